"""Media fetches cannot reach the server's own network (server-side request
forgery), and every failure looks the same to the client.

A canary HTTP server on loopback counts every request it gets: a refused
fetch must never reach it. Only loopback is ever contacted; private and
link-local addresses are reached only through an injected resolver, and
refused before any connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket

import pytest
from aiohttp import web

from mstar_actors.config import parse_config
from mstar_actors.prepare.media import (FetchError, FetchFailed, FetchSession, MediaLimits, MediaRef, fetch_remote,
                                        make_fetch_session)
from mstar_actors.prepare.media_guard import FetchPolicy, GuardedResolver, address_refusal
from mstar_actors.messages import (
    ChatMessage,
    ContentPart,
    Failed,
    NewRequest,
    Prepared,
    SamplingParams,
)
from mstar_actors.prepare.preparers import Draft
from tests.loopback import serving
from tests.prepare.actor_kit import running_prepare_actor

pytestmark = pytest.mark.timeout(30)

PARAM = "messages[0].content[1].image_url"
GENERIC = str(FetchFailed(PARAM))
IMAGE = b"\x89PNG not really"
OPT_IN = dict(allow_private_addresses=True)  # the canary is on loopback


class Canary:
    """Counts requests by path; ``/img`` answers IMAGE, ``/r/N`` redirects N
    more times before it, ``/to?url=U`` redirects to U, anything else 404."""

    def __init__(self):
        self.hits: list[str] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(request.path)
        if request.path == "/img":
            return web.Response(body=IMAGE)
        if request.path.startswith("/r/"):
            left = int(request.path[3:])
            raise web.HTTPFound("/img" if left == 1 else f"/r/{left - 1}")
        if request.path == "/to":
            raise web.HTTPFound(request.query["url"])
        raise web.HTTPNotFound()


@contextlib.asynccontextmanager
async def canary_at():
    canary = Canary()
    async with serving(canary.app) as base:
        canary.base = base
        canary.port = int(base.rsplit(":", 1)[1])
        yield canary


class FixedResolver:
    """An inner resolver that maps names to chosen addresses (nothing is looked up)."""

    def __init__(self, names: dict[str, list[str]]):
        self.names = names

    async def resolve(self, host, port=0, family=socket.AF_INET):
        if host not in self.names:
            raise OSError(f"{host}: unknown to the test's resolver")
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": 0} for a in self.names[host]]

    async def close(self):
        pass


def run_async(test):
    """Run an ``async def`` test on a fresh event loop."""

    @functools.wraps(test)
    def run(*args, **kw):
        return asyncio.run(test(*args, **kw))

    return run


def ref(url: str) -> MediaRef:
    return MediaRef("image", url, PARAM)


async def fetch(url: str, limits: MediaLimits, resolver=None) -> bytes:
    session = make_fetch_session(limits, resolver)
    try:
        return (await fetch_remote([ref(url)], limits, session))[PARAM]
    finally:
        await session.close()


async def refused(url: str, limits: MediaLimits, resolver=None) -> str:
    """The refusal's detail (what the server log gets). The client reads one message for every failure,
    but for its own URL refused before any connection or lookup (an IP literal, a host not allowed),
    which it reads named: nothing it did not send."""
    with pytest.raises(FetchError) as err:
        await fetch(url, limits, resolver)
    named = f"{PARAM}: not fetched: {err.value.reason}"
    assert err.value.param == PARAM and str(err.value.public()) == (named if err.value.is_public else GENERIC)
    return str(err.value)


# ---- the address rule -------------------------------------------------------------


def test_address_rule_refuses_every_non_public_kind():
    default, opted_in = FetchPolicy(own_port=8000), FetchPolicy(allow_private=True, own_port=8000)
    never = ["169.254.169.254", "fe80::1", "224.0.0.1", "ff02::1", "0.0.0.0", "::", "0.1.2.3", "240.0.0.1",
             "255.255.255.255"]
    private = ["127.0.0.1", "127.5.5.5", "::1", "::ffff:127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1",
               "fd00::1", "100.64.0.1"]
    for text in never:
        ip = ipaddress.ip_address(text)
        assert address_refusal(ip, 80, default) and address_refusal(ip, 80, opted_in), text
    for text in private:
        ip = ipaddress.ip_address(text)
        assert "allow_private_media_addresses" in address_refusal(ip, 80, default), text
        assert address_refusal(ip, 80, opted_in) is None, text
    for text in ("8.8.8.8", "2606:4700::1111"):
        assert address_refusal(ipaddress.ip_address(text), 80, default) is None
    own = FetchPolicy(own_addresses=frozenset({ipaddress.ip_address("8.8.8.8")}), own_port=8000)
    assert "this server" in address_refusal(ipaddress.ip_address("8.8.8.8"), 443, own)
    for text in ("127.0.0.1", "::1", "0.0.0.0"):  # the server's own port: refused even when opted in
        assert address_refusal(ipaddress.ip_address(text), 8000, opted_in) == "this server itself"


@run_async
async def test_resolved_private_addresses_are_refused_before_any_connection():
    """Names resolved (by the injected resolver) to private, link-local or
    mixed addresses: refused by default; the connect never happens, since
    the guard hands the connector no address."""
    names = {"intranet.test": ["10.0.0.7"], "metadata.test": ["169.254.169.254"], "ula.test": ["fd12::1"],
             "mixed.test": ["8.8.8.8", "10.0.0.7"]}
    guard = GuardedResolver(FetchPolicy(), FixedResolver(names))
    assert [r["host"] for r in await guard.resolve("mixed.test", 80)] == ["8.8.8.8"]  # the vetted ones only
    for name in ("intranet.test", "metadata.test", "ula.test"):
        detail = await refused(f"http://{name}/img", MediaLimits(), FixedResolver(names))
        assert "refused addresses" in detail, detail
    metadata = await refused("http://metadata.test/latest", MediaLimits(**OPT_IN), FixedResolver(names))
    assert "link-local" in metadata  # opting in to private addresses never opens link-local ones


@run_async
async def test_a_named_refusal_never_tells_this_servers_addresses_or_port():
    """Refusals a client reads are those of a policy blind to this server's own addresses and port: a
    literal that is refused only for being this server's answers as any failed fetch does."""
    import dataclasses

    limits = MediaLimits(own_port=8000)
    for allow_private, url, said in [(False, "http://8.8.8.8/x", None),  # one of this server's public addresses
                                     (False, "http://127.0.0.1:8000/x", "127.0.0.1: a loopback address"),
                                     (True, "http://127.0.0.1:8000/x", None),  # this server itself
                                     (False, "http://10.1.2.3/x", "10.1.2.3: a private address")]:
        session = make_fetch_session(dataclasses.replace(limits, allow_private_addresses=allow_private))
        session.policy = dataclasses.replace(session.policy, own_addresses=frozenset({ipaddress.ip_address("8.8.8.8")}))
        try:
            with pytest.raises(FetchError) as err:
                await fetch_remote([ref(url)], limits, session)
        finally:
            await session.close()
        public = str(err.value.public())
        assert public == GENERIC if said is None else public.startswith(f"{PARAM}: not fetched: {said}"), (url, public)


# ---- against the canary -----------------------------------------------------------


@run_async
async def test_loopback_in_every_spelling_is_refused_by_default_and_never_reached():
    async with canary_at() as canary:
        port = canary.port
        for url in (f"http://127.0.0.1:{port}/img", f"http://localhost:{port}/img", f"http://0x7f000001:{port}/img",
                    f"http://127.1:{port}/img", f"http://2130706433:{port}/img", f"http://[::1]:{port}/img",
                    f"http://[::ffff:127.0.0.1]:{port}/img", f"http://LocalHost:{port}/img"):
            detail = await refused(url, MediaLimits())
            assert "loopback" in detail or "canonical" in detail, (url, detail)
        assert canary.hits == []


@run_async
async def test_a_redirect_to_loopback_is_refused_on_its_hop():
    """The first hop is allowed (a public name, answered in memory); its
    redirect to the canary is checked as a hop of its own and refused."""

    class OnePublicHop:
        """A session whose ``public.test`` answers a redirect without a connection;
        every other URL goes to the real guarded session."""

        def __init__(self, real, location):
            self.real, self.location = real, location

        def get(self, url, **kw):
            if url.host != "public.test":
                return self.real.get(url, **kw)
            return _Redirect(self.location)

    async with canary_at() as canary:
        limits = MediaLimits()
        for target in (f"{canary.base}/img", f"http://localhost:{canary.port}/img", f"http://0x7f000001:{canary.port}/img",
                       "file:///etc/passwd"):
            real = make_fetch_session(limits)
            session = FetchSession(OnePublicHop(real.http, target), real.policy)
            try:
                with pytest.raises(FetchError, match="loopback|refused addresses|scheme 'file' is not fetched"):
                    await fetch_remote([ref("http://public.test/start")], limits, session)
            finally:
                await real.close()
        assert canary.hits == []


class _Redirect:
    def __init__(self, location):
        self.status, self.headers = 302, {"Location": location}

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


@run_async
async def test_opting_in_reaches_the_canary_but_never_the_servers_own_port():
    async with canary_at() as canary:
        assert await fetch(f"{canary.base}/img", MediaLimits(**OPT_IN)) == IMAGE
        assert await fetch(f"http://localhost:{canary.port}/img", MediaLimits(**OPT_IN)) == IMAGE
        assert canary.hits == ["/img", "/img"]
        itself = MediaLimits(**OPT_IN, own_port=canary.port)  # as if the canary were this server
        for url in (f"{canary.base}/v1/models", f"http://localhost:{canary.port}/metrics"):
            assert "this server itself" in await refused(url, itself)
        redirect = f"{canary.base}/to?url=http://127.0.0.1:{canary.port}/metrics"
        assert "this server itself" in await refused(redirect, MediaLimits(**OPT_IN, own_port=canary.port))
        assert canary.hits == ["/img", "/img"]


@run_async
async def test_allowed_media_domains_narrow_fetches_to_listed_hosts():
    async with canary_at() as canary:
        names = FixedResolver({"media.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
        limits = MediaLimits(**OPT_IN, allowed_domains=("Media.Test",))
        assert await fetch(f"http://media.test:{canary.port}/img", limits, names) == IMAGE
        assert canary.hits == ["/img"]
        for url in (f"http://other.test:{canary.port}/img", f"{canary.base}/img", f"http://localhost:{canary.port}/img"):
            assert "allowed_media_domains" in await refused(url, limits, names)
        # A listed host's redirect to an unlisted one is refused on its hop.
        away = f"http://media.test:{canary.port}/to?url=http://other.test:{canary.port}/img"
        assert "allowed_media_domains" in await refused(away, limits, names)
        assert canary.hits == ["/img", "/to"]
        # Listed, but resolving to loopback without the opt-in: still refused.
        assert "loopback" in await refused(f"http://media.test:{canary.port}/img",
                                           MediaLimits(allowed_domains=("media.test",)), names)
        assert canary.hits == ["/img", "/to"]


@run_async
async def test_exactly_max_media_redirects_are_followed_and_one_more_is_refused():
    async with canary_at() as canary:
        limits = MediaLimits(**OPT_IN, max_redirects=3)
        assert await fetch(f"{canary.base}/r/3", limits) == IMAGE
        assert "more than 3 redirects" in await refused(f"{canary.base}/r/4", limits)
        assert canary.hits.count("/img") == 1  # the 4th redirect's target was never requested
        none = MediaLimits(**OPT_IN, max_redirects=0)
        assert await fetch(f"{canary.base}/img", none) == IMAGE
        assert "more than 0 redirects" in await refused(f"{canary.base}/r/1", none)


# ---- what the client sees ---------------------------------------------------------


class MediaPreparer:
    """Prepares a request from its fetched bytes (the fetch is the prepare actor's)."""

    PREPARES_MEDIA = True

    def draft(self, req, fetched, *, abandoned=None):
        return Draft(Prepared(request_id=req.request_id, model="m", prompt_token_ids=[len(fetched[PARAM])],
                              sampling=SamplingParams()))


async def prepare_all(server: dict, urls: list[str]) -> list:
    """Each URL as one chat request through the prepare actor; its answers."""
    answers = []
    async with running_prepare_actor(MediaPreparer(), config=parse_config({"server": server}), num_workers=1) as (inbox, out):
        for i, url in enumerate(urls):
            parts = [ContentPart(type="text", text="what is it?"), ContentPart(type="image_url", url=url)]
            await inbox.send(NewRequest(request_id=f"r{i}", model="m", sampling=SamplingParams(),
                                        messages=[ChatMessage("user", parts)]))
            answers.append(await asyncio.wait_for(out.recv(), 10))
    return answers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@run_async
async def test_every_fetch_failure_gives_the_client_one_message_and_the_log_the_detail(caplog):
    """A closed port, a 404, a name resolved to a refused address and too many
    redirects answer the same 400: a client cannot tell them apart to map
    internal ports. Its own URL refused as written (an IP literal) is named."""
    caplog.set_level(logging.WARNING)
    async with canary_at() as canary:
        failing = [f"http://127.0.0.1:{closed_port()}/img", f"{canary.base}/nothing", f"{canary.base}/r/9"]
        answers = await prepare_all({"allow_private_media_addresses": True, "port": 8000},
                                    [f"{canary.base}/img", *failing])
        default = await prepare_all({}, [f"{canary.base}/img", f"http://localhost:{canary.port}/img"])
    assert isinstance(answers[0], Prepared) and answers[0].prompt_token_ids == [len(IMAGE)]
    assert all(isinstance(a, Failed) and a.status == 400 and a.param == PARAM for a in [*answers[1:], *default])
    assert {a.message for a in [*answers[1:], default[1]]} == {GENERIC}
    assert default[0].message == f"{PARAM}: not fetched: 127.0.0.1: a loopback address " \
                                 "(server.allow_private_media_addresses is off)"
    log = caplog.text
    for detail in ("ClientConnector", "HTTP 404", "more than 3 redirects", "loopback"):
        assert detail in log, (detail, log)
