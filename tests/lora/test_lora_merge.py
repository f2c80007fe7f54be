"""Steps of one adapter on merged weights (``mstar_actors.lora.merge``), against transformers + peft.

On CPU the runner merges only where each layer runs through Python (the
layer stack reads packed copies), so the model here is Qwen3's shape (per-head
q/k norms: the stack does not take it), in float32: token for token.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import runner_factories
from lora.lora_factories import make_saved_peft
from lora.test_lora_parity import BLOCK_SIZE, GREEDY, MAX_RANK, NUM_NEW, _spread, generate, load_weights
from mstar_actors.lora.merge import MergePolicy
from mstar_actors.models.cpu_stack import CpuDecoderStack
from mstar_actors.runner.build import merged_weights
from plan_driver import PlanDriver

Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=6, lora_alpha=12, rank_pattern={"down_proj": 2}, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),  # an LM head: never merged
    "embed": dict(r=4, lora_alpha=8, target_modules=["v_proj", "embed_tokens"]),  # nor an embedding
}
AFTER = 3  # steps in a row on one adapter before the merge


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Qwen3Config(**TINY, head_dim=32), dtype=torch.float32).eval()
    _spread(base, 0.15)
    base.save_pretrained(root / "base")
    adapters = {name: (root / name, make_saved_peft(AutoModelForCausalLM, root / "base", root / name, seed=20 + i, **kw))
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    return root / "base", base, adapters


def make_runner(folder, *, merge: bool = True, **overrides):
    keys = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0, max_loras=2,
                max_lora_rank=MAX_RANK)
    runner = runner_factories.make_runner(folder, **(keys | overrides))
    if merge:
        runner.merge_one_adapter_steps(runner.lora.merged_weights(), AFTER)
    return runner


def held(runner) -> list:
    """Record what the weights hold at each step (wraps ``MergedWeights.hold``)."""
    seen: list = []
    hold = runner.merged.hold

    def recorded(slot, tenant):
        hold(slot, tenant)
        seen.append(runner.merged.tenant)

    runner.merged.hold = recorded
    return seen


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (7 + 3 * i,), generator=gen).tolist() for i in range(n)]


# ---------------------------------------------------------------- the policy


def test_policy_merges_at_the_nth_step_of_a_run_and_restores_at_once():
    policy = MergePolicy(3)
    assert [policy.choose(t) for t in ["a", "a", "a", "a"]] == [None, None, "a", "a"]
    assert policy.choose(None) is None  # a step with base rows or a mix: as loaded, at once
    assert policy.after_steps == 6  # that merge lasted 2 steps: the next waits twice as long
    assert [policy.choose(t) for t in ["a", "a", "b", "b", "b", "b", "b", "b"]] == [None] * 7 + ["b"]  # runs restart
    assert policy.choose("a") is None  # another adapter: as loaded until its own run is long enough
    with pytest.raises(ValueError, match="accepted: 1 or more"):
        MergePolicy(0)


def test_short_merges_make_the_next_wait_longer_and_a_long_one_resets_it():
    """One request at a time, each on another adapter: runs of 8 steps. Merging at the 2nd step
    of each and restoring at the next request's first would copy the weights twice a request;
    the wait doubles after each merge held under 4 x 2 steps, until no such run merges."""
    policy = MergePolicy(2)
    merged_steps = []
    for request in range(6):
        merged_steps.append(sum(policy.choose(("slot", request)) is not None for _ in range(8)))
    assert merged_steps == [7, 5, 1, 0, 0, 0]
    assert policy.after_steps == 16
    assert sum(policy.choose("long") is not None for _ in range(16 + 4 * 2)) == 9  # held 9 steps: paid
    policy.choose(None)
    assert policy.after_steps == 2  # back to the configured wait


# ---------------------------------------------------------------- the weights


def test_merge_is_peft_merge_and_restore_is_exact(world):
    base_folder, _, adapters = world
    runner = make_runner(base_folder, merge=False)
    for slot, name in ((1, "attn"), (2, "mlp")):
        runner.install_adapter(slot, load_weights(adapters[name][0], base_folder, name))
    merged = runner.lora.merged_weights()
    layer = runner.model.model.layers[1]
    before = {n: m.weight.clone() for n, m in runner.lora.linears.items()}
    assert merged.num_bytes == sum(w.nbytes for w in before.values())
    merged.hold(1, "attn")
    from peft import PeftModel
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32),
                                     str(adapters["attn"][0])).merge_and_unload().model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([128, 64, 64])
    for ours, theirs in ((q, want.self_attn.q_proj), (k, want.self_attn.k_proj), (v, want.self_attn.v_proj),
                         (layer.self_attn.o_proj.weight, want.self_attn.o_proj)):
        torch.testing.assert_close(ours, theirs.weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer.mlp.down_proj.weight, before["model.layers.1.mlp.down_proj"])  # not a target of attn's
    merged.hold(2, "mlp")  # another adapter: restored first, then merged
    assert torch.equal(layer.self_attn.o_proj.weight, before["model.layers.1.self_attn.o_proj"])
    assert not torch.equal(layer.mlp.down_proj.weight, before["model.layers.1.mlp.down_proj"])
    merged.hold(0, None)
    for name, module in runner.lora.linears.items():
        assert torch.equal(module.weight, before[name]), f"{name} not restored bit for bit"


def test_an_adapter_on_the_head_or_embedding_is_never_merged(world):
    base_folder, _, adapters = world
    runner = make_runner(base_folder, max_loras=3)
    for slot, name in enumerate(["head", "attn", "embed"], start=1):
        runner.install_adapter(slot, load_weights(adapters[name][0], base_folder, name))
    assert [runner.merged.can_merge(slot) for slot in (1, 2, 3)] == [False, True, False]
    seen = held(runner)
    prompt = prompts(1, 4)[0]
    d = Driver(runner)
    d.step([d.start("h", prompt, slot=1)], [d.chunk("h")])
    assert d.run_to_end()["h"] == generate(adapters["head"][1], prompt)
    assert set(seen) == {None}


def test_a_merge_that_fails_halfway_is_restored_before_the_next(world, monkeypatch):
    """A merge that raises after some linears (an out-of-memory, say) fails its step; the weights
    then hold neither the adapter nor the loaded values, and the next hold, base or adapter,
    restores every linear first (never a second merge on top of the first)."""
    base_folder, _, adapters = world
    runner = make_runner(base_folder, merge=False)
    runner.install_adapter(1, load_weights(adapters["attn"][0], base_folder, "attn"))
    merged = runner.lora.merged_weights()
    before = {n: m.weight.clone() for n, m in runner.lora.linears.items()}
    merged.hold(1, "attn")
    want = {n: m.weight.clone() for n, m in runner.lora.linears.items()}
    merged.hold(0, None)
    calls = []
    addmm = torch.Tensor.addmm_

    def failing(self, *args, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise torch.OutOfMemoryError("scripted")
        return addmm(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "addmm_", failing)
    with pytest.raises(torch.OutOfMemoryError):
        merged.hold(1, "attn")
    monkeypatch.undo()
    merged.hold(1, "attn")
    for name, module in runner.lora.linears.items():
        assert torch.equal(module.weight, want[name]), f"{name} merged twice after the failure"
    with pytest.raises(torch.OutOfMemoryError):
        monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
        merged.hold(2, "other")
    monkeypatch.undo()
    merged.hold(0, None)
    for name, module in runner.lora.linears.items():
        assert torch.equal(module.weight, before[name]), f"{name} not restored after a failed merge"


def test_a_failed_capture_leaves_eager_merges(world, monkeypatch, caplog):
    """Where the merge graphs cannot be captured, merges run eagerly (logged) and still merge."""
    base_folder, _, adapters = world
    runner = make_runner(base_folder, merge=False)
    runner.install_adapter(1, load_weights(adapters["attn"][0], base_folder, "attn"))
    merged = runner.lora.merged_weights()
    monkeypatch.setattr(torch.Tensor, "is_cuda", True)  # so capture tries
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: (_ for _ in ()).throw(RuntimeError("scripted: no capture")))
    with caplog.at_level("WARNING", logger="mstar_actors.lora.merge"):
        merged.capture(3)
    monkeypatch.undo()
    assert merged._graphs == {} and "scripted: no capture" in caplog.text and "run eagerly" in caplog.text
    module = runner.model.model.layers[0].self_attn.o_proj
    before = module.weight.clone()
    merged.hold(1, "attn")
    assert not torch.equal(module.weight, before)
    merged.hold(0, None)
    assert torch.equal(module.weight, before)


def test_merged_weights_refuse_quantized_linears(world):
    base_folder, _, _ = world
    runner = make_runner(base_folder, merge=False)
    module = next(iter(runner.lora.linears.values()))
    module.weight = torch.nn.Parameter(module.weight.to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="quantized linears cannot be merged"):
        runner.lora.merged_weights()


# ---------------------------------------------------------------- served steps


def test_one_adapter_steps_run_merged_and_match_peft(world):
    """Two requests on one adapter (prefill, then decodes): merged from the third step on, their
    tokens are PEFT's; then a step mixing the base and another adapter restores the weights
    before it runs, and every request still gets its own model's tokens."""
    base_folder, base, adapters = world
    runner = make_runner(base_folder)
    for slot, name in ((1, "attn"), (2, "mlp")):
        runner.install_adapter(slot, load_weights(adapters[name][0], base_folder, name))
    seen = held(runner)
    p = prompts(4, 5)
    d = Driver(runner)
    d.step([d.start("a0", p[0], slot=1), d.start("a1", p[1], slot=1)], [d.chunk("a0"), d.chunk("a1")])
    for _ in range(6):
        d.step([], d.decodes("a0", "a1"))
    assert seen[:AFTER - 1] == [None] * (AFTER - 1) and set(seen[AFTER - 1:]) == {(1, 1)}
    # The base and another adapter join: restored at once, for every row's sake.
    d.step([d.start("b", p[2]), d.start("m", p[3], slot=2)], [d.chunk("b"), d.chunk("m"), *d.decodes("a0", "a1")])
    assert seen[-1] is None
    out = d.run_to_end()
    assert set(seen[-3:]) == {None}
    for rid, prompt, model in (("a0", p[0], adapters["attn"][1]), ("a1", p[1], adapters["attn"][1]),
                               ("b", p[2], base), ("m", p[3], adapters["mlp"][1])):
        assert out[rid] == generate(model, prompt), f"{rid} diverged from transformers+peft"


def test_a_slot_installed_again_is_not_served_its_old_merge(world):
    """Slot 1 merged with one adapter, its requests done, then installed with another: the next
    request on slot 1 gets the new adapter's tokens (the merge is keyed by the install)."""
    base_folder, base, adapters = world
    runner = make_runner(base_folder, max_loras=1)
    seen = held(runner)
    prompt = prompts(1, 6)[0]
    for i, name in enumerate(["attn", "mlp", "attn"]):
        runner.install_adapter(1, load_weights(adapters[name][0], base_folder, name))
        d = Driver(runner)
        d.step([d.start(f"r{i}", prompt, slot=1)], [d.chunk(f"r{i}")])
        assert d.run_to_end()[f"r{i}"] == generate(adapters[name][1], prompt), f"after installing {name} into slot 1"
        assert seen[-1] == (1, i + 1)
    runner.void_slot(1, "attn")  # a void slot's rows are the base model's, merged or not
    d = Driver(runner)
    d.step([d.start("v", prompt, slot=1)], [d.chunk("v")])
    assert d.run_to_end()["v"] == generate(base, prompt)


def test_the_layer_stack_refuses_merged_steps(tmp_path):
    """Where the CPU layer stack runs the steps (a Llama in float32), merging is refused by name."""
    from lora.test_lora_parity import make_base

    make_base("llama", tmp_path / "base")
    runner = make_runner(tmp_path / "base", merge=False)
    if not isinstance(runner.model.run_layers, CpuDecoderStack):
        pytest.skip("the CPU layer stack is not built on this machine")
    with pytest.raises(ValueError, match="layer stack reads packed copies"):
        runner.merge_one_adapter_steps(runner.lora.merged_weights(), AFTER)


def test_a_cpu_runner_keeps_no_copy_and_zero_turns_it_off(world):
    base_folder, _, _ = world
    runner = make_runner(base_folder, merge=False, merge_after_steps=4)
    assert runner.merged is None  # CPU: off
    zero = runner_factories.runner_config(base_folder, max_loras=2, merge_after_steps=0).lora
    assert merged_weights(runner.lora, zero, torch.device("cuda")) is None  # 0: no copy, on any device
    assert merged_weights(None, runner_factories.runner_config(base_folder).lora, torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_adapter_merged_on_cuda_matches_unmerged(world, dtype):
    """On the GPU, graphs and all: a float32 run merged gives PEFT's tokens; in bfloat16 the merged
    run's tokens are the unmerged run's (the merge rounds W + sBA once, as PEFT's does)."""
    base_folder, _, adapters = world
    outs = []
    for after in (2, 0):
        runner = make_runner(base_folder, merge=False, device="cuda", dtype=dtype, merge_after_steps=after,
                             max_num_seqs=8)
        assert (runner.merged is not None) == bool(after)
        runner.install_adapter(1, load_weights(adapters["mlp"][0], base_folder, "mlp"))
        d = Driver(runner)
        p = prompts(3, 7)
        d.step([d.start(f"r{i}", q, slot=1) for i, q in enumerate(p)], [d.chunk(f"r{i}") for i in range(3)])
        outs.append(d.run_to_end())
        if after:
            assert runner.merged.tenant == (1, 1)
    if dtype == "float32":
        for i, q in enumerate(prompts(3, 7)):
            assert outs[0][f"r{i}"] == generate(adapters["mlp"][1], q)
    assert outs[0] == outs[1], "merged and unmerged runs diverged"
