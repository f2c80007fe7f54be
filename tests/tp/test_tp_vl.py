"""Qwen2.5-VL at tp=2 (gloo, two processes): the text stack sharded, the
vision tower replicated; image and text prompts give tp=1's tokens and logits."""

from __future__ import annotations

import torch
from models.vl_factories import VOCAB, make_hf_vl_model
from tp_ranks import run_ranks
from tp_scenarios import vl_scenario

from mstar_actors.runner.parallel import SINGLE_RANK


def test_vl_image_and_text_prompts_at_tp2_equal_tp1(tmp_path):
    make_hf_vl_model(tmp_path)
    single = vl_scenario(SINGLE_RANK, tmp_path)
    (rank0, _), (rank1, _) = run_ranks(vl_scenario, 2, tmp_path)
    assert rank0["outputs"] == rank1["outputs"] == single["outputs"]
    assert all(len(out) == 16 for out in single["outputs"].values())
    for step, arrays in enumerate(zip(rank0["logits"], rank1["logits"], single["logits"])):
        ours, theirs, want = map(torch.as_tensor, arrays)
        assert torch.equal(ours, theirs) and ours.shape[1] == VOCAB
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    # The tower is whole on each rank, the text stack halved: more than half, well under all.
    assert 0.5 < rank0["num_params"] / single["num_params"] < 0.7
