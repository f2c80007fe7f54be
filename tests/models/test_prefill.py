"""Native prefill logits equal transformers' on the same weights."""

import pytest
import torch

from mstar_actors.models import load_model
from mstar_actors.models.attention import AttentionMetadata, allocate_kv_cache

from .factories import CONFIGS


def _one_seq_meta(num_tokens: int, block_size: int, blocks: list[int]) -> AttentionMetadata:
    slots = [blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_lens_list=[num_tokens],
        context_lens_list=[num_tokens],
        num_blocks_list=[len(blocks)],
    )


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_prefill_logits_match_transformers(kind, hf_models):
    folder, hf = hf_models(kind)
    model = load_model(folder, torch.float32, "cpu")
    num_tokens, block_size = 37, 8
    ids = torch.randint(0, hf.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    spec = model.spec
    caches = allocate_kv_cache(spec.num_layers, 12, block_size, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    blocks = [7, 2, 9, 4, 11]  # deliberately out of order: pages, not a contiguous buffer
    with torch.inference_mode():
        hidden = model(ids, torch.arange(num_tokens), caches, _one_seq_meta(num_tokens, block_size, blocks))
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)


def test_tied_model_has_no_lm_head(hf_models):
    folder, _ = hf_models("llama3-tied")
    model = load_model(folder, torch.float32, "cpu")
    assert not hasattr(model, "lm_head")
    assert model.spec.rope.rope_type == "llama3"
