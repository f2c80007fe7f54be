"""Qwen2-Audio's clip preparation, the part that runs wherever a clip is
prepared (inline in the prepare actor, or in a clip process,
``clip_processes``): decode and resample (``media.decode_audio``), the
Whisper feature extractor over the clip's own length, the kept frames, and
the clip's digest."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mstar_actors.prepare.media import MediaError, MediaLimits, MediaRef, decode_audio, source_digest


def load_feature_extractor(model_dir: Path) -> Any:
    """The model's Whisper feature extractor (Qwen2-Audio's defaults: 128 mel bins, 30 s chunks)."""
    from transformers import WhisperFeatureExtractor

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        return WhisperFeatureExtractor.from_pretrained(str(model_dir), local_files_only=True)
    return WhisperFeatureExtractor(feature_size=128)


def prepare_clip(feature_extractor: Any, data: bytes, param: str, limits: MediaLimits, sampling_rate: int,
                 max_seconds: float) -> tuple[Any, int, int, bytes]:
    """``clip_features`` and the clip's source digest, both where the clip is
    prepared: in a clip process the hash (about 2 ms a MB) stays off the
    process that feeds every clip."""
    return (*clip_features(feature_extractor, data, param, limits, sampling_rate, max_seconds), source_digest(data))


def clip_features(feature_extractor: Any, data: bytes, param: str, limits: MediaLimits, sampling_rate: int,
                  max_seconds: float) -> tuple[Any, int, int]:
    """One clip: decoded and resampled to mono at ``sampling_rate``, then the
    extractor's log-mel frames its valid rows read (numpy ``[frames, mels]``
    float32), the count of valid frames and of audio tokens."""
    from mstar_actors.models.qwen2_audio import audio_frames_kept, audio_num_tokens

    samples = decode_audio(data, MediaRef("audio", "", param), limits, sampling_rate, max_seconds)
    out = feature_extractor(samples, sampling_rate=sampling_rate, return_attention_mask=True, padding="max_length",
                            max_length=features_length(feature_extractor, len(samples)), return_tensors="np")
    num_frames = int(out["attention_mask"][0].sum())
    num_tokens = audio_num_tokens(num_frames)
    if num_tokens < 1:
        raise MediaError(param, f"the audio is {len(samples) / sampling_rate * 1000:.0f} ms long, too short to give "
                                f"an audio token; send at least "
                                f"{3 * feature_extractor.hop_length / sampling_rate * 1000:.0f} ms")
    rows = out["input_features"][0, :, :audio_frames_kept(num_frames, feature_extractor.nb_max_frames)]
    return rows.T.astype("float32", copy=False), num_frames, num_tokens


def features_length(feature_extractor: Any, num_samples: int) -> int:
    """The samples to pad a clip to before the extractor: the clip, the
    frames the model reads past it, and zeros enough that the STFT's
    reflected edge is zeros too, up to the extractor's 30 s chunk. Every
    frame kept is then the one the whole chunk gives (a frame sees only its
    own window), and so is the spectrogram's maximum, which sets its floor
    (the frames past the clip are silence, -10, in both). A 10 s clip then
    costs a third of the chunk's STFT and mel products. The frames come in
    whole tiles of ``_FRAME_TILE``, at least ``_MIN_FRAMES``: a mel product
    only a few frames wide takes another summation path in the BLAS, a last
    bit off the chunk's."""
    hop = feature_extractor.hop_length
    # The kept frames end at most two frames past the clip's (``audio_frames_kept``); one more, and the last window's
    # reflected half, lie wholly in zeros.
    num_frames = max(_MIN_FRAMES, -(-(num_samples + feature_extractor.n_fft // 2 + 1) // hop) + 3)
    num_frames = -(-num_frames // _FRAME_TILE) * _FRAME_TILE
    return min(feature_extractor.n_samples, num_frames * hop)


_MIN_FRAMES, _FRAME_TILE = 64, 32


def silent_wav(sampling_rate: int, num_samples: int) -> bytes:
    """A mono 16-bit PCM wav file of ``num_samples`` zero samples."""
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sampling_rate)
        w.writeframes(bytes(2 * num_samples))
    return out.getvalue()
