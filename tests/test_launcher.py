"""The launcher, live: `python -m mstar_actors serve` of a tiny model folder.

One server is shared by the tests that only look at it; the tests that
kill something start their own. Each start spawns four processes that
import torch, so these are the slowest tests of the actor runtime.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from mstar_actors.launcher import STOP_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180


def _load_kit():
    spec = importlib.util.spec_from_file_location("actors_test_kit", ROOT / "tests" / "actors" / "conftest.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    return kit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    _load_kit().make_model_dir(folder)
    return folder


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory) -> Path:
    """A private XDG_RUNTIME_DIR: runs of these tests never meet a user's server."""
    return tmp_path_factory.mktemp("runtime")


def _hup_default() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Server:
    """One `serve` subprocess; ``lines`` collects its log (stderr)."""

    def __init__(self, model_dir: Path, runtime_dir: Path, tmp: Path, extra_config: str = "", session: bool = False,
                 port: int | None = None):
        self.port = free_port() if port is None else port
        self.config = tmp / f"serve-{self.port}.yaml"
        self.config.write_text(
            f"model: {{path: {model_dir}, name: tiny, dtype: float32, device: cpu}}\n"
            "kv: {block_size: 4, num_blocks: 64}\n"
            "scheduler: {max_model_len: 128}\n" + extra_config
        )
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
        self.runtime_dir = runtime_dir
        self.lines: list[str] = []
        self.serving = threading.Event()
        self.first_ready = threading.Event()  # an actor said "ready" (others may still be loading)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar_actors", "serve", str(self.config), "--port", str(self.port)],
            cwd=ROOT, env=self.env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            start_new_session=session,  # a process group of its own, as a service manager starts it
            restore_signals=True, preexec_fn=_hup_default,  # from a terminal, whatever ignores it in this run
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.rstrip().endswith(": ready"):
                self.first_ready.set()
            if "serving tiny at http://" in line:
                self.serving.set()
        self.serving.set()  # ended: wake a waiter, which then sees the exit
        self.first_ready.set()

    def wait_serving(self):
        assert self.serving.wait(START_TIMEOUT_S), "no 'serving' line:\n" + self.log
        assert self.proc.poll() is None, "the server exited while starting:\n" + self.log

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def run_dir(self) -> Path:
        (run_dir,) = [p for p in (self.runtime_dir / "mstar-actors" / "runs").iterdir()
                      if json.loads((p / "actors.json").read_text())["launcher_pid"] == self.proc.pid]
        return run_dir

    def actors(self) -> dict[str, int]:
        return json.loads((self.run_dir / "actors.json").read_text())["actors"]

    def wait_exit(self, timeout=60) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    @contextlib.contextmanager
    def running(self):
        """The server ready inside the block, killed when the block ends, however it ends."""
        try:
            self.wait_serving()
            yield self
        finally:
            self.kill()


def our_segments(run_id: str | None = None) -> list[str]:
    prefix = f"mstar-{run_id}-" if run_id else "mstar-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
        return resp.status, json.loads(text) if text.strip().startswith("{") else {"text": text}


@pytest.fixture(scope="module")
def server(model_dir, runtime_dir, tmp_path_factory):
    print("seed: 0 (model.seed default; the tiny model is seeded with 0)")
    with Server(model_dir, runtime_dir, tmp_path_factory.mktemp("cfg")).running() as srv:
        yield srv


def test_health_and_a_completion(server):
    assert http(server.port, "/health")[0] == 200
    status, body = http(server.port, "/v1/completions",
                        {"model": "tiny", "prompt": "hello world w3", "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_run_dir_lists_every_actor(server):
    from actors.base import process_name

    actors = server.actors()
    assert sorted(actors) == ["adapter_reader", "conductor", "frontend", "prepare", "worker0"]
    assert (server.run_dir / "launcher.pid").read_text().strip() == str(server.proc.pid)
    # each process is named for its actor (pgrep worker0, top): not python, all alike
    assert {name: Path(f"/proc/{pid}/comm").read_text().strip() for name, pid in actors.items()} == {
        name: process_name(name) for name in actors}
    assert process_name("worker0") == "mstar-worker0" and process_name("adapter_reader") == "mstar-adapter_r"


def test_actors_take_a_short_openmp_spin_unless_the_user_set_one(server):
    from mstar_actors.launcher import OPENMP_SPIN_COUNT, openmp_spin_count

    environ = Path(f"/proc/{server.actors()['worker0']}/environ").read_bytes().split(b"\0")
    child = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    assert child.get("GOMP_SPINCOUNT") == (openmp_spin_count(server.env) or server.env.get("GOMP_SPINCOUNT"))
    assert openmp_spin_count({}) == OPENMP_SPIN_COUNT
    assert openmp_spin_count({"GOMP_SPINCOUNT": "5"}) is None and openmp_spin_count({"OMP_WAIT_POLICY": "passive"}) is None


def test_dump_stacks_shows_every_actor(server):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "dump_stacks"), "--timeout", "30"],
                         env=server.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in server.actors():
        assert f"actor {name} thread MainThread" in out.stdout
        assert f"actor {name} asyncio task" in out.stdout


def test_sigterm_stops_cleanly_without_leftovers(server):
    run_dir = server.run_dir
    run_id = run_dir.name
    assert our_segments(run_id)
    pids = server.actors().values()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0, server.log
    assert our_segments(run_id) == []
    assert not run_dir.exists()
    assert not any(_alive(pid) for pid in pids)


def test_a_server_started_under_nohup_outlives_the_terminal():
    """SIGHUP ignored at start (``nohup``, a service manager) stays ignored: only INT and TERM stop the server."""
    probe = "from mstar_actors import early_stop; print(' '.join(s.name for s in early_stop.stop_signals()))"
    for ignored, want in ((True, "SIGINT SIGTERM"), (False, "SIGINT SIGTERM SIGHUP")):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignored
                             else _hup_default)
        assert out.stdout.split() == want.split(), out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_a_stop_signal_to_the_whole_group_drains_as_one_to_the_launcher(model_dir, runtime_dir, tmp_path, sig):
    """systemd's stop, ``timeout`` and ``kill -TERM -PGID`` signal every
    process of the group, as a closed terminal sends SIGHUP: the actors leave
    it to the launcher, which drains."""
    with Server(model_dir, runtime_dir, tmp_path, session=True).running() as srv:
        run_id, pids = srv.run_dir.name, srv.actors().values()
        os.killpg(srv.proc.pid, sig)
        assert srv.wait_exit() == 0, srv.log
        assert "draining" in srv.log and "killed by" not in srv.log, srv.log
        assert f"stopping on signal {sig.name}" in srv.log, srv.log
        assert our_segments(run_id) == [] and not any(_alive(pid) for pid in pids)


def test_kill_9_of_an_actor_stops_the_launcher_naming_it(model_dir, runtime_dir, tmp_path):
    with Server(model_dir, runtime_dir, tmp_path).running() as srv:
        run_id = srv.run_dir.name
        os.kill(srv.actors()["worker0"], signal.SIGKILL)
        assert srv.wait_exit() != 0
        assert "actor worker0" in srv.log and "SIGKILL" in srv.log, srv.log
        assert our_segments(run_id) == []


def _reaper_of(run_id: str):
    import psutil

    return next(p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"]
                and "transport.reaper" in p.info["cmdline"] and run_id in p.info["cmdline"])


def test_kill_9_of_the_launcher_is_cleaned_by_its_reaper_else_by_the_next_start(model_dir, runtime_dir, tmp_path):
    """The run's reaper, in a session of its own, removes what a killed launcher left (some 100 MB of /dev/shm,
    kept until the next start), its whole group killed too; the reaper killed as well, the next start does."""
    with Server(model_dir, runtime_dir, tmp_path, session=True).running() as srv:
        run_dir = srv.run_dir
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.wait_exit()
        deadline = time.monotonic() + 30
        while (our_segments(run_dir.name) or run_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert our_segments(run_dir.name) == [] and not run_dir.exists()
    with Server(model_dir, runtime_dir, tmp_path).running() as srv:
        run_dir = srv.run_dir
        pids = list(srv.actors().values())
        _reaper_of(run_dir.name).kill()
        srv.proc.kill()
        srv.wait_exit()
        assert our_segments(run_dir.name), "a killed launcher with no reaper leaves its segments"
    from mstar_actors.config import Config
    from mstar_actors.launcher import Launcher

    os.environ["XDG_RUNTIME_DIR"], saved = str(runtime_dir), os.environ.get("XDG_RUNTIME_DIR")
    try:
        nxt = Launcher(Config(), None)  # it spawns nothing: no model facts needed
        nxt.prepare_run()  # what every start does first
        nxt.release()
    finally:
        os.environ.pop("XDG_RUNTIME_DIR") if saved is None else os.environ.__setitem__("XDG_RUNTIME_DIR", saved)
    assert our_segments(run_dir.name) == []
    assert not run_dir.exists()
    for pid in pids:  # the actors died with their launcher (parent-death signal)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        assert not _alive(pid)


def test_a_start_that_fails_half_way_releases_what_it_made(runtime_dir, monkeypatch):
    """prepare_run ran outside run()'s try: one failing after its rings (a full /dev/shm, say) left the run folder,
    its segments and the reaper until the process ended, and then the reaper said the launcher died."""
    import asyncio

    from mstar_actors.config import Config
    from mstar_actors.launcher import Launcher

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    launcher = Launcher(Config(), None)
    made = {}

    def fail(self):
        made["run_dir"], made["reaper"] = self.run_dir, self.reaper
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Launcher, "plan_metrics", fail)
    with pytest.raises(OSError):
        asyncio.run(launcher.run())
    assert not made["run_dir"].exists() and our_segments(made["run_dir"].name) == []
    assert made["reaper"].poll() == 0 and launcher.reaper is None  # told, and gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_frontends_ring_to_prepare_carries_the_largest_body_the_server_takes():
    from mstar_actors.config import Config, ServerConfig
    from mstar_actors.ring_sizes import ring_bytes

    config = Config(server=ServerConfig(max_body_bytes=32 << 20))
    assert ring_bytes("frontend.prepare", config, 2048) >= (32 << 20) * 5 // 4
    assert ring_bytes("frontend1.prepare", config, 2048) == ring_bytes("frontend.prepare", config, 2048)
    assert ring_bytes("prepare.conductor", config, 2048) == config.transport.ring_bytes  # media go by arena


def test_every_ring_holds_a_sequence_of_the_whole_context():
    """A plan's start, a Prepared and a first delta with its prompt's ids: a million-token context's take
    ~5 MB (the configured 4 MiB ring stopped the server); a plan fills the ring but its headroom."""
    from mstar_actors.config import Config
    from mstar_actors.ring_sizes import ID_BYTES, PLAN_HEADROOM, plan_bytes, ring_bytes, sequence_ids

    config = Config()
    one = ID_BYTES * sequence_ids(1 << 20, config.kv.block_size)
    for name in ("conductor.workers", "prepare.conductor", "conductor.frontend", "frontend.prepare"):
        assert ring_bytes(name, config, 1 << 20) > one + PLAN_HEADROOM
    assert plan_bytes(config, 1 << 20) == ring_bytes("conductor.workers", config, 1 << 20) - PLAN_HEADROOM > one
    assert ring_bytes("launcher.conductor", config, 1 << 20) < one


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model: {pth: x}\n")
    out = subprocess.run([sys.executable, "-m", "mstar_actors", "serve", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "pth" in line and "accepted keys there: path" in line


def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(model_dir, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = tmp_path / "taken.yaml"
        config.write_text(f"model: {{path: {model_dir}, name: tiny, device: cpu}}\nserver: {{port: {port}}}\n")
        out = subprocess.run([sys.executable, "-m", "mstar_actors", "serve", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    (line,) = [ln for ln in out.stderr.strip().splitlines() if "error" in ln.lower()]
    assert f"cannot listen on 127.0.0.1:{port}" in line and "server.port" in line, out.stderr
    assert "Traceback" not in out.stderr


def test_a_codec_folder_that_is_not_there_is_one_line_and_exit_2_before_the_actors(model_dir, tmp_path):
    config = tmp_path / "speech.yaml"
    config.write_text(f"model: {{path: {model_dir}, name: tiny, device: cpu}}\n"
                      f"speech: {{snac_path: {tmp_path / 'no-snac'}}}\n")
    out = subprocess.run([sys.executable, "-m", "mstar_actors", "serve", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [ln for ln in out.stderr.strip().splitlines() if "error" in ln.lower()]
    assert "speech.snac_path" in line and "is not a folder" in line, out.stderr


def test_a_stop_while_actors_start_does_not_wait_for_their_models(model_dir, runtime_dir, tmp_path):
    """SIGTERM once the first actor is ready, the workers still loading: the
    starting actors are killed at once (it waited out their stop timeout,
    ~10 s, while they loaded)."""
    srv = Server(model_dir, runtime_dir, tmp_path)
    try:
        assert srv.first_ready.wait(START_TIMEOUT_S), srv.log
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_exit()
        # (well under the stop timeout it used to wait out, with room for a loaded machine)
        assert time.monotonic() - started < STOP_TIMEOUT_S * 0.8 and "did not stop within" not in srv.log, srv.log
    finally:
        srv.kill()


@pytest.mark.parametrize("when", [0.3, 1.0, "serving tiny from"])
def test_a_signal_while_the_command_starts_stops_it_quietly(model_dir, runtime_dir, tmp_path, when):
    """SIGINT amid the imports, the model's checks or the spawn (a time, or
    the log line of the checks' end): exit 0, no traceback (it was a
    KeyboardInterrupt's, or lost to a library that caught it, the server
    then serving on), the start stopped."""
    srv = Server(model_dir, runtime_dir, tmp_path)
    try:
        if isinstance(when, str):
            deadline = time.monotonic() + START_TIMEOUT_S
            while not any(when in line for line in srv.lines) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            time.sleep(when)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait_exit() == 0, srv.log
        assert "Traceback" not in srv.log and "KeyboardInterrupt" not in srv.log, srv.log
        assert "stopped while starting" in srv.log and "serving tiny at" not in srv.log, srv.log
    finally:
        srv.kill()


def test_port_0_is_served_and_named_at_the_port_it_bound(model_dir, runtime_dir, tmp_path):
    with Server(model_dir, runtime_dir, tmp_path, port=0).running() as srv:
        line = next(line for line in srv.lines if "serving tiny at http://" in line)
        port = int(line.split("serving tiny at http://127.0.0.1:")[1].split()[0].rstrip("/"))
        assert port != 0 and http(port, "/health")[0] == 200


def test_a_host_that_is_not_this_hosts_address_is_named_as_such():
    from mstar_actors.launcher import port_problem

    problem = port_problem("192.0.2.7", 8347)  # TEST-NET-1: no host's own address
    assert "server.host '192.0.2.7' is not an address of this host" in problem and "--host" in problem


def test_an_actors_start_refusal_of_a_config_key_is_one_line_and_exit_2(model_dir, tmp_path):
    """A worker finds kv.num_blocks past free memory: the launcher names the
    key in one line (not the allocator's error, nor a peer that ended after it)."""
    config = tmp_path / "huge.yaml"
    config.write_text(f"model: {{path: {model_dir}, name: tiny, device: cpu}}\nserver: {{port: 0}}\n"
                      "kv: {num_blocks: 100000000000}\n")
    out = subprocess.run([sys.executable, "-m", "mstar_actors", "serve", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: kv.num_blocks 100000000000"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "actor worker0 failed while starting: kv.num_blocks" in out.stderr, out.stderr  # not a peer ending after it
