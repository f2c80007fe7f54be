"""Actor test kit: a tiny random Llama with a word-level tokenizer, saved to a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.word_tokenizer import save_word_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system", "hello", "world"] + [f"w{i}" for i in range(290)]


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (ids: specials, then WORDS) with a chat template."""
    save_word_tokenizer(folder, {t: i for i, t in enumerate(SPECIALS + WORDS)}, SPECIALS[3:], CHAT_TEMPLATE)


def make_model_dir(folder: Path, seed: int = 0):
    """Save a tiny random Llama (hidden 64, 2 layers, vocab 512) and its tokenizer; return the HF model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights: greedy argmax is not decided by rounding
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 1.0 if "embed" in name else 0.15)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    json.loads((folder / "config.json").read_text())  # written: the runner reads it
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, make_model_dir(folder)
