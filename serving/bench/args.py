"""Arguments of `qwen-jax bench serve | throughput` (vLLM's names) and `qwen-jax eval`. No
jax, so `--help` stays fast."""

from __future__ import annotations

import argparse

from qwen_jax.options import QUANTIZATION_METHODS
from qwen_jax.tasks import ALL_TASKS


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="model name sent in each request")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory: exact random prompt lengths (default: random words)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", default="random", dest="dataset",
                   choices=("random", "shared-prefix", "jsonl"))
    d.add_argument("--dataset-path", default=None, help="JSONL of {prompt} or {messages}")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128,
                   help="output tokens (also for shared-prefix and jsonl lines without one)")
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--shared-prefix-len", type=int, default=1024)
    d.add_argument("--num-prefix-groups", type=int, default=4)
    d.add_argument("--suffix-len", type=int, default=64)
    d.add_argument("--token-ids", action="store_true",
                   help="send random prompts as token ids (completions; exact lengths, no "
                        "tokenizer needed, e.g. for a dummy-weight preset)")
    d.add_argument("--random-vocab-size", type=int, default=10000,
                   help="with --token-ids and no --tokenizer: ids are drawn below this")
    d.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests/s (Poisson arrivals); inf sends all at once")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly the output length (vLLM's ignore_eos)")
    t.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed test request sent first")
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    r.add_argument("--metric-percentiles", default="90,99")
    r.add_argument("--result-json", default=None)
    r.add_argument("--save-detailed", action="store_true",
                   help="add per-request lengths, send times and latencies to the JSON")
    r.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between samples of the server's /metrics (running and "
                        "waiting requests) kept in the JSON's timeline; 0: none")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TTFT and ITL distributions, throughput and running/waiting "
                        "requests over the run (needs matplotlib: the plot extra)")
    r.add_argument("--plot-results", nargs="+", default=None, metavar="RESULT.json",
                   help="with --plot: draw these result files side by side instead of "
                        "running a benchmark (saved with --save-detailed or --plot)")
    r.add_argument("--plot-labels", nargs="+", default=None, metavar="LABEL",
                   help="a label per --plot-results file (default: the file names)")


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_false", dest="progress")


EVAL_DESCRIPTION = "Exact-match accuracy on held-out generated tasks"


def add_eval_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=int, default=500, help="problems per task")
    ap.add_argument("--model", default=None, 
                    help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default=",".join(ALL_TASKS))
    ap.add_argument("--one-at-a-time", action="store_true", help="one request per generate()")
    ap.add_argument("--passes", type=int, default=1,
                    help="evaluate N times on one engine (with prefix caching, later passes "
                         "hit the cache); prints each pass")
    for name in ("max-num-seqs", "max-num-batched-tokens", "max-model-len", "block-size",
                 "num-gpu-blocks-override"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                    help="fp8 | int8: quantise the model at load (fp8 / AWQ checkpoints load "
                         "quantised without it)")
