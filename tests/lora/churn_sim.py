"""Adapter-churn policy simulation: the engine's own ``AdapterPool`` and
``Scheduler`` driven by synthetic clients, with time counted in engine steps.
The churn tests run it as a regression check; run as a script it prints the
policy's table.

The scenario is ``tools/bench_lora.py``'s churn: ``--concurrency`` clients
share one queue of requests, request ``i`` asks adapter ``i % num_adapters``
(round robin), each client sends its next request when its last one ends,
and every request makes exactly ``--max-tokens`` tokens. A step's time is
the same whatever the batch holds (a launch-bound decode step), so tokens
per step is the batch's occupancy. The adapter-reader answers a read after
``--read-steps`` steps (one read at a time, in order) and every rank
acknowledges an install ``--install-steps`` steps after it was sent (1 by
default: on the H200 a swap back in runs inline between steps in about
2 ms, against decode steps of about 3 ms; an install from a host copy, an
adapter's first, takes 10-50 ms). A client's next request reaches the pool ``--client-steps``
steps after its last one ended (at least 1): the conductor routes all of a
step's endings before it reads any request the clients send back, so a
slot whose rows all end in one step is seen empty, as in the server.

Measured per concurrency, against the same run with every adapter resident
(``max_loras = num_adapters``, "no churn"): tokens per step, their ratio
(retention of the policy alone, with no device cost), time to first token
in steps (p50 / p90 / max), and the number of installs and reads.

    PYTHONPATH=. python tests/lora/churn_sim.py                  # 3 adapters over 2 slots, c = 1, 8, 32, 64
    PYTHONPATH=. python tests/lora/churn_sim.py --waves 3        # as many requests as bench_lora sends
    PYTHONPATH=. python tests/lora/churn_sim.py --install-steps 8 --concurrency 8,32

Every row of every step on an adapter slot is checked: the slot is
acknowledged and holds that request's adapter (``SimError`` otherwise; a
parked request is in no step), and every host copy hold the pool dropped
was one it had.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
from dataclasses import dataclass, field

from mstar_actors.lora.adapter_pool import QUANTUM_STEPS, AdapterPool, Admit, MoveRows
from mstar_actors.messages import (
    AdapterHostRef,
    AdapterInstalled,
    AdapterRead,
    DropAdapter,
    Failed,
    Finished,
    InstallAdapter,
    Prepared,
    ReadAdapter,
    SampledToken,
    SamplingParams,
    StepDone,
    TokenDelta,
)
from mstar_actors.sched import Scheduler

TOKEN = 7  # every step samples this; requests end by length
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
_NEXT = object()  # an event: one client sends its next request


class SimError(AssertionError):
    """A rule of the slot agreement broke in the simulation."""


@dataclass
class SimResult:
    concurrency: int
    max_loras: int
    num_requests: int = 0
    num_tokens: int = 0
    num_steps: int = 0
    num_installs: int = 0
    num_reads: int = 0
    ttft_steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / max(self.num_steps, 1)

    def ttft(self, q: float) -> int:
        ordered = sorted(self.ttft_steps)
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class _Sim:
    """One run: the pool and scheduler as the conductor wires them, plus
    a scripted reader, ranks and clients."""

    def __init__(self, concurrency, max_loras, num_adapters, max_tokens, num_requests, install_steps, read_steps,
                 client_steps, client_jitter=0, seed=0, quantum_steps=QUANTUM_STEPS):
        self.names = [f"lora{i}" for i in range(num_adapters)]
        self.adapter_pool = AdapterPool("base", max_loras, num_ranks=1, max_cpu_loras=num_adapters + 1,
                                        quantum_steps=quantum_steps)
        for name in self.names:
            self.adapter_pool.adapters[name] = _adapter(name)
        self.sched = Scheduler(num_blocks=concurrency * 20 + 64, block_size=16, max_num_seqs=max(concurrency, 8),
                               max_num_batched_tokens=4096, max_model_len=1024, eos_token_ids=[2],
                               enable_prefix_caching=False)
        self.max_tokens, self.install_steps, self.read_steps = max_tokens, install_steps, read_steps
        if client_steps < 1:
            raise ValueError(f"client_steps must be >= 1 (a next request arrives after the step's outputs), "
                             f"got {client_steps}")
        self.client_steps, self.client_jitter = client_steps, client_jitter
        self.rng = random.Random(seed)
        self.num_requests = num_requests
        self.result = SimResult(concurrency, max_loras)
        self.events: dict[int, list] = collections.defaultdict(list)  # step -> messages due then
        self.reader_free_at = 0
        self.holds: collections.Counter = collections.Counter()  # (name, digest) -> holds the pool has
        self.arrival: dict[str, int] = {}
        self.models: dict[str, str] = {}
        self.next_index = 0
        self.now = 0

    def run(self) -> SimResult:
        for _ in range(self.result.concurrency):
            self.submit()
        while self.sched.has_work() or self.adapter_pool.num_waiting or self.events:
            for msg in self.events.pop(self.now, []):
                self.deliver(msg)
            self.step()
            self.now += 1
            self.result.num_steps += 1
        return self.result

    def deliver(self, msg) -> None:
        if msg is _NEXT:
            self.submit()
        elif isinstance(msg, AdapterRead):
            self.route(self.adapter_pool.on_read(msg))
        else:
            self.route(self.adapter_pool.on_installed(msg))

    def step(self) -> None:
        plan = self.sched.schedule() if self.sched.has_work() else None
        if plan is None:
            if self.sched.has_work():
                self.route(self.adapter_pool.stalled())
            return  # idle: waiting for a read or an install
        for start in plan.started:
            self.check_slot(start.request_id, start.lora_slot)
        for chunk in plan.scheduled:
            self.check_slot(chunk.request_id, chunk.lora_slot)
        self.route(self.adapter_pool.step())  # after the plan, as the conductor sends it
        sampled = [SampledToken(c.request_id, TOKEN) for c in plan.scheduled if c.sample]
        self.result.num_tokens += len(sampled)
        self.route(self.sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=sampled)))

    def check_slot(self, request_id: str, slot: int) -> None:
        table = self.adapter_pool.table
        if slot == 0 or not table.is_ready(slot) or table._slots[slot].name != self.models[request_id]:
            raise SimError(f"step {self.now}: {request_id} on {self.models[request_id]!r} started on slot {slot}")

    def submit(self) -> None:
        if self.next_index >= self.num_requests:
            return
        i, self.next_index = self.next_index, self.next_index + 1
        request_id, model = f"r{i}", self.names[i % len(self.names)]
        self.arrival[request_id], self.models[request_id] = self.now, model  # reaches the pool before this step
        prepared = Prepared(request_id=request_id, model=model, prompt_token_ids=PROMPT,
                            sampling=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
        self.route(self.adapter_pool.add(prepared))

    def route(self, outs: list) -> None:
        for out in outs:
            match out:
                case Admit(prepared=prepared, slot=slot, root=root):
                    self.route(self.sched.add(prepared, root, slot))
                case MoveRows(request_ids=request_ids, slot=slot):
                    self.sched.set_lora_slot(request_ids, slot)
                case TokenDelta(request_id=request_id) if request_id in self.arrival:
                    self.result.ttft_steps.append(self.now + 1 - self.arrival.pop(request_id))
                case Finished(request_id=request_id):
                    self.result.num_requests += 1
                    self.route(self.adapter_pool.end(request_id))
                    delay = self.client_steps + self.rng.randint(0, self.client_jitter)
                    self.events[self.now + delay].append(_NEXT)
                case ReadAdapter(name=name):
                    self.read(name)
                case InstallAdapter(slot=slot, digest=digest):
                    self.result.num_installs += 1
                    self.events[self.now + self.install_steps].append(
                        AdapterInstalled(rank=0, slot=slot, digest=digest, ok=True))
                case DropAdapter(name=name, digest=digest):
                    if self.holds[name, digest] == 0:
                        raise SimError(f"DropAdapter({name!r}) without a hold")
                    self.holds[name, digest] -= 1
                case Failed():
                    raise SimError(f"request failed: {out}")
                case None | TokenDelta():
                    pass

    def read(self, name: str) -> None:
        """The reader answers one read at a time, in order."""
        self.result.num_reads += 1
        self.reader_free_at = max(self.reader_free_at, self.now) + self.read_steps
        self.holds[name, _digest(name)] += 1
        host = AdapterHostRef(segment=f"seg-{name}", nbytes=1)
        msg = AdapterRead(name=name, path=_adapter(name).path, digest=_digest(name), host=host, max_rank=8)
        self.events[self.reader_free_at].append(msg)


def _adapter(name: str):
    from mstar_actors.lora.adapter_pool import _Adapter

    return _Adapter(name, f"/adapters/{name}")


def _digest(name: str) -> str:
    return f"digest-{name}"


def simulate(concurrency: int, *, max_loras: int = 2, num_adapters: int = 3, max_tokens: int = 64,
             num_requests: int | None = None, install_steps: int = 1, read_steps: int = 1,
             client_steps: int = 1, client_jitter: int = 0, waves: int = 8,
             quantum_steps: int = QUANTUM_STEPS) -> SimResult:
    """One run; ``num_requests`` defaults to ``waves`` waves of ``concurrency`` (at least 48)."""
    num_requests = num_requests or max(waves * concurrency, 48)
    return _Sim(concurrency, max_loras, num_adapters, max_tokens, num_requests, install_steps, read_steps,
                client_steps, client_jitter, quantum_steps=quantum_steps).run()


def table(levels: list[int], **kw) -> str:
    num_adapters = kw.get("num_adapters", 3)
    lines = [f"churn: {num_adapters} adapters round robin over max_loras {kw.get('max_loras', 2)}; "
             f"{kw.get('max_tokens', 64)} tokens each; install {kw.get('install_steps', 1)} steps, "
             f"read {kw.get('read_steps', 1)} step(s), next request {kw.get('client_steps', 1)} step(s) after an end"
             f" (+ 0..{kw.get('client_jitter', 0)})",
             f"{'conc':>4} {'tok/step':>8} {'no churn':>8} {'ratio':>6} {'TTFT p50':>8} {'p90':>5} {'max':>5} "
             f"{'calm p90':>8} {'installs':>8} {'reads':>5}"]
    for c in levels:
        churn = simulate(c, **kw)
        calm = simulate(c, **{**kw, "max_loras": num_adapters})
        lines.append(f"{c:>4} {churn.tokens_per_step:>8.2f} {calm.tokens_per_step:>8.2f} "
                     f"{100 * churn.tokens_per_step / calm.tokens_per_step:>5.1f}% {churn.ttft(50):>8} "
                     f"{churn.ttft(90):>5} {max(churn.ttft_steps):>5} {calm.ttft(90):>8} {churn.num_installs:>8} "
                     f"{churn.num_reads:>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--max-loras", type=int, default=2)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--install-steps", type=int, default=1)
    p.add_argument("--read-steps", type=int, default=1)
    p.add_argument("--client-steps", type=int, default=1,
                   help="steps from a request's end to its client's next request reaching the pool (>= 1)")
    p.add_argument("--client-jitter", type=int, default=0,
                   help="up to this many more steps, drawn per request (seeded): the clients of one step's endings "
                        "send their next requests over several steps, as in the server (default 0)")
    p.add_argument("--requests", type=int, default=None, help="per level (default: --waves waves, at least 48)")
    p.add_argument("--waves", type=int, default=8,
                   help="requests per level = waves x concurrency, at least 48 (default 8; bench_lora runs 3)")
    p.add_argument("--quantum", type=int, default=QUANTUM_STEPS,
                   help=f"a tenant's turn in steps, at least (default {QUANTUM_STEPS})")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(table(levels, max_loras=args.max_loras, num_adapters=args.adapters, max_tokens=args.max_tokens,
                install_steps=args.install_steps, read_steps=args.read_steps, num_requests=args.requests,
                client_steps=args.client_steps, client_jitter=args.client_jitter, waves=args.waves,
                quantum_steps=args.quantum))
    return 0


if __name__ == "__main__":
    sys.exit(main())
