"""Which LoRA adapters are where: registered, in host memory, in the model's device slots.
Pure Python (the loading itself is the engine's `load` function, run on a thread).

The model holds `max_loras` adapters at once (qwen_jax/lora_layers.py); token slot s
reads buffer s - 1, slot 0 is the base model. A waiting request is admitted only once its
adapter has a slot: resident already, or a slot no running request uses (the least
recently used one, empty ones first) that the engine fills before the step
(`take_writes`). An adapter not in host memory (at most `max_cpu_loras` packed adapters,
least recently used dropped first) loads on a thread while its requests wait and the
others run. Running requests pin their adapter's slot.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from qwen_jax.validation import require
from serving.core.lora_request import LoRARequest
from serving.core.request import Request

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, max_loras: int, max_cpu_loras: int | None,
                 load: Callable[[LoRARequest], Any]):
        """load(lora_request) -> the adapter packed for a slot (ValueError if it cannot)."""
        max_cpu_loras = max_cpu_loras or max_loras
        require(max_loras >= 1, "max_loras", max_loras, ">= 1")
        require(max_cpu_loras >= max_loras, "max_cpu_loras", max_cpu_loras,
                f">= max_loras={max_loras}")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load = load
        self.registered: dict[str, LoRARequest] = {}
        self._host: collections.OrderedDict[LoRARequest, Any] = collections.OrderedDict()
        self._loading: dict[LoRARequest, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.slots: list[LoRARequest | None] = [None] * max_loras  # buffer index -> adapter
        self._users = [0] * max_loras  # running requests per buffer
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(max_loras))  # buffers, least recently used first
        self._writes: list[tuple[int, Any]] = []

    # ---- registry ------------------------------------------------------------------
    def add(self, lora: LoRARequest, packed=None) -> bool:
        """Register (load and check now, on the caller's thread; `packed`: already packed,
        as the device probe's random adapters are). False if it already is; ValueError
        for a bad adapter or a name registered with another adapter."""
        known = self.registered.get(lora.lora_name)
        if known is not None:
            require(known == lora, "lora_name", lora.lora_name,
                    f"a new name (already registered with path {known.lora_path!r}, id "
                    f"{known.lora_int_id})")
            return False
        for other in self.registered.values():
            require(other.lora_int_id != lora.lora_int_id, "lora_int_id", lora.lora_int_id,
                    f"unique (adapter {other.lora_name!r} has it)")
        self._keep(lora, self._load(lora) if packed is None else packed)
        self.registered[lora.lora_name] = lora
        return True

    def remove(self, name: str) -> bool:
        """Unregister; requests already queued keep it until they finish."""
        lora = self.registered.pop(name, None)
        if lora is None:
            return False
        self._host.pop(lora, None)
        for i, held in enumerate(self.slots):
            if held == lora and not self._users[i]:
                self.slots[i] = None
        return True

    def _keep(self, lora: LoRARequest, packed) -> None:
        self._host[lora] = packed
        self._host.move_to_end(lora)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    # ---- slots -----------------------------------------------------------------------
    def slot_for(self, request: Request) -> int | None:
        """The token slot the request would run in now (0: no adapter), giving its adapter
        a buffer if it has none; None: not yet (its adapter is loading, or every buffer
        is in use)."""
        lora = request.lora_request
        if lora is None:
            return 0
        if lora in self.slots:
            return self.slots.index(lora) + 1
        packed = self._host_copy(lora)
        if packed is None:
            return None
        free = next((i for i in self._recent if not self._users[i]), None)
        if free is None:
            return None
        self.slots[free] = lora
        self._writes = [(i, p) for i, p in self._writes if i != free] + [(free, packed)]
        return free + 1

    def _host_copy(self, lora: LoRARequest):
        if lora in self._host:
            self._host.move_to_end(lora)
            return self._host[lora]
        future = self._loading.get(lora)
        if future is None:
            self._loading[lora] = self._pool.submit(self._load, lora)
            return None
        if not future.done():
            return None
        del self._loading[lora]
        if future.exception() is not None:  # its files changed since it was registered
            logger.error("reloading LoRA adapter %r from %s failed (retrying): %s",
                         lora.lora_name, lora.lora_path, future.exception())
            return None
        self._keep(lora, future.result())
        return self._host[lora]

    def acquire(self, request: Request, slot: int) -> None:
        """The request runs in `slot` (from `slot_for`) from now on."""
        request.lora_slot = slot
        if slot:
            self._users[slot - 1] += 1
            self._recent.move_to_end(slot - 1)

    def release(self, request: Request) -> None:
        """The request stopped running (finished or preempted)."""
        slot, request.lora_slot = request.lora_slot, 0
        if slot:
            self._users[slot - 1] -= 1
            lora = self.slots[slot - 1]
            if not self._users[slot - 1] and lora is not None and \
                    self.registered.get(lora.lora_name) != lora:
                self.slots[slot - 1] = None  # removed while it ran

    def take_writes(self) -> list[tuple[int, Any]]:
        """(buffer index, packed adapter) to write before the next step, once each."""
        writes, self._writes = self._writes, []
        return writes

    def running_adapters(self) -> list[str]:
        return sorted({lora.lora_name for i, lora in enumerate(self.slots)
                       if lora is not None and self._users[i]})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
