"""Weight-only int8 and int4 linear layers on CPU (``model.quantization``).

Why: a decode step on CPU reads every weight once per step, and at a few
rows that read is the step's cost. int8 weights are a quarter of float32's
bytes, int4 an eighth (plus a float scale, and for int4 a float minimum,
per 32 weights).

The schemes are GGUF's, so a GGUF model's own quantization maps onto them
code for code:

- int8: groups of 32 along the input dimension, ``w = scale * q``, ``q`` in
  -127..127, ``scale = max|w| / 127`` (GGUF's Q8_0).
- int4: groups of 32, ``w = scale * q + min``, ``q`` in 0..15,
  ``min = min(w)``, ``scale = (max(w) - min(w)) / 15`` (GGUF's Q4_1).

Quantizing the dequantized float32 weights of a Q8_0 or Q4_1 tensor gives
back its codes exactly (each block holds the codes at both ends of its
range) and its scales to float32 rounding; ``tests/models/test_cpu_quant.py``
checks this against the embedded model's GGUF. (Q4_0 blocks are symmetric:
they requantize to the same values' nearest int4 codes, not always the same.)

The matmul is our AVX-512 kernel (``KERNEL_SOURCE``), in the layout of the
float32 one (``cpu_linear``): 32 output columns at a time, their codes
contiguous along the input dimension; codes become floats in registers
and are multiplied in float32 (at up to 4 rows a group's dot products are
scaled once: ``scale * sum(x q) + min * sum(x)``), so activations are never
quantized and results equal ``F.linear`` on the dequantized weight to
float32 rounding. Where the kernel does not build
(no AVX-512, no compiler), ``QuantizedWeight.linear`` dequantizes a group
of output columns at a time and calls ``F.linear``: right, slower.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import cpu_linear


GROUP = 32  # weights per scale, along the input dimension
BLOCK_N = cpu_linear.BLOCK_N  # output columns per packed block
QUANTIZATIONS = ("none", "int8", "int4", "int4_a8")

KERNEL_SOURCE = cpu_linear.BLOCK_ACCUMULATORS + r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK_N 32
#define GROUP 32
#define MAX_ROWS 8
#define ROWS_PER_CALL MAX_ROWS
#define FACTORED_ROWS 4
#define PREFETCH_GROUPS 4

/* The codes, scales and mins of the group PREFETCH_GROUPS ahead. A block's
   three streams are a few KB each, too short for the hardware prefetcher
   to ramp up: ahead of time they stream from DRAM at about 31 GB/s on two
   cores against 22 without (the 120 int4 linears of SmolLM2-135M's layers
   at one row). A prefetch past the end never faults. */
#define PREFETCH_GROUP(g)                                                   \
    do {                                                                    \
        int64_t group_bytes = GROUP * (bits == 4 ? 16 : 32);               \
        const char *pq = (const char *)q + ((g) + PREFETCH_GROUPS) * group_bytes; \
        for (int64_t b = 0; b < group_bytes; b += 64) _mm_prefetch(pq + b, _MM_HINT_T0); \
        const char *ps = (const char *)(scale + ((g) + PREFETCH_GROUPS) * BLOCK_N); \
        _mm_prefetch(ps, _MM_HINT_T0);                                      \
        _mm_prefetch(ps + 64, _MM_HINT_T0);                                 \
        if (minv) {                                                         \
            const char *pm = (const char *)(minv + ((g) + PREFETCH_GROUPS) * BLOCK_N); \
            _mm_prefetch(pm, _MM_HINT_T0);                                  \
            _mm_prefetch(pm + 64, _MM_HINT_T0);                             \
        }                                                                   \
    } while (0);

/* One block of 32 output columns, up to MAX_ROWS rows. Codes: int8 [K][32]
   (bits 8) or int4 [K][16] (bits 4: byte j holds column j in its low
   nibble, column j + 16 in its high one). scale, min: [K / 32][32] floats
   (min unused for int8). xsum: [rows][K / 32], each group's sum of x.

   An int4 code becomes a float through a 16-entry table (vpermps reads the
   low 4 bits of each index), cheaper than mask and convert. Up to
   FACTORED_ROWS rows, a group's dot products are taken on the raw codes
   and scaled once: y += scale * sum(x q) + min * sum(x); more rows rebuild
   the weight per k (scale * q + min) and share it, as the registers of
   twice the accumulators would not fit. */
static inline void block_rows(int bits, int rows, const float *x, int64_t ldx, const float *xsum,
                              const uint8_t *q, const float *scale, const float *minv, const float *bias,
                              int cols, float *y, int64_t ldy, int64_t K) {
    static const float LUT[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m512 table = _mm512_loadu_ps(LUT);
    const int64_t num_groups = K / GROUP;
    BLOCK_ACCUMULATORS
#define INT4_CODES(k)                                                       \
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + (k) * 16))); \
    __m512 c0 = _mm512_permutexvar_ps(v, table);                            \
    __m512 c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
#define INT8_CODES(k)                                                       \
    __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (k) * 32)))); \
    __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (k) * 32 + 16))));
#define FMA_ROWS(R, ACC, W0, W1)                                            \
    for (int m = 0; m < R; m++) {                                           \
        __m512 a = _mm512_set1_ps(x[m * ldx + k]);                          \
        ACC[m][0] = _mm512_fmadd_ps(a, W0, ACC[m][0]);                      \
        ACC[m][1] = _mm512_fmadd_ps(a, W1, ACC[m][1]);                      \
    }
    /* Factored: per group, dot products on the codes, then scale (and min). */
#define FACTORED(R, CODES, HAS_MIN)                                         \
    for (int64_t g = 0; g < num_groups; g++) {                              \
        PREFETCH_GROUP(g)                                                   \
        __m512 dot[FACTORED_ROWS][2];                                       \
        for (int m = 0; m < R; m++) { dot[m][0] = _mm512_setzero_ps(); dot[m][1] = _mm512_setzero_ps(); } \
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {             \
            CODES(k)                                                        \
            FMA_ROWS(R, dot, c0, c1)                                        \
        }                                                                   \
        __m512 s0 = _mm512_loadu_ps(scale + g * BLOCK_N), s1 = _mm512_loadu_ps(scale + g * BLOCK_N + 16); \
        for (int m = 0; m < R; m++) {                                       \
            acc[m][0] = _mm512_fmadd_ps(dot[m][0], s0, acc[m][0]);          \
            acc[m][1] = _mm512_fmadd_ps(dot[m][1], s1, acc[m][1]);          \
        }                                                                   \
        if (HAS_MIN) {                                                      \
            __m512 z0 = _mm512_loadu_ps(minv + g * BLOCK_N), z1 = _mm512_loadu_ps(minv + g * BLOCK_N + 16); \
            for (int m = 0; m < R; m++) {                                   \
                __m512 sx = _mm512_set1_ps(xsum[m * num_groups + g]);       \
                acc[m][0] = _mm512_fmadd_ps(sx, z0, acc[m][0]);             \
                acc[m][1] = _mm512_fmadd_ps(sx, z1, acc[m][1]);             \
            }                                                               \
        }                                                                   \
    }
    /* Shared: the weight rebuilt per k, then every row's FMAs on it. */
#define SHARED(R, CODES, HAS_MIN)                                           \
    for (int64_t g = 0; g < num_groups; g++) {                              \
        PREFETCH_GROUP(g)                                                   \
        __m512 s0 = _mm512_loadu_ps(scale + g * BLOCK_N), s1 = _mm512_loadu_ps(scale + g * BLOCK_N + 16); \
        __m512 z0 = HAS_MIN ? _mm512_loadu_ps(minv + g * BLOCK_N) : _mm512_setzero_ps();      \
        __m512 z1 = HAS_MIN ? _mm512_loadu_ps(minv + g * BLOCK_N + 16) : _mm512_setzero_ps(); \
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {             \
            CODES(k)                                                        \
            __m512 w0 = _mm512_fmadd_ps(c0, s0, z0), w1 = _mm512_fmadd_ps(c1, s1, z1);      \
            FMA_ROWS(R, acc, w0, w1)                                        \
        }                                                                   \
    }
#define INT4_F(R) FACTORED(R, INT4_CODES, 1)
#define INT8_F(R) FACTORED(R, INT8_CODES, 0)
#define INT4_S(R) SHARED(R, INT4_CODES, 1)
#define INT8_S(R) SHARED(R, INT8_CODES, 0)
#define BY_ROWS(F, S)                                                       \
    switch (rows) {                                                         \
        case 1: F(1) break; case 2: F(2) break; case 3: F(3) break; case 4: F(4) break; \
        case 5: S(5) break; case 6: S(6) break; case 7: S(7) break; default: S(8) break; \
    }
    if (bits == 4) { BY_ROWS(INT4_F, INT4_S) } else { BY_ROWS(INT8_F, INT8_S) }
    for (int m = 0; m < rows; m++) {
        _mm512_mask_storeu_ps(y + m * ldy, lo, acc[m][0]);
        _mm512_mask_storeu_ps(y + m * ldy + 16, hi, acc[m][1]);
    }
}

"""


KERNEL_SOURCE_AVX2 = cpu_linear.BLOCK_ACCUMULATORS_AVX2 + r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK_N 32
#define GROUP 32
#define PASS_ROWS 2     /* rows of a block_few pass */
#define ROWS_PER_CALL 48 /* rows of x a block_rows call: block_chunked's 8 groups of 6 */
#define DOT4
#define PREFETCH_GROUPS 4

""" + KERNEL_SOURCE[KERNEL_SOURCE.index("#define PREFETCH_GROUP(g)"):KERNEL_SOURCE.index("/* One block of 32")] + r"""
/* KERNEL_SOURCE's block_rows on AVX2 for one or two rows (block_chunked
   below takes more), factored: per group, the dot products of the rows
   with the raw codes (8 accumulators: 4 vectors of 8 columns a row) are
   scaled once into the outputs (8 more), y += scale * sum(x q) + min *
   sum(x), in one pass over the block. An int4 code
   becomes a float by zero-extension and conversion (AVX2 has no 16-lane
   table lookup). */
static inline void block_few(int bits, int rows, const float *x, int64_t ldx, const float *xsum,
                             const uint8_t *q, const float *scale, const float *minv, const float *bias,
                             int cols, float *y, int64_t ldy, int64_t K) {
    const int64_t num_groups = K / GROUP;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    BLOCK_OUT_AVX2
#define CODES(k)                                                            \
    __m256 c0, c1, c2, c3;                                                  \
    if (bits == 4) {                                                        \
        __m128i raw = _mm_loadu_si128((const __m128i *)(q + (k) * 16));    \
        __m128i lo = _mm_and_si128(raw, nibble), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble); \
        c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));                  \
        c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))); \
        c2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));                  \
        c3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))); \
    } else {                                                                \
        const uint8_t *qk = q + (k) * 32;                                   \
        c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qk))); \
        c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 8)))); \
        c2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 16)))); \
        c3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 24)))); \
    }
#define CODE_FMA_ROW(X, R, m)                                                \
    if ((R) > (m)) {                                                        \
        __m256 a = _mm256_broadcast_ss((X) + (m) * ldx + k);                \
        d##m##_0 = _mm256_fmadd_ps(a, c0, d##m##_0);                        \
        d##m##_1 = _mm256_fmadd_ps(a, c1, d##m##_1);                        \
        d##m##_2 = _mm256_fmadd_ps(a, c2, d##m##_2);                        \
        d##m##_3 = _mm256_fmadd_ps(a, c3, d##m##_3);                        \
    }
#define PASS(R)                                                             \
    {                                                                       \
        ACC_DECLARE(0)                                                      \
        for (int64_t g = 0; g < num_groups; g++) {                          \
            PREFETCH_GROUP(g)                                               \
            __m256 z = _mm256_setzero_ps();                                 \
            __m256 d0_0 = z, d0_1 = z, d0_2 = z, d0_3 = z, d1_0 = z, d1_1 = z, d1_2 = z, d1_3 = z; \
            for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {         \
                CODES(k)                                                    \
                CODE_FMA_ROW(x, R, 0) CODE_FMA_ROW(x, R, 1)                 \
            }                                                               \
            const float *sg = scale + g * BLOCK_N;                          \
            __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);   \
            __m256 s2 = _mm256_loadu_ps(sg + 16), s3 = _mm256_loadu_ps(sg + 24); \
            acc0_0 = _mm256_fmadd_ps(d0_0, s0, acc0_0); acc0_1 = _mm256_fmadd_ps(d0_1, s1, acc0_1); \
            acc0_2 = _mm256_fmadd_ps(d0_2, s2, acc0_2); acc0_3 = _mm256_fmadd_ps(d0_3, s3, acc0_3); \
            if ((R) > 1) {                                                  \
                acc1_0 = _mm256_fmadd_ps(d1_0, s0, acc1_0); acc1_1 = _mm256_fmadd_ps(d1_1, s1, acc1_1); \
                acc1_2 = _mm256_fmadd_ps(d1_2, s2, acc1_2); acc1_3 = _mm256_fmadd_ps(d1_3, s3, acc1_3); \
            }                                                               \
            if (minv) {                                                     \
                const float *mg = minv + g * BLOCK_N;                       \
                __m256 z0 = _mm256_loadu_ps(mg), z1 = _mm256_loadu_ps(mg + 8); \
                __m256 z2 = _mm256_loadu_ps(mg + 16), z3 = _mm256_loadu_ps(mg + 24); \
                __m256 sx = _mm256_broadcast_ss(xsum + g);                  \
                ACC_FMA(R, 4, 0, sx, z0, z1, z2, z3)                        \
                if ((R) > 1) {                                              \
                    sx = _mm256_broadcast_ss(xsum + num_groups + g);        \
                    ACC_FMA(R, 4, 1, sx, z0, z1, z2, z3)                    \
                }                                                           \
            }                                                               \
        }                                                                   \
        ACC_STORE(R, 4, 0)                                                  \
    }
    if (rows == 1) PASS(1) else PASS(2)
    BLOCK_STORE_AVX2
#undef PASS
}

/* 3 to ROWS_PER_CALL rows against one block, block_few's arithmetic in
   another order of work. block_few's passes of 2 rows each ran over the
   whole block, each converting every code again, and only the first read
   the block from memory: 8 rows cost 4.7 times one. Here the group (32 k)
   is the unit: every pass runs over a group before any goes on to the
   next, so the group is read from memory once, stays in L1 for the other
   passes, and the memory stream (PREFETCH_GROUP, once a group) runs under
   all of them. Each group of 6 rows takes the block in two halves of 16
   columns: a half's codes (low nibbles: columns 0-15, high: 16-31) become
   2 vectors of floats once per k and serve 6 rows (12 dot accumulators);
   the last 1 or 2 rows take all 32 columns at once (3 to 5 rows: two
   halves). The outputs wait in ``acc`` (rows x 32 floats on the stack)
   and take each group's scale * dot + min * sum(x) as block_few's
   registers do: the same operations in the same order, the same bits.
   7 or 8 rows left over (8, 13, 14, ...) take two passes of 3 or 4 rows
   rather than 6 and then 1 or 2 at 32 columns (those convert 4 vectors of
   codes a k for 1 or 2 rows' FMAs). The passes' bits are constants in
   each copy of the group loop (GROUPS), so no k tests them.

   Measured on a 2-core AMD EPYC (Zen 3, AVX2), two threads: the 120 int4
   linears of SmolLM2-135M's 30 layers in one PackArena, one linear_quant
   call each, ms a pass (median of 9, alternating the two kernels), 2-row
   passes over the whole block -> this: 1 row 5.8 -> 6.2 (the same code,
   noise), 2 rows 7.4 -> 7.4, 4 rows 14.2 -> 9.6, 6 rows 26.6 -> 17.9, 8
   rows 30.7 -> 20.4, 12 rows 53.1 -> 34.1, 16 rows 69.7 -> 44.3, 256 rows
   978 -> 709; int8, 8 rows 31.8 -> 24.0, 256 rows 788 -> 711. A decode
   step at 8 sequences (``python tools/profile_step.py --side ours
   --threads 2 --steps 20 --split --quantization int4 --num-seqs 8``,
   medians of 4 interleaved runs): the layers 44.1 -> 30.4 ms CPU, the LM
   head 6.8 -> 5.4, the step 53.0 -> 37.7; at one sequence the same (layers
   8.3 -> 8.7, noise: the same code). Still about twice the FMAs' time: a
   half pass's k (2 code conversions, 6 broadcasts, 12 FMAs) takes about
   10 cycles where its FMAs alone take 6. */
static inline void block_chunked(int bits, int rows, const float *x, int64_t ldx, const float *xsum,
                                 const uint8_t *q, const float *scale, const float *minv, const float *bias,
                                 int cols, float *y, int64_t ldy, int64_t K) {
    const int64_t num_groups = K / GROUP;
    float acc[ROWS_PER_CALL * BLOCK_N] __attribute__((aligned(32)));
    ACC_AT_BIAS(acc)
    /* Passes of 6 rows; 7 or 8 rows left (8, 13, 14, ...) take two of 3 or 4, not one of 6 and one of 1 or 2
       (block_few's 32 columns a pass converts 4 vectors of codes a k for 1 or 2 rows' FMAs). */
    int groups = rows / 6, rest = rows % 6;
    if (groups > 0 && (rest == 1 || rest == 2)) { groups--; rest += 6; }
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    /* Half H's codes of row k as floats: w0 columns 16H + 0..7, w1 16H + 8..15. */
#define HALF_CODES(H)                                                       \
    __m256 w0, w1;                                                          \
    if (bits == 4) {                                                        \
        __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qg + k * 16))); \
        __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qg + k * 16 + 8))); \
        if ((H) == 0) { v0 = _mm256_and_si256(v0, low4); v1 = _mm256_and_si256(v1, low4); } \
        else { v0 = _mm256_srli_epi32(v0, 4); v1 = _mm256_srli_epi32(v1, 4); } \
        w0 = _mm256_cvtepi32_ps(v0); w1 = _mm256_cvtepi32_ps(v1);          \
    } else {                                                                \
        const uint8_t *qk = qg + k * 32 + 16 * (H);                         \
        w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qk))); \
        w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 8)))); \
    }
#define HDOT_ROW(R, m)                                                      \
    __m256 d##m##_0 = z, d##m##_1 = z;
#define HFMA_ROW(R, m)                                                      \
    if ((R) > (m)) {                                                        \
        __m256 a = _mm256_broadcast_ss(xr + (m) * ldx + k);                 \
        d##m##_0 = _mm256_fmadd_ps(a, w0, d##m##_0);                        \
        d##m##_1 = _mm256_fmadd_ps(a, w1, d##m##_1);                        \
    }
#define HOUT_ROW(R, m)                                                      \
    if ((R) > (m)) {                                                        \
        float *o = a0 + (m) * BLOCK_N;                                      \
        __m256 o0 = _mm256_fmadd_ps(d##m##_0, s0, _mm256_load_ps(o));      \
        __m256 o1 = _mm256_fmadd_ps(d##m##_1, s1, _mm256_load_ps(o + 8));  \
        if (minv) {                                                         \
            __m256 sx = _mm256_broadcast_ss(xs + (m) * num_groups);         \
            o0 = _mm256_fmadd_ps(sx, z0, o0); o1 = _mm256_fmadd_ps(sx, z1, o1); \
        }                                                                   \
        _mm256_store_ps(o, o0); _mm256_store_ps(o + 8, o1);                 \
    }
    /* One pass: rows M0 .. M0 + R - 1 (R <= 6), half H, group g. */
#define HPASS(R, H, M0)                                                     \
    {                                                                       \
        const float *xr = x + (M0) * ldx;                                   \
        const __m256 z = _mm256_setzero_ps();                               \
        HDOT_ROW(R, 0) HDOT_ROW(R, 1) HDOT_ROW(R, 2) HDOT_ROW(R, 3) HDOT_ROW(R, 4) HDOT_ROW(R, 5) \
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {             \
            HALF_CODES(H)                                                   \
            HFMA_ROW(R, 0) HFMA_ROW(R, 1) HFMA_ROW(R, 2) HFMA_ROW(R, 3) HFMA_ROW(R, 4) HFMA_ROW(R, 5) \
        }                                                                   \
        float *a0 = acc + (M0) * BLOCK_N + 16 * (H);                        \
        const float *xs = xsum + (M0) * num_groups + g;                     \
        __m256 s0 = _mm256_loadu_ps(sg + 16 * (H)), s1 = _mm256_loadu_ps(sg + 16 * (H) + 8); \
        __m256 z0 = z, z1 = z;                                              \
        if (minv) { z0 = _mm256_loadu_ps(mg + 16 * (H)); z1 = _mm256_loadu_ps(mg + 16 * (H) + 8); } \
        HOUT_ROW(R, 0) HOUT_ROW(R, 1) HOUT_ROW(R, 2) HOUT_ROW(R, 3) HOUT_ROW(R, 4) HOUT_ROW(R, 5) \
    }
    /* The last 1 or 2 rows: all 32 columns a pass, block_few's CODES. */
#define FULL_OUT_ROW(R, m)                                                  \
    if ((R) > (m)) {                                                        \
        float *o = acc + (mb + (m)) * BLOCK_N;                            \
        __m256 o0 = _mm256_fmadd_ps(d##m##_0, s0, _mm256_load_ps(o));      \
        __m256 o1 = _mm256_fmadd_ps(d##m##_1, s1, _mm256_load_ps(o + 8));  \
        __m256 o2 = _mm256_fmadd_ps(d##m##_2, s2, _mm256_load_ps(o + 16)); \
        __m256 o3 = _mm256_fmadd_ps(d##m##_3, s3, _mm256_load_ps(o + 24)); \
        if (minv) {                                                         \
            __m256 sx = _mm256_broadcast_ss(xsum + (mb + (m)) * num_groups + g); \
            o0 = _mm256_fmadd_ps(sx, z0, o0); o1 = _mm256_fmadd_ps(sx, z1, o1); \
            o2 = _mm256_fmadd_ps(sx, z2, o2); o3 = _mm256_fmadd_ps(sx, z3, o3); \
        }                                                                   \
        _mm256_store_ps(o, o0); _mm256_store_ps(o + 8, o1);                 \
        _mm256_store_ps(o + 16, o2); _mm256_store_ps(o + 24, o3);           \
    }
#define FULL_PASS(R, M0)                                                    \
    {                                                                       \
        const int mb = (M0);                                                \
        const float *xr = x + mb * ldx;                                     \
        const __m256 z = _mm256_setzero_ps();                               \
        __m256 d0_0 = z, d0_1 = z, d0_2 = z, d0_3 = z, d1_0 = z, d1_1 = z, d1_2 = z, d1_3 = z; \
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {             \
            CODES(k)                                                        \
            CODE_FMA_ROW(xr, R, 0) CODE_FMA_ROW(xr, R, 1)                   \
        }                                                                   \
        __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);      \
        __m256 s2 = _mm256_loadu_ps(sg + 16), s3 = _mm256_loadu_ps(sg + 24); \
        __m256 z0 = z, z1 = z, z2 = z, z3 = z;                              \
        if (minv) {                                                         \
            z0 = _mm256_loadu_ps(mg); z1 = _mm256_loadu_ps(mg + 8);         \
            z2 = _mm256_loadu_ps(mg + 16); z3 = _mm256_loadu_ps(mg + 24);   \
        }                                                                   \
        FULL_OUT_ROW(R, 0) FULL_OUT_ROW(R, 1)                               \
    }
    const __m128i nibble = _mm_set1_epi8(0x0F);
    /* B: the bits, a constant in each copy of the loop (it shadows ``bits``),
       so that no pass tests it per k. */
#define GROUPS(B)                                                           \
    {                                                                       \
        const int bits = (B);                                               \
        for (int64_t g = 0; g < num_groups; g++) {                          \
            PREFETCH_GROUP(g)                                               \
            const uint8_t *qg = q;                                          \
            const float *sg = scale + g * BLOCK_N, *mg = minv ? minv + g * BLOCK_N : 0; \
            for (int r = 0; r < groups; r++) { HPASS(6, 0, 6 * r) HPASS(6, 1, 6 * r) } \
            const int m0 = 6 * groups;                                      \
            switch (rest) {                                                 \
                case 1: FULL_PASS(1, m0) break;                             \
                case 2: FULL_PASS(2, m0) break;                             \
                case 3: HPASS(3, 0, m0) HPASS(3, 1, m0) break;              \
                case 4: HPASS(4, 0, m0) HPASS(4, 1, m0) break;              \
                case 5: HPASS(5, 0, m0) HPASS(5, 1, m0) break;              \
                case 7: HPASS(4, 0, m0) HPASS(4, 1, m0) HPASS(3, 0, m0 + 4) HPASS(3, 1, m0 + 4) break; \
                case 8: HPASS(4, 0, m0) HPASS(4, 1, m0) HPASS(4, 0, m0 + 4) HPASS(4, 1, m0 + 4) break; \
                default: break;                                             \
            }                                                               \
        }                                                                   \
    }
    if (bits == 4) GROUPS(4) else GROUPS(8)
    for (int m = 0; m < rows; m++) {
        if (cols == BLOCK_N) {
            for (int j = 0; j < BLOCK_N; j += 8) _mm256_storeu_ps(y + m * ldy + j, _mm256_load_ps(acc + m * BLOCK_N + j));
        } else {
            for (int j = 0; j < cols; j++) y[m * ldy + j] = acc[m * BLOCK_N + j];
        }
    }
#undef CODES
}

static inline void block_rows(int bits, int rows, const float *x, int64_t ldx, const float *xsum,
                              const uint8_t *q, const float *scale, const float *minv, const float *bias,
                              int cols, float *y, int64_t ldy, int64_t K) {
    if (rows <= 2) block_few(bits, rows, x, ldx, xsum, q, scale, minv, bias, cols, y, ldy, K);
    else block_chunked(bits, rows, x, ldx, xsum, q, scale, minv, bias, cols, y, ldy, K);
}

/* int4 by integer dot products, as llama.cpp's Q4_1 x Q8_1: the rows'
   activations quantized to int8 per group of 32 (xq, scale dx), each
   group's dot product taken exactly in integers (vpmaddubsw on unsigned
   codes and signed activations, then vpmaddwd), then scaled once about
   the codes' middle, 8: y += scale * dx * (sum(q xq) - 8 sum(xq)) + (min +
   8 scale) * sum(x), so the activations' rounding meets the weights less
   their middle (about half the error of scale * q + min with the exact
   sum only under min, llama.cpp's Q4_1 x Q8_1). The codes are in the dot layout
   (``to_dot4``): per group, 16 vectors [ko 4][co 4] of 32 bytes, lane l of
   vector (ko, co) holding column co * 8 + l's codes of k = 8 ko + 0..3 (low
   nibbles) and 8 ko + 4..7 (high nibbles). A code-to-float conversion per
   weight is what this saves: 4x fewer instructions a weight at one row. */
static inline void block_dot4_few(int rows, const int8_t *xq, int64_t ldq, const float *dx, const float *xsum,
                                  const float *xq8, const uint8_t *q, const float *scale, const float *minv, const float *bias,
                                  int cols, float *y, int64_t ldy, int64_t K) {
    const int bits = 4;  /* for PREFETCH_GROUP */
    const int64_t num_groups = K / GROUP;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    BLOCK_OUT_AVX2
#define DOT_ROW(R, m)                                                       \
    if ((R) > (m)) {                                                        \
        __m256 d = _mm256_broadcast_ss(dx + (m) * num_groups + g);          \
        __m256 sx = _mm256_broadcast_ss(xsum + (m) * num_groups + g);       \
        __m256 c8 = _mm256_broadcast_ss(xq8 + (m) * num_groups + g);        \
        acc##m##_0 = _mm256_fmadd_ps(_mm256_sub_ps(dot[m][0], c8), _mm256_mul_ps(s0, d), acc##m##_0); \
        acc##m##_1 = _mm256_fmadd_ps(_mm256_sub_ps(dot[m][1], c8), _mm256_mul_ps(s1, d), acc##m##_1); \
        acc##m##_2 = _mm256_fmadd_ps(_mm256_sub_ps(dot[m][2], c8), _mm256_mul_ps(s2, d), acc##m##_2); \
        acc##m##_3 = _mm256_fmadd_ps(_mm256_sub_ps(dot[m][3], c8), _mm256_mul_ps(s3, d), acc##m##_3); \
        ACC_FMA(R, 4, m, sx, z0, z1, z2, z3)                                \
    }
#define PASS(R)                                                             \
    {                                                                       \
        ACC_DECLARE(0)                                                      \
        for (int64_t g = 0; g < num_groups; g++) {                          \
            PREFETCH_GROUP(g)                                               \
            const uint8_t *qg = q + g * 512;                                \
            __m256 dot[2][4];                                               \
            for (int co = 0; co < 4; co++) {                                \
                __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; \
                for (int ko = 0; ko < 4; ko++) {                            \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(qg + ko * 128 + co * 32)); \
                    __m256i lo = _mm256_and_si256(v, nibble);               \
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble); \
                    for (int m = 0; m < (R); m++) {                         \
                        const int8_t *xk = xq + m * ldq + g * GROUP + ko * 8; \
                        /* at most 8 * 2 * 15 * 127 = 30480: no int16 overflow */ \
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(*(const int32_t *)xk))); \
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(*(const int32_t *)(xk + 4)))); \
                    }                                                       \
                }                                                           \
                for (int m = 0; m < (R); m++) dot[m][co] = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m], ones)); \
            }                                                               \
            const float *sg = scale + g * BLOCK_N, *mg = minv + g * BLOCK_N; \
            __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);  \
            __m256 s2 = _mm256_loadu_ps(sg + 16), s3 = _mm256_loadu_ps(sg + 24); \
            __m256 eight = _mm256_set1_ps(8.0f);                            \
            __m256 z0 = _mm256_fmadd_ps(eight, s0, _mm256_loadu_ps(mg));    \
            __m256 z1 = _mm256_fmadd_ps(eight, s1, _mm256_loadu_ps(mg + 8)); \
            __m256 z2 = _mm256_fmadd_ps(eight, s2, _mm256_loadu_ps(mg + 16)); \
            __m256 z3 = _mm256_fmadd_ps(eight, s3, _mm256_loadu_ps(mg + 24)); \
            DOT_ROW(R, 0) DOT_ROW(R, 1)                                     \
        }                                                                   \
        ACC_STORE(R, 4, 0)                                                  \
    }
    if (rows == 1) PASS(1) else PASS(2)
    BLOCK_STORE_AVX2
}

/* Up to ROWS_PER_CALL rows: block_dot4_few's passes of 2 rows. (Passes of
   up to 8 rows over a group at a time, as block_chunked, gave the same bits
   and were slower: the int16 sums and the broadcasts of x, per row, are
   the cost here, not the codes.) */
static inline void block_rows_dot4(int rows, const int8_t *xq, int64_t ldq, const float *dx, const float *xsum,
                                   const float *xq8, const uint8_t *q, const float *scale, const float *minv, const float *bias,
                                   int cols, float *y, int64_t ldy, int64_t K) {
    const int64_t num_groups = K / GROUP;
    for (int m0 = 0; m0 < rows; m0 += PASS_ROWS)
        block_dot4_few(rows - m0 < PASS_ROWS ? rows - m0 : PASS_ROWS, xq + m0 * ldq, ldq, dx + m0 * num_groups,
                       xsum + m0 * num_groups, xq8 + m0 * num_groups, q, scale, minv, bias, cols, y + m0 * ldy, ldy, K);
}

"""


# The entry point both sources end with: ROWS_PER_CALL rows a block_rows call;
# with DOT4 defined (the AVX2 source) the int8-activation path of int4_a8.
LINEAR_QUANT_DRIVER = r"""
/* y[M][N] = x[M][K] (row stride ldx) @ dequant(W)^T + bias; W's codes packed
   as [ceil(N/32)][K][32 or 16 bytes], scales and mins as [ceil(N/32)][K/32][32].
   K is a multiple of 32. Blocks of columns are split among threads. With
   ``dot`` (int4 codes in the dot layout, where DOT4 is built; the
   configuration refuses int4_a8 elsewhere) the rows' activations are
   quantized here once and block_rows_dot4 takes the blocks. */
void linear_quant(int bits, int dot, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q,
                  const float *scale, const float *minv, int64_t N, const float *bias, float *y,
                  int num_threads) {
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N, num_groups = K / GROUP;
    int64_t block_bytes = K * (bits == 4 ? 16 : 32), block_groups = num_groups * BLOCK_N;
    int64_t rows_alloc = M > 0 ? M : 1;
    float *xsum = (float *)malloc(sizeof(float) * rows_alloc * num_groups * 3);
    float *dx = xsum + rows_alloc * num_groups, *xq8 = dx + rows_alloc * num_groups;
    int8_t *xq = 0;
#ifdef DOT4
    if (dot && bits == 4) xq = (int8_t *)malloc(rows_alloc * K);
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < num_groups; g++) {
            const float *xg = x + m * ldx + g * GROUP;
            float s = 0, amax = 0;
            for (int k = 0; k < GROUP; k++) { s += xg[k]; amax = fmaxf(amax, fabsf(xg[k])); }
            xsum[m * num_groups + g] = s;
            if (xq) {  /* round to nearest, |q| <= 127 */
                float inv = amax > 0 ? 127.0f / amax : 0.0f;
                dx[m * num_groups + g] = amax / 127.0f;
                int sum = 0;
                for (int k = 0; k < GROUP; k++) {
                    int v = (int)lrintf(xg[k] * inv);
                    xq[m * K + g * GROUP + k] = (int8_t)v;
                    sum += v;
                }
                xq8[m * num_groups + g] = 8.0f * (float)sum;
            }
        }
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t nb = 0; nb < num_blocks; nb++) {
        int cols = (int)(N - nb * BLOCK_N < BLOCK_N ? N - nb * BLOCK_N : BLOCK_N);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_CALL) {
            int rows = (int)(M - m0 < ROWS_PER_CALL ? M - m0 : ROWS_PER_CALL);
#ifdef DOT4
            if (xq) {
                block_rows_dot4(rows, xq + m0 * K, K, dx + m0 * num_groups, xsum + m0 * num_groups,
                                xq8 + m0 * num_groups, q + nb * block_bytes, scale + nb * block_groups,
                                minv + nb * block_groups, bias ? bias + nb * BLOCK_N : 0, cols,
                                y + m0 * N + nb * BLOCK_N, N, K);
                continue;
            }
#endif
            block_rows(bits, rows, x + m0 * ldx, ldx, xsum + m0 * num_groups, q + nb * block_bytes,
                       scale + nb * block_groups, minv ? minv + nb * block_groups : 0,
                       bias ? bias + nb * BLOCK_N : 0, cols, y + m0 * N + nb * BLOCK_N, N, K);
        }
    }
    free(xsum);
    free(xq);
}
"""
KERNEL_SOURCE += LINEAR_QUANT_DRIVER
KERNEL_SOURCE_AVX2 += LINEAR_QUANT_DRIVER


class QuantizedWeight:
    """One ``[out, in]`` weight quantized for ``linear`` (see the module
    docstring for the schemes). ``codes``: uint8 ``[ceil(out/32), in, 32]``
    (int8, the bytes of signed codes) or ``[ceil(out/32), in, 16]`` (int4,
    two codes a byte); ``scale`` and ``min``: float32 ``[ceil(out/32),
    in/32, 32]`` (``min`` None for int8). Padding columns are zero."""

    __slots__ = ("bits", "out_features", "in_features", "codes", "scale", "min", "dot_layout")

    def __init__(self, bits: int, out_features: int, in_features: int, codes: torch.Tensor, scale: torch.Tensor,
                 min: torch.Tensor | None, dot_layout: bool = False):
        self.bits, self.out_features, self.in_features = bits, out_features, in_features
        self.codes, self.scale, self.min = codes, scale, min
        # int4 only: ``codes`` are in the integer-dot kernel's order (``to_dot4``), same shape and bytes.
        self.dot_layout = dot_layout

    def column_codes(self) -> torch.Tensor:
        """``codes`` in the column layout (the class docstring's), whichever layout they are kept in."""
        return from_dot4(self.codes) if self.dot_layout else self.codes

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.min) if t is not None)

    def arena_floats(self) -> int:
        """The floats ``move_into`` takes from a ``PackArena`` (each tensor 64-byte aligned)."""
        return sum(-(-t.nbytes // 64) * 16 for t in (self.codes, self.scale, self.min) if t is not None)

    def move_into(self, arena: cpu_linear.PackArena) -> None:
        """Copy the codes, scales and mins into ``arena`` (huge pages where the OS gives them: the
        kernel streams them once per step, as the float32 kernel streams its blocks)."""
        codes = arena.take((-(-self.codes.nbytes // 4),)).view(torch.uint8)[: self.codes.nbytes]
        self.codes = codes.view(self.codes.shape).copy_(self.codes)
        self.scale = arena.take(tuple(self.scale.shape)).copy_(self.scale)
        if self.min is not None:
            self.min = arena.take(tuple(self.min.shape)).copy_(self.min)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, self.dequantize(), bias)`` for float32 ``x`` on CPU.
        A decode step calls this once a linear (121 times for SmolLM2):
        ``cpu_linear.on_rows`` hands the rows to the kernel as they come."""
        if x.dtype is not torch.float32 or not x.is_cpu:
            raise ValueError(f"quantized linear: takes float32 input on CPU, got {x.dtype} on {x.device}")
        lib = kernel()
        if lib is None:
            return F.linear(x, self.dequantize(), bias)
        def call(rows, num_rows, num_in, row_stride, bias_ptr, y, num_threads):
            codes, scale, minv = self._pointers()
            lib.linear_quant(self.bits, int(self.dot_layout), rows, num_rows, num_in, row_stride, codes, scale, minv,
                             self.out_features, bias_ptr, y, num_threads)

        return cpu_linear.on_rows(x, self.out_features, bias, call)

    def _pointers(self) -> tuple[int, int, int | None]:
        # Read on every call, not kept: ``move_into`` replaces the tensors.
        return self.codes.data_ptr(), self.scale.data_ptr(), None if self.min is None else self.min.data_ptr()

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight these codes stand for."""
        scale = self.scale.repeat_interleave(GROUP, dim=1)  # [nb, in, 32]
        if self.bits == 8:
            w = self.codes.view(torch.int8).float() * scale
        else:
            codes = self.column_codes()
            low, high = (codes & 0xF).float(), (codes >> 4).float()
            w = torch.cat([low, high], dim=2) * scale + self.min.repeat_interleave(GROUP, dim=1)
        return w.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup on a tied head)."""
        block, col = ids // BLOCK_N, ids % BLOCK_N
        scale = self.scale[block, :, col].repeat_interleave(GROUP, dim=1)  # [T, in]
        if self.bits == 8:
            return self.codes.view(torch.int8)[block, :, col].float() * scale
        byte = self.column_codes()[block, :, col % 16]
        code = torch.where((col < 16)[:, None], byte & 0xF, byte >> 4)
        return code.float() * scale + self.min[block, :, col].repeat_interleave(GROUP, dim=1)


def to_dot4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[nb, K, 16]`` from the column layout (byte j of row k:
    column j's code in the low nibble, column j + 16's in the high one) to
    the AVX2 integer-dot kernel's (``block_rows_dot4``): per group of 32 k,
    16 runs of 32 bytes ``[ko 4][co 4][lane 8][j 4]``, byte j of lane l
    holding column ``8 co + l``'s codes of k ``8 ko + j`` (low nibble) and
    ``8 ko + 4 + j`` (high). Same shape and bytes, another order."""
    nb, k, _ = codes.shape
    by_col = torch.cat([codes & 0xF, codes >> 4], dim=2)  # [nb, K, 32 cols]
    c = by_col.view(nb, k // GROUP, 4, 2, 4, 4, 8)  # [nb, g, ko, half, j, co, lane]
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [nb, g, ko, j, co, lane]
    return packed.permute(0, 1, 2, 4, 5, 3).contiguous().view(nb, k, 16)  # [nb, g, ko, co, lane, j]


def from_dot4(codes: torch.Tensor) -> torch.Tensor:
    """``to_dot4``'s inverse."""
    nb, k, _ = codes.shape
    packed = codes.view(nb, k // GROUP, 4, 4, 8, 4).permute(0, 1, 2, 5, 3, 4)  # [nb, g, ko, j, co, lane]
    by_col = torch.stack([packed & 0xF, packed >> 4], dim=3).reshape(nb, k, 32)  # [nb, g, ko, half, j, (co lane)]
    return (by_col[:, :, :16] | (by_col[:, :, 16:] << 4)).contiguous()


def quantize(weight: torch.Tensor, bits: int, dot_layout: bool = False) -> QuantizedWeight:
    """``weight [out, in]`` (``in`` a multiple of 32) quantized group-wise to
    ``bits`` (8 or 4); ``dot_layout`` (int4 only): codes for the AVX2
    integer-dot kernel (``int4_a8``), whose activations are rounded to int8."""
    if bits not in (8, 4):
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits}")
    num_out, num_in = weight.shape
    if num_in % GROUP:
        raise ValueError(f"quantize: the input dimension ({num_in}) must be a multiple of {GROUP}")
    w = weight.detach().float()
    num_blocks = -(-num_out // BLOCK_N)
    padded = w.new_zeros(num_blocks * BLOCK_N, num_in)
    padded[:num_out] = w
    groups = padded.view(num_blocks, BLOCK_N, num_in // GROUP, GROUP)  # [nb, 32 cols, groups, 32]
    if bits == 8:
        amax = groups.abs().amax(dim=3, keepdim=True)
        scale = amax / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = torch.round(groups * inv).clamp_(-127, 127).to(torch.int8)
        low = None
    else:
        low = groups.amin(dim=3, keepdim=True)
        scale = (groups.amax(dim=3, keepdim=True) - low) / 15
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = torch.round((groups - low) * inv).clamp_(0, 15).to(torch.uint8)
    # [nb, 32 cols, groups, 32 k] -> [nb, in, 32 cols]
    codes = codes.reshape(num_blocks, BLOCK_N, num_in).transpose(1, 2).contiguous()
    if bits == 8:
        codes = codes.view(torch.uint8)
    else:
        codes = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).contiguous()

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [nb, 32 cols, groups, 1] -> [nb, groups, 32 cols]
        return t.squeeze(3).transpose(1, 2).contiguous()

    dot = dot_layout and bits == 4
    return QuantizedWeight(bits, num_out, num_in, to_dot4(codes) if dot else codes, per_group(scale),
                           None if low is None else per_group(low), dot)


def bits_of(quantization: str) -> int | None:
    """``model.quantization`` -> the linear layers' bits (None: float)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    return {"none": None, "int8": 8, "int4": 4, "int4_a8": 4}[quantization]


def quantization_problem(quantization: str, device: str, dtype: torch.dtype) -> str | None:
    """Why an explicit ``model.quantization`` can't serve on ``device`` in
    ``dtype`` (None: it can; "auto" always can); the launcher asks before any actor starts."""
    if quantization == "auto" or bits_of(quantization) is None:
        return None
    if device != "cpu":
        return (f"model.quantization: {quantization} runs on CPU only (this model is on {device}); "
                "set model.quantization: none (or model.device: cpu)")
    if dtype != torch.float32:
        return (f"model.quantization: {quantization} takes model.dtype float32 on CPU, got {dtype}; "
                "set model.dtype: float32 (or model.quantization: none)")
    return None


def has_dot_kernel() -> bool:
    """Whether ``int4_a8`` can run here: the AVX2 kernel, built and checked
    (an AVX-512 CPU takes the AVX-512 kernel, which reads float activations)."""
    return kernel() is not None and cpu_linear.kernel_isa(("avx512", "avx2")) == "avx2"


# ---- the kernel ---------------------------------------------------------------


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built and self-checked kernel library, or None (one warning says why)."""
    return cpu_linear.checked_library("cpu_quant", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE_AVX2}, declare=_declare, check=_check,
                                      what="cpu quantized linear",
                                      when_off="quantized layers dequantize each call instead, much slower")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_quant.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.linear_quant.restype = None


def _check(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((11, 64), (40, 64), (40,)))
    dot_layouts = (False, True) if cpu_linear.kernel_isa(("avx512", "avx2")) == "avx2" else (False,)
    for bits, dot in [(8, False)] + [(4, dot) for dot in dot_layouts]:
        q = quantize(w, bits, dot_layout=dot)
        for bias in (b, None):
            y = torch.empty(11, 40)
            lib.linear_quant(bits, int(dot), x.data_ptr(), 11, 64, 64, q.codes.data_ptr(), q.scale.data_ptr(),
                             None if q.min is None else q.min.data_ptr(), 40,
                             None if bias is None else bias.data_ptr(), y.data_ptr(), 1)
            if not close_to_reference(y, F.linear(x, q.dequantize(), bias), q):
                raise cpu_linear.KernelUnavailable(f"its int{bits}{' (int8 activations)' if dot else ''} self-check "
                                                   "against F.linear failed")


# int8 activations (the dot layout's kernel) put each group's x within half a
# step of 1/127 of its largest value: a product is off by about 1% of its
# norm on random rows (the codes taken about their middle; the rest of each
# weight takes the exact sum of x). The float kernels equal F.linear to
# float32 rounding.
DOT_REL_ERROR = 4e-2


def close_to_reference(y: torch.Tensor, want: torch.Tensor, q: QuantizedWeight) -> bool:
    """Whether the kernel's ``y`` is ``want`` (F.linear on the dequantized
    weight) within the kernel's arithmetic: its norm-relative error under
    DOT_REL_ERROR for the integer dot products, float32 rounding otherwise."""
    if q.dot_layout:
        return bool((y - want).norm() <= DOT_REL_ERROR * want.norm())
    return torch.allclose(y, want, rtol=1e-4, atol=1e-4)
