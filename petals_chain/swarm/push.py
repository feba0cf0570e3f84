"""Server-to-server push of a relay step's activations (``--relay push``): routes, mailboxes and the push call.

In push mode the orchestrator sends a step to the chain's first hop together with a *route*: for every later hop
its peer id, its session id and that session's *push token*. Each server runs its blocks, pushes its output
straight to the next hop of the route (``PetalsChainBlocks.rpc_push``) and replies to the orchestrator; the
later hops wait for the pushed input instead of one sent by the orchestrator. A step's critical path is then
``hops + 1`` wide-area legs instead of ``2 * hops``.

Only routes the orchestrator made are followed: each session's push token is a random secret the orchestrator
gave that session's server in its ``open`` (over the authenticated stream of a trusted orchestrator), and it
reveals it only in the routes of that job's steps, i.e. to the servers before it on the same chain (which could
feed it wrong activations anyway; audits catch that). A push that does not carry the token of an open session
is refused before its tensor is read: no other peer can reach a session of another job or orchestrator.

Wire (stream call ``PetalsChainBlocks.rpc_push``): first message ``{"session_id", "token", "position",
"step_id", "route"}`` + the first chunk of hidden ``[1, n, hidden]`` (continuation chunks follow as in a session
step) -> ``{"ok": true}`` or an error reply. ``step_id`` numbers the job's steps: a session takes the push of the
step it awaits, never a stale one (a step retried after a failure may be pushed twice).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

import torch

MAX_ROUTE_HOPS = 64
MAX_TOKEN_CHARS = 128
MIN_TOKEN_CHARS = 16
MAX_PENDING_PUSHES = 4  # pushes a session keeps for steps it has not awaited yet (the oldest is dropped first)


def tensor_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes. A hop that took its input from a push says the digest of
    what it took; the orchestrator checks it against the previous hop's reply (the same serialized chunks
    deserialize to the same bytes), so a hop that pushes one thing and replies another is caught, and the next
    hop is not audited, and blamed, for an input the orchestrator never saw."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:32]


class RouteError(ValueError):
    """A malformed route or push field (the caller refuses the message as ``invalid``)."""


def check_token(token: Any) -> str:
    """A push token as given in an ``open`` (a string of 16..128 characters)."""
    if not isinstance(token, str) or not (MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS):
        raise RouteError(f"push_token must be a string of {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} characters")
    return token


def check_route(route: Any) -> list[dict]:
    """A step's route: a list (at most :data:`MAX_ROUTE_HOPS`) of ``{"peer", "session_id", "token"}``."""
    if route is None:
        return []
    if not isinstance(route, list) or len(route) > MAX_ROUTE_HOPS:
        raise RouteError(f"route must be a list of at most {MAX_ROUTE_HOPS} hops")
    out = []
    for hop in route:
        if not isinstance(hop, dict):
            raise RouteError("every route hop must be a map {peer, session_id, token}")
        peer, sid = hop.get("peer"), hop.get("session_id")
        if not isinstance(peer, str) or not (0 < len(peer) <= 128):
            raise RouteError("route hop 'peer' must be a peer id string")
        if not isinstance(sid, str) or not (0 < len(sid) <= 256):
            raise RouteError("route hop 'session_id' must be a non-empty string of at most 256 chars")
        out.append({"peer": peer, "session_id": sid, "token": check_token(hop.get("token"))})
    return out


class PushBox:
    """The pushed inputs waiting for one server session (at most :data:`MAX_PENDING_PUSHES`), and the step that
    waits for one. ``max_tokens``: the session's token limit, the most a push for it may carry (None: no limit)."""

    def __init__(self, token: str, max_tokens: int | None = None):
        self.token = check_token(token)
        self.max_tokens = max_tokens
        self._items: dict[int, tuple[int, torch.Tensor, list[dict]]] = {}  # step_id -> (position, hidden, route)
        self._waiter: tuple[int, asyncio.Future] | None = None
        self.closed = False

    def accepts(self, token: Any) -> bool:
        """Constant-time check of a push's token."""
        return isinstance(token, str) and not self.closed and hmac.compare_digest(token.encode(), self.token.encode())

    def put(self, step_id: int, position: int, hidden: torch.Tensor, route: list[dict]) -> None:
        item = (position, hidden, route)
        if self._waiter is not None and self._waiter[0] == step_id and not self._waiter[1].done():
            self._waiter[1].set_result(item)
            return
        self._items[step_id] = item
        while len(self._items) > MAX_PENDING_PUSHES:
            del self._items[min(self._items)]

    async def take(self, step_id: int, timeout_s: float) -> tuple[int, torch.Tensor, list[dict]]:
        """The push of step ``step_id`` -> (position, hidden, route); :class:`asyncio.TimeoutError` if none comes
        within ``timeout_s``. Pushes of earlier steps are dropped."""
        for old in [k for k in self._items if k <= step_id]:
            item = self._items.pop(old)
            if old == step_id:
                return item
        fut = asyncio.get_running_loop().create_future()
        self._waiter = (step_id, fut)
        try:
            return await asyncio.wait_for(fut, timeout=timeout_s)
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        self._items.clear()
        if self._waiter is not None and not self._waiter[1].done():
            self._waiter[1].cancel()
