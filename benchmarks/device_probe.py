"""The device probe: one entry point for a lent GPU; every figure is appended to
OUTDIR/probe.jsonl as one JSON line the moment it is measured.

    PYTHONPATH=. python3 benchmarks/device_probe.py --out OUTDIR \\
        [--stages env,check,attention,matmul,engine,offline[,speculative][,lora]]
        [--timeout STAGE=SECONDS]
        [--num-gpu-blocks-override 5200] [--quantization fp8|int8|awq] [--small]

Run from the repo root; nothing is installed. Stages run in this order, each in its own
process under its own timeout (a stage that times out or crashes leaves one line saying
so, and the next stage runs):

  env        versions, devices, memory, whether Triton kernels lower for CUDA; what a
             lax.cond costs: whether it holds the calling thread until the device gets
             there, and one executed cond's round trip
  check      each kernel against its jnp reference on the device
  attention  decode HBM GB/s at 1 / 8 / 64 sequences of 1k context; 2k prefill TFLOP/s
  matmul     grouped matmul GB/s over the experts touched at 1 / 8 / 64 decode tokens (bf16,
             fp8 and int4 experts) and a 2k prefill; stacked q/k/v and o_proj matmuls; KV
             page write
  engine     LLMEngine on Qwen3-30B-A3B shapes, dummy bf16 weights: load seconds, then per
             bucket compile seconds, temp memory and op counts of the compiled step
  offline    decode through LLMEngine.step, 1024 in / 128 out, at 1, 8 and 64 sequences,
             each through the overlapped loop, the same with device calls from the
             engine's thread, and the serial loop (--loops), then the overlapped loop
             with Qwen3's recommended sampling (--sampled-loops): output tok/s, execute
             ms, host ms and how long a dispatch holds the engine's thread per step
  speculative  (only when asked) the verify-cost curve: Qwen3-30B-A3B with a Qwen3-0.6B
             draft model, then with an EAGLE-3 head of the published Qwen3-30B-A3B
             heads' shapes (random, written to a temporary directory), dummy weights,
             greedy decode at 1 and 8 sequences verifying k = 1..5 drafts every step
             (against k = 0, no speculation): step execute ms, output tok/s, the experts
             a MoE layer is expected to read per step
  lora       (only when asked) multi-LoRA cost: Qwen3-30B-A3B with 8 adapter slots of
             rank 16 (random factors on attention, experts and router, packed directly),
             greedy decode of 1024 in / 64 out at 8 and 64 sequences with no adapter,
             then 8 adapters mixed in every step: output tok/s, decode execute ms, ratio

--quantization fp8 (or int8, awq): the engine and offline stages with quantised weights,
to set beside a run without it (`--stages engine,offline --quantization fp8`); the matmul
stage always measures the grouped matmul with bf16, fp8 and int4 expert weights.

--small: the embedded tiny model and tiny kernel shapes on the CPU, kernels interpreted:
a dry run of every stage (its numbers mean nothing).

Last, OUTDIR/kernel_table.json: the fastest kernel candidate per op and size among the
attention and matmul stages' timings (Triton, Mosaic GPU, XLA's ragged_dot), which
`qwen-jax serve --kernel-table` reads.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

STAGES = ("env", "check", "attention", "matmul", "engine", "offline", "speculative", "lora")
DEFAULT_STAGES = STAGES[:-2]  # speculative and lora: when asked (--stages speculative,lora)
# Seconds per stage on an H200, at most (the default stages under 9 minutes in all; a run
# takes less).
TIMEOUTS = {"env": 60, "check": 60, "attention": 45, "matmul": 60, "engine": 150,
            "offline": 150, "speculative": 420, "lora": 300}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JsonLines:
    """Appends one JSON object per line, flushed at once, stamped with seconds since
    the probe started."""

    def __init__(self, path, started):
        self.path, self.started = path, started
        # Buckets report as they compile, from the compile threads: one line at a time,
        # or print's text and newline interleave on stdout.
        self._lock = threading.Lock()

    def __call__(self, stage, **row):
        with self._lock:
            line = json.dumps({"stage": stage, **row,
                               "t": round(time.time() - self.started, 1)}, default=str)
            print(line, flush=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


# ---- stages (each runs in a child process) ----------------------------------------------
def stage_env(emit, args, arm):
    del arm
    import jax

    from pallas_kernels.cuda_lowering import cuda_lowering_error
    device = jax.devices()[0]
    emit("env", python=platform.python_version(), jax=jax.__version__,
         backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
         memory=getattr(device, "memory_stats", lambda: None)(),
         xla_flags=os.environ.get("XLA_FLAGS", ""), cuda_lowering=cuda_lowering_error() or "ok",
         commit=_git_head())
    emit("env", part="conditional", **conditional_costs(args.small))


def conditional_costs(small: bool) -> dict:
    """What a `lax.cond` costs the caller (the step's sampler runs several): a jitted call
    of a long computation followed by one cond, against the same with a select, timed to
    its return (not to its result): on a GPU, if XLA reads the predicate back, the cond's
    call returns only after the computation before it (`call_returns_ms` near
    `busy_ms`). Then 32 conds in a row, each on the one before's result, against 32
    selects: the round trip of one executed cond (`per_cond_us`)."""
    import jax
    import jax.numpy as jnp

    n, reps = (64, 4) if small else (4096, 40)
    x = jnp.ones((n, n), jnp.float32) / n

    def busy(x):
        return jax.lax.fori_loop(0, reps, lambda _, y: jnp.tanh(y @ x), x)

    def then_cond(x):
        y = busy(x)
        return jax.lax.cond(y[0, 0] > -1, lambda: y + 1, lambda: y - 1)

    def then_select(x):
        y = busy(x)
        return jnp.where(y[0, 0] > -1, y + 1, y - 1)

    def chain(use_cond):
        def run(v):
            for _ in range(32):
                if use_cond:
                    v = jax.lax.cond(v[0] > -1, lambda v=v: v * 0.5 + 1, lambda v=v: v * 0.5 - 1)
                else:
                    v = jnp.where(v[0] > -1, v * 0.5 + 1, v * 0.5 - 1)
            return v
        return run

    def timed(fn, arg, repeats=5):
        """(median seconds to the call's return, median seconds to its result)."""
        fn(arg).block_until_ready()
        returns, results = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            out = fn(arg)
            returns.append(time.perf_counter() - start)
            out.block_until_ready()
            results.append(time.perf_counter() - start)
        return sorted(returns)[repeats // 2], sorted(results)[repeats // 2]

    ms = lambda seconds: round(seconds * 1e3, 3)
    _, busy_s = timed(jax.jit(busy), x)
    cond_return, _ = timed(jax.jit(then_cond), x)
    select_return, _ = timed(jax.jit(then_select), x)
    v = jnp.ones(8, jnp.float32)
    _, conds = timed(jax.jit(chain(True)), v, repeats=21)
    _, selects = timed(jax.jit(chain(False)), v, repeats=21)
    return {"busy_ms": ms(busy_s), "call_returns_ms": ms(cond_return),
            "select_call_returns_ms": ms(select_return),
            "per_cond_us": round((conds - selects) / 32 * 1e6, 2)}


def _kernel_stage(stage, parts):
    """A stage made of benchmarks/kernels.py parts."""
    def run(emit, args, arm):
        del arm
        import kernels  # benchmarks/kernels.py, next to this script
        kernels.run(parts, small=args.small, emit=lambda row: emit(stage, **row))
    return run


def engine_kwargs(args):
    quantization = {} if args.quantization is None else dict(quantization=args.quantization)
    if args.small:
        return dict(model=None, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                    token_buckets=[8, 64], seq_buckets=[4, 8], num_gpu_blocks_override=200,
                    **quantization)
    # 64 sequences of 1024 + 128 tokens need 64 x 72 pages + the scratch page.
    return dict(model="qwen3-30b-a3b", load_format="dummy", dtype="bfloat16",
                max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1280,
                token_buckets=[8, 64, 2048], seq_buckets=[4, 8, 64],
                num_gpu_blocks_override=args.num_gpu_blocks_override, **quantization)


def stage_engine(emit, args, arm):
    """Load, compile (a line per bucket as it is ready), then the offline runs."""
    import jax

    from serving.engine.config import engine_config_from_kwargs
    from serving.engine.llm_engine import LLMEngine
    from serving.executor import step_lowering

    kwargs = engine_kwargs(args)
    started = time.time()
    engine = LLMEngine(engine_config_from_kwargs(
        kwargs.pop("model"), show_progress=False, compilation_cache_dir=None,
        precompile=False, enable_prefix_caching=False, **kwargs))
    device = jax.local_devices()[0]
    emit("engine", load_s=round(engine.load_seconds, 1), kv_pages=engine.num_pages,
         buckets=engine.bucket_pairs, impl=engine.model.impl,
         quantization=args.quantization or "none",
         weight_gb=round(_weight_bytes(engine) / 1e9, 3),
         memory=getattr(device, "memory_stats", lambda: None)())
    weight_shapes = step_lowering.per_layer_weight_shapes(engine.runner)

    def compiled(bucket, executable, seconds):
        memory = executable.memory_analysis()
        emit("engine", bucket=bucket, compile_s=round(seconds, 1),
             temp_mb=round(memory.temp_size_in_bytes / 2**20),
             argument_mb=round(memory.argument_size_in_bytes / 2**20),
             ops=step_lowering.compiled_counts(executable.as_text(), weight_shapes))

    seconds = engine.runner.precompile(engine.bucket_pairs, progress=False, on_compiled=compiled)
    emit("engine", compile_all_s=round(seconds, 1), total_s=round(time.time() - started, 1))
    if "offline" in args.stages:
        arm("offline")
        stage_offline(emit, args, engine)


def stage_offline(emit, args, engine):
    import dataclasses

    import numpy as np

    from serving.core.request import SamplingParams
    in_len, out_len = (40, 8) if args.small else (1024, 128)
    decode_tokens = 8 if args.small else 64  # decode steps run in buckets of <= this
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    # Qwen3's recommended sampling (the sampler's few-candidates path, one conditional)
    sampled = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=0,
                             max_tokens=out_len, ignore_eos=True)
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    levels = sorted({min(c, 8) for c in args.concurrency}) if args.small else args.concurrency
    config, thread = engine.scheduler_config, engine.runner.dispatch_thread
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for concurrency in levels:  # each level's decode bucket runs once before any timing
        _offline_run(engine, [[2] * 16] * concurrency, warm, f"warm{concurrency}",
                     decode_tokens)
    for concurrency in levels:
        prompts = [rng.integers(2, vocab - 1, in_len).tolist() for _ in range(concurrency)]
        walls, greedy_ms = {}, {}
        # The same prompts through each loop, one after the other; then with sampling.
        runs = [(loop, "greedy") for loop in args.loops]
        runs += [(loop, "qwen3") for loop in args.sampled_loops]
        for loop, sampling in runs:
            engine.scheduler_config = dataclasses.replace(
                config, async_scheduling=loop != "serial")
            engine.runner.dispatch_thread = loop != "overlapped-engine-thread" and thread
            row = _offline_run(engine, prompts, params if sampling == "greedy" else sampled,
                               f"c{concurrency}-{loop}-{sampling}", decode_tokens)
            if sampling == "greedy":
                walls[loop], greedy_ms[loop] = row["wall_s"], row["decode_execute_ms_p50"]
                if loop == "serial" and walls.get("overlapped"):
                    row["serial_over_overlapped"] = round(
                        walls["serial"] / walls["overlapped"], 3)
            elif greedy_ms.get(loop) and row["decode_execute_ms_p50"]:
                row["decode_execute_over_greedy"] = round(
                    row["decode_execute_ms_p50"] / greedy_ms[loop], 3)
            emit("offline", concurrency=concurrency, loop=loop, sampling=sampling,
                 dispatch_thread=engine.runner.dispatch_thread,
                 quantization=args.quantization or "none",
                 output_tok_s=round(concurrency * out_len / row["wall_s"], 1), **row)
    engine.scheduler_config, engine.runner.dispatch_thread = config, thread


def _eagle3_head_dir(args) -> str | None:
    """A random EAGLE-3 head for Qwen3-30B-A3B (hidden 2048, 32 heads, 4 KV heads, a
    32,000-token draft vocabulary), written once; None (the shipped head) for --small."""
    if args.small:
        return None
    import tempfile

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from qwen_jax.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
    cfg = Eagle3Config(hidden_size=2048, target_hidden_size=2048, intermediate_size=6144,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       vocab_size=151936, draft_vocab_size=32000, aux_layer_ids=(2, 24, 45),
                       rope_theta=1_000_000.0, max_position_embeddings=40960)
    head = Eagle3Head(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    head.d2t.set_value(jnp.asarray(np.arange(32000) * 4 - np.arange(32000), jnp.int32))
    path = tempfile.mkdtemp(prefix="eagle3-30b-")
    save_eagle3(head, path)
    return path


def stage_speculative(emit, args, arm):
    """Step time against drafts verified per step, for a draft model and an EAGLE-3
    head: one engine each with k = 5 drafts at most, trimmed to each k (adaptive off:
    every step verifies k drafts; the dummy drafts are rejected, so each step emits one
    token), k = 0 without speculation."""
    drafts = {"draft_model": None if args.small else "qwen3-0.6b",  # small: the shipped
              "eagle3": _eagle3_head_dir(args)}                    # draft and head
    for method, model in drafts.items():
        _speculative_curve(emit, args, method, model)


def _speculative_curve(emit, args, method: str, model: str | None) -> None:
    import dataclasses

    import numpy as np

    from serving.core.request import SamplingParams
    from serving.engine.config import engine_config_from_kwargs
    from serving.engine.llm_engine import LLMEngine
    from serving.metrics.step_cost import expected_experts_touched

    kwargs = engine_kwargs(args)
    kwargs.update(max_num_seqs=8, seq_buckets=[8, 16, 64],
                  token_buckets=[8, 16, 32, 64] + ([] if args.small else [2048]))
    engine = LLMEngine(engine_config_from_kwargs(
        kwargs.pop("model"), show_progress=False, compilation_cache_dir=None,
        precompile=False, enable_prefix_caching=False, speculative_config={
            "method": method, "num_speculative_tokens": 5, "model": model,
            "adaptive_draft_length": False}, **kwargs))
    speculator, config = engine.speculator, engine.speculator.config
    in_len, out_len = (40, 8) if args.small else (1024, 64)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    rng = np.random.default_rng(2)
    cfg = engine.model_config
    for batch in (1, 8):
        prompts = [rng.integers(2, cfg.vocab_size - 1, in_len).tolist() for _ in range(batch)]
        for k in (0, 1, 2, 3, 4, 5):
            engine.speculator = speculator if k else None
            if k:
                speculator.config = dataclasses.replace(config, num_speculative_tokens=k)
            for run in ("warm", "timed"):  # the first compiles this k's buckets
                before = speculator.num_drafts, speculator.num_accepted_tokens
                row = _offline_run(engine, prompts, params, f"spec{batch}-{k}-{run}", 64)
            drafts = speculator.num_drafts - before[0]
            emit("speculative", method=method, batch=batch, k=k, output_tok_s=round(
                batch * out_len / row["wall_s"], 1), steps=row["steps"],
                step_execute_ms_p50=row["decode_execute_ms_p50"],
                acceptance_length=(1 + (speculator.num_accepted_tokens - before[1]) / drafts
                                   if drafts else None),
                experts_per_layer_step=round(expected_experts_touched(
                    batch * (1 + k), cfg.num_experts, cfg.num_experts_per_tok), 2))
    engine.speculator = speculator


def stage_lora(emit, args, arm):
    """Decode with 8 rank-16 adapters mixed in each step against no adapter, one engine."""
    import numpy as np

    from qwen_jax.lora_packing import lora_buffer_shapes
    from serving.core.lora_request import LoRARequest
    from serving.core.request import SamplingParams
    from serving.engine.config import engine_config_from_kwargs
    from serving.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    engine = LLMEngine(engine_config_from_kwargs(
        kwargs.pop("model"), show_progress=False, compilation_cache_dir=None,
        enable_prefix_caching=False, enable_lora=True, max_loras=8, max_lora_rank=16,
        **kwargs))
    rng = np.random.default_rng(3)
    packed = [{name: (rng.standard_normal(shape, np.float32) * 0.01).astype(np.float32)
               for name, shape in seg.items()}
              for seg in lora_buffer_shapes(engine.model_config, engine.lora.buffer_rank)]
    loras = [LoRARequest(f"probe{i}", i + 1, f"random-{i}") for i in range(8)]
    for lora in loras:  # one random set for all eight: the step's work is the same
        engine.lora.slots.add(lora, packed)
    in_len, out_len = (40, 8) if args.small else (1024, 64)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for batch in (8,) if args.small else (8, 64):
        prompts = [rng.integers(2, vocab - 1, in_len).tolist() for _ in range(batch)]
        rates = {}
        for case, used in (("none", None), ("mixed_8", loras)):
            for run in ("warm", "timed"):
                row = _offline_run(engine, prompts, params, f"lora{batch}-{case}-{run}",
                                   64, used)
            rates[case] = batch * out_len / row["wall_s"]
            emit("lora", batch=batch, adapters=case, rank=16,
                 output_tok_s=round(rates[case], 1), steps=row["steps"],
                 step_execute_ms_p50=row["decode_execute_ms_p50"],
                 mixed_over_none=round(rates[case] / rates["none"], 3))


def _offline_run(engine, prompts, params, prefix, decode_tokens, loras=None):
    """The prompts through LLMEngine.step until all finish: per step, its bucket, device
    seconds (dispatch or the step before's end to its tokens read) and the host's rest.
    loras: request i runs loras[i % len(loras)] (None: no adapter)."""
    import numpy as np

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", {"prompt_token_ids": prompt}, params, stream=False,
                           lora_request=loras[i % len(loras)] if loras else None)
    runner, dispatch_seconds = engine.runner, []
    real_dispatch = runner.dispatch

    def dispatch(*args, **kwargs):  # how long the engine's thread is held per step
        start = time.perf_counter()
        pending = real_dispatch(*args, **kwargs)
        dispatch_seconds.append(time.perf_counter() - start)
        return pending

    runner.dispatch = dispatch
    steps, shapes, started = [], [], time.perf_counter()
    try:
        num_overlapped = _steps_until_done(engine, steps, shapes)
    finally:
        del runner.dispatch
    wall = time.perf_counter() - started
    decode = [(run, total) for bucket, run, total in steps if bucket[0] <= decode_tokens]
    median_ms = lambda v: round(float(np.median(v)) * 1e3, 3) if v else None
    # Overlapped, a step's host part runs while the device computes: "host" is then the
    # step's wall time past its device time (the host work the device waited for).
    return dict(wall_s=round(wall, 2), steps=len(steps), decode_steps=len(decode),
                overlapped_steps=num_overlapped,
                dispatch_ms_p50=median_ms(dispatch_seconds),
                decode_execute_ms_p50=median_ms([r for r, _ in decode]),
                decode_wall_ms_p50=median_ms([t for _, t in decode]),
                decode_host_ms_p50=median_ms([max(t - r, 0.0) for r, t in decode]),
                prefill_execute_ms_p50=median_ms([r for b, r, _ in steps if b[0] > decode_tokens]),
                **utilisation(engine, steps, shapes, decode_tokens))


def _steps_until_done(engine, steps, shapes) -> int:
    """LLMEngine.step until no request is left; appends each step's (bucket, device
    seconds, wall seconds) and shape; returns how many steps overlapped the one before."""
    num_overlapped = 0
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        before = engine.num_overlapped_steps
        engine.step()
        num_overlapped += engine.num_overlapped_steps - before
        last = engine.last_step
        if not last:  # overlapped: the first call only dispatches
            continue
        steps.append((last["bucket"], last["seconds"], time.perf_counter() - step_start))
        shapes.append(last["shape"])
    engine.step()  # an overlapped loop's last step may still be in flight: read it
    return num_overlapped


def utilisation(engine, steps, shapes, decode_tokens):
    """Median model FLOP/s and bytes/s of the decode and prefill steps
    (serving/metrics/step_cost.py), and MFU / MBU against the device's datasheet peak where
    the table knows it."""
    import numpy as np

    from serving.metrics.step_cost import CostModel, device_peak
    model = CostModel.for_engine(engine)
    peak = device_peak(engine.devices[0].device_kind)
    out = {"peak": peak.name if peak else None}
    for kind, chosen in (("decode", lambda t: t <= decode_tokens),
                         ("prefill", lambda t: t > decode_tokens)):
        costs = [(model.cost(shape), seconds) for (bucket, seconds, _), shape
                 in zip(steps, shapes) if shape is not None and seconds > 0
                 and chosen(bucket[0])]
        if not costs:
            continue
        flops = float(np.median([c.flops / s for c, s in costs]))
        rate = float(np.median([c.bytes / s for c, s in costs]))
        out[f"{kind}_tflop_s_p50"] = round(flops / 1e12, 4)
        out[f"{kind}_gb_s_p50"] = round(rate / 1e9, 3)
        if peak is not None:
            devices = len(engine.devices)
            out[f"{kind}_mfu_p50"] = round(flops / peak.flops(model.param_bytes) / devices, 4)
            out[f"{kind}_mbu_p50"] = round(rate / peak.memory_bytes_per_s / devices, 4)
    return out


def _weight_bytes(engine) -> int:
    """Bytes of the model's params on the devices (quantised weights as stored)."""
    import jax
    from flax import nnx
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(engine.model, nnx.Param)))


class Watchdog:
    """Ends this process when the current stage runs past its time, after saying so."""

    def __init__(self, emit, timeouts):
        self.emit, self.timeouts, self.timer = emit, timeouts, None

    def arm(self, stage):
        self.cancel()
        seconds = self.timeouts[stage]

        def expire():
            self.emit(stage, error="timeout", timeout_s=seconds)
            os._exit(124)
        self.timer = threading.Timer(seconds, expire)
        self.timer.daemon = True
        self.timer.start()

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()


def _git_head():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


RUNNERS = {"env": stage_env, "check": _kernel_stage("check", ["check"]),
           "attention": _kernel_stage("attention", ["attention"]),
           "matmul": _kernel_stage("matmul", ["grouped_matmul", "stacked_matmul", "kv_write"]),
           "engine": stage_engine, "speculative": stage_speculative, "lora": stage_lora}


# ---- the parent: stages in order, each under its timeout -------------------------------
def run_stage(stage, args, emit, argv):
    """Runs one stage in a child process; one line if it times out or fails."""
    timeout = args.timeouts[stage]
    if stage == "engine" and "offline" in args.stages:
        timeout += args.timeouts["offline"]
    command = [sys.executable, os.path.abspath(__file__), "--child", stage, *argv]
    env = {**os.environ, "PROBE_STARTED": str(emit.started),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(command, timeout=timeout + 5, env=env, cwd=REPO,
                              stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        emit(stage, error="timeout", timeout_s=timeout)
        return
    if proc.returncode not in (0, 124):  # 124: its watchdog already said so
        emit(stage, error=f"exit code {proc.returncode}", stderr_tail=proc.stderr[-3000:])


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder; results go to probe.jsonl")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES))
    parser.add_argument("--timeout", action="append", default=[],
                        help="STAGE=SECONDS, repeatable (defaults: %s)" % TIMEOUTS)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=5200)
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--loops", default="overlapped,overlapped-engine-thread,serial",
                        help="offline stage: the engine loops to run each concurrency "
                             "through, in turn: overlapped (the default engine's), the "
                             "same with its device calls from the engine's own thread (no "
                             "DispatchThread: a step's lax.cond holds that thread on a GPU), "
                             "and serial")
    parser.add_argument("--sampled-loops", default="overlapped",
                        help="offline stage: the loops to run each concurrency through "
                             "again with Qwen3's recommended sampling (temperature 0.6, "
                             "top-p 0.95, top-k 20), after the greedy ones; '' for none")
    parser.add_argument("--quantization", default=None, choices=("fp8", "int8", "awq"),
                        help="engine and offline stages with quantised weights (dummy, as "
                             "that format's checkpoint holds them); run once without it "
                             "and once with it to compare")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--child", choices=[s for s in STAGES if s != "offline"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.stages = args.stages.split(",")
    for stage in args.stages:
        if stage not in STAGES:
            parser.error(f"--stages has {stage!r}, expected some of {','.join(STAGES)}")
    args.timeouts = dict(TIMEOUTS)
    for item in args.timeout:
        stage, _, seconds = item.partition("=")
        if stage not in TIMEOUTS:
            parser.error(f"--timeout {item!r}: stage must be one of {','.join(STAGES)}")
        args.timeouts[stage] = float(seconds)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    for flag in ("loops", "sampled_loops"):
        loops = [loop for loop in getattr(args, flag).split(",") if loop]
        for loop in loops:
            if loop not in ("overlapped", "overlapped-engine-thread", "serial"):
                parser.error(f"--{flag.replace('_', '-')} has {loop!r}, expected some of "
                             "overlapped, overlapped-engine-thread, serial")
        setattr(args, flag, loops)
    return args


def main(argv=None):
    if REPO not in sys.path:  # the packages live in the repo root: nothing is installed
        sys.path.insert(0, REPO)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = float(os.environ.get("PROBE_STARTED", time.time()))
    emit = JsonLines(os.path.join(args.out, "probe.jsonl"), started)
    if args.child:
        watchdog = Watchdog(emit, args.timeouts)
        watchdog.arm(args.child)
        RUNNERS[args.child](emit, args, watchdog.arm)
        watchdog.cancel()
        return 0
    child_argv = [a for a in argv if a != "--child"]
    for stage in args.stages:
        if stage == "offline" and "engine" in args.stages:
            continue  # runs inside the engine's process
        run_stage("engine" if stage == "offline" else stage, args, emit, child_argv)
    write_kernel_table(args.out, emit)
    emit("done")
    return 0


def write_kernel_table(out, emit):
    """OUT/kernel_table.json: the fastest measured implementation of each op at each
    size (`qwen-jax serve --kernel-table OUT/kernel_table.json` runs it); none written
    when no kernel stage timed a candidate."""
    from pallas_kernels.choices import fastest

    with open(os.path.join(out, "probe.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    table = fastest(r for r in rows if r["stage"] in ("attention", "matmul") and "ms" in r)
    if not table.entries:
        return
    path = os.path.join(out, "kernel_table.json")
    with open(path, "w") as f:
        json.dump(table.to_dict(), f, indent=1)
    emit("kernel_table", path=path, table=table.to_dict())


if __name__ == "__main__":
    sys.exit(main())
