"""XLA's compile time for the step of the embedded tiny model, under each of several
XLA_FLAGS settings, side by side. Prints one JSON object.

XLA reads XLA_FLAGS once, when its backend starts, so each setting runs in a child process
of this script; the settings take turns for `--rounds` rounds (the machine's drifts fall on
all of them). In each child: an engine with no compile at start-up, its buckets' steps
traced and lowered, then compiled one after the other on one thread (none from the
persistent cache). Reported per setting: the median over rounds of the buckets' summed
compile seconds, and each bucket's StableHLO lines and compiled fusions (from the last
round).

    PYTHONPATH=. python benchmarks/step_compile.py [--rounds 2]
        [--flags "" "--xla_cpu_use_fusion_emitters=false"]

A flag XLA does not know stops the child (jaxlib 0.11 removed
--xla_cpu_use_fusion_emitters): its setting reports the error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUCKETS = ((8, 4), (8, 8), (64, 4), (64, 8))


def child() -> dict:
    """One round under this process's XLA_FLAGS."""
    import jax

    from qwen_jax import LLM
    llm = LLM(show_progress=False, compilation_cache_dir=None, precompile=False,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
              token_buckets=[8, 64], seq_buckets=[4, 8])
    runner = llm.llm_engine.runner
    rows = []
    for bucket in BUCKETS:
        lowered = runner._step.lower(runner.state, runner.kv_caches,
                                     *runner._abstract_args(bucket))
        started = time.perf_counter()
        executable = lowered.compile()
        seconds = time.perf_counter() - started
        rows.append({"bucket": list(bucket), "compile_s": round(seconds, 2),
                     "stablehlo_lines": lowered.as_text().count("\n"),
                     "fusions": executable.as_text().count(" fusion(")})
    return {"jax": jax.__version__, "buckets": rows,
            "compile_s": round(sum(r["compile_s"] for r in rows), 2)}


def run_child(flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flags", nargs="+", default=["", "--xla_cpu_use_fusion_emitters=false"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    runs: dict[str, list[dict]] = {flags: [] for flags in args.flags}
    for _ in range(args.rounds):
        for flags in args.flags:
            runs[flags].append(run_child(flags))
    settings = []
    for flags, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            settings.append({"xla_flags": flags, "error": results[0]["error"]})
            continue
        settings.append({"xla_flags": flags, "jax": ok[0]["jax"],
                         "compile_s_median": round(statistics.median(
                             r["compile_s"] for r in ok), 2),
                         "compile_s": [r["compile_s"] for r in ok],
                         "buckets": ok[-1]["buckets"]})
    base = settings[0].get("compile_s_median")
    for setting in settings:
        if base and "compile_s_median" in setting:
            setting["over_first"] = round(setting["compile_s_median"] / base, 2)
    print(json.dumps({"rounds": args.rounds, "settings": settings}, indent=1))


if __name__ == "__main__":
    main()
