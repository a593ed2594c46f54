"""StableHLO op counts of the serving step lowered for CUDA (no GPU needed), per layer
and per step, one JSON line per bucket as soon as it is counted, then the sampler alone.

    python benchmarks/step_ops.py [--model qwen3-30b-a3b] [--buckets 8x4,64x64,2048x64]
        [--impl pallas] [--kv-cache-dtype auto]

Abstract params at the model's real shapes: nothing is allocated. "Heavy" ops are the
ones that cost a kernel launch or a loop on a GPU (serving/executor/step_lowering.py, HEAVY_OPS);
`per_step_heavy` counts each layer body once per layer.
"""

import argparse
import json
import sys

from serving.executor import step_lowering


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--buckets", default="8x4,64x64,2048x64",
                        help="(tokens)x(sequences) pairs, comma separated")
    parser.add_argument("--impl", default="pallas", choices=["pallas", "reference"])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1280)
    args = parser.parse_args(argv)
    runner = step_lowering.abstract_runner(args.model, impl=args.impl,
                                      kv_cache_dtype=args.kv_cache_dtype,
                                      max_model_len=args.max_model_len)
    buckets = [tuple(int(n) for n in b.split("x")) for b in args.buckets.split(",")]
    for bucket in buckets:
        print(json.dumps({"model": args.model, "impl": args.impl,
                          "kv_cache_dtype": args.kv_cache_dtype,
                          **step_lowering.summary(runner, bucket)}), flush=True)
    vocab = runner.state["embed_tokens"].shape[0]
    for num_seqs in sorted({s for _, s in buckets}):
        print(json.dumps({"sampler": step_lowering.sampler_summary(num_seqs, vocab,
                                                              args.max_model_len)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
