"""GBP-CR and the planner's c tuning with a volunteer's cache cap (``--cache-tokens-per-block``, issue 17 leftover):
a server whose cap holds fewer than ``c`` jobs at any span was given a span as if its memory's slots held ``c``, and
the plan counted those slots (a chain of capacity 15 on a server whose cap holds 2)."""

from __future__ import annotations

from petals_chain.algorithms import gbp_cr, gca
from petals_chain.model import ModelSpec, ServerSpec
from petals_chain.orchestrator.planner import CappedServerSpec, Planner, ServerView
from petals_chain.swarm.records import ServerRecord

MODEL = ModelSpec(num_blocks=4, block_size=100.0, cache_size=10.0)


def capped(name: str = "C") -> CappedServerSpec:
    """Memory for 60 slots beside 4 blocks, a cap of 128 tokens per block at max_length 64: 2 jobs over any span."""
    return CappedServerSpec(name=name, memory=1000.0, tau_c=0.01, tau_p=0.01, cache_tokens_per_block=128,
                            max_length=64)


def slow(i: int) -> ServerSpec:
    return ServerSpec(name=f"U{i}", memory=500.0, tau_c=0.01, tau_p=0.02)


def test_gbp_cr_gives_no_span_to_a_server_whose_cap_cannot_hold_c_jobs():
    at_two = gbp_cr([capped(), slow(0), slow(1)], MODEL, 2, 10.0)
    assert at_two["C"] == (0, 4) and capped().residual_slots(MODEL, 4) >= 2 * 4
    at_three = gbp_cr([capped(), slow(0), slow(1)], MODEL, 3, 10.0)
    assert "C" not in at_three and min(at_three.coverage(MODEL.num_blocks)) >= 1, dict(at_three.items())
    # a plain server's spans are Eq. 8's as before
    assert dict(gbp_cr([slow(0), slow(1)], MODEL, 3, 10.0).items()) == dict(at_three.items())
    assert capped().most_jobs() == 2 and capped().max_blocks(MODEL, 3) == 0 and capped().max_blocks(MODEL, 2) == 4
    # a cap below one job of max_length is planned by its memory as before (paged, it serves shorter jobs; else its
    # failed load says what it holds)
    tiny = CappedServerSpec(name="T", memory=1000.0, tau_c=0.01, tau_p=0.01, cache_tokens_per_block=16, max_length=64)
    assert tiny.most_jobs() == 0 and tiny.max_blocks(MODEL, 3) == 4


def test_the_planners_plan_counts_only_the_slots_each_cap_allows():
    def record(name: str, memory: int, tau_p: float, cap: int = 0) -> ServerRecord:
        return ServerRecord(peer_id=name, public_name=name, memory_bytes=memory, tau_p=tau_p, max_length=64,
                            kv_cache="slots", cache_tokens_per_block=cap, state="online")

    planner = Planner(dht=None, prefix="m", client=None, max_length=64, on_chains=lambda chains: None,
                      arrival_rate=60.0, model_spec_fallback=lambda: MODEL)
    views = [ServerView("C", record("C", 1000, 0.01, cap=128))] + [ServerView(f"U{i}", record(f"U{i}", 500, 0.02))
                                                                    for i in range(4)]
    plan = planner.full_plan(views)
    assert plan is not None and plan.chains
    specs = {s.name: s for s in planner.specs(views)}
    used: dict[str, int] = {}
    for ch in plan.chains:
        for name, blocks in zip(ch.servers, ch.blocks):
            used[name] = used.get(name, 0) + ch.capacity * blocks
    # the code before: C's chain had capacity 15 (60 slots of the 8 its cap holds), its prediction 0.077 s for 0.104
    assert all(used[n] <= specs[n].residual_slots(MODEL, plan.placement[n][1]) for n in used), (used, plan.chains)
    honest = gca(list(specs.values()), MODEL, plan.placement)
    assert [(ch.servers, ch.capacity) for ch in plan.chains] == [(ch.servers, ch.capacity) for ch in honest]
    assert plan.lower == planner._bounds(honest)[0]
