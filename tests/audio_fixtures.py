"""Qwen2-Audio folders and audio files, for the preparation tests and the
prepare benchmark.

``save_audio_prepare_folder`` writes what preparation reads (no weights):
config.json, a word-level tokenizer with Qwen2-Audio's chat template and
audio specials, and the Whisper feature extractor (Qwen2-Audio's own: 128
mel bins, 30 s chunks, unless told). ``encode_audio`` makes a wav or mp3
file of two tones with ``av``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from tests.word_tokenizer import save_word_tokenizer

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = 5, 6, 7
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
WORDS = ["user", "assistant", "system", "what", "is", "this", "sound", "and", "Audio", "1:", "2:"]
# Qwen2-Audio-7B-Instruct's template (as transformers' Qwen2AudioProcessor writes it).
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_audio_prepare_folder(folder: Path, feature_extractor=None) -> Path:
    """What preparation reads from a Qwen2-Audio folder. Returns ``folder``."""
    from transformers import WhisperFeatureExtractor

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + [f"w{i}" for i in range(200)])}
    save_word_tokenizer(folder, vocab, SPECIALS[3:], CHAT_TEMPLATE)
    (feature_extractor or WhisperFeatureExtractor(feature_size=128)).save_pretrained(folder)
    config = {"architectures": ["Qwen2AudioForConditionalGeneration"], "model_type": "qwen2_audio",
              "audio_token_index": AUDIO_TOKEN, "text_config": {"vocab_size": 512, "eos_token_id": 2}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def save_tiny_audio_model(folder: Path) -> Path:
    """A servable tiny random Qwen2-Audio (float32 weights and the 8-bin, 2 s
    feature extractor of the tests' ``audio_factories``), with a tokenizer whose
    audio tokens are the model's ids and covering its whole vocabulary. Returns ``folder``."""
    from tests.models import audio_factories as af

    af.make_hf_audio_model(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4, "<|AUDIO|>": af.AUDIO_TOKEN,
             "<|audio_bos|>": af.AUDIO_BOS, "<|audio_eos|>": af.AUDIO_EOS}
    words = iter(WORDS + [f"x{i}" for i in range(af.VOCAB)])
    taken = set(vocab.values())
    vocab |= {next(words): i for i in range(af.VOCAB) if i not in taken}
    save_word_tokenizer(folder, vocab, SPECIALS[3:], CHAT_TEMPLATE)
    return folder


def audio_prepare_info(folder: Path):
    """The launcher's facts for a ``save_audio_prepare_folder`` folder, stated
    here: it holds no decoder for ``load_model_info`` to read."""
    from mstar_actors.model_info import ModelInfo

    return ModelInfo(served_name="audio", model_dir=str(folder), architecture="Qwen2AudioForConditionalGeneration",
                     vocab_size=512, eos_token_ids=(2,), dtype="float32", max_model_len=1 << 20, is_multimodal=True,
                     media_token_ids={"audio": AUDIO_TOKEN})


def tones(seconds: float, rate: int, channels: int = 2):
    """``[channels, samples]`` float32: 440 Hz on the left, 660 Hz on the right."""
    import numpy as np

    t = np.arange(int(round(seconds * rate))) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)])[:channels].astype(np.float32)


def encode_audio(fmt: str, seconds: float = 1.0, rate: int = 44100, channels: int = 2) -> bytes:
    """A ``wav`` (16-bit PCM) or ``mp3`` file of ``tones``."""
    import av
    import numpy as np

    samples = tones(seconds, rate, channels)
    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream({"wav": "pcm_s16le", "mp3": "libmp3lame"}[fmt], rate=rate)
        stream.layout = "stereo" if channels == 2 else "mono"
        for i in range(0, samples.shape[1], 1152):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, i:i + 1152]), format="fltp",
                                               layout=stream.layout.name)
            frame.rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
