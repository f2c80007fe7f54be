"""A rank compiles grammars a few at a time beside its steps; a compile whose
request ended before its turn is dropped (a client sending slow schemas and
hanging up held every later constrained request behind the compiles of the
departed), one already on its thread runs out and answers."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from types import SimpleNamespace

from actors.worker import MAX_COMPILES, WorkerActor
from mstar_actors.messages import CancelCompile, CompileGrammar, StructuredSpec


def test_a_cancelled_compile_still_waiting_for_its_turn_is_dropped():
    release, compiled = threading.Event(), []

    class Compiler:
        def compile(self, spec):
            release.wait(10)
            compiled.append(spec.spec)

    async def body():
        replies = []

        async def reply(msg):
            replies.append(msg.request_id)

        rank = SimpleNamespace(runner=SimpleNamespace(grammars=SimpleNamespace(compiler=Compiler())), rank=0,
                               log=logging.getLogger("test"), reply=reply, name="worker0", _compiles={},
                               _compile_slots=asyncio.Semaphore(MAX_COMPILES), _compiling_now=set())
        rank.run_blocking = functools.partial(WorkerActor.run_blocking, rank)
        rank._compile = functools.partial(WorkerActor._compile, rank)
        names = [f"r{i}" for i in range(MAX_COMPILES + 2)]
        for rid in names:
            await WorkerActor.handle(rank, "conductor", CompileGrammar(rid, StructuredSpec("regex", rid)))
        while len(rank._compiling_now) < MAX_COMPILES:  # the first ones take the slots, on their threads
            await asyncio.sleep(0.01)
        for rid in (names[0], names[-1]):  # one compiling, one waiting
            await WorkerActor.handle(rank, "conductor", CancelCompile(rid))
        release.set()
        while rank._compiles:
            await asyncio.sleep(0.01)
        return replies

    replies = asyncio.run(body())
    assert sorted(replies) == ["r0", "r1", "r2"] and sorted(compiled) == ["r0", "r1", "r2"]  # r3 never compiled
