"""Qwen2-Audio served end to end: a tiny random model behind the real
launcher (every actor in its own process, mel frames through the
shared-memory arena), an ``input_audio`` wav, an ``audio_url`` mp3 and a
text chat request sent at once with the ``openai`` client, greedy tokens
equal to transformers ``generate`` on the feature extractor's own padded
chunk; a corrupt clip fails alone with a 400 naming its part."""

from __future__ import annotations

import asyncio
import base64
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from test_launcher import Server

from tests import audio_fixtures

MAX_TOKENS = 8
QUESTION = {"type": "text", "text": "what is this sound"}


def wav_part(seconds: float = 1.2) -> dict:
    data = base64.b64encode(audio_fixtures.encode_audio("wav", seconds=seconds, rate=22050)).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def mp3_part(seconds: float = 0.7) -> dict:
    data = base64.b64encode(audio_fixtures.encode_audio("mp3", seconds=seconds, channels=1)).decode()
    return {"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{data}"}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [QUESTION, *parts]}]


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return audio_fixtures.save_tiny_audio_model(tmp_path_factory.mktemp("audio") / "tiny-audio")


@pytest.fixture(scope="module")
def audio_server(audio_dir, tmp_path_factory):
    runtime_dir = tmp_path_factory.mktemp("xdg")
    runtime_dir.chmod(0o700)
    print("seed: 0 (the tiny model's weights and model.seed)")
    srv = Server(audio_dir, runtime_dir, tmp_path_factory.mktemp("cfg"))
    try:
        srv.wait_serving()
        yield srv
    finally:
        srv.kill()


@functools.cache
def _hf_and_preparer(audio_dir: Path):
    from transformers import Qwen2AudioForConditionalGeneration

    from mstar_actors.config import Config, ModelConfig
    from mstar_actors.model_info import load_model_info
    from mstar_actors.prepare.media import MediaLimits
    from mstar_actors.prepare.preparers import load_preparer

    hf = Qwen2AudioForConditionalGeneration.from_pretrained(str(audio_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, load_preparer(load_model_info(Config(model=ModelConfig(path=str(audio_dir)))), MediaLimits())


def reference_reply(audio_dir: Path, messages: list[dict]) -> list[int]:
    """transformers' greedy tokens: our prompt ids (equal to the processor's,
    tests/prepare/test_audio_prepare.py), the feature extractor's whole padded
    chunk of each decoded clip and its attention mask."""
    from mstar_actors.frontend.openai_api import parse_messages
    from mstar_actors.messages import NewRequest, SamplingParams
    from mstar_actors.prepare.media import MediaLimits, MediaRef, decode_audio, read_local

    hf, preparer = _hf_and_preparer(audio_dir)
    chat = parse_messages(messages)
    draft = preparer.draft(NewRequest(request_id="ref", model="tiny", sampling=SamplingParams(), messages=chat), {})
    kwargs: dict = {}
    content = chat[0].content
    clips = [] if isinstance(content, str) else [p for p in content if p.type != "text"]
    if clips:
        fe = preparer.feature_extractor
        samples = [decode_audio(read_local(MediaRef("audio", p.url, "p"), MediaLimits()), MediaRef("audio", p.url, "p"),
                                MediaLimits(), fe.sampling_rate) for p in clips]
        out = fe(samples, sampling_rate=fe.sampling_rate, return_attention_mask=True, padding="max_length",
                 return_tensors="pt")
        kwargs = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
    prompt = draft.prepared.prompt_token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        result = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return result[0, len(prompt):].tolist()


async def _ask_all(port: int, bodies: dict[str, list[dict]]) -> dict[str, object]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    async def ask(messages):
        try:
            return await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
        except openai.APIStatusError as err:
            return err

    try:
        results = await asyncio.gather(*(ask(m) for m in bodies.values()))
    finally:
        await client.close()
    return dict(zip(bodies, results))


def test_audio_and_text_together_equal_transformers(audio_server, audio_dir):
    import openai
    from transformers import AutoTokenizer

    corrupt = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF junk" * 9).decode(), "format": "wav"}}
    bodies = {
        "wav": user(wav_part()),
        "two": user(mp3_part(), wav_part(0.5)),
        "text": [{"role": "user", "content": "what is this"}],
        "corrupt": user(wav_part(), corrupt),
    }
    replies = asyncio.run(_ask_all(audio_server.port, bodies))

    bad = replies.pop("corrupt")
    assert isinstance(bad, openai.BadRequestError), bad
    assert "messages[0].content[2].input_audio" in str(bad) and "could not decode the audio" in str(bad)
    tokenizer = AutoTokenizer.from_pretrained(str(audio_dir))
    for name, reply in replies.items():
        assert not isinstance(reply, Exception), f"{name}: {reply}"
        expected = reference_reply(audio_dir, bodies[name])
        got = tokenizer.convert_tokens_to_ids([t.token for t in reply.choices[0].logprobs.content])
        assert got == expected, f"{name}: served {got}, transformers {expected}"
        assert reply.usage.completion_tokens == MAX_TOKENS
    assert np.unique([r.usage.prompt_tokens for r in replies.values()]).size == 3  # each clip's own count
