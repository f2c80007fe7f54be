"""Malformed bodies and headers are 4xx in OpenAI's envelope, never a 5xx."""

import gzip
import json

from tests.hostile.conftest import run

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_envelope(status, body, expected=400):
    assert status == expected, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_nul_in_lora_path_is_a_400(hostile, tmp_path):
    async def go():
        async with hostile() as h:
            for path in [f"{tmp_path}/a\u0000b", "good\u0000/../../etc", f"{tmp_path}/a\nb"]:
                status, body = await h.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
                assert_envelope(status, body)
                assert body["error"]["param"] == "lora_path", body
            raw = b'{"lora_name": "x", "lora_path": "%s/\\ud800"}' % str(tmp_path).encode()
            status, body = await h.post("/v1/load_lora_adapter", raw)  # a lone surrogate
            assert_envelope(status, body)
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)


def test_gzip_header_over_plain_json_is_a_400(hostile):
    import json

    async def go():
        async with hostile() as h:
            raw = json.dumps(BODY).encode()
            status, body = await h.post(CHAT, raw, headers={"Content-Encoding": "deflate"})
            assert_envelope(status, body)  # (codings it does not decode: the 415 test below)
            status, body = await h.post(CHAT, gzip.compress(raw), headers={"Content-Encoding": "gzip"})
            assert status == 200, body  # a real gzip body still works
            broken = gzip.compress(raw)[:12] + b"\xff" * 64
            status, body = await h.post(CHAT, broken, headers={"Content-Encoding": "gzip"})
            assert_envelope(status, body)
            status, body = await h.post(CHAT, raw, headers={"Content-Encoding": "gzip"})  # the reported case
            assert_envelope(status, body)
            assert "Content-Encoding" in body["error"]["message"] and body["error"]["param"] == "body", body
            status, body = await h.post(CHAT, BODY)  # the server goes on serving
            assert status == 200, body
    run(go)


def test_a_content_encoding_not_decoded_is_a_415_naming_the_accepted(hostile):
    """br / zstd (aiohttp would need a package), a coding it does not know
    or several (it read those bodies as plain): a 415 listing gzip, deflate,
    identity, not a 400 telling the client to install a Python package."""
    async def go():
        async with hostile() as h:
            raw = json.dumps(BODY).encode()
            for encoding in ["br", "zstd", "x-gzip", "bogus", "gzip, br"]:
                status, body = await h.post(CHAT, raw, headers={"Content-Encoding": encoding,
                                                                "Content-Type": "application/json"})
                assert_envelope(status, body, 415)
                message = body["error"]["message"]
                assert "accepted: one of gzip, deflate or identity" in message and "install" not in message, body
                assert f"got {encoding!r}" in message, body  # the coding sent, named
                assert (body["error"]["param"], body["error"]["code"]) == ("Content-Encoding", "unsupported_encoding")
            for encoding in ["identity", "", "GZIP"]:
                body_bytes = gzip.compress(raw) if encoding == "GZIP" else raw
                status, body = await h.post(CHAT, body_bytes, headers={"Content-Encoding": encoding})
                assert status == 200, (encoding, body)
            async with h.session.get(h.url + "/health", headers={"Content-Encoding": "x-gzip"}) as resp:
                assert resp.status == 200  # no body: nothing to decode
    run(go)


def test_a_body_sent_as_a_form_or_text_is_a_415_unread(hostile):
    """A browser page of any origin posts text/plain, form and multipart bodies without asking the server
    first (CORS's simple requests): read as JSON, such a body loaded and unloaded adapters and ran generations
    for any site. JSON, no Content-Type or another type (a preflight's) is read."""
    async def go():
        async with hostile() as h:
            raw = json.dumps(BODY).encode()
            for media_type in ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                               "multipart/form-data; boundary=x", "Text/Plain"]:
                for path in (CHAT, "/v1/load_lora_adapter", "/tokenize"):
                    status, body = await h.post(path, raw, headers={"Content-Type": media_type})
                    assert_envelope(status, body, 415)
                    assert (body["error"]["param"], body["error"]["code"]) == ("Content-Type",
                                                                              "unsupported_media_type"), body
                    assert "application/json" in body["error"]["message"] and media_type in body["error"]["message"]
            for media_type in ["application/json", "application/json; charset=utf-8", "application/octet-stream"]:
                status, body = await h.post(CHAT, raw, headers={"Content-Type": media_type})
                assert status == 200, (media_type, body)
            for path, data in (("/v1/files", raw), ("/v1/audio/transcriptions", b"x" * (5 << 20))):  # multipart
                status, body = await h.post(path, data, headers={"Content-Type": "multipart/form-data; boundary=x"})
                assert_envelope(status, body, 404)  # (unread: not a 413 for an upload past the body limit)
                assert body["error"]["code"] == "not_found" and f"POST {path}" in body["error"]["message"], body
    run(go)


def test_a_body_that_fails_to_decode_at_its_end_is_answered_at_once(hostile):
    """The header first, then a deflate body cut short: aiohttp noticed only
    at the body's end and the route waited for the body for ever."""
    import asyncio
    import time

    async def go():
        async with hostile(request_read_timeout_s=20) as h:
            for body in [b"[" * 100, b"[" * 200_000]:
                reader, writer = await asyncio.open_connection("127.0.0.1", h.actor.port)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body))
                await writer.drain()
                await asyncio.sleep(0.05)  # the header is parsed and routed before the body arrives
                writer.write(body)
                start = time.monotonic()
                data = await asyncio.wait_for(reader.read(), 5)
                assert data.startswith(b"HTTP/1.1 400") and time.monotonic() - start < 2, data[:200]
                error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
                assert error["param"] == "body" and "deflate" in error["message"] and "\n" not in error["message"]
                writer.close()
            status, out = await h.post(CHAT, BODY)
            assert status == 200, out
    run(go)


def test_an_api_key_header_that_is_not_utf8_is_a_401(hostile):
    import asyncio

    async def go():
        async with hostile(api_key="sekret") as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", h.actor.port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 401"), head
            writer.close()
            status, out = await h.post(CHAT, BODY, headers={"Authorization": "Bearer sekret"})
            assert status == 200, out
    run(go)


def test_media_on_a_text_only_model_is_refused_by_its_part_first(hostile, model_dir):
    """Fields refused beside media (they work on text tokens) are not what a
    text-only model names: the media part is (prepare's refusal), so the
    client fixes the real problem first."""
    from mstar_actors.prepare.preparers import Preparer
    from mstar_actors.tokenization import Tokenization

    preparer = Preparer(Tokenization(model_dir), 256)

    async def go():
        async with hostile() as h:
            h.engine.plan = lambda req: [preparer.prepare(req)]
            media = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
            for extra in ({}, {"return_token_ids": True}, {"truncate_prompt_tokens": 3}):
                status, body = await h.post(CHAT, {**BODY, "messages": media, **extra})
                assert_envelope(status, body)
                assert body["error"]["param"] == "messages[0].content[1].image_url", (extra, body)
                message = body["error"]["message"]
                assert "reads text only" in message and not message.startswith("request ")  # no internal id
    run(go)


def api_reason_end(field: str) -> str:
    """The end of the unknown-field refusal's message, as the frontend writes it whole."""
    from mstar_actors.frontend import openai_api as api

    try:
        api.parse_chat(json.dumps(BODY | {field: 1}).encode(), 512, 400)
    except api.ApiError as err:
        return err.message[-40:]
    raise AssertionError("not refused")


def test_a_refusal_quotes_at_most_a_bounded_part_of_what_was_sent(hostile):
    """A 100 KB field name, model or tool_choice comes back cut: the error body stays small, and still names it."""
    async def go():
        async with hostile() as h:
            huge = "k" * 100_000
            tools = [{"type": "function", "function": {"name": "f"}}]
            for route, body, status in [(CHAT, BODY | {huge: 1}, 400), (CHAT, BODY | {"model": huge}, 404),
                                        (CHAT, BODY | {"tool_choice": huge, "tools": tools}, 400),
                                        ("/v1/completions", {"model": huge, "prompt": "hi"}, 404)]:
                got, answer = await h.post(route, body)
                assert_envelope(got, answer, status)
                assert len(json.dumps(answer)) < 3_000, (route, len(json.dumps(answer)))
                message = answer["error"]["message"]
                assert "kkkk" in message and "characters, cut" in message
            status, answer = await h.post(CHAT, BODY | {huge: 1})  # the value's middle cut: the reason's end kept
            assert answer["error"]["message"].endswith(api_reason_end(huge))
            status, answer = await h.post(CHAT, BODY | {"model": "\U0001F600" * 5000})  # bytes, not characters
            assert len(json.dumps(answer, ensure_ascii=False).encode()) < 3_000
            status, body = await h.post(CHAT, BODY)
            assert status == 200, body
    run(go)
