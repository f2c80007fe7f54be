"""One writer to N readers: one SPSC ring per reader.

Used for the conductor's step plans to the worker ranks: every rank must see
every message in the same order, so a message goes into every ring, and the
slowest rank sets the pace (backpressure, never loss).
"""

from __future__ import annotations

import time
from typing import Any

from transport.channel import Channel, ChannelStats
from transport.codec import Codec
from transport.errors import ChannelClosed, ChannelFull
from transport.ring import ShmRing


class BroadcastChannel(Channel):
    """The writer end over ``rings`` (each opened with role="writer").

    A message is encoded once. ``send`` waits until *every* ring has room
    before writing any, so all readers receive the same messages in the same
    order and a full ring never leaves a message half-broadcast.
    ``send_nowait`` is all-or-nothing likewise. Reading is per ring: each
    reader opens its own ring as an ordinary ``ShmRing``. Publication is the
    rings' (once per loop turn or batch); ``flush`` forces it on all of them.
    """

    def __init__(self, rings: list[ShmRing], union: Any, name: str):
        if not rings:
            raise ValueError(f"broadcast {name!r}: needs at least one reader ring")
        self.name = name
        self.rings = rings
        self._codec = Codec(union, name)
        self._num_blocked = 0
        self._blocked_s = 0.0

    def send_nowait(self, msg: Any) -> None:
        data = self._codec.encode(msg)
        need = self._check_send(data)
        full = [ring.name for ring in self.rings if not ring.has_room(need)]
        if full:
            raise ChannelFull(f"broadcast {self.name!r}: rings {full} are full; await send() to wait")
        for ring in self.rings:
            ring.send_encoded_nowait(data)

    async def send(self, msg: Any) -> None:
        data = self._codec.encode(msg)
        need = self._check_send(data)
        start = None
        for ring in self.rings:
            if not ring.has_room(need):
                start = start or time.perf_counter()
                await ring.wait_for_room(need)
        if start is not None:
            self._num_blocked += 1
            self._blocked_s += time.perf_counter() - start
        for ring in self.rings:
            # Room only grows while we wait on the others (we are the one writer).
            ring.send_encoded_nowait(data)

    def _check_send(self, data: bytes) -> int:
        return max(ring._check_send(data) for ring in self.rings)  # noqa: SLF001 - same package

    async def recv(self) -> Any:
        raise ChannelClosed(f"broadcast {self.name!r}: the broadcast end only sends; readers open their rings")

    def flush(self) -> None:
        """Publish what every ring holds unpublished (see ``ShmRing.flush``)."""
        for ring in self.rings:
            ring.flush()

    def close(self) -> None:
        for ring in self.rings:
            ring.close()  # each publishes what it holds first

    def stats(self) -> ChannelStats:
        """Messages and bytes once per broadcast; capacity of one ring (the
        slowest reader's bound); peak fill of the fullest ring."""
        per_ring = [ring.stats() for ring in self.rings]
        return ChannelStats(
            name=self.name,
            messages=min(s.messages for s in per_ring),
            bytes=min(s.bytes for s in per_ring),
            capacity_bytes=min(s.capacity_bytes for s in per_ring),
            peak_fill_bytes=max(s.peak_fill_bytes for s in per_ring),
            num_blocked=self._num_blocked,
            blocked_s=self._blocked_s,
        )
