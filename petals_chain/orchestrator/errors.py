"""The two ways a request ends without a generation: refused (4xx) or the swarm could not serve it (503)."""

from __future__ import annotations

import math
from typing import Any

MAX_NAME_SHOWN = 200  # characters of an unknown model's name an error repeats

# The code of an error that names none, by its status: every error object a client gets has a code to act on (a 413
# "prompt is too long" had code null). OpenAI's names where it has one.
_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
                  405: "method_not_allowed", 409: "conflict", 413: "request_too_large", 415: "unsupported_media_type",
                  422: "invalid_request", 429: "rate_limit_exceeded", 499: "client_disconnected",
                  500: "internal_error", 502: "bad_gateway", 503: "swarm_unavailable", 504: "deadline_exceeded"}
# The openai package (3.x) waits out a Retry-After of up to 120 s and does not retry at all above it; its
# earlier releases ignored one above 60 s (and backed off 0.5-8 s on their own): at most 60, each waits it out
MAX_RETRY_AFTER_S = 60


def default_code(status: int) -> str:
    """The error code of a response of ``status`` whose error names none."""
    return _DEFAULT_CODES.get(status) or ("invalid_request" if 400 <= status < 500 else "server_error")


def unavailable_retry_after_s(cfg: Any) -> int:
    """``Retry-After`` of a 503 (no chain, the swarm could not serve it): the soonest a chain can appear, a planner
    round (``refresh_s``) after a server's change settles (``settle_s``; 3 s by default), at least 1 and at most
    :data:`MAX_RETRY_AFTER_S`. Not longer: a 503 comes only after the request waited (``--no-chain-wait-s``, the
    queue time, its failovers), and the request sent again waits in the queue for a chain itself, served the moment
    one is planned, so a client that waits longer only loses time (and above 120 s today's openai package gives up
    instead of retrying); without the header OpenAI's clients retried after their own backoff (0.5-8 s) and other
    clients not at all."""
    seconds = float(getattr(cfg, "refresh_s", 1.0) or 0.0) + float(getattr(cfg, "settle_s", 2.0) or 0.0)
    return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


def shown_model_name(name: Any) -> str:
    """``name`` quoted for an error, cut at :data:`MAX_NAME_SHOWN` characters (a body of megabytes in ``model`` came
    back whole, JSON-escaped: larger)."""
    shown = repr(name)
    if len(shown) > MAX_NAME_SHOWN:
        shown = f"{shown[:MAX_NAME_SHOWN]}... ({len(str(name))} characters)"
    return shown


class RequestError(ValueError):
    """A request the orchestrator refuses (maps to HTTP 4xx); ``code`` None: :func:`default_code` of its status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code if code is not None else default_code(status)


class Unavailable(RuntimeError):
    """The swarm could not serve the request (no chain in time, too many failures): HTTP 503."""
