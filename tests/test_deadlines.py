"""Deadline-aware batching (seed 003): largest feasible batch, FLEX/FLEX-NP/EDF/FCFS, best effort, admission."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from petals_chain.algorithms.deadlines import (EDF, FCFS, FLEX, BatchLatency, DeadlineRequest, admission_check,
                                               deadline_metrics, largest_feasible_batch, make_scheduler,
                                               token_deadline, token_deadlines)


def req(i, d, model="m", a=0.0):
    return DeadlineRequest(i, model, a, d)


# ------------------------------------------------------------------------------------------------ latency model


def test_batch_latency_and_fit():
    lat = BatchLatency(0.01, 0.05)
    assert lat(4) == pytest.approx(0.09)
    assert lat.max_batch(0.09) == 4 and lat.max_batch(0.0599) == 0 and lat.max_batch(1.0, cap=7) == 7
    fit = BatchLatency.fit([(1, 0.06), (2, 0.07), (8, 0.13), (16, 0.21)])
    assert fit.alpha_s == pytest.approx(0.01) and fit.beta_s == pytest.approx(0.05)
    # noisy but decreasing samples would give alpha < 0: clamped, beta = mean
    f2 = BatchLatency.fit([(1, 0.2), (4, 0.1)])
    assert f2.alpha_s == 0.0 and f2.beta_s == pytest.approx(0.15)
    # negative intercept clamped to 0: alpha through the origin
    f3 = BatchLatency.fit([(1, 0.0), (2, 0.3)])
    assert f3.beta_s == 0.0 and f3.alpha_s == pytest.approx(0.6 / 5)
    # one batch size: all alpha (conservative)
    assert BatchLatency.fit([(4, 0.2), (4, 0.2)]) == BatchLatency(0.05, 0.0)
    with pytest.raises(ValueError):
        BatchLatency(-1, 0)
    with pytest.raises(ValueError):
        BatchLatency.fit([])


def test_token_deadlines():
    assert token_deadline(10.0, 0, 1.0, 0.1) == 11.0
    assert token_deadlines(0.0, 3, 0.5, 0.25) == [0.5, 0.75, 1.0]


# ------------------------------------------------------------------------------------- largest feasible batch


def brute_force_k(cands, now, lat, b_max):
    best = 0
    for k in range(1, min(b_max, len(cands)) + 1):
        if any(all(r.deadline_s + 1e-9 >= now + lat(k) for r in c) for c in itertools.combinations(cands, k)):
            best = k
    return best


def test_largest_feasible_batch_matches_brute_force():
    rng = random.Random(1)
    for _ in range(300):
        lat = BatchLatency(rng.choice([0.0, 0.01, 0.03]), rng.choice([0.0, 0.02, 0.05]))
        cands = [req(i, rng.uniform(0.0, 0.3)) for i in range(rng.randint(0, 7))]
        b_max = rng.randint(1, 8)
        now = rng.uniform(0.0, 0.05)
        got = largest_feasible_batch(cands, now, lat, b_max)
        assert len(got) == brute_force_k(cands, now, lat, b_max)
        assert all(r.deadline_s + 1e-9 >= now + lat(len(got)) for r in got)
        if got:  # the k earliest deadlines among those meeting the threshold
            thr = now + lat(len(got))
            meeting = sorted(r.deadline_s for r in cands if r.deadline_s + 1e-9 >= thr)
            assert sorted(r.deadline_s for r in got) == meeting[:len(got)]


def test_largest_feasible_batch_prefers_size_over_urgency():
    lat = BatchLatency(0.01, 0.0)
    # one urgent request and five relaxed ones: the batch of 5 relaxed ones is feasible, the urgent one is not in it
    cands = [req("u", 0.01)] + [req(i, 0.05) for i in range(5)]
    got = largest_feasible_batch(cands, 0.0, lat)
    assert len(got) == 5 and all(r.id != "u" for r in got)
    assert len(largest_feasible_batch(cands, 0.0, lat, b_max=3)) == 3


# ------------------------------------------------------------------------------------------------------- EDF


def test_edf_takes_earliest_deadline_run_and_drops_hopeless():
    lat = BatchLatency(0.01, 0.01)
    s = EDF({"g": {"m": lat}})
    o = s.arrive([req("late", 0.015), req("a", 0.05), req("b", 0.5), req("c", 0.5), req("d", 0.5), req("e", 0.5)], 0.0)
    # "late" needs 0.02 s alone: dropped; the batch meets "a"'s deadline 0.05: k <= 4
    assert [r.id for r in o.dropped] == ["late"]
    assert [b.size for b in o.starts] == [4] and o.starts[0].requests[0].id == "a"
    assert s.queued() == 1
    o = s.complete("g", 0.05)
    assert [r.id for r in o.starts[0].requests] == ["e"]


def test_edf_is_not_preemptive_and_flex_is():
    """Thm 5.1's adversary: one tight request at t=0, then omega requests with the same tight deadline at eps."""
    lat = BatchLatency(0.0, 1.0)  # every batch takes 1 s whatever its size
    omega = 50
    for cls, expect in ((EDF, 1), (FLEX, omega)):
        s = cls({"g": {"m": lat}})
        s.arrive(req("x", 1.0), 0.0)
        o = s.arrive([req(i, 1.001, a=0.001) for i in range(omega)], 0.001)
        if cls is EDF:
            assert not o.starts and not o.preempted
        else:
            assert [b.size for b in o.starts] == [omega] and [b.size for b in o.preempted] == [1]
            assert [r.id for r in o.dropped] == ["x"]  # can no longer finish: dropped, not re-enqueued
        # what completes on time
        running = s.running("g")
        assert running.size == expect and running.end_s <= running.deadline_s + 1e-9


# ------------------------------------------------------------------------------------------------------ FLEX


def test_flex_preemption_threshold_and_requeue():
    lat = BatchLatency(0.001, 0.01)
    s = FLEX({"g": {"a": lat, "b": lat}}, lam=3.0)
    o = s.arrive([req(i, 10.0, "a") for i in range(2)], 0.0)
    assert o.starts[0].size == 2
    # 5 < 3 * 2 requests of another model: no preemption
    o = s.arrive([req(("b", i), 10.0, "b") for i in range(5)], 0.001)
    assert not o.starts and s.preemptions == 0
    # 6 >= 3 * 2: preempt; the two preempted requests still meet their deadline and are re-enqueued
    o = s.arrive(req(("b", 5), 10.0, "b"), 0.002)
    assert [b.size for b in o.starts] == [6] and [b.size for b in o.preempted] == [2] and not o.dropped
    assert s.queued("a") == 2 and s.preemptions == 1
    o = s.complete("g", o.starts[0].end_s)
    assert o.starts[0].model == "a" and o.starts[0].size == 2


def test_flex_candidate_includes_running_batch_of_same_model():
    lat = BatchLatency(0.001, 0.01)
    s = FLEX({"g": {"m": lat}}, lam=3.0)
    s.arrive([req(i, 10.0) for i in range(3)], 0.0)
    o = s.arrive([req(("n", i), 10.0) for i in range(6)], 0.001)
    # B_g = 3 running + 6 new = 9 >= 3 * 3: the running batch is folded into a larger one, nothing re-enqueued
    assert [b.size for b in o.starts] == [9] and s.queued() == 0


def test_flex_np_never_preempts_and_prefers_largest_batch():
    lat = BatchLatency(0.001, 0.01)
    s = make_scheduler("flex-np", {"g": {"a": lat, "b": lat}})
    s.arrive(req("x", 10.0, "a"), 0.0)
    o = s.arrive([req(i, 10.0, "b") for i in range(50)] + [req("y", 0.5, "a")], 0.001)
    assert not o.starts and s.preemptions == 0
    o = s.complete("g", 0.011)
    assert o.starts[0].model == "b" and o.starts[0].size == 50  # largest batch first, not earliest deadline


def test_flex_tie_between_models_goes_to_earliest_deadline():
    lat = BatchLatency(0.001, 0.01)
    s = FLEX({"g": {"a": lat, "b": lat}})
    o = s.arrive([req(1, 5.0, "a"), req(2, 5.0, "a"), req(3, 1.0, "b"), req(4, 1.0, "b")], 0.0)
    assert o.starts[0].model == "b"


def test_multi_worker_and_remove_worker_requeues():
    lat = BatchLatency(0.001, 0.01)
    s = FLEX({"g1": {"m": lat}, "g2": {"m": lat}}, b_max=4)
    o = s.arrive([req(i, 10.0) for i in range(6)], 0.0)
    assert sorted(b.size for b in o.starts) == [2, 4]
    o = s.remove_worker("g1", 0.001)
    assert o.preempted and s.queued() + sum(b.size for b in o.starts) == o.preempted[0].size


def test_heterogeneous_worker_drops_only_when_no_worker_can_serve():
    fast, slow = BatchLatency(0.0, 0.01), BatchLatency(0.0, 1.0)
    s = EDF({"slow": {"m": slow}})
    s.add_worker("fast", {"m": fast})
    o = s.arrive(req("r", 0.5), 0.0)
    # the slow worker cannot make 0.5 s, the fast one can: the request is not dropped and runs on the fast one
    assert not o.dropped and [b.worker for b in o.starts] == ["fast"]


# ------------------------------------------------------------------------------------------------------ FCFS


def test_fcfs_arrival_order_no_drop_unless_told():
    lat = BatchLatency(0.01, 0.01)
    s = FCFS({"g": {"a": lat, "b": lat}}, b_max=2)
    s.arrive(req(0, 0.001, "a"), 0.0)  # hopeless but FCFS runs it
    s.arrive([req(1, 9.0, "b"), req(2, 9.0, "a"), req(3, 9.0, "a"), req(4, 9.0, "b")], 0.001)
    o = s.complete("g", 0.02)
    assert [r.id for r in o.starts[0].requests] == [1, 4]  # oldest is "b" request 1
    o = s.complete("g", 0.05)
    assert [r.id for r in o.starts[0].requests] == [2, 3]
    d = FCFS({"g": {"a": lat}}, drop=True)
    d.arrive(req("busy", 9.0, "a"), 0.0)
    d.arrive([req("x", 0.01, "a"), req("y", 9.0, "a")], 0.0)
    o = d.complete("g", 0.02)
    assert [r.id for r in o.dropped] == ["x"] and [r.id for r in o.starts[0].requests] == ["y"]


# ----------------------------------------------------------------------------------------------- best effort


@pytest.mark.parametrize("discipline", ["flex", "edf", "fcfs"])
def test_best_effort_lane(discipline):
    lat = BatchLatency(0.01, 0.01)
    s = make_scheduler(discipline, {"g": {"m": lat}}, best_effort=True, drop=True)
    s.arrive(req("busy", 9.0), 0.0)
    s.arrive(req("late", 0.02), 0.0)
    o = s.complete("g", 0.02)  # "late" can no longer finish: to the lane, and the idle worker runs it
    assert not o.dropped and o.starts[0].best_effort and [r.id for r in o.starts[0].requests] == ["late"]
    # a deadline-feasible request preempts the best-effort batch in every discipline
    o = s.arrive(req("ok", 1.0), 0.021)
    assert [r.id for r in o.starts[0].requests] == ["ok"] and o.preempted[0].best_effort
    assert s.best_effort_queued() == 1 and s.preemptions == 0  # pausing best effort is not a preemption
    o = s.complete("g", 0.041)
    assert o.starts[0].best_effort


def test_no_best_effort_drops():
    s = FLEX({"g": {"m": BatchLatency(0.01, 0.01)}})
    s.arrive(req("busy", 9.0), 0.0)
    s.arrive(req("late", 0.02), 0.0)
    o = s.complete("g", 0.02)
    assert [r.id for r in o.dropped] == ["late"] and not o.starts


# ------------------------------------------------------------------------------------------------- admission


def test_admission_check():
    lat = BatchLatency(0.001, 0.01)
    # idle worker, nothing ahead: done at l(1)
    e = admission_check(1.0, 0.0, 0, [(0.0, lat)])
    assert e.feasible and e.finish_s == pytest.approx(0.011)
    # 256 ahead on one worker busy until 0.5: two full batches (0.138 each) then a batch of 1
    e = admission_check(0.5 + 2 * 0.138 + 0.011 - 1e-6, 0.0, 256, [(0.5, lat)], b_max=128)
    assert not e.feasible and e.finish_s == pytest.approx(0.5 + 2 * 0.138 + 0.011)
    # two workers share the work ahead
    e2 = admission_check(1.0, 0.0, 256, [(0.5, lat), (0.0, lat)], b_max=128)
    assert e2.finish_s == pytest.approx(2 * 0.138 + 0.011)  # both full batches on the idle worker, then ours
    assert not admission_check(1.0, 0.0, 0, []).feasible
    assert not admission_check(1.0, 0.0, 0, [(0.0, lat)], slack_s=0.995).feasible


def test_scheduler_admission_counts_queue_ahead():
    lat = BatchLatency(0.01, 0.1)
    s = EDF({"g": {"m": lat}}, b_max=4)
    s.arrive([req(i, 9.0) for i in range(9)], 0.0)  # 4 running until 0.14, 5 queued
    early = s.admission(req("e", 0.3), 0.0)
    assert early.ahead == 0 and early.finish_s == pytest.approx(0.14 + 0.11)
    late = s.admission(req("l", 9.5), 0.0)
    assert late.ahead == 5 and late.finish_s == pytest.approx(0.14 + 0.14 + lat(2))
    assert not s.admission(req("x", 0.2), 0.0).feasible


# --------------------------------------------------------------------------------------------------- metrics


def test_deadline_metrics():
    m = deadline_metrics([1.0, 1.0, 1.0, 2.0], [0.5, 1.5, None, 2.0], 2.0)
    assert (m.on_time, m.late, m.dropped) == (2, 1, 1)
    assert m.goodput_rps == 1.0 and m.slo_attainment == 0.5 and m.drop_rate == 0.25
    with pytest.raises(ValueError):
        deadline_metrics([1.0], [], 1.0)
    assert math.isclose(deadline_metrics([], [], 1.0).slo_attainment, 1.0)


def test_validation():
    with pytest.raises(ValueError):
        FLEX(lam=1.0)
    with pytest.raises(ValueError):
        make_scheduler("sjf")
    with pytest.raises(ValueError):
        FLEX(b_max=0)
