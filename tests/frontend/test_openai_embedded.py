"""The official ``openai`` client, sync and async, streaming and not, against
the live embedded SmolLM2 (the session's ``smollm2_server``, see
``tests/live_smollm2.py``). Replies are short so the file runs in seconds."""

from __future__ import annotations

import asyncio
import math

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours."}]
MULTI_TURN = [
    {"role": "system", "content": "You are a terse assistant. Answer in a few words."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.base_url, api_key=smollm2_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(smollm2_server) -> str:
    return smollm2_server.model


def _templated_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_list_and_unknown_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert "no-such-model" in info.value.body["message"]


def test_wrong_key_is_401(smollm2_server, model):
    wrong = openai.OpenAI(base_url=smollm2_server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_chat_stream_and_usage_agree(client, model, smollm2_tokenizer):
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage.prompt_tokens == _templated_len(smollm2_tokenizer, CHAT)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 12

    text, chunks = _stream_text(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"})
    # the same prompt again: its full KV blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_multi_turn_keeps_every_role(client, model, smollm2_tokenizer):
    out = client.chat.completions.create(model=model, messages=MULTI_TURN, max_tokens=8, temperature=0)
    # The template saw four messages as they are (flattening would change the count).
    assert out.usage.prompt_tokens == _templated_len(smollm2_tokenizer, MULTI_TURN)
    assert out.choices[0].message.content


def test_completions_text_and_stream(client, model, smollm2_tokenizer):
    prompt = "The capital of France is"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text
    assert out.usage.prompt_tokens == len(smollm2_tokenizer(prompt).input_ids)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_stop_string_cuts_the_text(client, model):
    prompt = "1, 2, 3, 4,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0]
    assert free.text.count(",") >= 2, free.text  # the model keeps counting
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[","])
    assert cut.choices[0].text == free.text.split(",")[0]
    assert cut.choices[0].finish_reason == "stop"
    text, chunks = _stream_text(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count from 1 to 10, one number per line."}],
        max_tokens=24, temperature=0, stop="\n", stream=True))
    assert text and "\n" not in text and chunks[-1].choices[0].finish_reason == "stop"


def test_n_and_seeded_sampling(client, model):
    def sample(seed: int) -> list[str]:
        out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=1.0,
                                             n=2, seed=seed)
        assert sorted(c.index for c in out.choices) == [0, 1]
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first, again = sample(1234), sample(1234)
    assert first == again
    others = [sample(seed) for seed in (1, 2)]
    # Different seeds usually differ; three same pairs in a row would mean the seed is ignored.
    assert any(o != first for o in others)


def test_logprobs_and_top_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens or len(content) == out.usage.completion_tokens - 1
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, max(t.logprob for t in entry.top_logprobs), abs_tol=1e-4)
    legacy = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_async_client_concurrent_and_streaming(smollm2_server, model, client):
    expected = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)

    async def main() -> tuple[list[str], str]:
        aclient = openai.AsyncOpenAI(base_url=smollm2_server.base_url, api_key=smollm2_server.api_key,
                                     max_retries=0, timeout=120)
        async with aclient:
            full = await asyncio.gather(*[
                aclient.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
                for _ in range(4)])
            stream = await aclient.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                                           temperature=0, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return [f.choices[0].message.content for f in full], text

    batched, streamed = asyncio.run(main())
    # Greedy replies do not depend on what else is in the batch.
    assert batched == [expected.choices[0].message.content] * 4
    assert streamed == expected.choices[0].message.content
