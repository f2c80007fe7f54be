"""Which adapter sits in which device slot: the conductor's decision table.

Pure: no torch, no I/O, no clock. The conductor owns one table; every rank
holds the same slots because the table's decisions travel as
``InstallAdapter(slot, name, digest)`` messages, and rows use a slot only once
every rank has acknowledged it, or where every rank installs it before its
next plan (a swap: the pool's ``rows_follow``).

Slots: ``0`` is the zero adapter (base rows), never handed out; slots
``1..max_loras`` hold adapters, so the device stacks need ``num_slots =
max_loras + 1`` entries.

A slot's life::

    free --acquire--> installing --every rank acks ok, same digest--> ready
                          \\--any rank acks a failure-------------> failed

Invariants:

- A slot whose acks are not all in is never handed to another adapter: a
  rank may still be writing it, and a late ack must not count for the next
  install (acks carry no generation; this rule makes them unambiguous).
- A pinned slot is never evicted: a pin is a running request on it.
  Every successful ``acquire`` pins once; pair each with one ``unpin``.
- Idle slots (unpinned, every ack in) keep their adapter, so a later
  request reuses it without an install; when a slot is needed, the idle
  one released longest ago is evicted (LRU).
- A slot is found by its adapter's name and digest: a name reloaded with a
  new digest never reuses the old slot, whose requests finish on the old
  weights (and choices parked on that version find it again); unpinned, it
  is evicted as any idle slot.
- A failed install refuses the adapter everywhere: the slot stays failed
  (``acquire`` of that name and digest returns it, so the caller fails the
  request at once) until unpinned with every ack in, then it is freed and
  the next ``acquire`` retries.
- ``exclude`` only narrows which slot a new install may take; the table
  keeps no reservations itself (the pool decides which slots drain, see
  ``pick_drain``), so a reservation can never outlive its reason here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ZERO_SLOT = 0


class SlotState(enum.Enum):
    FREE = "free"
    INSTALLING = "installing"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class SlotInstall:
    """A decision to send to every rank: install ``name`` (``digest``) in ``slot``."""

    slot: int
    name: str
    digest: str


@dataclass(frozen=True)
class SlotSettled:
    """An install every rank has answered: ``ok``, or failed with ``errors`` by rank."""

    slot: int
    name: str
    digest: str
    ok: bool
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class _Slot:
    index: int
    state: SlotState = SlotState.FREE
    name: str = ""
    digest: str = ""
    num_pins: int = 0
    acks: dict[int, str | None] = field(default_factory=dict)  # rank -> None (ok) or error
    last_used: int = 0


class SlotTable:
    def __init__(self, max_loras: int, num_ranks: int = 1):
        if max_loras < 1 or num_ranks < 1:
            raise ValueError(f"SlotTable needs max_loras >= 1 and num_ranks >= 1, got {max_loras}, {num_ranks}")
        self.max_loras = max_loras
        self.num_ranks = num_ranks
        self._slots = [_Slot(i) for i in range(max_loras + 1)]
        self._by_key: dict[tuple[str, str], int] = {}  # (name, digest) -> the slot holding or installing it
        self._installs: list[SlotInstall] = []
        self._tick = 0

    @property
    def num_slots(self) -> int:
        """Device slots including the zero slot: the stacks' first dimension."""
        return self.max_loras + 1

    # ------------------------------------------------------------ queries

    def lookup(self, name: str, digest: str) -> int | None:
        """The slot holding ``name`` with weights ``digest`` (any state), or None."""
        return self._by_key.get((name, digest))

    def state(self, slot: int) -> SlotState:
        return self._slot(slot).state

    def is_ready(self, slot: int) -> bool:
        return slot == ZERO_SLOT or self._slot(slot).state is SlotState.READY

    def error(self, slot: int) -> str:
        """A failed slot's reason, one line per failing rank."""
        errors = self._slot(slot).acks
        return "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()) if e is not None)

    def num_pins(self, slot: int) -> int:
        return self._slot(slot).num_pins

    def num_free(self, exclude: frozenset[int] = frozenset()) -> int:
        """Slots an acquire of a new adapter could take now (free or evictable),
        leaving out ``exclude``."""
        return sum(1 for s in self._adapter_slots() if s.index not in exclude and self._is_takeable(s))

    def pick_drain(self, exclude: frozenset[int] = frozenset(), key=None) -> int | None:
        """The slot to hand over next: a ready one (an install in flight is
        never wasted) outside ``exclude``, the least by ``key(slot index)``
        (default: fewest pins, then the least recently used). None when no
        ready slot is left."""
        ready = [s for s in self._adapter_slots()
                 if s.index not in exclude and s.state is SlotState.READY]
        if not ready:
            return None
        if key is None:
            return min(ready, key=lambda s: (s.num_pins, s.last_used)).index
        return min(ready, key=lambda s: (key(s.index), s.last_used)).index

    def name_of(self, slot: int) -> str:
        """The adapter a slot holds or installs ("" when free)."""
        return self._slot(slot).name

    # ------------------------------------------------------------ decisions

    def acquire(self, name: str, digest: str, exclude: frozenset[int] = frozenset()) -> int | None:
        """Pin a slot for one request on adapter ``name`` with weights ``digest``.

        Returns the slot (pinned once), or None when every slot is pinned or
        mid-install: the pool is full and the request waits (backpressure).
        A slot holding ``name`` with ``digest`` is shared whatever ``exclude``
        says; a new install never takes a slot in ``exclude``.
        A newly picked slot is in ``installing`` and its install is queued
        for ``take_installs``; the caller checks ``is_ready`` before running
        rows on it, or sends the install so every rank makes it before its
        next plan (the pool's ``rows_follow``).
        """
        found = self._by_key.get((name, digest))
        if found is not None:
            self._pin(self._slots[found])
            return found
        victim = self._pick_victim(exclude)
        if victim is None:
            return None
        self._start_install(victim, name, digest)
        self._pin(victim)
        return victim.index

    def pin(self, slot: int) -> None:
        self._pin(self._slot_for_pin(slot))

    def unpin(self, slot: int) -> None:
        if slot == ZERO_SLOT:
            return
        s = self._slot(slot)
        if s.num_pins == 0:
            raise ValueError(f"unpin of slot {slot} ({s.name!r}) which has no pins: each acquire/pin pairs with one unpin")
        s.num_pins -= 1
        self._tick += 1
        s.last_used = self._tick
        self._free_if_done(s)

    def take_installs(self) -> list[SlotInstall]:
        """The installs decided since the last call, to send to every rank."""
        installs, self._installs = self._installs, []
        return installs

    def ack(self, rank: int, slot: int, digest: str, ok: bool, error: str = "") -> SlotSettled | None:
        """Record one rank's answer to an install. Returns the outcome once
        every rank has answered this install, else None. An ack for a digest
        the slot no longer holds is stale and ignored."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"ack from rank {rank}; this table has ranks 0..{self.num_ranks - 1}")
        s = self._slot(slot)
        if s.digest != digest or s.state is SlotState.FREE:
            return None
        if rank in s.acks:
            raise ValueError(f"rank {rank} acked slot {slot} ({s.name!r}, {digest}) twice")
        s.acks[rank] = None if ok else (error or "install failed")
        if not ok:
            s.state = SlotState.FAILED  # any failure refuses the adapter on every rank
        if len(s.acks) < self.num_ranks:
            return None
        if s.state is SlotState.INSTALLING:
            s.state = SlotState.READY
        settled = SlotSettled(slot, s.name, digest, s.state is SlotState.READY, self._errors(s))
        self._free_if_done(s)
        return settled

    # ------------------------------------------------------------ internals

    def _slot(self, slot: int) -> _Slot:
        if not 0 < slot <= self.max_loras:
            raise ValueError(f"slot {slot} is not an adapter slot; accepted: 1..{self.max_loras}")
        return self._slots[slot]

    def _slot_for_pin(self, slot: int) -> _Slot:
        s = self._slot(slot)
        if s.state is SlotState.FREE:
            raise ValueError(f"pin of free slot {slot}: acquire it first")
        return s

    def _adapter_slots(self) -> list[_Slot]:
        return self._slots[1:]

    def _pin(self, s: _Slot) -> None:
        s.num_pins += 1
        self._tick += 1
        s.last_used = self._tick

    def _is_takeable(self, s: _Slot) -> bool:
        all_acked = len(s.acks) == self.num_ranks
        return s.state is SlotState.FREE or (s.num_pins == 0 and all_acked)

    def _pick_victim(self, exclude: frozenset[int]) -> _Slot | None:
        takeable = [s for s in self._adapter_slots() if s.index not in exclude and self._is_takeable(s)]
        if not takeable:
            return None
        # Free slots first (last_used 0 after a free), then the least recently used.
        return min(takeable, key=lambda s: (s.state is not SlotState.FREE, s.last_used))

    def _start_install(self, s: _Slot, name: str, digest: str) -> None:
        self._forget(s)
        s.state, s.name, s.digest, s.acks = SlotState.INSTALLING, name, digest, {}
        self._by_key[name, digest] = s.index
        self._installs.append(SlotInstall(s.index, name, digest))

    def _free_if_done(self, s: _Slot) -> None:
        """A failed slot with no pins and every ack in goes back to free (the next acquire retries)."""
        if s.num_pins or len(s.acks) < self.num_ranks or s.state is not SlotState.FAILED:
            return
        self._forget(s)
        self._slots[s.index] = _Slot(s.index)

    def _forget(self, s: _Slot) -> None:
        if self._by_key.get((s.name, s.digest)) == s.index:
            del self._by_key[s.name, s.digest]

    @staticmethod
    def _errors(s: _Slot) -> dict[int, str]:
        return {rank: err for rank, err in s.acks.items() if err is not None}
