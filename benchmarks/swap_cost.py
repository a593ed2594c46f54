"""KV swap on this machine's device: page copies to pinned host memory and back, and
preemption by swap vs by recompute with identical greedy outputs. Prints one JSON object.

    PYTHONPATH=. python benchmarks/swap_cost.py [--model DIR] [--out FILE]

1. `copies`: with the engine's own cache, `--pages` pages copied to the host and back
   (`SwapStore.save` / `load`, blocked on), GB/s each way, and the memory kind the
   host copies live in (`pinned_host`).
2. `preemption`: the same long prompts through `LLM` with a KV pool too small for them,
   once with `swap_space=0` (recompute) and once with swap (`swap_min_tokens=0`):
   seconds, preemptions, swaps, recomputed tokens, and whether the greedy tokens match
   a run with a pool large enough never to preempt.
Runs anywhere (CPU: the same code path as plain copies); written for a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from qwen_jax import LLM, SamplingParams

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "qwen_jax" / "assets" / "tiny-qwen3-moe"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--load-format", default="auto")
    p.add_argument("--out")
    p.add_argument("--pages", default="1,8,64", help="page counts of the copy timings")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--small-pool", type=int, default=101, help="pages of the preempting runs")
    return p.parse_args(argv)


def engine_args(args, **extra) -> dict:
    return dict(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                token_buckets=[16, 64, 512], seq_buckets=[8], show_progress=False,
                load_format=args.load_format, enable_prefix_caching=False, **extra)


def time_copies(llm: LLM, counts: list[int]) -> dict:
    engine = llm.llm_engine
    store, runner = engine.swap_store, engine.runner
    out = {"bytes_per_page": engine.bytes_per_page}
    for n in counts:
        pages = list(range(1, n + 1))
        host = list(range(n))
        runner.copy_pages_to_host(store, pages, host)  # warm
        runner.copy_pages_from_host(store, host, pages)
        start = time.perf_counter()
        runner.copy_pages_to_host(store, pages, host)
        jax.block_until_ready(store.host_arrays())
        mid = time.perf_counter()
        kinds = sorted({x.sharding.memory_kind for x in store.host_arrays()})
        runner.copy_pages_from_host(store, host, pages)
        jax.block_until_ready(runner.kv_caches)
        end = time.perf_counter()
        gb = n * engine.bytes_per_page / 1e9
        out[f"{n}_pages"] = {"to_host_ms": round(1e3 * (mid - start), 3),
                             "to_device_ms": round(1e3 * (end - mid), 3),
                             "to_host_gb_s": round(gb / (mid - start), 3),
                             "to_device_gb_s": round(gb / (end - mid), 3),
                             "host_memory_kinds": kinds}
    return out


def generate(args, prompts, **extra) -> tuple[list, dict, float]:
    llm = LLM(args.model, **engine_args(args, **extra))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outs], llm.stats(), seconds


def preemption(args) -> dict:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 600, size=args.prompt_len).tolist()}
               for _ in range(args.num_prompts)]
    reference, _, _ = generate(args, prompts)
    out = {}
    for mode, extra in (("recompute", {}), ("swap", dict(swap_space=1, swap_min_tokens=0))):
        ids, stats, seconds = generate(args, prompts, num_gpu_blocks_override=args.small_pool,
                                       **extra)
        out[mode] = {"seconds": round(seconds, 3), "greedy_tokens_match": ids == reference,
                     **{k: stats[k] for k in ("num_preemptions", "num_swap_outs",
                                              "num_swap_ins", "num_recomputed_tokens")}}
    out["swap_vs_recompute_seconds"] = round(out["swap"]["seconds"]
                                             / out["recompute"]["seconds"], 3)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
              "model": args.model}
    llm = LLM(args.model, **engine_args(args, swap_space=1))
    result["copies"] = time_copies(llm, [int(n) for n in args.pages.split(",")])
    del llm
    result["preemption"] = preemption(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = all(result["preemption"][m]["greedy_tokens_match"] for m in ("recompute", "swap"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
