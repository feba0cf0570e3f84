"""Prefix cache of a server's paged KV pool: pages named by prefix hashes outlive their session, and a later
session with the same prompt prefix reuses them instead of computing them, with the same outputs."""

from __future__ import annotations

import pytest
import torch

from petals_chain.server.kv_cache import PagePool
from petals_chain.server.runner import BlockRunner, NoCapacityError
from petals_chain.swarm.prefix import page_hashes, prefix_hashes, split_hashes
from petals_chain.swarm.tiny_model import build_tiny_model

HIDDEN_SEED = 11


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=4, seed=0)


def _runner(model, num_slots=16, max_length=128, **kw) -> BlockRunner:
    return BlockRunner(model, 0, 4, num_slots=num_slots, max_length=max_length, progress=False, **kw)


def _embed(r: BlockRunner, ids: list[int]) -> torch.Tensor:
    """A fixed hidden state per token id (what the orchestrator's embedding would give)."""
    table = torch.randn(1000, r.hidden_size, generator=torch.Generator().manual_seed(HIDDEN_SEED))
    return table[torch.tensor(ids)].unsqueeze(0)


def _hashes(ids: list[int]) -> list[bytes]:
    return split_hashes(prefix_hashes(ids))


def _fresh(r: BlockRunner, ids: list[int]) -> torch.Tensor:
    r.allocate("fresh", 0, 4, max_tokens=len(ids))
    try:
        return r.forward("fresh", _embed(r, ids), 0)
    finally:
        r.release("fresh")


def test_hash_chain_names_every_prefix():
    a = list(range(40))
    b = list(range(20)) + [999] * 20
    ha, hb = _hashes(a), _hashes(b)
    assert len(ha) == 2 and len(prefix_hashes(a[:15])) == 0
    assert ha[0] == hb[0] and ha[1] != hb[1]  # block 1 (tokens 16-31) differs from token 20 on
    assert _hashes(list(range(32)))[1] == ha[1]  # a hash covers everything up to its block's end
    assert page_hashes(ha, 32) == [ha[1]] and page_hashes(ha, 16) == ha and page_hashes(ha, 24) == []
    with pytest.raises(ValueError):
        split_hashes(b"x" * 17)


def test_second_session_reuses_the_first_ones_pages(model):
    r = _runner(model)
    prompt = list(range(1, 41))  # 40 tokens: 2 full pages of 16
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    assert r.release("a", prefix_hashes(prompt))
    stats = r.cache_stats()
    assert stats["pages_cached"] == 2 * 4 and stats["pages_evictable"] == 8 and stats["pages_used"] == 0
    # cached pages count as available: nothing is lost to the cache
    assert r.cache_tokens_free == r.cache_tokens_total

    stranger = [7] + prompt[1:]  # one token differs, in the first page: nothing is shared
    assert r.allocate("s", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(stranger)) == 0
    r.release("s")
    other = prompt[:35] + [500, 501, 502, 503, 504, 505]  # shares 35 tokens: 2 pages (32 tokens)
    # the hashes as a list (what the RPC hands over) or as prefix_hashes' blob name the same pages
    matched = r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=_hashes(other[:-1]))
    assert matched == 32 and r.session_length("b") == 32
    out = r.forward("b", _embed(r, other[32:]), 32)
    ref = _fresh(r, other)
    torch.testing.assert_close(out, ref[:, 32:], rtol=0, atol=1e-4)
    # the shared pages are pinned, not evictable, while b holds them; b's own pages under them went back
    assert r.cache_stats()["pages_evictable"] == 0
    assert r.sessions()["b"]["shared_pages"] == 2 * 4
    assert r.cache_stats()["prefix_reused_tokens"] == 32
    # decode continues on top of the shared pages
    step = r.forward("b", _embed(r, [7]), len(other))
    torch.testing.assert_close(step, _fresh(r, other + [7])[:, -1:], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="shared cached prefix"):
        r.forward("b", _embed(r, [3]), 20)
    r.release("b")
    assert r.cache_stats()["pages_used"] == 0 and r.cache_stats()["pages_cached"] == 8


def test_first_step_before_the_match_copies_the_straddled_page(model):
    """Another hop of the chain matched less: this hop's first step starts inside its matched pages."""
    r = _runner(model)
    prompt = list(range(100, 150))  # 50 tokens: 3 full pages
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    r.release("a", prefix_hashes(prompt))
    assert r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 48
    out = r.forward("b", _embed(r, prompt[20:]), 20)  # starts in page 1, at offset 4
    torch.testing.assert_close(out, _fresh(r, prompt)[:, 20:], rtol=0, atol=1e-4)
    assert r.sessions()["b"]["shared_pages"] == 1 * 4
    r.release("b")
    stats = r.cache_stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]


def test_unused_match_is_unpinned_and_pool_is_whole_again(model):
    r = _runner(model)
    prompt = list(range(200, 233))
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    r.release("a", prefix_hashes(prompt))
    assert r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 32
    assert r.cache_stats()["pages_evictable"] == 0
    r.release("b")  # closed before any step
    assert r.cache_stats()["pages_evictable"] == 8 and r.cache_tokens_free == r.cache_tokens_total


def test_cached_pages_are_evicted_deepest_first_when_memory_is_needed(model):
    r = _runner(model, num_slots=8, max_length=64)  # 8 block-slots of 4 pages: 32 pages of 16 tokens
    prompt = list(range(300, 348))  # 3 pages per block
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    r.release("a", prefix_hashes(prompt))
    assert r.cache_stats()["pages_cached"] == 12
    # 12 cached, 20 free: a session of 64 tokens (4 pages per block) fits in the free pages, a second one evicts
    r.allocate("x", 0, 4, max_tokens=64)
    assert r.cache_stats()["prefix_evictions"] == 0
    r.allocate("y", 0, 4, max_tokens=64)
    assert r.cache_stats()["prefix_evictions"] == 12 and r.cache_stats()["pages_cached"] == 0
    with pytest.raises(NoCapacityError):
        r.allocate("z", 0, 4, max_tokens=16)
    r.release("x")
    r.release("y")
    # eviction order: the deepest page of a prefix goes first, so a partial prefix keeps its start
    pool = PagePool(6, 1, 16, 4, torch.float32)
    pool.reserve(3)
    pages = pool.take(3)
    for j in (2, 1, 0):
        assert pool.cache(0, bytes([j]) * 16, pages[j])
    pool.reserve(4)
    pool.take(4)  # 3 free + 1 eviction: the deepest page
    assert pool.match([0], [bytes([j]) * 16 for j in range(3)]) == 2


def test_evictions_take_a_prefixs_depth_away_in_every_layer_alike(model):
    """A match needs the page in every layer of the span: evictions go deepest position first across all layers
    (layer by layer, three evictions took layer 0's whole prefix and the other nine cached pages matched nothing),
    both for pages cached at close and for matched pages a first step unpins."""
    for first_step in (True, False):
        r = _runner(model, num_slots=8, max_length=64)  # 32 pages
        prompt = list(range(300, 348))  # 3 pages per block
        r.allocate("a", 0, 4, max_tokens=48)
        r.forward("a", _embed(r, prompt), 0)
        r.release("a", prefix_hashes(prompt))
        if first_step:  # pinned by a match, then unpinned by a first step at 0 (it computes everything itself)
            r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt))
            r.forward("b", _embed(r, prompt[:1]), 0)
        r.pool.reserve(r.pool.pages_free)
        r.pool.take(r.pool.pages_free)  # every free page, as other sessions would
        r.allocate("c", 0, 1, max_tokens=48)  # 3 pages: three evictions
        assert r.pool.match(range(4), _hashes(prompt)) == 2, first_step


def test_tight_pool_reuses_with_a_lean_reservation(model):
    """A pool too full for a copy of the whole limit in own pages still reuses the matched prefix (own pages only
    after it); a first step before the match then takes the pages it needs, or is refused with nothing changed."""
    r = _runner(model, num_slots=8, max_length=64)  # 32 pages
    prompt = list(range(400, 440))  # 2 full pages per block
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    r.release("a", prefix_hashes(prompt))
    r.allocate("hold", 0, 4, max_tokens=64)  # 16 pages: 8 free and the 8 cached are left
    # a full reservation (16 own pages) would evict the very prefix the session matched: it takes 8 and reuses
    assert r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 32
    assert r.sessions()["b"]["pages"] == 8
    out = r.forward("b", _embed(r, prompt[32:]), 32)
    torch.testing.assert_close(out, _fresh(_runner(model), prompt)[:, 32:], rtol=0, atol=1e-4)
    r.release("b", prefix_hashes(prompt))

    # another hop matched less: the first step starts at 20, inside the match, and needs a page of its own there;
    # the matched page it gives up (pinned by it alone) makes room (tests/test_hunt_server_runner.py: a refusal)
    assert r.allocate("c", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 32
    assert r.cache_stats()["pages_free"] == 0  # hold, c's 8 own pages and the 8 pinned shared ones
    out = r.forward("c", _embed(r, prompt[20:]), 20)
    r.release("hold")
    assert r.sessions()["c"]["shared_pages"] == 1 * 4
    r.release("c")
    torch.testing.assert_close(out, _fresh(r, prompt)[:, 20:], rtol=0, atol=1e-4)
    stats = r.cache_stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]

    # too full even for own pages after the match: refused (it would not fit without reuse either), and the
    # matched pages are evictable again
    r.allocate("hold", 0, 4, max_tokens=64)
    r.allocate("hold2", 0, 4, max_tokens=32)
    with pytest.raises(NoCapacityError):
        r.allocate("e", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt))
    assert r.cache_stats()["pages_evictable"] == 4  # c recomputed the second page of the match: it was evicted


@pytest.mark.parametrize("lean", [False, True])
def test_a_fork_before_the_sources_first_step_copies_the_matched_prefix(model, lean):
    """A session opened on a cached prefix holds those tokens in the shared pages it matched until its first step;
    a fork of it then copies them from there. (It copied the source's own pages, which hold nothing yet; opened
    lean they are NO_PAGE, and the copy read the pool's last page: another session's K/V.)"""
    r = _runner(model, num_slots=12, max_length=64)  # 48 pages of 16 tokens, 4 blocks
    prompt = list(range(600, 640))
    r.allocate("a", 0, 4, max_tokens=64)
    r.forward("a", _embed(r, prompt), 0)
    r.release("a", prefix_hashes(prompt))
    if lean:  # too full for b's whole limit in own pages: none under its match
        r.allocate("hold", 0, 4, max_tokens=64)
        r.allocate("hold2", 0, 4, max_tokens=64)
        r.forward("hold2", torch.randn(1, 64, r.hidden_size), 0)  # the pool's pages hold someone else's K/V
    assert r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 32
    assert r.sessions()["b"]["pages"] == (8 if lean else 16)
    if lean:
        r.release("hold")
    r.fork("b", "c", 32, max_tokens=48)
    assert r.sessions()["c"]["limit"] == 48
    ref = _fresh(_runner(model), prompt)[:, 32:]
    torch.testing.assert_close(r.forward("c", _embed(r, prompt[32:]), 32), ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(r.forward("b", _embed(r, prompt[32:]), 32), ref, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="must hold"):
        r.fork("b", "d", 32, max_tokens=31)


def test_slots_mode_and_disabled_cache_never_reuse(model):
    prompt = list(range(500, 540))
    for kw in ({"kv_cache": "slots"}, {"prefix_cache": False}, {"page_size": 24}):
        r = _runner(model, **kw)
        assert not r.prefix_cache
        r.allocate("a", 0, 4, max_tokens=64)
        r.forward("a", _embed(r, prompt), 0)
        r.release("a", prefix_hashes(prompt))
        assert r.cache_stats()["pages_cached"] == 0
        assert r.allocate("b", 0, 4, max_tokens=64, prefix_hashes=prefix_hashes(prompt)) == 0


def test_prefix_directory_longest_match_and_bound():
    from petals_chain.algorithms.prefix_locality import PrefixDirectory

    d = PrefixDirectory(capacity=5)
    d.add("A", ["k0", "k1", "k2"])
    d.add("B", ["k0", "x1"])
    assert d.match(["k0", "k1", "k2", "k3"]) == {"A": 3, "B": 1}
    assert d.preferred(["k0", "k1"]) == ["A", "B"] and d.preferred(["zz"]) == []
    d.add("C", ["k0"])  # 6 entries: the oldest, A's deepest block, goes first
    assert d.match(["k0", "k1", "k2"]) == {"A": 2, "B": 1, "C": 1}
    d.forget("A")
    assert d.match(["k0", "k1"]) == {"B": 1, "C": 1} and len(d) == 3
    with pytest.raises(ValueError):
        PrefixDirectory(capacity=-1)


def test_dispatch_starts_a_job_on_the_chain_holding_its_prefix():
    import asyncio

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import ChainPrefixes, DispatchJob, DispatchManager
    from petals_chain.swarm.prefix import prefix_hashes

    def chain(name, T):
        return Chain(servers=(name,), blocks=(4,), service_time=T, capacity=1, spans=((0, 4),))

    async def main():
        dm = DispatchManager(policy="jffc")
        fast, slow = chain("fast", 1.0), chain("slow", 2.0)
        dm.set_chains([fast, slow])
        prefixes = ChainPrefixes()
        prompt = list(range(70))
        prefixes.add(slow, prefix_hashes(prompt[:40]))  # the slower chain's servers were given 2 blocks of this prompt
        job = DispatchJob("1", prefer=prefixes.preferred(prefix_hashes(prompt[:-1])))
        lease = await dm.acquire(job)
        assert lease.chain.servers == ("slow",) and dm.preferred_starts == 1
        # the preferred chain is full now: the next job sharing the prefix takes the fastest free chain
        other = await dm.acquire(DispatchJob("2", prefer=prefixes.preferred(prefix_hashes(prompt[:-1]))))
        assert other.chain.servers == ("fast",) and dm.preferred_starts == 1
        queued = asyncio.create_task(dm.acquire(DispatchJob("3", prefer=prefixes.preferred(prefix_hashes(prompt[:-1])))))
        await asyncio.sleep(0)
        assert dm.queue_length == 1  # no chain has room: it waits in the queue like any job
        dm.release(other)
        assert (await queued).chain.servers == ("fast",)

    asyncio.run(main())
