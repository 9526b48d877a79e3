"""Errors a client sees, in OpenAI's JSON shape: ``{"error": {message, type, param, code}}``.

Every refusal of the Coordinator is a ``ServeError`` carrying its HTTP status; the
app turns it into the JSON body (or a final SSE event once a stream has begun),
logs it and counts it (``app.Rejections``) unless the request was counted already.
"""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error", 503: "service_unavailable", 504: "timeout_error",
}


class ServeError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.is_counted = False
        """Set once the request was counted (``output.Output.done``): the app's error
        handler then logs it without counting it again."""
        self.request_id: str | None = None
        """The Coordinator's own id of the request (its engines' request id), set by
        serving once the request has one; logged beside a client's ``x-request-id``."""

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return orjson.dumps(self.body())


def validation_error(errors: list[dict], loc_start: int) -> ServeError:
    """The 400 of a request that failed pydantic's validation, naming its first error's
    field: the names and list indexes of its location from ``loc_start`` on (FastAPI's
    locations begin with "body"), not the union member pydantic tried ("prompt", not
    "prompt.constrained-str")."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())[loc_start:]
                     if isinstance(p, int) or p.isidentifier()) or None
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
    return ServeError(400, message, code="invalid_request", param=where)
