"""The tensor-parallel ranks' collectives, the one place that names a backend.

A ``TensorParallel`` is what a sharded model holds: its rank, the world
size, and the two collectives Megatron-style sharding needs (``all_reduce``
after a row-parallel linear or the vocabulary-split embedding,
``all_gather`` of the vocabulary-split logits). ``SINGLE_RANK`` is the
one-rank version: both collectives return their input, so an unsharded
model pays nothing.

The process group is ``torch.distributed``'s default group (gloo on CPU,
NCCL on CUDA), joined through a TCP rendezvous on a loopback port the
launcher picked (``init_tensor_parallel``). Only activations travel here;
plans and agreement messages keep travelling over the rings.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT_S = 120.0  # a collective waiting longer for a peer fails rather than hangs


class CollectiveError(RuntimeError):
    """A collective failed (a peer stopped, hung past the timeout or died):
    the group is broken for good, so the rank cannot serve on, and its
    actor exits, which stops the server as any actor's death does."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a loopback TCP address the launcher chose, and how many come."""

    host: str
    port: int
    world_size: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def pick_loopback_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host`` (bound to port 0, then released for rank 0's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class TensorParallel:
    """One rank's view of the group. ``world_size == 1`` does nothing."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (on the current stream: capturable in a CUDA graph)."""
        if self.world_size > 1:
            import torch.distributed as dist

            x = x.contiguous()  # a fused GEMM's output may be a column view
            self._collective("all_reduce", dist.all_reduce, x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [R, n]`` side by side in rank order -> ``[R, world_size * n]``."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if self.backend == "nccl":  # one output buffer: capturable in a CUDA graph
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            self._collective("all_gather", dist.all_gather_into_tensor, out, x)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self._collective("all_gather", dist.all_gather, parts, x)
        return torch.cat(parts, dim=-1)

    def _collective(self, name: str, op, *args) -> None:
        try:
            op(*args)
        except Exception as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CollectiveError(f"rank {self.rank}: {name} across the {self.world_size} ranks failed ({reason}): "
                                  "a peer rank stopped, hung or died, and the group cannot be used again; "
                                  "restart the server") from err

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"


SINGLE_RANK = TensorParallel()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, rendezvous: Rendezvous, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """Join the ranks' process group (blocks until all ``world_size`` joined,
    at most ``timeout_s``); a group of one joins nothing."""
    if rendezvous.world_size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    backend = backend_for(device)
    from mstar_actors.runner.device import use_device

    use_device(device)
    dist.init_process_group(backend, init_method=rendezvous.init_method, rank=rank,
                            world_size=rendezvous.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    tp = TensorParallel(rank, rendezvous.world_size, backend)
    # One collective now: NCCL makes its communicator on the first, which
    # must not happen inside a CUDA graph's capture; on gloo it checks the wiring.
    probe = tp.all_reduce(torch.ones(1, device=device))
    if int(probe.item()) != tp.world_size:
        raise RuntimeError(f"rank {rank}: the group's first all-reduce gave {probe.item()}, not {tp.world_size}")
    return tp


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the group (at shutdown); a no-op for one rank or a group already gone."""
    if not tp.is_parallel:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def check_rank_devices(tp: int, device: str) -> None:
    """A CUDA group's rank R serves on ``cuda:R`` (``rank_device``): the machine must hold a GPU a rank (a rank
    past them failed at its start with torch's error)."""
    if tp > 1 and device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < tp:
        from mstar_actors.config import ConfigError

        count = torch.cuda.device_count()
        raise ConfigError(f"parallel.tp {tp}: each rank serves on a GPU of its own and this machine has {count}; "
                          f"set parallel.tp to at most {count} (or model.device: cpu)")


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """The device rank ``rank`` serves on: ``cuda:{rank}`` for a CUDA group, else ``device``."""
    if device.type == "cuda" and world_size > 1:
        return torch.device("cuda", rank)
    return device
