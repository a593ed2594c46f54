"""Decode throughput with and without a JSON-schema constraint, at 1 and 16 concurrent
requests, on one engine. Prints one JSON object.

    python benchmarks/structured.py [--model DIR] [--tokenizer DIR] [--repeats 3]

Each round submits `concurrency` requests at once through `LLM.generate` (prompts of 8
tokens, `max_tokens` 64, temperature 1, seeded), once free and once under a schema whose
string fields are long enough that replies run to `max_tokens`, so both modes generate the
same number of tokens; the constrained mode pays llguidance's mask fill on the host, the
mask's transfer and its application in the sampler. Rounds alternate modes; the median of
`--repeats` is reported. The vocabulary size sets the mask's cost: use a checkpoint with
Qwen3's tokenizer (151,936 ids) to see it at full size.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "bio"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                         "bio": {"type": "string", "minLength": 400, "maxLength": 800}}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "qwen_jax/assets/tiny-qwen3-moe"))
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: model's)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compilation-cache-dir", default="default")
    return p.parse_args(argv)


def make_llm(args):
    from qwen_jax import LLM
    return LLM(args.model, tokenizer=args.tokenizer, load_format=args.load_format,
               max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256,
               token_buckets=[16, 128], seq_buckets=[1, 16], show_progress=False,
               compilation_cache_dir=args.compilation_cache_dir)


def run_round(llm, prompt_ids, concurrency: int, max_tokens: int, schema) -> tuple[float, int]:
    """(seconds, generated tokens) of `concurrency` requests submitted at once."""
    from qwen_jax import SamplingParams
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=None if schema is None else {"json": schema})
              for i in range(concurrency)]
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * concurrency, params)
    seconds = time.perf_counter() - started
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(llm, prompt_ids, concurrency: int, args) -> dict:
    run_round(llm, prompt_ids, concurrency, 4, None)  # warm: buckets, llguidance tokenizer
    run_round(llm, prompt_ids, concurrency, 4, SCHEMA)
    rates = {"free": [], "json": []}
    tokens = {}
    for _ in range(args.repeats):
        for mode, schema in (("free", None), ("json", SCHEMA)):
            seconds, num = run_round(llm, prompt_ids, concurrency, args.max_tokens, schema)
            rates[mode].append(num / seconds)
            tokens[mode] = num
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["json"])
    steps = args.max_tokens  # every request runs to max_tokens: one token per step each
    return {"concurrency": concurrency, "tokens": tokens,
            "free_tok_s": round(free, 1), "json_tok_s": round(constrained, 1),
            "json_over_free": round(constrained / free, 3),
            "overhead_ms_per_step": round(1e3 * (tokens["json"] / constrained
                                                 - tokens["free"] / free) / steps, 2),
            "free_rates": [round(r, 1) for r in rates["free"]],
            "json_rates": [round(r, 1) for r in rates["json"]]}


def main(argv=None) -> None:
    args = parse_args(argv)
    llm = make_llm(args)
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode("Write a short JSON description of a person:")[:8]
    results = [measure(llm, prompt_ids, int(c), args) for c in args.concurrency.split(",")]
    print(json.dumps({"model": args.model, "tokenizer": args.tokenizer or args.model,
                      "vocab_size": llm.llm_engine.model_config.vocab_size,
                      "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
