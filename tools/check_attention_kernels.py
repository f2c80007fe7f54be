"""Check the Triton paged attention kernels against an fp32 reference, then time them.

Decode section (``paged_decode_attention``):

One row per (batch, context) of a Llama-3.2-1B-shaped layer (32 query heads,
8 KV heads, head_dim 64, bf16, block 16; every sequence at the same context):

- err: relative error (norm) of ours against fp32 attention on the same pages;
- ours: ``paged_decode_attention`` with the split count it picks (shown);
- 1 split: ours forced to one split (what split-K buys at small batch);
- torch ref: ``TorchPagedAttention`` decode path (index_select pages + masked SDPA);
- sdpa: ``F.scaled_dot_product_attention`` on K/V already gathered contiguous
  (no paging cost: a floor for a library kernel, not a fair end-to-end rival);
- GB/s: K/V bytes ours reads over its time.

Times are microseconds of device time per call: each callable is captured
``--calls`` times in one CUDA graph and replayed (median of ``--repeats``), so
launch overhead on the host, which the engine's graph runner removes too, is
not counted. ``--eager`` times plain launches instead (CUDA events around a loop).

Varlen section (``paged_varlen_attention``), one row per step mix (prefill
chunks beside decode rows, same layer shape):

- err: relative error of the varlen kernel against fp32 ``TorchPagedAttention``;
- varlen graph / old graph: device us per call replayed from a CUDA graph
  (the old path: decode kernel for the decode rows + SDPA per chunk, as
  ``TritonPagedAttention(eager_varlen=False)`` runs an eager mixed step;
  "n/a" if it cannot be captured);
- varlen eager / old eager: us per call of plain launches (CUDA events
  around a loop: what an eager step pays, host-bound when launches are);
- varlen host / old host: host us per call to issue the launches;
- ``--tune``: the varlen kernel's time (graph) for each ``(BLOCK_N, num_warps)``
  tile, to check the choice ``_varlen_config`` makes from shapes.

    python tools/check_attention_kernels.py
    python tools/check_attention_kernels.py --batches 1 64 --contexts 2000 --eager
    python tools/check_attention_kernels.py --sections decode --contexts 100 1000 --table-tokens 4096
    python tools/check_attention_kernels.py --sections varlen --mixes 4x256 2048 --tune

Without CUDA it runs Triton's interpreter on CPU with tiny defaults, as a
smoke test of the script only (no timings worth reading).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

from _common import non_negative_int, positive_int  # noqa: E402
from _gpu_timing import capture_graph, cuda_median_us  # noqa: E402

from mstar_actors.models.attention import AttentionMetadata, TorchPagedAttention, plan_varlen_work  # noqa: E402
from mstar_actors.models.triton_attention import (  # noqa: E402
    TritonPagedAttention,
    choose_num_splits,
    paged_decode_attention,
    paged_varlen_attention,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16


def make_case(batch: int, context: int, device: str, dtype: torch.dtype, seed: int = 0, table_tokens: int = 0) -> dict:
    """Shuffled, non-contiguous pages; every sequence at ``context`` tokens,
    its table padded to ``table_tokens`` tokens' blocks (a served graph's
    tables are ``max_model_len`` wide) with a block of its own."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
    width = max(per_seq, -(-table_tokens // BLOCK_SIZE))
    tables = torch.cat([tables, tables[:, :1].expand(batch, width - per_seq)], dim=1)
    return dict(
        q=torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(device, dtype),
        kv_cache=torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype),
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        scale=HEAD_DIM**-0.5,
    )


def gathered(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, KH, ctx, D]`` contiguous (every sequence at one context)."""
    pages = case["kv_cache"][:, case["block_tables"].long()]  # [2, B, nb, bs, KH, D]
    ctx = int(case["context_lens"][0])
    kv = pages.flatten(2, 3)[:, :, :ctx].transpose(2, 3).contiguous()
    return kv[0], kv[1]


def reference(case: dict, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q = case["q"].float().unsqueeze(2)
    out = F.scaled_dot_product_attention(q, k.float(), v.float(), scale=case["scale"], enable_gqa=True)
    return out.squeeze(2)


def torch_ref_call(case: dict):
    batch = case["q"].shape[0]
    ctx = int(case["context_lens"][0])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=case["q"].device),
        block_tables=case["block_tables"],
        query_start=torch.arange(batch + 1, dtype=torch.int32, device=case["q"].device),
        context_lens=case["context_lens"],
        query_lens_list=[1] * batch,
        context_lens_list=[ctx] * batch,
        num_blocks_list=[case["block_tables"].shape[1]] * batch,
        graph_decode=True,  # the same static path a captured step takes
    )
    backend = TorchPagedAttention()
    return lambda: backend.attend(case["q"], case["kv_cache"], meta, case["scale"])


def time_graph(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call of ``fn`` captured ``calls`` times in one graph."""
    return _median_us(capture_graph(fn, calls).replay, 1, calls, repeats)


def time_eager(fn, calls: int, repeats: int) -> float:
    fn()
    return _median_us(fn, calls, calls, repeats)


def _median_us(fn, num_runs: int, calls: int, repeats: int) -> float:
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    def run():
        for _ in range(num_runs):
            fn()
    return cuda_median_us(run, calls, repeats)


def run_row(batch: int, context: int, args) -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 on the GPU; the interpreter's tl.dot misreads bf16, so fp16 there.
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    case = make_case(batch, context, device, dtype, table_tokens=args.table_tokens)
    k, v = gathered(case)
    expected = reference(case, k, v)
    ours = paged_decode_attention(**case)
    err = ((ours.float() - expected).norm() / expected.norm()).item()
    splits = choose_num_splits(batch, NUM_KV_HEADS, case["block_tables"].shape[1] * BLOCK_SIZE, case["q"].device)
    out = torch.empty_like(case["q"])
    fns = {
        "ours": lambda: paged_decode_attention(**case, out=out),
        "1 split": lambda: paged_decode_attention(**case, out=out, num_splits=1),
        "torch ref": torch_ref_call(case),
        "sdpa": lambda: F.scaled_dot_product_attention(case["q"].unsqueeze(2), k, v, scale=case["scale"],
                                                       enable_gqa=True),
    }
    timer = time_eager if args.eager or device == "cpu" else time_graph
    us = {name: timer(fn, args.calls, args.repeats) for name, fn in fns.items()}
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * case["kv_cache"].element_size()
    gbps = kv_bytes / (us["ours"] * 1e-6) / 1e9
    cells = [f"{batch:>5}", f"{context:>7}", f"{splits:>6}", f"{err:>8.1e}"]
    cells += [f"{us[name]:>9.1f}" for name in fns] + [f"{gbps:>7.0f}"]
    return " ".join(cells)


# Step mixes of the varlen section: (query lengths, context lengths) per sequence.
MIXES = {
    "30+7dec": ([30] + [1] * 7, [30] + [100 + 15 * i for i in range(7)]),
    "30+31dec": ([30] + [1] * 31, [30] + [100 + 3 * i for i in range(31)]),
    "4x256": ([256] * 4, [256] * 4),
    "2048": ([2048], [2048]),
    "tiny": ([5, 1, 1], [5, 20, 40]),  # the CPU smoke test's default
}


def make_mix(query_lens: list[int], context_lens: list[int], device: str, dtype: torch.dtype, seed: int = 0):
    """``(q, kv_cache, meta)`` of one mixed step on shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for n in need:
        tables.append(order[taken : taken + n] + [order[-1]] * (max(need) - n))
        taken += n
    num_tokens = sum(query_lens)
    meta = AttentionMetadata.from_lists(slot_mapping=[0] * num_tokens, block_tables=tables, num_blocks=need,
                                        query_lens=query_lens, context_lens=context_lens, device=device)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return q, kv, meta


def time_host(fn, calls: int, repeats: int) -> float:
    """Median host microseconds per call to issue ``fn`` (not waiting for the device)."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def run_mix(name: str, args) -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's tl.dot misreads bf16
    query_lens, context_lens = MIXES[name]
    q, kv, meta = make_mix(query_lens, context_lens, device, dtype)
    scale = HEAD_DIM**-0.5
    expected = TorchPagedAttention().attend(q.float(), kv.float(), meta, scale)
    meta.derived.clear()
    work = torch.tensor(plan_varlen_work(query_lens), dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def varlen():
        paged_varlen_attention(q, kv, meta.block_tables, meta.query_start, meta.context_lens, work, scale, out=out)

    old_backend = TritonPagedAttention(eager_varlen=False)

    def old():  # meta.derived keeps the decode rows' index, built once per step as in serving
        old_backend.attend(q, kv, meta, scale)

    varlen()
    err = ((out.float() - expected).norm() / expected.norm()).item()
    us = {}
    for label, fn in (("varlen", varlen), ("old", old)):
        if device == "cuda":
            try:
                us[f"{label} graph"] = f"{time_graph(fn, args.calls, args.repeats):.1f}"
            except RuntimeError:  # a path that cannot be captured
                torch.cuda.synchronize()
                us[f"{label} graph"] = "n/a"
        else:
            us[f"{label} graph"] = "n/a"
        us[f"{label} eager"] = f"{time_eager(fn, args.calls, args.repeats):.1f}"
        us[f"{label} host"] = f"{time_host(fn, args.calls, args.repeats):.1f}"
    order = ("varlen graph", "old graph", "varlen eager", "old eager", "varlen host", "old host")
    cells = [f"{name:>9}", f"{len(work):>5}", f"{sum(query_lens):>6}", f"{err:>8.1e}"]
    row = " ".join(cells + [f"{us[key]:>12}" for key in order])
    if args.tune:
        timer = time_graph if device == "cuda" else time_eager
        tiles = {tile: timer(lambda: paged_varlen_attention(q, kv, meta.block_tables, meta.query_start,
                                                            meta.context_lens, work, scale, out=out, tile=tile),
                             args.calls, args.repeats)
                 for tile in TUNE_TILES}
        row += "\n" + " " * 10 + "tiles (BLOCK_N, warps) us: " + "  ".join(f"{t}: {v:.1f}" for t, v in tiles.items())
    return row


TUNE_TILES = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=("decode", "varlen"), default=["decode", "varlen"])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32, 64] if cuda else [2])
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[128, 1024] if cuda else [40])
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES),
                        default=["30+7dec", "30+31dec", "4x256", "2048"] if cuda else ["tiny"])
    parser.add_argument("--calls", type=positive_int, default=20 if cuda else 1, help="calls per timed run")
    parser.add_argument("--repeats", type=positive_int, default=10 if cuda else 1, help="timed runs (median)")
    parser.add_argument("--eager", action="store_true", help="decode section: time plain launches, not graph replays")
    parser.add_argument("--table-tokens", type=non_negative_int, default=0,
                        help="decode section: pad each block table to this many tokens, as a served graph's "
                             "(max_model_len wide; the split count follows the width); default: the context's own")
    parser.add_argument("--tune", action="store_true", help="varlen section: also time each (BLOCK_N, num_warps) tile")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: smoke test only)"
    print(f"# {device}; H={NUM_HEADS} KH={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}")
    worst = 0.0
    if "decode" in args.sections:
        print(f"## decode: us per call ({'eager' if args.eager or not cuda else 'CUDA graph'})")
        print("batch context splits      err      ours   1 split torch ref      sdpa    GB/s")
        for batch in args.batches:
            for context in args.contexts:
                row = run_row(batch, context, args)
                worst = max(worst, float(row.split()[3]))
                print(row, flush=True)
    if "varlen" in args.sections:
        print("## varlen: us per call of one layer's attention (old = decode kernel + SDPA per chunk)")
        print("      mix items tokens      err varlen graph    old graph varlen eager    old eager  varlen host"
              "     old host")
        for name in args.mixes:
            row = run_mix(name, args)
            worst = max(worst, float(row.split()[3]))
            print(row, flush=True)
    if worst >= 1e-2:
        print(f"FAIL: relative error {worst:.1e} >= 1e-2")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
