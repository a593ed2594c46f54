"""deploy/nginx/qwen-jax.conf in a real Nginx (Debian's package; .ci/run installs it) in
front of two `qwen-jax serve` processes on loopback: a session stays on one server,
streams pass through, and when one server is killed mid-load the requests after it
succeed on the other, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server.test_serve_cli import ARGS, free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nginx" / "qwen-jax.conf"


def start_server(model_dir, compile_cache, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", "--model", str(model_dir),
           "--port", str(port), "--served-model-name", "tiny", "--no-precompile",
           "--compilation-cache-dir", compile_cache, *ARGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)


def nginx_config(tmp: Path, listen: int, upstreams: list[int]) -> Path:
    """The repo's file with only its addresses changed, in a main config of its own."""
    text = CONF.read_text()
    servers = [line for line in text.splitlines() if line.strip().startswith("server 127.")]
    assert len(servers) == len(upstreams) == 2
    for line, port in zip(servers, upstreams):
        text = text.replace(line, line.replace(line.split()[1], f"127.0.0.1:{port}"))
    text = text.replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    (tmp / "qwen-jax.conf").write_text(text)
    main = tmp / "nginx.conf"
    main.write_text(f"""
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
worker_processes 1;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/qwen-jax.conf;
}}
""")
    return main


def wait_listening(proc: subprocess.Popen, port: int, timeout: float = 60) -> None:
    """Until `port` on loopback takes a connection; fails if `proc` exits first or the
    time runs out (on a loaded machine Nginx can take seconds to bind)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"Nginx exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"Nginx is not listening on {port} after {timeout} s")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, compile_cache, tmp_path_factory):
    """Nginx on a free port in front of two servers: (nginx url, the two processes)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        pytest.fail("Nginx is not installed: apt-get install nginx (.ci/run installs it)")
    ports = [free_port(), free_port()]
    servers = [start_server(tiny_model_dir, compile_cache, port) for port in ports]
    tmp = tmp_path_factory.mktemp("nginx")
    listen = free_port()
    main = nginx_config(tmp, listen, ports)
    proxy = None
    try:
        for proc in servers:
            wait_serving(proc)
        subprocess.run([nginx, "-t", "-c", str(main), "-p", str(tmp)], check=True,
                       capture_output=True)
        proxy = subprocess.Popen([nginx, "-c", str(main), "-p", str(tmp),
                                  "-g", "daemon off;"])
        wait_listening(proxy, listen)
        yield f"http://127.0.0.1:{listen}", servers, ports
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for proc in servers:
            proc.kill()
            proc.wait(10)


async def streamed(session, url: str, prompt: str, session_id: str) -> tuple[str, str]:
    """(how it ended, its text): "length", or the error it ended with."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"X-Session-ID": session_id}) as r:
            if r.status != 200:
                return f"status {r.status}", ""
            events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                      if line.startswith("data: {")]
    except aiohttp.ClientError as exc:  # the server went away mid-stream
        return type(exc).__name__, ""
    if not events or "error" in events[-1]:
        return "error", ""
    return (events[-1]["choices"][0]["finish_reason"],
            "".join(e["choices"][0]["text"] for e in events))


async def metric(session, port: int, name: str) -> float:
    """A server's series `name` summed over its labels."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


async def served_by(session, ports: list[int], before: list[float]) -> list[float]:
    """Requests each server answered since `before` (its request counter)."""
    return [await metric(session, port, "qwen_jax:request_success_total") - b
            for port, b in zip(ports, before)]


async def test_bench_serve_runs_through_nginx(fleet, tmp_path):
    from serving.cli.main import main
    url, _, _ = fleet
    out = tmp_path / "result.json"
    rc = await asyncio.to_thread(main, [
        "bench", "serve", "--base-url", url, "--model", "tiny", "--num-prompts", "6",
        "--random-input-len", "12", "--random-output-len", "5", "--ignore-eos",
        "--max-concurrency", "3", "--result-json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert report["total_output_tokens"] == 6 * 5 and report["mean_itl_ms"] > 0


async def test_nginx_keeps_sessions_streams_through_and_survives_a_dead_server(fleet):
    url, servers, ports = fleet
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        zero = await served_by(s, ports, [0.0, 0.0])
        # one session's requests all reach one server; streams arrive whole
        for _ in range(3):
            assert (await streamed(s, url, "Hello there", "alice"))[0] == "length"
        counts = await served_by(s, ports, zero)
        assert sorted(counts) == [0.0, 3.0]
        alice = counts.index(3.0)
        other = 1 - alice
        # streamed load over many sessions, alice's server killed while it streams
        sessions = [f"user-{i}" for i in range(8)]
        survivor_before = await metric(s, ports[other], "qwen_jax:request_success_total")
        tasks = [asyncio.ensure_future(streamed(s, url, "Once upon a time", sid))
                 for sid in [*sessions, "alice"]]
        running = "qwen_jax:num_requests_running"
        while not await metric(s, ports[alice], running):
            await asyncio.sleep(0.02)
        os.kill(servers[alice].pid, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # nothing hangs
        finished = [end for end, _ in outcomes if end == "length"]
        # the survivor's streams all finished; the dead one's ended with an error
        assert len(finished) == (await metric(s, ports[other], "qwen_jax:request_success_total")
                                 - survivor_before)
        assert len(finished) < len(outcomes)  # the killed server's streams did not
        # after the failure every request succeeds on the other server, alice's included
        after = await asyncio.wait_for(asyncio.gather(
            *(streamed(s, url, "Hello there", sid) for sid in ["alice", *sessions])), 120)
    assert [end for end, _ in after] == ["length"] * 9
    texts = {text for _, text in after}
    assert len(texts) == 1  # greedy: the same answer from either server
