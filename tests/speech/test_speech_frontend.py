"""The speech route of the real frontend actor over in-memory channels, the
engine's outputs sent by hand: the prompt it builds, audio leaving at the
fourth frame before the engine has finished, and failures after the first bytes."""

from __future__ import annotations

import asyncio
import base64
import json

import msgspec
import pytest

from mstar_actors.messages import Failed, Finished, SampledToken, TokenDelta
from tests.frontend.conftest import Harness
from tests.speech.speech_factories import CODEBOOK_SIZE, ids, orpheus_prompt, orpheus_tokenizer, reference_pcm, save_tiny_snac

pytest.importorskip("snac")

TEXT = "Hello world!"
FRAME_BYTES = 2048 * 2


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory):
    """(model folder with the Orpheus tokenizer, tokenizer, snac folder, snac model)."""
    root = tmp_path_factory.mktemp("orpheus-frontend")
    tok = orpheus_tokenizer(root / "model")
    tok.save_pretrained(root / "model")
    snac = save_tiny_snac(root / "snac")
    return root / "model", tok, root / "snac", snac


def speech_harness(orpheus) -> Harness:
    from mstar_actors.config import SpeechConfig

    folder, tok, snac_dir, _ = orpheus
    h = Harness(folder, tok)
    h.config = msgspec.structs.replace(h.config, speech=SpeechConfig(snac_path=str(snac_dir), codec_device="cpu",
                                                                     codec_threads=1))
    h.engine.plan = lambda req: None  # the test answers
    return h


def frame_tokens(tok, num_frames: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    base = tok.convert_tokens_to_ids("<custom_token_10>")
    return [base + s * CODEBOOK_SIZE + rng.randrange(CODEBOOK_SIZE) for _ in range(num_frames) for s in range(7)]


async def deltas(h: Harness, req, token_ids: list[int]) -> None:
    for i, t in enumerate(token_ids):
        await h.engine.send(TokenDelta(request_id=req.request_id, tokens=[SampledToken(request_id=req.request_id,
                                                                                      token_id=t)],
                                       num_prompt_tokens=len(req.prompt_token_ids) if i == 0 else 0))


async def read_into(h: Harness, body: dict, chunks: asyncio.Queue) -> int:
    async with h.session.post(h.url + "/v1/audio/speech", json=body) as r:
        async for data in r.content.iter_any():
            await chunks.put(data)
        return r.status


async def start_speech(h: Harness, body: dict) -> tuple[asyncio.Queue, asyncio.Task, object]:
    """A speech request in flight: (its body's chunks as they come, the client's
    task, which ends with the status, the request the engine got)."""
    chunks: asyncio.Queue = asyncio.Queue()
    client = asyncio.create_task(read_into(h, body, chunks))
    await h.engine.wait_for(lambda: h.engine.requests)
    return chunks, client, next(iter(h.engine.requests.values()))


async def take(chunks: asyncio.Queue, num_bytes: int) -> bytes:
    got = b""
    while len(got) < num_bytes:
        got += await asyncio.wait_for(chunks.get(), 10)
    return got


def run(fn, *args):
    asyncio.run(asyncio.wait_for(fn(*args), 15))


def test_audio_leaves_at_the_fourth_frame_before_the_engine_finishes(orpheus):
    run(_audio_leaves_early, orpheus)


def test_a_failure_after_the_first_bytes_is_an_error_event(orpheus):
    run(_failure_after_bytes, orpheus)


def test_a_refusal_before_any_audio_keeps_its_status(orpheus):
    run(_refusal_before_audio, orpheus)


def test_without_a_codec_the_route_says_what_it_needs(harness):
    run(_no_codec, harness)


async def _audio_leaves_early(orpheus):
    folder, tok, _, snac = orpheus
    async with speech_harness(orpheus) as h:
        chunks, client, req = await start_speech(h, {"model": "tiny", "voice": "zoe", "input": TEXT, "response_format": "pcm"})
        assert req.prompt_token_ids == orpheus_prompt(tok, "zoe", TEXT)
        assert req.sampling.stop_token_ids == tuple(ids(tok, "<custom_token_2>"))
        sos, eos_speech = ids(tok, "<custom_token_1>", "<custom_token_2>")
        tokens = [sos, *frame_tokens(tok, 6)]
        await deltas(h, req, tokens[:1 + 4 * 7])
        first = await take(chunks, 2 * FRAME_BYTES)  # frames 0 and 1, the engine not finished
        assert chunks.empty()
        await deltas(h, req, tokens[1 + 4 * 7:] + [eos_speech])
        await h.engine.send(Finished(request_id=req.request_id, finish_reason="stop",
                                     num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=len(tokens) + 1))
        rest = await take(chunks, 4 * FRAME_BYTES)
        assert await client == 200
        assert first + rest == reference_pcm(snac, tokens + [eos_speech], tok.convert_tokens_to_ids("<custom_token_10>"))


async def _failure_after_bytes(orpheus):
    folder, tok, _, _ = orpheus
    async with speech_harness(orpheus) as h:
        chunks, client, req = await start_speech(h, {"voice": "tara", "input": TEXT, "stream_format": "sse"})
        await deltas(h, req, frame_tokens(tok, 4))
        raw = await take(chunks, 1)  # the first delta event
        await h.engine.send(Failed(request_id=req.request_id, status=500, message="rank lost", error_type="server_error"))
        assert await client == 200
        while not chunks.empty():
            raw += chunks.get_nowait()
        events = [json.loads(part[len("data: "):]) for part in raw.decode().split("\n\n") if part]
        assert events[-1]["type"] == "error" and "rank lost" in events[-1]["error"]["message"]
        assert all(e["type"] != "speech.audio.done" for e in events)
        assert base64.b64decode(events[0]["audio"])[:4] == b"RIFF"


async def _refusal_before_audio(orpheus):
    async with speech_harness(orpheus) as h:
        chunks, client, req = await start_speech(h, {"voice": "tara", "input": TEXT})
        await h.engine.send(Failed(request_id=req.request_id, status=400, message="prompt too long", param="prompt"))
        assert await client == 400


async def _no_codec(harness):
    async with harness() as h:
        status, body = await h.post("/v1/audio/speech", {"voice": "tara", "input": TEXT})
    assert status == 404 and "speech.snac_path" in body["error"]["message"]


def test_a_failure_after_raw_audio_bytes_cuts_the_transfer(orpheus):
    run(_failure_after_raw_bytes, orpheus)


async def _failure_after_raw_bytes(orpheus):
    import aiohttp

    folder, tok, _, _ = orpheus
    async with speech_harness(orpheus) as h:
        chunks, client, req = await start_speech(h, {"voice": "tara", "input": TEXT})
        await deltas(h, req, frame_tokens(tok, 4))
        assert (await take(chunks, 44))[:4] == b"RIFF"
        await h.engine.send(Failed(request_id=req.request_id, status=500, message="rank lost", error_type="server_error"))
        with pytest.raises(aiohttp.ClientPayloadError):  # no end of the chunked body: the client knows
            await client


def test_a_reply_of_no_whole_frame_is_an_error_not_a_silent_file(orpheus):
    """The model wrote tokens but no whole codec frame (junk, or frames with
    codes out of range): a 500 saying so (it was a 200 of a bare WAV header);
    a cap under one frame's 7 codes is refused up front."""
    run(_no_frame, orpheus)


async def _no_frame(orpheus):
    folder, tok, _, _ = orpheus
    async with speech_harness(orpheus) as h:
        for stream_format in ("audio", "sse"):
            h.engine.requests.clear()
            body = {"voice": "tara", "input": TEXT, "stream_format": stream_format}
            client = asyncio.create_task(h.post("/v1/audio/speech", body))
            await h.engine.wait_for(lambda: h.engine.requests)
            req = next(iter(h.engine.requests.values()))
            await deltas(h, req, frame_tokens(tok, 1)[:5] + ids(tok, "<|eot_id|>"))
            await h.engine.send(Finished(request_id=req.request_id, finish_reason="stop", num_prompt_tokens=3,
                                         num_output_tokens=6))
            status, error = await client
            assert status == 500 and "no whole codec frame" in error["error"]["message"], (stream_format, error)
        status, body = await h.post("/v1/audio/speech", {"voice": "tara", "input": TEXT, "max_tokens": 6})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        h.engine.requests.clear()  # a cap the reply reached before a whole frame: the client's to raise
        client = asyncio.create_task(h.post("/v1/audio/speech", {"voice": "tara", "input": TEXT, "max_tokens": 8}))
        await h.engine.wait_for(lambda: h.engine.requests)
        req = next(iter(h.engine.requests.values()))
        await deltas(h, req, ids(tok, "<custom_token_1>", "<custom_token_1>") + frame_tokens(tok, 1)[:6])
        await h.engine.send(Finished(request_id=req.request_id, finish_reason="length", num_prompt_tokens=3,
                                     num_output_tokens=8))
        status, body = await client
        assert status == 400 and body["error"]["param"] == "max_tokens" and "raise it" in body["error"]["message"]
        # frames the model wrote with codes out of range: the model's fault, whatever the cap (no larger one helps)
        h.engine.requests.clear()
        client = asyncio.create_task(h.post("/v1/audio/speech", {"voice": "tara", "input": TEXT, "max_tokens": 14}))
        await h.engine.wait_for(lambda: h.engine.requests)
        req = next(iter(h.engine.requests.values()))
        await deltas(h, req, ids(tok, *["<custom_token_10>"] * 7) + frame_tokens(tok, 1)[:6])
        await h.engine.send(Finished(request_id=req.request_id, finish_reason="length", num_prompt_tokens=3,
                                     num_output_tokens=13))
        status, body = await client
        assert status == 500 and "out of range" in body["error"]["message"], body
