"""Fixtures of the structured-output tests (the kit is ``structured_kit``)."""

from __future__ import annotations

import pytest
from structured_kit import kit


@pytest.fixture(scope="session")
def word_model(tmp_path_factory):
    """(folder, HF model) of a tiny random Llama with the word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama-words")
    return folder, kit.make_model_dir(folder)
