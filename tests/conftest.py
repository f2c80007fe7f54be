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
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import kernel_launches

        kernel_launches.install()  # for test_kernels_compile, run last
    except ImportError:  # pragma: no cover - no Triton: its kernels' tests skip
        pass

# Run last: it compiles the kernel launches the other tests recorded.
COMPILE_LAST = "test_kernels_compile.py"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    items.sort(key=lambda item: item.path.name == COMPILE_LAST)  # stable: the others keep their order


# The live embedded-model server, shared by every test that needs it (one start per session).
from live_smollm2 import smollm2_server, smollm2_tokenizer  # noqa: E402,F401
# The live tiny-Llama server of the openai-client, structured-output and tool-call tests (one start per session).
from live_tiny import tiny_chat_server  # noqa: E402,F401


@pytest.fixture
def race_on_cpu(monkeypatch):
    """``sample_tokens`` on CPU tensors through the CUDA draw's kernel, in
    Triton's interpreter (the ``gpu`` tests run it compiled)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on CPU tensors only in Triton's interpreter")
    from mstar_actors.runner import sampling

    monkeypatch.setattr(sampling, "_races", lambda logits: True)
