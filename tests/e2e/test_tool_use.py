"""The shipped tiny model uses a tool end to end through the server and the official
`openai` client: it calls `add`, the test runs the call, and the model answers from the
result. With the qwen3 reasoning parser on and off, streamed and not; tool_choice "none"
leaves the call text in the content."""

from __future__ import annotations

import json

import openai
import pytest

from qwen_jax.tool_task import ADD_TOOL
from tests.server.conftest import EMBEDDED_ENGINE, ServerThread

ASK = [{"role": "user", "content": "Use the tool to add 385 and 47."}]
CALL = '{"a": 385, "b": 47}'


# One engine shape for the server's engine and the offline LLM: the second one's steps
# come from the persistent compilation cache the first one filled.
ENGINE = EMBEDDED_ENGINE


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="module")
def tool_llm(xla_cache):
    from qwen_jax.weights import DEFAULT_MODEL_DIR
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(DEFAULT_MODEL_DIR), compilation_cache_dir=xla_cache, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=[None, "qwen3"], ids=["plain", "reasoning"])
def tool_server(tool_llm, request):
    srv = ServerThread(tool_llm, served_model_name="tiny-qwen3-moe", tool_call_parser="hermes",
                       enable_auto_tool_choice=True, reasoning_parser=request.param).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(tool_server):  # per test: its connections belong to that test's event loop
    return openai.AsyncOpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def run_tool(call) -> str:
    assert call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    return str(arguments["a"] + arguments["b"])


async def ask(client, messages, **kwargs):
    return await client.chat.completions.create(model="tiny-qwen3-moe", messages=messages,
                                                tools=[ADD_TOOL], temperature=0, **kwargs)


async def test_model_calls_the_tool_and_answers_from_its_result(client):
    first = (await ask(client, ASK)).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "add" and call.function.arguments == CALL
    assert first.message.content in (None, "<think>\n\n</think>\n\n")  # parser off: think
    result = run_tool(call)
    history = [*ASK, {"role": "assistant", "content": first.message.content,
                      "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = (await ask(client, history)).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert second.message.content.endswith("385 + 47 = 432")


async def test_streamed_call_joins_to_the_same_call(client):
    deltas = [c.choices[0] async for c in await ask(client, ASK, stream=True)]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert {tc.index for tc in calls} == {0} and calls[0].function.name == "add"
    assert "".join(tc.function.arguments or "" for tc in calls) == CALL
    assert deltas[-1].finish_reason == "tool_calls"


async def test_required_and_named_tool_choice_get_the_same_call(client):
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        message = (await ask(client, ASK, tool_choice=choice)).choices[0].message
        assert [c.function.arguments for c in message.tool_calls] == [CALL]


async def test_tool_choice_none_leaves_the_call_as_text(client):
    message = (await ask(client, ASK, tool_choice="none")).choices[0].message
    assert not message.tool_calls and '"arguments": ' + CALL in message.content


def test_offline_chat_renders_tools_and_is_constrained_by_their_grammar(xla_cache):
    from qwen_jax import LLM, SamplingParams
    from serving.parsers.tool_parsers import calls_grammar
    llm = LLM(compilation_cache_dir=xla_cache, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=64)
    (free,) = llm.chat(ASK, greedy, tools=[ADD_TOOL])
    assert free.outputs[0].text.endswith(
        '<tool_call>\n{"name": "add", "arguments": ' + CALL + "}\n</tool_call>")
    tokenizer = llm.get_tokenizer()
    ids = {t: tokenizer.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    forced = SamplingParams(temperature=0, max_tokens=64, structured_outputs={
        "grammar": calls_grammar([ADD_TOOL], False, ids), "reasoning": True})
    (out,) = llm.chat(ASK, forced, tools=[ADD_TOOL])
    assert out.outputs[0].text == free.outputs[0].text  # the grammar allows what it writes
