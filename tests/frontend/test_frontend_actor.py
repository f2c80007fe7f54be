"""The frontend actor over in-memory channels, the engine's scheduler and real HTTP."""

import asyncio
import json

import aiohttp
import msgspec
import pytest

from mstar_actors.messages import ContextAgreed, EngineStats, Failed, Finished, PeerFailed, SampledToken, TokenDelta
from tests.frontend.conftest import REPLY
from tests.frontend.test_openai_api import BAD

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def run(fn):
    asyncio.run(asyncio.wait_for(fn(), 15))


def chat_body(**kw):
    return {"model": "tiny", "messages": MSGS} | kw


def hold(req):
    return None  # the fake engine keeps the request; the test answers


def test_chat_non_streaming_with_usage(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body())
            assert status == 200, r
            assert r["object"] == "chat.completion" and r["model"] == "tiny"
            (choice,) = r["choices"]
            assert choice["message"] == {"role": "assistant", "content": REPLY}
            assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
            req = next(iter(h.engine.requests.values()))
            n_prompt = h.engine.prompt_len(req)
            n_out = len(h.engine.tokenizer(REPLY).input_ids) + 1  # + EOS, which makes no text
            assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
            assert [m.role for m in req.messages] == ["system", "user"]

    run(body)


def test_a_request_takes_the_model_s_sampling_defaults_for_the_fields_it_leaves_out(harness):
    """As vLLM's ``--generation-config auto``: the model's generation_config.json
    values (``ModelInfo.sampling_defaults``) for what a request leaves out or
    sends null; what it sends rules. Its max_new_tokens caps a chat's output
    (cut to what the prompt leaves) and a completion's default of 16."""
    async def body():
        h = harness()
        defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1, "max_tokens": 5}
        h.info = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(h.info, sampling_defaults=defaults)),
                                 type(h.info))  # as the launcher hands it over
        async with h:
            for sent in (chat_body(), chat_body(temperature=0, top_k=None, max_tokens=9)):
                status, r = await h.post(CHAT, sent)
                assert status == 200, r
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hi", "top_p": 1})
            assert status == 200, r
            first, sent, completion = (req.sampling for req in h.engine.requests.values())
            assert (first.temperature, first.top_k, first.top_p, first.repetition_penalty) == (0.6, 20, 0.95, 1.1)
            assert (first.max_tokens, first.cut_to_context) == (5, True)
            assert (sent.temperature, sent.top_k, sent.max_tokens, sent.cut_to_context) == (0.0, 20, 9, False)
            assert (completion.top_p, completion.temperature, completion.max_tokens) == (1.0, 0.6, 5)
            assert all(type(s.max_tokens) is int and type(s.top_k) is int for s in (first, sent, completion))

    run(body)


def test_chat_streaming_with_usage(harness):
    async def body():
        async with harness() as h:
            status, events = await h.stream(CHAT, chat_body(stream_options={"include_usage": True}))
            assert status == 200
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert text == REPLY
            assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
            assert all(c["usage"] is None for c in chunks[:-1])

    run(body)


def test_a_client_request_id_names_the_response_as_vllms(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(request_id="my-req-1"))
            assert status == 200 and r["id"] == "chatcmpl-my-req-1", r
            status, events = await h.stream(CHAT, chat_body(request_id="my-req-2"))
            assert status == 200 and {c["id"] for c in events[:-1]} == {"chatcmpl-my-req-2"}
            ids = [req.request_id for req in h.engine.requests.values()]
            assert len(ids) == 2 and not any("my-req" in rid for rid in ids)  # the engine's ids stay its own
            # vLLM's X-Request-Id header comes before the body's; the id goes back in the header (the openai
            # client's .request_id)
            data = json.dumps(chat_body(request_id="my-req-3")).encode()
            async with h.session.post(h.url + CHAT, data=data, headers={"X-Request-Id": "hdr-1"}) as resp:
                assert resp.status == 200 and (await resp.json())["id"] == "chatcmpl-hdr-1"
                assert resp.headers["X-Request-Id"] == "hdr-1"  # echoed as sent
            async with h.session.post(h.url + CHAT, json=chat_body(), headers={"X-Request-Id": ""}) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == (await resp.json())["id"]  # (none)
            async with h.session.post(h.url + CHAT, json=chat_body(stream=True)) as resp:
                first = json.loads((await resp.content.readline()).decode().removeprefix("data: "))
                assert resp.headers["X-Request-Id"] == first["id"] and first["id"].startswith("chatcmpl-")
                await resp.read()
            status, r = await h.post(CHAT, chat_body(), headers={"X-Request-Id": "x" * 129})
            assert status == 400 and r["error"]["param"] == "X-Request-Id", r

    run(body)


def test_a_request_larger_than_the_ring_to_prepare_is_a_413_and_the_next_one_goes_on(harness):
    """The launcher sizes that ring for server.max_body_bytes; a config out of
    step with it (here the harness's 1 MiB ring under a 4 MiB body limit)
    answers the client, never a 500."""
    async def body():
        async with harness() as h:
            big = chat_body(messages=[{"role": "user", "content": "x" * (3 << 19)}])
            status, r = await h.post(CHAT, big)
            assert status == 413 and r["error"]["code"] == "request_too_large", r
            assert "transport.ring_bytes" in r["error"]["message"]
            status, r = await h.post(CHAT, chat_body())
            assert status == 200, r

    run(body)


def test_completions_plain_streaming_and_length(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "Hello", "max_tokens": 3})
            assert status == 200 and r["object"] == "text_completion"
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] == 3
            status, events = await h.stream(COMP, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100})
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY
            assert all(e["object"] == "text_completion" for e in events[:-1])

    run(body)


def test_n_choices_and_multiple_prompts(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(n=2, seed=7))
            assert status == 200
            assert [c["index"] for c in r["choices"]] == [0, 1]
            assert all(c["message"]["content"] == REPLY for c in r["choices"])
            (req,) = h.engine.requests.values()  # prepared once, fanned out by the engine
            assert req.n == 2
            assert sorted(s.sampling.seed for s in h.engine.started) == [7, 8]
            one = len(h.engine.tokenizer(REPLY).input_ids) + 1
            assert r["usage"]["completion_tokens"] == 2 * one
            status, r = await h.post(COMP, {"model": "tiny", "prompt": ["a b", "c"], "n": 2})
            assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
            assert len(h.engine.requests) == 3  # one per prompt
            prompts = [len(h.engine.tokenizer(p).input_ids) for p in ("a b", "c")]
            assert r["usage"]["prompt_tokens"] == sum(prompts)  # each prompt once, not once per choice

    run(body)


def test_streaming_n2_marks_every_choice(harness):
    async def body():
        async with harness() as h:
            _, events = await h.stream(CHAT, chat_body(n=2))
            chunks = events[:-1]
            for index in (0, 1):
                mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
                assert mine[0]["delta"]["role"] == "assistant"
                assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
                assert mine[-1]["finish_reason"] == "stop"

    run(body)


def test_stop_string_cuts_text_and_aborts(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(stop=[" is", "zzz"]))
            assert status == 200
            assert r["choices"][0]["message"]["content"] == "Hello world! This"
            assert r["choices"][0]["finish_reason"] == "stop"
            rid = next(iter(h.engine.requests))
            await h.engine.wait_for(lambda: rid in h.engine.aborts)
            assert r["usage"]["prompt_tokens"] == h.engine.prompt_len(h.engine.requests[rid])
            _, events = await h.stream(COMP, {"model": "tiny", "prompt": "x", "stop": "!"})
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world"

    run(body)


def test_stop_string_usage_needs_no_finished(harness):
    """A choice ended by a stop string reports usage from the engine's first
    delta (its prompt length) without waiting for a Finished."""
    async def body():
        async with harness() as h:
            def without_finished(req):  # the first deltas say the prefix cache held 5 tokens
                return [msgspec.structs.replace(m, num_cached_tokens=5) if m.num_prompt_tokens else m
                        for m in h.engine.reply(req) if isinstance(m, TokenDelta)]
            h.engine.plan = without_finished
            status, r = await h.post(CHAT, chat_body(stop="!", n=2))
            assert status == 200 and [c["message"]["content"] for c in r["choices"]] == ["Hello world"] * 2
            (req,) = h.engine.requests.values()
            n_prompt = h.engine.prompt_len(req)
            assert r["usage"]["prompt_tokens"] == n_prompt  # the prompt once, for both choices
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 5  # and its prefix hit
            await h.engine.wait_for(lambda: sorted(h.engine.aborts) == h.engine.choice_ids(req))  # each choice alone
            assert r["usage"]["completion_tokens"] == 2 * len(h.engine.tokenizer("Hello world!").input_ids)
            _, events = await h.stream(CHAT, chat_body(stop="!", stream_options={"include_usage": True}))
            assert [e["choices"][0]["finish_reason"] for e in events[:-2]].count("stop") == 1
            assert events[-2]["usage"]["prompt_tokens"] == n_prompt and events[-1] == "[DONE]"

    run(body)


def test_logprobs_chat_and_legacy_formats(harness):
    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(logprobs=True, top_logprobs=2))
            content = r["choices"][0]["logprobs"]["content"]
            assert len(content) == r["usage"]["completion_tokens"]
            first = content[0]
            assert first["token"] == "Hello" and first["logprob"] == -0.5
            assert first["bytes"] == list(b"Hello")
            assert len(first["top_logprobs"]) == 2 and set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
            _, r = await h.post(COMP, {"model": "tiny", "prompt": "x", "logprobs": 1, "max_tokens": 4})
            lp = r["choices"][0]["logprobs"]
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            assert "".join(lp["tokens"]) == r["choices"][0]["text"]
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
            # the top one, and the sampled token (OpenAI's up to logprobs + 1)
            assert all(len(top) in (1, 2) and top[t] == v for top, t, v in zip(lp["top_logprobs"], lp["tokens"],
                                                                               lp["token_logprobs"]))

    run(body)


@pytest.mark.parametrize("interval", [1, 3])
def test_a_stream_interval_sends_a_chunk_every_n_tokens_its_first_and_its_end_at_once(harness, interval):
    """vLLM's stream_interval: tokens that arrive one by one go out as one chunk of the first, then one each
    ``interval`` tokens, the rest with the finish; the text and logprobs are the same."""
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body(logprobs=True, stream_interval=interval)))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            (rid,) = h.engine.choice_ids(req)
            ids = h.engine.tokenizer(REPLY).input_ids
            (exchange,) = h.actor._exchanges.values()
            for i, token_id in enumerate(ids):
                tok = SampledToken(request_id=rid, token_id=token_id, logprob=-0.5)
                await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=3 if i == 0 else 0))
                while not (exchange.choices and exchange.choices[rid].num_output_tokens == i + 1):
                    await asyncio.sleep(0.001)  # the frontend takes each alone
            await h.engine.send(Finished(request_id=rid, finish_reason="stop", num_prompt_tokens=3,
                                         num_output_tokens=len(ids)))
            status, events = await streaming
            assert status == 200 and events[-1] == "[DONE]"
            chunks = [e["choices"][0] for e in events[1:-1]]
            sizes = [len((c["logprobs"] or {"content": []})["content"]) for c in chunks]
            full, rest = divmod(len(ids) - 1, interval)  # (the finish alone where none is left)
            assert sizes == [1] + [interval] * full + [rest], sizes
            assert "".join(c["delta"].get("content", "") for c in chunks) == REPLY
            assert chunks[-1]["finish_reason"] == "stop"

    run(body)


def test_outputs_queued_together_leave_in_one_event(harness):
    """Outputs that arrive faster than the stream writes go out together: one
    event with all their text and logprobs (and the finish), the same content."""
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body(logprobs=True, top_logprobs=1,
                                                                     stream_options={"include_usage": True})))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            (rid,) = h.engine.choice_ids(req)
            ids = h.engine.tokenizer(REPLY).input_ids
            for i, token_id in enumerate(ids):  # queued back to back: the frontend has not run meanwhile
                tok = SampledToken(request_id=rid, token_id=token_id, logprob=-0.5)
                await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=3 if i == 0 else 0))
            await h.engine.send(Finished(request_id=rid, finish_reason="stop", num_prompt_tokens=3,
                                         num_output_tokens=len(ids)))
            status, events = await streaming
            assert status == 200 and events[-1] == "[DONE]"
            role, merged, usage = events[:-1]
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            (choice,) = merged["choices"]
            assert choice["delta"]["content"] == REPLY and choice["finish_reason"] == "stop"
            assert len(choice["logprobs"]["content"]) == len(ids)
            assert usage["usage"]["completion_tokens"] == len(ids)

    run(body)


def test_queued_outputs_of_two_choices_leave_in_one_event_each(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body(n=2)))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            rids = h.engine.choice_ids(req)
            ids = h.engine.tokenizer(REPLY).input_ids
            for i, token_id in enumerate(ids):  # interleaved: a, b, a, b, ...
                for rid in rids:
                    tok = SampledToken(request_id=rid, token_id=token_id)
                    await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=3 if i == 0 else 0))
            for rid in rids:
                await h.engine.send(Finished(request_id=rid, finish_reason="stop", num_prompt_tokens=3,
                                             num_output_tokens=len(ids)))
            status, events = await streaming
            assert status == 200 and events[-1] == "[DONE]"
            content = [c["choices"][0] for c in events[:-1] if c["choices"] and c["choices"][0]["delta"].get("content")]
            assert sorted(c["index"] for c in content) == [0, 1]
            assert all(c["delta"]["content"] == REPLY and c["finish_reason"] == "stop" for c in content)

    run(body)


def test_a_backlog_past_one_steps_outputs_still_leaves_in_one_event_a_choice(harness):
    """More outputs queued than one step of 256 streams sends (the frontend
    behind the engine): the loop takes the whole backlog in before the
    stream writes, so each choice's tokens leave in one event."""
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            streaming = asyncio.create_task(h.stream(CHAT, chat_body(n=2, max_tokens=150)))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            (req,) = h.engine.requests.values()
            rids = h.engine.choice_ids(req)
            token_id = h.engine.tokenizer(REPLY).input_ids[0]
            for i in range(150):  # 300 outputs, interleaved, queued back to back
                for rid in rids:
                    tok = SampledToken(request_id=rid, token_id=token_id)
                    await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=3 if i == 0 else 0))
            for rid in rids:
                await h.engine.send(Finished(request_id=rid, finish_reason="length", num_prompt_tokens=3,
                                             num_output_tokens=150))
            status, events = await streaming
            assert status == 200 and events[-1] == "[DONE]"
            content = [c["choices"][0] for c in events[:-1] if c["choices"] and c["choices"][0]["delta"].get("content")]
            assert sorted(c["index"] for c in content) == [0, 1]
            want = h.engine.tokenizer.decode([token_id] * 150)
            assert all(c["delta"]["content"] == want and c["finish_reason"] == "length" for c in content)

    run(body)


def test_disconnect_mid_stream_aborts_every_choice(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            async with aiohttp.ClientSession() as s:
                # headers come with the first engine output (see FrontendActor._stream)
                posting = asyncio.create_task(s.post(h.url + CHAT, json=chat_body(n=2, stream=True)))
                await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
                (req,) = h.engine.requests.values()
                for rid in h.engine.choice_ids(req):
                    tok = SampledToken(request_id=rid, token_id=h.engine.tokenizer("Hello").input_ids[0])
                    await h.engine.send(TokenDelta(request_id=rid, tokens=[tok], num_prompt_tokens=3))
                resp = await posting
                line = await resp.content.readline()
                assert line.startswith(b"data: ")
                resp.close()  # the client goes away mid-stream
            # Both choices open: one Abort of the request stops them all (and prepare could drop it).
            await h.engine.wait_for(lambda: h.engine.aborts == [req.request_id])
            assert h.actor._exchanges == {}

    run(body)


def test_a_write_to_a_client_gone_is_a_499_without_a_traceback(harness):
    """A write that meets the closed connection (before aiohttp cancels the
    handler) ends the request as a 499, answered to aiohttp, which finishes
    quietly: raised, aiohttp logs it as "Error handling request" with a traceback."""
    from aiohttp import ClientConnectionResetError
    from aiohttp.test_utils import make_mocked_request

    async def body():
        async with harness() as h:
            async def handler(request):
                raise ClientConnectionResetError("Cannot write to closing transport")

            request = make_mocked_request("POST", CHAT)
            response = await h.actor._errors_middleware(request, handler)
            assert response.status == 499
            assert 'status="499"} 1.0' in await h.metrics()  # (a mocked request matches no route)

    run(body)


def test_disconnect_while_waiting_aborts(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = hold
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(h.url + CHAT, json=chat_body()))
                await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
                task.cancel()
            await h.engine.wait_for(lambda: h.engine.aborts == list(h.engine.requests))

    run(body)


def test_error_mid_stream_is_an_error_event_then_done(harness):
    """As vLLM's stream: the error's event, then [DONE] (a client reading to it does not wait on)."""
    async def body():
        async with harness() as h:
            def fail_after_one(req):
                first = h.engine.reply(req)[0]
                return [first, Failed(request_id=req.request_id, status=500, message="device lost",
                                      error_type="server_error")]
            h.engine.plan = fail_after_one
            status, events = await h.stream(CHAT, chat_body())
            assert status == 200
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["message"].endswith("device lost")
            assert events[-2]["error"]["type"] == "server_error"

    run(body)


def test_a_failure_of_a_whole_request_fails_the_exchange(harness):
    """Prepare and the adapter pool fail a request, not its choices."""
    async def body():
        async with harness() as h:
            h.engine.plan = lambda req: [Failed(request_id=req.request_id, status=400, param="messages",
                                                message="image 0 could not be decoded")]
            status, r = await h.post(CHAT, chat_body(n=2))
            assert status == 400 and r["error"]["message"].endswith("could not be decoded")
            assert h.actor._exchanges == {}

    run(body)


def test_an_empty_model_name_is_the_base_as_vllms(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(model=""))
            assert status == 200 and r["model"] == "tiny", r
            status, r = await h.post("/tokenize", {"model": "", "prompt": "hi"})
            assert status == 200, r

    run(body)


def test_engine_refusal_before_output_keeps_its_status(harness):
    async def body():
        async with harness() as h:
            h.engine.plan = lambda req: [Failed(request_id=req.request_id, status=400, param="messages",
                                                message="prompt of 999 tokens exceeds max_model_len 256")]
            status, r = await h.post(CHAT, chat_body())
            assert status == 400 and r["error"]["param"] == "messages"
            status, (r,) = await h.stream(CHAT, chat_body())
            assert status == 400 and "max_model_len" in r["error"]["message"]
            # the client's mistake is no request's end in vLLM's request_success (it read as aborts)
            assert 'finished_reason="abort",model_name="tiny"} 0.0' in await h.metrics()

    run(body)


def test_a_refused_prompt_of_a_list_is_named_by_its_index(harness):
    """A completion of several prompts refused for one of them says which (vLLM's batch prompts)."""
    async def body():
        async with harness() as h:
            status, r = await h.post(COMP, {"model": "tiny", "prompt": ["a b", "hello " * 300], "max_tokens": 2})
            assert status == 400 and r["error"]["code"] == "context_length_exceeded", r
            assert r["error"]["message"].startswith("prompt[1]: the prompt has "), r
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hello " * 300, "max_tokens": 2})
            assert status == 400 and r["error"]["message"].startswith("the prompt has "), r
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hello " * 120})  # no cap sent: 16
            assert status == 400 and r["error"]["param"] == "max_tokens", r
            assert r["error"]["message"].endswith("(no max_tokens was sent: a completion's is 16 then)"), r

    run(body)


def test_a_refused_cap_is_named_by_the_field_the_client_sent(harness):
    """The engine names the output's cap max_tokens; a client that sent max_completion_tokens reads that."""
    async def body():
        async with harness() as h:
            for field in ("max_tokens", "max_completion_tokens"):
                for path, sent in ((CHAT, chat_body(**{field: 255})), (COMP, {"model": "tiny", "prompt": "a b",
                                                                             field: 255})):
                    status, r = await h.post(path, sent)
                    assert status == 400 and r["error"]["param"] == field, r
                    assert r["error"]["code"] == "context_length_exceeded"
                    assert r["error"]["message"].startswith(f"{field} is 255, but the prompt has "), r
            # the prompt's logprobs an echo with logprobs asks for are named by logprobs, the field it sent
            h.engine.plan = lambda req: [Failed(request_id=req.request_id, status=400, param="prompt_logprobs",
                                                message="too many entries")]
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 2})
            assert status == 400 and r["error"]["param"] == "logprobs", r
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hi", "prompt_logprobs": 2})
            assert status == 400 and r["error"]["param"] == "prompt_logprobs", r

    run(body)


def test_stop_reason_names_a_listed_stop_token_that_ignore_eos_passed(harness, tokenizer):
    """As vLLM: an EOS ending has no stop_reason; under ignore_eos, EOS listed in stop_token_ids stops as listed."""
    eos = tokenizer.eos_token_id

    async def body():
        async with harness() as h:
            _, r = await h.post(CHAT, chat_body(stop_token_ids=[eos]))
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] is None
            _, r = await h.post(CHAT, chat_body(stop_token_ids=[eos], ignore_eos=True))
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == eos, r

    run(body)


def test_top_logprobs_zero_asks_for_nothing_and_needs_no_logprobs(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(top_logprobs=0))
            assert status == 200 and r["choices"][0]["logprobs"] is None, r
            status, r = await h.post(CHAT, chat_body(top_logprobs=1))
            assert status == 400 and r["error"]["param"] == "top_logprobs"

    run(body)


def test_a_preparation_line_past_its_bound_is_a_503_with_retry_after(harness):
    """Prepare's 503 ``overloaded`` (its media lines full) tells the client when to retry, as admission's."""
    async def body():
        from mstar_actors.messages import Failed

        async with harness() as h:
            h.engine.plan = lambda req: [Failed(request_id=req.request_id, status=503, code="overloaded",
                                                error_type="server_error", message="64 requests wait; retry later")]
            async with h.session.post(h.url + CHAT, data=json.dumps(chat_body()).encode()) as resp:
                r = await resp.json()
                assert resp.status == 503 and r["error"]["code"] == "overloaded", r
                assert resp.headers["Retry-After"] == "1"

    run(body)


def test_backpressure_is_503_over_max_waiting(harness):
    async def body():
        async with harness(max_waiting_requests=2) as h:
            h.engine.plan = hold
            full = h.actor.config.scheduler.max_num_seqs  # every sequence taken: what comes now waits
            await h.engine.send(EngineStats(num_running=full, num_waiting=0, num_kv_blocks_used=3,
                                            num_kv_blocks_total=10))
            held = [asyncio.create_task(h.post(CHAT, chat_body())) for _ in range(2)]
            await h.engine.wait_for(lambda: len(h.engine.requests) == 2)
            async with h.session.post(h.url + CHAT, data=json.dumps(chat_body()).encode()) as resp:
                r = await resp.json()
                assert resp.status == 503 and r["error"]["code"] == "overloaded", r
                assert resp.headers["Retry-After"] == "1" and "server.max_waiting_requests" in r["error"]["message"]
            for req in list(h.engine.requests.values()):
                for msg in h.engine.reply(req):
                    await h.engine.send(msg)
            assert [s for s, _ in await asyncio.gather(*held)] == [200, 200]
            await h.engine.send(EngineStats(num_running=0, num_waiting=5, num_kv_blocks_used=3, num_kv_blocks_total=10))
            status, _ = await h.post(CHAT, chat_body())
            assert status == 503
            # sequences free while the engine has a queue (preempted ones, prompts waiting for KV room) are the
            # queue's: two waiting and one free seat leave no room for a third waiting
            await h.engine.send(EngineStats(num_running=full - 1, num_waiting=2, num_kv_blocks_used=9,
                                            num_kv_blocks_total=10))
            status, _ = await h.post(CHAT, chat_body())
            assert status == 503
            await h.engine.send(EngineStats(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10))
            h.engine.plan = h.engine.reply
            status, _ = await h.post(CHAT, chat_body())
            assert status == 200

    run(body)


def test_a_burst_at_an_idle_server_is_admitted_up_to_its_sequences_plus_max_waiting(harness):
    """Choices with no output yet count as waiting only past the sequences the
    engine can still start: with 2 sequences free and room for 2 waiting, 4
    of a burst go in (they were refused past 2 before)."""
    async def body():
        async with harness(max_waiting_requests=2) as h:
            scheduler = msgspec.structs.replace(h.actor.config.scheduler, max_num_seqs=2)
            h.actor.config = msgspec.structs.replace(h.actor.config, scheduler=scheduler)
            h.engine.plan = hold
            held = [asyncio.create_task(h.post(CHAT, chat_body())) for _ in range(4)]
            await h.engine.wait_for(lambda: len(h.engine.requests) == 4)
            status, r = await h.post(CHAT, chat_body())
            assert status == 503 and r["error"]["code"] == "overloaded", r
            for req in list(h.engine.requests.values()):
                for msg in h.engine.reply(req):
                    await h.engine.send(msg)
            assert [s for s, _ in await asyncio.gather(*held)] == [200] * 4
            # one request of several choices fills the free sequences too; more than can ever fit is a 400
            before = set(h.engine.requests)
            held = asyncio.create_task(h.post(CHAT, chat_body(n=4)))
            await h.engine.wait_for(lambda: set(h.engine.requests) - before)
            (rid,) = set(h.engine.requests) - before
            for msg in h.engine.reply(h.engine.requests[rid]):
                await h.engine.send(msg)
            assert (await held)[0] == 200
            status, r = await h.post(CHAT, chat_body(n=5))
            assert status == 400 and r["error"]["param"] == "n" and "max_waiting_requests" in r["error"]["message"]

    run(body)


def test_a_burst_the_engine_reports_in_the_middle_of_is_admitted_as_one_it_does_not(harness):
    """The engine's report after it planned the first of the burst (one
    running, its prefill in flight, no token yet) leaves the room the burst
    had: 2 sequences and 3 waiting take 5 (the running one was counted as
    waiting too: 4 went in)."""
    async def body():
        async with harness(max_waiting_requests=3) as h:
            scheduler = msgspec.structs.replace(h.actor.config.scheduler, max_num_seqs=2)
            h.actor.config = msgspec.structs.replace(h.actor.config, scheduler=scheduler)
            h.engine.plan = hold
            first = asyncio.create_task(h.post(CHAT, chat_body()))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            await h.engine.send(EngineStats(num_running=1, num_waiting=0, num_starting=1, num_kv_blocks_used=1,
                                            num_kv_blocks_total=10))
            while h.actor._num_engine_starting != 1:
                await asyncio.sleep(0)
            held = [asyncio.create_task(h.post(CHAT, chat_body())) for _ in range(4)]
            await h.engine.wait_for(lambda: len(h.engine.requests) == 5)
            status, r = await h.post(CHAT, chat_body())
            assert status == 503, r
            assert "3 sequences waiting, the limit of 3" in r["error"]["message"], r
            for req in list(h.engine.requests.values()):
                for msg in h.engine.reply(req):
                    await h.engine.send(msg)
            assert [s for s, _ in await asyncio.gather(first, *held)] == [200] * 5

    run(body)


def test_auth_model_size_and_route_errors(harness):
    async def body():
        async with harness(api_key="sekret", max_body_bytes=1 << 20) as h:
            status, r = await h.post(CHAT, chat_body())
            assert status == 401 and r["error"]["code"] == "invalid_api_key"
            status, r = await h.post(CHAT, chat_body(), {"Authorization": "Bearer wrong"})
            assert status == 401
            ok = {"Authorization": "Bearer sekret"}
            async with h.session.get(h.url + "/health") as resp:
                assert resp.status == 200  # open without the key
            for path in ("/tokenize", "/tokenize/", "/detokenize/", "/v1/models/"):  # a trailing slash is the route
                async with h.session.post(h.url + path, json={"prompt": "x"}) as resp:
                    assert resp.status == 401, path
            status, r = await h.post(CHAT, chat_body(model="nope"), ok)
            assert status == 404 and r["error"]["code"] == "model_not_found" and r["error"]["param"] == "model"
            status, r = await h.post(CHAT, chat_body(model="tiny-lora"), ok)
            assert status == 200 and r["model"] == "tiny-lora"
            big = json.dumps(chat_body(user="x" * (10 << 20))).encode()
            status, r = await h.post(CHAT, big, ok)
            assert status == 413 and set(r["error"]) == {"message", "type", "param", "code"}
            status, r = await h.post("/v1/nothing", {}, ok)
            assert status == 404 and "error" in r
            async with h.session.get(h.url + "/v1/models", headers=ok) as resp:
                models = await resp.json()
            assert [m["id"] for m in models["data"]] == ["tiny", "tiny-lora"]
            assert models["data"][0]["max_model_len"] == 256
            # the scheme's case is free (RFC 7235); /tokenize takes the key too, as vLLM's
            status, r = await h.post(CHAT, chat_body(), {"Authorization": "bearer sekret"})
            assert status == 200
            status, r = await h.post("/tokenize", {"model": "tiny", "prompt": "x"})
            assert status == 401
            # Expect: 100-continue: a refused body is refused before the client sends it
            for headers, status in (("", 401), ("Authorization: Bearer sekret\r\n", 413)):
                host, port = h.url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                             f"Content-Length: {8 << 20}\r\nExpect: 100-continue\r\n\r\n".encode())
                answer = await reader.readline()
                writer.close()
                assert answer.split()[1] == str(status).encode(), answer  # no "100 Continue" first

            async def raw(request: bytes) -> bytes:
                host, port = h.url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(request)
                data = await reader.read(1 << 16)
                writer.close()
                return data

            # another expectation is ignored, as uvicorn's, on every route (aiohttp's plain-text 417 bypassed the
            # envelope, before the key); on a path no route serves, the 404 is still the envelope
            for path in ("/health", "/v1/models"):
                answer = await raw(f"GET {path} HTTP/1.1\r\nHost: x\r\nExpect: foo\r\n"
                                   "Authorization: Bearer sekret\r\n\r\n".encode())
                assert answer.startswith(b"HTTP/1.1 200"), answer
                assert b"\r\nServer: mstar-actors\r\n" in answer and b"aiohttp" not in answer, answer  # no versions
            answer = await raw(b"GET /nope HTTP/1.1\r\nHost: x\r\nExpect: foo\r\n\r\n")
            assert b"application/json" in answer and b'"error"' in answer and b"text/plain" not in answer, answer
            # a request line with no version (HTTP/0.9) was answered "HTTP/0.9 200" with headers
            answer = await raw(b"GET /health\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 400") and b"no HTTP version" in answer, answer
            # a 405 names the methods the route takes
            async with h.session.get(h.url + "/tokenize", headers=ok) as resp:
                assert resp.status == 405 and "POST" in resp.headers["Allow"]

    run(body)


@pytest.mark.parametrize("allowed, origin, expected", [(["*"], "http://a.example", "*"),
                                                       (["http://a.example"], "http://a.example", "http://a.example"),
                                                       (["http://a.example"], "http://b.example", None),
                                                       ([], "http://a.example", None)])
def test_cors_preflights_need_no_key_and_responses_name_the_origin(harness, allowed, origin, expected):
    async def body():
        async with harness(api_key="sekret", allowed_origins=allowed) as h:
            preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type"}
            async with h.session.options(h.url + CHAT, headers=preflight) as resp:
                assert resp.status == (200 if expected is not None else 400)  # a 400 naming it, as vLLM's (a 401 was)
                if expected is None:
                    assert f"disallowed CORS origin '{origin}'" in (await resp.json())["error"]["message"]
                else:
                    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
                    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            headers = {"Origin": origin, "Authorization": "Bearer sekret"}
            for stream in (False, True):
                async with h.session.post(h.url + CHAT, json=chat_body(stream=stream), headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 200 and resp.headers.get("Access-Control-Allow-Origin") == expected

    run(body)


def test_the_context_the_engine_agreed_bounds_max_tokens_and_is_listed(harness):
    async def body():
        async with harness() as h:
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "Hello", "max_tokens": 200})
            assert status == 200  # the launcher's context: 256
            await h.engine.send(ContextAgreed(max_model_len=100))  # the ranks' KV cache holds less
            while h.actor.info.max_model_len != 100:  # applied by the actor's mailbox, on this loop
                await asyncio.sleep(0)
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "Hello", "max_tokens": 200})
            assert status == 400 and r["error"]["param"] == "max_tokens"
            async with h.session.get(h.url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["max_model_len"] == 100

    run(body)


def test_starting_and_peer_failure(harness):
    async def body():
        async with harness(started=False) as h:
            async with h.session.get(h.url + "/health") as resp:
                assert resp.status == 503
            async with h.session.post(h.url + CHAT, data=json.dumps(chat_body()).encode()) as resp:
                r = await resp.json()
                assert resp.status == 503 and "starting" in r["error"]["message"] and resp.headers["Retry-After"] == "5"
            for path in ("/v1/models", "/v1/models/tiny"):  # a readiness probe on the model list waits too
                async with h.session.get(h.url + path) as resp:
                    assert resp.status == 503 and "starting" in (await resp.json())["error"]["message"], path
            await h.start()
            async with h.session.get(h.url + "/v1/models") as resp:
                assert resp.status == 200
            h.engine.plan = hold
            pending = asyncio.create_task(h.post(CHAT, chat_body()))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 1)
            await h.control(PeerFailed(actor="worker0", reason="killed by signal 9"))
            status, r = await pending
            assert status == 503 and "worker0" in r["error"]["message"]
            async with h.session.get(h.url + "/health") as resp:
                assert resp.status == 503
            status, later = await h.post(CHAT, chat_body())
            assert status == 503 and later["error"]["type"] == r["error"]["type"] == "service_unavailable_error"

    run(body)


def test_bad_inputs_over_http_then_a_good_request(harness):
    async def body():
        async with harness() as h:
            for kind, raw, param in BAD:
                status, r = await h.post(CHAT if kind == "chat" else COMP, raw)
                assert status == 400, (param, r)
                assert r["error"]["param"] == param
            status, r = await h.post(CHAT, chat_body())
            assert status == 200 and r["choices"][0]["message"]["content"] == REPLY

    run(body)


def test_a_trailing_slash_is_the_route_without_it(harness):
    async def body():
        async with harness() as h:
            for method, path in (("GET", "/health/"), ("GET", "/v1/models/"), ("HEAD", "/health/"),
                                 ("GET", "/v1/models/tiny/")):
                async with h.session.request(method, h.url + path) as resp:
                    assert resp.status == 200, (path, resp.status)
            async with h.session.get(h.url + "/metrics/") as resp:  # an alias counts as its route
                text = await resp.text()
            assert 'route="/health",status="200"} 2.0' in text and 'route="/v1/models/"' not in text
            async with h.session.post(h.url + "/v1/chat/completions/", json=chat_body()) as resp:
                assert resp.status == 200 and (await resp.json())["object"] == "chat.completion"
            async with h.session.get(h.url + "/v1/chat/completions/") as resp:
                assert resp.status == 405 and "POST" in resp.headers["Allow"]
            async with h.session.get(h.url + "/nowhere/") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"

    run(body)


def test_a_refused_request_leaves_a_line_in_the_log(harness, caplog):
    """vLLM's access log and validation errors say why a client's requests fail; so does ours, one line each."""
    async def body():
        async with harness() as h:
            with caplog.at_level("INFO"):
                status, _ = await h.post(CHAT, chat_body(max_tokens=-1))
                assert status == 400
                status, _ = await h.post("/v1/nope", {})
                assert status == 404
                status, _ = await h.post("/v1/no%0A2026-12-05 ERROR forged" + "a" * 3000, {})
                assert status == 404
            lines = [r.getMessage() for r in caplog.records]
            forged = [ln for ln in lines if "forged" in ln]
            assert forged and all("\n" not in ln and len(ln) < 600 for ln in forged), forged  # no forged line
            assert any(ln.startswith("POST /v1/chat/completions: 400 ") and "max_tokens" in ln for ln in lines), lines
            assert any(ln.startswith("POST /v1/nope: 404 ") for ln in lines), lines

    run(body)


def test_an_echo_with_a_cap_of_zero_generates_nothing_in_the_metrics(harness):
    """``echo`` with ``max_tokens: 0``: the engine's one token is not the client's, in usage and metrics alike."""
    async def body():
        async with harness() as h:
            status, r = await h.post(COMP, {"model": "tiny", "prompt": "hi there", "echo": True, "max_tokens": 0})
            assert status == 200 and r["usage"]["completion_tokens"] == 0
            text = await h.metrics()
            assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 0.0' in text

    run(body)


def test_a_request_s_params_are_observed_once_whatever_its_n(harness):
    """vLLM observes n and max_tokens once a parent request, not once a choice."""
    async def body():
        async with harness() as h:
            status, r = await h.post(CHAT, chat_body(n=3, max_tokens=40, logprobs=True))
            assert status == 200
            text = await h.metrics()
            model = '{engine="0",model_name="tiny"}'
            assert f"vllm:request_params_n_count{model} 1.0" in text and f"vllm:request_params_n_sum{model} 3.0" in text
            assert f"vllm:request_params_max_tokens_sum{model} 40.0" in text
            assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 3.0' in text

            def value(name: str) -> float:
                return float(next(ln for ln in text.splitlines() if ln.startswith(f"{name}{model} ")).split()[-1])

            # vLLM's: the most a choice generated, once a request; each choice's computed prompt and preemptions
            assert value("vllm:request_max_num_generation_tokens_count") == 1
            most = max(len(c["logprobs"]["content"]) for c in r["choices"])
            assert value("vllm:request_max_num_generation_tokens_sum") == most > 0
            assert value("vllm:request_prefill_kv_computed_tokens_count") == 3
            assert value("vllm:request_prefill_kv_computed_tokens_sum") == 3 * r["usage"]["prompt_tokens"]
            assert value("vllm:request_num_preemptions_count") == 3 and value("vllm:request_num_preemptions_sum") == 0

    run(body)


def test_metrics(harness):
    async def body():
        async with harness() as h:
            await h.post(CHAT, chat_body())
            await h.post(CHAT, chat_body(n=0))
            await h.engine.send(EngineStats(num_running=2, num_waiting=1, num_kv_blocks_used=7, num_kv_blocks_total=10,
                                            num_preemptions=3))
            await h.post(CHAT, chat_body())  # the stats are applied before this reply is
            async with h.session.get(h.url + CHAT) as resp:
                assert resp.status == 405
            async with h.session.delete(h.url + "/v1/models/tiny") as resp:
                assert resp.status == 405
            text = await h.metrics()
            assert 'mstar_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
            assert 'mstar_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
            assert 'mstar_requests_total{route="/v1/chat/completions",status="405"} 1.0' in text  # its route's
            assert 'mstar_requests_total{route="/v1/models/{model_id}",status="405"} 1.0' in text
            # vLLM's names, labelled by the served model, for dashboards made for vLLM
            model = '{engine="0",model_name="tiny"}'
            assert f"vllm:generation_tokens_total{model} 18.0" in text
            assert f"vllm:time_to_first_token_seconds_count{model} 2.0" in text
            # vLLM's buckets, a long queue's
            assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",' in text
            assert f"vllm:inter_token_latency_seconds_count{model}" in text
            assert f"vllm:e2e_request_latency_seconds_count{model} 2.0" in text
            for phase in ("queue", "prefill", "decode", "inference"):  # vLLM's dashboard's phases of a request
                assert f"vllm:request_{phase}_time_seconds_count{model} 2.0" in text
            assert f"vllm:request_generation_tokens_sum{model} 18.0" in text
            assert 'vllm:request_prompt_tokens_bucket{engine="0",le="5.0",' in text  # vLLM's 1-2-5 buckets
            assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0' in text
            for reason in ("length", "abort"):  # every reason from the start, as vLLM's
                assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="tiny"}} 0.0' \
                    in text
            assert f"vllm:prompt_tokens_total{model} " in text
            assert f"vllm:request_params_n_count{model} 2.0" in text and f"vllm:request_params_n_sum{model} 2.0" in text
            assert f"vllm:request_params_max_tokens_count{model} 2.0" in text
            assert f"vllm:request_time_per_output_token_seconds_count{model} 2.0" in text
            assert f"vllm:prompt_tokens_cached_total{model} 0.0" in text
            assert 'vllm:cache_config_info{block_size="16",cache_dtype="float32",enable_prefix_caching="True",' \
                   'engine="0",' \
                   'num_gpu_blocks="10"} 1.0' in text
            assert "vllm:lora_requests_info" not in text  # no adapter served here

            def value(name: str) -> float:
                return float(next(ln for ln in text.splitlines() if ln.startswith(f"{name}{model} ")).split()[-1])

            # the prefix cache's hit rate as vLLM's dashboards read it (each request's scheduler here is a new one:
            # every prompt looked up, none held)
            assert value("vllm:prefix_cache_queries_total") == value("vllm:prompt_tokens_total") > 0
            assert value("vllm:prefix_cache_hits_total") == 0
            assert "mstar_kv_blocks_used 7.0" in text and f"vllm:num_requests_running{model} 2.0" in text
            assert f"vllm:kv_cache_usage_perc{model} 0.7" in text
            assert "# TYPE vllm:num_preemptions_total counter" in text and f"vllm:num_preemptions_total{model} 3.0" in text
            # a request whose client went away is counted too, as 499 (it was left out)
            h.engine.plan = lambda req: None  # held: no reply comes
            posting = asyncio.create_task(h.post(CHAT, chat_body()))
            await h.engine.wait_for(lambda: len(h.engine.requests) == 3)
            posting.cancel()
            text = await h.metrics()
            while 'status="499"' not in text:  # the server sees the connection close a moment later
                await asyncio.sleep(0.02)
                text = await h.metrics()
            assert 'mstar_requests_total{route="/v1/chat/completions",status="499"} 1.0' in text

    run(body)


def test_a_parked_sequence_reads_waiting_in_the_gauges(harness):
    """Its adapter out of the slots, a running sequence is in no step: vLLM's gauges count it waiting (for its
    adapter: deferred), where they counted it running while lora_requests_info listed its adapter waiting."""
    async def body():
        async with harness() as h:
            await h.engine.send(EngineStats(num_running=3, num_waiting=1, num_kv_blocks_used=1, num_kv_blocks_total=8,
                                            num_parked=1, num_waiting_for_adapter=1, num_waiting_deferred=1))
            await h.post(CHAT, chat_body())  # the stats are applied before this reply is
            text = await h.metrics()
            model = '{engine="0",model_name="tiny"}'
            assert f"vllm:num_requests_running{model} 2.0" in text and f"vllm:num_requests_waiting{model} 2.0" in text
            for reason, count in (("capacity", 1), ("deferred", 1)):
                assert f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="tiny",reason="{reason}"}} ' \
                       f"{count}.0" in text, text

    run(body)


def test_admission_counts_what_the_engine_can_still_start():
    """The pure rule: an idle engine's free sequences take a burst; a queue takes none; one request too large
    for the server at all is a 400 naming n (no retry helps)."""
    from mstar_actors.frontend.admission import EngineLoad, admission_refusal

    idle = EngineLoad()
    assert admission_refusal(12, 1, idle, max_num_seqs=8, max_waiting=4) is None  # 8 start, 4 wait
    assert admission_refusal(13, 1, idle, max_num_seqs=8, max_waiting=4).param == "prompt"  # never fits: a 400
    # a request goes in while fewer than the limit wait, however many its choices: 3 of 4 waiting takes one of 12
    # (one whose choices must fit the room left was refused while smaller ones kept a choice or two waiting)
    queued = EngineLoad(num_waiting=3, num_running=8)
    assert admission_refusal(1, 1, queued, max_num_seqs=8, max_waiting=4) is None
    assert admission_refusal(12, 12, queued, max_num_seqs=8, max_waiting=4) is None
    assert admission_refusal(1, 1, EngineLoad(num_waiting=4, num_running=8), max_num_seqs=8,
                             max_waiting=4).code == "overloaded"
    sent = EngineLoad(num_running=2, num_starting=1, num_unacked=10)  # 9 sent, not started: 6 free seats take 6
    assert admission_refusal(4, 1, sent, max_num_seqs=8, max_waiting=4) is None
    sent = EngineLoad(num_running=2, num_starting=1, num_unacked=11)  # 10 sent: 4 waiting
    assert admission_refusal(1, 1, sent, max_num_seqs=8, max_waiting=4).status == 503
    too_many = admission_refusal(13, 13, idle, max_num_seqs=8, max_waiting=4)
    assert too_many.status == 400 and too_many.param == "n"
    # three frontends share the engine's 4 free seqs: each takes its share (2, rounded up) and 2 waiting, 12 in all
    # before the next report, 8 waiting; each took all 4 as its own, 18 in all, 14 waiting
    for sent in range(6):
        load = EngineLoad(num_unacked=sent, num_frontends=3)
        assert (admission_refusal(1, 1, load, max_num_seqs=4, max_waiting=2) is None) == (sent < 4), sent
    # one request that fits an idle engine goes in through any frontend (a 503 no retry helps, else)
    for seqs, waiting, frontends, n in ((8, 1, 3, 4), (2, 1, 4, 2), (256, 64, 4, 300)):
        assert admission_refusal(n, n, EngineLoad(num_frontends=frontends), max_num_seqs=seqs,
                                 max_waiting=waiting) is None


def test_chat_echo_puts_the_continued_assistant_message_before_the_reply(harness):
    """vLLM's chat echo: the last message's text where it is the assistant's (the reply continues it), before the
    reply's content, whole and streamed (a chunk of its own after the role); after a user's message, nothing."""
    async def body():
        async with harness() as h:
            h.engine.reply_text = " and more"
            continued = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
            request = chat_body(messages=continued, echo=True, add_generation_prompt=False,
                                continue_final_message=True)
            status, r = await h.post(CHAT, request)
            assert status == 200 and r["choices"][0]["message"]["content"] == "Sure, and more", r
            status, events = await h.stream(CHAT, request | {"n": 2})
            assert status == 200, events
            for index in (0, 1):
                deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"][0]["index"] == index]
                assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Sure,"}], deltas
                assert "".join(d.get("content", "") for d in deltas) == "Sure, and more"
            usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            status, events = await h.stream(CHAT, request | usage)
            role, echo = events[:2]  # the echo is no token of the reply: none counted yet
            assert echo["choices"][0]["delta"] == {"content": "Sure,"} and echo["usage"]["completion_tokens"] == 0
            assert echo["usage"] == role["usage"], echo
            status, r = await h.post(CHAT, chat_body(echo=True))  # the last message is the user's
            assert status == 200 and r["choices"][0]["message"]["content"] == " and more", r

    run(body)
