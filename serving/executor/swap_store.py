"""KV pages copied to host memory and back, by page id (the copies behind `swap_space`).

A page spans every layer: page p of a segment's `[X * P, L, K, H]` cache is rows
`x * P + p`, so a copy works on the `[X, P, L, K, H]` view. Copies run in power-of-two
chunks (13 pages: 8 + 4 + 1), each a jitted gather (device -> device), then a
`device_put` into JAX's `pinned_host` memory space: on a GPU a DMA into page-locked host
memory, on CPU the same calls make plain copies. Back, the chunk is `device_put` to the
device and scattered into its new pages by a jitted update that donates the cache. The
chunk sizes are compiled once (`compile`), so swapping never compiles while serving.

Host pages are bookkeeping ids (serving/core/swap.py hands them out); each maps to a row of
the chunk it was copied in. A chunk's memory is released when none of its rows is held.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

_HOST = "pinned_host"


def _paged(cache: jax.Array, num_pages: int) -> jax.Array:
    """[X * P, L, K, H] -> [X, P, L, K, H] (a free reshape)."""
    return cache.reshape(-1, num_pages, *cache.shape[1:])


def _gather_pages(caches, pages, *, num_pages: int):
    """caches: per segment (K, V); pages int32[n] -> per segment (K, V) of [X, n, L, K, H]."""
    return [tuple(_paged(c, num_pages)[:, pages] for c in kv) for kv in caches]


def _scatter_pages(caches, pages, chunk, *, num_pages: int):
    """Write chunk rows into `pages` (page 0, the scratch page, takes rows not wanted)."""
    return [tuple(_paged(c, num_pages).at[:, pages].set(rows).reshape(c.shape)
                  for c, rows in zip(kv, kv_rows)) for kv, kv_rows in zip(caches, chunk)]


def chunk_sizes(num: int, largest: int) -> list[int]:
    """Power-of-two chunks covering `num`, largest first: 13 -> [8, 4, 1]."""
    sizes = [largest] * (num // largest)
    rest = num % largest
    sizes += [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]
    return sizes


class _Chunk:
    """One copy's pages on the host, and the device shardings to bring them back to."""

    def __init__(self, host, device_shardings, num_rows: int):
        self.host = host
        self.device_shardings = device_shardings
        self.num_rows = num_rows


class SwapStore:
    def __init__(self, num_pages: int, max_pages_per_copy: int):
        self.num_pages = num_pages
        self.largest = 1 << max(0, (max_pages_per_copy - 1).bit_length())
        self.sizes = [1 << b for b in range(self.largest.bit_length())]
        self._gather = jax.jit(functools.partial(_gather_pages, num_pages=num_pages))
        self._scatter = jax.jit(functools.partial(_scatter_pages, num_pages=num_pages),
                                donate_argnums=(0,))
        self._gathers: dict[int, jax.stages.Compiled] = {}
        self._scatters: dict[int, jax.stages.Compiled] = {}
        self._rows: dict[int, tuple[_Chunk, int]] = {}  # host page -> (chunk, row)

    @property
    def num_compiles(self) -> int:
        return len(self._gathers) + len(self._scatters)

    @property
    def num_held_pages(self) -> int:
        return len(self._rows)

    def compile(self, caches) -> None:
        """Compile the gather and the scatter of every chunk size."""
        for n in self.sizes:
            pages = jax.ShapeDtypeStruct((n,), np.int32)
            gather = self._gather.lower(caches, pages).compile()
            chunk = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                   sharding=sh),
                                 jax.eval_shape(self._gather, caches, pages),
                                 gather.output_shardings)
            self._gathers[n] = gather
            self._scatters[n] = self._scatter.lower(caches, pages, chunk).compile()

    def save(self, caches, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy `device_pages` to the host under the ids `host_pages`. Reads `caches` before
        any later step writes them (JAX orders the read before the donation)."""
        start = 0
        for n in chunk_sizes(len(device_pages), self.largest):
            ids = np.asarray(device_pages[start:start + n], np.int32)
            rows = self._compiled(self._gathers, n, self._gather, caches, ids)
            host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(_HOST)),
                                rows)
            chunk = _Chunk(host, jax.tree.map(lambda x: x.sharding, rows), n)
            for row, page in enumerate(host_pages[start:start + n]):
                self._rows[page] = (chunk, row)
            start += n

    def load(self, caches, host_pages: list[int], device_pages: list[int]):
        """Copy host pages into `device_pages`; returns the updated (donated) caches."""
        targets: dict[int, tuple[_Chunk, np.ndarray]] = {}
        for host_page, device_page in zip(host_pages, device_pages):
            chunk, row = self._rows.pop(host_page)
            _, pages = targets.setdefault(id(chunk), (chunk, np.zeros(chunk.num_rows, np.int32)))
            pages[row] = device_page
        for chunk, pages in targets.values():
            rows = jax.tree.map(jax.device_put, chunk.host, chunk.device_shardings)
            caches = self._compiled(self._scatters, chunk.num_rows, self._scatter, caches,
                                    pages, rows)
        return caches

    def host_arrays(self) -> list[jax.Array]:
        """The host copies held now (for timing and for checking their memory kind)."""
        chunks = {id(chunk): chunk for chunk, _ in self._rows.values()}
        return [x for chunk in chunks.values() for x in jax.tree.leaves(chunk.host)]

    def release(self, host_pages: list[int]) -> None:
        """Forget host pages whose request finished while swapped out."""
        for page in host_pages:
            self._rows.pop(page, None)

    @staticmethod
    def _compiled(table: dict, n: int, jitted, *args):
        fn = table.get(n)
        return fn(*args) if fn is not None else jitted(*args)


def copy_planned_swaps(store: SwapStore | None, runner, out) -> None:
    """The swaps a step's schedule planned (`out`: its SchedulerOutput), made through the
    model runner before the step writes any page they read."""
    if store is None:
        return
    store.release(out.host_pages_freed)
    if out.swap_out:
        runner.copy_pages_to_host(store, *zip(*out.swap_out))
    if out.swap_in:
        runner.copy_pages_from_host(store, *zip(*out.swap_in))
