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

The format's pieces: its tags, how a value is typed and how history calls
are written. ``tool_calls.XmlCallStream`` reads a reply with them.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

BLOCK_OPEN, BLOCK_CLOSE = "<tool_call>", "</tool_call>"  # (hermes' tags too)
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
CALL_OPENING = f"{BLOCK_OPEN}\n{FUNCTION_OPEN}"  # a call as the format opens it (ends a qwen3 reasoning)
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# what ends a parameter's value: its closing tag, or (as vLLM reads a tag left out) the next parameter, the call's
# end or its block's (a forced reply's grammar writes every closing tag: its values end at theirs alone)
VALUE_END = re.compile("|".join(re.escape(t) for t in (PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE, BLOCK_CLOSE)))
FORCED_VALUE_END = re.compile(re.escape(PARAM_CLOSE))
_INTEGER = re.compile(r"[+-]?[0-9]+")
MAX_INTEGER_DIGITS = 4300  # int()'s limit on a string's digits
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


MAX_REF_DEPTH = 16  # references followed in a row (a definition that names itself ends there)


def resolved(schema: Any, root: Any) -> Any:
    """``schema`` with its ``$ref`` into ``root``'s ``$defs`` / ``definitions`` followed, and its
    ``anyOf`` / ``oneOf`` branches' (a parameter typed by a definition: pydantic's nested models and
    optionals), one level: a reference that leads nowhere is left as it is."""
    schema = _followed(schema, root)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema, dict) and isinstance(schema.get(key), list):
            schema = schema | {key: [_followed(b, root) for b in schema[key]]}
    return schema


def _followed(schema: Any, root: Any) -> Any:
    """``schema``'s chain of references, at most ``MAX_REF_DEPTH`` links (a definition naming itself ends there)."""
    for _ in range(MAX_REF_DEPTH):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not isinstance(root, dict):
            return schema
        section, _, name = ref.removeprefix("#/").partition("/")
        defs = root.get(section) if section in ("$defs", "definitions") else None
        target = defs.get(name) if isinstance(defs, dict) else None
        if not isinstance(target, dict):
            return schema
        schema = target | {k: v for k, v in schema.items() if k != "$ref"}
    return schema


def choices(schema: dict) -> list | None:
    """The values an ``enum`` or ``const`` lists (None: neither)."""
    return schema.get("enum", [schema["const"]] if "const" in schema else None)


def value_type(schema: Any) -> str | None:
    """The type a parameter's schema (``resolved``) gives its values: its ``type`` (a list's first besides
    null), the one type of all its ``anyOf`` / ``oneOf`` branches besides null, "enum" for string choices
    (null among them or not); None for any other (read as text, as vLLM reads a schema with no type)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "string" if "string" in kind else next((k for k in kind if k != "null"), None)
    texts = choices(schema)
    if isinstance(texts, list) and any(t is not None for t in texts) and all(
            t is None or isinstance(t, str) for t in texts):
        return "enum"
    branches = schema.get("anyOf") or schema.get("oneOf")
    if kind is None and isinstance(branches, list):
        kinds = {value_type(b) for b in branches if not (isinstance(b, dict) and b.get("type") == "null")}
        if len(kinds) > 1 and kinds <= {"string", "enum"}:  # texts all (a format's or a choice's): read as text
            kinds = {"string"}
        kind = kinds.pop() if len(kinds) == 1 else None
    return kind if isinstance(kind, str) else None


def nullable(schema: Any) -> bool:
    """Whether ``null`` written as a value is None: a key the schema does not name, a schema with no type
    (vLLM's), or one that lets null through (its type, a choice, or a branch's); else it is the value's own
    text."""
    if not isinstance(schema, dict):
        return True
    texts = choices(schema)
    if isinstance(texts, list):  # the values it lists, whatever its type allows
        return None in texts
    kind = schema.get("type")
    if kind is not None:
        return kind == "null" or (isinstance(kind, list) and "null" in kind)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        return any(nullable(b) for b in branches if isinstance(b, dict) and ("type" in b or choices(b)))
    return True


def read_value(raw: str, schema: Any) -> Any:
    """A parameter's written text as the value its schema's type reads (vLLM's conversion): the
    newline the format writes on either side is not the value's; ``null`` is None but for a string
    that takes no null (``nullable``); a string type, or none, keeps the text; integers, numbers (a whole one an
    integer) and booleans are read as written, objects and arrays as JSON; text that does not read as
    its type stays a string."""
    text = raw.removeprefix("\n").removesuffix("\n")
    word = text.strip()
    kind = value_type(schema)
    if word.lower() == "null" and (nullable(schema) or kind not in _STRING_TYPES):  # (a string's own text)
        return None
    if kind is None or kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short")):
        return int(word) if _INTEGER.fullmatch(word) and len(word) <= MAX_INTEGER_DIGITS else text
    if kind.startswith(("num", "float", "double")):
        try:
            number = _finite(word)
        except ValueError:
            return text
        return int(number) if number.is_integer() and kind.startswith("num") else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(word.lower(), text)
    try:
        return json.loads(word, parse_float=_finite, parse_constant=_no_constant)
    except ValueError:
        return text


def _finite(text: str) -> float:
    """A number's text as a float; ValueError where it is none a JSON reply can hold (past float's range, NaN)."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text[:20]} is past a float's range")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def written_calls(calls: list[tuple[str, Any]]) -> str:
    """``calls`` (name, arguments: an object or its JSON) as the format writes them (history)."""
    blocks = []
    for name, arguments in calls:
        values = json.loads(arguments) if isinstance(arguments, str) else arguments
        params = "".join(f"{PARAM_OPEN}{key}>\n{_written_value(value)}\n{PARAM_CLOSE}\n"
                         for key, value in (values.items() if isinstance(values, dict) else ()))
        blocks.append(f"{BLOCK_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{BLOCK_CLOSE}")
    return "\n".join(blocks)


def written_example() -> str:
    """The format's call, its parts described (a template that writes no tools learns it from this)."""
    return (f"{BLOCK_OPEN}\n{FUNCTION_OPEN}<the tool's name>>\n{PARAM_OPEN}<a parameter's name>>\n<its value>\n"
            f"{PARAM_CLOSE}\n{FUNCTION_CLOSE}\n{BLOCK_CLOSE}")


def _written_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
