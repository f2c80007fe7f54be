"""CPU sizing: how many threads each process may run so the machine is not
oversubscribed. Pure: no I/O, no torch; the actors pass in what they read.

The split, in order of need:

- every tensor-parallel worker runs ``torch_threads_per_worker`` intra-op
  threads (``parallel.worker_torch_threads``: on a GPU host one, the device
  does the work; on CPU the cores split between the ranks);
- the frontend and conductor loops keep ``num_reserved`` cores so that
  streaming and scheduling never wait behind preparation;
- what is left goes to the prepare pool. Each pool worker decodes on its own
  thread (ffmpeg single-threaded: the pool is the parallelism) and calls into
  torch, which runs the prepare process's intra-op threads, so the pool is
  ``cpus left // threads of this process``, capped at
  ``MAX_PREPARE_WORKERS`` (past 8 the video speed-up is flat and the reorder
  buffer only grows).

A higher ``prepare.preprocess_torch_threads`` therefore shrinks the pool:
with 8 CPUs left and 8 threads per worker the pool is 1 (one thread).

Each pool thread is then pinned to CPUs of its own (``pool_cpus``), taken
from the top of the allowed set, one per physical core before any core's
second hardware thread, while the loops and workers float. Drafts hand the
GIL over thousands of times each (PyAV releases it around every decode
call), and a pinned thread wakes on its own CPU after each hand-over instead
of wherever the OS puts it. Whether that pays depends on the host (measure it
with bench_prepare, docs/benchmarks.md); ``prepare.pin_pool_threads: false``
turns pinning off.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

MAX_PREPARE_WORKERS = 8


@dataclass(frozen=True)
class CpuPlan:
    num_cpus: int  # CPUs this server may use (the affinity mask, not the host's count)
    num_ranks: int  # tensor-parallel worker processes on this host
    torch_threads_per_worker: int = 1
    num_reserved: int = 2  # frontend and conductor loops

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_ranks", "torch_threads_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"CpuPlan.{name} must be at least 1, got {getattr(self, name)}")
        if self.num_reserved < 0:
            raise ValueError(f"CpuPlan.num_reserved must be at least 0, got {self.num_reserved}")

    @property
    def num_cpus_left(self) -> int:
        """CPUs for preparation once the workers and the loops have theirs (never below 1)."""
        used = self.num_ranks * self.torch_threads_per_worker + self.num_reserved
        return max(1, self.num_cpus - used)

    def prepare_workers(self, prepare_torch_threads: int) -> int:
        """Pool size for a prepare process running ``prepare_torch_threads``
        intra-op threads: ``min(8, cpus left // threads)``, at least 1."""
        if prepare_torch_threads < 1:
            raise ValueError(f"prepare_torch_threads must be at least 1, got {prepare_torch_threads}")
        return max(1, min(MAX_PREPARE_WORKERS, self.num_cpus_left // prepare_torch_threads))

    def pool_cpus(self, allowed: list[int], num_workers: int, prepare_torch_threads: int,
                  cores: Mapping[int, Hashable] | None = None) -> list[list[int]] | None:
        """The CPUs each of ``num_workers`` pool threads is pinned to:
        ``prepare_torch_threads`` of them apiece, disjoint, from the top of
        ``allowed`` (the process's affinity), so the low CPUs stay with the
        loops and workers. ``cores`` maps a CPU to its physical core (CPUs
        missing from it count as cores of their own): one CPU per core is
        taken first, top down, and a core's second hardware thread only once
        every core has one, since two drafts on the hardware threads of one
        core share its execution units. None (no pinning) when the CPUs left
        for preparation cannot give every thread its own: pinned threads
        sharing a CPU would wait for each other where floating ones would
        spread."""
        if num_workers < 2 or prepare_torch_threads < 1:
            return None
        need = num_workers * prepare_torch_threads
        if need > self.num_cpus_left or need > len(allowed):
            return None
        cores = cores or {}
        first, second, taken = [], [], set()
        for cpu in sorted(allowed, reverse=True):
            core = cores.get(cpu, ("cpu", cpu))
            (second if core in taken else first).append(cpu)
            taken.add(core)
        top = (first + second)[:need]
        return [sorted(top[i * prepare_torch_threads:(i + 1) * prepare_torch_threads]) for i in range(num_workers)]


def resolve_prepare_workers(
    plan: CpuPlan, prepare_torch_threads: int, configured: int | None, is_parallel: bool
) -> int:
    """The pool size the prepare actor runs: 1 unless the model's
    preparation is declared parallel; else the config's
    ``prepare.preprocess_workers`` when set (1: one thread), else the plan's."""
    if not is_parallel:
        return 1
    if configured is not None:
        if configured < 1:
            raise ValueError(f"prepare.preprocess_workers must be at least 1, got {configured}")
        return configured
    return plan.prepare_workers(prepare_torch_threads)
