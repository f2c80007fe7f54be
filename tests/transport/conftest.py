"""Fixtures for the transport tests: a fresh run (directory and id) per test,
and a check that no test leaves shared memory behind."""

import itertools
import os

import pytest

from transport import shm

_run_ids = itertools.count()


def _our_segments() -> set[str]:
    """Segments of this test process's runs (other suites may run alongside)."""
    prefix = f"{shm.PREFIX}t{os.getpid()}x"
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test must unlink what it created (as the launcher would)."""
    before = _our_segments()
    yield
    leaked = _our_segments() - before
    for name in leaked:  # don't let one failure cascade into the next tests
        shm.unlink_segment(name)
    assert not leaked, f"test left shared memory behind: {sorted(leaked)}"


class Run:
    def __init__(self, run_dir, run_id):
        self.run_dir = run_dir
        self.run_id = run_id

    def cleanup(self) -> list[str]:
        return shm.cleanup_run(self.run_id, self.run_dir)


@pytest.fixture
def run(tmp_path):
    """A run directory and a run id unique to this test process and test."""
    return Run(tmp_path / "run", f"t{os.getpid()}x{next(_run_ids)}")
