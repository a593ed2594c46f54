"""Tokenizer and chat template of a Hugging Face checkpoint directory.

Reads `tokenizer.json` with the `tokenizers` library (never `transformers`), the special tokens
and chat template from `tokenizer_config.json` / `chat_template.jinja`, and the extra EOS ids from
`generation_config.json`. No jax, no numpy: this runs on the serving host.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config writes it: a string or a serialized AddedToken."""
    return token.get("content") if isinstance(token, Mapping) else token


def _read_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    # A separate chat_template.jinja overrides the config's copy, as in transformers.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _add_missing_tokens(backend: tokenizers.Tokenizer, added: Mapping[str, Any]) -> None:
    """Adds tokens that tokenizer_config declares but tokenizer.json lacks, in id order."""
    for _, spec in sorted(added.items(), key=lambda item: int(item[0])):
        if backend.token_to_id(spec["content"]) is not None:
            continue
        token = tokenizers.AddedToken(
            spec["content"], single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", False), special=spec.get("special", False))
        backend.add_tokens([token])


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted: what a ByteLevel decoder undoes.
    Printable bytes stand for themselves; the others take chr(256 + n) in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class _GenerationTag(jinja2.ext.Extension):
    """Renders the body of `{% generation %}...{% endgeneration %}` (assistant-mask markers)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: plain json.dumps, without jinja's HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles an untrusted checkpoint chat template in a sandbox set up as transformers does."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise ValueError(f"messages[{index}].content[{j}] must be "
                             f'{{"type": "text", "text": <str>}}, got {part!r}')
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validates chat messages and returns plain copies with string content.

    Keys whose value is None are dropped (templates test for presence), and `reasoning` /
    `thinking` are aliased to `reasoning_content`, as transformers does.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role = {role!r} is invalid: must be one of {ROLES}")
        plain = {key: value for key, value in message.items() if value is not None}
        if "content" not in plain and role == "assistant" and plain.get("tool_calls"):
            plain["content"] = ""  # OpenAI allows tool-call-only assistant turns
        if "content" not in plain:
            raise ValueError(f"messages[{i}].content is missing")
        plain["content"] = _content_text(plain["content"], i)
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain.setdefault("reasoning_content", reasoning)
        normalized.append(plain)
    return normalized


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token: str | None = None,
                 pad_token: str | None = None, bos_token: str | None = None,
                 extra_special_tokens: Iterable[str] = (), generation_eos_ids: Sequence[int] = (),
                 chat_template: str | None = None, config: dict | None = None):
        self.backend = backend
        self.config = dict(config or {})  # tokenizer_config.json as read
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        # token_bytes: None -> every token's bytes; True -> special tokens' blanked
        self._token_bytes: dict[bool | None, list[bytes] | None] = {}
        self.eos_token_id = self._id_of(eos_token)
        if self.eos_token_id is None and generation_eos_ids:
            self.eos_token_id = generation_eos_ids[0]
        self.pad_token_id = self._id_of(pad_token)
        self.bos_token_id = self._id_of(bos_token)
        eos_ids = list(generation_eos_ids) + [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in eos_ids if i is not None))
        named = [eos_token, pad_token, bos_token, *extra_special_tokens]
        flagged = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids: set[int] = flagged | {
            i for i in map(self._id_of, named) if i is not None}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """Loads the tokenizer files of a checkpoint; None when it has no tokenizer.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        _add_missing_tokens(backend, config.get("added_tokens_decoder", {}))
        extra = [_token_content(t) for t in config.get("additional_special_tokens", [])]
        return cls(backend,
                   eos_token=_token_content(config.get("eos_token")),
                   pad_token=_token_content(config.get("pad_token")),
                   bos_token=_token_content(config.get("bos_token")),
                   extra_special_tokens=[t for t in extra if t],
                   generation_eos_ids=_generation_eos_ids(path),
                   chat_template=_read_chat_template(path, config), config=config)

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy rendering chats with `template` (compiled now, so errors show at once)."""
        import copy
        other = copy.copy(self)
        other.chat_template, other._compiled_template = template, compile_chat_template(template)
        return other

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token id's bytes, such that decoding ids is decoding their bytes joined as
        UTF-8 (lossy): true of a lone ByteLevel decoder (Qwen's, GPT-2's), and checked here
        against `decode` for every id. None for other decoders. Built once."""
        if None not in self._token_bytes:
            self._token_bytes[None] = self._byte_table()
        table = self._token_bytes[None]
        if table is None or not skip_special_tokens:
            return table
        if True not in self._token_bytes:  # special tokens decode to nothing when skipped
            special = [i for i, t in self.backend.get_added_tokens_decoder().items()
                       if t.special and i < len(table)]
            skipping = list(table)
            for i in special:
                skipping[i] = b""
            checked = not any(self.backend.decode([i], skip_special_tokens=True)
                              for i in special)
            self._token_bytes[True] = skipping if checked else None
        return self._token_bytes[True]

    def _byte_table(self) -> list[bytes] | None:
        if not isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel):
            return None
        chars = _byte_level_chars()
        # byte-level characters to their byte, then .encode("latin-1"); other characters
        # below 256 to one that latin-1 cannot encode (they take the slow path)
        to_latin1 = {o: 0x100 for o in range(256)} | {ord(c): b for c, b in chars.items()}
        table = []
        for i in range(self.vocab_size):
            token = self.backend.id_to_token(i)
            if token is None:
                table.append(b"")
                continue
            try:
                table.append(token.translate(to_latin1).encode("latin-1"))
            except UnicodeEncodeError:  # a character outside the byte map: its UTF-8
                table.append(b"".join(bytes([chars[c]]) if c in chars else c.encode()
                                      for c in token))
        decoded = self.backend.decode_batch([[i] for i in range(len(table))],
                                            skip_special_tokens=False)
        if any(b.decode("utf-8", "replace") != d for b, d in zip(table, decoded)):
            return None
        return table

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included (not the padded model vocab)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            tools: list[dict] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """Renders messages with the checkpoint's chat template (e.g. `enable_thinking=False`)."""
        if self.chat_template is None:
            raise ValueError("chat_template: the checkpoint defines none "
                             "(tokenizer_config.json or chat_template.jinja)")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                   "pad_token": self.pad_token}
        context = {k: v for k, v in special.items() if v is not None}
        context |= template_kwargs
        text = self._compiled_template.render(
            messages=normalize_messages(messages), tools=tools,
            add_generation_prompt=add_generation_prompt, **context)
        return self.encode(text) if tokenize else text
