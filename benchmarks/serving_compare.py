"""Serving comparisons on one model, side by side in one run: prefix caching on vs off, and
our server vs HF transformers' server. Prints one JSON object.

    python benchmarks/serving_compare.py [--model DIR] [--out FILE]

1. `qwen-jax serve` twice on loopback ports, `--enable-prefix-caching` then
   `--no-enable-prefix-caching`, same model and engine options; the same `qwen-jax bench
   serve` shared-prefix workload against each (groups of prompts sharing a long system
   prompt); TTFT, throughput and the prefix-cache hit rate from the `/metrics` counters
   (difference around the workload), and the TTFT ratio off / on.
2. Our server (prefix caching on, the default) vs HF transformers on the same model and the
   same `bench serve` random workload (greedy, `ignore_eos`), at max-concurrency 1 and
   `--hf-concurrency`: output tokens/s and TTFT ratios. The HF side is `transformers serve`
   (FastAPI; needs fastapi, uvicorn and accelerate, e.g. installed apart with
   `pip install --target DIR fastapi uvicorn; pip install --no-deps --target DIR accelerate`
   and passed as `--hf-pythonpath DIR`), launched with a small shim that accepts vLLM's
   `ignore_eos` extension (as `min_new_tokens = max_tokens`); without those packages it is
   a minimal aiohttp OpenAI-compatible wrapper around HF `generate` in this file (one
   request at a time, one SSE chunk per token). `--hf-server` forces either.

With `--plot-dir DIR`, `qwen-jax bench serve --plot` draws each comparison from its result
files: DIR/serving_prefix.png (prefix caching on vs off) and DIR/serving_compare.png (ours vs
HF at `--hf-concurrency`).

Every server started here is stopped (terminate, then kill) on the way out, errors included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO / "qwen_jax" / "assets" / "tiny-qwen3-moe"
QWEN_JAX = [sys.executable, "-c", "from serving.cli.main import main; raise SystemExit(main())"]

# `transformers serve` with vLLM's `ignore_eos` accepted on /v1/completions.
HF_SERVE_SHIM = r"""
import sys
from transformers.cli.serving.completion import CompletionHandler
_validate, _build = CompletionHandler._validate_request, CompletionHandler._build_generation_config
def _validate_request(self, body):
    return _validate(self, {k: v for k, v in body.items() if k != "ignore_eos"})
def _build_generation_config(self, body, model_generation_config, use_cb=False):
    config = _build(self, body, model_generation_config, use_cb=use_cb)
    if body.get("ignore_eos"):
        config.min_new_tokens = config.max_new_tokens
    return config
CompletionHandler._validate_request = _validate_request
CompletionHandler._build_generation_config = _build_generation_config
from transformers.cli.transformers import main
sys.argv = ["transformers", "serve", *sys.argv[1:]]
main()
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--plot-dir", help="draw each comparison into a PNG in this directory")
    p.add_argument("--seed", type=int, default=0)
    add_engine_options(p, "engine (both of our servers)", max_num_seqs=8,
                       max_num_batched_tokens=256, max_model_len=512, token_buckets="8,64,256",
                       seq_buckets="8")
    s = p.add_argument_group("shared-prefix workload")
    s.add_argument("--num-prefix-groups", type=int, default=4)
    s.add_argument("--prompts-per-group", type=int, default=8)
    s.add_argument("--shared-prefix-len", type=int, default=300)
    s.add_argument("--suffix-len", type=int, default=16)
    s.add_argument("--prefix-output-len", type=int, default=16)
    s.add_argument("--prefix-concurrency", type=int, default=4)
    r = p.add_argument_group("HF comparison (random workload)")
    r.add_argument("--hf-server", default="auto", choices=("auto", "transformers-serve", "wrapper"))
    r.add_argument("--hf-pythonpath", default=os.environ.get("HF_SERVE_PYTHONPATH", ""),
                   help="extra path with fastapi/uvicorn/accelerate for `transformers serve`")
    r.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-prefix", action="store_true", help="skip the prefix-caching part")
    r.add_argument("--torch-threads", type=int, default=1,
                   help="HF server's torch threads (2 thrash on a shared 2-core box)")
    r.add_argument("--random-prompts", type=int, default=16)
    r.add_argument("--random-input-len", type=int, default=128)
    r.add_argument("--random-output-len", type=int, default=32)
    r.add_argument("--hf-concurrency", type=int, default=8,
                   help="second concurrency level of the comparison (the first is 1)")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--_hf_wrapper", nargs=3, metavar=("MODEL", "PORT", "THREADS"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def add_engine_options(p, title: str, *, max_num_seqs: int, max_num_batched_tokens: int,
                       max_model_len: int, token_buckets: str, seq_buckets: str) -> None:
    """The engine options every `qwen-jax serve` of a comparison shares."""
    e = p.add_argument_group(title)
    e.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    e.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens)
    e.add_argument("--max-model-len", type=int, default=max_model_len)
    e.add_argument("--token-buckets", default=token_buckets)
    e.add_argument("--seq-buckets", default=seq_buckets)
    e.add_argument("--compilation-cache-dir", default="default")


def serve_cmd(args, port: int, *flags: str) -> list[str]:
    """`qwen-jax serve` on loopback with the shared engine options, then `flags`."""
    return [*QWEN_JAX, "serve", "--model", args.model, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--token-buckets", args.token_buckets,
            "--seq-buckets", args.seq_buckets, "--seed", str(args.seed),
            "--compilation-cache-dir", args.compilation_cache_dir, *flags]


# ---- servers ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    """A server subprocess in its own process group, logging to a temp file."""

    def __init__(self, name: str, cmd: list[str], port: int, logdir: str, env=None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env, start_new_session=True)
        self.ready_s = None

    def wait_ready(self, timeout: float) -> str:
        """Waits for /v1/models to answer; returns the served model id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   + self.tail())
            try:
                models = json.loads(http_get(self.url + "/v1/models", timeout=2))
                self.ready_s = round(time.perf_counter() - self.started, 1)
                return models["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n" + self.tail())

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        return Path(self.log_path).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.log.close()


def our_server(args, prefix_caching: bool, logdir: str) -> Server:
    port = free_port()
    cmd = serve_cmd(args, port,
                    "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    name = "qwen_jax_prefix_" + ("on" if prefix_caching else "off")
    return Server(name, cmd, port, logdir, env)


def hf_serve_available(extra_path: str) -> bool:
    env = hf_env(extra_path, 1)
    code = "import fastapi, uvicorn, accelerate, transformers.cli.serving.completion"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=120).returncode == 0


def hf_env(extra_path: str, threads: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [extra_path] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def hf_server(args, kind: str, logdir: str) -> Server:
    port = free_port()
    if kind == "transformers-serve":
        cmd = [sys.executable, "-c", HF_SERVE_SHIM, "--device", "cpu", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               args.model]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_hf_wrapper", args.model,
               str(port), str(args.torch_threads)]
    return Server("hf_" + kind.replace("-", "_"), cmd, port, logdir,
                  hf_env(args.hf_pythonpath if kind == "transformers-serve" else "",
                         args.torch_threads))


# ---- measurements ----------------------------------------------------------------------
def prefix_counters(server: Server) -> dict:
    text = http_get(server.url + "/metrics")
    out = {}
    for name in ("queries", "hits"):
        m = re.search(rf"^qwen_jax:prefix_cache_{name}(?:_total)?(?:{{[^}}]*}})?\s+(\S+)",
                      text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def warm_up(server: Server, model_id: str) -> None:
    """One short untimed request unrelated to the workloads (first-request costs)."""
    body = json.dumps({"model": model_id, "prompt": "warm up the server", "max_tokens": 4,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def bench(server: Server, model_id: str, tokenizer: str, logdir: str, tag: str,
          extra: list[str]) -> dict:
    path = os.path.join(logdir, f"{tag}.json")
    cmd = [*QWEN_JAX, "bench", "serve", "--base-url", server.url, "--model", model_id,
           "--tokenizer", tokenizer, "--ignore-eos", "--no-warmup", "--result-json", path,
           "--save-detailed", "--metrics-interval", "0.1", *extra]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"bench serve ({tag}) failed:\n{run.stdout[-2000:]}\n"
                           f"{run.stderr[-2000:]}")
    report = json.loads(Path(path).read_text())
    if report.get("failed") or report.get("errors"):
        raise RuntimeError(f"bench serve ({tag}): failed requests {report.get('errors')}")
    return report


def summary(report: dict) -> dict:
    keys = ("completed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms")
    return {k: (round(report[k], 3) if isinstance(report.get(k), float) else report.get(k))
            for k in keys}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def run_prefix_comparison(args, logdir: str) -> dict:
    num_prompts = args.num_prefix_groups * args.prompts_per_group
    workload = ["--dataset", "shared-prefix", "--num-prompts", str(num_prompts),
                "--num-prefix-groups", str(args.num_prefix_groups),
                "--shared-prefix-len", str(args.shared_prefix_len),
                "--suffix-len", str(args.suffix_len),
                "--random-output-len", str(args.prefix_output_len),
                "--max-concurrency", str(args.prefix_concurrency), "--seed", str(args.seed)]
    out = {}
    for on in (True, False):
        server = our_server(args, on, logdir)
        try:
            model_id = server.wait_ready(args.startup_timeout)
            warm_up(server, model_id)
            before = prefix_counters(server)
            report = bench(server, model_id, args.model, logdir,
                           f"prefix_{'on' if on else 'off'}", workload)
            after = prefix_counters(server)
        finally:
            server.stop()
        queries = after["queries"] - before["queries"]
        hits = after["hits"] - before["hits"]
        out["on" if on else "off"] = {
            "server_ready_s": server.ready_s, **summary(report),
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0}
    on, off = out["on"], out["off"]
    out["ratios_off_over_on"] = {
        "mean_ttft": ratio(off["mean_ttft_ms"], on["mean_ttft_ms"]),
        "median_ttft": ratio(off["median_ttft_ms"], on["median_ttft_ms"]),
        "p99_ttft": ratio(off["p99_ttft_ms"], on["p99_ttft_ms"]),
        "output_throughput": ratio(off["output_throughput"], on["output_throughput"])}
    out["workload"] = {"dataset": "shared-prefix", "num_prompts": num_prompts,
                       "num_prefix_groups": args.num_prefix_groups,
                       "shared_prefix_len": args.shared_prefix_len,
                       "suffix_len": args.suffix_len, "output_len": args.prefix_output_len,
                       "max_concurrency": args.prefix_concurrency, "seed": args.seed,
                       "request_rate": "inf", "ignore_eos": True, "temperature": 0.0}
    return out


def run_hf_comparison(args, logdir: str) -> dict:
    kind = args.hf_server
    if kind == "auto":
        kind = ("transformers-serve" if hf_serve_available(args.hf_pythonpath)
                else "wrapper")
    levels = sorted({1, args.hf_concurrency})
    workload = ["--dataset", "random", "--num-prompts", str(args.random_prompts),
                "--random-input-len", str(args.random_input_len),
                "--random-output-len", str(args.random_output_len), "--seed", str(args.seed)]
    results = {}
    for side in ("qwen_jax", "hf"):
        server = (our_server(args, True, logdir) if side == "qwen_jax"
                  else hf_server(args, kind, logdir))
        try:
            model_id = server.wait_ready(args.startup_timeout)
            warm_up(server, model_id)
            results[side] = {"server_ready_s": server.ready_s}
            for c in levels:
                report = bench(server, model_id, args.model, logdir, f"random_{side}_c{c}",
                               [*workload, "--max-concurrency", str(c)])
                results[side][f"concurrency_{c}"] = summary(report)
        finally:
            server.stop()
    ratios = {}
    for c in levels:
        ours, hf = results["qwen_jax"][f"concurrency_{c}"], results["hf"][f"concurrency_{c}"]
        ratios[f"concurrency_{c}"] = {
            "output_throughput_ours_over_hf": ratio(ours["output_throughput"],
                                                    hf["output_throughput"]),
            "mean_ttft_hf_over_ours": ratio(hf["mean_ttft_ms"], ours["mean_ttft_ms"]),
            "median_ttft_hf_over_ours": ratio(hf["median_ttft_ms"], ours["median_ttft_ms"]),
            "mean_tpot_hf_over_ours": ratio(hf["mean_tpot_ms"], ours["mean_tpot_ms"]),
            "same_token_counts": (ours["total_input_tokens"] == hf["total_input_tokens"]
                                  and ours["total_output_tokens"]
                                  == hf["total_output_tokens"])}
    return {"hf_server": kind, "torch_threads": args.torch_threads,
            "workload": {"dataset": "random", "num_prompts": args.random_prompts,
                         "input_len": args.random_input_len,
                         "output_len": args.random_output_len, "seed": args.seed,
                         "max_concurrency": levels, "ignore_eos": True, "temperature": 0.0},
            **results, "ratios": ratios}


def plot_comparisons(args, logdir: str) -> list[str]:
    """Each comparison's result files side by side, through `bench serve --plot`."""
    Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
    figures = []
    c = args.hf_concurrency
    for name, files, skip in (
            ("serving_prefix.png", {"prefix_on": "prefix caching on",
                                    "prefix_off": "prefix caching off"}, args.skip_prefix),
            ("serving_compare.png", {f"random_qwen_jax_c{c}": f"qwen-jax serve, concurrency {c}",
                                     f"random_hf_c{c}": f"HF server, concurrency {c}"},
             args.skip_hf)):
        if skip:
            continue
        out = os.path.join(args.plot_dir, name)
        cmd = [*QWEN_JAX, "bench", "serve", "--plot", out, "--plot-results",
               *(os.path.join(logdir, f"{tag}.json") for tag in files),
               "--plot-labels", *files.values()]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
        figures.append(out)
    return figures


# ---- fallback HF server: aiohttp around `generate`, one request at a time --------------
def hf_wrapper_main(model_path: str, port: int, threads: int) -> None:
    import asyncio
    import threading
    import uuid

    import torch
    from aiohttp import web
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    lock = asyncio.Lock()

    class QueueStreamer(BaseStreamer):
        def __init__(self, loop, queue):
            self.loop, self.queue, self.prompt_seen = loop, queue, False

        def put(self, value):
            if not self.prompt_seen:  # generate() first hands over the prompt
                self.prompt_seen = True
                return
            for token in value.reshape(-1).tolist():
                self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

        def end(self):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def models(_):
        return web.json_response({"object": "list", "data": [
            {"id": model_path, "object": "model", "owned_by": "hf-wrapper"}]})

    async def completions(request):
        body = await request.json()
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        max_tokens = int(body.get("max_tokens", 16))
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False,
                      pad_token_id=tokenizer.pad_token_id or model.config.eos_token_id)
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def chunk(text, finish=None, usage=None):
            data = {"id": rid, "object": "text_completion", "created": created,
                    "model": model_path,
                    "choices": [] if usage else [{"index": 0, "text": text,
                                                  "finish_reason": finish}]}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n".encode()

        async with lock:  # non-batched: one generate at a time
            if not body.get("stream"):
                out = await asyncio.to_thread(
                    lambda: model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist())
                return web.json_response({"id": rid, "object": "text_completion",
                                          "choices": [{"index": 0, "text":
                                                       tokenizer.decode(out)}]})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            streamer = QueueStreamer(loop, queue)
            worker = threading.Thread(target=lambda: torch.no_grad()(model.generate)(
                ids, streamer=streamer, **kwargs), daemon=True)
            worker.start()
            tokens, sent = [], ""
            while (token := await queue.get()) is not None:
                tokens.append(token)
                text = tokenizer.decode(tokens)
                await response.write(chunk(text[len(sent):]))
                sent = text
            worker.join()
            finish = "length" if len(tokens) >= max_tokens else "stop"
            await response.write(chunk("", finish))
            await response.write(chunk("", usage={
                "prompt_tokens": ids.shape[1], "completion_tokens": len(tokens),
                "total_tokens": ids.shape[1] + len(tokens)}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.get("/health", models),
                    web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._hf_wrapper:
        model_path, port, threads = args._hf_wrapper
        hf_wrapper_main(model_path, int(port), int(threads))
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # SIGTERM/SIGHUP unwind through the `finally` blocks that stop the servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    config = json.loads((Path(args.model) / "config.json").read_text())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving_compare_") as logdir:
        result = {
            "model": {"path": os.path.relpath(args.model, REPO)
                      if args.model.startswith(str(REPO)) else args.model,
                      **{k: config.get(k) for k in (
                          "hidden_size", "num_hidden_layers", "num_experts",
                          "num_experts_per_tok", "moe_intermediate_size", "vocab_size")}},
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                        "jax_backend": os.environ["JAX_PLATFORMS"]},
            "engine": {"max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "max_model_len": args.max_model_len,
                       "token_buckets": args.token_buckets, "seq_buckets": args.seq_buckets},
        }
        if not args.skip_prefix:
            result["prefix_caching"] = run_prefix_comparison(args, logdir)
        if not args.skip_hf:
            result["hf_comparison"] = run_hf_comparison(args, logdir)
        if args.plot_dir:
            result["plots"] = plot_comparisons(args, logdir)
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
