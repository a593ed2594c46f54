"""Compiled steps shared by the engines of one process.

An engine traces, lowers and compiles its step for every (T, S) bucket when it starts
(serving/executor/model_runner.py; the draft model's and EAGLE-3 head's proposals likewise).
XLA's persistent cache saves the compiles across processes, not the tracing and lowering
that come before them: on a CPU about 25 s for the embedded model's 27 buckets
(docs/benchmarks.md, "Engine start-up"). A second engine of the same shapes in the same
process (`LLM` objects made one after another, benchmarks comparing engines side by side,
the tests) takes the executables the first built instead, when everything the trace
depends on is the same: the step's function, the model's graph (configuration, kernels,
mesh: nnx's GraphDef), the runner's sizes, the abstract state, caches and arguments with
their shardings, and the JAX options that change a trace.

Bounded: on a CPU an executable maps about 730 memory regions (code, data and read-only
data of each kernel XLA emits) and a process may map vm.max_map_count, 65,530 by default
(about 90 executables), and jax's own caches keep more (every eager op's). Before an engine
compiles n executables the cache drops its references that no engine uses, least recently
used first, until the executables alive (the engines' and its own) and the n to come fit
`limit` and the process's mappings with theirs fit half its allowance: it holds nothing
past what engines hold when mappings run short.
"""

from __future__ import annotations

import collections
import gc
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

DEFAULT_LIMIT = 64
# Memory regions a CPU executable maps: the embedded model's steps, measured (~240 kernels)
REGIONS_PER_EXECUTABLE = 730


def signature(tree) -> Hashable:
    """A pytree's structure and each leaf's shape, dtype, weak type and sharding (a leaf
    without a dtype, such as a static int, by its value)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(np.dtype(x.dtype)),
                           bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None))
                          if hasattr(x, "dtype") else ("value", x) for x in leaves)


def trace_options() -> tuple:
    """The JAX options a step's trace depends on (conftest and users may set them)."""
    config: Any = jax.config  # its options are attributes the stubs do not list
    return config.jax_default_matmul_precision, config.jax_enable_x64


class SharedExecutables:
    """Compiled executables by key, the `limit` used last (see the module's docstring)."""

    def __init__(self, limit: int = DEFAULT_LIMIT,
                 regions: Callable[[], tuple[int, int] | None] | None = None):
        """regions: () -> (memory regions mapped, the most allowed) or None (unknown);
        default: `mapped_regions`."""
        self.limit = limit
        self.regions = regions or mapped_regions
        self._held: collections.OrderedDict[Hashable, jax.stages.Compiled] = (
            collections.OrderedDict())
        self._alive: weakref.WeakSet = weakref.WeakSet()  # every executable handed out
        # runner -> the keys of the executables it took (they stay alive while it does)
        self._users: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, user, key: Hashable | None) -> jax.stages.Compiled | None:
        """The executable of `key` if held, for `user` (a runner that keeps it)."""
        if key is None:
            return None
        with self._lock:
            compiled = self._held.get(key)
            if compiled is not None:
                self._held.move_to_end(key)
                self._users.setdefault(user, set()).add(key)
                self.hits += 1
            return compiled

    def put(self, user, key: Hashable | None, compiled: jax.stages.Compiled) -> None:
        """Keeps `compiled`, which `user` compiled and keeps."""
        with self._lock:
            self._alive.add(compiled)
            if key is None or self.limit <= 0:
                return
            self._held[key] = compiled
            self._held.move_to_end(key)
            self._users.setdefault(user, set()).add(key)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    def compile(self, user, keys: list[Hashable | None], lower: Callable[[int], object],
                compile_all: Callable[[list[int], list], list]) -> tuple[list, list[int]]:
        """The executables of `keys` for `user` (the runner keeping them): the shared ones
        where held, the others lowered (`lower(i)`) and compiled (`compile_all(indices,
        lowered)`) and then shared; and the indices of those compiled. A key of None is
        never shared (its trace depends on something unhashable)."""
        found = [self.get(user, key) for key in keys]
        missing = [i for i, compiled in enumerate(found) if compiled is None]
        if missing:
            self.make_room(len(missing))
        built = compile_all(missing, [lower(i) for i in missing]) if missing else []
        for i, compiled in zip(missing, built):
            found[i] = compiled
            self.put(user, keys[i], compiled)
        return found, missing

    def make_room(self, count: int) -> None:
        """Before `count` executables are compiled: drops the references used longest ago
        that no engine uses until the executables alive and those to come fit `limit`
        and the process's memory mappings with theirs fit half of what it may map."""
        if self._excess(count) <= 0:
            return
        gc.collect()  # engines gone but not collected yet (their jits are reference cycles)
        excess = self._excess(count)
        with self._lock:
            in_use = set().union(*self._users.values())  # dropping those frees nothing
            unused = [key for key in self._held if key not in in_use]  # oldest first
            dropped = unused[:max(excess, 0)]
            for key in dropped:
                del self._held[key]
        if dropped:
            gc.collect()  # free them now (jax's compiled objects are reference cycles)

    def _excess(self, count: int) -> int:
        """How many executables too many there would be with `count` more."""
        excess = len(self._alive) + count - self.limit
        regions = self.regions()
        if regions is not None:
            used, most = regions
            excess = max(excess, -(-(used + count * REGIONS_PER_EXECUTABLE - most // 2)
                                   // REGIONS_PER_EXECUTABLE))
        return excess


def mapped_regions() -> tuple[int, int] | None:
    """(memory regions this process maps, the most it may), where Linux says."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as most:
            return used, int(most.read())
    except (OSError, ValueError):
        return None


SHARED = SharedExecutables()


def traced_function(jitted) -> Hashable:
    """The function a `jax.jit` wraps (a bound method: its class's function), with the
    class of the object it is bound to."""
    fn = getattr(jitted, "__wrapped__", jitted)
    owner = getattr(fn, "__self__", None)
    return type(owner), getattr(fn, "__func__", fn)


def hashable_or_none(key: tuple) -> Hashable | None:
    """`key` if it hashes (an unhashable part: a graph node with a list attribute...)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


__all__ = ["SHARED", "SharedExecutables", "hashable_or_none", "signature",
           "trace_options", "traced_function"]
