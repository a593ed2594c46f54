"""The overlapped engine loop against the serial one, in one process. Prints one JSON object.

1. Host cost per step: `engine.step()` with N running decode sequences (N = 1, 8, 64,
   256) and the device step replaced by an instant fake: schedule + inputs + sampling
   arrays + output processing, serial and overlapped; the overlapped step's parts; and a
   fixed pure-Python loop timed between steps, so runs on this noisy machine (and two
   checkouts, before/after) compare as ratios. Then the same streamed decodes through
   AsyncLLM, as the server runs them: the engine thread's whole iteration, outputs
   handed to an event loop whose coroutines read them (and, a second time, make each
   into the server's SSE chunk of a streamed chat completion).
2. A fake device step of fixed duration d (default 2 ms and 12 ms, H200 estimates of a
   Qwen3-30B-A3B decode step at batch 1 and 64): the fake device runs the dispatched steps
   one after another, in real time, while the host goes on (it sleeps; it does not use a
   CPU). Step wall time and overlap efficiency d / wall, serial and overlapped, and
   through AsyncLLM with an SSE chunk made of every output.
3. The real tiny model on this CPU: output tokens/s of the same greedy workload, serial
   and overlapped, and whether every token is the same.
0. First, the vocabulary-wide work of a step at Qwen3's 151,936 tokens (lm head and
   sampler, 32 sequences): greedy, sampled, with and without logprobs, against the matmul.

`--server` instead: the server's way at many streams, the engine on a thread of the
server's process (`AsyncLLM`) against the engine in a process of its own (`MPAsyncLLM`,
`qwen-jax serve`'s default). N streamed requests through `generate` (DELTA outputs, as
the server asks), each read by a coroutine that makes every output into a chat SSE chunk,
against the fake device of d ms a step; the figure is the engine's step period while all
N decode (the median gap between consecutive steps' token times, from the step stats) and
d / period. The two kinds run in turns, `--rounds` times.

    PYTHONPATH=. python benchmarks/engine_overlap.py [--out FILE]
    PYTHONPATH=. python benchmarks/engine_overlap.py --host-only   # host cost only
    PYTHONPATH=. python benchmarks/engine_overlap.py --skip-engine  # the vocabulary part
    PYTHONPATH=. python benchmarks/engine_overlap.py --server --seqs 64 256 --device-ms 0 5 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from serving.sample.sampling_arrays import SamplerOutput  # noqa: E402

SEQS = (1, 8, 64, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    p.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    p.add_argument("--device-ms", type=float, nargs="+", default=[2.0, 12.0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    p.add_argument("--num-requests", type=int, default=64, help="real-model workload")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--penalties", action="store_true",
                   help="real-model workload with presence 0.5, frequency 0.3 and "
                        "repetition 1.1 penalties (they ran serially before they overlapped)")
    p.add_argument("--compilation-cache-dir", default="default")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="only the vocabulary part")
    p.add_argument("--skip-vocab", action="store_true", help="no vocabulary part")
    p.add_argument("--whole-responses", action="store_true",
                   help="also AsyncLLM with non-streamed requests: DELTA and FINAL_ONLY")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the engine option for the AsyncLLM figures (the server's way)")
    p.add_argument("--host-only", action="store_true",
                   help="only the host cost per step (no vocabulary part, fake device or "
                        "real model): what to run on two checkouts for before/after")
    p.add_argument("--final-only", action="store_true",
                   help="requests return only their final output (what LLM.generate and "
                        "`qwen-jax generate` ask for) instead of one per step (a stream)")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--vocab-hidden", type=int, default=128, help="the tiny model's hidden size")
    p.add_argument("--vocab-seqs", type=int, default=32)
    p.add_argument("--vocab-repeats", type=int, default=20)
    p.add_argument("--server", action="store_true",
                   help="only the server's way at many streams: the engine on a thread "
                        "against the engine in its own process (--seqs, --device-ms)")
    p.add_argument("--rounds", type=int, default=2, help="--server: turns of the two kinds")
    p.add_argument("--baseline-sampler", default=None,
                   help="a sampler.py to time beside serving/sample/sampler.py, e.g. from "
                        "`git show REV:serving/sample/sampler.py > /tmp/sampler_before.py`")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


class _NoEngine:
    """Metrics' engine collector reads stats only when scraped; nothing scrapes here."""

    engine = None

    def stats(self) -> dict:
        return {}


def streamed_chat_job(metrics, vocab_size: int):
    """What the server keeps for one streamed chat completion."""
    from serving.entrypoints.openai import protocol as proto
    from serving.entrypoints.openai.outputs import Job
    req = proto.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "stream": True, "max_tokens": 4000}, vocab_size)
    params = [proto.sampling_params(req, 10, 8192, "messages")]
    return Job(kind="chatcmpl", request_id="x", model="m", req=req, prompts=[[1] * 10],
               params=params, metrics=metrics)


class FakeDevice:
    """Stands in for `ModelRunner.dispatch`: steps run one after another for `seconds`
    each, starting when dispatched or when the step before ends; every row samples 7."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.busy_until = 0.0

    def dispatch(self, inputs, sampling, prev=None, score_rows=None):
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.seconds
        return _FakePending(self.busy_until, inputs.bucket[1])


class _FakePending:
    next_tokens = None

    def __init__(self, ready_at: float, num_seqs: int):
        self.ready_at, self.num_seqs = ready_at, num_seqs

    def result(self) -> SamplerOutput:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return SamplerOutput(token_ids=np.full(self.num_seqs, 7, np.int32), logprobs=None)


class _ReadyAt:
    """A device array's stand-in whose value reaches the host at `ready_at`."""

    def __init__(self, value: np.ndarray, ready_at: float):
        self.value, self.ready_at = value, ready_at

    def copy_to_host_async(self) -> None:
        pass

    def __array__(self, dtype=None, copy=None):
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.value


class BlockingFakeStep:
    """Stands in for the compiled steps (`runner._executables`, every bucket) as a GPU
    runs them: the device works `seconds` per step, one after another, and the call
    holds its thread until the device reaches the step's first `lax.cond`, `tail`
    seconds before the step's end (XLA's GPU runtime reads each conditional's predicate
    back and waits for it). Every row samples 7."""

    def __init__(self, seconds: float, tail: float = 1e-4):
        self.seconds, self.tail, self.busy_until = seconds, min(tail, seconds), 0.0

    def get(self, bucket, default=None):
        return self

    def __len__(self) -> int:  # no compiled step of its own (runner.num_compiles)
        return 0

    def __bool__(self) -> bool:
        return True

    def __call__(self, state, kv_caches, words, penalties, mask, prev_tokens):
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.seconds
        wait = self.busy_until - self.tail - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        tokens = _ReadyAt(np.full(mask.bits.shape[0], 7, np.int32), self.busy_until)
        return kv_caches, (SamplerOutput(token_ids=tokens, logprobs=None), prev_tokens)


def blocking_call_runs(engine, seconds: float, steps: int) -> dict:
    """The overlapped engine with `BlockingFakeStep` as its steps, its device calls from
    the engine's thread and then from the runner's dispatch thread: median wall ms per
    step and d / wall."""
    runner = engine.runner
    executables, on = runner._executables, runner.dispatch_thread
    vars(runner).pop("dispatch", None)  # the real dispatch, over the fake steps
    out = {}
    try:
        for name, thread in (("blocking_call", False), ("blocking_call_dispatch_thread", True)):
            runner.dispatch_thread = thread
            runner._executables = fake = BlockingFakeStep(seconds)
            wall = statistics.median(_step_walls(engine, steps))
            out[name] = {"wall_ms": round(1e3 * wall, 3), "efficiency": round(seconds / wall, 3)}
            fake.busy_until = 0.0
    finally:
        runner._executables, runner.dispatch_thread = executables, on
    return out


def decoding_engine(model, num_seqs: int, steps: int, async_scheduling: bool, cache_dir,
                    stream: bool = True, output_kind: str = "CUMULATIVE",
                    stream_interval: int = 1):
    """An engine with `num_seqs` sequences all decoding and a fake device (set later);
    `stream`: each request gets an output every step (every `stream_interval` tokens;
    holding what `output_kind` says), else only its final one."""
    from qwen_jax import LLM, SamplingParams
    rng = np.random.default_rng(num_seqs)
    prompt_lens = rng.integers(32, 257, size=num_seqs)
    max_tokens = 3 * steps + 32  # outlives the warm-up and timed steps
    pages = 1 + sum(-(-(int(k) + max_tokens) // 16) for k in prompt_lens)
    max_num_seqs = max(num_seqs, 8)
    llm = LLM(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
              max_model_len=1024, num_gpu_blocks_override=pages + 16, precompile=False,
              show_progress=False, compilation_cache_dir=cache_dir,
              async_scheduling=async_scheduling,
              **({} if stream_interval == 1 else {"stream_interval": stream_interval}))
    engine = llm.llm_engine
    engine.runner.dispatch = FakeDevice(0.0).dispatch
    vocab = engine.model_config.vocab_size
    kind = {} if output_kind == "CUMULATIVE" else {"output_kind": output_kind}  # older trees
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kind)
    for i, k in enumerate(prompt_lens):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(2, vocab, int(k)).tolist()},
                           params, stream=stream)
    for _ in range(20):  # prefill everything (steps of up to 8192 tokens), then decode
        engine.step()
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running):
            break
    if engine.scheduler.num_running != num_seqs:
        raise RuntimeError("not every sequence is running")
    return engine


def timed_steps(engine, device: FakeDevice, steps: int) -> list[float]:
    engine.runner.dispatch = device.dispatch
    return _step_walls(engine, steps)


def _step_walls(engine, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps, after 3 untimed ones."""
    for _ in range(3):
        engine.step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    return walls


def calibration() -> float:
    """Seconds of a fixed pure-Python loop: run between the timed steps, it tells how fast
    this (shared, noisy) CPU ran Python meanwhile, so runs can be compared as ratios."""
    t = time.perf_counter()
    x = 0
    for i in range(20000):
        x += i * i % 7
    return time.perf_counter() - t


def host_cost(engine, steps: int) -> dict:
    """Median host ms per step with an instant fake device, the calibration loop's median
    between them, their ratio, and (overlapped) the median ms of each part of a step."""
    engine.runner.dispatch = FakeDevice(0.0).dispatch
    for _ in range(3):
        engine.step()
    parts = {"schedule": (engine.scheduler, "schedule"),
             "launch": (engine, "_launch"),  # inputs, sampling arrays, dispatch
             "outputs": (engine, "_process_tokens"),
             "update_after_step": (engine.scheduler, "update_after_step")}
    spent: dict = {name: [] for name in parts}
    originals = {name: getattr(obj, attr) for name, (obj, attr) in parts.items()}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            result = fn(*a, **k)
            spent[name].append(time.perf_counter() - t)
            return result
        return call

    for name, (obj, attr) in parts.items():
        setattr(obj, attr, timed(name, originals[name]))
    walls, cpus, calib = [], [], []
    try:
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            engine.step()
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
            calib.append(calibration())
    finally:
        for name, (obj, attr) in parts.items():
            setattr(obj, attr, originals[name])
    wall, reference = statistics.median(walls), statistics.median(calib)
    # cpu_ms: this thread's CPU time, which other processes on a shared machine disturb
    # less than the wall time (they still slow its caches)
    return {"ms": round(1e3 * wall, 3), "cpu_ms": round(1e3 * statistics.median(cpus), 3),
            "calibration_ms": round(1e3 * reference, 3),
            "x_calibration": round(wall / reference, 3),
            "parts_ms": {name: round(1e3 * statistics.median(v), 3)
                         for name, v in spent.items() if v}}


def async_engine_thread(model, num_seqs: int, steps: int, cache_dir,
                        chunks: bool = False, device_ms: float = 0.0,
                        stream_interval: int = 1, whole: str | None = None) -> dict:
    """What the server's engine thread spends per step: AsyncLLM around an overlapped engine
    of `num_seqs` streamed DELTA decodes (instant fake device), each request's outputs read by a
    coroutine on an event loop in another thread, as the server's handlers read them
    (`chunks`: each also made into the server's SSE chunk, as a streamed chat completion).
    Median ms from one `engine.step()` start to the next (the step, the stats, handing
    the outputs to the event loop, the listeners; and whatever the loop thread holds the
    GIL for meanwhile), and the calibration loop timed on a third thread afterwards.
    `stream_interval`: the engine option, an output every that many tokens. `whole`: the
    requests are whole (non-streamed) responses with outputs of that kind, each read into
    its Job (the server's non-streamed handler), with the server's step listener
    (`Metrics.on_step`) on the engine thread."""
    import asyncio
    import threading

    from serving.engine.async_llm import AsyncLLM, RequestStream
    engine = decoding_engine(model, num_seqs, steps, True, cache_dir, stream=True,
                             output_kind=whole or "DELTA",  # what the server asks for
                             stream_interval=stream_interval)
    engine.runner.dispatch = FakeDevice(device_ms / 1e3).dispatch
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    received = [0]
    if chunks or whole:
        from serving.metrics.prometheus import Metrics
        metrics = Metrics(_NoEngine(), "m")

    async def read(stream):
        job = (streamed_chat_job(metrics, engine.model_config.vocab_size)
               if chunks or whole else None)
        while True:
            output = await stream.get()
            received[0] += 1
            if whole:
                job.add(0, output)
            elif job is not None:
                job.sse_chunks(0, output)

    readers: list[asyncio.Task] = []

    async def start():
        streams = {}
        for request_id in engine.request_ids():
            streams[request_id] = RequestStream(loop, asyncio.Queue())
            readers.append(loop.create_task(read(streams[request_id].queue)))
        return streams

    async def stop():
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

    streams = asyncio.run_coroutine_threadsafe(start(), loop).result()
    starts: list[float] = []
    step = engine.step

    def timed_step():
        starts.append(time.perf_counter())
        return step()

    engine.step = timed_step  # type: ignore[method-assign]
    llm = AsyncLLM(engine=engine)
    if whole:
        llm.step_listeners.append(metrics.on_step)
    llm._streams.update(streams)  # the streams AsyncLLM.generate would have registered
    while len(starts) < steps + 5:
        time.sleep(0.01)
    llm.shutdown()
    asyncio.run_coroutine_threadsafe(stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    gaps = [b - a for a, b in zip(starts[5:], starts[6:])]
    reference = statistics.median(calibration() for _ in range(20))
    wall = statistics.median(gaps)
    return {"ms": round(1e3 * wall, 3), "calibration_ms": round(1e3 * reference, 3),
            "x_calibration": round(wall / reference, 3), "outputs_read": received[0]}


def fake_device_runs(args) -> dict:
    out: dict = {"host_ms_per_step": {}, "fake_device": {}}
    for n in args.seqs:
        row: dict = {}
        # tokens to outlive the host-cost steps and, per device duration, three runs of
        # the overlapped engine (decoding_engine gives 3 * budget + 32)
        runs = 1 + (0 if args.host_only else 3 * len(args.device_ms))
        budget = -(-(args.steps + 3) * runs // 3)
        engines = {mode: decoding_engine(args.model, n, budget, mode == "overlapped",
                                         args.compilation_cache_dir, not args.final_only)
                   for mode in ("serial", "overlapped")}
        for mode, engine in engines.items():
            row[mode] = host_cost(engine, args.steps)
        if not args.final_only:
            row["async_llm_thread"] = async_engine_thread(
                args.model, n, args.steps, args.compilation_cache_dir,
                stream_interval=args.stream_interval)
            row["async_llm_thread_sse_chunks"] = async_engine_thread(
                args.model, n, args.steps, args.compilation_cache_dir, chunks=True,
                stream_interval=args.stream_interval)
        if args.whole_responses:  # non-streamed requests: per-step DELTA, or final only
            for kind in ("DELTA", "FINAL_ONLY"):
                row[f"async_llm_whole_{kind.lower()}"] = async_engine_thread(
                    args.model, n, args.steps, args.compilation_cache_dir, whole=kind)
        out["host_ms_per_step"][str(n)] = row
        for d in ([] if args.host_only else args.device_ms):
            cell: dict = {}
            for mode, engine in engines.items():
                walls = timed_steps(engine, FakeDevice(d / 1e3), args.steps)
                wall = statistics.median(walls)
                cell[mode] = {"wall_ms": round(1e3 * wall, 3),
                              "efficiency": round(d / 1e3 / wall, 3)}
            # As a GPU runs the step: its call holds the calling thread (the overlapped
            # loop's device calls from the engine's thread, then from the dispatch thread)
            cell.update({f"overlapped_{k}": v for k, v in blocking_call_runs(
                engines["overlapped"], d / 1e3, args.steps).items()})
            if not args.final_only:  # the server's way: AsyncLLM, a chat SSE chunk per output
                served = async_engine_thread(args.model, n, args.steps,
                                             args.compilation_cache_dir, chunks=True,
                                             device_ms=d, stream_interval=args.stream_interval)
                cell["async_llm_sse_chunks"] = {"wall_ms": served["ms"],
                                                "efficiency": round(d / served["ms"], 3)}
            out["fake_device"].setdefault(f"{d:g}ms", {})[str(n)] = cell
        print(json.dumps({"seqs": n, **{m: r["ms"] for m, r in row.items()}}),
              file=sys.stderr, flush=True)
    return out


def install_fake_device(engine, device_ms: float) -> None:
    """An `MPAsyncLLM` engine hook: in the engine's process, the fake device of d ms."""
    engine.runner.dispatch = FakeDevice(device_ms / 1e3).dispatch


def served_cell(kind: str, args, num_seqs: int, device_ms: float) -> dict:
    """`num_seqs` streamed DELTA requests through `generate` of AsyncLLM (`kind` "thread")
    or MPAsyncLLM ("process"), each output made into a chat SSE chunk by its reader:
    the engine's step period while every sequence decodes, and d / period."""
    import asyncio
    import threading

    from serving.core.request import SamplingParams
    from serving.metrics.prometheus import Metrics
    warmup = 5
    max_tokens = args.steps + warmup + 40
    rng = np.random.default_rng(num_seqs)
    prompt_lens = rng.integers(32, 257, size=num_seqs)
    pages = 1 + sum(-(-(int(k) + max_tokens) // 16) for k in prompt_lens)
    engine_args = dict(max_num_seqs=max(num_seqs, 8), max_num_batched_tokens=8192,
                       max_model_len=1024, num_gpu_blocks_override=pages + 16,
                       precompile=False, show_progress=False,
                       compilation_cache_dir=args.compilation_cache_dir,
                       stream_interval=args.stream_interval)
    if kind == "process":
        from serving.engine.process import MPAsyncLLM
        llm = MPAsyncLLM(args.model, engine_hook=("benchmarks.engine_overlap",
                                                  "install_fake_device", (device_ms,)),
                         **engine_args)
    else:
        from serving.engine.async_llm import AsyncLLM
        llm = AsyncLLM(args.model, **engine_args)
        install_fake_device(llm.engine, device_ms)
    vocab = llm.engine.model_config.vocab_size
    steps: list[tuple[float, int]] = []  # (token_time, tokens appended) per step
    llm.step_listeners.append(
        lambda info, outputs: steps.append((info["token_time"], info["num_generated"]))
        if "token_time" in info else None)
    metrics = Metrics(_NoEngine(), "m")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind="DELTA")
    received = [0]

    async def read(i: int, prompt: list[int]) -> None:
        job = streamed_chat_job(metrics, vocab)
        async for output in llm.generate({"prompt_token_ids": prompt}, params,
                                         request_id=str(i)):
            received[0] += 1
            job.sse_chunks(0, output)

    async def run() -> None:
        await asyncio.gather(*(read(i, rng.integers(2, vocab, int(k)).tolist())
                               for i, k in enumerate(prompt_lens)))

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    thread.join()
    llm.shutdown()
    loop.close()
    decoding = [t for t, n in steps if n == num_seqs]  # every sequence decoding
    gaps = [b - a for a, b in zip(decoding[warmup:], decoding[warmup + 1:])][:args.steps]
    period = statistics.median(gaps)
    return {"step_ms": round(1e3 * period, 3),
            "efficiency": round(device_ms / 1e3 / period, 3) if device_ms else None,
            "decode_steps": len(gaps), "outputs_read": received[0]}


def server_runs(args) -> dict:
    """`served_cell` for every N and d, the engine on a thread and in its own process in
    turns (the order swapped every round)."""
    kinds, cells = ("thread", "process"), {}
    for n in args.seqs:
        for d in args.device_ms:
            runs: dict = {kind: [] for kind in kinds}
            for r in range(args.rounds):
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    runs[kind].append(served_cell(kind, args, n, d))
            summary = {kind: {"step_ms": [c["step_ms"] for c in cell],
                              "efficiency": [c["efficiency"] for c in cell],
                              "outputs_read": cell[0]["outputs_read"]}
                       for kind, cell in runs.items()}
            cells[f"{n} seqs, d={d:g} ms"] = summary
            print(json.dumps({"seqs": n, "device_ms": d, **summary}), file=sys.stderr,
                  flush=True)
    return cells


def real_model(args) -> dict:
    """The shipped tiny model on this CPU, serial, overlapped, and overlapped with its
    device calls from the dispatch thread (off on a CPU by default: what it costs where
    calls return at once), same greedy workload (with --penalties: penalised), each mode
    twice."""
    from qwen_jax import LLM, SamplingParams
    rng = np.random.default_rng(0)
    results, report = {}, {}
    modes = ("serial", "overlapped", "overlapped_dispatch_thread")
    for mode in modes + tuple(m + "_again" for m in modes):
        llm = LLM(model=args.model, max_num_seqs=64, max_num_batched_tokens=512,
                  max_model_len=512, show_progress=False,
                  compilation_cache_dir=args.compilation_cache_dir,
                  async_scheduling=mode.startswith("overlapped"))
        llm.llm_engine.runner.dispatch_thread = "dispatch_thread" in mode
        vocab = llm.llm_engine.model_config.vocab_size
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(2, vocab, int(k)).tolist()}
                   for k in rng.integers(8, 128, size=args.num_requests)]
        penalties = (dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
                     if args.penalties else {})
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                **penalties)
        llm.generate(prompts[:8], params)  # warm
        before = llm.stats()["num_overlapped_steps"]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[mode] = [o.outputs[0].token_ids for o in outs]
        report[mode] = {"seconds": round(seconds, 3),
                        "output_tok_per_s": round(tokens / seconds, 1),
                        "overlapped_steps": llm.stats()["num_overlapped_steps"] - before}
    best = {m: max(report[m]["output_tok_per_s"], report[m + "_again"]["output_tok_per_s"])
            for m in modes}
    report["overlapped_over_serial"] = round(best["overlapped"] / best["serial"], 3)
    report["dispatch_thread_over_overlapped"] = round(
        best["overlapped_dispatch_thread"] / best["overlapped"], 3)
    report["same_tokens"] = all(results[m] == results["serial"] for m in results)
    return report


def vocab_work(args) -> dict:
    """The vocabulary-wide part of a step at Qwen3's vocabulary: lm-head matmul alone, then
    matmul + sampler for greedy rows, for temperature / top-p / top-k rows (logits peaked
    as a trained model's, and flat, where the candidates cannot decide top-p), and greedy
    with logprobs asked. Per case the matmul and the step(s) take turns, so each ratio
    to the matmul is of neighbouring calls: its median and range, milliseconds (median)
    and page faults per call (the process's minor faults: fresh scratch memory)."""
    import jax
    import jax.numpy as jnp

    from serving.core.request import SamplingParams
    from serving.sample import sampler
    s, h, v = args.vocab_seqs, args.vocab_hidden, args.vocab_size
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.normal(size=(h, v)).astype(np.float32) / np.sqrt(h))
    matmul = jax.jit(lambda x: x @ weight)
    samplers = {"after": sampler}
    if args.baseline_sampler:
        samplers["before"] = _load_sampler(args.baseline_sampler)
    # The whole SamplerOutput: the token ids alone would let XLA drop the logprobs.
    steps = {name: jax.jit(lambda x, sa, m=m: m.sample(x @ weight, sa))
             for name, m in samplers.items()}

    def arrays(module, params):
        entries = [module.SamplingEntry(params, i, 0, (), None, 0) for i in range(s)]
        return jax.device_put(module.build_sampling_arrays(entries, s, 16, v))

    peaked = jnp.asarray(rng.normal(size=(s, h)).astype(np.float32) * 6.0)
    flat = peaked * (0.05 / 6.0)
    cases = {
        "greedy": (peaked, SamplingParams(temperature=0.0)),
        "greedy_logprobs_20": (peaked, SamplingParams(temperature=0.0, logprobs=20)),
        "temperature_top_p_top_k": (peaked, SamplingParams(temperature=0.8, top_p=0.9,
                                                           top_k=50)),
        "top_p_peaked": (peaked, SamplingParams(temperature=0.8, top_p=0.9)),
        "top_p_flat_logits": (flat, SamplingParams(temperature=0.8, top_p=0.9)),
        "temperature_only": (peaked, SamplingParams(temperature=0.8)),
    }
    out: dict = {"num_seqs": s, "hidden": h, "vocab": v}
    for name, (x, params) in cases.items():
        calls = {"lm_head": (matmul, (x,))}
        calls.update({k: (steps[k], (x, arrays(samplers[k], params))) for k in steps})
        times, faults = _take_turns(calls, args.vocab_repeats)
        out[name] = {"lm_head_ms": round(1e3 * statistics.median(times["lm_head"]), 2)}
        for k in steps:
            ratios = [a / b for a, b in zip(times[k], times["lm_head"])]
            out[name][k] = {"ms": round(1e3 * statistics.median(times[k]), 2),
                            "x_lm_head": round(statistics.median(ratios), 2),
                            "x_range": [round(min(ratios), 2), round(max(ratios), 2)],
                            "page_faults": faults[k]}
    return out


def _take_turns(calls: dict, repeats: int):
    """Each call once to compile, then `repeats` rounds of one call each: seconds per call,
    and the median minor page faults per call."""
    import resource

    import jax
    for fn, fn_args in calls.values():
        jax.block_until_ready(fn(*fn_args))
    times: dict = {k: [] for k in calls}
    faults: dict = {k: [] for k in calls}
    for _ in range(repeats):
        for k, (fn, fn_args) in calls.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[k].append(time.perf_counter() - t)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return times, {k: int(statistics.median(f)) for k, f in faults.items()}


def _load_sampler(path: str):
    """Another version of serving/sample/sampler.py as a module of its own. It registers
    serving.structured_output.token_mask.TokenMask as a pytree again, which is already done:
    skipped."""
    import importlib.util
    from unittest import mock

    import jax

    from serving.structured_output.token_mask import TokenMask
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    register = jax.tree_util.register_dataclass

    def register_once(cls, *a, **k):
        return cls if cls is TokenMask else register(cls, *a, **k)

    with mock.patch.object(jax.tree_util, "register_dataclass", register_once):
        spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict:
    args = parse_args(argv)
    report: dict = {"args": vars(args)}
    if args.server:
        report["server"] = server_runs(args)
    else:
        if not (args.host_only or args.skip_vocab):
            report["vocab_work"] = vocab_work(args)
            print(json.dumps(report["vocab_work"]), file=sys.stderr, flush=True)
        if not args.skip_engine:
            report.update(fake_device_runs(args))
            if not (args.skip_real or args.host_only):
                report["tiny_model_cpu"] = real_model(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
