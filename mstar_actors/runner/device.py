"""The device and dtype a rank serves on, from ``model.device`` and ``model.dtype``.

Apart from the runner so that what resolves the serving dtype before any
rank starts (the model's facts, the adapter reader) imports torch alone.
"""

from __future__ import annotations

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={device!r} but no CUDA device is available; accepted here: cpu, auto")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (half precision is slow there); on a GPU the
    checkpoint's half dtype, or bfloat16 for a float32 checkpoint."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"model.dtype={dtype!r}; accepted: auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("bfloat16", "float16") else torch.bfloat16


def use_device(device: torch.device) -> None:
    """Make ``device`` this thread's current CUDA device (each thread has its
    own). A plain ``cuda`` names the current one already; CPU has none."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
