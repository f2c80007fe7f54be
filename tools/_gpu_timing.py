"""What the kernel checks and benchmarks share to time GPU work: a CUDA graph
of back-to-back calls, and the median of CUDA-event timings."""

from __future__ import annotations

import statistics

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
