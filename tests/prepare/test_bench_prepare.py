"""The prepare benchmark reads the server's log lines it splits TTFT by: the
prepare actor's stage line (made here by the actor's own formatter) and the
worker's step line."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from actors.prepare import _Slot, stage_line
from mstar_actors.messages import NewRequest, SamplingParams
from tests.loopback import serving

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_prepare.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_prepare_log", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_and_prefill_steps_from_the_server_log(bench):
    arrival = time.time()
    req = NewRequest(request_id="chatcmpl-1-0", model="vl", sampling=SamplingParams(), prompt="x", arrival_time=arrival)
    slot = _Slot(req, read_at=arrival + 0.002, draft_start=arrival + 0.003, draft_end=arrival + 0.030,
                 draft_cpu_ms=21.5, draft_faults=7, release_start=arrival + 0.0302, stored_at=arrival + 0.0306)
    log = bench.ServerLog()
    log.read_line(f"2026-01-01 00:00:00,000 DEBUG [prepare] mstar_actors.prepare: {stage_line(slot, arrival + 0.031)}\n")
    step_at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(arrival + 0.040)) + f",{int((arrival + 0.040) % 1 * 1000):03d}"
    log.read_line(f"{step_at} DEBUG [worker0] mstar_actors.worker0: step 7: 1 rows, 406 tokens, 1 new, 12.5 ms\n")
    [stage] = log.stages.values()
    assert (stage.read, stage.draft_start, stage.draft_end, stage.sent) == pytest.approx((2, 3, 30, 31), abs=0.11)
    timed = [bench.Timed("chatcmpl-1-0", sent=arrival - 0.005, ttft=0.050)]
    stages = bench.ttft_stages(timed, log, num_rounds=1)
    assert stages["at the frontend (body parsed)"] == pytest.approx(5, abs=0.2)
    assert stages["Prepared sent to the conductor"] == pytest.approx(36, abs=0.2)
    assert stages["draft's own time"] == pytest.approx(27, abs=0.2)
    assert stages["draft's own CPU ms (its thread)"] == 21.5 and stages["draft's minor page faults"] == 7
    assert stages["draft end -> release starts (in-order wait)"] == pytest.approx(0.2, abs=0.11)
    assert stages["release starts -> stored (arena put)"] == pytest.approx(0.4, abs=0.11)
    assert stages["stored -> sent (ring)"] == pytest.approx(0.4, abs=0.11)
    assert stages["first token at the client (TTFT)"] == pytest.approx(50)
    assert stages["prefill steps per round"] == 1 and stages["requests per prefill step"] == 1
    assert stages["prefill step ms (p50)"] == 12.5


def test_clip_argument(bench):
    assert bench._clip("640x480x8") == (640, 480, 8.0)
    with pytest.raises(Exception, match="WIDTHxHEIGHTxSECONDS"):
        bench._clip("640x480")


def test_ttft_clip_preset(bench):
    assert bench._clip_or_none("none") is None
    assert bench._clip_or_none("640x480x16") == bench.SEED_TTFT_CLIP == (640, 480, 16.0)
    assert bench.Clip(16.0, 640, 480).num_frames == 32


def test_profile_vl_step_runs_a_small_clip(capsys):
    spec = importlib.util.spec_from_file_location("profile_vl_step", TOOL.parent / "profile_vl_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--device", "cpu", "--clip", "112x112x1", "--requests", "2", "--repeats", "1", "--no-profiler"])
    out = capsys.readouterr().out
    assert "| vision tower (whole) |" in out and "| text layers |" in out and "whole step, no stage syncs" in out


def test_drafts_at_once_reports_cpu_faults_and_gil_waits(bench, monkeypatch):
    import os
    import threading

    class Preparer:  # a draft that holds the GIL ~2 ms in Python, then releases it
        def draft(self, req, fetched):
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            time.sleep(0.002)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # the plan leaves 1 CPU: no pinning
    line = bench.drafts_at_once(Preparer(), None, num_drafts=2, rounds=1)
    assert "1 at once: wall" in line and "2 at once: wall" in line and "voluntary context switches per draft" in line
    assert "GIL watcher: longest wait" in line and "TTFT gain bound" in line
    assert "2 at once pinned: not run" in line

    # With CPUs to spare (8, faked) the drafts also run pinned as the pool would pin them.
    pinned: dict[int, list[int]] = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("actors.prepare.read_cpu_cores", lambda cpus: {})  # no topology: one core per CPU
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: pinned.__setitem__(tid, list(cpus)))
    line = bench.drafts_at_once(Preparer(), None, num_drafts=2, rounds=1)
    assert "2 at once pinned as the pool pins them (CPUs [[7], [6]]): wall" in line and "; pinned: " in line
    assert sorted(pinned.values()) == [[6], [7]] and threading.get_native_id() not in pinned


def test_throughput_actor_warms_every_thread_and_times_batches(bench):
    """The throughput table's actor stays up between batches: its warm-up
    drafts on every pool thread, and each batch gets every request back."""
    import asyncio
    import threading

    from mstar_actors.messages import Prepared
    from mstar_actors.preprocess import Draft

    class Preparer:
        PREPROCESS_PARALLEL = True

        def __init__(self):
            self.threads: set[str] = set()

        def draft(self, req, fetched):
            self.threads.add(threading.current_thread().name)
            time.sleep(0.02)  # long enough that two requests never share a thread in the warm-up
            return Draft(Prepared(request_id=req.request_id, model="m", prompt_token_ids=[1, 2], sampling=req.sampling), [])

    def make(rid):
        return NewRequest(request_id=rid, model="m", sampling=SamplingParams(), prompt="x")

    async def run():
        preparer = Preparer()
        actor = bench.ActorUnderTest(preparer, num_workers=3)
        await actor.warm_up(make)
        warmed = set(preparer.threads)
        elapsed = [(await actor.batch([make(f"b{r}-{i}") for i in range(6)]))[-1] for r in range(2)]
        await actor.close()
        return warmed, elapsed

    warmed, elapsed = asyncio.run(run())
    assert len(warmed) == 3 and all(name.startswith("prepare") for name in warmed)
    assert all(0.03 <= e < 5 for e in elapsed)  # 6 requests of 20 ms on 3 threads: two waves at least


def test_closed_loop_keeps_four_in_flight_and_skips_each_clients_first(bench):
    """The closed loop: every client sends its next request once its last has
    answered (never more than ``concurrency`` in flight, and all of them in
    flight most of the time), and each client's first request is not counted."""
    import asyncio
    import json

    from aiohttp import web

    state = {"in_flight": 0, "most": 0, "served": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["messages"][0]["content"][1]["video_url"]["url"] == "data:video/mp4;base64,AAAA"
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        state["served"] += 1
        rid = f"chatcmpl-{state['served']}"
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(0.01)
        await response.write(b"data: " + json.dumps({"id": rid}).encode() + b"\n\n")
        state["in_flight"] -= 1
        await response.write(b"data: [DONE]\n\n")
        return response

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with serving(app) as base:
            port = int(base.rsplit(":", 1)[1])
            return await bench.closed_loop(port, "data:video/mp4;base64,AAAA", concurrency=4, per_client=3)

    counted, span = asyncio.run(main())
    assert state["served"] == 4 * (3 + 1) and state["most"] == 4
    assert len(counted) == 12 and len({t.request_id for t in counted}) == 12
    assert all(t.ttft >= 0.01 for t in counted) and span >= 3 * 0.01


def test_plain_pool_drafts_on_pinned_threads_and_times_each(bench, monkeypatch):
    """The throughput table's reference rows: the same drafts on a bare
    thread pool, each thread pinned where the prepare pool would pin it, each
    draft's wall and CPU kept; a draft that fails stops the benchmark."""
    import asyncio
    import os
    import threading

    from mstar_actors.messages import Failed, Prepared
    from mstar_actors.preprocess import Draft

    pinned: dict[int, list[int]] = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("actors.prepare.read_cpu_cores", lambda cpus: {})  # no topology: one core per CPU
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: pinned.__setitem__(tid, list(cpus)))

    class Preparer:
        def draft(self, req, fetched):
            if req.request_id == "bad":
                return Failed(request_id="bad", status=400, message="no such video")
            time.sleep(0.02)
            return Draft(Prepared(request_id=req.request_id, model="m", prompt_token_ids=[1], sampling=req.sampling), [])

    def make(rid):
        return NewRequest(request_id=rid, model="m", sampling=SamplingParams(), prompt="x")

    async def run():
        pool = bench.PlainPool(Preparer(), num_workers=2)
        await pool.warm_up(make)
        done = await pool.batch([make(f"r{i}") for i in range(4)])
        drafts = list(pool.drafts)
        with pytest.raises(RuntimeError, match="request bad failed: no such video"):
            await pool.batch([make("bad")])
        await pool.close()
        return done, drafts

    done, drafts = asyncio.run(run())
    assert sorted(pinned.values()) == [[6], [7]] and threading.get_native_id() not in pinned
    assert len(drafts) == 4 and all(0.015 < wall < 1 and cpu < wall for wall, cpu in drafts)
    assert len(done) == 4 and done == sorted(done) and 0.035 < done[-1] < 5  # 4 drafts of 20 ms on 2 threads: two waves


def test_throughput_rate_is_the_batchs_steady_middle(bench):
    """A batch's rate counts the results between the first wave's last and
    the drain's first, over the time between them: the same 2 a second
    whether two threads finish in step or half a draft apart, where the
    whole batch would say 2.0 and 1.78."""
    in_step, staggered = [1, 1, 2, 2, 3, 3, 4, 4], [1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5]
    assert bench.Batch(in_step, 2, 0, 0, 0).rate == bench.Batch(staggered, 2, 0, 0, 0).rate == 2.0
    assert bench.Batch(staggered, 2, 0, 0, 0).elapsed == 4.5
    assert bench.Batch([1, 2, 3, 4], 1, 0, 0, 0).rate == 1.0  # inline: results 1 to 3
    assert bench.Batch([2, 2, 3], 2, 0, 0, 0).rate == 1.0  # no middle: the whole batch
