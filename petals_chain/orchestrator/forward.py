"""Forwarding between the orchestrators of one swarm (``--group-with``): a request this orchestrator's group cannot
take now (no chain, or the queue at ``--max-queue``) goes to another orchestrator's group instead of failing.

A forwarded request carries :data:`FORWARDED_HEADER` and is never forwarded again (no loops); its reply, streamed
or not, is passed back as the other orchestrator sent it (status, body and headers), with :data:`SERVED_BY_HEADER`
naming it. If the other orchestrator cannot be reached, or stops refreshing its group record while the request
waits, this one handles the request itself (and answers 503 or 429 as it would have). A streamed completion the other
orchestrator cuts off mid-way (it died) is finished from here when its output is reproducible (greedy, or seeded): run
again here once this group has a chain (or on a third orchestrator), its events relayed without the text the client
already has, so an OpenAI client of this orchestrator sees one whole stream (:class:`_Delivered`). A session opened
through a forward lives on the other orchestrator: its later calls here are forwarded there (:attr:`SessionOwners`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from petals_chain.orchestrator.dispatch import note_admission
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.sampling import GREEDY_BELOW_TEMPERATURE

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-petals-chain-forwarded-by"  # value: the peer id of the orchestrator that forwarded it
SERVED_BY_HEADER = "x-petals-chain-served-by"  # value: the URL of the orchestrator that served it
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-api-key")
# the other orchestrator's reply headers not passed back: hop-by-hop ones, and those the relay sets itself (the body
# goes on as it came, still encoded: its content-encoding stays)
_REPLY_HEADERS_DROPPED = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "upgrade", "trailer", "te", "proxy-authenticate", "proxy-authorization"}
MAX_SESSION_OWNERS = 10_000
RESUME_S = 60.0  # how long a cut forwarded stream looks for somewhere to finish (a lost group moves within ~30 s)
RESUME_PAUSE_S = 1.0  # between its tries
# A stream this process resumes on itself is already counted in its client's requests under way: the header, with a
# secret only this process knows, lets it past the per-client cap once more (limits.py); forged, it is ignored.
RESUME_HEADER = "x-petals-chain-resume"
_RESUME_SECRET = secrets.token_urlsafe(24)
_RESUMABLE_PATHS = ("/v1/completions", "/v1/chat/completions")


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
             and o["servers"] > 0 and o["http_url"] and o["http_url"] != avoid]
    if not peers:
        return None
    best = max(peers, key=lambda o: (o["servers"] / (o["arrival_rate"] + 0.1), o["peer_id"]))
    return best["http_url"]


def is_resume(headers: Any) -> bool:
    """Whether a request is this process resuming a cut forwarded stream on itself (see :data:`RESUME_HEADER`)."""
    return hmac.compare_digest(headers.get(RESUME_HEADER, ""), _RESUME_SECRET)


def forwardable(orch: Any, headers: Any) -> bool:
    """Whether a request with these headers would be forwarded now (the limits' early refusals let it through)."""
    return FORWARDED_HEADER not in headers and forward_target(orch) is not None


async def maybe_forward(orch: Any, request: Request, url: Optional[str] = None) -> Optional[Response]:
    """The other orchestrator's reply to this request when :func:`forward_target` (or ``url``: a session's owner)
    names one and it answers; None: handle the request here."""
    if FORWARDED_HEADER in request.headers:
        return None
    url = url or forward_target(orch)
    if url is None:
        return None
    headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
    headers[FORWARDED_HEADER] = orch.groups.me
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
    try:
        upstream = await _reply_head(orch, request, client, client.build_request(
            request.method, url.rstrip("/") + request.url.path, content=await request.body(), headers=headers), url)
    except (httpx.TransportError, _Lost) as e:
        await client.aclose()
        logger.warning("could not forward %s to %s (%s): serving it here", request.url.path, url, e)
        return None
    except BaseException:
        await client.aclose()
        raise
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
            body = await upstream.aread()
        finally:
            await close()
        if (sid := opened_session_id(upstream.status_code, body)) is not None:
            orch.groups.session_owners.remember(sid, url)
        reply_headers.pop("content-encoding", None)  # read, so decoded
        return Response(body, status_code=upstream.status_code, headers=reply_headers)

    body = await request.body()
    delivered = _Delivered.of(request, body, upstream)

    async def relay():
        if delivered is None:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # the other orchestrator cut off too (no background task runs after an error)
                await close()
            return
        try:  # whole events only: a cut never leaves half of one with the client
            async for event in _events(upstream.aiter_raw()):
                if (out := delivered.take(event)) is not None:
                    yield out
            cut = "its stream ended early"
        except httpx.HTTPError as e:
            cut = f"{type(e).__name__}: {e}"
        finally:
            await close()
        if not delivered.finished:
            logger.warning("the stream forwarded to %s was cut off (%s): finishing it here", url, cut)
            async for out in _resume(orch, request.url.path, body, headers, delivered, url):
                yield out

    return StreamingResponse(relay(), status_code=upstream.status_code, headers=reply_headers,
                             background=BackgroundTask(close))


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


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (each with its blank-line end) from a byte stream; a partial last one is dropped."""
    buf = b""
    async for chunk in chunks:
        buf += chunk.replace(b"\r\n", b"\n")
        while (end := buf.find(b"\n\n")) >= 0:
            yield buf[:end + 2]
            buf = buf[end + 2:]


class _Delivered:
    """What a relayed completion stream gave its client: each choice's text so far, and whether it ended (its
    ``[DONE]`` or an error event). A run of the same request elsewhere goes through :meth:`take` too: its events are
    passed on without the text already delivered (checked equal: a reproducible output repeats), under the first
    run's id."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}  # choice index -> text delivered
        self.opened: set[int] = set()  # choices with an event delivered (a chat stream's role event comes once)
        self.ended: set[int] = set()  # choices whose finish_reason was delivered
        self.at: dict[int, int] = {}  # this run: choice index -> characters of its text seen so far
        self.head: dict[str, Any] = {}  # the first run's id and created time
        self.rerun = False  # events now come from a run of the request elsewhere
        self.reproducible = False
        self.finished = False

    @classmethod
    def of(cls, request: Request, body: bytes, upstream: httpx.Response) -> Optional["_Delivered"]:
        """A tracker when this forwarded reply is a stream that could be run again to the same text, else None."""
        if (request.method != "POST" or request.url.path.rstrip("/") not in _RESUMABLE_PATHS
                or upstream.status_code != 200 or "content-encoding" in upstream.headers
                or not upstream.headers.get("content-type", "").startswith("text/event-stream")):
            return None
        try:
            req = json.loads(body)
            if not isinstance(req, dict) or req.get("stream") is not True:
                return None
            greedy = float(req.get("temperature", 1.0)) < GREEDY_BELOW_TEMPERATURE or float(req.get("top_p", 1.0)) == 0
        except (ValueError, TypeError):
            return None
        tracker = cls()
        tracker.reproducible = greedy or req.get("seed") is not None
        return tracker

    def restart(self) -> None:
        """Another run of the request begins: its text is matched against what was delivered from the start."""
        self.at = {}
        self.rerun = True

    def take(self, event: bytes) -> Optional[bytes]:
        """The event to pass on (trimmed of text the client has), or None; raises :class:`_Mismatch`."""
        payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if payload == b"[DONE]":
            self.finished = True
            return event
        try:
            obj = json.loads(payload)
        except ValueError:
            return None if self.rerun else event  # comments and keep-alives: the first run's only
        if not isinstance(obj, dict):
            return None if self.rerun else event
        if "error" in obj:
            self.finished = True
            return event
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "created") if k in obj}
        kept = [c for c in obj.get("choices") or [] if isinstance(c, dict) and self._trim(c)]
        if not self.rerun:
            return event
        if not kept and not obj.get("usage"):
            return None
        return _sse_bytes({**obj, **self.head, "choices": kept})

    def _trim(self, choice: dict) -> bool:
        """Cut from ``choice`` the text already delivered; whether anything of it is left to send."""
        i = choice.get("index", 0)
        delta = choice.get("delta")
        holder, key = (delta, "content") if isinstance(delta, dict) else (choice, "text")
        text = holder.get(key) or ""
        at, have = self.at.get(i, 0), self.text.get(i, "")
        seen = min(len(text), max(0, len(have) - at))
        if text[:seen] != have[at:at + seen]:
            raise _Mismatch(f"choice {i}: the run here gave {text[:seen]!r} where the client had {have[at:at + seen]!r}")
        self.at[i] = at + len(text)
        self.text[i] = have + text[seen:]
        ends = choice.get("finish_reason") is not None
        if self.rerun:
            if i in self.ended or (not text[seen:] and not ends and i in self.opened):
                return False  # all of it delivered (a chat stream's role event, an end) by the run before
            if seen:
                holder[key] = text[seen:]
                if choice.get("logprobs"):
                    choice["logprobs"] = None  # an event cut in two: its tokens' logprobs cannot split by characters
        self.opened.add(i)
        if ends:
            self.ended.add(i)
        return True


class _Mismatch(Exception):
    """A run of a request elsewhere did not repeat the text the client already has."""


def _sse_bytes(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _error_event(status: int, code: str, message: str) -> bytes:
    return _sse_bytes({"error": {"message": message, "type": "server_error", "param": None, "code": code,
                                 "status": status}}) + b"data: [DONE]\n\n"


def _resume_target(orch: Any, lost: str) -> tuple[Optional[str], bool]:
    """Where to run a cut stream again now: ``(url, is_this_orchestrator)``; this one once its group has a chain."""
    if orch.dispatch.chains and getattr(orch, "local_url", None):
        return orch.local_url, True
    return _best_peer(orch, avoid=lost), False


async def _resume(orch: Any, path: str, body: bytes, headers: dict, delivered: _Delivered,
                  lost: str) -> AsyncIterator[bytes]:
    """The rest of a forwarded stream cut off by ``lost``: the request run again (here, or on another orchestrator)
    for up to :data:`RESUME_S`, relayed through ``delivered``; an error event if it cannot be finished."""
    if not delivered.reproducible:
        yield _error_event(503, "stream_cut", f"the orchestrator serving this stream ({lost}) was lost, and the "
                                              "stream cannot be finished elsewhere: it samples without a seed")
        return
    give_up = time.monotonic() + RESUME_S
    why = "no orchestrator with a chain"
    while True:
        url, here = _resume_target(orch, lost)
        if url is not None:
            sent = {**headers, FORWARDED_HEADER: orch.groups.me, **({RESUME_HEADER: _RESUME_SECRET} if here else {})}
            delivered.restart()
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), verify=not here) as client:
                    async with client.stream("POST", url.rstrip("/") + path, content=body, headers=sent) as r:
                        if r.status_code != 200:
                            reply = await r.aread()
                            if r.status_code not in (429, 502, 503, 504):
                                yield _error_event(r.status_code, "resume_refused", "the stream was cut off and its "
                                                   f"rerun at {url} was refused: {reply[:300].decode(errors='replace')}")
                                return
                            why = f"{url}: HTTP {r.status_code}"
                        else:
                            async for event in _events(r.aiter_raw()):
                                if _unavailable_event(event):  # that group lost its chain too: try again
                                    why = f"{url}: no chain"
                                    break
                                if (out := delivered.take(event)) is not None:
                                    yield out
                                if delivered.finished:
                                    logger.info("a cut forwarded stream was finished by %s", url)
                                    orch.groups.resumed += 1
                                    return
            except _Mismatch as e:
                logger.error("a cut forwarded stream could not be finished: %s", e)
                yield _error_event(502, "resume_mismatch", "the stream was cut off and its rerun gave another text "
                                                            f"than the one already sent ({e})")
                return
            except httpx.HTTPError as e:
                why = f"{url}: {type(e).__name__}: {e}"
        if time.monotonic() >= give_up:
            yield _error_event(503, "stream_cut", f"the orchestrator serving this stream ({lost}) was lost and "
                                                  f"no other could finish it within {RESUME_S:.0f} s ({why})")
            return
        await asyncio.sleep(RESUME_PAUSE_S)


def _unavailable_event(event: bytes) -> bool:
    """Whether an event is a 503 error (the run found no chain), which another try may get past."""
    if b'"error"' not in event:
        return False
    try:
        err = json.loads(event.split(b"data:", 1)[1]).get("error") or {}
    except (ValueError, IndexError, AttributeError):
        return False
    return err.get("status") == 503
