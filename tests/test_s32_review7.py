"""Review of the planner's searches in a thread (2902701): what the thread shares with the event loop."""

from __future__ import annotations

import threading
from collections import deque

from petals_chain.orchestrator.planner import RateEstimator


class _HookDeque(deque):
    """A deque whose next ``popleft`` first runs ``hook``: another thread's trim landing between the check of the
    oldest arrival and its pop, deterministically."""

    hook = None

    def popleft(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().popleft()


def test_the_arrival_rate_read_from_the_planners_thread_and_the_loop_at_once_loses_no_refresh():
    # the planner's search (a thread) asks rate() for every bound while the event loop asks it too (an arrival, the
    # swarm API): both trimmed the same expired arrival, and the second popleft() raised IndexError out of the
    # refresh (its re-plan lost)
    est = RateEstimator(window_s=300.0)
    est.t0 = 0.0
    est.arrivals = _HookDeque([1.0])
    errors: list[BaseException] = []

    def loop_side() -> None:
        try:
            est.rate(now=1000.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    other = threading.Thread(target=loop_side, daemon=True)

    def hook() -> None:
        other.start()
        other.join(timeout=0.5)  # it finishes here without a lock; with one it waits for ours (joined below)

    est.arrivals.hook = hook
    try:
        rate = est.rate(now=1000.0)
    finally:
        other.join(timeout=30)
    assert not other.is_alive() and not errors
    assert len(est.arrivals) == 0
    assert rate == est.rate(now=1000.0) == (0.5 * 30.0) / (300.0 + 30.0)
