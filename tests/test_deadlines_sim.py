"""Short runs of the seed 003 experiments: the qualitative results the seed claims, with margins."""

from __future__ import annotations

import pytest

from petals_chain.algorithms.deadlines import BatchLatency, DeadlineRequest, make_scheduler
from petals_chain.sim import deadlines as dl


def test_simulator_exact_on_a_tiny_case():
    lat = BatchLatency(0.01, 0.1)
    reqs = [DeadlineRequest.with_slo(i, "m", 0.0, 0.2) for i in range(5)] + [DeadlineRequest.with_slo("x", "m", 0.05, 0.1)]
    out = dl.simulate(make_scheduler("edf", {"g": {"m": lat}}), reqs, 1.0)
    # the 5 run together until 0.15; "x" (due 0.15) cannot make it alone after that: dropped
    assert out.finish_s[:5] == [pytest.approx(0.15)] * 5 and out.finish_s[5] is None
    assert out.metrics()["on_time"] == 5


def test_fig11a_short():
    r = dl.fig11a(duration_s=0.6)
    loose, tight = r["slos"]["250ms"], r["slos"]["90ms"]
    # SLO 250 ms: prioritizing large batches alone (FLEX-NP) beats EDF by a wide margin (seed: 3.7x)
    assert loose["flex_np_vs_edf"] > 2.5 and loose["flex_vs_edf"] > 2.5
    # SLO 90 ms: preemption matters: FLEX well above FLEX-NP and EDF (seed: 6.2x; ours ~2.5x, see results)
    assert tight["flex_vs_flex_np"] > 1.8 and tight["flex_vs_edf"] > 1.8
    assert tight["policies"]["flex"]["preemptions"] > 0 and tight["policies"]["flex-np"]["preemptions"] == 0
    # FCFS batches B's backlog and misses nearly everything
    assert loose["policies"]["fcfs"]["goodput_rps"] < 0.1 * loose["policies"]["flex"]["goodput_rps"]
    # the steady state (2nd burst to the last, excluded: 3 of the 5 bursts in 0.6 s) and EDF at Clockwork's batch
    # sizes are reported beside; capped at 8, its batches serve few of a burst in time
    assert tight["steady_flex_vs_edf"] > 1.8 and tight["flex_vs_clockwork"] > tight["flex_vs_edf"]
    assert tight["policies"]["clockwork"]["steady_goodput_rps"] < tight["policies"]["edf"]["steady_goodput_rps"]


def test_edf_at_fixed_batch_sizes_cuts_each_run_to_the_largest_that_fits():
    from petals_chain.algorithms.deadlines import EDF

    lat = dl.table4("RN18")
    workers = {"gpu": {"A": lat}}
    reqs = [DeadlineRequest.with_slo(("A", k), "A", 0.0, 1.0) for k in range(13)]
    free = make_scheduler("edf", workers).arrive(list(reqs), 0.0).starts
    cut = make_scheduler("clockwork", workers).arrive(
        [DeadlineRequest.with_slo(("A", k), "A", 0.0, 1.0) for k in range(13)], 0.0).starts
    assert [len(b.requests) for b in free] == [13] and [len(b.requests) for b in cut] == [8]
    assert cut[0].end_s == pytest.approx(lat(8))
    sizes = EDF(workers, batch_sizes=(1, 3)).arrive(
        [DeadlineRequest.with_slo(("A", k), "A", 0.0, 1.0) for k in range(2)], 0.0).starts
    assert [len(b.requests) for b in sizes] == [1]
    with pytest.raises(ValueError):
        EDF(workers, batch_sizes=(2, 4))
    # a deadline met only within float slack leaves no batch at all (cut to sizes, 0 read as the largest: 8 late)
    from petals_chain.algorithms.deadlines import EPS_S, BatchLatency

    lat, now = BatchLatency(0.003, 0.0101), 0.37
    d0 = now + lat(1) - EPS_S
    edge = [DeadlineRequest(("A", k), "A", 0.0, d0 + 1e-3 * k) for k in range(12)]
    out = make_scheduler("clockwork", {"gpu": {"A": lat}}).arrive(edge, now)
    assert all(b.end_s <= b.requests[0].deadline_s + EPS_S for b in out.starts)


def test_load_short():
    r = dl.load(loads=(0.5, 2.0), duration_s=0.4, workers=2)
    low, high = r["rows"]
    # light load: everybody meets (nearly) every deadline
    for p, m in low["policies"].items():
        assert m["slo_attainment"] > 0.95, p
    # overload: FLEX keeps its goodput, EDF collapses on small tight batches
    assert high["flex_vs_edf"] > 1.5 and high["policies"]["flex"]["goodput_rps"] > low["policies"]["flex"]["goodput_rps"]


def test_chain_short():
    r = dl.chain(loads=(1.5,), duration_s=10.0)
    row = r["rows"][0]
    assert row["policies"]["flex"]["goodput_rps"] > row["policies"]["edf"]["goodput_rps"]
