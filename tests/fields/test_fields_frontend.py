"""Output fields, routes, adapter reloads and the graceful drain, through the
real FrontendActor over HTTP with the scheduler-backed engine."""

import asyncio

import msgspec

from mstar_actors.messages import Drain, Drained, Finished, SampledToken, TokenDelta
from tests.frontend.conftest import REPLY

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def run(fn):
    asyncio.run(asyncio.wait_for(fn(), 20))


def chat_body(**kw):
    return {"model": "tiny", "messages": MSGS} | kw


def hold(req):
    return None


def test_include_stop_str_in_output_keeps_the_stop_string(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(stop=[" is"], include_stop_str_in_output=True))
            assert r["choices"][0]["message"]["content"] == "Hello world! This is"
            _, r = await h.post(CHAT, chat_body(stop=[" is"]))
            assert r["choices"][0]["message"]["content"] == "Hello world! This"

    run(body)


def test_skip_special_tokens_false_shows_them(harness):
    async def body():
        async with harness() as h:
            h.engine.reply_text = "Hello<|im_start|>world"
            _, r = await h.post(CHAT, chat_body())
            assert r["choices"][0]["message"]["content"] == "Helloworld"
            _, r = await h.post(CHAT, chat_body(skip_special_tokens=False))
            assert r["choices"][0]["message"]["content"] == "Hello<|im_start|>world"  # the EOS that stopped it: not
            _, r = await h.post(CHAT, chat_body(skip_special_tokens=False, include_stop_str_in_output=True))
            assert r["choices"][0]["message"]["content"] == "Hello<|im_start|>world<|im_end|>"


def test_a_stop_token_ends_the_text_without_its_own_text_unless_asked(harness):
    async def body():
        async with harness() as h:
            (stop_id,) = h.engine.tokenizer(" is", add_special_tokens=False).input_ids[-1:]
            _, r = await h.post(CHAT, chat_body(stop_token_ids=[stop_id]))
            stopped = r["choices"][0]["message"]["content"]
            assert r["choices"][0]["finish_reason"] == "stop" and REPLY.startswith(stopped) and stopped != REPLY
            _, r = await h.post(CHAT, chat_body(stop_token_ids=[stop_id], include_stop_str_in_output=True))
            shown = r["choices"][0]["message"]["content"]
            assert shown == stopped + h.engine.tokenizer.decode([stop_id])

    run(body)


def test_echo_prepends_the_prompt_text_streamed_or_not(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(COMP, {"model": "tiny", "prompt": "Once", "echo": True, "max_tokens": 50})
            assert r["choices"][0]["text"] == "Once" + REPLY
            ids = h.engine.tokenizer("The quick").input_ids
            _, events = await h.stream(COMP, {"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 50})
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "The quick" + REPLY

    run(body)


def test_a_prompt_of_ids_cut_inside_a_character_gets_it_whole_in_the_output(harness):
    """A prompt of ids ending with a character's first bytes: the output's
    text starts with the character its tokens finish (a decode of prompt and
    output together reads so), and the echo stops before it."""
    async def body():
        async with harness() as h:
            tok = h.engine.tokenizer
            ids = tok("日本語").input_ids
            cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
            read = tok.decode(ids[:cut])[:-1]
            assert "日本語".startswith(read) and len(read) < 3
            h.engine.plan = lambda req: h.engine.reply(req, ids=ids[cut:])
            _, r = await h.post(COMP, {"model": "tiny", "prompt": ids[:cut], "max_tokens": 50})
            assert r["choices"][0]["text"] == "日本語"[len(read):]
            _, events = await h.stream(COMP, {"model": "tiny", "prompt": ids[:cut], "echo": True, "max_tokens": 50})
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "日本語"
            # the prompt alone: as it decodes, the unfinished character a U+FFFD
            _, r = await h.post(COMP, {"model": "tiny", "prompt": ids[:cut], "echo": True, "max_tokens": 0})
            assert r["choices"][0]["text"] == tok.decode(ids[:cut])
            # an output that does not go on with it: the prompt's U+FFFD stays the prompt's (a JSON reply stays JSON)
            other = tok("{}").input_ids
            h.engine.plan = lambda req: h.engine.reply(req, ids=other)
            _, r = await h.post(COMP, {"model": "tiny", "prompt": ids[:cut], "max_tokens": 50})
            assert r["choices"][0]["text"] == "{}"
            for stream in (False, True):
                body = {"model": "tiny", "prompt": ids[:cut], "echo": True, "max_tokens": 50, "logprobs": 0}
                if stream:
                    _, events = await h.stream(COMP, body | {"stream": True})
                    text = "".join(e["choices"][0]["text"] for e in events[:-1])
                else:
                    text = (await h.post(COMP, body))[1]["choices"][0]["text"]
                assert text == tok.decode(ids[:cut] + other), stream

    run(body)


def test_echo_with_a_cap_of_0_gives_the_prompt_alone(harness):
    """OpenAI's prompt scoring: ``echo`` with ``max_tokens: 0`` answers the
    prompt and its logprobs, no token of output; 0 without echo is refused."""
    async def body():
        async with harness() as h:
            prompt = "The quick brown"
            num_ids = len(h.engine.tokenizer(prompt).input_ids)
            for field in ("max_tokens", "max_completion_tokens"):
                status, r = await h.post(COMP, {"model": "tiny", "prompt": prompt, "echo": True, field: 0,
                                                "logprobs": 1})
                choice = r["choices"][0]
                assert status == 200 and choice["text"] == prompt and choice["finish_reason"] == "length"
                assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == num_ids
                # the prompt's entries only (this engine scores no prompt: its first, unscored, alone)
                assert choice["logprobs"]["token_logprobs"] == [None] and choice["logprobs"]["text_offset"] == [0]
            req = list(h.engine.requests.values())[-1]
            assert req.sampling.max_tokens == 1  # the engine samples one token, not the client's
            _, events = await h.stream(COMP, {"model": "tiny", "prompt": prompt, "echo": True, "max_tokens": 0,
                                              "logprobs": 0, "stream_options": {"include_usage": True}})
            chunks = [e for e in events[:-1] if e["choices"]]  # the last: [DONE]
            assert "".join(e["choices"][0]["text"] for e in chunks) == prompt
            assert [t for e in chunks if e["choices"][0]["logprobs"]
                    for t in e["choices"][0]["logprobs"]["token_logprobs"]] == [None]
            assert events[-2]["usage"]["completion_tokens"] == 0
            status, r = await h.post(COMP, {"model": "tiny", "prompt": prompt, "max_tokens": 0})
            assert status == 400 and r["error"]["param"] == "max_tokens" and "echo" in r["error"]["message"]
            status, r = await h.post(COMP, {"model": "tiny", "prompt": prompt, "max_tokens": False})
            assert status == 400 and "echo" not in r["error"]["message"]  # no integer: the usual refusal

    run(body)


def test_return_token_ids_gives_the_prompt_and_the_sampled_ids(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(return_token_ids=True))
            req = next(iter(h.engine.requests.values()))
            assert r["prompt_token_ids"] == h.engine.prompt_ids(req)
            eos = h.engine.tokenizer.eos_token_id
            assert r["choices"][0]["token_ids"] == h.engine.tokenizer(REPLY).input_ids + [eos]
            _, events = await h.stream(COMP, {"model": "tiny", "prompt": "ab", "return_token_ids": True,
                                              "max_tokens": 3})
            streamed = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
            assert streamed == h.engine.tokenizer(REPLY).input_ids[:3]
            assert events[0]["choices"][0]["prompt_token_ids"] == h.engine.tokenizer("ab").input_ids
            assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:-1])
            _, events = await h.stream(CHAT, chat_body(return_token_ids=True))
            req = [r for r in h.engine.requests.values() if r.messages][-1]
            assert events[0]["prompt_token_ids"] == h.engine.prompt_ids(req)
            assert [t for e in events[1:-1] if e["choices"] for t in e["choices"][0]["token_ids"]] == \
                h.engine.tokenizer(REPLY).input_ids + [h.engine.tokenizer.eos_token_id]

    run(body)


def test_continuous_usage_stats_puts_usage_in_every_chunk(harness):
    """Each token is sent once the client has read the chunk before it (outputs
    that queue together would leave in one chunk, with one count)."""
    import json

    import aiohttp

    async def body():
        async with harness() as h:
            h.engine.plan = hold
            body = chat_body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
            async with aiohttp.ClientSession() as s:
                posting = asyncio.create_task(s.post(h.url + CHAT, json=body))
                await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
                (req,) = h.engine.requests.values()
                (rid,) = h.engine.choice_ids(req)
                ids = h.engine.tokenizer(REPLY).input_ids[:4]
                chunks, response = [], None
                for i, token_id in enumerate(ids):
                    tok = SampledToken(request_id=rid, token_id=token_id)
                    await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=2 if i == 0 else 0))
                    response = response or await posting
                    while not chunks or chunks[-1]["usage"]["completion_tokens"] < i + 1:
                        line = await response.content.readline()
                        if line.startswith(b"data: {"):
                            chunks.append(json.loads(line[6:]))
                await h.engine.send(Finished(request_id=rid, finish_reason="length", num_prompt_tokens=2,
                                             num_output_tokens=len(ids)))
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunks.append(json.loads(line[6:]))
            assert all(c["usage"] is not None for c in chunks)
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert counts == sorted(counts) and counts[-1] == len(ids) and counts[1] == 1
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and counts[0] == 0  # no output yet
            assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"  # decoded as UTF-8

    run(body)


def test_continuous_usage_is_each_chunks_own_choices_and_needs_include_usage(harness):
    """As vLLM's: a chunk's usage is its choice's prompt and outputs so far;
    continuous_usage_stats alone (vLLM reads it only with include_usage) is a 400."""
    async def body():
        async with harness() as h:
            options = {"include_usage": True, "continuous_usage_stats": True}
            _, events = await h.stream(CHAT, chat_body(n=2, stream_options=options))
            chunks = [e for e in events[:-1] if e["choices"]]
            (req,) = list(h.engine.requests.values())[-1:]
            n_prompt = h.engine.prompt_len(req)
            seen = {0: 0, 1: 0}
            for chunk in chunks:
                (choice,) = chunk["choices"]
                usage = chunk["usage"]
                assert usage["prompt_tokens"] == n_prompt  # its prompt, not the request's sum
                assert usage["completion_tokens"] >= seen[choice["index"]]  # its own count, growing
                seen[choice["index"]] = usage["completion_tokens"]
            assert seen[0] == seen[1] == events[-2]["usage"]["completion_tokens"] // 2
            status, r = await h.post(CHAT, chat_body(stream=True, stream_options={"continuous_usage_stats": True}))
            assert status == 400 and r["error"]["param"] == "stream_options.continuous_usage_stats", r

    run(body)


def test_cached_tokens_come_from_the_engine(harness):
    async def body():
        async with harness() as h:
            def cached(req):
                out = h.engine.reply(req)
                return [msgspec.structs.replace(m, num_cached_tokens=16) if isinstance(m, Finished) else m
                        for m in out]
            h.engine.plan = cached
            _, r = await h.post(CHAT, chat_body(n=2))
            assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}  # one prompt, not one per choice

    run(body)


def test_bad_words_and_min_tokens_reach_the_engine_as_token_ids(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(bad_words=["Hello"], min_tokens=2))
            req = next(iter(h.engine.requests.values()))
            tok = h.engine.tokenizer
            words = {tuple(tok("Hello", add_special_tokens=False).input_ids),
                     tuple(tok(" Hello", add_special_tokens=False).input_ids)}
            assert set(req.sampling.bad_words_token_ids) == words
            assert req.sampling.min_token_stop_ids == (tok.eos_token_id,)

    run(body)


def test_tokenize_detokenize_version_ping_and_model_by_id(harness):
    async def body():
        async with harness() as h:
            tok = h.engine.tokenizer
            status, r = await h.post("/tokenize", {"model": "tiny", "prompt": "Hello world"})
            assert status == 200 and r["tokens"] == tok("Hello world").input_ids
            assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": MSGS})
            text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
            assert r["tokens"] == tok(text, add_special_tokens=False).input_ids
            # specials on request are the tokenizer's own (this one adds none; its bos_token is no rule)
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": MSGS, "add_special_tokens": True})
            assert r["tokens"] == tok(text, add_special_tokens=True).input_ids
            # the whole text's count, past the context too (a client measures a text to cut it), as vLLM's
            long = "hello " * 400
            status, r = await h.post("/tokenize", {"model": "tiny", "prompt": long})
            assert status == 200 and r["tokens"] == tok(long).input_ids and r["count"] > r["max_model_len"]
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": long}]})
            assert status == 200 and r["count"] > r["max_model_len"]
            # tools rendered as a chat request's are; each token's vocabulary string on request
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": MSGS, "tools": tools,
                                                   "return_token_strs": True})
            # (this template writes no tools: they are described in a system message, as a chat request's)
            from mstar_actors.frontend.tool_calls import TOOLS_PREAMBLE

            preamble = TOOLS_PREAMBLE.format(tools='[{"name": "f", "parameters": {"type": "object"}}]',
                                             call='{"name": <the tool\'s name>, "parameters": <its arguments as an object>}')
            text = tok.apply_chat_template([{"role": "system", "content": preamble}, *MSGS], tokenize=False,
                                           add_generation_prompt=True)
            assert status == 200 and r["tokens"] == tok(text, add_special_tokens=False).input_ids
            assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
            # the turn flags read as a chat request reads them
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": MSGS, "continue_final_message": True})
            assert status == 400 and r["error"]["param"] == "continue_final_message"
            for name in ("add_generation_prompt", "continue_final_message", "tools"):  # the template's: not a prompt's
                status, r = await h.post("/tokenize", {"model": "tiny", "prompt": "x", name: False})
                assert status == 400 and r["error"]["param"] == name and "messages only" in r["error"]["message"]
            # a media part: refused by its part (its tokens follow its decoded size), not by the template
            media = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "image_url", "image_url": {"url": "data:,"}}]}]
            status, r = await h.post("/tokenize", {"model": "tiny", "messages": media})
            assert status == 400 and r["error"]["param"] == "messages[0].content[1].image_url"
            assert "reads text only" in r["error"]["message"]
            status, r = await h.post("/detokenize", {"model": "tiny", "tokens": tok("Hello world").input_ids})
            assert status == 200 and r == {"prompt": "Hello world"}
            status, r = await h.post("/tokenize", {"model": "nope", "prompt": "x"})
            assert status == 404 and r["error"]["code"] == "model_not_found"
            async with h.session.get(h.url + "/version") as resp:
                assert resp.status == 200 and "version" in await resp.json()
            for method in (h.session.get, h.session.post):
                async with method(h.url + "/ping") as resp:
                    assert resp.status == 200
            async with h.session.get(h.url + "/v1/models/tiny-lora") as resp:
                card = await resp.json()
                assert resp.status == 200 and card["id"] == "tiny-lora" and card["parent"] == "tiny"
            async with h.session.get(h.url + "/v1/models/other") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"

    run(body)


def test_reloading_a_served_adapter_needs_load_inplace(harness, tmp_path):
    async def body():
        async with harness() as h:
            lora = msgspec.structs.replace(h.config.lora, allow_runtime_updates=True, adapter_dirs=[str(tmp_path)])
            h.actor.config = msgspec.structs.replace(h.config, lora=lora)
            status, r = await h.post("/v1/load_lora_adapter", {"lora_name": "tiny-lora", "lora_path": "/elsewhere"})
            assert status == 400 and r["error"]["code"] == "adapter_already_loaded" and "load_inplace" in r["error"]["message"]
            # with load_inplace (or a new name) the request goes on to the path check
            for body in ({"lora_name": "tiny-lora", "lora_path": "/elsewhere", "load_inplace": True},
                         {"lora_name": "new", "lora_path": "/elsewhere"}):
                status, r = await h.post("/v1/load_lora_adapter", body)
                assert status == 403, r
            # a wrong type is refused whether the name is new or not
            for name in ("tiny-lora", "new"):
                status, r = await h.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": "/elsewhere",
                                                                   "load_inplace": "yes"})
                assert status == 400 and r["error"]["param"] == "load_inplace", r
            # a field the route does not read is named (a typo of load_inplace was dropped: a 200 that did not replace)
            status, r = await h.post("/v1/load_lora_adapter", {"lora_name": "tiny-lora", "lora_path": "/elsewhere",
                                                               "load_in_place": True})
            assert status == 400 and r["error"]["param"] == "load_in_place", r
            assert "accepted: load_inplace, lora_name, lora_path" in r["error"]["message"], r
            status, r = await h.post("/v1/unload_lora_adapter", {"lora_name": "tiny-lora", "lora_path": "/x"})
            assert status == 400 and r["error"]["param"] == "lora_path", r
            status, r = await h.post("/v1/unload_lora_adapter", {"lora_name": "tiny-lora", "lora_int_id": {"a": 1}})
            assert status == 400 and r["error"]["param"] == "lora_int_id", r  # vLLM's int

    run(body)


def test_drain_finishes_a_stream_in_flight_and_refuses_new_requests(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body()))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            await h.control(Drain(timeout_s=10.0))
            status, r = await h.post(CHAT, chat_body())
            assert status == 503 and r["error"]["code"] == "shutting_down"
            async with h.session.get(h.url + "/health") as resp:
                assert resp.status == 503
            for out in h.engine.reply(req):  # the request in flight finishes after the signal
                await h.engine.send(out)
            status, events = await streaming
            assert events[-1] == "[DONE]" and "".join(
                e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == REPLY
            assert await h.control_out.recv() == Drained(num_failed=0)

    run(body)


def test_drain_timeout_fails_what_is_left_with_a_clear_error(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body()))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            tok = SampledToken(request_id=req.request_id, token_id=h.engine.tokenizer("Hello").input_ids[0])
            await h.engine.send(TokenDelta(request_id=req.request_id, tokens=[tok], num_prompt_tokens=3))
            await h.control(Drain(timeout_s=0.2))
            status, events = await streaming
            assert events[-1] == "[DONE]" and "shutdown_timeout_s" in events[-2]["error"]["message"]
            assert events[-2]["error"]["code"] == "shutting_down"  # as a new request's 503 says it
            assert await h.control_out.recv() == Drained(num_failed=1)
            assert h.engine.aborts == [req.request_id]  # the engine frees its blocks

    run(body)


def test_stop_strings_wait_for_min_tokens(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(stop=["Hello"]))
            assert r["choices"][0]["message"]["content"] == ""
            _, r = await h.post(CHAT, chat_body(stop=["Hello", " is"], min_tokens=2))
            assert r["choices"][0]["message"]["content"] == "Hello world! This"  # " is" comes later
            # as vLLM's: the text of the first min_tokens tokens is not searched, a stop its last token ends included
            at = len(h.engine.tokenizer("Hello world").input_ids)
            _, r = await h.post(CHAT, chat_body(stop=[" world"], min_tokens=at))
            assert r["choices"][0]["message"]["content"].startswith("Hello world! This")
            _, r = await h.post(CHAT, chat_body(stop=[" world"], min_tokens=at - 1))
            assert r["choices"][0]["message"]["content"] == "Hello"
            # one that begins in that text and ends past it stops the output there
            _, r = await h.post(CHAT, chat_body(stop=["lo wor"], min_tokens=1))
            assert r["choices"][0]["message"]["content"] == "Hel"
            _, r = await h.post(CHAT, chat_body(stop=["lo wor", "ll"], min_tokens=at))  # "ll" ends in it: passed
            assert r["choices"][0]["message"]["content"].startswith("Hello world! This")

    run(body)


def test_the_scheduler_does_not_stop_on_eos_before_min_tokens(harness):
    async def body():
        async with harness() as h:
            h.engine.reply_text = "Hello<|im_end|> world"  # an EOS mid-reply
            _, r = await h.post(CHAT, chat_body())
            assert r["choices"][0]["message"]["content"] == "Hello"
            num_hello = len(h.engine.tokenizer("Hello").input_ids)
            _, r = await h.post(CHAT, chat_body(min_tokens=num_hello + 2))
            assert r["choices"][0]["message"]["content"] == "Hello world"

    run(body)
