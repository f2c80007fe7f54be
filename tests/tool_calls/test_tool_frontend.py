"""Tool calls through the real frontend actor: the engine (the real scheduler
and a scripted rank) replies with a fixed text, so the "model" makes a call
deterministically; full and streamed responses must read the same call."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from tests.tool_calls.templates import TIME, WEATHER

CALL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "weather in Paris?"}]


def asynctest(fn):
    """Run the coroutine test under a deadline (the suite has no async plugin)."""
    @functools.wraps(fn)
    def test(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30))
    return test


def _body(**kw) -> dict:
    return {"model": "tiny", "messages": USER, "tools": [WEATHER, TIME]} | kw


def _assemble(events: list) -> dict:
    """OpenAI's streamed deltas of choice 0 put together as a client does."""
    content, calls, reasons = "", {}, []
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        assert "<tool_call>" not in (delta.get("content") or "") and "</tool_call>" not in (delta.get("content") or "")
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or part.get("id")
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
        reasons.append(choice["finish_reason"])
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": reasons[-1]}


@asynctest
async def test_auto_reads_the_call_in_full_and_streamed(tool_harness):
    async with tool_harness() as h:
        h.engine.reply_text = CALL_REPLY
        status, body = await h.post("/v1/chat/completions", _body())
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking.\n"
        [call] = choice["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        request = next(iter(h.engine.requests.values()))
        assert request.tools == [WEATHER, TIME] and request.assistant_prefix == ""
        assert request.sampling.structured is None  # auto: the model may answer in text

        status, events = await h.stream("/v1/chat/completions", _body())
        assert status == 200 and events[-1] == "[DONE]"
        streamed = _assemble(events)
        assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == "Checking.\n"
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == \
            [(call["function"]["name"], call["function"]["arguments"])]
        assert streamed["calls"][0]["id"].startswith("call_")


@asynctest
async def test_a_reply_without_a_call_is_plain_content(tool_harness):
    async with tool_harness() as h:
        h.engine.reply_text = "It is sunny <tool"
        status, body = await h.post("/v1/chat/completions", _body())
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny <tool"}
        assert body["choices"][0]["finish_reason"] == "stop"
        status, events = await h.stream("/v1/chat/completions", _body())
        assert _assemble(events) == {"content": "It is sunny <tool", "calls": [], "finish_reason": "stop"}


@asynctest
async def test_tool_choice_none_renders_tools_and_reads_no_calls(tool_harness):
    async with tool_harness() as h:
        h.engine.reply_text = CALL_REPLY
        status, body = await h.post("/v1/chat/completions", _body(tool_choice="none"))
        assert body["choices"][0]["message"]["content"] == CALL_REPLY
        assert "tool_calls" not in body["choices"][0]["message"]
        assert next(iter(h.engine.requests.values())).tools == [WEATHER, TIME]  # as vLLM by default


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@asynctest
async def test_forced_call_is_constrained_and_read_bare(tool_harness, tool_choice):
    """The turn starts with the opening, the output is held to the call's
    schema; the model writes only the JSON."""
    async with tool_harness() as h:
        h.engine.reply_text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
        status, body = await h.post("/v1/chat/completions", _body(tool_choice=tool_choice))
        assert status == 200, body
        request = next(iter(h.engine.requests.values()))
        assert request.assistant_prefix == "<tool_call>\n"
        spec = request.sampling.structured
        # required: one or more calls, as the format joins them (vLLM's list); a named function: one call
        parallel = tool_choice == "required"
        assert (spec.kind, spec.param) == ("json_calls" if parallel else "json", "tool_choice")
        schema = json.loads(spec.spec)
        if parallel:
            assert schema["separator"] == "\n</tool_call>\n<tool_call>\n"
            schema = schema["schema"]
        names = [b["properties"]["name"]["enum"] for b in schema.get("anyOf", [schema])]
        assert names == ([["get_weather"], ["get_time"]] if tool_choice == "required" else [["get_weather"]])
        choice = body["choices"][0]
        # as vLLM's: "tool_calls" for required calls (and "auto" ones), a named function's the engine's reason
        finish = "tool_calls" if tool_choice == "required" else "stop"
        assert choice["finish_reason"] == finish and choice["message"]["content"] is None
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
        _, events = await h.stream("/v1/chat/completions", _body(tool_choice=tool_choice))
        streamed = _assemble(events)
        assert streamed["content"] == "" and streamed["calls"][0]["name"] == "get_weather"
        # as OpenAI's stream: the call's id, type and name first, its arguments next, the finish on its own chunk
        # (the openai client's stream helper closes a call only when the finish comes after it)
        choices = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
        head, arguments, end = choices[-3:]
        assert head["delta"]["tool_calls"] == [{"index": 0, "id": streamed["calls"][0]["id"], "type": "function",
                                                "function": {"name": "get_weather", "arguments": ""}}]
        assert arguments["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": streamed["calls"][0]["arguments"]}}]
        assert head["finish_reason"] is None and arguments["finish_reason"] is None
        assert end["delta"] == {} and end["finish_reason"] == finish


@asynctest
async def test_a_forced_call_a_stop_string_cuts_is_a_call_that_finished_on_stop(tool_harness):
    """The client's stop string ended the reply, maybe inside the arguments:
    its call as far as it was written, finish "stop" with the stop_reason
    (not "tool_calls", which says the model finished its calls)."""
    async with tool_harness() as h:
        h.engine.reply_text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
        forced = _body(tool_choice="required", stop=["Oslo"])
        status, body = await h.post("/v1/chat/completions", forced)
        choice = body["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "Oslo")
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "'
        _, events = await h.stream("/v1/chat/completions", forced)
        streamed = _assemble(events)
        assert streamed["finish_reason"] == "stop" and streamed["calls"][0]["arguments"] == '{"city": "'


@asynctest
async def test_each_choice_reads_its_own_calls(tool_harness):
    async with tool_harness() as h:
        h.engine.reply_text = CALL_REPLY
        status, events = await h.stream("/v1/chat/completions", _body(n=2))
        calls = [p for e in events if e != "[DONE]" for c in e["choices"] for p in c["delta"].get("tool_calls", [])]
        assert sorted(p["index"] for p in calls) == [0, 0, 0, 0]  # each choice's first call: its head, its arguments
        reasons = [c["finish_reason"] for e in events if e != "[DONE]" for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["tool_calls", "tool_calls"]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
@asynctest
async def test_bad_tools_are_a_400_naming_the_field(tool_harness, extra, param):
    async with tool_harness() as h:
        status, body = await h.post("/v1/chat/completions", _body(**extra))
        assert status == 400 and body["error"]["param"] == param, body


@asynctest
async def test_return_token_ids_are_the_prompt_with_its_tools_and_a_forced_calls_opening(tool_harness, hermes_tokenizer,
                                                                                        hermes_dir):
    """prompt_token_ids are the engine's prompt, sent back with the first delta (not the frontend's own rendering),
    and the request the frontend sends has prepare render the tools and the forced call's opening."""
    from mstar_actors.prepare.preparers import prompt_token_ids
    from mstar_actors.tokenization import Tokenization

    async with tool_harness() as h:
        h.engine.reply_text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        status, body = await h.post("/v1/chat/completions", _body(tools=[WEATHER], tool_choice="required",
                                                                  return_token_ids=True))
        assert status == 200, body
        req = next(iter(h.engine.requests.values()))
        assert req.return_prompt_ids and body["prompt_token_ids"] == h.engine.prompt_ids(req)
        text = hermes_tokenizer.apply_chat_template(USER, tools=[WEATHER], tokenize=False,
                                                    add_generation_prompt=True)
        expected = hermes_tokenizer(text + "<tool_call>\n", add_special_tokens=False).input_ids
        assert prompt_token_ids(Tokenization(hermes_dir), req, None)[0] == expected


@asynctest
async def test_qwen3_5_s_xml_calls_are_read_whole_and_streamed_and_forced_in_their_format(qwen3_coder_dir):
    """A template that writes ``<function=...>`` calls is read as ``qwen3_coder`` (vLLM's parser for
    Qwen3.5): auto calls come back typed by their schema, streamed alike; a forced reply is held to the
    format by an ``xml_calls`` grammar; history calls go back through the template."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import Harness

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_coder_dir), local_files_only=True)
    reply = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
            "</function>\n</tool_call>"
    async with Harness(qwen3_coder_dir, tokenizer) as h:
        h.engine.reply_text = reply
        status, body = await h.post("/v1/chat/completions", _body())
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.\n"
        [call] = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather",
                                                                                       {"city": "Paris"})
        status, events = await h.stream("/v1/chat/completions", _body())
        streamed = _assemble(events)
        assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == "Checking.\n"
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("get_weather", '{"city": "Paris"}')]

        h.engine.requests.clear()
        h.engine.reply_text = "<function=get_time>\n</function>"
        status, body = await h.post("/v1/chat/completions", _body(tool_choice="required"))
        assert status == 200 and body["choices"][0]["message"]["tool_calls"][0]["function"] == {
            "name": "get_time", "arguments": "{}"}, body
        request = next(iter(h.engine.requests.values()))
        assert request.assistant_prefix == "<tool_call>\n" and request.sampling.structured.kind == "xml_calls"
