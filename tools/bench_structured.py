"""Structured-output benchmark: output tokens/s with a ``json_schema``
response format against the same requests unconstrained, on our live server.

One server (``python -m mstar_actors serve``, every actor in its own
process) serves both kinds; at each ``--concurrency`` that many clients each
send their next request as soon as the last one ended, first unconstrained,
then constrained (the other order in every other round), for ``--repeats``
rounds: a machine whose load drifts shifts both alike, and the median of the
rounds' ratios is robust to a round that a burst of load spoiled. Every request makes exactly ``--max-tokens``
tokens (``ignore_eos``); the schema asks for more items than fit, so the
grammar is still open when the request ends and every step fills a mask.

    python tools/bench_structured.py                         # embedded SmolLM2, CPU, concurrency 1, 8, 32
    python tools/bench_structured.py --device cuda           # the same on a GPU (bfloat16)
    python tools/bench_structured.py --model DIR --concurrency 1,4 --max-tokens 128
    python tools/bench_structured.py --compile-stall              # a slow schema's compile beside a stream

Prints one table: tok/s of each kind per concurrency and their ratio (target:
constrained >= 0.95x unconstrained). ``--compile-stall`` instead streams one
free request, sends a schema whose grammar takes seconds to compile a second
in, and a plain request a second after that: the stream's median and largest
gap between tokens and the two requests' latencies (target: no stall, the
largest gap under 10x the median and the plain request under 1 s: the ranks
compile beside their steps).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import (
    Server, check_device, check_url, free_port, model_dir_of, positive_int, positive_ints, progress, run_tool,
    write_output,
)

SCHEMA = {
    "type": "array",
    "minItems": 100,  # more than any run's tokens can write: the grammar never completes
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
    },
}
TOPICS = ["engineers", "painters", "pilots", "chefs", "doctors", "teachers", "farmers", "poets"]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"List some {TOPICS[i % len(TOPICS)]} as JSON: name, city and age of each."}]


def body(model: str, i: int, max_tokens: int, constrained: bool) -> dict:
    out = {"model": model, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if constrained:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    return out


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    constrained: bool) -> tuple[int, float]:
    """(output tokens, wall seconds) of ``num_requests`` requests by ``concurrency`` clients."""
    import aiohttp

    queue = list(range(num_requests))
    num_tokens = 0

    async def client(session) -> None:
        nonlocal num_tokens
        while queue:
            i = queue.pop(0)
            async with session.post(url + "/chat/completions", json=body(model, i, max_tokens, constrained)) as response:
                data = await response.json()
                if response.status != 200:
                    raise SystemExit(f"server answered {response.status}: {data}")
            num_tokens += data["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
        return num_tokens, time.perf_counter() - start


async def warm_up(url: str, model: str) -> None:
    """Compile the schema and run a few steps of each kind before anything is timed; show a constrained answer."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for constrained in (False, True):
            async with session.post(url + "/chat/completions", json=body(model, 0, 24, constrained)) as response:
                data = await response.json()
                if response.status != 200:
                    raise SystemExit(f"server answered {response.status}: {data}")
            progress(f"{'json_schema' if constrained else 'free'} answer: {data['choices'][0]['message']['content']!r}")


def measure(url: str, model: str, levels: list[int], args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """(concurrency, unconstrained tok/s, constrained tok/s, median of the rounds' ratios) per level."""
    asyncio.run(warm_up(url, model))
    rows = []
    for c in levels:
        totals = {False: [0, 0.0], True: [0, 0.0]}
        ratios = []
        num_requests = max(c, args.num_requests)
        for r in range(args.repeats):
            rate = {}
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                tokens, wall = asyncio.run(run_level(url, model, c, num_requests, args.max_tokens, constrained))
                totals[constrained][0] += tokens
                totals[constrained][1] += wall
                rate[constrained] = tokens / wall
                progress(f"concurrency {c}, round {r + 1}, {'json_schema' if constrained else 'free'}: {rate[constrained]:.1f} tok/s")
            ratios.append(rate[True] / rate[False])
        rows.append((c, totals[False][0] / totals[False][1], totals[True][0] / totals[True][1], statistics.median(ratios)))
    return rows


# A long bounded-repeat pattern: its token masks take seconds to compile over a 49k vocabulary, its rules milliseconds.
SLOW_SCHEMA = {"type": "object", "required": ["u"],
               "properties": {"u": {"type": "string", "pattern": "^([a-z0-9]{1,100}\\.){1,100}[a-z]{2,8}$"}}}


async def compile_stall(url: str, model: str, max_tokens: int) -> str:
    """A free stream, the slow schema's request a second in, a plain one a second
    later: the stream's gaps between tokens, the two requests' latencies."""
    import aiohttp

    async def stream(session) -> list[float]:
        times = []
        request = {**body(model, 0, max_tokens, False), "stream": True}
        async with session.post(url + "/chat/completions", json=request) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
        return sorted(b - a for a, b in zip(times, times[1:]))

    async def timed(session, request: dict, delay: float) -> tuple[int, float]:
        await asyncio.sleep(delay)
        start = time.perf_counter()
        async with session.post(url + "/chat/completions", json=request) as response:
            await response.read()
            return response.status, time.perf_counter() - start

    slow = {"model": model, "messages": [{"role": "user", "content": "A web address, as JSON."}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "url", "schema": SLOW_SCHEMA}}}
    plain = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        gaps, (slow_status, slow_s), (plain_status, plain_s) = await asyncio.gather(
            stream(session), timed(session, slow, 1.0), timed(session, plain, 2.0))
    median, largest = statistics.median(gaps), gaps[-1]
    verdict = "met" if largest < 10 * median and plain_s < 1.0 else "NOT met"
    return "\n".join([
        f"a free stream of {max_tokens} tokens; a schema compiling for seconds sent 1 s in, a plain request 2 s in",
        f"stream gap between tokens: median {median * 1e3:.1f} ms, largest {largest * 1e3:.1f} ms "
        f"({largest / median:.1f}x the median)",
        f"the schema's request: {slow_s:.2f} s (status {slow_status}); the plain request: {plain_s:.2f} s "
        f"(status {plain_status})",
        f"target: largest gap < 10x the median, plain request < 1 s: {verdict}"])


def report(rows: list[tuple[int, float, float, float]], args: argparse.Namespace) -> str:
    lines = [f"{args.device}, {args.max_tokens} tokens per request (ignore_eos), {args.repeats} round(s)",
             f"{'concurrency':>11} {'free tok/s':>11} {'json_schema tok/s':>18} {'ratio':>6} {'median round ratio':>19}"]
    lines += [f"{c:>11} {free:>11.1f} {schema:>18.1f} {schema / free:>6.3f} {median:>19.3f}"
              for c, free, schema, median in rows]
    return "\n".join(lines)


def server_config(model_dir: Path, name: str, max_seqs: int, args: argparse.Namespace) -> dict:
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    config = {
        "model": {"path": str(model_dir), "name": name, "dtype": dtype, "device": args.device},
        "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 2048, "max_model_len": 2048},
        "kv": {"block_size": 16, "num_blocks": 2048},
        "server": {"host": "127.0.0.1", "port": free_port()},
    }
    if args.threads:
        config["parallel"] = {"worker_torch_threads": args.threads}
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    p.add_argument("--url", help="benchmark this running server (its /v1 URL) instead of starting one")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the server's model.device (default cpu)")
    p.add_argument("--dtype", help="the server's model.dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 8, 32],
                   help="comma-separated client concurrencies (default 1,8,32)")
    p.add_argument("--num-requests", type=positive_int, default=8,
                   help="requests per measurement, at least the concurrency (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per request, exactly (default 64)")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds of both kinds per concurrency (default 1)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="parallel.worker_torch_threads (default: the server's)")
    p.add_argument("--output", default=None, help="write the table to this file too")
    p.add_argument("--compile-stall", action="store_true",
                   help="measure a slow schema's compile beside a stream instead of the throughput table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    check_device(args.device)
    if args.url:
        args.url = check_url(args.url)
    model_dir = model_dir_of(args.model)
    name = "smollm2" if not args.model else model_dir.name
    levels = args.concurrency
    print(f"model {model_dir}, cpu count {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    server = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.url:
                url = args.url
            else:
                progress("starting the server")
                server = Server(server_config(model_dir, name, max(levels), args), Path(tmp))
                url = server.wait()
            if args.compile_stall:
                table = asyncio.run(compile_stall(url, name, max(args.max_tokens, 300)))
            else:
                table = report(measure(url, name, levels, args), args)
    finally:
        if server:
            server.stop()
    print(table)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    write_output(table, args.output)
    return 0


if __name__ == "__main__":
    run_tool(main)
