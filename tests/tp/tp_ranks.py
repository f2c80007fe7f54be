"""Run one function on every rank of a CPU (gloo) tensor-parallel group, in
processes of their own, and collect what each returns.

``run_ranks(fn, 2, *args)`` starts two processes; each joins the group on a
fresh loopback port, calls ``fn(tp, *args)`` with one torch thread (two
ranks on two cores) and sends back its result. ``fn`` must be a module-level
function (it is pickled by name). Bounded: a rank that does not answer in
``timeout_s`` fails the call, and every child is gone when it returns.

Each rank is a fresh process forked from a fork server that has only
imported torch (no tensor op run, no thread pool or CUDA context started):
a spawned rank imported torch itself, about 1.8 s a call of two ranks and
4 s of four on two cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import traceback
from typing import Any, Callable

RANK_TIMEOUT_S = 240.0
# What the fork server imports once, before it forks any rank.
PRELOAD = ["torch", "mstar_actors.runner.parallel"]


class LoaderLines(logging.Handler):
    """Keeps the loader's startup lines (``rank R of N holds ...``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_main(rank: int, world_size: int, port: int, device: str, fn: Callable, args: tuple, out: Any) -> None:
    import torch

    from mstar_actors.runner.parallel import Rendezvous, destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    lines = LoaderLines()
    loader_log = logging.getLogger("mstar_actors.models.loader")
    loader_log.setLevel(logging.INFO)
    loader_log.addHandler(lines)
    tp = None
    try:
        where = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
        tp = init_tensor_parallel(rank, Rendezvous("127.0.0.1", port, world_size), where, timeout_s=60)
        result = fn(tp, *args)
        out.put((rank, "ok", result, lines.lines))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, "error", traceback.format_exc(), lines.lines))
    finally:
        if tp is not None:
            destroy_tensor_parallel(tp)


def run_ranks(fn: Callable, world_size: int, *args: Any, device: str = "cpu",
              timeout_s: float = RANK_TIMEOUT_S) -> list[tuple[Any, list[str]]]:
    """``[(fn's result, the loader's log lines)]`` by rank; ``device`` "cuda"
    puts rank R on ``cuda:R`` in an NCCL group."""
    from mstar_actors.runner.parallel import pick_loopback_port

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    port = pick_loopback_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, device, fn, args, out), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[Any, list[str]]] = {}
    try:
        for _ in procs:
            try:
                rank, status, value, lines = out.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"a rank did not answer within {timeout_s:.0f} s") from None
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = (value, lines)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
