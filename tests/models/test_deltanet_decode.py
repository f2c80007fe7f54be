"""The delta rule's decode kernel (``deltanet_decode.decode_step``) against
the reference's recurrent step, on CPU in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET; the GPU runs it compiled in
test_deltanet_kernels_gpu.py).

Inputs come as the layer hands them over: q, k, v strided views of one
convolution output, a and b views of in_proj's, the gates raw; the pool's
slots are updated in place, and slots no row names must stay as they were.
"""

from __future__ import annotations

import pytest
import torch

from mstar_actors.models import deltanet_decode
from mstar_actors.models.deltanet_decode import conv_step, decode_step
from mstar_actors.models.deltanet_ops import Gates, _prepare, recurrent_delta_step

# CPU tensors run the kernel only in Triton's interpreter (no CUDA device);
# on a GPU host test_deltanet_kernels_gpu.py runs it compiled instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the kernel on CPU tensors needs Triton's interpreter (no CUDA)")

DK, DV = 16, 24  # DV: a 16-wide value tile and half of another (NARROW); one 32-wide, partial (WIDE)
NUM_SLOTS = 9


def layer_inputs(gen, rows: int, num_k: int, num_v: int, dtype: torch.dtype):
    """q, k, v views of one [rows, conv_dim] tensor; a, b views of a wider one."""
    mixed = torch.randn(rows, 2 * num_k * DK + num_v * DV, generator=gen).to(dtype)
    q, k, v = mixed.split([num_k * DK, num_k * DK, num_v * DV], dim=-1)
    proj = torch.randn(rows, 3 + 2 * num_v, generator=gen) * 3
    proj[0, 3] = 30.0  # past softplus' threshold: taken as is
    proj = proj.to(dtype)
    gates = Gates(proj[:, 3:3 + num_v], proj[:, 3 + num_v:], torch.rand(num_v, generator=gen) * 2 - 1,
                  torch.randn(num_v, generator=gen).to(dtype))
    return q.view(rows, num_k, DK), k.view(rows, num_k, DK), v.view(rows, num_v, DV), gates


def reference(q, k, v, gates: Gates, ssm, slots, continues):
    state = ssm[slots] * continues[:, None, None, None]
    o, state = recurrent_delta_step(*_prepare(q, k, v, gates.decay(), gates.beta()), state)
    out = ssm.clone()
    out[slots] = state
    return o.to(v.dtype), out


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("dtype, heads, atol", [(torch.float32, (2, 4), 2e-5), (torch.float32, (3, 3), 2e-5),
                                                (torch.bfloat16, (1, 2), 2e-2)],
                         ids=["fp32-gva", "fp32-equal-heads", "bf16"])
def test_decode_step_matches_the_recurrent_reference_in_place(dtype, heads, atol, wide, monkeypatch):
    if wide:  # the tiles of many rows, here at five
        monkeypatch.setattr(deltanet_decode, "WIDE_FROM", 0)
    gen = torch.Generator().manual_seed(heads[0] * 10 + heads[1])
    num_k, num_v = heads
    rows = 5
    q, k, v, gates = layer_inputs(gen, rows, num_k, num_v, dtype)
    ssm = torch.randn(NUM_SLOTS + 1, num_v, DK, DV, generator=gen) * 0.3
    slots = torch.tensor([6, 0, 3, 8, 1])
    continues = torch.tensor([True, False, True, True, False])
    want_o, want_ssm = reference(q, k, v, gates, ssm, slots, continues)
    got_ssm = ssm.clone()
    got_o = decode_step(q, k, v, gates, got_ssm, slots, continues)
    assert got_o.dtype == dtype and got_o.shape == v.shape
    torch.testing.assert_close(got_o.float(), want_o.float(), rtol=0, atol=atol)
    torch.testing.assert_close(got_ssm, want_ssm, rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-2)
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots.tolist()]
    assert torch.equal(got_ssm[untouched], ssm[untouched])


def test_a_fresh_row_ignores_what_its_slot_held():
    """A row that starts afresh computes from zero state whatever the slot held (NaN here)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, gates = layer_inputs(gen, 2, 1, 2, torch.float32)
    ssm = torch.randn(4, 2, DK, DV, generator=gen)
    ssm[2] = float("nan")
    slots, continues = torch.tensor([2, 0]), torch.tensor([False, True])
    want_o, want_ssm = reference(q, k, v, gates, torch.nan_to_num(ssm), slots, continues)
    got_o = decode_step(q, k, v, gates, ssm, slots, continues)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=2e-5)
    torch.testing.assert_close(ssm[2], want_ssm[2], rtol=0, atol=2e-5)


def test_decode_step_refuses_what_it_cannot_read():
    gen = torch.Generator().manual_seed(4)
    q, k, v, gates = layer_inputs(gen, 2, 2, 4, torch.float32)
    ssm = torch.zeros(3, 4, DK, DV)
    slots, continues = torch.tensor([0, 1]), torch.tensor([True, True])
    with pytest.raises(ValueError, match="Hv a multiple of Hk"):
        decode_step(q, k, v[:, :3], gates, ssm, slots, continues)
    with pytest.raises(ValueError, match="float32"):
        decode_step(q, k, v, gates, ssm.double(), slots, continues)
    with pytest.raises(ValueError, match="gates"):
        decode_step(q, k, v, gates._replace(a=gates.a[:, :2]), ssm, slots, continues)
    with pytest.raises(ValueError, match="contiguous"):
        decode_step(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, gates, ssm, slots, continues)


def test_context_lengths_say_which_rows_continue():
    """Given context lengths instead of flags, a row continues unless its context is its one token."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, gates = layer_inputs(gen, 3, 1, 2, torch.float32)
    ssm = torch.randn(4, 2, DK, DV, generator=gen)
    slots = torch.tensor([3, 1, 0])
    want_o, want_ssm = reference(q, k, v, gates, ssm, slots, torch.tensor([True, False, True]))
    got_o = decode_step(q, k, v, gates, ssm, slots, torch.tensor([7, 1, 2], dtype=torch.int32))
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=2e-5)
    torch.testing.assert_close(ssm, want_ssm, rtol=0, atol=2e-5)


def test_a_row_map_decodes_its_rows_in_place_and_padding_does_nothing():
    """Entries on rows of a wider step (``rows``, a static step's single-token
    rows): each entry's row of ``out`` gets that row's output, the other rows
    and the slots no live entry names stay as they were, padding (-1) included
    though it names a slot."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, gates = layer_inputs(gen, 6, 2, 4, torch.float32)
    ssm = torch.randn(NUM_SLOTS + 1, 4, DK, DV, generator=gen)
    rows = torch.tensor([4, -1, 1, 3, -1])
    slots = torch.tensor([2, NUM_SLOTS, 7, 0, 5])
    context = torch.tensor([9, 1, 1, 30, 4], dtype=torch.int32)
    live = rows >= 0
    want_o, want_ssm = reference(q[rows[live]], k[rows[live]], v[rows[live]], gates.rows(rows[live]), ssm,
                                 slots[live], context[live] > 1)
    out = torch.full((7, 4, DV), 5.0)
    got_ssm = ssm.clone()
    assert decode_step(q, k, v, gates, got_ssm, slots, context, rows, out) is out
    torch.testing.assert_close(out[rows[live]], want_o, rtol=0, atol=2e-5)
    assert (out[[0, 2, 5, 6]] == 5.0).all()
    torch.testing.assert_close(got_ssm, want_ssm, rtol=0, atol=2e-5)
    assert torch.equal(got_ssm[[NUM_SLOTS, 5]], ssm[[NUM_SLOTS, 5]])
    with pytest.raises(ValueError, match="int64 rows"):
        decode_step(q, k, v, gates, got_ssm, slots, context, rows.int(), out)
    with pytest.raises(ValueError, match="out"):
        decode_step(q, k, v, gates, got_ssm, slots, context, rows, out[:5])


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_counted_entries_take_their_tokens_in_order(dtype, atol):
    """Entries of several tokens (``counts``: a static or eager step's short
    chunks beside its decode rows): each entry's tokens one after another
    from its slot's state, as the reference's recurrent step takes them;
    a chunk whose context is its own tokens starts afresh, a later chunk
    continues; padding (-1, count 0) and rows no entry names stay as they were."""
    gen = torch.Generator().manual_seed(8)
    q, k, v, gates = layer_inputs(gen, 12, 2, 4, dtype)
    ssm = torch.randn(NUM_SLOTS + 1, 4, DK, DV, generator=gen) * 0.3
    rows = torch.tensor([0, 3, -1, 5, 10, 4])
    counts = torch.tensor([3, 1, 0, 5, 2, 0], dtype=torch.int32)
    slots = torch.tensor([6, 2, NUM_SLOTS, 4, 1, 8])
    # fresh, continues, padding, continues, fresh, and no tokens on a real row (nothing done, though "fresh")
    context = torch.tensor([3, 9, 1, 12, 2, 0], dtype=torch.int32)
    want_ssm, want_o = ssm.clone(), {}
    for row, n, slot, ctx in zip(rows.tolist(), counts.tolist(), slots.tolist(), context.tolist()):
        if row < 0 or n == 0:
            continue
        state = want_ssm[slot : slot + 1] * float(ctx > n)
        for r in range(row, row + n):
            o, state = recurrent_delta_step(*_prepare(q[r : r + 1], k[r : r + 1], v[r : r + 1],
                                                      gates.rows(torch.tensor([r])).decay(),
                                                      gates.rows(torch.tensor([r])).beta()), state.contiguous())
            want_o[r] = o[0].to(dtype)
        want_ssm[slot] = state[0]
    out = torch.full((13, 4, DV), 5.0, dtype=dtype)
    got_ssm = ssm.clone()
    assert decode_step(q, k, v, gates, got_ssm, slots, context, rows, out, counts) is out
    for r, o in want_o.items():
        torch.testing.assert_close(out[r].float(), o.float(), rtol=0, atol=atol)
    assert (out[[4, 12]] == 5.0).all()
    torch.testing.assert_close(got_ssm, want_ssm, rtol=0, atol=2e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(got_ssm[[8, NUM_SLOTS]], ssm[[8, NUM_SLOTS]])
    flags = context > counts  # the same entries with flags instead of context lengths
    again = out.clone()
    decode_step(q, k, v, gates, ssm, slots, flags, rows, again, counts)
    assert torch.equal(again, out) and torch.equal(ssm, got_ssm)
    with pytest.raises(ValueError, match="counts"):
        decode_step(q, k, v, gates, ssm, slots, context, rows, out, counts.long())


# -- the convolution (conv_step) ------------------------------------------------------------

KERNEL = 4


def conv_reference(x, weight, conv, slots, context_lens):
    """Each row's window (its slot's saved inputs, zeros when fresh, then x) in
    float32: ``(silu(window . weight) in x's dtype, the pool with each slot's
    window shifted by one)``."""
    fresh = (context_lens <= 1)[:, None, None]
    window = torch.cat((conv[slots].float().masked_fill(fresh, 0.0), x.float()[:, :, None]), dim=2)
    out = conv.clone()
    out[slots] = window[:, :, 1:].to(conv.dtype)
    return torch.nn.functional.silu((window * weight.float()[None]).sum(-1)).to(x.dtype), out


def conv_case(gen, rows: int, channels: int, extra: int, dtype: torch.dtype, kernel: int = KERNEL,
              slots: int = NUM_SLOTS):
    """in_proj's rows (the convolution's channels, then ``extra`` more) and a
    pool of ``slots`` random saved inputs, NaN in slot 2 (no row continues it)."""
    proj = torch.randn(rows, channels + extra, generator=gen).to(dtype)
    weight = (torch.randn(channels, kernel, generator=gen) / 2).to(dtype)
    conv = torch.randn(slots + 1, channels, kernel - 1, generator=gen).to(dtype)
    conv[2] = float("nan")
    return proj, weight, conv


@pytest.mark.parametrize("dtype, atol, kernel", [(torch.float32, 1e-5, 4), (torch.float16, 2e-3, 4),
                                                 (torch.float32, 1e-5, 2), (torch.float32, 1e-5, 3)],
                         ids=["fp32", "fp16", "fp32-k2", "fp32-k3"])
def test_conv_step_matches_the_reference_in_place(dtype, atol, kernel):
    """Rows continuing their slot and fresh ones (slot 2 holds NaN: read as
    zeros), a view of wider rows; slots no row names stay as they were."""
    gen = torch.Generator().manual_seed(11)
    proj, weight, conv = conv_case(gen, 4, 300, 40, dtype, kernel)  # two column blocks, the last partial
    slots = torch.tensor([6, 2, 0, 8])
    context_lens = torch.tensor([9, 1, 4, 2], dtype=torch.int32)
    want_out, want_conv = conv_reference(proj[:, :300], weight, conv, slots, context_lens)
    got_conv = conv.clone()
    before = proj.clone()
    got = conv_step(proj, weight, got_conv, slots, context_lens)
    torch.testing.assert_close(got, want_out, rtol=0, atol=atol)
    touched = slots.tolist()
    torch.testing.assert_close(got_conv[touched], want_conv[touched], rtol=0, atol=0)
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in touched]
    assert torch.equal(got_conv[untouched].nan_to_num(7.0), conv[untouched].nan_to_num(7.0))
    assert torch.equal(proj, before)  # without an expand, in_proj's rows are only read


@pytest.mark.parametrize("rows", ["3-rows", "most-rows"])
@pytest.mark.parametrize("sizes, conv_shards", [([96, 96, 128, 128, 4, 4], 3), ([320, 300], 1)],
                         ids=["qkv-z-b-a", "two-shards"])
def test_conv_step_folds_in_projs_expand_as_expand_rows_would(sizes, conv_shards, rows, device="cpu"):
    """in_proj's expand left to the convolution (``PendingExpand`` over its
    shards: Qwen3.5's q, k, v, z, b, a, or any other split of the row): the
    convolution of the expanded input, and the columns past it expanded in
    place, as ``expand_rows`` then the plain step; rows on slots 1, 0 (base:
    as it was) and 2 (one shard untargeted), up to ``CONV_FOLD_MAX_ROWS``,
    whose result is the same, bit for bit, beside other neighbours; one row
    more is left to ``expand_rows`` (None, nothing done). (The GPU suite runs
    it compiled, where ``expand_rows`` sums the rank's products in another
    order: there the two agree to float32's rounding.)"""
    from .test_triton_fused import FOLD_SLOTS, assert_close_to_expand, by_rows, pending_expand, reversed_rows

    gen = torch.Generator().manual_seed(12)
    row_slots = (FOLD_SLOTS["3-rows"] if rows == "3-rows"
                 else (FOLD_SLOTS["37-rows"] * 2)[:deltanet_decode.CONV_FOLD_MAX_ROWS])
    num_rows = len(row_slots)
    channels = sum(sizes[:conv_shards])
    proj, weight, conv = (t.to(device) for t in conv_case(gen, num_rows, channels, sum(sizes) - channels,
                                                          torch.float32, slots=num_rows + NUM_SLOTS))
    out, expand = pending_expand(proj, sizes, row_slots)
    width = proj.shape[1]
    # Each row its own state slot, every fourth fresh (the second, on slot 2: its NaN read as zeros).
    slots = torch.arange(1, num_rows + 1, device=device)
    context_lens = torch.tensor([1 if i % 4 == 1 else 3 + i for i in range(num_rows)], dtype=torch.int32, device=device)
    want = out.clone()
    with by_rows():  # one program a row, as the fold sums (tiles of rows' dots round otherwise)
        expand._replace(t=want[:, width:]).apply(want[:, :width])
    want_conv = conv.clone()
    want_out = conv_step(want[:, :width], weight, want_conv, slots, context_lens)
    again, again_conv = out.clone(), conv.clone()
    got = conv_step(out[:, :width], weight, conv, slots, context_lens, expand)
    check = torch.equal if device == "cpu" else assert_close_to_expand  # compiled, expand_rows sums in another order
    assert check(got, want_out) in (True, None) and check(conv.nan_to_num(7.0), want_conv.nan_to_num(7.0)) in (True, None)
    assert check(out[:, channels:width], want[:, channels:width]) in (True, None)  # past the convolution: in place
    base = [i for i, slot in enumerate(row_slots) if slot == 0]
    assert torch.equal(out[base, :width], proj[base])  # the base rows
    assert not torch.equal(want[:, :width], proj)  # the expand changed something
    again, again_expand = reversed_rows(again, expand)  # each row beside other neighbours: the same
    flipped = conv_step(again[:, :width], weight, again_conv, slots.flip(0), context_lens.flip(0), again_expand)
    assert torch.equal(flipped.flip(0), got) and torch.equal(again.flip(0), out)
    assert torch.equal(again_conv.nan_to_num(7.0), conv.nan_to_num(7.0))
    two = pending_expand(proj, [channels, width - channels], row_slots)[1]  # any shards of in_proj's width fit
    assert conv_step(out[:, :width], weight, conv, slots, context_lens, two._replace(t=two.t[:, :0])) is None  # t too narrow
    assert conv_step(out[:, :width], weight, conv, slots, context_lens, torch.zeros_like(proj)) is None
    if num_rows == deltanet_decode.CONV_FOLD_MAX_ROWS:  # a row more: past the line, left to expand_rows' launch
        more, kept = pending_expand(torch.cat([proj, proj[:1]]), sizes, row_slots + [1]), conv.clone()
        assert conv_step(more[0][:, :width], weight, conv, torch.cat([slots, slots[:1]]),
                         torch.cat([context_lens, context_lens[:1]]), more[1]) is None
        assert torch.equal(conv.nan_to_num(7.0), kept.nan_to_num(7.0))


def test_conv_step_refuses_what_it_cannot_read():
    gen = torch.Generator().manual_seed(13)
    proj, weight, conv = conv_case(gen, 2, 64, 0, torch.float32)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="int32 context lengths"):
        conv_step(proj, weight, conv, slots, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"pool.conv \[P \+ 1, C, K - 1\]"):
        conv_step(proj, weight, conv[:, :, :2], slots, torch.tensor([2, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="unit column stride"):
        conv_step(proj.t().contiguous().t(), weight, conv, slots, torch.tensor([2, 2], dtype=torch.int32))


# -- the Triton ops' routing (deltanet_triton), the chunked kernels stood in ---------------------


@pytest.fixture
def triton_ops(monkeypatch):
    """``TritonDeltaNetOps`` importable without fla-core (a CPU host): its
    chunked kernel stood in by one that fails, so a test sees that a step of
    short sequences never calls it."""
    import importlib
    import sys
    import types

    def chunked(*args, **kwargs):
        raise AssertionError("a sequence of at most RECURRENT_MAX tokens reached the chunked kernel")

    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = chunked
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)
    import mstar_actors.models as models

    name = "mstar_actors.models.deltanet_triton"
    saved = sys.modules.pop(name, None)
    try:
        module = importlib.import_module(name)
    finally:  # the module built on the stand-in is left nowhere a later import would find it
        sys.modules.pop(name, None)
        models.__dict__.pop("deltanet_triton", None)
        if saved is not None:
            sys.modules[name] = saved
    return module.TritonDeltaNetOps()


@pytest.mark.parametrize("form", ["eager", "static"])
def test_short_chunks_take_the_recurrent_kernel_beside_decode_rows(triton_ops, form):
    """A step of decode rows and chunks of up to RECURRENT_MAX tokens, fresh
    and continuing, eager and in a graphed step's static form (no longer
    sequence: no chunked call, padding entries and rows past the step): the
    reference's outputs and states; padding rows zeros."""
    from mstar_actors.models.attention import AttentionMetadata
    from mstar_actors.models.deltanet_ops import RECURRENT_MAX, StatePool, TorchDeltaNetOps, static_step_plan

    gen = torch.Generator().manual_seed(12)
    query_lens, context_lens, slots = [1, 5, 1, RECURRENT_MAX, 2], [9, 5, 1, 80, 2], [3, 0, 7, 5, 1]
    rows = sum(query_lens) + (3 if form == "static" else 0)
    q, k, v, gates = layer_inputs(gen, rows, 2, 4, torch.float32)
    meta = AttentionMetadata.from_lists(slot_mapping=[0] * sum(query_lens), block_tables=[[0]] * 5, num_blocks=[1] * 5,
                                        query_lens=query_lens, context_lens=context_lens, device="cpu")
    meta.state_slots, meta.state_slots_list = torch.tensor(slots), slots
    ssm = torch.randn(NUM_SLOTS + 1, 4, DK, DV, generator=gen) * 0.3
    ref = StatePool(torch.zeros(1), ssm.clone())
    real = sum(query_lens)
    want = TorchDeltaNetOps().delta_rule(q[:real], k[:real], v[:real], gates.rows(torch.arange(real)), ref, meta)
    pool = StatePool(torch.zeros(1), ssm.clone())
    if form == "static":
        plan = static_step_plan(query_lens, context_lens, slots, num_tokens=rows, num_entries=7, num_chunk_seqs=0,
                                scratch_slot=NUM_SLOTS)
        meta.deltanet_static = plan.to_step("cpu")
    got = triton_ops.delta_rule(q, k, v, gates, pool, meta)
    assert got.shape == v.shape
    torch.testing.assert_close(got[:real], want, rtol=0, atol=3e-5)
    if form == "static":  # three padding rows past the step
        assert got.shape[0] == real + 3 and (got[real:] == 0).all()
    torch.testing.assert_close(pool.ssm[:NUM_SLOTS], ref.ssm[:NUM_SLOTS], rtol=0, atol=3e-5)
