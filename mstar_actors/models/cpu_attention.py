"""Decode attention on CPU straight from the paged KV cache (float32).

Why: the torch reference (``TorchPagedAttention``) first copies every
decode sequence's pages into one padded tensor, then runs SDPA on it, per
layer; at decode sizes the copy and the calls cost more than the
arithmetic (``tools/profile_step.py --split`` shows attention's share).
The kernel here (``KERNEL_SOURCE``) reads each key and value where it lies
in its block: per (sequence, query head) the scores of its context, their
softmax, then the weighted sum of values, in float32. Grouped K/V heads are
read once per query head that shares them. Prefill chunks, graphed and
varlen steps keep the reference path.

Built and cached like ``cpu_linear``'s kernel; without it (no AVX-512, no
compiler, a failed self-check) the reference runs. Results equal SDPA's to
float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_linear
from .attention import AttentionMetadata, TorchPagedAttention


KERNEL_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* A dot product over D floats: 16 lanes at a time, the tail masked. */
static inline float dot(const float *a, const float *b, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    if (d < D) {
        __mmask16 m = (__mmask16)((1u << (D - d)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* out[b][h][:] = softmax(scale * q[b][h] . K[b]) V[b] for one query per
   sequence b. kv: [2][num_cache_blocks][bs][KH][D] (keys, then values);
   tables: [B][max_nb] block ids; lens: [B] context lengths (>= 1).
   q, out: [B][H][D] with row stride ldq / ldo floats between sequences. */
void decode_attention(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t D, const float *kv,
                      int64_t num_cache_blocks, int64_t bs, int64_t KH, const int64_t *tables, int64_t max_nb,
                      const int64_t *lens, float scale, float *out, int64_t ldo, int num_threads) {
    const int64_t group = H / KH, token = KH * D, half = num_cache_blocks * bs * token;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H, kh = h / group, len = lens[b];
        const float *qv = q + b * ldq + h * D;
        float *scores = (float *)malloc(sizeof(float) * len);
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            const float *k = kv + (tables[b * max_nb + t / bs] * bs + t % bs) * token + kh * D;
            float s = dot(qv, k, D) * scale;
            scores[t] = s;
            top = s > top ? s : top;
        }
        float total = 0;
        for (int64_t t = 0; t < len; t++) { scores[t] = expf(scores[t] - top); total += scores[t]; }
        float *o = out + b * ldo + h * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0;
        for (int64_t t = 0; t < len; t++) {
            const float *v = kv + half + (tables[b * max_nb + t / bs] * bs + t % bs) * token + kh * D;
            float p = scores[t] / total;
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
        free(scores);
    }
}
"""


# The same kernel on AVX2: only the dot product differs (8 lanes, a scalar tail).
KERNEL_SOURCE_AVX2 = KERNEL_SOURCE.replace(KERNEL_SOURCE[KERNEL_SOURCE.index("/* A dot product"):
                                                         KERNEL_SOURCE.index("/* out[b][h][:]")], r"""/* A dot product over D floats: 8 lanes at a time, then the tail. */
static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    float total = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    for (; d < D; d++) total += a[d] * b[d];
    return total;
}

""")


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built and self-checked library, or None (one warning says why)."""
    return cpu_linear.checked_library("cpu_attention", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE_AVX2}, declare=_declare, check=_check,
                                      what="cpu decode attention", when_off="decode attention gathers pages for SDPA")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_float, ptr,
                                     i64, ctypes.c_int]
    lib.decode_attention.restype = None


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H, D]`` (one query per sequence) against its pages -> ``[B, H, D]``.
    ``tables [B, nb]`` and ``lens [B]`` int64, contiguous."""
    two, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    lib.decode_attention(q.data_ptr(), q.stride(0), q.shape[0], q.shape[1], head_dim, kv_cache.data_ptr(),
                         num_cache_blocks, block_size, num_kv_heads, tables.data_ptr(), tables.shape[1],
                         lens.data_ptr(), scale, out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


def _check(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=gen)  # 6 blocks of 4 tokens, 2 KV heads of 8
    q = torch.randn(2, 4, 8, generator=gen)  # 2 sequences, 4 query heads
    tables, lens = torch.tensor([[5, 1, 3], [2, 4, 0]]), torch.tensor([11, 6])
    got = decode_attention(lib, q, cache, tables, lens, 0.3)
    for b in range(2):
        k, v = (cache[i][tables[b]].flatten(0, 1)[: lens[b]].transpose(0, 1) for i in (0, 1))  # [KH, len, D]
        want = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k.repeat_interleave(2, 0),
                                                                v.repeat_interleave(2, 0), scale=0.3)[:, 0]
        if not torch.allclose(got[b], want, rtol=1e-5, atol=1e-5):
            raise cpu_linear.KernelUnavailable("its self-check against SDPA failed")


class CpuPagedAttention(TorchPagedAttention):
    """The reference backend with decode rows on our kernel (CPU, float32, eager steps)."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lib = kernel()
        if (lib is None or meta.varlen_work is not None or meta.graph_decode or q.dtype != torch.float32
                or q.device.type != "cpu" or not kv_cache.is_contiguous()):
            return super().attend(q, kv_cache, meta, scale)
        decode = _decode_rows(meta)
        if decode is None:
            return super().attend(q, kv_cache, meta, scale)
        rows, tables, lens, is_all = decode
        if is_all:  # a pure decode step: every row is one sequence's query
            return decode_attention(lib, q, kv_cache, tables, lens, scale)
        out = torch.empty_like(q)
        out[rows] = decode_attention(lib, q[rows], kv_cache, tables, lens, scale)
        self._attend_chunks(q, kv_cache, meta, scale, out)
        return out


def _decode_rows(meta: AttentionMetadata):
    """``(rows, tables, lens, is_all)`` of the step's decode rows (None without any), once per step."""
    if "cpu_decode" in meta.derived:
        return meta.derived["cpu_decode"]
    seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    decode = None
    if seqs:
        num_blocks = max(meta.num_blocks_list[i] for i in seqs)
        index = torch.tensor(seqs, dtype=torch.long)
        tables = meta.block_tables[index, :num_blocks].long().contiguous()
        lens = meta.context_lens[index].long().contiguous()
        rows = torch.tensor([meta.query_start_list[i] for i in seqs], dtype=torch.long)
        decode = (rows, tables, lens, len(seqs) == sum(meta.query_lens_list))
    meta.derived["cpu_decode"] = decode
    return decode
