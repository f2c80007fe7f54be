"""The frontend's Prometheus metrics, on a registry of its own.

An own ``CollectorRegistry`` (not the process-global one) keeps two frontends
in one test process apart and keeps the default process collectors out.

The two observed once per token delta (tokens generated, inter-token
latency) are plain counts exposed as ``prometheus_client`` exposes its
``Counter`` and ``Histogram``: theirs take a lock and several calls per
observation, which a stream pays for every token.

With several frontend processes on one port (``server.api_server_count``) a
scrape reaches any one of them, so each must answer for all:
``prometheus_client``'s multiprocess mode (the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` to a folder of the run before it starts them),
every value in a file of that folder, ``render`` summing them; counters and
histograms are then ``prometheus_client``'s own, and an engine gauge (which
every frontend receives alike) is the latest written.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from mstar_actors.messages import EngineStats

# vLLM's TTFT buckets (a dashboard made for vLLM reads ours), up to the 43 minutes a long queue can take
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0, 640.0, 2560.0)
# vLLM's inter-token buckets, and finer ones below its 10 ms (a GPU's decode steps take 1-5 ms)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's end-to-end buckets, and finer ones below its 0.3 s
_E2E_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


_PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)  # a choice's preemptions
# vLLM's buckets of a step's tokens
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort")


def _one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    """Counters, histograms and engine gauges; ``render`` gives the text format.

    The engine's and the requests' metrics carry vLLM's names (``vllm:...``,
    a ``model_name`` label: the served base model), so dashboards, alerts
    and autoscalers made for vLLM read them; what vLLM has no name for (HTTP
    requests by route, KV blocks, adapter waits, recurrent-state slots) is
    ``mstar_...``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, multiprocess_dir: str | None = None, model_name: str = "", max_model_len: int = 1 << 20,
                 max_lora: int | None = None, cache_config: dict[str, str] | None = None) -> None:
        """``multiprocess_dir``: the run's folder of ``PROMETHEUS_MULTIPROC_DIR``
        (several frontends), which must be set before ``prometheus_client``
        is imported; None: this process's values alone. ``max_lora``: the
        adapter slots where adapters are served (None: none are);
        ``cache_config``: ``vllm:cache_config_info``'s labels."""
        if multiprocess_dir is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR") != multiprocess_dir:
            raise RuntimeError(f"multiprocess metrics in {multiprocess_dir}, but PROMETHEUS_MULTIPROC_DIR is "
                               f"{os.environ.get('PROMETHEUS_MULTIPROC_DIR')!r}: the launcher sets it before "
                               "starting the frontends")
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        reg = self.registry
        model = {"model_name": model_name, "engine": "0"}  # vLLM's labels (one engine: its "0")
        gauge = functools.partial(Gauge, registry=reg, **({"multiprocess_mode": "mostrecent"} if multiprocess_dir else {}))

        def vllm_gauge(name: str, documentation: str):
            return gauge(name, documentation, list(model)).labels(**model)

        def vllm_histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            return Histogram(name, documentation, list(model), buckets=buckets, registry=reg).labels(**model)

        def vllm_counter(name: str, documentation: str):
            return Counter(name, documentation, list(model), registry=reg).labels(**model)

        self.requests = Counter("mstar_requests", "HTTP requests by route and status code", ["route", "status"], registry=reg)
        self.prompt_tokens = vllm_counter("vllm:prompt_tokens", "Prompt tokens, counted once prefilled")
        # vLLM's prefix-cache pair: prompt tokens looked up, and those the cache held (hits / queries: the hit rate)
        self.prefix_cache_queries = vllm_counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the "
                                                 "prefix cache (not with caching off or prompt logprobs asked "
                                                 "for), counted once prefilled")
        self.prefix_cache_hits = vllm_counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache held")
        self.prompt_tokens_cached = vllm_counter("vllm:prompt_tokens_cached", "Prompt tokens not computed: the "
                                                 "prefix cache held them")
        self.time_to_first_token = vllm_histogram("vllm:time_to_first_token_seconds", "From arrival to the first token",
                                                  _TTFT_BUCKETS)
        self.e2e_latency = vllm_histogram("vllm:e2e_request_latency_seconds", "From arrival to a choice's end",
                                          _E2E_BUCKETS)
        self._success = Counter("vllm:request_success", "Choices ended, by finish reason (abort: not finished)",
                                [*model, "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:  # each at 0 from the start, as vLLM's: rate() and absent() read them
            self._success.labels(**model, finished_reason=reason)
        # a finished choice's phases, as vLLM's dashboard plots them (the engine's clock for the first two)
        self.queue_time = vllm_histogram("vllm:request_queue_time_seconds", "From the engine's receipt to the "
                                         "choice's first scheduled step", _E2E_BUCKETS)
        self.prefill_time = vllm_histogram("vllm:request_prefill_time_seconds", "From the first scheduled step to "
                                           "the first token", _E2E_BUCKETS)
        self.decode_time = vllm_histogram("vllm:request_decode_time_seconds", "From the first token to the last",
                                          _E2E_BUCKETS)
        self.inference_time = vllm_histogram("vllm:request_inference_time_seconds", "From the first scheduled step "
                                             "to the last token (prefill and decode)", _E2E_BUCKETS)
        self.time_per_output_token = vllm_histogram("vllm:request_time_per_output_token_seconds", "A finished "
                                                    "choice's decode time over its tokens after the first",
                                                    _ITL_BUCKETS)
        lengths = _one_two_five(max_model_len)
        self.params_n = vllm_histogram("vllm:request_params_n", "A finished choice's request's n", (1, 2, 5, 10, 20))
        self.params_max_tokens = vllm_histogram("vllm:request_params_max_tokens", "A finished choice's cap on "
                                                "its output tokens", lengths)
        self.request_prompt_tokens = vllm_histogram("vllm:request_prompt_tokens", "A finished choice's prompt "
                                                    "tokens", lengths)
        self.request_generation_tokens = vllm_histogram("vllm:request_generation_tokens", "A finished choice's "
                                                        "generated tokens", lengths)
        self.max_generation_tokens = vllm_histogram("vllm:request_max_num_generation_tokens", "A request's most "
                                                    "generated tokens of its finished choices", lengths)
        self.prefill_kv_computed = vllm_histogram("vllm:request_prefill_kv_computed_tokens", "A finished "
                                                  "choice's prompt tokens computed (the prefix cache's not)",
                                                  lengths)
        self.request_preemptions = vllm_histogram("vllm:request_num_preemptions", "A finished choice's "
                                                  "preemptions", _PREEMPTION_BUCKETS)
        self.iteration_tokens = vllm_histogram("vllm:iteration_tokens_total", "Tokens of an engine step (prompt "
                                               "chunks and decodes)", _STEP_TOKEN_BUCKETS)
        self.model = model
        if multiprocess_dir is None:
            self.generation_tokens = LoopCounter("vllm:generation_tokens", "Tokens generated", reg, model)
            self.inter_token_latency = LoopHistogram(
                "vllm:inter_token_latency_seconds", "Between consecutive token deltas", _ITL_BUCKETS, reg, model
            )
        else:  # values in the shared folder
            self.generation_tokens = vllm_counter("vllm:generation_tokens", "Tokens generated")
            self.inter_token_latency = vllm_histogram("vllm:inter_token_latency_seconds",
                                                      "Between consecutive token deltas", _ITL_BUCKETS)
        self.num_running = vllm_gauge("vllm:num_requests_running", "Requests running in the engine")
        self.num_waiting = vllm_gauge("vllm:num_requests_waiting", "Requests waiting in the engine")
        # vLLM's split of them: "deferred", held for an adapter's slot or a grammar's compile; "capacity", the rest
        waiting_by = gauge("vllm:num_requests_waiting_by_reason", "Requests waiting, by why", [*model, "reason"])
        self.num_waiting_by_reason = {reason: waiting_by.labels(**model, reason=reason)
                                      for reason in ("capacity", "deferred")}
        self.kv_cache_usage = vllm_gauge("vllm:kv_cache_usage_perc", "KV-cache blocks in use, a fraction (1: all)")
        self.num_kv_blocks_used = gauge("mstar_kv_blocks_used", "KV-cache blocks in use")
        self.num_kv_blocks_total = gauge("mstar_kv_blocks", "KV-cache blocks in all")
        # a counter (rate() and increase() read it across restarts); with several frontends
        # only the first counts, the sum over their files being the engine's
        self.num_preemptions = vllm_counter("vllm:num_preemptions", "Preemptions since start")
        self._preemptions_seen = 0
        self.num_waiting_for_adapter = gauge("mstar_num_requests_waiting_for_adapter",
                                             "Requests held until their LoRA adapter is in a slot")
        self.num_state_slots_used = gauge("mstar_state_slots_used", "Recurrent-state slots in use")
        self.num_state_slots_total = gauge("mstar_state_slots", "Recurrent-state slots in all")
        # vLLM's: the KV cache's settings as labels, the value 1 (set once the ranks' block count is known)
        self._cache_config = cache_config
        self._cache_info = None if cache_config is None else gauge(
            "vllm:cache_config_info", "The KV cache's settings", ["engine", *cache_config, "num_gpu_blocks"])
        # vLLM's, read by LoRA-affinity routers: the adapters of admitted (running) and waiting choices as labels,
        # the value the time they last changed. Every frontend gets the same EngineStats, so each renders the
        # current series itself (no multiprocess file: a past series would stay in it)
        self.max_lora = max_lora
        self._lora_info = None if max_lora is None else LatestInfo(
            "vllm:lora_requests_info", "Running stats on LoRA requests",
            {"max_lora": str(max_lora), "waiting_lora_adapters": "", "running_lora_adapters": ""}, reg)

    def observe_end(self, finish_reason: str | None, seconds: float, lengths: tuple[int, int] = (0, 0),
                    phases: tuple[float, float, float] | None = None, num_cached: int = 0,
                    num_preemptions: int = 0) -> None:
        """A choice ended: ``finish_reason`` None when it did not finish (its client left, it failed);
        ``lengths``: its prompt and generated tokens; ``phases``: its queue, prefill and decode seconds
        (None: it made no token); ``num_cached``: its prompt tokens the prefix cache held;
        ``num_preemptions``: the times it was preempted (recomputed)."""
        self._success.labels(**self.model, finished_reason=finish_reason or "abort").inc()
        if finish_reason is None:
            return
        self.e2e_latency.observe(seconds)
        self.request_prompt_tokens.observe(lengths[0])
        self.request_generation_tokens.observe(lengths[1])
        self.prefill_kv_computed.observe(max(0, lengths[0] - num_cached))
        self.request_preemptions.observe(num_preemptions)
        if phases is not None:
            queued, prefill, decode = phases
            self.queue_time.observe(queued)
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)
            if lengths[1] > 1:
                self.time_per_output_token.observe(decode / (lengths[1] - 1))

    def observe_params(self, n: int, max_tokens: int, max_generated: int = 0) -> None:
        """A request of finished choices: its n, its cap and the most tokens one of them generated (once a
        request, as vLLM's parent request)."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        self.max_generation_tokens.observe(max_generated)

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_engine(self, stats: EngineStats, counts_events: bool = True) -> None:
        """``counts_events``: this frontend adds the engine's new events to the counters. A running
        sequence parked for its adapter's slot is in no step: the gauges count it waiting."""
        num_waiting = stats.num_waiting + stats.num_parked
        self.num_running.set(stats.num_running - stats.num_parked)
        self.num_waiting.set(num_waiting)
        self.num_waiting_by_reason["capacity"].set(num_waiting - stats.num_waiting_deferred)
        self.num_waiting_by_reason["deferred"].set(stats.num_waiting_deferred)
        self.num_kv_blocks_used.set(stats.num_kv_blocks_used)
        self.num_kv_blocks_total.set(stats.num_kv_blocks_total)
        total = stats.num_kv_blocks_total
        self.kv_cache_usage.set(stats.num_kv_blocks_used / total if total else 0.0)
        if counts_events:
            for num_tokens in stats.step_tokens:
                self.iteration_tokens.observe(num_tokens)
        if counts_events and stats.num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = max(self._preemptions_seen, stats.num_preemptions)
        self.num_waiting_for_adapter.set(stats.num_waiting_for_adapter)
        self.num_state_slots_used.set(stats.num_state_slots_used)
        self.num_state_slots_total.set(stats.num_state_slots_total)
        if self._lora_info is not None:
            self._lora_info.set({"max_lora": str(self.max_lora),
                                 "waiting_lora_adapters": ",".join(stats.waiting_adapters),
                                 "running_lora_adapters": ",".join(stats.running_adapters)})
        if self._cache_info is not None and total:
            self._cache_info.labels(engine="0", **self._cache_config, num_gpu_blocks=str(total)).set(1)
            self._cache_info = None

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        every_frontend = CollectorRegistry()
        MultiProcessCollector(every_frontend, path=self.multiprocess_dir)
        if self._lora_info is not None:
            every_frontend.register(self._lora_info)
        return generate_latest(every_frontend)


class LatestInfo:
    """A gauge of one series whose labels say the current state, its value
    the time they last changed (``set_to_current_time``): this process's
    own, rendered as it stands, a past state's series gone with it."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.labels, self.since = labels, time.time()
        registry.register(self)

    def set(self, labels: dict[str, str]) -> None:
        if labels != self.labels:
            self.labels, self.since = labels, time.time()

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "gauge")]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "gauge")
        metric.add_sample(self.name, self.labels, self.since)
        yield metric


class LoopCounter:
    """A counter for one event loop's use (no lock: one thread writes and
    renders it), exposed as ``prometheus_client.Counter``: ``NAME_total``
    and ``NAME_created``."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry, labels: dict | None = None):
        self.name, self.documentation, self.labels = name, documentation, labels or {}
        self.value = 0.0
        self.created = time.time()
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "counter")]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        metric.add_sample(f"{self.name}_total", self.labels, float(self.value))
        metric.add_sample(f"{self.name}_created", self.labels, self.created)
        yield metric


class LoopHistogram:
    """A histogram for one event loop's use (a bisect and two additions per
    observation), exposed as ``prometheus_client.Histogram``: cumulative
    ``NAME_bucket{le=...}`` up to ``+Inf``, ``NAME_count``, ``NAME_sum``,
    ``NAME_created``. A value equal to a bound counts in that bound's bucket."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry,
                 labels: dict | None = None):
        self.name, self.documentation, self.labels = name, documentation, labels or {}
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, the last +Inf
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        total = 0
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            total += count
            metric.add_sample(f"{self.name}_bucket", {**self.labels, "le": floatToGoString(bound)}, float(total))
        metric.add_sample(f"{self.name}_count", self.labels, float(total))
        metric.add_sample(f"{self.name}_sum", self.labels, self.sum)
        metric.add_sample(f"{self.name}_created", self.labels, self.created)
        yield metric
