"""The planner's c tuning with volunteers' cache caps (``Planner._tune``, ``tune_capacity``): caps that never bind
(a cap at or above what the server's memory ever holds) must leave the plan ``tune_capacity`` makes; the tuning walks
each capped server as ``gbp_cr`` does and counts its slots as its ``residual_slots`` says (its cap's)."""

from __future__ import annotations

from petals_chain.algorithms import gbp_cr, gca, tune_capacity
from petals_chain.model import ModelSpec, ServerSpec
from petals_chain.orchestrator.planner import CappedServerSpec, Planner

MODEL = ModelSpec(num_blocks=6, block_size=100.0, cache_size=10.0)


def planner(rate: float, use_all_servers: bool) -> Planner:
    return Planner(dht=None, prefix="m", client=None, max_length=64, on_chains=lambda chains: None, arrival_rate=rate,
                   model_spec_fallback=lambda: MODEL, use_all_servers=use_all_servers)


def test_caps_that_never_bind_leave_the_plan_tune_capacity_makes():
    # S3 and S4 hold 6 and 16 jobs by their caps, more than their memory ever does (5 and 15 with one block)
    def spec(name, memory, tau_c, tau_p, jobs=0):
        kw = dict(name=name, memory=memory, tau_c=tau_c, tau_p=tau_p)
        return CappedServerSpec(**kw, cache_tokens_per_block=64 * jobs, max_length=64) if jobs else ServerSpec(**kw)

    specs = [spec("S0", 2000.0, 0.044, 0.027, jobs=191), spec("S1", 1200.0, 0.044, 0.041),
             spec("S2", 400.0, 0.006, 0.028), spec("S3", 150.0, 0.020, 0.048, jobs=6),
             spec("S4", 250.0, 0.046, 0.033, jobs=16), spec("S5", 150.0, 0.022, 0.012)]
    plain = [ServerSpec(name=s.name, memory=s.memory, tau_c=s.tau_c, tau_p=s.tau_p) for s in specs]
    pl = planner(0.5, use_all_servers=True)
    want = tune_capacity(plain, MODEL, 0.5, rho_bar=pl.rho_bar, method="lower", use_all_servers=True, ties="largest")
    got = pl._tune(specs, MODEL, 0.5)
    # the code before: c 7 and four servers placed for c 1 and all six (the same lower bound, its ranges' tie-break)
    assert (got[0], dict(got[1].items())) == (want[0], dict(want[1].items()))


def test_the_tuning_counts_a_capped_servers_slots_by_its_cap():
    """C's memory holds 60 slots beside 4 blocks, its cap 8 (2 jobs of 64 tokens per block); within the range of c
    it holds (1..2) the tuning planned its chain with the 60 (capacity 15), where GCA on the same placement finds 2."""
    model = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)
    specs = [CappedServerSpec(name="C", memory=1000.0, tau_c=0.01, tau_p=0.01, cache_tokens_per_block=128,
                              max_length=64)] + [ServerSpec(name=f"U{i}", memory=500.0, tau_c=0.01, tau_p=0.02)
                                                 for i in range(2)]
    c, placement, chains = tune_capacity(specs, model, 60.0, c_range=(1, 2))
    honest = gca(specs, model, placement)
    assert [(ch.servers, ch.capacity) for ch in chains] == [(ch.servers, ch.capacity) for ch in honest], chains
    assert any("C" in ch.servers for ch in chains)
    # plain servers are counted by Eq. 3 as before
    plain = [ServerSpec(name=s.name, memory=s.memory, tau_c=s.tau_c, tau_p=s.tau_p) for s in specs]
    c, placement, chains = tune_capacity(plain, model, 60.0, c_range=(1, 2))
    assert [(ch.servers, ch.capacity) for ch in chains] == [(ch.servers, ch.capacity)
                                                            for ch in gca(plain, model, placement)]


def test_a_cap_below_one_job_is_still_given_a_span_by_its_memory():
    """A cap below one job of ``max_length`` (16 tokens per block at 64) would count no chain now that the tuning counts
    caps: it is planned by its memory, as before (the server loads its span, and a failed load says what it holds;
    test_refused_assignments on real servers)."""
    from petals_chain.orchestrator.planner import ServerView
    from petals_chain.swarm.records import ServerRecord

    model = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)
    pl = Planner(dht=None, prefix="m", client=None, max_length=64, on_chains=lambda chains: None, arrival_rate=1.0,
                 model_spec_fallback=lambda: model)
    rec = ServerRecord(peer_id="T", public_name="T", memory_bytes=1000, tau_p=0.01, max_length=64, kv_cache="slots",
                       cache_tokens_per_block=16, state="online")
    plan = pl.full_plan([ServerView("T", rec)])
    assert plan is not None and dict(plan.placement.items()) == {"T": (0, 4)}, plan


def test_the_tuning_walks_a_capped_server_as_gbp_cr_does():
    """tune_capacity's placement at its c* is GBP-CR's at that c: a server whose cap holds fewer than c jobs gets no
    blocks (the code before: at c 21 it placed S0 and S3, caps of 19 and 11 jobs, where gbp_cr places none)."""
    model = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)

    def spec(name, memory, tau_c, tau_p, jobs):
        return CappedServerSpec(name=name, memory=memory, tau_c=tau_c, tau_p=tau_p, cache_tokens_per_block=64 * jobs,
                                max_length=64)

    specs = [spec("S0", 1000.0, 0.01, 0.048, 19), spec("S1", 300.0, 0.035, 0.028, 10),
             spec("S2", 500.0, 0.034, 0.038, 12), spec("S3", 2000.0, 0.011, 0.047, 11)]
    for use_all in (False, True):
        c, placement, _ = tune_capacity(specs, model, 400.0, use_all_servers=use_all)
        assert dict(placement.items()) == dict(gbp_cr(specs, model, c, 400.0, use_all_servers=use_all).items()), c
