"""Server RPC over hivemind P2P: one bidirectional stream per (job, server) session, plus ping and info.

Wire protocol (the handler class name ``PetalsChainBlocks`` is part of it; handles are
``PetalsChainBlocks.rpc_session``, ``.rpc_ping``, ``.rpc_info``). Messages are hivemind
``runtime_pb2.ExpertRequest`` / ``ExpertResponse``; control fields travel msgpack-encoded in ``metadata``;
tensors travel uncompressed (``USE_LEGACY_BFLOAT16 = False``: bf16 stays 2 bytes) and are split into
``CHUNK_BYTES`` chunks so that no message exceeds the P2P message limit.

Session stream, client -> server:
  1. ``{"op": "open", "session_id", "start_block", "end_block", "max_length"[, "wait_s"][, "fork_from",
     "fork_length"][, "prefix_hashes"][, "model"][, "adapter"]}`` -> ``{"ok": true, ...}`` or an error, after which
     the client ends the stream (the server waits up to ``LINGER_S`` for it, then ends it). ``model``: the
     fingerprint of the model the client means; a server serving another one (it offers several and was placed on
     another) refuses with ``unavailable``. ``adapter``: the adapter fingerprint (:mod:`~petals_chain.swarm.lora`)
     of the LoRA adapter the session's steps use (absent: the base model); a server that does not serve it (its
     record's ``adapters`` does not list it) refuses with ``unavailable``, and a fork must name its source's.
     ``prefix_hashes`` names the prompt (:mod:`~petals_chain.swarm.prefix`): the reply's ``cached_tokens`` says
     how many of its tokens the server's prefix cache holds in every block of the span (the session starts holding
     them; its first step may start there or earlier). With
     ``wait_s > 0`` a server without free slots queues the open (FIFO, bounded) for up to ``wait_s`` seconds
     instead of refusing it; the client sends nothing until the reply, and ending the stream meanwhile
     withdraws it. With ``heartbeat_s`` too (to servers whose record says ``open_heartbeats``), a queued
     open is answered every ``heartbeat_s`` seconds with ``{"ok": true, "waiting": true, "waited_s"}`` until
     the real reply, so the client can tell a long wait from a lost stream. ``fork_from`` names an open
     session of the same peer and span: the new session starts with a copy of its first ``fork_length``
     cached tokens (no wait; not with ``wait_s``).
  2. ``{"op": "step", "position"}`` + the first chunk of hidden ``[1, n, hidden]`` (further chunks follow
     as messages with only ``tensors``) -> ``{"ok": true, "position"}`` + output chunks, or an error reply
     (the session survives an error reply; nothing changed). A step past the session's ``max_length`` is refused
     from its first message (its chunks are read and dropped, not kept).
  3. ``{"op": "keepalive"}`` -> ``{"ok": true, "keepalive": true}``: nothing but a reset of the idle timer, for
     a session the client holds between turns.
  4. ``{"op": "extend", "max_length"}`` -> ``{"ok": true, "max_length"}``: the session may hold up to
     ``max_length`` tokens from now on (a paged KV cache takes the pages at once), or ``no_capacity`` and the
     session stays as it was.
  5. ``{"op": "close"[, "prefix_hashes"]}`` -> ``{"ok": true, "closed": true}``; the client ends the stream (as
     after an error reply to an open: a server closing right after its last reply could lose it, see ``_linger``).
     ``prefix_hashes`` names the tokens the session holds: its full pages among them stay cached.
The open reply announces ``idle_timeout_s``: the server frees the session's slots when the stream ends for
any reason: close, client disconnect, or no *valid* message (open, step, extend, keepalive) for ``idle_timeout_s``
(an error reply does not reset that timer, so garbage cannot hold slots). A peer the server does not trust
gets ``untrusted`` (after its first message, or ``UNTRUSTED_READ_S`` of silence) and the stream ends.
Error replies are ``{"ok": false, "code", "error"}`` with code ``no_capacity`` | ``untrusted`` | ``invalid``
| ``unavailable`` | ``idle_timeout`` | ``internal`` | ``no_push`` (a ``pushed`` step whose input no push brought
within the server's push timeout; servers before that code said ``unavailable``, "no push for step ...")
| ``stranger_quota`` (an untrusted peer over its share of the server's KV cache, see server/admission.py).
A code that refines one older clients know travels as that one, the refinement in ``"reason"`` (``REFINED_CODES``:
``stranger_quota`` as ``no_capacity``, which every client waits on; clients read ``reason`` back), so an older
client acts on what it knows. Either side ignores fields it does not know (a newer peer's), and a field an older
peer does not send takes its documented default.

The client checks every step reply against what it sent (one tensor of the same shape and dtype, finite,
in no more chunks than its size allows): anything else raises :class:`InvalidReply` and ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Union

import torch
import hivemind.compression.base
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from petals_chain.swarm.aio import (LINGER_S, OversizedMessage, bound_stream_messages, hold_after_reply,
                                    quiet_stream_peers_gone)
from petals_chain.swarm.prefix import HASH_BYTES, PREFIX_BLOCK_TOKENS, split_hashes
from petals_chain.swarm.push import PushBox, RouteError, check_route, check_token, tensor_digest


hivemind.compression.base.USE_LEGACY_BFLOAT16 = False  # bf16 travels as bf16, not as fp32
bound_stream_messages()  # a peer's message is refused unread past 4 MiB, both ways (see the function)
quiet_stream_peers_gone()  # a client leaving a stream mid-request is one DEBUG line, not a WARNING traceback

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # 1 MiB per message, far below hivemind's 4 MiB limit
MAX_METADATA_BYTES = 1 << 17  # 128 KiB: prefix hashes of 128k tokens
MIN_CHUNK_BYTES = 1024  # a sender may use smaller chunks than ours, but not absurdly many
MAX_CHUNKS = 4096
MAX_TENSOR_BYTES = 1 << 31  # 2 GiB per step; the server's max_length bounds it further
ALLOWED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_MAX_SESSION_ID = 256
UNTRUSTED_READ_S = 0.5  # how long the first message of an untrusted peer is awaited before it is refused
# A queued open's heartbeats (s): what clients ask for, and the bounds a server keeps the asked period within.
OPEN_HEARTBEAT_S = 5.0
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.5, 60.0  # the floor bounds what a peer's many queued opens make us send
# Silence after which a client gives up on a queued open that heartbeats: this many periods, plus a grace (s) for a
# loaded server's event loop.
HEARTBEATS_MISSED = 3
LOG_WAIT_S = 1.0  # a queued open that waited this long (or did not end served) is logged by the server


NO_PUSH = "no_push"  # the error code of a pushed step that got no push (see the module docstring)
# Codes sent as a code older clients know, with the code itself in "reason". stranger_quota: orchestrators before it
# read an unknown code as a failed server (a failover counted, the job given up with 503 after the failover budget)
# where no_capacity makes them wait or preempt. (no_push needs none: older orchestrators match its text.)
REFINED_CODES = {"stranger_quota": "no_capacity"}


class RemoteError(RuntimeError):
    """The server refused a request or rejected a message; ``code`` says why (see module docstring)."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code

    @property
    def no_push(self) -> bool:
        """A ``pushed`` step refused for want of its push: code ``no_push``, or an older server's ``unavailable``
        whose text says it (before the code existed)."""
        return self.code == NO_PUSH or (self.code == "unavailable" and str(self).startswith("no push for step"))


class NoCapacityError(RemoteError):
    """The server has fewer free cache slots than the session needs (code ``no_capacity``), or than it lets this
    peer hold (``stranger_quota``: an untrusted peer over its share; full for it until its own sessions close)."""

    def __init__(self, message: str, code: str = "no_capacity"):
        super().__init__(message, code)


class InvalidReply(ConnectionError):
    """The server's reply breaks the protocol (shape, dtype, NaN/inf, chunking): the server is faulty or hostile,
    and the stream is no longer usable."""


class RefusedError(Exception):
    """Raised by a :class:`SessionBackend` to refuse a request with an error ``code``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class _InconsistentChunks(RefusedError):
    """The announced chunking contradicts the first chunk itself."""


class SessionBackend(Protocol):
    """What the RPC handler needs from the server (implemented by ``petals_chain.server``)."""

    hidden_size: int

    def authorize(self, peer_id: str) -> bool: ...

    def open_session(self, session_id: str, start_block: int, end_block: int, max_length: int, peer_id: str,
                     fork_from: Optional[str] = None, fork_length: int = 0, **prefix: Any) -> dict:
        """Reserve slots (copying ``fork_from``'s first ``fork_length`` tokens of KV) or raise RefusedError;
        returns extra fields for the open reply. ``prefix``: ``prefix_hashes`` (a list of hashes) when the
        client named its prompt, ``push=True`` when the open carries a ``push_token`` (the session takes
        pushes: it holds a push relay's streams too), and ``adapter`` (a LoRA adapter fingerprint) when it names
        one."""

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run the session's blocks; raise RefusedError('invalid', ...) for bad input (state unchanged)."""

    def extend_session(self, session_id: str, max_length: int) -> dict:
        """Raise the session's token limit to ``max_length`` or raise RefusedError (``no_capacity``: unchanged);
        returns extra fields for the reply, ``max_length`` (the limit now) among them."""

    def close_session(self, session_id: str, **prefix: Any) -> None:
        """Free the session (``prefix_hashes``, when given: keep its full pages among them cached)."""

    def info(self) -> dict: ...


def _pack(meta: dict) -> bytes:
    return MSGPackSerializer.dumps(meta)


def _unpack(raw: bytes) -> dict:
    if len(raw) > MAX_METADATA_BYTES:
        raise RefusedError("invalid", f"metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        meta = MSGPackSerializer.loads(raw) if raw else {}
    except Exception as e:  # noqa: BLE001
        raise RefusedError("invalid", f"metadata is not msgpack: {e}") from None
    if not isinstance(meta, dict):
        raise RefusedError("invalid", "metadata must be a msgpack map")
    return meta


def _error(code: str, message: str) -> runtime_pb2.ExpertResponse:
    base = REFINED_CODES.get(code)
    reason = {"code": base, "reason": code} if base is not None else {"code": code}
    return runtime_pb2.ExpertResponse(metadata=_pack({"ok": False, **reason, "error": str(message)[:2000]}))


def _int_field(meta: dict, name: str, lo: int = 0, hi: int = 1 << 40) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not (lo <= value <= hi):
        raise RefusedError("invalid", f"field {name!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _hashes_field(meta: dict, max_tokens: int) -> dict:
    """``{"prefix_hashes": [...]}`` from the optional field (at most one hash per 16 tokens of ``max_tokens``),
    or ``{}``."""
    blob = meta.get("prefix_hashes")
    if blob is None:
        return {}
    try:
        hashes = split_hashes(blob)
    except ValueError as e:
        raise RefusedError("invalid", f"field 'prefix_hashes': {e}") from None
    if len(hashes) > max_tokens // PREFIX_BLOCK_TOKENS:
        raise RefusedError("invalid", f"field 'prefix_hashes': {len(hashes)} hashes for at most {max_tokens} tokens")
    return {"prefix_hashes": hashes} if hashes else {}


def serialize_chunks(tensor: torch.Tensor) -> list[runtime_pb2.Tensor]:
    """Serialize a tensor uncompressed and split it into message-sized chunks."""
    serialized = serialize_torch_tensor(tensor.detach().cpu().contiguous(), runtime_pb2.CompressionType.NONE)
    return list(split_for_streaming(serialized, CHUNK_BYTES))


_STILL_WAITING = object()  # a queued open's wait went on past one heartbeat period


def heartbeat_period(asked_s: float) -> float:
    """The heartbeat period a server keeps for an open asking ``asked_s`` (s)."""
    return min(max(float(asked_s), MIN_HEARTBEAT_S), MAX_HEARTBEAT_S)


def _withdraw_open(backend: Any, opening: asyncio.Future, reading: Optional[asyncio.Future], sid: str) -> None:
    """Give up a queued open (the client left, or the stream broke): its read (if given) and its wait are
    cancelled, and slots allocated at that very moment are released (a wait cancelled later releases its own, see
    :meth:`SlotWaitQueue.acquire`)."""
    if reading is not None:
        reading.cancel()
    if not opening.cancel() and not opening.cancelled() and opening.exception() is None:
        backend.close_session(sid)


async def _linger(stream: AsyncIterator, pending: Optional[asyncio.Future], timeout_s: float) -> None:
    """After a stream's last reply: read and drop what the client still sends until it ends the stream, at most
    ``timeout_s``. A handler that returns closes its end at once, and the P2P daemons then reset the stream, which
    can discard the reply still in flight (measured: 1 in ~40,000 refused opens on loopback, more on a loaded
    host; the client saw a silent server until its timeout). The client, having read the reply, ends it first.
    ``pending``: a read of the stream already begun."""
    if timeout_s <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(Exception):  # the end of the stream, the deadline, a broken stream: over either way
        if pending is not None and not pending.cancelled():
            await asyncio.wait_for(pending, timeout_s)
        while True:
            await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - loop.time()))


def _log_wait(sid: str, peer: str, waited_s: float, outcome: str) -> None:
    """One line per queued open that waited long, or waited at all and did not end served: which opens a server
    saw, and how each ended, is what tells a lost reply from a lost request afterwards (a refusal at once, e.g. a
    full queue, is answered in the same round trip and not logged: an overload would flood the log)."""
    if waited_s >= LOG_WAIT_S or (outcome != "served" and waited_s >= 0.1):
        logger.info(f"open {sid} of {peer[:12]} waited {waited_s:.1f} s for slots: {outcome}")


class PetalsChainBlocks(ServicerBase):
    """The server's RPC handler (``await handler.add_p2p_handlers(p2p)``)."""

    def __init__(self, backend: SessionBackend, *, idle_timeout_s: float = 120.0, push_timeout_s: float = 30.0,
                 open_heartbeats: bool = True, linger_s: float = LINGER_S,
                 push_fault: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.backend = backend
        self.push_fault = push_fault  # chaos runs only: corrupts what is pushed on, not the reply (emulated.py)
        self.linger_s = linger_s  # a stream's last reply waits this long for the client to end it (see _linger)
        self.idle_timeout_s = idle_timeout_s
        self.open_heartbeats = open_heartbeats  # answer a queued open's heartbeat_s (False: ignore it, as before)
        # how long a pushed step waits for its input, and a push for its stream: below the orchestrator's step timeout
        # (60 s), so that a lost push comes back as a refusal the orchestrator repairs, not as a dead server
        self.push_timeout_s = push_timeout_s
        self._boxes: dict[str, PushBox] = {}  # session id -> pushed inputs (sessions opened with a push_token)
        self._p2p: Optional[P2P] = None  # where pushes to the next hop go out

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, **kwargs: Any) -> None:
        self._p2p = p2p
        await super().add_p2p_handlers(p2p, wrapper, **kwargs)

    # ping and info answer on a fresh stream (like sessions), not on hivemind's persistent unary connection:
    # with hivemind 1.1.12 that connection hangs for a P2P replica created after another replica of the same
    # daemon was shut down (measured here), which is exactly how orchestrators and tests use replicas.
    async def rpc_ping(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta = request.metadata[:MAX_METADATA_BYTES]
        yield runtime_pb2.ExpertResponse(metadata=meta)
        await hold_after_reply(self.linger_s)

    async def rpc_info(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            info = self.backend.info()
        except Exception as e:  # noqa: BLE001
            logger.exception("info failed")
            yield _error("internal", f"info failed: {e}")
            await hold_after_reply(self.linger_s)
            return
        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, **info}))
        await hold_after_reply(self.linger_s)

    async def rpc_session(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = context.remote_id.to_base58()
        stream = requests.__aiter__()
        if not self.backend.authorize(peer):
            # Refused before anything is parsed or allocated, and a silent stream is not held for the idle timeout.
            # Its first message is still read (briefly): replying while the peer writes it resets the stream.
            with contextlib.suppress(StopAsyncIteration, asyncio.TimeoutError):
                await asyncio.wait_for(stream.__anext__(), timeout=min(self.idle_timeout_s, UNTRUSTED_READ_S))
            yield _error("untrusted", f"peer {peer} is not trusted by this server")
            await _linger(stream, None, min(self.linger_s, UNTRUSTED_READ_S))
            return
        session_id: Optional[str] = None
        loop = asyncio.get_running_loop()
        last_valid = loop.time()  # only valid messages move it: an error reply keeps the idle deadline
        push_streams: dict[tuple, PushStream] = {}  # (peer, session) -> a stream this session pushes its outputs on

        pending: Optional[asyncio.Future] = None  # a read of the stream begun while the open waited

        async def next_message() -> Optional[runtime_pb2.ExpertRequest]:
            nonlocal pending
            timeout = last_valid + self.idle_timeout_s - loop.time()
            if timeout <= 0:
                raise asyncio.TimeoutError
            try:
                if pending is not None:
                    fut, pending = pending, None
                    msg = await asyncio.wait_for(fut, timeout=timeout)
                else:
                    msg = await asyncio.wait_for(stream.__anext__(), timeout=timeout)
            except StopAsyncIteration:
                return None
            return msg

        try:
            first = await next_message()
            if first is None:
                return
            try:
                meta = _unpack(first.metadata)
                if meta.get("op") != "open":
                    raise RefusedError("invalid", "the first message of a session must be op=open")
                if not self.backend.authorize(peer):  # trust may have been withdrawn meanwhile
                    raise RefusedError("untrusted", f"peer {peer} is not trusted by this server")
                sid = meta.get("session_id")
                if not isinstance(sid, str) or not (0 < len(sid) <= _MAX_SESSION_ID):
                    raise RefusedError("invalid", "session_id must be a non-empty string of at most 256 chars")
                model = meta.get("model")
                served = getattr(self.backend, "model_fingerprint", "")
                if model is not None and (not isinstance(model, str) or len(model) > 64):
                    raise RefusedError("invalid", "field 'model' must be a model fingerprint (a string)")
                if model and served and model != served:
                    raise RefusedError("unavailable", f"this server serves model {served} now, not {model}")
                adapter = meta.get("adapter")
                if adapter is not None and (not isinstance(adapter, str) or not 0 < len(adapter) <= 64):
                    raise RefusedError("invalid", "field 'adapter' must be an adapter fingerprint (a string)")
                start = _int_field(meta, "start_block")
                end = _int_field(meta, "end_block", lo=1)
                max_length = _int_field(meta, "max_length", lo=1)
                wait_s = meta.get("wait_s", 0)
                if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not (0 <= wait_s < math.inf):
                    raise RefusedError("invalid", f"field 'wait_s' must be a finite number >= 0, got {wait_s!r}")
                beat = meta.get("heartbeat_s", 0)
                if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not (0 <= beat < math.inf):
                    raise RefusedError("invalid", f"field 'heartbeat_s' must be a finite number >= 0, got {beat!r}")
                beat = heartbeat_period(beat) if beat and self.open_heartbeats else 0.0
                fork_from = meta.get("fork_from")
                fork = {}
                if fork_from is not None:
                    if not isinstance(fork_from, str) or not (0 < len(fork_from) <= _MAX_SESSION_ID):
                        raise RefusedError("invalid", "fork_from must be a session id")
                    if wait_s:
                        raise RefusedError("invalid", "fork_from cannot be combined with wait_s")
                    fork = {"fork_from": fork_from, "fork_length": _int_field(meta, "fork_length", lo=1)}
                prefix = _hashes_field(meta, max_length)
                if fork and prefix:
                    raise RefusedError("invalid", "fork_from cannot be combined with prefix_hashes")
                push_token = meta.get("push_token")
                if push_token is not None:
                    try:
                        check_token(push_token)
                    except RouteError as e:
                        raise RefusedError("invalid", str(e)) from None
                    if sid in self._boxes:
                        raise RefusedError("invalid", f"session {sid!r} is already open")
                # a push session holds a push relay's streams too: its server counts their descriptors (only
                # then passed, so a backend that knows no push is driven as before)
                pushed = {"push": True} if push_token is not None else {}
                if adapter is not None:  # (only then passed: a backend that knows no adapters is driven as before)
                    pushed["adapter"] = adapter
                if wait_s > 0 and hasattr(self.backend, "open_session_wait"):
                    opening = asyncio.ensure_future(self.backend.open_session_wait(sid, start, end, max_length, peer,
                                                                                   float(wait_s), **prefix, **pushed))
                    reading = asyncio.ensure_future(stream.__anext__())
                    t_wait = loop.time()
                    try:
                        while True:
                            extra, pending = await self._open_waiting(opening, reading, sid, beat or None)
                            if extra is not _STILL_WAITING:
                                break
                            yield runtime_pb2.ExpertResponse(metadata=_pack(
                                {"ok": True, "waiting": True, "waited_s": round(loop.time() - t_wait, 3)}))
                    except BaseException as e:
                        refused = isinstance(e, RefusedError)
                        # refused: the read goes on while the refusal goes out (see _linger)
                        _withdraw_open(self.backend, opening, None if refused else reading, sid)
                        pending = reading if refused else None
                        _log_wait(sid, peer, loop.time() - t_wait, f"refused ({e})" if refused
                                  else f"abandoned ({type(e).__name__})")
                        raise
                    _log_wait(sid, peer, loop.time() - t_wait, "withdrawn by the client" if extra is None else "served")
                    if extra is None:
                        return  # the client went away (or broke protocol) while waiting
                else:
                    extra = self.backend.open_session(sid, start, end, max_length, peer, **fork, **prefix, **pushed)
                session_id = sid
                limit = max_length  # the session's token limit: a step's declared tokens are checked against it
                if push_token is not None:
                    self._boxes[sid] = PushBox(push_token, max_tokens=max_length)
            except RefusedError as e:
                yield _error(e.code, str(e))
                await _linger(stream, pending, self.linger_s)
                return
            last_valid = loop.time()
            yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "session_id": session_id,
                                                             "idle_timeout_s": self.idle_timeout_s, **(extra or {})}))

            while True:
                msg = await next_message()
                if msg is None:
                    return
                try:
                    meta = _unpack(msg.metadata)
                    op = meta.get("op")
                    if op == "close":
                        prefix = _hashes_field(meta, 1 << 40)
                        sid, session_id = session_id, None  # closed here, not again below
                        self._end_session(sid, **prefix)
                        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "closed": True}))
                        await _linger(stream, None, self.linger_s)
                        return
                    if op == "keepalive":
                        if msg.tensors:
                            raise RefusedError("invalid", "keepalive carries no tensors")
                        last_valid = loop.time()
                        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "keepalive": True}))
                        continue
                    if op == "extend":
                        if msg.tensors:
                            raise RefusedError("invalid", "extend carries no tensors")
                        extra = self.backend.extend_session(session_id, _int_field(meta, "max_length"))
                        granted = extra.get("max_length")
                        if isinstance(granted, int) and not isinstance(granted, bool) and granted > limit:
                            limit = granted
                        box = self._boxes.get(session_id)
                        if box is not None:  # pushes may be as long as the session now is
                            box.max_tokens = extra["max_length"]
                        last_valid = loop.time()
                        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, **extra}))
                        continue
                    if op != "step":
                        raise RefusedError("invalid", f"unknown op {op!r} (expected step, extend, keepalive or close)")
                    position = _int_field(meta, "position")
                    route = _route_field(meta)
                    taken: dict = {}
                    if meta.get("pushed") is True:  # the input comes from the previous hop (push mode)
                        position, hidden, route = await self._take_push(msg, meta, session_id, position)
                        taken = {"input_digest": tensor_digest(hidden)}  # what we computed on (see tensor_digest)
                    else:
                        hidden = await self._receive_tensor(msg, next_message, max_tokens=limit, position=position)
                    t_compute = time.perf_counter()
                    out = await self.backend.forward(session_id, hidden, position)
                    compute_s = time.perf_counter() - t_compute
                    chunks = serialize_chunks(out)
                    onward = chunks if self.push_fault is None or not route else serialize_chunks(self.push_fault(out))
                    pushed = (await self._push_next(route, position, meta.get("step_id"), onward, push_streams)
                              if route else {})
                except RefusedError as e:
                    yield _error(e.code, str(e))
                    continue
                except asyncio.TimeoutError:
                    raise  # idle in the middle of a chunked tensor: handled below
                except Exception as e:  # noqa: BLE001 - a bug must not kill the session or the server
                    logger.exception(f"step of session {session_id} failed")
                    yield _error("internal", f"{type(e).__name__}: {e}")
                    continue
                last_valid = loop.time()
                yield runtime_pb2.ExpertResponse(
                    metadata=_pack({"ok": True, "position": position + int(out.shape[1]),
                                    "compute_s": round(compute_s, 7), **pushed, **taken}),
                    tensors=[chunks[0]]
                )
                for chunk in chunks[1:]:
                    yield runtime_pb2.ExpertResponse(tensors=[chunk])
        except asyncio.TimeoutError:
            logger.info(f"session {session_id} of {peer}: idle for {self.idle_timeout_s} s, closing")
            yield _error("idle_timeout", f"no message for {self.idle_timeout_s} s; session closed")
        finally:
            if pending is not None:
                pending.cancel()
            for ps in push_streams.values():
                ps.close()
            if session_id is not None:
                self._end_session(session_id)

    def _end_session(self, session_id: str, **prefix: Any) -> None:
        """Close ``session_id`` at the backend and its push mailbox (pushes to it are refused from now on)."""
        self.backend.close_session(session_id, **prefix)
        box = self._boxes.pop(session_id, None)
        if box is not None:
            box.close()

    async def _take_push(self, msg: runtime_pb2.ExpertRequest, meta: dict, session_id: str,
                         position: int) -> tuple[int, torch.Tensor, list[dict]]:
        """The input of a ``pushed`` step: what the previous hop pushed for this ``step_id``."""
        if msg.tensors:
            raise RefusedError("invalid", "a pushed step carries no tensor (the previous hop pushes it)")
        box = self._boxes.get(session_id)
        if box is None:
            raise RefusedError("invalid", "this session was opened without a push_token: it cannot take pushes")
        step_id = _int_field(meta, "step_id")
        tokens = _int_field(meta, "tokens", lo=1)
        try:
            pushed_position, hidden, route = await box.take(step_id, self.push_timeout_s)
        except asyncio.TimeoutError:
            # its own code: the orchestrator stops pushing to this chain (relay.py); the text stays what servers
            # before the code said (code "unavailable"), which older orchestrators match
            raise RefusedError(NO_PUSH, f"no push for step {step_id} within {self.push_timeout_s} s") from None
        if pushed_position != position or hidden.shape[1] != tokens:
            raise RefusedError("invalid", f"the push of step {step_id} is for positions {pushed_position}.."
                                          f"+{hidden.shape[1]}, the step awaits {position}..+{tokens}")
        dtype = meta.get("dtype")
        if dtype is not None and ALLOWED_DTYPES.get(dtype) is not hidden.dtype:
            # the previous hop pushed another dtype than the orchestrator's: refused here, not blamed on us later
            raise RefusedError("invalid", f"the push of step {step_id} is {hidden.dtype}, the step awaits {dtype}")
        return position, hidden, route

    async def _push_next(self, route: list[dict], position: int, step_id: Any, chunks: list,
                         streams: dict[tuple, "PushStream"]) -> dict:
        """Push this step's output to the route's next hop -> reply fields ``pushed`` (and ``push_error``).
        ``streams``: the pushing session's open push streams (one per next hop, reused step after step: a stream
        open costs more than a message)."""
        if not isinstance(step_id, int) or isinstance(step_id, bool) or self._p2p is None:
            return {"pushed": False, "push_error": "no step_id" if self._p2p is not None else "no P2P"}
        hop = route[0]
        key = (hop["peer"], hop["session_id"])
        messages = push_messages(hop, position, step_id, route[1:], chunks)
        for attempt in range(2):
            ps = streams.get(key)
            if ps is None or ps.closed:  # closed: refused, broken or idle at the other end
                ps = streams[key] = PushStream(self._p2p, hop["peer"])
            try:
                await ps.send(messages, self.push_timeout_s)
                return {"pushed": True}
            except ConnectionError as e:  # cannot open a stream: one more try on a fresh one
                streams.pop(key, None)
                error = str(e)
        logger.info("push of step %d to %s failed: %s", step_id, hop["peer"][:12], error)
        return {"pushed": False, "push_error": error[:500]}

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A previous hop's outputs for a session of ours, one push after another on the stream (see
        :mod:`~petals_chain.swarm.push`); the stream ends at the first push no session takes."""
        stream = requests.__aiter__()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.push_timeout_s  # the first push comes at once; later ones within idle_timeout_s

        async def next_message() -> Optional[runtime_pb2.ExpertRequest]:
            try:
                return await asyncio.wait_for(stream.__anext__(), timeout=max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return None

        while True:
            try:
                first = await next_message()
                if first is None:
                    return
                meta = _unpack(first.metadata)
                box = self._boxes.get(meta.get("session_id")) if isinstance(meta.get("session_id"), str) else None
                if box is None or not box.accepts(meta.get("token")):
                    # the token is checked before the tensor is read: a stranger's push costs one message
                    raise RefusedError("untrusted", "no open session takes this push (unknown session or wrong token)")
                position = _int_field(meta, "position")
                step_id = _int_field(meta, "step_id")
                route = _route_field(meta)
                hidden = await self._receive_tensor(first, next_message, max_tokens=box.max_tokens)
                box.put(step_id, position, hidden, route)
            except RefusedError as e:
                yield _error(e.code, str(e))
                if e.code == "untrusted":
                    await _linger(stream, None, min(self.linger_s, UNTRUSTED_READ_S))
                    return
                continue
            except asyncio.TimeoutError:
                return  # idle (or stalled in the middle of a tensor): the pusher opens a new stream if it needs one
            deadline = loop.time() + self.idle_timeout_s
            yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True}))

    async def _open_waiting(self, opening: asyncio.Future, reading: asyncio.Future, sid: str,
                            timeout: Optional[float]) -> tuple[Any, Optional[asyncio.Future]]:
        """Wait for the open (``opening``) while watching the stream (``reading``) up to ``timeout`` seconds:
        ``(_STILL_WAITING, None)`` if neither finished; ``(None, None)`` if the client ended the stream (or sent
        anything) first, and the wait is withdrawn; else ``(extra, reading)``, the read continuing as the session's
        next message. The open's error propagates."""
        done, _ = await asyncio.wait({opening, reading}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            return _STILL_WAITING, None
        if opening.done():
            return opening.result(), reading
        _withdraw_open(self.backend, opening, reading, sid)
        return None, None

    async def _receive_tensor(self, first: runtime_pb2.ExpertRequest, next_message, max_tokens: Optional[int] = None,
                              position: Optional[int] = None) -> torch.Tensor:
        """Validate the declared tensor (at most ``max_tokens`` tokens, when given; a step's at ``position``: up to
        position ``max_tokens``), collect its chunks, deserialize; raises RefusedError.

        If the first chunk is rejected, the continuation chunks it announced are read and dropped, so that the
        stream stays in step with the client (one reply per step)."""
        if len(first.tensors) != 1:
            raise RefusedError("invalid", f"a step carries exactly one tensor, got {len(first.tensors)}")
        head = first.tensors[0]
        num_chunks = max(1, int(head.chunks))
        if num_chunks > MAX_CHUNKS:
            raise RefusedError("invalid", f"{num_chunks} chunks announced, at most {MAX_CHUNKS} allowed")
        try:
            nbytes = self._check_head(head, num_chunks, max_tokens, position)
        except _InconsistentChunks:
            raise  # the announced chunk count is not credible: do not wait for chunks
        except RefusedError:
            for _ in range(num_chunks - 1):
                msg = await next_message()
                if msg is None or msg.metadata:
                    break
            raise
        parts = [head]
        received = len(head.buffer)
        while len(parts) < num_chunks:
            msg = await next_message()
            if msg is None:
                raise RefusedError("invalid", "stream ended in the middle of a tensor")
            if msg.metadata or len(msg.tensors) != 1:
                raise RefusedError("invalid", "expected a tensor continuation chunk")
            parts.append(msg.tensors[0])
            received += len(msg.tensors[0].buffer)
            if received > nbytes:
                raise RefusedError("invalid", "tensor chunks exceed the declared size")
        if received != nbytes:
            raise RefusedError("invalid", f"tensor has {received} bytes, shape/dtype declare {nbytes}")
        try:
            tensor = deserialize_torch_tensor(combine_from_streaming(parts))
        except Exception as e:  # noqa: BLE001
            raise RefusedError("invalid", f"cannot deserialize tensor: {e}") from None
        if not torch.isfinite(tensor).all():
            raise RefusedError("invalid", "hidden states contain NaN or inf")
        return tensor

    def _check_head(self, head: runtime_pb2.Tensor, num_chunks: int, max_tokens: Optional[int] = None,
                    position: Optional[int] = None) -> int:
        """Bytes the declared tensor must have; RefusedError if dtype, shape (more than ``max_tokens`` tokens, or
        past position ``max_tokens`` for a step at ``position``) or chunking is unacceptable."""
        if head.dtype not in ALLOWED_DTYPES:
            raise RefusedError("invalid", f"dtype {head.dtype!r} not allowed (use one of {sorted(ALLOWED_DTYPES)})")
        if head.compression != runtime_pb2.CompressionType.NONE:
            raise RefusedError("invalid", "only uncompressed tensors are accepted")
        shape = list(head.size)
        hidden_size = self.backend.hidden_size
        if len(shape) != 3 or shape[0] != 1 or shape[2] != hidden_size or shape[1] < 1:
            raise RefusedError("invalid", f"hidden states must have shape [1, n >= 1, {hidden_size}], got {shape}")
        if max_tokens is not None and position is not None and position + shape[1] > max_tokens:
            # refused before its chunks are buffered (they are read and dropped): a step of a session of 16 tokens was
            # read whole, up to MAX_TENSOR_BYTES (and copied twice), before the session refused it
            raise RefusedError("invalid", f"positions {position}..{position + shape[1] - 1} exceed the session's "
                                          f"max_length {max_tokens}")
        if max_tokens is not None and shape[1] > max_tokens:
            # a push is kept until its step comes (several may wait): not more than the session can take
            raise RefusedError("invalid", f"{shape[1]} tokens pushed for a session of at most {max_tokens}")
        nbytes = math.prod(shape) * _DTYPE_BYTES[head.dtype]
        if nbytes > MAX_TENSOR_BYTES:
            raise RefusedError("invalid", f"tensor of {nbytes} bytes exceeds the {MAX_TENSOR_BYTES}-byte limit")
        if num_chunks > min(MAX_CHUNKS, 1 + nbytes // MIN_CHUNK_BYTES):
            raise _InconsistentChunks("invalid", f"{num_chunks} chunks for {nbytes} bytes (chunks must be >= "
                                          f"{MIN_CHUNK_BYTES} bytes)")
        if num_chunks > 1 and len(head.buffer) >= nbytes:
            raise _InconsistentChunks("invalid",
                                      "the first chunk already holds the whole tensor but more are announced")
        return nbytes


class PeerStream:
    """A stream call to one of a peer's ``PetalsChainBlocks`` handlers: the requests come from an async iterator
    (ending it sends the end of stream and closes our end), the replies from ``__anext__``.

    Unlike hivemind's ``iterate_protobuf_handler``, the peer ending the stream (or the P2P layer resetting it)
    ends the replies at once (StopAsyncIteration): hivemind's waits for the requests to end first, so a reset
    stream looked like a silent server until the caller's timeout. A read cancelled mid-message ends the stream
    too (its framing is lost)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, requests: AsyncIterator,
                 what: str):
        self._reader, self._writer, self._what = reader, writer, what
        self.ended = False
        self._writing = asyncio.ensure_future(self._write(requests))

    @classmethod
    async def open(cls, p2p: P2P, peer_id: Union[str, PeerID], method: str,
                   requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> "PeerStream":
        """Open a stream to ``peer_id``'s ``PetalsChainBlocks.<method>`` (P2P errors propagate)."""
        name = PetalsChainBlocks._get_handle_name(None, method)
        _, reader, writer = await p2p.call_binary_stream_handler(_as_peer(peer_id), name)
        return cls(reader, writer, requests, f"{method} of {str(peer_id)[:16]}…")

    async def _write(self, requests: AsyncIterator) -> None:
        try:
            async for request in requests:
                await P2P.send_protobuf(request, self._writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, self._writer)
        except (ConnectionError, OSError):
            pass  # the stream broke: the reader sees it end
        finally:
            self.close()

    def __aiter__(self) -> "PeerStream":
        return self

    async def __anext__(self) -> runtime_pb2.ExpertResponse:
        if self.ended:
            raise StopAsyncIteration
        try:
            reply, err = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, self._reader)
        except OversizedMessage as e:
            self.close()
            raise ConnectionError(f"{self._what}: {e}") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            self.close()
            raise StopAsyncIteration from None
        except BaseException:
            self.close()
            raise
        if err is not None:  # the handler raised (hivemind reports it in-stream)
            self.close()
            raise P2PHandlerError(f"{self._what} failed: {err.message}")
        return reply

    def close(self) -> None:
        """End the stream here (idempotent): no more requests are sent, no more replies read."""
        self.ended = True
        if not self._writing.done() and self._writing is not asyncio.current_task():
            self._writing.cancel()
        self._writer.close()


async def _drain(queue: asyncio.Queue) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """The messages put in ``queue``, as a stream's requests, until a None."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


def _route_field(meta: dict) -> list[dict]:
    try:
        return check_route(meta.get("route"))
    except RouteError as e:
        raise RefusedError("invalid", f"field 'route': {e}") from None


def push_messages(hop: dict, position: int, step_id: int, route: list[dict], chunks: list) -> list:
    """The messages of one push of serialized hidden states (``chunks``) to the route hop ``hop`` (``{"peer",
    "session_id", "token"}``), which forwards along ``route`` after it."""
    meta = {"session_id": hop["session_id"], "token": hop["token"], "position": int(position),
            "step_id": int(step_id), "route": route}
    messages = [runtime_pb2.ExpertRequest(metadata=_pack(meta), tensors=[chunks[0]])]
    return messages + [runtime_pb2.ExpertRequest(tensors=[c]) for c in chunks[1:]]


class PushStream:
    """One ``rpc_push`` stream to a peer for pushes one after another. A server does not wait for the
    acknowledgements (its reply to the orchestrator would wait a round trip to the next hop): they are read in the
    background, and a refusal or a broken stream closes it (the next push opens a new one; a push that got lost
    on the way leaves the next hop without its input, which the orchestrator sees and repairs)."""

    def __init__(self, p2p: P2P, peer: str):
        self.p2p, self.peer = p2p, peer
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses: Optional[AsyncIterator[runtime_pb2.ExpertResponse]] = None
        self._reader: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()
        self.closed = False

    def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        return _drain(self._queue)

    async def _open(self, timeout_s: float) -> None:
        if self.closed:
            raise ConnectionError("the push stream is closed")
        if self._responses is None:
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: see _await_next
                    self._responses = await PeerStream.open(self.p2p, self.peer, "rpc_push", self._requests())
            except Exception as e:  # noqa: BLE001 - P2P errors of a dead or unreachable peer
                self.close()
                raise ConnectionError(f"push to {self.peer[:16]}…: {type(e).__name__}: {e}") from e

    async def send(self, messages: list, timeout_s: float) -> None:
        """Send a push on the stream (opened on first use) without waiting for its acknowledgement.
        ConnectionError if the stream cannot be opened or is closed."""
        async with self._lock:
            await self._open(timeout_s)
            if self._reader is None:
                self._reader = asyncio.ensure_future(self._read_acks())
            for m in messages:
                self._queue.put_nowait(m)

    async def send_confirmed(self, messages: list, timeout_s: float) -> None:
        """Send a push and wait for its acknowledgement (a stream of one push). ConnectionError: unreachable,
        broken or timed out; RuntimeError: refused."""
        async with self._lock:
            try:
                await self._open(timeout_s)
                for m in messages:
                    self._queue.put_nowait(m)
                async with asyncio.timeout(timeout_s):  # not wait_for: see _await_next
                    reply = _unpack_reply(await self._responses.__anext__())
            except (StopAsyncIteration, asyncio.TimeoutError, ConnectionError) as e:
                self.close()
                raise ConnectionError(f"push to {self.peer[:16]}…: {type(e).__name__}: {e}") from None
            if not reply.get("ok", False):
                raise RuntimeError(f"push to {self.peer[:16]}… refused: {reply.get('code')}: {reply.get('error')}")

    async def _read_acks(self) -> None:
        try:
            async for reply in self._responses:
                meta = _unpack_reply(reply)
                if not meta.get("ok", False):
                    logger.info("push to %s refused: %s: %s", self.peer[:12], meta.get("code"), meta.get("error"))
                    return
        except Exception as e:  # noqa: BLE001 - the stream broke: the next push opens a new one
            logger.info("push stream to %s ended: %s: %s", self.peer[:12], type(e).__name__, e)
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)
        if self._reader is not None and not self._reader.done() and self._reader is not asyncio.current_task():
            self._reader.cancel()


async def push_step(p2p: P2P, hop: dict, position: int, step_id: int, route: list[dict], chunks: list,
                    timeout_s: float) -> None:
    """One push on a stream of its own, acknowledged (see :func:`push_messages`). Raises ConnectionError
    (unreachable, timeout, no reply) or RuntimeError (refused)."""
    ps = PushStream(p2p, hop["peer"])
    try:
        await ps.send_confirmed(push_messages(hop, position, step_id, route, chunks), timeout_s)
    finally:
        ps.close()


def _as_peer(peer_id: Union[str, PeerID]) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(str(peer_id))


async def _await_next(responses: AsyncIterator, timeout: Optional[float], what: str):
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a read that finishes as the
        # caller is cancelled (gh-86296), so a cancelled open or step ended in ConnectionError instead, in a task
        # whose canceller no longer read it ("Task exception was never retrieved").
        async with asyncio.timeout(timeout):
            return await responses.__anext__()
    except StopAsyncIteration:
        raise ConnectionError(f"{what}: the server closed the stream") from None
    except asyncio.TimeoutError:
        raise ConnectionError(f"{what}: no reply within {timeout} s") from None
    except (RemoteError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - P2P errors, resets, dead peers
        raise ConnectionError(f"{what}: {type(e).__name__}: {e}") from e


def _raise_if_error(meta: dict) -> None:
    if not meta.get("ok", False):
        code, message = str(meta.get("code", "invalid")), str(meta.get("error", "unknown error"))
        reason = meta.get("reason")
        if isinstance(reason, str) and REFINED_CODES.get(reason) == code:  # sent as the code it refines
            code = reason
        if code in ("no_capacity", "stranger_quota"):  # full (for this peer): wait, preempt; not a failed server
            raise NoCapacityError(message, code)
        raise RemoteError(message, code)


class RemoteSession:
    """A session with one server: ``await step(hidden, position)`` then ``await close()``."""

    def __init__(self, peer_id: str, session_id: str, start_block: int, end_block: int, max_length: int,
                 step_timeout_s: Optional[float]):
        self.peer_id, self.session_id = peer_id, session_id
        self.start_block, self.end_block, self.max_length = start_block, end_block, max_length
        self.position = 0  # tokens the server holds for this session (as acknowledged by it)
        self.open_heartbeats = 0  # "still waiting" replies the server sent while the open was queued
        self.cached_tokens = 0  # of the prompt named at open, tokens the server's prefix cache held
        self.prefix_cache = False  # the server keeps closed sessions' full pages for later prompts (open reply)
        self.last_compute_s: float | None = None  # server-side compute time of the last step (seconds)
        self.step_timeout_s = step_timeout_s
        self.idle_timeout_s: float | None = None  # announced by the server at open (None: an older server)
        self.last_io = time.monotonic()  # last reply from the server: what its idle timer saw last
        self.closed = False
        self._lost: BaseException | None = None  # why the stream ended under us (keepalive failed)
        self.push_token: str | None = None  # given at open: this session takes pushes from the previous hop
        self.pushed: bool | None = None  # the last step with a route: whether the server pushed its output on
        self.push_error: str | None = None
        self.input_digest: str | None = None  # the last pushed step: the digest of the input the server took
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses: Optional[AsyncIterator[runtime_pb2.ExpertResponse]] = None
        self._lock = asyncio.Lock()

    def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        return _drain(self._queue)

    async def step(self, hidden: torch.Tensor, position: int, *, route: Optional[list[dict]] = None,
                   step_id: Optional[int] = None, pushed: bool = False) -> torch.Tensor:
        """Send hidden ``[1, n, hidden_size]`` for positions ``position..position+n-1``; returns the same shape.

        Push mode (:mod:`~petals_chain.swarm.push`): ``route`` (with ``step_id``) makes the server push its
        output on to the route's first hop (:attr:`pushed` says whether it could); with ``pushed=True`` the
        server takes this step's input from the previous hop's push instead, and ``hidden`` only says the
        shape and dtype to expect (it is not sent)."""
        self._raise_if_closed()
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
            raise ValueError("hidden must be a 3-D tensor [1, n_tokens, hidden_size]")
        meta: dict = {"op": "step", "position": int(position)}
        dtype_name = str(hidden.dtype).removeprefix("torch.")  # as serialize_torch_tensor names it
        if route or pushed:
            meta["step_id"] = int(step_id)
        if route:
            meta["route"] = list(route)
        if pushed:
            meta.update(pushed=True, tokens=int(hidden.shape[1]), dtype=dtype_name)
        # a pushed step sends no tensor, but its reply is checked against the header one would have
        chunks = [] if pushed else serialize_chunks(hidden)
        expect = runtime_pb2.Tensor(dtype=dtype_name, size=list(hidden.shape),
                                    compression=runtime_pb2.CompressionType.NONE)
        messages = [runtime_pb2.ExpertRequest(metadata=_pack(meta), tensors=chunks[:1])]
        messages += [runtime_pb2.ExpertRequest(tensors=[c]) for c in chunks[1:]]
        async with self._lock:
            self._raise_if_closed()
            try:
                return await self._step_locked(messages, expect, hidden, int(position), bool(route))
            except RemoteError:
                raise  # an error reply: the stream is still in step, the session lives on
            except BaseException:
                # Timeout, dead peer or cancellation mid-step: replies may be left unread, so the stream can no
                # longer be trusted. End it; the server frees the slots when the stream closes.
                self.closed = True
                self._queue.put_nowait(None)
                raise

    def _raise_if_closed(self) -> None:
        lost = self._lost
        if lost is not None:  # the server dropped the stream while we held the session: say how
            if isinstance(lost, RemoteError):
                raise RemoteError(f"session lost: {lost}", lost.code)
            raise ConnectionError(f"session lost: {lost}")
        if self.closed:
            raise RemoteError("session is closed", "invalid")

    async def _step_locked(self, messages: list, sent: runtime_pb2.Tensor, hidden: torch.Tensor, position: int,
                           routed: bool) -> torch.Tensor:
        for m in messages:
            self._queue.put_nowait(m)
        what = f"step on {self.peer_id}"
        reply = await _await_next(self._responses, self.step_timeout_s, what)
        meta = _unpack_reply(reply)
        _raise_if_error(meta)
        digest = meta.get("input_digest")
        self.input_digest = digest if isinstance(digest, str) else None
        if routed:
            self.pushed = meta.get("pushed") is True
            self.push_error = None if self.pushed else str(meta.get("push_error", "the server did not push"))[:500]
        if len(reply.tensors) != 1:
            raise InvalidReply(f"{what}: a step reply carries one tensor, got {len(reply.tensors)}")
        # The reply must be what we sent, transformed: same dtype and shape. Checked before reading further
        # chunks, so a server announcing a huge or absurdly chunked tensor costs us nothing.
        head = reply.tensors[0]
        if head.dtype != sent.dtype or list(head.size) != list(sent.size) or head.compression != sent.compression:
            raise InvalidReply(f"{what}: reply tensor {head.dtype}{list(head.size)} (compression {head.compression}) "
                               f"does not match the {sent.dtype}{list(sent.size)} sent")
        nbytes = math.prod(sent.size) * _DTYPE_BYTES.get(sent.dtype, 4)
        num_chunks = max(1, int(head.chunks))
        if num_chunks > min(MAX_CHUNKS, 1 + nbytes // MIN_CHUNK_BYTES):
            raise InvalidReply(f"{what}: {num_chunks} chunks announced for {nbytes} bytes")
        parts, received = [head], len(head.buffer)
        while len(parts) < num_chunks and received <= nbytes:
            more = await _await_next(self._responses, self.step_timeout_s, what)
            if more.metadata or len(more.tensors) != 1:
                raise InvalidReply(f"{what}: expected a tensor continuation chunk")
            parts.append(more.tensors[0])
            received += len(more.tensors[0].buffer)
        if received != nbytes:
            raise InvalidReply(f"{what}: reply tensor has {received} bytes, {nbytes} expected")
        try:
            out = deserialize_torch_tensor(combine_from_streaming(parts))
        except Exception as e:  # noqa: BLE001
            raise InvalidReply(f"{what}: cannot deserialize the reply: {e}") from None
        if out.shape != hidden.shape or out.dtype != hidden.dtype:
            raise InvalidReply(f"{what}: reply {out.dtype}{list(out.shape)} for {hidden.dtype}{list(hidden.shape)}")
        if not torch.isfinite(out).all():
            raise InvalidReply(f"{what}: the reply contains NaN or inf")
        self.position = position + int(hidden.shape[1])
        self.last_io = time.monotonic()
        compute_s = meta.get("compute_s")
        # the server's own time for this step (incl. emulated slowness); lets the orchestrator split a hop's
        # time into compute (tau_p) and communication (tau_c) without trusting ping RTTs under load
        self.last_compute_s = (float(compute_s) if isinstance(compute_s, (int, float)) and 0 <= compute_s < 1e6
                               else None)
        return out

    async def keepalive(self) -> bool:
        """Reset the server's idle timer for this held session; False if the session is gone (it is then closed,
        and the next step raises what ended it). A no-op while a step is in flight (the stream is not idle)."""
        if self.closed:
            return False
        if self._lock.locked():
            return True
        async with self._lock:
            if self.closed:
                return False
            self._queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({"op": "keepalive"})))
            try:
                reply = await _await_next(self._responses, self.step_timeout_s, f"keepalive on {self.peer_id}")
                _raise_if_error(_unpack_reply(reply))
            except (ConnectionError, RemoteError) as e:
                self._lost = e
                self.closed = True
                self._queue.put_nowait(None)
                return False
            except BaseException:
                self.closed = True
                self._queue.put_nowait(None)
                raise
            self.last_io = time.monotonic()
            return True

    async def extend(self, max_length: int) -> int:
        """Ask the server to let this session hold up to ``max_length`` tokens; returns the limit granted. Raises
        :class:`NoCapacityError` or another :class:`RemoteError` (the session is unchanged and usable), or what a
        step would raise for a lost stream."""
        async with self._lock:
            self._raise_if_closed()
            self._queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({"op": "extend",
                                                                            "max_length": int(max_length)})))
            try:
                reply = await _await_next(self._responses, self.step_timeout_s, f"extend on {self.peer_id}")
            except BaseException:
                self.closed = True
                self._queue.put_nowait(None)
                raise
            self.last_io = time.monotonic()
            meta = _unpack_reply(reply)
            _raise_if_error(meta)
            self.max_length = int(meta.get("max_length", max_length))
            return self.max_length

    async def close(self, timeout_s: float = 10.0, prefix_hashes: bytes = b"") -> None:
        """Free the server's slots (idempotent; never raises for a dead server). ``prefix_hashes``
        (:func:`~petals_chain.swarm.prefix.prefix_hashes` of the tokens the session holds) lets the server keep
        the session's full pages in its prefix cache."""
        if self.closed:
            return
        self.closed = True
        try:
            async with self._lock:
                meta = {"op": "close", **({"prefix_hashes": bytes(prefix_hashes)} if prefix_hashes else {})}
                self._queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack(meta)))
                await _await_next(self._responses, timeout_s, "close")
        except (ConnectionError, RemoteError):
            pass
        finally:
            self._queue.put_nowait(None)

    async def __aenter__(self) -> "RemoteSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _unpack_reply(reply: runtime_pb2.ExpertResponse) -> dict:
    try:
        return _unpack(reply.metadata)
    except RefusedError as e:
        raise ConnectionError(f"malformed reply: {e}") from None


class ServerClient:
    """Client of petals-chain servers over an existing hivemind P2P (e.g. ``await dht.replicate_p2p()``)."""

    def __init__(self, p2p: P2P, *, open_timeout_s: float = 30.0, step_timeout_s: Optional[float] = 300.0,
                 model_fingerprint: str = "", heartbeat_grace_s: float = 5.0):
        self.p2p = p2p
        self.open_timeout_s = open_timeout_s
        self.step_timeout_s = step_timeout_s
        self.model_fingerprint = model_fingerprint  # named in every open (a server serving another model refuses)
        self.heartbeat_s, self.heartbeat_grace_s = OPEN_HEARTBEAT_S, heartbeat_grace_s
        # peer id -> whether it answers a queued open's heartbeat_s (its record's open_heartbeats; set by the owner)
        self.heartbeats: Callable[[str], bool] = lambda peer_id: False

    def _stub(self, peer_id: Union[str, PeerID]):
        return PetalsChainBlocks.get_stub(self.p2p, _as_peer(peer_id))

    async def open_session(self, peer_id: Union[str, PeerID], session_id: str, start_block: int, end_block: int,
                           max_length: int, wait_s: float = 0.0, fork_from: Optional[str] = None,
                           fork_length: int = 0, prefix_hashes: bytes = b"", push_token: str = "",
                           adapter: str = "") -> RemoteSession:
        """Reserve ``end_block - start_block`` slots on ``peer_id``; with ``wait_s > 0`` wait at the server (FIFO)
        up to ``wait_s`` seconds for them to free up (a server that heartbeats, see :attr:`heartbeats`, is given
        up on after ``HEARTBEATS_MISSED`` silent periods plus ``heartbeat_grace_s``). ``fork_from``: start with a
        copy of that session's first ``fork_length`` tokens of KV (same peer, same span). ``prefix_hashes``: the
        prompt's :func:`~petals_chain.swarm.prefix.prefix_hashes`; the session starts holding the ``cached_tokens``
        of it the server's prefix cache has (its ``position``). ``push_token``: the session takes pushes from the
        previous hop of a route that carries it (:mod:`~petals_chain.swarm.push`). ``adapter``: the fingerprint of
        the LoRA adapter the session runs with ("" for the base model).

        Raises NoCapacityError (server full), RemoteError (refused/invalid), ConnectionError (unreachable)."""
        sess = RemoteSession(str(peer_id), session_id, int(start_block), int(end_block), int(max_length),
                             self.step_timeout_s)
        beat = self.heartbeat_s if wait_s > 0 and self.heartbeats(str(peer_id)) else 0.0
        sess._queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({
            "op": "open", "session_id": session_id, "start_block": int(start_block), "end_block": int(end_block),
            "max_length": int(max_length), **({"wait_s": float(wait_s)} if wait_s > 0 else {}),
            **({"heartbeat_s": beat} if beat else {}),
            **({"fork_from": fork_from, "fork_length": int(fork_length)} if fork_from is not None else {}),
            **({"prefix_hashes": bytes(prefix_hashes)} if prefix_hashes else {}),
            **({"push_token": push_token} if push_token else {}),
            **({"adapter": adapter} if adapter else {}),
            **({"model": self.model_fingerprint} if self.model_fingerprint else {})})))
        try:
            async with asyncio.timeout(self.open_timeout_s):  # not wait_for: see _await_next
                sess._responses = await PeerStream.open(self.p2p, peer_id, "rpc_session", sess._requests())
        except asyncio.TimeoutError:
            raise ConnectionError(f"open on {peer_id}: no stream within {self.open_timeout_s} s") from None
        except Exception as e:  # noqa: BLE001
            raise ConnectionError(f"open on {peer_id}: {type(e).__name__}: {e}") from e
        try:
            budget = self.open_timeout_s + max(0.0, float(wait_s))
            give_up = time.monotonic() + budget
            # silence that ends a heartbeating wait: missed periods of what the server keeps, plus a grace
            quiet = HEARTBEATS_MISSED * heartbeat_period(beat) + self.heartbeat_grace_s if beat else budget
            while True:
                silence = min(max(0.001, give_up - time.monotonic()), quiet) if beat else budget
                meta = _unpack_reply(await _await_next(sess._responses, silence, f"open on {peer_id}"))
                _raise_if_error(meta)
                if not (beat and meta.get("waiting") is True):
                    break
                sess.open_heartbeats += 1  # still queued there: the stream and the server are alive
        except BaseException:
            sess.closed = True
            sess._queue.put_nowait(None)
            raise
        idle = meta.get("idle_timeout_s")
        if isinstance(idle, (int, float)) and not isinstance(idle, bool) and 0 < idle < math.inf:
            sess.idle_timeout_s = float(idle)
        sess.last_io = time.monotonic()
        if fork_from is not None:
            sess.position = int(fork_length)
        sess.prefix_cache = meta.get("prefix_cache") is True
        sess.push_token = push_token or None
        cached = meta.get("cached_tokens", 0)
        named = len(prefix_hashes) // HASH_BYTES * PREFIX_BLOCK_TOKENS  # a server cannot hold more than was named
        if isinstance(cached, int) and not isinstance(cached, bool) and 0 < cached <= min(named, int(max_length) - 1):
            sess.position = sess.cached_tokens = cached
        return sess

    async def _call(self, method: str, peer_id: Union[str, PeerID], request: runtime_pb2.ExpertRequest,
                    timeout_s: float) -> runtime_pb2.ExpertResponse:
        async def call():
            for attempt in range(2):
                stream = await getattr(self._stub(peer_id), method)(request)
                try:
                    return await stream.__anext__()
                except StopAsyncIteration:
                    # The stream ended without a reply: the handler closes its end right after replying, and the
                    # P2P daemons' reset now and then discards the reply in flight (see _linger; a one-message
                    # call cannot wait for our end of stream, hivemind has read it). They only read: ask once more.
                    if attempt:
                        raise

        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: see _await_next
                return await call()
        except Exception as e:  # noqa: BLE001 - timeouts, P2P errors, dead peers
            raise ConnectionError(f"{method} {peer_id}: {type(e).__name__}: {e}") from e

    async def push(self, hop: dict, position: int, step_id: int, route: list[dict], hidden: torch.Tensor,
                   timeout_s: float = 30.0) -> None:
        """Push ``hidden`` to a route hop ourselves (the orchestrator, when the hop before it failed to)."""
        await push_step(self.p2p, hop, position, step_id, route, serialize_chunks(hidden), timeout_s)

    async def ping(self, peer_id: Union[str, PeerID], timeout_s: float = 10.0) -> float:
        """Round-trip time of a tiny RPC in seconds (raises ConnectionError if unreachable)."""
        t0 = time.perf_counter()
        await self._call("rpc_ping", peer_id, runtime_pb2.ExpertRequest(metadata=b"\x00"), timeout_s)
        return time.perf_counter() - t0

    async def info(self, peer_id: Union[str, PeerID], timeout_s: float = 10.0) -> dict[str, Any]:
        """The server's current state: span, slots, tau_p, emulation, ... (see server docs)."""
        reply = await self._call("rpc_info", peer_id, runtime_pb2.ExpertRequest(), timeout_s)
        meta = _unpack_reply(reply)
        _raise_if_error(meta)
        meta.pop("ok", None)
        return meta
