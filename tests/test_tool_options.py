"""The options every tool takes are checked as they are read: one line
naming the option (argparse's usage error, or SystemExit), never a
traceback at the end of a run; a server a tool starts stops with it."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import _common  # noqa: E402


def test_counts_and_lists_of_counts():
    assert _common.positive_ints("1,8,32") == [1, 8, 32] and _common.positive_int("4") == 4
    for bad in ("1,x", "0", "", "1,,2", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            _common.positive_ints(bad)


def test_a_model_that_is_not_there_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"--model '.*': no config.json there; give a Hugging Face model folder"):
        _common.model_dir_of(str(tmp_path / "nothing"))
    (tmp_path / "config.json").write_text("{}")
    assert _common.model_dir_of(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("tool, args, says", [
    ("bench_serve.py", ["--concurrency", "1,x"], "argument --concurrency: expected comma-separated positive integers"),
    ("bench_serve.py", ["--model", "/nonexistent/model"], "--model '/nonexistent/model': no config.json there"),
    ("quant_parity.py", ["--prompts", "0"], "argument --prompts: expected a positive integer"),
    ("bench_structured.py", ["--device", "tpu"], "argument --device: invalid choice"),
])
def test_a_tool_s_bad_option_is_one_line(tool, args, says):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_started_by_a_tool_stops_when_the_tool_dies():
    """A tool killed mid-run left its server (and the server's actors) running."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); import _common; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "preexec_fn=_common.stop_with_parent()); print(child.pid, flush=True); time.sleep(60)"),
        str(ROOT / "tools")], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child_pid}").exists():
        status = Path(f"/proc/{child_pid}/stat").read_text().split()[2] if Path(f"/proc/{child_pid}").exists() else "X"
        if status == "Z":
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child_pid}").exists() or Path(f"/proc/{child_pid}/stat").read_text().split()[2] == "Z"
