"""Planning one step ahead (``Scheduler(max_in_flight=2)``): what the next
plan assumes of the step in flight, ends applied one step late, and a failed
step with a later one in flight; two steps ahead (``max_in_flight=3``) by the
same rules. The randomized trials run this mode too
(``test_sched_random``)."""

import pytest
from sched_factories import EOS, ROOT, assert_no_blocks_used, check_invariants, make_done, make_request, make_scheduler

from mstar_actors.messages import Failed, Finished, StepFailed, TokenDelta


def ahead(**overrides):
    return make_scheduler(max_in_flight=2, **overrides)


def test_the_next_plan_continues_past_the_step_in_flight():
    sched = ahead(block_size=4)
    sched.add(make_request("r0", num_prompt_tokens=7), ROOT)
    first = sched.schedule()  # the prompt, sampling its first token
    second = sched.schedule()  # that token's decode, planned before the result
    assert [(c.num_computed, c.num_tokens, c.sample) for c in first.scheduled] == [(0, 7, True)]
    assert [(c.num_computed, c.num_tokens, c.sample) for c in second.scheduled] == [(7, 1, True)]
    assert second.scheduled[0].block_ids == first.scheduled[0].block_ids  # position 7 is in the second block
    assert not sched.can_schedule()
    with pytest.raises(RuntimeError, match="at most 2"):
        sched.schedule()
    assert [type(o) for o in sched.update(make_done(first))] == [TokenDelta]
    third = sched.schedule()
    assert [(c.num_computed, c.num_tokens) for c in third.scheduled] == [(8, 1)]
    assert len(third.scheduled[0].block_ids) == 3  # position 8 opens a third block
    check_invariants(sched)


def test_max_tokens_stops_planning_ahead_without_a_wasted_row():
    sched = ahead()
    sched.add(make_request("r0", max_tokens=2), ROOT)
    prompt, decode = sched.schedule(), sched.schedule()
    sched.update(make_done(prompt))
    assert sched.schedule() is None  # the decode in flight samples the last token: nothing past it
    outputs = sched.update(make_done(decode))
    assert isinstance(outputs[-1], Finished) and outputs[-1].finish_reason == "length"
    assert not sched.has_work()
    assert_no_blocks_used(sched)


def test_an_eos_ends_the_request_one_step_late_and_its_row_is_void():
    sched = ahead()
    sched.add(make_request("r0"), ROOT)
    sched.add(make_request("r1"), ROOT)
    prompts = sched.schedule()
    decodes = sched.schedule()  # both decode, planned before r0's EOS is known
    outputs = sched.update(make_done(prompts, {"r0": EOS}))
    assert [o.request_id for o in outputs if isinstance(o, Finished)] == ["r0"]
    after = sched.schedule()
    assert after.finished == ["r0"]  # the ranks forget r0 after running its void row
    assert [c.request_id for c in after.scheduled] == ["r1"]
    outputs = sched.update(make_done(decodes, {"r0": 11, "r1": 12}))
    assert [(o.request_id, [t.token_id for t in o.tokens]) for o in outputs] == [("r1", [12])]  # r0's 11: nobody's
    check_invariants(sched)


def test_a_failed_step_with_a_later_one_in_flight_recomputes_the_rest():
    sched = ahead()
    for rid in ("r0", "r1"):
        sched.add(make_request(rid), ROOT)
    sched.update(make_done(sched.schedule()))  # both prompts done, one token each
    failing, later = sched.schedule(), sched.schedule()
    outputs = sched.fail_step(StepFailed(step_id=failing.step_id, rank=0, message="boom", request_ids=["r0"]))
    assert [(type(o), o.request_id) for o in outputs] == [(Failed, "r0")]
    r1 = sched.requests["r1"]
    assert r1 in sched.waiting and not r1.block_ids  # planned past a step that did not advance it: recomputed
    assert sched.update(make_done(later)) == []  # every row of the later step is void
    plan = sched.schedule()
    assert sorted(plan.finished) == ["r0", "r1"]
    assert [(s.request_id, s.output_token_ids) for s in plan.started] == [("r1", [7])]
    assert [(c.num_computed, c.num_tokens, c.sample) for c in plan.scheduled] == [(4, 3, True)]  # its first block is cached
    check_invariants(sched)


def test_a_failed_step_with_nothing_after_it_runs_its_other_rows_again():
    sched = ahead()
    for rid in ("r0", "r1"):
        sched.add(make_request(rid), ROOT)
    sched.update(make_done(sched.schedule()))
    failing = sched.schedule()
    sched.fail_step(StepFailed(step_id=failing.step_id, rank=0, message="boom", request_ids=["r0"]))
    again = sched.schedule()
    assert [(c.request_id, c.num_computed, c.num_tokens) for c in again.scheduled] == [("r1", 6, 1)]
    assert again.started == []  # the ranks still hold r1


def test_an_abort_while_two_steps_fly_voids_both_rows():
    sched = ahead()
    sched.add(make_request("r0"), ROOT)
    first, second = sched.schedule(), sched.schedule()
    [ending] = sched.abort("r0")
    assert ending.finish_reason == "abort"
    assert sched.update(make_done(first)) == [] and sched.update(make_done(second)) == []
    assert sched.schedule() is None and not sched.has_work()
    assert_no_blocks_used(sched)


def test_max_in_flight_is_one_to_three():
    with pytest.raises(ValueError, match="max_in_flight must be 1, 2 or 3"):
        make_scheduler(max_in_flight=4)


def test_two_steps_ahead_plan_a_token_further_for_each_and_stop_at_max_tokens():
    """``max_in_flight=3``: the plan after next continues two tokens past the
    results, in the blocks those positions need, and no row is planned past
    a known end (``max_tokens``)."""
    sched = make_scheduler(max_in_flight=3, block_size=4)
    sched.add(make_request("r0", num_prompt_tokens=7, max_tokens=3), ROOT)
    plans = [sched.schedule() for _ in range(3)]
    assert [[(c.num_computed, c.num_tokens) for c in p.scheduled] for p in plans] == [[(0, 7)], [(7, 1)], [(8, 1)]]
    assert len(plans[2].scheduled[0].block_ids) == 3  # position 8 opens a third block
    with pytest.raises(RuntimeError, match="at most 3"):
        sched.schedule()
    sched.update(make_done(plans[0]))
    assert sched.schedule() is None  # the two in flight sample tokens 2 and 3: the last
    sched.update(make_done(plans[1]))
    outputs = sched.update(make_done(plans[2]))
    assert isinstance(outputs[-1], Finished) and outputs[-1].num_output_tokens == 3
    assert not sched.has_work()
    assert_no_blocks_used(sched)


def test_two_steps_ahead_an_eos_voids_two_rows():
    sched = make_scheduler(max_in_flight=3)
    for rid in ("r0", "r1"):
        sched.add(make_request(rid), ROOT)
    prompts, first, second = sched.schedule(), sched.schedule(), sched.schedule()
    assert [c.request_id for c in second.scheduled] == ["r0", "r1"]  # planned before r0's EOS is known
    outputs = sched.update(make_done(prompts, {"r0": EOS}))
    assert [o.request_id for o in outputs if isinstance(o, Finished)] == ["r0"]
    after = sched.schedule()
    assert after.finished == ["r0"] and [c.request_id for c in after.scheduled] == ["r1"]
    for plan in (first, second):  # r0's rows computed tokens nobody reads
        outputs = sched.update(make_done(plan, {"r0": 11, "r1": 12}))
        assert [(o.request_id, [t.token_id for t in o.tokens]) for o in outputs] == [("r1", [12])]
    check_invariants(sched)


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_orders_with_no_step_to_carry_them_go_alone(max_in_flight):
    sched = make_scheduler(max_in_flight=max_in_flight)
    assert sched.schedule_orders() is None  # nothing to say
    sched.add(make_request("r0", num_media=1), ROOT)
    sched.update(make_done(sched.schedule()))
    sched.abort("r0")
    assert sched.schedule() is None
    plan = sched.schedule_orders()
    assert plan.finished == ["r0"] and plan.scheduled == [] and len(plan.drop_media) == 1
    assert sched.schedule_orders() is None  # said once
    assert sched.update(make_done(plan)) == []
    assert_no_blocks_used(sched)


def test_steps_ahead_is_a_scheduler_key_that_needs_async_scheduling():
    """``scheduler.steps_ahead: 2`` (the conductor's ``max_in_flight=3``) is accepted with overlapped scheduling
    and refused, with the fix, without it; other values name what is accepted."""
    from mstar_actors.config import ConfigError, parse_config

    config = parse_config({"model": {"device": "cpu"}, "scheduler": {"async_scheduling": True, "steps_ahead": 2}})
    assert config.scheduler.steps_ahead == 2
    assert parse_config({"model": {"device": "cuda"}}).scheduler.steps_ahead == 2, "the default with overlapped steps"
    assert parse_config({"model": {"device": "cuda"}, "scheduler": {"steps_ahead": 1}}).scheduler.steps_ahead == 1
    assert parse_config({"model": {"device": "cpu"}}).scheduler.steps_ahead == 1, "one plan ahead on CPU"
    assert parse_config({"model": {"device": "cpu"}, "scheduler": {"steps_ahead": 2}}).scheduler.steps_ahead == 2
    with pytest.raises(ConfigError, match="set async_scheduling: true, or steps_ahead: 1"):
        parse_config({"model": {"device": "cpu"}, "scheduler": {"async_scheduling": False, "steps_ahead": 2}})
    with pytest.raises(ConfigError, match="accepted: 1, 2"):
        parse_config({"scheduler": {"steps_ahead": 3}})


def test_a_prompt_that_cannot_fit_beside_the_running_waits_instead_of_being_admitted_and_preempted_again():
    """16 blocks of 4 tokens; r0 decodes on 5 of them. r1's 48-token prompt
    (12 blocks) does not fit beside it, but its first chunk (16 tokens)
    does: admitted, its second chunk then preempted r1 itself, its first
    chunk still in flight, so nothing of it was cached, and it was admitted
    again at once: every other step a wasted prefill, r0 crawling. r1 waits
    for the room instead, and r0 decodes every step."""
    sched = ahead(num_blocks=16, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    sched.add(make_request("r0", num_prompt_tokens=4, max_tokens=40), ROOT)
    pending, outputs = [], []
    for _ in range(16):  # r0: its prompt and decodes, one step ahead (5 blocks by the end)
        pending.append(sched.schedule())
        if len(pending) == 2:
            outputs += sched.update(make_done(pending.pop(0)))
    sched.add(make_request("r1", num_prompt_tokens=48, max_tokens=2), ROOT)
    for _ in range(12):
        plan = sched.schedule()
        assert [c.request_id for c in plan.scheduled] == ["r0"], plan.scheduled  # r1 waits; r0 never stalls
        pending.append(plan)
        outputs += sched.update(make_done(pending.pop(0)))
    assert sched.num_preemptions == 0 and sched.requests["r1"] in sched.waiting
    while sched.has_work():  # r0 ends (max_tokens): r1's whole prompt fits, and it runs
        if sched.can_schedule() and (plan := sched.schedule()) is not None:
            pending.append(plan)
        if pending:
            outputs += sched.update(make_done(pending.pop(0)))
    assert {o.request_id: o.finish_reason for o in outputs if isinstance(o, Finished)} == {"r0": "length",
                                                                                        "r1": "length"}
    assert sched.num_preemptions == 0
    assert_no_blocks_used(sched) if not sched.enable_prefix_caching else check_invariants(sched)


def test_the_rest_of_a_running_prompt_cut_short_of_the_budget_is_room_a_waiting_prompt_cannot_take():
    """r0's prompt asks for its logprobs: its chunks are cut to 8 scored
    tokens though the budget is 16, and r1 (3 blocks) was admitted beside its
    first chunk on what was free then (6 of 8 blocks); r0's third chunk then
    preempted r1 (6 + 3 > 8). r1 waits for the rest of r0's prompt instead."""
    sched = ahead(num_blocks=8, block_size=4, max_num_batched_tokens=16, max_model_len=32, max_scored_tokens=8)
    sched.add(make_request("r0", num_prompt_tokens=24, max_tokens=2, prompt_logprobs=1), ROOT)
    sched.add(make_request("r1", num_prompt_tokens=12, max_tokens=2), ROOT)
    pending, outputs = [], []
    while sched.has_work():
        if sched.can_schedule() and (plan := sched.schedule()) is not None:
            pending.append(plan)
        if pending:
            outputs += sched.update(make_done(pending.pop(0)))
    assert sched.num_preemptions == 0
    assert sorted(o.request_id for o in outputs if isinstance(o, Finished)) == ["r0", "r1"]
