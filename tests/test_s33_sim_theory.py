"""The simulators against queueing theory and conservation laws (session 33).

Each token-step simulator, reduced to one server that runs one request at a time, is an M/D/1 or M/G/1 queue whose
mean response time Pollaczek-Khinchine gives; the chain-dispatch simulator's M/M/1, M/M/c and Theorem 3.7 checks
are in ``tests/test_sim.py``. Fixed seeds: the runs are deterministic, the tolerance is the runs' 99.9 % interval.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from petals_chain.algorithms.chainsim import MMRequest, MultiModelSim, StepCost, exec_alone, simulate
from petals_chain.algorithms.deadlines import BatchLatency, DeadlineRequest, make_scheduler
from petals_chain.algorithms.multimodel import ServedModel, Volunteer
from petals_chain.sim import deadlines as dl
from petals_chain.sim import fairness as fair
from petals_chain.sim.engine import mean_ci

LAM = 0.7  # M/D/1 at rho = 0.7: one step of 1 s per request
RUNS, JOBS, WARM = 6, 3000, 300
ONE_STEP = StepCost(a=1.0, b=0.0, d=0.0)
MODEL = ServedModel("m", 1, 1.0, 0.01, 1.0, rate=LAM, c=4)  # one block, 1 s on a speed-1 server: scale 1


def pk_mean(lam: float, es: float, es2: float) -> float:
    """Pollaczek-Khinchine: mean response time of M/G/1 with service moments ``es``, ``es2``."""
    return es + lam * es2 / (2 * (1 - lam * es))


def _arrivals(seed: int, lam: float = LAM, n: int = JOBS) -> np.ndarray:
    return np.cumsum(np.random.default_rng([33, seed]).exponential(1 / lam, n))


def _outputs(seed: int, p: float | None, n: int = JOBS) -> np.ndarray:
    return np.random.default_rng([34, seed]).geometric(p, n) if p else np.ones(n, dtype=int)


def _close(means: list[float], exact: float) -> None:
    m, h = mean_ci(means, level=0.999)
    assert abs(m - exact) <= h, (m, h, exact)
    assert h < 0.1 * exact  # the check must be able to fail


@pytest.mark.parametrize("schedule,p", [("fcfs", None), ("db", 0.5)])
def test_chainsim_one_request_at_a_time_is_md1_mg1(schedule, p):
    """One chain, ``max_batch=1``, steps of 1 s: M/D/1 (one-token requests) or M/G/1 (geometric outputs)."""
    lam = LAM if p is None else 0.25  # rho 0.5: geometric outputs vary more
    means = []
    for s in range(RUNS):
        t, out = _arrivals(s, lam), _outputs(s, p)
        reqs = [MMRequest(i, "m", float(t[i]), 0, int(out[i]), exec_alone(0, int(out[i]), ONE_STEP))
                for i in range(JOBS)]
        o = simulate(reqs, [MODEL], [Volunteer("v", 100.0)], {"v": "m"}, schedule, cost=ONE_STEP, max_batch=1)
        means.append(float(np.mean([r.latency for r in o.requests[WARM:]])))
    es, es2 = (1.0, 1.0) if p is None else (1 / p, (2 - p) / p**2)
    _close(means, pk_mean(lam, es, es2))


def test_fairness_sim_one_slot_is_md1():
    means = []
    for s in range(RUNS):
        t = _arrivals(s)
        reqs = [fair.Request(i, f"c{i % 2}", float(t[i]), None, 0, 1, 1) for i in range(JOBS)]
        o = fair.FairSim("vtc", workers=1, capacity=1, cost=ONE_STEP).run(reqs)
        assert all(r.finishes == 1 for r in o.requests)
        means.append(float(np.mean([r.finished - r.arrival for r in o.requests[WARM:]])))
    _close(means, pk_mean(LAM, 1.0, 1.0))


@pytest.mark.parametrize("discipline", ["fcfs", "flex"])
def test_deadline_sim_batches_of_one_are_md1(discipline):
    means = []
    for s in range(RUNS):
        t = _arrivals(s)
        reqs = [DeadlineRequest.with_slo(i, "m", float(t[i]), 1e9) for i in range(JOBS)]
        o = dl.simulate(make_scheduler(discipline, {"w": {"m": BatchLatency(0.0, 1.0)}}, b_max=1), reqs,
                        float(t[-1]))
        means.append(float(np.mean(np.array(o.finish_s[WARM:], dtype=float) - t[WARM:])))
    _close(means, pk_mean(LAM, 1.0, 1.0))


def test_deadline_utilization_never_exceeds_one():
    """Busy time <= workers x time. Overloaded FCFS (late requests still run) drains long after the last arrival;
    its utilization read 2.15 at twice the capacity (all busy time over the arrival window)."""
    r = dl.load(loads=(2.0,), duration_s=0.5, policies=("fcfs", "flex"))
    for p, m in r["rows"][0]["policies"].items():
        assert 0.9 <= m["utilization"] <= 1.0 + 1e-9, (p, m["utilization"])


def test_deadline_utilization_is_the_busy_fraction_of_the_window():
    """One worker, batches of one taking 1 s, arrivals at 0, 1, ..., 9 plus nine at 0.5 (FCFS): busy from 0 to 19;
    over the 10 s window it was busy all the time, and half of it for a single request at 0..5 s of a 20 s one."""
    times = [float(k) for k in range(10)] + [0.5] * 9
    reqs = [DeadlineRequest.with_slo(i, "m", t, 1e9) for i, t in enumerate(sorted(times))]
    o = dl.simulate(make_scheduler("fcfs", {"w": {"m": BatchLatency(0.0, 1.0)}}, b_max=1), reqs, 10.0)
    assert o.busy_s["w"] == pytest.approx(19.0)
    assert o.utilization == pytest.approx(1.0)
    one = dl.simulate(make_scheduler("fcfs", {"w": {"m": BatchLatency(0.0, 5.0)}}, b_max=1),
                      [DeadlineRequest.with_slo(0, "m", 0.0, 1e9)], 20.0)
    assert one.utilization == pytest.approx(0.25)


def test_mean_ci_is_student_t_and_covers_95_percent():
    """A 95 % interval from 3 runs must cover the mean 95 % of the time; the normal quantile (1.96) covered 81 %."""
    assert mean_ci([1.0, 2.0, 3.0])[1] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    rng = np.random.default_rng(7)
    hits = 0
    trials = 4000
    for x in rng.normal(10.0, 2.0, (trials, 3)):
        m, h = mean_ci(x)
        hits += abs(m - 10.0) <= h
    assert 0.94 <= hits / trials <= 0.96, hits / trials
    assert mean_ci([5.0]) == (5.0, math.inf)
    with pytest.raises(ValueError):
        mean_ci([1.0, 2.0], level=1.5)


def test_chainsim_conserves_requests_and_work_across_disciplines_and_migrations():
    """Every request finishes once with all its tokens, servers moving between models mid-run included; with one
    request at a time and no lost KV every work-conserving order ends at the same instant."""
    cost = StepCost(a=0.05, b=0.0001, d=0.002)
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(1 / 6.0, 300))
    specs = [("a" if rng.random() < 0.6 else "b", int(rng.integers(20, 400)), int(rng.integers(1, 60))) for _ in t]

    def requests() -> list[MMRequest]:
        return [MMRequest(i, m, float(t[i]), inp, out, exec_alone(inp, out, cost))
                for i, (m, inp, out) in enumerate(specs)]

    models = [ServedModel(n, 1, 1.0, 0.01, 1.0, rate=3.0, c=8) for n in "ab"]
    vols = [Volunteer(f"s{i}", 100.0) for i in range(4)]
    flips = iter(range(10**6))

    def replan(sim: MultiModelSim, now: float):
        s = f"s{next(flips) % 4}"
        cur = {**sim.plan, **sim.loading}
        return {s: "b" if cur.get(s) == "a" else "a"}, now + 10.0

    sim = MultiModelSim(models, vols, {"s0": "a", "s1": "a", "s2": "b", "s3": "b"}, schedule="db", cost=cost,
                        kv_tokens=3000, replan=replan, replan_first=5.0, reload_s=2.0,
                        monitor_priors={"a": (1.0, 0.5), "b": (1.0, 0.5)})
    o = sim.run(requests())
    assert o.unfinished == 0 and sim.finished == len(specs)
    assert sum(r.migrations for r in o.requests) > 0  # the moves did move requests
    for r in o.requests:
        assert r.done == r.output and r.arrival <= r.first_token <= r.finished, vars(r)
    one = [ServedModel("m", 1, 1.0, 0.01, 1.0, rate=3.0, c=8)]
    ends = []
    for schedule in ("fcfs", "db", "mlfq"):
        rs = [MMRequest(i, "m", float(t[i]), 0, out, exec_alone(0, out, ONE_STEP)) for i, (_, _, out) in
              enumerate(specs)]
        o = simulate(rs, one, [Volunteer("v", 100.0)], {"v": "m"}, schedule, cost=ONE_STEP, max_batch=1)
        ends.append(max(r.finished for r in o.requests))
        assert o.steps == sum(out for _, _, out in specs)  # one step per token: no work lost or repeated
    assert ends[0] == pytest.approx(ends[1]) == pytest.approx(ends[2])


def test_deadline_and_fairness_experiments_reproduce_by_seed():
    """The same seed gives the same numbers (wall times aside), another seed other numbers."""
    def run(seed: int) -> list:
        r = dl.load(seed=seed, loads=(1.0,), duration_s=0.3, policies=("flex", "fcfs"))
        return [(p, m["on_time"], m["dropped"], m["utilization"]) for p, m in r["rows"][0]["policies"].items()]

    assert run(0) == run(0)
    assert run(0) != run(1)
    clients = fair.prefix_clients(3, rate=2.0, prefix=200, output=8)
    out = [fair.simulate("dlpm", fair.make_workload(clients, 20.0, seed=s), capacity=4) for s in (0, 0, 1)]
    key = [[(r.rid, r.finished) for r in o.requests] for o in out]
    assert key[0] == key[1] and key[0] != key[2]
