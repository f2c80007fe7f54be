"""Preparation of image, video and audio requests: throughput of the prepare
actor's pool at 1, 2, 4 and 8 workers, and time to first token of video
requests at concurrency 4 with the pool (4 workers) against one worker (1).

    python tools/bench_prepare.py                          # both parts, default clips
    python tools/bench_prepare.py --ttft-only --ttft-rounds 10
    python tools/bench_prepare.py --workers 1 2 --ttft-rounds 0 --output prepare.md

Throughput: the requests go through ``PrepareActor`` over in-memory
channels with the real Qwen2.5-VL preparation (chat template, Pillow /
``av`` decode, transformers' image processor) on a folder with no weights;
media travel as data: URLs (a 640x480 JPEG; a 4 s 320x240 clip sampled at 2
fps; and ``--ttft-clip``, 640x480 16 s, half as many requests a batch), and
tensors go to an in-process stand-in for the arena. Audio rows
(``--audio-seconds``, ``--audio-formats``) take the real Qwen2-Audio
preparation the same way (``av`` decode and resample of a 44.1 kHz stereo
clip to 16 kHz mono, the Whisper feature extractor's 128 mel bins over a 30
s chunk, the placeholder expansion) on a folder with no weights; with 2 or
more workers the actor prepares each clip in a process of its own. Each row
is measured through the actor (1 worker: one pool thread) and, as the
reference, on a bare thread pool pinned the same way ("plain": threads
only). Per cell: requests a second
in the batch's steady middle, CPU ms per request (this process's and its
clip processes'), the share of the batch its
threads spent drafting, the drafts' CPU over their wall time, and the
speed-up against 1 worker (the median of each round's ratio, with the
rounds' range; "whole batch" keeps the first wave and the drain).

Time to first token: the real server (``python -m mstar_actors serve``)
with ``prepare.preprocess_workers`` 4 against 1, side by side and taking
turns, on a tiny random Qwen2.5-VL with Qwen2.5-VL's own processor
(``--model PATH`` serves a real folder). Each request is streamed and timed
from the client: sent to its first content chunk. Two workloads: bursts of 4
sent at once (``--ttft-rounds`` of them), and a closed loop of 4 clients
each sending its next request when its last one has answered. The ratio
one / pool is printed for each, per clip, and in a last table for all.

``--output PATH`` appends the tables to PATH too.
"""

from __future__ import annotations

import argparse
import copy
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the engine, and the tools' shared modules

from _common import (  # noqa: E402
    Server, free_port, model_dir_of, non_negative_int, positive_float, positive_int, progress, run_tool,
    write_output,
)
from _vl_common import (  # noqa: E402
    HEAVY_CLIP,
    Clip,
    context_for,
    jpeg_data_url,
    make_request,
    parse_clip,
    parse_clip_or_none,
    parse_size,
    video_body,
)

from tests.vl_fixtures import HeapArena, save_tiny_vl_model, save_vl_prepare_folder, vl_prepare_info  # noqa: E402

CONCURRENCY = 4


# ---- throughput ---------------------------------------------------------------


class TimedPreparer:
    """The preparer, with each draft's wall and thread CPU seconds noted
    from outside: against the batch's time they split a pool's shortfall into
    idle threads and drafts slowed by one another."""

    def __init__(self, preparer):
        self.inner = preparer
        self.drafts: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, req, fetched=None, **kw):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.inner.draft(req, fetched, **kw)
        finally:
            self.drafts.append((time.perf_counter() - start, time.thread_time() - cpu))


class ActorUnderTest:
    """A ``PrepareActor`` over in-memory channels with ``num_workers`` pool
    threads, kept running between batches as a server keeps it, so a batch
    after ``warm_up`` finds every thread warm."""

    def __init__(self, preparer, num_workers: int, pin: bool = True):
        from actors.prepare import PrepareActor
        from mstar_actors.config import Config, PrepareConfig
        from mstar_actors.messages import FrontendToPrepare, PrepareToConductor
        from transport.memory import MemoryChannel

        self.num_workers = num_workers
        # A preparer with clip processes gets them from its actor: a copy of its own, so
        # a 1-worker actor prepares in-thread as a 1-worker server does.
        self.preparer = TimedPreparer(copy.copy(preparer) if hasattr(preparer, "start_processes") else preparer)
        self.inbox = MemoryChannel(FrontendToPrepare, "frontend.prepare", capacity_bytes=64 << 20)
        self.out = MemoryChannel(PrepareToConductor, "prepare.conductor", capacity_bytes=16 << 20)
        config = Config(prepare=PrepareConfig(pin_pool_threads=pin))
        self.actor = PrepareActor(name="prepare", config=config, inbox={"frontend": self.inbox},
                                  outbox={"conductor": self.out}, preparer=self.preparer, arena=HeapArena(),
                                  num_workers=num_workers)
        self.task = asyncio.create_task(self.actor.run())

    @property
    def drafts(self) -> list[tuple[float, float]]:
        return self.preparer.drafts

    async def warm_up(self, make) -> None:
        """Two requests per thread, all at once (every thread drafts at least one)."""
        await self.batch([make(f"warm{self.num_workers}-{i}") for i in range(2 * self.num_workers)])

    async def batch(self, requests: list) -> list[float]:
        """Seconds from the first request sent to each Prepared received, in order."""
        from mstar_actors.messages import Failed

        self.preparer.drafts = []
        start = time.perf_counter()
        sender = asyncio.create_task(_send_all(self.inbox, requests))
        done = []
        for _ in requests:
            msg = await self.out.recv()
            done.append(time.perf_counter() - start)
            if isinstance(msg, Failed):
                raise RuntimeError(f"request {msg.request_id} failed: {msg.message}")
        await sender
        return done

    async def close(self) -> None:
        from mstar_actors.messages import Shutdown

        await self.inbox.send(Shutdown(reason="bench"))
        await self.task


class PlainPool:
    """The same drafts on a bare ``ThreadPoolExecutor`` of ``num_workers``
    threads, pinned as the prepare pool pins its own, with no actor around
    them (no mailbox, release, arena or loop sharing the GIL): what the
    drafts themselves allow. Same interface as ``ActorUnderTest``."""

    def __init__(self, preparer, num_workers: int, pin: bool = True):
        import concurrent.futures
        import itertools

        self.num_workers = num_workers
        self.preparer = TimedPreparer(preparer)
        pins = pool_pins(num_workers) if pin else None
        taken = itertools.count()

        def pin_thread() -> None:
            if pins:
                os.sched_setaffinity(threading.get_native_id(), pins[next(taken) % len(pins)])

        self.pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="plain",
                                                          initializer=pin_thread)

    @property
    def drafts(self) -> list[tuple[float, float]]:
        return self.preparer.drafts

    def _draft(self, req) -> None:
        from mstar_actors.messages import Failed

        result = self.preparer.draft(req, {})
        if isinstance(result, Failed):
            raise RuntimeError(f"request {result.request_id} failed: {result.message}")

    async def warm_up(self, make) -> None:
        await self.batch([make(f"warm-plain{self.num_workers}-{i}") for i in range(2 * self.num_workers)])

    async def batch(self, requests: list) -> list[float]:
        loop = asyncio.get_running_loop()
        self.preparer.drafts = []
        start = time.perf_counter()
        done = []

        async def one(req) -> None:
            await loop.run_in_executor(self.pool, self._draft, req)
            done.append(time.perf_counter() - start)

        await asyncio.gather(*(one(r) for r in requests))
        return sorted(done)

    async def close(self) -> None:
        self.pool.shutdown()


async def _send_all(inbox, requests) -> None:
    for req in requests:
        await inbox.send(req)


def pool_pins(num_threads: int) -> list[list[int]] | None:
    """The CPUs the prepare pool would pin ``num_threads`` threads to in a
    one-GPU server on this host (``CpuPlan.pool_cpus``), or None."""
    from actors.prepare import read_cpu_cores
    from mstar_actors.prepare.cpu_plan import CpuPlan

    allowed = sorted(os.sched_getaffinity(0))
    return CpuPlan(num_cpus=len(allowed), num_ranks=1).pool_cpus(allowed, num_threads, 1, read_cpu_cores(allowed))


class Batch(NamedTuple):
    done: list[float]  # s from the first request sent to each result, in order
    workers: int
    cpu: float  # s of the process's CPU
    drafting: float  # s of draft wall time summed over the batch's requests
    draft_cpu: float  # s of the drafting threads' own CPU over them

    @property
    def elapsed(self) -> float:
        """The whole batch: its last result."""
        return self.done[-1]

    @property
    def rate(self) -> float:
        """Requests a second in the batch's steady middle: results between
        the first wave's last one (result W, for W workers) and the one after
        which the last request must have started (result N - W). The start
        (W drafts that began together end together) and the drain (threads
        idling one by one) are what a loaded server does not have. A batch
        too small for a middle (N <= 2W) counts whole."""
        n, w = len(self.done), self.workers
        if n <= 2 * w:
            return n / self.elapsed
        return (n - 2 * w) / (self.done[n - w - 1] - self.done[w - 1])


class Media(NamedTuple):
    """One row group of the throughput table: ``kind`` (image / video) of the
    content part, its data: URL, and requests per batch."""

    kind: str
    url: str
    requests: int
    preparer: object = None  # its own preparer (audio: Qwen2-Audio's); None: the table's


def cpu_s() -> float:
    """CPU seconds of this process and of its live children (the audio rows'
    clip processes: only the pool being measured is busy)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


async def measure_media(args, preparer, label: str, media: Media) -> dict[tuple[str, int], list[Batch]]:
    """Every pool size and both kinds of pool, kept running and warmed, taking
    turns batch by batch for ``--throughput-rounds`` rounds, so a drift in
    the host's load hits every cell alike."""
    kind, url, num_requests = media.kind, media.url, media.requests
    pools = {("actor", w): ActorUnderTest(preparer, w, pin=not args.pool_unpinned) for w in args.workers}
    pools.update({("plain", w): PlainPool(preparer, w, pin=not args.pool_unpinned) for w in args.workers})
    rounds: dict[tuple[str, int], list[Batch]] = {key: [] for key in pools}
    try:
        for pool in pools.values():
            await pool.warm_up(lambda rid: make_request(rid, kind, url))
        for r in range(args.throughput_rounds):
            for (name, workers), pool in pools.items():
                requests = [make_request(f"{kind}-{name}{workers}-{r}-{i}", kind, url) for i in range(num_requests)]
                cpu = cpu_s()
                done = await pool.batch(requests)
                drafts = pool.drafts
                rounds[name, workers].append(Batch(done, workers, cpu_s() - cpu, sum(w for w, _ in drafts),
                                                   sum(c for _, c in drafts)))
            progress(f"{label}: round {r + 1}/{args.throughput_rounds}", end="\r")
    finally:
        for pool in pools.values():
            await pool.close()
    progress("")
    return rounds


def throughput_rows(label: str, num_requests: int, rounds: dict[tuple[str, int], list[Batch]],
                    base_workers: int) -> list[str]:
    """One table row per pool and size: medians over the rounds; the speed-up
    is paired, each round's rate over the same round's 1-worker rate."""
    rows = []
    for (name, workers), batches in rounds.items():
        base = rounds[name, base_workers]
        rate, cpu = statistics.median(b.rate for b in batches), statistics.median(b.cpu for b in batches)
        busy = statistics.median(b.drafting / (workers * b.elapsed) for b in batches)
        draft_cpu = statistics.median(b.draft_cpu / b.drafting for b in batches)
        ratios = [b.rate / b0.rate for b0, b in zip(base, batches)]
        whole = statistics.median(b0.elapsed / b.elapsed for b0, b in zip(base, batches))
        rows.append(f"| {label} | {name} | {workers} | {num_requests} | {rate:.1f} | {1000 / rate:.1f} | "
                    f"{1000 * cpu / num_requests:.1f} | {busy:.0%} | {draft_cpu:.0%} | {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | {whole:.2f}x |")
    return rows


def throughput(report, args, preparer, media: dict[str, Media]) -> None:
    report(f"\nMedian of {args.throughput_rounds} rounds (sizes and pools interleaved); \"actor\": through "
           "the prepare actor (1 worker: one thread); \"plain\": the same drafts on a bare thread pool")
    report("\n| media | pool | workers | requests | req/s | ms/req | CPU ms/req | threads drafting | "
           "draft CPU / wall | speed-up (rounds' range) | whole batch |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m in media.items():
        rounds = asyncio.run(measure_media(args, m.preparer or preparer, label, m))
        for row in throughput_rows(label, m.requests, rounds, args.workers[0]):
            report(row)


def audio_media(args, tmp: Path, limits) -> dict[str, Media]:
    """One row group per ``--audio-formats``: a ``--audio-seconds`` clip of
    44.1 kHz stereo as a data: URL (an ``audio_url`` part), through Qwen2-Audio's preparer."""
    import base64

    from mstar_actors.prepare.preparers import load_preparer
    from tests.audio_fixtures import audio_prepare_info, encode_audio, save_audio_prepare_folder

    if not args.audio_formats:
        return {}
    preparer = load_preparer(audio_prepare_info(save_audio_prepare_folder(tmp / "audio")), limits)
    media = {}
    for fmt in args.audio_formats:
        data = base64.b64encode(encode_audio(fmt, seconds=args.audio_seconds)).decode()
        url = f"data:audio/{'mpeg' if fmt == 'mp3' else fmt};base64,{data}"
        media[f"audio {fmt} {args.audio_seconds:g} s"] = Media("audio", url, args.requests, preparer)
    return media


# ---- time to first token ------------------------------------------------------


def ttft_server(model_dir: Path, num_workers: int, tmp: Path, clip: Clip, max_model_len: int | None,
                pin: bool) -> Server:
    """The server with ``num_workers`` prepare threads. ``max_model_len`` also
    sizes the batch budget so the 4 concurrent video prompts fit one step.
    Prefix caching is off: every request carries the same clip, and with the
    cache on TTFT would time no prefill (and no vision encode) at all."""
    config = {
        "model": {"path": str(model_dir), "name": "vl", "dtype": "auto", "device": "auto"},
        "prepare": {"preprocess_workers": num_workers, "pin_pool_threads": pin},
        "server": {"host": "127.0.0.1", "port": free_port(), "max_body_bytes": 64 << 20,
                   "max_media_bytes": 50 << 20, **clip.server_limits()},
        "transport": {"arena_bytes": arena_bytes(clip), "ring_bytes": ring_bytes(clip)},
    }
    if max_model_len:  # the two servers share the device: each takes what its concurrent prompts need
        config["scheduler"] = {"max_model_len": max_model_len, "max_num_batched_tokens": CONCURRENCY * max_model_len}
        config["kv"] = {"enable_prefix_caching": False, "num_blocks": CONCURRENCY * -(-max_model_len // 16) + 64}
    else:
        config["kv"] = {"enable_prefix_caching": False, "memory_fraction": 0.4}
    return Server(config, tmp, env={"XDG_RUNTIME_DIR": str(tmp)})


def ring_bytes(clip: Clip) -> int:
    """Rings that take the clip's NewRequest (its data: URL ~1.4 x the mp4) twice over, in whole MiB."""
    url_bytes = len(clip.data_url())
    return max(4 << 20, -(-2 * (url_bytes + (64 << 10)) // (1 << 20)) << 20)


def arena_bytes(clip: Clip) -> int:
    """Room for every concurrent request's pixels twice over (256 MiB at least), in whole MiB."""
    return max(256 << 20, -(-2 * CONCURRENCY * clip.pixel_bytes() // (1 << 20)) << 20)


async def check_one(url: str, video: str) -> int:
    """One unstreamed video request must answer 200 with its 2 tokens; returns its prompt tokens."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/chat/completions", json=video_body(video, False)) as response:
            if response.status != 200:
                raise RuntimeError(f"the check request answered {response.status}: {await response.text()}")
            usage = (await response.json())["usage"]
    if usage["completion_tokens"] != 2:
        raise RuntimeError(f"the check request made {usage['completion_tokens']} tokens, asked for 2")
    return usage["prompt_tokens"]


def encoded_body(video: str) -> bytes:
    """The streamed request's body, encoded once before any clock starts (a
    multi-MB body encoded per request on the client's one loop would be
    counted in the next requests' TTFT)."""
    return json.dumps(video_body(video, True)).encode()


async def timed_request(session, url: str, raw: bytes) -> float:
    """One streamed request: seconds to its first chunk (then read to its end)."""
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{url}/chat/completions", data=raw, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"video request answered {response.status}: {await response.text()}")
        first = None
        async for line in response.content:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - start
    return first


async def burst(url: str, video: str) -> list[float]:
    """``CONCURRENCY`` video requests sent at once, each timed to its first streamed chunk."""
    import aiohttp

    raw = encoded_body(video)
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(timed_request(session, url, raw) for _ in range(CONCURRENCY))))


async def closed_loop(url: str, video: str, per_client: int) -> tuple[list[float], float]:
    """Concurrency as serving benchmarks mean it: ``CONCURRENCY`` clients,
    each sending its next request as soon as its last one has answered. Each
    client's first request (all sent at once: the ramp-up) is not counted.
    Returns the counted TTFTs and the seconds from the first counted one
    sent to the last answered."""
    import aiohttp

    raw = encoded_body(video)
    counted: list[tuple[float, float, float]] = []  # (sent, ttft, done)

    async def client(session) -> None:
        await timed_request(session, url, raw)
        for _ in range(per_client):
            sent = time.perf_counter()
            ttft = await timed_request(session, url, raw)
            counted.append((sent, ttft, time.perf_counter()))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
    span = max(done for _, _, done in counted) - min(sent for sent, _, _ in counted)
    return [ttft for _, ttft, _ in counted], span


class TtftRun(NamedTuple):
    """One server's measured requests: bursts, then a closed loop."""

    burst: list[float]  # TTFT s of ``rounds`` bursts of ``CONCURRENCY``
    closed: list[float]  # TTFT s of the closed loop's counted requests
    closed_span: float  # seconds they spanned


def measure_ttft(model_dir: Path, video: str, tmp: Path, rounds: int, clip: Clip, max_model_len: int | None,
                 pin: bool) -> tuple[dict[int, TtftRun], int]:
    """Pool (4 workers) and one worker (1) side by side, each idle while the other
    is measured, taking turns, so a change in the host's speed hits both
    alike: ``rounds`` bursts each, alternating, then the closed loop twice
    per server, pool, one, one, pool (a linear drift cancels). Returns
    each server's requests and the video prompt's token count."""
    servers: dict[int, Server] = {}
    try:
        for num_workers in (4, 1):
            progress(f"TTFT: starting the server with preprocess_workers={num_workers}")
            servers[num_workers] = ttft_server(model_dir, num_workers, tmp, clip, max_model_len, pin)
        urls = {n: server.wait() for n, server in servers.items()}
        for url in urls.values():
            num_prompt_tokens = asyncio.run(check_one(url, video))  # also the warm-up of every actor
            asyncio.run(burst(url, video))  # and of every pool thread (first-call costs)
        bursts: dict[int, list[float]] = {n: [] for n in servers}
        closed: dict[int, list[float]] = {n: [] for n in servers}
        spans = dict.fromkeys(servers, 0.0)
        for i in range(rounds):
            for n, url in urls.items():
                bursts[n] += asyncio.run(burst(url, video))
            progress(f"TTFT: burst {i + 1}/{rounds}", end="\r")
        per_half = max(1, rounds // 2)
        for n in (4, 1, 1, 4):
            progress(f"TTFT: closed loop, preprocess_workers={n}, {CONCURRENCY} x {per_half} requests", end="\r")
            ttfts, span = asyncio.run(closed_loop(urls[n], video, per_half))
            closed[n] += ttfts
            spans[n] += span
        progress("")
    finally:
        for server in servers.values():
            server.stop()
    return {n: TtftRun(bursts[n], closed[n], spans[n]) for n in servers}, num_prompt_tokens


def percentile_ms(values: list[float], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    ordered = sorted(values)
    return 1e3 * ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def report_ttft(report, runs: dict[int, TtftRun], num_prompt_tokens: int,
                max_model_len: int | None) -> tuple[float, float]:
    """The clip's TTFT tables; returns one / pool in bursts and in the closed loop."""
    p50 = {(n, mode): percentile_ms(getattr(runs[n], mode), 50) for n in (4, 1) for mode in ("burst", "closed")}
    rate = {n: len(runs[n].closed) / runs[n].closed_span for n in (4, 1)}
    ratios = p50[1, "burst"] / p50[4, "burst"], p50[1, "closed"] / p50[4, "closed"]
    report(f"\nserved video prompt: {num_prompt_tokens} tokens, context {max_model_len or 'of the model'}; "
           f"{len(runs[4].burst)} requests per mode in bursts of {CONCURRENCY} sent at once, {len(runs[4].closed)} "
           f"in a closed loop of {CONCURRENCY} clients (each sends its next request when its last one has answered)")
    report("| video TTFT, concurrency 4, p50 ms | bursts | closed loop | closed loop req/s |\n|---|---|---|---|")
    report(f"| pool (4 workers) | {p50[4, 'burst']:.0f} | {p50[4, 'closed']:.0f} | {rate[4]:.2f} |")
    report(f"| one worker (1) | {p50[1, 'burst']:.0f} | {p50[1, 'closed']:.0f} | {rate[1]:.2f} |")
    report(f"| one / pool | {ratios[0]:.2f}x | {ratios[1]:.2f}x | {rate[4] / rate[1]:.2f}x |")
    report("\n| TTFT ms, sent to first chunk | p50 | p90 | max |\n|---|---|---|---|")
    for n, name in ((4, "pool"), (1, "one worker")):
        for mode, label in (("burst", "bursts"), ("closed", "closed loop")):
            values = getattr(runs[n], mode)
            report(f"| {name}, {label} | {percentile_ms(values, 50):.0f} | {percentile_ms(values, 90):.0f} | "
                   f"{1e3 * max(values):.0f} |")
    return ratios


def run_ttft(report, args, clip: Clip, video: str, tmp: Path) -> tuple[float, float]:
    """Time to first token of ``clip``, pool against one worker; returns one / pool in bursts and closed loop."""
    # Qwen2.5-VL's own processor on a tiny model: the server decodes, resizes and patches the clip as
    # for a real model, so TTFT is mostly that.
    max_model_len = None if args.model else context_for(clip)
    model_dir = args.model or save_tiny_vl_model(tmp / f"tiny-vl-{max_model_len}", real_patches=True,
                                                 max_model_len=max_model_len)
    runs, num_prompt_tokens = measure_ttft(model_dir, video, tmp, args.ttft_rounds, clip, max_model_len,
                                           pin=not args.pool_unpinned)
    report(f"\nvideo {clip.label} at {clip.fps:g} fps ({clip.num_frames} frames, {len(video) >> 10} KiB data: URL)")
    return report_ttft(report, runs, num_prompt_tokens, max_model_len)


# ---- main ---------------------------------------------------------------------


class Report:
    """Prints the result tables, and appends them to ``--output`` too."""

    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        write_output(text, self.path, append=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=32, help="requests per batch (kind and pool size)")
    parser.add_argument("--throughput-rounds", type=positive_int, default=5,
                        help="batches per kind and pool size, sizes taking turns (the median is reported)")
    parser.add_argument("--workers", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--torch-threads", type=positive_int, default=1, help="intra-op threads of this process")
    parser.add_argument("--ttft-rounds", type=non_negative_int, default=5,
                        help="bursts of 4 video requests sent at once, and requests per client in the closed loop "
                             "of 4 clients (0: skip time to first token)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Qwen2.5-VL folder to serve for TTFT (default: a tiny random one)")
    parser.add_argument("--video-seconds", type=positive_float, default=4.0, help="length of the clip (default 4)")
    parser.add_argument("--video-size", type=parse_size, default=(320, 240), metavar="WxH",
                        help="frame size of the clip (default 320x240)")
    parser.add_argument("--video-fps", type=positive_float, default=2.0,
                        help="frames sampled per second of clip: the server's video_fps (default 2)")
    parser.add_argument("--ttft-clip", type=parse_clip_or_none, default=HEAVY_CLIP, metavar="WxHxSECONDS",
                        help="throughput rows and time to first token again with this clip (default 640x480x16: "
                             "32 frames, a draft of ~250-600 ms on one core by host; 'none' skips it)")
    parser.add_argument("--ttft-extra-clip", type=parse_clip, default=None, metavar="WxHxSECONDS",
                        help="time to first token with this clip too (e.g. 640x480x8)")
    parser.add_argument("--audio-seconds", type=positive_float, default=10.0,
                        help="length of the audio clip (default 10; at most 30)")
    parser.add_argument("--audio-formats", nargs="*", choices=["wav", "mp3"], default=["wav", "mp3"],
                        help="audio rows, one per format (none: no audio rows)")
    parser.add_argument("--ttft-only", action="store_true", help="only time to first token (no throughput)")
    parser.add_argument("--pool-unpinned", action="store_true",
                        help="run the pool's threads unpinned (prepare.pin_pool_threads: false), to compare with a "
                             "default (pinned) run on the same host")
    parser.add_argument("--output", type=Path, default=None, help="append the tables to this file too")
    args = parser.parse_args(argv)
    if args.model is not None:  # before any server starts: its own error would not name the option
        try:
            args.model = model_dir_of(str(args.model))
        except SystemExit as err:
            parser.error(str(err.code))
        from mstar_actors.prepare.preparers import MEDIA_PREPARERS

        archs = json.loads((args.model / "config.json").read_text()).get("architectures") or []
        if not any("video" in getattr(MEDIA_PREPARERS.get(a), "MEDIA_KINDS", ()) for a in archs):
            readers = ", ".join(a for a, p in MEDIA_PREPARERS.items() if "video" in p.MEDIA_KINDS)
            parser.error(f"--model {args.model}: its architecture ({', '.join(archs) or 'none named'}) takes no "
                         f"video; give a folder of one that does ({readers})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clip = Clip(args.video_seconds, *args.video_size, args.video_fps)
    heavy = args.ttft_clip and Clip(args.ttft_clip[2], *args.ttft_clip[:2], clip.fps)
    report = Report(args.output)
    import torch

    from mstar_actors.prepare.media import KEPT_BYTES_PER_DRAFT, MediaLimits, keep_freed_buffers
    from mstar_actors.prepare.preparers import load_preparer

    torch.set_num_threads(args.torch_threads)
    keep_freed_buffers(max_kept=KEPT_BYTES_PER_DRAFT * max(4, *args.workers))  # as the prepare actor does
    report(f"# {platform.node()} {os.cpu_count()} cpus (affinity {len(os.sched_getaffinity(0))}), torch threads "
           f"{torch.get_num_threads()}, pool threads {'unpinned' if args.pool_unpinned else 'pinned where the CPUs allow'}, "
           f"{args.requests} requests per batch; video {clip.label} sampled at {clip.fps:g} fps ({clip.num_frames} frames)")
    with tempfile.TemporaryDirectory() as tmp:
        videos = {clip: clip.data_url(), **({heavy: heavy.data_url()} if heavy else {})}
        if not args.ttft_only:
            limits = MediaLimits(max_bytes=50 << 20, **clip.server_limits())
            preparer = load_preparer(vl_prepare_info(save_vl_prepare_folder(Path(tmp) / "vl")), limits)
            media = {"image": Media("image", jpeg_data_url(), args.requests),
                     f"video {clip.label}": Media("video", videos[clip], args.requests)}
            if heavy:  # fewer requests, each ~10x the default clip's draft
                media[f"video {heavy.label}"] = Media("video", videos[heavy], max(8, args.requests // 2))
            media |= audio_media(args, Path(tmp), limits)
            throughput(report, args, preparer, media)
        if not args.ttft_rounds:
            return 0
        extras = [Clip(c[2], *c[:2], clip.fps) for c in (args.ttft_clip, args.ttft_extra_clip) if c]
        ratios = {}
        for c in dict.fromkeys([clip, *extras]):
            progress(f"TTFT with a {c.label} clip")
            ratios[c] = run_ttft(report, args, c, videos.get(c) or c.data_url(), Path(tmp))
        report(f"\n| video TTFT at concurrency {CONCURRENCY}, clip | one / pool, bursts | one / pool, closed loop |"
               "\n|---|---|---|")
        for c, (in_bursts, in_loop) in ratios.items():
            report(f"| {c.label} ({c.num_frames} frames) | {in_bursts:.2f}x | {in_loop:.2f}x |")
    return 0


if __name__ == "__main__":
    run_tool(main)
