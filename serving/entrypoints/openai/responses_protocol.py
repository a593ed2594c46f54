"""The Responses API's requests (`POST /v1/responses`, as OpenAI and vLLM serve it) as
the chat-completions requests the server already runs: `input` (a string, or a list of
messages, function calls and their outputs), `instructions`, function `tools` and
`tool_choice`, `text.format`, `reasoning`, `max_output_tokens`; fields named as the
Responses API names them in every error. Pure Python.

A stored response (`store`, the default) keeps the conversation it ended: its messages
and its output as chat messages, so a request with `previous_response_id` continues it
(its own `instructions` replace the earlier ones, as OpenAI's do)."""

from __future__ import annotations

from typing import Any

from serving.entrypoints.openai.errors import bad
from serving.entrypoints.openai.protocol import INT32_MAX, describe, read_dict, read_int

RESPONSE_FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "max_output_tokens", "temperature", "top_p", "stream", "store",
    "previous_response_id", "metadata", "user", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "priority",
    "truncation", "service_tier", "include", "top_logprobs", "stream_options"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# sampling fields the chat route reads under the same names
_PASSED = ("model", "temperature", "top_p", "stream", "seed", "top_k", "min_p",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "priority",
           "parallel_tool_calls", "user")


def _text(content: Any, field: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(field, f"{field} must be a string or a list of text parts, got "
                         f"{describe(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else describe(part)
            raise bad(f"{field}[{j}].type", f"{field}[{j}].type must be one of "
                                            f"{', '.join(_TEXT_PARTS)}, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{field}[{j}].text", f"{field}[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _call(item: dict, field: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad(f"{field}.{key}", f"{field}.{key} must be a string, got "
                                        f"{describe(item.get(key))}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages: consecutive function calls become one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", f"input must be a string or a non-empty list of items, got "
                           f"{describe(value)}")
    messages: list[dict] = []
    for i, item in enumerate(value):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(field, f"{field} must be an object, got {describe(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad(f"{field}.role", f"{field}.role must be one of "
                                           f"{', '.join(_ROLES)}, got {item.get('role')!r}")
            messages.append({"role": role, "content": _text(item.get("content"),
                                                            f"{field}.content")})
        elif kind == "function_call":
            call = _call(item, field)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{field}.call_id", f"{field}.call_id must be a string")
            output = item.get("output")
            output = output if isinstance(output, str) else _text(output, f"{field}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output})
        elif kind != "reasoning":  # earlier reasoning: Qwen3's template drops it anyway
            raise bad(f"{field}.type", f"{field}.type must be one of message, function_call, "
                                       f"function_call_output, reasoning, got {kind!r}")
    return messages


def _tools(body: dict) -> dict:
    """Function tools and tool_choice in the chat request's shape."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools", f"tools must be a list, got {describe(tools)}")
        out["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else describe(tool)
                raise bad(f"tools[{i}].type", f"tools[{i}].type must be function (the only "
                                              f"tool this server runs), got {kind!r}")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                        if k in tool}
            out["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                     "{\"type\": \"function\", \"name\": ...}, got "
                                     f"{str(choice)[:60]!r}")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _text_format(body: dict) -> dict:
    """`text.format` as the chat request's response_format."""
    fmt = read_dict(read_dict(body, "text"), "format") if body.get("text") else {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind != "json_schema":
        raise bad("text.format.type", f"text.format.type must be text, json_object or "
                                      f"json_schema, got {kind!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("text.format.schema", "text.format.schema must be a JSON schema object")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _thinking(body: dict) -> dict:
    """`reasoning.effort` none / minimal turns Qwen3's thinking off; other efforts keep it."""
    reasoning = read_dict(body, "reasoning") if body.get("reasoning") is not None else {}
    effort = reasoning.get("effort")
    if effort not in (None, "none", "minimal", "low", "medium", "high"):
        raise bad("reasoning.effort", f"reasoning.effort must be one of none, minimal, low, "
                                      f"medium, high, got {effort!r}")
    return {"enable_thinking": False} if effort in ("none", "minimal") else {}


def chat_request(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat-completions body to run, the conversation's messages without
    instructions: what a stored response keeps). `history`: the previous response's."""
    unknown = sorted(set(body) - RESPONSE_FIELDS)
    if unknown:
        raise bad(unknown[0], f"unknown field {unknown[0]!r} (the Responses API fields this "
                              f"server reads: {', '.join(sorted(RESPONSE_FIELDS))})")
    if "input" not in body:
        raise bad("input", "input is required: a string or a list of items")
    conversation = [*history, *input_messages(body["input"])]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"instructions must be a string, got {describe(instructions)}")
    messages = ([{"role": "system", "content": instructions}] if instructions else [])
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["messages"] = messages + conversation
    max_tokens = read_int(body, "max_output_tokens", None, 1, INT32_MAX)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    if body.get("top_logprobs"):
        chat.update(logprobs=True, top_logprobs=body["top_logprobs"])
    chat.update(_tools(body))
    chat.update(_text_format(body))
    thinking = _thinking(body)
    if thinking:
        chat["chat_template_kwargs"] = thinking
    return chat, conversation


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a follow-up turn sends back."""
    messages: list[dict] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            messages.extend(input_messages([item]))
    merged: list[dict] = []
    for message in messages:  # a reply's text and its calls: one assistant turn
        if merged and merged[-1]["role"] == "assistant" and message.get("tool_calls"):
            merged[-1].setdefault("tool_calls", []).extend(message["tool_calls"])
        else:
            merged.append(message)
    return merged


def echo_fields(body: dict) -> dict:
    """The request fields a response object repeats (OpenAI's shape)."""
    text = body.get("text") or {"format": {"type": "text"}}
    return {"instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True), "text": text,
            "reasoning": body.get("reasoning"), "metadata": body.get("metadata") or {},
            "truncation": "disabled", "user": body.get("user")}




__all__ = ["RESPONSE_FIELDS", "chat_request", "echo_fields", "input_messages",
           "output_messages"]
