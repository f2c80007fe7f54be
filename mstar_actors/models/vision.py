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


class TowerShape:
    """What a Qwen vision tower derives from its spec's sizes (``hidden_size``,
    ``num_heads``, ``in_channels``, ``temporal_patch_size``, ``patch_size``,
    ``spatial_merge_size``)."""

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


@dataclass(frozen=True)
class VisionSpec(TowerShape):
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
    check_head_dim(spec, where)
    if spec.window_size % (spec.patch_size * spec.spatial_merge_size):
        raise ModelLoadError(f"{where}: vision_config.window_size={spec.window_size} must be a multiple of patch_size * spatial_merge_size")
    return spec


def check_vision_width(out_hidden_size: int, hidden_size: int) -> None:
    """The tower's rows replace token embeddings, so their widths must agree."""
    if out_hidden_size != hidden_size:
        raise ModelLoadError(f"vision_config.out_hidden_size={out_hidden_size} must equal the text hidden_size={hidden_size}")


def check_head_dim(spec: TowerShape, where: str) -> None:
    """2D rotary turns rows and columns by a quarter of each head's pairs each."""
    if spec.hidden_size % spec.num_heads or spec.head_dim % 4:
        raise ModelLoadError(
            f"{where}: vision_config hidden_size={spec.hidden_size} / num_heads={spec.num_heads} must give a head_dim divisible by 4"
        )


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
    sizes = [h * w for t, h, w in grids for _ in range(t)]
    return [0, *torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()] if sizes else [0]


def window_order(grids: list[Grid], merge: int, cells_per_window: int) -> tuple[torch.Tensor, list[int]]:
    """Merge-block permutation that makes each window contiguous, and the
    cumulative patch counts at window boundaries (windows clipped at the
    frame's edges; none is empty: the window counts round up).

    Vectorised: each merge block gets its window's number (frame, window row,
    window column, row-major), and a stable sort by it keeps the blocks of a
    window in row-major order, as slicing each window out would: a frame has
    hundreds of windows, and a host loop over them costs more than the tower."""
    orders, counts, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        num_wh, num_ww = -(-gh // cells_per_window), -(-gw // cells_per_window)
        rows = torch.arange(gh) // cells_per_window
        cols = torch.arange(gw) // cells_per_window
        key = ((torch.arange(t)[:, None, None] * num_wh + rows[None, :, None]) * num_ww + cols[None, None, :]).flatten()
        orders.append(torch.argsort(key, stable=True) + base)
        counts.append(torch.bincount(key, minlength=t * num_wh * num_ww))
        base += t * gh * gw
    bounds = (torch.cat(counts) * merge * merge).cumsum(0)
    return torch.cat(orders), [0, *bounds.tolist()]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# -- modules --------------------------------------------------------------------


class PixelNorm:
    """The image processor's rescale and normalization of raw uint8 patch
    rows, in float32: ``(x * rescale - mean[c]) / std[c]``, the same three
    operations in the same order as the processor, so the rows are the
    ones it would have made, bit for bit. Rows are laid out channel-major
    (C, temporal patch, p, p), so channel ``c``'s constants cover
    ``cols_per_channel`` columns.

    Video rows travel raw (uint8) from the prepare actor to the ranks: a
    quarter of the bytes through the arena, the rank's copy and the
    host-to-device copy, and no float pass in preparation, which several
    drafts at once contend for. Kept off the module's buffers so that a
    model cast to bfloat16 keeps float32 constants."""

    def __init__(self, mean: list[float], std: list[float], rescale: float, cols_per_channel: int):
        self.rescale = float(rescale)
        # On the CPU explicitly: the loader builds the model under a meta device.
        self.mean = torch.tensor(mean, dtype=torch.float32, device="cpu").repeat_interleave(cols_per_channel)
        self.std = torch.tensor(std, dtype=torch.float32, device="cpu").repeat_interleave(cols_per_channel)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[1] != self.mean.numel():
            raise ValueError(f"uint8 pixel rows have shape {list(rows.shape)}; accepted: [N, {self.mean.numel()}]")
        if self.mean.device != rows.device:  # once per device
            self.mean, self.std = self.mean.to(rows.device), self.std.to(rows.device)
        return rows.float().mul_(self.rescale).sub_(self.mean).div_(self.std)


class PatchEmbed(nn.Module):
    """``processor``: the processor whose constants normalize raw uint8 rows,
    and the folder's file that holds them (named when they are missing)."""

    def __init__(self, spec: TowerShape, bias: bool = False,
                 processor: tuple[str, str] = ("image processor", "preprocessor_config.json")):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        # Stored as the checkpoint's Conv3d; a stride-equals-kernel conv over
        # one patch is a linear map of its flattened pixels.
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)
        self.processor = processor
        self.pixel_norm: PixelNorm | None = None  # set by the model's builder from the processor's constants

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dtype == torch.uint8:  # raw rows: normalize here, on the rank's device
            if self.pixel_norm is None:
                name, file = self.processor
                raise ValueError(f"uint8 pixel rows need the {name}'s mean, std and rescale factor, "
                                 f"which this vision tower was not given (the model folder's {file})")
            pixels = self.pixel_norm(pixels)
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


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
    """Attention that stays inside each segment (a window or a frame).

    Segments of equal length are batched into one unmasked SDPA call
    ``[S, H, L, D]``, one call per distinct length: a grid's windows have at
    most four (inner, right edge, bottom edge, corner), a video's frames one.
    Unmasked, SDPA takes its flash / memory-efficient kernels; a padded
    batch with a key mask would fall back to the math kernel, which
    materialises ``[S, H, L, L]``. A group whose segments lie
    back to back in the rows is a view; any other is gathered by an index
    built once per forward, and scattered back.
    """

    def __init__(self, bounds: list[int], device: torch.device | str):
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        lens = torch.tensor(bounds[1:], dtype=torch.long) - starts
        self.num_rows = bounds[-1]
        self.groups: list[tuple[int, int, int, torch.Tensor | None]] = []  # (first row, count, length, row index)
        for length in lens.unique().tolist():
            first = starts[lens == length]
            count = first.numel()
            if bool((first == first[0] + length * torch.arange(count)).all()):
                self.groups.append((int(first[0]), count, length, None))
            else:
                index = (first[:, None] + torch.arange(length)).flatten().to(device)
                self.groups.append((0, count, length, index))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v ``[N, H, D]`` -> ``[N, H, D]``."""
        if len(self.groups) == 1 and self.groups[0][3] is None and self.groups[0][0] == 0:
            _, count, length, _ = self.groups[0]
            return _sdpa(q, k, v, count, length)  # one batch of views, nothing gathered
        out = torch.empty_like(q)
        for first, count, length, index in self.groups:
            if index is None:
                rows = slice(first, first + count * length)
                out[rows] = _sdpa(q[rows], k[rows], v[rows], count, length)
            else:
                out.index_copy_(0, index, _sdpa(q[index], k[index], v[index], count, length))
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` back-to-back segments of ``length`` rows, each attending to itself."""
    shape = (count, length, q.shape[1], q.shape[2])
    batch = [t.reshape(shape).transpose(1, 2) for t in (q, k, v)]  # [S, H, L, D]
    return F.scaled_dot_product_attention(*batch).transpose(1, 2).reshape(q.shape)


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


@dataclass(frozen=True)
class Geometry:
    """What a forward derives from the grids alone, on the tower's device:
    the window permutation and its inverse, both segment sets, and the 2D
    rotary angles in window order. Built once per forward (every block shares
    it) and kept for the last few grid lists: clips of one size repeat."""

    order: torch.Tensor  # merge blocks in window order
    restore: torch.Tensor  # its inverse: merged rows back to input order
    windows: Segments
    frames: Segments
    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor


class Tower(nn.Module):
    """What the Qwen vision towers share around their blocks: the 2D rotary
    frequencies, the geometry of a grid list (``_build_geometry``, the
    tower's own), kept for the last ``MAX_GEOMETRIES`` lists (clips of one
    size repeat), and the check of pixel rows against their grids."""

    MAX_GEOMETRIES = 8

    def __init__(self, spec: TowerShape):
        super().__init__()
        self.spec = spec
        half = spec.head_dim // 2  # rows and columns each rotate a quarter of the pairs
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))
        self._geometries: dict[tuple, object] = {}  # (grids, device) -> geometry, oldest first

    def _geometry(self, grids: list[Grid], device: torch.device):
        key = (tuple(tuple(int(x) for x in g) for g in grids), str(device))
        geo = self._geometries.pop(key, None) or self._build_geometry(list(key[0]), device)
        self._geometries[key] = geo  # most recent last
        while len(self._geometries) > self.MAX_GEOMETRIES:
            del self._geometries[next(iter(self._geometries))]
        return geo

    def _build_geometry(self, grids: list[Grid], device: torch.device):
        raise NotImplementedError

    def _rotary_angles(self, grids: list[Grid]) -> torch.Tensor:
        """``[N, head_dim]`` angles of every patch, in the processor's order: rows' then columns', twice."""
        positions = patch_positions(grids, self.spec.spatial_merge_size)
        freqs = (positions[:, :, None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]: rows' then columns'
        return torch.cat((freqs, freqs), dim=-1)

    def _check(self, items: list[torch.Tensor], grids: list[Grid]) -> None:
        spec = self.spec
        bad = [g for g in grids if g[1] % spec.spatial_merge_size or g[2] % spec.spatial_merge_size or min(g) < 1]
        if bad:
            raise ValueError(f"grid_thw {bad}: height and width must be positive multiples of spatial_merge_size={spec.spatial_merge_size}")
        num_patches = sum(t * h * w for t, h, w in grids)
        shapes = [list(p.shape) for p in items]
        if any(p.ndim != 2 or p.shape[1] != spec.patch_dim for p in items) or sum(s[0] for s in shapes) != num_patches:
            raise ValueError(f"pixel_values has shape(s) {shapes}; grids {grids} need [{num_patches}, {spec.patch_dim}] rows in all")


class VisionTransformer(Tower):
    """``forward(pixel_values, grids)`` -> ``[N / merge**2, out_hidden_size]``,
    items in input order, each item's rows in the prompt's placeholder order.
    ``pixel_values`` is ``[N, patch_dim]``, or one such tensor per item (each
    is embedded on its own: a concatenation would copy every pixel row once
    more, ~60 MB for a 640x480 8 s clip in float32)."""

    def __init__(self, spec: VisionSpec):
        super().__init__(spec)
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)

    def forward(self, pixel_values: torch.Tensor | list[torch.Tensor], grids: list[Grid]) -> torch.Tensor:
        spec = self.spec
        items = [pixel_values] if isinstance(pixel_values, torch.Tensor) else list(pixel_values)
        self._check(items, grids)
        geo = self._geometry(grids, items[0].device)
        embedded = torch.cat([self.patch_embed(p) for p in items]) if len(items) > 1 else self.patch_embed(items[0])
        x = self._by_window(embedded, geo.order)
        for i, block in enumerate(self.blocks):
            x = block(x, geo.cos, geo.sin, geo.frames if i in spec.fullatt_block_indexes else geo.windows)
        return self.merger(x)[geo.restore]

    def _build_geometry(self, grids: list[Grid], device: torch.device) -> Geometry:
        spec = self.spec
        cells_per_window = spec.window_size // spec.patch_size // spec.spatial_merge_size
        order, window_bounds = window_order(grids, spec.spatial_merge_size, cells_per_window)
        angles = self._by_window(self._rotary_angles(grids), order)
        return Geometry(
            order=order.to(device),
            restore=torch.argsort(order).to(device),
            windows=Segments(window_bounds, device),
            frames=Segments(frame_bounds(grids), device),
            cos=angles.cos().to(device),
            sin=angles.sin().to(device),
        )

    def _by_window(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        unit = self.spec.merge_unit
        return rows.view(-1, unit, rows.shape[-1])[order].reshape(rows.shape)
