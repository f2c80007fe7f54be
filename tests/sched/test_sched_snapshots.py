"""Prefix caching with recurrent state: snapshots taken where a prompt's last
full block ends, restored on a hit, bounded and settled like KV blocks."""

from __future__ import annotations

import os
import random

import pytest

from mstar_actors.messages import StepFailed
from mstar_actors.sched.state_snapshots import SnapshotIndex

from sched_factories import ROOT, check_invariants, chunks_of, finished_of, make_done, make_request, make_scheduler, run_step
from test_sched_random import Trial

PROMPT = list(range(100, 114))  # 14 tokens: the snapshot point is 12 (three blocks of 4, one token left after)


def hybrid(**overrides):
    return make_scheduler(**dict(num_state_slots=4, num_state_snapshots=2) | overrides)


def run_to_end(sched, request) -> dict:
    sched.add(request, ROOT)
    plans, endings = [], {}
    while sched.has_work():
        plan, outputs = run_step(sched)
        check_invariants(sched)
        plans.append(plan)
        endings |= finished_of(outputs)
    return {"plans": plans, "finished": endings[request.request_id]}


def test_index_reserves_free_then_least_recently_used_and_settles():
    index = SnapshotIndex(2)
    a, b = index.reserve(), index.reserve()
    index.commit(a, b"A")
    index.commit(b, b"B")
    assert index.lookup(b"A") == a  # A is now the most recently used
    c = index.reserve()
    assert c == b and not index.has(b"B")  # B was the least recently used
    index.release(c)
    assert index.reserve() == c  # released: free again
    with pytest.raises(RuntimeError, match="not reserved"):
        index.commit(a, b"X")


def test_the_first_prompt_stops_at_its_snapshot_point_and_takes_one():
    sched = hybrid()
    first = run_to_end(sched, make_request("r0", prompt=PROMPT, max_tokens=2))["plans"]
    (chunk,) = first[0].scheduled
    assert (chunk.num_computed, chunk.num_tokens, chunk.snapshot) == (0, 12, 0)  # cut at 12 of 14
    assert chunks_of(first[1]) == {"r0": (12, 2, True)} and first[1].scheduled[0].snapshot == -1
    assert sched.snapshots.num_indexed == 1 and sched.snapshots.num_reserved == 0


def test_a_repeated_prompt_and_the_next_turn_restore_the_snapshot():
    sched = hybrid()
    r0 = run_to_end(sched, make_request("r0", prompt=PROMPT, max_tokens=2))
    again = run_to_end(sched, make_request("r1", prompt=PROMPT, max_tokens=2))
    (start,) = again["plans"][0].started
    assert start.restore_snapshot == 0 and again["finished"].num_cached_tokens == 12
    assert chunks_of(again["plans"][0]) == {"r1": (12, 2, True)}
    # The next turn: the whole first prompt, its answer and a new message.
    turn = PROMPT + [7, 7] + list(range(200, 209))
    nxt = run_to_end(sched, make_request("r2", prompt=turn, max_tokens=2))
    assert nxt["plans"][0].started[0].restore_snapshot == 0 and nxt["finished"].num_cached_tokens == 12
    assert r0["finished"].num_cached_tokens == 0


def test_no_snapshots_no_prefix_caching_for_a_hybrid_model():
    sched = hybrid(num_state_snapshots=0)
    run_to_end(sched, make_request("r0", prompt=PROMPT, max_tokens=2))
    again = run_to_end(sched, make_request("r1", prompt=PROMPT, max_tokens=2))
    assert again["finished"].num_cached_tokens == 0 and not sched.enable_prefix_caching
    assert all(c.snapshot == -1 for plan in again["plans"] for c in plan.scheduled)


def test_a_hit_needs_the_snapshot_and_the_kv_blocks():
    sched = hybrid(num_state_snapshots=1)
    run_to_end(sched, make_request("a", prompt=PROMPT, max_tokens=2))
    run_to_end(sched, make_request("b", prompt=[9] * 14, max_tokens=2))  # its snapshot evicts a's
    assert run_to_end(sched, make_request("a2", prompt=PROMPT, max_tokens=2))["finished"].num_cached_tokens == 0
    # KV evicted, snapshot kept: no hit either (a tiny cache that a4 must recycle).
    small = hybrid(num_blocks=5)
    run_to_end(small, make_request("c", prompt=PROMPT, max_tokens=2))
    run_to_end(small, make_request("d", prompt=[8] * 17, max_tokens=2))  # needs every block
    assert small.snapshots.num_indexed == 2
    assert run_to_end(small, make_request("c2", prompt=PROMPT, max_tokens=2))["finished"].num_cached_tokens == 0


def test_an_abort_in_flight_and_a_failed_step_give_the_snapshot_back():
    sched = hybrid()
    sched.add(make_request("r0", prompt=PROMPT, max_tokens=2), ROOT)
    plan = sched.schedule()
    assert plan.scheduled[0].snapshot == 0 and sched.snapshots.num_reserved == 1
    sched.abort("r0")
    sched.update(make_done(plan))
    assert sched.snapshots.num_reserved == 0 and sched.snapshots.num_indexed == 0
    sched.add(make_request("r1", prompt=PROMPT, max_tokens=2), ROOT)
    plan = sched.schedule()
    sched.fail_step(StepFailed(step_id=plan.step_id, rank=0, message="boom"))
    assert sched.snapshots.num_reserved == 0 and sched.snapshots.num_indexed == 0
    check_invariants(sched)


def test_random_schedules_restore_only_their_own_prefix_state():
    """The fake worker checks that every chunk past token 0 continues its own
    prefix's state (from its slot or a restored snapshot)."""
    seed = int(os.environ.get("MSTAR_SCHED_SEED", random.randrange(2**32)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    num_restored = 0
    for _ in range(40):
        t = Trial(random.Random(rng.randrange(2**32)), num_state_slots=rng.randint(1, 5),
                  num_state_snapshots=rng.randint(1, 4), enable_prefix_caching=True, max_in_flight=rng.choice([1, 2, 3]))
        t.run(num_steps=60)
        num_restored += t.worker.num_restores
        assert t.sched.snapshots.num_reserved == 0
    assert num_restored > 0, "the random prompts share prefixes: some hits should restore a snapshot"
