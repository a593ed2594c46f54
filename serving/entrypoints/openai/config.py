"""`qwen-jax serve`'s HTTP options (the engine's are EngineConfig's): frozen, keyword-only,
validated on construction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qwen_jax.validation import require
from serving.core.lora_request import LoRARequest
from serving.metrics.prometheus import METRICS_PREFIXES
from serving.parsers.reasoning import reasoning_parser_class
from serving.parsers.tool_parsers import tool_parser_class


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """`qwen-jax serve`'s HTTP options (the engine's are EngineConfig's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_body_mb: float = 8.0
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    log_interval: float = 10.0  # seconds between throughput lines; 0 disables
    retry_after: int = 1  # seconds, sent with 503 when the waiting queue is full
    reasoning_parser: str | None = None  # e.g. "qwen3": chat replies split out reasoning_content
    tool_call_parser: str | None = None  # e.g. "hermes": tool calls parsed out of chat replies
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    chat_template: str | None = None  # a file (or the template itself) replacing the model's
    default_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from; "*" any
    metrics_prefix: str = "qwen_jax"
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's option)
    lora_modules: tuple[LoRARequest, ...] = ()  # adapters registered at start, by name
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter, /v1/unload_...

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", self.port, "in [0, 65535]")
        require(self.max_request_body_mb > 0, "max_request_body_mb", self.max_request_body_mb,
                "> 0")
        require(self.shutdown_timeout >= 0, "shutdown_timeout", self.shutdown_timeout, ">= 0")
        require(self.metrics_prefix in METRICS_PREFIXES, "metrics_prefix", self.metrics_prefix,
                f"one of {', '.join(METRICS_PREFIXES)}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        names = [lora.lora_name for lora in self.lora_modules]
        require(len(set(names)) == len(names), "lora_modules", names, "distinct names")
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)
        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)
        require(self.tool_call_parser is not None or not self.enable_auto_tool_choice,
                "tool_call_parser", self.tool_call_parser, "set with enable_auto_tool_choice")
        require(isinstance(self.default_chat_template_kwargs, dict),
                "default_chat_template_kwargs", self.default_chat_template_kwargs,
                "a JSON object")

    def chat_template_text(self) -> str | None:
        """`--chat-template`'s template: the file's text, or the option's own."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        text = path.read_text(encoding="utf-8") if path.is_file() else self.chat_template
        if "{{" not in text and "{%" not in text:
            raise ValueError(f"chat_template {self.chat_template!r} is neither a file nor a "
                             "Jinja template")
        return text
