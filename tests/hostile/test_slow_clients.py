"""Idle and slow clients over raw sockets: every wait is bounded by the
server's config (small timeouts here, so each test takes a second or two)."""

import asyncio
import json
import logging
import resource
import time

from tests.hostile.conftest import run

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


async def connect(h):
    return await asyncio.open_connection("127.0.0.1", h.actor.port)


async def read_until_closed(reader, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and how long that took.
    A close while the client is still sending may arrive as a reset that
    overtakes the answer: then it reads as ``RESET`` (the timing still counts)."""
    start = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        data = RESET
    return data, time.monotonic() - start


RESET = b"<reset>"


def envelope_of(response: bytes) -> dict:
    _, _, body = response.partition(b"\r\n\r\n")
    return json.loads(body)["error"]


def test_idle_and_half_header_connections_are_closed(hostile):
    async def go():
        async with hostile(keepalive_timeout_s=0.5, request_read_timeout_s=5) as h:
            idle_reader, _ = await connect(h)
            half_reader, half_writer = await connect(h)
            half_writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            await half_writer.drain()
            for reader in (idle_reader, half_reader):
                data, took = await read_until_closed(reader, 3)
                assert took < 2.5 and b" 5" not in data[:12], (took, data)
                if reader is idle_reader:  # nothing asked, nothing answered
                    assert data in (b"", RESET), data
                else:  # a request begun is answered, not dropped, naming its bound
                    assert data.startswith(b"HTTP/1.1 408"), data
                    assert "keepalive_timeout_s" in envelope_of(data)["message"], data
            # a connection between requests is idle too
            reader, writer = await connect(h)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, took = await read_until_closed(reader, 3)
            assert data.startswith(b"HTTP/1.1 200") and took < 2.5, (took, data)
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)


def test_a_header_sent_slowly_is_a_408_from_its_first_byte(hostile):
    async def go():
        async with hostile(keepalive_timeout_s=5, request_read_timeout_s=1.0) as h:
            reader, writer = await connect(h)
            header = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY)
            start = time.monotonic()

            async def drip(data: bytes, pause: float):
                for byte in data:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(pause)

            dripping = asyncio.create_task(drip(header, 0.1))  # never finishes within the bound
            try:
                data, _ = await read_until_closed(reader, 4)
            finally:
                dripping.cancel()
            took = time.monotonic() - start
            assert (data == RESET or data.startswith(b"HTTP/1.1 408")) and 0.9 < took < 2, (took, data)
            assert data == RESET or "header" in envelope_of(data)["message"], data
            # the clock runs from the first byte: a header taking half the bound leaves half for the body
            reader, writer = await connect(h)
            start = time.monotonic()
            await drip(header, 0.7 / len(header))
            dripping = asyncio.create_task(drip(BODY, 0.02))
            try:
                data, _ = await read_until_closed(reader, 4)
            finally:
                dripping.cancel()
            took = time.monotonic() - start
            assert data == RESET or data.startswith(b"HTTP/1.1 408"), data
            assert 0.9 < took < 1.35, (took, data)  # not 0.7 + 1.0
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)


def test_a_request_line_that_breaks_the_parser_closes_the_connection(hostile):
    """``CONNECT`` with no target made aiohttp's request loop fail, and the
    connection then stayed open for ever (no timer runs without that loop)."""
    async def go():
        async with hostile(keepalive_timeout_s=5) as h:
            reader, writer = await connect(h)
            writer.write(b"CONNECT  \r\nAccept: text/html\r\n\r\n")
            data, took = await read_until_closed(reader, 3)
            assert took < 1, (took, data)
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)


def test_a_body_sent_a_byte_at_a_time_is_a_408(hostile):
    async def go():
        async with hostile(keepalive_timeout_s=5, request_read_timeout_s=0.6) as h:
            reader, writer = await connect(h)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(BODY))
            start = time.monotonic()

            async def drip():
                for byte in BODY:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.1)

            dripping = asyncio.create_task(drip())
            try:
                data, _ = await read_until_closed(reader, 4)
            finally:
                dripping.cancel()
            took = time.monotonic() - start
            assert data == RESET or envelope_of(data)["code"] == "request_timeout", data
            assert (data == RESET or data.startswith(b"HTTP/1.1 408")) and 0.5 < took < 3, (took, data)
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)


def test_connections_beyond_the_bound_get_a_fast_503(hostile, caplog):
    async def go():
        async with hostile(max_connections=3, keepalive_timeout_s=5) as h:
            held = [await connect(h) for _ in range(3)]
            await asyncio.sleep(0.1)  # accepted and counted
            reader, writer = await connect(h)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, took = await read_until_closed(reader, 2)
            assert data.startswith(b"HTTP/1.1 503") and took < 1, (took, data)
            assert b"\r\nRetry-After: 1\r\n" in data.split(b"\r\n\r\n")[0], data
            error = envelope_of(data)
            assert error["code"] == "too_many_connections" and set(error) == {"message", "type", "param", "code"}
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    with caplog.at_level(logging.INFO):
        run(go)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY
    lines = [r.getMessage() for r in caplog.records if "descriptor limit" in r.getMessage()]
    assert len(lines) == 1 and "at most 3 client connections" in lines[0], lines


def test_connection_bound_keeps_descriptors_in_reserve():
    from mstar_actors.frontend.http_server import NUM_RESERVED_FDS, connection_bound

    assert connection_bound(1000, 65536) == 1000
    assert connection_bound(1000, 1024) == 1024 - NUM_RESERVED_FDS
    assert connection_bound(1000, 10) == 1


def test_a_request_answered_before_its_body_leaves_no_clock_to_the_next(hostile):
    """A preflight (or a 401) is answered before the body's read took the connection's clock: the next request
    on that connection, seconds later, was a 408 at once, its deadline counted from the preflight's first byte."""
    async def go():
        async with hostile(keepalive_timeout_s=5, request_read_timeout_s=0.6) as h:
            reader, writer = await connect(h)
            writer.write(b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://a.example\r\n"
                         b"Access-Control-Request-Method: POST\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 200"), head
            if (length := int(dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:-2]).get(
                    b"Content-Length", b"0"))):
                await reader.readexactly(length)
            await asyncio.sleep(1.0)  # past the read bound, within the keep-alive
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY))
            await writer.drain()
            await asyncio.sleep(0.1)  # the body in a packet of its own, after the header
            writer.write(BODY)
            data, _ = await read_until_closed(reader, 10)
            assert data.startswith(b"HTTP/1.1 200"), data[:300]
    run(go)


def test_a_body_past_the_limit_is_refused_and_its_rest_never_read(hostile):
    """A 413 closes the connection (aiohttp kept it open, reading on the hundreds of megabytes it had refused)."""
    async def go():
        async with hostile(max_body_bytes=1 << 16) as h:
            reader, writer = await connect(h)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (64 << 20))

            async def send_on():
                for _ in range(1024):  # 64 MiB, far past what the server takes
                    writer.write(b"x" * (64 << 10))
                    await writer.drain()

            sending = asyncio.create_task(send_on())
            try:
                data, took = await read_until_closed(reader, 10)
            finally:
                sending.cancel()
            assert data == RESET or (data.startswith(b"HTTP/1.1 413") and b"Connection: close" in data), data[:300]
            assert took < 5, took  # closed: not after all 64 MiB
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)
