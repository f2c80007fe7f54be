"""Adapter churn: the pool's time slices (a waiter takes a slot when its
tenant's turn ends, the tenant's rows parked and resumed on the next slot
their adapter gets; arrival order; resident adapters never held up for
nothing), held host copies, and the policy simulation (churn_sim.py) as a
regression check."""

from __future__ import annotations

import churn_sim as sim
import pytest

from mstar_actors.config import Config, LoraConfig, ModelConfig
from mstar_actors.lora.adapter_pool import AdapterPool, Admit, MoveRows
from mstar_actors.sched.scheduler import PARKED
from mstar_actors.messages import (
    AdapterHostRef,
    AdapterInstalled,
    AdapterRead,
    AdapterReadFailed,
    DropAdapter,
    Failed,
    Finished,
    InstallAdapter,
    LoadAdapter,
    Prepared,
    ReadAdapter,
    SamplingParams,
    UnloadAdapter,
)


class Driver:
    """One pool; reads and installs are answered only when the test says so."""

    def __init__(self, max_loras: int = 2, names: str = "abc", max_cpu_loras: int = 0):
        config = Config(model=ModelConfig(path="unused", name="base"),
                        lora=LoraConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras or 8,
                                        adapters={n: f"/adapters/{n}" for n in names},
                                        allow_runtime_updates=True, adapter_dirs=["/adapters"]))
        self.adapter_pool = AdapterPool.from_config(config, "base", num_ranks=1)
        self.adapter_pool.max_cpu_loras = max_cpu_loras
        self.admitted: dict[str, int] = {}  # request id -> slot
        self.parked: set[str] = set()  # admitted, their slot lent to another adapter
        self.reads: list[str] = []  # names asked, in order (all of them, answered or not)
        self.unanswered: list[str] = []
        self.installs: list[InstallAdapter] = []
        self.unacked: list[InstallAdapter] = []
        self.drops: list[str] = []
        self.holds: dict[str, int] = {}
        self.finished: list[str] = []
        self.failed: list[str] = []

    def handle(self, outs: list) -> None:
        for out in outs:
            match out:
                case Admit(prepared=prepared, slot=slot):
                    self.admitted[prepared.request_id] = slot
                case MoveRows(request_ids=ids, slot=slot) if slot < 0:
                    assert all(rid in self.admitted for rid in ids), ids
                    self.parked.update(ids)
                    for rid in ids:
                        del self.admitted[rid]
                case MoveRows(request_ids=ids, slot=slot):
                    assert set(ids) <= self.parked, ids
                    self.parked.difference_update(ids)
                    self.admitted.update(dict.fromkeys(ids, slot))
                case ReadAdapter(name=name):
                    self.reads.append(name)
                    self.unanswered.append(name)
                case InstallAdapter():
                    self.installs.append(out)
                    self.unacked.append(out)
                case DropAdapter(name=name):
                    self.drops.append(name)
                    self.holds[name] -= 1
                    assert self.holds[name] >= 0, f"{name}: dropped more holds than it had"
                case Finished(request_id=request_id):
                    self.finished.append(request_id)
                case Failed(request_id=request_id):
                    self.failed.append(request_id)

    def send(self, request_id: str, model: str, *, same_step: bool = False) -> None:
        """A request of 4 tokens; a step after the last one (so it would hold a
        draining slot longer than the requests on it) unless ``same_step``."""
        if not same_step:
            self.step()
        self.handle(self.adapter_pool.add(Prepared(request_id=request_id, model=model, prompt_token_ids=[1, 2],
                                           sampling=SamplingParams(max_tokens=4))))

    def step(self, n: int = 1) -> None:
        """``n`` planned steps (each may end a turn)."""
        for _ in range(n):
            self.handle(self.adapter_pool.step())

    def settle(self) -> None:
        """Answer every read, then ack every install, until nothing is pending."""
        while self.unanswered or self.unacked:
            self.answer_reads()
            self.ack_installs()

    def answer_reads(self) -> None:
        while self.unanswered:
            name = self.unanswered.pop(0)
            self.holds[name] = self.holds.get(name, 0) + 1
            msg = AdapterRead(name=name, path=f"/adapters/{name}", digest=f"d-{name}",
                              host=AdapterHostRef(segment=f"seg-{name}", nbytes=1), max_rank=8)
            self.handle(self.adapter_pool.on_read(msg))

    def ack_installs(self) -> None:
        while self.unacked:
            install = self.unacked.pop(0)
            self.handle(self.adapter_pool.on_installed(AdapterInstalled(rank=0, slot=install.slot, digest=install.digest,
                                                                ok=True)))

    def end(self, request_id: str) -> None:
        self.handle(self.adapter_pool.end(request_id))

    def slot_of_adapter(self, name: str) -> int | None:
        """The slot holding the served version of ``name``."""
        return self.adapter_pool.table.lookup(name, self.adapter_pool.adapters[name].digest)


def running(resident: str, max_loras: int = 2, **kw) -> Driver:
    """A driver with one request admitted on each adapter in ``resident`` (``x1``)."""
    d = Driver(max_loras=max_loras, **kw)
    for name in resident:
        d.send(f"{name}1", name)
        d.settle()
        assert f"{name}1" in d.admitted
    return d


def test_a_waiter_takes_a_slot_when_its_tenants_turn_ends():
    """Both resident adapters keep admitting while c waits; when the tenant
    of the reserved slot has had its quantum, its rows are parked (not
    ended) and c installs there; the other slot keeps serving throughout."""
    d = running("ab")
    slot_a, slot_b = d.slot_of_adapter("a"), d.slot_of_adapter("b")
    d.send("c1", "c")
    d.settle()
    assert "c1" not in d.admitted
    for i in range(2, 5):  # new rows join both slots, the reserved one too
        d.send(f"a{i}", "a")
        d.send(f"b{i}", "b")
    assert all(f"a{i}" in d.admitted and f"b{i}" in d.admitted for i in range(2, 5))
    d.step(int(d.adapter_pool.quantum))
    assert d.parked == {"a1", "a2", "a3", "a4"}
    assert [i.name for i in d.unacked] == ["c"] and d.unacked[0].slot == slot_a
    d.settle()
    assert d.admitted["c1"] == slot_a and d.slot_of_adapter("b") == slot_b
    assert all(d.admitted[f"b{i}"] == slot_b for i in range(1, 5))


def test_parked_rows_resume_on_the_next_slot_their_adapter_gets():
    """a's parked rows reserve a slot of their own (b's, the older tenant),
    and resume there on the same version when b's turn ends, half a quantum
    later (turns end staggered); then c's ends and b comes back: a round
    robin whose rows move between slots, never onto one without their adapter."""
    d = running("ab")
    slot_a, slot_b = d.slot_of_adapter("a"), d.slot_of_adapter("b")
    half = int(d.adapter_pool.quantum) // 2
    d.send("c1", "c")
    d.step(2 * half)
    d.settle()
    assert d.parked == {"a1"} and d.admitted["c1"] == slot_a
    d.step(half)
    d.settle()
    assert d.admitted["a1"] == slot_b and d.parked == {"b1"} and d.slot_of_adapter("a") == slot_b
    d.step(half)
    d.settle()
    assert d.admitted["b1"] == slot_a and d.parked == {"c1"}


def test_no_starvation_the_waiter_gets_in_though_no_request_ever_ends():
    """Resident requests keep arriving and none ends: the waiter still gets a
    slot after one quantum, not after the requests on it."""
    d = running("ab")
    d.send("c1", "c")
    for i in range(2, 40):
        d.send(f"a{i}", "a")
        d.send(f"b{i}", "b")
        d.settle()
        if "c1" in d.admitted:
            break
    assert "c1" in d.admitted
    assert i <= int(d.adapter_pool.quantum) + 2


def test_older_waiters_get_slots_first_across_adapters():
    d = running("ab", names="abcd")
    d.send("c1", "c")
    d.send("d1", "d")
    d.settle()
    slot_b = d.slot_of_adapter("b")
    d.end("b1")  # "b"'s slot frees first, though "a"'s was reserved for "c": "c" is older, it goes first
    d.settle()
    assert d.admitted.get("c1") == slot_b and "d1" not in d.admitted
    d.end("a1")
    d.settle()
    assert "d1" in d.admitted


def test_a_reservation_ends_when_its_waiter_is_aborted():
    d = running("ab")
    d.send("c1", "c")
    d.send("a2", "a")
    assert "a2" in d.admitted  # the reserved slot still takes rows until its turn ends
    d.handle(d.adapter_pool.abort("c1"))
    assert "c1" in d.finished
    d.step(2 * int(d.adapter_pool.quantum))
    assert not d.parked and not d.unacked  # nobody waits: nobody is parked


def test_a_parked_choice_that_ends_releases_nothing_twice():
    """A parked row aborted (the scheduler ends it) is simply forgotten; its
    adapter's other parked rows still resume."""
    d = running("ab")
    d.send("a2", "a", same_step=True)
    d.send("c1", "c")
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert d.parked == {"a1", "a2"}
    d.end("a1")  # aborted while parked
    d.parked.discard("a1")
    d.step(int(d.adapter_pool.quantum) // 2)
    d.settle()
    assert d.admitted.get("a2") is not None and d.parked == {"b1"}
    slot = d.admitted["a2"]
    d.end("a2")  # the slot empties: b's parked row takes it at once, no turn to wait for
    d.settle()
    assert d.admitted["b1"] == slot and not d.parked and d.adapter_pool.table.num_pins(slot) == 1


def test_recently_used_host_copies_stay_held_so_swapping_back_needs_no_read():
    d = running("ab", max_cpu_loras=3)
    d.send("c1", "c")
    d.end("a1")
    d.settle()
    d.end("b1")
    d.end("c1")
    d.send("a2", "a")  # "a" was evicted from its slot; its host copy is still held
    assert d.unacked and d.unacked[-1].name == "a" and d.reads == ["a", "b", "c"]
    d.settle()
    assert "a2" in d.admitted and d.drops == []


def test_held_copies_fit_the_readers_tier_and_unloaded_ones_are_dropped():
    d = running("ab", max_cpu_loras=2)
    d.end("a1")
    d.end("b1")
    d.send("c1", "c")
    d.settle()
    assert d.drops == ["a"]  # the least recently used, to keep two held
    d.handle(d.adapter_pool.unload(UnloadAdapter(request_id="u", name="b")))
    assert d.drops == ["a", "b"]
    assert d.holds == {"a": 0, "b": 0, "c": 1}


def test_a_refused_request_of_several_choices_frees_each_choices_pin():
    """The scheduler refuses a whole request (a prompt past max_model_len) by
    its own id: every admitted choice's pin and slot record go (they were kept
    for ever: the slot could never be swapped; a base request's ids piled up)."""
    d = Driver(max_loras=1)
    for model, rid in (("a", "r"), ("base", "s")):
        d.handle(d.adapter_pool.add(Prepared(request_id=rid, model=model, prompt_token_ids=[1, 2],
                                             sampling=SamplingParams(max_tokens=4), n=3)))
        d.settle()
    slot = d.slot_of_adapter("a")
    assert d.adapter_pool.table.num_pins(slot) == 3
    d.end("r")
    d.end("s")
    assert d.adapter_pool.table.num_pins(slot) == 0 and d.adapter_pool._slot_of == {}
    d.send("b1", "b")  # the slot can be taken by another adapter now
    d.settle()
    assert "b1" in d.admitted


def test_the_frontends_hear_of_an_unload_before_its_answer():
    """A client's next request, through another frontend, comes after the 200: that frontend must know."""
    from mstar_actors.messages import AdapterUpdate, ModelsChanged

    d = running("ab")
    outs = d.adapter_pool.unload(UnloadAdapter(request_id="u", name="b"))
    kinds = [type(out) for out in outs if isinstance(out, (AdapterUpdate, ModelsChanged))]
    assert kinds == [ModelsChanged, AdapterUpdate], outs


def test_without_a_tier_every_unneeded_hold_is_dropped():
    d = running("ab", max_cpu_loras=0)
    d.end("a1")
    assert d.drops == ["a"]  # b1 runs on b's: held (a park would need it)
    d.end("b1")
    assert d.drops == ["a", "b"]


# ---- the policy benchmark ----------------------------------------------------------


def churn_and_calm(concurrency: int, kw: dict):
    """The simulated churn run (3 adapters over 2 slots) and the same with every adapter resident."""
    churn = sim.simulate(concurrency, **kw)
    calm = sim.simulate(concurrency, **{**kw, "max_loras": 3})
    print(f"seed none (deterministic); c={concurrency}: {churn.tokens_per_step:.2f} vs {calm.tokens_per_step:.2f} "
          f"tokens/step, TTFT p90 {churn.ttft(90)} max {max(churn.ttft_steps)} steps")
    assert churn.num_requests == calm.num_requests
    return churn, calm


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_churn_keeps_the_batch_busy_and_the_wait_bounded(concurrency):
    """3 adapters round robin over 2 slots. Before the drain policy: 57% / 42%
    of no-churn tokens per step at c=8 / 32 and waits of hundreds of steps."""
    kw = dict(max_tokens=32, install_steps=3, read_steps=1)
    churn, calm = churn_and_calm(concurrency, kw)
    assert churn.tokens_per_step >= 0.58 * calm.tokens_per_step
    # A waiter waits for at most the drain reserved before its own, then its own, then its install.
    one_request = kw["max_tokens"] + 1
    assert max(churn.ttft_steps) <= 2 * one_request + kw["install_steps"] + kw["read_steps"] + 2
    assert churn.num_reads == 3  # each adapter read once: swaps reuse the held host copies


def test_sim_catches_a_row_on_an_unacknowledged_slot(monkeypatch):
    """The simulation's own check: admitting before the acks is caught."""
    from mstar_actors.lora import slot_table

    monkeypatch.setattr(slot_table.SlotTable, "is_ready", lambda self, slot: False)
    with pytest.raises(sim.SimError, match="started on slot"):
        sim.simulate(2, max_tokens=4, num_requests=4)



def test_a_request_of_n_choices_pins_its_slot_once_per_choice():
    d = Driver(max_loras=1)

    def add(request_id: str, model: str, n: int) -> None:
        d.handle(d.adapter_pool.add(Prepared(request_id=request_id, model=model, prompt_token_ids=[1, 2],
                                     sampling=SamplingParams(max_tokens=4), n=n)))

    add("r", "a", n=3)
    d.settle()
    slot = d.admitted["r"]
    assert d.adapter_pool.table.num_pins(slot) == 3
    add("w", "b", n=2)  # the one slot is pinned: w waits for it
    d.settle()
    assert "w" not in d.admitted
    d.handle(d.adapter_pool.abort("w"))  # ended as a whole: one Finished per choice
    assert d.finished == ["w-0", "w-1"]
    d.end("r-0")
    d.end("r-1")
    assert d.adapter_pool.table.num_pins(slot) == 1
    d.end("r-2")
    assert d.adapter_pool.table.num_pins(slot) == 0


def test_parked_rows_whose_reinstall_fails_end_as_failed_with_the_reason():
    from mstar_actors.messages import Failed

    d = running("ab")
    d.send("c1", "c")
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert d.parked == {"a1"}
    d.step(int(d.adapter_pool.quantum) // 2)  # b's turn ends: a's reinstall goes out
    install = d.unacked.pop(0)
    assert install.name == "a"
    outs = d.adapter_pool.on_installed(AdapterInstalled(rank=0, slot=install.slot, digest=install.digest, ok=False,
                                                        error="the disk is gone"))
    failed = [out for out in outs if isinstance(out, Failed)]
    assert [f.request_id for f in failed] == ["a1"] and failed[0].status == 500
    assert "the disk is gone" in failed[0].message and "'a'" in failed[0].message


def test_parked_rows_resume_from_their_held_copy_with_no_read_though_one_copy_is_kept():
    """With one host copy kept, b's copy (b1 running, its file there) was
    dropped, and b1's resume read its files again, which might be gone by
    then. The copy of a version rows run on is held: the resume reads
    nothing."""
    d = running("ab", max_cpu_loras=1)
    reads = len(d.reads)
    d.send("c1", "c")
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    d.step(int(d.adapter_pool.quantum) // 2)
    d.settle()
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert not d.failed and {"a1", "b1", "c1"} <= set(d.admitted) | d.parked
    assert d.reads[reads:] == ["c"]  # only c's, never a's or b's again


@pytest.mark.parametrize("code", ["invalid_adapter", "adapter_path_not_allowed"])
def test_a_served_adapter_whose_files_are_gone_is_unloaded_with_a_404_naming_the_reason(code):
    """c's first read (no host copy yet) fails: its files are gone. c1 gets a
    404 with the reader's reason (not a 500: nothing is wrong with the
    server, the model is no longer there), /v1/models stops listing c, a
    later request is refused at once without a read, and a load brings it
    back."""
    from mstar_actors.messages import AdapterReadFailed, ModelsChanged

    d = Driver()
    d.send("c1", "c")
    assert d.unanswered == ["c"]
    d.unanswered.clear()
    outs = d.adapter_pool.on_read_failed(AdapterReadFailed(name="c", path="/adapters/c", code=code,
                                                           message="adapter 'c': there is no folder /adapters/c"))
    failed = [out for out in outs if isinstance(out, Failed)]
    assert [(f.request_id, f.status, f.code, f.param, f.error_type) for f in failed] == [
        ("c1", 404, "model_not_found", "model", "invalid_request_error")]
    assert "was unloaded" in failed[0].message and "there is no folder /adapters/c" in failed[0].message
    changed = [out for out in outs if isinstance(out, ModelsChanged)]
    assert [[a.name for a in m.adapters] for m in changed] == [["a", "b"]]
    reads = len(d.reads)
    outs = d.adapter_pool.add(Prepared(request_id="c2", model="c", prompt_token_ids=[1], sampling=SamplingParams()))
    assert [(o.status, o.code) for o in outs if isinstance(o, Failed)] == [(404, "model_not_found")]
    assert len(d.reads) == reads
    d.handle(d.adapter_pool.load(LoadAdapter(request_id="l", name="c", path="/adapters/c")))
    d.answer_reads()
    d.send("c3", "c")
    d.settle()
    assert d.admitted.get("c3") is not None


@pytest.mark.parametrize("case", ["machine", "no_runtime_updates"])
def test_a_failed_read_keeps_the_adapter_where_it_may_pass_or_could_not_be_loaded_again(case):
    """Shared memory full is the machine's failure, not the files': c stays
    served (a later read may pass). With runtime updates off nothing could
    load c again: it stays too. Either way its waiter fails with the reason."""
    from mstar_actors.messages import AdapterReadFailed, ModelsChanged

    d = Driver()
    d.adapter_pool.allow_runtime_updates = case == "machine"
    d.send("c1", "c")
    d.unanswered.clear()
    code = "adapter_read_error" if case == "machine" else "invalid_adapter"
    outs = d.adapter_pool.on_read_failed(AdapterReadFailed(name="c", path="/adapters/c", code=code,
                                                           message="OSError: [Errno 28] No space left on device"))
    assert [(o.request_id, o.status) for o in outs if isinstance(o, Failed)] == [("c1", 500)]
    assert not [o for o in outs if isinstance(o, ModelsChanged)] and "c" in d.adapter_pool.adapters
    d.send("c2", "c")
    assert d.unanswered == ["c"]  # read again
    d.settle()
    assert "c2" in d.admitted


def test_a_failed_read_with_a_load_of_the_name_queued_leaves_its_waiter_to_the_load():
    from mstar_actors.messages import AdapterReadFailed

    d = Driver()
    d.send("c1", "c")
    d.handle(d.adapter_pool.load(LoadAdapter(request_id="l", name="c", path="/adapters/c", replace=True)))
    assert d.unanswered == ["c", "c"]
    d.unanswered.pop(0)
    outs = d.adapter_pool.on_read_failed(AdapterReadFailed(name="c", path="/adapters/c", message="replaced"))
    d.handle(outs)
    assert not d.failed and "c" in d.adapter_pool.adapters
    d.settle()
    assert "c1" in d.admitted


def park_a_for_c(d) -> None:
    """c's request comes; a's rows run out their turn and are parked for it."""
    d.send("c1", "c")
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert d.parked == {"a1"}


def let_a_resume(d) -> None:
    """Half a turn more: a's rows are installed again and resume."""
    d.step(int(d.adapter_pool.quantum) // 2)
    d.settle()


def test_an_unloaded_adapters_parked_rows_still_resume_and_finish():
    d = running("ab", max_cpu_loras=4)
    park_a_for_c(d)
    d.handle(d.adapter_pool.unload(UnloadAdapter(request_id="u", name="a")))
    let_a_resume(d)
    assert "a1" in d.admitted and "a1" not in d.parked  # resumed on its own version, read nowhere again
    d.send("a9", "a")
    assert "a9" not in d.admitted  # new requests naming it are refused (404)


@pytest.mark.parametrize("update, max_cpu_loras", [("unload", 4), ("unload", 1), ("reload", 4)])
def test_an_adapter_unloaded_or_reloaded_while_its_rows_run_keeps_their_copy_until_they_end(update, max_cpu_loras):
    """The unload (or a reload under the name) comes while a's rows are on
    their slot, before any park; a waiter then takes the slot and parks them:
    the host copy of their version stays held, so they install it again,
    resume and finish, and only then is it dropped. With one host copy kept,
    a's was dropped, and the parked rows failed mid-stream."""
    d = running("ab", max_cpu_loras=max_cpu_loras)
    if update == "unload":
        d.handle(d.adapter_pool.unload(UnloadAdapter(request_id="u", name="a")))
    else:
        d.handle(d.adapter_pool.load(LoadAdapter(request_id="l", name="a", path="/adapters/a2", replace=True)))
        name = d.unanswered.pop(0)
        d.holds[name] += 1
        d.handle(d.adapter_pool.on_read(AdapterRead(name="a", path="/adapters/a2", digest="d-a2",
                                                    host=AdapterHostRef(segment="seg-a2", nbytes=1), max_rank=8)))
    assert "a" not in d.drops  # a1 still runs on that version
    park_a_for_c(d)
    let_a_resume(d)
    assert "a1" in d.admitted and not d.failed  # resumed on its own version
    d.end("a1")
    d.step()
    d.settle()
    assert d.drops.count("a") >= 1  # gone once nothing needs that version


def test_a_second_load_under_a_name_being_loaded_is_refused_unless_it_replaces():
    d = Driver(names="ab")
    load = d.adapter_pool.load(LoadAdapter(request_id="l1", name="z", path="/adapters/z1"))
    assert [type(out) for out in load] == [ReadAdapter]
    (refused,) = d.adapter_pool.load(LoadAdapter(request_id="l2", name="z", path="/adapters/z2"))
    assert (refused.status, refused.code) == (400, "adapter_already_loaded") and "load_inplace" in refused.message
    (refused,) = d.adapter_pool.load(LoadAdapter(request_id="l3", name="a", path="/adapters/a2"))  # served already
    assert refused.code == "adapter_already_loaded"
    assert [type(out) for out in d.adapter_pool.load(LoadAdapter(request_id="l4", name="z", path="/adapters/z2",
                                                                 replace=True))] == [ReadAdapter]


def test_a_swap_is_sent_with_its_rows_only_when_every_rank_said_it_keeps_the_image_and_nothing_is_in_flight():
    """``rows_follow``: the request is admitted with the install, not after
    its answers, only where the install is a swap on every rank (each rank's
    last answer names the digest in ``kept``) and no other install is in
    flight (one could change what a rank keeps); otherwise it waits."""

    def ack(pool: AdapterPool, install: InstallAdapter, rank: int, kept: list[str]) -> list:
        return pool.on_installed(AdapterInstalled(rank=rank, slot=install.slot, digest=install.digest, ok=True,
                                                  kept=kept))

    d = Driver(max_loras=1, names="ab", max_cpu_loras=4)  # host copies held: a swap back needs no read
    d.adapter_pool.num_ranks = 2
    d.adapter_pool.table.num_ranks = 2
    d.send("a1", "a")
    d.answer_reads()
    (install,) = d.unacked
    assert not install.rows_follow and "a1" not in d.admitted  # no rank has said what it keeps yet
    d.handle(ack(d.adapter_pool, install, 0, ["d-a"]))
    assert "a1" not in d.admitted
    d.handle(ack(d.adapter_pool, install, 1, ["d-a"]))
    assert d.admitted["a1"] == install.slot
    d.unacked.clear()
    d.end("a1")
    d.send("b1", "b")  # no rank keeps b: an install from the host copy, its rows wait
    d.answer_reads()
    (install,) = d.unacked
    assert not install.rows_follow and "b1" not in d.admitted
    d.handle(ack(d.adapter_pool, install, 0, ["d-a", "d-b"]))
    d.handle(ack(d.adapter_pool, install, 1, ["d-b"]))  # rank 1 let a's image go
    d.unacked.clear()
    d.end("b1")
    d.send("a2", "a")  # rank 1 keeps no image of a: its rows wait
    (install,) = d.unacked
    assert not install.rows_follow and "a2" not in d.admitted
    d.handle(ack(d.adapter_pool, install, 0, ["d-b", "d-a"]))
    d.handle(ack(d.adapter_pool, install, 1, ["d-b", "d-a"]))
    d.unacked.clear()
    d.end("a2")
    d.send("b2", "b")  # kept everywhere, nothing in flight: a swap, admitted with it
    (install,) = d.unacked
    assert install.rows_follow and d.admitted["b2"] == install.slot
    d.send("b3", "b")  # joins the same swap at once
    assert d.admitted["b3"] == install.slot


def test_a_runtime_loaded_adapter_is_read_confined_every_time_and_a_configured_one_is_not():
    """The pool tells the reader which reads stay inside lora.adapter_dirs (``ReadAdapter.confined``): a runtime
    load's, its first read and every later one (a host copy evicted, read again for an install); never a configured
    adapter's, whose files are read where their links lead."""
    from mstar_actors.messages import AdapterHostRef, AdapterRead, LoadAdapter, ReadAdapter

    pool = Driver(names="a").adapter_pool
    configured = pool._ensure_read(pool.adapters["a"])
    assert [(r.name, r.confined) for r in configured] == [("a", False)]
    pool.on_read(AdapterRead(name="a", path="/adapters/a", digest="d0", host=AdapterHostRef(segment="s0", nbytes=1),
                             max_rank=8))
    [load] = pool.load(LoadAdapter(request_id="l1", name="b", path="/adapters/b", replace=False))
    assert isinstance(load, ReadAdapter) and load.confined and load.refresh
    pool.on_read(AdapterRead(name="b", path="/adapters/b", digest="d1", host=AdapterHostRef(segment="s", nbytes=1),
                             max_rank=8))
    again = pool._ensure_read(pool.adapters["b"])
    assert [(r.name, r.path, r.confined) for r in again] == [("b", "/adapters/b", True)]


def reload_a(d) -> None:
    """A runtime reload of ``a`` from new files (digest ``d-a2``), answered at once."""
    d.handle(d.adapter_pool.load(LoadAdapter(request_id="l", name="a", path="/adapters/a2", replace=True)))
    d.holds[d.unanswered.pop(0)] += 1
    d.handle(d.adapter_pool.on_read(AdapterRead(name="a", path="/adapters/a2", digest="d-a2",
                                                host=AdapterHostRef(segment="seg-a2", nbytes=1), max_rank=8)))


def test_choices_parked_before_a_reload_never_take_the_new_versions_slot():
    """A request on the reloaded version takes a's slot at its turn's end, a1 (the old version) parked: a1
    looking for its version found the name's slot, holding the new one, and took it from under its rows
    (no request found it again, so the new version's requests all waited for an install)."""
    d = running("ab", max_cpu_loras=4)
    reload_a(d)
    d.send("a5", "a")  # the new version: it reserves a's slot, whose rows (the old version's) park at the turn's end
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert d.parked == {"a1"} and "a5" in d.admitted
    d.send("a6", "a", same_step=True)
    assert d.admitted.get("a6") == d.admitted["a5"]  # the new version's slot, found and shared
    for rid in ("a5", "a6", "b1"):
        d.end(rid)
    d.step(int(d.adapter_pool.quantum))
    d.settle()
    assert "a1" in d.admitted and not d.failed  # resumed on its own version


def test_a_waiter_of_an_adapter_unloaded_and_loaded_again_takes_the_loaded_one():
    """A read answer was given to the adapter of its name: after an unload and a load of that name, the
    answer to the waiter's own read reached the loaded adapter, the waiter's stayed reading for ever."""
    d = Driver(max_loras=1, names="ab")
    d.send("r1", "a")
    assert d.unanswered == ["a"]
    d.handle(d.adapter_pool.unload(UnloadAdapter(request_id="u", name="a")))
    d.handle(d.adapter_pool.load(LoadAdapter(request_id="l", name="a", path="/adapters/a2")))
    d.unanswered.pop(0)  # the waiter's read fails (a load is queued: the waiter goes with it)
    d.handle(d.adapter_pool.on_read_failed(AdapterReadFailed(name="a", path="/adapters/a", message="EIO",
                                                             code="adapter_read_error")))
    d.unanswered.remove("a")  # the load's read
    d.holds["a"] = d.holds.get("a", 0) + 1
    d.handle(d.adapter_pool.on_read(AdapterRead(name="a", path="/adapters/a2", digest="d-a2",
                                                host=AdapterHostRef(segment="seg-a2", nbytes=1), max_rank=8)))
    d.settle()
    assert "r1" in d.admitted and not d.failed


def test_rows_of_an_unloaded_version_whose_copy_is_gone_run_on_rather_than_park():
    """Admitted on its resident slot after its host copy was dropped, then unloaded: parked for a waiter,
    nothing could install it again and its rows failed mid-stream (500); they now keep the slot until
    they end, and the waiter takes it then."""
    d = Driver(max_loras=1, names="ab")
    d.send("r0", "a")
    d.answer_reads()
    d.handle(d.adapter_pool.abort("r0"))  # gone before its install's answer: nothing holds a's copy
    d.ack_installs()
    assert d.drops == ["a"]
    d.send("r1", "a")
    assert "r1" in d.admitted
    d.handle(d.adapter_pool.unload(UnloadAdapter(request_id="u", name="a")))
    d.send("r2", "b")
    d.step(4 * int(d.adapter_pool.quantum))
    d.settle()
    assert not d.failed and not d.parked and "r2" not in d.admitted
    d.end("r1")
    d.settle()
    assert "r2" in d.admitted


def test_a_slot_reserved_for_a_new_version_never_hands_itself_back_to_the_old_one():
    """A slot holding a's old version, its choices running, is reserved for a request on the reloaded version
    (whose copy is still being read): its rows parked, they found their version resident and a reservation for
    their name, resumed, were parked again, for ever (the pool's loop never returned). Reservations are per
    version now: the parked wait for their own turn."""
    import threading

    from mstar_actors.lora.adapter_pool import _Adapter

    pool = AdapterPool("base", max_loras=1, allow_runtime_updates=True, max_cpu_loras=0, quantum_steps=1)
    pool.adapters["a"] = _Adapter("a", "/p/a")
    host = AdapterHostRef(segment="seg", nbytes=1)

    def prepared(rid: str) -> Prepared:
        return Prepared(request_id=rid, model="a", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4))

    pool.add(prepared("r1"))
    (install,) = [o for o in pool.on_read(AdapterRead(name="a", path="/p/a", digest="d1", host=host, max_rank=8))
                  if isinstance(o, InstallAdapter)]
    assert [type(o) for o in pool.on_installed(AdapterInstalled(rank=0, slot=install.slot, digest="d1", ok=True))] \
        == [Admit]
    pool.load(LoadAdapter(request_id="l", name="a", path="/p/a2", replace=True))
    pool.on_read(AdapterRead(name="a", path="/p/a2", digest="d2", host=host, max_rank=8))
    assert [type(o) for o in pool.add(prepared("r2"))] == [ReadAdapter]  # its copy was dropped: read again
    outs: list = []
    settle = threading.Thread(target=lambda: outs.extend(pool.stalled()), daemon=True)
    settle.start()
    settle.join(timeout=10)
    assert not settle.is_alive(), "the pool's settle never returned"
    assert MoveRows(("r1-0",), PARKED) in outs or MoveRows(("r1",), PARKED) in outs, outs
