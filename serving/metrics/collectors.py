"""Collectors the Prometheus registry reads at scrape time: the engine's stats snapshot,
and counters and histograms kept as plain numbers by their one writer."""

from __future__ import annotations

import bisect

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

OWN = "qwen_jax"  # the prefix of metrics vLLM has no counterpart of


class EngineCollector:
    """Gauges and cumulative counters straight from the engine's stats snapshot; with
    data-parallel replicas (serving/engine/data_parallel.py) one series per replica,
    labelled `engine="i"` as vLLM labels its engine cores."""

    def __init__(self, llm, model_name: str, prefix: str):
        self.llm, self.model_name, self.prefix = llm, model_name, prefix
        per_replica = hasattr(llm, "replica_stats")
        self.labels = ["model_name", "engine"] if per_replica else ["model_name"]

    def rows(self) -> list[tuple[list[str], dict, bool]]:
        """(label values, stats, dead) per engine."""
        if len(self.labels) == 1:
            return [([self.model_name], self.llm.stats(),
                     getattr(self.llm, "dead", None) is not None)]
        return [([self.model_name, str(i)], stats, not serving)
                for i, serving, stats in self.llm.replica_stats() if stats]

    def _family(self, cls, name: str, doc: str, key: str, prefix: str | None = None,
                rows=None):
        family = cls(f"{prefix or self.prefix}:{name}", doc, labels=self.labels)
        for values, stats, dead in rows:
            family.add_metric(values, float(dead) if key == "dead" else stats[key])
        return family

    def collect(self):
        rows = self.rows()
        g, c = GaugeMetricFamily, CounterMetricFamily
        for cls, name, doc, key, prefix in (
                (g, "num_requests_running", "Requests in model execution batches.",
                 "num_running", None),
                (g, "num_requests_waiting", "Requests waiting to be processed.",
                 "num_waiting", None),
                (g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.",
                 "kv_cache_usage", None),
                (c, "prefix_cache_queries", "Prefix cache queries, in tokens.",
                 "prefix_cache_queries", None),
                (c, "prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits",
                 None),
                (c, "num_preemptions", "Cumulative number of preemptions.", "num_preemptions",
                 None),
                (c, "num_compiles", "XLA compilations of the model step.", "num_compiles", OWN),
                (g, "kv_cache_used_pages", "KV pages held by requests.", "num_used_pages", OWN),
                (g, "kv_cache_total_pages", "KV pages in the cache.", "num_total_pages", OWN),
                (g, "engine_dead", "1 once a failed step has killed the engine (a replica: "
                 "while it is not serving).", "dead", OWN)):
            yield self._family(cls, name, doc, key, prefix, rows)
        yield from scheduling_families(self, rows)
        yield from spec_decode_families(self, rows)
        if len(self.labels) > 1:  # data-parallel replicas: how often each was started again
            family = c(f"{OWN}:engine_restarts", "Times the replica was started again after "
                       "its engine process died.", labels=self.labels)
            for replica in self.llm.replicas:
                family.add_metric([self.model_name, str(replica.index)], replica.num_restarts)
            yield family


def scheduling_families(collector: EngineCollector, rows):
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
        yield collector._family(cls, name, doc, key, OWN, rows)


def spec_decode_families(collector: EngineCollector, rows):
    """Speculative decoding, vLLM's names: drafts (verify steps of a sequence with
    drafts), draft and accepted tokens, accepted tokens per draft position."""
    c = CounterMetricFamily
    for name, doc in (("num_drafts", "Verify steps of a sequence with draft tokens."),
                      ("num_draft_tokens", "Draft tokens verified."),
                      ("num_accepted_tokens", "Draft tokens accepted.")):
        yield collector._family(c, f"spec_decode_{name}", doc, f"spec_decode_{name}",
                                rows=rows)
    family = c(f"{collector.prefix}:spec_decode_num_accepted_tokens_per_pos",
               "Draft tokens accepted at each draft position.",
               labels=[*collector.labels, "position"])
    for values, stats, _ in rows:
        for position, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric([*values, str(position)], count)
    yield family


class PlainCounter:
    """A counter kept as a plain number by its one writer (the engine thread's step
    listener: no lock each time), read by `read` when scraped."""

    def __init__(self, name: str, doc: str, model_name: str, read):
        self.name, self.doc, self.model_name, self.read = name, doc, model_name, read

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], self.read())
        yield family


class TokenGaps:
    """A histogram of the gaps between a request's tokens, collected under each of
    `names`. One writer (the engine thread's step listener, a few distinct gaps a step)
    and the scrapes read it, so it is plain counts: a bisect and two adds per gap value.
    Two prometheus_client Histograms observed per streamed output were about a quarter of
    a streamed chunk's cost on the server's event loop."""

    def __init__(self, model_name: str, buckets: tuple[float, ...],
                 names: list[tuple[str, str]]):
        self.model_name, self.names = model_name, names
        self.bounds = (*buckets, float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, gap: float, times: int = 1) -> None:
        """`times` gaps of `gap` seconds each."""
        self.counts[bisect.bisect_left(self.bounds, gap)] += times
        self.sum += gap * times

    def collect(self):
        buckets, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        for name, doc in self.names:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], buckets, sum_value=self.sum)
            yield family
