"""Which data-parallel replica serves a request (`qwen-jax serve --data-parallel-size N`):
prefix affinity first, balanced by load.

The router keeps, per replica, the page hashes of the prompts it sent there (the prefix
cache's own chained hashes: serving/core/page_pool.py), most recent last and at most as
many as the replica's KV cache has pages: an LRU picture of what the replica most likely
still holds (the replicas' caches live in other processes; SGLang's cache-aware router
keeps the same kind of record of what it routed where). A request goes to the replica whose
record holds the longest run of its leading pages, unless that replica's load (unfinished
requests) exceeds the least loaded one's by more than the slack (`balance_abs` requests, or
`balance_rel` times the least load), or its KV cache is nearly full: then to the least
loaded, so one hot prefix cannot pin a replica. Ties go to the replica with the lower KV
use, then to the one sent fewer requests.

Policies: `prefix` (the above), `least_loaded` (load only), `round_robin` (the baseline the
routing benchmark compares against).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """A replica as the router sees it when a request arrives."""

    serving: bool         # started and not dead
    num_unfinished: int   # requests sent to it and not finished (running + waiting)
    kv_cache_usage: float  # from its last stats (0..1)


class ReplicaRouter:
    def __init__(self, num_replicas: int, policy: str = "prefix", *, capacity_pages: int = 4096,
                 balance_abs: int = 4, balance_rel: float = 0.5, kv_full: float = 0.95):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing must be one of {ROUTING_POLICIES}, "
                             f"got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.policy = policy
        self.capacity_pages = capacity_pages
        self.balance_abs, self.balance_rel, self.kv_full = balance_abs, balance_rel, kv_full
        self.records: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.num_routed = [0] * num_replicas
        self.num_affine = 0  # requests sent where their prefix was recorded
        self._turns = itertools.cycle(range(num_replicas))

    def matched_pages(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of `hashes`' leading pages the replica's record holds."""
        record = self.records[replica]
        count = 0
        for page_hash in hashes:
            if page_hash not in record:
                break
            count += 1
        return count

    def choose(self, hashes: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The replica for a request whose prompt's full pages hash to `hashes`; records
        them there. ValueError when no replica is serving."""
        serving = [i for i, load in enumerate(loads) if load.serving]
        if not serving:
            raise ValueError("no data-parallel replica is serving")
        if self.policy == "round_robin":
            choice = next(i for i in self._turns if loads[i].serving)
        else:
            choice = self._by_load(serving, loads)
            if self.policy == "prefix" and hashes:
                choice = self._by_prefix(serving, loads, hashes, choice)
        self.record(choice, hashes)
        self.num_routed[choice] += 1
        return choice

    def _by_load(self, serving: list[int], loads: Sequence[ReplicaLoad]) -> int:
        return min(serving, key=lambda i: (loads[i].num_unfinished, loads[i].kv_cache_usage,
                                           self.num_routed[i], i))

    def _by_prefix(self, serving: list[int], loads: Sequence[ReplicaLoad],
                   hashes: Sequence[int], least: int) -> int:
        matches = {i: self.matched_pages(i, hashes) for i in serving}
        best = max(serving, key=lambda i: (matches[i], -loads[i].num_unfinished, -i))
        if not matches[best]:
            return least
        floor = loads[least].num_unfinished
        slack = max(self.balance_abs, self.balance_rel * floor)
        if loads[best].num_unfinished > floor + slack or loads[best].kv_cache_usage >= self.kv_full:
            return least
        self.num_affine += 1
        return best

    def record(self, replica: int, hashes: Sequence[int]) -> None:
        """`hashes` are (now) in the replica's cache: the most recent entries of its record."""
        record = self.records[replica]
        for page_hash in hashes:
            record[page_hash] = None
            record.move_to_end(page_hash)
        while len(record) > self.capacity_pages:
            record.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica restarted: its cache is empty."""
        self.records[replica].clear()


__all__ = ["ROUTING_POLICIES", "ReplicaLoad", "ReplicaRouter"]
