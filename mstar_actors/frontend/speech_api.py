"""``POST /v1/audio/speech`` (OpenAI's body): validation and the response's bytes. Pure, no I/O.

Fields: ``model`` (the base or an adapter, as on text), ``input``, ``voice``
(one of ``speech.voices``), ``response_format`` (``wav`` or ``pcm``: 16-bit
little-endian mono at the codec's rate; OpenAI's default ``mp3`` is not
made here, so the default is ``wav``), ``stream_format`` (``audio``: the
file's bytes as they are made; ``sse``: ``speech.audio.delta`` events of
base64 bytes, then ``speech.audio.done`` with usage). ``speed`` and
``instructions`` are taken only at their neutral values. The sampling
extensions ``temperature``, ``top_p``, ``repetition_penalty`` and ``max_tokens``
(codec tokens) default to ``speech.*``; ``top_k`` to none, ``seed`` to a fresh draw.

A streamed WAV can't know its length when its header leaves, so both of its
sizes are 0xFFFFFFFF (as streamed WAV is written): readers take the data to
the end of the file.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from mstar_actors.frontend.openai_api import (
    ApiError,
    decode_body,
    draw_fields,
    get_int,
    get_str,
)
from mstar_actors.messages import SamplingParams
from mstar_actors.speech.orpheus import FRAME_TOKENS

if TYPE_CHECKING:
    from mstar_actors.config import SpeechConfig

MAX_INPUT_CHARS = 4096  # OpenAI's limit
RESPONSE_FORMATS = ("wav", "pcm")
OPENAI_ONLY_FORMATS = ("mp3", "opus", "aac", "flac")
STREAM_FORMATS = ("audio", "sse")
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}

SPEECH_FIELDS = frozenset({
    "model", "input", "voice", "response_format", "stream_format", "speed", "instructions",
    "temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens",
})
# Would change the output and are not implemented: taken only at these values.
NEUTRAL_VALUES = {"speed": (1, 1.0), "instructions": ("",)}

_json = msgspec.json.Encoder()


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class SpeechRequest:
    model: str | None
    text: str
    voice: str
    response_format: str
    stream_format: str
    sampling: SamplingParams  # its stop tokens are the frontend's to add (the model's end of speech)


def parse_speech(raw: bytes, config: SpeechConfig, max_model_len: int | None = None) -> SpeechRequest:
    """Validate a speech body (raises ApiError naming the field)."""
    body = decode_body(raw)
    _check_fields(body)
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise _bad("input", "expected the text to speak, a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        raise _bad("input", f"{len(text)} characters; at most {MAX_INPUT_CHARS}")
    return SpeechRequest(
        model=get_str(body, "model", None),
        text=text,
        voice=_voice(body, config.voices),
        response_format=_choice(body, "response_format", "wav", RESPONSE_FORMATS),
        stream_format=_choice(body, "stream_format", "audio", STREAM_FORMATS),
        sampling=_sampling(body, config, max_model_len),
    )


def _check_fields(body: dict) -> None:
    for name, value in body.items():
        if name in NEUTRAL_VALUES:
            if value is not None and (isinstance(value, bool) or value not in NEUTRAL_VALUES[name]):
                raise _bad(name, f"not supported by this server (it would change the output); "
                                 f"only {NEUTRAL_VALUES[name][-1]!r} is")
        elif name not in SPEECH_FIELDS:
            raise _bad(name, f"unknown field for /v1/audio/speech; accepted: {', '.join(sorted(SPEECH_FIELDS))}")


def _voice(body: dict, voices: list[str]) -> str:
    voice = body.get("voice")
    if voice not in voices:  # also a custom-voice object {"id": ...}: none are served
        shown = repr(voice) if isinstance(voice, str) else "missing" if voice is None else "not a voice name"
        raise _bad("voice", f"{shown[:60]}; accepted voices: {', '.join(voices)}")
    return voice


def _choice(body: dict, name: str, default: str, accepted: tuple[str, ...]) -> str:
    value = body.get(name)
    if value is None:
        return default
    if value in accepted:
        return value
    why = "not made by this server" if value in OPENAI_ONLY_FORMATS else "not a format"
    raise _bad(name, f"{value!r} is {why}; accepted: {', '.join(accepted)}" if isinstance(value, str)
               else f"expected one of {', '.join(accepted)}")


def _sampling(body: dict, config: SpeechConfig, max_model_len: int | None) -> SamplingParams:
    hi = max_model_len or 1 << 31
    asked = get_int(body, "max_tokens", None, FRAME_TOKENS, hi)  # fewer write no frame of audio
    return SamplingParams(
        max_tokens=min(asked if asked is not None else config.max_tokens or hi, hi),
        cut_to_context=asked is None,  # speech.max_tokens or the context, a default: cut to what the prompt leaves
        **draw_fields(body, config.temperature, config.top_p, config.repetition_penalty),
    )


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono PCM WAV header of unknown length (see the module docstring)."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))


def sse_delta(audio: bytes) -> bytes:
    return _event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()})


def sse_done(num_input_tokens: int, num_output_tokens: int) -> bytes:
    usage = {"input_tokens": num_input_tokens, "output_tokens": num_output_tokens,
             "total_tokens": num_input_tokens + num_output_tokens}
    return _event({"type": "speech.audio.done", "usage": usage})


def sse_error(err: ApiError) -> bytes:
    return _event({"type": "error", **err.envelope()})


def _event(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"
