"""The base model's LoRA-targetable modules and their shapes.

An adapter is checked against this before anything reaches a device: every
tensor must name a module listed here and fit its (in_features,
out_features). Module names are Hugging Face's, relative to the decoder's
root: ``self_attn.q_proj`` inside a layer, ``lm_head`` and ``embed_tokens``
outside. For ``embed_tokens`` PEFT's convention holds: in = vocab size,
out = hidden size (``lora_embedding_A`` is [r, vocab]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
EMBEDDING_MODULES = frozenset({"embed_tokens"})

_SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    # Its text stack is the Qwen2 decoder; the vision tower is never a target.
    "Qwen2_5_VLForConditionalGeneration",
    # Its decoder is Qwen2's; the audio encoder and projector are never targets.
    "Qwen2AudioForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
)


class BaseShapesError(ValueError):
    """A config.json whose targetable shapes can't be derived; names the field."""


@dataclass(frozen=True)
class BaseShapes:
    """Per-module (in_features, out_features) of the base model, plus its depth.

    ``layer_modules`` holds one entry per module of every decoder layer (all
    layers share shapes); ``global_modules`` holds ``lm_head`` and
    ``embed_tokens``.
    """

    num_layers: int
    layer_modules: dict[str, tuple[int, int]]
    global_modules: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Informational: a tied lm_head still takes its own LoRA delta.
    tie_word_embeddings: bool = False
    # A hybrid decoder: each layer's kind ("full_attention" / "linear_attention"); empty: one kind.
    layer_types: tuple[str, ...] = ()

    def allows(self, module: str, layer: int) -> str | None:
        """Why layer ``layer`` has no ``module`` (a hybrid decoder's attention
        and linear-attention modules live in their own kinds of layer), or None."""
        if not self.layer_types:
            return None
        kind = self.layer_types[layer]
        is_linear = module.startswith("linear_attn.")
        if is_linear != (kind == "linear_attention") and not module.startswith("mlp."):
            return f"layer {layer} is a {kind} layer, which has no {module}"
        return None

    def shape_of(self, module: str) -> tuple[int, int] | None:
        """(in, out) of a layer module suffix or a global module; None if not targetable."""
        if module in self.layer_modules:
            return self.layer_modules[module]
        return self.global_modules.get(module)

    def targetable(self) -> list[str]:
        return [*self.layer_modules, *self.global_modules]

    @classmethod
    def from_hf_config(cls, config: dict) -> BaseShapes:
        """Shapes of a Llama / Qwen2 / Qwen3 (or Mistral) ``config.json`` dict,
        or of Qwen2.5-VL's text stack.

        A vision-language config's ``text_config`` (transformers 5) overrides
        its top-level fields, which older configs use for the text stack and
        which keep ``tie_word_embeddings`` in either layout.
        """
        cfg = {**config, **(config.get("text_config") or {})}
        archs = config.get("architectures") or []
        if archs and not any(a in _SUPPORTED_ARCHITECTURES for a in archs):
            raise BaseShapesError(
                f"config.json: architectures {archs} have no LoRA shape rules; accepted: {list(_SUPPORTED_ARCHITECTURES)}"
            )
        hidden = _require_int(cfg, "hidden_size")
        heads = _require_int(cfg, "num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = _require_int(cfg, "intermediate_size")
        vocab = _require_int(cfg, "vocab_size")
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        layer = {
            "self_attn.q_proj": (hidden, q_size),
            "self_attn.k_proj": (hidden, kv_size),
            "self_attn.v_proj": (hidden, kv_size),
            "self_attn.o_proj": (q_size, hidden),
            "mlp.gate_proj": (hidden, inter),
            "mlp.up_proj": (hidden, inter),
            "mlp.down_proj": (inter, hidden),
        }
        # A tied lm_head is still its own Linear module in transformers, so
        # PEFT can target it; its LoRA delta is independent of the tie.
        glob = {"lm_head": (hidden, vocab), "embed_tokens": (vocab, hidden)}
        num_layers = _require_int(cfg, "num_hidden_layers")
        layer_types: tuple[str, ...] = ()
        if any(a.startswith("Qwen3_5") for a in archs):
            layer["self_attn.q_proj"] = (hidden, 2 * q_size)  # each head's query and its output gate
            layer.update(_linear_attention_shapes(cfg, hidden))
            from mstar_actors.models.spec import default_layer_types  # the loader's own rule

            layer_types = tuple(default_layer_types(cfg))
        return cls(
            num_layers=num_layers,
            layer_modules=layer,
            global_modules=glob,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_types=layer_types,
        )


def _linear_attention_shapes(cfg: dict, hidden: int) -> dict[str, tuple[int, int]]:
    key = _require_int(cfg, "linear_num_key_heads") * _require_int(cfg, "linear_key_head_dim")
    num_v = _require_int(cfg, "linear_num_value_heads")
    value = num_v * _require_int(cfg, "linear_value_head_dim")
    return {
        "linear_attn.in_proj_qkv": (hidden, 2 * key + value),
        "linear_attn.in_proj_q": (hidden, key),
        "linear_attn.in_proj_k": (hidden, key),
        "linear_attn.in_proj_v": (hidden, value),
        "linear_attn.in_proj_z": (hidden, value),
        "linear_attn.in_proj_b": (hidden, num_v),
        "linear_attn.in_proj_a": (hidden, num_v),
        "linear_attn.out_proj": (value, hidden),
    }


def _require_int(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise BaseShapesError(f"config.json: field {key!r} must be a positive integer, got {value!r}")
    return value
