"""The prefix directory forgets the chains a re-plan removed (session 36): their entries left only by the LRU cap
(65,536 entries), kept memory and were matched at every lookup, and a job still running on a removed chain entered
it again at its close."""

from __future__ import annotations

import asyncio
import types

from petals_chain.algorithms.prefix_locality import PrefixDirectory
from petals_chain.model import Chain
from petals_chain.orchestrator.core import Orchestrator
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager, chain_key
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, prefix_hashes

A = Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))
B = Chain(servers=("b",), blocks=(2,), service_time=0.1, capacity=1, spans=((0, 2),))


def test_retain_drops_the_entries_of_workers_not_kept_and_nothing_else():
    d = PrefixDirectory()
    d.add("w1", ["k0", "k1", "k2"])
    d.add("w2", ["k0", "k1"])
    d.add("w3", ["x0"])
    version = d.version
    assert d.retain(["w2", "w9"]) == 4  # w1's three, w3's one
    assert len(d) == 2 and d.version > version  # live views (LiveMatch) re-match
    assert d.match(["k0", "k1", "k2"]) == {"w2": 2}
    assert d.match(["x0"]) == {}
    assert d.retain(["w2"]) == 0 and d.version == version + 1  # nothing gone: nothing changes
    assert d.retain([]) == 2 and len(d) == 0 and d.match(["k0"]) == {}
    d.add("w1", ["k0"])  # the index stayed consistent: a worker comes back cleanly
    assert d.match(["k0"]) == {"w1": 1}


def _named(tokens: int) -> bytes:
    return prefix_hashes(list(range(tokens)), b"")


def test_a_replan_prunes_the_directory_of_the_chains_it_removed():
    """The orchestrator's re-plan hook: chain A re-planned away; its 2 entries are gone, B's stay (before: A's stayed,
    the directory still named A for the prompt). ``keep_s=0``: no grace for a chain that may come back
    (test_s36_review_deadlines_fixes)."""
    prefixes = ChainPrefixes(keep_s=0.0)
    dm = DispatchManager(policy="jffc")
    orch = types.SimpleNamespace(dispatch=dm, prefix_directory=prefixes)
    Orchestrator._on_chains(orch, [A, B])
    prefixes.add(A, _named(2 * PREFIX_BLOCK_TOKENS + 1))
    prefixes.add(B, _named(PREFIX_BLOCK_TOKENS + 1))
    assert len(prefixes.directory) == 3
    Orchestrator._on_chains(orch, [B])
    assert prefixes.matched_tokens(_named(2 * PREFIX_BLOCK_TOKENS + 1)) == {chain_key(B): PREFIX_BLOCK_TOKENS}
    assert len(prefixes.directory) == 1


def test_a_job_closing_on_a_chain_the_plan_removed_does_not_enter_it_again():
    async def main():
        dm = DispatchManager(policy="jffc")
        dm.set_chains([A, B])
        orch = types.SimpleNamespace(dispatch=dm, prefix_directory=ChainPrefixes(), model_id="m", shares=None,
                                     replay_cache=ReplayCache(1 << 20), cfg=types.SimpleNamespace(
                                         output_reserve_tokens=0))
        lease = await dm.acquire(DispatchJob("j", client="c"))
        holder = ChainHolder(orch, "j", 64)
        session = types.SimpleNamespace(hops=lease.hops)
        assert holder._holding_chain(session, lease) is lease.chain  # planned: entered
        dm.set_chains([ch for ch in (A, B) if chain_key(ch) != chain_key(lease.chain)])
        assert holder._holding_chain(session, lease) is None  # was: the removed chain
        dm.release(lease)

    asyncio.run(main())
