"""Tool calls through the official `openai` client on a random-weight model: every
`tool_choice`, streamed and not, with and without the qwen3 reasoning parser. "required"
and a named function are enforced by a grammar, so even random weights must call a tool
with arguments that follow its schema; "auto" and "none" leave the model free."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import ServerThread, wait_idle

INT = {"type": "integer", "minimum": -999, "maximum": 999}  # bounded: random weights stop
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": INT, "b": INT},
                   "required": ["a", "b"], "additionalProperties": False}}}
ECHO = {"type": "function", "function": {
    "name": "echo", "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "maxLength": 6}}, "required": ["word"]}}}
TOOLS = [ADD, ECHO]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Add 385 and 47."}]
# Seeds whose replies close their calls within max_tokens. Random weights sometimes write
# an extra property into echo's arguments (its schema allows them) until max_tokens: 2 to
# 3 seeds of 24 with either the Gumbel or the block softmax draw (seed 1 with the latter).
SEEDS = (0, 2, 3, 4)


@pytest.fixture(scope="module", params=[None, "qwen3"], ids=["plain", "reasoning"])
def tool_server(long_llm, request):
    srv = ServerThread(long_llm, served_model_name="tiny", tool_call_parser="hermes",
                       enable_auto_tool_choice=True, reasoning_parser=request.param).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(tool_server):
    return openai.AsyncOpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names=SCHEMAS):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def create(client, **kwargs):
    """Random weights would think forever (the grammar lets a think block come first when
    the reasoning parser is on), so the prompt closes the think block."""
    return await client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=1.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kwargs)


async def collect(stream):
    """(content, {index: (id, name, arguments)}, finish_reason) of a streamed choice."""
    content, calls, finish = "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            id_, name, args = calls.get(tc.index, (None, None, ""))
            calls[tc.index] = (tc.id or id_, (tc.function.name if tc.function else None) or name,
                               args + ((tc.function.arguments or "") if tc.function else ""))
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("seed", SEEDS)
async def test_required_always_calls_a_tool_with_valid_arguments(client, seed):
    out = await create(client, tool_choice="required", seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("seed", SEEDS[:3])
async def test_required_streamed_joins_to_the_unstreamed_calls(client, seed):
    whole = (await create(client, tool_choice="required", seed=seed)).choices[0]
    content, calls, finish = await collect(await create(client, tool_choice="required",
                                                        seed=seed, stream=True))
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    assert [(n, a) for _, n, a in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(id_.startswith("chatcmpl-tool-") for id_, _, _ in calls.values())


async def test_named_function_is_called_once_and_finishes_with_stop(client):
    for seed in SEEDS[:3]:
        out = await create(client, seed=seed,
                           tool_choice={"type": "function", "function": {"name": "echo"}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names={"echo"})


async def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in SEEDS[:3]:
        out = await create(client, seed=seed, tool_choice="required", parallel_tool_calls=False)
        assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["auto", "none"])
async def test_auto_and_none_leave_a_random_model_free(client, choice):
    out = await create(client, tool_choice=choice, seed=1, max_tokens=8)
    choice_ = out.choices[0]
    assert choice_.finish_reason in ("length", "stop") and not choice_.message.tool_calls
    assert out.usage.completion_tokens <= 8


async def test_tool_turns_render_through_the_template(client):
    call = {"id": "call_0", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 385, "b": 47}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "432"}]
    out = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                               tool_choice="none", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


async def test_everything_is_released(tool_server):
    stats = await wait_idle(tool_server.llm)
    assert stats["num_running"] == 0 and stats["num_used_pages"] == 0
