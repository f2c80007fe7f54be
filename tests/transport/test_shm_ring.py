"""ShmRing: records, wrap-around, backpressure, close, dead peers, decode
errors, and a multi-process stress run."""

import asyncio
import multiprocessing
import os
import random
import signal
import time

import msgspec
import pytest
from transport_procs import Blob, Done, Msg, payloads

from transport import ChannelBroken, ChannelClosed, ChannelFull, DecodeError, create_ring, open_ring, unlink_ring
from transport.ring import W_WRITER_PARKED, ShmRing

SPAWN = multiprocessing.get_context("spawn")


def make_ring(run, name="r", capacity_bytes=4096, union=Msg) -> tuple[ShmRing, ShmRing]:
    spec = create_ring(run.run_dir, run.run_id, name, capacity_bytes)
    return open_ring(spec, "writer", union), open_ring(spec, "reader", union)


def close_all(run, *rings):
    for ring in rings:
        ring.close()
    run.cleanup()


def test_round_trip_wraps_and_keeps_every_byte(run):
    seed = random.randrange(1 << 32)
    print(f"seed={seed}")
    writer, reader = make_ring(run, capacity_bytes=4096)
    expected = list(payloads(seed, 600, 2600))  # up to more than half the ring

    async def main():
        async def produce():
            for blob in expected:
                await writer.send(blob)
            writer.close()

        task = asyncio.create_task(produce())
        got = [msg async for msg in reader]
        await task
        return got

    got = asyncio.run(main())
    assert got == expected
    assert writer.stats().bytes > 50 * 4096  # wrapped many times
    assert reader.stats().messages == len(expected)
    close_all(run, reader)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4000, 4096 - 8 - 16])
def test_split_records_at_every_offset(run, size):
    writer, reader = make_ring(run, capacity_bytes=4096, union=bytes)
    data = bytes(range(256)) * 16
    for offset in range(0, 4096, 504):  # walk the start position around the ring
        filler = data[: max(0, 504 - 8 - 3)]  # msgpack bin header is 3 bytes
        writer.send_nowait(filler)
        assert reader.recv_nowait() == filler
        writer.send_nowait(data[:size])
        assert reader.recv_nowait() == data[:size]
    assert reader.recv_nowait() is None
    close_all(run, writer, reader)


def test_full_ring_blocks_send_until_read(run):
    writer, reader = make_ring(run, capacity_bytes=256)

    async def main():
        num_sent = 0
        with pytest.raises(ChannelFull, match="'r'.*full"):
            while True:
                writer.send_nowait(Blob(num_sent, b"y" * 40))
                num_sent += 1
        blocked = asyncio.create_task(writer.send(Blob(num_sent, b"z")))
        await asyncio.sleep(0)  # one turn: the send spins, then parks
        assert not blocked.done()
        assert writer._words[W_WRITER_PARKED] == 1
        assert (await reader.recv()).seq == 0
        await asyncio.wait_for(blocked, 1.0)
        return num_sent

    num_sent = asyncio.run(main())
    assert num_sent == 256 // 64  # 49-byte records take 64 bytes each
    stats = writer.stats()
    assert stats.num_blocked == 1 and stats.blocked_s > 0
    assert stats.peak_fill_bytes == stats.capacity_bytes
    close_all(run, writer, reader)


def test_close_drains_then_ends(run):
    writer, reader = make_ring(run)

    async def main():
        for seq in range(5):
            await writer.send(Blob(seq, b""))
        writer.close()
        got = [msg.seq async for msg in reader]
        with pytest.raises(ChannelClosed, match="closed by the writer"):
            await reader.recv()
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    writer.close()  # idempotent
    close_all(run, reader)


def test_reader_parked_then_woken_by_close(run):
    writer, reader = make_ring(run)

    async def main():
        pending = asyncio.create_task(reader.recv())
        await asyncio.sleep(0)
        assert not pending.done()
        writer.close()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(pending, 1.0)

    asyncio.run(main())
    close_all(run, reader)


def test_send_after_reader_closed_raises(run):
    writer, reader = make_ring(run)
    reader.close()
    with pytest.raises(ChannelClosed, match="reader has closed"):
        writer.send_nowait(Blob(0, b""))
    close_all(run, writer)


def test_oversize_message_points_to_the_arena(run):
    writer, reader = make_ring(run, capacity_bytes=1024)
    with pytest.raises(ValueError, match="'r'.*exceeds the 1024-byte ring.*arena"):
        writer.send_nowait(Blob(0, b"x" * 1024))
    close_all(run, writer, reader)


def test_decode_error_names_the_channel(run):
    spec = create_ring(run.run_dir, run.run_id, "plans", 4096)
    writer = open_ring(spec, "writer", int)
    reader = open_ring(spec, "reader", Msg)
    writer.send_nowait(42)
    writer.send_nowait(Blob(1, b"ok"))  # the bad record is consumed, not stuck
    with pytest.raises(DecodeError, match="'plans'"):
        reader.recv_nowait()
    assert reader.recv_nowait() == Blob(1, b"ok")
    close_all(run, writer, reader)


def test_wrong_spec_is_refused(run):
    spec = create_ring(run.run_dir, run.run_id, "r", 4096)
    bad = msgspec.structs.replace(spec, capacity_bytes=8192)
    with pytest.raises(ValueError, match="not a ring of 8192 bytes"):
        open_ring(bad, "reader", Msg)
    with pytest.raises(ValueError, match="use 'writer' or 'reader'"):
        open_ring(spec, "both", Msg)
    unlink_ring(spec)
    run.cleanup()


def _spawn(target, *args):
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def test_killed_writer_breaks_the_reader_within_a_second(run):
    import transport_procs

    spec = create_ring(run.run_dir, run.run_id, "r", 4096)
    reader = open_ring(spec, "reader", Msg)
    proc = _spawn(transport_procs.write_then_hang, spec, 3)

    async def main():
        assert [(await reader.recv()).seq for _ in range(3)] == [0, 1, 2]
        pending = asyncio.create_task(reader.recv())
        await asyncio.sleep(0)
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ChannelBroken, match="writer process died"):
            await asyncio.wait_for(pending, 1.0)
        return time.monotonic() - start

    took = asyncio.run(main())
    print(f"dead writer detected in {took * 1e3:.1f} ms")
    proc.join()
    close_all(run, reader)


def test_killed_reader_breaks_a_blocked_send(run):
    import transport_procs

    spec = create_ring(run.run_dir, run.run_id, "r", 256)
    writer = open_ring(spec, "writer", Msg)
    ready, child_end = SPAWN.Pipe()
    proc = _spawn(transport_procs.open_reader_then_hang, spec, child_end)
    assert ready.poll(30) and ready.recv() == "open"

    async def main():
        with pytest.raises(ChannelFull):
            while True:
                writer.send_nowait(Blob(0, b"y" * 40))
        pending = asyncio.create_task(writer.send(Blob(1, b"")))
        await asyncio.sleep(0)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(ChannelBroken, match="reader process died"):
            await asyncio.wait_for(pending, 1.0)

    asyncio.run(main())
    proc.join()
    close_all(run, writer)


def test_a_child_attaching_and_exiting_leaves_the_segment(run):
    import transport_procs

    spec = create_ring(run.run_dir, run.run_id, "r", 4096)
    proc = SPAWN.Process(target=transport_procs.open_reader_and_exit, args=(spec,))
    proc.start()
    proc.join()
    assert proc.exitcode == 0
    assert os.path.exists(f"/dev/shm/{spec.segment}")  # no resource tracker unlinked it
    assert run.cleanup() == [spec.segment]
    assert not os.path.exists(spec.data_fifo)


def test_multiprocess_stress_every_byte_in_order(run):
    import transport_procs

    seed = random.randrange(1 << 32)
    num, max_bytes = 4000, 40_000
    print(f"seed={seed} num={num} max_bytes={max_bytes}")
    spec = create_ring(run.run_dir, run.run_id, "stress", 64 * 1024)
    reader = open_ring(spec, "reader", Msg)
    proc = _spawn(transport_procs.write_seeded, spec, seed, num, max_bytes)

    async def main():
        expected = payloads(seed, num, max_bytes)
        num_read = 0
        async for msg in reader:
            if isinstance(msg, Done):
                assert msg.num_sent == num
                continue
            assert msg == next(expected), f"message {num_read} differs (seed={seed})"
            num_read += 1
        return num_read

    assert asyncio.run(main()) == num
    proc.join()
    assert proc.exitcode == 0
    print(reader.stats())
    close_all(run, reader)


def test_bad_record_in_a_batch_comes_after_the_good_ones(run):
    spec = create_ring(run.run_dir, run.run_id, "plans", 4096)
    writer, reader = open_ring(spec, "writer", Blob | int), open_ring(spec, "reader", Msg)
    for msg in (Blob(0, b"a"), 42, Blob(2, b"c")):
        writer.send_nowait(msg)
    assert reader.recv_nowait() == Blob(0, b"a")
    with pytest.raises(DecodeError, match="'plans'"):
        reader.recv_nowait()
    assert reader.recv_nowait() == Blob(2, b"c")
    assert reader.stats().messages == 2
    close_all(run, writer, reader)
