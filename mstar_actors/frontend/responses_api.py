"""``POST /v1/responses`` (OpenAI's Responses API), served as the chat it asks for. Pure, no I/O.

``read_responses`` reads a Responses body into the chat-completions body that asks for the same reply:
``instructions`` a system message first; ``input`` a string (one user message) or items: messages
(``input_text`` / ``output_text`` / ``input_image`` parts), ``function_call`` items an assistant's tool
calls, ``function_call_output`` items tool messages, ``reasoning`` items the next assistant message's
reasoning; function tools as OpenAI flattens them; ``text.format`` the response format;
``max_output_tokens`` the cap; ``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` the
output's logprobs. Every field the chat path checks is checked there, its error named by the field this
request sent (``ResponsesRequest.renamed``).

With ``server.responses_store_mib`` a Response whose request left ``store`` true is kept
(``response_store``) and ``previous_response_id`` continues its conversation: its input items and its
output, then the new input (its ``instructions`` are not carried over, as OpenAI's are not). Without it
nothing is stored (vLLM without its store answers the same) and the response says ``store: false``. What
needs a server-side run or state kept elsewhere (``conversation``, ``background``, ``prompt``, tools other
than functions) is a 400 saying what to send instead.

``ResponseEvents`` turns the chat stream's chunks into the Responses stream's events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ..., ``response.completed``); a
non-streamed request runs the same events and answers their final response, so the two agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

import msgspec

from mstar_actors.frontend.openai_api import (MAX_TOP_LOGPROBS, ApiError, _bad, _show, check_cache_retention,
                                              check_known, check_verbosity, decode_body, get_bool, get_int, get_str)
from mstar_actors.frontend.response_store import ResponseStore

# Read here, or handed to the chat path under the same name (its checks, its meaning).
OWN_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "include",
    "top_logprobs", "reasoning", "stream", "stream_options", "store", "truncation", "background",
    "previous_response_id", "conversation", "prompt", "max_tool_calls", "prompt_cache_retention",
})
CHAT_FIELDS = frozenset({
    "temperature", "top_p", "parallel_tool_calls", "metadata", "user", "service_tier", "safety_identifier",
    "prompt_cache_key",
    # vLLM's extensions of its Responses request, as its chat reads them
    "seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "ignore_eos", "cache_salt", "request_id", "priority", "chat_template_kwargs", "logit_bias",
    "skip_special_tokens", "include_stop_str_in_output", "stop_token_ids", "structured_outputs",
    "include_reasoning", "prompt_cache_options",
})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
NOT_STORED = ("nothing is stored here (each response is answered and forgotten, as vLLM without its store): "
              "send the whole conversation as input items, or start the server with server.responses_store_mib")


@dataclasses.dataclass
class ResponsesRequest:
    """A Responses body read: the chat body that asks for its reply, and what the response echoes."""

    chat: dict
    stream: bool
    echo: dict  # the request's fields a Response repeats (instructions, tools, text, ...)
    names: list[tuple[str, str]]  # (the chat body's field path, the Responses body's), longest first
    items: list[dict] = dataclasses.field(default_factory=list)  # the conversation's input items, ids given
    store: bool = False  # the Response is to be kept (``store`` left true, and a store to keep it)

    def renamed(self, err: ApiError) -> ApiError:
        """``err`` of the chat path, naming the field of the body the client sent."""
        if err.param is None:
            return err
        new = self._name(err.param)
        # a media part's chat field (image_url) is this body's part itself (its input_image)
        new = re.sub(r"((?:content|output)\[\d+\])\.image_url$", r"\1", new)
        message = err.message
        if message.startswith(err.param):
            message = new + message[len(err.param):]
        elif new != err.param:
            message = f"{new}: {message}"
        message = re.sub(r"\bmax_tokens\b", "max_output_tokens", message)
        # another field the chat path names in its words (a constraint a forced call can't take)
        message = re.sub(r"\bresponse_format(?:\.\w+)*", lambda m: self._name(m[0]), message)
        message = message.replace("image_url parts", "input_image parts")
        return ApiError(err.status, message, param=new, code=err.code, error_type=err.error_type,
                        retry_after_s=err.retry_after_s)

    def _name(self, param: str) -> str:
        for chat, own in self.names:
            if param == chat or param.startswith((chat + ".", chat + "[")):
                # a stored turn's field is none of this body's: the id that brought it in
                return own if own == "previous_response_id" else own + param[len(chat):]
        return param


def read_responses(raw: bytes, store: ResponseStore | None = None) -> ResponsesRequest:
    """Validate a Responses body (raises ApiError naming its field); ``store``: the stored Responses
    (None: none are kept)."""
    body = decode_body(raw)
    check_known(body, OWN_FIELDS | CHAT_FIELDS, "/v1/responses")
    _refuse_server_state(body, store is not None)
    prior: list[dict] = []
    previous = get_str(body, "previous_response_id", None)
    if previous is not None:
        prior = store.conversation(previous)
        if prior is None:  # (OpenAI's answer: a 400 of its own code)
            raise ApiError(400, f"previous_response_id: previous response with id {previous!r} not found (a "
                                "response is kept while the store has room, the least recently used dropped, "
                                "and only where its request left store true)",
                           param="previous_response_id", code="previous_response_not_found")
    chat: dict = {k: body[k] for k in CHAT_FIELDS if k in body}
    chat["model"] = body.get("model")
    names: list[tuple[str, str]] = [("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                                    ("response_format.json_schema", "text.format"), ("messages", "input"),
                                    ("reasoning_effort", "reasoning.effort"), ("logprobs", "include")]
    while prior and prior[-1].get("type") == "reasoning":  # a cut reply's reasoning, for no answer: none to give
        prior = prior[:-1]
    stored = _messages({"input": [_replayable(item) for item in prior]}, []) if prior else []
    first = 1 if body.get("instructions") is not None else 0  # the stored turns follow the instructions
    names += [(f"messages[{first + i}]", "previous_response_id") for i in range(len(stored))]
    chat["messages"] = _messages(body, names, stored)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _read_tools(body, chat, names)
    _read_text(body, chat)
    _read_include(body, chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("reasoning", 'expected an object like {"effort": "low"}')
        keys = ("effort", "summary", "generate_summary")
        if (unknown := next((k for k in reasoning if k not in keys), None)) is not None:
            raise _bad(f"reasoning.{unknown}", f"unknown field; accepted: {', '.join(keys)}")
        for key in ("summary", "generate_summary"):
            if reasoning.get(key) is not None:
                raise _bad(f"reasoning.{key}", "no reasoning summaries are written here; the reasoning itself "
                                               "is the output's reasoning item; leave it out")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, dict) and set(options) <= {"include_obfuscation"}
                                    and isinstance(options.get("include_obfuscation", False), bool)):
        raise _bad("stream_options", 'expected {"include_obfuscation": true or false} with stream: true')
    # kept unless asked not to; a client's request_id names the response, and one taken keeps the first
    named = body.get("request_id")
    keep = get_bool(body, "store", True) and store is not None and not (isinstance(named, str) and named in store)
    check_cache_retention(body)
    names.sort(key=lambda pair: -len(pair[0]))
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                                     "top_logprobs", "user")}
    echo["service_tier"] = "default"  # the tier it ran in, whatever was asked: one here (a latency's, not a reply's)
    echo |= {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
             "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": reasoning or {},
             "truncation": "disabled", "store": keep, "previous_response_id": previous}
    if echo["metadata"] is None:
        echo["metadata"] = {}
    if echo["parallel_tool_calls"] is None:
        echo["parallel_tool_calls"] = True
    items = [*prior, *_with_ids(body["input"])] if keep else []
    return ResponsesRequest(chat, stream, echo, names, items, keep)


def _with_ids(given: Any) -> list[dict]:
    """The request's input as the items a store lists, in OpenAI's item shapes: a string one user message,
    each item with an id and a status, a message's text content as its parts (``input_text``, an
    assistant's ``output_text``)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    items = []
    for item in given:
        kind = item.get("type", "message")
        given_id = item.get("id")
        item = item | {"type": kind, "id": given_id if isinstance(given_id, str) and given_id
                       else new_id(prefixes.get(kind, "item"))}
        if kind != "reasoning":
            item.setdefault("status", "completed")
        if kind == "message" and isinstance(item.get("content"), str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []}
                    if item.get("role") == "assistant" else {"type": "input_text", "text": item["content"]})
            item["content"] = [part]
        items.append(item)
    return items


def _replayable(item: dict) -> dict:
    """A stored item as the conversation's next turn reads it: a function call the output cap cut (status
    "incomplete") whose arguments are no JSON object keeps its call, since an answer to it may follow, with
    arguments ``{}`` (as vLLM reads a call's empty arguments): the chat path takes no broken call, and a
    conversation of the server's own output is always one it continues."""
    if item.get("type") != "function_call" or item.get("status") != "incomplete":
        return item
    try:
        whole = isinstance(json.loads(item.get("arguments") or ""), dict)
    except ValueError:
        whole = False
    return item if whole else item | {"arguments": "{}"}


def _refuse_server_state(body: dict, stores: bool) -> None:
    if body.get("previous_response_id") is not None and not stores:
        raise _bad("previous_response_id", NOT_STORED)
    if body.get("conversation") is not None:
        raise _bad("conversation", "conversations are not kept here: send previous_response_id (with "
                                   "server.responses_store_mib) or the whole conversation as input items")
    if body.get("prompt") is not None:
        raise _bad("prompt", "stored prompt templates are not served here; send the prompt's text as input")
    if get_bool(body, "background", False):
        raise _bad("background", "responses are answered while the request waits; stream instead (stream: true)")
    if body.get("max_tool_calls") is not None:
        raise _bad("max_tool_calls", "not supported: the model's calls are its own; send parallel_tool_calls: "
                                     "false for at most one, or leave it out")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _bad("truncation", f'only "disabled" is served (an input over the context is a 400, never cut), '
                                 f"got {_show(truncation)}")


# ---- input -----------------------------------------------------------------

ROLES = ("user", "system", "developer", "assistant")
# Each item's and part's keys as the client's types write them (an earlier response's output sent back holds
# them all); those that change no reply here (ids, statuses, a message's phase, a call's caller and namespace,
# annotations, cache breakpoints) are taken and ignored.
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "caller", "namespace", "async", "async_"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status", "caller", "name", "namespace"}
PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
             "output_text": {"type", "text", "annotations", "logprobs"}, "refusal": {"type", "refusal"},
             "input_image": {"type", "image_url", "detail", "file_id", "prompt_cache_breakpoint"}}
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "name", "schema", "description", "strict"}}
TOOL_CHOICES = ("none", "auto", "required")


def _messages(body: dict, names: list[tuple[str, str]], prior: list[dict] | None = None) -> list[dict]:
    """The chat messages of ``instructions``, then ``prior`` (a stored conversation's), then ``input``."""
    out: list[dict] = []
    instructions = get_str(body, "instructions", None)
    if instructions is not None:
        names.append(("messages[0]", "instructions"))
        out.append({"role": "system", "content": instructions})
    out += prior or []
    given = body.get("input")
    if isinstance(given, str):
        names.append((f"messages[{len(out)}]", "input"))
        return [*out, {"role": "user", "content": given}]
    if not (isinstance(given, list) and given):
        raise _bad("input", f"expected a string or a non-empty array of input items, got {_show(given)}")
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows it
    joinable = False  # the item before was an assistant's message or call: a call next is of its turn
    calls = {call["id"] for message in out for call in message.get("tool_calls") or ()}  # an output answers one
    for j, item in enumerate(given):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise _bad(where, f"expected an input item (an object), got {_show(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning, joinable = _reasoning_text(item, where), False
            continue
        if kind == "message":
            check_known(item, MESSAGE_KEYS, where=where)
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {_show(role)}")
            message = {"role": role, "content": _content(item.get("content"), f"{where}.content")}
        elif kind == "function_call":
            check_known(item, CALL_KEYS, where=where)
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where,
                                                                                         empty=True)}}
            calls.add(call["id"])
            if joinable and reasoning is None:  # one assistant turn: its text, then its calls
                last = out[-1]
                last.setdefault("tool_calls", []).append(call)
                _name_call(names, f"messages[{len(out) - 1}].tool_calls[{len(last['tool_calls']) - 1}]", where)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            _name_call(names, f"messages[{len(out)}].tool_calls[0]", where)
        elif kind == "function_call_output":
            check_known(item, OUTPUT_KEYS, where=where)
            names.append((f"messages[{len(out)}].content", f"{where}.output"))
            output = item.get("output")
            if _text(item, "call_id", where) not in calls:  # (OpenAI's answer too)
                raise _bad(f"{where}.call_id", f"no function call found for this output's call_id "
                                               f"{_show(item['call_id'])}: a function_call_output answers a "
                                               "function_call item before it (in input, or the previous response)")
            message = {"role": "tool", "tool_call_id": _text(item, "call_id", where),
                       "content": output if isinstance(output, str) else _content(output, f"{where}.output")}
        else:
            raise _bad(f"{where}.type", 'expected "message", "function_call", "function_call_output" or '
                                        f'"reasoning" (stored items are not referenced here), got {_show(kind)}')
        if reasoning is not None:
            if message["role"] != "assistant":
                raise _bad(where, "a reasoning item is followed by the assistant's message or function call "
                                  "it reasoned for")
            message["reasoning"], reasoning = reasoning, None
        names.append((f"messages[{len(out)}]", where))
        out.append(message)
        joinable = message["role"] == "assistant"
    if reasoning is not None:
        raise _bad(f"input[{len(given) - 1}]", "a reasoning item ends the input: it goes before the assistant's "
                                               "message or function call it reasoned for")
    return out


def _name_call(names: list[tuple[str, str]], chat: str, where: str) -> None:
    """A call's chat path named by its item: its function's fields are the item's own."""
    names += [(chat, where), (f"{chat}.function", where)]


def _content(content: Any, where: str) -> Any:
    """A message's content as chat parts (a string stays one)."""
    if isinstance(content, str):
        return content
    if not (isinstance(content, list) and content):
        raise _bad(where, f"expected a string or a non-empty array of content parts, got {_show(content)}")
    parts = []
    for k, part in enumerate(content):
        at = f"{where}[{k}]"
        if not isinstance(part, dict):
            raise _bad(at, f'expected a content part object like {{"type": "input_text", "text": ...}}, '
                           f"got {_show(part)}")
        kind = part.get("type")
        if kind not in PART_KEYS:
            raise _bad(f"{at}.type", f"expected one of {', '.join(PART_KEYS)} (files are not read here), "
                                     f"got {_show(kind)}")
        check_known(part, PART_KEYS[kind], where=at)
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise _bad(f"{at}.file_id", "no files are stored here; send the image as image_url (a data: URL)")
            image = {"url": _text(part, "image_url", at)}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _text(part, "refusal" if kind == "refusal" else "text", at,
                                                        empty=True)})
    return parts


def _reasoning_text(item: dict, where: str) -> str:
    check_known(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where=where)
    if item.get("encrypted_content") is not None:
        raise _bad(f"{where}.encrypted_content", "no reasoning is encrypted here; send its text as content")
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts in (None, []):
            continue
        if not (isinstance(parts, list) and all(isinstance(p, dict) and p.get("type") == kind
                                                and isinstance(p.get("text"), str) for p in parts)):
            raise _bad(f"{where}.{key}", f'expected an array of {{"type": "{kind}", "text": ...}} parts')
        return "".join(p["text"] for p in parts)
    return ""


def _text(obj: dict, key: str, where: str, empty: bool = False) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise _bad(f"{where}.{key}", f"expected a{'' if empty else ' non-empty'} string, got {_show(value)}")
    return value


# ---- tools, format, include ------------------------------------------------

def _read_tools(body: dict, chat: dict, names: list[tuple[str, str]]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"expected an array of function tools, got {_show(tools)}")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _bad(f"tools[{i}].type", f'only "function" tools are served here (no built-in tool runs on '
                                               f"this server), got {_show(kind)}")
            chat["tools"].append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
            names.append((f"tools[{i}].function", f"tools[{i}]"))
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) != {"type", "name"}:
            raise _bad("tool_choice", 'expected {"type": "function", "name": ...}')
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        names.append(("tool_choice.function", "tool_choice"))
    elif choice in TOOL_CHOICES:
        chat["tool_choice"] = choice
    else:
        raise _bad("tool_choice", f'expected "none", "auto", "required" or {{"type": "function", "name": ...}} '
                                  f"(only function tools are served here), got {_show(choice)}")


def _read_text(body: dict, chat: dict) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("text", 'expected an object like {"format": {"type": "json_schema", ...}}')
    check_verbosity(text.get("verbosity"), "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"expected an object, got {_show(fmt)}")
    kind = fmt.get("type")
    if kind not in FORMAT_KEYS:
        raise _bad("text.format.type", f'expected "text", "json_object" or "json_schema", got {_show(kind)}')
    check_known(fmt, FORMAT_KEYS[kind], where="text.format")
    if kind == "json_schema":  # flattened here, nested in chat's response_format
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                                          if k != "type"}}
    else:
        chat["response_format"] = fmt


def _read_include(body: dict, chat: dict) -> None:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise _bad("include", f'expected an array such as ["{LOGPROBS_INCLUDE}"], got {_show(include)}')
        for i, value in enumerate(include):
            if value != LOGPROBS_INCLUDE:
                raise _bad(f"include[{i}]", f'only "{LOGPROBS_INCLUDE}" is served here (nothing is stored, '
                                            f"no built-in tool runs), got {_show(value)}")
    # the alternatives' count counts only where the logprobs are included (else none are computed)
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if include:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top


# ---- the response and its events -----------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(chat_usage: dict, reasoning_tokens: int) -> dict:
    """The chat path's usage as a Response's."""
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    # cache_write_tokens (the SDK's type requires it): OpenAI's billed cache writes, none here (the prefix
    # cache fills itself as prompts run, at no cost)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseEvents:
    """The Responses stream's events of one reply, from the chat stream's chunk choices in order: each
    event a dict with its ``type`` and ``sequence_number``; ``response`` is the whole Response so far."""

    def __init__(self, response_id: str, model: str, created: int, echo: dict, sampling: dict):
        self.response = {"id": response_id, "object": "response", "created_at": created, "status": "in_progress",
                         "error": None, "incomplete_details": None, "model": model, "output": [], "usage": None,
                         **echo, **sampling}
        self._seq = 0
        self._open: dict | None = None  # the output item being written
        self._reason: str | None = None
        self._held: list = []  # logprob entries of tokens whose text is still held (a character's first bytes)

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return msgspec.json.decode(msgspec.json.encode(self.response))  # (a copy: later events change it)

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def chunk(self, choice: dict) -> list[dict]:
        """One chunk choice of the chat stream (its delta's reasoning, content or tool calls)."""
        delta, events = choice.get("delta", {}), []
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning") or delta.get("tool_calls"):
            self._held = []  # (a reasoning's or a call's tokens, its markup's held ones too, carry none here)
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"], None)
        if delta.get("content"):
            events += self._text("message", delta["content"], self._held + logprobs)
            self._held = []
        elif not (delta.get("reasoning") or delta.get("tool_calls")):  # with the text that completes them, if any
            self._held += logprobs  # (an end's EOS or a stop string's tokens: none, as OpenAI's)
        for part in delta.get("tool_calls") or []:
            events += self._call(part)
        if choice.get("finish_reason") is not None:
            self._reason = choice["finish_reason"]
        return events

    def _text(self, kind: str, text: str, logprobs: list | None) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(item)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._index(), content_index=0, part=dict(part)))
            item["content"].append(part)
        item = self._open
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]
        part["logprobs"] += logprobs
        return [*events, self._event("response.output_text.delta", **where, delta=text, logprobs=logprobs)]

    def _call(self, part: dict) -> list[dict]:
        events = []
        function = part.get("function") or {}
        if part.get("id") is not None:  # a new call: its head
            events += self._close()
            events += self._add({"type": "function_call", "id": new_id("fc"), "call_id": part["id"],
                                 "name": function.get("name", ""), "arguments": "", "status": "in_progress"})
        if function.get("arguments"):
            self._open["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=self._index(), delta=function["arguments"]))
        return events

    def _add(self, item: dict) -> list[dict]:
        self._open = item
        self.response["output"].append(item)
        return [self._event("response.output_item.added", output_index=self._index(), item=dict(item, content=[])
                            if "content" in item else dict(item))]

    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index()}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done")
            extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
            events = [self._event(done, **where, content_index=0, text=part["text"], **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        return [*events, self._event("response.output_item.done", output_index=self._index(), item=dict(item))]

    def end(self, chat_usage: dict, reasoning_tokens: int) -> list[dict]:
        """The reply ended (its usage came): the open item closes, then ``response.completed`` (or
        ``response.incomplete`` where the cap cut it)."""
        cut = self._reason == "length"
        events = self._close("incomplete" if cut else "completed")
        self.response["usage"] = usage_of(chat_usage, reasoning_tokens)
        self.response["status"] = "incomplete" if cut else "completed"
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        kind = "response.incomplete" if cut else "response.completed"
        return [*events, self._event(kind, response=self._snapshot())]

    def fail(self, err: ApiError) -> list[dict]:
        """A failure after the stream began: an ``error`` event, then ``response.failed``."""
        code = err.code or err.error_type
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": err.message}
        return [self._event("error", code=code, message=err.message, param=err.param),
                self._event("response.failed", response=self._snapshot())]
