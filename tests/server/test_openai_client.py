"""The official `openai` client drives completions and chat, streamed and not."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import wait_idle

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def test_completion(client):
    out = await client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                          logprobs=2, **GREEDY)
    assert isinstance(out, openai.types.Completion) and out.object == "text_completion"
    assert out.model == "tiny" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 5
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == \
        out.usage.prompt_tokens + 5


async def test_streamed_completion(client):
    stream = await client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                             stream=True, stream_options={"include_usage": True},
                                             **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    text = "".join(c.choices[0].text for c in chunks[:-1])
    whole = await client.completions.create(model="tiny", prompt="Hello", max_tokens=6, **GREEDY)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_chat(client):
    out = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, n=2,
        logprobs=True, top_logprobs=3, temperature=0.8, seed=3,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert out.object == "chat.completion" and [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == 8


async def test_streamed_chat(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
                  **GREEDY)
    stream = await client.chat.completions.create(stream=True, **kwargs)
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = await client.chat.completions.create(**kwargs)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_and_errors(client, server):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.completions.create(model="tiny", prompt="x", temperature=-1)
    stats = await wait_idle(server.llm)
    assert stats["num_used_pages"] == 0
