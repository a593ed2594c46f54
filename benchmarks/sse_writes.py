"""What the server's process spends per streamed output over real HTTP: the API process's
CPU time per output (its event loop and `MPAsyncLLM`'s reader thread), how many
`response.write` calls the outputs took, the engine's step period while every stream
decodes, and output tokens per second. Prints one JSON object.

The real application (`build_app`) serves N streamed `/v1/completions` requests (token-id
prompts, `ignore_eos`) from an engine process whose device is `engine_overlap`'s fake
one (d ms a step, the host running meanwhile); a client process of its own opens them all
at once and reads every chunk. The API process's CPU time is taken from the moment the
client opens the streams to the moment the last one ends, per output token (N x
max_tokens), `--rounds` times, each a fresh engine. With an instant device the engine
outruns the API process, which is then the bottleneck: the regime this measures.

    PYTHONPATH=. python benchmarks/sse_writes.py --seqs 256 --device-ms 0 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 5.0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compilation-cache-dir", default="default")
    p.add_argument("--client", nargs=3, metavar=("URL", "N", "MAX_TOKENS"),
                   help=argparse.SUPPRESS)  # the client process's own entry
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


async def client(url: str, num: int, max_tokens: int) -> None:
    """N streams at once, each read to its end; prints "begin" as it opens them and "done"
    when all have ended (the server's process times between)."""
    import aiohttp

    async def one(session, model: str, i: int) -> None:
        body = {"model": model, "prompt": [2 + (i + j) % 500 for j in range(32 + i % 64)],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0.0}
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            async for _ in response.content:  # one line at a time: SSE events are lines
                pass

    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.get(url.replace("/v1/completions", "/v1/models")) as response:
            model = (await response.json())["data"][0]["id"]
        print("begin", flush=True)
        await asyncio.gather(*(one(session, model, i) for i in range(num)))
        print("done", flush=True)


def cell(args, num_seqs: int, device_ms: float) -> dict:
    from aiohttp import web

    from serving.engine.process import MPAsyncLLM
    from serving.entrypoints.openai.api_server import build_app
    from serving.entrypoints.openai.config import ServerConfig
    pages = 1 + num_seqs * -(-(96 + args.max_tokens) // 16)
    llm = MPAsyncLLM(args.model, engine_hook=("benchmarks.serve_processes", "install_fake_device",
                                              (device_ms,)),
                     max_num_seqs=max(num_seqs, 8), max_num_batched_tokens=8192,
                     max_model_len=1024, num_gpu_blocks_override=pages + 16,
                     precompile=False, show_progress=False,
                     compilation_cache_dir=args.compilation_cache_dir)
    steps: list[tuple[float, int]] = []
    llm.step_listeners.append(
        lambda info, outputs: steps.append((info["token_time"], info["num_generated"]))
        if "token_time" in info else None)
    writes = [0]
    original = web.StreamResponse.write

    async def counted(self, data):
        writes[0] += 1
        return await original(self, data)

    async def run() -> dict:
        web.StreamResponse.write = counted  # type: ignore[method-assign]
        runner = web.AppRunner(build_app(llm, ServerConfig(log_interval=0)),
                               handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", f"http://127.0.0.1:{port}/v1/completions",
            str(num_seqs), str(args.max_tokens), stdout=subprocess.PIPE)
        assert proc.stdout is not None
        marks = []  # (process CPU, wall) at "begin" and at "done"
        for _ in range(2):
            if not (await asyncio.wait_for(proc.stdout.readline(), 600)).strip():
                raise RuntimeError(f"the client process failed ({await proc.wait()})")
            marks.append((time.process_time(), time.perf_counter()))
        await proc.wait()
        await runner.cleanup()
        (cpu0, wall0), (cpu1, wall1) = marks
        return {"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "writes": writes[0]}

    try:
        result = asyncio.run(run())
    finally:
        web.StreamResponse.write = original  # type: ignore[method-assign]
        llm.shutdown()
    times = [t for t, n in steps if n == num_seqs]  # steps where every stream decodes
    gaps = [b - a for a, b in zip(times, times[1:])]
    outputs = num_seqs * args.max_tokens
    return {"api_cpu_us_per_output": round(1e6 * result["cpu_s"] / outputs, 2),
            "api_cpu_share": round(result["cpu_s"] / result["wall_s"], 3),
            "writes_per_output": round(result["writes"] / outputs, 3),
            "decode_step_ms": round(1e3 * statistics.median(gaps), 3) if gaps else None,
            "tokens_per_s": round(outputs / result["wall_s"], 1)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.client:
        url, num, max_tokens = args.client
        asyncio.run(client(url, int(num), int(max_tokens)))
        return {}
    report: dict = {"args": vars(args), "cells": {}}
    for r in range(args.rounds):
        for n in args.seqs:
            for d in args.device_ms:
                result = cell(args, n, d)
                report["cells"].setdefault(f"{n} seqs, {d:g} ms", []).append(result)
                print(json.dumps({"round": r, "seqs": n, "device_ms": d, **result}), flush=True)
    for key, runs in report["cells"].items():
        report["cells"][key] = {
            "runs": runs, "median_api_cpu_us_per_output": round(float(np.median(
                [x["api_cpu_us_per_output"] for x in runs])), 2)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
