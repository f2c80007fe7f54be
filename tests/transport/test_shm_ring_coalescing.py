"""The ring writer's coalesced publication: records become visible (the
shared tail moves, the reader is woken) once per loop turn or batch, not
once per send."""

import asyncio
import random

import pytest
from transport_procs import Blob, Msg, payloads

from transport import ChannelClosed, ChannelFull, create_ring, open_ring, shm
from transport.ring import MAX_UNPUBLISHED_BYTES, W_READER_PARKED, W_TAIL, ShmRing


def make_ring(run, name="r", capacity_bytes=8192, union=Msg) -> tuple[ShmRing, ShmRing]:
    spec = create_ring(run.run_dir, run.run_id, name, capacity_bytes)
    return open_ring(spec, "writer", union), open_ring(spec, "reader", union)


def close_all(run, *rings):
    for ring in rings:
        ring.close()
    run.cleanup()


@pytest.fixture
def pokes(monkeypatch):
    """The file descriptors poked, in order (the real poke still happens)."""
    poked = []
    real_poke = shm.poke

    def counting_poke(fd):
        poked.append(fd)
        real_poke(fd)

    monkeypatch.setattr(shm, "poke", counting_poke)
    return poked


def published_tail(writer: ShmRing) -> int:
    return writer._words[W_TAIL]


def test_a_burst_to_a_busy_reader_is_published_once(run, pokes):
    writer, reader = make_ring(run)
    pokes.clear()  # opening an end pokes the other
    num = 40  # 40 records of 24 bytes stay under MAX_UNPUBLISHED_BYTES

    async def main():
        for seq in range(num):
            writer.send_nowait(Blob(seq, b""))
        assert published_tail(writer) == 0  # nothing visible within the turn
        await asyncio.sleep(0)
        assert published_tail(writer) == writer._tail
        return [reader.recv_nowait().seq for _ in range(num)]

    assert asyncio.run(main()) == list(range(num))
    assert reader.stats().peak_fill_bytes == writer._tail  # one batch
    assert not pokes  # the reader never parked
    close_all(run, writer, reader)


def test_a_parked_reader_gets_the_first_record_at_once_and_one_wakeup(run, pokes):
    writer, reader = make_ring(run)
    num = 40

    async def main():
        pending = asyncio.create_task(reader.recv())
        await asyncio.sleep(0)  # the reader spins, then parks
        assert reader._words[W_READER_PARKED] == 1
        pokes.clear()
        writer.send_nowait(Blob(0, b""))
        first_tail = writer._tail
        for seq in range(1, num):
            writer.send_nowait(Blob(seq, b""))
        assert published_tail(writer) == first_tail  # the first record only: the rest wait for the turn
        first = await asyncio.wait_for(pending, 1.0)
        return first, [reader.recv_nowait().seq for _ in range(num - 1)]

    first, rest = asyncio.run(main())
    assert first.seq == 0 and rest == list(range(1, num))
    assert pokes == [writer._peer_fd]  # one wakeup for the whole burst
    close_all(run, writer, reader)


def test_records_are_published_when_the_loop_turns_without_flush(run):
    writer, reader = make_ring(run)

    async def main():
        writer.send_nowait(Blob(1, b"a"))
        assert reader.recv_nowait() is None
        await asyncio.sleep(0)  # one loop turn, no flush()
        return reader.recv_nowait()

    assert asyncio.run(main()) == Blob(1, b"a")
    close_all(run, writer, reader)


def test_without_a_loop_every_send_is_published_at_once(run):
    writer, reader = make_ring(run)
    writer.send_nowait(Blob(1, b"a"))
    assert published_tail(writer) == writer._tail
    assert reader.recv_nowait() == Blob(1, b"a")
    close_all(run, writer, reader)


def test_flush_and_close_publish_what_is_pending(run):
    writer, reader = make_ring(run)

    async def main():
        writer.send_nowait(Blob(0, b""))
        writer.flush()
        assert reader.recv_nowait() == Blob(0, b"")
        for seq in (1, 2, 3):
            writer.send_nowait(Blob(seq, b""))
        writer.close()  # within the same turn: close must publish them
        writer.flush()  # after close: nothing to do, no error
        reader.flush()  # on the reader end: nothing to do
        got = [reader.recv_nowait().seq for _ in range(3)]
        with pytest.raises(ChannelClosed, match="closed by the writer"):
            reader.recv_nowait()
        await asyncio.sleep(0)  # the scheduled publication runs after close: harmless
        return got

    assert asyncio.run(main()) == [1, 2, 3]
    close_all(run, reader)


def test_a_long_burst_is_published_every_few_kilobytes(run):
    writer, reader = make_ring(run, capacity_bytes=64 * 1024)
    record = 8 + 64  # Blob(seq, 58 bytes) encodes to about 64 bytes

    async def main():
        unpublished = []
        for seq in range(2 * MAX_UNPUBLISHED_BYTES // record):
            writer.send_nowait(Blob(seq, bytes(58)))
            unpublished.append(writer._tail - published_tail(writer))
        return unpublished

    unpublished = asyncio.run(main())
    assert max(unpublished) < MAX_UNPUBLISHED_BYTES  # published mid-burst ...
    assert unpublished[-1] > 0  # ... and the rest left for the loop turn
    close_all(run, writer, reader)


def test_a_ring_that_looks_full_publishes_so_the_reader_can_drain(run):
    writer, reader = make_ring(run, capacity_bytes=256)

    async def main():
        num_sent = 0
        with pytest.raises(ChannelFull):
            while True:
                writer.send_nowait(Blob(num_sent, b"y" * 40))
                num_sent += 1
        assert published_tail(writer) == writer._tail  # all of it, within the turn
        return num_sent, [reader.recv_nowait().seq for _ in range(num_sent)]

    num_sent, got = asyncio.run(main())
    assert got == list(range(num_sent))
    close_all(run, writer, reader)


def test_a_waiting_reader_publishes_its_own_pending_sends_before_it_spins(run):
    """A ping then a wait for the pong in one task: the ping must leave
    before the wait spins, not after (no loop turn happens in between)."""
    ping_writer, ping_reader = make_ring(run, "ping")
    pong_writer, pong_reader = make_ring(run, "pong")

    async def main():
        ping_writer.send_nowait(Blob(7, b"ping"))
        assert published_tail(ping_writer) == 0
        waiting = pong_reader.wait_for_record()
        waiting.send(None)  # runs until it parks: spin done, no loop turn
        assert published_tail(ping_writer) == ping_writer._tail
        waiting.close()
        return ping_reader.recv_nowait()

    assert asyncio.run(main()) == Blob(7, b"ping")
    close_all(run, ping_writer, ping_reader, pong_writer, pong_reader)


@pytest.mark.parametrize("capacity_bytes", [512, 4096])
def test_order_and_bytes_kept_across_wraps_with_a_sender_that_never_yields(run, capacity_bytes):
    seed = random.randrange(1 << 32)
    print(f"seed={seed}")
    writer, reader = make_ring(run, capacity_bytes=capacity_bytes)
    expected = list(payloads(seed, 1500, capacity_bytes // 3))

    async def main():
        async def produce():
            for blob in expected:  # the actor's pattern: await only when full
                try:
                    writer.send_nowait(blob)
                except ChannelFull:
                    await writer.send(blob)
            writer.close()

        task = asyncio.create_task(produce())
        got = [msg async for msg in reader]
        await task
        return got

    got = asyncio.run(main())
    assert got == expected, f"seed={seed}"
    assert writer.stats().bytes > 20 * capacity_bytes  # wrapped many times
    close_all(run, reader)


def test_broadcast_flush_publishes_every_ring(run):
    from transport import BroadcastChannel

    specs = [create_ring(run.run_dir, run.run_id, f"plan{rank}", 4096) for rank in range(3)]
    writers = [open_ring(spec, "writer", Msg) for spec in specs]
    readers = [open_ring(spec, "reader", Msg) for spec in specs]
    channel = BroadcastChannel(writers, Msg, "plans")

    async def main():
        channel.send_nowait(Blob(3, b"plan"))
        assert all(reader.recv_nowait() is None for reader in readers)
        channel.flush()
        return [reader.recv_nowait() for reader in readers]

    assert asyncio.run(main()) == [Blob(3, b"plan")] * 3
    channel.close()
    close_all(run, *readers)
