"""A rank's media copies, driven by the real scheduler's plans over the real
arena: copied out at the first start and the block released at once; read
by the SeqStart's own refs (the plan is not rewritten); kept across a
preemption; dropped when the request ends; refs of never-started requests
only released."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mstar_actors.runner.media_copies import MediaCopies
from mstar_actors.messages import MediaItem, Prepared, SampledToken, SamplingParams, StepDone, StepPlan
from mstar_actors.sched import Scheduler
from transport import shm
from transport.arena import TensorArena, create_arena


@pytest.fixture
def arena(tmp_path):
    run_id = f"t{abs(hash(tmp_path)) % 10**8}"
    spec = create_arena(tmp_path, run_id, "media", 1 << 16)
    producer, consumer = TensorArena(spec, "producer"), TensorArena(spec, "consumer", reader_index=0)
    yield producer, consumer
    producer.close()
    consumer.close()
    shm.cleanup_run(run_id, tmp_path)


def _request(rid: str, ref, n: int = 1) -> Prepared:
    item = MediaItem(kind="image", pixel_values=ref, grid_thw=(1, 2, 2), token_offset=0, num_tokens=1)
    return Prepared(request_id=rid, model="m", prompt_token_ids=[300] * 4,
                    sampling=SamplingParams(max_tokens=50, cut_to_context=True), media=[item], n=n)


def _run(sched: Scheduler, copies: MediaCopies) -> StepPlan:
    plan = sched.schedule()
    frozen = msgspec.msgpack.encode(plan)
    copies.apply(plan)
    assert msgspec.msgpack.encode(plan) == frozen
    sampled = [SampledToken(c.request_id, 7) for c in plan.scheduled if c.sample]
    sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=sampled))
    return plan


def test_copy_out_release_keep_across_preemption_drop_at_end(arena):
    producer, consumer = arena
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    copies = MediaCopies(consumer)
    a, b = torch.arange(8.0).view(2, 4), torch.ones(2, 4)
    ref_a, ref_b = producer.put_nowait(a), producer.put_nowait(b)
    sched.receive(_request("b", ref_b))  # held by the adapter pool, say; it never starts
    sched.add(_request("a", ref_a, n=2), "root")
    plan = _run(sched, copies)
    assert producer.reclaim() > 0  # a's block is free already; b's is still held (never started)
    local = plan.started[0].media[0].pixel_values
    assert plan.started[1].media[0].pixel_values == local and copies.num_copies == 1  # both choices, one copy
    assert torch.equal(copies.resolve(local), a)
    with pytest.raises(ValueError, match="has no copy on this rank"):
        copies.resolve(ref_a)  # an arena ref is never what a SeqStart names
    for _ in range(5):  # positions 4..8: at 8 both need a third block, so a-1 is preempted
        plan = _run(sched, copies)
    assert plan.finished == ["a-1"] and copies.num_copies == 1
    sched.abort("a-0")
    plan = _run(sched, copies)
    assert [s.request_id for s in plan.started] == ["a-1"]
    assert torch.equal(copies.resolve(plan.started[0].media[0].pixel_values), a)  # the restart reads the same copy
    # b ends unstarted: the plan names its ref; a ends for good with its last choice
    sched.abort("b")
    sched.abort("a")
    sched.add(Prepared(request_id="c", model="m", prompt_token_ids=[5], sampling=SamplingParams(max_tokens=4)), "root")
    _run(sched, copies)
    assert copies.num_copies == 0 and producer.reclaim() > 0 and producer.num_bytes_in_use == 0
