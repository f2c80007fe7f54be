"""The Channel interface every transport implements.

A channel is one-directional with one writer and one reader. Messages are
typed (one tagged union per channel, see ``transport.codec``) and travel as
bytes, so the in-memory channel used in tests has the shared-memory ring's
semantics: a bounded byte buffer, a full buffer blocks ``send`` and makes
``send_nowait`` raise ``ChannelFull``, ``close`` by the writer ends the
channel for the reader once it has read everything before it.
"""

from __future__ import annotations

import abc
from typing import Any

import msgspec

from transport.errors import ChannelBroken, ChannelClosed


class ChannelStats(msgspec.Struct, kw_only=True):
    """Counters since the channel was opened, from this end's point of view."""

    name: str
    messages: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    peak_fill_bytes: int = 0  # the most bytes ever waiting in the buffer
    num_blocked: int = 0  # sends that had to wait for room
    blocked_s: float = 0.0  # total time sends waited for room


class Channel(abc.ABC):
    """One-directional, bounded, typed message channel."""

    name: str

    @abc.abstractmethod
    async def send(self, msg: Any) -> None:
        """Send one message, waiting while the buffer is full.
        Raises ChannelClosed when the reader has gone."""

    @abc.abstractmethod
    def send_nowait(self, msg: Any) -> None:
        """Send one message now or raise ChannelFull."""

    @abc.abstractmethod
    async def recv(self) -> Any:
        """The next message. Raises ChannelClosed at end of channel
        (ChannelBroken when the writer died) and DecodeError on bad bytes."""

    async def recv_batch(self, max_n: int = 256) -> list[Any]:
        """Every message already available, up to ``max_n``, and at least one
        (waiting for it): one await per batch, not per message, which is what
        bounds a busy reader's throughput. In channel order, exactly the
        messages successive ``recv`` calls would return. Raises like ``recv``,
        but only when it has nothing to return: a bad record ends the batch
        before it, and the next call raises its DecodeError (the call after
        that goes on with the records behind it); end of channel is raised by
        the call after the last batch."""
        return [await self.recv()]

    def flush(self) -> None:
        """Make what was sent visible to the reader now. Rings publish once per
        event-loop turn; an actor about to block its loop (a long step) flushes
        first so its last reply isn't held back. A no-op where sends are immediate."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close this end. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> ChannelStats:
        """Counters: messages, bytes, peak fill, time blocked."""

    def __aiter__(self):
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.recv()
        except ChannelBroken:
            raise  # a dead writer is not a clean end
        except ChannelClosed:
            raise StopAsyncIteration from None
