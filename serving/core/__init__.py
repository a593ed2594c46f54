"""Requests and their scheduling, in pure Python (no jax, no numpy): the request and
sampling types, the cache and scheduler configs, the compiled-shape buckets, the
scheduler with its ordering policies, prefill cap and degradation, the page pool with its
prefix-cache hashes, the KV cache manager and the swap bookkeeping.

Imports nothing else of `serving`; unit-tested in milliseconds.
"""
