"""Reproductions of the paper's §4.1 figures, the overall comparison and the trace replay.

Each function returns a JSON-ready dict; ``__main__`` prints tables and draws plots from it.
Monte Carlo run ``r`` of seed ``s`` uses ``np.random.default_rng([s, r])`` for its swarm and workload,
and every policy in a run sees the same swarm and the same jobs (common random numbers).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from petals_chain.algorithms.gbp_cr import blocks_per_server
from petals_chain.model import Chain
from petals_chain.sim import data as simdata
from petals_chain.sim.engine import Workload, mean_ci, simulate_chains
from petals_chain.sim.scenarios import (BLOOM_176B, DEFAULT_C, DEFAULT_ETA, DEFAULT_J, DEFAULT_LAMBDA, DEFAULT_RHO_BAR, DISPATCHERS,
                                        POLICIES, Scenario, bloom_scenario, covers_all_blocks, llama_trace_scenario,
                                        make_dispatcher, plan_policy, random_heterogeneous_swarm)

ROUTED_POLICIES = ("petals", "bprr")  # per-request routes: no chains, so no simple capacity

PAPER = {
    "fig8_reduction_range_pct": [8, 83],
    "table1": {  # §4.2, Table 1 (LLaMA-2-7B, 9 MIG servers, first 1000 Azure requests)
        "petals": {"mean_response_s": 31.4, "p95_response_s": 68.5, "mean_wait_s": 24.2},
        "bprr": {"mean_response_s": 19.8, "p95_response_s": 44.2, "mean_wait_s": 12.6},
        "jffc-only": {"mean_response_s": 10.0, "p95_response_s": 22.1, "mean_wait_s": 1.5},
        "proposed": {"mean_response_s": 7.3, "p95_response_s": 15.2, "mean_wait_s": 0.6},
    },
}


def _progress(iterable: Iterable, total: int | None = None, desc: str = "", enabled: bool = True):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, mininterval=0.5)


def run_rng(seed: int, run: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, run, *extra])


def pair_rates(chains: Sequence[Chain]) -> list[tuple[float, int]]:
    return [(1.0 / ch.service_time, int(ch.capacity)) for ch in chains]


# ------------------------------------------------------------------------------------- Fig. 3


def disjoint_chains_objective(order: Sequence[int], m: np.ndarray, t: np.ndarray, L: int, target: float) -> int | None:
    """Walk servers in ``order``, cut a chain whenever it covers ``L`` blocks, stop when sum(1/T) >= target.

    Returns the number of chains ``|K|`` (10a) of this feasible solution of (10), or None if the servers
    run out first.
    """
    nu, K, blocks, T = 0.0, 0, 0, 0.0
    for j in order:
        if m[j] < 1:
            continue
        blocks += int(m[j])
        T += float(t[j])
        if blocks >= L:
            K += 1
            nu += 1.0 / T
            blocks, T = 0, 0.0
            if nu >= target:
                return K
    return None


def fig3(*, runs: int = 20, seed: int = 0, c: int = DEFAULT_C, num_random: int = 100, lambdas: Sequence[float] = (0.2, 0.4, 0.6, 0.8),
         num_servers: int = DEFAULT_J, progress: bool = True) -> dict:
    """GBP-CR vs ``num_random`` random feasible placements on (10): objective ``c |K|``; eta=0 and eta=0.2.

    A random feasible placement is a random order of the servers cut into disjoint chains (each
    covering L blocks) until (10b) holds; orders that never reach (10b) are redrawn (up to 50x).
    """
    from petals_chain.algorithms import gbp_cr_chain_count

    out = {"c": c, "num_random": num_random, "runs": runs, "lambdas": list(lambdas), "cases": {}}
    anchors = simdata.get_anchors()
    for case, eta in (("homogeneous", 0.0), ("heterogeneous", DEFAULT_ETA)):
        rows = []
        for lam in _progress(lambdas, desc=f"fig3 {case}", enabled=progress):
            gbp, rand_all, never_worse = [], [], 0
            for r in range(runs):
                rng = run_rng(seed, r, int(lam * 1000))
                scen = bloom_scenario(num_servers, eta, lam, rng=rng, anchors=anchors)
                model = scen.model
                memory = np.array([s.memory for s in scen.servers])
                m = blocks_per_server(memory, model, c)
                t = np.array([s.tau_c + s.tau_p * mj for s, mj in zip(scen.servers, m)])
                target = lam / (scen.rho_bar * c)
                K = gbp_cr_chain_count(scen.servers, model, c, lam, scen.rho_bar)
                if K is None:
                    continue
                rand = []
                tries = 0
                while len(rand) < num_random and tries < 50 * num_random:
                    tries += 1
                    k = disjoint_chains_objective(rng.permutation(len(m)), m, t, model.num_blocks, target)
                    if k is not None:
                        rand.append(c * k)
                gbp.append(c * K)
                rand_all.extend(rand)
                if rand and c * K <= min(rand):
                    never_worse += 1
            if not gbp:
                rows.append({"lambda": lam, "feasible_runs": 0})
                continue
            ra = np.asarray(rand_all, dtype=float)
            rows.append({
                "lambda": lam, "feasible_runs": len(gbp), "gbp_cr_mean": float(np.mean(gbp)),
                "random_min": float(ra.min()) if len(ra) else None, "random_q1": float(np.percentile(ra, 25)) if len(ra) else None,
                "random_median": float(np.median(ra)) if len(ra) else None, "random_q3": float(np.percentile(ra, 75)) if len(ra) else None,
                "random_max": float(ra.max()) if len(ra) else None, "random_mean": float(ra.mean()) if len(ra) else None,
                "gbp_cr_le_best_random_runs": never_worse,
            })
        out["cases"][case] = rows
    return out


# ------------------------------------------------------------------------------------- Fig. 4


def chain_server_blocks(chains: Sequence[Chain]) -> list[dict[str, int]]:
    """Per chain: server -> ``m_ij`` (slots one job of the chain takes there)."""
    out = []
    for ch in chains:
        d: dict[str, int] = {}
        for name, mij in zip(ch.servers, ch.blocks):
            d[name] = d.get(name, 0) + int(mij)
        out.append(d)
    return out


def greedy_job_servers(chains: Sequence[Chain], required_rate: float) -> int | None:
    """Fewest job servers (sum of c_k) using chains in the given order with at most their capacities."""
    total, n = 0.0, 0
    for ch in chains:
        mu = 1.0 / ch.service_time
        if total + ch.capacity * mu >= required_rate:
            return n + int(math.ceil((required_rate - total) / mu - 1e-12))
        total += ch.capacity * mu
        n += ch.capacity
    return None


def ilp_job_servers(chains: Sequence[Chain], slots: dict[str, int], required_rate: float) -> int | None:
    """(7) restricted to ``chains``: min sum c_k s.t. sum c_k mu_k >= rate, memory (7d), c_k integer >= 0."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    K = len(chains)
    if K == 0:
        return None
    mu = np.array([1.0 / ch.service_time for ch in chains])
    names = sorted(slots)
    use = chain_server_blocks(chains)
    A = np.array([[use[k].get(n, 0) for k in range(K)] for n in names], dtype=float)
    cons = [LinearConstraint(mu[None, :], lb=required_rate, ub=np.inf),
            LinearConstraint(A, lb=-np.inf, ub=np.array([slots[n] for n in names], dtype=float))]
    res = milp(c=np.ones(K), constraints=cons, integrality=np.ones(K), bounds=Bounds(0, np.inf))
    if not res.success:
        return None
    return int(round(res.fun))


def fig4(*, runs: int = 20, seed: int = 0, c: int = DEFAULT_C, loads: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
         num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA, progress: bool = True) -> dict:
    """GCA vs c*K(c), the ceil(lambda/(rho_bar mu_1)) bound and the ILP optimum on GCA's chains.

    Placement: GBP-CR with c=7 using every server (arrival rate large enough that Alg. 1 never stops
    early), so the same placement serves every load. ``load`` = lambda as a fraction of the total
    service rate nu of GCA's chains; the required rate is lambda/rho_bar (7b).
    """
    from petals_chain.algorithms import gbp_cr, gca

    rows = {ld: {"gca": [], "ck": [], "lower": [], "ilp": []} for ld in loads}
    for r in _progress(range(runs), total=runs, desc="fig4", enabled=progress):
        rng = run_rng(seed, r)
        scen = bloom_scenario(num_servers, eta, DEFAULT_LAMBDA, rng=rng)
        placement = gbp_cr(scen.servers, scen.model, c=c, arrival_rate=1e9, rho_bar=scen.rho_bar)
        if not covers_all_blocks(placement, scen.model):
            continue
        chains = gca(scen.servers, scen.model, placement)
        if not chains:
            continue
        slots = {n: scen.by_name[n].residual_slots(scen.model, m) for n, (a, m) in placement.items()}
        nu = sum(ch.capacity / ch.service_time for ch in chains)
        mu1 = max(1.0 / ch.service_time for ch in chains)
        disjoint = _disjoint_gbp_chains(scen, c)
        for ld in loads:
            lam = ld * nu
            need = lam / scen.rho_bar
            rows[ld]["gca"].append(greedy_job_servers(chains, need))
            rows[ld]["lower"].append(int(math.ceil(need / mu1 - 1e-12)))
            rows[ld]["ilp"].append(ilp_job_servers(chains, slots, need))
            # c K(c): fewest disjoint GBP-CR chains of capacity c reaching lambda/rho_bar
            acc, K = 0.0, None
            for i, T in enumerate(disjoint):  # Alg. 1's order
                acc += c / T
                if acc >= need:
                    K = i + 1
                    break
            rows[ld]["ck"].append(c * K if K else None)
    table = []
    for ld in loads:
        d = rows[ld]
        entry = {"load": ld}
        for key in ("gca", "ck", "lower", "ilp"):
            vals = [v for v in d[key] if v is not None]
            entry[key] = float(np.mean(vals)) if vals else None
            entry[f"{key}_n"] = len(vals)
        table.append(entry)
    return {"c": c, "runs": runs, "rows": table}


def _disjoint_gbp_chains(scen: Scenario, c: int) -> list[float]:
    """``T`` of every complete disjoint chain of Alg. 1's walk for ``c`` (servers by ascending t~_j(c))."""
    model = scen.model
    m = np.array([s.max_blocks(model, c) for s in scen.servers])
    t = np.array([s.tau_c + s.tau_p * mj for s, mj in zip(scen.servers, m)])
    usable = np.nonzero(m >= 1)[0]
    order = usable[np.argsort(t[usable] / m[usable], kind="stable")]
    Ts, blocks, T = [], 0, 0.0
    for j in order:
        blocks += int(m[j])
        T += float(t[j])
        if blocks >= model.num_blocks:
            Ts.append(T)
            blocks, T = 0, 0.0
    return Ts


# ------------------------------------------------------------------------------------- Fig. 5


def fig5(*, runs: int = 20, seed: int = 0, c: int = DEFAULT_C, loads: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
         jobs: int = 5000, num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA, progress: bool = True) -> dict:
    """JFFC vs JSQ/JIQ/SED/SA-JSQ and the Theorem 3.7 bounds on GBP-CR(c=7)+GCA chains, lambda = load * nu.

    The placement uses every server (GBP-CR run for an arrival rate it cannot reach), so GCA yields
    several chains; with the default lambda=0.2 GBP-CR stops after one chain and every policy coincides.
    """
    from petals_chain.algorithms import gbp_cr, gca, response_time_bounds

    res = {ld: {k: [] for k in (*DISPATCHERS, "lower", "upper", "jffc_service_frac")} for ld in loads}
    res_chains: list[int] = []
    for r in _progress(range(runs), total=runs, desc="fig5", enabled=progress):
        rng = run_rng(seed, r)
        scen = bloom_scenario(num_servers, eta, DEFAULT_LAMBDA, rng=rng)
        # every server placed (as in Fig. 4), so that there are several chains to balance over
        placement = gbp_cr(scen.servers, scen.model, c=c, arrival_rate=1e9, rho_bar=scen.rho_bar)
        chains = gca(scen.servers, scen.model, placement) if covers_all_blocks(placement, scen.model) else []
        if not chains:
            continue
        nu = sum(ch.capacity / ch.service_time for ch in chains)
        res_chains.append(len(chains))
        for ld in loads:
            lam = ld * nu
            wl = Workload.poisson(lam, jobs, run_rng(seed, r, int(ld * 1000)))
            lo, hi = response_time_bounds(pair_rates(chains), lam)
            res[ld]["lower"].append(lo)
            res[ld]["upper"].append(hi)
            for kind in DISPATCHERS:
                d = make_dispatcher(kind, chains, run_rng(seed, r, int(ld * 1000), 7))
                s = simulate_chains(chains, d, wl, scen.cost, warmup=jobs // 10).summary()
                res[ld][kind].append(s["mean_response_s"])
                if kind == "jffc":
                    res[ld]["jffc_service_frac"].append(s["mean_service_s"] / s["mean_response_s"])
    rows = []
    for ld in loads:
        row = {"load": ld}
        for k, vals in res[ld].items():
            m, h = mean_ci(vals)
            row[k] = m
            if k in DISPATCHERS:
                row[f"{k}_ci"] = h
        rows.append(row)
    return {"c": c, "runs": runs, "jobs": jobs, "rows": rows, "chains_per_run": res_chains}


# ---------------------------------------------------------------------------------- Fig. 6 / 7


def _sim_proposed_c(scen: Scenario, c: int, wl: Workload, warmup: int) -> float:
    from petals_chain.algorithms import gbp_cr, gca

    placement = gbp_cr(scen.servers, scen.model, c=c, arrival_rate=scen.arrival_rate, rho_bar=scen.rho_bar)
    if not covers_all_blocks(placement, scen.model):
        return math.inf
    chains = gca(scen.servers, scen.model, placement)
    if not chains or sum(ch.capacity / ch.service_time for ch in chains) <= scen.arrival_rate:
        return math.inf  # unstable: the mean response time grows without bound
    return simulate_chains(chains, make_dispatcher("jffc", chains, None), wl, scen.cost, warmup=warmup).summary()["mean_response_s"]


def c_curves(scen: Scenario) -> dict[str, dict[int, float]]:
    """Objective per c: surrogate c K(c)/lambda, Thm 3.7 lower and upper bounds (tune_capacity's tables)."""
    from petals_chain.algorithms import tune_capacity

    import inspect

    # evaluate every c (tune_capacity may otherwise skip values it proves cannot win)
    extra = {"prune": False} if "prune" in inspect.signature(tune_capacity).parameters else {}
    out = {}
    for method in ("surrogate", "lower", "upper"):
        _, _, _, table = tune_capacity(scen.servers, scen.model, scen.arrival_rate, scen.rho_bar, method=method,
                                       return_table=True, **extra)
        table = {c: (math.inf if v is None else float(v)) for c, v in table.items()}
        if method == "surrogate":
            table = {c: v / scen.arrival_rate for c, v in table.items()}
        out[method] = table
    return out


def _argmin(d: dict[int, float]) -> int | None:
    finite = [(v, c) for c, v in d.items() if v is not None and math.isfinite(v)]
    return min(finite)[1] if finite else None


def fig6(*, runs: int = 20, seed: int = 0, jobs: int = 5000, c_values: Sequence[int] | None = None,
         arrival_rate: float = DEFAULT_LAMBDA, num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA,
         progress: bool = True) -> dict:
    """Mean response time vs c (simulated, averaged over runs) beside the surrogate and the bounds."""
    anchors = simdata.get_anchors()
    scen0 = bloom_scenario(num_servers, eta, arrival_rate, rng=run_rng(seed, 0), anchors=anchors)
    from petals_chain.algorithms import max_capacity

    c_max = max_capacity(scen0.servers, scen0.model)
    if c_values is None:
        c_values = sorted(set(list(range(1, min(c_max, 40) + 1)) + list(range(40, c_max + 1, 20))))
    sims = {c: [] for c in c_values}
    curves = {"surrogate": {}, "lower": {}, "upper": {}}
    stars = {"surrogate": [], "lower": [], "upper": [], "simulated": []}
    for r in _progress(range(runs), total=runs, desc="fig6", enabled=progress):
        scen = bloom_scenario(num_servers, eta, arrival_rate, rng=run_rng(seed, r), anchors=anchors)
        cur = c_curves(scen)
        wl = Workload.poisson(arrival_rate, jobs, run_rng(seed, r, 1))
        per_c = {}
        for c in c_values:
            per_c[c] = _sim_proposed_c(scen, c, wl, jobs // 10)
            sims[c].append(per_c[c])
        for m in curves:
            for c, v in cur[m].items():
                curves[m].setdefault(c, []).append(v)
            stars[m].append(_argmin(cur[m]))
        stars["simulated"].append(_argmin(per_c))
    sim_mean = {c: (float(np.mean(v)) if all(math.isfinite(x) for x in v) else math.inf) for c, v in sims.items()}
    curve_mean = {m: {c: (float(np.mean(v)) if all(math.isfinite(x) for x in v) else math.inf) for c, v in d.items()}
                  for m, d in curves.items()}
    return {
        "runs": runs, "jobs": jobs, "arrival_rate": arrival_rate, "c_values": list(c_values),
        "simulated": sim_mean, "curves": curve_mean,
        "c_star": {"simulated": _argmin(sim_mean), **{m: _argmin(curve_mean[m]) for m in curve_mean}},
        "c_star_per_run": stars,
    }


def fig7(*, runs: int = 20, seed: int = 0, jobs: int = 5000, lambdas: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
         c_values: Sequence[int] = tuple(range(1, 31)), num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA,
         progress: bool = True) -> dict:
    """c* vs lambda: surrogate, lower and upper bound (averaged curves) and the simulated best c."""
    anchors = simdata.get_anchors()
    rows = []
    for lam in _progress(lambdas, desc="fig7", enabled=progress):
        sims = {c: [] for c in c_values}
        curves = {"surrogate": {}, "lower": {}, "upper": {}}
        for r in range(runs):
            scen = bloom_scenario(num_servers, eta, lam, rng=run_rng(seed, r), anchors=anchors)
            for m, d in c_curves(scen).items():
                for c, v in d.items():
                    curves[m].setdefault(c, []).append(v)
            wl = Workload.poisson(lam, jobs, run_rng(seed, r, int(lam * 1000)))
            for c in c_values:
                sims[c].append(_sim_proposed_c(scen, c, wl, jobs // 10))
        sim_mean = {c: (float(np.mean(v)) if all(math.isfinite(x) for x in v) else math.inf) for c, v in sims.items()}
        row = {"lambda": lam, "simulated": _argmin(sim_mean),
               "simulated_T": sim_mean.get(_argmin(sim_mean)) if _argmin(sim_mean) else None}
        for m, d in curves.items():
            mean_d = {c: (float(np.mean(v)) if all(math.isfinite(x) for x in v) else math.inf) for c, v in d.items()}
            cs = _argmin(mean_d)
            row[m] = cs
            # the simulated mean response time at the c each method picks (inf if outside c_values or unstable)
            row[f"T_at_{m}"] = sim_mean.get(cs, None) if cs is not None else None
        rows.append(row)
    return {"runs": runs, "jobs": jobs, "c_values": list(c_values), "rows": rows}


# ------------------------------------------------------------------------------ overall / Fig. 8


def chains_service_rate(chains: Sequence[Chain]) -> float:
    """Jobs/s the chains serve when full: ``sum c_k / T_k`` (mean job size 1). At or above it the queue grows
    without bound (the proposed method's and JFFC-only's capacity)."""
    return float(sum(ch.capacity / ch.service_time for ch in chains))


def routed_service_rate_bound(scen: Scenario, placement: Mapping[str, tuple[int, int]],
                              slots: Mapping[str, int]) -> float:
    """An upper bound on the jobs/s per-request routing (PETALS, BPRR) can serve on ``placement``: at most
    ``min(sum_j slots_j / L, min_b sum_{j hosts b} slots_j)`` jobs are in service at once (a job holds one slot per
    block it is served, L in all, one of them at a server holding block b), each for at least the fastest route's
    service time ``T_min`` (mean job size 1), so throughput <= jobs / ``T_min`` (Little's law). Routes have no
    simple capacity: below the bound, stability is not known (hold-and-wait serves less)."""
    from petals_chain.algorithms.baselines import route_service_time, ws_rr_route

    L = scen.model.num_blocks
    per_block = np.zeros(L)
    for name, (a, m) in placement.items():
        per_block[a:a + m] += slots[name]
    jobs = min(sum(slots.values()) / L, float(per_block.min()))
    # WS-RR with every slot free and no waits is the route of the least service time (tau_c + tau_p m per hop)
    fastest = ws_rr_route(scen.servers, scen.model, placement, {n: L for n in placement}, {})
    return jobs / route_service_time(scen.by_name, fastest)


def overall(*, num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA, arrival_rate: float = DEFAULT_LAMBDA, runs: int = 20,
            seed: int = 0, jobs: int = 5000, policies: Sequence[str] = POLICIES, c: int = DEFAULT_C,
            petals_cache_tokens: int = 4096, bprr_r: int = 7, progress: bool = True) -> dict:
    """Mean/P95 response, wait and service per policy, averaged over ``runs`` (per-run means, then mean).

    Per policy also ``service_rate`` (chains: ``sum c_k / T_k``, mean over runs) or ``service_rate_bound`` (routed
    policies: :func:`routed_service_rate_bound`), and ``unstable_runs``: runs whose arrival rate is not below it. The
    means of an unstable run are those of its first ``jobs`` jobs only: they grow without bound with ``jobs``."""
    anchors = simdata.get_anchors()
    acc: dict[str, dict[str, list]] = {p: {"mean_response_s": [], "p95_response_s": [], "mean_wait_s": [], "mean_service_s": []}
                                       for p in policies}
    infeasible = {p: 0 for p in policies}
    rates: dict[str, list[float]] = {p: [] for p in policies}
    notes = {}
    for r in _progress(range(runs), total=runs, desc=f"overall J={num_servers} eta={eta}", enabled=progress):
        rng = run_rng(seed, r)
        scen = bloom_scenario(num_servers, eta, arrival_rate, rng=rng, anchors=anchors)
        wl = Workload.poisson(arrival_rate, jobs, run_rng(seed, r, 1))
        for p in policies:
            plan = plan_policy(p, scen, run_rng(seed, r, 2), c=c, petals_cache_tokens=petals_cache_tokens, bprr_r=bprr_r)
            if not plan.feasible:
                infeasible[p] += 1
                notes[p] = plan.note
                continue
            rates[p].append(chains_service_rate(plan.chains) if plan.chains is not None
                            else routed_service_rate_bound(scen, plan.placement, plan.slots))
            s = plan.simulate(wl, scen, run_rng(seed, r, 3), warmup=jobs // 10).summary()
            for k in acc[p]:
                acc[p][k].append(s[k])
    out = {}
    for p in policies:
        d = {}
        for k, vals in acc[p].items():
            m, h = mean_ci(vals)
            d[k] = None if not math.isfinite(m) else m
            if k == "mean_response_s":
                d["mean_response_ci_s"] = None if not math.isfinite(h) else h
        d["runs"] = len(acc[p]["mean_response_s"])
        d["infeasible_runs"] = infeasible[p]
        if rates[p]:
            routed = p in ROUTED_POLICIES
            d["service_rate_bound" if routed else "service_rate"] = float(np.mean(rates[p]))
            d["unstable_runs"] = sum(arrival_rate >= x for x in rates[p])
        if p in notes:
            d["note"] = notes[p]
        out[p] = d
    return out


def fig8(*, runs: int = 20, seed: int = 0, jobs: int = 5000, servers: Sequence[int] = (10, 20, 30, 40),
         etas: Sequence[float] = (0.1, 0.2, 0.3, 0.4), progress: bool = True,
         on_cell: Callable[[dict], None] | None = None, **overall_kw) -> dict:
    """The J x eta grid of §4.1.3: proposed (c=7) vs PETALS vs BPRR, with relative reductions."""
    cells = []
    for J in servers:
        for eta in etas:
            t0 = time.perf_counter()
            res = overall(num_servers=J, eta=eta, runs=runs, seed=seed, jobs=jobs, policies=("proposed", "petals", "bprr"),
                          progress=progress, **overall_kw)
            cell = {"servers": J, "eta": eta, "seconds": time.perf_counter() - t0, **{p: res[p] for p in res}}
            prop = res["proposed"]["mean_response_s"]
            for b in ("petals", "bprr"):
                base = res[b]["mean_response_s"]
                cell[f"reduction_vs_{b}_pct"] = (100.0 * (1 - prop / base)) if (prop and base) else None
            cells.append(cell)
            if on_cell:
                on_cell(cell)
    reds = [c[k] for c in cells for k in ("reduction_vs_petals_pct", "reduction_vs_bprr_pct") if c.get(k) is not None]
    return {"runs": runs, "jobs": jobs, "cells": cells,
            "reduction_range_pct": [min(reds), max(reds)] if reds else None,
            "paper_reduction_range_pct": PAPER["fig8_reduction_range_pct"]}


# ------------------------------------------------------------------------------------- trace


def trace_replay(*, trace_path: str | None = None, requests: int = 1000, seed: int = 0, runs: int = 1,
                 policies: Sequence[str] = (*POLICIES, "proposed-all"), service_scale: float = 1.0,
                 petals_cache_tokens: int = 4096,
                 progress: bool = True) -> dict:
    """Replay the first ``requests`` of the Azure trace on the §4.2 LLaMA-2-7B testbed model; c by the lower bound.

    Each run draws new RTTs (RIPE Atlas) for the 9 servers; arrivals and token counts are the trace's.
    ``service_scale`` multiplies every modelled time (planner and simulator alike), e.g. to match the
    mean service time measured on a real deployment.
    """
    trace = simdata.get_trace(trace_path, seed=seed)
    if requests:
        trace = trace.head(requests)
    if not math.isfinite(trace.rate):  # the planner then failed on "arrival_rate ... got inf"
        raise ValueError(f"{trace.source}: the {len(trace)} request(s) replayed arrive at one instant, so there is no "
                         "arrival rate to plan for: replay at least two requests at different times")
    anchors = simdata.get_anchors()
    acc = {p: [] for p in policies}
    cs, cs_all = [], []
    notes = {}
    for r in _progress(range(runs), total=runs, desc="trace", enabled=progress):
        scen = llama_trace_scenario(trace, rng=run_rng(seed, r), anchors=anchors, scale=service_scale)
        wl = Workload.from_lengths(trace.arrivals, trace.context_tokens, trace.generated_tokens)
        for p in policies:
            plan = plan_policy(p, scen, run_rng(seed, r, 2), c=None, petals_cache_tokens=petals_cache_tokens)
            if p == "proposed":
                cs.append(plan.c)
            if p == "proposed-all":
                cs_all.append(plan.c)
            if not plan.feasible:
                notes[p] = plan.note
                continue
            acc[p].append(plan.simulate(wl, scen, run_rng(seed, r, 3)).summary())
    out = {"source": trace.source, "requests": len(trace), "rate_per_s": trace.rate, "service_scale": service_scale,
           "petals_cache_tokens": petals_cache_tokens,
           "interarrival_std_ratio": simdata.interarrival_cv_ratio(trace.arrivals), "runs": runs,
           "c_lower_bound": cs, "c_lower_bound_all_servers": cs_all, "paper": PAPER["table1"], "policies": {}}
    for p in policies:
        if not acc[p]:
            out["policies"][p] = {"note": notes.get(p, "no runs")}
            continue
        out["policies"][p] = {k: float(np.mean([s[k] for s in acc[p]]))
                              for k in ("mean_response_s", "p95_response_s", "mean_wait_s", "mean_service_s")}
    return out


# ----------------------------------------------------------------------------------- planner


def planner_scale(num_servers: int, *, seed: int = 0, arrival_rate: float | None = None, method: str = "lower") -> dict:
    """Wall time of the full planning step (tune_capacity: c* search + GBP-CR + GCA) on a random swarm.

    The arrival rate defaults to ``0.01 * J`` req/s (the paper's 0.2 at J=20), so the load per server
    stays as in §4.1 while the swarm grows. ``service_rate``: the chains' total ``sum c_k / T_k`` (req/s);
    ``stable``: whether the arrival rate is below it (if not, the plan is the one that serves the most).
    """
    from petals_chain.algorithms import tune_capacity

    rng = np.random.default_rng(seed)
    servers = random_heterogeneous_swarm(num_servers, rng=rng)
    lam = 0.01 * num_servers if arrival_rate is None else arrival_rate
    scen_model = BLOOM_176B
    t0, p0 = time.perf_counter(), time.process_time()
    c, placement, chains = tune_capacity(servers, scen_model, lam, DEFAULT_RHO_BAR, method=method)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - p0
    # above the chains' total rate no c is stable and tune_capacity returns the plan that serves the most: say so
    # (the c and chains of a rate the swarm cannot serve read as a plan for it)
    service_rate = float(sum(ch.capacity / ch.service_time for ch in chains))
    # cpu_seconds: this process's CPU time, a fairer number than wall time on a shared machine
    return {"servers": num_servers, "seconds": seconds, "c": int(c), "chains": len(chains), "arrival_rate": lam,
            "placed_servers": len(placement), "cpu_seconds": cpu, "service_rate": service_rate,
            "stable": lam < service_rate}
