"""CUDA graphs for the runner's steps: captured once per bucket, replayed per step.

An eager step of a small model is host-bound: hundreds of kernel launches
(more with LoRA: one per targeted linear) cost more than the GPU work. So,
as vLLM does, we capture ``model(...)`` + ``compute_logits`` once per bucket
into a CUDA graph over static buffers and replay it with the step's values
copied in. Two kinds of step, two sets of graphs:

- ``DecodeGraphs``: pure decode steps (every sequence decodes one token and
  samples it), one graph per batch-size bucket.
- ``MixedGraphs``: steps with prefill chunks (a new request's prompt, or a
  slice of it, beside running decodes), one graph per bucket of the step's
  total query tokens ``T``, sequences padded to ``max_seqs``. Attention reads
  the step's shape from tensors only (``AttentionMetadata.varlen_work``).

Shared by both (``_StepGraphs``):

- One int32 staging buffer, host (pinned) and device (``_Staging``): every
  value the host writes for a step lies in it, a fixed header of fields
  followed by the step's block tables packed as ``[rows, width]`` (width:
  the widest table this step). A step fills the host copy and moves it with
  ONE host-to-device copy, then one device-to-device copy spreads the packed
  tables into ``block_tables [rows, max_blocks_per_seq]`` int32, the
  fixed-width tables attention reads. Columns a step does not write keep
  older valid block ids; attention never reads past ``context_lens``.
- int64 views (token ids, positions, KV slots) are cast from the staging
  fields INSIDE the graph (captured casts, no host cost).
- A token the previous step sampled and the host has not read yet (the
  runner's overlapped steps) comes from the device: its ``input_src`` field
  holds its row in ``step_tokens`` (the runner's buffer the previous step's
  sampling wrote), -1 for a token the host staged; the graph picks one or
  the other per token.
- ``logits [rows, vocab]`` float32, the graph's output.
- ``draws``: each graph ends with the step's draw, ``sampling_triton.race``
  over its logits into ``tokens``, so a step whose rows need no torch
  filter (``sampling.race_row``) launches nothing after the replay. The
  header then ends with ``scales | floors`` (float32) and ``seeds`` (int64)
  a sampled row and the unseeded rows' base seed (int64); padded rows, and
  every row of a step drawn after the replay, are skipped (floor NaN: the
  captured draw reads none of their logits; a mixed-step graph's
  ``max_seqs`` rows of Qwen3.5's 248k logits would be 254 MB a step).
- Padding goes to the scratch block: a KV block the runner allocates beyond
  the ones it reports, so the scheduler never hands it out and padded writes
  never touch a sequence's cache. Padding rows are on LoRA slot 0.
- LoRA: each bucket has a base graph (no LoRA step: every hook is a no-op,
  so base requests on a LoRA server keep base speed) and a rows graph per
  width (``LoraLayers.begin_rows_step`` over the static slots; a small
  bucket's narrower widths read fewer slots' A, ``LoraLayers.widths``),
  picked per step by its rows' slots (``width_for``; 0, the base graph,
  where no row has an adapter). The graphs read the LoRA stacks'
  tensors by address: adapter installs must write into them in place
  (``LoraStack.install_slot`` does), which ``check_lora_in_place`` asserts
  after each install.
- Capture runs largest bucket first into one memory pool shared by every
  graph of both sets (the runner passes it): only one graph ever runs at a
  time, so smaller graphs reuse the larger ones' intermediate memory.

Ordering invariant: the host staging buffer is rewritten at the start of
each step while the previous step's copy may still be in flight (a step
that samples nothing never synchronises). ``_Staging`` records an event
after each copy and waits for it before the host writes again; usually it
has long completed (sampling reads the logits on the host).

``capture=False`` (CPU tests) keeps every buffer and the packing, and
"replays" by running the same static-shape forward eagerly on them.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from mstar_actors.models.attention import AttentionMetadata, max_varlen_items, plan_varlen_work
from mstar_actors.models.deltanet_ops import RECURRENT_MAX, StaticStep, static_sizes, static_step_plan, takes_recurrent
from mstar_actors.runner.sampling import RaceRows

log = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2  # torch wants eager runs on the capture stream first; Triton compiles in them
_NUM_FIELDS = 7  # decode header: input_ids, positions, slot_mapping, context_lens, lora_slots, state_slots, input_src
MIN_TOKEN_BUCKET = 16
_INT32_STATIC = ("decode_context", "decode_counts")  # StaticStep fields the graph reads as staged
PROGRESS_EVERY_S = 10.0  # capture logs its progress this often


class DecodeBatch(Protocol):
    """What a step gives ``DecodeGraphs.run`` (the runner's ``Batch``): host
    lists with one entry per sequence, each a single decode row."""

    input_ids: list[int]
    device_inputs: list[tuple[int, int]]  # (index into input_ids, row of step_tokens): tokens still on the device
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    chunk_slots: list[int]
    state_slots: list[int]  # a hybrid model's recurrent-state slots (-1 each otherwise)
    flat_tables: np.ndarray | None  # block_tables flattened (and table_lengths), or None: flattened here
    table_lengths: np.ndarray | None


class StepBatch(DecodeBatch, Protocol):
    """What a step gives ``MixedGraphs.run``: ``input_ids``, ``positions``,
    ``slot_mapping`` per token; the rest per sequence (chunk), and the
    sampled rows (flat token indices) with their LoRA slots."""

    query_lens: list[int]
    logits_indices: list[int]
    sample_slots: list[int]


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... (each
    power of two and the midpoint above it), up to and including ``max_batch``."""
    sizes = {1, 2, 4, 8}
    n = 16
    while n < max_batch:
        sizes |= {n, n + n // 2}
        n *= 2
    return sorted(s for s in sizes if s < max_batch) + [max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts of mixed steps: 16, 32, 64, ... (powers of two)
    below ``max_tokens``, then ``max_tokens`` itself."""
    sizes = []
    n = MIN_TOKEN_BUCKET
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def chunk_seq_buckets(num_tokens: int, max_seqs: int) -> list[int]:
    """Captured counts of a hybrid model's longer sequences (more than
    ``deltanet_ops.RECURRENT_MAX`` tokens: the chunked delta rule's) in a
    mixed step of ``num_tokens`` tokens: 0 (no chunked call), then 1, 4,
    16, ... below the most that fit, then that most (``max_seqs``, and no
    more than ``num_tokens // (RECURRENT_MAX + 1)``): each sequence the
    chunked call holds costs its state whether padding or not
    (``deltanet_triton``), so a step pays for at most 4x its own."""
    most = min(max_seqs, num_tokens // (RECURRENT_MAX + 1))
    sizes, n = [0], 1
    while n < most:
        sizes.append(n)
        n *= 4
    return sizes + [most] if most else sizes


class _Staging:
    """The int32 buffer a step's host values travel in: pinned on the host
    (CUDA), twinned on the device, moved in one copy (see the module doc)."""

    def __init__(self, size: int, device: torch.device):
        is_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=is_cuda)
        self.host_np = self.host.numpy()
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if is_cuda else None

    def view(self, start: int, length: int) -> torch.Tensor:
        """The device field ``[start, start + length)``."""
        return self.device[start : start + length]

    def begin_write(self) -> None:
        """Wait until the last upload has read the host copy (ordering invariant)."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self, stop: int) -> None:
        self.device[:stop].copy_(self.host[:stop], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


def _capture(forward: Callable[[], None], pool: Any, device: torch.device) -> torch.cuda.CUDAGraph:
    """Warm ``forward`` up on a side stream, then capture it into ``pool``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(NUM_WARMUP_RUNS):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # The collector stays off while capturing: a finalizer it runs mid-capture
    # (an event or a stream freed) is a CUDA call capture forbids, and it
    # invalidates the whole capture. torch.cuda.graph collects on entry.
    is_gc_on = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):  # on torch's own side stream
            forward()
    finally:
        if is_gc_on:
            gc.enable()
    return graph


class _StepGraphs:
    """What both sets share: the model, the staging and table buffers, capture
    and replay by key ``(bucket, width)`` (``width`` 0: the base graph), the LoRA address check.

    Owned by the runner, used on its thread only, one step at a time.
    """

    name = "step graphs"
    off_hint = "set model.enforce_eager: true"

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], lora: Any, *, num_table_rows: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, step_tokens: torch.Tensor,
                 draws: bool = False):
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.draws = draws  # the graphs draw each sampled row's token too (see the module doc)
        self.block_size, self.scratch_block = block_size, scratch_block
        self.device = kv_caches[0].device
        self.step_tokens = step_tokens  # the runner's: the last sampling's tokens, read by address
        self.is_captured = False
        self.graphs: dict[tuple[Any, int], torch.cuda.CUDAGraph] = {}
        self.block_tables = torch.full((num_table_rows, max_blocks_per_seq), scratch_block, dtype=torch.int32,
                                       device=self.device)
        self._lora_addresses = _lora_addresses(lora)

    @property
    def scratch_slot(self) -> int:
        """The KV slot padding tokens write (the scratch block's first)."""
        return self.scratch_block * self.block_size

    def _send(self, tables_start: int, tables: Sequence[Sequence[int]], num_rows: int,
              flat: np.ndarray | None = None, lengths: np.ndarray | None = None) -> None:
        """Pack ``tables`` into ``num_rows`` rows after the header (rows past
        ``len(tables)`` and short tables' tails: the scratch block), move
        header and tables in one copy, spread the tables into ``block_tables``.
        ``flat`` and ``lengths``: the tables already flattened (a decode batch's)."""
        if flat is None:
            lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
            # Every table at once: a boolean mask fills in row-major order, the tables' own.
            flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
        width = int(lengths.max())
        stop = tables_start + num_rows * width
        packed = self._stage.host_np[tables_start:stop].reshape(num_rows, width)
        packed.fill(self.scratch_block)
        packed[: len(tables)][np.arange(width) < lengths[:, None]] = flat
        self._stage.upload(stop)
        self.block_tables[:num_rows, :width].copy_(self._stage.view(tables_start, num_rows * width).view(num_rows, width))

    # -- the draw (``draws``) ---------------------------------------------------

    def _draw_size(self, num_rows: int) -> int:
        """Staged int32 entries of a draw of ``num_rows`` rows (0 without draws)."""
        return 4 * num_rows + 2 if self.draws else 0

    def _make_draw(self, at: int, num_rows: int) -> None:
        """The draw's fields at ``at`` (even: the seeds are int64, two int32
        each): ``scales | floors`` (float32), ``seeds`` (int64) a row, the
        base seed (int64); ``tokens``, the graph's draws. Rows start skipped (floor NaN)."""
        self._draw_at, self._draw_rows = at, num_rows
        if not self.draws:
            return
        self.scales, self.floors = self._stage.view(at, 2 * num_rows).view(torch.float32).view(2, num_rows)
        self.seeds = self._stage.view(at + 2 * num_rows, 2 * num_rows).view(torch.int64)
        self.base_seed = self._stage.view(at + 4 * num_rows, 2).view(torch.int64)
        self.tokens = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self._draw_host()[1][:] = np.nan

    def _draw_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The host's scales, floors, seeds and base seed fields."""
        h, at, m = self._stage.host_np, self._draw_at, self._draw_rows
        scales, floors = h[at : at + 2 * m].view(np.float32).reshape(2, m)
        return scales, floors, h[at + 2 * m : at + 4 * m].view(np.int64), h[at + 4 * m : at + 4 * m + 2].view(np.int64)

    def _write_draw(self, race: RaceRows | None, base_seed: int, num_rows: int) -> None:
        """A step's draw of its ``num_rows`` sampled rows into the host fields
        (the padded rows skipped); None: a draw of no row (every row skipped)."""
        if race is not None and not self.draws:
            raise ValueError(f"these {self.name} draw no tokens (made with draws=True they do)")
        if not self.draws:
            return
        scales, floors, seeds, base = self._draw_host()
        floors[num_rows:] = np.nan
        if race is None:
            floors[:num_rows] = np.nan
            return
        scales[:num_rows], floors[:num_rows], seeds[:num_rows] = race.scales, race.floors, race.seeds
        base[0] = base_seed

    def _draw(self, logits: torch.Tensor) -> None:
        """The captured draw over ``logits`` (the graph's sampled rows) into ``tokens``."""
        if self.draws:
            from mstar_actors.runner import sampling_triton

            n = logits.shape[0]
            sampling_triton.race(logits, self.scales[:n], self.floors[:n], self.seeds[:n], self.base_seed,
                                 out=self.tokens[:n])

    def _take_device_tokens(self, input_ids: torch.Tensor, input_src: torch.Tensor) -> None:
        """``input_ids[i] = step_tokens[input_src[i]]`` where ``input_src[i] >= 0`` (captured)."""
        from_device = self.step_tokens.index_select(0, input_src.clamp(min=0))
        input_ids.copy_(torch.where(input_src >= 0, from_device, input_ids))

    def _replay(self, key: tuple[Any, int]) -> None:
        if self.is_captured:
            self.graphs[key].replay()
        else:
            with torch.inference_mode():
                self._forward(*key)

    def _forward(self, bucket: Any, width: int) -> None:
        raise NotImplementedError

    def _bucket_keys(self) -> list:
        """The graphs' buckets, ascending (a key is ``(bucket, width)``)."""
        return list(self.buckets)

    @staticmethod
    def _rows_of(bucket: Any) -> int:
        """A bucket's token rows (a hybrid model's mixed buckets are ``(tokens, longer sequences)``)."""
        return bucket[0] if isinstance(bucket, tuple) else bucket

    def _widths(self, bucket: Any) -> tuple[int, ...]:
        """The bucket's graphs' widths: 0 (base), then each LoRA rows width (``LoraLayers.widths``)."""
        return (0,) if self.lora is None else (0, *self.lora.widths(self._rows_of(bucket)))

    def width_for(self, bucket: Any, chunk_slots: Sequence[int]) -> int:
        """The width of a step whose chunks are on ``chunk_slots``: 0 where none has an adapter."""
        if self.lora is None or not any(chunk_slots):
            return 0
        return self.lora.width_for(chunk_slots, self._rows_of(bucket))

    def _stage_empty(self, bucket: Any) -> None:
        """Before a bucket's capture: a header its warm-up runs may read (padding laid out for it)."""

    def _sizes(self) -> str:
        raise NotImplementedError

    # -- capture -----------------------------------------------------------

    def capture_all(self, pool: Any = None) -> None:
        """Capture every (bucket, width), largest bucket first, into ``pool``
        (a fresh one when None; see the module doc)."""
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        total, reported = sum(len(self._widths(bucket)) for bucket in self._bucket_keys()), start
        with torch.inference_mode():
            for bucket in reversed(self._bucket_keys()):
                self._stage_empty(bucket)
                for width in self._widths(bucket):
                    self.graphs[(bucket, width)] = self._capture_one(bucket, width, pool)
                if time.perf_counter() - reported > PROGRESS_EVERY_S and len(self.graphs) < total:
                    reported = time.perf_counter()
                    log.info("%s: %d of %d captured (%.0f s)", self.name, len(self.graphs), total, reported - start)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.is_captured = True
        log.info(
            "%s: %d captured (%s%s) in %.1f s, %.1f MiB of device memory",
            self.name, len(self.graphs), self._sizes(), self._variants(),
            time.perf_counter() - start, (free_before - free_after) / 2**20,
        )

    def _variants(self) -> str:
        if self.lora is None:
            return ""
        narrow = sum(0 < width < self.lora.num_slots for _, width in self.graphs)
        return ", base and LoRA rows each" + (f", and {narrow} of the small buckets' narrower LoRA widths" if narrow else "")

    def _capture_one(self, bucket: Any, width: int, pool: Any) -> torch.cuda.CUDAGraph:
        try:
            return _capture(lambda: self._forward(bucket, width), pool, self.device)
        except Exception as err:
            raise RuntimeError(
                f"{self.name}: capturing bucket {bucket} ({f'LoRA rows, width {width}' if width else 'base'}) failed: {err}; "
                f"to serve without these graphs, {self.off_hint}"
            ) from err

    # -- LoRA --------------------------------------------------------------

    def check_lora_in_place(self) -> None:
        """Raise if a LoRA stack tensor was reallocated: captured graphs read
        the addresses they saw at capture, so a new tensor would be ignored."""
        if _lora_addresses(self.lora) != self._lora_addresses:
            raise RuntimeError(
                f"a LoRA stack tensor moved after the {self.name} were captured; adapter installs must "
                "write into the existing stacks in place (LoraStack.install_slot), or set model.enforce_eager"
            )


class DecodeGraphs(_StepGraphs):
    """Pure decode steps, one graph per (batch bucket, LoRA variant).

    Header (``max_batch`` each; row i = sequence i): ``input_ids | positions
    | slot_mapping | context_lens | lora_slots | state_slots | input_src``. Padded rows
    (bucket > batch) decode token 0 at position 0 with context 1 on the
    scratch block and, for a hybrid model (``scratch_state_slot``), on the
    scratch state slot: a context of 1 starts from zero state, so padding
    never reads a sequence's state and writes only the scratch slot.
    """

    name = "decode graphs"

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], lora: Any, *, max_batch: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, capture: bool = True,
                 pool: Any = None, scratch_state_slot: int | None = None, step_tokens: torch.Tensor,
                 draws: bool = False):
        super().__init__(model, kv_caches, lora, num_table_rows=max_batch, max_blocks_per_seq=max_blocks_per_seq,
                         block_size=block_size, scratch_block=scratch_block, step_tokens=step_tokens, draws=draws)
        self.max_batch = max_batch
        self.scratch_state_slot = scratch_state_slot  # None: the model keeps no recurrent state
        self.buckets = batch_buckets(max_batch)
        self._make_buffers(model.spec.vocab_size)
        if capture:
            self.capture_all(pool)

    def _make_buffers(self, vocab_size: int) -> None:
        m, dev = self.max_batch, self.device
        draw_at = _NUM_FIELDS * m + (_NUM_FIELDS * m) % 2  # even (``_make_draw``)
        self._tables_start = draw_at + self._draw_size(m)
        self._stage = _Staging(self._tables_start + m * self.block_tables.shape[1], dev)
        ids32, pos32, slots32, self.context_lens, self.lora_slots, states32, self.input_src = (
            self._stage.view(0, _NUM_FIELDS * m).view(_NUM_FIELDS, m))
        self._make_draw(draw_at, m)
        self._stage_longs = (ids32, pos32, slots32, states32)
        self.state_slots = torch.zeros(m, dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(m, dtype=torch.long, device=dev)
        self.query_start = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(m, vocab_size, dtype=torch.float32, device=dev)
        self._fill_padding(0, m)
        self._stage.upload(self._tables_start)

    def _sizes(self) -> str:
        return f"batch sizes {self.buckets}"

    def bucket_for(self, num_rows: int) -> int:
        """The smallest captured batch size holding ``num_rows`` rows."""
        if not 1 <= num_rows <= self.max_batch:
            raise ValueError(f"decode graphs take 1..{self.max_batch} rows (model.cuda_graph_max_batch); got {num_rows}")
        return next(b for b in self.buckets if b >= num_rows)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` of the host header become padded rows (see the class doc)."""
        h, m = self._stage.host_np, self.max_batch
        scratch_state = -1 if self.scratch_state_slot is None else self.scratch_state_slot
        for field, value in enumerate((0, 0, self.scratch_slot, 1, 0, scratch_state, -1)):
            h[field * m + start : field * m + stop] = value

    def _load(self, batch: DecodeBatch, race: RaceRows | None = None, base_seed: int = 0) -> int:
        """Copy ``batch`` (and its draw's inputs) into the static buffers; return its bucket."""
        num_rows = len(batch.input_ids)
        bucket = self.bucket_for(num_rows)
        self._stage.begin_write()
        h, m = self._stage.host_np, self.max_batch
        for field, values in enumerate(
            (batch.input_ids, batch.positions, batch.slot_mapping, batch.context_lens, batch.chunk_slots,
             batch.state_slots)
        ):
            h[field * m : field * m + num_rows] = values
        _put_sources(h[6 * m : 7 * m], num_rows, batch.device_inputs)
        self._fill_padding(num_rows, bucket)
        self._write_draw(race, base_seed, num_rows)
        self._send(self._tables_start, batch.block_tables, bucket, batch.flat_tables, batch.table_lengths)
        return bucket

    def run(self, batch: DecodeBatch, race: RaceRows | None = None, base_seed: int = 0) -> torch.Tensor:
        """The step's logits ``[len(batch.input_ids), vocab]`` float32: a view of
        the static output, valid until the next ``run``. ``race`` (graphs
        that draw): the rows' draw, whose tokens are then ``tokens[:rows]``
        (``base_seed``: the unseeded rows'); without it the graph's draw is
        of no row."""
        bucket = self._load(batch, race, base_seed)
        self._replay((bucket, self.width_for(bucket, batch.chunk_slots)))
        return self.logits[: len(batch.input_ids)]

    def _forward(self, bucket: int, width: int) -> None:
        """The static-shape step over rows ``:bucket``: what a graph captures."""
        for static, staged in zip((self.input_ids, self.positions, self.slot_mapping, self.state_slots),
                                  self._stage_longs):
            static[:bucket].copy_(staged[:bucket])
        self._take_device_tokens(self.input_ids[:bucket], self.input_src[:bucket])
        is_hybrid = self.scratch_state_slot is not None
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            query_start=self.query_start[: bucket + 1],
            context_lens=self.context_lens[:bucket],
            query_lens_list=[1] * bucket,
            context_lens_list=[],  # stale under graph_decode: never read
            num_blocks_list=[],
            graph_decode=True,
            state_slots=self.state_slots[:bucket] if is_hybrid else None,
        )
        if width:
            self.lora.begin_rows_step(self.lora_slots[:bucket], width=width)
        try:
            hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            self.logits[:bucket].copy_(self.model.compute_logits(hidden))
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self._draw(self.logits[:bucket])


class MixedGraphs(_StepGraphs):
    """Steps with prefill chunks, one graph per (token bucket, LoRA variant).

    Header, laid out for the largest bucket ``T`` and ``S = max_seqs``:

    - ``input_ids | positions | slot_mapping`` ``[3, T]`` (cast to int64 in
      the graph), ``input_src [T]`` and ``token_slots [T]`` (each token's LoRA slot); padding
      tokens are token 0 at position 0 on the scratch slot, LoRA slot 0;
    - ``query_start [S + 1]``, ``context_lens [S]``: padded sequences have
      no queries (their start is the step's token count) and no context;
    - ``sampled_rows [S]`` (token rows whose logits the step returns, in
      ``logits_indices`` order; padding: row 0) and ``sampled_slots [S]``;
    - ``varlen_work [P, 2]`` (``plan_varlen_work``, padded with ``(-1, 0)``;
      a bucket of ``t`` tokens reads its first ``max_varlen_items(t, S)``);
    - a hybrid model's (``scratch_state_slot``): ``state_slots [S]`` (padded
      with the scratch slot, the convolution's) and the delta rule's
      ``deltanet_ops.StaticPlan`` fields, laid out for ``D = min(S, T)``
      recurrent entries (decode rows and short chunks), ``P`` longer
      sequences (``chunk_seq_buckets(T, S)``'s largest) and their chunks. A
      hybrid model's graphs are keyed by ``(t, p)``: the step's token bucket
      and the bucket of its longer sequences (0: none, no chunked call),
      whose ``deltanet_ops.static_sizes(t, min(S, t), p)`` entries it reads.

    No work item covers a padding token, so attention leaves its output row
    unwritten: the graph zeroes those rows after attention in every layer
    (``_padding_rows_zeroed``). Every other op is row-wise, so nothing of a
    padding row reaches a real one, and the K/V padding tokens write to the
    scratch block stay finite.
    """

    name = "mixed-step graphs"
    off_hint = "set model.cuda_graph_max_tokens: 0 (steps with prefill chunks then run eagerly)"

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], lora: Any, *, max_seqs: int, max_tokens: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, capture: bool = True,
                 pool: Any = None, scratch_state_slot: int | None = None, step_tokens: torch.Tensor,
                 draws: bool = False):
        if max_tokens < 1 or max_seqs < 1:
            raise ValueError(f"mixed-step graphs need max_tokens >= 1 and max_seqs >= 1; got {max_tokens}, {max_seqs}")
        super().__init__(model, kv_caches, lora, num_table_rows=max_seqs, max_blocks_per_seq=max_blocks_per_seq,
                         block_size=block_size, scratch_block=scratch_block, step_tokens=step_tokens, draws=draws)
        self.max_seqs = max_seqs
        self.scratch_state_slot = scratch_state_slot  # None: the model keeps no recurrent state
        self.buckets = token_buckets(max_tokens)
        self.seq_buckets = ({b: chunk_seq_buckets(b, max_seqs) for b in self.buckets}
                            if scratch_state_slot is not None else {})
        self._make_buffers(model.spec.vocab_size)
        if capture:
            self.capture_all(pool)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _bucket_keys(self) -> list:
        if self.scratch_state_slot is None:
            return list(self.buckets)
        return [(b, p) for b in self.buckets for p in self.seq_buckets[b]]

    def _stage_empty(self, bucket: Any) -> None:
        """Padding indices depend on the bucket (``static_step_plan``'s)."""
        if self.scratch_state_slot is not None:
            self._stage.begin_write()
            self._write_header([], [], [], [], [], [], [], bucket, device_inputs=())
            self._stage.upload(self._tables_start)

    def _make_buffers(self, vocab_size: int) -> None:
        t, s, dev = self.max_tokens, self.max_seqs, self.device
        self._num_work = {b: max_varlen_items(b, s) for b in self.buckets}
        sizes = dict(longs=3 * t, input_src=t, token_slots=t, query_start=s + 1, context_lens=s, sampled_rows=s, sampled_slots=s,
                     work=2 * self._num_work[t])
        if self.scratch_state_slot is not None:
            p = self.seq_buckets[t][-1]
            sizes.update(state_slots=s, **static_sizes(t, min(s, t), p))
        self._at: dict[str, int] = {}
        offset = 0
        for field, size in sizes.items():
            self._at[field] = offset
            offset += size
        draw_at = offset + offset % 2  # even (``_make_draw``)
        self._tables_start = draw_at + self._draw_size(s)
        self._stage = _Staging(self._tables_start + s * self.block_tables.shape[1], dev)
        view = {field: self._stage.view(self._at[field], size) for field, size in sizes.items()}
        self._stage_longs, self.input_src = view["longs"].view(3, t), view["input_src"]
        self.token_slots, self.query_start, self.context_lens = view["token_slots"], view["query_start"], view["context_lens"]
        self.sampled_rows, self.sampled_slots = view["sampled_rows"], view["sampled_slots"]
        self.varlen_work = view["work"].view(-1, 2)
        self.longs = torch.zeros(3, t, dtype=torch.long, device=dev)  # input_ids, positions, slot_mapping
        if self.scratch_state_slot is not None:  # int64 in the graph, cast from the staged fields
            self._stage_states = view["state_slots"]
            self.state_slots = torch.zeros(s, dtype=torch.long, device=dev)
            self._static_views = {name: view[name] for name in StaticStep._fields}
            self._static_longs = {name: torch.zeros_like(field, dtype=torch.long) for name, field in
                                  self._static_views.items() if name not in _INT32_STATIC + ("chunk_continues",)}
        self._token_index = torch.arange(t, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(s, vocab_size, dtype=torch.float32, device=dev)
        self._make_draw(draw_at, s)
        self._write_header([], [], [], [], [], [], [], self._bucket_keys()[-1], device_inputs=())
        self._stage.upload(self._tables_start)

    def _sizes(self) -> str:
        longer = (f"; longer sequences of a hybrid model's {len(self._bucket_keys())} buckets: "
                  f"{sorted({p for ps in self.seq_buckets.values() for p in ps})}" if self.seq_buckets else "")
        return f"token counts {self.buckets}, up to {self.max_seqs} sequences{longer}"

    def takes(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of ``num_tokens`` query tokens in ``num_seqs`` chunks fits a bucket."""
        return 1 <= num_tokens <= self.max_tokens and 1 <= num_seqs <= self.max_seqs

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int:
        """The smallest captured token count holding the step."""
        if not self.takes(num_tokens, num_seqs):
            raise ValueError(
                f"mixed-step graphs take 1..{self.max_tokens} tokens (model.cuda_graph_max_tokens) in "
                f"1..{self.max_seqs} sequences (model.cuda_graph_max_batch); got {num_tokens} in {num_seqs}"
            )
        return next(b for b in self.buckets if b >= num_tokens)

    def _write_header(self, input_ids, positions, slot_mapping, token_slots, query_lens, context_lens,
                      sampled, key: Any, sampled_slots: Sequence[int] = (), state_slots: Sequence[int] = (), *,
                      device_inputs: Sequence[tuple[int, int]]) -> None:
        """The header's host copy for one step, padded to graph ``key``'s
        bucket of tokens (and of longer sequences) and ``max_seqs`` sequences."""
        bucket, chunk_seqs = key if isinstance(key, tuple) else (key, 0)
        put = self._put
        t, s, num_tokens = self.max_tokens, self.max_seqs, len(input_ids)
        longs = self._at["longs"]
        put(longs, input_ids, bucket, 0)
        put(longs + t, positions, bucket, 0)
        put(longs + 2 * t, slot_mapping, bucket, self.scratch_slot)
        _put_sources(self._stage.host_np[self._at["input_src"] : self._at["input_src"] + bucket], num_tokens, device_inputs)
        put(self._at["token_slots"], token_slots, bucket, 0)
        put(self._at["query_start"], np.cumsum([0, *query_lens]), s + 1, num_tokens)
        put(self._at["context_lens"], context_lens, s, 0)
        put(self._at["sampled_rows"], sampled, s, 0)
        put(self._at["sampled_slots"], sampled_slots, s, 0)
        work = plan_varlen_work(query_lens, self._num_work[bucket])
        put(self._at["work"], np.asarray(work, dtype=np.int32).reshape(-1), 2 * len(work), 0)
        if self.scratch_state_slot is not None:
            put(self._at["state_slots"], state_slots, s, self.scratch_state_slot)
            plan = static_step_plan(query_lens, context_lens, state_slots, num_tokens=bucket,
                                    num_entries=min(s, bucket), num_chunk_seqs=chunk_seqs,
                                    scratch_slot=self.scratch_state_slot)
            for name, values in zip(StaticStep._fields, plan):
                put(self._at[name], values, len(values), 0)

    def _put(self, start: int, values: Sequence[int], stop: int, pad: int) -> None:
        """Host field at ``start``: ``values``, then ``pad`` up to ``stop`` entries."""
        h, n = self._stage.host_np, len(values)
        h[start : start + n] = values
        h[start + n : start + stop] = pad

    def _load(self, batch: StepBatch, race: RaceRows | None = None, base_seed: int = 0) -> Any:
        """Copy ``batch`` (and its draw's inputs) into the static buffers;
        return its graph's bucket (a hybrid model's: ``(tokens, longer sequences)``)."""
        num_seqs = len(batch.query_lens)
        key = bucket = self.bucket_for(len(batch.input_ids), num_seqs)
        if self.scratch_state_slot is not None:
            longer = sum(n > 0 and not takes_recurrent(n) for n in batch.query_lens)
            key = (bucket, next(p for p in self.seq_buckets[bucket] if p >= longer))
        self._stage.begin_write()
        token_slots = np.repeat(np.asarray(batch.chunk_slots, dtype=np.int32), batch.query_lens)
        self._write_header(batch.input_ids, batch.positions, batch.slot_mapping, token_slots, batch.query_lens,
                           batch.context_lens, batch.logits_indices, key, batch.sample_slots, batch.state_slots,
                           device_inputs=batch.device_inputs)
        self._write_draw(race, base_seed, len(batch.logits_indices))
        self._send(self._tables_start, batch.block_tables, num_seqs)
        return key

    def run(self, batch: StepBatch, race: RaceRows | None = None, base_seed: int = 0) -> torch.Tensor:
        """The sampled rows' logits ``[len(batch.logits_indices), vocab]`` float32:
        a view of the static output, valid until the next ``run``; ``race``:
        as ``DecodeGraphs.run``'s."""
        key = self._load(batch, race, base_seed)
        self._replay((key, self.width_for(key, batch.chunk_slots)))
        return self.logits[: len(batch.logits_indices)]

    def _forward(self, key: Any, width: int) -> None:
        """The static-shape step over the bucket's tokens: what a graph captures."""
        bucket, chunk_seqs = key if isinstance(key, tuple) else (key, 0)
        self.longs[:, :bucket].copy_(self._stage_longs[:, :bucket])
        input_ids, positions, slot_mapping = self.longs[:, :bucket]
        self._take_device_tokens(input_ids, self.input_src[:bucket])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=self.block_tables,
            query_start=self.query_start,
            context_lens=self.context_lens,
            query_lens_list=[],  # stale under varlen_work: never read
            context_lens_list=[],
            num_blocks_list=[],
            varlen_work=self.varlen_work[: self._num_work[bucket]],
        )
        if self.scratch_state_slot is not None:
            self.state_slots.copy_(self._stage_states)
            meta.state_slots, meta.deltanet_static = self.state_slots, self._static_step(bucket, chunk_seqs)
        is_padding = self._token_index[:bucket] >= self.query_start[-1]
        if width:
            self.lora.begin_rows_step(self.token_slots[:bucket], self.sampled_slots, width=width)
        try:
            with _padding_rows_zeroed(self.model, is_padding):
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            self.logits.copy_(self.model.compute_logits(hidden.index_select(0, self.sampled_rows)))
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self._draw(self.logits)


    def _static_step(self, bucket: int, chunk_seqs: int) -> StaticStep:
        """The delta rule's ``StaticStep`` of a bucket, cast from the staged fields (in the graph)."""
        stop = static_sizes(bucket, min(self.max_seqs, bucket), chunk_seqs)
        fields = {}
        for name, staged in self._static_views.items():
            staged = staged[: stop[name]]
            if name in _INT32_STATIC:
                fields[name] = staged  # as the decode kernel reads them
            elif name == "chunk_continues":
                fields[name] = staged > 0
            else:
                fields[name] = self._static_longs[name][: stop[name]]
                fields[name].copy_(staged)
        fields["chunk_indices"] = fields["chunk_indices"].view(-1, 2)
        return StaticStep(**fields)


def _put_sources(field: np.ndarray, num_tokens: int, device_inputs: Sequence[tuple[int, int]]) -> None:
    """The host ``input_src`` field of a step: -1 (staged) for every token, then each device token's row."""
    field[:] = -1
    for index, row in device_inputs:
        if not 0 <= index < num_tokens:
            raise ValueError(f"device input at token {index}: the step has {num_tokens} tokens")
        field[index] = row


class _ZeroedRows:
    """An attention backend whose output rows under ``is_padding [T]`` are zero,
    whatever the backend left there (a kernel writes only planned rows)."""

    def __init__(self, backend: Any, is_padding: torch.Tensor):
        self.backend, self.mask = backend, is_padding[:, None, None]

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.backend.write_kv(kv_cache, k, v, meta)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # masked_fill, not a multiply: 0 * NaN is NaN, and unwritten memory may hold any bits.
        return self.backend.attend(q, kv_cache, meta, scale).masked_fill_(self.mask, 0.0)


@contextmanager
def _padding_rows_zeroed(model: Any, is_padding: torch.Tensor) -> Iterator[None]:
    """Every layer's attention through ``_ZeroedRows`` for one forward: one
    small masked fill per layer, captured with the rest."""
    layers = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]  # a hybrid's too
    backends = [attn.backend for attn in layers]
    for attn, backend in zip(layers, backends):
        attn.backend = _ZeroedRows(backend, is_padding)
    try:
        yield
    finally:
        for attn, backend in zip(layers, backends):
            attn.backend = backend


def _lora_addresses(lora: Any) -> list[int]:
    if lora is None:
        return []
    return [t.data_ptr() for stack in lora.stacks.values() for t in (stack.a, stack.b, stack.scales)]
