"""Every body field is implemented, ignored as OpenAI ignores it, or a 400 naming it."""

import json

import pytest

from mstar_actors.frontend import openai_api as api

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> bytes:
    return json.dumps({"model": "tiny", "messages": MSG} | kw).encode()


def comp(**kw) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi"} | kw).encode()


def refused(raw: bytes, kind: str = "chat") -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        (api.parse_chat if kind == "chat" else api.parse_completion)(raw, 256, 400)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("name", sorted(api.IGNORED_FIELDS))
def test_fields_that_change_nothing_are_accepted(name):
    value = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "priority": 0,
             "prediction": {"type": "content", "content": [{"type": "text", "text": "x"}]},
             "spaces_between_special_tokens": False, "prompt_cache_options": {}, "verbosity": "medium",
             "prompt_cache_retention": "24h"}.get(name, "x")
    api.parse_chat(chat(**{name: value}), 256, 400)
    api.parse_completion(comp(**{name: value}), 256, 400)


@pytest.mark.parametrize("name,value", [("use_beam_search", True), ("suffix", "tail"),
                                        ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
                                        ("length_penalty", 0.5), ("early_stopping", 0)])
def test_fields_that_would_change_the_output_are_refused_by_name(name, value):
    err = refused(chat(**{name: value}))
    assert err.param == name and "not supported" in err.message


@pytest.mark.parametrize("name,value", [("use_beam_search", False), ("suffix", ""), ("modalities", ["text"]),
                                        ("prompt_logprobs", None),
                                        ("length_penalty", 1), ("length_penalty", 1.0)])
def test_refused_fields_at_their_neutral_value_change_nothing_and_pass(name, value):
    api.parse_chat(chat(**{name: value}), 256, 400)


@pytest.mark.parametrize("name,value,message", [
    ("prediction", {"type": "content"}, 'expected {"type": "content"'),
    ("prediction", "x", 'expected {"type": "content"'),
    ("spaces_between_special_tokens", 1, "expected true or false"),
    ("logit_bias", {"9" * 5000: 1}, "is not a token id in [0, 400)"),  # its length first: int() takes 4300 digits
    ("min_tokens", 20, "at most the output's cap (max_tokens=16, the default), got 20"),
])
def test_a_wrong_value_of_a_field_is_a_400_naming_it(name, value, message):
    err = refused(comp(**{name: value}), "completion")
    assert err.param == name and message in err.message, err.message


def test_a_logit_bias_key_may_have_leading_zeros_and_min_tokens_names_the_cap_that_rules():
    assert api.parse_chat(chat(logit_bias={"0000000001": 5}), 256, 400).sampling.logit_bias == ((1, 5.0),)
    err = refused(chat(max_tokens=100, max_completion_tokens=10, min_tokens=50))
    assert "(max_completion_tokens=10)" in err.message, err.message


def test_a_repetition_penalty_takes_any_positive_number_as_vllm_does():
    assert api.parse_chat(chat(repetition_penalty=2.5), 256, 400).sampling.repetition_penalty == 2.5
    for bad in (0, -1, "2"):
        assert refused(chat(repetition_penalty=bad)).param == "repetition_penalty"


def test_add_special_tokens_defaults_to_each_endpoints_own_and_is_taken():
    """vLLM's defaults: a chat prompt is the template's text as it is, a completion prompt gets the BOS; either
    may ask otherwise (a templated text sent as a completion prompt, a template that writes no BOS)."""
    assert not api.parse_chat(chat(), 256, 400).add_special_tokens
    assert api.parse_completion(comp(), 256, 400).add_special_tokens
    assert api.parse_chat(chat(add_special_tokens=True), 256, 400).new_requests("r", "m")[0].add_special_tokens
    assert api.parse_completion(comp(add_special_tokens=False), 256, 400).new_requests("r", "m")[0] \
        .add_special_tokens is False
    assert refused(comp(add_special_tokens="no"), "completion").param == "add_special_tokens"


def test_an_assistant_refusal_part_is_its_text():
    msgs = MSG + [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}] + MSG
    assert api.parse_chat(chat(messages=msgs), 256, 400).messages[1].content[0].text == "I can't."
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]
    assert refused(chat(messages=user_refusal)).param == "messages[0].content[0].type"


def test_an_unknown_field_is_refused_naming_it_and_the_accepted_ones():
    err = refused(chat(temprature=0.5))
    assert err.param == "temprature" and "accepted:" in err.message and "temperature" in err.message
    assert refused(comp(messages=MSG), "completion").param == "messages"  # a chat field is unknown here
    assert refused(chat(prompt="x")).param == "prompt"
    assert refused(chat(best_of=1)).param == "best_of"  # a completion's field
    assert refused(chat(echo="yes")).param == "echo"  # chat's echo (vLLM's) is true or false


def test_fields_owned_by_structured_outputs_and_tools_are_one_list_each():
    # parsed by the structured-output and tool-calling parsers, not refused as unknown
    for name in api.STRUCTURED_FIELDS | api.TOOL_FIELDS:
        assert name in api.accepted_fields("chat")
    assert not api.TOOL_FIELDS & api.accepted_fields("completion")


def test_sampling_fields_reach_sampling_params():
    parsed = api.parse_chat(chat(logit_bias={"5": 10, "3": -100}, allowed_token_ids=[1, 2], min_tokens=4,
                                 bad_words=["foo"], stop_token_ids=[9], truncate_prompt_tokens=8, max_tokens=20),
                            256, 400)
    s = parsed.sampling
    assert s.logit_bias == ((3, -100.0), (5, 10.0)) and s.allowed_token_ids == (1, 2)
    assert s.min_tokens == 4 and s.truncate_prompt_tokens == 8 and parsed.bad_words == ["foo"]
    parsed.with_token_facts((7,), [[11, 12]])
    assert parsed.sampling.min_token_stop_ids == (7, 9) and parsed.sampling.bad_words_token_ids == ((11, 12),)
    # vLLM's -1: the model's context
    assert api.parse_chat(chat(truncate_prompt_tokens=-1), 256, 400).sampling.truncate_prompt_tokens == 256
    assert api.parse_completion(b'{"prompt": "hi", "truncate_prompt_tokens": -1}', 300).sampling \
        .truncate_prompt_tokens == 300


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_thinking_budget_takes_the_think_ids_or_names_why_it_cannot(kind):
    """vLLM's thinking_token_budget: a count of at least 0; it counts by the model's <think> and </think>
    tokens, which the frontend gives (none: a 400 saying what the model lacks)."""
    raw = (chat if kind == "chat" else comp)(thinking_token_budget=0)
    parsed = (api.parse_chat if kind == "chat" else api.parse_completion)(raw, 256, 400)
    assert parsed.sampling.thinking_budget == 0
    parsed.with_token_facts((7,), [], (20, 21))
    assert parsed.sampling.think_ids == (20, 21)
    with pytest.raises(api.ApiError) as info:
        parsed.with_token_facts((7,), [], None)
    assert info.value.param == "thinking_token_budget" and "model.reasoning_parser" in info.value.message
    plain = api.parse_chat(chat(), 256, 400)
    plain.with_token_facts((7,), [], (20, 21))
    assert plain.sampling.thinking_budget is None and plain.sampling.think_ids == ()
    for value in (-1, 1.5, True, "8"):
        err = refused((chat if kind == "chat" else comp)(thinking_token_budget=value), kind)
        assert err.param == "thinking_token_budget", value
    # a completion's constraint holds from its first token, which the forced </think> would break (chat's after it)
    format_ = {"type": "json_object"}
    if kind == "completion":
        err = refused(comp(thinking_token_budget=4, response_format=format_), kind)
        assert err.param == "thinking_token_budget" and "response_format" in err.message, err.message
    else:
        assert api.parse_chat(chat(thinking_token_budget=4, response_format=format_), 256, 400).sampling.structured


def test_min_tokens_with_ignore_eos_masks_only_the_stop_tokens():
    parsed = api.parse_chat(chat(min_tokens=2, ignore_eos=True, stop_token_ids=[9]), 256, 400)
    parsed.with_token_facts((7,), [])
    assert parsed.sampling.min_token_stop_ids == (9,)
    parsed = api.parse_chat(chat(), 256, 400)
    parsed.with_token_facts((7,), [])
    assert parsed.sampling.min_token_stop_ids == ()  # nothing to mask, so no processor runs


@pytest.mark.parametrize("body,param", [
    (chat(logit_bias={"-1": 1}), "logit_bias"), (chat(logit_bias={"1.5": 1}), "logit_bias"),
    (chat(logit_bias={"1": "x"}), "logit_bias"), (chat(logit_bias={"1": -100.5}), "logit_bias"),
    (chat(logit_bias=[1]), "logit_bias"), (chat(allowed_token_ids=[-1]), "allowed_token_ids[0]"),
    (chat(allowed_token_ids="1"), "allowed_token_ids"), (chat(min_tokens=30, max_tokens=20), "min_tokens"),
    (chat(bad_words="foo"), "bad_words"), (chat(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (chat(truncate_prompt_tokens=401), "truncate_prompt_tokens"),  # past max_model_len (vLLM's refusal)
    (chat(skip_special_tokens="no"), "skip_special_tokens"), (chat(return_token_ids=1), "return_token_ids"),
    (chat(include_stop_str_in_output="y"), "include_stop_str_in_output"),
    (chat(stream=True, stream_options={"bogus": True}), "stream_options.bogus"),
    (chat(messages=MSG, add_generation_prompt=True, continue_final_message=True), "continue_final_message"),
])
def test_invalid_values_are_a_400_naming_the_field(body, param):
    assert refused(body).param == param


def test_best_of_equal_to_n_is_accepted_and_echo_with_logprobs_asks_the_prompts():
    parsed = api.parse_completion(comp(best_of=2, n=2, echo=True), 256, 400)
    assert parsed.output.echo and parsed.n == 2 and parsed.sampling.prompt_logprobs is None
    assert api.parse_completion(comp(echo=True, logprobs=3), 256, 400).sampling.prompt_logprobs == 3
    assert api.parse_completion(comp(logprobs=3), 256, 400).sampling.prompt_logprobs is None
    # vLLM's prompt_logprobs: asked of the engine, the larger of the two where echo asks too
    assert api.parse_completion(comp(echo=True, logprobs=1, prompt_logprobs=4), 256, 400).sampling.prompt_logprobs == 4
    assert api.parse_chat(chat(prompt_logprobs=0), 256, 400).sampling.prompt_logprobs == 0
    assert refused(chat(prompt_logprobs=21)).param == "prompt_logprobs"
    assert refused(chat(prompt_logprobs=2, stream=True)).param == "prompt_logprobs"


def test_continue_final_message_leaves_the_assistant_message_open():
    msgs = MSG + [{"role": "assistant", "content": "Once upon"}]
    parsed = api.parse_chat(chat(messages=msgs, continue_final_message=True), 256, 400)
    assert parsed.continue_final_message and not parsed.add_generation_prompt
    (req,) = parsed.new_requests("x", "tiny")
    assert req.continue_final_message


def test_tokenize_bodies():
    assert api.parse_tokenize(b'{"prompt": "hi"}').add_special_tokens
    t = api.parse_tokenize(json.dumps({"messages": MSG}).encode())
    assert not t.add_special_tokens and t.add_generation_prompt and t.messages[0].content == "hi"
    for raw, param in [(b'{}', "prompt"), (b'{"prompt": "x", "messages": []}', "prompt"), (b'{"prompt": 3}', "prompt"),
                       (b'{"prompt": "x", "extra": 1}', "extra")]:
        with pytest.raises(api.ApiError) as info:
            api.parse_tokenize(raw)
        assert info.value.param == param
    assert api.parse_detokenize(b'{"tokens": [1, 2]}', 400) == (None, [1, 2])
    with pytest.raises(api.ApiError):
        api.parse_detokenize(b'{"tokens": [400]}', 400)


def test_truncating_is_refused_with_media_parts():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    assert refused(chat(messages=image, truncate_prompt_tokens=4)).param == "truncate_prompt_tokens"
    api.parse_chat(chat(messages=image, return_token_ids=True), 256, 400)  # the engine's ids come back (expanded)
    api.parse_chat(chat(messages=image, min_tokens=1), 256, 400)


def test_any_int64_seed_is_taken_and_each_choice_s_stays_one():
    """vLLM and OpenAI take any int64 (sys.maxsize among them); choice i samples with seed + i, wrapped."""
    from mstar_actors.sched.scheduler import choice_sampling

    top = (1 << 63) - 1
    sampling = api.parse_completion(comp(seed=top, n=3), 256, 400).sampling
    seeds = [choice_sampling(sampling, i).seed for i in range(3)]
    assert seeds == [top, -(1 << 63), -(1 << 63) + 1]
    assert refused(comp(seed=1 << 63), "completion").param == "seed"


def test_n_goes_to_openai_s_limit():
    assert api.parse_chat(chat(n=128), 256, 400).n == 128
    err = refused(chat(n=129))
    assert err.param == "n" and "[1, 128]" in err.message


@pytest.mark.parametrize("field,value,shown", [("logprobs", True, "got true"), ("max_tokens", "4", 'got "4"'),
                                               ("temperature", False, "got false")])
def test_a_refusal_shows_the_value_as_the_json_sent_it(field, value, shown):
    err = refused(comp(**{field: value}), "completion")
    assert err.param == field and shown in err.message, err.message
