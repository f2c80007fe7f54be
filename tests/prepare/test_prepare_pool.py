"""The prepare actor's pool over in-memory channels, with a fake preparer whose
per-request duration the test controls with events (no sleeps)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from actors.prepare import PrepareActor
from mstar_actors.config import Config, ServerConfig
from mstar_actors.messages import (
    Abort,
    Failed,
    FrontendToPrepare,
    NewRequest,
    Prepared,
    PrepareToConductor,
    SamplingParams,
    Shutdown,
    StructuredSpec,
)
from mstar_actors.prepare.preparers import Draft
from transport.errors import ChannelClosed
from transport.memory import MemoryChannel

pytestmark = pytest.mark.timeout(30)


class GatedPreparer:
    """Each request's draft blocks on its own gate; ``started`` tells the loop it began."""

    PREPROCESS_PARALLEL = True

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.ended: dict[str, asyncio.Event] = {}
        self.threads: set[str] = set()

    def expect(self, *ids: str) -> None:
        for rid in ids:
            self.gates[rid] = threading.Event()
            self.started[rid] = asyncio.Event()
            self.ended[rid] = asyncio.Event()

    def draft(self, req: NewRequest, fetched: dict, *, abandoned=None) -> Draft | Failed:
        self.threads.add(threading.current_thread().name)
        self.loop.call_soon_threadsafe(self.started[req.request_id].set)
        assert self.gates[req.request_id].wait(20), f"gate {req.request_id} never opened"
        self.loop.call_soon_threadsafe(self.ended[req.request_id].set)
        if req.prompt == "fail":
            return Failed(request_id=req.request_id, status=400, message="bad media", param="messages")
        if req.prompt == "boom":
            raise RuntimeError("preparer bug")
        return Draft(Prepared(request_id=req.request_id, model="m", prompt_token_ids=[1, 2, 3],
                              sampling=SamplingParams()))


class InlinePreparer(GatedPreparer):
    PREPROCESS_PARALLEL = False

    def draft(self, req, fetched, *, abandoned=None):
        self.threads.add(threading.current_thread().name)
        return Draft(Prepared(request_id=req.request_id, model="m", prompt_token_ids=[1], sampling=SamplingParams()))


class WatchedChannel(MemoryChannel):
    """Sets ``blocked`` when a send has to wait for room."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.blocked = asyncio.Event()

    async def send(self, msg) -> None:
        if not self._check_send(self._codec.encode(msg)):
            self.blocked.set()
        await super().send(msg)


class Harness:
    def __init__(self, preparer, num_workers: int, outbox_bytes: int = 1 << 20):
        self.inbox = MemoryChannel(FrontendToPrepare, "frontend.prepare", capacity_bytes=1 << 20)
        self.out = WatchedChannel(PrepareToConductor, "prepare.conductor", capacity_bytes=outbox_bytes)
        self.preparer = preparer
        config = Config(server=ServerConfig(allow_private_media_addresses=True))  # media is served on loopback
        self.actor = PrepareActor(name="prepare", config=config, inbox={"frontend": self.inbox},
                                  outbox={"conductor": self.out}, preparer=preparer, num_workers=num_workers)
        self.task = asyncio.create_task(self.actor.run())

    async def send(self, rid: str, prompt: str = "ok") -> None:
        """A request with an inline image (the pool's; the fake preparer reads only ``prompt``)."""
        from mstar_actors.messages import ChatMessage, ContentPart

        image = [ChatMessage("user", [ContentPart(type="image_url", url="data:image/png;base64,AA")])]
        await self.inbox.send(NewRequest(request_id=rid, model="m", sampling=SamplingParams(), prompt=prompt,
                                         messages=image))

    async def send_text(self, rid: str) -> None:
        await self.inbox.send(NewRequest(request_id=rid, model="m", sampling=SamplingParams(), prompt="ok"))

    async def recv_id(self) -> tuple[str, str]:
        msg = await self.out.recv()
        return type(msg).__name__, msg.request_id

    async def close(self) -> list:
        """Shut down and return what was still on the way out."""
        await self.inbox.send(Shutdown(reason="test"))
        assert await self.task == 0
        rest = []
        while True:
            try:
                rest.append(await self.out.recv())
            except ChannelClosed:
                return rest


async def settle() -> None:
    """Let every ready callback on the loop run (no timing involved)."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_each_request_goes_once_done_and_text_never_waits_for_the_pool():
    """A request finished before one started earlier goes at once (it waited for the head: a text
    request's first token came 2.4 s late behind three large images); a text request takes no pool
    thread, so it goes while every thread drafts."""
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=3)
    h.preparer.expect("r1", "r2", "r3", "t")
    for rid in ("r1", "r2", "r3"):
        await h.send(rid)
    for rid in ("r1", "r2", "r3"):
        await h.preparer.started[rid].wait()  # all three run at once
    h.preparer.gates["t"].set()
    await h.send_text("t")
    assert await h.recv_id() == ("Prepared", "t")  # beside the pool
    h.preparer.gates["r3"].set()
    assert await h.recv_id() == ("Prepared", "r3")  # r1 and r2 still drafting
    h.preparer.gates["r2"].set()
    assert await h.recv_id() == ("Prepared", "r2")
    h.preparer.gates["r1"].set()
    assert await h.recv_id() == ("Prepared", "r1")
    pool = {t for t in h.preparer.threads if t.startswith("prepare")}
    assert len(pool) == 3 and len(h.preparer.threads) == 4  # the text request's thread is not the pool's
    assert await h.close() == []


async def test_an_abort_read_while_its_request_is_sent_goes_after_it():
    """The loop alone sends: an Abort read while its request's send waits for room follows that request
    (a text request sending on its own task let a later Abort overtake it: the conductor dropped the unknown
    abort, then ran the request for a client that was gone)."""
    from mstar_actors.messages import PrepareToConductor
    from transport.codec import Codec
    from transport.memory import RECORD_OVERHEAD

    codec = Codec(PrepareToConductor, "size")
    one = Prepared(request_id="t1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams())
    room = len(codec.encode(one)) + len(codec.encode(Abort(request_id="t2"))) + 2 * RECORD_OVERHEAD
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=2, outbox_bytes=room)
    h.preparer.expect("t1", "t2")
    for rid in ("t1", "t2"):
        h.preparer.gates[rid].set()
        await h.send_text(rid)
        await h.preparer.ended[rid].wait()
    await h.out.blocked.wait()  # t2's Prepared waits for room
    await h.inbox.send(Abort(request_id="t2"))
    await settle()
    assert [await h.recv_id() for _ in range(3)] == [("Prepared", "t1"), ("Prepared", "t2"), ("Abort", "t2")]
    assert await h.close() == []


async def test_text_requests_are_bounded_too():
    """Past its lane's bounds and read-ahead, text stays in the frontend's ring (every text request was read
    at once, each a task waiting on a full outbox)."""
    from actors.prepare import MAX_READ_AHEAD

    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=1, outbox_bytes=200)
    ids = [f"t{i}" for i in range(40)]
    h.preparer.expect(*ids)
    for rid in ids:
        h.preparer.gates[rid].set()
        await h.send_text(rid)
    await h.out.blocked.wait()  # the loop waits to send: it reads nothing more
    for _ in range(20):  # (drafts started meanwhile end on their threads)
        await asyncio.sleep(0.01)
    assert len(h.actor.text.ahead) <= MAX_READ_AHEAD and h.actor.text.pending.num_preparing <= 2
    assert len(h.inbox._records) >= len(ids) - MAX_READ_AHEAD - 6, "read past the bounds"
    assert sorted([(await h.recv_id())[1] for _ in ids]) == sorted(ids)
    await h.close()


async def test_a_full_pool_reads_on_media_wait_in_line_and_past_it_are_a_503(monkeypatch):
    """With every thread busy, media requests wait in line, read (an abort drops one unprepared at once),
    up to MAX_MEDIA_WAITING; one more is a 503 at once; text and aborts are read all along (reading stopped
    at 8 waiting: a text request waited seconds behind twenty large images, and aborts behind them)."""
    monkeypatch.setattr("actors.prepare.MAX_MEDIA_WAITING", 4)
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=2)
    ids = [f"r{i}" for i in range(1, 10)]
    h.preparer.expect(*ids, "t")
    for rid in ids:
        await h.send(rid)
    await h.preparer.started["r1"].wait()
    await h.preparer.started["r2"].wait()
    refused = await h.out.recv()
    assert (refused.request_id, refused.status, refused.code) == ("r9", 503, "overloaded"), refused
    # Two drafting and one queued behind each thread; four more read, waiting.
    assert h.actor.media.pending.request_ids() == ["r1", "r2", "r3", "r4"]
    assert list(h.actor.media.ahead) == ["r5", "r6", "r7", "r8"] and not h.preparer.started["r3"].is_set()
    h.preparer.gates["t"].set()
    await h.send_text("t")
    assert await h.recv_id() == ("Prepared", "t")  # read and sent while the pool is full
    await h.inbox.send(Abort(request_id="r6"))
    await settle()
    assert list(h.actor.media.ahead) == ["r5", "r7", "r8"]
    h.preparer.gates["r2"].set()  # r2 goes at once (r1 still drafts); its thread takes the queued r3
    assert await h.recv_id() == ("Prepared", "r2")
    await h.preparer.started["r3"].wait()
    await settle()
    # r5 took r2's room: r1 and r3 drafting, r4 and r5 queued
    assert h.actor.media.pending.request_ids() == ["r1", "r3", "r4", "r5"] and not h.preparer.started["r4"].is_set()
    assert h.actor.media.pending.num_preparing == 4
    for rid in ids:
        h.preparer.gates[rid].set()
    assert {(await h.recv_id())[1] for _ in range(6)} == {"r1", "r3", "r4", "r5", "r7", "r8"}
    assert not h.preparer.started["r6"].is_set()
    assert await h.close() == []


async def test_media_waiting_past_their_bytes_bound_are_a_503(monkeypatch):
    """The line's bound counts the waiting requests' inline media too (each holds its data: URLs)."""
    monkeypatch.setattr("actors.prepare.MAX_MEDIA_WAITING_BYTES", 30)  # one inline image of the harness's: 24
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=1)
    h.preparer.expect("r1", "r2", "r3", "r4")
    for rid in ("r1", "r2", "r3", "r4"):
        await h.send(rid)
    refused = await h.out.recv()
    assert (refused.request_id, refused.status) == ("r4", 503) and "MiB" in refused.message, refused
    assert list(h.actor.media.ahead) == ["r3"]
    for rid in ("r1", "r2", "r3"):
        h.preparer.gates[rid].set()
    assert {(await h.recv_id())[1] for _ in range(3)} == {"r1", "r2", "r3"}
    assert await h.close() == []


async def test_a_request_abandoned_while_queued_for_a_thread_is_never_drafted():
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=2)
    h.preparer.expect("r1", "r2", "r3", "r4")
    for rid in ("r1", "r2", "r3"):
        await h.send(rid)
    await h.preparer.started["r1"].wait()
    await h.preparer.started["r2"].wait()
    await settle()
    assert "r3" in h.actor.media.pending  # read, queued for a thread
    await h.inbox.send(Abort(request_id="r3"))
    await h.send("r4")
    await settle()
    assert "r3" not in h.actor.media.pending
    for rid in ("r1", "r2", "r4"):
        h.preparer.gates[rid].set()
    assert sorted([await h.recv_id() for _ in range(3)]) == [("Prepared", rid) for rid in ("r1", "r2", "r4")]
    assert not h.preparer.started["r3"].is_set()  # its thread skipped it
    assert await h.close() == []


async def test_full_outbox_release_waits_and_nothing_is_lost():
    # room for one Prepared (about 140 bytes with the record header) and not two
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=4, outbox_bytes=200)
    ids = [f"r{i}" for i in range(6)]
    h.preparer.expect(*ids)
    for rid in ids:
        await h.send(rid)
    for rid in ids[:4]:
        await h.preparer.started[rid].wait()
    for rid in ids:
        h.preparer.gates[rid].set()
    await h.out.blocked.wait()
    await settle()
    assert h.out.stats().messages == 1 and h.out.stats().num_blocked == 1  # the second release waits
    assert sorted([(await h.recv_id())[1] for _ in ids]) == ids
    await h.close()


async def test_one_failing_request_fails_alone():
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=3)
    h.preparer.expect("r1", "r2", "r3", "r4")
    await h.send("r1")
    await h.send("r2", prompt="fail")
    await h.send("r3", prompt="boom")
    await h.send("r4")
    for rid in ("r4", "r3", "r2", "r1"):
        h.preparer.gates[rid].set()
    msgs = sorted([await h.out.recv() for _ in range(4)], key=lambda m: m.request_id)
    assert [type(m).__name__ for m in msgs] == ["Prepared", "Failed", "Failed", "Prepared"]
    assert (msgs[1].status, msgs[1].param) == (400, "messages")
    assert msgs[2].status == 500 and "preparer bug" in msgs[2].message
    await h.close()


async def test_abandoned_request_is_dropped_unsent_and_the_others_continue():
    h = Harness(GatedPreparer(asyncio.get_running_loop()), num_workers=3)
    h.preparer.expect("r1", "r2", "r3")
    for rid in ("r1", "r2", "r3"):
        await h.send(rid)
    await h.preparer.started["r1"].wait()
    await h.inbox.send(Abort(request_id="r1"))  # r1 still prepares
    h.preparer.gates["r2"].set()
    h.preparer.gates["r3"].set()
    assert sorted([await h.recv_id() for _ in range(2)]) == [("Prepared", "r2"), ("Prepared", "r3")]
    h.preparer.gates["r1"].set()  # its thread ends; the result goes nowhere
    await h.inbox.send(Abort(request_id="r2"))  # already released: forwarded in order
    assert await h.recv_id() == ("Abort", "r2")
    assert await h.close() == []


@contextlib.asynccontextmanager
async def slow_media_server():
    """``(base URL, asked, answer)``: ``/slow.png`` sets ``asked`` and answers
    (an empty body) only once ``answer`` is set."""
    from aiohttp import web

    from tests.loopback import serving

    asked, answer = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        asked.set()
        await answer.wait()
        return web.Response(body=b"")

    app = web.Application()
    app.router.add_get("/slow.png", slow)
    async with serving(app) as base:
        try:
            yield base, asked, answer
        finally:
            answer.set()  # the server's handler ends, so the server stops at once


def media_request(rid: str, url: str) -> NewRequest:
    from mstar_actors.messages import ChatMessage, ContentPart

    return NewRequest(request_id=rid, model="m", sampling=SamplingParams(),
                      messages=[ChatMessage("user", [ContentPart(type="image_url", url=url)])])


class FetchingPreparer(GatedPreparer):
    PREPARES_MEDIA = True


@pytest.mark.parametrize("num_workers", [1, 2], ids=["inline", "pool"])
async def test_a_slow_media_server_holds_back_no_other_request(num_workers):
    """A request fetching http(s) media (its server silent) is outside the
    release order and the mailbox: requests behind it are prepared and sent
    meanwhile, an abort of it stops its fetch at once, unforwarded, and it
    never takes a thread; one whose server answers late goes once fetched."""
    async with slow_media_server() as (base, asked, answer):
        h = Harness(FetchingPreparer(asyncio.get_running_loop()), num_workers=num_workers)
        h.preparer.expect("r1", "r2", "r3")
        h.preparer.gates["r2"].set()
        h.preparer.gates["r3"].set()
        await h.inbox.send(media_request("r1", f"{base}/slow.png"))
        await asked.wait()
        await h.send("r2")
        assert await h.recv_id() == ("Prepared", "r2")  # while r1 still waits for its server
        assert list(h.actor._fetching) == ["r1"] and "r1" not in h.actor.media.pending
        await h.inbox.send(Abort(request_id="r1"))
        await settle()
        assert not h.actor._fetching and h.actor.media.pending.num_preparing == 0
        assert not h.preparer.started["r1"].is_set()
        asked.clear()
        await h.inbox.send(media_request("r3", f"{base}/slow.png"))
        await asked.wait()
        answer.set()
        assert await h.recv_id() == ("Prepared", "r3")
        assert await h.close() == []


@pytest.mark.parametrize("num_workers", [1, 2], ids=["inline", "pool"])
async def test_requests_past_the_fetch_bound_wait_their_turn_and_hold_no_other_back(num_workers):
    """With ``max_fetching`` fetches hanging, a further media request waits its
    turn (an abort takes it out) while a plain one is prepared at once; when a
    fetch ends, the next waiting one starts."""
    async with slow_media_server() as (base, asked, answer):
        h = Harness(FetchingPreparer(asyncio.get_running_loop()), num_workers=num_workers)
        h.preparer.expect("t0", "m1", "m2", "m3", "t1")
        for rid in ("t0", "m1", "m3", "t1"):
            h.preparer.gates[rid].set()
        await h.send("t0")
        assert await h.recv_id() == ("Prepared", "t0")  # started: its bound is set
        h.actor.max_fetching = 1
        for rid in ("m1", "m2", "m3"):
            await h.inbox.send(media_request(rid, f"{base}/slow.png"))
        await asked.wait()
        await h.send("t1")
        assert await h.recv_id() == ("Prepared", "t1")
        assert list(h.actor._fetching) == ["m1"] and list(h.actor._to_fetch) == ["m2", "m3"]
        await h.inbox.send(Abort(request_id="m2"))
        await settle()
        assert list(h.actor._to_fetch) == ["m3"]
        answer.set()
        assert {await h.recv_id(), await h.recv_id()} == {("Prepared", "m1"), ("Prepared", "m3")}
        assert not h.preparer.started["m2"].is_set()
        assert await h.close() == []


@pytest.mark.parametrize("num_workers", [1, 2], ids=["inline", "pool"])
async def test_a_media_request_past_the_fetch_queue_is_a_503_and_reading_goes_on(num_workers, monkeypatch):
    """With every fetch slot taken and the waiting line full, one more media request is a 503 at once (the
    loop stopped reading there: a burst of slow media servers held every other request, text too)."""
    monkeypatch.setattr("actors.prepare.MAX_WAITING_TO_FETCH", 1)
    async with slow_media_server() as (base, asked, answer):
        h = Harness(FetchingPreparer(asyncio.get_running_loop()), num_workers=num_workers)
        h.preparer.expect("t0", "m1", "m2", "m3", "t1")
        for rid in h.preparer.gates:
            h.preparer.gates[rid].set()
        await h.send_text("t0")
        assert await h.recv_id() == ("Prepared", "t0")
        h.actor.max_fetching = 1
        for rid in ("m1", "m2", "m3"):
            await h.inbox.send(media_request(rid, f"{base}/slow.png"))
        await asked.wait()
        refused = await h.out.recv()
        assert (refused.request_id, refused.status, refused.code) == ("m3", 503, "overloaded"), refused
        await h.send_text("t1")
        assert await h.recv_id() == ("Prepared", "t1")
        answer.set()
        assert {await h.recv_id(), await h.recv_id()} == {("Prepared", "m1"), ("Prepared", "m2")}
        assert await h.close() == []


async def test_fetched_requests_join_the_bounded_media_line(monkeypatch):
    """A fetched request joins the media line, so fetches start only while it has room: the rest wait their
    turn to fetch (each finished fetch joined the line unbounded: 150 fetched bodies held for a full pool)."""
    from aiohttp import web

    from tests.loopback import serving

    monkeypatch.setattr("actors.prepare.MAX_MEDIA_WAITING", 4)

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 1000)

    app = web.Application()
    app.router.add_get("/a.png", image)
    async with serving(app) as base:
        h = Harness(FetchingPreparer(asyncio.get_running_loop()), num_workers=1)
        ids = [f"m{i}" for i in range(10)]
        h.preparer.expect("b1", "b2", *ids)
        for rid in ("b1", "b2"):  # the pool full: one drafting, one queued
            await h.send(rid)
        await h.preparer.started["b1"].wait()
        for rid in ids:
            await h.inbox.send(media_request(rid, f"{base}/a.png"))
        for _ in range(1000):  # until the fetches the line has room for have ended
            if len(h.actor.media.ahead) == 4 and not h.actor._fetching:
                break
            await asyncio.sleep(0.01)
        assert set(h.actor.media.ahead) == set(ids[:4]) and list(h.actor._to_fetch) == ids[4:]
        for gate in h.preparer.gates.values():
            gate.set()
        assert {(await h.recv_id())[1] for _ in range(12)} == {"b1", "b2", *ids}  # the rest fetched in turn
        assert await h.close() == []


async def test_a_failed_fetch_is_never_overtaken_by_its_abort():
    """A fetch's failure is sent while the request still counts as fetching: an Abort read while the send
    waits drops it (the Abort was forwarded first, and its Failed followed)."""
    from aiohttp import web

    from mstar_actors.messages import PrepareToConductor
    from tests.loopback import serving
    from transport.codec import Codec
    from transport.memory import RECORD_OVERHEAD

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/gone.png", missing)
    async with serving(app) as base:
        codec = Codec(PrepareToConductor, "size")
        from mstar_actors.prepare.media import FetchFailed
        from mstar_actors.prepare.preparers import failed

        one = Prepared(request_id="t1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams())
        param = "messages[0].content[0].image_url"
        gone = failed(media_request("m1", ""), str(FetchFailed(param)), param)  # what m1 is answered
        # room for t1's Prepared and m1's Abort, or for m1's Failed alone: the Failed waits behind t1's Prepared
        room = max(len(codec.encode(one)) + len(codec.encode(Abort(request_id="m1"))), len(codec.encode(gone)))
        h = Harness(FetchingPreparer(asyncio.get_running_loop()), num_workers=2,
                    outbox_bytes=room + 2 * RECORD_OVERHEAD)
        h.preparer.expect("t1", "m1")
        h.preparer.gates["t1"].set()
        await h.send_text("t1")
        await h.preparer.ended["t1"].wait()
        await settle()
        await h.inbox.send(media_request("m1", f"{base}/gone.png"))
        await h.out.blocked.wait()  # m1's Failed waits for room
        await h.inbox.send(Abort(request_id="m1"))
        await settle()
        assert await h.recv_id() == ("Prepared", "t1")
        assert await h.close() == []  # neither m1's Failed nor its Abort: the conductor never saw it


async def test_one_worker_drafts_on_a_thread_and_drops_requests_aborted_behind_a_long_draft():
    """A media preparer of one worker drafts on a thread of its own: while a long draft runs, the loop
    reads on, and requests whose clients left while they waited behind it are dropped unprepared (on the
    loop's thread, each was prepared in its turn and the requests after it waited for them)."""
    preparer = GatedPreparer(asyncio.get_running_loop())
    preparer.expect("long", "queued", "ahead1", "ahead2", "next")
    h = Harness(preparer, num_workers=1)
    for rid in ("long", "queued", "ahead1", "ahead2"):
        await h.send(rid)
    await preparer.started["long"].wait()
    await settle()
    assert list(h.actor.media.ahead) == ["ahead1", "ahead2"]  # read while the pool is full
    for rid in ("queued", "ahead1", "ahead2"):
        await h.inbox.send(Abort(request_id=rid))
    await h.send("next")
    preparer.gates["next"].set()
    await settle()
    assert list(h.actor.media.ahead) == ["next"]  # the one thread is long's: next waits for it, alone
    preparer.gates["long"].set()
    assert [await h.recv_id() for _ in range(2)] == [("Prepared", "long"), ("Prepared", "next")]
    assert not any(preparer.started[rid].is_set() for rid in ("queued", "ahead1", "ahead2"))
    assert h.actor.threads is not None and all(t.startswith("prepare") for t in preparer.threads)
    assert await h.close() == []  # no Abort forwarded: the conductor never saw them


async def test_inline_fallback_without_a_declaration():
    preparer = InlinePreparer(asyncio.get_running_loop())
    preparer.expect("r1", "r2")
    preparer.gates["r1"].set()
    preparer.gates["r2"].set()
    h = Harness(preparer, num_workers=4)
    await h.send("r1")
    await h.inbox.send(Abort(request_id="r1"))
    await h.send("r2")
    assert [await h.recv_id() for _ in range(3)] == [("Prepared", "r1"), ("Abort", "r1"), ("Prepared", "r2")]
    assert h.actor.threads is None
    assert not any(t.startswith("prepare") for t in preparer.threads)  # ran on the loop's thread
    await h.close()


async def test_inline_a_constrained_request_checks_aside_and_the_rest_go_on():
    """Inline (no pool), a constrained request's rules (up to a second for a large
    schema) are checked on a thread: a plain request behind it goes first, and
    an abort drops its result."""
    preparer = GatedPreparer(asyncio.get_running_loop())
    preparer.PREPROCESS_PARALLEL = False
    preparer.expect("slow", "plain", "gone")
    preparer.gates["plain"].set()
    h = Harness(preparer, num_workers=1)
    constrained = SamplingParams(structured=StructuredSpec("json", "{}"))
    await h.inbox.send(NewRequest(request_id="slow", model="m", sampling=constrained, prompt="ok"))
    await preparer.started["slow"].wait()
    await h.send("plain")
    assert await h.recv_id() == ("Prepared", "plain")  # while "slow" is still checking
    await h.inbox.send(NewRequest(request_id="gone", model="m", sampling=constrained, prompt="ok"))
    await preparer.started["gone"].wait()
    await h.inbox.send(Abort(request_id="gone"))
    assert await h.recv_id() == ("Abort", "gone")
    preparer.gates["gone"].set()
    preparer.gates["slow"].set()
    assert await h.recv_id() == ("Prepared", "slow")
    await preparer.ended["gone"].wait()
    assert await h.close() == []  # "gone" was never sent


async def test_inline_an_abort_read_while_a_checked_request_waits_to_be_sent_drops_it():
    """The request leaves the checks' table only once sent: an Abort read while its send waits drops it
    unsent (it left the table before its send, and the Abort overtook it into the conductor's ring)."""
    from mstar_actors.messages import PrepareToConductor
    from transport.codec import Codec
    from transport.memory import RECORD_OVERHEAD

    preparer = GatedPreparer(asyncio.get_running_loop())
    preparer.PREPROCESS_PARALLEL = False
    preparer.expect("c1", "c2")
    codec = Codec(PrepareToConductor, "size")
    one = Prepared(request_id="c1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams())
    room = len(codec.encode(one)) + len(codec.encode(Abort(request_id="c2"))) + 2 * RECORD_OVERHEAD
    h = Harness(preparer, num_workers=1, outbox_bytes=room)
    constrained = SamplingParams(structured=StructuredSpec("json", "{}"))
    for rid, num_sent in (("c1", 1), ("c2", 1)):
        preparer.gates[rid].set()
        await h.inbox.send(NewRequest(request_id=rid, model="m", sampling=constrained, prompt="ok"))
        await preparer.ended[rid].wait()
        for _ in range(500):  # c1 out before c2 drafts (each drafts on a thread of its own)
            if h.out.stats().messages == num_sent:
                break
            await asyncio.sleep(0.01)
    await h.out.blocked.wait()  # c2's Prepared waits for room
    await h.inbox.send(Abort(request_id="c2"))
    await settle()
    assert [await h.recv_id() for _ in range(2)] == [("Prepared", "c1"), ("Abort", "c2")]
    assert await h.close() == []


@pytest.mark.parametrize("num_workers", [1, 2], ids=["inline", "pool"])
async def test_debug_log_names_each_request_sent_once(caplog, num_workers):
    preparer = GatedPreparer(asyncio.get_running_loop())
    preparer.expect("r1", "r2")
    preparer.gates["r1"].set()
    preparer.gates["r2"].set()
    h = Harness(preparer, num_workers=num_workers)
    with caplog.at_level("DEBUG", logger="mstar_actors.prepare"):
        await h.send("r1")
        await h.send("r2", prompt="fail")
        assert sorted([await h.recv_id() for _ in range(2)]) == [("Failed", "r2"), ("Prepared", "r1")]
        await h.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared ")]
    assert sorted(lines) == ["prepared r1: Prepared sent", "prepared r2: Failed sent"]


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
async def test_pool_threads_are_pinned_to_cpus_of_their_own(monkeypatch, pin):
    """With CPUs to spare (an 8-CPU affinity here, faked, hardware threads in
    pairs: 2k and 2k+1 share a core), each pool thread pins itself to its own
    CPU from the top, one per core, before it drafts; the config's
    ``prepare.pin_pool_threads: false`` leaves them to the OS."""
    import os

    import actors.prepare
    from mstar_actors.config import parse_config

    pinned: dict[int, set[int]] = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(actors.prepare, "read_cpu_cores", lambda cpus: {cpu: (0, cpu // 2) for cpu in cpus})
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: pinned.__setitem__(tid, set(cpus)))
    preparer = GatedPreparer(asyncio.get_running_loop())
    drafted_on: set[int] = set()
    draft = preparer.draft

    def draft_and_note(req, fetched, *, abandoned=None):
        drafted_on.add(threading.get_native_id())
        return draft(req, fetched, abandoned=abandoned)

    preparer.draft = draft_and_note
    preparer.expect("a", "b")
    h = Harness(preparer, num_workers=2)
    h.actor.config = parse_config({"model": {"path": "m"}, "prepare": {"pin_pool_threads": pin},
                                   "parallel": {"worker_torch_threads": 1}})  # a GPU rank's: CPUs to spare
    await h.send("a")
    await h.send("b")
    await preparer.started["a"].wait()
    await preparer.started["b"].wait()
    for rid in ("a", "b"):
        preparer.gates[rid].set()
    assert sorted([await h.recv_id() for _ in range(2)]) == [("Prepared", "a"), ("Prepared", "b")]
    await h.close()
    if pin:
        assert set(pinned) == drafted_on and sorted(map(sorted, pinned.values())) == [[5], [7]]
    else:
        assert pinned == {}


def test_cpu_cores_are_read_from_sysfs(tmp_path):
    from actors.prepare import read_cpu_cores

    for cpu, core in ((0, 0), (1, 0), (2, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    (tmp_path / "cpu3" / "topology").mkdir(parents=True)  # no core_id: unknown, left out
    assert read_cpu_cores([0, 1, 2, 3, 4], root=tmp_path) == {0: (0, 0), 1: (0, 0), 2: (0, 1)}


async def test_a_refused_pin_leaves_the_thread_working(monkeypatch, caplog):
    import os

    def refuse(tid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    preparer = GatedPreparer(asyncio.get_running_loop())
    preparer.expect("a")
    preparer.gates["a"].set()
    h = Harness(preparer, num_workers=2)
    await h.send("a")
    assert await h.recv_id() == ("Prepared", "a")
    await h.close()
    assert any("could not pin a prepare thread" in r.getMessage() for r in caplog.records)
