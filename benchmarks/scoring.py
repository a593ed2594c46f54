"""Prompt scoring (echo-only requests: every prompt token's logprob, one token made, as
evaluation harnesses ask) against plain prefill of the same prompts, side by side in one
process on the tiny model. Prints one JSON object: prompt tokens/s of each (median of
`--rounds` alternating rounds after a warm-up), and their ratio.

Scoring runs the same continuous batch; a step that scores R prompt rows also computes
their logits and log-softmax (R x vocab) and their top tokens, and its prefill skips the
prefix cache (off here for both, so the work is the same apart from that).

    PYTHONPATH=. python benchmarks/scoring.py [--rounds 5] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from qwen_jax import LLM, SamplingParams, tasks  # noqa: E402
from serving.bench.eval_tasks import TINY_MODEL, chat_template, render_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()
    problems = [p for t in tasks.TASKS
                for p in tasks.problems(t, args.num_prompts // len(tasks.TASKS), seed=41)]
    prompts = render_prompts(problems, chat_template(TINY_MODEL))
    llm = LLM(model=str(TINY_MODEL), show_progress=False, enable_prefix_caching=False,
              max_num_seqs=16, max_num_batched_tokens=512, token_buckets=[16, 64, 512],
              seq_buckets=[4, 16])
    kinds = {"prefill": SamplingParams(temperature=0, max_tokens=1),
             "scoring": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)}
    num_tokens = sum(len(o.prompt_token_ids) for o in llm.generate(prompts, kinds["prefill"]))
    for params in kinds.values():  # warm-up: the scoring steps compile here
        llm.generate(prompts, params)
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, params in kinds.items():
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            rates[kind].append(num_tokens / (time.perf_counter() - started))
            if kind == "scoring":
                assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outputs)
    median = {kind: statistics.median(r) for kind, r in rates.items()}
    print(json.dumps({"num_prompts": len(prompts), "prompt_tokens": num_tokens,
                      "rounds": args.rounds, "prompt_tokens_per_s": median,
                      "scoring_over_prefill": median["scoring"] / median["prefill"],
                      "all_rounds": rates}, indent=2))


if __name__ == "__main__":
    main()
