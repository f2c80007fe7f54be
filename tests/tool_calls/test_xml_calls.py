"""The ``qwen3_coder`` tool-call format (Qwen3.5): values read by their schema's type, a reply's calls
streamed and read whole alike, forced calls held to the format by their grammar, history written in it."""

import json
import random

import pytest

from mstar_actors.frontend import tool_calls as tc
from mstar_actors.frontend import xml_calls as xc
from mstar_actors.messages import StructuredSpec
from mstar_actors.runner.grammar import GrammarError
from tests.tool_calls.conftest import accepter

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hot": {"type": "boolean"}, "where": {"type": "object"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("raw,schema,value", [
    ("\nParis\n", {"type": "string"}, "Paris"),
    ("\n 5 \n", {"type": "string"}, " 5 "),  # a string's text is its own, spaces and all
    ("\n5\n", {"type": "integer"}, 5),
    ("\nfive\n", {"type": "integer"}, "five"),  # not its type: the text
    ("\n10000\n", {"type": "number"}, 10000),
    ("\n2.5\n", {"type": "number"}, 2.5),
    ("\nTrue\n", {"type": "boolean"}, True),
    ("\n{\"a\": [1]}\n", {"type": "object"}, {"a": [1]}),
    ("\nnull\n", {"type": "integer"}, None),
    ("\n7\n", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "7"),  # no one type: its text (vLLM's)
    ("\n7\n", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),  # Optional[int]: the integer
    ("\nnull\n", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
    ("\nnull\n", {"type": "string"}, "null"),  # a string that takes no null: its text
    ("\nnull\n", {"type": ["string", "null"]}, None),
    ("\n[1, 2]\n", {"description": "no type"}, "[1, 2]"),  # no type: its text (vLLM's)
    ("\n5.0\n", {"type": "number"}, 5),  # a whole number: an integer (vLLM's)
    ("\n7\n", None, "7"),  # a key the schema does not name: its text (vLLM's)
    ("\n7\n", {"enum": ["7", "8"]}, "7"),
])
def test_a_value_reads_as_its_schema_s_type(raw, schema, value):
    assert xc.read_value(raw, schema) == value


def auto() -> tc.ToolRequest:
    return tc.parse_tool_request([WEATHER, TIME], "auto", tc.QWEN3_CODER)


def streamed(request: tc.ToolRequest, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream = tc.stream_reader(request)
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [d for part in parts for d in stream.feed(part)] + stream.flush()
    content = "".join(d.get("content", "") for d in deltas)
    calls = tc._calls_of([e for d in deltas for e in d.get("tool_calls", [])])
    return content, [(c.name, c.arguments) for c in calls]


CASES = [
    ("Let me check. " + call("get_weather", city="Paris", days="3", hot="false") + "\n",
     "Let me check. ", [("get_weather", '{"city": "Paris", "days": 3, "hot": false}')]),
    (call("get_time") + "\n" + call("get_weather", city="a < b", where='{"x": 1}'),
     None, [("get_time", "{}"), ("get_weather", '{"city": "a < b", "where": {"x": 1}}')]),
    ("no tools here <b>x</b>", "no tools here <b>x</b>", []),
    ("<tool_call>\nnot a call\n</tool_call> after", "<tool_call>\nnot a call\n</tool_call> after", []),
    ("ok " + call("get_weather", city="Rome")[:-len("</function>\n</tool_call>")] + "</fun",  # cut at the end
     "ok ", [("get_weather", '{"city": "Rome"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", None, [("get_weather", '{"city": "Os"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>",  # tags left out
     None, [("get_weather", '{"city": "Oslo", "days": 2}')]),
    ("x <tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool", "x ",
     [("get_weather", '{"unit": "c"}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # hermes JSON: not this format's
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>\n"  # no </function>
     + call("get_time"), None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get_time", "{}"), ("get_weather", '{"city": "A"}')]),  # two in a block
    (call("get_weather", city="A").replace("</function>", "<parameter=city>\nB\n</parameter>\n</function>"),
     None, [("get_weather", '{"city": "A"}')]),  # a key written twice: its first value
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_a_reply_reads_alike_whole_and_streamed_in_any_split(text, content, calls):
    whole_content, whole_calls = tc.read_calls(auto(), text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    for arguments in (c.arguments for c in whole_calls):
        json.loads(arguments)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 15))))
        assert streamed(auto(), text, cuts) == (content or "", calls), cuts


def test_a_streamed_call_sends_its_name_first_then_its_arguments_a_parameter_at_a_time():
    stream = tc.stream_reader(auto())
    assert isinstance(stream, tc.XmlCallStream)
    text = call("get_weather", city="Paris", days="3")
    pieces = [stream.feed(text[:i + 1][-1:]) for i in range(len(text))] + [stream.flush()]
    entries = [e for piece in pieces for d in piece for e in d.get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [e["function"]["arguments"] for e in entries[1:]] == ['{"city": "Paris"', ', "days": 3', "}"]
    limited = tc.parse_tool_request([WEATHER, TIME], "auto", tc.QWEN3_CODER, parallel_tool_calls=False)
    assert streamed(limited, call("get_time") + call("get_weather", city="x"), [])[1] == [("get_time", "{}")]


def test_the_template_s_format_is_chosen_and_history_is_written_in_it():
    template = "{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' }}"
    assert tc.choose_parser(template) == tc.QWEN3_CODER
    assert tc.choose_parser("{{ '<tool_call>\\n' + call | tojson }}") == tc.HERMES
    written = xc.written_calls([("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", {})])
    assert written == call("get_weather", city="Paris", days="3") + "\n" + call("get_time")
    assert [(c.name, c.arguments) for c in tc.read_calls(auto(), written)[1]] == [
        ("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]


def test_forced_calls_are_held_to_the_format_and_their_parameters_types(chars):
    import xgrammar

    request = tc.parse_tool_request([WEATHER, TIME], "required", tc.QWEN3_CODER)
    assert request.assistant_prefix == "<tool_call>\n"
    spec = StructuredSpec(*tc.forced_calls_spec(request))
    assert spec.kind == "xml_calls"
    accepted = accepter(chars, spec)

    weather = call("get_weather", city="Paris", days="3", unit="c").removeprefix("<tool_call>\n")
    weather = weather.removesuffix("\n</tool_call>")
    time = call("get_time").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    sep, end = tc.CALL_SEPARATOR[tc.QWEN3_CODER], tc.CALLS_END[tc.QWEN3_CODER]
    assert accepted(weather) and accepted(time) and accepted(weather + sep + time + end)
    assert not accepted(weather.replace("\n3\n", "\nthree\n"))  # an integer's value
    assert not accepted(weather.replace("\nc\n", "\nk\n"))  # not in its enum
    assert not accepted(time.replace("get_time", "get_date"))  # no such function
    assert not accepted(call("get_weather", days="3").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert not accepted(weather.replace("Paris", "Pa</parameter>ris"))  # a string's text never closes its tag
    tagged = {"a": "x</parameter>"}  # an object's string: its "<" escaped, so the value reads back whole
    with_tag = tc.parse_tool_request([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"o": {"type": "object"}}, "required": ["o"]}}}], "required", tc.QWEN3_CODER)
    tagged_matcher = xgrammar.GrammarMatcher(chars.compile(StructuredSpec(*tc.forced_calls_spec(with_tag))))
    escaped = call("f", o=json.dumps(tagged).replace("<", "\\u003c")).removeprefix("<tool_call>\n")
    assert not tagged_matcher.accept_string(call("f", o=json.dumps(tagged)).removeprefix("<tool_call>\n"))
    tagged_matcher.reset()
    assert tagged_matcher.accept_string(escaped.removesuffix("\n</tool_call>")) and tagged_matcher.accept_token(0)
    assert json.loads(tc.read_calls(with_tag, escaped)[1][0].arguments) == {"o": tagged}
    odd = weather.replace("Paris", "a</b> << <parameter=x>\n")  # any other text: read back as written
    assert accepted(odd)
    assert json.loads(tc.read_calls(request, odd)[1][0].arguments)["city"] == "a</b> << <parameter=x>\n"
    assert [(c.name, c.arguments) for c in tc.read_calls(request, weather + sep + time + end)[1]] == [
        ("get_weather", '{"city": "Paris", "days": 3, "unit": "c"}'), ("get_time", "{}")]
    named = tc.parse_tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                                  tc.QWEN3_CODER)
    assert json.loads(tc.forced_calls_spec(named)[1])["repeat"] is False
    assert tc.read_calls(named, "")[1][0].name == "get_time"  # cut before anything: the named call
    assert tc.read_calls(named, "")[0] is None


@pytest.mark.parametrize("fmt,good,bad", [
    ("date-time", "2026-12-06T05:47:30Z", "2026-12-06 05:47"),
    ("date", "2026-12-06", "06/12/2026"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    ("email", "a.b+c@example.com", '"a b"@example.com'),  # the dot-atom form: its text as the reader reads it
    ("uri", "https://example.com/a?b=c#d", "not a uri"),
    ("ipv4", "10.0.0.1", "010.0.0.1"),
    ("hostname", "example.com", "exa mple.com"),
])
def test_a_string_s_format_is_held_in_forced_calls(chars, fmt, good, bad):
    request, matcher = _forced(chars, {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
                                       "required": ["v"]})
    assert _held(request, matcher, v=good) == {"v": good} and _held(request, matcher, v=bad) is None


@pytest.mark.parametrize("parameters,reason", [
    ({"type": "object", "properties": {"p": {"type": "string", "format": "json-pointer"}}},
     "format 'json-pointer' is not enforced"),
    ({"type": "object", "properties": {"p": {"type": "string", "format": "iri"}}}, "format 'iri', which is not"),
    ({"type": "object", "properties": {"a>b": {"type": "integer"}}}, "a key with '<', '>'"),
    ({"type": "object", "properties": {" x": {"type": "integer"}}}, "space at its ends"),
    ({"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}}, "no one type"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}, "minProperties is not"),
])
def test_a_parameter_the_format_cannot_hold_to_its_schema_is_refused(chars, parameters, reason):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    request = tc.parse_tool_request([tool], "required", tc.QWEN3_CODER)
    with pytest.raises(GrammarError, match=reason):
        chars.check(StructuredSpec(*tc.forced_calls_spec(request)))


def test_a_forced_call_of_any_object_takes_any_keys_and_optional_types(chars):
    import xgrammar

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
                 "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["n"]}}}]
    request = tc.parse_tool_request(tools, "required", tc.QWEN3_CODER, parallel_tool_calls=False)
    matcher = xgrammar.GrammarMatcher(chars.compile(StructuredSpec(*tc.forced_calls_spec(request))))
    for text, arguments in ((call("f", a="x", b_2="7"), '{"a": "x", "b_2": "7"}'), (call("f"), "{}"),
                            (call("g", n="5"), '{"n": 5}'), (call("g", n="null"), '{"n": null}')):
        body = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
        matcher.reset()
        assert matcher.accept_string(body) and matcher.accept_token(0), body
        assert tc.read_calls(request, body)[1][0].arguments == arguments
    matcher.reset()
    assert not matcher.accept_string(call("g", n="five").removeprefix("<tool_call>\n"))


@pytest.mark.parametrize("parameters", [None, {"type": "object", "properties": {}},
                                        {"type": "object", "additionalProperties": False}])
def test_a_forced_call_of_a_function_of_no_parameters_writes_none(chars, parameters):
    """As the JSON formats' grammar holds it to ``{}``: a random model
    forced to call such a function wrote invented keys until max_tokens."""
    tool = {"type": "function", "function": {"name": "f"} | ({"parameters": parameters} if parameters else {})}
    request = tc.parse_tool_request([tool], "required", tc.QWEN3_CODER)
    accepted = accepter(chars, StructuredSpec(*tc.forced_calls_spec(request)))
    assert accepted(call("f").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert not accepted(call("f", a="x").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))


def _forced(chars, parameters: dict):
    """(request, matcher) of a forced call of tool ``f`` with ``parameters``."""
    import xgrammar

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    request = tc.parse_tool_request([tool], "required", tc.QWEN3_CODER)
    return request, xgrammar.GrammarMatcher(chars.compile(StructuredSpec(*tc.forced_calls_spec(request))))


def _held(request, matcher, **values: str):
    """The arguments read back from the forced call of ``values``, None where the grammar refuses it."""
    text = call("f", **values).removeprefix("<tool_call>\n")
    matcher.reset()
    if not (matcher.accept_string(text.removesuffix("\n</tool_call>")) and matcher.accept_token(0)):
        return None
    return json.loads(tc.read_calls(request, text)[1][0].arguments)


OPTIONAL_SHORT = {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]}
OPTIONAL_CHOICE = {"anyOf": [{"enum": ["c", "f"], "type": "string"}, {"type": "null"}]}  # Optional[Literal]
PLACE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema,good,bad", [
    (OPTIONAL_SHORT, [("ab", "ab"), ("null", None)], ["abc"]),
    (OPTIONAL_CHOICE, [("c", "c"), ("null", None)], ["k"]),
    ({"anyOf": [{"const": "a"}, {"type": "null"}]}, [("a", "a"), ("null", None)], ["b"]),
    ({"type": ["string", "null"], "enum": ["a", "b", None]}, [("b", "b"), ("null", None)], ["x"]),
    ({"anyOf": [{"type": "string", "pattern": "^[0-9]+$"}, {"type": "null"}]}, [("12", "12")], ["1a"]),
    ({"$ref": "#/$defs/Place"}, [('{"a": 1}', {"a": 1})], ['{"a": "x"}', "text"]),
    ({"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}, [('{"a": 2}', {"a": 2}), ("null", None)], ["{}"]),
])
def test_a_parameter_s_branches_and_references_are_held_and_read_as_written(chars, schema, good, bad):
    """pydantic's optionals, literals and nested models: the branch's own constraints hold, null reads as None."""
    request, matcher = _forced(chars, {"type": "object", "properties": {"v": schema}, "required": ["v"],
                                       "$defs": {"Place": PLACE}})
    for written, value in good:
        assert _held(request, matcher, v=written) == {"v": value}, written
    for written in bad:
        assert _held(request, matcher, v=written) is None, written


def test_a_number_past_a_float_s_range_never_makes_arguments_that_are_not_json():
    """``json.loads`` reads 1e999 as inf, which ``json.dumps`` writes as Infinity: it stays the text written."""
    number = {"type": "object", "properties": {"x": {"type": "number"}, "o": {"type": "object"},
                                                "n": {"type": "integer"}}}
    request = tc.parse_tool_request([{"type": "function", "function": {"name": "f", "parameters": number}}],
                                    "auto", tc.QWEN3_CODER)
    reply = call("f", x="841.5E1589988444", o='{"y": 24e91038294294, "z": NaN}', n="9" * 5000)
    arguments = tc.read_calls(request, reply)[1][0].arguments
    strict = json.loads(arguments, parse_constant=lambda c: pytest.fail(f"{c} in {arguments[:80]}"))
    assert strict == {"x": "841.5E1589988444", "o": '{"y": 24e91038294294, "z": NaN}', "n": "9" * 5000}


@pytest.mark.parametrize("parameters,reason", [
    ({"type": "object", "properties": [1, 2]}, "properties must be an object"),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "required": "city"}, "required must be an array"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}},
     "minLength 5 is greater than maxLength 2"),
])
def test_a_malformed_parameters_schema_gets_the_engine_s_reason(chars, parameters, reason):
    with pytest.raises(GrammarError, match=reason):
        _forced(chars, parameters)


def test_schemas_that_reach_far_or_nowhere_are_read_in_linear_time_and_never_fail():
    """A self-referencing anyOf (each branch followed once, not again and again), a $defs that is no object."""
    import time

    wide = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
            "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}] * 12}}}
    broken = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": ["A"]}
    for parameters in (wide, broken):
        request = tc.parse_tool_request([{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                                        "auto", tc.QWEN3_CODER)
        started = time.perf_counter()
        assert json.loads(tc.read_calls(request, call("f", x="1"))[1][0].arguments) == {"x": "1"}
        assert time.perf_counter() - started < 5  # (exponential: minutes)


def test_choices_and_bounded_strings_inside_a_json_value_keep_their_rules(chars):
    """An enum limits null away whatever its type allows; a length-bounded string writes "<" as its escape; a
    choice that writes the closing tag is refused; texts of several branches (a format's, a literal's) are text."""
    request, matcher = _forced(chars, {"type": "object", "properties": {
        "v": {"type": ["string", "null"], "enum": ["a", "b"]},
        "w": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 5}}, "required": ["name"]}},
        "d": {"anyOf": [{"type": "string", "format": "date"}, {"const": "today", "type": "string"}]}},
        "required": ["v", "w", "d"]})
    assert _held(request, matcher, v="null", w='[{"name": "x"}]', d="today") is None
    assert _held(request, matcher, v="a", w='[{"name": "a<b"}]', d="today") is None
    held = _held(request, matcher, v="a", w='[{"name": "a\\u003cb"}]', d="2026-12-06")
    assert held == {"v": "a", "w": [{"name": "a<b"}], "d": "2026-12-06"}
    with pytest.raises(GrammarError, match="an enum or const value holds </parameter>"):
        _forced(chars, {"type": "object", "properties": {"o": {"type": "object", "properties": {
            "s": {"enum": ["a</parameter>b", "c"]}}}}})


ANY_BUT_AT = {"type": "string", "pattern": "^[^@]+$"}


@pytest.mark.parametrize("schema,good,bad", [
    (ANY_BUT_AT, [("a b", "a b")], ["x</parameter>y", "a<b", "a@b"]),
    ({"type": "object", "properties": {"s": ANY_BUT_AT}, "required": ["s"]},
     [('{"s": "ab"}', {"s": "ab"})], ['{"s": "x</parameter>"}', '{"s": "a<b"}', '{"s": "a@b"}']),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[ -~]+q$"}}, "required": ["s"]},
     [('{"s": "a(b)q"}', {"s": "a(b)q"})], ['{"s": "x</parameter>q"}', '{"s": "x\\"q"}']),  # (the engine's own call)
    ({"type": "object", "properties": {"p": {"type": "string", "format": "json-pointer"}}, "required": ["p"]},
     [('{"p": "/a/b"}', {"p": "/a/b"})], ['{"p": "/x</parameter>"}']),
])
def test_a_pattern_or_format_never_writes_the_closing_tag(chars, schema, good, bad):
    """The reader ends a value at its first ``</parameter>``: where a pattern or format would let a value write
    one (its own text, or a string inside a JSON value), it writes no "<" (a value read cut short before)."""
    request, matcher = _forced(chars, {"type": "object", "properties": {"v": schema}, "required": ["v"]})
    for written, value in good:
        assert _held(request, matcher, v=written) == {"v": value}, written
    for written in bad:
        assert _held(request, matcher, v=written) is None, written


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^<[a-z]+>$"},
    {"type": "string", "pattern": "[<]"},
    {"type": "array", "items": {"type": "string", "pattern": "<.*"}},  # inside a JSON value
])
def test_a_pattern_with_a_closing_tag_s_first_character_of_its_own_is_refused(chars, schema):
    with pytest.raises(GrammarError, match=r"properties\['v'\]: a pattern in its schema has a '<' of its own"):
        _forced(chars, {"type": "object", "properties": {"v": schema}, "required": ["v"]})


NODE = {"$defs": {"Node": {"type": "object", "properties": {
    "label": {"type": "string"}, "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
    "required": ["label"]}}, "$ref": "#/$defs/Node"}  # pydantic's schema of a recursive model


@pytest.mark.parametrize("parser", [tc.HERMES, tc.QWEN3_CODER])
def test_parameters_that_are_a_ref_to_their_own_definition_are_that_definition(chars, parser):
    """A tool whose parameters are a ``$ref`` into their ``$defs`` is forced to the definition, read back typed by it
    (it was refused, naming a 'type' beside '$ref' the client never sent); a reference that leads nowhere is named."""
    import xgrammar

    tool = {"type": "function", "function": {"name": "f", "parameters": NODE}}
    request = tc.parse_tool_request([tool], "required", parser, parallel_tool_calls=False)
    matcher = xgrammar.GrammarMatcher(chars.compile(StructuredSpec(*tc.forced_calls_spec(request))))
    arguments = {"label": "a", "child": {"label": "b", "child": None}}
    if parser == tc.HERMES:
        good = json.dumps({"name": "f", "arguments": arguments})
        bad = '{"name": "f", "arguments": {"child": null}}'
    else:
        good = call("f", label="a", child=json.dumps(arguments["child"])).removeprefix("<tool_call>\n")
        bad = call("f", child="null").removeprefix("<tool_call>\n")
        assert json.loads(tc.read_calls(request, good)[1][0].arguments) == arguments
    assert matcher.accept_string(good.removesuffix("\n</tool_call>")), good
    matcher.reset()
    assert not matcher.accept_string(bad.removesuffix("\n</tool_call>"))
    text = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/S",
                                                                          "$defs": {"S": {"type": "string"}}}}}
    with pytest.raises(tc.ToolError, match="arguments are a JSON object.*'string'"):  # an object once followed
        tc.parse_tool_request([text], "required", parser)
    nowhere = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Nowhere"}}}
    with pytest.raises(GrammarError, match="Nowhere"):
        chars.check(StructuredSpec(*tc.forced_calls_spec(tc.parse_tool_request([nowhere], "required", parser))))


UNION = {"anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "a": {"type": "integer"}},
                    "required": ["kind", "a"], "additionalProperties": False},
                   {"$ref": "#/$defs/B"}],
         "$defs": {"B": {"type": "object", "properties": {"kind": {"const": "b"}, "b": {"type": "string"}},
                         "required": ["kind", "b"], "additionalProperties": False}}}  # pydantic's discriminated union


@pytest.mark.parametrize("key", ["anyOf", "oneOf"])
def test_parameters_that_are_a_union_of_objects_hold_a_forced_call_to_one_of_them(chars, key):
    """A tool whose parameters are a union at the top (pydantic's discriminated models) forces a call to one
    of its branches (it was refused, naming a 'type' beside the union the client never sent); a branch that is
    not an object is named; the qwen3_coder format, which writes a call's top properties, refuses it by name."""
    import xgrammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {key: UNION["anyOf"], "$defs": UNION["$defs"]}}}
    request = tc.parse_tool_request([tool], "required", tc.HERMES, parallel_tool_calls=False)
    matcher = xgrammar.GrammarMatcher(chars.compile(StructuredSpec(*tc.forced_calls_spec(request))))
    for arguments, held in (({"kind": "a", "a": 1}, True), ({"kind": "b", "b": "x"}, True),
                            ({"kind": "a", "b": "x"}, False), ({"kind": "c"}, False)):
        matcher.reset()
        assert matcher.accept_string(json.dumps({"name": "f", "arguments": arguments})) is held, arguments
    text = {"type": "function", "function": {"name": "f", "parameters": {key: [{"type": "object"},
                                                                              {"type": "string"}]}}}
    with pytest.raises(tc.ToolError, match=rf"parameters\.{key}\[1\]: a call's arguments are a JSON object.*'string'"):
        tc.parse_tool_request([text], "required", tc.HERMES)
    untyped = {"type": "function", "function": {"name": "f", "parameters": {key: [{"type": "object"}, {}]}}}
    with pytest.raises(tc.ToolError, match=rf"parameters\.{key}\[1\]: .*got one of no type \(any JSON\)"):
        tc.parse_tool_request([untyped], "required", tc.HERMES)
    xml = tc.parse_tool_request([tool], "required", tc.QWEN3_CODER)
    with pytest.raises(GrammarError, match=f"{key} at the top of its parameters is not enforced"):
        chars.check(StructuredSpec(*tc.forced_calls_spec(xml)))
