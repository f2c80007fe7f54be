"""The runner's grammar hooks on a tiny random model: constrained rows follow
their grammar (the random model alone would not), unconstrained rows in the
same steps are untouched, base and adapter rows alike; a restarted sequence
resumes with its grammar state; a forgotten one frees it."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
from structured_kit import EOS, make_adapter, token_text, word_id

from mstar_actors import messages
from mstar_actors.lora import BaseShapes, read_adapter
from mstar_actors.lora.host_copy import adapter_from_bytes, adapter_to_bytes
from mstar_actors.model_info import load_model_info
from mstar_actors.runner.grammar import load_matchers
from mstar_actors.runner.model_runner import PlanError
from plan_driver import PlanDriver
import runner_factories

BLOCK_SIZE = 4
NUM_NEW = 12
REGEX = r"hello(w1|w2|w3|w4){2,4}world"
CHOICES = ["w5w6", "w7", "userassistant"]
FREE = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
PROMPTS = {"re": [5, 9, 33, 41], "free": [7, 8, 9, 10, 11], "re-ad": [40, 41, 42], "free-ad": [100, 101], "choice": [60, 61]}
SLOTS = {"re-ad": 1, "free-ad": 1}


def structured(kind: str, spec: str) -> messages.SamplingParams:
    return msgspec.structs.replace(FREE, structured=messages.StructuredSpec(kind, spec))


SAMPLING = {"re": structured("regex", REGEX), "re-ad": structured("regex", REGEX),
            "choice": structured("choice", msgspec.json.encode(CHOICES).decode())}


@pytest.fixture(scope="module")
def world(word_model, tmp_path_factory):
    """(model folder, adapter weights) for runners with one adapter slot."""
    folder, hf_model = word_model
    adapter_folder = make_adapter(tmp_path_factory.mktemp("adapter"), hf_model)
    shapes = BaseShapes.from_hf_config(hf_model.config.to_dict())
    weights = adapter_from_bytes(adapter_to_bytes(read_adapter(adapter_folder, base=shapes, max_rank=8, name="ad")))
    return folder, weights


def make_runner(world, *, grammars: bool = True, device: str = "cpu"):
    """A runner with the adapter in slot 1 and, unless ``grammars`` is False, the matchers a worker gives it."""
    folder, weights = world
    keys = dict(dtype="float32", device=device, block_size=BLOCK_SIZE, num_blocks=64, seed=0, max_loras=1, max_lora_rank=8)
    runner = runner_factories.make_runner(folder, **keys)
    runner.install_adapter(1, weights)
    if grammars:
        runner.enable_grammars(load_matchers(load_model_info(runner_factories.runner_config(folder, **keys))))
    return runner


def start(driver: PlanDriver, rid: str, outputs=(), *, constrained: bool = True) -> messages.SeqStart:
    seq = driver.start(rid, PROMPTS[rid], outputs=outputs, slot=SLOTS.get(rid, 0))
    return msgspec.structs.replace(seq, sampling=SAMPLING.get(rid, FREE) if constrained else FREE)


def run_all(runner, *, constrained: bool = True, reasoning: bool = False) -> dict[str, list[int]]:
    """Every prompt's greedy output, in one batch; ``reasoning``: the constrained rows think first (``THINK``),
    a logit bias closing their reasoning at once."""
    driver = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
    seqs = [start(driver, rid, constrained=constrained) for rid in PROMPTS]
    if reasoning:
        seqs = [seq if seq.sampling.structured is None else msgspec.structs.replace(seq, sampling=msgspec.structs.replace(
            seq.sampling, logit_bias=((THINK[1], 100.0),), structured=msgspec.structs.replace(
                seq.sampling.structured, reasoning=THINK, opened=True))) for seq in seqs]
    driver.step(seqs, [driver.chunk(rid) for rid in PROMPTS])
    return driver.run_to_end()


def assert_follows(tokens: list[int], pattern: str) -> None:
    """The output up to EOS matches ``pattern`` whole; after it only EOS (a complete grammar allows nothing else)."""
    assert EOS in tokens, tokens
    assert re.fullmatch(pattern, token_text(tokens)), token_text(tokens)
    assert set(tokens[tokens.index(EOS):]) == {EOS}


def test_constrained_free_base_and_adapter_rows_in_one_step(world):
    outputs = run_all(make_runner(world))
    reference = run_all(make_runner(world, grammars=False), constrained=False)
    assert_follows(outputs["re"], REGEX)
    assert_follows(outputs["re-ad"], REGEX)
    assert_follows(outputs["choice"], "|".join(CHOICES))
    for rid in ("free", "free-ad"):  # the masks of the other rows never touch these
        assert outputs[rid] == reference[rid], rid
    for rid in ("re", "re-ad", "choice"):  # the random model alone does not write the grammar
        assert not re.fullmatch(REGEX, token_text(reference[rid])), rid
    assert outputs["re"] != outputs["re-ad"] or reference["re"] != reference["re-ad"]  # the adapter row ran on its slot


@pytest.mark.gpu
def test_constrained_rows_on_cuda_follow_their_grammar_beside_untouched_rows(world):
    """The CUDA path: the pinned bitmask copied to the device, rows that reason first, base and adapter rows."""
    reference = run_all(make_runner(world, grammars=False, device="cuda"), constrained=False)
    for reasoning in (False, True):
        outputs = run_all(make_runner(world, device="cuda"), reasoning=reasoning)
        if reasoning:
            assert all(outputs[rid][0] == THINK[1] for rid in ("re", "re-ad", "choice")), outputs
            outputs = {rid: tokens[1:] if rid in SAMPLING else tokens for rid, tokens in outputs.items()}
        assert_follows(outputs["re"], REGEX)
        assert_follows(outputs["re-ad"], REGEX)
        assert_follows(outputs["choice"], "|".join(CHOICES))
        for rid in ("free", "free-ad"):
            assert outputs[rid] == reference[rid], (reasoning, rid)


def test_restarted_sequence_resumes_with_its_grammar_state(world):
    """A preemption by recompute: the sequence is forgotten, then started again with its outputs."""
    whole = run_all(make_runner(world))["re"]
    runner = make_runner(world)
    driver = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
    driver.step([start(driver, "re")], [driver.chunk("re")])
    for _ in range(2):
        driver.step([], driver.decodes("re"))
    before = list(driver.seqs["re"]["outputs"])
    assert len(before) == 3 and before[0] == word_id("hello")
    driver.step([], [], [driver.finish("re")])
    assert len(runner.grammars) == 0
    restarted = start(driver, "re", outputs=before)
    driver.step([restarted], [driver.chunk("re")])
    assert driver.run_to_end()["re"] == whole
    assert_follows(whole, REGEX)


def test_finished_sequence_frees_its_matcher_and_unknown_ids_are_no_ops(world):
    runner = make_runner(world)
    driver = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
    driver.step([start(driver, "re"), start(driver, "free")], [driver.chunk("re"), driver.chunk("free")])
    assert set(runner.grammars.matchers) == {"re"}  # only constrained rows hold one
    driver.step([], [], [driver.finish("re"), "never-started"])
    assert len(runner.grammars) == 0


def test_a_bad_spec_on_a_rank_fails_its_row_alone(world):
    runner = make_runner(world)
    driver = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
    bad = msgspec.structs.replace(start(driver, "re"), sampling=structured("regex", "hello("))
    with pytest.raises(PlanError) as err:
        runner.start([bad, start(driver, "free")])
    assert err.value.request_ids == ["re"] and "regex" in str(err.value)
    assert "free" in runner.seqs and "re" not in runner.seqs and len(runner.grammars) == 0


def test_a_token_outside_the_grammar_ends_the_row_and_never_passes_unconstrained(world):
    """Possible only when a later filter removed every token the grammar allows."""
    matchers = make_runner(world).grammars
    matchers.start("x", messages.StructuredSpec("regex", REGEX), [])
    matchers.advance([messages.SampledToken("x", word_id("w1"))])
    logits = torch.zeros(1, 512)
    matchers.mask(logits, ["x"])
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [EOS]
    matchers.start("x", messages.StructuredSpec("regex", REGEX), [word_id("hello")])  # a restart begins anew
    assert not matchers.refused


def test_a_grammar_that_allows_nothing_next_reports_its_row(world):
    """Past "hello" the pattern allows no token, nor the end: the row is
    reported dead (its request fails) and given its stop tokens, so the
    draw is defined; rows with a way on are not."""
    from mstar_actors.runner.sampling import PendingSample, with_dead_rows

    matchers = make_runner(world).grammars
    matchers.start("x", messages.StructuredSpec("regex", r"hello[^\s\S]"), [])
    matchers.start("y", messages.StructuredSpec("regex", REGEX), [])
    logits = torch.zeros(3, 512)
    assert matchers.mask(logits, ["x", "free", "y"]) == []
    matchers.advance([messages.SampledToken("x", word_id("hello")), messages.SampledToken("y", word_id("hello"))])
    logits = torch.zeros(3, 512)
    assert matchers.mask(logits, ["x", "free", "y"]) == [0]
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [EOS]
    assert (logits[1] == 0).all() and (logits[2] > float("-inf")).sum() > 1
    draws = with_dead_rows(PendingSample([None] * 3, torch.tensor([EOS, 3, 4])), [0])
    assert [t.dead for t in with_dead_rows([messages.SampledToken(r, 1) for r in "xfy"], [0])] == [True, False, False]
    assert draws.dead_rows == {0}


def test_mask_leaves_unconstrained_rows_bit_identical(world):
    matchers = make_runner(world).grammars
    matchers.start("c", messages.StructuredSpec("choice", '["w7"]'), [])
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    matchers.mask(masked, ["a", "c", "b"])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert (masked[1] > float("-inf")).nonzero().flatten().tolist() == [word_id("w7")]


THINK = (word_id("w8"), word_id("w9"))  # the model's <think>, </think> in these tests


def allowed(matchers, rid: str) -> list[int]:
    logits = torch.zeros(1, 512)
    matchers.mask(logits, [rid])
    return (logits[0] > float("-inf")).nonzero().flatten().tolist()


def test_a_reply_that_reasons_first_is_held_to_its_grammar_after_the_reasoning(world):
    """``StructuredSpec.reasoning``: free until </think>, the grammar from the token after it; a reply whose
    prompt opened no <think> may open one as its first token, else its grammar holds from there."""
    matchers = make_runner(world).grammars
    spec = messages.StructuredSpec("regex", REGEX, reasoning=THINK, opened=True)
    hello, digits = [word_id("hello")], sorted(word_id(f"w{i}") for i in range(1, 5))
    matchers.start("x", spec, [])
    assert len(allowed(matchers, "x")) == 512  # thinking: free
    for token in (word_id("w7"), THINK[0], THINK[1]):  # a <think> inside the reasoning changes nothing
        assert len(allowed(matchers, "x")) == 512
        matchers.advance([messages.SampledToken("x", token)])
    assert allowed(matchers, "x") == hello
    matchers.advance([messages.SampledToken("x", hello[0])])
    assert allowed(matchers, "x") == digits
    matchers.start("x", spec, [word_id("w7"), THINK[1], hello[0]])  # a restart replays to the same state
    assert allowed(matchers, "x") == digits

    unopened = msgspec.structs.replace(spec, opened=False)
    matchers.start("y", unopened, [])
    assert allowed(matchers, "y") == sorted(hello + [THINK[0]])
    matchers.advance([messages.SampledToken("y", THINK[0])])
    assert len(allowed(matchers, "y")) == 512
    matchers.start("z", unopened, hello)  # no <think> first: held from its first token, <think> never again
    assert allowed(matchers, "z") == digits
    matchers.forget("y")
    assert "y" not in matchers.waiting


def test_served_reasoning_runs_as_an_unconstrained_row_then_follows_its_grammar(world):
    """Greedy rows: while it thinks, a constrained row samples what an unconstrained one samples; a </think>
    pushed first by logit_bias (its grammar alone never allows it) starts the grammar on the next token."""
    reference = run_all(make_runner(world, grammars=False), constrained=False)["re"]
    assert THINK[1] not in reference
    spec = messages.StructuredSpec("regex", REGEX, reasoning=THINK, opened=True)
    outputs = {}
    for name, bias in (("free", ()), ("closed", ((THINK[1], 100.0),))):
        driver = PlanDriver(make_runner(world), block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
        sampling = msgspec.structs.replace(FREE, structured=spec, logit_bias=bias)
        driver.step([driver.start("re", PROMPTS["re"], sampling=sampling)], [driver.chunk("re")])
        outputs[name] = driver.run_to_end()["re"]
    assert outputs["free"] == reference
    assert outputs["closed"][0] == THINK[1]
    assert_follows(outputs["closed"][1:], REGEX)


def test_a_thinking_budget_closes_the_reasoning_on_time_then_the_grammar_holds(world):
    """``SamplingParams.thinking_budget`` on a runner, greedy, beside a row without one: the prompt's open
    <think> and its one token after count, the output's next tokens are the free row's until the budget is
    spent, then </think>; a constrained row's grammar holds from the token after it (its own mask never
    allowed the close: the random model would not write it). Its </think> is a word no other holds (the
    matchers read a close spelled in pieces too)."""
    think = (THINK[0], word_id("w99"))
    prompt = PROMPTS["re"] + [think[0], 9]
    budgeted = msgspec.structs.replace(FREE, thinking_budget=4, think_ids=think)
    spec = messages.StructuredSpec("regex", REGEX, reasoning=think, opened=True)
    outputs = {}
    for name, sampling in (("free", FREE), ("budget", budgeted),
                           ("grammar", msgspec.structs.replace(budgeted, structured=spec))):
        driver = PlanDriver(make_runner(world), block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
        seqs = [driver.start("x", prompt, sampling=sampling), driver.start("free", PROMPTS["free"])]
        driver.step(seqs, [driver.chunk("x"), driver.chunk("free")])
        outputs[name] = driver.run_to_end()
    free = outputs["free"]["x"]
    assert think[1] not in free[:4]
    assert outputs["budget"]["x"][:4] == free[:3] + [think[1]]
    assert outputs["grammar"]["x"][:4] == free[:3] + [think[1]]
    assert_follows(outputs["grammar"]["x"][4:], REGEX)
    assert outputs["budget"]["free"] == outputs["grammar"]["free"] == outputs["free"]["free"]


def test_a_grammar_that_read_the_reasoning_end_in_a_word_gets_no_forced_close(world):
    """The matchers read a </think> inside another token's text (here "w9" inside "w97", as a close spelled in
    pieces) as the reasoning's end and hold from there; the budget, counting by the token, would force w9 where
    the grammar refuses it (the request then ended early): a grammar that holds and refuses the close ends the
    count instead."""
    prompt = PROMPTS["re"] + [THINK[0], 9]
    spec = messages.StructuredSpec("regex", REGEX, reasoning=THINK, opened=True)
    sampling = msgspec.structs.replace(FREE, thinking_budget=4, think_ids=THINK, structured=spec)
    driver = PlanDriver(make_runner(world), block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=FREE)
    driver.step([driver.start("x", prompt, sampling=sampling)], [driver.chunk("x")])
    outputs = driver.run_to_end()["x"]
    assert token_text(outputs[:1]) == "w97"  # the greedy free token, in which the matchers read "w9"
    assert_follows(outputs[1:], REGEX)


def test_a_close_spelled_in_pieces_ends_the_reasoning_too():
    """The reply's text reads the reasoning as ended at a "</think>" written in several tokens: the
    grammar holds from there as well (else that answer would go unconstrained)."""
    from mstar_actors.runner.grammar import GrammarCompiler, GrammarMatchers, raw_tokenizer_info

    vocab = ["<eos>", "<think>", "</think>", "</", "think", ">", "x", "{", "}"]
    matchers = GrammarMatchers(GrammarCompiler(raw_tokenizer_info(vocab, [0])), max_rows=1)
    spec = messages.StructuredSpec("regex", r"\{\}", reasoning=(1, 2), opened=True)
    for pieces in (["</", "think", ">"], ["x", "</", "think", ">"], ["</think>"]):
        matchers.start("r", spec, [vocab.index(p) for p in pieces[:-1]])
        logits = torch.zeros(1, len(vocab))
        matchers.mask(logits, ["r"])
        assert bool((logits > float("-inf")).all()), pieces  # still thinking
        matchers.advance([messages.SampledToken("r", vocab.index(pieces[-1]))])
        logits = torch.zeros(1, len(vocab))
        matchers.mask(logits, ["r"])
        assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [vocab.index("{")], pieces
    matchers.start("r", spec, [vocab.index(p) for p in ["</", "x", "think", ">"]])  # not the tag: still thinking
    logits = torch.zeros(1, len(vocab))
    matchers.mask(logits, ["r"])
    assert bool((logits > float("-inf")).all())
