"""Qwen3.5's vision tower and the multimodal rotary positions of its prompts.

Input rows are the processor's ``pixel_values``, laid out as Qwen2.5-VL's
(``models.vision``): one row per ``temporal_patch_size x patch x patch``
patch, item after item, frame after frame, each frame in spatial-merge-block
order; ``grid_thw`` gives each item's patch grid.

The tower: a linear patch embedding (the checkpoint's Conv3d, with bias),
plus a learned ``num_position_embeddings`` square grid of position
embeddings resampled bilinearly (corners aligned) onto each item's patch
grid; ``depth`` pre-norm blocks (LayerNorm, attention with 2D rotary
positions inside each frame, a GELU-tanh MLP); then the patch merger
(LayerNorm per patch, concatenation of each ``merge x merge`` block, two
linears around a GELU). No windows and, unlike Qwen3-VL, no deepstack
features: the merger's rows are all the text model takes.

Prompt positions (``mrope_positions``): the processor writes a video as one
``<t seconds><vision_start><video_pad>...<vision_end>`` group per temporal
patch, so the preparer sends one media item per temporal patch (grid
``(1, h, w)``); every item, image or frame, starts at the position after the
text before it and the text after it continues ``max(h, w) / merge`` further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import WeightRule
from .qwen2_5_vl import place_media
from .spec import ModelLoadError
from .vision import Grid, PatchEmbed, Segments, Tower, TowerShape, VisionAttention, check_head_dim, frame_bounds
from .vision import patch_positions

_NORM_EPS = 1e-6  # fixed in the reference implementation, not in config.json
_ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class Qwen3_5VisionSpec(TowerShape):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


def parse_qwen3_5_vision_spec(cfg: dict, where: str) -> Qwen3_5VisionSpec:
    """From config.json's ``vision_config``; refuses what the tower can't run."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise ModelLoadError(f"{where}: field 'vision_config' is missing")
    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{where}: vision_config.hidden_act {act!r} is not supported; accepted: {', '.join(_ACTIVATIONS)}")
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"{where}: vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported; accepted: axial")
    try:
        spec = Qwen3_5VisionSpec(
            depth=int(vc["depth"]),
            hidden_size=int(vc["hidden_size"]),
            intermediate_size=int(vc["intermediate_size"]),
            num_heads=int(vc["num_heads"]),
            out_hidden_size=int(vc["out_hidden_size"]),
            num_position_embeddings=int(vc["num_position_embeddings"]),
            patch_size=_scalar(vc.get("patch_size", 16), "patch_size", where),
            temporal_patch_size=_scalar(vc.get("temporal_patch_size", 2), "temporal_patch_size", where),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            in_channels=int(vc.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
    except KeyError as err:
        raise ModelLoadError(f"{where}: field 'vision_config.{err.args[0]}' is missing") from None
    check_head_dim(spec, where)
    if spec.num_grid_per_side**2 != spec.num_position_embeddings or spec.num_grid_per_side < 2:
        raise ModelLoadError(
            f"{where}: vision_config.num_position_embeddings={spec.num_position_embeddings} must be a square of at least 4"
        )
    return spec


def _scalar(value, name: str, where: str) -> int:
    if isinstance(value, (list, tuple)):  # the config allows [t, h, w]-style sizes; the reference uses one
        if len(set(value)) != 1:
            raise ModelLoadError(f"{where}: vision_config.{name} {list(value)} must be one size")
        value = value[0]
    return int(value)


_V = "model.visual"
_B = "blocks.{i}"
QWEN3_5_VISION_RULES = [
    WeightRule(f"{_V}.{name}", f"visual.{name}")
    for name in (
        "patch_embed.proj",
        "pos_embed",
        f"{_B}.norm1",
        f"{_B}.norm2",
        f"{_B}.attn.qkv",
        f"{_B}.attn.proj",
        f"{_B}.mlp.linear_fc1",
        f"{_B}.mlp.linear_fc2",
        "merger.norm",
        "merger.linear_fc1",
        "merger.linear_fc2",
    )
]
"""transformers 5's ``model.visual.*`` -> our ``visual.*``: the tower keeps its
checkpoint names (LoRA targets the text stack only)."""


# -- geometry: pure functions of the grids -------------------------------------


def position_interpolation(grids: list[Grid], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, 4] indices, [N, 4] weights)`` into the flattened ``side x side``
    position table for every patch (merge-block order, repeated per frame):
    bilinear with aligned corners, in float32 and the reference's order of
    operations, so the weights are its weights bit for bit."""
    indices, weights = [], []
    offsets = torch.arange(2)
    for t, h, w in grids:
        rows, cols = patch_positions([(1, h, w)], merge).unbind(1)
        taps = [_axis_taps(rows, h, side, offsets), _axis_taps(cols, w, side, offsets)]
        (h_taps, h_weights), (w_taps, w_weights) = taps
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: torch.Tensor, size: int, side: int, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def mrope_positions(num_prompt_tokens: int, media: list, spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """``([3, num_prompt_tokens] int64 positions, rope_delta)`` of a Qwen3.5
    prompt whose placeholder runs are ``media`` (``MediaItem``s: ``token_offset``,
    ``num_tokens``, ``grid_thw``; a video as one item per temporal patch),
    sorted by offset and not overlapping (the caller checks).

    An item starting at position ``s`` gets ``(s + t, s + row, s + col)`` over
    its merged grid; the text after it resumes at ``s + max(h, w) / merge``
    (the reference's rule, which ignores ``t``). Pure."""
    merge = spatial_merge_size

    def place(item, start: int) -> tuple[torch.Tensor, int]:
        t, h, w = item.grid_thw
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        return torch.stack([tt, hh, ww]).reshape(3, -1) + start, start + max(h, w) // merge

    return place_media(num_prompt_tokens, media, place)


# -- modules --------------------------------------------------------------------


class VisionMLP(nn.Module):
    def __init__(self, spec: Qwen3_5VisionSpec):
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, spec: Qwen3_5VisionSpec):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=_NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=_NORM_EPS)
        self.attn = VisionAttention(spec)  # qkv and proj with bias, as Qwen2.5-VL's
        self.mlp = VisionMLP(spec)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, spec: Qwen3_5VisionSpec):
        super().__init__()
        self.merged_size = spec.hidden_size * spec.merge_unit
        self.norm = nn.LayerNorm(spec.hidden_size, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged_size))))


@dataclass(frozen=True)
class Geometry:
    """What a forward derives from the grids alone, on the tower's device:
    the frames' segments, the 2D rotary angles and the position-table taps.
    Kept for the last few grid lists: clips of one size repeat."""

    frames: Segments
    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor
    interp_indices: torch.Tensor  # [N, 4]
    interp_weights: torch.Tensor  # [N, 4] float32


class Qwen3_5VisionTransformer(Tower):
    """``forward(pixel_values, grids)`` -> ``[N / merge**2, out_hidden_size]``,
    items in input order, each item's rows in the prompt's placeholder order.
    ``pixel_values`` is ``[N, patch_dim]``, or one such tensor per item (each
    embedded on its own, so pixel rows are not copied into one tensor)."""

    def __init__(self, spec: Qwen3_5VisionSpec):
        super().__init__(spec)
        self.patch_embed = PatchEmbed(spec, bias=True, processor=("video processor", "video_preprocessor_config.json"))
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)

    def forward(self, pixel_values: torch.Tensor | list[torch.Tensor], grids: list[Grid]) -> torch.Tensor:
        items = [pixel_values] if isinstance(pixel_values, torch.Tensor) else list(pixel_values)
        self._check(items, grids)
        geo = self._geometry(grids, items[0].device)
        x = torch.cat([self.patch_embed(p) for p in items]) if len(items) > 1 else self.patch_embed(items[0])
        # float32 weights times table rows, summed, then cast: the reference's order
        pos = (self.pos_embed(geo.interp_indices) * geo.interp_weights[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        for block in self.blocks:
            x = block(x, geo.cos, geo.sin, geo.frames)
        return self.merger(x)

    def _build_geometry(self, grids: list[Grid], device: torch.device) -> Geometry:
        spec = self.spec
        angles = self._rotary_angles(grids)
        indices, weights = position_interpolation(grids, spec.spatial_merge_size, spec.num_grid_per_side)
        return Geometry(
            frames=Segments(frame_bounds(grids), device),
            cos=angles.cos().to(device),
            sin=angles.sin().to(device),
            interp_indices=indices.to(device),
            interp_weights=weights.to(device),
        )
