"""Serving benchmark: our live server over HTTP against ``transformers`` ``generate``.

In one run, on the same weights, prompts and token limits, two workloads
(``--workload``, default both, one table each):

- ``fixed``: ``--num-prompts`` similar prompts, every system makes exactly
  ``--max-tokens`` tokens per prompt (the server with ``ignore_eos``,
  ``generate`` with ``min_new_tokens = max_new_tokens``). Equal lengths in
  and out: a padded batch does the same work as continuous batching, so this
  is the worst case for the server at concurrency > 1.
- ``natural``: a built-in list of ``--natural-prompts`` varied chat questions
  (some want one word, some a list or a paragraph), greedy, each stops at
  EOS or after ``--natural-max-tokens``. Only useful tokens count: those up
  to and including each answer's EOS, as ``generate`` returns them (a padded
  batch keeps stepping until its longest member ends; those steps make no
  useful tokens). Greedy decoding is the same in every system, so the useful
  token totals should be equal; the ``differ`` column counts the prompts
  whose answer (text and token count) differs from ``generate`` sequential's.

Systems, never running at the same time:

- ``generate`` sequential (one prompt at a time: the concurrency-1 reference)
  and padded-batch (``--batch`` prompts at once, in order, left padding);
- our server (``python -m mstar_actors serve``, every actor in its own
  process) at each ``--concurrency``: that many clients, each sending its
  next prompt as soon as its last answer ends, streaming chat completions so
  time to first token is measured where a client sees it.

Both sides run torch with the same number of intra-op threads (``--threads``,
default: the cores this process may use): this process sets it for
``generate`` and the server's config sets ``parallel.worker_torch_threads``
(the other actors do no tensor work). On a machine other jobs share, use
``--threads 1``: OpenMP's spinning threads slow down many times over when
they lose their core.

    python tools/bench_serve.py                       # embedded SmolLM2, both workloads, concurrency 1 and 8
    python tools/bench_serve.py --workload natural --natural-prompts 32   # every built-in question
    python tools/bench_serve.py --model DIR --concurrency 1,4,16 --max-tokens 64
    python tools/bench_serve.py --url http://127.0.0.1:8000/v1 --model DIR   # an already running server
    python tools/bench_serve.py --tp 2 --workload fixed --concurrency 1,4   # two sharded ranks
    python tools/bench_serve.py --peer llama.cpp      # against llama-server, float32 and int4 (tools/_peer.py)

Prints a table per workload and the ratios to ``generate`` (issue targets:
concurrency 1 >= 0.9x sequential, concurrency 8 >= 2x batched). Output
tokens/s = (useful) tokens / wall time. TTFT is the median; CPU ms/token is
user + system time of every process doing the work (this one for generate;
the launcher and every actor for the server, not the HTTP client), which
other jobs on a shared machine distort far less than wall time.

To see where a decode step's time goes, in one process and without HTTP:
``tools/profile_step.py`` (our ``ModelRunner.execute`` against the
``transformers`` forward on the same batch, with ``--profile`` for an op
breakdown of each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from _common import (  # noqa: E402
    Server, check_url, free_port, model_dir_of, positive_int, positive_ints, progress, run_tool, write_output,
)

TOPICS = ["the ocean", "a city at night", "mountains", "old libraries", "trains", "the desert", "winter",
          "a busy market", "rivers", "the moon", "forests", "small islands", "bridges", "gardens", "storms",
          "lighthouses"]
# Varied on purpose: one-word answers, short facts, lists, paragraphs, so
# requests end at very different times (and prompts differ in length).
QUESTIONS = [
    "What is the capital of France? Answer with one word.",
    "Write a paragraph about why the sky is blue.",
    "List five fruits that are red.",
    "Is water wet? Answer yes or no.",
    "Explain in a few sentences how a bicycle works.",
    "What is 7 times 8?",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "Describe the water cycle to a ten-year-old, step by step.",
    "Name the largest planet in our solar system.",
    "Write a short story about a robot who learns to paint.",
    "What color do you get when you mix blue and yellow? One word.",
    "List the days of the week.",
    "Why do leaves change color in autumn? Explain in one paragraph.",
    "Who wrote Romeo and Juliet?",
    "Suggest four names for a pet cat.",
    "What are the main differences between a virus and a bacterium?",
    "Say hello.",
    "Write a haiku about rain.",
    "I am planning a weekend trip to the mountains with two friends. We like hiking but one of us has "
    "a bad knee. What should we pack, and how should we plan the days?",
    "What is the boiling point of water in Celsius?",
    "List the steps to make a cup of tea.",
    "Summarize the plot of Cinderella in two sentences.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "Explain what a computer program is to someone who has never used a computer.",
    "Give one synonym for 'happy'.",
    "What are three benefits of regular exercise?",
    "How many legs does a spider have?",
    "Write a polite email asking a colleague to review a document by Friday.",
    "What does DNA stand for?",
    "Compare cats and dogs as pets in a short paragraph.",
    "Spell the word 'necessary' backwards.",
]


@dataclass
class Workload:
    name: str
    prompts: list[list[dict]]
    max_tokens: int
    exact: bool  # every answer is exactly max_tokens long (ignore_eos / min_new_tokens)


@dataclass
class Result:
    name: str
    num_tokens: int
    wall_s: float
    ttft_s: list[float]
    cpu_s: float | None = None  # CPU time (user + system) of every process doing the work
    answers: dict[int, tuple[str, int]] = field(default_factory=dict)  # prompt index -> (text, tokens)
    num_differ: int | None = None  # prompts answered unlike generate sequential

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s

    def row(self) -> str:
        ttft = f"{statistics.median(self.ttft_s) * 1000:8.0f}" if self.ttft_s else "       -"
        cpu = f"{self.cpu_s / self.num_tokens * 1000:11.1f}" if self.cpu_s is not None else "          -"
        differ = f"{self.num_differ:>7}" if self.num_differ is not None else "      -"
        return (f"{self.name:<28} {self.num_tokens:>7} {self.wall_s:>8.2f} {self.tokens_per_s:>9.1f} {ttft} {cpu}"
                f" {differ}")


def make_messages(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}] for i in range(num)]


def make_questions(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(num)]


# ---- transformers generate --------------------------------------------------


class Generate:
    """``transformers`` ``generate`` on the model, loaded once for every workload."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          local_files_only=True).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos_ids)

    def generate(self, texts: list[str], num_new: int, exact: bool) -> list[list[int]]:
        """New token ids per row, cut after the row's first EOS (what is useful)."""
        enc = self.tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        with self.torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=num_new, min_new_tokens=num_new if exact else None,
                                      do_sample=False, pad_token_id=self.pad)
        rows = out[:, enc.input_ids.shape[1]:].tolist()
        if exact:
            return rows
        return [row[: next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))] for row in rows]

    def run(self, workload: Workload, batch: int) -> list[Result]:
        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m in workload.prompts]
        self.generate(texts[:1], 2, True)  # warm up
        results = []
        for size, name in ((1, "generate sequential"), (batch, f"generate batch {batch} (padded)")):
            result = Result(name, 0, 0.0, [], 0.0)
            for i in range(0, len(texts), size):
                chunk = texts[i : i + size]
                t0 = time.perf_counter()
                self.generate(chunk, 1, True)  # time to first token: a generate of one token, timed apart
                result.ttft_s += [time.perf_counter() - t0] * len(chunk)
                t0, c0 = time.perf_counter(), time.process_time()
                rows = self.generate(chunk, workload.max_tokens, workload.exact)
                result.wall_s += time.perf_counter() - t0
                result.cpu_s += time.process_time() - c0
                for j, row in enumerate(rows):
                    result.answers[i + j] = (self.tokenizer.decode(row, skip_special_tokens=True), len(row))
                    result.num_tokens += len(row)
                progress(f"{workload.name}: {name}: {i + len(chunk)}/{len(texts)}")
            results.append(result)
        return results


# ---- our server -------------------------------------------------------------


def for_model(model_dir: Path, name: str, num_seqs: int, num_threads: int, tmp: Path, tp: int = 1,
              quantization: str = "none", async_scheduling: bool | None = None) -> Server:
    """The CPU server this benchmark measures; with ``tp`` ranks the threads are split between them."""
    return Server({
        "model": {"path": str(model_dir), "name": name, "dtype": "float32", "device": "cpu",
                  "quantization": quantization},
        "scheduler": {"max_num_seqs": max(num_seqs, 8), "max_num_batched_tokens": 1024, "max_model_len": 2048,
                      "async_scheduling": async_scheduling},
        "kv": {"block_size": 16, "num_blocks": 1024},
        "parallel": {"tp": tp, "worker_torch_threads": max(1, num_threads // tp)},
        "server": {"host": "127.0.0.1", "port": free_port()},
    }, tmp)


async def one_request(session, url: str, model: str, messages: list[dict], max_tokens: int,
                      exact: bool) -> tuple[float, str, int]:
    """Stream one greedy chat completion: (time to first token, text, number of tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": exact,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, num_tokens = None, [], 0
    async with session.post(url + "/chat/completions", json=body) as response:
        if response.status != 200:
            raise SystemExit(f"server answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(content)
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(parts), num_tokens


async def run_server_load(url: str, model: str, workload: Workload, concurrency: int,
                          server: Server | None = None, fresh_connections: bool = False) -> Result:
    """``concurrency`` clients take the prompts in order; each sends its next one
    as soon as its last answer ends, so ``concurrency`` requests are in flight.
    ``fresh_connections``: a new connection per request (llama-server closes a
    streamed response's connection, which a kept-alive session would reuse)."""
    import aiohttp

    queue = list(enumerate(workload.prompts))
    result = Result(f"server concurrency {concurrency}", 0, 0.0, [])

    async def client(session) -> None:
        while queue:
            i, messages = queue.pop(0)
            ttft, text, n = await one_request(session, url, model, messages, workload.max_tokens, workload.exact)
            if workload.exact and n != workload.max_tokens:
                raise SystemExit(f"request {i}: {n} tokens, expected {workload.max_tokens} (ignore_eos)")
            result.ttft_s.append(ttft)
            result.answers[i] = (text, n)
            result.num_tokens += n
            progress(f"{workload.name}: server concurrency {concurrency}: {len(result.answers)}/{len(workload.prompts)}")

    connector = aiohttp.TCPConnector(force_close=fresh_connections)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:
        await one_request(session, url, model, workload.prompts[0], 2, True)  # warm up
        start, cpu = time.perf_counter(), server.cpu_s() if server else None
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
        result.wall_s = time.perf_counter() - start
        result.cpu_s = server.cpu_s() - cpu if server else None
    return result


# ---- main -------------------------------------------------------------------


def report(workload: Workload, results: list[Result], batch: int) -> str:
    """The workload's table and its ratios to ``generate``; answers that differ go to stderr."""
    seq, batched = results[0], results[1]
    if not workload.exact:
        for r in results[1:]:
            r.num_differ = sum(r.answers[i] != seq.answers[i] for i in seq.answers)
        seq.num_differ = 0
    mean = seq.num_tokens / len(workload.prompts)
    limit = f"exactly {workload.max_tokens}" if workload.exact else f"EOS or {workload.max_tokens}, mean {mean:.1f}"
    lines = [f"\nworkload {workload.name}: {len(workload.prompts)} prompts, new tokens: {limit}",
             f"{'system':<28} {'tokens':>7} {'wall s':>8} {'tok/s':>9} {'TTFT ms':>8} {'CPU ms/tok':>11} {'differ':>7}"]
    lines += [r.row() for r in results]
    for r in results[2:]:
        lines.append(f"{r.name}: {r.tokens_per_s / seq.tokens_per_s:.2f}x generate sequential, "
                     f"{r.tokens_per_s / batched.tokens_per_s:.2f}x generate batch {batch}")
    for r in results[1:]:
        for i in sorted(i for i in seq.answers if r.answers[i] != seq.answers[i]):
            progress(f"{workload.name}: {r.name} differs on prompt {i} ({r.answers[i][1]} vs {seq.answers[i][1]} "
                     f"tokens): {r.answers[i][0][-80:]!r} vs {seq.answers[i][0][-80:]!r}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    p.add_argument("--url", help="benchmark this running server (its /v1 URL) instead of starting one")
    p.add_argument("--workload", choices=["fixed", "natural", "both"], default="both",
                   help="fixed-length answers, natural (EOS) answers, or both (default)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 8],
                   help="comma-separated client concurrencies (default 1,8)")
    p.add_argument("--batch", type=positive_int, default=8, help="generate's padded batch size (default 8)")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="fixed: prompts per measurement (default 8; with --peer 12; at least the largest concurrency)")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="fixed: new tokens per prompt, exactly (default 64)")
    p.add_argument("--natural-prompts", type=positive_int, default=16,
                   help=f"natural: prompts, from the {len(QUESTIONS)} built-in questions (default 16)")
    p.add_argument("--natural-max-tokens", type=positive_int, default=128,
                   help="natural: most new tokens per prompt, fewer at EOS (default 128)")
    p.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                   help="torch intra-op threads of generate and of the server's worker (default: the usable cores)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="the server's tensor-parallel ranks (parallel.tp; --threads split between them; default 1)")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="instead of generate: llama.cpp's llama-server (built once, cached) against our server, "
                        "float32 against an F32 GGUF and int4 against the embedded Q4_1 GGUF, fixed workload")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="--peer: rounds, each server alone, interleaved (default 2)")
    p.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                   help="our server's scheduler.async_scheduling (default: the config's, on)")
    p.add_argument("--output", default=None, help="write the tables to this file too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.async_scheduling = None if args.async_scheduling is None else args.async_scheduling == "on"
    if args.peer:
        from _peer import run_peer

        return run_peer(args)
    import torch

    torch.set_num_threads(args.threads)
    if args.url:
        args.url = check_url(args.url)  # before the reference's minutes
    model_dir = model_dir_of(args.model)
    name = "smollm2" if not args.model else model_dir.name
    levels = args.concurrency
    workloads = []
    if args.workload in ("fixed", "both"):
        workloads.append(Workload("fixed", make_messages(max(args.num_prompts or 8, max(levels))), args.max_tokens, True))
    if args.workload in ("natural", "both"):
        workloads.append(Workload("natural", make_questions(args.natural_prompts), args.natural_max_tokens, False))
    print(f"model {model_dir}, server tp {args.tp}, torch threads {args.threads}, cpu count {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    generate = Generate(model_dir)
    results = {w.name: generate.run(w, args.batch) for w in workloads}
    del generate
    server = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.url:
                url = args.url
            else:
                progress("starting the server")
                server = for_model(model_dir, name, max(levels), args.threads, Path(tmp), args.tp,
                                   async_scheduling=args.async_scheduling)
                url = server.wait()
            for w in workloads:
                for c in levels:
                    results[w.name].append(asyncio.run(run_server_load(url, name, w, c, server)))
    finally:
        if server:
            server.stop()
    tables = "\n".join(report(w, results[w.name], args.batch) for w in workloads)
    print(tables)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    write_output(tables, args.output)
    return 0


if __name__ == "__main__":
    run_tool(main)
