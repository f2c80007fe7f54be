"""MemoryBroadcast keeps BroadcastChannel's contract: every reader gets every
message in one order, and a full reader refuses a send_nowait to all."""

import asyncio

import pytest

from mstar_actors.messages import Abort, FrontendToPrepare
from transport.errors import ChannelFull
from transport.memory import MemoryBroadcast, MemoryChannel


def test_every_reader_gets_every_message_in_order_and_a_full_one_refuses_all():
    async def go():
        probe = MemoryChannel(FrontendToPrepare, "probe")
        record = probe._size(probe._codec.encode(Abort(request_id="a0")))
        small = MemoryChannel(FrontendToPrepare, "small", capacity_bytes=3 * record)
        big = MemoryChannel(FrontendToPrepare, "big")
        out = MemoryBroadcast([small, big], "fan")
        out.send_nowait(Abort(request_id="a0"))
        await out.send(Abort(request_id="a1"))
        out.send_nowait(Abort(request_id="a2"))
        with pytest.raises(ChannelFull):
            out.send_nowait(Abort(request_id="a3"))  # small is full: big does not get it either
        assert out.stats().messages == 3
        got = [[(await ch.recv()).request_id for _ in range(3)] for ch in (small, big)]
        assert got == [["a0", "a1", "a2"]] * 2
        assert big.stats().messages == 3

    asyncio.run(asyncio.wait_for(go(), 10))
