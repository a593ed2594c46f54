"""Scheduling options on the command line (vLLM's names where vLLM has them) and the
self-protection / swap state in /metrics."""

import aiohttp
import pytest

from serving.cli.args import engine_kwargs
from serving.cli.main import build_parser
from serving.engine.config import engine_config_from_kwargs
from serving.engine.stats import spec_decode_stats
from serving.metrics.prometheus import Metrics
from tests.helpers.prometheus import parse_values


def test_serve_accepts_the_scheduling_options():
    args = build_parser().parse_args([
        "serve", "--scheduling-policy", "length-aware", "--length-buckets", "64,256",
        "--aging-interval", "2", "--short-preempt-wait", "inf", "--boost-wait", "0.5",
        "--long-prefill-token-threshold", "64", "--max-long-partial-prefills", "2",
        "--kv-plan-limit", "0.9", "--degrade-after", "10", "--restore-after", "5",
        "--degraded-token-fraction", "0.25", "--swap-space", "4", "--swap-min-tokens", "64",
        "--stream-interval", "4"])
    config = engine_config_from_kwargs(args.model, **engine_kwargs(args))
    s, c = config.scheduler, config.cache
    assert (s.policy, s.length_buckets, s.aging_interval) == ("length-aware", (64, 256), 2.0)
    assert s.short_preempt_wait == float("inf") and s.boost_wait == 0.5
    assert s.long_prefill_token_threshold == 64 and s.prefill_chunk_cap == 64
    assert s.max_long_partial_prefills == 2 and s.long_partial_prefill_limit == 2
    assert (s.kv_plan_limit, s.degrade_after, s.restore_after) == (0.9, 10.0, 5.0)
    assert s.degraded_token_fraction == 0.25 and s.watermark == 0.05
    assert (c.swap_space, c.swap_min_tokens) == (4.0, 64)
    assert s.stream_interval == 4


def test_bad_scheduling_option_names_field_value_and_limit():
    for kwargs, message in [
        (dict(length_buckets=[512, 128]), "length_buckets must be two increasing"),
        (dict(aging_interval=float("inf")), "aging_interval must be a finite number"),
        (dict(restore_kv_usage=0.95), "restore_kv_usage must be in [0, degrade_kv_usage=0.9]"),
        (dict(kv_plan_limit=1.5), "kv_plan_limit must be in (0, 1], got 1.5"),
        (dict(boost_wait=-1), "boost_wait must be >= 0 seconds (inf: never), got -1"),
        (dict(swap_min_tokens=-1), "swap_min_tokens must be >= 0, got -1"),
    ]:
        with pytest.raises(ValueError) as info:
            engine_config_from_kwargs(None, **kwargs)
        assert message in str(info.value)


class _Stats:
    def __init__(self, **overrides):
        self.values = {
            "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.95,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 3,
            "num_compiles": 1, "num_used_pages": 5, "num_total_pages": 9,
            "max_num_batched_tokens": 256, "degraded": 1,
            "num_degradation_switches": 1, "num_priority_boosts": 7, "num_swapped_requests": 2,
            "swap_space_usage": 0.25, "num_swap_outs": 3, "num_swap_ins": 1,
            "num_recomputed_tokens": 0, **spec_decode_stats(None), **overrides}

    def stats(self):
        return self.values


def test_metrics_show_degradation_boosts_and_swap():
    values = parse_values(Metrics(_Stats(), "m").render().decode())
    label = '{model_name="m"}'
    expected = {
        "scheduler_max_num_batched_tokens": 256, "scheduler_degraded": 1,
        "scheduler_degradation_switches_total": 1, "scheduler_priority_boosts_total": 7,
        "num_requests_swapped": 2, "cpu_cache_usage_perc": 0.25, "num_swap_outs_total": 3,
        "num_swap_ins_total": 1, "num_recomputed_tokens_total": 0}
    assert {k: values[f"qwen_jax:{k}{label}"] for k in expected} == expected


async def test_server_metrics_report_the_effective_budget(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            values = parse_values(await r.text())
    label = '{model_name="tiny"}'
    assert values[f"qwen_jax:scheduler_max_num_batched_tokens{label}"] == 64
    assert values[f"qwen_jax:scheduler_degraded{label}"] == 0
    assert values[f"qwen_jax:num_requests_swapped{label}"] == 0
