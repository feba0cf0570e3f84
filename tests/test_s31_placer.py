"""The model placer and the planner over odd histories and records (issue 17 leftovers), on the real planners and
placer driven round by round (``test_placer_restart_overdue.RestartableSwarm``):

* a server overdue once loading a model kept the doubled load deadline there after a load that ended in time, until
  it restarted (a hang there was then noticed twice as late, for good);
* a server restarted with its clock set back (its new ``started_at`` earlier than the run before's) was read as
  restarted by its model's planner, but not by the placer while a record of the run before lived under another model:
  the placer passed over the new run's records, so a load it could not do kept it on that model, serving nothing;
* a record announcing ``tau_p`` 5e-324 (positive, denormal) made the placer's speed estimate infinite: every
  placement round raised, and no server was placed on any model;
* the planner alone: a server whose record one read missed while it loaded its assigned span, back before a re-plan,
  had no load deadline any more (a load that hung held its blocks with no chain through them for good)."""

from __future__ import annotations

import pydantic
import pytest

from petals_chain.swarm.records import TAU_P_MAX, TAU_P_MIN, ServerRecord, _ServerValueV1
from test_multimodel_load_failure import BOTH, SHORT_CACHE, Swarm
from test_placer_restart_overdue import DEADLINE, RestartableSwarm, beta_traffic, s_on_beta


def test_a_load_in_time_after_an_overdue_one_gives_the_next_try_the_one_deadline_again():
    sw = RestartableSwarm(deadline_s=DEADLINE)
    s_on_beta(sw)
    beta = sw.orchs["beta"].planner
    sw.now += DEADLINE + 1  # its load of beta hangs: overdue, moved to alpha
    sw.step()
    assert sw.placed("S") == "alpha" and sw.placer.json()["overdue_loads"] == {"S": {"beta": 1}}
    sw.announce("S", BOTH, "alpha")
    sw.step()
    sw.load("S", BOTH, "alpha")
    beta_traffic(sw)  # one deadline later beta's traffic gets it back, with twice the deadline there
    sw.step(2)
    assert sw.placed("S") == "beta", sw.placer.json()
    sw.announce("S", BOTH, "beta")
    sw.step()
    assert beta.assignment.get("S") == (0, 2) and beta.servers["S"].deadline_scale == 2.0
    sw.now += 10.0  # this time it loads within the one deadline
    sw.load("S", BOTH, "beta")
    sw.step()
    assert beta.current.chains, beta.current
    # the code before: {"S": {"beta": 1}} and a scale of 2 kept until S restarted
    assert sw.placer.json()["overdue_loads"] == {} and beta.load_deadline_scale == {}, sw.placer.json()


def test_a_load_slower_than_the_deadline_keeps_the_doublings_it_needed_only():
    """S's overdue loads of beta were counted 3 times (its next try there gets 8 x the deadline); the load that ends
    takes 100 s: 2 x the deadline of 60 s would do, so the next try gets that."""
    sw = RestartableSwarm(deadline_s=DEADLINE)
    s_on_beta(sw)
    beta = sw.orchs["beta"].planner
    sw.placer.overdue_strikes["S"] = {"beta": 3}
    beta.load_deadline_scale["S"] = 8.0
    sw.now += 100.0
    sw.load("S", BOTH, "beta")
    sw.step()
    assert sw.placer.json()["overdue_loads"] == {"S": {"beta": 1}} and beta.load_deadline_scale == {"S": 2.0}
    assert beta.servers["S"].load_s == pytest.approx(100.0)


def test_a_server_restarted_with_its_clock_set_back_is_moved_off_a_model_it_cannot_load():
    """S (started at 1000) restarts with its clock set back: its new run (started at 50) announces beta's record, and
    a record of the run before still lives under alpha. The new run cannot load beta's span and says so: beta's
    planner plans around it, and the placer moves it to alpha (the code before kept it on beta, serving nothing,
    while the run before's record lived)."""
    sw = RestartableSwarm()
    s_on_beta(sw, started_at=1000.0)
    beta = sw.orchs["beta"].planner
    sw.announce("S", BOTH, "beta", started_at=50.0)  # beta's record is the new run's, alpha's the last run's
    sw.step()
    assert beta.servers["S"].starts == (1000.0, 50.0)  # beta's planner: a restart
    sw.announce("S", BOTH, "beta", started_at=50.0, failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert beta.reported_load_failure("S") is not None
    assert sw.placed("S") == "alpha" and set(sw.placer.load_failures["S"]) == {"beta"}, sw.placer.json()
    assert sw.placer.started_at["S"] == 50.0


def test_a_record_of_the_run_before_read_late_under_another_model_is_no_restart():
    """S (started at 2000) failed beta and was moved to alpha; a record of a run before (1000), read for the first time
    under beta, is not a restart: beta's failure stands (as the placer read it before, taking the latest start of all
    records; the placer reads each record's start now)."""
    sw = RestartableSwarm()
    s_on_beta(sw, started_at=2000.0)
    beta = sw.orchs["beta"].planner
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    assert sw.placed("S") == "alpha"
    sw.announce("S", ["alpha"], "alpha")  # alpha's record only (beta's missed by a read)
    sw.dht.records["alpha-p"]["S"] = ServerRecord(**{**sw.dht.records["alpha-p"]["S"].model_dump(),
                                                     "models": ["alpha-p", "beta-p"], "serving": "alpha-p"})
    sw.dht.records["beta-p"].pop("S")
    sw.step()
    sw.now += beta.records_lost_s  # missed for as long as a record lives: taken as gone (a shorter miss: a failed read)
    sw.step()
    sw.announce("S", BOTH, "alpha", started_at=None)
    sw.dht.records["beta-p"]["S"] = ServerRecord(**{**sw.dht.records["beta-p"]["S"].model_dump(), "started_at": 1000.0})
    sw.step()
    assert set(sw.placer.load_failures.get("S", {})) == {"beta"} and sw.placer.started_at["S"] == 2000.0
    # a later start first read there (beta's record missed by a read; alpha's not yet the new run's) is a restart
    beta_record = sw.dht.records["beta-p"].pop("S")
    sw.step()
    sw.dht.records["beta-p"]["S"] = ServerRecord(**{**beta_record.model_dump(), "started_at": 3000.0})
    sw.step()
    assert "S" not in sw.placer.load_failures and sw.placer.started_at["S"] == 3000.0


@pytest.mark.parametrize("tau", [5e-324, 1e-300, 1.7e308])
def test_a_record_announcing_an_absurd_tau_p_is_read_within_bounds_and_planned(tau):
    sw = Swarm()
    for peer in ("S", "T", "U"):  # S offers both models with the absurd tau_p, T and U too with a plain one
        sw.announce(peer, BOTH, "alpha")
    for name in BOTH:
        rec = sw.dht.records[f"{name}-p"]["S"]
        sw.dht.records[f"{name}-p"]["S"] = ServerRecord.from_value(rec.to_value() | {"tau_p": tau})
    sw.step()  # the code before: ValueError (S "takes no time per job") out of every placement round
    assert set(sw.placer.placement) == {"S", "T", "U"} and set(sw.placer.placement.values()) == set(BOTH)

    value = ServerRecord(peer_id="S", state="joining", memory_bytes=500, tau_p=0.1).to_value() | {"tau_p": tau}
    assert _ServerValueV1.parse_obj(value).dict() == value  # an older peer's value: stored as it is
    got = ServerRecord.from_value(value).tau_p
    assert got == (TAU_P_MIN if tau < 1 else TAU_P_MAX)
    assert ServerRecord.from_value(value | {"tau_p": 0.0}).tau_p == 0.0  # still profiling
    with pytest.raises(pydantic.ValidationError):
        ServerRecord.from_value(value | {"tau_p": -1e-300})



def test_a_server_whose_record_missed_a_read_mid_load_still_has_a_load_deadline():
    """The planner alone (``test_load_deadline.Swarm``): B, assigned [2, 4), is loading when one read misses its
    record while D joins (the plan settles before re-planning: B's span stays assigned); B's record is back next
    read. Its view was made afresh, without the load clock its assignment started: a load that hung then held B's
    blocks, with no chain through them, for good. Its clock runs again: past the deadline C takes its blocks over."""
    from test_load_deadline import DEADLINE as LOAD_DEADLINE, Swarm as PlannerSwarm, record

    sw = PlannerSwarm({n: record(n) for n in "ABC"})
    sw.refresh()
    assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
    sw.load("A")
    sw.load("C")
    sw.refresh(1.0)
    sw.pl.settle_s = 30.0
    b = sw.records.pop("B")
    sw.records["D"] = record("D")
    sw.refresh(1.0)  # D joins: not settled, no re-plan
    sw.records["B"] = b
    sw.refresh(1.0)
    sw.pl.last_change -= 60.0  # settled (the planner's settle time is real time)
    sw.refresh(1.0)
    assert sw.pl.assignment["B"] == (2, 2) and sw.pl.assignment["C"] == (0, 2), sw.pl.assignment
    sw.refresh(LOAD_DEADLINE)
    # the code before: B never overdue, C never moved (no chain: nobody else holds [2, 4))
    assert sw.pl.servers["B"].load_overdue and sw.shown("B")["state"] == "failed", sw.shown("B")
    assert sw.pl.assignment["C"] == (2, 2), sw.pl.assignment
