"""LoRA on Qwen3.5's hybrid text model equals transformers + PEFT, token for token.

Three adapters (the DeltaNet projections only; gated attention and the MLP;
the LM head and the embedding) run beside base rows in the same steps on
fewer slots than adapters, one slot swapped between them (churn). An
adapter trained on split q / k / v DeltaNet projections serves like the
same factors on the fused ``in_proj_qkv``, and a module on the wrong kind
of layer is refused by name.
"""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import Qwen3_5ForCausalLM

import runner_factories
from lora_factories import write_adapter
from models.hybrid_factories import VOCAB, generate, make_qwen3_5, spread
from mstar_actors import messages
from mstar_actors.lora import AdapterError, BaseShapes, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.runner.model_runner import PlanError
from plan_driver import PlanDriver

BLOCK_SIZE = 4
NUM_NEW = 10
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ADAPTERS = {
    "deltanet": dict(r=8, lora_alpha=16, target_modules=DELTANET),
    "attn_mlp": dict(r=4, lora_alpha=8, use_rslora=True,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "head": dict(r=6, lora_alpha=12, target_modules=["lm_head", "embed_tokens"]),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_lora")
    base = make_qwen3_5(root / "base")
    adapters = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = Qwen3_5ForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(**kwargs)).eval()
        torch.manual_seed(10 + i)
        spread(peft_model)  # only the lora_ factors change: the base weights are the saved ones
        peft_model.save_pretrained(str(root / name))
        adapters[name] = (root / name, _reload(root / "base", root / name))
    return root / "base", base, adapters


def _reload(base_folder, adapter_folder):
    model = Qwen3_5ForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_folder)).eval()


def load_weights(folder, base_folder, name: str):
    """Read and validate, then pass through the host copy, as the worker receives it."""
    import json

    shapes = BaseShapes.from_hf_config(json.loads((base_folder / "config.json").read_text()))
    return adapter_from_bytes(adapter_to_bytes(read_adapter(folder, base=shapes, max_rank=MAX_RANK, name=name)))


def make_runner(folder, **overrides):
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, max_num_seqs=6, seed=0,
                  max_loras=2, max_lora_rank=MAX_RANK)
    return runner_factories.make_runner(folder, **(kwargs | overrides))


def serve_every_target(world, **overrides):
    """Three adapters beside base rows on two slots, one swapped (see the
    module doc): each request's tokens, its prompt and its adapter's name."""
    base_folder, base, adapters = world
    runner = make_runner(base_folder, **overrides)
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(2, VOCAB, (n,), generator=gen).tolist()
               for rid, n in [("d", 19), ("a", 11), ("b", 7), ("h", 13)]}
    on = {"d": "deltanet", "a": "attn_mlp", "b": None, "h": "head"}
    runner.install_adapter(1, load_weights(adapters["deltanet"][0], base_folder, "deltanet"))
    runner.install_adapter(2, load_weights(adapters["attn_mlp"][0], base_folder, "attn_mlp"))
    d = Driver(runner)
    starts = [d.start("d", prompts["d"], slot=1), d.start("a", prompts["a"], slot=2), d.start("b", prompts["b"])]
    d.step(starts, [d.chunk("d", 8), d.chunk("a"), d.chunk("b")])  # d's prefill in two chunks
    d.step([], [d.chunk("d"), *d.decodes("a", "b")])
    while len(d.seqs["a"]["outputs"]) < NUM_NEW:
        d.step([], d.decodes("d", "a", "b"))
    done = {"a": list(d.seqs["a"]["outputs"])}
    d.step([], d.decodes("d", "b"), finished=[d.finish("a")])
    # Churn: slot 2 frees with its last request and takes the third adapter.
    runner.install_adapter(2, load_weights(adapters["head"][0], base_folder, "head"))
    d.step([d.start("h", prompts["h"], slot=2)], [d.chunk("h"), *d.decodes("d", "b")])
    return d.run_to_end() | done, prompts, on, runner


def test_adapters_on_every_target_match_peft_beside_base_rows_with_churn(world):
    _, base, adapters = world
    outputs, prompts, on, _ = serve_every_target(world)
    for rid, name in on.items():
        model = base if name is None else adapters[name][1]
        assert outputs[rid] == generate(model, prompts[rid], NUM_NEW), f"{rid} on adapter {name} diverged from peft"
    assert outputs["d"] != generate(base, prompts["d"], NUM_NEW)  # the adapter matters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_match_peft_on_cuda_through_the_step_graphs(world):
    """The same steps on CUDA: prefill chunks from the mixed-step graphs and
    decodes from the decode graphs, LoRA rows through the Triton kernels."""
    _, base, adapters = world
    outputs, prompts, on, runner = serve_every_target(world, device="cuda", cuda_graph_max_batch=4)
    assert runner.mixed_graphs is not None and runner.mixed_graphs.is_captured
    for rid, name in on.items():
        model = (base if name is None else adapters[name][1]).to("cuda")
        try:
            assert outputs[rid] == generate(model, prompts[rid], NUM_NEW), f"{rid} on adapter {name} diverged from peft"
        finally:
            model.to("cpu")  # the module's other tests compare on the CPU



def test_split_qkv_adapter_serves_as_the_fused_one(world, tmp_path):
    """The same factors written on in_proj_q / in_proj_k / in_proj_v (B split by
    rows, A shared) give the fused adapter's tokens."""
    base_folder, _, adapters = world
    folder, peft_model = adapters["deltanet"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key, value = 2 * 16, 4 * 16  # q and k: 2 heads of 16; v: 4 heads of 16
    split = {}
    for name, tensor in tensors.items():
        if ".in_proj_qkv." not in name:
            split[name] = tensor
            continue
        for part, rows in (("q", slice(0, key)), ("k", slice(key, 2 * key)), ("v", slice(2 * key, 2 * key + value))):
            new = name.replace("in_proj_qkv", f"in_proj_{part}")
            split[new] = (tensor if "lora_A" in name else tensor[rows]).clone()
    split_folder = write_adapter(tmp_path / "split", split, {"r": 8, "lora_alpha": 16})
    runner = make_runner(base_folder)
    runner.install_adapter(1, load_weights(split_folder, base_folder, "split"))
    prompt = list(range(3, 20))
    d = Driver(runner)
    d.step([d.start("s", prompt, slot=1)], [d.chunk("s")])
    assert d.run_to_end()["s"] == generate(peft_model, prompt, NUM_NEW)


def test_a_module_on_the_wrong_kind_of_layer_is_refused_by_name(world, tmp_path):
    base_folder, _, _ = world
    a, b = torch.randn(4, 64), torch.randn(4 * 32 * 2, 4)
    folder = write_adapter(tmp_path / "wrong", {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,  # layer 0 is a DeltaNet layer
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    })
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj.*layer 0 is a linear_attention layer"):
        load_weights(folder, base_folder, "wrong")


def test_a_parked_sequence_resumes_on_another_slot_with_its_state_intact(world):
    """Churn's parking on the ranks: a sequence on slot 1 leaves the steps for
    two (its recurrent state and KV untouched), then its chunks name slot 2,
    holding the same adapter: its tokens are peft's. A chunk naming a slot
    this rank holds no adapter in fails that request."""
    base_folder, base, adapters = world
    folder, peft_model = adapters["deltanet"]
    runner = make_runner(base_folder)
    for slot in (1, 2):
        runner.install_adapter(slot, load_weights(folder, base_folder, "deltanet"))
    prompt, other = list(range(3, 21)), list(range(30, 37))
    d = Driver(runner)
    d.step([d.start("p", prompt, slot=1), d.start("o", other)], [d.chunk("p"), d.chunk("o")])
    d.step([], d.decodes("p", "o"))
    for _ in range(2):  # parked: only the other runs
        d.step([], d.decodes("o"))
    while len(d.seqs["p"]["outputs"]) < NUM_NEW:
        d.step([], [msgspec.structs.replace(c, lora_slot=2) for c in d.decodes("p")])
    assert d.seqs["p"]["outputs"] == generate(peft_model, prompt, NUM_NEW)
    runner.lora_names.pop(2)  # as if slot 2 held nothing on this rank
    with pytest.raises(PlanError, match="'o'"):
        d.step([], [msgspec.structs.replace(c, lora_slot=2) for c in d.decodes("o")])
