"""What the kernel checks and benchmarks share to time work: a CUDA graph of
back-to-back calls, the median of CUDA-event timings, and the median wall
time of eager calls (on the CPU too)."""

from __future__ import annotations

import statistics
import time

import torch


def capture_graph(fn, calls: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``calls`` back-to-back calls of ``fn``, which runs once
    on a side stream first (compiling and warming up outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def cuda_median_us(run, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the GPU microseconds of one ``run()``, divided by the ``calls`` it makes."""
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_us(fn, *, device: str, warmup: int, iters: int, calls: int = 1) -> float:
    """Median wall microseconds per call of ``calls`` back-to-back calls, synchronised at the end."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)
