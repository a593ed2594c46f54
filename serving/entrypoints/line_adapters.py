"""The `lora` field of a `qwen-jax generate` line: the name of an adapter given by
`--lora-modules`, or `{"name": ..., "path": ...}` (an adapter of the file's own, numbered
after the modules')."""

from __future__ import annotations

from collections.abc import Sequence

from serving.core.lora_request import LoRARequest

INLINE_FIELDS = ("name", "path", "base_model_name")


class LineAdapters:
    """The adapters a file's lines name, by name: one name is one adapter for the run."""

    def __init__(self, modules: Sequence[LoRARequest] = ()):
        self.by_name = {m.lora_name: m for m in modules}
        self._next_id = max((m.lora_int_id for m in modules), default=0) + 1

    def resolve(self, value) -> LoRARequest | None:
        """A line's `lora` value -> its adapter (None: the base model); ValueError naming
        the field and what it may be."""
        if value is None:
            return None
        if isinstance(value, str):
            known = self.by_name.get(value)
            if known is None:
                names = ", ".join(map(repr, self.by_name)) or "none"
                raise ValueError(f"'lora' {value!r} is not a known adapter (--lora-modules "
                                 f"and earlier lines give: {names}); give "
                                 "{\"name\": ..., \"path\": ...} for another")
            return known
        if not isinstance(value, dict):
            raise ValueError(f"'lora' must be an adapter name or {{\"name\": ..., \"path\": "
                             f"...}}, got {type(value).__name__}")
        return self._inline(value)

    def _inline(self, value: dict) -> LoRARequest:
        unknown = sorted(set(value) - set(INLINE_FIELDS))
        if unknown:
            raise ValueError(f"'lora' has unknown field(s) {unknown}; allowed: "
                             f"{', '.join(INLINE_FIELDS)}")
        name, path = _text(value, "name"), _text(value, "path")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"'lora.base_model_name' must be a string, got {base!r}")
        known = self.by_name.get(name)
        if known is not None:
            if known.lora_path != path:
                raise ValueError(f"'lora.path' {path!r}: adapter {name!r} is already "
                                 f"{known.lora_path!r} in this run (one path per name)")
            return known
        lora = LoRARequest(name, self._next_id, path, base)
        self._next_id += 1
        self.by_name[name] = lora
        return lora


def _text(value: dict, field: str) -> str:
    given = value.get(field)
    if not isinstance(given, str) or not given:
        raise ValueError(f"'lora.{field}' must be a non-empty string, got {given!r}")
    return given
