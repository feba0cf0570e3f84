"""(Proposed with the StrikeBook.prune diff.) The auditor forgets the strike records of servers gone."""

from __future__ import annotations

import asyncio
import time
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


def _auditor(live: list[str], servers: dict, **kw):
    """An auditor whose servers all answer ``x`` unchanged (every audit agrees), over ``servers`` as the planner's."""
    from petals_chain.orchestrator.audit import Auditor

    class Session:
        async def step(self, x, position):
            return x

        async def close(self):
            pass

    class Client:
        async def open_session(self, peer, **kw):
            return Session()

    planner = types.SimpleNamespace(servers=servers, online_views=lambda: [], report_failure=lambda *a, **k: None)
    orch = types.SimpleNamespace(planner=planner, client=Client(), cfg=types.SimpleNamespace(step_timeout_s=5.0),
                                 replacement_servers=lambda s, e: list(live))
    return Auditor(orch, rate=1.0, seed=0, **kw)


def test_prune_cost_is_amortized_when_the_book_keeps_many_records():
    """Records a prune must keep (banned liars, each back under a new id after its ban) made every later audit
    scan the whole book: 1,000 audits with 500 banned ids scanned 500,500 records (~1 ms an audit at 5,000). Now
    the next prune waits until the book has doubled past what the last one kept."""
    live = ["ref1", "ref2"]
    servers = {p: None for p in ("p0", *live)}
    auditor = _auditor(live, servers)
    for i in range(500):
        auditor.book.banned.add(f"liar{i}")
        auditor.book.audited(f"liar{i}")
    scanned = []
    prune = auditor.book.prune

    def counting(keep, now, below=0.01):
        scanned.append(len(auditor.book))
        return prune(keep, now, below)

    auditor.book.prune = counting
    x = torch.ones(1, 1, 8)

    async def audits():
        for i in range(1000):  # one server at a time, each under a new peer id
            peer = f"p{i}"
            servers.clear()
            servers.update({p: None for p in (peer, *live)})
            await auditor._judge(peer, 0, 4, None, x, 0, x)

    asyncio.run(audits())
    assert auditor.counts["agreed"] == 1000
    assert sum(scanned) <= 5 * 1000, (len(scanned), sum(scanned))  # a few records an audit, not the whole book
    assert len(auditor.book) <= 2 * (500 + len(servers) + 1)  # still bounded: the servers gone are forgotten
    assert all(auditor.distrusted(f"liar{i}") for i in range(500))


def test_a_struck_server_missing_from_one_read_keeps_its_strikes():
    """(Guard.) A server struck and then missing from the planner for one read (a partial DHT read) while the book
    is pruned keeps its decaying strikes: struck again when it is back, it is banned as if it never left."""
    live = ["ref1", "ref2"]
    servers = {p: None for p in ("liar", *live)}
    auditor = _auditor(live, servers, threshold=1.5, half_life_s=3600.0)
    auditor._strike("liar", 1.0, 0, 4)
    for i in range(200):  # servers gone fill the book past its bound
        auditor.book.audited(f"gone{i}")
    del servers["liar"]  # one read misses it
    auditor._prune()
    assert len(auditor.book) < 200 and auditor.book.snapshot("liar", time.monotonic())["strikes"] == 1
    servers["liar"] = None
    auditor._strike("liar", 1.0, 0, 4)
    assert auditor.distrusted("liar")
