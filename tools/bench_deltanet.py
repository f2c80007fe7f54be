"""Time Gated DeltaNet's two ops, Triton (``TritonDeltaNetOps``) against the
torch reference (``TorchDeltaNetOps``) on the same GPU, at one DeltaNet
layer of Qwen3.5-0.8B's shape (hidden 1024; 16 key and 16 value heads of
128; conv kernel 4; bf16, float32 recurrent state).

One row per (step, op):

- ``prefill N``: one fresh sequence of N tokens (the chunked kernels);
- ``decode B``: B sequences of one token each, continuing their states
  (the recurrent kernel; the step in the static ``graph_decode`` form).

Columns: microseconds of device time per call for Triton and for the
reference, their ratio (reference / Triton), and the relative error of
Triton's output against the reference in float32 on the same inputs.
Decode rows add ``fla us``: the same step through flash-linear-attention's
fused recurrent kernel, whose states come in and go out as tensors of
their own (a gather from the pool, a masked fill for fresh rows, a scatter
back) and whose gates are torch ops: what our decode kernel
(``deltanet_decode``) saves by updating the pool in place.
Decode calls are captured ``--calls`` times in one CUDA graph and replayed
(what the engine's decode graphs run); prefill calls are timed as plain
launches between CUDA events. Median of ``--repeats``.

``--short N ...`` adds a table of graphed mixed steps' delta rule (the
static form ``step_graphs.MixedGraphs`` runs): ``--short-decodes`` decode
rows beside three fresh chunks of N tokens, the chunks through the
recurrent kernel with the decode rows (the route for chunks of at most
``RECURRENT_MAX`` tokens) against the chunked kernels (fla's, their states
gathered and scattered back), with the recurrent route's relative error
against the reference: why the line sits where it does.

    python tools/bench_deltanet.py
    python tools/bench_deltanet.py --prefill --decode --short 4 16 37 64 128
    python tools/bench_deltanet.py --prefill 512 2048 8192 --decode 1 64 256
    python tools/bench_deltanet.py --device cpu --prefill --decode 1 8   # the torch forms alone (no prefill: minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import non_negative_int, positive_int  # noqa: E402
from _gpu_timing import capture_graph, cuda_median_us  # noqa: E402
from mstar_actors.models.attention import AttentionMetadata  # noqa: E402
from mstar_actors.models import deltanet_ops  # noqa: E402
from mstar_actors.models.deltanet_ops import Gates, StatePool, TorchDeltaNetOps, static_step_plan  # noqa: E402

HIDDEN, NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, KERNEL = 1024, 16, 16, 128, 4
CONV_DIM = 2 * NUM_K_HEADS * HEAD_DIM + NUM_V_HEADS * HEAD_DIM


def make_case(query_lens: list[int], fresh: bool, num_slots: int, seed: int = 0, device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(query_lens)
    context = list(query_lens) if fresh else [n + 100 for n in query_lens]
    slots = torch.randperm(num_slots, generator=gen)[: len(query_lens)].tolist()
    meta = AttentionMetadata.from_lists(slot_mapping=[0] * tokens, block_tables=[[0]] * len(query_lens),
                                        num_blocks=[1] * len(query_lens), query_lens=query_lens, context_lens=context,
                                        device=device)
    meta.state_slots, meta.state_slots_list = torch.tensor(slots, device=device), slots

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    bf16 = torch.bfloat16
    gates = Gates(rand(tokens, NUM_V_HEADS, scale=2.0).to(bf16), rand(tokens, NUM_V_HEADS, scale=2.0).to(bf16),
                  rand(NUM_V_HEADS), rand(NUM_V_HEADS).to(bf16))
    return dict(
        meta=meta,
        x=rand(tokens, CONV_DIM).to(bf16), weight=rand(CONV_DIM, KERNEL, scale=0.5).to(bf16),
        q=rand(tokens, NUM_K_HEADS, HEAD_DIM).to(bf16), k=rand(tokens, NUM_K_HEADS, HEAD_DIM).to(bf16),
        v=rand(tokens, NUM_V_HEADS, HEAD_DIM).to(bf16), gates=gates,
        pool=StatePool(rand(num_slots + 1, CONV_DIM, KERNEL - 1).to(bf16),
                       rand(num_slots + 1, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, scale=0.1)))


def calls(case: dict, ops, meta: AttentionMetadata) -> dict:
    c, pool = case, case["pool"]
    return {"conv": lambda: ops.conv(c["x"], c["weight"], pool, meta),
            "delta_rule": lambda: ops.delta_rule(c["q"], c["k"], c["v"], c["gates"], pool, meta)}


def fla_decode(case: dict, meta: AttentionMetadata):
    """A decode step's delta rule through fla-core's fused recurrent kernel:
    the gates as torch ops, the states gathered, zeroed where fresh, scattered back."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    c, pool = case, case["pool"]

    def step():
        slots, continues = meta.state_slots, meta.context_lens > 1
        state = pool.ssm.index_select(0, slots).masked_fill_(~continues[:, None, None, None], 0.0)
        g, beta = c["gates"].decay(), c["gates"].beta()
        o, final = fused_recurrent_gated_delta_rule(
            c["q"][:, None], c["k"][:, None], c["v"][:, None], g=g[:, None], beta=beta[:, None],
            scale=HEAD_DIM**-0.5, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.ssm.index_copy_(0, slots, final)
        return o
    return step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def errors(case: dict, triton_ops) -> dict:
    """Triton against the reference in float32, each on its own copy of the pools."""
    pool = case["pool"]
    mine = StatePool(pool.conv.clone(), pool.ssm.clone())
    ref = StatePool(pool.conv.float(), pool.ssm.clone())
    meta = lambda: dataclasses.replace(case["meta"], derived={})  # noqa: E731
    got_conv = triton_ops.conv(case["x"], case["weight"], mine, meta())
    got_o = triton_ops.delta_rule(case["q"], case["k"], case["v"], case["gates"], mine, meta())
    torch_ops, m = TorchDeltaNetOps(), meta()
    want_conv = torch_ops.conv(case["x"].float(), case["weight"].float(), ref, m)
    want_o = torch_ops.delta_rule(case["q"].float(), case["k"].float(), case["v"].float(),
                                  Gates(*(t.float() for t in case["gates"])), ref, m)
    return {"conv": max(rel_err(got_conv, want_conv), rel_err(mine.conv, ref.conv)),
            "delta_rule": max(rel_err(got_o, want_o), rel_err(mine.ssm, ref.ssm))}


def time_eager(fn, num_calls: int, repeats: int) -> float:
    fn()

    def run():
        for _ in range(num_calls):
            fn()
    return cuda_median_us(run, num_calls, repeats)


def time_graph(fn, num_calls: int, repeats: int) -> float:
    graph = capture_graph(fn, num_calls)
    graph.replay()
    return cuda_median_us(graph.replay, num_calls, repeats)


def static_meta(case: dict, num_slots: int, recurrent_max: int) -> AttentionMetadata:
    """The case's step in static form, its chunks of at most ``recurrent_max``
    tokens as recurrent entries and the rest through the chunked kernels."""
    meta, saved = case["meta"], deltanet_ops.RECURRENT_MAX
    deltanet_ops.RECURRENT_MAX = recurrent_max
    try:
        longer = sum(n > recurrent_max for n in meta.query_lens_list)
        plan = static_step_plan(meta.query_lens_list, meta.context_lens_list, meta.state_slots_list,
                                num_tokens=sum(meta.query_lens_list), num_entries=len(meta.query_lens_list),
                                num_chunk_seqs=longer, scratch_slot=num_slots)
    finally:
        deltanet_ops.RECURRENT_MAX = saved
    return dataclasses.replace(meta, derived={}, deltanet_static=plan.to_step(case["q"].device))


def short_table(args, triton_ops) -> None:
    decodes = args.short_decodes
    print(f"\n# graphed mixed steps' delta rule: {decodes} decode rows beside 3 chunks of N tokens continuing "
          f"their states (RECURRENT_MAX {deltanet_ops.RECURRENT_MAX})")
    header = f"{'chunks':<10} {'recurrent us':>12} {'chunked us':>11} {'chunked/recurrent':>17} {'rel err':>9}"
    print(header)
    print("-" * len(header))
    torch_ops = TorchDeltaNetOps()
    for n in args.short:
        lens = [1] * decodes + [n] * 3
        num_slots = max(64, len(lens))
        c = make_case(lens, fresh=False, num_slots=num_slots)
        pool = c["pool"]
        recurrent, chunked = (static_meta(c, num_slots, max_tokens) for max_tokens in (max(n, 1), 1))
        times = [time_graph(lambda m=m: triton_ops.delta_rule(c["q"], c["k"], c["v"], c["gates"], pool, m),
                            args.calls, args.repeats) for m in (recurrent, chunked)]
        mine, ref = StatePool(pool.conv, pool.ssm.clone()), StatePool(pool.conv, pool.ssm.clone())
        got = triton_ops.delta_rule(c["q"], c["k"], c["v"], c["gates"], mine, dataclasses.replace(recurrent, derived={}))
        want = torch_ops.delta_rule(c["q"].float(), c["k"].float(), c["v"].float(),
                                    Gates(*(t.float() for t in c["gates"])), ref, dataclasses.replace(c["meta"], derived={}))
        err = max(rel_err(got, want), rel_err(mine.ssm, ref.ssm))
        print(f"{f'3 x {n}':<10} {times[0]:>12.1f} {times[1]:>11.1f} {times[1] / times[0]:>16.2f}x {err:>9.2e}",
              flush=True)


def cpu_table(args) -> None:
    """Microseconds a call of the torch forms on CPU (float32, one intra-op
    thread, as a CPU worker runs), median of ``--repeats`` rounds of ``--calls``."""
    import statistics
    import time

    torch.set_num_threads(1)
    print(f"# CPU, torch {torch.__version__}, one thread; one DeltaNet layer: conv_dim {CONV_DIM}, heads "
          f"{NUM_K_HEADS}/{NUM_V_HEADS} x {HEAD_DIM}, kernel {KERNEL}, float32")
    print(f"{'step':<14} {'op':<11} {'torch us':>10}")
    steps = [(f"prefill {n}", [n], True) for n in args.prefill] + [(f"decode {b}", [1] * b, False) for b in args.decode]
    for name, lens, fresh in steps:
        case = make_case(lens, fresh, num_slots=max(64, len(lens)), device="cpu")
        for key in ("x", "weight", "q", "k", "v"):
            case[key] = case[key].float()
        case["gates"] = Gates(*(t.float() for t in case["gates"]))
        case["pool"] = StatePool(case["pool"].conv.float(), case["pool"].ssm)
        for op, fn in calls(case, TorchDeltaNetOps(), case["meta"]).items():
            fn()
            rounds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                rounds.append((time.perf_counter() - started) / args.calls * 1e6)
            print(f"{name:<14} {op:<11} {statistics.median(rounds):>10.1f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=positive_int, nargs="*", default=[2048],
                        help="tokens of each prefill row (none: no prefill rows)")
    parser.add_argument("--decode", type=positive_int, nargs="*", default=[1, 8, 32, 64],
                        help="sequences of each decode row (none: no decode rows)")
    parser.add_argument("--short", type=positive_int, nargs="*", default=[],
                        help="chunk lengths of graphed mixed steps to time both ways (see the module doc)")
    parser.add_argument("--short-decodes", type=non_negative_int, default=60,
                        help="decode rows beside the --short chunks")
    parser.add_argument("--calls", type=positive_int, default=20, help="calls per timed round (default 20)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed rounds, their median (default 10)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: time the torch forms alone (what CPU serving runs), float32, one thread")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        return cpu_table(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_deltanet: needs a CUDA device to time the GPU kernels (--device cpu times the "
                         "torch forms alone)")
    from mstar_actors.models.deltanet_triton import TritonDeltaNetOps

    triton_ops, torch_ops = TritonDeltaNetOps(), TorchDeltaNetOps()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; one DeltaNet layer: conv_dim {CONV_DIM}, "
          f"heads {NUM_K_HEADS}/{NUM_V_HEADS} x {HEAD_DIM}, kernel {KERNEL}, bf16")
    header = (f"{'step':<14} {'op':<11} {'timing':<6} {'triton us':>10} {'torch us':>10} {'ratio':>7} "
              f"{'rel err':>9} {'fla us':>8}")
    print(header)
    print("-" * len(header))
    steps = [(f"prefill {n}", [n], True) for n in args.prefill] + [(f"decode {b}", [1] * b, False) for b in args.decode]
    for name, lens, fresh in steps:
        case = make_case(lens, fresh, num_slots=max(64, len(lens)))
        errs = errors(case, triton_ops)
        decode = all(n == 1 for n in lens)
        meta = case["meta"]
        if decode:  # the static form a captured decode step runs (the reference reads its lists)
            static = dataclasses.replace(meta, graph_decode=True)
            timer, mine, theirs = time_graph, calls(case, triton_ops, static), calls(case, torch_ops, meta)
        else:
            timer, mine, theirs = time_eager, calls(case, triton_ops, meta), calls(case, torch_ops, meta)
        for op in ("conv", "delta_rule"):
            how = "graph" if decode else "eager"
            try:
                t_mine, t_ref = timer(mine[op], args.calls, args.repeats), timer(theirs[op], args.calls, args.repeats)
            except RuntimeError as err:  # a capture that fails: say so, and time plain launches instead
                print(f"# {name} {op}: graph capture failed ({err}); timing eager launches", flush=True)
                how, t_mine, t_ref = "eager", *(time_eager(f[op], args.calls, args.repeats) for f in (mine, theirs))
            fla = ""
            if decode and op == "delta_rule":  # timed as the two columns before it were
                fla_timer = time_eager if how == "eager" else timer
                fla = f"{fla_timer(fla_decode(case, static), args.calls, args.repeats):>8.1f}"
            print(f"{name:<14} {op:<11} {how:<6} {t_mine:>10.1f} {t_ref:>10.1f} "
                  f"{t_ref / t_mine:>6.1f}x {errs[op]:>9.2e} {fla}", flush=True)
    if args.short:
        short_table(args, triton_ops)


if __name__ == "__main__":
    main()
