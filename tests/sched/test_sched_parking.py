"""Parked sequences (adapter churn): left out of every plan while parked,
holding their blocks; the others, the head of the queue too, go on without
them; resumed, their chunks name the new LoRA slot."""

from __future__ import annotations

from sched_factories import ROOT, make_done, make_request, make_scheduler, run_step

from mstar_actors.sched import PARKED


def rows(plan) -> dict[str, int]:
    return {c.request_id: c.lora_slot for c in plan.scheduled}


def test_a_parked_running_sequence_skips_steps_keeps_its_blocks_and_resumes_on_the_new_slot():
    sched = make_scheduler()
    sched.add(make_request("a"), ROOT, lora_slot=1)
    sched.add(make_request("b"), ROOT, lora_slot=2)
    plan, _ = run_step(sched)
    assert rows(plan) == {"a": 1, "b": 2}
    blocks = list(sched.requests["a"].block_ids)
    sched.set_lora_slot(["a"], PARKED)
    for _ in range(3):
        plan, _ = run_step(sched)
        assert rows(plan) == {"b": 2}
    # in no step, it waits for its adapter: vLLM's gauges count it so (it was "running", 0 waiting); admission
    # still counts its seat taken (the others go on past it)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_parked, stats.num_waiting_for_adapter,
            stats.num_waiting_deferred) == (2, 0, 1, 1, 1)
    assert sched.requests["a"].block_ids == blocks and sched.requests["a"].lora_slot == PARKED
    done = sched.requests["a"].num_computed
    sched.set_lora_slot(["a"], 2)
    plan, _ = run_step(sched)
    assert rows(plan)["a"] == 2 and sched.requests["a"].num_computed == done + 1


def test_a_parked_head_of_the_queue_lets_the_others_in_and_keeps_its_place():
    sched = make_scheduler()
    for rid, slot in (("p", 1), ("q", 2), ("r", 2)):
        sched.add(make_request(rid), ROOT, lora_slot=slot)
    sched.set_lora_slot(["p"], PARKED)  # parked before it ever ran
    plan, _ = run_step(sched)
    assert [s.request_id for s in plan.started] == ["q", "r"]
    assert [s.request_id for s in sched.waiting] == ["p"]
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_deferred, stats.num_starting) == (2, 1, 1, 0)
    sched.set_lora_slot(["p"], 1)
    plan, _ = run_step(sched)
    assert [s.request_id for s in plan.started] == ["p"] and plan.started[0].lora_slot == 1


def test_nothing_to_plan_while_every_live_sequence_is_parked():
    sched = make_scheduler()
    sched.add(make_request("a"), ROOT, lora_slot=1)
    run_step(sched)
    sched.set_lora_slot(["a"], PARKED)
    assert sched.has_work() and sched.schedule() is None  # the conductor asks the pool (``stalled``)
    sched.set_lora_slot(["a"], 1)
    plan = sched.schedule()
    assert rows(plan) == {"a": 1}
    sched.update(make_done(plan))


def test_an_aborted_parked_sequence_frees_its_blocks_and_ids_of_ended_ones_are_skipped():
    sched = make_scheduler(num_blocks=8)
    sched.add(make_request("a"), ROOT, lora_slot=1)
    run_step(sched)
    sched.set_lora_slot(["a"], PARKED)
    free = sched.allocator.num_free
    finished = sched.abort("a")
    assert [f.request_id for f in finished] == ["a"] and sched.allocator.num_free > free
    sched.set_lora_slot(["a", "gone"], 1)  # ended meanwhile: no-op
    assert not sched.has_work()


def test_a_steps_decodes_are_grouped_by_lora_slot_in_arrival_order_within_one():
    """Decodes come out by LoRA slot, base first, each slot's oldest first, so
    a step's rows of one adapter sit side by side (the folded expands' tiles
    of rows mostly hold one adapter); the prefills follow them."""
    sched = make_scheduler(max_num_batched_tokens=64)  # every prompt in the first step
    order = [("a", 2), ("b", 0), ("c", 1), ("d", 2), ("e", 0), ("f", 1)]
    for rid, slot in order:
        sched.add(make_request(rid), ROOT, lora_slot=slot)
    run_step(sched)  # the prompts, in arrival order
    sched.add(make_request("late", num_prompt_tokens=3), ROOT, lora_slot=1)
    plan, _ = run_step(sched)
    assert [(c.request_id, c.lora_slot) for c in plan.scheduled] == [
        ("b", 0), ("e", 0), ("c", 1), ("f", 1), ("a", 2), ("d", 2), ("late", 1)]
