"""Slot agreement: the real conductor and adapter-reader with FOUR fake ranks
over in-memory channels. Fake ranks answer StepPlans with a scripted token
and InstallAdapter with ok (or a scripted failure), after checking the host
copy decodes; each checks that every row of every step runs on a slot
holding, on that rank at that point of its message order, its adapter's
digest (a row admitted before some rank installed it, or a slot reinstalled
before its last rows ran, breaks this on some rank), and every rank saw the
same rows on the same weights."""

from __future__ import annotations

import asyncio
import functools

import pytest
from lora_factories import base_shapes, make_adapter, make_base

from actors.adapter_reader import AdapterReaderActor
from actors.conductor import ConductorActor
from mstar_actors.config import Config, KvConfig, LoraConfig, ModelConfig, ParallelConfig, SchedulerConfig
from mstar_actors.model_info import ModelInfo
from mstar_actors.lora.host_copy import adapter_from_bytes
from mstar_actors.messages import (
    AdapterUpdate,
    TokenDelta,
    AdapterInstalled,
    AdapterReaderToConductor,
    ConductorToAdapterReader,
    ConductorToFrontend,
    ConductorToWorker,
    EngineStats,
    Failed,
    Finished,
    InstallAdapter,
    LoadAdapter,
    Prepared,
    PrepareToConductor,
    SamplingParams,
    Shutdown,
    StepDone,
    StepPlan,
    SampledToken,
    WorkerReady,
    WorkerToConductor,
)
from transport import shm
from transport.errors import ChannelClosed
from transport.memory import MemoryBroadcast, MemoryChannel

NUM_RANKS = 4
TOKEN = 7  # every fake step samples this (never EOS): requests end by length


def run_async(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        asyncio.run(asyncio.wait_for(fn(*args, **kw), 30))

    return wrapper


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three tiny PEFT adapters of one base: name -> folder; plus the base's shapes."""
    tmp = tmp_path_factory.mktemp("agreement")
    folders = {}
    for seed, name in enumerate(["a", "b", "c"]):
        model, config = make_base(seed=0)
        folders[name], _ = make_adapter(tmp, model, seed=seed + 1, name=name)
    return folders, base_shapes(config)


class FakeRank:
    """Answers plans and installs; records what it saw and any rule broken."""

    def __init__(self, rank: int, inbox, outbox, shared: dict, fail_names=(), fail_swaps=(), max_images=4):
        self.rank, self.inbox, self.outbox = rank, inbox, outbox
        self.shared = shared  # "expect": request id -> its adapter's digest; "violations"
        self.fail_names = set(fail_names)
        self.fail_swaps = set(fail_swaps)  # adapters whose install fails here once it would be a swap
        self.max_images = max_images
        self.kept: list[str] = []  # digests of the images kept for swaps, oldest use first (as SlotStaging)
        self.swaps_followed: list[str] = []  # adapters installed with rows_follow
        self.defer_swap_acks = False  # hold a rows_follow install's answer until the next plan has come
        self.void: set[int] = set()  # slots whose rows_follow install failed here: they take rows, on zeros (a worker's)
        self.deferred: list[AdapterInstalled] = []
        self.installs: list[tuple[int, str, str]] = []
        self.installs_after: list[tuple[int, str]] = []  # (step id, adapter) of installs a plan carried
        self.rows: dict[str, int] = {}  # request id -> lora_slot it started on
        self.slots_run: dict[str, list[int]] = {}  # request id -> the slot of each of its chunks
        self.local: dict[int, str | None] = {}  # slot -> the digest this rank holds there (None: failed)
        self.weights_run: list[tuple[int, str, str | None]] = []  # (step, request id, digest it ran on)

    async def run(self) -> None:
        await self.outbox.send(WorkerReady(rank=self.rank, num_kv_blocks=64))
        while True:
            try:
                msg = await self.inbox.recv()
            except ChannelClosed:  # the conductor stopped
                return
            match msg:
                case InstallAdapter() if msg.rows_follow and self.defer_swap_acks:
                    self.deferred.append(self.install(msg))  # answered with the next plan: the rows must not wait
                case InstallAdapter():
                    await self.outbox.send(self.install(msg))
                case StepPlan():
                    while self.deferred:  # before the step's answer, as a worker answers every install
                        await self.outbox.send(self.deferred.pop(0))
                    await self.outbox.send(self.step(msg))
                    for install in msg.install_after:  # a turn's end: after the step's rows ran
                        self.installs_after.append((msg.step_id, install.name))
                        await self.outbox.send(self.install(install))
                case Shutdown():
                    return

    def install(self, msg: InstallAdapter) -> AdapterInstalled:
        self.installs.append((msg.slot, msg.name, msg.digest))
        segment = shm.attach_segment(msg.host.segment)
        try:
            weights = adapter_from_bytes(bytes(segment.buf[: msg.host.nbytes]))
        finally:
            segment.close()
        assert weights.digest == msg.digest
        is_swap = msg.digest in self.kept
        if msg.rows_follow:
            self.swaps_followed.append(msg.name)
            if not is_swap:
                self.shared["violations"].append(f"rank {self.rank}: {msg.name} came with its rows following, "
                                                 "but this rank keeps no image of it")
        ok = msg.name not in self.fail_names and not (is_swap and msg.name in self.fail_swaps)
        self.local[msg.slot] = msg.digest if ok else None
        if ok or not msg.rows_follow:
            self.void.discard(msg.slot)
        else:  # the rows planned behind it run here too, on zeros (the worker's void_slot)
            self.void.add(msg.slot)
        if msg.digest in self.kept:
            self.kept.remove(msg.digest)
        if ok:
            self.kept = [*self.kept, msg.digest][-self.max_images:]
        error = "" if ok else f"scripted failure of {msg.name!r} on rank {self.rank}"
        return AdapterInstalled(rank=self.rank, slot=msg.slot, digest=msg.digest, ok=ok, error=error,
                                kept=list(self.kept))

    def step(self, plan: StepPlan) -> StepDone:
        for start in plan.started:
            self.rows[start.request_id] = start.lora_slot
        for chunk in plan.scheduled:  # every step's rows: a parked request resumes on another slot
            self.slots_run.setdefault(chunk.request_id, []).append(chunk.lora_slot)
            self.check_slot(plan.step_id, chunk.request_id, chunk.lora_slot)
        sampled = [SampledToken(c.request_id, TOKEN) for c in plan.scheduled if c.sample]
        return StepDone(step_id=plan.step_id, rank=self.rank, sampled=sampled)

    def check_slot(self, step_id: int, request_id: str, slot: int) -> None:
        if slot != 0 and self.local.get(slot) is None and slot not in self.void:
            # A worker refuses the step's rows on it (PlanError) while the other ranks run them: out of step.
            self.shared["violations"].append(f"rank {self.rank}: refused {request_id} on slot {slot}, which holds nothing")
        digest = None if slot == 0 else self.local.get(slot)
        self.weights_run.append((step_id, request_id, digest))
        expected = self.shared["expect"].get(request_id)
        if digest != expected:
            self.shared["violations"].append(f"rank {self.rank}: {request_id} ran on slot {slot} holding {digest}, "
                                             f"not {expected}")


class Cluster:
    """The conductor, the adapter-reader and four fake ranks on one loop."""

    def __init__(self, adapters, *, max_loras=2, fail_on=None, fail_swaps_on=None, runtime_dirs=None,
                 max_cpu_loras=8):
        folders, shapes = adapters
        self.config = Config(
            model=ModelConfig(path="unused", name="base"),
            parallel=ParallelConfig(tp=NUM_RANKS),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
            kv=KvConfig(block_size=4, num_blocks=64),
            lora=LoraConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras,
                            adapters={n: str(p) for n, p in folders.items()},
                            allow_runtime_updates=runtime_dirs is not None, adapter_dirs=runtime_dirs or []),
        )
        self.to_conductor = MemoryChannel(PrepareToConductor, "prepare.conductor")
        self.from_conductor = MemoryChannel(ConductorToFrontend, "conductor.frontend")
        c2r = MemoryChannel(ConductorToAdapterReader, "conductor.adapter_reader")
        r2c = MemoryChannel(AdapterReaderToConductor, "adapter_reader.conductor")
        c2w = [MemoryChannel(ConductorToWorker, f"conductor.worker{r}") for r in range(NUM_RANKS)]
        w2c = [MemoryChannel(WorkerToConductor, f"worker{r}.conductor") for r in range(NUM_RANKS)]
        # The folder is never read here: the launcher's facts for the base, with its LoRA shapes.
        self.info = ModelInfo(served_name="base", model_dir="unused", architecture="LlamaForCausalLM",
                              vocab_size=shapes.global_modules["embed_tokens"][0], eos_token_ids=(2,),
                              dtype="float32", max_model_len=64, lora_base=shapes)
        self.shared = {"violations": [], "expect": {}}
        fail_on, fail_swaps_on = fail_on or {}, fail_swaps_on or {}
        self.ranks = [FakeRank(r, c2w[r], w2c[r], self.shared, fail_on.get(r, ()), fail_swaps_on.get(r, ()))
                      for r in range(NUM_RANKS)]
        self.conductor = ConductorActor(
            name="conductor", config=self.config, info=self.info,
            inbox={"prepare": self.to_conductor, "adapter_reader": r2c} | {f"worker{r}": w2c[r] for r in range(NUM_RANKS)},
            outbox={"frontend": self.from_conductor, "workers": MemoryBroadcast(c2w, "conductor.workers"),
                    "adapter_reader": c2r})
        self.reader = AdapterReaderActor(name="adapter_reader", config=self.config, info=self.info,
                                         inbox={"conductor": c2r}, outbox={"conductor": r2c})
        self.stats: list[EngineStats] = []
        self.others: list = []
        self.ended: dict = {}
        self.num_expected = 0

    async def __aenter__(self):
        self.tasks = [asyncio.create_task(x) for x in
                      [self.conductor.run(), self.reader.run(), *(r.run() for r in self.ranks)]]
        return self

    async def __aexit__(self, *exc):
        await self.to_conductor.send(Shutdown(reason="test over"))
        await asyncio.gather(*self.tasks)
        assert not shm.cleanup_run(self.reader.run_id), "the reader left host copies behind"
        if not exc[0] and all(rid in self.ended for rid in self.shared["expect"]):  # every request ended
            assert not self.conductor.arrived, f"arrival times kept for {sorted(self.conductor.arrived)}"

    async def send(self, request_id: str, model: str, max_tokens: int = 4, digest: str | None = None) -> None:
        self.shared["expect"][request_id] = digest
        await self.to_conductor.send(Prepared(request_id=request_id, model=model, prompt_token_ids=[5, 6, 7, 8, 9],
                                              sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))

    def file(self, msg) -> None:
        match msg:
            case Finished() | Failed():
                self.ended[msg.request_id] = msg
            case EngineStats():
                self.stats.append(msg)
            case _:
                self.others.append(msg)

    async def collect(self, num_ended: int) -> dict:
        """Every end so far, once ``num_ended`` more than at the last call have come."""
        self.num_expected += num_ended
        while len(self.ended) < self.num_expected:
            self.file(await self.from_conductor.recv())
        return dict(self.ended)

    async def await_other(self, kind: type, request_id: str) -> None:
        """Read until a ``kind`` message for ``request_id``, filing the rest."""
        while True:
            msg = await self.from_conductor.recv()
            self.file(msg)
            if isinstance(msg, kind) and msg.request_id == request_id:
                return

    def digest(self, name: str) -> str:
        from mstar_actors.lora import read_adapter

        folders, shapes = self.reader.config.lora.adapters, self.info.lora_base
        return read_adapter(folders[name], base=shapes, max_rank=8, name=name).digest


def assert_agreed(cluster: Cluster) -> None:
    first = cluster.ranks[0]
    for rank in cluster.ranks[1:]:
        assert rank.installs == first.installs, f"rank {rank.rank} saw other installs than rank 0"
        assert rank.rows == first.rows
        assert rank.weights_run == first.weights_run, f"rank {rank.rank} ran rows on other weights than rank 0"
    assert cluster.shared["violations"] == []


@run_async
async def test_churn_three_adapters_over_two_slots_agree_on_every_rank(adapters):
    async with Cluster(adapters, max_loras=2) as cluster:
        digests = {n: cluster.digest(n) for n in "abc"}
        names = ["a", "b", "c", "base", "c", "a", "b", "base", "b", "c", "a", "a"]
        for i, name in enumerate(names):
            await cluster.send(f"r{i}", name, max_tokens=3 + i % 3, digest=digests.get(name))
        ended = await cluster.collect(len(names))
    assert all(isinstance(m, Finished) and m.finish_reason == "length" for m in ended.values()), ended
    assert_agreed(cluster)
    rows = cluster.ranks[0].rows
    for i, name in enumerate(names):
        assert (rows[f"r{i}"] == 0) == (name == "base"), f"r{i} on {name} ran on slot {rows[f'r{i}']}"
    installed = {(n, d) for _, n, d in cluster.ranks[0].installs}
    assert installed == {(n, digests[n]) for n in "abc"}
    assert {slot for slot, _, _ in cluster.ranks[0].installs} <= {1, 2}


@run_async
async def test_a_swap_back_in_has_its_rows_planned_before_any_rank_answers_it(adapters):
    """One request at a time, three adapters over two slots: every adapter
    after the first two is swapped back in (each rank keeps its image). Its
    rows follow in the next plan; the ranks hold their answers to those
    installs until that plan has come, so a conductor waiting for them would
    never plan it (the test times out)."""
    async with Cluster(adapters, max_loras=2) as cluster:
        digests = {n: cluster.digest(n) for n in "abc"}
        for rank in cluster.ranks:
            rank.defer_swap_acks = True
        names = ["a", "b", "c", "a", "b", "c", "a"]
        for i, name in enumerate(names):
            await cluster.send(f"r{i}", name, max_tokens=3, digest=digests[name])
            ended = await cluster.collect(1)
    assert all(isinstance(m, Finished) and m.num_output_tokens == 3 for m in ended.values()), ended
    assert_agreed(cluster)
    assert cluster.ranks[0].swaps_followed == names[3:]  # the first three read their host copies


@run_async
async def test_a_swap_failing_on_one_rank_fails_the_requests_it_admitted_before_any_token(adapters):
    """Rank 2's swap of "a" fails after its rows were planned: those requests
    end with a 500 naming the rank, no token of theirs reaches the client
    (the rank answers the install before the step), and the next request on
    "a" installs it afresh and completes."""
    async with Cluster(adapters, max_loras=2, fail_swaps_on={2: {"a"}}) as cluster:
        digests = {n: cluster.digest(n) for n in "abc"}
        for i, name in enumerate("abc"):
            await cluster.send(f"r{i}", name, max_tokens=3, digest=digests[name])
            await cluster.collect(1)
        await cluster.send("bad", "a", max_tokens=3, digest=digests["a"])  # a swap, its rows following
        ended = await cluster.collect(1)
        await cluster.send("again", "a", max_tokens=3, digest=digests["a"])
        ended = await cluster.collect(1)
    failed = ended["bad"]
    assert isinstance(failed, Failed) and failed.status == 500, failed
    assert "'a'" in failed.message and "rank 2" in failed.message and "scripted failure" in failed.message
    assert not [m for m in cluster.others if isinstance(m, TokenDelta) and m.request_id == "bad"]
    assert isinstance(ended["again"], Finished) and ended["again"].num_output_tokens == 3
    assert cluster.ranks[0].swaps_followed == ["a"]
    # Only the failed request ran on rank 2's failed slot (zeroed, so the ranks stayed in step); every other
    # row on its adapter everywhere.
    assert all(v.startswith("rank 2: bad ran on") for v in cluster.shared["violations"]), cluster.shared["violations"]


@run_async
async def test_one_rank_failing_an_install_refuses_it_everywhere_and_fails_only_its_requests(adapters):
    async with Cluster(adapters, max_loras=2, fail_on={2: {"b"}}) as cluster:  # only rank 2 refuses "b"
        digest_a = cluster.digest("a")
        await cluster.send("ok1", "a", digest=digest_a)
        await cluster.send("bad1", "b")
        await cluster.send("bad2", "b")
        await cluster.send("base1", "base")
        ended = await cluster.collect(4)
        # The failed slot was freed everywhere: a later request on "a" still runs.
        await cluster.send("ok2", "a", digest=digest_a)
        ended = await cluster.collect(1)
    for rid in ("ok1", "ok2", "base1"):
        assert isinstance(ended[rid], Finished), ended[rid]
    for rid in ("bad1", "bad2"):
        failed = ended[rid]
        assert isinstance(failed, Failed) and failed.status == 500
        assert "'b'" in failed.message and "rank 2" in failed.message and "scripted failure" in failed.message
    assert "bad1" not in cluster.ranks[0].rows  # never ran, on no slot
    assert_agreed(cluster)


@run_async
async def test_full_pool_holds_requests_until_a_slot_frees_then_they_complete(adapters):
    async with Cluster(adapters, max_loras=1) as cluster:
        digests = {n: cluster.digest(n) for n in "ab"}
        await cluster.send("a1", "a", max_tokens=8, digest=digests["a"])
        await cluster.send("b1", "b", max_tokens=2, digest=digests["b"])
        await cluster.send("a2", "a", max_tokens=2, digest=digests["a"])
        ended = await cluster.collect(3)
    assert all(isinstance(m, Finished) and m.num_output_tokens > 0 for m in ended.values()), ended
    assert max(s.num_waiting_for_adapter for s in cluster.stats) >= 1, "the held request was not visible"
    assert all(s.num_waiting_deferred >= s.num_waiting_for_adapter for s in cluster.stats)  # deferred, as vLLM's
    assert cluster.stats[-1].num_waiting_for_adapter == 0
    assert {slot for slot, _, _ in cluster.ranks[0].installs} == {1}
    assert_agreed(cluster)
    # each first delta carries the engine's queue and prefill times: the held one queued behind a1's steps
    first = {m.request_id: m for m in cluster.others if isinstance(m, TokenDelta) and m.num_prompt_tokens}
    assert sorted(first) == ["a1", "a2", "b1"] and all(m.prefill_s > 0 and m.queued_s >= 0 for m in first.values())
    assert first["b1"].queued_s > first["a1"].queued_s


@run_async
async def test_one_slot_two_adapters_take_turns_every_request_runs_to_its_length(adapters):
    """Requests longer than a turn on one slot: the first adapter's rows are
    parked when the second's turn comes and resume when theirs comes back,
    never on a slot without their adapter (every rank's check), and each
    makes all its tokens."""
    async with Cluster(adapters, max_loras=1) as cluster:
        digests = {n: cluster.digest(n) for n in "ab"}
        for rid, name in (("a1", "a"), ("b1", "b"), ("a2", "a")):
            await cluster.send(rid, name, max_tokens=40, digest=digests[name])
        ended = await cluster.collect(3)
    assert all(isinstance(m, Finished) and m.num_output_tokens == 40 for m in ended.values()), ended
    assert_agreed(cluster)
    installs = [name for _, name, _ in cluster.ranks[0].installs]
    assert installs[:3] == ["a", "b", "a"], installs  # a, then b's turn, then a back before b1 ended
    assert cluster.ranks[0].swaps_followed[:1] == ["a"], "a's parked rows waited for the swap back's answers"
    # A turn's end rides in the plan of the leaving tenant's last step on the slot.
    after = cluster.ranks[0].installs_after
    assert after, "no turn's install rode in a plan"
    for step, name in after:
        ran = {digest for at, _, digest in cluster.ranks[0].weights_run if at == step}
        assert ran and digests[name] not in ran, (step, name, ran)
    runs = cluster.ranks[0].slots_run
    assert len(runs["a1"]) < 40 + 5 and set(runs["a1"]) == {1}


@run_async
async def test_unknown_model_is_404_and_abort_of_a_held_request_finishes_it(adapters):
    from mstar_actors.messages import Abort

    async with Cluster(adapters, max_loras=1) as cluster:
        await cluster.send("x", "nope")
        await cluster.send("a1", "a", max_tokens=30, digest=cluster.digest("a"))
        await cluster.send("b1", "b", max_tokens=2)  # held: the only slot is pinned by a1
        await cluster.to_conductor.send(Abort(request_id="b1"))
        ended = await cluster.collect(3)
    assert ended["x"].status == 404 and ended["x"].code == "model_not_found" and "'nope'" in ended["x"].message
    assert isinstance(ended["b1"], Finished) and ended["b1"].finish_reason == "abort"
    assert "b1" not in cluster.ranks[0].rows
    assert isinstance(ended["a1"], Finished)


@run_async
async def test_reload_under_one_name_serves_the_new_digest_and_never_the_stale_slot(adapters, tmp_path):
    import shutil

    folders, _ = adapters
    v1 = shutil.copytree(folders["a"], tmp_path / "v1")
    v2 = shutil.copytree(folders["b"], tmp_path / "v2")  # other weights, loaded under the name "a"
    async with Cluster(adapters, max_loras=2, runtime_dirs=[str(tmp_path)]) as cluster:
        old, new = cluster.digest("a"), cluster.digest("b")
        await cluster.to_conductor.send(LoadAdapter(request_id="load1", name="a", path=str(v1), replace=True))
        await cluster.send("old", "a", max_tokens=20, digest=old)
        await cluster.await_other(TokenDelta, "old")  # it runs on v1's slot
        await cluster.to_conductor.send(LoadAdapter(request_id="load2", name="a", path=str(v2), replace=True))
        await cluster.await_other(AdapterUpdate, "load2")  # as a client waits for the 200
        await cluster.send("new", "a", max_tokens=2, digest=new)
        ended = await cluster.collect(2)
    updates = {m.request_id: m for m in cluster.others if hasattr(m, "status")}
    assert updates["load1"].status == 200 and updates["load2"].status == 200
    assert isinstance(ended["old"], Finished) and ended["old"].num_output_tokens == 20
    # "new" ran only on a slot every rank acknowledged with the new digest (FakeRank.check_acked).
    assert [d for _, n, d in cluster.ranks[0].installs if n == "a"] == [old, new]
    assert_agreed(cluster)
