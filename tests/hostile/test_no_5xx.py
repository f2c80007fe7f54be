"""Malformed bodies and headers are 4xx in OpenAI's envelope, never a 5xx."""

import gzip

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
            for encoding in ["gzip", "deflate", "br", "zstd", "x-unknown"]:
                status, body = await h.post(CHAT, raw, headers={"Content-Encoding": encoding,
                                                                "Content-Type": "application/json"})
                assert status < 500, (encoding, status, body)
                if status != 200:
                    assert_envelope(status, body, status)
            status, body = await h.post(CHAT, gzip.compress(raw), headers={"Content-Encoding": "gzip"})
            assert status == 200, body  # a real gzip body still works
            status, body = await h.post(CHAT, gzip.compress(raw)[:12] + b"\xff" * 64, headers={"Content-Encoding": "gzip"})
            assert_envelope(status, body)
            status, body = await h.post(CHAT, raw, headers={"Content-Encoding": "gzip"})  # the reported case
            assert_envelope(status, body)
            assert "Content-Encoding" in body["error"]["message"] and body["error"]["param"] == "body", body
            status, body = await h.post(CHAT, BODY)  # the server goes on serving
            assert status == 200, body
    run(go)
