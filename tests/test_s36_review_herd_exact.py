"""Review of 3876d2d (HERD's server split): small splits solved exactly (HiGHS called splits optimal that its cuts
had cut off: 38.5 for 40.5 after that commit), the split's time budget held in all (it held per solver call: 4 s for
2 s), and ``solve_herd``'s HiGHS "solve error" retried (None where a plan exists)."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from petals_chain.algorithms import herd
from petals_chain.algorithms.herd import (GroupServer, HerdProblem, Stream, assign_server_groups,
                                          brute_force_herd, brute_force_server_groups, check_solution,
                                          solve_herd, solve_server_groups, split_score)


def _servers(blocks, thr):
    return [GroupServer(f"s{i}", b, t) for i, (b, t) in enumerate(zip(blocks, thr))]


def test_the_split_highs_got_wrong_after_the_reseed_is_the_best_one():
    """The input 3876d2d left wrong (and worse than before it: 38.5, the old code 40.0; brute force 40.5)."""
    servers = _servers([1, 1, 4, 4, 1, 3], [0.5, 20.0, 1.5, 10.0, 18.5, 17.5])
    demand = {"A": 1.0, "B": 0.0, "C": 0.3}
    split = solve_server_groups(servers, demand, 1)
    assert split_score(servers, demand, 1, split) == pytest.approx((3, 40.5))
    assert brute_force_server_groups(servers, demand, 1) == pytest.approx((3, 40.5))


def _no_highs(*args, **kwargs):
    raise AssertionError("a split this small is solved without HiGHS")


def test_small_splits_need_no_highs_and_identical_servers_are_one_kind(monkeypatch):
    """12 identical servers over 4 orchestrators (the common swarm: one GPU model) and the residual input, solved by
    the exact search alone; its optimum checked against every count of servers per group."""
    monkeypatch.setattr(herd, "milp", _no_highs)
    servers = _servers([4] * 12, [10.0] * 12)
    demand = {"A": 2.5, "B": 1.0, "C": 1.0, "D": 0.3}
    split = solve_server_groups(servers, demand, 4)
    best = max(min(n * 10.0 / 4 / d for n, d in zip(counts, demand.values()))
               for counts in itertools.product(range(1, 10), repeat=4) if sum(counts) == 12)
    assert split_score(servers, demand, 4, split) == pytest.approx((4, best))
    servers = _servers([1, 1, 4, 4, 1, 3], [0.5, 20.0, 1.5, 10.0, 18.5, 17.5])
    split = solve_server_groups(servers, {"A": 1.0, "B": 0.0, "C": 0.3}, 1)
    assert split_score(servers, {"A": 1.0, "B": 0.0, "C": 0.3}, 1, split) == pytest.approx((3, 40.5))


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.5, 1.5, 7.0, 12.5])), min_size=1, max_size=3),
       pick=st.lists(st.integers(0, 2), min_size=1, max_size=6),
       rates=st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.5]), min_size=1, max_size=3), L=st.integers(1, 6))
def test_the_exact_search_equals_brute_force_with_servers_alike(kinds, pick, rates, L):
    """Servers of a few kinds (the search places a kind by counts, groups alike once): brute force's score."""
    servers = _servers(*zip(*(kinds[p % len(kinds)] for p in pick)))
    demand = {"ABC"[i]: r for i, r in enumerate(rates)}
    want = brute_force_server_groups(servers, demand, L)
    if want[0] == 0:  # no group can hold a copy: HiGHS's u_j model answers that (any split scores 0)
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(herd, "milp", _no_highs)
        split = solve_server_groups(servers, demand, L)
    assert split_score(servers, demand, L, split) == pytest.approx(want)


def test_a_search_out_of_time_leaves_the_split_to_highs(monkeypatch):
    """An exact search that cannot finish in its time: HiGHS's split stands (complete, no worse than greedy)."""
    monkeypatch.setattr(herd, "_exact_cover_split", lambda *a: (None, None, False))
    monkeypatch.setattr(herd, "_max_covered", lambda *a: None)
    rng = random.Random(3)
    servers = _servers([rng.randint(1, 6) for _ in range(7)], [rng.uniform(0.5, 20) for _ in range(7)])
    demand = {"A": 1.0, "B": 2.5}
    split = solve_server_groups(servers, demand, 6)
    got, greedy = (split_score(servers, demand, 6, s) for s in (split, assign_server_groups(servers, demand, 6)))
    assert set(split) == {s.peer_id for s in servers} and got[0] == 2 and got[1] >= greedy[1] * (1 - 1e-3)


def test_the_time_limit_holds_for_the_whole_split(monkeypatch):
    """20 servers over 3 orchestrators (L = 24): each HiGHS call got all of ``time_limit_s`` (2 s took 4.0 s;
    more with a previous split). Here every call is taken to spend its whole limit on a fake clock."""
    from petals_chain.algorithms.herd import milp as real

    clock = [100.0]
    limits = []

    def slow_milp(*args, **kwargs):
        limit = kwargs["options"]["time_limit"]
        limits.append(limit)
        res = real(*args, **{**kwargs, "options": {**kwargs["options"], "time_limit": min(limit, 0.05)}})
        clock[0] += limit
        return res

    monkeypatch.setattr(herd, "time", SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    monkeypatch.setattr(herd, "milp", slow_milp)
    rng = random.Random(0)
    servers = _servers([rng.randint(1, 8) for _ in range(20)], [rng.uniform(0.5, 20) for _ in range(20)])
    demand = {"A": 1.0, "B": 2.0, "C": 0.5}
    previous = {s.peer_id: "ABC"[i % 3] for i, s in enumerate(servers)}
    split = solve_server_groups(servers, demand, 24, previous, time_limit_s=2.0)
    assert split is not None and split_score(servers, demand, 24, split)[0] == 3
    assert len(limits) >= 3 and clock[0] - 100.0 <= 2.0 + 1e-9, limits


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_a_split_without_time_is_a_clear_error(bad):
    from petals_chain.orchestrator.groups import GroupCoordinator

    with pytest.raises(ValueError, match="time_limit_s"):
        solve_server_groups(_servers([4], [10.0]), {"A": 1.0}, 4, time_limit_s=bad)
    with pytest.raises(ValueError, match="ilp_time_s"):
        GroupCoordinator(dht=SimpleNamespace(peer_id="me"), prefix="p", peers=[], planner=None, http_url=str,
                         ilp_time_s=bad)


@pytest.mark.parametrize("num_gpus, streams", [
    (1, [Stream("s0", "m0", 0.5), Stream("s1", "m1", 0.5)]),  # the author's instance: objective 0
    (2, [Stream("s0", "m0", 0.5), Stream("s1", "m1", 0.5)]),  # one GPU each: 2.0
    (4, [Stream("s0", "m0", 0.5), Stream("s1", "m1", 0.5), Stream("s2", "m0", 1.306495451196695)]),  # 1.53
])
@pytest.mark.parametrize("merge", [False, True])
def test_herd_solves_models_a_hair_over_half_a_gpu_that_highs_ended_in_a_solve_error(num_gpus, streams, merge):
    """HiGHS ended these in "solve error" (no answer): solve_herd said infeasible where brute force plans them."""
    p = HerdProblem(streams, {"m0": 8.0000005, "m1": 8.0000005}, 16.0, num_gpus, 2 if num_gpus == 4 else None,
                    None, 2)
    sol, best = solve_herd(p, merge=merge), brute_force_herd(p)
    assert best is not None and sol is not None and check_solution(p, sol) == []
    assert sol.objective == pytest.approx(best.objective, rel=1e-6)
