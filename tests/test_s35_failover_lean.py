"""Lean sessions at the orchestrator (session 35): no prefix is named to a chain with a hop that announces no prefix
cache (its server opened lean and refused the first step: a preemption and a second open for every request), and a
prefix lookup counts once per served chain (a lean refusal's full re-open counted the prompt again with 0 hits, and
the refused open's hits though they were recomputed). In-process: the real ChainHolder, ChainSession and dispatcher
over a fake server client (test_s34_lean_refusal_bounds' orchestrator)."""

from __future__ import annotations

import types

import pytest
import torch
from test_s34_lean_refusal_bounds import PROMPT, make_orch, run

from petals_chain.orchestrator.failover import ChainHolder
from petals_chain.swarm.rpc import NoCapacityError


class Server:
    """Hops ``a`` and ``b``; ``cached[peer]``: the prompt's leading tokens that server's prefix cache holds (None:
    it has no prefix cache). ``a`` opens lean when named a prefix: it refuses the first step no_capacity when that
    starts before its match (the pages under the match are not its own)."""

    def __init__(self, cached: dict[str, int | None]):
        self.cached = cached
        self.opens: list[tuple[str, bool]] = []  # (peer, named a prefix)

    async def open_session(self, peer, **kw):
        named = bool(kw.get("prefix_hashes"))
        self.opens.append((peer, named))
        has_cache = self.cached[peer] is not None
        match = self.cached[peer] if named and has_cache else 0

        class Session:
            cached_tokens = match
            prefix_cache = has_cache
            steps = 0

            async def step(self, x, position, **_):
                if peer == "a" and match and self.steps == 0 and position < match:
                    raise NoCapacityError("no capacity: 6 cache page(s) needed, 0 of 24 available")
                self.steps += 1
                return torch.zeros_like(x)

            async def close(self, **_):
                pass

        return Session()


def with_records(orch, cached: dict[str, int | None]):
    """The planner's records of ``a`` and ``b``: ``prefix_cache`` as their servers announce it."""
    orch.planner = types.SimpleNamespace(
        servers={p: types.SimpleNamespace(record=types.SimpleNamespace(prefix_cache=c is not None))
                 for p, c in cached.items()},
        observe_job_tokens=lambda n: None)
    return orch


def lookups(orch) -> tuple[int, int]:
    p = orch.stats.prefix_json()
    return p["prefix_lookup_tokens"], p["prompt_cached_tokens"]


def test_no_prefix_is_named_to_a_chain_whose_other_hop_has_no_prefix_cache():
    """``b`` announces no prefix cache: the chain starts at 0 whatever ``a`` holds. Named the prompt, ``a`` (full)
    opened lean on its 48 cached tokens and refused the first step: a preemption and a second open for every
    request. Now the open names nothing: one open, served, 0 hits as before (nothing was reused then either)."""
    cached = {"a": 48, "b": None}
    server = Server(cached)

    async def body():
        orch = with_records(make_orch(server), cached)
        holder = ChainHolder(orch, "j", 64)
        await holder.feed(PROMPT)
        assert server.opens == [("a", False), ("b", False)], server.opens
        assert (holder.preemptions, holder.failovers, holder.cached_tokens) == (0, 0, 0)
        assert lookups(orch) == (50, 0)
        await holder.close()

    run(body)


@pytest.mark.parametrize("records", [True, False])
def test_a_chain_whose_hops_all_have_a_prefix_cache_is_still_named_its_prompt(records):
    """Every hop announces a prefix cache (or the planner has no record of them): the prompt is named and the chain
    starts after the prefix both hold (32 tokens), counted as 32 hits of a 50-token lookup."""
    cached = {"a": 32, "b": 32}
    server = Server(cached)

    async def body():
        orch = make_orch(server)
        if records:
            with_records(orch, cached)
        holder = ChainHolder(orch, "j", 64)
        await holder.feed(PROMPT)
        assert server.opens == [("a", True), ("b", True)], server.opens
        assert (holder.preemptions, holder.cached_tokens, holder.reused_tokens) == (0, 32, 32)
        assert lookups(orch) == (50, 32)
        await holder.close()

    run(body)


def test_a_lean_refusal_and_its_full_re_open_count_one_lookup_and_no_hit():
    """``a`` matched 48 tokens, ``b`` 32: the chain's first step starts at 32, before ``a``'s match, and ``a`` (lean)
    refuses it; the job re-opens naming nothing and computes all 50 tokens. /metrics counted 100 tokens looked up
    and 32 cached (a hit rate of 0.32 for a request served none): now 50 and 0."""
    cached = {"a": 48, "b": 32}
    server = Server(cached)

    async def body():
        orch = with_records(make_orch(server), cached)
        holder = ChainHolder(orch, "j", 64)
        await holder.feed(PROMPT)
        assert (holder.preemptions, holder.failovers) == (1, 0)
        assert server.opens == [("a", True), ("b", True), ("a", False), ("b", False)], server.opens
        assert lookups(orch) == (50, 0)
        assert orch.stats.prefix_json()["prompt_cache_hit_rate"] == 0
        await holder.feed([7])  # a decode step on the same chain: no open, no lookup
        assert lookups(orch) == (50, 0)
        await holder.close()

    run(body)
