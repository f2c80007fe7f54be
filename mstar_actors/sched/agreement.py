"""The conductor's start-up agreement and its small decisions of record, pure.

``combine_ready``: the ranks' capacities as one (the minimum of each; either
every rank keeps recurrent state or none). ``make_scheduler``: the Scheduler of
the model's facts (``ModelInfo``) on that capacity. ``combine_failures``: one
failure of a step several ranks failed. ``salted_root``: a request's prefix-cache
root with its ``cache_salt``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from mstar_actors.messages import Prepared, StepFailed, WorkerReady


class AgreementError(RuntimeError):
    """Ranks reported facts that cannot be combined (a configuration bug)."""


def combine_ready(ready: list[WorkerReady]) -> WorkerReady:
    """One capacity for every rank: the minimum of each."""
    first = ready[0]
    for other in ready[1:]:
        if (other.num_state_slots > 0) != (first.num_state_slots > 0):
            raise AgreementError(
                f"rank {other.rank} reports num_state_slots={other.num_state_slots}; "
                f"rank {first.rank} reports num_state_slots={first.num_state_slots}: "
                f"every rank must load the same model (0 only for a model without recurrent state)"
            )
    return WorkerReady(
        rank=0,
        num_kv_blocks=min(r.num_kv_blocks for r in ready),
        num_state_slots=min(r.num_state_slots for r in ready),
        num_state_snapshots=min(r.num_state_snapshots for r in ready),
    )


PROMPT_LOGPROB_ENTRY_BYTES = 20  # a prompt logprob entry's encoded size, with room (its encoding takes 13-17)


def make_scheduler(config: Any, info: Any, facts: WorkerReady, log: logging.Logger) -> Any:
    """The scheduler of the model ``info`` describes, on the ranks' capacity ``facts``."""
    from mstar_actors.ring_sizes import plan_bytes
    from mstar_actors.sched.scheduler import Scheduler

    sched = config.scheduler
    if facts.num_state_slots and config.kv.enable_prefix_caching:
        if facts.num_state_snapshots:
            log.info("prefix caching: %d recurrent-state snapshots, taken where a prompt's last full block ends",
                     facts.num_state_snapshots)
        else:
            log.info("prefix caching is off for this model: no recurrent-state snapshots (kv.state_snapshots: 0)")
    return Scheduler(
        num_blocks=facts.num_kv_blocks,
        block_size=config.kv.block_size,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=info.max_model_len,
        eos_token_ids=list(info.eos_token_ids),
        enable_prefix_caching=config.kv.enable_prefix_caching,
        num_state_slots=facts.num_state_slots,
        num_state_snapshots=facts.num_state_snapshots,
        max_in_flight=1 + sched.steps_ahead if sched.async_scheduling else 1,
        # a step's prompt logprobs within a quarter of a rank's ring to the conductor (at most ~17 bytes an entry)
        max_prompt_logprob_entries=config.transport.ring_bytes // 4 // PROMPT_LOGPROB_ENTRY_BYTES,
        max_plan_bytes=plan_bytes(config, info.max_model_len),
    )


def combine_failures(step_id: int, failures: list[StepFailed]) -> StepFailed:
    """One failure for the step: the rows every failing rank names, or the
    whole step when any rank names none."""
    whole_step = any(not f.request_ids for f in failures)
    ids = [] if whole_step else sorted({rid for f in failures for rid in f.request_ids})
    return StepFailed(step_id=step_id, rank=failures[0].rank, message="; ".join(f.message for f in failures),
                      request_ids=ids)


def salted_root(root: str, prepared: Prepared) -> str:
    """The prefix-cache root of a request: its weights', plus its ``cache_salt`` (hashed: the salt itself
    is a client's secret); its media enter the chain at their first block."""
    if prepared.cache_salt:
        root = f"{root}|salt:{hashlib.sha256(prepared.cache_salt.encode()).hexdigest()}"
    return root
