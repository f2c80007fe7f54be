"""Recurrent-state slots: the allocator on its own, then the scheduler owning
them like KV blocks (admission, backpressure, endings, preemption, choices,
prefix caching off), and a randomized property test."""

import os
import random

import pytest
from sched_factories import (
    ROOT,
    check_invariants,
    chunks_of,
    finished_of,
    make_done,
    make_request,
    make_scheduler,
    run_step,
)
from test_sched_random import Trial

from mstar_actors.messages import EngineStats, Failed, StepFailed
from mstar_actors.sched import StateSlotAllocator


def slots_of(plan) -> dict[str, int]:
    return {start.request_id: start.state_slot for start in plan.started}


def slot_gauges(sched) -> tuple[int, int]:
    stats = sched.stats()
    return stats.num_state_slots_used, stats.num_state_slots_total


# ------------------------------------------------------------- the allocator


def test_allocator_hands_out_the_lowest_free_slot():
    pool = StateSlotAllocator(3)
    assert (pool.num_slots, pool.num_used, pool.num_free) == (3, 0, 3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert (pool.num_used, pool.num_free) == (3, 0) and not pool.can_allocate()
    pool.free(1)
    assert pool.can_allocate() and not pool.is_used(1) and pool.is_used(0)
    assert pool.allocate() == 1
    pool.free(2)
    pool.free(0)
    assert pool.allocate() == 0 and pool.num_used == 2


def test_allocator_exhaustion_raises():
    pool = StateSlotAllocator(1)
    pool.allocate()
    with pytest.raises(RuntimeError, match="all 1 recurrent-state slots in use; check can_allocate"):
        pool.allocate()
    assert pool.num_used == 1


def test_allocator_refuses_double_free_and_unknown_slots():
    pool = StateSlotAllocator(2)
    slot = pool.allocate()
    pool.free(slot)
    with pytest.raises(RuntimeError, match="not in use \\(double free\\)"):
        pool.free(slot)
    with pytest.raises(RuntimeError, match="free\\(\\) of recurrent-state slot 2; slots are 0 .. 1"):
        pool.free(2)
    with pytest.raises(RuntimeError, match="slot -1"):
        pool.free(-1)
    assert pool.num_free == 2


def test_allocator_needs_a_slot():
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        StateSlotAllocator(0)


# ------------------------------------------------------------- the scheduler


def test_without_slots_nothing_changes():
    sched = make_scheduler()
    assert sched.state_slots is None and sched.enable_prefix_caching
    sched.add(make_request("r0"), ROOT)
    plan, _ = run_step(sched)
    assert slots_of(plan) == {"r0": -1} and sched.requests["r0"].state_slot == -1
    assert slot_gauges(sched) == (0, 0)
    with pytest.raises(ValueError, match="num_state_slots must be >= 0 \\(0: no recurrent state\\), got -1"):
        make_scheduler(num_state_slots=-1)


def test_slots_are_taken_at_admission_distinct_and_named_in_seq_start():
    sched = make_scheduler(num_state_slots=4)
    assert slot_gauges(sched) == (0, 4)
    for i in range(3):
        sched.add(make_request(f"r{i}"), ROOT)
    assert all(sched.requests[f"r{i}"].state_slot == -1 for i in range(3))  # queued: none yet
    plan = sched.schedule()
    assert slots_of(plan) == {"r0": 0, "r1": 1, "r2": 2}
    assert {rid: seq.state_slot for rid, seq in sched.requests.items()} == slots_of(plan)
    assert slot_gauges(sched) == (3, 4)
    check_invariants(sched)
    sched.update(make_done(plan))
    plan, _ = run_step(sched)
    assert plan.started == []  # a running sequence keeps its slot: it is named once
    assert {rid: seq.state_slot for rid, seq in sched.requests.items()} == {"r0": 0, "r1": 1, "r2": 2}


def test_no_free_slot_is_backpressure_and_the_freed_slot_goes_to_the_head():
    sched = make_scheduler(num_state_slots=2)
    sched.add(make_request("r0", max_tokens=1), ROOT)
    sched.add(make_request("r1", max_tokens=5), ROOT)
    sched.add(make_request("r2", max_tokens=5), ROOT)
    sched.add(make_request("r3", max_tokens=5), ROOT)
    plan, outputs = run_step(sched)  # KV and max_num_seqs have room for all: the slots do not
    assert slots_of(plan) == {"r0": 0, "r1": 1}
    assert list(finished_of(outputs)) == ["r0"]
    assert not any(isinstance(out, Failed) for out in outputs)
    check_invariants(sched)
    plan, _ = run_step(sched)  # r0's slot is free again; FIFO: r2 takes it, r3 keeps waiting
    assert plan.finished == ["r0"] and slots_of(plan) == {"r2": 0}
    assert [seq.request_id for seq in sched.waiting] == ["r3"] and sched.requests["r3"].state_slot == -1
    assert sched.stats().num_waiting == 1 and slot_gauges(sched) == (2, 2)
    check_invariants(sched)


def test_abort_of_a_running_sequence_frees_its_slot_for_the_next_plan():
    sched = make_scheduler(num_state_slots=2)
    sched.add(make_request("r0"), ROOT)
    sched.add(make_request("r1"), ROOT)
    plan = sched.schedule()
    assert slots_of(plan) == {"r0": 0, "r1": 1}
    [ending] = sched.abort("r0")  # while its step is in flight
    assert ending.finish_reason == "abort" and slot_gauges(sched) == (1, 2)
    sched.add(make_request("r2"), ROOT)
    sched.update(make_done(plan))
    plan = sched.schedule()  # the ranks forget r0 before r2 takes its slot
    assert plan.finished == ["r0"] and slots_of(plan) == {"r2": 0}
    check_invariants(sched)


def test_abort_of_a_waiting_sequence_holds_no_slot():
    sched = make_scheduler(num_state_slots=1)
    sched.add(make_request("r0"), ROOT)
    sched.add(make_request("r1"), ROOT)
    run_step(sched)
    assert sched.requests["r1"].state_slot == -1
    [ending] = sched.abort("r1")
    assert ending.finish_reason == "abort" and slot_gauges(sched) == (1, 1)
    check_invariants(sched)
    sched.abort("r0")
    assert slot_gauges(sched) == (0, 1) and not sched.has_work()


def test_a_failed_step_frees_the_slots_of_its_rows():
    sched = make_scheduler(num_state_slots=2)
    sched.add(make_request("r0"), ROOT)
    sched.add(make_request("r1"), ROOT)
    plan = sched.schedule()
    outputs = sched.fail_step(StepFailed(step_id=plan.step_id, rank=0, message="boom", request_ids=["r1"]))
    assert [out.request_id for out in outputs] == ["r1"]
    assert slot_gauges(sched) == (1, 2) and sched.requests["r0"].state_slot == 0
    check_invariants(sched)


def test_preemption_frees_the_slot_and_the_restart_gets_a_valid_one():
    # As test_preemption_frees_the_latest_admitted...: 6 blocks, r2 is preempted at position 8.
    sched = make_scheduler(num_blocks=6, num_state_slots=3)
    for i in range(3):
        sched.add(make_request(f"r{i}", prompt=[10 + i] * 4, max_tokens=50), ROOT)
    plan, _ = run_step(sched)
    assert slots_of(plan) == {"r0": 0, "r1": 1, "r2": 2}
    for _ in range(4):
        run_step(sched)
    plan, _ = run_step(sched)
    assert plan.finished == ["r2"] and sched.num_preemptions == 1
    assert sched.requests["r2"].state_slot == -1 and slot_gauges(sched) == (2, 3)
    check_invariants(sched)
    sched.abort("r0")
    plan = sched.schedule()
    assert plan.finished == ["r0"]
    [start] = plan.started
    assert start.request_id == "r2" and start.state_slot == sched.requests["r2"].state_slot
    assert start.state_slot in (0, 2) and start.state_slot != sched.requests["r1"].state_slot
    assert chunks_of(plan)["r2"] == (0, 9, True)  # from token 0: the ranks rebuild its state
    check_invariants(sched)


def test_each_choice_takes_its_own_slot():
    sched = make_scheduler(num_state_slots=3)
    sched.add(make_request("r0", n=2), ROOT)
    sched.add(make_request("r1", n=2), ROOT)
    plan, _ = run_step(sched)
    assert list(slots_of(plan).values()) == [0, 1, 2]  # r1's second choice waits for a slot
    assert len(plan.started) == 3 and sched.num_waiting == 1
    assert sched.waiting[0].parent_id == "r1" and sched.waiting[0].state_slot == -1
    check_invariants(sched)
    assert len(sched.abort("r0")) == 2 and slot_gauges(sched) == (1, 3)


@pytest.mark.parametrize("num_state_slots", [0, 4])
def test_prefix_caching_is_off_with_state_slots(num_state_slots):
    sched = make_scheduler(num_state_slots=num_state_slots, enable_prefix_caching=True)
    prompt = list(range(100, 112))
    endings = {}
    for rid in ["r0", "r1"]:
        sched.add(make_request(rid, prompt=prompt, max_tokens=2), ROOT)
        while sched.has_work():
            endings |= finished_of(run_step(sched)[1])
    expected = 0 if num_state_slots else 8  # two full blocks of 4 tokens, the last token left to compute
    assert endings["r1"].num_cached_tokens == expected
    assert sched.enable_prefix_caching is (num_state_slots == 0)
    assert (len(sched.prefix_index) == 0) is (num_state_slots > 0)  # never inserted either
    assert (sched.allocator.num_cached_free == 0) is (num_state_slots > 0)


def test_stats_carry_the_slot_gauges():
    sched = make_scheduler(num_state_slots=2)
    sched.add(make_request("r0"), ROOT)
    sched.schedule()
    assert sched.stats() == EngineStats(num_running=1, num_waiting=0, num_kv_blocks_used=2, num_kv_blocks_total=64,
                                        num_state_slots_used=1, num_state_slots_total=2, num_starting=1)


class SlotTrial(Trial):
    """A random trial that counts the steps run with a queue but no free slot."""

    num_backpressured = 0

    def step(self) -> bool:
        self.num_backpressured += bool(self.sched.waiting) and not self.sched.state_slots.can_allocate()
        return super().step()


def test_random_schedules_keep_every_slot_accounted_for():
    """check_invariants (after every call) and the fake worker check the slots;
    here small pools and caches make backpressure and preemption common."""
    seed = int(os.environ.get("MSTAR_SCHED_SEED", random.randrange(2**32)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    num_preemptions = num_backpressured = 0
    for _ in range(40):
        num_slots = rng.randint(1, 5)
        t = SlotTrial(random.Random(rng.randrange(2**32)), num_blocks=rng.randint(6, 24), num_state_slots=num_slots,
                      max_in_flight=rng.choice([1, 2, 3]))
        t.run(num_steps=60)
        pool = t.sched.state_slots
        assert pool.num_used == 0 and not any(pool.is_used(slot) for slot in range(num_slots))
        num_preemptions += t.sched.num_preemptions
        num_backpressured += t.num_backpressured
    assert num_preemptions > 0, "the random configs should exercise preemption"
    assert num_backpressured > 0, "the random configs should exhaust the slots"
