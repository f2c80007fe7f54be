"""The engine gauges of the frontend's metrics, set from EngineStats."""

from mstar_actors.frontend.metrics import Metrics
from mstar_actors.messages import EngineStats


def gauges(metrics: Metrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    return {name: float(value) for name, value in (line.split(" ") for line in lines if not line.startswith("#"))
            if name.startswith("mstar_") and "{" not in name}


def test_engine_gauges_follow_the_last_stats():
    metrics = Metrics()
    metrics.observe_engine(EngineStats(num_running=3, num_waiting=2, num_kv_blocks_used=7, num_kv_blocks_total=10,
                                       num_state_slots_used=3, num_state_slots_total=4))
    seen = gauges(metrics)
    assert seen["mstar_kv_blocks_used"] == 7 and seen["mstar_kv_blocks_total"] == 10
    assert seen["mstar_state_slots_used"] == 3 and seen["mstar_state_slots_total"] == 4
    metrics.observe_engine(EngineStats(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10))
    seen = gauges(metrics)  # a model without recurrent state reports none
    assert seen["mstar_state_slots_used"] == 0 and seen["mstar_state_slots_total"] == 0
    assert seen["mstar_num_requests_running"] == 0
