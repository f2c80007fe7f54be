"""Runners for tests, built as a worker builds one: ``build_runner`` from a
validated config and the model's facts.

``make_runner(folder, block_size=4, max_loras=3, ...)`` takes config keys
by their own names; each goes to the one section that declares it
(``block_size`` to ``kv``, ``max_loras`` to ``lora``, ...). Naming a LoRA
key turns runtime adapter loads on, so the runner has stacks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mstar_actors.config import Config, parse_config
from mstar_actors.model_info import load_model_info
from mstar_actors.runner.build import build_runner
from mstar_actors.runner.model_runner import ModelRunner


def _sections() -> dict[str, str]:
    """Config key -> the section that declares it (a key in two would be ambiguous)."""
    owner: dict[str, str] = {}
    for section in msgspec.structs.fields(Config):
        for key in msgspec.structs.fields(section.type):
            assert key.name not in owner, f"config key {key.name!r} is in {owner[key.name]} and {section.name}"
            owner[key.name] = section.name
    return owner


SECTIONS = _sections()


def runner_config(folder: Any = None, **keys: Any) -> Config:
    """A validated config serving ``folder`` with ``keys`` set where they belong."""
    data: dict[str, dict[str, Any]] = {"model": {"path": str(folder)}} if folder is not None else {}
    for key, value in keys.items():
        data.setdefault(SECTIONS[key], {})[key] = value
    if "lora" in data:
        data["lora"].setdefault("allow_runtime_updates", True)
    return parse_config(data)


def make_runner(folder: Any, *, sampler: Any = None, resolve_tensor: Any = None, tp: Any = None,
                **keys: Any) -> ModelRunner:
    """``tp``: the rank's ``TensorParallel`` (its shard is built), else one rank."""
    config = runner_config(folder, **keys)
    extra = {} if sampler is None else {"sampler": sampler}
    if tp is not None:
        extra["tp"] = tp
    return build_runner(config, load_model_info(config), resolve_tensor, **extra)


def record_draws(graphs: Any) -> list[bool]:
    """Wrap a runner's step graphs (``DecodeGraphs`` or ``MixedGraphs``); the
    returned list gets, for each of their steps, whether the graph drew its tokens."""
    drawn: list[bool] = []
    run = graphs.run

    def counted(batch, race, base_seed):
        drawn.append(race is not None)
        return run(batch, race, base_seed)

    graphs.run = counted
    return drawn


def check_graph_draws(script: Any, want: Any, runner: ModelRunner, graphs: Any, samplings: dict) -> None:
    """``script`` on ``runner`` with ``samplings`` gives ``want`` (another
    runner's outputs, drawn after its steps), ``graphs`` (the runner's decode
    or mixed-step graphs) drawing some of its steps and not others."""
    assert graphs.draws
    drawn = record_draws(graphs)
    assert script(runner, samplings=samplings) == want
    assert any(drawn) and not all(drawn)
