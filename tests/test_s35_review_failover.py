"""Review of abbc50d (no prefix named to a chain with a hop that has no prefix cache): a job closing on such a chain
still entered it in the prefix directory, so later jobs with that prompt started on it (a chain that can never
reuse the prompt) instead of where the dispatcher would put them. In-process: the real ChainHolder, ChainSession
and dispatcher over a fake server client (test_s35_failover_lean's)."""

from __future__ import annotations

import pytest
from test_s34_lean_refusal_bounds import PROMPT, make_orch, run
from test_s35_failover_lean import Server, with_records

from petals_chain.model import Chain
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.swarm.prefix import prefix_hashes

SLOW = Chain(servers=("a", "b"), blocks=(2, 2), service_time=1.0, capacity=4, spans=((0, 2), (2, 4)))
FAST = Chain(servers=("c", "d"), blocks=(2, 2), service_time=0.5, capacity=4, spans=((0, 2), (2, 4)))


@pytest.mark.parametrize("b_caches", [False, True])
def test_a_chain_entered_in_the_prefix_directory_only_if_every_hop_caches(b_caches):
    """A job served on (a, b) closes; the next job with the prompt may also run on (c, d), the dispatcher's pick.
    ``b`` without a prefix cache: (a, b) was entered in the directory, so the next job started there (its preferred
    chain) and computed all 50 tokens again; now it is not, and the job runs on (c, d), reusing their 48 cached
    tokens. ``b`` with one: (a, b) is entered and preferred as before (it holds the prompt)."""
    cached = {"a": 48, "b": 48 if b_caches else None, "c": 48, "d": 48}
    server = Server(cached)

    async def body():
        orch = with_records(make_orch(server), cached)
        orch.dispatch.set_chains([SLOW])
        first = ChainHolder(orch, "j1", 64)
        await first.feed(PROMPT)
        await first.feed([7])
        await first.close()
        preferred = orch.prefix_directory.preferred(prefix_hashes(PROMPT[:-1]))
        assert preferred == (((("a", "b"), ((0, 2), (2, 4))),) if b_caches else ()), preferred

        orch.dispatch.set_chains([FAST, SLOW])
        second = ChainHolder(orch, "j2", 64)
        await second.feed(PROMPT)
        assert (second.chain_names, second.cached_tokens) == ((["a", "b"], 48) if b_caches else (["c", "d"], 48))
        assert orch.dispatch.preferred_starts == (1 if b_caches else 0)
        await second.close()

    run(body)
