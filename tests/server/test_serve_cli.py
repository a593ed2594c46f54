"""`qwen-jax serve` as a real subprocess: start-up report, serving, SIGTERM drains and exits 0,
and its engine process (the default) stops with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

ARGS = ["--load-format", "dummy", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--max-model-len", "128", "--token-buckets", "8,64", "--seq-buckets", "4,8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(proc: subprocess.Popen, timeout: float = 150) -> list[str]:
    """A `serve` process's output up to its "serving on" line; kills it and fails the test
    with its last lines if it does not get there."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving on"):
            return lines
    proc.kill()
    pytest.fail("server did not start:\n" + "".join(lines[-40:]))


@pytest.fixture
def serve_process(tiny_model_dir, compile_cache):
    port = free_port()
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", "--model", str(tiny_model_dir),
           "--port", str(port), "--served-model-name", "tiny", "--shutdown-timeout", "20",
           "--compilation-cache-dir", compile_cache, *ARGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    lines = wait_serving(proc)
    yield proc, port, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def engine_processes(parent: int) -> list[int]:
    """Live children of `parent` running the engine (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"serving.engine.process" in cmdline:
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_sigterm_finishes_in_flight_requests_and_exits_zero(serve_process):
    proc, port, lines = serve_process
    engine = engine_processes(proc.pid)
    assert len(engine) == 1  # the engine steps in a process of its own
    report = "".join(lines)
    assert "loaded in" in report and "compiled 4 (tokens, seqs) buckets" in report
    assert "KV cache:" in report and "tokens in" in report
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "in flight", "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            events = [await r.content.readline()]
            proc.send_signal(signal.SIGTERM)
            async for line in r.content:
                events.append(line)
    payloads = [e for e in events if e.startswith(b"data: ")]
    assert proc.wait(timeout=60) == 0
    rest = proc.stdout.read()
    assert payloads[-1] == b"data: [DONE]\n"
    assert b'"finish_reason": "length"' in payloads[-2], rest  # finished, not cut off
    assert "shut down cleanly" in rest
    assert "POST /v1/completions 200" in rest  # the one-line-per-request log
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s:
            await s.get(url + "/health")
    assert not alive(engine[0])  # stopped by the server, not left behind


def test_an_option_the_model_refuses_is_one_line_naming_it_not_a_traceback():
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", "--port", str(free_port()),
           "--pipeline-parallel-size", "2", "--no-precompile"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert ("error: pipeline_parallel_size=2 must divide the 1 consecutive dense layers "
            "from layer 2") in done.stderr
    assert "Traceback" not in done.stderr
