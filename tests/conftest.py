"""Shared test fixtures. GPU tests skip cleanly without CUDA."""

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors
# (slow, so tests keep them small). Set before any test module imports a
# kernel: ``triton.jit`` reads it when it decorates.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


# The live embedded-model server, shared by every test that needs it (one start per session).
from live_smollm2 import smollm2_server, smollm2_tokenizer  # noqa: E402,F401
