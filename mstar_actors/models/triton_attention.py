"""Triton paged attention: decode rows, and steps with prefill chunks (CUDA;
Triton's interpreter runs both on CPU in tests).

``paged_decode_attention``: one query row per sequence against its paged KV
cache. One program per (sequence, KV head, context split) handles the whole
GQA group of query heads that share the KV head, so each K/V page is read
from memory once per group, not once per query head. Each program walks its
share of the sequence's context ``BLOCK_N`` tokens at a time (several pages
per step: the page ids of the step's tokens are gathered from the block
table), with an fp32 online softmax (exp2, running max and sum).

Split-K over the context: at small batch there are only ``B * KH`` programs
(8 for Llama-3.2-1B at B = 1), far fewer than the device's SMs, and a long
context would be read by a handful of SMs at a fraction of the memory
bandwidth. So when ``B * KH`` is below about twice the SM count, each
(sequence, KV head) is split into ``num_splits`` contiguous ranges of its
context, each program writes a partial output and its log-sum-exp, and a
second small kernel combines the splits. At larger batch one split suffices
and the first kernel writes the output directly (one launch).

Graph safety: the grid and ``num_splits`` depend on tensor shapes (and the
device's SM count) only; each program reads its context length from
``context_lens`` on the device and stops there, whatever the table width. No
host synchronisation, so a decode step can be captured in a CUDA graph and
replayed with new tables and lengths. A context length below 1 is treated as
1 (a padded row of a graph bucket), so no row is ever empty or NaN.

``paged_varlen_attention``: every query row of a step (decode rows and
prefill chunks, each chunk causal at its context's end) in one launch, for
steps with prefill chunks. One program per (work item, KV head): an item is
up to ``VARLEN_BLOCK_M`` query rows of one sequence (``plan_varlen_work``),
and its Q tile is those rows times the GQA group (token-major), so each K/V
page is again read once per group. It walks the context up to the tile's
last row's position only: tiles every row sees whole need no causal mask,
the diagonal tiles mask per element. Graph-safe like the decode kernel: the
grid is ``(P, KH)`` from shapes, items padded with ``(-1, 0)`` return at
once, and everything else is read on the device.

``TritonPagedAttention`` is the backend that picks between them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from mstar_actors import triton_launch

from .attention import VARLEN_BLOCK_M, AttentionMetadata, TorchPagedAttention, plan_varlen_work

log = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_SPLITS = 16
# Context tokens a program loads per loop step. Page ids are gathered per
# token, so a step may span several pages and any block_size works.
TOKENS_PER_STEP = 64


@triton.jit
def _attend_tokens(q, m_i, l_i, acc, n0, end, q_pos, table, kv_base, stride_kv, stride_kb, stride_kt, scale_log2,
                   offs_d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """One online-softmax step over context tokens ``n0 .. n0 + BLOCK_N`` (< ``end``)
    for a tile of query rows (a GQA group, or a run of tokens times a group):
    returns the updated running max, sum and output. ``CAUSAL`` also hides
    the keys past each row's position ``q_pos [rows]`` (the diagonal tiles of
    a prefill chunk); without it ``q_pos`` is not read and the code is the
    decode kernel's as before."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    page = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
    token = page * stride_kb + (offs_n % PAGE) * stride_kt
    k = tl.load(kv_base + token[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [D, N]
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [rows, N], log2 units
    if CAUSAL:
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(kv_base + stride_kv + token[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)  # [N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


# The table's row stride is the step's widest table in eager steps: left to
# specialise, each width class (1, a multiple of 16, other) would compile
# its own kernel in the middle of serving.
@triton.jit(do_not_specialize=["stride_tb"])
def _decode_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kv, stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, LOOP_WHILE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if GDC:  # the lengths may be a step's own gather, q is (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ctx = tl.maximum(tl.load(lens_ptr + seq), 1)
    steps_per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS)
    start = split * steps_per_split * BLOCK_N
    end = tl.minimum(ctx, start + steps_per_split * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    table = tables_ptr + seq * stride_tb
    kv_base = kv_ptr + kv_head * stride_kh
    if LOOP_WHILE:  # Triton's interpreter cannot range() over a loaded bound; the body is the same
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, end, end, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, False)
            n0 += BLOCK_N
    else:  # compiled: a for loop, which Triton software-pipelines
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, end, end, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, False)

    is_live = l_i > 0  # a split past the context's end saw no key
    out = acc / tl.where(is_live, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(is_live, m_i + tl.log2(tl.where(is_live, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    if GDC:  # everything below reads the decode kernel's writes (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    # Split 0 always holds the context's first key, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None], other=0.0)
    out = tl.sum(part * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_tb"])
def _varlen_kernel(
    q_ptr, kv_ptr, tables_ptr, starts_ptr, lens_ptr, work_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kv, stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LOOP_WHILE: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    if GDC:  # the work list may be a step's own (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_ptr + item * 2)
    if seq < 0:  # a padding item of a static work list
        return
    first = tl.load(work_ptr + item * 2 + 1)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    ctx = tl.load(lens_ptr + seq)

    # Rows are token-major: row r is query row first + r // BLOCK_G of the
    # chunk, head kv_head * GROUP + r % BLOCK_G (heads >= GROUP masked).
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    row = first + offs_r // BLOCK_G
    offs_g = offs_r % BLOCK_G
    mask_r = (row < q_len) & (offs_g < GROUP)
    token = q_start + row
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None], other=0.0)
    # The chunk ends the context. Positions are clamped at 0 so every row,
    # masked ones included, sees key 0 in the first tile: no row's running
    # max stays -inf, so no NaN even for a malformed (context < chunk) row.
    q_pos = tl.maximum(ctx - q_len + row, 0)
    first_pos = tl.maximum(ctx - q_len + first, 0)
    end = tl.minimum(ctx, ctx - q_len + first + BLOCK_M)  # past the tile's last row's position
    diag = (first_pos // BLOCK_N) * BLOCK_N  # tiles below it are visible to every row: no causal mask

    m_i = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M * BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, HEAD_DIM), dtype=tl.float32)
    table = tables_ptr + seq * stride_tb
    kv_base = kv_ptr + kv_head * stride_kh
    if LOOP_WHILE:  # Triton's interpreter cannot range() over a loaded bound; the bodies are the same
        n0 = diag * 0
        while n0 < diag:
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, diag, q_pos, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, False)
            n0 += BLOCK_N
        while n0 < end:
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, end, q_pos, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, True)
            n0 += BLOCK_N
    else:  # compiled: for loops, which Triton software-pipelines
        for n0 in range(0, diag, BLOCK_N):
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, diag, q_pos, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, False)
        for n0 in range(diag, end, BLOCK_N):
            m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, n0, end, q_pos, table, kv_base, stride_kv, stride_kb,
                                           stride_kt, scale_log2, offs_d, PAGE, BLOCK_N, PRECISION, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` against ``kv_cache [2, num_blocks, block_size, KH, D]``
    through ``block_tables [B, max_blocks]`` int32 and ``context_lens [B]``
    int32 -> ``[B, H, D]`` (written into ``out`` when given). ``num_splits``
    (context splits per sequence) defaults to one chosen from the shapes."""
    _check_inputs(q, kv_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    if block_tables.stride(1) != 1:
        raise ValueError("paged_decode_attention: block_tables needs a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * page, q.device)
    group = num_heads // num_kv_heads
    consts = dict(
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=TOKENS_PER_STEP, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOOP_WHILE=not q.is_cuda,
        **triton_launch.options(q),
    )
    if num_splits == 1:
        target, lse = out, out  # lse is not written with one split
        target_strides = (out.stride(0), out.stride(1), 0)
    else:
        target = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        target_strides = (target.stride(0), target.stride(1), target.stride(2))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, context_lens, target, lse,
        scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        *target_strides,
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0,
        **consts,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(batch, num_heads)](
            target, lse, out,
            target.stride(0), target.stride(1), target.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            **triton_launch.options(q),
        )  # fmt: skip
    return out


def paged_varlen_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    work: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Every query row of a step, decode rows and prefill chunks alike, in one
    launch: ``q [T, H, D]`` against ``kv_cache [2, num_blocks, block_size, KH, D]``
    -> ``[T, H, D]`` (written into ``out`` when given).

    Sequence ``s`` owns rows ``query_start[s] : query_start[s + 1]`` (int32
    ``[S + 1]``), has ``context_lens[s]`` (int32 ``[S]``) tokens of KV with its
    chunk at the end, in blocks ``block_tables[s]`` (int32 ``[S, W]``); row
    ``j`` of its chunk sees keys up to its position. ``work`` (int32 ``[P, 2]``,
    contiguous) lists ``(sequence, first row)`` items of ``VARLEN_BLOCK_M``
    rows each, padded with ``(-1, 0)`` (``plan_varlen_work``). Graph-safe: the
    grid ``(P, KH)`` comes from shapes and every program reads its item's
    metadata on the device. Rows no item covers are not written. ``tile``
    (``(BLOCK_N, num_warps)``) overrides the kernel's tile choice, for tuning."""
    _check_varlen_inputs(q, kv_cache, block_tables, query_start, context_lens, work)
    _, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if work.shape[0] == 0 or q.shape[0] == 0:
        return out
    _varlen_kernel[(work.shape[0], num_kv_heads)](
        q, kv_cache, block_tables, query_start, context_lens, work, out,
        scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        **_varlen_config(num_heads // num_kv_heads, head_dim, page, q, tile),
    )  # fmt: skip
    return out


def _varlen_config(group: int, head_dim: int, page: int, q: torch.Tensor, tile: tuple[int, int] | None = None) -> dict:
    """The varlen kernel's compile-time constants and launch shape, from the
    model's shape and dtype only (so ``warm_up`` compiles the one variant
    serving will use). ``tile`` = ``(BLOCK_N, num_warps)`` overrides the
    choice (tuning tools).

    The choice keeps a program's tiles in registers on sm_90 (bf16): the
    gathered K/V tiles carry a 64-bit address per element, so 4 warps spill
    at a 64-row x 64-dim Q tile against 64 keys; 8 warps with 64 keys fit,
    and 32 keys past 64 x 64 keep D = 128 from spilling."""
    block_g = triton.next_power_of_2(group)
    num_rows = VARLEN_BLOCK_M * block_g
    block_n, num_warps = tile or (TOKENS_PER_STEP if num_rows * head_dim <= 64 * 64 else TOKENS_PER_STEP // 2, 8)
    return dict(
        GROUP=group, BLOCK_G=block_g, BLOCK_M=VARLEN_BLOCK_M, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOOP_WHILE=not q.is_cuda, num_warps=num_warps,
        **triton_launch.options(q),
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context splits per (sequence, KV head): enough programs for about two per
    SM, at most ``MAX_SPLITS`` and no more than the table has steps. From
    shapes only, so a captured graph keeps its choice."""
    num_programs = batch * num_kv_heads
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    max_steps = triton.cdiv(max_context, TOKENS_PER_STEP)
    splits = max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, num_programs), max_steps))
    # A power of two: the count is a compile-time constant, so this keeps its
    # variants to a handful that ``warm_up`` compiles before serving.
    return 1 << (splits.bit_length() - 1)


def warm_up(q_shape: tuple[int, int, int], kv_cache: torch.Tensor) -> None:
    """Compile every split count ``choose_num_splits`` can pick, and the varlen kernel, for queries of
    ``[_, heads, head_dim]`` on ``kv_cache``, now: a compile takes about a
    second, which mid-serving would stall the whole batch. Reads the cache,
    writes only scratch tensors."""
    _, num_heads, head_dim = q_shape
    q = torch.zeros(1, num_heads, head_dim, dtype=kv_cache.dtype, device=kv_cache.device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=kv_cache.device)
    lens = torch.ones(1, dtype=torch.int32, device=kv_cache.device)
    num_splits = 1
    while num_splits <= MAX_SPLITS:
        paged_decode_attention(q, kv_cache, tables, lens, 1.0, num_splits=num_splits)
        num_splits *= 2
    # The varlen kernel has one variant per model and dtype (its table stride is not specialised).
    starts = torch.tensor([0, 1], dtype=torch.int32, device=kv_cache.device)
    work = torch.zeros(1, 2, dtype=torch.int32, device=kv_cache.device)
    paged_varlen_attention(q, kv_cache, tables, starts, lens, work, 1.0)


def _num_sms(device: torch.device) -> int:
    return triton_launch.num_sms(device, 1)  # the interpreter: splitting gains nothing


def is_supported_head_dim(head_dim: int) -> bool:
    return MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    _check_q_and_cache("paged_decode_attention", q, kv_cache)
    batch = q.shape[0]
    _check_int32("paged_decode_attention", block_tables=block_tables, context_lens=context_lens)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(context_lens.shape) != (batch,):
        raise ValueError(
            f"paged_decode_attention: block_tables {tuple(block_tables.shape)} must be [{batch}, max_blocks] and "
            f"context_lens {tuple(context_lens.shape)} [{batch}]"
        )


def _check_varlen_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         query_start: torch.Tensor, context_lens: torch.Tensor, work: torch.Tensor) -> None:
    name = "paged_varlen_attention"
    _check_q_and_cache(name, q, kv_cache)
    _check_int32(name, block_tables=block_tables, query_start=query_start, context_lens=context_lens, work=work)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if (num_seqs < 0 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs
            or tuple(query_start.shape) != (num_seqs + 1,)):
        raise ValueError(
            f"{name}: context_lens {tuple(context_lens.shape)} must be [S], block_tables "
            f"{tuple(block_tables.shape)} [S, max_blocks] and query_start {tuple(query_start.shape)} [S + 1]"
        )
    if work.dim() != 2 or work.shape[1] != 2 or not work.is_contiguous():
        raise ValueError(f"{name}: work {tuple(work.shape)} must be a contiguous [P, 2] of (sequence, first row) "
                         "items (plan_varlen_work)")
    if block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables needs a contiguous last dimension")


def _check_q_and_cache(name: str, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"{name}: q {tuple(q.shape)} must be [B, H, D] and kv_cache {tuple(kv_cache.shape)} "
            "[2, num_blocks, block_size, KH, D]"
        )
    _, num_heads, head_dim = q.shape
    _, _, _, num_kv_heads, kv_dim = kv_cache.shape
    if kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: q has {num_heads} heads of {head_dim}, kv_cache {num_kv_heads} of {kv_dim}; "
            "head_dim must match and the query heads be a multiple of the KV heads"
        )
    if not is_supported_head_dim(head_dim):
        raise ValueError(
            f"{name}: head_dim {head_dim} is not supported; "
            f"accepted: a power of two from {MIN_HEAD_DIM} to {MAX_HEAD_DIM} (use TorchPagedAttention otherwise)"
        )
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(
            f"{name}: q is {q.dtype} and kv_cache {kv_cache.dtype}; both must be one of float16, bfloat16, float32"
        )
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"{name}: q and kv_cache need a contiguous last dimension")


def _check_int32(name: str, **tensors: torch.Tensor) -> None:
    wrong = [f"{key} ({t.dtype})" for key, t in tensors.items() if t.dtype != torch.int32]
    if wrong:
        raise ValueError(f"{name}: {' and '.join(wrong)} must be int32")


class TritonPagedAttention(TorchPagedAttention):
    """The CUDA backend: every query row of a step through Triton kernels,
    ``write_kv`` the reference's ``index_copy_`` (graph-safe as it is).

    A ``graph_decode`` step is all decode rows and goes to
    ``paged_decode_attention`` as is (tensors only); so does an eager step of
    decode rows only. A step with ``meta.varlen_work`` (a graphed mixed step,
    its lists stale) goes to ``paged_varlen_attention`` with the metadata's
    tensors. An eager step with prefill chunks builds its work list once
    (``meta.derived``) and takes the same varlen kernel: one launch a layer
    for its decode rows and chunks together.

    ``eager_varlen=False`` runs eager mixed steps the other way, for the
    check tool's comparison (``tools/check_attention_kernels.py``): decode
    rows through the decode kernel, each prefill chunk through SDPA with the
    ``causal_lower_right`` bias over K/V repeated to every query head, which
    keeps SDPA on its fused kernel (a boolean mask with grouped heads takes
    the math path).

    A head_dim the kernels do not take falls back to the reference, with one
    warning, so such a model is slower but still correct.
    """

    def __init__(self, eager_varlen: bool = True) -> None:
        self.eager_varlen = eager_varlen
        self._warned_head_dims: set[int] = set()

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self._kernel_takes(q.shape[-1]):
            return super().attend(q, kv_cache, meta, scale)
        if meta.graph_decode:
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens, scale)
        if meta.varlen_work is not None:
            return paged_varlen_attention(q, kv_cache, meta.block_tables, meta.query_start, meta.context_lens,
                                          meta.varlen_work, scale)
        decode = _kernel_decode_rows(meta)
        if decode is not None and decode[0] is None:  # every row decodes: no gather, no scatter
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens, scale)
        if self.eager_varlen:
            return paged_varlen_attention(q, kv_cache, meta.block_tables, meta.query_start, meta.context_lens,
                                          _eager_varlen_work(meta), scale)
        out = torch.empty_like(q)
        if decode is not None:
            rows, tables, lens = decode
            out[rows] = paged_decode_attention(q[rows], kv_cache, tables, lens, scale)
        self._attend_chunks(q, kv_cache, meta, scale, out)
        return out

    @staticmethod
    def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        group = q.shape[0] // k.shape[0]
        k, v = (t.repeat_interleave(group, dim=0).unsqueeze(0) for t in (k, v))
        bias = causal_lower_right(q.shape[1], k.shape[2])
        return F.scaled_dot_product_attention(q.unsqueeze(0), k, v, attn_mask=bias, scale=scale)[0]

    def warm_up(self, num_heads: int, head_dim: int, kv_cache: torch.Tensor) -> None:
        """Compile the decode and varlen kernels' variants now (module ``warm_up``)."""
        if is_supported_head_dim(head_dim):
            warm_up((1, num_heads, head_dim), kv_cache)

    def _kernel_takes(self, head_dim: int) -> bool:
        if is_supported_head_dim(head_dim):
            return True
        if head_dim not in self._warned_head_dims:
            self._warned_head_dims.add(head_dim)
            log.warning("attention: head_dim %d has no Triton kernel (accepted: powers of two %d..%d); "
                        "using the torch reference", head_dim, MIN_HEAD_DIM, MAX_HEAD_DIM)
        return False


def _kernel_decode_rows(meta: AttentionMetadata):
    """``(rows [B] int64, tables [B, nb] int32, context_lens [B] int32)`` of the
    step's decode rows, None without any, rows None when every row decodes
    (row i = sequence i); built once per step, reused by every layer through
    ``meta.derived``."""
    if "triton_decode" in meta.derived:
        return meta.derived["triton_decode"]
    seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    decode = None
    if len(seqs) == meta.num_seqs:
        decode = (None, meta.block_tables, meta.context_lens)
    elif seqs:
        device = meta.block_tables.device
        starts = meta.query_start_list
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
        # The kernel stops at each context's end, so the full table width is fine.
        decode = (rows, meta.block_tables.index_select(0, index), meta.context_lens.index_select(0, index))
    meta.derived["triton_decode"] = decode
    return decode


def _eager_varlen_work(meta: AttentionMetadata) -> torch.Tensor:
    """An eager step's work list (int32 ``[P, 2]``, ``plan_varlen_work`` of its
    query lengths, unpadded) on the step's device; built once per step, reused
    by every layer through ``meta.derived``."""
    if "triton_varlen" not in meta.derived:
        work = plan_varlen_work(meta.query_lens_list)
        meta.derived["triton_varlen"] = torch.tensor(work, dtype=torch.int32, device=meta.block_tables.device).view(-1, 2)
    return meta.derived["triton_varlen"]
