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

SCRATCH_BLOCK_ID = 0
# Hash of the (empty) parent of a request's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """128-bit chained hash of one full block.

    blake2b rather than Python's `hash` so that a chain collision (which token
    verification alone cannot rule out, since it only checks the last block)
    is astronomically unlikely.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(array.array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class Block:
    """One KV page. `token_ids` is kept so a hash hit can be verified."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (page 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free pages in eviction order: the first key is reused first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def record_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash, only if its stored tokens match."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` free pages (evicting their cached hashes), ref 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each, in the given order (first freed is evicted first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    # Nothing to reuse in it: hand it out before any cached page.
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; keep the older one
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (pages in use keep their contents)."""
        for block in self.blocks:
            self._evict(block)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
