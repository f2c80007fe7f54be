"""A run's reaper: a small process that removes the run's shared memory and
run directory when its launcher dies without doing so (``kill -9``, the OOM
killer).

The launcher starts it with a pipe as its stdin whose writing end only the
launcher holds (actors are spawned without it). The read returns when that
end closes: after the launcher's own release (it writes ``released`` first:
nothing to do), or at its death, when the actors die too (their parent-death
signal) and their segments, some 100 MB with the media arena, would otherwise
stay in /dev/shm until the next start's ``cleanup_stale``. It runs in a
session of its own: a stop signalled to the launcher's process group (the
launcher's to drain), a Ctrl-C, or a ``kill -9`` of the whole group does not
reach it; it ignores the stop signals besides.

    python -m transport.reaper RUN_ID RUN_DIR
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from transport.shm import cleanup_run

RELEASED = b"released"


def start(run_id: str, run_dir: str | Path) -> subprocess.Popen:
    """The reaper of ``run_id``, waiting on the launcher's end of its stdin."""
    return subprocess.Popen([sys.executable, "-m", "transport.reaper", run_id, str(run_dir)],
                            stdin=subprocess.PIPE, start_new_session=True)


def release(reaper: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """The launcher cleaned up: tell the reaper so, and wait for it to leave."""
    try:
        reaper.stdin.write(RELEASED)
        reaper.stdin.close()
    except (BrokenPipeError, ValueError):  # it is gone already
        pass
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def main(argv: list[str]) -> int:
    run_id, run_dir = argv
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if sys.stdin.buffer.read() == RELEASED:
        return 0
    removed = cleanup_run(run_id, run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"mstar-actors: the launcher of run {run_id} died; removed its {len(removed)} shared-memory segments "
          f"and {run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
