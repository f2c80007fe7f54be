"""Qwen2-Audio served end to end: a tiny random model behind the real
launcher (every actor in its own process, mel frames through the
shared-memory arena), an ``input_audio`` wav, an ``audio_url`` mp3 and a
text chat request sent at once with the ``openai`` client, greedy tokens
equal to transformers ``generate`` on the feature extractor's own padded
chunk; a corrupt clip fails alone with a 400 naming its part."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from media_serving import MAX_TOKENS, ask_all, assert_replies_are_references, hf_and_preparer, serve

from tests import audio_fixtures

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
    """Two prepare workers: clips are prepared in the pool's processes, through slots of the run's shared memory."""
    yield from serve(audio_dir, tmp_path_factory, "prepare: {preprocess_workers: 2}\n")


def reference_reply(audio_dir: Path, messages: list[dict]) -> list[int]:
    """transformers' greedy tokens: our prompt ids (equal to the processor's,
    tests/prepare/test_audio_prepare.py), the feature extractor's whole padded
    chunk of each decoded clip and its attention mask."""
    from transformers import Qwen2AudioForConditionalGeneration

    from mstar_actors.frontend.openai_api import parse_messages
    from mstar_actors.messages import NewRequest, SamplingParams
    from mstar_actors.prepare.media import MediaLimits, MediaRef, decode_audio, read_local

    hf, preparer = hf_and_preparer(Qwen2AudioForConditionalGeneration, audio_dir)
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


def test_audio_and_text_together_equal_transformers(audio_server, audio_dir):
    import openai

    corrupt = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF junk" * 9).decode(), "format": "wav"}}
    bodies = {
        "wav": user(wav_part()),
        "two": user(mp3_part(), wav_part(0.5)),
        "text": [{"role": "user", "content": "what is this"}],
        "corrupt": user(wav_part(), corrupt),
    }
    replies = asyncio.run(ask_all(audio_server.port, bodies))

    bad = replies.pop("corrupt")
    assert isinstance(bad, openai.BadRequestError), bad
    assert "messages[0].content[2].input_audio" in str(bad) and "could not decode the audio" in str(bad)
    assert_replies_are_references(replies, bodies, audio_dir, reference_reply)
    assert np.unique([r.usage.prompt_tokens for r in replies.values()]).size == 3  # each clip's own count
    assert "prepare each clip in one of 2 processes" in audio_server.log
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mstar-{audio_server.run_dir.name}-clip")]
