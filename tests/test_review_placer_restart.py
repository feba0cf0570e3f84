"""The planner's restart detection (records' ``started_at``, ``Planner._note_start``), driven alone with a fake clock
(``test_load_deadline.Swarm``): an older record read late and then the newer one again is no restart (each such read
restarted the load clock and cleared an overdue load: never planned around); a restart with an earlier start (a
clock set back) is one; a restart loads with the one deadline (the longer one of earlier overdue loads stayed)."""

from __future__ import annotations

from test_hunt_placer_restart import serving_swarm
from test_load_deadline import DEADLINE, record


def hung_restart(started_at: float):
    """B, serving [2, 4), restarts (its process started at ``started_at``) and its load hangs."""
    sw = serving_swarm()
    sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=started_at)
    sw.refresh(1.0)
    return sw


def test_an_older_record_read_late_does_not_restart_the_load_clock():
    sw = hung_restart(5000.0)
    sw.refresh(DEADLINE + 1)
    assert sw.pl.servers["B"].load_overdue and sw.pl.assignment["C"] == (2, 2)
    since = sw.pl.servers["B"].awaiting_since
    for _ in range(3):
        sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=100.0)  # the run before's, read late
        sw.refresh(DEADLINE / 2)
        sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=5000.0)
        sw.refresh(DEADLINE / 2)
    # the code before: each newer record read again was a restart (not overdue, its clock 30 s old)
    assert sw.pl.servers["B"].load_overdue and sw.pl.servers["B"].awaiting_since == since
    assert sw.shown("B")["state"] == "failed"


def test_a_restart_with_an_earlier_start_time_is_a_restart():
    sw = hung_restart(50.0)  # its clock was set back: the new process says it started before the old one (100)
    sw.refresh(DEADLINE - 1)
    assert not sw.pl.servers["B"].load_overdue
    sw.refresh(2.0)
    # the code before: no deadline was started (B held [2, 4) with no chain through it for good)
    assert sw.pl.servers["B"].load_overdue and sw.pl.assignment["C"] == (2, 2), sw.pl.assignment


def test_a_restart_loads_with_the_one_deadline():
    sw = serving_swarm()
    sw.pl.load_deadline_scale["B"] = 4.0  # its loads were overdue twice before (the model placer doubles it)
    sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=5000.0)
    sw.refresh(1.0)
    sw.refresh(DEADLINE + 1)
    # the code before: the restarted load kept 4 x the deadline (not overdue until 240 s)
    assert sw.pl.servers["B"].load_overdue and "x 4" not in sw.shown("B")["load_error"], sw.shown("B")
    assert "B" not in sw.pl.load_deadline_scale


def test_the_placer_keeps_a_failed_load_when_the_run_befores_records_are_read_late():
    """The model placer (``test_placer_restart_overdue.RestartableSwarm``): S restarted once (1000 -> 2000), then
    failed beta's span and was moved to alpha; its records of the run before (1000), read again, are no restart."""
    from test_multimodel_load_failure import BOTH, SHORT_CACHE
    from test_placer_restart_overdue import RestartableSwarm, s_on_beta

    sw = RestartableSwarm()
    s_on_beta(sw, started_at=1000.0)
    beta = sw.orchs["beta"].planner
    sw.started["S"] = 2000.0
    sw.announce("S", BOTH, "beta")
    sw.step(2)
    sw.announce("S", BOTH, "beta", failed_span=[0, 2], load_error=SHORT_CACHE, epoch=beta.epoch)
    sw.step()
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert sw.placed("S") == "alpha" and set(sw.placer.load_failures["S"]) == {"beta"}
    for started in (1000.0, 2000.0):
        sw.started["S"] = started
        sw.announce("S", BOTH, "alpha")
        sw.step()
        # the code before: the older start read as a restart, beta's failure forgotten
        assert set(sw.placer.load_failures.get("S", {})) == {"beta"}, sw.placer.json()["load_failures"]
    sw.started["S"] = 3000.0  # a restart indeed
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert "S" not in sw.placer.load_failures
