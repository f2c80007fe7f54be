"""Delta ops on CPU: segments, the reference vs a per-row loop, stacks vs PEFT's layers."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from lora_factories import base_shapes, lora_layer, make_adapter, make_base

from mstar_actors.lora import LoraStack, build_segments, lora_delta_ref, read_adapter
from mstar_actors.lora.base_shapes import LAYER_MODULES
from mstar_actors.lora.ops import DenseFactors, build_dense_rows, delta_dense_ref, delta_one_slot, expand_matrix


def test_segments_sorted_group_each_slot_once_and_skip_base():
    seg = build_segments([0, 3, 3, 1, 0, 3])
    assert seg.seg_slots == (1, 3)
    assert seg.seg_lens == (1, 3)
    assert seg.row_index == (3, 1, 2, 5)
    assert [seg.rows(j) for j in range(2)] == [[3], [1, 2, 5]]


def test_segments_of_grouped_rows_need_no_index():
    seg = build_segments([0, 0, 2, 2, 5])
    assert seg.row_index is None
    assert seg.seg_starts == (2, 4) and seg.seg_lens == (2, 1) and seg.seg_slots == (2, 5)
    assert build_segments([0, 0]).num_segments == 0
    assert build_segments([]).num_segments == 0
    with pytest.raises(ValueError, match=">= 0"):
        build_segments([1, -1])


def _random_stack(gen, *, in_features, output_sizes, num_slots, max_rank, dtype):
    num_shards = len(output_sizes)
    a = torch.randn(num_shards, num_slots, max_rank, in_features, generator=gen).to(dtype)
    b = torch.randn(num_slots, sum(output_sizes), max_rank, generator=gen).to(dtype)
    a[:, 0] = 0
    b[0] = 0
    scales = torch.rand(num_shards, num_slots, generator=gen) + 0.5
    return a, b, scales


def _naive(y, x, a, b, scales, slots, offsets):
    y = y.float().clone()
    for t, s in enumerate(slots):
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            y[t, lo:hi] += scales[i, s] * (x[t].float() @ a[i, s].float().T) @ b[s, lo:hi].float().T
    return y


@pytest.mark.parametrize("output_sizes", [(48,), (64, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_a_per_row_loop_on_random_mixes(output_sizes, dtype):
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_rank, in_features, num_rows = 5, 8, 40, 37
    a, b, scales = _random_stack(gen, in_features=in_features, output_sizes=output_sizes, num_slots=num_slots, max_rank=max_rank, dtype=dtype)
    offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
    slots = torch.randint(0, num_slots, (num_rows,), generator=gen).tolist()
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, offsets[-1], generator=gen).to(dtype)
    got = lora_delta_ref(y0.clone(), x, a, b, scales, build_segments(slots), offsets)
    want = _naive(y0, x, a, b, scales, slots, offsets)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    base_rows = [t for t, s in enumerate(slots) if s == 0]
    assert torch.equal(got[base_rows], y0[base_rows])  # base rows untouched


@pytest.mark.parametrize("output_sizes", [(48,), (64, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_equal_the_segment_reference(output_sizes, dtype):
    """The one-hot path (every slot's shrink in one GEMM, every slot's expand
    in one batched GEMM) gives the segments' delta; base rows stay as they were."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_rank, in_features, num_rows = 5, 8, 40, 11
    a, b, scales = _random_stack(gen, in_features=in_features, output_sizes=output_sizes, num_slots=num_slots, max_rank=max_rank, dtype=dtype)
    scales[-1, 2] = 0.0  # a shard slot 2's adapter does not target
    offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
    slots = torch.randint(0, num_slots, (num_rows,), generator=gen).tolist()
    slots[:2] = [0, 4]
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, offsets[-1], generator=gen).to(dtype)
    got = delta_dense_ref(y0.clone(), x, a, expand_matrix(b), scales, build_dense_rows(slots, num_slots), offsets)
    want = lora_delta_ref(y0.clone(), x, a, b, scales, build_segments(slots), offsets)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    base_rows = [t for t, s in enumerate(slots) if s == 0]
    assert torch.equal(got[base_rows], y0[base_rows])


@pytest.mark.parametrize("output_sizes", [(48,), (64, 32, 32)])
def test_one_adapter_rows_take_that_slots_columns_and_equal_the_segments(output_sizes):
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_rank, in_features = 5, 8, 40
    a, b, scales = _random_stack(gen, in_features=in_features, output_sizes=output_sizes, num_slots=num_slots, max_rank=max_rank, dtype=torch.float32)
    offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
    slots = [3, 0, 3, 3, 0, 3]  # one adapter among base rows
    rows = build_dense_rows(slots, num_slots)
    assert (rows.num_adapters, rows.only_slot) == (1, 3)
    x = torch.randn(len(slots), in_features, generator=gen)
    y0 = torch.randn(len(slots), offsets[-1], generator=gen)
    got = delta_one_slot(y0.clone(), x, DenseFactors(a, b, scales, offsets), 3, rows.onehot[:, 3])
    want = lora_delta_ref(y0.clone(), x, a, b, scales, build_segments(slots), offsets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[[1, 4]], y0[[1, 4]])
    assert build_dense_rows([1, 2, 0], num_slots).only_slot == 0  # two adapters: no single slot


def test_dense_rows_of_an_embedding_gather_each_rows_own_slot():
    gen = torch.Generator().manual_seed(3)
    vocab, hidden, num_slots, max_rank = 30, 16, 4, 4
    a, b, scales = _random_stack(gen, in_features=vocab, output_sizes=(hidden,), num_slots=num_slots, max_rank=max_rank, dtype=torch.float32)
    slots, tokens = [1, 0, 3, 1, 2], torch.tensor([4, 7, 29, 0, 4])
    y0 = torch.randn(len(slots), hidden, generator=gen)
    got = delta_dense_ref(y0.clone(), tokens, a, expand_matrix(b), scales, build_dense_rows(slots, num_slots), [0, hidden],
                          is_embedding=True)
    for t, s in enumerate(slots):
        want = y0[t] + scales[0, s] * (a[0, s][:, tokens[t]] @ b[s].T)
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- stacks vs PEFT


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory):
    """A Qwen3 base and two PEFT adapters on copies of it, every target, different ranks."""
    tmp = tmp_path_factory.mktemp("adapters")
    model, cfg = make_base("qwen3")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
    folder1, peft1 = make_adapter(tmp, copy.deepcopy(model), seed=1, name="one", r=4, target_modules=targets, use_rslora=True)
    folder2, peft2 = make_adapter(tmp, copy.deepcopy(model), seed=2, name="two", r=8, lora_alpha=4, target_modules=targets)
    base = base_shapes(cfg)
    weights = {1: (read_adapter(folder1, base=base, max_rank=8), peft1), 2: (read_adapter(folder2, base=base, max_rank=8), peft2)}
    return base, weights


_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}


def _stack_for(base, modules, adapters, *, layer, is_embedding=False):
    in_features = base.shape_of(modules[0])[0]
    stack = LoraStack(
        in_features, [base.shape_of(m)[1] for m in modules], num_slots=4, max_rank=8, is_embedding=is_embedding
    )
    for slot, (weights, _) in adapters.items():
        found = weights.layers[layer] if layer is not None else weights.global_modules
        stack.install_slot(slot, [(shard, found[module]) for shard, module in enumerate(modules)])
    return stack


def _peft_out(peft_model, hf_module, x):
    layer = lora_layer(peft_model, hf_module)
    with torch.no_grad():
        return layer(x), layer.base_layer(x)


@pytest.mark.parametrize("group", ["qkv", "gate_up", "self_attn.o_proj", "mlp.down_proj"])
def test_stack_delta_equals_peft_layer_outputs(two_adapters, group):
    base, adapters = two_adapters
    modules = _FUSED.get(group, (group,))
    layer = 1
    stack = _stack_for(base, modules, adapters, layer=layer)
    slots = [0, 2, 2, 1, 0, 1, 2, 3, 1]  # slot 3 is empty: it adds zero
    x = torch.randn(len(slots), stack.in_features)
    outs = {slot: [_peft_out(peft, f"model.layers.{layer}.{m}", x) for m in modules] for slot, (_, peft) in adapters.items()}
    y = torch.cat([base_out for _, base_out in outs[1]], dim=-1)
    want = y.clone()
    for t, slot in enumerate(slots):
        if slot in outs:
            want[t] = torch.cat([with_lora[t] for with_lora, _ in outs[slot]])
    with torch.no_grad():
        stack.add_delta(y, x, build_segments(slots))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_lm_head_and_embedding_stacks_equal_peft(two_adapters):
    base, adapters = two_adapters
    slots = [1, 0, 2, 2, 1]
    hidden = torch.randn(len(slots), 64)
    ids = torch.tensor([5, 7, 300, 5, 11])
    head = _stack_for(base, ("lm_head",), adapters, layer=None)
    embed = _stack_for(base, ("embed_tokens",), adapters, layer=None, is_embedding=True)
    for stack, hf_module, x in ((head, "lm_head", hidden), (embed, "model.embed_tokens", ids)):
        outs = {slot: _peft_out(peft, hf_module, x) for slot, (_, peft) in adapters.items()}
        y = outs[1][1].clone()
        want = torch.stack([outs[s][0][t] if s else y[t] for t, s in enumerate(slots)])
        with torch.no_grad():
            stack.add_delta(y, x, build_segments(slots))
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_install_clears_what_an_earlier_tenant_left():
    stack = LoraStack(16, [8, 8], num_slots=2, max_rank=4)
    from mstar_actors.lora import LoraModule

    stack.install_slot(1, [(0, LoraModule(a=torch.ones(4, 16), b=torch.ones(8, 4), scale=1.0)),
                           (1, LoraModule(a=torch.ones(4, 16), b=torch.ones(8, 4), scale=1.0))])
    stack.install_slot(1, [(0, LoraModule(a=torch.ones(2, 16), b=torch.ones(8, 2), scale=2.0))])
    assert stack.a[0, 1, 2:].abs().sum() == 0 and stack.b[1, :8, 2:].abs().sum() == 0
    assert stack.a[1, 1].abs().sum() == 0 and stack.b[1, 8:].abs().sum() == 0 and stack.scales[1, 1] == 0
    stack.clear(1)
    assert stack.a.abs().sum() == 0 and stack.scales.abs().sum() == 0
    with pytest.raises(ValueError, match=r"do not fit shard 1 of this stack: accepted A \[r, 16\], B \[8, r\] with r <= 4"):
        stack.install_slot(1, [(1, LoraModule(a=torch.ones(8, 16), b=torch.ones(8, 8), scale=1.0))])
    with pytest.raises(ValueError, match="slot 0 is the zero adapter"):
        stack.install_slot(0, [(0, LoraModule(a=torch.ones(4, 16), b=torch.ones(8, 4), scale=1.0))])


def test_no_adapter_rows_is_a_no_op():
    stack = LoraStack(16, [8], num_slots=2, max_rank=4)
    y = torch.randn(3, 8)
    assert stack.add_delta(y.clone(), torch.randn(3, 16), build_segments([0, 0, 0])).equal(y)


def test_rows_of_adapters_that_leave_a_linear_alone_compute_nothing_there(monkeypatch):
    """An all-linear adapter leaves the LM head alone: its rows' delta there is
    zeros, so a step whose adapters all leave a linear alone skips it (as an
    install wrote it: no read of the scales); a slot written otherwise counts
    as targeted again."""
    from mstar_actors.lora import LoraModule, ops

    gen = torch.Generator().manual_seed(5)
    stack = LoraStack(16, [8], num_slots=3, max_rank=4)
    stack.install_slot(1, [])  # its adapter does not target this linear
    stack.install_slot(2, [(None, LoraModule(a=torch.randn(4, 16, generator=gen), b=torch.randn(8, 4, generator=gen),
                                             scale=1.0))])
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    want = stack.add_delta(y.clone(), x, build_segments([2, 1, 0, 2]), build_dense_rows([2, 1, 0, 2], 3))
    assert not torch.equal(want, y)

    def computed(*args, **kwargs):
        raise AssertionError("a delta computed for rows no adapter of which targets the linear")

    for name in ("delta_one_slot", "delta_dense_ref", "shrink_ref", "expand_ref"):
        monkeypatch.setattr(ops, name, computed)
    for rows in ([1, 0, 1], [0, 1]):
        assert stack.add_delta(y[:len(rows)].clone(), x[:len(rows)], build_segments(rows),
                               build_dense_rows(rows, 3)).equal(y[:len(rows)])
    stack.write_dense(1)  # written by other means than an install: computed again
    with pytest.raises(AssertionError, match="a delta computed"):
        stack.add_delta(y[:2].clone(), x[:2], build_segments([1, 1]))


def test_layer_module_names_match_base_shapes():
    assert set(LAYER_MODULES) == set(base_shapes(make_base()[1]).layer_modules)
