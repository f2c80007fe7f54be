"""How the step's own Triton kernels launch on CUDA: with programmatic
dependent launch (PDL) where the device has it (compute capability 9.0 and
up: Hopper, Blackwell).

A decode step of a small model is a chain of short kernels, and between two
of them the device drains the first, flushes its writes and only then
starts the second. Launched with PDL, a kernel's programs may start while
the kernel before it in the stream is still finishing. Each of our kernels
then follows one rule (``GDC`` in their signatures):

- before ``gdc_wait`` it reads only what no kernel of a step writes: weights,
  a LoRA slot's scale and factors, and the step's inputs copied in before its
  first kernel (row slots, context lengths); it writes nothing;
- ``gdc_wait`` returns once the kernel before it has finished and its writes
  are visible (by then every kernel before that one has finished too, since
  it waited in turn);
- ``gdc_launch_dependents`` right after lets the kernel after it start early.

The step's inputs are copied in, and a swap's slot copies queued, before
its first kernel, which is never one of ours (the embedding lookup comes
first), so they are complete when ours start. A kernel launched without PDL
(a cuBLAS GEMM, a torch op) waits for the whole of the one before it, as
always; CUDA graphs capture the programmatic edges as they are. On other
devices and under Triton's interpreter, ``GDC`` is False and the kernels
are what they were.

``tools/profile_gpu_step.py --pdl both`` times the step with and without.
"""

from __future__ import annotations

import functools

import torch

# Read as each kernel launches (graphs keep what they captured); the GPU
# tests and ``tools/profile_gpu_step.py --pdl`` run both.
enabled = True

_SM90: dict[int, bool] = {}


def pdl(x: torch.Tensor) -> bool:
    """Whether a kernel over ``x`` launches with PDL (``launch_pdl=`` and
    its ``GDC`` constant): ``x`` on an NVIDIA device of compute capability
    9.0 or newer, a Triton that has it, and ``enabled``."""
    return enabled and x.is_cuda and is_sm90(x.device) and _triton_has_pdl()


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` (CUDA) is an NVIDIA device of compute capability 9.0 or newer."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
    return _SM90[index]


@functools.cache
def _triton_has_pdl() -> bool:
    """Triton's ``gdc_wait`` and ``launch_pdl`` came together (Triton 3.4)."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device, off_cuda: int) -> int:
    """Streaming multiprocessors of ``device``, read once per device (a graph
    capture must not query); ``off_cuda`` elsewhere (Triton's interpreter:
    each caller's own stand-in)."""
    if device.type != "cuda":
        return off_cuda
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def options(x: torch.Tensor) -> dict:
    """A kernel's launch arguments over ``x``: ``launch_pdl`` and its ``GDC``
    constant, both ``pdl(x)``."""
    use = pdl(x)
    return {"GDC": use, "launch_pdl": use}
