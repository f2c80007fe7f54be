"""A reply's reasoning apart from its answer (``model.reasoning_parser``): the pure splitter, then the
frontend's chat responses, whole and streamed, against vLLM's ``--reasoning-parser`` fields."""

import asyncio

import pytest

from mstar_actors.frontend.reasoning import ReasoningStream, prompt_reasoning, reasoning_end, split_reasoning
from mstar_actors.messages import ChatMessage

CASES = [  # parser, reply, the prompt opened <think>, (reasoning, content)
    ("qwen3", "<think>\nI think.\n</think>\n\nThe answer is 4.", False, ("\nI think.\n", "\n\nThe answer is 4.")),
    ("qwen3", "The answer is 4.", False, (None, "The answer is 4.")),  # enable_thinking: false
    ("qwen3", "I think.\n</think>\n\nThe answer.", True, ("I think.\n", "\n\nThe answer.")),  # the template opened it
    ("qwen3", "  <think>cut off by max_tokens", False, ("cut off by max_tokens", "")),
    ("qwen3", "<thinking is not a tag", False, (None, "<thinking is not a tag")),
    ("qwen3", "<thi", False, (None, "<thi")),  # a tag's start that never finished is text
    ("qwen3", "a </think> b", False, (None, "a </think> b")),  # nothing opened: all answer
    ("qwen3", "\n<think>", False, ("", "")),  # cut right after its opening: reasoning, empty
    ("deepseek_r1", "<think>", False, ("", "")),  # a tag written anyway is no reasoning text
    ("deepseek_r1", "I think.</think>Answer", False, ("I think.", "Answer")),
    ("deepseek_r1", "<think>I think.</think>Answer", False, ("I think.", "Answer")),
    ("deepseek_r1", "no end", False, ("no end", "")),
    ("deepseek_r1", "x </thi", False, ("x </thi", "")),
]


CALL_CASES = [  # a reply that reads Qwen3.5's calls: one opened ends the reasoning and is the answer's (vLLM's)
    ("qwen3", "plan<tool_call>\n<function=f>", True, ("plan", "<tool_call>\n<function=f>")),
    ("qwen3", "<think>a</think>b<tool_call>", False, ("a", "b<tool_call>")),
    ("qwen3", "<think>a <tool_call>\n<func", False, ("a <tool_call>\n<func", "")),  # never finished
    ("qwen3", "<think>a <tool_call> tags</think>b", False, ("a <tool_call> tags", "b")),  # no function: text
]


@pytest.mark.parametrize("parser,text,opened,want", CASES + CALL_CASES)
def test_whole_and_streamed_replies_split_alike(parser, text, opened, want):
    calls = "<tool_call>\n<function=" if (parser, text, opened, want) in CALL_CASES else None
    assert split_reasoning(parser, text, opened, calls) == want
    for size in (1, 2, 5):  # any cut of the stream gives the same split
        stream, thought, answer = ReasoningStream(parser, opened, calls), "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i : i + size])
            thought, answer = thought + r, answer + c
        r, c = stream.flush()
        assert (thought + r, answer + c) == (want[0] or "", want[1])


def test_a_prompt_that_ends_inside_think_opens_the_reasoning():
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n") == "open"
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"  # enable_thinking: false


@pytest.mark.parametrize("prompt,end", [
    ("<|im_start|>assistant\n<think>\n", "\n</think>\n\n"),  # Qwen3.5's: the off form, "<think>\n\n</think>\n\n"
    ("<|im_start|>assistant\n<think>", "\n\n</think>\n\n"),
    ("<|im_start|>assistant\n<think>\nLet me see", "</think>\n\n"),  # thoughts of its own
    ("<|im_start|>assistant\n", "<think>\n\n</think>\n\n"),  # none opened: the whole off form
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ""),
])
def test_a_reply_that_gives_no_reasoning_follows_it_closed_as_the_template_closes_it(prompt, end):
    assert reasoning_end(prompt) == end
    assert prompt_reasoning("<|im_start|>assistant\n") is None
    with pytest.raises(ValueError, match="accepted: qwen3, deepseek_r1"):
        ReasoningStream("granite")


# ---------------------------------------------------------------- served

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
THOUGHT = "<think>\nsay hello\n</think>\n\nHello world!"


def run(fn):
    asyncio.run(asyncio.wait_for(fn(), 15))


def test_a_chat_reply_has_its_reasoning_apart(harness):
    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = THOUGHT
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS})
            assert status == 200, r
            message = r["choices"][0]["message"]
            assert message["reasoning"] == "\nsay hello\n" and message["content"] == "\n\nHello world!"
            status, events = await h.stream(CHAT, {"model": "tiny", "messages": MSGS})
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            assert "".join(d.get("reasoning", "") for d in deltas) == "\nsay hello\n"
            assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello world!"
            first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
            assert all("reasoning" not in d for d in deltas[first_answer:])  # reasoning first, then the answer
            # include_reasoning: false (vLLM's) drops it, whole and streamed
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "include_reasoning": False})
            assert "reasoning" not in r["choices"][0]["message"]
            assert r["choices"][0]["message"]["content"] == "\n\nHello world!"
            status, events = await h.stream(CHAT, {"model": "tiny", "messages": MSGS, "include_reasoning": False})
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            assert all("reasoning" not in d for d in deltas)
            assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello world!"
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "include_reasoning": "no"})
            assert status == 400 and r["error"]["param"] == "include_reasoning"
            # a reply cut inside its reasoning: all reasoning, content null (vLLM's)
            h.engine.reply_text = "<think>\nstill thinking"
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS})
            message = r["choices"][0]["message"]
            assert message["content"] is None and message["reasoning"] == "\nstill thinking"

    run(body)


def test_without_a_parser_the_reply_is_all_content(harness):
    async def body():
        async with harness() as h:
            h.engine.reply_text = THOUGHT
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "include_reasoning": True})
            assert status == 200 and r["choices"][0]["message"]["content"] == THOUGHT
            assert "reasoning" not in r["choices"][0]["message"]

    run(body)


def test_a_tool_call_opened_inside_the_reasoning(harness):
    """A hermes ``<tool_call>`` inside the reasoning stays reasoning (a call only thought about is not
    made); a Qwen3.5 (``qwen3_coder``) call opened there ends it and is the answer's, as vLLM's qwen3
    parser reads Qwen3.5 calling without closing its thinking; whole and streamed alike."""
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    xml_call = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def replies(h) -> list[tuple[str, list, str]]:
        out = []
        for stream in (False, True):
            request = {"model": "tiny", "messages": MSGS, "tools": tools}
            if stream:
                _, events = await h.stream(CHAT, request)
                deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
                reasoning = "".join(d.get("reasoning", "") for d in deltas)
                calls = [c for d in deltas for c in d.get("tool_calls") or [] if "id" in c]
                finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
            else:
                _, r = await h.post(CHAT, request)
                message, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
                reasoning, calls = message["reasoning"], message.get("tool_calls") or []
            out.append((reasoning, len(calls), finish))
        return out

    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3", "tool_call_parser": "qwen3_coder"}) as h:
            h.engine.reply_text = f"<think>\nI need f.\n{xml_call}"
            assert await replies(h) == [("\nI need f.\n", 1, "tool_calls")] * 2
            h.engine.reply_text = "<think>\nwrap it in <tool_call> tags? no.\n</think>\n\nDone."  # no function
            assert await replies(h) == [("\nwrap it in <tool_call> tags? no.\n", 0, "stop")] * 2
        async with harness(model_keys={"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}) as h:
            h.engine.reply_text = f"<think>\nI could write {call} but no.\n</think>\n\nNo call."
            assert await replies(h) == [(f"\nI could write {call} but no.\n", 0, "stop")] * 2
            h.engine.reply_text = f"<think>\nneeds f\n</think>\n\n{call}"
            _, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": tools})
            message = r["choices"][0]["message"]
            assert message["reasoning"] == "\nneeds f\n" and message["tool_calls"][0]["function"]["name"] == "f"
            assert r["choices"][0]["finish_reason"] == "tool_calls"

    run(body)


def _templated(tmp_path, template: str):
    """(folder, tokenizer, Tokenization) of the tests' ChatML tokenizer with ``template`` as its chat template."""
    from transformers import AutoTokenizer

    from mstar_actors.tokenization import Tokenization
    from tests.frontend.conftest import make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    tok.save_pretrained(str(folder))
    return folder, tok, Tokenization(folder)


def test_a_template_that_opens_think_in_its_generation_prompt(tmp_path):
    """Qwen3.5-style: the generation prompt ends with ``<think>`` unless enable_thinking is false."""
    _, _, tokenization = _templated(tmp_path, (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
        "{% else %}<think>\n{% endif %}{% endif %}"))
    assert prompt_reasoning(tokenization.generation_prompt(None)) == "open"
    assert prompt_reasoning(tokenization.generation_prompt({"enable_thinking": False})) == "closed"


def test_streamed_logprobs_and_token_ids_go_with_their_part(harness):
    """Outputs queued together leave in one event a choice; the reasoning's logprobs and token ids go on its
    chunk, the answer's on the answer's, for each of n choices."""
    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = THOUGHT
            request = {"model": "tiny", "messages": MSGS, "logprobs": True, "n": 2, "return_token_ids": True}
            status, events = await h.stream(CHAT, request)
            tok = h.engine.tokenizer
            for index in (0, 1):
                chunks = [c for e in events[:-1] for c in e["choices"] if c["index"] == index]
                thought = [c for c in chunks if "reasoning" in c["delta"]]
                answer = [c for c in chunks if c["delta"].get("content")]
                assert thought and answer
                ids = [i for c in chunks for i in c.get("token_ids", [])]
                assert ids == tok(THOUGHT).input_ids + [tok.eos_token_id]
                answer_ids = [i for c in answer for i in c["token_ids"]]
                assert "Hello world!" in tok.decode(answer_ids) and "say hello" not in tok.decode(answer_ids)
                words = "".join(e["token"] for c in answer for e in c["logprobs"]["content"])
                assert "world" in words and "say" not in words
                words = "".join(e["token"] for c in thought for e in c["logprobs"]["content"])
                assert "say" in words and "world" not in words

    run(body)


def test_a_reply_of_its_opening_alone_and_tool_parsing_keep_content_null(harness):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}) as h:
            for reply in ("<think>", "<think>\nstill"):
                h.engine.reply_text = reply
                for extra in ({}, {"tools": tools}):
                    status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS} | extra)
                    message = r["choices"][0]["message"]
                    assert message["content"] is None and "<think>" not in message.get("reasoning", ""), r
                    assert ("reasoning" in message) == (reply != "<think>")  # empty: absent, as a stream sends none

    run(body)


def test_the_template_probe_keeps_flag_sets_not_documents(harness):
    """The generation prompt is rendered once per set of chat_template_kwargs; a kwarg holding a large value
    is rendered each time, not kept."""
    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3"}) as h:
            for kwargs in ({"enable_thinking": False}, {"doc": "x" * 100_000}):
                await h.post(CHAT, {"model": "tiny", "messages": MSGS, "chat_template_kwargs": kwargs})
            assert list(h.actor._opening) == ['{"enable_thinking":false}']

    run(body)


def test_structured_outputs_hold_after_the_reasoning(tmp_path):
    """With <think> and </think> tokens of its own, a constrained chat reply is sent with them
    (``StructuredSpec.reasoning``: the ranks hold it to its grammar after </think>) and read with its
    reasoning apart; a forced tool call and a tokenizer without such tokens are held from the first token."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import Harness, make_tokenizer_dir

    from mstar_actors.tokenization import Tokenization

    special = make_tokenizer_dir(tmp_path / "special")  # tags a reply's decode drops: no token-level gate
    tok = AutoTokenizer.from_pretrained(str(special))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(str(special))
    assert Tokenization(special).single_token_id("</think>") is None
    plain = make_tokenizer_dir(tmp_path / "plain")
    folder = make_tokenizer_dir(tmp_path / "think")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(folder))
    think = tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = '<think>\nplan\n</think>\n\n{"a": 1}'
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "response_format": schema})
            assert status == 200, r
            message = r["choices"][0]["message"]
            assert message["reasoning"] == "\nplan\n" and message["content"] == '\n\n{"a": 1}'
            spec = next(iter(h.engine.requests.values())).sampling.structured
            assert spec.kind == "json" and spec.reasoning == think and not spec.opened
            h.engine.requests.clear()
            h.engine.reply_text = '{"name": "f", "arguments": {}}'
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": tools,
                                             "tool_choice": "required"})
            assert status == 200 and r["choices"][0]["message"]["tool_calls"], r
            forced = next(iter(h.engine.requests.values()))
            assert forced.sampling.structured.reasoning == ()
            assert forced.assistant_prefix == "<think>\n\n</think>\n\n"  # thinking skipped as the template skips it
        plain_tok = AutoTokenizer.from_pretrained(str(plain))
        async with Harness(plain, plain_tok, model_keys={"reasoning_parser": "deepseek_r1"}) as h:
            h.engine.reply_text = '{"a": 1}'
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "response_format": schema})
            assert status == 200 and r["choices"][0]["message"]["content"] == '{"a": 1}', r
            assert "reasoning" not in r["choices"][0]["message"]
            assert next(iter(h.engine.requests.values())).sampling.structured.reasoning == ()

    run(body)


def test_a_thinking_budget_goes_to_the_engine_with_the_think_ids_or_is_a_400(tmp_path):
    """vLLM's thinking_token_budget, chat and completions: sent with the model's <think> and </think> ids (the
    ranks count by them, ``runner.sampling.ThinkingBudget``); a model without a reasoning parser, or whose tags
    are no tokens of its own, refuses it by name."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import Harness, make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path / "think")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(folder))
    think = tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))

    async def body():
        for keys, want in (({"reasoning_parser": "qwen3"}, think), ({}, None)):
            async with Harness(folder, tok, model_keys=keys) as h:
                h.engine.reply_text = "<think>\nplan\n</think>\n\nok"
                for route, request in ((CHAT, {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})):
                    h.engine.requests.clear()
                    status, r = await h.post(route, {"model": "tiny", "thinking_token_budget": 3} | request)
                    if want is None:
                        assert status == 400 and r["error"]["param"] == "thinking_token_budget", r
                        continue
                    assert status == 200, r
                    sampling = next(iter(h.engine.requests.values())).sampling
                    assert (sampling.thinking_budget, sampling.think_ids) == (3, think)

    run(body)


def test_a_prompt_that_closed_or_opened_the_reasoning_decides_the_reply(tmp_path):
    """``enable_thinking: false`` (the template writes ``<think></think>``): the reply is all answer and a
    constraint holds from its first token, no <think> let through (vLLM reads reasoning as ended in the
    prompt); a continued final message inside ``<think>`` is read as reasoning until ``</think>``."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import Harness, make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path / "think")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                         "{% else %}<think>\n{% endif %}{% endif %}")
    tok.save_pretrained(str(folder))
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    off = {"enable_thinking": False}

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = '{"a": 1}'
            for extra in ({"response_format": schema}, {}):
                request = {"model": "tiny", "messages": MSGS, "chat_template_kwargs": off} | extra
                status, r = await h.post(CHAT, request)
                assert status == 200 and r["choices"][0]["message"]["content"] == '{"a": 1}', r
                assert "reasoning" not in r["choices"][0]["message"]
            spec = next(iter(h.engine.requests.values())).sampling.structured
            assert spec.reasoning == () and not spec.opened  # held from the first token: no <think> let through
            h.engine.requests.clear()
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "response_format": schema})
            assert next(iter(h.engine.requests.values())).sampling.structured.opened  # the template opened it
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            # a forced call: never inside <think>, the prompt's "<think>\n" closed as the template's off form
            for kwargs, prefix in (({}, "\n</think>\n\n"), (off, "")):
                h.engine.requests.clear()
                h.engine.reply_text = '{"name": "f", "parameters": {}}'
                status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": tools,
                                                 "tool_choice": "required", "chat_template_kwargs": kwargs})
                assert status == 200 and r["choices"][0]["message"]["tool_calls"], r
                assert next(iter(h.engine.requests.values())).assistant_prefix == prefix
            h.engine.requests.clear()
            h.engine.reply_text = " more</think>\n\nDone."
            continued = MSGS + [{"role": "assistant", "content": "<think>\nLet me think"}]
            status, r = await h.post(CHAT, {"model": "tiny", "messages": continued, "add_generation_prompt": False,
                                             "continue_final_message": True})
            assert status == 200, r
            message = r["choices"][0]["message"]
            assert message["reasoning"] == " more" and message["content"] == "\n\nDone.", message
            h.engine.reply_text = " <think>no</think> yes"  # a continued answer (no tag: templates close the rest)
            answer = MSGS + [{"role": "assistant", "content": "Sure,"}]
            status, r = await h.post(CHAT, {"model": "tiny", "messages": answer, "add_generation_prompt": False,
                                             "continue_final_message": True})
            assert status == 200 and r["choices"][0]["message"]["content"] == " <think>no</think> yes", r
            assert "reasoning" not in r["choices"][0]["message"], r

    run(body)


def test_a_dropped_reasoning_keeps_its_logprobs_and_ids_whole_and_streamed_alike(harness):
    """``include_reasoning: false``: a whole reply's logprobs and token ids cover every output token (vLLM's);
    a stream's carry the dropped reasoning's with the answer's, the same entries."""
    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = THOUGHT
            request = {"model": "tiny", "messages": MSGS, "logprobs": True, "return_token_ids": True,
                       "include_reasoning": False}
            status, r = await h.post(CHAT, request)
            whole = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
            status, events = await h.stream(CHAT, request)
            chunks = [c for e in events[:-1] for c in e["choices"]]
            assert all("reasoning" not in c["delta"] for c in chunks)
            streamed = [e["token"] for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
            assert streamed == whole and len(whole) == len(r["choices"][0]["token_ids"])
            assert [i for c in chunks for i in c.get("token_ids", [])] == r["choices"][0]["token_ids"]
            assert "".join(c["delta"].get("content") or "" for c in chunks) == r["choices"][0]["message"]["content"]

    run(body)


def test_a_strict_tool_s_calls_hold_from_the_first_token_and_the_reply_still_reasons(harness):
    """Its rule lets any text through between calls, so it is not held back to after </think>: a call a reply
    opens while thinking is held too, and the reply's reasoning is read apart (it was not, on a model whose
    think tags are several tokens)."""
    strict = [{"type": "function", "function": {"name": "f", "strict": True,
                                                "parameters": {"type": "object", "properties": {}}}}]

    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}) as h:
            h.engine.reply_text = "<think>\nhm</think>\n\nfine"
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": strict})
            assert status == 200 and r["choices"][0]["message"]["reasoning"] == "\nhm", r
            spec = next(iter(h.engine.requests.values())).sampling.structured
            assert spec.kind == "tagged_calls" and spec.reasoning == ()

    run(body)


def test_a_strict_call_opened_while_thinking_beside_an_answer_s_rule_stays_reasoning(tmp_path):
    """With response_format the rule holds after </think>: a Qwen3.5 call opened inside the reasoning was never
    held to its schema, so it is not read as a call (it was: arguments breaking the strict schema)."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import Harness, make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path / "think")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(folder))
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    opened = "<tool_call>\n<function=f>\n</function>\n</tool_call>"

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3",
                                                    "tool_call_parser": "qwen3_coder"}) as h:
            h.engine.reply_text = f"<think>\nI need f.\n{opened}"
            for extra in ({"response_format": answer}, {}):
                status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": strict} | extra)
                message = r["choices"][0]["message"]
                # beside the answer's rule: reasoning; alone, the strict rule held it from the first token (a
                # call, as the reader reads it)
                assert bool(message.get("tool_calls")) == ("response_format" not in extra), (extra, r)

    run(body)


def _think_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tests.frontend.conftest import make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path / "think")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(folder))
    return folder, tok


def test_hermes_strict_calls_hold_after_the_reasoning_whose_calls_stay_reasoning(tmp_path):
    """hermes' reader keeps a call written inside the reasoning as reasoning, but the strict calls' rule held
    from the first token, counting it: with parallel_tool_calls false the reply ended at that call, all of it
    reasoning. The rule now holds after </think>, as any other constraint."""
    from tests.frontend.conftest import Harness

    folder, tok = _think_tokenizer(tmp_path)
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    thought = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}) as h:
            h.engine.reply_text = f"<think>\nI will {thought}</think>\n\nfine"
            status, r = await h.post(CHAT, {"model": "tiny", "messages": MSGS, "tools": strict,
                                            "parallel_tool_calls": False})
            message = r["choices"][0]["message"]
            assert status == 200 and thought in message["reasoning"] and not message.get("tool_calls"), r
            assert message["content"].strip() == "fine"
            spec = next(iter(h.engine.requests.values())).sampling.structured
            assert spec.kind == "tagged_calls" and spec.reasoning == tuple(tok.convert_tokens_to_ids(["<think>",
                                                                                                      "</think>"]))

    run(body)


def test_a_qwen3_coder_call_opened_while_thinking_stays_reasoning_beside_a_response_format(tmp_path):
    """response_format holds after </think>, where the grammar sees the reasoning end; the reader ended it at a
    call opened inside it instead, so the rest of the reasoning and </think> came out as the answer (no JSON)."""
    from tests.frontend.conftest import Harness

    folder, tok = _think_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    opened = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3",
                                                    "tool_call_parser": "qwen3_coder"}) as h:
            h.engine.reply_text = f'<think>\nplan {opened}\nok</think>{{"x": 2}}'
            for stream in (False, True):
                body = {"model": "tiny", "messages": MSGS, "tools": tools, "response_format": answer}
                if stream:
                    _, chunks = await h.stream(CHAT, body)
                    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]" and c["choices"]]
                    content = "".join(d.get("content") or "" for d in deltas)
                    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
                    calls = [d for d in deltas if d.get("tool_calls")]
                else:
                    status, r = await h.post(CHAT, body)
                    message = r["choices"][0]["message"]
                    content, reasoning, calls = message["content"], message["reasoning"], message.get("tool_calls")
                assert content == '{"x": 2}' and opened in reasoning and not calls, (stream, content, reasoning)

    run(body)


def test_a_template_that_wants_a_system_turn_is_read_from_the_request_s_own_messages(tmp_path):
    """A template that refuses a lone user turn failed the generation prompt's probe, read then as opening
    nothing: a reply after the prompt's <think> came back all content, </think> in it, while the ranks
    knew the reasoning was open. Such a template's generation prompt is read from the request's own render."""
    from tests.frontend.conftest import Harness

    folder, tok, tokenization = _templated(tmp_path, (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"))
    assert prompt_reasoning(tokenization.generation_prompt(None)) == "open"  # the probe after a system turn
    chat = [ChatMessage("system", "s"), ChatMessage("user", "hi")]
    assert tokenization.generation_prompt_of(chat, None, "hermes") == "<|im_start|>assistant\n<think>\n"
    assert tokenization.generation_prompt_of(chat[1:], None, "hermes") == ""  # refused: the request's own error
    # a template no probe passes (it wants a turn named "boss"), and one that closes a conversation asking for no
    # reply with a token of its own: read from the request's render, past what both renders share
    _, _, strict = _templated(tmp_path / "strict", (
        "{% if messages[0]['content'] != 'boss' %}{{ raise_exception('boss first') }}{% endif %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        "{% if add_generation_prompt %}<think>\n{% else %}<|endoftext|>{% endif %}"))
    assert strict.generation_prompt(None) is None
    read = strict.generation_prompt_of([ChatMessage("user", "boss"), ChatMessage("user", "hi")], None, "hermes")
    assert read.endswith("<think>\n") and prompt_reasoning(read) == "open", read  # (from its line: "<" is shared)

    async def body():
        async with Harness(folder, tok, model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = "I think.\n</think>\n\nThe answer."
            messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
            status, r = await h.post(CHAT, {"model": "tiny", "messages": messages})
            message = r["choices"][0]["message"]
            assert status == 200 and (message["reasoning"], message["content"]) == ("I think.\n", "\n\nThe answer."), r

    run(body)


def test_a_response_counts_its_reasoning_tokens_shown_or_not(harness):
    """OpenAI's output_tokens_details.reasoning_tokens counts what the reply reasoned, whether or not it is
    shown: with include_reasoning false it was 0 (only written reasoning was counted)."""
    async def body():
        async with harness(model_keys={"reasoning_parser": "qwen3"}) as h:
            h.engine.reply_text = THOUGHT
            counts = {}
            for shown in (True, False):
                for stream in (False, True):
                    request = {"model": "tiny", "input": "hi", "include_reasoning": shown, "stream": stream}
                    if stream:
                        status, events = await h.stream("/v1/responses", request)
                        r = [e for e in events if isinstance(e, dict) and e.get("type") == "response.completed"]
                        r = r[0]["response"]
                    else:
                        status, r = await h.post("/v1/responses", request)
                    assert status == 200, r
                    assert any(item["type"] == "reasoning" for item in r["output"]) == shown, r
                    counts[shown, stream] = r["usage"]["output_tokens_details"]["reasoning_tokens"]
            assert len(set(counts.values())) == 1 and counts[True, False] > 0, counts

    run(body)
