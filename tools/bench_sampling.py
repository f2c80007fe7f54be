"""The sampler's cost a step on one device: ``sample_tokens`` against the
textbook form beside it (the exponential race over the whole vocabulary,
top-k and top-p read off a full sort, as vLLM's sampler and ours before
``CPU_CANDIDATES`` did), on peaked rows like a language model's (the top 20
tokens of 49,152 hold about 0.99 of the probability), ms a call (median of
``--iters``).

    python tools/bench_sampling.py                        # CPU, 1 / 8 / 32 rows, 2 threads
    python tools/bench_sampling.py --device cuda --rows 8 64 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mstar_actors.messages import SamplingParams
from mstar_actors.runner.sampling import SampleRow, sample_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check_device, positive_int, run_tool  # noqa: E402
from _gpu_timing import eager_us  # noqa: E402

CASES = {"temperature 1": {}, "top_p 0.9": {"top_p": 0.9}, "top_k 40": {"top_k": 40},
         "top_k 50, top_p 0.95": {"top_k": 50, "top_p": 0.95}, "seeded": {"seed": 5}}


def textbook(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token a row: temperature, top-k and top-p off a full sort, then the exponential race."""
    logits = logits.to(torch.float32) / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if params.top_k > 0:
            sorted_logits[:, params.top_k:] = float("-inf")
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[:, 0] = False
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=positive_int, default=49152)
    p.add_argument("--threads", type=positive_int, default=2, help="torch's CPU threads")
    p.add_argument("--iters", type=positive_int, default=15)
    args = p.parse_args(argv)
    check_device(args.device)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shared = torch.Generator(device=args.device).manual_seed(0)
    print(f"# sampling, ms a call: {args.device}, vocab {args.vocab}, torch {torch.__version__}, "
          f"{args.threads} threads")
    print(f"{'rows':>4} {'case':<22} {'ours':>8} {'textbook':>9} {'speed-up':>8}")
    for num_rows in args.rows:
        logits = torch.randn(num_rows, args.vocab, generator=gen) * 2
        logits[:, :20] += torch.linspace(14, 6, 20)
        logits = logits.to(args.device)
        for label, params in CASES.items():
            sampling = SamplingParams(**params)
            rows = [SampleRow(f"r{i}", sampling, [1], [2]) for i in range(num_rows)]
            timing = dict(device=args.device, warmup=1, iters=args.iters)
            ours = eager_us(lambda: sample_tokens(logits, rows, generator=shared), **timing) / 1e3
            book = eager_us(lambda: textbook(logits, sampling, shared).tolist(), **timing) / 1e3
            print(f"{num_rows:>4} {label:<22} {ours:>8.3f} {book:>9.3f} {book / ours:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    run_tool(main)
