"""A decoder's shape, read once from ``config.json`` and checked.

``ModelSpec`` is everything the shared decoder needs; the per-architecture
differences (q/k/v bias, per-head q/k norm) are fields here, filled from the
architecture's defaults and the config. A config the code can't serve is one
``ModelLoadError`` naming the field and what would be accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder the engine can't serve; the message names the file, field or tensor."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (``rope_type`` "default" or "llama3")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A Gated DeltaNet layer's shape (Qwen3.5's ``linear_attention`` layers)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # A hybrid decoder (Qwen3.5): each layer's kind; empty: every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionSpec | None = None

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep KV in the paged cache (full attention)."""
        return [i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] == FULL_ATTENTION]

    @property
    def state_layers(self) -> list[int]:
        """The layers that keep a recurrent state per sequence (linear attention)."""
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing; a model folder needs config.json in Hugging Face layout") from None
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON: {err}") from None


def _require(cfg: dict, key: str, where: str) -> object:
    if cfg.get(key) is None:
        raise ModelLoadError(f"{where}: field {key!r} is missing")
    return cfg[key]


def parse_rope(cfg: dict, where: str) -> RopeSpec:
    """Accept both ``rope_theta`` + ``rope_scaling`` (transformers 4) and
    ``rope_parameters`` (transformers 5)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported; accepted: default, llama3")
    if rope_type == "default":
        return RopeSpec(theta=float(theta))
    try:
        return RopeSpec(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise ModelLoadError(f"{where}: llama3 rope scaling needs field {err.args[0]!r}") from None


def _check_servable(cfg: dict, where: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported; accepted: silu")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported; accepted: false")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{where}: use_sliding_window=true is not supported; accepted: false")


def _generation_config(model_dir: Path) -> dict:
    """The folder's generation_config.json ({} where it has none)."""
    gen = Path(model_dir) / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        values = json.loads(gen.read_text())
    except ValueError as err:
        raise ModelLoadError(f"{gen}: not JSON ({err}); mend it or remove it") from None
    if not isinstance(values, dict):
        raise ModelLoadError(f"{gen}: expected a JSON object, got {type(values).__name__}; mend it or remove it")
    return values


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    """EOS ids from config.json and generation_config.json (union, in order):
    the one EOS rule; the ranks stop on these and ``ModelInfo`` carries them."""
    found: list[int] = []
    sources = [cfg, _generation_config(model_dir)]
    for src in sources:
        value = src.get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if isinstance(tok, int) and tok not in found:
                found.append(tok)
    return found


# transformers' defaults of the sampling fields a generation config may set: a value equal to its default is
# none the model asked for (as vLLM reads the file: ``GenerationConfig.to_diff_dict``).
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                        "max_new_tokens": None}


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults the model's generation_config.json asks for,
    named as a request names them (``max_new_tokens`` is ``max_tokens``):
    vLLM's ``--generation-config auto``, which serves a request that leaves
    out temperature, top_p, top_k, min_p, repetition_penalty or max_tokens
    with the model's. ``do_sample`` is not read, as vLLM reads none (a
    request's temperature 0 is greedy)."""
    gen, found = _generation_config(Path(model_dir)), {}
    for name, default in _GENERATION_DEFAULTS.items():
        value = gen.get(name)
        if value is None or (value == default and not isinstance(value, bool)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{Path(model_dir) / 'generation_config.json'}: {name} must be a number, got "
                                 f"{value!r}; mend it, or set model.generation_config: none to serve without it")
        if name in ("top_k", "max_new_tokens") and isinstance(value, float) and value.is_integer():
            value = int(value)  # (300.0: a count, which crosses to the ranks as an integer)
        found["max_tokens" if name == "max_new_tokens" else name] = value
    return found


def parse_spec(model_dir: Path, cfg: dict, *, qkv_bias: bool, qk_norm: bool) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json; architecture defaults for
    the bias and the q/k norm come from the caller's table."""
    where = f"{Path(model_dir) / 'config.json'}"
    _check_servable(cfg, where)
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    attention_bias = bool(cfg.get("attention_bias", False))
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    layer_types, linear = _layer_types(cfg, num_layers, where)
    return ModelSpec(
        architecture=cfg["architectures"][0],
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=parse_rope(cfg, where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        qk_norm=qk_norm,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        layer_types=layer_types,
        linear_attention=linear,
    )


def default_layer_types(cfg: dict) -> list[str]:
    """``layer_types`` of a hybrid config, or the family's default when it
    gives none: every ``full_attention_interval``-th layer (4th by default)
    full attention, the others linear attention."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = int(cfg.get("full_attention_interval", 4))
    return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(int(cfg.get("num_hidden_layers", 0)))]


def _layer_types(cfg: dict, num_layers: int, where: str) -> tuple[tuple[str, ...], LinearAttentionSpec | None]:
    """``config.layer_types`` (a hybrid decoder's) and its linear-attention shape; ((), None) without."""
    types = tuple(cfg.get("layer_types") or ())
    if not types:
        return (), None
    if len(types) != num_layers or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in types):
        raise ModelLoadError(f"{where}: layer_types must list {num_layers} entries, each "
                             f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}; got {list(types)}")
    if LINEAR_ATTENTION not in types:
        return types, None
    linear = LinearAttentionSpec(
        num_k_heads=int(_require(cfg, "linear_num_key_heads", where)),
        num_v_heads=int(_require(cfg, "linear_num_value_heads", where)),
        k_head_dim=int(_require(cfg, "linear_key_head_dim", where)),
        v_head_dim=int(_require(cfg, "linear_value_head_dim", where)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ModelLoadError(f"{where}: linear_num_value_heads={linear.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={linear.num_k_heads}")
    return types, linear
