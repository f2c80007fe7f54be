"""Greedy decoding through the runner, driven by hand-built StepPlans, equals
``transformers.generate`` token for token: concurrent sequences, chunked
prefill, a prefix-cache hit and a preemption with restart."""

from __future__ import annotations

import functools

import json
import shutil

import pytest
import torch

from mstar_actors import messages
from plan_driver import PlanDriver
import runner_factories
from mstar_actors.runner import model_runner
from mstar_actors.runner.model_runner import ModelRunner, PlanError, SeqState, build_batch

from .factories import CONFIGS

BLOCK_SIZE = 4
NUM_NEW = 32
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


def reference(hf, prompt: list[int]) -> list[int]:
    hf.generation_config.eos_token_id = None  # like ignore_eos: always NUM_NEW tokens
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def make_runner(folder, **overrides) -> ModelRunner:
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0)
    return runner_factories.make_runner(folder, **(kwargs | overrides))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_scripted_plans_match_generate(kind, hf_models):
    folder, hf = hf_models(kind)
    outputs, prompts = run_script(make_runner(folder))
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference(hf, prompt), f"sequence {rid} diverged"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama3-tied", "qwen3"])
def test_scripted_plans_match_generate_on_cuda(kind, hf_models):
    folder, hf = hf_models(kind)
    outputs, prompts = run_script(make_runner(folder, device="cuda"))
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference(hf, prompt), f"sequence {rid} diverged"
    half, _ = run_script(make_runner(folder, device="cuda", dtype="bfloat16"))
    assert all(len(out) == NUM_NEW for out in half.values())


def run_script(runner: ModelRunner) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Drive four sequences through every kind of step; return (outputs, prompts) by request id."""
    gen = torch.Generator().manual_seed(7)
    prompt_a = torch.randint(3, 500, (30,), generator=gen).tolist()
    prompt_b = torch.randint(3, 500, (5,), generator=gen).tolist()
    prompt_c = prompt_a[:24] + torch.randint(3, 500, (7,), generator=gen).tolist()  # shares 6 full blocks
    prompt_d = torch.randint(3, 500, (9,), generator=gen).tolist()
    d = Driver(runner)

    # Chunked prefill of A over three steps, mixed with B's and D's prefill and decodes.
    d.step([d.start("a", prompt_a), d.start("b", prompt_b), d.start("d", prompt_d)], [d.chunk("a", 12), d.chunk("b"), d.chunk("d")])
    d.step([], [d.chunk("a", 12), *d.decodes("b", "d")])
    d.step([], [d.chunk("a", 6), *d.decodes("b", "d")])
    # Prefix-cache hit: C reuses A's first six blocks and starts at num_computed=24.
    c_start = d.start("c", prompt_c, shared_blocks=d.seqs["a"]["blocks"][:6], num_computed=24)
    d.step([c_start], [d.chunk("c"), *d.decodes("a", "b", "d")])
    while len(d.seqs["d"]["outputs"]) < 10:
        d.step([], d.decodes("a", "b", "c", "d"))
    # Preemption: D is dropped (blocks freed), others run, then D restarts with its outputs.
    d_outputs = list(d.seqs["d"]["outputs"])
    d.step([], d.decodes("a", "b", "c"), finished=[d.finish("d")])
    d.step([], d.decodes("a", "b", "c"))
    restart = d.start("d", prompt_d, outputs=d_outputs)
    d.step([restart], [d.chunk("d", 11), *d.decodes("a", "b", "c")])  # recompute in two chunks
    d.step([], [d.chunk("d"), *d.decodes("a", "b", "c")])
    while chunks := d.decodes("a", "b", "c", "d"):
        d.step([], chunks)

    prompts = dict(a=prompt_a, b=prompt_b, c=prompt_c, d=prompt_d)
    return {rid: d.seqs[rid]["outputs"] for rid in prompts}, prompts


def test_ready_info_reads_eos_and_the_models_context(hf_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(hf_models("qwen3")[0], folder)
    gen_config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(gen_config | {"eos_token_id": [2, 5]}))
    runner = make_runner(folder, max_model_len=None)  # unset: the model's own (past it start refuses: test_model_info)
    info = runner.ready_info(rank=3)
    assert info == messages.WorkerReady(rank=3, num_kv_blocks=96)
    assert make_runner(folder, num_blocks=None, memory_fraction=0.001).num_kv_blocks >= 1


def test_finished_then_unknown_chunk_names_the_request(hf_models):
    folder, _ = hf_models("llama")
    d = Driver(make_runner(folder))
    d.step([d.start("x", [5, 6, 7])], [d.chunk("x")])
    with pytest.raises(PlanError, match="'x'.*never started") as err:
        d.step([], [d.chunk("x")], finished=["x"])
    assert err.value.request_ids == ["x"]


def _chunk(**overrides) -> messages.ScheduledChunk:
    fields = dict(request_id="r", num_computed=0, num_tokens=4, block_ids=[1], sample=True)
    return messages.ScheduledChunk(**(fields | overrides))


@pytest.mark.parametrize(
    "chunk, message",
    [
        (_chunk(num_tokens=5), "outside its 4 known tokens"),
        (_chunk(num_tokens=3), "sample=true but the chunk ends at 3"),
        (_chunk(block_ids=[]), "need 1 blocks"),
        (_chunk(block_ids=[99]), r"block ids \[99\] are outside"),
        (_chunk(request_id="nope"), "'nope'"),
    ],
)
def test_build_batch_rejects_bad_chunks(chunk, message):
    seqs = {"r": SeqState([1, 2, 3], GREEDY, [4])}
    with pytest.raises(PlanError, match=message):
        build_batch([chunk], seqs, block_size=4, num_kv_blocks=8, max_model_len=64)


def _decode_seqs() -> dict[str, SeqState]:
    """Sequences at a decode: "a" read its last token (the host feeds it),
    "b" and "c" still have one on the device (step_tokens rows 4 and 1)."""
    seqs = {"a": SeqState([1, 2, 3, 4, 5], GREEDY, [6]), "b": SeqState([9, 8], GREEDY), "c": SeqState([7] * 9, GREEDY, [3])}
    seqs["a"].lora_slot, seqs["c"].state_slot = 2, 5
    seqs["b"].pending, seqs["c"].pending = 4, 1
    return seqs


def _decodes() -> list[messages.ScheduledChunk]:
    return [_chunk(request_id="a", num_computed=5, num_tokens=1, block_ids=[3, 1]),
            _chunk(request_id="b", num_computed=2, num_tokens=1, block_ids=[2, 6, 7]),
            _chunk(request_id="c", num_computed=10, num_tokens=1, block_ids=[0, 4, 5])]


def test_decode_steps_flatten_as_any_chunks():
    """A decode step's numpy path gives the chunk-at-a-time batch, field for field."""
    seqs, chunks = _decode_seqs(), _decodes()
    batch = model_runner._build_decodes(chunks, seqs, 4, 8, 64)
    assert batch == model_runner._build_chunks(chunks, seqs, 4, 8, 64) == build_batch(chunks, seqs, 4, 8, 64)
    assert batch.input_ids == [6, 0, 0] and batch.device_inputs == [(1, 4), (2, 1)]
    assert batch.slot_mapping == [1 * 4 + 1, 2 * 4 + 2, 5 * 4 + 2] and batch.block_tables == [[3, 1], [2], [0, 4, 5]]
    assert batch.chunk_slots == batch.sample_slots == [2, 0, 0] and batch.state_slots == [-1, -1, 5]
    # the tables already flat for the graphs' upload; the general path leaves that to them
    assert batch.flat_tables.tolist() == [3, 1, 2, 0, 4, 5] and batch.table_lengths.tolist() == [2, 1, 3]
    assert model_runner._build_chunks(chunks, seqs, 4, 8, 64).flat_tables is None


@pytest.mark.parametrize(
    "row, overrides, message",
    [
        (0, dict(num_computed=4), "sample=true but the chunk ends at 5"),
        (1, dict(num_computed=3), "outside its 3 known tokens"),
        (2, dict(block_ids=[0, 4]), "need 3 blocks"),
        (2, dict(block_ids=[0, 8, 5]), r"block ids \[8\] are outside"),
        (1, dict(request_id="nope"), "'nope'"),
    ],
)
def test_decode_steps_reject_bad_chunks(row, overrides, message):
    """A bad chunk among decodes is named as the chunk-at-a-time path names it."""
    chunks = _decodes()
    chunks[row] = _chunk(**{f: getattr(chunks[row], f) for f in chunks[row].__struct_fields__} | overrides)
    assert model_runner._build_decodes(chunks, _decode_seqs(), 4, 8, 64) is None
    with pytest.raises(PlanError, match=message) as err:
        build_batch(chunks, _decode_seqs(), block_size=4, num_kv_blocks=8, max_model_len=64)
    assert err.value.request_ids == [chunks[row].request_id]


def test_build_batch_flattens_chunks():
    seqs = {"r": SeqState([1, 2, 3, 4, 5], GREEDY, [6]), "s": SeqState([9, 8], GREEDY)}
    chunks = [_chunk(num_computed=4, num_tokens=2, block_ids=[3, 1]), _chunk(request_id="s", num_tokens=1, block_ids=[2], sample=False)]
    batch = build_batch(chunks, seqs, block_size=4, num_kv_blocks=8, max_model_len=64)
    assert batch.input_ids == [5, 6, 9]
    assert batch.positions == [4, 5, 0]
    assert batch.slot_mapping == [4, 5, 8]
    assert batch.context_lens == [6, 1] and batch.query_lens == [2, 1]
    assert batch.logits_indices == [1] and batch.sample_ids == ["r"]
