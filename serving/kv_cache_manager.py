"""The three calls the scheduler makes on the page pool (vLLM v1's shape). Pure Python."""

from __future__ import annotations

from serving.block_pool import ROOT_HASH, Block, BlockPool, hash_block_tokens
from serving.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        # request_id -> how many of its leading blocks are registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.hit_rate

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached full-block prefix; never the whole sequence.

        At least one token is left to compute so the step produces logits.
        Requests that want prompt logprobs need every prompt position computed.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[Block] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(block_hash, request.tokens(start, start + self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] | None = None, *,
                       num_reserved_blocks: int = 0) -> bool:
        """Hold enough pages for computed + new tokens; False (no change) if short.

        `new_computed_blocks` (prefix hits from get_computed_blocks) marks an
        admission. `num_reserved_blocks` pages must stay free afterwards (the
        admission watermark).
        """
        computed = new_computed_blocks or ()
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(computed)
        num_new_blocks = max(num_new_blocks, 0)
        # Cached hits nobody holds are counted as free; taking them uses up free pages.
        num_revived = sum(1 for block in computed if block.ref_count == 0) if computed else 0
        if num_new_blocks + num_revived + num_reserved_blocks > self.num_free_blocks:
            return False
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(num_new_blocks)
        request.block_ids.extend(block.block_id for block in computed)
        request.block_ids.extend(block.block_id for block in new_blocks)
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.pool.record_query(request.num_tokens, len(computed) * self.block_size)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed.

        Only computed blocks: a block registered before its step ran could be
        hit by another request after this one is preempted or aborted, and
        that request would read KV that was never written.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block = self.pool.blocks[request.block_ids[i]]
            lo = i * self.block_size
            self.pool.cache(block, hashes[i], request.tokens(lo, lo + self.block_size))
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's pages, tail first so the tail is evicted first."""
        self.pool.free([self.pool.blocks[i] for i in reversed(request.block_ids)])
        request.block_ids.clear()
        self._num_cached_blocks.pop(request.request_id, None)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks, memoised on the request."""
        hashes = request.block_hashes
        bs = self.block_size
        num_blocks = min(num_blocks, request.num_tokens // bs)
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(hash_block_tokens(parent, request.tokens(i * bs, (i + 1) * bs)))
        return hashes
