"""LoRA in the engine: the model's adapter slots, the host-side registry and cache
(serving/core/lora_slots.py), and the engine's add_lora / remove_lora / list_loras."""

from __future__ import annotations

from qwen_jax.lora import load_adapter
from qwen_jax.lora_packing import pack_adapter
from qwen_jax.validation import require
from serving.core.lora_request import LoRARequest
from serving.core.lora_slots import LoRASlots

# The grouped-matmul kernels tile K and N by powers of two >= 16: buffers of a smaller
# rank are padded (zeros) to this multiple on the kernel paths.
KERNEL_RANK_MULTIPLE = 16


class EngineLoRA:
    """The LoRA state of one engine: slots in `model`, adapters packed at its buffer rank."""

    def __init__(self, config, model):
        require(config.max_lora_rank >= 1, "max_lora_rank", config.max_lora_rank, ">= 1")
        rank = config.max_lora_rank
        if model.impl != "reference":
            rank = -(-rank // KERNEL_RANK_MULTIPLE) * KERNEL_RANK_MULTIPLE
        self.model_config, self.max_rank = model.config, config.max_lora_rank
        self.buffer_rank = rank
        self.slots = LoRASlots(config.max_loras, config.max_cpu_loras, self._load)
        model.enable_lora(config.max_loras, rank)

    def _load(self, lora: LoRARequest) -> list[dict]:
        """Read, check and pack an adapter on the host (any thread)."""
        require(bool(lora.lora_path), "lora_path", lora.lora_path, "the adapter's directory")
        adapter = load_adapter(lora.lora_path, self.model_config, max_rank=self.max_rank,
                               name=lora.lora_name)
        return pack_adapter(adapter, self.model_config, rank=self.buffer_rank)

    def write_slots(self, runner) -> None:
        """Fill the buffers the scheduler gave adapters, before the step that uses them."""
        for index, packed in self.slots.take_writes():
            runner.write_lora_slot(index, packed)

    def stats(self, scheduler) -> dict:
        """vLLM's lora_requests_info: adapters of running and of waiting requests."""
        waiting = sorted({r.lora_request.lora_name for r in scheduler.waiting
                          if r.lora_request is not None})
        return {"lora_running_adapters": self.slots.running_adapters(),
                "lora_waiting_adapters": waiting, "max_loras": self.slots.max_loras}


def lora_setup(config, model) -> EngineLoRA | None:
    """The engine's LoRA state when `enable_lora` (slots preallocated in `model` now,
    before the KV cache is sized), else None."""
    if not config.enable_lora:
        return None
    from serving.executor import distributed
    require(not distributed.is_multiprocess(), "enable_lora", True,
            "False with several processes (adapters load on one host)")
    return EngineLoRA(config, model)


class LoRAMethods:
    """vLLM's LLMEngine LoRA methods, over the engine's `lora` (None: LoRA off)."""

    lora: EngineLoRA | None

    def _lora_slots(self) -> LoRASlots:
        require(self.lora is not None, "enable_lora", False, "True to serve LoRA adapters")
        assert self.lora is not None
        return self.lora.slots

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (loaded and checked now); False if it already was."""
        return self._lora_slots().add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter; requests that use it finish with it. False if unknown."""
        return self._lora_slots().remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else list(self.lora.slots.registered.values())

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: registered (loaded) now if it is new."""
        if lora_request is not None:
            slots = self._lora_slots()
            if slots.registered.get(lora_request.lora_name) != lora_request:
                slots.add(lora_request)
