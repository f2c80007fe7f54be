"""The architectures we serve, each stated once: its config defaults and its
checkpoint rules. Add one here (and, if it differs in structure, a field on
``ModelSpec``) to serve a new decoder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import qwen2_5_vl, qwen2_audio, qwen3_5, qwen3_5_vl
from .checkpoint import DECODER_RULES, IGNORED, QK_NORM_RULES, CheckpointRules


@dataclass(frozen=True)
class Architecture:
    name: str  # the ``architectures[0]`` value in config.json
    qkv_bias: bool  # q/k/v projections carry a bias regardless of attention_bias
    qk_norm: bool  # per-head RMSNorm on q and k before the rotary embedding
    rules: CheckpointRules
    # Vision-language models: the decoder's fields out of config.json (they
    # may be nested), and the model built around the decoder. None: plain CausalLM.
    text_config: Callable[[dict], dict] | None = None
    build: Callable | None = None  # (model_dir, parsed config.json, spec, attention backend, shard layout) -> model
    is_multimodal: bool = False  # takes media parts (its media token ids are in config.json)
    # (parsed config.json, where) -> media kind -> placeholder token id; multimodal only.
    media_token_ids: Callable[[dict, str], dict[str, int]] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("LlamaForCausalLM", qkv_bias=False, qk_norm=False, rules=CheckpointRules(DECODER_RULES, IGNORED)),
        Architecture("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, rules=CheckpointRules(DECODER_RULES, IGNORED)),
        Architecture(
            "Qwen3ForCausalLM",
            qkv_bias=False,
            qk_norm=True,
            rules=CheckpointRules(DECODER_RULES + QK_NORM_RULES, IGNORED),
        ),
        Architecture(
            qwen2_5_vl.ARCHITECTURE,
            qkv_bias=True,
            qk_norm=False,
            rules=CheckpointRules(qwen2_5_vl.QWEN2_5_VL_RULES, IGNORED, qwen2_5_vl.LAYOUT_ALIASES),
            text_config=qwen2_5_vl.text_config,
            build=qwen2_5_vl.build,
            is_multimodal=True,
            media_token_ids=qwen2_5_vl.media_token_ids,
        ),
        Architecture(
            qwen3_5.ARCHITECTURE,
            qkv_bias=False,
            qk_norm=True,
            rules=CheckpointRules(qwen3_5.QWEN3_5_RULES, IGNORED, qwen3_5.LAYOUT_ALIASES, qwen3_5.IGNORED_PREFIXES),
            text_config=qwen3_5.text_config,
            build=qwen3_5.build,
        ),
        Architecture(
            qwen3_5_vl.ARCHITECTURE,
            qkv_bias=False,
            qk_norm=True,
            rules=CheckpointRules(qwen3_5_vl.QWEN3_5_VL_RULES, IGNORED, qwen3_5.LAYOUT_ALIASES, qwen3_5.IGNORED_PREFIXES),
            text_config=qwen3_5.text_config,
            build=qwen3_5_vl.build,
            is_multimodal=True,
            media_token_ids=qwen2_5_vl.media_token_ids,
        ),
        Architecture(
            qwen2_audio.ARCHITECTURE,
            qkv_bias=True,
            qk_norm=False,
            rules=CheckpointRules(qwen2_audio.QWEN2_AUDIO_RULES, IGNORED, qwen2_audio.LAYOUT_ALIASES),
            text_config=qwen2_audio.text_config,
            build=qwen2_audio.build,
            is_multimodal=True,
            media_token_ids=qwen2_audio.media_token_ids,
        ),
    )
}

REFUSED: dict[str, str] = {
    name: "the Qwen3.5 mixture-of-experts family (qwen3_5_moe) is not served yet; serve a dense Qwen3.5 model"
    for name in qwen3_5.MOE_ARCHITECTURES
}
"""Architectures known and refused at start, each with its one-line reason."""
