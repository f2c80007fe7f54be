"""Float32 linear layers on CPU on a weight packed once: our own AVX-512
kernel where it builds, else oneDNN.

Why: a decode step on CPU is mostly GEMMs with few rows (one per sequence)
against weights that do not fit in cache. ``F.linear`` hands them to MKL's
sgemm, which repacks the weight on every call; a weight packed once skips
that. At a few rows such a GEMM is bound by reading the weight from memory,
and oneDNN's blocked kernel does not overlap those reads with its
arithmetic. The kernel here (``KERNEL_SOURCE``) walks a layout made for that: 32 output columns
at a time, their weights contiguous along the input dimension, so every
block is one sequential stream the hardware prefetcher follows; up to 8 rows
share each weight load. Its effect on SmolLM2's decode step is in
docs/benchmarks.md ("Serving (CPU)"), with the command that measures it
(``tools/profile_step.py --linear kernel|onednn``).

The kernel is C compiled once per machine with the system's C compiler
(``cc`` or ``gcc``), cached by its source's hash under the user's cache
folder (beside the embedded models) and loaded with ``ctypes``; it runs on the calling thread plus
OpenMP threads of the same runtime torch uses (as many as
``torch.get_num_threads()``). Without a compiler, on a CPU without
AVX-512, off Linux, or when its self-check fails, one warning says why and
every layer takes oneDNN's packed weight instead.

Cost: the packed copy lives next to the dense weight, which stays the
source of truth (the loader fills it, LoRA and CUDA read it). That is one
more copy of every packed weight in RAM (as large as the float32 weights
themselves). It is made on a layer's
first CPU float32 call, so a model that never runs there pays nothing, and
made again if the weight is replaced or changed in place.

Results equal ``F.linear``'s to float32 rounding (another summation order),
not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mstar_actors.fetch import cache_root

log = logging.getLogger(__name__)

BLOCK_N = 32  # output columns per packed block (two AVX-512 vectors)

# Shared by the block kernels (this one and cpu_quant's): a block's masks of
# its ``cols`` real columns of 32, and MAX_ROWS rows of accumulators that
# start at the bias (zero without one).
BLOCK_ACCUMULATORS = r"""
#define BLOCK_ACCUMULATORS                                                  \
    __mmask16 lo = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);     \
    __mmask16 hi = (__mmask16)(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1); \
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps(); \
    __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps(); \
    __m512 acc[MAX_ROWS][2];                                                \
    for (int m = 0; m < MAX_ROWS; m++) { acc[m][0] = b0; acc[m][1] = b1; }
"""

# Both instruction sets' entry point: blocks of 32 columns split among the
# threads, PASS_ROWS rows of x a pass through one block (``block_rows``).
LINEAR_DRIVER = r"""
void linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N,
                const float *bias, float *y, int num_threads) {
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t nb = 0; nb < num_blocks; nb++) {
        const float *wb = w + nb * K * BLOCK_N;
        int cols = (int)(N - nb * BLOCK_N < BLOCK_N ? N - nb * BLOCK_N : BLOCK_N);
        for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
            int rows = (int)(M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS);
            block_rows(rows, x + m0 * ldx, ldx, wb, bias ? bias + nb * BLOCK_N : 0, cols,
                       y + m0 * N + nb * BLOCK_N, N, K);
        }
    }
}
"""

KERNEL_SOURCE = BLOCK_ACCUMULATORS + r"""
#include <immintrin.h>
#include <stdint.h>

#define BLOCK_N 32
#define MAX_ROWS 8
#define PREFETCH_K 32  /* rows of the block ahead: 4 KB, what the prefetcher alone keeps too short */

/* Up to MAX_ROWS rows of x against one packed block of 32 output columns
   (wb: [K][32]); ``cols`` of them are real (the last block may be short;
   its padding columns are zeros in wb, neither loaded from bias nor stored). */
static inline void block_rows(int rows, const float *x, int64_t ldx, const float *wb, const float *bias,
                              int cols, float *y, int64_t ldy, int64_t K) {
    BLOCK_ACCUMULATORS
    /* One loop per row count, so the accumulators stay in registers. */
#define ROWS_LOOP(R)                                                        \
    for (int64_t k = 0; k < K; k++) {                                       \
        _mm_prefetch((const char *)(wb + (k + PREFETCH_K) * BLOCK_N), _MM_HINT_T0);      \
        _mm_prefetch((const char *)(wb + (k + PREFETCH_K) * BLOCK_N) + 64, _MM_HINT_T0); \
        __m512 w0 = _mm512_loadu_ps(wb + k * BLOCK_N);                      \
        __m512 w1 = _mm512_loadu_ps(wb + k * BLOCK_N + 16);                 \
        for (int m = 0; m < R; m++) {                                       \
            __m512 a = _mm512_set1_ps(x[m * ldx + k]);                      \
            acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);                  \
            acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);                  \
        }                                                                   \
    }
    switch (rows) {
        case 1: ROWS_LOOP(1) break;
        case 2: ROWS_LOOP(2) break;
        case 3: ROWS_LOOP(3) break;
        case 4: ROWS_LOOP(4) break;
        case 5: ROWS_LOOP(5) break;
        case 6: ROWS_LOOP(6) break;
        case 7: ROWS_LOOP(7) break;
        default: ROWS_LOOP(8) break;
    }
    for (int m = 0; m < rows; m++) {
        _mm512_mask_storeu_ps(y + m * ldy, lo, acc[m][0]);
        _mm512_mask_storeu_ps(y + m * ldy + 16, hi, acc[m][1]);
    }
}

/* y[M][N] = x[M][K] (row stride ldx) @ W^T + bias, W packed as [ceil(N/32)][K][32].
   Blocks of columns are split among threads; each block's weights are read
   once from memory and reused from cache by every group of 8 rows. Reading
   PREFETCH_K rows ahead, the 120 linears of SmolLM2-135M's layers take
   16.0 ms at one row on two cores against 18.6 without (22.8 -> 26.5 GB/s). */
""" + LINEAR_DRIVER.replace("PASS_ROWS", "MAX_ROWS")

# Shared by the AVX2 block kernels: a block's 32 columns are 4 vectors of 8,
# taken by passes of up to 6 rows over 2 of them (12 accumulators of the 16
# registers) or up to 2 rows over all 4. The accumulators are named scalars
# (acc0_0 .. acc5_3), not an array: GCC kept arrays of them on the stack,
# storing every one every k. A pass declares them all at the bias; those of
# rows and vectors it does not use are dead code. AVX2 has no masked float
# store: a short block's bias is read into a padded copy and its rows are
# stored through a buffer.
BLOCK_ACCUMULATORS_AVX2 = r"""
#define BLOCK_OUT_AVX2                                                      \
    float b[32] = {0}, t[6 * 32];                                           \
    if (bias) for (int j = 0; j < cols; j++) b[j] = bias[j];                \
    float *out = cols == 32 ? y : t;                                        \
    int64_t ldo = cols == 32 ? ldy : 32;
#define ACC_ROW(m) __m256 acc##m##_0 = B0, acc##m##_1 = B1, acc##m##_2 = B2, acc##m##_3 = B3;
#define ACC_DECLARE(J0)                                                     \
    __m256 B0 = _mm256_loadu_ps(b + 8 * (J0)), B1 = _mm256_loadu_ps(b + 8 * (J0) + 8); \
    __m256 B2 = _mm256_loadu_ps(b + 16), B3 = _mm256_loadu_ps(b + 24);      \
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
/* Row m of a pass of R rows: acc += a * (W0, W1[, W2, W3]) for NV of 2 or 4. */
#define ACC_FMA(R, NV, m, a, W0, W1, W2, W3)                                \
    if ((R) > (m)) {                                                        \
        acc##m##_0 = _mm256_fmadd_ps(a, W0, acc##m##_0);                        \
        acc##m##_1 = _mm256_fmadd_ps(a, W1, acc##m##_1);                        \
        if ((NV) == 4) {                                                    \
            acc##m##_2 = _mm256_fmadd_ps(a, W2, acc##m##_2);                    \
            acc##m##_3 = _mm256_fmadd_ps(a, W3, acc##m##_3);                    \
        }                                                                   \
    }
#define ACC_STORE_ROW(R, NV, J0, m)                                         \
    if ((R) > (m)) {                                                        \
        float *o = out + (m) * ldo + 8 * (J0);                              \
        _mm256_storeu_ps(o, acc##m##_0);                                      \
        _mm256_storeu_ps(o + 8, acc##m##_1);                                  \
        if ((NV) == 4) { _mm256_storeu_ps(o + 16, acc##m##_2); _mm256_storeu_ps(o + 24, acc##m##_3); } \
    }
#define ACC_STORE(R, NV, J0)                                                \
    ACC_STORE_ROW(R, NV, J0, 0) ACC_STORE_ROW(R, NV, J0, 1) ACC_STORE_ROW(R, NV, J0, 2) \
    ACC_STORE_ROW(R, NV, J0, 3) ACC_STORE_ROW(R, NV, J0, 4) ACC_STORE_ROW(R, NV, J0, 5)
/* The chunked kernels' saved accumulators (``acc``, BLOCK_N floats a row,
   32-byte aligned) of ``rows`` rows at the block's bias (zero without one;
   a short block's bias read into a padded copy). */
#define ACC_AT_BIAS(acc)                                                    \
    {                                                                       \
        float b_[BLOCK_N] __attribute__((aligned(32))) = {0};               \
        if (bias) for (int j = 0; j < cols; j++) b_[j] = bias[j];           \
        __m256 b0 = _mm256_load_ps(b_), b1 = _mm256_load_ps(b_ + 8);        \
        __m256 b2 = _mm256_load_ps(b_ + 16), b3 = _mm256_load_ps(b_ + 24);  \
        for (int m = 0; m < rows; m++) {                                    \
            _mm256_store_ps((acc) + m * BLOCK_N, b0); _mm256_store_ps((acc) + m * BLOCK_N + 8, b1);   \
            _mm256_store_ps((acc) + m * BLOCK_N + 16, b2); _mm256_store_ps((acc) + m * BLOCK_N + 24, b3); \
        }                                                                   \
    }
#define BLOCK_STORE_AVX2                                                    \
    if (cols < 32)                                                          \
        for (int m = 0; m < rows; m++)                                      \
            for (int j = 0; j < cols; j++) y[m * ldy + j] = t[m * 32 + j];
"""

KERNEL_SOURCE_AVX2 = BLOCK_ACCUMULATORS_AVX2 + r"""
#include <immintrin.h>
#include <stdint.h>

#define BLOCK_N 32
#define PASS_ROWS 48   /* rows of x a block_rows call: 8 groups of 6 */
#define PREFETCH_K 32  /* one or two rows: prefetch this many k rows ahead (4 KB) */
#define CHUNK_K 64     /* three rows or more: k rows of a chunk (8 KB of the block) */
#define AHEAD_K 128    /* ... and how far ahead their passes prefetch (16 KB) */

/* One or two rows of x against one packed block (wb: [K][32]): all 32
   columns per k, in one pass over the block (at one row the read of the
   weights is all that matters). */
static inline void block_few(int rows, const float *x, int64_t ldx, const float *wb, const float *bias,
                             int cols, float *y, int64_t ldy, int64_t K) {
    BLOCK_OUT_AVX2
#define ROW_FMA(R, NV, m)                                                   \
    if ((R) > (m)) {                                                        \
        __m256 a = _mm256_broadcast_ss(x + (m) * ldx + k);                  \
        ACC_FMA(R, NV, m, a, w0, w1, w2, w3)                                \
    }
#define PASS(R, J0, NV)                                                     \
    {                                                                       \
        ACC_DECLARE(J0)                                                     \
        for (int64_t k = 0; k < K; k++) {                                   \
            const float *w = wb + k * BLOCK_N + 8 * (J0);                   \
            _mm_prefetch((const char *)(wb + (k + PREFETCH_K) * BLOCK_N), _MM_HINT_T0);      \
            _mm_prefetch((const char *)(wb + (k + PREFETCH_K) * BLOCK_N) + 64, _MM_HINT_T0); \
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);    \
            __m256 w2 = (NV) == 4 ? _mm256_loadu_ps(w + 16) : w0;           \
            __m256 w3 = (NV) == 4 ? _mm256_loadu_ps(w + 24) : w1;           \
            ROW_FMA(R, NV, 0) ROW_FMA(R, NV, 1) ROW_FMA(R, NV, 2)           \
            ROW_FMA(R, NV, 3) ROW_FMA(R, NV, 4) ROW_FMA(R, NV, 5)           \
        }                                                                   \
        ACC_STORE(R, NV, J0)                                                \
    }
    if (rows == 1) PASS(1, 0, 4) else PASS(2, 0, 4)
    BLOCK_STORE_AVX2
#undef PASS
#undef ROW_FMA
}

/* 3 to PASS_ROWS rows of x against one packed block. Each group of 6 rows
   takes the block in two halves of 16 columns (2 weight vectors loaded
   once per k and shared by 6 rows: 12 accumulators), the last 1 or 2 rows
   all 32 columns at once (3 to 5 rows: two halves). Those passes do not
   each run over the whole block: k goes in chunks of CHUNK_K rows (8 KB),
   and every pass runs over a chunk before any goes on to the next, so only
   the first pass reads a chunk from further than L1. Between chunks a
   pass's accumulators wait in ``acc`` (rows x 32 floats on the stack).
   The chunk AHEAD_K rows ahead (into the next block at the end of this
   one) is prefetched a cache line per k, its lines shared out among all
   the passes, so the memory stream runs through every pass, not only the
   first: passes over the whole of K (6 rows a call) read the block from
   memory in the first and from L2 in the others, while memory sat idle,
   and 8 rows cost 1.5 times one. The sums run in the same order as
   theirs: the results are the same bits. */
static inline void block_chunked(int rows, const float *x, int64_t ldx, const float *wb, const float *bias,
                                 int cols, float *y, int64_t ldy, int64_t K) {
    float acc[PASS_ROWS * BLOCK_N] __attribute__((aligned(32)));
    ACC_AT_BIAS(acc)
    const int groups = rows / 6, rest = rows % 6;
    const int passes = 2 * groups + (rest == 0 ? 0 : rest <= 2 ? 1 : 2);
#define ACC_LOAD_ROW(R, NV, m)                                              \
    __m256 acc##m##_0 = (R) > (m) ? _mm256_load_ps(a + (m) * BLOCK_N) : _mm256_setzero_ps();      \
    __m256 acc##m##_1 = (R) > (m) ? _mm256_load_ps(a + (m) * BLOCK_N + 8) : _mm256_setzero_ps();  \
    __m256 acc##m##_2 = (R) > (m) && (NV) == 4 ? _mm256_load_ps(a + (m) * BLOCK_N + 16) : _mm256_setzero_ps(); \
    __m256 acc##m##_3 = (R) > (m) && (NV) == 4 ? _mm256_load_ps(a + (m) * BLOCK_N + 24) : _mm256_setzero_ps();
#define ACC_SAVE_ROW(R, NV, m)                                              \
    if ((R) > (m)) {                                                        \
        _mm256_store_ps(a + (m) * BLOCK_N, acc##m##_0);                     \
        _mm256_store_ps(a + (m) * BLOCK_N + 8, acc##m##_1);                 \
        if ((NV) == 4) {                                                    \
            _mm256_store_ps(a + (m) * BLOCK_N + 16, acc##m##_2);            \
            _mm256_store_ps(a + (m) * BLOCK_N + 24, acc##m##_3);            \
        }                                                                   \
    }
#define CROW_FMA(R, NV, m)                                                  \
    if ((R) > (m)) {                                                        \
        __m256 s = _mm256_broadcast_ss(xr + (m) * ldx + k);                 \
        ACC_FMA(R, NV, m, s, w0, w1, w2, w3)                                \
    }
#define CPASS(R, J0, NV, M0)                                                \
    {                                                                       \
        float *a = acc + (M0) * BLOCK_N + 8 * (J0);                         \
        const float *xr = x + (M0) * ldx;                                   \
        const char *pfe = ahead + (int64_t)(++p) * lines / passes * 64;     \
        ACC_LOAD_ROW(R, NV, 0) ACC_LOAD_ROW(R, NV, 1) ACC_LOAD_ROW(R, NV, 2) \
        ACC_LOAD_ROW(R, NV, 3) ACC_LOAD_ROW(R, NV, 4) ACC_LOAD_ROW(R, NV, 5) \
        for (int64_t k = k0; k < k1; k++) {                                 \
            if (pf < pfe) { _mm_prefetch(pf, _MM_HINT_T0); pf += 64; }      \
            const float *w = wb + k * BLOCK_N + 8 * (J0);                   \
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);    \
            __m256 w2 = (NV) == 4 ? _mm256_loadu_ps(w + 16) : w0;           \
            __m256 w3 = (NV) == 4 ? _mm256_loadu_ps(w + 24) : w1;           \
            CROW_FMA(R, NV, 0) CROW_FMA(R, NV, 1) CROW_FMA(R, NV, 2)        \
            CROW_FMA(R, NV, 3) CROW_FMA(R, NV, 4) CROW_FMA(R, NV, 5)        \
        }                                                                   \
        ACC_SAVE_ROW(R, NV, 0) ACC_SAVE_ROW(R, NV, 1) ACC_SAVE_ROW(R, NV, 2) \
        ACC_SAVE_ROW(R, NV, 3) ACC_SAVE_ROW(R, NV, 4) ACC_SAVE_ROW(R, NV, 5) \
    }
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK_K) {
        const int64_t k1 = k0 + CHUNK_K < K ? k0 + CHUNK_K : K, lines = 2 * (k1 - k0);
        const char *ahead = (const char *)(wb + (k0 + AHEAD_K) * BLOCK_N), *pf = ahead;
        int p = 0;
        for (int g = 0; g < groups; g++) { CPASS(6, 0, 2, 6 * g) CPASS(6, 2, 2, 6 * g) }
        const int m0 = 6 * groups;
        switch (rest) {
            case 1: CPASS(1, 0, 4, m0) break;
            case 2: CPASS(2, 0, 4, m0) break;
            case 3: CPASS(3, 0, 2, m0) CPASS(3, 2, 2, m0) break;
            case 4: CPASS(4, 0, 2, m0) CPASS(4, 2, 2, m0) break;
            case 5: CPASS(5, 0, 2, m0) CPASS(5, 2, 2, m0) break;
            default: break;
        }
    }
    for (int m = 0; m < rows; m++) {
        if (cols == BLOCK_N) {
            for (int j = 0; j < BLOCK_N; j += 8) _mm256_storeu_ps(y + m * ldy + j, _mm256_load_ps(acc + m * BLOCK_N + j));
        } else {
            for (int j = 0; j < cols; j++) y[m * ldy + j] = acc[m * BLOCK_N + j];
        }
    }
}

/* Measured on a 2-core AMD EPYC (Zen 3, AVX2), two threads: the 120 linears
   of SmolLM2-135M's 30 layers (425 MB of weights in one PackArena, one
   linear_f32 call each) take per pass, in ms (median of 15 passes), with
   whole-K passes of 6 rows -> with k-chunks: 1 row 30.9 -> 31.0, 2 rows
   27.0 -> 27.3, 4 rows 40.1 -> 27.8, 6 rows 46.5 -> 26.6, 8 rows 48.4 ->
   32.6, 12 rows 54.8 -> 32.2, 16 rows 61.5 -> 38.3; 256 rows 530 -> 543
   (min 488 -> 463; timed layer by layer, alternating the two, 256 and 512
   rows take 4 to 8% less). A decode step at 8 sequences
   (``python tools/profile_step.py --side ours --threads 2 --num-seqs 8 --split``,
   medians of 5 runs): the layers 47.7 -> 33.9 ms CPU, the LM head (8 rows
   as well) 11.0 -> 7.6, the step 60 -> 43 (unsplit 60 -> 46); at one
   sequence (--num-seqs 1) the same. */
static inline void block_rows(int rows, const float *x, int64_t ldx, const float *wb, const float *bias,
                              int cols, float *y, int64_t ldy, int64_t K) {
    if (rows <= 2) block_few(rows, x, ldx, wb, bias, cols, y, ldy, K);
    else block_chunked(rows, x, ldx, wb, bias, cols, y, ldy, K);
}

""" + LINEAR_DRIVER
COMPILE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# The instruction sets a kernel can be built for, best first, with their
# flags. A CPU without AVX-512 (many AMD EPYC hosts) gets a kernel's AVX2
# source where it has one: the same layout and results, 8 lanes a vector.
ISA_FLAGS = {"avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}


def is_packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` may take the packed path: CPU, float32 on
    both sides, no autograd (neither kernel has a backward), and a kernel
    that computes it right (checked once)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and is_available()
    )


_use_kernel = True


def use_kernel(enabled: bool) -> None:
    """Pack for our kernel (the default) or for oneDNN from now on, for
    comparisons and tests. Weights packed before keep their form: a packed
    copy says which kernel reads it."""
    global _use_kernel
    _use_kernel = enabled


def is_available() -> bool:
    """Either packed path works here: our kernel, else oneDNN's."""
    return _active_kernel() is not None or is_onednn_available()


def _active_kernel() -> ctypes.CDLL | None:
    return kernel() if _use_kernel else None


def packs_blocks() -> bool:
    """Whether weights packed now get our kernel's blocks (else oneDNN's layout)."""
    return _active_kernel() is not None


@functools.cache
def is_onednn_available() -> bool:
    """oneDNN's packed linear exists in this torch build and agrees with
    ``F.linear`` on a small case (a build without it, or a platform where
    it differs, keeps the plain path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            x, w, b = _check_case()
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), b, "none", [], "")
            return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


class KernelUnavailable(RuntimeError):
    """Why our kernel can't run here (the warning's text)."""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built and self-checked kernel library, or None (one warning says why)."""
    return checked_library("cpu_linear", {"avx512": KERNEL_SOURCE, "avx2": KERNEL_SOURCE_AVX2}, declare=_declare,
                           check=_check, what="cpu linear",
                           when_off="float32 CPU linears use oneDNN's packed weights instead, slower at decode sizes")


def checked_library(name: str, sources: dict[str, str], *, declare: Callable[[ctypes.CDLL], None],
                    check: Callable[[ctypes.CDLL], None], what: str, when_off: str) -> ctypes.CDLL | None:
    """One of our C kernels: the source of the best instruction set this CPU
    has (``sources``: ISA_FLAGS' names -> C) built (``build_library``),
    loaded, its functions' signatures declared, then checked against torch
    on a small case; None where any of that fails, with one warning saying
    why and what serves instead (``when_off``)."""
    isa = kernel_isa(tuple(sources))
    try:
        if isa is None:
            raise KernelUnavailable(f"this CPU has none of {', '.join(sources)} (or this is not Linux)")
        path = build_library(name, sources[isa], isa)
        lib = load_library(path)
        declare(lib)
        check(lib)
    except KernelUnavailable as err:
        log.warning("%s: our SIMD kernel is off (%s); %s. %s", what, err, when_off, HINT)
        return None
    log.info("%s: our %s kernel is on (%s)", what, isa, path.name)
    return lib


HINT = "To get it back: run on an x86-64 Linux CPU with AVX-512 or AVX2 and install a C compiler with OpenMP (gcc)."


def kernel_isa(choices: tuple[str, ...] = tuple(ISA_FLAGS)) -> str | None:
    """The first of ``choices`` this CPU runs (None: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return next((isa for isa in choices if _cpu_has(isa)), None)


def _cpu_has(isa: str) -> bool:
    return _cpu_has_avx512() if isa == "avx512" else _cpu_has_avx2()


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_has_avx512() -> bool:
    flags = _cpu_flags()
    return " avx512f" in flags and " fma" in flags


def _cpu_has_avx2() -> bool:
    flags = _cpu_flags()
    return " avx2" in flags and " fma" in flags


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_library(name: str, source: str, isa: str = "avx512") -> Path:
    """The library compiled from C ``source`` for ``isa`` (a key of
    ISA_FLAGS), built once per source and flags (cached under the user's
    cache folder as ``name-<hash>.so``)."""
    if not sys.platform.startswith("linux") or not _cpu_has(isa):
        raise KernelUnavailable(f"this CPU has no {isa} (or this is not Linux)")
    flags = [*COMPILE_FLAGS, *ISA_FLAGS[isa]]
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable("no C compiler found (cc or gcc on PATH)")
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    folder = cache_root().parent / "kernels"  # beside the embedded models' cache
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            source_file, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            source_file.write_text(source)
            done = subprocess.run([compiler, *flags, str(source_file), "-o", str(built)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[-400:]}")
            os.replace(built, target)  # atomic: a concurrent builder's copy is the same bytes
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"building with {compiler} failed: {err}") from None
    return target


def load_library(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise KernelUnavailable(f"loading {path.name} failed: {err}") from None


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.linear_f32.restype = None


def _check(lib: ctypes.CDLL) -> None:
    with torch.no_grad():
        x, w, b = _check_case()
        for bias in (b, None):
            y = _kernel_linear(lib, x, pack_blocks(w), w.shape[0], bias)
            if not torch.allclose(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5):
                raise KernelUnavailable("its self-check against F.linear failed")


def _check_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """11 rows (a group of 8 and a partial one) and 40 columns (a partial block)."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=gen) for shape in ((11, 24), (40, 24), (40,)))


def blocks_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape ``pack_blocks`` gives ``weight [N, K]``: ``[ceil(N / 32), K, 32]``."""
    num_out, num_in = weight.shape
    return -(-num_out // BLOCK_N), num_in, BLOCK_N


def pack_blocks(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 32), K, 32]``: each block of 32 output
    columns contiguous along K, the last block padded with zero columns.
    Written into ``out`` (contiguous, that shape) when given."""
    weight = weight.detach()
    num_out, num_in = weight.shape
    blocks = out if out is not None else weight.new_empty(blocks_shape(weight))
    num_full = num_out // BLOCK_N
    blocks[:num_full].copy_(weight[: num_full * BLOCK_N].view(num_full, BLOCK_N, num_in).transpose(1, 2))
    if num_full < blocks.shape[0]:
        blocks[num_full:].zero_()
        blocks[num_full, :, : num_out - num_full * BLOCK_N].copy_(weight[num_full * BLOCK_N :].t())
    return blocks


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


class PackArena:
    """One buffer for many packed weights, whose memory the OS is asked to
    back with 2 MiB pages (Linux transparent huge pages, ``madvise``) before
    anything touches it. Why: the kernel streams each weight once per step,
    and fewer TLB misses and page-bounded prefetch streams make that stream
    faster (``tools/profile_step.py`` measures the decode step). Where the OS says no (THP off, not Linux), the buffer is plain memory
    and nothing else changes. Costs no RAM: the up to 2 MiB of slack
    before the first page boundary is never touched.

    ``take`` hands out consecutive 64-byte-aligned slices; they live as
    long as any of them does (the buffer is freed with the last)."""

    def __init__(self, num_floats: int):
        self.buffer = torch.empty(num_floats + HUGE_PAGE // 4, dtype=torch.float32)
        start = -self.buffer.data_ptr() % HUGE_PAGE // 4  # first float on a 2 MiB boundary
        self.offset, self.end = start, start + num_floats
        self.is_huge = _advise_huge_pages(self.buffer.data_ptr() + start * 4, num_floats * 4)

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        num = 1
        for size in shape:
            num *= size
        if self.offset + num > self.end:
            raise ValueError(f"pack arena: {num} more floats do not fit, {self.end - self.offset} are left "
                             "(size it with arena_floats)")
        piece = self.buffer[self.offset : self.offset + num].view(shape)
        self.offset += -(-num // 16) * 16
        return piece


def arena_floats(weights: list[torch.Tensor]) -> int:
    """The floats a ``PackArena`` needs for ``weights``' blocks (aligned as ``take`` does)."""
    total = 0
    for weight in weights:
        num_blocks, num_in, block_n = blocks_shape(weight)
        total += -(-(num_blocks * num_in * block_n) // 16) * 16
    return total


def _advise_huge_pages(address: int, num_bytes: int) -> bool:
    if not sys.platform.startswith("linux") or num_bytes < HUGE_PAGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(num_bytes // HUGE_PAGE * HUGE_PAGE),
                            _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def _kernel_linear(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, num_out: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return on_rows(x, num_out, bias, lambda rows, num_rows, num_in, row_stride, bias_ptr, y, num_threads: lib.linear_f32(
        rows, num_rows, num_in, row_stride, blocks.data_ptr(), num_out, bias_ptr, y, num_threads))


def on_rows(x: torch.Tensor, num_out: int, bias: torch.Tensor | None, call: Callable[..., None]) -> torch.Tensor:
    """A linear kernel's output ``[..., num_out]`` for float32 ``x [..., in]``:
    ``call(rows, num_rows, num_in, row_stride, bias, y, num_threads)`` with
    pointers to x's rows as the kernels read them (unit column stride,
    ``row_stride`` floats apart: copied only when they are not), to the
    contiguous bias (or None) and to a fresh ``y``. Shapes and strides are
    read once: each read is a call, and a decode step makes 121 of these."""
    is_rows = x.dim() == 2
    rows = x if is_rows else x.reshape(-1, x.shape[-1])  # [M, in] as it comes: no reshape, no view
    (num_rows, num_in), (row_stride, col_stride) = rows.shape, rows.stride()
    if col_stride != 1 or (num_rows > 1 and row_stride < num_in):
        rows, row_stride = rows.contiguous(), num_in
    y = torch.empty(num_rows, num_out, dtype=torch.float32)
    if num_rows > 0:
        if bias is not None:
            bias = bias.contiguous()
        call(rows.data_ptr(), num_rows, num_in, row_stride, None if bias is None else bias.data_ptr(), y.data_ptr(),
             torch.get_num_threads())
    return y if is_rows else y.view(*x.shape[:-1], num_out)


class PackedWeight:
    """A packed copy of one dense ``[out, in]`` weight (our kernel's blocks,
    else oneDNN's layout), remade when the weight is replaced (another
    storage) or changed in place (its version)."""

    __slots__ = ("packed", "_key")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self._key: tuple | None = None

    def get(self, weight: torch.Tensor, arena: PackArena | None = None) -> torch.Tensor:
        """The packed copy, made now if missing or stale (our kernel's blocks
        into ``arena`` when given, else into memory of their own)."""
        key = _identity(weight)
        if key != self._key:
            if _active_kernel() is not None:
                self.packed = pack_blocks(weight, arena.take(blocks_shape(weight)) if arena is not None else None)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._key = key
        return self.packed

    def release(self) -> None:
        self.packed, self._key = None, None


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: PackedWeight) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``cache``'s packed copy of ``weight``.
    Only where ``is_packable(x, weight)``."""
    packed = cache.get(weight)
    if packed.dim() == 3:  # our kernel's blocks (oneDNN's copy is 2-D)
        return _kernel_linear(kernel(), x, packed, weight.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _identity(weight: torch.Tensor) -> tuple:
    # An inference tensor has no version counter; it can't be changed in
    # place outside inference mode, and the storage check still catches a swap.
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), tuple(weight.shape), version
