"""GrammarGate: a constrained request waits until every rank compiled its
grammar; one refusal fails it; an abort ends its choices; late answers are
no-ops."""

from mstar_actors.messages import Failed, Finished, GrammarCompiled, Prepared, SamplingParams, StructuredSpec
from mstar_actors.sched.grammar_gate import GrammarGate


def prepared(rid: str, n: int = 1) -> Prepared:
    spec = StructuredSpec("regex", "a+", "structured_outputs.regex")
    return Prepared(request_id=rid, model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(structured=spec),
                    n=n)


def compiled(rank: int, rid: str, ok: bool = True, error: str = "") -> GrammarCompiled:
    return GrammarCompiled(rank=rank, request_id=rid, ok=ok, error=error)


def test_a_request_goes_on_once_every_rank_compiled_it():
    gate = GrammarGate(num_ranks=2)
    order = gate.hold(prepared("r", n=2))
    assert (order.request_id, order.spec.spec) == ("r", "a+") and gate.num_waiting == 2
    assert gate.on_compiled(compiled(1, "r")) is None and gate.holds("r")
    assert gate.on_compiled(compiled(1, "r")) is None  # a rank's answer counts once
    out = gate.on_compiled(compiled(0, "r"))
    assert isinstance(out, Prepared) and out.request_id == "r" and not gate.holds("r") and gate.num_waiting == 0


def test_one_refusal_fails_the_request_naming_its_field_and_later_answers_do_nothing():
    gate = GrammarGate(num_ranks=2)
    gate.hold(prepared("r"))
    failed = gate.on_compiled(compiled(0, "r", ok=False, error="invalid regex for structured output: bad"))
    assert isinstance(failed, Failed) and (failed.status, failed.param) == (400, "structured_outputs.regex")
    assert failed.message == "structured_outputs.regex: invalid regex for structured output: bad"
    assert gate.on_compiled(compiled(1, "r")) is None and not gate.holds("r")


def test_an_abort_ends_each_choice_and_leaves_nothing_held():
    gate = GrammarGate(num_ranks=1)
    gate.hold(prepared("r", n=2))
    ended = gate.drop("r")
    assert [(f.request_id, f.finish_reason, f.num_prompt_tokens) for f in ended] == [("r-0", "abort", 3),
                                                                                    ("r-1", "abort", 3)]
    assert all(isinstance(f, Finished) for f in ended) and gate.drop("r") == []
    assert gate.on_compiled(compiled(0, "r")) is None  # the rank's answer after the abort


def test_a_rank_with_no_compile_thread_free_fails_the_request_as_busy_not_as_the_clients_fault():
    gate = GrammarGate(num_ranks=2)
    gate.hold(prepared("r"))
    busy = GrammarCompiled(rank=1, request_id="r", ok=False, busy=True, error="every thread busy; retry shortly")
    failed = gate.on_compiled(busy)
    assert isinstance(failed, Failed) and (failed.status, failed.code) == (503, "grammar_compiler_busy")
    assert failed.error_type == "service_unavailable_error" and failed.param is None and not gate.holds("r")
