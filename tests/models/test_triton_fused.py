"""The fused Triton kernels of the CUDA step against the torch ops they replace.

On CPU they run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET), so shapes stay small; the ``gpu`` tests run them compiled,
and the decoder with them against the decoder without them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mstar_actors.lora import LoraStack, triton_ops
from mstar_actors.models import triton_fused
from mstar_actors.models.lora_layers import PendingExpand
from mstar_actors.models.decoder import RMSNorm
from mstar_actors.models.qwen3_5 import GatedRMSNorm, PartialMRotary, ZeroCenteredRMSNorm
from mstar_actors.models.rope import RotaryEmbedding, rotate
from mstar_actors.models.spec import RopeSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to
# nearest even, so bfloat16 runs compiled only (``test_kernels_compiled_on_gpu``).
CPU_DTYPES = [torch.float32, torch.float16]


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """The norm's torch path (the one the kernel replaces on CUDA)."""
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(x.shape[-1], eps).to(device=x.device, dtype=x.dtype)
    norm.weight.data = weight
    return norm.reference(x)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int, atol: float = 0.0) -> None:
    """Every element within ``ulps`` units in the last place of the expected
    value in its dtype (the kernels' float32 steps may round a last bit the
    other way than torch's, and that bit may flip a rounding to the dtype),
    plus ``atol``."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    exp = expected.float()
    excess = (actual.float() - exp).abs() - ulps * ulp_of(expected) - atol
    assert excess.max() <= 0, f"{int((excess > 0).sum())} of {exp.numel()} elements more than {ulps} ulps off"


def ulp_of(x: torch.Tensor) -> torch.Tensor:
    """A unit in the last place of each element in its dtype, as float32."""
    info = torch.finfo(x.dtype)
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(info.tiny)))) * info.eps


def assert_close_to_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float32 steps taken otherwise than torch's (a sum in another order,
    the GPU's approximate exp, division and rsqrt) are off by a few float32
    ulps; in half precision that may flip a rounding, and the scale's or the
    product's rounding once more: two ulps of the dtype."""
    assert_within_ulps(actual, expected, 16 if expected.dtype == torch.float32 else 2)


# The folded and the plain expand sum the rank's float32 products in other
# orders: off by a few float32 ulps of the terms, not of the result. Here the
# terms (``pending_expand``: rank 8, factors of N(0, 1), scales up to 1.5) sum
# to ~10 at most: a few ulps of that are ~1e-6, absolute.
ORDER_ATOL = 1e-6


def assert_close_to_expand(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A folded expand against ``expand_rows``, compiled: the two sum the
    rank's products in other orders, so a float32 result is off by the
    rounding of that sum (its terms' size, not the result's: absolute); in
    half precision by a rounding of the dtype (two ulps), and where the
    result is near zero by that float32 sum's error (``ORDER_ATOL``)."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=3e-5)
    else:
        assert_within_ulps(actual, expected, 2, ORDER_ATOL)


def assert_close_to_silu_mul_of_expands(actual: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """SiLU-and-mul whose gate and up each took a folded expand, against the
    op on ``expand_rows``' gate and up: each operand may sit two ulps apart,
    or ``ORDER_ATOL`` near zero (``assert_close_to_expand``; an H100 put a
    float16 gate of -5.1e-5, a subnormal, four of its ulps off). Over those
    intervals the result moves by at most SiLU's steepest slope on the
    gate's interval times up's largest size (``1 + |gate|`` times
    silu(gate)'s relative size where the gate is far below 0), plus
    silu(gate)'s largest size times up's move; and each result is rounded
    once (two ulps of the larger)."""
    expected = triton_fused.silu_mul(torch.cat([gate, up], dim=-1))
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=3e-5)
        return
    g, u = gate.float(), up.float()
    dg, du = 2 * ulp_of(gate) + ORDER_ATOL, 2 * ulp_of(up) + ORDER_ATOL
    points = torch.stack([g - dg, g, g + dg])  # silu and its slope are smooth: their extremes over an interval this
    sig = torch.sigmoid(points)                # narrow sit at its ends or, near a turn, within a hair of its centre
    steepest = (sig * (1 + points * (1 - sig))).abs().amax(0)
    largest = (points * sig).abs().amax(0)
    rounding = 2 * torch.maximum(ulp_of(expected), ulp_of(actual))
    slack = steepest * (u.abs() + du) * dg + largest * du + rounding
    excess = (actual.float() - expected.float()).abs() - slack
    worst = excess.argmax()
    pick = lambda t: t.flatten()[worst].item()  # noqa: E731
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} elements past a rounding of an operand; the worst: gate "
        f"{pick(gate)}, up {pick(up)}, result {pick(actual)} against {pick(expected)}, slack {pick(slack)}")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_matches_torch(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 96, generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype).to(device)
    out = triton_fused.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_rounding(out, torch_norm(x, weight, 1e-6))


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_add_rms_norm_writes_the_sum_and_normalises_it(dtype, zero_centered, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 80, generator=gen).to(dtype).to(device)  # not a power of two: masked lanes
    residual = torch.randn(4, 80, generator=gen).to(dtype).to(device)
    weight = torch.randn(80, generator=gen).to(dtype).to(device)
    total = x + residual  # rounded to the dtype, as the kernel must round it
    out = triton_fused.rms_norm(x, weight, 1e-5, residual, zero_centered=zero_centered)
    assert torch.equal(residual, total)  # the sum, in place, bit for bit
    assert_close_to_rounding(out, torch_norm(total, weight, 1e-5, zero_centered))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_per_head_on_a_projections_view(dtype, device="cpu"):
    """Qwen3's q/k norms: ``[T, H, D]`` heads of a wider projection row, as they are."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 7 * 16, generator=gen).to(dtype).to(device)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    weight = torch.randn(16, generator=gen).to(dtype).to(device)
    out = triton_fused.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close_to_rounding(out, torch_norm(q, weight, 1e-6))


def test_rms_norm_refuses_what_does_not_fit():
    x = torch.randn(4, 64)
    assert triton_fused.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-6) is None  # weight dtype
    assert triton_fused.rms_norm(x.t().contiguous().t(), torch.ones(4), 1e-6) is None  # columns strided
    assert triton_fused.rms_norm(x, torch.ones(64), 1e-6, torch.randn(4, 64).half()) is None  # residual dtype
    assert triton_fused.rms_norm(torch.randn(0, 64), torch.ones(64), 1e-6).shape == (0, 64)


def paged_case(dtype, device, num_tokens=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=2):
    """q, k, v as views of one fused projection (row stride wider than the
    heads, as ``qkv_proj``'s output is split), the rotary tables of some
    positions, and an empty paged cache."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim)
    positions = torch.tensor([5, 17, 300, 2, 9][:num_tokens], device=device)
    cos, sin = rotary.tables(positions, dtype)
    cache = torch.zeros(2, 6, 4, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = torch.tensor([7, 0, 22, 13, 3][:num_tokens], device=device)
    return q, k, v, cos, sin, cache, slots


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_write_kv_equals_rotate_and_index_copy_bit_for_bit(dtype, device="cpu"):
    q, k, v, cos, sin, cache, slots = paged_case(dtype, device)
    want_q, want_k = rotate(q, cos, sin), rotate(k, cos, sin)
    want_cache = cache.clone()
    flat = want_cache.view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, slots, want_k)
    flat[1].index_copy_(0, slots, v)
    k_before = k.clone()
    assert triton_fused.rope_write_kv(q, k, v, cos, sin, cache, slots)
    assert torch.equal(q, want_q)  # float32 too: built without contracting a product into the sum
    assert torch.equal(cache, want_cache)
    assert torch.equal(k, k_before)


def test_rope_write_kv_skips_padding_slots_and_refuses_other_layouts():
    q, k, v, cos, sin, cache, slots = paged_case(torch.float32, "cpu")
    slots[1] = -1
    assert triton_fused.rope_write_kv(q, k, v, cos, sin, cache, slots)
    written = cache.view(2, -1, *cache.shape[-2:]).abs().sum(dim=(0, 2, 3)).nonzero().flatten().tolist()
    assert written == sorted([7, 22])
    assert not triton_fused.rope_write_kv(q, k, v, cos, sin, cache.half(), slots)  # cache dtype
    assert not triton_fused.rope_write_kv(q, k, v, cos, sin, cache, slots.int())  # slot dtype
    assert not triton_fused.rope_write_kv(q, k, v, cos[:2], sin[:2], cache, slots)  # tables of other tokens


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_write_kv_adds_a_delta_as_add_would(dtype, device="cpu"):
    """The LoRA delta run beside the GEMM: q, k and v take it first, rounded
    as ``qkv.add_(delta)`` rounds, so the result is that of add then rotary."""
    q, k, v, cos, sin, cache, slots = paged_case(dtype, device)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
    delta = (0.5 * torch.randn(qkv.shape, generator=torch.Generator().manual_seed(5))).to(dtype).to(device)
    # The reference: the sum, then the kernel without a delta (equal to rotate + index_copy, above).
    sizes = [q[0].numel(), k[0].numel(), v[0].numel()]
    rq, rk, rv = (t.view(t.shape[0], -1, q.shape[-1]) for t in (qkv + delta).split(sizes, dim=-1))
    ref_cache = cache.clone()
    assert triton_fused.rope_write_kv(rq, rk, rv, cos, sin, ref_cache, slots)
    assert triton_fused.rope_write_kv(q, k, v, cos, sin, cache, slots, delta)
    assert torch.equal(q, rq) and torch.equal(cache, ref_cache)
    wide = torch.zeros(delta.shape[0], delta.shape[1] + 1, dtype=dtype, device=device)
    assert not triton_fused.rope_write_kv(q, k, v, cos, sin, cache, slots, wide)  # not q|k|v's layout


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_mul_adds_a_delta_as_add_would(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(6)
    gate_up = (2 * torch.randn(3, 2 * 600, generator=gen)).to(dtype).to(device)
    delta = torch.randn(gate_up.shape, generator=gen).to(dtype).to(device)
    want = triton_fused.silu_mul(gate_up + delta)
    assert torch.equal(triton_fused.silu_mul(gate_up, delta), want)
    assert triton_fused.silu_mul(gate_up, delta[:, :-2]) is None  # not gate_up's shape


# Rows of the fold tests and their LoRA slots: three; 37, tiles of 16 where the
# kernel takes tiles of rows (``triton_fused.FOLD_ROWS``): rows of one adapter,
# of two, base rows, the last tile cut short.
FOLD_SLOTS = {"3-rows": [1, 0, 2], "37-rows": [1] * 8 + [0, 1, 2, 0] + [0] * 4 + [2, 2, 1, 0, 1, 0, 2, 2] + [2] * 4
              + [0, 2, 1, 1, 1, 0, 1, 0, 1]}


def reversed_rows(out: torch.Tensor, expand) -> tuple[torch.Tensor, object]:
    """A fused linear's output ``[y | t]`` and its expand with the rows in
    reverse order (a copy): each row beside other neighbours, in another
    tile, where its result must be the same."""
    flipped = out.flip(0)
    return flipped, expand._replace(t=flipped[:, out.shape[1] - expand.t.shape[1]:], row_slots=expand.row_slots.flip(0))


@contextlib.contextmanager
def by_rows():
    """``expand_rows`` one program a row at any row count (the sums a one-row fold makes)."""
    saved, triton_ops.MIN_TILE_ROWS = triton_ops.MIN_TILE_ROWS, 1 << 30
    try:
        yield
    finally:
        triton_ops.MIN_TILE_ROWS = saved


def pending_expand(y: torch.Tensor, output_sizes: list[int], row_slots: list[int], seed: int = 8, num_slots: int = 3,
                   max_rank: int = 8) -> tuple[torch.Tensor, PendingExpand]:
    """A fused linear's output ``[y | t]`` (``y``'s rows, then every shard and
    slot's shrink, as the fused GEMM writes them) with ``y``'s values, and the
    expand left to do on it: a stack on the Triton kernels whose slots past 0
    hold random factors and scales (of several shards, slot 2's second untargeted)."""
    gen = torch.Generator().manual_seed(seed)
    dtype, device = y.dtype, y.device
    stack = LoraStack(8, output_sizes, num_slots=num_slots, max_rank=max_rank, dtype=dtype, device=device,
                      kernels=triton_ops)
    stack.b[1:] = torch.randn(stack.b[1:].shape, generator=gen).to(dtype).to(device)
    stack.scales[:, 1:] = 0.5 + torch.rand(stack.scales[:, 1:].shape, generator=gen).to(device)
    if len(output_sizes) > 1:
        stack.scales[1, 2] = 0.0
        stack.b[2, stack.offsets[1]:stack.offsets[2]] = 0
    width = len(output_sizes) * num_slots * max_rank
    out = torch.cat([y, torch.randn(y.shape[0], width, generator=gen).to(dtype).to(device)], dim=-1)
    slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
    return out, PendingExpand(stack, out[:, y.shape[1]:], slots)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_write_kv_folds_a_fused_expand_as_expand_rows_would(dtype, device="cpu"):
    """A fused q|k|v's expand (``PendingExpand``), added by the rotary kernel
    as it loads: the result of ``expand_rows`` then the kernel, rows on
    slots 0 (base: untouched), 1 and 2 (k untargeted)."""
    q, k, v, cos, sin, cache, slots = paged_case(dtype, device)
    heads = q.shape[1] + 2 * k.shape[1]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
    sizes = [q[0].numel(), k[0].numel(), v[0].numel()]
    out, expand = pending_expand(qkv, sizes, [1, 0, 2])
    n = qkv.shape[1]
    want = out.clone()
    expand._replace(t=want[:, n:]).apply(want[:, :n])
    rq, rk, rv = want[:, :n].view(-1, heads, q.shape[-1]).split_with_sizes([q.shape[1], k.shape[1], k.shape[1]], 1)
    ref_cache = cache.clone()
    assert triton_fused.rope_write_kv(rq, rk, rv, cos, sin, ref_cache, slots)
    fq, fk, fv = out[:, :n].view(-1, heads, q.shape[-1]).split_with_sizes([q.shape[1], k.shape[1], k.shape[1]], 1)
    assert triton_fused.rope_write_kv(fq, fk, fv, cos, sin, cache, slots, expand=expand)
    check = torch.equal if device == "cpu" else assert_close_to_expand
    assert check(fq, rq) in (True, None) and check(cache, ref_cache) in (True, None)
    assert not torch.equal(rq, q)  # the expand changed something
    other = pending_expand(qkv, [sizes[0], sizes[1] + sizes[2]], [1, 0, 2])[1]
    assert not triton_fused.rope_write_kv(fq, fk, fv, cos, sin, cache, slots, expand=other)  # not q|k|v's shards


@pytest.mark.parametrize("rows", FOLD_SLOTS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_mul_folds_a_fused_expand_as_expand_rows_would(dtype, rows, device="cpu"):
    gen = torch.Generator().manual_seed(9)
    row_slots = FOLD_SLOTS[rows]
    gate_up = (2 * torch.randn(len(row_slots), 2 * 600, generator=gen)).to(dtype).to(device)
    out, expand = pending_expand(gate_up, [600, 600], row_slots)
    want = out.clone()
    expand._replace(t=want[:, 1200:]).apply(want[:, :1200])
    # One row a program sums as expand_rows does; tiles of rows take a dot of the rank, then the scale.
    got = triton_fused.silu_mul(out[:, :1200], expand=expand)
    if device == "cpu" and len(row_slots) < triton_fused.FOLD_ROWS:
        assert torch.equal(got, triton_fused.silu_mul(want[:, :1200]))
    else:  # gate and up each take their expand (a float16 element sat three ulps off on an H100)
        assert_close_to_silu_mul_of_expands(got, want[:, :600], want[:, 600:1200])
    base = [i for i, slot in enumerate(row_slots) if slot == 0]
    assert torch.equal(got[base], triton_fused.silu_mul(gate_up)[base])  # the base rows
    assert torch.equal(triton_fused.silu_mul(out[:, :1200], expand), got)  # handed over as the delta
    flipped, flipped_expand = reversed_rows(out, expand)
    assert torch.equal(triton_fused.silu_mul(flipped[:, :1200], expand=flipped_expand).flip(0), got)
    assert triton_fused.silu_mul(out[:, :1200], expand=pending_expand(gate_up, [400, 800], row_slots)[1]) is None


@pytest.mark.parametrize("rows", FOLD_SLOTS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_add_rms_norm_folds_a_fused_expand_as_expand_rows_would(dtype, zero_centered, rows, device="cpu"):
    """A fused o's or down's expand, added by the residual add's RMSNorm to
    the linear's output as it loads: the result (the sum, in place, and the
    norm) of ``expand_rows`` then the kernel, rows on slots 1, 0 (base:
    untouched) and 2, the output a view of the fused GEMM's wider rows."""
    gen = torch.Generator().manual_seed(10)
    row_slots = FOLD_SLOTS[rows]
    stream = torch.randn(len(row_slots), 80, generator=gen).to(dtype).to(device)
    weight = torch.randn(80, generator=gen).to(dtype).to(device)
    out, expand = pending_expand(torch.randn(len(row_slots), 80, generator=gen).to(dtype).to(device), [80], row_slots)
    want = out.clone()
    with by_rows():  # one program a row, as the fold sums (tiles of rows' dots round otherwise)
        expand._replace(t=want[:, 80:]).apply(want[:, :80])
    want_normed = triton_fused.rms_norm(stream, weight, 1e-5, want[:, :80], zero_centered=zero_centered)
    before = out[:, :80].clone()
    assert not torch.equal(want[:, :80], before)  # the expand changes something
    got = triton_fused.rms_norm(stream, weight, 1e-5, out[:, :80], zero_centered=zero_centered, expand=expand)
    check = torch.equal if device == "cpu" else assert_close_to_expand
    assert check(out[:, :80], want[:, :80]) in (True, None) and check(got, want_normed) in (True, None)
    base = [i for i, slot in enumerate(row_slots) if slot == 0]
    assert torch.equal(out[base, :80], stream[base] + before[base])  # the base rows: the plain sum
    assert triton_fused.rms_norm(stream, weight, 1e-5, None, expand=expand) is None  # only with a residual
    assert triton_fused.rms_norm(stream, weight, 1e-5, out[:, :80].clone(), expand=torch.zeros(len(row_slots), 80)) is None
    two = pending_expand(torch.zeros(len(row_slots), 80, dtype=dtype, device=device), [40, 40], row_slots)[1]
    assert triton_fused.rms_norm(stream, weight, 1e-5, out[:, :80].clone(), expand=two) is None  # one shard only


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_mul_equals_torch_to_rounding(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    gate_up = (2 * torch.randn(3, 2 * 1100, generator=gen)).to(dtype).to(device)  # two column blocks, the last partial
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    out = triton_fused.silu_mul(gate_up)
    assert out.shape == want.shape and out.dtype == dtype
    assert_close_to_rounding(out, want)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_norm_rope_write_kv_equals_norms_partial_rotary_and_index_copy(dtype, device="cpu"):
    """Qwen3.5's gated attention: q heads strided in ``[q_h | gate_h]`` rows,
    k and v views of the same projection, a rotary over a quarter of each
    head; the result that of the norm kernel, ``PartialMRotary`` and
    ``index_copy``, bit for bit (float32 too), q returned, nothing written in place."""
    gen = torch.Generator().manual_seed(15)
    tokens, heads, kv_heads, dim = 3, 4, 2, 32
    proj = (2 * torch.randn(tokens, heads * 2 * dim + 2 * kv_heads * dim, generator=gen)).to(dtype).to(device)
    q_gate, k, v = proj.split([heads * 2 * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q_gate.view(tokens, heads, 2 * dim)[..., :dim]
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    q_weight, k_weight = ((torch.randn(2, dim, generator=gen) / 4).to(dtype).to(device)).unbind(0)
    rotary = PartialMRotary(10000.0, 8, (2, 1, 1))
    positions = torch.tensor([5, 17, 300], device=device)
    cos, signed_sin = rotary.tables(positions, dtype)
    cache = torch.zeros(2, 6, 4, kv_heads, dim, dtype=dtype, device=device)
    slots = torch.tensor([7, 0, 22], device=device)
    want_q, want_k = rotary(positions, triton_fused.rms_norm(q, q_weight, 1e-6, zero_centered=True),
                            triton_fused.rms_norm(k, k_weight, 1e-6, zero_centered=True))
    want_cache = cache.clone()
    flat = want_cache.view(2, -1, kv_heads, dim)
    flat[0].index_copy_(0, slots, want_k)
    flat[1].index_copy_(0, slots, v)
    before = proj.clone()
    got = triton_fused.norm_rope_write_kv(q, k, v, q_weight, k_weight, 1e-6, cos, signed_sin, cache, slots)
    assert got.is_contiguous() and torch.equal(got, want_q) and torch.equal(cache, want_cache)
    assert torch.equal(proj, before)
    assert triton_fused.norm_rope_write_kv(q, k, v, q_weight[:8], k_weight, 1e-6, cos, signed_sin, cache, slots) is None


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_norm_rope_write_kv_folds_q_gate_k_vs_expand_as_expand_rows_would(dtype, device="cpu"):
    """The fused q|gate, k, v projection's expand (``PendingExpand``), added by
    the gated attention's kernel as it loads: q, the cache and the gates
    (in place) as ``expand_rows`` then the kernel leave them; rows on slots
    1, 0 (base: untouched) and 2 (k untargeted)."""
    gen = torch.Generator().manual_seed(16)
    tokens, heads, kv_heads, dim = 3, 4, 2, 32
    sizes = [heads * 2 * dim, kv_heads * dim, kv_heads * dim]
    out, expand = pending_expand((2 * torch.randn(tokens, sum(sizes), generator=gen)).to(dtype).to(device), sizes,
                                 [1, 0, 2])
    n = sum(sizes)

    def views(proj):
        q_gate, k, v = proj[:, :n].split(sizes, dim=-1)
        q_gate = q_gate.view(tokens, heads, 2 * dim)
        return q_gate[..., :dim], q_gate[..., dim:], k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)

    q_weight, k_weight = ((torch.randn(2, dim, generator=gen) / 4).to(dtype).to(device)).unbind(0)
    cos, signed_sin = PartialMRotary(10000.0, 8, (2, 1, 1)).tables(torch.tensor([5, 17, 300], device=device), dtype)
    cache, slots = torch.zeros(2, 6, 4, kv_heads, dim, dtype=dtype, device=device), torch.tensor([7, 0, 22], device=device)
    want = out.clone()
    expand._replace(t=want[:, n:]).apply(want[:, :n])
    wq, wgate, wk, wv = views(want)
    want_cache = cache.clone()
    want_q = triton_fused.norm_rope_write_kv(wq, wk, wv, q_weight, k_weight, 1e-6, cos, signed_sin, want_cache, slots)
    before = out.clone()
    q, gate, k, v = views(out)
    got = triton_fused.norm_rope_write_kv(q, k, v, q_weight, k_weight, 1e-6, cos, signed_sin, cache, slots, gate, expand)
    check = torch.equal if device == "cpu" else assert_close_to_expand
    assert check(got, want_q) in (True, None) and check(cache, want_cache) in (True, None)
    assert check(gate, wgate) in (True, None)  # the gates expanded in place
    assert not torch.equal(wgate, views(before)[1])  # the expand changed them
    assert torch.equal(out[1], before[1]) and torch.equal(q, views(before)[0]) and torch.equal(k, views(before)[2])
    for bad_gate in (None, gate[:, :2], gate.float() if dtype != torch.float32 else gate.half()):
        assert triton_fused.norm_rope_write_kv(q, k, v, q_weight, k_weight, 1e-6, cos, signed_sin, cache, slots,
                                               bad_gate, expand) is None  # an expand needs q's gates
    other = pending_expand(out[:, :n].clone(), [heads * dim, heads * dim + 2 * kv_heads * dim], [1, 0, 2])[1]
    assert triton_fused.norm_rope_write_kv(q, k, v, q_weight, k_weight, 1e-6, cos, signed_sin, cache, slots,
                                           gate, other) is None  # not q|gate, k, v's shards


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_gated_rms_norm_equals_the_layers_torch_ops_to_rounding(dtype, device="cpu"):
    """Qwen3.5's DeltaNet output norm: heads of the delta rule's output, the
    gate a strided view of in_proj's wider rows (as the layer hands them)."""
    gen = torch.Generator().manual_seed(14)
    x = (2 * torch.randn(3, 5, 24, generator=gen)).to(dtype).to(device)  # five heads of 24: both padded
    proj = (3 * torch.randn(3, 5 * 24 + 7, generator=gen)).to(dtype).to(device)
    gate = proj[:, 3:3 + 5 * 24]
    norm = GatedRMSNorm(24, 1e-6).to(device)
    norm.weight.data = (1 + torch.randn(24, generator=gen) / 4).to(dtype).to(device)
    want = norm.reference(x.reshape(-1, 24), gate.reshape(-1, 24)).view(3, -1)
    got = triton_fused.gated_rms_norm(x, gate, norm.weight, 1e-6)
    assert got.shape == (3, 5 * 24) and got.dtype == dtype
    assert_close_to_rounding(got, want)
    assert triton_fused.gated_rms_norm(x.transpose(0, 1).contiguous().transpose(0, 1), gate, norm.weight, 1e-6) is None
    assert triton_fused.gated_rms_norm(x, gate[:, :-1], norm.weight, 1e-6) is None


# ---- compiled, on the device -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compiled_on_gpu(dtype):
    test_rms_norm_matches_torch(dtype, "cuda")
    for zero_centered in (False, True):
        test_add_rms_norm_writes_the_sum_and_normalises_it(dtype, zero_centered, "cuda")
    test_rms_norm_per_head_on_a_projections_view(dtype, "cuda")
    test_rope_write_kv_equals_rotate_and_index_copy_bit_for_bit(dtype, "cuda")
    test_silu_mul_equals_torch_to_rounding(dtype, "cuda")
    test_gated_rms_norm_equals_the_layers_torch_ops_to_rounding(dtype, "cuda")
    test_norm_rope_write_kv_equals_norms_partial_rotary_and_index_copy(dtype, "cuda")
    test_norm_rope_write_kv_folds_q_gate_k_vs_expand_as_expand_rows_would(dtype, "cuda")
    test_rope_write_kv_adds_a_delta_as_add_would(dtype, "cuda")
    test_silu_mul_adds_a_delta_as_add_would(dtype, "cuda")
    test_rope_write_kv_folds_a_fused_expand_as_expand_rows_would(dtype, "cuda")
    for rows in FOLD_SLOTS:
        test_silu_mul_folds_a_fused_expand_as_expand_rows_would(dtype, rows, "cuda")
        for zero_centered in (False, True):
            test_add_rms_norm_folds_a_fused_expand_as_expand_rows_would(dtype, zero_centered, rows, "cuda")
