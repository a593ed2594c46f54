"""Soak: `qwen-jax serve` at about twice its measured capacity for a bounded time, on
loopback, with the traffic an exposed server sees. Prints one JSON object; exits 0 when
every check passes, 1 otherwise.

    python benchmarks/soak.py [--duration 600] [--load 2.0] [--out FILE] [engine options]

1. Start the server (a subprocess on a loopback port, `--max-waiting` so overload is shed
   with 503 + Retry-After) and ask it a greedy question while it is fresh.
2. Capacity: `--capacity-seconds` of closed-loop traffic, max-num-seqs clients at once, the
   well-formed mix below: completed requests per second.
3. Soak: Poisson arrivals at `--load` x capacity for `--duration` s. Completions and chats,
   half of them streamed; 20% with stop strings, 15% n=2, 20% logprobs; 10% of clients
   disconnect at a random point (after some chunks, or before a non-streamed answer); 5%
   hostile bodies (invalid JSON, wrong types, out-of-range values, an unknown model, a
   prompt over max_model_len, non-UTF-8 bytes, deep nesting, a body over the size limit).
   Every `--sample-interval` s: the server's RSS, KV pages in use, running and waiting.
4. Checks: every request ended: completed, a 4xx (hostile bodies only) or a 503 with
   Retry-After; none hung past `--request-timeout`, no 5xx, no error inside a stream; no KV
   page held once the server is idle; RSS flat after warm-up: the median of the last quarter
   of the soak's samples is within max(32 MiB, 5%) of the first quarter's; the greedy
   question answered exactly as when fresh; SIGTERM drains and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO / "qwen_jax" / "assets" / "tiny-qwen3-moe"
WORDS = ("alpha beta gamma delta sort reverse list number digit code text answer seven "
         "three nine the of and to in is was for on are with as").split()
STOPS = (["\n"], [" the"], ["e"], ["3", "7"])
GREEDY = {"messages": [{"role": "user", "content": "What is 385 + 47?"}], "max_tokens": 32,
          "temperature": 0}
FAILURES = ("hung", "5xx", "stream_error", "truncated", "503_without_retry_after",
            "unexpected_4xx", "hostile_accepted", "connection_error")
RSS_BOUND = (32 * 2**20, 0.05)  # flat: within max(32 MiB, 5%)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--duration", type=float, default=600.0, help="soak seconds")
    p.add_argument("--load", type=float, default=2.0, help="arrival rate / measured capacity")
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--sample-interval", type=float, default=5.0)
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request not ended by then has hung")
    p.add_argument("--max-prompt-words", type=int, default=40)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--url", help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    e = p.add_argument_group("server (when started here)")
    e.add_argument("--max-num-seqs", type=int, default=8)
    e.add_argument("--max-num-batched-tokens", type=int, default=256)
    e.add_argument("--max-model-len", type=int, default=256)
    e.add_argument("--max-waiting", type=int, default=16)
    e.add_argument("--token-buckets", default="8,64,256")
    e.add_argument("--seq-buckets", default="8")
    e.add_argument("--load-format", default="auto")
    e.add_argument("--compilation-cache-dir", default="default")
    return p.parse_args(argv)


# ---- the server ------------------------------------------------------------------------
def start_server(args, log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from serving.cli.main import main; raise SystemExit(main())",
           "serve", "--model", args.model, "--port", str(port), "--served-model-name", "soak",
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len), "--token-buckets", args.token_buckets,
           "--seq-buckets", args.seq_buckets, "--load-format", args.load_format,
           "--compilation-cache-dir", args.compilation_cache_dir, "--log-interval", "0"]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(url: str, proc, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before serving")
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout} s")


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


_METRIC = re.compile(r"^qwen_jax:(kv_cache_used_pages|num_requests_running|"
                     r"num_requests_waiting)\{[^}]*\}\s+(\S+)", re.M)


PROBE_TIMEOUT = aiohttp.ClientTimeout(total=60)  # our own probes: a hung server fails them


async def server_state(session, url: str) -> dict:
    async with session.get(url + "/metrics", timeout=PROBE_TIMEOUT) as r:
        text = await r.text()
    return {name: float(value) for name, value in _METRIC.findall(text)}


# ---- the traffic -----------------------------------------------------------------------
def well_formed(rng: np.random.Generator, args) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS, size=int(rng.integers(3, args.max_prompt_words + 1))))
    body: dict = {"model": args.model_id,
                  "max_tokens": int(rng.integers(4, args.max_output_tokens)),
                  "temperature": float(rng.choice([0.0, 0.8])),
                  "stream": bool(rng.random() < 0.5)}
    chat = bool(rng.random() < 0.5)
    if rng.random() < 0.2:
        body["stop"] = STOPS[int(rng.integers(len(STOPS)))]
    if rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
        return "/v1/chat/completions", body
    body["prompt"] = words
    return "/v1/completions", body


def hostile(rng: np.random.Generator, args) -> tuple[str, bytes]:
    """A body every OpenAI-compatible server must refuse with a 4xx (built only when
    drawn: one is 9 MB)."""
    ok = {"model": args.model_id, "prompt": "hello", "max_tokens": 4}
    dumps = lambda **fields: json.dumps({**ok, **fields}).encode()  # noqa: E731
    bodies = [
        lambda: b"{not json", lambda: b'{"prompt": "\xff\xfe", "max_tokens": 2}',
        lambda: b"[" * 100_000, lambda: dumps(max_tokens="ten"),
        lambda: dumps(temperature=-1), lambda: dumps(top_p=2), lambda: dumps(logprobs=100),
        lambda: dumps(model="no-such-model"),
        lambda: dumps(prompt="word " * (4 * args.max_model_len)),
        lambda: b" " * (9 * 2**20),  # over the default --max-request-body-mb 8
        lambda: json.dumps({"model": args.model_id, "messages": [], "max_tokens": 2}).encode(),
    ]
    index = int(rng.integers(len(bodies)))
    path = "/v1/chat/completions" if index == len(bodies) - 1 else "/v1/completions"
    return path, bodies[index]()


async def _read_stream(response, cut_after: int | None) -> str:
    seen, chunks = False, 0
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "completed" if not seen else "stream_error"
        if '"error"' in line and json.loads(line[6:]).get("error"):
            seen = True
        chunks += 1
        if cut_after is not None and chunks >= cut_after:
            return "disconnected"  # leaving the context closes the connection
    return "truncated"


async def one_request(session, url: str, path: str, body, *, cut_after: int | None,
                      give_up_after: float | None, is_hostile: bool) -> str:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    try:
        post = session.post(url + path, data=data, headers=headers)
        response = await (asyncio.wait_for(post, give_up_after) if give_up_after else post)
        async with response as r:
            if r.status == 200:
                if is_hostile:
                    return "hostile_accepted"
                if isinstance(body, dict) and body.get("stream"):
                    return await _read_stream(r, cut_after)
                await r.read()
                return "completed"
            await r.read()
            if r.status == 503:
                return "shed" if "Retry-After" in r.headers else "503_without_retry_after"
            if 400 <= r.status < 500:
                return "rejected" if is_hostile else "unexpected_4xx"
            return "5xx"
    except asyncio.TimeoutError:
        return "disconnected"  # our own cut of a non-streamed request
    except (aiohttp.ClientError, ConnectionError):
        return "connection_error"


class Traffic:
    """Sends the mix and counts how each request ended."""

    def __init__(self, session, url: str, args, rng: np.random.Generator):
        self.session, self.url, self.args, self.rng = session, url, args, rng
        self.outcomes: dict[str, int] = {}
        self.features = {"stream": 0, "chat": 0, "stop": 0, "n2": 0, "logprobs": 0,
                         "hostile": 0, "disconnect": 0}

    async def send(self, soak: bool) -> None:
        rng, args = self.rng, self.args
        is_hostile = soak and rng.random() < 0.05
        cut_after = give_up = None
        if is_hostile:
            path, body = hostile(rng, args)
            self.features["hostile"] += 1
        else:
            path, body = well_formed(rng, args)
            self._count_features(path, body)
            if soak and rng.random() < 0.1:
                self.features["disconnect"] += 1
                if body["stream"]:
                    cut_after = int(rng.integers(1, 6))
                else:
                    give_up = float(rng.uniform(0.05, 1.0))
        try:
            outcome = await asyncio.wait_for(
                one_request(self.session, self.url, path, body, cut_after=cut_after,
                            give_up_after=give_up, is_hostile=is_hostile),
                self.args.request_timeout)
        except asyncio.TimeoutError:
            outcome = "hung"
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _count_features(self, path: str, body: dict) -> None:
        f = self.features
        f["stream"] += body["stream"]
        f["chat"] += path.endswith("chat/completions")
        f["stop"] += "stop" in body
        f["n2"] += body.get("n") == 2
        f["logprobs"] += "logprobs" in body

    @property
    def num_completed(self) -> int:
        return self.outcomes.get("completed", 0)


# ---- the phases ------------------------------------------------------------------------
async def served_model(session, url: str) -> str:
    async with session.get(url + "/v1/models", timeout=PROBE_TIMEOUT) as r:
        return (await r.json())["data"][0]["id"]


async def greedy_answer(session, url: str, model: str) -> str:
    """The greedy reply, or why there is none (which then differs from a real reply)."""
    try:
        async with session.post(url + "/v1/chat/completions", json={"model": model, **GREEDY},
                                timeout=PROBE_TIMEOUT) as r:
            body = await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"<no answer: {exc!r}>"
    if r.status != 200:
        return f"<HTTP {r.status}: {body}>"
    return body["choices"][0]["message"]["content"]


async def measure_capacity(traffic: Traffic, seconds: float, clients: int) -> float:
    """Completed requests per second with `clients` back-to-back clients."""
    deadline = time.monotonic() + seconds
    started = time.monotonic()

    async def client():
        while time.monotonic() < deadline:
            await traffic.send(soak=False)
    await asyncio.gather(*(client() for _ in range(clients)))
    return traffic.num_completed / (time.monotonic() - started)


class Sampler:
    def __init__(self, session, url: str, pid: int | None, traffic: Traffic):
        self.session, self.url, self.pid, self.traffic = session, url, pid, traffic
        self.samples: list[dict] = []

    async def run(self, interval: float, started: float) -> None:
        while True:
            try:
                state = await server_state(self.session, self.url)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                state = {}  # recorded as missing: the checks at the end judge
            self.samples.append({
                "t": round(time.monotonic() - started, 1), "rss_mb": _mb(rss_bytes(self.pid)),
                "kv_pages_used": state.get("kv_cache_used_pages"),
                "running": state.get("num_requests_running"),
                "waiting": state.get("num_requests_waiting"),
                "outcomes": dict(self.traffic.outcomes)})
            await asyncio.sleep(interval)


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


async def soak_phase(traffic: Traffic, rate: float, seconds: float,
                     rng: np.random.Generator) -> int:
    """Poisson arrivals for `seconds`; returns once every request has ended."""
    tasks = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tasks.append(asyncio.create_task(traffic.send(soak=True)))
        await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    await asyncio.gather(*tasks)
    return len(tasks)


async def wait_idle(session, url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = await server_state(session, url)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return {"error": repr(exc)}
        if (not state.get("num_requests_running") and not state.get("num_requests_waiting")) \
                or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


def rss_check(samples: list[dict]) -> dict:
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    if len(rss) < 4:
        return {"ok": None, "why": "fewer than 4 RSS samples"}
    quarter = max(1, len(rss) // 4)
    first, last = float(np.median(rss[:quarter])), float(np.median(rss[-quarter:]))
    bound = max(RSS_BOUND[0] / 2**20, RSS_BOUND[1] * first)
    return {"ok": last - first <= bound, "first_quarter_mb": first, "last_quarter_mb": last,
            "growth_mb": round(last - first, 1), "bound_mb": round(bound, 1)}


async def run(args, url: str, pid: int | None) -> dict:
    rng = np.random.default_rng(args.seed)
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        args.model_id = await served_model(session, url)
        fresh = await greedy_answer(session, url, args.model_id)
        traffic = Traffic(session, url, args, rng)
        capacity = await measure_capacity(traffic, args.capacity_seconds, args.max_num_seqs)
        warm = dict(traffic.outcomes)
        traffic.outcomes.clear()
        rate = max(args.load * capacity, 0.1)
        sampler = Sampler(session, url, pid, traffic)
        started = time.monotonic()
        sampling = asyncio.create_task(sampler.run(args.sample_interval, started))
        num_sent = await soak_phase(traffic, rate, args.duration, rng)
        soak_s = time.monotonic() - started
        sampling.cancel()
        idle = await wait_idle(session, url)
        again = await greedy_answer(session, url, args.model_id)
    failures = {k: v for k, v in traffic.outcomes.items() if k in FAILURES}
    checks = {"every_request_ended": not failures and sum(traffic.outcomes.values()) == num_sent,
              "no_page_leaked": idle.get("kv_cache_used_pages") == 0,
              "rss_flat": rss_check(sampler.samples)["ok"],
              "greedy_identical": again == fresh}
    return {"capacity_req_per_s": round(capacity, 3), "arrival_rate_req_per_s": round(rate, 3),
            "soak_s": round(soak_s, 1), "requests": num_sent, "outcomes": traffic.outcomes,
            "failures": failures, "features": traffic.features, "warm_up_outcomes": warm,
            "idle_state": idle, "rss": rss_check(sampler.samples), "greedy": {
                "fresh": fresh, "after": again}, "checks": checks, "samples": sampler.samples}


def stop_server(proc) -> int:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        proc = None
        url, pid = args.url, args.pid
        if url is None:
            proc, url = start_server(args, os.path.join(tmp, "server.log"))
            pid = proc.pid
        try:
            asyncio.run(wait_healthy(url, proc))
            report = asyncio.run(run(args, url, pid))
        finally:
            exit_code = stop_server(proc) if proc is not None else None
        if proc is not None:
            report["checks"]["drained_exit_0"] = exit_code == 0
            report["server_log_tail"] = Path(tmp, "server.log").read_text()[-1500:]
    report["command"] = " ".join(["python", "benchmarks/soak.py", *(argv or sys.argv[1:])])
    report["total_s"] = round(time.perf_counter() - started, 1)
    report["passed"] = all(v is not False for v in report["checks"].values())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
