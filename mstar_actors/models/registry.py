"""The architectures we serve, each stated once: its config defaults and its
checkpoint rules. Add one here (and, if it differs in structure, a field on
``ModelSpec``) to serve a new decoder."""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import DECODER_RULES, IGNORED, QK_NORM_RULES, CheckpointRules


@dataclass(frozen=True)
class Architecture:
    name: str  # the ``architectures[0]`` value in config.json
    qkv_bias: bool  # q/k/v projections carry a bias regardless of attention_bias
    qk_norm: bool  # per-head RMSNorm on q and k before the rotary embedding
    rules: CheckpointRules


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
    )
}
