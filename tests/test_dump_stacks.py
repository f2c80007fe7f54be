"""tools/dump_stacks against an actor process whose event loop is blocked."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

from actors.base import Actor, ActorSpec, run_actor_process
from mstar_actors import rundir
from mstar_actors.config import Config

TOOL = Path(__file__).resolve().parent.parent / "tools" / "dump_stacks"


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


def test_dump_stacks_while_the_loop_is_blocked(tmp_path):
    print("seed: none (deterministic)")
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    spec = ActorSpec(name="blocked", config=Config(), run_dir=str(tmp_path), inbox={}, outbox={},
                     params={"started": started})
    proc = ctx.Process(target=run_actor_process, args=(f"{__name__}:BlockedActor", spec))
    proc.start()
    try:
        assert started.wait(60), "the test actor did not start"
        rundir.write_actors(tmp_path, "test", {"blocked": proc.pid})
        out = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--timeout", "20"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert "actor blocked thread MainThread" in text
        assert "blocking_call_in_handler" in text  # the blocked main thread's frame
        assert "actor blocked thread stack-dumper" in text
        assert "actor blocked asyncio task" in text and "in run" in text  # the actor's task
    finally:
        proc.kill()
        proc.join()
