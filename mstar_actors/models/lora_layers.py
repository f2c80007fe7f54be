"""LoRA inside the decoder: one ``LoraStack`` per targeted module, one step's segments.

Targets: every ``LoraLinear`` of the decoder (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``), the token embedding and the LM head. Each
targeted module gets a ``LoraHook`` (its stack plus the model's shared
``LoraStep``); after its base matmul it calls ``hook.apply(y, x)``.

Nothing here exists unless LoRA is enabled (``enable_lora``): a model built
without it has ``lora = None`` on every module and runs the base path only.
With LoRA on, a step with no adapter rows has ``LoraStep.segments = None``
and every hook returns at once, so base-only batches cost an attribute test
per module.

Two ways to give a step its rows' slots: segments grouped on the host (the
torch reference's input: the CPU), and a device tensor with one slot per
row (``begin_rows_step``: where the Triton kernels run, every step). The
rows path never reads the slots on the host and launches fixed work, so a
decode step run through it can be captured in a CUDA graph and replayed
with new slots written into the same tensor. Which one eager steps take,
and what runs the rows delta (``ops.RowKernels``), is fixed per device when
``enable_lora`` builds the stacks (``lora_kernels``), not chosen per step.

Where the kernels run, each decoder linear's stack is also fused
(``fuse_linear``): every adapter slot's A sits under the weight in one buffer, so a
rows step of fewer than ``MIN_SPLIT_FUSED_ROWS`` rows with adapter rows runs
one GEMM that yields the base output and each slot's shrink (the slots below
the step's ``LoraStep.width`` only: the rows' slots, rounded up to a width
captured for that size, ``LoraLayers.widths``); the kernel
after the GEMM adds the expand as it loads (``FOLD``, ``PendingExpand``: the
rotary kernel q|k|v's, SiLU-and-mul gate|up's, the residual add's RMSNorm
o's and down's), else the hook's ``expand`` in one launch. Steps without
adapter rows run the weight alone, a view of the same buffer. From
``MIN_SPLIT_FUSED_ROWS`` rows the delta (the grouped shrink and expand) runs
on a side stream while the base GEMM runs (``BESIDE``,
``LoraLinear.forward_parts``): o's and down's go straight into the residual
stream, q|k|v's and gate|up's into a buffer the next fused op adds as it
loads.

Adapter placement goes through the architecture's ``CheckpointRules`` (the
same table the weight loader uses): HF ``model.layers.3.self_attn.k_proj``
lands in our ``model.layers.3.self_attn.qkv_proj`` stack as shard 1.

Under tensor parallelism each stack is its module's shard and an install
takes this rank's part of each factor (``shard_factors``), as S-LoRA and
vLLM cut them: a column-parallel linear (q/k/v, gate/up, the LM head) keeps
A whole and B's rows of its outputs; a row-parallel one (o, down) keeps A's
columns of its inputs and B whole, its partial delta summed by the layer's
all-reduce with the base output; the embedding keeps A's columns of its
vocabulary rows. The parts are views of the host copy: no rank copies the
whole adapter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from mstar_actors.lora.adapter_file import AdapterWeights, LoraModule
from mstar_actors.lora.merge import MergedWeights
from mstar_actors.lora.ops import (
    TORCH_ROWS,
    ZERO_SLOT,
    DenseRows,
    LoraSegments,
    LoraStack,
    RowKernels,
    SlotStaging,
    build_dense_rows,
    build_segments,
    slot_image_bytes,
)

from .checkpoint import CheckpointRules
from .decoder import LoraEmbedding, LoraLinear
from .sharding import Cut

LM_HEAD = "lm_head"
# Steps of up to this many rows (decode-sized) also carry a one-hot of their
# slots, which the CPU's delta takes instead of segments (``ops.DenseRows``).
MAX_DENSE_ROWS = 64
# On CUDA, each decoder linear's delta of a step of many rows runs on a side
# stream while the base GEMM runs (``LoraHook.runs_beside``); off, it
# follows the GEMM on the step's stream. Read as steps run and graphs are captured
# (``tools/profile_gpu_step.py --lora-paths beside fused`` times both).
BESIDE = True
# Below that size, a fused linear's expand is added by the kernel after its
# GEMM as it loads (``PendingExpand``: rotary, SiLU-and-mul, the residual
# add's RMSNorm) instead of a launch of its own. Read likewise
# (``tools/profile_gpu_step.py --fold``).
FOLD = True
# Steps of up to this many rows also come in narrower widths (``LoraLayers.widths``): a fused GEMM's A rows of
# slots no row uses are most of a small step's LoRA cost (``tools/profile_gpu_step.py --max-loras``: one adapter's
# step over the base's, 1B shape, 98.7 / 96.8% with one / four slots at 1 row, 96.7 / 95.2% at 8, level at 64).
NARROW_MAX_ROWS = 16
EMBED_TOKENS = "model.embed_tokens"


class LoraStep:
    """The current step's rows grouped by slot, shared by every hook of one model.

    ``segments`` covers the flat batch's token rows, ``sampled_segments`` the
    rows given to the LM head (one per sampled chunk). Both are None outside
    a step and in steps without adapter rows. Set by ``LoraLayers.begin_step``
    and reset by ``end_step``; the runner executes one step at a time, so one
    shared holder is enough (no step ever sees another's segments).

    ``row_slots`` (int32 device tensor [T], 0 = base), set by
    ``begin_rows_step``, replaces both: every token-row hook reads its row's
    slot there, the LM head reads ``sampled_row_slots`` (the same tensor in
    a pure decode step; None when no sampled row has an adapter). At most
    one of ``row_slots`` and ``segments`` is set. ``row_groups`` /
    ``sampled_row_groups``: those rows grouped by slot on the device
    (``LoraStack.row_groups``), made once per step for the grouped
    kernel's batch sizes, else None. ``width``: with ``row_slots``, the
    slots ``0..width-1`` a fused GEMM covers, reading the A of ``1..width-1``
    (``LoraHook.fused_rows``).
    """

    __slots__ = ("segments", "sampled_segments", "dense", "sampled_dense", "token_slots", "row_slots", "row_groups",
                 "sampled_row_slots", "sampled_row_groups", "width", "side")

    def __init__(self) -> None:
        self.segments: LoraSegments | None = None
        self.sampled_segments: LoraSegments | None = None
        # The same rows as a one-hot, for steps of up to MAX_DENSE_ROWS rows (CPU), made
        # at the first hook that takes them (``LazyDense``).
        self.dense: LazyDense | None = None
        self.sampled_dense: LazyDense | None = None
        # Beside segments: each token row's slot (int64 [T] on the host), for the
        # CPU's layer stack in one C call (``cpu_stack``), which adds the deltas itself.
        self.token_slots: torch.Tensor | None = None
        self.row_slots: torch.Tensor | None = None
        self.row_groups: tuple[torch.Tensor, ...] | None = None
        self.sampled_row_slots: torch.Tensor | None = None
        self.sampled_row_groups: tuple[torch.Tensor, ...] | None = None
        # A rows step's fused GEMMs read the A of slots below this (every row's slot is), not all.
        self.width = 0
        # Where the kernels run on CUDA: the stream the decoder linears' deltas
        # run on, beside their base GEMMs (``LoraHook.runs_beside``).
        self.side: torch.cuda.Stream | None = None


class LazyDense:
    """A step's rows as a one-hot (``build_dense_rows``), made when a hook first takes them
    (``LoraStack.add_delta`` calls it past its early returns): where the CPU's layer stack adds the
    decoder linears' deltas itself, the embedding's and the LM head's hooks are often all that is
    left, and an all-linear adapter targets neither."""

    __slots__ = ("slots", "num_slots", "device", "rows")

    def __init__(self, slots: Sequence[int], num_slots: int, device: torch.device):
        self.slots, self.num_slots, self.device = slots, num_slots, device
        self.rows: DenseRows | None = None

    def __call__(self) -> DenseRows:
        if self.rows is None:
            self.rows = build_dense_rows(self.slots, self.num_slots, self.device)
        return self.rows


class PendingExpand(NamedTuple):
    """A fused linear's LoRA delta still to add: its expand, given the shrink
    ``t`` the fused GEMM wrote beside the base output
    (``LoraLinear.forward_parts(fold=True)``). The op after the GEMM adds it
    as it loads (``triton_fused.rope_write_kv``, ``silu_mul`` and ``rms_norm`` take it):
    one launch a linear fewer at decode sizes; ``apply`` adds it where that
    op cannot."""

    stack: LoraStack
    t: torch.Tensor
    row_slots: torch.Tensor

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return self.stack.add_delta_expand(y, self.t, self.row_slots)


class LoraHook:
    """One targeted module's stack; ``apply`` adds its delta for the step's adapter rows."""

    __slots__ = ("stack", "step", "is_sampled")

    def __init__(self, stack: LoraStack, step: LoraStep, *, is_sampled: bool = False):
        self.stack = stack
        self.step = step
        self.is_sampled = is_sampled  # the LM head sees only the sampled rows

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step.row_slots is not None:
            if self.is_sampled:
                slots = step.sampled_row_slots
                return y if slots is None else self.stack.add_delta_rows(y, x, slots, step.sampled_row_groups)
            return self.stack.add_delta_rows(y, x, step.row_slots, step.row_groups)
        segments = self.step.sampled_segments if self.is_sampled else self.step.segments
        dense = self.step.sampled_dense if self.is_sampled else self.step.dense
        return y if segments is None else self.stack.add_delta(y, x, segments, dense)

    def fuses(self, num_rows: int) -> bool:
        """Whether this step's ``num_rows`` rows take the fused GEMM and
        ``expand`` (a fused stack in a rows step with adapter rows; shapes and
        the step's kind only, so a captured graph keeps the choice)."""
        return self.step.row_slots is not None and not self.is_sampled and self.stack.fuses_rows(num_rows)

    def fused_rows(self) -> int:
        """The A rows this step's fused GEMM reads below the weight's: those of the adapter slots below its
        width (the zero slot has none, ``LoraStack.fuse_under``)."""
        return self.stack.slot_rows * max(self.step.width - 1, 0)

    def expand(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """y += the delta, given its shrink ``t`` from the fused GEMM."""
        return self.stack.add_delta_expand(y, t, self.step.row_slots)

    @property
    def folds(self) -> bool:
        """Whether a fused step's expand may be left to the op after the GEMM (``FOLD``)."""
        return FOLD

    def pending(self, t: torch.Tensor) -> PendingExpand:
        """``expand`` left for the op after the GEMM to add as it loads."""
        return PendingExpand(self.stack, t, self.step.row_slots)

    def runs_beside(self, num_rows: int) -> bool:
        """Whether this step's delta runs on the side stream, beside the base
        GEMM (``LoraLinear.forward_parts``): a rows step on CUDA, with
        ``BESIDE`` on, of a size the fused GEMM does not take (``fuses``:
        from ``MIN_SPLIT_FUSED_ROWS`` rows, where the rows kernels take several
        launches a linear; below, the fused GEMM and its one expand measure
        faster than a shrink beside the GEMM). Host state and shapes only,
        so a captured graph keeps the choice."""
        return (BESIDE and self.step.side is not None and self.step.row_slots is not None and not self.is_sampled
                and not self.fuses(num_rows))

    def fork(self) -> torch.cuda.StreamContext:
        """The side stream as the current one, after the work queued so far
        on the current stream (a graph capture's too): what runs under it
        is a branch of its own, beside what the current stream queues next."""
        side = self.step.side
        side.wait_stream(torch.cuda.current_stream(side.device))
        return torch.cuda.stream(side)

    def join(self) -> None:
        """The current stream waits for everything queued on the side stream."""
        side = self.step.side
        torch.cuda.current_stream(side.device).wait_stream(side)


class LoraLayers:
    """Every LoRA stack of one model, keyed by our module name, and its slots.

    ``install`` / ``clear`` run between steps on the runner's thread, never
    while a step reads the slot (the conductor installs only into slots no
    running row uses).
    """

    def __init__(self, stacks: dict[str, LoraStack], rules: CheckpointRules, step: LoraStep,
                 kernels: RowKernels = TORCH_ROWS, cuts: dict[str, dict[int | None, Cut]] | None = None,
                 linears: dict[str, LoraLinear] | None = None):
        self.stacks = stacks
        self.linears = linears or {}  # the decoder linears by stack name (the stacks' modules, bar the embedding)
        self.rules = rules
        # Stack -> {shard: where this rank's part of the module sits} (tensor parallelism; else empty).
        self.cuts = cuts or {}
        self.step = step
        self.kernels = kernels  # every stack's, picked once for the device (``lora_kernels``)
        self.uses_rows = kernels.uses_rows  # eager steps by rows (else host segments)

    @property
    def num_slots(self) -> int:
        return next(iter(self.stacks.values())).num_slots

    @property
    def device(self) -> torch.device:
        return next(iter(self.stacks.values())).a.device

    @property
    def fuses(self) -> bool:
        """Whether a decoder linear's A sits under its weight (``fuse_linear``)."""
        return any(stack.fused for stack in self.stacks.values())

    @property
    def max_rank(self) -> int:
        return next(iter(self.stacks.values())).max_rank

    # -- steps -------------------------------------------------------------

    def begin_step(self, chunk_slots: Sequence[int], query_lens: Sequence[int], sampled_slots: Sequence[int]) -> None:
        """Group this step's rows by slot: chunk ``i`` has ``query_lens[i]``
        rows on ``chunk_slots[i]``. A base-only step leaves the segments None.
        Where the kernels run (``uses_rows``) the step goes to
        ``begin_rows_step`` instead, with its own sampled rows unless it is
        a pure decode step (then they are the token rows)."""
        if not any(chunk_slots):
            self.end_step()
            return
        if self.uses_rows:
            width = self.width_for(chunk_slots, sum(query_lens))
            if _is_pure_decode(query_lens, chunk_slots, sampled_slots):
                self.begin_rows_step(self._on_device(chunk_slots), width=width)
                return
            sampled = self._on_device(sampled_slots) if any(sampled_slots) else None
            self.begin_rows_step(self._on_device(_token_slots(chunk_slots, query_lens)), sampled, width=width)
            if sampled is None:  # no sampled row has an adapter: the LM head skips its delta
                self.step.sampled_row_slots = self.step.sampled_row_groups = None
            return
        self.step.row_slots = None
        self.step.row_groups = None
        token_slots = _token_slots(chunk_slots, query_lens)
        self.step.token_slots = torch.tensor(token_slots, dtype=torch.int64)
        self.step.segments = build_segments(token_slots)
        self.step.sampled_segments = build_segments(sampled_slots) if any(sampled_slots) else None
        self.step.dense = self._dense(token_slots)
        self.step.sampled_dense = self._dense(sampled_slots) if any(sampled_slots) else None

    def _dense(self, slots: Sequence[int]) -> LazyDense | None:
        return LazyDense(slots, self.num_slots, self.device) if len(slots) <= MAX_DENSE_ROWS else None

    def _on_device(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)

    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile every kernel variant a step of up to ``max_num_tokens`` rows
        can launch, now: a Triton compile takes about a second, which in the
        middle of serving would stall every request in the batch. Runs each
        variant once on scratch tensors (slot rows of zeros: nothing changes),
        and a swap's piece copies on two scratch units."""
        if not self.uses_rows:
            return
        seen = set()
        for stack in self.stacks.values():
            shape = (tuple(stack.a.shape), tuple(stack.b.shape), stack.is_embedding, stack.fused)
            if shape not in seen:
                seen.add(shape)
                self.kernels.warm_up(stack, max_num_tokens)
        scratch = torch.zeros(2, dtype=torch.int16, device=self.device)
        self.kernels.piece_copies([scratch[:1]], [scratch[1:]])()
        torch.cuda.synchronize(self.device)

    def widths(self, num_rows: int) -> tuple[int, ...]:
        """The widths (``LoraStep.width``) a rows step of ``num_rows`` rows takes, ascending: where a fused
        GEMM runs and up to ``NARROW_MAX_ROWS`` rows, the slots below 2, 3, 5, 9, ... (one adapter slot, two,
        four, ...) and all of them; else all. A graph is captured for each (``step_graphs``)."""
        if num_rows > NARROW_MAX_ROWS or not self.fuses:
            return (self.num_slots,)
        return _narrow_widths(self.num_slots)

    def width_for(self, slots: Sequence[int], num_rows: int) -> int:
        """The narrowest of ``widths(num_rows)`` above every slot of ``slots`` (host ints: the step's)."""
        top = max(slots, default=0)
        return next(w for w in self.widths(num_rows) if w > top)

    def begin_rows_step(self, row_slots: torch.Tensor, sampled_row_slots: torch.Tensor | None = None, *,
                        width: int | None = None) -> None:
        """A step by rows: token row ``t`` runs on slot ``row_slots[t]`` (int32
        [T] on this model's device, 0 = base), the LM head's sampled row ``i``
        on ``sampled_row_slots[i]`` (int32 [S]; default: ``row_slots`` itself,
        as in a pure decode step, where the sampled rows are the token rows).

        The tensors are kept, not copied, and never read on the host: a caller
        capturing a CUDA graph passes its static slots buffers and rewrites
        them before each replay. ``width``: every row's slot is below it (default: all
        slots), the fused GEMMs read only those slots' A (``widths``). Call it inside the captured region: with the
        kernels it also groups the rows by slot on the device (a few small
        ops, once per step), which the replay must redo. Slots must be
        installed ones (not checked here: checking would read the device)."""
        self._check_row_slots("row_slots", row_slots)
        self.step.segments = None
        self.step.sampled_segments = None
        self.step.dense = self.step.sampled_dense = None
        self.step.token_slots = None
        width = self.num_slots if width is None else width
        if not 1 <= width <= self.num_slots:
            raise ValueError(f"a rows step's width is {width}; accepted: 1..{self.num_slots} (its rows' slots are below it)")
        self.step.row_slots = row_slots
        self.step.width = width
        self.step.row_groups = self._row_groups(row_slots)
        if sampled_row_slots is None:
            self.step.sampled_row_slots, self.step.sampled_row_groups = row_slots, self.step.row_groups
        else:
            self._check_row_slots("sampled_row_slots", sampled_row_slots)
            self.step.sampled_row_slots = sampled_row_slots
            self.step.sampled_row_groups = self._row_groups(sampled_row_slots)

    def _row_groups(self, row_slots: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        return next(iter(self.stacks.values())).row_groups(row_slots)  # the stacks share their kernels and slots

    def _check_row_slots(self, name: str, slots: torch.Tensor) -> None:
        if slots.dtype != torch.int32 or slots.dim() != 1 or slots.device != self.device:
            raise ValueError(
                f"{name} is {slots.dtype} {tuple(slots.shape)} on {slots.device}; "
                f"accepted: an int32 [num_rows] tensor on the LoRA stacks' device {self.device}"
            )

    def end_step(self) -> None:
        self.step.segments = None
        self.step.sampled_segments = None
        self.step.token_slots = None
        self.step.dense = self.step.sampled_dense = None
        self.step.row_slots = self.step.sampled_row_slots = None
        self.step.row_groups = self.step.sampled_row_groups = None

    def merged_weights(self) -> MergedWeights:
        """The decoder linears' weights with a copy of each as loaded, for steps of one adapter on
        merged weights (``lora.merge``): the copy's memory is taken now."""
        others = [stack for name, stack in self.stacks.items() if name not in self.linears]
        return MergedWeights([(module, self.stacks[name]) for name, module in self.linears.items()], others)

    # -- slots -------------------------------------------------------------

    def install(self, slot: int, weights: AdapterWeights) -> None:
        """Install ``weights`` into ``slot`` of every stack; modules the adapter
        does not target read zero. Every stack's slot is rewritten whole, so a
        reload never keeps an earlier tenant's rows; on any error the slot is
        left cleared. On CUDA it returns once the device holds the copy (it
        waits for its own stream only: see ``SlotStaging``). The slot's image
        is kept for a later ``reinstall`` (``max_slot_images``)."""
        self._check_slot(slot, weights.name)
        try:
            self._staging.install(slot, self._by_stack(slot, weights), key=weights.digest)
        except Exception:
            self.clear(slot)
            raise

    def reinstall(self, slot: int, name: str, digest: str) -> bool:
        """Install adapter ``name`` of ``digest`` into ``slot`` again from the
        image its last ``install`` kept; False when none is kept."""
        self._check_slot(slot, name)
        return self._staging.reinstall(slot, digest)

    def kept_images(self) -> list[str]:
        """The digests of the slot images kept for ``reinstall``, oldest use first."""
        return list(self._staging.images) if "_staging" in self.__dict__ else []

    def clear_slot_images(self) -> None:
        """Drop the kept slot images (the next install of each adapter builds its own again)."""
        if "_staging" in self.__dict__:
            self._staging.clear()

    # Slot images kept for reinstalls (pinned on CUDA): each is one slot of every
    # stack (~22 MB for a rank-16 all-linear Llama-3.2-1B adapter in bf16).
    max_slot_images = 4

    def start_staging(self) -> SlotStaging:
        """The install staging (on CUDA with its device twins) now: call
        before the KV cache is sized, which takes a share of what is free."""
        return self._staging

    @functools.cached_property
    def _staging(self) -> SlotStaging:
        twins = 0
        if self.device.type == "cuda":
            budget = DEVICE_IMAGES_SHARE * torch.cuda.get_device_properties(self.device).total_memory
            twins = min(self.max_slot_images, int(budget // max(1, slot_image_bytes(self.stacks))))
        return SlotStaging(self.stacks, self.device, max_images=self.max_slot_images, device_images=twins,
                           kernels=self.kernels)

    def clear(self, slot: int) -> None:
        for stack in self.stacks.values():
            stack.clear(slot)

    def _check_slot(self, slot: int, name: str) -> None:
        if not 0 < slot < self.num_slots:
            raise ValueError(
                f"adapter {name!r}: slot {slot} is out of range; accepted: 1..{self.num_slots - 1} "
                "(slot 0 is the base model; lora.max_loras sets the count)"
            )

    def _place(self, hf_module: str, name: str) -> tuple[str, int | None, int]:
        mapped = self.rules.place(hf_module)
        if mapped is None or mapped[0] not in self.stacks:
            raise ValueError(
                f"adapter {name!r}: module {hf_module!r} has no LoRA stack in this model; "
                f"accepted targets: {self._target_names()}"
            )
        return mapped

    def _target_names(self) -> str:
        """The checkpoint module names (their last part) an adapter may target here."""
        names = {rule.hf.rpartition(".")[2] for name in self.stacks for rule in self.rules.rules_for(name)}
        return ", ".join(sorted(names | {LM_HEAD}))

    def _by_stack(self, slot: int, weights: AdapterWeights) -> dict[str, list[tuple[int | None, LoraModule]]]:
        """The adapter's modules per stack as ``(shard, factors)``, each checked
        against its stack (a refusal names the module)."""
        by_stack: dict[str, list[tuple[int | None, LoraModule]]] = {}
        for hf_module, whole in weights.iter_modules():
            ours, shard, span = self._place(hf_module, weights.name)
            for shard, module in split_fused(whole, shard, span, self.stacks[ours].offsets):
                try:
                    module = shard_factors(module, self.cuts.get(ours, {}).get(shard), is_embedding=ours == EMBED_TOKENS)
                    self.stacks[ours].check(slot, shard or 0, module)
                except ValueError as err:
                    raise ValueError(f"adapter {weights.name!r}: module {hf_module!r} ({ours}): {err}") from None
                by_stack.setdefault(ours, []).append((shard, module))
        return by_stack


def split_fused(module: LoraModule, shard: int | None, span: int,
                offsets: Sequence[int]) -> list[tuple[int | None, LoraModule]]:
    """An adapter module on several shards of a stack at once (the whole of a
    fused module: ``shard`` None on a stack of several shards, or ``span``
    shards from ``shard``, as Qwen3.5's ``in_proj_qkv`` in our wider
    in-projection) as one part per shard: the same A, each shard's rows of B
    (``B A x`` split by output rows). Else as given; a B of the wrong size is
    left whole for the stack's check to refuse."""
    first, count = (0, len(offsets) - 1) if shard is None else (shard, span)
    lo, hi = offsets[first], offsets[first + count]
    if count == 1 or module.b.shape[0] != hi - lo:
        return [(shard, module)]
    return [(i, dataclasses.replace(module, b=module.b[offsets[i] - lo : offsets[i + 1] - lo]))
            for i in range(first, first + count)]


def shard_factors(module: LoraModule, cut: Cut | None, *, is_embedding: bool = False) -> LoraModule:
    """This rank's part of ``module``'s factors (views) for a base module cut
    at ``cut`` (None: held whole): B's rows of a column-parallel linear's
    outputs, A's columns of a row-parallel one's inputs, A's columns of the
    embedding's vocabulary rows. Factors of the wrong full size are left
    whole for the stack's check to refuse by shape."""
    if cut is None or cut.is_whole:
        return module
    if is_embedding or cut.dim == 1:  # A [r, in]: this rank's inputs (an embedding's in is the vocabulary)
        if module.a.shape[1] != cut.full:
            return module
        return dataclasses.replace(module, a=module.a[:, cut.start : cut.start + cut.size])
    if module.b.shape[0] != cut.full:  # B [out, r]: this rank's outputs
        return module
    return dataclasses.replace(module, b=module.b[cut.start : cut.start + cut.size])


def _token_slots(chunk_slots: Sequence[int], query_lens: Sequence[int]) -> list[int]:
    return [slot for slot, n in zip(chunk_slots, query_lens, strict=True) for _ in range(n)]


@functools.cache
def _narrow_widths(num_slots: int) -> tuple[int, ...]:
    """The slots below 2, 3, 5, 9, ... (the zero slot and one adapter slot, two, four, ...), then all of them."""
    widths, adapters = [], 1
    while adapters + 1 < num_slots:
        widths.append(adapters + 1)
        adapters *= 2
    return (*widths, num_slots)


def _is_pure_decode(query_lens: Sequence[int], chunk_slots: Sequence[int], sampled_slots: Sequence[int]) -> bool:
    """One row per chunk and every chunk sampled: the sampled rows are the
    token rows in the same order, so one slot per row serves every hook."""
    return len(sampled_slots) == len(chunk_slots) and all(n == 1 for n in query_lens)


# A linear's stack moves its A under the weight (``LoraStack.fuse_under``)
# while A's rows add at most this share to the weight's: the base GEMM then
# reads every slot's A too, about free for decode-sized steps, which are
# bound by reading the weight.
MAX_FUSED_SHARE = 0.25
# Kept slot images also stay on the device (a reinstall is then one device
# copy, queued with the steps: ``SlotStaging``), as many as fit this share of
# the device's memory (a rank-16 all-linear adapter: ~22 MB at Llama-3.2-1B's
# shape, ~86 MB at Llama-3.1-8B's), at most ``max_slot_images``.
DEVICE_IMAGES_SHARE = 0.01


def lora_kernels(device: torch.device | str) -> RowKernels:
    """What runs the rows delta on ``device``: the Triton kernels on CUDA
    where Triton imports, else the torch reference. Imported here, where the
    stacks are built, so ``ops`` never depends on its kernels."""
    if torch.device(device).type != "cuda":
        return TORCH_ROWS
    try:
        from mstar_actors.lora import triton_ops
    except ImportError:  # Triton missing or broken: correct, just slower
        return TORCH_ROWS
    return triton_ops


def enable_lora(
    model: nn.Module, rules: CheckpointRules, *, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device | str,
) -> LoraLayers:
    """Give every targetable module of ``model`` (a ``CausalLM``) a stack of
    ``num_slots`` slots (slot 0 = base) and return them. Called once, after
    the weights are loaded and before the KV cache is sized.

    Every stack's rows delta runs on ``lora_kernels(device)``, chosen here
    once. Where those take every step by rows (the Triton kernels), each
    decoder linear whose A rows fit ``MAX_FUSED_SHARE`` of its weight also
    computes the shrink of every slot in its base GEMM (``fuse_linear``)."""
    if num_slots < 2 or max_rank < 1:
        raise ValueError(f"LoRA needs num_slots >= 2 (slot 0 is the base) and max_rank >= 1; got {num_slots}, {max_rank}")
    step = LoraStep()
    stacks: dict[str, LoraStack] = {}
    cuts: dict[str, dict[int | None, Cut]] = {}
    linears: dict[str, LoraLinear] = {}
    kernels = lora_kernels(device)
    if kernels.uses_rows and torch.device(device).type == "cuda":
        step.side = torch.cuda.Stream(torch.device(device))
    kwargs = dict(num_slots=num_slots, max_rank=max_rank, dtype=dtype, device=device, kernels=kernels)
    # Only the text decoder (``model.model``): a vision tower's rows are not the step's token rows.
    for name, module in model.model.named_modules(prefix="model"):
        if isinstance(module, LoraLinear):
            sizes = getattr(module, "output_sizes", [module.out_features])
            stacks[name] = LoraStack(module.in_features, sizes, **kwargs)
            cuts[name] = module.tp_slices
            linears[name] = module
            module.lora = LoraHook(stacks[name], step)
            if kernels.uses_rows:
                fuse_linear(module, stacks[name])
        elif isinstance(module, LoraEmbedding):
            stacks[name] = LoraStack(module.num_embeddings, [module.embedding_dim], is_embedding=True, **kwargs)
            cuts[name] = module.tp_slices
            module.lora = LoraHook(stacks[name], step)
    # The LM head may be tied to the embedding (no module of its own); its
    # LoRA delta is independent of the tie, so it always gets a stack.
    spec = model.spec
    stacks[LM_HEAD] = LoraStack(spec.hidden_size, [model.layout.vocab_size], **kwargs)  # this rank's vocabulary
    cuts[LM_HEAD] = model.layout.vocab_cuts()
    model.lm_head_lora = LoraHook(stacks[LM_HEAD], step, is_sampled=True)
    return LoraLayers(stacks, rules, step, kernels, cuts, linears)


def fuse_linear(module: nn.Linear, stack: LoraStack) -> bool:
    """Serve ``module``'s base output from the first rows of one buffer whose
    next rows are ``stack``'s A (``LoraStack.fuse_under``), if A's rows fit
    ``MAX_FUSED_SHARE`` of the weight's and the dtypes agree; True if fused.
    The weight becomes a view of the buffer, so base-only steps run the same
    GEMM as before and the memory is the weight's plus A's, as unfused."""
    num_a_rows = (stack.num_slots - 1) * stack.slot_rows  # the adapter slots' (the zero slot has none)
    if num_a_rows > MAX_FUSED_SHARE * module.out_features or module.weight.dtype != stack.a.dtype:
        return False
    fused, fused_bias = stack.fuse_under(module.weight, module.bias)
    module.weight = nn.Parameter(fused[: module.out_features], requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(fused_bias[: module.out_features], requires_grad=False)
    module.fused_weight, module.fused_bias = fused, fused_bias
    module.fused_views = {}
    return True


__all__ = ["EMBED_TOKENS", "LM_HEAD", "LoraHook", "LoraLayers", "LoraStep", "ZERO_SLOT", "enable_lora", "fuse_linear",
           "lora_kernels", "shard_factors"]
