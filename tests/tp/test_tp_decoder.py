"""Tensor parallelism on CPU (gloo, two ranks in two processes): the sharded
decoder gives the unsharded one's greedy tokens and transformers', with
logits within 1e-4, through chunked prefill, a prefix-cache hit and a
preemption; each rank holds about half of the parameters and says so."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from models.factories import make_hf_model
from tp_ranks import run_ranks
from tp_scenarios import NUM_NEW, decode_prompts, decode_scenario

from mstar_actors.models.sharding import tp_refusal
from mstar_actors.models.loader import load_spec
from mstar_actors.runner.parallel import SINGLE_RANK

VOCAB = 512  # factories' tiny models


def hf_generate(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama-bias"])
def world(request, tmp_path_factory):
    """(folder, transformers model, the tp=1 run, the two ranks' runs with their loader lines)."""
    folder = tmp_path_factory.mktemp(f"tp_{request.param}")
    model = make_hf_model(request.param, folder)
    single = decode_scenario(SINGLE_RANK, folder, VOCAB)
    ranks = run_ranks(decode_scenario, 2, folder, VOCAB)
    return folder, model, single, ranks


def test_tp2_tokens_equal_tp1_and_transformers(world):
    _, model, single, ranks = world
    (rank0, _), (rank1, _) = ranks
    assert rank0["outputs"] == rank1["outputs"], "the ranks sampled different tokens"
    assert rank0["outputs"] == single["outputs"]
    for rid, prompt in decode_prompts(VOCAB).items():
        assert len(single["outputs"][rid]) == NUM_NEW
        assert single["outputs"][rid] == hf_generate(model, prompt), f"{rid} diverged from transformers"


def test_tp2_logits_match_tp1_and_agree_across_ranks(world):
    _, _, single, ranks = world
    (rank0, _), (rank1, _) = ranks
    assert len(rank0["logits"]) == len(single["logits"])
    for step, arrays in enumerate(zip(rank0["logits"], rank1["logits"], single["logits"])):
        ours, theirs, want = map(torch.as_tensor, arrays)
        assert torch.equal(ours, theirs), f"step {step}: the ranks' logits differ (they must sample alike)"
        assert ours.shape == want.shape and ours.shape[1] == VOCAB
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_tp2_first_logits_match_transformers(world):
    """The first step samples b and c (a's chunk is not its last): their
    logits are transformers' at each prompt's last position."""
    _, model, _, ranks = world
    prompts = decode_prompts(VOCAB)
    first = torch.as_tensor(ranks[0][0]["logits"][0])
    assert first.shape == (2, VOCAB)
    with torch.no_grad():
        for row, rid in enumerate(("b", "c")):
            want = model(torch.tensor([prompts[rid]])).logits[0, -1]
            torch.testing.assert_close(first[row], want, atol=1e-4, rtol=1e-4, msg=rid)


def test_each_rank_holds_about_half_and_logs_it(world):
    _, _, single, ranks = world
    for rank, (run, lines) in enumerate(ranks):
        share = run["num_params"] / single["num_params"]
        assert 0.45 < share < 0.55, f"rank {rank} holds {share:.2%} of the parameters"
        assert run["num_kv_heads"] == single["num_kv_heads"] // 2  # its KV heads only
        line = next(line for line in lines if line.startswith(f"rank {rank} of 2 holds"))
        held, total = map(float, re.match(r"rank \d of 2 holds ([\d.]+)M of ([\d.]+)M parameters", line).groups())
        assert held == pytest.approx(run["num_params"] / 1e6, rel=1e-3) and held < 0.55 * total


def test_kv_heads_replicate_when_tp_exceeds_them(world):
    """tp=4 over 2 KV heads: each head cached on the two ranks whose query heads read it; same tokens."""
    folder, _, single, _ = world
    _, spec = load_spec(folder)
    if spec.architecture != "LlamaForCausalLM":
        pytest.skip("one architecture is enough: the layout is shared")
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    ranks = run_ranks(decode_scenario, 4, folder, VOCAB)
    for run, _ in ranks:
        assert run["outputs"] == single["outputs"] and run["num_kv_heads"] == 1


def test_tp_that_does_not_split_the_model_is_refused_by_number(tmp_path):
    make_hf_model("llama", tmp_path)
    _, spec = load_spec(tmp_path)
    assert tp_refusal(spec, 1) is None and tp_refusal(spec, 2) is None and tp_refusal(spec, 4) is None
    assert tp_refusal(spec, 3) == ("parallel.tp=3 does not divide LlamaForCausalLM's num_attention_heads=4; "
                                   "parallel.tp values that split it: 1, 2, 4")
    assert "intermediate_size=100" in tp_refusal(dataclasses.replace(spec, intermediate_size=100, num_heads=8), 8)
    assert "vocab_size=510" in tp_refusal(dataclasses.replace(spec, vocab_size=510), 4)
    odd_kv = tp_refusal(dataclasses.replace(spec, num_heads=12, num_kv_heads=3, intermediate_size=120,
                                            vocab_size=516), 2)
    assert "num_key_value_heads=3" in odd_kv and odd_kv.endswith("values that split it: 1, 3, 6, 12")
