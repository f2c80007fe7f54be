"""Facts about the served model, computed once by the launcher.

``ModelInfo`` is built from the model folder and the validated config before
any actor starts, and travels to every actor in its spec, so no actor parses
``config.json`` or derives the served name again. What only the ranks can
learn (the KV capacity) refines ``max_model_len`` through the conductor's
agreement (``with_kv_capacity``), and the frontend reads the refined copy.
"""

from __future__ import annotations

import msgspec


class ModelInfo(msgspec.Struct, frozen=True):
    """One model's facts; every actor reads these, none re-derives them."""

    served_name: str  # what clients send as ``model``; adapters may not take it
    model_dir: str  # the resolved Hugging Face folder
    architecture: str  # config.json's ``architectures[0]``
    vocab_size: int  # the embedding's rows: the one vocabulary bound
    eos_token_ids: tuple[int, ...]  # tokenizer + config + generation_config, in order
    dtype: str  # the serving dtype after ``model.dtype: auto`` is resolved
    max_model_len: int  # prompt + output tokens; narrowed by the ranks' KV capacity
    is_multimodal: bool = False  # takes image / video parts

    def with_kv_capacity(self, num_kv_tokens: int) -> "ModelInfo":
        """The same facts with ``max_model_len`` narrowed to what the KV cache holds."""
        return msgspec.structs.replace(self, max_model_len=min(self.max_model_len, num_kv_tokens))
