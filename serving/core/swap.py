"""Host-page bookkeeping for KV swap (`swap_space`). Pure Python.

A preempted request's computed pages can be copied to host memory and copied back when
it resumes, instead of being recomputed. This module only hands out host page ids and
remembers which request holds which; the copies themselves are the runner's and the
swap store's (serving/executor/swap_store.py), driven by the (device page, host page)
pairs the scheduler puts in its output.

Swap or recompute: a request is swapped out when it has at least `min_tokens` computed
tokens (a short prefix recomputes inside a step's spare token budget for almost nothing;
a long one would cost whole prefill steps) and the host pages are free; otherwise it
is recomputed.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SwappedRequest:
    host_pages: list[int]
    num_computed_tokens: int  # KV positions the host pages hold


class SwapManager:
    def __init__(self, num_host_pages: int = 0, min_tokens: int = 0):
        if num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {num_host_pages}")
        self.num_host_pages = num_host_pages
        self.min_tokens = min_tokens
        self._free = list(range(num_host_pages - 1, -1, -1))  # pop() takes the lowest id
        self._free_set = set(self._free)
        self._swapped: dict[str, SwappedRequest] = {}
        self.released: list[int] = []  # host pages of requests dropped while swapped
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_pages_swapped_out = 0

    @property
    def enabled(self) -> bool:
        return self.num_host_pages > 0

    @property
    def num_free_host_pages(self) -> int:
        return len(self._free)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def usage(self) -> float:
        return 1 - len(self._free) / self.num_host_pages if self.num_host_pages else 0.0

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def num_saved_tokens(self, request_id: str) -> int:
        entry = self._swapped.get(request_id)
        return 0 if entry is None else entry.num_computed_tokens

    def should_swap(self, num_computed_tokens: int, num_pages: int) -> bool:
        return (self.enabled and num_computed_tokens > 0
                and num_computed_tokens >= self.min_tokens
                and num_pages <= len(self._free))

    def swap_out(self, request_id: str, device_pages: list[int],
                 num_computed_tokens: int) -> list[tuple[int, int]]:
        """Take host pages for `device_pages`; returns (device page, host page) pairs."""
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if len(device_pages) > len(self._free):
            raise ValueError(f"cannot swap out {len(device_pages)} pages, only "
                             f"{len(self._free)} host pages free")
        host = [self._free.pop() for _ in device_pages]
        self._free_set.difference_update(host)
        self._swapped[request_id] = SwappedRequest(host, num_computed_tokens)
        self.num_swap_outs += 1
        self.num_pages_swapped_out += len(host)
        return list(zip(device_pages, host))

    def swap_in(self, request_id: str, device_pages: list[int]) -> list[tuple[int, int]]:
        """Give back the request's host pages; returns (host page, device page) pairs."""
        entry = self._swapped.pop(request_id)
        if len(device_pages) != len(entry.host_pages):
            self._swapped[request_id] = entry
            raise ValueError(f"request {request_id!r} holds {len(entry.host_pages)} host "
                             f"pages, got {len(device_pages)} device pages")
        self._release(entry.host_pages)
        self.num_swap_ins += 1
        return list(zip(entry.host_pages, device_pages))

    def drop(self, request_id: str) -> None:
        """Forget a swapped request that finished or was aborted while on the host."""
        entry = self._swapped.pop(request_id, None)
        if entry is not None:
            self._release(entry.host_pages)
            self.released.extend(entry.host_pages)

    def take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    def _release(self, host_pages: list[int]) -> None:
        for page in host_pages:
            if page in self._free_set or not 0 <= page < self.num_host_pages:
                raise ValueError(f"double free of host page {page}")
        self._free.extend(reversed(host_pages))
        self._free_set.update(host_pages)
