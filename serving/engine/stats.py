"""The counters `LLMEngine.stats()` reports (and `/metrics` exports): KV pages, prefix
cache, compiles, the overlapped loop, speculative decoding, pipeline ticks; scheduling,
self-protection and swap."""

from __future__ import annotations

from serving.core.scheduler import Scheduler


def kv_stats(engine) -> dict:
    """`engine`: serving/engine.LLMEngine (not imported: it imports this module)."""
    kv, scheduler = engine.kv_manager, engine.scheduler
    return {
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "num_free_pages": kv.num_free_pages,
        "num_total_pages": kv.num_total_pages,
        "num_used_pages": kv.num_total_pages - kv.num_free_pages,
        "kv_cache_usage": kv.usage,
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
        "prefix_cache_queries": kv.pool.num_queried_tokens,
        "prefix_cache_hits": kv.pool.num_hit_tokens,
        "num_overlapped_steps": engine.num_overlapped_steps,
        "num_compiles": engine.runner.num_compiles + sum(
            part.num_compiles for part in (engine.swap_store, _draft_runner(engine))
            if part is not None),
        "bytes_per_page": engine.bytes_per_page,
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        **spec_decode_stats(engine.speculator),
        **pipeline_stats(engine.pipeline),
    }


def pipeline_stats(pipeline) -> dict:
    """Pipeline stages' ticks and bubble (serving/engine/pipeline.py); none without."""
    if pipeline is None:
        return {}
    stats = pipeline.stats
    return {"pipeline_ticks": stats.num_ticks, "pipeline_idle_slots": stats.num_idle_slots,
            "pipeline_idle_stage_ticks": stats.num_idle_stage_ticks,
            "pipeline_bubble_fraction": stats.bubble_fraction}


def _draft_runner(engine):
    speculator = engine.speculator
    draft = None if speculator is None else speculator.draft
    return None if draft is None else draft.runner


def spec_decode_stats(speculator) -> dict:
    """vLLM's spec-decode counters (zero without speculation); `speculator`:
    serving/engine/speculation.Speculator or None."""
    if speculator is None:
        return {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                "spec_decode_num_accepted_tokens": 0,
                "spec_decode_num_accepted_tokens_per_pos": [],
                "spec_decode_mean_acceptance_length": 0.0}
    return {"spec_decode_num_drafts": speculator.num_drafts,
            "spec_decode_num_draft_tokens": speculator.num_draft_tokens,
            "spec_decode_num_accepted_tokens": speculator.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(speculator.accepted_per_position),
            "spec_decode_mean_acceptance_length": speculator.mean_acceptance_length}


def scheduling_stats(s: Scheduler) -> dict:
    s.observe_pressure()  # an idle engine runs no step: its budget is restored here
    return {
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "degraded": int(s.pressure.degraded),
        "num_degradation_switches": s.pressure.num_switches,
        "num_priority_boosts": s.boost.num_boosts,
        "num_swap_outs": s.swap.num_swap_outs,
        "num_swap_ins": s.swap.num_swap_ins,
        "num_swapped_requests": s.swap.num_swapped,
        "num_host_pages": s.swap.num_host_pages,
        "num_used_host_pages": s.swap.num_host_pages - s.swap.num_free_host_pages,
        "swap_space_usage": s.swap.usage,
        "num_recomputed_tokens": s.num_recomputed_tokens,
    }
