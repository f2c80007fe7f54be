"""Factories and checkers for the scheduler tests: schedulers, requests,
hand-built StepDones, a fake worker that checks every plan, invariants."""

from __future__ import annotations

import random

from mstar_actors.messages import (
    RANK_MEMORY,
    Finished,
    MediaItem,
    Prepared,
    SampledToken,
    SamplingParams,
    StepDone,
    StepPlan,
    TensorRef,
    TokenDelta,
)
from mstar_actors.sched import Scheduler, SeqStatus

EOS = 2
ROOT = "base-model"


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=128,
        eos_token_ids=(EOS,),
        enable_prefix_caching=True,
    )
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def make_request(
    request_id: str = "r0",
    prompt: list[int] | None = None,
    num_prompt_tokens: int = 6,
    max_tokens: int = 16,
    prompt_param: str = "prompt",
    n: int = 1,
    num_media: int = 0,
    **sampling,
) -> Prepared:
    """``num_media`` items, each with an arena ref of its own (segment named
    for the request), on the prompt's first tokens (the scheduler never reads them).
    ``max_tokens`` is cut to the room the prompt leaves (``cut_to_context``)
    unless a test says otherwise."""
    sampling.setdefault("cut_to_context", True)
    if prompt is None:  # distinct per request id, so requests share a prefix only when a test says so
        rng = random.Random(request_id)
        prompt = [rng.randrange(10, 1000) for _ in range(num_prompt_tokens)]
    media = [MediaItem("image", make_ref(request_id, i), (1, 2, 2), token_offset=i, num_tokens=1)
             for i in range(num_media)]
    return Prepared(
        request_id=request_id,
        model="m",
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        prompt_param=prompt_param,
        media=media,
        media_digests=tuple(f"digest-{request_id}-{i}" for i in range(num_media)),
        n=n,
    )


def make_ref(request_id: str, index: int) -> TensorRef:
    return TensorRef(f"arena-{request_id}", 64 * index, 64, "float32", (4, 4))


def make_done(plan: StepPlan, tokens: dict[str, int] | None = None, default: int = 7) -> StepDone:
    """A StepDone sampling ``tokens[id]`` (else ``default``) for every chunk that samples."""
    tokens = tokens or {}
    sampled = [
        SampledToken(chunk.request_id, tokens.get(chunk.request_id, default))
        for chunk in plan.scheduled
        if chunk.sample
    ]
    return StepDone(step_id=plan.step_id, rank=0, sampled=sampled)


def run_step(sched: Scheduler, tokens: dict[str, int] | None = None, default: int = 7):
    plan = sched.schedule()
    assert plan is not None, "expected a plan"
    return plan, sched.update(make_done(plan, tokens, default))


def finished_of(outputs) -> dict[str, Finished]:
    return {out.request_id: out for out in outputs if isinstance(out, Finished)}


def tokens_of(outputs) -> dict[str, list[int]]:
    result: dict[str, list[int]] = {}
    for out in outputs:
        if isinstance(out, TokenDelta):
            result.setdefault(out.request_id, []).extend(t.token_id for t in out.tokens)
    return result


def chunks_of(plan: StepPlan) -> dict[str, tuple[int, int, bool]]:
    return {c.request_id: (c.num_computed, c.num_tokens, c.sample) for c in plan.scheduled}


def assert_no_blocks_used(sched: Scheduler) -> None:
    alloc = sched.allocator
    assert alloc.num_used == 0
    assert alloc.num_free == alloc.num_blocks
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))


def check_invariants(sched: Scheduler) -> None:
    """Block ownership, ref counts, the index and the queues agree."""
    alloc = sched.allocator
    holders = [0] * alloc.num_blocks
    for seq in sched.running:
        assert seq.status is SeqStatus.RUNNING
        assert len(set(seq.block_ids)) == len(seq.block_ids), f"{seq} holds a block twice"
        for block_id in seq.block_ids:
            holders[block_id] += 1
    for seq in sched.waiting:
        assert seq.status is SeqStatus.WAITING and not seq.block_ids and not seq.is_started
    for block_id, num_holders in enumerate(holders):
        assert alloc.ref_count(block_id) == num_holders, f"block {block_id}"
    assert alloc.num_used == sum(1 for n in holders if n > 0)
    for block_id in alloc.cached_free_ids():
        assert alloc.ref_count(block_id) == 0
        assert sched.prefix_index.get(alloc.hash_of(block_id)) == block_id
    num_hashed = sum(1 for b in range(alloc.num_blocks) if alloc.hash_of(b) is not None)
    assert num_hashed == len(sched.prefix_index)
    assert len(sched.running) <= sched.max_num_seqs
    ids = [s.request_id for s in sched.running] + [s.request_id for s in sched.waiting]
    assert sorted(ids) == sorted(sched.requests)
    check_state_slots(sched)


def check_state_slots(sched: Scheduler) -> None:
    """Running sequences hold distinct used slots (none without a pool), waiting ones none."""
    slots = [seq.state_slot for seq in sched.running]
    assert all(seq.state_slot == -1 for seq in sched.waiting), "a waiting sequence holds a state slot"
    pool = sched.state_slots
    if pool is None:
        assert all(slot == -1 for slot in slots), "a state slot without a pool"
        return
    assert len(set(slots)) == len(slots), f"running sequences share a state slot: {slots}"
    assert all(0 <= slot < pool.num_slots and pool.is_used(slot) for slot in slots), slots
    assert pool.num_used == len(sched.running)


class FakeWorker:
    """Executes plans the way a worker would, and checks them.

    It keeps, per block slot, the (root, position, token) whose KV was written
    there, so a chunk that reads a prefix (its own or a shared cached one)
    must find exactly its own tokens under its own root, written by an
    earlier step (rows of one step run as one batch).

    State slots: a started row's slot (when it has one) must not be held by
    a sequence the worker still knows, once the plan's ``finished`` is applied.
    It keeps, per state slot and per snapshot slot, the (root, tokens) whose
    recurrent state it holds, so a chunk that continues a state (past token
    0) must find exactly its own prefix there: in its slot from its earlier
    chunks, or restored from a snapshot of that prefix.

    Media: it applies the plan's orders as a rank does (``MediaCopies``),
    checking that every arena ref is released exactly once (copied or only
    released), that no key is copied twice or dropped unheld, and that every
    started row's media names a copy it holds.
    """

    def __init__(self, block_size: int, roots: dict[str, str]):
        self.block_size = block_size
        self.roots = roots  # request id -> root (workers never see roots; tests do)
        self.seqs: dict[str, list[int]] = {}  # request id -> all known tokens
        self.kv: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.copies: dict[int, TensorRef] = {}  # key -> the arena ref it was copied from
        self.released: list[TensorRef] = []  # arena refs this rank released, in order
        self.state_slots: dict[int, str] = {}  # state slot -> the request id whose state it holds
        self.slot_of: dict[str, int] = {}  # request id -> its state slot
        self.states: dict[int, tuple[str, tuple[int, ...]]] = {}  # state slot -> (root, tokens) of its state
        self.snapshots: dict[int, tuple[str, tuple[int, ...]]] = {}  # snapshot slot -> (root, tokens)
        self.num_restores = 0

    def run(self, plan: StepPlan, sample) -> StepDone:
        for request_id in plan.finished:
            assert self.seqs.pop(request_id, None) is not None, f"finished {request_id} unknown to the worker"
            self.state_slots = {slot: rid for slot, rid in self.state_slots.items() if rid != request_id}
        self.apply_media(plan)
        for start in plan.started:
            assert start.request_id not in self.seqs, f"{start.request_id} started twice"
            self.seqs[start.request_id] = start.prompt_token_ids + start.output_token_ids
            if start.state_slot >= 0:
                holder = self.state_slots.setdefault(start.state_slot, start.request_id)
                assert holder == start.request_id, f"{start.request_id} given state slot {start.state_slot} of {holder}"
                self.slot_of[start.request_id] = start.state_slot
                if start.restore_snapshot >= 0:
                    assert start.restore_snapshot in self.snapshots, f"{start.request_id}: restores an empty snapshot"
                    self.states[start.state_slot] = self.snapshots[start.restore_snapshot]
                    self.num_restores += 1
            for item in start.media:
                ref = item.pixel_values
                assert ref.segment == RANK_MEMORY and ref.offset in self.copies, f"{start.request_id}: {ref} not held"
        # One forward pass: every row reads the KV (and its state) as they were before the step.
        for chunk in plan.scheduled:
            assert chunk.num_tokens >= 1, f"{chunk.request_id}: empty chunk"
            self._check_prefix(chunk, self.seqs[chunk.request_id])
            self._check_state(chunk, self.seqs[chunk.request_id])
        sampled = []
        for chunk in plan.scheduled:
            tokens = self.seqs[chunk.request_id]
            self._write(chunk, tokens)
            if chunk.sample:
                assert chunk.num_computed + chunk.num_tokens == len(tokens)
                token_id = sample(chunk.request_id)
                tokens.append(token_id)
                sampled.append(SampledToken(chunk.request_id, token_id))
            else:
                assert chunk.num_computed + chunk.num_tokens < len(tokens)
        return StepDone(step_id=plan.step_id, rank=0, sampled=sampled)

    def apply_media(self, plan: StepPlan) -> None:
        for ref in plan.release_media:
            self._release(ref)
        for key in plan.drop_media:
            assert self.copies.pop(key, None) is not None, f"drop of media key {key}, not held"
        for order in plan.copy_media:
            assert order.key not in self.copies, f"media key {order.key} copied twice"
            self.copies[order.key] = order.ref
            self._release(order.ref)

    def _release(self, ref: TensorRef) -> None:
        assert ref.segment != RANK_MEMORY and ref not in self.released, f"{ref} released twice"
        self.released.append(ref)

    def _check_state(self, chunk, tokens: list[int]) -> None:
        """A chunk past token 0 continues its slot's state, which must be its own
        prefix; then the slot holds the state after the chunk (and the named
        snapshot a copy of it)."""
        slot = self.slot_of.get(chunk.request_id, -1)
        if slot < 0:
            assert chunk.snapshot < 0, f"{chunk.request_id}: a snapshot without a state slot"
            return
        root, stop = self.roots[chunk.request_id], chunk.num_computed + chunk.num_tokens
        if chunk.num_computed:
            assert self.states.get(slot) == (root, tuple(tokens[: chunk.num_computed])), (
                f"{chunk.request_id}: its state slot {slot} does not hold its first {chunk.num_computed} tokens")
        self.states[slot] = (root, tuple(tokens[:stop]))
        if chunk.snapshot >= 0:
            assert stop % self.block_size == 0, f"{chunk.request_id}: a snapshot off a block boundary ({stop})"
            self.snapshots[chunk.snapshot] = self.states[slot]

    def _slot(self, chunk, position: int) -> tuple[int, int]:
        return chunk.block_ids[position // self.block_size], position % self.block_size

    def _check_prefix(self, chunk, tokens: list[int]) -> None:
        root = self.roots[chunk.request_id]
        for position in range(chunk.num_computed):
            assert self.kv.get(self._slot(chunk, position)) == (root, position, tokens[position]), (
                f"{chunk.request_id}: stale KV at position {position}"
            )

    def _write(self, chunk, tokens: list[int]) -> None:
        root = self.roots[chunk.request_id]
        assert len(chunk.block_ids) * self.block_size >= chunk.num_computed + chunk.num_tokens
        for position in range(chunk.num_computed, chunk.num_computed + chunk.num_tokens):
            self.kv[self._slot(chunk, position)] = (root, position, tokens[position])
