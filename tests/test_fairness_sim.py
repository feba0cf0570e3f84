"""The fairness simulator (petals_chain/sim/fairness.py): invariants on random workloads, the seed's service
bounds (Thm 4.1 for DLPM, Thm 5.1 for D2LPM), and the quick headline experiments against their acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from petals_chain.algorithms.fairness import FAIRNESS_POLICIES
from petals_chain.sim import fairness as fair
from petals_chain.sim.fairness import ClientSpec, FairSim, PrefixCache, StepCost, make_workload, simulate


def _random_workload(seed: int, n_clients: int = 3, duration: float = 8.0, units_s: float = 3000.0):
    rng = np.random.default_rng([seed, 7])
    return make_workload(fair.random_clients(rng, n_clients, units_s=units_s), duration, seed)


@pytest.mark.parametrize("policy", FAIRNESS_POLICIES)
def test_every_request_finishes_once_and_no_worker_idles_while_one_waits(policy):
    for seed in range(3):
        reqs = _random_workload(seed)
        workers = 1 + seed % 3
        out = simulate(policy, reqs, workers=workers, capacity=4, cache_tokens=2500)
        assert len(out.requests) == len(reqs) > 20
        assert all(r.finishes == 1 and r.done == r.output for r in out.requests)
        assert out.wc_violations == 0
        for r in out.requests:
            assert r.arrival <= r.admitted < r.first_token <= r.finished
            assert 0 <= r.extend <= r.input_tokens
        # W = w_e * extend + w_q * output, exactly what the requests did
        for c in out.clients:
            rs = [r for r in out.requests if r.client == c]
            assert out.service[c] == pytest.approx(sum(r.extend + 2 * r.output for r in rs))


def test_step_model_one_request_alone():
    cost = StepCost(a=0.02, b=0.001, d=0.01)
    r = fair.Request(0, "a", 1.0, ("a", 0), 100, 20, 3)
    out = FairSim("fcfs", cost=cost).run([r])
    # prefill step (120 extend tokens, batch 1) then two decode steps
    assert r.first_token == pytest.approx(1.0 + 0.02 + 0.12 + 0.01)
    assert r.finished == pytest.approx(r.first_token + 2 * 0.03)
    assert r.extend == 120 and out.steps == 3


def test_second_request_of_a_group_reuses_the_prefix_and_eviction_is_lru():
    reqs = [fair.Request(0, "a", 0.0, "g", 1000, 10, 2), fair.Request(1, "a", 5.0, "g", 1000, 10, 2),
            fair.Request(2, "a", 6.0, "h", 1000, 10, 2), fair.Request(3, "a", 7.0, "g", 1000, 10, 2)]
    out = FairSim("fcfs", cache_tokens=1500).run(reqs)
    assert [r.extend for r in out.requests] == [1010, 10, 1010, 1010]  # h evicted g (capacity 1500)
    cache = PrefixCache(100)
    cache.use("x", 80)
    cache.use("y", 80)  # x pinned: the cache overflows rather than dropping a prefix in use
    assert "x" in cache and "y" in cache
    cache.release("x")
    assert "x" not in cache and "y" in cache


@pytest.mark.parametrize("seed", range(4))
def test_dlpm_service_difference_within_thm_4_1(seed):
    r = fair.bound_check(seed, policy="dlpm", workers=1, duration=12.0)
    assert r["finished_once"] and r["wc_violations"] == 0
    assert 0 < r["max_gap"] <= r["bound"], r


@pytest.mark.parametrize("seed", range(3))
def test_d2lpm_service_difference_within_thm_5_1(seed):
    r = fair.bound_check(seed, policy="d2lpm", workers=3, duration=12.0)
    assert r["finished_once"] and r["wc_violations"] == 0
    assert 0 < r["max_gap"] <= r["bound"], r


def test_the_bound_check_can_fail():
    # LPM is unfair: with the same workloads the Thm 4.1 bound is exceeded (so the tests above can fail)
    ratios = [fair.bound_check(s, policy="lpm", workers=1, duration=12.0)["ratio"] for s in range(4)]
    assert max(ratios) > 1.0, ratios


def test_jain_is_taken_only_while_all_clients_wait():
    reqs = make_workload([ClientSpec("a", 20.0, suffix=200, output=8), ClientSpec("b", 0.05, suffix=50, output=4)],
                         40.0, 3)
    out = simulate("vtc", reqs, capacity=2)
    m = fair.metrics(out, warmup=0.0)
    iv = fair.all_backlogged(out)
    assert m["all_backlogged_s"] == pytest.approx(sum(b - a for a, b in iv))
    assert m["all_backlogged_s"] < 0.2 * out.horizon  # b rarely waits


def test_requests_freed_in_one_step_are_all_replaced_in_the_next():
    """Two requests finish in the same step: both queued ones start in the next step together (the second waited a
    whole step with its slot empty before)."""
    # 0 runs steps [0, .02) and [.02, .04); 1 joins the second and finishes with 0 at .04; 2 and 3 wait for them
    reqs = [fair.Request(i, "c", t, None, 0, 10, n) for i, (t, n) in enumerate([(0.0, 2), (0.01, 1), (0.015, 3),
                                                                                (0.016, 3)])]
    o = fair.simulate("fcfs", reqs, capacity=2, cost=fair.StepCost(a=0.02, b=0.0, d=0.0))
    r = sorted(o.requests, key=lambda r: r.rid)
    assert r[0].finished == r[1].finished == pytest.approx(0.04)
    assert r[2].admitted == r[3].admitted == pytest.approx(0.04)
    assert r[2].finished == r[3].finished == pytest.approx(0.10)


def test_the_trace_split_into_clients_follows_the_seed_and_the_weights():
    w = {"heavy": 4.0, "a": 1.0, "b": 1.0}
    split = {seed: [r.client for r in fair.trace_workload(w, 2.0, 600.0, seed=seed)[0]] for seed in (0, 1)}
    assert split[0] != split[1] and len(split[0]) == len(split[1])
    assert 0.6 < split[0].count("heavy") / len(split[0]) < 0.73
    again = [r.client for r in fair.trace_workload(w, 4.0, 300.0, seed=0)[0]]
    assert again == split[0][:len(again)]  # a row keeps its client whatever the rate


def test_max_min_share():
    assert fair.max_min_share({"h": 10.0, "a": 1.0, "b": 2.0}, 9.0) == {"a": 1.0, "b": 2.0, "h": 6.0}


@pytest.fixture(scope="module")
def heavy_quick():
    return fair.heavy(quick=True)


def test_heavy_quick_acceptance(heavy_quick):
    r = heavy_quick
    d, fc = r["policies"]["dlpm"], r["policies"]["fcfs"]
    assert all(m["finished_once"] for m in r["policies"].values())
    # the same requests finish as soon as under FCFS; the units served inside the window vary with which requests
    # each order serves there
    assert d["finish_vs_fcfs"] >= fair.ACCEPT["heavy_throughput_vs_fcfs"] and d["throughput_vs_fcfs"] >= 0.95
    assert d["jain"] >= fair.ACCEPT["heavy_jain"]
    # light clients are protected from the heavy one's queue: their wait is a small part of FCFS's
    assert max(v["wait_s"] for v in d["light"].values()) < 0.2 * min(v["wait_s"] for v in fc["light"].values())
    assert d["light_ratio_max"] < 0.7 * fc["light_ratio_max"]
    # beside the other light clients (no heavy one) a light client is slower than alone: a smaller ratio
    assert all(r["alone"][c]["together_mean_s"] > r["alone"][c]["mean_s"] for c in d["light"])
    assert d["light_ratio_together_max"] < d["light_ratio_max"] and fc["light_ratio_together_max"] > 2


@pytest.mark.xfail(strict=True, reason="not met under the default step cost (docs/results.md): the heavy client "
                   "keeps the batch full, so a light request's service time is ~2x its time alone")
def test_heavy_light_latency_within_1_3x_of_alone(heavy_quick):
    assert heavy_quick["policies"]["dlpm"]["light_ratio_max"] <= fair.ACCEPT["heavy_light_latency_ratio"]


def test_heavy_light_latency_excess_is_batching_interference(heavy_quick):
    # the cause of the miss above: service time (admission to finish) is inflated for every policy, even FCFS
    for m in heavy_quick["policies"].values():
        assert m["light_service_ratio_max"] > fair.ACCEPT["heavy_light_latency_ratio"]


def test_prefix_quick_acceptance():
    r = fair.prefix(quick=True, duration=60.0)
    p = r["policies"]
    assert r["dlpm_vs_vtc"] >= fair.ACCEPT["prefix_dlpm_vs_vtc"]
    assert p["dlpm"]["cache_hit_rate"] > p["vtc"]["cache_hit_rate"] + 0.3
    assert p["dlpm"]["jain"] >= fair.ACCEPT["heavy_jain"]  # the seed: 0.83-0.855 (Fig. 10)


def test_distributed_quick_acceptance():
    r = fair.distributed(quick=True, duration=30.0, policies=("d2lpm", "d-vtc", "rr-lpm"))
    p = r["policies"]
    assert r["d2lpm_vs_dvtc"] >= fair.ACCEPT["distributed_d2lpm_vs_dvtc"]
    assert p["d2lpm"]["jain"] > p["rr-lpm"]["jain"]
    assert all(m["wc_violations"] == 0 and m["finished_once"] for m in p.values())
