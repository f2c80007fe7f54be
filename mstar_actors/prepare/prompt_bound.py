"""Refusing a prompt too long to serve without tokenizing all of it.

A multi-megabyte prompt took seconds of tokenizing before its refusal. A
text longer than ``limit * max_chars_per_token`` characters can't fit in
``limit`` tokens; below that, a short prefix measures the text's characters
per token and a second prefix aimed just past ``limit`` decides, so a
refusal costs about ``limit`` tokens of work. Pure: the tokenizer comes in
as a function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A prompt that may be too long is tokenized in prefixes: the first of this
# many characters per allowed token (a quarter of the limit's tokens for
# English), each next one aimed AIM past the limit at the characters per
# token measured so far, and at least GROWTH times the last.
FIRST_PROBE_CHARS_PER_TOKEN = 1
AIM = 1.1
GROWTH = 1.25
# Tokens a cut can add to a prefix (the split word or special token), so a
# prefix of limit + CUT_SLACK tokens proves the whole prompt has limit or more.
CUT_SLACK = 32


class PromptTooLong(ValueError):
    """A prompt refused before it was tokenized in full: it has at least
    ``min_tokens`` tokens, ``limit`` or more."""

    def __init__(self, min_tokens: int, limit: int):
        super().__init__(f"the prompt has at least {min_tokens} tokens (the limit is {limit})")
        self.min_tokens = min_tokens
        self.limit = limit


def encode_bounded(encode: Callable[[str], list], text: str, limit: int | None,
                   max_chars_per_token: int | None) -> list[int]:
    """``encode(text)``, unless the text has ``limit`` tokens or more: then
    PromptTooLong, decided from its length in characters when no
    tokenization could fit it, else from prefixes (see above)."""
    if limit is None:
        return list(encode(text))
    if max_chars_per_token and len(text) > (limit - 1) * max_chars_per_token:
        raise PromptTooLong(-(-len(text) // max_chars_per_token), limit)
    probe = FIRST_PROBE_CHARS_PER_TOKEN * limit
    while probe < len(text):
        num_tokens = len(encode(text[:probe]))
        if num_tokens >= limit + CUT_SLACK:
            raise PromptTooLong(num_tokens - CUT_SLACK, limit)
        chars_per_token = probe / max(num_tokens, 1)
        probe = max(int(probe * GROWTH), int(AIM * (limit + CUT_SLACK) * chars_per_token))
    return list(encode(text))


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None where no
    bound holds (an unknown-token that swallows whole words or runs).

    The longest vocabulary entry bounds it: byte-level entries spell one
    character per byte (a text character is one byte or more), SentencePiece
    entries one per character, byte-fallback pieces six per byte. A
    normalizer may compose characters first (NFC: e + U+0301 is one é), so
    it doubles the bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk and not model.byte_fallback):
        return None
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    return longest * (2 if backend.normalizer is not None else 1)
