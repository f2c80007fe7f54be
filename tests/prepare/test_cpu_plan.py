"""Sizing rules of the prepare pool (pure)."""

import pytest

from mstar_actors.cpu_plan import MAX_PREPARE_WORKERS, CpuPlan, resolve_prepare_workers


def make_plan(**overrides) -> CpuPlan:
    return CpuPlan(**({"num_cpus": 16, "num_ranks": 1, "torch_threads_per_worker": 2} | overrides))


def test_the_pool_is_cpus_left_over_the_prepare_threads():
    plan = make_plan()  # 16 - 1*2 - 2 reserved = 12 left
    assert plan.num_cpus_left == 12
    assert plan.prepare_workers(2) == 6
    assert plan.prepare_workers(3) == 4


def test_the_pool_is_capped_at_eight():
    assert make_plan(num_cpus=128).prepare_workers(1) == MAX_PREPARE_WORKERS == 8


def test_a_higher_thread_count_shrinks_the_pool_down_to_inline():
    plan = make_plan(num_cpus=12)  # 8 left
    assert [plan.prepare_workers(t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]


def test_ranks_take_their_threads_first():
    assert make_plan(num_cpus=16, num_ranks=4, torch_threads_per_worker=2).prepare_workers(1) == 6
    assert make_plan(num_cpus=4, num_ranks=2).num_cpus_left == 1  # never below one
    assert make_plan(num_cpus=2).prepare_workers(1) == 1


def test_config_overrides_and_declaration():
    plan = make_plan()
    assert resolve_prepare_workers(plan, 2, None, is_parallel=True) == 6
    assert resolve_prepare_workers(plan, 2, 3, is_parallel=True) == 3
    assert resolve_prepare_workers(plan, 2, 1, is_parallel=True) == 1  # 1 turns the pool off
    assert resolve_prepare_workers(plan, 2, 12, is_parallel=False) == 1  # no declaration: inline


@pytest.mark.parametrize("field", ["num_cpus", "num_ranks", "torch_threads_per_worker"])
def test_bad_plans_name_the_field(field):
    with pytest.raises(ValueError, match=field):
        make_plan(**{field: 0})
    with pytest.raises(ValueError, match="prepare_torch_threads"):
        make_plan().prepare_workers(0)


def test_pool_threads_get_cpus_of_their_own_from_the_top():
    plan = make_plan(torch_threads_per_worker=1)  # 16 - 1 - 2 reserved = 13 left
    assert plan.pool_cpus(list(range(16)), 4, 1) == [[15], [14], [13], [12]]
    assert plan.pool_cpus(list(range(16)), 3, 2) == [[14, 15], [12, 13], [10, 11]]
    # the affinity set as given, in any order, with gaps
    assert plan.pool_cpus([8, 2, 6, 4, 0, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15][::-1], 2, 1) == [[15], [14]]


def test_no_pinning_without_enough_cpus_for_every_thread():
    plan = make_plan(torch_threads_per_worker=1)  # 13 left
    assert plan.pool_cpus(list(range(16)), 7, 2) is None  # 14 CPUs wanted
    assert plan.pool_cpus(list(range(16)), 1, 1) is None  # inline: nothing to pin
    assert make_plan(num_cpus=2).pool_cpus([0, 1], 2, 1) is None  # the 2-core case: one CPU left
    assert make_plan(num_cpus=16).pool_cpus([0, 1, 2], 4, 1) is None  # fewer CPUs allowed than the plan says
