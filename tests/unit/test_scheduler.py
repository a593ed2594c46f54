"""Token-budget continuous batching: budgets, ordering, chunking, preemption, abort."""

import pytest

from serving.core.config import SchedulerConfig
from serving.core.kv_cache_manager import KVCacheManager
from serving.core.request import Request, RequestStatus, SamplingParams
from serving.core.scheduler import QueueFullError, Scheduler

BS = 4


def make_scheduler(num_pages=64, policy="fcfs", watermark=0.0, caching=True, **kwargs):
    # No admission headroom and no growth plan: these tests overcommit tiny pools on purpose.
    kwargs.setdefault("kv_plan_limit", 1.0)
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 32)
    kwargs.setdefault("max_model_len", 64)
    config = SchedulerConfig(policy=policy, watermark=watermark, **kwargs)
    return Scheduler(config, KVCacheManager(num_pages, BS, enable_prefix_caching=caching))


def make_request(rid, num_prompt, *, first_token=0, priority=0, arrival=None, max_tokens=4):
    extra = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, list(range(first_token, first_token + num_prompt)),
                   SamplingParams(max_tokens=max_tokens), priority=priority, **extra)


def step(scheduler):
    """One engine step: schedule, 'run', append a token for each sampling entry."""
    out = scheduler.schedule()
    scheduler.update_after_step(out)
    for seq in out.scheduled:
        if seq.samples:
            seq.request.append_output_token(7)
    return out


def chunks(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_caps_each_step():
    s = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 10))
    out = step(s)
    assert out.num_batched_tokens == 16
    assert chunks(out) == [("r0", 10), ("r1", 6)]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3))
    out = step(s)
    assert len(out.scheduled) == 2 and s.num_running == 2 and s.num_waiting == 1


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_scheduler(max_num_batched_tokens=12)
    s.add_request(make_request("old", 10))
    step(s)
    s.add_request(make_request("new", 10, first_token=100))
    out = step(s)
    assert chunks(out) == [("old", 1), ("new", 10)]


def test_chunked_prefill_samples_only_on_the_last_chunk():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("long", 20))
    outs = [step(s) for _ in range(4)]
    assert [(o.scheduled[0].start, o.scheduled[0].num_new_tokens, o.scheduled[0].samples)
            for o in outs] == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    assert s.get_request("long").num_output_tokens == 2


def test_decode_and_prefill_chunk_share_a_step():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", 4))
    step(s)
    s.add_request(make_request("b", 20))
    out = step(s)
    assert chunks(out) == [("a", 1), ("b", 7)]
    assert [x.samples for x in out.scheduled] == [True, False]


def test_request_without_tokens_to_compute_is_not_scheduled():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    out = s.schedule()
    s.update_after_step(out)  # the engine has not appended a token yet
    assert s.schedule().scheduled == []


def test_watermark_blocks_admission_but_not_running_growth():
    # 10 usable pages, watermark 0.2 -> 2 pages must stay free at admission.
    s = make_scheduler(num_pages=11, watermark=0.2)
    s.add_request(make_request("a", 32))  # 8 pages -> leaves exactly 2
    s.add_request(make_request("b", 4))  # would leave 1
    out = step(s)
    assert chunks(out) == [("a", 32)] and s.num_waiting == 1
    for _ in range(2):  # running growth may eat into the watermark
        step(s)
    assert len(s.get_request("a").page_ids) == 9


def test_preemption_takes_newest_and_requeues_it_at_the_front():
    s = make_scheduler(num_pages=5, max_num_batched_tokens=64)  # 4 usable pages
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    step(s)
    s.add_request(make_request("c", 2))
    out = step(s)  # a needs a 3rd page: b (newest) is preempted
    assert out.preempted == ["b"] and chunks(out) == [("a", 1)]
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.page_ids == [] and b.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_preempted_request_resumes_with_outputs_recomputed():
    s = make_scheduler(num_pages=5, max_num_batched_tokens=64, caching=False)
    s.add_request(make_request("a", 8, max_tokens=1))
    s.add_request(make_request("b", 8, first_token=100))
    step(s)
    step(s)  # b preempted
    a = s.finish("a", RequestStatus.FINISHED_LENGTH_CAPPED)
    assert a.page_ids == []
    out = step(s)
    b = s.get_request("b")
    assert chunks(out) == [("b", 9)] and out.scheduled[0].start == 0
    assert out.scheduled[0].samples and b.num_output_tokens == 2


def test_request_that_is_its_own_victim_stops_the_step():
    s = make_scheduler(num_pages=3, max_num_batched_tokens=64, max_model_len=8)
    s.add_request(make_request("a", 8, max_tokens=1))  # 2 usable pages: exactly fits
    step(s)
    s.get_request("a").append_output_token(5)  # hypothetical 10th token needs a 3rd page
    out = s.schedule()
    assert out.preempted == ["a"] and out.scheduled == []


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    s = make_scheduler(num_pages=5, max_num_batched_tokens=64, policy="priority")
    s.add_request(make_request("low", 8, priority=5, arrival=1.0))
    s.add_request(make_request("high", 8, priority=0, arrival=2.0))
    out = step(s)
    assert chunks(out) == [("high", 8), ("low", 8)]
    out = step(s)  # both need a 3rd page: the low-priority one goes
    assert out.preempted == ["low"] and chunks(out) == [("high", 1)]


def test_priority_preemption_refunds_an_already_scheduled_victim():
    s = make_scheduler(num_pages=5, max_num_batched_tokens=64, policy="priority")
    s.add_request(make_request("low", 6, priority=5, arrival=1.0))
    step(s)
    s.add_request(make_request("high", 8, first_token=100, priority=0, arrival=2.0))
    step(s)  # all 4 pages now held
    out = step(s)  # low decodes in its last page, then high needs a page: low is unscheduled
    assert out.preempted == ["low"] and chunks(out) == [("high", 1)]
    assert out.num_batched_tokens == 1


def test_fcfs_waiting_order():
    s = make_scheduler(max_num_seqs=1)
    for rid in ("x", "y", "z"):
        s.add_request(make_request(rid, 2, max_tokens=1))
    seen = []
    while s.has_unfinished:
        out = step(s)
        seen += [seq.request.request_id for seq in out.scheduled]
        for seq in out.scheduled:
            s.finish(seq.request.request_id, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert seen == ["x", "y", "z"]


def test_abort_frees_pages_at_once_and_dequeues():
    s = make_scheduler(num_pages=11)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 4))
    step(s)
    s.add_request(make_request("w", 4))
    free_before = s.kv.num_free_pages
    aborted = s.abort("a")
    assert aborted.status == RequestStatus.FINISHED_ABORTED and aborted.page_ids == []
    assert s.kv.num_free_pages == free_before + 2 and s.num_running == 1
    assert s.abort("w").status == RequestStatus.FINISHED_ABORTED and s.num_waiting == 0
    assert s.abort("missing") is None


def test_abort_between_schedule_and_update_is_ignored():
    s = make_scheduler()
    s.add_request(make_request("a", 8))
    out = s.schedule()
    s.abort("a")
    s.update_after_step(out)
    assert s.kv.pool.num_cached_pages == 0 and not s.has_unfinished


def test_prefix_hit_sets_num_computed_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    step(s)
    s.add_request(make_request("b", 10))
    out = step(s)
    seq = [x for x in out.scheduled if x.request.request_id == "b"][0]
    assert (seq.start, seq.num_new_tokens) == (8, 2)
    assert seq.request.num_cached_tokens == 8 and seq.request.num_computed_tokens == 10


def test_no_page_leak_after_everything_finishes():
    s = make_scheduler(num_pages=9, max_num_batched_tokens=16, caching=True)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=6))
    for _ in range(200):
        if not s.has_unfinished:
            break
        step(s)
        for r in list(s.running):
            if s.is_length_capped(r):
                s.finish(r.request_id, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert not s.has_unfinished and s.num_preemptions > 0
    assert s.kv.num_free_pages == s.kv.num_total_pages


def test_add_request_rejects_prompt_over_max_model_len():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="prompt has 17 tokens, more than max_model_len=16"):
        s.add_request(make_request("a", 17))


def test_add_request_rejects_requests_larger_than_the_cache():
    s = make_scheduler(num_pages=3, max_model_len=64)
    with pytest.raises(ValueError, match="num_total_pages=2"):
        s.add_request(make_request("a", 8, max_tokens=8))


def test_add_request_rejects_duplicate_ids_and_full_queue():
    s = make_scheduler(max_waiting=1)
    s.add_request(make_request("a", 2))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 2))
    with pytest.raises(QueueFullError, match="max_waiting=1"):
        s.add_request(make_request("b", 2))


def test_finish_requires_a_finished_status():
    s = make_scheduler()
    s.add_request(make_request("a", 2))
    with pytest.raises(ValueError, match="finished status, got RUNNING"):
        s.finish("a", RequestStatus.RUNNING)


def test_watermark_is_waived_when_nothing_is_running():
    s = make_scheduler(num_pages=11, watermark=0.2, max_model_len=40, max_num_batched_tokens=64)
    s.add_request(make_request("big", 36, max_tokens=1))  # 9 of 10 pages
    out = step(s)
    assert chunks(out) == [("big", 36)]


def test_pipeline_depth_keeps_in_flight_requests_out_and_splits_the_live_ones():
    """With D batches in flight a request whose token is in the pipeline is not scheduled
    (not even from the device, as the overlapped loop does), and each batch takes
    ceil(live / D) requests, so D batches of 6 requests hold 2 each."""
    s = make_scheduler(max_num_batched_tokens=64)
    s.pipeline_depth = 3
    for i in range(6):
        s.add_request(make_request(f"r{i}", 3))
    batches = []
    for _ in range(3):  # three ticks, no token read back yet
        out = s.schedule()
        s.update_after_step(out)
        for seq in out.scheduled:
            seq.request.num_pending_tokens += 1  # its token is in flight
        batches.append(chunks(out))
    assert batches == [[("r0", 3), ("r1", 3)], [("r2", 3), ("r3", 3)], [("r4", 3), ("r5", 3)]]
    assert s.schedule().is_empty  # every request waits for its token
    for rid in ("r0", "r1"):  # the first batch leaves the pipeline
        request = s.get_request(rid)
        request.num_pending_tokens -= 1
        request.append_output_token(7)
    assert chunks(s.schedule()) == [("r0", 1), ("r1", 1)]
