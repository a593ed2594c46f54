"""Padding waste of token-bucket sets, from the real scheduler (no model, no jax).

Drives `serving.core.scheduler.Scheduler` over offline workloads (a fixed number of requests in
flight, refilled as they finish), records every step's (tokens, sequences), and reports
for each bucket set the share of padded token rows: over all steps, over mixed steps
(prefill chunks, more tokens than sequences), and the compile count (bucket pairs).

    python benchmarks/bucket_waste.py [--max-num-batched-tokens 2048] [--max-num-seqs 64]
"""

import argparse
import json
import random
import sys

from serving.core.buckets import (
    MIN_SEQ_BUCKET,
    bucket_pairs,
    make_buckets,
    make_token_buckets,
    pick_bucket,
)
from serving.core.config import SchedulerConfig
from serving.core.kv_cache_manager import KVCacheManager
from serving.core.request import Request, RequestStatus, SamplingParams
from serving.core.scheduler import Scheduler


def simulate(prompt_lens, output_lens, *, in_flight, max_num_seqs, max_tokens, max_model_len):
    """[(tokens, sequences)] of every step of the workload."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                             max_model_len=max_model_len)
    pages = 1 + max_num_seqs * -(-max_model_len // 16)
    scheduler = Scheduler(config, KVCacheManager(pages, 16, enable_prefix_caching=False))
    todo = list(zip(prompt_lens, output_lens))
    steps = []

    def refill():
        while todo and scheduler.num_unfinished < in_flight:
            n_in, n_out = todo.pop()
            params = SamplingParams(max_tokens=n_out, ignore_eos=True)
            scheduler.add_request(Request(request_id=str(len(todo)),
                                          prompt_token_ids=[1] * n_in, sampling_params=params))
    refill()
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        steps.append((out.num_batched_tokens, out.num_seqs))
        scheduler.update_after_step(out)
        for seq in out.scheduled:
            if seq.samples:
                seq.request.append_output_token(1)
                if seq.request.num_output_tokens >= seq.request.sampling_params.max_tokens:
                    scheduler.finish(seq.request.request_id, RequestStatus.FINISHED_LENGTH_CAPPED)
        refill()
    return steps


def waste(steps, token_buckets):
    """Padded share of the token rows run, over all steps and over mixed steps."""
    def share(rows):
        padded = sum(pick_bucket(t, token_buckets) for t, _ in rows)
        return round(1 - sum(t for t, _ in rows) / padded, 3) if rows else None
    return {"all_steps": share(steps), "mixed_steps": share([s for s in steps if s[0] > s[1]])}


def workloads(seed=0):
    rng = random.Random(seed)
    fixed = lambda n: ([1024] * n, [128] * n)
    mixed = ([rng.randint(32, 1152) for _ in range(256)],
             [rng.randint(16, 128) for _ in range(256)])
    return {"1024in_128out_c1": (*fixed(4), 1), "1024in_128out_c8": (*fixed(32), 8),
            "1024in_128out_c64": (*fixed(256), 64), "mixed_32-1152in_16-128out_c32": (*mixed, 32)}


def candidate_sets(limit):
    """Bucket sets to compare; compile counts use today's pairing (one sequence bucket
    from 256 tokens on), so the old default's 39 compiles show here as its pairs."""
    return {"8,64,limit": [8, 64, limit], "powers_of_two": make_buckets(limit, minimum=8),
            "default (make_token_buckets)": make_token_buckets(limit)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1280)
    args = parser.parse_args(argv)
    seq_buckets = make_buckets(args.max_num_seqs, minimum=MIN_SEQ_BUCKET)
    steps = {name: simulate(p, o, in_flight=c, max_num_seqs=args.max_num_seqs,
                            max_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len)
             for name, (p, o, c) in workloads().items()}
    for name, buckets in candidate_sets(args.max_num_batched_tokens).items():
        row = {"buckets": name, "token_buckets": list(buckets),
               "compiles": len(bucket_pairs(buckets, seq_buckets)),
               **{w: waste(s, buckets) for w, s in steps.items()}}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
