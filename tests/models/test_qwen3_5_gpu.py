"""Qwen3.5 on CUDA: the Triton DeltaNet ops inside the runner, decode steps
replayed from CUDA graphs against the same runner run eagerly, and both
against transformers on the same random weights (float32)."""

from __future__ import annotations

import functools

import pytest
import torch

import runner_factories
from mstar_actors import messages
from plan_driver import PlanDriver

from .hybrid_factories import VOCAB, generate, make_qwen3_5

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_NEW = 12
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
Driver = functools.partial(PlanDriver, block_size=4, num_new=NUM_NEW, sampling=GREEDY)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_gpu")
    return folder, make_qwen3_5(folder)


def run(folder, **overrides) -> tuple[dict[str, list[int]], object]:
    runner = runner_factories.make_runner(folder, **(dict(dtype="float32", device="cuda", block_size=4, num_blocks=96,
                                                          max_num_seqs=6, cuda_graph_max_batch=4) | overrides))
    gen = torch.Generator().manual_seed(7)
    prompts = {rid: torch.randint(2, VOCAB, (n,), generator=gen).tolist() for rid, n in [("a", 37), ("b", 9), ("c", 1)]}
    d = Driver(runner)
    d.step([d.start(rid, p) for rid, p in prompts.items()], [d.chunk("a", 20), d.chunk("b"), d.chunk("c")])
    d.step([], [d.chunk("a"), *d.decodes("b", "c")])
    return d.run_to_end(), runner, prompts


def test_graphed_decode_equals_eager_and_transformers(world):
    folder, hf = world
    graphed, runner, prompts = run(folder)
    assert runner.graphs is not None and runner.graphs.is_captured
    assert type(runner.model.model.layers[0].linear_attn.ops).__name__ == "TritonDeltaNetOps"
    eager, _, _ = run(folder, enforce_eager=True)
    assert graphed == eager
    # On the GPU: where flash-linear-attention imports, transformers runs its kernels, which take CUDA tensors only.
    hf = hf.to("cuda")
    for rid, prompt in prompts.items():
        assert graphed[rid] == generate(hf, prompt, NUM_NEW), rid


def test_bfloat16_serves_close_to_float32(world):
    folder, _ = world
    half, _, _ = run(folder, dtype="bfloat16")
    full, _, _ = run(folder)
    same = sum(x == y for rid in full for x, y in zip(half[rid], full[rid]))
    assert same >= 0.6 * sum(len(v) for v in full.values())


def test_graphed_mixed_steps_equal_eager_and_transformers(world):
    """Steps with prefill chunks from the mixed-step graphs: a prompt of
    several 64-token chunks in one step beside decodes, a chunk continuing
    a state, and a one-token prompt, against eager steps and transformers."""
    folder, hf = world
    gen = torch.Generator().manual_seed(11)
    prompts = {rid: torch.randint(2, VOCAB, (n,), generator=gen).tolist() for rid, n in [("a", 150), ("b", 5), ("c", 1)]}

    def serve(**overrides):
        runner = runner_factories.make_runner(folder, **(dict(dtype="float32", device="cuda", block_size=4, num_blocks=96,
                                                              max_num_seqs=6, cuda_graph_max_batch=4) | overrides))
        d = Driver(runner)
        d.step([d.start("b", prompts["b"]), d.start("c", prompts["c"])], [d.chunk("b"), d.chunk("c")])
        d.step([d.start("a", prompts["a"])], [d.chunk("a", 130), *d.decodes("b", "c")])
        d.step([], [d.chunk("a"), *d.decodes("b", "c")])
        return d.run_to_end(), runner

    graphed, runner = serve()
    assert runner.mixed_graphs is not None and runner.mixed_graphs.is_captured
    eager, _ = serve(enforce_eager=True)
    assert graphed == eager
    hf = hf.to("cuda")
    for rid, prompt in prompts.items():
        assert graphed[rid] == generate(hf, prompt, NUM_NEW), rid
