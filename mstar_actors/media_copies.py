"""One rank's private copies of its requests' media tensors.

Pixel lifetime. The prepare actor stores each item's ``pixel_values`` in the
tensor arena; the arena reclaims FIFO, so a block held for a whole request
(maybe a long generation) would stall every newer tensor behind it. Instead
each rank copies a request's tensors out at its first ``SeqStart`` and
releases the arena blocks at once: arena use is bounded by the requests not
yet started, private memory by the requests in flight. The copies live until
the request ends for good, not merely until it leaves the workers: a
preempted request restarts and recomputes its vision rows from them. The
conductor says which is which: an id in ``StepPlan.finished`` that is also in
``StepPlan.preempted`` will start again; any other ended for good. Media of a
request that ended before any ``SeqStart`` is named in
``StepPlan.release_media`` and only released.

``take(plan)`` rewrites the plan's media refs to local keys (segment
``LOCAL``, offset = key) that ``resolve`` maps to the copy: a released arena
offset may be reused by a later request, so arena refs can't be the key.

Not thread-safe: the worker calls it on its loop, in plan order.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from mstar_actors.messages import MediaItem, SeqStart, StepPlan, TensorRef

LOCAL = "rank-local"


class MediaCopies:
    """``pin_memory`` (default: when CUDA is available) makes each copy in
    page-locked memory, so the runner's host -> device copy of the pixel rows
    is one DMA queued without blocking the host; a pageable copy is staged by
    the driver through a bounce buffer, one more memcpy (15 MB for a
    640x480 8 s clip's raw rows), synchronously."""

    def __init__(self, arena: Any, pin_memory: bool | None = None):
        self.arena = arena  # consumer end: view(ref), release(ref)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._keys: dict[str, list[int]] = {}  # request id -> its tensors' keys, in media order
        self._tensors: dict[int, torch.Tensor] = {}
        self._next_key = 0

    @property
    def num_requests(self) -> int:
        return len(self._keys)

    def take(self, plan: StepPlan) -> StepPlan:
        """Drop copies of requests that ended for good, release ``release_media``,
        copy the media of newly started requests; the plan with local refs."""
        self.forget(rid for rid in plan.finished if rid not in set(plan.preempted))
        for ref in plan.release_media:
            self.arena.release(ref)
        if not any(s.media for s in plan.started):
            return plan
        started = [self._localize(s) if s.media else s for s in plan.started]
        return msgspec.structs.replace(plan, started=started)

    def resolve(self, ref: TensorRef) -> torch.Tensor:
        if ref.segment != LOCAL or ref.offset not in self._tensors:
            raise ValueError(f"media tensor {ref.segment}:{ref.offset} has no copy on this rank; "
                             f"only refs rewritten by MediaCopies.take resolve")
        return self._tensors[ref.offset]

    def forget(self, request_ids: Any) -> None:
        for rid in request_ids:
            for key in self._keys.pop(rid, ()):
                del self._tensors[key]

    def _localize(self, start: SeqStart) -> SeqStart:
        keys = self._keys.get(start.request_id)
        if keys is None:  # first start: copy out, then give the arena block back
            keys = self._keys[start.request_id] = [self._copy(item.pixel_values) for item in start.media]
        media = [_with_ref(item, key) for item, key in zip(start.media, keys, strict=True)]
        return msgspec.structs.replace(start, media=media)

    def _copy(self, ref: TensorRef) -> int:
        try:
            view = self.arena.view(ref)
            tensor = view.pin_memory() if self.pin_memory else view.clone()
        finally:
            self.arena.release(ref)
        key, self._next_key = self._next_key, self._next_key + 1
        self._tensors[key] = tensor
        return key


def _with_ref(item: MediaItem, key: int) -> MediaItem:
    ref = item.pixel_values
    return msgspec.structs.replace(item, pixel_values=TensorRef(LOCAL, key, ref.nbytes, ref.dtype, ref.shape))
