"""``/v1/responses``: the Responses body read as its chat, the chat stream's chunks as its events, and the
route served by the real frontend actor (stream and not, their agreement, errors named by the body's fields)."""

import asyncio
import json

import pytest

from mstar_actors.frontend.openai_api import ApiError
from mstar_actors.frontend.responses_api import ResponseEvents, read_responses
from tests.frontend.conftest import REPLY
from tests.frontend.test_frontend_actor import run

TOOL = {"type": "function", "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


IMAGE = "data:image/png;base64,AA"


def read(**body):
    return read_responses(json.dumps({"model": "tiny", **body}).encode())


def refusal(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        read(**body)
    return info.value


def test_a_string_input_is_one_user_message_after_the_instructions():
    asked = read(input="hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5)
    assert asked.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert asked.chat["max_tokens"] == 7 and asked.chat["temperature"] == 0.5 and not asked.stream


def test_items_make_the_turns_an_assistant_s_calls_in_one_message():
    asked = read(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"},
                                     {"type": "input_image", "image_url": IMAGE, "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
    ], tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    user, assistant, out1, out2, again = asked.chat["messages"]
    assert user["content"][1] == {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}}
    assert assistant["reasoning"] == "look" and assistant["content"] == [{"type": "text", "text": "Let me see."}]
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert (out1["role"], out1["tool_call_id"], out1["content"]) == ("tool", "c1", "sunny")
    assert out2["content"] == [{"type": "text", "text": "rain"}]
    assert again == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert asked.chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert asked.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_an_earlier_responses_output_items_are_taken_back_whole():
    """Items as the client's types write them (a response's output dumped with its null fields): the keys
    that change no reply are taken."""
    asked = read(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi", "prompt_cache_breakpoint": None}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "phase": None,
         "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed",
         "caller": None, "namespace": None, "async_": None},
        {"type": "function_call_output", "call_id": "c1", "output": "ok", "id": None, "caller": None, "name": None,
         "status": None},
    ])
    assert [m["role"] for m in asked.chat["messages"]] == ["user", "assistant", "tool"]
    assert asked.chat["messages"][1]["tool_calls"][0]["id"] == "c1"


def test_an_output_answers_a_call_before_it():
    """OpenAI's rule: a function_call_output whose call_id no function_call before it made is a 400 naming
    it (one answered a call that never was, and the reply read it as a tool's result)."""
    err = refusal(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert err.param == "input[0].call_id" and "'nope'" not in err.message and '"nope"' in err.message, err
    err = refusal(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    assert err.param == "input[0].call_id", err


def test_input_items_are_kept_in_openai_s_shapes():
    """GET .../input_items lists the SDK's item types: a message's text as its parts (an assistant's
    output_text), each item with a status; the tier a response ran in is the one served."""
    asked = read(input=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "ok", "status": "completed"}],
                 store=True, service_tier="priority")
    assert asked.items == []  # no store: nothing listed
    from mstar_actors.frontend.response_store import ResponseStore

    asked = read_responses(json.dumps({"model": "tiny", "input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}], "service_tier": "priority"}).encode(),
        ResponseStore(1 << 20))
    user, assistant, call, output = asked.items
    assert user["content"] == [{"type": "input_text", "text": "a"}] and user["status"] == "completed"
    assert assistant["content"] == [{"type": "output_text", "text": "b", "annotations": []}]
    assert call["status"] == output["status"] == "completed"
    assert asked.echo["service_tier"] == "default"
    again = read_responses(json.dumps({"model": "tiny", "input": asked.items}).encode())  # the list taken back
    assert [m["role"] for m in again.chat["messages"]] == ["user", "assistant", "tool"]


def test_top_logprobs_alone_computes_none():
    """As OpenAI's: the alternatives' count counts where the logprobs are included."""
    asked = read(input="x", top_logprobs=2)
    assert "logprobs" not in asked.chat and "top_logprobs" not in asked.chat
    assert refusal(input="x", top_logprobs=99).param == "top_logprobs"


def test_format_and_logprobs_map_to_the_chat_fields():
    schema = {"type": "object"}
    asked = read(input="x", text={"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}},
                 include=["message.output_text.logprobs"], top_logprobs=3, reasoning={"effort": "low"})
    assert asked.chat["response_format"] == {"type": "json_schema",
                                             "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert asked.chat["logprobs"] is True and asked.chat["top_logprobs"] == 3
    assert asked.chat["reasoning_effort"] == "low"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # nothing is stored
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "low", "bogus": 1}}, "reasoning.bogus"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"type": "reasoning", "content": [], "encrypted_content": "x"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "hi"}]}, "input[1]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]}, "input[1]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]"),  # a part, not a string
    ({"input": "x", "n": 2}, "n"),  # unknown here (no choices in a Response)
    # this route's shapes, not chat's, in what it accepts
    ({"tool_choice": "any"}, "tool_choice"),
    ({"text": {"format": {"type": "json_object", "name": "x"}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "json_schema": {}}}}, "text.format.json_schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body, param):
    err = refusal(**({"input": "x"} | body))
    assert err.status == 400 and err.param == param and err.message.startswith(param), err.message
    assert '"function": {' not in err.message and '"json_schema": {' not in err.message  # chat's shapes


def test_the_chat_paths_errors_are_named_by_the_body_s_fields():
    asked = read(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                 tools=[TOOL], instructions="s")
    calls = read(input=[{"role": "user", "content": "a"},
                        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1]"},
                        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[2]"},
                        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text",
                                                                                      "text": "x"}]}])
    for chat, own in [("messages[1].tool_calls[0].function.arguments", "input[1].arguments"),
                      ("messages[1].tool_calls[1].function.arguments", "input[2].arguments"),
                      ("messages[2].content[0].text", "input[3].output[0].text")]:
        assert calls.renamed(ApiError(400, f"{chat}: wrong", param=chat)).param == own
    for chat, own in [("messages[2].content", "input[1].content"), ("messages[0]", "instructions"),
                      ("max_tokens", "max_output_tokens"), ("tools[0].function.parameters", "tools[0].parameters"),
                      ("response_format.json_schema.schema", "text.format.schema"), ("messages", "input"),
                      ("temperature", "temperature")]:
        err = asked.renamed(ApiError(400, f"{chat}: wrong", param=chat))
        assert (err.param, err.message) == (own, f"{own}: wrong")
    # chat's words for what this body names otherwise
    cap = asked.renamed(ApiError(400, "max_tokens is 9, too many", param="max_tokens"))
    assert cap.message == "max_output_tokens is 9, too many"
    for chat, own in [("response_format", "text.format"), ("response_format.json_schema.schema", "text.format.schema")]:
        forced = asked.renamed(ApiError(400, f"tool_choice: it cannot be combined with {chat}", param="tool_choice"))
        assert forced.message == f"tool_choice: it cannot be combined with {own}"
    image = asked.renamed(ApiError(400, "this model reads text only; image_url parts are for ...",
                                   param="messages[1].content[0].image_url"))
    assert image.param == "input[0].content[0]"
    assert image.message == "input[0].content[0]: this model reads text only; input_image parts are for ..."


def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
    return {"index": 0, "delta": delta, "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": logprobs}}


def test_events_open_and_close_each_output_item_in_order():
    events = ResponseEvents("resp_1", "tiny", 0, {"tools": []}, {"temperature": 1.0, "top_p": 1.0})
    out = events.start()
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    for c in (chunk({"reasoning": "think"}), chunk({"reasoning": "ing"}), chunk({"content": "Hi"}, logprobs=[entry]),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
              chunk({}, "tool_calls")):
        out += events.chunk(c)
    out += events.end({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                       "prompt_tokens_details": {"cached_tokens": 2}}, reasoning_tokens=3)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    final = out[-1]["response"]
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert message["content"] == [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": [entry]}]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == ("call_1", "f", '{"a": 1}',
                                                                                 "completed")
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert out[2]["item"]["content"] == [] and out[10]["item_id"] == message["id"]
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                              "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 14}
    assert final["status"] == "completed" and final["incomplete_details"] is None


def test_a_token_whose_text_is_held_gives_its_logprobs_with_the_text_that_completes_it():
    """A character of two byte tokens comes as a chunk of no text (the first's entry), then its text: both
    entries with it (the first was dropped: 6 entries of 16 tokens for Chinese text); an end's EOS entry none."""
    events = ResponseEvents("resp_1", "tiny", 0, {}, {})
    events.start()
    first, second, eos = ({"token": t, "logprob": -0.1, "bytes": b, "top_logprobs": []}
                          for t, b in (("\ufffd", [230]), ("\ufffd", [176, 180]), ("", [])))
    out = events.chunk(chunk({}, logprobs=[first])) + events.chunk(chunk({"content": "水"}, logprobs=[second]))
    out += events.chunk(chunk({}, "stop", logprobs=[eos]))
    [delta] = [e for e in out if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == [first, second] and bytes(first["bytes"] + second["bytes"]).decode() == "水"
    final = events.end({"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}, 0)[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == [first, second]
    # a call's markup tokens, held then written as the call (a chunk of no text, then its delta): not the next text's
    events = ResponseEvents("resp_2", "tiny", 0, {}, {})
    events.start()
    markup, done = ({"token": t, "logprob": -0.1, "bytes": list(t.encode()), "top_logprobs": []}
                    for t in ("<tool_call>", "Done."))
    events.chunk(chunk({}, logprobs=[markup]))
    events.chunk(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]}))
    [delta] = [e for e in events.chunk(chunk({"content": "Done."}, logprobs=[done]))
               if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == [done], delta


def test_a_reply_the_cap_cut_is_incomplete():
    events = ResponseEvents("resp_1", "tiny", 0, {}, {})
    events.start()
    events.chunk(chunk({"content": "Hel"}, "length"))
    last = events.end({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, 0)
    assert last[-1]["type"] == "response.incomplete"
    assert last[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last[-1]["response"]["output"][0]["status"] == "incomplete"


RESPONSES = "/v1/responses"


def sse_events(raw: bytes) -> list[dict]:
    """A Responses stream: each event's ``event:`` line names the type its data holds."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == kind[len("event: "):]
    return events


async def post_stream(h, body: dict) -> tuple[int, bytes]:
    async with h.session.post(h.url + RESPONSES, json=body | {"stream": True}) as r:
        return r.status, await r.read()


def test_the_route_answers_a_response_and_its_stream_agrees(harness):
    async def body():
        async with harness() as h:
            req = {"model": "tiny", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 50}
            status, r = await h.post(RESPONSES, req)
            assert status == 200, r
            assert r["object"] == "response" and r["id"].startswith("resp_") and r["status"] == "completed"
            (message,) = r["output"]
            assert message["content"][0]["text"] == REPLY and message["role"] == "assistant"
            assert r["usage"]["output_tokens"] > 0 and r["instructions"] == "Be brief." and r["store"] is False
            from openai.types.responses import Response

            Response.model_validate(r)  # the client's own type, strictly: its usage needs cache_write_tokens
            status, named = await h.post(RESPONSES, req | {"request_id": "resp_mine"})  # vLLM's, as sent
            assert named["id"] == "resp_mine"
            sent = h.engine.requests[next(iter(h.engine.requests))]
            assert [m.role for m in sent.messages] == ["system", "user"] and sent.sampling.max_tokens == 50
            status, raw = await post_stream(h, req)
            assert status == 200
            events = sse_events(raw)
            assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY
            final = events[-1]["response"]
            assert events[-1]["type"] == "response.completed"
            assert [o["content"] for o in final["output"]] == [message["content"]]
            assert final["usage"] == r["usage"]

    run(body)


def test_a_named_tool_is_answered_as_a_function_call(harness):
    async def body():
        async with harness() as h:
            h.engine.reply_text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'  # (llama3_json)
            req = {"model": "tiny", "input": "weather?", "tools": [TOOL],
                   "tool_choice": {"type": "function", "name": "get_weather"}}
            status, r = await h.post(RESPONSES, req)
            assert status == 200, r
            (call,) = r["output"]
            assert call["type"] == "function_call" and call["name"] == "get_weather"
            assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"]
            status, raw = await post_stream(h, req)
            events = sse_events(raw)
            (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
            assert json.loads(done["arguments"]) == {"city": "Paris"}
            assert events[-1]["response"]["output"][0]["arguments"] == done["arguments"]

    run(body)


def test_errors_name_the_responses_fields(harness):
    async def body():
        async with harness() as h:
            for req, param in [({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
                               ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
                                "input[0].content[0].text"),
                               ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                               ({"input": "x", "stream": True, "text": {"format": {"type": "yaml"}}},
                                "text.format.type")]:
                status, r = await h.post(RESPONSES, {"model": "tiny"} | req)
                assert status == 400 and r["error"]["param"] == param, r
                assert r["error"]["message"].startswith(param), r
            # the engine's refusal after the request left (the prompt's length, the scheduler's)
            status, r = await h.post(RESPONSES, {"model": "tiny", "input": "word " * 5000})
            assert status == 400 and r["error"]["code"] == "context_length_exceeded", r

    run(body)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(harness):
    async def body():
        from mstar_actors.messages import Failed, SampledToken, TokenDelta

        async with harness() as h:
            h.engine.plan = lambda req: None  # held: the test answers
            posting = asyncio.create_task(post_stream(h, {"model": "tiny", "input": "x"}))
            await h.engine.wait_for(lambda: h.engine.requests)
            (req,) = h.engine.requests.values()
            rid = h.engine.choice_ids(req)[0]
            await h.engine.send(TokenDelta(request_id=rid, tokens=[SampledToken(rid, 28)], num_prompt_tokens=3))
            await h.engine.send(Failed(request_id=rid, status=400, message="max_tokens: too many", param="max_tokens"))
            status, raw = await posting
            events = sse_events(raw)
            assert status == 200 and events[0]["type"] == "response.created"
            assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
            assert events[-2]["param"] == "max_output_tokens" and "max_output_tokens: too many" in events[-2]["message"]
            assert events[-1]["response"]["status"] == "failed"

    run(body)


def test_the_store_keeps_responses_in_its_bytes_and_lists_their_input_items():
    from mstar_actors.frontend.response_store import ResponseStore, input_items_page

    store = ResponseStore(max_bytes=1200)  # two of these conversations
    items = [{"type": "message", "id": f"msg_{i}", "role": "user", "content": "x" * 100} for i in range(3)]
    out = [{"type": "message", "id": "msg_out", "role": "assistant", "content": []}]
    assert store.put({"id": "resp_a", "output": out}, items)
    assert store.conversation("resp_a") == [*items, *out]
    assert store.put({"id": "resp_b", "output": []}, items)
    store.get("resp_a")  # used: resp_b is now the least recently used
    assert store.put({"id": "resp_c", "output": []}, items)
    assert store.get("resp_b") is None and store.get("resp_a") is not None and store.nbytes <= 1200
    assert not store.put({"id": "resp_big", "output": []}, items * 20)  # alone past the store: not kept
    assert store.pop("resp_a") and not store.pop("resp_a")
    page = input_items_page(items, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["msg_2", "msg_1"] and page["has_more"] and page["last_id"] == "msg_1"
    page = input_items_page(items, {"limit": "2", "after": "msg_1"})
    assert [i["id"] for i in page["data"]] == ["msg_0"] and not page["has_more"]
    assert input_items_page(items, {"order": "asc"})["first_id"] == "msg_0"
    for query, param in (({"after": "nope"}, "after"), ({"limit": "0"}, "limit"), ({"limit": "-3"}, "limit"),
                         ({"limit": "101"}, "limit"), ({"order": "up"}, "order")):
        with pytest.raises(ApiError) as info:
            input_items_page(items, query)
        assert info.value.param == param and info.value.status == 400


def test_previous_response_id_continues_a_stored_conversation(harness):
    """OpenAI's store (``server.responses_store_mib``): the next request follows the stored input and output
    (the earlier instructions not carried over); GET, input_items and DELETE read it; store false keeps none."""
    async def body():
        async with harness(responses_store_mib=1) as h:
            first = {"model": "tiny", "input": "Hi", "instructions": "Be brief."}
            status, r = await h.post(RESPONSES, first)
            assert status == 200 and r["store"] is True, r
            status, raw = await post_stream(h, {"model": "tiny", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}],
                "previous_response_id": r["id"]})
            second = sse_events(raw)[-1]["response"]
            assert status == 200 and second["previous_response_id"] == r["id"], second
            sent = list(h.engine.requests.values())[-1]
            assert [(m.role, m.content if isinstance(m.content, str) else m.content[0].text)
                    for m in sent.messages] == [("user", "Hi"), ("assistant", REPLY), ("user", "And then?")]
            async with h.session.get(f"{h.url}/v1/responses/{second['id']}") as resp:
                assert resp.status == 200 and await resp.json() == second
            async with h.session.get(f"{h.url}/v1/responses/{second['id']}/input_items?order=asc") as resp:
                listed = await resp.json()
            assert [(i["type"], i.get("role")) for i in listed["data"]] == [
                ("message", "user"), ("message", "assistant"), ("message", "user")]
            assert all(i["id"] for i in listed["data"]) and listed["has_more"] is False
            async with h.session.delete(f"{h.url}/v1/responses/{r['id']}") as resp:
                assert resp.status == 200 and (await resp.json())["deleted"] is True
            status, gone = await h.post(RESPONSES, {"model": "tiny", "input": "x", "previous_response_id": r["id"]})
            assert status == 400 and gone["error"]["code"] == "previous_response_not_found", gone
            status, r = await h.post(RESPONSES, first | {"store": False})
            assert r["store"] is False
            async with h.session.get(f"{h.url}/v1/responses/{r['id']}") as resp:
                assert resp.status == 404
        async with harness() as h:  # no store: a 404 saying how to keep them
            async with h.session.get(f"{h.url}/v1/responses/resp_x") as resp:
                assert resp.status == 404 and "responses_store_mib" in (await resp.json())["error"]["message"]

    run(body)


def test_vllm_s_responses_fields_reach_the_chat_it_asks_for():
    """vLLM's Responses request takes these of its chat's sampling: a 400 "unknown field" refused them."""
    fields = {"skip_special_tokens": False, "stop_token_ids": [5], "include_stop_str_in_output": True,
              "include_reasoning": False, "structured_outputs": {"regex": "a+"}, "prompt_cache_options": {}}
    asked = read(input="x", **fields)
    assert {k: asked.chat[k] for k in fields} == fields
    from mstar_actors.frontend import openai_api as api

    parsed = api.parse_chat(json.dumps(asked.chat).encode())
    assert list(parsed.sampling.stop_token_ids) == [5] and parsed.sampling.structured.kind == "regex"


def test_a_stored_cut_call_continues_and_an_id_is_never_taken_twice():
    """A stored call whose arguments are no JSON object (the output cap cut it) is continued, answered or
    not, as a call of arguments {}: the server refused a conversation of its own output, naming a chat field
    (previous_response_id.tool_calls[0].function.arguments) the client never sent. A client's request_id may
    not replace a kept response."""
    from mstar_actors.frontend import openai_api as api
    from mstar_actors.frontend.response_store import ResponseStore

    store = ResponseStore(1 << 20)
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get", "arguments": '{"',
            "status": "incomplete"}
    whole = {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "get", "arguments": '{"a": 1}'}
    assert store.put({"id": "resp_cut", "output": [call, whole]}, [{"type": "message", "id": "msg_1",
                                                                    "role": "user", "content": "weather?"}])
    for given in ("Try again", [{"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": None}]):
        asked = read_responses(json.dumps({"model": "tiny", "previous_response_id": "resp_cut",
                                           "input": given}).encode(), store)
        calls = api.parse_chat(json.dumps(asked.chat).encode()).messages[1].tool_calls
        assert [(c.id, c.arguments) for c in calls] == [("call_1", "{}"), ("call_2", '{"a": 1}')]
    assert all(isinstance(item["id"], str) and item["id"] for item in asked.items)  # a null id given one
    # a stored turn's field is named by the id that brought it in (no chat path of it)
    assert asked.renamed(ApiError(400, "messages[1].content: bad", param="messages[1].content")).param == \
        "previous_response_id"
    assert read_responses(json.dumps({"model": "tiny", "input": "x", "request_id": "resp_cut"}).encode(),
                          store).store is False  # taken: the first keeps it
    assert not store.put({"id": "resp_cut", "output": []}, [])


def test_a_response_past_the_whole_store_says_it_was_not_kept(harness):
    async def body():
        from mstar_actors.frontend.response_store import ResponseStore

        async with harness(responses_store_mib=1) as h:
            h.actor.responses = ResponseStore(max_bytes=300)  # less than any one response
            for stream in (False, True):
                if stream:
                    status, raw = await post_stream(h, {"model": "tiny", "input": "Hi"})
                    r = sse_events(raw)[-1]["response"]
                else:
                    status, r = await h.post(RESPONSES, {"model": "tiny", "input": "Hi"})
                assert status == 200 and r["store"] is False, r
                async with h.session.get(f"{h.url}/v1/responses/{r['id']}") as resp:
                    assert resp.status == 404

    run(body)
