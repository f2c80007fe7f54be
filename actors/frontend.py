"""The frontend actor: OpenAI-compatible HTTP in, engine requests out.

Channels (see ``actors.base``): inbox ``"conductor"`` (``ConductorToFrontend``)
and ``"control"``; outbox ``"prepare"`` (``FrontendToPrepare``) and
``"control"``. ``start()`` loads the tokenizer and opens the aiohttp site
(uvloop in the actor process); ``handle`` routes engine messages to the HTTP
exchange that waits for them; what the client receives is built by
``mstar_actors.frontend.responses``, errors outside a route by
``mstar_actors.frontend.http_server``. The served name, the vocabulary and the context
are the launcher's ``ModelInfo``; the conductor's ``ContextAgreed`` narrows the
context to what the ranks' KV cache holds.

Concurrency invariants (one asyncio loop, no threads touch this state):

- The mailbox's single reader never blocks on a client. Each HTTP exchange has
  its own queue (``mstar_actors.frontend.exchange``: bounded by what it can
  legitimately receive), and ``handle`` only ever ``push``es into it without
  waiting. A slow client therefore holds at most its own tokens in memory and
  never makes the frontend drop or stall anyone's.
- A stream writes what its queue holds at once: the outputs of each choice
  that queued while the last event was written leave in one event (their
  text, logprobs and token ids together), so under load the events per token
  fall instead of the backlog growing; a stream that keeps up sends one per
  token.
- Every engine request the frontend sent is aborted unless it finished, on
  every exit path of its handler (client gone: aiohttp cancels the handler;
  write failed; error; stop-string match), so the conductor frees its blocks.
- Speech (``/v1/audio/speech``) decodes codec tokens to audio on the codec's
  own thread (``mstar_actors.speech``), which sees only the frames it is
  handed: the loop awaits it and stays free.
- Waiting requests are ``max(EngineStats.num_waiting, unacknowledged)``: a
  request with no engine output yet is in prepare or in the engine's waiting
  queue, so summing the two would count the latter twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web, web_urldispatcher
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from actors.base import CONTROL, Actor, Mailbox
from mstar_actors.config import ConfigError, server_url
from mstar_actors.frontend import http_server as http
from mstar_actors.frontend import openai_api as api
from mstar_actors.frontend import responses
from mstar_actors.messages import (
    Abort,
    AdapterUpdate,
    ContextAgreed,
    Drain,
    Drained,
    EngineStats,
    Failed,
    Finished,
    LoadAdapter,
    ModelsChanged,
    NewRequest,
    PeerFailed,
    TokenDelta,
    UnloadAdapter,
    new_request_id,
)
from mstar_actors.frontend.admission import EngineLoad, admission_refusal
from mstar_actors.frontend.exchange import Exchange, failure
from mstar_actors.frontend.metrics import Metrics
from mstar_actors.frontend.openai_api import ApiError, ChoiceOutput, ParsedRequest, error_type_of
from mstar_actors.frontend.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    prompt_reasoning,
    reasoning_end,
)
from mstar_actors.frontend.response_store import ResponseStore, input_items_page
from mstar_actors.frontend.responses_api import new_id, read_responses
from mstar_actors.frontend.tool_calls import (
    LLAMA3_JSON,
    QWEN3_CODER,
    choose_parser,
    marker_problem,
)
from mstar_actors.frontend.xml_calls import CALL_OPENING as XML_CALL_OPENING
from transport.errors import ChannelFull, MessageTooLarge

_json = msgspec.json.Encoder()
# Engine messages the loop takes in before the streams write (a backlog: the
# loop takes what has arrived). Streams write between batches, so batches of
# one step's outputs (256 at 256 running requests) would send an event a token
# however far behind they fall; at 2048 the queued tokens leave together, and
# the events a request fall as the load rises (``tools/bench_frontend.py``).
MAILBOX_SIZE = 2048
# With server.api_key, /v1/* and these need the key (as vLLM's); /health, /ping,
# /metrics and /version stay open for probes and scrapers.
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
CLIENT_CLOSED = 499  # mstar_requests_total's status for a request whose client went away (nginx's code)
DRAIN_FAILURE_WRITE_S = 2.0  # after the drain's timeout: time for handlers to send their 503
REQUEST_STARTED = web.RequestKey("request_started", object)  # the loop time of a request's first byte (or None)
REQUEST_ID = web.RequestKey("request_id", str)  # a generation's X-Request-Id: the client's as sent, else its id


class FrontendActor(Actor):
    """See the module docstring."""

    def __init__(self, *, index: int = 0, metrics_dir: str | None = None, **kw: Any):
        super().__init__(**kw)
        # Of server.api_server_count frontends on one port: its request ids name it (new_request_id).
        self.index = index
        self.mailbox = Mailbox(self.inbox, max_pending=MAILBOX_SIZE)
        lora = self.config.lora  # adapters served: vllm:lora_requests_info, as vLLM's with LoRA on
        serves_adapters = self.info.lora_base is not None and (lora.adapters or lora.allow_runtime_updates)
        cache = {"block_size": str(self.config.kv.block_size), "cache_dtype": self.info.dtype,
                 "enable_prefix_caching": str(self.config.kv.enable_prefix_caching)}
        self.metrics = Metrics(metrics_dir, self.info.served_name, self.info.max_model_len,
                               max_lora=lora.max_loras if serves_adapters else None, cache_config=cache)
        store_mib = self.config.server.responses_store_mib  # the Responses kept (one frontend: config's rule)
        self.responses = ResponseStore(store_mib << 20) if store_mib else None
        self.port: int | None = None  # the bound port, once started
        self._is_started = CONTROL not in self.inbox  # without a launcher: ready when started
        self._failure: str | None = None  # a peer's failure: unhealthy from then on
        self._draining: str | None = None  # why new requests are refused while in-flight ones finish
        self.health_changed = asyncio.Event()  # set when Started / PeerFailed was applied
        self._exchanges: dict[str, Exchange] = {}  # request id -> its exchange
        self._updates: dict[str, asyncio.Future] = {}  # runtime load/unload id -> its AdapterUpdate
        self.adapters: dict[str, str] = {}  # served adapter name -> path (set in start)
        self._unacked: set[str] = set()
        self._num_engine_waiting = self._num_engine_running = self._num_engine_starting = 0  # its last EngineStats
        self._background: set[asyncio.Task] = set()
        self._idle = asyncio.Event()  # set when an exchange closes (the drain waits on it)
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ------------------------------------------------------

    async def start(self) -> None:
        from mstar_actors.prepare.media import keep_freed_buffers

        keep_freed_buffers()  # request bodies of megabytes, one after another: see there

        # name -> path; the conductor's ModelsChanged replaces it after each runtime load / unload
        self.adapters = dict(self.config.lora.adapters)
        self.tokenization = await self.run_blocking(_load_tokenization, Path(self.info.model_dir))
        self.tokenizer = self.tokenization.tokenizer
        self.token_text = functools.lru_cache(maxsize=65536)(self._decode_one)
        self.token_bytes = functools.lru_cache(maxsize=65536)(self.tokenization.token_bytes)
        self.tool_parser = choose_parser(self.tokenizer.chat_template, self.config.model.tool_call_parser)
        self.log.info("tool calls read as %s", self.tool_parser or "none (forced calls only: bare JSON)")
        problem = marker_problem(self.tool_parser, set(self.tokenizer.all_special_tokens))
        if problem:
            self.log.warning("%s", problem)
        self.reasoning_parser = self.config.model.reasoning_parser
        self._opening: dict[str, str | None] = {}  # chat_template_kwargs -> the generation prompt's text
        self.think_ids: tuple[int, int] | None = None  # <think>, </think>: structured outputs hold after the reasoning
        if self.reasoning_parser:
            ids = tuple(self.tokenization.single_token_id(tag) for tag in (THINK_OPEN, THINK_CLOSE))
            if None not in ids and max(ids) < self.info.vocab_size:
                self.think_ids = ids
            self.log.info("chat replies' reasoning read as %s (model.reasoning_parser); structured outputs hold %s",
                          self.reasoning_parser, "after </think>" if self.think_ids else
                          "from a reply's first token (no reasoning): <think> and </think> are not plain tokens "
                          "of its own")
        self.speech = None  # the speech route's codec and tokens (speech.snac_path)
        if self.config.speech.snac_path:
            self.speech = await self.run_blocking(_load_speech, self.config.speech, self.tokenizer, self.info.vocab_size)
            self.log.info("speech: SNAC codec on %s, %d Hz", self.speech.codec.device, self.speech.codec.sample_rate)
        self.started_at = int(time.time())
        await self._open_site()

    def _decode_one(self, token_id: int) -> str:
        """A token's own text for logprobs (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _open_site(self) -> None:
        server = self.config.server
        handler_kwargs = dict(access_log=None, keepalive_timeout=server.keepalive_timeout_s)
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, shutdown_timeout=2.0, **handler_kwargs)
        await self._runner.setup()
        before, fd_limit = http.raise_descriptor_limit()
        max_connections = http.connection_bound(server.max_connections, fd_limit)
        self.log.info("descriptor limit %d (was %d): at most %d client connections at once", fd_limit, before,
                      max_connections)
        refusal = ApiError(503, f"too many connections: the server takes {max_connections} at once; retry later",
                           code="too_many_connections")
        # Several frontends bind the one port (SO_REUSEPORT): the kernel spreads the connections.
        site = http.BoundedSite(self._runner, server.host, server.port, max_connections,
                                http.refusal_response(503, "Service Unavailable", _json.encode(refusal.envelope()), 1),
                                http.envelope_bytes, server.request_read_timeout_s, handler_kwargs,
                                reuse_port=server.api_server_count > 1)
        try:
            await site.start()
        except OSError as err:  # taken since the launcher's check (another server started meanwhile)
            raise ConfigError(f"cannot listen on {server.host}:{server.port} ({err.strerror}); stop what holds the "
                              "port or choose another (server.port, --port)") from None
        self.port = self._runner.addresses[0][1]
        self.address = server_url(server.host, self.port)
        self.log.info("listening for %s on %s%s (a 503 until every actor is ready)", self.info.served_name,
                      self.address,
                      f" (frontend {self.index + 1} of {server.api_server_count})" if server.api_server_count > 1 else "")

    async def stop(self) -> None:
        if self.failure:  # a channel from a peer broke (it died before the launcher could say so): why, not "stopped"
            reason = f"the server failed: {self.failure}; the server must be restarted"
        else:
            reason = f"the server is shutting down ({self.stop_reason or 'stopped'})"
        self._draining = self._draining or reason  # a request arriving from here on gets a 503 at once
        self._fail_all(503, reason, None if self.failure else "shutting_down")
        # Their handlers write the error (a stream's last event) before the connections close.
        await self._await_idle(DRAIN_FAILURE_WRITE_S)
        if self._runner is not None:
            await self._runner.cleanup()
        if getattr(self, "speech", None) is not None:
            self.speech.close()

    def on_started(self) -> None:
        self._is_started = True
        self.health_changed.set()

    def on_peer_failed(self, msg: PeerFailed) -> None:
        super().on_peer_failed(msg)
        self._failure = f"the {msg.actor} actor failed: {msg.reason}"
        self._fail_all(503, f"{self._failure}; the server must be restarted")
        self.health_changed.set()

    # ---- engine messages ----------------------------------------------

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case TokenDelta() | Finished() | Failed():
                self._unacked.discard(msg.request_id)
                exchange = self._exchanges.get(msg.request_id)
                if exchange is not None:  # else: aborted earlier; late outputs are expected
                    exchange.push(msg)
            case EngineStats():
                self._num_engine_waiting, self._num_engine_running = msg.num_waiting, msg.num_running
                self._num_engine_starting = msg.num_starting
                self.metrics.observe_engine(msg, counts_events=self.index == 0)
            case ModelsChanged(adapters=adapters):
                self.adapters = {a.name: a.path for a in adapters}
            case ContextAgreed(max_model_len=max_model_len):
                self.info = msgspec.structs.replace(self.info, max_model_len=max_model_len)
            case Drain():
                self._start_drain(msg)
            case AdapterUpdate(request_id=request_id):
                future = self._updates.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            case _:
                self.unknown(channel, msg)

    # ---- graceful shutdown ----------------------------------------------

    def _start_drain(self, msg: Drain) -> None:
        """Runs in the background: the mailbox keeps delivering the outputs
        that let in-flight requests finish."""
        if self._draining is None:
            self._draining = msg.reason or "the server is shutting down"
            self.log.info("draining: new requests get 503; %d requests in flight have %g s to finish",
                          len({id(e) for e in self._exchanges.values()}), msg.timeout_s)
            self.health_changed.set()
            task = asyncio.ensure_future(self._drain(msg.timeout_s))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _drain(self, timeout_s: float) -> None:
        num_failed = 0
        if not await self._await_idle(timeout_s):
            num_failed = len({id(e) for e in self._exchanges.values()})
            self.log.warning("%d requests still running after server.shutdown_timeout_s (%g s): failing them",
                             num_failed, timeout_s)
            self._fail_all(503, f"the server shut down before this request finished "
                                f"(server.shutdown_timeout_s = {timeout_s:g} s)", "shutting_down")
            await self._await_idle(DRAIN_FAILURE_WRITE_S)  # their handlers write the error
        await self.report(Drained(num_failed=num_failed))

    async def _await_idle(self, timeout_s: float) -> bool:
        """True once no exchange and no adapter update is open, within ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._exchanges or self._updates:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), remaining)
        return True

    def _fail_all(self, status: int, message: str, code: str | None = None) -> None:
        """Every open request and adapter update fails with ``message`` (``code``: as a new request's
        503 says the same, ``_check_available``)."""
        for rid, future in list(self._updates.items()):
            if not future.done():
                future.set_result(AdapterUpdate(request_id=rid, status=status, message=message))
        for rid, exchange in list(self._exchanges.items()):
            exchange.push(Failed(request_id=rid, status=status, message=message, error_type=error_type_of(status),
                                 code=code))

    # ---- HTTP app -------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.server.max_body_bytes,
                              middlewares=[self._clock_middleware, self._preflight_middleware, self._errors_middleware,
                                           self._auth_middleware, self._body_middleware])
        app.on_response_prepare.append(self._cors_headers)
        post = functools.partial(app.router.add_post, expect_handler=self._expect)
        get = functools.partial(app.router.add_get, expect_handler=self._expect)
        post("/v1/chat/completions", functools.partial(self._generate, kind="chat"))
        post("/v1/completions", functools.partial(self._generate, kind="completion"))
        post("/v1/responses", self._respond)
        get("/v1/responses/{response_id}", self._stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self._stored_response)
        get("/v1/responses/{response_id}/input_items", self._input_items)
        post("/v1/audio/speech", self._speech)
        get("/v1/models", self._models)
        get("/v1/models/{model_id:.+}", self._model)
        post("/tokenize", self._tokenize)
        post("/detokenize", self._detokenize)
        get("/version", self._version)
        get("/ping", self._health)
        post("/ping", self._health)
        post("/v1/load_lora_adapter", functools.partial(self._update_adapter, kind="load"))
        post("/v1/unload_lora_adapter", functools.partial(self._update_adapter, kind="unload"))
        get("/health", self._health)
        get("/metrics", self._metrics)
        # Each route with a trailing slash too, as vLLM's server takes it (it redirects): clients whose base URL
        # ends in a slash keep working. Served, not redirected: a redirect would send the body twice.
        for route in list(app.router.routes()):
            path = route.resource.canonical if route.resource is not None else ""
            if route.method != "HEAD" and path.startswith("/") and not path.endswith("/") and "{" not in path:
                add = app.router.add_get if route.method == "GET" else functools.partial(app.router.add_route,
                                                                                         route.method)
                add(path + "/", route.handler, expect_handler=self._expect)  # a GET's HEAD too
        return app

    def _allowed_origin(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin a browser's request gets (None: no CORS)."""
        origin, allowed = request.headers.get("Origin"), self.config.server.allowed_origins
        if origin is None:
            return None
        return "*" if "*" in allowed else origin if origin in allowed else None

    @web.middleware
    async def _clock_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The loop time of this request's first byte, taken from its connection for every request (the
        body's deadline counts from it): one answered before the body's read (a preflight, a 401) left it
        there, and the connection's next request, seconds later, was a 408 at once."""
        request[REQUEST_STARTED] = http.take_request_start(request)
        return await handler(request)

    @web.middleware
    async def _preflight_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A browser's CORS preflight: answered here, before the API key (a
        preflight carries none); from an origin not allowed, a 400 naming it
        (as vLLM's CORS layer)."""
        if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
                and "Origin" in request.headers):
            if self._allowed_origin(request) is None:
                origin = request.headers["Origin"][:200]
                self.metrics.observe_request(http.route_of(request), 400)
                return self._refused(request, ApiError(400, f"disallowed CORS origin {origin!r}: not in "
                                                            "server.allowed_origins", param="Origin",
                                                            code="disallowed_origin"))
            return web.Response(headers={
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "600",
            })
        return await handler(request)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer's headers: CORS where allowed, and the server's name with no versions (aiohttp's named
        Python's and its own, as a scanner reads them)."""
        response.headers["Server"] = "mstar-actors"
        if (request_id := request.get(REQUEST_ID)) is not None:  # (the openai client's ``.request_id``)
            response.headers["X-Request-Id"] = request_id
        origin = self._allowed_origin(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            if origin != "*":
                response.headers["Vary"] = "Origin"

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error leaves in OpenAI's envelope; every status is counted."""
        try:
            response = await handler(request)
        except ApiError as err:
            response = self._refused(request, err)
        except web.HTTPException as err:  # 404 route, 405, 413 body too large
            if err.status < 400:
                raise
            response = self._refused(request, ApiError(err.status, http.http_message(err, request),
                                                       code=http.http_code(err),
                                                       param="body" if err.status == 413 else None))
            if request.can_read_body:  # the rest of the body is never read (413; no route's 404 / 405)
                response = self._unread(request, response)
            if "Allow" in err.headers:  # a 405 names the methods the route takes
                response.headers["Allow"] = err.headers["Allow"]
        except asyncio.CancelledError:
            self.metrics.observe_request(http.route_of(request), CLIENT_CLOSED)
            raise  # the client went away: nobody to answer
        except ConnectionError:  # a write met the closed connection before aiohttp cancelled the handler
            self.metrics.observe_request(http.route_of(request), CLIENT_CLOSED)
            return web.Response(status=CLIENT_CLOSED)  # aiohttp's write of it fails quietly (raised, it logs a traceback)
        except Exception as err:  # a bug of ours: this request fails alone, in the envelope
            self.log.exception("request %s %s failed", request.method, request.path)
            response = http.error_response(ApiError(500, f"internal error: {type(err).__name__}: {err}"))
        self.metrics.observe_request(http.route_of(request), response.status)
        return response

    def _refused(self, request: web.Request, err: ApiError) -> web.Response:
        """The error's response, and a line in the log (as vLLM's access log and its validation errors
        give): an operator sees why a client's requests fail. Successes leave no line (per request
        at thousands a second, the log would be the bottleneck)."""
        self.log.info("%s %s: %d %s", request.method, http.loggable(request.path, 200), err.status,
                      http.loggable(err.message, 300))
        return http.error_response(err)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refusal = self._auth_refusal(request)
        if refusal is not None:
            raise refusal
        return await handler(request)

    def _auth_refusal(self, request: web.Request) -> ApiError | None:
        key = self.config.server.api_key
        path = request.path.rstrip("/")  # a route's trailing-slash alias is the route
        if key and (path.startswith("/v1/") or path in GUARDED_PATHS):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # header bytes that aren't UTF-8 arrive as surrogate escapes: compare them as sent
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                                      key.encode()):
                return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        return None

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a body the request would be refused for (no
        key, a declared size past the limit) is refused before the client sends it.
        Another expectation is ignored, as uvicorn's (aiohttp's 417 was plain text)."""
        limit = self.config.server.max_body_bytes
        refusal = self._auth_refusal(request)
        if refusal is None and (request.content_length or 0) > limit:
            refusal = ApiError(413, f"request body too large: {request.content_length} bytes declared; the limit is "
                                    f"server.max_body_bytes ({limit})", param="body", code="request_too_large")
        if refusal is None:
            if request.headers.get("Expect", "").lower() != "100-continue":
                return None
            return await web_urldispatcher._default_expect_handler(request)
        self.metrics.observe_request(http.route_of(request), refusal.status)
        response = self._refused(request, refusal)
        response.force_close()  # the body it declared is not read
        return response

    @web.middleware
    async def _body_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The whole body is read before any route runs (routes' ``read()`` then
        returns it), so a body the client can't deliver is the client's error
        on every route: undecodable (a 400), or not received in time (a 408;
        the clock started at the request's first byte). A coding not taken, or
        a body sent as a form or text (``media_type_problem``), is a 415 unread;
        a path no route takes, its 404 or 405 unread, whatever the body."""

        if request.match_info.http_exception is not None:  # no route: its 404 or 405, the body unread
            return await handler(request)
        if request.can_read_body:
            for header, problem_of, code in (("Content-Encoding", http.encoding_problem, "unsupported_encoding"),
                                             ("Content-Type", http.media_type_problem, "unsupported_media_type")):
                if (problem := problem_of(request.headers.get(header))) is not None:
                    return self._unread(request, self._refused(request, ApiError(415, problem, param=header,
                                                                                 code=code)))
        timeout = self.config.server.request_read_timeout_s
        started = request.get(REQUEST_STARTED)
        deadline = (started if started is not None else asyncio.get_running_loop().time()) + timeout
        try:
            async with asyncio.timeout_at(deadline):
                await request.read()
        except TimeoutError:
            err = ApiError(408, f"request not received within server.request_read_timeout_s ({timeout:g} s)",
                           param="body", code="request_timeout")
        except (RequestPayloadError, HttpProcessingError) as exc:
            err = ApiError(400, f"body: could not be read as sent ({http.payload_reason(exc, request)})",
                           param="body", code="invalid_body")
        else:
            return await handler(request)
        return self._unread(request, self._refused(request, err))

    @staticmethod
    def _unread(request: web.Request, response: web.Response) -> web.Response:
        """``response`` to a request whose body's rest is never read: answered, then its connection closed
        (the body marked ended keeps aiohttp from reading on after the answer)."""
        request.content.feed_eof()
        response.force_close()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        if self._failure or self._draining or not self._is_started:
            return web.json_response({"status": self._failure or self._draining or "starting"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _models(self, request: web.Request) -> web.Response:
        self._check_started()
        return web.json_response(api.models_list(self.info.served_name, self.started_at, self.info.max_model_len,
                                                 self.adapters))

    async def _model(self, request: web.Request) -> web.Response:
        self._check_started()
        model_id = request.match_info["model_id"].removesuffix("/")  # a trailing slash is the card's route
        listing = api.models_list(self.info.served_name, self.started_at, self.info.max_model_len, self.adapters)
        card = api.model_card(listing, model_id)
        if card is None:
            self._resolve_model(model_id)  # the 404 model_not_found naming what is served
        return web.json_response(card)

    async def _version(self, request: web.Request) -> web.Response:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return web.json_response({"version": version("mstar-actors")})
        except PackageNotFoundError:  # run from a source tree that was never installed
            return web.json_response({"version": "unknown"})

    # ---- vLLM's /tokenize and /detokenize ---------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        parsed = api.parse_tokenize(await request.read())
        self._resolve_model(parsed.model)
        tokens = await self.run_blocking(self._tokenize_ids, parsed)
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if parsed.return_token_strs else None
        return web.json_response({"count": len(tokens), "max_model_len": self.info.max_model_len, "tokens": tokens,
                                  "token_strs": strs})

    def _tokenize_ids(self, parsed: api.TokenizeRequest) -> list[int]:
        # the whole text, as vLLM's: a client measures a text past the context to cut it
        # (server.max_body_bytes bounds it)
        try:
            if parsed.messages is None:
                return self.tokenization.encode_text(parsed.prompt, parsed.add_special_tokens)
            self._check_text_only(parsed.messages)
            ids = self.tokenization.apply_chat_template(parsed.messages, parsed.add_generation_prompt, None,
                                                        parsed.continue_final_message, tools=parsed.tools,
                                                        tool_format=self.tool_parser or LLAMA3_JSON,
                                                        template_kwargs=parsed.chat_template_kwargs)
        except ValueError as err:  # no chat template, or the template refused the messages
            raise ApiError(400, f"messages: {err}", param="messages") from None
        return self.tokenization.with_special_tokens(ids) if parsed.add_special_tokens else ids

    def _check_text_only(self, chat: list) -> None:
        """/tokenize counts text: a media part's tokens follow its decoded size,
        which preparation finds; refused by its part, saying where to count it."""
        from mstar_actors.prepare.preparers import first_media_part

        if (media := first_media_part(chat)) is None:
            return
        why = ("/tokenize counts text only: a media part's tokens follow its decoded size, found as the request is "
               "prepared; send the chat to /v1/chat/completions with max_tokens 1 and read usage.prompt_tokens"
               if self.info.is_multimodal else "this model reads text only")
        raise ApiError(400, f"{media[0]}: {why}", param=media[0])

    async def _detokenize(self, request: web.Request) -> web.Response:
        model, tokens = api.parse_detokenize(await request.read(), self.info.vocab_size)
        self._resolve_model(model)
        text = await self.run_blocking(self.tokenizer.decode, tokens)
        return web.json_response({"prompt": text})

    # ---- runtime adapter updates (vLLM's routes and bodies) ---------------

    async def _update_adapter(self, request: web.Request, kind: str) -> web.Response:
        """Validated here as far as the body goes; the conductor (and the reader
        it asks) decide. A 200 answers with vLLM's plain-text message."""
        raw = await request.read()
        self._check_available()
        if not self.config.lora.allow_runtime_updates:
            raise ApiError(403, "runtime LoRA updates are off; set lora.allow_runtime_updates: true in the config",
                           code="runtime_updates_disabled", error_type="permission_error")
        body = api.decode_body(raw)
        api.check_adapter_fields(body, kind)
        name = self._adapter_name(body)
        rid = new_request_id("lora", self.index)
        if kind == "load":
            replace = api.get_bool(body, "load_inplace", False)
            if name in self.adapters and not replace:
                raise ApiError(400, f"lora_name: the adapter {name!r} is already loaded; send load_inplace: true "
                               "to replace it", param="lora_name", code="adapter_already_loaded")
            msg = LoadAdapter(request_id=rid, name=name, path=self._runtime_path(body), replace=replace)
        else:
            msg = UnloadAdapter(request_id=rid, name=name)
        future = self._updates[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.outbox["prepare"].send(msg)
            update = await future
        finally:
            self._updates.pop(rid, None)
            self._idle.set()
        if update.status != 200:
            about_path = kind == "load" and update.code != "adapter_already_loaded"
            raise ApiError(update.status, update.message, param="lora_path" if about_path else "lora_name",
                           code=update.code, error_type="permission_error" if update.status == 403 else None)
        return web.Response(text=update.message)

    def _adapter_name(self, body: dict) -> str:
        from mstar_actors.lora.names import name_problem

        name = api.get_str(body, "lora_name", None)
        if not name:
            raise ApiError(400, "lora_name is required: the name clients will put in the model field",
                           param="lora_name")
        problem = name_problem(name, self.info.served_name)
        if problem:
            raise ApiError(400, f"lora_name: {problem}", param="lora_name", code="invalid_adapter_name")
        return name

    def _runtime_path(self, body: dict) -> str:
        from mstar_actors.lora.paths import AdapterPathError, resolve_runtime_path

        path = api.get_str(body, "lora_path", None)
        if not path:
            raise ApiError(400, "lora_path is required: a PEFT adapter folder inside lora.adapter_dirs",
                           param="lora_path")
        problem = http.path_problem(path)
        if problem:
            raise ApiError(400, f"lora_path: {problem}", param="lora_path", code="invalid_adapter_path")
        try:
            return resolve_runtime_path(path, self.config.lora.adapter_dirs)
        except AdapterPathError as err:
            raise ApiError(403, str(err), param="lora_path", code="adapter_path_not_allowed",
                           error_type="permission_error") from None

    # ---- generation -----------------------------------------------------

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
        self._check_available()
        # The one vocabulary check is here (the embedding's rows); the prompt's length
        # is the scheduler's to check, its 400 comes back as Failed.
        if kind == "chat":
            parsed = self._parse_chat(raw)
        else:
            parsed = api.parse_completion(raw, self.info.max_model_len, self.info.vocab_size,
                                          defaults=self.info.sampling_defaults)
        return await self._serve(request, parsed)

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses``: served as the chat it asks for (``responses_api``), every error named by the
        field its body sent."""
        raw = await request.read()
        self._check_available()
        asked = read_responses(raw, self.responses)
        try:
            return await self._serve(request, self._parse_chat(_json.encode(asked.chat)), asked)
        except ApiError as err:
            raise asked.renamed(err) from None

    def _stored(self, request: web.Request) -> Any:
        """The stored Response the route names (``server.responses_store_mib``), else a 404 saying why."""
        response_id = request.match_info["response_id"]
        stored = None if self.responses is None else self.responses.get(response_id)
        if stored is None:
            why = ("nothing is stored here: start the server with server.responses_store_mib"
                   if self.responses is None else "a response is kept only where its request left store true, "
                                                  "while the store has room (the least recently used dropped)")
            raise ApiError(404, f"no response found with id {response_id!r}; {why}", param="response_id",
                           code="not_found")
        return stored

    async def _stored_response(self, request: web.Request) -> web.Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: a stored Response, or its deletion."""
        stored = self._stored(request)
        response_id = request.match_info["response_id"]
        if request.method == "DELETE":
            self.responses.pop(response_id)
            return web.json_response({"id": response_id, "object": "response", "deleted": True})
        return web.Response(body=stored.response_json, content_type="application/json")

    async def _input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items``: its conversation's input items, a page of them."""
        page = input_items_page(self._stored(request).items, request.query)
        return web.Response(body=_json.encode(page), content_type="application/json")

    def _parse_chat(self, raw: bytes) -> ParsedRequest:
        return api.parse_chat(raw, self.info.max_model_len, self.info.vocab_size, tool_parser=self.tool_parser,
                              takes_media=self.info.is_multimodal, defaults=self.info.sampling_defaults)

    async def _serve(self, request: web.Request, parsed: ParsedRequest, asked: Any = None) -> web.StreamResponse:
        """A parsed chat or completion request, answered (``asked``: a Responses request's reply)."""
        kind = parsed.kind
        header = api.checked_request_id(request.headers.get("X-Request-Id") or None, "X-Request-Id")
        if header is not None and asked is None:  # vLLM's: the header before the body's (a Response's id: its own)
            parsed.request_id = header
        parsed.with_token_facts(self.info.eos_token_ids, self._bad_words_token_ids(parsed.bad_words), self.think_ids)
        reasoning = self._with_reasoning_parser(parsed) if kind == "chat" and self.reasoning_parser else None
        exchange = Exchange(parsed, self._resolve_model(parsed.model), "chatcmpl" if kind == "chat" else "cmpl",
                            self.index)
        exchange.reasoning = reasoning
        if asked is not None:  # a Response's id: vLLM's request_id as sent, else resp_ and a fresh one
            exchange.response_id = parsed.request_id or new_id("resp")
        request[REQUEST_ID] = header or exchange.response_id  # (echoed as sent, as vLLM's request id headers)
        if parsed.output.echo:
            exchange.prompt_token_ids = await self.run_blocking(self._prompt_token_ids, exchange)
        self._admit(exchange)
        try:
            await self._submit(exchange)
            if asked is not None:
                return await self._stream(request, exchange,
                                          responses.ResponsesStream(request, exchange, asked, self.responses))
            if parsed.stream:
                return await self._stream(request, exchange)
            return await self._collect(exchange)
        finally:
            self._close(exchange)

    def _with_reasoning_parser(self, parsed: ParsedRequest) -> tuple[str, bool, str | None] | None:
        """How a chat reply is read with ``model.reasoning_parser``: ``(parser, the prompt opened the
        reasoning, what else ends it: a qwen3 reply's call opening where it reads calls)``, or None where it
        has none (its prompt closed it: all answer, as vLLM reads it). A structured output's constraint
        is set to hold from the token after ``</think>``, as vLLM's; a forced tool call's reply is held to
        the call from its first token (its prompt ends inside the call): no reasoning, its prompt's
        thinking closed before the call as a template closes it when thinking is off (``reasoning_end``)."""
        spec = parsed.sampling.structured
        if parsed.tools is not None and parsed.tools.is_forced:
            state = self._prompt_reasoning(parsed)
            if parsed.add_generation_prompt or state == "open":
                end = reasoning_end(self._followed_text(parsed) or "") if state != "closed" else ""
                parsed.tools = dataclasses.replace(parsed.tools, reasoning_end=end)
            return None
        tools = parsed.tools
        # a call a qwen3 reply opens ends its reasoning where it reads qwen3_coder calls (Qwen3.5 opens them while
        # thinking); strict calls with no answer's rule are then held from the first token, the rest of the
        # reasoning free (so too where the think tags are no single tokens to hold a rule back after). Any other
        # constraint holds after the reasoning, the calls' of another format (whose reader keeps a call opened
        # inside the reasoning as reasoning) included, and then no call opened inside it ends the reasoning: the
        # grammar never saw one.
        calls_open = (self.reasoning_parser == "qwen3" and tools is not None and tools.reads_calls
                      and tools.parser == QWEN3_CODER)
        gated = spec is not None and not ((calls_open or self.think_ids is None) and spec.kind == "tagged_calls"
                                          and "answer" not in msgspec.json.decode(spec.spec))
        if gated and self.think_ids is None:
            return None
        state = self._prompt_reasoning(parsed)
        if state == "closed":
            return None
        opened = state == "open"
        if gated:
            spec = msgspec.structs.replace(spec, reasoning=self.think_ids,
                                           opened=opened or self.reasoning_parser == "deepseek_r1")
            parsed.sampling = msgspec.structs.replace(parsed.sampling, structured=spec)
        calls_open = calls_open and not gated
        return self.reasoning_parser, opened, XML_CALL_OPENING if calls_open else None

    def _prompt_reasoning(self, parsed: ParsedRequest) -> str | None:
        """``prompt_reasoning`` of what the reply follows (``_followed_text``); a continued message with
        no tag goes on as an answer (templates close the rest)."""
        text = self._followed_text(parsed)
        if parsed.continue_final_message:
            return prompt_reasoning(text or "") or "closed"
        return None if text is None else prompt_reasoning(text)

    def _followed_text(self, parsed: ParsedRequest) -> str | None:
        """The text the reply follows: the message it continues (``continue_final_message``), else the
        generation prompt (a template that ends it with ``<think>``, as Qwen3.5's thinking one does, or
        with ``<think></think>`` when thinking is off), None with neither: the template rendered once per
        set of chat_template_kwargs, a few hundred sets kept."""
        if parsed.continue_final_message:
            content = parsed.messages[-1].content
            return content if isinstance(content, str) else "".join(
                part.text or "" for part in content if part.type == "text")
        if not parsed.add_generation_prompt:
            return None
        key = _json.encode(parsed.chat_template_kwargs or {}).decode()
        if key in self._opening:
            text = self._opening[key]
        else:
            text = self.tokenization.generation_prompt(parsed.chat_template_kwargs)
            if len(key) <= 256:  # (sets of flags; a kwarg holding a document is rendered each time, not kept)
                if len(self._opening) >= 256:
                    self._opening.pop(next(iter(self._opening)))  # the oldest set
                self._opening[key] = text
        if text is None:  # the template refuses a lone user turn: the request's own messages rendered
            text = self.tokenization.generation_prompt_of(parsed.messages, parsed.tools.tools if parsed.tools else None,
                                                          parsed.tool_format, parsed.chat_template_kwargs)
        return text

    # ---- text to speech -----------------------------------------------

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        """Orpheus: the voice's prompt in, codec tokens out, decoded to PCM by
        windows of frames as they come (``mstar_actors.speech``)."""
        from mstar_actors.frontend import speech_api

        raw = await request.read()
        self._check_available()
        if self.speech is None:
            raise ApiError(404, "text to speech is not served here: it needs an Orpheus model and "
                           "speech.snac_path (a SNAC codec folder) in the config", code="not_found")
        speech = speech_api.parse_speech(raw, self.config.speech, self.info.max_model_len)
        model = self._resolve_model(speech.model)
        prompt_ids = await self.run_blocking(self._speech_prompt_ids, speech)
        sampling = msgspec.structs.replace(speech.sampling, stop_token_ids=(self.speech.tokens.end_of_speech,))
        parsed = ParsedRequest(kind="speech", model=speech.model, sampling=sampling, prompts=[prompt_ids],
                               prompt_param="input")
        parsed.with_token_facts(self.info.eos_token_ids, [])
        exchange = Exchange(parsed, model, "speech", self.index)
        self._admit(exchange)
        try:
            await self._submit(exchange)
            return await self._speak(request, exchange, speech)
        finally:
            self._close(exchange)

    def _speech_prompt_ids(self, speech: Any) -> list[int]:
        from mstar_actors.prepare.prompt_bound import PromptTooLong
        from mstar_actors.speech.orpheus import FRAME_TOKENS, speech_text

        try:  # bounded as prepare bounds a prompt; the 6 framing tokens are counted by the scheduler
            text_ids = self.tokenization.encode_text(speech_text(speech.voice, speech.text), True,
                                                     self.info.max_model_len)
        except PromptTooLong as err:
            raise ApiError(400, f"input: {err}", param="input", code="context_length_exceeded") from None
        ids = self.speech.tokens.prompt_ids(text_ids)
        room = self.info.max_model_len - len(ids)
        if room < FRAME_TOKENS:
            raise ApiError(400, f"input: the voice's prompt takes {len(ids)} tokens, the context (max_model_len) "
                                f"{self.info.max_model_len}: less than one frame of audio ({FRAME_TOKENS} codec "
                                f"tokens) would be left; shorten the input to a prompt of at most "
                                f"{self.info.max_model_len - FRAME_TOKENS} tokens", param="input",
                           code="context_length_exceeded")
        return ids

    async def _speak(self, request: web.Request, exchange: Exchange, speech: Any) -> web.StreamResponse:
        """Feed each delta's tokens to the request's speech stream and write
        the PCM they complete; the response is prepared at the first bytes, so
        a refusal before them keeps its status."""
        stream = self.speech.stream()
        out = responses.SpeechOut(request, speech.response_format, speech.stream_format, self.speech.codec.sample_rate)
        num_fed = 0
        try:
            while exchange.is_waiting():
                applied = self._apply(exchange, await exchange.pop())
                if applied is None:
                    continue
                choice = applied[0]
                new, num_fed = choice.token_ids[num_fed:], len(choice.token_ids)
                await out.write(await stream.feed(new))
            await out.write(await stream.finish())
            choice = next(iter(exchange.choices.values()))
            asked_cap = not exchange.parsed.sampling.cut_to_context  # the client's max_tokens, not the default
            dropped = stream.reader.num_dropped_frames
            if not out.is_prepared and choice.finish_reason == "length" and asked_cap and not dropped:
                raise ApiError(400, f"max_tokens: the reply reached its cap of {choice.num_output_tokens} tokens "
                                    "before a whole frame of audio (7 codec tokens, after the tokens that open the "
                                    "speech); raise it", param="max_tokens")
            if not out.is_prepared:  # not one frame: a silent file would pass for audio
                raise ApiError(500, f"the model wrote no audio: {choice.num_output_tokens} tokens made no whole codec "
                                    f"frame ({dropped} frames had codes out of range); the served model or adapter "
                                    "does not write Orpheus's codec tokens for this voice and text",
                               error_type="server_error")
            if choice.finish_reason == "length":  # the audio's bytes are out: said here, where the operator sees it
                self.log.warning("speech %s cut at %d codec tokens (%s): the input's end was not spoken",
                                 exchange.id, choice.num_output_tokens,
                                 "the request's max_tokens" if asked_cap else "speech.max_tokens or the context")
            await out.finish(choice.num_prompt_tokens, choice.num_output_tokens)
        except ApiError as err:
            if not out.is_prepared:
                raise
            await out.fail(err)
        return out.response

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as it starts the text and after a space, as vLLM bans it."""
        encode = functools.partial(self.tokenization.encode_text, add_special_tokens=False)
        return [ids for word in words for ids in {tuple(encode(word)), tuple(encode(" " + word.lstrip()))}]

    def _prompt_token_ids(self, exchange: Exchange) -> list[list[int]]:
        """Each prompt's ids as prepare makes them, for an echo (completions: its text and
        logprobs are the choice's first output); only computed here when the client asks."""
        from mstar_actors.prepare.preparers import prompt_token_ids
        from mstar_actors.prepare.prompt_bound import PromptTooLong

        out = []
        for req in exchange.requests:
            if req.messages is not None:  # media reach here on a text-only model only: refused by the part
                self._check_text_only(req.messages)
            try:
                out.append(prompt_token_ids(self.tokenization, req, self.info.max_model_len)[0])
            except PromptTooLong as err:
                param = "messages" if req.messages is not None else "prompt"
                raise ApiError(400, f"{param}: {err}", param=param, code="context_length_exceeded") from None
            except ValueError as err:  # no chat template, or the template refused the messages
                raise ApiError(400, f"messages: {err}", param="messages") from None
        return out

    def _check_available(self) -> None:
        if self._failure:
            raise ApiError(503, f"{self._failure}; the server must be restarted")
        if self._draining:
            raise ApiError(503, f"{self._draining}: no new requests; retry on another replica",
                           code="shutting_down")
        self._check_started()

    def _check_started(self) -> None:
        """Until every actor is up nothing is served (a readiness probe on
        /v1/models, as on vLLM's, waits for the model)."""
        if not self._is_started:
            raise ApiError(503, "the server is starting; retry when GET /health answers 200", retry_after_s=5)

    def _resolve_model(self, model: str | None) -> str:
        """The served model a request names: none, or "" (as vLLM's), is the base."""
        base = self.info.served_name
        if not model or model == base or model in self.adapters:
            return model or base
        served = ", ".join([base, *sorted(self.adapters)])
        raise ApiError(404, f"the model {model!r} does not exist; served models: {served}", param="model",
                       code="model_not_found")

    def _admit(self, exchange: Exchange) -> None:
        """Raise the request's refusal where it finds ``server.max_waiting_requests`` waiting (``admission``)."""
        load = EngineLoad(self._num_engine_waiting, self._num_engine_running, self._num_engine_starting,
                          len(self._unacked), self.config.server.api_server_count)
        refusal = admission_refusal(exchange.num_choices, exchange.parsed.n, load, self.config.scheduler.max_num_seqs,
                                    self.config.server.max_waiting_requests)
        if refusal is not None:
            raise refusal

    async def _submit(self, exchange: Exchange) -> None:
        """Register every choice before sending, so no output can arrive unrouted."""
        for req in exchange.requests:
            self._exchanges[req.request_id] = exchange
            for cid in exchange.choice_ids[req.request_id]:
                exchange.choices[cid] = self._new_choice(len(exchange.choices), exchange, req)
                self._exchanges[cid] = exchange
        for req in exchange.requests:
            self._unacked.update(exchange.choice_ids[req.request_id])
            try:
                await self.outbox["prepare"].send(req)
            except MessageTooLarge:  # the launcher sizes this ring for server.max_body_bytes: a config out of step
                raise ApiError(413, f"request {exchange.response_id}: too large for the engine's rings to carry; "
                               "send less (fewer or smaller media) or raise transport.ring_bytes",
                               code="request_too_large") from None

    def _new_choice(self, index: int, exchange: Exchange, req: NewRequest) -> ChoiceOutput:
        from mstar_actors.tokenization import StopStrings

        prompt_ids = req.prompt_token_ids or []
        output = exchange.parsed.output
        # an echo shows a prompt of ids less a character its end leaves unfinished: the output always takes it
        detokenizer = self.tokenization.make_detokenizer(prompt_ids, output.skip_special_tokens,
                                                         give_back_tail=not output.echo)
        choice = ChoiceOutput(index, detokenizer, StopStrings(exchange.parsed.stop, output.include_stop_str_in_output),
                              api.token_id_text if output.return_tokens_as_token_ids else self.token_text,
                              exchange.parsed.logprobs is not None,
                              api.hidden_stop_ids(exchange.parsed, self.info.eos_token_ids), self.token_bytes)
        choice.num_prompt_tokens = len(prompt_ids)
        choice.min_tokens = req.sampling.min_tokens
        choice.echo_only = output.echo_only
        if output.echo:  # the prompt's text, as sent or as its ids decode
            ids = exchange.prompt_token_ids[exchange.requests.index(req)]
            # the prompt the model was given: as sent, or as its ids (cut by truncate_prompt_tokens) read
            cut = req.sampling.truncate_prompt_tokens is not None
            choice.echo_text = req.prompt if req.prompt is not None and not cut else self.tokenization.prompt_text(ids)
            choice.num_decoded_chars = len(choice.echo_text)  # the output's text_offsets follow it
            if exchange.parsed.logprobs is not None:  # and its tokens' logprobs (prompt_logprobs) come first
                choice.echo_prompt = (ids, self._text_offsets(ids), exchange.parsed.logprobs)
        return choice

    def _text_offsets(self, token_ids: list[int]) -> list[int]:
        """Where each token's text starts in the text of them all."""
        detokenizer, offsets, num_chars = self.tokenization.make_detokenizer([], skip_special_tokens=False), [], 0
        for token_id in token_ids:
            offsets.append(num_chars)
            num_chars += len(detokenizer.add([token_id]))
        return offsets

    def _close(self, exchange: Exchange) -> None:
        """Abort what has not finished and forget the exchange (every exit path)."""
        for rid in exchange.abort_ids():
            self._abort(rid)
        now = time.perf_counter()
        for choice in exchange.choices.values():
            if choice.finish_reason is not None or not exchange.is_refused:  # a 4xx is no request's end (vLLM's)
                end = now if choice.last_token_at is None else choice.last_token_at  # each choice's own (n > 1)
                phases = None if choice.first_token_at is None else (*choice.phases, end - choice.first_token_at)
                self.metrics.observe_end(choice.finish_reason, end - exchange.arrival,
                                         (choice.num_prompt_tokens, choice.num_output_tokens), phases,
                                         choice.num_cached_tokens, choice.num_preemptions)
        finished = [c.num_output_tokens for c in exchange.choices.values() if c.finish_reason is not None]
        if finished:
            self.metrics.observe_params(exchange.parsed.n, exchange.parsed.sampling.max_tokens, max(finished))
        for rid in [*exchange.choice_ids, *exchange.choices]:
            self._exchanges.pop(rid, None)
            self._unacked.discard(rid)
        self._idle.set()

    def _abort(self, request_id: str) -> None:
        """Without awaiting: this runs in ``finally`` of a cancelled handler."""
        msg = Abort(request_id=request_id)
        try:
            self.outbox["prepare"].send_nowait(msg)
        except ChannelFull:  # keep the order, wait for room in the background
            task = asyncio.ensure_future(self.outbox["prepare"].send(msg))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        except Exception as err:  # the channel is gone: shutting down
            self.log.debug("abort %s not sent: %s", request_id, err)

    def _apply(self, exchange: Exchange, msg: Any) -> tuple[ChoiceOutput, str, list] | None:
        """Feed one engine message to its choice; raise ApiError for Failed.
        None when the choice was already done (nothing for the client)."""
        choice = exchange.choices.get(msg.request_id)
        if isinstance(msg, Failed) and msg.status < 500 and (choice is None or not choice.is_done):
            exchange.is_refused = True  # the client's input: no end in request_success (see _close)
        if choice is None or choice.is_done:  # a whole request's, or stopped here
            if isinstance(msg, Failed) and choice is None:
                raise failure(exchange, msg)
            return None
        match msg:
            case TokenDelta():
                return choice, *self._apply_delta(exchange, choice, msg)
            case Finished():
                # stop_reason: a stop_token_ids entry, not an EOS ending (one that ignore_eos passed stops as listed)
                is_eos = msg.stop_token_id in self.info.eos_token_ids and not exchange.parsed.sampling.ignore_eos
                text = choice.finish(msg.finish_reason, msg.num_prompt_tokens, msg.num_output_tokens,
                                     msg.num_cached_tokens, None if is_eos else msg.stop_token_id,
                                     msg.num_preemptions)
                return choice, text, []
            case Failed():
                raise failure(exchange, msg)
        raise AssertionError(f"unroutable {type(msg).__name__}")

    def _apply_delta(self, exchange: Exchange, choice: ChoiceOutput, delta: TokenDelta) -> tuple[str, list]:
        now = time.perf_counter()
        if choice.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - exchange.arrival)
            choice.first_token_at, choice.phases = now, (delta.queued_s, delta.prefill_s)
        elif delta.tokens:
            self.metrics.inter_token_latency.observe((now - choice.last_token_at) / len(delta.tokens))
        choice.last_token_at = now
        if delta.num_prompt_tokens:  # the first delta: the prompt's usage, for a choice a stop string ends here
            self.metrics.prompt_tokens.inc(delta.num_prompt_tokens)  # counted once prefilled, as vLLM counts it
            self.metrics.prefix_cache_queries.inc(delta.num_queried_tokens)
            self.metrics.prefix_cache_hits.inc(delta.num_cached_tokens)
            self.metrics.prompt_tokens_cached.inc(delta.num_cached_tokens)
            choice.num_prompt_tokens, choice.num_cached_tokens = delta.num_prompt_tokens, delta.num_cached_tokens
        if delta.prompt_token_ids is not None:
            choice.prompt_token_ids = delta.prompt_token_ids
        if not choice.echo_only:  # (an echo's cap of 0: the engine's one token is not the client's)
            self.metrics.generation_tokens.inc(len(delta.tokens))
        text, entries = choice.add(delta.tokens)
        if choice.is_done:  # a stop string matched: free the engine's blocks now
            self._abort(delta.request_id)
        return text, entries

    async def _collect(self, exchange: Exchange) -> web.Response:
        while exchange.is_waiting():
            self._apply(exchange, await exchange.pop())
        body = responses.full_body(exchange, self.token_text)
        return web.Response(body=_json.encode(body), content_type="application/json")

    # ---- streaming ------------------------------------------------------

    async def _stream(self, request: web.Request, exchange: Exchange,
                      stream: responses.Stream | None = None) -> web.StreamResponse:
        """SSE (or a Responses reply, ``stream``). The response is prepared at the first engine output, so a
        request refused before that (prepare's or the scheduler's 4xx) keeps its status."""
        stream = stream or responses.Stream(request, exchange)
        interval = exchange.parsed.output.stream_interval
        held: dict[int, responses.Output] = {}  # each choice's outputs not yet written
        sent: dict[int, int] = {}  # and its tokens at its last chunk
        try:
            while exchange.is_waiting():
                msgs = await exchange.pop_all()
                if len(msgs) == 1 and interval == 1:  # a stream that keeps up: one output, one event
                    applied = self._apply(exchange, msgs[0])
                    if applied is not None:
                        await stream.write_choice(stream.take(*applied))
                else:
                    await self._hold_outputs(stream, exchange, msgs, held)
                    await responses.write_runs(stream, _due_runs(held, sent, interval))
            await responses.write_runs(stream, held)
            await stream.finish(responses.usage(exchange))
        except ApiError as err:
            if not stream.is_prepared:
                raise
            await stream.fail(err)
        return stream.response


    async def _hold_outputs(self, stream: responses.Stream, exchange: Exchange, msgs: list[Any],
                            held: dict[int, responses.Output]) -> None:
        """Apply ``msgs`` in order, each choice's joining its ``held`` run (in
        the order choices first appear; each choice's outputs keep theirs),
        which the caller writes when due (``_due_runs``): with no
        ``stream_interval``, all of them at once. While the stream keeps up an
        event carries one token; when outputs arrive faster than events are
        written (one process writes every stream, about 20k events/s on the
        H200's host), the queued ones leave together, so the cost per token
        falls as the load rises instead of the backlog growing."""
        try:
            for msg in msgs:
                applied = self._apply(exchange, msg)
                if applied is None:
                    continue
                out = stream.take(*applied)
                run = held.get(out.choice.index)
                if run is None:
                    held[out.choice.index] = out
                else:
                    run.extend(out)
        except ApiError:  # a later output failed the exchange: what came before it still goes out first
            await responses.write_runs(stream, held)
            held.clear()
            raise


def _due_runs(held: dict[int, responses.Output], sent: dict[int, int], interval: int) -> dict[int, responses.Output]:
    """The held runs whose chunk is due, taken out of ``held``: a choice's first tokens, its end, or ``interval``
    tokens since its last chunk (vLLM's stream_interval; 1: every run, each output bringing a token or the end;
    ``sent`` updated)."""
    due = {}
    for index, run in list(held.items()):
        choice = run.choice
        if index not in sent or choice.is_done or choice.num_output_tokens - sent[index] >= interval:
            due[index] = held.pop(index)
            sent[index] = choice.num_output_tokens
    return due


def _load_speech(config: Any, tokenizer: Any, vocab_size: int) -> Any:
    """The codec and the model's codec tokens; what does not fit is the
    operator's to mend (``ConfigError``: one line, exit 2)."""
    from mstar_actors.speech.orpheus import OrpheusFormatError
    from mstar_actors.speech.snac_codec import CodecLoadError
    from mstar_actors.speech.stream import load_speech

    try:
        return load_speech(config, tokenizer.get_vocab(), vocab_size)
    except CodecLoadError as err:
        raise ConfigError(str(err)) from None
    except OrpheusFormatError as err:
        raise ConfigError(f"speech.snac_path is set, but the served model does not write Orpheus's codec tokens "
                          f"({err}); serve an Orpheus model or leave speech out") from None
    except ImportError as err:
        raise ConfigError(f"speech.snac_path: the SNAC decoder needs the snac package ({err}); pip install snac") from None


def _load_tokenization(folder: Path) -> Any:
    from mstar_actors.tokenization import Tokenization

    return Tokenization(folder)
