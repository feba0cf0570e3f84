"""Seed 001 (SeaLLM) pure algorithms (petals_chain/algorithms/multimodel.py): DB budgets and priorities (Eq. 7),
preemption at step granularity, skip-join MLFQ, placement by unserved index (Eq. 6, Alg. 1), the adaptive
interval (Eq. 8) and the move-pays-for-its-reload rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from petals_chain.algorithms import multimodel as mm
from petals_chain.algorithms.multimodel import (AdaptiveInterval, DBScheduler, FCFSScheduler, Job, LengthClasses,
                                                MLFQScheduler, MixDriftDetector, PlanMetrics, ReplanTrigger, ServedModel,
                                                ServiceMonitor, ServiceStats, Volunteer)


def _db(mean=2.0, std=1.0, **kw):
    return DBScheduler(ServiceMonitor({"a": (mean, std), "b": (10.0, 0.0)}), **kw)


def test_service_stats_prior_then_sliding_window():
    st = ServiceStats(3.0, 1.0, window=4, min_samples=2)
    st.observe(1.0)
    assert (st.mean, st.std, st.base_budget) == (3.0, 1.0, 4.0)  # prior until min_samples
    st.observe(3.0)
    assert st.mean == pytest.approx(2.0) and st.std == pytest.approx(1.0)
    for x in (10.0, 10.0, 10.0, 10.0):
        st.observe(x)
    assert st.mean == pytest.approx(10.0) and st.std == pytest.approx(0.0)  # the window dropped the first two


def _length_mix(n, seed=0):
    import random

    rng = random.Random(seed)
    shapes = [(30, 4), (30, 300), (3000, 20), (3000, 400)]  # (input, output) tokens: four kinds of request
    return [(max(1, int(i * rng.uniform(0.7, 1.4))), max(1, int(o * rng.uniform(0.7, 1.4))))
            for i, o in (rng.choice(shapes) for _ in range(n))]


def test_length_classes_recover_clusters_shortest_first_and_keep_labels_on_refit():
    pts = _length_mix(400)
    lc = LengthClasses(4)
    c = lc.fit(mm.length_features(i, o) for i, o in pts)
    assert len(c) == 4 and list(c.sum(axis=1)) == sorted(c.sum(axis=1))  # ordered by size
    assert lc.classify(30, 4) == 0 and lc.classify(3000, 400) == 3
    labels = {shape: lc.classify(*shape) for shape in [(30, 4), (30, 300), (3000, 20), (3000, 400)]}
    assert sorted(labels.values()) == [0, 1, 2, 3]  # each kind of request is its own class
    # a refit on another draw (another order) gives every kind the same class: the monitor's keys stay valid
    lc.fit(mm.length_features(i, o) for i, o in reversed(_length_mix(400, seed=1)))
    assert {shape: lc.classify(*shape) for shape in labels} == labels
    assert lc.describe()["centroids_tokens"][0][1] < 10


def test_length_classes_online_one_class_until_fitted_and_k1_is_one_service():
    lc = LengthClasses(3, min_samples=50, refit_every=25)
    pts = _length_mix(200, seed=2)
    first = [lc.observe(i, o) for i, o in pts[:49]]
    assert set(first) == {0} and lc.fits == 0 and not lc.fitted
    later = [lc.observe(i, o) for i, o in pts[49:]]
    assert lc.fits == 1 + (200 - 50) // 25 and len(set(later)) == 3
    assert lc.classify(30, 4) == 0 and lc.classify(3000, 400) == 2
    one = LengthClasses(1)
    assert {one.observe(i, o) for i, o in pts} == {0} and one.centroids is None
    few = LengthClasses(4, min_samples=1)  # fewer distinct points than k: as many classes as points
    assert [few.observe(10, 10) for _ in range(5)] == [0] * 5 and len(few.centroids) == 1
    for bad in ({"k": 0}, {"window": 0}, {"refit_every": 0}):
        with pytest.raises(ValueError):
            LengthClasses(**bad)
    with pytest.raises(ValueError):
        LengthClasses(2).fit([])


def test_db_budget_and_priority_follow_eq7_and_double_geometrically():
    s = _db()
    j = Job("r", "a", 0.0)
    s.arrive(j, 0.0)
    q0 = 2.0 + 1.0  # L̂ + σ
    assert j.level == 0 and j.budget == pytest.approx(q0) and j.priority == pytest.approx(q0 * 2.0)
    s.charge([j], 1.0, 1.0)
    assert j.budget == pytest.approx(2.0) and j.priority == pytest.approx(4.0)  # O = Q_r · L̂_s
    s.charge([j], 2.5, 3.5)  # exhausted: k = 1, Q = 2 · Q0 (overshoot not carried over)
    assert j.level == 1 and j.budget == pytest.approx(2 * q0) and j.priority == pytest.approx(2 * q0 * 2.0)
    s.charge([j], 2 * q0, 10.0)  # exhausted again: k = 2, Q = 4 · Q0
    assert j.level == 2 and j.budget == pytest.approx(4 * q0)
    s.complete(j, 11.0)
    assert len(s) == 0 and s.monitor["a"].count == 1


def test_db_preempts_at_step_granularity_only_on_a_strict_inversion():
    s = _db()
    long_ = Job("long", "a", 0.0)
    s.arrive(long_, 0.0)
    assert s.select(1, 0.0) == [long_]
    s.charge([long_], 1.0, 1.0)  # Q 3 -> 2
    fresh = Job("fresh", "a", 1.0)
    s.arrive(fresh, 1.0)
    assert s.select(1, 1.0) == [long_] and s.preempted == []  # O 4 < 6: the running one keeps going
    s.charge([long_], 2.0, 3.0)  # exhausted: O = 6 * 2 = 12 > fresh's 6
    assert s.select(1, 3.0) == [fresh] and s.preempted == [long_]
    assert not long_.running and fresh.running
    # a shorter service beats a longer one at arrival: O = Q0 · L̂ (a: 3·2 = 6, b: 10·10 = 100)
    other = Job("b1", "b", 3.0)
    s.arrive(other, 3.0)
    assert s.select(3, 3.0)[-1] is other


def test_db_starvation_serves_a_waiting_service_first():
    s = _db(starve_factor=2.0)  # θ_a = 4 s, θ_b = 20 s
    a = [Job(f"a{i}", "a", 0.0) for i in range(2)]
    b = Job("b", "b", 0.0)
    for j in (*a, b):
        s.arrive(j, 0.0)
    assert b not in s.select(2, 0.0)
    assert b not in s.select(2, 19.0)
    assert s.select(2, 21.0)[0] is b  # b waited > 20 s: its service is starved
    # one service alone: its best job runs first anyway, so the rule takes the job waiting longest, as a backstop
    # once it has waited JOB_STARVE_FACTOR x θ_a = 16 s (a long job demoted below every new one waited for good)
    one = _db(starve_factor=2.0)
    x = Job("x", "a", 0.0)
    one.arrive(x, 0.0)
    x.priority, x.steps = 99.0, 3  # it ran, then was demoted: every new job of its service goes before it
    one.arrive(Job("y", "a", 1.0), 1.0)
    old = Job("z", "a", 0.5)  # waiting longer, never started: left to the order (else DB is FCFS at overload)
    one.arrive(old, 0.5)
    old.waiting_since = -5.0
    assert one.starved(15.0) == []
    assert one.starved(17.0) == [x]
    assert one.select(1, 17.0) == [x]


def test_fcfs_never_preempts_and_mlfq_skip_joins_and_demotes():
    f = FCFSScheduler()
    old, new = Job("old", "a", 5.0), Job("new", "a", 0.0)
    f.arrive(old, 5.0)
    assert f.select(1, 5.0) == [old]
    f.arrive(new, 6.0)  # earlier arrival time, but the running one keeps its place
    assert f.select(1, 6.0) == [old]
    m = MLFQScheduler(q1=0.1, levels=5)
    assert [m.join_level(x) for x in (0.05, 0.1, 0.15, 0.39, 0.41, 100.0)] == [0, 0, 1, 2, 3, 4]
    j = Job("j", "a", 0.0, prefill_s=0.15)
    m.arrive(j, 0.0)
    assert j.level == 1 and j.budget == pytest.approx(0.2)
    m.charge([j], 0.15, 0.15)
    assert j.level == 1
    m.charge([j], 0.06, 0.2)  # quantum 0.2 used up: one level down, quantum 0.4
    assert j.level == 2 and j.budget == pytest.approx(0.4)
    k = Job("k", "a", 1.0, prefill_s=0.01)
    m.arrive(k, 1.0)
    assert m.select(1, 1.0) == [k]  # the top queue first, FCFS inside a queue
    starving = MLFQScheduler(q1=0.1, levels=5, starve_s=1.0)
    starving.arrive(j, 1.0)
    starving.select(0, 2.5)
    assert j.level == 0


def test_make_scheduler_and_metrics():
    assert {mm.make_scheduler(n).name for n in mm.SCHEDULES} == set(mm.SCHEDULES)
    with pytest.raises(ValueError):
        mm.make_scheduler("edf")
    assert mm.normalized_latency([2.0, 9.0], [1.0, 3.0]) == pytest.approx(2.5)
    assert mm.slo_attainment([4.9, 5.0, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(2 / 3)  # strict: L_r < SLO
    assert mm.p99(list(range(101))) == pytest.approx(99.0)


MODEL = dict(num_blocks=8, block_memory=1.0, cache_memory=0.05, block_time=0.5, exec_s=4.0, c=4)


def _model(name, rate, **kw):
    return ServedModel(name, rate=rate, **{**MODEL, **kw})


def test_unserved_index_placement_respects_memory_and_favours_the_most_unserved_model():
    servers = [Volunteer(f"s{i}", 10.0) for i in range(6)]  # 10 GB: whole 8-block model + 40 slots
    hot, cold = _model("hot", 2.0), _model("cold", 0.2)
    plan = mm.place_by_unserved_index(servers, [cold, hot])
    counts = mm.groups_of(plan, servers)
    assert len(plan) == 6 and len(counts["hot"]) > len(counts["cold"]) >= 1
    # the first server goes to the model with the higher unserved index (more requests unserved)
    first = mm.place_by_unserved_index(servers[:1], [cold, hot])
    assert first == {"s0": "hot"}
    # a model that needs more memory than a small server has never lands there
    big = _model("big", 5.0, block_memory=4.0)
    small = [Volunteer("tiny", 3.0), Volunteer("huge", 80.0)]
    p = mm.place_by_unserved_index(small, [big, _model("x", 0.1)])
    assert p["tiny"] == "x" and p["huge"] == "big"
    assert not big.can_hold(small[0])


def test_a_model_with_traffic_gets_a_chain_before_another_gets_more():
    """Seed §3: a service first gets its minimum group. Without that rule a model whose misses outnumber another's
    requests (bursts that no capacity absorbs) would take every server; a model without traffic is not served first."""
    servers = [Volunteer(f"s{i}", 10.0) for i in range(4)]
    busy, quiet, idle = _model("busy", 1.0), _model("quiet", 0.1), _model("idle", 0.0)

    def evaluate(groups):
        out = {}
        for m, n, missed in ((busy, 100.0, 50.0), (quiet, 10.0, 0.0), (idle, 0.0, 0.0)):
            placed = bool(mm.model_chains(groups.get(m.name, ()), m))
            miss = missed if placed else n
            out[m.name] = mm.ModelEstimate(n, miss, 2.0, miss + mm.ALPHA * 2.0)
        return out

    plan = mm.place_by_unserved_index(servers, [busy, quiet, idle], evaluate=evaluate)
    assert {m: len(g) for m, g in mm.groups_of(plan, servers).items()} == {"busy": 3, "quiet": 1}


def test_largest_gain_gives_a_server_where_it_clears_misses_not_where_misses_stay():
    """Alg. 1 gives each server to the model with the most misses; a bursty model keeps many whatever it gets, so
    ``largest_gain`` gives the server to the model whose misses it clears instead (both rules serve each model
    first)."""
    servers = [Volunteer(f"s{i}", 10.0) for i in range(4)]
    bursty, steady = _model("bursty", 1.0), _model("steady", 0.5)
    misses = {"bursty": lambda k: 100.0 - 5.0 * k, "steady": lambda k: 40.0 if k == 1 else 0.0}

    def evaluate(groups):
        out = {}
        for name, n in (("bursty", 200.0), ("steady", 40.0)):
            k = len(groups.get(name, ()))
            miss = misses[name](k) if k else n
            out[name] = mm.ModelEstimate(n, miss, 3.0, miss + mm.ALPHA * 3.0)
        return out

    def counts(rule):
        plan = mm.place_by_unserved_index(servers, [bursty, steady], evaluate=evaluate, rule=rule)
        return {m: len(g) for m, g in mm.groups_of(plan, servers).items()}

    assert counts("most_unserved") == {"bursty": 3, "steady": 1}
    assert counts("largest_gain") == {"bursty": 2, "steady": 2}
    with pytest.raises(ValueError):
        mm.place_by_unserved_index(servers, [bursty, steady], rule="random")


def test_estimate_counts_unplaced_models_as_unserved():
    m = _model("m", 0.5)  # one chain serves 4 slots / 4 s = 1 req/s
    e = mm.estimate_model(m, [], 100.0)
    assert e.misses == e.requests == pytest.approx(50.0) and e.ui > 50.0
    chains = mm.model_chains([Volunteer("a", 9.99)], m)  # 8 blocks + 39 slots: 4 jobs a chain (10.0 holds 40: 5)
    assert len(chains) == 1 and chains[0].servers == ("a",) and chains[0].capacity == 4
    ok = mm.estimate_model(m, chains, 100.0)
    assert ok.misses < e.misses and ok.slo_attainment > 0.5
    assert mm.estimate_model(_model("m", 1.0), chains, 100.0).misses == pytest.approx(100.0)  # ρ = 1
    assert mm.erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = ρ


def test_an_overload_made_smaller_still_lowers_the_unserved_index():
    """More capacity for a model that stays overloaded lowers its index (below an unplaced model's, above any stable
    plan's), so the placer moves a server from an idle model to it; the move back never pays."""
    servers = [Volunteer(f"s{i}", 10.0) for i in range(5)]
    hot, idle = _model("hot", 6.0), _model("idle", 0.05)  # one chain serves 1 req/s: hot is overloaded on 4
    by_count = [mm.estimate_model(hot, mm.model_chains(servers[:k], hot), 60.0) for k in range(5)]
    assert all(e.misses == pytest.approx(e.requests) for e in by_count)  # overloaded with 0..4 servers
    assert [e.ui for e in by_count] == sorted((e.ui for e in by_count), reverse=True)
    assert len({round(e.ui, 9) for e in by_count}) == 5  # strictly: every server counts
    stable = mm.estimate_model(_model("m", 0.999), mm.model_chains(servers[:1], hot), 60.0)  # just below ν
    assert stable.norm_latency <= mm.UNPLACED_LN / 2 <= by_count[4].norm_latency < by_count[0].norm_latency
    cur = {"s0": "hot", "s1": "hot", "s2": "idle", "s3": "idle", "s4": "idle"}
    rate = mm.ui_rate(servers, [hot, idle], horizon_s=60.0)
    moves = mm.moves_that_pay(cur, {**cur, "s2": "hot", "s3": "hot"}, rate, reload_s=2.0, interval_s=60.0)
    assert {m.server for m in moves} == {"s2", "s3"} and all(m.dst == "hot" and m.benefit > 0 for m in moves)
    assert mm.moves_that_pay(cur, {**cur, "s1": "idle"}, rate, reload_s=2.0, interval_s=60.0) == []


def _edf_feasible(jobs, capacity):
    """Whether preemptive EDF on one resource of ``capacity`` finishes every (arrival, deadline, work) job in time
    (EDF is optimal for that question)."""
    t, left, todo = 0.0, {}, sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    while todo or left:
        if not left:
            t = max(t, jobs[todo[0]][0])
        while todo and jobs[todo[0]][0] <= t + 1e-12:
            i = todo.pop(0)
            left[i] = jobs[i][2]
        i = min(left, key=lambda i: jobs[i][1])
        until = min([jobs[todo[0]][0]] if todo else [math.inf])
        run = min(left[i] / capacity, until - t)
        t += run
        left[i] -= run * capacity
        if left[i] <= 1e-9:
            del left[i]
            if t > jobs[i][1] + 1e-9:
                return False
    return True


def test_on_time_upper_bound_is_never_below_the_best_schedule():
    """Against brute force: the most jobs any preemptive schedule finishes in time on one resource (the largest
    subset EDF finishes) never exceeds the bound, on random instances; on a plain overload the bound is exact."""
    rng = np.random.default_rng(3)
    tight = overloaded = 0
    for _ in range(60):
        n = int(rng.integers(2, 8))
        arr = np.round(rng.uniform(0, 6, n), 1)
        work = np.round(rng.uniform(0.2, 2.5, n), 2)
        due = arr + work * rng.uniform(1.0, 3.0, n)
        jobs = list(zip(arr, due, work))
        best = max(len(c) for k in range(n + 1) for c in itertools.combinations(range(n), k)
                   if _edf_feasible([jobs[i] for i in c], 1.0))
        bound = mm.on_time_upper_bound(arr, due, work, 1.0, grid_s=0.1, max_window_s=20.0)
        assert best <= bound <= n
        overloaded += best < n
        tight += best < n and bound == best
    assert overloaded >= 20 and tight >= 0.7 * overloaded  # not vacuous: exact on most instances that overflow
    # ten 1-s jobs all arriving at 0, due at 4 on one resource: 4 fit, and no more can
    assert mm.on_time_upper_bound([0.0] * 10, [4.0] * 10, [1.0] * 10, 1.0) == 4
    assert mm.on_time_upper_bound([0.0] * 10, [4.0] * 10, [1.0] * 10, 2.0) == 8  # twice the capacity
    # due at or before arrival: never on time, and counted in no window (it could fall in two)
    assert mm.on_time_upper_bound([0, 1], [2, 1], [0, 5], 1.0, grid_s=1.0, max_window_s=2.0) == 1
    assert mm.on_time_upper_bound([0, 1, 1], [3, 1, 1], [0, 5, 5], 1.0, grid_s=1.0, max_window_s=3.0) == 1
    assert mm.on_time_upper_bound([2.0], [1.0], [1.0], 1.0) == 0
    assert mm.on_time_upper_bound([2.0], [2.0], [0.0], 1.0) == 1
    for bad in (([0.0], [1.0], [1.0], 0.0), ([0.0], [math.nan], [1.0], 1.0), ([0.0], [1.0], [-1.0], 1.0),
                ([0.0, 1.0], [1.0], [1.0], 1.0)):
        with pytest.raises(ValueError):
            mm.on_time_upper_bound(*bad)


def test_adaptive_interval_eq8():
    ctl = AdaptiveInterval(100.0, beta=0.1, min_s=50.0, max_s=200.0)
    est = PlanMetrics(0.9, 2.0)
    assert ctl.update(PlanMetrics(0.88, 2.1), est) == pytest.approx(110.0)  # both errors < β: (1+β) I
    assert ctl.update(PlanMetrics(0.9, 2.5), est) == pytest.approx(99.0)  # L_N error 25 % > β: (1-β) I
    assert ctl.update(PlanMetrics(0.5, 2.0), est) == pytest.approx(89.1)  # SLO error > β
    for _ in range(20):
        ctl.update(PlanMetrics(0.1, 9.0), est)
    assert ctl.interval == 50.0  # clamped


def test_mix_drift_detector():
    d = MixDriftDetector(window_s=10.0, threshold=0.2, min_arrivals=4)
    d.set_plan({"a": 0.5, "b": 0.5})
    for t in range(8):
        d.arrive("a" if t % 2 else "b", float(t))
    assert not d.drifted(8.0)
    for t in range(8, 16):
        d.arrive("b", float(t))
    assert d.distance(16.0) > 0.2 and d.drifted(16.0)
    assert d.rates(16.0)["b"] == pytest.approx(0.9)


def test_moves_pay_for_their_reload_only():
    servers = [Volunteer(f"s{i}", 10.0) for i in range(4)]
    models = [_model("a", 0.05), _model("b", 2.0)]  # b needs 3 chains (1 req/s each): two moves together pay
    cur = {"s0": "a", "s1": "a", "s2": "a", "s3": "b"}
    target = {"s0": "a", "s1": "b", "s2": "b", "s3": "b"}
    rate = mm.ui_rate(servers, models)
    moves = mm.moves_that_pay(cur, target, rate, reload_s=10.0, interval_s=600.0)
    assert {m.server for m in moves} == {"s1", "s2"} and all(m.dst == "b" and m.benefit > 0 for m in moves)
    # the same moves do not pay when the reload eats the whole interval
    assert mm.moves_that_pay(cur, target, rate, reload_s=600.0, interval_s=600.0) == []
    # a move that only costs (towards the idle model) is never made
    back = {"s0": "a", "s1": "a", "s2": "a", "s3": "a"}
    assert mm.moves_that_pay(cur, back, rate, reload_s=10.0, interval_s=600.0) == []


def test_moves_below_the_gain_floor_are_made_only_from_an_idle_model():
    """With ``min_gain`` (the run time's noise floor) a move that saves less is not made, unless it takes the server
    from a model in ``idle`` (no traffic: its users lose nothing); a move that saves more is made either way."""
    def cost(x):
        return 1e-3 - 2e-5 * (x.get("s0") == "b") - 5.0 * (x.get("s1") == "b")

    cur = {"s0": "a", "s1": "a"}
    tiny = {**cur, "s0": "b"}
    assert [m.server for m in mm.moves_that_pay(cur, tiny, cost, reload_s=0.0, interval_s=1.0)] == ["s0"]
    assert mm.moves_that_pay(cur, tiny, cost, reload_s=0.0, interval_s=1.0, min_gain=5e-5) == []
    assert [m.server for m in mm.moves_that_pay(cur, tiny, cost, reload_s=0.0, interval_s=1.0, min_gain=5e-5,
                                                idle={"a"})] == ["s0"]
    big = {**cur, "s1": "b"}
    assert [m.server for m in mm.moves_that_pay(cur, big, cost, reload_s=0.0, interval_s=1.0, min_gain=5e-5)] == ["s1"]


def test_moves_swap_servers_between_models_only_when_the_swap_pays_by_a_margin():
    """A re-plan that moves one server a -> b and another b -> a changes no model's count of servers: on measured
    speeds such a swap "paid" a fraction of a percent for two reloads. It is made only when it saves more than
    ``SWAP_MARGIN`` of the interval's cost; a one-way move is made as before."""
    speeds = [1.06, 1.06, 1.01, 0.86, 1.14, 0.8]
    servers = [Volunteer(f"s{i}", 9.99, sp) for i, sp in enumerate(speeds)]  # 4 jobs a chain
    models = [_model("a", 0.3), _model("b", 0.2)]
    cur = {"s0": "a", **{f"s{i}": "b" for i in range(1, 6)}}
    target = mm.place_by_unserved_index(servers, models, horizon_s=600.0)
    rate = mm.ui_rate(servers, models)
    swap_too = mm.moves_that_pay(cur, target, rate, reload_s=10.0, interval_s=600.0, swap_margin=0.0,
                                 min_swap_gain=0.0)
    assert [(m.server, m.src, m.dst) for m in swap_too] == [("s4", "b", "a"), ("s0", "a", "b")]
    assert swap_too[1].benefit < 0.01 * 600.0 * rate({**cur, "s4": "a"})  # the second half saves < 1 %
    moves = mm.moves_that_pay(cur, target, rate, reload_s=10.0, interval_s=600.0)
    assert [(m.server, m.src, m.dst) for m in moves] == [("s4", "b", "a")]
    # a swap that pays well is made: a fast server to the overloaded model, a slow one to the other
    speeds = {"s0": 0.7, "s1": 1.0, "s2": 1.3, "s3": 1.0}
    servers = [Volunteer(k, 9.99, v) for k, v in speeds.items()]
    models = [_model("a", 1.5), _model("b", 1.0)]
    cur = {"s0": "a", "s1": "a", "s2": "b", "s3": "b"}
    moves = mm.moves_that_pay(cur, {**cur, "s0": "b", "s2": "a"}, mm.ui_rate(servers, models), reload_s=10.0,
                              interval_s=600.0)
    assert {(m.server, m.dst) for m in moves} == {("s0", "b"), ("s2", "a")}
    # after a swap, moves that do not cancel another (one way, or adding to a flow) need no margin
    def cost(x):
        return 100 - 10 * (x.get("s0") == "b") - 10 * (x.get("s1") == "a") - 3 * (x.get("s2") == "d")

    cur = {"s0": "a", "s1": "b", "s2": "c"}
    moves = mm.moves_that_pay(cur, {"s0": "b", "s1": "a", "s2": "d"}, cost, reload_s=0.0, interval_s=1.0)
    assert {(m.server, m.dst) for m in moves} == {("s0", "b"), ("s1", "a"), ("s2", "d")}
    def cost2(x):  # two models: s2 a -> b adds to the a -> b flow after the swap
        return 100 - 10 * (x.get("s0") == "b") - 10 * (x.get("s1") == "a") - 3 * (x.get("s2") == "b")

    cur = {"s0": "a", "s1": "b", "s2": "a"}
    moves = mm.moves_that_pay(cur, {"s0": "b", "s1": "a", "s2": "b"}, cost2, reload_s=0.0, interval_s=1.0)
    assert {(m.server, m.dst) for m in moves} == {("s0", "b"), ("s1", "a"), ("s2", "b")}

    # near no traffic 5 % of the cost is no margin: a swap must also save MIN_SWAP_GAIN (one request) per pair,
    # while a one-way move of any gain still pays (an idle model's server to one that needs it)
    def quiet(x):
        return 1e-3 - 4e-4 * (x.get("s0") == "b") - 4e-4 * (x.get("s1") == "a")

    cur = {"s0": "a", "s1": "b"}
    assert mm.moves_that_pay(cur, {"s0": "b", "s1": "a"}, quiet, reload_s=0.0, interval_s=1.0,
                             min_swap_gain=0.0) != []  # what re-plans did at run time ("paid" 5e-6 requests)
    moves = mm.moves_that_pay(cur, {"s0": "b", "s1": "a"}, quiet, reload_s=0.0, interval_s=1.0)
    assert [(m.server, m.dst) for m in moves] == [("s0", "b")]


def test_select_respects_fits():
    s = FCFSScheduler()
    jobs = [Job(i, "a", float(i)) for i in range(4)]
    for j in jobs:
        s.arrive(j, 0.0)
    room = {"n": 2}

    def fits(j, ahead):
        if j.key == 0:
            return False
        room["n"] -= 1
        return room["n"] >= 0

    assert [j.key for j in s.select(3, 0.0, fits)] == [1, 2]
    assert math.isnan(jobs[0].priority)


# ---------------------------------------------------------------- --schedule db|mlfq at the orchestrator's dispatch


def _priority_dispatch(schedule: str, classes: int = 1):
    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchManager

    dm = DispatchManager(schedule=schedule, classes=classes)
    dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
    return dm


async def _acquire(dm, job, keeps_kv: bool = True):
    """``dm.acquire(job)``, its chain then opened on servers that keep a paused job's KV (the orchestrator sets
    ``keeps_kv`` from the chain session's open): only such a job is paused for priority."""
    lease = await dm.acquire(job)
    lease.keeps_kv = keeps_kv
    return lease


def _job(dm, i: int, **kw):
    from petals_chain.orchestrator.dispatch import DispatchJob

    return DispatchJob(job_id=f"j{i}", sched=kw.pop("sched", None) or dm.new_priority_job(f"j{i}", "m"), **kw)


def test_db_dispatch_pauses_a_job_past_its_budget_for_a_new_one_and_resumes_it_first_after():
    import asyncio

    async def main():
        dm = _priority_dispatch("db")  # L̂ = 1 s (prior), Q0 = 1 s
        long = await _acquire(dm, _job(dm, 0))
        queued = asyncio.ensure_future(_acquire(dm, _job(dm, 1)))
        await asyncio.sleep(0)
        assert not queued.done() and not long.preempt  # the running job goes first: its budget is partly used
        dm.charge(long, 0.6)  # O = 0.4 < the new job's 1.0: keeps running
        assert not long.preempt and dm.priority_preemptions == 0
        dm.charge(long, 0.6)  # budget used up: level 1, Q = 2 s, O = 2.0 > 1.0: gives its chain back
        assert long.preempt and long.job.sched.level == 1 and dm.priority_preemptions == 1
        dm.release(long)  # the pause
        await asyncio.sleep(0)
        assert queued.done() and queued.result().job.job_id == "j1"
        # the paused job re-queues (yields) with its level kept; a newer job (O = 1.0) goes before it (O = 2.0)
        resumed = asyncio.ensure_future(_acquire(dm, _job(dm, 0, requeue=True, yields=True, sched=long.job.sched)))
        newer = asyncio.ensure_future(_acquire(dm, _job(dm, 2)))
        await asyncio.sleep(0)
        dm.release(queued.result())
        await asyncio.sleep(0)
        assert newer.done() and not resumed.done()
        dm.finished(queued.result().job.sched)
        dm.release(newer.result())
        await asyncio.sleep(0)
        assert resumed.done() and resumed.result().job.sched.level == 1
        dm.release(resumed.result())

    asyncio.run(main())


def test_db_dispatch_pauses_only_for_a_job_one_budget_doubling_ahead():
    """A pause at run time is a round trip (and a recompute where the job resumes on another chain): DB pauses
    a running job only for a waiting one with at most half its ``O_r`` (``PAUSE_FACTOR``), not for a near-equal
    one; MLFQ only for a job a level above, never inside a level."""
    import asyncio

    from petals_chain.algorithms.multimodel import PAUSE_FACTOR, make_scheduler

    db, mlfq = make_scheduler("db"), make_scheduler("mlfq")
    assert PAUSE_FACTOR == 2.0
    assert db.worth_pausing(2.0, 1.0) and not db.worth_pausing(1.9, 1.0) and db.worth_pausing(1.0, -1e9)
    assert mlfq.worth_pausing(1.0 + 1e-6, 0.5e-6) and not mlfq.worth_pausing(1e-6, 0.5e-6)

    async def main():
        dm = _priority_dispatch("db")  # service m: L̂ = 1 s (prior), Q0 = 1 s
        for _ in range(20):
            dm.priorities.monitor.observe("n", 0.55)  # service n: L̂ = 0.55 s, sigma 0: a new job's O = 0.3025
        running = await _acquire(dm, _job(dm, 0))
        dm.charge(running, 0.6)  # O = 0.4
        queued = asyncio.ensure_future(_acquire(dm, _job(dm, 1, sched=dm.new_priority_job("j1", "n"))))
        await asyncio.sleep(0)
        dm.charge(running, 0.05)  # O = 0.35 > 0.3025, but not twice it: no pause
        assert not queued.done() and not running.preempt and dm.priority_preemptions == 0
        dm.charge(running, 0.4)  # budget used up: level 1, O = 2.0 >= 2 x 0.3025
        assert running.preempt and dm.priority_preemptions == 1
        dm.release(running)
        await asyncio.sleep(0)
        assert queued.done()
        dm.release(queued.result())

    asyncio.run(main())


def test_db_dispatch_does_not_pause_a_job_whose_chain_would_recompute_its_kv():
    """A chain without a prefix cache on every hop (``--kv-cache slots``, ``--no-prefix-cache``) would recompute a
    paused job's whole history: DB keeps its order in the queue but lets that job finish."""
    import asyncio

    async def main():
        dm = _priority_dispatch("db")
        long = await _acquire(dm, _job(dm, 0), keeps_kv=False)
        queued = asyncio.ensure_future(_acquire(dm, _job(dm, 1)))
        later = asyncio.ensure_future(_acquire(dm, _job(dm, 2)))
        await asyncio.sleep(0)
        for _ in range(4):  # far past its budget: level 2, O = 4 > the waiting jobs' 1.0
            dm.charge(long, 1.0)
        assert long.job.sched.level >= 2 and not long.preempt and dm.priority_preemptions == 0
        dm.release(long)  # it finished
        await asyncio.sleep(0)
        assert queued.done() and not later.done()
        dm.release(queued.result())
        await asyncio.sleep(0)
        assert later.done()
        dm.release(later.result())

    asyncio.run(main())


def test_mlfq_and_fcfs_dispatch_orders():
    import asyncio

    async def main():
        dm = _priority_dispatch("mlfq")
        first = await _acquire(dm, _job(dm, 0))
        for _ in range(3):
            dm.charge(first, 0.05)  # past the 0.03 s quantum of the top level: level 1, then 2
        assert first.job.sched.level >= 1
        nxt = asyncio.ensure_future(_acquire(dm, _job(dm, 1)))
        await asyncio.sleep(0)
        assert first.preempt  # a new job joins the top queue: the demoted one pauses
        dm.release(first)
        await asyncio.sleep(0)
        assert nxt.done()
        dm.release(nxt.result())
        plain = _priority_dispatch("fcfs")
        assert plain.new_priority_job("x", "m") is None  # fcfs: no priorities kept, nothing paused

    asyncio.run(main())


def test_mlfq_dispatch_sends_a_job_waiting_past_twice_the_mean_back_to_the_top_queue():
    """FastServe's starvation rule at the orchestrator, as the simulator's MLFQ: a demoted job that waited longer
    than 2 x the mean execution time learnt goes back to the top queue, before top-level jobs that come later
    (without it, every new job would go first)."""
    import asyncio

    async def main():
        dm = _priority_dispatch("mlfq")
        for i in range(16):  # the monitor learns a mean execution time of 50 ms: the threshold is 100 ms
            lease = await _acquire(dm, _job(dm, 100 + i))
            dm.charge(lease, 0.05)
            dm.release(lease)
            dm.finished(lease.job.sched)
        assert dm.priorities.starve_threshold() == pytest.approx(0.1)
        first = await _acquire(dm, _job(dm, 0))
        for _ in range(3):
            dm.charge(first, 0.05)  # demoted below the top queue
        level = first.job.sched.level
        nxt = asyncio.ensure_future(_acquire(dm, _job(dm, 1)))
        await asyncio.sleep(0)
        assert first.preempt and level >= 1
        dm.release(first)
        await asyncio.sleep(0)
        running = nxt.result()
        resumed = asyncio.ensure_future(_acquire(dm, _job(dm, 0, requeue=True, yields=True, sched=first.job.sched)))
        await asyncio.sleep(0)
        dm.charge(running, 0.001)
        assert first.job.sched.level == level and dm.starvation_promotions == 0  # not waited long enough
        await asyncio.sleep(0.15)
        dm.charge(running, 0.001)
        assert first.job.sched.level == 0 and dm.starvation_promotions == 1  # back to the top queue
        newer = asyncio.ensure_future(_acquire(dm, _job(dm, 2)))  # a new top-level job, after the promotion
        await asyncio.sleep(0)
        dm.release(running)
        await asyncio.sleep(0)
        assert resumed.done() and not newer.done()
        # promoted, it went first and, started, is not paused for priority again (as DB's promoted jobs)
        assert resumed.result().job.protected
        dm.release(resumed.result())
        await asyncio.sleep(0)
        assert newer.done()
        dm.release(newer.result())

    asyncio.run(main())


async def _teach_classes(dm, kinds: dict, used: dict, n: int = 140) -> dict:
    """``n`` one-shot jobs of model ``m``, a third ``long``, the rest ``short`` (``kinds``: (prompt, max_tokens)),
    each run alone for ``used[kind]`` seconds: the arrivals teach the length classes (64 to the first fit), the
    completions each class's L̂ (16 each). Returns the services each kind got."""
    seen: dict = {kind: set() for kind in kinds}
    for i in range(n):
        kind = "long" if i % 3 == 0 else "short"
        lease = await _acquire(dm, _job(dm, i, sched=dm.new_priority_job(f"j{i}", "m", kinds[kind])))
        seen[kind].add(lease.job.sched.service)
        dm.charge(lease, used[kind])
        dm.release(lease)
        dm.finished(lease.job.sched)
    return seen


def test_db_dispatch_length_classes_learn_each_kind_and_put_the_short_kind_first():
    """--schedule-classes: one-shot jobs of a model split by (prompt, max_tokens) into services with their own
    L̂_s; once learnt, a new short job goes before a new long one, while with one service they are equal (FIFO)."""
    import asyncio

    async def main():
        dm = _priority_dispatch("db", classes=2)
        kinds = {"short": (20, 8), "long": (20, 400)}
        used = {"short": 0.2, "long": 5.0}  # execution seconds each kind takes
        seen = await _teach_classes(dm, kinds, used)
        assert seen["short"] == {"m", "m:0"} and seen["long"] == {"m", "m:1"}  # one service until the first fit
        assert dm.length_classes.describe()["centroids_tokens"] == [[20, 8], [20, 400]]
        mon = dm.priorities.monitor
        assert mon["m:0"].mean == pytest.approx(0.2) and mon["m:1"].mean == pytest.approx(5.0)
        # each class started from what the model's one service had learnt (not the 1 s default)
        assert mon["m:0"].prior_mean == mon["m:1"].prior_mean == pytest.approx(mon["m"].mean) != 1.0
        running = await _acquire(dm, _job(dm, 100, sched=dm.new_priority_job("r", "m", kinds["short"])))
        long = asyncio.ensure_future(_acquire(dm, _job(dm, 101, sched=dm.new_priority_job("l", "m", kinds["long"]))))
        await asyncio.sleep(0)
        short = asyncio.ensure_future(_acquire(dm, _job(dm, 102, sched=dm.new_priority_job("s", "m", kinds["short"]))))
        await asyncio.sleep(0)
        dm.release(running)
        await asyncio.sleep(0)
        assert short.done() and not long.done()  # the short kind overtakes the long one that came first
        dm.release(short.result())
        await asyncio.sleep(0)
        assert long.done()
        dm.release(long.result())
        one = _priority_dispatch("db")  # one service per model: the shape is ignored
        assert one.length_classes is None and one.new_priority_job("x", "m", (20, 8)).service == "m"

    asyncio.run(main())


def test_db_dispatch_starvation_rule_puts_a_service_waiting_past_twice_its_mean_first():
    """Seed 001's starvation rule at the orchestrator (θ_s = 2·L̂_s): with length classes a long job always loses
    to short ones by priority; once it has waited 2·L̂_long it takes the next slot that frees (it pauses nobody:
    at overload every service starves, and those pauses were most of DB's)."""
    import asyncio

    async def main():
        dm = _priority_dispatch("db", classes=2)
        kinds = {"short": (20, 8), "long": (20, 400)}
        used = {"short": 0.01, "long": 0.02}  # L̂: θ_short = 20 ms, θ_long = 40 ms
        await _teach_classes(dm, kinds, used)
        assert dm.starvation_promotions == 0  # nobody waited
        running = await _acquire(dm, _job(dm, 200, sched=dm.new_priority_job("r", "m", kinds["short"])))
        long_job = _job(dm, 201, sched=dm.new_priority_job("l", "m", kinds["long"]))
        long = asyncio.ensure_future(_acquire(dm, long_job))
        await asyncio.sleep(0)
        short = asyncio.ensure_future(_acquire(dm, _job(dm, 202, sched=dm.new_priority_job("s", "m", kinds["short"]))))
        await asyncio.sleep(0)
        dm.charge(running, 0.0001)
        assert long_job.starved is None and not running.preempt  # not yet: θ not passed, the short goes first
        await asyncio.sleep(0.06)
        dm.charge(running, 0.0001)  # both services starved now: the one waiting longest (long) goes first
        assert long_job.starved is not None and not running.preempt and dm.starvation_promotions == 2
        dm.charge(running, 0.05)  # past its budget now, and a starved job waits: still not paused
        assert not running.preempt and dm.priority_preemptions == 0
        dm.release(running)  # it finished
        await asyncio.sleep(0)
        assert long.done() and not short.done()  # the starved long job overtook the better short one
        assert long_job.starved is None and long_job.protected  # promoted once: it runs now, unpaused
        later = asyncio.ensure_future(_acquire(dm, _job(dm, 203, sched=dm.new_priority_job("t", "m", kinds["short"]))))
        await asyncio.sleep(0.03)
        dm.charge(long.result(), 0.05)  # past its budget, a better job waiting: still not paused
        assert not long.result().preempt
        dm.release(long.result())
        await asyncio.sleep(0)
        assert short.done()
        dm.release(short.result())
        await asyncio.sleep(0)
        assert later.done()
        dm.release(later.result())

    asyncio.run(main())


def test_replan_trigger_follows_a_drift_once_a_window_later():
    t = ReplanTrigger(window_s=30.0)
    assert t.reason(0.0, due=False, drifted=False) is None
    assert t.reason(5.0, due=True, drifted=True) == ReplanTrigger.INTERVAL  # the interval's end wins
    t.replanned(5.0, ReplanTrigger.INTERVAL)
    assert t.settle_at is None
    assert t.reason(10.0, due=False, drifted=True) == ReplanTrigger.DRIFT
    t.replanned(10.0, ReplanTrigger.DRIFT)
    assert t.reason(39.9, due=False, drifted=False) is None
    t.replanned(20.0, ReplanTrigger.DRIFT)  # another drift: one window after the last one
    assert t.reason(49.9, due=False, drifted=False) is None
    assert t.reason(50.0, due=False, drifted=False) == ReplanTrigger.SETTLE
    t.replanned(50.0, ReplanTrigger.SETTLE)
    assert t.reason(500.0, due=False, drifted=False) is None  # once only


def test_skip_join_mlfq_at_run_time_learns_its_quantum_and_each_jobs_first_iteration():
    """At the orchestrator every job joined the top queue (nothing set its first-iteration time) and ``q_1`` stayed
    at 30 ms, shorter than one relay step: skip-join was plain MLFQ with every job a level down after its first step.
    Both now come from the steps jobs run: a decode step 0.1 s and prefills of 0.02 s a prompt token."""
    import asyncio

    from petals_chain.algorithms.multimodel import IterationTimes
    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    t = IterationTimes(alpha=1.0)
    assert t.first_iteration_s(100) == 0.0  # nothing seen: every job joins the top queue
    t.observe(0.1, 1)
    t.observe(0.1 + 0.02 * 49, 50)
    assert t.first_iteration_s(1) == pytest.approx(0.1) and t.first_iteration_s(50) == pytest.approx(1.08)

    async def main():
        dm = DispatchManager(schedule="mlfq")
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        first = dm.new_priority_job("r-0", "m", (50, 8))
        lease = await dm.acquire(DispatchJob("r-0", sched=first))
        assert first.level == 0
        for _ in range(20):
            dm.charge(lease, 0.1, 1)
        dm.charge(lease, 0.1 + 0.02 * 49, 50)
        assert dm.priorities.q1 == pytest.approx(0.1)
        short, long_ = dm.new_priority_job("r-1", "m", (2, 8)), dm.new_priority_job("r-2", "m", (200, 8))
        assert short.level == 1 and long_.level == 6  # quanta 0.1 · 2^i cover 0.12 s and 4.1 s
        dm.release(lease)

    asyncio.run(main())


def test_db_dispatch_resumes_a_long_job_of_the_only_service_once_it_waited_long():
    """With one service (``--schedule-classes 1``, before the first length fit, or jobs all of one class) the rule
    between services never fired: a long job paused past its budget never resumed while new jobs kept the chain
    busy (298 in a row; on a real swarm its stream ended in a 503 at the queue timeout)."""
    import asyncio

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    async def main():
        dm = DispatchManager(schedule="db", classes=1)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])

        def job(i, **kw):
            sched = kw.pop("sched", None) or dm.new_priority_job(f"j{i}", "m", (20, 400))
            return DispatchJob(job_id=f"j{i}", sched=sched, **kw)

        for i in range(40):  # L̂ of the service: 50 ms
            lease = await dm.acquire(job(100 + i))
            dm.charge(lease, 0.05)
            dm.release(lease)
            dm.finished(lease.job.sched)
        long = await dm.acquire(job(0))
        long.keeps_kv = True
        nxt = asyncio.ensure_future(dm.acquire(job(1)))
        await asyncio.sleep(0)
        for _ in range(2):
            dm.charge(long, 0.05)  # past its budget (a level down, O_r twice a new job's), a better job waiting
        assert long.preempt and long.job.sched.level == 1
        dm.release(long)
        await asyncio.sleep(0)
        resumed = asyncio.ensure_future(dm.acquire(job(0, requeue=True, yields=True, sched=long.job.sched)))
        running = nxt.result()
        backstop = 4 * 2 * dm.priorities.monitor["m"].mean  # JOB_STARVE_FACTOR x STARVE_FACTOR x L̂
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(2, 10_000):
            assert loop.time() - t0 < 3 * backstop + 0.5, "the long job never resumed"
            newer = asyncio.ensure_future(dm.acquire(job(i)))  # new jobs keep arriving while one runs
            await asyncio.sleep(0.01)
            dm.charge(running, 0.01)
            dm.release(running)
            await asyncio.sleep(0)
            if resumed.done():
                newer.cancel()
                break
            running = newer.result()
        assert loop.time() - t0 >= backstop * 0.9 and dm.starvation_promotions >= 1

    asyncio.run(main())
