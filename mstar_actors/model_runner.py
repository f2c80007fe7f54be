"""The model runner: one rank's model, KV cache and sequence state.

``ModelRunner.execute(plan)`` runs one ``StepPlan``: forget finished
sequences, remember started ones, flatten the scheduled chunks into one
varlen batch, run the model, sample one token for every chunk that asks for
it, and append that token to its sequence. The runner decides nothing: block
ids, chunk sizes and which rows sample all come from the conductor, so every
rank runs the same plan to the same tokens.

Sequence state lives from ``plan.started`` until the id appears in
``plan.finished``; a sequence restarted after a preemption arrives again in
``started`` with the outputs it had, and replaces the old state.

LoRA (``max_loras > 0``): each sequence runs on its ``SeqStart.lora_slot``
(0: the base model); ``install_adapter`` fills a slot between steps. With
LoRA off no stack exists and the model runs its base path only.

``build_batch`` is a pure function (no torch), so the plan-to-batch rules can
be tested without a model.

CUDA graphs (CUDA, text models, unless ``enforce_eager``; ``decode_graphs``):
a pure decode step (every chunk one token that samples) of up to
``cuda_graph_max_batch`` sequences replays a decode graph captured at
startup; any other step of up to that many sequences and
``cuda_graph_max_tokens`` tokens (prefill chunks beside decodes) replays a
mixed-step graph; a larger step runs eagerly. The KV cache has one block
more than ``num_kv_blocks`` reports: the scratch block padded graph rows
write into, which no plan can name (block ids are checked against
``num_kv_blocks``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from mstar_actors import messages
from mstar_actors.decode_graphs import DecodeGraphs, MixedGraphs
from mstar_actors.lora.adapter_file import AdapterWeights
from mstar_actors.models.attention import AttentionMetadata, allocate_kv_cache, kv_bytes_per_block
from mstar_actors.models.loader import load_model, load_spec
from mstar_actors.models.media_inputs import MediaInputs, TensorResolver
from mstar_actors.models.lora_layers import LoraLayers, enable_lora
from mstar_actors.sampling import SampleRow, sample_tokens

log = logging.getLogger(__name__)

MAX_CPU_KV_BYTES = 2 << 30  # CPU cache cap: RAM is shared with every other actor

Sampler = Callable[..., list[messages.SampledToken]]


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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
    sample_slots: list[int] = field(default_factory=list)  # LoRA slot of each sampled row


def build_batch(
    chunks: list[messages.ScheduledChunk],
    seqs: dict[str, SeqState],
    block_size: int,
    num_kv_blocks: int,
    max_model_len: int,
) -> Batch:
    """Flatten the scheduled chunks (ScheduledChunk's semantics, messages.py)."""
    batch = Batch()
    for chunk in chunks:
        seq = _check_chunk(chunk, seqs, block_size, num_kv_blocks, max_model_len)
        start, stop = chunk.num_computed, chunk.num_computed + chunk.num_tokens
        batch.input_ids += seq.tokens(start, stop)
        batch.positions += range(start, stop)
        table = chunk.block_ids
        batch.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]
        batch.block_tables.append(table[: -(-stop // block_size)])
        batch.query_lens.append(chunk.num_tokens)
        batch.context_lens.append(stop)
        batch.request_ids.append(chunk.request_id)
        batch.chunk_slots.append(seq.lora_slot)
        if chunk.sample:
            batch.logits_indices.append(len(batch.input_ids) - 1)
            batch.sample_ids.append(chunk.request_id)
            batch.sample_slots.append(seq.lora_slot)
    return batch


def _check_chunk(chunk, seqs, block_size, num_kv_blocks, max_model_len) -> SeqState:
    rid = chunk.request_id
    seq = seqs.get(rid)
    if seq is None:
        raise PlanError(f"request {rid!r}: scheduled but never started (missing from StepPlan.started)", [rid])
    stop = chunk.num_computed + chunk.num_tokens
    if chunk.num_tokens < 1 or chunk.num_computed < 0 or stop > seq.num_tokens:
        raise PlanError(
            f"request {rid!r}: chunk [{chunk.num_computed}, {stop}) is outside its "
            f"{seq.num_tokens} known tokens; need num_tokens >= 1 and num_computed + num_tokens <= known",
            [rid],
        )
    if chunk.sample and stop != seq.num_tokens:
        raise PlanError(f"request {rid!r}: sample=true but the chunk ends at {stop}, not at the last token {seq.num_tokens}", [rid])
    if stop > max_model_len:
        raise PlanError(f"request {rid!r}: {stop} tokens exceed max_model_len={max_model_len}", [rid])
    num_needed = -(-stop // block_size)
    if len(chunk.block_ids) < num_needed:
        raise PlanError(f"request {rid!r}: {stop} tokens need {num_needed} blocks, block_ids has {len(chunk.block_ids)}", [rid])
    bad = [b for b in chunk.block_ids[:num_needed] if not 0 <= b < num_kv_blocks]
    if bad:
        raise PlanError(f"request {rid!r}: block ids {bad} are outside [0, {num_kv_blocks})", [rid])
    return seq


class ModelRunner:
    """Owns one rank's model, KV cache, sequence state and sampling generator.

    Not thread-safe: the worker calls ``execute`` for one plan at a time, in
    plan order, which is what keeps every rank's state identical.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_fraction: float = 0.9,
        max_model_len: int | None = None,
        seed: int = 0,
        sampler: Sampler = sample_tokens,
        resolve_tensor: TensorResolver | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 0,
        enforce_eager: bool = False,
        cuda_graph_max_batch: int = 64,
        max_num_batched_tokens: int = 2048,
        cuda_graph_max_tokens: int = 2048,
        max_lora_images: int = 4,
        lora_fuse_shrink: bool | None = None,
    ):
        self.device = resolve_device(device)
        arch, spec = load_spec(Path(model_dir))  # read first: "auto" dtype depends on it
        self.dtype = resolve_dtype(dtype, spec.torch_dtype, self.device)
        self.model = load_model(model_dir, self.dtype, self.device)
        if self.device.type == "cpu":
            # Now, not in the first request's step, and before the KV cache
            # is sized from the RAM that is left.
            self.model.pack_cpu_weights()
        self.spec = spec
        # Stacks before the KV cache: its size is what memory is left.
        self.lora: LoraLayers | None = None
        if max_loras > 0:
            self.lora = enable_lora(
                self.model, arch.rules, num_slots=max_loras + 1, max_rank=max_lora_rank, dtype=self.dtype, device=self.device,
                fuse_shrink=lora_fuse_shrink,
            )
            self.lora.max_slot_images = max_lora_images  # pinned, made at the installs that keep them
            if self.device.type == "cuda":
                # Fused linears copied their weights into new buffers (``fuse_linear``): hand the
                # old ones back to the driver, or the KV cache sized below would count them as used.
                torch.cuda.empty_cache()
        self.lora_names: dict[int, str] = {}  # slot -> installed adapter's name
        self.block_size = block_size
        self.max_model_len = min(max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        self.num_kv_blocks = num_blocks or self._blocks_from_memory(memory_fraction)
        self.scratch_block = self.num_kv_blocks  # one past the reported blocks: see the module doc
        self.kv_caches = allocate_kv_cache(
            spec.num_layers, self.num_kv_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim, self.dtype, self.device
        )
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.sampler = sampler
        self.seqs: dict[str, SeqState] = {}
        # Multimodal models: per-sequence positions and vision rows; pixel
        # values are read through ``resolve_tensor`` (the worker's arena).
        self.media = MediaInputs(self.model, resolve_tensor) if getattr(self.model, "is_multimodal", False) else None
        # A step never holds more tokens than the scheduler batches.
        max_graph_tokens = min(cuda_graph_max_tokens, max_num_batched_tokens)
        if self.device.type == "cuda":
            # Graph buckets (a decode batch, a mixed step's sampled rows) are row counts too.
            self._warm_up_kernels(max(max_num_batched_tokens, cuda_graph_max_batch))
        # Last: capture needs the LoRA stacks and the KV cache, and its memory
        # comes out of what the cache left.
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager and self.media is None:
            self.enable_step_graphs(cuda_graph_max_batch, max_graph_tokens if self._captures_varlen() else 0)

    def _warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile every Triton kernel variant a step can launch before the
        first request (each compile takes about a second: mid-serving it would
        stall the whole batch). Variants depend on shapes only, so the set is
        known: attention's split counts, each LoRA stack's tiling per row count."""
        started = time.perf_counter()
        backend = self.model.model.layers[0].self_attn.backend
        if hasattr(backend, "warm_up"):
            backend.warm_up(self.spec.num_heads, self.spec.head_dim, self.kv_caches[0])
        if self.lora is not None:
            self.lora.warm_up_kernels(max_num_tokens)
        torch.cuda.synchronize(self.device)
        log.info("kernels compiled for up to %d tokens a step in %.1f s", max_num_tokens, time.perf_counter() - started)

    def enable_step_graphs(self, max_batch: int, max_tokens: int = 0, *, capture: bool = True) -> None:
        """Serve pure decode steps of up to ``max_batch`` sequences through
        ``DecodeGraphs`` and, when ``max_tokens`` > 0, other steps of up to
        ``max_batch`` sequences and ``max_tokens`` tokens through
        ``MixedGraphs``; ``capture=False`` runs their static paths eagerly
        (tests). Both capture into one memory pool, the larger set first."""
        if self.media is not None:
            raise ValueError(f"step graphs: {self.spec.architecture} is multimodal; its steps run eagerly")
        pool = torch.cuda.graph_pool_handle() if capture else None
        shared = dict(max_blocks_per_seq=-(-self.max_model_len // self.block_size), block_size=self.block_size,
                      scratch_block=self.scratch_block, capture=capture, pool=pool)
        if max_tokens > 0:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, self.lora, max_seqs=max_batch,
                                            max_tokens=max_tokens, **shared)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.lora, max_batch=max_batch, **shared)

    def _captures_varlen(self) -> bool:
        """Whether attention can run a mixed step inside a CUDA graph: the
        Triton backend's varlen kernel can; the torch reference (no Triton, or
        a head size the kernel does not take) reads the step on the host."""
        try:
            from mstar_actors.models.triton_attention import TritonPagedAttention, is_supported_head_dim
        except ImportError:
            return False
        backend = self.model.model.layers[0].self_attn.backend
        if isinstance(backend, TritonPagedAttention) and is_supported_head_dim(self.spec.head_dim):
            return True
        log.info("mixed-step graphs off: attention (%s, head_dim %d) has no capturable varlen kernel; "
                 "steps with prefill chunks run eagerly", type(backend).__name__, self.spec.head_dim)
        return False

    # -- protocol ----------------------------------------------------------

    def ready_info(self, rank: int) -> messages.WorkerReady:
        return messages.WorkerReady(
            rank=rank,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(self.spec.eos_token_ids),
        )

    def execute(self, plan: messages.StepPlan) -> list[messages.SampledToken]:
        """Run one plan; return the sampled tokens in the order of the sampled chunks."""
        self.forget(plan.finished)
        self.start(plan.started)
        if not plan.scheduled:
            return []
        batch = build_batch(plan.scheduled, self.seqs, self.block_size, self.num_kv_blocks, self.max_model_len)
        logits = self._run_model(batch)
        if not batch.sample_ids:
            return []
        rows = [self._sample_row(rid) for rid in batch.sample_ids]
        sampled = self.sampler(logits, rows, generator=self.generator)
        for token in sampled:
            self.seqs[token.request_id].output_token_ids.append(token.token_id)
        return sampled

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
            self.seqs[s.request_id] = SeqState(list(s.prompt_token_ids), s.sampling, list(s.output_token_ids), s.lora_slot)
            if (error := self._start_media(s)) is not None:
                self.seqs.pop(s.request_id)
                errors.append(error)
        if errors:
            raise PlanError("; ".join(errors), [s.request_id for s in started if s.request_id not in self.seqs])

    def install_adapter(self, slot: int, weights: AdapterWeights) -> None:
        """Install ``weights`` into ``slot`` (cleared first: no earlier tenant's
        rows survive); returns once the device holds them. No running
        sequence may use ``slot``; steps on other slots may run meanwhile on
        another thread (the worker installs on a thread beside its steps): a
        step reads only its rows' slots, and on CUDA the copies run on a
        stream of their own, which the install waits for (not the steps')."""
        if self.lora is None:
            raise ValueError(f"adapter {weights.name!r}: LoRA is off on this rank (lora.max_loras = 0); enable it to install adapters")
        self.lora_names.pop(slot, None)  # on failure the slot is cleared and holds nothing
        self.lora.install(slot, weights)  # returns once the device holds the copy
        for graphs in (self.graphs, self.mixed_graphs):  # the graphs read the stacks by address
            if graphs is not None:
                graphs.check_lora_in_place()
        self.lora_names[slot] = weights.name

    def reinstall_adapter(self, slot: int, name: str, digest: str) -> bool:
        """Install the adapter of ``digest`` into ``slot`` from the pinned image
        this rank kept when it last installed it (``install_adapter``), with
        no host copy to read; False when it kept none (then install it)."""
        if self.lora is None:
            return False
        self.lora_names.pop(slot, None)
        if not self.lora.reinstall(slot, name, digest):
            return False
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.check_lora_in_place()
        self.lora_names[slot] = name
        return True

    def _lora_hint(self) -> str:
        if self.lora is None:
            return "LoRA is off on this rank (lora.max_loras = 0), so only slot 0 (base) is accepted"
        return f"installed: {dict(sorted(self.lora_names.items())) or 'none'} (slot: adapter)"

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished sequences; an unknown id is a no-op (aborts are idempotent)."""
        for rid in request_ids:
            self.seqs.pop(rid, None)
            if self.media is not None:
                self.media.forget(rid)

    # -- internals ---------------------------------------------------------

    def _start_media(self, s: messages.SeqStart) -> str | None:
        """Why ``s``'s media can't be served here, or None when it can (or has none)."""
        if self.media is None:
            return f"request {s.request_id!r}: has {len(s.media)} media item(s) but {self.spec.architecture} takes text only" if s.media else None
        try:
            self.media.start(s.request_id, s.prompt_token_ids, s.media)
        except ValueError as err:
            return str(err)
        return None

    def _sample_row(self, request_id: str) -> SampleRow:
        seq = self.seqs[request_id]
        return SampleRow(request_id, seq.sampling, seq.prompt_token_ids, seq.output_token_ids)

    def _run_model(self, batch: Batch) -> torch.Tensor:
        """The batch's sampled rows' logits, ``[len(batch.sample_ids), vocab]`` float32."""
        if self._is_graph_step(batch):
            return self.graphs.run(batch)
        if self.mixed_graphs is not None and self.mixed_graphs.takes(len(batch.input_ids), len(batch.request_ids)):
            return self.mixed_graphs.run(batch)
        input_ids, positions, meta, logits_indices = self._to_device(batch)
        if self.lora is not None:
            self.lora.begin_step(batch.chunk_slots, batch.query_lens, batch.sample_slots)
        try:
            with torch.inference_mode():
                hidden = self._forward(batch, input_ids, positions, meta)
                return self.model.compute_logits(hidden[logits_indices])
        finally:
            if self.lora is not None:
                self.lora.end_step()

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
        def longs(values: list[int]) -> torch.Tensor:
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
        return longs(batch.input_ids), longs(batch.positions), meta, longs(batch.logits_indices)

    def _blocks_from_memory(self, memory_fraction: float) -> int:
        """KV blocks that fit in ``memory_fraction`` of free device memory (CPU: of
        available RAM, capped at ``MAX_CPU_KV_BYTES``), measured after loading weights."""
        spec = self.spec
        per_block = kv_bytes_per_block(spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * memory_fraction)
        else:
            budget = min(int(psutil.virtual_memory().available * memory_fraction), MAX_CPU_KV_BYTES)
        num_blocks = budget // per_block - 1  # less the scratch block
        if num_blocks < 1:
            raise RuntimeError(
                f"kv: no room for two KV blocks (one is scratch) of {per_block} bytes on {self.device} "
                f"(budget {budget} bytes); raise kv.memory_fraction or set kv.num_blocks"
            )
        log.info("kv cache: %d blocks of %d tokens (%.1f MiB) on %s", num_blocks, self.block_size, num_blocks * per_block / 2**20, self.device)
        return num_blocks


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={device!r} but no CUDA device is available; accepted here: cpu, auto")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (half precision is slow there); on a GPU the
    checkpoint's half dtype, or bfloat16 for a float32 checkpoint."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"model.dtype={dtype!r}; accepted: auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("bfloat16", "float16") else torch.bfloat16
