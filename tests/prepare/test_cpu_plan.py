"""Sizing rules of the prepare pool (pure)."""

import pytest

from mstar_actors.prepare.cpu_plan import MAX_PREPARE_WORKERS, CpuPlan, resolve_prepare_workers


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


def test_pool_threads_take_one_cpu_per_physical_core_first():
    plan = make_plan(torch_threads_per_worker=1)  # 13 left
    # Hardware threads numbered in pairs (2k, 2k+1 share core k): the top
    # four CPUs are two cores, so the pool skips every second one.
    pairs = {cpu: cpu // 2 for cpu in range(16)}
    assert plan.pool_cpus(list(range(16)), 4, 1, pairs) == [[15], [13], [11], [9]]
    assert plan.pool_cpus(list(range(16)), 2, 2, pairs) == [[13, 15], [9, 11]]
    # Numbered by halves (k, k+8 share core k): the top four are four cores already.
    halves = {cpu: cpu % 8 for cpu in range(16)}
    assert plan.pool_cpus(list(range(16)), 4, 1, halves) == [[15], [14], [13], [12]]
    # More threads than cores: the second hardware threads come last, top down.
    assert plan.pool_cpus([12, 13, 14, 15], 3, 1, {12: 0, 13: 0, 14: 1, 15: 1}) == [[15], [13], [14]]
    # A CPU the map does not know is a core of its own.
    assert plan.pool_cpus(list(range(16)), 2, 1, {15: 7, 14: 7}) == [[15], [13]]
