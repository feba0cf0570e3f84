"""Per-request windows bounded by count (soak hunt, session 35): the planner's arrival-rate window (300 s) kept every
arrival time (~12 MB at 1,000 req/s) and a client's last minute of tokens one entry per finished job. Both now count
per bucket: at most a few hundred entries whatever the rate, and the estimates as exact as before (within 1 % on a
Poisson trace; the per-minute tokens never fewer)."""

from __future__ import annotations

import random

import pytest

from petals_chain.orchestrator.planner import RateEstimator


def _exact(times: list[float], window_s: float, now: float) -> float:
    return sum(1 for t in times if now - window_s <= t <= now)


def test_the_arrival_rate_keeps_a_bounded_count_and_the_same_estimate_on_a_trace():
    rng = random.Random(7)
    times, t = [], 1000.0
    while t < 1400.0:  # 400 s of Poisson arrivals, 1,000 req/s for 60 s, then 20 req/s
        t += rng.expovariate(1000.0 if t < 1060.0 else 20.0)
        times.append(t)
    est = RateEstimator(window_s=300.0)
    est.t0 = 900.0
    checks = iter([1030.0, 1059.5, 1200.0, 1330.0, 1359.9, 1399.0])
    check = next(checks)
    sizes = []
    for t in times:
        while check is not None and t > check:
            prior = est.prior * est.prior_weight_s
            exact = (_exact(times, 300.0, check) + prior) / (min(300.0, check - est.t0) + est.prior_weight_s)
            assert est.rate(now=check) == pytest.approx(exact, rel=0.01), check
            sizes.append(len(est.arrivals))
            check = next(checks, None)
        est.arrive(t)
    assert max(sizes) <= 4096 and len(est.buckets) <= 301 and len(times) > 60_000, sizes
    # arrival times that come late (another thread's clock read first) are counted in their own bucket
    late = RateEstimator(window_s=300.0)
    late.t0 = 0.0
    for t in (10.2, 12.5, 11.1, 10.7):
        late.arrive(t)
    assert [b[0] for b in late.buckets] == [10, 11, 12] and late.count_since(11.0, now=13.0) == 2


def test_a_clients_last_minute_of_tokens_keeps_one_entry_a_second(monkeypatch):
    import time as time_mod

    from petals_chain.orchestrator.stats import Stats

    stats, now = Stats(), [5000.0]
    monkeypatch.setattr(time_mod, "monotonic", lambda: now[0])
    for _ in range(6000):  # a minute at 100 jobs/s
        now[0] += 0.01
        stats._charge("alice", 3, "completed")
    assert len(stats.usage_window("alice")) <= 61
    assert stats.tokens_last_minute("alice") >= 3 * 5999  # (what left the minute: at most the oldest second's)
    now[0] += 59.5  # the last second's tokens are still in the minute, never counted out early
    assert stats.tokens_last_minute("alice") >= 3 * 50
    now[0] += 1.0
    assert stats.tokens_last_minute("alice") == 0
