"""A server's session service (what the session RPC calls) over a real runner on a tiny model: a queued open is
served as soon as a first step returns pages, a fork holds what its open declared, and refusals carry the code a
client acts on (``no_capacity`` retries elsewhere, ``invalid`` does not)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from petals_chain.server.admission import StrangerShares
from petals_chain.server.runner import BlockRunner
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.prefix import prefix_hashes
from petals_chain.swarm.rpc import RefusedError
from petals_chain.swarm.tiny_model import build_tiny_model

PROMPT = list(range(1, 41))  # 40 tokens: 2 full pages of 16 in the prefix cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4, seed=0)


def _service(model, num_slots: int, max_length: int = 64) -> SessionService:
    svc = SessionService(hidden_size=0, trusted={"peer"}, allow_any_client=False, state=lambda: "online",
                         on_change=lambda: None, describe=lambda: {})
    svc.runner = BlockRunner(model, 0, 4, num_slots=num_slots, max_length=max_length, progress=False,
                             batching=False)
    svc.hidden_size = svc.runner.hidden_size
    return svc


def _embed(svc: SessionService, ids: list[int]) -> torch.Tensor:
    table = torch.randn(1000, svc.hidden_size, generator=torch.Generator().manual_seed(1))
    return table[torch.tensor(ids)].unsqueeze(0)


async def _cache_prompt(svc: SessionService) -> None:
    """Compute PROMPT in a session and leave its full pages in the prefix cache."""
    svc.open_session("a", 0, 4, 64, "peer")
    await svc.forward("a", _embed(svc, PROMPT), 0)
    svc.close_session("a", prefix_hashes(PROMPT))


def test_a_queued_open_is_served_when_a_first_step_returns_pages(model):
    """A session opened on a cached prefix reserves its whole limit until its first step says where it starts;
    that step returns the pages under the shared prefix, and an open queued for them gets them at once (it waited
    for an unrelated close, or its timeout)."""
    async def main():
        svc = _service(model, num_slots=8)  # 32 pages
        await _cache_prompt(svc)
        svc.open_session("b", 0, 4, 64, "peer", prefix_hashes=prefix_hashes(PROMPT))  # 16 own + 8 pinned
        waiting = asyncio.ensure_future(svc.open_session_wait("c", 0, 4, 64, "peer", wait_s=30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # 8 pages free, 16 needed
        t0 = time.monotonic()
        await svc.forward("b", _embed(svc, PROMPT[32:]), 32)  # b's 8 own pages under the match go back
        await asyncio.wait_for(waiting, 5.0)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 2.0


def test_a_fork_holds_the_length_its_open_declared(model):
    async def main():
        svc = _service(model, num_slots=16, max_length=128)
        svc.open_session("src", 0, 4, 32, "peer")
        await svc.forward("src", torch.randn(1, 20, svc.hidden_size), 0)
        runner = svc.runner
        before = runner.pool.pages_available
        svc.open_session("long", 0, 4, 96, "peer", fork_from="src", fork_length=20)  # more than the source's 32
        assert before - runner.pool.pages_available == 6 * 4  # 96 tokens: 6 pages of 16 per block
        out = await svc.forward("long", torch.randn(1, 30, svc.hidden_size), 20)  # past the source's limit
        assert out.shape[1] == 30
        before = runner.pool.pages_available
        svc.open_session("short", 0, 4, 24, "peer", fork_from="src", fork_length=20)
        assert before - runner.pool.pages_available == 2 * 4
        with pytest.raises(RefusedError) as info:
            svc.open_session("shorter", 0, 4, 16, "peer", fork_from="src", fork_length=20)
        assert info.value.code == "invalid"

    asyncio.run(main())


def test_refusals_carry_the_code_a_client_acts_on(model):
    async def main():
        svc = _service(model, num_slots=8)
        await _cache_prompt(svc)
        svc.open_session("hold", 0, 4, 64, "peer")
        # lean: own pages only after the match; a first step before it needs pages the pool does not have (giving up
        # the matched pages frees none: b2 pins them too)
        svc.open_session("b", 0, 4, 48, "peer", prefix_hashes=prefix_hashes(PROMPT))
        svc.open_session("b2", 0, 4, 48, "peer", prefix_hashes=prefix_hashes(PROMPT))
        with pytest.raises(RefusedError) as info:
            await svc.forward("b", _embed(svc, PROMPT), 0)
        assert info.value.code == "no_capacity"
        svc.close_session("hold")
        out = await svc.forward("b", _embed(svc, PROMPT), 0)  # nothing changed by the refusal
        assert out.shape[1] == len(PROMPT)
        with pytest.raises(RefusedError) as info:  # a span the server does not hold is not a capacity problem
            await svc.open_session_wait("far", 0, 1 << 40, 64, "peer", wait_s=1.0)
        assert info.value.code == "invalid"

    asyncio.run(main())


def test_a_session_released_by_a_drain_hears_unavailable_not_unknown(model):
    """A drain's timeout releases the sessions still open; their next step or extension is ``unavailable`` (the
    server went away under them, so their client fails over), where an id never opened stays ``invalid``."""
    async def main():
        svc = _service(model, num_slots=8)
        svc.open_session("s", 0, 4, 64, "peer")
        await svc.forward("s", _embed(svc, PROMPT[:4]), 0)
        await svc.drain(0.05, forced=lambda: False)
        assert not svc.sessions and svc.runner.pool.pages_available == svc.runner.pool.num_pages
        with pytest.raises(RefusedError) as info:
            await svc.forward("s", _embed(svc, PROMPT[4:5]), 4)
        assert info.value.code == "unavailable" and "drain" in str(info.value)
        with pytest.raises(RefusedError) as info:
            svc.extend_session("s", 64)
        assert info.value.code == "unavailable"
        with pytest.raises(RefusedError) as info:
            await svc.forward("never", _embed(svc, PROMPT[:1]), 0)
        assert info.value.code == "invalid"

    asyncio.run(main())


def test_only_a_trusted_peers_close_puts_pages_in_the_prefix_cache(model):
    """With ``--allow-any-client`` a stranger may run sessions, but its close's word for which tokens its pages hold
    is not taken: a session of garbage closed under a popular prompt's hashes was reused by trusted sessions
    (their outputs off by 38 against 1e-5); and its open does not match cached pages."""
    async def main():
        svc = _service(model, num_slots=8)
        svc.allow_any_client = True
        svc.stranger_shares = StrangerShares(per_stranger=1.0, strangers=1.0)  # mallory's 16 of 32 pages
        svc.open_session("m", 0, 4, 64, "mallory")
        await svc.forward("m", torch.randn(1, len(PROMPT), svc.hidden_size) * 50, 0)
        svc.close_session("m", prefix_hashes(PROMPT))
        reply = svc.open_session("v", 0, 4, 64, "peer", prefix_hashes=prefix_hashes(PROMPT))
        assert reply["cached_tokens"] == 0
        svc.close_session("v")
        await _cache_prompt(svc)  # the trusted orchestrator's own close still caches
        reply = svc.open_session("w", 0, 4, 64, "peer", prefix_hashes=prefix_hashes(PROMPT))
        assert reply["cached_tokens"] == 32
        svc.close_session("w")
        # nor does a stranger match the trusted orchestrator's cached pages: cached_tokens (and the time saved) told
        # it which prompts others had sent, and it read their K/V
        reply = svc.open_session("m2", 0, 4, 64, "mallory", prefix_hashes=prefix_hashes(PROMPT))
        assert reply["cached_tokens"] == 0

    asyncio.run(main())
