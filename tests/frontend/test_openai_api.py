"""Pure validation: hostile bodies map to a 4xx naming the param; good ones to NewRequests."""

import json

import pytest

from mstar_actors.frontend import openai_api as api
from mstar_actors.messages import SamplingParams, choice_ids
from mstar_actors.sched.scheduler import choice_sampling

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": MSG} | fields).encode()


def comp(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi"} | fields).encode()


DEEP = b"[" * 10000 + b"]" * 10000
DEEP_OBJ = b'{"model": "tiny", "messages": ' + b'{"a":' * 10000 + b"1" + b"}" * 10000 + b"}"

# (parser, raw body, param named in the error)
BAD = [
    ("chat", b"", "body"),
    ("chat", b"{", "body"),
    ("chat", b"not json", "body"),
    ("chat", b"\xff\xfe\xfd", "body"),
    ("chat", b'{"messages": [{"role": "user", "content": "\xff"}]}', "body"),
    ("chat", b"[]", "body"),
    ("chat", b'"a string"', "body"),
    ("chat", b"null", "body"),
    ("chat", DEEP, "body"),
    ("chat", b'{"messages": [{"role": "user", "content": "\\ud800x"}]}', "body"),
    ("chat", DEEP_OBJ, "body"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "body"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', "body"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', "body"),
    ("chat", chat(messages=[]), "messages"),
    ("chat", chat(messages="hello"), "messages"),
    ("chat", chat(messages=None), "messages"),
    ("chat", json.dumps({"model": "tiny"}).encode(), "messages"),
    ("chat", chat(messages=[1]), "messages[0]"),
    ("chat", chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("chat", chat(messages=[{"content": "x"}]), "messages[0].role"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("chat", chat(messages=[{"role": "user"}]), "messages[0].content"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "audio", "audio": {"url": "x"}}]}]),
     "messages[0].content[0].type"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"uri": "x"}}]}]),
     "messages[0].content[0].image_url.uri"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]),
     "messages[0].content[0].image_url.url"),
    ("chat", chat(messages=[{"role": "user", "content": "x"},
                            {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                              {"type": "image_url", "image_url": "data:,"}]}],
                  continue_final_message=True, add_generation_prompt=False), "messages[1].content[1].image_url"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {"url": "x", "detail": "bogus"}}]}]),
     "messages[0].content[0].image_url.detail"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "video_url",
                                                          "video_url": {"url": "x", "detail": "low"}}]}]),
     "messages[0].content[0].video_url.detail"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": 5}]}]),
     "messages[0].content[0].video_url"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0].image_url"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "messages[0].content[0].text"),
    ("chat", chat(messages=[{"role": "user", "content": ["x"]}]), "messages[0].content[0]"),
    ("chat", chat(max_tokens=-1), "max_tokens"),
    ("chat", chat(max_tokens=0), "max_tokens"),
    ("chat", chat(max_tokens="10"), "max_tokens"),
    ("chat", chat(max_tokens=True), "max_tokens"),
    ("chat", chat(max_tokens=10**30), "max_tokens"),
    ("chat", chat(max_tokens=1.5), "max_tokens"),
    ("chat", chat(max_completion_tokens=-5), "max_completion_tokens"),
    ("chat", chat(temperature=-0.1), "temperature"),
    ("chat", chat(temperature=2.5), "temperature"),
    ("chat", chat(temperature="hot"), "temperature"),
    ("chat", chat(top_p=0), "top_p"),
    ("chat", chat(top_p=1.01), "top_p"),
    ("chat", chat(top_k=-2), "top_k"),
    ("chat", chat(top_k=0.5), "top_k"),
    ("chat", chat(min_p=-1), "min_p"),
    ("chat", chat(min_p=1.5), "min_p"),
    ("chat", chat(presence_penalty=3), "presence_penalty"),
    ("chat", chat(frequency_penalty=-2.01), "frequency_penalty"),
    ("chat", chat(repetition_penalty=0), "repetition_penalty"),
    ("chat", chat(repetition_penalty=-1), "repetition_penalty"),
    ("chat", chat(stop=5), "stop"),
    ("chat", chat(stop=[f"s{i}" for i in range(65)]), "stop"),
    ("chat", chat(stop=[""]), "stop"),
    ("chat", chat(stop=[1]), "stop"),
    ("chat", chat(stop="x" * 10000), "stop"),
    ("chat", chat(n=0), "n"),
    ("chat", chat(n=10**9), "n"),
    ("chat", chat(n=-1), "n"),
    ("chat", chat(seed="x"), "seed"),
    ("chat", chat(seed=2**70), "seed"),
    ("chat", chat(logprobs="yes"), "logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("chat", chat(top_logprobs=2), "top_logprobs"),
    ("chat", chat(stream="yes"), "stream"),
    ("chat", chat(stream_options={"include_usage": True}), "stream_options"),
    ("chat", chat(stream=True, stream_options=[1]), "stream_options"),
    ("chat", chat(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage"),
    ("chat", chat(model=7), "model"),
    ("chat", chat(user=["x"]), "user"),
    ("chat", chat(ignore_eos="no"), "ignore_eos"),
    ("chat", chat(stop_token_ids=[-1]), "stop_token_ids[0]"),
    ("completion", comp(prompt=None), "prompt"),
    ("completion", comp(prompt=""), "prompt"),
    ("completion", comp(prompt=[]), "prompt"),
    ("completion", comp(prompt=5), "prompt"),
    ("completion", comp(prompt={"text": "x"}), "prompt"),
    ("completion", comp(prompt=[1, "a"]), "prompt"),
    ("completion", comp(prompt=[[1, 2], "a"]), "prompt"),
    ("completion", comp(prompt=[[]]), "prompt"),
    ("completion", comp(prompt=[-1]), "prompt"),
    ("completion", comp(prompt=[10**6]), "prompt"),
    ("completion", comp(prompt=["x"] * 1000), "prompt"),
    ("completion", comp(prompt=[True, False]), "prompt"),
    ("completion", comp(logprobs=21), "logprobs"),  # (vLLM's max_logprobs: 20)
    ("completion", comp(logprobs=True), "logprobs"),
    ("completion", comp(best_of=3), "best_of"),
    ("chat", chat(use_beam_search=True), "use_beam_search"),
    ("chat", chat(unknown_field={"x": 1}), "unknown_field"),
    ("chat", chat(logit_bias={"x": 1}), "logit_bias"),
    ("chat", chat(logit_bias={"400": 1}), "logit_bias"),
    ("chat", chat(logit_bias={"5": 101}), "logit_bias"),
    ("chat", chat(allowed_token_ids=[400]), "allowed_token_ids[0]"),
    ("chat", chat(allowed_token_ids=[5, 6, -3]), "allowed_token_ids[2]"),  # which of a long list
    ("chat", chat(allowed_token_ids=[5, "6"]), "allowed_token_ids[1]"),
    ("chat", chat(min_tokens=-1), "min_tokens"),
    ("chat", chat(bad_words=[""]), "bad_words"),
    ("chat", chat(stream=True, stream_options={"continuous_usage_stats": 1}), "stream_options.continuous_usage_stats"),
    ("chat", chat(continue_final_message=True), "continue_final_message"),
    ("completion", comp(suffix="tail"), "suffix"),
    ("completion", comp(max_tokens=-3), "max_tokens"),
    ("completion", comp(max_tokens=257), "max_tokens"),
    ("completion", comp(prompt=["a"] * 20, n=26), "n"),  # 520 choices: past 4 x MAX_N
    ("chat", chat(metadata={"a": 1}), "metadata"),
    ("chat", chat(metadata="x"), "metadata"),
    ("chat", chat(store="yes"), "store"),
    ("chat", chat(service_tier=5), "service_tier"),
    ("completion", comp(priority="x"), "priority"),
    ("completion", comp(priority=1), "priority"),
    ("chat", chat(request_id=7), "request_id"),
    ("chat", chat(request_id=""), "request_id"),
    ("chat", chat(allowed_token_ids=[]), "allowed_token_ids"),
    ("chat", chat(length_penalty=True), "length_penalty"),
    ("chat", chat(use_beam_search=0), "use_beam_search"),
    ("chat", chat(messages=[{"role": "user", "content": "x", "foo": 1}]), "messages[0].foo"),
    ("chat", chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    ("chat", chat(messages=[{"role": "user", "content": "x", "name": 3}]), "messages[0].name"),
    ("chat", chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": 3}]),
     "messages[0].reasoning_content"),
]


def parse(kind: str, raw: bytes):
    if kind == "chat":
        return api.parse_chat(raw, max_model_len=256, vocab_size=400)
    return api.parse_completion(raw, max_model_len=256, vocab_size=400)


def test_there_are_enough_hostile_bodies():
    assert len(BAD) >= 50


@pytest.mark.parametrize("kind,raw,param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_body_is_a_400_naming_the_param(kind, raw, param):
    with pytest.raises(api.ApiError) as info:
        parse(kind, raw)
    err = info.value
    assert err.status == 400
    assert err.param == param
    envelope = err.envelope()["error"]
    assert set(envelope) == {"message", "type", "param", "code"}
    assert envelope["type"] == "invalid_request_error" and param in envelope["message"]


def test_chat_defaults_and_fields():
    parsed = api.parse_chat(chat(max_tokens=7, temperature=0, top_k=-1, stop="END", seed=3, n=2,
                                 logprobs=True, top_logprobs=2, user="u", metadata={"x": "1"}), max_model_len=256)
    assert parsed.sampling == SamplingParams(max_tokens=7, temperature=0.0, top_k=0, seed=3, logprobs=2)
    assert parsed.stop == ["END"] and parsed.n == 2 and parsed.logprobs == 2
    (req,) = parsed.new_requests("chatcmpl-x", "tiny", now=1.0)  # prepared once for both choices
    assert req.n == 2 and choice_ids(req.request_id, req.n) == ["chatcmpl-x-0-0", "chatcmpl-x-0-1"]
    assert [choice_sampling(req.sampling, i).seed for i in range(2)] == [3, 4]  # choices differ, yet reproduce
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"
    for count in (5, 64):  # past OpenAI's 4, as vLLM takes them
        stops = [f"s{i}" for i in range(count)]
        assert api.parse_chat(chat(stop=stops), max_model_len=256).stop == stops


def test_chat_max_tokens_defaults_to_the_context_and_prefers_max_completion_tokens():
    default = api.parse_chat(chat(), max_model_len=256).sampling
    assert (default.max_tokens, default.cut_to_context) == (256, True)  # cut to what the prompt leaves
    asked = api.parse_chat(chat(max_tokens=9, max_completion_tokens=5), 256).sampling
    assert (asked.max_tokens, asked.cut_to_context) == (5, False)  # the scheduler refuses it where it can't fit
    # completions' default of 16 counts as asked, as OpenAI's and vLLM's
    assert not api.parse_completion(comp(), 256).sampling.cut_to_context


def test_request_id_names_the_response_and_message_fields_reach_the_template():
    assert api.parse_chat(chat(request_id="my-req-1")).request_id == "my-req-1"
    msgs = [{"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": "yo", "reasoning_content": "think", "refusal": None,
             "annotations": [], "audio": None, "function_call": None}]
    user, assistant = api.parse_chat(chat(messages=msgs)).messages
    assert user.name == "ann" and assistant.reasoning_content == "think"
    from mstar_actors.frontend.tool_calls import template_tool_fields

    assert template_tool_fields(user) == {"name": "ann"}
    assert template_tool_fields(assistant) == {"reasoning_content": "think", "reasoning": "think"}  # as vLLM passes it


def test_reasoning_in_history_is_reasoning_content_under_vllm_s_new_name():
    """vLLM's responses name an assistant's reasoning ``reasoning`` now: a
    client sending such a message back as history gets it to the template."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sunny", "reasoning": "think"}]
    assert api.parse_chat(chat(messages=msgs)).messages[1].reasoning_content == "think"
    msgs[1]["reasoning_content"] = "think"  # both, the same: one
    assert api.parse_chat(chat(messages=msgs)).messages[1].reasoning_content == "think"
    msgs[1]["reasoning_content"] = "other"
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(chat(messages=msgs))
    assert info.value.param == "messages[1].reasoning"


@pytest.mark.parametrize("message, param", [
    ({"role": ["user"], "content": "x"}, "messages[0].role"),
    ({"role": {"a": 1}, "content": "x"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": ["wav"]}}]},
     "messages[0].content[0].input_audio.format"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": {}}}]},
     "messages[0].content[0].input_audio.format"),
])
def test_a_role_or_format_of_the_wrong_type_is_a_400_naming_it(message, param):
    """Was a 500 (an unhashable value looked up among the accepted ones)."""
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(chat(messages=[message]))
    assert info.value.status == 400 and info.value.param == param


def test_chat_roles_and_text_parts():
    msgs = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    parsed = api.parse_chat(chat(messages=msgs))
    assert [m.role for m in parsed.messages] == ["system", "system", "user", "assistant"]
    assert [p.text for p in parsed.messages[2].content] == ["a", "b"]


def test_chat_media_parts_pass_through_as_urls():
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             {"type": "video_url", "video_url": "file:///media/clip.mp4"}]  # vLLM also takes a bare string
    parsed = api.parse_chat(chat(messages=[{"role": "user", "content": parts}]))
    assert [(p.type, p.url) for p in parsed.messages[0].content[1:]] == [
        ("image_url", "data:image/png;base64,AA"), ("video_url", "file:///media/clip.mp4")]
    details = [{"type": "image_url", "image_url": {"url": "data:,", "detail": d}} for d in ("low", "high", "auto")]
    parsed = api.parse_chat(chat(messages=[{"role": "user", "content": details}]))
    assert [p.detail for p in parsed.messages[0].content] == ["low", "high", None]  # auto: the server's choice


def test_completion_prompts_and_choice_order():
    parsed = api.parse_completion(comp(prompt=["a", "b"], n=2, seed=10), vocab_size=400)
    reqs = parsed.new_requests("cmpl-x", "tiny")
    assert [(r.prompt, r.n) for r in reqs] == [("a", 2), ("b", 2)]
    assert [choice_sampling(r.sampling, i).seed for r in reqs for i in range(r.n)] == [10, 11, 10, 11]
    ids = api.parse_completion(comp(prompt=[[1, 2], [3]]), vocab_size=400).new_requests("c", "tiny")
    assert [r.prompt_token_ids for r in ids] == [[1, 2], [3]]
    assert api.parse_completion(comp(prompt=[5, 6])).prompts == [[5, 6]]
    assert api.parse_completion(comp()).sampling.max_tokens == 16
    assert api.parse_completion(comp(logprobs=20)).logprobs == 20  # vLLM's max_logprobs (OpenAI's legacy: 5)


def test_nulls_mean_absent_and_integral_floats_are_ints():
    parsed = api.parse_chat(chat(temperature=None, stop=None, n=2.0, max_tokens=None), max_model_len=64)
    assert parsed.sampling.temperature == 1.0 and parsed.n == 2 and parsed.sampling.max_tokens == 64


def test_stream_options():
    parsed = api.parse_chat(chat(stream=True, stream_options={"include_usage": True}))
    assert parsed.stream and parsed.include_usage


def test_error_types_by_status():
    assert api.ApiError(401, "x").error_type == "authentication_error"
    error = api.ApiError(404, "x", code="model_not_found").envelope()["error"]
    assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")  # OpenAI's pair
    assert api.ApiError(503, "x").error_type == "service_unavailable_error"


def test_models_list_shape():
    listed = api.models_list("tiny", 5, 256, ["lora-a"])
    assert listed["object"] == "list"
    base, lora = listed["data"]
    (permission,) = base.pop("permission")
    assert base == {"id": "tiny", "object": "model", "created": 5, "owned_by": "mstar-actors", "root": "tiny",
                    "parent": None, "max_model_len": 256}
    assert lora["id"] == "lora-a" and lora["parent"] == "tiny"
    # vLLM's card's permission, which clients that parse the card as vLLM's read
    assert permission["object"] == "model_permission" and permission["id"] == "modelperm-tiny"
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["allow_fine_tuning"]
    assert lora["permission"][0]["id"] == "modelperm-lora-a"


@pytest.mark.parametrize("raw, lone", [
    (rb'{"a": "x\ud800y"}', True), (rb'{"a": "x\ude00"}', True), (rb'{"a": "12\udc00"}', True),
    (rb'{"a": "\ud83d\ude00"', False),  # a pair, in a body cut short: truncated, as it is
    (rb'{"a": "write \\ud800 in JSON",}', False),  # an escaped backslash, then text: the comma is the fault
])
def test_a_lone_surrogate_escape_is_named_as_such(raw, lone):
    """msgspec calls a lone surrogate escape "truncated": the 400 says what it is."""
    with pytest.raises(api.ApiError) as info:
        api.decode_body(raw)
    assert info.value.status == 400 and info.value.param == "body"
    assert ("lone UTF-16 surrogate" in str(info.value)) == lone
    assert api.decode_body(rb'{"a": "\ud83d\ude00"}') == {"a": "\U0001f600"}


def test_a_cap_past_the_whole_context_is_context_length_exceeded():
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(api.ApiError) as info:
            api.parse_chat(chat(**{name: 5000}), 2048)
        assert (info.value.param, info.value.code) == (name, "context_length_exceeded")
        assert "2048" in info.value.message and "max_model_len" in info.value.message
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(chat(bogus=1))
    assert "taken and ignored" in info.value.message and "request_id" in info.value.message


def test_reasoning_effort_is_a_template_variable_as_vllm_passes_it():
    assert api.parse_chat(chat(reasoning_effort="high")).chat_template_kwargs == {"reasoning_effort": "high"}
    both = chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high", "x": 1})
    assert api.parse_chat(both).chat_template_kwargs == {"reasoning_effort": "high", "x": 1}  # the kwargs' own
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(chat(reasoning_effort="extreme"))
    assert info.value.param == "reasoning_effort" and "low, medium, high" in info.value.message
    with pytest.raises(api.ApiError) as info:  # a completion has no template to read it
        api.parse_completion(json.dumps({"model": "m", "prompt": "x", "reasoning_effort": "low"}).encode())
    assert info.value.param == "reasoning_effort"


def test_chat_template_kwargs_are_taken_and_the_template_call_s_own_names_refused():
    """vLLM's field (many clients send ``enable_thinking`` to every model):
    was refused unless empty."""
    assert api.parse_chat(chat(chat_template_kwargs={"enable_thinking": False})).chat_template_kwargs == {
        "enable_thinking": False}
    assert api.parse_chat(chat(chat_template_kwargs={})).chat_template_kwargs is None
    req = api.parse_chat(chat(chat_template_kwargs={"x": [1]})).new_requests("c", "m")[0]
    assert req.chat_template_kwargs == {"x": [1]}
    for value, param in [({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                         ({"tools": []}, "chat_template_kwargs.tools"), ([1], "chat_template_kwargs"),
                         ("x", "chat_template_kwargs")]:
        with pytest.raises(api.ApiError) as info:
            api.parse_chat(chat(chat_template_kwargs=value))
        assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("fields", [
    {"verbosity": "medium"}, {"stream": True, "stream_options": {"include_obfuscation": False}},
    {"reasoning_effort": "xhigh"}, {"reasoning_effort": "max"}, {"prompt_cache_retention": "24h"},
    {"prompt_cache_options": {}}, {"service_tier": "fast"}, {"functions": []}, {"function_call": "none"},
    {"documents": []}, {"logits_processors": []}, {"vllm_xargs": {}}, {"kv_transfer_params": {}},
    {"media_io_kwargs": {}}, {"truncation_side": "left"}, {"truncation_side": "right"}, {"stream_interval": 1},
    {"structured_outputs": {"regex": "a+", "disable_additional_properties": False}},
    {"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": True,  # xgrammar's reading
                            "disable_any_whitespace": False, "disable_fallback": True}},
])
def test_what_clients_send_that_changes_nothing_here_is_taken(fields):
    """OpenAI's defaults and newest values, and vLLM's fields at their neutral value (the SDKs, LangChain
    send them): a 400 broke such a client for nothing."""
    assert api.parse_chat(chat(**fields)) is not None


@pytest.mark.parametrize("fields, param", [
    ({"verbosity": "low"}, "verbosity"), ({"truncation_side": "middle"}, "truncation_side"),
    ({"stream_interval": 0}, "stream_interval"), ({"functions": [{"name": "f"}]}, "functions"),
    ({"stream": True, "stream_options": {"include_obfuscation": 1}}, "stream_options.include_obfuscation"),
    ({"prompt_cache_options": "x"}, "prompt_cache_options"), ({"verbosity": "loud"}, "verbosity"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"prompt_cache_retention": 24}, "prompt_cache_retention"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": "yes"}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": 1}}, "structured_outputs.disable_fallback"),
])
def test_their_other_values_change_the_output_and_are_refused_by_name(fields, param):
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(chat(**fields))
    assert info.value.param == param and info.value.status == 400
