"""OpenAI's ``strict`` tools: under ``tool_choice: "auto"`` a reply is free text, but a call it writes is held
to the format and its tool's schema from the format's opening to its end (the engine's triggered tags); the
template sees every tool as the client sent it."""

from __future__ import annotations

import json

import pytest

from mstar_actors.frontend import openai_api as api
from mstar_actors.frontend import tool_calls as tc
from mstar_actors.messages import StructuredSpec
from tests.tool_calls.templates import TIME

pytest.importorskip("xgrammar")
from mstar_actors.runner.grammar import GrammarError  # noqa: E402
from tests.tool_calls.conftest import accepter  # noqa: E402

STRICT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False, "type": "object"}}}
CALLS = {  # a valid call of each tool, a call breaking get_weather's schema, as each format writes them
    tc.HERMES: ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
                '<tool_call>\n{"name": "get_time", "arguments": {"any": ["thing"]}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'),
    tc.QWEN3_CODER: ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2"
                     "\n</parameter>\n</function>\n</tool_call>",
                     "<tool_call>\n<function=get_time>\n<parameter=any>\nthing\n</parameter>\n</function>\n"
                     "</tool_call>",
                     "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n"
                     "two\n</parameter>\n</function>\n</tool_call>"),
    tc.LLAMA3_JSON: ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
                     '{"name": "get_time", "parameters": {"any": 1}}',
                     '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
}


@pytest.mark.parametrize("parser", [tc.HERMES, tc.QWEN3_CODER])
def test_an_auto_reply_s_calls_of_a_strict_tool_hold_to_its_schema_and_text_stays_free(chars, parser):
    request = tc.parse_tool_request([STRICT_WEATHER, TIME], "auto", parser)
    spec = StructuredSpec(*tc.strict_calls_spec(request))
    assert spec.kind == "tagged_calls"
    accepted = accepter(chars, spec)
    good, other, bad = CALLS[parser]
    assert accepted("Any text at all, {braces} and <tags> too.")
    assert accepted(f"Let me look. {good}") and accepted(good + " " + other)  # a tool not strict: any arguments
    assert not accepted(f"Let me look. {bad}")
    assert [c.name for c in tc.read_calls(request, good)[1]] == ["get_weather"]
    one = tc.parse_tool_request([STRICT_WEATHER, TIME], "auto", parser, parallel_tool_calls=False)
    accepted = accepter(chars, StructuredSpec(*tc.strict_calls_spec(one)))
    assert accepted(good) and not accepted(good + " " + other)  # the reply ends with its one call


def test_llama3_s_bare_calls_of_a_strict_tool_hold_however_they_are_spaced(chars):
    """Llama 3's reader takes a reply that opens with "{" as calls, however spaced or ordered: such a reply is
    held to the calls' schema from its first character (a call held only from an exact opening let a compact or
    reordered call break its schema); any other reply is free text, which the reader keeps as content."""
    request = tc.parse_tool_request([STRICT_WEATHER, TIME], "auto", tc.LLAMA3_JSON)
    accepted = accepter(chars, StructuredSpec(*tc.strict_calls_spec(request)))
    good, other, bad = CALLS[tc.LLAMA3_JSON]
    assert accepted("Any text at all, {braces} and <tags> too.") and accepted("")
    for text in (good, "\n" + good, f"{good}; {other}"):
        assert accepted(text) and tc.read_calls(request, text)[1], text
    for text in (bad, '{"name":"get_weather","parameters":{"city":"Rome","days":3}}',
                 '{"parameters": {"city": "Rome", "days": 3}, "name": "get_weather"}', " {", f"{good} and text"):
        assert not accepted(text), text
    assert accepted(f"Let me look. {bad}") and tc.read_calls(request, f"Let me look. {bad}")[1] == []  # content
    one = tc.parse_tool_request([STRICT_WEATHER, TIME], "auto", tc.LLAMA3_JSON, parallel_tool_calls=False)
    accepted = accepter(chars, StructuredSpec(*tc.strict_calls_spec(one)))
    assert accepted(good) and not accepted(f"{good}; {other}")  # the reply ends with its one call
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    answer = {"kind": "json", "spec": json.dumps(schema), "param": "response_format"}
    accepted = accepter(chars, StructuredSpec(*tc.strict_calls_spec(request, answer)))
    assert accepted('{"x": 1}') and accepted(good) and not accepted("free text") and not accepted(bad)


@pytest.mark.parametrize("opening", ["\x0b", "\x0c", "\x1c", "\xa0", "\u2003", "\u3000", tc.PYTHON_TAG,
                                     f" {tc.PYTHON_TAG}\xa0"])
def test_llama3_s_free_text_is_what_its_reader_keeps_as_text(chars, opening):
    """The reader strips Python's spaces and Llama 3's <|python_tag|> before it looks for a "{": a reply that
    opens with them is calls (held to their schema), and free text opens otherwise."""
    request = tc.parse_tool_request([STRICT_WEATHER, TIME], "auto", tc.LLAMA3_JSON)
    accepted = accepter(chars, StructuredSpec(*tc.strict_calls_spec(request)))
    good, _, bad = CALLS[tc.LLAMA3_JSON]
    assert tc.read_calls(request, opening + bad)[1] and not accepted(opening + bad)
    for text in (opening + "Sure.", opening, "<|python", "<|python_tag|", f"<|python_tag|> hi {bad}", "<b>{",
                 "\xa0Fine {", f"{tc.PYTHON_TAG}<|python_tag|>{bad}", "\u2003"):
        assert accepted(text) and not tc.read_calls(request, text)[1], text


def test_with_response_format_a_reply_is_its_answer_or_text_with_a_strict_call(chars):
    """OpenAI takes both (the Agents SDK sends both): an answer held to response_format's rule, or calls."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    parsed = api.parse_chat(_chat(tools=[STRICT_WEATHER, TIME], response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}), 256, 400, tool_parser=tc.HERMES)
    spec = parsed.sampling.structured
    assert spec.kind == "tagged_calls" and json.loads(spec.spec)["answer"]["kind"] == "json"
    accepted = accepter(chars, spec)
    good, _, bad = CALLS[tc.HERMES]
    assert accepted('{"x": 1}') and accepted(good) and accepted(f"Let me look. {good} done")
    assert not accepted('{"x": "one"}') and not accepted("free text") and not accepted(f"Let me look. {bad}")


def test_no_strict_tool_or_a_forced_choice_takes_no_tagged_calls():
    assert tc.strict_calls_spec(tc.parse_tool_request([TIME], "auto", tc.HERMES)) is None
    assert tc.strict_calls_spec(tc.parse_tool_request([STRICT_WEATHER], "required", tc.HERMES)) is None


def test_a_strict_tool_whose_schema_the_engine_cannot_hold_is_named(chars):
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}
    with pytest.raises(GrammarError, match="multipleOf"):
        chars.check(StructuredSpec(*tc.strict_calls_spec(tc.parse_tool_request([bad], "auto", tc.HERMES))))


def _chat(**kw) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | kw).encode()


def test_the_request_takes_strict_tools_as_sent_and_refuses_what_it_cannot_hold():
    parsed = api.parse_chat(_chat(tools=[STRICT_WEATHER, TIME]), 256, 400, tool_parser=tc.HERMES)
    assert parsed.sampling.structured.kind == "tagged_calls" and parsed.sampling.structured.param == "tools"
    # the template sees each function as sent: its keys in their order, strict among them; without parameters,
    # a schema of none (a template reading parameters.properties finds it)
    assert [t["function"] for t in parsed.tools.tools] == [STRICT_WEATHER["function"], TIME["function"]]
    assert list(parsed.tools.tools[0]["function"]["parameters"])[-1] == "type"
    bare = api.parse_chat(_chat(tools=[{"type": "function", "function": {"name": "ping"}}]), 256, 400,
                          tool_parser=tc.HERMES).tools.tools
    assert bare == [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
                                                                                      "properties": {}}}}]
    with pytest.raises(api.ApiError) as err:
        yes = {"type": "function", "function": {"name": "f", "strict": "yes"}}
        api.parse_chat(_chat(tools=[yes]), 256, 400, tool_parser=tc.HERMES)
    assert err.value.param == "tools[0].function.strict"
