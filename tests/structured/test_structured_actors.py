"""Structured outputs through prepare, the conductor and two ranks over
in-memory channels, on the tiny random model: a grammar that ends finishes
the request with "stop"; a bad spec is prepare's 400 naming its field; an
abort frees every rank's grammar state; a preempted constrained request
resumes with its grammar state."""

from __future__ import annotations

import re

import msgspec
from structured_kit import EOS, request_path, token_text, word_id

from mstar_actors.messages import Abort, Failed, Finished, NewRequest, SamplingParams, StructuredSpec

Engine, make_config, async_test = request_path.Engine, request_path.make_config, request_path.async_test
SHORT = r"hello(w1|w2)world"
LONG = r"hello(w1|w2|w3|w4){8,10}world"


def request(rid: str, prompt: list[int], *, max_tokens: int = 20, spec: StructuredSpec | None = None,
            ignore_eos: bool = False) -> NewRequest:
    sampling = SamplingParams(max_tokens=max_tokens, cut_to_context=True, temperature=0.0, ignore_eos=ignore_eos,
                              structured=spec)
    return NewRequest(request_id=rid, model="tiny", sampling=sampling, prompt_token_ids=prompt)


async def serve(model_dir, requests: list[NewRequest], **kv) -> tuple[dict, Engine]:
    engine = Engine(make_config(model_dir, **kv))
    engine.start()
    for req in requests:
        await engine.to_prepare.send(req)
    out = await engine.collect(num_ended=len(requests))
    await engine.await_idle()
    return out, engine


@async_test
async def test_a_grammar_that_ends_finishes_with_stop_beside_free_rows(word_model):
    folder, _ = word_model
    choices = ["w5w6", "w7"]
    out, engine = await serve(folder, [
        request("re", [5, 9, 33], spec=StructuredSpec("regex", SHORT, "structured_outputs.regex")),
        request("choice", [20, 21], spec=StructuredSpec("choice", msgspec.json.encode(choices).decode())),
        request("free", [7, 8, 9], max_tokens=6, ignore_eos=True),
    ])
    assert await engine.stop() == [0] * 4
    for rid, pattern in (("re", SHORT), ("choice", "|".join(choices))):
        end, tokens = out[rid]["end"], out[rid]["tokens"]
        assert isinstance(end, Finished) and end.finish_reason == "stop" and end.stop_token_id == EOS, (rid, end)
        assert tokens[-1] == EOS and re.fullmatch(pattern, token_text(tokens)), (rid, tokens)
    assert out["free"]["end"].finish_reason == "length" and len(out["free"]["tokens"]) == 6
    # held for their grammars' compiles: waiting, but not for an adapter (this server has none)
    assert max(s.num_waiting for s in engine.stats) >= 1
    assert not any(s.num_waiting_for_adapter for s in engine.stats)
    assert max(s.num_waiting_deferred for s in engine.stats) >= 1  # vLLM's "deferred" waiting reason
    assert all(s.num_waiting_deferred <= s.num_waiting for s in engine.stats)


@async_test
async def test_a_bad_spec_is_prepares_400_naming_its_field(word_model):
    folder, _ = word_model
    out, engine = await serve(folder, [
        request("bad", [5, 9], spec=StructuredSpec("regex", "hello(", "structured_outputs.regex")),
        request("ok", [5, 9], max_tokens=3, ignore_eos=True),
    ])
    assert await engine.stop() == [0] * 4
    bad = out["bad"]["end"]
    assert isinstance(bad, Failed) and bad.status == 400 and bad.param == "structured_outputs.regex"
    assert "structured_outputs.regex" in bad.message and "parenthesis" in bad.message and not out["bad"]["tokens"]
    assert out["ok"]["end"].finish_reason == "length"


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", **parameters}}}


@async_test
async def test_a_forced_calls_refusal_names_the_tool_whose_parameters_it_is(word_model):
    """A forced call's schema joins its tools' parameters: a refusal named only
    tool_choice. An unforced tool's schema is only shown to the model: a
    keyword no grammar enforces there refuses nothing (as vLLM)."""
    from mstar_actors.frontend.tool_calls import ToolRequest, forced_call_schema

    folder, _ = word_model
    good = tool("good", {"properties": {"a": {"type": "integer"}}})
    no_value = tool("never", {"properties": {"a": {"anyOf": []}}, "required": ["a"]})
    unenforced = tool("tags", {"properties": {"t": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    forced = StructuredSpec("json", forced_call_schema(ToolRequest([good, no_value], "required", "llama3_json")),
                            "tool_choice")
    out, engine = await serve(folder, [
        msgspec.structs.replace(request("called", [5, 9], spec=forced), tools=[good, no_value]),
        msgspec.structs.replace(request("ok", [5, 9], max_tokens=3, ignore_eos=True), tools=[good, unenforced]),
    ])
    assert await engine.stop() == [0] * 4
    end = out["called"]["end"]
    assert isinstance(end, Failed) and end.status == 400 and end.param == "tools[1].function.parameters", end
    assert end.message.startswith(end.param) and "empty 'anyOf'" in end.message, end.message
    assert out["ok"]["end"].finish_reason == "length"


@async_test
async def test_a_forced_qwen3_coder_calls_refusal_names_its_tool(word_model):
    """The format's own grammar (``xml_calls``): a tool whose schema it cannot hold is named."""
    from mstar_actors.frontend.tool_calls import ToolRequest, forced_calls_spec

    folder, _ = word_model
    good = tool("good", {"properties": {"a": {"type": "integer"}}})
    odd = tool("odd", {"properties": {"a>b": {"type": "integer"}}})
    spec = StructuredSpec(*forced_calls_spec(ToolRequest([good, odd], "required", "qwen3_coder")), "tool_choice")
    out, engine = await serve(folder, [msgspec.structs.replace(request("called", [5, 9], spec=spec), tools=[good, odd]),
                                       request("ok", [5, 9], max_tokens=3, ignore_eos=True)])
    assert await engine.stop() == [0] * 4
    end = out["called"]["end"]
    assert isinstance(end, Failed) and end.status == 400 and end.param == "tools[1].function.parameters", end
    assert "a key with '<', '>'" in end.message, end.message


@async_test
async def test_abort_frees_the_grammar_state_on_every_rank(word_model):
    folder, _ = word_model
    engine = Engine(make_config(folder))
    engine.start()
    aborted = []

    async def abort_after_first_token(delta):
        if delta.request_id == "long" and not aborted:
            aborted.append(True)
            await engine.to_prepare.send(Abort(request_id="long"))

    await engine.to_prepare.send(request("long", [5, 9, 33], max_tokens=100, spec=StructuredSpec("regex", r"(w1|w2|w3){60}")))
    await engine.to_prepare.send(request("short", [7, 8, 9], max_tokens=5, ignore_eos=True))  # carries the forget
    out = await engine.collect(num_ended=2, on_delta=abort_after_first_token)
    assert out["long"]["end"].finish_reason == "abort"
    await engine.await_idle()
    ranks = engine.actors[2:]
    assert all("long" not in w.runner.seqs and len(w.runner.grammars) == 0 for w in ranks)
    assert await engine.stop() == [0] * 4


@async_test
async def test_a_preempted_constrained_request_resumes_with_its_grammar_state(word_model):
    """Four KV blocks of four tokens, two constrained requests of some 15
    tokens each (4 blocks): whichever started later is preempted when the
    other needs its block, and restarts after it ends with the outputs it had.
    Both are constrained, so the preempted one is, whatever order the ranks'
    compiles let them in (``GrammarGate``). On a loaded host the second may
    be admitted only after the first ended (no preemption): up to three tries."""
    folder, _ = word_model
    spec = StructuredSpec("regex", LONG)
    prompts = {"a": [5, 9, 33], "b": [7, 8, 9]}
    alone = {}
    for rid, prompt in prompts.items():
        out, engine = await serve(folder, [request(rid, prompt, spec=spec)])
        assert await engine.stop() == [0] * 4
        alone[rid] = out[rid]["tokens"]
    for _ in range(3):
        out, engine = await serve(folder, [request(rid, prompt, spec=spec) for rid, prompt in prompts.items()],
                                  num_blocks=4)
        assert await engine.stop() == [0] * 4
        for rid in prompts:
            tokens = out[rid]["tokens"]
            assert out[rid]["end"].finish_reason == "stop" and re.fullmatch(LONG, token_text(tokens)), tokens
            assert tokens == alone[rid] and tokens[0] == word_id("hello")
        if max(s.num_preemptions for s in engine.stats) >= 1:
            break
    assert max(s.num_preemptions for s in engine.stats) >= 1