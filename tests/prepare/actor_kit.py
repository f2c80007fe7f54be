"""The prepare actor running on in-memory channels, for tests that send it
requests and read what it hands the conductor."""

from __future__ import annotations

import asyncio
import contextlib

from actors.prepare import PrepareActor
from mstar_actors.config import Config
from mstar_actors.messages import FrontendToPrepare, PrepareToConductor, Shutdown
from transport.memory import MemoryChannel


@contextlib.asynccontextmanager
async def running_prepare_actor(preparer, *, config: Config | None = None, arena=None, num_workers: int = 2,
                                inbox_bytes: int = 1 << 20):
    """Yields (the frontend's channel in, the conductor's channel out); on
    leaving, a ``Shutdown`` and the actor's clean exit."""
    inbox = MemoryChannel(FrontendToPrepare, "frontend.prepare", capacity_bytes=inbox_bytes)
    out = MemoryChannel(PrepareToConductor, "prepare.conductor")
    actor = PrepareActor(name="prepare", config=config or Config(), inbox={"frontend": inbox}, outbox={"conductor": out},
                         preparer=preparer, arena=arena, num_workers=num_workers)
    task = asyncio.create_task(actor.run())
    yield inbox, out
    await inbox.send(Shutdown(reason="test"))
    assert await task == 0
