"""Triton kernels for the LoRA delta (CUDA; see ``ops`` for the meaning).

One launch per targeted linear and step, all shards of a stacked q|k|v or
gate|up in it, rows on any mix of slots (``LoraStack.add_delta_rows``).
Grids follow from shapes only and slots are read on the device, so a CUDA
graph captures a call and replays it with new slots:

- ``bgmv_rows`` (fewer than ``MIN_GEMM_ROWS`` rows: small decode steps,
  and the embedding always): grid (rows, shards x column groups). Each program
  reads its row's slot and returns at once on slot 0 (base rows are left
  bit-identical) or on a module the adapter does not target (scale 0),
  computes the rank-wide intermediate ``t = scale * x[row] @ A[shard,
  slot].T`` in fp32 (a one-row product: elementwise multiply and
  ``tl.sum``), then adds ``t @ B[slot, cols].T`` to its ``TILES`` column
  tiles of ``y[row]``. Every program of a row recomputes the shrink: the
  price of one launch instead of two and of no intermediate buffer;
  ``_pick_tiles`` balances that redundancy against filling the device. The
  embedding's shrink is a gather of ``A[0, slot, :, token]``.
- ``gemm_rows`` (from ``MIN_GEMM_ROWS`` rows: the LM head's decode steps)
  and ``expand_rows`` (a stack fused under its weight, below
  ``MIN_SPLIT_FUSED_ROWS``): the shrink of every slot is a GEMM's columns,
  and the expand one launch, a program a row, or where the grid is wide
  enough tiles of 16 rows, one ``tl.dot`` a slot present (``takes_tiles``).
  No row groups.
- ``shrink_expand_rows`` (from ``MIN_SPLIT_ROWS`` rows: prefill chunks):
  rows grouped by slot on the device
  (``group_rows``) into tiles of one slot, and two launches: the shrink
  once per (tile, shard, K split) into an fp32 scratch, then the expand
  over (tile, column blocks). The tiles are enumerated on the device
  (``_tile_of``) over a grid bounded by shapes (``num_row_tiles``), so few
  programs exit idle.

Every variant any of them can launch (``variant_of`` per row count) is
compiled at startup by ``warm_up``. The module itself is the stacks'
``ops.RowKernels`` on CUDA (``lora_layers.enable_lora`` picks it once per
device); importing it needs Triton, and without it the stacks run
``ops.TORCH_ROWS``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from mstar_actors import triton_launch

if TYPE_CHECKING:
    from mstar_actors.lora.ops import LoraStack

# ``ops.RowKernels``: every step goes by rows here, prefill chunks too (one
# launch a linear, no host-side grouping, shapes-only variants compiled at startup).
uses_rows = True
_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


# ---------------------------------------------------------------- kernels


@triton.jit
def _column_group(offsets_ptr, shard, group, GROUP_COLS: tl.constexpr):
    """(first column, end of the shard) of column group ``group`` of
    ``shard`` in the stacked output: the first is past the end for a
    shorter shard's spare groups, whose programs have nothing to do."""
    return tl.load(offsets_ptr + shard) + group * GROUP_COLS, tl.load(offsets_ptr + shard + 1)


@triton.jit
def _b_tile(b_ptr, stride_bs, stride_bn, slot, first, cols, mask, offs_r, mask_r):
    """``B[slot, first + cols, :]`` of a LoRA stack, ``[BLOCK, BLOCK_R]``, zeros where masked."""
    return tl.load(b_ptr + slot * stride_bs + (first + cols)[:, None].to(tl.int64) * stride_bn + offs_r[None, :],
                   mask=mask[:, None] & mask_r[None, :], other=0.0)


@triton.jit
def _fold_dot(t_ptr, stride_t, rows, lslot, slot, shard, num_shards, offs_r, R, b, scale, F32: tl.constexpr,
              DOT: tl.constexpr):
    """The expand of the tile's rows on adapter ``slot`` for one shard, ``[ROWS, BLOCK]`` float32 (zero on
    the other rows): their shrink ``[ROWS, BLOCK_R]`` (the fused GEMM's A columns) times ``b``
    (``_b_tile``) transposed. ``DOT`` (tiles of ``TILE_ROWS``): one ``tl.dot``, the tensor cores in half
    precision, exact float32 products for a float32 stack; ``gemm_rows``' float32 shrink (``F32`` on a half
    B) in two half dots, its rounding then the rest (the emulated float32 dot took 24.6 against 10.1 us for
    the LM head's expand at 64 rows on the H200), then ``scale`` (so a row's expand may differ in its last
    bit between steps of fewer and of 16 or more rows, as a GEMM's may between batch sizes). On the H200 at
    Qwen3.5-0.8B's gate|up, 64 / 256 rows of one adapter, silu_mul's fold took 2.1 / 3.3 us against 4.1 /
    12.3 as a sum of broadcast products; below 16 rows (one a program, ``triton_fused.fold_rows``) the sum,
    scaled first, took less (1.6 against 1.75 us at 8 rows, 1.8 against 4.6 with 4 adapters)."""
    mine = (lslot == slot) & (lslot != 0)
    t = tl.load(t_ptr + rows[:, None] * stride_t + (slot * num_shards + shard) * R + offs_r[None, :],
                mask=mine[:, None] & (offs_r < R)[None, :], other=0.0)
    if not DOT:  # one row: its shrink as a vector (a sum over the one row is itself), as _plus_expand sums
        return tl.sum(b.to(tl.float32) * (tl.sum(t.to(tl.float32), axis=0) * scale)[None, :], axis=1)[None, :]
    if F32 and b.dtype == tl.float32:
        d = tl.dot(t.to(tl.float32), tl.trans(b), input_precision="ieee")
    elif F32:  # a float32 t on a half B: its high half then the rest, two half dots (16 or 22 bits of t)
        hi = t.to(b.dtype)
        d = tl.dot((t - hi.to(tl.float32)).to(b.dtype), tl.trans(b), acc=tl.dot(hi, tl.trans(b)))
    else:
        d = tl.dot(t, tl.trans(b))
    return d * scale


@triton.jit
def _next_slot(lslot, done):
    """The largest adapter slot among a tile's rows not in ``done`` (0: none left) and ``done`` with it."""
    slot = tl.max(tl.where(done, 0, lslot), axis=0)
    return slot, done | (lslot == slot)


@triton.jit
def _rows_kernel(
    x_ptr, a_ptr, b_ptr, scales_ptr, y_ptr, offsets_ptr, slots_ptr,
    R, NUM_GROUPS,
    stride_xm, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_wl, stride_wn, stride_wr,
    stride_ss, stride_sl,
    stride_ym, stride_yn, stride_slot,
    K: tl.constexpr, IS_EMBEDDING: tl.constexpr, T_GIVEN: tl.constexpr, TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    # K is a compile-time constant (a linear's in_features: a few values per
    # model): the shrink's loop then has a fixed trip count, and Triton's
    # interpreter cannot loop to a runtime bound under NumPy >= 2.4.
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    shard = pid // NUM_GROUPS
    # At decode sizes a program's time is its chain of dependent loads, so
    # every load that does not wait on another is issued before any branch:
    # the slot and the column group together, then its scale (slot 0's is a
    # zero) and the first tile of B, all before ``gdc_wait`` (none is written
    # by a step: ``triton_launch``), then t or x, and y beside the next B.
    slot = tl.load(slots_ptr + row * stride_slot).to(tl.int64)
    n_start, hi = _column_group(offsets_ptr, shard, pid % NUM_GROUPS, TILES * BLOCK_N)
    scale = tl.load(scales_ptr + shard * stride_ss + slot * stride_sl)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = tl.arange(0, BLOCK_N)
    first = n_start + offs_n
    w_first = tl.load(b_ptr + slot * stride_wl + first[:, None].to(tl.int64) * stride_wn + offs_r[None, :] * stride_wr,
                      mask=(first < tl.where(slot != 0, hi, 0))[:, None] & mask_r[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Base rows, and a shorter shard's spare groups (shards narrower than the widest).
    if slot == 0 or n_start >= hi:
        return
    if not T_GIVEN and scale == 0.0:
        # The adapter does not target this module (or shard): its factors are zeros, so its
        # shrink is skipped. A given t is zero there, and the expand adds exactly 0 without waiting.
        return
    a_row = a_ptr + shard * stride_as + slot * stride_al + offs_r * stride_ar
    if IS_EMBEDDING:
        token = tl.load(x_ptr + row * stride_xm).to(tl.int64)
        t = tl.load(a_row + token * stride_ak, mask=mask_r, other=0.0).to(tl.float32)
    elif T_GIVEN:
        # The shrink came with the base GEMM (``expand_rows``): x is its
        # output's A columns, one per row of A, at A's row strides.
        t_cols = shard * stride_as + slot * stride_al + offs_r * stride_ar
        t = tl.load(x_ptr + row * stride_xm + t_cols * stride_xk, mask=mask_r, other=0.0).to(tl.float32)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            xk = tl.load(x_ptr + row * stride_xm + (k0 + offs_k) * stride_xk, mask=mask_k, other=0.0)
            ak = tl.load(a_row[:, None] + (k0 + offs_k)[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            acc += ak.to(tl.float32) * xk.to(tl.float32)[None, :]
        t = tl.sum(acc, axis=1)
    t = t * scale
    for j in tl.static_range(TILES):
        cols = n_start + j * BLOCK_N + offs_n
        mask_n = cols < hi
        y_ptrs = y_ptr + row * stride_ym + cols.to(tl.int64) * stride_yn
        y = tl.load(y_ptrs, mask=mask_n, other=0.0)
        if j == 0:
            w = w_first
        else:
            w = tl.load(
                b_ptr + slot * stride_wl + cols[:, None].to(tl.int64) * stride_wn + offs_r[None, :] * stride_wr,
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )
        delta = tl.sum(w.to(tl.float32) * t[None, :], axis=1)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 off CUDA (the interpreter's tests)."""
    return triton_launch.num_sms(device, 4)


@functools.lru_cache(maxsize=4096)  # pure, and called for every targeted linear of every eager step
def _pick_tiles(num_rows: int, num_shards: int, max_out: int, shrink_cost: int, block_n: int, num_sms: int) -> int:
    """Column tiles per program (a power of two) minimising the estimated time.

    A program costs its shrink (``shrink_cost``, the same for every program
    of a row) plus ``tiles * block_n`` columns of expand, and programs run in
    waves: few wide programs waste the device, many narrow ones repeat the
    shrink. A wave is two programs an SM while the shrink is short (it is
    latency-bound, so two overlap), one when it is long (wider than
    ``_SHORT_SHRINK``: then a program streams enough of A to use its SM's
    bandwidth). Shapes only, so a graph captures the same grid. The check
    tool's tile sweep (``tools/check_lora_kernels.py``) times its neighbours."""
    per_wave = num_sms * (2 if shrink_cost <= _SHORT_SHRINK else 1)
    max_tiles = triton.next_power_of_2(triton.cdiv(max_out, block_n))
    best, best_cost, tiles = 1, None, 1
    while tiles <= max_tiles:
        num_programs = num_rows * num_shards * triton.cdiv(max_out, tiles * block_n)
        cost = triton.cdiv(num_programs, per_wave) * (shrink_cost + tiles * block_n)
        if best_cost is None or cost < best_cost:
            best, best_cost = tiles, cost
        tiles *= 2
    return best


_SHORT_SHRINK = 2048


@functools.lru_cache(maxsize=256)
def _rows_blocks(max_rank: int, k: int, max_out: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_N, num_warps) of ``bgmv_rows``.

    The shrink takes the widest K tile that keeps its fp32 accumulator at
    32K values (128 registers a thread at 8 warps): at 1 to 32 rows the
    kernel is bound by the latency of its dependent loads, so fewer, wider
    loads win (the block sweep of ``tools/check_lora_kernels.py``)."""
    block_r = max(4, triton.next_power_of_2(max_rank))
    block_k = min(max(32, 32768 // block_r), 2048, triton.next_power_of_2(k))
    block_n = min(max(32, 4096 // block_r), triton.next_power_of_2(max_out))
    return block_r, block_k, block_n, 8


def bgmv_rows(stack: LoraStack, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, *, tiles: int | None = None,
              blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y[row] += the delta of ``row_slots[row]``'s adapter, every shard, one launch, in place.

    ``tiles`` (a power of two) overrides ``_pick_tiles``, and ``blocks``
    ``(BLOCK_K, BLOCK_N, num_warps)`` overrides ``_rows_blocks``: for tests
    and tile sweeps."""
    num_shards, _, max_rank, k = stack.a.shape
    num_rows, max_out = y.shape[0], max(stack.output_sizes)
    if not stack.is_embedding and x.dtype != stack.a.dtype:
        raise TypeError(f"LoRA rows delta: x is {x.dtype} and A is {stack.a.dtype}; accepted: the same dtype")
    block_r, block_k, block_n, num_warps = _rows_blocks(max_rank, k, max_out)
    if blocks is not None:
        block_k, block_n, num_warps = blocks
    shrink_cost = max_rank if stack.is_embedding else k
    tiles = tiles or _pick_tiles(num_rows, num_shards, max_out, shrink_cost, block_n, _num_sms(y.device))
    num_groups = triton.cdiv(max_out, tiles * block_n)
    a, b, scales = stack.a, stack.b, stack.scales
    x_stride_k = 0 if stack.is_embedding else x.stride(1)
    _rows_kernel[(num_rows, num_shards * num_groups)](
        x, a, b, scales, y, stack.offsets_on(y.device), row_slots,
        max_rank, num_groups,
        x.stride(0), x_stride_k,
        a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        b.stride(0), b.stride(1), b.stride(2),
        scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1), row_slots.stride(0),
        K=k, IS_EMBEDDING=stack.is_embedding, T_GIVEN=False, TILES=tiles,
        BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=num_warps, **triton_launch.options(y),
    )  # fmt: skip
    return y


def expand_rows(stack: LoraStack, y: torch.Tensor, t: torch.Tensor, row_slots: torch.Tensor, *,
                tiles: int | None = None, num_warps: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """y[row] += scale * t[row, its slot's columns] @ B[slot].T, every shard,
    one launch, in place: the rows delta of a fused stack (``LoraStack.fuse_under``),
    whose base GEMM wrote ``t = x @ A.T`` for every shard and slot beside
    ``y`` (t's column ``(slot * num_shards + shard) * max_rank + r`` is A's
    row ``[shard, slot, r]``; the columns of the step's slots' span, ``LoraStack.check_shrink``), or of a stack whose shrink was a GEMM of its
    own (``gemm_rows``: ``t`` in float32, which the tiles then take to
    within 2^-16 of itself, relatively).

    ``bgmv_rows`` without its shrink (the same programs, the same early
    exits: base rows, untargeted shards; the same column tiles, B read once
    a row), or where it pays (``takes_tiles``) tiles of ``TILE_ROWS`` rows
    (``_tiles_kernel``): B read once a tile and slot, the products on the
    tensor cores (a row's last bit may then differ between steps on either
    side of the line, as a GEMM's does between batch sizes).
    ``tiles`` / ``num_warps`` (rows) and ``block_n`` (tiles) override the
    defaults, for sweeps."""
    num_shards, _, max_rank, k = stack.a.shape
    num_rows, max_out = y.shape[0], max(stack.output_sizes)
    stack.check_shrink(t, num_rows)
    b, scales = stack.b, stack.scales
    if t.dtype in (b.dtype, torch.float32) and t.stride(1) == 1 and takes_tiles(stack, num_rows, _num_sms(y.device)):
        return _expand_tiles(stack, y, t, row_slots, block_n)
    block_r, _, cols, warps = _rows_blocks(max_rank, k, max_out)
    tiles = tiles or _pick_tiles(num_rows, num_shards, max_out, max_rank, cols, _num_sms(y.device))
    num_groups = triton.cdiv(max_out, tiles * cols)
    _rows_kernel[(num_rows, num_shards * num_groups)](
        t, stack.a, b, scales, y, stack.offsets_on(y.device), row_slots,
        max_rank, num_groups,
        t.stride(0), t.stride(1),
        max_rank, num_shards * max_rank, 1, 0,
        b.stride(0), b.stride(1), b.stride(2),
        scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1), row_slots.stride(0),
        K=max_rank, IS_EMBEDDING=False, T_GIVEN=True, TILES=tiles,
        BLOCK_N=cols, BLOCK_R=block_r, BLOCK_K=block_r,
        num_warps=num_warps or warps, **triton_launch.options(y),
    )  # fmt: skip
    return y


# ---------------------------------------------------------------- tiles of rows, slots read in the tile

# ``tl.dot``'s least M: a tile's rows, each program's.
TILE_ROWS = 16
# ``expand_rows`` takes tiles of rows from this many rows, where the tiles
# make at least ``MIN_TILE_PROGRAMS_PER_SM`` programs of 64 columns an SM:
# a per-row program reads B once a row, a tile's once a slot present in it,
# but few tiles leave the device idle and each slot of a tile costs a dot in
# turn. The H200, Qwen3.5-0.8B's widths, rank 16, us an expand and the op
# after it (``tools/check_lora_kernels.py --fold-table``: ``split`` tiles,
# ``s.rows`` per row): in_proj (8,224 columns) at 64 / 256 rows 9.3 / 29.9
# against 12.0 / 37.0 (4 adapters mixed 10.8 / 34.5 against 12.1 / 37.1), at
# 16 / 32 rows 4.9 / 6.9 against 4.7 / 7.3 (mixed 6.7 / 9.2 against 4.7 /
# 7.4); a 1,024-column output 2.8 against 2.4 at 64 rows, 3.3 against 4.4 at
# 256. The LM head's 128,256 columns at 16 rows: 12.6 against 24.4 (``--rows-table``).
MIN_TILE_ROWS = 16
MIN_TILE_PROGRAMS_PER_SM = 3


def takes_tiles(stack: LoraStack, num_rows: int, num_sms: int) -> bool:
    """Whether ``expand_rows`` takes tiles of rows for ``stack`` at ``num_rows`` (shapes only)."""
    if num_rows < MIN_TILE_ROWS or stack.b.dtype not in _DOT_DTYPES:
        return False
    programs = triton.cdiv(num_rows, TILE_ROWS) * sum(triton.cdiv(n, 64) for n in stack.output_sizes)
    return programs >= MIN_TILE_PROGRAMS_PER_SM * num_sms


@triton.jit(do_not_specialize=["M"])  # any row count one variant: warm_up compiles each at one count
def _tiles_kernel(
    t_ptr, b_ptr, scales_ptr, y_ptr, offsets_ptr, slots_ptr,
    M, R, NUM_SHARDS, NUM_GROUPS,
    stride_tm, stride_wl, stride_wn, stride_ss, stride_sl, stride_ym, stride_yn,
    F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """y[rows, cols] += each row's own slot's expand, for a tile of
    ``BLOCK_M`` rows and ``BLOCK_N`` columns of one shard: one ``tl.dot``
    a slot present in the tile (``_next_slot``, largest first), each adding
    zeros on the rows of other slots. Rows on slot 0, or on an adapter that
    does not target the shard (scale 0), are not written. Grid (row tiles,
    shards x column groups)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = rows < M
    pid = tl.program_id(1)
    shard = pid // NUM_GROUPS
    n_start, hi = _column_group(offsets_ptr, shard, pid % NUM_GROUPS, BLOCK_N)
    cols = n_start + tl.arange(0, BLOCK_N)
    mask_n = cols < hi
    offs_r = tl.arange(0, BLOCK_R)
    # Everything the step's kernels do not write, before the wait (``triton_launch``): the slots, the
    # first slot's scale and B.
    lslot = tl.load(slots_ptr + rows, mask=ok, other=0).to(tl.int64)
    slot, done = _next_slot(lslot, lslot == 0)
    scale = tl.load(scales_ptr + shard * stride_ss + slot * stride_sl)
    b = _b_tile(b_ptr, stride_wl, stride_wn, slot, 0, cols, mask_n, offs_r, offs_r < tl.where(slot != 0, R, 0))
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if slot == 0 or n_start >= hi:  # a tile of base rows, or a shorter shard's spare group
        return
    live = scale != 0.0  # some slot of the tile's rows targets the shard (an adapter on every linear and not
    other, others = _next_slot(lslot, done)  # the LM head: the head's tiles all leave, y unread)
    while other != 0:
        live = live | (tl.load(scales_ptr + shard * stride_ss + other * stride_sl) != 0.0)
        other, others = _next_slot(lslot, others)
    if not live:
        return
    # y beside the first slot's t (both wait on the step's kernels), so the tile pays one round trip for
    # them; the next slot's scale and B only where there is one.
    tile = ok[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    y = tl.load(y_ptrs, mask=tile, other=0.0)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    touched = lslot < 0
    while slot != 0:
        delta += _fold_dot(t_ptr, stride_tm, rows, lslot, slot, shard, NUM_SHARDS, offs_r, R, b, scale, F32, True)
        if scale != 0.0:  # else the adapter leaves this shard alone: its rows are not written
            touched = touched | (lslot == slot)
        slot, done = _next_slot(lslot, done)
        if slot != 0:
            scale = tl.load(scales_ptr + shard * stride_ss + slot * stride_sl)
            b = _b_tile(b_ptr, stride_wl, stride_wn, slot, 0, cols, mask_n, offs_r, offs_r < R)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=tile & touched[:, None])


@functools.lru_cache(maxsize=4096)
def _tile_cols(num_rows: int, num_shards: int, max_out: int, num_sms: int) -> int:
    """Columns a program of ``_tiles_kernel``: 128 where that still gives every SM two programs, else 64."""
    programs = triton.cdiv(num_rows, TILE_ROWS) * num_shards * triton.cdiv(max_out, 128)
    return 128 if programs >= 2 * num_sms else 64


def _expand_tiles(stack: LoraStack, y: torch.Tensor, t: torch.Tensor, row_slots: torch.Tensor,
                  block_n: int | None = None) -> torch.Tensor:
    num_shards, _, max_rank, _ = stack.a.shape
    num_rows, max_out = y.shape[0], max(stack.output_sizes)
    block_n = block_n or _tile_cols(num_rows, num_shards, max_out, _num_sms(y.device))
    num_groups = triton.cdiv(max_out, block_n)
    b, scales = stack.b, stack.scales
    _tiles_kernel[(triton.cdiv(num_rows, TILE_ROWS), num_shards * num_groups)](
        t, b, scales, y, stack.offsets_on(y.device), row_slots,
        num_rows, max_rank, num_shards, num_groups,
        t.stride(0), b.stride(0), b.stride(1), scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
        F32=torch.float32 in (b.dtype, t.dtype), BLOCK_M=TILE_ROWS, BLOCK_N=block_n, BLOCK_R=_block_r(max_rank),
        num_warps=4, **triton_launch.options(y),
    )  # fmt: skip
    return y


def gemm_rows(stack: LoraStack, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """The rows delta of a stack not fused under its weight (the LM head's)
    as a fused one's: the shrink of every shard and slot in one GEMM
    (``t = x @ A.T``, A's rows in t's columns as ``fuse_under`` lays them: slot by slot),
    then ``expand_rows``. No row groups: from ``MIN_GEMM_ROWS`` rows, where
    ``bgmv_rows`` would recompute the shrink in every program of a row."""
    num_shards, num_slots, max_rank, k = stack.a.shape
    if x.dtype != stack.a.dtype:
        raise TypeError(f"LoRA rows delta: x is {x.dtype} and A is {stack.a.dtype}; accepted: the same dtype")
    # In float32, as bgmv_rows keeps a row's shrink: rounded to the dtype it would change the row's
    # logits between steps on either side of MIN_GEMM_ROWS (a graph's padded bucket and the eager step).
    a = stack.a.transpose(0, 1).reshape(num_slots * num_shards * max_rank, k)
    t = torch.mm(x, a.T, out_dtype=torch.float32) if x.is_cuda else torch.mm(x.float(), a.float().T)
    return expand_rows(stack, y, t, row_slots)


def group_rows(row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, counts, starts), int32 on the slots' device: ``order[starts[s] :
    starts[s] + counts[s]]`` are the rows on slot ``s``, in row order.

    Elementwise ops, cumsums and a scatter over fixed shapes: no host sync, so
    a graph captures it (a sort would do, but this is plainly capturable)."""
    slots = row_slots.long()
    onehot = slots[:, None] == torch.arange(num_slots, device=slots.device)[None, :]  # [T, num_slots]
    rank_in_slot = (onehot.cumsum(0, dtype=torch.int32) - 1).gather(1, slots[:, None]).squeeze(1)
    counts = onehot.sum(0, dtype=torch.int32)
    starts = counts.cumsum(0, dtype=torch.int32) - counts
    order = torch.empty_like(row_slots, dtype=torch.int32)
    order.scatter_(0, (starts.long()[slots] + rank_in_slot), torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device))
    return order, counts, starts



# ---------------------------------------------------------------- shrink, then expand


@triton.jit
def _tile_of(counts_ptr, starts_ptr, pid_m, NUM_SLOTS, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(slot, first position in ``order``, rows) of row tile ``pid_m`` in
    the step's list of tiles: each adapter slot's rows cut into tiles of
    ``BLOCK_M``, slots in order. Past the last tile the slot's rows are 0."""
    offs_s = tl.arange(0, BLOCK_S)
    on_slot = offs_s + 1 < NUM_SLOTS  # adapter slots 1.. (slot 0's rows are base rows: no tiles)
    counts = tl.load(counts_ptr + 1 + offs_s, mask=on_slot, other=0)
    starts = tl.load(starts_ptr + 1 + offs_s, mask=on_slot, other=0)
    num_tiles = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(num_tiles, axis=0)
    index = tl.sum((ends <= pid_m).to(tl.int32))  # slots whose tiles all come before this one
    is_mine = offs_s == index
    first_tile = tl.sum(tl.where(is_mine, ends - num_tiles, 0))
    in_slot = (pid_m - first_tile) * BLOCK_M  # this tile's first row among its slot's
    start = tl.sum(tl.where(is_mine, starts, 0)) + in_slot
    num_rows = tl.sum(tl.where(is_mine, counts, 0)) - in_slot
    return index + 1, start, num_rows


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, scales_ptr, t_ptr, order_ptr, counts_ptr, starts_ptr,
    R, NUM_SLOTS,
    stride_xm, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_ss, stride_sl,
    stride_tk, stride_ts, stride_tm,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    if GDC:  # the step's groups are read below, written by a step's kernels (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # t[split, shard, p] = scale * x[order[p]] @ A[shard, slot, :, this split's K].T,
    # for the rows p of one tile on one slot (positions in ``order``, so a
    # tile's rows are contiguous in t). Grid (row tiles, shards, K splits).
    slot, start, num_rows = _tile_of(counts_ptr, starts_ptr, tl.program_id(0), NUM_SLOTS, BLOCK_M, BLOCK_S)
    if num_rows <= 0:  # past the step's last tile
        return
    shard = tl.program_id(1)
    scale = tl.load(scales_ptr + shard * stride_ss + slot.to(tl.int64) * stride_sl)
    if scale == 0.0:  # the adapter does not target this shard; the expand skips it too
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_rows
    rows = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = tl.program_id(2) * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + shard * stride_as + slot.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        mask_k = (offs_k + k0) < K
        xt = tl.load(x_ptrs + k0 * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptrs + k0 * stride_ak, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    t_ptrs = t_ptr + tl.program_id(2) * stride_tk + shard * stride_ts + (start + offs_m)[:, None] * stride_tm + offs_r[None, :]
    tl.store(t_ptrs, acc * scale, mask=mask_m[:, None])


@triton.jit
def _expand_kernel(
    b_ptr, scales_ptr, t_ptr, y_ptr, offsets_ptr, order_ptr, counts_ptr, starts_ptr,
    R, NUM_SLOTS, NUM_GROUPS,
    stride_wl, stride_wn, stride_wr,
    stride_ss, stride_sl,
    stride_tk, stride_ts, stride_tm,
    stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    if GDC:  # the step's groups are read below, written by a step's kernels (``triton_launch``)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # y[order[p], cols] += sum over splits of t[split, shard, p] @ B[slot, cols].T
    # for one tile's rows and TILES column blocks of one shard. Grid (row
    # tiles, shards x column groups): the same tiles as the shrink's.
    slot, start, num_rows = _tile_of(counts_ptr, starts_ptr, tl.program_id(0), NUM_SLOTS, BLOCK_M, BLOCK_S)
    if num_rows <= 0:
        return
    pid = tl.program_id(1)
    shard = pid // NUM_GROUPS
    slot64 = slot.to(tl.int64)
    if tl.load(scales_ptr + shard * stride_ss + slot64 * stride_sl) == 0.0:  # untargeted: no t was written
        return
    n_start, hi = _column_group(offsets_ptr, shard, pid % NUM_GROUPS, TILES * BLOCK_N)
    if n_start >= hi:  # a shorter shard than the widest: its spare groups
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_rows
    rows = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    t_ptrs = t_ptr + shard * stride_ts + (start + offs_m)[:, None] * stride_tm + offs_r[None, :]
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(SPLIT_K):
        t += tl.load(t_ptrs + split * stride_tk, mask=mask_m[:, None], other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    for j in range(TILES):
        cols = n_start + j * BLOCK_N + offs_n
        mask_n = cols < hi
        w = tl.load(
            b_ptr + slot64 * stride_wl + cols[None, :].to(tl.int64) * stride_wn + offs_r[:, None] * stride_wr,
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        # As Punica does: t rounded to the weights' dtype for the tensor-core
        # dot; the sum stays fp32.
        delta = tl.dot(t.to(w.dtype), w, input_precision=PRECISION)
        mask = mask_m[:, None] & mask_n[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def num_row_tiles(num_rows: int, num_slots: int, block_m: int) -> int:
    """An upper bound, from shapes only, on the row tiles of a step: tiling
    each slot's rows apart costs at most one partial tile per adapter slot
    present beyond the ``cdiv(num_rows, block_m)`` of one slot."""
    return triton.cdiv(num_rows, block_m) + min(num_slots - 1, num_rows) - 1


@functools.lru_cache(maxsize=4096)
def _split_blocks(num_rows: int, num_shards: int, k: int, max_out: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_K, SPLIT_K, BLOCK_N, TILES) of ``shrink_expand_rows``.

    16-row tiles (``tl.dot``'s least M) up to 255 rows, 64 from there
    (prefill chunks). K is split while the shrink has fewer programs than
    SMs (counting the tiles of a one-adapter step, the fewest) and each
    split keeps two K tiles: at 32 rows q|k|v has 6 tiles x shards, and
    one 2,048-long loop each would leave the device idle. The expand moves
    ``y`` and B once; 128 columns a program gives thousands of short
    programs only at prefill sizes. Not yet tuned on a device: the check
    tool's ``--rows-table`` times the neighbours of this choice."""
    block_m = 16 if num_rows < 256 else 64
    block_k = max(16, min(256 if block_m == 16 else 128, triton.next_power_of_2(k)))  # tl.dot: every dim >= 16
    num_tiles, split_k = triton.cdiv(num_rows, block_m), 1
    while split_k * 2 * block_k <= k and num_tiles * num_shards * split_k * 2 <= num_sms:
        split_k *= 2
    return block_m, block_k, split_k, max(16, min(128, triton.next_power_of_2(max_out))), 1


def shrink_expand_rows(
    stack: LoraStack, y: torch.Tensor, x: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
    blocks: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """The rows delta in two launches over the step's row tiles (rows grouped
    by slot, ``group_rows``): a shrink writing ``t = scale * x @ A.T`` once
    per (tile, shard, K split), fp32, then an expand adding ``t @ B.T`` to
    every column block of ``y``, in place. ``bgmv_rows`` recomputes a row's
    shrink in each of its programs; here it is done once, for the price of a second launch
    and a ``[SPLIT_K, shards, rows, BLOCK_R]`` fp32 scratch (made per call;
    inside a CUDA graph, from the graph's pool). Grids from shapes; base
    rows and untargeted shards are never written. ``blocks`` overrides
    ``_split_blocks``, for tests and sweeps."""
    num_shards, num_slots, max_rank, k = stack.a.shape
    num_rows, max_out = y.shape[0], max(stack.output_sizes)
    if x.dtype != stack.a.dtype or x.dtype not in _DOT_DTYPES:
        raise TypeError(f"LoRA rows delta: x is {x.dtype} and A is {stack.a.dtype}; accepted: the same dtype of {_DOT_DTYPES}")
    order, counts, starts = groups
    block_m, block_k, split_k, block_n, tiles = blocks or _split_blocks(num_rows, num_shards, k, max_out, _num_sms(y.device))
    block_r, block_s = _block_r(max_rank), max(2, triton.next_power_of_2(num_slots - 1))
    num_m = num_row_tiles(num_rows, num_slots, block_m)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    t = torch.empty(split_k, num_shards, num_rows, block_r, dtype=torch.float32, device=y.device)
    a, b, scales = stack.a, stack.b, stack.scales
    precision = _precision(a.dtype)
    _shrink_kernel[(num_m, num_shards, split_k)](
        x, a, scales, t, order, counts, starts,
        max_rank, num_slots,
        x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        scales.stride(0), scales.stride(1),
        t.stride(0), t.stride(1), t.stride(2),
        K=k, K_PER_SPLIT=k_per_split,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_S=block_s,
        PRECISION=precision, num_warps=4, **triton_launch.options(y),
    )  # fmt: skip
    num_groups = triton.cdiv(max_out, tiles * block_n)
    _expand_kernel[(num_m, num_shards * num_groups)](
        b, scales, t, y, stack.offsets_on(y.device), order, counts, starts,
        max_rank, num_slots, num_groups,
        b.stride(0), b.stride(1), b.stride(2),
        scales.stride(0), scales.stride(1),
        t.stride(0), t.stride(1), t.stride(2),
        y.stride(0), y.stride(1),
        SPLIT_K=split_k, TILES=tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_S=block_s,
        PRECISION=precision, num_warps=4, **triton_launch.options(y),
    )  # fmt: skip
    return y

# A fused stack's steps of fewer rows take the fused GEMM and one expand
# (folded into the next kernel where it takes it) instead, so every decode
# bucket up to 256 rows (``max_num_seqs``' default on CUDA): at 256 rows, one
# adapter, that step took 2.25 against 2.71 ms on the H200 on the 1B shape,
# 5.00 against 5.30 on Qwen3.5's, than the grouped kernels beside the GEMM
# (``tools/profile_gpu_step.py --split-rows 256 512``). Larger steps (prefill
# chunks) keep the grouped kernels, which read B once a slot, not a row.
MIN_SPLIT_FUSED_ROWS = 257
# A stack not fused under a weight (the LM head's; CUDA fuses every decoder
# linear's) takes the grouped kernels (``shrink_expand_rows``) from as many
# rows, and below them from ``MIN_GEMM_ROWS`` its shrink as one GEMM of its
# own then the expand (``gemm_rows``), as a fused stack's: grouping the rows
# by slot alone took ~20 us of small launches a step, more than the two
# kernels after it. Below ``MIN_GEMM_ROWS``, ``bgmv_rows``' one launch (the
# H200, an LM head of 128,256 columns, one adapter, us a call, ``bgmv`` /
# ``gemm+x`` in ``tools/check_lora_kernels.py --rows-table``: 10.5 / 13.0 at
# 8 rows, 17.7 / 13.0 at 16, 57.9 / 27.5 at 64, measured with the shrink in
# the activations' dtype; in float32, straight out of cuBLAS, the served
# step took the same: ``profile_gpu_step.py --batches 16 64 256``).
MIN_SPLIT_ROWS = MIN_SPLIT_FUSED_ROWS
MIN_GEMM_ROWS = 16


def kernel_for(num_rows: int) -> str:
    """The kernel a linear's step of ``num_rows`` rows takes: "bgmv"
    (``bgmv_rows``), "gemm" (``gemm_rows``) or "split"
    (``shrink_expand_rows``). A function of the shape alone, so a captured
    graph keeps its choice."""
    if num_rows >= MIN_SPLIT_ROWS:
        return "split"
    return "gemm" if num_rows >= MIN_GEMM_ROWS else "bgmv"


def needs_row_groups(num_rows: int) -> bool:
    """Whether a batch of ``num_rows`` takes the grouped kernels (``group_rows``' groups)."""
    return kernel_for(num_rows) == "split"


def uses_fused_rows(num_rows: int) -> bool:
    """Whether a fused stack's batch of ``num_rows`` takes the fused GEMM and ``expand_rows``."""
    return num_rows < MIN_SPLIT_FUSED_ROWS


def rows_delta(stack: LoraStack, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, groups=None) -> torch.Tensor:
    """The rows delta by the kernel that suits the batch's size (a shape, so graph-safe).

    ``groups``: ``group_rows(row_slots, ...)`` computed once per step by the
    caller (None: computed here when needed)."""
    kernel = "bgmv" if stack.is_embedding else kernel_for(y.shape[0])
    if kernel == "bgmv":
        return bgmv_rows(stack, y, x, row_slots)
    if kernel == "gemm":
        return gemm_rows(stack, y, x, row_slots)
    groups = groups if groups is not None else group_rows(row_slots, stack.num_slots)
    return shrink_expand_rows(stack, y, x, groups)


def warm_up(stack: LoraStack, max_num_rows: int) -> None:
    """Launch once every kernel variant ``rows_delta`` can pick for ``stack``
    at 1 to ``max_num_rows`` rows, so each compiles now (about a second
    each) rather than in the middle of serving. The variants differ in
    their compile-time block choices, functions of the row count
    (``variant_of``): one launch per distinct one, on zero slots (every
    program returns at once; nothing is written)."""
    device = stack.a.device
    for num_rows in _variant_row_counts(stack, max_num_rows, _num_sms(device)):
        if stack.is_embedding:
            x = torch.zeros(num_rows, dtype=torch.long, device=device)
        else:
            x = torch.zeros(num_rows, stack.in_features, dtype=stack.a.dtype, device=device)
        y = torch.zeros(num_rows, stack.offsets[-1], dtype=stack.a.dtype, device=device)
        rows_delta(stack, y, x, torch.zeros(num_rows, dtype=torch.int32, device=device))
    if stack.fused:
        num_t = stack.a.numel() // stack.in_features
        for num_rows in _expand_row_counts(stack, max_num_rows, _num_sms(device)):
            y = torch.zeros(num_rows, stack.offsets[-1], dtype=stack.a.dtype, device=device)
            t = torch.zeros(num_rows, num_t, dtype=stack.a.dtype, device=device)
            expand_rows(stack, y, t, torch.zeros(num_rows, dtype=torch.int32, device=device))


def expand_variant_of(stack: LoraStack, num_rows: int, num_sms: int) -> tuple:
    """The compiled variant ``expand_rows`` launches at ``num_rows`` rows (of
    the stack's dtype): its kernel and column tiles or columns."""
    num_shards, _, max_rank, k = stack.a.shape
    max_out = max(stack.output_sizes)
    if takes_tiles(stack, num_rows, num_sms):
        return "tiles", _tile_cols(num_rows, num_shards, max_out, num_sms)
    return "rows", _pick_tiles(num_rows, num_shards, max_out, max_rank, _rows_blocks(max_rank, k, max_out)[2], num_sms)


def _expand_row_counts(stack: LoraStack, max_num_rows: int, num_sms: int) -> list[int]:
    """The smallest row count of each distinct ``expand_variant_of`` a fused stack takes (``fuses_rows``)."""
    seen: dict[tuple, int] = {}
    for num_rows in range(1, max_num_rows + 1):
        if uses_fused_rows(num_rows):
            seen.setdefault(expand_variant_of(stack, num_rows, num_sms), num_rows)
    return sorted(seen.values())


def variant_of(stack: LoraStack, num_rows: int, num_sms: int) -> tuple:
    """The compiled variant ``rows_delta`` launches for ``stack`` at
    ``num_rows`` rows: the kernel and the block choices that are constexprs."""
    num_shards, _, max_rank, k = stack.a.shape
    max_out = max(stack.output_sizes)
    kernel = "bgmv" if stack.is_embedding else kernel_for(num_rows)
    if kernel == "bgmv":
        block_n = _rows_blocks(max_rank, k, max_out)[2]
        return kernel, _pick_tiles(num_rows, num_shards, max_out, max_rank if stack.is_embedding else k, block_n, num_sms)
    if kernel == "gemm":
        return kernel, *expand_variant_of(stack, num_rows, num_sms)
    return kernel, *_split_blocks(num_rows, num_shards, k, max_out, num_sms)


def _variant_row_counts(stack: LoraStack, max_num_rows: int, num_sms: int) -> list[int]:
    """The smallest row count of each distinct ``variant_of`` at 1 to ``max_num_rows`` rows (of those a
    fused stack takes ``rows_delta`` at: from ``MIN_SPLIT_FUSED_ROWS``)."""
    seen: dict[tuple, int] = {}
    for num_rows in range(1, max_num_rows + 1):
        if stack.fused and uses_fused_rows(num_rows):
            continue
        seen.setdefault(variant_of(stack, num_rows, num_sms), num_rows)
    return sorted(seen.values())


# ---------------------------------------------------------------- swaps

# A program copies a chunk of at most COPY_CHUNK 2-byte units (32 KB), in blocks of _COPY_BLOCK.
COPY_CHUNK = 16384
_COPY_BLOCK = 2048


@triton.jit
def _copy_chunks_kernel(table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``i`` copies row ``i`` of the table: ``count`` 2-byte units
    from byte address ``src`` to byte address ``dst``."""
    i = tl.program_id(0).to(tl.int64)
    src = tl.load(table_ptr + 3 * i).to(tl.pointer_type(tl.int16))
    dst = tl.load(table_ptr + 3 * i + 1).to(tl.pointer_type(tl.int16))
    count = tl.load(table_ptr + 3 * i + 2)
    for start in tl.static_range(0, CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def piece_copies(dst, src):
    """``ops.RowKernels.piece_copies``: every piece in one launch, from a
    table of (source, destination, count) chunks built here once, on the
    caller's stream when run. A swap back in copies several hundred pieces
    (each stack's slot: A a shard, B, the scales: 546 for a Qwen3.5-0.8B
    adapter) and took 1.0 ms of the worker's time on the H200, inline
    between two steps; ``_foreach_copy_`` works a piece at a time on the
    host (0.7 ms for the same pieces of CPU tensors), a launch once. Pieces of any
    dtype whose bytes are even (2-byte units: fp32 scales and bf16 factors
    alike); the pieces must outlive the call (it holds them)."""
    rows = []
    for d, s in zip(dst, src, strict=True):
        if not (d.is_contiguous() and s.is_contiguous()) or d.nbytes != s.nbytes or d.device != s.device:
            raise ValueError(f"piece copies take dense pieces of equal bytes on one device; got {tuple(d.shape)} "
                             f"{d.dtype} on {d.device} from {tuple(s.shape)} {s.dtype} on {s.device}")
        if d.nbytes % 2:
            raise ValueError(f"piece copies move 2-byte units; a piece of {d.nbytes} bytes ({d.dtype}) has an odd count")
        units = d.nbytes // 2
        rows += [(s.data_ptr() + 2 * at, d.data_ptr() + 2 * at, min(COPY_CHUNK, units - at))
                 for at in range(0, units, COPY_CHUNK)]
    if not rows:
        return lambda: None
    table = torch.tensor(rows, dtype=torch.int64, device=dst[0].device)
    pieces = (list(dst), list(src))  # the addresses in the table are theirs

    def run() -> None:
        _copy_chunks_kernel[(len(rows),)](table, CHUNK=COPY_CHUNK, BLOCK=_COPY_BLOCK)

    run.pieces = pieces
    return run
