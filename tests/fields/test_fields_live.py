"""The official ``openai`` client against a live server (every actor in its own
process, a tiny random Llama on CPU, greedy): each honoured field changes the
output as specified, an invalid value is a 400, and SIGTERM drains."""

import signal

import pytest

from tests.live_tiny import save_tiny_llama, serve_tiny

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
GREEDY = dict(model="tiny", temperature=0, extra_body={"return_token_ids": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """``(client, process)``; the last test of the module sends it SIGTERM."""
    folder = tmp_path_factory.mktemp("fields-model")
    save_tiny_llama(folder, tokenizer)
    with serve_tiny(folder, stop_timeout_s=90, shutdown_timeout_s=60) as (base_url, proc):
        yield openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60), proc


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_logit_bias_makes_every_token_that_token_and_bad_words_ban_it(server, tokenizer):
    client, _ = server
    (hello,) = tokenizer("Hello", add_special_tokens=False).input_ids
    out = client.completions.create(prompt="The quick", max_tokens=6, logit_bias={str(hello): 100}, **GREEDY)
    assert ids_of(out.choices[0]) == [hello] * 6
    extra = {"return_token_ids": True, "bad_words": ["Hello"]}
    out = client.completions.create(prompt="The quick", max_tokens=6, logit_bias={str(hello): 100},
                                    **GREEDY | {"extra_body": extra})
    assert hello not in ids_of(out.choices[0]) and len(ids_of(out.choices[0])) == 6


def test_allowed_token_ids_restrict_and_stop_token_ids_stop(server):
    client, _ = server
    allowed = [30, 31, 32]
    out = client.completions.create(prompt="The quick", max_tokens=8, temperature=1.0, seed=1,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True}, model="tiny")
    assert set(ids_of(out.choices[0])) <= set(allowed)
    plain = ids_of(client.completions.create(prompt="The quick", max_tokens=8, **GREEDY).choices[0])
    extra = {"return_token_ids": True, "stop_token_ids": [plain[2]], "ignore_eos": True}
    stopped = client.completions.create(prompt="The quick", max_tokens=8, **GREEDY | {"extra_body": extra})
    cut = plain.index(plain[2]) + 1
    assert ids_of(stopped.choices[0]) == plain[:cut] and stopped.choices[0].finish_reason == "stop"
    # vLLM's stop_reason: the stop token, the stop string, or null (a length cut, EOS)
    assert stopped.choices[0].model_extra["stop_reason"] == plain[2]
    text = client.completions.create(prompt="The quick", max_tokens=8, **GREEDY).choices[0]
    assert text.model_extra["stop_reason"] is None and text.finish_reason == "length"
    word = text.text.split()[1] if len(text.text.split()) > 1 else text.text.strip()[-2:]
    cut = client.completions.create(prompt="The quick", max_tokens=8, stop=[word], stream=True, **GREEDY)
    last = [chunk.choices[0] for chunk in cut][-1]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == word


def test_min_tokens_delays_a_forced_eos(server, tokenizer):
    client, _ = server
    bias = {str(tokenizer.eos_token_id): 100}
    out = client.completions.create(prompt="The quick", max_tokens=20, logit_bias=bias, **GREEDY)
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    extra = {"return_token_ids": True, "min_tokens": 5}
    out = client.completions.create(prompt="The quick", max_tokens=20, logit_bias=bias, **GREEDY | {"extra_body": extra})
    assert out.usage.completion_tokens == 6 and ids_of(out.choices[0])[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in ids_of(out.choices[0])[:5]


def test_truncate_echo_logprobs_zero_and_cached_tokens(server, tokenizer):
    client, _ = server
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    out = client.completions.create(prompt=prompt, max_tokens=2, model="tiny", extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):  # vLLM's truncation_side: which end is cut
        extra = {"truncate_prompt_tokens": 5, "truncation_side": side, "return_token_ids": True}
        out = client.completions.create(prompt=prompt, max_tokens=2, model="tiny", extra_body=extra)
        assert out.choices[0].model_extra["prompt_token_ids"] == kept, side
    # a text past the context, cut to its end: kept (it was refused as too long before the cut)
    for send in (client.completions.create, client.chat.completions.create):
        body = {"prompt": prompt * 200} if send == client.completions.create else {
            "messages": [{"role": "user", "content": prompt * 200}]}
        out = send(**body, max_tokens=2, model="tiny", extra_body={"truncate_prompt_tokens": 20})
        assert out.usage.prompt_tokens == 20
    out = client.completions.create(prompt="Hello world", max_tokens=2, echo=True, model="tiny", temperature=0)
    assert out.choices[0].text.startswith("Hello world")
    out = client.completions.create(prompt="Hello", max_tokens=3, logprobs=0, model="tiny", temperature=0)
    lp = out.choices[0].logprobs  # logprobs=0: the sampled token's alone, as OpenAI's
    assert len(lp.token_logprobs) == 3 and lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    ids = tokenizer("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False).input_ids
    out = client.completions.create(prompt=ids, max_tokens=2, echo=True, model="tiny", temperature=0)
    assert out.choices[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=False))  # special tokens too
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(prompt=ids, max_tokens=2, logprobs=1, model="tiny", temperature=0, extra_body=extra)
    assert out.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids_of(out.choices[0])]
    client.completions.create(prompt=prompt, max_tokens=1, model="tiny")
    again = client.completions.create(prompt=prompt, max_tokens=1, model="tiny")
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # a full KV block hit the prefix cache
    # vLLM's cache_salt: blocks are shared only between requests of the same salt
    def cached(salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(prompt=prompt, max_tokens=1, model="tiny", extra_body=body)
        return out.usage.prompt_tokens_details.cached_tokens
    assert cached("tenant-a") == 0 and cached("tenant-a") >= 16 and cached("tenant-b") == 0 and cached(None) >= 16
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(prompt=prompt, max_tokens=1, model="tiny", extra_body={"cache_salt": ""})


def test_echo_with_logprobs_scores_the_prompt(server, tokenizer):
    """lm-eval's loglikelihood request: echo, logprobs and one new token. The
    prompt's tokens come first (the first without a logprob), with text
    offsets into the echoed text; a token scored as the prompt's last has the
    logprob it had when it was sampled."""
    client, _ = server
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    out = client.completions.create(prompt=prompt, max_tokens=1, echo=True, logprobs=2, model="tiny", temperature=0,
                                    extra_body={"return_token_ids": True})
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(lp.top_logprobs[i][t] == lp.token_logprobs[i]
                                                              for i, t in enumerate(lp.tokens) if i)
    assert all(choice.text.startswith(token, offset) for token, offset in zip(lp.tokens, lp.text_offset))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] == len(prompt)
    assert "".join(lp.tokens) == choice.text
    (sampled,) = ids_of(choice)
    again = client.completions.create(prompt=ids + [sampled], max_tokens=1, echo=True, logprobs=0, model="tiny",
                                      temperature=0)
    assert again.choices[0].logprobs.token_logprobs[len(ids)] == pytest.approx(lp.token_logprobs[-1], abs=1e-4)
    streamed = client.completions.create(prompt=prompt, max_tokens=1, echo=True, logprobs=2, model="tiny",
                                         temperature=0, stream=True)
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert tokens == lp.tokens
    # a cap of 0: the prompt alone, scored as above (OpenAI's way to score a prompt)
    alone = client.completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=2, model="tiny", temperature=0)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    got = alone.choices[0].logprobs
    assert got.tokens == lp.tokens[:-1] and got.text_offset == lp.text_offset[:-1]
    assert got.token_logprobs[0] is None and got.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)


def test_prompt_logprobs_as_vllm_gives_them(server, tokenizer):
    """vLLM's prompt_logprobs: per completion choice, once for a chat; each
    position's prompt token with its logprob and rank, and the top ones."""
    client, _ = server
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    echoed = client.completions.create(prompt=prompt, max_tokens=1, echo=True, logprobs=0, model="tiny", temperature=0)
    out = client.completions.create(prompt=prompt, max_tokens=1, model="tiny", temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for position, (token_id, entry) in enumerate(zip(ids[1:], scores[1:]), start=1):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(echoed.choices[0].logprobs.token_logprobs[position], abs=1e-5)
        assert own["rank"] >= 1 and own["decoded_token"] == tokenizer.decode([token_id])
        ranked = sorted(v["rank"] for k, v in entry.items() if k != str(token_id) or v["rank"] <= 2)
        assert ranked[:2] == [1, 2] and len(entry) in (2, 3)
    # both asked, each with its own count; a cut prompt echoes as the model saw it, offsets into that
    both = client.completions.create(prompt="one two three four five", max_tokens=1, echo=True, logprobs=3, model="tiny",
                                     temperature=0, extra_body={"prompt_logprobs": 0, "truncate_prompt_tokens": 3})
    choice = both.choices[0]
    assert all(len(entry) == 1 for entry in choice.model_extra["prompt_logprobs"][1:])
    assert all(len(top) <= 4 for top in choice.logprobs.top_logprobs[1:]) and len(choice.logprobs.tokens) == 4
    assert all(choice.text.startswith(t, o) for t, o in zip(choice.logprobs.tokens, choice.logprobs.text_offset))
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=1, model="tiny",
                                          extra_body={"prompt_logprobs": 0})
    scores = chat.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == chat.usage.prompt_tokens and all(len(e) == 1 for e in scores[1:])


def test_invalid_or_unsupported_fields_are_a_400_naming_them(server):
    client, _ = server
    msgs = [{"role": "user", "content": "x"}]
    for kwargs, param in [({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logit_bias": {"1": 200}}, "logit_bias"),
                          ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
                          ({"extra_body": {"allowed_token_ids": [-1]}}, "allowed_token_ids[0]"),
                          ({"extra_body": {"no_such_field": 1}}, "no_such_field")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **kwargs)
        assert info.value.body["param"] == param
    # fields that change nothing pass, as OpenAI's server takes them
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, user="u", metadata={"k": "v"}, store=False)


def test_sigterm_lets_a_stream_in_flight_end_with_done_and_refuses_new_requests(server):
    client, proc = server
    stream = client.completions.create(model="tiny", prompt="The quick", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stderr:  # the frontend applied the drain
        if "draining: new requests get 503" in line:
            break
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    if isinstance(info.value, openai.InternalServerError):
        assert info.value.status_code == 503
    # The openai client ends the iteration at [DONE]; an error event would raise. Tokens made
    # while the client was slow to read come coalesced, so the first event may be the last.
    received = [first, *chunks]
    text = "".join(c.choices[0].text for c in received if c.choices)
    assert received[-1].choices[0].finish_reason == "length" and text
    assert proc.wait(timeout=90) == 0
