"""Native model code on the paged KV cache.

``loader.load_model(folder, dtype, device, tp)`` builds the shared decoder
(``decoder.CausalLM``) for any architecture in ``registry.ARCHITECTURES``,
this tensor-parallel rank's shard of it (``sharding``; all of it on one rank);
``checkpoint.CheckpointRules`` maps HF module names onto ours for the loader
and the LoRA code; ``attention`` holds the paged-attention seam.
"""

from .attention import AttentionMetadata, PagedAttention, allocate_kv_cache
from .checkpoint import CheckpointRules, WeightRule
from .decoder import CausalLM
from .loader import load_model, load_spec
from .registry import ARCHITECTURES, Architecture
from .spec import ModelLoadError, ModelSpec

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "AttentionMetadata",
    "CausalLM",
    "CheckpointRules",
    "ModelLoadError",
    "ModelSpec",
    "PagedAttention",
    "WeightRule",
    "allocate_kv_cache",
    "load_model",
    "load_spec",
]
