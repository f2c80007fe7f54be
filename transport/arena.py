"""Shared-memory arena for large tensors, passed by reference (``TensorRef``).

One producer process puts tensors; consumers map them without a copy and
release them. The launcher creates the arena (``create_arena``) and hands the
``ArenaSpec`` to the producer and to each consumer.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from mstar_actors.messages import TensorRef
from transport import shm
from transport.errors import ChannelError

MAGIC = 0x3141_4E45_5241_4D  # "MARENA1", little-endian
ALIGN = 64  # block (and so tensor data) alignment: one cache line
BLOCK_HEADER = 64
MAX_READERS = BLOCK_HEADER - 16  # one released flag byte per reader
W_MAGIC, W_CAPACITY = 0, 1
W_PRODUCER_PARKED = 8  # its own cache line
DATA = 128  # byte offset of the data area


class ArenaFull(ChannelError):
    """``put`` found no room in time: consumers hold too many tensors."""


class TensorTooLarge(ChannelError, ValueError):
    """``put`` of a tensor larger than the whole arena: no wait can make room."""


class ArenaSpec(msgspec.Struct, frozen=True):
    name: str
    segment: str
    capacity_bytes: int
    space_fifo: str  # consumers -> producer: "a block was released"


def create_arena(run_dir: str | os.PathLike, run_id: str, name: str, capacity_bytes: int) -> ArenaSpec:
    """Create the segment and FIFO of one arena (in the launcher)."""
    capacity = capacity_bytes - capacity_bytes % ALIGN
    if capacity < 2 * ALIGN:
        raise ValueError(f"arena {name!r}: capacity {capacity_bytes} bytes; use at least {2 * ALIGN}")
    shm.register_run(run_dir, run_id)
    seg = shm.create_segment(shm.segment_name(run_id, f"arena-{name}"), DATA + capacity)
    with seg.buf.cast("Q") as words:
        words[W_CAPACITY] = capacity
        words[W_MAGIC] = MAGIC
    seg.close()
    spec = ArenaSpec(name, seg.name, capacity, str(shm.fifo_dir(run_dir) / f"arena-{name}.space"))
    shm.make_fifo(Path(spec.space_fifo))
    return spec


def unlink_arena(spec: ArenaSpec) -> None:
    shm.unlink_segment(spec.segment)
    Path(spec.space_fifo).unlink(missing_ok=True)


def _block_size(nbytes: int) -> int:
    return BLOCK_HEADER + (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _said(nbytes: Sequence[int]) -> str:
    return f"a {nbytes[0]}-byte tensor" if len(nbytes) == 1 else f"{len(nbytes)} tensors of {sum(nbytes)} bytes in all"


def _placement(head: int, tail: int, fill: int, capacity: int, size: int) -> tuple[int, int] | None:
    """Where the producer's next block of ``size`` starts, and the bytes skipped before it at the
    data area's end (a block never wraps), given its positions; None: no room now."""
    if tail >= head and fill < capacity:
        if tail + size <= capacity:
            return tail, 0
        if size > head:  # would not fit after wrapping either
            return None
        return 0, capacity - tail
    return (tail, 0) if tail + size <= head else None


class TensorArena:
    """One end of an arena: the producer (``put``) or a consumer (``view``,
    ``release``).

    Layout::

        byte 0    | magic | capacity |                    (line 0)
        byte 64   | producer_parked                        (line 1)
        byte 128  +-- data: capacity bytes of blocks, in allocation order --+
                  | [header 64][tensor bytes, padded to 64] [header][...]   |
                  +---------------------------------------------------------+
        block header: size u64 (whole block) | num_readers u64 |
                      released u8 x 48 (one per reader index)

    Allocation is FIFO, like a ring: the producer allocates at its tail and
    reclaims from its head while the oldest block's readers have all set
    their released flag. A block never wraps (a tensor must be contiguous):
    when it doesn't fit before the end, the rest of the area becomes a skip
    block (born released) and the block starts at 0; when nothing is
    outstanding both positions go back to 0, so any tensor up to
    ``capacity - 64`` bytes fits an empty arena. Head, tail and fill are the
    producer's private state: only the flags are shared. A tensor released
    out of order is freed when the older ones are (FIFO).

    Ordering-critical stores: the producer writes the header and the tensor
    bytes before it sends the ``TensorRef`` (the ring publishes it after
    them); a consumer stops reading the tensor before it sets its flag
    (``publish_fence`` first, a no-op on x86-64, see ``ShmRing``). A full
    arena parks the producer Dekker style, as the ring does: the producer
    sets ``producer_parked``, fences, re-checks the flags; a consumer sets its
    flag, fences, and if the producer is parked clears it and pokes the FIFO.
    """

    def __init__(self, spec: ArenaSpec, role: Literal["producer", "consumer"], reader_index: int = 0):
        if role not in ("producer", "consumer"):
            raise ValueError(f"arena {spec.name!r}: role {role!r}; use 'producer' or 'consumer'")
        if not 0 <= reader_index < MAX_READERS:
            raise ValueError(f"arena {spec.name!r}: reader_index {reader_index}; use 0..{MAX_READERS - 1}")
        self.name, self.role, self.reader_index = spec.name, role, reader_index
        self._seg = shm.attach_segment(spec.segment)
        self._words = self._seg.buf.cast("Q")
        if self._words[W_MAGIC] != MAGIC or self._words[W_CAPACITY] != spec.capacity_bytes:
            raise ValueError(f"arena {spec.name!r}: segment {spec.segment!r} is not an arena of {spec.capacity_bytes} bytes")
        self.capacity_bytes = spec.capacity_bytes
        self._fifo = shm.open_fifo(spec.space_fifo)
        self._head = self._tail = self._fill = 0  # producer state
        self._num_outstanding = 0
        self._space = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- producer ----------------------------------------------------------

    async def put_all(self, tensors: Sequence[torch.Tensor], num_readers: int = 1,
                      max_wait_s: float = 30.0) -> list[TensorRef]:
        """Copy every tensor of ``tensors`` into the arena, all or none: wait (up to ``max_wait_s``) until
        they fit together, in order, where the blocks before them leave room. Put one at a time, a
        request's first tensors could be all that is left outstanding and still leave no room for the
        next one (a block never wraps: the free bytes may lie on both sides of them), so they would
        wait on each other. TensorTooLarge when they cannot fit together even an empty arena."""
        nbytes = [t.numel() * t.element_size() for t in tensors]
        sizes = [_block_size(n) for n in nbytes]
        if sum(sizes) > self.capacity_bytes:
            raise TensorTooLarge(f"arena {self.name!r}: {_said(nbytes)} can never fit the {self.capacity_bytes}-byte "
                                 "arena; raise transport.arena_bytes, or send fewer or smaller tensors")
        start = time.perf_counter()
        while True:
            self.reclaim()
            if self._fits_all(sizes):
                return [self.put_nowait(tensor, num_readers) for tensor in tensors]
            remaining = max_wait_s - (time.perf_counter() - start)
            if remaining <= 0 or not await self._wait_for_space(remaining):
                raise ArenaFull(self._full_message(nbytes, time.perf_counter() - start))

    def _fits_all(self, sizes: Sequence[int]) -> bool:
        """Whether ``_allocate`` would place blocks of ``sizes`` one after another now."""
        head, tail, fill = (self._head, self._tail, self._fill) if self._fill else (0, 0, 0)
        for size in sizes:
            spot = _placement(head, tail, fill, self.capacity_bytes, size)
            if spot is None:
                return False
            offset, skip = spot
            tail, fill = offset + size, fill + skip + size
        return True

    def put_nowait(self, tensor: torch.Tensor, num_readers: int = 1) -> TensorRef:
        """Copy ``tensor`` into the arena now, or raise ArenaFull."""
        ref = self._try_put(tensor, num_readers)
        if ref is None:
            raise ArenaFull(self._full_message([tensor.numel() * tensor.element_size()], 0.0))
        return ref

    async def put(self, tensor: torch.Tensor, num_readers: int = 1, max_wait_s: float = 30.0) -> TensorRef:
        """Copy ``tensor`` into the arena, waiting up to ``max_wait_s`` for
        consumers to release room. ``num_readers`` consumers (distinct
        reader indexes) must each release the ref."""
        return (await self.put_all([tensor], num_readers, max_wait_s))[0]

    def _try_put(self, tensor: torch.Tensor, num_readers: int) -> TensorRef | None:
        if self.role != "producer":
            raise ValueError(f"arena {self.name!r}: put on a consumer end")
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"arena {self.name!r}: num_readers {num_readers}; use 1..{MAX_READERS}")
        nbytes = tensor.numel() * tensor.element_size()
        if _block_size(nbytes) > self.capacity_bytes:
            raise TensorTooLarge(
                f"arena {self.name!r}: a {nbytes}-byte tensor can never fit the {self.capacity_bytes}-byte "
                f"arena; raise transport.arena_bytes or split the tensor"
            )
        self.reclaim()
        offset = self._allocate(_block_size(nbytes))
        if offset is None:
            return None
        self._write_header(offset, _block_size(nbytes), num_readers)
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if nbytes:
            torch.frombuffer(self._seg.buf, dtype=torch.uint8, count=nbytes, offset=DATA + offset + BLOCK_HEADER).copy_(flat)
        self._num_outstanding += 1
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef(self._seg.name, DATA + offset + BLOCK_HEADER, nbytes, dtype, tuple(tensor.shape))

    def _allocate(self, size: int) -> int | None:
        """Offset (in the data area) of a new block of ``size``, or None."""
        if self._fill == 0:
            self._head = self._tail = 0
        spot = _placement(self._head, self._tail, self._fill, self.capacity_bytes, size)
        if spot is None:
            return None
        offset, skip = spot
        if skip:
            self._write_skip(self._tail, skip)
        self._tail = offset
        return self._take(size)

    def _take(self, size: int) -> int:
        offset = self._tail
        self._tail += size
        self._fill += size
        return offset

    def _write_skip(self, offset: int, size: int) -> None:
        self._write_header(offset, size, 1)
        self._seg.buf[DATA + offset + 16] = 1  # born released
        self._fill += size
        self._num_outstanding += 1  # reclaim counts it out like any block

    def _write_header(self, offset: int, size: int, num_readers: int) -> None:
        base = DATA + offset
        self._words[base >> 3] = size
        self._words[(base >> 3) + 1] = num_readers
        self._seg.buf[base + 16 : base + BLOCK_HEADER] = bytes(MAX_READERS)

    def discard(self, ref: TensorRef) -> None:
        """Give back a block ``put`` stored that no consumer was ever handed
        (the request it was for failed before it was sent): released for every
        reader, so ``reclaim`` frees it in its turn."""
        if self.role != "producer":
            raise ValueError(f"arena {self.name!r}: discard on a consumer end")
        self._check_ref(ref)
        base = ref.offset - BLOCK_HEADER
        num_readers = self._words[(base >> 3) + 1]
        self._seg.buf[base + 16 : base + 16 + num_readers] = b"\x01" * num_readers
        self.reclaim()

    def reclaim(self) -> int:
        """Free the oldest blocks whose readers have all released; returns
        the bytes freed."""
        freed = 0
        while self._fill > 0 and self._is_released(self._head):
            size = self._words[(DATA + self._head) >> 3]
            self._head = (self._head + size) % self.capacity_bytes
            self._fill -= size
            freed += size
            self._num_outstanding -= 1
        shm.publish_fence()  # flag loads before we overwrite the block
        return freed

    def _is_released(self, offset: int) -> bool:
        base = DATA + offset
        num_readers = self._words[(base >> 3) + 1]
        return self._seg.buf[base + 16 : base + 16 + num_readers] == b"\x01" * num_readers

    async def _wait_for_space(self, max_wait_s: float) -> bool:
        """Park until a consumer releases something (True) or time is up."""
        self._arm()
        self._words[W_PRODUCER_PARKED] = 1
        shm.fence()
        if self.reclaim():
            self._words[W_PRODUCER_PARKED] = 0
            return True
        try:
            await asyncio.wait_for(self._space.wait(), max_wait_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._words[W_PRODUCER_PARKED] = 0

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fifo)
            self._loop, self._space = loop, asyncio.Event()
            loop.add_reader(self._fifo, self._on_poke)
        self._space.clear()

    def _on_poke(self) -> None:
        shm.drain(self._fifo)
        self._space.set()

    def _full_message(self, nbytes: Sequence[int], waited_s: float) -> str:
        return (
            f"arena {self.name!r} ({self.capacity_bytes} bytes, {self._fill} in use by "
            f"{self._num_outstanding} tensors) has no room for {_said(nbytes)} after "
            f"waiting {waited_s:.1f} s; consumers must release their TensorRefs (or raise transport.arena_bytes)"
        )

    # -- consumer ----------------------------------------------------------

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor behind ``ref``, mapped without a copy. Valid until
        ``release(ref)``; don't keep it (or views of it) after that."""
        self._check_ref(ref)
        dtype = getattr(torch, ref.dtype)
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        flat = torch.frombuffer(self._seg.buf, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
        return flat.view(dtype).view(ref.shape)

    def release(self, ref: TensorRef) -> None:
        """Give ``ref``'s block back (exactly once per consumer)."""
        self._check_ref(ref)
        shm.publish_fence()  # our reads of the tensor before the flag
        self._seg.buf[ref.offset - BLOCK_HEADER + 16 + self.reader_index] = 1
        shm.fence()
        if self._words[W_PRODUCER_PARKED]:
            self._words[W_PRODUCER_PARKED] = 0
            shm.poke(self._fifo)

    def _check_ref(self, ref: TensorRef) -> None:
        if ref.segment != self._seg.name:
            raise ValueError(f"arena {self.name!r}: ref is from segment {ref.segment!r}, not {self._seg.name!r}")
        if not DATA + BLOCK_HEADER <= ref.offset <= DATA + self.capacity_bytes - ref.nbytes:
            raise ValueError(f"arena {self.name!r}: ref offset {ref.offset} (+{ref.nbytes}) is outside the arena")

    # -- both --------------------------------------------------------------

    @property
    def num_bytes_in_use(self) -> int:
        return self._fill

    def close(self) -> None:
        """Unmap (deferred while views are alive) and close the FIFO."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fifo)
        os.close(self._fifo)
        self._words.release()
        self._seg.close()
