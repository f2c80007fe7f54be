"""Several frontend processes on one port (``server.api_server_count``), live:
the kernel spreads connections over them, each request is answered by the
frontend that took it (its id names it), a runtime LoRA load through one is
served by all, /metrics from any one counts every frontend's requests, and
SIGTERM drains them all."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import signal
import urllib.parse

import pytest

from mstar_actors.config import ConfigError, parse_config
from mstar_actors.launcher import plan_actors
from mstar_actors.messages import choice_ids, frontend_of, new_request_id
from tests.live_tiny import save_tiny_llama, serve_tiny
from tests.lora.lora_factories import make_saved_peft

NUM_FRONTENDS = 2
NUM_CONNECTIONS = 24  # all on one frontend by chance: 2 in 2^24


def test_request_ids_name_their_frontend():
    for frontend in (0, 1, 7, 63):
        rid = new_request_id("chatcmpl", frontend)
        assert frontend_of(rid) == frontend
        assert [frontend_of(cid) for cid in choice_ids(rid, 3)] == [frontend] * 3, "choice ids keep it"
    assert new_request_id("cmpl").startswith("cmpl-") and new_request_id("cmpl").count("-") == 1
    for other in ("r1", "cmpl-abc", "cmpl-f-abc", "cmpl-fx1-abc", "cmpl-f12345-abc"):
        assert frontend_of(other) == 0, other


def test_each_frontend_has_its_own_rings():
    plans = {plan.name: plan for plan in plan_actors(num_ranks=2, num_frontends=3)}
    names = ["frontend", "frontend1", "frontend2"]
    assert [plans[n].params["index"] for n in names] == [0, 1, 2]
    assert [plans[n].outbox["prepare"][0] for n in names] == [f"{n}.prepare" for n in names]
    assert [plans[n].inbox["conductor"][0] for n in names] == [f"conductor.{n}" for n in names]
    assert {k: v[0] for k, v in plans["prepare"].inbox.items() if k != "control"} == {n: f"{n}.prepare" for n in names}
    assert {k: v[0] for k, v in plans["conductor"].outbox.items() if k.startswith("frontend")} == {
        n: f"conductor.{n}" for n in names}


def test_several_frontends_need_a_fixed_port():
    with pytest.raises(ConfigError, match="server.port 0 .*api_server_count 2: .*set a fixed port"):
        parse_config({"model": {"device": "cpu"}, "server": {"port": 0, "api_server_count": 2}})
    assert parse_config({"model": {"device": "cpu"}, "server": {"port": 8123, "api_server_count": 2}})


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """``(base_url, process, adapter folder)``; the last test sends SIGTERM."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("api-servers-model")
    save_tiny_llama(folder, tokenizer)
    adapter = tmp_path_factory.mktemp("api-servers-adapter")
    make_saved_peft(LlamaForCausalLM, folder, adapter, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    sections = {"lora": {"max_loras": 2, "max_lora_rank": 8, "allow_runtime_updates": True,
                         "adapter_dirs": [str(adapter.parent)]}}
    with serve_tiny(folder, sections=sections, api_server_count=NUM_FRONTENDS, stop_timeout_s=60) as (url, proc):
        yield url, proc, adapter


def call(base_url: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request on a connection of its own (so the kernel picks a frontend for it)."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, url.path + path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def many(base_url: str, method: str, path: str, body: dict | None = None) -> list[tuple[int, bytes]]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: call(base_url, method, path, body), range(NUM_CONNECTIONS)))


@pytest.mark.slow
def test_every_frontend_answers_the_requests_it_took(server):
    base_url, _, _ = server
    answers = many(base_url, "POST", "/completions", {"model": "tiny", "prompt": "The quick", "max_tokens": 4,
                                                        "temperature": 0})
    assert all(status == 200 for status, _ in answers), answers[:2]
    bodies = [json.loads(body) for _, body in answers]
    assert {frontend_of(b["id"]) for b in bodies} == set(range(NUM_FRONTENDS)), "some frontend took no connection"
    assert len({b["choices"][0]["text"] for b in bodies}) == 1, "greedy: the same text whichever frontend took it"
    assert all(b["usage"]["completion_tokens"] == 4 for b in bodies)


@pytest.mark.slow
def test_a_runtime_load_through_one_frontend_is_served_by_all(server):
    base_url, _, adapter = server
    status, body = call(base_url, "POST", "/load_lora_adapter", {"lora_name": "ad", "lora_path": str(adapter)})
    assert status == 200, body
    for status, body in many(base_url, "GET", "/models"):
        assert status == 200 and "ad" in {m["id"] for m in json.loads(body)["data"]}, body
    answers = many(base_url, "POST", "/completions", {"model": "ad", "prompt": "The quick", "max_tokens": 3,
                                                        "temperature": 0})
    assert all(status == 200 for status, _ in answers), answers[:2]


@pytest.mark.slow
def test_metrics_from_any_frontend_count_every_frontends_requests(server):
    base_url, _, _ = server
    root = base_url.removesuffix("/v1")

    def completions_ok(text: str) -> float:
        found = re.search(r'^mstar_requests_total\{route="/v1/completions",status="200"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = {completions_ok(body.decode()) for _, body in many(root, "GET", "/metrics")}
    assert len(before) == 1, f"scrapes of different frontends disagree: {before}"
    assert all(status == 200 for status, _ in many(base_url, "POST", "/completions",
                                                   {"model": "tiny", "prompt": "Hi", "max_tokens": 1}))
    after = {completions_ok(body.decode()) for _, body in many(root, "GET", "/metrics")}
    assert after == {before.pop() + NUM_CONNECTIONS}


@pytest.mark.slow
def test_sigterm_drains_every_frontend(server):
    _, proc, _ = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = proc.stderr.read()
    assert log.count("drained (0 requests failed") == NUM_FRONTENDS, log[-3000:]
