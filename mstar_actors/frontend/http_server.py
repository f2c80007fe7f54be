"""The HTTP server's connection layer: limits, aiohttp's own answers, and
the JSON error envelope of what no route answers.

A client that opens connections and sends nothing must not starve others:
the soft descriptor limit is raised to the hard one at start, and the
server refuses connections beyond ``server.max_connections`` (capped below
the descriptor limit, so the process always keeps descriptors for its
rings, logs and ``/health``) with an immediate 503 instead of letting
``accept`` fail. Requests aiohttp refuses before any route runs (a malformed
request line or header, an unsupported ``Content-Encoding``) are answered
in the same JSON envelope as the app's errors.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from mstar_actors.frontend.openai_api import ApiError

# Descriptors kept for everything but client connections: shared-memory
# rings, the tokenizer's files, logs, the listening socket.
NUM_RESERVED_FDS = 64
_json = msgspec.json.Encoder()
_log = logging.getLogger("mstar_actors.frontend.http")  # refusals of what no route answers, one line each


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a sandbox may forbid it: keep the soft one
            return soft, soft
        return soft, hard
    return soft, soft


def connection_bound(max_connections: int, fd_limit: int) -> int:
    """The open connections served at once: the configured bound, capped so
    the process keeps ``NUM_RESERVED_FDS`` descriptors (and at least one connection)."""
    return max(1, min(max_connections, fd_limit - NUM_RESERVED_FDS))


class _Refusal(asyncio.Protocol):
    """Answers one fixed response to a connection over the bound, then closes.
    Waits for the request's first bytes (or a short while) so the kernel's
    buffer is read and the client sees the answer, not a reset."""

    def __init__(self, response: bytes):
        self.response = response
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._timer = asyncio.get_running_loop().call_later(0.5, self._answer)

    def data_received(self, data: bytes) -> None:
        self._answer()

    def _answer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.response)
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.transport = None


def refusal_response(status: int, reason: str, body: bytes, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection."""
    retry = f"Retry-After: {retry_after_s}\r\n" if retry_after_s is not None else ""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


class EnvelopeHandler(web.RequestHandler):
    """aiohttp's connection handler, answering its own errors with
    ``envelope(status, message) -> bytes`` (the app's JSON error body), and
    bounding the time from a request's first byte to its whole header by
    ``read_timeout`` (a 408; the app bounds the body, see ``take_request_start``)."""

    def __init__(self, manager: Any, envelope: Callable[..., bytes], read_timeout: float, **kw: Any):
        super().__init__(manager, **kw)
        self._envelope = envelope
        self._read_timeout = read_timeout
        self.request_started_at: float | None = None  # loop time of the first byte of the request being read
        self._header_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """aiohttp's request loop. Some request lines make it fail outside any
        route (``CONNECT`` with no target: an AttributeError), which left the
        connection open for ever with nothing reading it; close it instead."""
        try:
            await super().start()
        except Exception as err:
            self.log_debug("connection handler failed: %r", err)
            self.force_close()

    def data_received(self, data: bytes) -> None:
        if data and self.request_started_at is None and self._is_idle():
            self.request_started_at = asyncio.get_running_loop().time()
            if _is_http_09(data) and self.transport is not None:  # aiohttp answered it "HTTP/0.9 200", headers and all
                message = "malformed HTTP request: the request line names no HTTP version (HTTP/1.0 and 1.1 are served)"
                self.transport.write(refusal_response(400, "Bad Request", self._envelope(400, message)))
                self.force_close()
                return
        super().data_received(data)
        self._fail_pending_body()
        self._watch_header()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _is_idle(self) -> bool:
        """No request delivered to the app and waiting or running (aiohttp's internals)."""
        return not getattr(self, "_messages", None) and getattr(self, "_current_request", None) is None

    def _watch_header(self) -> None:
        if not self._is_idle():  # the header is complete: the app bounds the body
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
        elif self.request_started_at is not None and self._header_timer is None:
            deadline = self.request_started_at + self._read_timeout
            self._header_timer = asyncio.get_running_loop().call_at(deadline, self._header_overdue)

    def _process_keepalive(self) -> None:
        """aiohttp's idle timer: a connection with half a header is closed as idle (``keepalive_timeout_s``,
        against slow-header clients) but was closed unanswered; it gets its 408 first, naming the bound."""
        loop = asyncio.get_running_loop()
        waiter = getattr(self, "_waiter", None)
        if (self.request_started_at is not None and self._is_idle() and self.transport is not None
                and getattr(self, "_keepalive", False) and not getattr(self, "_force_close", True)
                and waiter is not None and not waiter.done()
                and loop.time() >= getattr(self, "_next_keepalive_close_time", float("inf"))):
            timeout = getattr(self, "_keepalive_timeout", 0)
            message = (f"request header not complete within server.keepalive_timeout_s ({timeout:g} s) of the "
                       "connection's start or its last answer")
            self.transport.write(refusal_response(408, "Request Timeout", self._envelope(408, message)))
        super()._process_keepalive()

    def _header_overdue(self) -> None:
        self._header_timer = None
        if self._is_idle() and self.transport is not None:
            message = f"request header not received within server.request_read_timeout_s ({self._read_timeout:g} s)"
            self.transport.write(refusal_response(408, "Request Timeout", self._envelope(408, message)))
            self.force_close()

    def _fail_pending_body(self) -> None:
        """A body that fails to decode at its very end (a deflate stream cut
        short) makes aiohttp queue an error answer but leaves the route's
        ``read()`` waiting for ever: hand the error to that read, so the
        client gets its 400 now. Reads aiohttp's internals; if they change,
        the body read timeout still ends the wait."""
        messages = getattr(self, "_messages", None)
        request = getattr(self, "_current_request", None)
        if not messages or request is None:
            return
        error = getattr(messages[-1][0], "exc", None)
        payload = request.content
        if isinstance(error, HttpProcessingError) and not payload.is_eof() and payload.exception() is None:
            payload.set_exception(RequestPayloadError(error.message or type(error).__name__))

    async def finish_response(self, request: Any, resp: web.StreamResponse, start_time: float | None) -> Any:
        """An error aiohttp raised outside the app's middlewares (an expectation on a path no route serves)
        came as plain text: it is the JSON envelope too."""
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and resp.content_type == "text/plain":
            message = f"{resp.reason.lower()}: {resp.text}" if resp.text else resp.reason.lower()
            resp = web.Response(status=resp.status, body=self._envelope(resp.status, message),
                                content_type="application/json")
        return await super().finish_response(request, resp, start_time)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)  # logs; raises when already answering
        self.log_debug("malformed request from %s: %s", request.remote, message or exc)
        lines = str(message or exc or "").strip().splitlines() or ["bad request"]
        text = f"malformed HTTP request: {lines[0][:200].rstrip(':')}"  # later lines quote the bytes
        param = code = None
        if "content-encoding" in lines[0].lower():  # a coding aiohttp could decode with a package it lacks
            status, param, code = 415, "Content-Encoding", "unsupported_encoding"
            text = encoding_problem(_coding_sent(request, lines[0])) or UNACCEPTED_ENCODING
        _log.info("%s: %d %s", getattr(request, "path", "?"), status, text)
        response = web.Response(status=status, body=self._envelope(status, text, param, code),
                                content_type="application/json")
        response.force_close()
        return response


def _is_http_09(data: bytes) -> bool:
    """Whether ``data``, a request's first bytes, hold a whole request line of a method and a target alone (an
    HTTP/0.9 line: no version)."""
    line, found, _ = data.partition(b"\n")
    parts = line.rstrip(b"\r").split()
    return bool(found) and len(parts) == 2 and parts[0].isalpha()


def _coding_sent(request: Any, reason: str) -> str:
    """The Content-Encoding a refused request sent: its header where aiohttp kept the request's headers, else the
    coding aiohttp's reason names ("Can not decode content-encoding: brotli (br)")."""
    sent = request.headers.get("Content-Encoding") if getattr(request, "headers", None) else None
    if sent:
        return sent
    named = re.search(r"\(([\w-]+)\)", reason) or re.search(r"content-encoding:\s*([\w-]+)", reason, re.IGNORECASE)
    return named.group(1) if named else "?"


ACCEPTED_ENCODINGS = ("gzip", "deflate", "identity")
UNACCEPTED_ENCODING = "the body's Content-Encoding is not accepted; accepted: one of gzip, deflate or identity (or none)"


def encoding_problem(value: str | None) -> str | None:
    """Why a request's Content-Encoding header is refused (aiohttp reads a
    coding it does not know, or several, as none), or None."""
    if value is None or value.strip().lower() in ("", *ACCEPTED_ENCODINGS):
        return None
    return f"{UNACCEPTED_ENCODING}, got {value[:60]!r}"


# The media types a browser posts from any page without asking the server first (CORS's "simple" requests):
# a body sent as one is no JSON a client meant, and read as JSON it would let any site's page load adapters or
# spend the engine (FastAPI, under vLLM, reads such a body as no JSON either).
SIMPLE_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def media_type_problem(value: str | None) -> str | None:
    """Why a request body's Content-Type is refused, or None (JSON, or none said)."""
    media_type = (value or "").split(";", 1)[0].strip().lower()
    if media_type not in SIMPLE_FORM_TYPES:
        return None
    return (f"the body is read as JSON, but its Content-Type is {value[:80]!r} (a form or text, as a browser page "
            "posts it); send Content-Type: application/json")


def take_request_start(request: web.BaseRequest) -> float | None:
    """The loop time of the request's first byte (None if unknown), once:
    the next request on the connection starts its own clock."""
    protocol = request.protocol
    started = getattr(protocol, "request_started_at", None)
    if started is not None:
        protocol.request_started_at = None
    return started


LISTEN_BACKLOG = 2048  # connections the kernel queues before the accept (uvicorn's, under vLLM; aiohttp's 128
# dropped a burst's connection requests, each retried by its client a second later)


class BoundedSite(web.TCPSite):
    """A TCP site whose connections get an ``EnvelopeHandler`` (made with
    ``handler_kwargs``, the runner's), and beyond ``max_connections`` a
    refusal (``response``, a whole HTTP response) instead of the app."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, max_connections: int, response: bytes,
                 envelope: Callable[[int, str], bytes], read_timeout: float, handler_kwargs: dict,
                 reuse_port: bool = False):
        super().__init__(runner, host, port, reuse_port=reuse_port or None, backlog=LISTEN_BACKLOG)
        self._read_timeout = read_timeout
        self._max_connections = max_connections
        self._response = response
        self._envelope = envelope
        self._handler_kwargs = handler_kwargs

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        if len(server.connections) >= self._max_connections:
            return _Refusal(self._response)
        return EnvelopeHandler(server, self._envelope, self._read_timeout, loop=asyncio.get_running_loop(),
                               **self._handler_kwargs)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog,
                                                reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


def loggable(text: str, limit: int) -> str:
    """``text`` for one log line: control characters escaped (a client's newline forges no line), cut at ``limit``."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."



MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


def path_problem(path: str) -> str | None:
    """Why ``path`` can't be a file-system path at all (None: it can). Checked
    before any file-system call: those raise on NULs and unencodable text."""
    if len(path) > MAX_PATH_CHARS:
        return f"{len(path)} characters; a path has at most {MAX_PATH_CHARS}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "contains a NUL or another control character; a path may not"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (a lone surrogate); a path must be"
    return None


def payload_reason(err: Exception, request: web.Request) -> str:
    """What the client sent wrong, in a line: aiohttp's payload errors wrap the cause."""
    cause = err.__cause__ if isinstance(err, RequestPayloadError) and err.__cause__ else err
    encoding = request.headers.get("Content-Encoding")
    text = str(getattr(cause, "message", "") or cause)
    # parser errors quote the bytes on later lines
    detail = (text.strip().splitlines() or [type(cause).__name__])[0][:200].rstrip(":")
    if encoding:
        return f"Content-Encoding {encoding!r} does not match the body: {detail}".rstrip(": ")
    return detail


def envelope_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return _json.encode(ApiError(status, message, param=param, code=code).envelope())


def error_response(err: ApiError) -> web.Response:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return web.Response(status=err.status, body=_json.encode(err.envelope()), content_type="application/json",
                        headers=headers)


def http_message(err: web.HTTPException, request: web.Request) -> str:
    if err.status == 413:
        return (f"request body too large: {err.text.rstrip('.')} (server.max_body_bytes); send less, or raise the "
                "limit in the config")
    if err.status == 404:
        return f"no route {request.method} {request.path}; see /v1/chat/completions, /v1/completions, /v1/responses, /v1/models"
    return f"{err.reason}: {request.method} {request.path}"


def http_code(err: web.HTTPException) -> str | None:
    return {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(err.status)


def route_of(request: web.Request) -> str:
    """The route's path as registered (an alias counts as its route); a 405's is the route its path names."""
    info = request.match_info.route.resource
    if info is None and getattr(request.match_info.http_exception, "status", None) == 405:
        info = next((r for r in request.app.router.resources() if _names(r, request.path)), None)
    return (info.canonical.rstrip("/") or "/") if info is not None else "unmatched"


def _names(resource: Any, path: str) -> bool:
    """Whether ``resource`` (plain, or with variables) is the route of ``path``."""
    info = resource.get_info()
    return info.get("path") == path or ("pattern" in info and info["pattern"].fullmatch(path) is not None)
