"""Paged attention: the seam between the decoder and an attention kernel.

The KV cache of one layer is one tensor ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 = K, 1 = V). A step's batch is a flat
(varlen) run of tokens from many sequences; ``AttentionMetadata`` says where
each sequence's queries sit in that run, how long its context is after this
step, which blocks hold its context, and where each new token's K/V goes.

A backend (``PagedAttention``) does two things per layer: write the new K/V
into the cache (``write_kv``), then attend each query to its own sequence's
cached context with a causal offset (``attend``). The torch backend here is
the CPU reference; GPU kernels (Triton, FlashAttention) implement the same
interface, and the loader picks one per device (``loader.attention_backend``),
so this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .deltanet_ops import StaticStep


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens and context are, for one step.

    Sequence ``i`` contributes queries ``query_start[i] : query_start[i+1]`` of
    the flat batch; after this step it has ``context_lens[i]`` tokens of KV
    (prefix already in the cache + this chunk), so its query ``j`` sits at
    position ``context_lens[i] - query_lens[i] + j`` and may see keys
    ``0 ..`` that position. The lists mirror the tensors so a CPU backend
    never has to synchronise to read them.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start: torch.Tensor  # [S + 1] int32, cumulative query lengths
    context_lens: torch.Tensor  # [S] int32
    query_lens_list: list[int]
    context_lens_list: list[int]
    num_blocks_list: list[int]  # blocks each sequence's context occupies
    # What a backend derives from the above once per step and reuses in every layer.
    derived: dict = field(default_factory=dict)
    # A decode step in static form, so it can be captured in a CUDA graph and
    # replayed with new tensor contents. Then every sequence is one decode row
    # (row i = sequence i); ``block_tables`` is ``[B, max_blocks_per_seq]``
    # int32 of one fixed width for the whole run, padded with any valid block
    # id; ``context_lens [B]`` int32 is authoritative (>= 1: a padded row has 1
    # and a table pointing at a scratch block); ``slot_mapping [B]`` int64.
    # The ``*_list`` fields and ``derived`` are stale inside a replayed graph
    # and must not be read: ``write_kv`` and ``attend`` are pure tensor code
    # with static shapes and no host synchronisation.
    graph_decode: bool = False
    # A step with prefill chunks in static form (a graphed mixed step; eager
    # steps may use it too): int32 ``[P, 2]`` work items ``(sequence, first
    # query row of the item within that sequence's chunk)``, one per tile of
    # query rows, padded with ``(-1, 0)`` items that do nothing. With it,
    # ``query_start [S + 1]``, ``context_lens [S]`` and ``block_tables [S, W]``
    # are authoritative on the device (padded sequences have no queries) and,
    # when the step is replayed from a graph, the ``*_list`` fields are stale.
    varlen_work: torch.Tensor | None = None
    # A hybrid model's step (``deltanet_ops``): each sequence's state slot,
    # int64 [S] on the device and as a host list; None for other models.
    state_slots: torch.Tensor | None = None
    state_slots_list: list[int] | None = None
    # A hybrid model's step in static form (a graphed mixed step, with
    # ``varlen_work``; ``state_slots [S]`` is then padded with the pools'
    # scratch slot): where the delta rule finds its short sequences (the
    # recurrent kernel's) and its longer ones (``deltanet_ops.StaticStep``).
    deltanet_static: StaticStep | None = None

    @classmethod
    def from_lists(cls, *, slot_mapping: Sequence[int], block_tables: Sequence[Sequence[int]],
                   num_blocks: Sequence[int], query_lens: Sequence[int], context_lens: Sequence[int],
                   device: torch.device | str) -> AttentionMetadata:
        """An eager step's metadata from host lists: ``block_tables`` already
        padded to one width, ``num_blocks`` the blocks each context occupies."""
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_lens_list=list(query_lens),
            context_lens_list=list(context_lens),
            num_blocks_list=list(num_blocks),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def query_start_list(self) -> list[int]:
        starts = [0]
        for n in self.query_lens_list:
            starts.append(starts[-1] + n)
        return starts


# Query rows per work item of a ``varlen_work`` step (see ``AttentionMetadata``).
VARLEN_BLOCK_M = 16


def plan_varlen_work(query_lens: Sequence[int], num_items: int | None = None,
                     block_m: int = VARLEN_BLOCK_M) -> list[tuple[int, int]]:
    """Work items covering every query row: ``(sequence, first row)`` for each
    run of up to ``block_m`` rows of one sequence's chunk, in sequence order;
    padded with ``(-1, 0)`` up to ``num_items`` when given. Pure host code."""
    work = [(seq, first) for seq, n in enumerate(query_lens) for first in range(0, n, block_m)]
    if num_items is not None:
        if len(work) > num_items:
            raise ValueError(f"{len(work)} work items do not fit the {num_items} of this step's static shape")
        work += [(-1, 0)] * (num_items - len(work))
    return work


def max_varlen_items(num_tokens: int, num_seqs: int, block_m: int = VARLEN_BLOCK_M) -> int:
    """An upper bound of ``len(plan_varlen_work(q))`` over every split of
    ``num_tokens`` query rows among at most ``num_seqs`` sequences."""
    return num_tokens // block_m + min(num_seqs, num_tokens)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagedAttention(Protocol):
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store ``k, v [T, KH, D]`` at ``meta.slot_mapping`` in ``kv_cache``."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``q [T, H, D]`` -> ``[T, H, D]``, each query against its sequence's cached context."""


class TorchPagedAttention:
    """Reference backend: gather pages, then SDPA.

    Decode rows (one query each) are attended together: one gather of every
    such sequence's pages padded to the longest, one SDPA call with a length
    mask (padding keys get -inf, so they add exactly nothing). On CPU this is
    what keeps a step's attention cost from growing with one call per
    sequence per layer. Prefill chunks get one SDPA call each, with a causal
    mask shifted by the cached prefix length. Grouped K/V heads are shared
    through SDPA's ``enable_gqa`` rather than copied per query head.

    A ``varlen_work`` step (a graphed mixed step's static form) is read from
    its tensors and attended one work item at a time (``_attend_varlen``).
    """

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.varlen_work is not None:
            return self._attend_varlen(q, kv_cache, meta, scale)
        if meta.graph_decode:
            mask = _graph_decode_mask(meta, kv_cache.shape[2])
            return self._attend_decode(q, kv_cache, meta.block_tables, mask, scale)
        out = torch.empty_like(q)
        decode = _decode_rows(meta, kv_cache.shape[2], q.device, q.dtype)
        if decode is not None:
            rows, tables, mask = decode
            out[rows] = self._attend_decode(q[rows], kv_cache, tables, mask, scale)
        self._attend_chunks(q, kv_cache, meta, scale, out)
        return out

    def _attend_chunks(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       out: torch.Tensor) -> None:
        """Prefill chunks (rows of sequences with more than one query), one SDPA
        call each, written into ``out``; decode rows are left to the caller."""
        start = 0
        for i in range(meta.num_seqs):
            q_len, ctx_len = meta.query_lens_list[i], meta.context_lens_list[i]
            if q_len > 1:
                k, v = self._gather(kv_cache, meta.block_tables[i, : meta.num_blocks_list[i]], ctx_len)
                qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
                out[start : start + q_len] = self._attend_chunk(qi, k, v, scale).transpose(0, 1)
            start += q_len

    def _attend_varlen(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float) -> torch.Tensor:
        """A ``varlen_work`` step from its tensors alone (the ``*_list`` fields
        may be stale), item by item as a kernel would run it: the reference
        for the static path. Reads the tensors on the host, so it runs only
        eagerly (CPU, tests, a fallback), never inside a captured graph.
        Rows no item covers (padding tokens) are zero."""
        out = torch.zeros_like(q)
        starts, ctx_lens = meta.query_start.tolist(), meta.context_lens.tolist()
        block_size = kv_cache.shape[2]
        contexts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for seq, first in meta.varlen_work.tolist():
            if seq < 0:
                continue
            q_len, ctx_len = starts[seq + 1] - starts[seq], ctx_lens[seq]
            if seq not in contexts:
                contexts[seq] = self._gather(kv_cache, meta.block_tables[seq, : -(-ctx_len // block_size)], ctx_len)
            k, v = contexts[seq]
            rows = slice(starts[seq] + first, starts[seq] + min(first + VARLEN_BLOCK_M, q_len))
            mask = _causal_offset_mask(q_len, ctx_len, q.device)[first : first + VARLEN_BLOCK_M]
            qi = q[rows].transpose(0, 1)  # [H, rows, D]
            attended = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = attended.transpose(0, 1)
        return out

    @staticmethod
    def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One prefill chunk: ``q [H, q_len, D]`` against its whole context ``k, v [KH, ctx, D]``,
        causal with the chunk at the context's end."""
        mask = _causal_offset_mask(q.shape[1], k.shape[1], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    @staticmethod
    def _attend_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """``q [B, H, D]``, one query per sequence, against its padded pages -> ``[B, H, D]``."""
        two, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        # index_select over whole blocks is one contiguous copy per block; advanced
        # indexing with a 2-D index takes a much slower strided path on CPU.
        pages = kv_cache.flatten(2).index_select(1, tables.flatten())  # [2, B*nb, bs*KH*D]
        pages = pages.view(two, tables.shape[0], tables.shape[1] * block_size, num_kv_heads, head_dim)
        kv = pages.transpose(2, 3)  # [2, B, KH, nb*bs, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V as ``[KH, ctx_len, D]`` each."""
        pages = kv_cache[:, blocks.long()]  # [2, nb, bs, KH, D]
        pages = pages.flatten(1, 2)[:, :ctx_len]  # [2, ctx, KH, D]
        kv = pages.permute(0, 2, 1, 3)  # [2, KH, ctx, D]
        return kv[0], kv[1]


def _decode_rows(meta: AttentionMetadata, block_size: int, device: torch.device, dtype: torch.dtype):
    """``(rows, tables, mask)`` for the step's decode rows, None without any:
    flat query rows ``[B]``, their block tables ``[B, nb]`` (int64) and an
    additive key mask ``[B, 1, 1, nb * block_size]`` (0 or -inf, in the
    queries' dtype: SDPA would convert a boolean one in every layer). Built
    once per step and kept in ``meta.derived``: every layer reuses it. A lone
    decode row takes this path too: SDPA's fused CPU kernel beats its math
    path even at B = 1."""
    if "decode" in meta.derived:
        return meta.derived["decode"]
    seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    decode = None
    if seqs:
        starts = meta.query_start_list
        num_blocks = max(meta.num_blocks_list[i] for i in seqs)
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        tables = meta.block_tables[index, :num_blocks].long()
        lens = meta.context_lens[index].long()
        positions = torch.arange(num_blocks * block_size, device=device)
        visible = (positions[None, :] < lens[:, None])[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
        decode = (rows, tables, mask)
    meta.derived["decode"] = decode
    return decode


def _graph_decode_mask(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """Key mask ``[B, 1, 1, max_blocks * block_size]`` from the tensors alone
    (graph-safe). Lengths are clamped to >= 1 so that no row is all -inf: a
    row with one valid key never yields NaN, whatever its table points at."""
    positions = torch.arange(meta.block_tables.shape[1] * block_size, device=meta.context_lens.device)
    lens = meta.context_lens.clamp(min=1)
    return (positions[None, :] < lens[:, None])[:, None, None, :]


def _causal_offset_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, ctx_len]`` bool: query j (position ctx_len - q_len + j) sees keys <= its position."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    return k_pos <= q_pos

