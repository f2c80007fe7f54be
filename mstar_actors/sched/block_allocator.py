"""A fixed pool of ref-counted KV blocks with reusable cached blocks."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from mstar_actors.sched.prefix_index import PrefixIndex


class BlockAllocator:
    """``num_blocks`` KV blocks of ``block_size`` tokens each.

    Every block is in exactly one of three states:

    - used: ``ref_count > 0``; held by that many sequences' block tables (more
      than one when a prefix-cached block is shared);
    - free: ``ref_count == 0`` and no hash; in ``_free``;
    - cached-free: ``ref_count == 0`` but it still holds the KV of an indexed
      full block; in ``_cached_free``, least recently freed first. A prefix hit
      revives it (``share``); it is evicted, and its index entry dropped, only
      when ``_free`` is empty and a new block is needed.

    So ``num_free`` (free + cached-free) is what ``allocate`` can hand out.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_index: PrefixIndex | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_index = prefix_index if prefix_index is not None else PrefixIndex()
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def cached_free_ids(self) -> list[int]:
        """Cached-free blocks, next to be evicted first."""
        return list(self._cached_free)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free

    def allocate(self, num: int) -> list[int]:
        """``num`` blocks with ref count 1: free ones first, then evicted cached ones (LRU)."""
        if not self.can_allocate(num):
            raise RuntimeError(f"allocate({num}) with only {self.num_free} free KV blocks; check can_allocate first")
        block_ids = [self._take_one() for _ in range(num)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (prefix hits), reviving cached-free ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is None:
                    raise RuntimeError(f"share() of KV block {block_id}, which is free and holds no cached prefix")
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """One holder fewer for each block.

        A block table is released last block first, so a sequence's tail blocks
        (useless without the blocks before them) are evicted before its head.
        """
        for block_id in reversed(list(block_ids)):
            if self._ref_counts[block_id] < 1:
                raise RuntimeError(f"free() of KV block {block_id}, which is not in use (double free)")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._release(block_id)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Index a used block whose full KV has just been computed.

        False when the block already has a hash or another block holds the same
        prefix (then this one stays unindexed and is freed plainly).
        """
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"cache() of KV block {block_id}, which is not in use")
        if self._hashes[block_id] is not None or not self.prefix_index.insert(block_hash, block_id):
            return False
        self._hashes[block_id] = block_hash
        return True

    def _release(self, block_id: int) -> None:
        if self._hashes[block_id] is None:
            self._free.append(block_id)
        else:
            self._cached_free[block_id] = None

    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._cached_free.popitem(last=False)
        self.prefix_index.remove(self._hashes[block_id])
        self._hashes[block_id] = None
        return block_id
