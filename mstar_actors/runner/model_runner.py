"""The model runner: one rank's model, KV cache and sequence state.

``ModelRunner.execute(plan)`` runs one ``StepPlan``: forget finished
sequences, remember started ones, flatten the scheduled chunks into one
varlen batch, run the model, sample one token for every chunk that asks for
it, and append that token to its sequence. The runner decides nothing: block
ids, chunk sizes and which rows sample all come from the conductor, so every
rank runs the same plan to the same tokens.

Overlapped steps (the worker's, on CUDA): ``execute`` is ``forward`` (the
model's work enqueued on the device), ``sample`` (the draws enqueued, their
host copies started) and ``collect`` (wait for those copies, append the
tokens). The worker may run the next plan's ``forward`` before it collects
the step before: a sequence whose sampled token the host has not read yet
holds it as ``SeqState.pending``, its row in ``step_tokens`` (a device
buffer each sampling writes), and the next step's input for that position
is read there, on the device (``Batch.device_inputs``). ``collect`` must
then come before the next ``sample`` (penalties, seeds and grammars read
the outputs the host holds), and it appends to the sequences as the step
saw them: one a later plan forgot or restarted keeps its new state.

Sequence state lives from ``plan.started`` until the id appears in
``plan.finished``; a sequence restarted after a preemption arrives again in
``started`` with the outputs it had, and replaces the old state.

LoRA (``lora`` given): each sequence runs on its ``SeqStart.lora_slot``
(0: the base model), or the slot a chunk names (``ScheduledChunk.lora_slot``,
a sequence the adapter pool parked and resumed elsewhere);
``install_adapter`` fills a slot between steps. With
LoRA off no stack exists and the model runs its base path only. Where
``merge_one_adapter_steps`` was called (a GPU's runner, by default), a run
of steps whose rows are all on one adapter goes on that adapter merged into
the weights, as the base model's steps (``lora.merge``).

The runner is built, not configured: ``build.build_runner`` loads the model,
enables LoRA, sizes the KV cache and hands the parts to the constructor,
then compiles the kernels and captures the step graphs.

``build_batch`` is a pure function (no torch), so the plan-to-batch rules can
be tested without a model.

Structured outputs (``enable_grammars``; ``runner.grammar``): a sequence with
``SamplingParams.structured`` gets a matcher at start (fed its earlier
outputs on a restart) and loses it when forgotten; each step the sampled
rows' logits are masked by their grammars after the model runs (outside the
CUDA graphs, which stay one set for every step; on CUDA the host fills the
masks while the device still runs the step) and every rank's matchers take
the token sampled, so they agree.

CUDA graphs (CUDA, text models, unless ``enforce_eager``; ``step_graphs``):
a pure decode step (every chunk one token that samples) of up to
``cuda_graph_max_batch`` sequences replays a decode graph captured at
startup; any other step of up to that many sequences and
``cuda_graph_max_tokens`` tokens (prefill chunks beside decodes) replays a
mixed-step graph; a larger step runs eagerly. The KV cache has one block
more than ``num_kv_blocks`` reports: the scratch block padded graph rows
write into, which no plan can name (block ids are checked against
``num_kv_blocks``). A graph draws its rows' tokens too where they need no
torch filter (temperature and seeds only, no grammar: ``sampling.race_row``)
and some row draws at random: nothing is launched between the replay and
the host copy; the unseeded rows' base seed then comes from the host
(``graph_seeds``), one a step, the same on every rank.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter

import msgspec
import numpy as np
import torch
from torch import nn

from mstar_actors import messages
from mstar_actors.lora.adapter_file import AdapterWeights
from mstar_actors.lora.merge import MergedWeights, MergePolicy
from mstar_actors.models.attention import AttentionMetadata
from mstar_actors.models.cpu_stack import CpuDecoderStack
from mstar_actors.models.deltanet_ops import StatePool
from mstar_actors.models.lora_layers import LoraLayers
from mstar_actors.models.media_inputs import MediaInputs
from mstar_actors.runner.grammar import GrammarError, GrammarMatchers
from mstar_actors.runner.step_graphs import DecodeGraphs, MixedGraphs
from mstar_actors.runner.sampling import (GREEDY_ROW, PendingSample, RaceRow, RaceRows, SampleRow, race_row, race_rows,
                                         races_on, sample_pending, with_dead_rows)

# A sampler answers a step's logits with its draws: at once (a list), or on their way to the host.
Sampler = Callable[..., "list[messages.SampledToken] | PendingSample"]


class PlanError(ValueError):
    """A plan this rank can't execute. ``request_ids`` names the rows at fault
    (empty: the whole step), so the worker can fail just those requests."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()):
        super().__init__(message)
        self.request_ids = list(request_ids)


@dataclass
class SeqState:
    prompt_token_ids: list[int]
    sampling: messages.SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    lora_slot: int = 0  # 0: the base model
    state_slot: int = -1  # a hybrid model's recurrent-state slot (-1: none)
    pending: int = -1  # row of the runner's step_tokens holding a sampled token not yet read (-1: none)
    race: RaceRow | None = field(init=False)  # the draw as a step graph takes it (None: it cannot)
    row: SampleRow | None = field(default=None, init=False)  # its sampled row, made once (``_sample_row``)
    # SamplingParams.prompt_logprobs: those of its prompt's tokens so far (until
    # the first sampled token carries them; None: none asked, or sent already)
    prompt_logprobs: list[messages.PromptLogprob] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.race = race_row(self.sampling)
        if self.sampling.prompt_logprobs is not None and not self.output_token_ids:
            self.prompt_logprobs = []

    @property
    def num_known(self) -> int:
        """Tokens the host holds (prompt and read outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known + (self.pending >= 0)

    def tokens(self, start: int, stop: int) -> list[int]:
        """``(prompt + outputs)[start:stop]`` without concatenating the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        head = self.prompt_token_ids[start:] if start < num_prompt else []
        return head + self.output_token_ids[max(start - num_prompt, 0) : stop - num_prompt]


@dataclass
class Batch:
    """One step's flat batch, as host lists."""

    input_ids: list[int] = field(default_factory=list)
    # (index into input_ids, row of step_tokens): a token sampled last step, still on the device (its input_ids entry: 0)
    device_inputs: list[tuple[int, int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)  # flat rows to sample (a chunk's last token)
    sample_ids: list[str] = field(default_factory=list)  # their request ids, same order
    request_ids: list[str] = field(default_factory=list)  # each chunk's request, in batch order

    def spans(self) -> list[tuple[str, int, int]]:
        """(request id, first token index, stop) of each chunk, in batch order."""
        return [(rid, ctx - n, ctx) for rid, n, ctx in zip(self.request_ids, self.query_lens, self.context_lens)]
    chunk_slots: list[int] = field(default_factory=list)  # LoRA slot of each chunk (0: base)
    state_slots: list[int] = field(default_factory=list)  # recurrent-state slot of each chunk (-1: none)
    sample_slots: list[int] = field(default_factory=list)  # LoRA slot of each sampled row
    sample_seqs: list[SeqState] = field(default_factory=list)  # each sampled row's sequence
    # ``block_tables`` row after row and each table's length (int64), where a
    # decode step's numpy path made them (``_build_decodes``); else None. The
    # same tables, so batches compare by the lists alone.
    flat_tables: np.ndarray | None = field(default=None, compare=False)
    table_lengths: np.ndarray | None = field(default=None, compare=False)


def build_batch(
    chunks: list[messages.ScheduledChunk],
    seqs: dict[str, SeqState],
    block_size: int,
    num_kv_blocks: int,
    max_model_len: int,
) -> Batch:
    """Flatten the scheduled chunks (ScheduledChunk's semantics, messages.py)."""
    batch = _build_decodes(chunks, seqs, block_size, num_kv_blocks, max_model_len) if chunks else None
    return batch if batch is not None else _build_chunks(chunks, seqs, block_size, num_kv_blocks, max_model_len)


def _build_chunks(chunks, seqs, block_size, num_kv_blocks, max_model_len) -> Batch:
    """``build_batch``, a chunk at a time: any chunks, and the errors' words."""
    batch = Batch()
    for chunk in chunks:
        seq = _check_chunk(chunk, seqs, block_size, num_kv_blocks, max_model_len)
        start, stop = chunk.num_computed, chunk.num_computed + chunk.num_tokens
        known = seq.num_known
        batch.input_ids += seq.tokens(start, min(stop, known))
        if stop > known:  # the last token: sampled by the step before, not read yet
            batch.device_inputs.append((len(batch.input_ids), seq.pending))
            batch.input_ids.append(0)
        batch.positions += range(start, stop)
        table = chunk.block_ids
        batch.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]
        batch.block_tables.append(table[: -(-stop // block_size)])
        batch.query_lens.append(chunk.num_tokens)
        batch.context_lens.append(stop)
        batch.request_ids.append(chunk.request_id)
        batch.chunk_slots.append(seq.lora_slot)
        batch.state_slots.append(seq.state_slot)
        if chunk.sample:
            batch.logits_indices.append(len(batch.input_ids) - 1)
            batch.sample_ids.append(chunk.request_id)
            batch.sample_slots.append(seq.lora_slot)
            batch.sample_seqs.append(seq)
    return batch


_SAMPLES = attrgetter("sample")
_STARTS, _TABLES, _SIZES = attrgetter("num_computed"), attrgetter("block_ids"), attrgetter("num_tokens")
_PENDING, _LORA, _STATE = attrgetter("pending"), attrgetter("lora_slot"), attrgetter("state_slot")
_PROMPTS, _OUTPUTS = attrgetter("prompt_token_ids"), attrgetter("output_token_ids")


def _build_decodes(chunks, seqs, block_size, num_kv_blocks, max_model_len) -> Batch | None:
    """``build_batch`` of sampled chunks, one token each (a decode step: most
    steps, up to hundreds of rows), with numpy over the rows instead of
    Python a row. None if a chunk is anything else or fails a check: the
    general path then flattens it, or names the fault."""
    n = len(chunks)
    if not all(map(_SAMPLES, chunks)) or any(map((1).__ne__, map(_SIZES, chunks))):
        return None
    rids = [c.request_id for c in chunks]
    try:
        states = [seqs[rid] for rid in rids]
    except KeyError:
        return None
    starts = np.fromiter(map(_STARTS, chunks), np.int64, n)
    known = (np.fromiter(map(len, map(_PROMPTS, states)), np.int64, n)
             + np.fromiter(map(len, map(_OUTPUTS, states)), np.int64, n))
    pending = np.fromiter(map(_PENDING, states), np.int64, n)
    tables = list(map(_TABLES, chunks))
    lengths = np.fromiter(map(len, tables), np.int64, n)
    stops = starts + 1
    needed = -(-stops // block_size)
    # _check_chunk's rules (a sampled chunk ends at the last token, so it is inside them)
    if ((starts < 0) | (stops != known + (pending >= 0)) | (stops > max_model_len) | (lengths < needed)).any():
        return None
    # A table longer than its sequence needs (blocks ahead of the tokens) is cut to them.
    block_tables = tables if (lengths == needed).all() else [t[:k] for t, k in zip(tables, needed.tolist())]
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int64, int(needed.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= num_kv_blocks):
        return None
    last = np.cumsum(needed) - 1  # each row's block: the last of its table
    slot_mapping = flat[last] * block_size + starts % block_size
    input_ids = [0] * n
    on_device = starts >= known  # sampled by the step before, not read yet
    device_rows = np.flatnonzero(on_device)
    for i in np.flatnonzero(~on_device).tolist():
        seq, at = states[i], int(starts[i])
        num_prompt = len(seq.prompt_token_ids)
        input_ids[i] = seq.prompt_token_ids[at] if at < num_prompt else seq.output_token_ids[at - num_prompt]
    lora_slots = list(map(_LORA, states))
    return Batch(
        input_ids=input_ids,
        device_inputs=list(zip(device_rows.tolist(), pending[device_rows].tolist())),
        positions=starts.tolist(),
        slot_mapping=slot_mapping.tolist(),
        block_tables=block_tables,
        query_lens=[1] * n,
        context_lens=stops.tolist(),
        logits_indices=list(range(n)),
        sample_ids=rids,
        request_ids=list(rids),
        chunk_slots=lora_slots,
        state_slots=list(map(_STATE, states)),
        sample_slots=list(lora_slots),
        sample_seqs=states,
        flat_tables=flat,
        table_lengths=needed,
    )


def _check_chunk(chunk, seqs, block_size, num_kv_blocks, max_model_len) -> SeqState:
    rid = chunk.request_id
    seq = seqs.get(rid)
    if seq is None:
        raise PlanError(f"request {rid!r}: scheduled but never started (missing from StepPlan.started)", [rid])
    stop = chunk.num_computed + chunk.num_tokens
    num_tokens = seq.num_tokens
    if chunk.num_tokens < 1 or chunk.num_computed < 0 or stop > num_tokens:
        raise PlanError(
            f"request {rid!r}: chunk [{chunk.num_computed}, {stop}) is outside its "
            f"{num_tokens} known tokens; need num_tokens >= 1 and num_computed + num_tokens <= known",
            [rid],
        )
    if chunk.sample and stop != num_tokens:
        raise PlanError(f"request {rid!r}: sample=true but the chunk ends at {stop}, not at the last token {num_tokens}", [rid])
    if stop > max_model_len:
        raise PlanError(f"request {rid!r}: {stop} tokens exceed max_model_len={max_model_len}", [rid])
    num_needed = -(-stop // block_size)
    if len(chunk.block_ids) < num_needed:
        raise PlanError(f"request {rid!r}: {stop} tokens need {num_needed} blocks, block_ids has {len(chunk.block_ids)}", [rid])
    ids = chunk.block_ids[:num_needed]
    if ids and (min(ids) < 0 or max(ids) >= num_kv_blocks):  # builtins: every chunk's table, every step
        bad = [b for b in ids if not 0 <= b < num_kv_blocks]
        raise PlanError(f"request {rid!r}: block ids {bad} are outside [0, {num_kv_blocks})", [rid])
    return seq


PROMPT_LOGPROB_PIECE = 256  # rows a log-softmax at a time: a piece's copy of [rows, vocab] float32


def _take_prompt_logprobs(logits: torch.Tensor, targets: tuple[int, ...], seqs: tuple[SeqState, ...]) -> None:
    """Each row's log-softmax at the prompt token it predicts, and its top
    ``prompt_logprobs`` alternatives, appended to its sequence's list (rows
    of a sequence in position order)."""
    targets_on_device = torch.tensor(targets, dtype=torch.long, device=logits.device)
    k = max(seq.sampling.prompt_logprobs for seq in seqs)
    for at in range(0, len(targets), PROMPT_LOGPROB_PIECE):
        piece = torch.log_softmax(logits[at : at + PROMPT_LOGPROB_PIECE].float(), dim=-1)
        chosen = piece.gather(1, targets_on_device[at : at + PROMPT_LOGPROB_PIECE, None])
        ranks = ((piece > chosen).sum(dim=-1) + 1).tolist()
        top_values, top_ids = piece.topk(k, dim=-1) if k else (piece[:, :0], piece[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, logprob in enumerate(chosen[:, 0].tolist()):
            seq = seqs[at + i]
            n = seq.sampling.prompt_logprobs
            top = tuple(messages.TopLogprob(t, v) for t, v in zip(top_ids[i][:n], top_values[i][:n]))
            seq.prompt_logprobs.append(messages.PromptLogprob(targets[at + i], logprob, top, ranks[i]))


def _copy_state(src: list[StatePool], src_slot: int, dst: list[StatePool], dst_slot: int) -> None:
    """Every linear-attention layer's state of ``src[src_slot]`` into ``dst[dst_slot]``."""
    for a, b in zip(src, dst, strict=True):
        b.conv[dst_slot].copy_(a.conv[src_slot])
        b.ssm[dst_slot].copy_(a.ssm[src_slot])


@dataclass(frozen=True)
class KvCache:
    """One rank's paged KV cache: per full-attention layer ``[2, num_blocks + 1,
    block_size, kv_heads, head_dim]``; plans may name blocks ``0 ..
    num_blocks - 1``, the last is the scratch block padded graph rows write
    into. ``state_pools``: a hybrid model's recurrent-state slots, one pool
    per linear-attention layer (``deltanet_ops.StatePool``), empty for
    other models; plans may name slots ``0 .. num_state_slots - 1``."""

    caches: list[torch.Tensor]
    block_size: int
    num_blocks: int
    state_pools: list[StatePool] = field(default_factory=list)
    # Prefix-cache snapshots of the recurrent state, shaped like ``state_pools``
    # (plans may name ``0 .. num_state_snapshots - 1``); empty: none.
    snapshot_pools: list[StatePool] = field(default_factory=list)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.state_pools[0].num_slots if self.state_pools else 0

    @property
    def num_state_snapshots(self) -> int:
        return self.snapshot_pools[0].num_slots if self.snapshot_pools else 0


@dataclass
class Step:
    """One plan on its way through the runner: ``forward`` made it, ``sample``
    and ``collect`` finish it."""

    batch: Batch
    logits: torch.Tensor | None  # the sampled rows' (None: the step samples nothing)
    states: list[SeqState]  # the sampled rows' sequences, as the step saw them
    draws: PendingSample | list[messages.SampledToken] | None = None
    drawn: torch.Tensor | None = None  # the rows' tokens the step's graph drew (None: ``sample`` draws them)

    def ready(self) -> bool:
        """Whether ``collect`` would not wait for the device."""
        return not isinstance(self.draws, PendingSample) or self.draws.ready()

    def wait(self) -> None:
        """Block until ``collect`` would not wait (any thread may call it)."""
        if isinstance(self.draws, PendingSample):
            self.draws.wait()


class ModelRunner:
    """Owns one rank's model, KV cache, sequence state and sampling generator.

    Not thread-safe: the worker runs one plan at a time, in plan order
    (``execute``, or overlapped as the module doc says), which is what keeps
    every rank's state identical.
    """

    def __init__(self, model: nn.Module, kv: KvCache, *, max_model_len: int, lora: LoraLayers | None = None,
                 media: MediaInputs | None = None, sampler: Sampler = sample_pending, seed: int = 0,
                 max_sampled_rows: int = 256):
        """The parts ``build.build_runner`` made, in its order; the runner builds nothing itself."""
        self.model = model
        self.spec = model.spec
        self.kv_caches = kv.caches
        self.block_size = kv.block_size
        self.num_kv_blocks = kv.num_blocks
        self.scratch_block = kv.scratch_block  # one past the reported blocks: see the module doc
        self.num_state_slots = kv.num_state_slots  # a hybrid model's (0: it keeps no recurrent state)
        self.state_pools, self.snapshot_pools = kv.state_pools, kv.snapshot_pools
        self.num_state_snapshots = kv.num_state_snapshots
        if kv.state_pools:
            model.attach_state_pools(kv.state_pools)
        self.lora = lora
        self.lora_names: dict[int, str] = {}  # slot -> installed adapter's name
        self.num_installs: dict[int, int] = {}  # slot -> installs into it so far (a merge's key: ``lora.merge``)
        self.merged: MergedWeights | None = None  # steps of one adapter on merged weights (``merge_one_adapter_steps``)
        self.merge_policy: MergePolicy | None = None
        self.max_model_len = min(max_model_len, self.spec.max_position_embeddings)
        # Multimodal models: per-sequence positions and vision rows (``MediaInputs``).
        self.media = media
        self.device, self.dtype = kv.caches[0].device, kv.caches[0].dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.graph_seeds = random.Random(seed)  # the step graphs' draws' base seeds, one a step (host side)
        self.sampler = sampler
        # The last sampling's tokens, where the next step reads those the host has
        # not (a step sampling more rows than this reads its draws at once).
        self.step_tokens = torch.zeros(max_sampled_rows, dtype=torch.long, device=self.device)
        self.seqs: dict[str, SeqState] = {}
        self.scoring: set[str] = set()  # requests whose prompt logprobs are still being computed
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.grammars: GrammarMatchers | None = None  # structured outputs: see enable_grammars

    def merge_one_adapter_steps(self, merged: MergedWeights, after_steps: int) -> None:
        """From now on the ``after_steps``-th step in a row whose rows are all on one adapter, and
        those after it on that adapter, run on it merged into ``merged``'s weights, as the base
        model's steps (``lora.merge``: ``MergePolicy`` waits longer after merges that did not last;
        on CUDA the merge and the restore are graphs, captured here). Not where the CPU layer stack
        runs the steps: it reads packed copies of the weights."""
        if isinstance(self.model.run_layers, CpuDecoderStack):
            raise ValueError("merged LoRA steps: the CPU layer stack reads packed copies of the weights, which a "
                             "merge would leave stale; merge only where each layer runs through Python")
        merged.capture(self.lora.num_slots)
        self.merged, self.merge_policy = merged, MergePolicy(after_steps)

    def enable_grammars(self, grammars: GrammarMatchers) -> None:
        """Serve ``SamplingParams.structured``: its rows' logits are masked by
        ``grammars`` before sampling (after the model, outside any graph)."""
        self.grammars = grammars

    def enable_step_graphs(self, max_batch: int, max_tokens: int = 0, *, capture: bool = True,
                           draws: bool | None = None) -> None:
        """Serve pure decode steps of up to ``max_batch`` sequences through
        ``DecodeGraphs`` and, when ``max_tokens`` > 0, other steps of up to
        ``max_batch`` sequences and ``max_tokens`` tokens through
        ``MixedGraphs``; ``capture=False`` runs their static paths eagerly
        (tests). Both capture into one memory pool, the larger set first.
        ``draws``: the graphs draw the tokens too, where the rows allow
        (``_graph_race``); by default where the sampler is
        ``sample_pending`` and its draw the race kernel's (CUDA)."""
        if draws is None:
            draws = self.sampler is sample_pending and races_on(self.device)
        if self.media is not None:
            raise ValueError(f"step graphs: {self.spec.architecture} is multimodal; its steps run eagerly")
        pool = torch.cuda.graph_pool_handle() if capture else None
        shared = dict(max_blocks_per_seq=-(-self.max_model_len // self.block_size), block_size=self.block_size,
                      scratch_block=self.scratch_block, capture=capture, pool=pool, step_tokens=self.step_tokens,
                      draws=draws)
        shared["scratch_state_slot"] = self.num_state_slots if self.num_state_slots else None  # the pools' scratch
        if max_tokens > 0:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, self.lora, max_seqs=max_batch,
                                            max_tokens=max_tokens, **shared)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.lora, max_batch=max_batch, **shared)

    # -- protocol ----------------------------------------------------------

    def ready_info(self, rank: int) -> messages.WorkerReady:
        return messages.WorkerReady(
            rank=rank,
            num_kv_blocks=self.num_kv_blocks,
            num_state_slots=self.num_state_slots,
            num_state_snapshots=self.num_state_snapshots,
        )

    def execute(self, plan: messages.StepPlan) -> list[messages.SampledToken]:
        """Run one plan; return the sampled tokens in the order of the sampled chunks."""
        step = self.forward(plan)
        self.sample(step)
        return self.collect(step)

    def forward(self, plan: messages.StepPlan) -> Step:
        """The plan's sequence changes, then its model step, enqueued (on CUDA
        the device may still be running it, and the step before, on return)."""
        self.forget(plan.finished)
        self.start(plan.started)
        if not plan.scheduled:
            return Step(Batch(), None, [], [])
        self._move_lora_slots(plan.scheduled)
        batch = build_batch(plan.scheduled, self.seqs, self.block_size, self.num_kv_blocks, self.max_model_len)
        if self.merged is not None:
            self._hold_merged(batch)
        snapshots = self._snapshots_to_take(plan.scheduled)
        states = batch.sample_seqs
        logits, drawn = self._run_model(batch, states)
        for slot, snapshot in snapshots:
            _copy_state(self.state_pools, slot, self.snapshot_pools, snapshot)
        if not batch.sample_ids:
            return Step(batch, None, [], [])
        return Step(batch, logits, states, drawn=drawn)

    def sample(self, step: Step) -> None:
        """Enqueue ``step``'s draws; every step before must have been collected.
        Their tokens stay on the device (``step_tokens``) for the next step,
        unless the sampler answered at once or the rows outnumber the buffer."""
        if step.draws is not None:
            return
        batch = step.batch
        rows = [self._sample_row(rid) for rid in batch.sample_ids]
        if step.drawn is not None:  # the step's graph drew them
            draws = PendingSample(rows, step.drawn)
        else:
            # on CUDA the masks fill while the device runs the step
            dead = self.grammars.mask(step.logits, batch.sample_ids) if self.grammars is not None else []
            for i, row in enumerate(rows):  # a grammar that holds and refuses </think> saw the reasoning end
                if (row.thinking is not None and self.grammars is not None
                        and self.grammars.refuses(row.request_id, i, row.thinking.close_id)):
                    row.thinking.end()  # (a close spelled in pieces): no budget forces one on it
            draws = self.sampler(step.logits, rows, generator=self.generator)
            if dead:  # rows whose grammar allows no token: their requests fail (``SampledToken.dead``)
                draws = with_dead_rows(draws, dead)
        if isinstance(draws, PendingSample) and len(rows) <= self.step_tokens.shape[0]:
            self.step_tokens[: len(rows)].copy_(draws.token_ids)
            for row, seq in enumerate(step.states):
                seq.pending = row
            step.draws = draws
            return
        step.draws = draws.result() if isinstance(draws, PendingSample) else draws
        self._take_tokens(step)

    def collect(self, step: Step) -> list[messages.SampledToken]:
        """``step``'s tokens, in the order of its sampled chunks (waits for their host copies)."""
        if isinstance(step.draws, PendingSample):
            step.draws = step.draws.result()
            self._take_tokens(step)
        return step.draws

    def _take_tokens(self, step: Step) -> None:
        """Append each sampled token to its sequence as the step saw it, and
        feed the grammars of those still running as that state. A sequence's
        first token carries its prompt logprobs, where asked for."""
        for row, (seq, token) in enumerate(zip(step.states, step.draws)):
            seq.output_token_ids.append(token.token_id)
            seq.pending = -1
            if seq.prompt_logprobs is not None:
                step.draws[row] = msgspec.structs.replace(token, prompt_logprobs=tuple(seq.prompt_logprobs))
                seq.prompt_logprobs = None
                self.scoring.discard(token.request_id)
        if self.grammars is not None:  # a dead row's stand-in is no token of its grammar: the request fails
            self.grammars.advance([t for seq, t in zip(step.states, step.draws)
                                   if self.seqs.get(t.request_id) is seq and not t.dead])

    def _hold_merged(self, batch: Batch) -> None:
        """The weights as this step needs them (``lora.merge``): its one adapter merged, where the
        policy says so, and then its rows run as the base's; else as loaded."""
        slots = set(batch.chunk_slots)
        slot = slots.pop() if len(slots) == 1 else 0
        tenant = (slot, self.num_installs.get(slot, 0)) if slot and self.merged.can_merge(slot) else None
        tenant = self.merge_policy.choose(tenant)
        self.merged.hold(slot, tenant)
        if tenant is not None:
            batch.chunk_slots = [0] * len(batch.chunk_slots)
            batch.sample_slots = [0] * len(batch.sample_slots)

    def _count_install(self, slot: int) -> None:
        """Before ``slot`` is written: a merge of its earlier tenant is not this one's (the install
        thread counts; the step thread reads, and only merges a slot its rows are on, which no
        install writes meanwhile)."""
        self.num_installs[slot] = self.num_installs.get(slot, 0) + 1

    def _move_lora_slots(self, chunks: list[messages.ScheduledChunk]) -> None:
        """Each chunk's rows on the LoRA slot it names (-1: where they were);
        a slot this rank holds no adapter in fails the step's rows on it."""
        bad = []
        for chunk in chunks:
            seq = self.seqs.get(chunk.request_id)
            if seq is None or chunk.lora_slot < 0 or chunk.lora_slot == seq.lora_slot:
                continue  # a missing sequence is build_batch's to report
            if chunk.lora_slot != 0 and chunk.lora_slot not in self.lora_names:
                bad.append(chunk.request_id)
                continue
            seq.lora_slot = chunk.lora_slot
        if bad:
            raise PlanError(f"requests {bad}: their chunks name LoRA slots that hold no adapter on this rank; "
                            f"{self._lora_hint()}", bad)

    def start(self, started: list[messages.SeqStart]) -> None:
        """Remember new sequences; a restarted one replaces its old state.

        A sequence on a LoRA slot this rank holds no adapter in is refused
        (PlanError naming it): running it on the base model would be wrong
        silently. The others are still remembered."""
        errors = []
        for s in started:
            if s.lora_slot != 0 and s.lora_slot not in self.lora_names:
                errors.append(f"request {s.request_id!r}: lora_slot {s.lora_slot} holds no adapter on this rank; {self._lora_hint()}")
                continue
            if (error := self._state_slot_error(s)) is not None:
                errors.append(error)
                continue
            seq = self.seqs[s.request_id] = SeqState(list(s.prompt_token_ids), s.sampling, list(s.output_token_ids),
                                                     s.lora_slot, s.state_slot)
            (self.scoring.add if seq.prompt_logprobs is not None else self.scoring.discard)(s.request_id)
            if (error := self._start_media(s) or self._start_grammar(s)) is not None:
                self.forget([s.request_id])
                errors.append(error)
            elif s.restore_snapshot >= 0:  # a prefix hit: its state after the prefix, from the snapshot
                _copy_state(self.snapshot_pools, s.restore_snapshot, self.state_pools, s.state_slot)
        if errors:
            raise PlanError("; ".join(errors), [s.request_id for s in started if s.request_id not in self.seqs])

    def install_adapter(self, slot: int, weights: AdapterWeights) -> None:
        """Install ``weights`` into ``slot`` (cleared first: no earlier tenant's
        rows survive); returns once the device holds them. No running
        sequence may use ``slot``; steps on other slots may run meanwhile on
        another thread (the worker installs on a thread beside its steps): a
        step reads only its rows' slots, and on CUDA the copies run on a
        stream of their own, which the install waits for; the slot itself is
        written after the steps queued before the install (its earlier
        tenant's last rows), never before."""
        if self.lora is None:
            raise ValueError(f"adapter {weights.name!r}: LoRA is off on this rank (lora.max_loras = 0); enable it to install adapters")
        self.lora_names.pop(slot, None)  # on failure the slot is cleared and holds nothing
        self._count_install(slot)
        self.lora.install(slot, weights)  # returns once the device holds the copy
        for graphs in (self.graphs, self.mixed_graphs):  # the graphs read the stacks by address
            if graphs is not None:
                graphs.check_lora_in_place()
        self.lora_names[slot] = weights.name

    def reinstall_adapter(self, slot: int, name: str, digest: str) -> bool:
        """Install the adapter of ``digest`` into ``slot`` from the image this
        rank kept when it last installed it (``install_adapter``), with no
        host copy to read; False when it kept none (then install it). On CUDA
        an image still on the device is one copy queued behind the steps
        already queued: it returns at once, and the next step reads the slot."""
        if self.lora is None:
            return False
        self.lora_names.pop(slot, None)
        self._count_install(slot)
        if not self.lora.reinstall(slot, name, digest):
            return False
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.check_lora_in_place()
        self.lora_names[slot] = name
        return True

    def void_slot(self, slot: int, name: str) -> None:
        """An install of ``name`` into ``slot`` failed here after the conductor
        planned rows behind it (``InstallAdapter.rows_follow``): the slot
        holds zeros and takes those rows all the same, so every rank runs the
        same batch (the tensor-parallel collectives pair up step by step);
        the conductor fails them before it uses any result of theirs."""
        if self.lora is None:
            return
        self._count_install(slot)
        self.lora.clear(slot)
        self.lora_names[slot] = f"{name} (its install failed: rows on it are void)"

    def kept_adapters(self) -> list[str]:
        """The digests whose slot images this rank keeps: installing one of
        them again is ``reinstall_adapter``, a copy."""
        return [] if self.lora is None else self.lora.kept_images()

    def _lora_hint(self) -> str:
        if self.lora is None:
            return "LoRA is off on this rank (lora.max_loras = 0), so only slot 0 (base) is accepted"
        return f"installed: {dict(sorted(self.lora_names.items())) or 'none'} (slot: adapter)"

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished sequences; an unknown id is a no-op (aborts are idempotent)."""
        for rid in request_ids:
            self.seqs.pop(rid, None)
            self.scoring.discard(rid)
            if self.grammars is not None:
                self.grammars.forget(rid)
            if self.media is not None:
                self.media.forget(rid)

    # -- internals ---------------------------------------------------------

    def _snapshots_to_take(self, chunks: list[messages.ScheduledChunk]) -> list[tuple[int, int]]:
        """(state slot, snapshot slot) of each chunk that names a snapshot, checked."""
        taken = []
        for chunk in chunks:
            if chunk.snapshot < 0:
                continue
            if not 0 <= chunk.snapshot < self.num_state_snapshots:
                raise PlanError(f"request {chunk.request_id!r}: snapshot {chunk.snapshot} is outside "
                                f"[0, {self.num_state_snapshots}) (kv.state_snapshots)", [chunk.request_id])
            taken.append((self.seqs[chunk.request_id].state_slot, chunk.snapshot))
        return taken

    def _state_slot_error(self, s: messages.SeqStart) -> str | None:
        """Why ``s``'s recurrent-state slot (or the snapshot it restores) can't be
        used here, or None: a hybrid model's sequence needs a slot of its own;
        other models take none."""
        if s.restore_snapshot >= 0 and not s.restore_snapshot < self.num_state_snapshots:
            return (f"request {s.request_id!r}: restore_snapshot {s.restore_snapshot} is outside "
                    f"[0, {self.num_state_snapshots}) (kv.state_snapshots)")
        if self.num_state_slots == 0:
            return None if s.state_slot < 0 else (f"request {s.request_id!r}: state_slot {s.state_slot}, but "
                                                  f"{self.spec.architecture} keeps no recurrent state")
        if not 0 <= s.state_slot < self.num_state_slots:
            return (f"request {s.request_id!r}: state_slot {s.state_slot} is outside [0, {self.num_state_slots}); "
                    f"{self.spec.architecture} needs a slot per running sequence")
        held = next((rid for rid, seq in self.seqs.items() if seq.state_slot == s.state_slot and rid != s.request_id), None)
        if held is not None:
            return f"request {s.request_id!r}: state_slot {s.state_slot} is held by running request {held!r}"
        return None

    def _start_media(self, s: messages.SeqStart) -> str | None:
        """Why ``s``'s media can't be served here, or None when it can (or has none)."""
        if self.media is None:
            return f"request {s.request_id!r}: has {len(s.media)} media item(s) but {self.spec.architecture} takes text only" if s.media else None
        try:
            self.media.start(s.request_id, s.prompt_token_ids, s.media)
        except ValueError as err:
            return str(err)
        return None

    def _start_grammar(self, s: messages.SeqStart) -> str | None:
        """Why ``s``'s grammar can't be served here, or None (also when it has none).
        A restarted sequence's matcher is fed its earlier outputs again."""
        if self.grammars is None:
            return f"request {s.request_id!r}: structured outputs are off on this rank" if s.sampling.structured else None
        try:
            self.grammars.start(s.request_id, s.sampling.structured, s.output_token_ids)
        except GrammarError as err:
            return f"request {s.request_id!r}: {err}"
        return None

    def _sample_row(self, request_id: str) -> SampleRow:
        seq = self.seqs[request_id]
        if seq.row is None:  # its lists are the sequence's, which grow in place
            seq.row = SampleRow(request_id, seq.sampling, seq.prompt_token_ids, seq.output_token_ids)
        return seq.row

    def _run_model(self, batch: Batch, states: list[SeqState]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's sampled rows' logits, ``[len(batch.sample_ids), vocab]``
        float32, and their tokens where the step's graph drew them
        (``states``: the sampled rows' sequences)."""
        prompt_rows = self._prompt_logprob_rows(batch)
        graphs = self.graphs if self._is_graph_step(batch) else None
        if graphs is None and self.mixed_graphs is not None and self.mixed_graphs.takes(len(batch.input_ids),
                                                                                          len(batch.request_ids)):
            graphs = self.mixed_graphs
        if graphs is not None and not prompt_rows:  # (a graph computes the sampled rows' logits only)
            race = self._graph_race(graphs, states)
            logits = graphs.run(batch, race, self.graph_seeds.getrandbits(62) if race is not None else 0)
            return logits, None if race is None else graphs.tokens[: len(batch.sample_ids)]
        input_ids, positions, meta, logits_indices = self._to_device(batch)
        # prompt positions whose logprobs are asked for go through the LM head beside the sampled rows
        rows, targets, seqs = zip(*prompt_rows) if prompt_rows else ((), (), ())
        if self.lora is not None:
            self.lora.begin_step(batch.chunk_slots, batch.query_lens,
                                 batch.sample_slots + [seq.lora_slot for seq in seqs])
        try:
            with torch.inference_mode():
                hidden = self._forward(batch, input_ids, positions, meta)
                if rows:
                    logits_indices = torch.cat([logits_indices, logits_indices.new_tensor(rows)])
                logits = self.model.compute_logits(hidden[logits_indices])
                if rows:
                    num_sampled = len(batch.logits_indices)
                    _take_prompt_logprobs(logits[num_sampled:], targets, seqs)
                    logits = logits[:num_sampled]
                return logits, None
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _prompt_logprob_rows(self, batch: Batch) -> list[tuple[int, int, SeqState]]:
        """(flat row, the prompt token it predicts, its sequence) of each
        position in the batch whose next token is a prompt token of a
        sequence that asked for prompt logprobs."""
        found: list[tuple[int, int, SeqState]] = []
        if not self.scoring:
            return found
        row = 0
        for rid, start, stop in batch.spans():
            seq = self.seqs[rid]
            if seq.prompt_logprobs is not None:
                prompt = seq.prompt_token_ids
                found += [(row + p - start, prompt[p + 1], seq) for p in range(start, min(stop, len(prompt) - 1))]
            row += stop - start
        return found

    def _graph_race(self, graphs: DecodeGraphs | MixedGraphs, states: list[SeqState]) -> RaceRows | None:
        """A graphed step's draw, if its graph takes it: no row needs a
        torch filter or a grammar (``sampling.race_row``), and some row
        draws at random (a greedy step's argmax after the replay is one
        launch: less host work than the graph's inputs)."""
        if not graphs.draws or self.sampler is not sample_pending or not states:
            return None
        rows = [seq.race for seq in states]
        if None in rows or all(row is GREEDY_ROW for row in rows):
            return None
        return race_rows(rows, [len(seq.output_token_ids) + (seq.pending >= 0) for seq in states])

    def _is_graph_step(self, batch: Batch) -> bool:
        """Pure decode within the captured sizes: one token per chunk, each sampled."""
        return (
            self.graphs is not None
            and len(batch.request_ids) <= self.graphs.max_batch
            and len(batch.sample_ids) == len(batch.request_ids) == len(batch.input_ids)
        )

    def _forward(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.media is None:
            return self.model(input_ids, positions, self.kv_caches, meta)
        try:  # multimodal: [3, T] positions, and vision rows spliced over placeholders
            positions, media_rows = self.media.step_inputs(batch.spans(), self.device)
        except ValueError as err:
            raise PlanError(str(err)) from None
        return self.model(input_ids, positions, self.kv_caches, meta, media_rows)

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        def longs(values: list[int] | tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        max_blocks = max(len(t) for t in batch.block_tables)
        meta = AttentionMetadata.from_lists(
            slot_mapping=batch.slot_mapping,
            block_tables=[t + [0] * (max_blocks - len(t)) for t in batch.block_tables],
            num_blocks=[len(t) for t in batch.block_tables],
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            device=self.device,
        )
        if self.num_state_slots:
            meta.state_slots, meta.state_slots_list = longs(batch.state_slots), batch.state_slots
        input_ids = longs(batch.input_ids)
        if batch.device_inputs:
            at, rows = zip(*batch.device_inputs)
            input_ids[longs(at)] = self.step_tokens[longs(rows)]
        return input_ids, longs(batch.positions), meta, longs(batch.logits_indices)
