"""The whole request path over in-memory channels: prepare + conductor + two
worker ranks with a tiny random Llama, and a fake frontend end."""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest
import torch

from actors.base import frontend_name
from actors.conductor import ConductorActor
from actors.prepare import PrepareActor
from actors.worker import WorkerActor
from mstar_actors.config import Config, KvConfig, ModelConfig, ParallelConfig, SchedulerConfig
from mstar_actors.messages import (
    Abort,
    ChatMessage,
    ConductorToFrontend,
    ContextAgreed,
    ConductorToWorker,
    EngineStats,
    Failed,
    Finished,
    FrontendToPrepare,
    NewRequest,
    PrepareToConductor,
    SamplingParams,
    Shutdown,
    StructuredSpec,
    TokenDelta,
    WorkerToConductor,
    frontend_of,
    new_request_id,
)
from mstar_actors.tokenization import Tokenization
from transport.memory import MemoryBroadcast, MemoryChannel

NUM_RANKS = 2


class Engine:
    """prepare, conductor and the ranks on one loop; ``to_prepare`` / ``from_conductor`` are the frontend's ends."""

    def __init__(self, config: Config, num_frontends: int = 1):
        from mstar_actors.model_info import load_model_info

        names = [frontend_name(i) for i in range(num_frontends)]
        self.to_prepares = [MemoryChannel(FrontendToPrepare, f"{name}.prepare") for name in names]
        self.from_conductors = [MemoryChannel(ConductorToFrontend, f"conductor.{name}") for name in names]
        self.to_prepare, self.from_conductor = self.to_prepares[0], self.from_conductors[0]
        p2c = MemoryChannel(PrepareToConductor, "prepare.conductor")
        c2w = [MemoryChannel(ConductorToWorker, f"conductor.worker{r}") for r in range(NUM_RANKS)]
        w2c = [MemoryChannel(WorkerToConductor, f"worker{r}.conductor") for r in range(NUM_RANKS)]
        common = dict(config=config, info=load_model_info(config))
        self.actors = [
            PrepareActor(name="prepare", inbox=dict(zip(names, self.to_prepares)), outbox={"conductor": p2c}, **common),
            ConductorActor(name="conductor", inbox={"prepare": p2c} | {f"worker{r}": w2c[r] for r in range(NUM_RANKS)},
                           outbox=dict(zip(names, self.from_conductors))
                           | {"workers": MemoryBroadcast(c2w, "conductor.workers")}, **common),
        ] + [
            WorkerActor(name=f"worker{r}", rank=r, inbox={"conductor": c2w[r]}, outbox={"conductor": w2c[r]}, **common)
            for r in range(NUM_RANKS)
        ]
        self.tasks = []

    def start(self):
        self.tasks = [asyncio.create_task(a.run(), name=a.name) for a in self.actors]

    async def stop(self) -> list[int]:
        await self.to_prepare.send(Shutdown(reason="test over"))
        return await asyncio.wait_for(asyncio.gather(*self.tasks), 10)

    async def collect(self, num_ended: int, on_delta=None, frontend: int = 0) -> dict:
        """Read until ``num_ended`` requests ended; per request: tokens, end message."""
        out: dict[str, dict] = {}
        self.stats: list[EngineStats] = []
        ended = 0
        while ended < num_ended:
            msg = await asyncio.wait_for(self.from_conductors[frontend].recv(), 10)
            match msg:
                case TokenDelta():
                    entry = out.setdefault(msg.request_id, {"tokens": [], "end": None})
                    entry["tokens"] += [t.token_id for t in msg.tokens]
                    if on_delta:
                        await on_delta(msg)
                case Finished() | Failed():
                    out.setdefault(msg.request_id, {"tokens": [], "end": None})["end"] = msg
                    ended += 1
                case EngineStats():
                    self.stats.append(msg)
        return out


    async def await_idle(self) -> EngineStats:
        """The conductor's gauges once nothing runs or waits (sent after the last step)."""
        while True:
            msg = await asyncio.wait_for(self.from_conductor.recv(), 10)
            if isinstance(msg, EngineStats):
                self.stats.append(msg)
                if msg.num_running == 0 and msg.num_waiting == 0:
                    return msg


def make_config(model_dir, ahead=0, **kv) -> Config:
    """``ahead``: the steps the conductor plans ahead of the ranks' answers (0: one step at a time)."""
    return Config(
        model=ModelConfig(path=str(model_dir), name="tiny", dtype="float32", device="cpu"),
        parallel=ParallelConfig(tp=NUM_RANKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                                  async_scheduling=ahead > 0, steps_ahead=max(ahead, 1)),
        kv=KvConfig(block_size=4, num_blocks=kv.get("num_blocks", 128)),
    )


def make_request(request_id, max_tokens=6, **prompt) -> NewRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return NewRequest(request_id=request_id, model="tiny", sampling=sampling, **prompt)


def greedy_reference(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' own forward, greedy, EOS ignored (as the requests ask)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        asyncio.run(fn(*args, **kw))

    return wrapper


@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["one-step", "planned-ahead", "two-ahead"])
@async_test
async def test_greedy_tokens_match_transformers_and_bad_prompt_fails_alone(tiny_model, ahead):
    model_dir, hf_model = tiny_model
    tok = Tokenization(model_dir)
    engine = Engine(make_config(model_dir, ahead))
    engine.start()
    chat = [ChatMessage(role="user", content="hello w7 w8 world")]
    requests = [
        make_request("ids", prompt_token_ids=[5, 9, 33, 41, 17, 100, 250]),
        make_request("text", prompt="hello world w1 w2 w3 w4 w5 w6 w9 w10 w11"),
        make_request("bad", prompt_token_ids=[5] * 130),  # over max_model_len: the scheduler refuses it
        make_request("chat", max_tokens=8, messages=chat),
    ]
    for req in requests:
        await engine.to_prepare.send(req)
    out = await engine.collect(num_ended=len(requests))
    await engine.await_idle()
    first_stats = engine.stats
    await engine.to_prepare.send(make_request("again", prompt_token_ids=[5, 9, 33]))  # after the idle step
    await engine.collect(num_ended=1)
    later_steps = [n for stats in engine.stats for n in stats.step_tokens]
    engine.stats = first_stats
    assert await engine.stop() == [0] * (2 + NUM_RANKS)

    bad = out["bad"]["end"]
    assert isinstance(bad, Failed) and bad.status == 400 and not out["bad"]["tokens"]
    assert bad.code == "context_length_exceeded" and "130 tokens" in bad.message and "max_model_len is 128" in bad.message
    prompts = {
        "ids": [5, 9, 33, 41, 17, 100, 250],
        "text": tok.encode_prompt("hello world w1 w2 w3 w4 w5 w6 w9 w10 w11"),
        "chat": tok.apply_chat_template(chat, True),
    }
    for rid, prompt in prompts.items():
        end = out[rid]["end"]
        assert isinstance(end, Finished) and end.finish_reason == "length", (rid, end)
        assert end.num_prompt_tokens == len(prompt)
        assert out[rid]["tokens"] == greedy_reference(hf_model, prompt, end.num_output_tokens), rid
    # every step's tokens reached the frontend (vllm:iteration_tokens_total): each prompt's and each output's
    # but the last, fed once; planning ahead, a step may carry rows it then drops
    steps = [n for stats in engine.stats for n in stats.step_tokens]
    fed = sum(len(prompt) + out[rid]["end"].num_output_tokens - 1 for rid, prompt in prompts.items())
    assert all(0 < n <= 64 for n in steps) and (sum(steps) == fed if ahead == 0 else sum(steps) >= fed), steps
    assert all(n > 0 for n in later_steps), later_steps  # a plan of orders alone (the last end's) runs no step


@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["one-step", "planned-ahead", "two-ahead"])
@async_test
async def test_abort_frees_everything_and_others_continue(tiny_model, ahead):
    model_dir, _ = tiny_model
    engine = Engine(make_config(model_dir, ahead))
    engine.start()

    async def abort_after_first_token(delta):
        if delta.request_id == "long" and not engine.aborted:
            engine.aborted = True
            await engine.to_prepare.send(Abort(request_id="long"))
            await engine.to_prepare.send(Abort(request_id="long"))  # idempotent

    engine.aborted = False
    await engine.to_prepare.send(make_request("long", max_tokens=100, prompt_token_ids=list(range(5, 30))))
    await engine.to_prepare.send(make_request("short", max_tokens=5, prompt_token_ids=[7, 8, 9]))
    out = await engine.collect(num_ended=2, on_delta=abort_after_first_token)
    assert out["long"]["end"].finish_reason == "abort"
    assert len(out["long"]["tokens"]) < 100
    assert out["short"]["end"].finish_reason == "length" and len(out["short"]["tokens"]) == 5
    final = await engine.await_idle()
    assert final.num_kv_blocks_used == 0
    # the conductor's scheduler and every rank forgot the aborted request
    conductor = engine.actors[1]
    assert not conductor.scheduler.requests
    assert all("long" not in w.runner.seqs for w in engine.actors[2:])
    assert await engine.stop() == [0] * (2 + NUM_RANKS)


@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["one-step", "planned-ahead", "two-ahead"])
@async_test
async def test_n_choices_are_prepared_once_and_each_ends_on_its_own(tiny_model, ahead):
    model_dir, hf_model = tiny_model
    engine = Engine(make_config(model_dir, ahead))
    engine.start()
    prompt = [5, 9, 33, 41, 17]
    # Enough tokens that the abort, sent at r-1's first token, lands while it runs.
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    await engine.to_prepare.send(NewRequest(request_id="r", model="tiny", sampling=sampling,
                                            prompt_token_ids=prompt, n=3))

    async def abort_one_choice(delta):
        if delta.request_id == "r-1" and not engine.aborted:
            engine.aborted = True
            await engine.to_prepare.send(Abort(request_id="r-1"))

    engine.aborted = False
    out = await engine.collect(num_ended=3, on_delta=abort_one_choice)
    assert sorted(out) == ["r-0", "r-1", "r-2"]
    assert out["r-1"]["end"].finish_reason == "abort"
    expected = greedy_reference(hf_model, prompt, 32)
    for rid in ("r-0", "r-2"):
        assert out[rid]["end"].finish_reason == "length" and out[rid]["tokens"] == expected
    assert (await engine.await_idle()).num_kv_blocks_used == 0
    assert not engine.actors[1].scheduler.choices  # the request ended with its last choice
    assert await engine.stop() == [0] * (2 + NUM_RANKS)


@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["one-step", "planned-ahead", "two-ahead"])
@async_test
async def test_failed_step_fails_its_rows_with_500_and_serving_continues(tiny_model, ahead):
    model_dir, _ = tiny_model
    engine = Engine(make_config(model_dir, ahead))
    workers = engine.actors[2:]
    engine.start()
    await engine.to_prepare.send(make_request("ok1", max_tokens=3, prompt_token_ids=[5, 6]))
    await engine.collect(num_ended=1)
    for worker in workers:  # the next step raises on every rank, once
        real = worker.runner.forward
        worker.runner.forward = functools.partial(_fail_once, worker, real)
    await engine.to_prepare.send(make_request("doomed", max_tokens=3, prompt_token_ids=[5, 6]))
    out = await engine.collect(num_ended=1)
    failed = out["doomed"]["end"]
    assert isinstance(failed, Failed) and failed.status == 500 and "injected" in failed.message
    await engine.to_prepare.send(make_request("ok2", max_tokens=3, prompt_token_ids=[5, 6]))
    out = await engine.collect(num_ended=1)
    assert out["ok2"]["end"].finish_reason == "length"
    assert await engine.stop() == [0] * (2 + NUM_RANKS)


@async_test
async def test_the_frontend_learns_the_context_the_kv_cache_leaves(tiny_model):
    model_dir, _ = tiny_model
    engine = Engine(make_config(model_dir, num_blocks=16))  # 64 KV tokens: less than max_model_len 128
    engine.start()
    assert await asyncio.wait_for(engine.from_conductor.recv(), 10) == ContextAgreed(max_model_len=64)
    stats = await asyncio.wait_for(engine.from_conductor.recv(), 10)  # the gauges before any request
    assert isinstance(stats, EngineStats) and (stats.num_kv_blocks_total, stats.num_running) == (16, 0), stats
    await engine.to_prepare.send(make_request("long", max_tokens=3, prompt_token_ids=[5] * 70))
    out = await engine.collect(num_ended=1)
    refused = out["long"]["end"]
    assert isinstance(refused, Failed) and refused.status == 400 and refused.code == "context_length_exceeded"
    assert "the whole KV cache holds 64 tokens" in refused.message
    assert await engine.stop() == [0] * (2 + NUM_RANKS)


@async_test
async def test_each_frontend_gets_its_requests_outputs_and_every_one_the_engines_news(tiny_model):
    """Two frontends (``server.api_server_count``): a request's tokens and end
    reach the frontend its id names, a refusal too; the context and the
    gauges reach both."""
    model_dir, _ = tiny_model
    engine = Engine(make_config(model_dir), num_frontends=2)
    engine.start()
    ids = [new_request_id("cmpl", 0), new_request_id("cmpl", 1), new_request_id("cmpl", 1)]
    assert [frontend_of(rid) for rid in ids] == [0, 1, 1]
    await engine.to_prepares[0].send(make_request(ids[0], prompt_token_ids=[5, 9, 33]))
    await engine.to_prepares[1].send(make_request(ids[1], prompt_token_ids=[7, 8]))
    await engine.to_prepares[1].send(make_request(ids[2], prompt_token_ids=[5] * 130))  # refused: too long
    for frontend in (0, 1):
        assert await asyncio.wait_for(engine.from_conductors[frontend].recv(), 10) == ContextAgreed(max_model_len=128)
    first = await engine.collect(num_ended=1, frontend=0)
    assert engine.stats, "the gauges reach frontend 0"
    second = await engine.collect(num_ended=2, frontend=1)
    assert engine.stats, "and frontend 1"
    assert set(first) == {ids[0]} and set(second) == {ids[1], ids[2]}
    assert first[ids[0]]["end"].finish_reason == "length" and len(first[ids[0]]["tokens"]) == 6
    assert second[ids[1]]["end"].finish_reason == "length"
    assert isinstance(second[ids[2]]["end"], Failed) and second[ids[2]]["end"].status == 400
    await engine.await_idle()
    assert await engine.stop() == [0] * (2 + NUM_RANKS)


def _fail_once(worker, real, plan):
    """The next plan with rows raises (a plan of orders alone, such as the one forgetting the last request, runs)."""
    if not plan.scheduled:
        return real(plan)
    worker.runner.forward = real
    raise RuntimeError("injected failure")


@async_test
async def test_a_failing_conductor_tells_each_live_request_why(tiny_model):
    """The conductor fails (here: a message it has no handler for, from a
    rank): each running request gets a 503 naming the cause before the
    channel ends, not an anonymous end."""
    model_dir, _ = tiny_model
    engine = Engine(make_config(model_dir))
    for worker in engine.actors[2:]:  # a grammar no rank answers for: its request waits in the gate
        worker._compile = lambda msg: asyncio.sleep(3600)
    engine.start()
    await engine.to_prepare.send(make_request("live", max_tokens=100, prompt_token_ids=[5, 6]))
    while not isinstance(msg := await asyncio.wait_for(engine.from_conductor.recv(), 10), TokenDelta):
        pass
    held = make_request("held", prompt_token_ids=[5, 6])
    held = msgspec.structs.replace(held, sampling=msgspec.structs.replace(
        held.sampling, structured=StructuredSpec("regex", "a+")))
    await engine.to_prepare.send(held)
    conductor = engine.actors[1]

    async def held_arrives():
        while "held" not in conductor.arrived:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held_arrives(), 10)
    worker0 = engine.actors[2]
    await worker0.outbox["conductor"].send(worker0.runner.ready_info(0))  # WorkerReady again: no handler
    failed = {}
    while len(failed) < 2:
        if isinstance(msg := await asyncio.wait_for(engine.from_conductor.recv(), 10), Failed):
            failed[msg.request_id] = msg
    for msg in failed.values():  # the one the gate held as well: told why, not "shutting down"
        assert msg.status == 503 and msg.error_type == "service_unavailable_error", msg
        assert "the engine stopped: UnknownMessage" in msg.message and "worker0" in msg.message, msg.message
    assert sorted(failed) == ["held", "live"]
    await engine.to_prepare.send(Shutdown(reason="test over"))  # the launcher's part: stop the others
    codes = await asyncio.wait_for(asyncio.gather(*engine.tasks), 10)
    assert codes[1] == 1  # the conductor's
