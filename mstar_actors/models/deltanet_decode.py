"""One decode token of the gated delta rule on Triton, in place on the state pool.

``decode_step`` runs a step's single-token rows (row ``i`` a sequence on
state slot ``slots[i]``) in one launch: each program loads its part of the
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
state (fla's split: ``BLOCK_V`` 8 and one warp, enough programs to fill the
device at one row; a launch takes at most 65,535 rows x value heads, the
grid's second axis). Graph safe: the slots and the flags or context
lengths are device tensors, the grid follows the shapes. A padded row of a graphed step names
the scratch slot and starts afresh, so it reads no sequence's state and
writes only the scratch slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .deltanet_ops import Gates

BLOCK_V = 8


@triton.jit
def _delta_decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, ssm_ptr, o_ptr, slots_ptr, continues_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, FRESH_AT: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    pid = tl.program_id(1)
    row, hv = pid // HV, pid % HV
    head = hv // GROUP  # value heads share key heads (GVA)
    row64 = row.to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    continues = tl.load(continues_ptr + row) > FRESH_AT
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_h = mask_k[:, None] & mask_v[None, :]
    h_ptrs = ssm_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    # A fresh row reads nothing (zeros): its k range is empty.
    h = tl.load(h_ptrs, mask=(offs_k < tl.where(continues, DK, 0))[:, None] & mask_v[None, :], other=0.0)
    q = tl.load(q_ptr + row64 * stride_qt + head * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row64 * stride_kt + head * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row64 * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale  # deltanet_ops.l2norm's eps
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    # Gates.decay: -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear past 20).
    x = tl.load(a_ptr + row64 * stride_at + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
    # Gates.beta: sigmoid in float32, rounded to b's dtype as torch's op leaves it.
    b_raw = tl.load(b_ptr + row64 * stride_bt + hv)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    h = h * tl.exp(g)
    delta = (v - tl.sum(h * k[:, None], axis=0)) * beta
    h = h + k[:, None] * delta[None, :]
    o = tl.sum(h * q[:, None], axis=0)
    tl.store(o_ptr + row64 * stride_ot + hv * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
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
    if rows * num_v > 65535:
        raise ValueError(f"deltanet decode: {rows} rows x {num_v} value heads is past a launch's 65,535 "
                         "programs a column; accepted: fewer rows a step")
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
                slots: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
    """``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``gates`` of those rows, the
    pool's ``ssm [P + 1, Hv, Dk, Dv]``, each row's ``slots [B]`` and whether
    it continues its slot's state, else starts from zeros: ``continues [B]``
    bool, or the rows' context lengths (int32: a row continues unless its
    context is its one token, read in the kernel, so a captured step derives
    nothing from them that a replay would not redo) -> ``o [B, Hv, Dv]`` in
    ``v``'s dtype; each row's slot of ``ssm`` is updated in place."""
    _check(q, k, v, gates, ssm, continues)
    rows, num_k, dk = q.shape
    num_v, dv = v.shape[1], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if rows == 0:
        return out
    _delta_decode_kernel[(triton.cdiv(dv, BLOCK_V), rows * num_v)](
        q, k, v, gates.a, gates.b, gates.A_log, gates.dt_bias, ssm, out, slots, continues,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        gates.a.stride(0), gates.b.stride(0),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), out.stride(0), out.stride(1), dk**-0.5,
        HV=num_v, GROUP=num_v // num_k, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V,
        FRESH_AT=0 if continues.dtype == torch.bool else 1, num_warps=1,
    )  # fmt: skip
    return out
