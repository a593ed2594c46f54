"""Data-parallel routing on the tiny model: two replicas behind one `DPAsyncLLM` (the client
`qwen-jax serve --data-parallel-size 2` runs), fresh for each policy, the same requests
through each. Workloads: `groups` (8 groups of 8 requests, each group sharing a 6-page
prefix, like per-tenant system prompts, arriving shuffled; 2, 8 and 32 in flight) and `hot` (half
the requests share one prefix, the rest are spread over 8 groups). Reports, per policy,
the prefix cache hit rate over both replicas (hit tokens / prompt tokens looked up) and
the requests each replica took; on this CPU the replicas share 2 cores, so no speeds.
Prints one JSON object.

    PYTHONPATH=. python benchmarks/dp_routing.py [--policies prefix round_robin least_loaded]
        [--in-flight 2 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from serving.core.replica_router import ROUTING_POLICIES  # noqa: E402
from serving.core.request import SamplingParams  # noqa: E402
from serving.engine.data_parallel import DPAsyncLLM  # noqa: E402

ENGINE = dict(show_progress=False, precompile=False, max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=256, token_buckets=[16, 256], seq_buckets=[8])
PAGE = 16


def workload(name: str, rng: random.Random) -> list[list[int]]:
    """Prompt token ids (the embedded model has 896): a group's prefix (6 pages) and a
    suffix of its own (5 tokens)."""
    prefixes = [[rng.randrange(10, 800) for _ in range(6 * PAGE)] for _ in range(9)]
    if name == "groups":
        groups = [g for g in range(8) for _ in range(8)]
    else:  # hot: prefix 8 takes half
        groups = [8] * 32 + [g for g in range(8) for _ in range(4)]
    rng.shuffle(groups)
    return [prefixes[g] + [rng.randrange(10, 800) for _ in range(5)] for g in groups]


async def drive(llm: DPAsyncLLM, prompts: list[list[int]], in_flight: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, ids: list[int]) -> None:
        async with gate:
            async for _ in llm.generate({"prompt_token_ids": ids}, params, f"r{i}"):
                pass

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


def measure(policy: str, workloads: dict[tuple[str, int], list[list[int]]]) -> dict:
    """{"<workload> x<in flight>": hit rate and requests per replica}, on fresh replicas."""
    llm = DPAsyncLLM(None, data_parallel_size=2, data_parallel_routing=policy, **ENGINE)
    try:
        result = {}
        for (name, in_flight), prompts in workloads.items():
            before = [s for _, _, s in llm.replica_stats()]
            routed = list(llm.router.num_routed)
            asyncio.run(drive(llm, prompts, in_flight))
            after = [s for _, _, s in llm.replica_stats()]
            hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"]
                       for a, b in zip(after, before))
            queries = sum(a["prefix_cache_queries"] - b["prefix_cache_queries"]
                          for a, b in zip(after, before))
            result[f"{name} x{in_flight}"] = {"prefix_hit_rate": round(hits / queries, 3),
                            "requests_per_replica": [n - r for n, r in
                                                     zip(llm.router.num_routed, routed)]}
        return result
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES),
                        choices=ROUTING_POLICIES)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workloads = {(name, n): workload(name, rng) for n in args.in_flight
                 for name in ("groups", "hot")}  # prefixes of their own: nothing carries over
    results = {policy: measure(policy, workloads) for policy in args.policies}
    print(json.dumps({"replicas": 2, "in_flight": args.in_flight, "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
