"""The plan is final as schedule() emits it: LoRA slots, choices of one
request, and the media orders that are the ranks' whole view of media lifetime."""

from sched_factories import ROOT, chunks_of, finished_of, make_done, make_ref, make_request, make_scheduler, run_step

from mstar_actors.messages import RANK_MEMORY, MediaCopy


def test_seq_start_carries_the_admitted_lora_slot_across_a_restart():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    sched.add(make_request("base", prompt=[10] * 4, max_tokens=50), ROOT)
    sched.add(make_request("on-2", prompt=[11] * 4, max_tokens=50), "adapter", lora_slot=2)
    plan, _ = run_step(sched)
    assert {s.request_id: s.lora_slot for s in plan.started} == {"base": 0, "on-2": 2}
    for _ in range(5):  # positions 4..8: at 8 both need a third block, so on-2 is preempted
        plan, _ = run_step(sched)
    assert plan.finished == ["on-2"]
    sched.abort("base")
    [restart] = sched.schedule().started
    assert (restart.request_id, restart.lora_slot) == ("on-2", 2)


def test_n_choices_run_as_sequences_of_one_prompt_seeded_apart():
    sched = make_scheduler()
    assert sched.add(make_request("r", n=3, max_tokens=2, seed=5), ROOT) == []
    plan, outputs = run_step(sched)
    assert [s.request_id for s in plan.started] == ["r-0", "r-1", "r-2"]
    assert [s.sampling.seed for s in plan.started] == [5, 6, 7]
    assert len({tuple(s.prompt_token_ids) for s in plan.started}) == 1
    assert {o.request_id: o.num_prompt_tokens for o in outputs} == {"r-0": 6, "r-1": 6, "r-2": 6}
    assert [f.request_id for f in sched.abort("r-1")] == ["r-1"]  # one choice
    assert [f.request_id for f in sched.abort("r")] == ["r-0", "r-2"]  # the rest of the request
    assert sched.abort("r") == [] and not sched.has_work()


def test_a_refusal_fails_every_choice():
    sched = make_scheduler(max_model_len=8)
    refusals = sched.add(make_request("long", num_prompt_tokens=9, n=2), ROOT)
    assert [(f.request_id, f.status) for f in refusals] == [("long-0", 400), ("long-1", 400)]
    assert sched.add(make_request("dup", n=2), ROOT) == []
    assert [f.param for f in sched.add(make_request("dup"), ROOT)] == ["request_id"]


def test_media_is_copied_once_for_every_choice_and_restart_and_dropped_after_the_last():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    sched.add(make_request("img", prompt=[10] * 4, max_tokens=50, n=2, num_media=1), ROOT)
    plan, _ = run_step(sched)
    assert plan.copy_media == [MediaCopy(0, make_ref("img", 0))]
    refs = {s.request_id: s.media[0].pixel_values for s in plan.started}
    assert set(refs) == {"img-0", "img-1"} and len(set(refs.values())) == 1
    assert refs["img-0"].segment == RANK_MEMORY and refs["img-0"].offset == 0
    for _ in range(5):  # positions 4..8: at 8 both need a third block, so img-1 is preempted
        plan, _ = run_step(sched)
    assert plan.finished == ["img-1"] and plan.drop_media == []
    plan, outputs = run_step(sched, {"img-0": 2})  # EOS: img-0 ends
    assert finished_of(outputs)["img-0"].finish_reason == "stop"
    plan = sched.schedule()
    [restart] = plan.started
    assert restart.media[0].pixel_values == refs["img-1"]  # the same copy, not copied again
    assert plan.copy_media == [] and plan.drop_media == []
    sched.update(make_done(plan))
    sched.abort("img-1")
    sched.add(make_request("next"), ROOT)
    plan = sched.schedule()
    assert plan.drop_media == [0] and plan.release_media == []


def test_media_of_a_request_that_never_started_is_released_unread():
    sched = make_scheduler(max_model_len=8)
    waiting = make_request("waits-for-adapter", num_media=2)
    sched.receive(waiting)  # the adapter pool holds it, then ends it
    assert sched.abort("waits-for-adapter") == []
    sched.add(make_request("too-long", num_prompt_tokens=9, num_media=1), ROOT)
    sched.add(make_request("r0"), ROOT)
    plan = sched.schedule()
    assert plan.release_media == [make_ref("waits-for-adapter", 0), make_ref("waits-for-adapter", 1),
                                  make_ref("too-long", 0)]
    assert plan.copy_media == [] and chunks_of(plan) == {"r0": (0, 6, True)}
