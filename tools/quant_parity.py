"""Quantized weights against the float32 model they come from, in process.

For each of ``--prompts`` built-in chat questions (``bench_serve.QUESTIONS``),
greedy decoding of ``--max-tokens`` tokens (``ignore_eos``) through our
``ModelRunner`` twice: ``model.quantization: none`` (float32) and
``--quantization``. Prints how many answers agree token for token, where
the first differing token falls, and, teacher-forced on the float32 answer,
the largest logit difference (absolute, and relative to that position's
logit range) over every decoded position.

    python tools/quant_parity.py                          # embedded SmolLM2, int4
    python tools/quant_parity.py --quantization int8 --prompts 32
    python tools/quant_parity.py --model DIR              # a float folder, requantized
    python tools/quant_parity.py --lora-rank 16           # every answer on a random all-linear adapter

On the embedded model the float32 folder is the GGUF dequantized, so int4
gives back its codes: differences are float32 rounding. On a float folder
they are the quantization's own error. ``--lora-rank``: both runners serve
every prompt on one random adapter (``bench_lora``'s, lora_B at 0.02: PEFT
starts it at zero), whose factors the quantized runner's layer stack keeps in
bfloat16 (``LoraStack.keep_half``): their rounding is then in the differences
too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from _common import model_dir_of, positive_int, run_tool  # noqa: E402
from bench_serve import make_questions  # noqa: E402


def make_runner(model_dir: Path, quantization: str, num_blocks: int, adapter: Path | None = None, rank: int = 0):
    """A runner of ``model_dir`` at ``quantization``; with ``adapter``, it installed in slot 1."""
    from mstar_actors.config import parse_config
    from mstar_actors.lora import BaseShapes, read_adapter
    from mstar_actors.model_info import load_model_info
    from mstar_actors.runner.build import build_runner

    raw = {"model": {"path": str(model_dir), "dtype": "float32", "device": "cpu", "quantization": quantization},
           "kv": {"block_size": 16, "num_blocks": num_blocks}}
    if adapter is not None:
        raw["lora"] = {"max_loras": 1, "max_lora_rank": rank, "allow_runtime_updates": True}
    config = parse_config(raw)
    runner = build_runner(config, load_model_info(config))
    if adapter is not None:
        from transformers import AutoConfig

        shapes = BaseShapes.from_hf_config(AutoConfig.from_pretrained(str(model_dir), local_files_only=True).to_dict())
        runner.install_adapter(1, read_adapter(adapter, base=shapes, max_rank=rank, name="random"))
    return runner


def decode(runner, prompt: list[int], num_new: int, forced: list[int] | None = None,
           slot: int = 0) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens, and the logits of every decoded position ([num_new, vocab]), one sequence alone.
    With ``forced``, those tokens are fed instead of the sampled ones (teacher forcing)."""
    from mstar_actors import messages
    from mstar_actors.runner.sampling import sample_tokens

    sampling = messages.SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    blocks = list(range(1, -(-(len(prompt) + num_new) // 16) + 1))
    rows: list[torch.Tensor] = []
    original = runner.sampler

    def keep(logits, sample_rows, generator=None):  # the runner takes a sampler's list of tokens too
        rows.append(logits[0].clone())
        sampled = sample_tokens(logits, sample_rows, generator=generator)
        if forced is None:
            return sampled
        return [messages.SampledToken(sampled[0].request_id, forced[len(rows) - 1])]

    runner.sampler = keep
    try:
        plan = messages.StepPlan(0, [messages.SeqStart("p", prompt, sampling, lora_slot=slot)],
                                 [messages.ScheduledChunk("p", 0, len(prompt), blocks, True)])
        tokens = [t.token_id for t in runner.execute(plan)]
        for step in range(1, num_new):
            chunk = messages.ScheduledChunk("p", len(prompt) + step - 1, 1, blocks, True)
            tokens += [t.token_id for t in runner.execute(messages.StepPlan(step, [], [chunk]))]
        runner.execute(messages.StepPlan(num_new, [], [], finished=["p"]))
    finally:
        runner.sampler = original
    return tokens, torch.stack(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    p.add_argument("--quantization", choices=["int8", "int4", "int4_a8"], default="int4")
    p.add_argument("--prompts", type=positive_int, default=16, help="built-in chat questions (default 16)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="greedy tokens per answer (default 64)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="serve every prompt on a random all-linear adapter of this rank (default 0: none)")
    args = p.parse_args(argv)
    if args.lora_rank < 0:
        p.error(f"--lora-rank: 0 (no adapter) or more, got {args.lora_rank}")
    from transformers import AutoTokenizer


    torch.set_num_threads(args.threads)
    model_dir = model_dir_of(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in make_questions(args.prompts)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    num_blocks = -(-(max(map(len, prompts)) + args.max_tokens) // 16) + 2
    with tempfile.TemporaryDirectory() as tmp:
        adapter = None
        if args.lora_rank:
            from transformers import AutoModelForCausalLM

            from bench_lora import save_random_adapter

            adapter = Path(tmp) / "random"
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
            save_random_adapter(model, adapter, args.lora_rank, seed=1)
        from mstar_actors.config import ConfigError

        try:
            float_runner = make_runner(model_dir, "none", num_blocks, adapter, args.lora_rank)
            quant_runner = make_runner(model_dir, args.quantization, num_blocks, adapter, args.lora_rank)
        except ConfigError as err:  # (int4_a8 on an AVX-512 CPU): what the server would say at start, one line
            p.error(f"--quantization {args.quantization}: {err}")
    slot = int(adapter is not None)
    num_same, firsts, worst_abs, worst_rel = 0, [], 0.0, 0.0
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            want, want_logits = decode(float_runner, prompt, args.max_tokens, slot=slot)
            got, _ = decode(quant_runner, prompt, args.max_tokens, slot=slot)
            _, quant_logits = decode(quant_runner, prompt, args.max_tokens, forced=want, slot=slot)
            diff = (quant_logits - want_logits).abs().amax(dim=1)
            spread = want_logits.amax(dim=1) - want_logits.amin(dim=1)
            worst_abs = max(worst_abs, float(diff.max()))
            worst_rel = max(worst_rel, float((diff / spread).max()))
            first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
            num_same += first is None
            if first is not None:
                firsts.append(first)
            print(f"# prompt {i}: {'same' if first is None else f'first difference at token {first}'}, "
                  f"max |logit diff| {float(diff.max()):.2e}", file=sys.stderr, flush=True)
    on = f", on a random rank-{args.lora_rank} adapter" if args.lora_rank else ""
    print(f"model {model_dir.name}, {args.quantization} against float32{on}, {len(prompts)} prompts x "
          f"{args.max_tokens} greedy tokens")
    print(f"answers equal token for token: {num_same}/{len(prompts)}"
          + (f"; the others first differ at tokens {sorted(firsts)}" if firsts else ""))
    print(f"largest logit difference (teacher-forced on the float32 answer): {worst_abs:.3e} absolute, "
          f"{worst_rel:.3e} of that position's logit range")
    return 0


if __name__ == "__main__":
    run_tool(main)
