"""Continuous batching with chunked prefill, prefix caching and preemption.

The conductor drives it in a loop: ``add`` / ``abort`` as messages arrive,
``schedule()`` -> one ``StepPlan`` to every rank, ``update(StepDone)`` ->
tokens and endings for the frontend. No I/O, no asyncio, no torch.

The plan is final as ``schedule()`` returns it: KV blocks, each chunk's
LoRA slot (the adapter pool's admission, passed to ``add``, or where it
moved the sequence since: ``set_lora_slot``), its recurrent-state slot and
the media orders are in it; nothing edits it on its way to the ranks.

Planning ahead (``max_in_flight=2``, the conductor's overlapped steps): the
next plan is made while a step runs, so a rank finds it waiting when the
step ends instead of idling for the result's round trip and the planning.
A running sequence whose in-flight chunk samples is planned one token
further (the ranks append what they sample before they run the next plan),
unless what is known already ends it (``max_tokens``, the context); an end
that only the sampled token shows (EOS, a stop token) is applied one step
late and exactly: the row planned past it computes a token nobody reads.
``max_in_flight=3`` plans two steps ahead of the results by the same rules
(a row per sampling step in flight further; an EOS then voids two rows), so
the conductor's own turn is behind a step as well: a rank finds the plan
after next waiting when it has answered one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from mstar_actors.messages import (
    ConductorToFrontend,
    EngineStats,
    Failed,
    Finished,
    Prepared,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SeqStart,
    StepDone,
    StepFailed,
    StepPlan,
    TokenDelta,
    choice_ids,
)
from mstar_actors.ring_sizes import ID_BYTES, sequence_ids
from mstar_actors.sched.block_allocator import BlockAllocator
from mstar_actors.sched.media import MediaLedger
from mstar_actors.sched.prefix_index import PrefixIndex
from mstar_actors.sched.sequence import Sequence, SeqStatus
from mstar_actors.sched.state_slots import StateSlotAllocator
from mstar_actors.sched.state_snapshots import SnapshotIndex

PARKED = -1  # a sequence's lora_slot while its adapter has no slot (``set_lora_slot``)
ROW_BYTES = 96  # a row's fields in a plan beside its block table, encoded, with room


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of a request: with a seed, it samples with seed + index
    (wrapped within int64), so choices differ and each reproduces."""
    if sampling.seed is None or index == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index + (1 << 63)) % (1 << 64) - (1 << 63))


def _start_bytes(num_tokens: int, block_size: int, fields_bytes: int) -> int:
    """What a sequence of ``num_tokens`` starting takes in a plan at most: its ids, its row's table, its fields."""
    return ID_BYTES * sequence_ids(num_tokens, block_size) + ROW_BYTES + fields_bytes


def _fields_bytes(req: Prepared) -> int:
    """A request's sampling fields and media, encoded (once a request)."""
    return len(_ENCODER.encode(req.sampling)) + len(_ENCODER.encode(req.media))


_ENCODER = msgspec.msgpack.Encoder()


def _score_entries(num_prompt: int, prompt_logprobs: int | None) -> int:
    """Entries of a prompt's logprobs: each token after the first, and its alternatives."""
    return 0 if prompt_logprobs is None else (num_prompt - 1) * (1 + prompt_logprobs)


def _constraint_fields(sampling: SamplingParams, num_outputs: int) -> list[str]:
    """The request fields whose token masks may have left no token to sample
    for output token ``num_outputs`` (from 0), as the client named them."""
    fields = [name for name, given in (("allowed_token_ids", sampling.allowed_token_ids),
                                       ("bad_words", sampling.bad_words_token_ids)) if given]
    if sampling.structured is not None:
        fields.append(sampling.structured.param or "structured_outputs")
    if num_outputs < sampling.min_tokens:  # its stop tokens are masked until it is reached
        fields.append("min_tokens")
    return fields


class _StepBuilder:
    """The plan being built by one ``schedule()`` call."""

    def __init__(self, budget: int):
        self.budget = budget
        self.plan_bytes = 0  # what the plan's rows and starts take encoded, at most (``Scheduler.max_plan_bytes``)
        self.score_entries = 0  # prompt logprobs (entries: a position's token and its alternatives) this step carries
        self.scored_tokens = 0  # prompt positions this step puts through the LM head for their logprobs
        self.chunks: dict[str, tuple[Sequence, ScheduledChunk]] = {}
        self.started: list[SeqStart] = []
        self.snapshots: dict[str, tuple[int, bytes]] = {}  # request id -> (reserved slot, prefix hash)

    def add(self, seq: Sequence, num_tokens: int, snapshot: tuple[int, bytes] | None = None,
            start: int | None = None, num_left: int | None = None) -> None:
        """A chunk of ``num_tokens`` of ``seq`` from ``start`` (its ``num_scheduled``), of the
        ``num_left`` it has ahead: the caller's, where it read them already."""
        if start is None:
            start, num_left = seq.num_scheduled, seq.num_tokens_ahead - seq.num_scheduled
        chunk = ScheduledChunk(
            request_id=seq.request_id,
            num_computed=start,
            num_tokens=num_tokens,
            block_ids=list(seq.block_ids),
            sample=num_tokens == num_left,
            snapshot=-1 if snapshot is None else snapshot[0],
            lora_slot=seq.lora_slot,
        )
        self.chunks[seq.request_id] = (seq, chunk)
        self.budget -= num_tokens
        self.plan_bytes += ID_BYTES * len(chunk.block_ids) + ROW_BYTES
        if snapshot is not None:
            self.snapshots[seq.request_id] = snapshot

    def group_by_slot(self) -> None:
        """The chunks so far ordered by LoRA slot (base first), each slot's in
        the order they came: a step's rows of one adapter side by side, so the
        kernels' tiles of rows (``triton_fused.FOLD_ROWS``) mostly hold one."""
        self.chunks = dict(sorted(self.chunks.items(), key=lambda item: item[1][1].lora_slot))

    def drop(self, seq: Sequence) -> tuple[int, bytes] | None:
        """Take back a chunk of a sequence preempted later in the same call;
        returns the snapshot it had reserved, for the caller to release."""
        entry = self.chunks.pop(seq.request_id, None)
        if entry is not None:
            self.budget += entry[1].num_tokens
            self.plan_bytes -= ID_BYTES * len(entry[1].block_ids) + ROW_BYTES
        return self.snapshots.pop(seq.request_id, None)


class _InFlight:
    """A step sent to the ranks: its rows, each with its sequence's epoch when
    planned (a row is live while that epoch lasts), and its reserved snapshots."""

    def __init__(self, step_id: int, rows: list[tuple[Sequence, ScheduledChunk]],
                 snapshots: dict[str, tuple[int, bytes]]):
        self.step_id = step_id
        self.rows = [(seq, chunk, seq.epoch) for seq, chunk in rows]
        self.snapshots = snapshots
        for seq, chunk in rows:
            seq.num_in_flight += chunk.num_tokens
            seq.num_samples_in_flight += chunk.sample

    def live_rows(self) -> list[tuple[Sequence, ScheduledChunk]]:
        return [(seq, chunk) for seq, chunk, epoch in self.rows
                if seq.status is SeqStatus.RUNNING and seq.epoch == epoch]

    def land(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        """A live row's step is over (done or failed): its counts leave the flight."""
        seq.num_in_flight -= chunk.num_tokens
        seq.num_samples_in_flight -= chunk.sample


class Scheduler:
    """The conductor's decider: queues, KV block table, prefix index, media
    and recurrent-state slots.

    A request of ``n`` choices is ``n`` sequences (``choice_ids``) sharing its
    prompt and media; each is scheduled, preempted and ended on its own, and
    its outputs name its choice.

    Invariants:

    - at most ``max_in_flight`` plans are in flight (1, or 2 or 3 when
      planning ahead): ``schedule()`` refuses to run past that until ``update()`` (or
      ``fail_step()``) has consumed the oldest result. Ranks run plans in
      order, so a block freed while steps are in flight (an abort, an end,
      a preemption) is handed out only in a later plan: what an in-flight
      step writes there lands before its new owner's writes, and rows of a
      sequence whose epoch has changed are void (their results ignored);
    - ``num_computed`` advances only in ``update()``, and a full block enters
      the prefix index only there, once its KV really exists;
    - a sequence's id goes into ``StepPlan.finished`` exactly when the workers
      hold state for it and it ends or is preempted, so a restarted sequence's
      id appears in ``finished`` before (or in the same plan as) its new
      ``SeqStart``, and workers apply ``finished`` first;
    - a request's media is copied by the ranks in the plan of its first
      ``SeqStart`` and dropped (or released, when none started) in a plan
      after its last choice ended (``MediaLedger``);
    - with ``num_state_slots > 0`` (a model with recurrent layers) a sequence
      holds a state slot exactly while it runs: taken at admission, before
      its ``SeqStart`` (which names it), given back with its blocks when it
      ends or is preempted; so the slots used are the running sequences.
      While every slot is in use the head of the queue waits (FIFO, like KV
      blocks); it is never failed for it. A restart may get another slot; it
      recomputes from token 0, so the ranks rebuild its state there. A freed
      slot is reused under the same in-flight rule as a freed block.
    - a parked sequence (``lora_slot == PARKED``, adapter churn) is in no
      plan until it is moved to a slot; it keeps its place in the queues and
      everything it holds, and the others (the head of the waiting queue too)
      go on without it.

    - prefix caching with recurrent state (``num_state_snapshots > 0``): a hit
      needs, beside the prefix's KV blocks, a snapshot of the state after its
      last block (``SnapshotIndex``), restored into the sequence's slot by
      its ``SeqStart.restore_snapshot``; the hit is the longest cached prefix
      that has one. Snapshots are taken where a prompt's last full block
      ends (what a multi-turn conversation and a repeated prompt share): the prefill chunk that would cross that
      boundary stops at it and names a reserved slot
      (``ScheduledChunk.snapshot``), whose prefix enters the index in
      ``update()`` once the state exists, like a full block's KV.

    With ``num_state_slots > 0`` and no snapshots, prefix caching is off
    whatever ``enable_prefix_caching`` says: a hit would restore the KV of a
    prefix but not the recurrent state after it.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        max_in_flight: int = 1,
        max_prompt_logprob_entries: int = 1 << 16,
        max_scored_tokens: int = 512,
        max_plan_bytes: int = 1 << 62,
    ):
        if max_in_flight not in (1, 2, 3):
            raise ValueError(f"scheduler: max_in_flight must be 1, 2 or 3 (plan up to two steps ahead), "
                             f"got {max_in_flight}")
        for name, value in [
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ]:
            if value < 1:
                raise ValueError(f"scheduler: {name} must be >= 1, got {value}")
        if num_state_slots < 0:
            raise ValueError(f"scheduler: num_state_slots must be >= 0 (0: no recurrent state), got {num_state_slots}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # One sequence can never hold more KV than the whole cache.
        self.max_kv_tokens = num_blocks * block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.state_slots = StateSlotAllocator(num_state_slots) if num_state_slots else None
        # A hybrid model's hit restores its state from a snapshot (see the class docstring).
        is_stateful = num_state_slots > 0
        self.snapshots = SnapshotIndex(num_state_snapshots) if is_stateful and num_state_snapshots > 0 else None
        self.enable_prefix_caching = enable_prefix_caching and (not is_stateful or self.snapshots is not None)
        self.prefix_index = PrefixIndex()
        self.allocator = BlockAllocator(num_blocks, block_size, self.prefix_index)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Sequence] = {}  # choice id -> its sequence, until it ends
        self.choices: dict[str, list[str]] = {}  # request id -> its choices still going
        self.media = MediaLedger()
        self.num_preemptions = 0
        self._num_arrivals = 0
        self._next_step_id = 0
        self.max_in_flight = max_in_flight
        # Prompt logprobs leave with a request's first token, in its step's result:
        # one request's, and one step's, at most this many entries (a position's
        # token, or one of its alternatives), so the ranks' results fit their rings.
        self.max_prompt_logprob_entries = max_prompt_logprob_entries
        # and a step computes the logits of at most this many prompt positions ([positions, vocab] float32 at once)
        self.max_scored_tokens = max_scored_tokens
        # A plan's starts (their ids) and rows (their tables), encoded, at most this many bytes (the ring to the
        # ranks holds it: ``ring_sizes``): the rest wait for the next step; a sequence too large alone is refused.
        self.max_plan_bytes = max_plan_bytes
        self._left_out: Sequence | None = None  # the first running row a plan's bound left out: the next starts there
        self._in_flight: deque[_InFlight] = deque()  # oldest first
        self._finished_ids: list[str] = []  # for the next plan's ``finished``

    # ------------------------------------------------------------------ intake

    def receive(self, req: Prepared) -> None:
        """Own ``req``'s media from its arrival, before the adapter pool admits
        it (``add``) or refuses it (``abort``): the media is released either way."""
        if not self._is_in_use(req, choice_ids(req.request_id, req.n)):
            self.media.add(req.request_id, req.media)

    def add(self, req: Prepared, root: str, lora_slot: int = 0) -> list[Failed]:
        """Queue ``req``'s choices (KV under weights named ``root``, rows on
        ``lora_slot``), or refuse each of them at once."""
        ids = choice_ids(req.request_id, req.n)
        if self._is_in_use(req, ids):
            self.media.release(req.media)  # the live request of that id keeps its own
            message = f"request id {req.request_id!r} is already in use; send a unique id"
            return [self._refuse(rid, "request_id", message) for rid in ids]
        self.media.add(req.request_id, req.media)
        fields_bytes = _fields_bytes(req)
        refusal = self._check_prompt(req, fields_bytes)
        if refusal is not None:
            self.media.end(req.request_id)
            return [msgspec.structs.replace(refusal, request_id=rid) for rid in ids]
        num_prompt = len(req.prompt_token_ids)
        # a client's cap fits (``_check_prompt``); a default is cut to the room the prompt leaves
        max_tokens = min(req.sampling.max_tokens, self._room(num_prompt))
        self.choices[req.request_id] = list(ids)
        for index, rid in enumerate(ids):
            seq = Sequence(rid, req, choice_sampling(req.sampling, index), root=root, lora_slot=lora_slot,
                           max_tokens=max_tokens, arrival=self._num_arrivals, block_size=self.block_size,
                           fields_bytes=fields_bytes)
            self._num_arrivals += 1
            self.requests[rid] = seq
            self.waiting.append(seq)
        return []

    def set_lora_slot(self, request_ids: Iterable[str], slot: int) -> None:
        """Move choices to another LoRA slot, or park them (``PARKED``): a
        parked sequence keeps its KV blocks and state slot but is left out of
        every step until the adapter pool gives its adapter a slot again (its
        chunks then name the new slot). The pool parks a slot's rows only
        between a step's plan and the install it sends after it, so every
        rank sees the last step on the old slot before the swap; an unknown
        id (ended meanwhile) is skipped."""
        for rid in request_ids:
            if (seq := self.requests.get(rid)) is not None:
                seq.lora_slot = slot

    def abort(self, request_id: str) -> list[Finished]:
        """Stop a request (every choice) or one choice now, wherever it is.
        Idempotent: only the first call returns the ``Finished`` of each
        choice; an unknown or ended id is a no-op. A request received but
        never added (the adapter pool ended it) only has its media released."""
        ids = self.choices.get(request_id)
        if ids is None and self.media.holds(request_id) and request_id not in self.requests:
            self.media.end(request_id)
            return []
        return [self._finish(self.requests[rid], "abort") for rid in list(ids or [request_id]) if rid in self.requests]

    def _is_in_use(self, req: Prepared, ids: list[str]) -> bool:
        return req.request_id in self.choices or any(rid in self.requests for rid in ids)

    def _check_prompt(self, req: Prepared, fields_bytes: int) -> Failed | None:
        num_prompt, max_tokens = len(req.prompt_token_ids), req.sampling.max_tokens
        if num_prompt == 0:
            return self._refuse(req.request_id, req.prompt_param, "the prompt is empty; send at least one token")
        if num_prompt >= self.max_model_len:
            message = (
                f"the prompt has {num_prompt} tokens, but max_model_len is {self.max_model_len} tokens for prompt "
                f"and output together; shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
            return self._refuse(req.request_id, req.prompt_param, message, code="context_length_exceeded")
        if num_prompt >= self.max_kv_tokens:
            message = (
                f"the prompt has {num_prompt} tokens, but the whole KV cache holds {self.max_kv_tokens} tokens "
                f"(max_model_len is {self.max_model_len}); shorten the prompt to at most {self.max_kv_tokens - 1} "
                f"tokens or give the server more KV blocks"
            )
            return self._refuse(req.request_id, req.prompt_param, message, code="context_length_exceeded")
        longest = num_prompt + min(max_tokens, self._room(num_prompt))  # (restarted, a start carries its outputs)
        if (need := _start_bytes(longest, self.block_size, fields_bytes)) > self.max_plan_bytes:
            message = (
                f"the request's prompt of {num_prompt} tokens, its output and its other fields take up to {need} "
                f"bytes in a step's plan, more than one carries ({self.max_plan_bytes}, from transport.ring_bytes); "
                f"send a shorter prompt, a smaller max_tokens or smaller fields (a schema, stop strings, logit_bias), "
                f"or raise transport.ring_bytes"
            )
            return self._refuse(req.request_id, req.prompt_param, message)
        entries = _score_entries(num_prompt, req.sampling.prompt_logprobs)
        if entries > self.max_prompt_logprob_entries:
            message = (
                f"the prompt's logprobs ({num_prompt} tokens with {req.sampling.prompt_logprobs} alternatives each: "
                f"{entries} entries; echo with logprobs, or prompt_logprobs) are more than one step's result "
                f"carries ({self.max_prompt_logprob_entries}, "
                "from transport.ring_bytes); ask for fewer alternatives or send a shorter prompt"
            )
            return self._refuse(req.request_id, "prompt_logprobs", message)
        room = self._room(num_prompt)
        # The cap the client sent must fit; a default cap is cut to the room, which min_tokens must fit then.
        cut = req.sampling.cut_to_context
        asked, param = (req.sampling.min_tokens, "min_tokens") if cut else (max_tokens, "max_tokens")
        if asked > room:
            limit = (f"max_model_len is {self.max_model_len} tokens for prompt and output together"
                     if self.max_model_len <= self.max_kv_tokens else
                     f"the whole KV cache holds {self.max_kv_tokens} tokens (max_model_len is {self.max_model_len})")
            message = (  # (the frontend names the field the client sent: max_tokens or max_completion_tokens)
                f"{param} is {asked}, but the prompt has {num_prompt} tokens and "
                f"{limit}: {asked} > {num_prompt + room} - {num_prompt}; ask for at most {room} tokens or "
                f"shorten the prompt"
            )
            return self._refuse(req.request_id, param, message, code="context_length_exceeded")
        return None

    def _room(self, num_prompt: int) -> int:
        """The output tokens a prompt of ``num_prompt`` leaves: in the context and in the whole KV cache."""
        return min(self.max_model_len, self.max_kv_tokens) - num_prompt

    @staticmethod
    def _refuse(request_id: str, param: str, message: str, code: str | None = None) -> Failed:
        return Failed(request_id=request_id, status=400, message=message, param=param, code=code)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute.

        Order: decodes of running sequences, then their unfinished prefills,
        then waiting requests in FIFO order (skipped in a step that preempted,
        so a victim is not re-admitted at once; one is admitted only where
        its whole prompt fits beside the running). Earlier admitted sequences
        are scheduled first everywhere, so the oldest one always progresses;
        with ``max_num_batched_tokens < max_num_seqs`` the newest decodes
        wait. Rows a plan's size left out (``max_plan_bytes``) come first in
        the next, which walks on from the first of them. The plan lists the
        decodes grouped by LoRA slot (``group_by_slot``), then the prefills
        in the order they were scheduled.
        """
        if not self.can_schedule():
            raise RuntimeError(
                f"schedule() while step(s) {[f.step_id for f in self._in_flight]} are in flight "
                f"(at most {self.max_in_flight}); pass the oldest's StepDone to update() "
                "(or its StepFailed to fail_step()) first"
            )
        step = _StepBuilder(self.max_num_batched_tokens)
        num_preemptions = self.num_preemptions
        first, self._left_out = self._left_out, None
        self._schedule_running(step, True, first)
        step.group_by_slot()
        self._schedule_running(step, False, first)
        if self.num_preemptions == num_preemptions or not step.chunks:
            self._admit_waiting(step)
        if not step.chunks:
            return None
        return self._emit(step)

    def schedule_orders(self) -> StepPlan | None:
        """A plan of no rows carrying the orders collected since the last plan
        (sequences the ranks must forget, media to drop or release), or None
        when there are none: with no step to follow an abort or an end, the
        ranks would otherwise hold those until the next request."""
        if not self.can_schedule() or not (self._finished_ids or self.media.has_orders()):
            return None
        return self._emit(_StepBuilder(0))

    def _emit(self, step: _StepBuilder) -> StepPlan:
        plan = StepPlan(
            step_id=self._next_step_id,
            started=step.started,
            scheduled=[chunk for _, chunk in step.chunks.values()],
            finished=self._finished_ids,
            **self._media_orders(),
        )
        self._in_flight.append(_InFlight(self._next_step_id, list(step.chunks.values()), step.snapshots))
        self._next_step_id += 1
        self._finished_ids = []
        return plan

    def can_schedule(self) -> bool:
        """Whether ``schedule()`` may plan another step now (see ``max_in_flight``)."""
        return len(self._in_flight) < self.max_in_flight

    def _media_orders(self) -> dict:
        copies, drops, releases = self.media.take()
        return dict(copy_media=copies, drop_media=drops, release_media=releases)

    def _schedule_running(self, step: _StepBuilder, decodes: bool, first: Sequence | None) -> None:
        # A row at a time over every running sequence, every step: the conductor's
        # largest cost at hundreds of rows, so each fact is read once a row.
        chunks, hybrid = step.chunks, self.snapshots is not None
        near_full = self.max_plan_bytes - ID_BYTES * _cdiv(self.max_model_len, self.block_size)  # (a row's at most)
        rows = list(self.running)
        if first is not None:  # the last plan's bound left rows out from ``first`` on: they go first
            at = next((i for i, seq in enumerate(rows) if seq is first), 0)
            rows = rows[at:] + rows[:at]
        for seq in rows:
            if step.budget == 0:
                return
            if seq.status is not SeqStatus.RUNNING or seq.request_id in chunks or seq.lora_slot == PARKED:
                continue  # preempted, already scheduled this step, or parked
            ahead = seq.num_tokens_ahead
            if seq.num_samples_in_flight and self._ends_in_flight(seq, ahead):
                continue
            start = seq.num_scheduled
            num_left = ahead - start
            if (num_left == 1) != decodes:
                continue
            num_new = min(num_left, step.budget)
            if hybrid:
                num_new = self._snapshot_point_cut(seq, start, num_new)
            if seq.sampling.prompt_logprobs is not None:  # its prompt's last token may be the decode pass's
                num_new = self._score_cut(seq, step, num_new, num_left)
                if num_new == 0:
                    continue
            if step.plan_bytes > near_full and chunks and (
                    step.plan_bytes + ID_BYTES * _cdiv(start + num_new, self.block_size) > self.max_plan_bytes):
                if self._left_out is None:
                    self._left_out = seq
                return  # the rest of the rows: the next plan (a shared prefix's tables, at hundreds of rows)
            if self._reserve_blocks(seq, start + num_new, step):
                step.add(seq, num_new, self._snapshot_to_take(seq, num_new) if hybrid else None, start, num_left)

    def _ends_in_flight(self, seq: Sequence, ahead: int) -> bool:
        """Whether a token being sampled in flight ends ``seq`` (``ahead``: its
        ``num_tokens_ahead``) whatever it is (its ``max_tokens``, or the
        context): then no row is planned past it."""
        return ahead - seq.num_prompt_tokens >= seq.max_tokens or ahead >= self.max_model_len

    def _reserve_blocks(self, seq: Sequence, stop: int, step: _StepBuilder) -> bool:
        """Blocks for a running ``seq``'s tokens up to ``stop``, preempting
        the latest admitted sequences (maybe ``seq`` itself) until they fit."""
        num_needed = _cdiv(stop, self.block_size) - len(seq.block_ids)
        if num_needed <= 0:
            return True  # most decodes: the last block still has room
        while not self.allocator.can_allocate(num_needed):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        seq.block_ids += self.allocator.allocate(num_needed)
        return True

    def _preempt(self, seq: Sequence, step: _StepBuilder) -> None:
        """Preempt by recompute: free everything, requeue at the head."""
        if (snapshot := step.drop(seq)) is not None:
            self.snapshots.release(snapshot[0])
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def _admit_waiting(self, step: _StepBuilder) -> None:
        parked = []  # FIFO among the others; a parked one keeps its place
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            if self.waiting[0].lora_slot == PARKED:
                parked.append(self.waiting.popleft())
            elif not self._try_admit(self.waiting[0], step):
                break  # FIFO: nobody overtakes the head
        self.waiting.extendleft(reversed(parked))

    def _try_admit(self, seq: Sequence, step: _StepBuilder) -> bool:
        if self.state_slots is not None and not self.state_slots.can_allocate():
            return False  # backpressure: a running sequence's end or preemption frees one
        start_bytes = _start_bytes(seq.num_tokens, self.block_size, seq.fields_bytes)
        if step.chunks and step.plan_bytes + start_bytes > self.max_plan_bytes:
            return False  # the next plan carries it
        hits, restore = self._lookup_prefix(seq)
        num_computed = len(hits) * self.block_size
        num_new = self._snapshot_point_cut(seq, num_computed, min(seq.num_tokens - num_computed, step.budget))
        num_new = self._score_cut(seq, step, num_new, seq.num_tokens - num_computed)
        if num_new == 0:
            return False  # its prompt logprobs leave with the next step's result
        num_needed = _cdiv(num_computed + num_new, self.block_size) - len(hits)
        # Hits that are cached-free leave the free pool when shared.
        num_revived = sum(1 for block_id in hits if self.allocator.ref_count(block_id) == 0)
        # Its whole prompt must fit beside the running, not only this chunk: admitted on a first chunk, its
        # next one would preempt it (the newest), its chunk in flight uncached, and it would come straight
        # back: a wasted prefill every other step while the others crawl. It waits for the room instead.
        # The running's own prompts come first: a prefill cut short of the budget (prompt logprobs, a
        # snapshot point) still needs the blocks of its rest.
        num_whole = _cdiv(seq.num_tokens, self.block_size) - len(hits)
        num_owed = sum(max(0, _cdiv(s.num_tokens, self.block_size) - len(s.block_ids)) for s in self.running)
        if not self.allocator.can_allocate(num_whole + num_revived + num_owed):  # (num_whole >= num_needed)
            return False
        self.allocator.share(hits)  # before allocate(), which could evict them
        seq.block_ids = hits + self.allocator.allocate(num_needed)
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.allocate()
        seq.num_computed = num_computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_computed
            seq.num_queried_tokens = seq.num_tokens if self._reads_cache(seq) else 0
        self.waiting.popleft()
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING
        seq.is_started = True
        media = self.media.start(seq.parent_id)  # names the ranks' copies; the first start orders them
        outputs = list(seq.output_token_ids)
        step.started.append(SeqStart(seq.request_id, seq.prompt_token_ids, seq.sampling, outputs, media, seq.lora_slot,
                                     state_slot=seq.state_slot, restore_snapshot=restore))
        step.plan_bytes += start_bytes - ID_BYTES * _cdiv(seq.num_tokens, self.block_size) - ROW_BYTES  # (its row's)
        step.add(seq, num_new, self._snapshot_to_take(seq, num_new))
        return True

    def _score_cut(self, seq: Sequence, step: _StepBuilder, num_new: int, num_left: int) -> int:
        """``num_new`` tokens of ``seq``, fewer for a prompt whose logprobs are asked:
        at most the prompt positions this step has left to score, and one fewer
        where that chunk would sample its first token (which carries them) past
        what this step's result has room for (it samples a step later)."""
        if seq.sampling.prompt_logprobs is None or seq.output_token_ids:
            return num_new
        num_new = min(num_new, self.max_scored_tokens - step.scored_tokens)
        if num_new <= 0:
            return 0
        if num_new == num_left:
            entries = _score_entries(seq.num_prompt_tokens, seq.sampling.prompt_logprobs)
            if step.score_entries and step.score_entries + entries > self.max_prompt_logprob_entries:
                num_new -= 1
            else:
                step.score_entries += entries
        step.scored_tokens += num_new
        return num_new

    def _lookup_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks of the longest known prefix, leaving at least the last
        token to compute so there is a position to sample from; with recurrent
        state, the longest whose state after it is snapshotted, and that
        snapshot's slot (-1: none). A prompt whose logprobs are asked for takes
        none until they are out (a cached position's logits are never computed)."""
        if not self._reads_cache(seq):
            return [], -1
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        hits = self.prefix_index.lookup(seq.block_hash(i) for i in range(max_hit_blocks))
        if self.snapshots is None:
            return hits, -1
        for num_blocks in range(len(hits), 0, -1):
            slot = self.snapshots.lookup(seq.block_hash(num_blocks - 1))
            if slot is not None:
                return hits[:num_blocks], slot
        return [], -1

    def _reads_cache(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and not (seq.sampling.prompt_logprobs is not None
                                                   and not seq.output_token_ids)

    # ---------------------------------------------------------- state snapshots

    def _snapshot_point(self, seq: Sequence) -> int:
        """Where ``seq``'s snapshot would be taken: its prompt's last full block
        boundary that a later prompt could hit (at least one token after it), 0: none."""
        if self.snapshots is None:
            return 0
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _snapshot_point_cut(self, seq: Sequence, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut to end at the snapshot point when
        the chunk would cross it and no snapshot of that prefix exists."""
        point = self._snapshot_point(seq)
        if start < point < start + num_new and not self.snapshots.has(seq.block_hash(point // self.block_size - 1)):
            return point - start
        return num_new

    def _snapshot_to_take(self, seq: Sequence, num_new: int) -> tuple[int, bytes] | None:
        """A reserved snapshot slot and its prefix hash when the chunk of ``num_new``
        tokens from ``seq.num_scheduled`` ends at the snapshot point, else None."""
        point = self._snapshot_point(seq)
        if point == 0 or seq.num_scheduled + num_new != point:
            return None
        block_hash = seq.block_hash(point // self.block_size - 1)
        if self.snapshots.has(block_hash) or not self.snapshots.can_reserve():
            return None
        return self.snapshots.reserve(), block_hash

    # ------------------------------------------------------------------ update

    def update(self, done: StepDone) -> list[ConductorToFrontend]:
        """Apply the oldest in-flight step's result: a ``TokenDelta`` per
        sequence that sampled, then a ``Finished`` for each that ended. Void
        rows (a sequence aborted, ended or preempted since the plan) are
        skipped, their sampled tokens ignored."""
        in_flight = self._check_in_flight(done.step_id)
        sampled = {token.request_id: token for token in done.sampled}
        live_rows = in_flight.live_rows()
        missing = [seq.request_id for seq, chunk in live_rows if chunk.sample and seq.request_id not in sampled]
        if missing:  # refused before any change: the step stays in flight
            raise ValueError(f"StepDone of step {done.step_id} has no sampled token for request(s) {missing}")
        self._in_flight.popleft()
        self._settle_snapshots(in_flight, live_rows)
        outputs: list[ConductorToFrontend] = []
        for seq, chunk in live_rows:
            in_flight.land(seq, chunk)
            seq.num_computed += chunk.num_tokens
            self._cache_full_blocks(seq, chunk.num_computed)
            if chunk.sample:
                outputs += self._append_token(seq, sampled[seq.request_id])
        return outputs

    def fail_step(self, failed: StepFailed) -> list[ConductorToFrontend]:
        """A step raised on a rank: fail the rows it names (all rows when it
        names none). Other rows did not advance: with no later step in flight
        their chunk is scheduled again; a later step in flight was planned as
        if they had, so they and every row of the later steps recompute from
        their tokens so far (preempted: the ranks forget them, and the later
        steps' rows are void)."""
        in_flight = self._check_in_flight(failed.step_id)
        self._in_flight.popleft()
        self._settle_snapshots(in_flight, [])
        names = set(failed.request_ids)
        outputs: list[ConductorToFrontend] = []
        kept = []
        for seq, chunk in in_flight.live_rows():
            in_flight.land(seq, chunk)
            if not names or seq.request_id in names:
                self._finish(seq, "abort")
                message = f"the engine failed its step on rank {failed.rank}: {failed.message}"
                outputs.append(Failed(seq.request_id, status=500, message=message, error_type="server_error"))
            else:
                kept.append(seq)
        if self._in_flight:
            later = [seq for step in self._in_flight for seq, _ in step.live_rows()]
            # Each once; requeued at the head, the earliest arrival first.
            for seq in sorted(set(kept + later), key=lambda s: s.arrival, reverse=True):
                if seq.status is SeqStatus.RUNNING:
                    self._requeue(seq)
        return outputs

    def _settle_snapshots(self, in_flight: _InFlight, done_rows: list[tuple[Sequence, ScheduledChunk]]) -> None:
        """Index the snapshots the step took for rows it completed; give back the others'."""
        done = {seq.request_id for seq, _ in done_rows}
        for request_id, (slot, block_hash) in in_flight.snapshots.items():
            if request_id in done:
                self.snapshots.commit(slot, block_hash)
            else:
                self.snapshots.release(slot)

    def _check_in_flight(self, step_id: int) -> _InFlight:
        """The oldest step in flight, which ``step_id`` must name (ranks answer in order)."""
        oldest = self._in_flight[0] if self._in_flight else None
        if oldest is None or oldest.step_id != step_id:
            expected = "no step is in flight" if oldest is None else f"the oldest in flight is step {oldest.step_id}"
            raise ValueError(f"result for step {step_id}, but {expected}")
        return oldest

    def _cache_full_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Index the blocks this step filled: their KV exists now."""
        if not self.enable_prefix_caching:
            return
        for index in range(num_computed_before // self.block_size, seq.num_computed // self.block_size):
            self.allocator.cache(seq.block_ids[index], seq.block_hash(index))

    def _append_token(self, seq: Sequence, token: SampledToken) -> list[ConductorToFrontend]:
        if token.dead:  # the request's constraints exclude every token: it can't go on
            self._finish(seq, "abort")
            fields = _constraint_fields(seq.sampling, len(seq.output_token_ids))
            at = len(seq.output_token_ids) + 1
            if seq.sampling.structured is not None and len(fields) == 1:  # its grammar alone
                message = (f"no token is left to sample at output token {at}: the output so far cannot be "
                           f"continued within {fields[0]} (no token, nor the end, is allowed next: a pattern that "
                           "cannot be completed from there, such as an empty character class); fix the constraint")
            else:
                message = (f"no token is left to sample at output token {at}: the request's own constraints "
                           f"({' and '.join(fields) or 'its token masks'}) exclude every token; loosen them")
            return [Failed(seq.request_id, status=400, message=message, param=fields[0] if fields else None)]
        seq.output_token_ids.append(token.token_id)
        num_outputs = len(seq.output_token_ids)
        first = num_outputs == 1
        outputs: list[ConductorToFrontend] = [TokenDelta(
            seq.request_id, [token], seq.num_prompt_tokens if first else 0,
            (seq.num_cached_tokens or 0) if first else 0,
            prompt_token_ids=seq.prompt_token_ids if first and seq.returns_prompt_ids else None,
            num_queried_tokens=seq.num_queried_tokens if first else 0)]
        ending = self._stop_reason(seq, token.token_id, num_outputs)
        if ending is not None:
            outputs.append(self._finish(seq, *ending))
        return outputs

    def _stop_reason(self, seq: Sequence, token_id: int, num_outputs: int) -> tuple[str, int | None] | None:
        sampling = seq.sampling
        if num_outputs >= sampling.min_tokens:  # the sampler masks stops before it too
            if token_id in self.eos_token_ids and not sampling.ignore_eos:
                return "stop", token_id
            if token_id in sampling.stop_token_ids:
                return "stop", token_id
        if num_outputs >= seq.max_tokens or seq.num_prompt_tokens + num_outputs >= self.max_model_len:
            return "length", None
        return None

    # ----------------------------------------------------------------- endings

    def _finish(self, seq: Sequence, reason: str, stop_token_id: int | None = None) -> Finished:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        del self.requests[seq.request_id]
        self._end_choice(seq)
        return Finished(
            request_id=seq.request_id,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            stop_token_id=stop_token_id,
            num_preemptions=seq.num_preemptions,
        )

    def _end_choice(self, seq: Sequence) -> None:
        """The request ends with its last choice: then its media goes."""
        going = self.choices[seq.parent_id]
        going.remove(seq.request_id)
        if not going:
            del self.choices[seq.parent_id]
            self.media.end(seq.parent_id)

    def _release(self, seq: Sequence) -> None:
        """Free the blocks and the state slot and have the workers forget the sequence."""
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        if seq.state_slot >= 0:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1
        seq.num_computed = 0
        seq.num_in_flight = seq.num_samples_in_flight = 0
        seq.epoch += 1  # its rows in steps in flight are void from here
        if seq.is_started:
            self._finished_ids.append(seq.request_id)
            seq.is_started = False

    # ------------------------------------------------------------------ gauges

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        """The gauges. A parked sequence (its adapter out of the slots) is in no step: it waits for its
        adapter, wherever it is kept; a running one parked keeps its seat and blocks (``num_parked``: the
        gauges count it waiting, admission a seat taken)."""
        parked = starting = 0
        for seq in self.running:
            if seq.lora_slot == PARKED:
                parked += 1
            elif not seq.output_token_ids:
                starting += 1
        held = parked + sum(1 for seq in self.waiting if seq.lora_slot == PARKED)
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_parked=parked,
            num_kv_blocks_used=self.allocator.num_used,
            num_kv_blocks_total=self.allocator.num_blocks,
            num_preemptions=self.num_preemptions,
            num_starting=starting,
            num_waiting_for_adapter=held,
            num_waiting_deferred=held,
            num_state_slots_used=self.state_slots.num_used if self.state_slots else 0,
            num_state_slots_total=self.state_slots.num_slots if self.state_slots else 0,
        )
