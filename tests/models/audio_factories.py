"""A tiny random Qwen2-Audio saved to a folder (with a Whisper feature
extractor of a 2 s chunk and 8 mel bins, so a clip is a few hundred frames),
and hand-built audio items with the shapes preparation produces."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

from mstar_actors import messages
from mstar_actors.models.qwen2_audio import audio_frames_kept, audio_num_tokens

from .factories import _spread_weights, multimodal_text_config

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = 300, 301, 302
VOCAB = 320
NUM_MEL_BINS = 8
CHUNK_SECONDS = 2
MAX_FRAMES = CHUNK_SECONDS * 100  # 10 ms hops
SAMPLING_RATE = 16000


def make_audio_config() -> Qwen2AudioConfig:
    text = multimodal_text_config(VOCAB, tie_word_embeddings=False)
    audio = dict(
        num_mel_bins=NUM_MEL_BINS,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        d_model=16,
        max_source_positions=MAX_FRAMES // 2,
    )
    return Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=AUDIO_TOKEN)


def make_feature_extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=CHUNK_SECONDS)


def make_hf_audio_model(folder: Path, seed: int = 0) -> Qwen2AudioForConditionalGeneration:
    """Save a random float32 Qwen2-Audio and its feature extractor to ``folder``; return it (eval mode)."""
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(make_audio_config()).to(torch.float32).eval()
    _spread_weights(model)
    with torch.no_grad():  # keep the encoder's activations moderate
        for name, p in model.model.audio_tower.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    make_feature_extractor().save_pretrained(folder)
    return model


def make_frames(num_frames: int, seed: int) -> torch.Tensor:
    """Random log-mel frames as an item carries them: the kept frames, one row each."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(audio_frames_kept(num_frames, MAX_FRAMES), NUM_MEL_BINS, generator=gen)


def padded_features(frames: torch.Tensor, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's inputs for one item: ``[1, mel, MAX_FRAMES]`` features
    (the kept frames, then noise: no valid row may depend on it) and the
    feature attention mask of ``num_frames`` ones."""
    features = 3.0 * torch.randn(1, NUM_MEL_BINS, MAX_FRAMES, generator=torch.Generator().manual_seed(num_frames))
    features[0, :, : frames.shape[0]] = frames.t()
    mask = torch.zeros(1, MAX_FRAMES, dtype=torch.long)
    mask[0, :num_frames] = 1
    return features, mask


def audio_item(ref: messages.TensorRef, num_frames: int, token_offset: int) -> messages.MediaItem:
    return messages.MediaItem("audio", ref, (1, num_frames, 1), token_offset, audio_num_tokens(num_frames))
