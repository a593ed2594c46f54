"""The Responses API (`/v1/responses`) through the official `openai` client on the shipped
tiny model: a plain answer with its reasoning split off, streamed events that reassemble
into the unstreamed response, a forced tool call and its follow-up turn (by
`previous_response_id` and by sending the items back), a JSON schema, stored responses,
and errors naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from qwen_jax.tool_task import ADD_TOOL
from tests.server.conftest import EMBEDDED_MODEL, serve_embedded_model

MODEL = EMBEDDED_MODEL
ADD = {"type": "function", **ADD_TOOL["function"]}  # the Responses API's tool shape


@pytest.fixture(scope="module")
def responses_server(tmp_path_factory):
    with serve_embedded_model(tmp_path_factory.mktemp("xla"), tool_call_parser="hermes",
                              enable_auto_tool_choice=True, reasoning_parser="qwen3") as srv:
        yield srv


@pytest.fixture
def client(responses_server):
    return openai.AsyncOpenAI(base_url=responses_server.url + "/v1", api_key="unused",
                              max_retries=0)


def _items(response) -> list[tuple]:
    """A response's output without its ids: (type, text or name and arguments)."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(part.text for part in item.content)))
        else:
            out.append((item.type, item.name, item.arguments))
    return out


async def test_a_plain_answer_with_its_reasoning(client):
    out = await client.responses.create(model=MODEL, input="What is 385 + 47?", temperature=0)
    assert out.object == "response" and out.status == "completed" and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output_text == "432"
    assert out.output[0].content[0].text.strip() == "2 3 4"  # its carries: the think block
    assert out.usage.input_tokens > 0 and out.usage.output_tokens > 3
    assert out.usage.output_tokens_details.reasoning_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


async def test_streamed_events_reassemble_into_the_response(client):
    kwargs = dict(model=MODEL, input="What is 385 + 47?", temperature=0)
    whole = await client.responses.create(**kwargs)
    events = [event async for event in await client.responses.create(stream=True, **kwargs)]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert _items(final) == _items(whole) and final.output_text == "432"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "432" and thought == whole.output[0].content[0].text
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 2


async def test_a_forced_tool_call_and_its_follow_up_turn(client):
    first = await client.responses.create(
        model=MODEL, input="Use the tool to add 385 and 47.", tools=[ADD], temperature=0,
        tool_choice={"type": "function", "name": "add"})
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 385, "b": 47}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "432"}
    # continued by id: the stored response holds the conversation so far
    second = await client.responses.create(model=MODEL, previous_response_id=first.id,
                                           input=[result], tools=[ADD], temperature=0)
    assert second.output_text.endswith("385 + 47 = 432")
    assert second.previous_response_id == first.id
    # stateless: the items sent back give the same answer
    again = await client.responses.create(
        model=MODEL, tools=[ADD], temperature=0, store=False,
        input=[{"role": "user", "content": "Use the tool to add 385 and 47."},
               {"type": "function_call", "call_id": call.call_id, "name": "add",
                "arguments": call.arguments}, result])
    assert again.output_text == second.output_text


async def test_a_streamed_tool_call(client):
    events = [e async for e in await client.responses.create(
        model=MODEL, input="Use the tool to add 385 and 47.", tools=[ADD], temperature=0,
        tool_choice="required", stream=True)]
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(pieces) == json.loads(done.arguments) == {"a": 385, "b": 47}
    (call,) = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == done.arguments and call.status == "completed"


async def test_a_json_schema_answer(client):
    schema = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0,
                                                       "maximum": 9999}},
              "required": ["sum"], "additionalProperties": False}
    out = await client.responses.create(
        model=MODEL, input="What is 385 + 47?", temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(out.output_text), schema)


async def test_max_output_tokens_leaves_it_incomplete(client):
    out = await client.responses.create(model=MODEL, input="What is 385 + 47?",
                                        temperature=0, max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


async def test_instructions_are_the_system_message(client):
    kwargs = dict(model=MODEL, input="What is 385 + 47?", temperature=0, max_output_tokens=4)
    plain = await client.responses.create(**kwargs)
    told = await client.responses.create(instructions="Answer in words.", **kwargs)
    assert told.instructions == "Answer in words." and plain.instructions is None
    assert told.usage.input_tokens > plain.usage.input_tokens + 4  # the system turn


async def test_stored_responses_are_retrieved_and_unknown_ids_named(client):
    out = await client.responses.create(model=MODEL, input="What is 1 + 2?", temperature=0)
    assert (await client.responses.retrieve(out.id)).output_text == out.output_text
    unstored = await client.responses.create(model=MODEL, input="What is 1 + 2?", store=False)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"background": True}, "background"),
])
async def test_bad_fields_are_named(client, fields, param):
    body = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**body)
    assert info.value.body["param"] == param
