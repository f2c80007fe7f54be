"""LoRA under tensor parallelism (gloo, two ranks): each rank installs its
part of every adapter from the shared-memory host copy, as a worker does,
and base rows mixed with three adapters of different ranks and targets (one
on lm_head and embed_tokens) give transformers + PEFT's tokens."""

from __future__ import annotations

import contextlib
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import pytest
import torch
from lora.test_lora_parity import ADAPTERS, MAX_RANK, generate, make_base, make_peft
from tp_ranks import run_ranks
from tp_scenarios import lora_scenario, merged_scenario

from mstar_actors.lora import BaseShapes, LoraModule, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.messages import AdapterHostRef, InstallAdapter
from mstar_actors.models.lora_layers import shard_factors
from mstar_actors.models.sharding import Cut


@contextlib.contextmanager
def host_copies(root, base):
    """The adapter reader's host copies of ``ADAPTERS`` (shared memory) and
    the ``InstallAdapter`` of each, into slots 1, 2, 3."""
    shapes = BaseShapes.from_hf_config(base.config.to_dict())
    segments, installs = [], []
    try:
        for slot, name in enumerate(ADAPTERS, start=1):
            weights = read_adapter(root / name, base=shapes, max_rank=MAX_RANK, name=name)
            blob = adapter_to_bytes(weights)
            shm = SharedMemory(create=True, size=len(blob))
            shm.buf[: len(blob)] = blob
            segments.append(shm)
            installs.append(InstallAdapter(slot=slot, name=name, digest=weights.digest,
                                           host=AdapterHostRef(segment=shm.name, nbytes=len(blob))))
        yield installs
    finally:
        for shm in segments:
            resource_tracker.register(shm._name, "shared_memory")  # noqa: SLF001 - the ranks unregistered it
            shm.close()
            shm.unlink()


def make_world(root, kind: str):
    base = make_base(kind, root / "base")
    peft = {name: make_peft(root / "base", root / name, seed=10 + i, **kwargs)
            for i, (name, kwargs) in enumerate(ADAPTERS.items())}
    return base, peft


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def world(request, tmp_path_factory):
    """(base model, {adapter: peft model}, the two ranks' runs)."""
    root = tmp_path_factory.mktemp(f"tp_lora_{request.param}")
    base, peft = make_world(root, request.param)
    with host_copies(root, base) as installs:
        ranks = run_ranks(lora_scenario, 2, root / "base", installs, MAX_RANK)
    return base, peft, [run for run, _ in ranks]


def assert_matches_peft(run, base, peft) -> None:
    for rid, prompt in run["prompts"].items():
        name = run["on"][rid]
        want = generate(base, prompt) if name is None else generate(peft[name], prompt)
        assert run["outputs"][rid] == want, f"{rid} on adapter {name} diverged from transformers+peft at tp=2"


def test_adapters_at_tp2_match_peft_token_for_token(world):
    base, peft, (rank0, rank1) = world
    assert rank0["replies"] == rank1["replies"] == [(True, "")] * 3
    assert rank0["outputs"] == rank1["outputs"]
    assert_matches_peft(rank0, base, peft)


def test_each_rank_merges_its_shards_of_one_adapter_and_matches_peft(tmp_path):
    """Steps of one adapter on merged weights (``lora.merge``) at tp=2: each rank merges its own
    shard of each factor, column- and row-parallel alike, and the tokens are PEFT's."""
    base, peft = make_world(tmp_path, "llama")
    with host_copies(tmp_path, base) as installs:
        ranks = run_ranks(merged_scenario, 2, tmp_path / "base", [m for m in installs if m.name != "all"], MAX_RANK)
    (rank0, _), (rank1, _) = ranks
    assert rank0["replies"] == [(True, "")] * 2 and rank0["outputs"] == rank1["outputs"]
    assert rank0["held"] == rank1["held"]
    assert {t[0] for t in rank0["held"] if t is not None} == {2, 3}  # attn's slot, then mlp's
    assert_matches_peft(rank0, base, peft)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_adapters_at_tp2_on_two_gpus_match_peft(tmp_path):
    """NCCL, the Triton shrink/expand and the fused linears on shards, the steps' graphs captured."""
    base, peft = make_world(tmp_path, "llama")
    with host_copies(tmp_path, base) as installs:
        ranks = run_ranks(lora_scenario, 2, tmp_path / "base", installs, MAX_RANK, "cuda", device="cuda")
    (rank0, _), (rank1, _) = ranks
    assert rank0["replies"] == [(True, "")] * 3 and rank0["outputs"] == rank1["outputs"]
    assert_matches_peft(rank0, base, peft)


def test_each_rank_stacks_its_shard_of_the_adapters(world):
    _, _, (rank0, rank1) = world
    rows = rank0["stack_rows"]
    assert rows == rank1["stack_rows"]
    assert rows["lm_head"][1] == 320 // 2  # B [slots, this rank's vocabulary, r]
    assert rows["model.layers.0.mlp.down_proj"][1] == 64  # row-parallel: B whole (hidden)


def test_factors_are_cut_as_views_of_the_host_copy():
    a, b = torch.randn(4, 10), torch.randn(6, 4)
    blob = adapter_to_bytes_one(a, b)
    module = adapter_from_bytes(blob, copy=False).layers[0]["self_attn.q_proj"]
    column = shard_factors(module, Cut(0, 3, 3, 6))
    assert torch.equal(column.b, b[3:]) and column.a is module.a
    row = shard_factors(module, Cut(1, 5, 5, 10))
    assert torch.equal(row.a, a[:, 5:]) and row.b is module.b
    embedding = shard_factors(module, Cut(0, 0, 5, 10), is_embedding=True)
    assert torch.equal(embedding.a, a[:, :5])
    for part, whole in ((column.b, module.b), (row.a, module.a)):  # no copy: the same storage
        assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def adapter_to_bytes_one(a, b) -> bytearray:
    from mstar_actors.lora import AdapterWeights

    weights = AdapterWeights(name="x", digest="d", max_rank=4, layers=({"self_attn.q_proj": LoraModule(a, b, 1.0)},),
                             global_modules={})
    return bytearray(adapter_to_bytes(weights))
