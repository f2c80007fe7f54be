"""The conductor's start-up agreement on its own: combining the ranks'
WorkerReady capacities and the Scheduler made from them and the model's facts."""

from __future__ import annotations

import logging

import pytest

from mstar_actors.sched.agreement import AgreementError, combine_ready, make_scheduler
from mstar_actors.config import Config, KvConfig, SchedulerConfig
from mstar_actors.messages import WorkerReady
from mstar_actors.model_info import ModelInfo

LOG = logging.getLogger("mstar_actors.conductor")


def ready(rank: int, **overrides) -> WorkerReady:
    return WorkerReady(**{"rank": rank, "num_kv_blocks": 100} | overrides)


INFO = ModelInfo(served_name="m", model_dir="m", architecture="LlamaForCausalLM", vocab_size=64,
                 eos_token_ids=(2, 7), dtype="float32", max_model_len=4096)


def config(enable_prefix_caching: bool = True) -> Config:
    return Config(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  kv=KvConfig(block_size=16, enable_prefix_caching=enable_prefix_caching))


def test_capacities_are_the_minimum_over_ranks():
    facts = combine_ready([ready(0, num_kv_blocks=90, num_state_slots=12),
                           ready(1, num_state_slots=10),
                           ready(2, num_state_slots=11)])
    assert facts == WorkerReady(rank=0, num_kv_blocks=90, num_state_slots=10)


def test_no_rank_with_recurrent_state_agrees_on_none():
    assert combine_ready([ready(0), ready(1)]).num_state_slots == 0


@pytest.mark.parametrize("slots", [(0, 8), (8, 0), (4, 4, 0)])
def test_ranks_disagreeing_on_recurrent_state_are_refused(slots):
    reports = [ready(rank, num_state_slots=n) for rank, n in enumerate(slots)]
    with pytest.raises(AgreementError, match="every rank must load the same model") as err:
        combine_ready(reports)
    assert "num_state_slots=0" in str(err.value) and f"num_state_slots={max(slots)}" in str(err.value)


def test_the_scheduler_takes_the_models_facts_and_the_configs_block_size():
    sched = make_scheduler(config(), INFO, ready(0), LOG)
    assert sched.eos_token_ids == {2, 7} and sched.max_model_len == 4096 and sched.block_size == 16


def test_scheduler_gets_the_slots_and_prefix_caching_is_off_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        sched = make_scheduler(config(), INFO, ready(0, num_state_slots=6), LOG)
    assert sched.state_slots.num_slots == 6 and not sched.enable_prefix_caching
    assert [r.getMessage() for r in caplog.records] == [
        "prefix caching is off for this model: no recurrent-state snapshots (kv.state_snapshots: 0)"
    ]


def test_scheduler_caches_prefixes_with_state_snapshots_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        sched = make_scheduler(config(), INFO, ready(0, num_state_slots=6, num_state_snapshots=4), LOG)
    assert sched.enable_prefix_caching and sched.snapshots.num_snapshots == 4
    assert [r.getMessage() for r in caplog.records] == [
        "prefix caching: 4 recurrent-state snapshots, taken where a prompt's last full block ends"
    ]


@pytest.mark.parametrize("num_state_slots, enable_prefix_caching", [(0, True), (6, False)])
def test_scheduler_logs_nothing_when_there_is_nothing_to_say(caplog, num_state_slots, enable_prefix_caching):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        sched = make_scheduler(config(enable_prefix_caching), INFO, ready(0, num_state_slots=num_state_slots), LOG)
    assert caplog.records == []
    assert sched.enable_prefix_caching is (num_state_slots == 0)
    assert (sched.state_slots is None) is (num_state_slots == 0)
