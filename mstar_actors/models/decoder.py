"""The shared decoder-only transformer (Llama, Qwen2, Qwen3) on a paged KV cache.

One implementation, parameterised by ``ModelSpec`` (q/k/v bias, per-head q/k
norm, tied embeddings). The module tree mirrors Hugging Face's names except
for the fused ``qkv_proj`` and ``gate_up_proj`` (see ``checkpoint``).

The forward takes a flat batch of tokens from many sequences plus
``AttentionMetadata``; it returns hidden states for every token, and
``compute_logits`` turns only the rows that get sampled into logits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_ops
from .attention import AttentionMetadata, PagedAttention, TorchPagedAttention
from .cpu_linear import PackArena, PackedWeight, arena_floats, is_packable, packed_linear, packs_blocks
from .cpu_quant import GROUP, QuantizedWeight, quantize
from .rope import RotaryEmbedding
from .sharding import Cut, ShardLayout, single_rank_layout
from .spec import ModelSpec

if TYPE_CHECKING:  # the hooks are made by ``lora_layers``, which builds on these modules
    from .lora_layers import LoraHook, PendingExpand


def fused_ops(x: torch.Tensor):
    """The one-call kernels ``x`` may take: ``cpu_ops`` (C) for CPU float32,
    ``triton_fused`` for CUDA activations, else None (torch's ops). Both
    modules have the same functions, returning None / False where a
    tensor's layout doesn't fit."""
    if cpu_ops.takes(x):
        return cpu_ops
    return cuda_fused_ops(x)


def cuda_fused_ops(x: torch.Tensor):
    """``triton_fused`` where ``x`` takes it (CUDA activations), else None;
    also for the CUDA-only kernels ``cpu_ops`` has no twin of."""
    if x.is_cuda:
        from . import triton_fused  # imported on first CUDA use: a CPU server never loads Triton here

        if triton_fused.takes(x):
            return triton_fused
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; a decode-sized CUDA step's through ``triton_linear`` (where
    cuBLAS leaves most of the device idle), the same call every time for a
    given size, so graphs and eager steps agree."""
    if x.is_cuda:
        kernel = _triton_linear()
        if (y := kernel.linear(x, weight, bias)) is not None:
            return y
    return F.linear(x, weight, bias)


@functools.cache
def _triton_linear():
    from . import triton_linear  # imported on first CUDA use: a CPU server never loads Triton here

    return triton_linear


def add_delta(y: torch.Tensor, delta: torch.Tensor | PendingExpand | None) -> None:
    """``y += delta`` in place, as ``LoraLinear.forward_parts`` left it: a
    tensor, or a fused linear's expand still to do."""
    if isinstance(delta, torch.Tensor):
        y.add_(delta)
    elif delta is not None:
        delta.apply(y)


class RMSNorm(nn.Module):
    zero_centered = False  # True: scales by ``1 + weight`` (Qwen3.5's, ``qwen3_5.ZeroCenteredRMSNorm``)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if self.zero_centered else torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call where it fits (``fused_ops``: equal to the dtype's rounding).
        if (ops := fused_ops(x)) is not None and (y := ops.rms_norm(x, self.weight, self.eps,
                                                                  zero_centered=self.zero_centered)) is not None:
            return y
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch ops, in the reference's order."""
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # The same arithmetic as below in one torch call (the casts are
            # no-ops in float32): equal bit for bit.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and scale after casting back, like the reference.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, x: torch.Tensor, y: torch.Tensor, delta: torch.Tensor | PendingExpand | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + y'), x + y')``, ``y'`` being ``y`` with ``delta`` added
        (``add_delta``: the LoRA delta of the linear that made ``y``, where
        it left one). Through ``fused_ops`` one call, which writes the sum
        into ``y`` in place (``y`` must be the caller's own), adding a fused
        linear's expand as it loads where it takes one."""
        ops = fused_ops(x)
        if delta is not None and not isinstance(delta, torch.Tensor) and ops is not None and ops.takes_expand:
            normed = ops.rms_norm(x, self.weight, self.eps, y, zero_centered=self.zero_centered, expand=delta)
            if normed is not None:
                return normed, y
        add_delta(y, delta)
        if ops is not None and (normed := ops.rms_norm(x, self.weight, self.eps, y,
                                                       zero_centered=self.zero_centered)) is not None:
            return normed, y
        total = x + y
        return self.reference(total), total


class LoraLinear(nn.Linear):
    """A linear layer LoRA can target: ``lora`` is None (base path only)
    unless ``lora_layers.enable_lora`` gave it a hook. On CPU in float32 the
    base matmul runs on a packed copy of the weight (``cpu_linear``), or on
    its quantized codes (``quant``, ``cpu_quant``); the LoRA delta is added
    to it all the same."""

    lora: LoraHook | None = None
    quant: QuantizedWeight | None = None  # set by CausalLM.quantize_cpu_weights (``weight`` is then on meta)
    packed: PackedWeight | None = None  # made on the first CPU float32 call
    # [weight; every adapter slot's LoRA A] where the stack is fused (``lora_layers.fuse_linear``),
    # ``weight`` being its first rows.
    fused_weight: torch.Tensor | None = None
    fused_bias: torch.Tensor | None = None
    fused_views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # ``_fused``'s, a dict of its own when fused
    # Where this rank's weight sits in the checkpoint tensor, per shard
    # (``sharding``); empty: the whole tensor.
    tp_slices: dict[int | None, Cut] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, delta = self.forward_parts(x)
        return y if delta is None else y.add_(delta)

    def forward_parts(self, x: torch.Tensor, residual: torch.Tensor | None = None, fold: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """``(y, delta)``. Where the hook runs the LoRA delta beside the base
        GEMM (``LoraHook.runs_beside``: a CUDA rows step of many rows), the delta runs on
        the side stream while the GEMM runs on the step's, and is returned
        for the caller to add (the next fused op reads it), or added into
        ``residual`` (then None). With ``fold``, where the fused GEMM runs
        (``LoraHook.fuses``), the delta is its expand still to do
        (``lora_layers.PendingExpand``), for the op after the GEMM to add as
        it loads. Elsewhere ``y`` has the delta and it is None."""
        hook = self.lora
        if hook is not None and x.is_cuda and hook.runs_beside(x.shape[0]):
            with hook.fork():
                target = residual if residual is not None else x.new_zeros(*x.shape[:-1], self.out_features)
                hook.apply(target, x)
            y = self._base(x)
            hook.join()
            return y, None if residual is not None else target
        if self.fused_weight is not None and hook.fuses(x.shape[0]):
            # One GEMM: the base output, then the shrink of each slot the step's rows may use; the
            # delta is the expand alone.
            out = linear(x, *self._fused(self.out_features + hook.fused_rows()))
            y, t = out[:, : self.out_features], hook.stack.fused_shrink(out)
            if fold and hook.folds:
                return y, hook.pending(t)
            return hook.expand(y, t), None
        y = self._base(x)
        return (y if hook is None else hook.apply(y, x)), None

    def _fused(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused buffer's first ``rows`` rows and its bias's, as views made once."""
        views = self.fused_views.get(rows)
        if views is None:
            bias = None if self.fused_bias is None else self.fused_bias[:rows]
            views = self.fused_views[rows] = (self.fused_weight[:rows], bias)
        return views

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        # A device-type and dtype test only: nothing data-dependent, no sync.
        if not is_packable(x, self.weight):
            return linear(x, self.weight, self.bias)
        if self.packed is None:
            self.packed = PackedWeight()
        return packed_linear(x, self.weight, self.bias, self.packed)


class LoraEmbedding(nn.Embedding):
    """The token embedding, LoRA-targetable like ``LoraLinear`` (its ``x`` is the token ids).

    Under tensor parallelism it holds the vocabulary rows of its ``layout``:
    ids outside them look up row 0 and are zeroed (base and delta alike),
    and the all-reduce sums the one rank that holds each id."""

    lora: LoraHook | None = None
    tp_slices: dict[int | None, Cut] = {}
    layout: ShardLayout | None = None
    quant: QuantizedWeight | None = None  # a tied head's quantized weight: rows are looked up there

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if layout is None or not layout.tp.is_parallel:
            y = self._lookup(input_ids)
            return y if self.lora is None else self.lora.apply(y, input_ids)
        local = input_ids - layout.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        local = local.masked_fill(outside, 0)
        y = self._lookup(local)
        if self.lora is not None:
            y = self.lora.apply(y, local)
        return layout.tp.all_reduce(y.masked_fill(outside[:, None], 0.0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quant is None else self.quant.rows(ids)


class StackedLinear(LoraLinear):
    """A linear layer fusing several projections along the output dimension."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])


class Attention(nn.Module):
    """This rank's heads (``layout``): q/k/v column-parallel, o row-parallel
    with one all-reduce (which also carries o's LoRA delta)."""

    def __init__(self, spec: ModelSpec, backend: PagedAttention, rotary: RotaryEmbedding | None = None,
                 layout: ShardLayout | None = None):
        super().__init__()
        layout = layout or single_rank_layout(spec)
        self.tp = layout.tp
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, spec.head_dim
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.qkv_proj = StackedLinear(spec.hidden_size, [q_size, kv_size, kv_size], spec.qkv_bias)
        self.qkv_proj.tp_slices = layout.qkv_cuts()
        self.o_proj = LoraLinear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.o_proj.tp_slices = layout.o_cuts()
        # A plain flag: ``hasattr`` on a module raises and catches inside
        # nn.Module.__getattr__ for the missing norm, every layer, every step.
        self.has_qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.rotary = rotary or RotaryEmbedding(spec.rope, spec.head_dim)
        self.backend = backend
        self.scale = spec.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """``(out, delta)``: o's output and its LoRA delta still to add, for
        the norm after it (``RMSNorm.add_norm``), where o left one
        (``LoraLinear.forward_parts`` with ``fold``: none under tensor
        parallelism, where the all-reduce carries it). ``residual``: the
        stream the caller adds the result to next, if its own (o's delta
        may go there instead)."""
        num_tokens = x.shape[0]
        # A fused q|k|v's expand goes into the rotary kernel where that runs (``_rope_write_kv``).
        qkv, delta = self.qkv_proj.forward_parts(x, fold=self._folds(x))
        if delta is not None and self.has_qk_norm:
            qkv, delta = qkv.add_(delta), None
        # The rows as heads, then split: one view and one split, where a split
        # of the columns and three views cost twice as much at decode sizes.
        shape = (num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        heads = qkv.view(shape)
        q, k, v = heads.split_with_sizes([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self._rope_write_kv(positions, q, k, v, kv_cache, meta, delta):
            add_delta(qkv, delta)
            q, k = self.rotary(positions, q, k)
            self.backend.write_kv(kv_cache, k, v, meta)
        out = self.backend.attend(q, kv_cache, meta, self.scale)
        if self.tp.is_parallel:  # a rank's partial delta goes through the all-reduce
            return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1))), None
        return self.o_proj.forward_parts(out.reshape(num_tokens, -1), residual, fold=True)


    def _rope_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata,
                       delta: torch.Tensor | PendingExpand | None = None) -> bool:
        """Rotary on q and k (in place: they are this step's own projections)
        and the KV write in one call (``fused_ops``), where the plain rotary
        and the reference backend's write would run, q, k and v taking
        ``delta`` (``[T, q|k|v]``, the LoRA delta) first where given; False
        (nothing done) elsewhere."""
        # The backend's class, not the instance: a wrapper timing the instance's
        # methods (tools/profile_step.py --split) must not switch this path off.
        if (type(self.rotary) is not RotaryEmbedding or type(self.backend).write_kv is not TorchPagedAttention.write_kv
                or positions.dim() != 1 or (ops := fused_ops(q)) is None or kv_cache.dtype != q.dtype):
            return False
        tables = self.rotary.step_tables or self.rotary.tables(positions, q.dtype)
        return ops.rope_write_kv(q, k, v, *tables, kv_cache, meta.slot_mapping, delta)

    def _folds(self, x: torch.Tensor) -> bool:
        """Whether q|k|v's expand may be left to ``_rope_write_kv``: no q/k
        norm comes between, and the rotary is the fused kernel's (the
        checks of ``_rope_write_kv`` that need no step tensors)."""
        return (not self.has_qk_norm and type(self.rotary) is RotaryEmbedding
                and type(self.backend).write_kv is TorchPagedAttention.write_kv
                and (ops := fused_ops(x)) is not None and ops.takes_expand)


class MLP(nn.Module):
    """This rank's intermediate columns: gate/up column-parallel, down row-parallel with one all-reduce."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout | None = None):
        super().__init__()
        layout = layout or single_rank_layout(spec)
        self.tp = layout.tp
        size = layout.intermediate_size
        self.gate_up_proj = StackedLinear(spec.hidden_size, [size, size], bias=False)
        self.gate_up_proj.tp_slices = layout.gate_up_cuts()
        self.down_proj = LoraLinear(size, spec.hidden_size, bias=False)
        self.down_proj.tp_slices = layout.down_cuts()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """``(out, delta)`` and ``residual``: as ``Attention.forward``'s, of down."""
        # One call where ``fused_ops`` takes it (equal to torch's to float32
        # rounding), adding the LoRA delta first where it ran beside the GEMM,
        # or a fused gate|up's expand.
        ops = fused_ops(x)
        gate_up, delta = self.gate_up_proj.forward_parts(x, fold=ops is not None and ops.takes_expand)
        act = ops.silu_mul(gate_up, delta) if ops is not None else None
        if act is None:
            add_delta(gate_up, delta)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        if self.tp.is_parallel:
            return self.tp.all_reduce(self.down_proj(act)), None
        return self.down_proj.forward_parts(act, residual, fold=True)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: PagedAttention, rotary: RotaryEmbedding | None = None,
                 layout: ShardLayout | None = None):
        super().__init__()
        self.self_attn = Attention(spec, backend, rotary, layout)
        self.mlp = MLP(spec, layout)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, delta: torch.Tensor | PendingExpand | None,
                positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple:
        """``x``: the previous layer's MLP output, not yet added into the
        residual stream ``residual`` (the first layer: the embedded rows,
        ``residual`` None), and its down's LoRA delta still to add
        (``delta``, ``MLP.forward``'s). Returns the same three for the next
        layer (this layer's MLP output, the stream before it, down's delta),
        so that every residual add goes with the norm after it (one call
        where ``fused_ops`` takes them, a fused o's or down's expand too;
        the sums land in the attention's and MLP's own outputs, never in the
        embeddings)."""
        if residual is None:  # the stream is the embedded rows: not ours to add into
            normed, residual, own = self.input_layernorm(x), x, None
        else:
            normed, residual = self.input_layernorm.add_norm(residual, x, delta)
            own = residual
        attn, delta = self.self_attn(normed, positions, kv_cache, meta, residual=own)
        normed, residual = self.post_attention_layernorm.add_norm(residual, attn, delta)
        x, delta = self.mlp(normed, residual=residual)
        return x, residual, delta


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: PagedAttention, layout: ShardLayout | None = None):
        super().__init__()
        layout = layout or single_rank_layout(spec)
        self.embed_tokens = LoraEmbedding(layout.vocab_size, spec.hidden_size)
        self.embed_tokens.tp_slices, self.embed_tokens.layout = layout.vocab_cuts(), layout
        # One rotary for all layers, so a step's angles are computed once (see run_layers).
        rotary = RotaryEmbedding(spec.rope, spec.head_dim)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, rotary, layout) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` -> final hidden states ``[T, hidden]``; ``compute_logits``
    on the rows that are sampled -> ``[R, vocab]`` float32.

    ``spec`` is the whole model's shape; ``layout`` this rank's share of it
    (``sharding``; one rank holds everything). The LM head holds the
    layout's vocabulary rows and ``compute_logits`` gathers every rank's,
    so every rank samples from the same whole-vocabulary logits."""

    lm_head_lora: LoraHook | None = None  # set by lora_layers.enable_lora (the head may be tied)
    lm_head_packed: PackedWeight | None = None  # the head's CPU float32 copy (cpu_linear), made on first use
    lm_head_quant: QuantizedWeight | None = None  # the head's quantized weight (quantize_cpu_weights)

    def __init__(self, spec: ModelSpec, backend: PagedAttention | None = None, layout: ShardLayout | None = None,
                 decoder: nn.Module | None = None):
        """``decoder``: a family's own layer stack (``embed_tokens``, ``layers``,
        ``norm``) in place of the shared one."""
        super().__init__()
        self.spec = spec
        self.layout = layout or single_rank_layout(spec)
        self.model = decoder or DecoderModel(spec, backend or TorchPagedAttention(), self.layout)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, self.layout.vocab_size, bias=False)
            self.lm_head.tp_slices = self.layout.vocab_cuts()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.run_layers(self.model.embed_tokens(input_ids), positions, kv_caches, meta)

    @property
    def attention_backend(self) -> PagedAttention:
        """The paged-attention backend every attention layer shares (the first one's)."""
        return self.model.layers[self.spec.kv_layers[0]].self_attn.backend

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder stack on embedded rows [T, H] (a multimodal model splices first)."""
        # The layers share one rotary unless a model replaced it (M-RoPE
        # computes its own per layer); its tables hold for this call only.
        rotary = self.model.layers[0].self_attn.rotary
        shared = rotary if isinstance(rotary, RotaryEmbedding) else None
        if shared is not None:
            shared.begin_step(positions, x.dtype)
        try:
            residual = delta = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, residual, delta = layer(x, residual, delta, positions, kv_cache, meta)
        finally:
            if shared is not None:
                shared.end_step()
        return self.model.norm.add_norm(residual, x, delta)[0]

    def pack_cpu_weights(self) -> int:
        """Make the packed copies of the CPU fast path (``cpu_linear``) now
        rather than in the first forward, which would take them out of the
        first request's time (about 0.4 s for SmolLM2) and after the KV cache
        was sized. For our kernel all copies go into one ``PackArena`` (huge
        pages where the OS gives them). A no-op off CPU float32 (or without
        a packed path); returns the bytes the copies take. Call after the
        weights are loaded."""
        with torch.no_grad():
            owners = [(m, m.weight) for m in self.modules() if isinstance(m, LoraLinear) and is_packable(m.weight, m.weight)]
            head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
            if is_packable(head, head):
                owners.append((self, head))
            weights = [weight for _, weight in owners]
            arena = PackArena(arena_floats(weights)) if weights and packs_blocks() else None
            for owner, weight in owners:
                if owner is self:
                    self.lm_head_packed = self.lm_head_packed or PackedWeight()
                    self.lm_head_packed.get(weight, arena)
                else:
                    owner.packed = owner.packed or PackedWeight()
                    owner.packed.get(weight, arena)
        return sum(weight.nbytes for weight in weights)

    def quantize_cpu_weights(self, bits: int, head_bits: int = 8,
                             int8_activations: bool = False) -> tuple[int, int, list[str]]:
        """Quantize every ``LoraLinear`` to ``bits`` (8 or 4; with
        ``int8_activations`` the int4 ones take the integer-dot kernel,
        ``int4_a8``) and the LM head
        to ``head_bits`` (``cpu_quant``; GGUF models keep their head at Q8_0
        beside Q4 layers, as it is the most sensitive matrix), then drop
        their float weights (moved to the meta device: nothing on CPU reads
        them, as LoRA adds its delta to the base output). A tied head's
        quantized weight also serves the embedding's lookups. Layers whose
        input size is not a multiple of 32 stay float. Call after loading
        and before ``pack_cpu_weights``; returns (float bytes dropped, bytes
        the quantized weights take, the names of those left float)."""
        dropped = kept = 0
        placed: list[QuantizedWeight] = []
        left_float: list[str] = []
        with torch.no_grad():
            tied = self.spec.tie_word_embeddings
            head = self.model.embed_tokens if tied else self.lm_head
            names = {module: name for name, module in self.named_modules()}
            owners = [m for m in self.modules() if isinstance(m, LoraLinear)]
            for module, num_bits in [(m, bits) for m in owners] + [(head, head_bits)]:
                if module.weight.shape[1] % GROUP:
                    left_float.append(names[module])
                    continue
                quant = quantize(module.weight, num_bits, dot_layout=int8_activations)
                if module is head:
                    self.lm_head_quant = quant
                    if tied:
                        module.quant = quant
                else:
                    module.quant = quant
                dropped += module.weight.nbytes
                kept += quant.nbytes
                placed.append(quant)
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
            if placed:  # all in one huge-page buffer, as pack_cpu_weights does for float32
                arena = PackArena(sum(q.arena_floats() for q in placed))
                for quant in placed:
                    quant.move_into(arena)
        return dropped, kept, left_float

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quant is not None:
            logits = self.lm_head_quant.linear(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
            logits = self._head(hidden, weight)
        if self.lm_head_lora is not None:  # rows of ``hidden`` are the sampled rows, in order
            logits = self.lm_head_lora.apply(logits, hidden)
        return self.layout.tp.all_gather(logits.float())

    def _head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's matmul. On CPU float32 through a packed copy of
        ``weight`` (one more copy of the head in RAM): the vocabulary-wide
        GEMM is the step's largest, and ``F.linear`` repacks it every call."""
        if not is_packable(hidden, weight):
            return linear(hidden, weight)
        if self.lm_head_packed is None:
            self.lm_head_packed = PackedWeight()
        return packed_linear(hidden, weight, None, self.lm_head_packed)
