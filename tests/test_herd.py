"""HERD group-assignment ILP (seed 003 §4, rebuilt in docs/scheduling-seeds.md §3.3) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from petals_chain.algorithms.herd import (HerdProblem, Stream, brute_force_herd, check_solution, merge_model_streams,
                                          solve_chain_allocation, solve_herd)
from petals_chain.sim.deadlines import random_herd_instance


@pytest.mark.parametrize("merge", [True, False])
def test_ilp_equals_brute_force_on_random_small_instances(merge):
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(12):
        p = random_herd_instance(rng, streams=int(rng.integers(2, 6)), gpus=int(rng.integers(2, 9)),
                                 models=int(rng.integers(1, 4)), g_bar=int(rng.integers(1, 5)),
                                 mem_gpu=float(rng.choice([6.0, 9.0, 16.0])), affinity_sets=int(rng.integers(1, 3)))
        ilp, bf = solve_herd(p, merge=merge), brute_force_herd(p)
        assert (ilp is None) == (bf is None)
        if ilp is None:
            continue
        assert ilp.objective == pytest.approx(bf.objective, rel=1e-6)
        assert check_solution(p, ilp) == [] and check_solution(p, bf) == []
        checked += 1
    assert checked >= 6


def test_constraints_shape_the_optimum():
    # two models that cannot share a GPU (memory), 4 GPUs, groups of at most 3
    streams = [Stream("s1", "a", 1.0), Stream("s2", "b", 2.0)]
    p = HerdProblem(streams, {"a": 10.0, "b": 10.0}, gpu_memory=16.0, num_gpus=4, g_bar=3)
    sol = solve_herd(p)
    assert sol.group["s1"] != sol.group["s2"]
    # best split: b (needs 2) gets 3 GPUs -> 1.5, a gets 1 -> 1.0; or 2/2 -> a 2.0, b 1.0: min bt = 1.0 either way
    assert sol.objective == pytest.approx(1.0)
    # with room for both models on one GPU they share a group of 3 (bt of b = 1.5)
    p2 = HerdProblem(streams, {"a": 4.0, "b": 4.0}, gpu_memory=16.0, num_gpus=4, g_bar=3)
    assert solve_herd(p2).objective == pytest.approx(1.5)
    # affinity sets forbid sharing again
    p3 = HerdProblem(streams, {"a": 4.0, "b": 4.0}, gpu_memory=16.0, num_gpus=4, g_bar=3, affinity_sets=[["a"], ["b"]])
    assert solve_herd(p3).objective == pytest.approx(1.0)
    # a model larger than a GPU: infeasible
    assert solve_herd(HerdProblem(streams, {"a": 20.0, "b": 1.0}, 16.0, 4, 3)) is None


def test_check_solution_catches_violations():
    streams = [Stream("s1", "a", 1.0)]
    p = HerdProblem(streams, {"a": 4.0}, gpu_memory=16.0, num_gpus=2, g_bar=2)
    sol = solve_herd(p)
    assert check_solution(p, sol) == []
    sol.sizes[0] = 3
    assert any("(a)" in v for v in check_solution(p, sol))


def test_merge_model_streams_uses_largest_n():
    m = merge_model_streams([Stream("x", "a", 1.0), Stream("y", "a", 3.0), Stream("z", "b", 2.0)])
    assert [(s.model, s.n) for s in m] == [("a", 3.0), ("b", 2.0)]


def test_chain_allocation():
    # one group: 12 servers, chains of 2 servers; model b needs twice a's chains
    sol = solve_chain_allocation({"a": 1.0, "b": 2.0}, {"a": 2, "b": 2}, num_servers=12)
    assert sol.chains == {"a": 2, "b": 4} and sol.objective == pytest.approx(2.0)
    assert sum(2 * c for c in sol.chains.values()) <= 12
    # every model needs a complete chain: not enough servers for both -> None
    assert solve_chain_allocation({"a": 1.0, "b": 1.0}, {"a": 3, "b": 3}, num_servers=5) is None
    # group limit: at most 2 chains per group, each model in one group
    sol = solve_chain_allocation({"a": 1.0, "b": 1.0}, {"a": 1, "b": 1}, num_servers=10, g_bar=2)
    assert all(sum(g.values()) <= 2 for g in sol.groups) and sol.chains == {"a": 2, "b": 2}
