"""The launcher: creates the rings, spawns one process per actor, supervises.

``serve(config, info)`` in order: clean up what dead runs left in /dev/shm,
make a run directory, create every ring, spawn the actors (``multiprocessing``
spawn context; each spec carries the model's ``ModelInfo``, read once before),
wait until each reports ``ActorReady`` (bounded; the message names who did
not), send ``Started`` to the frontend(s), then wait for one of:

- SIGINT / SIGTERM / SIGHUP (unless ``nohup`` ignores it): a graceful stop (exit code 0): ``Drain`` to each
  frontend, which refuses new requests with a 503 and lets those in flight
  finish for up to ``server.shutdown_timeout_s``, fails the rest and answers
  ``Drained`` (a second signal stops at once);
- an actor process exiting: logged with its name and exit code or signal; the
  frontends get ``PeerFailed`` so in-flight requests fail clearly; then a
  clean stop with exit code 1.

With ``server.api_server_count`` > 1 there are that many frontend processes
(``frontend``, ``frontend1`` ...) on the one port, each with its own rings
(``plan_actors``), and their Prometheus values in a folder of the run
(``plan_metrics``).

The media arena is made with the rings (``create_media_arena``). With
``parallel.tp`` > 1 the workers are one ``torch.distributed`` group: the
launcher picks a free loopback port for its rendezvous, records it in the
run directory (``rendezvous.json``) and hands it to every rank
(``plan_rendezvous``). A rank that dies is an actor exit like any other:
the others are stopped (killed if a collective holds them), so none waits
on its dead peer past the stop timeout.

Stopping: an actor still starting is killed (it serves nothing yet: a stop
need not wait for its model to load), ``Shutdown`` to every other live actor,
join with a timeout, kill the stragglers, unlink every segment and remove the
run directory. Child exits are
watched through their process sentinels on the asyncio loop: nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from actors.base import ActorSpec, frontend_name, run_actor_process
from mstar_actors import early_stop, messages, rundir
from mstar_actors.config import Config, server_url
from mstar_actors.model_info import ModelInfo
from mstar_actors.ring_sizes import ring_bytes

log = logging.getLogger("mstar_actors.launcher")

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
# How long a clean exit waits for a peer's error report (its cause), before it is reported itself.
REPORT_WAIT_S = 1.0
RENDEZVOUS_FILE = "rendezvous.json"  # the tensor-parallel group's address, in the run directory
DRAIN_MARGIN_S = 5.0  # past shutdown_timeout_s: the frontend fails what is left, then answers
# How long an idle OpenMP thread spins before it sleeps (GNU OpenMP's count; its own
# default is 300,000, about a millisecond here). Between CPU steps the conductor and
# frontend need a core: a worker whose idle threads held both of a 2-core VM's took
# their turns only at the scheduler's 4 ms ticks, and one request's tokens came 8 ms
# apart for a 4.4 ms step. 10,000 still bridges the gaps between a step's parallel
# regions (figures in docs/benchmarks.md, against llama.cpp). A user's own
# GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
OPENMP_SPIN_COUNT = "10000"


@dataclasses.dataclass
class ActorPlan:
    """One actor to spawn: its class and its channels as (ring name(s), union name)."""

    name: str
    target: str  # "module:Class"
    inbox: dict[str, tuple[Any, str]]
    outbox: dict[str, tuple[Any, str]]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


FRONTEND_TARGET = "actors.frontend:FrontendActor"


def plan_actors(num_ranks: int, num_frontends: int = 1) -> list[ActorPlan]:
    """The topology: which actor reads and writes which ring (by ring name).

    A ring name is ``<writer>.<reader>``; the conductor's broadcast is the list
    of its per-rank rings. Each of ``num_frontends`` (``server.api_server_count``)
    has its own pair of rings: to prepare, and from the conductor.
    """
    workers = [f"worker{r}" for r in range(num_ranks)]
    frontends = [frontend_name(i) for i in range(num_frontends)]
    plans = [
        *(ActorPlan(f, FRONTEND_TARGET,
                    inbox={"conductor": (f"conductor.{f}", "ConductorToFrontend")},
                    outbox={"prepare": (f"{f}.prepare", "FrontendToPrepare")},
                    params={"index": i}) for i, f in enumerate(frontends)),
        ActorPlan("prepare", "actors.prepare:PrepareActor",
                  inbox={f: (f"{f}.prepare", "FrontendToPrepare") for f in frontends},
                  outbox={"conductor": ("prepare.conductor", "PrepareToConductor")}),
        ActorPlan("conductor", "actors.conductor:ConductorActor",
                  inbox={"prepare": ("prepare.conductor", "PrepareToConductor")}
                  | {w: (f"{w}.conductor", "WorkerToConductor") for w in workers}
                  | {"adapter_reader": ("adapter_reader.conductor", "AdapterReaderToConductor")},
                  outbox={f: (f"conductor.{f}", "ConductorToFrontend") for f in frontends}
                  | {"workers": ([f"conductor.{w}" for w in workers], "ConductorToWorker"),
                     "adapter_reader": ("conductor.adapter_reader", "ConductorToAdapterReader")},
                  params={"num_ranks": num_ranks}),
        ActorPlan("adapter_reader", "actors.adapter_reader:AdapterReaderActor",
                  inbox={"conductor": ("conductor.adapter_reader", "ConductorToAdapterReader")},
                  outbox={"conductor": ("adapter_reader.conductor", "AdapterReaderToConductor")}),
    ]
    for rank, w in enumerate(workers):
        plans.append(ActorPlan(w, "actors.worker:WorkerActor",
                               inbox={"conductor": (f"conductor.{w}", "ConductorToWorker")},
                               outbox={"conductor": (f"{w}.conductor", "WorkerToConductor")},
                               params={"rank": rank}))
    for plan in plans:
        plan.inbox["control"] = (f"launcher.{plan.name}", "LauncherToActor")
        plan.outbox["control"] = (f"{plan.name}.launcher", "ActorToLauncher")
    return plans


class Rings:
    """Every ring of one run, by name; creates them and unlinks them all."""

    def __init__(self, run_id: str, run_dir: Path, config: Config, max_model_len: int):
        self.run_id = run_id
        self.run_dir = run_dir
        self.config = config
        self.max_model_len = max_model_len
        self.specs: dict[str, Any] = {}

    def create_all(self, plans: list[ActorPlan]) -> None:
        from transport import create_ring

        for plan in plans:
            for names, _ in [*plan.inbox.values(), *plan.outbox.values()]:
                for name in names if isinstance(names, list) else [names]:
                    if name in self.specs:
                        continue  # each ring appears at both of its ends
                    size = ring_bytes(name, self.config, self.max_model_len)
                    self.specs[name] = create_ring(self.run_dir, self.run_id, name, size)

    def resolve(self, channels: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
        """Ring names -> ring specs, as the child process opens them."""
        out = {}
        for key, (names, union) in channels.items():
            spec = [self.specs[n] for n in names] if isinstance(names, list) else self.specs[names]
            out[key] = (spec, union)
        return out

    def cleanup(self) -> list[str]:
        from transport import cleanup_run

        return cleanup_run(self.run_id, self.run_dir)


def openmp_spin_count(environ: Mapping[str, str]) -> str | None:
    """The actors' ``GOMP_SPINCOUNT`` (``OPENMP_SPIN_COUNT``), None where the user set OpenMP's waiting."""
    return None if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(environ) else OPENMP_SPIN_COUNT


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: left as it is) for the block,
    restored after: what a process started inside it inherits."""
    before = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is not None:
                os.environ[key] = value
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@contextlib.contextmanager
def dumps_held():
    """SIGUSR1 blocked in this thread while it starts actors: each child starts with it blocked (a mask
    survives the exec), so a stack dump asked before its dumper thread waits for one
    (``actors.base.run_actor_process``) waits, pending, where the signal's default action killed the
    actor, and with it the start."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Launcher:
    """Supervises one run. ``run()`` returns the process exit code."""

    def __init__(self, config: Config, info: ModelInfo | None, plans: list[ActorPlan] | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S):
        self.config = config
        self.info = info  # None: a launcher that only cleans up (it spawns nothing that needs it)
        self.plans = plans or plan_actors(config.parallel.tp, config.server.api_server_count)
        self.frontends = [plan.name for plan in self.plans if plan.target == FRONTEND_TARGET]
        self.ready_timeout_s = ready_timeout_s
        self.stop_signal = "that came while starting"  # the one that stops the server, for its log line
        self.run_id = rundir.new_run_id()
        for plan in self.plans:
            # The adapter reader's host copies and the prepare actor's clip slots are segments of this run.
            if plan.name in ("adapter_reader", "prepare"):
                plan.params["run_id"] = self.run_id
        self.run_dir: Path | None = None
        self.rings: Rings | None = None
        self.reaper: subprocess.Popen | None = None  # ``transport.reaper``: the run's cleanup if this process dies
        self.procs: dict[str, multiprocessing.Process] = {}
        self.to_actor: dict[str, Any] = {}
        self.from_actor: dict[str, Any] = {}
        self.ready: set[str] = set()
        self.addresses: dict[str, str] = {}  # where each actor serving clients listens (its ActorReady)
        self.exited: asyncio.Queue[str] = asyncio.Queue()
        self.drained = asyncio.Event()  # every frontend's Drained came
        self.drained_frontends: set[str] = set()
        self.stopping = False
        self.failures: dict[str, messages.ActorError] = {}  # the errors actors reported, first first
        self._failed = asyncio.Event()  # one was reported

    # ---- set-up -------------------------------------------------------------

    def prepare_run(self) -> None:
        from transport import cleanup_orphans, cleanup_stale, reaper, register_run

        root = rundir.runs_root()
        root.mkdir(parents=True, exist_ok=True)
        for run_id in cleanup_stale(root) + cleanup_orphans(rundir.run_is_dead):
            log.info("removed shared memory left by dead run %s", run_id)
        rundir.remove_dead_run_dirs(root)
        self.run_dir = rundir.create_run_dir(self.run_id, root)
        register_run(self.run_dir, self.run_id)
        self.reaper = reaper.start(self.run_id, self.run_dir)  # cleans up after a launcher that dies
        context = self.info.max_model_len if self.info is not None else 0  # (none: it spawns nothing)
        self.rings = Rings(self.run_id, self.run_dir, self.config, context)
        self.rings.create_all(self.plans)
        self.create_media_arena()
        self.plan_rendezvous()
        self.plan_metrics()

    def plan_metrics(self) -> None:
        """Several frontends answer /metrics for all of them from files in
        one folder of the run (``frontend.metrics``)."""
        if len(self.frontends) < 2:
            return
        folder = self.run_dir / "metrics"
        folder.mkdir()
        for plan in self.plans:
            if plan.name in self.frontends:
                plan.params["metrics_dir"] = str(folder)

    def plan_rendezvous(self) -> None:
        """Where the tensor-parallel ranks meet: a loopback port free now
        (rank 0's store binds it), recorded in the run directory."""
        import json

        from mstar_actors.runner.parallel import pick_loopback_port

        workers = [plan for plan in self.plans if plan.target == "actors.worker:WorkerActor"]
        if len(workers) < 2:
            return
        meet = {"host": "127.0.0.1", "port": pick_loopback_port(), "world_size": len(workers)}
        (self.run_dir / RENDEZVOUS_FILE).write_text(json.dumps(meet) + "\n")
        for plan in workers:
            plan.params["rendezvous"] = meet

    def create_media_arena(self) -> None:
        """One media tensor arena per run (``transport.arena_bytes``, sparse until
        used): prepare puts pixel values, each worker reads as reader ``rank``.
        Its segment is named under the run, so ``cleanup_run`` unlinks it at
        shutdown and ``cleanup_stale`` after a crash."""
        from transport import create_arena

        if not any(plan.name == "prepare" for plan in self.plans):
            return  # a test topology without the prepare actor
        spec = create_arena(self.run_dir, self.run_id, "media", self.config.transport.arena_bytes)
        for plan in self.plans:
            if plan.name == "prepare" or plan.target == "actors.worker:WorkerActor":
                # A plain dict: unpickling an ArenaSpec in the child would import
                # torch before the actor blocks SIGUSR1 (see actors.base).
                plan.params["arena_spec"] = msgspec.structs.asdict(spec)

    def open_control(self) -> None:
        from transport import open_ring

        for plan in self.plans:
            spec, union = self.rings.resolve({"c": plan.inbox["control"]})["c"]
            self.to_actor[plan.name] = open_ring(spec, role="writer", union=getattr(messages, union))
            spec, union = self.rings.resolve({"c": plan.outbox["control"]})["c"]
            self.from_actor[plan.name] = open_ring(spec, role="reader", union=getattr(messages, union))

    def spawn_all(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        info = msgspec.to_builtins(self.info) if self.info is not None else None
        with dumps_held():
            for plan in self.plans:
                spec = ActorSpec(name=plan.name, config=self.config, run_dir=str(self.run_dir),
                                 inbox=self.rings.resolve(plan.inbox), outbox=self.rings.resolve(plan.outbox),
                                 params=plan.params, log_level=level, info=info)
                proc = ctx.Process(target=run_actor_process, args=(plan.target, spec), name=plan.name)
                # prometheus_client reads its multiprocess folder as it is imported, and OpenMP its
                # settings as it loads: the child's environment has them.
                with _environment(PROMETHEUS_MULTIPROC_DIR=plan.params.get("metrics_dir"),
                                  GOMP_SPINCOUNT=openmp_spin_count(os.environ)):
                    proc.start()
                self.procs[plan.name] = proc
        rundir.write_actors(self.run_dir, self.run_id, {n: p.pid for n, p in self.procs.items()})

    def watch_exits(self) -> None:
        loop = asyncio.get_running_loop()
        for name, proc in self.procs.items():
            loop.add_reader(proc.sentinel, self._on_exit, name, proc.sentinel)

    def _on_exit(self, name: str, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        self.exited.put_nowait(name)

    # ---- supervision ----------------------------------------------------------

    async def run(self) -> int:
        try:
            self.prepare_run()  # (in the try: a start that fails half way releases what it made)
            self.open_control()
            self.spawn_all()
            self.watch_exits()
            return await self.supervise()
        finally:
            await self.stop_all()
            self.release()
            user = self._user_failure()
            if user is not None and not self.ready.issuperset(self.procs):  # the last line, as the CLI's refusals
                print(f"error: {user.message}", file=sys.stderr)

    async def supervise(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in early_stop.stop_signals():
            loop.add_signal_handler(sig, self._stop_on, sig, stop)
        if early_stop.requested():  # a signal while the run was made and the actors spawned
            stop.set()
        listeners = [asyncio.create_task(self.listen(n, ch)) for n, ch in self.from_actor.items()]
        try:
            if not await self.await_ready(stop):
                if stop.is_set() and not self._dead():
                    return 0
                return 1 if self._user_failure() is None else 2  # the operator's to mend: ``run`` ends with its line
            for name in self.frontends:
                await self.to_actor[name].send(messages.Started())
            host, port = self.config.server.host, self.config.server.port  # the bound port where it was 0
            url = next(iter(self.addresses.values()), None) or server_url(host, port)
            log.info("serving %s at %s (run dir %s)", self.info.served_name, url, self.run_dir)
            code = await self.await_end(stop)
            if code == 0:
                code = await self.drain(stop)
            return code
        finally:
            for task in listeners:
                task.cancel()

    async def listen(self, name: str, channel: Any) -> None:
        """Reads one actor's control channel: readiness and error reports."""
        from transport.errors import ChannelClosed

        while True:
            try:
                msg = await channel.recv()
            except ChannelClosed:
                return
            match msg:
                case messages.ActorReady(address=address):
                    self.ready.add(name)
                    if address:
                        self.addresses[name] = address
                    self._ready_changed.set()
                case messages.ActorError(message=message, traceback=tb):  # its own log has the traceback
                    log.error("actor %s failed: %s", name, message)
                    log.debug("actor %s's traceback:\n%s", name, tb)
                    self.failures.setdefault(name, msg)
                    self._failed.set()
                case messages.Drained(num_failed=num_failed):
                    log.info("%s drained (%d requests failed at the timeout)", name, num_failed)
                    self.drained_frontends.add(name)
                    if self.drained_frontends == set(self.frontends):
                        self.drained.set()

    def _user_failure(self) -> messages.ActorError | None:
        """The first failure an actor reported as the operator's to mend (a config key, the model folder)."""
        return next((f for f in self.failures.values() if f.user_error), None)

    def _dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if not p.is_alive()]

    async def await_ready(self, stop: asyncio.Event) -> bool:
        """True once every actor is ready; False on a stop, a death or the timeout."""
        self._ready_changed = asyncio.Event()
        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while len(self.ready) < len(self.procs):
            self._ready_changed.clear()
            waits = [asyncio.ensure_future(w) for w in (self._ready_changed.wait(), stop.wait(), self.exited.get())]
            remaining = deadline - asyncio.get_running_loop().time()
            done, pending = await asyncio.wait(waits, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if waits[2] in done:
                await self.report_death(waits[2].result(), starting=True)
                return False
            if stop.is_set():
                log.info("stopped while starting")
                return False
            if not done:
                missing = sorted(set(self.procs) - self.ready)
                log.error("not ready after %.0f s: %s (see their log lines above)", self.ready_timeout_s,
                          ", ".join(missing))
                return False
        return True

    def _stop_on(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        self.stop_signal = sig.name
        stop.set()

    async def await_end(self, stop: asyncio.Event) -> int:
        stop_task = asyncio.ensure_future(stop.wait())
        exit_task = asyncio.ensure_future(self.exited.get())
        done, _ = await asyncio.wait([stop_task, exit_task], return_when=asyncio.FIRST_COMPLETED)
        if exit_task in done:
            stop_task.cancel()
            await self.report_death(exit_task.result(), starting=False)
            return 1
        exit_task.cancel()
        log.info("stopping on signal %s", self.stop_signal)
        return 0

    async def drain(self, stop: asyncio.Event) -> int:
        """Graceful stop: the frontend refuses new requests and lets those in
        flight finish (``server.shutdown_timeout_s``); a second signal, an
        actor's death or a frontend that never answers cuts it short. The
        exit code: 1 where an actor died meanwhile."""
        timeout_s = self.config.server.shutdown_timeout_s
        stop.clear()  # a second signal stops at once
        log.info("draining: in-flight requests have %g s to finish (a second signal stops at once)", timeout_s)
        for name in self.frontends:
            await self.to_actor[name].send(messages.Drain(timeout_s=timeout_s, reason="the server is shutting down"))
        waits = [asyncio.ensure_future(w) for w in (self.drained.wait(), stop.wait(), self.exited.get())]
        done, pending = await asyncio.wait(waits, timeout=timeout_s + DRAIN_MARGIN_S,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if waits[2] in done:
            await self.report_death(waits[2].result(), starting=False)
            return 1
        if waits[1] in done:
            log.info("a second signal: stopping now")
        if not done:
            log.warning("the frontend(s) did not finish draining within %g s: stopping anyway",
                        timeout_s + DRAIN_MARGIN_S)
        return 0

    async def report_death(self, name: str, starting: bool) -> None:
        proc = self.procs[name]
        proc.join(timeout=1.0)  # its sentinel fired: the exit status is there
        how = exit_description(proc.exitcode)
        phase = "while starting" if starting else "while serving"
        if not self.failures and (proc.exitcode or 0) >= 0:  # an exit, not a signal: its report (or a peer's) is due
            try:
                await asyncio.wait_for(self._failed.wait(), REPORT_WAIT_S)
            except asyncio.TimeoutError:
                pass
        culprit = next(iter(self.failures), None)
        if culprit is not None and (culprit == name or proc.exitcode == 0):  # the reported failure is the cause
            if culprit != name:
                log.info("actor %s (pid %d) %s", name, proc.pid, how)
            log.error("actor %s failed %s: %s; shutting down", culprit, phase, self.failures[culprit].message)
        else:
            log.error("actor %s (pid %d) %s %s; shutting down", name, proc.pid, how, phase)
        for frontend in self.frontends:
            if frontend != name and self.procs[frontend].is_alive():
                try:
                    self.to_actor[frontend].send_nowait(messages.PeerFailed(actor=name, reason=how))
                except Exception as err:  # it may already be gone too
                    log.warning("could not tell %s: %s", frontend, err)

    # ---- stopping ---------------------------------------------------------------

    async def stop_all(self) -> None:
        self.stopping = True
        for name, proc in self.procs.items():
            if proc.is_alive() and name not in self.ready:  # still starting: no request to finish, nothing of its own
                log.info("actor %s (pid %d) is still starting: stopping it at once", name, proc.pid)
                proc.kill()
        for name, channel in self.to_actor.items():
            if name in self.procs and self.procs[name].is_alive():
                try:
                    channel.send_nowait(messages.Shutdown(reason="launcher stopping"))
                except Exception as err:  # full or gone: the kill below still stops it
                    log.debug("Shutdown to %s: %s", name, err)
        await self.join_all(STOP_TIMEOUT_S)
        for name, proc in self.procs.items():
            if proc.is_alive():
                log.warning("actor %s (pid %d) did not stop within %.0f s: killing it", name, proc.pid,
                            STOP_TIMEOUT_S)
                proc.kill()
        await self.join_all(STOP_TIMEOUT_S)

    async def join_all(self, timeout_s: float) -> None:
        """Wait until every child has exited (their sentinels), at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        waits = []
        for proc in self.procs.values():
            if proc.is_alive():
                done = loop.create_future()
                loop.add_reader(proc.sentinel, lambda f=done: f.done() or f.set_result(None))
                waits.append((proc, done))
        if waits:
            await asyncio.wait([f for _, f in waits], timeout=timeout_s)
        for proc, done in waits:
            loop.remove_reader(proc.sentinel)
            if done.done():  # its sentinel closed as it exits: reaped here, where it may become waitable a moment
                proc.join(1.0)  # after (it was then "alive", and was said not to have stopped within 10 s)

    def release(self) -> None:
        for channel in [*self.to_actor.values(), *self.from_actor.values()]:
            try:
                channel.close()
            except Exception as err:  # best effort: the segments are unlinked below anyway
                log.debug("closing %s: %s", getattr(channel, "name", "?"), err)
        if self.rings is not None:
            self.rings.cleanup()
        if self.run_dir is not None:
            rundir.remove_run_dir(self.run_dir)
        if self.reaper is not None:
            from transport import reaper

            reaper.release(self.reaper)
            self.reaper = None


DEMO_ADAPTERS = "~/.cache/mstar-actors/adapters"  # where tools/make_demo_adapters.py writes pirate/ and shout/


def validate_adapters(config: Config, info: ModelInfo) -> None:
    """Read and validate every configured adapter against the base model, before
    anything is spawned. Raises AdapterError naming the first bad one and why."""
    from mstar_actors.lora import AdapterError, read_adapter
    from mstar_actors.models.loader import stored_weight

    for folder in config.lora.adapter_dirs if config.lora.allow_runtime_updates else ():
        if not Path(folder).is_dir():  # a load from it is refused, naming it; say so now too
            log.warning("lora.adapter_dirs: %s is not a folder (yet); runtime loads from it fail until it is", folder)
    if not config.lora.adapters:
        return
    check_adapter_names(config, info)
    if info.lora_base is None:  # one line (exit 2), not a traceback
        raise AdapterError(f"lora.adapters: the base model {config.model.path} takes no adapters: {info.lora_refusal}")
    for name, path in config.lora.adapters.items():
        try:
            read_adapter(path, base=info.lora_base, max_rank=config.lora.max_lora_rank, name=name,
                         base_weights=functools.partial(stored_weight, info.model_dir))
        except AdapterError as err:
            folder = Path(path)  # (``~`` expanded at parse)
            demo = folder.parent == Path(DEMO_ADAPTERS).expanduser() and not folder.exists()
            hint = "; the demo adapters are made once by python tools/make_demo_adapters.py" if demo else ""
            raise AdapterError(f"lora.adapters.{name} ({path}): {err}{hint}".replace("\n", " ")) from None


def check_adapter_names(config: Config, info: ModelInfo) -> None:
    """Configured adapter names follow the runtime loads' rule (raises AdapterError)."""
    from mstar_actors.lora import AdapterError
    from mstar_actors.lora.names import name_problem

    for name in config.lora.adapters:
        problem = name_problem(name, info.served_name)
        if problem:
            raise AdapterError(f"lora.adapters: {problem}")


def port_problem(host: str, port: int) -> str | None:
    """Why the frontend could not listen on ``host:port`` (taken, or not this
    host's address), found before any actor loads the model; None when it can.
    A plain bind: a port another server holds with SO_REUSEPORT is taken too."""
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"server.host {host!r} is not an address of this host ({err}); use 127.0.0.1, 0.0.0.0 or a local name"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is free
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    return (f"cannot listen on {host}:{port} ({err.strerror}): server.host {host!r} is not an "
                            "address of this host; use 127.0.0.1, 0.0.0.0 or one of its own (server.host, --host)")
                return (f"cannot listen on {host}:{port} ({err.strerror}); stop what holds the port or choose "
                        f"another (server.port, --port)")
    return None


def serve(config: Config, info: ModelInfo) -> int:
    """Run the server until a signal or an actor's death; the exit code
    (2: a configured adapter can't be served, ``parallel.tp`` does not split
    the model, the grammar engine is missing or broken, or the port can't be
    listened on, or an actor found a config key or the model folder it
    cannot start with; one line on stderr says which)."""
    import uvloop

    from mstar_actors.lora import AdapterError
    from mstar_actors.runner.grammar import GrammarEngineError, check_engine

    try:
        check_engine()  # the host's install first: it needs no model
    except GrammarEngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if info.tp_refusal:
        print(f"error: {info.tp_refusal}", file=sys.stderr)
        return 2
    try:
        validate_adapters(config, info)
    except AdapterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if (problem := port_problem(config.server.host, config.server.port)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if early_stop.requested():
        log.info("stopped while starting")
        return 0
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(Launcher(config, info).run())
