"""In-memory channel with the shared-memory ring's semantics, for tests.

Both ends live on one asyncio loop. Messages are encoded on send and decoded
on receive exactly as over the ring, so an unencodable message, a message
outside the channel's union, a full buffer and end-of-channel all behave the
same way.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from transport.channel import Channel, ChannelStats
from transport.codec import Codec
from transport.errors import ChannelClosed, ChannelFull, DecodeError, MessageTooLarge

RECORD_OVERHEAD = 8  # the ring's per-record header, so capacities match


class MemoryChannel(Channel):
    def __init__(self, union: Any, name: str, capacity_bytes: int = 1 << 20):
        self.name = name
        self._codec = Codec(union, name)
        self._capacity = capacity_bytes
        self._records: collections.deque[bytes] = collections.deque()
        self._fill = 0
        self._writer_closed = False
        self._reader_closed = False
        self._changed = asyncio.Event()  # set on any push, pop or close
        self._stats = ChannelStats(name=name, capacity_bytes=capacity_bytes)

    def _size(self, data: bytes) -> int:
        return len(data) + RECORD_OVERHEAD

    def _push(self, data: bytes) -> None:
        self._records.append(data)
        self._fill += self._size(data)
        self._stats.messages += 1
        self._stats.bytes += len(data)
        self._stats.peak_fill_bytes = max(self._stats.peak_fill_bytes, self._fill)
        self._changed.set()

    def _check_send(self, data: bytes) -> bool:
        """True when ``data`` fits now. Raises for closed ends and oversize."""
        if self._writer_closed:
            raise ChannelClosed(f"channel {self.name!r}: send after close")
        if self._reader_closed:
            raise ChannelClosed(f"channel {self.name!r}: the reader has closed")
        if self._size(data) > self._capacity:
            raise MessageTooLarge(
                f"channel {self.name!r}: a {len(data)}-byte message exceeds the "
                f"{self._capacity}-byte buffer; send large tensors through the arena"
            )
        return self._fill + self._size(data) <= self._capacity

    def send_nowait(self, msg: Any) -> None:
        data = self._codec.encode(msg)
        if not self._check_send(data):
            raise ChannelFull(f"channel {self.name!r}: full ({self._fill}/{self._capacity} bytes)")
        self._push(data)

    async def send(self, msg: Any) -> None:
        data = self._codec.encode(msg)
        if self._check_send(data):
            self._push(data)
            return
        start = time.perf_counter()
        self._stats.num_blocked += 1
        while not self._check_send(data):
            self._changed.clear()
            await self._changed.wait()
        self._stats.blocked_s += time.perf_counter() - start
        self._push(data)

    async def _wait_for_record(self) -> None:
        while not self._records:
            if self._writer_closed:
                raise ChannelClosed(f"channel {self.name!r}: closed by the writer")
            if self._reader_closed:
                raise ChannelClosed(f"channel {self.name!r}: recv after close")
            self._changed.clear()
            await self._changed.wait()

    def _pop(self) -> Any:
        """Take and decode the oldest record (consumed even when it is bad,
        as over the ring, so a bad record is never stuck)."""
        data = self._records[0]
        self._consume_oldest()
        return self._codec.decode(data)

    async def recv(self) -> Any:
        await self._wait_for_record()
        return self._pop()

    async def recv_batch(self, max_n: int = 256) -> list[Any]:
        """See ``Channel.recv_batch``: a bad record ends the batch; the next
        call raises its DecodeError."""
        await self._wait_for_record()
        batch = [self._pop()]  # raises when the first record is bad: nothing to return
        while self._records and len(batch) < max_n:
            try:
                msg = self._codec.decode(self._records[0])
            except DecodeError:
                break  # left in place: the next call pops it and raises
            self._consume_oldest()
            batch.append(msg)
        return batch

    def _consume_oldest(self) -> None:
        """Move past the oldest record, already read, and give its room back to
        the writer (the ring's head advancing)."""
        data = self._records.popleft()
        self._fill -= self._size(data)
        self._changed.set()

    def close(self) -> None:
        """Close the writer end (the in-memory channel has one object for both
        ends: the reader closes with ``close_reader``)."""
        self._writer_closed = True
        self._changed.set()

    def close_reader(self) -> None:
        self._reader_closed = True
        self._changed.set()

    def stats(self) -> ChannelStats:
        return self._stats


class MemoryBroadcast:
    """``BroadcastChannel``'s semantics over in-memory channels, for tests:
    every message to every reader in one order; ``send_nowait`` is
    all-or-nothing (ChannelFull before any reader gets it)."""

    def __init__(self, channels: list[MemoryChannel], name: str = "broadcast"):
        if not channels:
            raise ValueError(f"broadcast {name!r}: needs at least one reader channel")
        self.channels = channels
        self.name = name

    def send_nowait(self, msg: Any) -> None:
        datas = [ch._codec.encode(msg) for ch in self.channels]
        full = [ch.name for ch, data in zip(self.channels, datas) if not ch._check_send(data)]
        if full:
            raise ChannelFull(f"broadcast {self.name!r}: channels {full} are full; await send() to wait")
        for ch, data in zip(self.channels, datas):
            ch._push(data)

    async def send(self, msg: Any) -> None:
        for ch in self.channels:  # room only grows while we wait on the others (we are the one writer)
            await ch.send(msg)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    def stats(self) -> ChannelStats:
        """As ``BroadcastChannel.stats``: once per broadcast, the slowest reader's bound."""
        per_reader = [ch.stats() for ch in self.channels]
        return ChannelStats(name=self.name, messages=min(s.messages for s in per_reader),
                            bytes=min(s.bytes for s in per_reader),
                            capacity_bytes=min(s.capacity_bytes for s in per_reader),
                            peak_fill_bytes=max(s.peak_fill_bytes for s in per_reader))
