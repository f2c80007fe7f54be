"""Loader errors name the tensor or field and say what was expected; the
checkpoint rules map HF module names for the loader and for LoRA."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_actors.models import ARCHITECTURES, ModelLoadError, load_model


@pytest.fixture
def folder(hf_models, tmp_path):
    """A private copy of the tiny Llama folder, free to break."""
    dst = tmp_path / "model"
    shutil.copytree(hf_models("llama")[0], dst)
    return dst


def _edit_tensors(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _load(folder):
    return load_model(folder, torch.float32, "cpu")


def test_missing_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        _load(folder)


def test_misshaped_tensor_names_both_shapes(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[100, 64\], expected \[128, 64\]"):
        _load(folder)


def test_unexpected_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor\(s\) 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        _load(folder)


def test_unknown_architecture_lists_accepted(folder):
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel' is not supported; accepted: LlamaForCausalLM, Qwen2"):
        _load(folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; accepted: silu"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
        (dict(hidden_size=None), "field 'hidden_size' is missing"),
    ],
)
def test_unservable_config_names_the_field(folder, changes, message):
    _edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match=message):
        _load(folder)


def test_missing_config_says_what_is_needed(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        _load(tmp_path)


def test_checkpoint_rules_place_adapter_modules():
    rules = ARCHITECTURES["Qwen3ForCausalLM"].rules
    assert rules.map_module("model.layers.3.self_attn.k_proj") == ("model.layers.3.self_attn.qkv_proj", 1)
    assert rules.map_module("base_model.model.model.layers.0.mlp.up_proj") == ("model.layers.0.mlp.gate_up_proj", 1)
    assert rules.map_module("model.layers.2.self_attn.o_proj") == ("model.layers.2.self_attn.o_proj", None)
    assert rules.map_module("model.layers.2.self_attn.q_norm") == ("model.layers.2.self_attn.q_norm", None)
    assert rules.map_module("model.layers.2.self_attn.rotary") is None
    assert rules.map_tensor("model.layers.5.self_attn.v_proj.bias") == ("model.layers.5.self_attn.qkv_proj.bias", 2)
    assert rules.checkpoint_parts("model.layers.5.mlp.gate_up_proj") == [
        ("model.layers.5.mlp.gate_proj", 0, 1), ("model.layers.5.mlp.up_proj", 1, 1)]
    assert ARCHITECTURES["LlamaForCausalLM"].rules.map_module("model.layers.0.self_attn.q_norm") is None
