"""The adapter-reader's host tier: which host copies it keeps. Pure: no I/O.

An entry is one adapter version (name, digest) in one shared-memory segment.
Holds count the conductor's references: each ``AdapterRead`` it was sent is
one hold, each ``DropAdapter`` releases one. Invariants:

- A held entry is never evicted: a rank may be mapping its segment.
- At most ``max_cpu_loras`` entries are kept; beyond that the unheld one
  used longest ago goes first. Held entries may push the count above the
  cap for a while (at most the installs and waiting adapters in flight);
  the cap is met again as they are released.
- A cached copy answers a read of the same name, path and file signature
  (sizes and modification times), unless the read asks for a refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HostEntry:
    name: str
    path: str
    signature: tuple  # the files' (size, mtime_ns) when read
    digest: str
    segment: str
    nbytes: int
    max_rank: int
    num_holds: int = 0
    last_used: int = 0


@dataclass
class HostTier:
    max_cpu_loras: int
    entries: dict[tuple[str, str], HostEntry] = field(default_factory=dict)  # (name, digest) -> entry
    _tick: int = 0

    def lookup(self, name: str, path: str, signature: tuple) -> HostEntry | None:
        for entry in self.entries.values():
            if (entry.name, entry.path, entry.signature) == (name, path, signature):
                return entry
        return None

    def find(self, name: str, digest: str) -> HostEntry | None:
        return self.entries.get((name, digest))

    def hold(self, entry: HostEntry) -> list[HostEntry]:
        """Add (if new) and hold ``entry``; returns the entries evicted to make room."""
        self.entries.setdefault((entry.name, entry.digest), entry)
        entry = self.entries[entry.name, entry.digest]
        entry.num_holds += 1
        self._touch(entry)
        return self._evict()

    def release(self, name: str, digest: str) -> list[HostEntry]:
        """Release one hold; returns the entries evicted. Unknown or unheld: an error."""
        entry = self.entries.get((name, digest))
        if entry is None or entry.num_holds == 0:
            raise ValueError(f"DropAdapter({name!r}, {digest}) without a hold: "
                             f"each AdapterRead pairs with exactly one DropAdapter")
        entry.num_holds -= 1
        self._touch(entry)
        return self._evict()

    def _touch(self, entry: HostEntry) -> None:
        self._tick += 1
        entry.last_used = self._tick

    def _evict(self) -> list[HostEntry]:
        evicted = []
        idle = sorted((e for e in self.entries.values() if e.num_holds == 0), key=lambda e: e.last_used)
        while len(self.entries) > self.max_cpu_loras and idle:
            entry = idle.pop(0)
            del self.entries[entry.name, entry.digest]
            evicted.append(entry)
        return evicted
