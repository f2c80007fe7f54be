"""Mixed-step graphs: steps with prefill chunks through static buffers give the eager runner's tokens.

On CPU the static path runs without capture (``enable_step_graphs(...,
capture=False)``): the same staging, padding, work plan and scratch block,
the forward run eagerly on them with the torch backend reading the
``varlen_work`` tensors. On a GPU (``-m gpu``) the graphs are really
captured and replayed, base and LoRA rows alike, and compared with
``enforce_eager``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lora.lora_factories import make_adapter
from mstar_actors import messages
from mstar_actors.config import ConfigError, parse_config
from mstar_actors.models.deltanet_ops import RECURRENT_MAX, static_sizes, static_step_plan
from mstar_actors.runner.step_graphs import MixedGraphs, _Staging, chunk_seq_buckets, token_buckets
from mstar_actors.lora import BaseShapes, read_adapter
from mstar_actors.runner.model_runner import ModelRunner
from mstar_actors.models.attention import TorchPagedAttention
from mstar_actors.runner.sampling import sample_tokens
from plan_driver import PlanDriver
import runner_factories

BLOCK_SIZE = 4
NUM_NEW = 12
MAX_SEQS = 4
MAX_TOKENS = 32  # buckets 16 and 32
MAX_RANK = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
ADAPTERS = {  # slot: PEFT kwargs (different ranks and targets; slot 1 has the LM head and the embedding)
    1: dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj", "lm_head", "embed_tokens"]),
    2: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
}  # fmt: skip
SLOTS = dict(a=1, b=0, c=2, d=1, e=0, f=1, g=2, h=0)  # f shares a's prefix: same adapter


# ---------------------------------------------------------------- helpers


class Recorder:
    """A sampler that records each step's logits (teacher-forced when ``forced``)."""

    def __init__(self, forced: list[list[int]] | None = None):
        self.logits: list[torch.Tensor] = []
        self.forced = forced

    def __call__(self, logits, rows, generator):
        self.logits.append(logits.float().cpu().clone())
        sampled = sample_tokens(logits, rows, generator=generator)
        if self.forced is not None:
            ids = self.forced[len(self.logits) - 1]
            sampled = [messages.SampledToken(s.request_id, i) for s, i in zip(sampled, ids)]
        return sampled


def make_runner(folder, *, graphs: bool = True, max_tokens: int = MAX_TOKENS, **overrides) -> ModelRunner:
    """A float32 CPU runner; with ``graphs`` its steps take the static paths, run without capture."""
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0, enforce_eager=True)
    runner = runner_factories.make_runner(folder, **(kwargs | overrides))
    if graphs:
        runner.enable_step_graphs(MAX_SEQS, max_tokens, capture=False)
    return runner


def record_paths(runner: ModelRunner) -> list[tuple[str, int]]:
    """Wrap the runner's graphs; the returned list gets ``(kind, tokens)`` of each graph step."""
    paths: list[tuple[str, int]] = []
    for kind, graphs in (("decode", runner.graphs), ("mixed", runner.mixed_graphs)):
        if graphs is not None:
            graphs.run = functools.partial(_counted, graphs.run, kind, paths)
    return paths


def _counted(run, kind, paths, batch, *args):
    paths.append((kind, len(batch.input_ids)))
    return run(batch, *args)


def script(runner: ModelRunner, slots: dict[str, int] | None = None,
           samplings: dict[str, messages.SamplingParams] | None = None) -> dict[str, list[int]]:
    """Prefill-only and mixed steps in both buckets, chunked prefill, a
    prefix-cache hit, an oversize chunk and a step over max_seqs (both
    eager), then decodes. Outputs by request id (``samplings``: a request's
    own, else greedy)."""
    slots, samplings = slots or {}, samplings or {}
    gen = torch.Generator().manual_seed(7)
    lens = dict(a=6, b=3, c=9, d=20, e=5, g=40, h=4)
    prompts = {rid: torch.randint(3, 300, (n,), generator=gen).tolist() for rid, n in lens.items()}
    prompts["f"] = prompts["a"][:BLOCK_SIZE] + torch.randint(3, 300, (10,), generator=gen).tolist()
    d = Driver(runner)

    def start(rid, **kw):
        return d.start(rid, prompts[rid], slot=slots.get(rid, 0), sampling=samplings.get(rid), **kw)

    d.step([start("a"), start("b")], [d.chunk("a"), d.chunk("b")])  # prefill only: 9 tokens, 2 of 4 seqs
    d.step([], d.decodes("a", "b"))  # decode graph
    d.step([start("c")], [d.chunk("c"), *d.decodes("a", "b")])  # one chunk beside decodes: 11 tokens
    d.step([start("d"), start("e")], [d.chunk("d", 7), d.chunk("e"), *d.decodes("a", "c")])  # d chunked: 14
    d.step([], [d.chunk("d"), *d.decodes("a", "b", "e")])  # d's last 13 + 3 decodes: 16, no padding
    d.step([], [*d.decodes("a", "b", "c", "d")])
    shared = d.seqs["a"]["blocks"][:1]  # a's first block holds f's first 4 tokens
    d.step([start("f", shared_blocks=shared, num_computed=BLOCK_SIZE)], [d.chunk("f"), *d.decodes("a", "b", "c")],
           finished=[d.finish("d"), d.finish("e")])  # prefix hit: context 14 > 10 queries; 13 tokens
    d.step([start("g")], [d.chunk("g"), *d.decodes("a", "f")])  # 42 tokens > 32: eager
    d.step([start("h")], [d.chunk("h"), *d.decodes("a", "b", "c", "f")], finished=[d.finish("g")])  # 5 seqs: eager
    d.step([], [*d.decodes("b", "c")])
    d.step([start("d", outputs=())], [d.chunk("d", 19), *d.decodes("b", "c", "h")])  # 22 tokens: bucket 32
    return d.run_to_end()


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def check_against_eager(make, slots=None) -> list[tuple[str, int]]:
    """Run ``script`` eagerly and through the static paths; tokens and logits
    must match. Returns the static run's graph steps."""
    eager_rec, static_rec = Recorder(), Recorder()
    want = script(make(graphs=False, sampler=eager_rec), slots)
    runner = make(sampler=static_rec)
    paths = record_paths(runner)
    assert script(runner, slots) == want
    assert_same_logits(static_rec.logits, eager_rec.logits)
    return paths


# ---------------------------------------------------------------- base model


def test_token_buckets():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(8) == [8]


def test_chunk_seq_buckets():
    """0 (no chunked call), powers of four, then the most a bucket holds: the
    sequences, or as many as its tokens make longer than RECURRENT_MAX each."""
    assert RECURRENT_MAX == 64
    assert chunk_seq_buckets(2048, 256) == [0, 1, 4, 16, 31]
    assert chunk_seq_buckets(512, 100) == [0, 1, 4, 7]
    assert chunk_seq_buckets(1024, 3) == [0, 1, 3]
    assert chunk_seq_buckets(130, 8) == [0, 1, 2]
    assert chunk_seq_buckets(64, 256) == [0] and chunk_seq_buckets(2048, 0) == [0]


def test_static_step_plan_splits_short_sequences_from_longer_ones():
    """Sequences of at most RECURRENT_MAX tokens become recurrent entries
    (their first row, slot, context and token count), the longer ones
    gathered rows with their own varlen layout; every field padded to
    ``static_sizes`` of the bucket (padding entries -1 on the scratch slot
    with a fresh context and no tokens, gathered padding rows past the step,
    empty sequences on the scratch slot)."""
    query_lens, context_lens, slots = [1, 70, 1, 3, 0], [40, 70, 1, 9, 0], [5, 2, 7, 0, 9]
    plan = static_step_plan(query_lens, context_lens, slots, num_tokens=80, num_entries=4, num_chunk_seqs=4,
                            scratch_slot=11)
    assert {name: len(values) for name, values in plan._asdict().items()} == static_sizes(80, 4, 4)
    assert plan.decode_rows == [0, 71, 72, -1] and plan.decode_counts == [1, 1, 3, 0]
    assert plan.decode_slots == [5, 7, 0, 11] and plan.decode_context == [40, 1, 9, 1]
    assert plan.chunk_rows == [*range(1, 71), *[80] * 10]
    assert plan.cu_seqlens == [0, 70, 70, 70, 70, 70]
    assert plan.chunk_slots == [2, 11, 11, 11, 11] and plan.chunk_continues == [0, 0, 0, 0, 0]
    assert plan.chunk_indices == [0, 0, 0, 1, *[4, 0] * 3]
    step = plan.to_step("cpu")
    assert step.decode_counts.dtype == step.decode_context.dtype == torch.int32
    assert step.chunk_continues.dtype == torch.bool and step.chunk_indices.shape == (5, 2)
    assert step.decode_rows.tolist() == plan.decode_rows and step.chunk_rows.dtype == torch.long
    short = static_step_plan([1, 3, 64], [5, 3, 70], [1, 2, 3], num_tokens=128, num_entries=4, num_chunk_seqs=0,
                             scratch_slot=11)
    assert short.decode_rows == [0, 1, 4, -1] and short.decode_counts == [1, 3, 64, 0]
    assert short.chunk_rows == short.cu_seqlens == short.chunk_slots == short.chunk_indices == []
    with pytest.raises(ValueError, match="1 longer ones"):
        static_step_plan(query_lens, context_lens, slots, num_tokens=80, num_entries=4, num_chunk_seqs=0,
                         scratch_slot=11)
    with pytest.raises(ValueError, match="3 sequences of at most 64 tokens"):
        static_step_plan(query_lens, context_lens, slots, num_tokens=80, num_entries=2, num_chunk_seqs=4,
                         scratch_slot=11)


def test_a_hybrid_models_steps_pick_their_longer_sequence_bucket(tmp_path):
    """A hybrid model's mixed-step graphs (laid out on CPU, not run): a step
    of decode rows and chunks of at most RECURRENT_MAX tokens takes the
    bucket without a chunked call, one with a longer chunk the smallest
    that holds it; the delta rule's fields come out as ``static_sizes`` says,
    context lengths and token counts int32 as the recurrent kernel reads them."""
    import types

    from .hybrid_factories import make_qwen3_5

    make_qwen3_5(tmp_path)
    runner = runner_factories.make_runner(tmp_path, dtype="float32", device="cpu", block_size=4, num_blocks=96,
                                          seed=0, enforce_eager=True)
    runner.enable_step_graphs(4, 256, capture=False)
    graphs = runner.mixed_graphs
    assert graphs.seq_buckets == {16: [0], 32: [0], 64: [0], 128: [0, 1], 256: [0, 1, 3]}

    def batch(query_lens):
        tokens = sum(query_lens)
        return types.SimpleNamespace(
            input_ids=[3] * tokens, positions=list(range(tokens)), slot_mapping=list(range(tokens)),
            device_inputs=[], query_lens=query_lens, context_lens=[n + 2 for n in query_lens],
            block_tables=[[1]] * len(query_lens), chunk_slots=[0] * len(query_lens),
            state_slots=list(range(len(query_lens))), logits_indices=[tokens - 1], sample_slots=[0])

    for query_lens, key in [([1, 1, RECURRENT_MAX], (128, 0)), ([1, RECURRENT_MAX + 1, 2], (128, 1)),
                            ([70, 70, 1], (256, 3))]:
        assert graphs._load(batch(query_lens)) == key, query_lens
        graphs._stage.upload(graphs._tables_start)
        step = graphs._static_step(*key)
        assert {name: field.numel() for name, field in step._asdict().items()} == static_sizes(key[0], 4, key[1])
        assert step.decode_context.dtype == step.decode_counts.dtype == torch.int32
        assert step.chunk_continues.dtype == torch.bool and step.decode_rows.dtype == torch.long
        short = [n for n in query_lens if n <= RECURRENT_MAX]
        assert step.decode_counts.tolist() == short + [0] * (4 - len(short))


def test_static_mixed_steps_match_eager(hf_models):
    folder, _ = hf_models("llama")
    paths = check_against_eager(functools.partial(make_runner, folder))
    mixed = [n for kind, n in paths if kind == "mixed"]
    assert mixed[:6] == [9, 11, 14, 16, 13, 22], paths  # 42 tokens and 5 sequences ran eagerly
    assert ("decode", 2) in paths


def _sampled(temperature, seed=None, **more) -> messages.SamplingParams:
    return messages.SamplingParams(max_tokens=NUM_NEW, temperature=temperature, seed=seed, ignore_eos=True, **more)


# b and e greedy, the others seeded; h's top_p draws its steps in the sampler, after the graph.
DRAWN = {rid: _sampled(0.7 + 0.1 * i, seed=i) for i, rid in enumerate("acdfg")}
DRAWN |= dict(b=_sampled(0.0), e=_sampled(0.0), h=_sampled(1.0, 3, top_p=0.8))


def test_mixed_graphs_that_draw_give_the_samplers_tokens(hf_models, race_on_cpu):
    """``MixedGraphs(draws=True)``: the graph's own draw of its sampled rows
    is the sampler's (the same race kernel, in Triton's interpreter); h's
    top_p draws its steps after the graph."""
    folder, _ = hf_models("llama")
    want = script(make_runner(folder), samplings=DRAWN)
    runner = make_runner(folder, graphs=False)
    runner.enable_step_graphs(MAX_SEQS, MAX_TOKENS, capture=False, draws=True)
    runner_factories.check_graph_draws(script, want, runner, runner.mixed_graphs, DRAWN)


def test_bucket_for_names_the_limits(hf_models):
    graphs = make_runner(hf_models("llama")[0]).mixed_graphs
    assert graphs.buckets == [16, 32]
    assert [graphs.bucket_for(n, 2) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]
    assert not graphs.takes(33, 1) and not graphs.takes(8, 5)
    with pytest.raises(ValueError, match=r"1\.\.32 tokens \(model.cuda_graph_max_tokens\) in 1\.\.4 sequences "
                                         r"\(model.cuda_graph_max_batch\); got 33 in 2"):
        graphs.bucket_for(33, 2)


def test_one_host_to_device_copy_per_step(hf_models, monkeypatch):
    runner = make_runner(hf_models("llama")[0])
    uploads = []
    upload = _Staging.upload
    monkeypatch.setattr(_Staging, "upload", lambda self, stop: (uploads.append(stop), upload(self, stop)))
    d = Driver(runner)
    d.step([d.start("a", [5, 6, 7, 8, 9]), d.start("b", [3, 4])], [d.chunk("a"), d.chunk("b")])
    d.step([], d.decodes("a", "b"))
    assert len(uploads) == 2


def test_padding_rows_never_reach_real_rows(hf_models, monkeypatch):
    """A backend that leaves NaN in the rows no work item covers (as a kernel
    may leave unwritten memory) changes nothing: the graph zeroes them."""
    folder, _ = hf_models("llama")
    want_rec, got_rec = Recorder(), Recorder()
    want = script(make_runner(folder, sampler=want_rec))
    attend = TorchPagedAttention._attend_varlen

    def leaves_nan(self, q, kv_cache, meta, scale):
        out = attend(self, q, kv_cache, meta, scale)
        out[int(meta.query_start[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(TorchPagedAttention, "_attend_varlen", leaves_nan)
    runner = make_runner(folder, sampler=got_rec)
    assert script(runner) == want
    assert_same_logits(got_rec.logits, want_rec.logits)
    assert all(kv.isfinite().all() for kv in runner.kv_caches), "padding tokens wrote NaN K/V"


def test_max_tokens_zero_keeps_mixed_steps_eager(hf_models):
    runner = make_runner(hf_models("llama")[0], max_tokens=0)
    assert runner.mixed_graphs is None and runner.graphs is not None
    paths = record_paths(runner)
    script(runner)
    assert paths and all(kind == "decode" for kind, _ in paths)


def test_multimodal_models_keep_eager_steps(tmp_path):
    from .vl_factories import make_hf_vl_model

    make_hf_vl_model(tmp_path)
    runner = make_runner(tmp_path, graphs=False)
    with pytest.raises(ValueError, match="multimodal; its steps run eagerly"):
        runner.enable_step_graphs(MAX_SEQS, MAX_TOKENS, capture=False)


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory, hf_models):
    """(base folder, {slot: adapter weights})."""
    base_folder, hf = hf_models("llama")
    root = tmp_path_factory.mktemp("adapters")
    shapes = BaseShapes.from_hf_config(hf.config.to_dict())
    weights = {}
    for slot, kwargs in ADAPTERS.items():
        folder, _ = make_adapter(root, copy.deepcopy(hf), seed=30 + slot, name=f"ad{slot}", **kwargs)
        weights[slot] = read_adapter(folder, base=shapes, max_rank=MAX_RANK, name=f"ad{slot}")
    return base_folder, weights


def lora_runner(world, *, install: bool = True, **overrides) -> ModelRunner:
    base_folder, weights = world
    runner = make_runner(base_folder, max_loras=2, max_lora_rank=MAX_RANK, **overrides)
    if install:
        for slot, w in weights.items():
            runner.install_adapter(slot, w)
    return runner


def test_static_lora_rows_match_eager(lora_world):
    """Rows on slots 1 and 2 and base rows in the same steps; slot 1 targets the LM head."""
    paths = check_against_eager(functools.partial(lora_runner, lora_world), SLOTS)
    assert sum(kind == "mixed" for kind, _ in paths) >= 6
    assert script(lora_runner(lora_world, graphs=False)) != script(lora_runner(lora_world, graphs=False), SLOTS), \
        "the adapters changed nothing: the test would prove nothing"


def test_static_lora_sampled_rows_have_their_own_slots(lora_world, monkeypatch):
    """The token rows and the LM head's sampled rows get separate slot tensors."""
    runner = lora_runner(lora_world)
    calls = []
    begin = type(runner.lora).begin_rows_step
    monkeypatch.setattr(type(runner.lora), "begin_rows_step",
                        lambda self, rows, sampled=None, **kw: (calls.append((rows.tolist(), sampled.tolist())),
                                                                begin(self, rows, sampled, **kw)))
    d = Driver(runner)
    d.step([d.start("a", [5, 6, 7], slot=1), d.start("b", [3, 4], slot=0), d.start("c", [8, 9, 10, 11], slot=2)],
           [d.chunk("a"), d.chunk("b"), d.chunk("c", 2)])
    assert calls == [([1, 1, 1, 0, 0, 2, 2] + [0] * 9, [1, 0, 0, 0])]  # c's partial chunk samples nothing


def test_static_base_steps_on_a_lora_runner_skip_the_delta(lora_world, monkeypatch):
    runner = lora_runner(lora_world)
    calls = []
    monkeypatch.setattr(runner.lora, "begin_rows_step", lambda *args, **kw: calls.append(args))
    assert script(runner) == script(make_runner(lora_world[0], graphs=False))
    assert calls == []


def test_a_moved_lora_stack_is_refused_by_the_mixed_graphs(lora_world):
    runner = lora_runner(lora_world, install=False)
    runner.graphs = None  # only the mixed graphs check
    stack = next(iter(runner.lora.stacks.values()))
    stack.a = stack.a.clone()
    with pytest.raises(RuntimeError, match="moved after the mixed-step graphs were captured"):
        runner.install_adapter(1, lora_world[1][1])


# ---------------------------------------------------------------- config and worker


def test_config_key_and_the_build_reads_it():
    assert parse_config({}).model.cuda_graph_max_tokens == 2048
    assert parse_config({"model": {"cuda_graph_max_tokens": 0}}).model.cuda_graph_max_tokens == 0
    with pytest.raises(ConfigError, match=r"Expected `int` >= 0 - at `\$.model.cuda_graph_max_tokens`"):
        parse_config({"model": {"cuda_graph_max_tokens": -1}})

    from mstar_actors.runner.build import graph_limits

    assert graph_limits(parse_config({"model": {"cuda_graph_max_tokens": 256}}))[1] == 256
    # No step holds more tokens than the scheduler batches.
    assert graph_limits(parse_config({"scheduler": {"max_num_batched_tokens": 512}}))[1] == 512


# ---------------------------------------------------------------- GPU: real capture


def cuda_runner(folder, **overrides) -> ModelRunner:
    kwargs = dict(device="cuda", enforce_eager=False, cuda_graph_max_batch=MAX_SEQS, cuda_graph_max_tokens=MAX_TOKENS)
    return make_runner(folder, graphs=False, **(kwargs | overrides))


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        error = (a - b).abs().max() / b.abs().max()
        assert error < tolerance, f"step {step}: relative logits error {error:.3g} >= {tolerance}"


def check_captured(make, slots=None) -> None:
    """float32 tokens equal to eager; bf16 logits within 2e-2 of an eager run
    teacher-forced with the graph run's tokens (bf16 may flip near-ties)."""
    want = script(make(enforce_eager=True), slots)
    runner = make()
    assert runner.mixed_graphs is not None and runner.mixed_graphs.is_captured
    paths = record_paths(runner)
    assert script(runner, slots) == want
    assert [n for kind, n in paths if kind == "mixed"][:6] == [9, 11, 14, 16, 13, 22]
    graph_rec = Recorder()
    graph_out = script(make(dtype="bfloat16", sampler=graph_rec), slots)
    forced = [[int(t) for t in step.argmax(-1)] for step in graph_rec.logits]
    eager_rec = Recorder(forced)
    assert script(make(dtype="bfloat16", enforce_eager=True, sampler=eager_rec), slots) == graph_out
    assert_logits_close(graph_rec.logits, eager_rec.logits, 2e-2)


@pytest.mark.gpu
def test_captured_mixed_graphs_match_eager_on_cuda(hf_models):
    folder, _ = hf_models("llama")
    runner = cuda_runner(folder)
    assert set(runner.mixed_graphs.graphs) == {(16, False), (32, False)}
    check_captured(functools.partial(cuda_runner, folder))


@pytest.mark.gpu
def test_captured_mixed_graphs_draw_the_eager_samplers_tokens_on_cuda(hf_models):
    """On CUDA the graphs draw by default: seeded and greedy rows give the
    eager runner's tokens (float32)."""
    folder, _ = hf_models("llama")
    want = script(cuda_runner(folder, enforce_eager=True), samplings=DRAWN)
    runner = cuda_runner(folder)
    runner_factories.check_graph_draws(script, want, runner, runner.mixed_graphs, DRAWN)


@pytest.mark.gpu
def test_captured_lora_mixed_graphs_match_eager_on_cuda(lora_world, monkeypatch):
    """Every linear's A under its weight (the share rule lifted for the tiny model): the 16-token
    bucket has a narrow width's graph too."""
    from mstar_actors.models import lora_layers

    monkeypatch.setattr(lora_layers, "MAX_FUSED_SHARE", 100.0)
    make = functools.partial(lora_runner, lora_world, device="cuda", enforce_eager=False, graphs=False,
                             cuda_graph_max_batch=MAX_SEQS, cuda_graph_max_tokens=MAX_TOKENS)
    assert set(make().mixed_graphs.graphs) == {(16, 0), (16, 2), (16, 3), (32, 0), (32, 3)}
    check_captured(make, SLOTS)


@pytest.mark.gpu
def test_mixed_buckets_are_capped_by_the_batched_tokens(hf_models):
    folder, _ = hf_models("llama")
    assert cuda_runner(folder, max_num_batched_tokens=24).mixed_graphs.buckets == [16, 24]
    assert cuda_runner(folder, cuda_graph_max_tokens=0).mixed_graphs is None
    assert cuda_runner(folder, enforce_eager=True).mixed_graphs is None
    assert isinstance(cuda_runner(folder).mixed_graphs, MixedGraphs)
