"""LoRA through the runner equals transformers + PEFT, token for token.

Three adapters of different ranks and targets (all linears with lm_head and
embed_tokens; attention-only with rsLoRA; MLP-only with a rank_pattern) and
base requests run concurrently in the same steps, driven by hand-built
StepPlans (chunked prefill, a prefix-cache hit within one adapter). Greedy
tokens must equal PEFT's ``generate`` with that adapter, and the merged
weights' (``merge_and_unload``). Also: a reload into a slot leaves nothing of
the earlier tenant, base rows in a mixed batch are bit-identical to the same
batch on the base model, and the LoRA-off runner builds no stack at all.
"""

from __future__ import annotations

import functools

import msgspec

import pytest
import torch
from lora.lora_factories import make_saved_peft
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from mstar_actors import messages
from plan_driver import PlanDriver
import runner_factories
from mstar_actors.lora import AdapterWeights, BaseShapes, LoraModule, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.runner.model_runner import ModelRunner, PlanError
from mstar_actors.models.lora_layers import LoraLayers

BLOCK_SIZE = 4
NUM_NEW = 16
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=320, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)  # fmt: skip
CONFIGS = {
    "llama": lambda: LlamaConfig(**_TINY),
    "qwen2": lambda: Qwen2Config(**_TINY),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**_TINY, head_dim=32),  # q/o sizes differ from hidden
    "qwen2-tied": lambda: Qwen2Config(**(_TINY | {"tie_word_embeddings": True})),  # the LM head is the embedding
}
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=LINEARS + ["lm_head", "embed_tokens"]),
    "attn": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=6, lora_alpha=12, rank_pattern={"down_proj": 2}, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


# ---------------------------------------------------------------- factories


def _spread(model, std: float) -> None:
    """Weights wider than the 0.02 init, so greedy argmaxes are far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif "lora_" in name:
                p.normal_(0.0, 0.25)  # PEFT starts B at zero; a zero adapter would prove nothing
            elif "base_layer" not in name and not name.startswith("base_model"):
                p.normal_(0.0, std if "embed" not in name else 1.0)


def make_base(kind: str, folder):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32).eval()
    _spread(model, 0.15)
    model.save_pretrained(folder)
    return model


def make_peft(base_folder, adapter_folder, *, seed: int, **lora_kwargs):
    """A PEFT model with random non-zero factors on a fresh copy of the base; saved to ``adapter_folder``."""
    return make_saved_peft(AutoModelForCausalLM, base_folder, adapter_folder, seed=seed, **lora_kwargs)


def generate(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def load_weights(folder, base_folder, name: str) -> AdapterWeights:
    """Read and validate, then pass through the host copy, as the worker receives it."""
    shapes = BaseShapes.from_hf_config(AutoModelForCausalLM.from_pretrained(base_folder).config.to_dict())
    return adapter_from_bytes(adapter_to_bytes(read_adapter(folder, base=shapes, max_rank=MAX_RANK, name=name)))


def make_runner(folder, **overrides) -> ModelRunner:
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0, max_loras=3, max_lora_rank=MAX_RANK)
    return runner_factories.make_runner(folder, **(kwargs | overrides))


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


# ---------------------------------------------------------------- parity


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def world(request, tmp_path_factory):
    """(base folder, base model, {adapter: (folder, peft model)}) for one architecture."""
    root = tmp_path_factory.mktemp(request.param)
    base = make_base(request.param, root / "base")
    adapters = {
        name: (root / name, make_peft(root / "base", root / name, seed=10 + i, **kwargs))
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return root / "base", base, adapters


def run_mixed(world, **runner_overrides) -> tuple[dict, dict, dict]:
    """Base and three adapters in the same steps: chunked prefill, a prefix hit.
    Returns (outputs, prompts, adapter name or None) by request id."""
    base_folder, _, adapters = world
    runner = make_runner(base_folder, **runner_overrides)
    slots = {name: slot for slot, name in enumerate(ADAPTERS, start=1)}
    for name, slot in slots.items():
        runner.install_adapter(slot, load_weights(adapters[name][0], base_folder, name))

    gen = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(3, 320, (n,), generator=gen).tolist() for rid, n in [("a1", 30), ("b0", 14), ("t1", 9), ("m1", 7)]}
    prompts["a2"] = prompts["a1"][:24] + torch.randint(3, 320, (5,), generator=gen).tolist()
    on = {"a1": "all", "a2": "all", "t1": "attn", "m1": "mlp", "b0": None}
    d = Driver(runner)
    start = {rid: d.start(rid, prompts[rid], slot=slots.get(on[rid], 0)) for rid in ("a1", "b0", "t1", "m1")}
    # Chunked prefill of a1 over three steps, next to the others' prefill and decodes.
    d.step(start.values(), [d.chunk("a1", 12), d.chunk("b0"), d.chunk("t1"), d.chunk("m1")])
    d.step([], [d.chunk("a1", 12), *d.decodes("b0", "t1", "m1")])
    d.step([], [d.chunk("a1", 6), *d.decodes("b0", "t1", "m1")])
    # Prefix-cache hit within adapter "all": a2 reuses a1's first six blocks.
    a2 = d.start("a2", prompts["a2"], slot=slots["all"], shared_blocks=d.seqs["a1"]["blocks"][:6], num_computed=24)
    d.step([a2], [d.chunk("a2"), *d.decodes("a1", "b0", "t1", "m1")])
    return d.run_to_end(), prompts, on


def assert_matches_peft(world, outputs, prompts, on) -> None:
    _, base, adapters = world
    for rid, prompt in prompts.items():
        name = on[rid]
        want = generate(base, prompt) if name is None else generate(adapters[name][1], prompt)
        assert outputs[rid] == want, f"{rid} on adapter {name} diverged from transformers+peft"


def test_mixed_adapters_match_peft_and_merged(world):
    outputs, prompts, on = run_mixed(world)
    assert_matches_peft(world, outputs, prompts, on)
    merged = {name: peft.merge_and_unload() for name, peft in _fresh_peft(world).items()}
    for rid in ("a1", "t1", "m1"):  # one request per adapter (a2 is a1's adapter again)
        name = on[rid]
        assert outputs[rid] == generate(merged[name], prompts[rid]), f"{rid} diverged from {name}'s merged weights"
    # That the adapters matter at all is shown by the reload test: one prompt, three different outputs.


@pytest.mark.gpu
def test_mixed_adapters_match_peft_on_cuda(world):
    """The Triton kernels (fp32: IEEE dots) give PEFT's tokens too; bfloat16 is a smoke run."""
    outputs, prompts, on = run_mixed(world, device="cuda")
    assert_matches_peft(world, outputs, prompts, on)
    half, _, _ = run_mixed(world, device="cuda", dtype="bfloat16")
    assert all(len(out) == NUM_NEW for out in half.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prompt_logprobs_go_through_each_rows_adapter(world, device):
    """A prompt's logprobs (echo with logprobs) on an adapter with an lm_head
    target are PEFT's, beside the same prompt on the base in the same steps
    (the LM head's delta is each row's own), over two chunks."""
    base_folder, base, adapters = world
    runner = make_runner(base_folder, device=device)
    runner.install_adapter(1, load_weights(adapters["all"][0], base_folder, "all"))
    prompt = list(range(5, 27))
    scored = msgspec.structs.replace(GREEDY, max_tokens=2, prompt_logprobs=2)
    d = Driver(runner)
    d.step([d.start("on", prompt, slot=1, sampling=scored), d.start("off", prompt, sampling=scored)],
           [d.chunk("on", 10), d.chunk("off", 10)])
    d.step([], [d.chunk("on"), d.chunk("off")])
    for rid, model in (("on", adapters["all"][1]), ("off", base)):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        got = d.firsts[rid].prompt_logprobs
        assert [p.logprob for p in got] == pytest.approx(want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(),
                                                         abs=1e-4), rid
        assert [[t.token_id for t in p.top_logprobs] for p in got] == want.topk(2, dim=-1).indices.tolist(), rid


def _fresh_peft(world):
    """PEFT models reloaded from the saved folders (merging mutates its model)."""
    from peft import PeftModel

    base_folder, _, adapters = world
    return {
        name: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32), str(folder)).eval()
        for name, (folder, _) in adapters.items()
    }


def test_reload_into_a_slot_leaves_no_stale_rows(world):
    base_folder, _, adapters = world
    runner = make_runner(base_folder, max_loras=1)
    prompt = list(range(5, 17))
    outs = []
    for i, name in enumerate(["all", "attn", "mlp"]):  # each drops targets the previous one had
        runner.install_adapter(1, load_weights(adapters[name][0], base_folder, name))
        d = Driver(runner)
        d.step([d.start(f"r{i}", prompt, slot=1)], [d.chunk(f"r{i}")])
        outs.append(d.run_to_end()[f"r{i}"])
        assert outs[-1] == generate(adapters[name][1], prompt), f"after reloading slot 1 with {name}"
    assert len({tuple(o) for o in outs}) == 3


def test_a_voided_slot_takes_its_rows_on_zeros(world):
    """After an install whose rows were already planned failed (the worker's
    ``void_slot``), the slot takes those rows rather than refusing the step
    (every rank must run the same batch) and adds nothing: the base model's
    tokens, to be discarded by the conductor."""
    base_folder, base, adapters = world
    runner = make_runner(base_folder, max_loras=1)
    runner.install_adapter(1, load_weights(adapters["all"][0], base_folder, "all"))
    runner.void_slot(1, "all")
    prompt = list(range(5, 17))
    d = Driver(runner)
    d.step([d.start("v", prompt, slot=1)], [d.chunk("v")])
    assert d.run_to_end()["v"] == generate(base, prompt)


def test_base_rows_in_a_mixed_batch_equal_the_base_batch(world):
    """Same batch twice: once with a row on an adapter, once all on the base;
    the base rows' logits must be bit-identical (LoRA touches only its rows)."""
    base_folder, _, adapters = world
    runs = []
    for adapter_slot in (1, 0):
        logits_seen: list[torch.Tensor] = []

        def sampler(logits, rows, generator):
            from mstar_actors.runner.sampling import sample_tokens

            logits_seen.append(logits.clone())
            return sample_tokens(logits, rows, generator=generator)

        runner = make_runner(base_folder, sampler=sampler)
        runner.install_adapter(1, load_weights(adapters["all"][0], base_folder, "all"))
        d = Driver(runner)
        starts = [d.start("b", [7, 8, 9, 10, 11]), d.start("x", [20, 21, 22], slot=adapter_slot), d.start("c", [30, 31])]
        d.step(starts, [d.chunk("b"), d.chunk("x"), d.chunk("c")])
        for _ in range(3):
            d.step([], d.decodes("b", "x", "c"))
        runs.append(torch.stack(logits_seen))  # [steps, rows b/x/c, vocab]
    mixed, plain = runs
    assert torch.equal(mixed[:, [0, 2]], plain[:, [0, 2]])
    assert not torch.allclose(mixed[:, 1], plain[:, 1])


# ---------------------------------------------------------------- off path and refusals


def test_lora_off_builds_no_stack_and_refuses_slots(world):
    base_folder, _, adapters = world
    runner = make_runner(base_folder, allow_runtime_updates=False)  # no adapter can ever be served: LoRA off
    assert runner.lora is None and runner.model.lm_head_lora is None
    assert all(getattr(m, "lora", None) is None for m in runner.model.modules())
    with pytest.raises(ValueError, match="'attn'.*LoRA is off"):
        runner.install_adapter(1, load_weights(adapters["attn"][0], base_folder, "attn"))
    d = Driver(runner)
    with pytest.raises(PlanError, match="'x'.*LoRA is off") as err:
        d.step([d.start("x", [5, 6], slot=1), d.start("ok", [5, 6])], [])
    assert err.value.request_ids == ["x"] and "ok" in runner.seqs


def test_install_refusals_name_adapter_and_module(world):
    base_folder, _, adapters = world
    runner = make_runner(base_folder, max_loras=2)
    lora: LoraLayers = runner.lora
    good = load_weights(adapters["attn"][0], base_folder, "attn")
    runner.install_adapter(2, good)
    m = LoraModule(a=torch.ones(2, 64), b=torch.ones(64, 2), scale=1.0)
    unknown = AdapterWeights("odd", "d", 2, ({"self_attn.rotary": m}, {}), {})
    with pytest.raises(ValueError, match="'odd'.*'model.layers.0.self_attn.rotary' has no LoRA stack"):
        runner.install_adapter(2, unknown)
    too_big = AdapterWeights("big", "d", 9, ({"mlp.down_proj": LoraModule(torch.ones(9, 96), torch.ones(64, 9), 1.0)}, {}), {})
    with pytest.raises(ValueError, match=r"'big'.*'model.layers.0.mlp.down_proj'.*r <= 8"):
        runner.install_adapter(2, too_big)
    # A refused install leaves the slot empty (not the earlier tenant, not half of the new one).
    assert 2 not in runner.lora_names
    assert all(not s.a[:, 2].any() and not s.b[2].any() for s in lora.stacks.values())
    with pytest.raises(ValueError, match="slot 3 is out of range; accepted: 1..2"):
        runner.install_adapter(3, good)
    with pytest.raises(PlanError, match="'y': lora_slot 2 holds no adapter.*installed: none"):
        Driver(runner).step([Driver(runner).start("y", [4], slot=2)], [])


def test_tied_lm_head_and_embedding_adapter_match_peft(tmp_path):
    """A tied LM head has no module of its own here; its LoRA stack still applies."""
    base_folder = tmp_path / "base"
    make_base("qwen2-tied", base_folder)
    peft = make_peft(base_folder, tmp_path / "ad", seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "lm_head", "embed_tokens"])
    seen: list[torch.Tensor] = []

    def sampler(logits, rows, generator):
        from mstar_actors.runner.sampling import sample_tokens

        seen.append(logits.clone())
        return sample_tokens(logits, rows, generator=generator)

    runner = make_runner(base_folder, max_loras=1, sampler=sampler)
    runner.install_adapter(1, load_weights(tmp_path / "ad", base_folder, "ad"))
    prompt = list(range(5, 20))
    d = Driver(runner)
    d.step([d.start("x", prompt, slot=1)], [d.chunk("x")])
    with torch.no_grad():
        want = peft(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(seen[0][0], want, rtol=1e-4, atol=1e-4)
    assert d.run_to_end()["x"] == generate(peft, prompt)
