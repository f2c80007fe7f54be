"""tools/bench_lora.py's client pool and plan: the processes of a level begin
together, once every one is ready, and a process that fails before it is
ready stops the level with its reason (no wait for a start that never comes);
the arguments' checks; the scenarios' order, rotated a level."""

from __future__ import annotations

import importlib.util
import queue
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench_lora():
    spec = importlib.util.spec_from_file_location("bench_lora_under_test", ROOT / "tools" / "bench_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # puts tools/ on sys.path for its neighbours
        yield module
    finally:
        sys.path[:] = path
        del sys.modules[spec.name]


def pool(bench_lora, *messages):
    """A ClientPool's start-up state with no processes: ``messages`` already on its ready queue."""
    clients = object.__new__(bench_lora.ClientPool)
    clients.ready, clients.go = queue.Queue(), threading.Event()
    for message in messages:
        clients.ready.put(message)
    return clients


def test_the_level_begins_once_every_process_is_ready(bench_lora):
    clients = pool(bench_lora, True)
    waiting = threading.Thread(target=clients._start_together, args=(2,))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and not clients.go.is_set()  # one of two ready: no start yet
    clients.ready.put(True)
    waiting.join(5)
    assert not waiting.is_alive() and clients.go.is_set()


def test_a_process_that_failed_before_it_was_ready_stops_the_level(bench_lora):
    clients = pool(bench_lora, True, "a client process failed: ConnectionRefusedError()")
    with pytest.raises(SystemExit, match="ConnectionRefusedError"):
        clients._start_together(2)
    assert not clients.go.is_set()


def test_a_process_never_ready_is_named_after_the_timeout(bench_lora, monkeypatch):
    monkeypatch.setattr(bench_lora, "READY_TIMEOUT_S", 0.05)
    with pytest.raises(SystemExit, match="not ready within"):
        pool(bench_lora)._start_together(1)


def test_scenarios_named_with_a_comma_parse_whole(bench_lora):
    """``--scenarios "lora off,base, lora on"``: "base, lora on" is one name, not two unknown ones."""
    parse_scenarios = bench_lora.parse_scenarios
    assert parse_scenarios("lora off,base, lora on,churn 3 over 2 slots") == ["lora off", "base, lora on",
                                                                             "churn 3 over 2 slots"]
    assert parse_scenarios(" one adapter ") == ["one adapter"]
    with pytest.raises(SystemExit, match="unknown \\['base'\\]"):
        parse_scenarios("base,one adapter")


def test_steps_ahead_needs_overlapped_scheduling(bench_lora):
    """``--steps-ahead 2`` with overlapped scheduling off is refused with the fix."""
    with pytest.raises(SystemExit, match="--async-scheduling on"):
        bench_lora.make_plan(bench_lora.parse_args(["--device", "cpu", "--steps-ahead", "2", "--async-scheduling",
                                                    "off"]))
    for extra in ([], ["--async-scheduling", "on"]):  # on by default
        plan = bench_lora.make_plan(bench_lora.parse_args(["--device", "cpu", "--steps-ahead", "2", *extra]))
        assert plan.steps_ahead == 2 and "2 steps ahead" in plan.describe()[0]


def test_each_level_rotates_the_scenarios_order(bench_lora):
    """Over as many levels as scenarios, each scenario is measured once in each
    position: none is always first after a level change."""
    scenarios = tuple(bench_lora.SCENARIOS)
    orders = [bench_lora.scenario_order(scenarios, turn) for turn in range(len(scenarios))]
    for order in orders:
        assert sorted(s.name for s in order) == sorted(s.name for s in scenarios)
    for position in range(len(scenarios)):
        assert {order[position].name for order in orders} == {s.name for s in scenarios}
    assert bench_lora.scenario_order(scenarios, len(scenarios)) == scenarios


def test_rounds_add_up_and_each_rounds_retention_is_listed(bench_lora):
    """Rounds sum into the table's row; each round's retention is its tokens/s over the same round's
    LoRA off at that level (no list for one round)."""
    results = {}
    for scenario, walls in (("lora off", (1.0, 2.0)), ("one adapter", (1.25, 2.0))):
        for wall in walls:
            bench_lora.add_up(results, bench_lora.Measurement(scenario, 8, 4, 100, wall, [0.01]))
    rows = sorted(results.values(), key=lambda m: m.scenario != "lora off")
    assert rows[1].num_tokens == 200 and rows[1].wall_s == 3.25
    assert bench_lora.round_lines(rows) == ["retention round by round:",
                                            "  one adapter            c=8    80.0 / 100.0%"]
    one = {}
    for scenario in ("lora off", "one adapter"):
        bench_lora.add_up(one, bench_lora.Measurement(scenario, 8, 4, 100, 1.0, [0.01]))
    assert bench_lora.round_lines(list(one.values())) == []
