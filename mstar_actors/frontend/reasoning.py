"""A reply's reasoning apart from its answer, as vLLM's ``--reasoning-parser`` gives it (``model.reasoning_parser``).

Qwen3, Qwen3.5 and DeepSeek-R1-style models think first, inside
``<think> ... </think>``, then answer. With a parser set, a chat reply's
thinking leaves in the message's ``reasoning`` field (streamed as
``delta.reasoning``), the answer in ``content``, and tool calls are read from
the answer only. Pure: no I/O, no tokenizer; text in, text out.

- ``qwen3``: reasoning is what a ``<think>`` opens, up to ``</think>``; a
  reply that opens none is all answer (``enable_thinking: false``), unless the
  prompt already opened it (templates that end the generation prompt with
  ``<think>``: ``opened``).
- ``deepseek_r1``: the reply starts inside the reasoning (the template opened
  it); a ``<think>`` it writes anyway is dropped; all reasoning until
  ``</think>``.

With ``call_opening`` (``<tool_call>\n<function=``, for a ``qwen3`` reply
that may call tools in Qwen3.5's format), a call opened inside the reasoning
ends it and is the answer's, as vLLM's ``qwen3`` parser reads Qwen3.5's
replies that call without closing their thinking first (a ``<tool_call>``
not followed by a function is the reasoning's text).

A reply cut before ``</think>`` (``max_tokens``) is reasoning to its end, with
no content, as vLLM's ``deepseek_r1`` leaves it (its ``qwen3`` gives such a
reply as content, ``<think>`` and all; here what a reply opened as reasoning
stays reasoning).
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_reasoning(prompt_text: str) -> str | None:
    """Where the end of a prompt's text (a generation prompt, a message the reply continues) leaves the
    reply: "open" inside a ``<think>`` block (the template opened it), "closed" past one (a template's
    ``<think></think>`` with ``enable_thinking: false``: the reply is all answer, as vLLM reads it),
    None where it names neither (the reply may open one)."""
    opened, closed = prompt_text.rfind(THINK_OPEN), prompt_text.rfind(THINK_CLOSE)
    if opened > closed:
        return "open"
    return "closed" if closed >= 0 else None


# a template's thinking when it is off (Qwen3's, Qwen3.5's ``enable_thinking: false``)
EMPTY_THINKING = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


def reasoning_end(prompt_text: str) -> str:
    """What closes a prompt's reasoning before a reply that gives none (a forced tool call) as a template
    closes it with thinking off (``EMPTY_THINKING``): the rest of that form after the ``<think>`` (and its
    whitespace) the prompt opened, ``</think>`` after thoughts of its own, all of it where the prompt opened
    none; nothing where it closed its own."""
    state = prompt_reasoning(prompt_text)
    if state is None:
        return EMPTY_THINKING
    if state == "closed":
        return ""
    tail = prompt_text[prompt_text.rfind(THINK_OPEN):]
    return EMPTY_THINKING[len(tail):] if EMPTY_THINKING.startswith(tail) else f"{THINK_CLOSE}\n\n"


class ReasoningStream:
    """One reply's text, fed as it streams, split into ``(reasoning, content)`` pieces.

    Text that may still be the start of a tag is held back until the next
    piece shows what it is (``flush`` gives it at the end)."""

    def __init__(self, parser: str, opened: bool = False, call_opening: str | None = None):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r}; accepted: {', '.join(PARSERS)}")
        self.parser = parser
        self._ends = (THINK_CLOSE, call_opening) if call_opening else (THINK_CLOSE,)
        self.state = "thinking" if opened or parser == "deepseek_r1" else "start"
        self.has_reasoning = self.state == "thinking"  # the reply had a reasoning part (perhaps empty)
        self._may_open = True  # a leading <think> is dropped (deepseek_r1: written anyway)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            if self.state == "answer":
                content.append(text)
                break
            if self._may_open:
                stripped = text.lstrip()
                if len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped):  # may still be a <think>
                    self._held = text
                    break
                self._may_open = False
                if stripped.startswith(THINK_OPEN):
                    text, self.state, self.has_reasoning = stripped[len(THINK_OPEN):], "thinking", True
                    continue
                if self.state == "start":  # qwen3, nothing opened: an answer with no reasoning
                    self.state = "answer"
                    continue
            end, tag = min(((at, tag) for tag in self._ends if (at := text.find(tag)) >= 0), default=(-1, ""))
            if end >= 0:  # (a call's opening is the answer's)
                reasoning.append(text[:end])
                text, self.state = text[end + len(tag) if tag == THINK_CLOSE else end:], "answer"
                continue
            keep = max(_partial_tail(text, tag) for tag in self._ends)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What was held back, at the reply's end: a tag's start that never finished is text."""
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self.state == "thinking":
            return held, ""
        return "", held  # qwen3's start: an answer that looked like an opening <think>


def split_reasoning(parser: str, text: str, opened: bool = False,
                    call_opening: str | None = None) -> tuple[str | None, str]:
    """A whole reply's ``(reasoning, content)``; reasoning None where the reply has no reasoning part."""
    stream = ReasoningStream(parser, opened, call_opening)
    pieces = stream.feed(text), stream.flush()
    reasoning, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
    return (reasoning if stream.has_reasoning else None), content


def _partial_tail(text: str, tag: str) -> int:
    """The length of ``text``'s longest end that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


__all__ = ["PARSERS", "THINK_CLOSE", "THINK_OPEN", "ReasoningStream", "prompt_reasoning", "split_reasoning"]
