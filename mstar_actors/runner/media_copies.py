"""One rank's private copies of its requests' media tensors.

The scheduler decides their lifetime and the plan says it (see
``StepPlan``): ``apply(plan)`` carries out its media orders (release refs of
requests that never started, free copies of requests that ended, copy new
ones out of the arena and release the arena block at once) and never
changes the plan. The runner then reads a SeqStart's pixel values through
``resolve``: its refs already name the copies (segment ``RANK_MEMORY``).

Not thread-safe: the worker calls it on its loop, in plan order.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar_actors.messages import RANK_MEMORY, StepPlan, TensorRef


class MediaCopies:
    """``pin_memory`` (default: when CUDA is available) makes each copy in
    page-locked memory, so the runner's host -> device copy of the pixel rows
    is one DMA queued without blocking the host; a pageable copy is staged by
    the driver through a bounce buffer, one more memcpy, synchronously."""

    def __init__(self, arena: Any, pin_memory: bool | None = None):
        self.arena = arena  # consumer end: view(ref), release(ref)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._tensors: dict[int, torch.Tensor] = {}  # MediaCopy.key -> the copy

    @property
    def num_copies(self) -> int:
        return len(self._tensors)

    def apply(self, plan: StepPlan) -> None:
        for ref in plan.release_media:
            self.arena.release(ref)
        for key in plan.drop_media:
            self._tensors.pop(key, None)  # absent only if a failed step stopped its copy
        for order in plan.copy_media:
            self._tensors[order.key] = self._copy(order.ref)

    def resolve(self, ref: TensorRef) -> torch.Tensor:
        if ref.segment != RANK_MEMORY or ref.offset not in self._tensors:
            raise ValueError(f"media tensor {ref.segment}:{ref.offset} has no copy on this rank; "
                             f"a SeqStart's media names a copy some plan's copy_media made")
        return self._tensors[ref.offset]

    def _copy(self, ref: TensorRef) -> torch.Tensor:
        try:
            view = self.arena.view(ref)
            return view.pin_memory() if self.pin_memory else view.clone()
        finally:
            self.arena.release(ref)
