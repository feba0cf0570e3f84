"""Serving sessions: the RPC session backend (:class:`~petals_chain.swarm.rpc.SessionBackend`) of a server.

A session is one job's use of a span of this server's blocks: open reserves the KV pages its declared
``max_length`` needs in every block (``slots`` mode: one slot per block; or waits for them, FIFO, see
:mod:`~petals_chain.server.admission`; or forks another session's KV prefix), steps run the blocks over the
session's pages, close frees them. Sessions are opened only on the runner being served
(:attr:`SessionService.runner`) and only while the server is ``online``; the lifecycle
(:mod:`~petals_chain.server.server`) swaps runners and drains through :meth:`SessionService.drain`.

With ``--allow-any-client`` peers the server does not trust ("strangers") open sessions too, within
:class:`~petals_chain.server.admission.StrangerShares` of the pool (counting the pages their open sessions reserve
and their queued opens wait for, each cap at least one session of the whole span at the server's max length); past
it they are refused with code ``stranger_quota``, as is a stranger's open past its part of the wait queue. Their
queued opens wait behind the trusted ones, which are not refused because a stranger's open waits.
:meth:`SessionService.stranger_slots_free` is the room a stranger would find (the record shows it).

A peer that sends an open again while its earlier open under the same session id still waits (its first stream
broke; the server has not noticed yet) replaces that wait: the new open keeps its turn, the old one is refused
``invalid``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from petals_chain.server.admission import STRANGER_QUOTA, Descriptors, SlotWaitQueue, StrangerShares, WaitRefused
from petals_chain.server.kv_cache import NoCapacityError
from petals_chain.swarm.rpc import RefusedError

logger = logging.getLogger("petals_chain.server")

INLINE_MAX_TOKENS = 8  # steps with at most this many tokens run inline (see SessionService.forward)
RELEASED_IDS_KEPT = 4096  # ids of sessions a drain released, remembered so their next step hears "unavailable"


@dataclass
class OpenSession:
    runner: Any  # the BlockRunner the session's slots are on (the one served when it opened)
    max_length: int
    peer: str  # who opened it: forks are only allowed from the same peer
    span: tuple[int, int]  # [start_block, end_block)
    steps: int = 0  # steps computed so far
    push: bool = False  # opened with a push_token: it holds the descriptors of a push relay's streams too
    adapter: Optional[str] = None  # the fingerprint of the LoRA adapter it runs with (None: the base model)


class SessionService:
    """Sessions on the runner being served (see the module docstring).

    ``state()`` is the server's state (sessions open only while ``online``); ``on_change()`` is called
    whenever the free slots change (the record shows them); ``describe()`` gives the server's part of
    :meth:`info`.
    """

    def __init__(self, *, hidden_size: int, trusted: Iterable[str], allow_any_client: bool,
                 state: Callable[[], str], on_change: Callable[[], None], describe: Callable[[], dict],
                 max_waiters: int = 256, max_wait_s: float = 600.0,
                 stranger_shares: StrangerShares = StrangerShares(), descriptors: Optional[Descriptors] = None):
        self.hidden_size = hidden_size
        # opens refused ``no_capacity`` near the open-files limit (past it none could even be answered)
        self.descriptors = descriptors if descriptors is not None else Descriptors()
        self.trusted = trusted
        self.allow_any_client = allow_any_client
        self.runner = None  # set by the lifecycle while a span is loaded
        self.model_fingerprint = ""  # of the model served (an open naming another is refused)
        self.sessions: dict[str, OpenSession] = {}
        self.admission = SlotWaitQueue(NoCapacityError, max_waiters=max_waiters, max_wait_s=max_wait_s)
        self.stranger_shares = stranger_shares
        # strangers' queued opens: session id -> (peer, pages); a new tuple per open, so that a replaced open's exit
        # leaves the entry of the open that replaced it
        self._waiting: dict[str, tuple[str, int]] = {}
        self._state, self._on_change, self._describe = state, on_change, describe
        self._closed = asyncio.Event()  # a session closed (or the drain was told to stop waiting)
        self._released: OrderedDict[str, None] = OrderedDict()  # by a drain's timeout, oldest first (bounded)
        self._push_open = 0  # open sessions opened with a push_token (held_push)
        self._push_waiting = 0  # opens with a push_token waiting for slots
        # opens waiting under a key (peer, session id) -> [push]: a new list per open, so that a replaced open's exit
        # leaves the entry of the open that replaced it
        self._wait_pushes: dict[tuple[str, str], list[bool]] = {}

    # ------------------------------------------------------------------ rpc.SessionBackend
    def authorize(self, peer_id: str) -> bool:
        return self.allow_any_client or peer_id in self.trusted

    def open_session(self, session_id: str, start_block: int, end_block: int, max_length: int, peer_id: str,
                     fork_from: Optional[str] = None, fork_length: int = 0,
                     prefix_hashes: Sequence[bytes] = (), push: bool = False, adapter: Optional[str] = None) -> dict:
        """Open a session now (see the module docstring); ``push``: it carries a ``push_token`` (its descriptors
        count as a push relay's, :class:`~petals_chain.server.admission.Descriptors`); ``adapter``: the fingerprint
        of the LoRA adapter its steps use (one this server does not serve is refused ``unavailable``)."""
        runner = self._check_open(session_id, max_length, adapter)
        self._check_descriptors(push)
        guest = not self._trusted(peer_id)
        if guest:
            self._check_share(runner, peer_id, start_block, end_block, max_length, session_id)
        ahead = self.admission.ahead_of(guest)
        if ahead:  # opens waiting for slots are served first (FIFO; a trusted peer's before a stranger's)
            raise RefusedError("no_capacity", f"no capacity: {ahead} opens wait for slots")
        try:
            return self._allocate(session_id, start_block, end_block, max_length, peer_id, fork_from, fork_length,
                                  prefix_hashes, push=push, adapter=adapter)
        except NoCapacityError as e:
            raise self._no_capacity(e, start_block, end_block) from None

    async def open_session_wait(self, session_id: str, start_block: int, end_block: int, max_length: int,
                                peer_id: str, wait_s: float, prefix_hashes: Sequence[bytes] = (),
                                push: bool = False, adapter: Optional[str] = None) -> dict:
        """Like open_session, but wait up to ``wait_s`` seconds (FIFO with other waiters) for free slots."""
        runner = self._check_open(session_id, max_length, adapter)
        key = (peer_id, session_id) if wait_s > 0 else None
        # a wait holds its stream's descriptor too; a re-sent open takes its earlier wait's place (see the module
        # docstring) and holds no more than it: refused at the open-files cap, the client's retry never got back in
        self._check_descriptors(push, replacing=self._wait_pushes.get(key) if key is not None else None)
        if not runner.start_block <= start_block < end_block <= runner.end_block:
            raise RefusedError("invalid", f"span [{start_block}, {end_block}) is not a non-empty part of this "
                                          f"server's blocks [{runner.start_block}, {runner.end_block})")
        need = runner.pages_needed(end_block - start_block, max_length)
        if need > runner.pool.num_pages:
            raise RefusedError("no_capacity", f"no capacity: {need} cache pages needed, the server has "
                                              f"{runner.pool.num_pages} in all")
        guest = not self._trusted(peer_id)
        max_guests = None  # the wait queue's part strangers may fill (the rest kept for trusted opens)
        entry = None
        if guest:
            self._check_share(runner, peer_id, start_block, end_block, max_length, session_id)
            if wait_s > 0:
                earlier = self._waiting.get(session_id)
                if earlier is not None and earlier[0] != peer_id:  # its pages are counted under the id once
                    raise RefusedError("invalid", f"another peer's open of session {session_id!r} waits already")
                if earlier is None:  # a re-sent open takes its earlier wait's place: no new place in the queue
                    self._check_waits(peer_id)
                if self.trusted:  # checked where the open would queue: one that fits now opens at once
                    max_guests = math.floor(self.stranger_shares.strangers * self.admission.max_waiters)
                entry = self._waiting[session_id] = (peer_id, need)  # its pages count against its share while it waits
        waits = int(push)  # counted as a push session's while it waits (and as it is served: briefly twice)
        self._push_waiting += waits
        keyed = None if key is None else [push]
        if keyed is not None:
            self._wait_pushes[key] = keyed
        try:
            return await self.admission.acquire(
                lambda: self._allocate(session_id, start_block, end_block, max_length, peer_id,
                                       prefix_hashes=prefix_hashes, push=push, adapter=adapter), wait_s,
                release=lambda _result: self.close_session(session_id), guest=guest, max_guests=max_guests,
                key=key)
        except NoCapacityError as e:
            raise self._no_capacity(e, start_block, end_block) from None
        except WaitRefused as e:
            if e.reason == "guests_full":
                raise RefusedError(STRANGER_QUOTA, f"stranger quota: {e} (--max-kv-share-strangers "
                                                   f"{self.stranger_shares.strangers:g} of --max-waiters "
                                                   f"{self.admission.max_waiters})") from None
            if e.reason == "replaced":  # this stream's client sent the open again (elsewhere): this one is void
                raise RefusedError("invalid", f"open of session {session_id!r} replaced: {e}") from None
            raise RefusedError("no_capacity", f"no capacity: {e}") from None
        finally:
            self._push_waiting -= waits
            if entry is not None and self._waiting.get(session_id) is entry:  # not the entry of an open replacing it
                del self._waiting[session_id]
            if keyed is not None and self._wait_pushes.get(key) is keyed:
                del self._wait_pushes[key]

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        sess = self._open(session_id)
        if position + hidden.shape[1] > sess.max_length:
            raise RefusedError("invalid", f"positions {position}..{position + hidden.shape[1] - 1} exceed the "
                                          f"session's max_length {sess.max_length}")
        try:
            # The runner's batch scheduler runs concurrent sessions' steps in one forward per block (issue 7);
            # a lone short step runs inline (a thread hand-off costs ~1.5 ms here) and longer work runs off the
            # event loop, so pings and other streams stay responsive.
            out = await sess.runner.forward_async(session_id, hidden, position, inline_max_tokens=INLINE_MAX_TOKENS)
        except NoCapacityError as e:  # a lean session's first step before its matched prefix needs pages
            raise self._no_capacity(e, *sess.span) from None
        except (ValueError, KeyError) as e:
            raise RefusedError("invalid", str(e)) from None
        finally:
            if self.sessions.get(session_id) is not sess:
                # closed during the step: its pages went back only now (the close's change notice came before, and
                # the record showed them held until the next refresh)
                self._on_change()
            if len(self.admission):  # a first step on a cached prefix returns the pages it no longer needs
                self.admission.notify()
        sess.steps += 1
        return out

    def extend_session(self, session_id: str, max_length: int) -> dict:
        """Raise an open session's token limit (a paged KV cache takes the pages now); ``no_capacity`` leaves it as
        it was. Running sessions go before opens waiting in the FIFO: refusing would preempt work already done."""
        sess = self._open(session_id)
        top = sess.runner.max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= top:
            # before the share: a length no server would grant is a bad request, not a quota to wait out
            raise RefusedError("invalid", f"max_length must be an int in [1, {top}] (this server's max_length), "
                                          f"got {max_length!r}")
        if not self._trusted(sess.peer) and sess.runner is self.runner:
            span = sess.span[1] - sess.span[0]
            more = sess.runner.pages_needed(span, max_length) - sess.runner.pages_needed(span, sess.max_length)
            if more > 0:
                self._check_share(sess.runner, sess.peer, *sess.span, max_length, session_id, more=more)
        try:
            sess.runner.extend(session_id, max_length)
        except NoCapacityError as e:
            raise self._no_capacity(e, *sess.span) from None
        except (ValueError, KeyError) as e:
            raise RefusedError("invalid", str(e)) from None
        sess.max_length = max(sess.max_length, max_length)
        self._on_change()
        return {"max_length": sess.max_length, "cache_tokens_free": sess.runner.cache_tokens_free}

    def close_session(self, session_id: str, prefix_hashes: Sequence[bytes] = ()) -> None:
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self._push_open -= sess.push
            # The close names the tokens its pages hold; only a trusted orchestrator's word puts pages in the prefix
            # cache (with --allow-any-client anyone could close a session of garbage under a popular prompt's hashes,
            # and trusted sessions would reuse it).
            sess.runner.release(session_id, prefix_hashes if sess.peer in self.trusted else ())
            self._closed.set()
            self._on_change()
            self.admission.notify()

    def info(self) -> dict:
        return {**self._describe(), "sessions": len(self.sessions), "admission": self.admission.stats(),
                "open_files": self.descriptors.stats(self.held(), self.held_push())}

    def session(self, session_id: str) -> Optional[OpenSession]:
        return self.sessions.get(session_id)

    # ------------------------------------------------------------------ for the lifecycle
    async def drain(self, timeout_s: float, forced: Callable[[], bool]) -> None:
        """Refuse waiting opens, wait up to ``timeout_s`` for open sessions to close (less once ``forced()``
        turns true, see :meth:`wake`), then release the rest. The caller has stopped new opens already."""
        self.admission.fail_all(lambda: RefusedError("unavailable", "server is draining, not accepting sessions"))
        deadline = time.monotonic() + timeout_s
        while self.sessions and time.monotonic() < deadline and not forced():
            self._closed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), timeout=min(1.0, deadline - time.monotonic()))
        if self.sessions:
            logger.warning(f"drain timeout: releasing {len(self.sessions)} open session(s)")
            for sid in list(self.sessions):
                self.close_session(sid)
                self._released[sid] = None
            while len(self._released) > RELEASED_IDS_KEPT:
                self._released.popitem(last=False)

    def wake(self) -> None:
        """Make a drain look at ``forced()`` again now."""
        self._closed.set()

    # ------------------------------------------------------------------ internals
    def _trusted(self, peer_id: str) -> bool:
        return peer_id in self.trusted

    def stranger_pages(self, peer_id: str, exclude: str = "") -> tuple[int, int]:
        """Pages of the served runner's pool that ``peer_id`` and all strangers together hold or wait for, not
        counting session ``exclude``. A stranger matches no cached prefix, so a session holds exactly what its
        span and limit reserve."""
        runner = self.runner
        if runner is None:
            return 0, 0
        peer = together = 0
        for sid, sess in self.sessions.items():
            if sess.runner is runner and sid != exclude and not self._trusted(sess.peer):
                pages = runner.pages_needed(sess.span[1] - sess.span[0], sess.max_length)
                together += pages
                peer += pages if sess.peer == peer_id else 0
        for sid, (waiter, pages) in self._waiting.items():
            if sid != exclude:
                together += pages
                peer += pages if waiter == peer_id else 0
        return peer, together

    def stranger_slots_free(self) -> int:
        """Slots (sessions of ``max_length`` tokens per block, as ``slots_free`` counts them) a peer this server does
        not trust, holding nothing here yet, could open now: 0 without ``--allow-any-client``; within the free slots,
        the per-stranger cap and what the strangers together have left of theirs (whenever someone is trusted)."""
        runner = self.runner
        if runner is None or not self.allow_any_client:
            return 0
        per, together = self.stranger_shares.caps(runner.pool.num_pages, self._session_pages(runner))
        room = per if not self.trusted else min(per, together - self.stranger_pages("")[1])
        return max(0, min(runner.slots_free, room // runner.pages_per_slot))

    @staticmethod
    def _session_pages(runner: Any) -> int:
        """Pages of one session over the runner's whole span at its max length (the floor of the shares)."""
        return runner.pages_needed(runner.num_blocks, runner.max_length)

    def _check_waits(self, peer_id: str) -> None:
        """Refuse (``stranger_quota``) a stranger's new wait past its part of the wait queue."""
        waits = sum(1 for peer, _ in self._waiting.values() if peer == peer_id)
        cap = self.stranger_shares.waits_per_stranger(self.admission.max_waiters)
        if waits >= cap:
            raise RefusedError(STRANGER_QUOTA, f"stranger quota: this peer has {waits} opens waiting for slots "
                                               f"already; a peer this server does not trust may have at most {cap} "
                                               f"(--max-kv-share-per-stranger {self.stranger_shares.per_stranger:g} "
                                               f"of --max-waiters {self.admission.max_waiters})")

    def _check_share(self, runner: Any, peer_id: str, start_block: int, end_block: int, max_length: int,
                     session_id: str, more: Optional[int] = None, fits_first: bool = False) -> None:
        """Refuse (``stranger_quota``) a stranger's session of ``max_length`` tokens over the span, or ``more``
        pages for its open session ``session_id``, past its share of the pool (see the module docstring).
        ``fits_first``: raise NoCapacityError first if the pool lacks the pages (a stranger reserves them all)."""
        if not (isinstance(start_block, int) and isinstance(end_block, int)
                and runner.start_block <= start_block < end_block <= runner.end_block and max_length >= 1):
            return  # a bad request: refused as invalid where it is allocated
        if more is None:
            need = runner.pages_needed(end_block - start_block, max_length)
            if fits_first and need > (available := runner.pool.pages_available):
                # A queued open is tried at every step and close while the pool is full: the scan of all sessions
                # below made each such try O(sessions), a decode round O(sessions^2) on the event loop.
                raise NoCapacityError(f"no capacity: {need} cache page(s) needed, {available} of "
                                      f"{runner.pool.num_pages} available")
            peer, together = self.stranger_pages(peer_id, exclude=session_id)
        else:  # an extend: the session's own pages count as held
            need = more
            peer, together = self.stranger_pages(peer_id)
        why = self.stranger_shares.refusal(need, peer, together, runner.pool.num_pages, reserve=bool(self.trusted),
                                           session_pages=self._session_pages(runner))
        if why is not None:
            raise RefusedError(STRANGER_QUOTA, f"stranger quota: {why}")

    def _open(self, session_id: str) -> OpenSession:
        """The open session ``session_id``; a session a drain released is ``unavailable`` (the server went away
        under it: its client fails over, as for a server gone), any other unknown id ``invalid``."""
        sess = self.sessions.get(session_id)
        if sess is None:
            if session_id in self._released:
                raise RefusedError("unavailable", f"session {session_id!r} was released: the server drained")
            raise RefusedError("invalid", f"unknown session {session_id!r}")
        return sess

    def held(self) -> int:
        """Sessions open or waiting for slots: each holds its stream's descriptor (see :class:`Descriptors`)."""
        return len(self.sessions) + len(self.admission)

    def held_push(self) -> int:
        """Of :meth:`held`, the sessions opened (or waiting to open) with a ``push_token``: they hold a push relay's
        streams too."""
        return self._push_open + self._push_waiting

    def _check_descriptors(self, push: bool = False, replacing: Optional[list[bool]] = None) -> None:
        """Refuse an open ``no_capacity`` (its client places the work elsewhere or retries; no ban) while the
        open-files limit is nearly reached: past it no stream could be accepted, and every open hung unanswered.
        ``push``: the open carries a ``push_token`` (it will hold a push relay's streams too). ``replacing``: the
        waiting open it takes the place of (``[push]``), not counted."""
        held, held_push = self.held(), self.held_push()
        if replacing is not None:
            held, held_push = held - 1, held_push - int(replacing[0])
        why = self.descriptors.refusal(held, held_push, opening_push=push)
        if why is not None:
            raise RefusedError("no_capacity", f"no capacity: {why}")

    def _check_open(self, session_id: str, max_length: int, adapter: Optional[str] = None):
        runner = self.runner
        state = self._state()
        if state != "online" or runner is None:
            raise RefusedError("unavailable", f"server is {state}, not accepting sessions")
        if adapter is not None and adapter not in runner.adapters:
            # unavailable, as a model this server does not serve now: its record (the orchestrator's view) is stale
            served = ", ".join(f"{name} ({fp})" for fp, name in runner.adapters.items()) or "none"
            raise RefusedError("unavailable", f"this server does not serve LoRA adapter {adapter} (it serves "
                                              f"{served})")
        if max_length > runner.max_length:
            raise RefusedError("invalid", f"max_length {max_length} exceeds this server's {runner.max_length}")
        if session_id in self.sessions:
            raise RefusedError("invalid", f"session {session_id!r} is already open")
        if session_id in self._released:
            # the stream that opened it may still be open: its steps and close would act on a new session of that id,
            # another peer's (which read and wrote its K/V, and was closed by it)
            raise RefusedError("invalid", f"session {session_id!r} was released by a drain: open under a new id")
        return runner

    def _allocate(self, session_id: str, start_block: int, end_block: int, max_length: int, peer_id: str,
                  fork_from: Optional[str] = None, fork_length: int = 0, prefix_hashes: Sequence[bytes] = (), *,
                  push: bool = False, adapter: Optional[str] = None) -> dict:
        """Check and allocate; raises NoCapacityError when the slots are not free (yet).

        ``fork_from``: an open session of the same peer and span whose first ``fork_length`` tokens of KV the
        new session starts with (``n > 1`` samples of one prompt share its prefill). ``prefix_hashes``: the
        prompt's names; the reply's ``cached_tokens`` is how much of it the prefix cache holds."""
        runner = self._check_open(session_id, max_length, adapter)
        if not self._trusted(peer_id):  # again when a queued open gets its turn: the peer may hold more now
            self._check_share(runner, peer_id, start_block, end_block, max_length, session_id,
                              fits_first=fork_from is None)
        cached = 0
        try:
            if fork_from is None:
                # a stranger (--allow-any-client) matches no cached page: the reply's cached_tokens (and the time
                # saved) would tell it which prompts others sent, and its steps would read their K/V
                cached = runner.allocate(session_id, start_block, end_block, max_tokens=max_length,
                                         prefix_hashes=prefix_hashes if peer_id in self.trusted else (),
                                         **({"adapter": adapter} if adapter is not None else {}))
            else:
                src = self.sessions.get(fork_from)
                if src is None or src.peer != peer_id or src.span != (start_block, end_block):
                    raise ValueError(f"cannot fork {fork_from!r}: no open session of this peer over blocks "
                                     f"[{start_block}, {end_block})")
                if src.adapter != adapter:  # its K/V were computed with another adapter (or none)
                    raise ValueError(f"cannot fork {fork_from!r}: it runs with "
                                     f"{'adapter ' + src.adapter if src.adapter else 'the base model'}, this open "
                                     f"with {'adapter ' + adapter if adapter else 'the base model'}")
                runner.fork(fork_from, session_id, fork_length, max_tokens=max_length)
        except (ValueError, KeyError) as e:
            raise RefusedError("invalid", str(e)) from None
        self.sessions[session_id] = OpenSession(runner, max_length, peer_id, (start_block, end_block), push=push,
                                                adapter=adapter)
        self._push_open += push
        waiting = self._waiting.get(session_id)
        if waiting is not None and waiting[0] == peer_id:  # (another peer's wait under this id fails at its turn)
            del self._waiting[session_id]  # served: its pages count as held now, not twice until its waiter wakes
        self._on_change()
        return {"slots_free": runner.slots_free, "cache_tokens_free": runner.cache_tokens_free,
                "start_block": start_block, "end_block": end_block, "cached_tokens": cached,
                "prefix_cache": bool(runner.prefix_cache)}

    def _no_capacity(self, e: Exception, start_block: int, end_block: int) -> RefusedError:
        runner = self.runner
        free, total = (runner.slots_free, runner.slots_total) if runner is not None else (0, 0)
        tokens = f", {runner.kv_cache} KV cache" if runner is not None else ""
        return RefusedError("no_capacity", f"no capacity: {e} (slots free {free} of {total}{tokens}, "
                                           f"{end_block - start_block} blocks asked for)")
