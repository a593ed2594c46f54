"""The three calls the scheduler makes on the page pool (vLLM v1's shape). Pure Python."""

from __future__ import annotations

from typing import Protocol

from serving.core.page_pool import Page, PagePool, hash_page_tokens, lora_seed, root_hash
from serving.core.request import Request


class PageListener(Protocol):
    def extend(self, request: Request, start: int) -> None:
        """`request.page_ids[start:]` are new."""

    def release(self, request: Request) -> None:
        """The request holds no pages any more."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int = 16,
                 enable_prefix_caching: bool = True):
        self.pool = PagePool(num_pages, page_size, enable_prefix_caching)
        self.page_size = page_size
        # request_id -> how many of its leading pages are registered in the cache.
        self._num_cached_pages: dict[str, int] = {}
        # Told of every request's page list as it grows and when it is freed (the engine's
        # PageTable, serving/executor/model_inputs.py); None: nobody mirrors the lists.
        self.listener: PageListener | None = None

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_total_pages

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.hit_rate

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def get_computed_pages(self, request: Request) -> tuple[list[Page], int]:
        """Longest cached full-page prefix; never the whole sequence.

        At least one token is left to compute so the step produces logits.
        Requests that want prompt logprobs need every prompt position computed.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_pages = (request.num_tokens - 1) // self.page_size
        hashes = self._page_hashes(request, max_pages)
        hits: list[Page] = []
        for i, page_hash in enumerate(hashes[:max_pages]):
            start = i * self.page_size
            page = self.pool.lookup(page_hash, request.tokens(start, start + self.page_size))
            if page is None:
                break
            hits.append(page)
        return hits, len(hits) * self.page_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_pages: list[Page] | None = None, *,
                       num_reserved_pages: int = 0) -> bool:
        """Hold enough pages for computed + new tokens; False (no change) if short.

        `new_computed_pages` (prefix hits from get_computed_pages) marks an
        admission. `num_reserved_pages` pages must stay free afterwards (the
        admission watermark).
        """
        if new_computed_pages is None and not num_reserved_pages and (
                request.num_computed_tokens + num_new_tokens
                <= len(request.page_ids) * self.page_size):
            return True  # the common decode step: its pages already hold the new token
        computed = new_computed_pages or ()
        num_tokens = request.num_computed_tokens + len(computed) * self.page_size + num_new_tokens
        num_new_pages = cdiv(num_tokens, self.page_size) - len(request.page_ids) - len(computed)
        num_new_pages = max(num_new_pages, 0)
        # Cached hits nobody holds are counted as free; taking them uses up free pages.
        num_revived = sum(1 for page in computed if page.ref_count == 0) if computed else 0
        if num_new_pages + num_revived + num_reserved_pages > self.num_free_pages:
            return False
        self.pool.touch(computed)
        new_pages = self.pool.allocate(num_new_pages)
        num_held = len(request.page_ids)
        request.page_ids.extend(page.page_id for page in computed)
        request.page_ids.extend(page.page_id for page in new_pages)
        if self.listener is not None and len(request.page_ids) > num_held:
            self.listener.extend(request, num_held)
        if new_computed_pages is not None and self.enable_prefix_caching:
            self.pool.record_query(request.num_tokens, len(computed) * self.page_size)
        return True

    def cache_pages(self, request: Request) -> None:
        """Register the request's full pages whose KV is computed.

        Only computed pages: a page registered before its step ran could be
        hit by another request after this one is preempted or aborted, and
        that request would read KV that was never written.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.page_size, len(request.page_ids))
        start = self._num_cached_pages.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._page_hashes(request, num_full)
        for i in range(start, num_full):
            page = self.pool.pages[request.page_ids[i]]
            lo = i * self.page_size
            self.pool.cache(page, hashes[i], request.tokens(lo, lo + self.page_size))
        self._num_cached_pages[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's pages, tail first so the tail is evicted first."""
        self.pool.free([self.pool.pages[i] for i in reversed(request.page_ids)])
        request.page_ids.clear()
        self._num_cached_pages.pop(request.request_id, None)
        if self.listener is not None:
            self.listener.release(request)

    def _page_hashes(self, request: Request, num_pages: int) -> list[int]:
        """Chained hashes of the first `num_pages` full pages, memoised on the request."""
        hashes = request.page_hashes
        bs = self.page_size
        num_pages = min(num_pages, request.num_tokens // bs)
        for i in range(len(hashes), num_pages):
            parent = hashes[i - 1] if i else root_hash(lora_seed(request.lora_request))
            hashes.append(hash_page_tokens(parent, request.tokens(i * bs, (i + 1) * bs)))
        return hashes
