"""Fused Triton kernels for the CUDA step's small operations (Triton's
interpreter runs them on CPU in tests).

A decode step of a small model is mostly launches: the profile of
Llama-3.2-1B's shape at one row (``tools/profile_gpu_step.py
--profile-batches``) ran about 37 kernels a layer, of which only 4 are the
GEMMs. torch spends seven on an RMSNorm (cast, square, mean, add, rsqrt,
multiply, cast back, scale), two on the residual add, eight on the rotary
of q and k and two on the KV write, two on SiLU-and-mul. Each one here is
one launch instead, rounding where the torch path it replaces
(``decoder``) rounds, and giving a row the same result whatever its stride,
so graphs and eager steps agree:

- ``rms_norm``: ``RMSNorm`` (normalise in float32, cast back, scale), with
  the residual add in the same pass when ``residual`` is given (the sum is
  rounded to the activations' dtype first, as ``x + y`` is); the sum of
  squares in float64, so its order does not matter.
- ``rope_write_kv``: ``rotate`` on q (in place) and k, then k and v written
  at ``slot_mapping`` into the paged cache: each product and the sum
  rounded to the dtype as torch's three elementwise kernels round them
  (equal bit for bit, float32 too: no FMA contraction).
- ``silu_mul``: ``F.silu(gate) * up`` over the fused ``gate_up`` output
  (the GPU's exp and division are approximate: within 2 ulps).
- ``gated_rms_norm``: Qwen3.5's DeltaNet output norm, per head, times
  ``silu(z)`` (``qwen3_5.GatedRMSNorm``: ten torch launches a layer), z
  read where in_proj wrote it. CUDA only: ``cpu_ops`` has no twin, the CPU
  runs the torch ops.
- ``norm_rope_write_kv``: Qwen3.5's gated attention, its q and k
  zero-centred norms, the partial rotary and the KV write in one launch
  (``rope_write_kv``'s kernel). CUDA only, as ``gated_rms_norm``.

``rope_write_kv`` and ``silu_mul`` also take a LoRA delta computed beside
the GEMM before them (``LoraLinear.forward_parts``), added as they load and
rounded as ``y.add_(delta)`` would round it; they, ``norm_rope_write_kv``
and ``rms_norm`` (to the residual) take a fused linear's expand still to
do, rounded as ``expand_rows`` rounds it: as its one-row programs sum
(``silu_mul`` from 16 rows: as its tiles of rows' dots).

On by default (``enabled``); ``tools/profile_gpu_step.py --fused-ops both``
times the step with and without them.

The functions mirror ``cpu_ops`` (the C path on CPU): same names, same
arguments, and None / False where the tensors don't fit, so the caller
falls back to torch. Graph-safe: grids come from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch
from mstar_actors.lora.triton_ops import _b_tile, _fold_dot, _next_slot

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_WIDTH = 16384  # a row a program holds whole (hidden sizes up to 16k)
# ``rms_norm`` folds an expand whose B tile (the row's width by the rank, padded
# to powers of two) has at most this many values, 64 a thread of 16 warps:
# hidden 2048 at rank 16. A wider row's expand runs as a launch of its own (``expand_rows``), whose programs
# share B's read: on the H200 at Llama-3.1-8B's hidden 4096, one adapter, 1 / 8 / 64 rows, the GPU step took
# 4.279 / 4.535 / 5.444 ms so, against 4.344 / 4.561 / 5.546 with the 4096 x 16 tile folded whole (16 warps)
# and 4.448 / 4.672 / 5.448 folded in two passes of 2048 columns (``tools/profile_gpu_step.py``, base 4.152).
MAX_FOLD_TILE = 32768
# ``rms_norm``, ``rope_write_kv``, ``norm_rope_write_kv`` and ``silu_mul`` add a fused linear's LoRA expand as
# they load (``cpu_ops``' do not).
takes_expand = True


# Read when a step runs or is captured; ``tools/profile_gpu_step.py
# --fused-ops`` times both, the GPU tests run both.
enabled = True


def takes(x: torch.Tensor) -> bool:
    """Whether ``x`` may take these kernels: CUDA activations of a served
    dtype without autograd. (Tests call the functions directly on CPU,
    under Triton's interpreter.)"""
    return enabled and x.is_cuda and x.dtype in _DTYPES and not torch.is_grad_enabled()


@triton.jit
def _inv_rms(x, n, eps, AXIS: tl.constexpr):
    """``rsqrt(mean(x * x) + eps)`` of float32 ``x`` along ``AXIS`` over ``n``
    values, the sum of squares in float64 (each product exact): Triton lays a
    row out by its alignment, so a float32 sum's order, and its last bit,
    would depend on the row stride, and one token's norm would differ between
    a step whose rows are views of a wider GEMM output and one whose are not."""
    x64 = x.to(tl.float64)
    return tl.math.rsqrt((tl.sum(x64 * x64, axis=AXIS) / n).to(tl.float32) + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x0, stride_x1, res_ptr, stride_res, w_ptr, out_ptr, n, eps,
                     t_ptr, stride_t, b_ptr, stride_bs, stride_bn, sc_ptr, stride_ss, stride_sl, lslot_ptr,
                     num_shards, R,
                     HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, FOLD: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK: tl.constexpr, GDC: tl.constexpr):
    i0 = tl.program_id(0).to(tl.int64)
    i1 = tl.program_id(1).to(tl.int64)
    row = i0 * tl.num_programs(1) + i1
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait (``triton_launch``)
    if FOLD:
        # The expand of a fused o or down (``rms_norm``'s ``expand``), B's
        # whole row for the row's slot: before the wait, as the others'.
        lslot, live, offs_r, mask_r = _row_slot(lslot_ptr, row, R, BLOCK_R)
        scale = tl.load(sc_ptr + lslot * stride_sl)
        b = _b_tile(b_ptr, stride_bs, stride_bn, lslot, 0, cols, mask, offs_r, mask_r)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RES:
        y = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        if FOLD:
            y = _plus_expand(y, b, _shrunk(t_ptr, row, stride_t, 0, num_shards, lslot, R, offs_r, mask_r, scale), live)
        # ``x + residual`` rounded to the dtype, stored back as the new residual.
        x = (x.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = _inv_rms(x32, n, eps, 0)
    if ZERO_CENTERED:  # Qwen3.5's: scaled by 1 + weight in float32, one cast at the end
        out = (x32 * inv) * (1.0 + w)
    else:  # cast, then scaled
        out = w * (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = False, expand=None) -> torch.Tensor | None:
    """``RMSNorm(x (+ residual))`` over the last dimension in one launch, or
    None where the tensors don't fit. ``x`` is ``[M, N]`` or ``[M, H, N]``
    with unit stride in ``N`` (per-head q/k norms take the projection's
    views as they are); the result is contiguous. With ``residual``
    (``[M, N]``, unit stride in ``N``), ``residual += x`` first, in place,
    rounded to the dtype: the sum is what is normalised. ``zero_centered``:
    scaled by ``1 + weight`` in float32 before the one cast (Qwen3.5's).
    ``expand`` (``lora_layers.PendingExpand``, with ``residual``): a fused
    o's or down's LoRA expand, added to ``residual`` first as
    ``expand_rows`` would add it; None where it doesn't fit (a tensor delta,
    or B's row too wide for a program's registers)."""
    n = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or n > MAX_WIDTH or weight.dtype != x.dtype or not weight.is_contiguous():
        return None
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        return None
    block = triton.next_power_of_2(n)
    if expand is not None and (residual is None or isinstance(expand, torch.Tensor)
                               or block * fold_block_r(expand) > MAX_FOLD_TILE):
        return None
    fold = fold_args(expand, x, [n])
    if fold is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n0, n1 = x.shape[0], x.shape[1] if x.dim() == 3 else 1
    if out.numel():
        # A folded expand holds B's [N, rank] tile in one program: warps to spread it (at most 64 values a thread).
        warps = _warps(n) if expand is None else min(16, max(_warps(n), block * fold_block_r(expand) // 2048))
        _rms_norm_kernel[(n0, n1)](x, x.stride(0), x.stride(1) if x.dim() == 3 else 0,
                                   x if residual is None else residual, 0 if residual is None else residual.stride(0),
                                   weight, out, n, eps, *fold[:-2], HAS_RES=residual is not None,
                                   ZERO_CENTERED=zero_centered, FOLD=expand is not None, BLOCK_R=fold_block_r(expand),
                                   BLOCK=block, num_warps=warps, **triton_launch.options(x))
    return out


@triton.jit
def _row_slot(lslot_ptr, row, R, BLOCK_R: tl.constexpr):
    """A row's LoRA slot for a folded expand: (slot, whether it is an adapter's,
    the rank's offsets, their mask: none for a base row, which loads nothing)."""
    lslot = tl.load(lslot_ptr + row).to(tl.int64)
    live = lslot != 0
    offs_r = tl.arange(0, BLOCK_R)
    return lslot, live, offs_r, offs_r < tl.where(live, R, 0)


@triton.jit
def _shrunk(t_ptr, row, stride_t, shard, num_shards, slot, R, offs_r, mask, scale):
    """A row's shrink for one shard from the fused GEMM's A columns, scaled (``lora.triton_ops.expand_rows``'s)."""
    at = t_ptr + row * stride_t + (slot * num_shards + shard) * R + offs_r
    return tl.load(at, mask=mask, other=0.0).to(tl.float32) * scale


@triton.jit
def _plus_expand(x, w, t, live):
    """``x`` plus the expand of its columns, rounded as ``expand_rows`` rounds
    ``y += t @ B.T``; a base row (not ``live``) as it was."""
    return tl.where(live, (x.to(tl.float32) + tl.sum(w.to(tl.float32) * t[None, :], axis=1)).to(x.dtype), x)


@triton.jit
def _rope_write_kv_kernel(q_ptr, stride_qt, stride_qh, k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh,
                          cos_ptr, sin_ptr, stride_ct, cache_ptr, stride_cs, stride_ch, cache_half, slot_ptr,
                          num_heads, dq_ptr, dk_ptr, dv_ptr, qo_ptr, stride_qot, stride_qoh, qw_ptr, kw_ptr, eps,
                          t_ptr, stride_t, b_ptr, stride_bs, stride_bn, sc_ptr, stride_ss, stride_sl, lslot_ptr,
                          num_shards, R, k_col, v_col, g_ptr, stride_gt, stride_gh,
                          HAS_DELTA: tl.constexpr, FOLD: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr,
                          BLOCK_R: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                          GDC: tl.constexpr):
    """Program ``(token, head)``: a q head (rotated into ``qo``) or a k head
    (rotated into the cache, its v beside it). Heads of ``DIM``, the first
    ``2 HALF`` rotated; ``NORM``: each q and k head first normalised and
    scaled by ``1 + weight`` (``rms_norm``'s zero-centred arithmetic).
    ``GATE`` (with ``FOLD``): q's shard is each head's q then its gate
    (Qwen3.5's), the gate's expand added in place at ``g_ptr``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    # The rotated half's partner (itself past the rotary dims).
    other = tl.where(cols < HALF, cols + HALF, tl.where(cols < 2 * HALF, cols - HALF, cols))
    is_rotated = cols < 2 * HALF
    is_k = h >= num_heads
    kh = tl.maximum(h - num_heads, 0)
    v_mask = cols < tl.where(is_k, DIM, 0)
    if NORM:  # the head's norm weight, at each column and its partner: before the wait (weights)
        w = tl.where(is_k, tl.load(kw_ptr + cols, mask=mask, other=0.0), tl.load(qw_ptr + cols, mask=mask, other=0.0))
        wo = tl.where(is_k, tl.load(kw_ptr + other, mask=mask, other=0.0),
                      tl.load(qw_ptr + other, mask=mask, other=0.0))
    if FOLD:
        # The expand of a fused q|k|v (``expand``): the row's LoRA slot, its
        # scales and B's columns for this head (and v's), before the wait:
        # none is a step's write (``triton_launch``).
        lslot, live, offs_r, mask_r = _row_slot(lslot_ptr, t, R, BLOCK_R)
        shard = tl.where(is_k, 1, 0)
        first = tl.where(is_k, k_col + kh * DIM, h * (2 * DIM if GATE else DIM))
        scale = tl.load(sc_ptr + shard * stride_ss + lslot * stride_sl)
        v_scale = tl.load(sc_ptr + 2 * stride_ss + lslot * stride_sl)
        bx = _b_tile(b_ptr, stride_bs, stride_bn, lslot, first, cols, mask, offs_r, mask_r)
        bo = _b_tile(b_ptr, stride_bs, stride_bn, lslot, first, other, mask, offs_r, mask_r)
        bv = _b_tile(b_ptr, stride_bs, stride_bn, lslot, v_col + kh * DIM, cols, v_mask, offs_r, mask_r)
        if GATE:  # a q head's gate, the DIM columns after its q: written back only where the row has an adapter
            g_mask = cols < tl.where(live & ~is_k, DIM, 0)
            bg = _b_tile(b_ptr, stride_bs, stride_bn, lslot, first + DIM, cols, g_mask, offs_r, mask_r)
    if GDC:  # everything below reads the step's own writes (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.load(cos_ptr + t * stride_ct + cols, mask=is_rotated, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + cols, mask=is_rotated, other=0.0).to(tl.float32)
    # The delta (``rope_write_kv``'s) has q's, k's and v's strides.
    if is_k:
        at = t * stride_kt + kh * stride_kh
        base, dbase = k_ptr + at, dk_ptr + at
    else:
        at = t * stride_qt + h * stride_qh
        base, dbase = q_ptr + at, dq_ptr + at
    # Every load before any branch on a loaded value (a k head's slot and v
    # too): at decode sizes the kernel's time is its chain of dependent loads.
    slot = tl.load(slot_ptr + t)
    v_at = t * stride_vt + kh * stride_vh + cols
    v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0)
    x = tl.load(base + cols, mask=mask, other=0.0)
    xo = tl.load(base + other, mask=mask, other=0.0)
    if HAS_DELTA:
        v = (v.to(tl.float32) + tl.load(dv_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)).to(v.dtype)
        x = (x.to(tl.float32) + tl.load(dbase + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        xo = (xo.to(tl.float32) + tl.load(dbase + other, mask=mask, other=0.0).to(tl.float32)).to(xo.dtype)
    if FOLD:
        tx = _shrunk(t_ptr, t, stride_t, shard, num_shards, lslot, R, offs_r, mask_r, scale)
        tv = _shrunk(t_ptr, t, stride_t, 2, num_shards, lslot, R, offs_r, offs_r < tl.where(live & is_k, R, 0), v_scale)
        x = _plus_expand(x, bx, tx, live)
        xo = _plus_expand(xo, bo, tx, live)
        v = _plus_expand(v, bv, tv, live)
        if GATE:
            g_at = g_ptr + t * stride_gt + h * stride_gh + cols
            tl.store(g_at, _plus_expand(tl.load(g_at, mask=g_mask, other=0.0), bg, tx, live), mask=g_mask)
    dtype = q_ptr.dtype.element_ty
    x = x.to(tl.float32)
    xo = xo.to(tl.float32)
    if NORM:  # as ``rms_norm`` (zero-centred): the sum of squares in float64, one cast after the scale
        inv = _inv_rms(x, DIM, eps, 0)
        x = ((x * inv) * (1.0 + w.to(tl.float32))).to(dtype).to(tl.float32)
        xo = ((xo * inv) * (1.0 + wo.to(tl.float32))).to(dtype).to(tl.float32)
    # torch's rounding: x * cos, swapped * signed_sin, then their sum, each to the dtype.
    rotated = ((x * c).to(dtype).to(tl.float32) + (xo * s).to(dtype).to(tl.float32)).to(dtype)
    rotated = tl.where(is_rotated, rotated, x.to(dtype))
    if is_k:
        if slot >= 0:  # a negative slot is a padding row: not written
            dst = cache_ptr + slot * stride_cs + kh * stride_ch + cols
            tl.store(dst, rotated, mask=mask)
            tl.store(dst + cache_half, v, mask=mask)
    else:
        # Every lane read its partner above, before any lane writes (q may be rotated in place).
        tl.debug_barrier()
        tl.store(qo_ptr + t * stride_qot + h * stride_qoh + cols, rotated, mask=mask)


def _paged_layout_fits(q, k, v, cos, signed_sin, kv_cache, slot_mapping) -> bool:
    """Whether q, k, v, the rotary tables and the cache take ``_rope_write_kv_kernel``."""
    num_tokens, _, head_dim = q.shape
    if (k.dim() != 3 or v.shape != k.shape or k.shape[0] < num_tokens or k.shape[2] != head_dim
            or slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens):  # a program a token of q
        return False
    return not (head_dim % 2 or head_dim > 1024 or not kv_cache.is_contiguous() or kv_cache.dtype != q.dtype
                or k.dtype != q.dtype or v.dtype != q.dtype or cos.dtype != q.dtype or signed_sin.dtype != q.dtype
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
                or cos.shape[0] != num_tokens or cos.stride() != signed_sin.stride() or cos.stride(-1) != 1
                or cos.shape[-1] % 2 or cos.shape[-1] > head_dim
                or any(t.stride(-1) != 1 for t in (q, k, v)) or kv_cache.shape[-1] != head_dim
                or kv_cache.shape[-2] != k.shape[1])


def _launch_rope_write_kv(q, k, v, cos, signed_sin, kv_cache, slot_mapping, parts, fold, q_out, norms, *,
                          has_delta: bool, expand, gate=None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if not num_tokens:
        return
    q_weight, k_weight, eps = norms if norms is not None else (q, q, 0.0)
    slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
    _rope_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        cos, signed_sin, cos.stride(0), kv_cache, slots.stride(0), slots.stride(1), kv_cache[0].numel(),
        slot_mapping, num_heads, *parts, q_out, q_out.stride(0), q_out.stride(1), q_weight, k_weight, eps, *fold,
        q if gate is None else gate, 0 if gate is None else gate.stride(0), 0 if gate is None else gate.stride(1),
        HAS_DELTA=has_delta, FOLD=expand is not None, NORM=norms is not None, GATE=gate is not None,
        BLOCK_R=fold_block_r(expand), DIM=head_dim, HALF=cos.shape[-1] // 2, BLOCK=triton.next_power_of_2(head_dim),
        # A folded expand holds three [head_dim, rank] tiles of B a program: more warps past rank 16; with
        # a gate four, at most 64 values a thread (MAX_FOLD_TILE: rms_norm's fold's budget).
        num_warps=(1 if head_dim <= 128 else 2) * (fold_block_r(expand) // 16) if gate is None else min(16, max(
            1, triton.next_power_of_2(4 * triton.next_power_of_2(head_dim) * fold_block_r(expand) // 2048))),
        enable_fp_fusion=False, **triton_launch.options(q))  # float32: no FMA, torch's two roundings


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, delta: torch.Tensor | None = None,
                  expand=None) -> bool:
    """Rotate ``q [T, H, D]`` in place and ``k [T, KH, D]`` by ``cos`` and
    ``signed_sin`` (``[T, 1, D]``, ``RotaryEmbedding.tables``), writing the
    rotated k and v at ``slot_mapping`` into ``kv_cache [2, blocks,
    block_size, KH, D]`` (a negative slot: not written), in one launch
    (``cpu_ops.rope_write_kv`` on CPU; ``k`` itself is left as it was).
    ``delta``: ``[T, (H + 2 KH) D]`` added to q, k and v first (rounded as
    ``add_``), where q, k and v are the heads of one contiguous ``[T, (H +
    2 KH) D]`` output, in that order. ``expand`` (or ``delta`` given one) (``lora_layers.PendingExpand``,
    not with ``delta``): a fused q|k|v's LoRA expand, added to q, k and v
    first as ``expand_rows`` would add it. False, having done nothing, where
    the layouts don't fit."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    delta, expand = _delta_or_expand(delta, expand)
    fold = fold_args(expand, q, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    if fold is None or (delta is not None and expand is not None):
        return False
    if delta is not None:
        parts = _delta_heads(delta, q, k, v)
        if parts is None:
            return False
    else:
        parts = (q, k, v)
    if not _paged_layout_fits(q, k, v, cos, signed_sin, kv_cache, slot_mapping) or cos.shape[-1] != head_dim:
        return False
    _launch_rope_write_kv(q, k, v, cos, signed_sin, kv_cache, slot_mapping, parts, fold, q, None,
                          has_delta=delta is not None, expand=expand)
    return True


def norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor, gate: torch.Tensor | None = None,
                       expand=None) -> torch.Tensor | None:
    """Qwen3.5's gated attention before ``attend``, in one launch: each q and k
    head normalised (``ZeroCenteredRMSNorm``: weights ``q_weight``,
    ``k_weight [D]``), its first ``R`` dims rotated by ``cos`` and
    ``signed_sin`` (``[T, 1, R]``), k and v written at ``slot_mapping`` into
    ``kv_cache`` as ``rope_write_kv`` writes them; returns q's result,
    ``[T, H, D]`` contiguous (``q``, ``k`` and ``v`` may be strided views:
    none is written). ``expand`` (``lora_layers.PendingExpand`` of the fused
    q|gate, k, v projection, with ``gate [T, H, D]``, the gates beside q):
    its LoRA expand added first, as ``expand_rows`` would add it, to q, k
    and v as they load and to ``gate`` in place. None (nothing done) where
    the tensors don't fit."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (not _paged_layout_fits(q, k, v, cos, signed_sin, kv_cache, slot_mapping)
            or any(w.shape != (head_dim,) or w.dtype != q.dtype or not w.is_contiguous() for w in (q_weight, k_weight))):
        return None
    if expand is not None and (isinstance(expand, torch.Tensor) or gate is None or gate.shape != q.shape
                               or gate.dtype != q.dtype or gate.stride(-1) != 1
                               or 4 * triton.next_power_of_2(head_dim) * fold_block_r(expand) > MAX_FOLD_TILE):
        return None  # (four [head_dim, rank] tiles of B past MAX_FOLD_TILE: the expand's own launch does it)
    fold = fold_args(expand, q, [2 * num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    if fold is None:
        return None
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _launch_rope_write_kv(q, k, v, cos, signed_sin, kv_cache, slot_mapping, (q, k, v), fold, q_out,
                          (q_weight, k_weight, eps), has_delta=False, expand=expand,
                          gate=gate if expand is not None else None)
    return q_out


def _delta_heads(delta: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple | None:
    """``delta``'s q, k and v heads with q's, k's and v's strides, or None
    where q, k and v are not the heads of one contiguous output like it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if (delta.shape != (num_tokens, width) or not delta.is_contiguous() or delta.dtype != q.dtype
            or k.data_ptr() != q.data_ptr() + num_heads * head_dim * q.element_size()
            or v.data_ptr() != k.data_ptr() + num_kv_heads * head_dim * k.element_size()
            or any(t.stride() != (width, head_dim, 1) for t in (q, k, v))):
        return None
    return tuple(delta.view(num_tokens, -1, head_dim).split_with_sizes([num_heads, num_kv_heads, num_kv_heads], dim=1))


@triton.jit
def _silu_mul_kernel(x_ptr, stride_x, d_ptr, out_ptr, stride_out, M, n,
                     t_ptr, stride_t, b_ptr, stride_bs, stride_bn, sc_ptr, stride_ss, stride_sl, lslot_ptr,
                     num_shards, R, up_col,
                     HAS_DELTA: tl.constexpr, FOLD: tl.constexpr, F32: tl.constexpr, BLOCK_R: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """A tile of ``ROWS`` rows by ``BLOCK`` columns a program."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = rows < M
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    tile = ok[:, None] & mask[None, :]
    if FOLD:
        # The expand of a fused gate|up (``silu_mul``'s ``expand``): the rows'
        # LoRA slots and B's columns of the largest, before the wait.
        lslot = tl.load(lslot_ptr + rows, mask=ok, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        slot, done = _next_slot(lslot, lslot == 0)
        mask_r = offs_r < tl.where(slot != 0, R, 0)  # a tile of base rows reads no B
        b_gate = _b_tile(b_ptr, stride_bs, stride_bn, slot, 0, cols, mask, offs_r, mask_r)
        b_up = _b_tile(b_ptr, stride_bs, stride_bn, slot, up_col, cols, mask, offs_r, mask_r)
    if GDC:  # everything below reads the step's own writes (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    at = rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(x_ptr + at, mask=tile, other=0.0)
    up = tl.load(x_ptr + at + n, mask=tile, other=0.0)
    if HAS_DELTA:  # the delta's rows are contiguous [T, 2I]; y.add_(delta)'s rounding
        d_at = rows[:, None] * 2 * n + cols[None, :]
        gate = (gate.to(tl.float32) + tl.load(d_ptr + d_at, mask=tile, other=0.0).to(tl.float32)).to(dtype)
        up = (up.to(tl.float32) + tl.load(d_ptr + d_at + n, mask=tile, other=0.0).to(tl.float32)).to(dtype)
    if FOLD:  # one dot a slot of the tile's rows, each row's from its own slot only
        gate_d = _fold_dot(t_ptr, stride_t, rows, lslot, slot, 0, num_shards, offs_r, R, b_gate,
                           tl.load(sc_ptr + slot * stride_sl), F32, ROWS > 1)
        up_d = _fold_dot(t_ptr, stride_t, rows, lslot, slot, 1, num_shards, offs_r, R, b_up,
                         tl.load(sc_ptr + stride_ss + slot * stride_sl), F32, ROWS > 1)
        slot, done = _next_slot(lslot, done)
        while slot != 0:
            b = _b_tile(b_ptr, stride_bs, stride_bn, slot, 0, cols, mask, offs_r, offs_r < R)
            gate_d += _fold_dot(t_ptr, stride_t, rows, lslot, slot, 0, num_shards, offs_r, R, b,
                                tl.load(sc_ptr + slot * stride_sl), F32, ROWS > 1)
            b = _b_tile(b_ptr, stride_bs, stride_bn, slot, up_col, cols, mask, offs_r, offs_r < R)
            up_d += _fold_dot(t_ptr, stride_t, rows, lslot, slot, 1, num_shards, offs_r, R, b,
                              tl.load(sc_ptr + stride_ss + slot * stride_sl), F32, ROWS > 1)
            slot, done = _next_slot(lslot, done)
        live = (lslot != 0)[:, None]
        gate = tl.where(live, (gate.to(tl.float32) + gate_d).to(dtype), gate)
        up = tl.where(live, (up.to(tl.float32) + up_d).to(dtype), up)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    # torch's rounding: silu in float32, cast, then the product in float32, cast.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (act * up).to(dtype), mask=tile)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None, expand=None) -> torch.Tensor | None:
    """``F.silu(gate) * up`` of ``gate_up [T, 2I]`` (its two halves) in one
    launch, ``[T, I]``, with ``delta`` (contiguous, ``gate_up``'s shape: the
    LoRA delta) or ``expand`` (``lora_layers.PendingExpand``: a fused
    gate|up's, as ``rope_write_kv`` takes it) added first where given; None
    where the rows don't fit."""
    delta, expand = _delta_or_expand(delta, expand)
    rows = _rows(gate_up)
    if rows is None or rows.shape[-1] % 2 or (delta is not None and expand is not None):
        return None
    if delta is not None and (delta.shape != rows.shape or not delta.is_contiguous() or delta.dtype != rows.dtype):
        return None
    n = rows.shape[-1] // 2
    fold = fold_args(expand, rows, [n, n])
    if fold is None:
        return None
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        # A folded expand (``fold_rows``): two [BLOCK, rank] tiles of B a program.
        per = fold_rows(rows.shape[0], expand)
        block = (min(1024, triton.next_power_of_2(n)) if expand is None
                 else min(4096 // fold_block_r(expand), triton.next_power_of_2(n)) if per == 1
                 else max(16, min(FOLD_COLS, triton.next_power_of_2(n))))
        _silu_mul_kernel[(triton.cdiv(rows.shape[0], per), triton.cdiv(n, block))](
            rows, rows.stride(0), rows if delta is None else delta, out, out.stride(0), rows.shape[0], n, *fold[:-1],
            HAS_DELTA=delta is not None, FOLD=expand is not None, F32=rows.dtype == torch.float32,
            BLOCK_R=fold_block_r(expand), ROWS=per, BLOCK=block, num_warps=4, **triton_launch.options(rows))
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, stride_x, g_ptr, stride_g, w_ptr, out_ptr, H, D, eps,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
    """Row ``pid``'s ``H`` heads of ``D``: each normalised in float32, cast,
    scaled by the weight (cast), times ``silu(gate)`` in float32, cast: the
    reference's roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (tl.arange(0, BLOCK_H) < H)[:, None] & (cols < D)[None, :]
    at = tl.arange(0, BLOCK_H)[:, None] * D + cols[None, :]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # a weight: before the wait
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + at, mask=mask, other=0.0).to(tl.float32)
    inv = _inv_rms(x, D, eps, 1)
    scaled = (w[None, :] * (x * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.load(g_ptr + row * stride_g + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H * D + at, (scaled * (gate / (1.0 + tl.exp(-gate)))).to(dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``qwen3_5.GatedRMSNorm`` in one launch: ``x [T, H, D]`` (contiguous
    heads), ``gate [T, H * D]`` (unit column stride, any row stride: a view
    of in_proj's output), ``weight [D]`` -> ``[T, H * D]``; None where the
    tensors don't fit."""
    if x.dim() != 3 or gate.dim() != 2:
        return None
    rows, heads, size = x.shape
    if (gate.shape != (rows, heads * size) or gate.stride(1) != 1 or gate.dtype != x.dtype or weight.shape != (size,)
            or weight.dtype != x.dtype or x.stride(2) != 1 or x.stride(1) != size or heads * size > MAX_WIDTH):
        return None
    out = torch.empty((rows, heads * size), dtype=x.dtype, device=x.device)
    if rows:
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(size)
        _gated_rms_norm_kernel[(rows,)](x, x.stride(0), gate, gate.stride(0), weight, out, heads, size, eps,
                                        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_warps(block_h * block_d),
                                        **triton_launch.options(x))
    return out


def _delta_or_expand(delta, expand) -> tuple:
    """``(delta, expand)`` with a ``PendingExpand`` passed as ``delta`` (what
    ``LoraLinear.forward_parts`` returns) moved to ``expand``."""
    if delta is not None and not isinstance(delta, torch.Tensor) and expand is None:
        return None, delta
    return delta, expand


def fold_args(expand, y: torch.Tensor, sizes: list[int]) -> tuple | None:
    """``expand``'s kernel arguments (t, its row stride, B and its slot and
    column strides, the scales and theirs, the row slots, the shards, the
    rank, then the B columns where the second and third shards start), zeros
    without one; None where it does not fit ``y``'s dtype or its shards are
    not ``sizes``."""
    if expand is None:
        return (y, 0, y, 0, 0, y, 0, 0, y, 0, 0, 0, 0)
    stack, t, row_slots = expand.stack, expand.t, expand.row_slots
    b, scales = stack.b, stack.scales
    num_shards, _, max_rank, _ = stack.a.shape
    if (list(stack.output_sizes) != sizes or b.dtype != y.dtype or t.dtype != y.dtype or b.stride(2) != 1
            or t.stride(1) != 1 or not stack.shrink_fits(t, y.shape[0])
            or row_slots.shape != (y.shape[0],) or row_slots.stride(0) != 1 or scales.dtype != torch.float32):
        return None
    offsets = stack.offsets
    return (t, t.stride(0), b, b.stride(0), b.stride(1), scales, scales.stride(0), scales.stride(1), row_slots,
            num_shards, max_rank, offsets[1], offsets[2] if len(offsets) > 3 else 0)


def fold_block_r(expand) -> int:
    return 16 if expand is None else max(16, triton.next_power_of_2(expand.stack.max_rank))


# Rows a program of ``silu_mul``'s folded expand from as many rows in a step: tl.dot's least, whose
# products of the rank run on the tensor cores (``_fold_dot``).
FOLD_ROWS = 16
# Columns a program of ``silu_mul``'s folded expand takes by tiles of ``FOLD_ROWS`` rows (read as graphs are captured)
FOLD_COLS = 64


def fold_rows(num_rows: int, expand) -> int:
    """Rows a program of a folded expand takes: ``FOLD_ROWS`` from that many rows, else one."""
    return FOLD_ROWS if expand is not None and num_rows >= FOLD_ROWS else 1


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[M, N]`` rows of unit stride without a copy, else None."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None
    if rows is None or rows.stride(-1) != 1:
        return None
    return rows


def _warps(n: int) -> int:
    return 1 if n <= 512 else 4 if n <= 4096 else 8
