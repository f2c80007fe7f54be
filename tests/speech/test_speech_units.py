"""Orpheus's token format, the window plan, the speech body and the codec
folder, each alone (no server)."""

from __future__ import annotations

import io
import json
import wave

import msgspec
import pytest

from mstar_actors.config import ConfigError, SpeechConfig, parse_config
from mstar_actors.frontend.openai_api import ApiError
from mstar_actors.frontend.speech_api import parse_speech, sse_delta, sse_done, wav_header
from mstar_actors.speech.orpheus import (FrameReader, OrpheusFormatError, OrpheusTokens, Window, WindowPlan,
                                         codebook_rows)

K = 8  # codebook size of these tests


def vocab(num_codes: int = 7 * K, gap_at: int | None = None) -> dict[str, int]:
    names = ["<|eot_id|>"] + [f"<custom_token_{i}>" for i in range(10 + num_codes)]
    ids = list(range(100, 100 + len(names)))
    if gap_at is not None:
        ids = ids[:11 + gap_at] + [i + 1 for i in ids[11 + gap_at:]]
    return dict(zip(names, ids))


def tokens() -> OrpheusTokens:
    return OrpheusTokens.from_vocab(vocab(), K)


def code(t: OrpheusTokens, slot: int, c: int) -> int:
    return t.code_base + slot * K + c


def test_token_ids_come_from_the_vocabulary_by_name():
    t = tokens()
    v = vocab()
    assert (t.start_of_human, t.end_of_human, t.start_of_ai, t.start_of_speech, t.end_of_speech) == tuple(
        v[f"<custom_token_{i}>"] for i in (3, 4, 5, 1, 2))
    assert t.code_base == v["<custom_token_10>"] and t.code_end == t.code_base + 7 * K
    assert t.prompt_ids([7, 8]) == [t.start_of_human, 7, 8, v["<|eot_id|>"], t.end_of_human, t.start_of_ai,
                                    t.start_of_speech]


def test_a_vocabulary_without_the_format_is_refused_by_name():
    with pytest.raises(OrpheusFormatError, match="no <custom_token_10> token"):
        OrpheusTokens.from_vocab({"<|eot_id|>": 1}, K)
    with pytest.raises(OrpheusFormatError, match="<custom_token_13> is not id"):
        OrpheusTokens.from_vocab(vocab(gap_at=3), K)
    with pytest.raises(OrpheusFormatError, match="must be consecutive"):
        OrpheusTokens.from_vocab(vocab(num_codes=7 * K - 1), K)


def test_frames_skip_framing_tokens_and_drop_a_misaligned_frame():
    t = tokens()
    reader = FrameReader(t)
    first = [code(t, s, s + 1) for s in range(7)]
    assert reader.feed([t.start_of_speech, *first[:3]]) == []
    assert reader.feed(first[3:]) == [(1, 2, 3, 4, 5, 6, 7)]
    misaligned = [code(t, 1, 0)] + [code(t, s, 0) for s in range(1, 7)]  # slot 1's token in slot 0
    assert reader.feed(misaligned) == [] and reader.num_dropped_frames == 1
    assert reader.feed([code(t, s, K - 1) for s in range(7)] + [t.end_of_speech]) == [(K - 1,) * 7]


def test_codebook_rows_follow_the_frame_layout():
    assert codebook_rows([(0, 1, 2, 3, 4, 5, 6), (10, 11, 12, 13, 14, 15, 16)]) == [
        [0, 10], [1, 4, 11, 14], [2, 3, 5, 6, 12, 13, 15, 16]]


@pytest.mark.parametrize("num_frames", [0, 1, 3, 4, 5, 9])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_the_window_plan_sends_every_frame_once_in_order(num_frames, batch):
    plan, sent, first_sent_at = WindowPlan(), [], None
    for start in range(0, num_frames, batch):
        for w in plan.add(min(batch, num_frames - start)):
            assert w.num_frames == 4 and w.first + 4 <= plan.num_frames
            sent += [w.first + p for p in range(w.emit_from, w.emit_to)]
            first_sent_at = first_sent_at or plan.num_frames
    last = plan.finish()
    if last is not None:
        sent += [last.first + p for p in range(last.emit_from, last.emit_to)]
    assert sent == list(range(num_frames))
    if num_frames >= 4:
        assert first_sent_at <= 4 + batch - 1  # audio leaves once four frames are in


def test_middle_frames_see_one_frame_before_and_two_after():
    plan = WindowPlan()
    windows = plan.add(8)  # frames 0 and 1 from the first window, then frame m from window [m-1, m+2]
    assert [(w.first, w.emit_from, w.emit_to) for w in windows] == [(0, 0, 2)] + [(m - 1, 1, 2) for m in range(2, 6)]
    assert plan.finish() == Window(4, 4, 2, 4)  # the last two frames, from the last window


CONFIG = SpeechConfig(snac_path="/x")


def speech(**body):
    return parse_speech(json.dumps({"input": "Hi there.", "voice": "tara"} | body).encode(), CONFIG, 256)


def test_speech_body_defaults_and_extensions():
    s = speech(model="tiny-fr")
    assert (s.model, s.voice, s.response_format, s.stream_format, s.text) == ("tiny-fr", "tara", "wav", "audio",
                                                                              "Hi there.")
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.repetition_penalty, s.sampling.max_tokens) == (
        0.6, 0.8, 1.3, 256)  # max_tokens capped by the context
    # by default a reply runs to the context (the whole input spoken, as OpenAI's); the operator's cap, if set
    long = parse_speech(json.dumps({"input": "Hi.", "voice": "tara"}).encode(), CONFIG, 8192)
    assert long.sampling.max_tokens == 8192 and long.sampling.cut_to_context
    capped = parse_speech(json.dumps({"input": "Hi.", "voice": "tara"}).encode(),
                          msgspec.structs.replace(CONFIG, max_tokens=1200), 8192)
    assert capped.sampling.max_tokens == 1200
    s = speech(temperature=0, top_k=5, seed=3, max_tokens=70, response_format="pcm", stream_format="sse", speed=1.0,
               instructions="")
    assert (s.sampling.temperature, s.sampling.top_k, s.sampling.seed, s.sampling.max_tokens) == (0.0, 5, 3, 70)
    assert (s.response_format, s.stream_format) == ("pcm", "sse")
    assert speech(repetition_penalty=2.5).sampling.repetition_penalty == 2.5  # any positive number, as a chat's


@pytest.mark.parametrize("body, param", [
    ({"voice": "Tara"}, "voice"), ({"voice": {"id": "voice_1"}}, "voice"), ({"input": "x" * 4097}, "input"),
    ({"input": 3}, "input"), ({"response_format": "flac"}, "response_format"), ({"speed": True}, "speed"),
    ({"stream": True}, "stream"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0}, "top_p"),
])
def test_speech_body_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        speech(**body)
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(param)


def test_the_wav_header_reads_back():
    pcm = bytes(range(200))
    with wave.open(io.BytesIO(wav_header(24000) + pcm)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.readframes(1000) == pcm


def test_sse_events():
    assert sse_delta(b"\x01\x02") == b'data: {"type":"speech.audio.delta","audio":"AQI="}\n\n'
    assert json.loads(sse_done(3, 4)[6:])["usage"] == {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}


def test_speech_config_keys_are_checked():
    assert parse_config({"speech": {"snac_path": "/s", "voices": ["a"]}}).speech.voices == ["a"]
    with pytest.raises(ConfigError, match="speech"):
        parse_config({"speech": {"snac": "/s"}})
    assert msgspec.structs.asdict(parse_config({}).speech)["snac_path"] is None


def test_codec_folders_that_cannot_decode_orpheus_are_refused(tmp_path):
    pytest.importorskip("snac")
    from mstar_actors.speech.snac_codec import CodecLoadError, SnacCodec

    with pytest.raises(CodecLoadError, match="config.json"):
        SnacCodec.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vq_strides": [8, 4, 2, 1]}))
    with pytest.raises(CodecLoadError, match=r"vq_strides \[4, 2, 1\]"):
        SnacCodec.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vq_strides": [4, 2, 1]}))
    with pytest.raises(CodecLoadError, match="pytorch_model.bin"):
        SnacCodec.load(tmp_path)


def test_a_codec_folder_is_checked_before_the_actors_and_a_misfit_is_the_operators_one_line(tmp_path):
    """The command checks the SNAC folder before any actor starts (it failed
    13 s in, inside the frontend, with a traceback); what only the frontend
    can find (the served model writes no Orpheus tokens) is a ConfigError:
    one line, exit 2."""
    from actors.frontend import _load_speech
    from mstar_actors.config import ConfigError
    from mstar_actors.speech.snac_codec import CodecLoadError, check_folder
    from tests.speech.speech_factories import save_tiny_snac

    with pytest.raises(CodecLoadError, match="is not a folder"):
        check_folder(tmp_path / "absent")
    with pytest.raises(CodecLoadError, match="config.json"):
        check_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vq_strides": [4, 2, 1]}))
    with pytest.raises(CodecLoadError, match="pytorch_model.bin"):
        check_folder(tmp_path)
    pytest.importorskip("snac")

    class PlainTokenizer:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    with pytest.raises(ConfigError, match="speech.snac_path"):
        _load_speech(parse_config({"speech": {"snac_path": str(tmp_path)}}).speech, PlainTokenizer(), 100)
    snac_dir = tmp_path / "snac"
    save_tiny_snac(snac_dir)
    check_folder(snac_dir)

    with pytest.raises(ConfigError, match="does not write Orpheus's codec tokens"):
        _load_speech(parse_config({"speech": {"snac_path": str(snac_dir), "codec_device": "cpu"}}).speech,
                     PlainTokenizer(), 100)
