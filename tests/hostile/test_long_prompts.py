"""A prompt too long to serve is refused after about max_model_len tokens of
work, not after tokenizing all of it."""

import random

import pytest

from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams
from mstar_actors.prepare.preparers import Preparer
from mstar_actors.prepare.prompt_bound import CUT_SLACK
from mstar_actors.tokenization import Tokenization

LIMIT = 256  # the tiny model's max_position_embeddings


class Counting:
    """The tokenizer, counting the characters and tokens it was asked to encode."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.num_chars = 0
        self.num_tokens = 0

    def __call__(self, text, **kw):
        out = self.inner(text, **kw)
        self.num_chars += len(text)
        self.num_tokens += len(out.input_ids)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counted(model_dir):
    tokenization = Tokenization(model_dir)
    assert tokenization.max_chars_per_token  # computed from the real vocabulary
    tokenization.tokenizer = counter = Counting(tokenization.tokenizer)
    return Preparer(tokenization, LIMIT), counter


def request(prompt=None, messages=None):
    return NewRequest(request_id="r", model="tiny", sampling=SamplingParams(max_tokens=4), prompt=prompt,
                      messages=messages)


def assert_too_long(out):
    assert out.status == 400 and out.code == "context_length_exceeded", out
    assert out.message.startswith("the prompt has at least ") and f"context is {LIMIT} tokens" in out.message


def test_a_huge_prompt_is_refused_from_its_length_without_tokenizing(counted):
    preparer, counter = counted
    text = "The quick brown fox jumps over the lazy dog. " * 90_000  # ~4 MB
    assert_too_long(preparer.draft(request(prompt=text)))
    assert_too_long(preparer.draft(request(messages=[ChatMessage(role="user", content=text)])))
    assert counter.num_chars == 0


def test_a_long_prompt_is_refused_within_two_and_a_half_limits_of_work(counted):
    preparer, counter = counted
    limit_chars = (LIMIT - 1) * preparer.tokenization.max_chars_per_token
    for piece in ["hello world ", "東京 café 🙂 ", "x"]:
        text = (piece * (limit_chars // len(piece)))[:limit_chars]
        counter.num_tokens = 0
        assert_too_long(preparer.draft(request(prompt=text)))
        # about 1.5 limits for text, 2.25 for a run of one letter (BPE merges it unevenly)
        assert counter.num_tokens <= 2.5 * (LIMIT + CUT_SLACK), (piece, counter.num_tokens)


def test_prompts_that_fit_are_tokenized_as_before(counted, tokenizer):
    preparer, _ = counted
    rng = random.Random(0)
    words = ["hello", "world", "東京", "🙂", "<|im_start|>", "\n", "  ", "STOP", "naïve"]
    for _ in range(50):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 120)))
        out = preparer.draft(request(prompt=text))
        expected = tokenizer(text).input_ids
        if len(expected) < LIMIT:
            assert out.prepared.prompt_token_ids == expected
        else:
            assert out.status == 400


def test_the_character_bound_holds_on_the_vocabulary(model_dir, tokenizer):
    bound = Tokenization(model_dir).max_chars_per_token
    for entry, token_id in tokenizer.get_vocab().items():
        assert len(tokenizer.decode([token_id])) <= bound, entry


@pytest.mark.parametrize("part", [ContentPart(type="image_url", url="data:image/png;base64,AA"),
                                  ContentPart(type="input_audio", url="data:audio/wav;base64,AA")])
def test_media_on_a_text_only_model_is_a_400_naming_the_part(counted, part):
    preparer, _ = counted
    out = preparer.prepare(request(messages=[ChatMessage("user", [ContentPart(type="text", text="look"), part])]))
    assert out.status == 400 and out.param == f"messages[0].content[1].{part.type}", out
    readers = ("Qwen2AudioForConditionalGeneration)" if part.type == "input_audio" else
               "Qwen2_5_VLForConditionalGeneration, Qwen3_5ForConditionalGeneration)")  # the part's readers alone
    assert "reads text only" in out.message and out.message.endswith(f"a media architecture ({readers}"), out
