"""The cache reservation ``c`` taken on spans placed for another (session 36): Theorem 3.7's ``c*`` of a full plan
that is not adopted was taken on the spans kept whatever they hold, so ``/api/v1/swarm`` reported a ``c`` that a kept
server could not hold (its span placed for a smaller one) and newcomers' spans were sized for it; so did a restarted
orchestrator that kept the spans the servers serve. Now ``c`` is taken as far as every placed server holds it. The
planner is driven alone with a fake clock and records (test_load_deadline's harness: 300 bytes, ``s_m`` 100, ``s_c``
10: two blocks hold 5 jobs)."""

from __future__ import annotations

from dataclasses import replace

from test_load_deadline import Swarm, record


def _xy(c_star: int | None = None) -> Swarm:
    """X and Y serve [2, 4) and [0, 2) (the full plan would swap them: not worth a reload); the full plan's c is
    ``c_star`` when given."""
    sw = Swarm({"X": record("X", "online", (2, 2), epoch=3), "Y": record("Y", "online", (0, 2), epoch=3)})
    if c_star is not None:
        real = sw.pl.full_plan
        sw.pl.full_plan = lambda views: replace(real(views), c=c_star)
    return sw


def _replan(sw: Swarm, c_star: int) -> None:
    real = sw.pl.full_plan
    sw.pl.full_plan = lambda views: replace(real(views), c=c_star)
    sw.pl.last_full_replan = -1e9  # the re-plan interval is due
    sw.refresh(1.0)


def test_c_is_raised_on_kept_spans_only_as_far_as_every_server_holds_it():
    """c 2 in force, c* 8: every kept server holds 5 jobs over its 2 blocks. c was taken as 8 ("cache reservation
    c 2 -> 8, spans kept"); now 5, nothing reloaded."""
    sw = _xy()
    sw.refresh()
    sw.pl.plan = replace(sw.pl.plan, c=2)
    epoch = sw.pl.epoch
    _replan(sw, 8)
    assert sw.pl.assignment == {"X": (2, 2), "Y": (0, 2)} and sw.pl.epoch == epoch
    assert sw.pl.plan.c == 5, [e["reason"] for e in sw.pl.plan_log]
    assert "c 2 -> 5" in sw.pl.plan_log[-1]["reason"], sw.pl.plan_log[-1]
    assert sw.pl.jobs_reserved(sw.pl.usable_views(), sw.pl.plan.placement) == 5


def test_c_beyond_what_the_kept_spans_hold_is_not_taken_and_a_lower_one_is():
    """c 5 in force (what the spans hold): c* 8 changes nothing (no "c" entry); c* 3 is taken."""
    sw = _xy()
    sw.refresh()
    assert sw.pl.plan.c == 5
    n = len(sw.pl.plan_log)
    _replan(sw, 8)
    assert sw.pl.plan.c == 5 and [e for e in list(sw.pl.plan_log)[n:] if e["kind"] == "c"] == []
    _replan(sw, 3)
    assert sw.pl.plan.c == 3 and "c 5 -> 3" in sw.pl.plan_log[-1]["reason"]


def test_a_restarted_orchestrator_keeping_the_served_spans_takes_only_the_c_they_hold():
    """A restarted orchestrator keeps the spans X and Y serve; the full plan's c (8) was taken with them: c 8 on
    servers that hold 5 jobs. Now 5."""
    sw = _xy(c_star=8)
    sw.refresh()
    assert sw.pl.plan_log[0]["reason"] == "kept the spans the servers already serve"
    assert sw.pl.plan.c == 5, list(sw.pl.plan_log)
