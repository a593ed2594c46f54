"""KV swap bookkeeping: host pages handed out and back with no leak and no double free;
preempted requests swapped out and in (or recomputed when host space is short), with the
same outputs as a run that never preempts."""

import pytest

from serving.core.request import RequestStatus
from serving.core.swap import SwapManager
from tests.helpers.fake_engine import FakeEngine


def test_swap_out_and_in_pairs_pages_and_returns_them():
    m = SwapManager(num_host_pages=4)
    pairs = m.swap_out("a", [7, 3, 9], num_computed_tokens=10)
    assert pairs == [(7, 0), (3, 1), (9, 2)]
    assert m.num_free_host_pages == 1 and m.is_swapped("a") and m.num_saved_tokens("a") == 10
    assert m.swap_in("a", [5, 6, 8]) == [(0, 5), (1, 6), (2, 8)]
    assert m.num_free_host_pages == 4 and not m.is_swapped("a")
    assert (m.num_swap_outs, m.num_swap_ins, m.num_pages_swapped_out) == (1, 1, 3)


def test_swap_rejects_double_swap_short_space_and_wrong_page_counts():
    m = SwapManager(num_host_pages=2)
    m.swap_out("a", [1], 4)
    with pytest.raises(ValueError, match="already swapped out"):
        m.swap_out("a", [2], 4)
    with pytest.raises(ValueError, match="only 1 host pages free"):
        m.swap_out("b", [2, 3], 8)
    with pytest.raises(ValueError, match="holds 1 host pages, got 2"):
        m.swap_in("a", [4, 5])
    assert m.is_swapped("a") and m.num_free_host_pages == 1


def test_double_free_of_a_host_page_is_an_error():
    m = SwapManager(num_host_pages=2)
    m.swap_out("a", [1], 4)
    m._swapped["b"] = m._swapped["a"]  # two owners of one host page: a bookkeeping bug
    m.swap_in("a", [3])
    with pytest.raises(ValueError, match="double free of host page 0"):
        m.swap_in("b", [4])


def test_should_swap_needs_room_and_enough_computed_tokens():
    m = SwapManager(num_host_pages=4, min_tokens=16)
    assert m.should_swap(16, 4) and not m.should_swap(15, 1) and not m.should_swap(32, 5)
    assert not m.should_swap(0, 0)
    assert not SwapManager(0).should_swap(100, 1)


def test_drop_releases_host_pages_once():
    m = SwapManager(num_host_pages=3)
    m.swap_out("a", [1, 2], 8)
    m.drop("a")
    m.drop("a")
    assert m.num_free_host_pages == 3 and m.take_released() == [0, 1] and m.take_released() == []


LENGTHS = [(14, 9), (30, 6), (7, 12), (22, 8), (5, 10), (19, 7), (11, 11)]


def _run(num_pages, num_host_pages, swap_min_tokens=0, policy="fcfs"):
    e = FakeEngine(num_pages=num_pages, num_host_pages=num_host_pages,
                   swap_min_tokens=swap_min_tokens, policy=policy, max_num_batched_tokens=24)
    for i, (n, max_tokens) in enumerate(LENGTHS):
        e.add(f"r{i}", n, max_tokens=max_tokens, first_token=3 * i)
    e.run()
    s = e.scheduler
    assert s.kv.num_free_pages == s.kv.num_total_pages  # no device page leaked
    assert s.swap.num_free_host_pages == num_host_pages  # nor any host page
    assert not e.host  # every host copy went back or was forgotten
    return e


@pytest.fixture(scope="module")
def unpreempted():
    e = _run(num_pages=200, num_host_pages=0)
    assert e.scheduler.num_preemptions == 0
    return e.outputs


@pytest.mark.parametrize("policy", ["fcfs", "priority", "length-aware"])
def test_swapped_requests_resume_with_identical_outputs(unpreempted, policy):
    e = _run(num_pages=12, num_host_pages=64, policy=policy)
    s = e.scheduler
    assert s.num_preemptions > 0 and s.swap.num_swap_outs == s.num_preemptions
    assert s.swap.num_swap_ins == s.swap.num_swap_outs and s.num_recomputed_tokens == 0
    assert e.outputs == unpreempted


def test_full_host_space_falls_back_to_recompute(unpreempted):
    e = _run(num_pages=12, num_host_pages=3)
    s = e.scheduler
    assert s.swap.num_swap_outs > 0 and s.num_recomputed_tokens > 0
    assert s.swap.num_swap_outs < s.num_preemptions
    assert e.outputs == unpreempted


def test_short_contexts_are_recomputed_below_swap_min_tokens(unpreempted):
    e = _run(num_pages=12, num_host_pages=64, swap_min_tokens=10_000)
    assert e.scheduler.swap.num_swap_outs == 0 and e.scheduler.num_recomputed_tokens > 0
    assert e.outputs == unpreempted


def test_abort_while_swapped_out_frees_the_host_pages():
    e = FakeEngine(num_pages=5, num_host_pages=8, max_num_batched_tokens=64)
    e.add("a", 8)
    e.add("b", 8)
    e.step()
    out = e.step()  # a needs a third page: b is swapped out
    assert out.preempted == ["b"] and [h for _, h in out.swap_out] == [0, 1]
    e.scheduler.abort("b")
    assert e.scheduler.swap.num_free_host_pages == 8
    assert e.step().host_pages_freed == [0, 1] and not e.host
    b = e.scheduler.get_request("b")
    assert b is None and e.scheduler.finish("a", RequestStatus.FINISHED_ABORTED) is not None
