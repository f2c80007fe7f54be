"""Qwen2.5-VL served end to end: a tiny random model behind the real launcher
(every actor in its own process, media through the shared-memory arena),
image, video and text chat requests sent at once with the ``openai`` client,
greedy tokens equal to transformers ``generate`` on the same processor
outputs; a corrupt image fails alone with a 400 naming its part; shutdown
leaves no shared memory behind."""

from __future__ import annotations

import asyncio
import base64
import io
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from media_serving import MAX_TOKENS, ask_all, assert_replies_are_references, hf_and_preparer, serve
from test_launcher import our_segments

from tests import vl_fixtures
from tests.models import vl_factories as vf



def png_url(seed: int, height: int = 16, width: int = 24) -> str:
    from PIL import Image

    array = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def mp4_url(seconds: int = 2, fps: int = 4, size: int = 16) -> str:
    """A short mjpeg clip (sampled at the server's 2 fps: 4 frames, 2 temporal patches)."""
    import av

    out = io.BytesIO()
    rng = np.random.default_rng(7)
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mjpeg", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuvj444p"
        for _ in range(seconds * fps):
            frame = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(out.getvalue()).decode()


def messages_with(kind: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": f"describe this {kind}"},
                                         {"type": f"{kind}_url", f"{kind}_url": {"url": url}}]}]


TEXT_MESSAGES = [{"role": "user", "content": "describe this and this"}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return vl_fixtures.save_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl")


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    yield from serve(vl_dir, tmp_path_factory)


def reference_reply(vl_dir: Path, messages: list[dict]) -> list[int]:
    """transformers' greedy tokens on what our preparer makes of ``messages``
    (the server gets the same tensors through the arena; video rows travel
    raw and are normalized by the vision tower, as here)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams
    from mstar_actors.models.vision import PixelNorm

    parts = messages[0]["content"]
    content = parts if isinstance(parts, str) else [
        ContentPart(type="text", text=p["text"]) if p["type"] == "text" else ContentPart(type=p["type"], url=p[p["type"]]["url"])
        for p in parts]
    req = NewRequest(request_id="ref", model="tiny", sampling=SamplingParams(),
                     messages=[ChatMessage("user", content)])
    hf, preparer = hf_and_preparer(Qwen2_5_VLForConditionalGeneration, vl_dir)
    draft = preparer.draft(req, {})
    prompt = draft.prepared.prompt_token_ids
    kwargs: dict = {"mm_token_type_ids": torch.tensor([[1 if t == 300 else 2 if t == 301 else 0 for t in prompt]])}
    for item in draft.media:
        if item.kind == "image":
            kwargs |= {"pixel_values": item.pixel_values, "image_grid_thw": torch.tensor([item.grid_thw])}
        else:
            ip = preparer.image_processor
            rows = PixelNorm(ip.image_mean, ip.image_std, ip.rescale_factor, item.pixel_values.shape[1] // 3)(item.pixel_values)
            kwargs |= {"pixel_values_videos": rows, "video_grid_thw": torch.tensor([item.grid_thw]),
                       "second_per_grid_ts": torch.tensor([item.second_per_grid_t])}
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def test_image_video_and_text_together_equal_transformers(vl_server, vl_dir):
    import openai

    bodies = {
        "image": messages_with("image", png_url(1)),
        "video": messages_with("video", mp4_url()),
        "text": TEXT_MESSAGES,
        "corrupt": messages_with("image", "data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode()),
    }
    replies = asyncio.run(ask_all(vl_server.port, bodies))

    bad = replies.pop("corrupt")
    assert isinstance(bad, openai.BadRequestError), bad
    assert "messages[0].content[1].image_url" in str(bad)
    assert_replies_are_references(replies, bodies, vl_dir, reference_reply)


def test_another_image_of_the_same_size_does_not_reuse_the_first_ones_kv(vl_server, vl_dir):
    """Placeholder blocks are keyed by the media digest: a different image of
    the same size has the same prompt tokens, but its reply must be its own."""
    first, again, other = (asyncio.run(ask_all(vl_server.port, {"r": messages_with("image", png_url(seed))}))["r"]
                           for seed in (11, 11, 12))
    tokens = [[t.token for t in r.choices[0].logprobs.content] for r in (first, again, other)]
    assert tokens[0] == tokens[1]
    assert tokens[2] == _tokens(vl_dir, messages_with("image", png_url(12)))


def test_text_before_an_image_is_shared_with_requests_of_other_images(vl_server, vl_dir):
    """The blocks before a request's first media token are keyed by its text alone: another image after
    the same text reuses them (cached_tokens), its reply still its own."""
    text = " ".join(f"rule {i}: answer briefly and precisely." for i in range(12))  # several blocks

    def with_text(seed: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": png_url(seed)}}]}]

    first, other = (asyncio.run(ask_all(vl_server.port, {"r": with_text(seed)}))["r"] for seed in (21, 22))
    assert first.usage.prompt_tokens == other.usage.prompt_tokens
    assert 16 <= other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens - 4  # the text's
    assert [t.token for t in other.choices[0].logprobs.content] == _tokens(vl_dir, with_text(22))


def _tokens(vl_dir: Path, messages: list[dict]) -> list[str]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vl_dir)).convert_ids_to_tokens(reference_reply(vl_dir, messages))


def test_n_choices_of_one_image_each_equal_transformers(vl_server, vl_dir):
    """The request is prepared once; its choices share the image's one copy
    on the rank, held until the last of them ends."""
    import openai

    async def ask():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{vl_server.port}/v1", api_key="none", max_retries=0)
        try:
            return await client.chat.completions.create(
                model="tiny", messages=messages_with("image", png_url(3)), max_tokens=MAX_TOKENS, temperature=0,
                logprobs=True, n=3, extra_body={"ignore_eos": True})
        finally:
            await client.close()

    reply = asyncio.run(ask())
    expected = _tokens(vl_dir, messages_with("image", png_url(3)))
    assert [[t.token for t in c.logprobs.content] for c in reply.choices] == [expected] * 3
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS


def _prepared_ids(vl_dir: Path, messages: list[dict]) -> list[int]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams

    content = [ContentPart(type="text", text=p["text"]) if p["type"] == "text" else
               ContentPart(type=p["type"], url=p[p["type"]]["url"]) for p in messages[0]["content"]]
    req = NewRequest(request_id="ref", model="tiny", sampling=SamplingParams(), messages=[ChatMessage("user", content)])
    return hf_and_preparer(Qwen2_5_VLForConditionalGeneration, vl_dir)[1].draft(req, {}).prepared.prompt_token_ids


def test_return_token_ids_gives_the_prompt_the_model_was_given_media_expanded(vl_server, vl_dir):
    """vLLM's return_token_ids with an image: the prompt's ids as prepared (the image's placeholder run expanded
    to its patches), in the response and on a stream's first chunk, and the reply's own ids."""
    import json
    import urllib.request

    messages = messages_with("image", png_url(4))
    expected = _prepared_ids(vl_dir, messages)
    assert expected.count(vf.IMAGE_TOKEN) > 1
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

    def post(payload: dict) -> bytes:
        request = urllib.request.Request(f"http://127.0.0.1:{vl_server.port}/v1/chat/completions",
                                         data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    reply = json.loads(post(body))
    assert reply["prompt_token_ids"] == expected
    assert len(expected) == reply["usage"]["prompt_tokens"]
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"]
    events = [json.loads(line[6:]) for line in post(body | {"stream": True}).decode().splitlines()
              if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == expected
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == reply["choices"][0]["token_ids"]


def test_shutdown_leaves_no_shared_memory(vl_server):
    run_id = vl_server.run_dir.name
    assert any("arena-media" in name for name in our_segments(run_id)), "the run has a media arena"
    vl_server.proc.send_signal(signal.SIGTERM)
    assert vl_server.wait_exit() == 0, vl_server.log
    assert our_segments(run_id) == []
