"""The worker installs adapters beside its steps: a slow install stalls no step.

A fake runner stands in for ``ModelRunner`` (steps answer at once, an
install waits for the test's go), over in-memory channels, no model."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from multiprocessing import resource_tracker

import msgspec
import torch

from actors.worker import WorkerActor, _mapped_segment
from mstar_actors.config import Config, LoraConfig, ModelConfig
from mstar_actors.lora.adapter_file import AdapterWeights, LoraModule
from mstar_actors.lora.host_copy import adapter_to_bytes
from mstar_actors.messages import (
    AdapterHostRef,
    AdapterInstalled,
    ConductorToWorker,
    InstallAdapter,
    Shutdown,
    StepDone,
    StepPlan,
    WorkerReady,
    WorkerToConductor,
)
from transport import shm as segments
from transport.memory import MemoryChannel


class DoneStep:
    """A step whose tokens are on the host when it is made (a CPU step's)."""

    def ready(self):
        return True

    def wait(self):
        pass


class SlowInstallRunner:
    """Steps return no tokens at once; ``install_adapter`` blocks (on the install thread) until ``go`` is set."""

    device = torch.device("cpu")

    def __init__(self):
        self.go = threading.Event()
        self.installed: list[tuple[int, str]] = []
        self.voided: list[tuple[int, str]] = []
        self.refuse = False  # install_adapter raises
        self.steps = 0

    def ready_info(self, rank):
        return WorkerReady(rank=rank, num_kv_blocks=8)

    def forward(self, plan):
        self.steps += 1
        return DoneStep()

    def sample(self, step):
        pass

    def collect(self, step):
        return []

    def reinstall_adapter(self, slot, name, digest):
        return False  # keeps no images: every install reads the host copy

    def kept_adapters(self):
        return []

    def void_slot(self, slot, name):
        self.voided.append((slot, name))

    def install_adapter(self, slot, weights):
        if self.refuse:
            raise ValueError(f"scripted refusal of {weights.name!r}")
        if not self.go.wait(10):
            raise TimeoutError("the test never let the install finish")
        self.installed.append((slot, weights.name))


_COPIES = itertools.count()


def _host_copy(name: str) -> tuple[str, InstallAdapter]:
    """The adapter's host copy in a segment of its own, as the adapter-reader writes it."""
    module = LoraModule(torch.ones(2, 4), torch.ones(3, 2), 1.0)
    weights = AdapterWeights(name=name, digest=f"digest-{name}", max_rank=2,
                             layers=({"self_attn.q_proj": module},), global_modules={})
    blob = adapter_to_bytes(weights)
    segment_name = segments.segment_name(f"t{os.getpid()}", f"adapter{next(_COPIES)}")
    segment = segments.create_segment(segment_name, len(blob))
    segment.buf[: len(blob)] = blob
    segment.close()
    ref = AdapterHostRef(segment=segment_name, nbytes=len(blob))
    return segment_name, InstallAdapter(slot=1, name=name, digest=weights.digest, host=ref)


def _free(*names: str) -> None:
    for name in names:
        segments.unlink_segment(name)


def test_an_install_maps_its_host_copy_without_the_resource_tracker(monkeypatch):
    """The ranks attach one segment at once: a tracker's register / unregister
    per rank printed KeyError tracebacks (its names are a set shared by the
    spawned processes); the segment is the run's, no process's."""
    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda *args: calls.append(args))
    monkeypatch.setattr(resource_tracker, "unregister", lambda *args: calls.append(args))
    name, install = _host_copy("a")
    try:
        with _mapped_segment(name, install.host.nbytes) as blob:
            assert len(blob) == install.host.nbytes
        assert not calls
    finally:
        _free(name)


async def _start(runner):
    """A worker with 2 LoRA slots over in-memory channels, past its ready info: (inbox, outbox, task)."""
    config = Config(model=ModelConfig(path="unused"), lora=LoraConfig(max_loras=2))
    inbox = MemoryChannel(ConductorToWorker, "conductor.worker0")
    outbox = MemoryChannel(WorkerToConductor, "worker0.conductor")
    worker = WorkerActor(name="worker0", rank=0, runner=runner, inbox={"conductor": inbox},
                         outbox={"conductor": outbox}, config=config)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(outbox.recv(), 10)
    return inbox, outbox, task


def _serve(runner, script, *shms: str) -> None:
    """``script`` against a worker on ``runner``, then the host copies freed."""
    try:
        asyncio.run(_run(runner, script))
    finally:
        _free(*shms)


async def _run(runner, script):
    inbox, outbox, task = await _start(runner)
    try:
        await script(inbox, outbox)
    finally:
        await inbox.send(Shutdown(reason="test over"))
        assert await asyncio.wait_for(task, 10) == 0


def test_steps_run_while_an_install_is_in_flight():
    runner = SlowInstallRunner()
    shm, install = _host_copy("a")

    async def script(inbox, outbox):
        await inbox.send(install)
        for step_id in (1, 2, 3):  # each answered while the install still waits
            await inbox.send(StepPlan(step_id=step_id, started=[], scheduled=[]))
            reply = await asyncio.wait_for(outbox.recv(), 10)
            assert isinstance(reply, StepDone) and reply.step_id == step_id
        assert runner.installed == []
        runner.go.set()
        reply = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(reply, AdapterInstalled) and reply.ok, reply
        assert (reply.slot, reply.digest) == (1, install.digest)
        assert runner.installed == [(1, "a")]

    _serve(runner, script, shm)


def test_an_install_its_rows_follow_finishes_before_the_next_plan_even_from_the_host_copy():
    """``rows_follow``: the conductor planned the slot's rows right behind
    the install, expecting a swap. This rank kept no image, so it installs
    from the host copy there and then: the next plan waits for it, and the
    answer (naming what the rank keeps) comes before the step's."""
    runner = SlowInstallRunner()
    shm, install = _host_copy("a")
    install = msgspec.structs.replace(install, rows_follow=True)

    async def script(inbox, outbox):
        await inbox.send(install)
        await inbox.send(StepPlan(step_id=1, started=[], scheduled=[]))
        await asyncio.sleep(0.3)  # the install waits for go
        assert runner.steps == 0, "the step ran before the install it follows"
        runner.go.set()
        first = await asyncio.wait_for(outbox.recv(), 10)
        second = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(first, AdapterInstalled) and first.ok and first.kept == [], first
        assert isinstance(second, StepDone) and second.step_id == 1
        assert runner.installed == [(1, "a")]

    _serve(runner, script, shm)


def test_a_failed_install_its_rows_follow_leaves_the_slot_taking_them_on_zeros():
    """Its rows are in the next plan on every rank: this rank voids the slot
    (zeros that still take rows) rather than refuse that plan, or it would
    fall out of step with the ranks whose install went well."""
    runner = SlowInstallRunner()
    runner.refuse = True
    shm, install = _host_copy("a")
    install = msgspec.structs.replace(install, rows_follow=True)

    async def script(inbox, outbox):
        await inbox.send(install)
        reply = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(reply, AdapterInstalled) and not reply.ok and "scripted refusal" in reply.error, reply
        assert runner.voided == [(1, "a")]

    _serve(runner, script, shm)


def test_installs_complete_in_arrival_order_and_failures_are_answered():
    runner = SlowInstallRunner()
    runner.go.set()
    shm_a, install_a = _host_copy("a")
    shm_b, install_b = _host_copy("b")
    install_b = InstallAdapter(slot=2, name="b", digest=install_b.digest, host=install_b.host)
    gone = InstallAdapter(slot=2, name="c", digest="d", host=AdapterHostRef(segment="no-such-segment", nbytes=8))

    async def script(inbox, outbox):
        for msg in (install_a, install_b):
            await inbox.send(msg)
        replies = [await asyncio.wait_for(outbox.recv(), 10) for _ in range(2)]
        await inbox.send(gone)  # slot 2 again: only once its last install was answered
        replies.append(await asyncio.wait_for(outbox.recv(), 10))
        assert [(r.slot, r.ok) for r in replies] == [(1, True), (2, True), (2, False)]
        assert "no-such-segment" in replies[2].error and "'c'" in replies[2].error
        assert runner.installed == [(1, "a"), (2, "b")]

    _serve(runner, script, shm_a, shm_b)


def test_more_installs_than_slots_is_a_protocol_error():
    runner = SlowInstallRunner()  # never finishes: the queue fills
    shms, msgs = zip(*[_host_copy(n) for n in "abcd"])

    async def main():
        inbox, _, task = await _start(runner)
        for msg in msgs:
            await inbox.send(msg)
        code = await asyncio.wait_for(task, 10)
        runner.go.set()
        return code

    try:
        assert asyncio.run(main()) == 1  # the actor fails, naming the rule
    finally:
        _free(*shms)


class KeptImageRunner(SlowInstallRunner):
    """Keeps the images of ``kept`` digests: those swap back in at once."""

    def __init__(self, kept):
        super().__init__()
        self.kept, self.swapped = set(kept), []

    def reinstall_adapter(self, slot, name, digest):
        if digest not in self.kept:
            return False
        self.swapped.append((slot, name))
        return True

    def kept_adapters(self):
        return sorted(self.kept)


def test_a_kept_image_swaps_in_inline_unless_an_install_is_on_the_thread():
    shm_a, install_a = _host_copy("a")
    shm_b, install_b = _host_copy("b")
    install_b = InstallAdapter(slot=2, name="b", digest=install_b.digest, host=install_b.host)
    runner = KeptImageRunner({install_b.digest})  # "a" reads its host copy on the thread, which waits for go

    async def script(inbox, outbox):
        await inbox.send(install_b)  # kept: answered inline, the thread untouched
        reply = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(reply, AdapterInstalled) and (reply.slot, reply.ok) == (2, True)
        assert runner.swapped == [(2, "b")] and runner.installed == []
        await inbox.send(install_a)  # to the thread, which blocks
        await inbox.send(install_b)  # kept, but queued behind "a": one install at a time, in order
        await inbox.send(StepPlan(step_id=1, started=[], scheduled=[]))
        reply = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(reply, StepDone) and reply.step_id == 1  # steps go on meanwhile
        assert runner.swapped == [(2, "b")]
        runner.go.set()
        replies = [await asyncio.wait_for(outbox.recv(), 10) for _ in range(2)]
        assert [(r.slot, r.ok) for r in replies] == [(1, True), (2, True)]
        assert runner.installed == [(1, "a")] and runner.swapped == [(2, "b"), (2, "b")]

    _serve(runner, script, shm_a, shm_b)
