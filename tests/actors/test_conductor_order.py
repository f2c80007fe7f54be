"""The conductor's order of sends after a step: the next plan goes to the
ranks before that step's tokens go to the frontend (the ranks wait for the
plan; the tokens hold no step back). The real conductor, a fake rank, and
channels that record every send in one list."""

from __future__ import annotations

import asyncio

from actors.conductor import ConductorActor
from mstar_actors.config import Config, KvConfig, ModelConfig, SchedulerConfig
from mstar_actors.messages import (
    ConductorToFrontend,
    ConductorToWorker,
    EngineStats,
    Failed,
    Finished,
    Prepared,
    PrepareToConductor,
    SampledToken,
    SamplingParams,
    Shutdown,
    StepDone,
    StepPlan,
    TokenDelta,
    WorkerReady,
    WorkerToConductor,
    new_request_id,
)
from mstar_actors.model_info import ModelInfo
from transport.errors import ChannelClosed
from transport.memory import MemoryBroadcast, MemoryChannel


class Recording(MemoryChannel):
    """A channel that notes each message it is given, in one shared list."""

    def __init__(self, union, name: str, sent: list):
        super().__init__(union, name)
        self.sent = sent

    async def send(self, msg) -> None:
        self.sent.append(msg)
        await super().send(msg)


async def fake_rank(inbox, outbox) -> None:
    """Answers each plan with token 7 for every sampled row."""
    await outbox.send(WorkerReady(rank=0, num_kv_blocks=64))
    while True:
        try:
            msg = await inbox.recv()
        except ChannelClosed:  # the conductor stopped
            return
        if isinstance(msg, StepPlan):
            await outbox.send(StepDone(step_id=msg.step_id, rank=0,
                                       sampled=[SampledToken(c.request_id, 7) for c in msg.scheduled if c.sample]))


def test_the_next_plan_leaves_before_the_steps_tokens():
    async def run() -> list:
        config = Config(model=ModelConfig(path="unused", name="base"),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True,
                                                  steps_ahead=1),
                        kv=KvConfig(block_size=4, num_blocks=64))
        info = ModelInfo(served_name="base", model_dir="unused", architecture="LlamaForCausalLM", vocab_size=32,
                         eos_token_ids=(2,), dtype="float32", max_model_len=64)
        sent: list = []
        to_conductor = MemoryChannel(PrepareToConductor, "prepare.conductor")
        to_frontend = Recording(ConductorToFrontend, "conductor.frontend", sent)
        to_rank = Recording(ConductorToWorker, "conductor.worker0", sent)
        from_rank = MemoryChannel(WorkerToConductor, "worker0.conductor")
        conductor = ConductorActor(name="conductor", config=config, info=info,
                                   inbox={"prepare": to_conductor, "worker0": from_rank},
                                   outbox={"frontend": to_frontend, "workers": MemoryBroadcast([to_rank], "workers")})
        tasks = [asyncio.create_task(conductor.run()), asyncio.create_task(fake_rank(to_rank, from_rank))]
        while not isinstance(await to_frontend.recv(), EngineStats):  # started: the request comes to it idle
            pass
        for _ in range(10):
            await asyncio.sleep(0)
        await to_conductor.send(Prepared(request_id=new_request_id("cmpl"), model="base", prompt_token_ids=[5, 6, 7],
                                         sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        while not isinstance(await to_frontend.recv(), Finished):
            pass
        await to_conductor.send(Shutdown())
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return sent

    sent = asyncio.run(asyncio.wait_for(run(), 30))
    kinds = ["plan" if isinstance(m, StepPlan) else "tokens" if isinstance(m, TokenDelta) else None for m in sent]
    kinds = [k for k in kinds if k]
    # Prefill and the first decode planned ahead; then each step's answer
    # brings the plan after next, sent ahead of that step's tokens, until
    # the request's last planned step (6 tokens: 6 steps, the 6th planned
    # before the 4th token goes out).
    assert kinds[:12] == ["plan", "plan"] + ["plan", "tokens"] * 4 + ["tokens"] * 2, kinds
    plans = [m for m in sent if isinstance(m, StepPlan)]
    assert [len(p.scheduled) for p in plans] == [1] * 6 + [0] * (len(plans) - 6)  # then orders alone (the end)
    # the arrival at an idle conductor is reported once planned: running (its prefill in flight), not waiting
    # (frontends counted it against max_waiting_requests: a burst at an idle server had 503s)
    reports = [(m.num_running, m.num_waiting, m.num_starting) for m in sent if isinstance(m, EngineStats)]
    assert reports[:2] == [(0, 0, 0), (1, 0, 1)], reports


def test_a_step_a_rank_never_answers_stops_the_conductor():
    """A hung rank (stopped, stuck in a kernel): past scheduler.step_timeout_s
    the conductor exits naming the step and the rank, which stops the server
    and fails the requests with the reason, instead of their waiting for ever."""
    async def run() -> tuple[int, str]:
        config = Config(model=ModelConfig(path="unused", name="base"),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, step_timeout_s=0.2),
                        kv=KvConfig(block_size=4, num_blocks=64))
        info = ModelInfo(served_name="base", model_dir="unused", architecture="LlamaForCausalLM", vocab_size=32,
                         eos_token_ids=(2,), dtype="float32", max_model_len=64)
        to_conductor = MemoryChannel(PrepareToConductor, "prepare.conductor")
        to_rank = MemoryChannel(ConductorToWorker, "conductor.worker0")
        from_rank = MemoryChannel(WorkerToConductor, "worker0.conductor")
        conductor = ConductorActor(name="conductor", config=config, info=info,
                                   inbox={"prepare": to_conductor, "worker0": from_rank},
                                   outbox={"frontend": MemoryChannel(ConductorToFrontend, "conductor.frontend"),
                                           "workers": MemoryBroadcast([to_rank], "workers")})
        task = asyncio.create_task(conductor.run())
        await from_rank.send(WorkerReady(rank=0, num_kv_blocks=64))
        await to_conductor.send(Prepared(request_id=new_request_id("cmpl"), model="base", prompt_token_ids=[5, 6, 7],
                                         sampling=SamplingParams(max_tokens=6)))
        assert isinstance(await asyncio.wait_for(to_rank.recv(), 10), StepPlan)  # and the rank never answers
        return await asyncio.wait_for(task, 10), conductor.failure

    code, failure = asyncio.run(run())
    assert code == 1
    assert "StepTimeout: step 0: no answer from rank(s) [0] in 0.2 s (scheduler.step_timeout_s)" in failure


def test_a_choices_outputs_after_its_end_are_dropped():
    """The adapter pool may fail a choice while the plan ahead goes out (a parked choice it cannot install
    again), before the last step's outputs are sent: that step's tokens and end then followed its Failed,
    and the client was answered twice."""
    async def run() -> list:
        config = Config(model=ModelConfig(path="unused", name="base"))
        info = ModelInfo(served_name="base", model_dir="unused", architecture="LlamaForCausalLM", vocab_size=32,
                         eos_token_ids=(2,), dtype="float32", max_model_len=64)
        sent: list = []
        to_frontend = Recording(ConductorToFrontend, "conductor.frontend", sent)
        to_rank = MemoryChannel(ConductorToWorker, "conductor.worker0")
        conductor = ConductorActor(name="conductor", config=config, info=info, inbox={},
                                   outbox={"frontend": to_frontend, "workers": MemoryBroadcast([to_rank], "workers")})
        request_id = new_request_id("cmpl")
        live, ended = f"{request_id}-0", f"{request_id}-1"
        conductor.arrived.update({live: (0.0, None), ended: (0.0, None)})
        await conductor.send_outputs([Failed(request_id=ended, status=500, message="no longer served")])
        end = Finished(request_id=ended, finish_reason="length", num_prompt_tokens=3, num_output_tokens=1)
        await conductor.send_outputs([TokenDelta(request_id=rid, tokens=[SampledToken(rid, 7)])
                                      for rid in (ended, live)] + [end])
        return sent

    sent = asyncio.run(run())
    assert [(type(m).__name__, m.request_id[-1]) for m in sent] == [("Failed", "1"), ("TokenDelta", "0")]
