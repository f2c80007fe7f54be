"""The actor base: a mailbox, dispatch by message type, a lifecycle.

An actor is one process (or, in tests, one object on a shared asyncio loop)
with named channels::

    actor = MyActor(name="prepare", config=config, info=info,
                    inbox={"frontend": ch_in, "control": ctl_in},
                    outbox={"conductor": ch_out, "control": ctl_out},
                    **params)          # e.g. rank=0 for a worker
    exit_code = await actor.run()

``info`` is the launcher's ``ModelInfo`` (``mstar_actors.model_info``): the
model's facts, which no actor derives again.

Conventions every actor follows (the frontend included):

- Channel names are the peer's name: ``"frontend"``, ``"prepare"``,
  ``"conductor"``, ``"worker0"`` .. ``"worker{N-1}"`` (the conductor's
  outbound broadcast to every rank is ``"workers"``), and ``"control"`` for the
  launcher (inbound ``LauncherToActor``, outbound ``ActorToLauncher``). The
  control channels are optional, so tests may leave them out.
- Subclasses override ``start()`` (load things; run blocking work with
  ``await self.run_blocking(fn, *args)``), ``handle(channel, msg)`` (a
  ``match`` on the message class that ends in ``case _:
  self.unknown(channel, msg)``), and optionally ``stop()`` (release things),
  ``on_started()`` and ``on_peer_failed(msg)`` (launcher notices).
- An actor whose loop is not "one message, one reaction" (the conductor's
  busy loop) overrides ``serve()`` and pulls from ``self.mailbox`` itself,
  passing every message through ``self.dispatch``.

Lifecycle of ``run()``: ``start()``; ``ActorReady`` to the launcher; then
``serve()`` until a ``Shutdown`` arrives on any channel or an inbound channel
ends; then ``stop()`` and every outbound channel is closed (so the end
propagates downstream). An unexpected exception anywhere is logged with the
actor's name and reported to the launcher as ``ActorError`` with its
traceback; ``run()`` then returns 1 and the process exits non-zero.

Process entry: ``run_actor_process("actors.worker:WorkerActor", spec)``. The
class travels as a string so that torch is imported only after SIGUSR1 is
blocked (see ``run_actor_process``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mstar_actors.config import Config
from mstar_actors.early_stop import STOP_SIGNALS
from mstar_actors.messages import (
    ActorError,
    ActorReady,
    PeerFailed,
    Shutdown,
    Started,
)
from transport.errors import ChannelBroken, ChannelClosed, DecodeError

if TYPE_CHECKING:  # importing it imports torch: see ActorSpec.info
    from mstar_actors.model_info import ModelInfo

log = logging.getLogger("mstar_actors.actor")

CONTROL = "control"


def frontend_name(index: int) -> str:
    """The name of frontend ``index`` of ``server.api_server_count`` (its
    actor's, and its channels' at the prepare and conductor ends):
    ``frontend``, then ``frontend1`` ..."""
    return "frontend" if index == 0 else f"frontend{index}"


class ShutdownRequested(Exception):
    """Raised inside ``dispatch`` to end ``serve()``; ``run()`` stops cleanly."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PeerGone(ChannelBroken):
    """An inbound channel broke: the actor writing it died. The launcher names
    which and how; this actor stops with one line, no traceback of its own."""

    def __init__(self, actor: str, channel: str, err: BaseException):
        super().__init__(f"actor {actor!r}: inbound channel {channel!r} broke: {err}")
        writer = "the launcher" if channel == CONTROL else f"the {channel} actor"
        self.failure = f"{writer} died (its channel {channel!r} broke)"


class UnknownMessage(RuntimeError):
    """A message this actor has no handler for: a protocol bug, never ignored."""


@dataclasses.dataclass(frozen=True)
class _EndOfChannel:
    """Put in the mailbox by a channel's reader task when the channel ends
    (closed, broken, or an undecodable message, which ``dispatch`` raises)."""

    error: BaseException


class Mailbox:
    """Merges named inbound channels into one ordered stream of ``(channel, msg)``.

    One reader task per channel feeds one bounded queue, so each channel's
    order is kept and a slow actor pushes back on its writers (a full queue
    blocks the reader task, which leaves the bytes in the channel's buffer).
    Interleaving across channels follows arrival order.
    """

    def __init__(self, channels: dict[str, Any], max_pending: int = 256):
        self.channels = channels
        self._queue: asyncio.Queue = asyncio.Queue(max_pending)
        self._tasks: list[asyncio.Task] = []

    def open(self) -> None:
        for name, channel in self.channels.items():
            task = asyncio.create_task(self._pump(name, channel), name=f"recv:{name}")
            self._tasks.append(task)

    async def _pump(self, name: str, channel: Any) -> None:
        """Move one channel's messages into the queue, a batch per await: the
        per-message cost is a ``put_nowait``, not a coroutine. The batch is
        at most the queue's size, so what the pump holds stays bounded (a
        full queue still blocks it, leaving the rest in the channel)."""
        queue = self._queue
        max_n = max(1, queue.maxsize)
        while True:
            try:
                batch = await channel.recv_batch(max_n)
            except (ChannelClosed, DecodeError) as err:  # ChannelBroken included
                await queue.put((name, _EndOfChannel(err)))  # after every message before it
                return
            for msg in batch:
                if queue.full():
                    await queue.put((name, msg))
                else:
                    queue.put_nowait((name, msg))

    async def get(self) -> tuple[str, Any]:
        """The next ``(channel, message)``, waiting for one."""
        return self._queue.get_nowait() if not self._queue.empty() else await self._queue.get()

    def get_nowait(self) -> tuple[str, Any] | None:
        """The next ``(channel, message)`` if one is waiting, else None."""
        return None if self._queue.empty() else self._queue.get_nowait()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class Actor:
    """Base class; see the module docstring for the conventions."""

    def __init__(self, name: str, config: Config, inbox: dict[str, Any], outbox: dict[str, Any],
                 info: ModelInfo | None = None, **params: Any):
        if params:
            raise TypeError(f"actor {name!r}: unexpected parameters {sorted(params)}")
        self.name = name
        self.config = config
        self.info = info  # the model's facts, from the launcher (None: an actor that needs none)
        self.inbox = inbox
        self.outbox = outbox
        self.mailbox = Mailbox(inbox)
        self.log = logging.getLogger(f"mstar_actors.{name}")
        self.stop_reason = ""
        # what ended ``run`` with an error ("Type: message", or a dead peer's PeerGone.failure), for ``stop`` to tell
        self.failure = ""
        self.own_process = False  # set by the process entry: the heap is the actor's alone
        self.address = ""  # where it serves clients once started (a frontend's URL), for the launcher's line

    # ---- hooks for subclasses ------------------------------------------

    async def start(self) -> None:
        """Load what the actor needs before it reports ready."""

    async def handle(self, channel: str, msg: Any) -> None:
        self.unknown(channel, msg)

    async def stop(self) -> None:
        """Release what ``start`` acquired. Runs on every exit path."""

    def on_started(self) -> None:
        """The launcher says every actor is ready."""

    def on_peer_failed(self, msg: PeerFailed) -> None:
        self.log.warning("peer %s failed: %s", msg.actor, msg.reason)

    # ---- the machinery ----------------------------------------------------

    def unknown(self, channel: str, msg: Any) -> None:
        raise UnknownMessage(
            f"actor {self.name!r}: no handler for {type(msg).__name__} on channel {channel!r}"
        )

    async def run_blocking(self, fn: Callable, *args: Any) -> Any:
        """Run blocking work (model loading) in a thread, keeping the loop free."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def dispatch(self, channel: str, msg: Any) -> None:
        """Route one mailbox item: control and end-of-channel here, the rest to ``handle``."""
        match msg:
            case _EndOfChannel(error=ChannelBroken() as err):
                raise PeerGone(self.name, channel, err)
            case _EndOfChannel(error=DecodeError() as err):
                raise DecodeError(f"actor {self.name!r}: inbound channel {channel!r}: {err}")
            case _EndOfChannel():
                raise ShutdownRequested(f"channel {channel!r} ended")
            case Shutdown(reason=reason):
                raise ShutdownRequested(reason or f"Shutdown on {channel!r}")
            case Started() if channel == CONTROL:
                self.on_started()
            case PeerFailed() if channel == CONTROL:
                self.on_peer_failed(msg)
            case _:
                await self.handle(channel, msg)

    async def serve(self) -> None:
        """Default loop: one message, one reaction, in mailbox order."""
        while True:
            channel, msg = await self.mailbox.get()
            await self.dispatch(channel, msg)

    async def report(self, msg: Any) -> None:
        """Send to the launcher, if there is a control channel."""
        if CONTROL in self.outbox:
            await self.outbox[CONTROL].send(msg)

    async def run(self) -> int:
        """The whole lifecycle; returns the process exit code (0 clean, 1 error)."""
        self.mailbox.open()
        code = 0
        try:
            await self.start()
            if self.own_process:
                settle_heap(self.log)
            await self.report(ActorReady(actor=self.name, pid=os.getpid(), address=self.address))
            self.log.info("ready")
            await self.serve()
        except ShutdownRequested as stop:
            self.stop_reason = stop.reason
            self.log.info("shutting down: %s", stop.reason)
        except Exception as err:  # reported, then the process exits non-zero
            code = 1
            self.failure = err.failure if isinstance(err, PeerGone) else f"{type(err).__name__}: {err}"
            await self._report_error(err)
        finally:
            self.mailbox.close()
            code = await self._stop_quietly(code)
            self._close_outbox()
        return code

    async def _report_error(self, err: Exception) -> None:
        user = _is_user_error(err)
        if isinstance(err, PeerGone):  # a consequence: the launcher logs the death itself
            text, message = "", err.failure
            self.log.error("actor %s stops: %s", self.name, message)
        elif user:  # the operator's to mend, and the message says how: no traceback
            text, message = "", str(err)
            self.log.error("actor %s failed: %s", self.name, message)
        else:
            text, message = "".join(traceback.format_exception(err)), f"{type(err).__name__}: {err}"
            self.log.error("actor %s failed: %s\n%s", self.name, err, text)
        try:
            msg = ActorError(actor=self.name, message=message, traceback=text, user_error=user)
            if CONTROL in self.outbox:
                self.outbox[CONTROL].send_nowait(msg)
        except Exception as send_err:  # the launcher still sees the exit code
            self.log.error("could not report the error to the launcher: %s", send_err)

    async def _stop_quietly(self, code: int) -> int:
        try:
            await self.stop()
        except Exception as err:
            self.log.error("stop() failed: %s\n%s", err, traceback.format_exc())
            return 1
        return code

    def _close_outbox(self) -> None:
        for channel in self.outbox.values():
            try:
                channel.close()
            except Exception as err:  # closing is best effort at exit
                self.log.debug("closing %s: %s", getattr(channel, "name", "?"), err)


def _is_user_error(err: Exception) -> bool:
    """A config key, the model folder or the machine refused with a message
    naming what to change (``ConfigError``, ``ModelLoadError``, ``FetchError``)."""
    from mstar_actors.config import ConfigError
    from mstar_actors.fetch import FetchError
    from mstar_actors.models.spec import ModelLoadError

    return isinstance(err, (ConfigError, ModelLoadError, FetchError))


# --------------------------------------------------------------------------
# Process entry
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ActorSpec:
    """Everything a child process needs; pickled by the spawn context.

    ``inbox`` / ``outbox`` map channel names to ``(ring_spec, union_name)``:
    the union is named (``"FrontendToPrepare"``) and looked up in
    ``mstar_actors.messages`` so nothing heavy is imported while unpickling.
    """

    name: str
    config: Config
    run_dir: str
    inbox: dict[str, tuple[Any, str]]
    outbox: dict[str, tuple[Any, str]]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_level: int = logging.INFO
    # The launcher's ModelInfo as plain builtins: unpickling the struct would
    # import torch (its LoRA shapes' package does) before SIGUSR1 is blocked.
    info: dict[str, Any] | None = None


def stacks_path(run_dir: str | os.PathLike, actor: str) -> Path:
    return Path(run_dir) / "stacks" / f"{actor}.txt"


def _coroutine_frames(coro: Any) -> list:
    """Frames of a suspended coroutine chain, outermost first (follows ``cr_await``)."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _format_frames(frames: list) -> str:
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in frames)
    return "".join(summary.format())


def _all_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
    """``asyncio.all_tasks`` from another thread: the set may change under us, so retry."""
    for _ in range(10):
        try:
            return list(asyncio.all_tasks(loop))
        except RuntimeError:
            continue
    return []


def format_stacks(actor: str, loop: asyncio.AbstractEventLoop | None) -> str:
    """Every thread's stack and every asyncio task's stack, labelled.

    Safe to call from a thread other than the loop's, including while the
    loop is blocked: it only reads frames.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"=== actor {actor} (pid {os.getpid()}) at {time.strftime('%H:%M:%S')} ===\n"]
    for ident, frame in sys._current_frames().items():
        label = names.get(ident, "?")
        parts.append(f"--- actor {actor} thread {label} (id {ident}) ---\n")
        parts.append("".join(traceback.format_stack(frame)))
    if loop is not None:
        for task in _all_tasks(loop):
            parts.append(f"--- actor {actor} asyncio task {task.get_name()} ---\n")
            parts.append(_format_frames(_coroutine_frames(task.get_coro())) or "  (no frames)\n")
    return "".join(parts)


def write_stacks(actor: str, run_dir: str | os.PathLike, loop: asyncio.AbstractEventLoop | None) -> Path:
    """Write ``format_stacks`` atomically to ``RUN_DIR/stacks/<actor>.txt``
    (a reader never sees half a file: it appears complete or not at all)."""
    path = stacks_path(run_dir, actor)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(format_stacks(actor, loop))
    os.replace(tmp, path)
    return path


class StackDumper:
    """A daemon thread that waits for SIGUSR1 with ``sigwait`` and dumps stacks.

    SIGUSR1 must already be blocked in every thread (``run_actor_process``
    blocks it first thing), so the signal stays pending until this thread takes
    it; no Python signal handler is involved, which is why it works while the
    actor's event loop is blocked in a long call.
    """

    def __init__(self, actor: str, run_dir: str | os.PathLike):
        self.actor = actor
        self.run_dir = run_dir
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._wait, name="stack-dumper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _wait(self) -> None:
        while True:
            signal.sigwait({signal.SIGUSR1})
            try:
                write_stacks(self.actor, self.run_dir, self.loop)
            except Exception as err:  # a failed dump must not kill the actor
                log.error("actor %s: stack dump failed: %s", self.actor, err)


GC_PAUSE_LOGGED_S = 0.005  # a collection at least this long is logged (DEBUG)


def settle_heap(log: logging.Logger) -> None:
    """After ``start()`` in an actor's own process: move what start-up made
    (modules, weights' wrappers, tokenizers) out of the collector's reach,
    so a full collection while serving walks only what serving made (a
    collection over every start-up object stalls the loop for tens of ms);
    then log each collection that still takes ``GC_PAUSE_LOGGED_S`` or more."""
    gc.collect()
    gc.freeze()
    started: list[float] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            took = time.perf_counter() - started[0]
            if took >= GC_PAUSE_LOGGED_S:
                log.debug("garbage collection of generation %d: %.1f ms, %d freed", info["generation"], took * 1e3,
                          info["collected"])

    gc.callbacks.append(watch)


def _setup_logging(name: str, level: int) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the launcher dies (Linux), so a
    ``kill -9`` of the launcher leaves no actor behind holding its segments."""
    if not _prctl(1, signal.SIGKILL):  # PR_SET_PDEATHSIG
        return  # not Linux: the launcher's next start still cleans up
    if os.getppid() == 1:  # the launcher died before the prctl took effect
        os._exit(1)


def process_name(actor: str) -> str:
    """What ``ps -o comm``, ``top`` and ``pgrep`` show for an actor's process (the kernel keeps 15 bytes)."""
    return f"mstar-{actor}"[:15]


def _name_process(actor: str) -> None:
    """Name this process (and the threads it starts) for its actor: each is ``python`` otherwise, a worker
    not told from the frontend without the run dir's actors.json (Linux; elsewhere unnamed)."""
    _prctl(15, process_name(actor).encode())  # PR_SET_NAME


def _prctl(option: int, value: Any) -> bool:
    """Linux's ``prctl(option, value)``; False where there is none."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        return False
    return True


def _import_class(target: str) -> type:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def open_channels(spec: ActorSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """Open the rings named in ``spec``: reader ends for the inbox, writer ends
    for the outbox; a list of rings is one broadcast (the conductor's plans)."""
    from mstar_actors import messages
    from transport import BroadcastChannel, open_ring

    def writer(key: str, ring_spec: Any, union: Any) -> Any:
        if isinstance(ring_spec, list):
            rings = [open_ring(s, role="writer", union=union) for s in ring_spec]
            return BroadcastChannel(rings, union, name=f"{spec.name}.{key}")
        return open_ring(ring_spec, role="writer", union=union)

    inbox = {n: open_ring(s, role="reader", union=getattr(messages, u)) for n, (s, u) in spec.inbox.items()}
    outbox = {n: writer(n, s, getattr(messages, u)) for n, (s, u) in spec.outbox.items()}
    return inbox, outbox


async def _run_actor(actor_cls: type, spec: ActorSpec, dumper: StackDumper) -> int:
    dumper.loop = asyncio.get_running_loop()
    inbox, outbox = open_channels(spec)
    info = None
    if spec.info is not None:
        import msgspec

        from mstar_actors.model_info import ModelInfo

        info = msgspec.convert(spec.info, ModelInfo)
    actor = actor_cls(name=spec.name, config=spec.config, inbox=inbox, outbox=outbox, info=info, **spec.params)
    actor.own_process = True
    return await actor.run()


def run_actor_process(target: str, spec: ActorSpec) -> None:
    """Process entry for one actor (``target`` is ``"module:Class"``).

    Order matters: SIGUSR1 is blocked before anything imports torch, so the
    native threads torch starts inherit the blocked mask and the signal can
    only be taken by the stack-dumper thread's ``sigwait``.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    # The launcher coordinates shutdown: a Ctrl-C, systemd's stop, a closed terminal
    # or ``kill -TERM -PGID`` signals the whole group, and the actors drain on its
    # word (their processes, clip processes too, inherit the ignoring); it kills stragglers.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    _name_process(spec.name)
    _setup_logging(spec.name, spec.log_level)
    dumper = StackDumper(spec.name, spec.run_dir)
    dumper.start()
    actor_cls = _import_class(target)  # may import torch: after the mask
    import uvloop

    profiler = _profiler(spec.name, spec.config.debug)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code = runner.run(_run_actor(actor_cls, spec, dumper))
    finally:
        if profiler is not None:
            _save_profile(profiler, spec.name, spec.config.debug.profile_dir)
    _leave(code)


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown: the actor has stopped, closed
    its channels and given back what it held (the launcher unlinks the shared
    memory); the teardown would only print extension modules' leak notices
    (some 60 lines of Triton's nanobind objects a process, every stop)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _profiler(name: str, debug: Any) -> Any:
    """A running ``cProfile.Profile`` of this process's event-loop thread when
    ``debug.profile_actors`` names the actor, else None. Its statistics are
    written when the actor's loop ends (``_save_profile``)."""
    if name not in debug.profile_actors:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _save_profile(profiler: Any, name: str, folder: str) -> None:
    profiler.disable()
    path = Path(folder) / f"{name}.prof"
    try:
        profiler.dump_stats(path)
    except OSError as err:
        log.error("%s: could not write its profile to %s: %s; set debug.profile_dir to a writable folder", name,
                  path, err)
        return
    log.info("%s: profile written to %s (python -m pstats %s)", name, path, path)
