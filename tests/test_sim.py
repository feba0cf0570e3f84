"""Simulator: queueing sanity against closed forms, slot safety of per-request routing, data loaders, CLI contracts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from petals_chain.algorithms import JFFCDispatcher, response_time_bounds
from petals_chain.model import Chain, ServerSpec
from petals_chain.sim import data as simdata
from petals_chain.sim.engine import CostModel, ServerCost, Workload, mean_ci, simulate_chains, simulate_routed

ROOT = Path(__file__).resolve().parents[1]


def erlang_c_response(lam: float, mu: float, c: int) -> float:
    """Mean response time of M/M/c."""
    a = lam / mu
    rho = a / c
    s = sum(a**k / math.factorial(k) for k in range(c))
    tail = a**c / math.factorial(c) / (1 - rho)
    return tail / (s + tail) / (c * mu - lam) + 1 / mu


def _chain(name: str, T: float, cap: int) -> Chain:
    return Chain(servers=(name,), blocks=(1,), service_time=T, capacity=cap, spans=((0, 1),))


def _replicate(chains, lam, runs, jobs, seed, dispatcher=JFFCDispatcher):
    means = []
    for r in range(runs):
        wl = Workload.poisson(lam, jobs, np.random.default_rng([seed, r]))
        means.append(simulate_chains(chains, dispatcher(chains), wl, warmup=jobs // 10).summary()["mean_response_s"])
    return mean_ci(means)


def test_single_chain_matches_erlang_c():
    lam, T, c = 1.6, 2.0, 4  # rho = 0.8
    m, h = _replicate([_chain("a", T, c)], lam, runs=8, jobs=20000, seed=1)
    exact = erlang_c_response(lam, 1 / T, c)
    assert abs(m - exact) <= max(h, 0.02 * exact), (m, h, exact)


@pytest.mark.parametrize("load", [0.5, 0.85])
def test_jffc_mean_between_theorem_3_7_bounds(load):
    chains = [_chain("fast", 1.0, 3), _chain("mid", 2.5, 4), _chain("slow", 6.0, 5)]
    nu = sum(ch.capacity / ch.service_time for ch in chains)
    lam = load * nu
    lower, upper = response_time_bounds([(1 / ch.service_time, ch.capacity) for ch in chains], lam)
    assert upper > lower * 1.05  # the instance must separate the bounds for the test to mean something
    m, h = _replicate(chains, lam, runs=8, jobs=20000, seed=2)
    assert lower - h <= m <= upper + h, (lower, m, h, upper)


def test_chain_fifo_baselines_complete_every_job_within_capacity():
    from petals_chain.algorithms.baselines import JIQDispatcher, JSQDispatcher, SAJSQDispatcher, SEDDispatcher

    chains = [_chain("a", 1.0, 2), _chain("b", 3.0, 3)]
    wl = Workload.poisson(1.5, 3000, np.random.default_rng(5))
    for cls in (JSQDispatcher, JIQDispatcher, SEDDispatcher, SAJSQDispatcher):
        d = cls(chains, rng=np.random.default_rng(0))
        res = simulate_chains(chains, d, wl)
        assert len(res.response) == 3000
        assert np.all(res.wait >= -1e-12) and np.all(res.service > 0)
        assert all(o == 0 for o in d.occupancy)


def test_simulate_chains_service_is_size_times_T():
    ch = [_chain("a", 2.5, 1000)]  # never queues
    wl = Workload.poisson(0.5, 500, np.random.default_rng(3))
    res = simulate_chains(ch, JFFCDispatcher(ch), wl)
    assert np.allclose(res.service, 2.5 * wl.features[:, 0])
    assert np.allclose(res.wait, 0.0)


# ---------------------------------------------------------------------- per-request routing


def _line_servers(n_per_stage: int, stages: int, blocks_per_stage: int, slots: int):
    """Servers in ``stages`` consecutive spans; every route takes one server per stage."""
    servers, spans, total = [], {}, {}
    for s in range(stages):
        for i in range(n_per_stage):
            name = f"s{s}_{i}"
            servers.append(ServerSpec(name=name, memory=100.0, tau_c=0.01 * (i + 1), tau_p=0.05 * (s + 1)))
            spans[name] = (s * blocks_per_stage, blocks_per_stage)
            total[name] = slots
    return servers, spans, total


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_per_stage=st.integers(1, 3), stages=st.integers(1, 3), bps=st.integers(1, 3), extra=st.integers(0, 4),
       lam=st.floats(0.5, 20.0), seed=st.integers(0, 10**6))
def test_routed_never_exceeds_server_slots(n_per_stage, stages, bps, extra, lam, seed):
    servers, spans, total = _line_servers(n_per_stage, stages, bps, bps + extra)
    rng = np.random.default_rng(seed)

    def route_fn(free, expected_wait):
        # a random route (ignores free slots on purpose, so jobs must wait at full servers)
        return [(f"s{s}_{int(rng.integers(n_per_stage))}", s * bps, (s + 1) * bps) for s in range(stages)]

    wl = Workload.poisson(lam, 300, np.random.default_rng(seed + 1))
    res = simulate_routed(route_fn, total, wl, CostModel.from_servers(servers), check_slots=True)
    assert len(res.response) == 300
    for name, used in res.extra["max_used"].items():
        assert used <= total[name]
    assert np.all(res.wait >= -1e-12)
    assert np.all(res.response >= res.service - 1e-12)


def test_routed_single_server_matches_erlang_c():
    """One server, every job takes the whole model with 1 slot each out of c: an M/M/c queue."""
    servers = [ServerSpec(name="x", memory=10.0, tau_c=0.5, tau_p=0.5)]  # T = 1.0 for one block
    c, lam = 3, 2.1  # rho = 0.7
    means = []
    for r in range(8):
        wl = Workload.poisson(lam, 20000, np.random.default_rng([9, r]))
        res = simulate_routed(lambda f, w: [("x", 0, 1)], {"x": c}, wl, CostModel.from_servers(servers), warmup=2000)
        means.append(res.summary()["mean_response_s"])
    m, h = mean_ci(means)
    exact = erlang_c_response(lam, 1.0, c)
    assert abs(m - exact) <= max(h, 0.03 * exact), (m, h, exact)


def test_petals_and_bprr_routing_on_paper_scenario_respect_slots():
    from petals_chain.sim.scenarios import bloom_scenario, plan_bprr, plan_petals

    scen = bloom_scenario(10, 0.3, 0.5, rng=np.random.default_rng(4), anchors=simdata.synthetic_anchors())
    wl = Workload.poisson(0.5, 400, np.random.default_rng(5))
    for plan in (plan_petals(scen, np.random.default_rng(6)), plan_bprr(scen)):
        assert plan.feasible, plan.note
        res = simulate_routed(plan.route_fn, plan.slots, wl, scen.cost, check_slots=True)
        assert len(res.response) == 400
        for name, used in res.extra["max_used"].items():
            assert used <= plan.slots[name]


def test_trace_cost_model_is_footnote_11():
    cost = CostModel({"a": ServerCost(c0=0.05, p0=0.001, pI=1e-5, pO=2e-3, cO=0.05)})
    wl = Workload.from_lengths(np.array([0.0]), np.array([2000]), np.array([20]))
    res = simulate_routed(lambda f, w: [("a", 0, 10)], {"a": 10}, wl, cost)
    expected = 0.05 * 20 + 10 * (0.001 + 1e-5 * 2000 + 2e-3 * 19)
    assert res.service[0] == pytest.approx(expected)


# ----------------------------------------------------------------------------------- data


def test_trace_timestamp_seven_fractional_digits(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n"
                 "2023-11-16 18:17:04.0319600,3180,8\n"
                 "2023-11-16 18:17:05,110,0\n")
    tr = simdata.load_trace(p)
    assert tr.arrivals[0] == 0.0
    assert tr.arrivals[1] == pytest.approx(0.052, abs=1e-9)
    assert tr.arrivals[2] == pytest.approx(1.02004, abs=1e-9)
    assert list(tr.context_tokens) == [4808, 3180, 110]
    assert list(tr.generated_tokens) == [10, 8, 1]  # zero output tokens still produce the first token
    assert simdata.parse_timestamp_ns("2023-11-16 18:17:03.1234567") - simdata.parse_timestamp_ns("2023-11-16 18:17:03") == 123456700


@pytest.mark.parametrize("bad", ["2023-11-16 18:17:xx.1,1,1\n", "2023-11-16 18:17:03.12a,1,1\n", "2023-11-16 18:17:03.1234567891,1,1\n", "2023-11-16 18:17:03,-1,1\n",
                                 "2023-11-16 18:17:03,abc,1\n"])
def test_trace_bad_rows_raise_clear_error(tmp_path, bad):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + bad)
    with pytest.raises(simdata.DataError, match="t.csv:2"):
        simdata.load_trace(p)


def test_trace_and_rtt_fallbacks(tmp_path, monkeypatch):
    monkeypatch.setattr(simdata, "_candidate_dirs", lambda: [tmp_path])
    tr = simdata.get_trace(seed=1)
    assert tr.source == "synthetic"
    assert len(tr) == 8818
    assert tr.rate == pytest.approx(2.57, rel=1e-6)
    assert np.median(tr.context_tokens) == pytest.approx(1469, rel=0.05)
    assert np.mean(tr.context_tokens) == pytest.approx(2048, rel=0.08)
    assert np.median(tr.generated_tokens) == pytest.approx(13, rel=0.1)
    assert simdata.interarrival_cv_ratio(tr.arrivals) > 2.0  # bursty, unlike Poisson (ratio 1)
    an = simdata.get_anchors()
    assert an.source == "synthetic" and len(an) == 320
    with pytest.raises(FileNotFoundError):
        simdata.get_trace(tmp_path / "missing.csv")
    with pytest.raises(FileNotFoundError):
        simdata.get_anchors(tmp_path / "missing.csv")


def test_rtt_loader_medians_and_orchestrator(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("measure_id,anchor_id,dst_ip,init_time,latency_m1,latency_m2,latency_m3,latency_m4,latitude,longitude\n"
                 "x,1,ip,t,10,-1,30,20,50.0,8.0\n"
                 "x,1,ip,t,40,,0,,50.0,8.0\n"
                 "x,2,ip,t,5,6,7,-3,50.0,8.0\n"
                 "x,3,ip,t,100,100,100,100,52.0,13.0\n")
    an = simdata.load_anchors(p)
    med = dict(zip(an.ids, an.median_ms))
    assert med == {"1": 25.0, "2": 6.0, "3": 100.0}  # median of positive samples only
    rtt = simdata.sample_rtts_ms(an, 2, np.random.default_rng(0))
    # orchestrator = anchor 2 (lowest); servers = anchors 1 and 3 in some order
    d13 = float(simdata.great_circle_km(50.0, 8.0, np.array([52.0]), np.array([13.0]))[0])
    expected = sorted([0.3 * 6 + 0.3 * 25, 0.3 * 6 + 0.3 * 100 + 0.01 * d13])
    assert sorted(rtt.tolist()) == pytest.approx(expected)
    tau = simdata.sample_tau_c(an, 2, np.random.default_rng(0))
    assert sorted(tau.tolist()) == pytest.approx([(e + 18.0) / 1000 for e in expected])


def test_shared_data_files_parse_when_present():
    trace_path = simdata.default_data_path(simdata.TRACE_FILENAME)
    if trace_path is None:
        pytest.skip("shared data not present")
    tr = simdata.load_trace(trace_path)
    assert 8800 <= len(tr) <= 8830
    assert tr.rate == pytest.approx(2.57, rel=0.01)
    assert simdata.interarrival_cv_ratio(tr.arrivals) == pytest.approx(13.15, rel=0.02)
    an = simdata.load_anchors(simdata.default_data_path(simdata.RTT_FILENAME))
    assert len(an) == 320


# ------------------------------------------------------------------------------------ CLI


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "petals_chain.sim", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_overall_json_contract():
    p = _cli("overall", "--servers", "10", "--eta", "0.4", "--runs", "1", "--jobs", "200", "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"proposed", "petals", "bprr", "jffc-only"}
    for pol in ("proposed", "petals", "bprr"):
        for key in ("mean_response_s", "p95_response_s", "mean_wait_s", "mean_service_s"):
            assert isinstance(out[pol][key], float) and out[pol][key] >= 0
        assert out[pol]["mean_response_s"] == pytest.approx(out[pol]["mean_wait_s"] + out[pol]["mean_service_s"], rel=1e-9)
    # BLOOM-176B (92 GB of weights) fits on no 40 GB server: JFFC-only is reported as infeasible, not faked
    for key in ("mean_response_s", "p95_response_s", "mean_wait_s", "mean_service_s"):
        assert key in out["jffc-only"] and out["jffc-only"][key] is None


def test_cli_planner_scale_json_contract():
    p = _cli("planner-scale", "--servers", "40", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"servers", "seconds", "c", "chains"} <= set(out)
    assert out["servers"] == 40 and out["seconds"] > 0 and out["c"] >= 1 and out["chains"] >= 1


def test_cli_rejects_bad_arguments():
    p = _cli("overall", "--runs", "0", "--json")
    assert p.returncode == 2 and "--runs" in p.stderr
    p = _cli("trace", "--trace", "/nonexistent/trace.csv", "--json", "--no-progress")
    assert p.returncode == 2 and "not found" in p.stderr
    p = _cli("overall", "--petals-cache-tokens", "100", "--json")
    assert p.returncode == 2 and "--petals-cache-tokens" in p.stderr
    p = _cli("bogus")
    assert p.returncode == 2


# ----------------------------------------------------------------------- figure experiments


def test_fig3_gbp_cr_never_worse_than_random_placements_homogeneous():
    from petals_chain.sim.experiments import fig3

    res = fig3(runs=2, num_random=20, lambdas=(0.2, 0.4, 0.6), progress=False)
    for row in res["cases"]["homogeneous"]:
        if row["feasible_runs"]:
            assert row["gbp_cr_le_best_random_runs"] == row["feasible_runs"]  # Thm 3.4
            assert row["gbp_cr_mean"] <= row["random_min"]


def test_fig4_orders_lower_bound_ilp_gca_and_ck():
    from petals_chain.sim.experiments import fig4

    res = fig4(runs=2, loads=(0.1, 0.3, 0.5, 0.7), progress=False)
    for row in res["rows"]:
        assert row["lower"] <= row["ilp"] + 1e-9  # one chain at most mu_1 per job server
        assert row["ilp"] <= row["gca"] + 1e-9  # GCA's allocation is feasible for the ILP
        if row["ck"] is not None:
            assert row["gca"] <= row["ck"] + 1e-9  # c·K(c) is the paper's upper bound on what GCA needs


def test_ilp_job_servers_respects_memory():
    from petals_chain.sim.experiments import greedy_job_servers, ilp_job_servers

    chains = [Chain(("a", "b"), (2, 1), 1.0, 3, ((0, 2), (2, 3))), Chain(("c",), (3,), 2.0, 2, ((0, 3),))]
    slots = {"a": 6, "b": 3, "c": 6}
    # rate 3.5 needs the 3 fast jobs (rate 3) plus one slow one (0.5): 4 job servers
    assert greedy_job_servers(chains, 3.5) == 4
    assert ilp_job_servers(chains, slots, 3.5) == 4
    assert ilp_job_servers(chains, slots, 10.0) is None  # beyond what memory allows


def test_cli_trace_and_rtt_files(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    for _ in range(60):
        t += float(rng.exponential(0.5))
        whole, frac = int(t), int(round((t - int(t)) * 1e7))
        if frac == 10**7:
            whole, frac = whole + 1, 0
        lines.append(f"2023-11-16 18:{17 + whole // 60:02d}:{whole % 60:02d}.{frac:07d},{int(rng.integers(10, 4000))},"
                     f"{int(rng.integers(1, 60))}")
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(lines) + "\n")
    rtt = tmp_path / "rtt.csv"
    rows = ["measure_id,anchor_id,dst_ip,init_time,latency_m1,latency_m2,latency_m3,latency_m4,latitude,longitude"]
    for i in range(15):
        rows.append(f"m,{i},ip,t,{10 + 3 * i},{11 + 3 * i},-1,{12 + 3 * i},{45 + i * 0.5},{5 + i}")
    rtt.write_text("\n".join(rows) + "\n")
    p = _cli("trace", "--trace", str(trace), "--rtt-file", str(rtt), "--runs", "1", "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["source"] == str(trace) and out["requests"] == 60
    for pol in ("proposed", "petals", "bprr", "jffc-only"):
        assert out["policies"][pol]["mean_response_s"] > 0
    p = _cli("overall", "--rtt-file", str(tmp_path / "nope.csv"), "--json")
    assert p.returncode == 2 and "not found" in p.stderr


@pytest.mark.slow
def test_cli_reproduce_quick_runs_every_experiment(tmp_path):
    p = _cli("reproduce", "--quick", "--runs", "1", "--jobs", "200", "--json", "--no-progress", "--out", str(tmp_path), timeout=500)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"fig3", "fig4", "fig5", "fig6", "fig7", "fig8", "overall", "trace"}
    assert out["fig5"]["rows"] and out["fig7"]["rows"] and out["fig8"]["cells"]
    assert out["fig6"]["c_star"]["lower"] is not None
    for name in ("fig3_gbp_cr", "fig4_gca", "fig5_jffc", "fig6_c_tuning", "fig7_c_star", "fig8_overall"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    for name in ("fig3", "overall", "trace"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["result"]


@pytest.mark.parametrize("policy", ["petals", "bprr"])
def test_route_memoization_is_exact(policy):
    from petals_chain.sim.scenarios import bloom_scenario, plan_bprr, plan_petals

    for seed, lam in ((1, 0.2), (2, 0.6), (3, 1.5)):
        scen = bloom_scenario(12, 0.25, lam, rng=np.random.default_rng(seed), anchors=simdata.synthetic_anchors())
        plan = plan_petals(scen, np.random.default_rng(seed)) if policy == "petals" else plan_bprr(scen)
        wl = Workload.poisson(lam, 600, np.random.default_rng(seed + 10))
        a = simulate_routed(plan.route_fn, plan.slots, wl, scen.cost)
        b = simulate_routed(plan.route_fn, plan.slots, wl, scen.cost, route_key=plan.route_key)
        assert np.array_equal(a.response, b.response) and np.array_equal(a.wait, b.wait)
        if lam > 1.0:
            assert b.wait.max() > 0  # servers filled up, so the key took several values


def test_routed_sim_shows_routers_the_wait_where_a_hop_finds_too_few_slots():
    """WS-RR adds a server's expected wait only where ``free < m_ij``: the wait must be there whenever that holds
    (it was 0 wherever one slot was free, so a 4-block hop was sent to 2 free slots and waited), and a server with a
    queue shows no free slot (a new hop starts after the queue)."""
    import numpy as np

    from petals_chain.algorithms.baselines import ws_rr_route
    from petals_chain.model import ModelSpec, ServerSpec
    from petals_chain.sim.engine import CostModel, Workload, simulate_routed

    model = ModelSpec(4, 1.0, 0.1)
    servers = [ServerSpec("A", 4.6, 0.05, 1.0), ServerSpec("B", 8.0, 0.05, 1.2)]
    placement = {"A": (0, 4), "B": (0, 4)}
    seen = []

    def route(free, wait):
        seen.append((dict(free), dict(wait)))
        return ws_rr_route(servers, model, placement, free, wait)

    wl = Workload(np.array([0.0, 0.1, 0.2, 0.3]), np.array([[1.0, 0, 0]] * 4))
    simulate_routed(route, {"A": 6, "B": 40}, wl, CostModel.from_servers(servers))
    free, wait = seen[1]
    assert free["A"] == 2 and wait["A"] > 0  # the second job finds 2 of A's slots free: its 4-block hop would wait
    assert all(w > 0 for _, ws in seen for w in ws.values())
