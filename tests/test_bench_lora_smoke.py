"""tools/bench_lora.py run as a user runs it: its argument checks, the dry
run (the plan, and a tiny model of Llama-3.2-1B's architecture whose
adapters pass the launcher's own checks), and a live smoke run of every
scenario on a tiny model, three servers at concurrency 1, with the final table."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "bench_lora.py"
SCENARIOS = ("lora off", "base, lora on", "one adapter", "mixed 4 adapters", "churn 3 over 2 slots")


def run_bench(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python tools/bench_lora.py ARGV`` from the repository root."""
    return subprocess.run([sys.executable, str(TOOL), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory) -> Path:
    """The actor tests' tiny random Llama and its tokenizer."""
    spec = importlib.util.spec_from_file_location("actors_test_kit", ROOT / "tests" / "actors" / "conftest.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    folder = tmp_path_factory.mktemp("bench-lora") / "kit"
    kit.make_model_dir(folder)
    return folder


# ---- arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency '1,x'"),
    (["--concurrency", "0,8"], "--concurrency must be at least 1"),
    (["--rank", "0"], "--rank must be at least 1"),
    (["--model", "no-such-setup"], "expected smollm2, llama-3.2-1b-random, llama-3.1-8b-random, qwen3.5-0.8b-random, or a folder"),
])
def test_bad_arguments_say_what_is_accepted(argv, message):
    run = run_bench(*argv)
    assert run.returncode != 0 and message in run.stderr


def test_cuda_without_a_device_points_at_dry_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    run = run_bench("--model", "llama-3.2-1b-random")
    assert run.returncode != 0 and "--dry-run" in run.stderr


# ---- dry run ------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_checks_a_tiny_random_llama(kit_model):
    run = run_bench("--model", "llama-3.2-1b-random", "--dry-run", "--tokenizer", str(kit_model), "--waves", "2",
                    "--min-requests", "3", "--rank", "4")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "setup llama-3.2-1b-random on cuda (bfloat16)" in out and "64 new tokens per request" in out
    assert "c=1: 3 requests, c=8: 16 requests, c=32: 64 requests" in out
    assert "server off  : no lora section" in out and "server churn: max_loras 2, adapters lora0, lora1, lora2" in out
    assert "server unmerged: max_loras 4, adapters lora0, lora1, lora2, lora3, merge_after_steps 0; " \
           "scenarios: one adapter unmerged" in out  # the LoRA kernels' cost beside the merged steps (CUDA)
    # Llama-3.2-1B's published shape, with SmolLM2's vocabulary.
    assert "16 layers, hidden 2048, intermediate 8192, heads 32/8, vocab 49152" in out
    assert "rope llama3, tied embeddings" in out
    assert 1.0 < float(re.search(r"~(\d\.\d\d)B parameters", out)[1]) < 1.1
    # Each server's config through the real parser, its adapters through the launcher's checks.
    assert "tiny check: server off config valid, adapters none" in out
    assert "tiny check: server on config valid, adapters ['lora0', 'lora1', 'lora2', 'lora3']" in out
    assert "tiny check: server churn config valid, adapters ['lora0', 'lora1', 'lora2']" in out


def test_smoke_shrinks_the_plan(kit_model):
    run = run_bench("--model", "llama-3.2-1b-random", "--dry-run", "--smoke", "--tokenizer", str(kit_model))
    assert run.returncode == 0, run.stderr
    assert "4 new tokens per request" in run.stdout and "per scenario and round c=1: 2 requests;" in run.stdout


# ---- a live run ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_run_measures_every_scenario_and_makes_adapters_once(kit_model, tmp_path):
    from safetensors.torch import load_file

    cache, output = tmp_path / "cache", tmp_path / "table.txt"
    run = run_bench("--smoke", "--model", str(kit_model), "--cache-dir", str(cache), "--rank", "4",
                    "--output", str(output), timeout=800)
    assert run.returncode == 0, run.stderr[-3000:]
    table = output.read_text()
    assert table.strip() in run.stdout
    for name in SCENARIOS:  # 2 requests of exactly 4 tokens each
        assert re.search(rf"^{re.escape(name)} +1 +2 +8 ", table, re.M), name
    assert re.search(r"^lora off .* 100\.0% ", table, re.M)
    assert re.search(r"concurrency +1: p50 \d+ ms vs \d+ ms \(\d+\.\d\dx\), p90", table)
    assert "NOT measured here" in table and "68-90%" in table and "68-84%" in table
    assert re.search(r"one adapter +c=1 +ours +\d+\.\d%: vLLM 68\.2% \((above|NOT above)\), SGLang 68\.1%", table)

    # The adapters: random, on every linear of the decoder, each its own weights.
    [folder] = (cache / "adapters").iterdir()
    tensors = load_file(folder / "lora0" / "adapter_model.safetensors")
    targets = {k.split(".")[-3] for k in tensors if "lora_B" in k}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)
    other = load_file(folder / "lora1" / "adapter_model.safetensors")
    assert any(not other[k].equal(t) for k, t in tensors.items())

    again = run_bench("--smoke", "--model", str(kit_model), "--cache-dir", str(cache), "--rank", "4",
                      "--scenarios", "one adapter")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "making adapters" in run.stderr and "making adapters" not in again.stderr
    assert re.search(r"^one adapter +1 +2 +8 ", again.stdout, re.M)
    assert not re.search(r"^mixed 4 adapters +1 ", again.stdout, re.M)  # only the scenarios asked for


def test_dry_run_of_the_8b_shape(kit_model):
    run = run_bench("--model", "llama-3.1-8b-random", "--dry-run", "--tokenizer", str(kit_model), "--concurrency", "1")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    # Llama-3.1-8B's published shape (untied head), with SmolLM2's vocabulary.
    assert "32 layers, hidden 4096, intermediate 14336, heads 32/8, vocab 49152" in out
    assert "rope llama3, untied head" in out
    assert 7.3 < float(re.search(r"~(\d\.\d\d)B parameters", out)[1]) < 7.5
    assert "tiny check: server churn config valid" in out
