"""/metrics: vLLM's request and step histograms, FLOPs counted to the step, utilisation
against a device peak, vLLM's names on request, NVML gauges, and the shipped dashboard."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import aiohttp
import pytest

from serving.engine.stats import spec_decode_stats
from serving.metrics.nvml import NvmlCollector, load_nvml
from serving.metrics.prometheus import Metrics
from serving.metrics.step_cost import CostModel, DevicePeak, StepShape
from tests.helpers.prometheus import parse_values
from tests.server.conftest import ServerThread, wait_idle

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "qwen-jax-dashboard.json"
LABEL = '{model_name="tiny"}'


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    return parse_values(text)


async def complete(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            return await r.json()


async def test_request_and_step_histograms_vllm_users_graph(server):
    await wait_idle(server.llm)
    before = await scrape(server.url)
    await complete(server.url, {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2,
                                "temperature": 0.5, "ignore_eos": True})
    await wait_idle(server.llm)
    after = await scrape(server.url)

    def grew(name):
        return after[f"qwen_jax:{name}{LABEL}"] - before.get(f"qwen_jax:{name}{LABEL}", 0)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_n"):
        assert grew(f"{name}_count") == 1, name
    assert grew("request_prompt_tokens_sum") == 3
    assert grew("request_generation_tokens_sum") == 8  # both samples
    assert grew("request_max_num_generation_tokens_sum") == 4
    assert grew("request_params_n_sum") == 2 and grew("request_params_max_tokens_sum") == 4
    assert grew("time_per_output_token_seconds_count") >= 3
    assert grew("inter_token_latency_seconds_count") == grew(
        "time_per_output_token_seconds_count")
    assert grew("generation_tokens_total") == 8
    steps = grew("iteration_tokens_total_count")
    assert steps >= 4 and grew("iteration_seqs_count") == steps
    assert grew("iteration_new_seqs_sum") == 2  # the two samples were admitted once each
    assert grew("step_seconds_count") == steps


async def test_flops_are_counted_to_the_step(server):
    """One request alone: a 3-token prefill, then 3 decodes at contexts 4, 5, 6."""
    await wait_idle(server.llm)
    before = await scrape(server.url)
    await complete(server.url, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                "ignore_eos": True})
    await wait_idle(server.llm)
    after = await scrape(server.url)
    engine = server.llm.engine
    model = CostModel(engine.model_config, 4, 4)
    shapes = [StepShape(query_lens=(3,), context_lens=(3,))] + [
        StepShape(query_lens=(1,), context_lens=(c,)) for c in (4, 5, 6)]
    name = f"qwen_jax:model_flops_total{LABEL}"
    assert after[name] - before[name] == sum(model.flops(s) for s in shapes)
    name = f"qwen_jax:model_bytes_total{LABEL}"
    assert after[name] - before[name] == pytest.approx(sum(model.cost(s).bytes for s in shapes))
    assert after[f"qwen_jax:model_flops_per_second_count{LABEL}"] >= 4
    # A CPU has no peak: absolute rates only.
    assert not any("utilization" in key for key in after)


class _FakeLLM:
    dead = None

    @staticmethod
    def stats():
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                "num_compiles": 0, "num_used_pages": 0, "num_total_pages": 9,
                "max_num_batched_tokens": 64, "degraded": 0, "num_degradation_switches": 0,
                "num_priority_boosts": 0, "num_swapped_requests": 0, "swap_space_usage": 0.0,
                "num_swap_outs": 0, "num_swap_ins": 0, "num_recomputed_tokens": 0,
                **spec_decode_stats(None)}


def test_utilisation_is_the_step_rate_over_the_devices_peak(server):
    model = CostModel(server.llm.engine.model_config, 2, 2)
    peak = DevicePeak("test", bf16_flops=1e9, tf32_flops=5e8, memory_bytes_per_s=1e8)
    metrics = Metrics(_FakeLLM(), "m", cost_model=model, peak=peak, num_devices=2)
    shape = StepShape(query_lens=(1, 1), context_lens=(7, 9))
    metrics.on_step({"num_tokens": 2, "num_seqs": 2, "num_admitted": 0, "seconds": 0.5,
                     "shape": shape}, [])
    cost = model.cost(shape)
    sample = metrics.registry.get_sample_value
    assert sample("qwen_jax:model_flops_utilization_sum", {"model_name": "m"}) == \
        pytest.approx(cost.flops / 0.5 / 2e9)
    assert sample("qwen_jax:memory_bandwidth_utilization_sum", {"model_name": "m"}) == \
        pytest.approx(cost.bytes / 0.5 / 2e8)
    assert sample("qwen_jax:peak_flops_per_second", {"model_name": "m"}) == 2e9


async def test_vllm_names_on_request(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny", metrics_prefix="vllm").start()
    try:
        await complete(srv.url, {"prompt": "names", "max_tokens": 2})
        values = await scrape(srv.url)
    finally:
        srv.stop()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_success_total"):
        assert any(k.startswith(f"vllm:{name}") for k in values), name
        assert not any(k.startswith(f"qwen_jax:{name}") for k in values), name
    assert f"qwen_jax:num_compiles_total{LABEL}" in values  # no vLLM counterpart


def _fake_pynvml(fail_init: bool = False):
    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")
    return types.SimpleNamespace(
        nvmlInit=init, nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=h * 10**9,
                                                                total=141 * 10**9))


def test_nvml_gauges_per_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    nvml = load_nvml()
    families = {f.name: f for f in NvmlCollector(nvml, "m").collect()}
    util = {s.labels["gpu"]: s.value for s in families["qwen_jax:gpu_utilization_perc"].samples}
    assert util == {"0": 0.40, "1": 0.41}
    used = families["qwen_jax:gpu_memory_used_bytes"].samples
    assert [s.value for s in used] == [0.0, 1e9]


def test_without_a_driver_there_are_no_nvml_metrics(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert load_nvml() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert load_nvml() is None


def _dashboard_metrics() -> set[str]:
    text = json.dumps(json.loads(DASHBOARD.read_text()))
    names = re.findall(r"(?:\$\{?prefix\}?|qwen_jax):([a-z0-9_]+)", text)
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}


def _base_names(names) -> set[str]:
    return {re.sub(r"_(bucket|sum|count|total|created)$", "", n.split("{")[0].split(":")[1])
            for n in names}


async def test_every_metric_the_dashboard_queries_exists(server, monkeypatch):
    await complete(server.url, {"prompt": "dash", "max_tokens": 2})
    exported = _base_names(await scrape(server.url))
    # What a GPU adds: utilisation against its peak, and NVML's gauges.
    gpu = Metrics(_FakeLLM(), "m", cost_model=CostModel(server.llm.engine.model_config, 2, 2),
                  peak=DevicePeak("test", 1e9, 1e9, 1e9))
    gpu.on_step({"seconds": 0.1, "shape": StepShape(query_lens=(1,), context_lens=(1,))}, [])
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    gpu.registry.register(NvmlCollector(load_nvml(), "m"))
    exported |= _base_names(s.name for f in gpu.registry.collect() for s in f.samples)
    queried = _dashboard_metrics()
    assert len(queried) >= 20
    assert queried <= exported, queried - exported


def test_token_counts_and_itl_come_from_the_steps_not_the_outputs():
    """A step's own stats count every token, whatever its outputs held (a whole response
    gets only its final output; --stream-interval N one per N tokens): each gap from the
    token's own previous one, a prompt once per request; the tracker counts only finishes."""
    from serving.core.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
    metrics = Metrics(_FakeLLM(), "m")
    # step 1: two requests' first tokens (prompts of 5 and 7); step 2 at t=0.3: both again,
    # and a third request whose last token came at t=0.1
    metrics.on_step({"num_generated": 2, "num_prompt_tokens": 12, "token_time": 0.2,
                     "previous_token_times": {}}, [])
    metrics.on_step({"num_generated": 3, "num_prompt_tokens": 0, "token_time": 0.3,
                     "previous_token_times": {0.2: 2, 0.1: 1}}, [])
    tracker = metrics.tracker(SamplingParams(n=2, max_tokens=5))
    tracker.observe(RequestOutput("r", None, [1, 2], None, [
        CompletionOutput(0, "", [7] * 5, finish_reason="length"),
        CompletionOutput(1, "", [7] * 3, finish_reason="stop")], True,
        RequestMetrics(arrival_time=0.0)))
    values = parse_values(metrics.render().decode())
    label = '{model_name="m"}'
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert values[f"qwen_jax:{name}_count{label}"] == 3
        assert values[f"qwen_jax:{name}_sum{label}"] == pytest.approx(0.1 + 0.1 + 0.2)
    assert values[f"qwen_jax:generation_tokens_total{label}"] == 5
    assert values[f"qwen_jax:prompt_tokens_total{label}"] == 12
    assert values[f"qwen_jax:request_generation_tokens_sum{label}"] == 8
    assert values['qwen_jax:request_success_total{finished_reason="length",model_name="m"}'] == 1
    assert values['qwen_jax:request_success_total{finished_reason="stop",model_name="m"}'] == 1


def test_token_gaps_expose_what_a_prometheus_histogram_would():
    """The ITL / TPOT histogram is kept as plain counts (it is written per streamed output);
    its samples are prometheus_client's for the same observations, under both names."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from serving.metrics.prometheus import ITL_BUCKETS
    metrics = Metrics(_FakeLLM(), "m", prefix="vllm")
    reference = CollectorRegistry()
    histogram = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                          ["model_name"], buckets=ITL_BUCKETS, registry=reference)
    for gap in (0.0, 0.01, 0.0100001, 0.3, 0.31, 7.5, 100.0, 0.049):
        metrics.token_gaps.observe(gap)
        histogram.labels("m").observe(gap)
    metrics.token_gaps.observe(0.2, 3)
    for _ in range(3):
        histogram.labels("m").observe(0.2)

    def samples(text: str, name: str) -> dict:
        return {k: v for k, v in parse_values(text).items()
                if k.startswith(name) and not k.startswith(name + "_created")}
    expected = samples(generate_latest(reference).decode(), "vllm:inter_token_latency_seconds")
    text = metrics.render().decode()
    assert len(expected) == len(ITL_BUCKETS) + 3  # the buckets, +Inf, _count, _sum
    assert samples(text, "vllm:inter_token_latency_seconds") == pytest.approx(expected)
    assert samples(text, "vllm:time_per_output_token_seconds") == pytest.approx({
        k.replace("inter_token_latency", "time_per_output_token"): v for k, v in expected.items()})
