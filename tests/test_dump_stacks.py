"""tools/dump_stacks against an actor process whose event loop is blocked: as
the installed ``mstar-actors dump-stacks`` command, and as the launcher run
from a plain shell (no virtual environment on PATH) of a checkout with a .venv."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.base import Actor, ActorSpec, run_actor_process
from mstar_actors import rundir
from mstar_actors.config import Config

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "dump_stacks"
PLAIN_PATH = "/usr/bin:/bin"


class BlockedActor(Actor):
    """Blocks its own event loop in ``time.sleep`` inside ``start``."""

    def __init__(self, *, started, **kw):
        super().__init__(**kw)
        self.started_event = started

    async def start(self):
        self.started_event.set()
        blocking_call_in_handler()


def blocking_call_in_handler():
    time.sleep(60)


@pytest.fixture(scope="module")
def blocked_run(tmp_path_factory):
    """A run directory listing one live actor blocked in its event loop."""
    print("seed: none (deterministic)")
    run_dir = tmp_path_factory.mktemp("run")
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    spec = ActorSpec(name="blocked", config=Config(), run_dir=str(run_dir), inbox={}, outbox={},
                     params={"started": started})
    proc = ctx.Process(target=run_actor_process, args=(f"{__name__}:BlockedActor", spec))
    proc.start()
    try:
        assert started.wait(60), "the test actor did not start"
        rundir.write_actors(run_dir, "test", {"blocked": proc.pid})
        yield run_dir
    finally:
        proc.kill()
        proc.join()


def assert_stacks(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "actor blocked thread MainThread" in text
    assert "blocking_call_in_handler" in text  # the blocked main thread's frame
    assert "actor blocked thread stack-dumper" in text
    assert "actor blocked asyncio task" in text and "in run" in text  # the actor's task


def test_the_command_dumps_while_the_loop_is_blocked(blocked_run):
    out = subprocess.run([sys.executable, "-m", "mstar_actors", "dump-stacks", str(blocked_run), "--timeout", "20"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert_stacks(out)


@pytest.fixture
def checkout_with_venv(tmp_path):
    """A checkout as ``make install`` leaves it: the launcher, the package and
    .venv (this test's own environment, which has the project's dependencies)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a virtual environment: there is no .venv to find")
    (tmp_path / "tools").mkdir()
    shutil.copy(TOOL, tmp_path / "tools" / "dump_stacks")
    for package in ("mstar_actors", "actors", "transport"):
        (tmp_path / package).symlink_to(ROOT / package)
    (tmp_path / ".venv").symlink_to(sys.prefix)
    return tmp_path


def test_the_launcher_finds_the_checkouts_venv_from_a_plain_shell(blocked_run, checkout_with_venv):
    launcher = checkout_with_venv / "tools" / "dump_stacks"
    out = subprocess.run(["env", "-i", f"PATH={PLAIN_PATH}", str(launcher), str(blocked_run), "--timeout", "20"],
                         capture_output=True, text=True, timeout=60, cwd=checkout_with_venv)
    assert_stacks(out)


def test_the_launcher_uses_the_active_virtual_environment(blocked_run):
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a virtual environment")
    out = subprocess.run(["env", "-i", f"PATH={PLAIN_PATH}", f"VIRTUAL_ENV={sys.prefix}", str(TOOL),
                          str(blocked_run), "--timeout", "20"], capture_output=True, text=True, timeout=60)
    assert_stacks(out)


def test_without_an_environment_the_launcher_says_how_to_make_one(tmp_path):
    """No .venv, no $VIRTUAL_ENV, an interpreter without the dependencies: one line saying what to do."""
    python = shutil.which("python3", path=PLAIN_PATH)
    probe = subprocess.run([python, "-c", "import psutil"], capture_output=True) if python else None
    if probe is None or probe.returncode == 0:
        pytest.skip("no python3 on the plain PATH lacks the dependencies")
    (tmp_path / "tools").mkdir()
    shutil.copy(TOOL, tmp_path / "tools" / "dump_stacks")
    (tmp_path / "mstar_actors").symlink_to(ROOT / "mstar_actors")
    out = subprocess.run(["env", "-i", f"PATH={PLAIN_PATH}", str(tmp_path / "tools" / "dump_stacks")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "make install" in out.stderr and "psutil" in out.stderr


def test_a_run_whose_launcher_is_gone_is_refused_and_no_pid_of_it_signalled(tmp_path, monkeypatch):
    """Its actors' pids may be other processes' now (SIGUSR1 ends a process that does not catch it)."""
    from mstar_actors import dump_stacks

    run_dir = tmp_path / "20261201000000p999999"
    run_dir.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / rundir.ACTORS_FILE).write_text(
        f'{{"run_id": "x", "launcher_pid": {int(gone.stdout)}, "actors": {{"worker0": {os.getpid()}}}}}')
    monkeypatch.setattr(os, "kill", lambda *args: pytest.fail(f"signalled {args}"))
    assert dump_stacks.main([str(run_dir)]) == 2


def test_a_dump_asked_while_an_actor_starts_waits_for_its_dumper(tmp_path):
    """The launcher lists its actors as soon as they are spawned; a dump asked then reached an actor before
    its dumper thread blocked SIGUSR1, whose default action killed it, and the start with it."""
    from mstar_actors.launcher import dumps_held

    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    spec = ActorSpec(name="blocked", config=Config(), run_dir=str(tmp_path), inbox={}, outbox={},
                     params={"started": started})
    proc = ctx.Process(target=run_actor_process, args=(f"{__name__}:BlockedActor", spec))
    with dumps_held():
        proc.start()
    try:
        (tmp_path / "stacks").mkdir()
        os.kill(proc.pid, signal.SIGUSR1)  # before the child has even imported anything
        assert started.wait(60) and proc.is_alive(), proc.exitcode
        deadline = time.monotonic() + 30
        while not (tmp_path / "stacks" / "blocked.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "actor blocked thread MainThread" in (tmp_path / "stacks" / "blocked.txt").read_text()
    finally:
        proc.kill()
        proc.join()


def test_the_newest_run_is_the_last_started_whichever_was_dumped_last(tmp_path):
    """Runs were ordered by their folder's time, which a dump's stacks/ moves: a dump of the older run made
    it the "newest", the default target of the next dump."""
    for name, started in (("old", 1000), ("new", 2000)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / rundir.PID_FILE).write_text(f"{os.getpid()}\n")
        (run_dir / rundir.ACTORS_FILE).write_text("{}")
        os.utime(run_dir / rundir.PID_FILE, (started, started))
    (tmp_path / "old" / "stacks").mkdir()  # the older one dumped last
    assert rundir.live_runs(tmp_path) == [tmp_path / "old", tmp_path / "new"]


def test_a_reader_that_stops_reading_ends_the_output_quietly(blocked_run):
    """``dump_stacks | head -1``: a BrokenPipeError's traceback, and no actor signalled."""
    out = subprocess.run(f"{sys.executable} -m mstar_actors dump-stacks {blocked_run} --timeout 20 | head -1",
                         shell=True, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.startswith("=== run ") and "Traceback" not in out.stderr, out.stderr
