"""The model's tokenizer, the incremental detokenizer and stop strings.

``Tokenization`` loads a Hugging Face tokenizer from a local model directory
(never the network) and is built inside the process that uses it (prepare,
frontend): it is never pickled or sent anywhere.

``IncrementalDetokenizer`` and ``StopStrings`` are pure per-request state
machines the frontend feeds as ``TokenDelta``s arrive.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils.chat_template_utils import _compile_jinja_template

from mstar_actors import messages
from mstar_actors.frontend.tool_calls import (
    TemplateToolCaps,
    template_tool_caps,
    template_tool_fields,
    with_tool_polyfills,
)
from mstar_actors.prepare.prompt_bound import encode_bounded, max_chars_per_token

REPLACEMENT_CHAR = "\ufffd"


class TemplateRefused(ValueError):
    """A request's messages the chat template does not render (or a model without one): the client's."""
# Prompt tokens the detokenizer decodes before the first output token, so the
# first output gets the right leading space (SentencePiece) and merges (vLLM: 5).
NUM_PREFIX_TOKENS = 5
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's alphabet


_PROBE = "\u241fprobe\u241f"  # a user turn's text no template writes itself (``generation_prompt``)


class Tokenization:
    """One model's tokenizer with the calls the engine needs."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        try:
            self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                str(self.model_dir), local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot load a tokenizer from model directory {self.model_dir.name!r}: {exc}; "
                "it needs tokenizer.json or the tokenizer files of a Hugging Face model"
            ) from exc
        if (template := processor_chat_template(self.model_dir)) is not None:
            self.tokenizer.chat_template = template
        self._text_decoders: dict[bool, TextDecoder] = {}
        self._tool_caps: TemplateToolCaps | None = None  # the template's tool fields, probed once

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def content_format(self) -> str:
        """How the chat template reads a message's content: ``"openai"`` where it loops over its parts, else
        ``"string"`` (``content_format``)."""
        return content_format(getattr(self.tokenizer, "chat_template", None) or "")

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        return max_chars_per_token(self.tokenizer)

    def encode_text(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; PromptTooLong when it has ``max_tokens`` or
        more (decided without tokenizing all of a long text)."""
        def encode(part: str) -> list[int]:
            return self.tokenizer(part, add_special_tokens=add_special_tokens).input_ids

        return encode_bounded(encode, text, max_tokens, self.max_chars_per_token)

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """``ids`` with the special tokens the tokenizer adds around a text (its post-processor's:
        Llama 3's BOS, none for SmolLM2), each end's unless ``ids`` already has them there (a chat
        template that writes the BOS itself)."""
        prefix, suffix = self._special_ends
        if prefix and ids[: len(prefix)] != prefix:
            ids = prefix + ids
        if suffix and ids[len(ids) - len(suffix):] != suffix:
            ids = ids + suffix
        return ids

    @functools.cached_property
    def _special_ends(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text's own when it adds special tokens."""
        plain = self.tokenizer("a", add_special_tokens=False).input_ids
        full = self.tokenizer("a", add_special_tokens=True).input_ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return [], []

    def encode_prompt(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of a completion prompt, with the model's BOS rules
        (``max_tokens``: see ``encode_text``)."""
        return self.encode_text(text, True, max_tokens)

    def apply_chat_template(
        self,
        chat: list[messages.ChatMessage],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        assistant_prefix: str = "",
        tool_format: str = "llama3_json",
        template_kwargs: dict | None = None,
        media_parts: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's own chat template
        (``processor_chat_template``'s where the folder has one).

        ``tools`` (OpenAI's list) are rendered by the template as it documents
        them (or, where it writes none, described in the system message, and
        an assistant's calls in its content, in ``tool_format``:
        ``with_tool_polyfills``);
        ``assistant_prefix`` is appended after the generation prompt
        (the opening of a forced tool call). The rendered text is tokenized
        without adding special tokens again (the template writes them), as
        ``tokenizer.apply_chat_template`` does. ``template_kwargs``: more
        variables for the template (a request's ``chat_template_kwargs``).
        ``media_parts``: image, video and audio parts go to the template as
        Qwen's templates read them (a multimodal model's preparer expands
        their placeholders); else a message is its text parts joined.
        """
        text = self._render(chat, add_generation_prompt, continue_final_message, tools, tool_format, template_kwargs,
                            media_parts)
        return self.encode_text(text + assistant_prefix, False, max_tokens)

    def _render(self, chat: list[messages.ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                tools: list[dict] | None, tool_format: str, template_kwargs: dict | None, media_parts: bool) -> str:
        """``apply_chat_template``'s text (raises TemplateRefused)."""
        if not self.has_chat_template:
            raise TemplateRefused(
                f"model {self.model_dir.name!r} has no chat template, so it cannot take "
                "'messages'; send a plain 'prompt' to /v1/completions instead"
            )
        loops = self.content_format == "openai"
        conversation = [_template_message(i, m, media_parts, loops) for i, m in enumerate(chat)]
        conversation, tools = self.tool_polyfills(chat, conversation, tools, tool_format)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            raise TemplateRefused(f"the model's chat template refused 'messages': {exc}") from exc
        except Exception as exc:  # a value it can't render (the request's: the template is the model's)
            raise TemplateRefused(f"the model's chat template could not render 'messages' or chat_template_kwargs: "
                             f"{type(exc).__name__}: {exc}") from exc
        return text

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token that spells ``text`` (``</think>``, say), or None where it takes more, or
        where a decode that skips special tokens (a reply's, by default) drops it."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1 or any(self.tokenizer.decode(ids, skip_special_tokens=skip) != text for skip in (False, True)):
            return None
        return ids[0]

    def generation_prompt(self, template_kwargs: dict | None = None) -> str | None:
        """The chat template's text after a user turn with the generation prompt (what a reply follows):
        whether it opens a ``<think>`` block, say. Empty where there is no template; None where the
        template refuses a lone user turn and one after a system turn (a rule of its own on the messages):
        then only a request's own messages tell (``generation_prompt_of``)."""
        if not self.has_chat_template:
            return ""
        for probe in ([{"role": "user", "content": _PROBE}],
                      [{"role": "system", "content": "-"}, {"role": "user", "content": _PROBE}]):
            try:
                text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                                          **(template_kwargs or {}))
            except Exception:  # noqa: BLE001 - a template's own rule on its messages: the next probe
                continue
            return text[text.rfind(_PROBE) + len(_PROBE):]
        return None

    def generation_prompt_of(self, chat: list[messages.ChatMessage], tools: list[dict] | None, tool_format: str,
                             template_kwargs: dict | None = None) -> str:
        """``generation_prompt`` of a request's own messages: its render's text past what it shares with the
        same render without the generation prompt (a template may end a conversation that asks for none with
        a closing token of its own), from the line or tag that difference starts in (``<think>`` against
        ``<|endoftext|>`` share a ``<``); empty where the template refuses them (the request's own render
        reports it)."""
        try:
            whole, turns = (self._render(chat, add, False, tools, tool_format, template_kwargs, False)
                            for add in (True, False))
        except TemplateRefused:
            return ""
        shared = len(os.path.commonprefix([whole, turns]))
        start = max(whole.rfind("\n", 0, shared), whole.rfind(">", 0, shared)) + 1 if shared < len(turns) else shared
        return whole[start:]

    def tool_polyfills(self, chat: list[messages.ChatMessage], conversation: list[dict], tools: list[dict] | None,
                       tool_format: str) -> tuple[list[dict], list[dict] | None]:
        """``(conversation, tools)`` of ``chat`` (its template messages) as
        ``with_tool_polyfills`` makes them for the chat template, whose tool
        fields are probed once."""
        if not (tools or any(m.tool_calls for m in chat)):
            return conversation, tools
        return with_tool_polyfills(conversation, tools, self.tool_caps, tool_format)

    @property
    def tool_caps(self) -> TemplateToolCaps:
        """Which tool fields the chat template writes (the rest are polyfilled)."""
        if self._tool_caps is None:
            self._tool_caps = template_tool_caps(lambda conversation, tools: self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=False))
        return self._tool_caps

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def prompt_text(self, token_ids: list[int]) -> str:
        """A prompt of ids as text, less a character its end leaves unfinished
        (its output's text starts with that character: ``IncrementalDetokenizer``)."""
        return less_unfinished_character(token_ids, lambda ids: self.decode(ids, skip_special_tokens=False),
                                         self.token_bytes)[1]

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own UTF-8 bytes: part of a character for a token whose text
        alone decodes to U+FFFD (a byte-level BPE piece, a ``<0xNN>`` fallback)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8", "surrogatepass")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if fallback:
            return bytes([int(fallback[1], 16)])
        if all(c in _BYTE_OF_CHAR for c in piece):  # GPT-2's byte-level alphabet
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode("utf-8")

    def make_detokenizer(
        self, prompt_token_ids: list[int], skip_special_tokens: bool = True, give_back_tail: bool = True
    ) -> IncrementalDetokenizer:
        """``give_back_tail``: off where the prompt is echoed less its unfinished last character
        (``prompt_text``), which the output then always starts with."""
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens,
                                      self.text_decoder(skip_special_tokens), self.token_bytes, give_back_tail)

    def text_decoder(self, skip_special_tokens: bool = True) -> TextDecoder:
        """This tokenizer's ``TextDecoder`` for the flag, one per setting."""
        decoder = self._text_decoders.get(skip_special_tokens)
        if decoder is None:
            decoder = self._text_decoders[skip_special_tokens] = TextDecoder(self.tokenizer, skip_special_tokens)
        return decoder


# A media part as Qwen's chat templates read it (Qwen2-Audio's template tests for an ``audio_url`` key)
_MEDIA_PARTS = {"image_url": {"type": "image"}, "video_url": {"type": "video"},
                "audio_url": {"type": "audio", "audio_url": ""}, "input_audio": {"type": "audio", "audio_url": ""}}


def _template_message(index: int, message: messages.ChatMessage, media_parts: bool,
                      loops: bool = False) -> dict[str, Any]:
    """A ChatMessage as the dict chat templates expect: its parts as a list
    (a template that loops over them, ``loops``, or ``media_parts``, media
    ones as the placeholders Qwen's templates read), else its text parts
    joined by newlines (as vLLM does for a template that reads a string).
    Where the template loops over the parts (``loops``), a string is one
    text part (as vLLM makes it: looped over, a string's characters write
    nothing); a tool's text is always one string, as vLLM gives it."""
    content = message.content
    if isinstance(content, str):
        if loops and message.role != "tool":
            content = [{"type": "text", "text": content}]
    else:
        for part_index, part in enumerate(content):
            if part.type != "text" and not (media_parts and part.type in _MEDIA_PARTS):
                raise ValueError(f"messages[{index}].content[{part_index}] has type {part.type!r}; "
                                 "only 'text' content parts are supported for this model so far")
        texts_only = all(p.type == "text" for p in content)
        content = ([{"type": "text", "text": p.text or ""} if p.type == "text" else dict(_MEDIA_PARTS[p.type])
                    for p in content] if (media_parts or loops) and not (message.role == "tool" and texts_only)
                   else "\n".join(p.text or "" for p in content))
    return {"role": message.role, "content": content} | template_tool_fields(message)


def content_format(template: str) -> str:
    """``"openai"`` where ``template`` loops over a message's content (its parts, as a list: a Gemma-style
    template writes them one after another), else ``"string"`` (Llama's, Qwen's, SmolLM2's: they print the
    content, and a list would print as one); vLLM tells the two apart the same way. Read from the template's
    syntax tree: the names a message goes by (a loop over ``messages``, a ``set`` from one), the names its
    content goes by, and a ``for`` over one of those."""
    try:  # (transformers' environment: its ``{% generation %}`` tag, which marks an assistant's turn)
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return "string"
    loops, sets = list(tree.find_all(jinja2.nodes.For)), list(tree.find_all(jinja2.nodes.Assign))
    message_names = _names_bound(loops, sets, lambda node: _reads(node, {"messages"}), {"messages"})
    content_names = _names_bound([], sets, lambda node: _reads(node, message_names, "content"), set())

    def over_content(node: Any) -> bool:
        return _reads(node, message_names, "content") or _reads(node, content_names)

    return "openai" if any(over_content(loop.iter) for loop in loops) else "string"


def _names_bound(loops: list, sets: list, reads: Callable[[Any], bool], names: set[str]) -> set[str]:
    """``names`` and every name a loop or a ``set`` binds to what ``reads`` says comes from them, to a fixpoint."""
    names = set(names)
    while True:
        found = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name) and reads(loop.iter)}
        found |= {a.target.name for a in sets if isinstance(a.target, jinja2.nodes.Name) and reads(a.node)}
        if found <= names:
            return names
        names |= found


def _reads(node: Any, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` (with ``key``: its ``key``), through filters, tests, slices and
    indexes (``messages[1:]``, ``messages[0]``, ``message.content | list``)."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or (
            isinstance(node, jinja2.nodes.Getitem) and not _is_key(node.arg)):  # (an item, a slice: not a field)
        node = node.node
    if key is not None:
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            return _reads(node.node, names)
        if isinstance(node, jinja2.nodes.Getitem) and _is_key(node.arg) and node.arg.value == key:
            return _reads(node.node, names)
        return False
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_key(node: Any) -> bool:
    return isinstance(node, jinja2.nodes.Const) and isinstance(node.value, str)


def processor_chat_template(model_dir: Path) -> str | None:
    """The processor's chat template (``chat_template.json``), where the folder
    has one: a multimodal model's card renders prompts with it
    (``processor.apply_chat_template``; Qwen2-Audio's writes the audio
    placeholders, its tokenizer's does not), so every prompt of the model
    does. None: the tokenizer's."""
    path = model_dir / "chat_template.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) and template else None


class TextDecoder:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` for one setting of
    the flag, with the same result at a fraction of the cost: the
    detokenizer decodes twice per token. A fast tokenizer whose class keeps
    the library's decode and cleans up no spaces is decoded by its backend
    directly (the wrapper's argument conversion costs more than the decode);
    any other goes through ``decode``. A single token's text, the
    detokenizer's prefix for nearly every token, is remembered (at most one
    entry per id of the vocabulary)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self.skip_special_tokens = skip_special_tokens
        self.decode_ids = _backend_decode(tokenizer, skip_special_tokens) or functools.partial(
            tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self._texts: dict[int, str] = {}

    def decode(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:
            text = self._texts.get(token_ids[0])
            if text is None:
                text = self._texts[token_ids[0]] = self.decode_ids(token_ids)
            return text
        return self.decode_ids(token_ids) if token_ids else ""


def _backend_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Any:
    """The backend's decode when ``tokenizer.decode`` is exactly it, else None."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base

    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or cls.decode is not Base.decode
            or cls._decode is not PreTrainedTokenizerFast._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)


def unfinished_tail(token_ids: list[int], token_bytes: Callable[[int], bytes]) -> tuple[int, bool]:
    """Where ``token_ids``' bytes end with the first bytes of a character
    (ones that more bytes would finish, not invalid ones), as a prompt of
    ids cut inside a character ends: ``(n, False)`` where its last ``n``
    tokens are that character's bytes alone (leave them unread: a
    SentencePiece byte fallback decodes each to a U+FFFD), ``(0, True)`` where
    a token also holds what comes before it (strip the one U+FFFD a byte-level
    decode ends in), ``(0, False)`` where the ids end at a character's end."""
    tail = token_ids[-4:]  # a character has <= 4 bytes
    pieces = [token_bytes(t) for t in tail]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(pieces), final=False)
    pending = len(decoder.getstate()[0])
    num, covered = 0, 0
    while pending and covered < pending:
        num += 1
        covered += len(pieces[-num])
    return (num, False) if pending and covered == pending else (0, bool(pending))


def less_unfinished_character(token_ids: list[int], decode: Callable[[list[int]], str],
                              token_bytes: Callable[[int], bytes]) -> tuple[int, str, bool]:
    """``(ids read, their text, whether a character was left out)`` of a
    prompt of ids: all but a character its end leaves unfinished
    (``unfinished_tail``), which its output may finish."""
    text = decode(token_ids)
    if not text.endswith(REPLACEMENT_CHAR):  # whole (the usual prompt: no byte of it is looked at)
        return len(token_ids), text, False
    num, strip = unfinished_tail(token_ids, token_bytes)
    read = len(token_ids) - num
    text = decode(token_ids[:read]) if num else text[:-1] if strip else text
    return read, text, bool(num or strip)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas as they arrive.

    vLLM's prefix-offset / read-offset technique: keep a short window of ids
    that starts a few tokens before the unread ones; decode the window with
    and without the unread ids and emit the difference. Decoding in context
    keeps SentencePiece leading spaces and byte-level merges right, and costs
    O(window) per token instead of O(output).

    Invariants: the prefix text (``_window[:_num_read]``'s) does not end in
    U+FFFD (it stops at a character boundary; a prompt's unfinished last
    character is unread, or, inside a token, cut from it); text is emitted only when the
    whole window decodes to more text that does not end in U+FFFD, so half a
    UTF-8 character is held back until its last byte arrives. The prefix's
    text changes only when the read ids advance, so it is decoded once then.

    For byte-level BPE the concatenated deltas plus ``flush()`` equal
    ``decode(all_output_ids)``. For SentencePiece models with a prompt, the
    first delta keeps its leading space (the text continues the prompt),
    where a standalone decode would drop it.

    ``decoder``: a ``TextDecoder`` of ``tokenizer`` with the same
    ``skip_special_tokens``, shared by the requests of one process (its
    cache of single tokens' texts is then warm); made here when not given.

    A prompt of token ids may end inside a character (its last bytes a
    character's first): the prompt's text then ends in U+FFFD, which the
    output's first tokens may replace with the whole character. With
    ``token_bytes`` (``Tokenization.token_bytes``) that unfinished character
    is left unread, so an output that goes on with it starts with the whole
    character (as a decode of prompt and output together reads). With
    ``give_back_tail`` an output whose first visible text does not go on
    with it (the prompt's whole decode is what that text starts with)
    leaves it the prompt's U+FFFD, out of the output; without (an echo that
    shows the prompt less that character), the output starts with it
    whatever comes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        decoder: TextDecoder | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
        give_back_tail: bool = True,
    ):
        if decoder is not None and decoder.skip_special_tokens != skip_special_tokens:
            raise ValueError("the decoder's skip_special_tokens differs from the detokenizer's")
        self._decode = (decoder or TextDecoder(tokenizer, skip_special_tokens)).decode
        self._window: list[int] = list(prompt_token_ids[-NUM_PREFIX_TOKENS:])
        self._num_read = len(self._window)
        self._prefix_text: str | None = None  # decode(_window[:_num_read]), once needed
        self._token_bytes = token_bytes  # until the prompt's prefix is decoded
        self._give_back_tail = give_back_tail
        # the prompt's unfinished character while its owner is open: (its tokens unread, the prompt's whole text)
        self._tail: tuple[int, str] | None = None

    def add(self, token_ids: list[int]) -> str:
        """The new text that ``token_ids`` complete (possibly "")."""
        if len(token_ids) == 1:
            return self._add_one(token_ids[0])
        return "".join([self._add_one(token_id) for token_id in token_ids])

    def flush(self) -> str:
        """What is still held back at the end of the request (an unfinished
        character decodes as U+FFFD, as a full decode would)."""
        prefix_text = self._prefix()
        text = self._decode(self._window)
        if self._tail is not None:  # no visible text yet: whose the prompt's character is, by the whole
            if text.startswith(self._tail[1]):
                prefix_text = self._give_back()
            self._tail = None
        self._advance()
        return text[len(prefix_text) :]

    def _add_one(self, token_id: int) -> str:
        self._window.append(token_id)
        prefix_text = self._prefix()
        text = self._decode(self._window)
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # a special token skipped, or a character still incomplete
        if self._tail is not None:  # the first visible text: whose the prompt's character is
            if text.startswith(self._tail[1]):  # not gone on with: its U+FFFD the prompt's
                prefix_text = self._give_back()
                if len(text) <= len(prefix_text):
                    return ""
            self._tail = None
        self._advance()
        return text[len(prefix_text) :]

    def _give_back(self) -> str:
        num, whole = self._tail
        self._tail = None
        self._num_read += num
        self._prefix_text = whole
        return whole

    def _prefix(self) -> str:
        if self._prefix_text is None:
            if self._token_bytes is not None:  # the prompt's: its unfinished character left unread
                prompt = self._window[: self._num_read]
                self._num_read, text, left_out = less_unfinished_character(prompt, self._decode, self._token_bytes)
                self._token_bytes = None
                if left_out and self._give_back_tail:
                    self._tail = (len(prompt) - self._num_read, self._decode(prompt))
            else:
                text = self._decode(self._window[: self._num_read])
            self._prefix_text = text
        return self._prefix_text

    def _advance(self) -> None:
        """The read ids become the next prefix; everything is now read."""
        del self._window[: self._num_read]
        self._num_read = len(self._window)
        self._prefix_text = None


class StopStrings:
    """Cuts a request's text stream at the first stop string (OpenAI ``stop``).

    Holds back the longest suffix of the text seen so far that could still
    grow into a stop string; everything before it is safe to emit. A match
    anywhere in held + new text stops the stream: the text before the match
    is returned and the stop string itself is never emitted. When several
    stops match, the earliest in the text wins. ``include_stop`` (vLLM's
    ``include_stop_str_in_output``) emits the matched stop string too.
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]  # "" would match everywhere
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""
        self._unsearched = 0  # leading characters of the held text fed with search=False

    @property
    def is_stopped(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str, search: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched). With
        ``search`` False (the text of the first ``min_tokens`` tokens, as
        vLLM's) no match ends in ``new_text``, but one may begin there and
        end in text fed later."""
        if not self.stops:  # nothing to look for, nothing held
            return new_text, False
        if self.is_stopped:
            return "", True
        text = self._held + new_text
        if search:
            match_at, match = self._find_first_match(text, self._unsearched)
            if match is not None:
                self.matched, self._held = match, ""
                return text[: match_at + (len(match) if self.include_stop else 0)], True
        num_held = self._num_partial_suffix(text)
        num_emitted = len(text) - num_held
        self._unsearched = max(0, (self._unsearched if search else len(text)) - num_emitted)
        self._held = text[num_emitted:]
        return text[:num_emitted], False

    def flush(self) -> str:
        """The held-back text, when the request ends without a match."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _find_first_match(self, text: str, min_end: int = 0) -> tuple[int, str | None]:
        """The earliest stop in ``text`` that ends past its first ``min_end`` characters."""
        best_at, best = len(text), None
        for stop in self.stops:
            at = text.find(stop, max(0, min_end - len(stop) + 1))
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _num_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop: tried only where
        the stop's first character stands (64 stops of 512 characters, a token's text each step)."""
        longest = 0
        for stop in self.stops:
            at = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
            while at != -1 and len(text) - at > longest:
                if stop.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(stop[0], at + 1)
        return longest
