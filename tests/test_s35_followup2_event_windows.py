"""The fair-sharing service meter (``ServiceMeter``, the orchestrator's ``shares.meter``) and the placement's mix
drift detector (``MixDriftDetector``) kept one entry per event of their windows: memory and time grew with the
request rate. They now count in buckets: the entries are bounded by buckets x clients (models), and what they report
stays within 1 % of the exact per-event figures on traces of 60,000 events."""

from __future__ import annotations

import bisect
import random
from collections import defaultdict

import pytest

from petals_chain.algorithms.fairness import ServiceMeter, jain_index
from petals_chain.algorithms.multimodel import MixDriftDetector

# entries per client (model) at most: 120 buckets in the window and the one its start cuts (60 s in 0.5 s buckets,
# 120 s in 1 s buckets), and one more fed late (the placement feeds each model's round in turn)
ENTRIES_PER_KEY = 122


def test_the_service_meter_keeps_one_entry_per_client_and_bucket_and_reports_as_before():
    """60,000 service events of 3 clients over 300 s (200 a second, some negative corrections), a 60 s window:
    rates and Jain's index within 1 % of the exact ones at every read, at most 121 entries per client (the old
    meter held every event of the window: ~12,000)."""
    rng = random.Random(7)
    window, clients = 60.0, ("a", "b", "c")
    weight = {"a": 1.0, "b": 1.3, "c": 0.7}
    m = ServiceMeter(window_s=window)
    events: list[tuple[float, str, float]] = []
    t, most, reads = 1000.0, 0, 0
    for i in range(60_000):
        t += rng.expovariate(200.0)
        c = rng.choice(clients)
        units = rng.uniform(1.0, 40.0) * weight[c] if rng.random() > 0.05 else -rng.uniform(0.0, 5.0)
        m.served(t, c, units)
        events.append((t, c, units))
        if i % 500 == 0:
            m.sample(t, clients)
        if i % 2000 == 1999:
            assert len(m._events) <= ENTRIES_PER_KEY * len(clients), (t, len(m._events))  # old: ~12,000
            exact: dict[str, float] = defaultdict(float)
            for te, ce, ue in events:
                if te >= t - window:
                    exact[ce] += ue
            got = m.rates(t)
            for ce in clients:
                assert got[ce] == pytest.approx(exact[ce] / window, rel=0.01), (t, ce)
            if t - 1000.0 > window:  # backlogged through a whole window: compared
                jain = jain_index([exact[ce] / window for ce in clients])
                assert m.jain(t) == pytest.approx(jain, rel=0.01)
            reads += 1
        most = max(most, len(m._events))
    assert reads == 30 and most <= ENTRIES_PER_KEY * len(clients), most


def test_the_mix_drift_detector_keeps_one_entry_per_model_and_bucket_and_reports_as_before():
    """60,000 arrivals of 3 models, fed each model in turn per 2 s round (as the placement feeds them: a bucket comes
    again after later ones), the mix shifting from 60/30/10 to 20/30/50; a 120 s window: the mix, the rates, the
    count and the drift verdict as the exact ones (within 1 %) at every read, at most 121 entries per model (the old
    detector held every arrival of the window: ~24,000)."""
    rng = random.Random(11)
    window, models = 120.0, ("a", "b", "c")
    d = MixDriftDetector(window_s=window, threshold=0.2, min_arrivals=30)
    d.set_plan({"a": 0.6, "b": 0.3, "c": 0.1})
    times: dict[str, list[float]] = {m: [] for m in models}
    t0, most, reads = 5000.0, 0, 0
    for r in range(300):  # 600 s, 100 arrivals a second
        lo, shift = t0 + 2.0 * r, min(1.0, r / 150)
        share = {"a": 0.6 - 0.4 * shift, "b": 0.3, "c": 0.1 + 0.4 * shift}
        drawn = rng.choices(models, weights=[share[m] for m in models], k=200)
        for m in models:
            new = sorted(rng.uniform(lo, lo + 2.0) for x in drawn if x == m)
            for x in new:
                d.arrive(m, x)
            times[m].extend(new)
            most = max(most, len(d._events))
        now = lo + 2.0
        if r % 10 == 9:
            assert len(d._events) <= ENTRIES_PER_KEY * len(models), (now, len(d._events))  # old: ~24,000
            exact = {m: len(ts) - bisect.bisect_left(ts, now - window) for m, ts in times.items()}
            total = sum(exact.values())
            got_mix, got_rates = d.mix(now), d.rates(now)
            for m in models:
                assert got_mix[m] == pytest.approx(exact[m] / total, rel=0.01), (now, m)
                assert got_rates[m] == pytest.approx(exact[m] / window, rel=0.01), (now, m)
            assert d.count(now) == pytest.approx(total, rel=0.01)
            distance = 0.5 * sum(abs(exact[m] / total - d.planned[m]) for m in models)
            if abs(distance - d.threshold) > 0.01 * d.threshold:
                assert d.drifted(now) == (distance > d.threshold), (now, distance)
            reads += 1
    assert sum(len(ts) for ts in times.values()) >= 50_000
    assert reads == 30 and d.drifted(t0 + 600.0)
    assert most <= ENTRIES_PER_KEY * len(models), most


def test_an_arrival_or_service_at_the_windows_start_is_in_it_and_a_bad_window_is_refused():
    """Bucket edges are exact: an event at exactly ``now - window_s`` is counted (as the per-event windows did),
    one just before is not (as before the buckets); a window of 0 or less is refused (the detector took it, and
    divided by it)."""
    d = MixDriftDetector(window_s=10.0)
    for t in (5.9, 6.0, 7.0):
        d.arrive("a", t)
    assert d.rates(16.0) == {"a": pytest.approx(0.2)} and d.mix(16.0) == {"a": pytest.approx(1.0)}
    m = ServiceMeter(window_s=10.0)
    for t in (5.9, 6.0, 7.0):
        m.served(t, "a", 1.0)
    assert m.rates(16.0) == {"a": pytest.approx(0.2)}
    for cls in (MixDriftDetector, ServiceMeter):
        with pytest.raises(ValueError):
            cls(window_s=0.0)
