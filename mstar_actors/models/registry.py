"""The architectures we serve, each stated once: its config defaults and its
checkpoint rules. Add one here (and, if it differs in structure, a field on
``ModelSpec``) to serve a new decoder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import qwen2_5_vl
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
        ),
    )
}
