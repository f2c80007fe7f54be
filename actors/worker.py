"""The worker actor: one process per tensor-parallel rank; executes plans in order.

It owns the device state (through ``ModelRunner``) and decides nothing another
rank would have to agree with: it reports local facts (``WorkerReady``) and
the result of each step (``StepDone`` / ``StepFailed``).

With ``parallel.tp = N`` the N workers are the ranks of one
``torch.distributed`` group (``runner.parallel``), joined at start through
the rendezvous the launcher picked and left at stop. Each loads its shard
of the model; the forward's collectives are the only traffic between ranks,
and every plan and install still comes from the conductor over the rings.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import threading
import time
from typing import Any

from actors.base import Actor
from mstar_actors.messages import (AdapterInstalled, CancelCompile, CompileGrammar, GrammarCompiled, InstallAdapter,
                                   StepDone, StepFailed, StepPlan)
from mstar_actors.runner.parallel import CollectiveError
from transport.shm import attach_segment

# Grammars a rank compiles at once beside its steps for requests waiting on them (the conductor sends one a
# constrained request), at least, and its compile threads past those: a compile whose request ended or ran out
# of time (``scheduler.grammar_compile_timeout_s``) runs out on its thread, which can't be stopped, without its
# slot. A host of more cores compiles more at once (``compiles_at_once``), so a few slow schemas hold fewer others.
MAX_COMPILES = 2
MAX_COMPILE_THREADS = 4
MOST_COMPILES = 8
COMPILE_THREAD_WAIT_S = 1.0  # past this with no thread free, the request is a 503 (busy), not a wait for minutes
TRIM_AFTER_COMPILE_S = 1.0  # a compile that long made enough garbage to hand back (``_compile_below_steps``)
COMPILE_NICENESS = 10  # a compile's thread yields the CPU to the step's threads (a CPU rank has few cores)


def compiles_at_once(num_cpus: int, num_ranks: int) -> int:
    """A rank's grammar compiles at once: a quarter of its share of the cores (a step's threads keep the rest),
    ``MAX_COMPILES`` at least, ``MOST_COMPILES`` at most."""
    return max(MAX_COMPILES, min(MOST_COMPILES, num_cpus // (4 * num_ranks)))


def _compile_below_steps(compiler: Any, spec: Any) -> Any:
    """``compiler.compile(spec)`` on this thread at a lower priority than the
    steps' (Linux schedules threads by their own niceness; elsewhere as is).
    A long compile's working memory (hundreds of MB for a long choice list)
    goes back to the system after it: glibc keeps freed pages mapped until
    trimmed (the rank's resident memory stayed 1.5 GB up after a few)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    started = time.perf_counter()
    try:
        return compiler.compile(spec)
    finally:
        if time.perf_counter() - started >= TRIM_AFTER_COMPILE_S:
            _trim_heap()


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: freed heap pages back to the system (a no-op elsewhere)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def install_from_host(runner: Any, rank: int, msg: InstallAdapter) -> AdapterInstalled:
    """Install the adapter-reader's host copy named by ``msg`` into ``msg.slot``.

    The segment is the reader's: it is mapped for the install and read in
    place (the copy goes straight into the device staging), then unmapped,
    so ``runner.install_adapter`` must copy the weights before it returns
    and keep no reference to them (``ModelRunner``'s does: its stacks are
    device tensors); no process's exit unlinks it (the run's cleanup does).
    Any failure (missing segment, torn blob, digest
    mismatch, a module this model has no stack for) is an ``ok=False``
    answer with the reason; the conductor then refuses the adapter on every
    rank.
    """
    try:
        if runner.reinstall_adapter(msg.slot, msg.name, msg.digest):  # this rank kept its image
            error = None
        else:
            with _mapped_segment(msg.host.segment, msg.host.nbytes) as blob:
                error = _install_blob(runner, msg, blob)  # its frame, and the views of the segment, are gone after
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    if error is not None:
        error = f"rank {rank}: adapter {msg.name!r} into slot {msg.slot}: {error}"
    return installed(runner, rank, msg, error)


def installed(runner: Any, rank: int, msg: InstallAdapter, error: str | None = None) -> AdapterInstalled:
    """The answer to ``msg``: ok unless ``error``, with the images the rank keeps now."""
    return AdapterInstalled(rank=rank, slot=msg.slot, digest=msg.digest, ok=error is None, error=error or "",
                            kept=runner.kept_adapters())


def _install_blob(runner: Any, msg: InstallAdapter, blob: memoryview) -> str | None:
    """The install from a mapped blob; the failure's reason, or None. Returns
    rather than raises, so no traceback keeps the blob's views alive."""
    from mstar_actors.lora.host_copy import adapter_from_bytes

    try:
        weights = adapter_from_bytes(blob, copy=False)
        if weights.digest != msg.digest:
            raise ValueError(f"host copy holds digest {weights.digest}, the install names {msg.digest}")
        runner.install_adapter(msg.slot, weights)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def _mapped_segment(name: str, nbytes: int):
    """The first ``nbytes`` of shared memory segment ``name``, mapped while the
    block runs (``transport.shm``'s attach: no resource tracker, which ranks
    attaching one segment at once would confuse)."""
    segment = attach_segment(name)
    try:
        if nbytes > segment.size:
            raise ValueError(f"shared memory segment {name!r} has {segment.size} bytes, the install names {nbytes}")
        blob = segment.buf[:nbytes]
        try:
            yield blob
        finally:
            blob.release()
    finally:
        segment.close()


class WorkerActor(Actor):
    """inbox: ``conductor`` (ConductorToWorker), ``control``; outbox: ``conductor``, ``control``.

    Plans run inline on the loop, in order: the rank has nothing else to do
    meanwhile, and a control message waiting behind a step is fine (a stack
    dump does not need the loop).

    Overlapped steps: a plan is enqueued on the device (``runner.forward``,
    then ``runner.sample``) and answered once its tokens reach the host
    (``runner.collect``). While the device runs step N, the loop waits for
    whichever comes first, step N's tokens or the next plan (the conductor
    plans one step ahead, or two with ``scheduler.steps_ahead: 2``, so it is
    usually waiting already): the next plan's forward is then enqueued behind
    step N, reading N's tokens on the device, before N is collected and
    answered. One step ahead, the device idles only where the answer's trip,
    the conductor's turn and this forward outlast a step; two ahead, where
    the forward alone does, or the conductor's whole turn (no depth helps
    then). On a CPU a step is done when it returns, and each is answered at
    once. The wait for the device is a thread (``_device_waits``) that
    blocks on the step's event and wakes the loop: no polling.

    Installs run beside the steps, one at a time in arrival order, on a
    thread (``_install_loop``): reading the host copy and staging it is tens
    of milliseconds of host work, and every running row would otherwise
    stall for it. That is safe because of the agreement: the conductor
    installs only into a slot no running row uses, and sends rows on it only
    after every rank acknowledged (but see ``rows_follow`` below); this rank
    acknowledges once the copy is done (on CUDA the copies are on the steps'
    stream, so a later step is ordered after them). A step sent before the
    install never sees the new weights, one sent after the acknowledgement
    always does.

    A swap back in (this rank kept the adapter's pinned image: adapter
    churn) is only the copies, a few ms; it runs inline, between steps, when
    no install is on the thread: beside a decoding step loop the same copies
    took over ten times as long on the thread (``tools/profile_gpu_step.py``),
    which kept the slot out of service that long. Every
    answer names the images this rank keeps (``AdapterInstalled.kept``), so
    the conductor knows which installs will be swaps: those it sends with
    ``rows_follow``, planning the slot's rows without waiting for the
    acknowledgement; such an install always finishes before the next message
    is read (should the swap fail, from the host copy, stalling the steps),
    and should it fail outright the slot still takes the rows planned on it,
    on zeros (``void_slot``): every rank runs the same batch, and the
    conductor fails those rows before it uses their results.
    """

    def __init__(self, *, rank: int = 0, runner: Any = None, arena_spec: Any = None,
                 rendezvous: dict | None = None, **kw: Any):
        super().__init__(**kw)
        self.rank = rank
        self.runner = runner  # tests may inject one; otherwise built in start()
        self.rendezvous = rendezvous  # where the tensor-parallel ranks meet (the launcher's pick); None: one rank
        self.tp: Any = None  # the rank's TensorParallel once joined
        self.arena_spec = arena_spec  # the media arena, read as consumer ``rank``
        self.media: Any = None  # MediaCopies when there is an arena (see mstar_actors.runner.media_copies)
        # Bounded by the protocol: at most one install per slot is ever outstanding.
        self.installs: asyncio.Queue[InstallAdapter] = asyncio.Queue(maxsize=max(1, self.config.lora.max_loras))
        self.num_installing = 0  # queued for the install thread or on it
        # Grammars compiling beside the steps (``CompileGrammar``), a few at a time: a thread and its memory each.
        self._compiles: dict[str, asyncio.Task] = {}  # by request id
        compiles = compiles_at_once(len(os.sched_getaffinity(0)), self.config.parallel.tp)
        self._compile_slots = asyncio.Semaphore(compiles)
        # released as a thread ends
        self._compile_threads = asyncio.Semaphore(compiles + MAX_COMPILE_THREADS - MAX_COMPILES)
        self.pending: _Pending | None = None  # the step sampled on the device, not yet answered
        self._next: asyncio.Future | None = None  # a mailbox read begun while a step ran (its result is the next message)
        self._device_waits: queue.SimpleQueue | None = None  # (step, future) for the waiting thread

    async def start(self) -> None:
        if self.arena_spec is not None:
            from mstar_actors.runner.media_copies import MediaCopies
            from transport.arena import ArenaSpec, TensorArena

            spec = ArenaSpec(**self.arena_spec) if isinstance(self.arena_spec, dict) else self.arena_spec
            self.media = MediaCopies(TensorArena(spec, "consumer", reader_index=self.rank))
        if self.runner is None:
            self.set_torch_threads()
            from mstar_actors.runner.build import build_runner

            self.tp = await self.join_group()
            resolve = self.media.resolve if self.media is not None else None
            self.runner = await self.run_blocking(functools.partial(build_runner, tp=self.tp), self.config, self.info,
                                                  resolve)
            from mstar_actors.runner.grammar import load_matchers

            matchers = functools.partial(load_matchers, self.info, self.runner.device, self.config.scheduler.max_num_seqs)
            self.runner.enable_grammars(await self.run_blocking(matchers))
        await self.outbox["conductor"].send(self.runner.ready_info(self.rank))

    async def join_group(self) -> Any:
        """This rank's place in the tensor-parallel group (blocks until every rank joined)."""
        from mstar_actors.runner.device import resolve_device, use_device
        from mstar_actors.runner.parallel import SINGLE_RANK, Rendezvous, init_tensor_parallel, rank_device

        if not self.rendezvous or self.rendezvous["world_size"] == 1:
            return SINGLE_RANK
        meet = Rendezvous(**self.rendezvous)
        device = rank_device(resolve_device(self.config.model.device), self.rank, meet.world_size)
        use_device(device)  # the loop's thread runs the steps: its current device is the rank's
        tp = await self.run_blocking(init_tensor_parallel, self.rank, meet, device)
        self.log.info("joined the tensor-parallel group at %s as rank %d of %d (%s)", meet.init_method, tp.rank,
                      tp.world_size, tp.backend)
        return tp

    async def stop(self) -> None:
        if self.tp is not None:
            from mstar_actors.runner.parallel import destroy_tensor_parallel

            destroy_tensor_parallel(self.tp)

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        """Blocking work (loading, installs) in a thread of its own that ends
        with the call, not the loop's executor. Why: OpenMP keeps a team of
        helper threads per thread that ran a parallel region, for as long as
        that thread lives; a kept executor thread's idle team makes the step
        thread's parallel regions wait (``tools/profile_step.py`` against the
        served step shows it)."""
        return await self.start_blocking(fn, *args)

    def start_blocking(self, fn: Any, *args: Any) -> asyncio.Future:
        """``fn(*args)`` begun on a thread of its own (``run_blocking``'s); its future."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def run() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as err:  # handed to the awaiting task, raised there
                result, error = None, err
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (a compile left to run out)
                loop.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=run, name=f"{self.name}:blocking", daemon=True).start()
        return done

    def set_torch_threads(self) -> None:
        """On the loop's thread, which runs every step: OpenMP's thread count
        is per calling thread, so setting it inside run_blocking would not stick."""
        import torch

        num_threads = self.config.parallel.worker_torch_threads or 1  # settled at parse (``with_device_defaults``)
        torch.set_num_threads(num_threads)
        self.log.info("torch intra-op threads: %d", num_threads)

    async def serve(self) -> None:
        installer = asyncio.create_task(self._install_loop(), name="worker:installs")
        try:
            while True:
                if self.pending is not None and self.pending.step.ready():
                    await self._answer_pending()
                    continue
                item = self._waiting_message()
                if item is None:
                    item = await self._next_message()
                if item is not None:  # None: the pending step's tokens arrived first
                    await self.dispatch(*item)
        finally:
            installer.cancel()
            if self._device_waits is not None:
                self._device_waits.put(None)

    def _waiting_message(self) -> tuple[str, Any] | None:
        """The next message if it has arrived (the read begun earlier first: order is kept)."""
        if self._next is None:
            return self.mailbox.get_nowait()
        if not self._next.done():
            return None
        item, self._next = self._next.result(), None
        return item

    async def _next_message(self) -> tuple[str, Any] | None:
        """Wait for the next message; with a step on the device, None if its tokens reach the host first."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.mailbox.get())
        if self.pending is not None:
            await asyncio.wait({self._next, self._device_done(self.pending)}, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.wait({self._next})
        return self._waiting_message()

    def _device_done(self, pending: _Pending) -> asyncio.Future:
        """A future set once ``pending``'s tokens are on the host (one wait per step, on the waiting thread)."""
        if pending.done is None:
            if self._device_waits is None:
                self._device_waits = queue.SimpleQueue()
                threading.Thread(target=_wait_for_devices, args=(self._device_waits, asyncio.get_running_loop()),
                                 name=f"{self.name}:device-waits", daemon=True).start()
            pending.done = asyncio.get_running_loop().create_future()
            self._device_waits.put((pending.step, pending.done))
        return pending.done

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case StepPlan():
                await self.run_step(msg)
            case CompileGrammar():
                task = asyncio.create_task(self._compile(msg), name=f"worker:grammar:{msg.request_id}")
                self._compiles[msg.request_id] = task
                task.add_done_callback(lambda _, rid=msg.request_id: self._compiles.pop(rid, None))
            case CancelCompile(request_id=request_id):
                task = self._compiles.get(request_id)
                if task is not None:  # its slot goes to the next (a compile begun runs out on its thread)
                    task.cancel()
            case InstallAdapter():
                if self.num_installing == 0 and self._swap_in(msg):
                    return await self.reply(installed(self.runner, self.rank, msg))
                if msg.rows_follow:  # the next plan may read the slot: install it before reading on
                    if self.num_installing:
                        raise RuntimeError(
                            f"rank {self.rank}: install of {msg.name!r} into slot {msg.slot} with its rows following "
                            f"while {self.num_installing} install(s) are outstanding: the conductor sends those only "
                            "with none in flight")
                    self.log.warning("rank %d: %r is not kept for a swap into slot %d; installing it from its host "
                                     "copy before the next step", self.rank, msg.name, msg.slot)
                    reply = await self.run_blocking(self.install, msg)
                    if not reply.ok:  # the rows planned behind it still run here, on zeros, as on every rank
                        self.runner.void_slot(msg.slot, msg.name)
                    return await self.reply(reply)
                try:
                    self.installs.put_nowait(msg)
                    self.num_installing += 1
                except asyncio.QueueFull:
                    raise RuntimeError(
                        f"rank {self.rank}: install of {msg.name!r} into slot {msg.slot} while "
                        f"{self.installs.qsize()} installs are outstanding, more than the {self.config.lora.max_loras} "
                        "slots: the conductor broke the one-install-per-slot rule"
                    ) from None
            case _:
                return self.unknown(channel, msg)

    async def reply(self, msg: Any) -> None:
        out = self.outbox["conductor"]
        await out.send(msg)
        # The next queued message may run synchronously (a step) without
        # yielding to the loop: publish this reply before it starts.
        out.flush()

    async def _compile(self, msg: CompileGrammar) -> None:
        """The request's grammar compiled on a thread (the engine lets go of
        the GIL: the steps go on), kept in the engine's cache for the
        request's start; then the answer: a refusal where it is not compiled
        within ``scheduler.grammar_compile_timeout_s`` (the thread runs out
        without the slot, so one slow grammar holds no other request's)."""
        from mstar_actors.runner.grammar import GrammarError

        grammars = getattr(self.runner, "grammars", None)
        timeout_s = self.config.scheduler.grammar_compile_timeout_s
        async with self._compile_slots:
            started = time.perf_counter()
            try:
                if grammars is None:
                    raise GrammarError(msg.spec.kind, "structured outputs are off on this rank")
                try:  # every thread held by compiles whose requests ended or timed out: none is free soon
                    await asyncio.wait_for(self._compile_threads.acquire(), COMPILE_THREAD_WAIT_S)
                except TimeoutError:
                    await self.reply(GrammarCompiled(rank=self.rank, request_id=msg.request_id, ok=False, busy=True,
                                                     error=f"every grammar compile thread of rank {self.rank} is "
                                                           "running grammars whose requests ended or ran out of "
                                                           "time; retry shortly"))
                    return
                future = self.start_blocking(_compile_below_steps, grammars.compiler, msg.spec)
                future.add_done_callback(self._compile_ended)
                await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except GrammarError as err:
                reply = GrammarCompiled(rank=self.rank, request_id=msg.request_id, ok=False, error=str(err))
            except TimeoutError:
                reply = GrammarCompiled(rank=self.rank, request_id=msg.request_id, ok=False, error=(
                    f"not compiled within {timeout_s:g} s (scheduler.grammar_compile_timeout_s): the grammar is too "
                    "costly to build over this vocabulary (a long pattern of nested repeats, a choice of very long "
                    "strings); simplify it"))
            else:
                reply = GrammarCompiled(rank=self.rank, request_id=msg.request_id, ok=True)
        self.log.debug("grammar of %s: %.1f ms", msg.request_id, (time.perf_counter() - started) * 1e3)
        await self.reply(reply)

    def _compile_ended(self, future: asyncio.Future) -> None:
        self._compile_threads.release()
        if not future.cancelled():
            future.exception()  # retrieved: a compile left to run out has nobody to refuse

    def _swap_in(self, msg: InstallAdapter) -> bool:
        """Install ``msg`` inline from the image this rank kept; False when it
        kept none or the copy failed (then the install thread reads the host copy)."""
        started = time.perf_counter()
        try:
            if not self.runner.reinstall_adapter(msg.slot, msg.name, msg.digest):
                return False
        except Exception:
            self.log.exception("rank %d: swapping %r back into slot %d failed; installing from its host copy",
                               self.rank, msg.name, msg.slot)
            return False
        self.log.debug("swap of %r back into slot %d: %.1f ms", msg.name, msg.slot, (time.perf_counter() - started) * 1e3)
        return True

    async def _install_loop(self) -> None:
        while True:
            msg = await self.installs.get()
            started = time.perf_counter()
            try:
                reply = await self.run_blocking(self.install, msg)
            finally:
                self.num_installing -= 1
            self.log.debug("install of %r into slot %d: %.1f ms", msg.name, msg.slot, (time.perf_counter() - started) * 1e3)
            await self.reply(reply)

    def install(self, msg: InstallAdapter) -> AdapterInstalled:
        """On the install thread: the host copy into the slot, then wait for the device copies."""
        from mstar_actors.runner.device import use_device

        use_device(self.runner.device)  # a thread's current device is its own: the rank's
        reply = install_from_host(self.runner, self.rank, msg)
        if not reply.ok:
            self.log.warning("%s", reply.error)
        return reply

    async def run_step(self, plan: StepPlan) -> None:
        """Enqueue ``plan``'s step behind the pending one, answer that one, then
        sample this one (its sampling reads the outputs the answer appended)."""
        start = time.perf_counter()
        try:
            if self.media is not None:  # the plan's media orders: copies out of the arena, releases
                self.media.apply(plan)
            step, failed = self.runner.forward(plan), None
        except CollectiveError:  # the group is broken: this rank exits, which stops the server
            raise
        except Exception as err:  # the step fails; the rank keeps serving
            step, failed = None, self._failed(plan, err)
        for install in plan.install_after:  # behind this step's kernels; acknowledged before the step ahead
            await self.handle("conductor", install)
        if self.pending is not None:
            await self._answer_pending()
        if failed is None:
            try:
                self.runner.sample(step)
                self.pending = _Pending(plan, step, start)
                return
            except Exception as err:
                failed = self._failed(plan, err)
        await self.reply(failed)

    async def _answer_pending(self) -> None:
        pending, self.pending = self.pending, None
        plan = pending.plan
        try:
            sampled = self.runner.collect(pending.step)
        except Exception as err:
            return await self.reply(self._failed(plan, err))
        elapsed = time.perf_counter() - pending.start
        self.log.debug("step %d: %d rows, %d tokens, %d new, %.1f ms", plan.step_id, len(plan.scheduled),
                       sum(c.num_tokens for c in plan.scheduled), len(plan.started), elapsed * 1e3)
        await self.reply(StepDone(step_id=plan.step_id, rank=self.rank, sampled=sampled, elapsed_s=elapsed))

    def _failed(self, plan: StepPlan, err: Exception) -> StepFailed:
        """The step fails; the rank keeps serving. A PlanError names the rows
        at fault; anything else fails the whole step."""
        self.log.error("step %d failed on rank %d", plan.step_id, self.rank, exc_info=err)
        message = f"rank {self.rank}, step {plan.step_id}: {type(err).__name__}: {err}"
        return StepFailed(step_id=plan.step_id, rank=self.rank, message=message,
                          request_ids=list(getattr(err, "request_ids", ())))


class _Pending:
    """A step on the device: its plan, the runner's ``Step``, when it began,
    and the future the waiting thread sets (None until a wait was asked)."""

    def __init__(self, plan: StepPlan, step: Any, start: float):
        self.plan, self.step, self.start = plan, step, start
        self.done: asyncio.Future | None = None


def _wait_for_devices(jobs: queue.SimpleQueue, loop: asyncio.AbstractEventLoop) -> None:
    """The waiting thread: block on each step until its tokens are on the host,
    then wake the loop (blocking releases the interpreter lock); None ends it."""
    while (job := jobs.get()) is not None:
        step, done = job
        try:
            step.wait()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, done)


def _settle(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
