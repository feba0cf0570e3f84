"""Goodput at overload on a real swarm: deadline-aware ``--schedule edf`` vs the paper's FCFS-JFFC (issue 18).

Real processes: an orchestrator and ``--servers`` servers on loopback, each link delayed by ``--rtt-ms`` (emulated,
per message), ``--kv-cache slots`` so every chain runs a fixed number of jobs. First a probe measures the service
time ``S`` of one request alone (``--max-tokens`` greedy tokens) and the chains' capacity; requests then arrive
open-loop (Poisson) at ``--overload`` x the swarm's capacity ``sum c_k / S``, each with ``deadline_ms`` =
``--slo`` x ``S`` (time to its last token). The same arrival times are replayed in each mode, on a fresh swarm:

* ``fcfs`` — ``--schedule fcfs`` and every request ``best_effort``: the behaviour before deadlines existed (FIFO,
  every request served however late; the outcome is only measured);
* ``edf`` — ``--schedule edf``: earliest deadline first, a request predicted to miss refused at once (429
  ``deadline_unreachable``), a queued one whose deadline passed dropped (504);
* ``flex`` — ``--schedule flex``: ``edf``, and a request that would miss takes the slot of a running request
  without a deadline, paused between two steps and resumed later (seed 003's best-effort lane).

``--background N`` adds N clients that send long requests without a deadline (``--background-tokens`` each) in a
closed loop for the whole window, the batch work that shares the swarm with the interactive requests: their
completed tokens per second are printed too (what pausing costs them).

Printed per mode: goodput (requests that met their deadline per second of the arrival window), SLO attainment over
all requests, refused / dropped / missed, and how fast refusals came back (client-side round trip); the ratio of
goodputs is the acceptance number (seed 003: FLEX goodput >= 1.5x FCFS-JFFC at 2x overload).

    python scripts/bench_deadlines.py [--model PATH|smollm2-135m] [--duration-s 40] [--overload 2] [--slo 4]
    python scripts/bench_deadlines.py --modes edf,flex --background 2 --kv-cache paged ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import name_list, nonnegative_int, output_file, positive_float, positive_int  # noqa: E402
from bench_fairness import add_testbed_args, arrivals, model_and_prompt  # noqa: E402 - shared with bench_fairness


async def replay(url: str, model: str, plan: list[float], body: dict) -> list[dict]:
    """Send one request at each time of ``plan``; per request: sent, latency, HTTP status, deadline report."""
    import httpx

    limits = httpx.Limits(max_connections=len(plan) + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()

        async def one(at: float) -> dict:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter() - t0
            r = await c.post("/v1/completions", json={"model": model, **body})
            out = {"sent": sent, "latency": time.perf_counter() - t0 - sent, "status": r.status_code}
            js = r.json()
            out["deadline"] = js.get("deadline")
            out["code"] = (js.get("error") or {}).get("code")
            return out

        return await asyncio.gather(*(one(t) for t in plan))


async def background(url: str, model: str, clients: int, body: dict, duration_s: float) -> dict:
    """``clients`` closed loops of long requests without a deadline for ``duration_s``: tokens of the requests
    completed within the window, and how many completed."""
    import httpx

    done = {"requests": 0, "tokens": 0, "errors": 0}
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        t0 = time.perf_counter()

        async def loop() -> None:
            while time.perf_counter() - t0 < duration_s:
                r = await c.post("/v1/completions", json={"model": model, **body})
                if time.perf_counter() - t0 > duration_s:
                    return
                if r.status_code == 200:
                    done["requests"] += 1
                    done["tokens"] += r.json()["usage"]["completion_tokens"]
                else:
                    done["errors"] += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    return done


async def run_mode(url: str, model: str, plan: list[float], body: dict, clients: int, bg_body: dict,
                   duration_s: float) -> tuple[list[dict], dict]:
    bg = asyncio.ensure_future(background(url, model, clients, bg_body, duration_s)) if clients else None
    if bg is not None:
        await asyncio.sleep(min(2.0, duration_s / 10))  # the batch work is running when interactive requests come
    res = await replay(url, model, plan, body)
    return res, (await bg if bg is not None else {})


def start_swarm(args, schedule: str, logs: str):
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for, model_memory

    L, _, _ = model_memory(args.model, args.max_length)
    extra = ("--kv-cache", args.kv_cache, "--emulate-rtt-ms", str(args.rtt_ms))
    servers = [LocalServer(f"s{i}", memory_for(args.model, args.max_length, L, args.slots), extra_args=extra)
               for i in range(args.servers)]
    return LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs,
                      orchestrator_args=["--schedule", schedule, "--max-queue", "100000"])


def outcome(r: dict) -> str:
    if r["status"] == 429 and r["code"] in ("deadline_unreachable", "deadline_infeasible"):
        return "refused"
    if r["status"] == 504 and r["code"] == "deadline_exceeded":
        return "dropped"
    if r["status"] != 200:
        return f"error {r['status']} {r['code']}"
    return r["deadline"]["outcome"]


MODES = ("fcfs", "edf", "flex")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or short name (default: a tiny random-weight Llama)")
    # checked as parsed, before any work: ``--overload 0`` divided by zero, and ``--modes`` with a typo failed to
    # start its orchestrator, both after the probe's swarm
    add_testbed_args(p)
    p.add_argument("--overload", type=positive_float, default=2.0, help="offered load / capacity")
    p.add_argument("--slo", type=positive_float, default=4.0, help="deadline = SLO x the service time alone")
    p.add_argument("--duration-s", type=positive_float, default=40.0, help="arrival window per mode")
    p.add_argument("--modes", type=name_list(MODES), default="fcfs,edf", help="comma-separated: fcfs, edf, flex")
    p.add_argument("--background", type=nonnegative_int, default=0, metavar="N",
                   help="clients of long requests without a deadline, in a closed loop")
    p.add_argument("--background-tokens", type=positive_int, default=96)
    p.add_argument("--kv-cache", choices=["slots", "paged"], default="slots",
                   help="the servers' KV cache (paged keeps a paused request's KV as a cached prefix)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the raw results here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_deadlines_"))
    rng = np.random.default_rng(args.seed)
    prompt = model_and_prompt(args, work, rng)
    base = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

    # 1. service time alone and capacity
    with tempfile.TemporaryDirectory() as logs, start_swarm(args, "fcfs", logs) as sw:
        st = sw.wait_ready(timeout=900)
        model, capacity = st["model"], sum(ch["capacity"] for ch in st["chains"])
        probe = asyncio.run(replay(sw.url, model, [0.0], base))  # warm-up
        probe = [asyncio.run(replay(sw.url, model, [0.0], base))[0] for _ in range(5)]
    service = statistics.median(r["latency"] for r in probe)
    cap_rate = capacity / service
    rate = args.overload * cap_rate
    deadline_ms = args.slo * service * 1000.0
    plan = arrivals(rate, args.duration_s, rng)
    if not plan:  # (the ratios below divided by zero)
        print(f"error: no request arrives in --duration-s {args.duration_s:g} at {rate:.3g} req/s", file=sys.stderr)
        return 2
    print(f"capacity {capacity} jobs, service alone {service:.3f} s -> {cap_rate:.2f} req/s; offered {rate:.2f} req/s "
          f"({args.overload:g}x), deadline {deadline_ms:.0f} ms ({args.slo:g}x service), {len(plan)} requests",
          flush=True)

    modes = args.modes
    runs, summ = {}, {}
    for mode in modes:
        body = {**base, "deadline_ms": deadline_ms, **({"best_effort": True} if mode == "fcfs" else {})}
        with tempfile.TemporaryDirectory() as logs, start_swarm(args, mode, logs) as sw:
            sw.wait_ready(timeout=900)
            print(f"--schedule {mode}: {len(plan)} requests over {args.duration_s:g} s ...", flush=True)
            t0 = time.perf_counter()
            bg_body = {**base, "max_tokens": args.background_tokens}
            res, bg = asyncio.run(run_mode(sw.url, model, plan, body, args.background, bg_body, args.duration_s))
            wall = time.perf_counter() - t0
            server_side = sw.swarm()["deadlines"]
        outs = [outcome(r) for r in res]
        refusal_ms = sorted(r["latency"] * 1000 for r, o in zip(res, outs) if o == "refused")
        s = {o: outs.count(o) for o in sorted(set(outs))}
        s.update(requests=len(res), wall_s=wall, goodput_per_s=outs.count("met") / args.duration_s,
                 attainment=outs.count("met") / len(res),
                 refusal_ms_p50=float(np.percentile(refusal_ms, 50)) if refusal_ms else None,
                 refusal_ms_p99=float(np.percentile(refusal_ms, 99)) if refusal_ms else None,
                 refusal_ms_max=max(refusal_ms) if refusal_ms else None,
                 met_latency_p50_s=statistics.median([r["latency"] for r, o in zip(res, outs) if o == "met"] or [0]),
                 background_tokens_per_s=bg.get("tokens", 0) / args.duration_s,
                 background_requests=bg.get("requests", 0), background_errors=bg.get("errors", 0),
                 paused=server_side.get("paused", 0), server_side=server_side)
        runs[mode], summ[mode] = res, s
    first = summ[modes[0]]
    print(f"\n{'':32s}" + "".join(f"{m:>12s}" for m in modes))
    rows = (("goodput (met/s)", lambda s: s["goodput_per_s"]),
            (f"goodput / {modes[0]}", lambda s: s["goodput_per_s"] / first["goodput_per_s"]
             if first["goodput_per_s"] else float("inf")),
            ("SLO attainment", lambda s: s["attainment"]),
            ("met", lambda s: s.get("met", 0)), ("missed", lambda s: s.get("missed", 0)),
            # admitted and missed, of the admitted (met or missed): what the admission prediction got wrong
            ("missed / admitted", lambda s: s.get("missed", 0) / max(1, s.get("met", 0) + s.get("missed", 0))),
            ("refused at arrival", lambda s: s.get("refused", 0)), ("dropped in queue", lambda s: s.get("dropped", 0)),
            ("refusal round trip p50 (ms)", lambda s: s["refusal_ms_p50"]),
            ("refusal round trip p99 (ms)", lambda s: s["refusal_ms_p99"]),
            ("refusal round trip max (ms)", lambda s: s["refusal_ms_max"]),
            ("met: latency p50 (s)", lambda s: s["met_latency_p50_s"]),
            ("requests paused (flex)", lambda s: s["paused"]),
            ("background: tokens/s", lambda s: s["background_tokens_per_s"]),
            ("background: requests done", lambda s: s["background_requests"]))
    for name, f in rows:
        vals = [f(summ[m]) for m in modes]
        print(f"{name:32s}" + "".join(f"{'-':>12s}" if v is None else f"{v:12.3f}" for v in vals))
    errors = {m: {k: v for k, v in s.items() if k.startswith("error")} for m, s in summ.items()}
    if any(errors.values()):
        print(f"errors: {errors}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "service_s": service, "rate": rate,
                                               "deadline_ms": deadline_ms, "summary": summ, "runs": runs}, indent=1))
    return 0 if not any(errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
