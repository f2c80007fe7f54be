"""recv_batch on both channel kinds: everything available in one await, in
order, bounded by max_n; a bad record ends the batch before it; end of
channel after the last batch."""

import asyncio

import msgspec
import pytest
from transport_procs import Blob, Msg

from transport import ChannelClosed, DecodeError, create_ring, open_ring
from transport.memory import MemoryChannel


class Pair:
    """A writer and a reader end of one channel, of either kind."""

    def __init__(self, kind, run):
        self.run = run
        if kind == "memory":
            self.writer = self.reader = MemoryChannel(Msg, "plans", capacity_bytes=4096)
        else:
            spec = create_ring(run.run_dir, run.run_id, "plans", 4096)
            self.writer = open_ring(spec, "writer", Msg)
            self.reader = open_ring(spec, "reader", Msg)

    def send_bad(self):
        """An int where the union wants a Blob or a Done."""
        if isinstance(self.writer, MemoryChannel):
            self.writer._push(msgspec.msgpack.encode(42))
        else:
            self.writer.send_encoded_nowait(msgspec.msgpack.encode(42))

    def close(self):
        self.writer.close()
        if self.reader is not self.writer:
            self.reader.close()
            self.run.cleanup()


@pytest.fixture(params=["memory", "ring"])
def pair(request, run):
    pairs = []

    def make():
        pairs.append(Pair(request.param, run))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


def test_one_await_returns_everything_available_in_order(pair):
    async def main():
        p = pair()
        for seq in range(5):
            p.writer.send_nowait(Blob(seq, b"x" * seq))
        p.writer.flush()
        assert await p.reader.recv_batch() == [Blob(seq, b"x" * seq) for seq in range(5)]

    asyncio.run(main())


def test_max_n_bounds_the_batch_and_keeps_the_rest(pair):
    async def main():
        p = pair()
        for seq in range(5):
            p.writer.send_nowait(Blob(seq, b""))
        p.writer.flush()
        assert [m.seq for m in await p.reader.recv_batch(2)] == [0, 1]
        assert (await p.reader.recv()).seq == 2  # batch and single receives mix in order
        assert [m.seq for m in await p.reader.recv_batch(10)] == [3, 4]

    asyncio.run(main())


def test_an_empty_channel_waits_for_the_first_message(pair):
    async def main():
        p = pair()
        waiting = asyncio.create_task(p.reader.recv_batch())
        await asyncio.sleep(0)  # one loop turn: the reader is now waiting
        assert not waiting.done()
        p.writer.send_nowait(Blob(7, b"late"))
        assert await asyncio.wait_for(waiting, 5) == [Blob(7, b"late")]

    asyncio.run(main())


def test_a_bad_record_is_raised_after_the_good_ones_before_it(pair):
    async def main():
        p = pair()
        p.writer.send_nowait(Blob(0, b"a"))
        p.writer.send_nowait(Blob(1, b"b"))
        p.send_bad()
        p.writer.send_nowait(Blob(3, b"d"))
        p.writer.flush()
        assert [m.seq for m in await p.reader.recv_batch()] == [0, 1]
        with pytest.raises(DecodeError, match="'plans'"):
            await p.reader.recv_batch()
        assert await p.reader.recv_batch() == [Blob(3, b"d")]  # the bad record is consumed

    asyncio.run(main())


def test_end_of_channel_comes_after_the_last_batch(pair):
    async def main():
        p = pair()
        p.writer.send_nowait(Blob(0, b"a"))
        p.writer.send_nowait(Blob(1, b"b"))
        p.writer.close()
        assert [m.seq for m in await p.reader.recv_batch()] == [0, 1]
        with pytest.raises(ChannelClosed, match="closed by the writer"):
            await p.reader.recv_batch()

    asyncio.run(main())
