"""The ``qwen3_coder`` tool-call format (Qwen3.5, Qwen3-Coder): a call is

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

each value written bare (a string as its text, a number, ``true``, an object
as JSON) and read back by the type the tool's ``parameters`` schema gives
its key, as vLLM's ``qwen3_coder`` parser reads it. Pure: no I/O.

``XmlCallStream`` reads a reply as it streams, in the deltas
``tool_calls.HermesCallStream`` sends (text outside blocks as content, held
where it may open one; whitespace between calls dropped): a call's id and
name once ``<function=NAME>`` is written, then its arguments' JSON a
parameter at a time, closed at ``</function>``. A whole reply is read
through it (``tool_calls.read_calls``), so both read the same calls. A
forced reply (``tool_choice`` required or named) starts inside a block, its
markup never content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mstar_actors.frontend import tool_calls as tc

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# what ends a parameter's value: its closing tag, or (as vLLM reads a tag left out) the next one or the call's end
_VALUE_END = re.compile(re.escape(PARAM_CLOSE) + "|" + re.escape(PARAM_OPEN) + "|" + re.escape(FUNCTION_CLOSE))
_INTEGER = re.compile(r"[+-]?[0-9]+")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def value_type(schema: Any) -> str | None:
    """The type a parameter's schema gives its values (the first besides null of a list), or None."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "string" if "string" in kind else next((k for k in kind if k != "null"), None)
    texts = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if texts is not None and all(isinstance(t, str) for t in texts):
        return "enum"
    return kind if isinstance(kind, str) else None


def read_value(raw: str, schema: Any) -> Any:
    """A parameter's written text as the value its schema's type reads (vLLM's conversion): the
    newline the format writes on either side is not the value's; ``null`` is None; a string type keeps
    the text; integers, numbers and booleans are read as written, any other schema's value as JSON; text
    that does not read as its type, or a key the schema does not name (``schema`` None), stays a string."""
    text = raw.removeprefix("\n").removesuffix("\n")
    word = text.strip()
    if word.lower() == "null":
        return None
    kind = value_type(schema)
    if schema is None or kind in _STRING_TYPES:
        return text
    if kind is None:
        kind = "json"
    if kind.startswith(("int", "uint", "long", "short")):
        return int(word) if _INTEGER.fullmatch(word) else text
    if kind.startswith(("num", "float", "double")):
        if _INTEGER.fullmatch(word) and kind.startswith("num"):
            return int(word)
        try:
            number = float(word)
        except ValueError:
            return text
        return number if number == number and abs(number) != float("inf") else text
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(word.lower(), text)
    try:
        return json.loads(word)
    except ValueError:
        return text


def written_calls(calls: list[tuple[str, Any]]) -> str:
    """``calls`` (name, arguments: an object or its JSON) as the format writes them (history)."""
    blocks = []
    for name, arguments in calls:
        values = json.loads(arguments) if isinstance(arguments, str) else arguments
        params = "".join(f"{PARAM_OPEN}{key}>\n{_written_value(value)}\n{PARAM_CLOSE}\n"
                         for key, value in (values.items() if isinstance(values, dict) else ()))
        blocks.append(f"{tc.HERMES_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{tc.HERMES_CLOSE}")
    return "\n".join(blocks)


def written_example() -> str:
    """The format's call, its parts described (a template that writes no tools learns it from this)."""
    return (f"{tc.HERMES_OPEN}\n{FUNCTION_OPEN}<the tool's name>>\n{PARAM_OPEN}<a parameter's name>>\n<its value>\n"
            f"{PARAM_CLOSE}\n{FUNCTION_CLOSE}\n{tc.HERMES_CLOSE}")


def _written_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class XmlCallStream(tc.HermesCallStream):
    """A ``qwen3_coder`` reply, streamed (see the module). States past
    ``HermesCallStream``'s: "block" waits for ``<function=NAME>`` (a block
    that opens otherwise is read whole at its end: content with its markup),
    "params" reads the call's parameters to ``</function>``, then "tag" as
    hermes reads to ``</tool_call>``. ``forced``: the reply starts inside a
    block (its prompt ended with the opening) and no text is content."""

    def __init__(self, request: tc.ToolRequest, forced: bool = False):
        super().__init__(request.max_calls)
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in request.tools}
        self._forced = forced
        self._function = request.function  # a named tool_choice's: its call whatever was written
        self._name = ""  # the call being read
        self._num_params = 0  # its parameters read
        if forced:
            self._state = "block"

    def flush(self) -> list[dict]:
        if self._state == "params":  # cut: the parameters as far as they went, a value cut as far as written
            self._final = True
            deltas = self.feed("")
            held = self._held.lstrip()
            if held.startswith(PARAM_OPEN) and ">" in held:
                name, _, value = held[len(PARAM_OPEN):].partition(">")
                deltas += self._parameter(name, value[: len(value) - tc._partial_suffix(value, PARAM_CLOSE)])
            self._held, self._state = "", "out"
            deltas += self._arguments(self._close())
            return tc._joined(deltas)
        if self._forced and self.num_calls == 0 and self._function is not None:  # nothing read: the named call
            self._held, self.num_calls = "", 1
            return [{"tool_calls": [tc._head_delta(0, self._function)]}, {"tool_calls": [self._piece("{}")]}]
        return super().flush()

    def _step(self, deltas: list[dict]) -> bool:
        if self._state == "block":
            return self._block(deltas)
        if self._state == "params":
            return self._params(deltas)
        return super()._step(deltas)

    def _block(self, deltas: list[dict]) -> bool:
        """A block's start: ``<function=NAME>`` is a call; any other opening, the block read whole."""
        body = self._held.lstrip()
        if body.startswith(FUNCTION_OPEN) and ">" in body:
            name, _, self._held = body[len(FUNCTION_OPEN):].partition(">")
            self.num_calls += 1
            self._said = False
            self._shown = self.max_calls is None or self.num_calls <= self.max_calls
            self._name, self._num_params, self._state = name.strip(), 0, "params"
            if self._shown:
                deltas.append({"tool_calls": [tc._head_delta(self.num_calls - 1, self._name)]})
            return True
        if FUNCTION_OPEN.startswith(body[: len(FUNCTION_OPEN)]) and not self._final:
            return False  # its opening still being written
        if self._forced:  # (the grammar writes the opening: only a cut reply gets here)
            self._held = ""
            return False
        return super()._step(deltas)  # hermes' "block": its end, then read whole (no call: content)

    def _params(self, deltas: list[dict]) -> bool:
        body = self._held.lstrip()
        if body.startswith(FUNCTION_CLOSE):
            self._held, self._state = body[len(FUNCTION_CLOSE):], "tag"
            deltas += self._arguments(self._close())
            return True
        if body.startswith(PARAM_OPEN) and ">" in body:
            name, _, rest = body[len(PARAM_OPEN):].partition(">")
            end = _VALUE_END.search(rest)
            if end is None:
                return False  # its value still being written
            value_end = end.end() if end.group() == PARAM_CLOSE else end.start()
            self._held = rest[value_end:]
            deltas += self._parameter(name, rest[: end.start()])
            return True
        if any(tag.startswith(body[: len(tag)]) for tag in (FUNCTION_CLOSE, PARAM_OPEN)) and not self._final:
            return False  # a tag still being written
        at = body.find("<", 1)  # text between parameters is none of the call's
        if at < 0:
            self._held = ""
            return False
        self._held = body[at:]
        return True

    def _parameter(self, name: str, raw: str) -> list[dict]:
        schema = self._schemas.get(self._name, {})
        properties = schema.get("properties") if isinstance(schema, dict) else None
        value = read_value(raw, (properties or {}).get(name.strip()))  # (None: a key the schema does not name)
        self._num_params += 1
        piece = ("{" if self._num_params == 1 else ", ") + json.dumps(name.strip(), ensure_ascii=False) + ": "
        return self._arguments(piece + json.dumps(value, ensure_ascii=False))

    def _close(self) -> str:
        return "}" if self._num_params else "{}"

    def _arguments(self, piece: str) -> list[dict]:
        return [{"tool_calls": [self._piece(piece)]}] if self._shown else []

    def _piece(self, text: str) -> dict:
        return {"index": self.num_calls - 1, "function": {"arguments": text}}

    def _content(self, text: str, deltas: list[dict]) -> None:
        if not self._forced:
            super()._content(text, deltas)
