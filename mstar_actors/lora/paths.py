"""Where a runtime adapter load may read: folders inside ``lora.adapter_dirs``.

The frontend resolves a load's ``lora_path`` here (symlinks followed on both
sides) and sends the real path on; the adapter reader then opens only files
inside those folders (``adapter_file.read_adapter``'s ``allowed_dirs``), so a
link planted after the check leads nowhere. The config's paths have ``~``
expanded at parse.
"""

from __future__ import annotations

import os
from pathlib import Path


class AdapterPathError(ValueError):
    """A runtime load path outside ``lora.adapter_dirs``; the message names both."""


def resolve_runtime_path(path: str, adapter_dirs: list[str]) -> str:
    """The real path of a runtime load, if it lies inside an allowed folder
    (symlinks resolved on both sides; ``~`` in ``path`` expanded, as the config's are). Raises
    AdapterPathError otherwise."""
    if not adapter_dirs:
        raise AdapterPathError(
            f"lora_path {path!r}: runtime loads may read only folders inside lora.adapter_dirs, "
            f"and the config lists none; add the folder to lora.adapter_dirs"
        )
    written_path, path = path, os.path.expanduser(path)
    real = Path(path).resolve()
    allowed = [Path(d).resolve() for d in adapter_dirs]
    if any(real == d or d in real.parents for d in allowed):
        return str(real)
    written = Path(os.path.abspath(path))
    as_written = [Path(os.path.abspath(d)) for d in adapter_dirs]
    # the folders as configured: where the path resolved stays unsaid
    inside_as_written = any(written == d or d in written.parents for d in allowed + as_written)
    where = ("leads outside the allowed adapter folders through a link" if inside_as_written
             else "is outside the allowed adapter folders")
    raise AdapterPathError(
        f"lora_path {written_path!r} {where}: {', '.join(adapter_dirs)}; copy the adapter there or extend "
        "lora.adapter_dirs"
    )
