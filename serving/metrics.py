"""Prometheus metrics with vLLM's meanings under a `qwen_jax:` prefix.

Engine-wide state (running/waiting, KV usage, prefix cache, preemptions, compiles) is read
from `AsyncLLM.stats()` at scrape time by a custom collector; per-request observations
(tokens, latencies, finish reasons) are recorded by the server as outputs arrive; tokens per
step come from the engine's step listener. Each server owns a private registry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.request import RequestOutput

PREFIX = "qwen_jax:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (seconds / tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    """Gauges and cumulative counters straight from the engine's stats snapshot."""

    def __init__(self, llm, model_name: str):
        self.llm, self.labels = llm, {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(PREFIX + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s = self.llm.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "num_requests_running", "Requests in model execution batches.",
                           s["num_running"])
        yield self._family(g, "num_requests_waiting", "Requests waiting to be processed.",
                           s["num_waiting"])
        yield self._family(g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.",
                           s["kv_cache_usage"])
        yield self._family(c, "prefix_cache_queries", "Prefix cache queries, in tokens.",
                           s["prefix_cache_queries"])
        yield self._family(c, "prefix_cache_hits", "Prefix cache hits, in tokens.",
                           s["prefix_cache_hits"])
        yield self._family(c, "num_preemptions", "Cumulative number of preemptions.",
                           s["num_preemptions"])
        yield self._family(c, "num_compiles", "XLA compilations of the model step.",
                           s["num_compiles"])
        yield from _scheduling_families(self, s)


def _scheduling_families(collector: _EngineCollector, s: dict):
    """Self-protection and KV swap (vLLM v0's names for the swap gauges)."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    for cls, name, doc, key in (
            (g, "scheduler_max_num_batched_tokens",
             "Effective token budget per step (lowered while degraded).",
             "max_num_batched_tokens"),
            (g, "scheduler_degraded", "1 while KV pressure has lowered the token budget.",
             "degraded"),
            (c, "scheduler_degradation_switches", "Times degradation switched on or off.",
             "num_degradation_switches"),
            (c, "scheduler_priority_boosts",
             "Waiting requests boosted one level after waiting past --boost-wait.",
             "num_priority_boosts"),
            (g, "num_requests_swapped", "Preempted requests whose KV is in host memory.",
             "num_swapped_requests"),
            (g, "cpu_cache_usage_perc", "Host swap space usage. 1 means 100 percent.",
             "swap_space_usage"),
            (c, "num_swap_outs", "Preemptions that copied the KV to host memory.",
             "num_swap_outs"),
            (c, "num_swap_ins", "Swapped-out requests resumed from host memory.",
             "num_swap_ins"),
            (c, "num_recomputed_tokens", "Computed tokens discarded by recompute preemptions.",
             "num_recomputed_tokens")):
        yield collector._family(cls, name, doc, s[key])


class Metrics:
    def __init__(self, llm, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.request_success = counter("request_success", "Finished requests by reason.",
                                       ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request spent waiting before its first step.",
                                    LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.",
                                          TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(llm, model_name))
        # Plain totals for the periodic throughput log line.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def on_step(self, step_info: dict, outputs) -> None:
        """Engine-thread step listener."""
        self.iteration_tokens.labels(self.model_name).observe(step_info.get("num_tokens", 0))

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one request's cumulative outputs: token counts, ITL, and at finish the
    latency histograms and finish reasons."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.label = metrics.model_name
        self.num_tokens: dict[int, int] = {}
        self.last_time: float | None = None
        self.prompt_counted = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        new = 0
        for c in output.outputs:
            new += len(c.token_ids) - self.num_tokens.get(c.index, 0)
            self.num_tokens[c.index] = len(c.token_ids)
        if new and not self.prompt_counted:
            self.prompt_counted = True
            self.m.prompt_tokens.labels(self.label).inc(len(output.prompt_token_ids))
            self.m.num_prompt_tokens += len(output.prompt_token_ids)
        if new:
            self.m.generation_tokens.labels(self.label).inc(new)
            self.m.num_generation_tokens += new
            if self.last_time is not None:
                self.m.itl.labels(self.label).observe(now - self.last_time)
            self.last_time = now
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        for c in output.outputs:
            self.m.request_success.labels(self.label, c.finish_reason or "abort").inc()
        t = output.metrics
        if t is None:
            return
        if t.first_token_time is not None:
            self.m.ttft.labels(self.label).observe(t.first_token_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            self.m.queue_time.labels(self.label).observe(t.first_scheduled_time - t.arrival_time)
        self.m.e2e.labels(self.label).observe((t.finished_time or now) - t.arrival_time)
