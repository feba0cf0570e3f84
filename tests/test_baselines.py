"""PETALS, BPRR and whole-model baselines against their definitions."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from petals_chain.algorithms import (ModelSpec, Placement, ServerSpec, cg_bp_placement, petals_cache_slots,
                                     petals_num_blocks, petals_placement, petals_route, route_service_time,
                                     whole_model_placement, ws_rr_route)
from petals_chain.algorithms.baselines.petals import _choose_start, petals_throughput

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _servers(rng, J, lo=3.0, hi=30.0):
    return [ServerSpec(f"s{j}", float(rng.uniform(lo, hi)), float(rng.uniform(0.02, 0.1)),
                       float(rng.uniform(0.05, 0.2))) for j in range(J)]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), J=st.integers(1, 12), L=st.integers(1, 30),
       rule=st.sampled_from(["sorted", "sum"]))
def test_petals_placement_definition_and_coverage(seed, J, L, rule):
    rng = np.random.default_rng(seed)
    model = ModelSpec(L, 1.0, 0.1)
    servers = _servers(rng, J)
    pl = petals_placement(servers, model, rng=random.Random(seed), window_rule=rule)
    by = {s.name: s for s in servers}
    total = 0
    for name, (a, m) in pl.items():
        assert m == petals_num_blocks(by[name], model) and 0 <= a and a + m <= L
        total += m
    sizes = [petals_num_blocks(s, model) for s in servers]
    if rule == "sorted" and sum(sizes) >= L:
        assert min(pl.coverage(L)) >= 1  # covers every block when memory allows


def test_petals_window_rules_differ_as_documented():
    thr = np.array([1.0, 10.0, 3.0, 3.0])
    assert _choose_start(thr, 2, "sorted") == 0  # (1, 10) is lexicographically smallest
    assert _choose_start(thr, 2, "sum") == 2  # 6 is the smallest sum
    assert _choose_start(np.zeros(5), 3, "sorted") == 0 and _choose_start(np.zeros(5), 3, "sum") == 0


def test_petals_block_count_cache_and_throughput():
    model = ModelSpec(70, 1.32, 0.11)
    fast = ServerSpec("f", 40.0, 0.05, 0.109)
    # 4096-token cache per block at max_length 2048 = 2 slots' worth per block
    assert petals_num_blocks(fast, model) == int(40.0 // (1.32 + 0.22))
    assert petals_num_blocks(fast, model, cache_tokens=2048) == int(40.0 // (1.32 + 0.11))
    assert petals_cache_slots(25) == 50 and petals_cache_slots(25, max_length=4096) == 25
    assert petals_throughput(fast, 25) == pytest.approx((1 / 0.109) / 13)
    assert petals_throughput(fast, 25, network_rps=0.1) == 0.1
    with pytest.raises(ValueError):
        petals_placement([fast], model, window_rule="max")


def _all_routes(servers, pl, L):
    """Every route: hops (name, start, end), switching only at span ends."""
    out = []

    def walk(e, hops):
        if e == L:
            out.append(list(hops))
            return
        for s in servers:
            if s.name not in pl:
                continue
            a, m = pl[s.name]
            if a <= e < a + m:
                walk(a + m, hops + [(s.name, e, a + m)])

    walk(0, [])
    return out


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), J=st.integers(1, 7), L=st.integers(1, 8))
def test_routes_are_min_cost_by_brute_force(seed, J, L):
    rng = np.random.default_rng(seed)
    model = ModelSpec(L, 1.0, 0.1)
    servers = _servers(rng, J)
    spans = {}
    for s in servers:
        m = int(rng.integers(1, L + 1))
        spans[s.name] = (int(rng.integers(0, L - m + 1)), m)
    pl = Placement(spans, num_blocks=L)
    free = {s.name: int(rng.integers(0, 2 * L)) for s in servers}
    wait = {s.name: float(rng.uniform(0, 5)) for s in servers}
    by = {s.name: s for s in servers}
    routes = _all_routes(servers, pl, L)

    def petals_cost(r):
        return sum((by[n].tau_c - 0.018) / 2 + 0.018 + by[n].tau_p * (e - b) + (10.0 if free[n] < e - b else 0.0)
                   for n, b, e in r)

    def ws_cost(r):
        return sum(by[n].tau_c + by[n].tau_p * (e - b) + (wait[n] if free[n] < e - b else 0.0) for n, b, e in r)

    if not routes:
        with pytest.raises(ValueError):
            petals_route(servers, model, pl, free)
        with pytest.raises(ValueError):
            ws_rr_route(servers, model, pl, free, wait)
        return
    r1 = petals_route(servers, model, pl, free)
    assert r1 in routes and petals_cost(r1) == pytest.approx(min(map(petals_cost, routes)), rel=1e-12)
    r2 = ws_rr_route(servers, model, pl, free, wait)
    assert r2 in routes and ws_cost(r2) == pytest.approx(min(map(ws_cost, routes)), rel=1e-12)
    assert route_service_time(by, r2) == pytest.approx(sum(by[n].tau_c + by[n].tau_p * (e - b) for n, b, e in r2))


def test_petals_route_avoids_full_server():
    model = ModelSpec(4, 1.0, 0.1)
    servers = [ServerSpec("fast", 10, 0.02, 0.01), ServerSpec("slow", 10, 0.02, 0.5)]
    pl = Placement({"fast": (0, 4), "slow": (0, 4)}, num_blocks=4)
    assert petals_route(servers, model, pl, {"fast": 4, "slow": 4}) == [("fast", 0, 4)]
    assert petals_route(servers, model, pl, {"fast": 3, "slow": 4}) == [("slow", 0, 4)]  # +10 s on fast
    assert ws_rr_route(servers, model, pl, {"fast": 0, "slow": 4}, {"fast": 0.5}) == [("fast", 0, 4)]
    assert ws_rr_route(servers, model, pl, {"fast": 0, "slow": 4}, {"fast": 5.0}) == [("slow", 0, 4)]
    with pytest.raises(ValueError):
        petals_route(servers, model, pl, {"fast": 1})


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), J=st.integers(1, 12), L=st.integers(1, 30), R=st.integers(1, 10))
def test_cg_bp_definition_and_coverage(seed, J, L, R):
    rng = np.random.default_rng(seed)
    model = ModelSpec(L, 1.0, 0.1)
    servers = _servers(rng, J)
    pl = cg_bp_placement(servers, model, R)
    sizes = {s.name: s.max_blocks(model, R) for s in servers}
    for name, (a, m) in pl.items():
        assert m == sizes[name] >= 1 and 0 <= a and a + m <= L
    assert set(pl) == {n for n, m in sizes.items() if m >= 1}  # every server that fits gets blocks
    if sum(sizes.values()) >= L:
        assert min(pl.coverage(L)) >= 1


def test_cg_bp_prefers_uncovered_then_least_cached():
    model = ModelSpec(6, 1.0, 0.5)
    # all host 3 blocks at R=1; the fastest two cover 0..5, the third goes where caches are fewest
    servers = [ServerSpec("a", 4.5, 0.0, 0.1), ServerSpec("b", 4.5, 0.0, 0.11), ServerSpec("c", 4.5, 0.0, 0.12),
               ServerSpec("d", 3.0, 0.0, 0.13)]
    pl = cg_bp_placement(servers, model, 1)
    assert pl["a"] == (0, 3) and pl["b"] == (3, 3)  # uncovered blocks first
    # every server adds 1 slot per block: c ties everywhere (smallest start), d goes where counts are lowest
    assert pl["c"] == (0, 3) and pl["d"] == (3, 2)
    with pytest.raises(ValueError):
        cg_bp_placement(servers, model, 0)


def test_whole_model_placement():
    model = ModelSpec(10, 1.0, 0.25)
    servers = [ServerSpec("big", 20.0, 0.1, 0.2), ServerSpec("small", 11.0, 0.1, 0.1),
               ServerSpec("tiny", 9.0, 0.1, 0.1)]
    pl, chains = whole_model_placement(servers, model)
    assert dict(pl) == {"big": (0, 10)}  # small fits the weights but not one job's cache (needs 12.5)
    assert len(chains) == 1
    ch = chains[0]
    assert ch.capacity == int((20.0 - 10.0) // 0.25) // 10 == 4
    assert ch.service_time == pytest.approx(0.1 + 0.2 * 10) and ch.spans == ((0, 10),)
