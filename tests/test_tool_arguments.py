"""The benchmark tools' counts, lengths of time and folders are checked as
they are read: argparse's usage error (exit 2) naming the option, before any
server starts or any model loads; and what a run prints from figures it can
not measure says so instead of a number."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def refused(parse, argv: list[str], capsys) -> str:
    """``parse(argv)``'s usage error; its stderr."""
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.fixture()
def no_server(monkeypatch):
    """Any server or model a tool would start fails the test instead."""
    import _common

    def started(*args, **kwargs):
        pytest.fail("a server was started before the arguments were checked")
    monkeypatch.setattr(_common.Server, "__init__", started)
    monkeypatch.setattr(_common.subprocess, "Popen", started)


# ---- bench_serve --peer: its levels are bench_serve's parsed --concurrency --------------------------------


def test_the_peer_run_takes_the_parsed_concurrency_levels(tmp_path, monkeypatch):
    import _peer
    import bench_serve

    (tmp_path / "config.json").write_text("{}")
    args = bench_serve.parse_args(["--peer", "llama.cpp", "--model", str(tmp_path), "--concurrency", "1,4",
                                   "--rounds", "2"])
    assert args.concurrency == [1, 4]
    seen = {}
    monkeypatch.setattr(_peer._llama_cpp, "server_binary", lambda: None)  # nothing built
    monkeypatch.setattr(_peer, "systems", lambda model_dir, is_embedded: [])  # nothing started
    monkeypatch.setattr(_peer, "report", lambda entries, levels, figures: seen.setdefault("levels", levels) and "")
    assert _peer.run_peer(args) == 0
    assert seen["levels"] == [1, 4]


# ---- bench_structured ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--repeats", "0"), ("--num-requests", "-1"), ("--max-tokens", "-5"),
                                         ("--threads", "0")])
def test_bench_structured_counts_are_positive(flag, value, capsys, monkeypatch, no_server):
    import bench_structured

    monkeypatch.setattr(bench_structured, "model_dir_of", lambda arg: pytest.fail("went past the arguments"))
    err = refused(bench_structured.main, [flag, value], capsys)
    assert f"argument {flag}: expected a positive integer, got '{value}'" in err


# ---- quant_parity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--max-tokens", "-1"), ("--threads", "0"),
                                         ("--threads", "-1"), ("--prompts", "0")])
def test_quant_parity_counts_are_positive(flag, value, capsys, monkeypatch):
    import quant_parity

    monkeypatch.setattr(quant_parity, "model_dir_of", lambda arg: pytest.fail("the model was looked up"))
    monkeypatch.setattr(quant_parity, "make_runner", lambda *a, **k: pytest.fail("a model was loaded"))
    err = refused(quant_parity.main, [flag, value], capsys)
    assert f"argument {flag}: expected a positive integer, got '{value}'" in err


# ---- profile_step -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--steps", "-1"), ("--threads", "0"),
                                         ("--min-context", "0")])
def test_profile_step_counts_are_positive(flag, value, capsys):
    import profile_step

    err = refused(profile_step.parse_args, [flag, value], capsys)
    assert f"argument {flag}: expected a positive integer, got '{value}'" in err


def test_profile_step_refuses_a_min_context_above_the_max(capsys):
    import profile_step

    err = refused(profile_step.parse_args, ["--min-context", "100", "--max-context", "10"], capsys)
    assert "--min-context 100 is above --max-context 10" in err
    assert profile_step.parse_args(["--min-context", "10", "--max-context", "10"]).max_context == 10


# ---- bench_frontend -----------------------------------------------------------------------------------------


def test_bench_frontend_step_ms_is_not_negative(capsys, monkeypatch):
    import bench_frontend

    monkeypatch.setattr(bench_frontend, "corpus_ids", lambda folder: pytest.fail("went past the arguments"))
    monkeypatch.setattr(bench_frontend, "Rig", lambda *a, **k: pytest.fail("the frontend was started"))
    err = refused(bench_frontend.main, ["--step-ms", "-1"], capsys)
    assert "argument --step-ms: expected a non-negative number, got '-1'" in err


def _level(concurrency: int, wall_s: float, frontend_s: float):
    import bench_frontend

    level = bench_frontend.Level(concurrency)
    level.num_requests, level.num_tokens, level.num_events, level.wall_s = 48, 48 * 64, 48 * 66, wall_s
    level.cpu_s = {"frontend": frontend_s, "engine": 0.02, "clients": 0.01}
    level.frontend_system_s = frontend_s / 4
    return level


def test_a_level_too_short_to_time_cpu_prints_no_cpu_figures():
    import bench_frontend

    args = argparse.Namespace(max_tokens=64, logprobs=False, rounds=1)
    text = bench_frontend.table({1: [_level(1, 0.08, 0.3)], 64: [_level(64, 0.9, 0.03)],
                                 256: [_level(256, 2.0, 1.5)]}, args)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()}
    for c in ("1", "64"):  # too little wall time; too few of the frontend's CPU ticks
        cells = [cell.strip() for cell in rows[c].split("|")[1:-1]]
        assert cells[3:6] == ["n/a"] * 3 and cells[7:9] == ["n/a"] * 2, rows[c]
        assert cells[6] == "66.0"  # events per request: no CPU clock in it
    assert "n/a" not in rows["256"] and "| 0.488 | 25% | 75 |" in rows["256"]
    note = [line for line in text.splitlines() if line.startswith("n/a:")]
    assert len(note) == 1 and "concurrency 1, 64" in note[0] and "too short to time CPU" in note[0]
    assert "--waves" in note[0] and "--min-requests" in note[0]


# ---- bench_deltanet -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--decode", "0"), ("--decode", "-2"), ("--prefill", "0"),
                                         ("--calls", "0"), ("--repeats", "0")])
def test_bench_deltanet_row_counts_are_positive(flag, value, capsys, monkeypatch):
    import bench_deltanet

    monkeypatch.setattr(bench_deltanet, "cpu_table", lambda args: pytest.fail(f"a table was timed: {args}"))
    err = refused(bench_deltanet.main, ["--device", "cpu", flag, value], capsys)
    assert f"argument {flag}: expected a positive integer, got '{value}'" in err


# ---- bench_prepare ------------------------------------------------------------------------------------------


def test_bench_prepare_checks_the_model_before_any_server(capsys, monkeypatch, no_server):
    import bench_prepare

    monkeypatch.setattr(bench_prepare, "Report", lambda path: pytest.fail("went past the arguments"))
    err = refused(bench_prepare.main, ["--model", "/nonexistent/model"], capsys)
    assert "--model '/nonexistent/model': no config.json there" in err


def test_bench_prepare_refuses_a_model_that_takes_no_video(tmp_path, capsys, monkeypatch, no_server):
    """A text model's folder (or an embedded name) was served, and every video request then refused by it."""
    import bench_prepare

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    monkeypatch.setattr(bench_prepare, "Report", lambda path: pytest.fail("went past the arguments"))
    err = refused(bench_prepare.main, ["--model", str(tmp_path)], capsys)
    assert "its architecture (LlamaForCausalLM) takes no video" in err and "Qwen2_5_VLForConditionalGeneration" in err


@pytest.mark.parametrize("flag, value, says", [
    ("--torch-threads", "0", "expected a positive integer"), ("--video-seconds", "0", "expected a positive number"),
    ("--video-fps", "-2", "expected a positive number"), ("--audio-seconds", "nan", "expected a positive number"),
    ("--ttft-clip", "640x480x0", "the seconds must be a positive number"),
])
def test_bench_prepare_lengths_are_positive(flag, value, says, capsys, monkeypatch, no_server):
    import bench_prepare

    monkeypatch.setattr(bench_prepare, "Report", lambda path: pytest.fail("went past the arguments"))
    err = refused(bench_prepare.main, [flag, value], capsys)
    assert f"argument {flag}: " in err and says in err


# ---- the other tools' counts --------------------------------------------------------------------------------


def test_bench_lora_max_tokens_zero_is_refused_not_the_default():
    import bench_lora

    for flag in ("--max-tokens", "--client-processes"):
        with pytest.raises(SystemExit, match=f"{flag} must be at least 1, got 0"):
            bench_lora.make_plan(bench_lora.parse_args(["--dry-run", flag, "0"]))
    assert bench_lora.make_plan(bench_lora.parse_args(["--dry-run"])).max_tokens == 32


def test_profile_vl_step_fps_is_positive(capsys, monkeypatch):
    import profile_vl_step

    monkeypatch.setattr(profile_vl_step, "check_device", lambda device: pytest.fail("went past the arguments"))
    err = refused(profile_vl_step.main, ["--fps", "0"], capsys)
    assert "argument --fps: expected a positive number, got '0'" in err
