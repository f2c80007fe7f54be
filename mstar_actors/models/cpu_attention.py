"""Attention on CPU straight from the paged KV cache, one query row at a time (float32).

Why: the torch reference (``TorchPagedAttention``) first copies every
decode sequence's pages into one padded tensor, then runs SDPA on it, per
layer; at decode sizes the copy and the calls cost more than the
arithmetic (``tools/profile_step.py --split`` shows attention's share).
The kernel here (``KERNEL_SOURCE``) reads each key and value where it lies
in its block: per (sequence, K/V head) the query heads that share that head
score a tile of keys, rescale their running softmax, and sum in the tile's
values, in float32; so each key and value is read once per step and layer,
and no buffer grows with the context. A prefill chunk's rows take it too,
each against its causal prefix (faster here than SDPA with a causal mask
on a copy of the pages, at tens of rows as at thousands); graphed and
varlen steps keep the reference path.

One C source (plain vectors of 8 floats) built for AVX-512 and AVX2 alike,
cached and self-checked like ``cpu_linear``'s kernels; without it (neither
instruction set, no compiler, a failed self-check) the reference runs.
Results equal SDPA's to float32 rounding (another summation order).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_linear, cpu_ops
from .attention import AttentionMetadata, TorchPagedAttention


KERNEL_SOURCE = cpu_ops.VECTORS + r"""
#define TILE 32       /* keys scored before their values are summed (a softmax rescale per tile) */
#define MAX_GROUP 16  /* query heads per K/V head in one pass over the keys */
#define MIN_PARALLEL_WORK (1 << 16)  /* multiply-adds below which a fork and join cost about what a second thread saves */

/* s[j] = q . k[j] over D floats for 4 keys: 4 independent chains, q loaded once for all. */
static inline void dot4(const float *q, const float *const *k, int64_t D, float *s) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        v8 x = load8(q + d);
        a0 += x * load8(k[0] + d); a1 += x * load8(k[1] + d); a2 += x * load8(k[2] + d); a3 += x * load8(k[3] + d);
    }
    float t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (; d < D; d++) { t0 += q[d] * k[0][d]; t1 += q[d] * k[1][d]; t2 += q[d] * k[2][d]; t3 += q[d] * k[3][d]; }
    s[0] = t0 + sum8(a0); s[1] = t1 + sum8(a1); s[2] = t2 + sum8(a2); s[3] = t3 + sum8(a3);
}

static inline float dot(const float *q, const float *k, int64_t D) {
    v8 a = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) a += load8(q + d) * load8(k + d);
    float t = 0;
    for (; d < D; d++) t += q[d] * k[d];
    return t + sum8(a);
}

/* o[:D] = o * c + sum_i p[i] v[i][:D] over n value rows v[i]: 64 floats a
   pass where they fit (8 chains of FMAs in flight, as many as keep both FMA
   units busy), then 8 at a time, then the tail. */
static inline void accumulate(float *o, float c, const float *p, const float *const *v, int64_t n, int64_t D) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        v8 a0 = load8(o + d) * c, a1 = load8(o + d + 8) * c, a2 = load8(o + d + 16) * c, a3 = load8(o + d + 24) * c;
        v8 a4 = load8(o + d + 32) * c, a5 = load8(o + d + 40) * c, a6 = load8(o + d + 48) * c, a7 = load8(o + d + 56) * c;
        for (int64_t i = 0; i < n; i++) {
            const float *vi = v[i] + d;
            a0 += p[i] * load8(vi); a1 += p[i] * load8(vi + 8); a2 += p[i] * load8(vi + 16); a3 += p[i] * load8(vi + 24);
            a4 += p[i] * load8(vi + 32); a5 += p[i] * load8(vi + 40); a6 += p[i] * load8(vi + 48); a7 += p[i] * load8(vi + 56);
        }
        store8(o + d, a0); store8(o + d + 8, a1); store8(o + d + 16, a2); store8(o + d + 24, a3);
        store8(o + d + 32, a4); store8(o + d + 40, a5); store8(o + d + 48, a6); store8(o + d + 56, a7);
    }
    for (; d + 8 <= D; d += 8) {
        v8 a = load8(o + d) * c;
        for (int64_t i = 0; i < n; i++) a += p[i] * load8(v[i] + d);
        store8(o + d, a);
    }
    for (; d < D; d++) {
        float a = o[d] * c;
        for (int64_t i = 0; i < n; i++) a += p[i] * v[i][d];
        o[d] = a;
    }
}

/* G query heads (q, o: [G][D]) that share one K/V head, against len keys:
   a tile's keys are scored, the running softmax of each head rescaled to the
   tile's new maximum, then its values summed in; o is divided by the
   softmax's total at the end. key[t] and key[t] + half are token t's key
   and value. */
static void attend_group(const float *q, float *o, int64_t G, int64_t D, const float *kv, int64_t half,
                         int64_t token, int64_t kh, const int64_t *table, int64_t bs, int64_t len, float scale) {
    float top[MAX_GROUP], total[MAX_GROUP], p[MAX_GROUP][TILE];
    const float *key[TILE], *value[TILE];
    for (int64_t g = 0; g < G; g++) { top[g] = -INFINITY; total[g] = 0; }
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t i = 0; i < n; i++) {
            int64_t t = t0 + i;
            key[i] = kv + (table[t / bs] * bs + t % bs) * token + kh * D;
            value[i] = key[i] + half;
        }
        for (int64_t g = 0; g < G; g++) {
            float m = top[g];
            int64_t i = 0;
            for (; i + 4 <= n; i += 4) dot4(q + g * D, key + i, D, p[g] + i);
            for (; i < n; i++) p[g][i] = dot(q + g * D, key[i], D);
            for (i = 0; i < n; i++) {
                p[g][i] *= scale;
                m = p[g][i] > m ? p[g][i] : m;
            }
            float c = expf(top[g] - m), sum = 0;  /* 0 on the first tile: nothing to rescale */
            int64_t i8 = 0;
            for (; i8 + 8 <= n; i8 += 8) store8(p[g] + i8, exp8(load8(p[g] + i8) - m));
            for (; i8 < n; i8++) p[g][i8] = expf(p[g][i8] - m);
            for (i = 0; i < n; i++) sum += p[g][i];
            if (t0 == 0) memset(o + g * D, 0, sizeof(float) * D);
            accumulate(o + g * D, c, p[g], value, n, D);
            top[g] = m;
            total[g] = total[g] * c + sum;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.0f / total[g];
        for (int64_t d = 0; d < D; d++) o[g * D + d] *= inv;
    }
}

/* out[b][h][:] = softmax(scale * q[b][h] . K[b]) V[b] for one query per
   sequence b. kv: [2][num_cache_blocks][bs][KH][D] (keys, then values);
   tables: [B][max_nb] block ids; lens: [B] context lengths (>= 1).
   q, out: [B][H][D] with row stride ldq / ldo floats between sequences.
   One work item per (sequence, K/V head), its query heads read its keys
   and values once; threads only where the work pays for them. */
void decode_attention(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t D, const float *kv,
                      int64_t num_cache_blocks, int64_t bs, int64_t KH, const int64_t *tables, int64_t max_nb,
                      const int64_t *lens, float scale, float *out, int64_t ldo, int num_threads) {
    const int64_t group = H / KH, token = KH * D, half = num_cache_blocks * bs * token;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += lens[b];
    work *= H * D;
    if (work < MIN_PARALLEL_WORK || B * KH < 2) num_threads = 1;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < B * KH; item++) {
        int64_t b = item / KH, kh = item % KH;
        for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
            int64_t G = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP, h = kh * group + g0;
            attend_group(q + b * ldq + h * D, out + b * ldo + h * D, G, D, kv, half, token, kh,
                         tables + b * max_nb, bs, lens[b], scale);
        }
    }
}
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built and self-checked library, or None (one warning says why)."""
    return cpu_linear.checked_library("cpu_attention", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE},
                                      declare=_declare, check=_check,
                                      what="cpu decode attention", when_off="decode attention gathers pages for SDPA")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_float, ptr,
                                     i64, ctypes.c_int]
    lib.decode_attention.restype = None


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H, D]`` float32 (one query per sequence) against its pages -> ``[B, H, D]``.
    ``tables [B, nb]`` and ``lens [B]`` int64, contiguous. Shapes and strides
    are read once and handed to torch as ints (``cpu_ops`` says why)."""
    _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, num_heads, _ = q.shape
    q_stride, head_stride, one = q.stride()
    if one != 1 or head_stride != head_dim:
        q, q_stride = q.contiguous(), num_heads * head_dim
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    lib.decode_attention(q.data_ptr(), q_stride, num_seqs, num_heads, head_dim, kv_cache.data_ptr(), num_cache_blocks,
                         block_size, num_kv_heads, tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale,
                         out.data_ptr(), num_heads * head_dim, torch.get_num_threads())
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
    """The reference backend with every row of an eager step on our kernel
    (CPU, float32): a decode row against its sequence's whole context, row
    ``j`` of a prefill chunk against its causal prefix. A row's arithmetic
    is the same whichever rows share its step (decode rows, chunks, adapter
    rows or none: ``cpu_stack`` runs the same call)."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lib = kernel()
        if (lib is None or meta.varlen_work is not None or meta.graph_decode or q.dtype is not torch.float32
                or not q.is_cpu or not kv_cache.is_contiguous()):
            return super().attend(q, kv_cache, meta, scale)
        tables, lens = row_contexts(meta)
        return decode_attention(lib, q, kv_cache, tables, lens, scale)


def row_contexts(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's block table ``[T, W]`` and the tokens it attends
    ``[T]`` (int64, contiguous): a decode row its whole context, row ``j``
    of a chunk of ``n`` rows its context less the ``n - 1 - j`` rows after
    it. Made once per step (``meta.derived``): every layer reuses it."""
    if "cpu_rows" in meta.derived:
        return meta.derived["cpu_rows"]
    tables, lens = meta.block_tables.long(), meta.context_lens.long()
    num_rows = sum(meta.query_lens_list)
    if num_rows != meta.num_seqs:  # prefill chunks: a row per query, each its own length
        seq_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs),
                                             torch.tensor(meta.query_lens_list, dtype=torch.long))
        ends = meta.query_start[1:].long()[seq_of_row]
        tables, lens = tables[seq_of_row], lens[seq_of_row] - ends + torch.arange(1, num_rows + 1)
    meta.derived["cpu_rows"] = (tables, lens)
    return tables, lens
