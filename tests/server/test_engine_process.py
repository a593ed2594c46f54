"""The engine in its own process (`MPAsyncLLM`, `qwen-jax serve`'s default): the same
outputs as the engine on a thread, the server's routes and metrics over it, errors that
keep their type, aborts that free pages, and a dead engine process reported as
`EngineDeadError`."""

from __future__ import annotations

import asyncio
import copy
import os
import signal

import aiohttp
import pytest

from serving.core.request import SamplingParams
from serving.engine.exceptions import EngineDeadError
from tests.helpers.prometheus import parse_values
from tests.server.conftest import ENGINE_ARGS, ServerThread, wait_idle


def fail_steps_with(engine, request_id: str) -> None:
    """In the engine process (an `engine_hook`): a step fails while `request_id` is live,
    as a device error would."""
    step = engine.step

    def failing_step():
        if request_id in engine.request_ids():
            raise FloatingPointError(f"injected failure: {request_id} is live")
        return step()

    engine.step = failing_step


@pytest.fixture(scope="module")
def mp_llm(tiny_model_dir, compile_cache):
    from serving.engine.process import MPAsyncLLM
    llm = MPAsyncLLM(str(tiny_model_dir), compilation_cache_dir=compile_cache,
                     engine_hook=("tests.server.test_engine_process", "fail_steps_with",
                                  ("explode",)),
                     **{**ENGINE_ARGS, "precompile": False})  # what the tests run compiles
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mp_server(mp_llm):
    srv = ServerThread(mp_llm, served_model_name="tiny").start()
    yield srv
    srv.stop()


async def collect(llm, prompt, params, request_id):
    return [o async for o in llm.generate(prompt, params, request_id=request_id)]


def folded(outputs, kind: str):
    """A request's outputs folded into one, as a reader that fell behind gets them."""
    first = copy.deepcopy(outputs[0])
    for later in outputs[1:]:
        first.add(copy.deepcopy(later), aggregate=kind == "DELTA")
    return first


def added_up(outputs):
    """{sample index: (token ids, text, logprobs, finish reason)} of DELTA outputs."""
    samples: dict = {}
    for output in outputs:
        for c in output.outputs:
            ids, text, lps, _ = samples.get(c.index, ([], "", [], None))
            samples[c.index] = (ids + c.token_ids, text + c.text, lps + (c.logprobs or []),
                                c.finish_reason)
    return samples


@pytest.mark.parametrize("params", [
    dict(temperature=0, max_tokens=12, ignore_eos=True),
    dict(temperature=0.9, top_p=0.9, seed=7, n=2, logprobs=2, max_tokens=9),
    dict(temperature=0, max_tokens=30, stop=["\n"], prompt_logprobs=1),
], ids=["greedy", "seeded_n2_logprobs", "stop_string_prompt_logprobs"])
async def test_outputs_match_the_engine_on_a_thread(mp_llm, shared_llm, params):
    prompt = "The capital of France is"
    for kind in ("DELTA", "CUMULATIVE"):
        p = SamplingParams(**params, output_kind=kind)
        here = await collect(shared_llm, prompt, p, f"thread-{kind}-{id(params)}")
        there = await collect(mp_llm, prompt, p, f"process-{kind}-{id(params)}")
        # Outputs a reader was slow to take arrive folded into one (RequestOutput.add), so
        # each side's are folded: the same outputs field by field but the ids and times
        # (not num_cached_tokens: the two engines' prefix caches hold other histories).
        a, b = folded(here, kind), folded(there, kind)
        assert (b.prompt, b.prompt_token_ids, b.finished) == (
            a.prompt, a.prompt_token_ids, a.finished)
        assert b.outputs == a.outputs and b.prompt_logprobs == a.prompt_logprobs
        assert all(not o.finished for o in there[:-1])
        final = there[-1]
        assert final.prompt == prompt and final.prompt_token_ids == mp_llm.tokenizer.encode(prompt)
        m = final.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time
        if kind == "DELTA":
            assert added_up(there) == added_up(here)
    assert (await wait_idle(mp_llm))["num_used_pages"] == 0


async def test_errors_reach_the_caller_with_their_type_and_message(mp_llm):
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        await collect(mp_llm, {"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=2),
                      "too-long")
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 10000000"):
        await collect(mp_llm, {"prompt_token_ids": [5, 10_000_000]}, None, "bad-id")
    with pytest.raises(ValueError, match="unknown engine call 'step'"):
        await asyncio.wrap_future(mp_llm._request("step"))  # only the server's calls cross
    outputs = await collect(mp_llm, "Hi", SamplingParams(max_tokens=3), "after-errors")
    assert outputs[-1].finished  # the engine goes on serving


async def test_leaving_a_stream_aborts_it_and_frees_its_pages(mp_llm):
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind="DELTA")
    stream = mp_llm.generate("Once upon a time", params, request_id="left")
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.aclose()
    stats = await wait_idle(mp_llm)
    assert stats["num_running"] == 0 and stats["num_used_pages"] == 0
    # an explicit abort ends the stream with finish_reason "abort" (the id once read as
    # a reply's marker: replies are matched by their call)
    task = asyncio.ensure_future(collect(mp_llm, "Once", params, "added"))
    while not mp_llm.stats()["num_running"] and not task.done():
        await asyncio.sleep(0.01)
    await mp_llm.abort("added")
    outputs = await task
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert (await wait_idle(mp_llm))["num_used_pages"] == 0


async def test_server_routes_and_metrics_over_the_engine_process(mp_server, mp_llm):
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(mp_server.url + "/v1/completions", json=body) as r:
            whole = await r.json()
        async with s.post(mp_server.url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            streamed = (await r.read()).decode()
        async with s.post(mp_server.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {
                        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}) as r:
            bad_schema = r.status, await r.json()
        async with s.get(mp_server.url + "/metrics") as r:
            metrics = parse_values(await r.text())
        async with s.get(mp_server.url + "/v1/models") as r:
            models = await r.json()
    assert whole["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["text"] for c in _events(streamed))
    assert text == whole["choices"][0]["text"]
    assert bad_schema[0] == 400 and "response_format" in bad_schema[1]["error"]["message"]
    # counted from the engine process's step stats, by the listener in this one
    assert metrics['qwen_jax:generation_tokens_total{model_name="tiny"}'] == 12
    assert models["data"][0]["root"] == str(mp_llm.engine.model_path)


def _events(text: str) -> list[dict]:
    import json
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def test_an_engine_process_that_exits_is_a_dead_engine(tiny_model_dir, compile_cache):
    from serving.engine.process import MPAsyncLLM
    llm = MPAsyncLLM(str(tiny_model_dir), compilation_cache_dir=compile_cache,
                     **{**ENGINE_ARGS, "precompile": False})
    told: list = []
    llm.dead_listeners.append(told.append)
    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        outputs = 0
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for _ in llm.generate("Once upon a time", params):
                outputs += 1
                if outputs == 1:  # outputs already on their way may still arrive
                    os.kill(llm._process.pid, signal.SIGKILL)
        assert len(told) == 1 and llm.dead is not None
        with pytest.raises(EngineDeadError):
            await collect(llm, "Hi", params, "after-death")
    finally:
        llm.shutdown()


async def test_a_failed_step_in_the_engine_process_is_a_dead_engine(mp_llm, mp_server):
    """Last in this file: it kills the module's engine."""
    told: list = []
    mp_llm.dead_listeners.append(told.append)
    params = SamplingParams(temperature=0, max_tokens=5)
    with pytest.raises(EngineDeadError, match="FloatingPointError.*injected failure"):
        await collect(mp_llm, "Hi", params, "explode")
    assert len(told) == 1 and isinstance(mp_llm.dead, FloatingPointError)  # its own type
    with pytest.raises(EngineDeadError):
        await collect(mp_llm, "Hi", params, "after-death")
    async with aiohttp.ClientSession() as s:  # the server answers 500 / 503 (it would exit)
        async with s.post(mp_server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}) as r:
            assert r.status == 500 and "engine is dead" in (await r.json())["error"]["message"]
        async with s.get(mp_server.url + "/health") as r:
            assert r.status == 503
