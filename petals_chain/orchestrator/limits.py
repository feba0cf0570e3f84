"""Admission limits of the HTTP API: a bounded central queue, per-client limits, bounded request bodies.

A pure ASGI middleware, so a streamed response counts as in flight until its last byte is sent (or the
client disconnects). Rejections are 429 (or 413 for bodies) in OpenAI's error format, with a
``Retry-After`` header estimated from the measured service time and the queue ahead (none for a request that can
never be admitted as it is, ``exceeds_capacity``, ``tokens_per_minute`` over the budget itself, or
``deadline_infeasible``, a deadline missed even by an idle swarm: retried, it would be refused again).
A request that is a 400 (an invalid body, a prompt longer than the context) gets that 400 whatever the limits say:
an early 429 is answered only once the app found the request otherwise valid (:class:`_Refusal`), for as many of
a client's requests at once as it may have in flight (past that, once its body passes the route's model). A body is
read once, by the outermost layer that needs it, and handed on with its JSON parse (:data:`READ_BODY`).

The queue bound itself is exact in the dispatch manager (:mod:`dispatch`), which refuses a job when its
queue is full; the check here is only a cheap early refusal. A generation response is held back until the
dispatcher has decided on the request's job (:class:`~petals_chain.orchestrator.dispatch.Admission`), so
that a refusal of a streamed request is still an HTTP 429 and not an error event inside a 200 stream.

The client is the name of the API key a request presents (``--api-keys``, :mod:`auth`); without keys every
request is the one client ``anonymous``. With keys, the API (``/v1/*``, ``/api/v1/sessions*``, ``/tokenize``,
``/detokenize``) answers 401 to a missing or unknown key, each key has its own limits, and a session answers only to
the key that opened it (another key gets 404, as for a session that does not exist). The swarm state, metrics,
health and dashboard stay public (they show key names, never keys).

The key file is reloaded when it changes (:class:`~petals_chain.orchestrator.auth.KeyFile`): a key's limits are read
at each request, so an edit applies to the next one. The multi-turn sessions of a key removed from the file are
closed once their turn under way (if any) ends: the client can no longer reach them (401), and they held their
chain or KV until the idle reaper. A key whose name stays (a new key for it, new limits) keeps its sessions.
Reloads are counted in ``petals_chain_api_key_reloads_total{outcome}`` and ``/api/v1/limits``.
"""

from __future__ import annotations

import asyncio
import contextvars
import email.message
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from petals_chain.orchestrator.auth import (ANONYMOUS, CLIENT, DEFAULT_RELOAD_S, ApiKey, KeyFile, KeyRing,
                                            bearer_key)
from petals_chain.orchestrator.dispatch import ADMISSION, Admission
from petals_chain.orchestrator.errors import RequestError, unavailable_retry_after_s
from petals_chain.orchestrator.forward import FORWARDED_HEADER, forwardable, opened_session_id
from petals_chain.orchestrator.resume import is_resume
from petals_chain.orchestrator.sse import NO_RETRY_HEADER, error_object

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

# the generation endpoints (their requests are a client's in-flight work); api.py counts them by the same pattern
GENERATE_PATH = re.compile(r"^/(v1/completions|v1/chat/completions|v1/responses|v1/embeddings|"
                           r"api/v1/sessions/[^/]+/generate)/?$")
_OPEN_SESSION = re.compile(r"^/api/v1/sessions/?$")
_SESSION = re.compile(r"^/api/v1/sessions/([^/]+)(/generate)?/?$")
_AUTHENTICATED = re.compile(r"^/(v1/|api/v1/sessions|(de)?tokenize/?$)")
_SESSION_GENERATE = re.compile(r"^/api/v1/sessions/[^/]+/generate/?$")
# scope key: the request's body (a ReadBody), read by the outermost layer that needed it, for the layers inside it and
# the endpoint (ReadBodyRoute): one read, one JSON parse, one verdict
READ_BODY = "petals_chain.body"

logger = logging.getLogger(__name__)
_HELD = "petals_chain.held"  # scope key: (ledger, client) of a request holding its client's state (release_client)
# the key a request was admitted with (set by the middleware; copied into the tasks it spawns): a reload of the
# file while it runs changes the next request's limits, not this one's
REQUEST_KEY: contextvars.ContextVar[Optional[ApiKey]] = contextvars.ContextVar("petals_chain_request_key",
                                                                             default=None)


@dataclass
class LimitsConfig:
    """``max_queue``: central queue bound (enforced by the dispatch manager; here an early check);
    ``client_max_inflight``: one client's running + queued generation requests; ``client_max_sessions``:
    one client's open multi-turn sessions; ``max_body_bytes``: request body size."""

    max_queue: int = 1024
    client_max_inflight: int = 256
    client_max_sessions: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    keys: Optional[KeyRing | KeyFile] = None  # --api-keys; None: no authentication, one anonymous client

    @classmethod
    def from_config(cls, cfg: Any) -> "LimitsConfig":
        """The limits of ``cfg``: its ``api_key_ring`` (the :class:`KeyFile` the command line read once and shares
        among every model's API), else its ``api_keys`` file read here and watched every ``api_keys_reload_s``."""
        d = cls()
        numbers = {k: int(getattr(cfg, k, None) or getattr(d, k)) for k in d.__dict__ if k != "keys"}
        keys = getattr(cfg, "api_key_ring", None)
        path = getattr(cfg, "api_keys", None)
        if keys is None and path:
            keys = KeyFile(path, reload_s=float(getattr(cfg, "api_keys_reload_s", DEFAULT_RELOAD_S)))
        return cls(**numbers, keys=keys)

    def _key(self, client: str) -> Optional[ApiKey]:
        """``client``'s key: the one its request was admitted with (a reload of the file meanwhile changes the next
        request's limits and deadlines, not this one's), else the key of that name loaded last."""
        if self.keys is None:
            return None
        pinned = REQUEST_KEY.get()
        return pinned if pinned is not None and pinned.name == client else self.keys.get(client)

    def inflight_limit(self, client: str) -> int:
        key = self._key(client)
        return key.max_concurrent if key is not None and key.max_concurrent else self.client_max_inflight

    def session_limit(self, client: str) -> int:
        key = self._key(client)
        return key.max_sessions if key is not None and key.max_sessions else self.client_max_sessions

    def deadline_defaults(self, client: str) -> tuple[Optional[int], Optional[int]]:
        """The key's default ``(deadline_ms, ttft_deadline_ms)`` (None: none)."""
        key = self._key(client)
        return (key.deadline_ms, key.ttft_deadline_ms) if key is not None else (None, None)

    def tokens_per_minute(self, client: str) -> Optional[int]:
        key = self._key(client)
        return key.tokens_per_minute if key is not None else None


class BodyTooLarge(StarletteHTTPException):
    """A chunked body past the limit, raised while the app reads it: an HTTP exception so that FastAPI's body
    parsing passes it on as a 413 (any other exception there becomes its 400 "error parsing the body")."""

    code = "body_too_large"  # the app's handler answers with it, as the limits' own 413 (it said request_too_large)

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


class ReadBody:
    """A request body read whole by the outermost layer that needed it (``scope[READ_BODY]``) and its JSON value,
    parsed at most once for every layer and the endpoint: they all see the same bytes and the same verdict."""

    __slots__ = ("data", "_parsed", "_value", "_error")

    def __init__(self, data: bytes):
        self.data = data
        self._parsed = False
        self._value: Any = None
        self._error: Optional[BaseException] = None

    def json(self) -> Any:
        """``json.loads`` of the body (parsed on the first call); what it raised (ValueError, RecursionError), raised
        again at each call."""
        if not self._parsed:
            self._parsed = True
            try:
                self._value = json.loads(self.data)
            except (ValueError, RecursionError) as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value


async def read_whole(receive: Receive, limit: int) -> Optional[bytes]:
    """The whole request body from ``receive``; None: the client disconnected first. ``BodyTooLarge`` once it
    passes ``limit`` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class _ReadBodyRequest(Request):
    """A request whose body an outer layer read (:class:`ReadBody`): its bytes and its JSON value are that read's."""

    def __init__(self, scope: Scope, receive: Receive, read: ReadBody):
        super().__init__(scope, receive)
        self._body = read.data  # Request.body() and stream() give these bytes
        self._read = read

    async def json(self) -> Any:
        return self._read.json()


class ReadBodyRoute(APIRoute):
    """FastAPI's route (``app.router.route_class``) whose endpoint takes the body an outer layer read
    (``scope[READ_BODY]``: the model router's, the limits' own) and its JSON parse as they are: parsed again, a
    1 MiB body cost its parse twice on each request, and two parses could disagree (a body nested deep enough
    passed one and failed the other)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def read_once(request: Request) -> Response:
            read = request.scope.get(READ_BODY)
            return await handler(request if read is None else _ReadBodyRequest(request.scope, request.receive, read))

        return read_once


class _Refusal:
    """An early 429 (``client_inflight_limit``, ``tokens_per_minute``, ``queue_full``) decided when a request came
    in, answered once the app found the request otherwise valid: at its token reservation (``Admission.reserve``),
    after its body, model and context-length checks. A request that is a 400 gets that 400 whatever the limits say
    (a 429 for it was retried for ever); the request is not counted as in flight meanwhile, but as one its client's app
    checks (at most its in-flight cap of them at once: :meth:`AdmissionLimits._may_defer`). ``retry``: the
    ``Retry-After`` (True: the queue's estimate; a callable: seconds, asked when answered). ``per_minute``: the
    client's tokens-per-minute budget of a ``tokens_per_minute`` refusal (a request larger than it never fits)."""

    def __init__(self, limits: "AdmissionLimits", code: str, message: str,
                 retry: bool | Callable[[], int] = True, per_minute: Optional[int] = None):
        self.limits, self.code, self.message, self.retry = limits, code, message, retry
        self.per_minute = per_minute
        self.fired = False

    def fire(self, need: int = 0, field: str = "max_tokens", adm: Optional[Admission] = None) -> None:
        """``Admission.reserve``: the request is valid, so it is refused (the app's 429 is replaced by :meth:`answer`
        in :class:`_HeldResponse`). A request of more tokens than the whole budget gets the app's answer that it never
        fits (no ``Retry-After``), as :meth:`AdmissionLimits._reserve` gives it: told "retry later", its retry after
        the minute heard that."""
        if self.per_minute is not None and adm is not None:
            self.limits._over_budget(adm, need, self.per_minute, field)
        self.fired = True
        raise RequestError(self.message, status=429, code=self.code)

    async def answer(self, send: Send) -> None:
        """The refusal as the whole response, as the limits answered it before the body was read."""
        retry = self.retry() if callable(self.retry) else self.retry
        await self.limits._reject(send, 429, self.code, self.message, retry=retry)


def client_of(scope: Scope, keys: Optional[KeyRing | KeyFile]) -> Optional[str]:
    """The request's client: its key's name; ``anonymous`` without keys; None for a missing or unknown key."""
    if keys is None:
        return ANONYMOUS
    found = key_of(scope, keys)
    return found.name if found is not None else None


def key_of(scope: Scope, keys: KeyRing | KeyFile) -> Optional[ApiKey]:
    """The configured key the request presents, or None."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    key = bearer_key(headers)
    return keys.lookup(key) if key else None


def _take(counts: dict[str, int], client: str, n: int) -> None:
    """Take ``n`` off ``client``'s count, dropping the entry at zero (the dicts hold only clients with something)."""
    left = counts.get(client, 0) - n
    if left > 0:
        counts[client] = left
    else:
        counts.pop(client, None)


class ClientLedger:
    """What each client holds across every model an orchestrator process serves: a key's limits are the key's,
    not one model's (counted per model, a key with two models had its tokens per minute, sessions and concurrency
    twice). ``orchs``: the orchestrators of those models (their live sessions, their token counts)."""

    def __init__(self, orchs: Sequence[Any]):
        self.orchs = list(orchs)
        self.by_client: dict[str, int] = {}  # generation requests running or queued
        self.sessions_of: dict[str, set[str]] = {}
        self.opening: dict[str, int] = {}  # session opens of each client under way (counted against max_sessions)
        self.reserved: dict[str, int] = {}  # tokens requests under way may still use, per client (tokens_per_minute)
        # refused generation requests the app checks before their 429 (_Refusal), per client: bounded (_may_defer)
        self.checking: dict[str, int] = {}
        self.active: dict[str, int] = {}  # API requests under way per client, on every path
        self.retired: set[str] = set()  # names a reload removed, forgotten once nothing of them runs (sweep)

    def live_sessions(self) -> set[str]:
        return {sid for o in self.orchs for sid in getattr(o, "sessions", {})}

    def tokens_last_minute(self, client: str) -> int:
        return sum(o.stats.tokens_last_minute(client) for o in self.orchs)

    def retire(self, removed: set[str], added: set[str]) -> None:
        """A reload of the key file removed the names ``removed`` and added ``added``: a removed name's per-client
        state (statistics, fair sharing, Prometheus series) is dropped once nothing of it runs (:meth:`sweep`);
        one added back before that keeps it. Without this, each removed or rotated name stayed for ever."""
        self.retired -= added
        self.retired |= removed - {ANONYMOUS}
        self.sweep()

    def sweep(self) -> None:
        """Forget each retired name with no request under way, no session open and no job waiting, in every
        model's orchestrator. The live sessions and the waiting jobs are read once for all the names (read for each,
        a reload that removed 1,000 names read a queue of 1,000 jobs 1,000 times), and a model's fair-sharing
        window is passed over once for all the names it forgets."""
        if not self.retired:
            return
        live = self.live_sessions()
        waiting = {getattr(j, "client", None) for o in self.orchs
                   for j in getattr(getattr(o, "dispatch", None), "waiting_jobs", list)()}
        idle = sorted(n for n in self.retired if not self._busy(n, live, waiting))
        if not idle:
            return
        self.retired.difference_update(idle)
        for name in idle:
            self.sessions_of.pop(name, None)
        for o in self.orchs:
            for part, forget in (("stats", "forget_client"), ("deadlines", "forget")):
                forget_one = getattr(getattr(o, part, None), forget, None)
                if forget_one is not None:
                    for name in idle:
                        forget_one(name)
            forget_all = getattr(getattr(o, "shares", None), "forget", None)
            if forget_all is not None:
                forget_all(*idle)

    def _busy(self, name: str, live: set[str], waiting: set[Any]) -> bool:
        """Whether ``name`` has a request under way, a session among ``live`` or a job among ``waiting``'s
        clients."""
        return bool(self.active.get(name) or self.opening.get(name) or name in waiting
                    or not self.sessions_of.get(name, set()).isdisjoint(live))

    def seconds_until_below(self, client: str, limit: int) -> int:
        """Seconds until ``client``'s last-minute usage over every model drops below ``limit`` (Retry-After)."""
        used = self.tokens_last_minute(client)
        if used < limit:
            return 1
        now = time.monotonic()
        for t, n in sorted(e for o in self.orchs for e in o.stats.usage_window(client)):  # each leaves at t + 60
            used -= n
            if used < limit:
                return max(1, math.ceil(t + 60.0 - now))
        return 60


class AdmissionLimits:
    """ASGI middleware enforcing :class:`LimitsConfig` in front of the API app of ``orch`` (per-client counts in
    ``ledger``, shared by every model's app of one orchestrator process)."""

    def __init__(self, app: Any, orch: Any, limits: Optional[LimitsConfig] = None,
                 ledger: Optional[ClientLedger] = None, end_hook: bool = False):
        self.app = app
        # the app's end-of-request hook calls release_client once it counted the request (api.py); else done here
        self.end_hook = end_hook
        self.orch = orch
        self.limits = limits or LimitsConfig.from_config(getattr(orch, "cfg", None))
        self.inflight = 0
        self.ledger = ledger if ledger is not None else ClientLedger([orch])
        # the ledger's dicts themselves (changed in place only): every model's app sees the same counts
        self.by_client = self.ledger.by_client
        self.sessions_of = self.ledger.sessions_of
        self.opening = self.ledger.opening
        self.reserved = self.ledger.reserved
        self.checking = self.ledger.checking
        self.rejected: dict[str, int] = {}
        self.api: Any = None  # the FastAPI app whose routes' body models _body_valid checks (install_limits)
        self._metric = None
        try:
            from prometheus_client import Counter

            self._metric = Counter("petals_chain_rejected_requests", "Requests refused by admission limits",
                                   ["reason"], registry=orch.stats.registry)
        except Exception:  # noqa: BLE001 - metrics are optional (e.g. a registry that already has it)
            self._metric = None
        self._closing: set[asyncio.Task] = set()  # closes of the sessions of removed keys
        if isinstance(self.limits.keys, KeyFile):
            self.limits.keys.listeners.append(self._keys_reloaded)
            try:
                orch.stats.registry.register(_KeyFileMetrics(self.limits.keys))
            except Exception:  # noqa: BLE001 - optional, as above (another app over the same orchestrator has it)
                pass

    def _keys_reloaded(self, added: set[str], removed: set[str], changed: set[str]) -> None:
        """A reload of the key file: close the sessions of the removed keys (on this app's model), each once its
        turn under way, if any, ends; their names' state goes once nothing of them runs (:meth:`ClientLedger.
        retire`)."""
        self.ledger.retire(removed, added)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # polled outside the event loop: the sessions are left to the idle reaper
            return
        live = getattr(self.orch, "sessions", {})
        for name in sorted(removed):
            sids = sorted(sid for sid in self.sessions_of.get(name, ()) if sid in live)
            if sids:
                task = asyncio.ensure_future(self._close_sessions_of(name, sids))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def _close_sessions_of(self, name: str, sids: list[str]) -> None:
        for sid in sids:
            s = self.orch.sessions.get(sid)
            if s is None:
                continue
            while not await s.wait_turn_end(5.0):  # its turn (running, or waiting for a chain) finishes first
                pass
            if self.limits.keys is None or self.limits.keys.get(name) is not None:
                return  # the name came back meanwhile (with a new key): its sessions are its own again
            if sid not in self.orch.sessions:
                continue
            try:
                await self.orch.close_session(sid)
            except RequestError:  # closed meanwhile (by its client, or the reaper)
                continue
            logger.info("closed session %s of %s: its API key was removed", sid, name)
        self.ledger.sweep()

    # ---- state ---------------------------------------------------------------------------------
    def capacity(self) -> int:
        return int(sum(max(0, int(ch.capacity)) for ch in getattr(self.orch.dispatch, "chains", [])))

    def open_sessions(self, client: str) -> int:
        owned = self.sessions_of.get(client)
        if not owned:
            return 0
        owned.intersection_update(self.ledger.live_sessions())  # closed or reaped sessions stop counting
        if not owned:
            self.sessions_of.pop(client, None)
        return len(owned)

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free: the queue ahead served at the chains' measured rate."""
        measured = {}
        try:
            measured = self.orch.stats.measured()
        except Exception:  # noqa: BLE001
            pass
        service = measured.get("mean_service_s") or 1.0
        queue = int(getattr(self.orch.dispatch, "queue_length", 0))
        cap = max(1, self.capacity())
        return int(min(120, max(1, math.ceil(service * (queue + 1) / cap))))

    def snapshot(self) -> dict:
        numbers = {k: v for k, v in self.limits.__dict__.items() if k != "keys"}
        keys = self.limits.keys
        reloads = {"api_keys_reloads": keys.reloads, "api_keys_reload_failures": keys.failures} \
            if isinstance(keys, KeyFile) else {}
        return {"inflight": self.inflight, "clients": len(self.by_client), "rejected": dict(self.rejected),
                "api_keys": len(keys) if keys is not None else 0, **reloads, **numbers}

    def clients_json(self) -> list[dict]:
        """Usage per client (key name; never the key): requests in flight, open sessions, tokens in the last
        minute, and each key's limits."""
        names = set(self.by_client) | set(self.sessions_of)
        if self.limits.keys is not None:
            names |= {k.name for k in self.limits.keys.keys}
        else:
            names.add(ANONYMOUS)
        stats = self.orch.stats
        return [{"name": n, "inflight": self.by_client.get(n, 0), "sessions": self.open_sessions(n),
                 "tokens_last_minute": self.ledger.tokens_last_minute(n), **stats.client_totals(n),
                 "limits": {"max_concurrent": self.limits.inflight_limit(n),
                            "max_sessions": self.limits.session_limit(n),
                            "tokens_per_minute": self.limits.tokens_per_minute(n)}}
                for n in sorted(names)]

    # ---- responses -----------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if self._metric is not None:
            self._metric.labels(reason).inc()

    def count_refusal(self, reason: str) -> None:
        """Count a refusal answered in front of these limits (the model router's 413) as one of theirs."""
        self._count(reason)

    async def _reject(self, send: Send, status: int, reason: str, message: str, retry: bool | int = True,
                      no_retry: bool = False) -> None:
        self._count(reason)
        await self._send_error(send, status, error_object(status, message, code=reason), retry, no_retry)

    async def _send_error(self, send: Send, status: int, error: dict, retry: bool | int,
                          no_retry: bool = False) -> None:
        """``error`` (``{"error": {...}}``) as the whole response; ``retry``: a ``Retry-After`` (True: ours);
        ``no_retry``: ``x-should-retry: false``, for a refusal sending the request again cannot cure."""
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="petals-chain"'))
        if no_retry:  # OpenAI's clients retry every 429 and 5xx unless told not to
            headers.append((NO_RETRY_HEADER.encode(), b"false"))
        if retry:
            seconds = self.retry_after_s() if retry is True else int(retry)
            headers.append((b"retry-after", str(seconds).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # ---- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope.get("type") == "http" and path == "/api/v1/limits":
            get = scope.get("method") == "GET"  # (HEAD comes as GET: swarm.httpedge.HeadAsGet)
            body = json.dumps(self.snapshot() if get else error_object(405, "Method Not Allowed",
                                                                       code="method_not_allowed")).encode()
            await send({"type": "http.response.start", "status": 200 if get else 405,
                        "headers": [(b"content-type", b"application/json")] + ([] if get else [(b"allow", b"GET")])})
            return await send({"type": "http.response.body", "body": body})
        if scope.get("type") != "http" or not _AUTHENTICATED.match(path):
            return await self.app(scope, receive, send)
        key = key_of(scope, self.limits.keys) if self.limits.keys is not None else None
        client = key.name if key is not None else ANONYMOUS if self.limits.keys is None else None
        if client is None:
            return await self._reject(send, 401, "invalid_api_key", "a valid API key is required: send "
                                      "'Authorization: Bearer KEY' (keys are configured with --api-keys)",
                                      retry=False)
        token = CLIENT.set(client)  # copied into every task the request spawns (stats, sessions)
        scope["petals_chain.client"] = client  # who it was admitted as (a key reload may remove or rename it meanwhile)
        pinned = REQUEST_KEY.set(key)  # its limits and deadlines: the key's as it was admitted, reloads aside
        self.ledger.active[client] = self.ledger.active.get(client, 0) + 1
        scope[_HELD] = (self.ledger, client)
        try:
            await self._serve(client, scope, receive, send)
        finally:
            REQUEST_KEY.reset(pinned)
            CLIENT.reset(token)
            if not self.end_hook:
                release_client(scope)

    async def _serve(self, client: str, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        m = _SESSION.match(path)
        if m is not None and not _OPEN_SESSION.match(path) and self.limits.keys is not None:
            sid = m.group(1)
            if sid in getattr(self.orch, "sessions", {}) and sid not in self.sessions_of.get(client, set()):
                return await self._reject(send, 404, "session_not_found", f"no open session {sid!r}", retry=False)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length":
                try:
                    if int(v) > limit:
                        return await self._reject(send, 413, "body_too_large",
                                                  f"the request body is larger than {limit} bytes", retry=False)
                except ValueError:
                    return await self._reject(send, 400, "bad_content_length", "invalid Content-Length",
                                              retry=False)
        read: Optional[ReadBody] = scope.get(READ_BODY)
        if read is not None and len(read.data) > limit:  # read by a layer outside (the model router) up to its cap
            return await self._reject(send, 413, "body_too_large", f"the request body is larger than {limit} bytes",
                                      retry=False)
        receive = self._bounded(receive, limit)
        if _OPEN_SESSION.match(path):
            cap = self.limits.session_limit(client)
            # opens still reading their body count too: checked one by one, concurrent opens all got past the cap
            if self.open_sessions(client) + self.opening.get(client, 0) >= cap:
                return await self._reject(send, 429, "client_session_limit",
                                          f"this client already has {cap} open sessions;"
                                          " close one (DELETE /api/v1/sessions/{id}) or retry later")
            self.opening[client] = self.opening.get(client, 0) + 1
            try:
                return await self._guard(self._record_session(client, send), scope, receive, send)
            finally:
                _take(self.opening, client, 1)
        if not GENERATE_PATH.match(path):
            return await self._guard(send, scope, receive, send)
        per_minute = self.limits.tokens_per_minute(client)
        refusal = self._early_refusal(client, scope, per_minute)
        if refusal is not None and (not self._defers(scope) or not self._may_defer(client)):
            # the app may forward the request (or hold a session's turn) before its own checks end, or the client has
            # as many refused requests in them as it may have in flight: the body is checked here (read once, handed
            # on), and only a body the app refuses (400) goes on
            if read is None:
                try:
                    data = await read_whole(receive, limit)
                except BodyTooLarge:
                    return await self._reject(send, 413, "body_too_large",
                                              f"the request body is larger than {limit} bytes", retry=False)
                if data is None:
                    return None  # the client went away
                read = scope[READ_BODY] = ReadBody(data)
                receive = replay_body(data, receive)
            if self._body_valid(scope, read):
                return await refusal.answer(send)
        adm = Admission()
        if refusal is not None:
            # answered once the app found the request valid; never counted in flight
            adm.reserve = lambda need, field="max_tokens": refusal.fire(int(need), field, adm)
            adm.refused_early = True
            self.checking[client] = self.checking.get(client, 0) + 1
        else:
            self.inflight += 1
            self.by_client[client] = self.by_client.get(client, 0) + 1
            if per_minute is not None:
                adm.reserve = lambda need, field="max_tokens": self._reserve(client, adm, int(need), per_minute,
                                                                             field)
        token = ADMISSION.set(adm)  # copied into the tasks the app spawns for this request
        held = _HeldResponse(self, send, adm, refusal)
        watcher = asyncio.ensure_future(held.watch())
        try:
            await self._guard(held, scope, receive, send)
            await held.finish()
        finally:
            watcher.cancel()
            ADMISSION.reset(token)
            if refusal is not None:
                _take(self.checking, client, 1)
            else:
                # the reservation's real use is charged by now (a little counted twice meanwhile: never less)
                _take(self.reserved, client, adm.reserved)
                self.inflight -= 1
                _take(self.by_client, client, 1)

    def _early_refusal(self, client: str, scope: Scope, per_minute: Optional[int]) -> Optional[_Refusal]:
        """The 429 the client's limits or a full queue give this generation request now, if any: a cheap check
        before its body is read (the exact queue bound is the dispatcher's, QueueFull)."""
        mine = self.by_client.get(client, 0)
        cap = self.limits.inflight_limit(client)
        if mine >= cap and not is_resume(Headers(scope=scope)):  # a resume's request is already counted here
            return _Refusal(self, "client_inflight_limit",
                            f"this client already has {mine} requests running or queued (limit {cap})")
        if per_minute is not None and self._tokens_held(client) >= per_minute:
            return _Refusal(self, "tokens_per_minute", f"this client used its {per_minute} tokens per minute; "
                            "retry later", retry=lambda: self.ledger.seconds_until_below(client, per_minute),
                            per_minute=per_minute)
        queue = int(getattr(self.orch.dispatch, "queue_length", 0))
        full = self.inflight >= self.capacity() + self.limits.max_queue or queue >= self.limits.max_queue
        # a queue that keeps places for clients with nothing waiting (dispatch.QueueShareFull): the count here includes
        # other clients' undecided requests, so such a client's request goes on to the dispatcher's exact decision
        dispatch = self.orch.dispatch
        if (full and queue < self.limits.max_queue and getattr(dispatch, "keeps_places", False)
                and dispatch.waiting_of(client) == 0):
            full = False
        if full and not forwardable(self.orch, Headers(scope=scope)):  # another orchestrator's group may take it
            return _Refusal(self, "queue_full", f"the swarm is at capacity and its queue is full "
                            f"({self.limits.max_queue} waiting); retry later")
        return None

    def _defers(self, scope: Scope) -> bool:
        """Whether an early refusal of this request may wait for the app's checks (:class:`_Refusal`): the app does
        nothing before them but forward the request to another orchestrator (only with groups, and not one
        forwarded here already), or wait for a session's turn under way (a session's generate)."""
        if _SESSION_GENERATE.match(scope.get("path", "")):
            return False
        return getattr(self.orch, "groups", None) is None or FORWARDED_HEADER in Headers(scope=scope)

    def _may_defer(self, client: str) -> bool:
        """Whether another refused request of ``client`` may wait for the app's checks (:class:`_Refusal`): it is not
        counted in flight meanwhile, and the checks tokenize its prompt (up to a million characters) or template its
        messages (and compile a structured output's grammar). Unbounded, a client past its cap (or every client at a
        full queue) had any number of requests doing that work at once, where one within its limits has at most its
        cap; bounded so, a client has at most as many refused requests in the app as it may have in flight (at least
        one)."""
        return self.checking.get(client, 0) < max(1, self.limits.inflight_limit(client))

    def _body_valid(self, scope: Scope, read: ReadBody) -> bool:
        """Whether the body passes the body validation of the API route ``scope`` reaches, as FastAPI runs it (JSON by
        its Content-Type rule, the route's model), with the JSON parse the endpoint uses: False only when the app
        would refuse it (400) before any work; True when it cannot tell (no such route)."""
        route = self._route(scope)
        field = getattr(route, "body_field", None)
        if field is None:
            return True
        value: Any = None
        if read.data:
            kind = Headers(scope=scope).get("content-type")
            if not kind:
                is_json = not getattr(route, "strict_content_type", True)
            else:
                message = email.message.Message()
                message["content-type"] = kind
                sub = message.get_content_subtype()
                is_json = message.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))
            if not is_json:
                return False  # the app takes such a body as bytes: never the JSON object a route takes
            try:
                value = read.json()
            except (ValueError, RecursionError):
                return False
        try:
            _, errors = field.validate(value, {}, loc=("body",))
        except Exception:  # noqa: BLE001 - a validator that raises is the app's to answer (and to log)
            return False
        return not errors

    def _route(self, scope: Scope) -> Optional[APIRoute]:
        """The route (FastAPI's) of ``api`` that ``scope`` reaches; None: none."""
        api = self.api
        if api is None:
            return None
        from starlette.routing import Match

        for route in api.router.routes:
            if isinstance(route, APIRoute) and route.matches(scope)[0] == Match.FULL:
                return route
        return None

    def _tokens_held(self, client: str) -> int:
        """Tokens ``client`` used in the last minute plus what its requests under way may still use."""
        return self.ledger.tokens_last_minute(client) + self.reserved.get(client, 0)

    def _reserve(self, client: str, adm: Admission, need: int, per_minute: int, field: str = "max_tokens") -> None:
        """Hold ``need`` tokens (prompt + max_tokens x n) of ``client``'s per-minute budget for a request, before it
        runs. Checking only the tokens charged when requests end let one request, or many at once, spend the budget
        several times over. ``field``: the body field the output limit came in (named in the error)."""
        self._over_budget(adm, need, per_minute, field)
        held = self._tokens_held(client)
        if held + need > per_minute:
            self._count("tokens_per_minute")
            raise RequestError(f"this request may use {need} tokens and this client has {held} of its {per_minute} "
                               "tokens per minute used or held by requests under way; retry later", status=429,
                               code="tokens_per_minute")
        self.reserved[client] = self.reserved.get(client, 0) + need
        adm.reserved += need

    def _over_budget(self, adm: Admission, need: int, per_minute: int, field: str) -> None:
        """Refuse (429 ``tokens_per_minute``, counted) a request of ``need`` tokens, more than the whole budget
        ``per_minute``: no ``Retry-After`` (``adm.never_fits``), retried it fails again. Nothing if it fits."""
        if need > per_minute:
            self._count("tokens_per_minute")
            adm.never_fits = True
            what, fix = (("its inputs", "send fewer or shorter inputs") if field == "input"  # embeddings
                         else (f"prompt + {field} x n", f"lower {field}"))
            raise RequestError(f"this request may use {need} tokens ({what}), more than this client's "
                               f"{per_minute} tokens per minute: {fix}", status=429, param=field,
                               code="tokens_per_minute")

    async def _guard(self, inner_send: Send, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await inner_send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, 413, "body_too_large",
                                   f"the request body is larger than {self.limits.max_body_bytes} bytes", retry=False)

    @staticmethod
    def _bounded(receive: Receive, limit: int) -> Receive:
        """``receive`` that raises once a (chunked) body exceeds ``limit`` bytes."""
        total = 0

        async def wrapped() -> dict:
            nonlocal total
            message = await receive()
            if message.get("type") == "http.request":
                total += len(message.get("body", b""))
                if total > limit:
                    raise BodyTooLarge(limit)
            return message

        return wrapped

    def _record_session(self, client: str, send: Send) -> Send:
        """``send`` that notes the id of a session this client opened (from the small JSON reply)."""
        chunks: list[bytes] = []
        status = 0

        async def wrapped(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message.get("status", 0))
            elif message["type"] == "http.response.body" and status == 200:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    if (sid := opened_session_id(status, b"".join(chunks))) is not None:
                        self.sessions_of.setdefault(client, set()).add(sid)
            await send(message)

        return wrapped


class _KeyFileMetrics:
    """Prometheus collector of a :class:`KeyFile`: the keys loaded and the reloads of the file by outcome."""

    def __init__(self, keys: KeyFile):
        self.keys = keys

    def describe(self) -> list:  # the names, so that a second registration is refused as a duplicate
        return self._families(0, 0, 0)

    def collect(self) -> list:
        return self._families(len(self.keys), self.keys.reloads, self.keys.failures)

    @staticmethod
    def _families(n: int, reloads: int, failures: int) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loaded = GaugeMetricFamily("petals_chain_api_keys", "API keys loaded from the --api-keys file", value=n)
        counts = CounterMetricFamily("petals_chain_api_key_reloads", "Edits of the --api-keys file: loaded, or "
                                     "failed (the keys loaded before kept; also a file gone or unreadable)",
                                     labels=["outcome"])
        counts.add_metric(["loaded"], reloads)
        counts.add_metric(["failed"], failures)
        return [loaded, counts]


def _stream_error(messages: list[dict]) -> dict | None:
    """The error object (with its ``status``) of a held event stream that ended in an error event, else None."""
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                err = json.loads(line[6:]).get("error")
            except ValueError:
                continue
            status = err.get("status") if isinstance(err, dict) else None
            if isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 600:
                return dict(err)
    return None


class _HeldResponse:
    """``send`` of a generation request that holds a 200 response back until the dispatcher admitted (started
    or queued) or refused the request's job. A streamed response starts before its job reaches the dispatcher;
    if the job is refused, a 429 with the refusal's code (``queue_full``, ``deadline_unreachable``, ...) and
    ``Retry-After`` goes out instead and the held stream is dropped. A stream that ends in an error event before
    the dispatcher decided (no chain served the model) goes out as that error's HTTP status, as OpenAI answers.
    Any 429 the app sends gets a ``Retry-After`` if it has none, unless the request can never be admitted as it is
    (:attr:`~petals_chain.orchestrator.dispatch.Admission.never_fits`: more completions than the swarm can ever hold,
    more tokens than its client's budget per minute, a deadline an idle swarm misses): retried, it would be refused
    again. ``refusal``: an early refusal that waits for the app's checks (:class:`_Refusal`); once it fired, the app's
    answer to it is replaced by the limits' own."""

    def __init__(self, limits: AdmissionLimits, send: Send, adm: Admission, refusal: Optional[_Refusal] = None):
        self.limits, self.send, self.adm, self.refusal = limits, send, adm, refusal
        self.held: list[dict] = []
        self.passing = False  # decided: messages go straight through
        self.replaced = False  # a 429 went out instead: the app's messages are dropped
        self.lock = asyncio.Lock()

    async def __call__(self, message: dict) -> None:
        async with self.lock:
            if self.replaced:
                return  # the client has its 429; the app winds down (the server reports the disconnect)
            # a refused request the app served (2xx, 3xx) without reserving its tokens (an endpoint that skips
            # reserve_tokens) was found valid all the same: it gets its 429, never the app's answer
            if self.refusal is not None and not self.passing and (
                    self.refusal.fired or int(message.get("status", 400)) < 400):
                self.replaced, self.held = True, []
                return await self.refusal.answer(self.send)
            if self.passing:
                return await self._send(message)
            self.held.append(message)
            await self._settle(app_done=False)

    async def watch(self) -> None:
        """Release the held response as soon as the dispatcher decides (a queued job may wait long)."""
        await self.adm.event.wait()
        async with self.lock:
            await self._settle(app_done=False)

    async def finish(self) -> None:
        async with self.lock:
            await self._settle(app_done=True)

    async def _settle(self, app_done: bool) -> None:
        if self.passing or self.replaced or not self.held:
            if app_done and not self.replaced:
                self.passing = True
            return
        start = self.held[0]
        complete = any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in self.held)
        failed = _stream_error(self.held) if complete and self.adm.state is None and start.get("status") == 200 \
            else None
        if failed is not None:  # ended in error before the dispatcher saw it (no chain at all): nothing went out yet
            self.replaced, self.held = True, []
            status = failed.pop("status", 503)
            # a 504 deadline_exceeded (no chain came before its deadline) is the swarm's state now: retried, it may
            # be served (api._futile_retry)
            retry = unavailable_retry_after_s(getattr(self.limits.orch, "cfg", None)) if status == 503 \
                else status == 429
            await self.limits._send_error(self.send, status, {"error": failed}, retry=retry,
                                          no_retry=status == 429 and self.adm.never_fits)
        elif start.get("status") == 200 and self.adm.state == "refused":
            self.replaced, self.held = True, []
            if self.adm.code and self.adm.message:  # the dispatcher's own words (e.g. "ask for fewer": never fits)
                await self.limits._reject(self.send, 429, self.adm.code, self.adm.message,
                                          retry=not self.adm.never_fits, no_retry=self.adm.never_fits)
            else:
                await self.limits._reject(self.send, 429, "queue_full",
                                          "the swarm is at capacity and its queue is full "
                                          f"({self.limits.limits.max_queue} waiting); retry later")
        elif start.get("status") != 200 or self.adm.state == "admitted" or complete or app_done:
            held, self.held, self.passing = self.held, [], True
            for m in held:
                await self._send(m)

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.start" and message.get("status") == 429:
            headers = list(message.get("headers", []))
            # a request that can never be admitted as it is (Admission.never_fits) is not told to come back, nor is
            # one another orchestrator refused so (a forward's reply, its x-should-retry: false passed through: a
            # Retry-After added here invited back what that orchestrator said never fits)
            futile = self.adm.never_fits or any(k.lower() == NO_RETRY_HEADER.encode() and v.strip().lower() == b"false"
                                                for k, v in headers)
            if not futile and not any(k.lower() == b"retry-after" for k, _ in headers):
                headers.append((b"retry-after", str(self.limits.retry_after_s()).encode()))
                message = {**message, "headers": headers}
            if self.adm.state == "refused":  # the dispatcher's refusal, answered by the app (non-streamed)
                code = self.adm.code or "queue_full"
                self.limits.rejected[code] = self.limits.rejected.get(code, 0) + 1
                if self.limits._metric is not None:
                    self.limits._metric.labels(code).inc()
        await self.send(message)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` whose first message is ``body`` (read already), whole; then ``receive``'s own (a disconnect)."""
    sent = False

    async def wrapped() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


def release_client(scope: Scope) -> None:
    """The request of ``scope`` is over and counted: its hold on its client's state ends (once). A name removed from
    the key file is forgotten after its last request's count, not before it (counted after, it came back)."""
    held = scope.pop(_HELD, None)
    if held is not None:
        ledger, client = held
        _take(ledger.active, client, 1)
        if ledger.retired:
            ledger.sweep()


def install_limits(app: Any, orch: Any, limits: Optional[LimitsConfig] = None,
                   ledger: Optional[ClientLedger] = None, end_hook: bool = False) -> None:
    """Wrap ``app`` (FastAPI/Starlette) with :class:`AdmissionLimits`; the instance is ``app.state.limits``.
    ``end_hook``: the app's end-of-request hook calls :func:`release_client` after counting the request."""
    holder: dict[str, AdmissionLimits] = {}

    class _Bound(AdmissionLimits):
        def __init__(self, inner: Any):
            super().__init__(inner, orch, limits, ledger, end_hook)
            self.api = app  # its routes' body models: an invalid body is answered 400 before a full queue's 429
            holder["limits"] = self
            app.state.limits = self

    app.add_middleware(_Bound)
