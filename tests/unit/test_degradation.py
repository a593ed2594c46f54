"""Self-protection on a fake clock: KV-pressure degradation with hysteresis, the admission
headroom and growth plan, each switch logged once."""

import logging

from serving.core.config import SchedulerConfig
from serving.core.degradation import KVPressure
from tests.helpers.fake_engine import FakeEngine

CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)


def feed(pressure, start, seconds, usage, every=1.0):
    t = start
    while t <= start + seconds + 1e-9:
        pressure.observe(t, usage)
        t += every
    return t


def test_degrades_only_after_usage_stays_high_for_the_whole_duration():
    p = KVPressure(CONFIG)
    t = feed(p, 0, 20, 0.95)
    p.observe(t, 0.5)  # a dip restarts the clock
    t = feed(p, t + 1, 29, 0.95)
    assert not p.degraded and p.max_num_batched_tokens == 64
    feed(p, t, 1, 0.95)
    assert p.degraded and p.num_switches == 1
    assert p.max_num_batched_tokens == 32 and p.watermark == 2 * CONFIG.watermark


def test_restores_with_hysteresis():
    p = KVPressure(CONFIG)
    t = feed(p, 0, 30, 0.95)
    assert p.degraded
    t = feed(p, t, 120, 0.85)  # below the degrade threshold, above the restore one
    assert p.degraded
    t = feed(p, t, 29, 0.7)
    assert p.degraded
    feed(p, t, 1, 0.7)
    assert not p.degraded and p.num_switches == 2 and p.max_num_batched_tokens == 64


def test_degraded_budget_never_drops_below_max_num_seqs():
    config = SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=64,
                             degraded_token_fraction=0.1, degrade_after=0)
    p = KVPressure(config)
    p.observe(0, 1.0)
    assert p.degraded and p.max_num_batched_tokens == 48


def test_infinite_duration_turns_degradation_off():
    p = KVPressure(SchedulerConfig(degrade_after=float("inf")))
    feed(p, 0, 10_000, 1.0, every=100)
    assert not p.degraded


def test_each_switch_is_logged_once(caplog):
    p = KVPressure(CONFIG)
    with caplog.at_level(logging.WARNING, logger="serving.core.degradation"):
        t = feed(p, 0, 100, 0.95)
        feed(p, t, 100, 0.1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "degraded, max_num_batched_tokens 64 -> 32" in lines[0]
    assert "restored max_num_batched_tokens 64" in lines[1]


def test_scheduler_lowers_its_token_budget_under_sustained_kv_pressure():
    # 16 usable pages of 4 tokens; a and b grow from 14 to all 16 of them.
    e = FakeEngine(num_pages=17, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                   degrade_after=1.0, step_seconds=1.0)
    e.add("a", 28, max_tokens=4)
    e.add("b", 28, max_tokens=4)
    e.step()
    e.add("c", 60, max_tokens=1)  # waits: no pages
    for _ in range(3):  # usage 0.875, then 1.0 for 1 s: degraded as a and b finish
        e.step()
    s = e.scheduler
    assert s.pressure.degraded and s.max_num_batched_tokens == 32
    assert chunks(e.step()) == [("c", 32)]  # restoring takes 30 s below 80%


def test_admission_keeps_the_headroom_and_plans_running_growth():
    # 25 usable pages; kv_plan_limit 0.92 -> at most 23 planned.
    e = FakeEngine(num_pages=26, max_num_batched_tokens=128, watermark=0.0,
                   kv_plan_limit=0.92, max_model_len=128)
    e.add("a", 40)  # 10 pages, the next token needs an 11th: 1 page of growth
    e.add("b", 48)  # 12 pages: 10 + 12 + 1 = 23 <= 23
    e.add("c", 4)  # 1 page: 10 + 12 + 1 + 1 + (growth of b: 1) > 23
    out = e.step()
    assert chunks(out) == [("a", 40), ("b", 48)]
    # Without the plan, c is admitted into the last free pages.
    free = FakeEngine(num_pages=26, max_num_batched_tokens=128, watermark=0.0,
                      kv_plan_limit=1.0, max_model_len=128)
    for rid, n in (("a", 40), ("b", 48), ("c", 4)):
        free.add(rid, n)
    assert [rid for rid, _ in chunks(free.step())] == ["a", "b", "c"]


def test_degraded_admission_headroom_doubles():
    config = dict(num_pages=21, max_num_batched_tokens=128, watermark=0.1,
                  kv_plan_limit=1.0, max_model_len=128, degraded_token_fraction=1.0)
    e = FakeEngine(**config)  # 20 pages, headroom 2 pages; degraded: 4
    e.scheduler.pressure.degraded = True
    e.add("a", 40)  # 10 pages
    e.add("b", 28)  # 7 pages: 3 left < 4
    assert chunks(e.step()) == [("a", 40)]
    normal = FakeEngine(**config)
    normal.add("a", 40)
    normal.add("b", 28)
    assert chunks(normal.step()) == [("a", 40), ("b", 28)]


def chunks(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
