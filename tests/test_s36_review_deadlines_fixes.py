"""Review of 27ec79b (deadlines and fairness leftovers), session 36.

* ``ChainHolder.ran`` was reset only where a session's turn gave its chain back: a turn that lost its chain and failed
  left it set, and the next turn (a new request, never run) dropped at its deadline in the queue was counted
  ``missed`` with the message of a job that lost its chain.
* The central ``lpm`` admission bound read every queued job's match on every chain (O(queue x chains), 83 ms an
  admission with 1,000 queued jobs on 50 chains): now each queued job's matches once.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairDispatcher, FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import DEADLINE, DeadlineBook, RequestDeadline
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.fairness import ClientShares
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.stats import Stats

CHAIN = Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))


def test_a_session_turn_after_one_that_lost_its_chain_is_dropped_not_missed_at_its_deadline():
    """sessions.py starts a turn with ``admitted = cs is not None``; the turn before ran and lost its chain
    (``ran`` stayed set). This turn waits behind a busy chain until its deadline: dropped, never ran (was: missed,
    "its chain was lost or given back")."""
    async def main():
        shares = ClientShares(FairPolicy("fcfs"), registry=CollectorRegistry(), keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares)
        dm.set_chains([CHAIN])
        orch = types.SimpleNamespace(
            dispatch=dm, stats=Stats(), prefix_directory=ChainPrefixes(), chain_sessions=set(), shares=shares,
            planner=None, replay_cache=ReplayCache(1 << 20), client=None, observe_hop=None, model_id="m",
            auditor=None, deadlines=DeadlineBook(),
            cfg=types.SimpleNamespace(queue_timeout_s=30.0, output_reserve_tokens=0, max_failovers=3,
                                      relay="orchestrator", open_wait_max_s=1.0, hold_sessions=False,
                                      no_chain_wait_s=5.0))
        busy = await dm.acquire(DispatchJob("other", client="x"))  # the only slot stays taken
        holder = ChainHolder(orch, "s", 4)
        holder.client = "c"
        holder.ran, holder.admitted = True, False  # the last turn ran, lost its chain and failed
        dl = RequestDeadline.from_ms("c", 500, None)
        DEADLINE.set(dl)
        with pytest.raises(RequestError) as err:
            await holder._ensure_chain([1, 2, 3], 3)
        assert (err.value.status, err.value.code) == (504, "deadline_exceeded")
        assert "lost" not in str(err.value), err.value  # was: "... (its chain was lost or given back)"
        counts = orch.deadlines.json()["clients"]["c"]
        assert (dl.outcome, counts["dropped"], counts["missed"]) == ("dropped", 1, 0), counts  # was: missed
        assert not holder.ran
        dm.release(busy)

    asyncio.run(asyncio.wait_for(main(), 20))


class Counted(Mapping):
    """A job's cached-prefix map that counts its reads (each a prefix-directory match for a live one)."""

    reads = 0

    def __init__(self, data: dict):
        self._data = data

    def __getitem__(self, key):
        Counted.reads += 1
        return self._data[key]

    def get(self, key, default=None):
        Counted.reads += 1
        return self._data.get(key, default)

    def items(self):
        Counted.reads += 1
        return self._data.items()

    def __iter__(self):
        Counted.reads += 1
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_the_lpm_bound_reads_each_queued_jobs_matches_once_not_once_per_chain():
    """1,000 queued jobs on 50 busy chains, each queued job holding a prefix somewhere: the bound reads each one's
    map a bounded number of times (was: once per chain, ~51,000 reads), and counts what LPM puts ahead: the 10 jobs
    holding at least the new job's 16 tokens on its chain, in turns of all chains."""
    shares = ClientShares(FairPolicy("lpm", FairnessConfig()), registry=CollectorRegistry(), keyed=True)
    chains = 50
    d = FairDispatcher([(1.0, 1)] * chains, shares.policy, shares.describe)
    for k in range(chains):
        d.arrive(DispatchJob(f"r{k}", client="a", input_tokens=8))
    for i in range(1000):
        held = {0: 16} if i % 100 == 0 else {1 + i % (chains - 1): 16, 0: 8}
        d.arrive(DispatchJob(f"q{i}", client="a", input_tokens=20, matched=Counted(held)))
    job = DispatchJob("new", client="b", input_tokens=20, matched={0: 16})
    Counted.reads = 0
    ahead = shares.ahead_bound(job, d, [1.0] * chains)
    assert Counted.reads <= 3 * 1000, Counted.reads  # was: 51,000
    assert ahead == (10 + 1) * chains - 1  # its chain's 10 turns before it, in jobs of all 50 chains


def test_a_chain_back_after_a_short_ban_keeps_its_prefixes_and_one_gone_for_good_is_pruned():
    """The re-plan hook pruned the directory of every chain left out at once: a server failed, was banned for its
    5 s (--ban-base-s), and its chain came back as it was with its prompts forgotten (the next request with the same
    system prompt computed it all again, cached_tokens 0, though the server still held it). Now a chain left out
    keeps its entries for ``keep_s``; past that, the next re-plan drops them."""
    from petals_chain.orchestrator.core import Orchestrator
    from petals_chain.orchestrator.dispatch import chain_key
    from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, prefix_hashes

    a = Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))
    b = Chain(servers=("b",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))
    now = [0.0]
    prefixes = ChainPrefixes(keep_s=60.0, clock=lambda: now[0])
    orch = types.SimpleNamespace(dispatch=DispatchManager(policy="jffc"), prefix_directory=prefixes)
    named = prefix_hashes(list(range(2 * PREFIX_BLOCK_TOKENS + 1)), b"")
    Orchestrator._on_chains(orch, [a, b])
    prefixes.add(a, named)
    Orchestrator._on_chains(orch, [b])  # a's server failed: banned for 5 s
    now[0] = 5.0
    Orchestrator._on_chains(orch, [a, b])  # back as it was
    assert prefixes.matched_tokens(named) == {chain_key(a): 2 * PREFIX_BLOCK_TOKENS}  # was: {} (forgotten)
    now[0] = 10.0
    Orchestrator._on_chains(orch, [b])  # gone again, for good this time
    now[0] = 69.0
    Orchestrator._on_chains(orch, [b])
    assert prefixes.matched_tokens(named) == {chain_key(a): 2 * PREFIX_BLOCK_TOKENS}  # 59 s out: kept
    now[0] = 71.0
    Orchestrator._on_chains(orch, [b])
    assert prefixes.matched_tokens(named) == {} and len(prefixes.directory) == 0  # 61 s out: pruned
    with pytest.raises(ValueError):
        ChainPrefixes(keep_s=-1.0)
