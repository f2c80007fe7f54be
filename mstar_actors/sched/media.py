"""The scheduler's media ledger: the one owner of each request's arena tensors.

A request's media is prepared once and shared by its choices. Its life, as
the plans tell the ranks (see ``StepPlan``):

    held (from arrival, while the adapter pool may still refuse it)
      |
    added --first choice started--> copied (copy_media) --last choice ended--> dropped (drop_media)
      \\--every choice ended, none started-------------------------------------> released (release_media)

Keys of rank copies are never reused, so a SeqStart's ref names one copy on
every rank whatever the arena does with the released block.
"""

from __future__ import annotations

import msgspec

from mstar_actors.messages import RANK_MEMORY, MediaCopy, MediaItem, TensorRef


class _Entry:
    def __init__(self, items: list[MediaItem]):
        self.items = items  # as prepared: arena refs
        self.copied: list[MediaItem] | None = None  # as SeqStarts carry them, once copied


class MediaLedger:
    """Pure: no I/O. ``take()`` hands the orders collected since the last plan."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}  # request id -> its media
        self._next_key = 0
        self._copies: list[MediaCopy] = []
        self._drops: list[int] = []
        self._releases: list[TensorRef] = []

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, media: list[MediaItem]) -> None:
        """Own a request's media (a second add of the same request keeps the first)."""
        if media and request_id not in self._entries:
            self._entries[request_id] = _Entry(list(media))

    def holds(self, request_id: str) -> bool:
        return request_id in self._entries

    def release(self, media: list[MediaItem]) -> None:
        """Release refs that no entry owns (a refused duplicate's)."""
        self._releases += [item.pixel_values for item in media]

    def start(self, request_id: str) -> list[MediaItem]:
        """The items a SeqStart of the request carries; the first call orders the copies."""
        entry = self._entries.get(request_id)
        if entry is None:
            return []
        if entry.copied is None:
            entry.copied = [self._copy(item) for item in entry.items]
        return entry.copied

    def end(self, request_id: str) -> None:
        """The request ended for good (its last choice, or refused): free what the ranks hold of it."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry.copied is None:
            self._releases += [item.pixel_values for item in entry.items]
        else:
            self._drops += [item.pixel_values.offset for item in entry.copied]

    def has_orders(self) -> bool:
        return bool(self._copies or self._drops or self._releases)

    def take(self) -> tuple[list[MediaCopy], list[int], list[TensorRef]]:
        """(copies, drops, releases) for the next plan."""
        orders = self._copies, self._drops, self._releases
        self._copies, self._drops, self._releases = [], [], []
        return orders

    def _copy(self, item: MediaItem) -> MediaItem:
        ref = item.pixel_values
        key, self._next_key = self._next_key, self._next_key + 1
        self._copies.append(MediaCopy(key, ref))
        local = TensorRef(RANK_MEMORY, key, ref.nbytes, ref.dtype, ref.shape)
        return msgspec.structs.replace(item, pixel_values=local)
