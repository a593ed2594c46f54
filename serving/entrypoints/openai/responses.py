"""`POST /v1/responses` and `GET /v1/responses/{id}` (OpenAI's Responses API, as vLLM
serves it) over the chat route's machinery: the request becomes a chat request
(responses_protocol.py), runs through the same tool, reasoning and grammar handling, and
its reply becomes output items (`reasoning`, `message`, `function_call`). Streamed, the
chat deltas become the Responses events (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`,
`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`, their `.done`s, `response.completed` or
`response.incomplete`), each numbered by `sequence_number`; the final event's response is
the one the same request gets unstreamed.

Stored responses (`store`, the default) live in memory, the newest `max_stored` of
them; an unknown or expired id is a 404 naming `previous_response_id`."""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

from aiohttp import web

from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.errors import APIError, error_body
from serving.entrypoints.openai.outputs import sse
from serving.entrypoints.openai.responses_protocol import (
    chat_request,
    echo_fields,
    output_messages,
)

MAX_STORED = 1024


class ResponseStore:
    """The newest stored responses: id -> (response object, its conversation)."""

    def __init__(self, max_stored: int = MAX_STORED):
        self.max_stored = max_stored
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = (
            collections.OrderedDict())

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict, list[dict]]:
        found = self._items.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r}: unknown, stored with "
                                f"store=false, or expired (this server keeps the newest "
                                f"{self.max_stored})", param=param)
        return found

    def history(self, response_id: str) -> list[dict]:
        """The conversation a follow-up of `response_id` continues: its messages, then
        its output as chat messages."""
        response, conversation = self.get(response_id, "previous_response_id")
        return [*conversation, *output_messages(response["output"])]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat reply's message as output items: its reasoning, its text, its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    items.extend(call_item(call) for call in message.get("tool_calls") or [])
    return items


class ResponseBuilder:
    """The response object of one request, its usage and status filled in at the end."""

    def __init__(self, body: dict, model: str):
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.base = {"id": self.id, "object": "response", "created_at": self.created,
                     "model": model, **echo_fields(body)}

    def response(self, output: list[dict], status: str, usage: dict | None,
                 finish_reason: str | None = None) -> dict:
        incomplete = finish_reason == "length"
        return {**self.base, "status": "incomplete" if incomplete else status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": None, "output": output, "usage": usage}


def response_usage(job, reasoning_tokens: int) -> dict:
    usage = job.usage()
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"][
                "cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


class EventStream:
    """A streamed choice's chat deltas -> Responses events (SSE bytes), and the output
    items they add up to."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the message or reasoning item being written
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its item

    def _event(self, kind: str, **fields) -> bytes:
        event = sse({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return event

    def start(self) -> list[bytes]:
        response = self.builder.response([], "in_progress", None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, delta: dict) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            make = reasoning_item if kind == "reasoning" else message_item
            self.open = make("", status="in_progress")
            self.items.append(self.open)
            index = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**self.open, "content": []}))
            out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                   output_index=index, content_index=0,
                                   part=self.open["content"][0]))
        part = self.open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta")
        extra: dict = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(name, item_id=self.open["id"], output_index=len(self.items) - 1,
                               content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict) -> list[bytes]:
        out: list[bytes] = []
        item = self.calls.get(call["index"])
        if item is None:
            out += self._close()
            item = call_item({"id": call["id"], "function": {
                "name": call["function"]["name"], "arguments": ""}}, status="in_progress")
            self.calls[call["index"]] = item
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=dict(item)))
        piece = call["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.items.index(item), delta=piece))
        return out

    def _close(self) -> list[bytes]:
        """Ends the open message or reasoning item."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        item["status"] = "completed"
        done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                else "response.output_text.done")
        extra: dict = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self, usage: dict, finish_reason: str | None) -> tuple[list[bytes], dict]:
        """The closing events and the whole response."""
        out = self._close()
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.items.index(item)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        response = self.builder.response(self.items, "completed", usage, finish_reason)
        kind = ("response.incomplete" if response["status"] == "incomplete"
                else "response.completed")
        out.append(self._event(kind, response=response))
        return out, response


async def create_response(server, request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    body = await server._json(request)
    lora_request = server._check_model(proto.read_str(body, "model", None))
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise APIError(400, "previous_response_id must be a string", param="previous_response_id")
    history = server.responses.history(previous) if previous else []
    store = proto.read_bool(body, "store", True)
    chat, conversation = chat_request(body, history)
    req = proto.parse_chat(chat, server.vocab_size, server.default_sampling)
    req.lora_request = lora_request
    reply = server._reply_format(req)
    await server._check_constraint(req)
    ids = await server._render_chat(req.messages, req.tools, req.template_kwargs)
    builder = ResponseBuilder(body, server.loras.model_name(lora_request))
    job, first, outputs = await server._start(request, req, [ids], "resp", "input", reply)
    try:
        if req.stream:
            return await _stream(server, request, job, first, outputs, builder, store,
                                 conversation)
        job.add(*first)
        while (item := await server._engine_call(outputs.__anext__())) is not None:
            job.add(*item)
    finally:
        await outputs.aclose()
    choice = job.response()["choices"][0]
    message = choice["message"]
    response = builder.response(output_items(message), "completed",
                                response_usage(job, _reasoning_tokens(server, message)),
                                choice["finish_reason"])
    if store:
        server.responses.put(response, conversation)
    return web.json_response(response)


def _reasoning_tokens(server, message: dict) -> int:
    text = message.get("reasoning_content")
    return len(server.tokenizer.encode(text, False)) if text and server.tokenizer else 0


async def _stream(server, request, job, first, outputs, builder, store, conversation):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    events = EventStream(builder)
    await response.prepare(request)
    try:
        for event in events.start():
            await response.write(event)
        finish = None
        item: Any = first
        while item is not None:
            for _, delta, reason in job.deltas(*item):
                finish = reason or finish
                for event in events.feed(delta):
                    await response.write(event)
            item = await server._engine_call(outputs.__anext__())
        reasoning = "".join(i["content"][0]["text"] for i in events.items
                            if i["type"] == "reasoning")
        closing, whole = events.finish(response_usage(job, _reasoning_tokens(
            server, {"reasoning_content": reasoning})), finish)
        for event in closing:
            await response.write(event)
        if store:
            server.responses.put(whole, conversation)
    except ConnectionError:
        return response
    except APIError as exc:  # headers are out: report in-band, then end the stream
        await response.write(sse({"type": "error", "sequence_number": events.seq,
                                  **error_body(exc.status, exc.message)["error"]}))
    await response.write_eof()
    return response


async def get_response(server, request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response."""
    response, _ = server.responses.get(request.match_info["response_id"], "response_id")
    return web.json_response(response)


__all__ = ["EventStream", "ResponseStore", "create_response", "get_response", "output_items"]
