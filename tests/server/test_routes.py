"""Every route over real HTTP on loopback: completions and chat, streamed and not, n > 1,
stop strings, logprobs, usage that matches the tokenizer, and concurrency (greedy)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.helpers.prometheus import parse_values
from tests.server.conftest import wait_idle

GREEDY = {"temperature": 0, "ignore_eos": True}


async def post(server, path, body, **kwargs):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body, **kwargs) as r:
            return r.status, await r.json()


async def stream_events(server, path, body):
    """The `data:` payloads of an SSE response, [DONE] included as the string."""
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line:
                    assert line.startswith("data: ")
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_models_lists_the_served_model(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/models") as r:
            body = await r.json()
    assert r.status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"] and body["data"][0]["max_model_len"] == 128


async def test_health_is_200(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/health") as r:
            assert r.status == 200


async def test_completion_usage_matches_the_tokenizer(server):
    prompt = "The capital of France is"
    status, body = await post(server, "/v1/completions",
                              {"model": "tiny", "prompt": prompt, "max_tokens": 7, **GREEDY})
    assert status == 200 and body["object"] == "text_completion"
    num_prompt = len(server.llm.tokenizer.encode(prompt))
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 7,
                             "total_tokens": num_prompt + 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert isinstance(choice["text"], str) and choice["text"]


async def test_token_id_prompt_and_default_max_tokens_of_16(server):
    status, body = await post(server, "/v1/completions", {"prompt": [1, 2, 3], **GREEDY})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 16


async def test_streamed_completion_concatenates_to_the_unstreamed_text(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    _, whole = await post(server, "/v1/completions", body)
    events = await stream_events(
        server, "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_completion_streamed_and_not(server):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}, **GREEDY}
    status, whole = await post(server, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    ids = server.llm.tokenizer.apply_chat_template(body["messages"], tokenize=True,
                                                   enable_thinking=False)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert whole["usage"]["completion_tokens"] == 8
    events = await stream_events(server, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_enable_thinking_changes_the_prompt(server):
    messages = [{"role": "user", "content": "Hi"}]
    _, on = await post(server, "/tokenize", {"messages": messages})
    _, off = await post(server, "/tokenize", {"messages": messages,
                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert off["count"] > on["count"]  # the empty <think></think> block


async def test_n_greater_than_one_returns_n_choices(server):
    body = {"prompt": "Hello", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    status, whole = await post(server, "/v1/completions", body)
    assert status == 200 and sorted(c["index"] for c in whole["choices"]) == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 18
    assert len({c["text"] for c in whole["choices"]}) > 1
    events = await stream_events(server, "/v1/completions", {**body, "stream": True})
    texts = {}
    for c in events[:-1]:
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


async def test_batched_prompts_index_choices_by_prompt_then_sample(server):
    status, body = await post(server, "/v1/completions",
                              {"prompt": ["Hello", [5, 6, 7]], "n": 2, "max_tokens": 3, **GREEDY})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy samples agree
    assert body["usage"]["prompt_tokens"] == len(server.llm.tokenizer.encode("Hello")) + 3


async def test_stop_string_cuts_the_text_there(server):
    body = {"prompt": "Write a list:", "max_tokens": 20, **GREEDY}
    _, whole = await post(server, "/v1/completions", body)
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    _, cut = await post(server, "/v1/completions", {**body, "stop": [stop]})
    assert cut["choices"][0]["text"] == expected
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == stop
    events = await stream_events(server, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == expected


async def test_stop_token_ids_finish_with_that_id(server):
    from serving.core.request import SamplingParams
    prompt = [9, 8, 7]
    outs = [o async for o in server.llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    ids = outs[-1].outputs[0].token_ids
    stop_id = ids[2]
    _, body = await post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                     "stop_token_ids": [stop_id], **GREEDY})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == ids.index(stop_id) + 1


async def test_completion_logprobs(server):
    status, body = await post(server, "/v1/completions",
                              {"prompt": "Hi", "max_tokens": 4, "logprobs": 3, **GREEDY})
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    assert lp["text_offset"][0] == 0


async def test_chat_logprobs_and_top_logprobs(server):
    status, body = await post(server, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                               "logprobs": True, "top_logprobs": 2, **GREEDY})
    content = body["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy takes the top one


async def test_concurrent_requests_get_what_they_get_alone(server):
    prompts = ["alpha beta", "The quick brown fox jumps over", "1 2 3 4 5 6 7 8 9",
               "Hello", "Qwen is a language model that"]
    body = {"max_tokens": 10, **GREEDY}
    together = await asyncio.gather(*(post(server, "/v1/completions", {**body, "prompt": p})
                                      for p in prompts))
    alone = [await post(server, "/v1/completions", {**body, "prompt": p}) for p in prompts]
    assert [b["choices"][0]["text"] for _, b in together] == \
        [b["choices"][0]["text"] for _, b in alone]


async def test_tokenize_and_detokenize_round_trip(server):
    status, tok = await post(server, "/tokenize",
                             {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and tok["tokens"] == server.llm.tokenizer.encode("Hello world")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
    assert len(tok["token_strs"]) == tok["count"]
    status, detok = await post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": "Hello world"}


async def test_metrics_count_requests_and_tokens(server):
    await post(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 5, **GREEDY})
    await wait_idle(server.llm)
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
    assert r.status == 200
    values = parse_values(text)
    label = '{model_name="tiny"}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert values[f"qwen_jax:{name}{label}"] == 0
    assert values[f"qwen_jax:generation_tokens_total{label}"] >= 5
    assert values[f"qwen_jax:prompt_tokens_total{label}"] >= 1
    assert values['qwen_jax:request_success_total{finished_reason="length",model_name="tiny"}'] >= 1
    assert values[f"qwen_jax:time_to_first_token_seconds_count{label}"] >= 1
    assert values[f"qwen_jax:e2e_request_latency_seconds_count{label}"] >= 1
    assert values[f"qwen_jax:request_queue_time_seconds_count{label}"] >= 1
    assert values[f"qwen_jax:inter_token_latency_seconds_count{label}"] >= 4
    assert values[f"qwen_jax:iteration_tokens_total_count{label}"] >= 5
    assert f"qwen_jax:prefix_cache_queries_total{label}" in values
    assert f"qwen_jax:prefix_cache_hits_total{label}" in values
    assert f"qwen_jax:num_preemptions_total{label}" in values
    assert values[f"qwen_jax:num_compiles_total{label}"] >= 1


async def test_unknown_route_is_a_json_404(server):
    status, body = await post(server, "/v1/nope", {})
    assert status == 404 and body["error"]["code"] == 404


async def test_everything_is_released_afterwards(server):
    stats = await wait_idle(server.llm)
    assert stats["num_running"] == 0 and stats["num_used_pages"] == 0
