"""A decoder layer's small float32 ops on CPU in single C calls: RMSNorm
(with the residual add before it), rotary on q and k with the KV-cache
write, and the MLP's ``silu(gate) * up``.

Why: at decode sizes (a few rows of 576 floats) these ops are all call
overhead. ``F.rms_norm`` is a composite of about eight torch kernels on CPU
(about 50 us a call on the 2-core VM, 61 calls a SmolLM2 step); rotary is
five kernels for q and five for k, then two ``index_copy_`` into the cache.
Each function here is one ``ctypes`` call of a few us.

Arithmetic: rotary and the cache write equal the torch path bit for bit
(products rounded, then summed, as torch does: built without contracting
them into FMAs). RMSNorm's sum of squares is taken in another order than
torch's, so its results equal ``F.rms_norm``'s to float32 rounding, not bit
for bit; the residual add is the same single addition. ``silu_mul`` takes
its exponential from ``VECTOR_EXP`` (within an ulp or two of ``expf``, as
torch's vectorised exp is), so it equals torch's to float32 rounding.

Built and cached like ``cpu_linear``'s kernels (one C source, plain
vectors of 8 floats, for AVX-512 and AVX2 machines alike); without it (no
compiler, a failed self-check) the callers keep their torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import cpu_linear
from .rope import rotate

# A fused linear's LoRA expand is added apart here (``triton_fused``'s take it as they load).
takes_expand = False

# Plain vectors of 8 floats (GCC's vector extensions, one source for every
# instruction set) and e^x on them, for the kernels here and ``cpu_attention``.
VECTORS = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }
static inline float sum8(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* e^x of 8 floats within about an ulp of expf: x = n ln2 + r (ln2 in two
   parts, so r is exact), e^r by Cephes' degree-5 polynomial on
   |r| <= ln2 / 2, times 2^n built in the exponent bits. x is clamped to
   [-87.3, 88.7] (e^x from 1e-38 to 3e38): no infinities, no denormals. */
static inline v8 broadcast8(float a) { return (v8){a, a, a, a, a, a, a, a}; }

static inline v8 exp8(v8 x) {
    x = select8(x < -87.3365f, broadcast8(-87.3365f), x);
    x = select8(x > 88.7228f, broadcast8(88.7228f), x);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 n = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
    n = select8(n > fx, n - 1.0f, n);  /* floor */
    v8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8 y = broadcast8(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return y * (v8)bits;
}
"""

KERNEL_SOURCE = VECTORS + r"""
/* Products are rounded before they are summed, as torch's separate kernels do. */
#pragma GCC optimize("fp-contract=off")

/* For each of M rows: h = x + res (stored back into res) where res is given,
   else h = x; out = w * (h * (1 / sqrt(mean(h^2) + eps))), in the order of
   the reference's two products. */
void add_rms_norm(const float *x, int64_t ldx, float *res, int64_t ldr, const float *w, float *out, int64_t ldo,
                  int64_t M, int64_t N, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float *h = res ? res + m * ldr : (float *)xm;
        float *o = out + m * ldo;
        v8 acc = {0};
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            v8 v = load8(xm + i);
            if (res) { v = v + load8(h + i); store8(h + i, v); }
            acc += v * v;
        }
        float total = 0;
        for (; i < N; i++) {
            float v = xm[i];
            if (res) { v = v + h[i]; h[i] = v; }
            total += v * v;
        }
        for (int j = 0; j < 8; j++) total += acc[j];
        float inv = 1.0f / sqrtf(total / (float)N + eps);
        for (i = 0; i < N; i++) o[i] = w[i] * (h[i] * inv);
    }
}

/* Rotate the H heads of one row in place: x * cos + rotate_half(x) * sin, the
   minus of rotate_half folded into ssin ((-sin, sin) halves). */
static inline void rotate_heads(float *x, int64_t H, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    float t[512];
    for (int64_t h = 0; h < H; h++) {
        float *xh = x + h * D;
        memcpy(t, xh, sizeof(float) * D);
        for (int64_t d = 0; d < half; d++) xh[d] = t[d] * c[d] + t[d + half] * s[d];
        for (int64_t d = half; d < D; d++) xh[d] = t[d] * c[d] + t[d - half] * s[d];
    }
}

/* T tokens: q [T][H][D] and k [T][KH][D] (row strides ldq, ldk; heads
   contiguous) rotated in place by cos and ssin [T][D]; then k and v
   (row stride ldv) written at slots[t] of cache [2][num_slots][KH][D]
   (keys, then values). A negative slot is a padding row: not written. */
void rope_write_kv(float *q, int64_t ldq, int64_t H, float *k, int64_t ldk, const float *v, int64_t ldv,
                   int64_t KH, int64_t D, int64_t T, const float *cos, const float *ssin, float *cache,
                   int64_t num_slots, const int64_t *slots) {
    const int64_t token = KH * D;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = ssin + t * D;
        rotate_heads(q + t * ldq, H, D, c, s);
        rotate_heads(k + t * ldk, KH, D, c, s);
        if (slots[t] < 0) continue;
        memcpy(cache + slots[t] * token, k + t * ldk, sizeof(float) * token);
        memcpy(cache + (num_slots + slots[t]) * token, v + t * ldv, sizeof(float) * token);
    }
}
/* For each of M rows of x [2N] (row stride ldx): out[:N] (row stride ldo) =
   silu(x[:N]) * x[N:], silu(g) = g / (1 + e^-g), in the reference's order. */
void silu_mul(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = x + m * ldx, *u = g + N;
        float *o = out + m * ldo;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            v8 gi = load8(g + i);
            store8(o + i, gi / (1.0f + exp8(-gi)) * load8(u + i));
        }
        for (; i < N; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
"""

MAX_HEAD_DIM = 512  # rotate_heads' buffer


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built and self-checked library, or None (one warning says why)."""
    return cpu_linear.checked_library("cpu_ops", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE}, declare=_declare,
                                      check=_check, what="cpu layer ops",
                                      when_off="RMSNorm, rotary, the KV write and SiLU run as torch ops")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.add_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float]
    lib.add_rms_norm.restype = None
    lib.rope_write_kv.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.rope_write_kv.restype = None
    lib.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
    lib.silu_mul.restype = None


# The wrappers below run several times per layer and step: they read each
# tensor's shape and strides once, and give torch ints, not a ``torch.Size``
# (``torch.empty(x.shape)`` and ``x.view(x.shape)`` take a slow path, several
# us a call on a small VM).


def takes(x: torch.Tensor) -> bool:
    """Whether ``x`` may take these ops: CPU float32 rows without autograd, the library built."""
    return x.is_cpu and x.dtype is torch.float32 and not torch.is_grad_enabled() and kernel() is not None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """``x`` as ``[M, N]`` rows of unit stride without a copy, with M, N and
    the rows' stride; None where that would take a copy."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None
    if rows is None:
        return None
    (num_rows, num_cols), (row_stride, col_stride) = rows.shape, rows.stride()
    if col_stride != 1 or (num_rows > 1 and row_stride < num_cols):
        return None
    return rows, num_rows, num_cols, row_stride


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = False, expand=None) -> torch.Tensor | None:
    """``F.rms_norm(x (+ residual), weight)`` in one call, or None where the
    rows don't fit (the caller then takes torch's path). With ``residual``
    (the shape of ``x``), ``residual += x`` first, in place: the sum is what
    is normalised. ``zero_centered``: the scale is ``1 + weight`` (in
    float32 the same products as the reference's). None where an
    ``expand`` is given (``triton_fused``'s takes one; here the caller adds it)."""
    if expand is not None:
        return None
    if zero_centered:
        weight = 1.0 + weight
    lib = kernel()
    rows = _rows(x)
    res = _rows(residual) if residual is not None else None
    if lib is None or rows is None or (residual is not None and res is None) or not weight.is_contiguous():
        return None
    rows, num_rows, num_cols, row_stride = rows
    out = torch.empty(num_rows, num_cols, dtype=torch.float32)
    lib.add_rms_norm(rows.data_ptr(), row_stride, None if res is None else res[0].data_ptr(),
                     0 if res is None else res[3], weight.data_ptr(), out.data_ptr(), num_cols, num_rows, num_cols, eps)
    return out if x.dim() == 2 else out.view(*x.shape)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.silu(gate) * up`` of ``gate_up [T, 2I]`` (its two halves) in one
    call, ``[T, I]``; None where the rows don't fit or a ``delta`` is given
    (``triton_fused``'s takes one; here the caller adds it)."""
    lib = kernel()
    rows = _rows(gate_up)
    if lib is None or rows is None or rows[2] % 2 or delta is not None:
        return None
    rows, num_rows, num_cols, row_stride = rows
    size = num_cols // 2
    out = torch.empty(num_rows, size, dtype=torch.float32)
    lib.silu_mul(rows.data_ptr(), row_stride, out.data_ptr(), size, num_rows, size)
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], size)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """Rotate ``q [T, H, D]`` and ``k [T, KH, D]`` in place by ``cos`` and
    ``signed_sin`` (``[T, 1, D]``, ``RotaryEmbedding.tables``), then write k
    and v at ``slot_mapping`` into ``kv_cache [2, blocks, block_size, KH, D]``
    (what ``TorchPagedAttention.write_kv`` does). False, having done
    nothing, where the tensors' layouts don't fit one call or a ``delta``
    is given (``triton_fused``'s takes one; here the caller adds it)."""
    if delta is not None:
        return False
    lib = kernel()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    (q_stride, q_head, q_one), (k_stride, k_head, k_one), (v_stride, v_head, v_one) = q.stride(), k.stride(), v.stride()
    if (lib is None or head_dim > MAX_HEAD_DIM or head_dim % 2 or not kv_cache.is_contiguous()
            or slot_mapping.dtype is not torch.int64 or not slot_mapping.is_contiguous()
            or not cos.is_contiguous() or not signed_sin.is_contiguous() or cos.shape[0] != num_tokens
            or q_one != 1 or k_one != 1 or v_one != 1 or q_head != head_dim or k_head != head_dim or v_head != head_dim
            or q.dtype is not torch.float32 or k.dtype is not torch.float32 or v.dtype is not torch.float32):
        return False
    _, num_blocks, block_size, _, _ = kv_cache.shape
    lib.rope_write_kv(q.data_ptr(), q_stride, num_heads, k.data_ptr(), k_stride, v.data_ptr(), v_stride, num_kv_heads,
                      head_dim, num_tokens, cos.data_ptr(), signed_sin.data_ptr(), kv_cache.data_ptr(),
                      num_blocks * block_size, slot_mapping.data_ptr())
    return True


def _check(lib: ctypes.CDLL) -> None:
    """Against torch: RMSNorm (with and without the residual) and SiLU to rounding, rotary and the cache write exactly."""
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(shape, generator=gen) for shape in ((3, 45), (3, 45), (45,)))
    want_sum = x + res
    out = torch.empty(3, 45)
    lib.add_rms_norm(x.data_ptr(), 45, res.data_ptr(), 45, w.data_ptr(), out.data_ptr(), 45, 3, 45, 1e-5)
    if not (torch.equal(res, want_sum) and torch.allclose(out, F.rms_norm(want_sum, (45,), w, 1e-5), rtol=1e-5, atol=1e-6)):
        raise cpu_linear.KernelUnavailable("its RMSNorm self-check against torch failed")
    qkv = torch.randn(3, 4 * 8 + 2 * 2 * 8, generator=gen)  # 3 tokens, 4 query heads, 2 KV heads of 8
    q, k, v = (t.view(3, -1, 8) for t in qkv.split([32, 16, 16], dim=-1))
    angles = torch.randn(3, 4, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    ssin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    want_q, want_k, want_v = rotate(q, cos, ssin), rotate(k, cos, ssin), v.clone()
    cache, slots = torch.zeros(2, 3, 2, 2, 8), torch.tensor([5, -1, 0])
    lib.rope_write_kv(q.data_ptr(), q.stride(0), 4, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), 2, 8, 3,
                      cos.data_ptr(), ssin.data_ptr(), cache.data_ptr(), 6, slots.data_ptr())
    flat = cache.view(2, 6, 2, 8)
    if not (torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(flat[0, 5], want_k[0])
            and torch.equal(flat[1, 0], want_v[2]) and not flat[:, [1, 2, 3, 4]].any()):
        raise cpu_linear.KernelUnavailable("its rotary and KV-write self-check against torch failed")
    gate_up = torch.randn(3, 2 * 21, generator=gen) * 8  # 21: a vector of 8 twice and a tail
    act = torch.empty(3, 21)
    lib.silu_mul(gate_up.data_ptr(), 42, act.data_ptr(), 21, 3, 21)
    if not torch.allclose(act, F.silu(gate_up[:, :21]) * gate_up[:, 21:], rtol=1e-5, atol=1e-6):
        raise cpu_linear.KernelUnavailable("its SiLU self-check against torch failed")
