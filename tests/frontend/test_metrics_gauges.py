"""The engine gauges of the frontend's metrics, set from EngineStats."""

from mstar_actors.frontend.metrics import Metrics
from mstar_actors.messages import EngineStats


def gauges(metrics: Metrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    return {name: float(value) for name, value in (line.split(" ") for line in lines if not line.startswith("#"))
            if name.startswith(("mstar_", "vllm:")) and "le=" not in name}


def test_engine_gauges_follow_the_last_stats():
    metrics = Metrics()
    metrics.observe_engine(EngineStats(num_running=3, num_waiting=2, num_kv_blocks_used=7, num_kv_blocks_total=10,
                                       num_state_slots_used=3, num_state_slots_total=4))
    seen = gauges(metrics)
    assert seen["mstar_kv_blocks_used"] == 7 and seen["mstar_kv_blocks"] == 10
    assert seen["mstar_state_slots_used"] == 3 and seen["mstar_state_slots"] == 4
    metrics.observe_engine(EngineStats(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10))
    seen = gauges(metrics)  # a model without recurrent state reports none
    assert seen["mstar_state_slots_used"] == 0 and seen["mstar_state_slots"] == 0
    model = '{engine="0",model_name=""}'
    assert seen[f"vllm:num_requests_running{model}"] == 0 and seen[f"vllm:kv_cache_usage_perc{model}"] == 0
    # vLLM's waiting split: held for an adapter's slot or a grammar (deferred), the rest for capacity
    metrics.observe_engine(EngineStats(num_running=1, num_waiting=5, num_kv_blocks_used=1, num_kv_blocks_total=10,
                                       num_waiting_for_adapter=1, num_waiting_deferred=2))
    seen = gauges(metrics)
    assert seen['vllm:num_requests_waiting_by_reason{engine="0",model_name="",reason="capacity"}'] == 3
    assert seen['vllm:num_requests_waiting_by_reason{engine="0",model_name="",reason="deferred"}'] == 2


def test_iteration_tokens_count_each_step_the_engine_reported_once():
    """vLLM's vllm:iteration_tokens_total: a step's tokens each (``EngineStats.step_tokens``, the steps since the
    stats before), observed by the frontend that counts the engine's events only (with several, the first)."""
    metrics, other = Metrics(), Metrics()
    for stats in (EngineStats(num_running=1, num_waiting=0, num_kv_blocks_used=1, num_kv_blocks_total=10,
                              step_tokens=(40, 1)),
                  EngineStats(num_running=1, num_waiting=0, num_kv_blocks_used=1, num_kv_blocks_total=10,
                              step_tokens=(1,))):
        metrics.observe_engine(stats)
        other.observe_engine(stats, counts_events=False)
    model = '{engine="0",model_name=""}'
    seen = gauges(metrics)
    assert seen[f"vllm:iteration_tokens_total_count{model}"] == 3
    assert seen[f"vllm:iteration_tokens_total_sum{model}"] == 42
    text = metrics.render().decode()
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name=""} 2.0' in text
    assert gauges(other)[f"vllm:iteration_tokens_total_count{model}"] == 0


def test_lora_requests_info_names_the_running_and_waiting_adapters_as_vllms():
    """What LoRA-affinity routers read: one series, its labels the adapters of admitted choices and of those
    waiting for a slot, its value the time they last changed (the latest series is the current one)."""
    import time

    metrics = Metrics(max_lora=2)
    idle = EngineStats(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10)

    def series() -> dict[str, float]:
        return {name: value for name, value in gauges(metrics).items() if name.startswith("vllm:lora_requests_info")}

    (name, value), = series().items()
    assert name == 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    assert abs(value - time.time()) < 60
    metrics.observe_engine(EngineStats(num_running=3, num_waiting=1, num_kv_blocks_used=2, num_kv_blocks_total=10,
                                       running_adapters=("a", "b"), waiting_adapters=("c",)))
    assert list(series()) == [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}']
    metrics.observe_engine(idle)
    assert list(series()) == [name]
    assert "lora_requests_info" not in Metrics().render().decode()  # without adapters served: no such metric


def test_loop_counter_and_histogram_render_as_prometheus_client_does():
    import random

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from mstar_actors.frontend.metrics import LoopCounter, LoopHistogram

    buckets = (0.001, 0.0025, 0.01, 1.0, 2.5)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter, histogram = Counter("c_tokens", "doc c", registry=theirs), Histogram("h_seconds", "doc h", buckets=buckets,
                                                                                  registry=theirs)
    loop_counter, loop_histogram = LoopCounter("c_tokens", "doc c", ours), LoopHistogram("h_seconds", "doc h", buckets,
                                                                                         ours)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    values = [*buckets, 0.0, 3.0, *(rng.choice([rng.random() * 0.02, rng.random() * 4]) for _ in range(200))]
    for value in values:  # bounds themselves included: a value equal to a bound is in its bucket
        histogram.observe(value)
        loop_histogram.observe(value)
        counter.inc(3)
        loop_counter.inc(3)

    def text(registry):  # the creation times differ by when each was made
        return [line for line in generate_latest(registry).decode().splitlines() if "_created " not in line]

    assert text(ours) == text(theirs), f"seed {seed}"
    assert "h_seconds_created" in generate_latest(ours).decode() and "c_tokens_created" in generate_latest(ours).decode()
