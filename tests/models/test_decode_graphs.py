"""Decode graphs: pure decode steps through static buffers give the eager runner's tokens.

On CPU the static path runs without capture (``enable_step_graphs(capture=
False)``): the same buffers, packing, padding and scratch block, the forward
run eagerly on them. On a GPU (``-m gpu``) the graphs are really captured and
replayed, base and LoRA rows alike, and compared with ``enforce_eager``.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from mstar_actors import messages
from mstar_actors.config import ConfigError, parse_config
from mstar_actors.runner.step_graphs import DecodeGraphs, batch_buckets
from mstar_actors.lora import BaseShapes, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.runner.model_runner import ModelRunner, PlanError
from mstar_actors.runner.sampling import sample_tokens
from plan_driver import PlanDriver
import runner_factories

BLOCK_SIZE = 4
NUM_NEW = 12
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
ADAPTERS = {  # slot: PEFT kwargs (different ranks and targets, embedding and LM head included)
    1: dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj", "lm_head", "embed_tokens"]),
    2: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
}  # fmt: skip


# ---------------------------------------------------------------- helpers


class Recorder:
    """A sampler that records each step's logits and which path produced them."""

    def __init__(self, forced: list[list[int]] | None = None):
        self.logits: list[torch.Tensor] = []
        self.forced = forced  # teacher forcing: these tokens instead of the argmax

    def __call__(self, logits, rows, generator):
        self.logits.append(logits.float().cpu().clone())
        sampled = sample_tokens(logits, rows, generator=generator)
        if self.forced is not None:
            ids = self.forced[len(self.logits) - 1]
            sampled = [messages.SampledToken(s.request_id, i) for s, i in zip(sampled, ids)]
        return sampled


def make_runner(folder, *, static: int | None = None, **overrides) -> ModelRunner:
    """A float32 CPU runner; ``static``: its pure decode steps of up to that
    many rows take the static (graph) path, run without capture."""
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0, enforce_eager=True)
    runner = runner_factories.make_runner(folder, **(kwargs | overrides))
    if static is not None:
        runner.enable_step_graphs(static, capture=False)
    return runner


def count_graph_steps(runner: ModelRunner) -> list[int]:
    """Wrap the runner's graphs; the returned list gets each graph step's row count."""
    sizes: list[int] = []
    run = runner.graphs.run

    def counted(batch, *args):
        sizes.append(len(batch.input_ids))
        return run(batch, *args)

    runner.graphs.run = counted
    return sizes


def script(runner: ModelRunner, slots: dict[str, int] | None = None,
           samplings: dict[str, messages.SamplingParams] | None = None) -> dict[str, list[int]]:
    """Padded buckets, block crossings, a finished sequence replaced, a batch over
    the graphs' max (4), prefill next to decodes. Outputs by request id
    (``samplings``: a request's own, else greedy)."""
    slots, samplings = slots or {}, samplings or {}
    gen = torch.Generator().manual_seed(5)
    lens = dict(a=6, b=3, c=9, d=5, e=4, f=7)
    prompts = {rid: torch.randint(3, 300, (n,), generator=gen).tolist() for rid, n in lens.items()}
    d = Driver(runner)

    def start(rid):
        return d.start(rid, prompts[rid], slot=slots.get(rid, 0), sampling=samplings.get(rid))

    d.step([start("a"), start("b"), start("c")], [d.chunk("a"), d.chunk("b"), d.chunk("c")])
    for _ in range(3):
        d.step([], d.decodes("a", "b", "c"))  # 3 rows in bucket 4
    d.step([start("d")], [d.chunk("d"), *d.decodes("a", "c")], finished=[d.finish("b")])  # mixed: eager
    for _ in range(2):
        d.step([], d.decodes("a", "c", "d"))  # b's rows reused by d
    d.step([start("e"), start("f")], [d.chunk("e"), d.chunk("f"), *d.decodes("a", "c", "d")])
    d.step([], d.decodes("a", "c", "d", "e", "f"))  # 5 rows > max 4: eager
    d.step([], d.decodes("a", "c", "d", "e"), finished=[d.finish("f")])  # 4 rows: no padding
    d.step([], d.decodes("a"), finished=[d.finish("c"), d.finish("d")])  # one row
    return d.run_to_end()


# ---------------------------------------------------------------- base model


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def test_static_decode_matches_eager(hf_models):
    folder, _ = hf_models("llama")
    eager_rec, static_rec = Recorder(), Recorder()
    want = script(make_runner(folder, sampler=eager_rec))
    runner = make_runner(folder, static=4, sampler=static_rec)
    sizes = count_graph_steps(runner)
    got = script(runner)
    assert got == want
    assert {1, 2, 3, 4} <= set(sizes) and 5 not in sizes  # padded buckets used; 5 rows ran eagerly
    for step, (a, b) in enumerate(zip(static_rec.logits, eager_rec.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def _sampled(temperature, seed=None, **more) -> messages.SamplingParams:
    return messages.SamplingParams(max_tokens=NUM_NEW, temperature=temperature, seed=seed, ignore_eos=True, **more)


# b and f greedy, the others seeded; e's top_p draws its steps in the sampler, after the graph.
DRAWN = dict(a=_sampled(0.9, 1), b=_sampled(0.0), c=_sampled(1.3, 7), d=_sampled(0.7, 3), e=_sampled(1.0, 11, top_p=0.9),
             f=_sampled(0.0))


def test_graphs_that_draw_give_the_samplers_tokens(hf_models, race_on_cpu):
    """``DecodeGraphs(draws=True)``: the graph's own draw is the sampler's
    (the same race kernel, here in Triton's interpreter) on the same rows."""
    folder, _ = hf_models("llama")
    want = script(make_runner(folder, static=4), samplings=DRAWN)
    runner = make_runner(folder)
    runner.enable_step_graphs(4, capture=False, draws=True)
    runner_factories.check_graph_draws(script, want, runner, runner.graphs, DRAWN)  # steps with e drew after
    assert any(len(set(tokens)) > 1 for tokens in want.values())
    greedy = make_runner(folder)
    greedy.enable_step_graphs(4, capture=False, draws=True)
    drawn = runner_factories.record_draws(greedy.graphs)
    assert script(greedy) == script(make_runner(folder, static=4))
    assert drawn and not any(drawn)  # greedy steps take their argmax after the graph


def test_graphs_draw_unseeded_rows_from_the_runners_seed(hf_models):
    """Unseeded rows take a base seed from the runner's host generator: the
    same seed draws the same tokens, another seed others."""
    if not os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the draw runs on CPU tensors only in Triton's interpreter")
    folder, _ = hf_models("llama")
    unseeded = {rid: _sampled(1.5) for rid in "abcdef"}

    def outputs(seed):
        runner = make_runner(folder, seed=seed)
        runner.enable_step_graphs(4, capture=False, draws=True)
        return script(runner, samplings=unseeded)

    first = outputs(0)
    assert outputs(0) == first
    assert outputs(1) != first


def test_scratch_block_is_never_reported_and_takes_the_padding(hf_models):
    folder, _ = hf_models("llama")
    runner = make_runner(folder, static=4)
    assert runner.ready_info(0).num_kv_blocks == runner.num_kv_blocks == 96
    assert runner.scratch_block == 96 and runner.kv_caches[0].shape[1] == 97
    script(runner)
    for kv in runner.kv_caches:
        assert not kv[:, 0].any(), "block 0 (never handed out) was written: padding must go to the scratch block"
        assert kv[:, 96].any(), "padded rows wrote nowhere"
    d = Driver(runner)
    bad = messages.ScheduledChunk("x", 0, 3, [96], True)
    with pytest.raises(PlanError, match=r"'x'.*block ids \[96\] are outside \[0, 96\)"):
        d.step([d.start("x", [5, 6, 7])], [bad])


def test_memory_sized_cache_reserves_the_scratch_block(hf_models):
    folder, _ = hf_models("llama")
    runner = make_runner(folder, num_blocks=None, memory_fraction=0.001)
    assert runner.kv_caches[0].shape[1] == runner.num_kv_blocks + 1 == runner.scratch_block + 1


def test_cpu_runner_never_captures(hf_models):
    folder, _ = hf_models("llama")
    assert make_runner(folder, enforce_eager=False).graphs is None


def test_bucket_for_names_the_limit(hf_models):
    graphs = make_runner(hf_models("llama")[0], static=4).graphs
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match=r"1\.\.4 rows \(model.cuda_graph_max_batch\); got 5"):
        graphs.bucket_for(5)


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory, hf_models):
    """(base folder, {slot: adapter weights as the worker receives them})."""
    base_folder, _ = hf_models("llama")
    root = tmp_path_factory.mktemp("adapters")
    shapes = BaseShapes.from_hf_config(AutoModelForCausalLM.from_pretrained(base_folder).config.to_dict())
    weights = {}
    for slot, kwargs in ADAPTERS.items():
        model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(**kwargs))
        torch.manual_seed(20 + slot)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.25)  # PEFT starts B at zero; a zero adapter would prove nothing
        peft_model.save_pretrained(str(root / f"ad{slot}"))
        read = read_adapter(root / f"ad{slot}", base=shapes, max_rank=MAX_RANK, name=f"ad{slot}")
        weights[slot] = adapter_from_bytes(adapter_to_bytes(read))
    return base_folder, weights


MIXED_SLOTS = dict(a=1, b=2, c=0, d=2, e=1, f=0)


def lora_runner(world, *, install=True, **overrides) -> ModelRunner:
    base_folder, weights = world
    runner = make_runner(base_folder, max_loras=2, max_lora_rank=MAX_RANK, **overrides)
    if install:
        for slot, w in weights.items():
            runner.install_adapter(slot, w)
    return runner


def test_static_lora_rows_match_eager(lora_world):
    want = script(lora_runner(lora_world), MIXED_SLOTS)
    runner = lora_runner(lora_world, static=4)
    sizes = count_graph_steps(runner)
    assert script(runner, MIXED_SLOTS) == want
    assert sizes
    base_only = script(lora_runner(lora_world))
    assert base_only != want, "the adapters changed nothing: the test would prove nothing"


def test_static_base_rows_on_a_lora_runner_skip_the_delta(lora_world, monkeypatch):
    """A step with no adapter row runs the base variant: no LoRA step at all."""
    runner = lora_runner(lora_world, static=4)
    calls = []
    monkeypatch.setattr(runner.lora, "begin_rows_step", lambda slots, **kw: calls.append(slots))
    base = script(runner)
    assert base == script(make_runner(lora_world[0]))
    assert calls == []


def test_a_moved_lora_stack_is_refused(lora_world):
    runner = lora_runner(lora_world, static=4, install=False)
    runner.install_adapter(1, lora_world[1][1])  # in place: accepted
    stack = next(iter(runner.lora.stacks.values()))
    stack.b = stack.b.clone()
    with pytest.raises(RuntimeError, match="moved after the decode graphs were captured"):
        runner.install_adapter(2, lora_world[1][2])


# ---------------------------------------------------------------- config and worker


def test_config_keys_and_the_build_reads_them():
    from mstar_actors.runner.build import graph_limits, takes_graphs

    config = parse_config({"model": {"enforce_eager": True, "cuda_graph_max_batch": 128}, "scheduler": {"max_num_seqs": 32}})
    assert config.model.enforce_eager and config.model.cuda_graph_max_batch == 128
    assert parse_config({}).model.enforce_eager is False and parse_config({}).model.cuda_graph_max_batch is None
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        parse_config({"model": {"cuda_graph_max_batch": 0}})

    cuda = torch.device("cuda")
    assert not takes_graphs(config, cuda, is_multimodal=False)  # enforce_eager
    assert takes_graphs(parse_config({}), cuda, is_multimodal=False)
    assert not takes_graphs(parse_config({}), cuda, is_multimodal=True)
    assert not takes_graphs(parse_config({}), torch.device("cpu"), is_multimodal=False)
    assert graph_limits(config)[0] == 32  # capped by scheduler.max_num_seqs
    cpu, on_cuda = parse_config({"model": {"device": "cpu"}}), parse_config({"model": {"device": "cuda"}})
    assert graph_limits(on_cuda)[0] == on_cuda.scheduler.max_num_seqs == 256  # no cliff: every batch is graphed
    assert cpu.scheduler.max_num_seqs == 64
    assert on_cuda.scheduler.async_scheduling is True and on_cuda.scheduler.steps_ahead == 2
    assert cpu.scheduler.async_scheduling is True and cpu.scheduler.steps_ahead == 1
    one_at_a_time = parse_config({"model": {"device": "cpu"}, "scheduler": {"async_scheduling": False}}).scheduler
    assert one_at_a_time.async_scheduling is False and one_at_a_time.steps_ahead == 1
    assert graph_limits(parse_config({"model": {"device": "cuda", "cuda_graph_max_batch": 96}}))[0] == 96
    if not torch.cuda.is_available():
        assert parse_config({}).scheduler.max_num_seqs == 64  # auto resolves to this host's device


# ---------------------------------------------------------------- GPU: real capture


def cuda_runner(folder, **overrides) -> ModelRunner:
    kwargs = dict(device="cuda", enforce_eager=False, cuda_graph_max_batch=4)
    return make_runner(folder, **(kwargs | overrides))


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        error = (a - b).abs().max() / b.abs().max()
        assert error < tolerance, f"step {step}: relative logits error {error:.3g} >= {tolerance}"


@pytest.mark.gpu
def test_captured_graphs_match_eager_on_cuda(hf_models):
    folder, _ = hf_models("llama")
    eager = cuda_runner(folder, enforce_eager=True)
    assert eager.graphs is None and eager.mixed_graphs is None
    want = script(eager)
    runner = cuda_runner(folder)
    assert runner.graphs is not None and runner.graphs.is_captured
    assert set(runner.graphs.graphs) == {(b, 0) for b in (1, 2, 4)}
    sizes = count_graph_steps(runner)
    assert script(runner) == want
    assert {1, 2, 3, 4} <= set(sizes)


@pytest.mark.gpu
def test_captured_graphs_draw_the_eager_samplers_tokens_on_cuda(hf_models):
    """On CUDA the decode graphs draw by default: seeded and greedy rows give
    the eager runner's tokens (float32), a top_p row's steps drawn after the graph."""
    folder, _ = hf_models("llama")
    want = script(cuda_runner(folder, enforce_eager=True), samplings=DRAWN)
    runner = cuda_runner(folder)
    runner_factories.check_graph_draws(script, want, runner, runner.graphs, DRAWN)


@pytest.mark.gpu
def test_captured_graphs_bf16_logits_close_to_eager(hf_models):
    """bf16 may flip near-ties, so the eager run is teacher-forced with the graph run's tokens."""
    folder, _ = hf_models("llama")
    graph_rec = Recorder()
    graph_out = script(cuda_runner(folder, dtype="bfloat16", sampler=graph_rec))
    forced = [[int(t) for t in step.argmax(-1)] for step in graph_rec.logits]
    eager_rec = Recorder(forced)
    assert script(cuda_runner(folder, dtype="bfloat16", enforce_eager=True, sampler=eager_rec)) == graph_out
    assert_logits_close(graph_rec.logits, eager_rec.logits, 2e-2)


@pytest.mark.gpu
def test_fused_kernels_match_the_torch_ops_on_cuda(hf_models, monkeypatch):
    """The decoder with ``triton_fused``'s kernels and with torch's ops,
    graphs captured: float32 tokens equal; bf16 logits within rounding, the
    torch run teacher-forced with the fused run's tokens."""
    from mstar_actors.models import triton_fused

    folder, _ = hf_models("llama")
    fused_rec = Recorder()
    monkeypatch.setattr(triton_fused, "enabled", True)
    want = script(cuda_runner(folder))
    fused_bf16 = script(cuda_runner(folder, dtype="bfloat16", sampler=fused_rec))
    monkeypatch.setattr(triton_fused, "enabled", False)
    assert script(cuda_runner(folder)) == want
    torch_rec = Recorder([[int(t) for t in step.argmax(-1)] for step in fused_rec.logits])
    assert script(cuda_runner(folder, dtype="bfloat16", sampler=torch_rec)) == fused_bf16
    assert_logits_close(fused_rec.logits, torch_rec.logits, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_ops", [False, True], ids=["torch_ops", "fused"])
def test_captured_lora_graphs_match_eager_on_cuda(lora_world, fused_ops, monkeypatch):
    """Every linear's A under its weight (the tiny model's A rows outweigh its weights, so the share rule is
    lifted): the graphs of each width, a narrow one among them, give the eager steps' tokens."""
    from mstar_actors.models import lora_layers, triton_fused

    monkeypatch.setattr(triton_fused, "enabled", fused_ops)
    monkeypatch.setattr(lora_layers, "MAX_FUSED_SHARE", 100.0)
    want = script(lora_runner(lora_world, device="cuda"), MIXED_SLOTS)
    runner = lora_runner(lora_world, device="cuda", enforce_eager=False, cuda_graph_max_batch=4)
    assert runner.lora.widths(4) == (2, 3) == (2, runner.lora.num_slots)
    assert set(runner.graphs.graphs) == {(b, w) for b in (1, 2, 4) for w in (0, 2, 3)}
    replayed, replay = [], runner.graphs._replay
    runner.graphs._replay = lambda key: replayed.append(key[1]) or replay(key)
    sizes = count_graph_steps(runner)
    assert script(runner, MIXED_SLOTS) == want
    assert sizes and set(replayed) == {2, 3}  # every step of the script has an adapter row
    # bf16: teacher-forced eager against the graphs, logits within tolerance.
    graph_rec = Recorder()
    graph_out = script(lora_runner(lora_world, device="cuda", dtype="bfloat16", enforce_eager=False,
                                   cuda_graph_max_batch=4, sampler=graph_rec), MIXED_SLOTS)
    forced = [[int(t) for t in step.argmax(-1)] for step in graph_rec.logits]
    eager_rec = Recorder(forced)
    assert script(lora_runner(lora_world, device="cuda", dtype="bfloat16", sampler=eager_rec), MIXED_SLOTS) == graph_out
    assert_logits_close(graph_rec.logits, eager_rec.logits, 2e-2)


@pytest.mark.gpu
def test_lora_beside_the_gemm_matches_lora_after_it_on_cuda(lora_world, monkeypatch):
    """Each linear's delta on a side stream while its GEMM runs (graphs
    captured with the fork and join inside) against the delta after the
    GEMM: float32 tokens equal; bf16 logits within rounding (the delta is
    added into the residual stream or by the next op, in another order).
    The grouped kernels from 2 rows, so that these small steps go beside."""
    from mstar_actors.lora import triton_ops
    from mstar_actors.models import lora_layers

    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", 2)
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_FUSED_ROWS", 2)

    forks = []
    fork = lora_layers.LoraHook.fork
    monkeypatch.setattr(lora_layers.LoraHook, "fork", lambda hook: forks.append(1) or fork(hook))
    monkeypatch.setattr(lora_layers, "BESIDE", False)
    want = script(lora_runner(lora_world, device="cuda"), MIXED_SLOTS)
    after_rec = Recorder()
    after = script(lora_runner(lora_world, device="cuda", dtype="bfloat16", enforce_eager=False,
                               cuda_graph_max_batch=4, sampler=after_rec), MIXED_SLOTS)
    assert not forks
    monkeypatch.setattr(lora_layers, "BESIDE", True)
    graphs = script(lora_runner(lora_world, device="cuda", enforce_eager=False, cuda_graph_max_batch=4), MIXED_SLOTS)
    assert forks, "no step ran its delta beside the GEMM: the test would prove nothing"
    assert graphs == want, "float32 graphs with the delta beside: other tokens than after"
    assert script(lora_runner(lora_world, device="cuda"), MIXED_SLOTS) == want, "float32 eager steps: other tokens"
    forced = [[int(t) for t in step.argmax(-1)] for step in after_rec.logits]
    beside_rec, exact_rec = Recorder(forced), Recorder(forced)
    assert script(lora_runner(lora_world, device="cuda", dtype="bfloat16", enforce_eager=False, cuda_graph_max_batch=4,
                              sampler=beside_rec), MIXED_SLOTS) == after
    # Both bf16 runs against float32 on the same tokens. The delta beside is
    # rounded to bf16 before it is added (after, the expand adds it in
    # float32), so the two differ by rounding. With these large random
    # adapters a step's worst logit is off float32's by 1-14% of the largest
    # in either path, growing over the steps and varying from run to run
    # (one run's 20 steps: beside 1.2-11.5%, mean 4.1%; after 1.0-13.9%,
    # mean 3.5%). A wrong delta shows in the float32 tokens above; here every
    # step stays under 25%, and beside's mean over the steps is at most 1.5x
    # after's (or than 4%).
    script(lora_runner(lora_world, device="cuda", sampler=exact_rec), MIXED_SLOTS)
    errors = []
    for beside, after_logits, exact in zip(beside_rec.logits, after_rec.logits, exact_rec.logits, strict=True):
        scale = exact.abs().max()
        errors.append([float((t - exact).abs().max() / scale) for t in (beside, after_logits)])
    message = "bf16 logits off float32's, (beside, after) per step: " + ", ".join(f"({b:.3f}, {a:.3f})" for b, a in errors)
    assert max(max(e) for e in errors) < 0.25, message
    beside_mean, after_mean = (sum(e[i] for e in errors) / len(errors) for i in (0, 1))
    assert beside_mean < 1.5 * max(after_mean, 4e-2), message


@pytest.mark.gpu
def test_lora_expand_folded_into_the_next_kernel_matches_its_own_launch_on_cuda(lora_world, monkeypatch):
    """A fused linear's expand added by the kernel after its GEMM as it loads
    (``lora_layers.FOLD``: q|k|v's by the rotary, gate|up's by SiLU-and-mul,
    o's and down's by the residual add's RMSNorm) against its own launch
    before them, graphs captured: float32 tokens equal; bf16 logits
    within rounding (the kernels sum the delta as the expand does, but may
    contract a product into it differently), teacher-forced."""
    from mstar_actors.models import lora_layers

    monkeypatch.setattr(lora_layers, "MAX_FUSED_SHARE", 100.0)  # this small model's A under every weight
    folded, apart = [], []
    pending = lora_layers.LoraHook.pending
    monkeypatch.setattr(lora_layers.LoraHook, "pending", lambda hook, t: folded.append(1) or pending(hook, t))
    apply = lora_layers.PendingExpand.apply
    monkeypatch.setattr(lora_layers.PendingExpand, "apply", lambda expand, y: apart.append(1) or apply(expand, y))
    runs = {}
    for fold in (False, True):
        monkeypatch.setattr(lora_layers, "FOLD", fold)
        exact = script(lora_runner(lora_world, device="cuda", enforce_eager=False, cuda_graph_max_batch=4), MIXED_SLOTS)
        rec = Recorder(None if not fold else [[int(t) for t in step.argmax(-1)] for step in runs[False][1].logits])
        half = script(lora_runner(lora_world, device="cuda", dtype="bfloat16", enforce_eager=False,
                                  cuda_graph_max_batch=4, sampler=rec), MIXED_SLOTS)
        runs[fold] = exact, rec, half
        assert bool(folded) is fold, "the expand was (not) left to the next kernel as FOLD says"
        assert not apart, "a folded expand was launched apart: the kernel after its GEMM did not take it"
    assert runs[True][0] == runs[False][0], "float32: other tokens with the expand folded"
    assert runs[True][2] == runs[False][2]
    assert_logits_close(runs[True][1].logits, runs[False][1].logits, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("beside", [False, True], ids=["after", "beside"])
def test_programmatic_launch_changes_no_bit_on_cuda(lora_world, beside, monkeypatch):
    """Our Triton kernels launched with programmatic dependent launch
    (``triton_launch``) against without, graphs captured, adapter rows beside
    base rows, the grouped LoRA kernels from 2 rows: the same arithmetic, only
    when each kernel may start differs, so bf16 logits are equal bit for bit.
    A kernel that read a tensor before its wait that the kernel before it
    writes would show here as a wrong or varying logit."""
    from mstar_actors import triton_launch
    from mstar_actors.lora import triton_ops
    from mstar_actors.models import lora_layers

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer")
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", 2)
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_FUSED_ROWS", 2)
    monkeypatch.setattr(lora_layers, "BESIDE", beside)
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(triton_launch, "enabled", pdl)
        assert triton_launch.pdl(torch.empty(1, device="cuda")) is pdl
        rec = Recorder()
        out = script(lora_runner(lora_world, device="cuda", dtype="bfloat16", enforce_eager=False,
                                 cuda_graph_max_batch=4, sampler=rec), MIXED_SLOTS)
        runs[pdl] = out, rec.logits
    assert runs[True][0] == runs[False][0]
    for step, (with_pdl, without) in enumerate(zip(runs[True][1], runs[False][1], strict=True)):
        assert torch.equal(with_pdl, without), f"step {step}: logits differ by {(with_pdl - without).abs().max():.3g}"


@pytest.mark.gpu
def test_adapter_installed_after_capture_is_used_by_the_graphs(lora_world):
    want = script(lora_runner(lora_world, device="cuda"), MIXED_SLOTS)
    runner = lora_runner(lora_world, device="cuda", enforce_eager=False, cuda_graph_max_batch=4, install=False)
    assert runner.graphs.is_captured  # captured with every slot empty
    for slot, w in lora_world[1].items():
        runner.install_adapter(slot, w)
    assert script(runner, MIXED_SLOTS) == want


@pytest.mark.gpu
def test_enforce_eager_captures_nothing_on_cuda(hf_models):
    folder, _ = hf_models("llama")
    assert cuda_runner(folder, enforce_eager=True).graphs is None
    assert isinstance(cuda_runner(folder).graphs, DecodeGraphs)
