"""A flexible server whose load of a model always takes longer than ``--load-deadline-s`` (issue 17 leftover), on the
real planners and placer driven round by round (``test_placer_restart_overdue.RestartableSwarm``): it was moved off
the model at the deadline and back one deadline later, every two deadlines for good; each move restarted its load, so
the model, whose only server it is, was never served (19 moves in 20 deadlines). Each overdue load of the same model
now doubles both the wait before the next try there and that try's deadline."""

from __future__ import annotations

import logging

from test_multimodel_load_failure import BOTH
from test_placer_restart_overdue import DEADLINE, RestartableSwarm, s_on_beta


def drive(sw: RestartableSwarm, load_s: float, horizon_s: float, step_s: float = 10.0) -> list[tuple]:
    """S follows the placement with beta's traffic arriving throughout: alpha's span loads at once, beta's takes
    ``load_s`` from the assignment that gave it (a move restarts it). The moves made, as (time, from, to)."""
    beta = sw.orchs["beta"].planner
    t0, moves, last, loading_since = sw.now, [], sw.placed("S"), sw.now
    while sw.now - t0 < horizon_s:
        sw.now += step_s
        for k in range(3):
            beta.rates.arrive(sw.now - k)
        where = sw.placed("S")
        if where == "beta" and beta.assignment.get("S") and sw.now - loading_since >= load_s:
            sw.load("S", BOTH, "beta")
        elif where == "alpha" and sw.orchs["alpha"].planner.assignment.get("S"):
            sw.load("S", BOTH, "alpha")
        else:
            sw.announce("S", BOTH, where)
        sw.step()
        if sw.placed("S") != last:
            moves.append((round(sw.now - t0), last, sw.placed("S")))
            last, loading_since = sw.placed("S"), sw.now
    return moves


def test_a_load_slower_than_the_deadline_gets_longer_tries_and_ends_served():
    sw = RestartableSwarm(deadline_s=DEADLINE)
    s_on_beta(sw)
    moves = drive(sw, load_s=2.5 * DEADLINE, horizon_s=20 * DEADLINE)
    beta = sw.orchs["beta"].planner
    # tries of 60 s, then 120 s (off beta 60 s, then 120 s), then 240 s: the load of 150 s ends in the third
    assert [m[1:] for m in moves] == [("beta", "alpha"), ("alpha", "beta")] * 2, moves
    assert sw.placed("S") == "beta" and beta.current is not None and beta.current.chains, sw.placer.json()
    assert "S" not in sw.placer.load_failures and sw.placer.json()["overdue_loads"] == {"S": {"beta": 2}}
    assert beta.load_deadline_scale == {"S": 4.0}


def test_the_longer_deadline_is_said_and_forgotten_when_the_server_restarts(caplog):
    sw = RestartableSwarm(deadline_s=DEADLINE)
    s_on_beta(sw)
    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.placement"):
        moves = drive(sw, load_s=100 * DEADLINE, horizon_s=4.5 * DEADLINE)  # a load that never ends
    assert [m[1:] for m in moves] == [("beta", "alpha"), ("alpha", "beta"), ("beta", "alpha")], moves
    failure = sw.placer.json()["load_failures"]["S"]["beta"]
    assert "--load-deadline-s 60 x 2 after earlier overdue loads" in failure["load_error"], failure
    assert any("not placed on beta again for 120 s, then with 4 x its load deadline" in r.getMessage()
               for r in caplog.records), caplog.text
    sw.started["S"] = 5000.0  # restarted: it loads afresh, with the one deadline
    sw.announce("S", BOTH, "alpha")
    sw.step()
    assert "S" not in sw.placer.overdue_strikes and sw.orchs["beta"].planner.load_deadline_scale == {}
