"""Randomized property test: many requests (some of several choices, some
with media), aborts of requests and of choices, and random configs through
schedule / update with a fake worker that checks every plan; invariants are
checked after every call. Planning ahead (``max_in_flight=2`` or 3) runs the
same trials with the next plan (or two) made, and run by the worker, before
the last result is applied. Set MSTAR_SCHED_SEED to replay a failing seed."""

import os
import random
from collections import deque

import pytest

from sched_factories import EOS, FakeWorker, check_invariants, make_request, make_scheduler

from mstar_actors.messages import Failed, Finished, StepPlan, TokenDelta, choice_ids

STOP = 99
ROOTS = ["model", "adapter-a", "adapter-b"]


class Trial:
    def __init__(self, rng: random.Random, **overrides):
        self.rng = rng
        config = dict(
            num_blocks=rng.randint(6, 40),
            block_size=rng.choice([1, 2, 4, 8]),
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(6, 40),
            max_model_len=rng.randint(8, 80),
            enable_prefix_caching=rng.random() < 0.8,
        )
        self.sched = make_scheduler(**config | overrides)
        self.results: deque = deque()  # StepDones of the plans in flight, oldest first
        self.roots: dict[str, str] = {}
        self.worker = FakeWorker(self.sched.block_size, self.roots)
        self.prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(1, 30))] for _ in range(3)]
        self.num_added = 0
        self.streamed: dict[str, list[int]] = {}  # choice id -> its tokens
        self.ended: dict[str, str] = {}
        self.choices: dict[str, list[str]] = {}  # request id -> its choice ids
        self.refs: list = []  # every arena ref the requests brought

    def add_some(self) -> None:
        for _ in range(self.rng.choice([0, 0, 1, 1, 2, 3])):
            request_id = f"q{self.num_added}"
            self.num_added += 1
            prompt = self.rng.choice(self.prefixes)[: self.rng.randint(0, 30)]
            prompt += [self.rng.randrange(10, 1000) for _ in range(self.rng.choice([0, 1, 5, 20]))]
            n = self.rng.choice([1, 1, 1, 2, 3])
            num_media = min(len(prompt), self.rng.choice([0, 0, 1, 2]))
            ids = self.choices[request_id] = choice_ids(request_id, n)
            root = self.rng.choice(ROOTS)
            self.roots.update(dict.fromkeys(ids, root))
            req = make_request(
                request_id,
                prompt=prompt,
                max_tokens=self.rng.randint(1, 20),
                ignore_eos=self.rng.random() < 0.2,
                stop_token_ids=(STOP,) if self.rng.random() < 0.5 else (),
                n=n,
                num_media=num_media,
            )
            self.streamed.update({rid: [] for rid in ids})
            self.refs += [item.pixel_values for item in req.media]  # a refused request's are released too
            refusals = self.sched.add(req, root)
            if refusals:
                assert [f.request_id for f in refusals] == ids
                for refusal in refusals:
                    assert isinstance(refusal, Failed) and refusal.status == 400
                    assert refusal.request_id.startswith(request_id)
                    self.end(refusal.request_id, "refused")

    def abort_some(self) -> None:
        if self.num_added and self.rng.random() < 0.15:
            request_id = f"q{self.rng.randrange(self.num_added + 2)}"  # maybe unknown or already ended
            ids = self.choices.get(request_id, [request_id])
            if self.rng.random() < 0.5:  # one choice, else the whole request
                request_id = self.rng.choice(ids)
                ids = [request_id]
            endings = self.sched.abort(request_id)
            assert {e.request_id for e in endings} <= set(ids)
            for ending in endings:
                assert ending.finish_reason == "abort"
                self.check_finished(ending)

    def end(self, request_id: str, reason: str) -> None:
        assert request_id not in self.ended, f"{request_id} ended twice"
        self.ended[request_id] = reason

    def check_finished(self, ending: Finished) -> None:
        self.end(ending.request_id, ending.finish_reason)
        assert ending.num_output_tokens == len(self.streamed[ending.request_id])

    def check_media(self) -> None:
        """Once every request ended, the next plan's orders leave the ranks
        holding nothing, and every arena ref was released exactly once."""
        assert self.sched.media.num_requests == 0
        copies, drops, releases = self.sched.media.take()
        assert copies == []
        self.worker.apply_media(StepPlan(step_id=-1, started=[], scheduled=[], drop_media=drops, release_media=releases))
        assert self.worker.copies == {}, "a request's media copies outlived it"
        assert sorted(map(repr, self.worker.released)) == sorted(map(repr, self.refs))

    def sample(self, request_id: str) -> int:
        return self.rng.choice([EOS, STOP] + [self.rng.randrange(10, 1000)] * 6)

    def step(self) -> bool:
        """Plan (and run) while the scheduler may, then apply the oldest result."""
        while self.sched.can_schedule():
            had_work = self.sched.has_work()
            plan = self.sched.schedule()
            check_invariants(self.sched)
            if plan is None:
                assert self.results or not had_work, "schedule() returned None with work queued and none in flight"
                break
            self.check_plan(plan)
            self.results.append(self.worker.run(plan, self.sample))
        if not self.results:
            return False
        self.abort_some()  # maybe while steps are in flight
        check_invariants(self.sched)
        self.apply(self.results.popleft())
        return True

    def check_plan(self, plan: StepPlan) -> None:
        assert sum(c.num_tokens for c in plan.scheduled) <= self.sched.max_num_batched_tokens
        assert len(plan.scheduled) <= self.sched.max_num_seqs
        for start in plan.started:  # a restart resumes exactly what was streamed
            assert start.output_token_ids == self.streamed[start.request_id]
            assert start.state_slot == self.sched.requests[start.request_id].state_slot
            if start.state_slot >= 0:  # the ranks build its recurrent state from token 0, or restore a snapshot
                first = next(c for c in plan.scheduled if c.request_id == start.request_id)
                assert (first.num_computed == 0) is (start.restore_snapshot < 0)
        for chunk in plan.scheduled:  # never planned past what is known to end it
            seq = self.sched.requests[chunk.request_id]
            assert seq.num_output_tokens + seq.num_samples_in_flight <= seq.max_tokens
            assert chunk.num_computed + chunk.num_tokens <= self.sched.max_model_len

    def apply(self, done) -> None:
        for out in self.sched.update(done):
            assert out.request_id not in self.ended, f"output after the end of {out.request_id}"
            if isinstance(out, TokenDelta):
                self.streamed[out.request_id] += [t.token_id for t in out.tokens]
            else:
                self.check_finished(out)
        check_invariants(self.sched)
        return True

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.add_some()
            self.abort_some()
            self.step()
        for _ in range(10_000):
            if not self.step():
                break
        assert not self.sched.has_work()
        assert sorted(self.ended) == sorted(self.streamed), "a request never ended"
        assert self.sched.allocator.num_used == 0
        self.check_media()
        for request_id, tokens in self.streamed.items():
            reason = self.ended[request_id]
            if reason == "stop":
                assert tokens[-1] in (EOS, STOP)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_random_requests_and_aborts_keep_invariants(max_in_flight):
    seed = int(os.environ.get("MSTAR_SCHED_SEED", random.randrange(2**32)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    num_preemptions = 0
    for trial in range(40):
        t = Trial(random.Random(rng.randrange(2**32)), max_in_flight=max_in_flight)
        t.run(num_steps=60)
        num_preemptions += t.sched.num_preemptions
    assert num_preemptions > 0, "the random configs should exercise preemption"
