"""The planner's re-placement decisions (review of session 35). A full plan on the spans in force but another cache
reservation ``c`` (Theorem 3.7 tuning as lambda moves) was dropped whole, so ``plan.c`` (new servers' spans, HERD's
split, the model placer) kept the old value; a full plan that moved servers was compared, by its memory's slots,
with the plan in force by the slots its servers announce (fewer: paged KV, ``--max-length``), and a swap of two
equal servers "improved predicted response 1.979s -> 0.4459s": both reloaded for nothing; a chain recompute for a
server's slots read "servers online changed". The planner is driven alone, with a fake clock and records (the
harness records announce 5 slots where their memory holds 10)."""

from __future__ import annotations

from dataclasses import replace

from test_load_deadline import Swarm, record
from test_s31_blip import Counting, _online_swarm


def test_a_new_c_on_the_spans_in_force_is_taken_without_moving_a_server():
    sw = _online_swarm()
    pub, installs = Counting(sw), []
    sw.pl.on_chains = installs.append
    epoch, c = sw.pl.epoch, sw.pl.plan.c
    real = sw.pl.full_plan
    sw.pl.full_plan = lambda views: replace(real(views), c=c - 2)  # GBP-CR's spans, c* tuned to lambda
    assert dict(sw.pl.full_plan(sw.pl.usable_views()).placement.items()) == sw.pl.assignment
    sw.pl.last_full_replan = -1e9  # the re-plan interval is due
    sw.refresh(1.0)
    assert sw.pl.plan.c == c - 2 and sw.pl.epoch == epoch and pub.published == [] and installs == []
    entry = sw.pl.plan_log[-1]
    assert entry["kind"] == "c" and entry["c"] == c - 2 and f"c {c} -> {c - 2}" in entry["reason"], entry
    log_len = len(sw.pl.plan_log)
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)  # the same c again: nothing to log
    assert len(sw.pl.plan_log) == log_len and sw.pl.plan.c == c - 2


def _restarted(rate: float) -> Swarm:
    """An orchestrator (re)started over X and Y serving [2, 4) and [0, 2): equal servers, GBP-CR's order swapped."""
    sw = Swarm({"X": record("X", "online", (2, 2), epoch=3), "Y": record("Y", "online", (0, 2), epoch=3)})
    sw.pl.fixed_rate = rate
    sw.refresh()
    return sw


def test_a_restart_keeps_the_spans_of_equal_servers():
    sw = _restarted(4.0)
    assert sw.pl.assignment == {"X": (2, 2), "Y": (0, 2)} and sw.pl.epoch == 4, list(sw.pl.plan_log)
    assert sw.pl.plan_log[0]["reason"] == "kept the spans the servers already serve"


def test_a_re_plan_does_not_swap_equal_servers_when_lambda_rises():
    sw = _restarted(0.5)
    pub = Counting(sw)
    assert sw.pl.assignment == {"X": (2, 2), "Y": (0, 2)}
    sw.pl.fixed_rate = 4.0  # announced slots now matter: by them the plan in force predicted 4x slower
    full = sw.pl.full_plan(sw.pl.usable_views())
    assert dict(full.placement.items()) == {"X": (0, 2), "Y": (2, 2)}
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)
    assert sw.pl.assignment == {"X": (2, 2), "Y": (0, 2)} and sw.pl.epoch == 4 and pub.published == [], \
        [e["reason"] for e in sw.pl.plan_log]


def test_a_truly_better_re_placement_is_still_adopted():
    """A -> X is the chain, Y a spare on [0, 2); X delivers 5x slower than it advertises: Y takes [2, 4)."""
    sw = Swarm({"A": record("A", "online", (0, 2), epoch=3), "X": record("X", "online", (2, 2), epoch=3),
                "Y": record("Y", "online", (0, 2), epoch=3)})
    sw.refresh()
    assert sw.pl.assignment == {"A": (0, 2), "X": (2, 2), "Y": (0, 2)} and sw.chains() == [("A", "X")]
    for _ in range(30):
        sw.pl.observe_hop("X", 1, 2, None, compute_s=2 * 0.5 / sw.pl.steps_per_job)
    sw.refresh(1.0)
    assert sw.pl.assignment["Y"] == (2, 2) and sw.pl.epoch == 5
    assert any(e["kind"] == "placement" and e["reason"].startswith("re-placement improves")
               for e in sw.pl.plan_log), [e["reason"] for e in sw.pl.plan_log]


def test_a_chain_recompute_says_what_changed_in_the_servers():
    sw = _online_swarm()
    sw.records["A"] = sw.records["A"].model_copy(update={"slots_total": 2, "slots_free": 2})
    sw.refresh(1.0)
    assert sw.pl.plan_log[-1]["reason"] == "slots of A 5 -> 2", list(sw.pl.plan_log)[-1]
    sw.records["B"] = sw.records["B"].model_copy(update={"state": "joining"})  # B reloads: out of the chains
    sw.refresh(1.0)
    assert sw.pl.plan_log[-1]["reason"] == "servers online -B" and sw.chains() == [], list(sw.pl.plan_log)[-1]
    was, now = (("A", 2, 0), ("B", 5, 0)), (("A", 2, 640), ("C", 5, 0))
    assert sw.pl._servers_change(was, now) == "servers online +C, -B; KV cache tokens of A 0 -> 640"
