"""A Triton GEMM for decode-sized steps: ``x @ W.T`` of a few rows on CUDA.

At one row a decode step is its weights read once, and cuBLAS's choice for a
few rows leaves most of the device idle on the smaller linears: on the H200
at Llama-3.2-1B's shape (``tools/profile_gpu_step.py --profile-batches 1``)
q|k|v and o ran a tile of 64 outputs a program, 32 to 48 programs on 132
multiprocessors, at 1.4-1.7 TB/s of the 4.2 the copy reaches. Here every
program takes a tile of ``BLOCK_N`` outputs over a ``1 / SPLIT_K`` share of
the inputs, so a small weight spreads over several times as many programs;
and it launches with PDL (``triton_launch``), its first weight tile loaded
before ``gdc_wait``: the weights are read while the kernel before it
finishes. Alone, or in a chain of a decoder's layers, it and cuBLAS are
about level (``tools/check_linear_kernels.py``: o and down 0.85-1.0x
cuBLAS's time, q|k|v up to 1.1x); in the served step
(``tools/profile_gpu_step.py --gemv both``) the one-row step took 1.002 ms
against 1.033 and with an adapter 1.046 against 1.143: the fused linears'
weights with every slot's A under them (``LoraLinear.fused_weight``), whose
odd widths cuBLAS tiles worst, gain most.

Split over the inputs, each program writes its float32 partial sums to a
workspace and bumps its output tile's counter; the last of a tile's
programs to arrive adds the partials up in split order (so a row's result
does not depend on which program finished first), adds the bias, writes the
tile in the output's dtype and zeroes the counter for the next call. The
workspace and counters are the device's, one set for every call: each
call writes them only after ``gdc_wait``, by when the call before it on the
stream has finished. So calls on one device must not run concurrently on
two streams (the side stream of ``LoraLinear.forward_parts`` runs the LoRA
kernels only).

Which calls take it (``linear``): an NVIDIA device of compute capability
9.0 or newer (it was measured on the H200), bfloat16 or float16, at most
``MAX_ROWS`` rows of unit stride, a contiguous weight; float32 (the parity
tests' dtype) and larger steps stay on cuBLAS. Products on the tensor cores,
sums in float32 as cuBLAS's, in another order: a logit may differ in its last
bit from cuBLAS's, the same in every step of the same size.
``tools/check_linear_kernels.py`` checks it against ``F.linear`` and times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch

# Read as each call runs (graphs keep what they captured); the GPU tests and
# ``tools/profile_gpu_step.py`` run both.
enabled = True
# Steps of more rows stay on cuBLAS: on the H200 (``tools/check_linear_kernels.py
# --rows 16 32 64``) this kernel took 0.91-1.08x cuBLAS's time at 16 rows,
# 0.97-1.26x at 32 and 1.2-1.8x at 64, where cuBLAS reads 3.1-3.9 TB/s of
# Llama-3.1-8B's larger weights.
MAX_ROWS = 8
_DTYPES = (torch.float16, torch.bfloat16)


# What a split over the inputs costs beyond its share of the weight (its float32
# partials written, then added by the tile's last program), in inputs a program
# reads: ``pick``'s one measured constant.
SPLIT_COST = 256


def pick(n: int, k: int, m: int = 1, num_sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps)`` for an ``[n, k]`` weight and
    ``m`` rows on ``num_sms`` multiprocessors: tiles of 64 x 256 (32 KiB of
    bf16), 64 x 128 past 32 rows (whose x tiles would not fit the shared
    memory beside the weight's otherwise), and the split over the inputs
    that ends soonest: a program a multiprocessor at a time, so the inputs
    each program reads times the programs' waves (``ceil(tiles * split /
    num_sms)``), plus ``SPLIT_COST`` for any split; at most two waves, at
    least 512 inputs a split, at most 16; on a tie the more programs. On
    the H200 (132 multiprocessors; every split of a weight timed at one and
    8 rows, ``tools/check_linear_kernels.py --split-sweep``) this picked the
    fastest split of Llama-3.2-1B's and 3.1-8B's linears or one within 6%
    of it, with and without every LoRA slot's A under them: 34 tiles,
    Llama-3.2-1B's down with four slots' A, take 7 splits (8.9 us against
    11.4 at 4: 136 programs left 4 to a second wave); 65, 8B's o and down
    with two slots', 4 (8.2 and 30.5 us against 11.5 and 37.8 unsplit); 96,
    8B's q|k|v, none (14.4 against 17.3 at 2)."""
    block_k = 256 if block_m(m) <= 32 else 128
    tiles = triton.cdiv(n, 64)
    best = (triton.cdiv(tiles, num_sms) * triton.cdiv(k, block_k) * block_k, 1)
    split = 2
    while split <= 16 and k // split >= 512 and tiles * split <= 2 * num_sms:
        k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        # (a split whose inputs rounded to whole tiles leave its last programs none: a smaller one's cost, more programs)
        cost = triton.cdiv(tiles * split, num_sms) * k_per + SPLIT_COST
        if cost <= best[0] and triton.cdiv(k, k_per) == split:
            best = (cost, split)
        split += 1
    return 64, block_k, best[1], 4


def block_m(m: int) -> int:
    """The rows' tile: tl.dot's least (16), or the rows' power of two."""
    return max(16, triton.next_power_of_2(m))


@triton.jit
def _gemv_kernel(x_ptr, stride_xm, w_ptr, stride_wn, b_ptr, out_ptr, stride_om, part_ptr, count_ptr, M, N, K,
                 K_PER, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k0 = pid_k * K_PER
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w_at = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight tile before the wait: a weight is no kernel's output.
    w = tl.load(w_at, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_at = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(x_at, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    for step in range(BLOCK_K, K_PER, BLOCK_K):
        ks = offs_k + step
        w = tl.load(w_at + step, mask=mask_n[:, None] & (ks < K)[None, :], other=0.0)
        x = tl.load(x_at + step, mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tile = mask_m[:, None] & mask_n[None, :]
    out_at = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=tile)
    else:
        part_at = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_at + pid_k * BLOCK_M * N, acc, mask=tile)
        tl.debug_barrier()  # every thread's partials written before the counter moves
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the tile's last program: the sum, in split order
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_at + s * BLOCK_M * N, mask=tile, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=tile)
            tl.atomic_xchg(count_ptr + pid_n, 0)


class _Workspace:
    """A device's partial sums and tile counters, grown as wider weights come.
    Grown inside a graph capture, the new tensors come from the graph's pool
    and the counters' zeroing is captured too (a replay zeroes zeros); an
    outgrown tensor is kept, since a captured graph may still point at it."""

    def __init__(self) -> None:
        self.parts: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, planes: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = -1 if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device()
        parts, counts = self.parts.get(index), self.counts.get(index)
        if parts is None or parts.numel() < planes * n:
            self.retired.extend([] if parts is None else [parts])
            parts = self.parts[index] = torch.empty(max(planes * n, 1 << 20), dtype=torch.float32,
                                                    device=device)
        if counts is None or counts.numel() < tiles:
            self.retired.extend([] if counts is None else [counts])
            counts = self.counts[index] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        return parts, counts


_workspace = _Workspace()


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` takes the kernel (see the module's docstring)."""
    return (enabled and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and weight.dtype == x.dtype and weight.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.shape[1] == x.shape[1] and not torch.is_grad_enabled()
            # the kind of device the tiles were measured on against cuBLAS; elsewhere cuBLAS keeps every call
            and triton_launch.is_sm90(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a decode-sized ``x``, or None where it
    does not take it (``takes``)."""
    if not takes(x, weight):
        return None
    return launch(x, weight, bias)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel on ``x [M <= 64, K]`` and ``weight [N, K]`` (unit stride in
    K), with ``pick``'s tiles or ``config``'s (``tools/check_linear_kernels.py
    --sweep``); no checks (``linear`` makes them; tests call it on CPU, under
    Triton's interpreter)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, split, warps = config or pick(n, k, m, triton_launch.num_sms(x.device, 132))
    tiles = triton.cdiv(n, block_n)
    rows = block_m(m)
    parts, counts = _workspace.get(x.device, split * rows, n, tiles)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    _gemv_kernel[(tiles, split)](x, x.stride(0), weight, weight.stride(0), weight if bias is None else bias, out,
                                 out.stride(0), parts, counts, m, n, k, k_per, HAS_BIAS=bias is not None,
                                 BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                                 num_warps=warps, **triton_launch.options(x))
    return out
