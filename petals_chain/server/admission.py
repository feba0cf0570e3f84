"""Bounded FIFO wait for cache slots (used by opens that carry ``wait_s > 0``).

PETALS-style per-request routing sends a request to its servers at arrival and lets it wait there until
enough cache frees up (no central queue). A waiting open is served in arrival order: when slots free up,
the oldest waiter is tried first and nobody behind it is served while it still does not fit (no
overtaking, so a request needing many slots cannot starve). The number of waiters and each wait are
bounded; a waiter that gives up (timeout, client disconnect) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class WaitRefused(Exception):
    """The open cannot wait: the queue is full or its wait ran out (``reason``: ``queue_full`` | ``timeout``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class _Waiter:
    try_alloc: Callable[[], Any]
    future: asyncio.Future
    since: float = field(default_factory=time.monotonic)


class SlotWaitQueue:
    """FIFO of opens waiting for slots; ``notify()`` after every release.

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

    async def acquire(self, try_alloc: Callable[[], Any], wait_s: float,
                      release: Optional[Callable[[Any], None]] = None) -> Any:
        """Allocate now if nobody waits ahead and it fits, else wait up to ``min(wait_s, max_wait_s)`` seconds.

        ``release(result)`` undoes an allocation that was made for a waiter that was cancelled at that moment.
        Raises ``no_capacity`` (``wait_s <= 0`` and it does not fit), :class:`WaitRefused` or ``try_alloc``'s error.
        """
        if not self._queue:
            try:
                return try_alloc()
            except self.no_capacity:
                if wait_s <= 0:
                    raise
        elif wait_s <= 0:
            return try_alloc()  # an open that does not wait keeps today's behaviour (it may still fit)
        if len(self._queue) >= self.max_waiters:
            raise WaitRefused("queue_full", f"{len(self._queue)} opens already wait for slots (limit {self.max_waiters})")
        limit = min(float(wait_s), self.max_wait_s)
        waiter = _Waiter(try_alloc, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
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
