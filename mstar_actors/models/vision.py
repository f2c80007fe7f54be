"""Qwen2.5-VL's vision tower: patches of pixels in, one row per merged patch out.

Input rows are the processor's ``pixel_values``: one row per
``temporal_patch_size x patch_size x patch_size`` patch (all channels), laid
out item after item, frame after frame, and inside a frame in
spatial-merge-block order (each ``merge x merge`` block of neighbouring
patches is contiguous). ``grid_thw`` gives each item's patch grid.

The tower: a linear patch embedding, ``depth`` pre-norm blocks (RMSNorm,
attention with 2D rotary positions, SwiGLU MLP), then the patch merger, which
concatenates each ``merge x merge`` block and projects it to the text
model's width. Most blocks attend inside windows of ``window_size`` pixels;
the blocks in ``fullatt_block_indexes`` attend across a whole frame. Windows
are made by permuting merge blocks so each window is one contiguous run;
the output is permuted back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import RMSNorm
from .spec import ModelLoadError

_NORM_EPS = 1e-6  # fixed in the reference implementation, not in config.json

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class VisionSpec:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    tokens_per_second: float = 2.0
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one ``pixel_values`` row."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


def parse_vision_spec(cfg: dict, where: str) -> VisionSpec:
    """From config.json's ``vision_config``; refuses what the tower can't run."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise ModelLoadError(f"{where}: field 'vision_config' is missing")
    act = vc.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: vision_config.hidden_act {act!r} is not supported; accepted: silu")
    rope = vc.get("rope_parameters") or {}
    try:
        spec = VisionSpec(
            depth=int(vc["depth"]),
            hidden_size=int(vc["hidden_size"]),
            intermediate_size=int(vc["intermediate_size"]),
            num_heads=int(vc["num_heads"]),
            out_hidden_size=int(vc["out_hidden_size"]),
            patch_size=int(vc.get("patch_size", 14)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            window_size=int(vc.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in vc.get("fullatt_block_indexes", ())),
            in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))),
            tokens_per_second=float(vc.get("tokens_per_second", 2)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
    except KeyError as err:
        raise ModelLoadError(f"{where}: field 'vision_config.{err.args[0]}' is missing") from None
    if spec.hidden_size % spec.num_heads or spec.head_dim % 4:
        raise ModelLoadError(
            f"{where}: vision_config hidden_size={spec.hidden_size} / num_heads={spec.num_heads} must give a head_dim divisible by 4"
        )
    if spec.window_size % (spec.patch_size * spec.spatial_merge_size):
        raise ModelLoadError(f"{where}: vision_config.window_size={spec.window_size} must be a multiple of patch_size * spatial_merge_size")
    return spec


# -- geometry: pure functions of the grids -------------------------------------


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """``[N, 2]`` (row, col) of every patch, in the processor's merge-block order."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_bounds(grids: list[Grid]) -> list[int]:
    """Cumulative patch counts at every frame boundary (full-attention segments)."""
    bounds = [0]
    for t, h, w in grids:
        bounds += [bounds[-1] + h * w * (i + 1) for i in range(t)]
    return bounds


def window_order(grids: list[Grid], merge: int, cells_per_window: int) -> tuple[torch.Tensor, list[int]]:
    """Merge-block permutation that makes each window contiguous, and the
    cumulative patch counts at window boundaries (windows clipped at the
    frame's edges; empty ones dropped)."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        num_wh, num_ww = -(-gh // cells_per_window), -(-gw // cells_per_window)
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for ti in range(t):
            for wr in range(num_wh):
                for wc in range(num_ww):
                    r0, c0 = wr * cells_per_window, wc * cells_per_window
                    cells = index[ti, r0 : r0 + cells_per_window, c0 : c0 + cells_per_window].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), bounds


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# -- modules --------------------------------------------------------------------


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        # Stored as the checkpoint's Conv3d; a stride-equals-kernel conv over
        # one patch is a linear map of its flattened pixels.
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: "Segments") -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class Segments:
    """Attention that stays inside each segment (a window or a frame), for
    every segment of every item in ONE SDPA call: rows ``[start, stop)`` of
    each segment are gathered into a padded batch ``[S, H, L, D]`` and a key
    mask hides the padding. Built once per forward for each set of bounds
    (one call per segment cost a kernel launch per window and layer)."""

    def __init__(self, bounds: list[int], device: torch.device | str):
        lens = [stop - start for start, stop in zip(bounds[:-1], bounds[1:])]
        length = max(lens)
        steps = torch.arange(length, device=device)
        valid = steps[None, :] < torch.tensor(lens, device=device)[:, None]  # [S, L]
        self.index = torch.where(valid, torch.tensor(bounds[:-1], device=device)[:, None] + steps[None, :], 0)
        self.key_mask = valid[:, None, None, :]  # [S, 1, 1, L]: keys a row may see
        self.rows = valid.flatten().nonzero().squeeze(1)  # the padded batch's real rows, in input order

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v ``[N, H, D]`` -> ``[N, H, D]``."""
        batch = [t[self.index].transpose(1, 2) for t in (q, k, v)]  # [S, H, L, D]
        out = F.scaled_dot_product_attention(*batch, attn_mask=self.key_mask)
        return out.transpose(1, 2).flatten(0, 1)[self.rows]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in float32 like the reference, whatever the model dtype."""
    x32 = x.float()
    return (x32 * cos[:, None] + rotate_half(x32) * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(spec.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.merged_size = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, _NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size), nn.GELU(), nn.Linear(self.merged_size, spec.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


class VisionTransformer(nn.Module):
    """``forward(pixel_values [N, patch_dim], grids)`` -> ``[N / merge**2, out_hidden_size]``,
    items in input order, each item's rows in the prompt's placeholder order."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        half = spec.head_dim // 2  # rows and columns each rotate a quarter of the pairs
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        spec = self.spec
        self._check(pixel_values, grids)
        order, window_bounds = window_order(grids, spec.spatial_merge_size, spec.window_size // spec.patch_size // spec.spatial_merge_size)
        order = order.to(pixel_values.device)
        device = pixel_values.device
        frames, windows = Segments(frame_bounds(grids), device), Segments(window_bounds, device)
        x = self._by_window(self.patch_embed(pixel_values), order)
        cos, sin = self._rotary(grids, order, device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in spec.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(order)]

    def _by_window(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        unit = self.spec.merge_unit
        return rows.view(-1, unit, rows.shape[-1])[order].reshape(rows.shape)

    def _rotary(self, grids: list[Grid], order: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = patch_positions(grids, self.spec.spatial_merge_size).to(device)
        inv_freq = self.inv_freq.to(device)
        freqs = (positions[:, :, None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]: rows' then columns'
        angles = self._by_window(torch.cat((freqs, freqs), dim=-1), order)
        return angles.cos(), angles.sin()

    def _check(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        spec = self.spec
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.ndim != 2 or tuple(pixel_values.shape) != (num_patches, spec.patch_dim):
            raise ValueError(
                f"pixel_values has shape {list(pixel_values.shape)}; grids {grids} need [{num_patches}, {spec.patch_dim}]"
            )
        bad = [g for g in grids if g[1] % spec.spatial_merge_size or g[2] % spec.spatial_merge_size or min(g) < 1]
        if bad:
            raise ValueError(f"grid_thw {bad}: height and width must be positive multiples of spatial_merge_size={spec.spatial_merge_size}")
