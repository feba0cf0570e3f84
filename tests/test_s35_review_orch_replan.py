"""Review of 959beb1 (session 35): the steps-per-job band's reference is the value the installed chains were computed
with, whatever recomputed them. Before, a recompute for another reason (a server's slots changed, a join, a ban) made
the chains at the estimate of that moment but left the reference where the band last moved it: the estimate could then
drift up to 25 % on the reference's far side, and the chains (their service times, the predictions and deadlines made
from them) stayed ~50 % off with no recompute. The planner is driven alone, with a fake clock and records."""

from __future__ import annotations

import pytest

from test_s31_blip import _online_swarm


def test_chains_recomputed_for_another_reason_move_the_steps_per_job_reference():
    sw = _online_swarm()
    for _ in range(8):  # measured compute: the chains' service times scale with the steps per job
        for n in "AB":
            sw.pl.observe_hop(n, 1, 2, None, compute_s=0.02)
    installs: list = []
    sw.pl.on_chains = installs.append
    sw.pl.steps_per_job = 10.0
    sw.refresh(1.0)
    sw.pl.steps_per_job = 12.2  # within 25 % of 10: nothing recomputed for it
    sw.refresh(1.0)
    assert len(installs) == 1
    sw.records["A"] = sw.records["A"].model_copy(update={"slots_total": 4, "slots_free": 4})
    sw.refresh(1.0)  # a real change: the chains are recomputed, at 12.2 steps per job
    assert len(installs) == 2 and installs[-1][0].service_time > 1.15 * installs[0][0].service_time
    sw.pl.steps_per_job = 8.2  # within 25 % of 10, but 33 % below the 12.2 the installed chains were computed with
    sw.refresh(1.0)
    sw.refresh(1.0)
    exact = sw.pl.evaluate(sw.pl.online_views(), sw.pl.plan.placement).chains[0].service_time
    assert len(installs) == 3, [e["reason"] for e in sw.pl.plan_log]
    assert installs[-1][0].service_time == pytest.approx(exact, rel=0.01)
    assert sw.pl.plan_log[-1]["reason"].startswith("steps per job 8.2")


@pytest.mark.parametrize("round_s", [2.0, 12.0])
def test_the_mix_drift_detector_counts_every_arrival_of_a_busy_round(round_s):
    """The planner's rate estimator keeps the latest 4,096 arrival times; the model placer fed its mix-drift detector
    with those alone, so a model with more arrivals in one placement round (10,000 req/s at the 2 s refresh; 1,000
    req/s in a 12 s round, a slow re-placement's) was read at 4,096 per round: a steady 10:1 mix read as ~2:1 (or
    ~5:1), a drift, and servers re-placed for nothing. Now the arrivals beyond the kept times are fed from the
    estimator's buckets."""
    from types import SimpleNamespace

    from petals_chain.algorithms.multimodel import MixDriftDetector
    from petals_chain.orchestrator.placement import ModelPlacer
    from petals_chain.orchestrator.planner import RateEstimator

    per_round = {"a": 20_000, "b": 2_000} if round_s == 2.0 else {"a": 12_000, "b": 1_200}
    rates = {n: RateEstimator() for n in per_round}
    placer = ModelPlacer.__new__(ModelPlacer)  # its arrival feed alone (the rest needs swarms)
    placer.orchs = {n: SimpleNamespace(planner=SimpleNamespace(rates=r)) for n, r in rates.items()}
    placer._last_arrival = {n: -float("inf") for n in rates}
    placer.drift = MixDriftDetector(window_s=120.0, threshold=0.2, min_arrivals=20)
    t0 = 1000.0
    for k in range(4):
        for n, count in per_round.items():
            for i in range(count):
                rates[n].arrive(t0 + k * round_s + (i + 0.5) * round_s / count)
        placer._note_arrivals(t0 + (k + 1) * round_s)
    now = t0 + 4 * round_s
    placer.drift.set_plan({"a": 10 / 11, "b": 1 / 11})
    mix = placer.drift.mix(now)
    assert mix["a"] == pytest.approx(10 / 11, abs=0.01) and not placer.drift.drifted(now), mix
    seen = sum(placer.drift.rates(now).values()) * placer.drift.window_s
    assert seen == pytest.approx(4 * sum(per_round.values()), abs=4)


def test_arrival_times_since_a_point_count_every_arrival_in_order():
    """``RateEstimator.times_since``: the kept times, and the arrivals older than those by their buckets (a Poisson
    burst of 20,000 in 30 s, then a trickle): the count within a few of the exact one, in order, all after ``start``;
    with fewer arrivals than it keeps, exactly the arrival times."""
    import random

    from petals_chain.orchestrator.planner import RateEstimator

    rng = random.Random(3)
    times = sorted(1000 + rng.random() * 30 for _ in range(20_000)) + [1030.5, 1031.0, 1033.0]
    est = RateEstimator()
    for t in times:
        est.arrive(t)
    for start in (990.0, 1005.3, 1020.7, 1029.99):
        got = est.times_since(start, now=1040.0)
        assert got == sorted(got) and min(got) > start
        assert len(got) == pytest.approx(sum(1 for t in times if t > start), abs=5), start
    few = RateEstimator()
    for t in (5.0, 6.5, 6.0):
        few.arrive(t)
    assert few.times_since(5.5, now=10.0) == [6.0, 6.5] and few.times_since(-1e9, now=400.0) == []


def test_a_re_plan_that_keeps_the_placement_refreshes_chains_to_the_measured_speeds():
    """A and B deliver 4x faster than they advertise: no key of the chains changes (the steps per job hold, nothing
    joins), the slow-server flag is for slower ones only, and the periodic re-plan kept the placement: the chains kept
    the advertised service times for good (0.64 s for 0.19 s). Now a re-plan that keeps the placement recomputes the
    chains (installed only when they moved)."""
    sw = _online_swarm()
    installs: list = []
    sw.pl.on_chains = installs.append
    advertised = sw.pl.current.chains[0].service_time
    for _ in range(30):
        sw.pl.observe_hop("A", 1, 2, None, compute_s=2 * 0.025 / sw.pl.steps_per_job)
        sw.pl.observe_hop("B", 1, 2, None, compute_s=2 * 0.05 / sw.pl.steps_per_job)
    sw.refresh(1.0)
    measured = sw.pl.evaluate(sw.pl.online_views(), sw.pl.plan.placement).chains[0].service_time
    assert measured < advertised / 3 and installs == []  # (not before the re-plan: no key changed)
    sw.pl.last_full_replan = -1e9  # the re-plan interval is due
    sw.refresh(1.0)
    assert len(installs) == 1 and installs[0][0].service_time == pytest.approx(measured)
    assert sw.pl.plan_log[-1]["reason"] == "placement kept; chains follow the measured speeds"
    epoch = sw.pl.epoch
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)  # nothing moved since: not installed again
    assert len(installs) == 1 and sw.pl.epoch == epoch
