"""The planner's leftovers of session 35 (review notes): a newcomer that joins holding a span was predicted there by
the jobs it announces and elsewhere by its memory's slots (a reload for nothing, worse on one basis); a retune of the
cache reservation ``c`` with a join sized the newcomer's span at the old ``c``; ``c`` stayed stale when the full plan
that chose a new one moved servers and was not adopted; ties of ``c`` (the same Theorem 3.7 bound) were broken by
the smallest ``c``, at float noise, so ``c`` flapped between equal values. The planner is driven alone, with a fake
clock and records (the harness records announce 5 slots where their memory holds 10)."""

from __future__ import annotations

import time
from dataclasses import replace

from petals_chain.algorithms import ModelSpec, ServerSpec, tune_capacity
from petals_chain.swarm.records import ServerRecord
from test_load_deadline import MODEL, Swarm, record
from test_s31_blip import Counting, _online_swarm


def _serving(name: str, span: tuple[int, int], memory: int = 300, slots: int = 5, tau_p: float = 0.1) -> ServerRecord:
    return ServerRecord(peer_id=name, public_name=name, state="online", memory_bytes=memory, tau_p=tau_p,
                        kv_cache="slots", start_block=span[0], num_blocks=span[1], slots_total=slots, slots_free=slots,
                        timestamp=time.time(), max_length=64, epoch=3)


def test_a_newcomer_serving_a_span_is_not_reloaded_by_its_memorys_slots():
    """D joins serving [2, 4) with the 15 slots it announces (its memory holds 30 there, 10 beside all 4 blocks). Its
    span was predicted by the 15, the whole model by the memory's 10: "join of D (incremental)" moved it to [0, 4)
    (2.57 s -> 0.856 s predicted; on the jobs it would hold there, 5, no stable plan at all). Now it keeps its span."""
    sw = Swarm({"A": _serving("A", (0, 2)), "B": _serving("B", (2, 2), tau_p=0.2), "C": _serving("C", (0, 2))})
    sw.pl.fixed_rate, sw.pl.use_all_servers = 8.0, False
    sw.refresh()
    assert sw.pl.assignment == {"A": (0, 2), "B": (2, 2), "C": (0, 2)}
    sw.records["D"] = _serving("D", (2, 2), memory=500, slots=15)
    sw.refresh(1.0)
    assert sw.pl.assignment["D"] == (2, 2), [e["reason"] for e in sw.pl.plan_log]
    assert ("C", "D") in [ch.servers for ch in sw.pl.current.chains]


def test_a_retune_with_a_join_sizes_the_newcomers_span_at_the_new_c():
    """c* moves to 12 at the re-plan D (450 bytes: 4 blocks beside 1 job, 3 beside 5, 2 beside 12) joins in. D got the
    span of the c before (4 blocks: one job) and c stayed; now c is 12 and D's span holds 12 jobs."""
    sw = _online_swarm()
    real = sw.pl.full_plan
    sw.pl.full_plan = lambda views: replace(real(views), c=12)  # Theorem 3.7's c* at this lambda
    sw.records["D"] = record("D").model_copy(update={"memory_bytes": 450})
    sw.refresh(1.0)
    assert sw.pl.plan.c == 12, [e["reason"] for e in sw.pl.plan_log]
    spec = sw.pl.specs([sw.pl.servers["D"]])[0]
    assert sw.pl.assignment["D"][1] == spec.max_blocks(MODEL, 12) == 2, sw.pl.assignment


def test_c_follows_lambda_when_a_moving_full_plan_is_not_adopted():
    """X and Y serve [2, 4) and [0, 2); the full plan swaps them (GBP-CR's order) at a new c: the swap is not worth
    it, and its c was dropped with it. Now c is taken on the spans kept: no reload, nothing published, said once."""
    sw = Swarm({"X": record("X", "online", (2, 2), epoch=3), "Y": record("Y", "online", (0, 2), epoch=3)})
    sw.refresh()
    pub = Counting(sw)
    epoch, c = sw.pl.epoch, sw.pl.plan.c
    real = sw.pl.full_plan
    sw.pl.full_plan = lambda views: replace(real(views), c=c - 3)
    assert dict(sw.pl.full_plan(sw.pl.usable_views()).placement.items()) == {"X": (0, 2), "Y": (2, 2)}
    sw.pl.last_full_replan = -1e9  # the re-plan interval is due
    sw.refresh(1.0)
    assert sw.pl.assignment == {"X": (2, 2), "Y": (0, 2)} and sw.pl.epoch == epoch and pub.published == []
    assert sw.pl.plan.c == c - 3, [e["reason"] for e in sw.pl.plan_log]
    entry = sw.pl.plan_log[-1]
    assert entry["kind"] == "c" and f"c {c} -> {c - 3}" in entry["reason"], entry


def test_the_c_in_force_is_kept_when_it_ties_and_else_the_largest_of_its_placement():
    """A, B, C (300 bytes: 2 blocks beside up to 5 jobs): every c of 1..5 gives the one placement, the same bound.
    The plan took c 1 (its memory's 10 slots planned for one job each); now the largest, 5. A c in force that ties
    (3) was retuned to 1 at the next re-plan ("cache reservation c 3 -> 1"); now it is kept."""
    sw = _online_swarm()
    assert sw.pl.plan.c == 5
    sw.pl.plan = replace(sw.pl.plan, c=3)
    log_len = len(sw.pl.plan_log)
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)
    assert sw.pl.plan.c == 3 and len(sw.pl.plan_log) == log_len, list(sw.pl.plan_log)[log_len:]


def test_c_does_not_flap_between_equal_bounds_as_lambda_moves():
    """Five servers, every server placed (use_all_servers): c 1..8 give bounds that differ only by waiting below 1e-9
    (different placements), and the smallest "attaining" it followed the float noise: c 7 at lambda 0.32, 1 at 0.093, 7 again (s2 reloading between 2 and 5
    blocks each time). With the c in force preferred among ties, c and the placement stay."""
    model = ModelSpec(5, 1.0, 0.25)
    servers = [ServerSpec("s0", 16.0, 0.04325, 0.28562), ServerSpec("s1", 16.0, 0.09355, 0.13853),
               ServerSpec("s2", 8.0, 0.12276, 0.17389), ServerSpec("s3", 16.0, 0.00827, 0.23098),
               ServerSpec("s4", 16.0, 0.09892, 0.24076)]
    c, placement, _ = tune_capacity(servers, model, 0.32, use_all_servers=True, ties="largest")
    for lam in (0.093, 0.32, 0.128, 0.404):
        c2, placement2, _, table = tune_capacity(servers, model, lam, use_all_servers=True, ties="largest", prefer=c,
                                                 return_table=True)
        assert (c2, dict(placement2.items())) == (c, dict(placement.items())), (lam, c2, table)
        # without a c in force, the tied placement serving most (s2 on 2 blocks) at its largest c: no noise
        assert tune_capacity(servers, model, lam, use_all_servers=True, ties="largest")[0] == c == 8
    # the paper's argmin (the default) is unchanged, the noise's winner
    assert tune_capacity(servers, model, 0.32, use_all_servers=True)[0] == 7
