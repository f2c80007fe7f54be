"""Prompt logprobs (completions' echo with logprobs): every prompt token's
logprob given those before it, and its top alternatives, equal
transformers' log-softmax of its logits, through chunked prefill, beside
requests that ask for none, and with no prefix-cache hit to skip positions."""

from __future__ import annotations

import pytest
import torch

from mstar_actors import messages
from mstar_actors.sched import Scheduler

import runner_factories

TOP = 3


def serve(runner, waves: list[dict[str, tuple[list[int], messages.SamplingParams]]]):
    """The scheduler and the runner in one loop, a wave of requests after the
    one before has ended; each request's first sampled token, and the prompt
    tokens the prefix cache held for it."""
    sched = Scheduler(num_blocks=runner.num_kv_blocks, block_size=runner.block_size, max_num_seqs=4,
                      max_num_batched_tokens=12, max_model_len=runner.max_model_len,
                      eos_token_ids=runner.spec.eos_token_ids)
    firsts, cached = {}, {}
    for wave in waves:
        for rid, (prompt, sampling) in wave.items():
            assert not sched.add(messages.Prepared(rid, "m", list(prompt), sampling), "base")
        while sched.has_work():
            plan = sched.schedule()
            for out in sched.update(messages.StepDone(plan.step_id, 0, runner.execute(plan))):
                if isinstance(out, messages.TokenDelta) and out.request_id not in firsts:
                    firsts[out.request_id], cached[out.request_id] = out.tokens[0], out.num_cached_tokens
    return firsts, cached


def expected(hf, prompt: list[int]) -> tuple[list[float], list[list[int]], list[int]]:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    return chosen[:, 0].tolist(), logprobs.topk(TOP, dim=-1).indices.tolist(), ranks.tolist()


@pytest.mark.parametrize("kind, device", [("llama", "cpu"), ("qwen2", "cpu"),
                                          pytest.param("llama", "cuda", marks=pytest.mark.gpu)])
def test_prompt_logprobs_match_transformers_through_chunks(kind, device, hf_models):
    """On CUDA the steps that score prompt positions leave the step graphs for eager runs."""
    folder, hf = hf_models(kind)
    runner = runner_factories.make_runner(folder, dtype="float32", device=device, block_size=4, num_blocks=96, seed=0)
    long = [(7 * i + 3) % 90 + 5 for i in range(30)]
    scored = messages.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    plain = messages.SamplingParams(max_tokens=2, temperature=0.0)
    prompts = {"scored": long, "plain": [11, 12, 13, 14, 15, 16, 17, 18, 19], "again": long, "unscored": long}
    firsts, cached = serve(runner, [{"scored": (long, scored), "plain": (prompts["plain"], plain)},
                                    {"again": (long, scored)}, {"unscored": (long, plain)}])
    assert firsts["plain"].prompt_logprobs == ()
    for rid in ("scored", "again"):
        got = firsts[rid].prompt_logprobs
        logprobs, tops, ranks = expected(hf, prompts[rid])
        assert [p.token_id for p in got] == prompts[rid][1:]  # 30 tokens over chunks of 12
        assert [p.logprob for p in got] == pytest.approx(logprobs, abs=1e-3 if device == "cuda" else 1e-4)
        assert [[t.token_id for t in p.top_logprobs] for p in got] == tops
        assert all(p.top_logprobs[0].logprob >= p.logprob - 1e-5 for p in got)
        if device == "cpu":  # (on CUDA near ties may order apart)
            assert [p.rank for p in got] == ranks and max(ranks) > TOP  # random weights: most far down
    # the same prompt again: its positions' logits are computed, not skipped; without logprobs it is a hit
    assert cached["again"] == 0 and cached["unscored"] == 28
