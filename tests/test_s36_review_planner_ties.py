"""Review of 1fd6fd1 (c ties in ``tune_capacity``): the planner's ``ties="largest"`` took the *smallest* c within
``TIE_TOLERANCE`` of the minimum. At light load every placement with the same fastest chain ties (the waiting term is
below 1e-9 of the bound), so that was the placement of least capacity: the demo's SmolLM2 swarm planned 3 chains of
capacity 6 in all (c 4) where the paper's argmin gives 2 of 7 (c 6). A tie now goes to the placement whose chains
serve the most (sum c_k mu_k), at the largest c giving it. Pure: no model, no processes."""

from __future__ import annotations

import pytest

from petals_chain.algorithms import ModelSpec, ServerSpec, tune_capacity

# the demo's real servers (petals_chain.demo.REAL_SERVERS: blocks, KV slots per block, RTT ms) on SmolLM2-135M at
# max_length 1024 (30 blocks, s_m = 14160384 B, s_c = 1572864 B), in units of s_m; tau_p of a CPU-sized block
DEMO_MODEL = ModelSpec(30, 1.0, 1572864 / 14160384)
DEMO = [ServerSpec(name, blocks * (1 + slots * DEMO_MODEL.cache_size), (rtt + 18) / 1000, 0.002)
        for name, blocks, slots, rtt in [("gpu-a100", 16, 8, 4.0), ("gpu-3090", 12, 8, 8.0), ("gpu-t4", 10, 6, 12.0),
                                         ("laptop", 8, 6, 20.0)]]


def _rate(chains) -> float:
    return sum(ch.capacity / ch.service_time for ch in chains)


@pytest.mark.parametrize("lam", [0.05, 0.5])
def test_a_light_load_tie_keeps_the_plan_of_most_capacity(lam):
    """The demo's swarm at lambda 0.05 and 0.5 (its default): the commit planned c 4 / 5 with less capacity than the
    paper's argmin (c 6: a100 -> 3090 of 6 jobs, t4 -> laptop -> 3090 of 1); now c 6 and its chains again."""
    paper = tune_capacity(DEMO, DEMO_MODEL, lam, use_all_servers=True)
    c, placement, chains = tune_capacity(DEMO, DEMO_MODEL, lam, use_all_servers=True, ties="largest")
    assert paper[0] == 6 and sum(ch.capacity for ch in paper[2]) == 7
    assert (c, dict(placement.items())) == (paper[0], dict(paper[1].items())), (c, dict(placement.items()))
    assert sum(ch.capacity for ch in chains) == 7 and len(chains) == 2


def test_a_tie_goes_to_the_placement_serving_most_and_stays_as_lambda_moves():
    """Five servers, all placed: c 1..8 (four placements, s2 on 5, 4, 3 or 2 blocks) give the same lower bound to
    1e-11 at light load. The commit picked c 1's placement (total rate 30.7 jobs/s) at c 2 for every lambda; now the
    one serving most (33.7: s2 on 2 blocks), at the largest c giving it (8), whatever lambda is in the tie."""
    model = ModelSpec(5, 1.0, 0.25)
    servers = [ServerSpec("s0", 16.0, 0.04325, 0.28562), ServerSpec("s1", 16.0, 0.09355, 0.13853),
               ServerSpec("s2", 8.0, 0.12276, 0.17389), ServerSpec("s3", 16.0, 0.00827, 0.23098),
               ServerSpec("s4", 16.0, 0.09892, 0.24076)]
    rates = {c: _rate(tune_capacity(servers, model, 0.32, use_all_servers=True, c_range=(c, c))[2])
             for c in range(1, 9)}
    for lam in (0.093, 0.128, 0.32, 0.404):
        c, placement, chains = tune_capacity(servers, model, lam, use_all_servers=True, ties="largest")
        assert c == 8 and placement["s2"] == (0, 2), (lam, c, dict(placement.items()))
        assert _rate(chains) == pytest.approx(max(rates.values())) and _rate(chains) > rates[2] * 1.05
