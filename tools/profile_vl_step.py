"""Where a video prefill step's time goes, in the worker's own code path.

    python tools/profile_vl_step.py --device cpu --clip 320x240x2      # here: seconds
    python tools/profile_vl_step.py --device cuda                       # the GPU host: the bench's heavy clip

Builds the TTFT benchmark's tiny random Qwen2.5-VL (the tests'
``save_tiny_vl_model(real_patches=True)``: Qwen2.5-VL's 14 px patches and
112 px windows, a tiny tower and text stack) and a clip (default the heavy
one, 640x480, 8 s at 2 fps: 16 frames, ~3.1k prompt tokens, ~12.5k
patches), prepares ``--requests`` video requests with the real preparer
(the one the prepare actor loads), then runs ``ModelRunner.execute`` on one
StepPlan that prefills them all, as the conductor plans it when the four
Prepared arrive together. The pixel rows take the worker's path: a
``MediaCopies`` over an arena stand-in (the rank's private copy), then the
runner's resolver.

Printed: each draft's time; per stage of the step (the rank's media copy,
sequence start with the multimodal positions, host batch, host->device
copies, the vision tower's patch embedding, each block by type and its
attention / MLP, the merger, the splice, the text layers, logits, sampling),
the median over ``--repeats`` steps, each stage timed with wall time around
a device synchronisation (stages nest: the tower holds its blocks); then a
``torch.profiler`` table (CPU and, on CUDA, CUDA activities) of one step.
The synchronisations cost a little; the whole step's wall time is also
printed without them.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the engine, and the tools' shared modules

from _common import check_device, non_negative_int, positive_float, positive_int, run_tool  # noqa: E402
from _vl_common import Clip, context_for, make_request, parse_clip  # noqa: E402

from tests.vl_fixtures import save_tiny_vl_model  # noqa: E402


class StageTimer:
    """Wraps methods so each call adds its synchronised wall time to a stage."""

    def __init__(self, device):
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.ms: dict[str, list[float]] = collections.defaultdict(list)
        self.on = True
        self._current: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr, None)
        if inner is None:  # a stage this version of the code does not have
            return

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self._current[name] += 1e3 * (time.perf_counter() - start)

        setattr(obj, attr, timed)

    def end_step(self) -> None:
        for name, ms in self._current.items():
            self.ms[name].append(ms)
        self._current.clear()


def instrument(runner, copies, timer: StageTimer) -> None:
    import mstar_actors.runner.model_runner as runner_module

    model = runner.model
    timer.wrap(copies, "apply", "rank's media copy (MediaCopies.apply)")
    timer.wrap(runner, "start", "sequence start (checks, mrope positions)")
    timer.wrap(runner_module, "build_batch", "host batch (build_batch)")
    timer.wrap(runner, "_to_device", "host batch -> device (ids, slots, tables)")
    timer.wrap(runner.media, "_pixels", "pixel rows -> device")
    timer.wrap(runner.media, "step_inputs", "media step inputs (pixels, tower, positions, splice)")
    timer.wrap(model, "encode_media", "vision tower (whole)")
    visual = model.visual
    timer.wrap(visual, "_check", "  tower: input checks")
    timer.wrap(visual, "_geometry", "  tower: window order, segments, rotary (per forward)")
    timer.wrap(visual.patch_embed, "forward", "  tower: patch embedding")
    for i, block in enumerate(visual.blocks):
        kind = "full" if i in visual.spec.fullatt_block_indexes else "window"
        timer.wrap(block, "forward", f"  tower: {kind} block (whole)")
        timer.wrap(block.attn, "forward", f"    {kind} block: attention")
        timer.wrap(block.mlp, "forward", f"    {kind} block: MLP")
    timer.wrap(visual.merger, "forward", "  tower: patch merger")
    timer.wrap(model, "run_layers", "text layers")
    timer.wrap(model, "compute_logits", "logits")
    timer.wrap(runner, "sampler", "sampling")


def make_plan(step_id: int, drafts, block_size: int, previous: list[str], ledger):
    """``ledger`` (the scheduler's ``MediaLedger``) orders the rank's media copies."""
    from mstar_actors import messages
    from mstar_actors.prepare.preparers import with_media

    for rid in previous:
        ledger.end(rid)
    started, scheduled, next_block = [], [], 0
    for i, (draft, refs) in enumerate(drafts):
        prepared = with_media(draft, refs)
        rid = f"s{step_id}-{i}"
        num = len(prepared.prompt_token_ids)
        blocks = list(range(next_block, next_block + -(-num // block_size)))
        next_block += len(blocks)
        ledger.add(rid, prepared.media)
        started.append(messages.SeqStart(rid, prepared.prompt_token_ids, messages.SamplingParams(max_tokens=1, temperature=0.0),
                                         media=ledger.start(rid)))
        scheduled.append(messages.ScheduledChunk(rid, 0, num, blocks, True))
    copies, drops, releases = ledger.take()
    return messages.StepPlan(step_id, started, scheduled, finished=previous, copy_media=copies, drop_media=drops,
                             release_media=releases), next_block


class DictArena:
    """The arena's consumer end over in-process tensors (``MediaCopies`` reads it)."""

    def __init__(self):
        self.tensors = {}

    def put(self, tensor):
        from mstar_actors.messages import TensorRef

        key = len(self.tensors)
        self.tensors[key] = tensor
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef("dict", key, tensor.numel() * tensor.element_size(), dtype, tuple(tensor.shape))

    def view(self, ref):
        return self.tensors[ref.offset]

    def release(self, ref):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--clip", type=parse_clip, default=(640, 480, 8.0), metavar="WxHxSECONDS",
                        help="the video (default 640x480x8, the bench's heavy clip; 320x240x2 is quick on a CPU)")
    parser.add_argument("--fps", type=positive_float, default=2.0, help="frames sampled per second of clip")
    parser.add_argument("--requests", type=positive_int, default=4, help="videos prefilled together in one step")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--threads", type=non_negative_int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler table")
    args = parser.parse_args(argv)
    check_device(args.device)

    import torch

    from mstar_actors.config import Config, ModelConfig
    from mstar_actors.prepare.media import MediaLimits
    from mstar_actors.runner.media_copies import MediaCopies
    from mstar_actors.config import parse_config
    from mstar_actors.model_info import load_model_info
    from mstar_actors.runner.build import build_runner
    from mstar_actors.sched.media import MediaLedger
    from mstar_actors.prepare.preparers import load_preparer

    if args.threads:
        torch.set_num_threads(args.threads)
    width, height, seconds = args.clip
    clip = Clip(seconds, width, height, args.fps)
    max_model_len = context_for(clip)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_vl_model(Path(tmp) / "vl", real_patches=True, max_model_len=max_model_len)
        limits = MediaLimits(max_bytes=50 << 20, **clip.server_limits())
        preparer = load_preparer(load_model_info(Config(model=ModelConfig(path=str(folder)))), limits)
        url = clip.data_url()
        drafts, draft_ms, arena = [], [], DictArena()
        for i in range(args.requests):
            start = time.perf_counter()
            draft = preparer.draft(make_request(f"v{i}", "video", url), {})
            draft_ms.append(1e3 * (time.perf_counter() - start))
            drafts.append((draft, [arena.put(m.pixel_values) for m in draft.media]))
        num_prompt = len(drafts[0][0].prepared.prompt_token_ids)
        grid = drafts[0][0].media[0].grid_thw
        print(f"# clip {width}x{height} {seconds:g} s at {clip.fps:g} fps: grid {grid} ({grid[0] * grid[1] * grid[2]} patches), "
              f"{num_prompt} prompt tokens; {args.requests} requests in one step; {len(url) >> 10} KiB data: URL")
        print(f"# drafts (real preparation, one at a time): {', '.join(f'{ms:.0f}' for ms in draft_ms)} ms")

        copies = MediaCopies(arena)
        block_size = 16
        num_blocks = args.requests * -(-max_model_len // block_size) + 1
        config = parse_config({"model": {"path": str(folder), "dtype": args.dtype, "device": args.device},
                               "kv": {"block_size": block_size, "num_blocks": num_blocks},
                               "scheduler": {"max_model_len": max_model_len,
                                             "max_num_batched_tokens": args.requests * max_model_len}})
        runner = build_runner(config, load_model_info(config), copies.resolve)
        device = runner.device
        print(f"# device {device}, dtype {runner.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
        timer = StageTimer(device)
        instrument(runner, copies, timer)
        previous: list[str] = []
        ledger = MediaLedger()
        walls = []

        def step(step_id: int) -> float:
            nonlocal previous
            plan, _ = make_plan(step_id, drafts, block_size, previous, ledger)
            timer.sync()
            start = time.perf_counter()
            copies.apply(plan)
            tokens = runner.execute(plan)
            timer.sync()
            elapsed = 1e3 * (time.perf_counter() - start)
            assert len(tokens) == args.requests, tokens
            previous = [s.request_id for s in plan.started]
            return elapsed

        step(0)  # warm-up: first-call costs (allocator, kernels)
        timer.ms.clear()
        timer._current.clear()
        for i in range(args.repeats):
            walls.append(step(i + 1))
            timer.end_step()
        print(f"\n| stage (synchronised wall ms, median of {args.repeats} steps) | ms |\n|---|---|")
        for name, values in timer.ms.items():
            print(f"| {name} | {statistics.median(values):.2f} |")
        print(f"| **whole step, with the stage syncs** | {statistics.median(walls):.2f} |")
        timer.on = False
        plain = []
        for i in range(args.repeats):
            plain.append(step(100 + i))
        print(f"| **whole step, no stage syncs** | {statistics.median(plain):.2f} |")
        if args.no_profiler:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step(200)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(f"\ntorch.profiler, one step, sorted by {sort}:")
        print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    run_tool(main)
