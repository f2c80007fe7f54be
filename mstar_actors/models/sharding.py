"""Megatron-style tensor-parallel shards of the decoder: which part each rank holds.

Column-parallel (q/k/v, gate/up, the LM head): a rank holds a run of output
rows; row-parallel (o, down): a run of input columns, and its partial sums
are all-reduced; the embedding holds a run of vocabulary rows (a masked
lookup, then an all-reduce). Attention heads split across ranks; KV heads
too, or, where ``tp`` exceeds their count, each is replicated on the
``tp / num_kv_heads`` ranks whose query heads read it (as vLLM does).

A module's ``tp_slices`` (set as the model is built) say where its weight
sits in the checkpoint tensor: ``{shard: Cut}``, shard None for a module
that fuses nothing. The loader reads only those slices (``safe_open``'s
``get_slice``) and the LoRA install cuts adapters the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .spec import ModelSpec

if TYPE_CHECKING:
    from mstar_actors.runner.parallel import TensorParallel


@dataclass(frozen=True)
class Cut:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``start : start + size`` of a
    checkpoint tensor whose ``dim`` is ``full`` long."""

    dim: int
    start: int
    size: int
    full: int

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.full

    def take(self, tensor):
        """``tensor``'s part (a view, or a safetensors slice read)."""
        part = slice(self.start, self.start + self.size)
        return tensor[part] if self.dim == 0 else tensor[:, part]


def tp_refusal(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split this model, in one line naming the numbers
    and the values that would; None if they can."""
    problem = _tp_problem(spec, tp)
    if problem is None:
        return None
    works = [n for n in range(2, 17) if _tp_problem(spec, n) is None]
    return f"{problem}; parallel.tp values that split it: {', '.join(map(str, [1, *works]))}" if works else problem


def _tp_problem(spec: ModelSpec, tp: int) -> str | None:
    if tp == 1:
        return None
    if spec.is_hybrid:
        return (f"parallel.tp={tp}: {spec.architecture}'s linear-attention layers are not split across ranks yet; "
                "serve it with parallel.tp: 1")
    checks = [("num_attention_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size),
              ("vocab_size", spec.vocab_size)]
    for field, value in checks:
        if value % tp:
            return f"parallel.tp={tp} does not divide {spec.architecture}'s {field}={value}"
    kv = spec.num_kv_heads
    if (kv % tp if kv >= tp else tp % kv):
        return (f"parallel.tp={tp} and {spec.architecture}'s num_key_value_heads={kv}: one must divide the other "
                "(KV heads split across ranks, or each replicated on tp / num_key_value_heads ranks)")
    return None


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a decoder of shape ``spec``, and the group it belongs to."""

    spec: ModelSpec
    tp: TensorParallel

    def __post_init__(self) -> None:
        refusal = tp_refusal(self.spec, self.tp.world_size)
        if refusal is not None:
            raise ValueError(refusal)

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def world_size(self) -> int:
        return self.tp.world_size

    @property
    def num_heads(self) -> int:
        return self.spec.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.spec.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        kv = self.spec.num_kv_heads
        if kv >= self.world_size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.world_size // kv)  # replicated: the KV head of this rank's query heads

    @property
    def intermediate_size(self) -> int:
        return self.spec.intermediate_size // self.world_size

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size // self.world_size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    # -- where each module's part sits in the checkpoint ---------------------

    def qkv_cuts(self) -> dict[int, Cut]:
        d, q = self.spec.head_dim, self.num_heads * self.spec.head_dim
        kv = Cut(0, self.kv_head_start * d, self.num_kv_heads * d, self.spec.kv_size)
        return {0: Cut(0, self.rank * q, q, self.spec.q_size), 1: kv, 2: kv}

    def o_cuts(self) -> dict[None, Cut]:
        q = self.num_heads * self.spec.head_dim
        return {None: Cut(1, self.rank * q, q, self.spec.q_size)}

    def gate_up_cuts(self) -> dict[int, Cut]:
        n = self.intermediate_size
        cut = Cut(0, self.rank * n, n, self.spec.intermediate_size)
        return {0: cut, 1: cut}

    def down_cuts(self) -> dict[None, Cut]:
        n = self.intermediate_size
        return {None: Cut(1, self.rank * n, n, self.spec.intermediate_size)}

    def vocab_cuts(self) -> dict[None, Cut]:
        return {None: Cut(0, self.vocab_start, self.vocab_size, self.spec.vocab_size)}


def single_rank_layout(spec: ModelSpec) -> ShardLayout:
    from mstar_actors.runner.parallel import SINGLE_RANK

    return ShardLayout(spec, SINGLE_RANK)
