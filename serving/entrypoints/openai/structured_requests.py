"""Request fields for tool calls and structured outputs (OpenAI's and vLLM's), and the vLLM
fields this server does not implement: set to anything but their default they are a 400
naming them, never silently ignored. No aiohttp, no grammar engine here."""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.core.structured_params import StructuredOutputsParams
from serving.entrypoints.openai.errors import bad
from serving.parsers.chat_reply import ReplyFormat
from serving.parsers.tool_parsers import HermesToolParser, calls_grammar

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
GUIDED_BACKENDS = (None, "auto", "guidance", "llguidance")
STRUCTURED_FIELDS = {"structured_outputs", "guided_whitespace_pattern",
                     "guided_decoding_backend", *GUIDED}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}

# vLLM request fields with the value that means "not used"; anything else is refused.
_UNSET = object()
_VLLM_UNSUPPORTED = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": _UNSET,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": _UNSET,
    "truncation_side": _UNSET, "logprob_token_ids": _UNSET,
    "allowed_token_ids": _UNSET, "bad_words": _UNSET, "return_tokens_as_token_ids": False,
    "return_token_ids": False, "return_prompt_text": False, "cache_salt": _UNSET,
    "kv_transfer_params": _UNSET, "ec_transfer_params": _UNSET, "vllm_xargs": _UNSET,
    "repetition_detection": _UNSET, "stream_interval": _UNSET, "request_id": _UNSET,
    "logits_processors": _UNSET, "thinking_token_budget": _UNSET, "prompt_embeds": _UNSET,
    "functions": _UNSET, "function_call": _UNSET, "audio": _UNSET, "prediction": _UNSET,
    "web_search_options": _UNSET}
_VLLM_CHAT_UNSUPPORTED = {
    "continue_final_message": False, "documents": _UNSET, "chat_template": _UNSET,
    "media_io_kwargs": _UNSET, "mm_processor_kwargs": _UNSET, "reasoning_effort": _UNSET,
    "modalities": ["text"]}
UNSUPPORTED_FIELDS = set(_VLLM_UNSUPPORTED) | set(_VLLM_CHAT_UNSUPPORTED)


def reject_unsupported(body: dict, chat: bool) -> None:
    """A 400 naming the first vLLM field set that this server does not implement."""
    table = {**_VLLM_UNSUPPORTED, **(_VLLM_CHAT_UNSUPPORTED if chat else {})}
    for name, unused in table.items():
        value = body.get(name)
        if value is None or value == unused or (unused is _UNSET and value in ([], {}, "")):
            continue
        raise bad(name, f"{name} is not supported by this server (vLLM honours it; it "
                         f"would be ignored here), got {str(value)[:40]!r}")


@dataclasses.dataclass
class ToolRequest:
    """A chat request's tools: `choice` is "none", "auto", "required" or a function name."""

    tools: list[dict]
    choice: str
    named: bool  # `choice` names a function
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def constrained(self) -> bool:
        return self.named or self.choice == "required"


def _check_tool(i: int, tool: Any) -> None:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)
            and function["name"]):
        raise bad("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": <str>, \"parameters\": <schema>}}}}, got "
                            f"{str(tool)[:60]!r}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad("tools", f"tools[{i}].function.parameters must be a JSON schema object, "
                            f"got {str(parameters)[:40]!r}")


def _tool_choice(body: dict, names: list[str]) -> tuple[str, bool]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), False
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                                      f"got {str(choice)[:60]!r}")
        if name not in names:
            raise bad("tool_choice", f"tool_choice names function {name!r}, which is not in "
                                      f"tools ({', '.join(names) or 'none given'})")
        return name, True
    if choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or a "
                                  f"named function, got {str(choice)[:40]!r}")
    if choice == "required" and not names:
        raise bad("tool_choice", "tool_choice \"required\" needs tools")
    return choice, False


def read_tools(body: dict) -> ToolRequest:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of objects, got {str(tools)[:40]!r}")
    for i, tool in enumerate(tools):
        _check_tool(i, tool)
    choice, named = _tool_choice(body, [t["function"]["name"] for t in tools])
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got "
                                          f"{str(parallel)[:40]!r}")
    return ToolRequest(tools, choice, named, parallel)


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got "
                     f"{str(kind)[:40]!r}")


def _guided(body: dict) -> StructuredOutputsParams | None:
    given = {GUIDED[k]: body[k] for k in GUIDED if body.get(k) is not None}
    if not given:
        return None
    backend = body.get("guided_decoding_backend")
    if backend not in GUIDED_BACKENDS:
        raise bad("guided_decoding_backend", f"guided_decoding_backend must be one of "
                                              f"auto, guidance (llguidance is the only "
                                              f"grammar engine), got {str(backend)[:40]!r}")
    return StructuredOutputsParams(**given,
                                   whitespace_pattern=body.get("guided_whitespace_pattern"))


def read_structured(body: dict, chat: bool) -> tuple[StructuredOutputsParams | None, str]:
    """(constraint or None, the field it came from) from `structured_outputs`, the older
    `guided_*` fields or (chat) `response_format`; more than one of them is a 400."""
    readers = [("structured_outputs", lambda: None if body.get("structured_outputs") is None
                else StructuredOutputsParams.from_dict(body["structured_outputs"])),
               (next((k for k in GUIDED if body.get(k) is not None), "guided_json"),
                lambda: _guided(body))]
    if chat:
        readers.append(("response_format", lambda: _from_response_format(
            body.get("response_format"))))
    found = []
    for field, read in readers:
        try:
            params = read()
        except (ValueError, TypeError) as exc:
            raise bad(field, str(exc)) from None
        if params is not None:
            found.append((params, field))
    if len(found) > 1:
        raise bad(found[1][1], f"only one constraint may be given; got {found[0][1]} and "
                                f"{found[1][1]}")
    return found[0] if found else (None, "")


def reply_format(req, reasoning_parser, auto_parser, tag_ids: dict) -> ReplyFormat:
    """How a chat request's replies are split. tool_choice "required" or a named function
    becomes a grammar of Hermes tool calls (the format Qwen3 was trained on) in
    `req.structured`; "auto" needs the server's tool parser (`auto_parser`, None unless
    --enable-auto-tool-choice), as in vLLM."""
    tools = req.tool_request
    parser, names = None, tuple(tools.names)
    single = tools.named or not tools.parallel  # a named function is called once
    if tools.constrained:
        names = (tools.choice,) if tools.named else names
        chosen = [t for t in tools.tools if t["function"]["name"] in names]
        # A think block may come first whether or not the reasoning parser is on: Qwen3
        # writes its calls after one, and a call forced at the first token puts the model
        # out of distribution (the tiny model then writes wrong arguments).
        req.structured = StructuredOutputsParams(
            grammar=calls_grammar(chosen, not single, tag_ids), reasoning=True)
        req.structured_field, parser = "tools", HermesToolParser
    elif tools.choice == "auto" and tools.tools:
        if auto_parser is None:
            raise bad("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set")
        parser = auto_parser
    return ReplyFormat(reasoning_parser, req.include_reasoning, parser, names,
                       1 if single else None, "stop" if tools.named else "tool_calls")
