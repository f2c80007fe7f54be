"""OpenAI-compatible request validation and response building: pure, no I/O.

``parse_chat`` / ``parse_completion`` turn raw body bytes into a validated
``ParsedRequest`` (or raise ``ApiError`` naming the field and what would be
accepted); ``ParsedRequest.new_requests`` makes one engine ``NewRequest`` per
prompt, of ``n`` choices. The ``*_response`` / ``*_chunk`` builders make
OpenAI's JSON shapes.

Validation is by hand rather than through msgspec Structs: each field gets an
error that names it and its accepted range, ``bool`` is never taken for an
int, and ``null`` means "not given".

Every body field is in one of three sets per endpoint (``check_fields``): it is
implemented; it changes nothing here and is ignored, as OpenAI ignores it
(``user``, ``metadata``...); or it is refused with a 400 naming it. A field
that would change the output and is not implemented is refused, and so is an
unknown one: a silently ignored field is a wrong answer.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mstar_actors.frontend import tool_calls
from mstar_actors.frontend.tool_calls import ToolError, ToolRequest
from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams, StructuredSpec

MAX_N = 128  # OpenAI's limit (the server's own bounds: max_num_seqs + max_waiting_requests)
MAX_STOP_STRINGS = 64  # OpenAI's 4 and more, as vLLM takes (evaluation harnesses send more than 4)
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's), completions and prompt_logprobs too (vLLM's max_logprobs; OpenAI's legacy 5)
MAX_PROMPTS = 64
MAX_SEED = (1 << 63) - 1  # any int64, as vLLM (a choice's seed + index wraps within int64: ``choice_sampling``)
MIN_SEED = -(1 << 63)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# A message's fields: every role's, a role's own, and the fields of an
# assistant message as the API returned it, sent back as history: read by no
# chat template, ignored. Any other (non-null) field is refused by name.
MESSAGE_ECHOED_KEYS = frozenset({"refusal", "annotations"})
MESSAGE_KEYS = frozenset({"role", "content", "name"})
# an assistant's reasoning: ``reasoning`` as vLLM's responses name it now, ``reasoning_content`` as before
MESSAGE_ROLE_KEYS = {"assistant": frozenset({"tool_calls", "reasoning_content", "reasoning"}) | MESSAGE_ECHOED_KEYS,
                     "tool": frozenset({"tool_call_id"})}


class ApiError(Exception):
    """An error the client gets in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_of(status)
        self.retry_after_s = retry_after_s  # a retryable refusal's Retry-After header (seconds)

    def envelope(self) -> dict:
        return error_envelope(self.message, self.error_type, self.param, self.code)


def error_type_of(status: int) -> str:
    """OpenAI's error type of an HTTP status (a refusal's default)."""
    if status == 401:
        return "authentication_error"
    if status < 500:  # a 404 too: OpenAI's model_not_found is an invalid_request_error
        return "invalid_request_error"
    return "server_error" if status != 503 else "service_unavailable_error"


# An error body's message and param at most, in bytes of UTF-8 (a refusal quotes what the client sent: a 100 KB
# field name or model would come back twice over)
MAX_ERROR_MESSAGE_BYTES, MAX_ERROR_PARAM_BYTES = 2000, 200


def error_envelope(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _cut(message, MAX_ERROR_MESSAGE_BYTES), "type": error_type,
                      "param": None if param is None else _cut(param, MAX_ERROR_PARAM_BYTES), "code": code}}


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` bytes of UTF-8: its middle cut (a quoted value), its ends kept (the field
    and what is accepted)."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    half = (limit - 60) // 2
    head, tail = encoded[:half].decode(errors="ignore"), encoded[-half:].decode(errors="ignore")
    return f"{head} ... ({len(text)} characters, cut) ... {tail}"


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# --------------------------------------------------------------------------
# Which fields each endpoint takes
# --------------------------------------------------------------------------

# Both endpoints: OpenAI's sampling fields and the vLLM extensions honoured.
COMMON_FIELDS = frozenset({
    "model", "n", "stream", "stream_options", "stop", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logprobs",
    "stop_token_ids", "ignore_eos", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens", "return_token_ids",
    "return_tokens_as_token_ids", "prompt_logprobs", "cache_salt", "add_special_tokens", "thinking_token_budget",
    "truncation_side", "stream_interval",
})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "add_generation_prompt", "continue_final_message",
                               "chat_template_kwargs", "include_reasoning", "reasoning_effort", "echo"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}

# Implemented, and parsed by the structured-output and tool-calling parts of
# the request parser, not by the sampling fields here.
STRUCTURED_FIELDS = frozenset({
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
})
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
OWNED_FIELDS = {"chat": STRUCTURED_FIELDS | TOOL_FIELDS, "completion": STRUCTURED_FIELDS}

# Change nothing in the output: accepted (their types checked, ``_check_ignored``)
# and ignored, as OpenAI's server does; ``request_id`` names the response. A
# ``prediction`` (OpenAI's predicted outputs) only speeds a reply up; fast
# tokenizers put no spaces between special tokens either way (vLLM's reading).
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "request_id", "priority", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "prediction",
    "spaces_between_special_tokens", "verbosity",
})
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")  # OpenAI's prompt_cache_retention (older SDKs: in-memory)
VERBOSITIES = ("low", "medium", "high")  # OpenAI's; "medium", its default, alone changes nothing here


def check_verbosity(value: Any, param: str) -> None:
    """OpenAI's ``verbosity``: its default, or a 400 that says what it is and what is served."""
    if value is not None and value != "medium":
        reason = ("not supported: a reply's length is the model's; send max_tokens, or \"medium\""
                  if value in VERBOSITIES else f"expected one of {', '.join(VERBOSITIES)}, got {_show(value)}")
        raise _bad(param, reason)


def check_cache_retention(body: dict) -> None:
    value = get_str(body, "prompt_cache_retention", None)
    if value is not None and value not in CACHE_RETENTIONS:
        raise _bad("prompt_cache_retention", f"expected one of {', '.join(CACHE_RETENTIONS)}, got {_show(value)}")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_REQUEST_ID = 16, 64, 512, 128

# Would change the output and are not implemented: refused unless their value is
# the neutral one (then they change nothing either). Name -> neutral values.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,), "suffix": ("",),
    "audio": (), "modalities": (["text"],), "functions": ([],),
    "function_call": ("none",), "web_search_options": (), "reasoning_effort": (),
    "chat_template": (), "documents": ([],), "mm_processor_kwargs": ({},), "media_io_kwargs": ({},),
    "logits_processors": ([],), "vllm_xargs": ({},),
    "prompt_embeds": (), "kv_transfer_params": ({},),
}


# Refused unless neutral, their neutral value the endpoint's own (vLLM's defaults):
# a chat prompt is the template's text, a completion prompt gets the tokenizer's BOS.
def accepted_fields(kind: str) -> frozenset[str]:
    own = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    return own | OWNED_FIELDS[kind] | IGNORED_FIELDS


def check_fields(body: dict, kind: str) -> None:
    """400 for the first field that is neither taken nor harmless to ignore."""
    accepted = accepted_fields(kind)
    for name, value in body.items():
        if name in accepted or value is None:
            continue
        neutrals = UNSUPPORTED_FIELDS.get(name)
        if neutrals is not None:
            if any(type(value) is type(neutral) and value == neutral for neutral in neutrals):
                continue  # (of the neutral value's type: true is not 1)
            raise _bad(name, "not supported by this server (it would change the output); remove it")
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        raise _bad(name, f"unknown field for {endpoint}; accepted: {', '.join(sorted(accepted - IGNORED_FIELDS))}; "
                         f"taken and ignored (they change no output): {', '.join(sorted(IGNORED_FIELDS))}")


# --------------------------------------------------------------------------
# Field readers: null means absent; bool is not an int
# --------------------------------------------------------------------------


# a high surrogate escape not followed by a low one, or a low one not after a high one (an escape: its
# backslash not itself escaped, an odd run of them)
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(?:\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def decode_body(raw: bytes) -> dict:
    """The JSON object in ``raw`` (400 for anything else)."""
    try:
        body = msgspec.json.decode(raw)
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", param="body") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        if _LONE_SURROGATE.search(raw):  # msgspec says "truncated" of it
            raise ApiError(400, "body: a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
                                "its pair), which is no character; send the character itself or its whole pair",
                           param="body") from None
        raise ApiError(400, f"body: not valid JSON ({err})", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got {_kind(body)}", param="body")
    return body


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(body: dict, name: str, default: Any, lo: int, hi: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
        value = int(value)  # 16.0 is an integer in JSON's number model
    if not _is_int(value) or not lo <= value <= hi:
        raise _bad(name, f"expected an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def get_float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    ok = ok and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise _bad(name, f"expected a number in {bracket}{lo}, {hi}], got {_show(value)}")
    return float(value)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {_show(value)}")
    return value


def get_str(body: dict, name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(name, f"expected a string, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    """A sent value as JSON writes it (``true``, ``"4"``), a container by its kind, cut to 40 characters."""
    text = msgspec.json.encode(value).decode() if isinstance(value, (int, float, str)) else _kind(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------
# The validated request
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputOptions:
    """How the frontend renders a choice (no effect on the engine)."""

    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: bool = False  # completions: the prompt text before the output
    # completions, echo with a cap of 0: the prompt alone (and its logprobs), as
    # OpenAI's; the engine samples one token, which is not the client's
    echo_only: bool = False
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids
    # vLLM: logprobs name tokens "token_id:{id}" (tokens whose text is no whole
    # character, "\ufffd" for several, stay apart)
    return_tokens_as_token_ids: bool = False
    # vLLM: each prompt token's logprob, rank and top alternatives (this many),
    # per choice (completions) or once (chat); None: not asked
    prompt_logprobs: int | None = None
    continuous_usage_stats: bool = False  # usage in every streamed chunk
    # vLLM's: a streamed choice's chunk once this many tokens came since its last (its first token and its end
    # at once)
    stream_interval: int = 1


@dataclass
class ParsedRequest:
    """A validated request: one prompt (chat) or several (completions), ``n``
    choices each. Choice ``p * n + i`` is prompt ``p``, sample ``i``."""

    kind: str  # "chat" | "completion"
    model: str | None
    sampling: SamplingParams
    request_id: str | None = None  # the client's, for the response's id (``_parse_request_id``)
    cache_salt: str = ""  # vLLM's: the prefix cache is shared only between requests of the same salt
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token, None = no logprobs
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (its BOS) on the prompt (chat: false)
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template
    include_reasoning: bool = True  # vLLM's: false drops the reply's reasoning (model.reasoning_parser)
    prompts: list[str | list[int]] = field(default_factory=list)
    tools: ToolRequest | None = None
    output: OutputOptions = field(default_factory=lambda: OutputOptions())
    bad_words: list[str] = field(default_factory=list)  # tokenized by the frontend (``with_token_facts``)
    prompt_param: str = ""  # the body field the prompt came from, when not prompt / messages (speech: "input")
    cap_param: str = "max_tokens"  # the body field of the output's cap: a refusal of "max_tokens" names this
    cap_sent: bool = True  # the client sent the cap (else a completion's is vLLM's default, 16)
    tool_format: str = tool_calls.LLAMA3_JSON  # the model's tool-call format (``NewRequest.tool_format``)
    # vLLM's chat echo: the last message's text, an assistant's (the reply continues it), before the reply's content
    chat_echo: str = ""

    def with_token_facts(self, eos_token_ids: tuple[int, ...], bad_words_token_ids: list[list[int]],
                         think_ids: tuple[int, int] | None = None) -> None:
        """Fill the sampling fields that need the tokenizer: the ids ``min_tokens``
        masks (EOS unless ignored, and the stop tokens), the bad words' ids and
        the ``<think>`` / ``</think>`` ids a thinking budget counts by (a 400
        for a budget where the model reads no reasoning: ``think_ids`` None)."""
        sampling = self.sampling
        if sampling.thinking_budget is not None and think_ids is None:
            raise _bad("thinking_token_budget", "this model's replies have no reasoning to hold to a budget: it "
                                                "needs model.reasoning_parser and <think> and </think> as tokens "
                                                "of the model's own; remove the field")
        stop_ids = () if sampling.min_tokens == 0 else (
            (() if sampling.ignore_eos else tuple(eos_token_ids)) + sampling.stop_token_ids)
        self.sampling = msgspec.structs.replace(
            sampling, min_token_stop_ids=tuple(sorted(set(stop_ids))),
            bad_words_token_ids=tuple(tuple(ids) for ids in bad_words_token_ids if ids),
            think_ids=tuple(think_ids) if sampling.thinking_budget is not None else ())

    @property
    def num_choices(self) -> int:
        return self.n * max(1, len(self.prompts))

    def new_requests(self, base_id: str, model: str, now: float | None = None) -> list[NewRequest]:
        """One engine request per prompt, of ``n`` choices: prepared once, its
        choices sampled by the engine (with a seed, choice i uses seed + i)."""
        now = time.time() if now is None else now
        out = []
        for index, prompt in enumerate(self.prompts or [None]):
            out.append(
                NewRequest(
                    request_id=f"{base_id}-{index}",
                    model=model,
                    sampling=self.sampling,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt if isinstance(prompt, list) else None,
                    messages=self.messages,
                    add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    add_special_tokens=self.add_special_tokens,
                    chat_template_kwargs=self.chat_template_kwargs,
                    arrival_time=now,
                    n=self.n,
                    tools=self.tools.tools if self.tools else None,
                    assistant_prefix=self.tools.assistant_prefix if self.tools else "",
                    tool_format=self.tool_format,
                    prompt_param=self.prompt_param,
                    cache_salt=self.cache_salt,
                    return_prompt_ids=self.output.return_token_ids,
                )
            )
        return out


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 16


def get_token_ids(body: dict, name: str, max_len: int, vocab_size: int | None) -> tuple[int, ...]:
    """A list of token ids inside the vocabulary (empty when absent)."""
    value = body.get(name)
    if value is None:
        return ()
    hi = vocab_size or 1 << 31
    if not (isinstance(value, list) and len(value) <= max_len):
        raise _bad(name, f"expected a list of at most {max_len} token ids in [0, {hi})")
    if (bad := next((i for i, t in enumerate(value) if not (_is_int(t) and 0 <= t < hi)), None)) is not None:
        raise _bad(f"{name}[{bad}]", f"{_show(value[bad])} is no token id in [0, {hi})")  # (which of a long list)
    return tuple(value)


def _parse_allowed_token_ids(body: dict, vocab_size: int | None) -> tuple[int, ...]:
    """vLLM's ``allowed_token_ids``: a non-empty list (an empty one would allow nothing)."""
    if body.get("allowed_token_ids") == []:
        raise _bad("allowed_token_ids", "expected at least one token id (leave the field out to allow every token)")
    return get_token_ids(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, vocab_size)


def parse_logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``: keys are decimal token ids inside the
    vocabulary, biases numbers in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"expected an object of at most {MAX_LOGIT_BIAS} \"token id\": bias entries")
    hi = vocab_size or 1 << 31
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key.lstrip("0")) <= len(str(hi)) and int(key) < hi):
            raise _bad("logit_bias", f"key {_show(key)} is not a token id in [0, {hi})")
        if not ((_is_int(bias) or isinstance(bias, float)) and math.isfinite(bias) and -100 <= bias <= 100):
            raise _bad("logit_bias", f"the bias of {key} must be a number in [-100, 100], got {_show(bias)}")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def parse_bad_words(body: dict) -> list[str]:
    value = body.get("bad_words")
    if value is None:
        return []
    if not (isinstance(value, list) and len(value) <= MAX_BAD_WORDS
            and all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_CHARS for w in value)):
        raise _bad("bad_words", f"expected a list of at most {MAX_BAD_WORDS} non-empty strings")
    return value


# The sampling fields a model's generation_config.json sets as its requests' defaults (``ModelInfo.sampling_defaults``,
# as vLLM's ``--generation-config auto``), its max_new_tokens as max_tokens.
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _defaulted(body: dict, defaults: dict | None) -> dict:
    """``body`` with the model's default of each sampling field it leaves out (or sends null)."""
    if not defaults:
        return body
    return body | {name: value for name, value in defaults.items() if name != "max_tokens" and body.get(name) is None}


def check_sampling_defaults(defaults: dict) -> None:
    """``ValueError`` naming a model default a request could not send (its range, as a request's is checked)."""
    try:
        _parse_sampling(_defaulted({}, defaults), (1, False), None, None)
        _parse_max_tokens({"max_tokens": defaults.get("max_tokens")}, None, None)
    except ApiError as err:
        raise ValueError(err.message) from None


def draw_fields(body: dict, temperature: float = 1.0, top_p: float = 1.0,
                repetition_penalty: float = 1.0) -> dict:
    """The draw's fields every generating route reads alike (the speech route with its model's defaults):
    ``SamplingParams`` keywords, their ranges vLLM's."""
    return dict(
        temperature=get_float(body, "temperature", temperature, 0.0, 2.0),
        top_p=get_float(body, "top_p", top_p, 0.0, 1.0, lo_open=True),
        top_k=max(get_int(body, "top_k", 0, -1, (1 << 31) - 1), 0),  # -1 and 0 both mean off
        # vLLM's rule: any positive number (it divides positive logits and multiplies the others)
        repetition_penalty=get_float(body, "repetition_penalty", repetition_penalty, 0.0, math.inf, lo_open=True),
        seed=get_int(body, "seed", None, MIN_SEED, MAX_SEED),
    )


def _parse_sampling(body: dict, cap: tuple[int, bool], logprobs: int | None,
                    vocab_size: int | None, max_model_len: int | None = None) -> SamplingParams:
    max_tokens, cut_to_context = cap  # from ``_parse_max_tokens``
    draw = draw_fields(body)
    stop_token_ids = get_token_ids(body, "stop_token_ids", 64, vocab_size)
    min_tokens = body.get("min_tokens")
    if _is_int(min_tokens) and min_tokens > max_tokens:
        sent = next((f"{name}={body[name]}" for name in ("max_completion_tokens", "max_tokens")  # the first rules
                     if body.get(name) is not None), f"max_tokens={max_tokens}, the default")
        raise _bad("min_tokens", f"must be at most the output's cap ({sent}), got {min_tokens}")
    min_tokens = get_int(body, "min_tokens", 0, 0, max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        cut_to_context=cut_to_context,
        **draw,
        min_p=get_float(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stop_token_ids=stop_token_ids,
        ignore_eos=get_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        structured=parse_structured(body),
        logit_bias=parse_logit_bias(body, vocab_size),
        allowed_token_ids=_parse_allowed_token_ids(body, vocab_size),
        min_tokens=min_tokens,
        truncate_prompt_tokens=_parse_truncation(body, max_model_len),
        truncate_right=_parse_truncation_side(body),
        thinking_budget=get_int(body, "thinking_token_budget", None, 0, 1 << 31),
    )


def _parse_truncation_side(body: dict) -> bool:
    """vLLM's truncation_side: which end truncate_prompt_tokens cuts ("left", the default: the last N tokens
    are kept; "right": the first N). True for "right"."""
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise _bad("truncation_side", f'expected "left" (keep the prompt\'s last tokens) or "right" (its first), '
                                      f"got {_show(side)}")
    return side == "right"


def _parse_truncation(body: dict, max_model_len: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last N tokens; -1, the model's context."""
    value = get_int(body, "truncate_prompt_tokens", None, -1, 1 << 31)
    if value == 0:
        raise _bad("truncate_prompt_tokens", "expected -1 (the model's context, max_model_len) or a positive "
                                             "integer, got 0")
    if max_model_len and value is not None and value > max_model_len:  # (vLLM's refusal too)
        raise _bad("truncate_prompt_tokens", f"{value} is more than max_model_len ({max_model_len}); keep at most "
                                             f"{max_model_len} tokens, or -1 for the model's context")
    return (max_model_len or None) if value == -1 else value


def _parse_cache_salt(body: dict) -> str:
    """vLLM's ``cache_salt``: a non-empty string; requests share prefix-cache blocks only with the same salt
    (none: with every unsalted request), so one tenant's prompts cannot be probed by another's timing."""
    salt = get_str(body, "cache_salt", None)
    if salt is not None and not salt:
        raise _bad("cache_salt", "expected a non-empty string (leave it out for no salt)")
    return salt or ""


def _text_parts(content: Any) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


def _check_ignored(body: dict) -> None:
    """The ignored fields (``IGNORED_FIELDS``) change nothing, but a wrong
    type or value is still the client's error, as OpenAI answers it."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        get_str(body, name, None)
    get_bool(body, "store", False)
    get_bool(body, "spaces_between_special_tokens", True)
    check_cache_retention(body)
    check_verbosity(body.get("verbosity"), "verbosity")
    if body.get("prompt_cache_options") is not None and not isinstance(body["prompt_cache_options"], dict):
        raise _bad("prompt_cache_options", f"expected an object, got {_show(body['prompt_cache_options'])}")
    prediction = body.get("prediction")
    if prediction is not None and not (
            isinstance(prediction, dict) and prediction.get("type") == "content"
            and set(prediction) <= {"type", "content"}
            and (isinstance(prediction.get("content"), str) or _text_parts(prediction.get("content")))):
        raise _bad("prediction", 'expected {"type": "content", "content": a string or an array of text parts}')
    if get_int(body, "priority", 0, -(1 << 31), 1 << 31) != 0:  # vLLM's, as vLLM without priority scheduling
        raise _bad("priority", "requests are served first come, first served here; send 0 or leave it out")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise _bad("service_tier", f"expected one of {', '.join(SERVICE_TIERS)}, got {_show(tier)}")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
            and all(len(k) <= MAX_METADATA_KEY and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE
                    for k, v in metadata.items())):
        raise _bad("metadata", f"expected an object of at most {MAX_METADATA_PAIRS} string values, keys of at most "
                               f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}")


def _parse_request_id(body: dict) -> str | None:
    """vLLM's ``request_id``: the response's id is ``chatcmpl-{request_id}``
    (``cmpl-`` for completions); the engine keeps ids of its own."""
    return checked_request_id(get_str(body, "request_id", None), "request_id")


def checked_request_id(value: str | None, param: str) -> str | None:
    """A client's id for the response (the body's ``request_id``, or the ``X-Request-Id`` header)."""
    if value is not None and not (0 < len(value) <= MAX_REQUEST_ID and value.isprintable()):
        raise _bad(param, f"expected 1 to {MAX_REQUEST_ID} printable characters")
    return value


def _parse_max_tokens(body: dict, default: int | None, max_model_len: int | None, lo: int = 1,
                      model_default: int | None = None) -> tuple[int, bool]:
    """(the output's cap, whether it may be cut to what the prompt leaves):
    the client's ``max_completion_tokens`` or ``max_tokens`` (at least
    ``lo``), a prompt leaving less room being refused
    (``SamplingParams.cut_to_context``); else the endpoint's ``default``
    (counted as sent, as OpenAI's 16 for completions; the model's
    ``model_default``, its generation config's max_new_tokens, where
    lower), or with none the model's default or the whole context, cut."""
    hi = max_model_len or (1 << 31)
    for name in ("max_tokens", "max_completion_tokens"):  # past the whole context: no prompt leaves it room
        value = body.get(name)
        if _is_int(value) and value > hi:
            raise ApiError(400, f"{name}: {value} is more than the model's whole context ({hi} tokens, "
                                f"max_model_len), before any prompt; ask for at most {hi} less the prompt's tokens",
                           param=name, code="context_length_exceeded")
    value = get_int(body, "max_tokens", None, lo, hi)
    value = get_int(body, "max_completion_tokens", value, lo, hi)
    if value is None:
        if default is not None:
            return min(default, model_default or default), False
        return min(hi, model_default or hi), True
    return value, False


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"expected a string or a list of at most {MAX_STOP_STRINGS} strings")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise _bad("stop", f"each stop must be a non-empty string of at most {MAX_STOP_CHARS} characters")
    return stops


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _parse_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise _bad("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object like {{\"include_usage\": true}}, got {_show(options)}")
    unknown = next((k for k in options if k not in (*STREAM_OPTIONS, "include_obfuscation")), None)
    if unknown is not None:
        raise _bad(f"stream_options.{unknown}", f"unknown option; accepted: {', '.join(STREAM_OPTIONS)}, "
                                                "include_obfuscation")
    if not isinstance(options.get("include_obfuscation", False), bool):  # (its padding field: none is sent)
        raise _bad("stream_options.include_obfuscation", "expected true or false")
    flags = []
    for name in STREAM_OPTIONS:
        try:
            flags.append(get_bool(options, name, False))
        except ApiError:
            raise _bad(f"stream_options.{name}", "expected true or false") from None
    include_usage, continuous = flags
    if continuous and not include_usage:  # vLLM reads it only with include_usage; alone it would change nothing
        raise _bad("stream_options.continuous_usage_stats", "takes effect with include_usage: true; send both")
    return stream, include_usage, continuous


def _parse_output(body: dict, continuous_usage_stats: bool) -> OutputOptions:
    return OutputOptions(
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        return_token_ids=get_bool(body, "return_token_ids", False),
        return_tokens_as_token_ids=get_bool(body, "return_tokens_as_token_ids", False),
        prompt_logprobs=get_int(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS),
        continuous_usage_stats=continuous_usage_stats,
        stream_interval=get_int(body, "stream_interval", 1, 1, 1 << 20),
    )


def _parse_common(body: dict, kind: str, cap: tuple[int, bool], logprobs: int | None,
                  vocab_size: int | None, max_model_len: int | None = None,
                  defaults: dict | None = None) -> ParsedRequest:
    check_fields(body, kind)
    stream, include_usage, continuous = _parse_stream(body)
    _check_ignored(body)
    output = _parse_output(body, continuous)
    sampling = _parse_sampling(_defaulted(body, defaults), cap, logprobs, vocab_size, max_model_len)
    if output.prompt_logprobs is not None:
        if stream:  # as vLLM: its responses carry them, its chunks don't
            raise _bad("prompt_logprobs", "not with stream: true; send stream: false to get the prompt's logprobs")
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=output.prompt_logprobs)
    return ParsedRequest(
        kind=kind,
        request_id=_parse_request_id(body),
        cache_salt=_parse_cache_salt(body),
        model=get_str(body, "model", None),
        sampling=sampling,
        n=get_int(body, "n", 1, 1, MAX_N),
        stream=stream,
        include_usage=include_usage,
        stop=_parse_stop(body),
        logprobs=logprobs,
        output=output,
        bad_words=parse_bad_words(body),
        add_special_tokens=get_bool(body, "add_special_tokens", kind == "completion"),  # (vLLM's defaults)
        cap_param="max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens",
        cap_sent=any(body.get(name) is not None for name in ("max_tokens", "max_completion_tokens")),
    )


# --------------------------------------------------------------------------
# Structured outputs: response_format, vLLM's structured_outputs and guided_*
# --------------------------------------------------------------------------

# vLLM's structured_outputs keys and their StructuredSpec kind; the older
# top-level guided_* names map the same way.
STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Options (true or false) that change nothing here: no fallback engine exists, JSON is always generated
# without free whitespace (what disable_any_whitespace asks for), and an object whose schema states no
# additionalProperties takes no other key (what disable_additional_properties asks of vLLM's guidance
# backend; its xgrammar one reads schemas so whatever the option says).
IGNORED_STRUCTURED_KEYS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
REFUSED_GUIDED_FIELDS = {"guided_whitespace_pattern"}
# vLLM's guided_decoding_backend names: one engine compiles every constraint here, so the name changes nothing
GUIDED_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def parse_structured(body: dict) -> StructuredSpec | None:
    """The request's output constraint, or None; at most one may be given (else 400 naming both).

    Only shapes are checked here; the spec itself is compiled by prepare,
    whose refusal (a 400 naming the same field) comes before any rank sees it.
    """
    found = [spec for spec in (_from_response_format(body), *_from_structured_outputs(body), *_from_guided(body))
             if spec is not None]
    if len(found) > 1:
        names = " and ".join(s.param for s in found)
        raise ApiError(400, f"{names}: only one structured output constraint may be given per request",
                       param=found[0].param)
    return found[0] if found else None


def _from_response_format(body: dict) -> StructuredSpec | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("response_format", f'expected an object like {{"type": "json_object"}}, got {_show(fmt)}')
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad("response_format.type", f'expected "text", "json_object" or "json_schema", got {_show(kind)}')
    # A key its type does not read would be dropped: refused, naming it. json_object takes a "schema" as
    # llama.cpp's server does.
    reads = {"text": (), "json_object": ("schema",), "json_schema": ("json_schema",)}[kind]
    extra = next((key for key, v in fmt.items() if v is not None and key != "type" and key not in reads), None)
    if extra is not None:
        raise _bad(f"response_format.{extra}", f'not read with "type": "{kind}"; a schema goes in {{"type": '
                                               '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    if kind == "text":
        return None
    if kind == "json_object":
        if fmt.get("schema") is not None:
            return _schema_spec(fmt["schema"], "response_format.schema")
        return StructuredSpec("json_object", "", "response_format")
    return _json_schema_spec(fmt.get("json_schema"))


def _json_schema_spec(value: Any) -> StructuredSpec:
    where = "response_format.json_schema"
    if not isinstance(value, dict):
        raise _bad(where, f'expected an object like {{"name": ..., "schema": {{...}}}}, got {_show(value)}')
    extra = next((key for key, v in value.items()
                  if v is not None and key not in ("name", "description", "schema", "strict")), None)
    if extra is not None:
        raise _bad(f"{where}.{extra}", "not a key of json_schema; accepted: name, description, schema, strict")
    for key in ("name", "description"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise _bad(f"{where}.{key}", f"expected a string, got {_show(value[key])}")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise _bad(f"{where}.strict", f"expected true or false, got {_show(value['strict'])}")
    # The output always matches the schema: strict or not, the grammar enforces it.
    return _schema_spec(value.get("schema"), f"{where}.schema")


def _schema_spec(schema: Any, param: str) -> StructuredSpec:
    if isinstance(schema, str):  # vLLM accepts a schema as JSON text
        try:
            decoded = msgspec.json.decode(schema)
        except msgspec.DecodeError as err:
            raise _bad(param, f"a schema given as text must be JSON text of a schema object, got {_show(schema)} "
                              f"({err})") from None
        if not isinstance(decoded, (dict, bool)):
            raise _bad(param, f"a schema given as text must be JSON text of a schema object, got {_show(schema)}")
        return StructuredSpec("json", schema, param)
    if not isinstance(schema, (dict, bool)):
        raise _bad(param, f"expected a JSON schema object, got {_show(schema)}")
    return StructuredSpec("json", msgspec.json.encode(schema).decode(), param)


def _from_structured_outputs(body: dict) -> list[StructuredSpec]:
    options = body.get("structured_outputs")
    if options is None:
        return []
    if not isinstance(options, dict):
        raise _bad("structured_outputs", f'expected an object like {{"regex": "..."}}, got {_show(options)}')
    specs = []
    for key, value in options.items():
        if value is None:
            continue
        if key in IGNORED_STRUCTURED_KEYS:
            if not isinstance(value, bool):
                raise _bad(f"structured_outputs.{key}", f"expected true or false, got {_show(value)}")
            continue
        if key not in STRUCTURED_KEYS:
            accepted = ", ".join(sorted(STRUCTURED_KEYS.keys() | IGNORED_STRUCTURED_KEYS))
            raise _bad(f"structured_outputs.{key}", f"not supported; accepted keys are {accepted}")
        if key == "json_object":
            if not isinstance(value, bool):
                raise _bad("structured_outputs.json_object", f"expected true or false, got {_show(value)}")
            if value:
                specs.append(StructuredSpec("json_object", "", "structured_outputs.json_object"))
            continue
        specs.append(_field_spec(STRUCTURED_KEYS[key], value, f"structured_outputs.{key}"))
    return specs


def _from_guided(body: dict) -> list[StructuredSpec]:
    for name in REFUSED_GUIDED_FIELDS:
        if body.get(name) is not None:
            raise _bad(name, "not supported: JSON is generated without free whitespace; remove it")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise _bad("guided_decoding_backend", f"expected one of {', '.join(GUIDED_BACKENDS)}, got {_show(backend)}")
    return [_field_spec(kind, body[name], name) for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None]


def _field_spec(kind: str, value: Any, param: str) -> StructuredSpec:
    """One structured_outputs / guided_* value by its kind: json a schema, choice a list of strings, else a string."""
    if kind == "json":
        return _schema_spec(value, param)
    if kind == "choice":
        if not (isinstance(value, list) and value):
            got = "an empty list" if value == [] else _show(value)
            raise _bad(param, f"expected a non-empty list of non-empty strings, got {got}")
        bad = next((i for i, c in enumerate(value) if not (isinstance(c, str) and c)), None)
        if bad is not None:
            raise _bad(param, f"expected a non-empty list of non-empty strings; {param}[{bad}] is "
                              f"{_show(value[bad])}")
        return StructuredSpec("choice", msgspec.json.encode(value).decode(), param)
    if not isinstance(value, str) or not value:
        raise _bad(param, f"expected a non-empty string, got {_show(value)}")
    return StructuredSpec(kind, value, param)


# --------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------


def parse_chat(raw: bytes, max_model_len: int | None = None, vocab_size: int | None = None, *,
               tool_parser: str | None = None, takes_media: bool = True, defaults: dict | None = None) -> ParsedRequest:
    """Validate a chat-completions body (raises ApiError). ``tool_parser``: the
    model's tool-call format (``tool_calls.choose_parser``), None for none;
    ``takes_media``: the model reads media parts (a text-only one's prepare
    refuses them, naming the part); ``defaults``: the model's sampling
    defaults (``ModelInfo.sampling_defaults``) for the fields the body leaves out."""
    body = decode_body(raw)
    defaults = defaults or {}
    cap = _parse_max_tokens(body, None, max_model_len, model_default=defaults.get("max_tokens"))
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top and not want_logprobs:  # 0 asks for nothing: taken without logprobs, as vLLM takes it
        raise _bad("top_logprobs", "requires logprobs: true")
    parsed = _parse_common(body, "chat", cap, (top or 0) if want_logprobs else None, vocab_size, max_model_len,
                           defaults)
    parsed.messages = parse_messages(body.get("messages"))
    parsed.continue_final_message, parsed.add_generation_prompt = _parse_turn_flags(body, parsed.messages)
    parsed.chat_template_kwargs = _with_reasoning_effort(body, parse_template_kwargs(body))
    parsed.include_reasoning = get_bool(body, "include_reasoning", True)
    parsed.chat_echo = _chat_echo(parsed.messages) if get_bool(body, "echo", False) else ""
    if takes_media:
        _check_media_fields(parsed)
    _parse_tools(parsed, body, tool_parser)
    parsed.tool_format = parsed.tools.parser if parsed.tools else tool_parser or tool_calls.LLAMA3_JSON
    given = parsed.sampling.structured
    if parsed.continue_final_message and given is not None:  # a forced tool call's included
        raise _bad(given.param, "an output constraint (a forced tool call's too) shapes a whole new reply; it "
                                "cannot continue the final message (continue_final_message), whose text would "
                                "come before it")
    return parsed


def _chat_echo(messages: list[ChatMessage]) -> str:
    """vLLM's chat ``echo``: the last message's text where it is the assistant's, the role the reply takes (its
    text parts joined by newlines); else nothing."""
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content if part.type == "text")


# Names the template call itself takes (Hugging Face's apply_chat_template and
# its render): set by the request's own fields, never by chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
    "conversations",
})
MAX_TEMPLATE_KWARGS = 32


def parse_template_kwargs(body: dict) -> dict | None:
    """vLLM's ``chat_template_kwargs``: an object of more variables the chat
    template reads (``enable_thinking`` for Qwen3's); None when absent or
    empty. The names the template call takes itself are refused."""
    value = body.get("chat_template_kwargs")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise _bad("chat_template_kwargs", f"expected an object of at most {MAX_TEMPLATE_KWARGS} variables for the "
                                           f"chat template, like {{\"enable_thinking\": false}}, got {_show(value)}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if reserved:
        raise _bad(f"chat_template_kwargs.{reserved[0]}", "is set by the request itself (messages, tools, "
                                                          "add_generation_prompt, continue_final_message), not here")
    return value


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _with_reasoning_effort(body: dict, kwargs: dict | None) -> dict | None:
    """``reasoning_effort`` as the chat template reads it (vLLM's: a template variable of that name, which a
    template that does not read it leaves its prompt as it was); ``chat_template_kwargs``' own wins."""
    effort = get_str(body, "reasoning_effort", None)
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise _bad("reasoning_effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got {_show(effort)}")
    return {"reasoning_effort": effort} | (kwargs or {})


def _parse_turn_flags(body: dict, chat: list[ChatMessage]) -> tuple[bool, bool]:
    """(continue_final_message, add_generation_prompt), checked against the messages."""
    continue_final = get_bool(body, "continue_final_message", False)
    add_generation_prompt = get_bool(body, "add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise _bad("continue_final_message", "cannot be true together with add_generation_prompt: true")
    if continue_final and chat[-1].role != "assistant":
        raise _bad("continue_final_message", "the last message must be the assistant's, to be continued")
    last = chat[-1].content
    if continue_final and isinstance(last, list) and last and last[-1].type != "text":
        # the template's render is cut after the message's final text: a media part past it would be lost
        where = f"messages[{len(chat) - 1}].content[{len(last) - 1}].{last[-1].type}"
        raise _bad(where, "the message continued (continue_final_message) must end with a text part; its last "
                          f"part is {last[-1].type}")
    return continue_final, add_generation_prompt


def _parse_tools(parsed: ParsedRequest, body: dict, tool_parser: str | None) -> None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls``; a forced call (``required``, a named
    function) is constrained to the call's JSON by structured outputs, an ``auto`` reply's calls of a
    strict tool too (``tool_calls.strict_calls_spec``)."""
    try:
        parsed.tools = tool_calls.parse_tool_request(body.get("tools"), body.get("tool_choice"), tool_parser,
                                                     body.get("parallel_tool_calls"))
    except ToolError as err:
        raise _bad(err.param, err.message) from None
    if parsed.tools is None:
        return
    given = parsed.sampling.structured
    if not parsed.tools.is_forced:  # a strict tool's calls, and an answer held to response_format's rule
        answer = None if given is None else {"kind": given.kind, "spec": given.spec, "param": given.param}
        strict = tool_calls.strict_calls_spec(parsed.tools, answer)
        if strict is not None:
            parsed.sampling = msgspec.structs.replace(parsed.sampling, structured=StructuredSpec(*strict, "tools"))
        return
    if given is not None:
        raise _bad("tool_choice", f"a required or named tool call is already constrained; it cannot be combined "
                                  f"with {given.param or 'another output constraint'}")
    spec = StructuredSpec(*tool_calls.forced_calls_spec(parsed.tools), "tool_choice")
    parsed.sampling = msgspec.structs.replace(parsed.sampling, structured=spec)


def _check_media_fields(parsed: ParsedRequest) -> None:
    """A field that works on the prompt's text tokens is refused with media:
    truncating could cut a media item's placeholder run."""
    has_media = any(not isinstance(m.content, str) and any(p.type != "text" for p in m.content)
                    for m in parsed.messages or [])
    if not has_media:
        return
    if parsed.sampling.truncate_prompt_tokens is not None:
        raise _bad("truncate_prompt_tokens", "not supported with image, video or audio parts")


def parse_messages(messages: Any) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty array of messages, got {_show(messages)}")
    return [_parse_message(i, m) for i, m in enumerate(messages)]


def _parse_message(i: int, message: Any) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad(where, f"expected an object with role and content, got {_show(message)}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {_show(role)}")
    accepted = MESSAGE_KEYS | MESSAGE_ROLE_KEYS.get(role, frozenset())
    unknown = next((key for key, value in message.items() if key not in accepted and value is not None), None)
    if unknown is not None:
        raise _bad(f"{where}.{unknown}", f"not a field of a {role} message here; accepted: "
                                         f"{', '.join(sorted(accepted - MESSAGE_ECHOED_KEYS))}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    try:
        extra = tool_calls.parse_message_tool_fields(where, role, message)
    except ToolError as err:
        raise _bad(err.param, err.message) from None
    for key in ("name", "reasoning_content", "reasoning"):  # to the chat template, as vLLM hands them on
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(f"{where}.{key}", f"expected a string, got {_show(value)}")
        if value is None:
            continue
        if key == "reasoning":  # templates read reasoning_content
            if extra.get("reasoning_content", value) != value:
                raise _bad(f"{where}.reasoning", "differs from reasoning_content, the same field's older name: "
                                                 "send one of them")
            key = "reasoning_content"
        extra[key] = value
    if isinstance(content, str):
        return ChatMessage(role=ROLES[role], content=content, **extra)
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"expected a string or an array of text parts, got {_show(content)}")
    parts = [_parse_part(f"{where}.content[{j}]", p, role) for j, p in enumerate(content)]
    return ChatMessage(role=ROLES[role], content=parts, **extra)


def _parse_part(where: str, part: Any, role: str) -> ContentPart:
    if not isinstance(part, dict):
        raise _bad(where, f"expected an object like {{\"type\": \"text\", \"text\": ...}}, got {_show(part)}")
    kind = part.get("type")
    if kind == "refusal" and role == "assistant":  # OpenAI's assistant part: its text, as vLLM renders it
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise _bad(f"{where}.refusal", f"expected a string, got {_show(refusal)}")
        return ContentPart(type="text", text=refusal)
    if kind in ("image_url", "video_url", "audio_url"):
        return _parse_media_part(f"{where}.{kind}", kind, part.get(kind))
    if kind == "input_audio":
        return ContentPart(type=kind, url=_parse_input_audio(f"{where}.input_audio", part.get(kind)))
    if kind != "text":
        raise _bad(f"{where}.type", "accepted content part types are \"text\", \"image_url\", \"video_url\", "
                                    "\"audio_url\" and \"input_audio\" (and an assistant's \"refusal\"), "
                                    f"got {_show(kind)}")
    text = part.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text", f"expected a string, got {_show(text)}")
    return ContentPart(type="text", text=text)


INPUT_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg"}


def _parse_input_audio(where: str, value: Any) -> str:
    """OpenAI's ``{"data": base64, "format": "wav" | "mp3"}``, as the data: URL
    prepare reads (the base64 itself is checked there, with the size limit)."""
    if not isinstance(value, dict):
        raise _bad(where, f"expected an object like {{\"data\": \"<base64>\", \"format\": \"wav\"}}, got {_show(value)}")
    unknown = next((k for k in value if k not in ("data", "format")), None)
    if unknown is not None:  # the clip is read as its bytes say (a rate, channels): a key can't change it
        raise _bad(f"{where}.{unknown}", "not a key of input_audio; accepted: data, format")
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise _bad(f"{where}.data", f"expected the audio file as a non-empty base64 string, got {_show(data)}")
    if not isinstance(fmt, str) or fmt not in INPUT_AUDIO_FORMATS:
        raise _bad(f"{where}.format", f"accepted formats are {', '.join(map(repr, INPUT_AUDIO_FORMATS))}, got {_show(fmt)}")
    return f"data:{INPUT_AUDIO_FORMATS[fmt]};base64,{data}"


IMAGE_DETAILS = ("auto", "low", "high")


def _parse_media_part(where: str, kind: str, value: Any) -> ContentPart:
    """OpenAI's ``{"url": ..., "detail": ...}`` object (``detail`` an image's
    only), or vLLM's bare URL string. Whether the model takes media, and the
    URL's scheme and limits, are checked by prepare."""
    keys = ("url", "detail") if kind == "image_url" else ("url",)
    if isinstance(value, dict):
        unknown = next((k for k in value if k not in keys), None)
        if unknown is not None:
            raise _bad(f"{where}.{unknown}", f"not a key of {kind}; accepted: {', '.join(keys)}")
        url, detail = value.get("url"), value.get("detail")
        if not isinstance(url, str) or not url:
            raise _bad(f"{where}.url", f"expected the {kind[:-4]}'s URL as a non-empty string (data:, http(s):// or "
                                       f"file://), got {_show(url)}")
        if detail is not None and detail not in IMAGE_DETAILS:
            raise _bad(f"{where}.detail", f"accepted: {', '.join(map(repr, IMAGE_DETAILS))}, got {_show(detail)}")
        return ContentPart(type=kind, url=url, detail=detail if detail in ("low", "high") else None)
    if not isinstance(value, str) or not value:
        raise _bad(where, f"expected an object like {{\"url\": \"data:...\"}} or a URL string, got {_show(value)}")
    return ContentPart(type=kind, url=value)


# --------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------


def parse_completion(raw: bytes, max_model_len: int | None = None, vocab_size: int | None = None, *,
                     defaults: dict | None = None) -> ParsedRequest:
    """Validate a (legacy) completions body (raises ApiError); ``defaults`` as ``parse_chat``'s."""
    body = decode_body(raw)
    defaults = defaults or {}
    echo = get_bool(body, "echo", False)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value == 0 and not isinstance(value, bool) and not echo:
            raise _bad(name, "expected an integer of at least 1, got 0 (0 only with \"echo\": true, which returns "
                             "the prompt alone)")
    cap = _parse_max_tokens(body, 16, max_model_len, lo=0 if echo else 1,  # 0: echo the prompt alone
                            model_default=defaults.get("max_tokens"))
    logprobs = get_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    parsed = _parse_common(body, "completion", cap, logprobs, vocab_size, max_model_len, defaults)
    if parsed.sampling.thinking_budget is not None and parsed.sampling.structured is not None:
        param = parsed.sampling.structured.param or "structured_outputs"
        raise _bad("thinking_token_budget", f"not with {param} on /v1/completions, whose constraint holds from the "
                                            "first token (a forced </think> would break it); send the chat to "
                                            "/v1/chat/completions, where it holds after the reasoning")
    if echo and logprobs is not None:  # the prompt's tokens' logprobs too, as OpenAI's (a prompt's score)
        parsed.sampling = msgspec.structs.replace(
            parsed.sampling, prompt_logprobs=max(logprobs, parsed.sampling.prompt_logprobs or 0))
    if cap[0] == 0:  # the engine runs the prompt and samples one token, not output
        parsed.sampling = msgspec.structs.replace(parsed.sampling, max_tokens=1)
    parsed.output = dataclasses.replace(parsed.output, echo=echo, echo_only=cap[0] == 0)
    best_of = get_int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != parsed.n:
        raise _bad("best_of", f"only best_of equal to n ({parsed.n}) is supported: choices are not ranked")
    parsed.prompts = parse_prompts(body.get("prompt"), vocab_size)
    if parsed.num_choices > MAX_N * 4:
        raise _bad("n", f"{len(parsed.prompts)} prompts x n={parsed.n} is more than {MAX_N * 4} choices")
    return parsed


def parse_prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of those."""
    accepted = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise _bad("prompt", f"expected {accepted}, non-empty; got {_show(prompt)}")
    if len({isinstance(p, str) for p in prompts}) > 1:
        raise _bad("prompt", "a list of prompts must be all strings or all token-id lists, not a mix")
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    for i, p in enumerate(prompts):
        _check_prompt(i, p, vocab_size, accepted)
    return prompts


def _check_prompt(i: int, prompt: Any, vocab_size: int | None, accepted: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", f"prompt {i} is empty; send at least one character (or token id)")
        return
    if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
        raise _bad("prompt", f"prompt {i}: expected {accepted}, non-empty")
    hi = vocab_size if vocab_size else 1 << 31
    bad = next((t for t in prompt if not 0 <= t < hi), None)
    if bad is not None:
        raise _bad("prompt", f"prompt {i}: token id {bad} is out of range [0, {hi})")


# --------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's bodies)
# --------------------------------------------------------------------------


@dataclass
class TokenizeRequest:
    """Exactly one of ``prompt`` / ``messages``; ``add_special_tokens`` defaults
    as vLLM's: true for a prompt, false for messages (the template writes them)."""

    model: str | None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None  # messages: more variables for the template, as a chat request's
    tools: list[dict] | None = None  # messages: the tools the template renders, as a chat request's
    return_token_strs: bool = False  # each token's vocabulary string too


TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs", "tools", "chat_template_kwargs"})


def parse_tokenize(raw: bytes) -> TokenizeRequest:
    body = decode_body(raw)
    check_known(body, TOKENIZE_FIELDS, "/tokenize")
    strs = get_bool(body, "return_token_strs", False)
    model = get_str(body, "model", None)
    if ("prompt" in body) == ("messages" in body):
        raise _bad("prompt", "send exactly one of prompt (a string) and messages")
    if "prompt" in body:
        prompt = get_str(body, "prompt", None)
        if prompt is None:
            raise _bad("prompt", "expected a string")
        for name in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if body.get(name) is not None:  # the chat template's: a prompt is not rendered
                raise _bad(name, "renders with messages only; send messages, or leave it out with a prompt")
        return TokenizeRequest(model, prompt=prompt, add_special_tokens=get_bool(body, "add_special_tokens", True),
                               return_token_strs=strs)
    chat = parse_messages(body.get("messages"))
    continue_final, add_generation_prompt = _parse_turn_flags(body, chat)  # as a chat request reads them
    try:
        tools = tool_calls.parse_tool_request(body.get("tools"), "none", None)
    except ToolError as err:
        raise _bad(err.param, err.message) from None
    return TokenizeRequest(model, messages=chat, add_special_tokens=get_bool(body, "add_special_tokens", False),
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
                           chat_template_kwargs=parse_template_kwargs(body),
                           tools=None if tools is None else tools.tools, return_token_strs=strs)


def parse_detokenize(raw: bytes, vocab_size: int | None) -> tuple[str | None, list[int]]:
    """(model, token ids)."""
    body = decode_body(raw)
    check_known(body, {"model", "tokens"}, "/detokenize")
    tokens = get_token_ids(body, "tokens", 1 << 20, vocab_size)
    if "tokens" not in body or body["tokens"] is None:
        raise _bad("tokens", "expected a list of token ids")
    return get_str(body, "model", None), list(tokens)


# vLLM's runtime LoRA routes' fields (an unload's lora_int_id names nothing the name does not).
ADAPTER_FIELDS = {"load": frozenset({"lora_name", "lora_path", "load_inplace"}),
                  "unload": frozenset({"lora_name", "lora_int_id"})}


def check_adapter_fields(body: dict, kind: str) -> None:
    """400 for a field /v1/{kind}_lora_adapter does not read (a typo such as load_in_place was dropped)."""
    check_known(body, ADAPTER_FIELDS[kind], f"/v1/{kind}_lora_adapter")
    get_int(body, "lora_int_id", None, -(1 << 63), (1 << 63) - 1)  # vLLM's int, else a 400


def check_known(obj: dict, accepted: frozenset | set, route: str = "", where: str = "") -> None:
    """400 naming the first key of ``obj`` not in ``accepted`` (``where``: the path of a nested ``obj``)."""
    unknown = next((k for k in obj if k not in accepted), None)
    if unknown is not None:
        raise _bad(f"{where}.{unknown}" if where else unknown,
                   f"unknown field{f' for {route}' if route else ''}; accepted: {', '.join(sorted(accepted))}")


# --------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    usage = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return usage


def chat_response(rid: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices, "usage": usage}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


def chat_logprob(token: str, logprob: float, top: list[tuple[str, float]], token_bytes: bytes | None = None,
                 top_bytes: list[bytes] | None = None) -> dict:
    """One entry of ``choices[].logprobs.content``; ``bytes`` are a token's own
    (part of a character for some), else its text's."""
    def raw(text: str, given: bytes | None) -> list[int]:
        return list(given if given is not None else text.encode("utf-8", "surrogatepass"))

    return {
        "token": token,
        "logprob": logprob,
        "bytes": raw(token, token_bytes),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": raw(t, top_bytes[k] if top_bytes else None)}
                         for k, (t, lp) in enumerate(top)],
    }


def vllm_prompt_logprobs(scores: tuple, token_text: Any, num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then each
    one's ``{token id: {logprob, rank, decoded_token}}``, the prompt token's
    own first, then the ``num_top`` top alternatives (rank 1, 2, ...)."""
    out: list[dict | None] = [None]
    for score in scores:
        entry = {str(score.token_id): {"logprob": score.logprob, "rank": score.rank,
                                       "decoded_token": token_text(score.token_id)}}
        for rank, top in enumerate(score.top_logprobs[:num_top], start=1):
            entry.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank,
                                                 "decoded_token": token_text(top.token_id)})
        out.append(entry)
    return out


def token_id_text(token_id: int) -> str:
    """A token's name in logprobs under ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}"


def completion_response(rid: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": usage}


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def legacy_logprobs(entries: list[tuple]) -> dict:
    """OpenAI's legacy completions logprobs from (token, logprob, top, text_offset).
    Each ``top_logprobs`` holds the sampled token too, as OpenAI's does (up to
    ``logprobs + 1`` entries): ``top_logprobs[i][tokens[i]]`` is always there."""
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [None if e[1] is None else {**dict(e[2]), e[0]: e[1]} for e in entries],
        "text_offset": [e[3] for e in entries],
    }


def hidden_stop_ids(parsed: ParsedRequest, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a choice and whose text stays out of it: EOS (unless
    ignored) and ``stop_token_ids``, unless ``include_stop_str_in_output``."""
    if parsed.output.include_stop_str_in_output:
        return frozenset()
    sampling = parsed.sampling
    return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(eos_token_ids))


def model_card(listing: dict, model_id: str) -> dict | None:
    """One entry of ``models_list``'s listing (``/v1/models/{id}``), None if not served."""
    return next((m for m in listing["data"] if m["id"] == model_id), None)


def models_list(name: str, created: int, max_model_len: int | None, adapters: dict[str, str] | list[str] = ()) -> dict:
    """vLLM's listing: each adapter with ``parent`` = the base and ``root`` = its path
    (``adapters`` maps name -> path; a plain list of names roots each at its name)."""
    base = {"id": name, "object": "model", "created": created, "owned_by": "mstar-actors", "root": name,
            "parent": None, "max_model_len": max_model_len}
    pairs = sorted(adapters.items()) if isinstance(adapters, dict) else [(a, a) for a in adapters]
    data = [base] + [dict(base, id=a, root=path, parent=name) for a, path in pairs]
    return {"object": "list", "data": [card | {"permission": [_permission(card["id"], created)]} for card in data]}


def _permission(model: str, created: int) -> dict:
    """vLLM's model card's one permission (clients that parse its card read it): sampling, logprobs, viewing."""
    return {"id": f"modelperm-{model}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


# --------------------------------------------------------------------------
# One choice's output, assembled from engine deltas
# --------------------------------------------------------------------------


class ChoiceOutput:
    """Text, logprobs and finish state of one choice: pure, fed by the frontend.

    ``detokenizer`` has ``add(ids) -> str`` (never half a UTF-8 character) and
    ``stops`` has ``feed(text) -> (emit, matched)`` and ``flush() -> str``
    (see ``mstar_actors.tokenization``). ``token_text(id)`` names a token for
    logprobs. Once ``is_done``, later messages of this choice are ignored: after
    a stop-string match the frontend aborts the engine request, and tokens
    already in flight are not the client's.
    """

    def __init__(self, index: int, detokenizer: Any, stops: Any, token_text: Any, want_logprobs: bool,
                 hidden_stop_ids: frozenset[int] = frozenset(), token_bytes: Any = None):
        self.index = index
        self.detokenizer = detokenizer
        # the engine ends the choice on these tokens; their text is not output (vLLM's
        # default, ``hidden_stop_ids``): always the last token of its delta
        self.hidden_stop_ids = hidden_stop_ids
        self.min_tokens = 0
        self.stops = stops
        self.token_text = token_text
        self.token_bytes = token_bytes  # id -> the token's UTF-8 bytes (chat logprobs' bytes); None: its text's
        self.want_logprobs = want_logprobs
        self.text_parts: list[str] = []
        # characters the detokenizer has given, held back for a stop string or not:
        # where the next token's text starts (legacy logprobs' text_offset)
        self.num_decoded_chars = 0
        # (token, logprob, top, text_offset, (token id, top ids))
        self.logprobs: list[tuple[str, float, list[tuple[str, float]], int, tuple]] = []
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None  # the stop token of stop_token_ids the engine ended it on
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held
        self.num_preemptions = 0  # the engine's, at the end
        self.token_ids: list[int] = []  # for return_token_ids
        self.num_streamed_ids = 0  # of token_ids, already sent in chunks
        self.is_prompt_sent = False  # streamed completions: prompt_token_ids went out
        self.prompt_token_ids: list[int] | None = None  # return_token_ids: the engine's, on the first delta
        self.echo_text = ""  # completions echo: the prompt before the output
        # echo with logprobs: the prompt's ids and where each one's text starts, for
        # the entries the first token's prompt_logprobs fill (then None)
        self.echo_prompt: tuple[list[int], list[int], int] | None = None  # (ids, offsets, top alternatives)
        self.prompt_scores: tuple = ()  # SampledToken.prompt_logprobs of the first token, where asked for
        self.is_echoed = False  # streamed: the echo went out with the first chunk
        self.echo_only = False  # OutputOptions.echo_only: the engine's one token is not output
        self.last_token_at: float | None = None  # perf_counter of the last delta, for inter-token latency
        self.first_token_at: float | None = None  # perf_counter of the first, for the decode time
        self.phases = (0.0, 0.0)  # the engine's queue and prefill seconds (TokenDelta's, on the first)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, tokens: list) -> tuple[str, list]:
        """Feed sampled tokens; return (new text, new logprob entries).
        Sets ``finish_reason = "stop"`` when a stop string matched."""
        if self.is_done:
            return "", []
        if tokens and tokens[0].prompt_logprobs:  # the first token, of a request that asked for them
            self.prompt_scores = tokens[0].prompt_logprobs
        if self.echo_only:  # the prompt alone: its entries, none of the token
            if self.echo_prompt is None or not tokens:
                return "", []
            self._add_prompt_logprobs(self.prompt_scores)
            return "", self.logprobs[:]  # the first delta's: only the prompt's
        if not (self.want_logprobs or self.num_output_tokens < self.min_tokens):
            return self._add_group(tokens), []
        first_entry = len(self.logprobs)
        if self.echo_prompt is not None and tokens:
            self._add_prompt_logprobs(self.prompt_scores)
        emitted = []
        for token in tokens:  # one by one: a logprob entry each, or min_tokens is reached mid-delta
            self.num_output_tokens += 1
            self.token_ids.append(token.token_id)
            if self.want_logprobs:
                self._add_logprob(token)
            # a stop token's text stays out where it ends the choice: from min_tokens on (the scheduler's rule; a
            # thinking budget's forced </think> may come before)
            ends = token.token_id in self.hidden_stop_ids and self.num_output_tokens >= self.min_tokens
            ids = [] if ends else [token.token_id]
            text = self.detokenizer.add(ids)
            self.num_decoded_chars += len(text)
            # as vLLM: a stop string ends past the text of the first min_tokens tokens (it may begin in it)
            emit, matched = self.stops.feed(text, search=self.num_output_tokens > self.min_tokens)
            self._append(emit, emitted)
            if matched:
                self.finish_reason = "stop"
                break
        return "".join(emitted), self.logprobs[first_entry:]

    def _add_group(self, tokens: list) -> str:
        """``add`` for tokens fed as one group (no logprobs, min_tokens reached):
        the same steps, on the path every token of a plain stream takes."""
        ids = [t.token_id for t in tokens]
        self.num_output_tokens += len(ids)
        self.token_ids += ids
        text = self.detokenizer.add(ids[:-1] if ids[-1] in self.hidden_stop_ids else ids)
        self.num_decoded_chars += len(text)
        emit, matched = self.stops.feed(text)
        if emit:
            self.text_parts.append(emit)
        if matched:
            self.finish_reason = "stop"
        return emit

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or stop token that ended the
        choice; None for EOS, a length cut, or a grammar's end."""
        return self.stops.matched if self.stops.matched is not None else self.stop_token_id

    def finish(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
               num_cached_tokens: int = 0, stop_token_id: int | None = None, num_preemptions: int = 0) -> str:
        """The engine finished this choice (not done here); return the held-back tail text.
        ``stop_token_id``: the stop token (of ``stop_token_ids``) it ended on, if any."""
        self.num_cached_tokens, self.num_preemptions = num_cached_tokens, num_preemptions
        self.stop_token_id = stop_token_id
        emitted: list[str] = []
        emit, matched = self.stops.feed(self.detokenizer.flush())
        self._append(emit if matched else emit + self.stops.flush(), emitted)
        self.finish_reason = "stop" if matched or finish_reason != "length" else "length"
        if self.echo_only:  # nothing was generated for the client: the cap of 0 ended it (OpenAI's)
            self.finish_reason, self.stop_token_id = "length", None
        self.num_prompt_tokens = num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = 0 if self.echo_only else max(self.num_output_tokens, num_output_tokens)
        return "".join(emitted)

    def _append(self, text: str, emitted: list[str]) -> None:
        if text:
            self.text_parts.append(text)
            emitted.append(text)

    def _add_logprob(self, token: Any) -> None:
        logprob = token.logprob if token.logprob is not None else 0.0
        self._add_entry(token.token_id, logprob, token.top_logprobs, self.num_decoded_chars)

    def _add_prompt_logprobs(self, given: tuple) -> None:
        """The echoed prompt's entries: its first token has no logprob (nothing
        before it), each later one the logprob it had given those before it."""
        ids, offsets, num_top = self.echo_prompt
        self.echo_prompt = None
        self._add_entry(ids[0], None, (), offsets[0])
        for token, offset in zip(given, offsets[1:]):  # (prompt_logprobs may have asked for more alternatives)
            self._add_entry(token.token_id, token.logprob, token.top_logprobs[:num_top], offset)

    def _add_entry(self, token_id: int, logprob: float | None, tops: tuple, offset: int) -> None:
        top = [(self.token_text(t.token_id), t.logprob) for t in tops]
        ids = (token_id, tuple(t.token_id for t in tops))
        self.logprobs.append((self.token_text(token_id), logprob, top, offset, ids))

    def chat_logprobs(self, entries: list | None = None) -> list[dict] | None:
        if not self.want_logprobs:
            return None
        out = []
        for tok, lp, top, _, (token_id, top_ids) in (self.logprobs if entries is None else entries):
            if self.token_bytes is None:
                out.append(chat_logprob(tok, lp, top))
            else:
                out.append(chat_logprob(tok, lp, top, self.token_bytes(token_id),
                                        [self.token_bytes(i) for i in top_ids]))
        return out

    def legacy_logprobs(self, entries: list | None = None) -> dict | None:
        if not self.want_logprobs:
            return None
        return legacy_logprobs(self.logprobs if entries is None else entries)
