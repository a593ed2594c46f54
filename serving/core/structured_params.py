"""vLLM's `StructuredOutputsParams`: what a request's output must follow. Pure Python (no
jax, no grammar engine): checked here for shape, compiled in `serving.structured_output.grammar`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# llguidance's JSON options for the default layout: `json.dumps`'s separators, no other
# whitespace (free whitespace lets a sampled model pad forever).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# vLLM's `disable_fallback` says what always holds here: the one grammar engine, llguidance,
# never falls back to another, so the field is accepted whatever its value.
_NO_FALLBACK = "disable_fallback"
_UNSUPPORTED = {"structural_tag": "structural_tag constraints are not supported",
                "disable_additional_properties": "only false (the schema as written) is "
                                                 "supported"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, object or text), `regex`, `choice` (a list of
    strings), `grammar` (Lark or GBNF, as llguidance reads them) or `json_object` (any
    JSON object).

    JSON is written compactly with `", "` and `": "` separators (as `json.dumps` and Qwen3's
    tool calls write it); `disable_any_whitespace` drops those spaces, `whitespace_pattern`
    (a regex) allows free whitespace of that pattern between tokens instead. `reasoning`:
    the constraint starts after the model's `</think>` (the server sets it on chat requests
    when `--reasoning-parser` is on).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or "
                             f"its text), got {type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r:.40}")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r:.60}")
        for name in ("json_object", "disable_any_whitespace", "reasoning"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be a boolean, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | None:
        """The JSON schema of a `json` / `json_object` constraint (parsed), else None."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            try:
                return json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        return self.json

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """vLLM's JSON shape -> params; an unknown or unsupported key is a ValueError
        naming it."""
        if not isinstance(fields, dict):
            raise ValueError(f"structured_outputs must be an object, got {fields!r:.40}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in fields.items():
            if key in _UNSUPPORTED and value not in (None, False):
                raise ValueError(f"structured_outputs.{key}: {_UNSUPPORTED[key]}")
            if key not in known and key not in _UNSUPPORTED and key != _NO_FALLBACK:
                raise ValueError(f"structured_outputs.{key} is not a known field; known: "
                                 f"{', '.join(sorted(known))}")
        return cls(**{k: v for k, v in fields.items() if k in known})
