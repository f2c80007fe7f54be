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


def _family(module, rules: CheckpointRules, *, qkv_bias: bool, qk_norm: bool,
            text_config: Callable[[dict], dict] | None = None,
            media_token_ids: Callable[[dict, str], dict[str, int]] | None = None) -> Architecture:
    """The architecture a model module builds (its ``ARCHITECTURE``, ``build``
    and, unless given, ``text_config``); multimodal where it has media token ids."""
    return Architecture(module.ARCHITECTURE, qkv_bias=qkv_bias, qk_norm=qk_norm, rules=rules,
                        text_config=text_config or module.text_config, build=module.build,
                        is_multimodal=media_token_ids is not None, media_token_ids=media_token_ids)


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
        _family(qwen2_5_vl, CheckpointRules(qwen2_5_vl.QWEN2_5_VL_RULES, IGNORED, qwen2_5_vl.LAYOUT_ALIASES),
                qkv_bias=True, qk_norm=False, media_token_ids=qwen2_5_vl.media_token_ids),
        _family(qwen3_5, CheckpointRules(qwen3_5.QWEN3_5_RULES, IGNORED, qwen3_5.LAYOUT_ALIASES, qwen3_5.IGNORED_PREFIXES),
                qkv_bias=False, qk_norm=True),
        _family(qwen3_5_vl,
                CheckpointRules(qwen3_5_vl.QWEN3_5_VL_RULES, IGNORED, qwen3_5.LAYOUT_ALIASES, qwen3_5.IGNORED_PREFIXES),
                qkv_bias=False, qk_norm=True, text_config=qwen3_5.text_config, media_token_ids=qwen2_5_vl.media_token_ids),
        _family(qwen2_audio, CheckpointRules(qwen2_audio.QWEN2_AUDIO_RULES, IGNORED, qwen2_audio.LAYOUT_ALIASES),
                qkv_bias=True, qk_norm=False, media_token_ids=qwen2_audio.media_token_ids),
    )
}

REFUSED: dict[str, str] = {
    name: "the Qwen3.5 mixture-of-experts family (qwen3_5_moe) is not served yet; serve a dense Qwen3.5 model"
    for name in qwen3_5.MOE_ARCHITECTURES
}
"""Architectures known and refused at start, each with its one-line reason."""
