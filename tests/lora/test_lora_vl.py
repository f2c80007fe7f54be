"""LoRA on Qwen2.5-VL's text stack equals transformers + PEFT, token for token.

A tiny random Qwen2.5-VL and a PEFT adapter on its language model only (q/k/v/o,
gate/up/down of every layer, lm_head and embed_tokens; random non-zero
factors). Through the runner, with hand-built StepPlans: an image prompt and a
text prompt on the adapter next to an image prompt on the base model, in the
same steps (chunked prefill splitting the image run). Greedy tokens must equal
PEFT's ``generate`` (and the base model's). Also: both PEFT key layouts read
to the same factors, the served folder's shapes come from its text stack, and
an adapter that reaches into the vision tower is refused, naming the module.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models.test_qwen2_5_vl import hf_media_kwargs, media_prompt
from models.vl_factories import VOCAB, FakeArena, make_hf_vl_model
from lora_factories import TEXT_STACK, assert_same_factors, make_saved_peft, save_renamed_adapter, served_shapes
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration

from mstar_actors import messages
from plan_driver import PlanDriver
from mstar_actors.lora import AdapterError, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.model_info import load_model_info
from runner_factories import make_runner

BLOCK_SIZE = 4
NUM_NEW = 16
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
IMAGE_GRID = (1, 6, 10)  # 15 placeholder tokens


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base folder, base model, adapter folder, PEFT model)."""
    root = tmp_path_factory.mktemp("vl_lora")
    base = make_hf_vl_model(root / "base")
    peft = make_vl_peft(root / "base", root / "text", target_modules=TEXT_STACK)
    return root / "base", base, root / "text", peft


def make_vl_peft(base_folder, adapter_folder, *, seed: int = 7, **lora_kwargs):
    return make_saved_peft(Qwen2_5_VLForConditionalGeneration, base_folder, adapter_folder, seed=seed, r=MAX_RANK,
                           lora_alpha=16, **lora_kwargs)


def generate(model, prompt, media, arena) -> list[int]:
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False,
            **hf_media_kwargs(prompt, media, arena),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


def test_served_shapes_come_from_the_text_stack(world):
    base_folder, _, _, _ = world
    shapes = served_shapes(base_folder)  # what the adapter reader and the launcher use
    assert shapes.num_layers == 2 and not shapes.tie_word_embeddings
    assert shapes.shape_of("self_attn.k_proj") == (64, 32) and shapes.shape_of("mlp.down_proj") == (128, 64)
    assert shapes.shape_of("lm_head") == (64, VOCAB) and shapes.shape_of("embed_tokens") == (VOCAB, 64)


def test_adapter_on_the_text_stack_matches_peft(world):
    base_folder, base, adapter_folder, peft = world
    shapes = served_shapes(base_folder)
    weights = read_adapter(adapter_folder, base=shapes, max_rank=MAX_RANK, name="text")
    assert weights.num_modules == 2 * 7 + 2
    arena = FakeArena()
    prompts = {
        "img": media_prompt([("text", 5), ("image", IMAGE_GRID), ("text", 6)], arena, seed=1),
        "txt": media_prompt([("text", 17)], arena, seed=2),
        "base": media_prompt([("text", 3), ("image", IMAGE_GRID), ("text", 4)], arena, seed=3),
    }
    on_adapter = {"img": True, "txt": True, "base": False}
    runner = make_runner(
        base_folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=64, seed=0,
        max_loras=1, max_lora_rank=MAX_RANK, resolve_tensor=arena.resolve,
    )  # fmt: skip
    assert not any(name.startswith("visual") for name in runner.lora.stacks)  # the tower gets no stack
    runner.install_adapter(1, adapter_from_bytes(adapter_to_bytes(weights)))  # as the worker receives it
    d = Driver(runner)
    starts = [d.start(rid, p, m, slot=1 if on_adapter[rid] else 0) for rid, (p, m, _) in prompts.items()]
    # img's image run covers tokens 6..20: chunks of 10 and the rest split it.
    d.step(starts, [d.chunk("img", 10), d.chunk("txt", 9), d.chunk("base")])
    d.step([], [d.chunk("img"), d.chunk("txt"), d.chunk("base")])
    outputs = d.run_to_end()
    for rid, (prompt, media, _) in prompts.items():
        model = peft if on_adapter[rid] else base
        assert outputs[rid] == generate(model, prompt, media, arena), f"{rid} (adapter: {on_adapter[rid]}) diverged"
    with peft.disable_adapter():  # the adapter changes the tokens, so the comparison above means something
        assert outputs["img"] != generate(peft, *prompts["img"][:2], arena)


def test_both_peft_layouts_read_to_the_same_factors(world, tmp_path):
    base_folder, _, adapter_folder, _ = world
    shapes = served_shapes(base_folder)
    assert any(k.startswith("base_model.model.model.language_model.layers.") for k in load_file(adapter_folder / "adapter_model.safetensors"))
    save_renamed_adapter(adapter_folder, tmp_path, lambda k: k.replace("model.language_model.", "model."))
    new = read_adapter(adapter_folder, base=shapes, max_rank=MAX_RANK)
    old = read_adapter(tmp_path, base=shapes, max_rank=MAX_RANK)
    assert_same_factors(new, old)


@pytest.mark.parametrize("layout", ["transformers5", "original"])
def test_vision_tower_target_is_refused_by_name(world, tmp_path, layout):
    """Plain names hit the tower too: its blocks have mlp.gate_proj as well."""
    base_folder, _, _, _ = world
    make_vl_peft(base_folder, tmp_path / "ad", target_modules=["q_proj", "gate_proj"])
    if layout == "original":
        path = tmp_path / "ad" / "adapter_model.safetensors"
        tensors = load_file(path)
        save_file({k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v for k, v in tensors.items()}, path)
    prefix = "model.visual." if layout == "transformers5" else "visual."
    message = (
        rf"adapter 'ad': module '{prefix}blocks\.\d+\.mlp\.gate_proj' is in the vision tower; vision tower modules "
        r"are not adapter targets; accepted: the text stack's linears, lm_head, embed_tokens"
    )
    with pytest.raises(AdapterError, match=message):
        read_adapter(tmp_path / "ad", base=served_shapes(base_folder), max_rank=MAX_RANK)



def test_launcher_accepts_a_text_stack_adapter_and_refuses_a_model_without_rules(world):
    import json

    import msgspec

    from mstar_actors.config import parse_config
    from mstar_actors.launcher import validate_adapters
    from mstar_actors.model_info import lora_base_of

    base_folder, _, adapter_folder, _ = world
    lora = {"max_loras": 1, "max_lora_rank": MAX_RANK, "adapters": {"text": str(adapter_folder)}}
    config = parse_config({"model": {"path": str(base_folder)}, "lora": lora})
    info = load_model_info(config)
    validate_adapters(config, info)
    other = json.loads((base_folder / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    shapes, refusal = lora_base_of(other)
    assert shapes is None
    without_rules = msgspec.structs.replace(info, lora_base=None, lora_refusal=refusal)
    with pytest.raises(AdapterError, match=r"lora.adapters: the base model .* takes no adapters: .*GPT2LMHeadModel.*no LoRA shape rules"):
        validate_adapters(config, without_rules)


def test_launcher_says_how_the_demo_adapters_are_made_and_warns_of_an_adapter_dir_not_there(world, tmp_path,
                                                                                            monkeypatch, caplog):
    from mstar_actors.config import parse_config
    from mstar_actors.launcher import validate_adapters

    base_folder = world[0]
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is this test's
    lora = {"max_loras": 1, "adapters": {"pirate": "~/.cache/mstar-actors/adapters/pirate"},
            "allow_runtime_updates": True, "adapter_dirs": ["~/nowhere"]}
    config = parse_config({"model": {"path": str(base_folder)}, "lora": lora})
    with caplog.at_level("WARNING", logger="mstar_actors.launcher"):
        with pytest.raises(AdapterError, match=r"there is no folder .*; the demo adapters are made once by "
                                               r"python tools/make_demo_adapters.py"):
            validate_adapters(config, load_model_info(config))
    assert f"lora.adapter_dirs: {tmp_path / 'nowhere'} is not a folder" in caplog.text  # ~ expanded at parse
    other = parse_config({"model": {"path": str(base_folder)},
                          "lora": {"max_loras": 1, "adapters": {"mine": str(tmp_path / "mine")}}})
    with pytest.raises(AdapterError, match="there is no folder") as info:
        validate_adapters(other, load_model_info(other))
    assert "make_demo_adapters" not in str(info.value)  # only the demo's folders
