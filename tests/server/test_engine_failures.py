"""A failed step is not a healthy server. A failure that destroys device state kills the
engine: in-flight and new requests get a 500, /health a 503, and `serve` exits 1 once
those are out. A failure confined to one request's output fails that request only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from tests.helpers.failures import corrupt_token_after, fail_device_step
from tests.server.conftest import ENGINE_ARGS, ServerThread, wait_idle

MARKER = 4242  # the victim's prompt ends with it; no other prompt here contains it


@pytest.fixture
def victim_llm(tiny_model_dir, compile_cache):
    """An engine of its own: these tests kill it. Buckets compile on first use (from the
    session's persistent cache): these tests need only one or two."""
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(tiny_model_dir), compilation_cache_dir=compile_cache, precompile=False,
                   **ENGINE_ARGS)
    yield llm
    llm.shutdown()


async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_a_bad_value_from_the_device_fails_that_request_only(server):
    undo = corrupt_token_after(server.llm.engine, MARKER)
    url = server.url + "/v1/completions"
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as s:
            (bad, error), (good, ok) = await asyncio.gather(
                _post(s, url, {**body, "prompt": [11, 12, MARKER]}),
                _post(s, url, {**body, "prompt": [11, 12, 13]}))
            async with s.get(server.url + "/health") as health:
                assert health.status == 200
    finally:
        undo()
    assert bad == 500 and error["error"]["type"] == "InternalServerError"
    assert "sampled token id -7" in error["error"]["message"]
    assert "outside the vocabulary [0, 151936)" in error["error"]["message"]
    assert good == 200 and ok["usage"]["completion_tokens"] == 6
    assert server.llm.dead is None
    stats = await wait_idle(server.llm)
    assert stats["num_used_pages"] == 0  # the failed request's pages came back


async def _stream_until_cut(session, url, body) -> list[dict | str]:
    events = []
    async with session.post(url, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: "):
                data = text[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_a_failed_device_step_kills_the_engine(victim_llm):
    srv = ServerThread(victim_llm, served_model_name="tiny").start()
    fail_device_step(victim_llm.engine, after_steps=2)  # the stream's first tokens go out
    url = srv.url + "/v1/completions"
    body = {"prompt": "dies", "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as s:
            events = await _stream_until_cut(s, url, {**body, "stream": True})
            status, error = await _post(s, url, body)
            async with s.get(srv.url + "/health") as health:
                health_status = health.status
            async with s.get(srv.url + "/metrics") as metrics:
                text = await metrics.text()
    finally:
        srv.stop()
    assert events[-1] == "[DONE]" and "choices" in events[0]
    assert events[-2]["error"]["code"] == 500 and "engine is dead" in events[-2]["error"]["message"]
    assert status == 500 and "engine is dead" in error["error"]["message"]
    assert health_status == 503
    assert 'qwen_jax:engine_dead{model_name="tiny"} 1.0' in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post_when_up(url: str, body: dict, results: dict) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        request = urllib.request.Request(url, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                results["status"], results["body"] = r.status, json.load(r)
            return
        except urllib.error.HTTPError as exc:
            results["status"], results["body"] = exc.code, json.load(exc)
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)  # not listening yet


def test_serve_answers_in_flight_requests_then_exits_1(victim_llm):
    from serving.entrypoints.openai.config import ServerConfig
    from serving.entrypoints.openai.serve_process import serve
    fail_device_step(victim_llm.engine)
    port = _free_port()
    results: dict = {}
    client = threading.Thread(target=_post_when_up, args=(
        f"http://127.0.0.1:{port}/v1/completions",
        {"prompt": "first", "max_tokens": 4}, results))
    client.start()
    code = asyncio.run(serve(victim_llm, ServerConfig(port=port, log_interval=0,
                                                      served_model_name="tiny")))
    client.join(30)
    assert code == 1
    assert results["status"] == 500 and "engine is dead" in results["body"]["error"]["message"]
    with pytest.raises(urllib.error.URLError):  # it stopped listening
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
