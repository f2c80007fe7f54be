"""The shared decoder's layer stack on CPU in one C call (``decoder_stack``).

Why: at decode sizes each layer is about a dozen small kernel calls (two
norms, four linears, rotary with the KV write, attention, SiLU), and on
CPU the Python around them (module calls, views, each call's argument
checks and ``ctypes`` conversions) costs about as much as the norms,
rotary and attention themselves: several ms a SmolLM2 step of 30 layers.
Here the whole stack, the final norm included, is one ``ctypes`` call;
what it needs from the weights (pointers, shapes) is gathered once
(``StackPlan``) and only the step's own arrays are passed per call.

The C here (``KERNEL_SOURCE``) orchestrates and computes nothing itself:
it calls the same compiled kernels the Python path calls (``cpu_ops``,
``cpu_linear``, ``cpu_quant``, ``cpu_attention``), through their addresses,
with the same arguments, so a step's hidden states and KV cache equal the
Python path's bit for bit, decode rows and prefill chunks alike. Adapter
rows are its own work: each linear's LoRA delta (``lora_delta``) is added
in C, the rows of one slot together, within float32 rounding of the
Python path's GEMMs. Why: there a step with adapter rows runs every layer
through Python and each delta as a few torch calls a linear, about 12 ms
more than the base's 22 of a one-row SmolLM2 step (``tools/bench_lora.py``
on 2 cores: one adapter at c=1 62% of LoRA off's tokens/s that way, 93-95%
here). Prompts too: a SmolLM2 prefill of 7 x 37 prompt rows on four adapters
took 241 ms here against 387 there (base 205), of 7 x 292 rows 2.39 s against
2.94 (base 2.05 s; the Python path's deltas gather each adapter's rows).
Under quantized linears the delta reads its factors in bfloat16
(``LoraStack.keep_half``, which rounds the Python path's to the same values):
a step reads all of each adapter's factors, and in float32 a SmolLM2
adapter's were a quarter of an int4 step's bytes.

Taken by ``CausalLM``s of the shared decoder (Llama, Qwen2; not per-head
q/k norms), one rank, every linear on our float32 blocks or quantized
codes, CPU float32 rows with 1-D positions, base-only or with adapter rows
by host slots; everything else, decided per step by a few attribute tests,
runs the Python path (``CausalLM.run_layers``).
``install`` puts it in front of a model's ``run_layers``.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import nn

from mstar_actors.lora.ops import LoraStack, delta_rows_ref

from . import cpu_attention, cpu_linear, cpu_ops, cpu_quant
from .attention import AttentionMetadata
from .decoder import CausalLM, DecoderLayer, DecoderModel, LoraLinear, RMSNorm
from .rope import RotaryEmbedding

log = logging.getLogger(__name__)

KERNEL_SOURCE = cpu_ops.VECTORS + r"""
#include <immintrin.h>
#include <stdlib.h>

/* The kernels' signatures (cpu_linear, cpu_quant, cpu_ops, cpu_attention). */
typedef void (*linear_f32_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, const float *,
                              float *, int);
typedef void (*linear_quant_fn)(int, int, const float *, int64_t, int64_t, int64_t, const uint8_t *, const float *,
                                const float *, int64_t, const float *, float *, int);
typedef void (*add_rms_norm_fn)(const float *, int64_t, float *, int64_t, const float *, float *, int64_t, int64_t,
                                int64_t, float);
typedef void (*rope_write_kv_fn)(float *, int64_t, int64_t, float *, int64_t, const float *, int64_t, int64_t,
                                 int64_t, int64_t, const float *, const float *, float *, int64_t, const int64_t *);
typedef void (*silu_mul_fn)(const float *, int64_t, float *, int64_t, int64_t, int64_t);
typedef void (*decode_attention_fn)(const float *, int64_t, int64_t, int64_t, int64_t, const float *, int64_t,
                                    int64_t, int64_t, const int64_t *, int64_t, const int64_t *, float, float *,
                                    int64_t, int);

/* One linear: bits 0 is a float32 weight in cpu_linear's blocks (weight),
   8 or 4 cpu_quant's codes (weight), scales and mins; dot: int4 codes in
   the integer-dot layout. bias may be null. Its LoRA stack (ops.LoraStack;
   lora_a null: none): a [shards][slots][rank][in], bt [slots][rank][out] (B transposed),
   float32, or bfloat16 where lora_half (LoraStack.keep_half), scales [shards][slots],
   shard i's outputs [offsets[i], offsets[i + 1]). */
typedef struct {
    int64_t bits, dot, in_features, out_features;
    const void *weight;
    const float *scale, *minv, *bias;
    const void *lora_a, *lora_bt;
    const float *lora_scales;
    const int64_t *lora_offsets;
    int64_t lora_shards, lora_slots, lora_rank, lora_half;
} linear_desc;

typedef struct {
    linear_desc qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
} layer_desc;

typedef struct {
    linear_f32_fn linear_f32;
    linear_quant_fn linear_quant;
    add_rms_norm_fn add_rms_norm;
    rope_write_kv_fn rope_write_kv;
    silu_mul_fn silu_mul;
    decode_attention_fn decode_attention;
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const layer_desc *layers;
    const float *final_norm;
} stack_desc;

int64_t stack_desc_size(void) { return sizeof(stack_desc); }

/* y[M][out] = x[M][in] (contiguous rows) through one linear. */
static void linear(const stack_desc *s, const linear_desc *l, const float *x, int64_t M, float *y, int num_threads) {
    if (l->bits == 0)
        s->linear_f32(x, M, l->in_features, l->in_features, (const float *)l->weight, l->out_features, l->bias, y,
                      num_threads);
    else
        s->linear_quant((int)l->bits, (int)l->dot, x, M, l->in_features, l->in_features, (const uint8_t *)l->weight,
                        l->scale, l->minv, l->out_features, l->bias, y, num_threads);
}

#define LORA_PARALLEL 8192  /* multiply-adds from which a delta takes the threads */
#define LORA_COLS 256  /* outputs an expand's chunk: its rows of y stay in the first cache */
#define LORA_ROW_BLOCK 64  /* rows a block of the shrink: its inputs stay in the second cache over A's rows */
#define INLINE static inline __attribute__((always_inline))

/* Factors k..k+7 of an array of float32, or of bfloat16 where half (a bfloat16's bits are its
   float's upper half). The functions after it take half, and their tile's row count, as constants
   at each call (the branches of each call site in lora_delta), so each is inlined once per case,
   its loops for the one type and its accumulators in registers: a variable there (a parallel
   region's) would leave them scalar. */
INLINE v8 factor8(const void *p, int64_t k, int half) {
    if (!half) return load8((const float *)p + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));  /* one widening move */
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}
INLINE float factor(const void *p, int64_t k, int half) {
    if (!half) return ((const float *)p)[k];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[k] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
INLINE const void *factor_row(const void *p, int64_t index, int half) {
    return (const char *)p + index * (half ? 2 : 4);
}

/* The shrink of NG <= 2 rows (xs) on four rows of A (ar, A's rows ir..ir + 3; past W, nr < 4, the
   last repeated and not stored): work[g * W + ir + j] = scale[j] * (x[g] . A[ir + j]). Each A
   vector is loaded once for the tile's rows, each x vector once for its four rows of A. */
INLINE void lora_shrink_tile(const float *const *xs, int64_t in, const void *const *ar, const float *scale,
                             float *const *out, int nr, int NG, int half) {
    v8 acc[2][4] = {{{0}}};
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        const v8 f0 = factor8(ar[0], k, half), f1 = factor8(ar[1], k, half), f2 = factor8(ar[2], k, half),
                 f3 = factor8(ar[3], k, half);
        for (int g = 0; g < NG; g++) {
            const v8 xv = load8(xs[g] + k);
            acc[g][0] += xv * f0;
            acc[g][1] += xv * f1;
            acc[g][2] += xv * f2;
            acc[g][3] += xv * f3;
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < nr; j++) {
            float t = sum8(acc[g][j]);
            for (int64_t kk = k; kk < in; kk++) t += xs[g][kk] * factor(ar[j], kk, half);
            out[g][j] = t * scale[j];
        }
}

/* yr[g][n] += sum over r of coef[g][r] * bt[r * out + n] for n in [lo, hi), NG <= 4 rows: blocks of
   16 outputs of every row held in registers while every rank's product is added, in rank order
   (each B vector loaded once for the rows); then 8 at a time, then the tail. */
INLINE void lora_expand_tile(float *const *yr, const float *const *coef, const void *bt, int64_t out, int64_t R,
                             int64_t lo, int64_t hi, int NG, int half) {
    int64_t n = lo;
    for (; n + 16 <= hi; n += 16) {
        v8 acc[4][2];
        for (int g = 0; g < NG; g++) {
            acc[g][0] = load8(yr[g] + n);
            acc[g][1] = load8(yr[g] + n + 8);
        }
        for (int64_t r = 0; r < R; r++) {
            const void *br = factor_row(bt, r * out + n, half);
            const v8 b0 = factor8(br, 0, half), b1 = factor8(br, 8, half);
            for (int g = 0; g < NG; g++) {
                const v8 c = broadcast8(coef[g][r]);
                acc[g][0] += c * b0;
                acc[g][1] += c * b1;
            }
        }
        for (int g = 0; g < NG; g++) {
            store8(yr[g] + n, acc[g][0]);
            store8(yr[g] + n + 8, acc[g][1]);
        }
    }
    for (int g = 0; g < NG; g++) {
        int64_t m = n;
        for (; m + 8 <= hi; m += 8) {
            v8 a = load8(yr[g] + m);
            for (int64_t r = 0; r < R; r++) a += broadcast8(coef[g][r]) * factor8(factor_row(bt, r * out + m, half), 0, half);
            store8(yr[g] + m, a);
        }
        for (; m < hi; m++) {
            float a = yr[g][m];
            for (int64_t r = 0; r < R; r++) a += coef[g][r] * factor(bt, r * out + m, half);
            yr[g][m] = a;
        }
    }
}

/* y[m] += the LoRA delta of row m's adapter (row_slots[m]; 0: the base, none),
   as LoraStack's: per shard i, scale[i][s] * (x[m] . A[i][s][r] for each r) times
   B[s][n] for n in the shard's outputs. The rows of one slot together, in
   register tiles (lora_shrink_tile, lora_expand_tile); one parallel region,
   a slot at a time: its shrink over groups of four rows of A, then its expand
   over chunks of outputs, which the next slot's shrink does not wait for (the
   slots' rows, and their rows of work, are apart).
   work: M * shards * rank floats, M indices. */
static void lora_delta(const linear_desc *l, const float *x, int64_t M, float *y, const int64_t *row_slots,
                       float *work, int64_t *rows, int num_threads) {
    const int64_t in = l->in_features, out = l->out_features, R = l->lora_rank, S = l->lora_slots;
    const int64_t NS = l->lora_shards, W = NS * R;
    const int half = l->lora_half != 0;
    if (!row_slots || !l->lora_a) return;
    int64_t starts[S + 1];  /* slot s's rows: rows[starts[s] .. starts[s + 1]), in order */
    int64_t total = 0;
    for (int64_t s = 0; s < S; s++) {
        starts[s] = total;
        int targeted = 0;  /* an adapter that leaves this linear alone (every scale 0) adds nothing */
        for (int64_t i = 0; i < NS; i++) targeted |= l->lora_scales[i * S + s] != 0.0f;
        if (s == 0 || !targeted) continue;
        for (int64_t m = 0; m < M; m++)
            if (row_slots[m] == s) rows[total++] = m;
    }
    starts[S] = total;
    if (!total) return;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && total * (W * in + R * out) >= LORA_PARALLEL)
    for (int64_t s = 1; s < S; s++) {
        const int64_t G = starts[s + 1] - starts[s];
        if (!G) continue;  /* every thread alike: the same loops meet the same worksharing */
        const int64_t *const srows = rows + starts[s];
        float *const swork = work + starts[s] * W;
        const void *bt = factor_row(l->lora_bt, s * R * out, half);
        for (int64_t g0 = 0; g0 < G; g0 += LORA_ROW_BLOCK) {  /* a block of rows at a time: its x stays cached */
            const int64_t g1 = g0 + LORA_ROW_BLOCK < G ? g0 + LORA_ROW_BLOCK : G;
            #pragma omp for schedule(static)
            for (int64_t ir = 0; ir < W; ir += 4) {
                const int nr = W - ir < 4 ? (int)(W - ir) : 4;
                const void *ar[4];
                float scale[4];
                for (int j = 0; j < 4; j++) {
                    const int64_t a_row = ir + (j < nr ? j : nr - 1), i = a_row / R;
                    ar[j] = factor_row(l->lora_a, ((i * S + s) * R + a_row % R) * in, half);
                    scale[j] = l->lora_scales[i * S + s];
                }
                for (int64_t g = g0; g < g1; g += 2) {
                    const float *xs[2] = {x + srows[g] * in, x + srows[g + (g + 1 < g1)] * in};
                    float *dst[2] = {swork + g * W + ir, swork + (g + 1) * W + ir};
                    if (g + 1 < g1) {
                        if (half) lora_shrink_tile(xs, in, ar, scale, dst, nr, 2, 1);
                        else lora_shrink_tile(xs, in, ar, scale, dst, nr, 2, 0);
                    } else {
                        if (half) lora_shrink_tile(xs, in, ar, scale, dst, nr, 1, 1);
                        else lora_shrink_tile(xs, in, ar, scale, dst, nr, 1, 0);
                    }
                }
            }
        }
        /* B transposed, [rank][out]: a block of outputs of up to four rows held while every rank's
           row is scaled into it (y read and written once, not once a rank); no barrier at its end,
           the region's own joins the threads */
        #pragma omp for schedule(static) nowait
        for (int64_t c = 0; c < out; c += LORA_COLS) {
            const int64_t end = c + LORA_COLS < out ? c + LORA_COLS : out;
            for (int64_t i = 0; i < NS; i++) {
                const int64_t lo = l->lora_offsets[i] > c ? l->lora_offsets[i] : c;
                const int64_t hi = l->lora_offsets[i + 1] < end ? l->lora_offsets[i + 1] : end;
                for (int64_t g = 0; g < G && lo < hi; g += 4) {
                    float *yr[4];
                    const float *coef[4];
                    const int ng = G - g < 4 ? (int)(G - g) : 4;
                    for (int j = 0; j < ng; j++) {
                        yr[j] = y + srows[g + j] * out;
                        coef[j] = swork + (g + j) * W + i * R;
                    }
                    #define LORA_EXPAND(NG) \
                        (half ? lora_expand_tile(yr, coef, bt, out, R, lo, hi, NG, 1) \
                              : lora_expand_tile(yr, coef, bt, out, R, lo, hi, NG, 0))
                    switch (ng) {
                        case 4: LORA_EXPAND(4); break;
                        case 3: LORA_EXPAND(3); break;
                        case 2: LORA_EXPAND(2); break;
                        default: LORA_EXPAND(1);
                    }
                    #undef LORA_EXPAND
                }
            }
        }
    }
}

/* lora_delta alone, for the self-check and tests. */
void linear_lora_delta(const linear_desc *l, const float *x, int64_t M, float *y, const int64_t *row_slots,
                       float *work, int64_t *rows, int num_threads) {
    lora_delta(l, x, M, y, row_slots, work, rows, num_threads);
}

/* The decoder's layers and final norm on T rows x [T][hidden] (the
   embedded tokens; not written): out [T][hidden] = norm(the residual
   stream after the last layer). Row t is at rotary tables cos, ssin
   [T][head_dim], writes its key and value at slots[t] of every layer's
   cache (caches[l]: [2][num_cache_blocks][block_size][KH][D]) and attends
   to the first lens[t] tokens of its sequence's blocks tables[t]
   ([T][max_nb]; cpu_attention.row_contexts). Each step is the Python path's call, in its order, on
   the same arguments: residual sums land in the sublayers' outputs. row_slots [T] (null: a
   base-only step): each row's LoRA slot, whose delta each linear adds (lora_delta) where the
   Python path adds its own, in another order of sums.
   Returns 0, or -1 where its buffers could not be allocated. */
int decoder_stack(const stack_desc *s, const float *x, int64_t T, const float *cos, const float *ssin,
                   const int64_t *slots, float *const *caches, int64_t num_cache_blocks, int64_t block_size,
                   const int64_t *tables, int64_t max_nb, const int64_t *lens, const int64_t *row_slots,
                   int64_t max_width, float *out, int num_threads) {
    const int64_t H = s->hidden, D = s->head_dim, NH = s->num_heads, KH = s->num_kv_heads, I = s->intermediate;
    const int64_t qkv_n = (NH + 2 * KH) * D, attn_n = NH * D;
    float *buffer = (float *)malloc(sizeof(float) * T * (3 * H + qkv_n + attn_n + 3 * I));
    float *work = row_slots ? (float *)malloc(sizeof(float) * T * max_width) : 0;  /* lora_delta's */
    int64_t *rows = row_slots ? (int64_t *)malloc(sizeof(int64_t) * T) : 0;
    if (!buffer || (row_slots && (!work || !rows))) {
        free(buffer);
        free(work);
        free(rows);
        return -1;
    }
    float *normed = buffer, *sums[2] = {buffer + T * H, buffer + 2 * T * H};
    float *qkv = buffer + 3 * T * H, *attn = qkv + T * qkv_n, *gate_up = attn + T * attn_n, *act = gate_up + 2 * T * I;
    const float *residual = x;
    float *sublayer = 0;  /* the last sublayer's output, not yet added into the residual stream */
    int next = 0;  /* the sums buffer that does not hold the residual stream */
    for (int64_t l = 0; l < s->num_layers; l++) {
        const layer_desc *layer = s->layers + l;
        if (l == 0) {
            s->add_rms_norm(x, H, 0, 0, layer->input_norm, normed, H, T, H, s->eps);
        } else {
            s->add_rms_norm(residual, H, sublayer, H, layer->input_norm, normed, H, T, H, s->eps);
            residual = sublayer;
        }
        linear(s, &layer->qkv, normed, T, qkv, num_threads);
        lora_delta(&layer->qkv, normed, T, qkv, row_slots, work, rows, num_threads);
        s->rope_write_kv(qkv, qkv_n, NH, qkv + NH * D, qkv_n, qkv + (NH + KH) * D, qkv_n, KH, D, T, cos, ssin,
                         caches[l], num_cache_blocks * block_size, slots);
        s->decode_attention(qkv, qkv_n, T, NH, D, caches[l], num_cache_blocks, block_size, KH, tables, max_nb, lens,
                            s->scale, attn, attn_n, num_threads);
        sublayer = sums[next];
        next ^= 1;
        linear(s, &layer->o, attn, T, sublayer, num_threads);
        lora_delta(&layer->o, attn, T, sublayer, row_slots, work, rows, num_threads);
        s->add_rms_norm(residual, H, sublayer, H, layer->post_norm, normed, H, T, H, s->eps);
        residual = sublayer;
        linear(s, &layer->gate_up, normed, T, gate_up, num_threads);
        lora_delta(&layer->gate_up, normed, T, gate_up, row_slots, work, rows, num_threads);
        s->silu_mul(gate_up, 2 * I, act, I, T, I);
        sublayer = sums[next];
        next ^= 1;
        linear(s, &layer->down, act, T, sublayer, num_threads);
        lora_delta(&layer->down, act, T, sublayer, row_slots, work, rows, num_threads);
    }
    s->add_rms_norm(residual, H, sublayer, H, s->final_norm, out, H, T, H, s->eps);
    free(buffer);
    free(work);
    free(rows);
    return 0;
}
"""


class LinearDesc(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int64), ("dot", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("out_features", ctypes.c_int64), ("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("minv", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("lora_a", ctypes.c_void_p),
                ("lora_bt", ctypes.c_void_p), ("lora_scales", ctypes.c_void_p), ("lora_offsets", ctypes.c_void_p),
                ("lora_shards", ctypes.c_int64), ("lora_slots", ctypes.c_int64), ("lora_rank", ctypes.c_int64),
                ("lora_half", ctypes.c_int64)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]


class StackDesc(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("linear_f32", "linear_quant", "add_rms_norm", "rope_write_kv",
                                                      "silu_mul", "decode_attention")] + \
               [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                    "intermediate")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(LayerDesc)),
                ("final_norm", ctypes.c_void_p)]


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built library, or None (one warning says why). Its self-check is
    the struct layout; the kernels it calls are checked by their own modules."""
    return cpu_linear.checked_library("cpu_stack", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE}, declare=_declare,
                                      check=_check, what="cpu decoder stack",
                                      when_off="each layer runs its kernels through Python")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.stack_desc_size.argtypes, lib.stack_desc_size.restype = [], i64
    lib.decoder_stack.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr,
                                  ctypes.c_int]
    lib.decoder_stack.restype = ctypes.c_int
    lib.linear_lora_delta.argtypes = [ctypes.POINTER(LinearDesc), ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.linear_lora_delta.restype = None


def _check(lib: ctypes.CDLL) -> None:
    if lib.stack_desc_size() != ctypes.sizeof(StackDesc):
        raise cpu_linear.KernelUnavailable("its struct layout differs from the one Python writes")
    for half in (False, True):  # widths off the vector tiles, rows on two adapters and the base
        got, want = lora_delta(lib, *lora_case(13, [7, 19], 5, num_rows=7, half=half, seed=int(half)))
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise cpu_linear.KernelUnavailable(f"its LoRA delta ({'bfloat16' if half else 'float32'} factors) "
                                               f"is off the reference by {(got - want).abs().max().item():.3g}")


def lora_case(in_features: int, output_sizes: list[int], rank: int, *, num_rows: int, half: bool, seed: int):
    """A random ``LoraStack`` of three slots (two adapters), rows ``x`` and their
    slots (0, 1, 2 in turn), for ``lora_delta``: (stack, x, row_slots)."""
    gen = torch.Generator().manual_seed(seed)
    stack = LoraStack(in_features, output_sizes, num_slots=3, max_rank=rank)
    for slot in (1, 2):  # slot 0 is the base's: zero
        stack.a[:, slot].normal_(generator=gen)
        stack.b[slot].normal_(generator=gen)
        stack.scales[:, slot].uniform_(0.5, 2.0, generator=gen)
        stack.write_dense(slot)
    if half:
        stack.keep_half()
    x = torch.randn(num_rows, in_features, generator=gen)
    return stack, x, torch.arange(num_rows, dtype=torch.int64) % 3


def lora_delta(lib: ctypes.CDLL, stack: LoraStack, x: torch.Tensor, row_slots: torch.Tensor,
               num_threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(the C delta of ``row_slots``' adapters added to zeros, the torch reference's) for ``x``'s rows."""
    half = stack.half is not None
    a, bt = stack.half if half else (stack.a, stack.b_all)
    offsets = torch.tensor(stack.offsets, dtype=torch.int64)
    desc = LinearDesc(in_features=stack.in_features, out_features=stack.offsets[-1], lora_a=a.data_ptr(),
                      lora_bt=bt.data_ptr(), lora_scales=stack.scales.data_ptr(), lora_offsets=offsets.data_ptr(),
                      lora_shards=len(stack.output_sizes), lora_slots=stack.num_slots, lora_rank=stack.max_rank,
                      lora_half=int(half))
    num_rows = x.shape[0]
    got = torch.zeros(num_rows, stack.offsets[-1])
    work = torch.empty(num_rows, len(stack.output_sizes) * stack.max_rank)
    rows = torch.empty(num_rows, dtype=torch.int64)
    lib.linear_lora_delta(ctypes.byref(desc), x.data_ptr(), num_rows, got.data_ptr(), row_slots.data_ptr(),
                          work.data_ptr(), rows.data_ptr(), num_threads)
    return got, delta_rows_ref(torch.zeros_like(got), x, stack.a, stack.b, stack.scales, row_slots, stack.offsets)


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class PlanRefused(ValueError):
    """Why a model's layers can't take one C call (the message says what)."""


class StackPlan:
    """Everything ``decoder_stack`` reads that holds across steps: the
    kernels' addresses, the model's shape, and each layer's weights by
    address. It holds the tensors it points at, so they outlive it; it reads
    them as they are when it is made, so make it after the weights are
    final (quantized, packed, LoRA stacks built)."""

    def __init__(self, model: CausalLM):
        self.lib = kernel()
        if self.lib is None or cpu_ops.kernel() is None or cpu_attention.kernel() is None:
            raise PlanRefused("the stack's, the layer ops' or the attention's kernel did not build")
        spec, layers = model.spec, model.model.layers
        attn = layers[0].self_attn
        self.num_layers, self.hidden = len(layers), spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = layers[0].mlp.down_proj.in_features
        self.kept: list[torch.Tensor] = []  # what the descriptors point at
        norms = [model.model.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        eps = {n.eps for n in norms}
        if len(eps) != 1 or any(type(n) is not RMSNorm or n.zero_centered for n in norms):
            raise PlanRefused("its norms are not plain RMSNorms of one eps")
        self.hook = attn.qkv_proj.lora
        self.lora_a = None if self.hook is None else self.hook.stack.a.data_ptr()  # where the first stack's A was
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, LoraLinear)]
        if any(m.fused_weight is not None or (m.lora is None) != (self.hook is None)
               or (m.lora is not None and m.lora.step is not self.hook.step) for m in linears):
            raise PlanRefused("its linears' LoRA hooks do not share one step, or a stack is fused into a weight")
        self.has_float = self.has_quant = False  # which linear kernels the layers take (``_linear``)
        self.max_width = 0  # shards x rank, the widest LoRA stack's (``_lora``; 0: none)
        with torch.no_grad():
            self.layers = (LayerDesc * len(layers))(*(self._layer(layer) for layer in layers))
        self.desc = StackDesc(
            linear_f32=_address(cpu_linear.kernel(), "linear_f32") if self.has_float else None,
            linear_quant=_address(cpu_quant.kernel(), "linear_quant") if self.has_quant else None,
            add_rms_norm=_address(cpu_ops.kernel(), "add_rms_norm"),
            rope_write_kv=_address(cpu_ops.kernel(), "rope_write_kv"), silu_mul=_address(cpu_ops.kernel(), "silu_mul"),
            decode_attention=_address(cpu_attention.kernel(), "decode_attention"),
            num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=self.intermediate, eps=eps.pop(), scale=attn.scale,
            layers=self.layers, final_norm=self._keep(model.model.norm.weight.detach()))

    def _keep(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        if not tensor.is_contiguous() or tensor.dtype not in (torch.float32, torch.uint8, torch.bfloat16) or not tensor.is_cpu:
            raise PlanRefused(f"a weight is {tensor.dtype} on {tensor.device}, contiguous {tensor.is_contiguous()}")
        self.kept.append(tensor)
        return tensor.data_ptr()

    def _layer(self, layer: DecoderLayer) -> LayerDesc:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not DecoderLayer or attn.has_qk_norm or type(attn.rotary) is not RotaryEmbedding:
            raise PlanRefused("a layer has per-head q/k norms or a rotary of its own")
        if not isinstance(attn.backend, cpu_attention.CpuPagedAttention) or attn.tp.is_parallel or mlp.tp.is_parallel:
            raise PlanRefused("attention is not the CPU backend, or the layers are split across ranks")
        hidden, heads = self.hidden, self.num_heads * self.head_dim
        qkv = heads + 2 * self.num_kv_heads * self.head_dim
        return LayerDesc(qkv=self._linear(attn.qkv_proj, hidden, qkv), o=self._linear(attn.o_proj, heads, hidden),
                         gate_up=self._linear(mlp.gate_up_proj, hidden, 2 * self.intermediate),
                         down=self._linear(mlp.down_proj, self.intermediate, hidden),
                         input_norm=self._keep(layer.input_layernorm.weight.detach()),
                         post_norm=self._keep(layer.post_attention_layernorm.weight.detach()))

    def _linear(self, module: LoraLinear, in_features: int, out_features: int) -> LinearDesc:
        if (module.in_features, module.out_features) != (in_features, out_features):
            raise PlanRefused(f"a linear is {module.in_features} -> {module.out_features}, not the layers' "
                              f"{in_features} -> {out_features}")
        bias = self._keep(module.bias.detach()) if module.bias is not None else None
        shape = dict(in_features=in_features, out_features=out_features, bias=bias, **self._lora(module))
        if (quant := module.quant) is not None:
            if cpu_quant.kernel() is None:
                raise PlanRefused("the quantized linears' kernel did not build")
            self.has_quant = True
            codes, scale, minv = (self._keep(t) for t in (quant.codes, quant.scale, quant.min))
            return LinearDesc(bits=quant.bits, dot=int(quant.dot_layout), weight=codes, scale=scale, minv=minv, **shape)
        if not cpu_linear.packs_blocks() or not cpu_linear.is_packable(module.weight, module.weight):
            raise PlanRefused("a float linear is not on our packed kernel")
        module.packed = module.packed or cpu_linear.PackedWeight()
        blocks = module.packed.get(module.weight)
        if blocks.dim() != 3:  # oneDNN's layout
            raise PlanRefused("float linears are packed for oneDNN, not our kernel")
        self.has_float = True
        return LinearDesc(bits=0, dot=0, weight=self._keep(blocks), **shape)

    def _lora(self, module: LoraLinear) -> dict:
        """The linear's LoRA stack for ``lora_delta`` (none: no fields)."""
        if module.lora is None:
            return {}
        stack = module.lora.stack
        if stack.fused or stack.is_embedding or stack.b_all is None:
            raise PlanRefused("a LoRA stack is fused into its weight, an embedding's, or without its B transposed")
        self.max_width = max(self.max_width, len(stack.output_sizes) * stack.max_rank)
        offsets = torch.tensor(stack.offsets, dtype=torch.int64)
        self.kept.append(offsets)
        # A quantized linear's factors in bfloat16 (``LoraStack.keep_half``): half the bytes a step reads.
        half = module.quant is not None
        a, bt = stack.keep_half() if half else (stack.a, stack.b_all)
        return dict(lora_a=self._keep(a), lora_bt=self._keep(bt), lora_scales=self._keep(stack.scales),
                    lora_offsets=offsets.data_ptr(), lora_shards=len(stack.output_sizes), lora_slots=stack.num_slots,
                    lora_rank=stack.max_rank, lora_half=int(half))


class CpuDecoderStack:
    """``CausalLM.run_layers`` in one C call where a step fits (see the
    module docstring), else the model's own ``run_layers`` (``fallback``).

    LoRA: ``enable_lora`` gives every linear a hook, all sharing one step;
    the plan checked that and took each stack's factors. A step with adapter
    rows (segments set) passes each token row's slot (``LoraStep.token_slots``);
    one by device slots (row slots set) takes the fallback. A hook set on the
    first layer's qkv after the plan was made, or its stack's A moved, remakes
    the plan, which checks them again."""

    def __init__(self, model: CausalLM, plan: StackPlan, fallback):
        self.model = model
        self.plan = plan
        self.fallback = fallback
        self.qkv = model.model.layers[0].self_attn.qkv_proj
        self.rotary = model.model.layers[0].self_attn.rotary
        # (the list the runner passes, its first cache's address, the C array of every layer's, blocks, block size)
        self._caches: tuple[list[torch.Tensor], int, ctypes.Array, int, int] | None = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        if not self.takes(x, positions, meta) or not self._know_caches(kv_caches):
            return self.fallback(x, positions, kv_caches, meta)
        return self.run(x.contiguous(), positions, meta)

    def takes(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step fits one call: CPU float32 rows without autograd,
        1-D positions, an eager step (no static graph form), LoRA rows that
        ``_row_slots`` takes."""
        hook = self.qkv.lora
        if self.plan is None or hook is not self.plan.hook and not self._replan():
            return False
        # A stack's A that moved since the plan (fused under its weight) remakes it, which refuses that.
        if hook is not None and (hook.stack.a.data_ptr() != self.plan.lora_a and not self._replan()
                                 or self._row_slots(hook, x.shape[0]) is False):
            return False
        return (x.dtype is torch.float32 and x.is_cpu and x.dim() == 2 and positions.dim() == 1
                and not torch.is_grad_enabled() and meta.varlen_work is None and not meta.graph_decode)

    @staticmethod
    def _row_slots(hook, num_rows: int) -> torch.Tensor | None | bool:
        """The step's rows' LoRA slots for ``lora_delta``: None in a base-only
        step, False where the call does not take the step (rows by device slots)."""
        step = hook.step
        if step.row_slots is not None:
            return False
        if step.segments is None:
            return None
        slots = step.token_slots
        return slots if slots is not None and slots.shape[0] == num_rows else False

    def _replan(self) -> bool:
        try:
            self.plan = StackPlan(self.model)
        except PlanRefused as err:
            log.info("decoder stack: each layer runs through Python from now on (%s)", err)
            self.plan = None
        return self.plan is not None

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The C call on a step that ``takes``, once its caches are known (``_know_caches``)."""
        num_rows = x.shape[0]
        cos, signed_sin = self.rotary.tables(positions, torch.float32)
        tables, lens = cpu_attention.row_contexts(meta)
        slots = meta.slot_mapping
        if slots.dtype is not torch.int64 or not slots.is_contiguous():
            slots = slots.long().contiguous()
        _, _, pointers, num_cache_blocks, block_size = self._caches
        hook = self.qkv.lora
        row_slots = None if hook is None else self._row_slots(hook, num_rows)
        out = torch.empty(num_rows, self.plan.hidden, dtype=torch.float32)
        if self.plan.lib.decoder_stack(ctypes.byref(self.plan.desc), x.data_ptr(), num_rows, cos.data_ptr(),
                                       signed_sin.data_ptr(), slots.data_ptr(), pointers, num_cache_blocks, block_size,
                                       tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                       None if row_slots is None else row_slots.data_ptr(), self.plan.max_width,
                                       out.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"decoder stack: no memory for the buffers of a step of {num_rows} rows")
        return out

    def _know_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether the caches fit (every layer's one contiguous CPU float32
        shape of this model's KV heads); their addresses are taken again
        only when the list or its first tensor changes."""
        known = self._caches
        if known is not None and known[0] is kv_caches and known[1] == kv_caches[0].data_ptr():
            return True
        if len(kv_caches) != self.plan.num_layers:
            return False
        shape = kv_caches[0].shape
        if len(shape) != 5 or shape[3] != self.plan.num_kv_heads or shape[4] != self.plan.head_dim or any(
                c.shape != shape or c.dtype is not torch.float32 or not c.is_cpu or not c.is_contiguous()
                for c in kv_caches):
            return False
        pointers = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
        self._caches = (kv_caches, kv_caches[0].data_ptr(), pointers, shape[1], shape[2])
        return True


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s layers can't take one C call (None: they can)."""
    if not isinstance(model, CausalLM) or type(model.model) is not DecoderModel:
        return f"{type(model).__name__} is not the shared decoder"
    if model.layout.tp.is_parallel:
        return "its layers are split across ranks"
    if not all(p.is_cpu and p.dtype is torch.float32 for p in model.model.layers.parameters() if p.device.type != "meta"):
        return "its layers are not CPU float32"
    return None


def install(model: nn.Module) -> bool:
    """Put ``CpuDecoderStack`` in front of ``model.run_layers`` (an attribute
    of this instance: the class is untouched) where the model fits; True if
    it did. Call once the weights are final (``StackPlan``)."""
    reason = refusal(model)
    if reason is None:
        try:
            plan = StackPlan(model)
        except PlanRefused as err:
            reason = str(err)
    if reason is not None:
        log.info("decoder stack: each layer runs through Python (%s)", reason)
        return False
    fallback = model.run_layers
    if isinstance(fallback, CpuDecoderStack):  # installed before: the plan is remade, the stack replaced
        fallback = fallback.fallback
    model.run_layers = CpuDecoderStack(model, plan, fallback)
    log.info("decoder stack: CPU steps run all %d layers in one C call (adapter rows' deltas too)", plan.num_layers)
    return True
