"""`qwen-jax bench serve`: an aiohttp load generator for any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from serving.bench.datasets import BenchRequest, build_requests, load_tokenizer
from serving.bench.report import RequestResult, compute_metrics, format_table, parse_goodput

CHAT_ENDPOINT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
# Any server's gauges: ours (qwen_jax: or vllm:), vLLM's, SGLang's.
_GAUGE = re.compile(r"^[a-z_]+:num_requests_(running|waiting)(?:\{[^}]*\})?\s+(\S+)", re.M)
# vLLM's speculative-decoding counters (ours are under both prefixes: vllm: once)
_SPEC = re.compile(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)(?:_total)?"
                   r"(?:\{[^}]*\})?\s+(\S+)", re.M)


def build_payload(request: BenchRequest, *, model: str | None, chat: bool,
                  ignore_eos: bool) -> dict:
    payload = {"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    if ignore_eos:
        payload["ignore_eos"] = True
    if chat:
        messages = request.messages or (
            ([{"role": "system", "content": request.system}] if request.system else [])
            + [{"role": "user", "content": request.prompt}])
        payload.update(messages=messages, max_completion_tokens=request.output_len)
    else:
        # Text, or token ids (then the system prefix is ids too).
        prompt: Any = request.prompt if request.prompt is not None else " ".join(
            str(m.get("content", "")) for m in request.messages or ())
        if request.system:
            prompt = request.system + prompt
        payload.update(prompt=prompt, max_tokens=request.output_len)
    return payload


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def _read_stream(response, result: RequestResult, started: float, chat: bool) -> int:
    """Fills ttft/itl/latency/text/usage from the SSE stream; returns the chunk count."""
    num_chunks, last = 0, started
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators and ": keep-alive" comments
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"error in stream: {chunk['error']}")
        if choices := chunk.get("choices"):
            now = time.perf_counter()
            if num_chunks == 0:
                result.ttft = now - started
            else:
                result.itl.append(now - last)
            last = now
            num_chunks += 1
            result.generated_text += _chunk_text(choices[0], chat)
        if usage := chunk.get("usage"):
            result.output_tokens = usage.get("completion_tokens") or 0
            result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    result.latency = last - started
    return num_chunks


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict,
                       request: BenchRequest, chat: bool, tokenizer=None) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    started = time.perf_counter()
    result.start = started  # made relative to the run's start by run_benchmark
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {body}"
                return result
            num_chunks = await _read_stream(response, result, started, chat)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RuntimeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if num_chunks == 0:
        result.error = "the stream ended without a chunk to time TTFT by"
        return result
    if not result.output_tokens:  # a server without usage: count tokens ourselves
        result.output_tokens = (len(tokenizer.encode(result.generated_text)) if tokenizer
                                else num_chunks)
    result.success = True
    return result


async def arrivals(requests: list[BenchRequest], rate: float, burstiness: float,
                   rng: np.random.Generator):
    """Yields requests spaced by gamma(shape=burstiness, mean=1/rate) gaps (Poisson at 1)."""
    for i, request in enumerate(requests):
        yield request
        if rate != float("inf") and i < len(requests) - 1:
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def _scrape(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The server's /metrics text; None without it."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def server_gauges(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """Running and waiting requests from the server's /metrics; None without them."""
    text = await _scrape(session, base_url)
    found = {"running": 0.0, "waiting": 0.0}
    matches = _GAUGE.findall(text or "")
    for kind, value in matches:
        found[kind] += float(value)
    return found if matches else None


async def spec_decode_counts(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """The server's speculative-decoding counters (drafts, draft_tokens, accepted_tokens,
    summed over its engines); None without them."""
    found = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    matches = _SPEC.findall(await _scrape(session, base_url) or "")
    for kind, value in matches:
        found[kind] += float(value)
    return found if matches else None


def spec_decode_report(before: dict | None, after: dict | None) -> dict:
    """vLLM's bench serve figures over the run: mean acceptance length (1 + accepted per
    draft), acceptance rate (accepted per draft token), the counts; {} without counters
    or drafts."""
    if before is None or after is None:
        return {}
    delta = {kind: after[kind] - before[kind] for kind in after}
    if delta["drafts"] <= 0:
        return {}
    return {"spec_decode_num_drafts": int(delta["drafts"]),
            "spec_decode_num_draft_tokens": int(delta["draft_tokens"]),
            "spec_decode_num_accepted_tokens": int(delta["accepted_tokens"]),
            "spec_decode_mean_acceptance_length": 1 + delta["accepted_tokens"] / delta["drafts"],
            "spec_decode_acceptance_rate": (delta["accepted_tokens"] / delta["draft_tokens"]
                                            if delta["draft_tokens"] else 0.0)}


class Timeline:
    """Samples of the run every `interval` s: the client's requests in flight and, while
    the server exposes them, its running and waiting gauges."""

    def __init__(self, interval: float):
        self.interval = interval
        self.in_flight = 0
        self.data: dict[str, list] = {"t": [], "in_flight": [], "running": [], "waiting": []}

    async def sample(self, session, base_url: str, started: float) -> None:
        query = True
        while True:
            query = await self.sample_once(session, base_url, started, query)
            await asyncio.sleep(self.interval)

    async def sample_once(self, session, base_url: str, started: float,
                          query: bool = True) -> bool:
        """One sample; returns whether the server answered with its gauges (once it has
        not, only the client's count is sampled)."""
        gauges = await server_gauges(session, base_url) if query else None
        self.data["t"].append(round(time.perf_counter() - started, 3))
        self.data["in_flight"].append(self.in_flight)
        if gauges is not None:
            self.data["running"].append(gauges["running"])
            self.data["waiting"].append(gauges["waiting"])
        return gauges is not None

    def report(self) -> dict:
        data = dict(self.data)
        if len(data["running"]) != len(data["t"]):  # the server stopped answering: drop them
            data["running"] = data["waiting"] = []
        return data


async def run_benchmark(requests: list[BenchRequest], *, base_url: str, endpoint: str,
                        model: str | None, request_rate: float, burstiness: float,
                        max_concurrency: int | None, seed: int, ignore_eos: bool,
                        tokenizer=None, warmup: bool = True, metrics_interval: float = 0.0
                        ) -> tuple[list[RequestResult], float, dict, dict]:
    """(results, duration, timeline, speculative-decoding figures: spec_decode_report);
    each result's `start` is seconds into the run."""
    url = base_url.rstrip("/") + endpoint
    chat = endpoint == CHAT_ENDPOINT
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeline = Timeline(metrics_interval)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        async def one(request: BenchRequest) -> RequestResult:
            payload = build_payload(request, model=model, chat=chat, ignore_eos=ignore_eos)
            async with limit or contextlib.nullcontext():
                timeline.in_flight += 1
                try:
                    return await send_request(session, url, payload, request, chat, tokenizer)
                finally:
                    timeline.in_flight -= 1

        if warmup:  # fail fast on a wrong URL or model name, before timing anything
            probe = await one(requests[0])
            if not probe.success:
                raise RuntimeError(f"test request to {url} failed: {probe.error}")
        spec_before = await spec_decode_counts(session, base_url)
        started = time.perf_counter()
        sampler = (asyncio.create_task(timeline.sample(session, base_url, started))
                   if metrics_interval > 0 else None)
        tasks = [asyncio.create_task(one(r)) async for r in
                 arrivals(requests, request_rate, burstiness, np.random.default_rng(seed))]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        if sampler is not None:
            sampler.cancel()
            await timeline.sample_once(session, base_url, started,  # the idle end
                                       query=bool(timeline.data["running"]))
        for r in results:
            r.start -= started
        spec = spec_decode_report(spec_before, await spec_decode_counts(session, base_url))
        return list(results), duration, timeline.report(), spec


def _percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not all(0 < p < 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100), got {text!r}")
    return values


def _validate(args) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.metrics_interval < 0:
        raise ValueError(f"--metrics-interval must be >= 0, got {args.metrics_interval}")
    if (args.plot_results or args.plot_labels) and not args.plot:
        raise ValueError("--plot-results and --plot-labels go with --plot FILE.png")
    if args.plot:  # before the run, not after it
        from serving.bench.plot import require_matplotlib
        require_matplotlib()


def bench_serve(args) -> dict:
    """Runs the benchmark `args` describe; prints the table, returns (and saves) the JSON."""
    _validate(args)
    slos = parse_goodput(args.goodput)
    percentiles = _percentiles(args.metric_percentiles)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer)
    results, duration, timeline, spec = asyncio.run(run_benchmark(
        requests, base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=args.ignore_eos,
        tokenizer=tokenizer, warmup=not args.no_warmup, metrics_interval=args.metrics_interval))
    report = {**compute_metrics(results, duration, percentiles=percentiles, slos_ms=slos),
              **spec}
    print(format_table(report, percentiles))
    report = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url,
              "endpoint": args.endpoint, "model_id": args.model, "dataset": args.dataset,
              "num_prompts": len(requests), "request_rate": str(args.request_rate),
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "goodput_slos_ms": slos or None, **report,
              "errors": [r.error for r in results if not r.success][:20], "timeline": timeline}
    if args.save_detailed or args.plot:
        report.update(input_lens=[r.prompt_len for r in results],
                      output_lens=[r.output_tokens for r in results],
                      ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                      e2els=[r.latency for r in results],
                      start_times=[round(r.start, 6) for r in results],
                      successes=[r.success for r in results])
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        from serving.bench.plot import plot_results
        print(f"plot: {plot_results([(args.model or 'run', report)], args.plot)}")
    return report


def plot_files(args) -> str:
    """`--plot FILE --plot-results A.json B.json ...`: no benchmark, only the figure."""
    from serving.bench.plot import load_results, plot_results
    if not args.plot:
        raise ValueError("--plot-results needs --plot FILE.png")
    return plot_results(load_results(args.plot_results, args.plot_labels), args.plot)
