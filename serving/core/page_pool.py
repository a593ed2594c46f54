"""Page allocator: ref counts, chained prefix hashes, LRU eviction. Pure Python.

Page 0 is the padding scratch page: padding tokens write there, so it is never
handed out. A page whose ref count is 0 is free; if it still carries a prefix
hash it stays reusable as a cache hit until the allocator evicts it, least
recently freed first.
"""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Sequence

SCRATCH_PAGE_ID = 0
# Hash of the (empty) parent of a request's first page.
ROOT_HASH = 0


def hash_page_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """128-bit chained hash of one full page.

    blake2b rather than Python's `hash` so that a chain collision (which token
    verification alone cannot rule out, since it only checks the last page)
    is astronomically unlikely.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(array.array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_hash(seed: str | None) -> int:
    """The parent hash of a sequence's first page: ROOT_HASH, or one of its own for a
    `seed` (a LoRA adapter: pages computed with different adapters never match)."""
    if seed is None:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=16).digest(), "little")


def lora_seed(lora_request) -> str | None:
    """The root-hash seed of a request's adapter (a LoRARequest, or None: the base)."""
    if lora_request is None:
        return None
    return f"lora:{lora_request.lora_int_id}:{lora_request.lora_path}"


def prompt_page_hashes(token_ids: Sequence[int], page_size: int,
                       seed: str | None = None) -> list[int]:
    """The chained hashes of the full pages of `token_ids`, as the prefix cache keys them
    (the data-parallel router matches requests to replicas by them)."""
    hashes: list[int] = []
    parent = root_hash(seed)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_page_tokens(parent, token_ids[start:start + page_size])
        hashes.append(parent)
    return hashes


class Page:
    """One KV page. `token_ids` is kept so a hash hit can be verified."""

    __slots__ = ("page_id", "ref_count", "page_hash", "token_ids")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_count = 0
        self.page_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Page(id={self.page_id}, ref={self.ref_count}, cached={self.page_hash is not None})"


class PagePool:
    def __init__(self, num_pages: int, page_size: int = 16,
                 enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        # Free pages in eviction order: the first key is reused first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(1, num_pages))
        self._cached: dict[int, int] = {}  # page hash -> page id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_total_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_total_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def record_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def lookup(self, page_hash: int, token_ids: Sequence[int]) -> Page | None:
        """The cached page for this hash, only if its stored tokens match."""
        page_id = self._cached.get(page_hash)
        if page_id is None:
            return None
        page = self.pages[page_id]
        if page.token_ids != tuple(token_ids):
            return None
        return page

    def allocate(self, num_pages: int) -> list[Page]:
        """Take `num_pages` free pages (evicting their cached hashes), ref 1."""
        if num_pages > self.num_free_pages:
            raise ValueError(
                f"cannot allocate {num_pages} pages, only {self.num_free_pages} free")
        taken = []
        for _ in range(num_pages):
            page_id, _ = self._free.popitem(last=False)
            page = self.pages[page_id]
            self._evict(page)
            page.ref_count = 1
            taken.append(page)
        return taken

    def touch(self, pages: Sequence[Page]) -> None:
        """Take a reference on cached pages (a prefix hit)."""
        for page in pages:
            if page.ref_count == 0:
                del self._free[page.page_id]
            page.ref_count += 1

    def free(self, pages: Sequence[Page]) -> None:
        """Drop one reference each, in the given order (first freed is evicted first)."""
        for page in pages:
            if page.ref_count <= 0:
                raise ValueError(f"double free of page {page.page_id}")
            page.ref_count -= 1
            if page.ref_count == 0:
                self._free[page.page_id] = None
                if page.page_hash is None:
                    # Nothing to reuse in it: hand it out before any cached page.
                    self._free.move_to_end(page.page_id, last=False)

    def cache(self, page: Page, page_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full, computed page under its chained hash."""
        if not self.enable_prefix_caching or page.page_hash is not None:
            return
        if page_hash in self._cached:
            return  # an identical page is already cached; keep the older one
        page.page_hash = page_hash
        page.token_ids = tuple(token_ids)
        self._cached[page_hash] = page.page_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (pages in use keep their contents)."""
        for page in self.pages:
            self._evict(page)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def _evict(self, page: Page) -> None:
        if page.page_hash is None:
            return
        if self._cached.get(page.page_hash) == page.page_id:
            del self._cached[page.page_hash]
        page.page_hash = None
        page.token_ids = None
