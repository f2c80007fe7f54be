"""The conductor's turn a step, on the host alone: the real ``ConductorActor``
(its ``Scheduler`` and ``AdapterPool``) over in-memory channels, which encode
and decode every message as the shared-memory rings do, with one rank that
answers each plan as soon as the next one comes (or after 2 ms when none
does) and ``--frontends`` readers of every output. ``--rows`` requests decode
side by side; the table gives the conductor's own time a decode step of all
of them (median, from a step's answer received to its outputs and gauges
sent: the update, the next plan, the tokens), beside the scheduler's own
``schedule`` + ``update`` of the same rows in a loop of its own (the
reference: what the turn costs beyond the decision).

A GPU step of a few ms leaves the conductor that much time a step; where the
turn takes longer, the served steps wait for it whatever the device does.

    python tools/bench_conductor.py                    # 64 and 256 rows, 4 frontends
    python tools/bench_conductor.py --rows 32 64 256 --frontends 1 --steps-ahead 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.conductor import ConductorActor  # noqa: E402
from actors.base import frontend_name  # noqa: E402
from mstar_actors.config import Config, KvConfig, ModelConfig, SchedulerConfig  # noqa: E402
from mstar_actors import messages as m  # noqa: E402
from mstar_actors.model_info import ModelInfo  # noqa: E402
from mstar_actors.sched import Scheduler  # noqa: E402
from transport.errors import ChannelClosed  # noqa: E402
from transport.memory import MemoryBroadcast, MemoryChannel  # noqa: E402

BLOCK_SIZE = 16
PROMPT_TOKENS = 128


def _requests(num_rows: int, num_frontends: int, max_tokens: int) -> list[m.Prepared]:
    sampling = m.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [m.Prepared(request_id=m.new_request_id("cmpl", i % num_frontends), model="base",
                     prompt_token_ids=[10 + (i + j) % 1000 for j in range(PROMPT_TOKENS)], sampling=sampling)
            for i in range(num_rows)]


def _num_blocks(num_rows: int, max_tokens: int) -> int:
    return num_rows * (-(-(PROMPT_TOKENS + max_tokens) // BLOCK_SIZE)) + 64


async def _rank(inbox: MemoryChannel, outbox: MemoryChannel, num_blocks: int) -> None:
    """Answers a plan when the next arrives (as a rank that overlaps its steps), or after 2 ms without one."""
    await outbox.send(m.WorkerReady(rank=0, num_kv_blocks=num_blocks))
    pending = None
    while True:
        try:
            msg = await asyncio.wait_for(inbox.recv(), 0.002)
        except asyncio.TimeoutError:
            if pending is not None:
                await outbox.send(pending)
                pending = None
            continue
        except ChannelClosed:
            return
        if not isinstance(msg, m.StepPlan):
            continue
        if pending is not None:
            await outbox.send(pending)
        pending = m.StepDone(step_id=msg.step_id, rank=0,
                             sampled=[m.SampledToken(c.request_id, 7) for c in msg.scheduled if c.sample])


async def _frontend(inbox: MemoryChannel, num_requests: int, done: asyncio.Future) -> None:
    ended = 0
    while ended < num_requests:
        msg = await inbox.recv()
        ended += isinstance(msg, m.Finished)
    done.set_result(None)


class _TimedConductor(ConductorActor):
    """Notes its time from each step's answers, all received, to the gauges after that step's outputs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.turns: list[tuple[int, float]] = []  # (rows of the step answered, seconds)
        self._began: tuple[int, float] | None = None

    async def await_step(self, step_id: int):
        results = await super().await_step(step_id)
        self._began = (len(results[0].sampled) if isinstance(results[0], m.StepDone) else 0, time.perf_counter())
        return results

    async def send_stats(self) -> None:
        await super().send_stats()
        if self._began is not None:
            rows, began = self._began
            self.turns.append((rows, time.perf_counter() - began))
            self._began = None


async def _turns(num_rows: int, num_frontends: int, max_tokens: int, steps_ahead: int) -> list[float]:
    num_blocks = _num_blocks(num_rows, max_tokens)
    config = Config(model=ModelConfig(path="unused", name="base"),
                    scheduler=SchedulerConfig(max_num_seqs=num_rows, max_num_batched_tokens=8192,
                                              async_scheduling=True, steps_ahead=steps_ahead),
                    kv=KvConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
    info = ModelInfo(served_name="base", model_dir="unused", architecture="LlamaForCausalLM", vocab_size=49152,
                     eos_token_ids=(2,), dtype="bfloat16", max_model_len=4096)
    to_conductor = MemoryChannel(m.PrepareToConductor, "prepare.conductor")
    to_rank = MemoryChannel(m.ConductorToWorker, "conductor.worker0", capacity_bytes=1 << 24)
    from_rank = MemoryChannel(m.WorkerToConductor, "worker0.conductor", capacity_bytes=1 << 24)
    to_frontends = [MemoryChannel(m.ConductorToFrontend, f"conductor.{frontend_name(i)}", capacity_bytes=1 << 24)
                    for i in range(num_frontends)]
    conductor = _TimedConductor(name="conductor", config=config, info=info,
                               inbox={"prepare": to_conductor, "worker0": from_rank},
                               outbox={**{frontend_name(i): ch for i, ch in enumerate(to_frontends)},
                                       "workers": MemoryBroadcast([to_rank], "workers")})
    requests = _requests(num_rows, num_frontends, max_tokens)
    loop = asyncio.get_running_loop()
    done = [loop.create_future() for _ in range(num_frontends)]
    tasks = [asyncio.create_task(conductor.run()), asyncio.create_task(_rank(to_rank, from_rank, num_blocks))]
    readers = [asyncio.create_task(_frontend(ch, sum(1 for j in range(num_rows) if j % num_frontends == i), done[i]))
               for i, ch in enumerate(to_frontends)]
    for req in requests:
        await to_conductor.send(req)
    await asyncio.gather(*done)
    await to_conductor.send(m.Shutdown())
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for reader in readers:
        reader.cancel()
    return [seconds for rows, seconds in conductor.turns if rows == num_rows]


def _scheduler_alone(num_rows: int, max_tokens: int, steps_ahead: int) -> list[float]:
    """``schedule`` + ``update`` a step of ``num_rows`` decodes, the scheduler in a loop of its own, as many
    plans in flight as the conductor's."""
    sched = Scheduler(num_blocks=_num_blocks(num_rows, max_tokens), block_size=BLOCK_SIZE, max_num_seqs=num_rows,
                      max_num_batched_tokens=8192, max_model_len=4096, eos_token_ids=[2], max_in_flight=1 + steps_ahead)
    for req in _requests(num_rows, 1, max_tokens):
        sched.receive(req)
        sched.add(req, "base")
    times, in_flight = [], []
    while sched.has_work() or in_flight:
        start = time.perf_counter()
        plan = sched.schedule() if sched.can_schedule() and sched.has_work() else None
        if plan is not None:
            in_flight.append(plan)
        if plan is None or not sched.can_schedule():
            old = in_flight.pop(0)
            sched.update(m.StepDone(step_id=old.step_id, rank=0,
                                    sampled=[m.SampledToken(c.request_id, 7) for c in old.scheduled if c.sample]))
        if plan is not None and len(plan.scheduled) == num_rows:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--frontends", type=int, default=4, help="frontend processes' channels (server.api_server_count)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--steps-ahead", type=int, choices=[1, 2], default=2,
                   help="scheduler.steps_ahead (default 2: a GPU server's, overlapped steps being on there)")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.frontends < 1 or args.max_tokens < 4:
        p.error("--rows and --frontends must be at least 1, --max-tokens at least 4")
    print(f"# the conductor's own time a decode step, ms (median), {args.frontends} frontend(s), {args.max_tokens} "
          f"tokens a request, steps ahead {args.steps_ahead}; reference: the scheduler's schedule + update alone")
    print(f"{'rows':>5} {'turn':>8} {'scheduler':>10} {'turn/scheduler':>15}")
    for num_rows in args.rows:
        print(f"# {num_rows} rows ...", file=sys.stderr, flush=True)
        turn = statistics.median(asyncio.run(_turns(num_rows, args.frontends, args.max_tokens, args.steps_ahead)))
        alone = statistics.median(_scheduler_alone(num_rows, args.max_tokens, args.steps_ahead))
        print(f"{num_rows:>5} {turn * 1e3:>8.3f} {alone * 1e3:>10.3f} {turn / alone:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
