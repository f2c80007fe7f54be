"""Run directories: where a serve records who it is and what it owns.

Layout of ``<runs_root>/<run_id>/``::

    launcher.pid     the launcher's pid
    actors.json      {"run_id", "launcher_pid", "actors": {name: pid}}
    transport.json   the transport's ownership marker (see transport.shm)
    fifo/            ring wakeup FIFOs
    stacks/<actor>.txt   written by an actor on SIGUSR1 (tools/dump_stacks)

``runs_root()`` is ``$XDG_RUNTIME_DIR/mstar-actors/runs`` (``/tmp`` when
unset). The launcher is the only writer; tools only read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil

ACTORS_FILE = "actors.json"
PID_FILE = "launcher.pid"


def runs_root() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / "mstar-actors" / "runs"


def new_run_id() -> str:
    """Unique per start, sortable by time, and without '-' (segment names use it as separator)."""
    return f"{time.strftime('%Y%m%d%H%M%S')}p{os.getpid()}"


def run_is_dead(run_id: str) -> bool:
    """True for a launcher run id (``new_run_id``) whose launcher is gone: its
    pid runs no more, or runs a process started after the run (a reused pid).
    Other ids (not ours to judge) are never dead."""
    stamp, sep, pid = run_id.partition("p")
    if not sep or not pid.isdigit() or len(stamp) != 14 or not stamp.isdigit():
        return False
    try:
        started = time.mktime(time.strptime(stamp, "%Y%m%d%H%M%S"))
        proc = psutil.Process(int(pid))
        return proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > started + 1
    except psutil.NoSuchProcess:  # ZombieProcess included
        return True
    except (ValueError, psutil.AccessDenied):
        return False


def create_run_dir(run_id: str, root: Path | None = None) -> Path:
    run_dir = (root or runs_root()) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
    return run_dir


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_actors(run_dir: Path, run_id: str, pids: dict[str, int]) -> None:
    record = {"run_id": run_id, "launcher_pid": os.getpid(), "actors": pids}
    _write_atomically(run_dir / ACTORS_FILE, json.dumps(record, indent=1))


def read_actors(run_dir: Path) -> dict:
    path = Path(run_dir) / ACTORS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run directory of a started server?") from None


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie (exited, not yet reaped by its parent)
    does not: a killed launcher whose parent has not waited for it is one,
    and its run must still be cleaned up."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess included
        return False
    except psutil.AccessDenied:  # another user's process: it runs
        return True


def live_runs(root: Path | None = None) -> list[Path]:
    """Run directories whose launcher is alive, oldest first: by when the launcher wrote its pid, once as it
    started (the folder's own time moves as files come and go in it: a dump's ``stacks/``)."""
    root = root or runs_root()
    if not root.is_dir():
        return []
    runs = []
    for run_dir in root.iterdir():
        try:
            pid_file = run_dir / PID_FILE
            pid, started = int(pid_file.read_text()), pid_file.stat().st_mtime
        except (OSError, ValueError):
            continue
        if is_alive(pid) and (run_dir / ACTORS_FILE).exists():
            runs.append((started, run_dir.name, run_dir))
    return [run_dir for *_, run_dir in sorted(runs)]


def find_run(arg: str | None, root: Path | None = None) -> Path:
    """A run directory from a path, a launcher pid, or (None) the newest live run."""
    if arg is None:
        runs = live_runs(root)
        if not runs:
            raise FileNotFoundError(f"no live run under {root or runs_root()}: is a server running?")
        return runs[-1]
    if Path(arg).is_dir():
        run_dir = Path(arg)
        pid = read_actors(run_dir).get("launcher_pid")
        if not isinstance(pid, int) or not is_alive(pid) or run_is_dead(run_dir.name):
            # its actors' pids may be other processes' by now: none is signalled
            raise FileNotFoundError(f"{arg}: its launcher (pid {pid}) is not running: the run is over")
        return run_dir
    if arg.isdigit():
        for run_dir in live_runs(root):
            if read_actors(run_dir).get("launcher_pid") == int(arg):
                return run_dir
        raise FileNotFoundError(f"no live run has launcher pid {arg}; pass the run directory instead (under "
                                f"{runs_root()}; the launcher's start-up line names it)")
    raise FileNotFoundError(f"{arg}: neither a run directory nor a launcher pid")


def remove_dead_run_dirs(root: Path | None = None) -> list[Path]:
    """Remove run directories whose launcher is gone (after their shared memory
    was cleaned up by ``transport.cleanup_stale``)."""
    root = root or runs_root()
    removed = []
    if not root.is_dir():
        return removed
    for run_dir in root.iterdir():
        try:
            pid = int((run_dir / PID_FILE).read_text())
        except (OSError, ValueError):
            pid = None  # half-created: another launcher may be writing it right now
            if time.time() - run_dir.stat().st_mtime < 60:
                continue
        if pid is None or not is_alive(pid):
            remove_run_dir(run_dir)
            removed.append(run_dir)
    return removed
