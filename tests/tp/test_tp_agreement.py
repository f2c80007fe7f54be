"""Slot agreement over real sharded installs: the real conductor and
adapter-reader with two worker ranks whose runners hold their shards (gloo,
two processes; this process relays the rings' messages to them). A rank
whose install fails refuses the adapter on every rank and fails only the
requests on it; a full pool holds requests until a slot frees."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import msgspec
import pytest
from lora.lora_factories import base_shapes, make_adapter, make_base
from tp_ranks import run_ranks
from tp_scenarios import serve_rank

from actors.adapter_reader import AdapterReaderActor
from actors.conductor import ConductorActor
from mstar_actors.config import Config, KvConfig, LoraConfig, ModelConfig, ParallelConfig, SchedulerConfig
from mstar_actors.messages import (
    AdapterInstalled,
    AdapterReaderToConductor,
    ConductorToAdapterReader,
    ConductorToFrontend,
    ConductorToWorker,
    EngineStats,
    Failed,
    Finished,
    InstallAdapter,
    Prepared,
    PrepareToConductor,
    SamplingParams,
    Shutdown,
    StepPlan,
    WorkerToConductor,
)
from mstar_actors.model_info import ModelInfo
from transport import shm
from transport.errors import ChannelClosed
from transport.memory import MemoryBroadcast, MemoryChannel

NUM_RANKS = 2
REPLY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base folder, {adapter: folder}, the base's LoRA shapes)."""
    tmp = tmp_path_factory.mktemp("tp_agreement")
    model, config = make_base(seed=0)
    model.save_pretrained(tmp / "base")
    folders = {}
    for seed, name in enumerate(["a", "b"]):
        model, _ = make_base(seed=0)
        folders[name], _ = make_adapter(tmp, model, seed=seed + 1, name=name,
                                        target_modules=["q_proj", "o_proj", "gate_proj", "down_proj", "lm_head"])
    return tmp / "base", folders, base_shapes(config)


class RelayedRank:
    """One rank's end of the rings here; its runner in a rank process."""

    def __init__(self, rank: int, inbox, outbox, commands, replies, shared: dict):
        self.rank, self.inbox, self.outbox = rank, inbox, outbox
        self.commands, self.replies, self.shared = commands, replies, shared
        self.installs: list[tuple[int, str, str]] = []
        self.rows: dict[str, int] = {}

    async def answer(self):
        return await asyncio.get_running_loop().run_in_executor(None, self.replies.get, True, REPLY_TIMEOUT_S)

    async def run(self) -> None:
        await self.outbox.send(await self.answer())  # WorkerReady, once the shard is loaded
        while True:
            try:
                msg = await self.inbox.recv()
            except ChannelClosed:
                return
            if isinstance(msg, Shutdown):
                return
            # A plan's installs (a turn's end) go to the rank after its step, as the worker runs them.
            after = msg.install_after if isinstance(msg, StepPlan) else []
            for command in [msgspec.structs.replace(msg, install_after=[]) if after else msg, *after]:
                await self.relay(command)

    async def relay(self, msg) -> None:
        if isinstance(msg, InstallAdapter):
            self.installs.append((msg.slot, msg.name, msg.digest))
        elif isinstance(msg, StepPlan):
            for start in msg.started:
                self.rows[start.request_id] = start.lora_slot
                self.check_acked(start.request_id, start.lora_slot)
        self.commands.put(msg)
        reply = await self.answer()
        if isinstance(reply, AdapterInstalled):
            self.shared[self.rank, reply.slot] = reply.digest if reply.ok else None
        await self.outbox.send(reply)

    def check_acked(self, request_id: str, slot: int) -> None:
        """A row on an adapter's slot arrives only once every rank acknowledged one digest there."""
        if slot == 0:
            return
        digests = {self.shared.get((r, slot)) for r in range(NUM_RANKS)}
        if len(digests) != 1 or None in digests:
            self.shared["violations"].append(f"rank {self.rank}: {request_id} on slot {slot}, acks {digests}")


class ShardedCluster:
    """The conductor and the adapter-reader here, two sharded ranks in their processes."""

    def __init__(self, world, *, max_loras: int, fail_on: dict[int, tuple[str, ...]] | None = None):
        base_folder, folders, shapes = world
        self.config = Config(
            model=ModelConfig(path=str(base_folder), name="base"), parallel=ParallelConfig(tp=NUM_RANKS),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv=KvConfig(block_size=4, num_blocks=64),
            lora=LoraConfig(max_loras=max_loras, max_lora_rank=8, adapters={n: str(p) for n, p in folders.items()}),
        )
        self.info = ModelInfo(served_name="base", model_dir=str(base_folder), architecture="LlamaForCausalLM",
                              vocab_size=320, eos_token_ids=(2,), dtype="float32", max_model_len=64, lora_base=shapes)
        self.to_conductor = MemoryChannel(PrepareToConductor, "prepare.conductor")
        self.from_conductor = MemoryChannel(ConductorToFrontend, "conductor.frontend")
        c2r = MemoryChannel(ConductorToAdapterReader, "conductor.adapter_reader")
        r2c = MemoryChannel(AdapterReaderToConductor, "adapter_reader.conductor")
        c2w = [MemoryChannel(ConductorToWorker, f"conductor.worker{r}") for r in range(NUM_RANKS)]
        w2c = [MemoryChannel(WorkerToConductor, f"worker{r}.conductor") for r in range(NUM_RANKS)]
        ctx = multiprocessing.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(NUM_RANKS)]
        self.replies = [ctx.Queue() for _ in range(NUM_RANKS)]
        self.shared = {"violations": []}
        self.ranks = [RelayedRank(r, c2w[r], w2c[r], self.commands[r], self.replies[r], self.shared)
                      for r in range(NUM_RANKS)]
        self.conductor = ConductorActor(
            name="conductor", config=self.config, info=self.info,
            inbox={"prepare": self.to_conductor, "adapter_reader": r2c} | {f"worker{r}": w2c[r] for r in range(NUM_RANKS)},
            outbox={"frontend": self.from_conductor, "workers": MemoryBroadcast(c2w, "conductor.workers"),
                    "adapter_reader": c2r})
        self.reader = AdapterReaderActor(name="adapter_reader", config=self.config, info=self.info,
                                         inbox={"conductor": c2r}, outbox={"conductor": r2c})
        self.fail_on = fail_on or {}
        self.ended: dict = {}
        self.stats: list[EngineStats] = []

    def _serve_ranks(self) -> None:
        try:
            self.rank_results = run_ranks(_serve_relayed, NUM_RANKS, self.info.model_dir, self.commands,
                                          self.replies, self.fail_on, self.config.lora.max_loras)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            self.rank_error = err
            for replies in self.replies:  # unblock the relays
                replies.put(None)

    async def __aenter__(self):
        self.rank_error = None
        self.thread = threading.Thread(target=self._serve_ranks, daemon=True)
        self.thread.start()
        self.tasks = [asyncio.create_task(x) for x in [self.conductor.run(), self.reader.run(),
                                                      *(r.run() for r in self.ranks)]]
        return self

    async def __aexit__(self, *exc):
        await self.to_conductor.send(Shutdown(reason="test over"))
        await asyncio.gather(*self.tasks)
        for commands in self.commands:
            commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, REPLY_TIMEOUT_S)
        assert self.rank_error is None, self.rank_error
        assert not shm.cleanup_run(self.reader.run_id), "the reader left host copies behind"

    async def send(self, request_id: str, model: str, max_tokens: int = 4) -> None:
        await self.to_conductor.send(Prepared(request_id=request_id, model=model, prompt_token_ids=[5, 6, 7, 8, 9],
                                              sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True)))

    async def collect(self, request_ids) -> dict:
        while not set(request_ids) <= set(self.ended):
            msg = await asyncio.wait_for(self.from_conductor.recv(), REPLY_TIMEOUT_S)
            if isinstance(msg, Finished | Failed):
                self.ended[msg.request_id] = msg
            elif isinstance(msg, EngineStats):
                self.stats.append(msg)
        return dict(self.ended)


def _serve_relayed(tp, base_folder, commands, replies, fail_on, max_loras):
    return serve_rank(tp, base_folder, commands[tp.rank], replies[tp.rank], tuple(fail_on.get(tp.rank, ())),
                      max_loras)


def assert_agreed(cluster: ShardedCluster) -> None:
    first, second = cluster.ranks
    assert first.installs == second.installs and first.rows == second.rows
    assert cluster.shared["violations"] == []


def test_a_rank_failing_its_sharded_install_refuses_the_adapter_everywhere(world):
    async def main():
        async with ShardedCluster(world, max_loras=2, fail_on={1: ("b",)}) as cluster:
            await cluster.send("ok1", "a")
            await cluster.send("bad1", "b")
            await cluster.send("base1", "base")
            await cluster.collect(["ok1", "bad1", "base1"])
            await cluster.send("ok2", "a")  # the refused slot was freed everywhere
            return cluster, await cluster.collect(["ok2"])

    cluster, ended = asyncio.run(asyncio.wait_for(main(), 300))
    for rid in ("ok1", "ok2", "base1"):
        assert isinstance(ended[rid], Finished) and ended[rid].num_output_tokens == 4, ended[rid]
    failed = ended["bad1"]
    assert isinstance(failed, Failed) and failed.status == 500
    assert "'b'" in failed.message and "rank 1" in failed.message and "scripted failure" in failed.message
    assert "bad1" not in cluster.ranks[0].rows
    assert_agreed(cluster)


def test_a_full_pool_of_sharded_slots_holds_requests_until_one_frees(world):
    async def main():
        async with ShardedCluster(world, max_loras=1) as cluster:
            await cluster.send("a1", "a", max_tokens=8)
            await cluster.send("b1", "b", max_tokens=2)
            await cluster.send("a2", "a", max_tokens=2)
            return cluster, await cluster.collect(["a1", "b1", "a2"])

    cluster, ended = asyncio.run(asyncio.wait_for(main(), 300))
    assert all(isinstance(m, Finished) and m.num_output_tokens > 0 for m in ended.values()), ended
    assert max(s.num_waiting_for_adapter for s in cluster.stats) >= 1, "the held request was not visible"
    assert {slot for slot, _, _ in cluster.ranks[0].installs} == {1}
    assert_agreed(cluster)
