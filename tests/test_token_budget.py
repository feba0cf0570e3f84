"""Chain capacity by tokens (issue 15): a paged server's token budget holds jobs of the expected length ``L^``.

Units: the estimate and the budget arithmetic (pure, algorithms/token_budget.py), the planner's ``M~_j`` per record.
Through the orchestrator (real server processes, real P2P on loopback): a paged chain runs as many jobs at once as
its token budget holds (more than its ``max_length`` slots), a burst of jobs longer than ``L^`` waits at the server
instead of failing, and every output equals transformers'.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from conftest import hf_greedy_from
from petals_chain.algorithms.token_budget import JobTokenEstimate, jobs_in_budget


def test_jobs_in_budget():
    assert jobs_in_budget(4096 * 32, 1360) == 96
    assert jobs_in_budget(0, 16) == 0
    with pytest.raises(ValueError):
        jobs_in_budget(100, 0)
    with pytest.raises(ValueError):
        jobs_in_budget(-1, 16)


def test_estimate_prior_then_mean_of_window_rounded_to_pages():
    est = JobTokenEstimate(4096, window=4, min_jobs=3, granularity=16, tolerance=0.2)
    assert est.value == 4096  # a fresh orchestrator counts max_length slots until it has seen traffic
    assert not est.observe(100) and not est.observe(200)  # fewer than min_jobs: the prior holds
    assert est.value == 4096
    assert est.observe(300) and est.value == 208  # mean 200, rounded up to whole pages of 16
    assert not est.observe(230)  # mean 207.5: inside the band, no recompute
    assert est.value == 208
    for t in (9000, 9000, 9000, 9000):  # the window forgets old jobs; lengths are clamped to max_length
        est.observe(t)
    assert est.value == 4096 and est.mean == 4096
    assert est.observed == 8


def test_estimate_does_not_flip_at_a_page_boundary():
    """Short jobs whose mean hovers around a page boundary (one page is more than the 20 % band there) must not move
    L^ back and forth: each move recomputes the chains."""
    est = JobTokenEstimate(128, window=8, min_jobs=1)
    changes = sum(est.observe(t) for t in [40, 70, 50, 60, 45, 75] * 30)
    assert changes == 1 and est.value == 48  # the first job moves it off the prior (128), then it stays


def test_estimate_fixed_prior_and_bounds():
    assert JobTokenEstimate(64, prior=1).value == 16  # at least one page
    assert JobTokenEstimate(64, prior=63).value == 64  # at most max_length
    with pytest.raises(ValueError):
        JobTokenEstimate(0)
    with pytest.raises(ValueError):
        JobTokenEstimate(64, tolerance=1.0)


def test_planner_counts_paged_servers_by_tokens():
    from petals_chain.orchestrator.planner import Planner
    from petals_chain.swarm.records import ServerRecord

    planner = Planner(dht=None, prefix="t", client=None, max_length=4096, on_chains=lambda chains: None,
                      job_tokens=1000)
    common = dict(peer_id="p", state="online", memory_bytes=1, tau_p=0.01, start_block=0, num_blocks=10,
                  max_length=4096)
    paged = ServerRecord(**common, slots_total=32, slots_free=32, kv_cache="paged", page_size=16,
                         cache_tokens_total=32 * 4096, cache_tokens_free=32 * 4096)
    slots = ServerRecord(**common, slots_total=32, slots_free=32, kv_cache="slots", page_size=4096,
                         cache_tokens_total=32 * 4096, cache_tokens_free=32 * 4096)
    assert planner.residual_jobs(slots) == 32  # Eq. 3 slots, whatever L^
    assert planner.residual_jobs(paged) == 32 * 4096 // 1008  # L^ rounded up to whole pages: 1008 tokens
    planner.observe_job_tokens(10)  # fixed by --job-tokens: not learnt
    assert planner.job_tokens.value == 1008
    auto = Planner(dht=None, prefix="t", client=None, max_length=4096, on_chains=lambda chains: None)
    assert auto.residual_jobs(paged) == 32  # L^ = max_length before any job: the slot count
    for _ in range(16):
        auto.observe_job_tokens(2048)
    assert auto.job_tokens.value == 2048 and auto.residual_jobs(paged) == 64


# ---------------------------------------------------------------- through the orchestrator

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


@contextlib.contextmanager
def one_paged_server(model_path, tmp_path, scaled, **cfg):
    """An in-process orchestrator (``--job-tokens 16`` and ``cfg``) and one server holding all 4 blocks in the
    memory of 2 slots of 64 tokens per block, its chain up."""
    from inprocess import InProcessSwarm

    from petals_chain.swarm.local import memory_for

    sw = InProcessSwarm(model_path, tmp_path, max_length=MAX_LENGTH, arrival_rate=1.0, job_tokens=16, **cfg)
    try:
        sw.start()
        sw.add_server("a", memory_for(model_path, MAX_LENGTH, 4, 2))
        sw.wait_until(lambda st: st["ready"] and st["chains"], scaled(120), "the chain")
        yield sw
    finally:
        sw.stop()


def all_at_once(sw, prompts: list[list[int]], max_tokens: int, scaled) -> list:
    """Greedy generations of ``prompts``, submitted together."""
    from petals_chain.orchestrator.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def run(orch):
        return await asyncio.gather(*(orch.generate(p, params) for p in prompts))

    return sw.call(run, timeout=scaled(300))


@pytest.mark.slow
def test_paged_chain_runs_its_token_budget_and_long_bursts_wait(model_path, tmp_path, scaled):
    """One server, all 4 blocks, the memory of 2 slots of 64 tokens per block. With ``--job-tokens 16`` its chain
    holds 8 jobs at once (2 x 64 / 16), not 2: 8 short requests submitted together all run at once. Then 6 requests
    declaring 60 tokens each (4x the budget) all finish: the opens the server cannot fit wait in its FIFO. Every
    output equals transformers'."""
    with one_paged_server(model_path, tmp_path, scaled) as sw:
        st = sw.state()
        assert [c["capacity"] for c in st["chains"]] == [8], st["chains"]
        assert st["servers"][0]["slots_total"] == 2 * 4  # block-slots of max_length: what slots mode would run
        assert st["job_tokens"]["value"] == 16 and st["job_tokens"]["mode"] == "fixed"
        short = [[3 + i, 14, 15, 92, 65, 35] for i in range(8)]  # 6 + 8 = 14 tokens declared: one page
        outs = all_at_once(sw, short, 8, scaled)
        st = sw.state()
        print("chains:", st["chains"], "job_tokens:", st["job_tokens"])
        assert st["chains"][0]["max_active"] == 8  # all at once: 4x the chain's max_length slots
        for p, g in zip(short, outs):
            assert g.token_ids == hf_greedy_from(model_path, p, 8)
        long = [[7 + i, 21, 5, 40] for i in range(6)]  # 4 + 56 = 60 tokens declared, 4 pages per block each
        outs = all_at_once(sw, long, 56, scaled)
        st = sw.state()
        print("chains:", st["chains"], "job_tokens:", st["job_tokens"])
        assert st["job_tokens"]["open_waits"] >= 1  # the server fits 2 at once: the others waited for pages
        assert all(g.failovers == 0 for g in outs)
        for p, g in zip(long, outs):
            assert g.token_ids == hf_greedy_from(model_path, p, 56)


@pytest.mark.slow
def test_an_open_waits_at_a_server_for_its_queue_time_or_a_bounded_time_if_silent(model_path, tmp_path, scaled):
    """The long burst of the test above with ``open_wait_max_s`` 0.2 s. The server heartbeats the opens it queues,
    so they keep their place in its FIFO for the jobs' queue time (none is sent again). Then, as if the server were
    an older one without heartbeats, the same burst: the queued opens run out of their 0.2 s wait there before
    pages free up and are sent again (a lost reply would cost that wait, not the job's whole queue budget). Every
    job finishes on its chain, token-exact, without a failover."""
    with one_paged_server(model_path, tmp_path, scaled, open_wait_max_s=0.2) as sw:
        long = [[7 + i, 21, 5, 40] for i in range(6)]

        async def older_server(orch):
            peer = next(iter(orch.planner.servers))
            assert orch.client.heartbeats(peer)  # what this version's record says
            orch.client.heartbeats = lambda peer_id: False

        for heartbeats in (True, False):
            if not heartbeats:
                sw.call(older_server)
            before = sw.state()["job_tokens"]
            outs = all_at_once(sw, long, 56, scaled)
            st = sw.state()["job_tokens"]
            waits, rewaits = st["open_waits"] - before["open_waits"], st["open_rewaits"] - before["open_rewaits"]
            assert waits >= 1, st
            assert (rewaits == 0) if heartbeats else (rewaits >= 1), (heartbeats, st)
            assert all(g.failovers == 0 for g in outs)
            for p, g in zip(long, outs):
                assert g.token_ids == hf_greedy_from(model_path, p, 56)


# ---------------------------------------------------------------- growth and preemption

def _runner(model_path, slots: int, kv_cache: str = "paged"):
    from petals_chain.server.runner import BlockRunner

    return BlockRunner(str(model_path), 0, 2, num_slots=slots, max_length=MAX_LENGTH, kv_cache=kv_cache,
                       batching=False)


def test_runner_extend_takes_pages_or_changes_nothing(model_path):
    from petals_chain.server.kv_cache import NoCapacityError

    r = _runner(model_path, slots=2)  # 2 block-slots of 64 tokens: 8 pages of 16
    r.allocate("a", 0, 2, max_tokens=10)  # one page per block
    r.allocate("b", 0, 2, max_tokens=40)  # three pages per block
    x = torch.randn(1, 10, r.config.hidden_size)
    before = r.forward("a", x, 0)
    assert r.pool.pages_available == 0
    with pytest.raises(NoCapacityError):
        r.extend("a", 17)
    assert r.sessions()["a"]["limit"] == 10 and r.sessions()["a"]["pages"] == 2  # unchanged
    with pytest.raises(ValueError):
        r.forward("a", torch.randn(1, 1, r.config.hidden_size), 10)  # beyond the limit
    r.release("b")
    assert r.extend("a", 40) == 40 and r.sessions()["a"]["pages"] == 6
    assert r.extend("a", 20) == 40  # never shrinks
    y = torch.randn(1, 20, r.config.hidden_size)
    out = r.forward("a", y, 10)  # continues over the old page and the new ones
    ref = _runner(model_path, slots=2)
    ref.allocate("a", 0, 2, max_tokens=40)
    assert torch.equal(ref.forward("a", x, 0), before)
    assert torch.allclose(ref.forward("a", y, 10), out, atol=1e-6)
    with pytest.raises(ValueError):
        r.extend("a", MAX_LENGTH + 1)
    with pytest.raises(KeyError):
        r.extend("nope", 20)
    s = _runner(model_path, slots=2, kv_cache="slots")
    s.allocate("a", 0, 2, max_tokens=10)
    assert s.extend("a", 60) == MAX_LENGTH  # a slot holds max_length already


@pytest.mark.slow
def test_jobs_outgrowing_their_reservation_extend_or_are_preempted_exactly(model_path, tmp_path, scaled):
    """Chains are opened for the prompt + 8 tokens (``output_reserve_tokens=8``) and L^ is 16, so the server's 32
    pages (2 slots of 64 tokens per block, 4 blocks) admit 6 jobs of 4 prompt tokens at once; each then generates
    56 tokens and must grow to 4 pages per block: the server fits two of them at full length. Jobs extend while
    pages are free; the others are preempted (their KV kept as cached prefixes), resume when pages free up, and
    every output equals transformers'."""
    with one_paged_server(model_path, tmp_path, scaled, output_reserve_tokens=8) as sw:
        prompts = [[7 + i, 21, 5, 40] for i in range(6)]
        outs = all_at_once(sw, prompts, 56, scaled)
        st = sw.state()
        print("job_tokens:", st["job_tokens"], "relay:", {k: st["relay"][k] for k in ("prompt_cached_tokens",
                                                                                        "failovers")})
        assert st["chains"][0]["max_active"] == 6  # all admitted at once on their short reservations
        assert st["job_tokens"]["extensions"] >= 2 and st["job_tokens"]["preemptions"] >= 1
        assert all(g.failovers == 0 for g in outs)
        for p, g in zip(prompts, outs):
            assert g.token_ids == hf_greedy_from(model_path, p, 56)
