"""Checkpoint rules: how Hugging Face module names map onto ours.

Each architecture states its rules once, as a table of ``WeightRule``s. The
weight loader uses them to place every checkpoint tensor, and the LoRA code
uses the same table to place adapter weights: an adapter's
``model.layers.3.self_attn.k_proj`` lands in our
``model.layers.3.self_attn.qkv_proj`` as shard 1.

Shards: our fused modules (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up)
stack several HF projections along the output dimension. The fused module has
``output_sizes`` (one per shard) and ``shard_slice(i)`` giving rows
``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = "{i}"


@dataclass(frozen=True)
class WeightRule:
    """One HF module -> one of our modules (and the shard inside it).

    ``{i}`` in both names stands for the layer index. ``span``: the HF module
    fills that many consecutive shards from ``shard`` (a projection the
    checkpoint already fuses, inside one we fuse further). ``for_adapters``:
    a name adapters may use but checkpoints never hold (split projections of
    one the checkpoint fuses); the loader skips it.
    """

    hf: str
    ours: str
    shard: int | None = None
    span: int = 1
    for_adapters: bool = False


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(re.escape(_LAYER), r"(\d+)") + r"$")


class CheckpointRules:
    """A compiled rule table; ``ignored`` lists HF tensor patterns to skip
    (e.g. precomputed rotary buffers some checkpoints carry); ``aliases``
    (prefix, replacement) pairs rewrite another checkpoint layout of the same
    model into the one the rules name, before any lookup."""

    def __init__(self, rules: list[WeightRule], ignored: tuple[str, ...] = (), aliases: tuple[tuple[str, str], ...] = (),
                 ignored_prefixes: tuple[str, ...] = ()):
        self.rules = list(rules)
        self.aliases = tuple(aliases)
        self.ignored_prefixes = tuple(ignored_prefixes)
        self._forward = [(_pattern(r.hf), r) for r in self.rules]
        self._reverse = [(_pattern(r.ours), r) for r in self.rules]
        self._ignored = [_pattern(p) for p in ignored]

    def place(self, hf_module: str) -> tuple[str, int | None, int] | None:
        """``model.layers.3.self_attn.k_proj`` -> ``("model.layers.3.self_attn.qkv_proj", 1, 1)``:
        our module, the first shard it fills and how many; None when no rule
        matches (the caller decides whether that is an error)."""
        hf_module = self.canonical(hf_module.removeprefix("base_model.model."))  # PEFT's wrapper prefix
        for pattern, rule in self._forward:
            m = pattern.match(hf_module)
            if m:
                return _fill(rule.ours, m), rule.shard, rule.span
        return None

    def map_module(self, hf_module: str) -> tuple[str, int | None] | None:
        """``place`` without the span: ``("model.layers.3.self_attn.qkv_proj", 1)``."""
        placed = self.place(hf_module)
        return None if placed is None else placed[:2]

    def map_tensor(self, hf_name: str) -> tuple[str, int | None] | None:
        """``...k_proj.weight`` -> ``("...qkv_proj.weight", 1)``."""
        module, _, leaf = hf_name.rpartition(".")
        mapped = self.map_module(module)
        if mapped is None:
            return None
        return f"{mapped[0]}.{leaf}", mapped[1]

    def checkpoint_parts(self, our_module: str) -> list[tuple[str, int | None, int]]:
        """The checkpoint modules that fill ``our_module``: ``(HF module, first
        shard, shards)`` each (shard None: all of it), adapter-only names left out."""
        return [(_fill(rule.hf, m), rule.shard, rule.span) for pattern, rule in self._reverse
                if not rule.for_adapters and (m := pattern.match(our_module))]

    def rules_for(self, our_module: str) -> list[WeightRule]:
        """The rules that fill ``our_module`` (every shard's, the whole's)."""
        return [rule for pattern, rule in self._reverse if pattern.match(our_module)]

    def canonical(self, hf_name: str) -> str:
        """``hf_name`` in the layout the rules name (the first matching alias applied)."""
        for prefix, replacement in self.aliases:
            if hf_name.startswith(prefix):
                return replacement + hf_name[len(prefix) :]
        return hf_name

    def is_ignored(self, hf_name: str) -> bool:
        return hf_name.startswith(self.ignored_prefixes) or any(p.match(hf_name) for p in self._ignored)


def _fill(template: str, match: re.Match) -> str:
    return template.replace(_LAYER, match.group(1)) if match.groups() else template


_L = "model.layers.{i}"

DECODER_RULES = [
    WeightRule("model.embed_tokens", "model.embed_tokens"),
    WeightRule(f"{_L}.self_attn.q_proj", f"{_L}.self_attn.qkv_proj", 0),
    WeightRule(f"{_L}.self_attn.k_proj", f"{_L}.self_attn.qkv_proj", 1),
    WeightRule(f"{_L}.self_attn.v_proj", f"{_L}.self_attn.qkv_proj", 2),
    WeightRule(f"{_L}.self_attn.o_proj", f"{_L}.self_attn.o_proj"),
    WeightRule(f"{_L}.mlp.gate_proj", f"{_L}.mlp.gate_up_proj", 0),
    WeightRule(f"{_L}.mlp.up_proj", f"{_L}.mlp.gate_up_proj", 1),
    WeightRule(f"{_L}.mlp.down_proj", f"{_L}.mlp.down_proj"),
    WeightRule(f"{_L}.input_layernorm", f"{_L}.input_layernorm"),
    WeightRule(f"{_L}.post_attention_layernorm", f"{_L}.post_attention_layernorm"),
    WeightRule("model.norm", "model.norm"),
    WeightRule("lm_head", "lm_head"),
]
"""Llama / Qwen2 (Qwen2 adds biases on q/k/v: same module names)."""

QK_NORM_RULES = [
    WeightRule(f"{_L}.self_attn.q_norm", f"{_L}.self_attn.q_norm"),
    WeightRule(f"{_L}.self_attn.k_norm", f"{_L}.self_attn.k_norm"),
]
"""Qwen3's per-head RMSNorm on q and k."""

IGNORED = (f"{_L}.self_attn.rotary_emb.inv_freq",)
