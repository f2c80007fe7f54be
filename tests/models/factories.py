"""Tiny random Hugging Face models saved to a folder, for the model tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The tiny decoder's sizes, shared by every family's test model."""

TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, temporal_patch_size=2,
                  spatial_merge_size=2)
"""The tiny vision tower's sizes (2x2 merge, rows as wide as the decoder's), shared by the VL test models."""

_TINY = dict(
    **TINY_DECODER,
    vocab_size=512,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    "llama": lambda: LlamaConfig(**_TINY),
    "llama3-tied": lambda: LlamaConfig(**_TINY, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**_TINY, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**_TINY, head_dim=32),
    "llama-bias": lambda: LlamaConfig(**_TINY, attention_bias=True),  # o_proj's bias: row-parallel, added once
}


def multimodal_text_config(vocab_size: int, **extra) -> dict:
    """A multimodal test model's text stack: the tiny decoder, 512 positions."""
    return dict(TINY_DECODER, vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, **extra)


def make_hf_model(kind: str, folder: Path, seed: int = 0):
    """Save a random float32 model of ``kind`` to ``folder``; return it (eval mode)."""
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _spread_weights(model)
    model.save_pretrained(folder)
    return model


def _spread_weights(model) -> None:
    """Wider random weights than the 0.02 init, so logits are far apart and a
    greedy argmax is not decided by float32 rounding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
