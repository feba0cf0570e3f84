"""Follow-ups of the session 35 reviews (failover): a hop moved to another server after a failure
(``ChainSession.replace``) now says again whether every hop keeps prefixes (a session's chain moved onto a
``--no-prefix-cache`` server was still released between turns and entered in the prefix directory), and the prefix
directory names the servers the session ended on, not the planned chain whose failed server holds nothing.
In-process: the real ChainHolder, ChainSession and dispatcher over a fake server client."""

from __future__ import annotations

import torch
from test_s34_lean_refusal_bounds import PROMPT, make_orch, run

from petals_chain.model import Chain
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, prefix_hashes, split_hashes

AB = Chain(servers=("a", "b"), blocks=(2, 2), service_time=0.5, capacity=4, spans=((0, 2), (2, 4)))
AE = Chain(servers=("a", "e"), blocks=(2, 2), service_time=1.0, capacity=4, spans=((0, 2), (2, 4)))
NAMED = prefix_hashes(PROMPT[:-1])  # what a job with the prompt looks up


class Servers:
    """Servers ``a``, ``b`` and ``e`` (``caches[peer]``: it keeps closed sessions' pages as cached prefixes). ``b``
    dies at the second step of its first session; a session closed naming prefix hashes leaves them cached on a
    server with a prefix cache, and an open naming some is told how many leading tokens that server holds."""

    def __init__(self, caches: dict[str, bool]):
        self.caches = caches
        self.held: dict[str, list[bytes]] = {p: [] for p in caches}
        self.opens: list[str] = []
        self.b_sessions = 0

    async def open_session(self, peer, **kw):
        servers, has = self, self.caches[peer]
        self.opens.append(peer)
        named = split_hashes(kw.get("prefix_hashes") or b"")
        match = 0
        while has and match < len(named) and match < len(self.held[peer]) and named[match] == self.held[peer][match]:
            match += 1
        dies = peer == "b" and self.b_sessions == 0
        self.b_sessions += peer == "b"

        class Session:
            cached_tokens = match * PREFIX_BLOCK_TOKENS
            prefix_cache = has
            steps = 0

            async def step(self, x, position, **_):
                if dies and self.steps == 1:
                    raise ConnectionError("b died")
                self.steps += 1
                return torch.zeros_like(x)

            async def close(self, prefix_hashes=b"", **_):
                if has and prefix_hashes:
                    servers.held[peer] = split_hashes(prefix_hashes)

        return Session()


def orch_of(servers: Servers, chains: list[Chain]):
    orch = make_orch(servers)
    orch.dispatch.set_chains(chains)
    orch.replacement_servers = lambda start, end: ["e"]
    return orch


def test_a_session_moved_onto_a_server_without_prefix_cache_keeps_its_chain_between_turns():
    """A session's chain (a, b), both caching prefixes; b dies in the second turn and its span moves to e, which
    has no prefix cache. Before, the chain still counted as keeping prefixes: it was released between turns (e keeps
    nothing: the next turn recomputed the whole history), offered as cheap to pause, and entered in the prefix
    directory. Now it is held (the next turn opens nothing), and nobody is pointed at it."""
    servers = Servers({"a": True, "b": True, "e": False})

    async def body():
        orch = orch_of(servers, [AB])
        job = ChainHolder(orch, "s1", 64)
        await job.feed(PROMPT)
        assert job.cs.prefix_cache and job.lease.keeps_kv
        await job.feed([7])  # b dies: its span moves to e
        assert job.chain_names == ["a", "e"] and job.failovers == 1
        assert not job.cs.prefix_cache and not job.lease.keeps_kv
        assert await job.release_chain() is False  # held between turns, as any chain with a no-cache hop
        opens = len(servers.opens)
        await job.feed([8])  # the next turn: on the held chain, nothing recomputed
        assert len(servers.opens) == opens and job.reused_tokens == len(PROMPT) + 1
        await job.close()
        assert orch.prefix_directory.preferred(NAMED) == ()

    run(body)


def test_a_moved_hop_back_on_a_caching_server_makes_the_chain_a_caching_one_again():
    """The span of a no-cache hop moved to a server with a prefix cache: every hop keeps prefixes now."""
    servers = Servers({"a": True, "b": False, "e": True})

    async def body():
        orch = orch_of(servers, [AB])
        job = ChainHolder(orch, "s1", 64)
        await job.feed(PROMPT)
        assert not job.cs.prefix_cache
        await job.feed([7])
        assert job.chain_names == ["a", "e"] and job.cs.prefix_cache and job.lease.keeps_kv
        assert await job.release_chain() is True
        await job.close()

    run(body)


def test_the_prefix_directory_names_the_servers_a_session_ended_on():
    """A job planned on (a, b) ends on (a, e) after b died: a and e hold its prompt, b nothing. Before, (a, b) was
    entered in the prefix directory: the next job with the prompt was steered there and computed all of it
    (0 tokens cached). Now the planned chain of the hops the session ended on, (a, e), is entered: the next job
    starts there and reuses 48 tokens. With no planned chain of those hops, nothing is entered."""
    servers = Servers({"a": True, "b": True, "e": True})

    async def body():
        orch = orch_of(servers, [AB, AE])  # AB is faster: the dispatcher's own pick for a job naming no chain
        first = ChainHolder(orch, "j1", 64)
        await first.feed(PROMPT)
        await first.feed([7])
        assert first.chain_names == ["a", "e"]
        await first.close()
        assert orch.prefix_directory.preferred(NAMED) == (((("a", "e"), ((0, 2), (2, 4)))),)
        second = ChainHolder(orch, "j2", 64)
        await second.feed(PROMPT)
        assert (second.chain_names, second.cached_tokens) == (["a", "e"], 48)
        await second.close()

        lone = orch_of(Servers({"a": True, "b": True, "e": True}), [AB])  # (a, e) is no planned chain
        job = ChainHolder(lone, "j3", 64)
        await job.feed(PROMPT)
        await job.feed([7])
        assert job.chain_names == ["a", "e"]
        await job.close()
        assert lone.prefix_directory.preferred(NAMED) == ()

    run(body)
