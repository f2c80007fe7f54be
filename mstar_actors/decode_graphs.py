"""CUDA graphs for pure decode steps: captured once per batch-size bucket, replayed per step.

An eager decode step of a small model is host-bound: hundreds of kernel
launches (more with LoRA: two per targeted linear) cost more than the GPU
work. A step in which every sequence decodes one token and samples it has
the same shape every time for a given batch size, so, as vLLM does, we
capture ``model(...)`` + ``compute_logits`` once per bucket size into a CUDA
graph over static buffers and replay it with the step's values copied in.

Static buffers (sized for ``max_batch`` rows; row i = sequence i):

- one int32 staging buffer, host (pinned) and device, laid out as
  ``[input_ids | positions | slot_mapping | context_lens | lora_slots]``
  (``max_batch`` each) followed by the step's block tables packed as
  ``[bucket, width]`` (width: the widest table this step). A step fills the
  host copy and moves it with ONE host-to-device copy, then one
  device-to-device copy spreads the packed tables into
- ``block_tables [max_batch, max_blocks_per_seq]`` int32, the fixed-width
  tables attention reads (``AttentionMetadata.graph_decode``). Columns a
  step does not write keep older valid block ids; attention never reads past
  ``context_lens``.
- ``input_ids``, ``positions``, ``slot_mapping`` int64, filled from the
  staging views INSIDE the graph (three captured casts, no host cost).
- ``logits [max_batch, vocab]`` float32, the graph's output.

Padded rows (bucket > batch) decode token 0 at position 0 with context 1 on
the scratch block: a KV block the runner allocates beyond the ones it
reports, so the scheduler never hands it out and padded writes never touch a
sequence's cache. Their LoRA slot is 0.

LoRA: each bucket has a base graph (no LoRA step: every hook is a no-op, so
base requests on a LoRA server keep base speed) and a rows graph
(``LoraLayers.begin_rows_step`` over the static slots), picked per step by
whether any row has an adapter. The graphs read the LoRA stacks' tensors by
address: adapter installs must write into them in place (``LoraStack.install_slot``
does), which ``check_lora_in_place`` asserts after each install.

Ordering invariant: the host staging buffer is rewritten at the start of
each step while the previous step's copy may, in principle, be in flight.
It never is: the runner samples from the previous step's logits on the host
(a synchronising ``.tolist()``), which is stream-ordered after that copy.

``capture=False`` (CPU tests) keeps every buffer and the packing, and
"replays" by running the same static-shape forward eagerly on them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from mstar_actors.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2  # torch wants eager runs on the capture stream first; Triton compiles in them
_NUM_FIELDS = 5  # input_ids, positions, slot_mapping, context_lens, lora_slots


class DecodeBatch(Protocol):
    """What a step gives ``DecodeGraphs.run`` (the runner's ``Batch``): host
    lists with one entry per sequence, each a single decode row."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    chunk_slots: list[int]


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... (each
    power of two and the midpoint above it), up to and including ``max_batch``."""
    sizes = {1, 2, 4, 8}
    n = 16
    while n < max_batch:
        sizes |= {n, n + n // 2}
        n *= 2
    return sorted(s for s in sizes if s < max_batch) + [max_batch]


class DecodeGraphs:
    """Static buffers and one captured graph per (bucket, LoRA variant).

    Owned by the runner, used on its thread only, one step at a time.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        lora: Any,
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        capture: bool = True,
    ):
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.max_batch, self.block_size, self.scratch_block = max_batch, block_size, scratch_block
        self.buckets = batch_buckets(max_batch)
        self.device = kv_caches[0].device
        self.is_captured = capture
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._make_buffers(max_blocks_per_seq, model.spec.vocab_size)
        self._lora_addresses = _lora_addresses(lora)
        if capture:
            self.capture_all()

    # -- buffers -----------------------------------------------------------

    def _make_buffers(self, max_blocks_per_seq: int, vocab_size: int) -> None:
        m, dev = self.max_batch, self.device
        size = _NUM_FIELDS * m + m * max_blocks_per_seq
        pin = dev.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._stage = torch.zeros(size, dtype=torch.int32, device=dev)
        ids32, pos32, slots32, self.context_lens, self.lora_slots = self._stage[: _NUM_FIELDS * m].view(_NUM_FIELDS, m)
        self._stage_longs = (ids32, pos32, slots32)
        self.input_ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(m, dtype=torch.long, device=dev)
        self.block_tables = torch.full((m, max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(m, vocab_size, dtype=torch.float32, device=dev)
        self._fill_padding(0, m)
        self._stage.copy_(self._host)

    def bucket_for(self, num_rows: int) -> int:
        """The smallest captured batch size holding ``num_rows`` rows."""
        if not 1 <= num_rows <= self.max_batch:
            raise ValueError(f"decode graphs take 1..{self.max_batch} rows (model.cuda_graph_max_batch); got {num_rows}")
        return next(b for b in self.buckets if b >= num_rows)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` of the host header become padded rows (see module doc)."""
        h, m = self._host_np, self.max_batch
        for field, value in enumerate((0, 0, self.scratch_block * self.block_size, 1, 0)):
            h[field * m + start : field * m + stop] = value

    def _load(self, batch: DecodeBatch) -> int:
        """Copy ``batch`` into the static buffers; return its bucket."""
        num_rows = len(batch.input_ids)
        bucket = self.bucket_for(num_rows)
        h, m = self._host_np, self.max_batch
        for field, values in enumerate(
            (batch.input_ids, batch.positions, batch.slot_mapping, batch.context_lens, batch.chunk_slots)
        ):
            h[field * m : field * m + num_rows] = values
        self._fill_padding(num_rows, bucket)
        width = max(len(t) for t in batch.block_tables)
        start = _NUM_FIELDS * m
        tables = h[start : start + bucket * width].reshape(bucket, width)
        tables.fill(self.scratch_block)
        for row, table in zip(tables, batch.block_tables):
            row[: len(table)] = table
        stop = start + bucket * width
        self._stage[:stop].copy_(self._host[:stop], non_blocking=True)
        self.block_tables[:bucket, :width].copy_(self._stage[start:stop].view(bucket, width))
        return bucket

    # -- steps -------------------------------------------------------------

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """The step's logits ``[len(batch.input_ids), vocab]`` float32: a view of
        the static output, valid until the next ``run``."""
        bucket = self._load(batch)
        uses_rows = self.lora is not None and any(batch.chunk_slots)
        if self.is_captured:
            self.graphs[(bucket, uses_rows)].replay()
        else:
            with torch.inference_mode():
                self._forward(bucket, uses_rows)
        return self.logits[: len(batch.input_ids)]

    def _forward(self, bucket: int, uses_rows: bool) -> None:
        """The static-shape step over rows ``:bucket``: what a graph captures."""
        for static, staged in zip((self.input_ids, self.positions, self.slot_mapping), self._stage_longs):
            static[:bucket].copy_(staged[:bucket])
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            query_start=self.query_start[: bucket + 1],
            context_lens=self.context_lens[:bucket],
            query_lens_list=[1] * bucket,
            context_lens_list=[],  # stale under graph_decode: never read
            num_blocks_list=[],
            graph_decode=True,
        )
        if uses_rows:
            self.lora.begin_rows_step(self.lora_slots[:bucket])
        try:
            hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            self.logits[:bucket].copy_(self.model.compute_logits(hidden))
        finally:
            if self.lora is not None:
                self.lora.end_step()

    # -- capture -----------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every (bucket, variant), largest bucket first, into one
        shared memory pool: later (smaller) graphs reuse the larger ones'
        intermediate memory, since only one graph ever runs at a time."""
        variants = (False, True) if self.lora is not None else (False,)
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                for uses_rows in variants:
                    self.graphs[(bucket, uses_rows)] = self._capture_one(bucket, uses_rows, pool)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        log.info(
            "decode graphs: %d captured (batch sizes %s%s) in %.1f s, %.1f MiB of device memory",
            len(self.graphs), self.buckets, ", base and LoRA rows each" if len(variants) == 2 else "",
            time.perf_counter() - start, (free_before - free_after) / 2**20,
        )

    def _capture_one(self, bucket: int, uses_rows: bool, pool: Any) -> torch.cuda.CUDAGraph:
        # Buffers hold padded rows here (set at construction, never loaded
        # before capture): warm-up and capture runs write only the scratch block.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                self._forward(bucket, uses_rows)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # on torch's own side stream
            self._forward(bucket, uses_rows)
        return graph

    # -- LoRA --------------------------------------------------------------

    def check_lora_in_place(self) -> None:
        """Raise if a LoRA stack tensor was reallocated: captured graphs read
        the addresses they saw at capture, so a new tensor would be ignored."""
        if _lora_addresses(self.lora) != self._lora_addresses:
            raise RuntimeError(
                "a LoRA stack tensor moved after the decode graphs were captured; adapter installs must "
                "write into the existing stacks in place (LoraStack.install_slot), or set model.enforce_eager"
            )


def _lora_addresses(lora: Any) -> list[int]:
    if lora is None:
        return []
    return [t.data_ptr() for stack in lora.stacks.values() for t in (stack.a, stack.b, stack.scales)]
