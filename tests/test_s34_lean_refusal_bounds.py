"""Review of 2b05a18 (a lean first step refused ``no_capacity`` is a wait): only that refusal is a wait. A server
refusing other steps so (buggy or hostile) is a failed step within ``--max-failovers``; as a wait it cost nothing
and a request re-opened its chain for ever. In-process: the real ChainHolder, ChainSession and dispatcher over a
fake server client."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchManager
from petals_chain.orchestrator.errors import Unavailable
from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.stats import Stats
from petals_chain.swarm.rpc import NoCapacityError

H = 8
PROMPT = list(range(3, 53))  # 50 tokens: 3 pages of 16 named at open
MAX_FAILOVERS = 3


class Server:
    """Hop ``a`` (a prefix cache holding the prompt's 48 first tokens) and ``b`` (none): ``refuse(opened_named,
    steps_before)`` says whether ``a`` refuses a step no_capacity."""

    def __init__(self, refuse):
        self.refuse = refuse
        self.opens: list[tuple[str, bool]] = []  # (peer, named a prefix)

    async def open_session(self, peer, **kw):
        named = bool(kw.get("prefix_hashes"))
        self.opens.append((peer, named))
        server = self

        class Session:
            cached_tokens = 48 if named and peer == "a" else 0
            prefix_cache = True
            steps = 0

            async def step(self, x, position, **_):
                if peer == "a" and server.refuse(named, self.steps):
                    raise NoCapacityError("no capacity: 8 cache page(s) needed, 0 of 24 available")
                self.steps += 1
                return torch.zeros_like(x)

            async def close(self, **_):
                pass

        return Session()


def make_orch(client):
    async def embed(ids):
        return torch.zeros(1, len(ids), H)

    dm = DispatchManager(policy="jffc")
    dm.set_chains([Chain(servers=("a", "b"), blocks=(2, 2), service_time=1.0, capacity=4, spans=((0, 2), (2, 4)))])
    orch = types.SimpleNamespace(
        dispatch=dm, stats=Stats(), prefix_directory=ChainPrefixes(), chain_sessions=set(), shares=None, planner=None,
        replay_cache=ReplayCache(1 << 20), client=client, observe_hop=None, model_id="m", auditor=None,
        cfg=types.SimpleNamespace(queue_timeout_s=30.0, output_reserve_tokens=0, max_failovers=MAX_FAILOVERS,
                                  relay="orchestrator", open_wait_max_s=1.0, hold_sessions=False, no_chain_wait_s=5.0),
        batcher=types.SimpleNamespace(embed=embed), server_failed=lambda e: None, replacement_servers=lambda s, e: [])
    orch._background = asyncio.ensure_future
    return orch


def run(body):
    # generous: the old code never ended (it re-opened the chain thousands of times a second until this fired)
    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_server_refusing_every_step_no_capacity_fails_the_request_within_the_failover_budget():
    """A hop that answers no_capacity to every step, its sessions opened full too: the request fails 503 after
    ``--max-failovers`` failed steps (before the review it waited for ever: no budget spent, never failed over)."""
    server = Server(lambda named, steps: True)

    async def body():
        orch = make_orch(server)
        holder = ChainHolder(orch, "j", 64)
        with pytest.raises(Unavailable, match="gave up after"):
            await holder.feed(PROMPT)
        assert holder.failovers == MAX_FAILOVERS + 1 and orch.stats.preemptions <= MAX_FAILOVERS + 1
        assert len(server.opens) < 40, len(server.opens)
        await holder.close()
        assert orch.dispatch.running == 0

    run(body)


def test_a_refusal_after_the_first_step_is_a_failed_step_not_a_wait():
    """A lean session served its first step: its pages are all taken, an honest server never refuses a later
    step. One that does is a failed step (the hop moved, the failover counted), not a preemption that re-opens
    and replays the whole sequence at no cost (each decode step, for ever)."""
    refused = []

    def refuse(named, steps):
        if steps == 1 and not refused:
            refused.append(True)
            return True
        return False

    server = Server(refuse)

    async def body():
        orch = make_orch(server)
        orch.replacement_servers = lambda s, e: []
        holder = ChainHolder(orch, "j", 64)
        await holder.feed(PROMPT)
        await holder.feed([7])
        assert refused and holder.preemptions == 0 and holder.failovers == 1, (holder.preemptions, holder.failovers)
        assert orch.stats.replays == {"partial": 1, "full": 0}, orch.stats.replays  # hop a re-opened, replayed
        await holder.close()

    run(body)


def test_a_lean_first_step_refused_is_one_wait_and_later_opens_name_the_prefix_again():
    """The case 2b05a18 fixed, kept: the lean first step refused once is a preemption (no failover), the next open
    names no prefix and is served; a later re-open (a preemption) names the prefix again."""
    server = Server(lambda named, steps: named and steps == 0)

    async def body():
        orch = make_orch(server)
        holder = ChainHolder(orch, "j", 64)
        await holder.feed(PROMPT)
        assert (holder.preemptions, holder.failovers) == (1, 0)
        assert [named for peer, named in server.opens if peer == "a"] == [True, False]
        assert not holder.open_full
        await holder._preempt(Exception("grow refused"))  # a later preemption: its re-open may reuse the prefix
        server.refuse = lambda named, steps: False
        await holder.feed([7])
        assert [named for peer, named in server.opens if peer == "a"] == [True, False, True]
        await holder.close()

    run(body)


def test_a_refusal_whose_full_re_open_never_came_leaves_the_next_turn_its_cached_prefix():
    """A session's turn refused lean, then cancelled (its client gone) while its full re-open waited at the server:
    the next turn names the cached prefix again (it opened naming none: the whole history recomputed)."""
    server = Server(lambda named, steps: named and steps == 0)
    hang = asyncio.Event()

    async def body():
        orch = make_orch(server)
        plain = server.open_session

        async def open_session(peer, **kw):
            if not kw.get("prefix_hashes") and not hang.is_set():
                await hang.wait()  # the full re-open queued at a full server
            return await plain(peer, **kw)

        server.open_session = open_session
        holder = ChainHolder(orch, "s", 64)
        turn = asyncio.ensure_future(holder.feed(PROMPT))
        while len(server.opens) < 2 or holder.preemptions < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        turn.cancel()
        await asyncio.gather(turn, return_exceptions=True)
        hang.set()
        server.refuse = lambda named, steps: False
        del server.opens[:]
        await holder.feed(holder.sync(PROMPT + [7]))  # the next turn
        assert server.opens[0] == ("a", True), server.opens
        await holder.close()

    run(body)
