"""tools/check_lora_kernels.py run as a user runs it, on its CPU path (the GPU run happens on a CUDA host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_lora_kernels.py"


def run_tool(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python tools/check_lora_kernels.py ARGV`` from the repository root."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, str(TOOL), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_dry_run_validates_every_mix_and_writes_json(tmp_path):
    out = tmp_path / "lora_kernels.json"
    run = run_tool("--dry-run", "--dtype", "float32", "--linears", "o", "--tokens", "1", "8",
                   "--mixes", "base", "one", "mixed4", "random", "--output", str(out))
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["mix"]) for r in rows] == [(t, m) for t in (1, 8) for m in ("base", "one", "mixed4", "random")]
    assert all(r["error"] is None and r["kernel_us"] is not None for r in rows)
    # The slot mixes: no adapter, one adapter, 4 adapters in turn, random slots (of 8 and the base).
    segments = {r["mix"]: r["num_segments"] for r in rows if r["tokens"] == 8}
    assert (segments["base"], segments["one"], segments["mixed4"]) == (0, 1, 4) and 1 <= segments["random"] <= 8
    assert "8 passed, 0 failed" in run.stdout


def test_a_failing_config_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A config that fails (here its check raises) fails in its own row; the later ones still run. (A count of 0
    is no such config: the parser refuses it, naming the flag.)"""
    monkeypatch.syspath_prepend(str(TOOL.parent))
    import check_lora_kernels as tool

    check = tool.check_one

    def failing_first(row, *args):
        if row.tokens == 2:
            raise ZeroDivisionError("a row that cannot run")
        return check(row, *args)

    monkeypatch.setattr(tool, "check_one", failing_first)
    out = tmp_path / "r.json"
    code = tool.main(["--dry-run", "--linears", "o", "--tokens", "2", "1", "--mixes", "one", "--output", str(out)])
    assert code == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [2, 1]
    assert rows[0]["error"].startswith("ZeroDivisionError") and rows[1]["error"] is None
    assert "1 passed, 1 failed" in capsys.readouterr().out
    assert run_tool("--dry-run", "--tokens", "0").returncode == 2


def test_fold_table_dry_run_checks_each_rows_result_without_its_neighbours(tmp_path):
    """``--fold-table`` on its CPU path: the gate|up, in_proj and norm folds at 16 and
    37 rows, one adapter and 4 (interleaved, grouped), each row's result the same, outputs and
    in-place writes, with the rows reversed; in_proj's not folded past
    ``CONV_FOLD_MAX_ROWS``."""
    from mstar_actors.models.deltanet_decode import CONV_FOLD_MAX_ROWS

    out = tmp_path / "folds.json"
    run = run_tool("--fold-table", "--dry-run", "--output", str(out))
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["rows"], r["mix"]) for r in rows] == [
        (op, n, mix) for n in (16, 37) for mix in ("one", "mixed4", "grouped4") for op in ("gate_up", "in_proj", "norm")]
    assert all(r["alone_us"] is None and r["split_us"] is None and r["folded_us"] is None for r in rows)  # no timing
    assert [r["folds"] for r in rows] == [r["op"] != "in_proj" or r["rows"] <= CONV_FOLD_MAX_ROWS for r in rows]
    assert "# 0 folds gave a row another result" in run.stdout
