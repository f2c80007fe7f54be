"""One rank's decode step on the GPU, in process: base against LoRA rows.

Times ``ModelRunner.execute`` for pure decode steps (what the CUDA graphs
replay) of B sequences at about 100 tokens of context, with every row on
the base model, on one adapter, or on four adapters round robin; the
same steps' graphs replayed back to back (the device's time alone,
steadier than the wall time of ``execute``); then decode steps whose rows
draw at temperature 1, the draw inside the decode graph against
``sample_pending`` after it (``--host-profile-batches``: the host's side
of decode steps, timed and under cProfile); then mixed steps (a new
request's 30-token prompt beside N decodes: what every new request costs
the batch), base and one adapter, through the mixed-step
graphs and eagerly; then the time of ``install_adapter`` (what an adapter
swap waits for on a rank); then the GPU kernels of one adapter step by
``torch.profiler``. No server, no processes: the figures are the model
runner's share of a serving step. The decode table runs runners side by
side, one per ``--lora-paths``: ``beside`` (from ``MIN_SPLIT_ROWS`` rows
each decoder linear's delta on a side stream while its GEMM runs, added by
the op after it, below as ``fused``; CUDA's default, ``lora_layers.BESIDE``), ``fused``
(every slot's A under the weight: one GEMM, then the expand) and
``unfused`` (the GEMM, then the one-row kernel with its own shrink). ``--fused-ops``
likewise sets the layers' small ops side by side: ``triton_fused``'s one
launch each (RMSNorm with the residual add, rotary with the KV write,
SiLU-and-mul; on by default, see ``triton_fused.enabled``) or torch's ops,
``--pdl`` our Triton kernels launched with programmatic dependent launch or
without (``triton_launch``), ``--gemv`` decode-sized steps on our GEMM or
cuBLAS's (``triton_linear``), and
``--fold`` a fused q|k|v's and gate|up's LoRA expand added by the rotary and
SiLU-and-mul kernels or launched alone (``lora_layers.FOLD``).

    python tools/profile_gpu_step.py --tokenizer DIR            # the random Llama-3.2-1B shape
    python tools/profile_gpu_step.py --tokenizer DIR --batches 1 8 32 64 --mixed-decodes 7 31
    python tools/profile_gpu_step.py --tokenizer DIR --model qwen3.5-0.8b-random   # the hybrid model

Needs CUDA; makes the model and adapters like ``bench_lora.py`` (same cache).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_lora  # noqa: E402
from _common import non_negative_int, positive_int  # noqa: E402
from mstar_actors import messages, triton_launch  # noqa: E402
from mstar_actors.lora import BaseShapes, read_adapter, triton_ops  # noqa: E402
from mstar_actors.config import parse_config  # noqa: E402
from mstar_actors.models import lora_layers, triton_fused, triton_linear  # noqa: E402
from mstar_actors.model_info import load_model_info  # noqa: E402
from mstar_actors.runner.build import build_runner  # noqa: E402
from mstar_actors.runner.model_runner import ModelRunner  # noqa: E402

NUM_ADAPTERS = 4
CONTEXT = 100
PREFILL = 30  # a mixed step's new prompt


def load_adapters(runner: ModelRunner, paths: dict[str, Path], model_dir: Path) -> list:
    import json

    base = BaseShapes.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    return [read_adapter(paths[name], base=base, max_rank=16, name=name) for name in sorted(paths)]


class Decoder:
    """Prefills B sequences on the given slots, then runs decode steps on them."""

    def __init__(self, runner: ModelRunner, slots: list[int], tag: str, temperature: float = 0.0,
                 seed: int | None = None):
        self.runner, self.block_size = runner, runner.block_size
        self.rids = [f"{tag}{i}" for i in range(len(slots))]
        self.sampling = messages.SamplingParams(max_tokens=10_000, temperature=temperature, seed=seed, ignore_eos=True)
        self.blocks = {rid: list(range(1 + i * 64, 1 + (i + 1) * 64)) for i, rid in enumerate(self.rids)}
        self.done = {rid: 0 for rid in self.rids}
        # A model with recurrent state gives each sequence a state slot: the
        # first ones (a mixed step's new request takes the last).
        self.stateful = runner.num_state_slots > 0
        starts = [messages.SeqStart(rid, [(7 * i + j) % 1000 + 3 for j in range(CONTEXT)], self.sampling, lora_slot=s,
                                    state_slot=i if self.stateful else -1)
                  for i, (rid, s) in enumerate(zip(self.rids, slots))]
        self.step_id = 0
        self.run(starts, [self.chunk(rid, CONTEXT) for rid in self.rids])

    def chunk(self, rid: str, num_tokens: int) -> messages.ScheduledChunk:
        c = messages.ScheduledChunk(rid, self.done[rid], num_tokens, self.blocks[rid], True)
        self.done[rid] += num_tokens
        return c

    def run(self, started=(), chunks=()) -> None:
        self.step_id += 1
        self.runner.execute(messages.StepPlan(self.step_id, list(started), list(chunks), []))

    def decode(self) -> float:
        started = time.perf_counter()
        self.run((), [self.chunk(rid, 1) for rid in self.rids])
        return time.perf_counter() - started

    def mixed(self, slot: int, blocks: list[int]) -> float:
        """One step: a new request's ``PREFILL``-token prompt on ``slot`` (in
        ``blocks``) beside a decode of every sequence; the request is then
        forgotten, so its blocks serve the next one."""
        self.step_id += 1
        rid = f"new{self.step_id}"
        start = messages.SeqStart(rid, [(5 * j) % 1000 + 3 for j in range(PREFILL)], self.sampling, lora_slot=slot,
                                  state_slot=self.runner.num_state_slots - 1 if self.stateful else -1)
        chunks = [messages.ScheduledChunk(rid, 0, PREFILL, blocks, True), *(self.chunk(r, 1) for r in self.rids)]
        started = time.perf_counter()
        self.runner.execute(messages.StepPlan(self.step_id, [start], chunks, []))
        elapsed = time.perf_counter() - started
        self.runner.forget([rid])
        return elapsed

    def close(self) -> None:
        self.runner.forget(self.rids)


def time_steps(runner: ModelRunner, slots: list[int], tag: str, num_steps: int, **sampling) -> float:
    d = Decoder(runner, slots, tag, **sampling)
    for _ in range(3):
        d.decode()
    times = [d.decode() for _ in range(num_steps)]
    d.close()
    return statistics.median(times) * 1e3


def time_replays(runner: ModelRunner, slots: list[int], tag: str, num_steps: int) -> float:
    """Median ms of the decode graph ``slots`` take, replayed back to back
    on the step's inputs (CUDA events, ``num_steps`` rounds of 10): the
    GPU's own time of a step, what a server whose host work overlaps the
    device's waits for. Steadier than ``time_steps``, whose wall time
    takes the host's preparation and its jitter too."""
    graphs = runner.graphs
    if graphs is None or not graphs.is_captured or len(slots) > graphs.max_batch:
        return float("nan")  # no graph to replay: the step runs eagerly (``time_steps`` times it)
    d = Decoder(runner, slots, tag)
    d.decode()  # the graph's static inputs now hold this batch
    bucket = graphs.bucket_for(len(slots))
    graph = graphs.graphs[(bucket, graphs.width_for(bucket, slots))]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(num_steps):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    d.close()
    return statistics.median(times)


def print_sampled(runner: ModelRunner, batches: list[int], num_steps: int) -> None:
    """Decode steps of base rows drawing at temperature 1 (unseeded, and
    seeded), the draw inside the decode graph against the sampler's launches
    after the replay (``ModelRunner._graph_race``), step by step in turns on
    the same sequences; greedy beside them. Host: ``forward`` and ``sample``,
    what the worker's loop spends before it waits for the device."""
    graphs = runner.graphs
    if graphs is None or not graphs.draws:
        return print("# sampled rows: the decode graphs draw no tokens here; skipped")
    print(f"# decode step ms (median of {num_steps} each, in turns), base rows: the draw in the decode graph against "
          "sample_pending after its replay (the graph's draw then unused); host: forward + sample, step: until collected")
    print(f"{'batch':>5} {'rows':>12} {'host in':>8} {'host after':>10} {'step in':>8} {'step after':>10}")
    for batch in batches:
        for name, sampling in (("greedy", {}), ("temperature", dict(temperature=1.0)),
                               ("seeded", dict(temperature=1.0, seed=7))):
            d = Decoder(runner, [0] * batch, "s", **sampling)
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            try:
                for i in range(2 * (num_steps + 3)):
                    drawn_inside = i % 2 == 0
                    if drawn_inside:  # the runner's own choice
                        runner.__dict__.pop("_graph_race", None)
                    else:  # no step drawn in its graph: its captured draw keeps no token, the sampler draws after
                        runner._graph_race = lambda graphs, states: None
                    d.step_id += 1
                    plan = messages.StepPlan(d.step_id, [], [d.chunk(rid, 1) for rid in d.rids], [])
                    started = time.perf_counter()
                    step = runner.forward(plan)
                    runner.sample(step)
                    host = time.perf_counter() - started
                    runner.collect(step)
                    if i >= 6:
                        times[drawn_inside].append((host, time.perf_counter() - started))
            finally:
                runner.__dict__.pop("_graph_race", None)
                d.close()
            (h_in, s_in), (h_after, s_after) = ([statistics.median(t[k] for t in times[v]) * 1e3 for k in (0, 1)]
                                                for v in (True, False))
            print(f"{batch:>5} {name:>12} {h_in:>8.3f} {h_after:>10.3f} {s_in:>8.3f} {s_after:>10.3f}")


class Overlapped:
    """Decode steps of a ``Decoder``'s rows in the worker's overlapped order
    (``actors.worker``: the next ``forward``, then ``collect`` of the step
    before, then ``sample``), so the host builds step N+1 while the device
    runs step N."""

    def __init__(self, runner: ModelRunner, d: Decoder):
        self.runner, self.d = runner, d
        self.before = runner.forward(self.plan())
        runner.sample(self.before)

    def plan(self) -> messages.StepPlan:
        self.d.step_id += 1
        return messages.StepPlan(self.d.step_id, [], [self.d.chunk(rid, 1) for rid in self.d.rids], [])

    def steps(self, n: int, parts: dict[str, list[float]] | None = None) -> float:
        """Run ``n`` steps; return seconds a step (``parts``: gets each
        step's seconds of forward, collect and sample)."""
        runner = self.runner
        started = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            step = runner.forward(self.plan())
            t1 = time.perf_counter()
            runner.collect(self.before)
            t2 = time.perf_counter()
            runner.sample(step)
            t3 = time.perf_counter()
            self.before = step
            if parts is not None:
                for name, t in zip(("forward", "collect", "sample"), (t1 - t0, t2 - t1, t3 - t2)):
                    parts.setdefault(name, []).append(t)
        return (time.perf_counter() - started) / n

    def close(self) -> None:
        self.runner.collect(self.before)
        self.d.close()


def time_overlapped(runner: ModelRunner, slots: list[int], tag: str, num_steps: int) -> float:
    """Median ms a step of ``slots``' decode steps back to back in the
    worker's order (``Overlapped``; ``num_steps`` rounds of 10): the step
    a served batch sees, the host's work hidden behind the device's, or the
    device's behind the host's. Each round starts from fresh sequences of
    ``CONTEXT`` tokens, so its steps read the KV cache the other columns'
    steps read: one long run grows every row's context by a token a step
    (from 100 to 300 tokens over 200 steps; at 256 rows of Llama-3.2-1B's
    shape, 32 KB of bf16 K and V a token, about 0.9 GB more read a step at
    its middle), a cost of the context, not of the loop."""
    def round_() -> float:
        loop = Overlapped(runner, Decoder(runner, slots, tag))
        try:
            loop.steps(3)
            return loop.steps(10)
        finally:
            loop.close()

    round_()
    return statistics.median(round_() for _ in range(num_steps)) * 1e3


def profile_host(runner: ModelRunner, num_rows: int, num_steps: int, temperature: float) -> str:
    """The host's side of decode steps of ``num_rows`` base rows in the
    worker's overlapped order (``Overlapped``): medians of each part, ms,
    then cProfile's functions by their cumulative time over ``num_steps`` steps."""
    import cProfile
    import io
    import pstats

    loop = Overlapped(runner, Decoder(runner, [0] * num_rows, f"host{temperature}", temperature=temperature))
    parts: dict[str, list[float]] = {}
    try:
        loop.steps(5)
        loop.steps(num_steps, parts)
        profiler = cProfile.Profile()
        profiler.enable()
        loop.steps(num_steps)
        profiler.disable()
    finally:
        loop.close()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(28)
    medians = ", ".join(f"{name} {statistics.median(t) * 1e3:.3f}" for name, t in parts.items())
    return f"# host ms a step (median of {num_steps}): {medians}\n" + out.getvalue()


def time_mixed(runner: ModelRunner, num_decodes: int, slot: int, num_steps: int, *, graphed: bool) -> float | None:
    """Median ms of a mixed step (``Decoder.mixed``) with every row on
    ``slot``; ``graphed=False`` hides the mixed-step graphs for the run, so
    the same runner times its eager path. None without graphs to time."""
    graphs = runner.mixed_graphs
    if graphed and graphs is None:
        return None
    blocks = list(range(runner.num_kv_blocks - 2, runner.num_kv_blocks))  # past every Decoder's
    d = Decoder(runner, [slot] * num_decodes, f"x{int(graphed)}{slot}")
    runner.mixed_graphs = graphs if graphed else None
    try:
        for _ in range(3):
            d.mixed(slot, blocks)
        times = [d.mixed(slot, blocks) for _ in range(num_steps)]
    finally:
        runner.mixed_graphs = graphs
        d.close()
    return statistics.median(times) * 1e3


def print_mixed(runner: ModelRunner, decodes: list[int], num_steps: int) -> None:
    print(f"# mixed step ms (median of {num_steps}): one {PREFILL}-token prefill beside N decodes, every row on "
          f"the base model or on one adapter; graphed (mixed-step graphs) against eager, same runner")
    print(f"{'decodes':>7} {'rows':>5} {'graphed':>8} {'eager':>8} {'eager/graphed':>13}")
    for num_decodes in decodes:
        for name, slot in (("base", 0), ("one", 1)):
            graphed = time_mixed(runner, num_decodes, slot, num_steps, graphed=True)
            eager = time_mixed(runner, num_decodes, slot, num_steps, graphed=False)
            ratio = "n/a" if graphed is None else f"{eager / graphed:.2f}x"
            shown = "n/a" if graphed is None else f"{graphed:.3f}"
            print(f"{num_decodes:>7} {name:>5} {shown:>8} {eager:>8.3f} {ratio:>13}")


def time_install(runner: ModelRunner, adapters: list, repeats: int, beside: int = 0) -> tuple[float, float, float, float]:
    """Median ms of ``install_adapter`` from bf16 host copies (as the adapter
    reader keeps them) into slots 1-2, of ``reinstall_adapter`` of the same
    weights into the other slot (the host's hold, and until the device has
    it: from a device twin the copy is queued and the call returns first),
    and of a decode step meanwhile. With
    ``beside`` > 0 a thread keeps decoding that many sequences on slot 3
    during the installs, as a worker's step loop does beside its install
    thread (both want the GIL); step time is then that loop's median."""
    import threading

    weights = [w.to_dtype(torch.bfloat16) for w in adapters[:2]]
    stop, warm, step_times = threading.Event(), threading.Event(), []

    def decode_loop() -> None:
        d = Decoder(runner, [3] * beside, "busy")
        while not stop.is_set():
            step_times.append(d.decode())
            if len(step_times) == 5:
                warm.set()
            if d.done[d.rids[0]] >= 64 * runner.block_size:  # its blocks are full: start over
                d.close()
                d = Decoder(runner, [3] * beside, "busy")
        d.close()

    loop = threading.Thread(target=decode_loop) if beside else None
    if loop is not None:
        loop.start()
        warm.wait()  # the loop is running (and warm) before the first install
    times, again, held = [], [], []
    for i in range(repeats):
        runner.lora.clear_slot_images()
        started = time.perf_counter()
        runner.install_adapter(1 + i % 2, weights[i % 2])
        times.append(time.perf_counter() - started)
        torch.cuda.synchronize()  # a reinstall queued behind steps would time them too
        started = time.perf_counter()
        if not runner.reinstall_adapter(2 - i % 2, weights[i % 2].name, weights[i % 2].digest):
            raise RuntimeError("the install kept no slot image")
        again.append(time.perf_counter() - started)
        torch.cuda.current_stream().synchronize()
        held.append(time.perf_counter() - started)
    if loop is not None:
        stop.set()
        loop.join()
    step = statistics.median(step_times[5:]) * 1e3 if len(step_times) > 5 else float("nan")
    return statistics.median(times) * 1e3, statistics.median(again) * 1e3, statistics.median(held) * 1e3, step


def _profiled(step: Callable[[], object]) -> Any:
    """torch.profiler's events over 5 calls of ``step`` (warm already)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
    return prof.key_averages()


def profile_step(runner: ModelRunner, slots: list[int]) -> str:
    """torch.profiler's table of 5 decode steps on ``slots``: the GPU kernels
    by device time, and the host's share (an op's CPU time against the step's)."""
    d = Decoder(runner, slots, "prof")
    d.decode()
    events = _profiled(d.decode)
    d.close()
    return events.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)


def profile_mixed(runner: ModelRunner, num_decodes: int) -> str:
    """torch.profiler's tables of 5 mixed steps (``Decoder.mixed``, base rows,
    graphed where the runner has mixed-step graphs): the GPU kernels by
    device time, then the host's ops by their own CPU time (a mixed step's
    wall time is the larger of the two)."""
    blocks = list(range(runner.num_kv_blocks - 2, runner.num_kv_blocks))  # past every Decoder's
    d = Decoder(runner, [0] * num_decodes, "profmix")
    for _ in range(3):
        d.mixed(0, blocks)
    events = _profiled(lambda: d.mixed(0, blocks))
    d.close()
    return (events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="SmolLM2's tokenizer files and config.json (default: the fetched embedded model)")
    p.add_argument("--model", choices=sorted(bench_lora.RANDOM_SETUPS), default=bench_lora.LLAMA_1B,
                   help=f"the random model's shape (default {bench_lora.LLAMA_1B})")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=positive_int, default=30)
    p.add_argument("--mixed-decodes", type=non_negative_int, nargs="*", default=[7, 31],
                   help="decodes beside each mixed step's prefill (none: skip the mixed steps)")
    p.add_argument("--sampled-batches", type=positive_int, nargs="*", default=[8, 64],
                   help="rows of the sampled decode steps: the draw in the graph against after it (none: skip)")
    p.add_argument("--host-profile-batches", type=positive_int, nargs="*", default=[],
                   help="rows of decode steps whose host side (forward, collect, sample in the worker's "
                        "overlapped order) is timed and profiled with cProfile, greedy and at temperature 1")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--profile-batches", type=positive_int, nargs="+", default=[8],
                   help="rows of the profiled decode steps, each profiled on the base model and on one adapter")
    p.add_argument("--profile-mixed", type=non_negative_int, nargs="*", default=[],
                   help="decodes beside the prefill of each profiled mixed step (base rows; default none)")
    p.add_argument("--lora-paths", nargs="+", choices=["beside", "fused", "unfused"], default=["beside", "fused"],
                   help="decode table runners, side by side: the LoRA delta beside the GEMM on a side stream "
                        "(CUDA's default), after it with A under the weight, or after it unfused "
                        "(default: beside fused); the rest of the run takes the first")
    p.add_argument("--fused-ops", choices=["on", "off", "both"], default="both",
                   help="decode table with the layers' small ops fused (triton_fused, the default), as torch ops, "
                        "or both side by side (default); the rest of the run takes the first")
    p.add_argument("--pdl", choices=["on", "off", "both"], default="both",
                   help="decode table with our Triton kernels launched with programmatic dependent launch "
                        "(triton_launch), without, or both side by side (default); the rest of the run takes "
                        "the first")
    p.add_argument("--gemv", choices=["on", "off", "both"], default="on",
                   help="decode table with the linears of decode-sized steps on our Triton GEMM "
                        "(triton_linear, the default), on cuBLAS, or both side by side; the rest of the run takes "
                        "the first")
    p.add_argument("--gemv-max-rows", type=positive_int, default=None,
                   help="steps of up to this many rows take our GEMM (triton_linear.MAX_ROWS, at most 64)")
    p.add_argument("--fold", choices=["on", "off", "both"], default="both",
                   help="decode table with a fused q|k|v's and gate|up's LoRA expand added by the rotary and "
                        "SiLU-and-mul kernels (lora_layers.FOLD), as launches of their own, or both side by side "
                        "(default); the rest of the run takes the first")
    p.add_argument("--max-loras", type=positive_int, nargs="+", default=[NUM_ADAPTERS],
                   help=f"decode table runners with these lora.max_loras, side by side (default {NUM_ADAPTERS}; "
                        "bench_lora's churn serves 2); each holds min(max_loras, "
                        f"{NUM_ADAPTERS}) adapters, and mixed rows go round robin over them; the rest of the run "
                        "takes the first")
    p.add_argument("--split-rows", type=positive_int, nargs="+", default=[triton_ops.MIN_SPLIT_FUSED_ROWS],
                   help="decode table runners whose fused linears' LoRA steps of at least this many rows take "
                        "the grouped shrink and expand (beside the GEMM), fewer the fused GEMM and its expand "
                        f"(triton_ops.MIN_SPLIT_FUSED_ROWS, default {triton_ops.MIN_SPLIT_FUSED_ROWS}), side by "
                        "side; the rest of the run takes the first")
    p.add_argument("--fold-cols", type=positive_int, nargs="+", default=[triton_fused.FOLD_COLS],
                   help="decode table runners whose SiLU-and-mul folded expand takes this many columns a program "
                        f"by tiles of {triton_fused.FOLD_ROWS} rows (triton_fused.FOLD_COLS, default "
                        f"{triton_fused.FOLD_COLS}), side by side; the rest of the run takes the first")
    args = p.parse_args(argv)
    if args.gemv_max_rows is not None:
        if not 1 <= args.gemv_max_rows <= 64:
            p.error(f"--gemv-max-rows: 1 to 64, got {args.gemv_max_rows}")
        triton_linear.MAX_ROWS = args.gemv_max_rows
    if min(args.max_loras) < 1:
        p.error(f"--max-loras: at least 1 each, got {args.max_loras}")
    if not torch.cuda.is_available():
        print("profile_gpu_step needs CUDA", file=sys.stderr)
        return 2
    # As a GPU worker runs (parallel.worker_torch_threads on CUDA): one intra-op
    # thread, so host work beside the steps (an install's staging) does not
    # fan out over every core.
    torch.set_num_threads(1)
    if args.tokenizer is None:
        from mstar_actors.fetch import resolve_model

        args.tokenizer = Path(resolve_model("smollm2"))
    cache = bench_lora.default_cache_dir()
    model_dir = bench_lora.make_random_model(args.model, cache / args.model, args.tokenizer, "bfloat16", "cuda")
    paths = bench_lora.make_adapters(model_dir, cache / "adapters" / f"{args.model}-r16",
                                     [f"lora{i}" for i in range(NUM_ADAPTERS)], 16, "bfloat16", "cuda")
    # the install rows decode 32 beside
    max_seqs = max([*args.batches, *args.mixed_decodes, *args.profile_batches, *args.profile_mixed,
                    *args.host_profile_batches,
                    *args.sampled_batches, 32])
    runners = {}
    modes = {"on": [True], "off": [False], "both": [True, False]}
    for path, ops, pdl, gemv, fold, max_loras, split, fold_cols in itertools.product(
            args.lora_paths, modes[args.fused_ops], modes[args.pdl], modes[args.gemv], modes[args.fold],
            args.max_loras, args.split_rows, args.fold_cols):
        fused = path != "unfused"
        config = parse_config({"model": {"path": str(model_dir), "device": "cuda"},
                               "kv": {"num_blocks": 64 * max_seqs + 8},
                               "lora": {"max_loras": max_loras, "max_lora_rank": 16, "allow_runtime_updates": True},
                               "scheduler": {"max_model_len": 2048}})
        share = lora_layers.MAX_FUSED_SHARE
        lora_layers.MAX_FUSED_SHARE = share if fused else 0.0  # 0: no linear's A fits under its weight
        triton_fused.enabled = ops  # read as the graphs are captured: each runner replays its own kernels
        triton_launch.enabled = pdl
        triton_linear.enabled = gemv
        lora_layers.FOLD = fold
        lora_layers.BESIDE = path == "beside"
        triton_ops.MIN_SPLIT_FUSED_ROWS = triton_ops.MIN_SPLIT_ROWS = split  # read as graphs are captured
        triton_fused.FOLD_COLS = fold_cols
        try:
            runner = build_runner(config, load_model_info(config))
        finally:
            lora_layers.MAX_FUSED_SHARE = share
        adapters = load_adapters(runner, paths, model_dir)
        for slot, weights in enumerate(adapters[:max_loras], start=1):
            runner.install_adapter(slot, weights)
        runners[(path, "fused" if ops else "torch", "on" if pdl else "off", "on" if gemv else "off",
                 "on" if fold else "off", max_loras, split, fold_cols)] = runner
    # The eager steps below run as the first runner was built.
    triton_fused.enabled = modes[args.fused_ops][0]
    triton_launch.enabled = modes[args.pdl][0]
    triton_linear.enabled = modes[args.gemv][0]
    lora_layers.FOLD = modes[args.fold][0]
    lora_layers.BESIDE = args.lora_paths[0] == "beside"
    triton_ops.MIN_SPLIT_FUSED_ROWS = triton_ops.MIN_SPLIT_ROWS = args.split_rows[0]
    triton_fused.FOLD_COLS = args.fold_cols[0]
    print(f"# {torch.cuda.get_device_name()}: decode step ms (median of {args.steps}), ModelRunner.execute, "
          f"context ~{CONTEXT}; lora beside: the delta on a side stream during the GEMM; fused: every LoRA linear's "
          f"A under its weight (one GEMM, then the expand); "
          f"ops fused: RMSNorm+add, rotary+KV write, SiLU-and-mul one launch each; gpu: the decode graph "
          f"replayed back to back (the device's time alone, CUDA events); loop: steps back to back in the "
          f"worker's overlapped order (the next step built while the device runs this one: a served batch's step)")
    print(f"{'batch':>5} {'lora':>8} {'ops':>6} {'pdl':>4} {'gemv':>4} {'fold':>4} {'slots':>5} {'split':>5} "
          f"{'cols':>4} "
          f"{'base':>8} {'one':>8} {'mixed':>8} "
          f"{'one/base':>9} {'mixed/base':>10} {'gpu base':>8} {'gpu one':>8} {'gpu o/b':>8} "
          f"{'loop base':>9} {'loop one':>8} {'loop o/b':>8}")
    for batch in args.batches:
        for (linears, ops, pdl, gemv, fold, max_loras, split, cols), runner in runners.items():  # side by side
            base = time_steps(runner, [0] * batch, "b", args.steps)
            one = time_steps(runner, [1] * batch, "o", args.steps)
            held = min(max_loras, NUM_ADAPTERS)
            mixed = time_steps(runner, [1 + i % held for i in range(batch)], "m", args.steps)
            gpu_base = time_replays(runner, [0] * batch, "gb", args.steps)
            gpu_one = time_replays(runner, [1] * batch, "go", args.steps)
            loop_base = time_overlapped(runner, [0] * batch, "lb", args.steps)
            loop_one = time_overlapped(runner, [1] * batch, "lo", args.steps)
            print(f"{batch:>5} {linears:>8} {ops:>6} {pdl:>4} {gemv:>4} {fold:>4} {max_loras:>5} {split:>5} {cols:>4} "
                  f"{base:>8.3f} {one:>8.3f} {mixed:>8.3f} "
                  f"{base / one:>8.1%} {base / mixed:>9.1%} {gpu_base:>8.3f} {gpu_one:>8.3f} {gpu_base / gpu_one:>8.1%} "
                  f"{loop_base:>9.3f} {loop_one:>8.3f} {loop_base / loop_one:>8.1%}")
    runner = next(iter(runners.values()))
    if args.sampled_batches:
        print_sampled(runner, args.sampled_batches, args.steps)
    if args.mixed_decodes:
        print_mixed(runner, args.mixed_decodes, args.steps)
    print("# adapter installs, ms (median of 8): install_adapter from a bf16 host copy (returns once the device "
          "holds it), and reinstall_adapter from the image the install kept (a swap back in: from its device twin "
          "one copy queued with the steps, so the call returns first; then until the device holds it)")
    # On the runner of the most slots: installs alternate between slots 1 and 2, a thread decodes beside on 3.
    key, runner = max(runners.items(), key=lambda item: item[0][5])
    slots = key[5]
    besides = (0, 8, 32) if slots >= 3 else (0,) if slots == 2 else ()
    if not besides:
        print(f"#   none timed: installs take two slots, the runners have {slots} (--max-loras)")
    for beside in besides:
        install, again, held, step = time_install(runner, adapters, 8, beside)
        where = f"beside a thread decoding {beside} sequences (its steps {step:.2f} ms)" if beside else "alone"
        print(f"#   {where}: install {install:.1f}, reinstall {again:.1f} (held on the device {held:.1f})")
    for batch in args.host_profile_batches:
        for temperature in (0.0, 1.0):
            print(f"# the host's side of decode steps of {batch} base rows, temperature {temperature:g}")
            print(profile_host(runner, batch, args.steps, temperature))
    if not args.no_profile:
        for batch in args.profile_batches:
            for name, slot in (("base", 0), ("one adapter", 1)):
                print(f"# torch.profiler, 5 decode steps of {batch} rows, {name}")
                print(profile_step(runner, [slot] * batch))
        for num_decodes in args.profile_mixed:
            print(f"# torch.profiler, 5 mixed steps: one {PREFILL}-token prefill beside {num_decodes} decodes, base")
            print(profile_mixed(runner, num_decodes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
