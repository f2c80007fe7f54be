"""``tools/sim_churn.py`` as a module, for the churn tests (tools/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_sim_churn():
    if "sim_churn" in sys.modules:
        return sys.modules["sim_churn"]
    spec = importlib.util.spec_from_file_location("sim_churn", ROOT / "tools" / "sim_churn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_churn"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
