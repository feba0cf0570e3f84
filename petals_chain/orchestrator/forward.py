"""Forwarding between the orchestrators of one swarm (``--group-with``): a request this orchestrator's group cannot
take now (no chain, or the queue at ``--max-queue``) goes to another orchestrator's group instead of failing.

A forwarded request carries :data:`FORWARDED_HEADER` and its request id (``x-request-id``: the other
orchestrator's log lines and reply name the same one), and is never forwarded again (no loops); its reply, streamed
or not, is passed back as the other orchestrator sent it (status, body and headers), with :data:`SERVED_BY_HEADER`
naming it. If the other orchestrator cannot be reached, or stops refreshing its group record while the request
waits, this one handles the request itself (and answers 503 or 429 as it would have). A streamed completion the other
orchestrator cuts off mid-way (it died, or stopped refreshing its group record while the stream was silent) is finished
from here when its output is reproducible: run again here once this group has a chain (or on a third orchestrator),
its events relayed without what the client already has, so an OpenAI client of this orchestrator sees one whole
stream (resume.py). A session opened through a forward lives on the other orchestrator: its later calls here are
forwarded there (:attr:`SessionOwners`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from petals_chain.orchestrator.auth import CLIENT
from petals_chain.orchestrator.deadlines import key_defaults
from petals_chain.orchestrator.dispatch import note_admission
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.request_id import HEADER as REQUEST_ID_HEADER, current_request_id
from petals_chain.orchestrator.resume import (SHUTTING_DOWN, Cut, DeadlineGone, ResponsesRecord, StreamRecord,
                                             client_tls, finish, first_deadline_s, relay_events, sse_events,
                                             stream_ending, ticking, with_time_gone)
from petals_chain.swarm.media import is_event_stream

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-petals-chain-forwarded-by"  # value: the peer id of the orchestrator that forwarded it
SERVED_BY_HEADER = "x-petals-chain-served-by"  # value: the URL of the orchestrator that served it
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-api-key")
# the other orchestrator's reply headers not passed back: hop-by-hop ones, and those the relay sets itself (the body
# goes on as it came, still encoded: its content-encoding stays)
_REPLY_HEADERS_DROPPED = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "upgrade", "trailer", "te", "proxy-authenticate", "proxy-authorization"}
MAX_SESSION_OWNERS = 10_000
TARGET_WAIT_S = 10.0  # a request to a group without a chain waits this long for one, here or elsewhere, to be known


def warm_up() -> None:
    """At startup, what the first forward did on the event loop while other requests waited: import httpx's
    transport (httpcore, loaded with the first client) and make :func:`client_tls`."""
    import httpcore  # noqa: F401

    client_tls()


class SessionOwners(OrderedDict):
    """Session id -> URL of the orchestrator it was opened on through a forward (bounded, oldest out first)."""

    def remember(self, session_id: str, url: str) -> None:
        self[session_id] = url
        self.move_to_end(session_id)
        while len(self) > MAX_SESSION_OWNERS:
            self.popitem(last=False)


def opened_session_id(status: int, body: bytes) -> Optional[str]:
    """The id a session-open reply names (None: not a 200 naming one)."""
    if status != 200:
        return None
    try:
        sid = json.loads(body).get("session_id")
    except (ValueError, AttributeError):
        return None
    return sid if isinstance(sid, str) else None


class _Lost(Exception):
    """The other orchestrator stopped answering while a forwarded request waited for its reply."""


async def unless_disconnected(request: Request, coro, give_up: Optional[Callable[[], Optional[str]]] = None):
    """Await ``coro``; if the client goes away first, cancel it (its chain and server slots are freed, or the
    connection to the orchestrator it was forwarded to is closed, which frees them there). ``give_up()``, asked
    every second, names a reason to stop waiting (:class:`_Lost`), or None."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if give_up is not None and (reason := give_up()) is not None:
                raise _Lost(reason)
            if await request.is_disconnected():
                logger.info("%s %s: the client disconnected; its generation is cancelled", request.method,
                            request.url.path)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise RequestError("the client disconnected", status=499, code="client_disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def forward_target(orch: Any) -> Optional[str]:
    """The URL of the orchestrator to send a request to now, or None to handle it here: only with groups, only when
    this group has no chain or a full queue, and only to a live orchestrator whose group has servers (the most
    servers per request arriving at it first)."""
    groups = orch.groups
    if groups is None:
        return None
    dispatch = orch.dispatch
    full = dispatch.max_queue is not None and dispatch.queue_length >= dispatch.max_queue
    if dispatch.chains and not full:
        return None
    return _best_peer(orch)


def _best_peer(orch: Any, avoid: str = "") -> Optional[str]:
    """The live orchestrator (not this one, nor ``avoid``) whose group has the most servers per request arriving."""
    groups = orch.groups
    peers = [o for o in groups.json()["orchestrators"] if o["peer_id"] != groups.me and o["live"]
             and o["servers"] > 0 and o["http_url"] and o["http_url"] != avoid and _usable_url(o["http_url"])]
    if not peers:
        return None
    best = max(peers, key=lambda o: (o["servers"] / (o["arrival_rate"] + 0.1), o["peer_id"]))
    return best["http_url"]


@functools.lru_cache(maxsize=1024)
def _usable_url(url: str) -> bool:
    """Whether another orchestrator's ``http_url`` (its group record's) can be sent a request: an http(s) URL with a
    host and a port in range. One that cannot (``http://host:port``, port 99999: from an orchestrator started before
    ``--public-url`` was checked) is never a target: each forward there failed (served here after a warning per
    request, or a 500 for a port out of range), its rerun of a cut stream ended the stream without an error event,
    and it stood in for live orchestrators that could serve. Warned once per URL."""
    try:
        parsed = httpx.URL(url)
        usable = parsed.scheme in ("http", "https") and bool(parsed.host) and (parsed.port is None
                                                                              or 0 < parsed.port < 65536)
        why = "not an http(s) URL with a host and a port in 1-65535"
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        usable, why = False, str(e)
    if not usable:
        logger.warning("another orchestrator's group record names the URL %r (%s): no request is forwarded there",
                       url[:200], why)
    return usable


async def _target_soon(orch: Any, request: Request, arrived: float) -> Optional[str]:
    """:func:`forward_target`; while this orchestrator knows no split yet (it just started) and its group has no
    chain, waiting up to :data:`TARGET_WAIT_S` for a target or a chain (a request queued here waited for this
    group's own chain, ``--no-chain-wait-s`` then 503, while another group could serve it), and never past the
    request's nearer deadline (``arrived``: monotonic; then it is handled here, which drops it at once). None as
    soon as this group has a chain, or the client left."""
    url = forward_target(orch)
    if url is not None or orch.groups is None or orch.dispatch.chains or orch.groups.epoch > 0:
        return url
    deadline_s = first_deadline_s(await request.body(), _key_deadlines(request))
    give_up = arrived + (TARGET_WAIT_S if deadline_s is None else min(TARGET_WAIT_S, deadline_s))
    while time.monotonic() < give_up and not await request.is_disconnected():
        await asyncio.sleep(min(0.25, max(give_up - time.monotonic(), 0.0)))
        if orch.dispatch.chains:
            return None
        if (url := forward_target(orch)) is not None:
            return url
    return None


def _key_deadlines(request: Request) -> dict:
    """The deadlines this client's API key gives a request that names none (``deadline_ms``, ``ttft_deadline_ms``)."""
    defaults = key_defaults(request.scope.get("app"), CLIENT.get())
    return {} if defaults is None else dict(zip(("deadline_ms", "ttft_deadline_ms"), defaults))


def forwardable(orch: Any, headers: Any) -> bool:
    """Whether a request with these headers would be forwarded now (the limits' early refusals let it through)."""
    return FORWARDED_HEADER not in headers and forward_target(orch) is not None


async def maybe_forward(orch: Any, request: Request, url: Optional[str] = None) -> Optional[Response]:
    """The other orchestrator's reply to this request when :func:`forward_target` (or ``url``: a session's owner)
    names one and it answers; None: handle the request here."""
    if FORWARDED_HEADER in request.headers:
        return None
    arrived = time.monotonic()  # a deadline counts from here, the wait for a target included
    url = url or await _target_soon(orch, request, arrived)
    if url is None:
        return None
    body = sent = await request.body()
    if time.monotonic() - arrived > 0.05:  # waited for a target: the deadlines sent on are what is left of them
        try:
            sent = with_time_gone(body, arrived, _key_deadlines(request))
        except DeadlineGone:
            return None  # served (and dropped at its deadline) here
    headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
    headers[FORWARDED_HEADER] = orch.groups.me
    if (rid := current_request_id()) is not None:  # the same id there: one grep finds the request on both
        headers[REQUEST_ID_HEADER] = rid
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), verify=client_tls())
    try:
        upstream = await _reply_head(orch, request, client, client.build_request(
            request.method, url.rstrip("/") + request.url.path, content=sent, headers=headers), url)
    except (httpx.TransportError, httpx.InvalidURL, _Lost) as e:  # InvalidURL: a bad URL in another's group record
        await client.aclose()
        logger.warning("could not forward %s to %s (%s): serving it here", request.url.path, url, e)
        return None
    except BaseException:
        await client.aclose()
        raise
    if upstream.status_code == 503:  # an error object (never a stream): read whole
        try:
            reply = await upstream.aread()
        finally:
            await upstream.aclose()
            await client.aclose()
        try:
            code = (json.loads(reply).get("error") or {}).get("code")
        except (ValueError, AttributeError):
            code = None
        if code == SHUTTING_DOWN:  # it stops (api.ShutdownGate): served here, as if it could not be reached
            logger.info("%s is stopping: serving %s here", url, request.url.path)
            return None
        kept = {k: v for k, v in upstream.headers.items()
                if k.lower() not in _REPLY_HEADERS_DROPPED and k.lower() != "content-encoding"}
        return Response(reply, status_code=503, headers={**kept, SERVED_BY_HEADER: url})
    orch.groups.forwarded += 1
    # the other orchestrator decides admission: pass its reply through as it comes (the API holds a streamed reply
    # until our dispatcher decides, which for a forwarded request it never does: the whole stream was held)
    note_admission(True)
    reply_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _REPLY_HEADERS_DROPPED}
    reply_headers[SERVED_BY_HEADER] = url

    closed = False

    async def close() -> None:  # once; also when the client left before the relay started (its finally never ran)
        nonlocal closed
        if not closed:
            closed = True
            await upstream.aclose()
            await client.aclose()

    if request.method == "POST" and request.url.path.rstrip("/") == "/api/v1/sessions":
        try:  # a session opened there: its later calls here go there too
            reply = await upstream.aread()
        finally:
            await close()
        if (sid := opened_session_id(upstream.status_code, reply)) is not None:
            orch.groups.session_owners.remember(sid, url)
        reply_headers.pop("content-encoding", None)  # read, so decoded
        return Response(reply, status_code=upstream.status_code, headers=reply_headers)

    # the client's own body: a rerun shortens its deadlines itself
    record = StreamRecord.of(request.method, request.url.path, body, upstream.status_code, upstream.headers, arrived,
                             _key_deadlines(request))

    async def relay():
        if record is None:
            async for out in _relay_raw(orch, url, upstream, close):
                yield out
            return
        try:  # whole events only: a cut never leaves half of one with the client
            async for out in relay_events(record, upstream.aiter_raw(), lambda: _live(orch, url)):
                yield out
            cut = "its stream ended early"
        except (httpx.HTTPError, Cut) as e:
            cut = f"{type(e).__name__}: {e}"
        finally:
            await close()
        if record.finished:
            return
        logger.warning("the stream forwarded to %s was cut off (%s): finishing it here", url, cut)

        def where(local_refused: bool) -> tuple[Optional[str], bool]:
            here = getattr(orch, "local_url", None) if orch.dispatch.chains else None
            peer = _best_peer(orch, avoid=url)
            if here is not None and not (local_refused and peer is not None):
                return here, True
            return peer, False

        async for out in finish(record, request.url.path, headers, where, lambda u: _live(orch, u), url):
            yield out
        if record.finished_by is not None:
            orch.groups.resumed += 1

    return StreamingResponse(relay(), status_code=upstream.status_code, headers=reply_headers,
                             background=BackgroundTask(close))


async def _relay_raw(orch: Any, url: str, upstream: httpx.Response, close: Callable[[], Any]):
    """A reply relayed as it comes (a session's stream, a one-shot reply), closed at its end. A sender that stops
    refreshing its group record while its reply is silent is lost (its host gone with the connection open: the relay
    waited for good). An event stream is relayed in whole events, and one cut off ends with an error event; any other
    reply cut off aborts the response."""
    events = is_event_stream(upstream.headers) and "content-encoding" not in upstream.headers
    # a Responses stream relayed as bytes (none today: each gets a record) ends as the SDK reads one:
    # response.failed and an error event, numbered on from the events relayed, under their ids
    responses = (ResponsesRecord({}, 0.0) if events and upstream.request.url.path.rstrip("/").endswith("/v1/responses")
                 else None)
    try:
        async for chunk in ticking(sse_events(upstream.aiter_raw()) if events else upstream.aiter_raw()):
            if chunk is None:
                if not _live(orch, url):
                    raise Cut("it no longer refreshes its group record")
                continue
            if responses is not None:
                responses.take(chunk)  # followed only: the event goes on as it came
            yield chunk
    except (httpx.HTTPError, Cut) as e:
        if not events:
            raise
        logger.warning("the stream forwarded to %s was cut off (%s: %s)", url, type(e).__name__, e)
        message = f"the orchestrator serving this stream ({url}) was lost: {e}"
        yield (responses.ending(503, "stream_cut", message) if responses is not None
               else stream_ending(503, "stream_cut", message))
    finally:  # the other orchestrator cut off too (no background task runs after an error)
        await close()


def _live(orch: Any, url: str) -> bool:
    """Whether the orchestrator at ``url`` still refreshes its group record (one stopped or cut off does not)."""
    return any(o["http_url"] == url and o["live"] for o in orch.groups.json()["orchestrators"])


async def _reply_head(orch: Any, request: Request, client: httpx.AsyncClient, req: httpx.Request,
                      url: str) -> httpx.Response:
    """Send ``req`` and wait for its reply's head. The other orchestrator holds the head until its dispatcher
    decides, and a one-shot reply's until its generation ends, so no wait is too long in itself; a wait on an
    orchestrator that no longer refreshes its group record (stopped, its host gone with the connection open) is:
    :class:`_Lost`."""

    def give_up() -> Optional[str]:
        return None if _live(orch, url) else "it no longer refreshes its group record"

    return await unless_disconnected(request, client.send(req, stream=True), give_up)


async def forward_session_call(orch: Any, request: Request, session_id: str) -> Optional[Response]:
    """A call on a session this orchestrator does not hold but opened elsewhere through a forward: that
    orchestrator's reply (None: not such a session, or its orchestrator cannot be reached)."""
    groups = orch.groups
    url = groups.session_owners.get(session_id) if groups is not None else None
    if url is None or session_id in getattr(orch, "sessions", {}):
        return None
    reply = await maybe_forward(orch, request, url)
    if reply is not None and request.method == "DELETE":
        groups.session_owners.pop(session_id, None)
    return reply
