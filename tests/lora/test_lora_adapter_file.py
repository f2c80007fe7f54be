"""Reading PEFT adapters: exact factors and scales, every refusal, digests."""

from __future__ import annotations

import functools
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from lora_factories import base_shapes, edit_adapter, lora_layer, make_adapter, make_base, write_adapter

from mstar_actors.lora import AdapterError, BaseShapes, read_adapter
from mstar_actors.lora.adapter_file import pattern_key

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_delta(peft_model, hf_module: str) -> torch.Tensor:
    """PEFT's own merged delta for a module, in our [out, in] orientation."""
    layer = lora_layer(peft_model, hf_module)
    delta = layer.get_delta_weight("default")
    return delta.T if hf_module.endswith("embed_tokens") else delta


def _assert_matches_peft(weights, peft_model) -> None:
    for hf_module, module in weights.iter_modules():
        ours = module.scale * module.b.float() @ module.a.float()
        torch.testing.assert_close(ours, _peft_delta(peft_model, hf_module).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_target_matches_peft_merged_delta(tmp_path, arch):
    model, cfg = make_base(arch)
    folder, peft_model = make_adapter(tmp_path, model, r=8, lora_alpha=16, target_modules=ALL + ["lm_head", "embed_tokens"])
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=8)
    assert weights.num_modules == 2 * 7 + 2
    assert weights.max_rank == 8
    assert set(weights.global_modules) == {"lm_head", "embed_tokens"}
    _assert_matches_peft(weights, peft_model)


def test_rslora_scale_is_alpha_over_sqrt_r(tmp_path):
    model, cfg = make_base()
    folder, peft_model = make_adapter(tmp_path, model, r=4, lora_alpha=6, use_rslora=True)
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=16)
    assert {m.scale for _, m in weights.iter_modules()} == {6 / math.sqrt(4)}
    _assert_matches_peft(weights, peft_model)


def test_rank_and_alpha_patterns_follow_peft(tmp_path):
    model, cfg = make_base()
    folder, peft_model = make_adapter(
        tmp_path,
        model,
        r=4,
        lora_alpha=8,
        target_modules=ALL,
        rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 8},
        alpha_pattern={r"layers\.0\.mlp\.(gate|up)_proj": 3},
    )
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=8)
    assert weights.layers[1]["self_attn.q_proj"].rank == 2
    assert weights.layers[0]["self_attn.q_proj"].rank == 4
    assert weights.layers[0]["mlp.down_proj"].rank == 8
    assert weights.layers[0]["mlp.gate_proj"].scale == 3 / 4
    assert weights.layers[1]["mlp.gate_proj"].scale == 2.0
    _assert_matches_peft(weights, peft_model)


@pytest.mark.parametrize("alpha", [0, -8])
def test_an_alpha_of_zero_or_below_scales_the_delta_as_peft_does(tmp_path, alpha):
    """PEFT serves lora_alpha 0 (no change) and below (the delta subtracted); it was refused."""
    model, cfg = make_base()
    folder, peft_model = make_adapter(tmp_path, model, r=4, lora_alpha=alpha, alpha_pattern={"v_proj": -2})
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=8)
    assert weights.layers[0]["self_attn.q_proj"].scale == alpha / 4
    assert weights.layers[0]["self_attn.v_proj"].scale == -2 / 4
    _assert_matches_peft(weights, peft_model)


def test_pattern_key_is_a_dotted_suffix_regex():
    assert pattern_key(["q_proj"], "model.layers.0.self_attn.q_proj") == "q_proj"
    assert pattern_key(["proj"], "model.layers.0.self_attn.q_proj") == "model.layers.0.self_attn.q_proj"
    assert pattern_key([r"layers\.1\..*"], "model.layers.1.mlp.up_proj") == r"layers\.1\..*"


def test_tied_embeddings_base_accepts_lm_head_and_embedding(tmp_path):
    model, cfg = make_base(tie_word_embeddings=True)
    folder, peft_model = make_adapter(tmp_path, model, target_modules=["lm_head", "embed_tokens"])
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=8)
    assert weights.layers == ({}, {})
    _assert_matches_peft(weights, peft_model)


def test_base_shapes_from_hf_config():
    _, cfg = make_base("qwen3")
    shapes = BaseShapes.from_hf_config(cfg)
    assert shapes.num_layers == 2
    assert shapes.layer_modules["self_attn.q_proj"] == (64, 128)
    assert shapes.layer_modules["self_attn.k_proj"] == (64, 64)
    assert shapes.layer_modules["self_attn.o_proj"] == (128, 64)
    assert shapes.layer_modules["mlp.down_proj"] == (96, 64)
    assert shapes.global_modules == {"lm_head": (64, 320), "embed_tokens": (320, 64)}
    with pytest.raises(ValueError, match="intermediate_size"):
        BaseShapes.from_hf_config({k: v for k, v in cfg.items() if k != "intermediate_size"})


# ---------------------------------------------------------------- digests


def test_digest_names_the_weights_and_scaling(tmp_path):
    model, cfg = make_base()
    base = base_shapes(cfg)
    folder, _ = make_adapter(tmp_path, model, seed=1, name="a")
    first = read_adapter(folder, base=base, max_rank=8).digest
    assert read_adapter(folder, base=base, max_rank=8).digest == first
    copy = shutil.copytree(folder, tmp_path / "copy")
    assert read_adapter(copy, base=base, max_rank=8, name="other").digest == first
    edit_adapter(copy, config={"lora_alpha": 9})
    assert read_adapter(copy, base=base, max_rank=8).digest != first
    model2, _ = make_base()
    other, _ = make_adapter(tmp_path, model2, seed=2, name="b")
    assert read_adapter(other, base=base, max_rank=8).digest != first


# ---------------------------------------------------------------- refusals


@pytest.fixture
def saved(tmp_path):
    """(folder, BaseShapes) of a plain q/k/v/o adapter."""
    model, cfg = make_base()
    folder, _ = make_adapter(tmp_path, model)
    return folder, base_shapes(cfg)


def _refused(folder, base, match, max_rank=8):
    with pytest.raises(AdapterError, match=match) as info:
        read_adapter(folder, base=base, max_rank=max_rank)
    assert f"adapter {folder.name!r}" in str(info.value)
    return str(info.value)


def test_refuses_peft_dora(tmp_path):
    model, cfg = make_base()
    folder, _ = make_adapter(tmp_path, model, use_dora=True)
    _refused(folder, base_shapes(cfg), r"DoRA \(use_dora=true\) is not served")
    edit_adapter(folder, config={"use_dora": False})  # the magnitudes alone give it away
    _refused(folder, base_shapes(cfg), r"lora_magnitude_vector.*DoRA magnitude")


@pytest.mark.parametrize("option, value", [("alora_invocation_tokens", [330, 42]), ("layer_replication", [[0, 1], [0, 1]]),
                                           ("use_qalora", True), ("fan_in_fan_out", True),
                                           ("monteclora_config", {"n_experts": 4}),
                                           ("target_parameters", ["mlp.experts.gate_up_proj"])])
def test_refuses_peft_options_that_change_what_it_computes(saved, option, value):
    """Read as plain LoRA, an activated LoRA or a replicated stack gave other
    tokens than PEFT's without a word."""
    folder, base = saved
    edit_adapter(folder, config={option: value})
    _refused(folder, base, rf"{option}=.* is not served")


@pytest.mark.parametrize("option", ["trainable_token_indices", "kasa_config", "use_bdlora"])
def test_refuses_peft_variants_by_their_option_as_peft_writes_them(tmp_path, option):
    """Trained embedding rows, KaSA's singular values, block-diagonal factors:
    each named, not a puzzle over a tensor or a shape it left."""
    from peft.tuners.lora.config import BdLoraConfig, KasaConfig

    model, cfg = make_base()
    kwargs = {"trainable_token_indices": dict(trainable_token_indices=[1, 2]),
              "kasa_config": dict(kasa_config=KasaConfig()),
              "use_bdlora": dict(use_bdlora=BdLoraConfig(target_modules_bd_a=["q_proj", "k_proj"],
                                                         target_modules_bd_b=["v_proj", "o_proj"], nblocks=2))}[option]
    folder, _ = make_adapter(tmp_path, model, **kwargs)
    _refused(folder, base_shapes(cfg), rf"{option}=.* is not served")


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_refuses_an_unconverted_residual_init(saved, init):
    """Its factors are a delta on base weights PEFT changed; converted, PEFT writes init_lora_weights=true."""
    folder, base = saved
    edit_adapter(folder, config={"init_lora_weights": init})
    msg = _refused(folder, base, rf"init_lora_weights='{init}'")
    assert "path_initial_model_for_weight_conversion" in msg
    edit_adapter(folder, config={"init_lora_weights": "gaussian"})
    read_adapter(folder, base=base, max_rank=8)


def test_refuses_kohya_dora_scale(saved):
    folder, base = saved
    edit_adapter(folder, tensors={"base_model.model.model.layers.0.self_attn.q_proj.dora_scale": torch.ones(1, 64)})
    _refused(folder, base, r"q_proj\.dora_scale' is a DoRA magnitude")


def test_refuses_rank_over_max(saved):
    folder, base = saved
    msg = _refused(folder, base, r"has rank 4, over max_lora_rank=2", max_rank=2)
    assert "model.layers.0.self_attn" in msg and "raise lora.max_lora_rank" in msg


def test_refuses_two_tensors_of_one_factor(saved):
    """Two spellings of one module's path, each with its own factors: which
    one PEFT would load is not what a server should guess (PEFT takes the
    prefixed key; the unprefixed one, a VL spelling, alias the same module)."""
    folder, base = saved
    key = "model.layers.0.self_attn.q_proj.lora_A.weight"
    a = read_adapter(folder, base=base, max_rank=8).layers[0]["self_attn.q_proj"].a
    edit_adapter(folder, tensors={key: a + 1})
    msg = _refused(folder, base, r"tensors '.*q_proj.lora_A.weight' and '.*q_proj.lora_A.weight' are the same factor "
                                 r"of module 'model.layers.0.self_attn.q_proj' \(two spellings of one key\)")
    assert "base_model.model.model.layers.0" in msg and f"'{key}'" in msg
    edit_adapter(folder, drop=(key,), tensors={
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)})
    _refused(folder, base, r"'model.language_model.layers.0.self_attn.q_proj' and 'model.layers.0.self_attn.q_proj' "
                           r"are the same module")


def test_refuses_keys_with_peft_adapter_names(saved):
    """An unfiltered state_dict keeps PEFT's adapter name in each key: named as such."""
    folder, base = saved
    edit_adapter(folder, tensors={"base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight":
                                  torch.zeros(4, 64)})
    msg = _refused(folder, base, r"carries PEFT's adapter name 'default'")
    assert "lora_A.weight" in msg and "full module weight" not in msg
    edit_adapter(folder, drop=("base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight",),
                 tensors={"base_model.model.model.embed_tokens.lora_embedding_A.weight": torch.zeros(4, 64)})
    msg = _refused(folder, base, r"lora_embedding_A.weight' is not a LoRA factor; accepted keys end in")


def test_refuses_unknown_target(saved):
    folder, base = saved
    edit_adapter(
        folder,
        tensors={
            "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.zeros(64, 4),
        },
    )
    _refused(folder, base, r"'model.layers.0.self_attn.rotary' is not a LoRA target.*accepted: \['self_attn.q_proj'")


def test_refuses_global_module_the_base_lacks(saved):
    folder, base = saved
    edit_adapter(folder, tensors={"base_model.model.model.norm.lora_A.weight": torch.zeros(4, 64)})
    _refused(folder, base, r"module 'model.norm' (has no lora_B|is not a LoRA target)")


def test_refuses_shapes_of_another_base(saved):
    folder, _ = saved
    _, wider = make_base(hidden_size=96, intermediate_size=128)
    _refused(folder, base_shapes(wider), r"k_proj' has lora_A \(4, 64\).*do not fit the base model's 96 in / 48 out; accepted: A \[r, 96\], B \[48, r\]")


def test_refuses_layer_out_of_range(saved):
    folder, _ = saved
    _, shallow = make_base(num_hidden_layers=1)
    _refused(folder, base_shapes(shallow), r"in layer 1, but the base model has 1 layers \(0..0\)")


@pytest.mark.parametrize("config, match", [({"bias": "lora_only"}, "bias='lora_only' is not served"), ({"lora_bias": True}, "lora_bias=true is not served")])
def test_refuses_bias_in_config(saved, config, match):
    folder, base = saved
    edit_adapter(folder, config=config)
    _refused(folder, base, match)


@pytest.mark.parametrize("config, match", [
    ({"lora_alpha": float("nan")}, r"field 'lora_alpha' must be a finite number, got nan"),
    ({"lora_alpha": float("inf")}, r"field 'lora_alpha' must be a finite number"),
    ({"r": 0}, r"field 'r' must be a finite positive number, got 0"),
    ({"r": True}, r"field 'r' must be a finite positive number"),
    ({"rank_pattern": "x"}, r"field 'rank_pattern' must be an object of module name patterns to numbers"),
    ({"alpha_pattern": [1]}, r"field 'alpha_pattern' must be an object"),
    ({"rank_pattern": {"[": 8}}, r"'\[' is not a regular expression"),
    ({"rank_pattern": {"q_proj": "8"}}, r"field 'rank_pattern'\['q_proj'\] must be a finite positive number, got '8'"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, r"field 'alpha_pattern'\['q_proj'\] must be a finite number"),
])
def test_refuses_ranks_and_alphas_that_are_no_finite_numbers(saved, config, match):
    folder, base = saved
    edit_adapter(folder, config=config)
    _refused(folder, base, match)


def test_refuses_bias_tensors(saved):
    folder, base = saved
    edit_adapter(folder, tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)})
    _refused(folder, base, r"lora_B.bias' is a LoRA bias")


def test_refuses_peft_lora_bias(tmp_path):
    model, cfg = make_base()
    folder, _ = make_adapter(tmp_path, model, lora_bias=True)
    _refused(folder, base_shapes(cfg), "lora_bias=true is not served")


def test_refuses_modules_to_save(tmp_path):
    model, cfg = make_base()
    folder, _ = make_adapter(tmp_path, model, modules_to_save=["lm_head"])
    _refused(folder, base_shapes(cfg), r"modules_to_save=\['lm_head'\] replaces base weights")
    edit_adapter(folder, config={"modules_to_save": None})
    _refused(folder, base_shapes(cfg), r"'base_model.model.lm_head.weight' is a full module weight \(PEFT saves modules_to_save")


def test_refuses_missing_files(saved):
    folder, base = saved
    weights = folder / "adapter_model.safetensors"
    weights.rename(folder / "adapter_model.bin")
    _refused(folder, base, r"adapter_model.bin is a pickle.*save the adapter as adapter_model.safetensors")
    (folder / "adapter_model.bin").unlink()
    _refused(folder, base, "adapter_model.safetensors is missing")
    os.mkfifo(weights)  # never opened: a FIFO with no writer would block the read
    _refused(folder, base, "adapter_model.safetensors in .* is not a regular file")
    weights.unlink()
    (folder / "adapter_config.json").unlink()
    _refused(folder, base, "adapter_config.json is missing")
    (folder / "adapter_config.json").write_text("{}")  # the file named in place of its folder
    _refused(folder / "adapter_config.json", base, r"adapter_config.json is a file, not a folder; give the path")


def test_refuses_corrupt_json(saved):
    folder, base = saved
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    _refused(folder, base, "adapter_config.json is not valid JSON")


def test_refuses_truncated_safetensors(saved):
    folder, base = saved
    path = folder / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    _refused(folder, base, r"adapter_model.safetensors is truncated: \d+ bytes, its header needs \d+")
    path.write_bytes(data[:20])
    _refused(folder, base, "has a corrupt header")
    import json
    import struct

    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    key = next(k for k in header if k != "__metadata__")
    for offsets in ([0, 2.0], [0, 2, 3], [8, 4], "0-2"):  # what the format's reader would refuse
        bad = json.dumps(header | {key: header[key] | {"data_offsets": offsets}}).encode()
        path.write_bytes(struct.pack("<Q", len(bad)) + bad + data[8 + size:])
        _refused(folder, base, "has a corrupt header.*data_offsets")


def test_refuses_rank_that_disagrees_with_config(saved):
    folder, base = saved
    edit_adapter(folder, config={"r": 8})
    _refused(folder, base, r"has rank 4 in adapter_model.safetensors but adapter_config.json says r=8")


def test_refuses_half_a_pair_and_non_float(tmp_path):
    base = base_shapes(make_base()[1])
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    folder = write_adapter(tmp_path / "half", {f"{key}.lora_A.weight": torch.zeros(4, 64)})
    _refused(folder, base, "has no lora_B tensor")
    folder = write_adapter(
        tmp_path / "ints",
        {f"{key}.lora_A.weight": torch.zeros(4, 64, dtype=torch.int32), f"{key}.lora_B.weight": torch.zeros(64, 4)},
    )
    _refused(folder, base, "has dtype torch.int32; accepted: float32, float16, bfloat16")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refuses_non_finite_weights(tmp_path, bad):
    base = base_shapes(make_base()[1])
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    b = torch.zeros(64, 4)
    b[3, 1] = bad
    folder = write_adapter(tmp_path / "bad", {f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": b})
    _refused(folder, base, rf"tensor '{key}.lora_B.weight' holds NaN or infinite values; accepted: finite")


def test_host_copy_in_the_serving_dtype_keeps_the_digest_and_refuses_overflow(tmp_path):
    """The reader keeps host copies in the ranks' dtype (half the bytes an install copies)."""
    base = base_shapes(make_base()[1])
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    b = torch.randn(64, 4)
    folder = write_adapter(tmp_path / "ok", {f"{key}.lora_A.weight": torch.randn(4, 64), f"{key}.lora_B.weight": b})
    weights = read_adapter(folder, base=base, max_rank=8)
    half = weights.to_dtype(torch.bfloat16)
    module = half.layers[0]["self_attn.q_proj"]
    assert half.digest == weights.digest and module.a.dtype == module.b.dtype == torch.bfloat16
    assert torch.equal(module.b, b.to(torch.bfloat16)) and module.scale == weights.layers[0]["self_attn.q_proj"].scale
    b[0, 0] = 1e6  # finite in float32 and bfloat16, beyond float16's 65504
    big = read_adapter(write_adapter(tmp_path / "big", {f"{key}.lora_A.weight": torch.randn(4, 64),
                                                        f"{key}.lora_B.weight": b}), base=base, max_rank=8)
    big.to_dtype(torch.bfloat16)
    with pytest.raises(AdapterError, match=r"'model.layers.0.self_attn.q_proj' overflows torch.float16 .*bfloat16 / float32"):
        big.to_dtype(torch.float16)


def test_refuses_resized_vocabulary_copy(tmp_path):
    model, cfg = make_base()
    folder, _ = make_adapter(tmp_path, model, target_modules=["embed_tokens"])
    edit_adapter(folder, tensors={"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(330, 64)})
    _refused(folder, base_shapes(cfg), "trained with a resized vocabulary")


@pytest.mark.parametrize("tied", [False, True])
def test_the_embedding_and_head_copies_peft_saves_must_be_the_served_ones(tmp_path, tied):
    """PEFT loads an adapter's saved ``base_layer`` copies over the base: a table the adapter changed would
    answer other tokens than the served one (only LoRA factors are served); a dtype's rounding is the same table."""
    from mstar_actors.models.loader import stored_weight

    model, cfg = make_base(tie_word_embeddings=tied)
    model.save_pretrained(str(tmp_path / "base"))
    served = functools.partial(stored_weight, tmp_path / "base")
    folder, _ = make_adapter(tmp_path, model, target_modules=["q_proj", "embed_tokens", "lm_head"])
    read = functools.partial(read_adapter, base=base_shapes(cfg), max_rank=8, base_weights=served)
    assert set(read(folder).global_modules) == {"embed_tokens", "lm_head"}
    copies = [k for k in load_file(str(folder / "adapter_model.safetensors")) if k.endswith(".base_layer.weight")]
    assert {k.split(".")[-3] for k in copies} == {"embed_tokens", "lm_head"}
    for key in copies:
        halved = load_file(str(folder / "adapter_model.safetensors"))[key].half()  # saved in another dtype
        edit_adapter(folder, tensors={key: halved})
        read(folder)
        changed = halved.float()
        changed[7] = torch.randn(changed.shape[1])  # a token's row set anew
        edit_adapter(folder, tensors={key: changed})
        with pytest.raises(AdapterError, match=rf"saved copy of the base model's {key.split('.')[-3]} .* row 7 by"):
            read(folder)
        edit_adapter(folder, tensors={key: halved})
    read(folder)
    read_adapter(folder, base=base_shapes(cfg), max_rank=8)  # (no served weights given: shapes alone)


def test_reading_an_adapter_again_and_again_keeps_no_memory(saved):
    """Every runtime load reads the file again: safetensors 0.8's
    ``safe_open(...).get_tensor`` kept ~64 bytes a tensor for good (the
    reader grew without end under loads and unloads)."""
    import gc
    import tracemalloc

    folder, base = saved

    def read() -> None:
        read_adapter(folder, base=base, max_rank=8)

    read()
    gc.collect()
    tracemalloc.start()
    try:
        read()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            read()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    num_tensors = len(load_file(str(folder / "adapter_model.safetensors")))
    assert grown < 40 * num_tensors * 16, (grown, num_tensors)  # a quarter of what the leak kept
