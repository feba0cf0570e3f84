"""asyncio helpers the roles share."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

logger = logging.getLogger(__name__)

# How long a stream's last reply waits for the client to end the stream (``rpc._linger``) or close its end
# (:func:`hold_after_reply`), in seconds.
LINGER_S = 10.0

# What a write to a stream whose peer has gone ends in.
_PEER_GONE = (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError)

# The largest message read from a P2P stream (bytes). Ours are at most a 1 MiB tensor chunk and 128 KiB of metadata
# (rpc.CHUNK_BYTES, rpc.MAX_METADATA_BYTES); the DHT's RPCs do not come this way (unary, bounded by p2pd).
MAX_STREAM_MESSAGE_BYTES = 4 << 20


class OversizedMessage(asyncio.IncompleteReadError):
    """A peer announced a stream message larger than :data:`MAX_STREAM_MESSAGE_BYTES`: the stream ends there, as
    for a peer gone (hivemind's handlers and :class:`~petals_chain.swarm.rpc.PeerStream` take it so)."""

    def __init__(self, size: int, limit: int):
        super().__init__(b"", size)
        self.size, self.limit = size, limit

    def __str__(self) -> str:
        return f"the peer announced a message of {self.size} bytes (at most {self.limit} are read)"


def bound_stream_messages(limit: int = MAX_STREAM_MESSAGE_BYTES) -> None:
    """Make hivemind's P2P refuse stream messages over ``limit`` bytes before reading them (idempotent).

    hivemind reads a message's announced length, up to 2^64, into memory before anything parses it: one stream of
    any peer (a server's ``rpc_push`` and ``rpc_session`` answer everyone; an orchestrator reads every server's
    replies) made the reader hold 500 MB in 2 s."""
    from hivemind.p2p import P2P

    if getattr(P2P.receive_raw_data, "limit", None) == limit:
        return

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        size = int.from_bytes(header, P2P.BYTEORDER)
        if size > limit:
            raise OversizedMessage(size, limit)
        return await reader.readexactly(size)

    receive_raw_data.limit = limit
    P2P.receive_raw_data = staticmethod(receive_raw_data)


def _coro_name(future: Any) -> str:
    get_coro = getattr(future, "get_coro", None)
    return getattr(get_coro(), "__qualname__", "") if callable(get_coro) else ""


def quiet_peer_disconnects(loop: asyncio.AbstractEventLoop) -> None:
    """Log hivemind's unretrieved "peer gone" stream errors in one DEBUG line instead of an ERROR traceback.

    hivemind's P2P writes a stream handler's replies (and its end of stream) from tasks nobody awaits; when the
    peer has left, each ends in ``ConnectionResetError`` and asyncio logs "Task exception was never retrieved"
    with a traceback (dozens per server churn). A peer leaving mid-stream is normal in a swarm. Anything else still
    reaches the previous handler."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        where = _coro_name(context.get("future"))
        if isinstance(context.get("exception"), _PEER_GONE) and where.startswith("P2P."):
            logger.debug(f"a peer left while {where} wrote to it: {context['exception']!r}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _PeerGoneMidRequest(logging.Filter):
    """hivemind's stream handlers log a WARNING with a traceback when the peer of a stream they serve leaves
    mid-request: p2pd resets the stream, and the read of the next request (or the handler) ends in
    ``ConnectionResetError`` (2 tracebacks in a 150-stream storm of dropped clients). A client leaving is normal in a
    swarm (its end of a broken write is DEBUG in hivemind already): one DEBUG line naming the error instead. Any
    other error keeps its WARNING and traceback."""

    MESSAGES = {"Exception while receiving requests:": "reading its next request",
                "Handler failed with the exception:": "in the handler"}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        where = self.MESSAGES.get(record.msg) if isinstance(record.msg, str) else None
        if where is None or not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            return True
        record.msg, record.args = f"a peer left mid-request ({where}): {type(exc).__name__}: %s", (exc,)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_stream_peers_gone() -> None:
    """Log a peer that leaves a stream hivemind serves mid-request in one DEBUG line (:class:`_PeerGoneMidRequest`),
    and stop writing a message to a stream whose connection is lost (idempotent).

    hivemind writes a message in 64 KiB chunks before it waits for any: past the fifth write to a lost connection
    asyncio logs "socket.send() raised exception." as a WARNING for each (a storm of 150 clients dropped while 3 MiB
    replies went out: 6,900 lines; a server's 1 MiB reply chunk, 11). The write ends at the first such chunk with the
    ``ConnectionResetError`` its drain raised anyway."""
    from hivemind.p2p import P2P

    hivemind_p2p = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(f, _PeerGoneMidRequest) for f in hivemind_p2p.filters):
        hivemind_p2p.addFilter(_PeerGoneMidRequest())
    if getattr(P2P.send_raw_data, "stops_when_lost", False):
        return

    async def send_raw_data(data: bytes, writer: asyncio.StreamWriter, *, chunk_size: int = 2**16) -> None:
        transport = getattr(writer, "transport", None)
        writer.write(len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        view = memoryview(data)
        for offset in range(0, len(view), chunk_size):
            if transport is not None and transport.is_closing():
                raise ConnectionResetError("the stream's connection was lost while a message was written")
            writer.write(view[offset:offset + chunk_size])
        await writer.drain()

    send_raw_data.stops_when_lost = True
    P2P.send_raw_data = staticmethod(send_raw_data)


async def hold_after_reply(timeout_s: float) -> None:
    """After a one-message call's reply (ping, info, dial-back): keep the stream until the client closes its end
    (hivemind then cancels the handler), at most ``timeout_s``. A handler that returns closes its end at once, and
    p2pd's reset of the stream can discard the reply in flight (:func:`petals_chain.swarm.rpc._linger`); hivemind
    has read the request stream to its end before calling the handler, so there is nothing left to read here."""
    if timeout_s > 0:
        await asyncio.sleep(timeout_s)


async def outlast(fut: asyncio.Future) -> None:
    """Wait until ``fut`` is done, whatever cancellations come meanwhile (work that cannot be stopped, e.g. in a
    thread, still owns what it writes until it ends); its exception is read, not raised."""
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            pass
    if not fut.cancelled():
        fut.exception()


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """Like :func:`asyncio.gather`, but the first failure cancels the others (and waits for them) before it is
    raised: one part of a request failing leaves nothing of the request running (gather lets the rest run on)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
