"""Defects found by hunting in the server role's runner (KV pages, prefix cache), each pinned by a test that failed
before its fix."""

from __future__ import annotations

import pytest
import torch

from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.prefix import prefix_hashes
from petals_chain.swarm.tiny_model import build_tiny_model

PROMPT = list(range(1, 41))  # 40 tokens: 2 full pages of 16 in the prefix cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4, seed=0)


def _embed(ids: list[int]) -> torch.Tensor:
    table = torch.randn(1000, 64, generator=torch.Generator().manual_seed(1))
    return table[torch.tensor(ids)].unsqueeze(0)


@pytest.mark.parametrize("start", [0, 8, 16, 20])
def test_a_session_opened_lean_may_start_before_its_match_on_its_own_pins(model, start):
    """A full pool opens a session on a cached prefix *lean* (own pages only after the match). If the chain's other
    hops matched less, its first step starts earlier and needs own pages there: the matched pages it gives up for
    them make room. The first step at 0 was refused no_capacity (8 pages needed, 4 available) by a server that held
    nothing but this session and its cache, though its open said that it fits."""
    runner = BlockRunner(model, 0, 4, num_slots=5, max_length=64, progress=False, batching=False)  # 20 pages
    ref = BlockRunner(model, 0, 4, num_slots=4, max_length=64, progress=False, batching=False, prefix_cache=False)
    ref.allocate("r", 0, 4)
    want = torch.cat([ref.forward("r", _embed(PROMPT), 0), ref.forward("r", _embed([7]), 40)], dim=1)

    runner.allocate("a", 0, 4)
    runner.forward("a", _embed(PROMPT), 0)
    runner.release("a", prefix_hashes(PROMPT))  # 2 pages per block cached, 12 free
    assert runner.allocate("b", 0, 4, prefix_hashes=prefix_hashes(PROMPT)) == 32
    assert runner.sessions()["b"]["pages"] == 2 * 4  # lean: 8 own pages, 8 matched ones pinned, 4 free
    out = runner.forward("b", _embed(PROMPT[start:]), start)
    got = torch.cat([want[:, :start], out, runner.forward("b", _embed([7]), 40)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    runner.release("b")
    stats = runner.cache_stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_evictable"] == 20


def test_a_lean_first_step_that_does_not_fit_changes_nothing(model):
    """Another session pins the same matched pages, so giving them up frees nothing: refused, and the session is as
    it was (it may still start at its match)."""
    runner = BlockRunner(model, 0, 4, num_slots=8, max_length=64, progress=False, batching=False)  # 32 pages
    runner.allocate("a", 0, 4)
    runner.forward("a", _embed(PROMPT), 0)
    runner.release("a", prefix_hashes(PROMPT))  # 8 cached, 24 free
    runner.allocate("b", 0, 4, prefix_hashes=prefix_hashes(PROMPT))  # 16 own: 8 free
    runner.allocate("c", 0, 4, prefix_hashes=prefix_hashes(PROMPT))  # lean on the same 8 pinned pages
    before = runner.cache_stats()
    with pytest.raises(Exception, match="no capacity"):
        runner.forward("c", _embed(PROMPT), 0)
    assert runner.cache_stats() == before and runner.session_length("c") == 32
    assert runner.forward("c", _embed(PROMPT[32:]), 32).shape == (1, 8, 64)
