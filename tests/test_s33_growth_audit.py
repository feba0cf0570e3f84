"""(Proposed with the StrikeBook.prune diff.) The auditor forgets the strike records of servers gone."""

from __future__ import annotations

import asyncio
import types

import torch


def test_auditor_forgets_servers_gone_whose_strikes_decayed():
    """Every audit kept a strike record of each server it involved, for ever: one per peer id audited since start
    (1,000 servers that came and went: 1,000 records, and a strike series each for liars). Now the records of
    servers gone, not banned, whose strikes decayed away are dropped; a banned server's stays."""
    from petals_chain.orchestrator.audit import PRUNE_SLACK, Auditor

    class Session:
        def __init__(self, peer):
            self.peer = peer

        async def step(self, x, position):
            return x + (0.5 if self.peer.startswith("liar") else 0.0)

        async def close(self):
            pass

    class FakeClient:
        async def open_session(self, peer, **kw):
            return Session(peer)

    servers: dict = {}
    planner = types.SimpleNamespace(servers=servers, online_views=lambda: [],
                                    report_failure=lambda *a, **k: None)
    live = ["ref1", "ref2"]
    orch = types.SimpleNamespace(planner=planner, client=FakeClient(), cfg=types.SimpleNamespace(step_timeout_s=5.0),
                                 replacement_servers=lambda s, e: list(live))
    auditor = Auditor(orch, rate=1.0, seed=0, half_life_s=1e-3, threshold=1.0)
    x = torch.ones(1, 1, 8)

    async def churn():
        for i in range(1000):
            peer = f"liar{i}" if i == 7 else f"p{i}"
            servers.clear()
            servers.update({p: None for p in (peer, *live)})
            out = x + (0.5 if peer.startswith("liar") else 0.0)
            await auditor._judge(peer, 0, 4, None, x, 0, out)

    asyncio.run(churn())
    assert auditor.distrusted("liar7")  # struck once at threshold 1: banned for good, kept
    assert len(auditor.book) <= 2 * len(servers) + PRUNE_SLACK + 3, len(auditor.book)
    assert auditor.book.snapshot("liar7", 0.0)["strikes"] == 1
