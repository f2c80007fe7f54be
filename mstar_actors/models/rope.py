"""Rotary position embedding (plain ``rope_theta`` and Llama-3 scaling).

Computed per token from ``positions`` like ``transformers`` does (float32
angles, then cast), so native and reference logits agree to float32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled for llama3."""
    # Explicit CPU: the model may be built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by
    ``factor``, short kept, the band between interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + _rotate_half(x) * sin``, bit for bit, with the minus sign
    folded into ``signed_sin`` (``(-sin, sin)`` halves): ``(-a) * b`` and
    ``a * (-b)`` round alike, and one fewer kernel runs (no negation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


class RotaryEmbedding(nn.Module):
    """Rotates q and k by token position.

    One instance serves every layer of a decoder, and ``begin_step`` /
    ``end_step`` bracket a forward over all of them: the angles of a step's
    positions are computed once there instead of once per layer (30 times
    for SmolLM2). Outside such a bracket each call computes its own.
    """

    def __init__(self, rope: RopeSpec, head_dim: int):
        super().__init__()
        # A plain attribute, not a buffer: it survives building on the meta
        # device (``to_empty`` would leave a buffer uninitialised).
        self.inv_freq = inverse_frequencies(rope, head_dim)
        self.step_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KH, D]`` by their token positions ``[T]``."""
        cos, signed_sin = self.step_tables if self.step_tables is not None else self.tables(positions, q.dtype)
        return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``signed_sin`` ``[T, 1, D]`` for ``positions [T]`` (see ``rotate``)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]

    def begin_step(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Compute the tables every layer of this forward uses (same ``positions``)."""
        self.step_tables = self.tables(positions, dtype)

    def end_step(self) -> None:
        self.step_tables = None
