"""The CUDA path of tensor parallelism: two ranks on two GPUs in an NCCL
group, the all-reduces captured inside the step graphs (decode and mixed),
the Triton attention and LoRA kernels on shards. Needs two GPUs."""

from __future__ import annotations

import pytest
import torch
from models.factories import make_hf_model
from tp_ranks import run_ranks
from tp_scenarios import decode_scenario

from mstar_actors.runner.parallel import SINGLE_RANK

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

VOCAB = 512


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_on_two_gpus_equals_tp1(kind, eager, tmp_path):
    make_hf_model(kind, tmp_path)
    keys = dict(device="cuda", enforce_eager=eager)
    single = decode_scenario(SINGLE_RANK, tmp_path, VOCAB, **keys)
    (rank0, _), (rank1, _) = run_ranks(on_cuda, 2, tmp_path, eager, device="cuda")
    assert rank0["outputs"] == rank1["outputs"] == single["outputs"]
    for ours, theirs, want in zip(rank0["logits"], rank1["logits"], single["logits"]):
        ours, theirs, want = map(torch.as_tensor, (ours, theirs, want))
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def on_cuda(tp, folder, eager: bool) -> dict:
    return decode_scenario(tp, folder, VOCAB, device="cuda", enforce_eager=eager)
