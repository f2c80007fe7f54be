"""Single-producer single-consumer ring of variable-size records in shared
memory, between two processes, behind the ``Channel`` interface.

The launcher creates each ring (``create_ring``) and passes the ``RingSpec``
to the two processes, which ``open_ring(spec, role, union)``. Both ends run
on an asyncio loop; waiting spins briefly, then parks on a FIFO the loop
watches. See ``ShmRing`` for the layout and the ordering rules.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from transport import shm
from transport.channel import Channel, ChannelStats
from transport.codec import Codec
from transport.errors import ChannelBroken, ChannelClosed, ChannelFull, DecodeError, MessageTooLarge

MAGIC = 0x3152_5253_5453_4D  # "MSTSRR1", little-endian
RECORD_HEADER = 8
MIN_CAPACITY = 64
# Word indexes (8-byte words) of the header fields; one cache line = 8 words.
W_MAGIC, W_CAPACITY, W_WRITER_PID, W_READER_PID, W_WRITER_CLOSED, W_READER_CLOSED = range(6)
W_TAIL = 8  # line 1
W_HEAD = 16  # line 2
W_READER_PARKED = 24  # line 3
W_WRITER_PARKED = 32  # line 4
DATA = 40 * 8  # byte offset of the data area
# Checks before parking. One check is ~0.1 us, so this spins for tens of
# microseconds: long enough to catch a peer that is mid-step, short enough
# not to matter when the peer is idle.
MAX_SPIN_CHECKS = 300
# Then this long checking between sched_yield calls, before parking.
MAX_YIELD_S = 100e-6
MAX_BATCH = 256  # records the reader decodes per visit to the shared counters
# The writer publishes its tail at once when this many bytes are unpublished
# (about 56 records of 64 B): a fast sender that never yields to its loop
# still feeds the reader in small batches, and a large record (whose copy
# dwarfs the fence) is published as soon as it is written.
MAX_UNPUBLISHED_BYTES = 4096
SMALL_RECORD_BYTES = 4096  # the reader decodes these from a copy, larger ones in place
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


class RingSpec(msgspec.Struct, frozen=True):
    """Everything a process needs to open one end of a ring (picklable)."""

    name: str  # the channel's name, used in every error message
    segment: str  # shared-memory segment name, mstar-<run_id>-ring-<name>
    capacity_bytes: int  # size of the data area
    data_fifo: str  # writer -> reader: "records available"
    space_fifo: str  # reader -> writer: "room available"


def create_ring(run_dir: str | os.PathLike, run_id: str, name: str, capacity_bytes: int) -> RingSpec:
    """Create the segment and FIFOs of one ring (in the launcher)."""
    capacity = _round_capacity(name, capacity_bytes)
    shm.register_run(run_dir, run_id)
    seg = shm.create_segment(shm.segment_name(run_id, f"ring-{name}"), DATA + capacity)
    words = seg.buf.cast("Q")
    words[W_CAPACITY] = capacity
    words[W_MAGIC] = MAGIC
    words.release()
    seg.close()
    fifos = shm.fifo_dir(run_dir)
    spec = RingSpec(name, seg.name, capacity, str(fifos / f"{name}.data"), str(fifos / f"{name}.space"))
    shm.make_fifo(Path(spec.data_fifo))
    shm.make_fifo(Path(spec.space_fifo))
    return spec


def unlink_ring(spec: RingSpec) -> None:
    """Remove the ring's names (open ends keep working); idempotent."""
    shm.unlink_segment(spec.segment)
    for path in (spec.data_fifo, spec.space_fifo):
        Path(path).unlink(missing_ok=True)


def open_ring(spec: RingSpec, role: Literal["writer", "reader"], union: Any) -> ShmRing:
    if role not in ("writer", "reader"):
        raise ValueError(f"ring {spec.name!r}: role {role!r}; use 'writer' or 'reader'")
    return ShmRing(spec, role, union)


def _round_capacity(name: str, capacity_bytes: int) -> int:
    if capacity_bytes < MIN_CAPACITY:
        raise ValueError(f"ring {name!r}: capacity {capacity_bytes} bytes; use at least {MIN_CAPACITY}")
    return capacity_bytes - capacity_bytes % 8


def _footprint(nbytes: int) -> int:
    """Bytes a record of ``nbytes`` payload takes: header, payload, padding
    to 8 so every record header is 8-aligned and never straddles the end."""
    return RECORD_HEADER + ((nbytes + 7) & ~7)


_local = threading.local()


def _unpublished_rings() -> set:
    """This thread's writer ends holding records they have not published.

    Per thread because publishing touches a writer's private tail, which only
    its own (loop) thread may do."""
    try:
        return _local.rings
    except AttributeError:
        _local.rings = set()
        return _local.rings


def publish_pending() -> None:
    """Publish every unpublished record this thread's ring writers hold.

    A waiting end calls this before it spins: the spin does not yield to the
    loop, so the once-per-iteration publication would otherwise wait for it
    (a ping's reply would not leave before the next ping came back)."""
    for ring in _unpublished_rings():
        ring.flush()  # leaves the set alone: the ring stays listed until its loop turn


class Parker:
    """One end's parking place on its asyncio loop: readable ``fd`` means
    the peer poked us; the peer's pidfd, once known, means it exited.

    Both descriptors stay registered with the loop while the end is open;
    the callbacks drain the FIFO and set an event. ``arm()`` clears the event
    *before* the caller sets its parked flag, so a poke that lands between
    the flag and the ``wait()`` is never lost (the callback sets the event
    after the clear, and callbacks run on the loop thread only).
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.is_peer_dead = False
        self._pidfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def watch_peer(self, pid: int) -> None:
        if pid == 0 or self._pidfd is not None or self.is_peer_dead:
            return
        self._pidfd = shm.open_pidfd(pid)
        if self._pidfd is None:
            self.is_peer_dead = True
        elif self._loop is not None:
            self._loop.add_reader(self._pidfd, self._on_exit)

    def arm(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        self._event.clear()

    async def wait(self) -> None:
        await self._event.wait()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._unbind()
        self._loop, self._event = loop, asyncio.Event()
        loop.add_reader(self.fd, self._on_poke)
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, self._on_exit)

    def _unbind(self) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.remove_reader(self.fd)
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)

    def _on_poke(self) -> None:
        shm.drain(self.fd)
        self._event.set()

    def _on_exit(self) -> None:
        self.is_peer_dead = True
        self._loop.remove_reader(self._pidfd)
        self._event.set()

    def close(self) -> None:
        self._unbind()
        self._loop = None
        for fd in (self.fd, self._pidfd):
            if fd is not None:
                os.close(fd)
        self._pidfd = None


class ShmRing(Channel):
    """One end (writer or reader) of an SPSC ring in shared memory.

    Layout of the segment (8-byte words; each line is one 64-byte cache line,
    so the writer's and the reader's hot counters never share a line)::

        byte 0   +------------------------------------------------------+
                 | magic | capacity | writer_pid | reader_pid |         |
                 | writer_closed | reader_closed | (unused)           |
        byte 64  +------------------------------------------------------+
                 | tail: bytes ever published (u64, monotonic) [writer] |
        byte 128 +------------------------------------------------------+
                 | head: bytes ever consumed (u64, monotonic) [reader]  |
        byte 192 +------------------------------------------------------+
                 | reader_parked (set by reader, cleared by writer)     |
        byte 256 +------------------------------------------------------+
                 | writer_parked (set by writer, cleared by reader)     |
        byte 320 +------------------------------------------------------+
                 | data: capacity bytes, records at (position % cap)    |
                 |  [len u64][payload ...][pad to 8] [len][payload] ... |
                 +------------------------------------------------------+

    Fill is ``tail - head``; the ring is empty when they are equal. A record
    takes ``8 + round_up(len, 8)`` bytes. Headers are 8-aligned and never
    straddle the end; a payload that reaches the end is *split*: it continues
    at the start of the data area (the reader joins the two parts, the only
    case where it copies before decoding). So no bytes are wasted on skip
    markers and any record up to ``capacity - 8`` bytes fits an empty ring;
    bigger ones raise ``ValueError`` (use the tensor arena).

    Coalesced publication (writer). ``send``/``send_nowait`` write the record
    and advance a *private* tail (``_tail``); the shared ``tail`` word, the
    fence and the parked-reader check happen once per batch, in ``flush()``:

    - once per event-loop iteration: the first unpublished record schedules
      ``flush`` with ``loop.call_soon``, which runs before the loop next
      sleeps, so a burst of N sends costs one fence and at most one wakeup;
    - at once when ``MAX_UNPUBLISHED_BYTES`` are unpublished, when the ring
      looks full to the writer (the reader can only make room from what it
      sees), before any end of this thread spins or parks
      (``publish_pending``), on ``flush()`` and on ``close()``;
    - at once when no event loop runs in this thread, and for the first
      record of a batch when the reader is parked (idle: it gains nothing
      from waiting for more, and a sender that then blocks its loop does
      not hold the message back).

    So a record is visible at the latest when the sending task next yields to
    its loop. A task that sends to a busy reader and then blocks its loop
    without yielding (a long synchronous computation) should call
    ``flush()`` first. The
    writer also keeps the last ``head`` it loaded (``_head``) and re-loads
    the shared word only when that stale view says the ring is full, at
    publication, or when asked ``has_room``: a stale head only under-states
    the room, never over-states it.

    Ordering-critical stores:

    1. Writer: payload and length are written *before* ``tail`` is
       published (``flush`` stores ``tail`` only after every record up to the
       private tail is complete). Reader: ``tail`` is loaded *before* the
       payload is read.
    2. Reader: the payload is fully decoded (or copied out) *before* ``head``
       is published (the writer may overwrite those bytes right after).
    3. Writer: ``close`` flushes, then stores ``writer_closed`` after the last
       ``tail``; the reader re-loads ``tail`` after seeing it.
    4. Parking (both directions, Dekker style): the waiter stores its
       ``*_parked`` flag, issues a full fence, *then* re-checks the counter;
       the peer stores the counter, issues a full fence, *then* loads the
       flag and, if set, clears it and writes one byte to the waiter's FIFO.
       With the fences, at least one side sees the other's store, so a
       wakeup is never lost; without them x86's store buffer lets both miss.
       The writer's counter store here is the *published* tail: unpublished
       records wake no one, and a writer about to wait for room publishes
       first, so the reader it waits for can see (and consume) everything.

    Why plain stores through a memoryview are enough for 1-3: each counter is
    one aligned 8-byte word written and read through a ``"Q"`` memoryview,
    which CPython compiles to a single ``memcpy`` of 8 bytes (one load or
    store instruction, so never torn); every store is a separate C call, so
    the compiler cannot reorder them. On x86-64 (TSO) stores become visible in
    program order and loads are not reordered with older loads or younger
    stores, so 1-3 hold as written. aarch64 may reorder both, so there
    ``shm.publish_fence`` (a ``dmb ish``) precedes every counter store; on
    x86-64 it is a no-op. Rule 4 needs store->load order, which neither
    architecture gives for free: ``shm.fence`` is a real ``mfence`` /
    ``dmb ish`` on every architecture.

    Wakeups: the waiter spins ``MAX_SPIN_CHECKS`` checks, then yields its
    core between checks for ``MAX_YIELD_S`` (``_spin``), then parks on its
    FIFO (``data`` for the reader, ``space`` for the writer) through the
    asyncio loop; the peer pokes only when the flag says it is parked, so a
    busy stream makes no system calls and an idle end uses no CPU. Each end
    also watches the other's pidfd (readable when that process exits): a
    dead writer makes ``recv`` raise ``ChannelBroken`` once the records it
    published are drained; a dead reader makes a blocked ``send`` raise it.

    Threads: one end is used from one thread (its event loop's).
    """

    def __init__(self, spec: RingSpec, role: Literal["writer", "reader"], union: Any):
        self.name = spec.name
        self.role = role
        self._codec = Codec(union, spec.name)  # the error path and its messages
        self._encode = msgspec.msgpack.Encoder().encode  # hot paths call these directly
        self._decode = msgspec.msgpack.Decoder(union).decode
        self._seg = shm.attach_segment(spec.segment)
        self._buf = self._seg.buf
        self._mmap = self._seg._mmap  # noqa: SLF001 - slicing the mmap copies small records fastest
        self._words = self._buf.cast("Q")
        self._capacity = self._check_header(spec)
        self._data_end = DATA + self._capacity
        self._head = self._words[W_HEAD]  # reader: its position; writer: the last head it loaded
        self._tail = self._words[W_TAIL]  # writer: its private position; reader: the last tail it loaded
        self._published = self._tail  # writer: the tail the reader can see
        self._is_publish_scheduled = False
        self._can_write = role == "writer"  # and not closed: one test on the hot path
        self._is_closed = False
        self._ready: collections.deque = collections.deque()  # decoded, not yet received
        self._error: DecodeError | None = None  # raised after the records before it
        self._num_messages = self._num_bytes = self._peak_fill = self._num_blocked = 0
        self._blocked_s = 0.0
        own, peer = (spec.data_fifo, spec.space_fifo) if role == "reader" else (spec.space_fifo, spec.data_fifo)
        self._parker = Parker(shm.open_fifo(own))
        self._peer_fd = shm.open_fifo(peer)
        self._attach()

    def _check_header(self, spec: RingSpec) -> int:
        if self._words[W_MAGIC] != MAGIC or self._words[W_CAPACITY] != spec.capacity_bytes:
            raise ValueError(
                f"ring {spec.name!r}: segment {spec.segment!r} is not a ring of "
                f"{spec.capacity_bytes} bytes; open it with the RingSpec create_ring returned"
            )
        return spec.capacity_bytes

    def _attach(self) -> None:
        """Claim our end (pid word) and poke the peer, which may be parked
        without a pid to watch yet."""
        mine, theirs = (W_WRITER_PID, W_READER_PID) if self.role == "writer" else (W_READER_PID, W_WRITER_PID)
        pid = self._words[mine]
        if pid not in (0, os.getpid()) and shm.open_pidfd(pid) is not None:
            raise RuntimeError(f"ring {self.name!r}: the {self.role} end is already open in process {pid}")
        self._words[mine] = os.getpid()
        shm.fence()
        self._parker.watch_peer(self._words[theirs])
        shm.poke(self._peer_fd)

    # -- writer ------------------------------------------------------------

    def send_nowait(self, msg: Any) -> None:
        """``_try_write`` inlined: the actors' send path, where one Python
        call is a fifth of the cost. Anything unusual (full-looking ring,
        closed ends, a split record) goes the general way."""
        data = self._encode(msg)
        n = len(data)
        need = RECORD_HEADER + ((n + 7) & ~7)
        tail = self._tail
        start = DATA + tail % self._capacity
        end = start + RECORD_HEADER + n
        if (tail + need - self._head > self._capacity or end > self._data_end
                or not self._can_write or self._words[W_READER_CLOSED]):
            if not self._try_write(data):
                self._raise_full(data)
            return
        self._words[start >> 3] = n
        self._mmap[start + RECORD_HEADER : end] = data
        self._tail = tail = tail + need
        self._num_messages += 1
        self._num_bytes += n
        if tail - self._published >= MAX_UNPUBLISHED_BYTES:
            self.flush()
        elif not self._is_publish_scheduled:
            self._schedule_flush()

    async def send(self, msg: Any) -> None:
        data = self._encode(msg)
        if not self._try_write(data):  # no nested coroutine on the fast path
            await self.send_encoded(data)

    def send_encoded_nowait(self, data: bytes) -> None:
        """Send an already encoded message now or raise ChannelFull."""
        if not self._try_write(data):
            self._raise_full(data)

    async def send_encoded(self, data: bytes) -> None:
        """Send an already encoded message, waiting while the ring is full."""
        if not self._try_write(data):
            await self.wait_for_room(_footprint(len(data)))
            self._try_write(data)

    def _raise_full(self, data: bytes) -> None:
        raise ChannelFull(
            f"channel {self.name!r}: full ({self._tail - self._head}/{self._capacity} bytes "
            f"used, {_footprint(len(data))} needed); await send() to wait for the reader"
        )

    def _check_send(self, data: bytes) -> int:
        if self.role != "writer":
            raise ChannelClosed(f"channel {self.name!r}: send on the reader end")
        if self._is_closed:
            raise ChannelClosed(f"channel {self.name!r}: send after close")
        need = _footprint(len(data))
        if need > self._capacity:
            raise MessageTooLarge(
                f"channel {self.name!r}: a {len(data)}-byte message exceeds the {self._capacity}-byte "
                f"ring (at most {self._capacity - RECORD_HEADER}); send large tensors through the arena"
            )
        return need

    def has_room(self, need: int) -> bool:
        """True when ``need`` bytes fit now. Raises when the reader closed.
        When they do not, publishes what is pending: only the reader can make
        room, and only from records it can see."""
        if self._words[W_READER_CLOSED]:
            raise ChannelClosed(f"channel {self.name!r}: the reader has closed")
        if self._capacity - (self._tail - self._head) >= need:
            return True
        self.flush()
        self._head = self._words[W_HEAD]
        return self._capacity - (self._tail - self._head) >= need

    async def wait_for_room(self, need: int) -> None:
        """Spin, then park on the space FIFO until ``need`` bytes fit."""
        start = time.perf_counter()
        self._num_blocked += 1
        publish_pending()
        try:
            while not self._spin(lambda: self.has_room(need)):
                self._parker.arm()
                self._parker.watch_peer(self._words[W_READER_PID])
                if self._park_and_recheck(W_WRITER_PARKED, lambda: self.has_room(need)):
                    return
                if self._parker.is_peer_dead:
                    raise ChannelBroken(f"channel {self.name!r}: the reader process died; nothing will drain the ring")
                await self._parker.wait()
                self._words[W_WRITER_PARKED] = 0
        finally:
            self._blocked_s += time.perf_counter() - start

    def _try_write(self, data: bytes) -> bool:
        """Write one record if it fits (False if not) and advance the private
        tail; publication is ``flush``'s (see the class docstring). The hot
        path: one method, few attribute loads, because every Python call
        costs ~0.1 us here."""
        n = len(data)
        need = RECORD_HEADER + ((n + 7) & ~7)
        tail = self._tail
        if tail + need - self._head > self._capacity or not self._can_write or self._words[W_READER_CLOSED]:
            self._check_send(data)  # raises for the cases that are errors
            if not self.has_room(need):
                return False
        start = DATA + tail % self._capacity
        self._words[start >> 3] = n
        start += RECORD_HEADER
        end = start + n
        if end <= self._data_end:
            self._mmap[start:end] = data
        else:
            self._write_split(start, data)
        self._tail = tail = tail + need
        self._num_messages += 1
        self._num_bytes += n
        if tail - self._published >= MAX_UNPUBLISHED_BYTES:
            self.flush()
        elif not self._is_publish_scheduled:
            self._schedule_flush()
        return True

    def _write_split(self, start: int, data: bytes) -> None:
        """A payload that reaches the end of the data area continues at its
        start (``start`` may be the end itself: a header in the last word)."""
        end = self._data_end
        first = end - start
        with memoryview(data) as view:
            if first:
                self._buf[start:end] = view[:first]
            self._buf[DATA : DATA + len(data) - first] = view[first:]

    def _schedule_flush(self) -> None:
        """Publish at the end of this loop iteration; at once without a loop,
        or when the reader is parked: it is idle, so it gains nothing from a
        batch, and the waking fence and poke are due anyway. (The flag is
        loaded without a fence: a reader that parks just after we look is
        woken by the scheduled ``flush``, which follows rule 4.)"""
        loop = asyncio._get_running_loop()  # noqa: SLF001 - None, not an exception, when there is none
        if loop is None or self._words[W_READER_PARKED]:
            self.flush()
            return
        self._is_publish_scheduled = True
        loop.call_soon(self._on_loop_turn)
        _unpublished_rings().add(self)  # while scheduled: records may follow a bounded flush

    def _on_loop_turn(self) -> None:
        self._is_publish_scheduled = False
        _unpublished_rings().discard(self)
        if not self._is_closed:
            self.flush()

    def flush(self) -> None:
        """Publish every record written so far and wake a parked reader
        (rules 1 and 4). Cheap when there is nothing to publish; a no-op on
        the reader end and after close."""
        tail = self._tail
        if tail == self._published or not self._can_write:
            return
        words = self._words
        if shm.NEEDS_PUBLISH_FENCE:
            shm.fence()
        words[W_TAIL] = tail  # rule 1: after every record up to it
        self._published = tail
        self._head = head = words[W_HEAD]
        if tail - head > self._peak_fill:  # the fill only falls until the next publication
            self._peak_fill = tail - head
        shm.fence()  # rule 4, publisher side
        if words[W_READER_PARKED]:
            words[W_READER_PARKED] = 0
            shm.poke(self._peer_fd)

    # -- reader ------------------------------------------------------------

    async def recv(self) -> Any:
        if self._ready:
            return self._ready.popleft()
        while not self._take_all():
            self._check_end()
            await self.wait_for_record()
        return self._ready.popleft()

    async def recv_batch(self, max_n: int = MAX_BATCH) -> list[Any]:
        """Every decoded message, up to ``max_n``, at least one (see
        ``Channel.recv_batch``). The decoded queue already stops before a bad
        record (``_take_all``), whose error the next call raises."""
        ready = self._ready
        if not ready:
            while not self._take_all():
                self._check_end()
                await self.wait_for_record()
        if len(ready) <= max_n:
            batch = list(ready)
            ready.clear()
            return batch
        return [ready.popleft() for _ in range(max_n)]

    def recv_nowait(self) -> Any | None:
        """The next message if one is waiting, else None (raises at end)."""
        if self._ready or self._take_all():
            return self._ready.popleft()
        self._check_end()
        return None

    def has_record(self) -> bool:
        return bool(self._ready) or self._load_tail() != self._head

    def _load_tail(self) -> int:
        self._tail = self._words[W_TAIL]
        return self._tail

    def _check_end(self) -> None:
        """Raise when no record will ever come. The re-check after each flag
        is rule 3: the final tail is visible once the flag is."""
        if self._is_closed:
            raise ChannelClosed(f"channel {self.name!r}: recv after close")
        if self.role != "reader":
            raise ChannelClosed(f"channel {self.name!r}: recv on the writer end")
        if self._words[W_WRITER_CLOSED] and not self.has_record():
            raise ChannelClosed(f"channel {self.name!r}: closed by the writer")
        if self._parker.is_peer_dead and not self.has_record():
            raise ChannelBroken(f"channel {self.name!r}: the writer process died without closing")

    async def wait_for_record(self) -> None:
        """Spin, then park on the data FIFO until a record, a close or the
        writer's death; returns without a guarantee of a record."""
        publish_pending()  # our own replies must not wait for our spin
        if self._spin(self.has_record):
            return
        self._parker.arm()
        self._parker.watch_peer(self._words[W_WRITER_PID])
        if self._park_and_recheck(W_READER_PARKED, self._is_ready):
            return
        await self._parker.wait()
        self._words[W_READER_PARKED] = 0

    def _is_ready(self) -> bool:
        return self.has_record() or bool(self._words[W_WRITER_CLOSED]) or self._parker.is_peer_dead

    def _take_all(self) -> bool:
        """Decode every record published so far (up to ``MAX_BATCH``) into
        the ready queue, then publish ``head`` and check for a parked writer
        once for the whole batch, so the shared counters are paid per batch,
        not per small message. A bad record ends the batch; its
        error is raised after the good records before it are received."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        words, cap = self._words, self._capacity
        tail, head = words[W_TAIL], self._head
        if tail == head:
            return False
        if tail - head > self._peak_fill:
            self._peak_fill = tail - head
        decode, ready, mm = self._decode, self._ready, self._mmap
        end, max_len = self._data_end, cap - RECORD_HEADER
        num_messages = num_bytes = 0
        while head != tail and num_messages < MAX_BATCH:
            start = DATA + head % cap
            n = words[start >> 3]
            start += RECORD_HEADER  # may be ``end``: the payload then starts the data area
            try:
                if start + n > end or n > SMALL_RECORD_BYTES:
                    record = self._record(start, n, max_len)  # split, large or corrupt
                else:
                    record = mm[start : start + n]  # a copy: cheaper than a view at this size
                ready.append(decode(record))  # rule 2: before head moves
            except _DECODE_ERRORS:
                self._error = self._decode_error(record)
                head += RECORD_HEADER + ((n + 7) & ~7)
                break
            except DecodeError as err:  # a corrupt length
                self._error = err
                head += RECORD_HEADER + ((n + 7) & ~7)
                break
            head += RECORD_HEADER + ((n + 7) & ~7)
            num_messages += 1
            num_bytes += n
        self._num_messages += num_messages
        self._num_bytes += num_bytes
        self._publish_head(head)
        if not ready:  # the only record was bad
            error, self._error = self._error, None
            raise error
        return True

    def _publish_head(self, head: int) -> None:
        """Rule 2 then rule 4, publisher side: the batch is decoded, so its
        bytes are the writer's again; wake the writer if it waits for them."""
        self._head = self._tail = head
        words = self._words
        if shm.NEEDS_PUBLISH_FENCE:
            shm.fence()
        words[W_HEAD] = head
        shm.fence()
        if words[W_WRITER_PARKED]:
            words[W_WRITER_PARKED] = 0
            shm.poke(self._peer_fd)

    def _record(self, start: int, n: int, max_len: int) -> memoryview | bytes:
        """The payload at byte ``start`` of the segment: a view when
        contiguous, joined when split at the end of the data area."""
        if n > max_len:
            raise DecodeError(f"channel {self.name!r}: corrupt record length {n} at {self._head}")
        end = self._data_end
        if start + n <= end:
            return self._buf[start : start + n]
        return bytes(self._buf[start:end]) + bytes(self._buf[DATA : DATA + n - (end - start)])

    def _decode_error(self, record: Any) -> DecodeError:
        """The codec's error for a record the fast decoder refused (its
        message names the channel and the reason)."""
        try:
            self._codec.decode(record)
        except DecodeError as err:
            return err
        return DecodeError(f"channel {self.name!r}: undecodable message")

    # -- both ends ---------------------------------------------------------

    def _spin(self, is_ready) -> bool:
        """Busy checks, then checks between ``sched_yield`` calls, then give
        up (the caller parks). The yielding phase matters when the peer runs
        on our core (the kernel tends to wake it there): a pure spin then
        keeps the very process we wait for off the CPU, and both ends settle
        into parking on every message (round trip 100+ us under load)."""
        for _ in range(MAX_SPIN_CHECKS):
            if is_ready():
                return True
        deadline = time.perf_counter() + MAX_YIELD_S
        while time.perf_counter() < deadline:
            os.sched_yield()
            if is_ready():
                return True
        return False

    def _park_and_recheck(self, flag: int, is_ready) -> bool:
        """Rule 4, waiter side: flag, fence, re-check. True when no need to
        park after all (the flag is withdrawn)."""
        self._words[flag] = 1
        shm.fence()
        if is_ready():
            self._words[flag] = 0
            return True
        return False

    def close(self) -> None:
        """Close this end; the writer's close publishes what is pending and
        lets the reader drain, then end."""
        if self._is_closed:
            return
        if self.role == "writer":
            self.flush()  # rule 3: the last tail before writer_closed
        self._is_closed = True
        self._can_write = False
        shm.publish_fence()
        self._words[W_WRITER_CLOSED if self.role == "writer" else W_READER_CLOSED] = 1
        shm.fence()
        shm.poke(self._peer_fd)
        self._parker.close()
        os.close(self._peer_fd)
        _unpublished_rings().discard(self)
        self._words.release()
        self._seg.close()

    def stats(self) -> ChannelStats:
        return ChannelStats(
            name=self.name,
            messages=self._num_messages,
            bytes=self._num_bytes,
            capacity_bytes=self._capacity,
            peak_fill_bytes=self._peak_fill,
            num_blocked=self._num_blocked,
            blocked_s=self._blocked_s,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
