"""Length-aware scheduling with aging, on a fake clock: buckets, weights, the aging bound,
budget yielding, preempting a running long request for short ones, priority boosts."""

import numpy as np
import pytest

from serving.core.policies import LONG, MEDIUM, SHORT, length_class
from tests.helpers.fake_engine import FakeEngine

LA = "length-aware"


def order(engine):
    return [r.request_id for r in engine.scheduler.waiting]


def chunks(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


@pytest.mark.parametrize("num, bounds, bucket", [
    (1, (128, 512), SHORT), (127, (128, 512), SHORT), (128, (128, 512), MEDIUM),
    (511, (128, 512), MEDIUM), (512, (128, 512), LONG), (5000, (128, 512), LONG),
    (9, (10, 20), SHORT), (10, (10, 20), MEDIUM), (20, (10, 20), LONG),
])
def test_length_class_boundaries(num, bounds, bucket):
    assert length_class(num, bounds) == bucket


def test_shorter_prompts_rank_first_at_equal_wait():
    e = FakeEngine(policy=LA, length_buckets=(8, 32), max_num_seqs=1)
    e.add("long", 40)
    e.clock.advance(0.01)
    e.add("medium", 10)
    e.clock.advance(0.01)
    e.add("short", 4)
    assert order(e) == ["short", "medium", "long"]
    fcfs = FakeEngine(max_num_seqs=1)
    for rid, n in (("long", 40), ("medium", 10), ("short", 4)):
        fcfs.add(rid, n)
    assert order(fcfs) == ["long", "medium", "short"]


def test_a_request_gains_one_bucket_per_aging_interval():
    e = FakeEngine(policy=LA, length_buckets=(8, 32), aging_interval=1.0, boost_wait=float("inf"))
    e.add("long", 40)
    e.clock.advance(1.5)  # 1.5 levels: above a new medium (1 level), below a new short (2)
    e.add("medium", 10)
    e.add("short", 4)
    assert order(e) == ["short", "long", "medium"]
    e.clock.advance(0.6)  # long has now waited 2.1 intervals: above any newcomer
    e.add("short2", 4)
    assert order(e) == ["short", "long", "short2", "medium"]


def _admission_violations(engine, arrivals, slack):
    """Pairs (a, b) with b admitted before a although b arrived more than `slack` later."""
    admitted = engine.admitted
    return [(a, b) for i, a in enumerate(admitted) for b in admitted[:i]
            if arrivals[b][0] > arrivals[a][0] + slack]


def _random_arrivals(seed, **config):
    """Bursts and lulls of 3-, 12- and 30-token prompts (buckets 8, 24); the engine, run to
    the end, and each request's (arrival time, prompt length)."""
    rng = np.random.default_rng(seed)
    e = FakeEngine(policy=LA, length_buckets=(8, 24), aging_interval=0.2, max_num_seqs=2,
                   max_num_batched_tokens=16, step_seconds=0.05, **config)
    arrivals = {}
    for i in range(120):
        for _ in range(rng.poisson(1.5 if (i // 20) % 2 else 0.2)):
            rid = f"r{len(arrivals)}"
            num_prompt = int(rng.choice([3, 12, 30]))
            e.add(rid, num_prompt, max_tokens=int(rng.integers(1, 4)))
            arrivals[rid] = (e.clock.now, num_prompt)
        e.step()
    e.run()
    assert len(e.admitted) == len(arrivals)
    return e, arrivals


@pytest.mark.parametrize("seed", range(4))
def test_aging_bound_holds_under_random_arrivals(seed):
    # Nobody may be admitted behind a request that arrived more than 2 aging intervals
    # later (bucket gap x interval). No prefill cap: the queue's order alone.
    e, arrivals = _random_arrivals(seed, long_prefill_token_threshold=0)
    assert _admission_violations(e, arrivals, slack=2 * 0.2 + 1e-9) == []


@pytest.mark.parametrize("seed", range(4))
def test_aging_bound_holds_but_for_prompts_waiting_for_the_long_prefill_slot(seed):
    # The default cap (8 tokens, one long prefill at a time): a prompt of more than 8
    # tokens waiting for the slot may be passed by ones of at most 8, and only so.
    e, arrivals = _random_arrivals(seed)
    violations = _admission_violations(e, arrivals, slack=2 * 0.2 + 1e-9)
    assert violations  # the slot is what lets short prompts by
    assert all(arrivals[a][1] > 8 >= arrivals[b][1] for a, b in violations)


def _starve_long(aging_interval):
    """One long request, then a short one arriving every step for 300 steps."""
    e = FakeEngine(policy=LA, length_buckets=(8, 24), aging_interval=aging_interval,
                   max_num_seqs=1, boost_wait=float("inf"), step_seconds=0.05)
    e.add("short-first", 3, max_tokens=2)
    e.add("long", 30, max_tokens=1)
    for i in range(300):
        e.add(f"s{i}", 3, max_tokens=2)
        e.step()
    return e


def test_sustained_short_traffic_cannot_starve_a_long_request():
    e = _starve_long(aging_interval=0.5)
    assert "long" in e.admitted
    # Admitted behind at most the shorts that arrived within 2 intervals of it.
    assert e.admitted.index("long") <= 2 + int(2 * 0.5 / 0.05)
    # Without aging in the time frame (an interval of 1000 s), it starves: the bound is
    # what aging buys.
    assert "long" not in _starve_long(aging_interval=1000.0).admitted


def test_running_prefill_yields_its_budget_to_a_short_request():
    # No prefill cap, so the chunks show what the budget alone gives.
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=16,
                   long_prefill_token_threshold=0)
    e.add("long", 40)
    assert chunks(e.step()) == [("long", 16)]
    e.add("short", 5)
    assert chunks(e.step()) == [("short", 5), ("long", 11)]
    # FCFS keeps running requests first.
    f = FakeEngine(max_num_batched_tokens=16)
    f.add("long", 40)
    f.step()
    f.add("short", 5)
    assert chunks(f.step()) == [("long", 16)]


def test_a_yielding_prefill_goes_before_waiting_requests_that_rank_below_it():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32,
                   aging_interval=1.0, long_prefill_token_threshold=0)
    e.add("long", 60)
    assert chunks(e.step()) == [("long", 32)]
    e.clock.advance(0.5)
    e.add("short", 5)  # key t + 0.5: above the long one (t + 2)
    e.clock.advance(2.0)
    e.add("medium", 10)  # key t + 3.5: below it
    assert chunks(e.step()) == [("short", 5), ("long", 27)]
    assert [r.request_id for r in e.scheduler.waiting] == ["medium"]


def test_a_long_request_that_aged_past_a_short_one_keeps_its_budget():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), aging_interval=0.1,
                   max_num_batched_tokens=16, long_prefill_token_threshold=0)
    e.add("long", 40)
    e.step()
    e.clock.advance(1.0)  # the long request's key is now older than any newcomer's
    e.add("short", 5)
    assert chunks(e.step()) == [("long", 16)]


def _long_then_short(num_host_pages, short_preempt_wait=0.1):
    """A long request decoding in the only seat when a short one arrives."""
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_seqs=1, step_seconds=0.05,
                   num_host_pages=num_host_pages, short_preempt_wait=short_preempt_wait)
    e.add("long", 30, max_tokens=12)
    for _ in range(3):
        e.step()
    e.add("short", 4, max_tokens=3)
    e.run()
    return e


@pytest.mark.parametrize("num_host_pages", [0, 64])
def test_long_request_is_preempted_for_a_waiting_short_one_and_resumes_identically(
        num_host_pages):
    e = _long_then_short(num_host_pages)
    s = e.scheduler
    assert s.get_request("long") is None and s.num_preemptions == 1
    assert e.admitted == ["long", "short"]
    swapped = num_host_pages > 0
    assert s.swap.num_swap_outs == s.swap.num_swap_ins == int(swapped)
    assert (s.num_recomputed_tokens > 0) == (not swapped)
    # The same requests with no preemption: identical outputs, no page left behind.
    alone = _long_then_short(num_host_pages, short_preempt_wait=float("inf"))
    assert alone.scheduler.num_preemptions == 0
    assert e.outputs == alone.outputs
    assert s.kv.num_free_pages == s.kv.num_total_pages
    assert s.swap.num_free_host_pages == num_host_pages


def test_short_request_does_not_preempt_before_its_wait_threshold():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_seqs=1, short_preempt_wait=1.0,
                   step_seconds=0.25)
    e.add("long", 30, max_tokens=30)
    e.step()
    e.add("short", 4)
    for _ in range(5):  # waits of 0, 0.25, ..., 1.0 s: not past the threshold
        e.step()
        assert e.scheduler.num_preemptions == 0
    e.step()
    assert e.scheduler.num_preemptions == 1 and "short" in e.admitted


def test_short_request_never_preempts_a_long_one_that_aged_past_it():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_seqs=1, aging_interval=0.1,
                   short_preempt_wait=0.0, boost_wait=float("inf"))
    e.add("long", 30, max_tokens=30)
    e.step()
    e.clock.advance(0.5)  # long's key: arrival + 0.2 < the short's arrival
    e.add("short", 4)
    for _ in range(5):
        e.step()
    assert e.scheduler.num_preemptions == 0 and e.admitted == ["long"]


def test_queue_wait_boosts_priority_by_one_level():
    e = FakeEngine(policy="priority", max_num_seqs=1, boost_wait=0.2)
    e.add("busy", 4, max_tokens=50)
    e.step()
    e.add("p1", 4, priority=1)
    e.clock.advance(0.3)
    e.add("p0-late", 4, priority=0)
    e.add("p2", 4, priority=2)
    assert order(e) == ["p0-late", "p1", "p2"]
    e.step()  # p1 waited 0.3 s > 0.2 s: one level up, level with p0 and earlier
    assert order(e) == ["p1", "p0-late", "p2"]
    assert e.scheduler.boost.num_boosts == 1 and e.scheduler.boost.active


def test_boost_lifts_a_long_request_one_bucket():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), aging_interval=1.0, max_num_seqs=1,
                   boost_wait=0.2)
    e.add("busy", 4, max_tokens=50)
    e.step()
    e.add("long", 30)
    e.clock.advance(0.3)
    e.add("medium", 10)  # long key: t + 2; medium: t + 0.3 + 1
    assert order(e) == ["medium", "long"]
    e.step()  # long boosted: t + 1 < t + 1.3
    assert order(e) == ["long", "medium"]


def test_fcfs_boosts_nothing():
    e = FakeEngine(max_num_seqs=1, boost_wait=0.0)
    e.add("a", 4, max_tokens=20)
    e.add("b", 4)
    for _ in range(5):
        e.step()
    assert e.scheduler.boost.num_boosts == 0
