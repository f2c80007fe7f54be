"""A live ``python -m mstar_actors serve`` of a tiny random Llama, for the
tests that talk to a real server with the ``openai`` client.

``save_tiny_llama`` writes the model beside a tokenizer; ``serve_tiny``
starts the server on a free port with a config built from the caller's
sections, waits for the launcher's "serving" line (reading the child's
stderr, no polling), yields ``(base_url, process)``, and stops it.

``tiny_chat_server`` is one such server for the whole session (registered in
``tests/conftest.py``), shared by the live tests that only send it requests:
the ``openai`` client's, structured outputs' and tool calls'. A start costs
about 8 s and a stop 2 s on two cores.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

MODEL_NAME = "tiny"
CHAT_API_KEY = "tiny-key"
CHAT_MAX_MODEL_LEN = 1024  # a tool-call prompt with its tools, and its reply


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_llama(folder: Path, tokenizer, max_position_embeddings: int = 256) -> None:
    """A 2-layer random Llama over ``tokenizer``'s vocabulary, and the tokenizer, in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def serve_tiny(folder: Path, max_model_len: int = 256, num_blocks: int = 64, stop_timeout_s: float = 30,
               sections: dict | None = None, **server) -> Iterator[tuple[str, subprocess.Popen]]:
    """The server of the model in ``folder``; ``server`` adds keys to the config's server section,
    ``sections`` whole sections (``{"lora": {...}}``)."""
    port = free_port()
    config = folder / "serve.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model": {"path": str(folder), "name": MODEL_NAME, "dtype": "float32", "device": "cpu"},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": max_model_len, "max_model_len": max_model_len},
        "kv": {"block_size": 16, "num_blocks": num_blocks},
        "server": {"host": "127.0.0.1", "port": port} | server,
    } | (sections or {})))
    proc = subprocess.Popen([sys.executable, "-m", "mstar_actors", "serve", str(config)],
                            stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if f"serving {MODEL_NAME} at" in line:
            break
    else:
        proc.wait()
        pytest.fail(f"the server exited ({proc.returncode}) before serving:\n{''.join(log[-40:])}")
    try:
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=stop_timeout_s)
        proc.stderr.close()


@pytest.fixture(scope="session")
def tiny_chat_server(tmp_path_factory):
    """``(base_url, api_key)`` of a server of the tiny Llama over the frontend
    kit's byte-level BPE (every byte a token: any JSON can be written), with a
    hermes-format chat template (a chat without tools and without a system
    message renders as ChatML, the kit's template) and an API key. The tests
    that use it change nothing on it."""
    from transformers import AutoTokenizer

    from tests.tool_calls.templates import HERMES_TEMPLATE, make_tool_model_dir

    folder = make_tool_model_dir(tmp_path_factory.mktemp("tiny-chat-model"), HERMES_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    save_tiny_llama(folder, tokenizer, max_position_embeddings=CHAT_MAX_MODEL_LEN)
    with serve_tiny(folder, max_model_len=CHAT_MAX_MODEL_LEN, num_blocks=256, api_key=CHAT_API_KEY) as (base_url, proc):
        # Read its log to the end: over a session a full pipe would block its actors.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield base_url, CHAT_API_KEY
