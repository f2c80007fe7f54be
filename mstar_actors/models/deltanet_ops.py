"""Gated DeltaNet's two sequence ops over a step's flat batch, with per-sequence state.

A Gated DeltaNet layer (Qwen3.5's ``linear_attention``) keeps, per
sequence, a short convolution state (the last ``K - 1`` inputs of its
depthwise causal convolution) and a recurrent state ``S [Hv, Dk, Dv]``. The
ranks hold both in a fixed pool of state slots (``StatePool``), one slot
per running sequence, chosen by the scheduler; a step names each
sequence's slot in ``AttentionMetadata.state_slots``. A sequence whose
chunk starts at token 0 starts from zero state; any later chunk continues
from the state its slot holds (chunked prefill, decode).

``DeltaNetOps`` is the seam to a kernel set, as ``PagedAttention`` is for
attention: ``TorchDeltaNetOps`` here is the reference (the CPU's, and
every other's check); the loader picks one per device.

The arithmetic follows transformers' ``Qwen3_5GatedDeltaNet``: a chunk of
more than one token takes the chunked form of the delta rule (chunks of
64, a triangular solve inside each), a single token the recurrent form,
both in float32 with q and k L2-normalised and q scaled by ``Dk ** -0.5``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata
from .decoder import add_delta

if TYPE_CHECKING:  # made by ``lora_layers``
    from .lora_layers import PendingExpand

CHUNK = 64  # the chunked form's block of tokens (the reference's and the kernels')
# On CUDA a sequence of at most this many tokens in a step takes the recurrent
# kernel, its tokens in order in one program a head, beside the decode rows
# (no launch of its own); a longer one takes the chunked kernels, whose dozen
# launches and gathered states a short chunk would not repay.
RECURRENT_MAX = CHUNK


@dataclass(frozen=True)
class StatePool:
    """One Gated DeltaNet layer's state slots: ``conv [P + 1, C, K - 1]`` in
    the model's dtype and ``ssm [P + 1, Hv, Dk, Dv]`` float32. Slot ``P``
    is scratch (padded rows of a static step write there)."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0] - 1


def allocate_state_pools(num_layers: int, num_slots: int, conv_dim: int, kernel: int, num_v_heads: int,
                         k_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[StatePool]:
    """Zeroed pools of ``num_slots`` slots (plus scratch) for each of ``num_layers`` layers."""
    return [StatePool(torch.zeros(num_slots + 1, conv_dim, kernel - 1, dtype=dtype, device=device),
                      torch.zeros(num_slots + 1, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=device))
            for _ in range(num_layers)]


def state_bytes_per_slot(num_layers: int, conv_dim: int, kernel: int, num_v_heads: int, k_dim: int, v_dim: int,
                         dtype: torch.dtype) -> int:
    conv = conv_dim * (kernel - 1) * torch.empty((), dtype=dtype).element_size()
    return num_layers * (conv + num_v_heads * k_dim * v_dim * 4)


class Gates(NamedTuple):
    """A step's delta-rule gates as the layer has them: ``a, b [T, Hv]``
    (``in_proj``'s last two shards) and the layer's ``A_log, dt_bias [Hv]``.
    The decay and write strength are computed here (``decay``, ``beta``);
    the Triton decode kernel computes the same from these inputs itself."""

    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def decay(self) -> torch.Tensor:
        """Log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` ``[T, Hv]``, float32."""
        return -self.A_log.float().exp() * F.softplus(self.a.float() + self.dt_bias)

    def beta(self) -> torch.Tensor:
        """Write strength ``sigmoid(b)`` ``[T, Hv]`` in ``b``'s dtype."""
        return self.b.sigmoid()

    def rows(self, rows) -> Gates:
        """These gates for ``rows`` of the step (an index tensor or a slice)."""
        return self._replace(a=self.a[rows], b=self.b[rows])


class StaticStep(NamedTuple):
    """A hybrid model's step in static form (a graphed mixed step), as the
    delta rule reads it: device tensors whose shapes follow the graph's
    bucket (``static_sizes``), filled per step from ``static_step_plan``'s
    host lists.

    Sequences of at most ``RECURRENT_MAX`` tokens (decode rows, short
    chunks) take the recurrent form in place on their slots, one entry each
    (``deltanet_decode.decode_step``'s row map): ``decode_rows [D]`` int64
    (the first row; -1: padding, nothing done), ``decode_slots [D]`` int64,
    ``decode_context [D]`` int32 (an entry continues its slot's state unless
    its context is its own tokens) and ``decode_counts [D]`` int32 (its
    tokens; padding: 0). The longer ones go through one varlen call of the
    chunked form over their rows gathered: ``chunk_rows [T]`` int64 (each
    gathered row's row of the step; padding: ``T``, a row past the step's
    that nothing reads), ``cu_seqlens [P + 2]`` int64 (empty sequences past
    the last: padding), ``chunk_slots [P + 1]`` int64 (padding: the scratch
    slot), ``chunk_continues [P + 1]`` bool and ``chunk_indices [NT, 2]``
    int64 ``(sequence, chunk)`` of their 64-token chunks (padding: ``(P,
    0)``, the last, empty, sequence). Padding sequences cost the chunked
    call a state each: ``P`` is bucketed small (``step_graphs.chunk_seq_buckets``);
    a bucket of no longer sequence (``P = 0``) has no chunked call, and its
    chunk fields are empty."""

    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_context: torch.Tensor
    decode_counts: torch.Tensor
    chunk_rows: torch.Tensor
    cu_seqlens: torch.Tensor
    chunk_slots: torch.Tensor
    chunk_continues: torch.Tensor
    chunk_indices: torch.Tensor


class StaticPlan(NamedTuple):
    """``StaticStep``'s fields as host lists (``chunk_indices`` flat: sequence, chunk, ...)."""

    decode_rows: list[int]
    decode_slots: list[int]
    decode_context: list[int]
    decode_counts: list[int]
    chunk_rows: list[int]
    cu_seqlens: list[int]
    chunk_slots: list[int]
    chunk_continues: list[int]
    chunk_indices: list[int]

    def to_step(self, device: torch.device | str) -> StaticStep:
        """The plan as the delta rule reads it (eager: a test's or a
        benchmark's; the graphs cast their staged copy in place instead)."""
        ints = {"decode_context", "decode_counts"}
        fields = {name: torch.tensor(values, dtype=torch.int32 if name in ints else torch.long, device=device)
                  for name, values in self._asdict().items()}
        fields["chunk_continues"] = fields["chunk_continues"].bool()
        fields["chunk_indices"] = fields["chunk_indices"].view(-1, 2)
        return StaticStep(**fields)


def static_sizes(num_tokens: int, num_entries: int, num_chunk_seqs: int) -> dict[str, int]:
    """Each ``StaticStep`` field's length (``chunk_indices``: values, two a
    chunk) in a bucket of ``num_tokens`` rows, ``num_entries`` recurrent
    entries and ``num_chunk_seqs`` longer sequences (0: no chunked call)."""
    chunked = num_chunk_seqs > 0
    seqs = num_chunk_seqs + 1 if chunked else 0  # and one empty sequence, which padding chunks name
    # A sequence of n tokens has at most n // CHUNK + 1 chunks: these, at most tokens // CHUNK + sequences.
    num_chunks = num_tokens // CHUNK + num_chunk_seqs if chunked else 0
    return dict(decode_rows=num_entries, decode_slots=num_entries, decode_context=num_entries,
                decode_counts=num_entries, chunk_rows=num_tokens if chunked else 0, cu_seqlens=seqs + 1 if chunked else 0,
                chunk_slots=seqs, chunk_continues=seqs, chunk_indices=2 * num_chunks)


def takes_recurrent(num_tokens: int) -> bool:
    """Whether the Triton ops take a sequence of ``num_tokens`` this step
    through the recurrent form (one program a head, its tokens in order)
    rather than the chunked one (``RECURRENT_MAX``)."""
    return num_tokens <= RECURRENT_MAX


def static_step_plan(query_lens: Sequence[int], context_lens: Sequence[int], state_slots: Sequence[int], *,
                     num_tokens: int, num_entries: int, num_chunk_seqs: int, scratch_slot: int) -> StaticPlan:
    """A step's ``StaticPlan``, padded to ``static_sizes(num_tokens,
    num_entries, num_chunk_seqs)``. Pure; raises ValueError where the step
    does not fit."""
    decode_rows, decode_slots, decode_context, decode_counts = [], [], [], []
    chunk_rows, cu_seqlens, chunk_slots, chunk_continues, chunk_indices = [], [0], [], [], []
    start = 0
    for n, ctx, slot in zip(query_lens, context_lens, state_slots):
        if n == 0:
            pass
        elif takes_recurrent(n):
            decode_rows.append(start)
            decode_slots.append(slot)
            decode_context.append(ctx)
            decode_counts.append(n)
        else:
            for j in range(-(-n // CHUNK)):
                chunk_indices += [len(chunk_slots), j]
            chunk_rows.extend(range(start, start + n))
            cu_seqlens.append(cu_seqlens[-1] + n)
            chunk_slots.append(slot)
            chunk_continues.append(int(ctx > n))
        start += n
    sizes = static_sizes(num_tokens, num_entries, num_chunk_seqs)
    if (start > num_tokens or len(decode_rows) > num_entries or len(chunk_slots) > num_chunk_seqs
            or len(chunk_indices) > sizes["chunk_indices"]):
        raise ValueError(f"static deltanet step: {start} tokens, {len(decode_rows)} sequences of at most "
                         f"{RECURRENT_MAX} tokens and {len(chunk_slots)} longer ones ({len(chunk_indices) // 2} "
                         f"chunks); the bucket holds {num_tokens}, {num_entries}, {num_chunk_seqs} "
                         f"({sizes['chunk_indices'] // 2})")
    pad_entries = num_entries - len(decode_rows)
    entries = (decode_rows + [-1] * pad_entries, decode_slots + [scratch_slot] * pad_entries,
               decode_context + [1] * pad_entries, decode_counts + [0] * pad_entries)
    if num_chunk_seqs == 0:
        return StaticPlan(*entries, [], [], [], [], [])
    pad_seqs = sizes["chunk_slots"] - len(chunk_slots)
    return StaticPlan(
        *entries, chunk_rows + [num_tokens] * (num_tokens - len(chunk_rows)),
        cu_seqlens + [cu_seqlens[-1]] * pad_seqs, chunk_slots + [scratch_slot] * pad_seqs,
        chunk_continues + [0] * pad_seqs,
        chunk_indices + [num_chunk_seqs, 0] * (sizes["chunk_indices"] // 2 - len(chunk_indices) // 2))


class DeltaNetOps(Protocol):
    def conv(self, proj: torch.Tensor, weight: torch.Tensor, pool: StatePool, meta: AttentionMetadata,
             delta: torch.Tensor | PendingExpand | None = None) -> torch.Tensor:
        """``proj [T, >= C]`` (in_proj's rows: the convolution's input is their
        first ``C`` columns) -> ``silu(causal depthwise conv) [T, C]`` per
        sequence, continuing from (and updating) each sequence's ``pool.conv``
        slot; ``weight [C, K]``. ``delta``: in_proj's LoRA delta still to add
        (``LoraLinear.forward_parts``'), added first: in place to the columns
        past ``C`` (the gates and z are read there after); the first ``C``
        may take it on the way in only, so nothing reads them after."""

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Gates, pool: StatePool,
                   meta: AttentionMetadata) -> torch.Tensor:
        """``q, k [T, Hk, Dk]`` (not yet normalised), ``v [T, Hv, Dv]`` and the
        step's ``gates`` -> ``o [T, Hv, Dv]`` in ``v``'s dtype, continuing from
        (and updating) each sequence's ``pool.ssm`` slot."""


# -- the reference arithmetic -------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32, q/k normalised (q scaled), key heads repeated onto value heads."""
    num_k, num_v = k.shape[-2], v.shape[-2]
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if num_k != num_v:
        q, k = q.repeat_interleave(num_v // num_k, dim=-2), k.repeat_interleave(num_v // num_k, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk, prepared (``_prepare``): ``q, k [L, H, Dk]``,
    ``v [L, H, Dv]``, ``g, beta [L, H]``, ``state [H, Dk, Dv]`` -> ``(o [L, H, Dv],
    final state)``, all float32; the chunked (WY) form of the reference."""
    length = q.shape[0]
    pad = (CHUNK - length % CHUNK) % CHUNK
    # [H, N, C, D]: heads first, then chunks of CHUNK tokens.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, CHUNK, x.shape[2]) for x in (q, k, v))
    beta, g = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, CHUNK) for x in (beta, g))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1), state


def recurrent_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``B`` sequences at once, prepared: ``q, k [B, H, Dk]``,
    ``v [B, H, Dv]``, ``g, beta [B, H]``, ``state [B, H, Dk, Dv]`` (contiguous,
    updated in place) -> ``(o [B, H, Dv], state)``; the reference's
    recurrent form as batched matrix products, so no temporary is the size
    of the state (1 MB a sequence and layer on Qwen3.5-0.8B)."""
    b, h, dk, dv = state.shape
    state.mul_(g.exp()[..., None, None])
    flat = state.view(b * h, dk, dv)
    memory = torch.bmm(k.reshape(b * h, 1, dk), flat).view(b, h, dv)
    delta = (v - memory) * beta[..., None]
    flat.baddbmm_(k.reshape(b * h, dk, 1), delta.reshape(b * h, 1, dv))
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv), state


def conv_chunk(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``x [L, C]`` after ``prev [C, K - 1]`` -> ``(silu(conv) [L, C], new prev)``."""
    window = torch.cat((prev, x.t().to(prev.dtype)), dim=1)  # [C, K - 1 + L]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - prev.shape[1]:]


# -- the varlen step ---------------------------------------------------------------------------


def _step_rows(meta: AttentionMetadata, device: torch.device):
    """``(decode, chunks)`` of this step, kept in ``meta.derived``: the rows of
    single-token sequences with their slots and whether each continues a
    state, as device tensors (or None), and ``(first row, length, slot,
    continues)`` of each longer chunk. A graphed decode step (``graph_decode``)
    is read from its tensors alone: every row decodes, and a row continues
    its state unless its context is that one token."""
    if meta.graph_decode:
        rows = torch.arange(meta.context_lens.shape[0], device=device)
        return (rows, meta.state_slots, meta.context_lens > 1), []
    if "deltanet" in meta.derived:
        return meta.derived["deltanet"]
    starts = meta.query_start_list
    decode_rows, decode_slots, decode_cont, chunks = [], [], [], []
    for i, (n, ctx) in enumerate(zip(meta.query_lens_list, meta.context_lens_list)):
        slot, continues = meta.state_slots_list[i], ctx > n
        if n == 1:
            decode_rows.append(starts[i])
            decode_slots.append(slot)
            decode_cont.append(continues)
        else:
            chunks.append((starts[i], n, slot, continues))
    decode = None
    if decode_rows:
        decode = (torch.tensor(decode_rows, dtype=torch.long, device=device),
                  torch.tensor(decode_slots, dtype=torch.long, device=device),
                  torch.tensor(decode_cont, dtype=torch.bool, device=device))
    meta.derived["deltanet"] = (decode, chunks)
    return decode, chunks


class TorchDeltaNetOps:
    """The reference: single-token rows of a step batched into one recurrent
    step, each longer chunk on its own through the chunked form."""

    def conv(self, proj: torch.Tensor, weight: torch.Tensor, pool: StatePool, meta: AttentionMetadata,
             delta: torch.Tensor | PendingExpand | None = None) -> torch.Tensor:
        add_delta(proj, delta)
        x = proj[:, :weight.shape[0]]
        decode, chunks = _step_rows(meta, x.device)
        out = torch.empty_like(x)
        if decode is not None:
            rows, slots, continues = decode
            prev = pool.conv.index_select(0, slots) * continues[:, None, None]  # [B, C, K - 1]
            window = torch.cat((prev, x[rows, :, None].to(prev.dtype)), dim=2)  # [B, C, K]
            y = (window.to(weight.dtype) * weight[None]).sum(-1)
            out[rows] = F.silu(y).to(x.dtype)
            pool.conv.index_copy_(0, slots, window[:, :, 1:])
        for first, n, slot, continues in chunks:
            prev = pool.conv[slot] if continues else torch.zeros_like(pool.conv[slot])
            out[first:first + n], pool.conv[slot] = conv_chunk(x[first:first + n], weight, prev)
        return out

    def delta_rule(self, q, k, v, gates: Gates, pool: StatePool, meta: AttentionMetadata) -> torch.Tensor:
        decode, chunks = _step_rows(meta, q.device)
        g, beta = gates.decay(), gates.beta()
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if decode is not None:
            rows, slots, continues = decode
            state = pool.ssm.index_select(0, slots).masked_fill_(~continues[:, None, None, None], 0.0)
            o, state = recurrent_delta_step(*_prepare(q[rows], k[rows], v[rows], g[rows], beta[rows]), state)
            out[rows] = o.to(v.dtype)
            pool.ssm.index_copy_(0, slots, state)
        for first, n, slot, continues in chunks:
            rows = slice(first, first + n)
            state = pool.ssm[slot] if continues else torch.zeros_like(pool.ssm[slot])
            o, pool.ssm[slot] = chunked_delta_rule(*_prepare(q[rows], k[rows], v[rows], g[rows], beta[rows]), state)
            out[rows] = o.to(v.dtype)
        return out
