"""A live server with ``parallel.tp: 2`` on CPU: two worker ranks in one
gloo group. It serves transformers' greedy tokens, records its rendezvous,
logs each rank's share; a SIGKILL of one rank under load fails every request
in flight within a few seconds with a clear error, and leaves no shared
memory and no process behind (the surviving rank is stopped, not left in a
collective). A ``tp`` that does not split the model is refused at start."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch

from tests.hostile.test_resilience import KILL_BOUND_S, _runs, error_of, in_flight_until_killed
from tests.test_launcher import ROOT, Server, _load_kit, our_segments

pytestmark = pytest.mark.timeout(300)

PROMPT = "hello world w3"
SERVER_ERRORS = ("server_error", "service_unavailable_error")  # the failure's: a 500's or a 503's


def start_tp_server(folder, tmp_path_factory, tp: int = 2) -> Server:
    """Server's start, with ``parallel.tp`` in its config file."""
    return Server(folder, tmp_path_factory.mktemp("runtime"), tmp_path_factory.mktemp("cfg"),
                  extra_config=f"parallel: {{tp: {tp}}}\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, _load_kit().make_model_dir(folder)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with start_tp_server(model[0], tmp_path_factory).running() as srv:
        yield srv


def complete(port: int, max_tokens: int, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | fields
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_tp2_server_serves_transformers_tokens_and_records_its_group(server, model):
    folder, hf = model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT)["input_ids"]
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    reply = complete(server.port, 12)
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["choices"][0]["text"] == tokenizer.decode(want)
    meet = json.loads((server.run_dir / "rendezvous.json").read_text())
    assert meet["host"] == "127.0.0.1" and meet["world_size"] == 2 and meet["port"] > 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank} of 2 holds [\d.]+M of [\d.]+M parameters", server.log), server.log
    assert "torch intra-op threads: 1" in server.log  # two ranks on two cores: one each
    # the prompt's logprobs (echo with logprobs) through both ranks' halves of the LM head
    scored = complete(server.port, 1, echo=True, logprobs=1)["choices"][0]["logprobs"]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    want = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert scored["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)


def test_sigkill_of_one_rank_under_load_fails_requests_fast_and_leaves_nothing(server):
    run_id = server.run_dir.name
    launcher = psutil.Process(server.proc.pid)
    processes = [launcher, *launcher.children(recursive=True)]
    victim = server.actors()["worker1"]
    ends, last_end_s = asyncio.run(in_flight_until_killed(f"http://127.0.0.1:{server.port}", victim, 8, 4))
    assert len(ends) == 12
    print(f"the last of {len(ends)} requests in flight ended {last_end_s:.3f} s after the SIGKILL")
    assert last_end_s < KILL_BOUND_S, last_end_s
    clear = re.compile(r"the worker1 actor failed: .*SIGKILL|the server is shutting down \(channel '\w+' ended\)"
                       r"|rank 0, step \d+: |the engine stopped: .*'worker1' broke")
    for kind, _, what in ends:
        error = error_of(kind, what)
        assert error["type"] in SERVER_ERRORS and clear.search(error["message"]), (kind, what)
    assert server.wait_exit(60) != 0
    assert "actor worker1" in server.log and "SIGKILL" in server.log
    assert our_segments(run_id) == []
    deadline = time.monotonic() + 15
    while (left := [p.pid for p in processes if _runs(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"processes of the run still running: {left}"


def test_tp_that_does_not_divide_the_heads_is_refused_at_start(model, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {{path: {model[0]}, name: tiny, dtype: float32, device: cpu}}\nparallel: {{tp: 3}}\n")
    run = subprocess.run([sys.executable, "-m", "mstar_actors", "serve", str(cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path)))
    assert run.returncode == 2, run.stderr
    assert "error: parallel.tp=3 does not divide LlamaForCausalLM's num_attention_heads=4" in run.stderr
