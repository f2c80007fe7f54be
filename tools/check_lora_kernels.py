"""Check the LoRA Triton kernels against the torch reference, then time them.

For every config (linear x batch tokens x rank x slot mix) of a
Llama-3.2-1B-shaped model it first validates the kernels' delta against the
fp32 reference on fresh random inputs, then times the whole delta
(``LoraStack.add_delta_rows``: one launch, the kernel its row count picks,
plus the step's once-per-step row grouping) and the base GEMM ``x @ W.T`` of
the same linear with CUDA events (warmup, median), and prints one table row:
shape, mix, kernel us, base GEMM us, overhead %. A config that fails is
reported in its row and the run goes on; the exit status is 1 if any failed.

    python tools/check_lora_kernels.py                 # full run on a GPU
    python tools/check_lora_kernels.py --dry-run       # CPU: reference path, small subset
    python tools/check_lora_kernels.py --tokens 1 256 --ranks 16 --linears qkv

``--decode`` prints the decode-step table instead: for batches of 1, 8, 32
and 64 rows (one per sequence) and each linear, the time per call of the
base GEMM and of the rows kernels (``add_delta_rows``: one program per row
below ``MIN_GEMM_ROWS``, a GEMM's shrink and one expand below ``MIN_SPLIT_ROWS``,
rows grouped by slot from there), eager and inside one
CUDA graph of 66 back-to-back calls (a Llama-3.2-1B decode step makes 66
LoRA calls: 16 layers x 4 linears, embedding, LM head). Eager times are the
wall time of 66 back-to-back calls / 66, launch overhead included, as an
eager step pays it; graph times are the replay's GPU time / 66.

    python tools/check_lora_kernels.py --decode                 # GPU
    python tools/check_lora_kernels.py --decode --dry-run       # CPU: reference path, no graphs

``--rows-table`` times each rows kernel against the others for one
linear's call inside a CUDA graph (us per call, ``--calls`` back-to-back
calls a graph): ``bgmv_rows`` and ``shrink_expand_rows``
with its default blocks and a few neighbours of them, then the whole linear
with its base GEMM: the GEMM alone, GEMM + ``bgmv_rows``, and the fused
GEMM (every slot's A under the weight) + ``expand_rows``, for q|k|v, o,
gate|up and down at 8-128 rows, one adapter and 4 mixed, rank 16; every
variant is first checked against the fp32 reference. Then the per-layer
sum of the four linears per variant, and the step's ``group_rows`` (once
per step, shared by every linear, not in the per-call figures). With
``--dry-run`` (or no CUDA device) it runs tiny linears in Triton's
interpreter on the CPU, eagerly, to check the tool end to end.

    python tools/check_lora_kernels.py --rows-table              # GPU
    python tools/check_lora_kernels.py --rows-table --dry-run    # CPU, interpreter, seconds

``--fold-table`` times the folded expands: ``silu_mul`` over a fused
gate|up (tiles of ``triton_fused.FOLD_ROWS`` rows, a ``tl.dot`` a slot of
a tile), Qwen3.5's ``conv_step`` over a fused in_proj (one row a
program, up to ``deltanet_decode.CONV_FOLD_MAX_ROWS``; past them ``-``)
and the residual's ``rms_norm`` over o's or down's (one row a program),
Qwen3.5-0.8B's widths, rank 16, each at 8-256 rows, one adapter and 4
(interleaved row by row, and grouped as the scheduler orders a step's
rows), us per call inside a CUDA graph beside the op alone and beside
``expand_rows`` then the op (``split``: what runs without the fold; ``s.rows``
the same with the expand one program a row, where it would take tiles of rows);
every fold is first checked to give its rows the same result, bit for bit,
in reverse order (a row's result must not depend on its neighbours in a
tile). With ``--dry-run`` (or no CUDA device) it runs a
few rows in Triton's interpreter.

    python tools/check_lora_kernels.py --fold-table              # GPU
    python tools/check_lora_kernels.py --fold-table --dry-run    # CPU, interpreter

``--output PATH`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import non_negative_int, positive_int  # noqa: E402
from _gpu_timing import capture_graph, eager_us  # noqa: E402
from mstar_actors.lora import LoraStack, build_segments  # noqa: E402
from mstar_actors.lora.ops import LoraSegments, expand_ref, shrink_ref  # noqa: E402
from mstar_actors.models.lora_layers import lora_kernels  # noqa: E402

# Llama-3.2-1B: hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64.
HIDDEN, INTER, VOCAB = 2048, 8192, 128256
Q_SIZE, KV_SIZE = 32 * 64, 8 * 64
LINEARS = {
    "qkv": (HIDDEN, (Q_SIZE, KV_SIZE, KV_SIZE)),
    "o": (Q_SIZE, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
    "lm_head": (HIDDEN, (VOCAB,)),
}
TOKENS = (1, 8, 32, 256, 2048)
RANKS = (8, 16, 64)
MIXES = ("base", "one", "mixed4", "random")
MAX_LORAS = 8  # device slots besides slot 0
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@dataclass
class Row:
    linear: str
    in_features: int
    out_features: int
    tokens: int
    rank: int
    mix: str
    num_segments: int = 0  # distinct adapters among the rows
    rel_error: float | None = None
    kernel_us: float | None = None
    base_gemm_us: float | None = None
    overhead_pct: float | None = None
    error: str | None = None


def slot_mix(mix: str, num_tokens: int, rng: random.Random) -> list[int]:
    """Per-token slots: tokens come in up to 16 contiguous requests, each on one slot."""
    num_requests = min(num_tokens, 16)
    bounds = [round(i * num_tokens / num_requests) for i in range(num_requests + 1)]
    if mix == "base":
        per_request = [0] * num_requests
    elif mix == "one":
        per_request = [1] * num_requests
    elif mix == "mixed4":
        per_request = [1 + i % 4 for i in range(num_requests)]
    elif mix == "random":
        per_request = [rng.randrange(MAX_LORAS + 1) for _ in range(num_requests)]
    else:
        raise ValueError(f"unknown mix {mix!r}; accepted: {MIXES}")
    return [per_request[r] for r in range(num_requests) for _ in range(bounds[r + 1] - bounds[r])]


def make_stack(in_features, output_sizes, rank, dtype, device, gen) -> LoraStack:
    """Random factors in every adapter slot, each at ``rank`` (the stack's max rank)."""
    stack = LoraStack(in_features, output_sizes, num_slots=MAX_LORAS + 1, max_rank=rank, dtype=dtype, device=device,
                      kernels=lora_kernels(device))
    a_shape, b_shape = stack.a[:, 1:].shape, stack.b[1:].shape
    stack.a[:, 1:] = (torch.randn(a_shape, generator=gen) / in_features**0.5).to(dtype).to(device)
    stack.b[1:] = (torch.randn(b_shape, generator=gen) / rank**0.5).to(dtype).to(device)
    stack.scales[:, 1:] = (torch.rand(stack.scales[:, 1:].shape, generator=gen) + 0.5).to(device)
    return stack


def reference_delta(stack: LoraStack, x: torch.Tensor, segments: LoraSegments) -> torch.Tensor:
    """The fp32 delta from the same (rounded) weights, by the torch reference."""
    y = torch.zeros(x.shape[0], stack.offsets[-1], device=x.device)
    buf = shrink_ref(x.float(), stack.a.float(), segments)
    return expand_ref(y, buf, stack.b.float(), stack.scales, segments, stack.offsets)


def time_us(fn, *, device: str, warmup: int, iters: int) -> float:
    """Median microseconds of ``fn``: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def check_one(row: Row, output_sizes, args, device: str, dtype: torch.dtype) -> None:
    """Validate, then time one config, filling ``row`` in place."""
    seed = args.seed + zlib.crc32(f"{row.linear}/{row.tokens}/{row.rank}/{row.mix}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    stack = make_stack(row.in_features, output_sizes, row.rank, dtype, device, gen)
    slots = slot_mix(row.mix, row.tokens, rng)
    segments = build_segments(slots)  # the reference's input
    row.num_segments = segments.num_segments
    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)  # the per-step copy, outside the timed region
    x = torch.randn(row.tokens, row.in_features, generator=gen).to(dtype).to(device)
    y = torch.zeros(row.tokens, row.out_features, dtype=dtype, device=device)
    stack.add_delta_rows(y, x, row_slots)
    want = reference_delta(stack, x, segments)
    scale = want.norm().item()
    row.rel_error = 0.0 if scale == 0 and y.abs().max().item() == 0 else (y.float() - want).norm().item() / max(scale, 1e-12)
    if row.rel_error >= TOLERANCE[dtype]:
        row.error = f"relative error {row.rel_error:.2e} >= {TOLERANCE[dtype]:.0e}"
        return
    weight = (torch.randn(row.out_features, row.in_features, generator=gen) / row.in_features**0.5).to(dtype).to(device)
    timing = dict(device=device, warmup=args.warmup, iters=args.iters)
    row.kernel_us = time_us(lambda: stack.add_delta_rows(y, x, row_slots), **timing)
    row.base_gemm_us = time_us(lambda: x @ weight.T, **timing)
    row.overhead_pct = 100.0 * row.kernel_us / row.base_gemm_us


def configs(args):
    for linear in args.linears:
        in_features, output_sizes = LINEARS[linear]
        for tokens in args.tokens:
            for rank in args.ranks:
                for mix in args.mixes:
                    yield Row(linear, in_features, sum(output_sizes), tokens, rank, mix), output_sizes


def format_row(row: Row) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    shape = f"{row.linear} {row.in_features}->{row.out_features}"
    return (
        f"{shape:<24} {row.tokens:>5} {row.rank:>4} {row.mix:<7} {row.num_segments:>4} "
        f"{num(row.rel_error, '.1e'):>8} {num(row.kernel_us, '.1f'):>9} {num(row.base_gemm_us, '.1f'):>9} "
        f"{num(row.overhead_pct, '.1f'):>8}  {row.error or ''}"
    )


HEADER = f"{'shape':<24} {'T':>5} {'rank':>4} {'mix':<7} {'segs':>4} {'rel_err':>8} {'lora_us':>9} {'gemm_us':>9} {'ovh_%':>8}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, torch reference path, a small subset of configs")
    p.add_argument("--decode", action="store_true", help="the decode-step table: GEMM vs rows kernels, eager and graphed")
    p.add_argument("--rows-table", action="store_true", help="bgmv / shrink-expand variants per linear, in graphs")
    p.add_argument("--fold-table", action="store_true", help="the folded expands beside their ops alone, in graphs")
    p.add_argument("--rows", nargs="+", type=positive_int, default=None,
                   help="--rows-table's row counts (default 8 16 32 64 128), --fold-table's (default 8 32 64 128 256)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="--rows-table's variants to time (default all: see rows_variants and linear_variants)")
    p.add_argument("--calls", type=positive_int, default=None,
                   help="calls per graph (default 66, a decode step's LoRA calls)")
    p.add_argument("--min-split-rows", type=int, default=None,
                   help="set triton_ops.MIN_SPLIT_ROWS for this run (the routing add_delta_rows follows in every section)")
    p.add_argument("--linears", nargs="+", choices=list(LINEARS), default=list(LINEARS))
    p.add_argument("--tokens", nargs="+", type=positive_int, default=list(TOKENS))
    p.add_argument("--ranks", nargs="+", type=positive_int, default=list(RANKS))
    p.add_argument("--mixes", nargs="+", choices=(*MIXES, "grouped4"), default=list(MIXES))
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=non_negative_int, default=10)
    p.add_argument("--iters", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the rows as JSON here too")
    args = p.parse_args(argv)
    if args.decode or args.rows_table or args.fold_table:
        return args
    if args.dry_run:
        args.linears = [l for l in args.linears if l != "lm_head"][:2]
        args.tokens = [t for t in args.tokens if t <= 32][:2] or [1]
        args.ranks = args.ranks[:1]
        args.warmup, args.iters = 1, 3
    return args


# ---------------------------------------------------------------- decode table

DECODE_BATCHES = (1, 8, 32, 64)
CALLS_PER_STEP = 66  # Llama-3.2-1B: 16 layers x (qkv, o, gate_up, down) + embedding + LM head


@dataclass
class DecodeRow:
    linear: str
    in_features: int
    out_features: int
    batch: int
    rank: int
    mix: str
    rel_error: float | None = None  # rows kernel vs the fp32 reference
    gemm_us: float | None = None
    gemm_graph_us: float | None = None
    rows_us: float | None = None
    rows_graph_us: float | None = None
    error: str | None = None


def decode_slots(mix: str, batch: int, rng: random.Random) -> list[int]:
    """One slot per row (each row its own sequence); mixed4 interleaves adapters row by row, grouped4 puts
    each one's rows side by side (as the scheduler orders a step's decodes)."""
    if mix == "base":
        return [0] * batch
    if mix == "one":
        return [1] * batch
    if mix == "mixed4":
        return [1 + i % 4 for i in range(batch)]
    if mix == "grouped4":
        return sorted(1 + i % 4 for i in range(batch))
    return [rng.randrange(MAX_LORAS + 1) for _ in range(batch)]


def graph_us(fn, *, warmup: int, iters: int, calls: int = CALLS_PER_STEP) -> float:
    """Median GPU microseconds per call of one CUDA graph of ``calls`` back-to-back calls."""
    graph = capture_graph(fn, calls)
    return time_us(graph.replay, device="cuda", warmup=warmup, iters=iters) / calls


def check_decode_one(row: DecodeRow, output_sizes, args, device: str, dtype: torch.dtype) -> None:
    """Validate the rows kernel, then time GEMM / rows for one config, filling ``row``."""
    seed = args.seed + zlib.crc32(f"decode/{row.linear}/{row.batch}/{row.rank}/{row.mix}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    stack = make_stack(row.in_features, output_sizes, row.rank, dtype, device, gen)
    slots = decode_slots(row.mix, row.batch, rng)
    segments = build_segments(slots)  # the reference's input
    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    groups = stack.row_groups(row_slots)  # once per step in a model, shared by its 66 calls
    x = torch.randn(row.batch, row.in_features, generator=gen).to(dtype).to(device)
    y = torch.zeros(row.batch, row.out_features, dtype=dtype, device=device)
    stack.add_delta_rows(y, x, row_slots, groups)
    want = reference_delta(stack, x, segments)
    scale = want.norm().item()
    row.rel_error = 0.0 if scale == 0 and y.abs().max().item() == 0 else (y.float() - want).norm().item() / max(scale, 1e-12)
    if row.rel_error >= TOLERANCE[dtype]:
        row.error = f"rows kernel: relative error {row.rel_error:.2e} >= {TOLERANCE[dtype]:.0e}"
        return
    weight = (torch.randn(row.out_features, row.in_features, generator=gen) / row.in_features**0.5).to(dtype).to(device)
    out = torch.empty(row.batch, row.out_features, dtype=dtype, device=device)
    gemm = lambda: torch.matmul(x, weight.T, out=out)  # noqa: E731
    rows = lambda: stack.add_delta_rows(y, x, row_slots, groups)  # noqa: E731
    timing = dict(warmup=args.warmup, iters=args.iters, calls=args.calls)
    row.gemm_us = eager_us(gemm, device=device, **timing)
    row.rows_us = eager_us(rows, device=device, **timing)
    if device == "cuda":
        row.gemm_graph_us = graph_us(gemm, **timing)
        row.rows_graph_us = graph_us(rows, **timing)


def decode_configs(args):
    for linear in args.linears:
        in_features, output_sizes = LINEARS[linear]
        for batch in args.tokens:
            for rank in args.ranks:
                for mix in args.mixes:
                    yield DecodeRow(linear, in_features, sum(output_sizes), batch, rank, mix), output_sizes


DECODE_HEADER = (
    f"{'shape':<24} {'B':>3} {'rank':>4} {'mix':<7} {'rel_err':>8} "
    f"{'gemm':>8} {'gemm_g':>8} {'rows':>8} {'rows_g':>8}  (us per call; _g: in a graph)"
)


def format_decode_row(row: DecodeRow) -> str:
    def num(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    shape = f"{row.linear} {row.in_features}->{row.out_features}"
    return (
        f"{shape:<24} {row.batch:>3} {row.rank:>4} {row.mix:<7} {num(row.rel_error, '.1e'):>8} "
        f"{num(row.gemm_us):>8} {num(row.gemm_graph_us):>8} {num(row.rows_us):>8} "
        f"{num(row.rows_graph_us):>8}  {row.error or ''}"
    )


def decode_main(args) -> int:
    """The ``--decode`` run: defaults narrowed to decode batches, rank 16, the mixed4 mix."""
    defaults = {"tokens": list(TOKENS), "ranks": list(RANKS), "mixes": list(MIXES)}
    if args.tokens == defaults["tokens"]:
        args.tokens = list(DECODE_BATCHES)
    if args.ranks == defaults["ranks"]:
        args.ranks = [16]
    if args.mixes == defaults["mixes"]:
        args.mixes = ["mixed4"]
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if args.dry_run:
        args.linears, args.tokens, args.warmup, args.iters = args.linears[:1], args.tokens[:2], 1, 2
    args.calls = 2 if args.dry_run else (args.calls or CALLS_PER_STEP)
    dtype = getattr(torch, args.dtype)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    print(f"# decode  {env}  dtype={args.dtype}  max_loras={MAX_LORAS}  seed={args.seed}  calls per timing={args.calls}")
    print(DECODE_HEADER)
    return run_rows(decode_configs(args), check_decode_one, format_decode_row, args, device, dtype, env)


# ---------------------------------------------------------------- rows kernels, side by side

TABLE_ROWS = (8, 16, 32, 64, 128)
TABLE_LINEARS = ("qkv", "o", "gate_up", "down")  # one decoder layer
TINY_LINEARS = {"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (128, 128)), "down": (128, (64,))}


def rows_variants(triton_ops, stack: LoraStack, num_rows: int, num_sms: int) -> dict:
    """name -> fn(y, x, row_slots, groups): the rows kernels (``bgmv_rows``, and ``gemm_rows``: the
    shrink a GEMM of every slot's A, then ``expand_rows``) and the shrink-expand blocks around its
    default (BLOCK_M, BLOCK_K, SPLIT_K, BLOCK_N, TILES)."""
    num_shards, _, _, k = stack.a.shape
    bm, bk, sk, bn, tiles = triton_ops._split_blocks(num_rows, num_shards, k, max(stack.output_sizes), num_sms)
    blocks = {
        "split": (bm, bk, sk, bn, tiles),
        "bn64": (bm, bk, sk, 64, tiles),
        "bn256": (bm, bk, sk, 256, tiles),
        "sk/2": (bm, bk, max(1, sk // 2), bn, tiles),
        "sk*2": (bm, bk, sk * 2, bn, tiles),
        "bk128": (bm, 128, sk, bn, tiles),
        "t2": (bm, bk, sk, bn, 2),
    }

    def split(b):
        return lambda y, x, slots, groups: triton_ops.shrink_expand_rows(stack, y, x, groups, blocks=b)

    variants = {
        "bgmv": lambda y, x, slots, groups: triton_ops.bgmv_rows(stack, y, x, slots),
        "gemm+x": lambda y, x, slots, groups: triton_ops.gemm_rows(stack, y, x, slots),
    }
    return variants | {name: split(b) for name, b in blocks.items()}


def linear_variants(triton_ops, stack: LoraStack, weight: torch.Tensor) -> dict:
    """name -> fn(x, row_slots): the whole LoRA linear, base GEMM included:
    "gemm" the base alone, "g+bgmv" the GEMM then ``bgmv_rows``, "g+fused"
    one GEMM over the weight with every adapter slot's A under it, then
    ``expand_rows`` (``LoraStack.fuse_under``: what CUDA serving runs below
    ``MIN_SPLIT_ROWS``), with 4 or 8 warps, and "g+f.rows" with the expand one program a row
    at any row count (``expand_rows`` takes tiles of rows from ``MIN_TILE_ROWS``)."""
    import copy

    fused_stack = copy.copy(stack)  # fuse_under replaces its ``a`` only: the original stays unfused
    fused, _ = fused_stack.fuse_under(weight, None)
    n = weight.shape[0]

    def gemm_bgmv(x, slots):
        return triton_ops.bgmv_rows(stack, F.linear(x, weight), x, slots)

    def gemm_fused(num_warps):
        def run(x, slots):
            out = F.linear(x, fused)
            return triton_ops.expand_rows(fused_stack, out[:, :n], fused_stack.fused_shrink(out), slots,
                                          num_warps=num_warps)
        return run

    return {"gemm": lambda x, slots: F.linear(x, weight), "g+bgmv": gemm_bgmv, "g+fused": gemm_fused(None),
            "g+f.w4": gemm_fused(4), "g+f.rows": expand_by_rows(gemm_fused(None))}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm().item()
    return (got.float() - want).norm().item() / max(scale, 1e-12)


def time_rows_variant(fn, y, x, row_slots, groups, args, device: str) -> float:
    call = lambda: fn(y, x, row_slots, groups)  # noqa: E731
    timing = dict(warmup=args.warmup, iters=args.iters, calls=args.calls)
    return graph_us(call, **timing) if device == "cuda" else eager_us(call, device=device, **timing)


def table_one(triton_ops, linear: str, shape, num_rows: int, mix: str, args, device: str, dtype) -> dict:
    """us per call of every variant on one linear / rows / mix (None where it failed), after checking each."""
    in_features, output_sizes = shape
    seed = args.seed + zlib.crc32(f"table/{linear}/{num_rows}/{mix}".encode())
    gen = torch.Generator().manual_seed(seed)
    stack = make_stack(in_features, output_sizes, 16, dtype, device, gen)
    slots = decode_slots(mix, num_rows, None)
    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    groups = triton_ops.group_rows(row_slots, stack.num_slots)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype).to(device)
    want = reference_delta(stack, x, build_segments(slots))
    result = {}
    for name, fn in rows_variants(triton_ops, stack, num_rows, triton_ops._num_sms(torch.device(device))).items():
        if args.variants and name not in args.variants:
            continue
        y = torch.zeros(num_rows, stack.offsets[-1], dtype=dtype, device=device)
        try:
            err = rel_error(fn(y, x, row_slots, groups), want)
            if err >= TOLERANCE[dtype]:
                raise AssertionError(f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}")
            result[name] = time_rows_variant(fn, y, x, row_slots, groups, args, device)
        except Exception as err:  # one failing variant must not end the run
            print(f"# {linear} rows={num_rows} {mix} {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}", file=sys.stderr)
            result[name] = None
    weight = (torch.randn(stack.offsets[-1], in_features, generator=gen) / in_features**0.5).to(dtype).to(device)
    base = F.linear(x, weight).float()
    for name, fn in linear_variants(triton_ops, stack, weight).items():
        if args.variants and name not in args.variants:
            continue
        try:
            if name != "gemm":
                err = rel_error(fn(x, row_slots).float() - base, want)
                if err >= TOLERANCE[dtype]:
                    raise AssertionError(f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}")
            result[name] = time_rows_variant(lambda y, x_, s, g, fn=fn: fn(x_, s), None, x, row_slots, None, args, device)
        except Exception as err:
            print(f"# {linear} rows={num_rows} {mix} {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}", file=sys.stderr)
            result[name] = None
    return result


def _cells(values, names) -> str:
    return " ".join(f"{'ERR' if values.get(n) is None else format(values[n], '.1f'):>6}" for n in names)


def rows_table_main(args) -> int:
    """The ``--rows-table`` run; exit status 1 if any variant failed its check."""
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu":  # the kernels on CPU tensors: Triton's interpreter, set before the module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from mstar_actors.lora import triton_ops

    linears = TINY_LINEARS if device == "cpu" else LINEARS
    names_linears = [l for l in (args.linears if args.linears != list(LINEARS) else TABLE_LINEARS) if l in linears]
    rows = args.rows or ([8, 16] if device == "cpu" else list(TABLE_ROWS))
    mixes = ["one", "mixed4"] if args.mixes == list(MIXES) else args.mixes
    if device == "cpu":
        args.warmup, args.iters, args.calls = 0, 1, 1
        if args.dtype != "float32":  # Triton 3.6's interpreter computes tl.dot of bf16/fp16 tiles wrongly
            print(f"# {args.dtype} -> float32 in the interpreter (its tl.dot of 16-bit tiles is wrong)")
            args.dtype = "float32"
    args.calls = args.calls or CALLS_PER_STEP
    dtype = getattr(torch, args.dtype)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"}
    print(f"# rows kernels  {env}  dtype={args.dtype}  rank=16  max_loras={MAX_LORAS}  calls per graph={args.calls}")
    print("# us per call; split: shrink_expand_rows at its default blocks, the others its neighbours (see rows_variants)")
    names, table = None, []
    for num_rows in rows:
        for mix in mixes:
            for linear in names_linears:
                values = table_one(triton_ops, linear, linears[linear], num_rows, mix, args, device, dtype)
                if names is None:
                    names = list(values)
                    print(f"{'linear':<8} {'rows':>4} {'mix':<6} " + " ".join(f"{n:>6}" for n in names))
                table.append({"linear": linear, "rows": num_rows, "mix": mix, "us": values})
                print(f"{linear:<8} {num_rows:>4} {mix:<6} {_cells(values, names)}", flush=True)
    print_layer_sums(table, names, rows, mixes, names_linears)
    print_group_rows(triton_ops, rows, args, device)
    failed = sum(v is None for r in table for v in r["us"].values())
    print(f"# {len(table) * len(names or ()) - failed} variants passed, {failed} failed")
    out = args.output
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": env, "dtype": args.dtype, "calls": args.calls, "rows": table}, indent=1))
        print(f"# wrote {out}")
    return 1 if failed else 0


def print_layer_sums(table: list[dict], names, rows, mixes, linears) -> None:
    """Per (rows, mix): each variant's sum over the layer's linears, and the
    sum of the best split variant per linear (what per-linear blocks could give)."""
    if not names:
        return
    splits = [n for n in names if n != "bgmv" and not n.startswith("g")]  # the split variants (gemm, g+...: whole linears)
    print(f"# per layer ({' + '.join(linears)})")
    print(f"{'layer':<8} {'rows':>4} {'mix':<6} " + " ".join(f"{n:>6}" for n in names) + f" {'best':>6}")
    for num_rows in rows:
        for mix in mixes:
            entries = [r["us"] for r in table if r["rows"] == num_rows and r["mix"] == mix]
            sums = {n: None if any(e[n] is None for e in entries) else sum(e[n] for e in entries) for n in names}
            best = [min((e[n] for n in splits if e[n] is not None), default=None) for e in entries]
            best_sum = None if None in best else sum(best)
            print(f"{'sum':<8} {num_rows:>4} {mix:<6} {_cells(sums, names)} {_cells({'b': best_sum}, ['b'])}")


def print_group_rows(triton_ops, rows, args, device: str) -> None:
    """``group_rows`` (once a step before the grouped kernels), us, in a graph on CUDA."""
    figures = []
    for num_rows in rows:
        slots = torch.tensor(decode_slots("mixed4", num_rows, None), dtype=torch.int32, device=device)
        fn = lambda: triton_ops.group_rows(slots, MAX_LORAS + 1)  # noqa: E731
        timing = dict(warmup=args.warmup, iters=args.iters, calls=1)
        us = graph_us(fn, **timing) if device == "cuda" else eager_us(fn, device=device, **timing)
        figures.append(f"{num_rows}: {us:.1f}")
    print("# group_rows once a step, us (rows: us): " + ", ".join(figures))

def run_rows(configs_, check, format_, args, device, dtype, env: dict) -> int:
    """Check and print each configuration's row (a failure is recorded, not
    fatal), then write them all as JSON to ``--output``. Exit status 1 if any
    row failed."""
    rows = []
    for row, output_sizes in configs_:
        try:
            check(row, output_sizes, args, device, dtype)
        except Exception as err:  # one failing config must not end the run
            row.error = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
        print(format_(row), flush=True)
    failed = [r for r in rows if r.error]
    print(f"# {len(rows) - len(failed)} passed, {len(failed)} failed")
    out = args.output
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": env, "dtype": args.dtype, "rows": [asdict(r) for r in rows]}, indent=1))
        print(f"# wrote {out}")
    return 1 if failed else 0


# ---------------------------------------------------------------- fold table

# Qwen3.5-0.8B: intermediate 3584; in_proj q | k | v | z | b | a (the first three convolved, kernel 4); o's
# and down's expand into the hidden size, 1024, added by the residual's RMSNorm (zero-centred).
FOLD_WIDTHS = {"gate_up": [3584, 3584], "in_proj": [2048, 2048, 2048, 2048, 16, 16], "norm": [1024]}
TINY_FOLD_WIDTHS = {"gate_up": [96, 96], "in_proj": [64, 64, 64, 64, 4, 4], "norm": [96]}  # the interpreter's
FOLD_TABLE_ROWS = (8, 16, 24, 32, 64, 128, 256)  # around the lines the folds draw


def fold_ops(widths: dict, num_rows: int, mix: str, dtype, device: str, gen, flip: bool = False) -> dict:
    """name -> (the op with its fold (None where it does not fold), the op
    alone, ``expand_rows`` then the op, what the fold wrote: its result and
    the tensors it writes in place, given the result), on fresh inputs; with
    ``flip``, the fold's rows in reverse order (what it wrote flipped back)."""
    from mstar_actors.lora import triton_ops
    from mstar_actors.models import deltanet_decode, triton_fused
    from mstar_actors.models.lora_layers import PendingExpand

    slots = torch.tensor(decode_slots(mix, num_rows, None), dtype=torch.int32, device=device)
    order = torch.arange(num_rows - 1, -1, -1, device=device) if flip else torch.arange(num_rows, device=device)
    ops = {}
    for name, sizes in widths.items():
        stack = LoraStack(64, sizes, num_slots=5, max_rank=16, dtype=dtype, device=device, kernels=triton_ops)
        stack.b[1:] = (torch.randn(stack.b[1:].shape, generator=gen) * 0.1).to(dtype).to(device)
        stack.scales[:, 1:] = 0.5
        width = sum(sizes)
        out = torch.randn(num_rows, width + len(sizes) * 5 * 16, generator=gen).to(dtype).to(device)[order]
        expand, y = PendingExpand(stack, out[:, width:], slots[order]), out[:, :width]
        if name == "gate_up":
            ops[name] = (lambda y=y, e=expand: triton_fused.silu_mul(y, expand=e), lambda y=y: triton_fused.silu_mul(y),
                         lambda y=y, e=expand: (e.apply(y), triton_fused.silu_mul(y)), lambda got: [got[order]])
            continue
        if name == "norm":
            weight = (torch.randn(width, generator=gen) / 4).to(dtype).to(device)
            residual = torch.randn(num_rows, width, generator=gen).to(dtype).to(device)[order]
            plain = (lambda y=y, w=weight, r=residual: triton_fused.rms_norm(y, w, 1e-6, r, zero_centered=True))
            ops[name] = (lambda y=y, e=expand, w=weight, r=residual:
                         triton_fused.rms_norm(y, w, 1e-6, r, zero_centered=True, expand=e),
                         plain, lambda y=y, e=expand, plain=plain: (e.apply(y), plain()),
                         lambda got, r=residual: [got[order], r[order]])
            continue
        channels = sum(sizes[:3])
        weight = (torch.randn(channels, 4, generator=gen) / 2).to(dtype).to(device)
        pool = torch.randn(num_rows + 1, channels, 3, generator=gen).to(dtype).to(device)
        state = torch.arange(1, num_rows + 1, device=device)[order]
        context = torch.full((num_rows,), 40, dtype=torch.int32, device=device)
        plain = (lambda y=y, w=weight, p=pool, s=state, c=context: deltanet_decode.conv_step(y, w, p, s, c))
        ops[name] = (lambda y=y, e=expand, w=weight, p=pool, s=state, c=context: deltanet_decode.conv_step(y, w, p, s, c, e),
                     plain, lambda y=y, e=expand, plain=plain: (e.apply(y), plain()),
                     lambda got, y=y, p=pool: [got[order], y[order], p])
    return ops


def expand_by_rows(fn):
    """``fn`` with ``expand_rows`` one program a row at any row count (its tiles of rows off): the
    fold table's ``s.rows`` column, and the linear table's ``g+f.rows``."""
    from mstar_actors.lora import triton_ops

    def run(*args):
        saved, triton_ops.MIN_TILE_ROWS = triton_ops.MIN_TILE_ROWS, 1 << 30
        try:
            return fn(*args)
        finally:
            triton_ops.MIN_TILE_ROWS = saved
    return run


def fold_table_main(args) -> int:
    """The ``--fold-table`` run; exit status 1 if a row's result depends on its neighbours."""
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from mstar_actors.lora import triton_ops  # after the interpreter's switch: read as its kernels are made
    rows = args.rows or ([16, 37] if device == "cpu" else list(FOLD_TABLE_ROWS))
    widths = TINY_FOLD_WIDTHS if device == "cpu" else FOLD_WIDTHS
    mixes = ["one", "mixed4", "grouped4"] if args.mixes == list(MIXES) else args.mixes
    calls = args.calls or 20
    dtype = getattr(torch, args.dtype)
    if device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter's tl.dot takes no bfloat16
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"}
    print(f"# folded expands  {env}  dtype={dtype}  rank=16  calls per graph={calls}")
    print(f"{'op':<8} {'rows':>4} {'mix':<6} {'alone':>6} {'split':>6} {'s.rows':>6} {'folded':>6} {'saved':>6}")
    table, failed = [], 0
    for num_rows in rows:
        for mix in mixes:
            for name in widths:
                def fresh(flip=False, seed=zlib.crc32(f"fold/{name}/{num_rows}/{mix}".encode())):
                    return fold_ops(widths, num_rows, mix, dtype, device, torch.Generator().manual_seed(seed), flip)[name]
                fold, _, _, wrote = fresh()
                got = fold()
                folds = got is not None
                if folds:
                    whole = [t.clone() for t in wrote(got)]
                    fold, _, _, wrote = fresh(True)
                    flipped = [t.clone() for t in wrote(fold())]
                    if not all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(flipped, whole)):
                        failed += 1
                        print(f"# {name} rows={num_rows} {mix}: a row's result depends on its neighbours", file=sys.stderr)
                alone = split = split_rows = folded = None
                if device == "cuda":
                    timing = dict(warmup=args.warmup, iters=args.iters, calls=calls)
                    alone, split = graph_us(fresh()[1], **timing), graph_us(fresh()[2], **timing)
                    if num_rows >= triton_ops.MIN_TILE_ROWS:
                        split_rows = graph_us(expand_by_rows(fresh()[2]), **timing)
                    folded = graph_us(fresh()[0], **timing) if folds else None
                cells = " ".join("-".rjust(6) if v is None else f"{v:>6.2f}"
                                 for v in (alone, split, split_rows, folded, None if folded is None else split - folded))
                table.append({"op": name, "rows": num_rows, "mix": mix, "alone_us": alone, "split_us": split,
                              "split_by_rows_us": split_rows, "folded_us": folded, "folds": folds})
                print(f"{name:<8} {num_rows:>4} {mix:<6} {cells}", flush=True)
    print(f"# {failed} folds gave a row another result beside other neighbours")
    if args.output is not None:
        args.output.write_text(json.dumps({"env": env, "rows": table}, indent=1))
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.min_split_rows is not None:
        from mstar_actors.lora import triton_ops

        triton_ops.MIN_SPLIT_ROWS = args.min_split_rows
    if args.decode:
        return decode_main(args)
    if args.rows_table:
        return rows_table_main(args)
    if args.fold_table:
        return fold_table_main(args)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    dtype = getattr(torch, args.dtype)
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: running the torch reference on the CPU (use --dry-run for a quick subset)")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    print(f"# {env}  dtype={args.dtype}  max_loras={MAX_LORAS}  seed={args.seed}")
    print(HEADER)
    return run_rows(configs(args), check_one, format_row, args, device, dtype, env)


if __name__ == "__main__":
    sys.exit(main())
