"""A seeded fuzzer over every route: no 5xx, every 4xx in the envelope, and
the server still answers a normal request afterwards.

The frontend runs over in-memory channels; its engine prepares every
request with the real ``Preparer`` (tokenizer, chat template, length checks)
and answers like the scheduler. ``FUZZ_SEED=<n>`` replays a run; the seed
is printed and named in every failure.
"""

import asyncio
import gzip
import json
import os
import random
import time
import zlib

import aiohttp

from mstar_actors.messages import Failed
from mstar_actors.prepare.preparers import Preparer
from mstar_actors.tokenization import Tokenization
from tests.hostile.conftest import make_harness

NUM_BODIES = 1200
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
          ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("GET", "/health"),
          ("GET", "/metrics")]
ODD_ROUTES = [("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/models"),
              ("PATCH", "/health"), ("OPTIONS", "/v1/chat/completions"), ("HEAD", "/v1/models"),
              ("FOO", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/../etc/passwd"),
              ("POST", "/v1/chat/completions/"), ("GET", "/%00"), ("POST", "/v1/chat%2Fcompletions")]
STRINGS = ["", "tiny", "tiny-lora", "\x00", "a\x00b", "good\u0000/../../etc", "../../etc/passwd", "org/name",
           "\u202eevil", "東京 café 🙂", "\ufeff", "\n\r\t", "<|im_start|>", "<|im_end|>" * 50, "x" * 100_000,
           "%s%n%x", "{{ 7*7 }}", "{% for x in range(99999999) %}x{% endfor %}", "null", "\\u0000", "\U0010ffff"]
NUMBERS = [0, -1, 1, 2**31, 2**63, -2**63 - 1, 2**64, 10**30, 1e308, -1e308, 1e-320, 0.5, 16.0, 3.999, -0.0]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "suffix",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
          "add_generation_prompt", "user", "lora_name", "lora_path", "response_format", "tools"]
CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", ";;;/;", "*/*"]


class Fuzzer:
    def __init__(self, seed: int, tmp_path):
        self.rng = random.Random(seed)
        self.tmp_path = tmp_path

    def value(self, depth: int = 0):
        r = self.rng.random()
        if r < 0.25:
            return self.rng.choice(STRINGS)
        if r < 0.5:
            return self.rng.choice(NUMBERS)
        if r < 0.6:
            return self.rng.choice([True, False, None])
        if r < 0.8 and depth < 3:
            return [self.value(depth + 1) for _ in range(self.rng.randrange(0, 4))]
        if depth < 3:
            keys = FIELDS + STRINGS[:6]
            return {self.rng.choice(keys): self.value(depth + 1) for _ in range(self.rng.randrange(0, 4))}
        return self.rng.choice(STRINGS)

    def message(self):
        part = self.rng.choice([{"type": "text", "text": self.rng.choice(STRINGS)},
                                {"type": "image_url", "image_url": {"url": self.rng.choice(
                                    ["data:image/png;base64,AAAA", "file:///etc/passwd", "data:,", "x"])}},
                                {"type": "video_url", "video_url": "data:video/mp4;base64,"},
                                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": self.value()}},
                                {"type": self.value()}, self.value()])
        content = self.rng.choice([self.rng.choice(STRINGS), [part], part, None, self.value()])
        return {"role": self.rng.choice(["user", "system", "assistant", "developer", "tool", "", None, self.value()]),
                "content": content}

    def valid(self, path: str) -> dict:
        if path.endswith("chat/completions"):
            return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if path.endswith("completions"):
            return {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        if path.endswith("unload_lora_adapter"):
            return {"lora_name": "x"}
        return {"lora_name": "x", "lora_path": f"{self.tmp_path}/ok"}

    def body(self, path: str) -> bytes:
        kind = self.rng.random()
        if kind < 0.55:  # a valid body with some fields made hostile
            body = self.valid(path)
            for _ in range(self.rng.randrange(1, 4)):
                field = self.rng.choice(FIELDS)
                body[field] = self.message() if field == "messages" and self.rng.random() < 0.3 else self.value()
            if self.rng.random() < 0.2:
                body["messages"] = [self.message() for _ in range(self.rng.randrange(1, 4))]
            return json.dumps(body, allow_nan=True).encode()
        if kind < 0.7:  # any JSON value
            return json.dumps(self.value(), allow_nan=True).encode()
        raw = json.dumps(self.valid(path)).encode()
        choice = self.rng.randrange(9)
        if choice == 0:
            return raw[: self.rng.randrange(len(raw))]  # truncated
        if choice == 1:
            return bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 200)))  # garbage
        if choice == 2:
            return b"[" * self.rng.choice([100, 10_000, 200_000])  # nested deeply
        if choice == 3:
            return "\ufeff".encode() + raw  # a BOM
        if choice == 4:
            return raw.replace(b'"', b"'")
        if choice == 5:
            return raw.decode().replace("hi", "\udc80").encode("utf-8", "surrogatepass")  # not UTF-8
        if choice == 6:
            return raw.replace(b"4", b"1" * self.rng.choice([20, 400, 5000]))  # huge number literal
        if choice == 7:
            return raw.replace(b"hi", b"\\ud800\\u0000")  # a lone surrogate escape, an escaped NUL
        return b""

    def headers(self, body: bytes) -> tuple[dict, bytes]:
        headers = {}
        content_type = self.rng.choice(CONTENT_TYPES)
        if content_type:
            headers["Content-Type"] = content_type
        r = self.rng.random()
        if r < 0.08:
            headers["Content-Encoding"] = "gzip"
            body = gzip.compress(body) if self.rng.random() < 0.5 else body
        elif r < 0.14:
            headers["Content-Encoding"] = "deflate"
            body = zlib.compress(body) if self.rng.random() < 0.5 else body
        elif r < 0.2:
            headers["Content-Encoding"] = self.rng.choice(["br", "zstd", "identity", "x-\u00e9", "gzip, gzip", ""])
        if self.rng.random() < 0.05:
            headers["Authorization"] = self.rng.choice(["Bearer", "Basic %00", "x" * 8000])
        if self.rng.random() < 0.05:
            headers["Accept"] = "text/html"
        return headers, body


def check(seed: int, method: str, path: str, status: int, raw: bytes, sent: bytes) -> None:
    where = f"seed {seed}: {method} {path} with {sent[:120]!r}"
    assert status < 500, f"{where}: {status} {raw[:300]!r}"
    if status >= 400 and method != "HEAD":
        try:
            error = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"{where}: {status} without the envelope: {raw[:300]!r}") from None
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), where


def test_fuzz_every_route(model_dir, tokenizer, tmp_path):
    seed = int(os.environ.get("FUZZ_SEED", time.time_ns() % 2**32))
    print(f"fuzz seed {seed} (FUZZ_SEED={seed} replays it)")
    preparer = Preparer(Tokenization(model_dir), 256)
    (tmp_path / "ok").mkdir()

    def plan(engine, req):
        try:
            prepared = preparer.prepare(req)
        except Exception as err:  # a preparer bug: the client sees a 500, the fuzzer fails naming it
            return [Failed(request_id=req.request_id, status=500, message=f"preparer raised {err!r}")]
        return [prepared] if isinstance(prepared, Failed) else engine.reply(req)

    async def go():
        h = make_harness(model_dir, tokenizer, str(tmp_path), max_body_bytes=1 << 20)
        async with h:
            h.engine.plan = lambda req: plan(h.engine, req)
            fuzzer = Fuzzer(seed, tmp_path)
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
                cases = []
                for i in range(NUM_BODIES):
                    method, path = fuzzer.rng.choice(ROUTES if fuzzer.rng.random() < 0.9 else ODD_ROUTES)
                    headers, body = fuzzer.headers(fuzzer.body(path))
                    if method == "HEAD":  # its answer has no body, so one in a low-level error reads as garbage
                        headers, body = {}, b""
                    cases.append((method, path, headers, body))
                cases.append(("POST", "/v1/completions", {}, b'{"prompt": "' + b"a" * (2 << 20) + b'"}'))  # 413
                limit = asyncio.Semaphore(8)

                async def one(method, path, headers, body):
                    async with limit:
                        try:
                            async with session.request(method, h.url + path, data=body, headers=headers,
                                                       skip_auto_headers=["Content-Type"]) as r:
                                status, raw = r.status, await r.read()
                        except (aiohttp.ClientError, TimeoutError) as err:
                            raise AssertionError(f"seed {seed}: {method} {path} {headers} with {body[:200]!r}: "
                                                 f"{type(err).__name__} {err}") from None
                        check(seed, method, path, status, raw, body)

                await asyncio.gather(*(one(*case) for case in cases))
            status, body = await h.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and body["choices"][0]["message"]["content"], (seed, body)
            assert h.actor_task.done() is False and h.engine_task.done() is False, seed
    asyncio.run(asyncio.wait_for(go(), 60))


RAW_METHODS = [b"GET", b"POST", b"PUT", b"HEAD", b"FOO", b"G\xffT", b"", b"GET GET", b"PRI", b"CONNECT"]
RAW_TARGETS = [b"/v1/chat/completions", b"/v1/completions", b"/v1/models", b"/health", b"/metrics",
               b"/v1/load_lora_adapter", b"*", b"http://x/health", b"/\xff", b"/%", b"/a b", b"", b"/" * 9000]
RAW_VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"HTTP/1.1 x", b"", b"http/1.1"]
RAW_HEADERS = [b"Host: x", b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer sekret", b"Content-Type: \xff",
               b"Content-Encoding: gzip", b"Content-Encoding: br", b"Content-Length: 2", b"Expect: 100-continue",
               b"X-Forwarded-For: \xff", b"Accept: text/html", b"Content-Type: application/json; charset=\xff"]
BAD_HEADERS = [b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked", b"Content-Length: -1",
               b"Content-Length: 99999999999999999999", b"Connection: upgrade", b"Upgrade: websocket", b"X-\xff: y",
               b"Bad Header: x", b": empty", b"X: " + b"a" * 9000, b"X:\x00y", b"Host: x\rInjected: y"]


def raw_request(rng: random.Random) -> bytes:
    body = rng.choice([b"", b"{}", b'{"prompt": "hi", "max_tokens": 2}', b"zz\r\n", b"0\r\n\r\n", b"\x1f\x8b\x08"])
    headers = [rng.choice(BAD_HEADERS if rng.random() < 0.15 else RAW_HEADERS) for _ in range(rng.randrange(0, 4))]
    if rng.random() < 0.6:  # a well-formed frame, so the headers reach the app
        line = b" ".join([rng.choice([b"GET", b"POST"]), rng.choice(RAW_TARGETS[:6]), b"HTTP/1.1"])
        headers = [b"Host: x", *(h for h in headers if not h.startswith(b"Content-Length")),
                   b"Content-Length: %d" % len(body)]
    else:
        line = b" ".join([rng.choice(RAW_METHODS), rng.choice(RAW_TARGETS), rng.choice(RAW_VERSIONS)])
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


async def exchange_raw(port: int, request: bytes) -> tuple[int | None, bytes]:
    """(status, body) of the first final answer; (None, b"") when the server closed without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.IncompleteReadError:
                return None, b""
            status = int(head.split(b" ", 2)[1])
            if status >= 200:
                break  # else 100 Continue: the answer follows
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
        if request.startswith(b"HEAD "):
            return status, b""  # an answer to HEAD has no body, whatever its Content-Length says
        try:
            body = await asyncio.wait_for(reader.readexactly(int(lengths[0])), 5) if lengths else b""
        except asyncio.IncompleteReadError:
            body = b""
        return status, body
    finally:
        writer.close()


def test_fuzz_raw_requests(model_dir, tokenizer, tmp_path):
    """Malformed request lines and headers: aiohttp's own refusals carry the envelope too."""
    seed = int(os.environ.get("FUZZ_SEED", time.time_ns() % 2**32))
    print(f"raw fuzz seed {seed} (FUZZ_SEED={seed} replays it)")
    rng = random.Random(seed)

    async def go():
        h = make_harness(model_dir, tokenizer, str(tmp_path), api_key="sekret", keepalive_timeout_s=0.5,
                         request_read_timeout_s=1)
        async with h:
            limit = asyncio.Semaphore(8)

            async def one(request: bytes) -> None:
                async with limit:
                    try:
                        status, body = await exchange_raw(h.actor.port, request)
                    except TimeoutError:
                        raise AssertionError(f"seed {seed}: no answer nor close in 5 s to {request[:300]!r}") from None
                if status is not None:
                    method = b"HEAD" if request.startswith(b"HEAD ") else b"?"
                    check(seed, method.decode(), "raw", status, body if body or method == b"HEAD" else b"-", request)

            await asyncio.gather(*(one(raw_request(rng)) for _ in range(300)))
            status, body = await h.post("/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                        headers={"Authorization": "Bearer sekret"})
            assert status == 200, (seed, body)
    asyncio.run(asyncio.wait_for(go(), 60))
