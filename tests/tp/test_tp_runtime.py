"""The tensor-parallel runtime's small parts: the one-rank group does
nothing, two gloo ranks reduce and gather, the ranks' threads on 2 cores."""

from __future__ import annotations

import os

import pytest
import torch
from tp_ranks import run_ranks

from mstar_actors.config import default_worker_threads, parse_config
from mstar_actors.runner.parallel import SINGLE_RANK, TensorParallel, pick_loopback_port, rank_device


def test_single_rank_collectives_return_their_input():
    x = torch.randn(3, 4)
    assert SINGLE_RANK.all_reduce(x) is x and SINGLE_RANK.all_gather(x) is x
    assert not SINGLE_RANK.is_parallel
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        TensorParallel(2, 2)


def collectives(tp) -> tuple[list, list]:
    x = torch.full((2, 3), float(tp.rank + 1))
    gathered = tp.all_gather(torch.arange(3.0).view(1, 3) + 10 * tp.rank)
    return tp.all_reduce(x).tolist(), gathered.tolist()


def test_two_gloo_ranks_sum_and_gather_in_rank_order():
    for (summed, gathered), _ in run_ranks(collectives, 2):
        assert summed == [[3.0] * 3] * 2
        assert gathered == [[0.0, 1.0, 2.0, 10.0, 11.0, 12.0]]


def test_two_ranks_on_two_cores_take_one_thread_each():
    assert default_worker_threads("cpu", 2, 2) == 1
    assert default_worker_threads("cpu", 16, 2) == 8
    assert default_worker_threads("cuda", 16, 2) == 1
    config = parse_config({"parallel": {"tp": 2}, "model": {"device": "cpu"}})  # settled: workers and prepare read it
    assert config.parallel.worker_torch_threads == default_worker_threads("cpu", len(os.sched_getaffinity(0)), 2)
    assert parse_config({"parallel": {"worker_torch_threads": 3}}).parallel.worker_torch_threads == 3


def test_rendezvous_port_is_free_and_cuda_ranks_get_their_device():
    assert 0 < pick_loopback_port() < 65536
    assert rank_device(torch.device("cuda"), 1, 2) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), 1, 2) == torch.device("cpu")
