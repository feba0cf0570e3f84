"""A wave of servers joining a lightly loaded swarm after its first plan (CI under two test workers: the real-model
swarm's six servers were planned as three, then three more). Placed together they form a chain of their own; the
planner compared that only by the predicted response time, which is flat at light load, so it kept the newcomers'
spans taken one at a time (two on the same blocks, none on the first ones) or none: one chain for good."""

from __future__ import annotations

import pytest

from petals_chain.algorithms import ModelSpec
from petals_chain.orchestrator.planner import Planner, ServerView
from test_orchestrator_units import _FakeRecord


def _planner(use_all_servers: bool) -> Planner:
    model = ModelSpec(num_blocks=9, block_size=10.0, cache_size=1.0)
    return Planner(dht=None, prefix="x", client=None, max_length=64, on_chains=lambda c: None, arrival_rate=1.0,
                   model_spec_fallback=lambda: model, use_all_servers=use_all_servers)


def _view(name: str, rtt_s: float = 0.001) -> ServerView:
    v = ServerView(peer_id=name, record=_FakeRecord(60.0, 0.05, name=name, max_blocks=3))
    v.rtt_s = rtt_s
    return v


@pytest.mark.parametrize("use_all_servers", [True, False])
def test_a_wave_of_newcomers_on_a_lightly_loaded_swarm(use_all_servers):
    pl = _planner(use_all_servers)
    first = [_view(n) for n in "abc"]
    plan = pl.full_plan(first)
    assert plan is not None and len(plan.chains) == 1
    wave = [_view(n, 0.001 * (i + 1)) for i, n in enumerate("def")]
    best, reason = pl._search_joins(first + wave, plan, plan, "servers joined", wave, plan.c)
    if use_all_servers:  # (the default, --spare-servers use): every volunteer serves, as a second chain
        assert reason == "join of 3 servers (chains of their own)" and len(best.chains) == 2
        assert sorted(best.placement[n] for n in "def") == [(0, 3), (3, 3), (6, 3)]
        assert all(best.placement[n] == plan.placement[n] for n in "abc")  # nobody already planned moves
    else:  # --spare-servers idle: the paper's GBP-CR leaves servers the load does not need idle
        assert best is plan and reason == "servers joined"
