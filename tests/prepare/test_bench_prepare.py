"""tools/bench_prepare.py and tools/profile_vl_step.py run as a user runs
them, on small clips: the throughput table through the prepare actor and a
bare thread pool, time to first token of two served engines (pool against
one worker) timed from the client, and the clip arguments' checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL_CLIP = ["--video-seconds", "1", "--video-size", "64x48", "--ttft-clip", "none"]
NUMBER = r"\d+(\.\d+)?"


def run_tool(name: str, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python tools/NAME ARGV`` from the repository root."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_throughput_table_through_the_actor_and_a_plain_pool(tmp_path):
    output = tmp_path / "prepare.md"
    run = run_tool("bench_prepare.py", "--requests", "5", "--workers", "1", "2", "--throughput-rounds", "2",
                   "--ttft-rounds", "0", *SMALL_CLIP, "--audio-seconds", "1", "--output", str(output))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "video 64x48 1 s sampled at 2 fps (2 frames)" in run.stdout
    for media in ("image", "video 64x48 1 s", "audio wav 1 s", "audio mp3 1 s"):
        for pool in ("actor", "plain"):
            # Every cell measured; 1 worker is each pool's own reference.
            one = rf"\| {media} \| {pool} \| 1 \| 5 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| \d+% \| \d+% \| "
            assert re.search(one + r"1\.00x \(1\.00-1\.00\) \| 1\.00x \|", run.stdout), (media, pool)
            two = rf"\| {media} \| {pool} \| 2 \| 5 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| \d+% \| \d+% \| "
            assert re.search(two + rf"{NUMBER}x \({NUMBER}-{NUMBER}\) \| {NUMBER}x \|", run.stdout), (media, pool)
    assert "TTFT" not in run.stdout  # --ttft-rounds 0
    assert output.read_text() == run.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ttft_of_the_pool_against_one_worker_from_the_client():
    run = run_tool("bench_prepare.py", "--ttft-only", "--ttft-rounds", "2", *SMALL_CLIP, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "media | pool | workers" not in out  # --ttft-only
    # 2 bursts of 4 per server; the closed loop twice per server, one counted request per client each time.
    assert "8 requests per mode in bursts of 4 sent at once, 8 in a closed loop of 4 clients" in out
    assert re.search(rf"\| pool \(4 workers\) \| \d+ \| \d+ \| {NUMBER} \|", out)
    assert re.search(rf"\| one worker \(1\) \| \d+ \| \d+ \| {NUMBER} \|", out)
    assert re.search(rf"\| one / pool \| {NUMBER}x \| {NUMBER}x \| {NUMBER}x \|", out)
    for row in ("pool, bursts", "pool, closed loop", "one worker, bursts", "one worker, closed loop"):
        assert re.search(rf"\| {row} \| \d+ \| \d+ \| \d+ \|", out), row
    assert re.search(rf"\| 64x48 1 s \(2 frames\) \| {NUMBER}x \| {NUMBER}x \|", out)


@pytest.mark.parametrize("argv, message", [
    (["--ttft-clip", "640x480"], "expected WIDTHxHEIGHTxSECONDS"),
    (["--ttft-extra-clip", "640x480xlong"], "expected WIDTHxHEIGHTxSECONDS"),
    (["--video-size", "15x16"], "width and height must be even and at least 16"),
    (["--video-size", "320"], "expected WIDTHxHEIGHT"),
])
def test_clip_arguments_say_what_is_accepted(argv, message):
    run = run_tool("bench_prepare.py", *argv)
    assert run.returncode == 2 and message in run.stderr


def test_profile_vl_step_runs_a_small_clip():
    run = run_tool("profile_vl_step.py", "--device", "cpu", "--clip", "112x112x1", "--requests", "2", "--repeats", "1",
                   "--no-profiler")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "| vision tower (whole) |" in out and "| text layers |" in out and "whole step, no stage syncs" in out
