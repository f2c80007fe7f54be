"""TensorArena: zero-copy round trips, FIFO reclaim, a full arena that waits
then errors, and a consumer in another process."""

import asyncio
import multiprocessing
import random

import pytest
import torch

from transport.arena import ArenaFull, TensorArena, TensorTooLarge, create_arena

SPAWN = multiprocessing.get_context("spawn")


def make_arena(run, capacity_bytes=64 * 1024):
    spec = create_arena(run.run_dir, run.run_id, "host", capacity_bytes)
    return spec, TensorArena(spec, "producer"), TensorArena(spec, "consumer")


def close_all(run, *arenas):
    for arena in arenas:
        arena.close()
    run.cleanup()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_round_trip_without_copy(run, dtype):
    _, producer, consumer = make_arena(run)
    tensor = (torch.arange(3 * 5 * 7) % 5).to(dtype).reshape(3, 5, 7)
    ref = producer.put_nowait(tensor)
    assert ref.dtype == str(dtype).removeprefix("torch.") and ref.shape == (3, 5, 7)
    view = consumer.view(ref)
    assert view.dtype == dtype and torch.equal(view, tensor)
    assert consumer.view(ref).data_ptr() == view.data_ptr()  # the same shared bytes
    assert ref.offset % 64 == 0
    del view
    consumer.release(ref)
    assert producer.reclaim() > 0 and producer.num_bytes_in_use == 0
    close_all(run, producer, consumer)


def test_empty_and_non_contiguous_tensors(run):
    _, producer, consumer = make_arena(run)
    empty = producer.put_nowait(torch.empty(0, 4))
    transposed = torch.arange(12.0).reshape(3, 4).t()
    ref = producer.put_nowait(transposed)
    assert consumer.view(empty).shape == (0, 4)
    assert torch.equal(consumer.view(ref), transposed)
    close_all(run, producer, consumer)


def test_release_frees_in_fifo_order(run):
    _, producer, consumer = make_arena(run, capacity_bytes=4096)
    block = torch.zeros(1024 - 64, dtype=torch.uint8)  # 1 KiB blocks with their header
    refs = [producer.put_nowait(block) for _ in range(4)]
    with pytest.raises(ArenaFull, match=r"arena 'host' \(4096 bytes, 4096 in use by 4 tensors\).*960-byte"):
        producer.put_nowait(block)
    consumer.release(refs[1])
    assert producer.reclaim() == 0  # refs[0] still held: FIFO
    consumer.release(refs[0])
    assert producer.reclaim() == 2048
    producer.put_nowait(block)
    producer.put_nowait(block)
    close_all(run, producer, consumer)


def test_wraps_with_seeded_sizes_and_keeps_bytes(run):
    seed = random.randrange(1 << 32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    _, producer, consumer = make_arena(run, capacity_bytes=16 * 1024)
    held = []
    for step in range(400):
        tensor = torch.full((rng.randint(0, 3000),), step % 251, dtype=torch.uint8)
        while (ref := _try_put(producer, tensor)) is None:
            old_ref, old = held.pop(0)
            assert torch.equal(consumer.view(old_ref), old), f"seed={seed}"
            consumer.release(old_ref)
        held.append((ref, tensor))
    close_all(run, producer, consumer)


def _try_put(producer, tensor):
    try:
        return producer.put_nowait(tensor)
    except ArenaFull:
        return None


def test_full_arena_waits_then_errors(run):
    _, producer, consumer = make_arena(run, capacity_bytes=4096)
    big = torch.zeros(2000, dtype=torch.uint8)

    async def main():
        first = await producer.put(big)
        with pytest.raises(ArenaFull, match="'host' .*3000-byte tensor after waiting 0.0"):
            await producer.put(torch.zeros(3000, dtype=torch.uint8), max_wait_s=0.02)
        pending = asyncio.create_task(producer.put(torch.zeros(3000, dtype=torch.uint8)))
        await asyncio.sleep(0)  # one turn: the put parks
        assert not pending.done()
        consumer.release(first)
        await asyncio.wait_for(pending, 1.0)

    asyncio.run(main())
    close_all(run, producer, consumer)


def test_discarded_blocks_are_freed_in_their_turn(run):
    """A request whose later tensor failed gives its stored ones back
    (``discard``): no consumer ever sees them, and the arena does not stay
    full behind them."""
    _, producer, consumer = make_arena(run, capacity_bytes=4096)
    block = torch.zeros(1024 - 64, dtype=torch.uint8)
    held = producer.put_nowait(block)
    stored = [producer.put_nowait(block) for _ in range(3)]
    for ref in stored:
        producer.discard(ref)
    assert producer.num_bytes_in_use == 4096  # behind a block a consumer still holds: FIFO
    consumer.release(held)
    assert producer.reclaim() == 4096 and producer.num_bytes_in_use == 0
    with pytest.raises(ValueError, match="discard on a consumer end"):
        consumer.discard(held)
    close_all(run, producer, consumer)


def test_put_all_stores_together_or_waits_never_on_its_own_blocks(run):
    """A request's tensors go in all or none: one at a time, its first could be all that is left
    outstanding and still leave no room for its next (blocks never wrap), waiting on itself."""
    _, producer, consumer = make_arena(run, capacity_bytes=6400)
    other = producer.put_nowait(torch.zeros(1920 - 64, dtype=torch.uint8))  # another request's, at 0
    a, b = torch.ones(2560 - 64, dtype=torch.uint8), torch.full((3200 - 64,), 2, dtype=torch.uint8)

    async def main():
        pending = asyncio.create_task(producer.put_all([a, b]))
        await asyncio.sleep(0)  # one turn: it parks, holding nothing
        assert not pending.done() and producer.num_bytes_in_use == 1920
        consumer.release(other)
        refs = await asyncio.wait_for(pending, 1.0)  # the emptied arena: both from 0
        assert [torch.equal(consumer.view(r), t) for r, t in zip(refs, (a, b))] == [True, True]
        too_many = r"2 tensors of \d+ bytes in all .*can never fit the 6400-byte arena"
        with pytest.raises(TensorTooLarge, match=too_many):
            await producer.put_all([a, torch.zeros(3904 - 64 + 1, dtype=torch.uint8)])
        with pytest.raises(ArenaFull, match="no room for 2 tensors"):
            await producer.put_all([a, b], max_wait_s=0.02)  # refs still held: a timely refusal, nothing stored
        assert producer.num_bytes_in_use == 5760

    asyncio.run(main())
    close_all(run, producer, consumer)


def test_too_big_for_the_arena_says_so(run):
    _, producer, consumer = make_arena(run, capacity_bytes=4096)
    with pytest.raises(TensorTooLarge, match="'host'.*can never fit the 4096-byte arena"):
        producer.put_nowait(torch.zeros(4096, dtype=torch.uint8))
    close_all(run, producer, consumer)


def test_consumer_in_another_process(run):
    import transport_procs

    spec, producer, _ = make_arena(run)
    tensors = [torch.randn(64, 32), torch.arange(100, dtype=torch.int32), torch.ones(8, dtype=torch.bfloat16)]
    refs = [producer.put_nowait(t) for t in tensors]
    sums = [float(t.double().sum()) for t in tensors]
    proc = SPAWN.Process(target=transport_procs.view_and_release, args=(spec, refs, sums))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    producer.reclaim()
    assert producer.num_bytes_in_use == 0
    close_all(run, producer)
