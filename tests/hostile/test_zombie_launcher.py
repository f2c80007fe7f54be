"""A killed launcher that its parent has not reaped yet is a zombie: it has
exited, so its run is dead and is cleaned up like any other dead run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mstar_actors import rundir
from transport import cleanup_orphans, cleanup_stale
from transport.shm import MARKER, SHM_DIR, segment_name


@pytest.fixture
def zombie():
    """An exited child left unreaped (its Popen is held and never polled)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    yield proc
    proc.wait()


def _run_of(pid: int, root: Path) -> tuple[str, Path]:
    """A run directory of launcher ``pid``, as the launcher writes it."""
    run_id = f"{time.strftime('%Y%m%d%H%M%S', time.localtime(time.time() - 60))}p{pid}"
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    (run_dir / rundir.PID_FILE).write_text(f"{pid}\n")
    (run_dir / rundir.ACTORS_FILE).write_text(json.dumps({"run_id": run_id, "launcher_pid": pid, "actors": {}}))
    marker = {"run_id": run_id, "launcher_pid": pid, "launcher_start": psutil.Process(pid).create_time()}
    (run_dir / MARKER).write_text(json.dumps(marker))
    return run_id, run_dir


def test_a_zombie_is_not_alive(zombie):
    assert psutil.pid_exists(zombie.pid)  # the pid is still taken: signal 0 would succeed
    assert not rundir.is_alive(zombie.pid)
    assert rundir.is_alive(psutil.Process().pid)


def test_the_run_of_a_zombie_launcher_is_cleaned_up(zombie, tmp_path):
    run_id, run_dir = _run_of(zombie.pid, tmp_path)
    assert rundir.run_is_dead(run_id)
    assert rundir.live_runs(tmp_path) == []
    segment = SHM_DIR / segment_name(run_id, "ring-a.b")
    segment.write_bytes(b"x")
    try:
        assert cleanup_stale(tmp_path) == [run_id]
        assert not segment.exists()
        segment.write_bytes(b"x")  # its run directory gone, the segment is still an orphan of a dead run
        # Another dead run's orphans on this machine (a killed server's) go too.
        assert run_id in cleanup_orphans(rundir.run_is_dead) and not segment.exists()
        assert rundir.remove_dead_run_dirs(tmp_path) == [run_dir] and not run_dir.exists()
    finally:
        segment.unlink(missing_ok=True)
