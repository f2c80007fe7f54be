"""The host-copy blob: an exact round trip of a validated adapter, and clear refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from lora_factories import base_shapes, make_adapter, make_base
from safetensors.torch import save as st_save

from mstar_actors.lora import AdapterWeights, LoraModule, read_adapter
from mstar_actors.lora.host_copy import FORMAT, HostCopyError, adapter_from_bytes, adapter_to_bytes

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]


def _assert_same(got: AdapterWeights, want: AdapterWeights) -> None:
    assert (got.name, got.digest, got.max_rank, len(got.layers)) == (want.name, want.digest, want.max_rank, len(want.layers))
    got_modules, want_modules = dict(got.iter_modules()), dict(want.iter_modules())
    assert got_modules.keys() == want_modules.keys()
    for key, m in want_modules.items():
        g = got_modules[key]
        assert g.scale == m.scale, key
        assert g.a.dtype == m.a.dtype and torch.equal(g.a, m.a), key
        assert g.b.dtype == m.b.dtype and torch.equal(g.b, m.b), key


def test_peft_adapter_round_trips_exactly(tmp_path):
    model, cfg = make_base("qwen3")
    folder, _ = make_adapter(
        tmp_path, model, r=4, lora_alpha=7, use_rslora=True, target_modules=ALL, rank_pattern={"down_proj": 2}
    )
    weights = read_adapter(folder, base=base_shapes(cfg), max_rank=8, name="mine")
    blob = adapter_to_bytes(weights)
    _assert_same(adapter_from_bytes(blob), weights)
    # A worker reads straight from the mapped segment: a memoryview with slack after the blob is fine
    # only once sliced to nbytes, which is what AdapterHostRef carries.
    padded = bytearray(blob) + bytearray(64)
    _assert_same(adapter_from_bytes(memoryview(padded)[: len(blob)]), weights)


def test_partial_targets_views_and_bf16_round_trip():
    big = torch.randn(6, 16, dtype=torch.bfloat16)
    a, b = big[:2], torch.randn(8, 2, dtype=torch.bfloat16)  # a is a view of a larger tensor
    layers = ({}, {"mlp.down_proj": LoraModule(a=a, b=b, scale=1 / 3)}, {})
    weights = AdapterWeights(name="x", digest="d" * 32, max_rank=2, layers=layers, global_modules={})
    got = adapter_from_bytes(adapter_to_bytes(weights))
    _assert_same(got, weights)
    assert got.layers[0] == {} and got.layers[2] == {}


def test_refuses_foreign_and_torn_blobs():
    with pytest.raises(HostCopyError, match="format"):
        adapter_from_bytes(st_save({"x": torch.zeros(2)}))
    weights = AdapterWeights(
        name="torn", digest="d", max_rank=1,
        layers=({"self_attn.q_proj": LoraModule(torch.ones(1, 4), torch.ones(4, 1), 2.0)},), global_modules={},
    )  # fmt: skip
    blob = adapter_to_bytes(weights)
    with pytest.raises(HostCopyError, match="truncated"):
        adapter_from_bytes(blob[:20])
    with pytest.raises(HostCopyError, match="too short"):
        adapter_from_bytes(b"abc")
    meta = {"format": FORMAT, "name": "gap", "digest": "d", "max_rank": "1", "num_layers": "1",
            "scales": json.dumps({"model.layers.0.self_attn.q_proj": 1.0})}  # fmt: skip
    with pytest.raises(HostCopyError, match="'gap'.*lacks tensor 'model.layers.0.self_attn.q_proj.lora_B'"):
        adapter_from_bytes(st_save({"model.layers.0.self_attn.q_proj.lora_A": torch.ones(1, 4)}, metadata=meta))
    meta["scales"] = json.dumps({"model.layers.5.self_attn.q_proj": 1.0})
    tensors = {"model.layers.5.self_attn.q_proj.lora_A": torch.ones(1, 4), "model.layers.5.self_attn.q_proj.lora_B": torch.ones(4, 1)}
    with pytest.raises(HostCopyError, match="N < 1"):
        adapter_from_bytes(st_save(tensors, metadata=meta))


# ---------------------------------------------------------------- the worker's install


class _Runner:
    def __init__(self, error: Exception | None = None):
        self.installed: list[tuple[int, AdapterWeights]] = []
        self.error = error

    def reinstall_adapter(self, slot, name, digest):
        return False  # keeps no images: every install reads the host copy

    def kept_adapters(self):
        return []

    def install_adapter(self, slot, weights):
        """As the real runner does, copy: the weights are views of the mapped segment."""
        if self.error:
            raise self.error
        self.installed.append((slot, copy.deepcopy(weights)))


@pytest.fixture
def segment():
    """A shared-memory segment holding one adapter's blob, as the adapter-reader writes it."""
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory

    layers = ({"mlp.up_proj": LoraModule(torch.randn(2, 8), torch.randn(12, 2), 0.5)},)
    weights = AdapterWeights(name="seg", digest="abc", max_rank=2, layers=layers, global_modules={})
    blob = adapter_to_bytes(weights)
    shm = SharedMemory(create=True, size=len(blob) + 100)
    shm.buf[: len(blob)] = blob
    yield shm, len(blob), weights
    # The worker unregistered the name from this (shared) tracker; re-register so unlink balances.
    resource_tracker.register(shm._name, "shared_memory")
    shm.close()
    shm.unlink()


def _install_msg(shm, nbytes, digest="abc"):
    from mstar_actors.messages import AdapterHostRef, InstallAdapter

    return InstallAdapter(slot=2, name="seg", digest=digest, host=AdapterHostRef(segment=shm.name, nbytes=nbytes))


def test_worker_installs_from_the_segment(segment):
    from actors.worker import install_from_host

    shm, nbytes, weights = segment
    runner = _Runner()
    reply = install_from_host(runner, 3, _install_msg(shm, nbytes))
    assert (reply.rank, reply.slot, reply.digest, reply.ok, reply.error) == (3, 2, "abc", True, "")
    [(slot, got)] = runner.installed
    assert slot == 2
    _assert_same(got, weights)


def test_worker_answers_every_failure_with_its_reason(segment):
    from actors.worker import install_from_host

    shm, nbytes, _ = segment
    reply = install_from_host(_Runner(), 1, _install_msg(shm, nbytes, digest="other"))
    assert not reply.ok and "rank 1: adapter 'seg' into slot 2" in reply.error and "digest abc" in reply.error
    reply = install_from_host(_Runner(ValueError("module 'x' has no LoRA stack")), 0, _install_msg(shm, nbytes))
    assert not reply.ok and "ValueError: module 'x' has no LoRA stack" in reply.error
    reply = install_from_host(_Runner(), 0, _install_msg(shm, shm.size + 1))
    assert not reply.ok and "the install names" in reply.error
    reply = install_from_host(_Runner(), 0, _install_msg(shm, 12))
    assert not reply.ok and "HostCopyError" in reply.error
    from mstar_actors.messages import AdapterHostRef, InstallAdapter

    gone = InstallAdapter(slot=1, name="gone", digest="d", host=AdapterHostRef(segment="mstar_no_such_segment", nbytes=8))
    reply = install_from_host(_Runner(), 0, gone)
    assert not reply.ok and "FileNotFoundError" in reply.error


def test_the_reader_tells_the_machines_failure_from_the_files():
    """The pool unloads an adapter only for ``invalid_adapter``: its files give no adapter."""
    import errno

    from actors.adapter_reader import _code
    from mstar_actors.lora import AdapterError
    from mstar_actors.lora.adapter_file import AdapterFileOutside

    assert _code(OSError(errno.ENOSPC, "No space left on device")) == "adapter_read_error"
    assert _code(MemoryError()) == "adapter_read_error"
    assert _code(FileNotFoundError("gone")) == "invalid_adapter"
    assert _code(PermissionError(errno.EACCES, "Permission denied")) == "invalid_adapter"  # the files' fault too
    assert _code(AdapterError("adapter 'a': there is no folder")) == "invalid_adapter"
    assert _code(ValueError("not a safetensors file")) == "invalid_adapter"
    assert _code(AdapterFileOutside("outside")) == "adapter_path_not_allowed"
