"""The Mailbox pulls a batch per await (recv_batch) and keeps what recv did:
per-channel order, backpressure bounded by max_pending, end of channel after
the last message, and a bad record raised after the messages before it."""

import asyncio

import msgspec
import pytest

from actors.base import Actor, Mailbox, _EndOfChannel
from mstar_actors.config import Config
from mstar_actors.messages import ActorError, ActorToLauncher, FrontendToPrepare, NewRequest, SamplingParams
from transport.errors import ChannelClosed, DecodeError
from transport.memory import MemoryChannel


def new_request(request_id):
    return NewRequest(request_id=request_id, model="m", sampling=SamplingParams(), prompt="hi")


class Seen(Actor):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list = []

    async def handle(self, channel, msg):
        self.seen.append((channel, msg.request_id))


@pytest.mark.parametrize("max_pending", [1, 3, 256])
def test_order_per_channel_and_end_after_the_last_message(max_pending):
    async def main():
        a, b = MemoryChannel(FrontendToPrepare, "a"), MemoryChannel(FrontendToPrepare, "b")
        for i in range(20):
            a.send_nowait(new_request(f"a{i}"))
            b.send_nowait(new_request(f"b{i}"))
        a.close()
        b.close()
        mailbox = Mailbox({"a": a, "b": b}, max_pending=max_pending)
        mailbox.open()
        got = {"a": [], "b": []}
        ends = set()
        while len(ends) < 2:
            name, msg = await asyncio.wait_for(mailbox.get(), 5)
            if isinstance(msg, _EndOfChannel):
                assert isinstance(msg.error, ChannelClosed)
                ends.add(name)
            else:
                assert name not in ends, "a message after its channel's end"
                got[name].append(msg.request_id)
        assert got == {n: [f"{n}{i}" for i in range(20)] for n in "ab"}
        mailbox.close()

    asyncio.run(main())


def test_a_full_mailbox_leaves_the_rest_in_the_channel():
    async def main():
        ch = MemoryChannel(FrontendToPrepare, "a")
        for i in range(10):
            ch.send_nowait(new_request(f"r{i}"))
        mailbox = Mailbox({"a": ch}, max_pending=2)
        mailbox.open()
        for _ in range(5):
            await asyncio.sleep(0)  # let the pump run as far as it can
        # queue (2) + the pump's batch (at most max_pending) are out of the channel
        assert len(ch._records) >= 10 - 2 - 2
        assert [(await mailbox.get())[1].request_id for _ in range(10)] == [f"r{i}" for i in range(10)]
        mailbox.close()

    asyncio.run(main())


def test_a_bad_record_fails_the_actor_after_the_messages_before_it():
    async def main():
        inbox = {"frontend": MemoryChannel(FrontendToPrepare, "frontend->x")}
        control = MemoryChannel(ActorToLauncher, "x->launcher")
        actor = Seen(name="x", config=Config(), inbox=inbox, outbox={"control": control})
        inbox["frontend"].send_nowait(new_request("a"))
        inbox["frontend"].send_nowait(new_request("b"))
        inbox["frontend"]._push(msgspec.msgpack.encode(42))
        inbox["frontend"].send_nowait(new_request("never"))
        assert await asyncio.wait_for(actor.run(), 5) == 1
        assert actor.seen == [("frontend", "a"), ("frontend", "b")]
        errors = [m for m in [await control.recv() for _ in range(2)] if isinstance(m, ActorError)]
        assert errors and DecodeError.__name__ in errors[0].message and "'frontend'" in errors[0].message

    asyncio.run(main())
