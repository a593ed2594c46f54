"""Speculative decoding on the tiny model, side by side in one process. Prints one JSON
object.

For each workload and batch size, the same requests through an engine without
speculation (overlapped loop, the default, and serial: speculation steps serially) and
with n-gram drafts (`--k` draft tokens at most, prompt lookup 1..3), the embedded
model's shipped draft model (`draft`, two dense layers of half the width) or its shipped
EAGLE-3 head (`eagle3`, one layer fed the target's hidden states), the draft
length chosen per sequence and step (the default) or always all proposed (`*_fixed`;
for the draft model and the head also `*_host`: fixed, the host waiting for each
proposal's drafts before it builds the verify step, where by default they stay on the
device):
output tokens/s (median of `--rounds` rounds after a warm-up one; in each round the engines
take turns batch by batch; every bucket compiled at start-up, as when serving), the ratios,
the mean acceptance length (1 + kept drafts per verify step, vLLM's), drafts per verify
step, the share of engine steps that speculated (the adaptive switch's choice), the experts
a MoE layer is expected to read per step (uniform routing, serving/metrics/step_cost.py)
with and without drafts, and whether every text is the same.
Workloads: `tasks` (the tiny model's four tasks, greedy: short answers after long
prompts), `repeat` (its copy task only), `continue` (the four tasks with `ignore_eos` and
128 tokens: past its answer the model goes on with digits and tags it was never trained
to write, so decoding dominates and drafts fail more) and `sampled` (`continue` at
temperature 0.8, seeded). Batch 1 runs the requests one at a time; batch 8 eight at once.

    PYTHONPATH=. python benchmarks/speculative.py [--k 3] [--rounds 3] [--out FILE]
        [--methods ngram draft eagle3]
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
from serving.metrics.step_cost import expected_experts_touched  # noqa: E402

METHODS = {"ngram": "ngram", "draft": "draft_model", "eagle3": "eagle3"}  # engine: method
WORKLOADS = {  # name: (tasks, sampling parameters)
    "tasks": (tasks.TASKS, dict(temperature=0, max_tokens=64)),
    "repeat": (("copy",), dict(temperature=0, max_tokens=64)),
    "continue": (tasks.TASKS, dict(temperature=0, max_tokens=128, ignore_eos=True)),
    "sampled": (tasks.TASKS, dict(temperature=0.8, seed=3, max_tokens=128, ignore_eos=True)),
}


def _prompts(task_names, count: int) -> list[str]:
    per_task = -(-count // len(task_names))
    problems = [p for t in task_names for p in tasks.problems(t, per_task, seed=17)]
    return render_prompts(problems[:count], chat_template(TINY_MODEL))


def _run(llm, prompts, params) -> tuple[float, int, list[str]]:
    """One `generate` call: (seconds, output tokens, texts)."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return (seconds, sum(len(o.outputs[0].token_ids) for o in outputs),
            [o.outputs[0].text for o in outputs])


def _spec_counts(llm) -> tuple[int, ...]:
    """Verify steps, draft tokens, kept drafts, engine steps begun speculating and not."""
    stats = llm.stats()
    speculator = llm.llm_engine.speculator
    return (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"],
            0 if speculator is None else speculator.num_steps[True],
            0 if speculator is None else speculator.num_steps[False])


def _experts(llm, tokens: float) -> float:
    config = llm.llm_engine.model_config
    return expected_experts_touched(round(tokens), config.num_experts, config.num_experts_per_tok)


def compare(workload: str, batch: int, engines: dict, rounds: int) -> dict:
    """Each round runs every batch of `batch` prompts through each engine in turn (the
    order rotating from batch to batch), so the machine's drifts in speed, which on
    these shared machines move a whole engine's run by 30%, fall on all of them alike;
    an engine's rate in a round: its tokens over its seconds."""
    task_names, sampling = WORKLOADS[workload]
    prompts = _prompts(task_names, 8 if batch == 1 else 16)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    params = SamplingParams(**sampling)
    names = list(engines)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    texts: dict[str, list[str]] = {name: [] for name in engines}
    counts = {name: [0] * 5 for name in engines}
    for llm in engines.values():  # warm-up
        for chunk in batches:
            _run(llm, chunk, params)
    for _ in range(rounds):
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for i, chunk in enumerate(batches):
            for name in names[i % len(names):] + names[:i % len(names)]:
                llm = engines[name]
                before = _spec_counts(llm)
                took, made, out = _run(llm, chunk, params)
                seconds[name] += took
                tokens[name] += made
                texts[name] += out
                for j, (a, b) in enumerate(zip(before, _spec_counts(llm))):
                    counts[name][j] += b - a
        for name in names:
            rates[name].append(tokens[name] / seconds[name])
    median = {name: statistics.median(r) for name, r in rates.items()}
    row = {"workload": workload, "batch": batch, "output_tokens_per_s": median}
    for name in [n for n in engines if not n.startswith("none")]:
        steps, drafted, kept, speculating, plain = counts[name]
        per_step = drafted / steps if steps else 0.0
        row[name] = {"over_none": median[name] / median["none"],
                     "over_none_serial": median[name] / median["none_serial"],
                     "mean_acceptance_length": 1 + kept / steps if steps else None,
                     "drafts_per_verify_step": per_step,
                     # the adaptive switch's choice: the share of engine steps speculating
                     "speculating_steps": speculating / max(speculating + plain, 1),
                     "experts_per_layer_step": _experts(engines[name], batch * (1 + per_step)),
                     "same_texts": texts[name] == texts["none"]}
    row["experts_per_layer_step_none"] = _experts(engines["none"], batch)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    # every bucket compiled at start-up; few of them: ten engines share this process (an
    # executable maps ~700 regions on CPU, a process may map 65,530; engines of the same
    # shapes share their executables). A step's rows (a
    # sequence's, one per draft) fit max_num_seqs: 32 for 8 sequences and 3 drafts each.
    common = dict(model=str(TINY_MODEL), show_progress=False, enable_prefix_caching=False,
                  max_num_seqs=32, max_num_batched_tokens=512, token_buckets=[16, 64, 512],
                  seq_buckets=[8, 32])
    engines = {"none": LLM(**common), "none_serial": LLM(**common, async_scheduling=False)}
    for name in args.methods:  # the draft model and the head: the embedded model's own
        config = spec if name == "ngram" else {"method": METHODS[name],
                                               "num_speculative_tokens": args.k}
        engines[name] = LLM(**common, speculative_config=config)
        engines[f"{name}_fixed"] = LLM(**common, speculative_config={
            **config, "adaptive_draft_length": False})
        if name != "ngram":
            engines[f"{name}_host"] = LLM(**common, speculative_config={
                **config, "adaptive_draft_length": False})
            engines[f"{name}_host"].llm_engine.speculator.keep_drafts_on_device = False
    rows = [compare(w, b, engines, args.rounds) for w in args.workloads for b in args.batches]
    report = {"k": args.k, "rounds": args.rounds, "results": rows}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
