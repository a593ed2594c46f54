"""Device KV cache: sizing from free device memory (or an explicit page count) and allocation."""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)

# CPU backends report no memory limit; like vLLM's CPU KV space, use a fixed budget.
CPU_KV_CACHE_BYTES = 1 << 30


def free_device_bytes(device=None) -> int | None:
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def num_pages_to_allocate(cache_config, per_page: int, max_pages_needed: int) -> int:
    """Pages (page 0, the scratch page, included) the cache gets.

    `num_gpu_blocks_override` wins; otherwise `gpu_memory_utilization` of the device memory
    the weights leave free, or a fixed budget on CPU, never more than `max_pages_needed`.
    """
    if cache_config.num_gpu_blocks_override is not None:
        return int(cache_config.num_gpu_blocks_override)
    free = free_device_bytes()
    if free is None:
        budget = CPU_KV_CACHE_BYTES
        pages = min(budget // per_page, max_pages_needed)
    else:
        pages = int(free * cache_config.gpu_memory_utilization) // per_page
    if pages < 2:
        raise ValueError(
            f"no room for the KV cache: {free} free bytes at gpu_memory_utilization="
            f"{cache_config.gpu_memory_utilization} fit {pages} pages of {per_page} bytes; "
            f"at least 2 are needed")
    return int(pages)


def allocate(model, num_pages: int, page_size: int, dtype):
    caches = model.init_kv_caches(num_pages, page_size, dtype)
    logger.info("KV cache: %d pages x %d tokens (page 0 is the padding scratch page), %.1f MiB",
                num_pages, page_size, sum(x.nbytes for x in jax.tree.leaves(caches)) / 2**20)
    return caches
