"""Steps of one adapter on merged weights (dLoRA's merge, OSDI '24).

While every row of a run of steps is on one adapter, each decoder linear's
weight can hold ``W + s * B @ A`` of that adapter, as PEFT's
``merge_and_unload`` makes it: those steps then run as the base model's
(the base step graphs, no LoRA kernel at all), so a server whose traffic is
one adapter at a time serves it at the base model's speed. The first step
with a row on another slot (or on the base) restores every weight from a
copy kept as loaded, exactly: no subtraction, no drift however often it
merges.

Two parts: ``MergePolicy`` (pure: which adapter the weights should hold
for a step, with hysteresis, so steps that alternate between one adapter
and a mix do not copy the weights each time, and a back-off for runs too
short to pay for their copies) and ``MergedWeights`` (the device work: the
copy, the merge, the restore, enqueued on the step's stream before the
step, so they are ordered after the steps before it; on CUDA each is one
captured graph).

Which slot the weights hold is this rank's own choice, made from the plans
alone, and no other rank needs it: a merged shard's output ``(W + sBA) x``
equals its unmerged ``Wx + s B(Ax)`` up to rounding, under tensor
parallelism too (each rank merges its own shard of each factor, as it
installs them). The merge rounds ``W + sBA`` once into the weight's dtype,
as PEFT's merge does: in bfloat16 a step's outputs move by about the
rounding of the outputs themselves; in float32 by far less.

An adapter on the token embedding or the LM head is never merged (the
embedding may be the head, tied), nor a slot installed again since the
weights took it: the policy keys an adapter by (slot, install count).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .ops import LoraStack

log = logging.getLogger(__name__)


class MergePolicy:
    """Which adapter the weights should hold for each step (pure host state).

    ``choose(tenant)``: ``tenant`` is the step's one adapter (any hashable
    key that changes when its slot is installed again), or None for a step
    with base rows, with rows of several adapters, or of an adapter that
    cannot be merged. Returns the tenant the weights must hold for the
    step, or None (the weights as loaded). A tenant is merged at its
    ``after_steps``-th step in a row as the only one, and held while every
    step stays on it.

    A merge and its restore read and write every decoder weight twice
    (about a millisecond for a 1B model on a GPU): worth it for a long run
    of one adapter's steps, not for many short ones (one request at a time,
    each on another adapter). So a merge that ends before it was held for
    ``HELD_ENOUGH`` times ``after_steps`` steps doubles the run the next one
    waits for (up to ``MAX_AFTER_STEPS``), and one held that long resets
    it: short runs soon stop merging, long ones merge as before."""

    HELD_ENOUGH = 4
    MAX_AFTER_STEPS = 1024

    def __init__(self, after_steps: int):
        if after_steps < 1:
            raise ValueError(f"merge after_steps is {after_steps}; accepted: 1 or more")
        self.base_after_steps = self.after_steps = after_steps
        self.merged: Hashable | None = None
        self._candidate: Hashable | None = None
        self._run = 0  # steps in a row on ``_candidate``
        self._held = 0  # steps run on the current merge

    def choose(self, tenant: Hashable | None) -> Hashable | None:
        if tenant is not None and tenant == self.merged:
            self._held += 1
            return tenant
        if self.merged is not None:
            self._restored()
        if tenant is None:
            self._candidate, self._run = None, 0
            return None
        if tenant != self._candidate:
            self._candidate, self._run = tenant, 0
        self._run += 1
        if self._run >= self.after_steps:
            self.merged, self._held = tenant, 1
        return self.merged

    def _restored(self) -> None:
        paid = self._held >= self.HELD_ENOUGH * self.base_after_steps
        self.after_steps = self.base_after_steps if paid else min(2 * self.after_steps, self.MAX_AFTER_STEPS)
        self.merged = None


class MergedWeights:
    """Every decoder linear's weight, a copy of it as loaded, and the slot merged into it.

    ``linears``: ``(module, stack)`` pairs, the module's ``weight`` being
    the rows its stack's shards cover (a fused stack's weight is a view of
    its buffer: ``LoraStack.fuse_under``); ``others``: the stacks that are
    not a decoder linear's (the embedding's, the LM head's). The copy costs
    the linears' weight bytes once more (``num_bytes``): made here, before
    the KV cache is sized from what is left."""

    def __init__(self, linears: Sequence[tuple[Any, LoraStack]], others: Sequence[LoraStack]):
        for module, stack in linears:
            weight, shape = module.weight, (stack.offsets[-1], stack.in_features)
            if weight.is_meta or not weight.is_floating_point() or tuple(weight.shape) != shape:
                raise ValueError(f"merged LoRA steps need each linear's float weight [out, in] as its stack covers "
                                 f"it; found {tuple(weight.shape)} {weight.dtype} on {weight.device} "
                                 "(quantized linears cannot be merged)")
        self.linears = list(linears)
        self.others = list(others)
        with torch.no_grad():
            self.loaded = [module.weight.detach().clone() for module, _ in self.linears]
        self.tenant: Hashable | None = None  # what the weights hold (None: as loaded)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # slot -> its merge (0: the restore), where captured

    @property
    def num_bytes(self) -> int:
        return sum(weight.nbytes for weight in self.loaded)

    def can_merge(self, slot: int) -> bool:
        """Whether ``slot``'s adapter targets decoder linears only (as its install left the stacks)."""
        return not any(stack.targets(slot) for stack in self.others)

    def hold(self, slot: int, tenant: Hashable | None) -> None:
        """Make the weights hold ``tenant`` (on ``slot``), or, with None, the weights as loaded; a
        no-op when they already do. Device work on the current stream, ordered after the steps
        enqueued before it and before those after; one graph launch each where ``capture`` made
        them. Should it fail halfway, the weights are known to hold neither, and the next call
        restores them first."""
        if tenant == self.tenant:
            return
        with torch.inference_mode():
            if self.tenant is not None:
                self._run(0, self._restore)
            if tenant is not None:
                self.tenant = _UNKNOWN
                self._run(slot, functools.partial(self._merge, slot))
        self.tenant = tenant

    def capture(self, num_slots: int) -> None:
        """On CUDA, one graph that restores every weight and one that merges each adapter slot
        ``1 .. num_slots - 1`` (the stacks are written in place, so a graph reads what the slot
        holds when it runs; an untargeted linear's slot is zeros, scale 0, and adds zero): a merge
        is one launch, not a few hundred small ones from the step's thread. Should a capture
        fail, merges run eagerly (logged): slower to switch, the same weights."""
        if not self.loaded or not self.loaded[0].is_cuda:
            return
        with torch.inference_mode():
            self._merge(1, every_linear=True)  # once eagerly (the GEMMs' first use), then back
            self._restore()
            try:
                torch.cuda.synchronize()
                for slot in range(num_slots):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        if slot == 0:
                            self._restore()
                        else:
                            self._merge(slot, every_linear=True)
                    self._graphs[slot] = graph
            except Exception as err:  # noqa: BLE001 - an optimisation: the eager path is the same work
                self._graphs.clear()
                log.warning("merged LoRA steps: capturing the merge and restore graphs failed (%s: %s); they run "
                            "eagerly, a few hundred launches a switch", type(err).__name__, err)

    def _run(self, slot: int, eager: Callable[[], None]) -> None:
        graph = self._graphs.get(slot)
        if graph is not None:
            graph.replay()
        else:
            eager()

    def _restore(self) -> None:
        for (module, _), loaded in zip(self.linears, self.loaded):
            module.weight.copy_(loaded)
            _changed(module)

    def _merge(self, slot: int, every_linear: bool = False) -> None:
        for module, stack in self.linears:
            if not (every_linear or stack.targets(slot)):
                continue
            weight = module.weight
            for shard in range(len(stack.output_sizes)):  # a shard its adapter leaves out has scale 0: adds zero
                rows = slice(stack.offsets[shard], stack.offsets[shard + 1])
                b = (stack.b[slot, rows] * stack.scales[shard, slot]).to(weight.dtype)  # on the device: no sync
                weight[rows].addmm_(b, stack.a[shard, slot])
            _changed(module)


_UNKNOWN = object()  # what the weights hold while a merge is being written (or after it failed)


def _changed(module: Any) -> None:
    """A CPU linear's packed copy of its weight is stale once the weight changes in place."""
    packed = getattr(module, "packed", None)
    if packed is not None:
        packed.release()


__all__ = ["MergePolicy", "MergedWeights"]
