"""The server's event-loop work per streamed output: what `Job.sse_chunks` (the metrics
tracker, the delta of text and tokens, the chat reply's delta, the JSON) costs for one
RequestOutput of a streamed request, as the server's handlers run it for every output of
every stream. Prints JSON: microseconds per output, median of the repeats.

    PYTHONPATH=. python benchmarks/stream_chunks.py [--tokens 300] [--repeats 15]

Run it on two checkouts in turn for a before/after (it only needs `serving`; checkouts
before `sse_chunks` had `Job.chunks` and `sse`, which it falls back to).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from serving.core.request import CompletionOutput, RequestMetrics, RequestOutput
from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.outputs import Job
from serving.metrics.prometheus import Metrics


class _NoEngine:
    """Metrics' engine collector reads stats only when scraped; nothing scrapes here."""

    engine = None

    def stats(self) -> dict:
        return {}


def outputs(num_tokens: int) -> list[RequestOutput]:
    """The DELTA outputs of one stream (what the server asks the engine for), a token
    (two characters) per step."""
    return [RequestOutput("x", None, [1] * 10, None, [CompletionOutput(0, "ab", [5])], False,
                          RequestMetrics(arrival_time=0.0)) for _ in range(num_tokens)]


def streamed_job(kind: str, metrics: Metrics, vocab_size: int = 1000) -> Job:
    """What the server keeps for one streamed chat or completions request."""
    if kind == "chat":
        req = proto.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                "stream": True, "max_tokens": 4000}, vocab_size)
        prompt_param, job_kind = "messages", "chatcmpl"
    else:
        req = proto.parse_completion({"model": "m", "prompt": "hi", "stream": True,
                                      "max_tokens": 4000}, vocab_size)
        prompt_param, job_kind = "prompt", "cmpl"
    params = [proto.sampling_params(req, 10, 8192, prompt_param)]
    return Job(kind=job_kind, request_id="x", model="m", req=req, prompts=[[1] * 10],
               params=params, metrics=metrics)


def events(job: Job, output: RequestOutput) -> list[bytes]:
    if hasattr(job, "sse_chunks"):
        return job.sse_chunks(0, output)
    from serving.entrypoints.openai.outputs import sse  # older checkouts
    return [sse(chunk) for chunk in job.chunks(0, output)]


def per_output_us(kind: str, stream: list[RequestOutput], repeats: int) -> dict:
    metrics = Metrics(_NoEngine(), "m")
    runs = []
    for _ in range(repeats):
        job = streamed_job(kind, metrics)
        num_chunks = 0
        t = time.perf_counter()
        for output in stream:
            num_chunks += len(events(job, output))
        runs.append((time.perf_counter() - t) / len(stream) * 1e6)
    return {"median": round(statistics.median(runs), 2), "min": round(min(runs), 2),
            "chunks_per_pass": num_chunks}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=300, help="outputs (tokens) per stream")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    stream = outputs(args.tokens)
    report = {"tokens": args.tokens, "repeats": args.repeats,
              "us_per_output": {kind: per_output_us(kind, stream, args.repeats)
                                for kind in ("chat", "completions")}}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
