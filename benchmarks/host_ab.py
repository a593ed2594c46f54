"""Host cost per engine step of two checkouts, measured in alternation. Prints JSON.

On a shared, noisy machine two benchmark runs one after the other differ by up to 2x, more
than most host-side changes are worth. Here two worker processes, one per checkout, each
build the same decoding engine (`engine_overlap.decoding_engine`: N running decodes, an
instant fake device) and then take turns: the first runs K steps while the second waits,
then the second, for R rounds, the order swapped every round. Both see the same machine
at nearly the same time, so the ratio of each round's medians (after / before) is steady
where the absolute figures are not. The harness code (this file and engine_overlap.py)
is this checkout's for both sides; only `serving` comes from each checkout.

    git worktree add /tmp/before <rev>
    PYTHONPATH=. python benchmarks/host_ab.py --before /tmp/before --seqs 256
    PYTHONPATH=. python benchmarks/host_ab.py --before /tmp/before --seqs 256 --serial
    PYTHONPATH=. python benchmarks/host_ab.py --before /tmp/before --seqs 256 --final-only

`--output-kind` sets what the streamed requests' outputs hold on both sides (a checkout
from before `SamplingParams.output_kind` takes only CUMULATIVE); `--before-output-kind`
overrides it on the before side, so `--before .` compares two kinds on one checkout:

    PYTHONPATH=. python benchmarks/host_ab.py --before . --before-output-kind CUMULATIVE \
        --output-kind DELTA
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("CUMULATIVE", "DELTA")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", help="the other checkout's root (required)")
    p.add_argument("--after", default=str(HERE.parent), help="default: this checkout")
    p.add_argument("--seqs", type=int, default=256, help="running decode sequences")
    p.add_argument("--serial", action="store_true", help="the serial loop (default overlapped)")
    p.add_argument("--final-only", action="store_true",
                   help="requests return only their final output (default: a stream)")
    p.add_argument("--output-kind", default="CUMULATIVE", choices=KINDS,
                   help="what each streamed output holds (SamplingParams.output_kind)")
    p.add_argument("--before-output-kind", default=None, choices=KINDS,
                   help="the before side's --output-kind (default: the same)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps-per-turn", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    """In a checkout's root: build the engine, then run a turn per line read."""
    sys.path.insert(0, os.getcwd())
    spec = importlib.util.spec_from_file_location("engine_overlap", HERE / "engine_overlap.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    steps = args.rounds * args.steps_per_turn
    engine = bench.decoding_engine(None, args.seqs, steps // 3 + 8, not args.serial, "default",
                                   stream=not args.final_only, output_kind=args.output_kind)
    engine.runner.dispatch = bench.FakeDevice(0.0).dispatch
    for _ in range(5):
        engine.step()
    print("ready", flush=True)
    for _ in sys.stdin:
        walls, cpus = [], []
        for _ in range(args.steps_per_turn):
            t, c = time.perf_counter(), time.thread_time()
            engine.step()
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
        print(json.dumps([1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)]),
              flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if not args.before:
        raise SystemExit("--before: the other checkout's root is required")
    sides = {"before": args.before, "after": args.after}
    env = dict(os.environ, PYTHONPATH=".", JAX_PLATFORMS="cpu")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--seqs", str(args.seqs), "--rounds", str(args.rounds),
               "--steps-per-turn", str(args.steps_per_turn)]
    command += ["--serial"] * args.serial + ["--final-only"] * args.final_only
    workers = {}
    kinds = {"before": args.before_output_kind or args.output_kind, "after": args.output_kind}
    for name, root in sides.items():  # one at a time: start-up is not measured
        workers[name] = subprocess.Popen(command + ["--output-kind", kinds[name]], cwd=root,
                                         env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if workers[name].stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} worker ({root}) did not start")
    turns: dict[str, list] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            workers[name].stdin.write("go\n")
            workers[name].stdin.flush()
            turns[name].append(json.loads(workers[name].stdout.readline()))
    for w in workers.values():
        w.stdin.close()
        w.wait()

    def quartiles(values):
        return [round(v, 3) for v in statistics.quantiles(values, n=4)]

    before, after = turns["before"], turns["after"]
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "ms_per_step": {name: {"median": round(statistics.median(t[0] for t in turns[name]), 3),
                               "min": round(min(t[0] for t in turns[name]), 3)}
                        for name in sides},
        "after_over_before_wall": quartiles([a[0] / b[0] for a, b in zip(after, before)]),
        "after_over_before_cpu": quartiles([a[1] / b[1] for a, b in zip(after, before)]),
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
