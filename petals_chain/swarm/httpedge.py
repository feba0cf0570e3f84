"""HTTP at the edges of the protocol, for the orchestrator's API and the dashboard (ASGI middlewares).

* :class:`HeadAsGet`: ``HEAD`` answered as ``GET`` without the body (RFC 9110 §9.3.2). FastAPI routes a GET route for
  GET alone: ``HEAD /healthz`` (``curl -I``, an uptime monitor's check) was a 405.
* :class:`DecodedBody`: a request body sent with ``Content-Encoding: gzip`` or ``deflate`` is decoded as the app reads
  it, bounded by the body limit once decoded (a small body that inflates to gigabytes is cut at the limit, a 413)
  and to :data:`MAX_GZIP_MEMBERS` gzip members (a 400 past them); another coding is a 415 naming the ones taken, with
  ``Accept-Encoding`` (RFC 9110 §12.5.3). The coding was ignored: a gzip body was "not valid JSON: it is not UTF-8
  text".
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Awaitable, Callable, Optional

from starlette.exceptions import HTTPException

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

CODINGS = ("gzip", "deflate")  # what DecodedBody decodes (``x-gzip`` is gzip: RFC 9110 §8.4.1.3)
ACCEPT_ENCODING = ", ".join(CODINGS)
DECODED_CHUNK = 64 * 1024  # the most one receive() hands on: one compressed message inflates by at most this much
# gzip members one body may have (``cat a.gz b.gz``): each costs a decompressor and a copy of the message's rest, so
# a body of tiny ones (21 bytes each, 400,000 in 8 MiB) held the event loop for seconds while it decoded to nothing
MAX_GZIP_MEMBERS = 64
_BODY_METHODS = ("POST", "PUT", "PATCH")


class BodyDecodeError(HTTPException):
    """A coded body that cannot be read (400 ``invalid_content_encoding``) or is past the limit once decoded (413
    ``body_too_large``): an HTTP exception, so that FastAPI's body parsing passes it on to the app's handler, which
    answers with ``code``; raised past the app (a layer that read the body itself), :class:`DecodedBody` answers it."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(status, message)
        self.code = code


class HeadAsGet:
    """``HEAD`` runs as ``GET``, its response's body dropped (headers and status as GET's, Content-Length too). The
    app runs on a copy of the scope whose method is GET: the server and the layers outside see HEAD throughout, and
    what the layers inside set in the scope (the route, the client admitted) is copied back once the app is done."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def bodiless(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": b""}
            await send(message)

        # not in place: uvicorn's httptools protocol frames the response by the method it reads there as the response
        # goes out (set to GET, it waited for GET's body: "Response content shorter than Content-Length" per HEAD)
        inner = {**scope, "method": "GET"}
        try:
            await self.app(inner, receive, bodiless)
        finally:
            scope.clear()
            scope.update(inner, method="HEAD")


def _codings(scope: Scope) -> list[str]:
    """The content codings of the request, in the order applied (``identity`` left out), lower case."""
    out: list[str] = []
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-encoding":
            out += [c.strip().lower() for c in v.decode("latin-1").split(",")]
    return [{"x-gzip": "gzip"}.get(c, c) for c in out if c and c != "identity"]


class _Inflater:
    """Decodes one body coded with ``coding`` chunk by chunk, at most :data:`DECODED_CHUNK` bytes per call; a gzip
    body of several members (``cat a.gz b.gz``) is read whole, up to :data:`MAX_GZIP_MEMBERS` of them."""

    def __init__(self, coding: str):
        self.coding = coding
        self.d: Optional[Any] = None  # the decompressor, made at the first bytes (deflate: zlib-wrapped or raw)
        self.pending = b""  # compressed bytes not decoded yet
        self.draining = False  # the last call filled its chunk: zlib may hold more output with no input left
        self.members = 0  # streams begun (gzip members; deflate has one)

    def _new(self, head: bytes) -> Any:
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # "deflate" is the zlib format (RFC 9110 §8.4.1.2), but some clients send raw deflate: told by the header
        zlib_wrapped = len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes) -> None:
        self.pending += data

    def take(self) -> bytes:
        """Decoded bytes from what was fed (b"": it needs more input)."""
        while self.pending or self.draining:
            if self.d is None:
                if self.members and self.coding != "gzip":  # its stream ended with the last message: bytes after it
                    raise zlib.error("data after the end of the compressed stream")
                if self.coding == "deflate" and len(self.pending) < 2:
                    return b""
                self.members += 1
                if self.members > MAX_GZIP_MEMBERS:
                    raise BodyDecodeError(400, "invalid_content_encoding", f"the request body has more than "
                                          f"{MAX_GZIP_MEMBERS} gzip members (Content-Encoding: gzip): compress it as "
                                          "one")
                self.d = self._new(self.pending)
            out = self.d.decompress(self.pending, DECODED_CHUNK)
            self.pending = self.d.unconsumed_tail
            self.draining = len(out) == DECODED_CHUNK and not self.d.eof
            if self.d.eof:
                rest, self.d = self.d.unused_data, None
                if self.coding != "gzip" and rest:
                    raise zlib.error("data after the end of the compressed stream")
                self.pending = rest + self.pending
            if out:
                return out
        return b""

    def finish(self) -> None:
        """The body ended: raises if its last stream is cut short."""
        if self.d is not None or self.pending:
            raise zlib.error("the compressed body ends in the middle of its stream")


class DecodedBody:
    """Decodes a request body sent with a content coding of :data:`CODINGS` (see the module); ``limit()``: the most
    bytes it may decode to. Nothing is read until a layer inside asks for the body: a request refused unread (no API
    key, a Content-Length past the limit, which is kept for that) stays unread. Its ``Content-Encoding`` and
    ``Content-Length`` headers are removed: what the layers inside read is the decoded body."""

    def __init__(self, app: Any, limit: Callable[[], int]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        codings = _codings(scope)
        if not codings:
            return await self.app(scope, receive, send)
        if len(codings) > 1 or codings[0] not in CODINGS:
            shown = ", ".join(codings)[:100]
            return await _answer(send, 415, "unsupported_content_encoding",
                                 f"Content-Encoding {shown!r} is not supported: send the body as it is, or with one "
                                 f"of {ACCEPT_ENCODING}", [(b"accept-encoding", ACCEPT_ENCODING.encode())])
        limit = int(self.limit())
        coding = codings[0]
        declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), b"")
        keep_length = declared.isdigit() and int(declared) > limit  # refused unread inside, as any such body
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-encoding"
                            and (keep_length or k.lower() != b"content-length")]
        started = False

        async def tracking(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _decoding(receive, coding, limit), tracking)
        except BodyDecodeError as e:  # raised through a layer that read the body itself (the limits, a router)
            if started:
                raise
            await _answer(send, e.status_code, e.code, str(e.detail))


def _decoding(receive: Receive, coding: str, limit: int) -> Receive:
    """``receive`` with the body decoded from ``coding``; :class:`BodyDecodeError` for a bad one or one that decodes
    past ``limit`` bytes."""
    inflater = _Inflater(coding)
    total = wire = 0  # bytes decoded, bytes received
    ended = False  # the client's body has all come
    delivered = False  # and its decoded end was handed on: what follows is the client's own (a disconnect)

    async def decoded() -> dict:
        nonlocal total, wire, ended, delivered
        while not delivered:
            try:
                out = inflater.take()
                if not out and ended:
                    inflater.finish()
            except zlib.error as e:
                raise BodyDecodeError(400, "invalid_content_encoding",
                                      f"the request body is not valid {coding} data (Content-Encoding: {coding}): "
                                      f"{e}") from None
            total += len(out)
            if total > limit or wire > limit:  # the coded bytes too: empty gzip members decode to nothing
                raise BodyDecodeError(413, "body_too_large", f"the request body is larger than {limit} bytes"
                                      f"{' once decoded' if total > limit else ''} (Content-Encoding: {coding})")
            if out or ended:
                delivered = ended and not out
                return {"type": "http.request", "body": out, "more_body": not delivered}
            message = await receive()
            if message.get("type") != "http.request":
                return message  # a disconnect: on to the app as it came
            inflater.feed(message.get("body", b""))
            wire += len(message.get("body", b""))
            ended = not message.get("more_body", False)
        return await receive()

    return decoded


async def _answer(send: Send, status: int, code: str, message: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
