"""The grammar engine's EBNF as text (the form its grammars print in): its
character classes with characters taken out, its literals' characters, its
rules renamed. Pure text: no engine, no I/O.

A class is ``[...]`` or ``[^...]`` of characters and ``a-b`` ranges, with the
engine's escapes (``\\n``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``, ``\\]``...);
a literal is ``"..."`` with the same escapes."""

from __future__ import annotations

import re
from collections.abc import Callable

Ranges = list[tuple[int, int]]  # inclusive code point ranges

_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.DOTALL)
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)
_NAMED = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "b": 8, "a": 7, "e": 27, "0": 0}
_WIDTH = {"x": 2, "u": 4, "U": 8}
_CLASS_ESCAPED = set("\\]-[\"")


class ClassEmptied(ValueError):
    """A class all of whose characters were taken out: its place in the grammar can no longer be written."""


def _chars(body: str) -> list[tuple[int, bool]]:
    """``body``'s characters as (code point, written as an escape)."""
    out, i = [], 0
    while i < len(body):
        if body[i] != "\\" or i + 1 == len(body):
            out.append((ord(body[i]), False))
            i += 1
            continue
        kind = body[i + 1]
        width = _WIDTH.get(kind, 0)
        out.append((int(body[i + 2:i + 2 + width], 16) if width else _NAMED.get(kind, ord(kind)), True))
        i += 2 + width
    return out


def literal_text(piece: str) -> str:
    """The text a literal ``"..."`` writes."""
    return "".join(chr(c) for c, _ in _chars(piece[1:-1]))


def class_ranges(piece: str) -> tuple[bool, Ranges]:
    """(negated, ranges) of a class ``[...]``."""
    body = piece[1:-1]
    negated = body.startswith("^")
    chars = _chars(body[1:] if negated else body)
    ranges, i = [], 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == (ord("-"), False):
            ranges.append((chars[i][0], chars[i + 2][0]))
            i += 3
        else:
            ranges.append((chars[i][0], chars[i][0]))
            i += 1
    return negated, ranges


def _merged(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _minus(ranges: Ranges, taken: Ranges) -> Ranges:
    out = _merged(ranges)
    for t_lo, t_hi in taken:
        out = [piece for lo, hi in out
               for piece in ((lo, min(hi, t_lo - 1)), (max(lo, t_hi + 1), hi)) if piece[0] <= piece[1]]
    return out


def _char(code: int) -> str:
    """``code`` as the engine reads it in a class or a literal (its ``\\x`` takes every hex digit that follows:
    ``\\u`` and ``\\U`` take four and eight)."""
    char = chr(code)
    if char in _CLASS_ESCAPED:
        return "\\" + char
    if 0x20 <= code < 0x7F:
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def class_text(negated: bool, ranges: Ranges) -> str:
    """A class of ``ranges`` (their complement where ``negated``). A "^" is never its first character, however
    written: the engine reads the escapes first, and a class that opens with one as negated."""
    merged = _merged(ranges)
    caret = ord("^")
    if merged and merged[0][0] == caret:
        if merged[0][1] == caret and len(merged) == 1 and not negated:
            return '"^"'
        merged = ([(caret + 1, merged[0][1])] if merged[0][1] > caret else []) + merged[1:] + [(caret, caret)]
    parts = (_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in merged)
    return "[" + ("^" if negated else "") + "".join(parts) + "]"


def classes_meet(text: str, chars: Ranges) -> bool:
    """Whether some class of ``text`` takes one of ``chars``."""
    for piece in _PIECE.findall(text):
        if piece.startswith("[") and len(piece) > 1:
            negated, ranges = class_ranges(piece)
            left = _minus(chars, ranges)  # ``chars`` the class does not list
            if left if negated else left != _merged(chars):
                return True
    return False


def without_chars(text: str, taken: Ranges) -> str:
    """``text`` with the characters ``taken`` out of every class (added to a
    negated one's); ClassEmptied where a class had no others. Literals are
    left as they are (``literals``)."""
    out = []
    for piece in _PIECE.findall(text):
        if piece.startswith("[") and len(piece) > 1:
            negated, ranges = class_ranges(piece)
            if negated:
                piece = class_text(True, ranges + taken)
            elif not (kept := _minus(ranges, taken)):
                raise ClassEmptied(piece)
            else:
                piece = class_text(False, kept)
        out.append(piece)
    return "".join(out)


def normalized(text: str) -> str:
    """``text`` (a grammar as the engine prints it) with every literal and class written as ``literal`` and
    ``class_text`` write them, for the engine to read back: it prints a character up to U+00FF as ``\\xHH``,
    which its parser reads with every hex digit that follows ("\\xe9e", an "é" then an "e", read as U+0E9E)."""
    out = []
    for piece in _PIECE.findall(text):
        if piece.startswith('"') and len(piece) > 1:
            piece = literal(literal_text(piece))
        elif piece.startswith("[") and len(piece) > 1:
            piece = class_text(*class_ranges(piece))
        out.append(piece)
    return "".join(out)


def literals(text: str) -> list[str]:
    """The texts of ``text``'s literals."""
    return [literal_text(p) for p in _PIECE.findall(text) if p.startswith('"') and len(p) > 1]


def map_literals(text: str, change: Callable[[str], str]) -> str:
    """``text`` with each literal's text ``t`` written ``change(t)``."""
    return "".join(literal(change(literal_text(p))) if p.startswith('"') and len(p) > 1 else p
                   for p in _PIECE.findall(text))


def literal(text: str) -> str:
    """``text`` as a literal."""
    return '"' + "".join(_char(ord(c)) if c in '"\\' or not 0x20 <= ord(c) < 0x7F else c for c in text) + '"'


def renamed(text: str, prefix: str) -> str:
    """``text`` with each rule it defines renamed ``prefix`` + its name, where defined and where used."""
    names = set(_RULE.findall(text))
    return "".join(prefix + p if p in names else p for p in _PIECE.findall(text))


def map_calls(text: str, name: str, change: Callable[[list[str]], str]) -> str:
    """``text`` with each call ``NAME(ARG, ...)`` replaced by ``change(args)``, each argument as written
    (a literal, or ``key=value``)."""
    pieces = _PIECE.findall(text)
    out, i = [], 0
    while i < len(pieces):
        if pieces[i] == name and i + 1 < len(pieces) and pieces[i + 1] == "(":
            end = pieces.index(")", i)  # (a literal's parenthesis is inside its one piece)
            out.append(change([a.strip() for a in _arguments(pieces[i + 2:end])]))
            i = end + 1
            continue
        out.append(pieces[i])
        i += 1
    return "".join(out)


def _arguments(pieces: list[str]) -> list[str]:
    """The comma-separated arguments of a call's pieces (a literal's commas are inside its one piece)."""
    args, current = [], []
    for piece in pieces:
        if piece == ",":
            args.append("".join(current))
            current = []
        else:
            current.append(piece)
    return args + ["".join(current)]
