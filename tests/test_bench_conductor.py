"""``tools/bench_conductor.py`` as a user runs it: a table row per row count, the conductor's turn and the
scheduler's, both positive, on small sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_conductor_prints_a_row_per_size():
    out = subprocess.run([sys.executable, "tools/bench_conductor.py", "--rows", "4", "16", "--frontends", "2",
                          "--max-tokens", "8", "--steps-ahead", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line and not line.startswith(("#", " rows"))]
    assert [int(r[0]) for r in rows] == [4, 16], out
    for _, turn, alone, ratio in rows:
        assert float(turn) > 0 and float(alone) > 0 and ratio.endswith("x"), out
