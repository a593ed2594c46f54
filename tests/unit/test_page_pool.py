"""Page allocator and the KV cache manager's three calls."""

import pytest

from serving.core.kv_cache_manager import KVCacheManager
from serving.core.page_pool import ROOT_HASH, PagePool, hash_page_tokens
from serving.core.request import Request, SamplingParams

BS = 4


def make_request(rid, tokens, **sampling):
    return Request(rid, list(tokens), SamplingParams(**sampling))


def admit(manager, request, num_new=None):
    """Admission as the scheduler does it; returns the number of cached tokens."""
    hits, num_cached = manager.get_computed_pages(request)
    num_new = request.num_tokens - num_cached if num_new is None else num_new
    assert manager.allocate_slots(request, num_new, hits)
    request.num_computed_tokens = num_cached
    return num_cached


def compute(manager, request, num_new):
    request.num_computed_tokens += num_new
    manager.cache_pages(request)


def test_page_zero_is_reserved_and_never_handed_out():
    pool = PagePool(num_pages=5, page_size=BS)
    assert pool.num_total_pages == 4 and pool.num_free_pages == 4
    ids = [b.page_id for b in pool.allocate(4)]
    assert sorted(ids) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot allocate 1 pages, only 0 free"):
        pool.allocate(1)


def test_ref_counts_shared_block_freed_only_after_last_ref():
    pool = PagePool(num_pages=4, page_size=BS)
    (page,) = pool.allocate(1)
    pool.touch([page])
    assert page.ref_count == 2 and pool.num_free_pages == 2
    pool.free([page])
    assert page.ref_count == 1 and pool.num_free_pages == 2
    pool.free([page])
    assert page.ref_count == 0 and pool.num_free_pages == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free([page])


def test_chained_hash_depends_on_parent():
    h1 = hash_page_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_page_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert hash_page_tokens(h1, [5, 6, 7, 8]) != hash_page_tokens(ROOT_HASH, [5, 6, 7, 8])
    assert h1 != hash_page_tokens(ROOT_HASH, [1, 2, 3, 5])


def test_hit_verified_against_stored_tokens():
    pool = PagePool(num_pages=4, page_size=BS)
    (page,) = pool.allocate(1)
    pool.cache(page, 1234, [1, 2, 3, 4])
    assert pool.lookup(1234, [1, 2, 3, 4]) is page
    # Same hash, other tokens: a collision must never return the page.
    assert pool.lookup(1234, [9, 9, 9, 9]) is None


def test_lru_eviction_least_recently_freed_first():
    pool = PagePool(num_pages=4, page_size=BS)
    a, b, c = pool.allocate(3)
    for i, page in enumerate((a, b, c)):
        pool.cache(page, 100 + i, [i] * BS)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first is b and pool.lookup(100 + 1, [1] * BS) is None
    assert pool.lookup(100, [0] * BS) is a and pool.lookup(102, [2] * BS) is c
    (second,) = pool.allocate(1)
    assert second is a


def test_uncached_free_pages_are_reused_before_cached_ones():
    pool = PagePool(num_pages=4, page_size=BS)
    a, b, _ = pool.allocate(3)
    pool.cache(a, 7, [0] * BS)
    pool.free([a])
    pool.free([b])
    assert pool.allocate(1)[0] is b


def test_manager_prefix_hit_shares_pages_and_sets_cached_tokens():
    manager = KVCacheManager(num_pages=16, page_size=BS)
    first = make_request("a", range(10))  # pages [0..3] [4..7] + 2 tokens
    admit(manager, first)
    compute(manager, first, 10)
    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_cached = manager.get_computed_pages(second)
    assert num_cached == 8
    assert [b.page_id for b in hits] == first.page_ids[:2]
    assert manager.allocate_slots(second, second.num_tokens - num_cached, hits)
    assert second.page_ids[:2] == first.page_ids[:2]
    assert manager.pool.pages[first.page_ids[0]].ref_count == 2


def test_hit_never_covers_the_whole_prompt():
    manager = KVCacheManager(num_pages=16, page_size=BS)
    first = make_request("a", range(8))
    admit(manager, first)
    compute(manager, first, 8)
    again = make_request("b", range(8))
    _, num_cached = manager.get_computed_pages(again)
    assert num_cached == 4  # (8 - 1) // 4 pages: one token is left to compute


def test_prompt_logprobs_requests_skip_the_cache():
    manager = KVCacheManager(num_pages=16, page_size=BS)
    first = make_request("a", range(9))
    admit(manager, first)
    compute(manager, first, 9)
    assert manager.get_computed_pages(make_request("b", range(9), prompt_logprobs=1))[1] == 0


def test_only_computed_blocks_are_registered():
    manager = KVCacheManager(num_pages=16, page_size=BS)
    first = make_request("a", range(12))
    admit(manager, first)  # pages allocated, nothing computed yet
    assert manager.pool.num_cached_pages == 0
    compute(manager, first, 5)
    assert manager.pool.num_cached_pages == 1
    compute(manager, first, 7)
    assert manager.pool.num_cached_pages == 3


def test_allocate_slots_fails_without_side_effects():
    manager = KVCacheManager(num_pages=4, page_size=BS)  # 3 usable pages
    request = make_request("a", range(13))
    assert not manager.allocate_slots(request, 13, [])
    assert request.page_ids == [] and manager.num_free_pages == 3
    assert manager.allocate_slots(request, 12, [])
    assert len(request.page_ids) == 3 and manager.num_free_pages == 0


def test_allocate_slots_respects_reserved_blocks():
    manager = KVCacheManager(num_pages=5, page_size=BS)
    request = make_request("a", range(12))
    assert not manager.allocate_slots(request, 12, [], num_reserved_pages=2)
    assert manager.allocate_slots(request, 12, [], num_reserved_pages=1)


def test_decode_growth_allocates_one_page_per_block_boundary():
    manager = KVCacheManager(num_pages=8, page_size=BS)
    request = make_request("a", range(4))
    admit(manager, request)
    compute(manager, request, 4)
    assert len(request.page_ids) == 1
    request.append_output_token(99)
    assert manager.allocate_slots(request, 1)
    assert len(request.page_ids) == 2


def test_counters_and_hit_rate():
    manager = KVCacheManager(num_pages=16, page_size=BS)
    first = make_request("a", range(8))
    admit(manager, first)
    compute(manager, first, 8)
    second = make_request("b", list(range(8)) + [1])
    admit(manager, second)
    assert manager.pool.num_queried_tokens == 8 + 9
    assert manager.pool.num_hit_tokens == 8
    assert manager.prefix_cache_hit_rate == pytest.approx(8 / 17)


def test_free_returns_every_page_and_tail_is_evicted_first():
    manager = KVCacheManager(num_pages=8, page_size=BS)
    request = make_request("a", range(12))
    admit(manager, request)
    compute(manager, request, 12)
    ids = list(request.page_ids)
    manager.free(request)
    assert request.page_ids == [] and manager.num_free_pages == manager.num_total_pages
    assert manager.usage == 0.0
    # The four never-used pages go first, then the request's tail page before its head.
    order = [b.page_id for b in manager.pool.allocate(manager.num_total_pages)]
    assert order[-3:] == ids[::-1]


def test_cached_free_pages_count_as_free_and_revive_on_hit():
    manager = KVCacheManager(num_pages=4, page_size=BS)
    first = make_request("a", range(9))
    admit(manager, first)
    compute(manager, first, 9)
    manager.free(first)
    assert manager.num_free_pages == 3
    second = make_request("b", range(9))
    assert admit(manager, second) == 8
    assert manager.num_free_pages == 0  # two revived hits + one new page


def test_reset_prefix_cache_forgets_hashes():
    manager = KVCacheManager(num_pages=8, page_size=BS)
    first = make_request("a", range(9))
    admit(manager, first)
    compute(manager, first, 9)
    manager.free(first)
    manager.reset_prefix_cache()
    assert manager.get_computed_pages(make_request("b", range(9)))[1] == 0
    assert manager.pool.num_cached_pages == 0


def test_prefix_caching_disabled_never_hits():
    manager = KVCacheManager(num_pages=8, page_size=BS, enable_prefix_caching=False)
    first = make_request("a", range(9))
    admit(manager, first)
    compute(manager, first, 9)
    assert manager.get_computed_pages(make_request("b", range(9)))[1] == 0
