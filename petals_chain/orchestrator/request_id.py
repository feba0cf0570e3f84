"""Request ids: every API response carries ``x-request-id`` (OpenAI's clients expose it as ``_request_id`` and log
it), and the orchestrator's log lines written while a request is served end with it, so one grep finds a request's
story, on the orchestrator it was forwarded to as well (the forward sends the same id).

A client's own ``X-Request-Id`` is kept when it is short printable ASCII (:data:`MAX_ID_CHARS` of
``[A-Za-z0-9._:-]``: safe in a header, a log line and a ``%`` format); otherwise the request gets ``req_<32 hex>``.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import quote

HEADER = "x-request-id"
MAX_ID_CHARS = 128
# matched whole (fullmatch): '$' also matches before a trailing newline, which let "abc\n" through
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,%d}" % MAX_ID_CHARS)
_CODE = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # an error code worth logging (another orchestrator's reply sends it)
MAX_PATH_SHOWN = 200  # characters of a request's path a log line repeats
_SCOPE_KEY = "petals_chain.request"  # the request's RequestTrace in its ASGI scope (nested apps reuse it)
_LOGGERS = "petals_chain"  # records of these loggers (and below) get the id
_MAX_ERROR_BODY = 64 * 1024  # an error response's body read for its code (OpenAI's error objects are small)

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass
class RequestTrace:
    """One API request: its id, and whether its outcome was counted (``petals_chain_api_requests``; shared by the
    tasks the request spawns: they copy the context, which holds this object)."""

    id: str
    counted: bool = False
    code: Optional[str] = None  # the error code of its response, when that is an error object (for the log)


# The request being served (set by :class:`RequestIds`; copied into the tasks a request spawns).
REQUEST: contextvars.ContextVar[Optional[RequestTrace]] = contextvars.ContextVar("petals_chain_request", default=None)


def current_request_id() -> Optional[str]:
    """The id of the request being served here, or None outside one."""
    trace = REQUEST.get()
    return trace.id if trace is not None else None


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is valid (see the module's doc), else a new one."""
    for k, v in headers:
        if k.lower() == HEADER.encode():
            try:
                given = v.decode("ascii")
            except UnicodeDecodeError:
                break
            return given if _VALID.fullmatch(given) else new_request_id()
    return new_request_id()


EndHook = Callable[[Scope, Optional[int], list, RequestTrace, Optional[BaseException]], None]


class RequestIds:
    """ASGI middleware: names each HTTP request (:data:`REQUEST` and the scope), puts ``x-request-id`` on its
    response (replacing one the app set: a forwarded reply's, the same id) and calls ``on_end(scope, status,
    response headers, trace, error)`` when the app is done (status None: no response started). Inside another
    :class:`RequestIds` (a router in front) it reuses that one's trace and leaves the header to it."""

    def __init__(self, app: Any, on_end: Optional[EndHook] = None):
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        outer = scope.get(_SCOPE_KEY)
        trace = outer if isinstance(outer, RequestTrace) else RequestTrace(request_id_of(scope.get("headers", [])))
        scope[_SCOPE_KEY] = trace
        status: Optional[int] = None
        headers: list = []

        async def named_send(message: dict) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = int(message.get("status", 0))
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                if outer is None:
                    headers.append((HEADER.encode(), trace.id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and status is not None and status >= 400 \
                    and trace.code is None:
                trace.code = _error_code(message.get("body", b""))
            await send(message)

        token = REQUEST.set(trace)
        error: Optional[BaseException] = None
        try:
            await self.app(scope, receive, named_send)
        except BaseException as e:
            error = e
            raise
        finally:
            if self.on_end is not None:
                try:
                    self.on_end(scope, status, headers, trace, error)
                except Exception:  # noqa: BLE001 - counting must never turn a served request into an error
                    logging.getLogger(__name__).exception("request %s: its end could not be recorded", trace.id)
            # the exception's traceback holds this frame: kept here, a cycle kept the app's frames (a stream's
            # generator, whose cleanup undoes a turn its client never got) alive until the next garbage collection
            error = None
            REQUEST.reset(token)


def _error_code(body: bytes) -> Optional[str]:
    """The ``code`` of an OpenAI error object in ``body`` (its first chunk), or None."""
    if not body.startswith(b"{") or len(body) > _MAX_ERROR_BODY:
        return None
    try:
        code = json.loads(body).get("error", {}).get("code")
    except (ValueError, AttributeError, RecursionError):
        return None
    return code if isinstance(code, str) and _CODE.fullmatch(code) else None


def shown_path(path: Any) -> str:
    """A request's ``path`` for a log line, percent-encoded as uvicorn's access log writes it: the ASGI path is
    decoded, so a client's ``%0A`` or ``%1B`` would otherwise start a forged log line or drive the operator's
    terminal; cut at :data:`MAX_PATH_SHOWN` characters."""
    shown = quote(str(path), safe="/", errors="backslashreplace")
    return shown if len(shown) <= MAX_PATH_SHOWN else shown[:MAX_PATH_SHOWN] + "..."


def scope_request_id(scope: Scope) -> Optional[str]:
    """The id :class:`RequestIds` gave the request of ``scope`` (None: it did not see it)."""
    trace = scope.get(_SCOPE_KEY)
    return trace.id if isinstance(trace, RequestTrace) else None


_installed = False


def install_log_ids() -> None:
    """Make the records of petals-chain's loggers written while a request is served end with ``[request ID]``
    (once per process; the record factory in place before is kept and called first)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        trace = REQUEST.get()
        name = record.name  # None in a record logging.makeLogRecord rebuilds (its fields are set after this)
        if trace is not None and isinstance(name, str) and (name == _LOGGERS or name.startswith(_LOGGERS + ".")):
            record.request_id = trace.id
            # the id has no '%' (_VALID), so the message's own %-arguments still format as before
            record.msg = f"{record.msg} [request {trace.id}]"
        return record

    logging.setLogRecordFactory(factory)
