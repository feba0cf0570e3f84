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


# What a request's tokens are, by the body field that sent them, for a context-length error: the tokens counted are
# the templated conversation's (chat, the Responses API), not the characters sent
_INPUT_LABELS = {"prompt": "the prompt", "messages": "the messages (as the chat template puts them)",
                 "input": "the input (with any instructions, as the chat template puts them)",
                 "input_ids": "input_ids"}


def context_length_error(tokens: int, max_length: int, *, field: str = "prompt", max_tokens: int | None = None,
                         limit_field: str = "max_tokens", held: int | None = None, session: bool = False,
                         scoring: bool = False, index: int | None = None) -> RequestError:
    """The 400 ``context_length_exceeded`` of ``tokens`` input tokens that leave no room in ``max_length``, or, with
    ``max_tokens``, of an explicit output limit that does not fit after them. ``field``: the body field the tokens
    came in (``param``: chat's ``messages``, the Responses API's ``input``, a session turn's own field; OpenAI names
    them so); ``index``: the prompt's place in a request of several. ``session`` (implied by ``held``, a session's
    tokens before this turn): the limit is the session's ``max_length`` and the tokens what it would hold with the
    turn. ``scoring``: nothing is generated (an explicit output limit of 0), so the whole context may be input;
    else one token must be left, and the excess said counts it (a prompt told "2 too many" that lost 2 was refused
    again)."""
    label = _INPUT_LABELS.get(field, field) + (f" at index {index}" if index is not None else "")
    fit = max_length if scoring else max_length - 1  # the most input tokens that leave room for what is asked
    if held is None and not session:
        limit = f"this model's maximum context length is {max_length} tokens"
        count = f"there are {tokens} tokens in {label}"
        shorten = f"reduce {label.split(' (')[0]}"
    else:
        limit = f"this session's max_length is {max_length} tokens"
        count = f"with this turn's {field} it would hold {tokens}" + (f" ({held} before it)" if held is not None
                                                                       else "")
        shorten = (f"shorten this turn's {field}, or open a new session" if held is None or held <= fit else
                   "the session is full: open a new one")
    if max_tokens is not None:
        return RequestError(f"{limit}; {count}, and {limit_field} is {max_tokens}: at most {max_length - tokens} "
                            f"fit (reduce {limit_field}, or {shorten.removeprefix('reduce ')})", param=limit_field,
                            code="context_length_exceeded")
    if tokens == max_length and not scoring:
        left = "no room is left for a completion"
    else:
        left = f"{tokens - fit} too many" + ("" if scoring else f", at most {fit} leave room for a completion")
    return RequestError(f"{limit}, but {count}: {left} ({shorten})", param=field, code="context_length_exceeded")


class Unavailable(RuntimeError):
    """The swarm could not serve the request (no chain in time, too many failures): HTTP 503, with ``code`` (None:
    ``swarm_unavailable``)."""

    code: str | None = None  # a subclass's (ShuttingDown's) stands unless one is given

    def __init__(self, message: str = "", code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
