"""The persistent XLA compilation cache: a restart reuses compiled buckets."""

from __future__ import annotations

import os
from pathlib import Path

import jax


def default_compilation_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qwen-jax", "jax-compilation-cache")


def enable_compilation_cache(directory: str | None) -> None:
    """Persistent XLA cache: a restart reuses compiled buckets (0.55 s -> 0.03 s each).
    directory: "default" (under ~/.cache), a path, or None / "" (off)."""
    if directory == "default":
        directory = default_compilation_cache_dir()
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
