"""The worker's overlapped steps: the next plan goes to the device before the
step ahead of it is answered, answers keep plan order, and a step is answered
as soon as its tokens are on the host, with no message needed to wake it.

A fake runner stands in for ``ModelRunner``: its steps' tokens "reach the
host" when the test releases them (as a CUDA step's event would), and it
records the order of the runner calls, over in-memory channels, no model."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from actors.worker import WorkerActor
from mstar_actors.config import Config, ModelConfig
from mstar_actors.messages import (
    AdapterHostRef,
    AdapterInstalled,
    ConductorToWorker,
    InstallAdapter,
    SampledToken,
    Shutdown,
    StepDone,
    StepFailed,
    StepPlan,
    WorkerReady,
    WorkerToConductor,
)
from transport.errors import ChannelClosed
from transport.memory import MemoryChannel


class HeldStep:
    """A step on the 'device' until ``release``."""

    def __init__(self, step_id: int):
        self.step_id = step_id
        self.released = threading.Event()

    def ready(self) -> bool:
        return self.released.is_set()

    def wait(self) -> None:
        if not self.released.wait(10):
            raise TimeoutError(f"the test never released step {self.step_id}")


class DeviceRunner:
    """Each forward also lets the step before finish on the 'device' (it was
    enqueued ahead), as a GPU would while the host builds the next step."""

    device = torch.device("cpu")

    def __init__(self, fail_forward: int = -1, fail_collect: int = -1):
        self.calls: list[tuple[str, int]] = []
        self.steps: dict[int, HeldStep] = {}
        self.fail_forward, self.fail_collect = fail_forward, fail_collect

    def ready_info(self, rank):
        return WorkerReady(rank=rank, num_kv_blocks=8)

    def forward(self, plan):
        self.calls.append(("forward", plan.step_id))
        if plan.step_id - 1 in self.steps:
            self.steps[plan.step_id - 1].released.set()
        if plan.step_id == self.fail_forward:
            raise RuntimeError(f"step {plan.step_id} refused")
        self.steps[plan.step_id] = HeldStep(plan.step_id)
        return self.steps[plan.step_id]

    def sample(self, step):
        self.calls.append(("sample", step.step_id))

    def collect(self, step):
        self.calls.append(("collect", step.step_id))
        step.wait()
        if step.step_id == self.fail_collect:
            raise RuntimeError(f"step {step.step_id} broke on the device")
        return [SampledToken(f"r{step.step_id}", step.step_id)]


async def _started(runner):
    inbox = MemoryChannel(ConductorToWorker, "conductor.worker0")
    outbox = MemoryChannel(WorkerToConductor, "worker0.conductor")
    worker = WorkerActor(name="worker0", rank=0, runner=runner, inbox={"conductor": inbox},
                         outbox={"conductor": outbox}, config=Config(model=ModelConfig(path="unused")))
    task = asyncio.create_task(worker.run())
    assert isinstance(await asyncio.wait_for(outbox.recv(), 10), WorkerReady)
    return inbox, outbox, task


async def _until(predicate) -> None:
    for _ in range(1000):  # the worker's loop runs between our awaits
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the worker never got there")


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id=step_id, started=[], scheduled=[])


def _run(runner, script) -> None:
    async def main():
        inbox, outbox, task = await _started(runner)
        try:
            await script(inbox, outbox)
        finally:
            for step in runner.steps.values():
                step.released.set()
            await inbox.send(Shutdown(reason="test over"))
            assert await asyncio.wait_for(task, 10) == 0

    asyncio.run(main())


def test_the_next_plan_is_enqueued_before_the_step_ahead_is_answered():
    runner = DeviceRunner()

    async def script(inbox, outbox):
        await inbox.send(_plan(1))
        await _until(lambda: ("sample", 1) in runner.calls)
        await inbox.send(_plan(2))  # arrives while step 1 is still on the device
        done = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(done, StepDone) and done.step_id == 1 and done.sampled[0].token_id == 1
        await _until(lambda: ("sample", 2) in runner.calls)
        assert runner.calls == [("forward", 1), ("sample", 1), ("forward", 2), ("collect", 1), ("sample", 2)]
        runner.steps[2].released.set()  # no message follows: the device's answer alone wakes the worker
        done = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(done, StepDone) and done.step_id == 2

    _run(runner, script)


def test_a_step_whose_tokens_arrive_first_is_answered_before_the_next_plan():
    runner = DeviceRunner()

    async def script(inbox, outbox):
        await inbox.send(_plan(1))
        await _until(lambda: ("sample", 1) in runner.calls)
        runner.steps[1].released.set()
        assert (await asyncio.wait_for(outbox.recv(), 10)).step_id == 1
        await inbox.send(_plan(2))
        await _until(lambda: ("sample", 2) in runner.calls)
        runner.steps[2].released.set()
        assert (await asyncio.wait_for(outbox.recv(), 10)).step_id == 2
        assert runner.calls == [("forward", 1), ("sample", 1), ("collect", 1), ("forward", 2), ("sample", 2),
                                ("collect", 2)]

    _run(runner, script)


@pytest.mark.parametrize("where", ["forward", "collect"])
def test_failures_are_answered_in_plan_order_and_serving_goes_on(where):
    runner = DeviceRunner(**{f"fail_{where}": 2})

    async def script(inbox, outbox):
        await inbox.send(_plan(1))
        await _until(lambda: ("sample", 1) in runner.calls)
        await inbox.send(_plan(2))
        first = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(first, StepDone) and first.step_id == 1
        if where == "collect":
            await _until(lambda: ("sample", 2) in runner.calls)
            runner.steps[2].released.set()
        second = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(second, StepFailed) and second.step_id == 2 and "step 2" in second.message
        await inbox.send(_plan(3))
        await _until(lambda: ("sample", 3) in runner.calls)
        runner.steps[3].released.set()
        third = await asyncio.wait_for(outbox.recv(), 10)
        assert isinstance(third, StepDone) and third.step_id == 3

    _run(runner, script)


def test_a_failed_collective_stops_the_rank():
    """A collective that failed (a peer stopped or hung past the timeout)
    leaves the group broken: the rank exits, so the server stops (the
    launcher sees an actor die), instead of failing every later step; and
    a collective's failure is one, whichever op and backend it was."""
    from mstar_actors.runner.parallel import CollectiveError, TensorParallel

    with pytest.raises(CollectiveError, match=r"rank 1: all_reduce across the 2 ranks failed .*restart the server"):
        TensorParallel(1, 2, "gloo").all_reduce(torch.ones(2))  # no group joined: the op raises
    with pytest.raises(CollectiveError, match="all_gather"):
        TensorParallel(0, 2, "gloo").all_gather(torch.ones(1, 2))

    class BrokenGroup(DeviceRunner):
        def forward(self, plan):
            if plan.step_id == 2:
                raise CollectiveError("rank 0: all_reduce across the 2 ranks failed (timed out)")
            return super().forward(plan)

    async def main():
        inbox, outbox, task = await _started(BrokenGroup())
        await inbox.send(_plan(1))
        await inbox.send(_plan(2))
        assert await asyncio.wait_for(task, 10) == 1  # exited, without a Shutdown
        answers = []
        with pytest.raises(ChannelClosed):  # the worker's outbox closed as it exited
            while True:
                answers += await asyncio.wait_for(outbox.recv_batch(), 10)
        assert not [m for m in answers if isinstance(m, StepFailed)]

    asyncio.run(main())


class SwappingRunner(DeviceRunner):
    """Keeps every adapter's image: an install is a swap back in, inline."""

    def reinstall_adapter(self, slot, name, digest):
        self.calls.append(("swap", slot))
        return True

    def kept_adapters(self):
        return []


def test_an_install_after_a_step_is_acknowledged_before_the_step_ahead_is_answered():
    """A LoRA turn's end: the plan carries the swap into the slot its rows
    leave. The worker queues it behind the plan's kernels and acknowledges
    it before it answers the step ahead, so the conductor admits the slot's
    new rows before it plans on that answer."""
    runner = SwappingRunner()
    swap = InstallAdapter(slot=1, name="b", digest="digest-b", host=AdapterHostRef(segment="unused", nbytes=0))

    async def script(inbox, outbox):
        await inbox.send(_plan(1))
        await _until(lambda: ("sample", 1) in runner.calls)
        await inbox.send(StepPlan(step_id=2, started=[], scheduled=[], install_after=[swap]))
        replies = [await asyncio.wait_for(outbox.recv(), 10) for _ in range(2)]
        assert [type(r) for r in replies] == [AdapterInstalled, StepDone]
        assert (replies[0].slot, replies[0].ok, replies[1].step_id) == (1, True, 1)
        await _until(lambda: ("sample", 2) in runner.calls)
        assert runner.calls == [("forward", 1), ("sample", 1), ("forward", 2), ("swap", 1), ("collect", 1),
                                ("sample", 2)]

    _run(runner, script)
