"""A scripted stand-in for the conductor, for model-runner tests: allocates
KV blocks, cuts chunks, sends StepPlans and records every sampled token."""

from __future__ import annotations

from typing import Any

from mstar_actors import messages


class PlanDriver:
    def __init__(self, runner: Any, *, block_size: int, num_new: int, sampling: messages.SamplingParams):
        self.runner = runner
        self.block_size, self.num_new, self.sampling = block_size, num_new, sampling
        self.free = list(range(runner.num_kv_blocks - 1, 0, -1))
        # A hybrid model's recurrent-state slots, handed out at start like the scheduler does.
        self.free_states = list(range(getattr(runner, "num_state_slots", 0) - 1, -1, -1))
        self.seqs: dict[str, dict] = {}
        self.firsts: dict[str, messages.SampledToken] = {}  # each request's first sampled token
        self.step_id = 0

    def start(self, rid, prompt, media=(), outputs=(), *, slot=0, shared_blocks=(), num_computed=0,
              sampling: messages.SamplingParams | None = None) -> messages.SeqStart:
        """A new (or restarted, with ``outputs``) sequence; ``shared_blocks`` and
        ``num_computed`` model a prefix-cache hit; ``sampling``: the driver's if None."""
        state = self.free_states.pop() if self.free_states else -1
        self.seqs[rid] = dict(num_prompt=len(prompt), outputs=list(outputs), blocks=list(shared_blocks),
                              done=num_computed, state=state)
        return messages.SeqStart(rid, list(prompt), sampling or self.sampling, list(outputs), media=list(media), lora_slot=slot,
                                 state_slot=state)

    def chunk(self, rid, num_tokens: int | None = None) -> messages.ScheduledChunk:
        seq = self.seqs[rid]
        total = seq["num_prompt"] + len(seq["outputs"])
        num_tokens = num_tokens or total - seq["done"]
        stop = seq["done"] + num_tokens
        while len(seq["blocks"]) * self.block_size < stop:
            seq["blocks"].append(self.free.pop())
        chunk = messages.ScheduledChunk(rid, seq["done"], num_tokens, list(seq["blocks"]), stop == total)
        seq["done"] = stop
        return chunk

    def finish(self, rid) -> str:
        seq = self.seqs.pop(rid)
        self.free += seq["blocks"]
        if seq["state"] >= 0:
            self.free_states.append(seq["state"])
        return rid

    def step(self, started=(), chunks=(), finished=()) -> None:
        plan = messages.StepPlan(self.step_id, list(started), list(chunks), list(finished))
        self.step_id += 1
        for token in self.runner.execute(plan):
            outputs = self.seqs[token.request_id]["outputs"]
            if not outputs:
                self.firsts[token.request_id] = token  # (a request's first carries its prompt logprobs)
            outputs.append(token.token_id)

    def decodes(self, *rids) -> list[messages.ScheduledChunk]:
        """One decode chunk for each still-running sequence that wants more tokens."""
        return [self.chunk(r) for r in rids if r in self.seqs and len(self.seqs[r]["outputs"]) < self.num_new]

    def run_to_end(self) -> dict[str, list[int]]:
        """Decode every sequence to ``num_new`` tokens; their outputs by id."""
        while chunks := self.decodes(*self.seqs):
            self.step([], chunks)
        return {rid: seq["outputs"] for rid, seq in self.seqs.items()}
