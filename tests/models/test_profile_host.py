"""``tools/profile_gpu_step.py``'s host profile on a CPU runner's static
path: the worker's overlapped order times its three parts, profiles them,
and leaves no sequence behind."""

from __future__ import annotations

import sys
from pathlib import Path

import runner_factories

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import profile_gpu_step  # noqa: E402


def test_host_profile_times_forward_collect_and_sample(hf_models):
    folder, _ = hf_models("llama")
    runner = runner_factories.make_runner(folder, dtype="float32", device="cpu", block_size=16, num_blocks=64 * 4 + 8,
                                          seed=0, enforce_eager=True, max_num_seqs=4)
    runner.enable_step_graphs(4, capture=False)
    report = profile_gpu_step.profile_host(runner, 4, 3, 1.0)
    head, profile = report.split("\n", 1)
    assert head.startswith("# host ms a step (median of 3): forward ") and ", collect " in head and ", sample " in head
    assert "function calls" in profile and "Ordered by: cumulative time" in profile and "tottime" in profile
    assert not runner.seqs


def test_overlapped_steps_are_timed_and_leave_no_sequence(hf_models):
    folder, _ = hf_models("llama")
    runner = runner_factories.make_runner(folder, dtype="float32", device="cpu", block_size=16, num_blocks=64 * 4 + 8,
                                          seed=0, enforce_eager=True, max_num_seqs=4)
    runner.enable_step_graphs(4, capture=False)
    decoder = profile_gpu_step.Decoder(runner, [0] * 3, "t")
    loop = profile_gpu_step.Overlapped(runner, decoder)
    parts: dict = {}
    assert loop.steps(4, parts) > 0
    assert sorted(parts) == ["collect", "forward", "sample"] and all(len(t) == 4 for t in parts.values())
    # the prefill's token and 4 steps' collected, one step still on the device
    assert all(len(runner.seqs[rid].output_token_ids) == 5 and runner.seqs[rid].pending >= 0 for rid in decoder.rids)
    loop.close()
    assert profile_gpu_step.time_overlapped(runner, [0] * 2, "u", 2) > 0
    assert not runner.seqs
