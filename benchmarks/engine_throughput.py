"""Offline engine throughput of a tiny Qwen3-MoE, every mode on the same model and workload.

Modes, run one after another in this process so their ratios are comparable on a noisy
machine: continuous batching (every request submitted at once), one request at a time,
static batches (max_num_seqs requests per batch, the next batch starts only when the
whole batch is done), and HF transformers `generate` (PyTorch, float32) batched with left
padding and one by one. With --rounds N every engine mode runs N times, the order reversed
every other round, and reports its median run. Then the host-side cost of one engine step
with 256 running decode sequences, with the device step replaced by a stub. Prints one
JSON object.

    python benchmarks/engine_throughput.py [--model DIR] [--num-requests 48] [--rounds 3]
                                           [--out FILE]

Without --model it uses the tiny model shipped in the package, or else builds a random
tiny Qwen3-MoE with HF transformers. TTFT is measured from the moment the mode's whole
workload was handed over (every request "arrives" at once), so queueing counts.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overlap import FakeDevice  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO / "qwen_jax" / "assets" / "tiny-qwen3-moe"
RANDOM_MODEL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=128, max_position_embeddings=2048,
                    eos_token_id=1, bos_token_id=0, pad_token_id=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: shipped tiny model, else random)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--host-seqs", type=int, default=256, help="running sequences, host bench")
    p.add_argument("--host-steps", type=int, default=50)
    p.add_argument("--host-max-model-len", type=int,
                   help="default: the model's max_position_embeddings, at most 2048")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine mode this many times, alternating the order; "
                        "each reports its median run")
    p.add_argument("--skip-hf", action="store_true", help="skip HF transformers generate")
    p.add_argument("--skip-hf-one-by-one", action="store_true")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads; on a shared 2-core box 2 threads thrash")
    p.add_argument("--compilation-cache-dir", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    return p.parse_args(argv)


# ---- model and workload ----------------------------------------------------------------
def resolve_model(args, tmp: str) -> tuple[str, str]:
    if args.model:
        return args.model, "given"
    if (SHIPPED_MODEL / "config.json").exists():
        return str(SHIPPED_MODEL), "shipped tiny model"
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**RANDOM_MODEL)).eval()
    model.save_pretrained(tmp)
    return tmp, "random tiny Qwen3-MoE (HF init)"


def make_workload(args, vocab_size: int):
    """Random token-id prompts with lengths spread over the whole range; fixed output lengths."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=n)
    output_lens = rng.integers(args.min_output, args.max_output + 1, size=n)
    prompts = [rng.integers(2, vocab_size, size=int(k)).tolist() for k in prompt_lens]
    return prompts, [int(k) for k in output_lens]


def engine_params(output_lens):
    """Greedy, fixed lengths."""
    from qwen_jax import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in output_lens]


# ---- reporting ---------------------------------------------------------------------------
def percentile(values, q):
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else None


def summarise(seconds, output_lens, ttfts, extra=None):
    total_out = int(sum(output_lens))
    return {"seconds": round(seconds, 3), "output_tokens": total_out,
            "output_tokens_per_s": round(total_out / seconds, 1),
            "requests_per_s": round(len(output_lens) / seconds, 3),
            "ttft_p50_s": _round(percentile(ttfts, 50)),
            "ttft_p99_s": _round(percentile(ttfts, 99)), **(extra or {})}


def _round(x, digits=4):
    return None if x is None else round(x, digits)


def match_fraction(outputs, reference):
    same = sum(a == b for a, b in zip(outputs, reference))
    return round(same / len(reference), 3)


# ---- engine modes --------------------------------------------------------------------------
def run_engine_batches(llm, prompts, output_lens, batch_size, pad_outputs=False):
    """Submit `batch_size` requests, wait for all of them, then the next batch.

    batch_size >= len(prompts) is continuous batching over the whole workload. With
    pad_outputs every member decodes as long as the batch's longest (true static
    batching); only its own tokens are kept. TTFT comes from each RequestOutput's
    first-token timestamp, relative to the start of the run.
    """
    token_ids, ttfts, since_submit = [], [], []
    start = time.monotonic()
    for i in range(0, len(prompts), batch_size):
        lens = output_lens[i:i + batch_size]
        batch = [{"prompt_token_ids": p} for p in prompts[i:i + batch_size]]
        params = engine_params([max(lens)] * len(lens) if pad_outputs else lens)
        for out, k in zip(llm.generate(batch, params), lens):
            token_ids.append(list(out.outputs[0].token_ids)[:k])
            ttfts.append(out.metrics.first_token_time - start)
            since_submit.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return time.monotonic() - start, token_ids, ttfts, since_submit


class _StepRecorder:
    """Wraps engine.step: the device seconds of each step it reads (engine.last_step)."""

    def __init__(self, engine):
        self.engine, self.fn, self.seconds = engine, engine.step, []

    def __call__(self):
        outputs = self.fn()
        if self.engine.last_step:
            self.seconds.append(self.engine.last_step["seconds"])
        return outputs


def engine_modes(llm, prompts, output_lens, max_num_seqs, rounds=1):
    """Each mode with the overlapped loop (the default), and continuous batching and
    static batches also with the serial loop. With rounds > 1 every mode runs once a
    round, the order reversed every other round (a noisy machine drifts): each mode
    reports its median run, and every run's throughput."""
    modes = {"continuous": (len(prompts), False, True),
             "continuous_serial_loop": (len(prompts), False, False),
             "one_at_a_time": (1, False, True),
             "static_batches": (max_num_seqs, False, True),
             "static_batches_serial_loop": (max_num_seqs, False, False),
             "static_batches_padded": (max_num_seqs, True, True)}
    runs: dict[str, list] = {name: [] for name in modes}
    tokens = {}
    compiles_before = llm.stats()["num_compiles"]
    for i in range(rounds):
        order = list(modes.items()) if i % 2 == 0 else list(reversed(modes.items()))
        for name, (batch_size, pad, overlap) in order:
            result, ids = engine_run(llm, prompts, output_lens, name, batch_size, pad, overlap)
            if tokens.setdefault(name, ids) != ids:
                raise RuntimeError(f"{name}: greedy tokens differ between rounds")
            runs[name].append(result)
    results = {}
    for name, mode_runs in runs.items():
        speeds = [r["output_tokens_per_s"] for r in mode_runs]
        results[name] = sorted(mode_runs, key=lambda r: r["output_tokens_per_s"])[
            (len(mode_runs) - 1) // 2]
        if rounds > 1:
            results[name]["output_tokens_per_s_runs"] = speeds
    stats = llm.stats()
    checks = {"compiles_while_timed": stats["num_compiles"] - compiles_before,
              "pages_leaked": stats["num_total_pages"] - stats["num_free_pages"],
              "num_preemptions": stats["num_preemptions"],
              "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 3)}
    return results, tokens, checks


def engine_run(llm, prompts, output_lens, name, batch_size, pad, overlap):
    """One mode's run over the workload: (summary, token ids)."""
    engine = llm.llm_engine
    config = engine.scheduler_config
    engine.step = device = _StepRecorder(engine)
    engine.scheduler_config = dataclasses.replace(config, async_scheduling=overlap)
    overlapped = engine.scheduler_config.async_scheduling
    try:
        seconds, ids, ttfts, since_submit = run_engine_batches(
            llm, prompts, output_lens, batch_size, pad)
    finally:
        del engine.step
        engine.scheduler_config = config
    if [len(t) for t in ids] != output_lens:  # ignore_eos: lengths are exact
        raise RuntimeError(f"{name}: outputs are not the requested lengths")
    return summarise(seconds, output_lens, ttfts, {
        "ttft_since_submit_p50_s": _round(percentile(since_submit, 50)),
        "ttft_since_submit_p99_s": _round(percentile(since_submit, 99)),
        "num_steps": len(device.seconds),
        "device_step_ms_mean": round(1e3 * statistics.fmean(device.seconds), 2),
        "host_share_of_wall": round(1 - sum(device.seconds) / seconds, 3),
        "overlapped_loop": overlapped}), ids


# ---- HF transformers -----------------------------------------------------------------------
class FirstTokenClock:
    """A generate() streamer: the first put() is the prompt, the second the first token."""

    def __init__(self):
        self.calls, self.first_token_time = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.monotonic()

    def end(self):
        pass


def hf_generate(model, batch, max_new_tokens, clock=None):
    """Greedy, left padded, never stopping early. Returns each row's new tokens."""
    import torch
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, streamer=clock)
    return out[:, width:].tolist()


def hf_modes(model_path, prompts, output_lens, batch_size, one_by_one=True, threads=1):
    """HF batched (static batches padded to the longest prompt and the longest output) and
    one request at a time. Only each request's own output tokens count."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    hf_generate(model, prompts[:2], 4)  # warm-up
    results, tokens = {}, {}
    runs = {"hf_batched": batch_size, **({"hf_one_by_one": 1} if one_by_one else {})}
    for name, size in runs.items():
        ids, ttfts = [], []
        start = time.monotonic()
        for i in range(0, len(prompts), size):
            batch, lens = prompts[i:i + size], output_lens[i:i + size]
            clock = FirstTokenClock()
            rows = hf_generate(model, batch, max(lens), clock)
            ids.extend(row[:k] for row, k in zip(rows, lens))
            ttfts.extend([clock.first_token_time - start] * len(batch))
        results[name] = summarise(time.monotonic() - start, output_lens, ttfts)
        tokens[name] = ids
    return results, tokens


# ---- host-side step cost -------------------------------------------------------------------
class _Timer:
    """Wraps a callable and records the duration of each call."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds.append(time.perf_counter() - t)
        return out


def decoding_engine(model_path, args, config, max_len):
    """An engine whose device step is stubbed, with args.host_seqs sequences all decoding."""
    from qwen_jax import LLM, SamplingParams
    n, rng = args.host_seqs, np.random.default_rng(args.seed + 1)
    prompt_lens = rng.integers(32, 257, size=n)
    max_tokens = 2 * args.host_steps + 16  # outlives the warm-up and timed steps
    pages = 1 + sum(-(-(int(k) + max_tokens) // 16) for k in prompt_lens)
    llm = LLM(model=model_path, max_num_seqs=n, max_num_batched_tokens=4096,
              max_model_len=max_len, num_gpu_blocks_override=pages + 16,
              precompile=False, show_progress=False,
              compilation_cache_dir=args.compilation_cache_dir)
    engine = llm.llm_engine
    engine.runner.dispatch = FakeDevice(0.0).dispatch  # every row 'samples' token 7
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, k in enumerate(prompt_lens):
        prompt = rng.integers(2, config["vocab_size"], int(k)).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while not _all_decoding(engine.scheduler, n):
        engine.step()
    for _ in range(5):  # warm the decode path
        engine.step()
    return engine


def host_step_cost(model_path, args):
    """engine.step() with 256 decoding sequences and the device step stubbed out, timing
    schedule, build_model_inputs and build_sampling_arrays (the pre-step host work) and the
    whole step (which adds update_after_step and output processing). Prefix caching stays
    on, as by default, so the step pays for hashing full pages."""
    import serving.engine.llm_engine as engine_module
    config = json.loads((Path(model_path) / "config.json").read_text())
    max_len = args.host_max_model_len or min(2048, config["max_position_embeddings"])
    engine = decoding_engine(model_path, args, config, max_len)
    timers = {"schedule": _Timer(engine.scheduler.schedule),
              "build_model_inputs": _Timer(engine_module.build_model_inputs),
              "build_sampling_arrays": _Timer(engine_module.build_sampling_arrays)}
    engine.scheduler.schedule = timers["schedule"]
    engine_module.build_model_inputs = timers["build_model_inputs"]
    engine_module.build_sampling_arrays = timers["build_sampling_arrays"]
    totals = []
    try:
        for _ in range(args.host_steps):
            t = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - t)
    finally:
        engine_module.build_model_inputs = timers["build_model_inputs"].fn
        engine_module.build_sampling_arrays = timers["build_sampling_arrays"].fn
    if engine.scheduler.num_running != args.host_seqs:
        raise RuntimeError("a sequence finished or was preempted during the timed steps")
    pre = [sum(parts) for parts in zip(*(tm.seconds for tm in timers.values()))]
    report = {"num_running_seqs": args.host_seqs, "steps": args.host_steps,
              "max_model_len": max_len, "pre_step_ms": _ms(pre),
              "whole_step_without_device_ms": _ms(totals)}
    report.update({f"{name}_ms": _ms(tm.seconds) for name, tm in timers.items()})
    return report


def _all_decoding(scheduler, n):
    running = scheduler.running
    return len(running) == n and all(
        r.num_computed_tokens == r.num_tokens_with_pending - 1 for r in running)


def _ms(seconds):
    return {"mean": round(1e3 * statistics.fmean(seconds), 3),
            "p99": round(1e3 * percentile(seconds, 99), 3)}


# ---- main ----------------------------------------------------------------------------------
def throughput_modes(args, model_path, prompts, output_lens):
    """Engine modes then HF modes; returns (per-mode results, per-mode tokens, checks, startup)."""
    from qwen_jax import LLM
    t = time.monotonic()
    # Prefix caching off: later modes replay the same prompts and would hit the cache.
    llm = LLM(model=model_path, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=False,
              compilation_cache_dir=args.compilation_cache_dir, show_progress=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                 engine_params([4] * 4))  # warm-up beyond the bucket precompile
    startup = time.monotonic() - t
    results, tokens, checks = engine_modes(llm, prompts, output_lens, args.max_num_seqs,
                                           args.rounds)
    del llm
    if not args.skip_hf:
        hf_results, hf_tokens = hf_modes(model_path, prompts, output_lens, args.max_num_seqs,
                                         not args.skip_hf_one_by_one, args.torch_threads)
        results.update(hf_results)
        tokens.update(hf_tokens)
    base = results["continuous"]["output_tokens_per_s"]
    for name, r in results.items():
        r["throughput_vs_continuous"] = round(r["output_tokens_per_s"] / base, 3)
        r["greedy_tokens_match_continuous"] = match_fraction(tokens[name], tokens["continuous"])
    return results, checks, startup


def describe(args, model_source, config, prompts, output_lens):
    def spread(values):
        return {"min": min(values), "mean": round(float(np.mean(values)), 1), "max": max(values)}
    model = {"source": model_source,
             "num_experts": config.get("num_experts", config.get("num_local_experts")),
             **{k: config.get(k) for k in ("hidden_size", "num_hidden_layers",
                                           "num_experts_per_tok", "moe_intermediate_size",
                                           "vocab_size")}}
    machine = {"platform": sys.platform, "cpu_count": os.cpu_count(),
               "jax_backend": __import__("jax").default_backend(),
               "torch_threads": args.torch_threads}
    workload = {"num_requests": len(prompts), "prompt_tokens": spread([len(p) for p in prompts]),
                "output_tokens": spread(output_lens), "greedy": True, "ignore_eos": True,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_model_len": args.max_model_len}
    return {"model": model, "machine": machine, "workload": workload}


def main(argv=None):
    args = parse_args(argv)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model_path, model_source = resolve_model(args, tmp)
        config = json.loads((Path(model_path) / "config.json").read_text())
        prompts, output_lens = make_workload(args, config["vocab_size"])
        results, checks, startup = throughput_modes(args, model_path, prompts, output_lens)
        host = host_step_cost(model_path, args)
    report = {**describe(args, model_source, config, prompts, output_lens),
              "engine_startup_s": round(startup, 2), "engine_checks": checks,
              "modes": results, "host_step_decoding": host,
              "total_seconds": round(time.monotonic() - began, 1)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
