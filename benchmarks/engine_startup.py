"""Engine start-up with and without the executables shared by a process's engines
(serving/executor/shared_executables.py), the embedded model, every bucket compiled at
start-up (the default). Prints one JSON object.

For each engine kind (`plain`, and speculative with the shipped EAGLE-3 head and the shipped
draft model), after one start that fills XLA's persistent cache (the first start's seconds
are reported too: long when that cache is cold): the seconds an `LLM(...)`
takes to start with sharing off (every bucket traced and lowered, the compiles read back
from the persistent cache) and on with an engine of the same kind started before it (it
takes that one's executables), median of `--rounds`.

    PYTHONPATH=. python benchmarks/engine_startup.py [--rounds 3] [--kinds plain eagle3 draft]
        [--compilation-cache-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from qwen_jax import LLM  # noqa: E402
from serving.executor.shared_executables import DEFAULT_LIMIT, SHARED  # noqa: E402

KINDS = {"plain": None,
         "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
         "draft": {"method": "draft_model", "num_speculative_tokens": 3}}


def _start(kind: str, cache_dir: str) -> tuple[float, int]:
    """Seconds to start one engine of `kind`, and its executables (then it is dropped)."""
    started = time.perf_counter()
    llm = LLM(show_progress=False, compilation_cache_dir=cache_dir,
              speculative_config=KINDS[kind])
    seconds = time.perf_counter() - started
    count = llm.stats()["num_compiles"]
    del llm
    gc.collect()
    return seconds, count


def measure(kind: str, rounds: int, cache_dir: str) -> dict:
    SHARED.limit = 0
    SHARED.clear()
    first, count = _start(kind, cache_dir)  # fills the persistent cache
    unshared, shared = [], []
    for _ in range(rounds):
        SHARED.limit = 0
        SHARED.clear()
        unshared.append(_start(kind, cache_dir)[0])
        SHARED.limit = DEFAULT_LIMIT
        _start(kind, cache_dir)  # its executables stay shared
        shared.append(_start(kind, cache_dir)[0])
    SHARED.clear()
    return {"executables": count, "first_start_s": first,
            "unshared_s": statistics.median(unshared), "shared_s": statistics.median(shared),
            "shared_over_unshared": statistics.median(shared) / statistics.median(unshared)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--compilation-cache-dir", default="default",
                        help="XLA's persistent cache (default: ~/.cache/qwen-jax's)")
    args = parser.parse_args()
    report = {kind: measure(kind, args.rounds, args.compilation_cache_dir)
              for kind in args.kinds}
    print(json.dumps({"rounds": args.rounds, "results": report}, indent=2))


if __name__ == "__main__":
    main()
