"""The one rule for adapter names, for configured and runtime ones alike.

A name travels into URLs (``model`` fields), logs, metrics labels and the
listing, so it is kept to what is safe in all of them: Hub-style
``org/name`` works, path tricks, control and bidirectional characters don't.
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 128
_NAME_CHARS = re.compile(r"[A-Za-z0-9._/-]+")
RULE = (f"an adapter name is 1 to {MAX_NAME_CHARS} characters of A-Z a-z 0-9 . _ / -, "
        "with no empty, '.' or '..' segment between slashes, and differs from the base model's name")


def name_problem(name: str, base_name: str) -> str | None:
    """Why ``name`` can't name an adapter beside the base ``base_name`` (None: it can)."""
    if not 1 <= len(name) <= MAX_NAME_CHARS:
        return f"{_show(name)} has {len(name)} characters; {RULE}"
    if not _NAME_CHARS.fullmatch(name):
        return f"{_show(name)} has a character outside the allowed set; {RULE}"
    if any(segment in ("", ".", "..") for segment in name.split("/")):  # URLs drop or fold them
        return f"{_show(name)} has an empty, '.' or '..' segment; {RULE}"
    if name == base_name:
        return f"{_show(name)} is the base model's name; {RULE}"
    return None


def _show(name: str) -> str:
    """The name quoted on one line, shortened: errors echo it, never its raw bytes."""
    text = ascii(name)
    return text if len(text) <= 60 else text[:57] + "..."
