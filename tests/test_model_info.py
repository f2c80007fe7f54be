"""ModelInfo: the model's facts, read once from the folder, as the ranks read them."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from mstar_actors.config import ConfigError, parse_config
from mstar_actors.lora.base_shapes import BaseShapes
from mstar_actors.model_info import ModelInfo, load_model_info, served_name
from mstar_actors.models.spec import ModelLoadError

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def model_folder(tmp_path: Path, generation_eos=None, **fields) -> Path:
    """A folder with only config.json (and generation_config.json): the facts need no weights."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | fields))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return tmp_path


def info_of(folder: Path, **sections) -> ModelInfo:
    model = {"path": str(folder), "device": "cpu"} | sections.pop("model", {})
    return load_model_info(parse_config({"model": model, **sections}))


def test_facts_of_a_llama_folder(tmp_path):
    folder = model_folder(tmp_path, generation_eos=[2, 5, 0])
    info = info_of(folder, model={"name": "tiny"})
    assert (info.served_name, info.model_dir, info.architecture) == ("tiny", str(folder), "LlamaForCausalLM")
    assert info.vocab_size == 512 and not info.is_multimodal and info.media_token_ids == {}
    assert info.eos_token_ids == (2, 5, 0)  # config.json's first, then generation_config's extras: the ranks' rule
    assert info.dtype == "float32"  # auto on CPU
    assert info.lora_base == BaseShapes.from_hf_config(LLAMA) and info.lora_refusal == ""


def test_served_name_is_the_configured_the_embedded_or_the_folder_name(tmp_path):
    assert served_name("mine", "smollm2", tmp_path) == "mine"
    assert served_name(None, "smollm2", tmp_path / "cache-dir") == "smollm2"
    assert served_name(None, str(tmp_path / "folder") + "/", tmp_path / "folder") == "folder"


def test_max_model_len_is_capped_by_the_model_and_narrowed_by_the_kv_cache(tmp_path):
    folder = model_folder(tmp_path)
    assert info_of(folder).max_model_len == 256  # unset: the model's own context
    assert info_of(folder, scheduler={"max_model_len": 100}).max_model_len == 100
    with pytest.raises(ConfigError, match=r"scheduler.max_model_len 10000 is past the model's context \(256 positions"):
        info_of(folder, scheduler={"max_model_len": 10_000})  # as vLLM refuses it
    info = info_of(folder)
    assert info.with_kv_capacity(64).max_model_len == 64 and info.with_kv_capacity(1000) == info


def test_dtype_is_the_ranks_resolution(tmp_path):
    folder = model_folder(tmp_path)
    assert info_of(folder, model={"dtype": "float16"}).dtype == "float16"
    assert info_of(folder, model={"dtype": "auto"}).dtype == "float32"


def test_a_folder_the_ranks_cannot_serve_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config.json: architecture 'GPT2LMHeadModel' is not supported"):
        info_of(model_folder(tmp_path, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelLoadError, match=r"config.json: field 'hidden_size' is missing"):
        info_of(model_folder(tmp_path, architectures=["LlamaForCausalLM"], hidden_size=None))


def test_sampling_defaults_are_what_generation_config_asks_for_as_vllm_reads_it(tmp_path):
    folder = model_folder(tmp_path)
    assert info_of(folder).sampling_defaults == {}  # no generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300,
        "repetition_penalty": 1.0, "eos_token_id": 2}))
    assert info_of(folder).sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert info_of(folder, model={"generation_config": "none"}).sampling_defaults == {}
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 1.0, "min_p": 0.05}))
    assert info_of(folder).sampling_defaults == {"min_p": 0.05}  # transformers' own defaults: none asked for
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 20.0, "max_new_tokens": 300.0}))
    counts = info_of(folder).sampling_defaults  # counts written as floats are the integers a plan carries
    assert counts == {"top_k": 20, "max_tokens": 300} and {type(v) for v in counts.values()} == {int}
    for bad, named in (({"top_p": 0}, r"top_p: expected a number in \(0.0, 1.0\], got 0"),
                       ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
                       ({"top_p": True}, "top_p must be a number, got True"),
                       ({"max_new_tokens": 0}, r"max_new_tokens: expected an integer in \[1, ")):
        (folder / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError, match=named + ".*model.generation_config: none"):
            info_of(folder)
        assert info_of(folder, model={"generation_config": "none"}).sampling_defaults == {}
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json: not JSON"):
        info_of(folder)


def test_info_crosses_processes_as_the_spec_carries_it(tmp_path):
    folder = model_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 20, "max_new_tokens": 64, "top_p": 0.5}))
    info = info_of(folder)
    assert pickle.loads(pickle.dumps(info)) == info
    back = msgspec.convert(msgspec.to_builtins(info), ModelInfo)  # ActorSpec.info and back
    assert back == info
    # an integer stays one (a float max_tokens in a request broke the channel to prepare)
    assert {k: type(v) for k, v in back.sampling_defaults.items()} == {"top_k": int, "max_tokens": int, "top_p": float}


def test_unpickling_a_spec_with_info_imports_no_torch(tmp_path):
    """The child unpickles its spec before it blocks SIGUSR1: nothing in it may import torch."""
    from actors.base import ActorSpec
    from mstar_actors.config import Config

    info = info_of(model_folder(tmp_path))
    spec = ActorSpec(name="x", config=Config(), run_dir=str(tmp_path), inbox={}, outbox={},
                     info=msgspec.to_builtins(info))
    (tmp_path / "spec.pickle").write_bytes(pickle.dumps(spec))
    code = (f"import pickle, sys; pickle.loads(open({str(tmp_path / 'spec.pickle')!r}, 'rb').read()); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}).returncode == 0


def test_a_folder_without_weights_or_a_tokenizer_is_refused_naming_what_it_lacks(tmp_path):
    from mstar_actors.model_info import check_model_files
    from mstar_actors.models.spec import ModelLoadError

    import torch
    from safetensors.torch import save_file

    folder = model_folder(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights found"):
        check_model_files(folder)
    weights = folder / "model.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(7)}, str(weights))
    whole = weights.read_bytes()
    with pytest.raises(ModelLoadError, match=r"no tokenizer files \(one of tokenizer.json, .*copy them"):
        check_model_files(folder)
    (folder / "tokenizer.json").write_text("{}")
    check_model_files(folder)
    # a weights file cut short, or not safetensors: named with what to do, before any actor loads it
    for data, why in [(whole[:-4], "cut short"), (whole[:20], "cut short"), (b"", "cut short"),
                      (b"\x10" + bytes(7) + b"not json at all!", "header is not valid"), (whole + b"x", "longer"),
                      (b"\x05" + bytes(7) + b"[1,2]", "header is not valid"),
                      (b"\x22" + bytes(7) + b'{"a": {"data_offsets": [0, "xy"]}}', "header is not valid")]:
        weights.write_bytes(data)
        with pytest.raises(ModelLoadError, match=why) as info:
            check_model_files(folder)
        assert str(weights) in str(info.value) and "download it again" in str(info.value)
