"""The Triton LoRA kernels vs the torch reference on fresh random inputs (CUDA only):
prefill-sized steps (the grouped kernel), decode batches (the per-row one), and
the shrink-then-expand kernels at both sizes."""

from __future__ import annotations

import random

import pytest
import torch

from mstar_actors.lora import LoraStack, build_segments
from mstar_actors.lora.ops import embedding_shrink_ref, expand_ref, shrink_ref

pytestmark = pytest.mark.gpu

_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def triton_ops():
    return pytest.importorskip("mstar_actors.lora.triton_ops")


def _random_stack(gen, in_features, output_sizes, *, num_slots, max_rank, dtype, is_embedding=False):
    kernels = pytest.importorskip("mstar_actors.lora.triton_ops")  # what enable_lora gives CUDA stacks
    stack = LoraStack(in_features, output_sizes, num_slots=num_slots, max_rank=max_rank, dtype=dtype, device="cuda",
                      is_embedding=is_embedding, kernels=kernels)
    stack.a[:, 1:] = (torch.randn(stack.a[:, 1:].shape, generator=gen) / in_features**0.5).to(dtype).cuda()
    stack.b[1:] = (torch.randn(stack.b[1:].shape, generator=gen) / max_rank**0.5).to(dtype).cuda()
    stack.scales[:, 1:] = (torch.rand(stack.scales[:, 1:].shape, generator=gen) + 0.5).cuda()
    return stack


def _reference(stack, x, segments):
    """fp32 delta from the same (rounded) weights."""
    a, b = stack.a.float(), stack.b.float()
    y = torch.zeros(segments.num_rows, stack.offsets[-1], device="cuda")
    buf = embedding_shrink_ref(x, a, segments) if stack.is_embedding else shrink_ref(x.float(), a, segments)
    return expand_ref(y, buf, b, stack.scales, segments, stack.offsets)


def _on_cuda(slots):
    return torch.tensor(slots, dtype=torch.int32, device="cuda")


def _rel(got, want):
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()


def _assert_delta(y, base, want, tol):
    """``y`` (rounded to its dtype) is ``base + want`` within ``tol`` of the
    delta's norm plus one rounding of the sum: a one-row delta much smaller
    than its base loses up to half an ulp of ``y`` per element to the final
    rounding alone (and the fused GEMM's base columns may round differently
    from a separate GEMM's), which no kernel can avoid."""
    err = (y.float() - base.float() - want).norm().item()
    rounding = torch.finfo(y.dtype).eps * (base.float() + want).norm().item()
    assert err <= tol * want.norm().item() + rounding, (err, want.norm().item(), rounding)


def _slots(kind, num_rows, num_slots, rng):
    if kind == "one":
        return [1] * num_rows
    if kind == "mixed":
        return [rng.choice([0, 1, 2, 3, 4]) for _ in range(num_rows)]
    return [rng.randrange(num_slots) for _ in range(num_rows)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 7, 256, 1000])
@pytest.mark.parametrize("shape", [(2048, (2048, 512, 512)), (2048, (8192, 8192)), (8192, (2048,)), (96, (40, 24))])
@pytest.mark.parametrize("mix", ["one", "mixed", "random"])
def test_kernels_match_reference(triton_ops, dtype, num_rows, shape, mix):
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    in_features, output_sizes = shape
    stack = _random_stack(gen, in_features, output_sizes, num_slots=9, max_rank=16, dtype=dtype)
    slots = _slots(mix, num_rows, 9, rng)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype).cuda()
    y = torch.zeros(num_rows, stack.offsets[-1], dtype=dtype, device="cuda")
    stack.add_delta_rows(y, x, _on_cuda(slots))
    assert _rel(y, _reference(stack, x, build_segments(slots))) < _TOL[dtype]


@pytest.mark.parametrize("max_rank", [8, 64])
def test_kernels_add_onto_the_base_output_and_skip_base_rows(triton_ops, max_rank):
    gen = torch.Generator().manual_seed(0)
    stack = _random_stack(gen, 256, (128, 64), num_slots=4, max_rank=max_rank, dtype=torch.bfloat16)
    slots = [0, 3, 0, 1, 1, 0, 2]
    segments = build_segments(slots)
    x = torch.randn(len(slots), 256, generator=gen).bfloat16().cuda()
    y0 = torch.randn(len(slots), 192, generator=gen).bfloat16().cuda()
    y = stack.add_delta_rows(y0.clone(), x, _on_cuda(slots))
    base_rows = [t for t, s in enumerate(slots) if s == 0]
    assert torch.equal(y[base_rows], y0[base_rows])
    assert _rel(y - y0, _reference(stack, x, segments)) < 2e-2


def test_lm_head_and_embedding_on_cuda(triton_ops):
    gen = torch.Generator().manual_seed(1)
    slots = [1, 2, 0, 2, 3] * 20
    segments = build_segments(slots)
    head = _random_stack(gen, 2048, (128256,), num_slots=4, max_rank=16, dtype=torch.bfloat16)
    x = torch.randn(len(slots), 2048, generator=gen).bfloat16().cuda()
    y = torch.zeros(len(slots), 128256, dtype=torch.bfloat16, device="cuda")
    assert _rel(head.add_delta_rows(y, x, _on_cuda(slots)), _reference(head, x, segments)) < 1e-2
    embed = _random_stack(gen, 1000, (2048,), num_slots=4, max_rank=16, dtype=torch.bfloat16, is_embedding=True)
    ids = torch.randint(0, 1000, (len(slots),), generator=gen).cuda()
    y = torch.zeros(len(slots), 2048, dtype=torch.bfloat16, device="cuda")
    assert _rel(embed.add_delta_rows(y, ids, _on_cuda(slots)), _reference(embed, ids, segments)) < 1e-2


# ---------------------------------------------------------------- per-row slots (decode, graphs)

_LLAMA_1B = {
    "qkv": (2048, (2048, 512, 512)),
    "o": (2048, (2048,)),
    "gate_up": (2048, (8192, 8192)),
    "down": (8192, (2048,)),
    "lm_head": (2048, (128256,)),
}


def _mixed_rank_stack(gen, in_features, output_sizes, *, is_embedding=False, dtype=torch.bfloat16):
    """Slots 1-4 at ranks 4/8/16/16 (zero-padded to 16), bf16 unless said."""
    stack = _random_stack(gen, in_features, output_sizes, num_slots=5, max_rank=16, dtype=dtype, is_embedding=is_embedding)
    for slot, rank in ((1, 4), (2, 8)):
        stack.a[:, slot, rank:] = 0
        stack.b[slot, :, rank:] = 0
    return stack


def _row_slots(rng, num_rows):
    return torch.tensor([rng.choice([0, 1, 2, 3, 4]) for _ in range(num_rows)], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("num_rows", [1, 8, 32, 64])
@pytest.mark.parametrize("linear", list(_LLAMA_1B))
def test_rows_kernel_matches_reference(triton_ops, linear, num_rows):
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    in_features, output_sizes = _LLAMA_1B[linear]
    stack = _mixed_rank_stack(gen, in_features, output_sizes)
    slots = _row_slots(rng, num_rows)
    slots[0] = 1  # never an all-base batch (the reference would be zero)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16().cuda()
    y0 = torch.randn(num_rows, stack.offsets[-1], generator=gen).bfloat16().cuda()
    y = stack.add_delta_rows(y0.clone(), x, slots)
    _assert_delta(y, y0, _reference(stack, x, build_segments(slots.tolist())), 1e-2)
    base_rows = (slots == 0).nonzero().flatten()
    assert torch.equal(y[base_rows], y0[base_rows])


@pytest.mark.parametrize("num_rows", [1, 64])
def test_rows_embedding_matches_reference(triton_ops, num_rows):
    rng, gen = random.Random(num_rows), torch.Generator().manual_seed(num_rows)
    stack = _mixed_rank_stack(gen, 128256, (2048,), is_embedding=True)
    slots = _row_slots(rng, num_rows)
    slots[0] = 3
    ids = torch.randint(0, 128256, (num_rows,), generator=gen).cuda()
    y = torch.zeros(num_rows, 2048, dtype=torch.bfloat16, device="cuda")
    stack.add_delta_rows(y, ids, slots)
    assert _rel(y, _reference(stack, ids, build_segments(slots.tolist()))) < 1e-2


@pytest.mark.parametrize("min_split_rows", [64, 16])  # 64: the default routing; 16: shrink then expand at 32 rows
@pytest.mark.parametrize("num_rows", [8, 32])  # one program per row; rows grouped by slot inside the graph
@pytest.mark.parametrize("linear", ["qkv", "lm_head"])
def test_rows_kernel_replays_in_a_cuda_graph_with_new_slots(triton_ops, linear, num_rows, min_split_rows, monkeypatch):
    """Captured once; each replay reads the slots written into the same tensor since."""
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", min_split_rows)
    gen = torch.Generator().manual_seed(11)
    in_features, output_sizes = _LLAMA_1B[linear]
    stack = _mixed_rank_stack(gen, in_features, output_sizes)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16().cuda()
    y0 = torch.randn(num_rows, stack.offsets[-1], generator=gen).bfloat16().cuda()
    y = y0.clone()
    slots = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        stack.add_delta_rows(y, x, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(y0)
        stack.add_delta_rows(y, x, slots)
    for values in ([1, 2, 3, 4, 0, 1, 2, 3], [0] * 8, [4, 4, 0, 0, 2, 2, 1, 1]):
        values = values * (num_rows // 8)
        slots.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        if not any(values):
            assert torch.equal(y, y0)
            continue
        _assert_delta(y, y0, _reference(stack, x, build_segments(values)), 1e-2)
        assert torch.equal(y[[t for t, s in enumerate(values) if s == 0]], y0[[t for t, s in enumerate(values) if s == 0]])


def _with_an_untargeted_shard(linear, num_rows, dtype):
    """Llama-3.2-1B's ``linear``, every slot mixed with base rows (row 0 on
    slot 1); slot 2 leaves its last shard untargeted (scale 0). Returns
    (generator, stack, that shard's columns, row slots); prints the seed."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    in_features, output_sizes = _LLAMA_1B[linear]
    stack = _mixed_rank_stack(gen, in_features, output_sizes, dtype=dtype)
    shard = len(output_sizes) - 1
    lo, hi = stack.offsets[shard], stack.offsets[shard + 1]
    stack.a[shard, 2], stack.b[2, lo:hi], stack.scales[shard, 2] = 0, 0, 0.0
    slots = _row_slots(rng, num_rows)
    slots[0] = 1
    return gen, stack, slice(lo, hi), slots


def _assert_left_alone(y, y0, slots, untargeted: slice) -> None:
    """Base rows, and slot 2's rows in its untargeted shard, are as they were, bit for bit."""
    base_rows = (slots == 0).nonzero().flatten()
    assert torch.equal(y[base_rows], y0[base_rows])
    on_two = (slots == 2).nonzero().flatten()
    assert torch.equal(y[on_two, untargeted], y0[on_two, untargeted])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 8, 16, 32, 63, 256])
@pytest.mark.parametrize("linear", ["qkv", "o", "gate_up", "down"])
def test_fused_gemm_and_expand_match_reference(triton_ops, linear, num_rows, dtype):
    """Every adapter slot's A under the weight: the one GEMM's first columns
    are the base output, and the expand of its A columns adds each row's delta."""
    gen, stack, untargeted, slots = _with_an_untargeted_shard(linear, num_rows, dtype)
    weight = (torch.randn(stack.offsets[-1], stack.in_features, generator=gen) / stack.in_features**0.5).to(dtype).cuda()
    fused, _ = stack.fuse_under(weight, None)
    x = torch.randn(num_rows, stack.in_features, generator=gen).to(dtype).cuda()
    n = weight.shape[0]
    out = torch.nn.functional.linear(x, fused)
    base = torch.nn.functional.linear(x, weight)
    y0 = out[:, :n].clone()
    y = triton_ops.expand_rows(stack, out[:, :n], stack.fused_shrink(out), slots)
    _assert_delta(y, base, _reference(stack, x, build_segments(slots.tolist())), _TOL[dtype])
    _assert_left_alone(y, y0, slots, untargeted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [16, 64, 256])
@pytest.mark.parametrize("linear", ["qkv", "lm_head"])
def test_gemm_rows_match_reference(triton_ops, linear, num_rows, dtype):
    """An unfused stack (the LM head's) between ``MIN_GEMM_ROWS`` and ``MIN_SPLIT_ROWS`` rows: its own
    GEMM's shrink, then the expand."""
    gen, stack, untargeted, slots = _with_an_untargeted_shard(linear, num_rows, dtype)
    assert triton_ops.kernel_for(num_rows) == "gemm"
    x = torch.randn(num_rows, stack.in_features, generator=gen).to(dtype).cuda()
    y0 = torch.randn(num_rows, stack.offsets[-1], generator=gen).to(dtype).cuda()
    y = triton_ops.rows_delta(stack, y0.clone(), x, slots)
    _assert_delta(y, y0, _reference(stack, x, build_segments(slots.tolist())), _TOL[dtype])
    _assert_left_alone(y, y0, slots, untargeted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [16, 64])
def test_gemm_rows_keep_the_shrink_in_float32_as_bgmv_rows(triton_ops, num_rows, dtype):
    """The LM head's delta from ``MIN_GEMM_ROWS`` rows (cuBLAS's float32 shrink, the tiles' two half dots)
    is ``bgmv_rows``' (the shrink kept in float32) but for a last bit in rare values: a row's logits do not
    move with the step's row count. The shrink rounded to the dtype first moves a good share of them."""
    gen, stack, _, slots = _with_an_untargeted_shard("lm_head", num_rows, dtype)
    x = torch.randn(num_rows, stack.in_features, generator=gen).to(dtype).cuda()
    y0 = torch.zeros(num_rows, stack.offsets[-1], dtype=dtype, device="cuda")
    want = triton_ops.bgmv_rows(stack, y0.clone(), x, slots)
    got = triton_ops.gemm_rows(stack, y0.clone(), x, slots)
    a = stack.a.reshape(-1, stack.in_features)
    rounded = triton_ops.expand_rows(stack, y0.clone(), (x.float() @ a.float().T).to(dtype), slots)
    moved = [(v != want).float().mean().item() for v in (got, rounded)]
    assert moved[0] < 0.01 and moved[1] > 10 * moved[0], moved
    errs = [_rel(v, want.float()) for v in (got, rounded)]
    assert errs[0] < errs[1] / 4, errs


# ---------------------------------------------------------------- shrink, then expand


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows", [16, 32, 64, 100, 128, 2048])
@pytest.mark.parametrize("linear", list(_LLAMA_1B))
def test_shrink_expand_matches_reference(triton_ops, linear, num_rows, dtype):
    """Llama-3.2-1B's shapes, every slot mixed with base rows; slot 2 leaves
    its last shard untargeted (scale 0): those columns and the base rows
    come out bit-identical."""
    if linear == "lm_head" and num_rows > 128:
        pytest.skip("the LM head sees sampled rows only")
    gen, stack, untargeted, slots = _with_an_untargeted_shard(linear, num_rows, dtype)
    x = torch.randn(num_rows, stack.in_features, generator=gen).to(dtype).cuda()
    y0 = torch.randn(num_rows, stack.offsets[-1], generator=gen).to(dtype).cuda()
    groups = triton_ops.group_rows(slots, stack.num_slots)
    y = triton_ops.shrink_expand_rows(stack, y0.clone(), x, groups)
    _assert_delta(y, y0, _reference(stack, x, build_segments(slots.tolist())), _TOL[dtype])
    _assert_left_alone(y, y0, slots, untargeted)


@pytest.mark.parametrize("num_rows", [32, 128])
@pytest.mark.parametrize("linear", ["qkv", "down"])
def test_shrink_expand_blocks_of_the_check_tool(triton_ops, linear, num_rows):
    """Every variant the check tool (tools/check_lora_kernels.py --rows-table) times is right before it is
    timed, here at the real shapes: bgmv, and shrink-expand at its default blocks and their neighbours."""
    rng, gen = random.Random(num_rows), torch.Generator().manual_seed(num_rows)
    in_features, output_sizes = _LLAMA_1B[linear]
    stack = _mixed_rank_stack(gen, in_features, output_sizes)
    slots = _row_slots(rng, num_rows)
    slots[0] = 4
    groups = triton_ops.group_rows(slots, stack.num_slots)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16().cuda()
    want = _reference(stack, x, build_segments(slots.tolist()))
    num_shards, _, _, k = stack.a.shape
    bm, bk, sk, bn, tiles = triton_ops._split_blocks(num_rows, num_shards, k, max(stack.output_sizes), 132)
    neighbours = [(bm, bk, sk, bn, tiles), (bm, bk, sk, 64, tiles), (bm, bk, sk, 256, tiles),
                  (bm, bk, max(1, sk // 2), bn, tiles), (bm, bk, sk * 2, bn, tiles), (bm, 128, sk, bn, tiles),
                  (bm, bk, sk, bn, 2)]
    variants = {"bgmv": lambda y: triton_ops.bgmv_rows(stack, y, x, slots)}
    variants |= {f"split {b}": lambda y, b=b: triton_ops.shrink_expand_rows(stack, y, x, groups, blocks=b)
                 for b in neighbours}
    for name, fn in variants.items():
        y = torch.zeros(num_rows, stack.offsets[-1], dtype=torch.bfloat16, device="cuda")
        assert _rel(fn(y), want) < 1e-2, name
