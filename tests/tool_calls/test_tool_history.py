"""A history with tool calls and tool results: accepted by the frontend's
parser, handed to the template in the shape Hugging Face templates read, and
rendered with the tools (and a forced call's opening) by prepare."""

from __future__ import annotations

import json

import msgspec
import pytest

from mstar_actors.frontend import openai_api as api
from mstar_actors.messages import ChatMessage, NewRequest, SamplingParams, ToolCall
from tests.tool_calls.templates import WEATHER, make_tool_model_dir

ARGS = '{"city": "Paris"}'
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def _parse(messages, **kw):
    body = {"model": "tiny", "messages": messages} | kw
    return api.parse_chat(json.dumps(body).encode(), None, tool_parser="hermes")


def test_tool_history_is_accepted():
    parsed = _parse(HISTORY, tools=[WEATHER])
    assert parsed.messages == [
        ChatMessage("user", "weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall(id="call_1", name="get_weather", arguments=ARGS),)),
        ChatMessage("tool", '{"temp_c": 21}', tool_call_id="call_1"),
    ]
    # and it survives the channel's encoding
    req = parsed.new_requests("r", "tiny")[0]
    assert msgspec_roundtrip(req) == req


def msgspec_roundtrip(req: NewRequest) -> NewRequest:
    from mstar_actors.messages import FrontendToPrepare

    return msgspec.msgpack.Decoder(FrontendToPrepare).decode(msgspec.msgpack.encode(req))


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"id": ["c"], "function": {"name": "f", "arguments": "{}"}}]},
     "messages[0].tool_calls[0].id"),  # was replaced by a made-up id
    ({"role": "assistant", "tool_calls": [{"type": "bogus", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[0].tool_calls[0].type"),
    ({"role": "tool", "content": None}, "messages[0].content"),
])
def test_bad_tool_messages_name_the_field(message, param):
    """A wrong field of a history call or tool message is named (null ones are absent)."""
    with pytest.raises(api.ApiError) as info:
        _parse([message])
    assert info.value.status == 400 and info.value.param == param


def test_a_history_call_s_null_fields_are_absent():
    (assistant,) = _parse([{"role": "assistant", "tool_calls": [
        {"id": None, "type": None, "function": {"name": "f", "arguments": "{}"}}]}]).messages
    assert assistant.tool_calls[0].name == "f" and assistant.tool_calls[0].id.startswith("call_")


@pytest.mark.parametrize("arguments", ["", None])
def test_a_history_call_of_no_arguments_reads_as_an_empty_object(arguments):
    """vLLM's reading: what a reply cut at its call's name returns ("") goes back as {}."""
    (assistant,) = _parse([{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": arguments}}]}]).messages
    assert assistant.tool_calls[0].arguments == "{}"


def test_auto_on_a_template_with_no_format_is_refused():
    body = {"model": "tiny", "messages": HISTORY[:1], "tools": [WEATHER]}
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(json.dumps(body).encode(), None, tool_parser=None)
    assert info.value.param == "tool_choice" and "tool_call_parser" in info.value.message
    forced = api.parse_chat(json.dumps(body | {"tool_choice": "required"}).encode(), None, tool_parser=None)
    assert forced.sampling.structured.kind == "json_calls"  # one or more calls


def test_forced_call_cannot_continue_the_final_message():
    messages = HISTORY[:1] + [{"role": "assistant", "content": "Sure"}]
    with pytest.raises(api.ApiError) as info:
        _parse(messages, tools=[WEATHER], tool_choice="required", continue_final_message=True,
               add_generation_prompt=False)
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("constraint, param", [({"response_format": {"type": "json_object"}}, "response_format"),
                                               ({"guided_regex": "[0-9]+"}, "guided_regex")])
def test_an_output_constraint_cannot_continue_the_final_message(constraint, param):
    """The grammar would start over after the continued text: the turn as a whole would break it."""
    messages = HISTORY[:1] + [{"role": "assistant", "content": '{"name": "'}]
    with pytest.raises(api.ApiError) as info:
        _parse(messages, continue_final_message=True, add_generation_prompt=False, **constraint)
    assert info.value.status == 400 and info.value.param == param and "continue_final_message" in info.value.message


def test_forced_call_with_another_constraint_is_refused():
    pytest.importorskip("mstar_actors.runner.grammar")  # response_format is parsed where the engine is
    with pytest.raises(api.ApiError) as info:
        _parse(HISTORY[:1], tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert info.value.param == "tool_choice"


def test_the_template_gets_decoded_arguments(hermes_dir):
    from mstar_actors.tokenization import Tokenization

    tokenization = Tokenization(hermes_dir)
    ids = tokenization.apply_chat_template(_parse(HISTORY).messages, True)
    text = tokenization.decode(ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text


def test_a_qwen3_coder_template_writes_history_calls_in_its_own_tags(qwen3_coder_dir):
    from mstar_actors.tokenization import Tokenization

    tokenization = Tokenization(qwen3_coder_dir)
    text = tokenization.decode(tokenization.apply_chat_template(_parse(HISTORY).messages, True), False)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>" in text


def test_a_template_that_writes_no_tools_gets_them_in_the_system_message_and_calls_in_content(plain_dir, hermes_dir):
    """SmolLM2's template writes role and content only: the tools and the
    history's calls were dropped without a word. As llama.cpp's polyfills:
    the tools described in the system message, a call as the JSON a forced
    call answers with; a template that writes them is left as it is."""
    from mstar_actors.tokenization import Tokenization

    plain = Tokenization(plain_dir)
    assert (plain.tool_caps.tools, plain.tool_caps.tool_calls) == (False, False)
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = plain.decode(plain.apply_chat_template(_parse(messages).messages, True, tools=[WEATHER]),
                        skip_special_tokens=False)
    system, user, assistant, tool = text.split("<|im_end|>")[:4]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:\n")
    assert json.dumps(WEATHER["function"]) in system and '"parameters": <its arguments' in system
    assert assistant.strip() == '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert '{"temp_c": 21}' in tool
    no_system = plain.decode(plain.apply_chat_template(_parse(HISTORY[:1]).messages, True, tools=[WEATHER]),
                             skip_special_tokens=False)
    assert no_system.startswith("<|im_start|>system\nYou can call these tools:")
    hermes = Tokenization(hermes_dir)
    assert (hermes.tool_caps.tools, hermes.tool_caps.tool_calls) == (True, True)
    assert "You can call these tools" not in hermes.decode(
        hermes.apply_chat_template(_parse(HISTORY).messages, True, tools=[WEATHER]), skip_special_tokens=False)


def _caps(template: str):
    import jinja2

    from mstar_actors.frontend.tool_calls import template_tool_caps

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = jinja2.Environment()
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    return template_tool_caps(lambda conversation, tools: compiled.render(messages=conversation, tools=tools))


LOOP = "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
NO_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + LOOP + "{% endfor %}")
MISTRAL_CALLS = (LOOP + "{% for c in m.tool_calls or [] %}{% if c.id|length != 9 %}"
                 "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
                 "[TOOL_CALLS]{{ c.function.name }}{% endfor %}{% endfor %}")
TOOLS_WITH_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' and tools %}{% for t in tools %}"
                     "{{ t.function.name }}{% endfor %}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}")


def test_the_probe_tells_what_a_template_writes_and_leaves_a_refusing_one_alone():
    assert _caps(NO_SYSTEM) == type(_caps(NO_SYSTEM))(tools=False, tool_calls=False, system=False)
    mistral = _caps(MISTRAL_CALLS)  # its calls written once the probe's id has nine characters
    assert mistral.tool_calls and not mistral.tools and mistral.system
    assert _caps(TOOLS_WITH_SYSTEM).tools  # written only beside a system message: still written
    assert _caps("{{ raise_exception('no tools here') }}").tool_calls  # raising: left as it is


def test_polyfilled_tools_go_to_the_first_user_message_where_the_template_takes_no_system_and_in_its_format():
    from mstar_actors.frontend.tool_calls import HERMES, with_tool_polyfills

    conversation = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"c": 1}}}]}]
    out, tools = with_tool_polyfills(conversation, [WEATHER], _caps(NO_SYSTEM), HERMES)
    assert tools is None and [m["role"] for m in out] == ["user", "assistant"]
    assert out[0]["content"].startswith("You can call these tools:\n") and out[0]["content"].endswith("\n\nweather?")
    assert "reply with only: <tool_call>\n{\"name\": <the tool's name>, \"arguments\":" in out[0]["content"]
    assert out[1] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"c": 1}}\n</tool_call>'}


def test_prepare_renders_the_tools_and_a_forced_opening(hermes_dir):
    from mstar_actors.prepare.preparers import Preparer
    from mstar_actors.tokenization import Tokenization

    tokenization = Tokenization(hermes_dir)
    parsed = _parse(HISTORY[:1], tools=[WEATHER], tool_choice="required")
    req = parsed.new_requests("r", "tiny")[0]
    assert req.tools == [WEATHER] and req.assistant_prefix == "<tool_call>\n"
    # the rendering alone: the constraint is the grammar engine's to compile
    unconstrained = msgspec.structs.replace(req, sampling=SamplingParams())
    prepared = Preparer(tokenization).prepare(unconstrained)
    text = tokenization.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER) in text  # the template listed the tool
    assert text.endswith("<|im_start|>assistant\n<tool_call>\n")
    plain = Preparer(tokenization).prepare(NewRequest(request_id="p", model="tiny", sampling=SamplingParams(),
                                                      messages=parsed.messages))
    assert "# Tools" not in tokenization.decode(plain.prompt_token_ids, skip_special_tokens=False)


def test_a_template_s_refusal_on_the_chat_path_reads_as_the_tokenize_route_s(tmp_path):
    """The template's own words, under the field, as ``/tokenize`` says them (not a Python error's name)."""
    from mstar_actors.messages import Failed
    from mstar_actors.prepare.preparers import Preparer
    from mstar_actors.tokenization import Tokenization

    folder = make_tool_model_dir(tmp_path / "nosys", NO_SYSTEM)
    failed = Preparer(Tokenization(folder)).prepare(NewRequest(
        request_id="r", model="tiny", sampling=SamplingParams(),
        messages=_parse([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]).messages))
    assert isinstance(failed, Failed) and failed.status == 400 and failed.param == "messages"
    assert failed.message == "messages: the model's chat template refused 'messages': System role not supported"
