"""``sampling``'s draw on CUDA in two Triton launches (Triton's interpreter
runs them on CPU in tests).

A row's token is the exponential race of ``sampling`` written in logs:
``argmax(x / T - log(E))`` over the tokens the filters kept, ``E = -log(u)``
exponential, ``u`` uniform: the same law as ``Categorical(softmax(x / T))``.
Each ``u`` comes from Philox keyed by the row's seed and counted by the
token's index, so a row needs no generator state of its own: a seeded row's
seed is ``derive_seed(seed, len(output))``, an unseeded row's the step's base
seed (drawn on the device from the shared generator, no host
synchronisation) plus its row. A row that keeps no finite token takes its
argmax, the first of equal maxima as ``torch.argmax``: a greedy row keeps
none (its floor is +inf). NaN logits count as -inf.

In torch the same draw takes a dozen launches and, for seeded rows, one
exponential fill a row. A row's chunks of the vocabulary run side by side:
one program a row, looping over them, is bound by its latency (0.26 ms at 8
rows of 49,152 on the H200, ``tools/bench_sampling.py --device cuda``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch

BLOCK = 2048  # tokens a program of the first pass takes: a row's vocabulary in chunks, side by side
UNSEEDED = -1  # ``seeds``' mark for a row that takes the step's base seed


@triton.jit
def _race_chunk_kernel(x_ptr, stride_x, vocab, scale_ptr, floor_ptr, seed_ptr, base_ptr,
                       best_ptr, best_at_ptr, top_ptr, top_at_ptr, UNSEEDED: tl.constexpr, BLOCK: tl.constexpr,
                       GDC: tl.constexpr):
    """A chunk of a row's tokens a program: its raw maximum and its best race
    score, each with its first index, into ``[rows, chunks]``."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if GDC:  # every input is the sampler's own write, the kernel's before it among them (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    floor = tl.load(floor_ptr + row)  # kept: logits from this one up (+inf: none, a greedy row)
    if floor != floor:  # NaN: a row drawn by no one (a graph's padding), nothing read
        return
    scale = tl.load(scale_ptr + row)  # 1 / temperature
    seed = tl.load(seed_ptr + row)
    seed = tl.where(seed == UNSEEDED, tl.load(base_ptr) + row, seed)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN
    at = row * tl.num_programs(1) + chunk
    tl.store(top_ptr + at, tl.max(x, axis=0))
    tl.store(top_at_ptr + at, chunk * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
    if floor < float("inf"):  # a greedy row keeps no token: no uniforms drawn
        u = tl.rand(seed, cols)
        score = tl.where(ok & (x >= floor) & (x > float("-inf")), x * scale - tl.log(-tl.log(u)), float("-inf"))
        tl.store(best_ptr + at, tl.max(score, axis=0))
        tl.store(best_at_ptr + at, chunk * BLOCK + tl.argmax(score, axis=0, tie_break_left=True))
    else:
        tl.store(best_ptr + at, float("-inf"))


@triton.jit
def _race_pick_kernel(best_ptr, best_at_ptr, top_ptr, top_at_ptr, floor_ptr, chunks, out_ptr, CHUNKS: tl.constexpr,
                      GDC: tl.constexpr):
    """A row a program: the first chunk's of equal best scores, else (no
    finite token kept) of equal maxima; a skipped row (floor NaN) keeps its ``out``."""
    row = tl.program_id(0).to(tl.int64)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    floor = tl.load(floor_ptr + row)
    if floor != floor:
        return
    offs = tl.arange(0, CHUNKS)
    ok = offs < chunks
    at = row * chunks + offs
    best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
    top = tl.load(top_ptr + at, mask=ok, other=float("-inf"))
    pick = tl.argmax(best, axis=0, tie_break_left=True)
    first = tl.argmax(top, axis=0, tie_break_left=True)
    drawn = tl.load(best_at_ptr + row * chunks + pick)
    greedy = tl.load(top_at_ptr + row * chunks + first)
    tl.store(out_ptr + row, tl.where(tl.max(best, axis=0) > float("-inf"), drawn, greedy).to(tl.int64))


def race(logits: torch.Tensor, scales: torch.Tensor, floors: torch.Tensor, seeds: torch.Tensor,
         base: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``[rows]`` (int64) for ``logits`` ``[rows, vocab]`` (any float
    dtype, unit stride along the vocabulary): ``scales`` (float32 ``[rows]``,
    1 / temperature), ``floors`` (float32 ``[rows]``, the least logit a row
    keeps: -inf all, +inf none, so its argmax; NaN: the row is skipped, its
    logits unread and its ``out`` left as it was), ``seeds`` (int64 ``[rows]``, a
    row's Philox seed or ``UNSEEDED``) and ``base`` (int64 ``[1]``, the
    unseeded rows' seed) on the logits' device; into ``out`` (int64
    ``[rows]``) if given. Two launches: the chunks of every row side by
    side, then a row's pick among its chunks."""
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(BLOCK, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    best, top = torch.empty(2, num_rows, chunks, dtype=torch.float32, device=logits.device)
    best_at, top_at = torch.empty(2, num_rows, chunks, dtype=torch.int32, device=logits.device)
    options = triton_launch.options(logits)
    _race_chunk_kernel[(num_rows, chunks)](
        logits, logits.stride(0), vocab, scales, floors, seeds, base, best, best_at, top, top_at,
        UNSEEDED=UNSEEDED, BLOCK=block, num_warps=4, **options,
    )  # fmt: skip
    _race_pick_kernel[(num_rows,)](
        best, best_at, top, top_at, floors, chunks, out, CHUNKS=triton.next_power_of_2(chunks), num_warps=1, **options,
    )  # fmt: skip
    return out
