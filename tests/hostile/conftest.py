"""Hostile-input test kit: the frontend harness of tests/frontend, an engine
that also answers runtime adapter updates, and raw-socket helpers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.frontend.conftest import Engine, Harness, model_dir, tokenizer  # noqa: F401


def run(fn, timeout: float = 15) -> None:
    asyncio.run(asyncio.wait_for(fn(), timeout))


class AdapterEngine(Engine):
    """The frontend tests' engine, plus vLLM-style answers to runtime adapter updates: a
    load of a path ending in ``/ok`` succeeds, anything else is a 404."""

    async def run(self) -> None:
        from mstar_actors.messages import AdapterUpdate, LoadAdapter, UnloadAdapter

        async for msg in self.inbox:
            match msg:
                case LoadAdapter() if msg.path.endswith("/ok"):
                    message = f"Success: LoRA adapter '{msg.name}' added successfully."
                    await self.outbox.send(AdapterUpdate(request_id=msg.request_id, status=200, message=message))
                case LoadAdapter() | UnloadAdapter():
                    await self.outbox.send(AdapterUpdate(request_id=msg.request_id, status=404,
                                                         message=f"no adapter {msg.name!r}"))
                case _:
                    await self._one(msg)
            self.changed.set()

    async def _one(self, msg: Any) -> None:
        from mstar_actors.messages import Abort, NewRequest

        match msg:
            case NewRequest():
                self.requests[msg.request_id] = msg
                for out in self.plan(msg) or []:
                    await self.outbox.send(out)
            case Abort():
                self.aborts.append(msg.request_id)


def make_harness(model_dir, tokenizer, adapter_dir: str | None = None, **server: Any) -> Harness:
    """A harness whose config takes runtime adapter updates inside ``adapter_dir``."""
    from mstar_actors.config import parse_config

    h = Harness(model_dir, tokenizer)
    lora = {"adapters": {"tiny-lora": str(model_dir)}}
    if adapter_dir:
        lora |= {"allow_runtime_updates": True, "adapter_dirs": [adapter_dir]}
    h.config = parse_config({"model": {"path": str(model_dir), "name": "tiny"},
                             "server": {"port": 0} | server, "lora": lora})
    h.engine = AdapterEngine(tokenizer, h.prepare, h.conductor, max_model_len=h.info.max_model_len)
    return h


@pytest.fixture
def hostile(model_dir, tokenizer, tmp_path):
    """A factory: ``async with hostile(**server_overrides) as h:`` with runtime
    adapter updates allowed inside ``tmp_path``."""
    return lambda **kw: make_harness(model_dir, tokenizer, str(tmp_path), **kw)
