"""Bounded FIFO wait for cache slots (used by opens that carry ``wait_s > 0``).

PETALS-style per-request routing sends a request to its servers at arrival and lets it wait there until
enough cache frees up (no central queue). A waiting open is served in arrival order: when slots free up,
the oldest waiter is tried first and nobody behind it is served while it still does not fit (no
overtaking, so a request needing many slots cannot starve). The number of waiters and each wait are
bounded; a waiter that gives up (timeout, client disconnect) leaves the queue at once. *Guests* (peers the server
does not trust, ``--allow-any-client``) wait behind every trusted waiter and are overtaken by trusted opens.

:class:`StrangerShares` bounds what guests hold: one peer id at most ``--max-kv-share-per-stranger`` of the KV pool,
all of them together at most ``--max-kv-share-strangers`` (a stranger makes new peer ids cheaply; the rest is the
trusted orchestrators' reserve). Each cap is at least one session over the server's whole span at its max length
(a small server whose shares round down below one session still serves one stranger at a time). A refusal by these
caps has its own code, :data:`STRANGER_QUOTA`.

An open that waits may name a key (its peer and session id): a second wait under the same key takes the first's place
in the queue, and the first is refused (``replaced``): a client that re-sends its open (its first stream broke) keeps
its turn and holds one place, not two.

:class:`Descriptors` bounds what the server's open-files limit (``ulimit -n``) can hold: each open session, and each
open waiting for slots, holds the descriptor of its P2P stream (measured with the tiny model: one per stream in the
server process, and one in p2pd's); a session opened with a ``push_token`` (``--relay push``) holds three, its stream
and a step's push in from the previous hop and out to the next. Past the limit hivemind could not even accept a
stream: every open hung unanswered until its client gave up (150 opens at ``ulimit -n 128``: none served in 120 s,
and the server's record publishing failed). An open is refused ``no_capacity`` while fewer than
:data:`DESCRIPTOR_RESERVE` descriptors are left, or when the sessions held and it would hold more than the limit
leaves them; the record announces no more slots than the free descriptors hold, and the sessions the limit holds
(``max_sessions``), at three descriptors each for :data:`PUSH_SEEN_S` after a push open, else one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

STRANGER_QUOTA = "stranger_quota"  # refusal code: an untrusted peer's open or extend is over its share of the pool
DEFAULT_MAX_KV_SHARE_PER_STRANGER = 0.25
DEFAULT_MAX_KV_SHARE_STRANGERS = 0.5
# Open files kept for the server's own work, not a session's stream: the record's trip to the DHT process (torch
# shared memory, failing with EMFILE at the limit), logging, a refusal's stream, a push's stream to the next hop
DESCRIPTOR_RESERVE = 32
# Open files one session holds: its stream from the orchestrator (measured: 8 sessions held 9 more under --relay
# orchestrator). Counting 3 for each, as a push session holds, capped a server at ulimit -n 1024 at 320 sessions
# where 960 fit.
DESCRIPTORS_PER_SESSION = 1
# Open files a session opened with a push_token holds: its stream and, per step, a stream from the previous hop and
# one to the next (at ulimit -n 128 two push servers held 127 each with 2 counted: pushes and the record failed with
# EMFILE, and a server was declared failed)
DESCRIPTORS_PER_PUSH_SESSION = 3
# How long after a push open the record announces sessions at DESCRIPTORS_PER_PUSH_SESSION each (seconds): the
# server cannot tell its orchestrators' relay from anything but their opens, and over-announcing under a push relay
# gets the planner's jobs refused
PUSH_SEEN_S = 600.0
# Open files an idle server holds (measured ~20): the part of the limit no session can have, in the announced capacity
DESCRIPTORS_IDLE = 32
# How often a refusal for want of descriptors is logged while it lasts (seconds)
DESCRIPTOR_LOG_S = 60.0
# How long a count of the open descriptors is taken again while far from the limit (seconds; see Descriptors.in_use)
DESCRIPTOR_COUNT_MAX_AGE_S = 1.0

logger = logging.getLogger("petals_chain.server")


def check_share(flag: str, value: object) -> float:
    """``value`` as a fraction in (0, 1], or a ValueError naming ``flag``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1  # NaN fails too
    if not ok:
        raise ValueError(f"{flag} must be a fraction in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StrangerShares:
    """The parts of the KV pool peers the server does not trust may hold (see the module docstring)."""

    per_stranger: float = DEFAULT_MAX_KV_SHARE_PER_STRANGER
    strangers: float = DEFAULT_MAX_KV_SHARE_STRANGERS

    def __post_init__(self) -> None:
        check_share("--max-kv-share-per-stranger", self.per_stranger)
        check_share("--max-kv-share-strangers", self.strangers)

    def caps(self, pool_pages: int, session_pages: int = 0) -> tuple[int, int]:
        """Pages of a pool of ``pool_pages`` one stranger, and all strangers together, may hold: the shares rounded
        down, but each at least ``session_pages`` (one session over the server's whole span at its max length;
        at most the pool). Without that floor a server holding fewer than 1 / share such sessions (3 slots on 2
        blocks: "at most 0 of its 3") refused every stranger's session even when idle."""
        one = min(max(0, int(session_pages)), pool_pages)
        return (max(math.floor(self.per_stranger * pool_pages), one),
                max(math.floor(self.strangers * pool_pages), one))

    def refusal(self, need: int, peer_holds: int, strangers_hold: int, pool_pages: int, *,
                reserve: bool = True, session_pages: int = 0) -> Optional[str]:
        """Why a stranger holding ``peer_holds`` pages may not take ``need`` more while all strangers hold
        ``strangers_hold`` of ``pool_pages``; None if it may. ``reserve``: keep the trusted peers' part (there are
        some); without it only the per-peer cap applies. ``session_pages``: the floor of both caps (:meth:`caps`)."""
        per, together = self.caps(pool_pages, session_pages)
        floor = ", at least one session of its whole span" if session_pages and per > math.floor(
            self.per_stranger * pool_pages) else ""
        if need > per:
            return (f"{need} cache pages asked for; a peer this server does not trust may hold at most {per} of its "
                    f"{pool_pages} (--max-kv-share-per-stranger {self.per_stranger:g}{floor})")
        if peer_holds + need > per:
            return (f"this peer holds (or waits for) {peer_holds} cache pages and asks for {need} more; a peer this "
                    f"server does not trust may hold at most {per} of its {pool_pages} "
                    f"(--max-kv-share-per-stranger {self.per_stranger:g}{floor}): close a session first")
        floor = ", at least one session of its whole span" if session_pages and together > math.floor(
            self.strangers * pool_pages) else ""
        if reserve and strangers_hold + need > together:
            return (f"peers this server does not trust hold (or wait for) {strangers_hold} cache pages, {need} more "
                    f"asked for; together they may hold at most {together} of its {pool_pages}, the rest is kept for "
                    f"its trusted orchestrators (--max-kv-share-strangers {self.strangers:g}{floor})")
        return None

    def waits_per_stranger(self, max_waiters: int) -> int:
        """Queued opens one stranger may have: ``--max-kv-share-per-stranger`` of ``max_waiters``, at least 1 (the
        page cap alone let one peer id fill the strangers' part of the queue with one-page opens)."""
        return max(1, math.floor(self.per_stranger * max_waiters))


def _open_files() -> Optional[int]:
    """Descriptors this process has open (None where the platform does not say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir held
    except OSError:
        return None


def _open_files_limit() -> Optional[int]:
    """The soft open-files limit (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


class Descriptors:
    """This process's open descriptors against its open-files limit, for admission and the announced slots (see the
    module docstring). ``limit`` is read at each call; ``in_use`` (tests give fakes) is counted at most once per
    ``max_age_s`` while the last count left over a quarter of the limit free (:meth:`in_use`).

    ``sessions`` is the number of sessions open or waiting for slots, ``push`` how many of them were opened with a
    ``push_token`` (they hold ``per_push`` descriptors each, the others ``per_session``)."""

    def __init__(self, *, reserve: int = DESCRIPTOR_RESERVE, per_session: int = DESCRIPTORS_PER_SESSION,
                 per_push: int = DESCRIPTORS_PER_PUSH_SESSION, idle: int = DESCRIPTORS_IDLE,
                 in_use: Callable[[], Optional[int]] = _open_files,
                 limit: Callable[[], Optional[int]] = _open_files_limit, log_period_s: float = DESCRIPTOR_LOG_S,
                 max_age_s: float = DESCRIPTOR_COUNT_MAX_AGE_S, push_seen_s: float = PUSH_SEEN_S,
                 clock: Callable[[], float] = time.monotonic):
        if reserve < 0 or per_session < 1 or per_push < per_session or idle < 0 or not max_age_s >= 0 \
                or not push_seen_s >= 0:
            raise ValueError("reserve, idle, max_age_s and push_seen_s must be >= 0, per_session >= 1 and "
                             "per_push >= per_session")
        self.reserve, self.per_session, self.per_push, self.idle = int(reserve), int(per_session), int(per_push), \
            int(idle)
        self._in_use, self._limit, self._clock = in_use, limit, clock
        self.log_period_s, self.max_age_s, self.push_seen_s = float(log_period_s), float(max_age_s), float(push_seen_s)
        self.refused = 0  # opens refused for want of descriptors
        self.counts = 0  # times the descriptors were counted
        self._logged_at, self._logged_refused = -math.inf, 0
        self._counted: Optional[int] = None  # the last count, when, and the descriptors the sessions held then held
        self._counted_at, self._counted_held = -math.inf, 0
        self._push_seen_at = -math.inf  # the last open with a push_token

    def held(self, sessions: int = 0, push: int = 0) -> int:
        """Descriptors ``sessions`` open or waiting hold, ``push`` of them opened with a ``push_token``."""
        push = min(max(0, push), max(0, sessions))
        return (max(0, sessions) - push) * self.per_session + push * self.per_push

    def saw_push(self) -> None:
        """An open with a ``push_token`` came: the record announces sessions at ``per_push`` each for a while."""
        self._push_seen_at = self._clock()

    @property
    def per_announced(self) -> int:
        """Descriptors the record counts per session: ``per_push`` within ``push_seen_s`` of a push open (its
        orchestrator relays by push), else ``per_session``."""
        return self.per_push if self._clock() - self._push_seen_at < self.push_seen_s else self.per_session

    def in_use(self, sessions: int = 0, limit: Optional[int] = None, push: int = 0) -> Optional[int]:
        """Descriptors open now, with ``sessions`` open or waiting (None: the platform does not say). Counting them
        lists ``/proc/self/fd`` (5 ms at 10,000 descriptors, on the event loop at every open): within ``max_age_s``
        of the last count, and while it left more than a quarter of ``limit`` free, the last count is taken again,
        plus the descriptors of the sessions held since (:meth:`held`; so a storm of opens is still counted)."""
        now = self._clock()
        held = self.held(sessions, push)
        if self._counted is not None and limit is not None and now - self._counted_at < self.max_age_s:
            estimate = self._counted + max(0, held - self._counted_held)
            if limit - self.reserve - estimate > max(limit // 4, 4 * self.reserve):
                return estimate
        counted = self._in_use()
        self.counts += 1
        self._counted, self._counted_at, self._counted_held = counted, now, held
        return counted

    def free(self, sessions: int = 0, push: int = 0) -> Optional[int]:
        """Descriptors left to sessions now, with ``sessions`` open or waiting (the reserve kept back; may be
        negative); None: no limit known."""
        limit = self._limit()
        in_use = None if limit is None else self.in_use(sessions, limit, push)
        return None if limit is None or in_use is None else limit - self.reserve - in_use

    def _budget(self, limit: int) -> int:
        """Descriptors the limit leaves to sessions, past an idle server's and the reserve."""
        return max(0, limit - self.idle - self.reserve)

    def sessions_free(self, sessions: int = 0, push: int = 0) -> Optional[int]:
        """More sessions admission takes now, with ``sessions`` open or waiting (``push`` of them push sessions), at
        :attr:`per_announced` descriptors each: as many as the free descriptors hold, and as the limit leaves past
        the sessions held; None: any number."""
        limit = self._limit()
        if limit is None:
            return None
        per, free = self.per_announced, self.free(sessions, push)
        room = (self._budget(limit) - self.held(sessions, push)) // per
        return max(0, room if free is None else min(room, free // per))

    def sessions_total(self) -> Optional[int]:
        """Sessions the limit holds at once (at :attr:`per_announced` descriptors each), past an idle server's
        descriptors and the reserve; None: any number."""
        limit = self._limit()
        return None if limit is None else self._budget(limit) // self.per_announced

    def refusal(self, sessions: int = 0, push: int = 0, *, opening_push: bool = False) -> Optional[str]:
        """Why an open (or a wait for slots, which holds its stream) is refused now, with ``sessions`` open or waiting
        already (``push`` of them push sessions); ``opening_push``: it carries a ``push_token``. None if it may
        proceed. Refused when the descriptors left are within the reserve, or when the sessions held and this one
        would hold more than the limit leaves them (a push session's later streams are taken after its open).
        Logged once per ``log_period_s`` while it lasts (a storm refused hundreds of opens a second)."""
        if opening_push:
            self.saw_push()
        limit = self._limit()
        if limit is None:
            return None
        in_use = self.in_use(sessions, limit, push)
        free = None if in_use is None else limit - self.reserve - in_use
        held = self.held(sessions, push)
        need = self.per_push if opening_push else self.per_session
        if (free is None or free > 0) and held + need <= self._budget(limit):
            return None
        why = (f"this server is out of open files ({in_use} of its limit of {limit} in use, {self.reserve} kept for "
               f"its own work; {sessions} sessions open or waiting, {push} of them push sessions, holding {held}: "
               f"{self.per_session} each, {self.per_push} a push session): raise ulimit -n where it starts")
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= self.log_period_s:
            logger.warning("opens refused for want of descriptors: %d since the last warning; %s",
                           self.refused - self._logged_refused, why)
            self._logged_at, self._logged_refused = now, self.refused
        return why

    def stats(self, sessions: int = 0, push: int = 0) -> dict:
        """The open-files picture for ``info``: the limit, the descriptors in use (as last counted or estimated), the
        sessions the limit holds and those admission takes now (None: not known or not bounded), and the descriptors
        the record counts per session."""
        limit = self._limit()
        return {"limit": limit, "in_use": None if limit is None else self.in_use(sessions, limit, push),
                "sessions_total": self.sessions_total(), "sessions_free": self.sessions_free(sessions, push),
                "refused": self.refused, "per_session": self.per_announced}


class WaitRefused(Exception):
    """The open cannot wait: the queue (or its guests' part) is full, its wait ran out or a later open under its key
    took its place (``reason``: ``queue_full`` | ``guests_full`` | ``timeout`` | ``replaced``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class _Waiter:
    try_alloc: Callable[[], Any]
    future: asyncio.Future
    guest: bool = False  # an untrusted peer's open: served after every trusted waiter
    key: Optional[Hashable] = None  # a later wait under the same key replaces this one
    since: float = field(default_factory=time.monotonic)


class SlotWaitQueue:
    """FIFO of opens waiting for slots (trusted ones ahead of guests); ``notify()`` after every release.

    ``try_alloc()`` must either allocate and return a result, raise ``no_capacity`` (the exception type given
    to the constructor: not enough slots yet, keep waiting) or raise anything else (the open fails with it).
    """

    def __init__(self, no_capacity: type[BaseException], *, max_waiters: int = 256, max_wait_s: float = 600.0):
        if max_waiters < 0 or not (max_wait_s >= 0):
            raise ValueError("max_waiters and max_wait_s must be >= 0")
        self.no_capacity = no_capacity
        self.max_waiters = int(max_waiters)
        self.max_wait_s = float(max_wait_s)
        self._queue: collections.deque[_Waiter] = collections.deque()
        self.served = 0  # opens that waited and then got their slots
        self.timeouts = 0
        self.abandoned = 0  # waiters removed because their client went away

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def guests(self) -> int:
        """Guests' opens waiting."""
        return sum(w.guest for w in self._queue)

    def ahead_of(self, guest: bool) -> int:
        """Waiters a new open would queue behind: all of them for a guest, the trusted ones for a trusted peer."""
        return len(self._queue) if guest else len(self._queue) - self.guests

    async def acquire(self, try_alloc: Callable[[], Any], wait_s: float,
                      release: Optional[Callable[[Any], None]] = None, *, guest: bool = False,
                      max_guests: Optional[int] = None, key: Optional[Hashable] = None) -> Any:
        """Allocate now if nobody waits ahead and it fits, else wait up to ``min(wait_s, max_wait_s)`` seconds.

        ``release(result)`` undoes an allocation that was made for a waiter that was cancelled at that moment.
        ``guest``: an untrusted peer's open, queued behind every trusted one (a stranger's open waiting at the head
        held up every trusted open behind it). ``max_guests``: guests' opens that may wait at once (None: any number
        up to ``max_waiters``); it bounds only opens that must wait. ``key``: a queued waiter under the same key is
        refused (``replaced``) and this open takes its place (the queue does not grow). Raises ``no_capacity``
        (``wait_s <= 0`` and it does not fit), :class:`WaitRefused` (``guests_full`` past ``max_guests``) or
        ``try_alloc``'s error.
        """
        if not self.ahead_of(guest):
            try:
                return try_alloc()
            except self.no_capacity:
                if wait_s <= 0:
                    raise
        elif wait_s <= 0:
            return try_alloc()  # an open that does not wait keeps today's behaviour (it may still fit)
        old = None if key is None else next((w for w in self._queue  # a peer trusted since (or no more) queues anew
                                             if w.key == key and w.guest == guest and not w.future.done()), None)
        if old is None and len(self._queue) >= self.max_waiters:
            raise WaitRefused("queue_full", f"{len(self._queue)} opens already wait for slots "
                                            f"(limit {self.max_waiters})")
        if old is None and guest and max_guests is not None and self.guests >= max_guests:
            raise WaitRefused("guests_full", f"{self.guests} opens of peers this server does not trust wait for slots "
                                             f"already (at most {max_guests})")
        limit = min(float(wait_s), self.max_wait_s)
        waiter = _Waiter(try_alloc, asyncio.get_running_loop().create_future(), guest=guest, key=key)
        if old is not None:  # its turn, and its place among the trusted waiters or the guests
            waiter.since = old.since
            self._queue[self._queue.index(old)] = waiter
            old.future.set_exception(WaitRefused("replaced", "a later open under the same session id and peer took "
                                                             "this one's place in the queue"))
            self.notify()  # at the head, the new open may fit where the old one did not
        elif guest:
            self._queue.append(waiter)
        else:  # behind the trusted waiters, ahead of the guests
            self._queue.insert(self.ahead_of(False), waiter)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=limit)
        except asyncio.CancelledError:
            self._forget(waiter, release)
            self.abandoned += 1
            raise
        if not done:
            self._forget(waiter, release)
            self.timeouts += 1
            raise WaitRefused("timeout", f"no slots freed up within {limit:.3g} s")
        if waiter.future.exception() is None:
            self.served += 1
        return waiter.future.result()

    def _forget(self, waiter: _Waiter, release: Optional[Callable[[Any], None]]) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None and release is not None:
            release(fut.result())  # allocated just as the waiter gave up: give the slots back
        elif not fut.done():
            fut.cancel()
        self.notify()  # the head may have changed: someone behind may fit now

    def notify(self) -> None:
        """Serve waiters in FIFO order while the oldest one fits."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.future.done():
                self._queue.popleft()
                continue
            try:
                result = waiter.try_alloc()
            except self.no_capacity:
                return
            except Exception as e:  # noqa: BLE001 - the open fails with this error (e.g. server draining)
                self._queue.popleft()
                waiter.future.set_exception(e)
                continue
            self._queue.popleft()
            waiter.future.set_result(result)

    def fail_all(self, exc_factory: Callable[[], BaseException]) -> None:
        """Fail every waiter (the server stops serving, e.g. draining for a reload)."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(exc_factory())

    def stats(self) -> dict:
        oldest = (time.monotonic() - self._queue[0].since) if self._queue else 0.0
        return {"waiting": len(self._queue), "served": self.served, "timeouts": self.timeouts,
                "abandoned": self.abandoned, "oldest_wait_s": oldest}
