"""One decode step in process: our ``ModelRunner.execute`` against the
``transformers`` model's forward on the same batch, CPU time and op profile.

Both sides decode ``--num-seqs`` sequences of ``--min-context`` ..
``--max-context`` prompt tokens (the same random ids, one seed), one new token
per sequence per step, greedy. Ours is a whole worker step (batch building,
the decoder, the LM head on the sampled rows, sampling); ``transformers``'s is
what ``generate`` runs per decode step on a left-padded batch (one forward
with its KV cache, the last position's logits, argmax). CPU time is the
thread's (``time.thread_time``), which other jobs on a shared machine distort
far less than wall time; the median over ``--steps`` steps is printed.

    python tools/profile_step.py                      # SmolLM2, 8 sequences, 1 thread
    python tools/profile_step.py --profile            # plus torch.profiler's top ops of each side
    python tools/profile_step.py --num-seqs 1 --threads 2
    python tools/profile_step.py --side ours --split  # ours split: linears, attention, LM head, the rest
    python tools/profile_step.py --side ours --linear onednn   # our step on oneDNN's linears (the fallback)
    python tools/profile_step.py --side ours --quantization int4 --num-seqs 1 --threads 2
    python tools/profile_step.py --side ours --layers python --split   # each layer through Python, not one C call
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from _common import model_dir_of, positive_int, run_tool  # noqa: E402


def make_prompts(num_seqs: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=gen).tolist()
    # Skip the first ids (special tokens) so no prompt holds an EOS.
    return [torch.randint(100, vocab_size, (n,), generator=gen).tolist() for n in lens]


class OurStep:
    """A ModelRunner fed by a minimal scripted conductor: prefill once, then decode steps."""

    def __init__(self, model_dir: Path, prompts: list[list[int]], block_size: int = 16, quantization: str = "none",
                 layers: str = "stack"):
        from mstar_actors import messages
        from mstar_actors.config import parse_config
        from mstar_actors.model_info import load_model_info
        from mstar_actors.models.cpu_stack import CpuDecoderStack
        from mstar_actors.runner.build import build_runner

        self.messages = messages
        max_len = max(len(p) for p in prompts) + 512
        num_blocks = len(prompts) * (-(-max_len // block_size)) + 1
        config = parse_config({"model": {"path": str(model_dir), "dtype": "float32", "device": "cpu",
                                         "quantization": quantization},
                               "kv": {"block_size": block_size, "num_blocks": num_blocks}})
        self.runner = build_runner(config, load_model_info(config))
        if layers == "python" and isinstance(self.runner.model.run_layers, CpuDecoderStack):
            self.runner.model.run_layers = self.runner.model.run_layers.fallback
        self.block_size = block_size
        sampling = messages.SamplingParams(max_tokens=1 << 20, temperature=0.0)
        self.seqs = {f"r{i}": dict(num_tokens=len(p), blocks=[]) for i, p in enumerate(prompts)}
        self.next_block = 1
        started = [messages.SeqStart(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
        self.step_id = 0
        self._execute(started, [self._chunk(rid, 0, len(p)) for rid, p in zip(self.seqs, prompts)])

    def _chunk(self, rid: str, start: int, num_tokens: int):
        seq = self.seqs[rid]
        while len(seq["blocks"]) * self.block_size < start + num_tokens:
            seq["blocks"].append(self.next_block)
            self.next_block += 1
        return self.messages.ScheduledChunk(rid, start, num_tokens, list(seq["blocks"]), True)

    def _execute(self, started, chunks) -> None:
        plan = self.messages.StepPlan(self.step_id, started, chunks)
        self.step_id += 1
        for token in self.runner.execute(plan):
            self.seqs[token.request_id]["num_tokens"] += 1

    def step(self) -> None:
        self._execute([], [self._chunk(rid, seq["num_tokens"] - 1, 1) for rid, seq in self.seqs.items()])


class HfStep:
    """``transformers``'s decode step as ``generate`` runs it on a left-padded batch."""

    def __init__(self, model_dir: Path, prompts: list[list[int]]):
        from transformers import AutoModelForCausalLM, DynamicCache

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          local_files_only=True).eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.next_ids = self._forward(ids, self._positions(width))

    def _positions(self, num_new: int) -> torch.Tensor:
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        return positions[:, -num_new:]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float().argmax(-1, keepdim=True)

    def step(self) -> None:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        with torch.inference_mode():
            self.next_ids = self._forward(self.next_ids, self._positions(1))


class Split:
    """CPU time of our step spent in the decoder's linears (each
    ``LoraLinear``'s base product: the packed or quantized kernel), in
    attention (the backend's ``attend``, all layers, and its ``write_kv``
    where the fused rotary and KV write does not take it) and in
    the LM head (``compute_logits``), per step: wrappers on the runner's own
    objects, so nothing else changes. Steps whose layers run as one C call
    (``cpu_stack``) show it as "layers (C)": its linears and attention are
    inside, and no longer apart."""

    def __init__(self, ours: OurStep):
        from mstar_actors.models.cpu_stack import CpuDecoderStack
        from mstar_actors.models.decoder import LoraLinear

        self.parts = {"linears": 0.0, "attention": 0.0, "layers (C)": 0.0, "lm head": 0.0}
        model = ours.runner.model
        if isinstance(model.run_layers, CpuDecoderStack):
            model.run_layers.run = self._timed("layers (C)", model.run_layers.run)
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module._base = self._timed("linears", module._base)
        backend = model.attention_backend
        for name in ("write_kv", "attend"):
            setattr(backend, name, self._timed("attention", getattr(backend, name)))
        model.compute_logits = self._timed("lm head", model.compute_logits)
        self.ours = ours

    def _timed(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part] += time.thread_time() - start
        return timed

    def run(self, num_steps: int) -> None:
        samples = {name: [] for name in [*self.parts, "rest", "step"]}
        for _ in range(num_steps):
            self.parts = dict.fromkeys(self.parts, 0.0)
            start = time.thread_time()
            self.ours.step()
            total = time.thread_time() - start
            for name, value in [*self.parts.items(), ("rest", total - sum(self.parts.values())), ("step", total)]:
                samples[name].append(value * 1000)
        print("ours split, CPU ms per step (median): " + ", ".join(
            f"{name} {statistics.median(values):.1f}" for name, values in samples.items()), flush=True)


def time_steps(step, num_steps: int, num_warmup: int = 3) -> tuple[list[float], list[float]]:
    """(this thread's CPU seconds, wall seconds) per step."""
    for _ in range(num_warmup):
        step()
    times, walls = [], []
    for _ in range(num_steps):
        start, wall = time.thread_time(), time.perf_counter()
        step()
        times.append(time.thread_time() - start)
        walls.append(time.perf_counter() - wall)
    return times, walls


def profile_steps(step, num_steps: int, num_rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=num_rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    p.add_argument("--num-seqs", type=positive_int, default=8, help="sequences decoding together (default 8)")
    p.add_argument("--min-context", type=positive_int, default=50, help="shortest prompt in tokens (default 50)")
    p.add_argument("--max-context", type=positive_int, default=100, help="longest prompt in tokens (default 100)")
    p.add_argument("--steps", type=positive_int, default=20, help="timed decode steps per side (default 20)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--side", choices=["ours", "hf", "both"], default="both")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops over 5 steps of each side")
    p.add_argument("--split", action="store_true",
                   help="then split our step's CPU time: linears, attention, LM head (GEMM + LoRA), the rest")
    p.add_argument("--linear", choices=["kernel", "onednn"], default="kernel",
                   help="our float32 linears: our AVX-512 kernel (default, where it builds) or oneDNN's")
    p.add_argument("--quantization", choices=["none", "int8", "int4", "int4_a8"], default="none",
                   help="our side's model.quantization (default none: float32)")
    p.add_argument("--layers", choices=["stack", "python"], default="stack",
                   help="our CPU steps' layers: one C call where a step fits (default) or each through Python")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.min_context > args.max_context:
        p.error(f"--min-context {args.min_context} is above --max-context {args.max_context}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mstar_actors.models import cpu_linear
    from mstar_actors.models.loader import load_spec

    torch.set_num_threads(args.threads)
    cpu_linear.use_kernel(args.linear == "kernel")
    model_dir = model_dir_of(args.model)
    _, spec = load_spec(model_dir)
    prompts = make_prompts(args.num_seqs, args.min_context, args.max_context, spec.vocab_size, args.seed)
    print(f"model {model_dir.name}, {args.num_seqs} sequences, prompts {sorted(len(p) for p in prompts)} tokens, "
          f"threads {args.threads}, seed {args.seed}, linears {args.linear}, quantization {args.quantization}, "
          f"layers {args.layers}",
          flush=True)
    medians = {}
    for name in (["ours", "hf"] if args.side == "both" else [args.side]):
        side = (OurStep(model_dir, prompts, quantization=args.quantization, layers=args.layers) if name == "ours"
                else HfStep(model_dir, prompts))
        step = side.step
        times, walls = time_steps(step, args.steps)
        medians[name] = statistics.median(times) * 1000
        print(f"{name:>4}: CPU ms per step median {medians[name]:.1f} (min {min(times) * 1000:.1f}, "
              f"max {max(times) * 1000:.1f}, {args.steps} steps), wall ms median {statistics.median(walls) * 1000:.1f}",
              flush=True)
        if args.profile:
            profile_steps(step, 5, 20)
        if args.split and name == "ours":
            Split(side).run(args.steps)
    if len(medians) == 2:
        print(f"ours / hf: {medians['ours'] / medians['hf']:.2f}")
    return 0


if __name__ == "__main__":
    run_tool(main)
