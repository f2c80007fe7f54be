"""Serving benchmark: our live server over HTTP against ``transformers`` ``generate``.

In one run, on the same weights, prompts and number of new tokens:

- ``generate`` sequential (one prompt at a time: the concurrency-1 reference)
  and padded-batch (``--batch`` prompts at once, left padding);
- our server (``python -m mstar_actors serve``, every actor in its own
  process) at each ``--concurrency``, streaming chat completions so time to
  first token is measured where a client sees it.

Every system makes exactly ``--max-tokens`` tokens per prompt: the server with
``ignore_eos``, ``generate`` with ``min_new_tokens = max_new_tokens``. Both
sides run torch with the same number of intra-op threads (``--threads``,
default: the cores this process may use): this process sets it for
``generate`` and the server's config sets ``parallel.worker_torch_threads``
(the other actors do no tensor work). Generate and the server never run at
the same time. On a machine other jobs share, use ``--threads 1``: OpenMP's
spinning threads slow down many times over when they lose their core.

    python tools/bench_serve.py                       # embedded SmolLM2, concurrency 1 and 8
    python tools/bench_serve.py --model DIR --concurrency 1,4,16 --max-tokens 64
    python tools/bench_serve.py --url http://127.0.0.1:8000/v1 --model DIR   # an already running server

Prints a table and the ratios to ``generate`` (issue targets: concurrency 1
>= 0.9x sequential, concurrency 8 >= 2x batched). TTFT is the median; CPU
ms/token is user + system time of every process doing the work (this one
for generate; the launcher and every actor for the server, not the HTTP
client), which other jobs on a shared machine distort far less than wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["the ocean", "a city at night", "mountains", "old libraries", "trains", "the desert", "winter",
          "a busy market", "rivers", "the moon", "forests", "small islands", "bridges", "gardens", "storms",
          "lighthouses"]


@dataclass
class Result:
    name: str
    num_tokens: int
    wall_s: float
    ttft_s: list[float]
    cpu_s: float | None = None  # CPU time (user + system) of every process doing the work

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s

    def row(self) -> str:
        ttft = f"{statistics.median(self.ttft_s) * 1000:8.0f}" if self.ttft_s else "       -"
        cpu = f"{self.cpu_s / self.num_tokens * 1000:11.1f}" if self.cpu_s is not None else "          -"
        return f"{self.name:<28} {self.num_tokens:>7} {self.wall_s:>8.2f} {self.tokens_per_s:>9.1f} {ttft} {cpu}"


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def make_messages(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}] for i in range(num)]


# ---- transformers generate --------------------------------------------------


def run_generate(model_dir: Path, prompts: list[list[dict]], max_tokens: int, batch: int) -> list[Result]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(batch_texts: list[str], num_new: int) -> int:
        enc = tokenizer(batch_texts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                                 pad_token_id=pad)
        return (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]

    generate(texts[:1], 2)  # warm up
    results = []
    for size, name in ((1, "generate sequential"), (batch, f"generate batch {batch} (padded)")):
        num_tokens, wall, cpu, ttft = 0, 0.0, 0.0, []
        for i in range(0, len(texts), size):
            chunk = texts[i : i + size]
            t0 = time.perf_counter()
            generate(chunk, 1)  # time to first token: a generate of one token, timed apart
            ttft += [time.perf_counter() - t0] * len(chunk)
            t0, c0 = time.perf_counter(), time.process_time()
            num_tokens += generate(chunk, max_tokens)
            wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
            progress(f"{name}: {i + len(chunk)}/{len(texts)}")
        results.append(Result(name, num_tokens, wall, ttft, cpu))
    return results


# ---- our server -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mstar_actors serve`` on a temporary config naming ``model_dir``."""

    def __init__(self, model_dir: Path, name: str, num_seqs: int, num_threads: int, tmp: Path):
        self.port = free_port()
        config = tmp / "bench.yaml"
        config.write_text(json.dumps({
            "model": {"path": str(model_dir), "name": name, "dtype": "float32", "device": "cpu"},
            "scheduler": {"max_num_seqs": max(num_seqs, 8), "max_num_batched_tokens": 1024, "max_model_len": 2048},
            "kv": {"block_size": 16, "num_blocks": 1024},
            "parallel": {"worker_torch_threads": num_threads},
            "server": {"host": "127.0.0.1", "port": self.port},
        }))
        self.log: list[str] = []
        self.serving = threading.Event()
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar_actors", "serve", str(config)], cwd=ROOT,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if f"serving {self.name} at http://" in line:
                self.serving.set()
        self.serving.set()

    def wait(self) -> str:
        self.serving.wait(600)
        if self.proc.poll() is not None:
            raise SystemExit(f"the server exited ({self.proc.returncode}):\n{''.join(self.log[-30:])}")
        return f"http://127.0.0.1:{self.port}/v1"

    def cpu_s(self) -> float:
        """CPU time so far of the launcher and every actor process."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


async def one_request(session, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, int]:
    """Stream one chat completion: (time to first token, number of tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, num_tokens = None, 0
    async with session.post(url + "/chat/completions", json=body) as response:
        if response.status != 200:
            raise SystemExit(f"server answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, num_tokens


async def run_server_load(url: str, model: str, prompts: list[list[dict]], max_tokens: int, concurrency: int,
                          server: Server | None = None) -> Result:
    import aiohttp

    queue = list(enumerate(prompts))
    ttfts: list[float] = []
    total = 0

    async def client(session) -> None:
        nonlocal total
        while queue:
            i, messages = queue.pop(0)
            ttft, n = await one_request(session, url, model, messages, max_tokens)
            if n != max_tokens:
                raise SystemExit(f"request {i}: {n} tokens, expected {max_tokens} (ignore_eos)")
            ttfts.append(ttft)
            total += n
            progress(f"server concurrency {concurrency}: {len(ttfts)}/{len(prompts)}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await one_request(session, url, model, prompts[0], 2)  # warm up
        start, cpu = time.perf_counter(), server.cpu_s() if server else None
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
        wall = time.perf_counter() - start
        cpu = server.cpu_s() - cpu if server else None
    return Result(f"server concurrency {concurrency}", total, wall, ttfts, cpu)


# ---- main -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    p.add_argument("--url", help="benchmark this running server (its /v1 URL) instead of starting one")
    p.add_argument("--concurrency", default="1,8", help="comma-separated client concurrencies (default 1,8)")
    p.add_argument("--batch", type=int, default=8, help="generate's padded batch size (default 8)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per measurement (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, exactly (default 64)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch intra-op threads of generate and of the server's worker (default: the usable cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from mstar_actors.fetch import fetch_embedded

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else Path(fetch_embedded("smollm2"))
    name = "smollm2" if not args.model else model_dir.name
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = make_messages(max(args.num_prompts, max(levels)))
    print(f"model {model_dir}, {len(prompts)} prompts x {args.max_tokens} new tokens, torch threads {args.threads}, "
          f"cpu count {os.cpu_count()}", flush=True)
    results = run_generate(model_dir, prompts, args.max_tokens, args.batch)
    server = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.url:
                url = args.url
            else:
                progress("starting the server")
                server = Server(model_dir, name, max(levels), args.threads, Path(tmp))
                url = server.wait()
            for c in levels:
                results.append(asyncio.run(run_server_load(url, name, prompts, args.max_tokens, c, server)))
    finally:
        if server:
            server.stop()
    print(f"\n{'system':<28} {'tokens':>7} {'wall s':>8} {'tok/s':>9} {'TTFT ms':>8} {'CPU ms/tok':>11}")
    for r in results:
        print(r.row())
    seq, batched = results[0], results[1]
    for r in results[2:]:
        print(f"{r.name}: {r.tokens_per_s / seq.tokens_per_s:.2f}x generate sequential, "
              f"{r.tokens_per_s / batched.tokens_per_s:.2f}x generate batch {args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
