"""OpenAI's wire shapes shared by the API and the stream relay (resume.py): error objects and server-sent events."""

from __future__ import annotations

import json
from typing import Any, Optional

DONE = "data: [DONE]\n\n"
# A comment line: no event for any SSE parser (the spec's "ignore the line"; the openai package's decoder too), but
# bytes on the wire, so that a proxy does not take a stream waiting in the queue for a dead one
KEEPALIVE = ": keepalive\n\n"
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
                503: "service_unavailable"}  # other 4xx: invalid_request_error; other 5xx: server_error


# OpenAI's clients retry every 429 and 5xx (twice, by default) unless this header says "false", as OpenAI's servers
# send it for an error a retry cannot cure (the API and the limits middleware both answer such errors)
NO_RETRY_HEADER = "x-should-retry"


def error_object(status: int, message: str, *, type_: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None) -> dict:
    """``{"error": {...}}`` as OpenAI answers it; ``type_`` defaults to the status's kind."""
    type_ = type_ or _ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(obj: Any, event: Optional[str] = None) -> str:
    """One server-sent event carrying ``obj`` as compact JSON; ``event``: its name (the Responses API names each)."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def error_event(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                type_: Optional[str] = None) -> str:
    """The event that ends a stream in error: the error object with the HTTP status the request would have had
    (a client acts on it: 503 tries another orchestrator, 429 retries later)."""
    err = error_object(status, message, type_=type_, param=param, code=code)["error"]
    return sse({"error": {**err, "status": status}})
