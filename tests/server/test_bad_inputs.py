"""Hostile and malformed requests each get the right 4xx with OpenAI's error JSON; the
server keeps serving and releases everything. Also API keys and client disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.server.conftest import ServerThread, wait_idle

C, CHAT, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
OK = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def raw(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


CASES = [  # (id, path, body: dict or raw bytes, status, param or None)
    ("prompt-missing", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-int", C, {"prompt": 5}, 400, "prompt"),
    ("prompt-object", C, {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("prompt-empty-list", C, {"prompt": []}, 400, "prompt"),
    ("prompt-empty-string", C, {"prompt": ""}, 400, "prompt"),
    ("prompt-nested-empty", C, {"prompt": [[]]}, 400, "prompt"),
    ("prompt-negative-id", C, {"prompt": [-1]}, 400, "prompt"),
    ("prompt-id-past-vocab", C, {"prompt": [151936]}, 400, "prompt"),
    ("prompt-float-ids", C, {"prompt": [1.5, 2]}, 400, "prompt"),
    ("prompt-bool-ids", C, {"prompt": [True]}, 400, "prompt"),
    ("prompt-past-context-text", C, {"prompt": "hello " * 400}, 400, "prompt"),
    ("prompt-past-context-ids", C, {"prompt": [5] * 200}, 400, "prompt"),
    ("prompt-batch-too-large", C, {"prompt": ["a"] * 65}, 400, "prompt"),
    ("max-tokens-negative", C, {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-zero", C, {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-string", C, {**OK, "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-huge", C, {**OK, "max_tokens": 10**30}, 400, "max_tokens"),
    ("max-tokens-past-context", C, {**OK, "max_tokens": 500}, 400, "max_tokens"),
    ("temperature-negative", C, {**OK, "temperature": -0.5}, 400, "temperature"),
    ("temperature-string", C, {**OK, "temperature": "hot"}, 400, "temperature"),
    ("temperature-overflow", C, raw('{"prompt": "hi", "temperature": 1e400}'), 400,
     "temperature"),
    ("temperature-nan", C, raw('{"prompt": "hi", "temperature": NaN}'), 400, "body"),
    ("top-p-zero", C, {**OK, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", C, {**OK, "top_p": 1.5}, 400, "top_p"),
    ("top-k-below-minus-one", C, {**OK, "top_k": -2}, 400, "top_k"),
    ("top-k-huge", C, {**OK, "top_k": 2**40}, 400, "top_k"),
    ("min-p-above-one", C, {**OK, "min_p": 2}, 400, "min_p"),
    ("presence-penalty-range", C, {**OK, "presence_penalty": 5}, 400, "presence_penalty"),
    ("frequency-penalty-range", C, {**OK, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("n-zero", C, {**OK, "n": 0}, 400, "n"),
    ("n-huge", C, {**OK, "n": 1000}, 400, "n"),
    ("n-float", C, {**OK, "n": 1.5}, 400, "n"),
    ("logprobs-too-many", C, {**OK, "logprobs": 21}, 400, "logprobs"),
    ("logprobs-negative", C, {**OK, "logprobs": -1}, 400, "logprobs"),
    ("seed-string", C, {**OK, "seed": "abc"}, 400, "seed"),
    ("seed-huge", C, {**OK, "seed": 2**70}, 400, "seed"),
    ("stop-int", C, {**OK, "stop": 5}, 400, "stop"),
    ("stop-empty-string", C, {**OK, "stop": [""]}, 400, "stop"),
    ("stop-too-many", C, {**OK, "stop": [f"s{i}" for i in range(100)]}, 400, "stop"),
    ("stop-token-ids-negative", C, {**OK, "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ("stop-token-ids-string", C, {**OK, "stop_token_ids": "x"}, 400, "stop_token_ids"),
    ("ignore-eos-string", C, {**OK, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("min-tokens-above-max", C, {**OK, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ("min-tokens-with-too-many-stop-ids", C,
     {**OK, "min_tokens": 1, "stop_token_ids": list(range(100, 200))}, 400, None),
    ("stream-string", C, {**OK, "stream": "true"}, 400, "stream"),
    ("stream-options-without-stream", C, {**OK, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("stream-options-bad-type", C,
     {**OK, "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "include_usage"),
    ("unknown-model", C, {**OK, "model": "gpt-4"}, 404, "model"),
    ("model-not-string", C, {**OK, "model": 123}, 400, "model"),
    ("echo-string", C, {**OK, "echo": "yes"}, 400, "echo"),
    ("best-of-unsupported", C, {**OK, "best_of": 3}, 400, "best_of"),
    ("logit-bias-unsupported", C, {**OK, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("priority-string", C, {**OK, "priority": "high"}, 400, "priority"),
    ("bad-json", C, raw('{"prompt": "hi",'), 400, "body"),
    ("json-array", C, raw("[1, 2]"), 400, "body"),
    ("json-null", C, raw("null"), 400, "body"),
    ("empty-body", C, raw(""), 400, "body"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe\xfd"}', 400, "body"),
    ("deeply-nested", C, raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400,
     "body"),
    ("ten-megabytes", C, raw(json.dumps({"prompt": "x" * (10 * 2**20)})), 413, "body"),
    ("responses-input-missing", R, {"max_output_tokens": 2}, 400, "input"),
    ("responses-input-int", R, {"input": 5}, 400, "input"),
    ("responses-input-past-context", R, {"input": "word " * 300}, 400, "input"),
    ("responses-content-int", R, {"input": [{"role": "user", "content": 5}]}, 400,
     "input[0].content"),
    ("responses-output-without-call-id", R,
     {"input": [{"type": "function_call_output", "output": "4"}]}, 400, "input[0].call_id"),
    ("responses-max-output-tokens-string", R, {"input": "hi", "max_output_tokens": "9"}, 400,
     "max_output_tokens"),
    ("responses-temperature-negative", R, {"input": "hi", "temperature": -1}, 400,
     "temperature"),
    ("responses-tool-choice-unknown", R, {"input": "hi", "tools": [
        {"type": "function", **TOOL["function"]}], "tool_choice": {
        "type": "function", "name": "nope"}}, 400, "tool_choice"),
    ("responses-previous-unknown", R, {"input": "hi", "previous_response_id": "resp_x"}, 404,
     "previous_response_id"),
    ("responses-instructions-int", R, {"input": "hi", "instructions": 5}, 400,
     "instructions"),
    ("responses-unknown-field", R, {"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("responses-bad-json", R, raw('{"input": '), 400, "body"),
    ("messages-missing", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("messages-no-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages"),
    ("messages-no-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("messages-int-content", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages"),
    ("messages-image-part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("messages-not-objects", CHAT, {"messages": ["hello"]}, 400, "messages"),
    ("messages-past-context", CHAT,
     {"messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages"),
    ("chat-template-kwargs-string", CHAT, {"messages": USER, "chat_template_kwargs": "x"},
     400, "chat_template_kwargs"),
    ("top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 5}, 400,
     "top_logprobs"),
    ("top-logprobs-too-many", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50},
     400, "top_logprobs"),
    ("chat-logprobs-string", CHAT, {"messages": USER, "logprobs": "yes"}, 400, "logprobs"),
    ("response-format-unknown-type", CHAT,
     {"messages": USER, "response_format": {"type": "structural_tag"}}, 400, "response_format"),
    ("response-format-schema-missing", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format"),
    ("json-schema-invalid", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ("structured-regex-invalid", C, {"prompt": "hi", "structured_outputs": {"regex": "[a-"}},
     400, "structured_outputs"),
    ("structured-grammar-invalid", C,
     {"prompt": "hi", "structured_outputs": {"grammar": "start: undefined_rule"}}, 400,
     "structured_outputs"),
    ("structured-two-kinds", C,
     {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("structured-unknown-key", C, {"prompt": "hi", "structured_outputs": {"jsn": {}}}, 400,
     "structured_outputs"),
    ("structured-tag-unsupported", C,
     {"prompt": "hi", "structured_outputs": {"structural_tag": "{}"}}, 400,
     "structured_outputs"),
    ("guided-choice-not-a-list", C, {"prompt": "hi", "guided_choice": "yes"}, 400,
     "guided_choice"),
    ("guided-and-structured", C, {"prompt": "hi", "guided_regex": "a",
                                      "structured_outputs": {"regex": "b"}}, 400,
     "guided_regex"),
    ("guided-backend-unknown", C,
     {"prompt": "hi", "guided_regex": "a", "guided_decoding_backend": "xgrammar"}, 400,
     "guided_decoding_backend"),
    ("structured-with-min-tokens", C,
     {"prompt": "hi", "guided_regex": "a+", "min_tokens": 2}, 400, "min_tokens"),
    ("vllm-beam-search", C, {"prompt": "hi", "use_beam_search": True}, 400,
     "use_beam_search"),
    ("vllm-bad-words", CHAT, {"messages": USER, "bad_words": ["x"]}, 400, "bad_words"),
    ("vllm-request-chat-template", CHAT, {"messages": USER, "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("openai-functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("tools-not-functions", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("tool-choice-unknown-function", CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("tool-choice-required-without-tools", CHAT, {"messages": USER, "tool_choice": "required"},
     400, "tool_choice"),
    ("tool-choice-auto-not-enabled", CHAT, {"messages": USER, "tools": [TOOL]}, 400,
     "tool_choice"),
    ("tool-choice-and-response-format", CHAT, {
        "messages": USER, "tools": [TOOL], "tool_choice": "required",
        "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("tool-parameters-invalid", CHAT, {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     400, "tools"),
    ("parallel-tool-calls-string", CHAT, {"messages": USER, "tools": [TOOL],
                                          "tool_choice": "none", "parallel_tool_calls": "no"},
     400, "parallel_tool_calls"),
    ("max-completion-tokens-negative", CHAT, {"messages": USER, "max_completion_tokens": -3},
     400, "max_completion_tokens"),
    ("tokenize-empty", "/tokenize", {}, 400, "prompt"),
    ("tokenize-int-prompt", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("detokenize-string", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize-missing", "/detokenize", {}, 400, "tokens"),
    ("unknown-route", "/v1/engines", {}, 404, None),
]


async def send(session, url, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(), r.headers


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
async def test_bad_request_gets_the_right_error(server, path, body, status, param):
    async with aiohttp.ClientSession() as s:
        got, error, _ = await send(s, server.url + path, body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == status and error["error"]["message"]
    if param is not None:
        assert error["error"]["param"] == param, error


def test_the_suite_has_at_least_forty_cases():
    assert len(CASES) >= 40


async def test_wrong_method_is_405_json(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + C) as r:
            body = await r.json()
    assert r.status == 405 and body["error"]["code"] == 405


async def test_unknown_fields_are_ignored(server):
    async with aiohttp.ClientSession() as s:
        status, body, _ = await send(s, server.url + C, {**OK, "frobnicate": {"a": [1]},
                                                         "x_debug": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_server_still_serves_and_nothing_is_left_allocated(server):
    async with aiohttp.ClientSession() as s:
        status, body, _ = await send(s, server.url + C, OK)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
    stats = await wait_idle(server.llm)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_used_pages"] == 0


@pytest.fixture
def aborted(server, monkeypatch):
    """Request ids the engine really aborted (they were still live)."""
    engine = server.llm.engine
    real_abort = engine.abort
    ids = []

    def abort(request_id):
        out = real_abort(request_id)
        if out is not None:
            ids.append(request_id)
        return out
    monkeypatch.setattr(engine, "abort", abort)
    return ids


async def test_dropped_streams_abort_and_free_their_pages(server, aborted):
    body = {"prompt": "tell me a story", "max_tokens": 100, "ignore_eos": True,
            "temperature": 0, "stream": True}

    async def drop_after_two_chunks(session):
        resp = await session.post(server.url + C, json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
                if seen == 2:
                    break
        resp.close()  # drops the connection mid-generation

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        await asyncio.gather(*(drop_after_two_chunks(s) for _ in range(20)))
    stats = await wait_idle(server.llm)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_used_pages"] == 0
    assert len(aborted) == 20


async def test_dropped_unstreamed_request_is_aborted(server, aborted):
    body = {"prompt": "tell me a story", "max_tokens": 120, "ignore_eos": True, "n": 8}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(send(s, server.url + C, body))
        for _ in range(200):
            if server.llm.stats()["num_running"]:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    stats = await wait_idle(server.llm)
    assert stats["num_running"] == 0 and stats["num_used_pages"] == 0
    assert len(aborted) == 1


@pytest.fixture(scope="module")
def keyed_server(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny", api_key="sekret").start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": "sekret"}, 401),
    ({"Authorization": "Bearer sekret"}, 200)])
async def test_api_key_is_required_on_v1_routes(keyed_server, headers, status):
    async with aiohttp.ClientSession(headers=headers) as s:
        got, body, _ = await send(s, keyed_server.url + C, OK)
        async with s.get(keyed_server.url + "/v1/models") as r:
            assert r.status == status
        async with s.get(keyed_server.url + "/health") as r:
            assert r.status == 200
    assert got == status
    if status == 401:
        assert body["error"]["code"] == 401 and body["error"]["type"] == "AuthenticationError"


async def test_chunked_body_past_the_limit_is_413(server):
    async def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}'
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + C, data=chunks()) as r:
            body = await r.json()
    assert r.status == 413 and body["error"]["code"] == 413
