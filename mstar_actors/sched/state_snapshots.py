"""A bounded pool of recurrent-state snapshots, keyed by the prefix they end.

A hybrid model's prefix hit must restore the recurrent state after the
prefix as well as its KV blocks. The ranks keep ``num_snapshots`` copies of
a sequence's state (``StatePool``-shaped), each taken at the end of a chunk
that stops at a block boundary, and this index says which prefix each
holds: the chain hash of its last block, so a snapshot is found under the
same adapter-digest roots as the KV blocks it goes with.

Every snapshot slot is in exactly one state: free, reserved (a plan in
flight writes it; its hash enters the index once the step is done), or
indexed (least recently used first). ``reserve`` takes a free slot, else
evicts the least recently used indexed one.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class SnapshotIndex:
    def __init__(self, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"snapshot pool: num_snapshots must be >= 1, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self._free: deque[int] = deque(range(num_snapshots))
        self._indexed: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._reserved: set[int] = set()

    @property
    def num_indexed(self) -> int:
        return len(self._indexed)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._indexed

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding the state after the prefix ending in ``block_hash``
        (marked recently used), or None."""
        slot = self._indexed.get(block_hash)
        if slot is not None:
            self._indexed.move_to_end(block_hash)
        return slot

    def can_reserve(self) -> bool:
        return bool(self._free or self._indexed)

    def reserve(self) -> int:
        """A slot for a new snapshot: a free one, else the least recently used
        indexed one (its prefix forgotten)."""
        if self._free:
            slot = self._free.popleft()
        elif self._indexed:
            _, slot = self._indexed.popitem(last=False)
        else:
            raise RuntimeError(f"all {self.num_snapshots} snapshot slots are reserved by the plan in flight")
        self._reserved.add(slot)
        return slot

    def commit(self, slot: int, block_hash: bytes) -> None:
        """The reserved ``slot`` now holds the state after ``block_hash``'s prefix."""
        self._check_reserved(slot)
        self._reserved.discard(slot)
        old = self._indexed.pop(block_hash, None)
        if old is not None:
            self._free.append(old)  # the newer copy of the same prefix replaces it
        self._indexed[block_hash] = slot

    def release(self, slot: int) -> None:
        """A reserved slot whose snapshot was not taken (its step failed or its row ended)."""
        self._check_reserved(slot)
        self._reserved.discard(slot)
        self._free.append(slot)

    def _check_reserved(self, slot: int) -> None:
        if slot not in self._reserved:
            raise RuntimeError(f"snapshot slot {slot} is not reserved")
