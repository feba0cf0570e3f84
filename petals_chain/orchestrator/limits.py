"""Admission limits of the HTTP API: a bounded central queue, per-client limits, bounded request bodies.

A pure ASGI middleware, so a streamed response counts as in flight until its last byte is sent (or the
client disconnects). Rejections are 429 (or 413 for bodies) in OpenAI's error format, with a
``Retry-After`` header estimated from the measured service time and the queue ahead (none for a request that can
never be admitted as it is, ``exceeds_capacity``, ``tokens_per_minute`` over the budget itself, or
``deadline_infeasible``, a deadline missed even by an idle swarm: retried, it would be refused again).

The queue bound itself is exact in the dispatch manager (:mod:`dispatch`), which refuses a job when its
queue is full; the check here is only a cheap early refusal. A generation response is held back until the
dispatcher has decided on the request's job (:class:`~petals_chain.orchestrator.dispatch.Admission`), so
that a refusal of a streamed request is still an HTTP 429 and not an error event inside a 200 stream.

The client is the name of the API key a request presents (``--api-keys``, :mod:`auth`); without keys every
request is the one client ``anonymous``. With keys, the API (``/v1/*``, ``/api/v1/sessions*``) answers 401 to
a missing or unknown key, each key has its own limits, and a session answers only to the key that opened it
(another key gets 404, as for a session that does not exist). The swarm state, metrics, health and dashboard
stay public (they show key names, never keys).

The key file is reloaded when it changes (:class:`~petals_chain.orchestrator.auth.KeyFile`): a key's limits are read
at each request, so an edit applies to the next one. The multi-turn sessions of a key removed from the file are
closed once their turn under way (if any) ends: the client can no longer reach them (401), and they held their
chain or KV until the idle reaper. A key whose name stays (a new key for it, new limits) keeps its sessions.
Reloads are counted in ``petals_chain_api_key_reloads_total{outcome}`` and ``/api/v1/limits``.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from petals_chain.orchestrator.auth import (ANONYMOUS, CLIENT, DEFAULT_RELOAD_S, ApiKey, KeyFile, KeyRing,
                                            bearer_key)
from petals_chain.orchestrator.dispatch import ADMISSION, Admission
from petals_chain.orchestrator.errors import RequestError, unavailable_retry_after_s
from petals_chain.orchestrator.forward import forwardable, opened_session_id
from petals_chain.orchestrator.resume import is_resume
from petals_chain.orchestrator.sse import NO_RETRY_HEADER, error_object

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

# the generation endpoints (their requests are a client's in-flight work); api.py counts them by the same pattern
GENERATE_PATH = re.compile(r"^/(v1/completions|v1/chat/completions|v1/responses|api/v1/sessions/[^/]+/generate)/?$")
_OPEN_SESSION = re.compile(r"^/api/v1/sessions/?$")
_SESSION = re.compile(r"^/api/v1/sessions/([^/]+)(/generate)?/?$")
_AUTHENTICATED = re.compile(r"^/(v1/|api/v1/sessions)")

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


class _BodyTooLarge(StarletteHTTPException):
    """A chunked body past the limit, raised while the app reads it: an HTTP exception so that FastAPI's body
    parsing passes it on as a 413 (any other exception there becomes its 400 "error parsing the body")."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


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
        if scope.get("type") == "http" and path == "/api/v1/limits" and scope.get("method") == "GET":
            body = json.dumps(self.snapshot()).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
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
        mine = self.by_client.get(client, 0)
        cap = self.limits.inflight_limit(client)
        if mine >= cap and not is_resume(Headers(scope=scope)):  # a resume's request is already counted here
            return await self._reject(send, 429, "client_inflight_limit",
                                      f"this client already has {mine} requests running or queued (limit {cap})")
        per_minute = self.limits.tokens_per_minute(client)
        if per_minute is not None and self._tokens_held(client) >= per_minute:
            return await self._reject(send, 429, "tokens_per_minute",
                                      f"this client used its {per_minute} tokens per minute; retry later",
                                      retry=self.ledger.seconds_until_below(client, per_minute))
        # Cheap early refusal (before the body is read); the exact bound is the dispatcher's (QueueFull).
        queue = int(getattr(self.orch.dispatch, "queue_length", 0))
        full = self.inflight >= self.capacity() + self.limits.max_queue or queue >= self.limits.max_queue
        # a queue that keeps places for clients with nothing waiting (dispatch.QueueShareFull): the count here includes
        # other clients' undecided requests, so such a client's request goes on to the dispatcher's exact decision
        dispatch = self.orch.dispatch
        if (full and queue < self.limits.max_queue and getattr(dispatch, "keeps_places", False)
                and dispatch.waiting_of(client) == 0):
            full = False
        if full and not forwardable(self.orch, Headers(scope=scope)):  # another orchestrator's group may take it
            # A body the app refuses (400) gets that answer: a 429 for it was retried by clients, and could never
            # succeed. Read and checked here only while the queue is full; let in, it is refused by the app's
            # validation before any work (and the dispatcher's exact bound stands in any case).
            try:
                body = await self._read_body(receive)
            except _BodyTooLarge:
                return await self._reject(send, 413, "body_too_large",
                                          f"the request body is larger than {limit} bytes", retry=False)
            if body is None:
                return None  # the client went away
            if self._body_valid(scope, body):
                return await self._reject(send, 429, "queue_full",
                                          f"the swarm is at capacity and its queue is full ({self.limits.max_queue} "
                                          "waiting); retry later")
            receive = replay_body(body, receive)
        self.inflight += 1
        self.by_client[client] = mine + 1
        adm = Admission()
        if per_minute is not None:
            adm.reserve = lambda need, field="max_tokens": self._reserve(client, adm, int(need), per_minute,
                                                                         field)
        token = ADMISSION.set(adm)  # copied into the tasks the app spawns for this request
        held = _HeldResponse(self, send, adm)
        watcher = asyncio.ensure_future(held.watch())
        try:
            await self._guard(held, scope, receive, send)
            await held.finish()
        finally:
            watcher.cancel()
            ADMISSION.reset(token)
            # the reservation's real use is charged by now (a little counted twice meanwhile: never less)
            _take(self.reserved, client, adm.reserved)
            self.inflight -= 1
            _take(self.by_client, client, 1)

    @staticmethod
    async def _read_body(receive: Receive) -> bytes | None:
        """The whole request body (None: the client disconnected first)."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _body_valid(self, scope: Scope, body: bytes) -> bool:
        """Whether ``body`` passes the body validation of the API route ``scope`` reaches (JSON, the route's model):
        False only when the app would refuse it (400) before any work; True when it cannot tell (no such route)."""
        field = self._body_field(scope)
        if field is None:
            return True
        kind = Headers(scope=scope).get("content-type", "")
        if kind and not re.match(r"^application/([\w.+-]+\+)?json\s*(;|$)", kind.strip().lower()):
            return False  # the app reads such a body as bytes: never the JSON object a route takes
        try:
            value = json.loads(body) if body else None
        except (ValueError, RecursionError):
            return False
        try:
            _, errors = field.validate(value, {}, loc=("body",))
        except Exception:  # noqa: BLE001 - a validator that raises is the app's to answer (and to log)
            return False
        return not errors

    def _body_field(self, scope: Scope) -> Any:
        """The body field (FastAPI's) of the route of ``api`` that ``scope`` reaches; None: none."""
        api = self.api
        if api is None:
            return None
        from fastapi.routing import APIRoute
        from starlette.routing import Match

        for route in api.router.routes:
            if isinstance(route, APIRoute) and route.matches(scope)[0] == Match.FULL:
                return route.body_field
        return None

    def _tokens_held(self, client: str) -> int:
        """Tokens ``client`` used in the last minute plus what its requests under way may still use."""
        return self.ledger.tokens_last_minute(client) + self.reserved.get(client, 0)

    def _reserve(self, client: str, adm: Admission, need: int, per_minute: int, field: str = "max_tokens") -> None:
        """Hold ``need`` tokens (prompt + max_tokens x n) of ``client``'s per-minute budget for a request, before it
        runs. Checking only the tokens charged when requests end let one request, or many at once, spend the budget
        several times over. ``field``: the body field the output limit came in (named in the error)."""
        held = self._tokens_held(client)
        if held + need > per_minute:
            self._count("tokens_per_minute")
            if need > per_minute:
                adm.never_fits = True  # no Retry-After: it exceeds the budget itself, retried it fails again
                raise RequestError(f"this request may use {need} tokens (prompt + {field} x n), more than this "
                                   f"client's {per_minute} tokens per minute: lower {field}", status=429,
                                   param=field, code="tokens_per_minute")
            raise RequestError(f"this request may use {need} tokens and this client has {held} of its {per_minute} "
                               "tokens per minute used or held by requests under way; retry later", status=429,
                               code="tokens_per_minute")
        self.reserved[client] = self.reserved.get(client, 0) + need
        adm.reserved += need

    async def _guard(self, inner_send: Send, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await inner_send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except _BodyTooLarge:
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
                    raise _BodyTooLarge(limit)
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
    again."""

    def __init__(self, limits: AdmissionLimits, send: Send, adm: Admission):
        self.limits, self.send, self.adm = limits, send, adm
        self.held: list[dict] = []
        self.passing = False  # decided: messages go straight through
        self.replaced = False  # a 429 went out instead: the app's messages are dropped
        self.lock = asyncio.Lock()

    async def __call__(self, message: dict) -> None:
        async with self.lock:
            if self.replaced:
                return  # the client has its 429; the app winds down (the server reports the disconnect)
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
