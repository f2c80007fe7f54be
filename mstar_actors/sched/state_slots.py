"""A fixed pool of recurrent-state slots, one per running sequence."""

from __future__ import annotations


class StateSlotAllocator:
    """``num_slots`` slots, numbered ``0 .. num_slots - 1``, of the ranks' recurrent-state pool.

    A model with recurrent layers (Gated DeltaNet's convolution state and
    recurrent matrix) keeps one fixed-size state per sequence, wherever its
    tokens are; a slot names where it lives on every rank. Each slot is either
    used (held by exactly one running sequence) or free. Unlike KV blocks a
    slot is never shared and holds nothing reusable once freed: the next
    holder's state is rebuilt from its first token.

    ``allocate`` hands out the lowest free slot, so a small load keeps to the
    first slots and a run is reproducible.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._is_used = [False] * num_slots
        self._num_used = 0

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_free(self) -> int:
        return self.num_slots - self._num_used

    def can_allocate(self) -> bool:
        return self._num_used < self.num_slots

    def allocate(self) -> int:
        """The lowest free slot, now used."""
        if not self.can_allocate():
            raise RuntimeError(
                f"allocate() with all {self.num_slots} recurrent-state slots in use; check can_allocate first"
            )
        slot = self._is_used.index(False)
        self._is_used[slot] = True
        self._num_used += 1
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise RuntimeError(f"free() of recurrent-state slot {slot}; slots are 0 .. {self.num_slots - 1}")
        if not self._is_used[slot]:
            raise RuntimeError(f"free() of recurrent-state slot {slot}, which is not in use (double free)")
        self._is_used[slot] = False
        self._num_used -= 1

    def is_used(self, slot: int) -> bool:
        return self._is_used[slot]
