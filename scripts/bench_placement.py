"""Several models on shared servers under a traffic shift (issue 17, seed 001): ``--model-placement ui`` (unserved
index + adaptive replacement) against a fixed plan (``static``: re-placed once, for the first traffic seen) and
round-robin (``even``), and ``--schedule db`` (doubling budget) against ``fcfs``, on real processes.

Two models behind one orchestrator (tiny 4-layer Llama ``alpha`` and Qwen2 ``beta``; ``--alpha``/``--beta`` put a
real one, e.g. SmolLM2, in either place); ``--servers`` servers each offer both (``--model ALPHA --model BETA``) and
emulate a slow device (``--decode-ms`` per block per token). Requests arrive open-loop (Poisson): first
``--phase-s`` seconds mostly on alpha (``--hi`` req/s on alpha, ``--lo`` on beta), then the mix flips; a
``--long-frac`` of them ask for ``--long-tokens`` tokens, the rest for ``--max-tokens``. The same requests are
replayed for each run (``--runs POLICY[@INDEX]:SCHEDULE[:K],...``; ``INDEX``: ``--placement-index``, analytic
or simulated; ``K``: ``--schedule-classes``, default the orchestrator's) on a fresh swarm. ``--burst N``: the busy
model's requests come in bursts of ``N`` at once (burst times Poisson at ``hi / N``: the same mean rate), the
traffic the M/M/C index cannot see and the simulated one replays.

Printed per policy and phase: requests, failures, normalized latency (Eq. 1: each request's response time over its
model's mean execution time ``L̂_s``, the median ``service_s`` of that model over all runs; and per class, each
(model, max_tokens) kind of request over its own median, the seed's services), P99 response, SLO attainment
(response < 5 x the request's own execution time, Eq. 5), the servers per model at the end of the phase and the
moves made; the ratio of normalized latencies after the shift is the acceptance number (seed 001: adaptive <= 1/1.3
of a fixed plan's). Every output is checked token-exact against transformers.

    python scripts/bench_placement.py [--runs ui:fcfs,static:fcfs,ui:db] [--servers 4] [--phase-s 60] [--hi 4.0]
    python scripts/bench_placement.py --runs ui:fcfs,ui@simulated:fcfs --burst 12
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fairness import arrivals  # noqa: E402 - shared with the fairness benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, nonnegative_int, positive_float, positive_int, probability  # noqa: E402

PROMPT = [5, 6, 7, 8, 9]


async def replay(url: str, plan: list[tuple[float, str, int]]) -> list[dict]:
    """Send ``plan``'s requests ``(time, model, max_tokens)`` at their times; per request: model, sent, response
    time, reply."""
    import httpx

    limits = httpx.Limits(max_connections=len(plan) + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()

        async def one(at: float, model: str, max_tokens: int) -> dict:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter() - t0
            r = await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True})
            out = {"model": model, "sent": sent, "response": time.perf_counter() - t0 - sent, "status": r.status_code,
                   "max_tokens": max_tokens}
            if r.status_code == 200:
                info = r.json()["petals_chain"][0]
                out.update(tokens=info["token_ids"], service_s=info["service_s"], wait_s=info["wait_s"])
            return out

        return list(await asyncio.gather(*(one(*req) for req in plan)))


def placement(sw) -> dict:
    return sw.swarm().get("model_placement", {})


def run_policy(policy: str, schedule: str, paths: dict, plan: list[tuple[float, str, int]], args, log_dir: Path,
               classes: str = "", index: str = "analytic") -> dict:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for, model_memory

    memory = max(memory_for(path, 64, model_memory(path, 64)[0], args.slots) for path in paths.values())
    servers = [LocalServer(f"s{i}", memory, tau_p=args.decode_ms / 1000 * (args.max_tokens + 1),
                           model=[str(paths["alpha"]), str(paths["beta"])],
                           extra_args=["--emulate-decode-ms", str(args.decode_ms), "--kv-cache", args.kv_cache])
               for i in range(args.servers)]
    sw = LocalSwarm(paths["alpha"], servers, max_length=64, log_dir=log_dir / f"{policy}-{index}-{schedule}",
                    models=paths,
                    orchestrator_args=["--model-placement", policy, "--schedule", schedule, "--placement-index", index,
                                       "--replace-interval-s", str(args.interval_s),
                                       "--placement-window-s", str(args.window_s), "--model-reload-s", "2",
                                       "--audit-rate", "0", "--audit-probe-s", "0"]
                    + (["--schedule-classes", classes] if classes else []))
    with sw:
        sw.wait_until(lambda s: sum(s.get("model_placement", {}).get("servers_per_model", {}).values())
                      == args.servers, 180, "every server placed")
        for name in paths:
            sw.wait_until(lambda s, n=name: any(m["name"] == n and m["chains"] for m in s["models"]), 180,
                          f"a chain of {name}")
        # every server loaded and in a chain (whole-model servers: a chain each) before the clock starts: a
        # SmolLM2 server still loading its blocks would take the CPU from the others in the first phase
        until = time.monotonic() + 300
        while sum(m["chains"] for m in sw.swarm()["models"]) < args.servers and time.monotonic() < until:
            time.sleep(1.0)
        at_start = placement(sw)["servers_per_model"]
        half = [(t, m, n) for t, m, n in plan if t < args.phase_s]
        results = asyncio.run(replay(sw.url, half))
        mid = placement(sw)
        rest = [(t - args.phase_s, m, n) for t, m, n in plan if t >= args.phase_s]
        after = asyncio.run(replay(sw.url, rest))
        end = placement(sw)
        scheds = [sw.swarm(name).get("schedule", {}) for name in paths]  # pauses, starvation promotions
    for r in after:
        r["sent"] += args.phase_s
    name = policy + ("" if index == "analytic" else f"@{index}") + f":{schedule}" + (f":{classes}" if classes else "")
    return {"policy": policy, "schedule": schedule, "name": name, "results": results + after, "start": at_start,
            "mid": mid["servers_per_model"],
            "end": end["servers_per_model"], "moves": end.get("moves", 0), "recent": end.get("recent", []),
            "replans": end.get("replans", []), "pauses": sum(sc.get("paused", 0) for sc in scheds),
            "promotions": sum(sc.get("starvation_promotions", 0) for sc in scheds)}


def summarize(run: dict, phase: int, exec_s: dict, phase_s: float, expected: dict, class_s: dict) -> dict:
    rs = [r for r in run["results"] if (r["sent"] >= phase_s) == (phase == 2)]
    ok = [r for r in rs if r["status"] == 200]
    wrong = [r for r in ok if r["tokens"] != expected[r["model"]][:r["max_tokens"]]]
    norm = [r["response"] / exec_s[r["model"]] for r in ok]
    by_class = [r["response"] / class_s[(r["model"], r["max_tokens"])] for r in ok]
    slo = [r["response"] < 5.0 * r["service_s"] for r in ok]
    return {"requests": len(rs), "failed": len(rs) - len(ok), "wrong": len(wrong),
            "norm_latency": statistics.fmean(norm) if norm else float("nan"),
            "norm_latency_class": statistics.fmean(by_class) if by_class else float("nan"),
            "p99_s": float(np.percentile([r["response"] for r in ok], 99)) if ok else float("nan"),
            "slo": sum(slo) / len(slo) if slo else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="ui:fcfs,static:fcfs,ui:db",
                   help="POLICY:SCHEDULE[:K] (K: --schedule-classes), one swarm each")
    # numbers checked as parsed, before models are built: a zero rate or burst was a ZeroDivisionError in arrivals
    p.add_argument("--servers", type=positive_int, default=4)
    p.add_argument("--slots", type=positive_int, default=2,
                   help="KV slots per block of each server (chain concurrency)")
    p.add_argument("--kv-cache", choices=["slots", "paged"], default="slots",
                   help="the servers' KV cache: slots (a pause recomputes the paused job's KV) or paged (kept as a "
                        "cached prefix)")
    p.add_argument("--phase-s", type=positive_float, default=60.0)
    p.add_argument("--hi", type=positive_float, default=4.0, help="req/s on the busy model")
    p.add_argument("--lo", type=positive_float, default=0.3, help="req/s on the quiet model")
    p.add_argument("--decode-ms", type=nonnegative_float, default=25.0)
    p.add_argument("--max-tokens", type=positive_int, default=8)
    p.add_argument("--long-tokens", type=positive_int, default=40)
    p.add_argument("--long-frac", type=probability, default=0.15)
    p.add_argument("--interval-s", type=positive_float, default=60.0, help="--replace-interval-s")
    p.add_argument("--window-s", type=positive_float, default=15.0, help="--placement-window-s")
    p.add_argument("--burst", type=positive_int, default=1, metavar="N",
                   help="the busy model's requests in bursts of N (same mean rate; 1: Poisson)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--alpha", default="tiny", metavar="tiny|NAME|PATH",
                   help="model alpha: a tiny random 4-layer Llama, or a real one (a registry name such as "
                        "smollm2-135m, fetched by scripts/setup.sh, or a path)")
    p.add_argument("--beta", default="tiny", metavar="tiny|NAME|PATH", help="model beta: a tiny Qwen2, or as --alpha")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from petals_chain.swarm.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    from petals_chain.swarm.registry import REGISTRY, registry_path

    def model(name: str, which: str, family: str) -> Path:
        if which == "tiny":
            return Path(build_tiny_model(tmp / name, family=family, num_layers=4))
        return registry_path(which) if which in REGISTRY else Path(which)

    paths = {"alpha": model("alpha", args.alpha, "llama"), "beta": model("beta", args.beta, "qwen2")}
    from conftest import hf_greedy_from

    longest = max(args.max_tokens, args.long_tokens)
    expected = {n: hf_greedy_from(path, PROMPT, longest) for n, path in paths.items()}
    rng = np.random.default_rng(args.seed)
    def busy(rate: float) -> list[float]:
        return [t for t in arrivals(rate / args.burst, args.phase_s, rng) for _ in range(args.burst)]

    times = sorted([(t, "alpha") for t in busy(args.hi)]
                   + [(t, "beta") for t in arrivals(args.lo, args.phase_s, rng)]
                   + [(args.phase_s + t, "alpha") for t in arrivals(args.lo, args.phase_s, rng)]
                   + [(args.phase_s + t, "beta") for t in busy(args.hi)])
    plan = [(t, m, args.long_tokens if rng.random() < args.long_frac else args.max_tokens) for t, m in times]
    print(f"{len(plan)} requests: {args.phase_s:.0f} s at alpha {args.hi}/s + beta {args.lo}/s, then flipped; "
          f"{args.servers} servers offering both, {args.decode_ms} ms per block per token"
          + (f"; the busy model's in bursts of {args.burst}" if args.burst > 1 else ""), flush=True)
    runs = []
    for pair in args.runs.split(","):
        policy, _, rest = pair.partition(":")
        policy, _, index = policy.partition("@")
        schedule, _, classes = rest.partition(":")
        t0 = time.time()
        runs.append(run_policy(policy, schedule or "fcfs", paths, plan, args, tmp / "logs", classes,
                               index or "analytic"))
        print(f"  {pair}: ran in {time.time() - t0:.0f} s; servers per model at start {runs[-1]['start']}, after "
              f"phase 1 {runs[-1]['mid']}, at the end {runs[-1]['end']}; moves {runs[-1]['moves']}; pauses "
              f"{runs[-1]['pauses']}, starvation promotions {runs[-1]['promotions']}", flush=True)
        for m in runs[-1]["recent"]:
            print(f"      move {m['server'][:10]} {m['from']} -> {m['to']} ({m['why']})", flush=True)
        for r in runs[-1]["replans"]:
            print(f"      re-plan ({r['why']}; {r.get('index')} index, {r.get('replayed')} requests replayed, "
                  f"step cost (a, b, d) {r.get('step_cost')}, {r.get('decide_s')} s): "
                  f"rates {r['rates']}, servers {r['servers_per_model']}, target "
                  f"{r['target']}, {r['moves']} moves; predicted (misses, L_N) now {r.get('predicted_now')}, "
                  f"at the target {r.get('predicted_target')}; block time {r.get('block_time_s')}, slots "
                  f"{r.get('slots')}, speeds {r.get('speeds')}", flush=True)
    exec_s = {n: statistics.median([r["service_s"] for run in runs for r in run["results"]
                                    if r["model"] == n and r["status"] == 200]) for n in paths}
    kinds = {(r["model"], r["max_tokens"]) for run in runs for r in run["results"] if r["status"] == 200}
    class_s = {k: statistics.median([r["service_s"] for run in runs for r in run["results"]
                                     if (r["model"], r["max_tokens"]) == k and r["status"] == 200]) for k in kinds}
    print("L̂_s (median execution time): " + ", ".join(f"{n} {v:.3f} s" for n, v in exec_s.items())
          + "; per class: " + ", ".join(f"{m}/{n} tokens {v:.3f} s" for (m, n), v in sorted(class_s.items())))
    print("| placement:schedule | phase | requests | failed | wrong tokens | normalized latency | by class | P99 (s) | "
          "SLO attainment |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = {}
    for run in runs:
        for phase in (1, 2):
            s = summarize(run, phase, exec_s, args.phase_s, expected, class_s)
            table[(run["name"], phase)] = s
            print(f"| {run['name']} | {'alpha-heavy' if phase == 1 else 'beta-heavy (after the shift)'} | "
                  f"{s['requests']} | {s['failed']} | {s['wrong']} | {s['norm_latency']:.2f} | "
                  f"{s['norm_latency_class']:.2f} | {s['p99_s']:.2f} | "
                  f"{100 * s['slo']:.1f} % |")
    names = [r["name"] for r in runs]
    pairs = [("ui:fcfs", "static:fcfs", "adaptive replacement / fixed plan, acceptance <= 0.769")]
    pairs += [(n, "ui:fcfs", "DB / FCFS, seed: <= 0.5") for n in names if n.startswith("ui:db")]
    pairs += [(n, n.replace("@simulated", ""), "simulated / analytic unserved index") for n in names
              if "@simulated" in n]
    for a, b, what in pairs:
        if a in names and b in names:
            for key, label in (("norm_latency", "normalized latency"), ("norm_latency_class", "by class")):
                after = table[(a, 2)][key] / table[(b, 2)][key]
                both = (table[(a, 1)][key] + table[(a, 2)][key]) / (table[(b, 1)][key] + table[(b, 2)][key])
                print(f"{label} {a} / {b}: after the shift {after:.3f}, both phases {both:.3f} ({what})")
    bad = sum(s["failed"] + s["wrong"] for s in table.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
