"""A word-level tokenizer saved to a folder: the tiny chat models' of the
actor, preparation and serving tests (words split on white space, so a
prompt's ids are the template's words, one each)."""

from __future__ import annotations

from pathlib import Path


def save_word_tokenizer(folder: Path, vocab: dict[str, int], specials: list[str], chat_template: str) -> None:
    """A word-level tokenizer over ``vocab`` (``<unk>``, ``<s>`` and ``</s>``
    as unknown, bos and eos) with ``specials`` as its additional special
    tokens and ``chat_template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=specials)
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
