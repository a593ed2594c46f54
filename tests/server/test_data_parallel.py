"""Data parallelism behind one endpoint (serving/engine/data_parallel.py): two engine
processes behind one server give a single replica's greedy answers, keep a prefix group on
one replica, label /metrics per replica, and survive one replica's death (its requests fail
cleanly, the other's finish, it is started again and answers)."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from serving.core.request import SamplingParams
from tests.helpers.prometheus import parse_values
from tests.server.conftest import ENGINE_ARGS, ServerThread

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def add(a, b):"]


@pytest.fixture(scope="module")
def dp_llm(tiny_model_dir, compile_cache):
    from serving.engine.data_parallel import DPAsyncLLM
    llm = DPAsyncLLM(str(tiny_model_dir), data_parallel_size=2, restart_backoff_s=0.1,
                     compilation_cache_dir=compile_cache, **{**ENGINE_ARGS, "precompile": False})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_server(dp_llm):
    srv = ServerThread(dp_llm, served_model_name="tiny").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_server(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny").start()
    yield srv
    srv.stop()


async def complete(session, url: str, prompt: str, **body) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def test_greedy_answers_through_two_replicas_equal_one_replicas(dp_server, one_server,
                                                                     dp_llm):
    async with aiohttp.ClientSession() as s:
        # all at once: both replicas take some
        dp = await asyncio.gather(*(complete(s, dp_server.url, p) for p in PROMPTS * 2))
        one = await asyncio.gather(*(complete(s, one_server.url, p) for p in PROMPTS * 2))
    assert all(status == 200 for status, _ in dp)
    assert [b["choices"][0]["text"] for _, b in dp] == [b["choices"][0]["text"] for _, b in one]
    assert all(n > 0 for n in dp_llm.router.num_routed)


async def test_a_shared_prefix_group_stays_on_one_replica(dp_llm):
    page = dp_llm.engine.page_size
    groups = {g: [1000 + g] * (3 * page) for g in range(2)}  # 3 full pages each
    before = [s["prefix_cache_hits"] for _, _, s in dp_llm.replica_stats()]
    params = SamplingParams(temperature=0, max_tokens=2)
    # one at a time (round robin would split both groups over the replicas)
    for i, group in enumerate([0, 0, 1, 1, 0, 1]):
        ids = groups[group] + [7 + i]
        async for _ in dp_llm.generate({"prompt_token_ids": ids}, params, f"group-{i}"):
            pass
    hits = [s["prefix_cache_hits"] - b for (_, _, s), b in zip(dp_llm.replica_stats(), before)]
    # each group's 2nd and 3rd request reuse its 3 pages: they ran where its 1st one did
    assert sum(hits) == 2 * 2 * 3 * page


async def test_health_and_metrics_name_each_replica(dp_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(dp_server.url + "/health") as r:
            health = r.status, await r.json()
        async with s.get(dp_server.url + "/metrics") as r:
            metrics = parse_values(await r.text())
    assert health[0] == 200
    assert [(e["engine"], e["state"]) for e in health[1]["replicas"]] == [
        ("0", "serving"), ("1", "serving")]
    for engine in "01":
        label = f'{{engine="{engine}",model_name="tiny"}}'
        assert metrics[f"qwen_jax:num_requests_running{label}"] == 0
        assert metrics[f"qwen_jax:engine_dead{label}"] == 0
        assert metrics[f"qwen_jax:kv_cache_total_pages{label}"] > 0
    # the request-level series count both replicas' requests in one
    assert metrics['qwen_jax:generation_tokens_total{model_name="tiny"}'] > 0


async def test_leaving_a_stream_or_aborting_frees_its_pages_on_its_replica(dp_llm):
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind="DELTA")
    left = dp_llm.generate("Once upon a time", params, request_id="left")
    async for _ in left:
        break
    replica = dp_llm._owner["left"]
    assert replica.llm.stats()["num_running"] + replica.llm.stats()["num_waiting"] == 1
    await left.aclose()  # a client that went away
    task = asyncio.ensure_future(collect_all(dp_llm, "Once", params, "aborted"))
    while "aborted" not in dp_llm._owner:
        await asyncio.sleep(0.01)
    await dp_llm.abort("aborted")
    assert (await task)[-1].outputs[0].finish_reason == "abort"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline and any(
            s["num_running"] or s["num_used_pages"] for _, _, s in dp_llm.replica_stats()):
        await asyncio.sleep(0.05)
    assert all(not s["num_running"] and not s["num_used_pages"]
               for _, _, s in dp_llm.replica_stats())
    assert not dp_llm._owner and all(r.num_unfinished == 0 for r in dp_llm.replicas)


async def collect_all(llm, prompt, params, request_id):
    return [o async for o in llm.generate(prompt, params, request_id)]


async def stream(session, url: str, prompt: str) -> str:
    """A streamed completion's outcome: its finish reason, or the error it ended with."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:  # failed before its first token
            return "error" if r.status == 500 else f"status {r.status}"
        text = (await r.read()).decode()
    if '"error"' in text:
        return "error"
    return "length" if '"finish_reason": "length"' in text.replace('":"', '": "') else text


async def test_a_killed_replica_fails_its_requests_while_the_other_serves_then_serves_again(
        dp_server, dp_llm):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        tasks = [asyncio.ensure_future(stream(s, dp_server.url, p)) for p in PROMPTS]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (sum(r.num_unfinished for r in dp_llm.replicas) < len(PROMPTS)
               and loop.time() < deadline):  # every request routed
            await asyncio.sleep(0.02)
        on_victim = dp_llm.replicas[1].num_unfinished
        assert on_victim and dp_llm.replicas[0].num_unfinished
        os.kill(dp_llm.replicas[1].llm.pid, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # nothing hangs
        assert sorted(outcomes) == sorted(["length"] * (len(PROMPTS) - on_victim)
                                          + ["error"] * on_victim)
        async with s.get(dp_server.url + "/health") as r:
            states = [e["state"] for e in (await r.json())["replicas"]]
            assert r.status == 200 and states[0] == "serving"
        status, body = await complete(s, dp_server.url, PROMPTS[0])  # the other one serves
        assert status == 200 and body["choices"][0]["text"]
        while dp_llm.replicas[1].state != "serving" and loop.time() < deadline + 120:
            await asyncio.sleep(0.1)
        assert dp_llm.replicas[1].state == "serving" and dp_llm.replicas[1].num_restarts == 1
        async with s.get(dp_server.url + "/metrics") as r:
            restarts = parse_values(await r.text())
        assert [restarts[f'qwen_jax:engine_restarts_total{{engine="{i}",model_name="tiny"}}']
                for i in "01"] == [0, 1]
        # the restarted replica answers: two at once, one each
        answers = await asyncio.gather(*(complete(s, dp_server.url, p, max_tokens=30,
                                                  ignore_eos=True) for p in PROMPTS[:2]))
    assert [status for status, _ in answers] == [200, 200]
    assert dp_llm.replicas[1].llm.stats()["prefix_cache_queries"] > 0
