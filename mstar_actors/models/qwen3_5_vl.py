"""Qwen3.5 as a vision-language model: the hybrid text stack
(``qwen3_5.Qwen3_5ForCausalLM``, whose rotary already takes ``[3, T]``
positions) with the vision tower (``qwen3_5_vision``) in front.

Checkpoints are in transformers 5's layout: ``model.language_model.*`` (read
through the text model's aliases), ``model.visual.*`` (the tower's rules) and
``lm_head``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import qwen3_5
from .attention import PagedAttention
from .deltanet_ops import DeltaNetOps
from .media_inputs import MediaSplice
from .qwen2_5_vl import media_token_ids
from .qwen3_5_vision import QWEN3_5_VISION_RULES, Grid, Qwen3_5VisionSpec, Qwen3_5VisionTransformer, mrope_positions
from .qwen3_5_vision import parse_qwen3_5_vision_spec
from .sharding import ShardLayout
from .spec import ModelLoadError, ModelSpec
from .vision import PixelNorm, check_vision_width

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"

QWEN3_5_VL_RULES = qwen3_5.QWEN3_5_RULES + QWEN3_5_VISION_RULES
"""With ``qwen3_5.LAYOUT_ALIASES`` and ``qwen3_5.IGNORED_PREFIXES``."""


class Qwen3_5ForConditionalGeneration(MediaSplice, qwen3_5.Qwen3_5ForCausalLM):
    """The hybrid text model plus ``visual``. ``forward`` takes ``positions
    [3, T]`` (``[T]`` for text-only steps) and, optionally, ``media_rows``:
    (flat row indices, vision rows) that replace those rows' token embeddings
    before the first layer. The tower is replicated on every rank."""

    def __init__(self, spec: ModelSpec, vision: Qwen3_5VisionSpec, token_ids: dict[str, int],
                 backend: PagedAttention | None = None, layout: ShardLayout | None = None,
                 ops: DeltaNetOps | None = None, rotary_dim: int | None = None,
                 section: tuple[int, int, int] = (11, 11, 10)):
        super().__init__(spec, backend, layout, ops, rotary_dim, section)
        check_vision_width(vision.out_hidden_size, spec.hidden_size)
        self.vision_spec = vision
        self.media_token_ids = dict(token_ids)
        self.visual = Qwen3_5VisionTransformer(vision)

    def encode_media(self, pixel_values: torch.Tensor | list[torch.Tensor], grids: list[Grid]) -> torch.Tensor:
        """Vision rows for several items at once, ``[sum(t*h*w) / merge**2, hidden]``."""
        return self.visual(pixel_values, grids)

    def mrope_positions(self, num_prompt_tokens: int, media: list) -> tuple[torch.Tensor, int]:
        return mrope_positions(num_prompt_tokens, media, self.vision_spec.spatial_merge_size)


def build(model_dir: Path, cfg: dict, spec: ModelSpec, backend: PagedAttention,
          layout: ShardLayout | None = None) -> Qwen3_5ForConditionalGeneration:
    """The loader's constructor: the text model's rotary facts, the vision
    fields, and the video processor's normalization for raw video rows."""
    from mstar_actors.prepare.preparers import load_video_processor, video_pixel_constants

    where = str(Path(model_dir) / "config.json")
    if spec.linear_attention is None:
        raise ModelLoadError(f"{where}: {spec.architecture} needs linear_attention layers in layer_types")
    rotary_dim, section = qwen3_5.rotary_facts(cfg, spec.head_dim, where)
    vision = parse_qwen3_5_vision_spec(cfg, where)
    model = Qwen3_5ForConditionalGeneration(spec, vision, media_token_ids(cfg, where), backend, layout, None,
                                            rotary_dim, section)
    cols = vision.temporal_patch_size * vision.patch_size**2
    model.visual.patch_embed.pixel_norm = PixelNorm(*video_pixel_constants(load_video_processor(model_dir)), cols)
    return model
