"""The conductor's loop in one process, for model tests: the real scheduler
plans, one runner executes, results flow back, until every request ends."""

from __future__ import annotations

from mstar_actors import messages
from mstar_actors.sched import Scheduler

ROOT = "base"


class Engine:
    def __init__(self, runner, *, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                 enable_prefix_caching: bool = True):
        self.runner = runner
        self.sched = Scheduler(
            num_blocks=runner.num_kv_blocks, block_size=runner.block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=runner.max_model_len,
            eos_token_ids=runner.spec.eos_token_ids, enable_prefix_caching=enable_prefix_caching,
            num_state_slots=runner.num_state_slots, num_state_snapshots=runner.num_state_snapshots,
        )
        self.plans: list[messages.StepPlan] = []

    def run(self, prompts: dict[str, list[int]], sampling: messages.SamplingParams) -> dict[str, tuple[list[int], messages.Finished]]:
        """Serve ``prompts`` together; each request's tokens and its ``Finished``."""
        for rid, prompt in prompts.items():
            assert not self.sched.add(messages.Prepared(rid, "m", list(prompt), sampling), ROOT)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        ended: dict[str, messages.Finished] = {}
        while self.sched.has_work():
            plan = self.sched.schedule()
            self.plans.append(plan)
            sampled = self.runner.execute(plan)
            for out in self.sched.update(messages.StepDone(plan.step_id, 0, sampled)):
                if isinstance(out, messages.TokenDelta):
                    tokens[out.request_id] += [t.token_id for t in out.tokens]
                elif isinstance(out, messages.Finished):
                    ended[out.request_id] = out
        return {rid: (tokens[rid], ended[rid]) for rid in prompts}
