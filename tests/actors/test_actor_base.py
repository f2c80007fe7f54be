"""The actor base: dispatch, unknown messages, errors reported, shutdown."""

import asyncio
import functools

from actors.base import Actor, format_stacks
from mstar_actors.config import Config
from mstar_actors.messages import (
    Abort,
    ActorError,
    ActorReady,
    ActorToLauncher,
    FrontendToPrepare,
    LauncherToActor,
    NewRequest,
    SamplingParams,
    Shutdown,
    Started,
)
from transport.memory import MemoryChannel


class Recorder(Actor):
    """Records what it handles; fails on request id "boom"."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list = []
        self.started = False
        self.stopped = False
        self.progress = asyncio.Event()  # set whenever something was handled

    async def handle(self, channel, msg):
        match msg:
            case NewRequest(request_id="boom"):
                raise RuntimeError("boom requested")
            case NewRequest() | Abort():
                self.seen.append((channel, msg.request_id))
                self.progress.set()
            case _:
                self.unknown(channel, msg)

    def on_started(self):
        self.started = True
        self.progress.set()

    async def stop(self):
        self.stopped = True


def make_actor(**overrides):
    inbox = {
        "frontend": MemoryChannel(FrontendToPrepare, "frontend->x"),
        "control": MemoryChannel(LauncherToActor, "launcher->x"),
    }
    outbox = {"control": MemoryChannel(ActorToLauncher, "x->launcher")}
    kw = dict(name="x", config=Config(), inbox=inbox, outbox=outbox) | overrides
    return Recorder(**kw)


def async_test(fn):
    @functools.wraps(fn)
    def wrapper():
        asyncio.run(fn())

    return wrapper


def new_request(request_id):
    return NewRequest(request_id=request_id, model="m", sampling=SamplingParams(), prompt="hi")


async def drain(channel):
    out = []
    while channel._records:
        out.append(await channel.recv())
    return out


@async_test
async def test_dispatch_keeps_order_and_shuts_down():
    actor = make_actor()
    for rid in ("a", "b", "c"):
        await actor.inbox["frontend"].send(new_request(rid))
    await actor.inbox["frontend"].send(Abort(request_id="a"))
    await actor.inbox["control"].send(Started())
    code = await asyncio.wait_for(_run_until_idle_then_shutdown(actor), 5)
    assert code == 0
    assert actor.seen == [("frontend", "a"), ("frontend", "b"), ("frontend", "c"), ("frontend", "a")]
    assert actor.started and actor.stopped
    (ready,) = await drain(actor.outbox["control"])
    assert isinstance(ready, ActorReady) and ready.actor == "x"


async def _run_until_idle_then_shutdown(actor):
    task = asyncio.create_task(actor.run())
    while len(actor.seen) < 4 or not actor.started:
        actor.progress.clear()
        await actor.progress.wait()
    await actor.inbox["control"].send(Shutdown(reason="test"))
    code = await task
    assert actor.stop_reason == "test"
    return code


@async_test
async def test_unknown_message_is_an_error_reported_to_the_launcher():
    actor = make_actor()
    # Shutdown is handled by the base; a message of the union without a
    # handler case must fail loudly, naming actor, channel and type.
    actor.inbox["frontend"] = MemoryChannel(LauncherToActor, "odd")
    actor.mailbox.channels["frontend"] = actor.inbox["frontend"]
    await actor.inbox["frontend"].send(Started())
    code = await asyncio.wait_for(actor.run(), 5)
    assert code == 1
    ready, err = await drain(actor.outbox["control"])
    assert isinstance(err, ActorError)
    assert "'x'" in err.message and "Started" in err.message and "'frontend'" in err.message
    assert actor.stopped


@async_test
async def test_exception_in_handler_is_reported_with_traceback():
    actor = make_actor()
    await actor.inbox["frontend"].send(new_request("boom"))
    code = await asyncio.wait_for(actor.run(), 5)
    assert code == 1
    _, err = await drain(actor.outbox["control"])
    assert "boom requested" in err.message and "Traceback" in err.traceback
    # Outbound channels are closed so the end propagates downstream.
    assert actor.outbox["control"]._writer_closed


@async_test
async def test_end_of_inbound_channel_stops_cleanly():
    actor = make_actor()
    await actor.inbox["frontend"].send(new_request("a"))
    actor.inbox["frontend"].close()
    assert await asyncio.wait_for(actor.run(), 5) == 0
    assert actor.seen == [("frontend", "a")]
    assert "ended" in actor.stop_reason


@async_test
async def test_format_stacks_shows_threads_and_tasks_while_loop_blocked():
    loop = asyncio.get_running_loop()

    async def parked():
        await asyncio.Event().wait()

    task = asyncio.create_task(parked(), name="parked-task")
    await asyncio.sleep(0)
    text = await loop.run_in_executor(None, format_stacks, "x", loop)
    assert "thread MainThread" in text and "asyncio task parked-task" in text
    assert "in parked" in text
    task.cancel()


def test_settle_heap_freezes_start_up_objects_and_logs_long_collections(monkeypatch, caplog):
    import gc
    import logging

    from actors import base

    before = len(gc.callbacks)
    monkeypatch.setattr(base, "GC_PAUSE_LOGGED_S", 0.0)  # every collection counts as long here
    try:
        kept = [[i] for i in range(1000)]  # made "at start-up": frozen, out of later collections' walk
        base.settle_heap(logging.getLogger("mstar_actors.test"))
        assert gc.get_freeze_count() >= len(kept)
        with caplog.at_level(logging.DEBUG, logger="mstar_actors.test"):
            gc.collect()
        assert any("garbage collection of generation 2" in r.getMessage() for r in caplog.records)
    finally:
        del gc.callbacks[before:]
        gc.unfreeze()


def test_a_named_actor_is_profiled_and_its_statistics_saved(tmp_path):
    import pstats

    from actors import base
    from mstar_actors.config import parse_config

    debug = parse_config({"debug": {"profile_actors": ["prepare", "conductor"], "profile_dir": str(tmp_path)}}).debug
    assert base._profiler("worker0", debug) is None
    profiler = base._profiler("conductor", debug)
    try:
        sorted(str(i) for i in range(1000))  # work the profile must name
    finally:
        base._save_profile(profiler, "conductor", debug.profile_dir)
    stats = pstats.Stats(str(tmp_path / "conductor.prof")).stats
    assert any(func == "<built-in method builtins.sorted>" for _, _, func in stats)
