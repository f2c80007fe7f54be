"""One live server of the embedded SmolLM2 for the whole test session.

``python -m mstar_actors serve configs/smollm2.yaml`` (every actor in its own
process) on a free port, with an ``api_key`` so 401s can be tested on the
same server. Starting costs ~15 s on two cores, so the end-to-end test and
the openai-client tests share it through the session-scoped
``smollm2_server`` fixture (registered in ``tests/conftest.py``).

The first ``fetch_embedded`` on a fresh machine downloads ~90 MB and
converts it (~30 s); later sessions reuse the cached folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
START_TIMEOUT_S = 300
MODEL_NAME = "smollm2"


@dataclasses.dataclass
class LiveServer:
    base_url: str  # ".../v1", as the openai client wants it
    api_key: str
    model: str
    model_dir: Path
    log: list[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain(proc: subprocess.Popen, log: list[str], serving: threading.Event) -> None:
    """Read the server's log to the end: a full pipe would block its actors."""
    for line in proc.stderr:
        log.append(line)
        if f"serving {MODEL_NAME} at http://" in line:
            serving.set()
    serving.set()  # exited: wake the waiter, which then sees the return code


def start_server(tmp: Path):
    """Start the server; a generator that yields ``LiveServer`` and stops it after."""
    from mstar_actors.fetch import fetch_embedded

    model_dir = Path(fetch_embedded(MODEL_NAME))
    port = _free_port()
    config = tmp / "smollm2-test.yaml"
    data = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())
    data.setdefault("server", {})["api_key"] = API_KEY
    config.write_text(json.dumps(data))  # JSON is YAML
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mstar_actors", "serve", str(config), "--port", str(port)],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    serving = threading.Event()
    threading.Thread(target=_drain, args=(proc, log, serving), daemon=True).start()
    if not serving.wait(START_TIMEOUT_S) or proc.poll() is not None:
        proc.kill()
        proc.wait()
        pytest.fail(f"the SmolLM2 server did not start (exit {proc.returncode}):\n{''.join(log[-40:])}")
    try:
        yield LiveServer(f"http://127.0.0.1:{port}/v1", API_KEY, MODEL_NAME, model_dir, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    yield from start_server(tmp_path_factory.mktemp("smollm2-server"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_server.model_dir), local_files_only=True)
