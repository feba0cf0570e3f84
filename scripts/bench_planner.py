#!/usr/bin/env python3
"""Planner-scale benchmark: c* search by the Theorem 3.7 lower bound + GBP-CR + GCA, and JFFC decision time.

Random heterogeneous swarms with the paper's parameters (BLOOM-176B: L=70, s_m=1.32 GB, s_c=0.11 GB;
a fraction eta of fast servers with 40 GB / 109 ms per block, the rest 20 GB / 175 ms;
tau_c = RTT + 18 ms with RTT uniform in [5, 100] ms as a stand-in for RIPE Atlas). ``rate/s`` (JSON
``service_rate``): the chains' total rate ``sum c_k / T_k``; a lambda at or above it is marked unstable (``stable``).

    python scripts/bench_planner.py [--servers 100 1000 10000] [--arrival-rate 0.2] [--spare-servers use] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from petals_chain.algorithms import JFFCDispatcher, ModelSpec, ServerSpec, tune_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, positive_int  # noqa: E402

BLOOM = ModelSpec(num_blocks=70, block_size=1.32, cache_size=0.11)


def random_swarm(J: int, eta: float = 0.2, seed: int = 0) -> list[ServerSpec]:
    rng = random.Random(seed)
    servers = []
    for j in range(J):
        fast = rng.random() < eta
        rtt = rng.uniform(0.005, 0.100)
        servers.append(ServerSpec(f"s{j}", 40.0 if fast else 20.0, rtt + 0.018, 0.109 if fast else 0.175))
    return servers


def time_planner(J: int, arrival_rate: float, rho_bar: float, method: str, seed: int = 0,
                 use_all_servers: bool = False) -> dict:
    servers = random_swarm(J, seed=seed)
    t0, p0 = time.perf_counter(), time.process_time()
    c, placement, chains = tune_capacity(servers, BLOOM, arrival_rate, rho_bar, method, use_all_servers=use_all_servers)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - p0
    # at or above the chains' total rate tune_capacity returns the plan that serves the most: not a plan for the rate
    service_rate = float(sum(ch.capacity / ch.service_time for ch in chains))
    return {"servers": J, "seconds": elapsed, "cpu_seconds": cpu, "c": c, "chains": len(chains),
            "placed": len(placement), "arrival_rate": arrival_rate, "service_rate": service_rate,
            "stable": arrival_rate < service_rate}


def time_jffc(K: int = 10_000, ops: int = 200_000, seed: int = 0) -> dict:
    rng = random.Random(seed)
    d = JFFCDispatcher([(rng.uniform(0.05, 0.2), rng.randint(1, 10)) for _ in range(K)])
    busy: list[int] = []
    # fill to about capacity so decisions hit both the free-chain heap and the central queue
    t0 = time.process_time()
    for i in range(ops):
        if busy and rng.random() < 0.5:
            k = busy.pop(rng.randrange(len(busy)))
            if d.complete(k) is not None:
                busy.append(k)
        else:
            k = d.arrive(i)
            if k is not None:
                busy.append(k)
    elapsed = time.process_time() - t0
    return {"chains": K, "operations": ops, "us_per_decision": elapsed / ops * 1e6, "queue_length": d.queue_length}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=positive_int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--arrival-rate", type=nonnegative_float, nargs="+", default=[0.2])
    ap.add_argument("--rho-bar", type=float, default=0.7)
    ap.add_argument("--method", choices=["lower", "upper", "surrogate"], default="lower")
    ap.add_argument("--jffc-chains", type=positive_int, default=10_000)
    ap.add_argument("--spare-servers", choices=["idle", "use"], default="idle",
                    help="use: GBP-CR places every server (the orchestrator's default, --spare-servers use)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not 0 < args.rho_bar <= 1:  # (the other numbers are checked as parsed)
        ap.error("--rho-bar must be in (0, 1]")
    try:
        rows = [time_planner(J, lam, args.rho_bar, args.method, use_all_servers=args.spare_servers == "use")
                for lam in args.arrival_rate for J in args.servers]
    except ValueError as e:  # the planner's: too few servers to hold the model, say
        print(f"error: {e}", file=sys.stderr)
        return 2
    jffc = time_jffc(args.jffc_chains)
    if args.json:
        print(json.dumps({"planner": rows, "jffc": jffc}))
        return 0
    print(f"{'J':>7} {'lambda':>8} {'wall s':>9} {'cpu s':>9} {'c*':>5} {'chains':>7} {'placed':>7} {'rate/s':>9}")
    for r in rows:
        print(f"{r['servers']:>7} {r['arrival_rate']:>8g} {r['seconds']:>9.3f} {r['cpu_seconds']:>9.3f} {r['c']:>5} "
              f"{r['chains']:>7} {r['placed']:>7} {r['service_rate']:>9.3f}" + ("" if r["stable"] else "  UNSTABLE"))
    if not all(r["stable"] for r in rows):
        print("UNSTABLE: lambda is not below the chains' total rate (rate/s) at any c: the queue grows without bound; "
              "the plan shown is the one that serves the most")
    print(f"JFFC at {jffc['chains']} chains: {jffc['us_per_decision']:.2f} us (CPU) per arrive/complete "
          f"({jffc['operations']} operations, final queue {jffc['queue_length']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
