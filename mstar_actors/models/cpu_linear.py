"""Float32 linear layers on CPU through oneDNN, on a weight reordered once.

Why: a decode step on CPU is mostly GEMMs with few rows (one per sequence)
against weights that do not fit in cache. ``F.linear`` hands them to MKL's
sgemm, which repacks the weight on every call; oneDNN on a weight already in
its blocked layout skips that. Measured on one AVX-512 core, SmolLM2-135M
shapes, weights cold as in a real step: the 30 layers' four projections at 8
rows 37 ms against 70 ms, the tied LM head (49152 x 576) 8 ms against 20 ms;
at 1 row about even for the layers and 8 against 11 ms for the head; at a
few hundred rows (prefill) 10-20% faster. So one rule: every float32 CPU
linear without autograd takes this path, whatever its row count.

Cost: the packed copy lives next to the dense weight, which stays the
source of truth (the loader fills it, LoRA and CUDA read it). That is one
more copy of every packed weight in RAM (for SmolLM2 in float32 about
540 MB: 425 MB of layers and 113 MB of LM head). It is made on a layer's
first CPU float32 call, so a model that never runs there pays nothing, and
made again if the weight is replaced or changed in place.

Results equal ``F.linear``'s to float32 rounding (another summation order),
not bit for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def is_packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` may take the packed path: CPU, float32 on
    both sides, no autograd (the oneDNN op has no backward), and a oneDNN
    build that computes it right (checked once)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and is_available()
    )


@functools.cache
def is_available() -> bool:
    """oneDNN's packed linear exists in this torch build and agrees with
    ``F.linear`` on a small case (a build without it, or a platform where
    it differs, keeps the plain path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(shape, generator=gen) for shape in ((3, 24), (40, 24), (40,)))
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), b, "none", [], "")
            return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


class PackedWeight:
    """A oneDNN-layout copy of one dense ``[out, in]`` weight, remade when the
    weight is replaced (another storage) or changed in place (its version)."""

    __slots__ = ("packed", "_key")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self._key: tuple | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _identity(weight)
        if key != self._key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._key = key
        return self.packed

    def release(self) -> None:
        self.packed, self._key = None, None


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: PackedWeight) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``cache``'s packed copy of ``weight``.
    Only where ``is_packable(x, weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, cache.get(weight), bias, "none", [], "")


def _identity(weight: torch.Tensor) -> tuple:
    # An inference tensor has no version counter; it can't be changed in
    # place outside inference mode, and the storage check still catches a swap.
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), tuple(weight.shape), version
