"""Scheduling for mixed traffic, through the server, in one run. Prints one JSON object.

    PYTHONPATH=. python benchmarks/scheduling.py [--model DIR] [--out FILE]

1. Mixed workload: `--long-fraction` (20%) of prompts of about `--long-len` tokens, the
   rest about `--short-len`, `--output-len` tokens each (greedy, `ignore_eos`). One
   `qwen-jax serve` per policy (fcfs, priority, length-aware with its defaults; same
   engine options), all started first. Capacity is measured on the fcfs server (the
   whole mix sent at once, requests/s); then the same requests arrive as a Poisson
   process at `--load` (80%) of it, against each server in turn, for `--rounds` rounds
   (the order reversed every other round, so a machine busy with something else for a
   while weighs on every policy alike). Long prompts are sent with priority 1 and short
   ones 0 (what `priority` orders by; the other policies ignore it). Per policy, over all
   rounds: p50/p99 TTFT and E2E of short and of long requests, the longest wait (TTFT:
   arrival to first token) of any request, throughput; then length-aware / fcfs ratios
   against the issue's targets, pooled and per round. `--with-capped-fcfs` adds an fcfs
   server with length-aware's prefill cap, to tell what the cap buys from what the
   order does.
2. Pressure: a small KV pool (`--pressure-pages`) and `--pressure-requests` long
   contexts sent at once, so running requests outgrow the pool and get preempted:
   recompute (`--swap-space 0`) vs swap (`--swap-space 1 --swap-min-tokens 0`), with the
   recomputed tokens, swaps and end-to-end times. Both servers run with degradation
   thresholds scaled to a one-minute run (usage > 80% for 2 s degrades, < 50% for 2 s
   restores; the defaults are 90% / 30 s and 80% / 30 s) and /metrics is polled every
   0.2 s, so the run records the budget being lowered and restored.

Every server started here is stopped on the way out, errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_compare import (  # noqa: E402
    SHIPPED_MODEL,
    Server,
    add_engine_options,
    free_port,
    http_get,
    serve_cmd,
)

from serving.bench.datasets import BenchRequest  # noqa: E402
from serving.bench.load_generator import arrivals, build_payload, send_request  # noqa: E402

POLICIES = ("fcfs", "priority", "length-aware")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--logdir", help="keep the servers' logs here (default: a temp dir)")
    add_engine_options(p, "engine (every server)", max_num_seqs=16, max_num_batched_tokens=512,
                       max_model_len=1024, token_buckets="16,64,128,256,512", seq_buckets="16")
    m = p.add_argument_group("mixed workload")
    m.add_argument("--num-requests", type=int, default=160)
    m.add_argument("--capacity-requests", type=int, default=40)
    m.add_argument("--short-len", type=int, default=64)
    m.add_argument("--long-len", type=int, default=900)
    m.add_argument("--long-fraction", type=float, default=0.2)
    m.add_argument("--output-len", type=int, default=32)
    m.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    m.add_argument("--rounds", type=int, default=3, help="workload runs per server")
    m.add_argument("--policy-flags", default="",
                   help="extra serve flags for the length-aware server")
    m.add_argument("--with-capped-fcfs", action="store_true",
                   help="also an fcfs server with length-aware's prefill cap "
                        "(--long-prefill-token-threshold 128 --max-long-partial-prefills 1)")
    m.add_argument("--skip-mixed", action="store_true")
    r = p.add_argument_group("pressure run")
    r.add_argument("--pressure-requests", type=int, default=8)
    r.add_argument("--pressure-len", type=int, default=400)
    r.add_argument("--pressure-output-len", type=int, default=320)
    r.add_argument("--pressure-pages", type=int, default=161)
    r.add_argument("--degrade-kv-usage", type=float, default=0.8)
    r.add_argument("--degrade-after", type=float, default=2.0)
    r.add_argument("--restore-kv-usage", type=float, default=0.5)
    r.add_argument("--restore-after", type=float, default=2.0)
    r.add_argument("--skip-pressure", action="store_true")
    return p.parse_args(argv)


# ---- servers and metrics -----------------------------------------------------------------
def start_server(args, name: str, flags: list[str], logdir: str) -> Server:
    port = free_port()
    cmd = serve_cmd(args, port, "--log-interval", "0", *flags)
    server = Server(name, cmd, port, logdir, env=None)
    server.model = server.wait_ready(args.startup_timeout)
    return server


def scrape(url: str) -> dict[str, float]:
    """/metrics values by name, labels dropped (one model per server)."""
    values = {}
    for line in http_get(url + "/metrics").splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0) + float(value)
    return values


class Sampler(threading.Thread):
    """Polls /metrics; keeps every change of the degraded flag and the token budget."""

    KEYS = ("qwen_jax:scheduler_degraded", "qwen_jax:scheduler_max_num_batched_tokens")

    def __init__(self, url: str, every: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.started = time.perf_counter()
        self.changes: list[dict] = []
        self.max_kv_usage = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        last = None
        while not self.stop.is_set():
            try:
                v = scrape(self.url)
            except OSError:
                continue
            state = tuple(v.get(k) for k in self.KEYS)
            self.max_kv_usage = max(self.max_kv_usage, v.get("qwen_jax:kv_cache_usage_perc", 0))
            if state != last:
                self.changes.append({
                    "t_s": round(time.perf_counter() - self.started, 2),
                    "degraded": state[0], "max_num_batched_tokens": state[1],
                    "kv_cache_usage": round(v.get("qwen_jax:kv_cache_usage_perc", 0), 3)})
                last = state
            self.stop.wait(self.every)


# ---- load ------------------------------------------------------------------------------
def make_workload(num: int, args, rng: np.random.Generator) -> list[tuple[BenchRequest, bool]]:
    """(request, is_long); lengths within +-10% (long ones capped to fit the context)."""
    out = []
    for _ in range(num):
        is_long = rng.random() < args.long_fraction
        mean = args.long_len if is_long else args.short_len
        n = int(rng.integers(int(mean * 0.9), int(mean * 1.1) + 1))
        n = min(n, args.max_model_len - args.output_len)
        ids = rng.integers(3, 600, size=n).tolist()
        out.append((BenchRequest(prompt=ids, prompt_len=n, output_len=args.output_len), is_long))
    return out


async def drive(url: str, model: str, workload, rate: float, seed: int):
    """Send every request at the arrival process's times; results in workload order."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(request: BenchRequest, is_long: bool):
            payload = build_payload(request, model=model, chat=False, ignore_eos=True)
            payload["priority"] = int(is_long)
            return await send_request(session, url + "/v1/completions", payload, request, False)

        kinds = {id(r): is_long for r, is_long in workload}
        started = time.perf_counter()
        tasks = [asyncio.create_task(one(r, kinds[id(r)])) async for r in
                 arrivals([r for r, _ in workload], rate, 1.0, np.random.default_rng(seed))]
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


def pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def summarize(results, workload, seconds: float) -> dict:
    failed = [r.error for r in results if not r.success]
    out: dict = {"requests": len(results), "failed": len(failed), "errors": failed[:3],
                 "seconds": round(seconds, 2)}
    for kind, want in (("short", False), ("long", True)):
        rs = [r for r, (_, is_long) in zip(results, workload) if is_long == want and r.success]
        out[kind] = {"n": len(rs),
                     "ttft_p50_s": pct([r.ttft for r in rs], 50),
                     "ttft_p99_s": pct([r.ttft for r in rs], 99),
                     "e2e_p50_s": pct([r.latency for r in rs], 50),
                     "e2e_p99_s": pct([r.latency for r in rs], 99)}
    ok = [r for r in results if r.success]
    out["max_wait_s"] = round(max(r.ttft for r in ok), 4) if ok else None
    out["requests_per_s"] = round(len(ok) / seconds, 3)
    out["output_tokens_per_s"] = round(sum(r.output_tokens for r in ok) / seconds, 1)
    return out


def run_load(server: Server, workload, rate: float, seed: int) -> dict:
    return summarize_runs([load_run(server, workload, rate, seed)], workload)


def load_run(server: Server, workload, rate: float, seed: int) -> tuple:
    """(results, seconds, counter increments) of one pass of the workload."""
    before = scrape(server.url)
    results, seconds = asyncio.run(drive(server.url, server.model, workload, rate, seed))
    after = scrape(server.url)
    counters = {name: after.get("qwen_jax:" + name, 0) - before.get("qwen_jax:" + name, 0)
                for name in COUNTERS}
    return results, seconds, counters


COUNTERS = ("num_preemptions_total", "scheduler_priority_boosts_total",
            "num_swap_outs_total", "num_recomputed_tokens_total")


def summarize_runs(runs: list[tuple], workload) -> dict:
    """Percentiles over every run's requests together; seconds and counters summed."""
    summary = summarize([r for results, _, _ in runs for r in results], workload * len(runs),
                        sum(seconds for _, seconds, _ in runs))
    for name in COUNTERS:
        summary[name] = sum(counters[name] for _, _, counters in runs)
    return summary


# ---- the two parts -----------------------------------------------------------------------
def measure_capacity(server: Server, args) -> float:
    """Requests/s with the whole mix sent at once (the engine saturated)."""
    workload = make_workload(args.capacity_requests, args, np.random.default_rng(args.seed + 1))
    results, seconds = asyncio.run(drive(server.url, server.model, workload, float("inf"),
                                         args.seed))
    return sum(r.success for r in results) / seconds


CAPPED_FCFS = "fcfs+prefill-cap"  # fcfs with length-aware's prefill cap: what order adds


def servers_to_compare(args) -> list[tuple[str, list[str]]]:
    """(name, serve flags) of each server of the mixed run."""
    out = [(policy, ["--scheduling-policy", policy]
            + (args.policy_flags.split() if policy == "length-aware" else []))
           for policy in POLICIES]
    if args.with_capped_fcfs:
        out.append((CAPPED_FCFS, ["--scheduling-policy", "fcfs",
                                  "--long-prefill-token-threshold", "128",
                                  "--max-long-partial-prefills", "1"]))
    return out


def run_mixed(args, logdir: str) -> dict:
    workload = make_workload(args.num_requests, args, np.random.default_rng(args.seed))
    out: dict = {"workload": {
        "requests": len(workload), "long": sum(k for _, k in workload),
        "short_len": args.short_len, "long_len": args.long_len, "output_len": args.output_len,
        "load": args.load, "rounds": args.rounds}, "policies": {}}
    configs = servers_to_compare(args)
    names = [name for name, _ in configs]
    servers: dict[str, Server] = {}
    runs: dict[str, list] = {name: [] for name in names}
    try:
        for name, flags in configs:
            servers[name] = start_server(args, name, flags, logdir)
        out["capacity_requests_per_s"] = round(measure_capacity(servers["fcfs"], args), 3)
        rate = args.load * out["capacity_requests_per_s"]
        out["request_rate"] = round(rate, 3)
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                runs[name].append(load_run(servers[name], workload, rate, args.seed))
    finally:
        for server in servers.values():
            server.stop()
    for name in names:
        out["policies"][name] = summarize_runs(runs[name], workload)
    out["length_aware_vs_fcfs"] = ratios(out["policies"]["fcfs"],
                                         out["policies"]["length-aware"])
    out["length_aware_vs_fcfs"]["per_round"] = [
        round_ratios(summarize_runs([f], workload), summarize_runs([la], workload))
        for f, la in zip(runs["fcfs"], runs["length-aware"])]
    return out


def round_ratios(fcfs: dict, la: dict) -> dict:
    """One round's ratios, with the short p99 TTFTs they come from."""
    r = {k: v for k, v in ratios(fcfs, la).items() if k != "targets_met"}
    r["short_ttft_p99_s"] = {"fcfs": fcfs["short"]["ttft_p99_s"],
                             "length-aware": la["short"]["ttft_p99_s"]}
    return r


def ratios(fcfs: dict, la: dict) -> dict:
    def div(a, b):
        return round(a / b, 3) if a is not None and b else None
    r = {"short_ttft_p99_improvement": div(fcfs["short"]["ttft_p99_s"], la["short"]["ttft_p99_s"]),
         "long_e2e_p99_ratio": div(la["long"]["e2e_p99_s"], fcfs["long"]["e2e_p99_s"]),
         "throughput_ratio": div(la["output_tokens_per_s"], fcfs["output_tokens_per_s"])}
    r["targets_met"] = {
        "short_ttft_p99_at_least_2x_better": (r["short_ttft_p99_improvement"] or 0) >= 2,
        "long_e2e_p99_at_most_1.5x": (r["long_e2e_p99_ratio"] or 99) <= 1.5,
        "throughput_within_10pct": (r["throughput_ratio"] or 0) >= 0.9}
    return r


def run_pressure(args, logdir: str) -> dict:
    n, length, out_len = args.pressure_requests, args.pressure_len, args.pressure_output_len
    rng = np.random.default_rng(args.seed + 2)
    workload = [(BenchRequest(prompt=rng.integers(3, 600, size=length).tolist(),
                              prompt_len=length, output_len=out_len), True) for _ in range(n)]
    timers = ["--degrade-kv-usage", str(args.degrade_kv_usage), "--degrade-after",
              str(args.degrade_after), "--restore-kv-usage", str(args.restore_kv_usage),
              "--restore-after", str(args.restore_after),
              "--num-gpu-blocks-override", str(args.pressure_pages)]
    out: dict = {"workload": {"requests": n, "prompt_len": length, "output_len": out_len,
                              "kv_pages": args.pressure_pages, "page_size": 16}}
    for mode, flags in (("recompute", ["--swap-space", "0"]),
                        ("swap", ["--swap-space", "1", "--swap-min-tokens", "0"])):
        server = start_server(args, "pressure_" + mode, timers + flags, logdir)
        sampler = Sampler(server.url)
        try:
            sampler.start()
            out[mode] = run_load(server, workload, float("inf"), args.seed)
            time.sleep(args.restore_after + 1.5)  # idle: the budget comes back
        finally:
            sampler.stop.set()
            sampler.join(5)
            server.stop()
        out[mode]["degradation_timeline"] = sampler.changes
        out[mode]["max_kv_cache_usage"] = round(sampler.max_kv_usage, 3)
    rec, swp = out["recompute"], out["swap"]
    out["swap_vs_recompute"] = {
        "seconds_ratio": round(swp["seconds"] / rec["seconds"], 3),
        "long_e2e_p50_ratio": round(swp["long"]["e2e_p50_s"] / rec["long"]["e2e_p50_s"], 3)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    result: dict = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
                    "engine": {k: getattr(args, k) for k in (
                        "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                        "token_buckets", "seq_buckets")}, "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        logdir = args.logdir or tmp
        Path(logdir).mkdir(parents=True, exist_ok=True)
        if not args.skip_mixed:
            result["mixed"] = run_mixed(args, logdir)
        if not args.skip_pressure:
            result["pressure"] = run_pressure(args, logdir)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
