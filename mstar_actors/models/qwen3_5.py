"""Qwen3.5's text stack: a hybrid of Gated DeltaNet and gated attention layers.

``config.layer_types`` names each layer's token mixer:

- ``linear_attention``: Gated DeltaNet. ``in_proj_qkv`` (q | k | v), a
  short causal depthwise convolution over them (here one ``in_proj`` GEMM
  yields q, k, v and the three projections below), then the gated delta rule
  (decay ``g = -exp(A_log) * softplus(a + dt_bias)``, write strength
  ``beta = sigmoid(b)``: ``deltanet_ops.Gates``) on a per-sequence recurrent state, a gated RMSNorm
  by ``in_proj_z`` and ``out_proj``. Its per-sequence state sits in the
  ranks' state slots (``deltanet_ops.StatePool``), the scheduler's to hand
  out like KV blocks.
- ``full_attention``: attention on the paged KV cache whose ``q_proj``
  also yields a per-head output gate (``[q_h | gate_h]`` per head), with
  per-head q/k RMSNorm and a rotary embedding over the first quarter of
  each head (``partial_rotary_factor``), multimodal (three position axes,
  interleaved sections) for the vision-language model.

Every RMSNorm of the stack but the DeltaNet's gated one scales by
``1 + weight`` (zero-centred weights). The MLP, embedding and LM head are
the shared decoder's, so LoRA, packing and sharding apply as they do there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, PagedAttention, TorchPagedAttention
from .checkpoint import DECODER_RULES, QK_NORM_RULES, WeightRule
from .decoder import MLP, CausalLM, LoraEmbedding, LoraLinear, RMSNorm, StackedLinear, add_delta, cuda_fused_ops
from .deltanet_ops import DeltaNetOps, Gates, StatePool, TorchDeltaNetOps
from .rope import rotate
from .sharding import ShardLayout, single_rank_layout
from .spec import FULL_ATTENTION, ModelLoadError, ModelSpec, default_layer_types

if TYPE_CHECKING:  # made by ``lora_layers``, which builds on these modules
    from .lora_layers import PendingExpand

ARCHITECTURE = "Qwen3_5ForCausalLM"
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")

# -- config and checkpoint ----------------------------------------------------------

LAYOUT_ALIASES = (("model.language_model.", "model."),)
"""The vision-language checkpoint's text stack -> the text model's names."""

IGNORED_PREFIXES = ("mtp.",)
"""The multi-token-prediction head released checkpoints carry: not served."""

_L = "model.layers.{i}"
_D = f"{_L}.linear_attn"
# The DeltaNet's four input projections are one GEMM here (``in_proj``: q | k |
# v | z | b | a), as one LoRA stack: the checkpoint's fused in_proj_qkv fills
# its first three shards.
LINEAR_ATTENTION_RULES = [
    WeightRule(f"{_D}.in_proj_qkv", f"{_D}.in_proj", 0, span=3),
    # Adapters trained on split q / k / v projections land on its shards.
    WeightRule(f"{_D}.in_proj_q", f"{_D}.in_proj", 0, for_adapters=True),
    WeightRule(f"{_D}.in_proj_k", f"{_D}.in_proj", 1, for_adapters=True),
    WeightRule(f"{_D}.in_proj_v", f"{_D}.in_proj", 2, for_adapters=True),
    WeightRule(f"{_D}.in_proj_z", f"{_D}.in_proj", 3),
    WeightRule(f"{_D}.in_proj_b", f"{_D}.in_proj", 4),
    WeightRule(f"{_D}.in_proj_a", f"{_D}.in_proj", 5),
    WeightRule(f"{_D}.out_proj", f"{_D}.out_proj"),
    WeightRule(f"{_D}.conv1d", f"{_D}.conv1d"),
    WeightRule(f"{_D}.norm", f"{_D}.norm"),
    WeightRule(_D, _D),  # A_log, dt_bias
]
QWEN3_5_RULES = DECODER_RULES + QK_NORM_RULES + LINEAR_ATTENTION_RULES


def text_config(cfg: dict) -> dict:
    """The text stack's fields, flat: the vision-language config nests them
    under ``text_config``. The rotary's partial factor and multimodal
    sections are read by ``rotary_facts``; the spec sees plain rotary."""
    flat = {**cfg, **(cfg.get("text_config") or {})}
    rope = dict(flat.get("rope_parameters") or flat.get("rope_scaling") or {})
    flat.pop("rope_scaling", None)
    theta = rope.get("rope_theta", flat.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    flat["rope_parameters"] = {"rope_type": "default" if rope_type in ("mrope", "default") else rope_type,
                               "rope_theta": theta}
    flat["layer_types"] = default_layer_types(flat)
    return flat


def rotary_facts(cfg: dict, head_dim: int, where: str) -> tuple[int, tuple[int, int, int]]:
    """``(rotary_dim, mrope_section)``: the rotated share of each head and how
    its frequency pairs split over the (t, h, w) axes."""
    flat = {**cfg, **(cfg.get("text_config") or {})}
    rope = flat.get("rope_parameters") or flat.get("rope_scaling") or {}
    factor = float(rope.get("partial_rotary_factor", flat.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ModelLoadError(f"{where}: partial_rotary_factor={factor} gives a rotary size of {rotary_dim} for "
                             f"head_dim {head_dim}; accepted: an even size in [2, head_dim]")
    section = tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ModelLoadError(f"{where}: rope mrope_section {list(section)} must be three sizes summing to "
                             f"rotary_dim / 2 = {rotary_dim // 2}")
    return rotary_dim, section


# -- the modules ---------------------------------------------------------------------------


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, in float32, cast after the scale
    (the reference's order); one call through ``fused_ops`` where it fits."""

    zero_centered = True

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output's RMSNorm per head, times ``silu(gate)``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` (the delta rule's output), ``gate [T, H * D]`` (z,
        a view of in_proj's output) -> ``[T, H * D]``: one launch on CUDA
        (``triton_fused.gated_rms_norm``), else the torch ops."""
        ops = cuda_fused_ops(x)
        if ops is not None and (y := ops.gated_rms_norm(x, gate, self.weight, self.eps)) is not None:
            return y
        return self.reference(x.reshape(-1, x.shape[-1]), gate.reshape(-1, x.shape[-1])).view(gate.shape)

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The torch ops over rows of one head, in the reference's order."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


class PartialMRotary(nn.Module):
    """Rotary over the first ``rotary_dim`` of each head. ``positions [T]``
    (text) or ``[3, T]`` (t, h, w): frequency pair ``j`` turns by the
    h position where ``j % 3 == 1`` and ``j < 3 * section[1]``, by w where
    ``j % 3 == 2`` and ``j < 3 * section[2]``, else by t (interleaved
    sections). Its tables are computed once per step (``begin_step``)."""

    def __init__(self, theta: float, rotary_dim: int, section: tuple[int, int, int]):
        super().__init__()
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)  # plain attribute: survives the meta build
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long, device="cpu")
        for dim in (1, 2):
            axis[dim : 3 * section[dim] : 3] = dim
        self.axis = axis
        self.rotary_dim = rotary_dim
        self.step_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` ``[T, 1, rotary_dim]``, the sine's first half
        negated (``rope.rotate``'s form, the fused kernel's)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq, self.axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        if positions.ndim == 1:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        else:  # each pair's own axis: [T, D/2]
            chosen = positions.float().gather(0, self.axis[:, None].expand(-1, positions.shape[1]))
            freqs = chosen.t() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sin = angles.sin().to(dtype)[:, None, :]
        half = self.rotary_dim // 2
        return angles.cos().to(dtype)[:, None, :], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def begin_step(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.step_tables = self.tables(positions, dtype)

    def end_step(self) -> None:
        self.step_tables = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = self.step_tables if self.step_tables is not None else self.tables(positions, q.dtype)
        return self._rotate(q, cos, signed_sin), self._rotate(k, cos, signed_sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rotate(rot, cos, signed_sin), rest), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate: ``q_proj`` holds ``[q_h | gate_h]``
    per head, the output is ``o_proj(attn * sigmoid(gate))``."""

    def __init__(self, spec: ModelSpec, backend: PagedAttention, rotary: PartialMRotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = StackedLinear(spec.hidden_size, [2 * spec.q_size, spec.kv_size, spec.kv_size], spec.qkv_bias)
        self.o_proj = LoraLinear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend
        self.scale = spec.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, residual: torch.Tensor | None = None) -> tuple:
        """``(out, delta)`` and ``residual``: as ``decoder.Attention.forward``'s."""
        num_tokens = x.shape[0]
        # A fused q|gate, k, v's expand goes into the fused kernel where that runs (``_norm_rope_write_kv``).
        qkv, delta = self.qkv_proj.forward_parts(x, fold=self._folds(x))
        if isinstance(delta, torch.Tensor):  # computed beside the GEMM: added now (the kernel takes no q|gate delta)
            qkv, delta = qkv.add_(delta), None
        q_gate, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        normed = self._norm_rope_write_kv(positions, q, k, v, kv_cache, meta, gate, delta)
        if normed is None:
            add_delta(qkv, delta)
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
            self.backend.write_kv(kv_cache, k, v, meta)
        else:
            q = normed
        out = self.backend.attend(q, kv_cache, meta, self.scale).reshape(num_tokens, -1)
        return self.o_proj.forward_parts(out * torch.sigmoid(gate.reshape(num_tokens, -1)), residual, fold=True)

    def _norm_rope_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kv_cache: torch.Tensor, meta: AttentionMetadata, gate: torch.Tensor,
                            expand: PendingExpand | None) -> torch.Tensor | None:
        """q's and k's norms, the rotary and the KV write in one launch
        (``triton_fused.norm_rope_write_kv``, adding ``expand``, q|gate, k and
        v's LoRA expand, the gates' in place) where the step runs the fused
        CUDA ops and the backend writes as the reference does: q's result;
        None (nothing done) elsewhere."""
        ops = cuda_fused_ops(q)
        if ops is None or not self._fuses():
            return None
        rotary = self.rotary
        cos, signed_sin = rotary.step_tables if rotary.step_tables is not None else rotary.tables(positions, q.dtype)
        return ops.norm_rope_write_kv(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos,
                                      signed_sin, kv_cache, meta.slot_mapping, gate, expand)

    def _fuses(self) -> bool:
        """The checks of ``_norm_rope_write_kv`` that need no step tensors."""
        return type(self.backend).write_kv is TorchPagedAttention.write_kv and self.q_norm.eps == self.k_norm.eps

    def _folds(self, x: torch.Tensor) -> bool:
        """Whether q|gate, k, v's expand may be left to ``_norm_rope_write_kv``."""
        return self._fuses() and (ops := cuda_fused_ops(x)) is not None and ops.takes_expand


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; its per-sequence state is ``pool`` (set by the runner)."""

    pool: StatePool | None = None

    def __init__(self, spec: ModelSpec, ops: DeltaNetOps):
        super().__init__()
        la = spec.linear_attention
        self.num_v_heads, self.k_head_dim, self.v_head_dim = la.num_v_heads, la.k_head_dim, la.v_head_dim
        self.sizes = [la.key_dim, la.key_dim, la.value_dim]
        # q | k | v | z | b | a in one GEMM (see LINEAR_ATTENTION_RULES).
        self.in_proj = StackedLinear(spec.hidden_size, self.sizes + [la.value_dim, la.num_v_heads, la.num_v_heads],
                                     bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False,
                                padding=la.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(la.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_v_heads))
        self.norm = GatedRMSNorm(la.v_head_dim, spec.rms_norm_eps)
        self.out_proj = LoraLinear(la.value_dim, spec.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, residual: torch.Tensor | None = None) -> tuple:
        """``(out, delta)`` and ``residual``: as ``decoder.Attention.forward``'s."""
        if self.pool is None or meta.state_slots is None:
            raise RuntimeError("a Gated DeltaNet step needs state slots: the runner attaches the pools "
                               "and each step names its sequences' slots (AttentionMetadata.state_slots)")
        num_tokens = x.shape[0]
        # in_proj's LoRA delta is left to the convolution (``DeltaNetOps.conv``), which adds it where z, b
        # and a below (views of proj) are read after.
        proj, delta = self.in_proj.forward_parts(x, fold=True)
        mixed = self.ops.conv(proj, self.conv1d.weight[:, 0], self.pool, meta, delta)
        z, b, a = proj.split([sum(self.sizes), *self.in_proj.output_sizes[3:]], dim=-1)[1:]
        q, k, v = mixed.split(self.sizes, dim=-1)
        q = q.reshape(num_tokens, -1, self.k_head_dim)
        k = k.reshape(num_tokens, -1, self.k_head_dim)
        v = v.reshape(num_tokens, -1, self.v_head_dim)
        out = self.ops.delta_rule(q, k, v, Gates(a, b, self.A_log, self.dt_bias), self.pool, meta)
        return self.out_proj.forward_parts(self.norm(out, z), residual, fold=True)


class HybridLayer(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str, backend: PagedAttention, ops: DeltaNetOps,
                 rotary: PartialMRotary, layout: ShardLayout):
        super().__init__()
        self.is_attention = kind == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(spec, backend, rotary)
        else:
            self.linear_attn = GatedDeltaNet(spec, ops)
        self.mlp = MLP(spec, layout)
        self.input_layernorm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, delta: torch.Tensor | PendingExpand | None,
                positions: torch.Tensor, kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> tuple:
        """``decoder.DecoderLayer``'s pairing: ``x`` the previous layer's MLP
        output not yet added into ``residual`` (None: ``x`` is the stream),
        ``delta`` its down's LoRA delta still to add; returns the same three."""
        if residual is None:  # the embedded rows: not ours to add into
            h, residual, own = self.input_layernorm(x), x, None
        else:
            h, residual = self.input_layernorm.add_norm(residual, x, delta)
            own = residual
        if self.is_attention:
            h, delta = self.self_attn(h, positions, kv_cache, meta, residual=own)
        else:
            h, delta = self.linear_attn(h, meta, residual=own)
        h, residual = self.post_attention_layernorm.add_norm(residual, h, delta)
        x, delta = self.mlp(h, residual=residual)
        return x, residual, delta


class HybridModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: PagedAttention, ops: DeltaNetOps, rotary: PartialMRotary,
                 layout: ShardLayout):
        super().__init__()
        self.embed_tokens = LoraEmbedding(layout.vocab_size, spec.hidden_size)
        self.embed_tokens.tp_slices, self.embed_tokens.layout = layout.vocab_cuts(), layout
        self.rotary = rotary  # shared by the attention layers: one table per step
        self.layers = nn.ModuleList(HybridLayer(spec, kind, backend, ops, rotary, layout) for kind in spec.layer_types)
        self.norm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen3_5ForCausalLM(CausalLM):
    """The hybrid text model. ``kv_caches`` holds the full-attention layers'
    caches only, in layer order (``spec.kv_layers``); the DeltaNet layers
    read their state from the pools ``attach_state_pools`` gave them."""

    def __init__(self, spec: ModelSpec, backend: PagedAttention | None = None, layout: ShardLayout | None = None,
                 ops: DeltaNetOps | None = None, rotary_dim: int | None = None,
                 section: tuple[int, int, int] = (11, 11, 10)):
        layout = layout or single_rank_layout(spec)  # a layout of more ranks is refused (``tp_refusal``)
        rotary = PartialMRotary(spec.rope.theta, rotary_dim or spec.head_dim // 4, section)
        decoder = HybridModel(spec, backend or TorchPagedAttention(), ops or TorchDeltaNetOps(), rotary, layout)
        super().__init__(spec, backend, layout, decoder=decoder)

    def use_ops(self, ops: DeltaNetOps) -> None:
        """Run every DeltaNet layer's convolution and delta rule on ``ops``."""
        for i in self.spec.state_layers:
            self.model.layers[i].linear_attn.ops = ops

    def attach_state_pools(self, pools: list[StatePool]) -> None:
        """Give each DeltaNet layer its pool (one per ``spec.state_layers``, in order)."""
        layers = [self.model.layers[i].linear_attn for i in self.spec.state_layers]
        if len(pools) != len(layers):
            raise ValueError(f"{len(pools)} state pools for {len(layers)} linear-attention layers")
        for layer, pool in zip(layers, pools):
            layer.pool = pool

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata) -> torch.Tensor:
        caches = iter(kv_caches)
        rotary = self.model.rotary
        rotary.begin_step(positions, x.dtype)
        try:
            residual = delta = None
            for layer in self.model.layers:
                x, residual, delta = layer(x, residual, delta, positions, next(caches) if layer.is_attention else None,
                                           meta)
        finally:
            rotary.end_step()
        return self.model.norm.add_norm(residual, x, delta)[0]


def build(model_dir: Path, cfg: dict, spec: ModelSpec, backend: PagedAttention,
          layout: ShardLayout | None = None) -> Qwen3_5ForCausalLM:
    """The loader's constructor (the rotary facts of the parsed config.json);
    the loader gives the DeltaNet layers their device's ops (``use_ops``)."""
    where = str(Path(model_dir) / "config.json")
    if spec.linear_attention is None:
        raise ModelLoadError(f"{where}: {spec.architecture} needs linear_attention layers in layer_types")
    rotary_dim, section = rotary_facts(cfg, spec.head_dim, where)
    return Qwen3_5ForCausalLM(spec, backend, layout, None, rotary_dim, section)
