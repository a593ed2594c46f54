"""Speculative decoding on the tiny model, side by side in one process. Prints one JSON
object.

For each workload and batch size, the same greedy requests through an engine without
speculation (overlapped loop, the default, and serial: speculation steps serially) and
one with n-gram drafts (`--k` draft tokens, prompt lookup 1..3): output
tokens/s (median of `--rounds` alternating rounds, after a warm-up round that compiles),
the ratio, the mean acceptance length (1 + kept drafts per verify step, vLLM's), and
whether every text is the same. Workloads: `tasks` (the tiny model's four tasks, whose
answers partly copy their prompts) and `repeat` (its copy task only: outputs that repeat
the prompt, as edit-this-text requests do). Batch 1 runs the requests one at a time;
batch 8 eight at once.

    PYTHONPATH=. python benchmarks/speculative.py [--k 3] [--rounds 3] [--out FILE]
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

WORKLOADS = {"tasks": tasks.TASKS, "repeat": ("copy",)}


def _prompts(task_names, count: int) -> list[str]:
    per_task = -(-count // len(task_names))
    problems = [p for t in task_names for p in tasks.problems(t, per_task, seed=17)]
    return render_prompts(problems[:count], chat_template(TINY_MODEL))


def _run(llm, prompts, batch: int, params) -> tuple[float, int, list[str]]:
    started = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return (seconds, sum(len(o.outputs[0].token_ids) for o in outputs),
            [o.outputs[0].text for o in outputs])


def compare(workload: str, batch: int, engines: dict, rounds: int) -> dict:
    prompts = _prompts(WORKLOADS[workload], 8 if batch == 1 else 16)
    params = SamplingParams(temperature=0, max_tokens=64)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    texts: dict[str, list[str]] = {}
    accepted = {}
    for llm in engines.values():  # warm-up: compiles this batch's buckets
        _run(llm, prompts, batch, params)
    for _ in range(rounds):
        for name, llm in engines.items():
            before = llm.stats()
            seconds, tokens, texts[name] = _run(llm, prompts, batch, params)
            rates[name].append(tokens / seconds)
            after = llm.stats()
            drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            kept = (after["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"])
            accepted[name] = 1 + kept / drafts if drafts else None
    median = {name: statistics.median(r) for name, r in rates.items()}
    return {"workload": workload, "batch": batch,
            "output_tokens_per_s": median,
            "ngram_over_none": median["ngram"] / median["none"],
            "ngram_over_none_serial": median["ngram"] / median["none_serial"],
            "mean_acceptance_length": accepted["ngram"],
            "same_texts": texts["ngram"] == texts["none"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    common = dict(model=str(TINY_MODEL), precompile=False, show_progress=False,
                  enable_prefix_caching=False)
    engines = {"none": LLM(**common), "none_serial": LLM(**common, async_scheduling=False),
               "ngram": LLM(**common, speculative_config=spec)}
    rows = [compare(w, b, engines, args.rounds) for w in WORKLOADS for b in args.batches]
    report = {"k": args.k, "rounds": args.rounds, "results": rows}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
