"""A tiny random Qwen2.5-VL saved to a folder, and hand-built media inputs
with the shapes the transformers processor produces."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from mstar_actors import messages

from .factories import TINY_TOWER, _spread_weights, multimodal_text_config

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303
VOCAB = 320
MERGE = TINY_TOWER["spatial_merge_size"]
PATCH_DIM = 3 * 2 * 2 * 2  # channels * temporal_patch_size * patch_size**2
TOKENS_PER_SECOND = 2


def make_vl_config() -> Qwen2_5_VLConfig:
    text = multimodal_text_config(
        VOCAB, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(
        TINY_TOWER,
        depth=3,
        patch_size=2,
        window_size=8,  # 2 x 2 merged cells per window
        fullatt_block_indexes=[1],
        tokens_per_second=TOKENS_PER_SECOND,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )


def make_hf_vl_model(folder: Path, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """Save a random float32 Qwen2.5-VL to ``folder``; return it (eval mode)."""
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(make_vl_config()).to(torch.float32).eval()
    _spread_weights(model)
    with torch.no_grad():  # keep the vision tower's activations moderate
        for name, p in model.model.visual.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


def make_pixels(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Random processor-shaped ``pixel_values``: one row per patch."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_DIM, generator=gen)


def num_media_tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // MERGE**2


class FakeArena:
    """Stands in for the worker's arena: a TensorRef's segment name looks up a tensor."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def store(self, name: str, tensor: torch.Tensor) -> messages.TensorRef:
        self.tensors[name] = tensor
        return messages.TensorRef(name, 0, tensor.numel() * tensor.element_size(), "float32", tuple(tensor.shape))

    def resolve(self, ref: messages.TensorRef) -> torch.Tensor:
        return self.tensors[ref.segment]
