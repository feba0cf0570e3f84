"""HERD's server-group split ILP against brute force on random small instances.

    python scripts/check_herd_split.py --seeds 1 2 3 --instances 2000
    python scripts/check_herd_split.py --previous --instances 800    # with a random previous split (moves phase)

Prints every instance where ``solve_server_groups`` returns None, covers fewer groups than brute force, or finds a
lower worst burst tolerance (beyond the solver's 1e-3 gap; with ``--previous``, beyond the 10 % moves margin).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from petals_chain.algorithms.herd import (GroupServer, brute_force_server_groups,  # noqa: E402
                                          solve_server_groups, split_score)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402


def search(seed: int, instances: int, with_previous: bool) -> dict:
    rng = random.Random(seed)
    misses, nones = [], []
    t0 = time.perf_counter()
    for _ in range(instances):
        n = rng.randint(1, 6)
        blocks = [rng.randint(0, 6) for _ in range(n)]
        thr = [rng.choice([0.5, 1.5, rng.uniform(0.5, 20)]) for _ in range(n)]
        demand = {"ABC"[j]: rng.choice([0.0, 0.3, 1.0, 2.5, rng.uniform(0, 3)]) for j in range(rng.randint(1, 3))}
        L = rng.randint(1, 6)
        servers = [GroupServer(f"s{i}", b, t) for i, (b, t) in enumerate(zip(blocks, thr))]
        previous = {s.peer_id: rng.choice("ABCD") for s in servers} if with_previous else None
        case = {"blocks": blocks, "throughputs": thr, "demand": demand, "L": L, "previous": previous}
        split = solve_server_groups(servers, demand, L, previous)
        if split is None:
            nones.append(case)
            continue
        got, want = split_score(servers, demand, L, split), brute_force_server_groups(servers, demand, L)
        slack = 0.1 if with_previous else 1e-3
        if got[0] != want[0] or got[1] < want[1] * (1 - slack) - 1e-9:
            misses.append({**case, "got": got, "brute_force": want})
    return {"seed": seed, "instances": instances, "misses": misses, "none": nones,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    # (a negative count checked nothing and exited 0, as if every instance had passed)
    ap.add_argument("--instances", type=positive_int, default=1000)
    ap.add_argument("--previous", action="store_true", help="give each solve a random previous split")
    args = ap.parse_args()
    bad = 0
    for seed in args.seeds:
        r = search(seed, args.instances, args.previous)
        bad += len(r["misses"]) + len(r["none"])
        print(json.dumps(r))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
