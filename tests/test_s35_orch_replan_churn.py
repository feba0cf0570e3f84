"""Re-plans that change nothing (soak hunt, session 35). The chains were recomputed, and installed in the dispatcher
(a new dispatch generation: every queued job drained and re-arrived, reserved slots and fairness charges redone), at
every refresh where the steps-per-job estimate crossed a fixed 25 % bucket boundary: a soak's mean of ~13 steps
hovered across 1.25**11.5 = 13.03 and made ~10 "plans" per 45 s round with nothing moved. The estimate now moves the
chains only once it leaves a 25 % band around the value they were computed with, and chains identical to the
installed ones are not installed again. The planner is driven alone, with a fake clock and records."""

from __future__ import annotations

from test_s31_blip import _online_swarm


def _installs(sw) -> list:
    calls: list = []
    sw.pl.on_chains = calls.append
    return calls


def test_steps_per_job_hovering_at_a_bucket_edge_recomputes_nothing():
    sw = _online_swarm()
    sw.pl.steps_per_job = 12.9
    for _ in range(8):  # measured compute: the chains' service times scale with the steps per job
        for n in "AB":
            sw.pl.observe_hop(n, 1, 2, None, compute_s=2 * 0.1 / 13)
    sw.refresh(1.0)
    calls, log_len, epoch = _installs(sw), len(sw.pl.plan_log), sw.pl.epoch
    before_s = sw.pl.current.chains[0].service_time
    for k in range(10):  # the soak's estimate: 12.4 .. 14.2, around 13.03
        sw.pl.steps_per_job = (12.9, 13.2)[k % 2]
        sw.refresh(1.0)
    assert calls == [] and len(sw.pl.plan_log) == log_len and sw.pl.epoch == epoch, list(sw.pl.plan_log)[log_len:]
    # a real change (more than 25 % from what the chains were computed with) still recomputes them, once
    sw.pl.steps_per_job = 17.0
    sw.refresh(1.0)
    sw.refresh(1.0)
    assert len(calls) == 1 and sw.pl.plan_log[-1]["reason"].startswith("steps per job 17.0"), list(sw.pl.plan_log)
    assert calls[0][0].service_time > 1.25 * before_s


def test_chains_unchanged_by_a_ban_are_not_installed_again():
    """C holds a spare span in no chain: its ban (or its return) leaves the chains as they are: the dispatcher keeps
    its generation (no drain and re-arrival of the queue)."""
    sw = _online_swarm()
    calls = _installs(sw)
    before = list(sw.pl.current.chains)
    sw.pl.report_failure("C", "test")
    assert sw.pl.servers["C"].banned and calls == [] and sw.chains() == [("A", "B")]
    assert sw.pl.current.chains == before
    sw.pl.report_failure("B", "test")  # B is on the chain: dropped at once
    assert calls == [[]] and sw.chains() == []


def test_a_full_plan_that_moves_nothing_is_not_adopted_as_a_re_placement():
    """At the periodic re-plan, GBP-CR's plan predicts from the servers' memory, the plan in force from the slots they
    announce: the same spans "improved predicted response 2.394s -> 0.9606s" (soak) and were adopted again every
    interval, the chains reinstalled each time."""
    import asyncio

    from petals_chain.orchestrator.planner import Plan

    sw = _online_swarm()
    calls, log_len, epoch = _installs(sw), len(sw.pl.plan_log), sw.pl.epoch
    cur = sw.pl.current
    same = Plan(c=sw.pl.plan.c, placement=sw.pl.plan.placement, chains=cur.chains, lower=cur.lower / 10,
                upper=cur.upper / 10)
    sw.pl.full_plan = lambda views: same
    sw.pl.last_full_replan = -1e9  # the interval is due
    asyncio.run(sw.pl._decide([], []))
    assert calls == [] and len(sw.pl.plan_log) == log_len and sw.pl.epoch == epoch, list(sw.pl.plan_log)[log_len:]
    assert sw.pl.plan.lower != same.lower
