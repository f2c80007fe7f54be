"""Structured-output test kit: the actor tests' tiny Llama with its word-level
tokenizer (each word one token, so a grammar over words reads plainly), the
decoding of token ids back to the strings the grammar sees, and an adapter."""

from __future__ import annotations

import importlib.util
from pathlib import Path


_KIT = Path(__file__).resolve().parent.parent / "actors" / "conftest.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load("actor_test_kit", _KIT)
# The actor tests' in-memory engine (prepare, conductor, two ranks); only its helpers are used.
request_path = _load("actor_request_path", _KIT.parent / "test_request_path.py")
VOCAB = kit.SPECIALS + kit.WORDS  # token id -> its string
EOS = 2  # "</s>"


def token_text(token_ids: list[int]) -> str:
    """The bytes a grammar matched: the tokens' strings concatenated, up to the first EOS."""
    ids = token_ids[: token_ids.index(EOS)] if EOS in token_ids else token_ids
    return "".join(VOCAB[t] if t < len(VOCAB) else f"<{t}>" for t in ids)  # the model has more rows than words


def word_id(word: str) -> int:
    return VOCAB.index(word)


def make_adapter(folder: Path, model, *, seed: int = 3) -> Path:
    """A random (non-zero B) PEFT LoRA on ``model``'s attention, saved to ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    get_peft_model(model, config).save_pretrained(str(folder))
    return folder
