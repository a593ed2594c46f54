"""Request ids (X-Request-Id echoed or generated, in response ids and logs), CORS for the
allowed origins only, and the API key check."""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
import pytest

from serving.entrypoints.openai.http_policy import api_key_matches, parse_origins, request_id
from tests.server.conftest import ServerThread

ORIGIN = "https://app.example.com"
BODY = {"prompt": "ids", "max_tokens": 2, "temperature": 0}


async def test_a_client_request_id_is_echoed_and_names_the_response(server, caplog):
    caplog.set_level(logging.INFO, logger="qwen_jax.server")
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=BODY,
                          headers={"X-Request-Id": "trace-42"}) as r:
            body = await r.json()
            assert r.status == 200 and r.headers["X-Request-Id"] == "trace-42"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True}
        async with s.post(server.url + "/v1/chat/completions", json=chat,
                          headers={"X-Request-Id": "trace-43"}) as r:
            first = await r.content.readline()
            assert r.headers["X-Request-Id"] == "trace-43"  # streamed responses carry it too
            await r.read()
    assert body["id"] == "cmpl-trace-42"
    assert b'"id": "chatcmpl-trace-43"' in first
    assert any("POST /v1/completions 200" in m and "request_id=trace-42" in m
               for m in caplog.messages)


async def test_without_a_request_id_one_is_generated(server):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=BODY) as r:
            body = await r.json()
            generated = r.headers["X-Request-Id"]
        async with s.get(server.url + "/v1/nope") as r:  # errors carry one as well
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-Id"])
    assert re.fullmatch(r"[0-9a-f]{32}", generated) and body["id"] == f"cmpl-{generated}"


async def test_a_reused_request_id_does_not_collide_in_the_engine(server):
    async def one(s):
        async with s.post(server.url + "/v1/completions", json=BODY,
                          headers={"X-Request-Id": "same"}) as r:
            return r.status
    async with aiohttp.ClientSession() as s:
        assert await asyncio.gather(one(s), one(s)) == [200, 200]


async def test_an_unusable_request_id_is_refused_naming_the_header(server):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=BODY,
                          headers={"X-Request-Id": "has spaces"}) as r:
            body = await r.json()
            assert r.status == 400 and r.headers["X-Request-Id"] != "has spaces"
    assert body["error"]["param"] == "X-Request-Id"
    assert "X-Request-Id='has spaces'" in body["error"]["message"]
    with pytest.raises(ValueError, match="1 to 128 characters"):
        request_id({"X-Request-Id": "x" * 129})


@pytest.fixture(scope="module")
def cors_server(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny", api_key="sekret",
                       allowed_origins=(ORIGIN,)).start()
    yield srv
    srv.stop()


async def test_preflight_from_an_allowed_origin_needs_no_key(cors_server):
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    async with aiohttp.ClientSession() as s:
        async with s.options(cors_server.url + "/v1/completions", headers=headers) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        async with s.options(cors_server.url + "/v1/completions",
                             headers={**headers, "Origin": "https://evil.example"}) as r:
            body = await r.json()
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
    assert "'https://evil.example' is not allowed" in body["error"]["message"]


async def test_responses_name_the_allowed_origin_only(cors_server, server):
    key = {"Authorization": "Bearer sekret"}
    async with aiohttp.ClientSession() as s:
        async with s.get(cors_server.url + "/v1/models", headers={**key, "Origin": ORIGIN}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert r.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
            assert r.headers["Vary"] == "Origin"
        async with s.get(cors_server.url + "/v1/models",
                         headers={**key, "Origin": "https://evil.example"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        async with s.get(server.url + "/v1/models", headers={"Origin": ORIGIN}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers  # none allowed by default


def test_origins_parse_from_lists_commas_and_vllm_json():
    assert parse_origins(["https://a.example/", "https://b.example,https://c.example"]) == \
        ("https://a.example", "https://b.example", "https://c.example")
    assert parse_origins(['["*"]']) == ("*",)
    with pytest.raises(ValueError, match="allowed_origins"):
        parse_origins(['[1, 2]'])


@pytest.mark.parametrize("header,ok", [
    ("Bearer sekret", True), ("bearer sekret", True), ("Bearer sekre", False),
    ("Bearer sekret2", False), ("sekret", False), ("", False)])
def test_api_key_check(header, ok):
    assert api_key_matches(header, "sekret") is ok
