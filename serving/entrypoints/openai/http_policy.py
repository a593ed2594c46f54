"""Per-request HTTP policy of the server: request ids (`X-Request-Id`), CORS for the
origins `--allowed-origins` names, and the API key check. Pure functions of headers."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Mapping, Sequence

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/=+-]+")  # printable, no spaces: safe in logs and ids
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE = "600"


def request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id, else a fresh one. Raises ValueError for an id that could
    not go into logs and response ids unchanged."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None or value == "":
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_LEN or not _REQUEST_ID.fullmatch(value):
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise ValueError(f"header {REQUEST_ID_HEADER}={shown!r} must be 1 to "
                         f"{MAX_REQUEST_ID_LEN} characters of letters, digits and ._:/=+-")
    return value


def parse_origins(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--allowed-origins` values: origins, comma-separated lists, or vLLM's JSON list
    (`'["*"]'`)."""
    origins: list[str] = []
    for value in values or ():
        value = value.strip()
        items = json.loads(value) if value.startswith("[") else value.split(",")
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError(f"allowed_origins: {value!r} is not a list of origins")
        origins += [o.strip().rstrip("/") for o in items if o.strip()]
    return tuple(origins)


def allowed_origin(origin: str | None, allowed: Sequence[str]) -> str | None:
    """The Access-Control-Allow-Origin value for a request's Origin, or None."""
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin.rstrip("/") in allowed else None


def cors_headers(origin: str | None, allowed: Sequence[str]) -> dict[str, str]:
    """Headers every response to an allowed origin carries (none for other origins)."""
    value = allowed_origin(origin, allowed)
    if value is None:
        return {}
    headers = {"Access-Control-Allow-Origin": value,
               "Access-Control-Expose-Headers": REQUEST_ID_HEADER}
    if value != "*":
        headers["Vary"] = "Origin"
    return headers


def preflight_headers(origin: str | None, allowed: Sequence[str],
                      requested_headers: str | None) -> dict[str, str] | None:
    """Headers of the answer to a CORS preflight (OPTIONS); None when the origin is not
    allowed. The requested headers are granted as asked: the API key still guards the
    actual request."""
    headers = cors_headers(origin, allowed)
    if not headers:
        return None
    headers.update({"Access-Control-Allow-Methods": CORS_METHODS,
                    "Access-Control-Allow-Headers": requested_headers
                    or f"Authorization, Content-Type, {REQUEST_ID_HEADER}",
                    "Access-Control-Max-Age": CORS_MAX_AGE})
    return headers


def api_key_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time: both sides are hashed
    first, so not even the key's length shows in the timing."""
    token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                               hashlib.sha256(key.encode()).digest())
