"""Scheduler behaviour, step by step, with hand-built worker results."""

import msgspec
import pytest
from sched_factories import (
    EOS,
    ROOT,
    assert_no_blocks_used,
    check_invariants,
    chunks_of,
    finished_of,
    make_done,
    make_request,
    make_scheduler,
    run_step,
    tokens_of,
)

from mstar_actors.messages import Failed, Finished, Prepared, StepDone, StepFailed, TokenDelta
from mstar_actors.ring_sizes import ID_BYTES, sequence_ids
from mstar_actors.sched import chain_hash, root_hash


def test_prefill_then_decodes_until_max_tokens():
    sched = make_scheduler()
    assert sched.add(make_request("r0", num_prompt_tokens=6, max_tokens=3), ROOT) == []
    assert sched.has_work() and sched.num_waiting == 1
    plan, outputs = run_step(sched)
    assert [s.request_id for s in plan.started] == ["r0"]
    assert chunks_of(plan) == {"r0": (0, 6, True)}
    assert len(plan.scheduled[0].block_ids) == 2
    assert outputs == [TokenDelta("r0", list(make_done(plan).sampled), num_prompt_tokens=6,  # on the first delta
                                  num_queried_tokens=6)]
    plan, outputs = run_step(sched)
    assert plan.started == [] and chunks_of(plan) == {"r0": (6, 1, True)}
    assert outputs == [TokenDelta("r0", list(make_done(plan).sampled))]  # not on later ones
    plan, outputs = run_step(sched, {"r0": 9})
    assert chunks_of(plan) == {"r0": (7, 1, True)}
    assert tokens_of(outputs) == {"r0": [9]}
    assert finished_of(outputs)["r0"] == Finished("r0", "length", num_prompt_tokens=6, num_output_tokens=3)
    assert not sched.has_work() and sched.schedule() is None
    assert_no_blocks_used(sched)
    assert sched.allocator.num_cached_free == 2  # 8 tokens of KV computed: two full blocks
    # The workers forget r0 with the next plan.
    sched.add(make_request("r1"), ROOT)
    assert sched.schedule().finished == ["r0"]


def test_chunked_prefill_splits_under_budget_and_mixes_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_request("r0", num_prompt_tokens=4, max_tokens=10), ROOT)
    run_step(sched)
    sched.add(make_request("r1", num_prompt_tokens=20, max_tokens=10), ROOT)
    seen = []
    for _ in range(3):
        plan, outputs = run_step(sched)
        assert sum(c.num_tokens for c in plan.scheduled) <= 8
        assert plan.scheduled[0].request_id == "r0"  # decodes first
        seen.append(chunks_of(plan)["r1"])
    assert seen == [(0, 7, False), (7, 7, False), (14, 6, True)]
    assert tokens_of(outputs) == {"r0": [7], "r1": [7]}
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"r0": (7, 1, True), "r1": (20, 1, True)}


def test_long_prompt_alone_is_split_into_budget_sized_chunks():
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add(make_request("r0", num_prompt_tokens=12), ROOT)
    chunks = [chunks_of(run_step(sched)[0])["r0"] for _ in range(3)]
    assert chunks == [(0, 5, False), (5, 5, False), (10, 2, True)]


def test_max_num_seqs_is_honoured():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", max_tokens=2), ROOT)
    plan, _ = run_step(sched)
    assert [s.request_id for s in plan.started] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    plan, outputs = run_step(sched)
    assert set(finished_of(outputs)) == {"r0", "r1"}
    plan = sched.schedule()
    assert [s.request_id for s in plan.started] == ["r2"] and plan.finished == ["r0", "r1"]


def test_waiting_requests_are_admitted_in_fifo_order():
    # r0 holds most of the cache: r1 (too big for what is left) blocks r2 behind it.
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    sched.add(make_request("r0", num_prompt_tokens=16, max_tokens=2), ROOT)
    run_step(sched)
    sched.add(make_request("r1", num_prompt_tokens=12), ROOT)
    sched.add(make_request("r2", num_prompt_tokens=2), ROOT)
    plan, _ = run_step(sched)
    assert plan.started == [] and sched.num_waiting == 2
    plan = sched.schedule()
    assert plan.finished == ["r0"] and [s.request_id for s in plan.started] == ["r1", "r2"]


def test_preemption_frees_the_latest_admitted_and_restarts_it_with_its_outputs():
    # 6 blocks of 4 tokens; three 4-token prompts fill 2 blocks each by position 8.
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    for i in range(3):
        sched.add(make_request(f"r{i}", prompt=[10 + i] * 4, max_tokens=50), ROOT)
    outputs_of = {f"r{i}": [] for i in range(3)}
    for step in range(5):  # prefill, then positions 4..7
        _, outputs = run_step(sched, default=20 + step)
        for rid, toks in tokens_of(outputs).items():
            outputs_of[rid] += toks
    assert sched.allocator.num_free == 0
    plan, _ = run_step(sched, default=30)  # position 8: r0 needs a block, r2 is preempted
    assert chunks_of(plan) == {"r0": (8, 1, True), "r1": (8, 1, True)}
    assert plan.finished == ["r2"] and plan.started == []
    assert sched.stats().num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["r2"]
    check_invariants(sched)
    # Room again: r2 comes back with what it generated, recomputed from scratch.
    sched.abort("r0")
    plan = sched.schedule()
    assert plan.finished == ["r0"]
    [start] = plan.started
    assert start.request_id == "r2" and start.output_token_ids == outputs_of["r2"] == [20, 21, 22, 23, 24]
    assert chunks_of(plan)["r2"] == (0, 9, True)
    # its end tells how often it was recomputed (vLLM's vllm:request_num_preemptions)
    sched.update(make_done(plan))
    ends = {f.request_id: f.num_preemptions for f in sched.abort("r1") + sched.abort("r2")}
    assert ends == {"r1": 0, "r2": 1}, ends


def test_preemption_of_several_keeps_admission_order_at_the_head():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    for i in range(3):
        sched.add(make_request(f"r{i}", prompt=[10 + i] * 4, max_tokens=50), ROOT)
    run_step(sched)  # all three admitted
    while "r2" not in [s.request_id for s in sched.waiting]:
        run_step(sched)
    while "r1" not in [s.request_id for s in sched.waiting]:
        run_step(sched)
    assert [s.request_id for s in sched.waiting] == ["r1", "r2"]
    assert sched.num_running == 1 and sched.num_preemptions == 2
    check_invariants(sched)


def test_restarted_sequence_resumes_from_its_prefix_cache_hit():
    sched = make_scheduler(num_blocks=7)
    for i, num_prompt in enumerate([4, 4, 8]):
        sched.add(make_request(f"r{i}", prompt=[10 + i] * num_prompt, max_tokens=50), ROOT)
    run_step(sched)  # all three admitted
    while not sched.waiting:
        run_step(sched)
    # r2's three full blocks went back cached, tail first: r0 and r1 evicted
    # two of them for their own new blocks, r2's head block is still indexed.
    assert [s.request_id for s in sched.waiting] == ["r2"] and sched.allocator.num_cached_free == 1
    sched.abort("r0")
    plan = sched.schedule()
    [start] = plan.started
    num_tokens = len(start.prompt_token_ids) + len(start.output_token_ids)
    assert chunks_of(plan)["r2"] == (4, num_tokens - 4, True)


def test_prefix_cache_hit_shares_blocks():
    sched = make_scheduler()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    sched.add(make_request("r0", prompt=prompt, max_tokens=5), ROOT)
    run_step(sched)
    sched.add(make_request("r1", prompt=prompt, max_tokens=2), ROOT)
    plan, _ = run_step(sched)
    assert chunks_of(plan)["r1"] == (8, 2, True)
    r0, r1 = sched.requests["r0"], sched.requests["r1"]
    assert r1.block_ids[:2] == r0.block_ids[:2] and r1.block_ids[2] != r0.block_ids[2]
    assert [sched.allocator.ref_count(b) for b in r1.block_ids] == [2, 2, 1]
    check_invariants(sched)
    _, outputs = run_step(sched)
    assert finished_of(outputs)["r1"].num_cached_tokens == 8
    assert [sched.allocator.ref_count(b) for b in r0.block_ids[:2]] == [1, 1]
    sched.abort("r0")
    assert_no_blocks_used(sched)


def test_prefix_hit_always_leaves_the_last_token_to_compute():
    sched = make_scheduler()
    prompt = list(range(100, 108))  # exactly 2 full blocks
    sched.add(make_request("r0", prompt=prompt, max_tokens=1), ROOT)
    run_step(sched)
    sched.add(make_request("r1", prompt=prompt, max_tokens=1), ROOT)
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"r1": (4, 4, True)}


def test_blocks_filled_by_decoded_tokens_are_cached_too():
    sched = make_scheduler()
    sched.add(make_request("r0", prompt=[5, 6], max_tokens=7), ROOT)
    for token in [40, 41, 42, 43, 44, 45, 46]:
        run_step(sched, {"r0": token})
    # prompt + outputs = 9 tokens, 8 of them computed: 2 full blocks.
    sched.add(make_request("r1", prompt=[5, 6, 40, 41, 42, 43, 44, 45, 46, 47]), ROOT)
    plan = sched.schedule()
    assert chunks_of(plan)["r1"] == (8, 2, True)


def test_different_roots_never_share_blocks():
    sched = make_scheduler()
    prompt = list(range(100, 110))
    sched.add(make_request("a", prompt=prompt, max_tokens=1), "adapter-digest-a")
    run_step(sched)
    sched.add(make_request("b", prompt=prompt, max_tokens=1), "adapter-digest-b")
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"b": (0, 10, True)}
    sched.add(make_request("a2", prompt=prompt, max_tokens=1), "adapter-digest-a")
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"a2": (8, 2, True)}


def test_media_requests_share_the_text_before_their_first_media_block_only():
    """A system prompt before the images is shared whatever the images (with text-only requests too);
    blocks from the first media token on only with the same media in the same places."""
    sched = make_scheduler()
    prompt = list(range(100, 114))  # blocks of 4: [0-3] [4-7] [8-11], the image at tokens 9-10

    def request(rid: str, digest: str) -> Prepared:
        base = make_request(rid, prompt=prompt, max_tokens=1, num_media=1)
        image = msgspec.structs.replace(base.media[0], token_offset=9, num_tokens=2)
        return msgspec.structs.replace(base, media=[image], media_digests=(digest,))

    sched.add(request("a", "image-a"), ROOT)
    run_step(sched)
    sched.add(request("b", "image-b"), ROOT)
    assert chunks_of(run_step(sched)[0]) == {"b": (8, 6, True)}  # the two blocks before the image's
    sched.add(request("a2", "image-a"), ROOT)
    assert chunks_of(run_step(sched)[0]) == {"a2": (12, 2, True)}  # the image's block too
    sched.add(make_request("text", prompt=prompt, max_tokens=1), ROOT)
    assert chunks_of(run_step(sched)[0]) == {"text": (8, 6, True)}
    sched.add(request("salted", "image-a"), ROOT + "|salt:x")
    assert chunks_of(run_step(sched)[0]) == {"salted": (0, 14, True)}
    check_invariants(sched)


def test_a_turn_that_adds_an_image_keeps_the_hits_before_it():
    """Each item keys the blocks from its first token on: a second turn's image after the first turn's leaves
    the blocks before it shared (one digest of all the items keyed them all from the first image on: a
    multi-turn chat with images hit its system prompt only)."""
    sched = make_scheduler()
    prompt = list(range(100, 122))  # blocks of 4; image a at tokens 5-6 (block 1), image b at 17-18 (block 4)

    def request(rid: str, *images: tuple[int, str]) -> Prepared:
        base = make_request(rid, prompt=prompt, max_tokens=1, num_media=len(images))
        media = [msgspec.structs.replace(item, token_offset=at, num_tokens=2) for item, (at, _) in
                 zip(base.media, images)]
        return msgspec.structs.replace(base, media=media, media_digests=tuple(d for _, d in images))

    sched.add(request("first", (5, "image-a"), (17, "image-b")), ROOT)
    run_step(sched)
    sched.add(request("other b", (5, "image-a"), (17, "image-c")), ROOT)
    assert chunks_of(run_step(sched)[0]) == {"other b": (16, 6, True)}  # blocks 0-3: text and image a
    sched.add(request("other a", (5, "image-c"), (17, "image-b")), ROOT)
    assert chunks_of(run_step(sched)[0]) == {"other a": (4, 18, True)}  # block 0 alone: a differs in block 1
    check_invariants(sched)


def test_prefix_cache_disabled_never_hits():
    sched = make_scheduler(enable_prefix_caching=False)
    for rid in ["r0", "r1"]:
        sched.add(make_request(rid, num_prompt_tokens=10, max_tokens=1), ROOT)
        plan, _ = run_step(sched)
        assert chunks_of(plan)[rid] == (0, 10, True)
    assert len(sched.prefix_index) == 0 and sched.allocator.num_cached_free == 0


def test_eviction_takes_least_recently_freed_cached_blocks():
    sched = make_scheduler(num_blocks=8)
    prompt_a, prompt_b, prompt_c = [[base + i for i in range(9)] for base in (100, 200, 300)]
    for rid, prompt in [("a", prompt_a), ("b", prompt_b)]:
        sched.add(make_request(rid, prompt=prompt, max_tokens=1), ROOT)
        run_step(sched)
    # Free: 2 plain (the partial blocks) + 4 cached, a's tail first.
    assert sched.allocator.num_cached_free == 4
    sched.add(make_request("c", prompt=prompt_c + [1] * 11, max_tokens=1), ROOT)  # 5 blocks
    run_step(sched)

    def hashes(prompt):
        h0 = chain_hash(root_hash(ROOT), prompt[:4])
        return [h0, chain_hash(h0, prompt[4:8])]

    a0, a1 = hashes(prompt_a)
    assert a0 in sched.prefix_index and a1 not in sched.prefix_index
    assert all(h in sched.prefix_index for h in hashes(prompt_b))
    sched.add(make_request("b2", prompt=prompt_b, max_tokens=1), ROOT)
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"b2": (8, 1, True)}
    check_invariants(sched)


@pytest.mark.parametrize(
    "sampling, tokens, reason, stop_token_id, num_outputs",
    [
        ({}, [7, EOS], "stop", EOS, 2),
        ({"ignore_eos": True}, [EOS, EOS, EOS], "length", None, 3),
        ({"stop_token_ids": (99,)}, [7, 99], "stop", 99, 2),
        ({"stop_token_ids": (99,), "ignore_eos": True}, [EOS, 99], "stop", 99, 2),
        ({}, [7, 7, 7], "length", None, 3),
    ],
)
def test_stop_conditions(sampling, tokens, reason, stop_token_id, num_outputs):
    sched = make_scheduler()
    sched.add(make_request("r0", max_tokens=3, **sampling), ROOT)
    streamed = []
    for token in tokens:
        _, outputs = run_step(sched, {"r0": token})
        streamed += tokens_of(outputs).get("r0", [])
    [ending] = finished_of(outputs).values()
    assert (ending.finish_reason, ending.stop_token_id, ending.num_output_tokens) == (reason, stop_token_id, num_outputs)
    assert streamed == tokens  # the stop token itself is streamed too
    assert isinstance(outputs[-1], Finished) and not sched.has_work()
    assert_no_blocks_used(sched)


def test_max_tokens_past_max_model_len_is_refused_and_a_default_is_cut():
    sched = make_scheduler(max_model_len=10)
    (failed,) = sched.add(make_request("r0", num_prompt_tokens=8, max_tokens=3, cut_to_context=False), ROOT)
    assert (failed.request_id, failed.status, failed.param, failed.code) == ("r0", 400, "max_tokens",
                                                                             "context_length_exceeded")
    assert "the prompt has 8 tokens" in failed.message and "at most 2" in failed.message
    assert failed.message.startswith("max_tokens is 3")  # the frontend names the field the client sent
    assert not sched.has_work()
    assert sched.add(make_request("r1", num_prompt_tokens=8, max_tokens=2, cut_to_context=False), ROOT) == []
    sched.add(make_request("r2", num_prompt_tokens=8, max_tokens=100), ROOT)
    run_step(sched)
    _, outputs = run_step(sched)
    assert finished_of(outputs)["r2"].finish_reason == "length"
    assert finished_of(outputs)["r2"].num_output_tokens == 2


def test_min_tokens_past_the_room_a_default_cap_is_cut_to_is_refused():
    """A chat request with no cap: the whole context, cut to what the prompt
    leaves; min_tokens beyond that was cut with it, silently."""
    sched = make_scheduler(max_model_len=10)
    (failed,) = sched.add(make_request("r0", num_prompt_tokens=8, max_tokens=100, min_tokens=3), ROOT)
    assert (failed.status, failed.param, failed.code) == (400, "min_tokens", "context_length_exceeded")
    assert "min_tokens is 3" in failed.message and "at most 2" in failed.message
    assert sched.add(make_request("r1", num_prompt_tokens=8, max_tokens=100, min_tokens=2), ROOT) == []


def test_max_tokens_past_the_kv_cache_is_refused_and_a_default_is_cut():
    sched = make_scheduler(num_blocks=2, max_model_len=100)
    (failed,) = sched.add(make_request("r0", num_prompt_tokens=7, max_tokens=100, cut_to_context=False), ROOT)
    assert failed.param == "max_tokens" and "KV cache holds 8 tokens" in failed.message
    assert "at most 1" in failed.message
    sched.add(make_request("r1", num_prompt_tokens=7, max_tokens=100), ROOT)
    _, outputs = run_step(sched)
    assert finished_of(outputs)["r1"].num_output_tokens == 1


@pytest.mark.parametrize("param", ["prompt", "messages"])
def test_too_long_prompt_is_refused(param):
    sched = make_scheduler(max_model_len=16)
    (failed,) = sched.add(make_request("long-1", num_prompt_tokens=16, prompt_param=param), ROOT)
    assert isinstance(failed, Failed) and failed.status == 400 and failed.param == param
    assert failed.request_id == "long-1" and "16 tokens" in failed.message and "max_model_len" in failed.message
    assert "at most 15" in failed.message
    assert sched.add(make_request("ok", num_prompt_tokens=15), ROOT) == []
    assert sched.num_waiting == 1


def test_empty_prompt_is_refused():
    sched = make_scheduler()
    (failed,) = sched.add(make_request("e", prompt=[], prompt_param="messages"), ROOT)
    assert failed.status == 400 and failed.param == "messages" and "empty" in failed.message
    assert not sched.has_work()


def test_prompt_larger_than_the_whole_kv_cache_is_refused():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    (failed,) = sched.add(make_request("big", num_prompt_tokens=8), ROOT)
    assert failed.status == 400 and "KV cache holds 8 tokens" in failed.message and failed.request_id == "big"
    assert not sched.has_work()


def test_duplicate_live_request_id_is_refused():
    sched = make_scheduler()
    assert sched.add(make_request("r0"), ROOT) == []
    (failed,) = sched.add(make_request("r0"), ROOT)
    assert failed.param == "request_id" and sched.num_waiting == 1


def test_abort_while_waiting():
    sched = make_scheduler()
    sched.add(make_request("r0"), ROOT)
    (ending,) = sched.abort("r0")
    assert ending == Finished("r0", "abort", num_prompt_tokens=6, num_output_tokens=0)
    assert sched.abort("r0") == [] and sched.abort("never-seen") == []
    assert sched.schedule() is None and not sched.has_work()
    sched.add(make_request("r1"), ROOT)
    assert sched.schedule().finished == []  # the workers never knew r0


def test_abort_while_prefilling_across_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_request("r0", num_prompt_tokens=12), ROOT)
    run_step(sched)
    assert sched.allocator.num_used == 1
    assert [f.finish_reason for f in sched.abort("r0")] == ["abort"]
    assert_no_blocks_used(sched)
    assert sched.abort("r0") == []
    sched.add(make_request("r1", prompt=[1, 2, 3]), ROOT)
    assert sched.schedule().finished == ["r0"]


def test_abort_while_step_in_flight_drops_its_result():
    sched = make_scheduler()
    sched.add(make_request("r0", num_prompt_tokens=10), ROOT)
    sched.add(make_request("r1", num_prompt_tokens=3), ROOT)
    plan = sched.schedule()
    assert [f.num_output_tokens for f in sched.abort("r0")] == [0]
    assert sched.allocator.num_used == 1  # r1's block only, at once
    outputs = sched.update(make_done(plan))
    assert [o.request_id for o in outputs] == ["r1"]
    assert len(sched.prefix_index) == 0  # r0's blocks were never indexed: they are free
    assert sched.abort("r0") == []
    assert sched.schedule().finished == ["r0"]


def test_every_ending_returns_blocks():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add(make_request("waits", num_prompt_tokens=40), ROOT)
    sched.add(make_request("done", num_prompt_tokens=3, max_tokens=1), ROOT)
    for i in range(3):
        sched.add(make_request(f"p{i}", num_prompt_tokens=20 + i), ROOT)
    run_step(sched)
    run_step(sched)
    plan = sched.schedule()
    for rid in list(sched.requests):
        sched.abort(rid)
    sched.update(make_done(plan))
    assert not sched.has_work()
    assert_no_blocks_used(sched)


def test_schedule_before_update_raises():
    sched = make_scheduler()
    sched.add(make_request("r0"), ROOT)
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match=rf"step\(s\) \[{plan.step_id}\] are in flight"):
        sched.schedule()
    with pytest.raises(ValueError, match="result for step 5"):
        sched.update(msgspec.structs.replace(make_done(plan), step_id=5))
    sched.update(make_done(plan))
    assert sched.schedule().step_id == plan.step_id + 1


def test_missing_sampled_token_raises_before_changing_anything():
    sched = make_scheduler()
    sched.add(make_request("r0"), ROOT)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for request.*r0"):
        sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=[]))
    sched.update(make_done(plan))  # nothing was applied: the real result still fits


def test_fail_step_fails_named_rows_and_retries_the_others():
    sched = make_scheduler()
    sched.add(make_request("bad", num_prompt_tokens=5), ROOT)
    sched.add(make_request("good", num_prompt_tokens=5), ROOT)
    plan = sched.schedule()
    outputs = sched.fail_step(StepFailed(step_id=plan.step_id, rank=1, message="boom", request_ids=["bad"]))
    [failed] = outputs
    assert failed.request_id == "bad" and failed.status == 500 and "boom" in failed.message
    plan2 = sched.schedule()
    assert plan2.finished == ["bad"] and chunks_of(plan2) == {"good": (0, 5, True)}
    sched.update(make_done(plan2))
    check_invariants(sched)


def test_stats():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add(make_request("r0", num_prompt_tokens=6), ROOT)
    sched.add(make_request("r1"), ROOT)
    run_step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used, stats.num_kv_blocks_total) == (1, 1, 2, 10)


def test_bad_construction_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        make_scheduler(max_num_seqs=0)


def test_a_dead_draw_fails_its_request_alone_and_frees_it():
    """The sampler found no token its processors allow (``SampledToken.dead``)."""
    from mstar_actors.messages import SampledToken

    sched = make_scheduler()
    sched.add(make_request("dead"), ROOT)
    sched.add(make_request("live"), ROOT)
    plan = sched.schedule()
    sampled = [SampledToken(c.request_id, 0, dead=c.request_id == "dead") for c in plan.scheduled if c.sample]
    outputs = sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=sampled))
    (failed,) = [o for o in outputs if isinstance(o, Failed)]
    assert (failed.request_id, failed.status) == ("dead", 400) and "no token is left to sample" in failed.message
    assert tokens_of(outputs) == {"live": [0]} and set(sched.requests) == {"live"}


def test_a_dead_draw_names_the_constraints_the_request_gave():
    from mstar_actors.messages import SampledToken, StructuredSpec

    sched = make_scheduler()
    regex = StructuredSpec("regex", "[0-9]{2}[a-z]+", "structured_outputs.regex")
    sched.add(make_request("dead", allowed_token_ids=(3, 4), structured=regex), ROOT)
    sched.add(make_request("late", structured=regex, min_tokens=1), ROOT)  # past min_tokens: its mask is off
    sched.add(make_request("early", min_tokens=3), ROOT)
    failed = {}
    for step in range(2):
        plan = sched.schedule()
        sampled = [SampledToken(c.request_id, 0, dead=c.request_id != "late" or step == 1)
                   for c in plan.scheduled if c.sample]
        failed |= {o.request_id: o for o in sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=sampled))
                   if isinstance(o, Failed)}
    assert {rid: f.param for rid, f in failed.items()} == {
        "dead": "allowed_token_ids", "late": "structured_outputs.regex", "early": "min_tokens"}
    assert "(allowed_token_ids and structured_outputs.regex)" in failed["dead"].message
    assert "cannot be continued within structured_outputs.regex" in failed["late"].message  # its grammar alone


def test_the_first_delta_carries_the_prompt_and_its_prefix_hit():
    """What the frontend reports for a choice a stop string ends (no Finished waited for)."""
    prompt = list(range(10, 30))
    sched = make_scheduler(enable_prefix_caching=True)
    sched.add(make_request("a", prompt=prompt, max_tokens=2), ROOT)
    while sched.has_work():
        run_step(sched)
    sched.add(make_request("b", prompt=prompt, max_tokens=2), ROOT)
    _, outputs = run_step(sched)
    first = next(o for o in outputs if isinstance(o, TokenDelta))
    assert (first.num_prompt_tokens, first.num_cached_tokens) == (20, 16)  # whole blocks of the prompt
    assert first.num_queried_tokens == 20  # vLLM's prefix-cache queries: the prompt looked up


@pytest.mark.parametrize(("caching", "prompt_logprobs"), [(False, None), (True, 0)])
def test_a_prompt_the_cache_is_not_read_for_is_no_query(caching, prompt_logprobs):
    """Caching off, or prompt logprobs asked for (a cached position's logits are never computed): no
    lookup, so none counted as one (each was a miss in the hit rate)."""
    prompt = list(range(10, 30))
    sched = make_scheduler(enable_prefix_caching=caching)
    for rid in ("a", "b"):
        sched.add(make_request(rid, prompt=prompt, max_tokens=2, prompt_logprobs=prompt_logprobs), ROOT)
        _, outputs = run_step(sched)
        first = next(o for o in outputs if isinstance(o, TokenDelta))
        assert (first.num_queried_tokens, first.num_cached_tokens) == (0, 0)
        while sched.has_work():
            run_step(sched)


def test_prompt_logprobs_past_one_steps_result_are_refused():
    sched = make_scheduler(max_prompt_logprob_entries=20)
    (refused,) = sched.add(make_request("big", num_prompt_tokens=12, prompt_logprobs=1), ROOT)  # 11 x 2 = 22
    assert isinstance(refused, Failed) and refused.status == 400 and refused.param == "prompt_logprobs"
    assert "22 entries" in refused.message and "transport.ring_bytes" in refused.message


@pytest.mark.parametrize("limits, k, first, second", [
    # two whose logprobs together are more than a step's result (14 entries each): one samples a step later
    (dict(max_prompt_logprob_entries=20, max_scored_tokens=64), 1, (0, 7, False), (7, 1, True)),
    # their logits are [positions, vocab] at once: a scored prompt's chunk is cut to what the step has left
    (dict(max_num_batched_tokens=32, max_scored_tokens=10), 0, (0, 2, False), (2, 6, True)),
])
def test_scored_prompts_share_a_steps_limits(limits, k, first, second):
    """Unscored prompts beside them are not cut."""
    sched = make_scheduler(**limits)
    for rid in ("a", "b"):
        assert sched.add(make_request(rid, num_prompt_tokens=8, prompt_logprobs=k), ROOT) == []
    sched.add(make_request("plain", num_prompt_tokens=8), ROOT)
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"a": (0, 8, True), "b": first, "plain": (0, 8, True)}
    plan, _ = run_step(sched)
    assert chunks_of(plan)["b"] == second
    check_invariants(sched)


def test_a_scored_prompts_last_token_alone_still_counts_against_the_steps_result():
    """Cut by one, two scored prompts each have one token left: the pass over
    one-token chunks (decodes) samples them a step apart too."""
    sched = make_scheduler(max_prompt_logprob_entries=20)
    for rid in ("x", "a", "b"):  # x takes the first step's room: a and b are cut by one
        assert sched.add(make_request(rid, num_prompt_tokens=8, prompt_logprobs=1), ROOT) == []
    plan, _ = run_step(sched)
    assert chunks_of(plan) == {"x": (0, 8, True), "a": (0, 7, False), "b": (0, 7, False)}
    plan, _ = run_step(sched)
    assert chunks_of(plan)["a"] == (7, 1, True) and "b" not in chunks_of(plan)
    plan, _ = run_step(sched)
    assert chunks_of(plan)["b"] == (7, 1, True)


def test_the_prompts_ids_ride_on_each_choices_first_delta_only_when_asked():
    """vLLM's return_token_ids: each choice's first TokenDelta carries the prompt the model was given; later
    deltas, and every delta of a request that did not ask, carry none."""
    sched = make_scheduler()
    asked = msgspec.structs.replace(make_request("a", prompt=[11, 12, 13], n=2), return_prompt_ids=True)
    for req in (asked, make_request("b", prompt=[21, 22])):
        sched.receive(req)
        sched.add(req, ROOT)
    deltas = []
    for _ in range(3):
        deltas += [out for out in run_step(sched)[1] if isinstance(out, TokenDelta)]
    firsts = {d.request_id: d.prompt_token_ids for d in deltas if d.num_prompt_tokens}
    assert firsts == {"a-0": [11, 12, 13], "a-1": [11, 12, 13], "b": None}
    assert all(d.prompt_token_ids is None for d in deltas if not d.num_prompt_tokens)


def test_a_plan_carries_no_more_starts_and_tables_than_its_ring_holds():
    """Sequences sharing a long cached prefix start a few tokens each: without a bound, as many start in one plan
    as the budget takes, each with its whole prompt and table (past the ring to the ranks, which stopped the
    server); the rest wait for the next plan, and every plan fits."""
    prompt = list(range(70_000, 70_100))  # (ids of a large vocabulary: msgpack's widest)
    limit = 1500  # one such start with its row, and the rows already running
    sched = make_scheduler(num_blocks=256, max_plan_bytes=limit)
    sched.add(make_request("a", prompt=prompt, max_tokens=2), ROOT)
    while sched.has_work():
        run_step(sched)
    for rid in "bcd":
        sched.add(make_request(rid, prompt=prompt + [7], max_tokens=3), ROOT)
    starts = []
    while sched.has_work():
        plan, _ = run_step(sched)
        assert len(msgspec.msgpack.encode(plan)) <= limit
        starts.append([s.request_id for s in plan.started])
    assert [s for s in starts if s] == [["b"], ["c"], ["d"]]
    unbounded = make_scheduler(num_blocks=256)
    unbounded.add(make_request("a", prompt=prompt, max_tokens=2), ROOT)
    while unbounded.has_work():
        run_step(unbounded)
    for rid in "bcd":
        unbounded.add(make_request(rid, prompt=prompt + [7], max_tokens=3), ROOT)
    plan, _ = run_step(unbounded)
    assert [s.request_id for s in plan.started] == ["b", "c", "d"] and len(msgspec.msgpack.encode(plan)) > limit


def test_rows_a_plan_s_size_leaves_out_go_first_in_the_next():
    """Every plan walked the running rows in one order and stopped at its bound at the same row: the rows past
    it got none until those ahead of them ended (hundreds of steps); each now waits a step at most."""
    limit = ID_BYTES * sequence_ids(1024, 16) + 200  # a whole-context row's, as a small ring sizes it
    sched = make_scheduler(num_blocks=2048, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048,
                           max_model_len=1024, max_plan_bytes=limit)
    for i in range(20):
        sched.add(make_request(f"r{i}", num_prompt_tokens=10, max_tokens=800, ignore_eos=True), ROOT)
    last, longest, step, cut = {}, 0, 0, False
    while sched.has_work():
        plan, _ = run_step(sched)
        step += 1
        cut |= len(plan.scheduled) < len(sched.running)
        for chunk in plan.scheduled:
            longest = max(longest, step - last.get(chunk.request_id, step - 1) - 1)
            last[chunk.request_id] = step
    assert cut and longest <= 1


def test_a_sequence_past_what_a_plan_carries_is_refused_naming_the_ring():
    sched = make_scheduler(max_plan_bytes=500)
    (refused,) = sched.add(make_request("big", num_prompt_tokens=100, max_tokens=4), ROOT)
    assert isinstance(refused, Failed) and refused.status == 400 and refused.param == "prompt"
    assert "transport.ring_bytes" in refused.message and "100 tokens" in refused.message
    assert sched.add(make_request("small", num_prompt_tokens=10, max_tokens=4), ROOT) == []
