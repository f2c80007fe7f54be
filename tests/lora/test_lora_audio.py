"""LoRA on Qwen2-Audio's decoder equals transformers + PEFT, token for token.

A tiny random Qwen2-Audio and a PEFT adapter on its language model only
(q/k/v/o, gate/up/down of every layer, lm_head and embed_tokens; random
non-zero factors). Through the runner: an audio prompt and a text prompt on
the adapter next to an audio prompt on the base model, in the same steps
(chunked prefill splitting the audio run). Greedy tokens must equal PEFT's
``generate`` (and the base model's). An adapter that reaches into the audio
encoder or the projector is refused, naming the module.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models.audio_factories import VOCAB, make_hf_audio_model
from models.test_qwen2_audio import audio_prompt, hf_audio_kwargs
from models.vl_factories import FakeArena
from lora_factories import TEXT_STACK, assert_same_factors, make_saved_peft, save_renamed_adapter, served_shapes
from safetensors.torch import load_file
from transformers import Qwen2AudioForConditionalGeneration

from mstar_actors import messages
from mstar_actors.lora import AdapterError, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from plan_driver import PlanDriver
from runner_factories import make_runner

BLOCK_SIZE = 4
NUM_NEW = 16
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base folder, base model, adapter folder, PEFT model)."""
    root = tmp_path_factory.mktemp("audio_lora")
    base = make_hf_audio_model(root / "base")
    peft = make_audio_peft(root / "base", root / "text", target_modules=TEXT_STACK)
    return root / "base", base, root / "text", peft


def make_audio_peft(base_folder, adapter_folder, *, seed: int = 7, **lora_kwargs):
    return make_saved_peft(Qwen2AudioForConditionalGeneration, base_folder, adapter_folder, seed=seed, r=MAX_RANK,
                           lora_alpha=16, **lora_kwargs)


def generate(model, prompt, media, frames) -> list[int]:
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                             do_sample=False, **hf_audio_kwargs(media, frames))
    return out[0, len(prompt):].tolist()


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


def test_served_shapes_come_from_the_decoder(world):
    shapes = served_shapes(world[0])
    assert shapes.num_layers == 2 and not shapes.tie_word_embeddings
    assert shapes.shape_of("self_attn.k_proj") == (64, 32) and shapes.shape_of("lm_head") == (64, VOCAB)


def test_adapter_on_the_decoder_matches_peft(world):
    base_folder, base, adapter_folder, peft = world
    weights = read_adapter(adapter_folder, base=served_shapes(base_folder), max_rank=MAX_RANK, name="text")
    assert weights.num_modules == 2 * 7 + 2
    arena = FakeArena()
    prompts = {
        "aud": audio_prompt([("text", 5), ("audio", 60), ("text", 6)], arena, seed=1),  # 15 audio tokens from 6
        "txt": audio_prompt([("text", 17)], arena, seed=2),
        "base": audio_prompt([("text", 3), ("audio", 45), ("text", 4)], arena, seed=3),
    }
    on_adapter = {"aud": True, "txt": True, "base": False}
    runner = make_runner(base_folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=64, seed=0,
                         max_loras=1, max_lora_rank=MAX_RANK, resolve_tensor=arena.resolve)
    assert not any(name.startswith(("audio_tower", "multi_modal_projector")) for name in runner.lora.stacks)
    runner.install_adapter(1, adapter_from_bytes(adapter_to_bytes(weights)))  # as the worker receives it
    d = Driver(runner)
    starts = [d.start(rid, p, m, slot=1 if on_adapter[rid] else 0) for rid, (p, m, _) in prompts.items()]
    d.step(starts, [d.chunk("aud", 10), d.chunk("txt", 9), d.chunk("base")])
    d.step([], [d.chunk("aud"), d.chunk("txt")])
    outputs = d.run_to_end()
    for rid, (prompt, media, frames) in prompts.items():
        model = peft if on_adapter[rid] else base
        assert outputs[rid] == generate(model, prompt, media, frames), f"{rid} (adapter: {on_adapter[rid]}) diverged"
    with peft.disable_adapter():  # the adapter changes the tokens, so the comparison above means something
        assert outputs["aud"] != generate(peft, *prompts["aud"])


def test_original_peft_layout_reads_to_the_same_factors(world, tmp_path):
    base_folder, _, adapter_folder, _ = world
    shapes = served_shapes(base_folder)
    assert any(k.startswith("base_model.model.model.language_model.layers.") for k in load_file(adapter_folder / "adapter_model.safetensors"))
    save_renamed_adapter(adapter_folder, tmp_path, lambda k: k.replace("model.language_model.", "language_model.model.")
                         .replace("base_model.model.lm_head", "base_model.model.language_model.lm_head"))
    new, old = read_adapter(adapter_folder, base=shapes, max_rank=MAX_RANK), read_adapter(tmp_path, base=shapes, max_rank=MAX_RANK)
    assert_same_factors(new, old)


@pytest.mark.parametrize("targets, module", [
    (["q_proj", "fc1"], r"model\.audio_tower\.layers\.\d+\.(self_attn\.q_proj|fc1)"),  # q_proj is in both stacks
    (["linear"], r"model\.multi_modal_projector\.linear"),
])
def test_audio_encoder_targets_are_refused_by_name(world, tmp_path, targets, module):
    base_folder = world[0]
    make_audio_peft(base_folder, tmp_path / "ad", target_modules=targets)
    message = (rf"adapter 'ad': module '{module}' is in the audio encoder; audio encoder modules are not adapter "
               r"targets; accepted: the text stack's linears, lm_head, embed_tokens")
    with pytest.raises(AdapterError, match=message):
        read_adapter(tmp_path / "ad", base=served_shapes(base_folder), max_rank=MAX_RANK)
