"""sample_tokens: greedy, filters, penalties, per-request seeds, logprobs, NaN safety."""

import math

import pytest
import torch

from mstar_actors import messages
from mstar_actors.runner.sampling import (
    MIN_LOGPROB,
    SampleRow,
    apply_min_p,
    apply_top_k_top_p,
    apply_penalties,
    sample_tokens,
)

VOCAB = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_row(request_id="r", prompt=(), output=(), **params) -> SampleRow:
    return SampleRow(request_id, messages.SamplingParams(**params), list(prompt), list(output))


def make_logits(num_rows, vocab=VOCAB, seed=0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def token_ids(sampled):
    return [s.token_id for s in sampled]


def gen(seed=0, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def test_greedy_equals_argmax_any_dtype():
    logits = make_logits(5)
    rows = [make_row(str(i), temperature=0.0) for i in range(5)]
    assert token_ids(sample_tokens(logits, rows)) == logits.argmax(-1).tolist()
    half = logits.to(torch.bfloat16)
    assert token_ids(sample_tokens(half, rows)) == half.float().argmax(-1).tolist()
    assert [s.request_id for s in sample_tokens(logits, rows)] == [str(i) for i in range(5)]


def test_empty_batch_and_shape_mismatch():
    assert sample_tokens(torch.empty(0, VOCAB), []) == []
    with pytest.raises(ValueError, match="num_rows=1"):
        sample_tokens(make_logits(2), [make_row()])


def test_input_logits_not_modified():
    logits = make_logits(2)
    before = logits.clone()
    rows = [make_row("a", output=[1, 2], repetition_penalty=1.5, presence_penalty=1.0, top_k=3),
            make_row("b", temperature=0.0, frequency_penalty=0.5, output=[3])]
    sample_tokens(logits, rows, generator=gen())
    assert torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = make_logits(8, seed=1)
    greedy = logits.argmax(-1).tolist()
    rows_k = [make_row(str(i), temperature=1.5, top_k=1) for i in range(8)]
    rows_p = [make_row(str(i), temperature=1.5, top_p=1e-6) for i in range(8)]
    for seed in range(5):
        assert token_ids(sample_tokens(logits, rows_k, generator=gen(seed))) == greedy
        assert token_ids(sample_tokens(logits, rows_p, generator=gen(seed))) == greedy


def test_min_p_masks_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    apply_min_p(logits, [0.5])  # keep p >= 0.25
    assert torch.isfinite(logits[0, :2]).all() and torch.isinf(logits[0, 2:]).all()
    # Sampling with min_p never draws a masked token.
    rows = [make_row(str(i), min_p=0.5) for i in range(500)]
    drawn = set(token_ids(sample_tokens(probs.log().expand(500, 4), rows, generator=gen())))
    assert drawn == {0, 1}


def test_top_k_and_top_p_keep_the_expected_sets():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(2000, 4)
    rows_k = [make_row(str(i), top_k=2) for i in range(2000)]
    assert set(token_ids(sample_tokens(logits, rows_k, generator=gen()))) == {0, 1}
    # top_p=0.75: 0.4 + 0.3 = 0.7 < 0.75, so the third token is needed too.
    rows_p = [make_row(str(i), top_p=0.75) for i in range(2000)]
    assert set(token_ids(sample_tokens(logits, rows_p, generator=gen()))) == {0, 1, 2}


def reference_kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens a row keeps, from all of them sorted: the top_k most
    likely (0 = off), then the smallest set whose probability reaches top_p."""
    order = logits.argsort(descending=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    probs = torch.softmax(logits[order].double(), dim=0).tolist()
    kept, mass = [], 0.0
    for token, p in zip(order, probs):
        if kept and mass >= top_p:
            break
        kept.append(token)
        mass += p
    return {t for t in kept if logits[t] > float("-inf")} or {order[0]}


@pytest.mark.parametrize("candidates", [8, 256])
@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_keep_what_a_full_sort_keeps(device, candidates, monkeypatch):
    """Batches of rows of 3,000 tokens with top_k and top_p on, off and mixed,
    nuclei inside the CPU's first candidates and past them (flat rows: those
    rows sorted whole), a top_k wider than them, some tokens already -inf:
    the kept sets are a full sort's."""
    from mstar_actors.runner import sampling

    monkeypatch.setattr(sampling, "CPU_CANDIDATES", candidates)
    gen_ = torch.Generator().manual_seed(11)
    vocab = 3000
    batches = [[(0, 0.9), (40, 1.0), (40, 0.5), (0, 1.0), (3, 0.5), (0, 0.99), (5, 0.0), (0, 0.3)],
               [(600, 1.0), (1000, 0.95), (0, 0.9), (0, 0.2)], [(7, 1.0), (0, 1.0), (30, 1.0)]]
    for cases in batches:
        for scale in (4.0, 0.1):  # peaked and flat rows
            logits = torch.randn(len(cases), vocab, generator=gen_) * scale
            logits[2, :50] = float("-inf")
            got = apply_top_k_top_p(logits.clone().to(device), [k for k, _ in cases], [p for _, p in cases]).cpu()
            for row, (k, p) in enumerate(cases):
                want = reference_kept(logits[row], k, p if p < 1.0 else 2.0)
                assert set(torch.isfinite(got[row]).nonzero().flatten().tolist()) == want, (row, k, p, scale)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    row = make_row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0,
                   frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [row])
    expected = [
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2 - 0.5 * 2 - 0.25,  # output twice, negative: multiplied
        0.5 / 2 - 0.5 * 1 - 0.25,  # output once
        3.0,  # never seen
        1.0,
    ]
    assert logits[0].tolist() == pytest.approx(expected)


def test_penalties_touch_only_rows_that_have_them():
    logits = make_logits(3)
    before = logits.clone()
    rows = [make_row("a", output=[1, 2, 3]),
            make_row("b", output=[1], presence_penalty=2.0),
            make_row("c", prompt=[5], output=[7])]
    apply_penalties(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1, 1] == pytest.approx(before[1, 1] - 2.0)
    assert torch.equal(logits[1, 2:], before[1, 2:])


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    row = make_row(output=[0], temperature=0.0, frequency_penalty=2.0)
    assert token_ids(sample_tokens(logits, [row])) == [1]


def _splitmix63(seed: int, n: int) -> int:
    """The seed mix in Python integers: the reference ``derive_seeds`` must equal."""
    mask = (1 << 64) - 1
    x = ((seed & mask) * 0x9E3779B97F4A7C15 + n) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1


def test_derive_seeds_is_derive_seed_row_by_row():
    from mstar_actors.runner.sampling import derive_seed, derive_seeds

    seeds = [0, 1, 7, -3, 2**63 - 1, -(2**63), 2**64 + 5, 123456789]
    counts = [0, 1, 2, 3, 4, 5, 1000, 2**31]
    want = [_splitmix63(s, n) for s, n in zip(seeds, counts)]
    assert derive_seeds(seeds, counts).tolist() == want
    assert [derive_seed(s, n) for s, n in zip(seeds, counts)] == want


def test_race_row_takes_temperature_and_seeds_only():
    """What a decode graph may draw by itself (``race_row``), and what needs torch first."""
    from mstar_actors.runner.sampling import race_row

    def row(**kw):
        return race_row(messages.SamplingParams(**kw))

    assert row(temperature=0.0, top_p=0.5, top_k=3) == (1.0, math.inf, None)  # greedy: filters change nothing
    assert row(temperature=0.5, seed=4) == (2.0, -math.inf, 4)
    for refused in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(logprobs=0), dict(presence_penalty=0.5),
                    dict(repetition_penalty=1.1), dict(logit_bias=((3, 1.0),)), dict(allowed_token_ids=(1, 2)),
                    dict(bad_words_token_ids=((4,),)), dict(min_tokens=2, min_token_stop_ids=(0,)),
                    dict(thinking_budget=8, think_ids=(5, 6))):
        assert row(temperature=1.0, **refused) is None, refused


@pytest.mark.parametrize("device", [*DEVICES, "race"])
def test_seeded_row_independent_of_batch_and_position(device, request):
    device = _on(device, request)
    vocab = 200
    flat = torch.zeros(1, vocab)  # uniform: every draw depends only on the seed

    def draw(seed, num_out, others, position):
        rows = [make_row(f"o{i}", output=[0] * i, seed=(i if i % 2 else None)) for i in range(others)]
        rows.insert(position, make_row("me", output=[3] * num_out, seed=seed))
        logits = torch.cat([make_logits(others, vocab, seed=9), flat]) if others else flat
        # Put the flat row where "me" sits.
        order = list(range(others)) + [others]
        order.insert(position, order.pop())
        out = sample_tokens(logits[order].to(device), rows, generator=gen(others, device))
        return out[position].token_id

    for num_out in range(6):
        alone = draw(1234, num_out, 0, 0)
        assert draw(1234, num_out, 3, 0) == alone
        assert draw(1234, num_out, 3, 3) == alone
        assert draw(1234, num_out, 7, 4) == alone
    # Different steps give different draws (the step is part of the seed).
    assert len({draw(1234, n, 0, 0) for n in range(10)}) > 1


def test_seeded_request_reproduces_after_restart():
    """Decode 8 tokens, then restart from the first 4 outputs: the rest repeat."""
    logits = make_logits(1, seed=3) / 3

    def run(outputs, steps):
        outputs = list(outputs)
        for _ in range(steps):
            row = make_row(prompt=[1, 2], output=outputs, seed=77, presence_penalty=0.3)
            outputs.append(sample_tokens(logits, [row])[0].token_id)
        return outputs

    full = run([], 8)
    assert run(full[:4], 4) == full


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_distribution_matches_softmax(device):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num_draws = 20000
    logits = probs.log().expand(num_draws, 4).to(device)
    rows = [make_row(str(i)) for i in range(num_draws)]
    drawn = token_ids(sample_tokens(logits, rows, generator=gen(5, device)))
    counts = torch.bincount(torch.tensor(drawn), minlength=4)
    assert (counts / num_draws - probs).abs().max() < 0.015


def test_temperature_scales_distribution():
    logits = torch.tensor([0.0, 2.0]).expand(20000, 2)
    rows = [make_row(str(i), temperature=2.0) for i in range(20000)]
    frac_one = sum(token_ids(sample_tokens(logits, rows, generator=gen(6)))) / 20000
    assert frac_one == pytest.approx(torch.softmax(torch.tensor([0.0, 1.0]), 0)[1].item(), abs=0.015)


def test_seeded_distribution_matches_softmax():
    probs = torch.tensor([0.25, 0.75])
    logits = probs.log().expand(4000, 2)
    rows = [make_row(str(i), seed=i) for i in range(4000)]
    frac_one = sum(token_ids(sample_tokens(logits, rows))) / 4000
    assert frac_one == pytest.approx(0.75, abs=0.03)


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    logits = make_logits(3, seed=4)
    rows = [make_row("a", temperature=0.0, logprobs=3, repetition_penalty=3.0, prompt=[0, 1]),
            make_row("b", logprobs=0, top_k=5),
            make_row("c")]
    out = sample_tokens(logits, rows, generator=gen())
    expected = torch.log_softmax(logits, -1)
    for i in (0, 1):
        assert out[i].logprob == pytest.approx(expected[i, out[i].token_id].item(), abs=1e-5)
    tops = out[0].top_logprobs
    assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    assert [t.token_id for t in tops] == expected[0].topk(3).indices.tolist()
    assert [t.logprob for t in tops] == pytest.approx(expected[0].topk(3).values.tolist(), abs=1e-5)
    assert out[1].top_logprobs == ()
    assert out[2].logprob is None and out[2].top_logprobs == ()


def test_processed_logprobs_follow_penalties_and_filters():
    logits = make_logits(1, seed=4)
    row = make_row(logprobs=2, top_k=2, temperature=0.5)
    out = sample_tokens(logits, [row], generator=gen(), logprobs_mode="processed")[0]
    expected = torch.log_softmax(logits[0].topk(2).values / 0.5, -1)
    assert sorted(t.logprob for t in out.top_logprobs) == pytest.approx(sorted(expected.tolist()), abs=1e-5)
    assert math.exp(out.top_logprobs[0].logprob) + math.exp(out.top_logprobs[1].logprob) == pytest.approx(1.0)


@pytest.mark.parametrize("device", [*DEVICES, "race"])
def test_nan_and_inf_logits_give_valid_tokens_and_finite_logprobs(device, request):
    device = _on(device, request)
    logits = torch.zeros(5, VOCAB)
    logits[0, :] = float("nan")
    logits[1, :] = float("-inf")
    logits[2, 7] = float("inf")
    logits[3, 10] = float("nan")
    logits[3, 11] = 50.0
    rows = [make_row(str(i), logprobs=2, temperature=1e-3, top_p=0.5, min_p=0.1) for i in range(4)]
    rows.append(make_row("4", temperature=1e-7))  # below the greedy threshold
    out = sample_tokens(logits.to(device), rows, generator=gen(0, device))
    assert all(0 <= s.token_id < VOCAB for s in out)
    assert out[2].token_id == 7 and out[3].token_id == 11
    for s in out[:4]:
        assert math.isfinite(s.logprob) and s.logprob >= MIN_LOGPROB
        assert all(math.isfinite(t.logprob) for t in s.top_logprobs)


@pytest.mark.parametrize("device", [*DEVICES, "race"])
def test_all_tokens_penalised_to_minus_inf_is_safe(device, request):
    device = _on(device, request)
    logits = torch.full((1, 4), float("-inf"), device=device)
    row = make_row(output=[0, 1], repetition_penalty=2.0, frequency_penalty=1.0, top_k=2, seed=1)
    (s,) = sample_tokens(logits, [row])
    assert 0 <= s.token_id < 4
    # No finite logit at any temperature: the row's argmax (the first token), never a random draw.
    rows = [make_row(str(i), temperature=t, seed=i, top_k=k) for i, (t, k) in enumerate([(0.5, 0), (1.0, 3),
                                                                                          (1.5, 0), (2.0, 1)] * 4)]
    assert token_ids(sample_tokens(torch.full((16, 64), float("-inf"), device=device), rows)) == [0] * 16


def _uniforms(seeds: list[int], vocab: int, device: str) -> torch.Tensor:
    """Philox's uniforms ``tl.rand(seed, token)`` a row, as the race kernel draws them."""
    import triton
    import triton.language as tl

    @triton.jit
    def fill(seed_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + cols, tl.rand(tl.load(seed_ptr + row), cols), mask=cols < vocab)

    out = torch.empty(len(seeds), vocab, device=device)
    fill[(len(seeds),)](torch.tensor(seeds, device=device), out, vocab, BLOCK=triton.next_power_of_2(vocab))
    return out.cpu()


def _on(device: str, request) -> str:
    """A test's device: "race" is the CPU through the CUDA draw's kernel (``race_on_cpu``)."""
    if device == "race":
        request.getfixturevalue("race_on_cpu")
        return "cpu"
    return device


@pytest.mark.parametrize("device", ["race", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_race_kernel_skips_rows_whose_floor_is_nan(device, request):
    """A step graph's padding: a row with floor NaN is not drawn (its ``out``
    keeps what it held, even with NaN logits) and changes no other row's token."""
    from mstar_actors.runner import sampling_triton

    device = _on(device, request)
    logits = make_logits(6, 3000, seed=4).to(device)
    logits[3] = float("nan")
    f32 = dict(dtype=torch.float32, device=device)
    scales = torch.tensor([1.0, 2.0, 1.0, 1.0, 0.5, 1.0], **f32)
    floors = torch.tensor([float("-inf"), float("-inf"), float("inf"), float("-inf"), float("-inf"), float("-inf")], **f32)
    seeds = torch.tensor([5, sampling_triton.UNSEEDED, 6, 7, sampling_triton.UNSEEDED, 8], dtype=torch.int64, device=device)
    base = torch.tensor([123], dtype=torch.int64, device=device)
    want = sampling_triton.race(logits, scales, floors, seeds, base)
    skipped = [1, 3, 5]
    floors[skipped] = float("nan")
    out = torch.full((6,), -7, dtype=torch.int64, device=device)
    got = sampling_triton.race(logits, scales, floors, seeds, base, out=out)
    assert got is out
    for i in range(6):
        assert got[i].item() == (-7 if i in skipped else want[i].item()), i


@pytest.mark.parametrize("device", ["race", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_race_kernel_takes_the_gumbel_argmax_of_the_kept_tokens(device, request):
    """Each random row's token is ``argmax(x / T - log(-log u))`` over its
    top_k (ties at the floor kept), ``u`` Philox's uniforms under the row's
    seed (``derive_seed`` for a seeded row, the step's base seed plus the row
    for the others); greedy rows, and rows with no finite logit, take the
    first of equal maxima; NaN counts as -inf. Rows wider than the kernel's
    block of 2,048 tokens."""
    from mstar_actors.runner import sampling_triton
    from mstar_actors.runner.sampling import derive_seed

    device = _on(device, request)
    vocab = 5000
    logits = make_logits(8, vocab, seed=12)
    logits[0, [10, 4000]] = 30.0  # equal maxima in two blocks
    logits[1, :] = float("-inf")
    logits[2, 100:200] = float("nan")
    logits[4, 3000] = logits[4, 2999] = logits[4].max() + 1  # tied at top_k=2's floor
    logits[7] = torch.linspace(0.0, 0.5, vocab)  # nearly flat: top_k decides the draw
    logits[7, -9:] = float("nan")  # more NaNs than top_k: ranked last, not first
    rows = [make_row("a", temperature=0.0), make_row("b", temperature=0.7), make_row("c", top_k=50, seed=3),
            make_row("d", temperature=1.5), make_row("e", top_k=2, seed=9, output=[1, 2]),
            make_row("f", temperature=0.0, seed=4), make_row("g", top_k=1, temperature=2.0),
            make_row("h", top_k=5, temperature=5.0)]
    shared = gen(21, device)
    base = torch.randint(0, 1 << 62, (1,), generator=gen(21, device), device=device).item()  # sample_tokens' draw
    got = token_ids(sample_tokens(logits.to(device), rows, generator=shared))
    seeds = [base + i if r.params.seed is None else derive_seed(r.params.seed, len(r.output_token_ids))
             for i, r in enumerate(rows)]
    gumbel = -torch.log(-torch.log(_uniforms(seeds, vocab, device)))
    clean = logits.nan_to_num(nan=float("-inf"))
    for i, r in enumerate(rows):
        if r.params.temperature < 1e-5 or not torch.isfinite(clean[i]).any():
            assert got[i] == clean[i].argmax().item(), r.request_id
            continue
        floor = clean[i].topk(r.params.top_k).values[-1] if r.params.top_k else float("-inf")
        score = torch.where(clean[i] >= floor, clean[i] * (1.0 / r.params.temperature) + gumbel[i], float("-inf"))
        assert got[i] == score.argmax().item(), r.request_id
    assert got[0] == 10 and got[1] == 0 and got[4] in (2999, 3000) and got[6] == clean[6].argmax().item()
    assert vocab - 14 <= got[7] < vocab - 9
    assert sampling_triton.BLOCK < vocab


@pytest.mark.parametrize("device", ["race", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_race_kernel_keeps_top_k_of_the_finite_logits(device, request):
    """Seeded draws of a nearly flat row with more NaNs than top_k: every
    token among the k largest finite logits, and several of them drawn."""
    device = _on(device, request)
    logits = torch.linspace(0.0, 0.3, 300)
    logits[[3, 50, 299, 298, 297, 296, 295, 100]] = float("nan")
    rows = [make_row(str(i), top_k=5, temperature=3.0, seed=i) for i in range(40)]
    drawn = set(token_ids(sample_tokens(logits.expand(40, 300).to(device), rows)))
    assert drawn <= {290, 291, 292, 293, 294} and len(drawn) >= 3


def test_race_kernel_draws_follow_the_filtered_softmax(race_on_cpu):
    """Through the kernel, unseeded and seeded: temperature, top_k's floor
    (raw logits) and top_p (the tempered copy the torch filters leave)."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 150
    logits = probs.log().expand(n, 4)
    cases = {"seeded": {"seed": 0}, "top_k 2": {"top_k": 2}, "top_p 0.5, T 0.5": {"top_p": 0.5, "temperature": 0.5}}
    for label, params in cases.items():
        rows = [make_row(str(i), **{k: (i if k == "seed" else v) for k, v in params.items()}) for i in range(n)]
        counts = torch.bincount(torch.tensor(token_ids(sample_tokens(logits, rows, generator=gen(5)))), minlength=4)
        want = torch.softmax(probs.log() / params.get("temperature", 1.0), 0)
        if label == "top_k 2":
            want = torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])
        if label.startswith("top_p"):  # T 0.5: 1/30, 4/30, 9/30, 16/30; the nucleus of 0.5 is token 3 alone
            want = torch.tensor([0.0, 0.0, 0.0, 1.0])
        assert ((counts / n - want).abs() < 0.1).all(), (label, counts)
        assert (counts[want == 0] == 0).all(), label


@pytest.mark.gpu
def test_cuda_matches_cpu_for_greedy_and_penalised_logprobs():
    logits = make_logits(4, seed=8).to(torch.bfloat16)
    rows = [make_row(str(i), temperature=0.0, logprobs=2, prompt=[1, 2], output=[3], repetition_penalty=1.3)
            for i in range(4)]
    on_cpu, on_cuda = sample_tokens(logits, rows), sample_tokens(logits.cuda(), rows)
    assert token_ids(on_cuda) == token_ids(on_cpu)
    assert [s.logprob for s in on_cuda] == pytest.approx([s.logprob for s in on_cpu], abs=1e-4)


def test_bench_sampling_prints_a_row_a_case_with_its_ratio():
    """``tools/bench_sampling.py`` on a small vocabulary: every case timed beside the textbook form."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "tools" / "bench_sampling.py"), "--rows", "2", "--vocab", "500",
                          "--iters", "1", "--threads", "1"], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("   2 ")]
    assert len(lines) == 5 and all(line.endswith("x") for line in lines)


def test_greedy_tokens_are_argmax_first_largest_and_nan_alike():
    """``greedy_tokens`` runs ``max``'s kernel on CPU: the same indices as
    ``argmax`` where logits tie (the first) or hold NaN (taken as largest)."""
    from mstar_actors.runner.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(-3, 3, (6, 1000), generator=gen).to(dtype)  # many ties
        x[1, 17] = x[1, 900] = float("nan")
        x[2] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_its_processors_leave_no_token_is_marked_dead_and_the_others_are_not(temperature):
    """allowed_token_ids [2] with min_tokens' ban of 2: nothing is left. The
    draw is a stand-in; the row says so (the scheduler fails the request)."""
    rows = [make_row("dead", allowed_token_ids=(2,), min_tokens=5, min_token_stop_ids=(2,), temperature=temperature),
            make_row("live", allowed_token_ids=(2, 3), min_tokens=5, min_token_stop_ids=(2,), temperature=temperature),
            make_row("free", temperature=temperature)]
    dead, live, free = sample_tokens(make_logits(3), rows, generator=gen())
    assert dead.dead and not live.dead and not free.dead
    assert live.token_id == 3


def test_a_seeded_draw_survives_a_batchs_last_bit_differences():
    """Logits of a row batched with others differ from its lone logits in their last bits: a seeded row's
    token (the exponential race on every device) changes only between near-equal candidates, rarely (none
    of these 2,000 steps); the inverse of the cumulative distribution, where its uniform fell near a
    boundary the nudge moved, picked a neighbour (7 of them here)."""
    vocab, steps = 4096, 2000
    logits = make_logits(steps, vocab, seed=4)
    nudged = logits + 2e-5 * torch.randn(steps, vocab, generator=torch.Generator().manual_seed(5))
    rows = [make_row(output=[0] * n, seed=1000 + n) for n in range(steps)]
    lone = token_ids(sample_tokens(logits, rows))
    batched = token_ids(sample_tokens(nudged, rows))
    assert sum(a != b for a, b in zip(lone, batched)) <= 1
    # An unseeded row beside seeded ones still draws from the shared generator, as alone.
    mixed, mixed_logits = [make_row("u", output=[0]), *rows[:3]], torch.cat([logits[:1], logits[:3]])
    drawn = token_ids(sample_tokens(mixed_logits, mixed, generator=gen(8)))
    assert drawn[1:] == lone[:3]
    assert drawn[:1] == token_ids(sample_tokens(logits[:1], mixed[:1], generator=gen(8)))


OPEN, CLOSE = 5, 6  # <think>, </think>


def thinking_row(prompt, output=(), budget=2, **params) -> SampleRow:
    return make_row("t", prompt=prompt, output=output, thinking_budget=budget, think_ids=(OPEN, CLOSE), **params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_spent_thinking_budget_allows_only_the_close_whatever_else_the_row_asks(temperature, device):
    """vLLM's thinking_token_budget: the tokens after the prompt's open <think> count (here the "\n" after it),
    then the output's; at the budget </think> is the one token, though allowed_token_ids leave it out, a
    bias sinks it and min_tokens' ban holds; the raw logprobs stay the model's."""
    logits = make_logits(1)
    logits[0, CLOSE] = -20.0  # the model would not close
    logits = logits.to(device)
    params = dict(temperature=temperature, allowed_token_ids=(1, 2, 3), logit_bias=((CLOSE, -100.0),),
                  min_tokens=9, min_token_stop_ids=(CLOSE,), logprobs=1)
    free = thinking_row([1, OPEN, 9], output=[], **params)  # 1 reasoning token of 2
    [token] = sample_tokens(logits, [free], generator=gen(device=device))
    assert token.token_id in (1, 2, 3)
    spent = thinking_row([1, OPEN, 9], output=[3], **params)  # 2 of 2
    [token] = sample_tokens(logits, [spent], generator=gen(device=device))
    assert token.token_id == CLOSE
    assert token.logprob == pytest.approx(torch.log_softmax(logits[0].cpu(), -1)[CLOSE].item(), abs=1e-4)


def test_a_thinking_budget_counts_only_inside_the_reasoning():
    """Closed in the prompt (a template with thinking off) or never opened: nothing counts until the output opens
    <think>; a </think> the model writes ends the count; a second <think> counts anew; budget 0 closes at once."""
    logits = make_logits(1)
    logits[0, CLOSE] = -30.0

    def sampled(prompt, output, budget=2):
        return token_ids(sample_tokens(logits, [thinking_row(prompt, output, budget, temperature=0.0)]))[0]

    greedy = logits.argmax(-1).item()
    assert greedy not in (OPEN, CLOSE)
    assert sampled([OPEN, 9, CLOSE], [1, 2, 3, 4]) == greedy  # closed in its prompt
    assert sampled([7, 8], [1, 2, 3, 4]) == greedy  # never opened
    assert sampled([7, 8], [OPEN, 1]) == greedy  # opened by the output: 1 of 2
    assert sampled([7, 8], [OPEN, 1, 2]) == CLOSE
    assert sampled([OPEN, 1, 2, CLOSE], [1, 2, 3]) == greedy  # the prompt's own reasoning, closed
    assert sampled([OPEN], [1, CLOSE, 2, 3]) == greedy  # the model closed it in time
    assert sampled([OPEN], [1, CLOSE, 2, OPEN, 3]) == greedy  # reopened: 1 of 2
    assert sampled([OPEN], [1, CLOSE, 2, OPEN, 3, 4]) == CLOSE
    assert sampled([1, OPEN], [], budget=0) == CLOSE


def test_a_thinking_budget_follows_outputs_as_they_grow_in_place():
    """A runner keeps one row a sequence, its output list the sequence's own: the count reads each token once."""
    logits = make_logits(1)
    logits[0, CLOSE] = -30.0
    row = thinking_row([OPEN], output=[], budget=3, temperature=0.0)
    picks = []
    for _ in range(6):
        [token] = sample_tokens(logits, [row])
        picks.append(token.token_id)
        row.output_token_ids.append(token.token_id)
    greedy = logits.argmax(-1).item()
    assert picks == [greedy, greedy, greedy, CLOSE, greedy, greedy]
