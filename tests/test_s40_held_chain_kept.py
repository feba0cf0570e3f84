"""Servers that join holding a whole chain (handed over by another orchestrator's group, or restarted together) on a
lightly loaded swarm: the prediction is flat there, and the rule that keeps held spans asked for a strictly better
one, so the wave was left unplaced for good: each span alone completes no chain, and GBP-CR over the wave would move
every one of them (refused since test_s40_wave_join_held). With every volunteer used (``--spare-servers use``) the
spans are kept, as a wave of newcomers is placed, when that predicts no worse and serves more."""

from __future__ import annotations

import pytest

from petals_chain.orchestrator.planner import ServerView, _total_rate
from test_orchestrator_units import _FakeRecord
from test_s40_wave_join_held import _planner


def _view(name: str, rtt_s: float, span: tuple[int, int] = (0, 0), tau_p: float = 0.05) -> ServerView:
    slots = (60 - 10 * span[1]) // span[1] if span[1] else 0  # what its memory holds there (Eq. 3)
    record = _FakeRecord(60.0, tau_p, start=span[0], num=span[1], slots=slots, state="online" if span[1] else "joining",
                         name=name, max_blocks=3)
    record.max_length = 64
    v = ServerView(peer_id=name, record=record)
    v.rtt_s = rtt_s
    return v


@pytest.mark.parametrize("use_all", [True, False])
def test_a_wave_holding_a_whole_chain_keeps_it_at_light_load(use_all):
    pl = _planner(use_all)
    first = [_view(n, 0.001 * (i + 1)) for i, n in enumerate("abc")]
    plan = pl.full_plan(first)
    assert plan is not None and len(plan.chains) == 1
    spans = {"d": (6, 3), "e": (0, 3), "f": (3, 3)}  # a whole chain, not in the order GBP-CR would give it
    wave = [_view(n, 0.002 * (i + 1), spans[n], tau_p=0.1) for i, n in enumerate("def")]  # slower: no faster chain
    views = first + wave
    base = pl.evaluate(views, plan.placement, plan.c, residual=pl.held_jobs(views, plan.placement))
    best, reason = pl._keep_held_spans(views, base, base, "", wave, plan.c)
    best, reason = pl._search_joins(views, base, best, reason, wave, plan.c)
    if use_all:
        assert {n: tuple(best.placement[n]) for n in "def"} == spans, reason
        assert reason == "3 server(s) joined holding spans: kept"
        assert _total_rate(best.chains) > 1.05 * _total_rate(base.chains)
        assert best.lower <= base.lower * (1 + 1e-9)
    else:  # --spare-servers idle: a flat prediction is no reason to use them (unchanged)
        assert best is base and reason == ""
