"""The one validation helper: an error a user can cause names the field, its value and the
limit it breaks. Pure Python, so every config and request module can use it."""

from __future__ import annotations


def require(ok: bool, field: str, value: object, limit: str) -> None:
    """Raise `ValueError("<field> must be <limit>, got <value!r>")` unless `ok`."""
    if not ok:
        raise ValueError(f"{field} must be {limit}, got {value!r}")
