"""BroadcastChannel to reader processes, and cleanup of a run's shared memory
after a clean shutdown and after a launcher killed without cleanup."""

import asyncio
import multiprocessing
import os
import random

import pytest
from transport_procs import Blob, Done, Msg, digest_of, payloads

from transport import BroadcastChannel, ChannelFull, cleanup_stale, create_ring, open_ring, shm

SPAWN = multiprocessing.get_context("spawn")


def test_broadcast_to_four_reader_processes(run):
    import transport_procs

    seed = random.randrange(1 << 32)
    num, max_bytes = 1500, 3000
    print(f"seed={seed}")
    specs = [create_ring(run.run_dir, run.run_id, f"plan{rank}", 16 * 1024) for rank in range(4)]
    expected = digest_of(seed, num, max_bytes)
    procs = [SPAWN.Process(target=transport_procs.read_and_digest, args=(spec, expected)) for spec in specs]
    for proc in procs:
        proc.start()
    channel = BroadcastChannel([open_ring(spec, "writer", Msg) for spec in specs], Msg, "plans")

    async def main():
        for blob in payloads(seed, num, max_bytes):
            await channel.send(blob)
        await channel.send(Done(num))

    asyncio.run(main())
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0], f"seed={seed}"
    stats = channel.stats()
    assert stats.messages == num + 1 and stats.capacity_bytes == 16 * 1024
    channel.close()
    assert len(run.cleanup()) == 4


def test_broadcast_send_nowait_is_all_or_nothing(run):
    specs = [create_ring(run.run_dir, run.run_id, f"plan{rank}", 256) for rank in range(2)]
    writers = [open_ring(spec, "writer", Msg) for spec in specs]
    readers = [open_ring(spec, "reader", Msg) for spec in specs]
    channel = BroadcastChannel(writers, Msg, "plans")
    writers[1].send_nowait(Blob(-1, b"x" * 150))  # rank 1 is behind
    channel.send_nowait(Blob(0, b"y" * 40))
    with pytest.raises(ChannelFull, match="'plans'.*'plan1'"):
        channel.send_nowait(Blob(1, b"y" * 40))
    assert [readers[0].recv_nowait().seq, readers[0].recv_nowait()] == [0, None]  # nothing half-sent

    async def main():
        pending = asyncio.create_task(channel.send(Blob(1, b"y" * 40)))
        await asyncio.sleep(0)
        assert not pending.done()
        assert readers[1].recv_nowait().seq == -1
        await asyncio.wait_for(pending, 1.0)

    asyncio.run(main())
    assert [r.recv_nowait().seq for r in readers] == [1, 0]
    assert channel.stats().num_blocked == 1
    channel.close()
    for reader in readers:
        reader.close()
    run.cleanup()


def test_cleanup_run_removes_segments_and_fifos(run):
    spec = create_ring(run.run_dir, run.run_id, "a", 4096)
    create_ring(run.run_dir, run.run_id, "b", 4096)
    assert sorted(run.cleanup()) == [spec.segment, spec.segment[:-1] + "b"]
    assert not os.path.exists(spec.data_fifo) and run.cleanup() == []
    with pytest.raises(ValueError, match="without '/' or '-'"):
        shm.run_prefix("a-b")


def test_cleanup_stale_after_the_launcher_was_killed(tmp_path):
    import transport_procs

    run_id = f"t{os.getpid()}xstale"
    proc = SPAWN.Process(target=transport_procs.create_ring_and_die, args=(str(tmp_path), run_id))
    proc.start()
    proc.join(60)
    segment = f"mstar-{run_id}-ring-steps"
    assert os.path.exists(f"/dev/shm/{segment}")
    live_id = f"t{os.getpid()}xlive"  # a run whose launcher (us) still runs
    create_ring(tmp_path / live_id, live_id, "steps", 4096)
    assert cleanup_stale(tmp_path) == [run_id]
    assert not os.path.exists(f"/dev/shm/{segment}")
    assert not (tmp_path / run_id / "fifo").exists()
    assert os.path.exists(f"/dev/shm/mstar-{live_id}-ring-steps")
    shm.cleanup_run(live_id, tmp_path / live_id)
