"""Tiny random base models and PEFT adapters saved to a tmp dir."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mstar_actors.lora import BaseShapes

_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # Qwen3 with head_dim * heads != hidden: q/o shapes differ from hidden.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
}


def make_base(arch: str = "llama", *, seed: int = 0, **overrides):
    """(model, config dict) of a tiny random decoder."""
    config_cls, model_cls, extra = _ARCHS[arch]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        tie_word_embeddings=False,
        **extra,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config_dict = config.to_dict()
    config_dict["architectures"] = [model_cls.__name__]
    return model_cls(config).eval(), config_dict


def base_shapes(config_dict: dict) -> BaseShapes:
    return BaseShapes.from_hf_config(config_dict)


def make_adapter(tmp: Path, model, *, seed: int = 1, name: str = "ad", **lora_kwargs):
    """Wrap ``model`` with a random (non-zero B) PEFT LoRA, save it; returns (folder, peft_model)."""
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    lora_kwargs.setdefault("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    folder = Path(tmp) / name
    peft_model.save_pretrained(str(folder))
    return folder, peft_model.eval()


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A hand-made adapter folder (for layouts PEFT won't write)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def edit_adapter(folder: Path, *, config: dict | None = None, tensors: dict | None = None, drop=()) -> None:
    """Rewrite a saved adapter: merge ``config`` keys, add ``tensors``, drop keys."""
    cfg_path = folder / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config or {})
    cfg_path.write_text(json.dumps(cfg))
    st_path = folder / "adapter_model.safetensors"
    weights = {k: v for k, v in load_file(str(st_path)).items() if k not in drop}
    weights.update(tensors or {})
    save_file(weights, str(st_path))


def lora_layer(peft_model, hf_module: str):
    """The PEFT LoRA layer wrapping ``hf_module`` (e.g. "model.layers.0.self_attn.q_proj")."""
    return peft_model.base_model.model.get_submodule(hf_module)


# PEFT matches a string target as a full-name regex: a multimodal model's language model linears only.
TEXT_STACK = r"lm_head|.*language_model\.embed_tokens|.*language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"


def make_saved_peft(model_cls, base_folder: Path, adapter_folder: Path, *, seed: int, **lora_kwargs):
    """A PEFT model (eval mode) with random non-zero factors on a fresh
    ``model_cls`` copy of the base, saved to ``adapter_folder``."""
    model = model_cls.from_pretrained(base_folder, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.25)  # PEFT starts B at zero; a zero adapter would prove nothing
    peft_model.save_pretrained(str(adapter_folder))
    return peft_model


def served_shapes(folder: Path) -> BaseShapes:
    """The LoRA shapes the launcher hands the adapter reader for ``folder``."""
    from mstar_actors.config import parse_config
    from mstar_actors.model_info import load_model_info

    return load_model_info(parse_config({"model": {"path": str(folder)}})).lora_base


def save_renamed_adapter(source: Path, folder: Path, rename) -> None:
    """``source``'s adapter in ``folder``, each tensor's key passed through ``rename``."""
    tensors = load_file(source / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    save_file({rename(k): v for k, v in tensors.items()}, folder / "adapter_model.safetensors")


def assert_same_factors(first, second) -> None:
    """Two ``AdapterWeights`` hold the same modules with equal factors."""
    first_modules, second_modules = dict(first.iter_modules()), dict(second.iter_modules())
    assert first_modules.keys() == second_modules.keys()
    for key, module in first_modules.items():
        assert torch.equal(module.a, second_modules[key].a) and torch.equal(module.b, second_modules[key].b), key
