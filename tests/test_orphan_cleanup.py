"""Shared memory of a dead launcher whose run directory is gone (a test's
temporary folder, another runtime dir) is removed at the next start."""

import os
import subprocess
import sys
import time
from pathlib import Path

from mstar_actors import rundir
from transport import cleanup_orphans

SHM = Path("/dev/shm")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_orphans_of_dead_launchers_go_and_live_ones_stay():
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(time.time() - 60))
    dead = SHM / f"mstar-{stamp}p{_dead_pid()}-ring-a.b"
    live = SHM / f"mstar-{rundir.new_run_id()}-ring-a.b"
    foreign = SHM / f"mstar-t{os.getpid()}x0-ring-r"  # not a launcher run id: not ours to judge
    for path in (dead, live, foreign):
        path.write_bytes(b"x")
    try:
        cleaned = cleanup_orphans(rundir.run_is_dead)
        assert not dead.exists()
        assert live.exists() and foreign.exists()
        assert dead.name.split("-")[1] in cleaned
    finally:
        for path in (dead, live, foreign):
            path.unlink(missing_ok=True)


def test_a_reused_pid_counts_as_dead():
    # our own pid, but a run id stamped before this process started: the launcher that made it is gone
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(time.time() - 3600 * 24))
    assert rundir.run_is_dead(f"{stamp}p{os.getpid()}")
    assert not rundir.run_is_dead(rundir.new_run_id())
