"""Frontend CPU per streamed token, without a model.

The real frontend actor (its own process, uvloop, the shared-memory rings the
launcher would give it) serves streaming chat completions to ``--concurrency``
clients; a stand-in engine in a second process answers every request with
tokens as fast as the frontend takes them: each step one ``TokenDelta`` per
running request and a ``Finished`` after the last, as the conductor sends
them, paced only by the ring's backpressure. Every token the frontend
detokenizes, formats and writes is the real path; only the engine behind it
is stood in.

The tokens are the model's own ids of a real text (this repository's README
and a few lines of non-ASCII script), request ``seed`` choosing where each
request starts in it, so detokenization costs what it does when serving; the
model folder only needs its tokenizer (``--model``: a folder or an embedded
name, by default the fetched SmolLM2).

The clients (this process) keep one connection each and send the next request
as soon as the last answer ended; they count SSE events and read the usage
without parsing every event, so they take little of the CPU the frontend
needs; the first request of each level is decoded whole and its text checked
against the tokenizer's decode of the ids the engine sent.

Per level (median of ``--rounds``): output tokens/s, the frontend process's
CPU seconds per 1,000 tokens (all its threads), SSE events per request, and
the CPU of the engine stand-in and of the clients, which share the other
cores.

    python tools/bench_frontend.py                                   # c = 1, 64, 256; about a minute
    python tools/bench_frontend.py --concurrency 64 --rounds 1 --profile /tmp/frontend.prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from _common import (  # noqa: E402
    ROOT, free_port, non_negative_float, positive_int, positive_ints, progress, run_tool, write_output,
)
from actors.base import Actor, ActorSpec, run_actor_process  # noqa: E402
from mstar_actors.messages import (  # noqa: E402
    Abort,
    EngineStats,
    Finished,
    NewRequest,
    SampledToken,
    TokenDelta,
    TopLogprob,
    choice_ids,
)
from transport.ring import _footprint  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
NUM_PROMPT_TOKENS = 24  # what the stand-in reports as each prompt's length
NUM_TOP_LOGPROBS = 2  # --logprobs: top_logprobs of every request
EXTRA_TEXT = (
    "\n\nUnicode in the output: héllo wörld, ünïcode naïve café — 東京 and 大阪, Ελληνικά, "
    "русский текст, emoji 🙂🚀 too; quotes \"like these\" and a tab\tand a backslash \\.\n"
)
END_OF_CHUNKED_BODY = b"\r\n0\r\n\r\n"
CPU_TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # psutil's CPU times of a process advance in these steps
MIN_CPU_WALL_S = 0.5  # a level shorter than this, or with fewer of the frontend's ticks, has no CPU figures
MIN_CPU_TICKS = 20


# --------------------------------------------------------------------------
# The engine stand-in (its own process)
# --------------------------------------------------------------------------


class StandInEngine(Actor):
    """Takes the frontend's ``NewRequest`` / ``Abort`` (its ``frontend``
    inbox) and runs every request's choices in steps: one ``TokenDelta`` per
    running choice per step, its ``Finished`` right after its
    ``max_tokens``-th token, ``EngineStats`` after a step that changed the
    number running. ``is_paced``: a step is sent once the frontend has read
    every step but the last from the ring, as a served model's step lands
    while the frontend writes the one before: the frontend always has the
    next step to take, and a stream gets about one event per token; else
    steps queue up in the ring until it is full, and the backlog leaves in
    fewer, larger events. ``step_s``: besides, a step at most every that many
    seconds, as a GPU's step takes them (the frontend then writes an event a
    token while it keeps up)."""

    def __init__(self, token_ids: list[int], logprobs: bool = False, is_paced: bool = True, step_s: float = 0.0,
                 **kw: Any):
        super().__init__(**kw)
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.is_paced = is_paced
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}  # choice id -> [next position, tokens left, tokens sent]
        self.num_running_sent = -1
        self.encode = msgspec.msgpack.Encoder().encode

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case NewRequest():
                start = start_of(msg.sampling.seed or 0, len(self.token_ids))
                for cid in choice_ids(msg.request_id, msg.n):
                    self.running[cid] = [start, msg.sampling.max_tokens, 0]
            case Abort(request_id=rid):
                for cid in [c for c in self.running if c == rid or c.rsplit("-", 1)[0] == rid]:
                    del self.running[cid]
            case _:
                self.unknown(channel, msg)

    async def serve(self) -> None:
        ring = self.outbox["frontend"]
        while True:
            if not self.running:
                await self.dispatch(*await self.mailbox.get())
            while (item := self.mailbox.get_nowait()) is not None:
                await self.dispatch(*item)
            due = time.monotonic() + self.step_s
            num_bytes = await self.step(ring)
            if self.is_paced:  # the frontend has read every step before this one
                await ring.wait_for_room(ring.capacity_bytes - num_bytes)
            # the mailbox's pump reads new requests between steps; a stand-in GPU step's time passes
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def step(self, ring: Any) -> int:
        """Send one step's outputs; return the bytes they take in the ring."""
        outputs = []
        ids = self.token_ids
        for cid, seq in list(self.running.items()):
            pos, left, sent = seq
            token_id = ids[pos % len(ids)]
            top = tuple(TopLogprob(token_id=ids[(pos + k) % len(ids)], logprob=-0.25 - k)
                        for k in range(NUM_TOP_LOGPROBS)) if self.logprobs else ()
            token = SampledToken(request_id=cid, token_id=token_id, logprob=-0.25 if self.logprobs else None,
                                 top_logprobs=top)
            outputs.append(TokenDelta(request_id=cid, tokens=[token], num_prompt_tokens=0 if sent else NUM_PROMPT_TOKENS))
            seq[:] = [pos + 1, left - 1, sent + 1]
            if left == 1:
                del self.running[cid]
                outputs.append(Finished(request_id=cid, finish_reason="length", num_prompt_tokens=NUM_PROMPT_TOKENS,
                                        num_output_tokens=sent + 1))
        if len(self.running) != self.num_running_sent:
            self.num_running_sent = len(self.running)
            outputs.append(EngineStats(num_running=len(self.running), num_waiting=0, num_kv_blocks_used=0,
                                       num_kv_blocks_total=1))
        num_bytes = 0
        for data in map(self.encode, outputs):
            num_bytes += _footprint(len(data))
            await ring.send_encoded(data)
        return num_bytes


def start_of(seed: int, num_token_ids: int) -> int:
    """Where request ``seed``'s tokens start in the text's ids."""
    return seed * 7919 % num_token_ids


def _profiled_frontend(profile: str, **kw: Any) -> Any:
    """The frontend actor under cProfile, its statistics written to
    ``profile`` when it stops (``--profile``); ``run_actor_process`` calls
    this as it would the actor's class."""
    import cProfile

    from actors.frontend import FrontendActor

    class ProfiledFrontend(FrontendActor):
        async def run(self) -> int:
            profiler = cProfile.Profile()
            profiler.enable()
            try:
                return await super().run()
            finally:
                profiler.disable()
                profiler.dump_stats(profile)

    return ProfiledFrontend(**kw)


# --------------------------------------------------------------------------
# The clients (this process)
# --------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection streaming one request at a time;
    an answer ends with the chunked body's last chunk."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.buffer.endswith(END_OF_CHUNKED_BODY) or not self.buffer.startswith(b"HTTP/1.1 200"):
            if self.answer is not None and not self.answer.done():
                self.answer.set_result(bytes(self.buffer))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(f"the frontend closed the connection: {exc}"))

    async def request(self, raw: bytes) -> bytes:
        self.buffer.clear()
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.answer


def request_bytes(seed: int, max_tokens: int, logprobs: bool) -> bytes:
    body = {"model": "bench", "messages": [{"role": "user", "content": f"Write a short poem, number {seed}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": NUM_TOP_LOGPROBS}
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def num_completion_tokens(answer: bytes) -> int:
    at = answer.rfind(b'"completion_tokens":')
    if at < 0:
        raise SystemExit(f"an answer without usage:\n{answer[:2000]!r}")
    digits = answer[at + len(b'"completion_tokens":'):].split(b",", 1)[0].split(b"}", 1)[0]
    return int(digits)


def streamed_text(answer: bytes) -> str:
    """Every content delta of a streamed chat answer, joined."""
    parts = []
    for line in answer.split(b"\n"):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


class Level:
    """One concurrency level's figures for one round."""

    def __init__(self, concurrency: int):
        self.concurrency = concurrency
        self.num_requests = 0
        self.num_tokens = 0
        self.num_events = 0
        self.wall_s = 0.0
        self.cpu_s: dict[str, float] = {}  # by process: user + system
        self.frontend_system_s = 0.0  # the frontend's CPU in the kernel (its socket writes, mostly)
        self.first_answer = b""
        self.first_seed = 0


async def run_level(port: int, level: Level, num_requests: int, first_seed: int, args: argparse.Namespace,
                    procs: dict[str, psutil.Process], label: str) -> None:
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_Connection, "127.0.0.1", port))[1] for _ in range(level.concurrency)]
    seeds = iter(range(first_seed, first_seed + num_requests))
    step = max(1, num_requests // 10)

    async def client(conn: _Connection) -> None:
        for seed in seeds:
            answer = await conn.request(request_bytes(seed, args.max_tokens, args.logprobs))
            if not answer.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"request {seed}: the frontend answered {answer[:400]!r}")
            if seed == first_seed:
                level.first_answer, level.first_seed = answer, seed
            level.num_requests += 1
            level.num_tokens += num_completion_tokens(answer)
            level.num_events += answer.count(b"\n\n")
            if level.num_requests % step == 0:
                progress(f"{label}: {level.num_requests}/{num_requests} requests", end="\r")

    before = {name: _cpu_s(p) for name, p in procs.items()}
    start = time.perf_counter()
    await asyncio.gather(*[client(c) for c in conns])
    level.wall_s = time.perf_counter() - start
    after = {name: _cpu_s(p) for name, p in procs.items()}
    level.cpu_s = {name: after[name][0] - before[name][0] for name in procs}
    level.frontend_system_s = after["frontend"][1] - before["frontend"][1]
    for conn in conns:
        conn.transport.close()


def too_short_for_cpu(level: Level) -> bool:
    """Whether ``level`` ran too briefly for its CPU figures to mean anything: CPU times advance by whole ticks,
    so over a fraction of a second (or a few ticks of the frontend's) they are mostly rounding."""
    return level.wall_s < MIN_CPU_WALL_S or level.cpu_s.get("frontend", 0.0) < MIN_CPU_TICKS * CPU_TICK_S


def _cpu_s(proc: psutil.Process) -> tuple[float, float]:
    """(user + system, system) CPU seconds so far, every thread included."""
    times = proc.cpu_times()
    return times.user + times.system, times.system


def check_text(level: Level, tokenizer: Any, token_ids: list[int], max_tokens: int) -> None:
    """The first answer's text must be what the tokenizer makes of the ids the engine sent."""
    start = start_of(level.first_seed, len(token_ids))
    ids = [token_ids[(start + k) % len(token_ids)] for k in range(max_tokens)]
    expected, got = tokenizer.decode(ids), streamed_text(level.first_answer)
    if got != expected:
        raise SystemExit(f"concurrency {level.concurrency}: streamed text differs from the decode of its ids:\n"
                         f"expected {expected!r}\ngot      {got!r}")


# --------------------------------------------------------------------------
# Set-up: the rings, the two processes
# --------------------------------------------------------------------------


class Rig:
    """The frontend and the stand-in engine over the launcher's kind of rings."""

    def __init__(self, args: argparse.Namespace, token_ids: list[int]):
        from mstar_actors.config import parse_config
        from mstar_actors.model_info import load_model_info
        from mstar_actors.rundir import new_run_id
        from transport import create_ring

        self.port = free_port()
        self.config = parse_config({"model": {"path": args.model, "name": "bench"},
                                    "server": {"port": self.port, "max_waiting_requests": 100_000}})
        info = load_model_info(self.config)
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-frontend-")
        self.run_dir, self.run_id = self.tmp.name, new_run_id()
        size = self.config.transport.ring_bytes
        rings = {name: create_ring(self.run_dir, self.run_id, name, size)
                 for name in ("conductor.frontend", "frontend.prepare", "bench.engine")}
        common = dict(config=self.config, run_dir=self.run_dir, info=msgspec.to_builtins(info), log_level=logging.WARNING)
        frontend = ActorSpec(name="frontend", inbox={"conductor": (rings["conductor.frontend"], "ConductorToFrontend")},
                             outbox={"prepare": (rings["frontend.prepare"], "FrontendToPrepare")},
                             params={"profile": args.profile} if args.profile else {}, **common)
        engine = ActorSpec(name="engine", inbox={"frontend": (rings["frontend.prepare"], "FrontendToPrepare"),
                                                 "control": (rings["bench.engine"], "LauncherToActor")},
                           outbox={"frontend": (rings["conductor.frontend"], "ConductorToFrontend")},
                           params={"token_ids": token_ids, "logprobs": args.logprobs, "is_paced": not args.unpaced,
                                   "step_s": args.step_ms / 1e3},
                           **common)
        target = "bench_frontend:_profiled_frontend" if args.profile else "actors.frontend:FrontendActor"
        self.procs = {"frontend": SPAWN.Process(target=run_actor_process, args=(target, frontend), name="frontend"),
                      "engine": SPAWN.Process(target=run_actor_process, args=("bench_frontend:StandInEngine", engine),
                                              name="engine")}
        from transport import open_ring
        from mstar_actors import messages

        self.engine_control = open_ring(rings["bench.engine"], role="writer", union=messages.LauncherToActor)

    def start(self) -> dict[str, psutil.Process]:
        for proc in self.procs.values():
            proc.start()
        self.wait_ready()
        return {name: psutil.Process(p.pid) for name, p in self.procs.items()} | {"clients": psutil.Process()}

    def wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.exitcode is not None]
            if dead:
                raise SystemExit(f"the {dead[0]} process exited ({self.procs[dead[0]].exitcode}) before serving")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)  # another process: polling /health is the only way to see it ready
        raise SystemExit("the frontend was not ready within 120 s")

    def stop(self) -> None:
        """Shutdown to the engine; its closed ring ends the frontend (which
        then writes its profile)."""
        from mstar_actors.messages import Shutdown
        from transport import cleanup_run

        try:
            self.engine_control.send_nowait(Shutdown(reason="benchmark over"))
            for proc in self.procs.values():
                proc.join(timeout=30)
        finally:
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=10)
            cleanup_run(self.run_id, self.run_dir)
            self.tmp.cleanup()


def corpus_ids(model_dir: str) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = (ROOT / "README.md").read_text() + EXTRA_TEXT
    return tokenizer, tokenizer(text, add_special_tokens=False).input_ids


def num_requests_at(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, concurrency * args.waves)


async def measure(rig: Rig, procs: dict[str, psutil.Process], args: argparse.Namespace, tokenizer: Any,
                  token_ids: list[int]) -> dict[int, list[Level]]:
    results: dict[int, list[Level]] = {c: [] for c in args.concurrency}
    seed = 0
    warm = Level(8)
    await run_level(rig.port, warm, 32, seed, args, procs, "warm-up")
    seed += 32
    for r in range(args.rounds):
        for c in args.concurrency:
            level = Level(c)
            n = num_requests_at(c, args)
            await run_level(rig.port, level, n, seed, args, procs, f"round {r + 1}/{args.rounds}, concurrency {c}")
            seed += n
            check_text(level, tokenizer, token_ids, args.max_tokens)
            results[c].append(level)
            cpu = ("n/a (too short to time CPU)" if too_short_for_cpu(level)
                   else f"{1000 * level.cpu_s['frontend'] / level.num_tokens:.3f} CPU s per 1k tokens")
            progress(f"round {r + 1}/{args.rounds}, concurrency {c}: {level.num_tokens / level.wall_s:,.0f} tok/s, "
                     f"frontend {cpu}")
    return results


def table(results: dict[int, list[Level]], args: argparse.Namespace) -> str:
    head = (f"frontend, {args.max_tokens} tokens per streamed chat request{' with logprobs' if args.logprobs else ''}; "
            f"median of {args.rounds} round(s)\n"
            "| concurrency | requests | tok/s | frontend CPU s / 1k tok | of it in the kernel | frontend CPU % "
            "| events / request | engine CPU % | clients CPU % |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows, short = [], []
    for c, levels in results.items():
        def med(fn):
            return statistics.median(fn(level) for level in levels)

        if any(map(too_short_for_cpu, levels)):
            short.append(c)
            frontend = kernel = frontend_pct = engine_pct = clients_pct = "n/a"
        else:
            frontend = f"{med(lambda l: 1000 * l.cpu_s['frontend'] / l.num_tokens):.3f}"
            kernel = f"{med(lambda l: 100 * l.frontend_system_s / max(l.cpu_s['frontend'], 1e-9)):.0f}%"
            frontend_pct = f"{med(lambda l: 100 * l.cpu_s['frontend'] / l.wall_s):.0f}"
            engine_pct = f"{med(lambda l: 100 * l.cpu_s['engine'] / l.wall_s):.0f}"
            clients_pct = f"{med(lambda l: 100 * l.cpu_s['clients'] / l.wall_s):.0f}"
        rows.append(
            f"| {c} | {levels[0].num_requests} | {med(lambda l: l.num_tokens / l.wall_s):,.0f} "
            f"| {frontend} | {kernel} | {frontend_pct} | {med(lambda l: l.num_events / l.num_requests):.1f} "
            f"| {engine_pct} | {clients_pct} |")
    if short:
        rows.append(f"\nn/a: concurrency {', '.join(map(str, short))} ran too short to time CPU (under "
                    f"{MIN_CPU_WALL_S} s, or under {MIN_CPU_TICKS} of the frontend's {CPU_TICK_S * 1000:.0f} ms "
                    "CPU-clock ticks); lengthen each level with more --waves or --min-requests")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model folder or embedded name (only its tokenizer is used)")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 64, 256], help="comma-separated client counts")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--waves", type=positive_int, default=6, help="requests per level: concurrency x waves ...")
    parser.add_argument("--min-requests", type=positive_int, default=48, help="... and at least this many")
    parser.add_argument("--logprobs", action="store_true", help="every request asks for logprobs and the top 2")
    parser.add_argument("--unpaced", action="store_true",
                        help="the engine stand-in sends steps until the ring is full, not one per ring read")
    parser.add_argument("--step-ms", type=non_negative_float, default=0.0,
                        help="the engine stand-in's least time a step, as a GPU's (e.g. 1.2 at 64 rows)")
    parser.add_argument("--profile", default="", help="write the frontend's cProfile statistics to this file")
    parser.add_argument("--output", help="also write the table here")
    args = parser.parse_args(argv)
    if args.profile:
        args.profile = str(Path(args.profile).resolve())

    from mstar_actors.fetch import FetchError, resolve_model

    try:  # only its tokenizer is read: a tokenizer's folder will do
        folder = resolve_model(args.model)
    except FetchError as err:
        raise SystemExit(f"--model: {err}") from None
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise SystemExit(f"--model {args.model!r}: no tokenizer there (tokenizer.json); give a model folder or an "
                         "embedded name")
    tokenizer, token_ids = corpus_ids(str(folder))
    rig = Rig(args, token_ids)
    try:
        procs = rig.start()
        progress(f"frontend pid {procs['frontend'].pid}, engine stand-in pid {procs['engine'].pid}, "
                 f"port {rig.port}; corpus of {len(token_ids)} tokens")
        import uvloop

        results = uvloop.run(measure(rig, procs, args, tokenizer, token_ids))
    finally:
        rig.stop()
    text = table(results, args)
    print(text)
    write_output(text, args.output)
    return 0


if __name__ == "__main__":
    run_tool(main)
