"""/v1/completions `echo` and vLLM's `prompt_logprobs` on both routes, as evaluation
harnesses call them: the prompt before each choice's text, its tokens' logprobs first in
`logprobs` (the first token's null), token-id and list prompts, max_tokens 0 for pure
scoring, streamed as vLLM streams it."""

from __future__ import annotations

import math

import pytest

from tests.server.test_routes import post, stream_events

GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


async def _prompt_scores(server, ids) -> list:
    """Each prompt token's logprob through the prompt_logprobs field (k = 1)."""
    status, body = await post(server, "/v1/completions", {
        **GREEDY, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    return [None] + [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], entries[1:])]


async def test_echo_puts_the_prompt_before_the_text(server):
    body = {**GREEDY, "prompt": "The capital of France is", "max_tokens": 5}
    status, plain = await post(server, "/v1/completions", body)
    status2, echoed = await post(server, "/v1/completions", {**body, "echo": True})
    assert status == status2 == 200
    assert echoed["choices"][0]["text"] == body["prompt"] + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]


async def test_echo_with_logprobs_scores_the_prompt_tokens(server):
    prompt = "One two three four five six"
    ids = server.llm.tokenizer.encode(prompt)
    status, body = await post(server, "/v1/completions", {
        **GREEDY, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2})
    assert status == 200
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert "".join(lp["tokens"][:len(ids)]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scores = await _prompt_scores(server, ids)
    for got, want in zip(lp["token_logprobs"][1:len(ids)], scores[1:]):
        assert math.isclose(got, want, abs_tol=1e-4)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets[len(ids)] == len(prompt)  # the first generated token
    assert choice["text"].startswith(prompt)


async def test_pure_scoring_with_max_tokens_zero_and_token_id_prompts(server):
    # lm-evaluation-harness's loglikelihood requests: token ids, echo, logprobs, nothing new
    prompts = [[791, 6722, 315, 9625, 374], [9, 22, 4, 17]]
    status, body = await post(server, "/v1/completions", {
        **GREEDY, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    for choice, ids in zip(body["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids)  # the prompt alone
        assert choice["text"] == server.llm.tokenizer.decode(ids, skip_special_tokens=False)
        scores = await _prompt_scores(server, ids)
        assert lp["token_logprobs"][0] is None
        for got, want in zip(lp["token_logprobs"][1:], scores[1:]):
            assert math.isclose(got, want, abs_tol=1e-4)
    assert body["usage"]["completion_tokens"] == 0


async def test_max_tokens_zero_needs_echo(server):
    status, body = await post(server, "/v1/completions", {**GREEDY, "prompt": "hi",
                                                          "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


async def test_streamed_echo_sends_the_prompt_first(server):
    body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 4, "echo": True,
            "logprobs": 1}
    status, whole = await post(server, "/v1/completions", body)
    events = await stream_events(server, "/v1/completions", {**body, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"].startswith("Once upon a time")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_returns_prompt_logprobs_at_the_top_level(server):
    status, body = await post(server, "/v1/chat/completions", {
        **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert status == 200
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in entries[1:])  # k = 0: the prompt token alone


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                          ("prompt_logprobs", "2")])
async def test_bad_prompt_logprobs_are_named(server, field, value):
    status, body = await post(server, "/v1/completions",
                              {**GREEDY, "prompt": "hi", "max_tokens": 1, field: value})
    assert status == 400 and body["error"]["param"] == field


async def test_tokenizer_info_is_served_only_when_enabled(server, shared_llm):
    import aiohttp

    from tests.server.conftest import ServerThread
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/tokenizer_info") as r:
            assert r.status == 404  # off by default, as vLLM's
    srv = ServerThread(shared_llm, served_model_name="tiny",
                       enable_tokenizer_info_endpoint=True).start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/tokenizer_info") as r:
                info = await r.json()
        assert r.status == 200 and info["tokenizer_class"] == "Qwen2Tokenizer"
        assert "{%" in info["chat_template"] and info["eos_token"] == "<|im_end|>"
        assert 151645 in info["eos_token_ids"] and "vocab_file" not in info
    finally:
        srv.stop()
