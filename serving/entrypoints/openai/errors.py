"""OpenAI-shaped API errors (pure Python): a client's mistake or an overload becomes an
`APIError`, which the server answers with OpenAI's error JSON. A module of its own so the
request parsers (protocol.py, structured_requests.py) share it without importing each
other."""

from __future__ import annotations

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
               429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error a client caused (or an overload): becomes OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)
