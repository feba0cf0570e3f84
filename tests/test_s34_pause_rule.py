"""One pause rule for the orchestrator and the chain simulator (algorithms/multimodel.py ``PAUSE_RULES``): under
``runtime`` (the simulator's default) a running job keeps its place unless a waiting one goes before it by the
discipline's margin (``Scheduler.pause_victim``, what ``DispatchManager._preempt_for_priority`` asks); a starved
job pauses nobody and, once started, is not paused again. ``seed`` keeps seed 001's pause on any inversion."""

from __future__ import annotations

import numpy as np
import pytest

from petals_chain.algorithms import chainsim as cs
from petals_chain.algorithms import multimodel as mm
from petals_chain.algorithms.chainsim import MMRequest, MultiModelSim, exec_alone
from petals_chain.algorithms.multimodel import DBScheduler, FCFSScheduler, Job, MLFQScheduler, ServedModel, Volunteer


def _db(pauses: str, **kw) -> DBScheduler:
    return DBScheduler(mm.ServiceMonitor({"a": (1.0, 0.0), "b": (1.0, 0.0)}), pauses=pauses, **kw)


def _running(s: mm.Scheduler, job: Job, now: float = 0.0) -> None:
    s.arrive(job, now)
    assert s.select(1, now) == [job]


def _two_running_one_waiting(pauses: str, b_priority: float) -> tuple[DBScheduler, Job, Job, Job]:
    """Service a's jobs a1, a2 (O 50) hold both places of a DB group; b's job b1 (O ``b_priority``) waits from 0."""
    s = _db(pauses)
    a1, a2, b1 = Job("a1", "a", 0.0), Job("a2", "a", 0.0), Job("b1", "b", 0.0)
    for j in (a1, a2):
        s.arrive(j, 0.0)
    s.select(2, 0.0)
    s.arrive(b1, 0.0)
    a1.priority = a2.priority = 50.0
    b1.priority = b_priority
    return s, a1, a2, b1


@pytest.mark.parametrize("ratio,paused", [(1.9, False), (2.0, True), (10.0, True)])
def test_db_pauses_a_running_job_only_for_one_worth_pausing_for(ratio, paused):
    """O_r of the running job = ratio x the new one's: the seed's rule pauses it at any ratio > 1, the runtime's only
    at PAUSE_FACTOR (2) or more, as the orchestrator does."""
    for pauses in mm.PAUSE_RULES:
        s = _db(pauses, starve_factor=None)
        run, new = Job("run", "a", 0.0), Job("new", "a", 1.0)
        _running(s, run)
        s.arrive(new, 1.0)
        run.priority, new.priority = ratio, 1.0
        batch = s.select(1, 1.0)
        expect_pause = paused or pauses == "seed"
        assert batch == ([new] if expect_pause else [run]), (pauses, ratio)
        assert s.preempted == ([run] if expect_pause else [])
        assert s.worth_pausing(ratio, 1.0) == paused  # the margin both the simulator and the orchestrator use


def test_free_places_go_in_order_and_each_waiting_job_pauses_at_most_one():
    """Capacity 3: two running jobs (O 8 and 3) and three waiting (O 1, 2, 5). The free place goes to O 1; O 2 pauses
    O 8 (8 >= 2 x 2); O 5 does not pause O 3. Under the seed's rule the batch is simply the best three."""
    for pauses, expect in (("runtime", ["w1", "w2", "r3"]), ("seed", ["w1", "w2", "r3"])):
        s = _db(pauses, starve_factor=None)
        r8, r3 = Job("r8", "a", 0.0), Job("r3", "a", 0.1)
        for j in (r8, r3):
            s.arrive(j, 0.0)
        assert len(s.select(3, 0.0)) == 2
        ws = [Job(f"w{p}", "a", 1.0 + i) for i, p in enumerate((1, 2, 5))]
        for j in ws:
            s.arrive(j, 1.0)
        for j, p in zip((r8, r3, *ws), (8.0, 3.0, 1.0, 2.0, 5.0)):
            j.priority = p
        assert sorted(j.key for j in s.select(3, 1.0)) == sorted(expect)
        assert [j.key for j in s.preempted] == ["r8"]
    # ... but where the seed's rule pauses on a small inversion, the runtime's keeps both running jobs
    for pauses, expect in (("runtime", {"r8", "r3", "w1"}), ("seed", {"w1", "w2", "r3"})):
        s = _db(pauses, starve_factor=None)
        r8, r3 = Job("r8", "a", 0.0), Job("r3", "a", 0.1)
        for j in (r8, r3):
            s.arrive(j, 0.0)
        s.select(3, 0.0)
        ws = [Job("w1", "a", 1.0), Job("w2", "a", 2.0)]
        for j in ws:
            s.arrive(j, 1.0)
        r8.priority, r3.priority, ws[0].priority, ws[1].priority = 5.0, 3.0, 1.0, 4.0
        assert {j.key for j in s.select(3, 1.0)} == expect, pauses


def test_a_starved_job_pauses_nobody_and_once_started_is_not_paused_for_priority():
    """Service b's job waits past θ_b = 2 L̂_b while a's jobs (O 50) hold both places: under the runtime rule it waits
    for a free place (the seed's rule puts it in at once), takes it, and a new job of O 0.01 then pauses the other
    running job, never it."""
    s, a1, a2, b1 = _two_running_one_waiting("runtime", 1.0)
    assert set(map(id, s.select(2, 5.0))) == {id(a1), id(a2)} and b1.starved
    s.complete(a1, 6.0)
    assert set(map(id, s.select(2, 6.0))) == {id(a2), id(b1)} and b1.protected and not a2.protected
    new = Job("new", "a", 6.5)
    s.arrive(new, 6.5)
    new.priority, b1.priority = 0.01, 40.0  # b1 demoted below the new job: still not paused
    assert set(map(id, s.select(2, 6.5))) == {id(b1), id(new)} and s.preempted == [a2]
    seed, a1, a2, b1 = _two_running_one_waiting("seed", 1.0)
    assert b1 in seed.select(2, 5.0) and len(seed.preempted) == 1


def test_fcfs_never_pauses_and_mlfq_pauses_across_levels_only():
    f = FCFSScheduler(pauses="runtime")
    new, old = Job("new", "a", 1.0), Job("old", "a", 0.0)
    _running(f, new, 1.0)
    f.arrive(old, 1.0)  # an older job that did not fit earlier: it waits, as the orchestrator's fcfs has it wait
    assert f.select(1, 2.0) == [new] and not f.worth_pausing(1.0, 0.0)
    m = MLFQScheduler(pauses="runtime", q1=1.0)
    run = Job("run", "a", 0.0)
    _running(m, run)
    m.charge([run], 1.5, 1.5)  # used its level-0 quantum: level 1
    same, top = Job("same", "a", 2.0, prefill_s=1.5), Job("top", "a", 3.0)
    m.arrive(same, 2.0)  # skip-join to level 1: same level, no pause
    assert same.level == 1 and m.select(1, 2.0) == [run]
    m.arrive(top, 3.0)
    assert m.select(1, 3.0) == [top] and m.preempted == [run]


def test_bad_pause_rules_are_refused():
    for bad in ("", "none", "Runtime"):
        with pytest.raises(ValueError, match="pause rule"):
            mm.make_scheduler("db", pauses=bad)
        with pytest.raises(ValueError, match="pause rule"):
            MultiModelSim([ServedModel("m", 1, 1.0, 0.01, 1.0, rate=1.0, c=4)], [Volunteer("v", 100.0)], {"v": "m"},
                          pauses=bad)


def test_the_simulators_db_pauses_only_by_the_margin_and_never_a_starved_start():
    """On a random overload, every pause the simulator's DB makes under the runtime rule is one the orchestrator would
    make: the job that took the place goes before the paused one by PAUSE_FACTOR. Under the seed's rule some are not
    (the rule the runtime does not follow), and it pauses many times more."""
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(1 / 30.0, 250))
    reqs = [MMRequest(i, "a", float(t[i]), int(rng.integers(1, 600)), int(rng.integers(1, 120)),
                      service="s" + str(int(rng.integers(3)))) for i in range(250)]
    for r in reqs:
        r.exec_s = exec_alone(r.input, r.output, cs.MM_COST)
    models = [ServedModel("a", 1, 1.0, 0.01, 1.0, rate=10.0, c=8)]
    counts = {}
    for pauses in mm.PAUSE_RULES:
        bad = []
        real = mm.Scheduler.select

        def spy(self, capacity, now, fits=None, one_of=None, bad=bad):
            batch = real(self, capacity, now, fits, one_of)
            for p in self.preempted:
                if not any(p.priority >= mm.PAUSE_FACTOR * j.priority for j in batch if j not in (p,)):
                    bad.append(p)
            return batch

        mm.Scheduler.select = spy
        try:
            o = cs.simulate(reqs, models, [Volunteer("v", 100.0)], {"v": "a"}, "db", cost=cs.MM_COST, max_batch=8,
                            kv_tokens=6000, pauses=pauses)
        finally:
            mm.Scheduler.select = real
        assert o.unfinished == 0
        counts[pauses] = (sum(r.preemptions for r in o.requests), len(bad))
    assert counts["runtime"][0] > 0 and counts["runtime"][1] == 0, counts
    assert counts["seed"][1] > 0 and counts["seed"][0] > 3 * counts["runtime"][0], counts


def test_a_promoted_mlfq_job_stays_starved_until_it_starts_and_pauses_nobody():
    """MLFQ's starvation rule moves a job waiting past starve_s to the top queue; as DB's promoted jobs, it then waits
    for a free place and pauses nobody, at the next steps too (before: from the next step on it paused the running
    job, which starved in turn: 35k pauses and 22k recomputes for 4.9k requests on the db quick run), as the
    orchestrator's mlfq now does too (DispatchManager._promote_starved)."""
    m = MLFQScheduler(pauses="runtime", q1=1.0, starve_s=1.0)
    run, w = Job("run", "a", 0.0), Job("w", "a", 0.5, prefill_s=2.5)
    _running(m, run)
    m.charge([run], 3.5, 0.5)  # level 2
    m.arrive(w, 0.5)  # skip-join at level 2: same level as the running job, no pause
    assert m.select(1, 0.6) == [run] and w.level == 2
    for t in (1.7, 1.8, 1.9):  # starved at 1.7 (waited > 1 s): level 0, first in line, but no pause
        assert m.select(1, t) == [run] and w.starved and w.level == 0, t
        m.charge([run], 0.1, t + 0.1)
    m.complete(run, 2.0)
    assert m.select(1, 2.0) == [w] and w.protected and not w.starved
    new = Job("new", "a", 2.1)
    m.arrive(new, 2.1)
    w.level = 5  # however far it falls, a job started because it starved is not paused for priority
    assert m.select(1, 2.1) == [w]


def test_db_promotes_one_starved_job_per_service_at_a_time_as_the_orchestrator():
    """DispatchManager._promote_starved promotes one job per service while it waits. b1 starves behind two running
    jobs (O 50); a better job of b (b2, O 1) that arrives then is not promoted with it: once b1 has a place, b2 goes
    by its O_r and pauses a2 (50 >= 2 x 1). Before, b2 was marked starved after 0.1 s of waiting: it paused nobody,
    waited for a free place, and once started was never paused for priority (protected)."""
    s, a1, a2, b1 = _two_running_one_waiting("runtime", 5.0)
    assert set(map(id, s.select(2, 3.0))) == {id(a1), id(a2)} and b1.starved  # waited 3 s > θ_b = 2 s
    b2 = Job("b2", "b", 3.5)
    s.arrive(b2, 3.5)
    b2.priority = 1.0
    assert set(map(id, s.select(2, 3.6))) == {id(a1), id(a2)}  # b1 is b's promoted job: it goes first, b2 waits
    assert not b2.starved
    s.complete(a1, 4.0)
    assert set(map(id, s.select(2, 4.0))) == {id(b1), id(b2)} and s.preempted == [a2]
    assert b1.protected and not b2.protected and not b1.starved
