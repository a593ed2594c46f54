"""A fake OpenAI-compatible streaming server for the load generator's tests: one SSE chunk
per token, usage when asked, a 500 for prompts containing FAIL, and optionally vLLM's
running/waiting gauges and speculative-decoding counters on /metrics."""

import asyncio
import contextlib
import json
import threading
from types import SimpleNamespace

import pytest
from aiohttp import web


def _fake_app(state) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        state.bodies.append(body)
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        state.active += 1
        state.max_active = max(state.max_active, state.active)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(0.03)  # "prefill"
            n = body.get("max_completion_tokens") or body["max_tokens"]
            for i in range(n):
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else \
                    {"index": 0, "text": f" t{i}"}
                await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                await asyncio.sleep(0.005)
            if state.send_usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                     .encode())
            await response.write(b"data: [DONE]\n\n")
            state.served += 1
            return response
        finally:
            state.active -= 1

    async def metrics(request: web.Request) -> web.Response:
        if not state.metrics:
            raise web.HTTPNotFound()
        spec = "".join(  # speculative decoding's counters: 2 drafts, 3 of 6 kept a request
            f'{prefix}:spec_decode_num_{name}_total{{model_name="m"}} {per * state.served}\n'
            for prefix in ("vllm", "qwen_jax")
            for name, per in (("drafts", 2), ("draft_tokens", 6), ("accepted_tokens", 3)))
        return web.Response(text=f'vllm:num_requests_running{{model_name="m"}} {state.active}\n'
                                 'vllm:num_requests_waiting{model_name="m"} 0\n' + spec)

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/metrics", metrics)
    return app


@contextlib.contextmanager
def serve_in_thread(app: web.Application):
    """`app` on 127.0.0.1:<free port>, run by an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def fake_server():
    """(url, state): state counts active requests and keeps the bodies received."""
    state = SimpleNamespace(active=0, max_active=0, bodies=[], send_usage=True, metrics=False,
                            served=0)
    with serve_in_thread(_fake_app(state)) as url:
        yield url, state
