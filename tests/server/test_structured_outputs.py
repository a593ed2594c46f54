"""Structured outputs through the official `openai` client on a random-weight model at
temperature 1.0: whatever the weights want, every reply follows its JSON schema, regex or
choice (20 seeds each, sent concurrently so constrained rows share batches), with the
qwen3 reasoning parser and enable_thinking false too. Unconstrained rows are unaffected."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import ServerThread, wait_idle

SEEDS = range(20)
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["alpha", "beta", "gamma delta"]
ASK = [{"role": "user", "content": "Describe someone."}]


@pytest.fixture(scope="module")
def reasoning_server(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny", reasoning_parser="qwen3").start()
    yield srv
    srv.stop()


def client_of(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def chat_all(server, **kwargs) -> list:
    client = client_of(server)
    return await asyncio.gather(*(client.chat.completions.create(
        model="tiny", messages=ASK, temperature=1.0, seed=seed, **kwargs) for seed in SEEDS))


async def test_json_schema_replies_validate(server):
    for out in await chat_all(server, response_format=RESPONSE_FORMAT):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


async def test_regex_completions_match(server):
    client = client_of(server)
    outs = await asyncio.gather(*(client.completions.create(
        model="tiny", prompt="Code:", temperature=1.0, seed=seed, max_tokens=20,
        extra_body={"guided_regex": REGEX}) for seed in SEEDS))
    for out in outs:
        assert re.fullmatch(REGEX, out.choices[0].text), out.choices[0].text
        assert out.choices[0].finish_reason == "stop"


async def test_choice_replies_are_one_of_the_choices(server):
    outs = await chat_all(server, extra_body={"structured_outputs": {"choice": CHOICES}})
    texts = [out.choices[0].message.content for out in outs]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1  # the weights still choose


async def test_enable_thinking_false_with_reasoning_parser_validates(reasoning_server):
    outs = await chat_all(reasoning_server, response_format=RESPONSE_FORMAT, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    for out in outs:
        message = out.choices[0].message
        assert message.reasoning_content is None
        jsonschema.validate(json.loads(message.content), SCHEMA)


async def test_json_object_and_completions_structured_outputs(server):
    client = client_of(server)
    chat = await client.chat.completions.create(
        model="tiny", messages=ASK, temperature=1.0, seed=3, max_tokens=100,
        response_format={"type": "json_object"})
    text = chat.choices[0].message.content  # any object: random weights may not finish it
    assert text.startswith("{")
    assert chat.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    out = await client.completions.create(
        model="tiny", prompt="JSON:", temperature=1.0, seed=4, max_tokens=100,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


async def test_streamed_constrained_reply_joins_to_the_unstreamed_one(server):
    client = client_of(server)
    kwargs = dict(model="tiny", messages=ASK, temperature=1.0, seed=11,
                  response_format=RESPONSE_FORMAT)
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(stream=True, **kwargs)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == whole.choices[0].message.content


async def test_unconstrained_rows_sample_as_if_alone(server):
    """A seeded free request draws the same tokens next to constrained ones."""
    client = client_of(server)
    free = dict(model="tiny", prompt="Once", temperature=1.0, seed=5, max_tokens=12,
                extra_body={"ignore_eos": True})
    alone = await client.completions.create(**free)
    together = await asyncio.gather(client.completions.create(**free), *(
        client.completions.create(model="tiny", prompt="x", temperature=1.0, seed=s,
                                  max_tokens=12, extra_body={"guided_regex": REGEX})
        for s in range(5)))
    assert together[0].choices[0].text == alone.choices[0].text


async def test_everything_is_released(server):
    stats = await wait_idle(server.llm)
    assert stats["num_running"] == 0 and stats["num_used_pages"] == 0
