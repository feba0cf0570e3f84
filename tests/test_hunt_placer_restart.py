"""The planner and a server that restarts with the same identity (records' ``started_at``, issue 17 leftover): the
load deadline started only at an assignment of a span the server did not serve, so a server that served its span,
restarted and hung loading it again held its blocks with no chain through them for good (no chain after 5 deadlines).
A later ``started_at`` is a restart: the deadline starts again unless the new process already serves its span. The
planner is driven alone with a fake clock (``test_load_deadline.Swarm``)."""

from __future__ import annotations

from test_load_deadline import DEADLINE, Swarm, record


def serving_swarm() -> Swarm:
    sw = Swarm({n: record(n, started_at=100.0) for n in "ABC"})
    sw.refresh()
    assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
    for n in "ABC":
        sw.records[n] = record(n, "online", sw.pl.assignment[n], epoch=sw.pl.epoch, started_at=100.0)
    sw.refresh(1.0)
    assert ("A", "B") in sw.chains()
    return sw


def test_a_restarted_server_whose_load_hangs_is_planned_around_at_the_deadline():
    sw = serving_swarm()
    sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=5000.0)  # back, joining; its load hangs
    sw.refresh(1.0)
    sw.refresh(DEADLINE - 1)
    assert sw.pl.assignment["C"] == (0, 2) and not sw.shown("B")["load_error"]  # a load may take a while
    sw.refresh(2.0)
    assert sw.pl.assignment["C"] == (2, 2) and sw.pl.assignment["B"] == (2, 2), sw.pl.assignment  # C covers B's blocks
    assert sw.shown("B")["state"] == "failed" and "--load-deadline-s 60" in sw.shown("B")["load_error"]
    sw.records["C"] = record("C", "online", (2, 2), epoch=sw.pl.epoch, started_at=100.0)
    sw.refresh(1.0)
    assert ("A", "C") in sw.chains()


def test_a_server_back_with_its_span_or_an_older_record_starts_no_deadline():
    sw = serving_swarm()
    sw.records["B"] = record("B", "online", (2, 2), epoch=sw.pl.epoch, started_at=5000.0)  # restarted, loaded
    sw.refresh(1.0)
    assert sw.pl.servers["B"].awaiting_since is None
    sw.records["B"] = record("B", epoch=sw.pl.epoch, started_at=100.0)  # an older run's record read again: no restart
    sw.refresh(1.0)
    assert sw.pl.servers["B"].awaiting_since is None
