"""logit_bias, allowed_token_ids, bad_words and min_tokens change the sampled
tokens as specified, per row, in batches that mix rows with and without them."""

import pytest
import torch

from mstar_actors.messages import SamplingParams
from mstar_actors.runner.sampling import SampleRow, sample_tokens

VOCAB = 50
EOS = 7


def rows_of(*params: SamplingParams, outputs=None) -> list[SampleRow]:
    outputs = outputs or [[] for _ in params]
    return [SampleRow(f"r{i}", p, [1, 2, 3], list(o)) for i, (p, o) in enumerate(zip(params, outputs))]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE = "cpu"


@pytest.fixture(autouse=True, params=DEVICES)
def device(request, monkeypatch):
    """Each test on the CPU and, where there is one, the GPU (index ops on the device)."""
    monkeypatch.setitem(globals(), "DEVICE", request.param)
    return request.param


def logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_logit_bias_plus_100_makes_every_draw_that_token_and_leaves_other_rows():
    biased = SamplingParams(temperature=1.0, logit_bias=((11, 100.0),))
    plain = SamplingParams(temperature=0.0)
    for seed in range(20):
        x = logits(2, seed)
        tokens = sample_tokens(x, rows_of(biased, plain))
        assert tokens[0].token_id == 11
        assert tokens[1].token_id == int(x[1].argmax())


def test_logit_bias_minus_100_bans_the_argmax():
    x = logits(1)
    top = int(x[0].argmax())
    (token,) = sample_tokens(x, rows_of(SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))))
    assert token.token_id != top and token.token_id == int(x[0].topk(2).indices[1])


def test_allowed_token_ids_restrict_random_draws():
    allowed = (3, 9, 40)
    params = SamplingParams(temperature=2.0, allowed_token_ids=allowed, seed=5)
    drawn = {sample_tokens(logits(1, s), rows_of(params))[0].token_id for s in range(40)}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_bad_words_ban_a_single_token_and_the_last_token_after_its_prefix():
    x = logits(1)
    top = int(x[0].argmax())
    greedy = SamplingParams(temperature=0.0, bad_words_token_ids=((top,),))
    assert sample_tokens(x, rows_of(greedy))[0].token_id != top
    two = SamplingParams(temperature=0.0, bad_words_token_ids=((20, top),))
    assert sample_tokens(x, rows_of(two, outputs=[[5, 20]]))[0].token_id != top  # "20 top" would complete
    assert sample_tokens(x, rows_of(two, outputs=[[20, 5]]))[0].token_id == top  # the prefix is not there


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(temperature=0.0, logit_bias=((EOS, 100.0), (8, 90.0)), min_tokens=3,
                            min_token_stop_ids=(EOS, 8))
    x = logits(1)
    for num_out in range(3):
        token = sample_tokens(x, rows_of(params, outputs=[[1] * num_out]))[0].token_id
        assert token not in (EOS, 8)
    assert sample_tokens(x, rows_of(params, outputs=[[1] * 3]))[0].token_id == EOS


def test_logprobs_stay_raw_under_processors():
    x = logits(1)
    params = SamplingParams(temperature=0.0, logprobs=0, logit_bias=((11, 100.0),))
    (token,) = sample_tokens(x, rows_of(params))
    assert token.token_id == 11 and token.top_logprobs == ()
    assert abs(token.logprob - float(torch.log_softmax(x[0], -1)[11].cpu())) < 1e-5
