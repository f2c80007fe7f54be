"""A rank's media copies: copied out of the real arena at the first start and
the block released at once; kept across a preemption; dropped when the
request ends for good; refs of never-started requests only released."""

from __future__ import annotations

import torch

from mstar_actors.media_copies import LOCAL, MediaCopies
from mstar_actors.messages import MediaItem, SamplingParams, SeqStart, StepPlan
from transport import shm
from transport.arena import TensorArena, create_arena


def _arenas(tmp_path):
    run_id = f"t{abs(hash(tmp_path)) % 10**8}"
    spec = create_arena(tmp_path, run_id, "media", 1 << 16)
    return run_id, TensorArena(spec, "producer"), TensorArena(spec, "consumer", reader_index=0)


def _start(rid: str, ref) -> SeqStart:
    item = MediaItem(kind="image", pixel_values=ref, grid_thw=(1, 2, 2), token_offset=0, num_tokens=1)
    return SeqStart(rid, [300], SamplingParams(), media=[item])


def test_copy_out_release_keep_across_preemption_drop_at_end(tmp_path):
    run_id, producer, consumer = _arenas(tmp_path)
    try:
        copies = MediaCopies(consumer)
        a, b = torch.arange(8.0).view(2, 4), torch.ones(2, 4)
        ref_a, ref_b = producer.put_nowait(a), producer.put_nowait(b)
        plan = copies.take(StepPlan(step_id=0, started=[_start("a", ref_a)], scheduled=[]))
        assert producer.reclaim() > 0  # a's block is free already; b's is still held (never started)
        local = plan.started[0].media[0].pixel_values
        assert local.segment == LOCAL and torch.equal(copies.resolve(local), a)
        # preempted, then restarted with the same (released, maybe reused) arena ref
        plan = copies.take(StepPlan(step_id=1, started=[_start("a", ref_a)], scheduled=[], finished=["a"], preempted=["a"]))
        assert torch.equal(copies.resolve(plan.started[0].media[0].pixel_values), a)
        # b ended unstarted: the conductor names its ref; a ends for good
        copies.take(StepPlan(step_id=2, started=[], scheduled=[], finished=["a"], release_media=[ref_b]))
        assert copies.num_requests == 0 and producer.reclaim() > 0 and producer.num_bytes_in_use == 0
    finally:
        producer.close()
        consumer.close()
        shm.cleanup_run(run_id, tmp_path)
