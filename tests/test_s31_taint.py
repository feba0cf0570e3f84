"""Verified chains after a ban: KV a chain did not compute itself (a prefix-cache hit, a fork of a sibling) may
have been computed from the banned server's replies even when that server is not on the chain.

Servers name a cached page by its tokens' prefix hashes and the orchestrator's salt only (runner.allocate_locked:
``pool.match(layers, page_hashes(prefix_hashes))``), not by the servers upstream of them: a later hop's pages made
for a job through a liar serve a later job whose earlier hop is honest. In-process: a fake chain session and
servers' cache, the real dispatcher, auditor, replay cache and stats."""

from __future__ import annotations

import asyncio
import types

import torch

from petals_chain.model import Chain
from petals_chain.orchestrator import failover
from petals_chain.orchestrator.audit import Auditor
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchManager
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.stats import Stats
from petals_chain.swarm.prefix import HASH_BYTES, PREFIX_BLOCK_TOKENS, prefix_hashes, split_hashes

H = 8  # hidden size of the fake hops' replies


class FakeChainSession:
    """A chain whose servers share one prefix cache (``cache``: the page names they hold, of any upstream)."""

    cache: set[bytes] = set()
    made: list["FakeChainSession"] = []

    def __init__(self, client, hops, session_id, max_length, observe=None, wait_s=0.0, push=False):
        self.hops, self.max_length = list(hops), max_length
        self.peers_used = {h[0] for h in self.hops}
        self.prefix_cache, self.push, self.wait_s, self.silent_wait_max_s = True, False, wait_s, 0.0
        self.cached_tokens = 0
        self.named_at_open = self.named_at_close = None
        self.forked_from = None
        self.positions: list[int] = []  # the first position of every step
        FakeChainSession.made.append(self)

    async def open(self, fork_from=None, fork_length=0, named=b""):
        self.named_at_open, self.forked_from = named, fork_from
        held = 0
        for h in split_hashes(named):
            if h not in self.cache:
                break
            held += 1
        self.cached_tokens = held * PREFIX_BLOCK_TOKENS

    async def step(self, i, x, position):
        if i == 0:
            self.positions.append(position)
        return torch.zeros(1, x.shape[1], H)

    async def close(self, named=b""):
        self.named_at_close = named
        self.cache.update(split_hashes(named))


def make_orch(servers=("h0", "h1")):
    stats = Stats()
    dm = DispatchManager(policy="jffc")
    dm.set_chains([Chain(servers=servers, blocks=(2, 2), service_time=1.0, capacity=4, spans=((0, 2), (2, 4)))])
    orch = types.SimpleNamespace(
        dispatch=dm, stats=stats, prefix_directory=ChainPrefixes(), chain_sessions=set(), shares=None, planner=None,
        replay_cache=ReplayCache(1 << 20), client=None, observe_hop=None, model_id="m",
        cfg=types.SimpleNamespace(queue_timeout_s=30.0, output_reserve_tokens=0, max_failovers=3, relay="orchestrator",
                                  open_wait_max_s=1.0, hold_sessions=False, no_chain_wait_s=5.0, step_timeout_s=5.0),
        batcher=types.SimpleNamespace(embed=embed), server_failed=lambda e: None, replacement_servers=lambda s, e: [])
    orch._background = lambda coro: asyncio.ensure_future(coro)
    orch.auditor = Auditor(orch, 0.0, registry=stats.registry)
    return orch


async def embed(ids):
    return torch.zeros(1, len(ids), H)


def run(monkeypatch, body):
    monkeypatch.setattr(failover, "ChainSession", FakeChainSession)
    monkeypatch.setattr(FakeChainSession, "cache", set())
    monkeypatch.setattr(FakeChainSession, "made", [])
    asyncio.run(asyncio.wait_for(body(), 60))  # a holder that drops and re-takes its chain for ever fails here


def test_a_chain_that_reused_cached_kv_replays_after_a_ban_and_offers_none_of_it(monkeypatch):
    """Job A ran through the liar L (hop 0) and closed: hop 1 cached pages computed from L's replies. Job C's chain
    (h0, h1) does not run through L but reuses those pages. After L's ban, C must drop that KV and replay on a chain
    that computes it (C kept it: its tokens came from L's replies), and its close must offer none of it under the
    new salt (it did: the liar's contribution survived the ban, as the cached pages of a later prompt)."""
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks named at open (all but the last token)

    async def body():
        orch = make_orch()
        FakeChainSession.cache.update(split_hashes(prefix_hashes(prompt[:32])))  # A's close, before the ban
        holder = ChainHolder(orch, "c", 64)
        await holder.feed(prompt)
        first = FakeChainSession.made[0]
        assert "L" not in first.peers_used and first.cached_tokens == 32 and first.positions == [32]
        orch.auditor.ban("L")  # audits caught A's hop 0
        await holder.feed([7])
        assert len(FakeChainSession.made) == 2, "the chain that reused pages from before the ban was kept"
        assert first.named_at_close == b""  # nothing of it offered to a later job
        second = FakeChainSession.made[1]
        assert second.cached_tokens == 0 and second.positions == [0]  # every token computed again
        assert second.named_at_open == prefix_hashes(prompt, orch.auditor.salt)
        await holder.close()
        # the replayed chain computed all of its KV after the ban: offered under the new salt
        assert second.named_at_close == prefix_hashes(prompt + [7], orch.auditor.salt)
        assert len(second.named_at_close) == 3 * HASH_BYTES

    run(monkeypatch, body)


def test_a_chain_that_computed_its_own_kv_keeps_it_after_an_unrelated_ban(monkeypatch):
    """Nothing reused, no banned server on the chain: a ban elsewhere changes nothing for the job."""
    prompt = list(range(100, 150))

    async def body():
        orch = make_orch()
        holder = ChainHolder(orch, "c", 64)
        await holder.feed(prompt)
        orch.auditor.ban("L")
        await holder.feed([7])
        assert len(FakeChainSession.made) == 1 and FakeChainSession.made[0].positions == [0, 50]
        await holder.close()
        assert FakeChainSession.made[0].named_at_close == prefix_hashes(prompt + [7], orch.auditor.salt)

    run(monkeypatch, body)


def test_a_fork_carries_the_kv_provenance_of_its_sibling(monkeypatch):
    """``n > 1``: a choice forks the prompt's KV from its sibling's chain. The sibling's KV came from a server it
    replaced since (L, now banned), or from a prefix cache before a ban: the fork holds the same KV, and must
    replay like its sibling (the fork's own chain never named L, so it kept the liar's KV and offered it)."""
    prompt = list(range(100, 150))

    async def body(reused: bool):
        FakeChainSession.cache.clear()
        FakeChainSession.made.clear()
        orch = make_orch()
        if reused:
            FakeChainSession.cache.update(split_hashes(prefix_hashes(prompt[:32])))
        first = ChainHolder(orch, "a", 64)
        await first.feed(prompt)
        if not reused:
            first.cs.peers_used.add("L")  # hop 0 moved from L to h0 during the prefill
        child = ChainHolder(orch, "b", 64)
        child.fork_source = (first, len(prompt))
        child.kv_ids, child.paid = list(prompt), len(prompt)
        await child.feed([7])
        forked = FakeChainSession.made[1]
        assert forked.forked_from is first.cs and forked.positions == [50]
        orch.auditor.ban("L")
        await child.feed([8])
        assert len(FakeChainSession.made) == 3, "the fork kept KV its sibling must replay"
        assert forked.named_at_close == b""
        assert FakeChainSession.made[2].positions == [0] and FakeChainSession.made[2].forked_from is None
        await child.close()
        await first.close()
        assert first.cs is None

    run(monkeypatch, lambda: body(False))
    run(monkeypatch, lambda: body(True))


def test_a_job_cancelled_while_it_waits_to_open_again_on_a_full_chain_gives_its_slot_back(monkeypatch):
    """A chain's servers refuse the open twice for lack of pages: the job waits a moment before the next try, holding
    its lease. Its client leaving during that wait lost the lease for good (the cancellation came out of the
    ``except HopFailure`` handler, past the clause that releases it): the chain had one slot less until a re-plan."""
    from petals_chain.orchestrator.relay import HopFailure

    opens = []
    refused_twice = asyncio.Event()

    class FullChainSession(FakeChainSession):
        async def open(self, fork_from=None, fork_length=0, named=b""):
            opens.append(self)
            if len(opens) == 2:
                refused_twice.set()
            raise HopFailure("h1", RuntimeError("no capacity: 4 cache page(s) needed"), no_capacity=True, hop=1)

    async def body():
        monkeypatch.setattr(failover, "ChainSession", FullChainSession)
        orch = make_orch()
        holder = ChainHolder(orch, "c", 64)
        feeding = asyncio.ensure_future(holder.feed(list(range(20))))
        await refused_twice.wait()  # the second refusal's handler runs on to its sleep before this wakes
        assert not feeding.done() and orch.dispatch.running == 1
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
        assert feeding.cancelled()
        assert orch.dispatch.running == 0, "the cancelled job's lease was never given back"
        assert not orch.chain_sessions
        await holder.close()

    run(monkeypatch, body)


def test_every_open_counts_its_lookup_so_the_prompt_cache_hit_rate_stays_within_one(monkeypatch):
    """Two opens of one prompt (two choices, or a failover's reopen) each reuse 32 of its 50 tokens: the hit rate is
    64 of the 100 tokens looked up (it counted the hits of every open against the prompt's tokens counted once per
    request, and passed 1)."""
    prompt = list(range(100, 150))

    async def body():
        orch = make_orch()
        FakeChainSession.cache.update(split_hashes(prefix_hashes(prompt[:32])))
        holders = [ChainHolder(orch, "c", 64) for _ in range(2)]
        for h in holders:
            await h.feed(prompt)
        assert orch.stats.prefix_json()["prompt_cache_hit_rate"] == 64 / 100
        for h in holders:
            await h.close()

    run(monkeypatch, body)
