"""Review of a1cd349 (the planner's re-placement rule): a full plan that moves servers and the plan in force were both
predicted by the slots the servers' memory gives at ``max_length``. Paged servers hold ``max_length / L^`` times
more jobs than that: as lambda rose, the plan in force looked saturated by that count and every server reloaded for
a plan that, by the jobs they hold, predicts a slower response (0.764 s -> 1.038 s here; 7 of 30 random paged
swarms reloaded, none got faster). Both are now predicted by the jobs each server would hold there
(``Planner.held_jobs``). The planner is driven alone, with a fake clock and records."""

from __future__ import annotations

import pytest

from petals_chain.algorithms import gca
from petals_chain.algorithms.token_budget import JobTokenEstimate
from petals_chain.model import ModelSpec
from test_load_deadline import Swarm, record

MODEL = ModelSpec(num_blocks=8, block_size=100.0, cache_size=4.0)  # max_length 64: a slot of 4 bytes a block
MEMORY = {"S0": 700, "S1": 1300, "S2": 500, "S3": 700}
TAU_P = {"S0": 0.06, "S1": 0.221, "S2": 0.176, "S3": 0.209}
JOB = 16  # L^: a paged server holds 64 / 16 = 4 jobs where its memory's slots count one


def _server(name: str, span: tuple[int, int] = (0, 0), paged: bool = False, **kw):
    r = record(name, "online" if span[1] else "joining", span, **kw)
    slots = (MEMORY[name] - 100 * span[1]) // 4 if span[1] else 0  # Eq. 3, as the server loads
    extra = dict(kv_cache="paged", page_size=16, cache_tokens_total=slots * 64, cache_tokens_free=slots * 64) \
        if paged else {}
    return r.model_copy(update=dict(memory_bytes=MEMORY[name], tau_p=TAU_P[name], slots_total=slots,
                                    slots_free=slots, **extra))


def _loaded(paged: bool) -> Swarm:
    """S0..S3 planned at lambda 3.95 and serving their spans."""
    sw = Swarm({n: _server(n) for n in MEMORY})
    sw.pl.model_spec = MODEL
    sw.pl.job_tokens = JobTokenEstimate(64, prior=JOB)
    sw.pl.fixed_rate = 3.95
    sw.refresh()
    for n in MEMORY:
        sw.records[n] = _server(n, sw.pl.assignment[n], paged, epoch=sw.pl.epoch)
    sw.refresh(1.0)
    assert sw.pl.current.chains
    return sw


def _held(sw: Swarm, placement) -> float:
    """The predicted response of ``placement`` with each server holding the jobs it announces once loaded there."""
    specs = sw.pl.specs([v for v in sw.pl.usable_views() if v.peer_id in placement])
    jobs = {s.name: s.residual_slots(MODEL, placement[s.name][1]) * 64 // JOB for s in specs}
    return sw.pl._bounds(gca(specs, MODEL, placement, residual_slots=jobs))[0]


def test_a_paged_swarm_is_not_reloaded_for_a_plan_that_holds_fewer_jobs():
    sw = _loaded(paged=True)
    epoch, before = sw.pl.epoch, dict(sw.pl.assignment)
    sw.pl.fixed_rate = 15.8  # lambda x4: by its memory's slots the plan in force saturates
    full = sw.pl.full_plan(sw.pl.usable_views())
    assert dict(full.placement.items()) != before
    assert _held(sw, full.placement) > 1.3 * _held(sw, sw.pl.plan.placement)  # the move would be slower
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)
    assert sw.pl.assignment == before and sw.pl.epoch == epoch, [e["reason"] for e in sw.pl.plan_log]
    better, ours, theirs = sw.pl.moves_better(sw.pl.usable_views(), sw.pl.plan, full)
    assert not better and ours == pytest.approx(_held(sw, sw.pl.plan.placement), rel=1e-6)
    assert theirs == pytest.approx(_held(sw, full.placement), rel=1e-6)


def test_a_slot_swarm_still_moves_for_a_clearly_better_plan():
    """The same swarm with slot caches (it holds what its memory gives): the move is real, 4.07 s -> 1.08 s."""
    sw = _loaded(paged=False)
    epoch = sw.pl.epoch
    sw.pl.fixed_rate = 15.8
    sw.pl.last_full_replan = -1e9
    sw.refresh(1.0)
    assert sw.pl.epoch == epoch + 1
    reason = sw.pl.plan_log[-2]["reason"]
    assert reason == "re-placement improves predicted response 4.068s -> 1.08s (jobs each server holds, both)", \
        reason
