"""Review of 7c92f6f (a wave of newcomers placed as chains of their own when that predicts no worse and serves more).

The rule also took a wave whose servers joined holding spans (handed over by another orchestrator's group, or
restarted): GBP-CR over the newcomers places them by their speeds alone, so on a lightly loaded swarm, where the
prediction is flat, all three were moved off the chain they held for some more jobs per second: a reload of each
(minutes on a real model), where one newcomer keeps its span unless another predicts clearly better. A wave
holding no spans still forms chains of its own (test_s39_wave_join)."""

from __future__ import annotations

from petals_chain.algorithms import ModelSpec
from petals_chain.orchestrator.planner import Planner, ServerView, _total_rate
from test_orchestrator_units import _FakeRecord


def _view(name: str, rtt_s: float, tau_p: float = 0.05, span: tuple[int, int] = (0, 0)) -> ServerView:
    record = _FakeRecord(60.0, tau_p, start=span[0], num=span[1], slots=4 if span[1] else 0,
                         state="online" if span[1] else "joining", name=name, max_blocks=6 if span[1] else 3)
    record.max_length = 64
    v = ServerView(peer_id=name, record=record)
    v.rtt_s = rtt_s
    return v


def _planner(use_all: bool = True) -> Planner:
    model = ModelSpec(num_blocks=9, block_size=10.0, cache_size=1.0)
    return Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                   model_spec_fallback=lambda: model, use_all_servers=use_all)


def test_a_wave_holding_spans_is_not_reloaded_for_capacity_alone():
    pl = _planner()
    first = [_view(n, 0.001 * (i + 1)) for i, n in enumerate("abc")]
    plan = pl.full_plan(first)
    assert plan is not None and len(plan.chains) == 1
    spans = {"d": (0, 5), "e": (5, 2), "f": (7, 2)}  # a whole chain, held
    wave = [_view(n, 0.001 * (i + 1), tau_p, spans[n]) for i, (n, tau_p) in enumerate(zip("def", (0.1, 0.1, 0.05)))]
    views = first + wave
    base = pl.evaluate(views, plan.placement, plan.c, residual=pl.held_jobs(views, plan.placement))
    together = pl.joint(views, base.placement, wave, plan.c)
    # the case: GBP-CR moves every one of them, for more jobs per second, predicting the same response
    assert all(tuple(together.placement[n]) != spans[n] for n in "def")
    assert abs(together.lower - base.lower) <= 1e-9 * base.lower
    assert _total_rate(together.chains) > 1.05 * _total_rate(base.chains)
    best, reason = pl._search_joins(views, base, base, "", wave, plan.c)
    assert reason != "join of 3 servers (chains of their own)"
    assert all(best.placement.get(n) in (None, spans[n]) for n in "def"), dict(best.placement.items())

