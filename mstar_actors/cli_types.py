"""argparse ``type``s of bounded numbers, one reader for the server's commands and the tools' flags: a value
out of bounds is the flag's one-line error, never a traceback or a wait for nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def counted(convert: Callable[[str], float], low: float, strict: bool, what: str) -> Callable[[str], Any]:
    """An argparse ``type`` of a finite number above ``low`` (``strict``) or at least it."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = float("nan")  # refused below
        if not ((value > low) if strict else (value >= low)) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what.split(" ", 1)[1].replace(" ", "_").replace("-", "_")
    return parse


positive_int = counted(int, 0, True, "a positive integer")  # a count of at least 1
non_negative_int = counted(int, 0, False, "a non-negative integer")  # 0 meaning none, or a default the option names
positive_float = counted(float, 0.0, True, "a positive number")  # a length of time, a rate
non_negative_float = counted(float, 0.0, False, "a non-negative number")
