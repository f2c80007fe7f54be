"""An aiohttp app served on a loopback port for the length of a test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def serving(app) -> AsyncIterator[str]:
    """``async with serving(app) as base:`` -- ``base`` is ``http://127.0.0.1:PORT``."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
