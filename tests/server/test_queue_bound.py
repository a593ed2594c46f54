"""A full waiting queue sheds load with 503 + Retry-After; nothing leaks."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.server.conftest import ENGINE_ARGS, ServerThread, wait_idle


@pytest.fixture(scope="module")
def bounded_server(tiny_model_dir, compile_cache):
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(tiny_model_dir), compilation_cache_dir=compile_cache, max_waiting=1,
                   **ENGINE_ARGS)
    srv = ServerThread(llm, served_model_name="tiny").start()
    yield srv
    srv.stop()
    llm.shutdown()


async def fire(session, url, stream):
    body = {"prompt": "load", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return r.status, r.headers.get("Retry-After"), await r.json()
        await r.read()
        return 200, None, None


@pytest.mark.parametrize("stream", [False, True])
async def test_full_queue_answers_503_with_retry_after(bounded_server, stream):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        results = await asyncio.gather(*(fire(s, bounded_server.url, stream) for _ in range(24)))
    statuses = [r[0] for r in results]
    assert 200 in statuses and 503 in statuses, statuses
    assert set(statuses) <= {200, 503}
    for status, retry_after, body in results:
        if status == 503:
            assert int(retry_after) >= 1
            assert body["error"]["code"] == 503 and "max_waiting=1" in body["error"]["message"]
    stats = await wait_idle(bounded_server.llm)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_used_pages"] == 0
