"""The batched LoRA delta of one targeted linear, for a batch mixing adapters.

For every row ``t`` on slot ``s``::

    y[t, off_i : off_i + out_i] += scale[i, s] * (x[t] @ A[i, s].T) @ B[s, off_i : off_i + out_i].T

over every shard ``i`` of a fused linear (``qkv_proj`` = q|k|v: three A's,
one B whose out rows are the three B's concatenated at ``offsets``). A plain
linear is the one-shard case. Weights of every slot are stacked on the device
(``LoraStack``), zero-padded to ``max_rank``; slot 0 stays zero (base rows).

Two ways to name each row's slot, one meaning:

- Segments (Punica's SGMV layout): ``build_segments`` sorts a step's per-row
  slots once on the host and drops slot-0 rows. A segment ``j`` covers rows
  ``row_index[seg_starts[j] : seg_starts[j] + seg_lens[j]]`` (``row_index``
  None: rows are already grouped, positions are rows).
  ``LoraStack.add_delta`` runs the torch reference over them (``*_ref``, fp32
  math): the CPU path, and CUDA without Triton.
- A one-hot over the slots (``DenseRows``, ``build_dense_rows``): the CPU's
  path for decode-sized steps. Every slot's shrink is one GEMM, each row
  keeps its own slot's columns, and every slot's expand is one GEMM per
  shard whose other slots add exact zeros: a fixed handful of ops per
  linear whatever the adapter mix, where segments cost a gather, GEMMs and
  a scatter per adapter present (the CPU section of the LoRA serving
  benchmark, docs/benchmarks.md). Rows on a single adapter take that slot's block of
  operands laid out at install (``DenseFactors``, ``delta_one_slot``): one
  GEMM, a scaling and one GEMM.
- Per-row slots (``LoraStack.add_delta_rows``): a device tensor
  ``row_slots`` [T] (int32, 0 = base). Nothing about it is read on the host,
  the work's shape depends only on tensor shapes, and slot 0's factors are
  zero, so the call can be captured once in a CUDA graph and replayed with
  other slots written into the same tensor; base rows come out bit-identical
  to ``y``. The stack runs it by its ``RowKernels``, chosen once where the
  stacks are built (``lora_layers.enable_lora``): the Triton kernels of
  ``triton_ops`` on CUDA (every step takes them there, prefill too), else
  ``TORCH_ROWS``, the torch reference. This module never imports Triton.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from mstar_actors.lora.adapter_file import LoraModule

ZERO_SLOT = 0


def refuse_zero_slot(slot: int, what: str) -> None:
    """Raise unless ``slot`` is an adapter's: slot 0 is the zero adapter, written by nothing (a fused
    stack's slot 0 of A is its weight's last rows, ``LoraStack.fuse_under``)."""
    if slot == ZERO_SLOT:
        raise ValueError(f"slot 0 is the zero adapter and is never {what}; accepted: slots 1 and up")


# ---------------------------------------------------------------- segments


@dataclass(frozen=True)
class LoraSegments:
    """One step's rows grouped by slot, as host tuples (the reference's input)."""

    num_rows: int
    seg_starts: tuple[int, ...]
    seg_lens: tuple[int, ...]
    seg_slots: tuple[int, ...]
    row_index: tuple[int, ...] | None  # None: segment positions are row numbers

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots)

    def rows(self, j: int) -> list[int] | slice:
        start, end = self.seg_starts[j], self.seg_starts[j] + self.seg_lens[j]
        return slice(start, end) if self.row_index is None else list(self.row_index[start:end])


def build_segments(token_slots: Sequence[int] | torch.Tensor) -> LoraSegments:
    """Group a step's rows by slot; rows on slot 0 (base) are left out. One
    segment per distinct adapter slot, rows gathered through ``row_index``
    (stable, so each request's rows stay in order; None where the adapter
    rows already lie in slot order, back to back)."""
    slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
    if any(s < 0 for s in slots):
        raise ValueError(f"token slots must be >= 0 (0 = base); got {min(slots)}")
    order = sorted((i for i, s in enumerate(slots) if s != ZERO_SLOT), key=lambda i: slots[i])
    is_identity = order == list(range(order[0], order[0] + len(order))) if order else True
    return _runs(slots, order, with_index=not is_identity)


def _runs(slots: list[int], order: list[int], *, with_index: bool) -> LoraSegments:
    starts, lens, seg_slots = [], [], []
    for pos, row in enumerate(order):
        slot = slots[row]
        if seg_slots and seg_slots[-1] == slot and starts[-1] + lens[-1] == pos:
            lens[-1] += 1
        else:
            starts.append(pos)
            lens.append(1)
            seg_slots.append(slot)
    # Without an index, segment positions are row numbers; drop the base runs.
    keep = [j for j, s in enumerate(seg_slots) if s != ZERO_SLOT]
    if not with_index and order:
        starts = [order[starts[j]] for j in range(len(starts))]
    return LoraSegments(
        num_rows=len(slots),
        seg_starts=tuple(starts[j] for j in keep),
        seg_lens=tuple(lens[j] for j in keep),
        seg_slots=tuple(seg_slots[j] for j in keep),
        row_index=tuple(order) if with_index else None,
    )


@dataclass(frozen=True)
class DenseRows:
    """A step's rows as a one-hot over the slots: ``slots`` [T] int64 (0 =
    base), ``onehot`` [T, num_slots] float32 (1 at the row's slot; a base
    row's is all zero, slot 0's factors being zero anyway)."""

    slots: torch.Tensor
    onehot: torch.Tensor
    num_adapters: int  # distinct adapter slots among the rows
    only_slot: int  # the adapter slot when there is exactly one, else 0

    @functools.cached_property
    def on_only_slot(self) -> torch.Tensor:
        """``onehot``'s column of ``only_slot`` [T]: made once a step, read by every linear."""
        return self.onehot[:, self.only_slot]

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]


def build_dense_rows(token_slots: Sequence[int], num_slots: int, device: torch.device | str = "cpu") -> DenseRows:
    token_slots = list(token_slots)
    slots = torch.tensor(token_slots, dtype=torch.long, device=device)
    onehot = torch.zeros(slots.shape[0], num_slots, dtype=torch.float32, device=device)
    onehot.scatter_(1, slots[:, None], 1.0)
    onehot[:, ZERO_SLOT] = 0.0
    adapters = set(token_slots) - {ZERO_SLOT}
    return DenseRows(slots, onehot, len(adapters), next(iter(adapters)) if len(adapters) == 1 else ZERO_SLOT)


# The dense path's work bound (rows x slots x out): beyond it, e.g. the LM
# head over a large batch, segments are cheaper.
MAX_DENSE_ELEMENTS = 1 << 22


# ---------------------------------------------------------------- reference


def expand_matrix(b: torch.Tensor) -> torch.Tensor:
    """B of every slot as one ``[slots * R, out]`` matrix (slot-major rows), the dense path's expand operand."""
    num_slots, out, max_rank = b.shape
    return b.permute(0, 2, 1).reshape(num_slots * max_rank, out).contiguous()


class DenseFactors:
    """Every slot's factors of one linear's stack laid out for steps whose
    adapter rows are all on one slot (CPU, ``delta_one_slot``), slot-major
    in blocks of width ``W = shards x R``: ``a_t`` [in, slots * W] (each
    shard's A transposed, side by side), ``b`` [slots * W, out] (each
    shard's B transposed in its own rows and columns, zeros elsewhere),
    ``scales`` [slots * W] (each shard's scale once per rank), fp32. Such a
    step's delta is then one GEMM, one scaling and one GEMM whatever the
    shard count. (Steps mixing slots keep ``delta_dense_ref``'s GEMM per
    shard: the zeros of a block layout over every slot would be read
    ``shards`` times over.) ``write`` rewrites one slot's block in place,
    so steps on other slots may read the rest meanwhile (an install runs
    beside the steps)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, offsets: Sequence[int]):
        num_shards, num_slots, max_rank, k = a.shape
        self.width, self.offsets = num_shards * max_rank, tuple(offsets)
        self.a_t = torch.zeros(k, num_slots * self.width)
        self.b = torch.zeros(num_slots * self.width, self.offsets[-1])
        self.scales = torch.zeros(num_slots * self.width)
        for slot in range(num_slots):
            self.write(slot, a, b, scales)

    def block(self, slot: int) -> slice:
        return slice(slot * self.width, (slot + 1) * self.width)

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        """Slot ``slot``'s block from the stack's ``a`` [shards, slots, R, in],
        ``b`` [slots, out, R] and ``scales`` [shards, slots]."""
        num_shards, _, max_rank, k = a.shape
        cols = self.block(slot)
        self.a_t[:, cols] = a[:, slot].reshape(self.width, k).T
        rows = self.b[cols]
        rows.zero_()
        for i in range(num_shards):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            rows[i * max_rank : (i + 1) * max_rank, lo:hi] = b[slot, lo:hi].T
        self.scales[cols] = scales[:, slot].float().repeat_interleave(max_rank)


def delta_one_slot(y: torch.Tensor, x: torch.Tensor, f: DenseFactors, slot: int, on_slot: torch.Tensor) -> torch.Tensor:
    """``delta_dense_ref`` when every adapter row is on ``slot`` (``on_slot``
    [T]: 1 for its rows, 0 for base ones), in place on ``y``, fp32 math:
    that slot's block of ``f`` alone (see ``DenseFactors``)."""
    cols = f.block(slot)
    t = x.float() @ f.a_t[:, cols]
    t *= on_slot[:, None] * f.scales[cols]
    return _add_product(y, t, f.b[cols])


def _add_product(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if y.dtype == torch.float32:
        return y.addmm_(t, b)
    y.copy_((y.float() + t @ b.float()).to(y.dtype))
    return y


def delta_dense_ref(y, x, a, b_all, scales, rows: DenseRows, offsets: Sequence[int], *, is_embedding: bool = False):
    """``lora_delta_ref`` over a one-hot (see ``DenseRows``), in place on
    ``y``, fp32 math: every slot's shrink in one GEMM, each row's own slot's
    rank columns kept and scaled (the others zeroed), then one GEMM per
    shard against ``b_all = expand_matrix(b)``, whose zeroed columns add
    exact zeros. The scale multiplies the rank-wide intermediate, as the
    CUDA kernels do."""
    num_shards, num_slots, max_rank, k = a.shape
    num_rows = y.shape[0]
    if is_embedding:  # A's columns at the token ids, every slot's
        shrink = a[0][:, :, x.long()].permute(2, 0, 1).float().unsqueeze(1)  # [T, 1, slots, R]
    else:
        shrink = (x.float() @ a.reshape(num_shards * num_slots * max_rank, k).float().T)
        shrink = shrink.view(num_rows, num_shards, num_slots, max_rank)
    weights = rows.onehot[:, None, :] * scales[None, :, :]  # [T, shards, slots]: the row's own slot's scale, else 0
    shrink = (shrink * weights[..., None]).view(num_rows, num_shards, num_slots * max_rank)
    for i in range(len(offsets) - 1):
        lo, hi = offsets[i], offsets[i + 1]
        _add_product(y[:, lo:hi], shrink[:, i], b_all[:, lo:hi])
    return y



def shrink_ref(x: torch.Tensor, a: torch.Tensor, segments: LoraSegments) -> torch.Tensor:
    """x [T, in] @ A[shard, slot].T per segment -> fp32 [num_shards, T, max_rank] (zero on base rows)."""
    num_shards, _, max_rank, _ = a.shape
    out = torch.zeros(num_shards, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    for j, slot in enumerate(segments.seg_slots):
        rows = segments.rows(j)
        xs = x[rows].float()
        for i in range(num_shards):
            out[i, rows] = xs @ a[i, slot].float().T
    return out


def embedding_shrink_ref(token_ids: torch.Tensor, a: torch.Tensor, segments: LoraSegments) -> torch.Tensor:
    """The embedding's shrink is a gather: A[0, slot][:, id] per row -> fp32 [1, T, max_rank]."""
    _, _, max_rank, _ = a.shape
    out = torch.zeros(1, token_ids.shape[0], max_rank, dtype=torch.float32, device=a.device)
    for j, slot in enumerate(segments.seg_slots):
        rows = segments.rows(j)
        out[0, rows] = a[0, slot][:, token_ids[rows]].float().T
    return out


def expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    segments: LoraSegments,
    offsets: Sequence[int],
) -> torch.Tensor:
    """y[rows, off_i:off_{i+1}] += scale[i, slot] * buf[i, rows] @ B[slot, off_i:off_{i+1}].T, in place."""
    for j, slot in enumerate(segments.seg_slots):
        rows = segments.rows(j)
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            delta = float(scales[i, slot]) * (buf[i, rows] @ b[slot, lo:hi].float().T)
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
    return y


def lora_delta_ref(y, x, a, b, scales, segments: LoraSegments, offsets: Sequence[int]) -> torch.Tensor:
    """The whole delta of one linear, in place on ``y``, fp32 math (see the module doc)."""
    return expand_ref(y, shrink_ref(x, a, segments), b, scales, segments, offsets)


def delta_rows_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    offsets: Sequence[int],
    *,
    is_embedding: bool = False,
    t: torch.Tensor | None = None,
) -> torch.Tensor:
    """``lora_delta_ref`` with one slot per row (``row_slots`` [T] on ``y``'s
    device) instead of segments, in place on ``y``, fp32 math. ``t``: the
    shrink already made by a fused stack's GEMM ([T, slots x shards x R],
    the first slots', ``LoraStack.fuse_under``); ``x`` is then unused.

    Gathers every row's factors (no host sync, no data-dependent shape, so it
    is graph-capturable too); base rows add an exact zero, whatever slot 0's
    A holds (a fused stack's is its weight's last rows: ``fuse_under``)."""
    slots = row_slots.long()
    if t is not None:  # row i's own slot's columns of every shard
        num_shards, _, max_rank = a.shape[:3]
        rows = torch.arange(t.shape[0], device=t.device)
        shrink = t.reshape(t.shape[0], -1, num_shards, max_rank)[rows, slots].float().transpose(0, 1)
    elif is_embedding:  # the shrink is a gather of A's columns at the token ids
        shrink = a[0][slots, :, x.long()].float().unsqueeze(0)  # [1, T, R]
    else:
        shrink = torch.matmul(a[:, slots].float(), x.float()[None, :, :, None]).squeeze(-1)  # [S, T, R]
    row_scales = scales[:, slots]  # [S, T]
    for i in range(len(offsets) - 1):
        lo, hi = offsets[i], offsets[i + 1]
        delta = torch.bmm(b[slots, lo:hi].float(), shrink[i].unsqueeze(-1)).squeeze(-1) * row_scales[i, :, None]
        delta = torch.where((slots != ZERO_SLOT)[:, None], delta, 0.0)
        y[:, lo:hi] = (y[:, lo:hi].float() + delta).to(y.dtype)
    return y


def check_rows(y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, *, in_features: int, out_features: int, is_embedding: bool) -> None:
    """Shape, dtype and device checks of ``add_delta_rows`` (host metadata only: no sync)."""
    num_rows = row_slots.shape[0] if row_slots.dim() == 1 else -1
    want_x = (num_rows,) if is_embedding else (num_rows, in_features)
    if row_slots.dtype != torch.int32 or row_slots.dim() != 1 or row_slots.device != y.device:
        raise ValueError(
            f"row_slots is {row_slots.dtype} {tuple(row_slots.shape)} on {row_slots.device}; "
            f"accepted: int32 [T] on the output's device {y.device}"
        )
    if tuple(x.shape) != want_x or tuple(y.shape) != (num_rows, out_features):
        raise ValueError(
            f"LoRA rows delta: x {tuple(x.shape)}, y {tuple(y.shape)} for {num_rows} row slots; "
            f"accepted: x {list(want_x)}, y [{num_rows}, {out_features}]"
        )


# ---------------------------------------------------------------- rows kernels


class RowKernels(Protocol):
    """What runs a stack's per-row delta: ``triton_ops`` (the module itself)
    or ``TORCH_ROWS``. Picked once per device where the stacks are built."""

    uses_rows: bool  # eager steps go by rows too (else host segments and the one-hot)

    def rows_delta(self, stack: LoraStack, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor,
                   groups: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor: ...

    def expand_rows(self, stack: LoraStack, y: torch.Tensor, t: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor: ...

    def needs_row_groups(self, num_rows: int) -> bool: ...

    def uses_fused_rows(self, num_rows: int) -> bool: ...

    def group_rows(self, row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, ...]: ...

    def warm_up(self, stack: LoraStack, max_num_rows: int) -> None: ...

    def piece_copies(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Callable[[], None]:
        """``dst[i].copy_(src[i])`` for every i, each a dense piece of the same
        bytes on one device, as a call made once and run for every swap."""
        ...


class TorchRows:
    """``RowKernels`` by the torch reference (``delta_rows_ref``): the CPU,
    and CUDA without Triton. It needs no row groups and compiles nothing."""

    # Eager steps group their rows on the host (segments, one-hot): cheaper
    # than gathering every row's B, vocabulary-wide for the LM head.
    uses_rows = False

    @staticmethod
    def rows_delta(stack: LoraStack, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor,
                   groups: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        return delta_rows_ref(y, x, stack.a, stack.b, stack.scales, row_slots, stack.offsets, is_embedding=stack.is_embedding)

    @staticmethod
    def expand_rows(stack: LoraStack, y: torch.Tensor, t: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        return delta_rows_ref(y, None, stack.a, stack.b, stack.scales, row_slots, stack.offsets, t=t)

    @staticmethod
    def needs_row_groups(num_rows: int) -> bool:
        return False

    @staticmethod
    def uses_fused_rows(num_rows: int) -> bool:
        return True

    @staticmethod
    def group_rows(row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError("the torch rows reference takes no row groups (its needs_row_groups is always false)")

    @staticmethod
    def warm_up(stack: LoraStack, max_num_rows: int) -> None:
        return None

    @staticmethod
    def piece_copies(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Callable[[], None]:
        """One ``_foreach_copy_`` a dtype (it batches dense pieces of one dtype into few launches)."""
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for d, s in zip(dst, src, strict=True):
            by_dtype.setdefault(d.dtype, []).append((d, s))
        groups = list(by_dtype.values())

        def run() -> None:
            for pairs in groups:
                copy_all(pairs)

        return run


TORCH_ROWS = TorchRows()


# ---------------------------------------------------------------- device stacks


class KeptForms(NamedTuple):
    """A slot's forms besides its factors, kept with a slot image (``LoraStack.kept_forms``): B
    transposed, and the bfloat16 halves of A and of B transposed where the stack keeps them."""

    b_rows: torch.Tensor
    halves: tuple[torch.Tensor, torch.Tensor] | None


class LoraStack:
    """Every slot's factors for one targeted linear (or embedding), on the device.

    ``a`` [num_shards, num_slots, max_rank, in], ``b`` [num_slots, sum(output_sizes),
    max_rank], ``scales`` fp32 [num_shards, num_slots]. Slot 0 is never written.
    ``install_slot`` / ``clear`` run on the worker between steps, never while a
    step that reads the slot is in flight (the conductor's install protocol
    guarantees no running row is on a slot being installed). ``kernels`` run
    the rows delta: ``enable_lora`` gives every stack its device's
    (``lora_layers.lora_kernels``); built alone, a stack runs the reference.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        is_embedding: bool = False,
        kernels: RowKernels = TORCH_ROWS,
    ):
        if is_embedding and len(output_sizes) != 1:
            raise ValueError("an embedding LoRA stack has one shard")
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.offsets = tuple(sum(self.output_sizes[:i]) for i in range(len(self.output_sizes) + 1))
        self.max_rank = max_rank
        self.is_embedding = is_embedding
        self.kernels = kernels  # fixed for the stack's life: no step chooses again
        num_shards = len(self.output_sizes)
        if kernels.uses_rows:  # slot by slot in memory, as ``fuse_under`` lays A (a slot's rows, every shard's, in a run)
            self.a = torch.zeros(num_slots, num_shards, max_rank, in_features, dtype=dtype, device=device).transpose(0, 1)
        else:
            self.a = torch.zeros(num_shards, num_slots, max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, self.offsets[-1], max_rank, dtype=dtype, device=device)
        self.scales = torch.zeros(num_shards, num_slots, dtype=torch.float32, device=device)
        # Made here, not at first use: a first use inside CUDA-graph capture
        # would be a host-to-device copy, which capture forbids.
        self._offsets_dev = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        # Where the one-hot path runs (steps not by rows), its operands, kept slot by
        # slot: an install writes only its own slot's, so steps on other slots
        # may read them meanwhile. expand_matrix(b) for steps mixing slots,
        # and a linear's DenseFactors for steps on one.
        self.fused = False  # ``a`` lives under the targeted linear's weight (``fuse_under``)
        self.b_all = self.factors = None
        self.half: tuple[torch.Tensor, torch.Tensor] | None = None  # bfloat16 ``a`` and ``b_all`` (``keep_half``)
        self._stale_factors: set[int] = set()  # slots whose ``factors`` block waits for its first step (``_factors``)
        self._untargeted: set[int] = set()  # slots an install left with scales of 0 here (``set_targeted``)
        if not kernels.uses_rows:
            self.b_all = expand_matrix(self.b)
            if not is_embedding:
                self.factors = DenseFactors(self.a, self.b, self.scales, self.offsets)

    @property
    def num_slots(self) -> int:
        return self.a.shape[1]

    def fuse_under(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Move ``a`` under the targeted linear's ``weight`` ([sum(output_sizes),
        in]) in one buffer, rows ``[weight; a[shard, slot, r] slot by slot]``
        (``slot_rows`` a slot, every shard's) from slot 1, and return it with
        ``bias`` padded by zeros for A's rows. One GEMM of a step's input with
        the buffer gives the base output and each adapter slot's shrink
        ``t = x @ A.T`` beside it, so the delta is an expand alone
        (``add_delta_expand``): one launch a linear instead of a kernel that
        recomputes the shrink in each of its programs. A step whose rows use
        slots below ``k`` only runs the buffer's first ``out + (k - 1) *
        slot_rows`` rows (``LoraStep.width``): the other slots' A is not read.
        ``a`` becomes a view of the buffer, so installs and the other kernels
        use it as before; its slot 0, the zero adapter's, is the weight's last
        ``slot_rows`` rows (``fused_shrink``: the base rows' shrink is never
        read, so no GEMM reads a zero A). Nothing writes slot 0
        (``refuse_zero_slot``). The caller serves the base output from the
        buffer's first rows."""
        n = self.offsets[-1]
        if self.is_embedding or weight.shape != (n, self.in_features) or weight.dtype != self.a.dtype or weight.device != self.a.device:
            raise ValueError(f"fusing LoRA A under a weight {tuple(weight.shape)} {weight.dtype} on {weight.device}; "
                             f"accepted: a linear's weight [{n}, {self.in_features}] {self.a.dtype} on {self.a.device}")
        if n < self.slot_rows:
            raise ValueError(f"fusing LoRA A under a weight of {n} rows; accepted: at least a slot's {self.slot_rows}")
        by_slot = self.a.transpose(0, 1)
        fused = torch.cat([weight.detach(), by_slot[1:].reshape(-1, self.in_features)])
        self.a = fused[n - self.slot_rows:].view(by_slot.shape).transpose(0, 1)
        self.fused = True
        fused_bias = None if bias is None else torch.cat([bias.detach(), bias.new_zeros(fused.shape[0] - n)])
        return fused, fused_bias

    def fused_shrink(self, out: torch.Tensor) -> torch.Tensor:
        """The shrink ``t`` in a fused GEMM's output ``out`` (``fuse_under``): its columns from one slot's
        before the base output's end, so slot ``s``'s sit where the expands look for them, at ``s *
        slot_rows``; slot 0's are the base output's last (base rows read no shrink)."""
        return out[:, self.offsets[-1] - self.slot_rows:]

    @property
    def slot_rows(self) -> int:
        """Rows of A a slot (every shard's): a fused GEMM's columns a slot (``fuse_under``)."""
        return len(self.output_sizes) * self.max_rank

    def shrink_fits(self, t: torch.Tensor, num_rows: int) -> bool:
        """Whether ``t`` is a shrink of ``num_rows`` rows as a fused GEMM gives it: the columns of the
        first one or more slots (``fuse_under``), at most all of them."""
        cols = t.shape[1] if t.dim() == 2 else -1
        return t.shape[0] == num_rows and cols > 0 and cols % self.slot_rows == 0 and cols <= self.num_slots * self.slot_rows

    def check_shrink(self, t: torch.Tensor, num_rows: int) -> None:
        """Raise unless ``shrink_fits``."""
        if not self.shrink_fits(t, num_rows):
            raise ValueError(f"LoRA expand: t is {tuple(t.shape)}; accepted: [{num_rows}, k * {self.slot_rows}] for "
                             f"k of 1..{self.num_slots} (rows x the first k slots' shards x max_rank, the fused GEMM's A columns)")

    def fuses_rows(self, num_rows: int) -> bool:
        """Whether a rows step of ``num_rows`` rows takes ``add_delta_expand``:
        a fused stack, below ``MIN_SPLIT_FUSED_ROWS`` rows (from there the
        grouped kernel reads ``a`` instead, where a per-row expand would read
        B once a row)."""
        return self.fused and self.kernels.uses_fused_rows(num_rows)

    def add_delta_expand(self, y: torch.Tensor, t: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """y += the delta of row ``t``'s slot given its shrink (a fused stack's
        GEMM columns, ``fuse_under``), in place; graph-safe as ``add_delta_rows``."""
        if y.shape[0] == 0:
            return y
        return self.kernels.expand_rows(self, y, t, row_slots)

    def row_groups(self, row_slots: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The rows grouped by slot on the device, for ``add_delta_rows``; None
        where the kernel a batch of this size takes needs none. Device ops only:
        graph-capturable. One step's groups serve every stack of the model."""
        if not self.kernels.needs_row_groups(row_slots.shape[0]):
            return None
        return self.kernels.group_rows(row_slots, self.num_slots)

    def offsets_on(self, device: torch.device | str) -> torch.Tensor:
        """The shard offsets as an int32 tensor on ``device`` (made once)."""
        if self._offsets_dev.device != torch.device(device):
            self._offsets_dev = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        return self._offsets_dev

    def install_slot(self, slot: int, modules: Sequence[tuple[int | None, LoraModule]]) -> None:
        """Replace the whole of ``slot`` with ``modules`` (``(shard, factors)``
        pairs; shards not named read zero), checked first, then staged on the
        host and written with one copy per tensor. ``SlotStaging`` does the
        same for every stack of a model at once (what a worker's install runs
        on a GPU)."""
        refuse_zero_slot(slot, "installed")
        a, b, scales = (torch.zeros(shape, dtype=dtype) for shape, dtype in self.slot_layout())
        copies, values = self.staged_copies(slot, modules, a, b)
        copy_all(copies)
        scales.copy_(torch.tensor(values, dtype=scales.dtype))
        for dst, src in zip(self.slot_views(slot), (a, b, scales)):
            dst.copy_(src)
        self.write_dense(slot)
        self.set_targeted(slot, any(values))

    def slot_layout(self) -> tuple[tuple[torch.Size, torch.dtype], ...]:
        """Shapes and dtypes of one slot's ``a``, ``b`` and ``scales``."""
        return ((self.a[:, 0].shape, self.a.dtype), (self.b[0].shape, self.b.dtype),
                (self.scales[:, 0].shape, self.scales.dtype))

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``slot``'s ``a``, ``b`` and ``scales``: views of the stacks, in ``slot_layout``."""
        return self.a[:, slot], self.b[slot], self.scales[:, slot]

    def staged_copies(self, slot: int, modules: Sequence[tuple[int | None, LoraModule]], a: torch.Tensor,
                      b: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
        """Check ``modules`` against this stack; return the ``(destination,
        source)`` copies that write them into ``a`` and ``b`` (one slot's
        layout, zeroed by the caller) and the slot's scale per shard (0 where
        no module). Copies, not done here: the caller does every stack's in
        one call (each torch call gives up the GIL and takes it back, which
        costs most beside a busy step loop)."""
        for shard, module in modules:
            self.check(slot, shard or 0, module)
        copies, values = [], [0.0] * len(self.output_sizes)
        for shard, module in modules:
            shard, rank = shard or 0, module.rank
            copies += [(a[shard, :rank], module.a), (b[self.offsets[shard] : self.offsets[shard + 1], :rank], module.b)]
            values[shard] = module.scale
        return copies, values

    def check(self, slot: int, shard: int, module: LoraModule) -> None:
        """Raise ValueError, naming what fits, unless ``module`` fits ``shard`` of a non-zero ``slot``."""
        refuse_zero_slot(slot, "installed")
        rank = module.rank
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        if module.a.shape != (rank, self.in_features) or module.b.shape != (hi - lo, rank) or rank > self.max_rank:
            raise ValueError(
                f"LoRA factors A {tuple(module.a.shape)} / B {tuple(module.b.shape)} do not fit shard {shard} of "
                f"this stack: accepted A [r, {self.in_features}], B [{hi - lo}, r] with r <= {self.max_rank}"
            )

    def clear(self, slot: int) -> None:
        refuse_zero_slot(slot, "cleared")
        self.a[:, slot].zero_()
        self.b[slot].zero_()
        self.scales[:, slot] = 0.0
        self.write_dense(slot)
        self.set_targeted(slot, False)

    def set_targeted(self, slot: int, targeted: bool) -> None:
        """Whether ``slot``'s adapter targets this linear (a scale not 0), as an
        install just wrote it: host facts, no read of the scales. A slot not
        known untargeted is taken as targeted (``write_dense`` forgets it)."""
        if targeted:
            self._untargeted.discard(slot)
        else:
            self._untargeted.add(slot)

    def targets(self, slot: int) -> bool:
        """Whether ``slot``'s delta here is computed (``set_targeted``)."""
        return slot not in self._untargeted

    def write_dense(self, slot: int, kept: KeptForms | None = None,
                    copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """``slot``'s copies in the torch kernels' dense forms (none with the row kernels), after a write:
        ``b_all``'s now (the CPU's layer stack reads it) and the bfloat16 halves where kept
        (``keep_half``); ``kept``: what ``kept_forms`` gave after an earlier write of the same factors
        (a kept image's), copied rather than remade: into ``copies`` where given (the caller makes
        every stack's in one call, as ``staged_copies``' caller does), else here. ``factors``' at the
        first step that takes them (``_factors``), which a swap's requests may never run: rewriting
        them is strided transposes, a stack at a time, inline on the worker."""
        self._untargeted.discard(slot)
        if kept is None or (self.half is not None and kept.halves is None):  # none, or kept before keep_half
            self._write_forms(slot)
        else:
            pairs = [] if self.b_all is None else [(self.b_rows(slot), kept.b_rows)]
            if self.half is not None:
                pairs += zip(self.slot_halves(slot), kept.halves)
            if copies is None:
                copy_all(pairs)
            else:
                copies += pairs
        if self.factors is not None:
            self._stale_factors.add(slot)

    def kept_forms(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> KeptForms | None:
        """After a write of ``slot`` from an image whose regions of this stack are ``a`` and ``b``: the
        slot's forms for the image to keep (None: this stack has none), the image's factors made the
        slot's (rounded, where the stack keeps halves), so a swap back copies all of them as they are."""
        if self.b_all is None:
            return None
        if self.half is not None:
            a.copy_(self.a[:, slot])
            b.copy_(self.b[slot])
        halves = None if self.half is None else tuple(half.clone() for half in self.slot_halves(slot))
        return KeptForms(self.b_rows(slot).clone(), halves)

    def _write_forms(self, slot: int) -> None:
        if self.half is not None:  # the float32 factors rounded through the halves: one set of values
            a_half, bt_half = self.slot_halves(slot)
            a_half.copy_(self.a[:, slot])
            self.a[:, slot].copy_(a_half)
            self.b[slot].copy_(self.b[slot].to(torch.bfloat16))
            self.b_rows(slot).copy_(self.b[slot].T)
            bt_half.copy_(self.b_rows(slot))
        elif self.b_all is not None:
            self.b_rows(slot).copy_(self.b[slot].T)

    def slot_halves(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s views of the halves (``keep_half``): A's, B transposed's."""
        a_half, bt_half = self.half
        return a_half[:, slot], bt_half[slot * self.max_rank : (slot + 1) * self.max_rank]

    def keep_half(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``a`` and ``b_all`` in bfloat16, every slot, from now on (each
        ``write_dense`` keeps them), for the CPU layer stack's quantized
        linears (``cpu_stack``): a step reads every factor of its adapters
        once, and under int4 codes a SmolLM2 adapter's float32 factors were a
        quarter of the step's bytes. The float32 factors are rounded to the
        same values (every slot now, each write after), so the Python path's
        deltas and the layer stack's agree within float32 sums; bfloat16 is
        what most adapters are trained and saved in, and its rounding (2^-9)
        is far below what int4 or int8 weights give up."""
        if self.b_all is None or self.is_embedding or self.fused:
            raise ValueError("bfloat16 factors are the CPU layer stack's: a linear's stack with B transposed, "
                             "A not fused under a weight")
        if self.half is None:
            self.half = (torch.empty_like(self.a, dtype=torch.bfloat16), torch.empty_like(self.b_all, dtype=torch.bfloat16))
            for slot in range(self.num_slots):
                self._write_forms(slot)
                if self.factors is not None:
                    self._stale_factors.add(slot)
        return self.half

    def b_rows(self, slot: int) -> torch.Tensor:
        """``slot``'s rows of ``b_all`` (its B transposed), a view."""
        return self.b_all[slot * self.max_rank : (slot + 1) * self.max_rank]

    def _factors(self, slot: int) -> DenseFactors:
        """``factors`` with ``slot``'s block as the slot now holds it. Steps and
        installs never share a slot (the conductor installs only into slots no
        running row uses), so the step that writes the block is its only reader."""
        if slot in self._stale_factors:
            self.factors.write(slot, self.a, self.b, self.scales)
            self._stale_factors.discard(slot)
        return self.factors

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, segments: LoraSegments,
                  dense: DenseRows | Callable[[], DenseRows] | None = None) -> torch.Tensor:
        """y += this linear's LoRA delta for the step's rows, in place; returns y.

        ``x`` is the linear's input [T, in] (token ids [T] for an embedding),
        ``y`` its output [T, sum(output_sizes)]. No-op when no row has an adapter.
        ``dense``: the same rows as a one-hot, taken when its product is
        small enough (``MAX_DENSE_ELEMENTS``): over that one slot's columns
        when the rows have one adapter, else over every slot's; or a call that makes it
        (``lora_layers.LazyDense``), made only past the early return.
        """
        if segments.num_segments == 0 or self._untargeted.issuperset(segments.seg_slots):
            return y  # no row's adapter targets this linear (e.g. an all-linear adapter's LM head): zeros
        if callable(dense):
            dense = dense()
        if dense is not None and dense.num_rows * self.num_slots * self.offsets[-1] <= MAX_DENSE_ELEMENTS:
            if self.factors is not None and dense.only_slot != ZERO_SLOT:
                return delta_one_slot(y, x, self._factors(dense.only_slot), dense.only_slot, dense.on_only_slot)
            if self.b_all is not None:
                return delta_dense_ref(y, x, self.a, self.b_all, self.scales, dense, self.offsets,
                                       is_embedding=self.is_embedding)
        shrink = embedding_shrink_ref(x, self.a, segments) if self.is_embedding else shrink_ref(x, self.a, segments)
        return expand_ref(y, shrink, self.b, self.scales, segments, self.offsets)

    def add_delta_rows(self, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, groups=None) -> torch.Tensor:
        """y += the delta with row ``t`` on slot ``row_slots[t]`` (int32 [T] on
        ``y``'s device, 0 = base), in place; returns y.

        Graph-safe: never reads ``row_slots`` on the host and launches the same
        work for any slot values, so a captured call replays correctly after
        the caller writes new slots into the same tensor. ``groups``: the
        step's ``row_groups`` of the same slots, made once per step for every
        stack (None: made by the kernel if it needs them)."""
        check_rows(y, x, row_slots, in_features=self.in_features, out_features=self.offsets[-1], is_embedding=self.is_embedding)
        if y.shape[0] == 0:
            return y
        return self.kernels.rows_delta(self, y, x, row_slots, groups)


class SlotStaging:
    """One slot of every stack of a model as an image of two flat buffers, so
    an adapter install on a GPU is one host-to-device copy plus one batched
    device copy into the stacks, and a swap back in is the batched copy alone.

    ``install`` builds a pinned host image (zeroed, then the adapter's modules
    written into their stacks' regions), copies it whole to a device twin on
    a stream of its own, and spreads the twin into the stacks' slot once the
    steps already queued on the step stream (the caller's current stream:
    a worker's steps and its install thread share the device's default
    stream) are done: the last steps of the slot's earlier tenant read its
    weights to the end. Then it waits for its own stream only, so steps
    queued meanwhile are not delayed. The last ``max_images`` images are kept
    by key (the adapter's digest), so installing the same weights again
    (adapter churn) is ``reinstall``: no parsing, zeroing or staging (the
    churn rows of the LoRA serving benchmark, docs/benchmarks.md). The most
    recently used ``device_images`` of them keep their device twin too (a
    fixed pool allocated here, before the KV cache is sized): their
    reinstall is one device copy queued on the step stream, behind the steps
    already queued and ahead of those queued after it, so nothing waits on
    the host and the slot is ready for the next step. An image without a
    twin takes the least recently used one (copied there first). Every path
    makes a handful of torch calls whatever the module count: each call
    gives the GIL up and takes it back, and beside a step loop that holds it
    most of the time, a call per module would stall the install behind every
    step. One install or reinstall at a time (the worker installs on one
    thread, and swaps inline only while none is in flight).

    CPU stacks take the same images in plain host memory, written straight
    into the slot (and its dense forms, ``LoraStack.write_dense``): a swap
    back in is a handful of copies, inline between two steps, where an
    install from the host copy runs on the install thread beside the steps
    (about 115 ms for a SmolLM2-135M adapter on two cores).
    """

    def __init__(self, stacks: dict[str, LoraStack], device: torch.device, max_images: int = 0,
                 device_images: int = 1, kernels: RowKernels = TORCH_ROWS):
        self.stacks = stacks
        self.kernels = kernels  # the stacks' (``piece_copies``: a twin into a slot)
        self._twin_copies: dict[tuple[int, int], Callable[[], None]] = {}  # (slot, twin index) -> its copies
        self.layouts = {name: stack.slot_layout() for name, stack in stacks.items()}
        dtypes = {dtype for layout in self.layouts.values() for _, dtype in layout[:2]}
        if len(dtypes) != 1:
            raise ValueError(f"LoRA stacks hold factors of several dtypes {sorted(map(str, dtypes))}; accepted: one")
        self.dtype = dtypes.pop()
        self.device = device
        self.size = sum(a.numel() + b.numel() for (a, _), (b, _), _ in self.layouts.values())
        self.num_scales = sum(s.numel() for _, _, (s, _) in self.layouts.values())
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # None: CPU stacks
        self.max_images = max_images
        self.images: collections.OrderedDict[str, _SlotImage] = collections.OrderedDict()  # by key, oldest first
        self._scratch: _SlotImage | None = None  # the image of installs that keep none
        self._slot_views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._free_twins = [_DeviceTwin(self, device, i) for i in range(max(1, device_images))] if self.stream else []
        self._twins: collections.OrderedDict[str, _DeviceTwin] = collections.OrderedDict()  # by key, oldest use first

    @property
    def image_bytes(self) -> int:
        """One image's bytes (each kept pinned image, each device twin)."""
        return slot_image_bytes(self.stacks)

    @property
    def kept_image_bytes(self) -> int:
        """A kept image's bytes once written: ``image_bytes``, B's transpose where the stacks have one
        and the bfloat16 halves where they keep them (``LoraStack.kept_forms``)."""
        return self.image_bytes + sum(view.numel() * view.element_size() for stack in self.stacks.values()
                                      if stack.b_all is not None
                                      for view in (stack.b_rows(1), *(stack.slot_halves(1) if stack.half else ())))

    @property
    def num_device_images(self) -> int:
        return len(self._free_twins) + len(self._twins)

    def install(self, slot: int, by_stack: dict[str, Sequence[tuple[int | None, LoraModule]]],
                key: str | None = None) -> None:
        """Replace ``slot`` of every stack: ``by_stack[name]`` its modules (stacks
        not named read zero); keep the image under ``key`` when given. Raises
        ValueError before writing any device memory if a module does not fit."""
        refuse_zero_slot(slot, "installed")
        for name, stack in self.stacks.items():  # a refusal before any kept image gives its buffers up
            for shard, module in by_stack.get(name, ()):
                stack.check(slot, shard or 0, module)
        self.forget(key)
        keep = key is not None and self.max_images > 0
        image = self._free_image(keep)
        image.fill(self.stacks, slot, by_stack)
        if keep:
            self.images[key] = image
        self._write(slot, image, key if keep else None)

    def reinstall(self, slot: int, key: str) -> bool:
        """Write the kept image ``key`` into ``slot``; False when none is kept.
        With its device twin: one device copy queued on the step stream, no wait."""
        refuse_zero_slot(slot, "installed")
        image = self.images.get(key)
        if image is None:
            return False
        self.images.move_to_end(key)
        twin = self._twins.get(key)
        if twin is None:
            self._write(slot, image, key)
            return True
        self._twins.move_to_end(key)
        step_stream = torch.cuda.current_stream(self.device)
        self._copy_twin(slot, twin)
        self._write_dense(slot, image, key)
        twin.read.record(step_stream)
        return True

    def forget(self, key: str | None) -> None:
        """Drop the image kept under ``key`` (and its device twin), if any."""
        if key is None:
            return
        self.images.pop(key, None)
        if (twin := self._twins.pop(key, None)) is not None:
            self._free_twins.append(twin)

    def clear(self) -> None:
        """Drop every kept image (the next install of each adapter builds its own again)."""
        for key in list(self.images):
            self.forget(key)

    def _free_image(self, keep: bool) -> _SlotImage:
        if not keep:
            if self._scratch is None:
                self._scratch = self._new_image()
            return self._scratch
        if len(self.images) >= self.max_images:  # the oldest kept image's buffers serve the new one
            key, image = next(iter(self.images.items()))
            self.forget(key)
            return image
        return self._new_image()

    def _new_image(self) -> _SlotImage:
        return _SlotImage(self.layouts, self.size, self.num_scales, self.dtype, list(self.stacks),
                          pin=self.stream is not None)

    def _copy_twin(self, slot: int, twin: _DeviceTwin) -> None:
        """``twin`` into ``slot`` of every stack, queued on the current stream."""
        key = (slot, twin.index)
        if key not in self._twin_copies:
            (factors, scales), (twin_factors, twin_scales) = self._views(slot), twin.views
            self._twin_copies[key] = self.kernels.piece_copies([*factors, *scales], [*twin_factors, *twin_scales])
        self._twin_copies[key]()

    def _views(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if slot not in self._slot_views:
            self._slot_views[slot] = _dense_parts(stack.slot_views(slot) for stack in self.stacks.values())
        return self._slot_views[slot]

    def _take_twin(self, key: str | None) -> _DeviceTwin:
        """A device twin for the image of ``key`` (None: one for this write
        only): a free one, else the least recently used image's."""
        twin = self._free_twins.pop() if self._free_twins else self._twins.popitem(last=False)[1]
        if key is None:
            self._free_twins.append(twin)
        else:
            self._twins[key] = twin
        return twin

    def _write(self, slot: int, image: _SlotImage, key: str | None) -> None:
        if self.stream is None:  # CPU stacks: the image straight into the slot, and its dense forms
            _copy_parts(self._views(slot), image.dense)
            self._write_dense(slot, image, key)
            return
        step_stream = torch.cuda.current_stream(self.device)
        twin = self._take_twin(key)
        # Its last reinstall may still be queued on the step stream: that copy reads it first.
        self.stream.wait_event(twin.read)
        with torch.cuda.stream(self.stream):
            twin.flat.copy_(image.flat, non_blocking=True)
            twin.scales.copy_(image.scales, non_blocking=True)
        # The steps queued so far may read the slot's earlier tenant: the slot is written after them.
        self.stream.wait_stream(step_stream)
        with torch.cuda.stream(self.stream):
            self._copy_twin(slot, twin)
            self._write_dense(slot, image, key)
        self.stream.synchronize()

    def _write_dense(self, slot: int, image: _SlotImage, key: str | None) -> None:
        """After ``image`` is written into ``slot``: the torch kernels' dense
        forms (``LoraStack.write_dense``; none under the row kernels: CUDA
        stacks have them only where Triton is missing), B's transpose from
        the image where it kept it (kept after its first write, so a swap
        back copies it instead of transposing again), and which stacks the
        slot's adapter targets."""
        kept, copies = image.kept, []
        for name, stack in self.stacks.items():
            stack.write_dense(slot, None if kept is None else kept.get(name), copies)
            stack.set_targeted(slot, image.targets[name])
        copy_all(copies)
        if kept is None and key is not None:
            image.kept = {name: forms for name, stack in self.stacks.items()
                          if (forms := stack.kept_forms(slot, *image.views[name][:2])) is not None}


def slot_image_bytes(stacks: dict[str, LoraStack]) -> int:
    """The bytes of one slot of every stack: a ``SlotStaging`` image."""
    return sum(view.numel() * view.element_size() for stack in stacks.values() for view in stack.slot_views(1))


class _DeviceTwin:
    """One image on the device (``SlotStaging``'s layout), and the event after
    the last copy that read it on the step stream."""

    def __init__(self, staging: SlotStaging, device: torch.device, index: int):
        self.index = index  # its place in the fixed pool (the key of its copies into each slot)
        self.flat = torch.empty(staging.size, dtype=staging.dtype, device=device)
        self.scales = torch.empty(staging.num_scales, dtype=torch.float32, device=device)
        regions = _slot_regions(staging.layouts, self.flat, self.scales)
        self.views = _dense_parts(regions[name] for name in staging.stacks)
        self.read = torch.cuda.Event()


class _SlotImage:
    """One slot of every stack in host memory (``SlotStaging``'s layout), pinned
    for a GPU's copies; ``dense``: its pieces in the stacks' order (``_dense_parts``)."""

    def __init__(self, layouts: dict, size: int, num_scales: int, dtype: torch.dtype, order: list[str], pin: bool):
        self.flat = torch.empty(size, dtype=dtype, pin_memory=pin)
        self.scales = torch.empty(num_scales, dtype=torch.float32, pin_memory=pin)
        self.views = _slot_regions(layouts, self.flat, self.scales)
        self.dense = _dense_parts(self.views[name] for name in order)
        self.kept: dict[str, KeptForms] | None = None  # each stack's other forms (``LoraStack.kept_forms``)
        self.targets: dict[str, bool] = {name: False for name in order}  # the stacks whose scales are not all 0

    def fill(self, stacks: dict[str, LoraStack], slot: int,
             by_stack: dict[str, Sequence[tuple[int | None, LoraModule]]]) -> None:
        copies, values = [], []
        self.kept = None
        for name, stack in stacks.items():
            a, b, _ = self.views[name]
            stack_copies, stack_values = stack.staged_copies(slot, by_stack.get(name, ()), a, b)
            copies += stack_copies
            values += stack_values
            self.targets[name] = any(stack_values)
        self.flat.zero_()
        copy_all(copies)
        self.scales.copy_(torch.tensor(values, dtype=torch.float32))


def _dense_parts(slot_views) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each stack's one-slot ``(a, b, scales)`` as dense pieces, factors and
    scales apart: ``a[shard]``, ``b``, ``scales[shard:shard + 1]``. A stack's
    slot may be strided across its shards (``a[:, slot]``, where A is laid
    shard by shard: the torch reference's stacks), and the copies take
    dense pieces (``_foreach_copy_`` batches them into a few launches where
    strided ones took a copy kernel each, ~200 launches, ~2 ms, for a
    Llama-3.2-1B adapter; ``RowKernels.piece_copies`` into one)."""
    factors, scales = [], []
    for a, b, s in slot_views:
        factors += [*a.unbind(0), b]
        scales += [s[i : i + 1] for i in range(s.shape[0])]
    return factors, scales


def _copy_parts(dst: tuple[list[torch.Tensor], list[torch.Tensor]],
                src: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    for d, s in zip(dst, src):
        torch._foreach_copy_(d, s)


def copy_all(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, in one torch call."""
    if copies:
        torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])


def _slot_regions(layouts: dict, flat: torch.Tensor, scales: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each stack's ``(a, b, scales)`` of one slot as views of two flat buffers, stacks in order."""
    regions, at, scale_at = {}, 0, 0
    for name, ((a_shape, _), (b_shape, _), (s_shape, _)) in layouts.items():
        a = flat[at : at + a_shape.numel()].view(a_shape)
        at += a_shape.numel()
        b = flat[at : at + b_shape.numel()].view(b_shape)
        at += b_shape.numel()
        regions[name] = (a, b, scales[scale_at : scale_at + s_shape.numel()].view(s_shape))
        scale_at += s_shape.numel()
    return regions
