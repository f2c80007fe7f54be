"""Qwen2-Audio preparation: OpenAI's ``input_audio`` and vLLM's ``audio_url``
parts parsed, wav and mp3 files (made here with ``av``) decoded and
resampled to 16 kHz, prompt ids and mel frames equal to transformers'
``Qwen2AudioProcessor``, every limit and a corrupt file refused as a 400
naming the part, and the actor's pool sending each request once ready."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
import torch

from mstar_actors.frontend import openai_api as api
from mstar_actors.messages import (
    Failed,
    NewRequest,
    Prepared,
    SamplingParams,
)
from mstar_actors.prepare.media import MediaLimits, MediaRef, decode_audio
from mstar_actors.prepare.preparers import AudioPreparer, Draft, load_preparer
from tests import audio_fixtures as af
from tests import vl_fixtures
from tests.prepare.actor_kit import running_prepare_actor

QUESTION = {"type": "text", "text": "what is this sound"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return af.save_audio_prepare_folder(tmp_path_factory.mktemp("audio"))


@pytest.fixture(scope="module")
def preparer(folder):
    return load_preparer(af.audio_prepare_info(folder), MediaLimits())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def request(*parts: dict, rid: str = "r") -> NewRequest:
    """The NewRequest the frontend makes of one user message with ``parts``."""
    body = {"model": "audio", "messages": [{"role": "user", "content": [QUESTION, *parts]}]}
    parsed = api.parse_chat(json.dumps(body).encode())
    return NewRequest(request_id=rid, model="audio", sampling=SamplingParams(), messages=parsed.messages)


def processor_reference(folder, preparer, samples: list[np.ndarray], num_parts: int) -> dict:
    """transformers' processor on the template text our preparer renders and the same samples."""
    from transformers import AutoTokenizer, Qwen2AudioProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    processor = Qwen2AudioProcessor(feature_extractor=preparer.feature_extractor, tokenizer=tokenizer,
                                    chat_template=af.CHAT_TEMPLATE)
    content = [QUESTION] + [{"type": "audio", "audio_url": "x"}] * num_parts
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[text], audio=samples, sampling_rate=16000, return_tensors="pt")


# -- parsing ---------------------------------------------------------------------------------


def test_parts_become_data_urls_and_bad_ones_name_the_field():
    req = request(input_audio(b"RIFF", "mp3"), audio_url("https://example.com/a.wav"))
    parts = req.messages[0].content
    assert [(p.type, p.url) for p in parts[1:]] == [("input_audio", "data:audio/mpeg;base64,UklGRg=="),
                                                     ("audio_url", "https://example.com/a.wav")]
    for part, param, message in [
        ({"type": "input_audio", "input_audio": {"data": "AA", "format": "flac"}}, "input_audio.format",
         "accepted formats are 'wav', 'mp3'"),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data", "non-empty base64 string"),
        ({"type": "input_audio", "input_audio": "AA"}, "input_audio", "expected an object like"),
        ({"type": "audio_url", "audio_url": {}}, "audio_url.url", "expected the audio's URL as a non-empty string"),
        ({"type": "input_audio", "input_audio": {"data": "AA", "format": "wav", "sample_rate": 8000}},
         "input_audio.sample_rate", "not a key of input_audio; accepted: data, format"),
        ({"type": "audio"}, "type", '"audio_url" and "input_audio"'),
    ]:
        with pytest.raises(api.ApiError, match=message) as err:
            request(part)
        assert err.value.param == f"messages[0].content[1].{param}"


# -- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_decode_resamples_to_16k_and_averages_the_channels(fmt):
    ref = MediaRef("audio", "", "messages[0].content[1].input_audio")
    samples = decode_audio(af.encode_audio(fmt, seconds=1.0, rate=44100), ref, MediaLimits(), 16000)
    assert samples.dtype == np.float32 and samples.ndim == 1
    expected = af.tones(1.0, 16000).mean(axis=0)
    # mp3 adds its encoder delay (and frame padding) at the start: align on the best lag.
    lag = 0 if fmt == "wav" else int(np.argmax([np.dot(samples[k:k + 8000], expected[:8000]) for k in range(2000)]))
    assert abs(len(samples) - lag - 16000) <= (2 if fmt == "wav" else 1200)
    n = min(len(samples) - lag, 16000) - 200  # the resampler's filter tail
    error = np.abs(samples[lag + 100:lag + n] - expected[100:n]).max()
    assert error < (2e-3 if fmt == "wav" else 3e-2), error


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_prompt_and_frames_equal_the_processor(folder, preparer, fmt):
    data = [af.encode_audio(fmt, seconds=1.5, rate=22050), af.encode_audio(fmt, seconds=0.4, rate=16000, channels=1)]
    draft = preparer.draft(request(input_audio(data[0], fmt), audio_url(f"data:audio/{fmt};base64,{b64(data[1])}")), {})
    assert isinstance(draft, Draft), draft
    ref = MediaRef("audio", "", "p")
    samples = [decode_audio(d, ref, MediaLimits(), 16000) for d in data]
    expected = processor_reference(folder, preparer, samples, 2)
    assert draft.prepared.prompt_token_ids == expected["input_ids"][0].tolist()
    for item, features, mask in zip(draft.media, expected["input_features"], expected["feature_attention_mask"]):
        num_frames = int(mask.sum())
        assert item.kind == "audio" and item.grid_thw == (1, num_frames, 1)
        ids = draft.prepared.prompt_token_ids
        assert ids[item.token_offset - 1:item.token_offset + item.num_tokens + 1] == \
            [af.AUDIO_BOS] + [af.AUDIO_TOKEN] * item.num_tokens + [af.AUDIO_EOS]
        kept = item.pixel_values.shape[0]
        assert kept == min(3000, 2 * ((num_frames - 1) // 2 + 1) + 1)
        assert torch.equal(item.pixel_values, features[:, :kept].t())
    assert sum(m.num_tokens for m in draft.media) == draft.prepared.prompt_token_ids.count(af.AUDIO_TOKEN)


@pytest.mark.parametrize("num_samples", [1, 159, 160, 161, 16000, 16001, 479_500, 480_000])
def test_features_of_a_short_pad_equal_the_whole_chunks(preparer, num_samples):
    """The extractor over ``features_length`` samples gives the kept frames
    (and the floor the spectrogram's maximum sets) of its whole 30 s chunk,
    bit for bit, clip lengths at hop boundaries and near the chunk's end."""
    from mstar_actors.models.qwen2_audio import audio_frames_kept
    from mstar_actors.prepare.audio_features import features_length

    fe = preparer.feature_extractor
    samples = np.random.default_rng(num_samples).standard_normal(num_samples).astype(np.float32) * 0.1
    samples[: num_samples // 3] *= 1e-6  # quiet stretches, floored at the maximum less 8
    kwargs = dict(sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="np")
    whole = fe(samples, **kwargs)
    short = fe(samples, max_length=features_length(fe, num_samples), **kwargs)
    num_frames = int(whole["attention_mask"][0].sum())
    kept = audio_frames_kept(num_frames, fe.nb_max_frames)
    assert int(short["attention_mask"][0].sum()) == num_frames
    assert short["input_features"].shape[2] >= kept
    assert np.array_equal(short["input_features"][..., :kept], whole["input_features"][..., :kept])


def test_file_url_inside_the_allowed_dir(folder, tmp_path):
    (tmp_path / "clip.wav").write_bytes(af.encode_audio("wav", seconds=0.5))
    limits = MediaLimits(allowed_dir=str(tmp_path))
    prep = load_preparer(af.audio_prepare_info(folder), limits)
    draft = prep.draft(request(audio_url(f"file://{tmp_path}/clip.wav")), {})
    assert isinstance(draft, Draft) and draft.media[0].grid_thw == (1, 50, 1)
    outside = prep.draft(request(audio_url(f"file://{tmp_path}/../clip.wav")), {})
    assert isinstance(outside, Failed) and outside.param == "messages[0].content[1].audio_url"


# -- refusals: 400s naming the part -------------------------------------------------------------


def refusal(preparer, req: NewRequest) -> Failed:
    result = preparer.draft(req, {})
    assert isinstance(result, Failed) and result.status == 400, result
    return result


def test_corrupt_and_silent_files_fail_naming_the_part(preparer):
    bad = refusal(preparer, request(input_audio(b"RIFF\x00\x00junk" * 10)))
    assert bad.param == "messages[0].content[1].input_audio" and "could not decode the audio" in bad.message
    no_audio = refusal(preparer, request(audio_url("data:audio/wav;base64," + png_b64())))
    assert no_audio.param == "messages[0].content[1].audio_url"
    short = refusal(preparer, request(input_audio(af.encode_audio("wav", seconds=0.01, rate=16000, channels=1))))
    assert "too short to give an audio token" in short.message


def png_b64() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(out, format="PNG")
    return b64(out.getvalue())


@pytest.mark.parametrize("limits, parts, index, message", [
    (dict(max_bytes=10_000), [0.1, 1.0], 2, r"the audio is about 441\d\d bytes; this server accepts at most 10000 bytes per item "
                                            r"\(server.max_media_bytes\)"),
    (dict(max_audio_seconds=1.0), [0.5, 1.5], 2, r"the audio is 1.50 s long; this server accepts at most 1 s per clip "
                                                 r"\(server.max_audio_seconds"),
    (dict(), [31.0], 1, r"the audio is 31.00 s long; this server accepts at most 30 s per clip"),  # the extractor's chunk
    (dict(max_items=2), [0.1, 0.1, 0.1], 3, r"the request has 3 media parts; this server accepts at most 2 per request "
                                            r"\(server.max_media_items\)"),
])
def test_each_limit_is_a_400_naming_the_part(folder, limits, parts, index, message):
    prep = load_preparer(af.audio_prepare_info(folder), MediaLimits(**limits))
    req = request(*(input_audio(af.encode_audio("wav", seconds=s, rate=22050, channels=1)) for s in parts))
    result = refusal(prep, req)
    assert result.param == f"messages[0].content[{index}].input_audio"
    assert re.search(message, result.message), result.message


def test_a_clip_of_unknown_length_is_cut_off_while_decoding(folder, monkeypatch):
    """A container that states no duration: the decoded samples are counted."""
    from mstar_actors.prepare import media

    monkeypatch.setattr(media, "_duration_s", lambda container, stream: None)
    prep = load_preparer(af.audio_prepare_info(folder), MediaLimits(max_audio_seconds=1.0))
    result = refusal(prep, request(input_audio(af.encode_audio("wav", seconds=1.5))))
    assert result.param == "messages[0].content[1].input_audio"
    assert "the audio is over 1 s long; this server accepts at most 1 s per clip" in result.message
    assert isinstance(prep.draft(request(input_audio(af.encode_audio("wav", seconds=0.9))), {}), Draft)


def test_other_models_refuse_audio_and_this_one_refuses_images(preparer, tmp_path):
    vl = load_preparer(vl_fixtures.vl_prepare_info(vl_fixtures.save_vl_prepare_folder(tmp_path / "vl")), MediaLimits())
    wav = af.encode_audio("wav", seconds=0.2)
    refused = refusal(vl, request(input_audio(wav)))
    assert refused.param == "messages[0].content[1].input_audio"
    assert "this model takes no audio (input_audio parts); accepted media parts: image_url, video_url" in refused.message
    image = refusal(preparer, request({"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64()}}))
    assert image.param == "messages[0].content[1].image_url"
    assert "this model takes no image (image_url parts); accepted media parts: audio_url, input_audio" in image.message


def test_the_processors_chat_template_wins_over_a_text_one(folder, tmp_path):
    """A folder whose tokenizer template is text-only and whose
    chat_template.json is the processor's (as published checkpoints may be)."""
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    text_only = "{% for m in messages %}<|im_start|> {{ m['content'] if m['content'] is string else '' }} {% endfor %}"
    (tmp_path / "m" / "chat_template.jinja").write_text(text_only)
    config.pop("chat_template", None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    wav = input_audio(af.encode_audio("wav", seconds=0.3))
    plain = load_preparer(af.audio_prepare_info(tmp_path / "m"), MediaLimits())
    assert "the chat template wrote 0 media placeholders for 1 media parts" in refusal(plain, request(wav)).message
    (tmp_path / "m" / "chat_template.json").write_text(json.dumps({"chat_template": af.CHAT_TEMPLATE}))
    draft = load_preparer(af.audio_prepare_info(tmp_path / "m"), MediaLimits()).draft(request(wav), {})
    assert isinstance(draft, Draft) and draft.prepared.prompt_token_ids.count(af.AUDIO_TOKEN) == draft.media[0].num_tokens


def test_preparer_is_parallel_and_text_requests_take_the_plain_path(preparer):
    assert isinstance(preparer, AudioPreparer) and preparer.PREPROCESS_PARALLEL
    draft = preparer.draft(NewRequest(request_id="t", model="audio", sampling=SamplingParams(), prompt="what is this"), {})
    assert isinstance(draft, Draft) and not draft.media and draft.prepared.prompt_param == "prompt"


# -- the actor ---------------------------------------------------------------------------------


async def test_actor_on_a_pool_sends_each_request_once_ready(preparer):
    """The long clip's draft holds back none of the requests sent after it (a text request, a refused
    clip, a short one): each goes when done. (The short clip's order against it is the GIL's: decoding
    holds it, so a short clip's thread may wait out the long one's work; the text request and the refusal
    need no such turn.)"""
    arena = vl_fixtures.HeapArena()
    async with running_prepare_actor(preparer, arena=arena, inbox_bytes=1 << 22) as (inbox, out):
        long_clip, short_clip = af.encode_audio("wav", seconds=8.0), af.encode_audio("mp3", seconds=0.3)
        await inbox.send(request(input_audio(long_clip), rid="a"))  # the longest draft first
        await inbox.send(request(input_audio(b"junk" * 20), rid="b"))
        await inbox.send(request(input_audio(short_clip, "mp3"), rid="c"))
        await inbox.send(NewRequest(request_id="d", model="audio", sampling=SamplingParams(), prompt="what is this"))
        results = [await out.recv() for _ in range(4)]
        order = [r.request_id for r in results]
        assert sorted(order) == ["a", "b", "c", "d"] and order.index("a") > max(order.index("b"), order.index("d"))
        a, b, c, d = sorted(results, key=lambda r: r.request_id)
        assert isinstance(a, Prepared) and a.media[0].kind == "audio" and a.media[0].grid_thw == (1, 800, 1)
        assert tuple(arena.tensors[a.media[0].pixel_values.offset].shape) == a.media[0].pixel_values.shape == (801, 128)
        assert isinstance(b, Failed) and b.status == 400 and b.param == "messages[0].content[1].input_audio"
        assert isinstance(c, Prepared) and isinstance(d, Prepared) and not d.media
        assert a.media_digests != c.media_digests


async def test_actor_fetches_an_audio_url_over_http_under_the_media_rules(preparer, caplog):
    """An ``audio_url`` over http(s) is fetched by the actor under the
    hardening rules (loopback only when allowed) and prepared exactly as the
    same bytes sent inline; a 404, or a refused address, is a 400 naming the part."""
    from aiohttp import web

    from mstar_actors.config import Config, ServerConfig
    from tests.loopback import serving

    clip = af.encode_audio("mp3", seconds=1.5)

    async def handler(request):
        return web.Response(body=clip, content_type="audio/mpeg")

    app = web.Application()
    app.router.add_get("/clip.mp3", handler)
    arena = vl_fixtures.HeapArena()
    async with serving(app) as base:
        for allowed in (True, False):
            config = Config(server=ServerConfig(allow_private_media_addresses=allowed))
            async with running_prepare_actor(preparer, config=config, arena=arena) as (inbox, out):
                await inbox.send(request(audio_url(f"{base}/clip.mp3"), rid="url"))
                await inbox.send(request(input_audio(clip, "mp3"), rid="inline"))
                await inbox.send(request(audio_url(f"{base}/missing.mp3"), rid="404"))
                # each in its turn once its bytes are at hand: fetches end in any order
                results = {msg.request_id: msg for msg in [await out.recv() for _ in range(3)]}
                fetched, inline, missing = results["url"], results["inline"], results["404"]
            assert isinstance(inline, Prepared) and isinstance(missing, Failed) and missing.status == 400
            assert missing.param == "messages[0].content[1].audio_url"
            if not allowed:  # the server is on loopback: refused (the client is not told why: the log says)
                assert isinstance(fetched, Failed) and fetched.status == 400
                assert fetched.param == "messages[0].content[1].audio_url", fetched
                assert "allow_private_media_addresses is off" in caplog.text
                continue
            assert isinstance(fetched, Prepared), fetched
            assert fetched.prompt_token_ids == inline.prompt_token_ids
            assert fetched.media[0].grid_thw == inline.media[0].grid_thw
            assert torch.equal(arena.tensors[fetched.media[0].pixel_values.offset],
                               arena.tensors[inline.media[0].pixel_values.offset])


def test_clips_prepared_in_a_process_equal_the_inline_ones_and_refusals_name_the_part(preparer, monkeypatch):
    """Two processes, each pinned to a CPU, and three threads at once: each
    clip's frames equal the inline ones, through slots that grow for a bigger
    clip (a first slot of 64 KB here) and are unlinked at stop."""
    import concurrent.futures
    import copy
    import os

    from mstar_actors.prepare import clip_processes

    monkeypatch.setattr(clip_processes, "MIN_CLIP_BYTES", 64 << 10)
    in_processes, beside = copy.copy(preparer), copy.copy(preparer)
    cpus = sorted(os.sched_getaffinity(0))[-2:]
    in_processes.start_processes(2, "cliptest", [[cpus[-1]], [cpus[0]]])
    beside.start_processes(1, "cliptest")  # another pool under the same run id: slots of its own
    try:
        pinned = [os.sched_getaffinity(p.process.pid) for p in in_processes.processes.processes]
        assert pinned == [{cpus[-1]}, {cpus[0]}]
        clips = [af.encode_audio("mp3", seconds=1.2, rate=22050), af.encode_audio("wav", seconds=0.5, rate=16000),
                 af.encode_audio("wav", seconds=3.0, rate=44100)]  # 0.5 MB: the slot grows
        assert len(clips[2]) > 4 * (64 << 10) > len(clips[1])
        reqs = [request(input_audio(clip, "mp3" if i == 0 else "wav"), rid=str(i)) for i, clip in enumerate(clips)]
        inline = [preparer.draft(r, {}) for r in reqs]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for _ in range(3):
                for ours, other in zip(inline * 2, pool.map(lambda r: in_processes.draft(r, {}), reqs * 2), strict=True):
                    assert isinstance(other, Draft) and other.prepared.prompt_token_ids == ours.prepared.prompt_token_ids
                    assert other.media[0].grid_thw == ours.media[0].grid_thw
                    assert other.media[0].source_digest == ours.media[0].source_digest
                    assert torch.equal(other.media[0].pixel_values, ours.media[0].pixel_values)
        assert torch.equal(beside.draft(reqs[0], {}).media[0].pixel_values, inline[0].media[0].pixel_values)
        short = refusal(in_processes, request(input_audio(af.encode_audio("wav", seconds=0.01, rate=16000, channels=1))))
        assert short.param == "messages[0].content[1].input_audio" and "too short to give an audio token" in short.message
        slots = [name for name in os.listdir("/dev/shm") if name.startswith("mstar-cliptest-clip")]
        assert 2 <= len(slots) <= 6 and any(not name.endswith(f"-{in_processes.processes.frame_bytes + (64 << 10)}")
                                            for name in slots)
    finally:
        in_processes.stop_processes()
        beside.stop_processes()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("mstar-cliptest-")]


def test_a_clip_process_that_dies_or_hangs_fails_its_clip_naming_the_part_and_is_started_again(preparer,
                                                                                                monkeypatch):
    """The process killed between clips: the next call is a 400 naming its
    part, the process starts again, and the clip after equals the inline
    one. A clip past the time limit (1 ms here) is a 400 too, its process
    restarted."""
    import copy
    import os
    import signal

    from mstar_actors.prepare import clip_processes

    in_processes = copy.copy(preparer)
    in_processes.start_processes(1, "clipdeath")
    try:
        (process,) = in_processes.processes.processes
        req = request(input_audio(af.encode_audio("wav", seconds=1.0, rate=16000)))
        want = preparer.draft(req, {}).media[0].pixel_values
        assert torch.equal(in_processes.draft(req, {}).media[0].pixel_values, want)
        os.kill(process.process.pid, signal.SIGKILL)
        process.process.join()
        dead = in_processes.draft(req, {})
        assert isinstance(dead, Failed) and dead.status == 400 and dead.param == "messages[0].content[1].input_audio"
        assert "the process preparing this audio ended" in dead.message
        assert process.generation == 2 and torch.equal(in_processes.draft(req, {}).media[0].pixel_values, want)

        # 1 us: no process answers a clip that fast (a warm one answered this 1 s wav within 1 ms).
        monkeypatch.setattr(clip_processes, "CLIP_TIMEOUT_S", 1e-6)
        slow = in_processes.draft(req, {})
        assert isinstance(slow, Failed) and slow.status == 400 and slow.param == "messages[0].content[1].input_audio"
        assert "took over 1e-06 s and was stopped" in slow.message
        monkeypatch.setattr(clip_processes, "CLIP_TIMEOUT_S", 60.0)
        # Another clip after it: the stopped clip's frames, had they come late, would differ.
        other = request(input_audio(af.encode_audio("mp3", seconds=0.6, rate=22050), "mp3"))
        got = in_processes.draft(other, {}).media[0].pixel_values
        assert process.generation == 3 and torch.equal(got, preparer.draft(other, {}).media[0].pixel_values)
    finally:
        in_processes.stop_processes()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("mstar-clipdeath-")]


def long_clip_request(rid: str) -> NewRequest:
    """A 30 s 44.1 kHz stereo wav: a clip that takes its process tens of ms or more."""
    return request(input_audio(af.encode_audio("wav", seconds=30.0)), rid=rid)


def test_a_process_killed_under_both_lanes_fails_both_calls_at_once_and_serves_again(preparer):
    """Both lanes' calls wait on the process when it is killed: each reads
    the end of its own pipe at once (none waits for the 60 s limit), each is
    a 400 naming its part or, had it finished first, the inline frames; then
    the restarted process serves both lanes again."""
    import concurrent.futures
    import copy
    import os
    import signal
    import time

    in_processes = copy.copy(preparer)
    in_processes.start_processes(1, "clipboth")
    try:
        (process,) = in_processes.processes.processes
        reqs = [long_clip_request("a"), long_clip_request("b")]
        want = preparer.draft(reqs[0], {}).media[0].pixel_values
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            start = time.perf_counter()
            futures = [pool.submit(in_processes.draft, r, {}) for r in reqs]
            while process.busy < 2:
                assert not futures[0].done(), futures[0].result()
                time.sleep(1e-3)
            os.kill(process.process.pid, signal.SIGKILL)
            results = [f.result() for f in futures]
            assert time.perf_counter() - start < 30
        assert any(isinstance(r, Failed) for r in results)
        for r in results:
            if isinstance(r, Failed):
                assert r.status == 400 and "the process preparing this audio ended" in r.message, r
            else:
                assert torch.equal(r.media[0].pixel_values, want)
        assert process.generation == 2 and process.busy == 0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for r in pool.map(lambda req: in_processes.draft(req, {}), reqs):
                assert torch.equal(r.media[0].pixel_values, want)
    finally:
        in_processes.stop_processes()


def test_closing_with_a_clip_in_flight_ends_every_process_and_leaves_no_segment(preparer):
    import concurrent.futures
    import copy
    import os
    import time

    in_processes = copy.copy(preparer)
    in_processes.start_processes(2, "clipclose")
    pool = in_processes.processes
    reqs = [long_clip_request(str(i)) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        futures = [threads.submit(in_processes.draft, r, {}) for r in reqs]
        while sum(p.busy for p in pool.processes) < 2:
            assert not futures[0].done(), futures[0].result()
            time.sleep(1e-3)
        in_processes.stop_processes()
        results = [f.result() for f in futures]
    assert all(isinstance(r, Failed) and r.status == 400 for r in results[2:]), results  # after the close
    assert not any(p.process.is_alive() for p in pool.processes)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("mstar-clipclose-")]


def _chat(*parts: dict) -> NewRequest:
    body = {"model": "audio", "messages": [{"role": "user", "content": list(parts)}]}
    return NewRequest(request_id="r", model="audio", sampling=SamplingParams(),
                      messages=api.parse_chat(json.dumps(body).encode()).messages)


def test_a_placeholder_spelled_across_text_parts_is_refused_by_its_first_part(preparer):
    """The template joins a message's text parts: "<|AUD" and "IO|>" made the placeholder, a media place with
    no item (taken with no audio part; with one, blamed on the audio part as a template's miscount)."""
    wav = input_audio(af.encode_audio("wav", seconds=0.2))
    for extra in ([], [wav]):
        result = refusal(preparer, _chat({"type": "text", "text": "what <|AUD"}, {"type": "text", "text": "IO|> is"},
                                         *extra))
        assert result.param == "messages[0].content[0].text", result
        assert "the text parts after it, which the chat template joins, spell <|AUDIO|>" in result.message
        assert "send media as audio_url / input_audio parts" in result.message  # this model's parts, not images'
    whole = refusal(preparer, _chat({"type": "text", "text": "a"}, {"type": "text", "text": "b <|AUDIO|>"}))
    assert whole.param == "messages[0].content[1].text" and "holds <|AUDIO|>" in whole.message
    # parts a media part stands between are no one text
    assert isinstance(preparer.draft(_chat({"type": "text", "text": "<|AUD"}, wav, {"type": "text", "text": "IO|>"}),
                                     {}), Draft)
    prompt = preparer.draft(NewRequest(request_id="p", model="audio", sampling=SamplingParams(),
                                       prompt="<|AUDIO|> hi"), {})
    assert prompt.param == "prompt" and "media go in chat audio_url / input_audio parts" in prompt.message


def _float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None, :], format="flt", layout="mono")
        frame.rate = rate
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return out.getvalue()


def test_a_clip_of_nan_samples_is_a_400_and_a_length_just_past_the_limit_says_so(folder, preparer):
    """NaN samples made NaN features and a reply of <unk> whose logprobs read the clamp's floor; a clip of
    1.004 s against a 1 s limit was "1.00 s long; ... at most 1 s"."""
    half = np.sin(np.arange(16000, dtype=np.float32) / 10)
    half[8000:] = np.nan
    result = refusal(preparer, request(input_audio(_float_wav(half))))
    assert result.param == "messages[0].content[1].input_audio"
    assert "samples that are no finite numbers (NaN or infinity)" in result.message
    prep = load_preparer(af.audio_prepare_info(folder), MediaLimits(max_audio_seconds=1.0))
    long = refusal(prep, request(input_audio(af.encode_audio("wav", seconds=1.004, rate=16000, channels=1))))
    assert "the audio is 1.004 s long; this server accepts at most 1 s per clip" in long.message, long.message
