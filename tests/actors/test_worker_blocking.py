"""The worker's blocking calls run in a thread that ends with the call, so no
idle OpenMP team outlives a load or an install (it slows the step thread's
parallel regions); results and errors still come back to the awaiting task."""

from __future__ import annotations

import asyncio
import functools
import threading
from types import SimpleNamespace

import pytest

from actors.worker import WorkerActor


def run_blocking(fn, *args):
    worker = SimpleNamespace(name="worker0")
    worker.start_blocking = functools.partial(WorkerActor.start_blocking, worker)
    return asyncio.run(WorkerActor.run_blocking(worker, fn, *args))


def test_result_comes_back_from_a_thread_that_then_ends():
    seen = {}

    def work(a, b):
        seen["thread"] = threading.current_thread()
        return a + b

    assert run_blocking(work, 2, 3) == 5
    assert seen["thread"] is not threading.main_thread()
    seen["thread"].join(timeout=5)
    assert not seen["thread"].is_alive()


def test_errors_are_raised_in_the_awaiting_task():
    def fail():
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        run_blocking(fail)
