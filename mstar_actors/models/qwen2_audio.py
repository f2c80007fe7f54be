"""Qwen2-Audio: a Whisper-style audio encoder (``audio_tower``) and a linear
projector (``multi_modal_projector``) in front of the shared Qwen2 decoder,
whose positions stay plain 1-D rotary.

An audio item is its clip's log-mel frames (the feature extractor's, in rows
of ``num_mel_bins``). The reference encodes every clip padded to the
extractor's whole chunk (``2 * max_source_positions`` frames) and masks the
padding out of attention; a valid output row only sees the frames up to
``2 * num_conv_frames`` (the convolutions' reach), so an item carries just
those (``audio_frames_kept``) and the encoder runs on the valid positions
alone: the same rows, a fraction of the work for a short clip.

For ``num_frames`` valid frames: the stride-2 convolution gives
``(num_frames - 1) // 2 + 1`` positions, the stride-2 pooling after the
layers ``(positions - 2) // 2 + 1`` audio tokens (``audio_num_tokens``, the
processor's count). ``MediaItem.grid_thw`` of an audio item is
``(1, num_frames, 1)``.

Checkpoints come in two layouts, both read through one rule table: the
original (``language_model.model.*``, ``language_model.lm_head``,
``audio_tower.*``, ``multi_modal_projector.*``) and transformers 5's
in-memory one (``model.language_model.*``, ``model.audio_tower.*``, ...);
``LAYOUT_ALIASES`` rewrites both into the decoder's names and ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import PagedAttention, TorchPagedAttention
from .checkpoint import DECODER_RULES, WeightRule
from .decoder import CausalLM
from .media_inputs import MediaSplice
from .sharding import ShardLayout
from .spec import ModelLoadError, ModelSpec

ARCHITECTURE = "Qwen2AudioForConditionalGeneration"

# -- config and checkpoint ----------------------------------------------------------

LAYOUT_ALIASES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head", "lm_head"),
    ("model.language_model.", "model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
"""Either checkpoint layout -> the decoder's names (``model.layers.*``, ``lm_head``) and the encoder's own."""

_B = "audio_tower.layers.{i}"
AUDIO_RULES = [
    WeightRule(name, name)
    for name in (
        "audio_tower.conv1",
        "audio_tower.conv2",
        "audio_tower.embed_positions",
        f"{_B}.self_attn.q_proj",
        f"{_B}.self_attn.k_proj",
        f"{_B}.self_attn.v_proj",
        f"{_B}.self_attn.out_proj",
        f"{_B}.self_attn_layer_norm",
        f"{_B}.fc1",
        f"{_B}.fc2",
        f"{_B}.final_layer_norm",
        "audio_tower.layer_norm",
        "multi_modal_projector.linear",
    )
]
"""The encoder's modules keep their checkpoint names (LoRA targets the decoder only)."""

QWEN2_AUDIO_RULES = DECODER_RULES + AUDIO_RULES


def text_config(cfg: dict) -> dict:
    """The decoder's fields as one flat dict: ``text_config`` over the top
    level (its unset fields, saved as null, leave the top level's)."""
    text = {k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None}
    return {**cfg, **text}


def media_token_ids(cfg: dict, where: str) -> dict[str, int]:
    value = cfg.get("audio_token_index", cfg.get("audio_token_id"))
    if not isinstance(value, int):
        raise ModelLoadError(f"{where}: field 'audio_token_index' is missing")
    return {"audio": value}


@dataclass(frozen=True)
class AudioSpec:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_source_positions: int
    layer_norm_eps: float = 1e-5

    @property
    def max_frames(self) -> int:
        """Mel frames of the extractor's whole chunk (30 s for the released models)."""
        return 2 * self.max_source_positions


def parse_audio_spec(cfg: dict, where: str) -> AudioSpec:
    """From config.json's ``audio_config``; refuses what the encoder can't run."""
    ac = cfg.get("audio_config")
    if not isinstance(ac, dict):
        raise ModelLoadError(f"{where}: field 'audio_config' is missing")
    act = ac.get("activation_function", "gelu")
    if act != "gelu":
        raise ModelLoadError(f"{where}: audio_config.activation_function {act!r} is not supported; accepted: gelu")
    try:
        spec = AudioSpec(
            num_mel_bins=int(ac.get("num_mel_bins", 128)),
            d_model=int(ac["d_model"]),
            num_layers=int(ac["encoder_layers"]),
            num_heads=int(ac["encoder_attention_heads"]),
            ffn_dim=int(ac["encoder_ffn_dim"]),
            max_source_positions=int(ac.get("max_source_positions", 1500)),
        )
    except KeyError as err:
        raise ModelLoadError(f"{where}: field 'audio_config.{err.args[0]}' is missing") from None
    if spec.d_model % spec.num_heads:
        raise ModelLoadError(f"{where}: audio_config d_model={spec.d_model} is not a multiple of "
                             f"encoder_attention_heads={spec.num_heads}")
    return spec


# -- clip geometry (pure) -------------------------------------------------------------


def audio_conv_frames(num_frames: int) -> int:
    """Positions after the stride-2 convolution, for ``num_frames`` valid mel frames."""
    return (num_frames - 1) // 2 + 1


def audio_num_tokens(num_frames: int) -> int:
    """Audio tokens of a clip of ``num_frames`` valid mel frames (``Qwen2AudioProcessor``'s count)."""
    return (audio_conv_frames(num_frames) - 2) // 2 + 1


def audio_frames_kept(num_frames: int, max_frames: int) -> int:
    """The mel frames an item carries: those the valid positions' convolutions
    read (up to frame ``2 * conv_frames``), within the extractor's chunk."""
    return min(max_frames, 2 * audio_conv_frames(num_frames) + 1)


# -- the encoder ----------------------------------------------------------------------


class EncoderAttention(nn.Module):
    """Bidirectional attention over one clip's positions (k_proj has no bias)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, self.num_heads, self.head_dim).transpose(0, 1)

        # q scaled before the product, as the reference does (its rounding).
        q = heads(self.q_proj(x) * self.head_dim**-0.5)
        out = F.scaled_dot_product_attention(q, heads(self.k_proj(x)), heads(self.v_proj(x)), scale=1.0)
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class EncoderLayer(nn.Module):
    def __init__(self, spec: AudioSpec):
        super().__init__()
        self.self_attn = EncoderAttention(spec.d_model, spec.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.fc1 = nn.Linear(spec.d_model, spec.ffn_dim)
        self.fc2 = nn.Linear(spec.ffn_dim, spec.d_model)
        self.final_layer_norm = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """``Qwen2AudioEncoder`` on one clip's valid positions: conv, conv (stride
    2), learned positions, pre-norm layers, pooling (stride 2), a final norm."""

    def __init__(self, spec: AudioSpec):
        super().__init__()
        self.spec = spec
        self.conv1 = nn.Conv1d(spec.num_mel_bins, spec.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(spec.d_model, spec.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(spec.max_source_positions, spec.d_model)
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))
        self.layer_norm = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)

    def forward(self, frames: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``frames [audio_frames_kept(num_frames), num_mel_bins]`` -> ``[audio_num_tokens(num_frames), d_model]``."""
        x = frames.to(self.conv1.weight.dtype).t()[None]  # [1, mel, frames]
        x = F.gelu(self.conv1(x))
        positions = audio_conv_frames(num_frames)
        x = F.gelu(self.conv2(x))[0, :, :positions].t()  # past ``positions``: padding's, masked by the reference
        x = x + self.embed_positions.weight[:positions]
        for layer in self.layers:
            x = layer(x)
        x = F.avg_pool1d(x.t()[None], kernel_size=2, stride=2)[0].t()
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, d_model: int, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(d_model, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


# -- the model ------------------------------------------------------------------------


class Qwen2AudioForConditionalGeneration(MediaSplice, CausalLM):
    """The shared decoder (``model``, ``lm_head``), plus ``audio_tower`` and
    ``multi_modal_projector``.

    ``forward`` takes ``positions [T]`` and, optionally, ``media_rows``: (flat
    row indices, audio rows) that replace those rows' token embeddings before
    the first layer. The encoder is replicated on every rank.
    """

    def __init__(self, spec: ModelSpec, audio: AudioSpec, token_ids: dict[str, int],
                 backend: PagedAttention | None = None, layout: ShardLayout | None = None):
        super().__init__(spec, backend or TorchPagedAttention(), layout)
        self.audio_spec = audio
        self.media_token_ids = dict(token_ids)
        self.audio_tower = AudioEncoder(audio)
        self.multi_modal_projector = Projector(audio.d_model, spec.hidden_size)

    def encode_media(self, frames: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Audio rows for several clips, one encoder call each (clips differ
        in length), ``[sum(audio_num_tokens), hidden]``."""
        rows = [self.audio_tower(f, grid[1]) for f, grid in zip(frames, grids, strict=True)]
        return self.multi_modal_projector(torch.cat(rows))

    def media_item_problem(self, item) -> str | None:
        """Why ``item`` (a ``MediaItem``) does not fit this encoder, or None."""
        _, num_frames, _ = item.grid_thw
        spec = self.audio_spec
        if tuple(item.grid_thw) != (1, num_frames, 1) or not 0 < num_frames <= spec.max_frames:
            return f"grid_thw {list(item.grid_thw)} must be (1, num_frames, 1) with 0 < num_frames <= {spec.max_frames}"
        if item.num_tokens != audio_num_tokens(num_frames) or item.num_tokens < 1:
            return f"num_tokens={item.num_tokens}, but {num_frames} frames give {audio_num_tokens(num_frames)} (at least 1)"
        expected = (audio_frames_kept(num_frames, spec.max_frames), spec.num_mel_bins)
        if tuple(item.pixel_values.shape) != expected:
            return f"pixel_values has shape {list(item.pixel_values.shape)}, expected {list(expected)}"
        return None


def build(model_dir: Path, cfg: dict, spec: ModelSpec, backend: PagedAttention,
          layout: ShardLayout | None = None) -> Qwen2AudioForConditionalGeneration:
    """The loader's constructor for this architecture (the audio fields of the parsed config.json)."""
    where = str(Path(model_dir) / "config.json")
    return Qwen2AudioForConditionalGeneration(spec, parse_audio_spec(cfg, where), media_token_ids(cfg, where),
                                              backend, layout)
