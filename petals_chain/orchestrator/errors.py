"""The two ways a request ends without a generation: refused (4xx) or the swarm could not serve it (503)."""

from __future__ import annotations

from typing import Any

MAX_NAME_SHOWN = 200  # characters of an unknown model's name an error repeats


def shown_model_name(name: Any) -> str:
    """``name`` quoted for an error, cut at :data:`MAX_NAME_SHOWN` characters (a body of megabytes in ``model`` came
    back whole, JSON-escaped: larger)."""
    shown = repr(name)
    if len(shown) > MAX_NAME_SHOWN:
        shown = f"{shown[:MAX_NAME_SHOWN]}... ({len(str(name))} characters)"
    return shown


class RequestError(ValueError):
    """A request the orchestrator refuses (maps to HTTP 4xx)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class Unavailable(RuntimeError):
    """The swarm could not serve the request (no chain in time, too many failures): HTTP 503."""
