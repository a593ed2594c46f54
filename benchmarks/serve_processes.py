"""The server's way at many streams: the engine on a thread of the server's process
(`AsyncLLM`) against the engine in a process of its own (`MPAsyncLLM`, `qwen-jax serve`'s
default), against a fake device step of d ms. Prints one JSON object.

Each cell submits N streamed requests through `generate` (DELTA outputs, as the server
asks), each read by a coroutine on an event loop that makes every output into a chat SSE
chunk (the server's per-output work: `Job.sse_chunks`), while the engine decodes
them all against a fake device that takes d ms a step and lets the host run meanwhile.
The figure is the engine's step period while all N decode: the median gap between the
monotonic times at which consecutive steps' tokens reached the host (the step stats'
`token_time`, read the same way for both). Overlap efficiency is d / that period. The two
kinds run in turns, `--rounds` times.

    PYTHONPATH=. python benchmarks/serve_processes.py --seqs 64 256 --device-ms 5 12
    PYTHONPATH=. python benchmarks/serve_processes.py --send-cost --seqs 256 --rounds 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 5.0, 12.0])
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per cell")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--kinds", nargs="+", default=["thread", "process"],
                   choices=("thread", "process"))
    p.add_argument("--compilation-cache-dir", default="default")
    p.add_argument("--send-cost", action="store_true",
                   help="instead: the engine process's step and send at --seqs, outputs "
                        "built as wire tuples against RequestOutputs (--rounds turns)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def install_fake_device(engine, device_ms: float) -> None:
    """In the engine's process: the device replaced by `engine_overlap`'s fake one."""
    from benchmarks.engine_overlap import FakeDevice
    engine.runner.dispatch = FakeDevice(device_ms / 1e3).dispatch


def served_cell(kind: str, args, num_seqs: int, device_ms: float) -> dict:
    from benchmarks.stream_chunks import _NoEngine, streamed_job
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
        llm = MPAsyncLLM(args.model, engine_hook=("benchmarks.serve_processes",
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
        job = streamed_job("chat", metrics, vocab)
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


def send_cost(num_seqs: int, rounds: int, cache_dir) -> dict:
    """The engine process's own work per step at `num_seqs` streamed DELTA decodes (instant
    fake device): `engine.step()` and pickling its message, with the outputs built as the
    wire tuples it sends (`wire_output`, what the engine process does) against built as
    RequestOutputs and then taken apart into the same tuples. Two engines, turns of 5
    steps, the order swapped every round; ms per step and the per-round ratio."""
    import pickle

    from benchmarks.engine_overlap import decoding_engine
    from serving.engine.process import _completion_fields, wire_output

    def taken_apart(o):
        return wire_output(o.request_id, o.prompt, o.prompt_token_ids, o.prompt_logprobs,
                           [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                             c.finish_reason, c.stop_reason) for c in o.outputs],
                           o.finished, o.metrics, o.num_cached_tokens, o.error)

    engines = {kind: decoding_engine(None, num_seqs, 6 * rounds + 10, True, cache_dir,
                                     output_kind="DELTA") for kind in ("objects", "wire")}
    wire = engines["wire"].output_processor
    wire.make_output, wire.make_completion = wire_output, _completion_fields
    encode = {"objects": lambda outputs: [taken_apart(o) for o in outputs],
              "wire": lambda outputs: outputs}
    times: dict = {kind: [] for kind in engines}
    for r in range(rounds):
        for kind in (("objects", "wire") if r % 2 == 0 else ("wire", "objects")):
            engine = engines[kind]
            t = time.perf_counter()
            for _ in range(5):
                outputs = engine.step()
                pickle.dumps(("step", engine.last_step, engine.stats(), encode[kind](outputs)),
                             protocol=pickle.HIGHEST_PROTOCOL)
            times[kind].append((time.perf_counter() - t) / 5)
    ratios = sorted(w / o for w, o in zip(times["wire"], times["objects"]))
    return {"seqs": num_seqs, "rounds": rounds,
            "ms_per_step": {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()},
            "wire_over_objects": {"q1": round(ratios[len(ratios) // 4], 3),
                                  "median": round(statistics.median(ratios), 3),
                                  "q3": round(ratios[3 * len(ratios) // 4], 3)}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.send_cost:
        report = {n: send_cost(n, args.rounds, args.compilation_cache_dir) for n in args.seqs}
        print(json.dumps(report, indent=1))
        return report
    report: dict = {"args": vars(args), "cells": {}}
    for n in args.seqs:
        for d in args.device_ms:
            cell: dict = {kind: [] for kind in args.kinds}
            for r in range(args.rounds):
                for kind in args.kinds if r % 2 == 0 else args.kinds[::-1]:
                    cell[kind].append(served_cell(kind, args, n, d))
            summary = {kind: {"step_ms": [c["step_ms"] for c in runs],
                              "efficiency": [c["efficiency"] for c in runs],
                              "outputs_read": runs[0]["outputs_read"]}
                       for kind, runs in cell.items()}
            report["cells"][f"{n} seqs, d={d:g} ms"] = summary
            print(json.dumps({"seqs": n, "device_ms": d, **summary}), file=sys.stderr,
                  flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
