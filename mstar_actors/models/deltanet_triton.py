"""Gated DeltaNet's two ops on Triton (CUDA): ``TritonDeltaNetOps``.

The prefill chunks of a step longer than ``deltanet_ops.RECURRENT_MAX``
tokens run on flash-linear-attention's chunked kernels (the ``fla-core``
package): all of them in one varlen call of
``chunk_gated_delta_rule`` (``[1, T, H, D]``, ``cu_seqlens`` over the
chunks), q and k as they come (L2-normalised in the kernel, ``Dk ** -0.5``
scale), natural-log decay ``g`` in float32 and ``beta`` after its sigmoid,
key heads shared across value heads by the kernel (GVA: ``Hv % Hk == 0``).
Their initial states are gathered from the pool by slot (zeroed for a
sequence whose chunk starts at token 0) and the float32 final states
scattered back. The decode rows and the shorter chunks take our recurrent
kernel (``deltanet_decode.decode_step``, one entry a sequence, a chunk's
tokens in order), which updates each sequence's slot of the pool in place
and computes the gates itself: a short chunk costs no launch, gather or
scatter of its own, where the chunked call costs a dozen launches a layer
and its states' traffic.

How the chunked kernel must be called (this broke an earlier use):

- The varlen path caches its chunk index tensors (``chunk_indices``,
  ``chunk_offsets``) by the identity of the ``cu_seqlens`` tensor object,
  not its contents. A ``cu_seqlens`` buffer refilled in place between calls
  gets the previous call's chunk count: the per-chunk buffers are sized by
  it while the kernels walk the new lengths, and write past their end (an
  illegal memory access on the second call). Each step builds its own
  ``cu_seqlens`` and passes ``chunk_indices`` computed from the host lists
  (no device sync), and nothing mutates either afterwards.

The causal depthwise convolution is our own kernel (fla-core's takes its
initial states as one tensor per sequence, not from a pool of slots):
``_conv_kernel`` computes ``silu(conv)`` for tiles of ``BLOCK_T`` rows of
one sequence (a ``plan_varlen_work`` item) times ``BLOCK_C`` channels, the
window's first ``K - 1`` inputs before the chunk read from the sequence's
``pool.conv`` slot (zeros for a fresh sequence); ``_conv_state_kernel``
then writes each sequence's last ``K - 1`` inputs back to its slot (a
second launch: the tiles that read a slot and the one that ends the
sequence are different programs). A pure decode step takes
``deltanet_decode.conv_step`` instead: one launch, one row a program,
which also adds a fused in_proj's LoRA expand (``PendingExpand``) as the
row loads, to every column of in_proj's output (no launch of its own).

Graph safety: a pure decode step (``meta.graph_decode``, or every sequence
one token) reads only ``state_slots`` and ``context_lens`` on the device
(row ``i`` is sequence ``i``; continues iff ``context_lens > 1``); shapes
follow the row count; no host synchronisation. A step in static form
(``meta.deltanet_static``: a graphed mixed step) reads only tensors too:
the convolution takes attention's ``varlen_work`` tiles (the same 16 rows);
the delta rule splits the sequences as an eager step does, those of at
most ``RECURRENT_MAX`` tokens through our recurrent kernel by a row map,
in place, the longer ones gathered into one varlen call of the chunked
kernel (none in a bucket without them), padded with
empty sequences on the scratch slot (the kernels skip an empty sequence's
chunks, but each still costs its state: a gather, the kernel's read and
write of it, a scatter; 1 MB a layer at Qwen3.5-0.8B's heads). Padding
every sequence of the graph (256) into that call made a graphed mixed step
of 38 rows 19.8 ms on the H200 against a 64-row decode step's 2.9: the
graphs are bucketed by the longer sequences too
(``step_graphs.chunk_seq_buckets``). Other steps with prefill chunks read
the host lists and run eagerly: each Triton launch costs tens of
microseconds of Python, so an eager step of Qwen3.5-0.8B's 18 DeltaNet
layers took 45-80 ms on the H200 whatever its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

try:
    import triton
    import triton.language as tl
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except Exception as err:  # Triton or fla-core missing or broken: the loader falls back to the reference
    raise ImportError(f"Triton DeltaNet kernels need triton and fla-core: {err}") from err

from .attention import AttentionMetadata, plan_varlen_work
from .decoder import add_delta
from .deltanet_decode import conv_step, decode_step
from .deltanet_ops import CHUNK, Gates, StatePool, takes_recurrent

if TYPE_CHECKING:  # made by ``lora_layers``
    from .lora_layers import PendingExpand

BLOCK_T = 16  # rows of one sequence per convolution program
BLOCK_C = 128  # channels per convolution program


@triton.jit
def _conv_input(x_ptr, prev_ptr, start, idx, slot, cont, chan, valid, stride_x, stride_ps, stride_pc,
                K: tl.constexpr):
    """The convolution's input at chunk position ``idx [R]`` (may be negative:
    then the slot's saved input ``K - 1 + idx``, or 0 for a fresh sequence),
    for rows ``[R]`` of ``start``, ``slot``, ``cont`` and channels ``chan [C]``:
    ``[R, C]`` float32."""
    inside = valid & (idx >= 0)[:, None]
    before = valid & ((idx < 0) & cont)[:, None]
    xv = tl.load(x_ptr + (start + idx).to(tl.int64)[:, None] * stride_x + chan[None, :], mask=inside, other=0.0)
    pv = tl.load(prev_ptr + slot[:, None] * stride_ps + chan[None, :] * stride_pc + (K - 1 + idx)[:, None],
                 mask=before, other=0.0)
    return xv.to(tl.float32) + pv.to(tl.float32)


@triton.jit
def _save_state(x_ptr, prev_ptr, start, n, slot, cont, chan, valid, stride_x, stride_ps, stride_pc,
                K: tl.constexpr):
    """Each row's sequence's last ``K - 1`` inputs into its slot. Entry ``i``
    takes input ``n - (K - 1) + i``: x, or the slot's own entry ``n + i > i``.
    In ascending ``i`` no entry is read after it is overwritten, and the
    barrier before each store keeps every thread's earlier reads (this
    program's window too) ahead of it, whatever thread holds which element."""
    for i in tl.static_range(K - 1):
        value = _conv_input(x_ptr, prev_ptr, start, n - (K - 1) + i, slot, cont, chan, valid, stride_x,
                            stride_ps, stride_pc, K)
        tl.debug_barrier()
        tl.store(prev_ptr + slot[:, None] * stride_ps + chan[None, :] * stride_pc + i,
                 value.to(prev_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, out_ptr, prev_ptr, starts_ptr, ctx_ptr, slots_ptr, items_ptr, C,
                 stride_x, stride_o, stride_wc, stride_wk, stride_ps, stride_pc,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The program's ``(sequence, first row)`` work item from ``items_ptr``
    (-1: padding, does nothing): its rows' outputs; ``_conv_state_kernel``
    saves the slots after."""
    pid = tl.program_id(0)
    chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = chan < C
    rows = tl.arange(0, BLOCK_T)
    item = tl.zeros([BLOCK_T], tl.int32) + tl.load(items_ptr + 2 * pid)
    seq = tl.maximum(item, 0)
    start = tl.load(starts_ptr + seq)
    n = tl.load(starts_ptr + seq + 1) - start
    pos = tl.load(items_ptr + 2 * pid + 1) + rows
    live = (pos < n) & (item >= 0)
    cont = tl.load(ctx_ptr + seq, mask=live, other=0) > n
    slot = tl.load(slots_ptr + seq, mask=live, other=0).to(tl.int64)
    valid = live[:, None] & mask_c[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for w in tl.static_range(K):
        xw = _conv_input(x_ptr, prev_ptr, start, pos - (K - 1) + w, slot, cont, chan, valid, stride_x, stride_ps,
                         stride_pc, K)
        weight = tl.load(w_ptr + chan * stride_wc + w * stride_wk, mask=mask_c, other=0.0).to(tl.float32)
        acc += xw * weight[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (start + pos).to(tl.int64)[:, None] * stride_o + chan[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid)


@triton.jit
def _conv_state_kernel(x_ptr, prev_ptr, starts_ptr, ctx_ptr, slots_ptr, num_seqs, C, stride_x, stride_ps, stride_pc,
                       K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sequences ``pid * BLOCK_T ..``: the last ``K - 1`` inputs into each slot."""
    seq = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = seq < num_seqs
    start = tl.load(starts_ptr + seq, mask=live, other=0)
    n = tl.load(starts_ptr + seq + 1, mask=live, other=1) - start
    cont = tl.load(ctx_ptr + seq, mask=live, other=0) > n
    slot = tl.load(slots_ptr + seq, mask=live, other=0).to(tl.int64)
    valid = live[:, None] & (chan < C)[None, :]
    _save_state(x_ptr, prev_ptr, start, n, slot, cont, chan, valid, stride_x, stride_ps, stride_pc, K)


def _check_conv(x: torch.Tensor, weight: torch.Tensor, pool: StatePool) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"deltanet conv: x must be [T, C] with unit channel stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if weight.shape != (x.shape[1], pool.conv.shape[2] + 1) or pool.conv.shape[1] != x.shape[1]:
        raise ValueError(f"deltanet conv: weight {tuple(weight.shape)} and pool.conv {tuple(pool.conv.shape)} "
                         f"do not fit x [T, {x.shape[1]}] (accepted: weight [C, K], pool.conv [P + 1, C, K - 1])")
    if pool.conv.stride(2) != 1:
        raise ValueError("deltanet conv: pool.conv's last dimension must be contiguous")


def _chunk_plan(meta: AttentionMetadata, chunks: list, device: torch.device):
    """The prefill chunks of a step for the varlen kernel, once per step: their
    rows of the flat batch (a slice when they are contiguous), ``cu_seqlens``
    and ``chunk_indices`` (int64, built here from the host lists, never
    refilled), and their slots and whether each continues a state."""
    if "deltanet_triton" in meta.derived:
        return meta.derived["deltanet_triton"]
    first, end = chunks[0][0], chunks[-1][0] + chunks[-1][1]
    lengths = [n for _, n, _, _ in chunks]
    if sum(lengths) == end - first and all(a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:])):
        rows = slice(first, end)
    else:
        rows = torch.tensor([r for f, n, _, _ in chunks for r in range(f, f + n)], dtype=torch.long, device=device)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    indices = [(i, j) for i, n in enumerate(lengths) for j in range(-(-n // CHUNK))]
    plan = (rows,
            torch.tensor(cu, dtype=torch.long, device=device),
            torch.tensor(indices, dtype=torch.long, device=device),
            torch.tensor([slot for _, _, slot, _ in chunks], dtype=torch.long, device=device),
            torch.tensor([c for _, _, _, c in chunks], dtype=torch.bool, device=device))
    meta.derived["deltanet_triton"] = plan
    return plan


def _recurrent_entries(meta: AttentionMetadata, device: torch.device):
    """An eager step's split, once per step: ``(rows, counts, slots,
    continues)`` of its sequences of at most ``RECURRENT_MAX`` tokens (the
    recurrent kernel's entries; None if none) and ``(first row, length,
    slot, continues)`` of each longer one (the chunked kernel's)."""
    if "deltanet_recurrent" in meta.derived:
        return meta.derived["deltanet_recurrent"]
    entries, chunks = [], []
    for start, n, ctx, slot in zip(meta.query_start_list, meta.query_lens_list, meta.context_lens_list,
                                   meta.state_slots_list):
        if n:
            (entries if takes_recurrent(n) else chunks).append((start, n, slot, ctx > n))
    tensors = None
    if entries:
        rows, counts, slots, continues = zip(*entries)
        tensors = (torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(counts, dtype=torch.int32, device=device),
                   torch.tensor(slots, dtype=torch.long, device=device),
                   torch.tensor(continues, dtype=torch.bool, device=device))
    meta.derived["deltanet_recurrent"] = plan = (tensors, chunks)
    return plan


def _initial_states(pool: StatePool, slots: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
    """``pool.ssm[slots]`` (a copy), zero where a sequence starts afresh."""
    return pool.ssm.index_select(0, slots).masked_fill_(~continues[:, None, None, None], 0.0)


def _is_pure_decode(meta: AttentionMetadata) -> bool:
    return meta.graph_decode or (meta.deltanet_static is None and all(n == 1 for n in meta.query_lens_list))


class TritonDeltaNetOps:
    """``DeltaNetOps`` on the GPU: fla-core's delta-rule kernels and our conv."""

    def conv(self, proj: torch.Tensor, weight: torch.Tensor, pool: StatePool, meta: AttentionMetadata,
             delta: torch.Tensor | PendingExpand | None = None) -> torch.Tensor:
        if _is_pure_decode(meta):  # row i is sequence i; a fused in_proj's expand is added as the rows load
            step = (proj, weight, pool.conv, meta.state_slots, meta.context_lens)
            if delta is not None and (out := conv_step(*step, delta)) is not None:
                return out
            add_delta(proj, delta)
            return conv_step(*step)
        add_delta(proj, delta)
        x = proj[:, :weight.shape[0]]
        _check_conv(x, weight, pool)
        out = torch.empty_like(x)
        channels, kernel = weight.shape
        strides = (x.stride(0), out.stride(0), weight.stride(0), weight.stride(1), pool.conv.stride(0),
                   pool.conv.stride(1))
        if meta.deltanet_static is not None:  # static: attention's tiles, every sequence in the tensors
            out.zero_()  # padding rows, which no tile covers, stay finite
            items, num_seqs = meta.varlen_work, meta.state_slots.shape[0]
            _conv_kernel[(items.shape[0], triton.cdiv(channels, BLOCK_C))](
                x, weight, out, pool.conv, meta.query_start, meta.context_lens, meta.state_slots, items, channels,
                *strides, K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
            _conv_state_kernel[(triton.cdiv(num_seqs, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
                x, pool.conv, meta.query_start, meta.context_lens, meta.state_slots, num_seqs, channels, x.stride(0),
                pool.conv.stride(0), pool.conv.stride(1), K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
            return out
        items = meta.derived.get("deltanet_conv_items")
        if items is None:
            work = plan_varlen_work(meta.query_lens_list, block_m=BLOCK_T)
            items = meta.derived["deltanet_conv_items"] = torch.tensor(work, dtype=torch.int32, device=x.device)
        _conv_kernel[(items.shape[0], triton.cdiv(channels, BLOCK_C))](
            x, weight, out, pool.conv, meta.query_start, meta.context_lens, meta.state_slots, items, channels,
            *strides, K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
        num_seqs = meta.num_seqs
        _conv_state_kernel[(triton.cdiv(num_seqs, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
            x, pool.conv, meta.query_start, meta.context_lens, meta.state_slots, num_seqs, channels, x.stride(0),
            pool.conv.stride(0), pool.conv.stride(1), K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
        return out

    def delta_rule(self, q, k, v, gates: Gates, pool: StatePool, meta: AttentionMetadata) -> torch.Tensor:
        if (static := meta.deltanet_static) is not None:  # tensors only: see the module doc
            num_rows = v.shape[0]
            out = torch.zeros((num_rows + 1, *v.shape[1:]), dtype=v.dtype, device=v.device)  # row T: padding's
            decode_step(q, k, v, gates, pool.ssm, static.decode_slots, static.decode_context, static.decode_rows, out,
                        static.decode_counts)
            if static.chunk_slots.shape[0]:  # a bucket with longer sequences
                rows = static.chunk_rows
                taken = rows.clamp(max=num_rows - 1)  # padding rows gather row T - 1, scatter to row T
                o = self._chunked(q, k, v, gates, pool, taken, static.cu_seqlens, static.chunk_indices,
                                  static.chunk_slots, static.chunk_continues)
                out.index_copy_(0, rows.clamp(max=num_rows), o)
            return out[:num_rows]  # rows of no sequence: zeros
        if _is_pure_decode(meta):  # row i is sequence i: tensors only, graph-safe
            return decode_step(q, k, v, gates, pool.ssm, meta.state_slots, meta.context_lens)
        entries, chunks = _recurrent_entries(meta, q.device)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if entries is not None:  # decode rows and short chunks, in place on their rows of out
            rows, counts, slots, continues = entries
            decode_step(q, k, v, gates, pool.ssm, slots, continues, rows, out, counts)
        if chunks:
            rows, cu_seqlens, chunk_indices, slots, continues = _chunk_plan(meta, chunks, q.device)
            out[rows] = self._chunked(q, k, v, gates, pool, rows, cu_seqlens, chunk_indices, slots, continues)
        return out

    @staticmethod
    def _chunked(q, k, v, gates: Gates, pool: StatePool, rows, cu_seqlens, chunk_indices, slots,
                 continues) -> torch.Tensor:
        """The chunked kernel over ``rows`` of the step (the longer sequences),
        states gathered by slot and scattered back: their output rows."""
        chunk_gates = gates.rows(rows)
        o, final = chunk_gated_delta_rule(
            q[rows][None], k[rows][None], v[rows][None], g=chunk_gates.decay()[None], beta=chunk_gates.beta()[None],
            scale=q.shape[-1] ** -0.5, initial_state=_initial_states(pool, slots, continues), output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        pool.ssm.index_copy_(0, slots, final)
        return o[0].to(v.dtype)
