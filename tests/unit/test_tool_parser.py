"""The Hermes (Qwen3) tool-call parser on canned replies: whole and streamed token by token,
inside and after a think block, two calls, tags split across tokens, broken JSON, unknown
functions, no call."""

from __future__ import annotations

import json

import pytest

from serving.parsers.chat_reply import ReplyFormat
from serving.parsers.reasoning import Qwen3ReasoningParser
from serving.parsers.tool_parsers import HermesToolParser, calls_grammar

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 385, "b": 47}}\n</tool_call>'
MUL = ('<tool_call>\n{"name": "mul", "arguments": {"x": "a \\"}\\" b", "y": [1, {"z": 2}]}}'
       "\n</tool_call>")
THINK = "<think>\nI should add them.\n</think>\n\n"


def stream(text: str, pieces: list[str] | None = None, **kwargs):
    """Feed `text` in the given pieces (default: 3 characters at a time)."""
    pieces = pieces or [text[i:i + 3] for i in range(0, len(text), 3)]
    assert "".join(pieces) == text
    parser = HermesToolParser(**kwargs)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        c, deltas = parser.feed(piece, finished=i == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None  # the name and id come once, first
                call.update(id=d["id"], name=d["function"]["name"])
            call["arguments"] += d["function"]["arguments"]
    rest, parsed = parser.finish()
    return content + rest, [calls[i] for i in sorted(calls)], parsed


def as_dicts(parsed):
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.calls]


def test_one_call_after_a_think_block():
    parsed = HermesToolParser.extract(THINK + ADD)
    assert parsed.content == THINK
    assert as_dicts(parsed) == [{"name": "add", "arguments": {"a": 385, "b": 47}}]
    assert parsed.calls[0].arguments == '{"a": 385, "b": 47}'  # the model's own text


def test_two_calls_keep_their_order_and_escaped_braces():
    parsed = HermesToolParser.extract(ADD + "\n" + MUL)
    assert parsed.content is None
    assert [c["name"] for c in as_dicts(parsed)] == ["add", "mul"]
    assert as_dicts(parsed)[1]["arguments"] == {"x": 'a "}" b', "y": [1, {"z": 2}]}


def test_call_inside_a_think_block_is_found_without_a_reasoning_parser():
    text = "<think>\nlet me call <tool_call>\n" + ADD[12:] + "\n</think>\n\ndone"
    parsed = HermesToolParser.extract(text)
    assert parsed.content == "<think>\nlet me call "
    assert as_dicts(parsed)[0]["name"] == "add"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>',  # unbalanced
    '<tool_call>\n["add", 1]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>',  # arguments not an object
    ADD + "\n<tool_call>\n{oops}\n</tool_call>",  # one good call and one broken one
])
def test_malformed_calls_come_back_as_text(text):
    parsed = HermesToolParser.extract(text)
    assert parsed.calls == [] and parsed.content == text
    # Streamed, the whole reply arrives as content by the end (a call whose name had
    # already streamed cannot be taken back, but the finish reports no calls).
    content, _, streamed = stream(text)
    assert content == text and streamed.calls == []


def test_unknown_function_is_text_whole_and_streamed():
    text = "Sure.\n" + ADD
    assert HermesToolParser.extract(text, ["mul"]).calls == []
    content, calls, parsed = stream(text, tool_names=["mul"])
    assert content == text and calls == [] and parsed.calls == []


def test_no_call_is_all_content():
    assert HermesToolParser.extract("just 432").content == "just 432"
    content, calls, _ = stream("just 432 < 500 <tool")  # a tag prefix is released at the end
    assert content == "just 432 < 500 <tool" and calls == []


@pytest.mark.parametrize("text", [ADD, "Let me add.\n\n" + ADD, ADD + "\n" + MUL])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_pieces_join_to_the_whole_parse(text, size):
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, calls, parsed = stream(text, pieces)
    whole = HermesToolParser.extract(text)
    assert content == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.calls]
    assert [c["id"] for c in calls] == [c.id for c in parsed.calls]  # ids survive finish()


def test_tags_split_across_tokens_are_held_back():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool") == ("Hi ", [])  # "<tool" might start a call
    content, deltas = parser.feed('_call>\n{"name": "add", "argu')
    assert content == "" and deltas[0]["function"] == {"name": "add", "arguments": ""}
    content, deltas = parser.feed('ments": {"a": 1}}\n</tool_')
    assert deltas == [{"index": 0, "function": {"arguments": '{"a": 1}'}}]


def test_parallel_off_keeps_the_first_call():
    parsed = HermesToolParser.extract(ADD + "\n" + MUL, max_calls=1)
    assert [c.name for c in parsed.calls] == ["add"]
    _, calls, _ = stream(ADD + "\n" + MUL, max_calls=1)
    assert [c["name"] for c in calls] == ["add"]


@pytest.mark.parametrize("streamed", [False, True])
def test_reply_with_reasoning_parser_splits_think_block_then_calls(streamed):
    fmt = ReplyFormat(reasoning_parser=Qwen3ReasoningParser, tool_parser=HermesToolParser,
                      tool_names=("add",))
    text = THINK + ADD
    if streamed:
        s = fmt.stream()
        deltas = [s.delta(text[i:i + 4], i + 4 >= len(text)) for i in range(0, len(text), 4)]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
        assert (reasoning, content, s.finish_reason("stop")) == ("I should add them.", "",
                                                                 "tool_calls")
        assert args == '{"a": 385, "b": 47}'
    else:
        message, finish = fmt.message(text, "stop")
        assert finish == "tool_calls" and message["content"] is None
        assert message["reasoning_content"] == message["reasoning"] == "I should add them."
        assert message["tool_calls"][0]["function"] == {"name": "add",
                                                        "arguments": '{"a": 385, "b": 47}'}


def test_named_tool_choice_finishes_with_stop_and_length_stays_length():
    fmt = ReplyFormat(tool_parser=HermesToolParser, tool_names=("add",), tools_finish="stop")
    assert fmt.message(ADD, "stop")[1] == "stop"
    assert ReplyFormat(tool_parser=HermesToolParser).message("<tool_call>\n{", "length")[1] \
        == "length"


def test_calls_grammar_uses_tag_tokens_and_each_schema():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    one = calls_grammar(tools, parallel=False, token_ids={"<tool_call>": 7, "</tool_call>": None})
    assert "start: call\n" in one and "<[7]>" in one and '"</tool_call>"' in one
    assert '"const": "add"' in one and '"a": {"type": "integer"}' in one
    assert 'start: call ("\\n" call)*' in calls_grammar(tools, True, {})
