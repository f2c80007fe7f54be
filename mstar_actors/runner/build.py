"""A rank's ``ModelRunner``, built from the validated config and the model's facts.

``build_runner`` runs named steps, each in the place the next one needs:

1. ``load_model``: the weights, on the device, in the serving dtype.
2. ``model.quantize_cpu_weights`` (CPU, ``model.quantization``), then
   ``model.pack_cpu_weights``: the GEMM layout, now rather than in the first
   request's step, and before the KV cache is sized from the RAM left.
3. ``enable_served_lora``: the LoRA stacks, where an adapter can ever be
   served; before the KV cache, whose size is the memory that is left.
   On CPU, ``cpu_stack.install`` then gathers the final weights' addresses
   for base-only steps' one-call layer stack. On CUDA, ``merged_weights``
   keeps a copy of the decoder's weights for steps of one adapter on merged
   weights (``lora.merge``).
4. ``size_kv_cache``: the blocks that fit (or ``kv.num_blocks``), plus the
   scratch block.
5. ``warm_kernels`` (CUDA): every Triton variant a step can launch, compiled
   before the first request.
6. ``capture_graphs`` (CUDA, text models, unless ``enforce_eager``): last,
   since capture needs the stacks and the cache, and its memory comes out of
   what the cache left.
"""

from __future__ import annotations

import logging
import re
import time

import psutil
import torch
from torch import nn

from mstar_actors.config import Config, ConfigError, KvConfig, LoraConfig
from mstar_actors.fetch import EMBEDDED
from mstar_actors.lora.merge import MergedWeights
from mstar_actors.model_info import ModelInfo
from mstar_actors.models import cpu_stack
from mstar_actors.models.attention import allocate_kv_cache, kv_bytes_per_block
from mstar_actors.models.checkpoint import CheckpointRules
from mstar_actors.models.cpu_quant import GROUP, bits_of, has_dot_kernel, quantization_problem
from mstar_actors.models.deltanet_ops import StatePool, allocate_state_pools, state_bytes_per_slot
from mstar_actors.models.loader import load_model
from mstar_actors.models.registry import ARCHITECTURES
from mstar_actors.models.lora_layers import LoraLayers, enable_lora
from mstar_actors.models.media_inputs import MediaInputs, TensorResolver
from mstar_actors.models.spec import ModelSpec
from mstar_actors.runner.device import resolve_device, resolve_dtype, use_device
from mstar_actors.runner.model_runner import KvCache, ModelRunner, Sampler
from mstar_actors.runner.parallel import SINGLE_RANK, TensorParallel, rank_device
from mstar_actors.runner.sampling import sample_pending

log = logging.getLogger(__name__)

MAX_CPU_KV_BYTES = 2 << 30  # CPU cache cap: RAM is shared with every other actor


def _by_kind(names: list[str]) -> str:
    """Module names as kinds and counts: "mlp.down_proj in 2 layers, lm_head"."""
    kinds: dict[str, int] = {}
    for name in names:
        kind = re.sub(r"^.*\blayers\.\d+\.", "", name)
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{kind} in {n} layers" if n > 1 else kind for kind, n in kinds.items())


def build_runner(config: Config, info: ModelInfo, resolve_tensor: TensorResolver | None = None, *,
                 sampler: Sampler = sample_pending, tp: TensorParallel = SINGLE_RANK) -> ModelRunner:
    """The rank's runner (blocking: loads weights). ``resolve_tensor`` reads
    media pixel values (the rank's arena); ``sampler`` picks each step's
    tokens; ``tp`` is the rank's tensor-parallel group (its shard is loaded)."""
    device = rank_device(resolve_device(config.model.device), tp.rank, tp.world_size)
    use_device(device)  # this thread's kernels, streams and graph captures go to the rank's device
    dtype = resolve_dtype(info.dtype, None, device)
    bits = quantization_bits(config.model.quantization, config.model.path, device, dtype)
    model = load_model(info.model_dir, dtype, device, tp)
    if bits is not None:
        int8_activations = config.model.quantization == "int4_a8"
        dropped, kept, left_float = model.quantize_cpu_weights(bits, int8_activations=int8_activations)
        log.info("weights: int%d linears%s%s take %.1f MiB in place of %.1f MiB of float32", bits,
                 ", int8 activations" if int8_activations else "",
                 " (int8 head)" if model.lm_head_quant is not None else "",
                 kept / 2**20, dropped / 2**20)
        if left_float:
            log.warning("weights: %d of the linears stay float32, their input size (this rank's share) not a "
                        "multiple of %d: %s", len(left_float), GROUP, _by_kind(left_float))
    if device.type == "cpu":
        model.pack_cpu_weights()  # step 2
    rules = ARCHITECTURES[info.architecture].rules  # where adapters' modules land: the loader's own table
    lora = enable_served_lora(model, rules, config.lora, dtype, device)
    if device.type == "cpu":
        cpu_stack.install(model)  # step 3, on the final weights
        if lora is not None:  # after the stack's plan: its quantized linears' stacks keep bfloat16 halves too
            staging = lora.start_staging()
            log.info("LoRA slot images: up to %d kept for swaps (lora.max_cpu_loras; %.1f MiB each, as used), a "
                     "swap of those one copy", staging.max_images, staging.kept_image_bytes / 2**20)
    merged = merged_weights(lora, config.lora, device)
    pools, snapshots = size_state_pools(model.spec, config.scheduler.max_num_seqs, num_state_snapshots(config), dtype,
                                        device)
    kv = size_kv_cache(model.spec, config.kv, dtype, device, model.layout.num_kv_heads, pools, snapshots)
    media = MediaInputs(model, resolve_tensor) if getattr(model, "is_multimodal", False) else None
    runner = ModelRunner(model, kv, max_model_len=info.max_model_len, lora=lora, media=media, sampler=sampler,
                         seed=config.model.seed, max_sampled_rows=config.scheduler.max_num_seqs)
    if merged is not None:
        runner.merge_one_adapter_steps(merged, config.lora.merge_after_steps)
    max_batch, max_tokens = graph_limits(config)
    if device.type == "cuda":
        # Graph buckets (a decode batch, a mixed step's sampled rows) are row counts too.
        warm_kernels(runner, max(config.scheduler.max_num_batched_tokens, max_batch))
    if takes_graphs(config, device, is_multimodal=media is not None):
        capture_graphs(runner, max_batch, max_tokens)
    return runner


def quantization_bits(quantization: str, model_path: str, device: torch.device, dtype: torch.dtype) -> int | None:
    """``model.quantization`` -> the linear layers' bits (None: float).
    "auto" is an embedded model's shipped quantization on CPU float32, else
    none; an explicit int8/int4 elsewhere is refused (``ConfigError``)."""
    if quantization == "auto":
        shipped = EMBEDDED[model_path].quantization if model_path in EMBEDDED else "none"
        is_float_cpu = device.type == "cpu" and dtype == torch.float32
        return bits_of(shipped) if is_float_cpu else None
    if (problem := quantization_problem(quantization, device.type, dtype)) is not None:
        raise ConfigError(problem)
    bits = bits_of(quantization)
    if quantization == "int4_a8" and not has_dot_kernel():
        raise ConfigError("model.quantization: int4_a8 runs on our AVX2 integer-dot kernel, which this CPU does not "
                          "take (an AVX-512 CPU runs the AVX-512 kernel, or no kernel built: see the log's warning); "
                          "set model.quantization: int4")
    return bits


def is_lora_served(lora: LoraConfig) -> bool:
    """Whether any adapter can ever be served: configured ones or runtime
    loads. Otherwise the model keeps its base path, with no stacks."""
    return bool(lora.adapters) or lora.allow_runtime_updates


def enable_served_lora(model: nn.Module, rules: CheckpointRules, lora: LoraConfig, dtype: torch.dtype,
                       device: torch.device) -> LoraLayers | None:
    """``max_loras`` slots beside the base (slot 0) on every targetable
    module, or None where no adapter can be served (``is_lora_served``)."""
    if not is_lora_served(lora):
        return None
    layers = enable_lora(model, rules, num_slots=lora.max_loras + 1, max_rank=lora.max_lora_rank, dtype=dtype,
                         device=device)
    layers.max_slot_images = lora.max_cpu_loras  # as many slot images as the reader keeps host copies
    staging = layers.start_staging()  # its device twins, before the KV cache takes what is free
    if device.type == "cuda":
        log.info("LoRA slot images: up to %d kept for swaps (lora.max_cpu_loras), pinned on the host; the %d most "
                 "recently used on %s too (%.1f MiB each, %.1f MiB in all), a swap of those one device copy",
                 staging.max_images, staging.num_device_images, device, staging.image_bytes / 2**20,
                 staging.num_device_images * staging.image_bytes / 2**20)
        # Fused linears copied their weights into new buffers (``fuse_linear``): hand the
        # old ones back to the driver, or the KV cache sized next would count them as used.
        torch.cuda.empty_cache()
    return layers


def size_state_pools(spec: ModelSpec, num_slots: int, num_snapshots: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[list[StatePool], list[StatePool]]:
    """A hybrid model's recurrent-state slots, one per sequence the scheduler
    may run (``scheduler.max_num_seqs``), and its prefix-cache snapshots, both
    allocated before the KV cache takes what is left; none for other models."""
    la = spec.linear_attention
    if la is None:
        return [], []
    layers = len(spec.state_layers)
    shape = (la.conv_dim, la.conv_kernel, la.num_v_heads, la.k_head_dim, la.v_head_dim)
    pools = allocate_state_pools(layers, num_slots, *shape, dtype, device)
    snapshots = allocate_state_pools(layers, num_snapshots, *shape, dtype, device) if num_snapshots else []
    per_slot = state_bytes_per_slot(layers, *shape, dtype)
    log.info("recurrent state: %d slots and %d prefix snapshots of %.2f MiB each (%.1f MiB, %d linear-attention "
             "layers) on %s; the KV cache takes what is left", num_slots, num_snapshots, per_slot / 2**20,
             (num_slots + 1 + (num_snapshots + 1 if num_snapshots else 0)) * per_slot / 2**20, layers, device)
    return pools, snapshots


def num_state_snapshots(config: Config) -> int:
    """``kv.state_snapshots``, by default one per sequence the scheduler may run; 0 without prefix caching."""
    if not config.kv.enable_prefix_caching:
        return 0
    return config.scheduler.max_num_seqs if config.kv.state_snapshots is None else config.kv.state_snapshots


def merged_weights(lora: LoraLayers | None, config: LoraConfig, device: torch.device) -> MergedWeights | None:
    """The copy of the decoder's weights that steps of one adapter on merged weights restore from
    (``lora.merge``), taken before the KV cache is sized; None where LoRA is off, on CPU (its layer
    stack reads packed copies of the weights) or with ``lora.merge_after_steps: 0``."""
    if lora is None or device.type != "cuda" or not config.merge_after_steps:
        return None
    merged = lora.merged_weights()
    log.info("LoRA: from the %dth step in a row whose rows are all on one adapter, steps run on it merged into the "
             "weights (lora.merge_after_steps; 0 turns it off); the decoder's weights as loaded are kept to restore "
             "them: %.1f MiB", config.merge_after_steps, merged.num_bytes / 2**20)
    return merged


def size_kv_cache(spec: ModelSpec, kv: KvConfig, dtype: torch.dtype, device: torch.device,
                  num_kv_heads: int | None = None, state_pools: list[StatePool] | None = None,
                  snapshot_pools: list[StatePool] | None = None) -> KvCache:
    """``kv.num_blocks`` blocks, else those that fit in ``kv.memory_fraction``
    of what is free now; one more is allocated as the scratch block. A rank
    caches its own ``num_kv_heads`` (all of them without tensor parallelism),
    for the full-attention layers only (``spec.kv_layers``)."""
    num_kv_heads = num_kv_heads or spec.num_kv_heads
    num_blocks = kv.num_blocks or blocks_from_memory(spec, kv.block_size, kv.memory_fraction, dtype, device,
                                                     num_kv_heads)
    per_block = kv_bytes_per_block(len(spec.kv_layers), kv.block_size, num_kv_heads, spec.head_dim, dtype)
    if kv.num_blocks:  # set by hand: it must fit what is free, or the allocation's own error names no key
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                else psutil.virtual_memory().available)
        if (num_blocks + 1) * per_block > free:
            raise ConfigError(f"kv.num_blocks {num_blocks} of kv.block_size {kv.block_size} tokens take "
                              f"{(num_blocks + 1) * per_block / 2**30:.1f} GiB; {free / 2**30:.1f} GiB is free on "
                              f"{device}: set fewer blocks (or smaller ones), or leave kv.num_blocks out to size the "
                              "cache from kv.memory_fraction")
    caches = allocate_kv_cache(len(spec.kv_layers), num_blocks + 1, kv.block_size, num_kv_heads, spec.head_dim,
                               dtype, device)
    log.info("kv cache: %d blocks of %d tokens (%.1f MiB, %s) on %s", num_blocks, kv.block_size,
             num_blocks * per_block / 2**20, "kv.num_blocks" if kv.num_blocks else
             f"kv.memory_fraction {kv.memory_fraction:g} of what was free", device)
    return KvCache(caches, kv.block_size, num_blocks, state_pools or [], snapshot_pools or [])


def blocks_from_memory(spec: ModelSpec, block_size: int, memory_fraction: float, dtype: torch.dtype,
                       device: torch.device, num_kv_heads: int | None = None) -> int:
    """KV blocks that fit in ``memory_fraction`` of free device memory (CPU: of
    available RAM, capped at ``MAX_CPU_KV_BYTES``), measured after loading weights."""
    per_block = kv_bytes_per_block(len(spec.kv_layers), block_size, num_kv_heads or spec.num_kv_heads, spec.head_dim,
                                   dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction)
    else:
        budget = min(int(psutil.virtual_memory().available * memory_fraction), MAX_CPU_KV_BYTES)
    num_blocks = budget // per_block - 1  # less the scratch block
    capped = device.type != "cuda" and budget == MAX_CPU_KV_BYTES  # (more memory would not help)
    if num_blocks < 1:
        raise ConfigError(
            f"kv: no room for two KV blocks (one is scratch) of {per_block} bytes (kv.block_size {block_size} "
            f"tokens) on {device} (budget {budget} bytes{', the most a CPU cache takes' if capped else ''}); "
            f"{'' if capped else 'raise kv.memory_fraction, '}lower kv.block_size (vLLM's is 16) or set kv.num_blocks"
        )
    return num_blocks


def graph_limits(config: Config) -> tuple[int, int]:
    """(sequences, tokens) the step graphs take: no step holds more sequences
    or tokens than the scheduler batches (0 tokens: no mixed-step graphs)."""
    model, scheduler = config.model, config.scheduler
    return (min(model.cuda_graph_max_batch or scheduler.max_num_seqs, scheduler.max_num_seqs),
            min(model.cuda_graph_max_tokens, scheduler.max_num_batched_tokens))


def takes_graphs(config: Config, device: torch.device, *, is_multimodal: bool) -> bool:
    """Whether steps replay CUDA graphs: on CUDA, for text models (media
    rows are spliced on the host), unless ``model.enforce_eager``."""
    return device.type == "cuda" and not config.model.enforce_eager and not is_multimodal


def warm_kernels(runner: ModelRunner, max_num_tokens: int) -> None:
    """Compile every Triton kernel variant a step can launch before the
    first request (each compile takes about a second: mid-serving it would
    stall the whole batch). Variants depend on shapes only, so the set is
    known: attention's split counts, each LoRA stack's tiling per row count."""
    started = time.perf_counter()
    backend = runner.model.attention_backend
    if hasattr(backend, "warm_up"):
        backend.warm_up(runner.model.layout.num_heads, runner.spec.head_dim, runner.kv_caches[0])
    if runner.lora is not None:
        runner.lora.warm_up_kernels(max_num_tokens)
    torch.cuda.synchronize(runner.device)
    log.info("kernels compiled for up to %d tokens a step in %.1f s", max_num_tokens, time.perf_counter() - started)


def capture_graphs(runner: ModelRunner, max_batch: int, max_tokens: int) -> None:
    """Decode graphs of up to ``max_batch`` sequences, and mixed-step graphs
    of up to ``max_tokens`` tokens where attention can capture them."""
    runner.enable_step_graphs(max_batch, max_tokens if captures_mixed(runner) else 0)


def captures_mixed(runner: ModelRunner) -> bool:
    """Whether a step with prefill chunks can be captured: attention must
    read its shape from tensors (``captures_varlen``), and so must a hybrid
    model's DeltaNet layers (the Triton ops' static form; the torch
    reference reads the step on the host)."""
    if runner.spec.is_hybrid and not captures_deltanet(runner):
        log.info("mixed-step graphs off: %s's DeltaNet layers run the torch reference, which reads each step on "
                 "the host; steps with prefill chunks run eagerly (decode steps are graphed)", runner.spec.architecture)
        return False
    return captures_varlen(runner)


def captures_deltanet(runner: ModelRunner) -> bool:
    try:
        from mstar_actors.models.deltanet_triton import TritonDeltaNetOps
    except ImportError:
        return False
    layers = runner.model.model.layers
    return all(isinstance(layers[i].linear_attn.ops, TritonDeltaNetOps) for i in runner.spec.state_layers)


def captures_varlen(runner: ModelRunner) -> bool:
    """Whether attention can run a mixed step inside a CUDA graph: the
    Triton backend's varlen kernel can; the torch reference (no Triton, or
    a head size the kernel does not take) reads the step on the host."""
    try:
        from mstar_actors.models.triton_attention import TritonPagedAttention, is_supported_head_dim
    except ImportError:
        return False
    backend = runner.model.attention_backend
    if isinstance(backend, TritonPagedAttention) and is_supported_head_dim(runner.spec.head_dim):
        return True
    log.info("mixed-step graphs off: attention (%s, head_dim %d) has no capturable varlen kernel; "
             "steps with prefill chunks run eagerly", type(backend).__name__, runner.spec.head_dim)
    return False
