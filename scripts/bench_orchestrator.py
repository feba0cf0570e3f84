"""Orchestrator benchmarks (issue 4):

1. ``overhead``: orchestrator time per generated token beyond the time spent waiting on servers
   (embeddings, LM head, sampling, detokenization, asyncio and serialization at the orchestrator), from
   its own counters: ``(service time - time waiting on hop RPCs) / tokens``, one request at a time.
2. ``dispatch``: JFFC decision time at 10^4 chains, for the bare state machine and through the
   orchestrator's asyncio DispatchManager (acquire/release).
3. ``concurrency``: concurrent sessions one orchestrator sustains with the tiny model: N clients generate
   at once against servers with enough slots; tokens/s, per-token latency and orchestrator CPU per level.

    python scripts/bench_orchestrator.py [--quick] [--json out.json] [--only overhead,dispatch,concurrency]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import name_list, output_file  # noqa: E402


def bench_dispatch(num_chains: int = 10_000, ops: int = 100_000) -> dict:
    from petals_chain.algorithms import JFFCDispatcher
    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    chains = [Chain(servers=(f"s{k}",), blocks=(8,), service_time=0.5 + (k % 101) / 50, capacity=1 + k % 4,
                    spans=((0, 8),)) for k in range(num_chains)]
    d = JFFCDispatcher(chains)
    total_cap = sum(ch.capacity for ch in chains)
    # Fill to 90% so arrivals search a partly occupied heap, then alternate complete/arrive at steady state.
    running = []
    for i in range(int(0.9 * total_cap)):
        running.append(d.arrive(i))
    t0 = time.perf_counter()
    for i in range(ops):
        k = running[i % len(running)]
        nxt = d.complete(k)
        if nxt is None:
            running[i % len(running)] = d.arrive(i)
    bare = (time.perf_counter() - t0) / (2 * ops)

    async def through_manager() -> float:
        dm = DispatchManager(policy="jffc")
        t_set = time.perf_counter()
        dm.set_chains(chains)
        set_s = time.perf_counter() - t_set
        leases = [await dm.acquire(DispatchJob(str(i))) for i in range(int(0.9 * total_cap))]
        n = ops // 4
        t = time.perf_counter()
        for i in range(n):
            lease = leases[i % len(leases)]
            dm.release(lease)
            leases[i % len(leases)] = await dm.acquire(DispatchJob(f"x{i}"))
        return (time.perf_counter() - t) / (2 * n), set_s

    managed, set_s = asyncio.run(through_manager())
    return {"chains": num_chains, "total_capacity": total_cap, "jffc_decision_us": bare * 1e6,
            "manager_acquire_release_us": managed * 1e6, "set_chains_ms": set_s * 1e3}


def _swarm(work: Path, servers_spec, max_length: int, arrival_rate: float):
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for
    from petals_chain.swarm.tiny_model import build_tiny_model

    path = build_tiny_model(work / "model", family="llama", num_layers=8, seed=0)
    servers = [LocalServer(name, memory_for(path, max_length, blocks, slots), tau_p=0.001, emulate_rtt_ms=rtt)
               for name, blocks, slots, rtt in servers_spec]
    return LocalSwarm(path, servers, max_length=max_length, arrival_rate=arrival_rate, log_dir=work / "logs")


def bench_overhead(work: Path, requests: int, max_tokens: int) -> dict:
    # One whole-model server and a two-hop pair: measures the per-hop relay cost too.
    sw = _swarm(work / "overhead", [("whole", 8, 2, 0.0), ("h1", 4, 2, 0.0), ("h2", 4, 2, 0.0)], 256, 0.5)
    with sw:
        sw.wait_ready(timeout=240)
        client = sw.client()
        client.complete("warm up", max_tokens=4)
        before = sw.swarm()["relay"]
        lat = []
        hops = []
        for i in range(requests):
            t0 = time.perf_counter()
            c = client.complete(f"Request number {i}: the quick brown fox", max_tokens=max_tokens, ignore_eos=True)
            lat.append((time.perf_counter() - t0) / max(1, len(c.token_ids)))
            hops.append(len(c.chain))
        after = sw.swarm()["relay"]
    tokens = after["tokens"] - before["tokens"]
    service = after["service_s"] - before["service_s"]
    hop = after["hop_s"] - before["hop_s"]
    steps = after["relay_steps"] - before["relay_steps"]
    return {"requests": requests, "tokens": tokens, "mean_hops": statistics.mean(hops),
            "service_per_token_ms": 1e3 * service / tokens, "hop_wait_per_token_ms": 1e3 * hop / tokens,
            "orchestrator_overhead_per_token_ms": 1e3 * (service - hop) / tokens,
            "client_latency_per_token_ms": 1e3 * statistics.mean(lat), "relay_steps": steps}


def _state(sw) -> dict:
    import httpx

    return httpx.get(f"{sw.url}/api/v1/swarm", timeout=120).json()


def bench_concurrency(work: Path, levels: list[int], max_tokens: int) -> list[dict]:
    import psutil

    top = max(levels)
    # Enough slots for the largest level: every job starts at once (no queueing), so we measure the relay.
    sw = _swarm(work / "concurrency", [("w1", 8, (top + 1) // 2 + 1, 0.0), ("w2", 8, (top + 1) // 2 + 1, 0.0)], 128,
                float(top))
    out = []
    with sw:
        sw.wait_ready(timeout=240)
        st = sw.swarm()
        cap = sum(ch["capacity"] for ch in st["chains"])
        proc = psutil.Process(sw.orchestrator.popen.pid)
        client = sw.client()
        client.complete("warm up", max_tokens=4)
        for n in levels:
            results, errors = [], []

            def one(i):
                try:
                    t0 = time.perf_counter()
                    c = client.complete(f"Session {i} says", max_tokens=max_tokens, ignore_eos=True)
                    results.append((time.perf_counter() - t0, c))
                except Exception as e:  # noqa: BLE001
                    errors.append(str(e))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            relay0 = _state(sw)["relay"]
            proc.cpu_percent(None)
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            cpu = proc.cpu_percent(None)
            t_state = time.perf_counter()
            relay1 = _state(sw)["relay"]
            state_s = time.perf_counter() - t_state
            batches = relay1["lm_head_batches"] - relay0["lm_head_batches"]
            rows = relay1["lm_head_rows"] - relay0["lm_head_rows"]
            tokens = sum(len(c.token_ids) for _, c in results)
            service = [c.service_s / max(1, len(c.token_ids)) for _, c in results]
            out.append({"concurrent": n, "capacity": cap, "completed": len(results), "failed": len(errors),
                        "tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
                        "mean_wait_s": statistics.mean(c.wait_s for _, c in results) if results else None,
                        "per_token_ms_p50": 1e3 * statistics.median(service) if service else None,
                        "orchestrator_cpu_percent": cpu,
                        "lm_head_rows_per_batch": rows / batches if batches else None,
                        "swarm_state_after_s": state_s})
            print(f"  concurrency {n}: {out[-1]}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests and levels")
    p.add_argument("--only", type=name_list(("overhead", "dispatch", "concurrency")),
                   default="overhead,dispatch,concurrency")
    p.add_argument("--json", type=output_file, default=None, help="write results here")
    args = p.parse_args(argv)
    only = set(args.only)
    results: dict = {"machine": {"cpus": __import__("os").cpu_count()}}
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        work = Path(tmp)
        if "dispatch" in only:
            print("dispatch: JFFC at 10^4 chains ...", flush=True)
            results["dispatch"] = bench_dispatch(ops=20_000 if args.quick else 100_000)
            print(" ", results["dispatch"], flush=True)
        if "overhead" in only:
            print("overhead: one request at a time ...", flush=True)
            results["overhead"] = bench_overhead(work, 4 if args.quick else 12, 32 if args.quick else 64)
            print(" ", results["overhead"], flush=True)
        if "concurrency" in only:
            print("concurrency: N clients at once ...", flush=True)
            levels = [1, 8, 32] if args.quick else [1, 8, 32, 64, 128]
            results["concurrency"] = bench_concurrency(work, levels, 16 if args.quick else 32)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
