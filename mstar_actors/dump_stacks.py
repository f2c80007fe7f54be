"""Print every thread's and every asyncio task's stack of every actor of a run.

``mstar-actors dump-stacks [RUN_DIR | LAUNCHER_PID] [--timeout SECONDS]``
(or ``tools/dump_stacks``, which finds the project's environment first).

Without an argument it picks the newest live run. It reads the run
directory's actors.json, removes old dumps, sends SIGUSR1 to every actor and
prints each ``stacks/<actor>.txt`` as it appears. Actors dump from a
dedicated thread, so this works while an actor's event loop is blocked.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from mstar_actors import rundir
from mstar_actors.cli_types import counted

POLL_S = 0.05  # this CLI waits for files another process writes; a short bounded wait is its only option


def request_dumps(run_dir: Path, actors: dict[str, int]) -> dict[str, Path]:
    """Signal every actor; the dump file each one will write, by name (an
    actor that no longer runs is said so, and has none)."""
    stacks = run_dir / "stacks"
    stacks.mkdir(exist_ok=True)
    pending = {}
    for name, pid in actors.items():
        path = stacks / f"{name}.txt"
        path.unlink(missing_ok=True)
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            print(f"=== actor {name} (pid {pid}): not running ===\n")
            continue
        pending[name] = path
    return pending


def collect(pending: dict[str, Path], timeout_s: float) -> list[str]:
    """Print dumps as they appear; the names that never did."""
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for name, path in list(pending.items()):
            if path.exists():  # written atomically: complete when it exists
                print(path.read_text())
                del pending[name]
        if pending:
            time.sleep(POLL_S)
    return sorted(pending)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", help="a run directory or the launcher's pid (default: newest live run)")
    parser.add_argument("--timeout", type=counted(float, 0.0, True, "a positive number of seconds"), default=10.0,
                        help="seconds to wait for every actor")


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every actor dumped, 1 when one did not (or the output's reader stopped reading,
    ``| head``: the output ends quietly, some dumps unread), 2 without a run."""
    try:
        return _run(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush: no second error
        return 1


def _run(args: argparse.Namespace) -> int:
    try:
        run_dir = rundir.find_run(args.run)
        actors = rundir.read_actors(run_dir)["actors"]
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"=== run {run_dir} ===\n")  # (the newest live run is the machine's: which one this is)
    pending = request_dumps(run_dir, actors)
    gone = sorted(set(actors) - set(pending))
    missing = collect(pending, args.timeout)
    for name in missing:
        print(f"error: actor {name} did not dump its stacks within {args.timeout:.0f} s", file=sys.stderr)
    for name in gone:
        print(f"error: actor {name} is not running", file=sys.stderr)
    return 1 if missing or gone else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dump_stacks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
