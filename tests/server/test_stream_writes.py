"""Streams over real HTTP: the server writes at most one chunk per output token (a reader
that fell behind gets what waits as one output, so fewer), plus the finish and [DONE]."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web


async def test_concurrent_streams_take_at_most_one_write_per_token(server, monkeypatch):
    writes = [0]
    original = web.StreamResponse.write

    async def counted(self, data):
        writes[0] += 1
        return await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted)
    num_streams, max_tokens = 4, 24

    async def one(session, i: int) -> int:
        body = {"prompt": [2 + i, 3, 4], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            return len([line async for line in r.content if line.strip()])

    async with aiohttp.ClientSession() as session:
        events = await asyncio.gather(*(one(session, i) for i in range(num_streams)))
    assert writes[0] == sum(events)  # one event a write
    assert all(2 <= n <= max_tokens + 2 for n in events), events
