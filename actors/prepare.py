"""The prepare actor: client requests in, model inputs out, each as soon as it is ready.

The model-specific work (chat template, tokens, media decode, the processor)
is a preparer from ``mstar_actors.prepare.preparers``, chosen by the architecture;
``draft(req, fetched) -> Draft | Failed`` is its one entry point. This file
only schedules it.

Two paths:

- **Inline** (the preparer does not declare ``PREPROCESS_PARALLEL``: text,
  milliseconds a request): one message, one reaction, in mailbox order, as
  the default ``Actor.serve`` does. ``Abort`` is forwarded in order.
- **Pool** (a media preparer, one worker or more): each media request's
  preparation runs on a ``ThreadPoolExecutor`` while this loop only starts
  requests and finishes them (stores tensors in the arena, sends), so a long
  video's draft holds neither the loop (its fetches, the aborts it reads)
  nor the requests behind it. Requests without media (text, milliseconds)
  take a lane of their own beside the pool (the loop's default executor):
  never a pool thread, so none waits for media. ``serve`` below is the loop.
  Each pool thread is
  pinned to CPUs of its own when the CPU plan has them
  (``CpuPlan.pool_cpus``; ``prepare.pin_pool_threads``); for a preparer
  that prepares in processes (audio clips: ``start_processes``), each
  process takes those CPUs instead, and its two threads float.

Invariants of the pool path. Each lane's state (what it started and has not
released, its bounds, abandoned requests) is a ``PendingRequests``
(``mstar_actors.prepare``), touched only by the loop's thread, which alone
sends; the executors' threads see only their request and the read-only
preparer.

- **Done, then gone.** ``PendingRequests`` releases each request once it is
  done, the oldest of those done first: an image a thread has taken never
  waits for a long video started before it, nor text for media (as each
  request of vLLM's awaits its own media).
- **Bounded lanes.** A lane starts a request only while fewer than
  ``2 * num_workers`` are preparing in it (drafting, or queued for a
  thread: each pool thread has its next request waiting, so a thread that
  finishes starts it at once instead of after this loop's turn, which shares
  the GIL with the drafts) and fewer than ``2 * num_workers`` wait for
  release. Past that, more are read into the lane and wait their turn (an
  ``Abort`` read meanwhile drops its request unprepared): media requests up
  to ``MAX_MEDIA_WAITING``, those fetching counted (they join the line once
  fetched), and ``MAX_MEDIA_WAITING_BYTES`` of their inline and fetched
  media; past it a media request read is a 503 at once and fetches wait
  their turn, so the loop reads on and text and aborts never wait behind a
  media backlog (reading stopped there once: a text request waited seconds
  behind twenty large images, and the clients that left meanwhile had their
  requests prepared and run); text up to ``MAX_READ_AHEAD``, past which the
  loop reads nothing more and new requests wait undecoded in the mailbox
  and the ring behind it (the
  frontend sees backpressure).
- **Bounded outbox.** A release awaits ``send`` on the loop: while the
  conductor's ring is full nothing else is read, nothing is dropped, and an
  ``Abort`` read after it never overtakes its request.
- **Abandoned requests.** An ``Abort`` for a request not yet released takes
  it out of its lane at once; a thread that has not begun its draft skips it, one that has
  stops before its next media item, and the result is dropped unsent. Its tensors never reach the
  arena, since storing happens only at release. The Abort itself is not
  forwarded: the conductor never saw the request, and the frontend expects no
  ``Finished`` for a request that produced no token. An ``Abort`` for a
  request already released (or unknown) is forwarded, in order.
- **Failures are per request.** A preparer's refusal is that request's
  ``Failed(400)``; an unexpected exception is its ``Failed(500)``; an arena
  that stays full is its ``Failed(503)``.

**Fetching, both paths.** Media fetched over http(s) is async I/O on this
loop (aiohttp), in a task of the request's own, before the request takes its
turn: a slow or silent server holds neither a pool thread, nor the mailbox,
nor the requests behind it. A fetching request is outside the release order
(it joins the media line at the end of its fetch, and starts only while that
line has room), at most ``max_fetching`` at once; more
wait their turn to fetch, up to ``MAX_WAITING_TO_FETCH``: past that, a request
with http(s) media is a 503 at once (retry later), while requests without
http(s) media go on (reading stopped there once, and held every request behind
a burst of slow media servers without a word). An ``Abort`` cancels its fetch (or its turn) at once and is not forwarded
(the conductor never saw the request). A fetch that fails is that request's
``Failed(400)``, sent when it fails.

At DEBUG, each request sent logs one line: its id and what was sent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import os
import threading
from pathlib import Path
from typing import Any


from actors.base import Actor, Mailbox
from mstar_actors.prepare.cpu_plan import CpuPlan, resolve_prepare_workers
from mstar_actors.prepare.media import (FetchError, MediaError, MediaLimits, MediaRef, collect_media, fetch_remote,
                                        make_fetch_session)
from mstar_actors.messages import Abort, Failed, LoadAdapter, NewRequest, Prepared, UnloadAdapter
from mstar_actors.prepare import PendingRequest, PendingRequests
from mstar_actors.prepare.preparers import (Draft, Preparer, failed, first_media_part, load_preparer, media_parts,
                                            with_media)
from transport.arena import ArenaFull, TensorTooLarge

__all__ = ["PrepareActor", "Preparer", "load_preparer"]

# Requests fetching http(s) media at once, at least (4 a pool worker past that): each holds its
# bytes until drafted, at most ``server.max_media_bytes`` an item.
MIN_FETCHING = 16
# Requests with http(s) media read while ``max_fetching`` fetch, waiting their turn (a NewRequest each: small);
# past them, such a request is a 503.
MAX_WAITING_TO_FETCH = 64
# Text requests read while their lane is full, waiting for room; past them nothing more is read.
MAX_READ_AHEAD = 8
# Media requests read while the pool is full, waiting for a thread, and their inline media's bytes (data: URLs,
# decoded from the body): past either, such a request is a 503.
MAX_MEDIA_WAITING = 64
MAX_MEDIA_WAITING_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(eq=False)
class Lane:
    """Requests drafting on one executor (the pool's threads; None: the loop's default executor, for text):
    started and not yet released (``pending``), and those read while it was full (``ahead``, oldest first)."""

    pending: PendingRequests
    executor: Any = None
    ahead: collections.OrderedDict[str, tuple[NewRequest, dict[str, bytes]]] = dataclasses.field(
        default_factory=collections.OrderedDict)


class PrepareActor(Actor):
    """inbox: ``frontend`` (FrontendToPrepare), ``control``; outbox: ``conductor``, ``control``.

    ``preparer``, ``arena`` and ``num_workers`` may be injected (tests);
    otherwise ``start`` builds them from the config. ``arena`` is the producer
    end of the media tensor arena (``async put_all(tensors, num_readers)``: all or none).
    """

    def __init__(self, *, preparer: Any = None, arena: Any = None, num_workers: int | None = None,
                 arena_spec: Any = None, run_id: str | None = None, **kw: Any):
        super().__init__(**kw)
        self.run_id = run_id  # names the clip processes' shared memory (None: an id of its own)
        # Hold at most one message beyond the one being handled, so a full lane
        # leaves the rest in the frontend's ring: the frontend feels backpressure.
        self.mailbox = Mailbox(self.inbox, max_pending=1)
        self.preparer = preparer
        self.arena = arena
        self.arena_spec = arena_spec
        self.num_workers = num_workers
        self.limits = MediaLimits.from_config(self.config.server)
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.media = Lane(PendingRequests(max_preparing=1, max_unreleased=1))  # sized with the pool in start
        self.text = Lane(PendingRequests(max_preparing=1, max_unreleased=1))
        self._tasks: dict[PendingRequest, asyncio.Task] = {}  # preparing, abandoned ones included
        self._aside: dict[str, asyncio.Task] = {}  # inline: constrained requests drafting on a thread, by id
        self._fetching: dict[str, asyncio.Task] = {}  # fetching http(s) media, by id: outside the release order
        # waiting to fetch, with their http(s) parts
        self._to_fetch: collections.OrderedDict[str, tuple[NewRequest, list[MediaRef]]] = collections.OrderedDict()
        self.max_fetching = MIN_FETCHING  # sized with the pool in start
        self._changed = asyncio.Event()  # a preparation ended
        self._http: Any = None  # media.FetchSession, made on first http(s) media

    # ---- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        import torch

        from mstar_actors.prepare.media import KEPT_BYTES_PER_DRAFT, keep_freed_buffers

        # Drafts make and drop tens of MB each (a 640x480 16 s clip: ~100 MB of fresh pages
        # per draft); kept, they are reused without page faults, and four pool threads no
        # longer serialise on the process's mmap/munmap (see keep_freed_buffers).
        keep_freed_buffers()
        torch.set_num_threads(self.config.prepare.preprocess_torch_threads)
        if self.preparer is None:
            self.preparer = await self.run_blocking(load_preparer, self.info, self.limits)
        if self.arena is None and self.arena_spec is not None:
            from transport.arena import ArenaSpec, TensorArena

            spec = ArenaSpec(**self.arena_spec) if isinstance(self.arena_spec, dict) else self.arena_spec  # the launcher's dict
            self.arena = TensorArena(spec, "producer")
        self.num_workers = self._size_pool()
        for lane in (self.media, self.text):
            lane.pending = PendingRequests(max_preparing=2 * self.num_workers, max_unreleased=2 * self.num_workers)
        self.max_fetching = max(MIN_FETCHING, 4 * self.num_workers)
        if getattr(self.preparer, "PREPROCESS_PARALLEL", False):  # a pool, of one thread at the least
            # A preparer whose heavy part holds the GIL runs it in processes of
            # its own (``start_processes``: audio clips), one a worker. Its
            # threads then only hand clips over and wait, so there are two a
            # process (a lane each, ``clip_processes``), unpinned: each process
            # finds its next clip queued when it finishes one. The processes
            # take the CPUs the threads would have taken.
            in_processes = hasattr(self.preparer, "start_processes") and self.num_workers > 1
            num_threads = 2 * self.num_workers if in_processes else self.num_workers
            # Each pool thread sets its intra-op count too (with some OpenMP
            # runtimes it is per thread), so N workers never fan out over
            # every core each; and takes CPUs of its own when the plan has them.
            threads = self.config.prepare.preprocess_torch_threads
            cpus = None
            if self.config.prepare.pin_pool_threads:
                allowed = sorted(os.sched_getaffinity(0))
                cpus = self._cpu_plan().pool_cpus(allowed, self.num_workers, threads, read_cpu_cores(allowed))
            self.threads = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="prepare",
                                                              initializer=self._init_pool_thread,
                                                              initargs=(threads, None if in_processes else cpus,
                                                                        itertools.count()))
            self.media.executor = self.threads
            # Each thread's draft keeps its freed buffers for the next (one heap, see there).
            keep_freed_buffers(max_kept=KEPT_BYTES_PER_DRAFT * num_threads)
            self.log.info("preparing on %d threads, %s", num_threads,
                          f"pinned to CPUs {cpus}" if cpus and not in_processes else "not pinned")
            if in_processes:
                await self.run_blocking(self.preparer.start_processes, self.num_workers, self.run_id, cpus)
                self.log.info("the pool's threads prepare each clip in one of %d processes, %s", self.num_workers,
                              f"pinned to CPUs {cpus}" if cpus else "not pinned")
        else:
            self.log.info("preparing inline")

    def _init_pool_thread(self, torch_threads: int, cpus: list[list[int]] | None, taken: Any) -> None:
        """A new pool thread: pinned to the next CPU group (``CpuPlan.pool_cpus``),
        then its intra-op thread count (OpenMP threads it starts share its CPUs)."""
        import torch

        if cpus:
            group = cpus[next(taken) % len(cpus)]
            try:
                os.sched_setaffinity(threading.get_native_id(), group)  # this thread only
            except OSError as err:
                self.log.warning("could not pin a prepare thread to CPUs %s (%s); it runs unpinned", group, err)
        torch.set_num_threads(torch_threads)

    def _cpu_plan(self) -> CpuPlan:
        return CpuPlan(num_cpus=len(os.sched_getaffinity(0)), num_ranks=self.config.parallel.tp,
                       torch_threads_per_worker=self.config.parallel.worker_torch_threads or 1)

    def _size_pool(self) -> int:
        is_parallel = bool(getattr(self.preparer, "PREPROCESS_PARALLEL", False))
        if self.num_workers is not None:
            return self.num_workers if is_parallel else 1
        return resolve_prepare_workers(self._cpu_plan(), self.config.prepare.preprocess_torch_threads,
                                       self.config.prepare.preprocess_workers, is_parallel)

    async def stop(self) -> None:
        for task in [*self._tasks.values(), *self._aside.values(), *self._fetching.values()]:
            task.cancel()
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        if hasattr(self.preparer, "stop_processes"):
            self.preparer.stop_processes()
        if self._http is not None:
            await self._http.close()

    # ---- inline path ----------------------------------------------------------

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case NewRequest() if refs := self._remote_refs(msg):
                await self._start_fetch(msg, refs)
            case NewRequest():
                await self._prepare_fetched(msg, {})
            case Abort() if msg.request_id in self._fetching:  # its fetch stops now; the conductor never saw it
                self._fetching.pop(msg.request_id).cancel()
            case Abort() if lane := self._lane_holding(msg.request_id):
                self._abandon(lane, msg.request_id)
            case Abort() if msg.request_id in self._to_fetch:  # waiting for its turn to fetch
                del self._to_fetch[msg.request_id]
            case Abort() if msg.request_id in self._aside:  # its check's result is dropped
                self._aside.pop(msg.request_id).cancel()
                await self.outbox["conductor"].send(msg)
            case Abort() | LoadAdapter() | UnloadAdapter():  # the conductor decides adapters
                await self.outbox["conductor"].send(msg)
            case _:
                self.unknown(channel, msg)

    # ---- pool path ------------------------------------------------------------

    async def serve(self) -> None:
        if self.threads is None:
            return await super().serve()
        reading: asyncio.Task | None = None
        try:
            while True:
                self._changed.clear()  # before looking, so no completion is missed
                await self._release_ready()
                for lane in (self.media, self.text):
                    while lane.ahead and lane.pending.can_start():  # waiting first: they were read first
                        self._start(lane, *lane.ahead.popitem(last=False)[1])
                self._next_fetches()  # the media line's room, for what waits to fetch
                if reading is None and len(self.text.ahead) < MAX_READ_AHEAD:
                    reading = asyncio.create_task(self.mailbox.get(), name="prepare:read")
                changed = asyncio.create_task(self._changed.wait())
                await asyncio.wait({changed} | ({reading} if reading else set()),
                                   return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if reading is not None and reading.done():
                    channel, msg = reading.result()
                    reading = None
                    await self.dispatch(channel, msg)
        finally:
            if reading is not None:
                reading.cancel()

    def _start(self, lane: Lane, req: NewRequest, fetched: dict[str, bytes]) -> None:
        pending = lane.pending.start(req)
        task = asyncio.create_task(self._prepare(pending, fetched, lane), name=f"prepare:{req.request_id}")
        self._tasks[pending] = task
        task.add_done_callback(functools.partial(self._on_done, lane, pending))

    def _on_done(self, lane: Lane, pending: PendingRequest, task: asyncio.Task) -> None:
        del self._tasks[pending]
        if task.cancelled():
            lane.pending.drop(pending)
        else:
            lane.pending.finish(pending, task.result())  # _prepare turns every error into a Failed
        self._changed.set()

    def _lane_holding(self, request_id: str) -> Lane | None:
        """The lane a request was read into and not yet released from."""
        return next((lane for lane in (self.media, self.text)
                     if request_id in lane.ahead or request_id in lane.pending), None)

    def _abandon(self, lane: Lane, request_id: str) -> None:
        """Take a request out of its lane: unstarted, it is dropped; started, its thread's result is."""
        if lane.ahead.pop(request_id, None) is None:
            pending = lane.pending.abandon(request_id)
            if pending.is_cancellable:
                self._tasks[pending].cancel()  # not yet handed to a thread: stop now
            self._changed.set()
        self.log.debug("request %s abandoned before its release: dropped unsent", request_id)

    async def _release_ready(self) -> None:
        """Send every finished request, the oldest of each lane's first."""
        for lane in (self.text, self.media):
            while (pending := lane.pending.pop_releasable()) is not None:
                await self._send_result(pending.req, pending.result)

    # ---- both paths -----------------------------------------------------------

    async def _prepare_fetched(self, req: NewRequest, fetched: dict[str, bytes]) -> None:
        """A request whose media bytes are at hand (``fetched``: its http(s)
        parts'): into the pool's order, or prepared inline."""
        if self.threads is not None:
            lane = self.text if first_media_part(req.messages) is None else self.media
            if lane.pending.can_start() and not lane.ahead:
                self._start(lane, req, fetched)
            elif lane is self.media and (refusal := self._media_backlog_refusal(req)) is not None:
                await self._send_result(req, refusal)
            else:  # its turn comes when the lane has room
                lane.ahead[req.request_id] = (req, fetched)
        elif req.sampling.structured is not None:  # inline, its rules checked on a thread
            self._check_aside(req, fetched)
        else:  # inline: never in the release order
            await self._send_result(req, await self._prepare(PendingRequest(req), fetched))

    def _media_line_room(self, num_bytes: int) -> bool:
        """Whether the media line (requests waiting for a pool thread, and those fetching, which join it) has
        room for one more holding ``num_bytes``: fewer than ``MAX_MEDIA_WAITING``, their media's bytes (inline
        and fetched) within ``MAX_MEDIA_WAITING_BYTES``."""
        held = sum(_inline_bytes(r) + sum(map(len, fetched.values())) for r, fetched in self.media.ahead.values())
        return (len(self.media.ahead) + len(self._fetching) < MAX_MEDIA_WAITING
                and held + num_bytes <= MAX_MEDIA_WAITING_BYTES)

    def _media_backlog_refusal(self, req: NewRequest) -> Failed | None:
        """A 503 for a media request past the pool's waiting line (``_media_line_room``), else None."""
        if self._media_line_room(_inline_bytes(req)):
            return None
        return Failed(request_id=req.request_id, status=503, error_type="server_error", code="overloaded",
                      message=f"{len(self.media.ahead) + len(self._fetching)} requests with media wait for the "
                              f"{self.num_workers} preparing thread(s) (at most {MAX_MEDIA_WAITING}, "
                              f"{MAX_MEDIA_WAITING_BYTES >> 20} MiB of media); retry later")

    def _remote_refs(self, req: NewRequest) -> list[MediaRef]:
        """The request's http(s) media parts, to fetch first (none where a part
        is refused: its draft refuses it in its turn)."""
        if not getattr(self.preparer, "PREPARES_MEDIA", False) or not req.messages:
            return []
        try:
            refs = collect_media(req, self.limits, getattr(self.preparer, "MEDIA_KINDS", None))
        except MediaError:
            return []
        return [r for r in refs if r.scheme in ("http", "https")]

    async def _start_fetch(self, req: NewRequest, refs: list[MediaRef]) -> None:
        """Fetch the request's http(s) media in a task of its own, then go on
        as ``_prepare_fetched`` (the pool: into the order at the loop's next
        turn); with ``max_fetching`` fetching, it waits its turn, and with
        ``MAX_WAITING_TO_FETCH`` waiting too, it is a 503."""
        if len(self._to_fetch) >= MAX_WAITING_TO_FETCH:
            await self._send_result(req, Failed(
                request_id=req.request_id, status=503, error_type="server_error", code="overloaded",
                message=f"{len(self._fetching)} requests are fetching http(s) media and {len(self._to_fetch)} wait "
                        "to; retry later, or send the media inline (data: URLs)"))
            return
        self._to_fetch[req.request_id] = (req, refs)
        self._next_fetches()

    def _next_fetches(self) -> None:
        """Start the requests waiting to fetch, oldest first, while fewer than ``max_fetching`` fetch and (the
        pool) the media line has room for what they fetch: fetched, each joins it."""
        while (self._to_fetch and len(self._fetching) < self.max_fetching
               and (self.threads is None or self._media_line_room(0))):
            self._fetch_now(*self._to_fetch.popitem(last=False)[1])

    def _fetch_now(self, req: NewRequest, refs: list[MediaRef]) -> None:
        async def fetch() -> None:
            fetched: dict[str, bytes] | Failed = {}
            try:
                try:
                    fetched = await self._fetch(req, refs)
                except MediaError as err:
                    fetched = failed(req, str(err), err.param)
                except Exception as err:  # a bug fails its request alone
                    fetched = self._unexpected(req, err)
                if isinstance(fetched, Failed):  # sent while still fetching: an Abort read meanwhile drops it
                    await self._send_result(req, fetched)
                elif self.threads is not None:
                    self.media.ahead[req.request_id] = (req, fetched)
            finally:
                self._fetching.pop(req.request_id, None)  # an Abort took it out already
                self._next_fetches()
                self._changed.set()
            if self.threads is None and not isinstance(fetched, Failed):
                await self._prepare_fetched(req, fetched)

        self._fetching[req.request_id] = asyncio.create_task(fetch(), name=f"fetch:{req.request_id}")

    def _check_aside(self, req: NewRequest, fetched: dict[str, bytes]) -> None:
        """Inline, a constrained request drafts on a thread of its own (a large
        schema's rules take up to a second to check): the requests behind it go on."""
        async def prepare() -> None:
            result = await self._prepare(PendingRequest(req), fetched, aside=True)
            await self._send_result(req, result)
            del self._aside[req.request_id]  # (not before: an Abort read while it waits to go drops it unsent)

        self._aside[req.request_id] = asyncio.create_task(prepare(), name=f"prepare:{req.request_id}")

    async def _prepare(self, pending: PendingRequest, fetched: dict[str, bytes], lane: Lane | None = None,
                       aside: bool = False) -> Draft | Failed:
        """Draft on ``lane``'s executor (or inline; ``aside``: on a thread of its own)."""
        req = pending.req
        try:
            if aside:
                return await self.run_blocking(self._draft, pending, fetched)
            if lane is None:
                return self._draft(pending, fetched)
            lane.pending.hand_over(pending)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(lane.executor, self._draft, pending, fetched)
        except MediaError as err:
            return failed(req, str(err), err.param)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug in preparation fails its request alone
            return self._unexpected(req, err)

    def _unexpected(self, req: NewRequest, err: Exception) -> Failed:
        self.log.exception("preparing request %s failed", req.request_id, exc_info=err)
        return Failed(request_id=req.request_id, status=500, error_type="server_error",
                      message=f"preparing the request failed: {type(err).__name__}: {err}")

    def _draft(self, pending: PendingRequest, fetched: dict[str, bytes]) -> Draft | Failed:
        """The preparer's draft (on a pool thread, or inline)."""
        if pending.is_abandoned:  # aborted while queued for a thread: its result would be dropped
            return Failed(request_id=pending.request_id, status=400, message="abandoned before its draft began")
        return self.preparer.draft(pending.req, fetched, abandoned=lambda: pending.is_abandoned)

    async def _fetch(self, req: NewRequest, refs: list[MediaRef]) -> dict[str, bytes]:
        if self._http is None:
            self._http = make_fetch_session(self.limits)
        try:
            return await fetch_remote(refs, self.limits, self._http)
        except FetchError as err:  # the client is told one message whatever failed; the log, why
            self.log.warning("request %s: %s", req.request_id, err)
            raise err.public() from None

    async def _send_result(self, req: NewRequest, result: Draft | Failed) -> None:
        msg = result if isinstance(result, Failed) else await self._finish(req, result)
        await self.outbox["conductor"].send(msg)
        self.log.debug("prepared %s: %s sent", req.request_id, type(msg).__name__)

    async def _finish(self, req: NewRequest, draft: Draft) -> Prepared | Failed:
        """Store the draft's tensors in the arena (readers: every rank)."""
        if not draft.media:
            return draft.prepared
        if self.arena is None:
            return Failed(request_id=req.request_id, status=503, error_type="server_error",
                          message="this server has no tensor arena for media inputs")
        try:  # all or none: one at a time, its first tensors could leave no room for its next
            refs = await self.arena.put_all([item.pixel_values for item in draft.media],
                                            num_readers=self.config.parallel.tp)
        except TensorTooLarge as err:  # no wait can help: the client's to shrink, or the config's to grow
            sizes = [item.pixel_values.numel() * item.pixel_values.element_size() for item in draft.media]
            parts = media_parts(req.messages)  # (one item a part: the largest one's named)
            param = parts[sizes.index(max(sizes))][0] if len(parts) == len(sizes) else "messages"
            return self._unstored(req, Failed(
                request_id=req.request_id, status=413, code="media_too_large", param=param,
                message=f"{param}: this request's media make more tensor bytes than the whole tensor arena holds "
                        f"({err}); send fewer or smaller media (fewer pixels, frames or seconds)"))
        except ArenaFull as err:  # the workers hold too much media for now
            return self._unstored(req, Failed(
                request_id=req.request_id, status=503, error_type="server_error",
                message=f"no room for the request's media tensors: {err}; retry later"))
        return with_media(draft, refs)

    def _unstored(self, req: NewRequest, failed: Failed) -> Failed:
        """The request's media were not stored (``put_all`` stores all or none)."""
        self.log.info("request %s: media not stored: %s", req.request_id, failed.message)
        return failed


def _inline_bytes(req: NewRequest) -> int:
    """The characters of a request's media URLs (its data: URLs' base64: what it holds while it waits)."""
    return sum(len(part.url or "") for message in req.messages or []
               for part in (message.content if isinstance(message.content, list) else []) if part.type != "text")


def read_cpu_cores(cpus: list[int], root: Path = Path("/sys/devices/system/cpu")) -> dict[int, tuple[int, int]]:
    """Each CPU's physical core, as (package, core id), from sysfs: what
    ``CpuPlan.pool_cpus`` needs to keep two pool threads off one core's two
    hardware threads. A CPU whose topology cannot be read is left out (the
    plan counts it as a core of its own)."""
    cores = {}
    for cpu in cpus:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            cores[cpu] = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            continue
    return cores
