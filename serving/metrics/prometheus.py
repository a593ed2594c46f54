"""Prometheus metrics: vLLM's metrics with vLLM's meanings and buckets, under a `qwen_jax:`
prefix or, with `prefix="vllm"`, under vLLM's own names (so dashboards and autoscalers built
for vLLM work unchanged); metrics vLLM has no counterpart of (utilisation, compiles, step
shape, HTTP status codes) are always `qwen_jax:`.

Engine-wide state (running/waiting, KV usage, prefix cache, preemptions, compiles) is read
from `AsyncLLM.stats()` at scrape time by a custom collector; per-request observations
(tokens, latencies, finish reasons, parameters) are recorded by the server as outputs
arrive; per-step ones (batched tokens, new sequences, device time, FLOPs and bytes against
the device's peaks, serving/metrics/step_cost.py) come from the engine's step listener.
Each server owns a private registry; collectors.py holds the collectors read at scrape time.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.core.request import RequestOutput, SamplingParams
from serving.metrics.collectors import OWN, EngineCollector, PlainCounter, TokenGaps
from serving.metrics.lora_info import LoRAInfoCollector
from serving.metrics.nvml import NvmlCollector, load_nvml
from serving.metrics.step_cost import CostModel, DevicePeak, device_peak

METRICS_PREFIXES = ("qwen_jax", "vllm")  # vllm: vLLM's metric names, for its dashboards
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (seconds / tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# Ours: device seconds of a step, fractions of a peak, and absolute rates (CPU to B200).
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                        2.0, 5.0, 10.0)
UTILISATION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9,
                       0.95, 1.0)
RATE_BUCKETS = tuple(m * 10.0 ** e for e in range(6, 17) for m in (1, 2, 5))


def bucket_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, ... up to `limit` (vLLM's token-count buckets)."""
    return tuple(v for v in (m * 10 ** e for e in range(12) for m in (1, 2, 5)) if v <= limit)


class _Factory:
    """Metrics of one registry, labelled by model name."""

    def __init__(self, registry: CollectorRegistry, prefix: str):
        self.registry, self.prefix = registry, prefix

    def name(self, base: str, own: bool) -> str:
        return f"{OWN if own else self.prefix}:{base}"

    def counter(self, base, doc, extra=(), own=False):
        return Counter(self.name(base, own), doc, ["model_name", *extra], registry=self.registry)

    def histogram(self, base, doc, buckets, own=False):
        return Histogram(self.name(base, own), doc, ["model_name"], buckets=buckets,
                         registry=self.registry)

    def gauge(self, base, doc, own=True):
        return Gauge(self.name(base, own), doc, ["model_name"], registry=self.registry)


# The metrics `Metrics.on_step` updates every engine step.
_STEP_SERIES = ("iteration_tokens", "iteration_seqs", "iteration_new_seqs", "step_seconds",
                "flops", "bytes", "flops_rate", "bytes_rate", "mfu", "mbu")


class Metrics:
    """`cost_model` and `peak` (None: unknown, e.g. a CPU) turn each step's shape and
    device time into FLOP/s and bytes/s, and into utilisation of `num_devices` x peak."""

    def __init__(self, llm, model_name: str, *, prefix: str = OWN, max_model_len: int = 4096,
                 cost_model: CostModel | None = None, peak: DevicePeak | None = None,
                 num_devices: int = 1):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.cost_model, self.peak, self.num_devices = cost_model, peak, num_devices
        f = _Factory(self.registry, prefix)
        # Plain totals, for the periodic throughput log line; generation_tokens_total too.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._request_metrics(f, bucket_1_2_5(max_model_len))
        self._step_metrics(f)
        # The series each step updates, labelled once: `labels()` takes a lock and builds
        # its key on every call (it was ~40% of a streamed chunk's cost in the server,
        # whose per-output series are plain counts now: PlainCounter, TokenGaps).
        self._step_series = {name: getattr(self, name).labels(model_name)
                             for name in _STEP_SERIES if hasattr(self, name)}  # mfu: a peak
        self.http_responses = f.counter("http_responses", "HTTP responses by status code.",
                                        ["code"], own=True)
        self.registry.register(EngineCollector(llm, model_name, prefix))
        self.lora_info = LoRAInfoCollector(llm, prefix) if "max_loras" in llm.stats() else None
        if self.lora_info is not None:  # the engine serves LoRA adapters
            self.registry.register(self.lora_info)

    def _request_metrics(self, f: _Factory, lengths: tuple[int, ...]) -> None:
        h = f.histogram
        # Counted by the engine thread's step listener (on_step): plain totals, one writer.
        self.registry.register(PlainCounter(
            f.name("prompt_tokens", False), "Prefill tokens processed.", self.model_name,
            lambda: self.num_prompt_tokens))
        self.registry.register(PlainCounter(
            f.name("generation_tokens", False), "Generation tokens processed.",
            self.model_name, lambda: self.num_generation_tokens))
        self.request_success = f.counter("request_success", "Finished requests by reason.",
                                         ["finished_reason"])
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        # Inter-token latency, and vLLM's older name for the same intervals (its dashboards
        # graph it): one histogram under both names.
        self.token_gaps = TokenGaps(self.model_name, ITL_BUCKETS, [
            (f.name("inter_token_latency_seconds", False), "Inter-token latency."),
            (f.name("time_per_output_token_seconds", False), "Time per output token.")])
        self.registry.register(self.token_gaps)
        self.request_tpot = h("request_time_per_output_token_seconds",
                              "Decode time / (generated tokens - 1), per request.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.",
                     LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds",
                            "Time in WAITING before the first step.", LATENCY_BUCKETS)
        self.inference_time = h("request_inference_time_seconds",
                                "Time in RUNNING: first step to finish.", LATENCY_BUCKETS)
        self.prefill_time = h("request_prefill_time_seconds",
                              "First step to first token.", LATENCY_BUCKETS)
        self.decode_time = h("request_decode_time_seconds", "First token to finish.",
                             LATENCY_BUCKETS)
        self.request_prompt_tokens = h("request_prompt_tokens", "Prompt tokens per request.",
                                       lengths)
        self.request_generation_tokens = h("request_generation_tokens",
                                           "Generated tokens per request (all n samples).",
                                           lengths)
        self.request_max_generation_tokens = h("request_max_num_generation_tokens",
                                               "Most tokens any sample of a request generated.",
                                               lengths)
        self.request_n = h("request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_max_tokens = h("request_params_max_tokens",
                                    "The max_tokens request parameter.", lengths)

    def _step_metrics(self, f: _Factory) -> None:
        h = f.histogram
        self.iteration_tokens = h("iteration_tokens_total", "Tokens per engine step.",
                                  TOKEN_BUCKETS)
        self.iteration_seqs = h("iteration_seqs", "Sequences per engine step.",
                                TOKEN_BUCKETS, own=True)
        self.iteration_new_seqs = h("iteration_new_seqs",
                                    "Sequences admitted from the waiting queue per step.",
                                    TOKEN_BUCKETS, own=True)
        self.step_seconds = h("step_seconds", "Device time of a step (its jitted call).",
                              STEP_SECONDS_BUCKETS, own=True)
        self.flops = f.counter("model_flops",
                               "Model FLOPs computed (serving/metrics/step_cost.py).", own=True)
        self.bytes = f.counter("model_bytes", "Weight and KV bytes a step reads and writes.",
                               own=True)
        self.flops_rate = h("model_flops_per_second", "Model FLOPs / device time, per step.",
                            RATE_BUCKETS, own=True)
        self.bytes_rate = h("memory_bytes_per_second", "Model bytes / device time, per step.",
                            RATE_BUCKETS, own=True)
        if self.peak is None:
            return
        self.mfu = h("model_flops_utilization", "Per step: model FLOP/s / peak FLOP/s.",
                     UTILISATION_BUCKETS, own=True)
        self.mbu = h("memory_bandwidth_utilization", "Per step: bytes/s / peak bandwidth.",
                     UTILISATION_BUCKETS, own=True)
        peak_bytes = self.peak.memory_bytes_per_s * self.num_devices
        peak_flops = self.peak.flops(self.cost_model.param_bytes if self.cost_model else 2)
        f.gauge("peak_flops_per_second", f"Peak of the replica's devices ({self.peak.name}).",
                ).labels(self.model_name).set(peak_flops * self.num_devices)
        f.gauge("peak_memory_bytes_per_second", "Peak memory bandwidth of the replica.",
                ).labels(self.model_name).set(peak_bytes)

    def on_step(self, step_info: dict, outputs) -> None:
        """Engine-thread step listener (the series labelled once: it runs every step). The
        token counts and inter-token latency come from the step's own stats, as vLLM's
        engine keeps them: whatever its outputs hold (whole responses get only their final
        one; --stream-interval), every token counts, each gap measured from its own
        previous token."""
        self.num_generation_tokens += step_info.get("num_generated", 0)
        self.num_prompt_tokens += step_info.get("num_prompt_tokens", 0)
        previous = step_info.get("previous_token_times")
        if previous:
            now, observe = step_info["token_time"], self.token_gaps.observe
            for then, count in previous.items():
                observe(now - then, count)
        series = self._step_series
        if self.lora_info is not None:
            self.lora_info.on_step()
        series["iteration_tokens"].observe(step_info.get("num_tokens", 0))
        series["iteration_seqs"].observe(step_info.get("num_seqs", 0))
        series["iteration_new_seqs"].observe(step_info.get("num_admitted", 0))
        seconds, shape = step_info.get("seconds"), step_info.get("shape")
        if seconds is None:
            return
        series["step_seconds"].observe(seconds)
        if shape is None or self.cost_model is None or seconds <= 0:
            return
        cost = self.cost_model.cost(shape)
        series["flops"].inc(cost.flops)
        series["bytes"].inc(cost.bytes)
        series["flops_rate"].observe(cost.flops / seconds)
        series["bytes_rate"].observe(cost.bytes / seconds)
        if self.peak is not None:
            peak_flops = self.peak.flops(self.cost_model.param_bytes) * self.num_devices
            peak_bytes = self.peak.memory_bytes_per_s * self.num_devices
            series["mfu"].observe(cost.flops / seconds / peak_flops)
            series["mbu"].observe(cost.bytes / seconds / peak_bytes)

    def tracker(self, params: SamplingParams | None = None) -> RequestTracker:
        return RequestTracker(self, params)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one request's outputs (DELTA, or one FINAL_ONLY): each sample's finish
    reason, and at the finish the latency, token-count and parameter histograms. Token
    counts and inter-token latency are the step listener's (Metrics.on_step)."""

    def __init__(self, metrics: Metrics, params: SamplingParams | None = None):
        self.m = metrics
        self.params = params
        self.label = metrics.model_name
        self.num_tokens: dict[int, int] = {}

    def observe(self, output: RequestOutput) -> None:
        num_tokens = self.num_tokens
        for c in output.outputs:  # what each output adds (a FINAL_ONLY one: everything)
            num_tokens[c.index] = num_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.m.request_success.labels(self.label, c.finish_reason).inc()
        if output.finished:
            self._finish(output, time.monotonic())

    def _finish(self, output: RequestOutput, now: float) -> None:
        m, label = self.m, self.label
        lengths = list(self.num_tokens.values()) or [0]
        m.request_prompt_tokens.labels(label).observe(len(output.prompt_token_ids))
        m.request_generation_tokens.labels(label).observe(sum(lengths))
        m.request_max_generation_tokens.labels(label).observe(max(lengths))
        if self.params is not None:
            m.request_n.labels(label).observe(self.params.n)
            if self.params.max_tokens is not None:
                m.request_max_tokens.labels(label).observe(self.params.max_tokens)
        if output.metrics is not None:
            self._phases(output.metrics, now, max(lengths))

    def _phases(self, t, now: float, num_generated: int) -> None:
        m, label = self.m, self.label
        finished = t.finished_time or now
        m.e2e.labels(label).observe(finished - t.arrival_time)
        if t.first_token_time is not None:
            m.ttft.labels(label).observe(t.first_token_time - t.arrival_time)
            decode = finished - t.first_token_time
            m.decode_time.labels(label).observe(decode)
            if num_generated > 1:
                m.request_tpot.labels(label).observe(decode / (num_generated - 1))
        if t.first_scheduled_time is not None:
            m.queue_time.labels(label).observe(t.first_scheduled_time - t.arrival_time)
            m.inference_time.labels(label).observe(finished - t.first_scheduled_time)
            if t.first_token_time is not None:
                m.prefill_time.labels(label).observe(t.first_token_time - t.first_scheduled_time)


def metrics_for(llm, model_name: str, prefix: str = OWN) -> Metrics:
    """The metrics of a server over `llm` (an AsyncLLM): its engine's cost model and
    devices, and NVML's gauges when NVML answers."""
    engine = llm.engine
    cost = engine.cost_model
    devices = engine.devices
    metrics = Metrics(llm, model_name, prefix=prefix, max_model_len=engine.max_model_len,
                      cost_model=cost, peak=device_peak(devices[0].device_kind),
                      num_devices=len(devices))
    nvml = load_nvml() if devices[0].platform == "gpu" else None
    if nvml is not None:
        metrics.registry.register(NvmlCollector(nvml, model_name))
    return metrics


async def log_throughput(metrics: Metrics, llm, interval: float,
                         logger: logging.Logger) -> None:
    """Every `interval` seconds while there is work, vLLM's throughput log line."""
    last = (time.monotonic(), metrics.num_prompt_tokens, metrics.num_generation_tokens)
    while True:
        await asyncio.sleep(interval)
        now = (time.monotonic(), metrics.num_prompt_tokens, metrics.num_generation_tokens)
        s = llm.stats()
        if now[1:] != last[1:] or s["num_running"] or s["num_waiting"]:
            seconds = now[0] - last[0]
            logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f "
                        "tokens/s, running: %d reqs, waiting: %d reqs, KV cache usage: "
                        "%.1f%%, prefix cache hit rate: %.1f%%",
                        (now[1] - last[1]) / seconds, (now[2] - last[2]) / seconds,
                        s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"],
                        100 * s["prefix_cache_hit_rate"])
        last = now
