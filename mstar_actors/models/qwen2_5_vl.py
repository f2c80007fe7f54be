"""Qwen2.5-VL: the vision tower (``vision``) in front of the shared Qwen2
decoder, whose rotary embedding becomes multimodal (M-RoPE).

M-RoPE: every token has three positions (temporal, height, width); the
rotary frequency pairs are split by ``mrope_section`` into three runs, each
rotated by one of them. Text tokens carry the same value in all three, so a
text-only prompt is plain RoPE. A media item's placeholder run gets its
merged grid's (t, h, w) coordinates offset by the position where it starts
(video t scaled by ``second_per_grid_t * tokens_per_second``); the text after
it continues from the largest position used so far + 1. A sequence's
``rope_delta`` (max position + 1 - prompt length) shifts every generated
token: position = token index + delta.

Checkpoints come in two layouts, both read through one rule table: the
original (``model.layers.*``, ``visual.*``, ``lm_head``) and transformers
5's (``model.language_model.*``, ``model.visual.*``); ``LAYOUT_ALIASES``
rewrites the second into the first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .attention import PagedAttention, TorchPagedAttention
from .checkpoint import DECODER_RULES, WeightRule
from .decoder import CausalLM
from .media_inputs import MediaSplice
from .rope import _rotate_half, inverse_frequencies
from .sharding import ShardLayout
from .spec import ModelLoadError, ModelSpec
from .vision import Grid, PixelNorm, VisionSpec, VisionTransformer, check_vision_width, parse_vision_spec

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"

# -- config and checkpoint ----------------------------------------------------------

LAYOUT_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers 5 layout prefix -> the original layout's, applied to checkpoint and adapter names."""

_B = "visual.blocks.{i}"
VISION_RULES = [
    WeightRule(name, name)
    for name in (
        "visual.patch_embed.proj",
        f"{_B}.norm1",
        f"{_B}.norm2",
        f"{_B}.attn.qkv",
        f"{_B}.attn.proj",
        f"{_B}.mlp.gate_proj",
        f"{_B}.mlp.up_proj",
        f"{_B}.mlp.down_proj",
        "visual.merger.ln_q",
        "visual.merger.mlp.0",
        "visual.merger.mlp.2",
    )
]
"""The tower's modules keep their checkpoint names (LoRA targets the text stack only)."""

QWEN2_5_VL_RULES = DECODER_RULES + VISION_RULES


def text_config(cfg: dict) -> dict:
    """The decoder's fields as one flat dict: transformers 5 nests them under
    ``text_config``, older configs keep them at the top level. The multimodal
    rotary (``mrope`` type, ``mrope_section``) is read by ``mrope_section``;
    the decoder's spec sees plain rotary with the same theta."""
    flat = {**cfg, **(cfg.get("text_config") or {})}
    rope = dict(flat.get("rope_parameters") or flat.get("rope_scaling") or {})
    flat.pop("rope_scaling", None)
    theta = rope.get("rope_theta", flat.get("rope_theta", 1000000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    flat["rope_parameters"] = {"rope_type": "default" if rope_type in ("mrope", "default") else rope_type, "rope_theta": theta}
    return flat


def mrope_section(cfg: dict, head_dim: int, where: str) -> tuple[int, int, int]:
    flat = {**cfg, **(cfg.get("text_config") or {})}
    rope = flat.get("rope_parameters") or flat.get("rope_scaling") or {}
    section = tuple(int(s) for s in rope.get("mrope_section", ()))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelLoadError(
            f"{where}: rope mrope_section {list(section)} must be three sizes summing to head_dim / 2 = {head_dim // 2}"
        )
    return section


def media_token_ids(cfg: dict, where: str) -> dict[str, int]:
    ids = {}
    for kind in ("image", "video"):
        value = cfg.get(f"{kind}_token_id", (cfg.get("text_config") or {}).get(f"{kind}_token_id"))
        if not isinstance(value, int):
            raise ModelLoadError(f"{where}: field '{kind}_token_id' is missing")
        ids[kind] = value
    return ids


# -- multimodal rotary positions -----------------------------------------------------


def mrope_positions(
    num_prompt_tokens: int,
    media: list,
    spatial_merge_size: int,
    tokens_per_second: float,
) -> tuple[torch.Tensor, int]:
    """``([3, num_prompt_tokens] int64 positions, rope_delta)`` of a prompt whose
    placeholder runs are ``media`` (``MediaItem``s: ``token_offset``,
    ``num_tokens``, ``grid_thw``, ``kind``, ``second_per_grid_t``), sorted by
    offset and not overlapping (the caller checks). Pure: depends only on the
    prompt length and the items' grids and offsets."""

    def place(item, start: int) -> tuple[torch.Tensor, int]:
        grid = _item_grid(item, spatial_merge_size, tokens_per_second, start)
        return grid, int(grid.max()) + 1

    return place_media(num_prompt_tokens, media, place)


def place_media(num_prompt_tokens: int, media: list, place) -> tuple[torch.Tensor, int]:
    """``([3, num_prompt_tokens] positions, rope_delta)``: text runs count on
    from where the run before them left off, the same in all three rows;
    ``place(item, start)`` gives an item's ``[3, num_tokens]`` positions from
    ``start`` and where the text after it resumes."""
    runs, next_pos, cursor = [], 0, 0
    for item in media:
        runs.append(_text_run(item.token_offset - cursor, next_pos))
        next_pos += item.token_offset - cursor
        grid, next_pos = place(item, next_pos)
        runs.append(grid)
        cursor = item.token_offset + item.num_tokens
    runs.append(_text_run(num_prompt_tokens - cursor, next_pos))
    positions = torch.cat(runs, dim=1)
    return positions, next_pos + (num_prompt_tokens - cursor) - num_prompt_tokens


def _text_run(length: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + length, dtype=torch.long).expand(3, length)


def _item_grid(item, merge: int, tokens_per_second: float, start: int) -> torch.Tensor:
    t, h, w = item.grid_thw
    # Float32 products, then truncation, like the reference, so a fractional
    # interval rounds the same way.
    interval = torch.tensor(tokens_per_second * item.second_per_grid_t if item.kind == "video" else 0.0, dtype=torch.float32)
    t_idx = (torch.arange(t) * interval).long()
    tt, hh, ww = torch.meshgrid(t_idx, torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


class MRotaryEmbedding(nn.Module):
    """Rotary embedding over ``positions [3, T]``: frequency pair ``j`` turns
    by the temporal, height or width position according to ``mrope_section``."""

    def __init__(self, spec: ModelSpec, section: tuple[int, int, int]):
        super().__init__()
        self.inv_freq = inverse_frequencies(spec.rope, spec.head_dim)  # plain attribute: survives meta build
        self.axis = torch.repeat_interleave(torch.arange(3, device="cpu"), torch.tensor(section, device="cpu"))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq, self.axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        if positions.ndim == 1:
            positions = positions.expand(3, -1)
        chosen = positions[self.axis].float()  # [D/2, T]: each pair's own axis
        freqs = chosen.t() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos().to(q.dtype)[:, None, :]
        sin = angles.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# -- the model ---------------------------------------------------------------------------


class Qwen2_5_VLForConditionalGeneration(MediaSplice, CausalLM):
    """The shared decoder (``model``, ``lm_head``) with M-RoPE, plus ``visual``.

    ``forward`` takes ``positions [3, T]`` (``[T]`` for text-only steps) and,
    optionally, ``media_rows``: (flat row indices, vision rows) that replace
    those rows' token embeddings before the first layer.

    Under tensor parallelism the text stack is sharded like any decoder's;
    the vision tower is replicated on every rank (each encodes the same
    media and splices the same rows).
    """

    def __init__(
        self,
        spec: ModelSpec,
        vision: VisionSpec,
        section: tuple[int, int, int],
        token_ids: dict[str, int],
        backend: PagedAttention | None = None,
        layout: ShardLayout | None = None,
    ):
        super().__init__(spec, backend or TorchPagedAttention(), layout)
        check_vision_width(vision.out_hidden_size, spec.hidden_size)
        self.vision_spec = vision
        self.media_token_ids = dict(token_ids)
        self.visual = VisionTransformer(vision)
        for layer in self.model.layers:
            layer.self_attn.rotary = MRotaryEmbedding(spec, section)

    def encode_media(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Vision rows for several items at once, ``[sum(t*h*w) / merge**2, hidden]``."""
        return self.visual(pixel_values, grids)

    def mrope_positions(self, num_prompt_tokens: int, media: list) -> tuple[torch.Tensor, int]:
        v = self.vision_spec
        return mrope_positions(num_prompt_tokens, media, v.spatial_merge_size, v.tokens_per_second)


def build(model_dir: Path, cfg: dict, spec: ModelSpec, backend: PagedAttention,
          layout: ShardLayout | None = None) -> Qwen2_5_VLForConditionalGeneration:
    """The loader's constructor for this architecture (the vision fields of the parsed config.json)."""
    from mstar_actors.prepare.preparers import load_image_processor  # the preparer's constants, from the same folder

    where = str(Path(model_dir) / "config.json")
    vision = parse_vision_spec(cfg, where)
    model = Qwen2_5_VLForConditionalGeneration(
        spec, vision, mrope_section(cfg, spec.head_dim, where), media_token_ids(cfg, where), backend, layout
    )
    ip = load_image_processor(model_dir)
    cols = vision.temporal_patch_size * vision.patch_size**2
    model.visual.patch_embed.pixel_norm = PixelNorm(ip.image_mean, ip.image_std, ip.rescale_factor, cols)
    return model
