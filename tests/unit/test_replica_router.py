"""The data-parallel router (serving/core/replica_router.py) and the DP client's pure parts
(device slices per replica, stats summed across replicas)."""

from __future__ import annotations

import pytest

from serving.core.lora_request import LoRARequest
from serving.core.page_pool import lora_seed, prompt_page_hashes
from serving.core.replica_router import ReplicaLoad, ReplicaRouter
from serving.engine.data_parallel import merge_stats, visible_devices


def idle(n: int, **kw) -> list[ReplicaLoad]:
    return [ReplicaLoad(True, kw.get("loads", [0] * n)[i], 0.0) for i in range(n)]


def test_page_hashes_are_the_prefix_caches_chain_and_differ_per_adapter():
    ids = list(range(40))
    hashes = prompt_page_hashes(ids, 16)
    assert len(hashes) == 2  # full pages only
    assert prompt_page_hashes(ids[:32] + [99] * 8, 16) == hashes  # a later page: same chain
    assert prompt_page_hashes([7] + ids[1:], 16)[1] != hashes[1]  # chained: page 1 differs
    lora = LoRARequest("sql", 1, "/a")
    assert prompt_page_hashes(ids, 16, lora_seed(lora))[0] != hashes[0]


def test_a_prefix_group_stays_on_the_replica_that_first_took_it():
    router = ReplicaRouter(2)
    a = prompt_page_hashes([1] * 48, 16)
    b = prompt_page_hashes([2] * 48, 16)
    picks = [router.choose(h, idle(2)) for h in (a, b, a, b, a, b)]
    assert picks == [0, 1, 0, 1, 0, 1]
    assert router.num_affine == 4
    # a longer match wins over a shorter one
    router.record(1, a[:1])
    assert router.choose(a, idle(2)) == 0


def test_a_hot_prefix_cannot_pin_a_busy_replica():
    router = ReplicaRouter(2, balance_abs=4, balance_rel=0.5)
    hot = prompt_page_hashes([3] * 64, 16)
    assert router.choose(hot, idle(2)) == 0
    # replica 0 is 4 busier: within the slack, affinity wins
    assert router.choose(hot, idle(2, loads=[4, 0])) == 0
    # 5 busier: the least loaded takes it (and now holds the prefix too)
    assert router.choose(hot, idle(2, loads=[5, 0])) == 1
    # with both loaded, the slack is half the least load: 30 vs 20 stays, 31 vs 20 moves
    router.forget(1)
    assert router.choose(hot, idle(2, loads=[30, 20])) == 0
    assert router.choose(hot, idle(2, loads=[31, 20])) == 1
    # a nearly full KV cache also sends it elsewhere
    full = [ReplicaLoad(True, 0, 0.99), ReplicaLoad(True, 0, 0.1)]
    assert router.choose(hot, full) == 1


def test_replicas_that_do_not_serve_are_never_chosen():
    router = ReplicaRouter(3)
    a = prompt_page_hashes([5] * 32, 16)
    router.record(1, a)
    loads = [ReplicaLoad(True, 3, 0.0), ReplicaLoad(False, 0, 0.0), ReplicaLoad(True, 0, 0.0)]
    assert router.choose(a, loads) == 2
    with pytest.raises(ValueError, match="no data-parallel replica is serving"):
        router.choose(a, [ReplicaLoad(False, 0, 0.0)] * 3)


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = ReplicaRouter(2, "round_robin")
    a = prompt_page_hashes([1] * 32, 16)
    assert [rr.choose(a, idle(2)) for _ in range(4)] == [0, 1, 0, 1]
    ll = ReplicaRouter(2, "least_loaded")
    assert ll.choose(a, idle(2, loads=[0, 0])) == 0
    assert ll.choose(a, idle(2, loads=[2, 1])) == 1
    with pytest.raises(ValueError, match="data_parallel_routing must be one of"):
        ReplicaRouter(2, "random")


def test_the_record_keeps_the_most_recent_pages_within_the_cache_size():
    router = ReplicaRouter(1, capacity_pages=3)
    old, new = prompt_page_hashes([1] * 32, 16), prompt_page_hashes([2] * 32, 16)
    router.record(0, old)
    router.record(0, new)
    assert router.matched_pages(0, new) == 2 and router.matched_pages(0, old) == 0
    assert len(router.records[0]) == 3


def test_each_replica_sees_its_own_slice_of_the_devices():
    assert visible_devices(2, 4, None) == ["0,1,2,3", "4,5,6,7"]
    assert visible_devices(2, 1, "3, 5,6") == ["3", "5"]
    with pytest.raises(ValueError, match="4 devices, but CUDA_VISIBLE_DEVICES='0,1' lists 2"):
        visible_devices(2, 2, "0,1")


def test_replica_stats_add_up_as_one_engines():
    one = {"num_running": 2, "num_used_pages": 10, "num_total_pages": 100,
           "kv_cache_usage": 0.1, "prefix_cache_hits": 30, "prefix_cache_queries": 60,
           "prefix_cache_hit_rate": 0.5, "spec_decode_num_accepted_tokens_per_pos": [3, 1],
           "lora_running_adapters": ["a"], "max_loras": 4, "bytes_per_page": 512}
    two = {**one, "num_running": 1, "num_used_pages": 50, "prefix_cache_hits": 0,
           "spec_decode_num_accepted_tokens_per_pos": [1], "lora_running_adapters": ["b", "a"]}
    merged = merge_stats([one, two])
    assert merged["num_running"] == 3 and merged["num_total_pages"] == 200
    assert merged["kv_cache_usage"] == 60 / 200
    assert merged["prefix_cache_hit_rate"] == 30 / 120
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [4, 1]
    assert merged["lora_running_adapters"] == ["a", "b"]
    assert merged["max_loras"] == 4 and merged["bytes_per_page"] == 512
