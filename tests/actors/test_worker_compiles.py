"""A rank compiles grammars a few at a time beside its steps. A compile whose request ended gives its slot to the
next at once, begun or not (a client sending slow schemas and hanging up held every later constrained request
behind the compiles of the departed); one not done within ``scheduler.grammar_compile_timeout_s`` is refused with
the reason and runs out on its thread without its slot."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from types import SimpleNamespace

from actors.worker import COMPILE_THREAD_WAIT_S, MAX_COMPILE_THREADS, MAX_COMPILES, WorkerActor
from mstar_actors.messages import CancelCompile, CompileGrammar, StructuredSpec


class _Compiler:
    """Compiles a spec at once, or one named ``slow*`` once released."""

    def __init__(self):
        self.release, self.compiled = threading.Event(), []

    def compile(self, spec):
        if spec.spec.startswith("slow"):
            self.release.wait(20)
        self.compiled.append(spec.spec)


def _rank(compiler, timeout_s: float = 30.0):
    replies = []

    async def reply(msg):
        replies.append((msg.request_id, msg.ok, msg.error))

    rank = SimpleNamespace(runner=SimpleNamespace(grammars=SimpleNamespace(compiler=compiler)), rank=0,
                           log=logging.getLogger("test"), reply=reply, name="worker0", _compiles={},
                           _compile_slots=asyncio.Semaphore(MAX_COMPILES),
                           _compile_threads=asyncio.Semaphore(MAX_COMPILE_THREADS),
                           config=SimpleNamespace(scheduler=SimpleNamespace(grammar_compile_timeout_s=timeout_s)))
    for name in ("start_blocking", "_compile", "_compile_ended"):
        setattr(rank, name, functools.partial(getattr(WorkerActor, name), rank))
    return rank, replies


async def _send(rank, msg):
    await WorkerActor.handle(rank, "conductor", msg)


async def _until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_a_cancelled_compile_gives_its_slot_to_the_next_at_once():
    compiler = _Compiler()

    async def body():
        rank, replies = _rank(compiler)
        slow = [f"slow{i}" for i in range(MAX_COMPILES)]
        for rid in slow + ["fast", "dropped"]:
            await _send(rank, CompileGrammar(rid, StructuredSpec("regex", rid)))
        await asyncio.sleep(0.2)
        assert replies == []  # the slow ones hold every slot
        await _send(rank, CancelCompile("dropped"))  # waiting: never compiled
        await _send(rank, CancelCompile(slow[0]))  # compiling: its slot goes, its thread runs out
        await _until(lambda: replies)
        assert replies == [("fast", True, "")]
        compiler.release.set()
        await _until(lambda: not rank._compiles and len(compiler.compiled) == MAX_COMPILES + 1)
        return replies

    replies = asyncio.run(body())
    assert sorted(r[0] for r in replies) == sorted(["fast"] + [f"slow{i}" for i in range(1, MAX_COMPILES)])
    assert "dropped" not in compiler.compiled


def test_a_compile_past_its_time_is_refused_naming_the_setting_and_holds_no_slot():
    compiler = _Compiler()

    async def body():
        rank, replies = _rank(compiler, timeout_s=0.3)
        for rid in [f"slow{i}" for i in range(MAX_COMPILES)] + ["fast"]:
            await _send(rank, CompileGrammar(rid, StructuredSpec("regex", rid)))
        await _until(lambda: len(replies) == MAX_COMPILES + 1)
        compiler.release.set()
        await _until(lambda: len(compiler.compiled) == MAX_COMPILES + 1)
        await asyncio.sleep(0.05)
        assert rank._compile_threads._value == MAX_COMPILE_THREADS  # every thread ended and gave its place back
        return replies

    replies = asyncio.run(body())
    # every reply came before the slow compiles were let end: fast's slot was a timed-out one's, given at the time
    # (its reply and the last slow ones' timeouts may come in either order)
    assert [r for r in replies if r[0] == "fast"] == [("fast", True, "")]
    for rid, ok, error in (r for r in replies if r[0] != "fast"):
        assert rid.startswith("slow") and not ok and "scheduler.grammar_compile_timeout_s" in error


def test_with_every_thread_held_by_left_compiles_a_request_is_told_the_rank_is_busy():
    """Compiles left to run out on every thread: the next request is answered busy at once (a 503 to retry, its
    input not at fault: a cheap grammar is never blamed for others' slow ones, nor held for minutes behind them);
    once a thread is free, requests compile again."""
    compiler = _Compiler()

    async def body():
        rank, replies = _rank(compiler, timeout_s=0.2)
        slow = [f"slow{i}" for i in range(MAX_COMPILE_THREADS)]
        for rid in slow:
            await _send(rank, CompileGrammar(rid, StructuredSpec("regex", rid)))
        await _until(lambda: len(replies) == len(slow))  # each timed out; every thread still busy
        started = time.monotonic()
        await _send(rank, CompileGrammar("cheap", StructuredSpec("regex", "cheap")))
        await _until(lambda: len(replies) == len(slow) + 1)
        waited = time.monotonic() - started
        compiler.release.set()
        await _until(lambda: rank._compile_threads._value == MAX_COMPILE_THREADS)
        await _send(rank, CompileGrammar("again", StructuredSpec("regex", "again")))
        await _until(lambda: len(replies) == len(slow) + 2)
        return replies, waited

    replies, waited = asyncio.run(body())
    rid, ok, error = replies[-2]
    assert rid == "cheap" and not ok and "retry shortly" in error and waited < COMPILE_THREAD_WAIT_S + 1
    assert replies[-1] == ("again", True, "")


def test_a_long_compiles_freed_memory_goes_back_to_the_system(monkeypatch):
    import actors.worker as worker

    trims = []
    monkeypatch.setattr(worker, "_trim_heap", lambda: trims.append(1))
    compiler = SimpleNamespace(compile=lambda spec: time.sleep(0.05) or "compiled")
    monkeypatch.setattr(worker, "TRIM_AFTER_COMPILE_S", 10.0)
    assert worker._compile_below_steps(compiler, None) == "compiled" and trims == []  # a short one: left as is
    monkeypatch.setattr(worker, "TRIM_AFTER_COMPILE_S", 0.01)
    assert worker._compile_below_steps(compiler, None) == "compiled" and trims == [1]


def test_a_host_of_more_cores_compiles_more_at_once():
    """Two a rank on a small host, a quarter of a rank's share of the cores on a larger one, eight at most."""
    from actors.worker import compiles_at_once

    assert [compiles_at_once(cpus, ranks) for cpus, ranks in ((2, 1), (8, 2), (16, 1), (64, 2), (128, 1))] == \
        [MAX_COMPILES, MAX_COMPILES, 4, 8, 8]
