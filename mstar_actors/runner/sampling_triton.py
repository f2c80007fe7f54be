"""``sampling``'s draw on CUDA in one Triton kernel (Triton's interpreter runs
it on CPU in tests).

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

In torch the same draw took a dozen launches and, for seeded rows, one
exponential fill a row: ``tools/bench_sampling.py --device cuda``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch

BLOCK = 2048  # tokens a program reads at a time, in its loop over the row
UNSEEDED = -1  # ``seeds``' mark for a row that takes the step's base seed


@triton.jit
def _race_kernel(x_ptr, stride_x, vocab, scale_ptr, floor_ptr, seed_ptr, base_ptr, out_ptr,
                 BLOCK: tl.constexpr, GDC: tl.constexpr):
    """One row a program: its raw argmax and its race over the whole row."""
    row = tl.program_id(0)
    scale = tl.load(scale_ptr + row)  # 1 / temperature
    floor = tl.load(floor_ptr + row)  # kept: logits from this one up (+inf: none, a greedy row)
    floor = tl.where(floor == floor, floor, float("-inf"))  # NaN logits made top_k's floor NaN
    seed = tl.load(seed_ptr + row)
    if GDC:  # the logits and the base seed are the step's own writes (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seed = tl.where(seed == -1, tl.load(base_ptr) + row, seed)
    offs = tl.arange(0, BLOCK)
    top = tl.full((), float("-inf"), tl.float32)
    top_at = tl.full((), 0, tl.int32)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN
        m = tl.max(x, axis=0)
        at = start + tl.argmax(x, axis=0, tie_break_left=True)
        top_at = tl.where(m > top, at, top_at)  # strictly: the first block's of equal maxima
        top = tl.maximum(m, top)
        u = tl.rand(seed, cols)
        score = x * scale - tl.log(-tl.log(u))
        score = tl.where(ok & (x >= floor) & (x > float("-inf")), score, float("-inf"))
        s = tl.max(score, axis=0)
        s_at = start + tl.argmax(score, axis=0, tie_break_left=True)
        best_at = tl.where(s > best, s_at, best_at)
        best = tl.maximum(s, best)
    tl.store(out_ptr + row, tl.where(best > float("-inf"), best_at, top_at).to(tl.int64))


def race(logits: torch.Tensor, scales: torch.Tensor, floors: torch.Tensor, seeds: torch.Tensor,
         base: torch.Tensor) -> torch.Tensor:
    """Token ids ``[rows]`` (int64) for ``logits`` ``[rows, vocab]`` (any float
    dtype, unit stride along the vocabulary): ``scales`` (float32 ``[rows]``,
    1 / temperature), ``floors`` (float32 ``[rows]``, the least logit a row
    keeps: -inf all, +inf none, so its argmax), ``seeds`` (int64 ``[rows]``, a row's
    Philox seed or ``UNSEEDED``) and ``base`` (int64 ``[1]``, the unseeded
    rows' seed) on the logits' device."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _race_kernel[(num_rows,)](
        logits, logits.stride(0), vocab, scales, floors, seeds, base, out,
        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), num_warps=8, **triton_launch.options(logits),
    )  # fmt: skip
    return out
