"""A Gated DeltaNet layer's decode tokens and short chunks on Triton, in place on the state pool.

Two kernels: ``conv_step`` (the short causal convolution, with in_proj's
LoRA expand folded in) and ``decode_step`` (the gated delta rule).

``decode_step`` runs a step's single-token rows (row ``i`` a sequence on
state slot ``slots[i]``), and with a row map its short chunks too (an
entry's tokens in order, ``counts``), in one launch: each program loads its part of the
sequence's float32 state straight from ``pool.ssm[slot]`` (zeros where the
sequence starts afresh), applies the decay and the delta update, writes the
output and stores the state back over the same slot. The gates come raw
(``deltanet_ops.Gates``: ``a``, ``b``, ``A_log``, ``dt_bias``) and are
computed in the kernel as ``Gates.decay`` and ``Gates.beta`` compute them
(beta rounded to ``b``'s dtype, as torch's sigmoid leaves it); q and k are
L2-normalised in the kernel (eps 1e-6, q scaled by ``Dk ** -0.5``) and may
be strided views of the convolution's output (each head's elements
contiguous), so nothing is copied on the way in.

Why a kernel of our own: flash-linear-attention's fused recurrent kernel
takes its initial states as one ``[B, Hv, Dk, Dv]`` tensor and returns the
final ones in another, so a pool of slots costs a gather of every row's
state, a masked fill for fresh rows and a scatter back: three more passes
over 1 MB a row and layer (Qwen3.5-0.8B), each about as long as the delta
rule itself, and the gates' torch ops besides. Here the state is read and
written once (``tools/bench_deltanet.py`` times both ways).

Program ``(v tile, row * Hv + head)`` holds ``Dk x BLOCK_V`` of one head's
state (``NARROW`` / ``WIDE`` by the grid's size; a launch takes at most
65,535 rows x value heads, the grid's second axis). Graph safe: the slots
and the flags or context lengths are device tensors, the grid follows the
shapes. A padded row of a graphed step names the scratch slot and starts
afresh, so it reads no sequence's state and writes only the scratch slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch
from mstar_actors.lora.triton_ops import _b_tile, _fold_dot

from .deltanet_ops import Gates
from .triton_fused import fold_args, fold_block_r

# Value columns a program and its warps: narrow tiles while the grid is small
# (few rows), wider ones past ``WIDE_FROM`` rows x value heads, where fewer,
# longer reads of each state row pay (swept on the H200 over 8-64 columns and
# 1-8 warps at 1-128 rows of Qwen3.5-0.8B's heads; ``tools/bench_deltanet.py`` times the tiles picked). The
# two split the sum over Dk differently: a float32 result may differ in its last bit between step sizes on
# either side of the line, as a GEMM's does between batch sizes.
NARROW = (16, 1)
WIDE = (32, 2)
WIDE_FROM = 256
BLOCK_C = 256  # channels per convolution program (one row each)
CONV_WARPS = 4
# The most rows whose in_proj expand the convolution folds: past them ``expand_rows`` then the plain step
# cost less (``tools/check_lora_kernels.py --fold-table`` on the H200, Qwen3.5-0.8B's in_proj, rank 16, us
# folded / split: 3.1 / 4.4 at 8 rows, 4.3 / 4.9 at 16, 6.6 / 6.1 at 24, 13.9 / 12.0 at 64; tiles of 16
# rows a program with a tl.dot a slot cost more than both: 18-24 us at 64 rows).
CONV_FOLD_MAX_ROWS = 16


@triton.jit
def _token_inputs(row64, live, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, head, hv, offs_k, offs_v, mask_k, mask_v,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt):
    """Row ``row64``'s q, k, v and raw gates as stored (row 0's unless ``live``: a row every step has)."""
    row64 = tl.where(live, row64, 0)
    q = tl.load(q_ptr + row64 * stride_qt + head * stride_qh + offs_k, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + row64 * stride_kt + head * stride_kh + offs_k, mask=mask_k, other=0.0)
    v = tl.load(v_ptr + row64 * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
    return q, k, v, tl.load(a_ptr + row64 * stride_at + hv), tl.load(b_ptr + row64 * stride_bt + hv)


@triton.jit
def _delta_token(h, q, k, v, a, b_raw, o_row_ptr, offs_v, mask_v, scale, neg_exp_a, dt_bias):
    """One token (``_token_inputs``) through the state tile ``h``: writes its output row, returns the new ``h``."""
    q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale  # deltanet_ops.l2norm's eps
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    # Gates.decay: -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear past 20).
    x = a.to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = neg_exp_a * softplus
    # Gates.beta: sigmoid in float32, rounded to b's dtype as torch's op leaves it.
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    h = h * tl.exp(g)
    delta = (v - tl.sum(h * k[:, None], axis=0)) * beta
    h = h + k[:, None] * delta[None, :]
    o = tl.sum(h * q[:, None], axis=0)
    tl.store(o_row_ptr + offs_v, o.to(o_row_ptr.dtype.element_ty), mask=mask_v)
    return h


@triton.jit
def _delta_decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, ssm_ptr, o_ptr, slots_ptr, continues_ptr, rows_ptr,
    counts_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, FRESH_AT: tl.constexpr, HAS_ROWS: tl.constexpr,
    MULTI: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    pid = tl.program_id(1)
    entry, hv = pid // HV, pid % HV
    head = hv // GROUP  # value heads share key heads (GVA)
    slot = tl.load(slots_ptr + entry).to(tl.int64)
    if MULTI:  # entry i: counts[i] tokens from row rows[i] on, in order; continues unless its context is them
        count = tl.load(counts_ptr + entry)
        continues = tl.load(continues_ptr + entry).to(tl.int32) > FRESH_AT * count
    else:
        continues = tl.load(continues_ptr + entry) > FRESH_AT
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    if HAS_ROWS:  # entry i is row rows[i] of q, k, v, the gates and o; -1: padding, which reads and writes nothing
        row64 = tl.load(rows_ptr + entry).to(tl.int64)
        live = row64 >= 0
        if MULTI:  # an entry of no tokens does nothing either, whatever its context says
            live = live & (count > 0)
        continues = continues & live
        row64 = tl.maximum(row64, 0)
        mask_v = (offs_v < tl.where(live, DV, 0))
    else:
        row64 = entry.to(tl.int64)
        live = row64 >= 0
        mask_v = offs_v < DV
    mask_k = offs_k < DK
    mask_h = mask_k[:, None] & mask_v[None, :]
    h_ptrs = ssm_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    # A fresh row reads nothing (zeros): its k range is empty.
    h = tl.load(h_ptrs, mask=(offs_k < tl.where(continues, DK, 0))[:, None] & mask_v[None, :], other=0.0)
    neg_exp_a = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    o_ptrs = o_ptr + row64 * stride_ot + hv * stride_oh
    args = (q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, head, hv, offs_k, offs_v, mask_k, mask_v, stride_qt, stride_qh,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt)
    if MULTI:  # each token's inputs read while the one before it computes
        q, k, v, a, b = _token_inputs(row64, live & (count > 0), *args)
        for j in range(0, count):
            nq, nk, nv, na, nb = _token_inputs(row64 + j + 1, live & (j + 1 < count), *args)
            h = _delta_token(h, q, k, v, a, b, o_ptrs + j * stride_ot, offs_v, mask_v, scale, neg_exp_a, dt_bias)
            q, k, v, a, b = nq, nk, nv, na, nb
    else:
        q, k, v, a, b = _token_inputs(row64, live, *args)
        h = _delta_token(h, q, k, v, a, b, o_ptrs, offs_v, mask_v, scale, neg_exp_a, dt_bias)
    tl.store(h_ptrs, h, mask=mask_h)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Gates, ssm: torch.Tensor,
           continues: torch.Tensor) -> None:
    rows, num_k, dk = q.shape
    num_v, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != rows or num_v % num_k:
        raise ValueError(f"deltanet decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; accepted: "
                         "q, k [B, Hk, Dk] and v [B, Hv, Dv] with Hv a multiple of Hk")
    if any(t.stride(-1) != 1 for t in (q, k, v)) or gates.a.stride(-1) != 1 or gates.b.stride(-1) != 1:
        raise ValueError("deltanet decode: q, k, v, a and b need their last dimension contiguous")
    if gates.a.shape != (rows, num_v) or gates.b.shape != (rows, num_v):
        raise ValueError(f"deltanet decode: gates a {tuple(gates.a.shape)}, b {tuple(gates.b.shape)}; "
                         f"accepted: [{rows}, {num_v}]")
    if continues.dtype not in (torch.bool, torch.int32):
        raise ValueError(f"deltanet decode: continues is {continues.dtype}; accepted: bool flags or int32 "
                         "context lengths")
    if gates.A_log.shape != (num_v,) or gates.dt_bias.shape != (num_v,):
        raise ValueError(f"deltanet decode: A_log {tuple(gates.A_log.shape)}, dt_bias {tuple(gates.dt_bias.shape)}; "
                         f"accepted: [{num_v}] each")
    if ssm.shape[1:] != (num_v, dk, dv) or ssm.dtype != torch.float32 or ssm.stride(-1) != 1:
        raise ValueError(f"deltanet decode: pool.ssm {tuple(ssm.shape)} {ssm.dtype}; accepted: float32 "
                         f"[slots, {num_v}, {dk}, {dv}] with Dv contiguous")


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Gates, ssm: torch.Tensor,
                slots: torch.Tensor, continues: torch.Tensor, rows: torch.Tensor | None = None,
                out: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``gates`` of those rows, the
    pool's ``ssm [P + 1, Hv, Dk, Dv]``, each row's ``slots [B]`` and whether
    it continues its slot's state, else starts from zeros: ``continues [B]``
    bool, or the rows' context lengths (int32: a row continues unless its
    context is its one token, read in the kernel, so a captured step derives
    nothing from them that a replay would not redo) -> ``o [B, Hv, Dv]`` in
    ``v``'s dtype; each row's slot of ``ssm`` is updated in place.

    ``rows [E]`` (int64): E entries, entry i on row ``rows[i]`` of q, k, v
    and the gates (-1: none, the entry does nothing), with ``slots`` and
    ``continues`` per entry; its output goes to that row of ``out`` (q's
    rows at least), which is returned (a mixed step's decode rows among
    longer ones, ``deltanet_ops.StaticStep``).

    ``counts [E]`` (int32, with ``rows``): entry i is a sequence of
    ``counts[i]`` tokens, rows ``rows[i]`` on, taken one after another by one
    program (0: nothing done); it continues its slot unless its context is
    those tokens (``continues`` as context lengths) or its flag is false. A
    short chunk so costs its tokens in sequence but no launches of its own
    (``deltanet_ops.RECURRENT_MAX``)."""
    _check(q, k, v, gates, ssm, continues)
    num_rows, num_k, dk = q.shape
    num_v, dv = v.shape[1], v.shape[2]
    if rows is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    elif (rows.dtype != torch.long or slots.shape != rows.shape or continues.shape != rows.shape or out is None
          or out.shape[0] < num_rows or out.shape[1:] != v.shape[1:] or out.stride(-1) != 1):
        raise ValueError(f"deltanet decode: rows {tuple(rows.shape)} {rows.dtype}, slots {tuple(slots.shape)}, "
                         f"continues {tuple(continues.shape)}, out {None if out is None else tuple(out.shape)}; "
                         f"accepted: int64 rows, slots and continues of one length, out [>= {num_rows}, {num_v}, "
                         f"{dv}] with Dv contiguous")
    if counts is not None and (rows is None or counts.dtype != torch.int32 or counts.shape != rows.shape):
        raise ValueError(f"deltanet decode: counts {tuple(counts.shape)} {counts.dtype}; accepted: int32, one a "
                         "row-map entry (rows given)")
    entries = num_rows if rows is None else rows.shape[0]
    if entries * num_v > 65535:
        raise ValueError(f"deltanet decode: {entries} rows x {num_v} value heads is past a launch's 65,535 "
                         "programs a column; accepted: fewer rows a step")
    if entries == 0:
        return out
    block_v, warps = WIDE if entries * num_v > WIDE_FROM else NARROW
    _delta_decode_kernel[(triton.cdiv(dv, block_v), entries * num_v)](
        q, k, v, gates.a, gates.b, gates.A_log, gates.dt_bias, ssm, out, slots, continues,
        slots if rows is None else rows, slots if counts is None else counts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        gates.a.stride(0), gates.b.stride(0),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), out.stride(0), out.stride(1), dk**-0.5,
        HV=num_v, GROUP=num_v // num_k, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        FRESH_AT=0 if continues.dtype == torch.bool else 1, HAS_ROWS=rows is not None, MULTI=counts is not None,
        num_warps=warps,
    )  # fmt: skip
    return out


# -- the convolution ---------------------------------------------------------------------------


@triton.jit
def _tap(tile, taps, j, AXIS: tl.constexpr):
    """Tap ``j`` of ``tile`` (``taps`` along ``AXIS``, broadcast), exactly (a sum of it and zeros)."""
    return tl.sum(tl.where(taps == j, tile, 0.0), axis=AXIS)


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, out_ptr, prev_ptr, ctx_ptr, slots_ptr, M, C, N,
    stride_x, stride_o, stride_wc, stride_wk, stride_ps, stride_pc,
    t_ptr, stride_t, b_ptr, stride_bs, stride_bn, sc_ptr, stride_ss, stride_sl, lslot_ptr, offs_ptr, num_slots, R,
    K: tl.constexpr, TAPS: tl.constexpr, BLOCK_C: tl.constexpr, FOLD: tl.constexpr, NUM_SHARDS: tl.constexpr,
    BLOCK_R: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One row by ``BLOCK_C`` columns a program (``rows``: that row, as a tile of one)."""
    rows = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)
    ok = rows < M
    chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_row = chan < N
    is_conv = chan < C
    tile = ok[:, None] & in_row[None, :]
    conv_tile = ok[:, None] & is_conv[None, :]
    taps = tl.arange(0, TAPS)
    w = tl.load(w_ptr + chan[:, None] * stride_wc + taps[None, :] * stride_wk,
                mask=is_conv[:, None] & (taps < K)[None, :], other=0.0).to(tl.float32)
    if FOLD:  # in_proj's expand over the whole row: B's columns for the row's slot (before the wait)
        lslot = tl.load(lslot_ptr + rows, mask=ok, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        slot = tl.max(lslot, axis=0)
        b = _b_tile(b_ptr, stride_bs, stride_bn, slot, 0, chan, in_row, offs_r, offs_r < tl.where(slot != 0, R, 0))
        # The shards this block's columns fall in (one, but for narrow ones: b and a).
        first, last = tl.program_id(1) * BLOCK_C, tl.minimum(tl.program_id(1) * BLOCK_C + BLOCK_C, N) - 1
        lo, hi = 0, 0
        for i in tl.static_range(1, NUM_SHARDS):
            start = tl.load(offs_ptr + i)
            lo += (first >= start).to(tl.int32)
            hi += (last >= start).to(tl.int32)
    cont = tl.load(ctx_ptr + rows, mask=ok, other=0) > 1
    slot_of_state = tl.load(slots_ptr + rows, mask=ok, other=0).to(tl.int64)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + rows[:, None] * stride_x + chan[None, :], mask=tile, other=0.0)
    if FOLD:  # each shard's expand on its columns (triton_fused._fold_dot's sum of the rank's products)
        delta = tl.zeros([1, BLOCK_C], tl.float32)
        if slot != 0:
            for s in range(lo, hi + 1):
                d = _fold_dot(t_ptr, stride_t, rows, lslot, slot, s, num_slots, offs_r, R, b,
                              tl.load(sc_ptr + s * stride_ss + slot * stride_sl), False, False)
                ours = (chan >= tl.load(offs_ptr + s)) & (chan < tl.load(offs_ptr + s + 1))
                delta = tl.where(ours[None, :], d, delta)
        x = tl.where((lslot != 0)[:, None], (x.to(tl.float32) + delta).to(x.dtype), x)
        tl.store(x_ptr + rows[:, None] * stride_x + chan[None, :], x, mask=tile & ~is_conv[None, :])  # z | b | a
    # The window: the slot's K - 1 saved inputs (zeros for a fresh sequence), then this token's.
    saved = prev_ptr + slot_of_state[:, None, None] * stride_ps + chan[None, :, None] * stride_pc + taps[None, None, :]
    conv = (conv_tile & cont[:, None])[:, :, None]  # nothing saved is read for a fresh sequence
    window = tl.load(saved, mask=conv & (taps < K - 1)[None, None, :], other=0.0).to(tl.float32)
    window = tl.where((taps == K - 1)[None, None, :], x.to(tl.float32)[:, :, None], window)
    # Summed tap by tap in order, as ``_conv_kernel`` sums them: a row's result is the same in a mixed step.
    acc = tl.zeros([1, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        acc += _tap(window, taps[None, None, :], j, 2) * _tap(w, taps[None, :], j, 1)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + chan[None, :], (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
             mask=conv_tile)
    # The slot's new inputs: the window shifted by one (read before any is overwritten).
    shifted = tl.load(saved + 1, mask=conv & (taps < K - 2)[None, None, :], other=0.0)
    shifted = tl.where((taps == K - 2)[None, None, :], x.to(prev_ptr.dtype.element_ty)[:, :, None], shifted)
    tl.debug_barrier()
    tl.store(saved, shifted, mask=conv_tile[:, :, None] & (taps < K - 1)[None, None, :])


def conv_step(proj: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
              context_lens: torch.Tensor, expand=None) -> torch.Tensor | None:
    """One token a row of the causal depthwise convolution: ``proj [B, N]``
    in_proj's rows (unit column stride), whose first ``C`` columns are the
    convolution's input, ``weight [C, K]``, the pool's ``conv [P + 1, C, K - 1]``
    (each row's slot's last ``K - 1`` inputs, updated in place), ``slots [B]``
    and ``context_lens [B]`` (int32: a row continues its slot unless its
    context is its one token) -> ``silu(conv) [B, C]`` in proj's dtype.

    ``expand`` (``lora_layers.PendingExpand`` of in_proj, every shard): its
    LoRA expand is added as the row loads, as ``expand_rows`` would add it,
    to the convolution's input and, in place, to proj's other columns (z, b,
    a: the ops after read them there): no launch of its own. None (nothing
    done) where it does not fit proj (a tensor delta, other shards) or past
    ``CONV_FOLD_MAX_ROWS`` rows, where the expand's own launch costs less."""
    rows, channels = proj.shape[0], weight.shape[0]
    kernel = weight.shape[1]
    if (proj.dim() != 2 or proj.stride(1) != 1 or proj.shape[1] < channels or conv.shape[1:] != (channels, kernel - 1)
            or conv.stride(2) != 1 or context_lens.dtype != torch.int32 or kernel < 2):
        raise ValueError(f"deltanet conv step: proj {tuple(proj.shape)}, weight {tuple(weight.shape)}, pool.conv "
                         f"{tuple(conv.shape)}, context_lens {context_lens.dtype}; accepted: proj [B, >= C] with unit "
                         "column stride, weight [C, K >= 2], pool.conv [P + 1, C, K - 1] contiguous in K - 1, "
                         "int32 context lengths")
    if expand is None:
        fold, width, num_shards = fold_args(None, proj, []), channels, 1
    else:
        if (isinstance(expand, torch.Tensor) or sum(expand.stack.output_sizes) != proj.shape[1]
                or rows > CONV_FOLD_MAX_ROWS):
            return None
        fold = fold_args(expand, proj, list(expand.stack.output_sizes))
        if fold is None:
            return None
        width, num_shards = proj.shape[1], len(expand.stack.output_sizes)
    out = torch.empty((rows, channels), dtype=proj.dtype, device=proj.device)
    if rows == 0:
        return out
    offsets = proj if expand is None else expand.stack.offsets_on(proj.device)
    # A folded expand: B's [BLOCK_C, rank] tile a program.
    block_c = BLOCK_C if expand is None else min(BLOCK_C, max(32, 4096 // fold_block_r(expand)))
    _conv_step_kernel[(rows, triton.cdiv(width, block_c))](
        proj, weight, out, conv, context_lens, slots, rows, channels, width,
        proj.stride(0), out.stride(0), weight.stride(0), weight.stride(1), conv.stride(0), conv.stride(1),
        *fold[:9], offsets, *fold[9:11],
        K=kernel, TAPS=triton.next_power_of_2(kernel), BLOCK_C=block_c, FOLD=expand is not None,
        NUM_SHARDS=num_shards, BLOCK_R=fold_block_r(expand), num_warps=CONV_WARPS, **triton_launch.options(proj),
    )  # fmt: skip
    return out
