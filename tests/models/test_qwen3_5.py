"""Qwen3.5's hybrid text model against transformers on the same random weights.

Greedy tokens in float32 must equal ``generate``: prompts longer than a
chunk (prefill in several chunks, each continuing the DeltaNet state from
its slot), prompts of different lengths side by side in the same steps
(single-token and multi-token rows mixed), and a preempted sequence that
is recomputed from token 0 on another slot. bfloat16 and float16 run the
same model within their rounding.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import runner_factories
from .engine_loop import Engine
from .hybrid_factories import VOCAB, generate, interpreted_cuda_ops, make_qwen3_5
from mstar_actors import messages
from mstar_actors.models.loader import load_spec
from mstar_actors.models.sharding import tp_refusal
from mstar_actors.models.spec import ModelLoadError
from mstar_actors.runner.model_runner import PlanError
from plan_driver import PlanDriver

BLOCK_SIZE = 4
NUM_NEW = 12
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    return folder, make_qwen3_5(folder)


def make_runner(folder, **overrides):
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, max_num_seqs=6, seed=0)
    return runner_factories.make_runner(folder, **(kwargs | overrides))


def prompts(seed: int = 3) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(2, VOCAB, (n,), generator=gen).tolist() for rid, n in [("long", 37), ("mid", 20), ("short", 5), ("one", 1)]}


def test_builds_kv_for_attention_layers_and_a_state_slot_per_sequence(world):
    folder, _ = world
    runner = make_runner(folder)
    assert len(runner.kv_caches) == 1  # one full-attention layer of four
    assert runner.num_state_slots == 6 and runner.ready_info(0).num_state_slots == 6
    pool = runner.model.model.layers[0].linear_attn.pool
    assert pool.conv.shape == (7, 2 * 32 + 64, 3) and pool.ssm.shape == (7, 4, 16, 16) and pool.ssm.dtype == torch.float32


def test_chunked_prefill_and_mixed_steps_match_transformers(world):
    assert_chunked_steps_match_transformers(*world)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels on CPU tensors need Triton's interpreter (no CUDA)")
def test_its_cuda_only_kernels_keep_the_tokens_in_the_interpreter(world, monkeypatch):
    """The hybrid layers' kernels that run on CUDA only (``cuda_fused_ops``:
    the DeltaNet's gated RMSNorm, the gated attention's norms, rotary and KV
    write), here on CPU tensors in Triton's interpreter: the same greedy
    tokens as transformers, prefill in chunks beside decodes."""
    ran = interpreted_cuda_ops(monkeypatch)
    assert_chunked_steps_match_transformers(*world)
    assert ran and all(ran)  # the fused attention ran every time


def assert_chunked_steps_match_transformers(folder, hf):
    d = Driver(make_runner(folder))
    ps = prompts()
    # Every prompt in chunks of at most 7 tokens, side by side with the others' decodes.
    d.step([d.start(rid, p) for rid, p in ps.items()], [d.chunk(rid, min(7, len(p))) for rid, p in ps.items()])
    while any(len(s["outputs"]) < NUM_NEW for s in d.seqs.values()):
        chunks = []
        for rid, s in d.seqs.items():
            left = s["num_prompt"] + len(s["outputs"]) - s["done"]
            if len(s["outputs"]) < NUM_NEW:
                chunks.append(d.chunk(rid, min(7, left)))
        d.step([], chunks)
    for rid, p in ps.items():
        assert [*d.seqs[rid]["outputs"]] == generate(hf, p, NUM_NEW), f"{rid} ({len(p)} prompt tokens) diverged"


def test_a_preempted_sequence_recomputes_its_state_on_another_slot(world):
    folder, hf = world
    d = Driver(make_runner(folder))
    p = prompts()["mid"]
    other = prompts(seed=4)["long"]
    d.step([d.start("a", p), d.start("b", other)], [d.chunk("a"), d.chunk("b")])
    for _ in range(4):
        d.step([], d.decodes("a", "b"))
    outputs, slot = list(d.seqs["a"]["outputs"]), d.seqs["a"]["state"]
    # Preempt by recompute: forget it, restart from token 0 with the tokens it had (prompt + outputs).
    finished = d.finish("a")
    restart = d.start("c", [0])  # another sequence takes the freed slot meanwhile
    d.step([restart], [d.chunk("c"), *d.decodes("b")], finished=[finished])
    again = d.start("a", p, outputs=outputs)
    assert again.state_slot != slot
    d.step([again], [d.chunk("a"), *d.decodes("b", "c")])
    result = d.run_to_end()
    assert result["a"] == generate(hf, p, NUM_NEW)
    assert result["b"] == generate(hf, other, NUM_NEW)


def test_prefix_hits_restore_the_recurrent_state_from_a_snapshot(world):
    """Through the real scheduler: a repeated prompt and the next turn of a
    conversation hit the prefix that ends at the first prompt's last full
    block, restore the state after it, and still give transformers' tokens."""
    folder, hf = world
    engine = Engine(make_runner(folder), max_num_batched_tokens=16)  # the first prompt in chunks
    first = prompts()["long"][:23]  # snapshot point: 20 tokens (five blocks of 4, one token after)
    (out, done), = engine.run({"a": first}, GREEDY).values()
    assert out == generate(hf, first, NUM_NEW) and done.num_cached_tokens == 0
    assert any(c.snapshot >= 0 for plan in engine.plans for c in plan.scheduled)
    (again, done), = engine.run({"b": first}, GREEDY).values()
    assert again == out and done.num_cached_tokens == 20
    turn = first + out + [5, 6, 7, 8, 9]
    (nxt, done), = engine.run({"c": turn}, GREEDY).values()
    assert done.num_cached_tokens == 20 and nxt == generate(hf, turn, NUM_NEW)


def test_without_snapshots_a_hybrid_model_recomputes_every_prefix(world):
    folder, hf = world
    runner = make_runner(folder, state_snapshots=0)
    assert runner.num_state_snapshots == 0
    engine = Engine(runner)
    first = prompts()["long"][:23]
    engine.run({"a": first}, GREEDY)
    (again, done), = engine.run({"b": first}, GREEDY).values()
    assert done.num_cached_tokens == 0 and again == generate(hf, first, NUM_NEW)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_stay_close_to_float32(world, dtype):
    folder, hf = world
    runner = make_runner(folder, dtype=dtype)
    p = prompts()["long"]
    seen = {}

    def record(logits, rows, generator):
        seen["logits"] = logits
        return []

    runner.sampler = record
    d = Driver(runner)
    d.step([d.start("a", p)], [d.chunk("a", 20)])
    d.step([], [d.chunk("a")])
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0, -1].float()
    got = seen["logits"][0]
    assert (got - want).norm() / want.norm() < 3e-2


def test_a_sequence_without_its_own_state_slot_is_refused(world):
    folder, _ = world
    runner = make_runner(folder)
    start = messages.SeqStart("a", [5, 6], GREEDY, [])  # no state_slot
    with pytest.raises(PlanError, match="state_slot -1 is outside"):
        runner.start([start])
    runner.start([messages.SeqStart("b", [5, 6], GREEDY, [], state_slot=2)])
    with pytest.raises(PlanError, match="state_slot 2 is held by running request 'b'"):
        runner.start([messages.SeqStart("c", [5, 6], GREEDY, [], state_slot=2)])


def test_moe_variant_and_tensor_parallelism_are_refused_by_name(world, tmp_path):
    folder, _ = world
    cfg = json.loads((folder / "config.json").read_text())
    _, spec = load_spec(folder, cfg)
    assert "linear-attention layers" in tp_refusal(spec, 2)
    cfg["architectures"] = ["Qwen3_5MoeForCausalLM"]
    with pytest.raises(ModelLoadError, match="mixture-of-experts family .* not served yet"):
        load_spec(tmp_path, cfg)
