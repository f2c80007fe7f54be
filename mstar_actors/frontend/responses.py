"""What a client of the OpenAI routes receives: a whole response's body, or
its server-sent events as the engine's outputs arrive, and speech's audio.

``Stream`` writes one exchange's chunks in OpenAI's SSE format (a chunk's
envelope encoded once, the role chunk first, reasoning and tool calls apart
where a parser reads them, vLLM's ``return_token_ids`` and
``continuous_usage_stats``); ``full_body`` builds the non-streamed response
from the same choices, so the two agree. The frontend actor applies engine
messages to an ``Exchange``'s choices and hands the results here.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from mstar_actors.frontend import openai_api as api
from mstar_actors.frontend.openai_api import ApiError, ChoiceOutput, ParsedRequest
from mstar_actors.frontend.reasoning import ReasoningStream, split_reasoning
from mstar_actors.frontend.responses_api import ResponseEvents
from mstar_actors.frontend.tool_calls import (ForcedCallStream, HermesCallStream, finish_reason, read_calls,
                                              stream_reader)

if TYPE_CHECKING:
    from mstar_actors.frontend.exchange import Exchange

_json = msgspec.json.Encoder()


def usage(exchange: Exchange) -> dict:
    """The response's usage: each prompt's tokens once (not per choice), every choice's outputs."""
    choices = [c for c in exchange.choices.values() if c.index % exchange.parsed.n == 0]
    prompt = sum(c.num_prompt_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices)
    return api.usage_dict(prompt, sum(c.num_output_tokens for c in exchange.choices.values()), cached)


def full_body(exchange: Exchange, token_text: Any) -> dict:
    """The non-streamed response of a finished exchange (``token_text``: a token id's text, for prompt logprobs)."""
    choices = sorted(exchange.choices.values(), key=lambda c: c.index)
    args = (exchange.response_id, exchange.model, exchange.created)
    if exchange.parsed.kind == "chat":
        out = [api.chat_choice(c.index, c.text, c.finish_reason, c.chat_logprobs()) for c in choices]
        out = [with_reasoning(exchange, choice) for choice in out]
        out = [with_tool_calls(exchange.parsed, choice, own.stop_reason) for choice, own in zip(out, choices)]
        if exchange.parsed.chat_echo:  # vLLM's echo: the continued message's text before the reply's content
            for choice in out:
                choice["message"]["content"] = exchange.parsed.chat_echo + (choice["message"]["content"] or "")
        body = api.chat_response(*args, out, usage(exchange))
    else:
        out = [api.completion_choice(c.index, c.echo_text + c.text, c.finish_reason, c.legacy_logprobs())
               for c in choices]
        body = api.completion_response(*args, out, usage(exchange))
    for choice, own in zip(out, choices):
        choice["stop_reason"] = own.stop_reason
    if exchange.parsed.output.prompt_logprobs is not None:  # vLLM's: once for chat's one prompt, else per choice
        scores = [api.vllm_prompt_logprobs(c.prompt_scores, token_text, exchange.parsed.output.prompt_logprobs)
                  for c in choices]
        if exchange.parsed.kind == "chat":
            body["prompt_logprobs"] = scores[0]
        else:
            for choice, own in zip(out, scores):
                choice["prompt_logprobs"] = own
    if exchange.parsed.output.return_token_ids:
        add_token_ids(body, exchange, choices)
    return body


async def write_runs(stream: Stream, runs: dict[int, Output]) -> None:
    for run in runs.values():
        await stream.write_choice(run.merged())


@dataclasses.dataclass
class Output:
    """A choice's text to stream, with its logprob entries; with a reasoning parser, the reasoning
    before it apart (``Stream.take``), with its entries and the end of its token ids. Outputs of
    one choice merge in order (a reply's reasoning always comes before its answer)."""

    choice: ChoiceOutput
    text: str
    entries: list
    thought: str = ""
    thought_entries: list = dataclasses.field(default_factory=list)
    thought_ids_end: int = 0
    later: list = dataclasses.field(default_factory=list)  # outputs joined after this one (``extend``)

    def extend(self, later: "Output") -> None:
        """``later`` after this one, joined once when written (``merged``): a run held for many tokens
        (``stream_interval``) is not copied at each."""
        self.later.append(later)

    def merged(self) -> "Output":
        """One output of this one and those ``extend`` added, in order."""
        if not self.later:
            return self
        parts = [self, *self.later]
        return Output(self.choice, "".join(p.text for p in parts), [e for p in parts for e in p.entries],
                      "".join(p.thought for p in parts), [e for p in parts for e in p.thought_entries],
                      max(p.thought_ids_end for p in parts))


def add_token_ids(body: dict, exchange: Exchange, choices: list[ChoiceOutput]) -> None:
    """vLLM's return_token_ids: the prompt's ids (chat: once; completions: per
    choice) and each choice's sampled ids."""
    if exchange.parsed.kind == "chat":
        body["prompt_token_ids"] = prompt_ids(choices)
    for c, out in zip(choices, body["choices"]):
        out["token_ids"] = c.token_ids
        if exchange.parsed.kind != "chat":
            out["prompt_token_ids"] = c.prompt_token_ids


def prompt_ids(choices: Any) -> list[int] | None:
    """The prompt's ids as the engine sent them with a choice's first delta (a chat request's choices share
    one prompt); None where no choice got one (each ended before its first token: an abort)."""
    return next((c.prompt_token_ids for c in choices if c.prompt_token_ids is not None), None)


class Stream:
    """Writes one exchange's chunks in OpenAI's SSE format."""

    def __init__(self, request: web.Request, exchange: Exchange):
        self.request = request
        self.exchange = exchange
        # vLLM's continuous_usage_stats: with include_usage, each chunk's own choice's usage so far
        self.continuous = exchange.parsed.output.continuous_usage_stats  # with include_usage (``_parse_stream``)
        self._by_index = {c.index: c for c in exchange.choices.values()}
        self.is_chat = exchange.parsed.kind == "chat"
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache"})
        self.tool_readers = tool_readers(exchange) if self.is_chat else {}
        self.reasoning = ({i: ReasoningStream(*exchange.reasoning) for i in range(exchange.num_choices)}
                          if exchange.reasoning is not None else {})
        self._held_entries: dict[int, list] = {}  # choice -> entries of text a reasoning stream holds back
        self._ids_seen: dict[int, int] = {}  # choice -> its token ids at its last output taken
        self.reasoning_ids: dict[int, int] = {}  # choice -> where its reasoning's token ids end, shown or not
        self.build = api.chat_chunk if self.is_chat else api.completion_chunk
        # Every chunk's bytes around its choices, encoded once (None: the usage changes per chunk)
        self._envelope = None if self.continuous else chunk_envelope(self.build, exchange, self._usage_field())

    @property
    def is_prepared(self) -> bool:
        return self.response.prepared

    async def _prepare(self) -> None:
        await self.response.prepare(self.request)
        if self.is_chat:  # the first chunk of each choice carries the role
            ex = self.exchange
            for index in range(ex.num_choices):
                # return_token_ids: the prompt's ids once, on the first chunk (as vLLM)
                returns_ids = ex.parsed.output.return_token_ids and not index
                extra = {"prompt_token_ids": prompt_ids(ex.choices.values())} if returns_ids else {}
                choice = self._by_index.get(index)
                if self.continuous and choice is not None:  # the role chunk delivers no output token yet
                    extra["usage"] = api.usage_dict(choice.num_prompt_tokens, 0, choice.num_cached_tokens)
                role = api.chat_chunk_choice(index, {"role": "assistant", "content": ""}, None, None)
                await self._write_choices([role], extra, choice)
                if ex.parsed.chat_echo:  # vLLM's echo: the continued message's text, a chunk of its own (no token)
                    echo = api.chat_chunk_choice(index, {"content": ex.parsed.chat_echo}, None, None)
                    await self._write_choices([echo], {"usage": extra["usage"]} if "usage" in extra else {}, choice)

    def take(self, choice: ChoiceOutput, text: str, entries: list) -> Output:
        """One applied output of ``choice``, its reasoning apart where a parser reads it
        (``model.reasoning_parser``): the entries and token ids of text held back as a possible tag
        wait with it; an output that ends the reasoning and starts the answer gives its own to the
        answer."""
        stream = self.reasoning.get(choice.index)
        if stream is None:
            return Output(choice, text, entries)
        thought, text = stream.feed(text)
        if choice.is_done:
            more_thought, more_text = stream.flush()
            thought, text = thought + more_thought, text + more_text
        entries = self._held_entries.pop(choice.index, []) + entries
        before, now = self._ids_seen.get(choice.index, 0), len(choice.token_ids)
        self._ids_seen[choice.index] = now
        if thought:  # (its tokens: those up to the output's, or up to the answer's it starts)
            self.reasoning_ids[choice.index] = now if not text else before
        if not self.exchange.parsed.include_reasoning:  # dropped: its entries and ids go with the answer's
            thought = ""
        if not (thought or text):
            if not choice.is_done:  # all held back
                self._held_entries[choice.index] = entries
                return Output(choice, "", [])
            return Output(choice, "", entries)  # the end (an EOS's entry): on the last chunk
        if not text:
            return Output(choice, "", [], thought, entries, now)
        return Output(choice, text, entries, thought, [], before if thought else 0)

    async def write_choice(self, out: Output) -> None:
        choice, text, entries = out.choice, out.text, out.entries
        if out.thought:
            if not self.is_prepared:
                await self._prepare()
            logprobs = choice.chat_logprobs(out.thought_entries)
            await self._write_choice(choice, api.chat_chunk_choice(choice.index, {"reasoning": out.thought}, None,
                                                                   logprobs), ids_end=out.thought_ids_end)
        if not (text or entries or choice.is_done):
            return  # e.g. held back by the detokenizer or a possible stop string
        if not self.is_prepared:
            await self._prepare()
        reason = choice.finish_reason
        if choice.echo_text and not choice.is_echoed:
            text, choice.is_echoed = choice.echo_text + text, True
        if self.is_chat:
            delta = {"content": text} if text else {}
            if choice.index in self.tool_readers:
                deltas, reason = self._tool_deltas(choice, text)
                if not (deltas or entries or choice.is_done):
                    return
                await self._write_tool_chunks(choice, deltas, reason, choice.chat_logprobs(entries))
                return
            logprobs = choice.chat_logprobs(entries)
            out = api.chat_chunk_choice(choice.index, delta, reason, logprobs)
        else:
            logprobs = choice.legacy_logprobs(entries)
            out = api.completion_choice(choice.index, text, reason, logprobs)
        await self._write_choice(choice, out)

    async def _write_choice(self, choice: ChoiceOutput, out: dict, ids_end: int | None = None) -> None:
        """``ids_end``: the chunk's token ids end there (a reasoning chunk's), else at the last."""
        if out["finish_reason"] is not None:
            out["stop_reason"] = choice.stop_reason
        if self.exchange.parsed.output.return_token_ids:
            if not self.is_chat and not choice.is_prompt_sent:  # completions: per choice, on its first chunk
                out["prompt_token_ids"] = choice.prompt_token_ids
                choice.is_prompt_sent = True
            end = len(choice.token_ids) if ids_end is None else max(ids_end, choice.num_streamed_ids)
            out["token_ids"] = choice.token_ids[choice.num_streamed_ids:end]
            choice.num_streamed_ids = end
        await self._write_choices([out], choice=choice)

    def _tool_deltas(self, choice: ChoiceOutput, text: str) -> tuple[list[dict], str | None]:
        """The chunks' deltas with markup of tool calls held back: the content,
        then each call once it is complete (its head, then its arguments), a
        forced reply's calls as they are written; and the choice's finish reason."""
        reader = self.tool_readers[choice.index]
        reason = functools.partial(finish_reason, self.exchange.parsed.tools, choice.finish_reason,
                                   stop_reason=choice.stop_reason)
        if isinstance(reader, ForcedCallStream):  # a forced reply's calls, streamed as they are written
            parts = reader.feed(text) + (reader.flush() if choice.is_done else [])
            return [{"tool_calls": [part]} for part in parts], reason(reader.num_calls)
        if isinstance(reader, HermesCallStream):  # content and calls in order, arguments as they are written
            deltas = reader.feed(text) + (reader.flush() if choice.is_done else [])
            return deltas, reason(reader.num_calls)
        first_index = reader.num_calls
        content, calls = reader.feed(text)
        if choice.is_done:
            tail, more = reader.flush()
            content, calls = content + tail, calls + more
        deltas = [{"content": content}] if content else []
        for k, call in enumerate(calls):
            deltas += [{"tool_calls": [part]} for part in call.as_deltas(first_index + k)]
        return deltas, reason(reader.num_calls)

    async def _write_tool_chunks(self, choice: ChoiceOutput, deltas: list[dict], reason: str | None,
                                 logprobs: list[dict] | None) -> None:
        """A chunk a delta (the logprobs on the first); the finish reason on the
        last, or on a chunk of its own after calls (as OpenAI's: clients close a
        call they streamed when the finish comes after it)."""
        if reason is not None and deltas and "tool_calls" in deltas[-1]:
            deltas = deltas + [{}]
        deltas = deltas or [{}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            await self._write_choice(choice, api.chat_chunk_choice(choice.index, delta, reason if last else None,
                                                                   logprobs if k == 0 else None))

    async def _write_choices(self, choices: list[dict], extra: dict | None = None,
                             choice: ChoiceOutput | None = None) -> None:
        if self._envelope is not None and not extra:
            head, tail = self._envelope
            body = _json.encode(choices[0]) if len(choices) == 1 else b",".join([_json.encode(c) for c in choices])
            await self.response.write(head + body + tail)
            return
        ex = self.exchange
        await write_event(self.response, self.build(ex.response_id, ex.model, ex.created, choices)
                           | self._usage_field(choice) | (extra or {}))

    def _usage_field(self, choice: ChoiceOutput | None = None) -> dict:
        """What a chunk with choices says of usage: nothing, null (include_usage),
        or (continuous) its choice's so far: its prompt's tokens and its own
        outputs, as vLLM's."""
        if self.continuous and choice is not None:
            return {"usage": api.usage_dict(choice.num_prompt_tokens, choice.num_output_tokens,
                                            choice.num_cached_tokens)}
        return {"usage": None} if self.exchange.parsed.include_usage else {}

    async def finish(self, usage: dict) -> None:
        """Every choice ended: the usage chunk (include_usage), then the stream's end."""
        if self.exchange.parsed.include_usage:
            ex = self.exchange
            await write_event(self.response, self.build(ex.response_id, ex.model, ex.created, [], usage))
        await self.response.write(b"data: [DONE]\n\n")

    async def fail(self, err: ApiError) -> None:
        """A failure after the stream began: the client sees it, then the stream's end (as vLLM's)."""
        await write_event(self.response, err.envelope())
        await self.response.write(b"data: [DONE]\n\n")


class ResponsesStream(Stream):
    """A ``/v1/responses`` reply (``responses_api``): the chat stream's chunk choices made its events,
    written as SSE where it streams, else run to its final Response (``response``, once finished)."""

    def __init__(self, request: web.Request, exchange: Exchange, asked: Any, store: Any = None):
        super().__init__(request, exchange)
        self.asked = asked
        self.store = store if asked.store else None  # (``response_store.ResponseStore``) keeps the Response
        self._envelope = None
        sampling = exchange.parsed.sampling
        self.events = ResponseEvents(exchange.response_id, exchange.model, exchange.created, asked.echo,
                                     {"temperature": sampling.temperature, "top_p": sampling.top_p})
        self._started = False

    @property
    def is_prepared(self) -> bool:  # a non-streamed reply's failure is an error response
        return self.asked.stream and self.response.prepared

    async def _prepare(self) -> None:
        if self._started:
            return
        self._started = True
        if self.asked.stream:
            await self.response.prepare(self.request)
        await self._write(self.events.start())

    async def _write_choice(self, choice: ChoiceOutput, out: dict, ids_end: int | None = None) -> None:
        await self._write(self.events.chunk(out))

    async def finish(self, usage: dict) -> None:
        await self._prepare()  # (a reply of no text: its events still open)
        # OpenAI's reasoning_tokens: those generated, shown or not (include_reasoning false)
        events = self.events.end(usage, max(self.reasoning_ids.values(), default=0))
        if self.store is not None and not self.store.put(self.events.response, self.asked.items):
            for response in (self.events.response, events[-1]["response"]):  # past the whole store: not kept
                response["store"] = False
        await self._write(events)
        if not self.asked.stream:
            self.response = web.Response(body=_json.encode(self.events.response), content_type="application/json")

    async def fail(self, err: ApiError) -> None:
        await self._write(self.events.fail(self.asked.renamed(err)))

    async def _write(self, events: list[dict]) -> None:
        if self.asked.stream:
            for event in events:
                await self.response.write(b"event: " + event["type"].encode() + b"\ndata: " + _json.encode(event)
                                          + b"\n\n")


async def write_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + _json.encode(payload) + b"\n\n")


def chunk_envelope(build: Any, exchange: Exchange, usage: dict) -> tuple[bytes, bytes]:
    """The SSE bytes of ``build``'s chunk (with ``usage``) before and after
    its list of choices: a chunk is then ``head + choices + tail``, the bytes
    ``write_event`` would write, without building and encoding the
    envelope per event."""
    marker = uuid.uuid4().hex  # a string no id or model name holds
    chunk = build(exchange.response_id, exchange.model, exchange.created, [marker]) | usage
    data = b"data: " + _json.encode(chunk) + b"\n\n"
    head, tail = data.split(_json.encode(marker))
    return head, tail


class SpeechOut:
    """Writes a speech response: the file's bytes as they come (``audio``), or
    OpenAI's ``speech.audio.delta`` / ``speech.audio.done`` events (``sse``)."""

    def __init__(self, request: web.Request, response_format: str, stream_format: str, sample_rate: int):
        from mstar_actors.frontend import speech_api

        self.api = speech_api
        self.request = request
        self.is_sse = stream_format == "sse"
        content_type = "text/event-stream; charset=utf-8" if self.is_sse else speech_api.CONTENT_TYPES[response_format]
        self.response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
        self._head = speech_api.wav_header(sample_rate) if response_format == "wav" else b""

    @property
    def is_prepared(self) -> bool:
        return self.response.prepared

    async def write(self, pcm: bytes) -> None:
        if not pcm:
            return
        if not self.is_prepared:
            await self.response.prepare(self.request)
            pcm, self._head = self._head + pcm, b""
        await self.response.write(self.api.sse_delta(pcm) if self.is_sse else pcm)

    async def finish(self, num_input_tokens: int, num_output_tokens: int) -> None:
        if not self.is_prepared:  # no audio at all: the bare header
            await self.response.prepare(self.request)
            if self._head:
                await self.response.write(self.api.sse_delta(self._head) if self.is_sse else self._head)
        if self.is_sse:
            await self.response.write(self.api.sse_done(num_input_tokens, num_output_tokens))
        await self.response.write_eof()

    async def fail(self, err: ApiError) -> None:
        """After bytes left: an error event, or (raw audio) the connection cut
        before the body's end, so the client sees a truncated transfer."""
        if self.is_sse:
            await self.response.write(self.api.sse_error(err))
        elif self.request.transport is not None:
            self.request.transport.close()


def tool_readers(exchange: Exchange) -> dict[int, Any]:
    """Choice index -> its tool-call reader (content and calls split as text
    streams in), when the request reads tool calls."""
    tools = exchange.parsed.tools
    if tools is None or not tools.reads_calls:
        return {}
    return {index: stream_reader(tools) for index in range(exchange.num_choices)}


def with_reasoning(exchange: Exchange, choice: dict) -> dict:
    """A full chat choice with its reasoning apart (``model.reasoning_parser``): ``reasoning``, and the
    answer in content (null when the reply is all reasoning, as vLLM's)."""
    if exchange.reasoning is None:
        return choice
    message = choice["message"]
    parser, opened, call_opening = exchange.reasoning
    reasoning, content = split_reasoning(parser, message["content"], opened, call_opening)
    message["content"] = content if content or reasoning is None else None
    if reasoning and exchange.parsed.include_reasoning:  # (an empty one, as a stream sends none: absent)
        message["reasoning"] = reasoning
    return choice


def with_tool_calls(parsed: ParsedRequest, choice: dict, stop_reason: str | int | None) -> dict:
    """A full chat choice with the calls its text made (content: the text
    around them, or null), when the request reads tool calls."""
    if parsed.tools is None or not parsed.tools.reads_calls:
        return choice
    message = choice["message"]
    content, calls = read_calls(parsed.tools, message["content"] or "")
    message["content"] = content if message["content"] is not None else None
    if calls:
        message["tool_calls"] = [call.as_dict() for call in calls]
    choice["finish_reason"] = finish_reason(parsed.tools, choice["finish_reason"], len(calls), stop_reason)
    return choice
