"""The prefill cap (`long_prefill_token_threshold`, `max_long_partial_prefills`: vLLM's
names) on a fake clock: defaults per policy, chunk sizes, one long prompt prefilling at a
time while short ones pass it, trimming to token buckets, identical outputs; and
preemption for a short request short of pages once it waited past `short_preempt_wait`."""

import pytest

from serving.core.config import SchedulerConfig
from tests.helpers.fake_engine import FakeEngine

LA = "length-aware"


def chunks(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def prefill_chunks(policy, num_prompt=40, **config):
    """The chunk sizes a lone prompt is prefilled in (a 32-token budget)."""
    e = FakeEngine(policy=policy, length_buckets=(8, 24), max_num_batched_tokens=32, **config)
    e.add("long", num_prompt, max_tokens=1)
    sizes = []
    while e.scheduler.has_unfinished:
        sizes += [n for _, n in chunks(e.step())]
    return sizes


@pytest.mark.parametrize("policy, threshold, cap", [
    (LA, None, 128), ("fcfs", None, None), ("priority", None, None),
    (LA, 0, None), ("fcfs", 64, 64), (LA, 300, 300),
])
def test_prefill_cap_defaults_to_the_short_bound_under_length_aware_only(
        policy, threshold, cap):
    config = SchedulerConfig(policy=policy, long_prefill_token_threshold=threshold)
    assert config.prefill_chunk_cap == cap


@pytest.mark.parametrize("policy, threshold, max_long, limit", [
    (LA, None, None, 1), (LA, None, 3, 3), (LA, 0, None, None), ("fcfs", None, None, None),
    ("fcfs", 64, None, None), ("priority", 64, 2, 2), ("fcfs", None, 2, None),
])
def test_long_partial_prefill_limit_is_one_under_length_aware_and_needs_a_cap(
        policy, threshold, max_long, limit):
    config = SchedulerConfig(policy=policy, long_prefill_token_threshold=threshold,
                             max_long_partial_prefills=max_long)
    assert config.long_partial_prefill_limit == limit


@pytest.mark.parametrize("field, value, message", [
    ("long_prefill_token_threshold", -1,
     r"long_prefill_token_threshold must be >= 0 tokens \(0: no cap\) or None, got -1"),
    ("max_long_partial_prefills", 0, r"max_long_partial_prefills must be >= 1 or None, got 0"),
])
def test_bad_cap_options_are_refused_with_field_value_and_limit(field, value, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: value})


def test_length_aware_prefills_a_long_prompt_in_chunks_of_the_short_bound():
    assert prefill_chunks(LA) == [8, 8, 8, 8, 8]
    assert prefill_chunks(LA, long_prefill_token_threshold=0) == [32, 8]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_fcfs_and_priority_chunks_fill_the_budget_unless_a_threshold_is_set(policy):
    assert prefill_chunks(policy) == [32, 8]
    assert prefill_chunks(policy, long_prefill_token_threshold=12) == [12, 12, 12, 4]


def test_a_short_request_arriving_mid_prefill_shares_its_step_with_a_capped_chunk():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32)
    e.add("long", 60)
    assert chunks(e.step()) == [("long", 8)]
    e.add("short", 5)
    assert chunks(e.step()) == [("short", 5), ("long", 8)]
    # Without the cap the long chunk takes whatever the short one leaves.
    u = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32,
                   long_prefill_token_threshold=0)
    u.add("long", 60)
    assert chunks(u.step()) == [("long", 32)]
    u.add("short", 5)
    assert chunks(u.step()) == [("short", 5), ("long", 27)]


def two_long_prompts(**config):
    """Per step, the chunks of two 40-token prompts sent together (a 32-token budget)."""
    e = FakeEngine(length_buckets=(8, 24), max_num_batched_tokens=32, **config)
    e.add("a", 40, max_tokens=1)
    e.add("b", 40, max_tokens=1)
    steps = []
    while e.scheduler.has_unfinished:
        steps.append(chunks(e.step()))
    return steps


def test_length_aware_prefills_one_long_prompt_at_a_time():
    # b starts beside a's last chunk (8 tokens left: no longer a long prefill).
    assert two_long_prompts(policy=LA) == [
        [("a", 8)], [("a", 8)], [("a", 8)], [("a", 8)], [("a", 8), ("b", 8)],
        [("b", 8)], [("b", 8)], [("b", 8)], [("b", 8)]]


@pytest.mark.parametrize("config", [
    dict(policy=LA, max_long_partial_prefills=2),
    dict(policy="fcfs", long_prefill_token_threshold=8),
])
def test_more_long_partial_prefills_share_a_step_when_allowed(config):
    assert two_long_prompts(**config) == [[("a", 8), ("b", 8)]] * 5


def test_short_requests_are_admitted_while_a_long_prompt_waits_for_the_prefill_slot():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32,
                   token_buckets=(32,))  # one bucket: nothing to trim chunks to
    e.add("a", 40)
    e.add("b", 40)
    assert chunks(e.step()) == [("a", 8)]
    e.add("s1", 5)
    e.add("s2", 6)
    assert chunks(e.step()) == [("s1", 5), ("s2", 6), ("a", 8)]
    assert [r.request_id for r in e.scheduler.waiting] == ["b"]


def test_a_long_prompt_waiting_for_the_slot_does_not_hold_back_later_short_ones():
    # b has aged past any newcomer, yet while a holds the slot a new short one goes first.
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32,
                   aging_interval=0.1)
    e.add("a", 60)
    e.add("b", 40)
    e.step()
    e.clock.advance(1.0)
    e.add("short", 5)
    assert [r.request_id for r in e.scheduler.waiting] == ["b", "short"]
    assert chunks(e.step()) == [("a", 8), ("short", 5)]
    assert [r.request_id for r in e.scheduler.waiting] == ["b"]


def decodes_and_a_capped_chunk(num_decoding, policy=LA):
    """The step after `num_decoding` short requests start decoding and a long one arrives
    (token buckets 4, 8, 16, 32; the cap is 8 under length-aware)."""
    e = FakeEngine(policy=policy, length_buckets=(8, 24), max_num_batched_tokens=32,
                   token_buckets=(4, 8, 16, 32))
    for i in range(num_decoding):
        e.add(f"s{i}", 2, max_tokens=5)
    e.step()
    e.add("long", 40)
    return chunks(e.step())


def test_a_capped_chunk_is_trimmed_so_the_step_pads_to_the_bucket_below():
    # 3 decodes + 8 = 11 tokens would pad to 16; 3 past the 8 bucket, 5 of padding.
    assert decodes_and_a_capped_chunk(3) == [("s0", 1), ("s1", 1), ("s2", 1), ("long", 5)]


def test_a_capped_chunk_is_kept_when_it_puts_more_past_the_bucket_than_it_pads():
    # 7 decodes + 8 = 15 tokens: 7 past the 8 bucket, 1 of padding.
    assert decodes_and_a_capped_chunk(7)[-1] == ("long", 8)


def test_uncapped_chunks_are_never_trimmed():
    assert decodes_and_a_capped_chunk(3, policy="fcfs")[-1] == ("long", 29)


def test_decode_tokens_and_prompts_within_the_cap_are_not_split():
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32)
    e.add("a", 7, max_tokens=3)
    e.add("b", 7, max_tokens=3)
    assert chunks(e.step()) == [("a", 7), ("b", 7)]
    assert chunks(e.step()) == [("a", 1), ("b", 1)]


def _mixed_outputs(threshold):
    e = FakeEngine(policy=LA, length_buckets=(8, 24), max_num_batched_tokens=32,
                   long_prefill_token_threshold=threshold)
    e.add("long", 50, max_tokens=5, first_token=3)
    e.step()
    e.add("medium", 12, max_tokens=5, first_token=9)
    e.add("short", 5, max_tokens=5, first_token=20)
    e.run()
    return e.outputs


def test_capped_chunks_give_the_same_outputs_as_uncapped_ones():
    assert _mixed_outputs(threshold=5) == _mixed_outputs(threshold=0)
    assert len(_mixed_outputs(threshold=5)) == 3


def _long_holding_the_pages(short_preempt_wait):
    """A long request holds most of a small pool; a short one arrives and cannot get
    pages (seats are free), the clock moving 0.1 s a step."""
    e = FakeEngine(policy=LA, length_buckets=(8, 24), num_pages=13, max_num_seqs=4,
                   step_seconds=0.1, short_preempt_wait=short_preempt_wait,
                   boost_wait=float("inf"))
    e.add("long", 40, max_tokens=8)  # grows to all 12 usable pages (47 tokens of KV)
    for _ in range(6):  # 5 prefill chunks of 8, a decode: 41 tokens in 11 pages
        e.step()
    e.add("short", 6, max_tokens=3)  # needs 2 pages; 1 is free
    return e


def test_a_short_request_short_of_pages_preempts_the_long_one_once_past_its_wait():
    e = _long_holding_the_pages(short_preempt_wait=0.25)
    waits = []
    while "short" not in e.admitted:
        waits.append(round(e.clock.now - e.scheduler.get_request("short").arrival_time, 2))
        e.step()
    assert e.scheduler.num_preemptions == 1
    assert waits[-1] > 0.25 and all(w <= 0.25 for w in waits[:-1])
    e.run()
    assert set(e.outputs) == {"long", "short"}


def test_a_short_request_short_of_pages_never_preempts_with_an_infinite_wait():
    e = _long_holding_the_pages(short_preempt_wait=float("inf"))
    e.run()
    assert e.scheduler.num_preemptions == 0
    assert e.admitted == ["long", "short"]
