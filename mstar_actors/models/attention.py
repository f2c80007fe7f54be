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
interface and are picked by ``make_attention_backend``.

On CPU in float32 the torch backend keeps each decoding sequence's K/V in a
contiguous copy across steps (``DecodeStaging``), so a decode step appends
one token per sequence instead of gathering every page in every layer; the
paged cache stays the source of truth the copy is filled from.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def query_start_list(self) -> list[int]:
        starts = [0]
        for n in self.query_lens_list:
            starts.append(starts[-1] + n)
        return starts


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
    """

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)

    # Made on the first CPU float32 decode step (a class default, so a
    # subclass that does not call this __init__ still has it).
    staging: DecodeStaging | None = None

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.graph_decode:
            mask = _graph_decode_mask(meta, kv_cache.shape[2])
            return self._attend_decode(q, kv_cache, meta.block_tables, mask, scale)
        if q.device.type == "cpu" and q.dtype == torch.float32:
            if self.staging is None:
                self.staging = DecodeStaging()
            step = self.staging.plan(meta, q, kv_cache)
            if step is not None:
                return self._attend_staged(step, q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        decode = _decode_rows(meta, kv_cache.shape[2], q.device, q.dtype)
        if decode is not None:
            rows, tables, mask = decode
            out[rows] = self._attend_decode(q[rows], kv_cache, tables, mask, scale)
        self._attend_chunks(q, kv_cache, meta, scale, out)
        return out

    def _attend_staged(self, step: StagedStep, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float) -> torch.Tensor:
        """Decode rows on the staged copy, prefill chunks as usual. With every
        row a decode row on its own staged row (the usual decode step) the
        result is the staged output itself: no gather, no scatter."""
        out = self.staging.attend(step, q, kv_cache, scale)
        if step.is_identity:
            return out
        full = torch.empty_like(q)
        full[step.query_rows] = out[step.rows]
        self._attend_chunks(q, kv_cache, meta, scale, full)
        return full

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
                mask = _causal_offset_mask(q_len, ctx_len, q.device)
                oi = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
                out[start : start + q_len] = oi.transpose(0, 1)
            start += q_len

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


# --- CPU decode rows on a contiguous copy --------------------------------------

# What one layer's staged copy may take (K and V); a step that would need more
# takes the gather path instead. 8 MiB is 8 sequences of up to 680 tokens at
# SmolLM2's 3 KV heads of 64, and 30 layers' worth is 240 MiB at most.
MAX_STAGED_BYTES_PER_LAYER = 8 << 20
STAGED_KEYS_ALIGN = 128  # the copy's length grows in these steps, rows one at a time


@dataclass(frozen=True)
class StagedRow:
    """A staged row holds the first ``length`` tokens of the sequence whose
    block table starts with ``blocks`` (the blocks covering those tokens)."""

    blocks: tuple[int, ...]
    length: int


def match_staged_rows(
    previous: list[StagedRow | None], decode: list[tuple[tuple[int, ...], int]]
) -> tuple[list[int], list[bool], list[StagedRow | None]]:
    """Pure: the staged row each of a step's decode sequences takes.

    ``decode`` holds each decode sequence's block table and its context
    length after this step. A sequence continues a previous row when that
    row holds exactly its first ``context - 1`` tokens in the same blocks:
    the same sequence one step later (or one sharing those very blocks
    through the prefix cache, whose K/V are the same). Each row is taken
    once. Every other sequence takes the lowest free row and must be filled
    whole from the cache; rows no sequence takes are dropped, so a row only
    lives across consecutive steps in which its sequence decodes (which is
    what keeps its blocks from being freed and reused under it).

    Returns the row of each sequence, whether it must be filled, and the
    rows' contents after this step.
    """
    by_key: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(previous):
        if row is not None and row.blocks:
            by_key.setdefault((row.blocks[0], row.length), []).append(r)
    rows = [-1] * len(decode)
    taken: set[int] = set()
    for i, (blocks, context) in enumerate(decode):
        for r in by_key.get((blocks[0], context - 1), ()) if blocks else ():
            prev = previous[r]
            if r not in taken and blocks[: len(prev.blocks)] == prev.blocks:
                rows[i] = r
                taken.add(r)
                break
    fills = [r < 0 for r in rows]
    free = (r for r in range(len(previous) + len(decode)) if r not in taken)
    rows = [r if r >= 0 else next(free) for r in rows]
    contents: list[StagedRow | None] = [None] * (max(rows) + 1 if rows else 0)
    for r, (blocks, context) in zip(rows, decode):
        contents[r] = StagedRow(blocks, context)
    return rows, fills, contents


@dataclass
class StagedStep:
    """One step's decode rows on the staged copy, derived once per step."""

    generation: int
    rows: torch.Tensor  # [Bd] int64: staged row of each decode sequence
    query_rows: torch.Tensor  # [Bd] int64: its query's row in the flat batch
    positions: torch.Tensor  # [Bd] int64: where its new token goes (context - 1)
    slots: torch.Tensor  # [Bd] int64: the new token's cache slot
    fills: list[tuple[int, list[int], int]]  # (row, blocks, context) copied whole from the cache
    decode: list[tuple[int, list[int], int]]  # the same for every decode sequence
    num_rows: int  # rows 0 .. num_rows - 1 are attended (a row no sequence holds is masked)
    num_keys: int  # the longest context
    mask: torch.Tensor  # [num_rows * KH, group, num_keys] additive key mask
    is_identity: bool  # every query decodes and query i is on row i
    token_index: tuple[torch.Size, torch.Tensor] | None = None  # see DecodeStaging._token_index


class _StagedLayer:
    __slots__ = ("cache_ref", "buf", "generation")

    def __init__(self, kv_cache: torch.Tensor):
        self.cache_ref = weakref.ref(kv_cache)
        self.buf: torch.Tensor | None = None  # [2, rows, KH, keys, D]
        self.generation = -1  # the step that last brought it up to date


class DecodeStaging:
    """Each decoding sequence's K/V in one contiguous copy per layer, kept
    across steps (CPU, float32).

    Why: gathering every page of every decode sequence in every layer was a
    third of a CPU decode step's attention (the pages are cold by then, the
    weights having streamed through the cache). With the copy a decode step
    appends one token per sequence per layer, and attention runs as three
    batched ops (scores, softmax, values) over ``[rows * KH, group, keys]``.

    Layout of a layer's copy: ``[2, rows, KH, keys, D]`` (K, V), row ``r``
    holding its sequence's tokens ``0 .. length - 1``; the rest is zeros or
    stale finite values that the step's key mask hides.

    The paged cache stays the source of truth; the copy is only filled from
    it (a new row: its whole context; a continued row: the token this step
    wrote, read back at its slot), always after ``write_kv``. Invariants:
    a row's contents follow ``match_staged_rows`` (only consecutive decode
    steps keep it), and a layer copy that missed a step (``generation``
    behind) or belongs to another cache tensor is refilled whole, so an
    interrupted step or a second cache never yields stale keys.
    """

    def __init__(self, max_bytes_per_layer: int = MAX_STAGED_BYTES_PER_LAYER):
        self.max_bytes_per_layer = max_bytes_per_layer
        self.rows: list[StagedRow | None] = []
        self.generation = 0
        self.layers: dict[int, _StagedLayer] = {}  # by the layer cache's data_ptr

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor) -> StagedStep | None:
        """This step's ``StagedStep`` (made by the first layer, reused by the
        others), or None when the step has no decode rows or its copy would
        exceed ``max_bytes_per_layer``: then every row is dropped."""
        if "staged" not in meta.derived:
            meta.derived["staged"] = self._plan(meta, q.shape[1], kv_cache)
        return meta.derived["staged"]

    def release(self) -> None:
        self.rows = []
        self.layers.clear()

    def _plan(self, meta: AttentionMetadata, num_heads: int, kv_cache: torch.Tensor) -> StagedStep | None:
        self.generation += 1
        seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
        if not seqs:
            self.release()
            return None
        tables = meta.block_tables.tolist()
        decode = [(tuple(tables[i][: meta.num_blocks_list[i]]), meta.context_lens_list[i]) for i in seqs]
        rows, fills, self.rows = match_staged_rows(self.rows, decode)
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        num_keys = max(context for _, context in decode)
        if self._nbytes(len(self.rows), num_kv_heads, num_keys, head_dim) > self.max_bytes_per_layer:
            self.release()
            return None
        # A copy that missed the last step can't be appended to: drop it.
        self.layers = {k: v for k, v in self.layers.items() if v.generation >= self.generation - 1}
        starts = meta.query_start_list
        every = [(r, list(blocks), context) for r, (blocks, context) in zip(rows, decode)]
        query_rows = torch.tensor([starts[i] for i in seqs])
        return StagedStep(
            generation=self.generation,
            rows=torch.tensor(rows),
            query_rows=query_rows,
            positions=torch.tensor([context - 1 for _, context in decode]),
            slots=meta.slot_mapping.index_select(0, query_rows),
            fills=[e for e, fill in zip(every, fills) if fill],
            decode=every,
            num_rows=len(self.rows),
            num_keys=num_keys,
            mask=self._mask(num_keys, num_heads, num_kv_heads),
            is_identity=len(seqs) == len(meta.slot_mapping) and rows == list(range(len(seqs))),
        )

    def _mask(self, num_keys: int, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """Additive ``[rows * KH, group, keys]``: row ``r`` sees its first
        ``length`` keys; a row no sequence holds sees key 0 only (finite, unused)."""
        lens = torch.tensor([row.length if row is not None else 1 for row in self.rows])
        visible = torch.arange(num_keys)[None, :] < lens[:, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        num_rows = len(self.rows)
        return mask[:, None, :].expand(num_rows, num_heads, num_keys).reshape(num_rows * num_kv_heads, -1, num_keys)

    @staticmethod
    def _nbytes(num_rows: int, num_kv_heads: int, num_keys: int, head_dim: int) -> int:
        return 2 * num_rows * num_kv_heads * num_keys * head_dim * 4

    def attend(self, step: StagedStep, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """``[num_rows, H, D]``: each staged row's query (zero on a row no
        sequence holds) against its copy. Call after ``write_kv``."""
        buf = self._update(step, kv_cache)
        num_rows, num_keys = step.num_rows, step.num_keys
        num_heads, head_dim = q.shape[1], q.shape[2]
        group_rows = num_rows * kv_cache.shape[3]
        if step.is_identity:
            qs = q
        else:
            qs = q.new_zeros(num_rows, num_heads, head_dim)
            qs[step.rows] = q[step.query_rows]
        k = buf[0, :num_rows, :, :num_keys].view(group_rows, num_keys, head_dim)
        v = buf[1, :num_rows, :, :num_keys].view(group_rows, num_keys, head_dim)
        scores = torch.baddbmm(step.mask, qs.reshape(group_rows, -1, head_dim), k.transpose(1, 2), alpha=scale)
        return torch.bmm(scores.softmax(-1), v).view(num_rows, num_heads, head_dim)

    def _update(self, step: StagedStep, kv_cache: torch.Tensor) -> torch.Tensor:
        """This layer's copy, grown to the step's size and brought up to date."""
        layer = self.layers.get(kv_cache.data_ptr())
        if layer is None or layer.cache_ref() is not kv_cache:
            layer = self.layers[kv_cache.data_ptr()] = _StagedLayer(kv_cache)
        is_behind = layer.generation < step.generation - 1
        buf = layer.buf = self._fit(layer.buf, step, kv_cache)
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        # The new tokens, read back at their slots, go to (row, head, position)
        # through one flat index: a copy per row, cheaper than a 2-D index_put.
        new = kv_cache.view(2, -1, num_kv_heads, head_dim).index_select(1, step.slots)  # [2, Bd, KH, D]
        flat = buf.view(2, -1, head_dim)
        flat.index_copy_(1, self._token_index(step, buf.shape), new.view(2, -1, head_dim))
        for row, blocks, context in step.decode if is_behind else step.fills:
            pages = kv_cache[:, blocks].flatten(1, 2)[:, :context]  # [2, context, KH, D]
            buf[:, row, :, :context] = pages.transpose(1, 2)
        layer.generation = step.generation
        return buf

    @staticmethod
    def _token_index(step: StagedStep, shape: torch.Size) -> torch.Tensor:
        """Flat ``[Bd * KH]`` index of each new token's (row, head, position) in a
        copy of ``shape``, made once per step (every layer's copy has one shape)."""
        if step.token_index is None or step.token_index[0] != shape:
            _, _, num_kv_heads, num_keys, _ = shape
            heads = torch.arange(num_kv_heads)
            index = ((step.rows[:, None] * num_kv_heads + heads[None, :]) * num_keys + step.positions[:, None]).flatten()
            step.token_index = (shape, index)
        return step.token_index[1]

    def _fit(self, buf: torch.Tensor | None, step: StagedStep, kv_cache: torch.Tensor) -> torch.Tensor:
        """``buf``, or a larger zeroed copy of it when the step needs more
        rows or keys (keys rounded up to ``STAGED_KEYS_ALIGN`` within budget)."""
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        have_rows, have_keys = (0, 0) if buf is None else (buf.shape[1], buf.shape[3])
        if have_rows >= step.num_rows and have_keys >= step.num_keys:
            return buf
        num_rows = max(have_rows, step.num_rows)
        num_keys = max(have_keys, -(-step.num_keys // STAGED_KEYS_ALIGN) * STAGED_KEYS_ALIGN)
        if self._nbytes(num_rows, num_kv_heads, num_keys, head_dim) > self.max_bytes_per_layer:
            num_keys = max(have_keys, step.num_keys)
        grown = kv_cache.new_zeros(2, num_rows, num_kv_heads, num_keys, head_dim)
        if buf is not None:
            grown[:, :have_rows, :, :have_keys] = buf
        return grown


def make_attention_backend(device: torch.device | str) -> PagedAttention:
    """The attention backend for ``device``: on CUDA the Triton decode kernel
    (``TritonPagedAttention``) when Triton imports, else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            from .triton_attention import TritonPagedAttention
        except ImportError as err:  # Triton missing or broken: correct, just slower
            log.warning("attention: Triton unavailable (%s); using the torch reference on %s", err, device)
        else:
            return TritonPagedAttention()
    return TorchPagedAttention()
