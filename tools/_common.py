"""What the serving benchmarks share: a served engine started from a config
dict, free ports, progress lines, the ``--output`` file, and the checks of
the options every tool takes (``--model``, ``--device``, counts and lists of
them), each a one-line error naming the option."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from mstar_actors import cli_types

# the flags' bounded numbers (one reader with the server's commands)
positive_int, non_negative_int = cli_types.positive_int, cli_types.non_negative_int
positive_float, non_negative_float = cli_types.positive_float, cli_types.non_negative_float

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600
READY_POLL_S = 0.2  # the server is another process: polling /health is the only way to see it ready


def progress(text: str, end: str = "\n") -> None:
    """A line on stderr, so stdout keeps only the tables."""
    print(f"# {text}" if text else "", end=end, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]



def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated counts of at least 1 (``1,8,32``)."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None


def run_tool(main: Callable[[], int | None]) -> None:
    """A tool's entry point: ``main``'s exit status; Ctrl-C one line, no traceback (the servers a tool
    starts are in a session of their own, so the key reaches the tool alone, which stops them)."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("interrupted: the tables printed so far stand; nothing more was measured", file=sys.stderr)
        status = 130
    raise SystemExit(status)


def quiet_child(target: Callable, *args):
    """A spawned helper process's target: ``target(*args)`` with Ctrl-C left to the tool that spawned it
    (which stops it), so the key prints no traceback of every process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return target(*args)


def check_url(url: str) -> str:
    """``--url``: the /v1 URL of a server that answers, checked before anything is measured (SystemExit of
    one line otherwise)."""
    url = url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            return url  # a server with a key: the tool's own requests say so
        raise SystemExit(f"--url {url}: GET {url}/models answered {err.code}; give a running server's /v1 URL")
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise SystemExit(f"--url {url}: no server answers there ({reason}); start one with `python -m "
                         "mstar_actors serve CONFIG`, or leave --url out to have the tool start its own") from None
    return url


def model_dir_of(arg: str | None) -> Path:
    """The folder ``--model`` names: a Hugging Face folder, or an embedded
    name (fetched once; none: SmolLM2). SystemExit of one line otherwise."""
    from mstar_actors.fetch import EMBEDDED, FetchError, fetch_embedded

    if arg and Path(arg).expanduser().is_dir():
        if not (Path(arg).expanduser() / "config.json").is_file():
            raise SystemExit(f"--model {arg!r}: no config.json there; give a Hugging Face model folder or an "
                             f"embedded name ({', '.join(sorted(EMBEDDED))})")
        return Path(arg).expanduser()
    if not arg or arg in EMBEDDED:
        try:
            return Path(fetch_embedded(arg or "smollm2"))
        except FetchError as err:
            raise SystemExit(f"--model: {err}") from None
    folder = Path(arg).expanduser()
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--model {arg!r}: no config.json there; give a Hugging Face model folder or an embedded "
                         f"name ({', '.join(sorted(EMBEDDED))})")
    return folder


def check_device(device: str) -> None:
    """``--device cuda`` on a host without one: SystemExit of one line."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here; run it on a GPU host, or use --device cpu")


def write_output(text: str, path: Path | str | None, *, append: bool = False) -> None:
    """The tables into ``--output`` too (nothing without one)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as f:
        f.write(text + "\n")


# libc's prctl, found here: the child between fork and exec may only call it
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def stop_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the server gets SIGTERM (its graceful stop) when the
    tool that started it dies, however it dies (Linux's PR_SET_PDEATHSIG;
    elsewhere the tool's own exit stops it). A tool that died before the
    call: the server stops at once."""
    parent = os.getpid()

    def in_child() -> None:
        if _PRCTL is not None:
            _PRCTL(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
    return in_child


class Server:
    """``python -m mstar_actors serve`` on a config dict (written to ``tmp``),
    ready once ``GET /health`` answers 200. Its stderr is kept in ``log``
    (saved by ``--server-logs``, never parsed)."""

    def __init__(self, config: dict, tmp: Path, log_level: str = "INFO", env: dict | None = None):
        self.port = config["server"]["port"]
        self.name = config["model"]["name"]
        path = tmp / f"bench-{self.port}.yaml"
        path.write_text(json.dumps(config))
        self.log: list[str] = []
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar_actors", "serve", str(path), "--log-level", log_level], cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=pythonpath, **(env or {})), stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL, text=True, preexec_fn=stop_with_parent(), start_new_session=True)
        threading.Thread(target=self.log.extend, args=(self.proc.stderr,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait(self) -> str:
        """The server's /v1 URL once it is ready (SystemExit with its log's tail if it exits first)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{''.join(self.log[-30:])}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self.url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(READY_POLL_S)
        raise SystemExit(f"the server was not ready within {READY_TIMEOUT_S} s:\n{''.join(self.log[-30:])}")

    def cpu_s(self) -> float:
        """CPU time so far of the launcher and every actor process."""
        return sum(self.process_cpu_s().values())

    def process_cpu_s(self) -> dict[str, float]:
        """CPU time so far (user + system) of the launcher and of each actor
        process, by actor name (the run directory's actors.json; a process it
        does not name, by pid)."""
        import psutil

        from mstar_actors.rundir import ACTORS_FILE, runs_root

        names = {}
        for path in runs_root().glob(f"*p{self.proc.pid}/{ACTORS_FILE}"):  # the run id ends with the launcher's pid
            names = {pid: name for name, pid in json.loads(path.read_text())["actors"].items()}
        names[self.proc.pid] = "launcher"
        root = psutil.Process(self.proc.pid)
        return {names.get(p.pid, f"pid {p.pid}"): sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
