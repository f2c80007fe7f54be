"""tools/check_lora_kernels.py imports and runs its CPU path here; the GPU run happens on a CUDA host."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_lora_kernels.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_lora_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_validates_every_mix_and_writes_json(tmp_path, monkeypatch, capsys):
    tool = _load_tool()
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--dry-run", "--dtype", "float32", "--linears", "o", "--tokens", "1", "8", "--mixes", "base", "one", "mixed4", "random"]
    assert tool.main(argv) == 0
    rows = json.loads((tmp_path / "lora_kernels.json").read_text())["rows"]
    assert [(r["tokens"], r["mix"]) for r in rows] == [(t, m) for t in (1, 8) for m in ("base", "one", "mixed4", "random")]
    assert all(r["error"] is None and r["kernel_us"] is not None for r in rows)
    assert {r["num_segments"] for r in rows if r["mix"] == "mixed4" and r["tokens"] == 8} == {4}
    assert "8 passed, 0 failed" in capsys.readouterr().out


def test_a_failing_config_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    tool = _load_tool()
    calls = []

    def flaky(row, *args):
        calls.append(row.mix)
        if row.mix == "one":
            raise RuntimeError("compile failed")

    monkeypatch.setattr(tool, "check_one", flaky)
    assert tool.main(["--dry-run", "--linears", "o", "--tokens", "1", "--mixes", "one", "random", "--json", str(tmp_path / "r.json")]) == 1
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert calls == ["one", "random"]
    assert rows[0]["error"] == "RuntimeError: compile failed" and rows[1]["error"] is None


def test_slot_mixes():
    tool = _load_tool()
    import random

    rng = random.Random(0)
    assert tool.slot_mix("base", 5, rng) == [0] * 5
    assert tool.slot_mix("one", 3, rng) == [1, 1, 1]
    assert set(tool.slot_mix("mixed4", 256, rng)) == {1, 2, 3, 4}
    assert len(tool.slot_mix("random", 2048, rng)) == 2048
