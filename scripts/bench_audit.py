"""Verified chains, measured (issue 21): honest false positives, audits to catch a liar, and what auditing costs.

Real processes on loopback: an orchestrator and ``--servers`` servers that each hold the whole model (so every
span has two other holders: an auditor and a referee); the tiny random-weight Llama by default, ``--model`` for
another (e.g. ``smollm2-135m``).

1. **False positives**: honest servers, ``--audit-rate 1``; closed-loop clients until ``--audits`` steps were
   audited. Printed: audits, strikes and bans among honest servers (target 0), the distribution of the relative
   error between servers that agreed (the tolerance's margin).
2. **Detection**: one server adds noise to ``--faulty-rate`` of its replies (``--emulate-faulty-rate``) and
   announces the best ``tau_p`` (so it serves); ``--audit-rate`` ``--detect-rate``. Per trial (a fresh swarm):
   seconds and audits of the liar until its ban, strikes on honest servers. ``--trials`` trials.
3. **Cost**: honest servers under ``--clients`` closed-loop clients for ``--cost-s`` seconds at each audit rate
   of ``--cost-rates`` (a fresh swarm each, same workload): tokens/s side by side, ratio to rate 0.

    python scripts/bench_audit.py [--audits 10000] [--trials 3] [--cost-rates 0,0.02,0.1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import name_list, output_file, positive_float, positive_int, probability, probability_list  # noqa: E402

PHASES = ("fp", "detect", "cost")


def swarm(args, audit_rate: float, faulty: float | None, logs: str):
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for, model_memory

    L, _, _ = model_memory(args.model, args.max_length)
    mem = memory_for(args.model, args.max_length, L, args.slots)
    servers = []
    for i in range(args.servers):
        extra, tau = [], 0.002
        if faulty is not None and i == 0:
            extra, tau = ["--emulate-faulty-rate", str(faulty)], 0.001
        if args.server_dtype:
            extra = [*extra, "--dtype", args.server_dtype]
        servers.append(LocalServer("liar" if faulty is not None and i == 0 else f"honest{i}", mem, tau_p=tau,
                                   extra_args=extra))
    return LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs,
                      orchestrator_args=["--audit-rate", str(audit_rate), "--replan-interval-s", "3600"])


def load(sw, args, stop: threading.Event, clients: int) -> dict:
    """Closed-loop clients until ``stop``; returns requests and generated tokens."""
    done = {"requests": 0, "tokens": 0}
    lock = threading.Lock()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 700, size=int(n)).tolist() for n in rng.integers(4, 24, size=16)]

    def worker(k: int) -> None:
        c = sw.client(timeout=300)
        i = k
        while not stop.is_set():
            comp = c.complete(prompts[i % len(prompts)], max_tokens=args.max_tokens, ignore_eos=True)
            i += clients
            with lock:
                done["requests"] += 1
                done["tokens"] += len(comp.token_ids)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    return {"threads": threads, "done": done}


def false_positives(args) -> dict:
    with tempfile.TemporaryDirectory() as logs, swarm(args, 1.0, None, logs) as sw:
        sw.wait_ready(timeout=600)
        stop = threading.Event()
        run = load(sw, args, stop, args.clients)
        t0 = time.time()
        while True:
            time.sleep(2)
            a = sw.swarm()["audit"]
            print(f"  {a['audits']} audits ({a['agreed']} agreed, {a['disagreed']} disagreed), "
                  f"{time.time() - t0:.0f} s", flush=True)
            if a["audits"] >= args.audits or time.time() - t0 > args.max_s:
                break
        stop.set()
        for t in run["threads"]:
            t.join(timeout=120)
        st = sw.swarm()
    trust = {s["public_name"]: s["trust"] for s in st["servers"]}
    a = st["audit"]
    return {"audits": a["audits"], "agreed": a["agreed"], "disagreed": a["disagreed"],
            "inconclusive": a["inconclusive"], "strikes": a["strikes"], "bans": a["bans"],
            "max_agreeing_error": a["max_agreeing_error"], "skipped": {k: v for k, v in a.items()
                                                                        if k.startswith("skipped")},
            "trust": trust, "requests": run["done"]["requests"], "seconds": time.time() - t0,
            "error_quantiles": a["error_quantiles"]}


def detection(args) -> list[dict]:
    out = []
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory() as logs, swarm(args, args.detect_rate, args.faulty_rate, logs) as sw:
            sw.wait_ready(timeout=600)
            stop = threading.Event()
            run = load(sw, args, stop, 1)  # one client: its requests go to the fastest chain, the liar's
            t0 = time.time()
            st = sw.swarm()
            while time.time() - t0 < args.max_s:
                time.sleep(1)
                st = sw.swarm()
                if st["audit"]["bans"]:
                    break
            stop.set()
            for t in run["threads"]:
                t.join(timeout=120)
            trust = {s["public_name"]: s["trust"] for s in st["servers"]}
            row = {"trial": trial, "banned": st["audit"]["banned"], "seconds": time.time() - t0,
                   "liar_audits": trust["liar"]["audits"], "liar_strikes": trust["liar"]["strikes"],
                   "honest_strikes": sum(v["strikes"] for k, v in trust.items() if k != "liar"),
                   "requests": run["done"]["requests"]}
            print(f"  trial {trial}: {row}", flush=True)
            out.append(row)
    return out


def cost(args) -> dict:
    res = {}
    for rate in args.cost_rates:
        with tempfile.TemporaryDirectory() as logs, swarm(args, rate, None, logs) as sw:
            sw.wait_ready(timeout=600)
            sw.client().complete([1, 2, 3], max_tokens=2)  # warm-up
            stop = threading.Event()
            run = load(sw, args, stop, args.clients)
            time.sleep(args.cost_s)
            stop.set()
            for t in run["threads"]:
                t.join(timeout=120)
            a = sw.swarm()["audit"]
        res[rate] = {"tokens_per_s": run["done"]["tokens"] / args.cost_s, "audits": a["audits"],
                     "requests": run["done"]["requests"]}
        print(f"  audit rate {rate:g}: {res[rate]}", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or short name (default: a tiny random-weight Llama)")
    p.add_argument("--servers", type=positive_int, default=3)
    p.add_argument("--slots", type=positive_int, default=6)
    p.add_argument("--max-length", type=positive_int, default=128)
    p.add_argument("--max-tokens", type=positive_int, default=24)
    p.add_argument("--clients", type=positive_int, default=4)
    p.add_argument("--audits", type=positive_int, default=10_000, help="audited steps for the false-positive count")
    p.add_argument("--max-s", type=positive_float, default=1800.0, help="time limit of each phase")
    p.add_argument("--faulty-rate", type=probability, default=0.1)
    p.add_argument("--detect-rate", type=probability, default=0.1, help="--audit-rate of the detection trials")
    p.add_argument("--trials", type=positive_int, default=3)
    p.add_argument("--cost-rates", type=probability_list, default="0,0.02,0.1")
    p.add_argument("--cost-s", type=positive_float, default=60.0)
    p.add_argument("--phases", type=name_list(PHASES), default="fp,detect,cost")
    p.add_argument("--server-dtype", default=None, help="servers' --dtype (e.g. bfloat16: the 16-bit tolerance)")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args()
    if args.model is None:
        from petals_chain.swarm.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench_audit_")) / "tiny", family="llama",
                                          num_layers=4))
    phases = args.phases
    out: dict = {"args": vars(args)}
    if "fp" in phases:
        print("1. honest servers, every step audited ...", flush=True)
        out["false_positives"] = fp = false_positives(args)
        print(f"honest: {fp['audits']} audits, {fp['disagreed']} disagreements, {fp['strikes']} strikes, "
              f"{fp['bans']} bans; relative error between servers {fp['error_quantiles']}")
    if "detect" in phases:
        print(f"2. a server corrupting {args.faulty_rate:g} of its replies, audit rate {args.detect_rate:g} ...",
              flush=True)
        out["detection"] = det = detection(args)
        caught = [r for r in det if r["banned"] == ["liar"]]
        if caught:
            print(f"caught in {len(caught)}/{len(det)} trials: audits of the liar until its ban "
                  f"{[r['liar_audits'] for r in caught]} (mean {statistics.mean(r['liar_audits'] for r in caught):.0f}),"
                  f" seconds {[round(r['seconds']) for r in caught]}; honest strikes "
                  f"{sum(r['honest_strikes'] for r in det)}")
    if "cost" in phases:
        print("3. throughput at each audit rate ...", flush=True)
        out["cost"] = c = cost(args)
        base = c.get(0.0, next(iter(c.values())))["tokens_per_s"]
        for rate, r in c.items():
            print(f"audit rate {rate:g}: {r['tokens_per_s']:.1f} tokens/s ({r['tokens_per_s'] / base:.3f}x rate 0), "
                  f"{r['audits']} audits")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
