"""The pure tool-call module: the format chosen from the template, the
request's tools validated, and calls read back from replies, whole and
streamed in every split."""

from __future__ import annotations

import json

import pytest

from mstar_actors.frontend import tool_calls as tc
from mstar_actors.frontend.tool_calls import HermesCallStream, Llama3JsonReader, ToolError
from tests.frontend.conftest import CHATML
from tests.tool_calls.templates import HERMES_TEMPLATE, LLAMA3_JSON_TEMPLATE, TIME, WEATHER, make_tool_model_dir


def _calls(calls) -> list[tuple[str, dict | str]]:
    return [(c.name, _arguments(c.arguments)) for c in calls]


def _arguments(text: str) -> dict | str:
    """A call's arguments read (their text where max_tokens cut them)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _stream(reader, text: str, size: int) -> tuple[str, list]:
    """Feed ``text`` in pieces of ``size`` characters, then flush."""
    content, calls = "", []
    for at in range(0, len(text), size):
        piece, more = reader.feed(text[at:at + size])
        content, calls = content + piece, calls + more
    piece, more = reader.flush()
    return content + piece, calls + more


def _hermes(text: str, size: int, max_calls: int | None = None) -> tuple[str, list]:
    """A hermes reply streamed in pieces of ``size`` characters: (content, calls as (name, arguments))."""
    return _read_back(_stream_deltas(HermesCallStream(max_calls), text, size))[:2]


# ---- the format ----------------------------------------------------------


def test_parser_chosen_from_the_template():
    assert tc.choose_parser(HERMES_TEMPLATE) == "hermes"
    assert tc.choose_parser(LLAMA3_JSON_TEMPLATE) == "llama3_json"
    assert tc.choose_parser(CHATML) is None and tc.choose_parser(None) is None
    assert tc.choose_parser({"default": CHATML, "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert tc.choose_parser(CHATML, "llama3_json") == "llama3_json"  # the config overrides


def test_config_key_is_validated():
    from mstar_actors.config import ConfigError, parse_config

    assert parse_config({"model": {"tool_call_parser": "hermes"}}).model.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        parse_config({"model": {"tool_call_parser": "mistral"}})


# ---- replies the templates render ------------------------------------------

HISTORY_CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]


@pytest.mark.parametrize("template, start, end", [
    (HERMES_TEMPLATE, "<|im_start|>assistant", "<|im_end|>"),
    (LLAMA3_JSON_TEMPLATE, "assistant<|end_header_id|>\n\n", "<|eom_id|>"),
])
def test_the_templates_own_rendering_of_calls_reads_back(tmp_path, template, start, end):
    """A call as the template writes it in the history is what the model learned
    to write: the reader gives back the same calls, and no content."""
    from mstar_actors.messages import ChatMessage, ToolCall
    from mstar_actors.tokenization import Tokenization

    tokenization = Tokenization(make_tool_model_dir(tmp_path / "m", template))
    calls = tuple(ToolCall(id=f"call_{i}", name=n, arguments=json.dumps(a)) for i, (n, a) in enumerate(HISTORY_CALLS))
    chat = [ChatMessage("user", "weather and time?"), ChatMessage("assistant", "", tool_calls=calls)]
    ids = tokenization.apply_chat_template(chat, False, tools=[WEATHER, TIME])
    rendered = tokenization.decode(ids, skip_special_tokens=False)
    reply = rendered[rendered.rindex(start) + len(start):rendered.rindex(end)]
    request = tc.parse_tool_request([WEATHER, TIME], "auto", tc.choose_parser(template))
    content, parsed = tc.read_calls(request, reply)
    assert content is None and _calls(parsed) == HISTORY_CALLS


# ---- hermes ------------------------------------------------------------------

HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_hermes_streamed_in_any_split_reads_the_same(size):
    content, calls = _hermes(HERMES_REPLY, size)
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_holds_back_a_possible_opening_only():
    reader = HermesCallStream()
    assert reader.feed("a <tool") == [{"content": "a "}]  # may become <tool_call>
    assert reader.feed("s are fun") == [{"content": "<tools are fun"}]  # did not
    assert reader.flush() == []


def test_hermes_gives_back_what_is_not_a_call():
    bad = "<tool_call>\n{not json}\n</tool_call> after"
    assert _hermes(bad, 3) == (bad, [])
    assert _hermes('x <tool_call>{"arguments": {}}', 4) == ('x <tool_call>{"arguments": {}}', [])


def test_hermes_keeps_the_text_after_a_call_whose_object_never_closed():
    """Nothing the model wrote is dropped: text past a call's arguments, its object never closed, is content."""
    assert _hermes('<tool_call>\n{"name": "f", "arguments": {"c": "P"}\nAfter text', 3) == (
        "\nAfter text", [("f", {"c": "P"})])
    assert _hermes('<tool_call>\n{"name": "f", "arguments": {"c": "P"}\nSo {x}.\n</tool_call> ok', 2) == (
        "\nSo {x}.\n ok", [("f", {"c": "P"})])


def test_hermes_reads_a_call_cut_at_eos_and_string_arguments():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert _hermes(text, 4) == ("", [("f", {"a": 1})])


def test_a_forced_reply_reads_the_bare_json():
    """The opening is in the prompt: the output is the call's JSON alone."""
    request = tc.parse_tool_request([WEATHER, TIME], "required", "hermes")
    content, calls = tc.read_calls(request, '{"name": "f", "arguments": {"x": [1, 2]}}')
    assert content is None and _calls(calls) == [("f", {"x": [1, 2]})]
    assert tc.read_calls(request, "not a call") == (None, [])  # (the grammar writes calls only)


def test_a_forced_reply_cut_short_is_a_call_as_its_stream_sends_it():
    """max_tokens cut the arguments: the call's arguments go as far as they
    were written, in a response as in a stream (as vLLM's named call), never
    the format's wrapper as content; a reply cut in its head has no call."""
    for parser in ("hermes", "llama3_json"):
        request = tc.parse_tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                                        parser)
        key = tc.ARGUMENTS_KEY[parser]
        text = f'{{"name": "get_weather", "{key}": {{"cit'
        content, calls = tc.read_calls(request, text)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"cit')]
        stream = tc.ForcedCallStream(request)
        deltas = stream.feed(text)
        assert stream.flush() == [] and "".join(d["function"]["arguments"] for d in deltas) == '{"cit'
        cut = [(c.name, c.arguments) for c in tc.read_calls(request, '{"name": "get_wea')[1]]
        assert cut == [("get_weather", "")]  # named: the call whatever was written
        assert [(c.name, c.arguments) for c in tc.read_calls(request, f'{{"name": "get_weather", "{key[:3]}')[1]] \
            == [("get_weather", "")]
        required = tc.parse_tool_request([WEATHER, TIME], "required", parser)
        assert tc.read_calls(required, '{"name": "get_wea') == (None, [])  # no name yet: no call, no markup
        assert [c.name for c in tc.read_calls(required, '{"name": "get_time", "')[1]] == ["get_time"]


def _stream_deltas(stream, text: str, size: int) -> list[dict]:
    deltas = [d for at in range(0, len(text), size) for d in stream.feed(text[at:at + size])]
    return deltas + stream.flush()


def _read_back(deltas: list[dict]) -> tuple[str, list[tuple[str, dict]], int]:
    """(content, calls, the most argument pieces one call took) from chunk deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    parts = [p for d in deltas for p in d.get("tool_calls", [])]
    names = {p["index"]: p["function"]["name"] for p in parts if "id" in p}
    pieces = {i: [p["function"]["arguments"] for p in parts if p["index"] == i and "id" not in p] for i in names}
    calls = [(names[i], _arguments("".join(pieces[i]))) for i in sorted(names)]
    return content, calls, max((len(v) for v in pieces.values()), default=0)


HERMES_STREAM_CASES = [
    HERMES_REPLY,
    'Sure. <tool_call>{"name": "f", "arguments": {"s": "a } ] \\" </tool_call> {", "n": [1, {"x": 2}]}}</tool_call> '
    'and then some text <tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n\n',
    "<tool_call>\n{not json}\n</tool_call> after",  # not a call: content, markup included
    'x <tool_call>{"arguments": {}, "name": "late"}</tool_call> y',  # the name not first: read whole
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}',  # string arguments, cut at EOS: read whole
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}',  # cut at EOS before its closing tag
    "No tools needed: <b>ok</b> <tool",
    '<tool_call>{"name": "f\\x", "arguments": {"a": 1}}</tool_call>',  # a name that is no JSON string: content
    '<tool_call>{"name": "f\ng", "arguments": {"a": 1}}</tool_call> ok',
    '<tool_call>{"arguments": {"a": "</tool_call>"}, "name": "f"}</tool_call> then',  # the tag in a string
    '<tool_call>\n{"name": "g", "arguments": {"s": "x</tool_call>y"}}\n',  # ... and cut at EOS
    'a <tool_call>{"name": "f", "arguments": {"k": 1}, "x": "</tool_call>"}</tool_call> b',
    '\n <tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n<tool_call>{"name": "g", "arguments": {}}</tool_call>\n',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call> \n text \n<tool_call>{"name": "g", "arguments": {}}'
    '</tool_call> \n',
    " \n\t ",  # whitespace alone: content
    '<tool_call>{"name":"f","arguments":{}}</tool_call><tool_call>not json\n</tool_call>\n\n',  # after a block's text
    '<tool_call>{"name":"f","arguments":{}}</tool_call> hi  ',
    '<tool_call>{"name":"get","arguments":{"a":1}}\nok.a b',  # a call's block never closed, text after it
    '<tool_call>{"arguments": {}, "name": "v"} ok',  # ... its name not first
    '<tool_call>{"name": "u", "arguments": {}} ok <tool_call>{"name": "h", "arguments": {}}</tool_call>',  # ... then
    '<tool_call>{"arguments": {}, "name": "u"} <tool_call>{"name": "h", "arguments": {"s": "</tool_call> }"}}'
    '</tool_call> end',  # another block, a tag in its string
    'a <tool_call>{"name": "f", "arguments": {"c": "P"}} junk\n</tool_call> b',  # text after the call in its block
    '<tool_call>{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {}}</tool_call>',  # two objects, one block
    'Sure. <tool_call>{"name": "f", "arguments": {"t": "U"}}\n</',  # cut inside its closing tag
    'Sure. <tool_call>{"arguments": {}, "name": "f"} ok\n</tool_cal',  # ... read whole, text before the cut tag
    'Xm<tool_call>\n{"name": "f", "arguments": {"c": "P"}}\n</tool_call>'
    '<tool_call>\n{"name": "g", "arguments": {"q": "a',
    # ... cut inside a call's arguments: a call as far as it was written
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # its object never closes
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call> ok',  # arguments no JSON: as written
    'I will call.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # ... a bare word
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"b": 2}}'
    '\n</tool_call>\nDone: both looked up.',  # a call's object never closed: its block's tag ends it, then more
    '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>", "b": [1</tool_call> after',  # arguments cut at a tag
    '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}\nAfter text',  # ... never closed: the text after it
    '<tool_call>\n{"name": "f", "arguments": {"c": "P"}\nHmm, also.\n<tool_call>\n{"name": "g", "arguments": {}}'
    '\n</tool_call>\nDone',  # ... and text before the next block
]


@pytest.mark.parametrize("text", HERMES_STREAM_CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_streams_arguments_as_written_and_reads_what_a_response_reads(text, size):
    """``tool_choice: "auto"`` streamed (as vLLM's hermes parser): content and
    calls in order, a call's head once its name is written, its arguments in
    pieces; joined, the same content and calls as the whole reply's, where
    every call's arguments are valid JSON. Where one's are not (cut, never
    closed, NaN), the whole reply is content as written, as vLLM's reads it."""
    request = tc.parse_tool_request([WEATHER, TIME], "auto", "hermes")
    stream = tc.stream_reader(request)
    assert isinstance(stream, tc.HermesCallStream)
    deltas = _stream_deltas(stream, text, size)
    content, calls, most_pieces = _read_back(deltas)
    whole_content, whole_calls = tc.read_calls(request, text)
    if any(isinstance(arguments, str) or "NaN" in json.dumps(arguments) for _, arguments in calls):
        assert (whole_content, whole_calls) == (text, [])
        return
    assert content == (whole_content or "") and calls == _calls(whole_calls)
    assert whole_content is not None or not any("content" in d for d in deltas)  # null content: none streamed
    assert stream.num_calls == len(whole_calls)
    if size == 1 and '"s": "a }' in text:
        assert most_pieces > 10  # never held to the call's end


def test_hermes_stream_keeps_the_order_of_content_and_calls_and_drops_calls_past_the_limit():
    text = 'one <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> two <tool_call>{"name": "b", ' \
           '"arguments": {}}</tool_call>'
    deltas = _stream_deltas(tc.HermesCallStream(), text, 1000)
    assert [next(iter(d)) for d in deltas] == ["content", "tool_calls", "tool_calls", "content", "tool_calls",
                                                "tool_calls"]
    limited = tc.HermesCallStream(max_calls=1)  # parallel_tool_calls: false
    content, calls, _ = _read_back(_stream_deltas(limited, text, 3))
    assert calls == [("a", {"k": 1})] and content == "one  two " and limited.num_calls == 2


def test_plain_text_streams_unchanged():
    text = "No tools needed: it is sunny. <b>ok</b>"
    assert _hermes(text, 2) == (text, [])
    assert _stream(Llama3JsonReader(), text, 2) == (text, [])


# ---- llama 3 JSON --------------------------------------------------------------


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '  \n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_reads_one_call(text, size):
    content, calls = _stream(Llama3JsonReader(), text, size)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris"})]


def test_llama3_reads_calls_joined_and_gives_back_the_rest():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}'
    assert _calls(_stream(Llama3JsonReader(), text, 3)[1]) == [("a", {}), ("b", {"k": 1})]
    for not_calls in ('{"name": "a", "parameters": {}} and more', '{"city": "Paris"}', "{broken",
                      # a JSON answer with a "name" key (a response_format's, say): content, as vLLM reads it; it
                      # was a call of the name's value, its other keys dropped
                      '{"name": "Paris", "country": "France"}', '{"name": "a", "parameters": {}}; {"name": "b"}'):
        assert _stream(Llama3JsonReader(), not_calls, 3) == (not_calls, [])


# ---- the request ---------------------------------------------------------------


def test_tool_choice_forms():
    assert tc.parse_tool_request([WEATHER], None, "hermes").choice == "auto"
    assert tc.parse_tool_request(None, None, "hermes") is None
    assert tc.parse_tool_request([], "none", "hermes") is None
    named = tc.parse_tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, "hermes")
    assert (named.choice, named.function, named.is_forced, named.assistant_prefix) == \
        ("function", "get_time", True, "<tool_call>\n")
    none = tc.parse_tool_request([WEATHER], "none", "hermes")
    assert none.tools == [WEATHER] and not none.reads_calls  # rendered, as vLLM does by default
    assert tc.parse_tool_request([WEATHER], "required", "llama3_json").assistant_prefix == ""


@pytest.mark.parametrize("tools, choice, param", [
    ({"type": "function"}, None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "get\n"}}], None, "tools[0].function.name"),  # (not before its end)
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "always", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(ToolError) as info:
        tc.parse_tool_request(tools, choice, "hermes")
    assert info.value.param == param


def _nested(levels: int, ref: bool = False) -> dict:
    """A schema of objects ``levels`` deep, each the next's property ``a`` (the last refers to the first)."""
    schema = inner = {"type": "object", "properties": {}}
    for _ in range(levels):
        inner["properties"]["a"] = inner = {"type": "object", "properties": {}}
    if ref:
        inner["properties"]["b"] = {"$ref": "#"}
    return schema


def test_a_deep_schema_is_a_400_or_served_never_a_recursion():
    """Schemas as deep as a body may be (~500 objects): the call's schema was built by recursion, a
    RecursionError, a 500 (and a retry of the client's, three times)."""
    for choice in ("required", "auto"):
        tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(480), "strict": True}}]
        with pytest.raises(ToolError, match="nested more than 256") as info:
            tc.parse_tool_request(tools, choice, "hermes")
        assert info.value.param == "tools[0].function.parameters"
    deep = {"type": "function", "function": {"name": "f", "parameters": _nested(126, ref=True), "strict": True}}
    forced = json.loads(tc.forced_call_schema(tc.parse_tool_request([deep], "required", "hermes")))
    assert forced["properties"]["arguments"] == {"$ref": "#/$defs/call0"}
    inner = forced["$defs"]["call0"]
    for _ in range(126):
        inner = inner["properties"]["a"]
    assert inner["properties"]["b"] == {"$ref": "#/$defs/call0"}  # rebased at the bottom too
    assert tc.strict_calls_spec(tc.parse_tool_request([deep], "auto", "hermes"), None) is not None


def test_a_template_with_no_format_serves_forced_calls_only():
    with pytest.raises(ToolError, match="tool_call_parser"):
        tc.parse_tool_request([WEATHER], "auto", None)
    forced = tc.parse_tool_request([WEATHER], "required", None)
    assert forced.parser == "llama3_json" and forced.assistant_prefix == ""  # a bare JSON object
    assert not tc.parse_tool_request([WEATHER], "none", None).reads_calls


def test_forced_schema_pins_the_name_and_the_parameters():
    required = json.loads(tc.forced_call_schema(tc.parse_tool_request([WEATHER, TIME], "required", "hermes")))
    assert [b["properties"]["name"] for b in required["anyOf"]] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    assert required["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    named = tc.parse_tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                                  "llama3_json")
    schema = json.loads(tc.forced_call_schema(named))
    assert schema["required"] == ["name", "parameters"] and schema["properties"]["name"] == {"enum": ["get_weather"]}


def test_a_schema_without_a_type_still_forces_an_object():
    """``"parameters": {}`` takes any JSON; a call's arguments are an object all the same."""
    request = tc.parse_tool_request([{"type": "function", "function": {"name": "f", "parameters": {}}}], "required",
                                    "hermes")
    assert json.loads(tc.forced_call_schema(request))["properties"]["arguments"]["type"] == "object"


def test_arguments_keep_a_number_past_a_doubles_range_as_written():
    """9e999 is JSON text (it reads as inf, which json.dumps would write as
    Infinity): a call keeps its arguments as written, whole or streamed, in
    every format. NaN is no JSON: a llama3_json reply is then no call; a hermes block that opened as a call's
    head and object was streamed as that call, its arguments as written, and a response is its text (as vLLM's)."""
    big = '{"name": "f", "arguments": {"x": 9e999, "y": "é"}}'
    for request in (tc.parse_tool_request([WEATHER], "required", "hermes"),
                    tc.parse_tool_request([WEATHER], "auto", "hermes")):
        text = big if request.is_forced else f"<tool_call>{big}</tool_call>"
        content, calls = tc.read_calls(request, text)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 9e999, "y": "é"}')]
    llama = tc.parse_tool_request([WEATHER], "auto", "llama3_json")
    assert [c.arguments for c in tc.read_calls(llama, '{"name": "f", "parameters": {"x": 1E400}}')[1]] == ['{"x": 1E400}']
    nan = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    content, calls = tc.read_calls(tc.parse_tool_request([WEATHER], "auto", "hermes"), nan)
    assert (content, calls) == (nan, [])
    assert tc.read_calls(llama, '{"name": "f", "parameters": {"x": NaN}}')[1] == []
    # arguments a JSON string holds are that text; written before the name, re-encoded (as JSON allows)
    assert tc.parse_call('{"name": "f", "arguments": "{\\"a\\":1}"}').arguments == '{"a":1}'
    assert tc.parse_call('{"arguments": {"a":1}, "name": "f"}').arguments == '{"a": 1}'
    assert tc.parse_call('{"arguments": {"a": 1e999}, "name": "f"}') is None


def test_finish_reason():
    auto, required = (tc.parse_tool_request([WEATHER], choice, "hermes") for choice in ("auto", "required"))
    named = tc.parse_tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, "hermes")
    assert tc.finish_reason(auto, "stop", 1) == tc.finish_reason(required, "stop", 1) == "tool_calls"
    assert tc.finish_reason(named, "stop", 1) == "stop"  # as vLLM's and OpenAI's
    assert tc.finish_reason(auto, "stop", 0) == "stop"
    assert tc.finish_reason(auto, "length", 2) == "length"  # a cut reply says so
    assert tc.finish_reason(auto, "stop", 1, "STOP") == tc.finish_reason(required, "stop", 1, 7) == "stop"


def test_call_ids_and_shapes():
    call = tc.parse_call('{"name": "f", "arguments": {"é": 1}}')
    assert call.id.startswith("call_") and len(call.id) > 10 and call.id != tc.parse_call('{"name": "f"}').id
    assert call.as_deltas(3) == [{"index": 3, "id": call.id, "type": "function", "function": {"name": "f", "arguments": ""}},
                                 {"index": 3, "function": {"arguments": '{"é": 1}'}}]


@pytest.mark.parametrize("parser, reply", [
    ("hermes", HERMES_REPLY),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, reply):
    request = tc.parse_tool_request([WEATHER, TIME], "auto", parser, parallel_tool_calls=False)
    assert _calls(tc.read_calls(request, reply)[1]) == [("get_weather", {"city": "Paris"})]
    for size in (1, 3, 1000):
        reader = tc.stream_reader(request)
        calls = _read_back(_stream_deltas(reader, reply, size))[1] if parser == "hermes" else _calls(
            _stream(reader, reply, size)[1])
        assert calls == [("get_weather", {"city": "Paris"})]
    both = tc.parse_tool_request([WEATHER, TIME], "auto", parser, parallel_tool_calls=True)
    assert len(tc.read_calls(both, reply)[1]) == 2
    with pytest.raises(ToolError) as info:
        tc.parse_tool_request([WEATHER], "auto", parser, parallel_tool_calls="no")
    assert info.value.param == "parallel_tool_calls"


def test_a_special_opening_marker_is_reported():
    assert "special token" in tc.marker_problem("hermes", {"<tool_call>", "<|im_end|>"})
    assert tc.marker_problem("hermes", {"<|im_end|>"}) is None
    assert tc.marker_problem("llama3_json", {"<|python_tag|>"}) is None  # read with or without it


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_forced_reply_streams_each_calls_arguments_as_they_are_written(parser, piece):
    """As OpenAI's and vLLM's streams: a call's id and name once its name is
    written (arguments ""), then its arguments in pieces; the pieces of a
    call join to the arguments read_calls reads from the whole reply."""
    request = tc.parse_tool_request([WEATHER, TIME], "required", parser)
    key = tc.ARGUMENTS_KEY[parser]
    calls = [{"name": "get_weather", key: {"city": "Oslo \"N\" {x}", "unit": "c"}}, {"name": "get_time", key: {}}]
    text = tc.CALL_SEPARATOR[parser].join(json.dumps(c) for c in calls)
    stream = tc.ForcedCallStream(request)
    deltas = [d for i in range(0, len(text), piece) for d in stream.feed(text[i:i + piece])]
    assert stream.flush() == [] and stream.num_calls == 2
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["function"]) for h in heads] == [(0, {"name": "get_weather", "arguments": ""}),
                                                             (1, {"name": "get_time", "arguments": ""})]
    assert all(h["id"].startswith("call_") and h["type"] == "function" for h in heads)
    joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i and "id" not in d) for i in (0, 1)]
    assert [json.loads(j) for j in joined] == [json.loads(c.arguments) for c in tc.read_calls(request, text)[1]]
    assert all(j.startswith("{") for j in joined)  # the space before them is the call's
    if piece == 1:  # each piece leaves as it comes: never held to the call's end
        assert len([d for d in deltas if d["index"] == 0 and "id" not in d]) > 10
    cut = tc.ForcedCallStream(request)
    assert cut.feed('{"name": "get_wea') == [] and cut.flush() == []  # no name yet: no call, no markup as content


def test_hermes_stream_and_whole_reply_agree_on_random_replies():
    """Replies of text, whitespace, calls (a tag or braces inside their
    strings) and blocks that are no call, split at random: the stream's
    content and calls are the whole reply's (every block closed, every
    object whole: where a call's object breaks off, the stream has sent it)."""
    import random

    request = tc.parse_tool_request([WEATHER, TIME], "auto", "hermes")
    pieces = ["Hello.", " ", "\n", "\n\n", "a b", "<b>x</b>", "{}", "<tool",
              '<tool_call>{"name": "u", "arguments": {"a": 1}}',  # a block never closed
              '<tool_call>{"name": "f", "arguments": {"s": "x </tool_call> }"}}</tool_call>',
              '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
              '<tool_call>{"arguments": {"k": [1, 2]}, "name": "h"}</tool_call>',
              "<tool_call>not json</tool_call>", "<tool_call>\n</tool_call>",
              '<tool_call>{"name": "g", "arguments": {"b": 2}} tail</tool_call>']  # text after the call's object
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 7)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12))))
        stream = tc.stream_reader(request)
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        deltas = [d for part in parts for d in stream.feed(part)] + stream.flush()
        content, calls, _ = _read_back(deltas)
        whole_content, whole_calls = tc.read_calls(request, text)
        assert (content, calls) == (whole_content or "", _calls(whole_calls)), (text, cuts)
