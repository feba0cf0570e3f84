#!/usr/bin/env python3
"""Simulator and planner benchmarks (printed, not asserted).

* events/s of the chain simulator (JFFC, and JSQ with per-chain FIFOs) on the paper's default swarm
  at load 0.7, and of the per-request-routed simulator (PETALS, BPRR routing on every arrival);
* wall time of the full planning step (``tune_capacity``: c* by the Theorem 3.7 lower bound +
  GBP-CR + GCA) for J = 100, 1000, 10000 random heterogeneous servers (``planner-scale``).

Usage: ``python scripts/bench_sim.py [--jobs N] [--servers 100 1000 10000] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from petals_chain.sim import experiments as ex
from petals_chain.sim.engine import Workload, simulate_chains, simulate_routed
from petals_chain.sim.scenarios import bloom_scenario, covers_all_blocks, make_dispatcher, plan_bprr, plan_petals

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402


def bench_chains(jobs: int, kind: str) -> dict:
    from petals_chain.algorithms import gbp_cr, gca

    scen = bloom_scenario(20, 0.2, 0.2, rng=np.random.default_rng(0))
    placement = gbp_cr(scen.servers, scen.model, c=7, arrival_rate=1e9, rho_bar=0.7)
    assert covers_all_blocks(placement, scen.model)
    chains = gca(scen.servers, scen.model, placement)
    nu = sum(ch.capacity / ch.service_time for ch in chains)
    wl = Workload.poisson(0.7 * nu, jobs, np.random.default_rng(1))
    p0 = time.process_time()
    res = simulate_chains(chains, make_dispatcher(kind, chains, np.random.default_rng(2)), wl, scen.cost)
    cpu = time.process_time() - p0
    return {"sim": f"chains/{kind}", "jobs": jobs, "chains": len(chains), "events": res.events, "seconds": res.wall_s,
            "cpu_seconds": cpu, "events_per_s": res.events / res.wall_s, "events_per_cpu_s": res.events / cpu}


def bench_routed(jobs: int, policy: str) -> dict:
    scen = bloom_scenario(20, 0.2, 0.2, rng=np.random.default_rng(0))
    plan = plan_petals(scen, np.random.default_rng(3)) if policy == "petals" else plan_bprr(scen)
    wl = Workload.poisson(0.2, jobs, np.random.default_rng(1))
    p0 = time.process_time()
    res = simulate_routed(plan.route_fn, plan.slots, wl, scen.cost, route_key=plan.route_key)
    cpu = time.process_time() - p0
    return {"sim": f"routed/{policy}", "jobs": jobs, "servers": len(plan.slots), "events": res.events, "seconds": res.wall_s,
            "cpu_seconds": cpu, "events_per_s": res.events / res.wall_s, "events_per_cpu_s": res.events / cpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # checked as parsed: a traceback from numpy or the swarm builder before
    p.add_argument("--jobs", type=positive_int, default=200_000, help="jobs for the chain simulator (routed: jobs/20)")
    p.add_argument("--servers", type=positive_int, nargs="*", default=[100, 1000, 10000])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = {"simulator": [], "planner": []}
    for kind in ("jffc", "jsq"):
        out["simulator"].append(bench_chains(a.jobs, kind))
    for pol in ("petals", "bprr"):
        out["simulator"].append(bench_routed(max(a.jobs // 20, 100), pol))
    for J in a.servers:
        t0 = time.perf_counter()
        try:
            out["planner"].append(ex.planner_scale(J))
        except ValueError as e:  # too few servers to hold the model, say
            print(f"error: planner J={J}: {e}", file=sys.stderr)
            return 2
        print(f"planner J={J}: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if a.json:
        print(json.dumps(out))
        return 0
    for r in out["simulator"]:
        print(f"{r['sim']:16s} {r['jobs']:8d} jobs {r['events']:9d} events {r['seconds']:7.2f} s wall "
              f"{r['events_per_s']:10,.0f} events/s wall, {r['events_per_cpu_s']:10,.0f} events/CPU-s")
    for r in out["planner"]:
        print(f"planner J={r['servers']:6d}: {r['seconds']:8.3f} s wall, {r['cpu_seconds']:8.3f} s CPU  c*={r['c']}  chains={r['chains']}  "
              f"lambda={r['arrival_rate']:g}  placed={r['placed_servers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
