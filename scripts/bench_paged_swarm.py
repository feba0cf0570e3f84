"""A paged swarm against a slot swarm at equal memory, end to end: chain capacity by tokens (issue 15).

Swarms in turn, identical but for the servers' ``--kv-cache`` and the orchestrator's ``--job-tokens``: an
orchestrator and two servers that can each hold only half of the blocks (every chain has two hops; loopback with
``--rtt-ms`` emulated per message), each server's memory its half of the blocks plus ``--slots`` cache slots of
``--max-length`` tokens per block. Each gets the same burst of ``--requests`` completion requests at once, with
prompt and output lengths drawn from the Azure conversation trace (``../shared/data``; a synthetic stand-in
without it) scaled by ``--max-length / 4096``; a request's prompt is random token ids and it generates exactly
its trace output length (greedy, ``ignore_eos``).

Three runs: ``slots`` servers (a chain runs as many jobs as its hops' slots hold, Eq. 3); ``paged`` servers with
``--job-tokens max_length`` (the paged cache alone: the same chain capacities); ``paged`` with ``--job-tokens
auto`` (the orchestrator counts the same memory as a token budget over ``L^``, the mean declared length of recent
jobs, ``algorithms/token_budget.py``, learnt from the burst itself: its first 16 requests). Printed side by side:
chain capacity, most jobs run at once, mean and P90 response time, the burst's makespan, opens that waited at a
server for pages, and whether every request's tokens are identical in all three.

    python scripts/bench_paged_swarm.py [--model smollm2-135m] [--requests 32] [--max-length 512] [--rtt-ms 100]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, nonnegative_int, positive_int  # noqa: E402


def workload(n: int, max_length: int, vocab: int, trace: str | None, seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, tokens to generate) with the conversation trace's lengths scaled to ``max_length``."""
    from petals_chain.sim.data import CONV_TRACE_FILENAME, default_data_path, get_conversation_lengths, get_trace

    rng = np.random.default_rng(seed)
    path = trace or default_data_path(CONV_TRACE_FILENAME)
    if path is not None:
        t = get_trace(path)
        ctx, gen = t.context_tokens.astype(float), t.generated_tokens.astype(float)
    else:  # totals only: split them as the real trace does on average (22 % generated)
        total, _ = get_conversation_lengths(None, seed=seed)
        ctx, gen = 0.78 * total, 0.22 * total
    scale = max_length / 4096
    out = []
    for i in rng.choice(len(ctx), size=n, replace=False):
        p = int(max(1, round(ctx[i] * scale)))
        g = int(max(1, round(gen[i] * scale)))
        if p + g > max_length:
            p = max(1, max_length - g) if g < max_length else 1
            g = max_length - p
        out.append((rng.integers(10, vocab, size=p).tolist(), g))
    return out


async def burst(url: str, model: str, reqs: list[tuple[list[int], int]]) -> list[tuple[float, list[int]]]:
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        async def one(prompt: list[int], g: int) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": g,
                                                      "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()["petals_chain"][0]["token_ids"]

        return await asyncio.gather(*(one(p, g) for p, g in reqs))


def run(args, reqs, mode: str, job_tokens: str) -> dict:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

    L, s_m, s_c = model_memory(args.model, args.max_length)
    half = -(-L // 2)
    extra = ("--kv-cache", mode, "--emulate-rtt-ms", str(args.rtt_ms))
    servers = [LocalServer(f"s{i}", int(half * (s_m + args.slots * s_c)), extra_args=extra) for i in range(2)]
    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs,
                       orchestrator_args=["--job-tokens", job_tokens]) as sw:
        st = sw.wait_ready(timeout=900)
        client = sw.client()
        client.complete("Hello", max_tokens=2)  # warm-up (one job: L^ still at its prior)
        t0 = time.perf_counter()
        results = asyncio.run(burst(sw.url, client.model, reqs))
        makespan = time.perf_counter() - t0
        st = client.swarm()
    times = [t for t, _ in results]
    return {"hops": sorted({len(ch["servers"]) for ch in st["chains"]}),
            "capacity": sum(ch["capacity"] for ch in st["chains"]),
            "max_active": sum(ch["max_active"] for ch in st["chains"]), "mean": statistics.mean(times),
            "p90": float(np.percentile(times, 90)), "makespan": makespan, "tokens": [ids for _, ids in results],
            "job_tokens": st["job_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=positive_int, default=32)
    p.add_argument("--max-length", type=positive_int, default=512)
    p.add_argument("--slots", type=positive_int, default=4,
                   help="cache slots of max_length tokens per block per server")
    p.add_argument("--rtt-ms", type=nonnegative_float, default=100.0,
                   help="emulated round trip per message to each server")
    p.add_argument("--trace", default=None, help="Azure conversation trace CSV (default: ../shared/data)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    args = p.parse_args()

    from petals_chain.swarm.sources import resolve_source

    vocab = int(resolve_source(args.model).config.vocab_size)
    reqs = workload(args.requests, args.max_length, vocab, args.trace, args.seed)
    lengths = [len(pr) + g for pr, g in reqs]
    print(f"{args.requests} requests: prompt + output mean {statistics.mean(lengths):.0f} tokens "
          f"(max {max(lengths)}), max_length {args.max_length}, emulated RTT {args.rtt_ms:g} ms", flush=True)
    # slots; paged with chain capacities in max_length slots (the cache alone); paged with capacities by tokens
    runs = (("slots", "slots", str(args.max_length)), ("paged, L^=max", "paged", str(args.max_length)),
            ("paged, L^ auto", "paged", "auto"))
    res = {}
    for label, mode, job_tokens in runs:
        print(f"running: {label} ...", flush=True)
        res[label] = run(args, reqs, mode, job_tokens)
    s = res["slots"]
    print(f"\nchains of {s['hops']} hops; equal memory: {args.slots} slots of {args.max_length} tokens per block")
    print(f"{'':24s}" + "".join(f"{label:>16s}" for label, _, _ in runs) + f"{'auto / slots':>14s}")
    for name, key, fmt in (("chain capacity (jobs)", "capacity", "{:16.0f}"),
                           ("most jobs at once", "max_active", "{:16.0f}"), ("mean response (s)", "mean", "{:16.2f}"),
                           ("P90 response (s)", "p90", "{:16.2f}"), ("makespan (s)", "makespan", "{:16.2f}")):
        print(f"{name:24s}" + "".join(fmt.format(res[label][key]) for label, _, _ in runs)
              + f"{res['paged, L^ auto'][key] / s[key]:14.3f}")
    jt = res["paged, L^ auto"]["job_tokens"]
    print(f"auto: L^ = {jt['value']} tokens (mean declared {jt['mean_declared']:.0f} over {jt['jobs_observed']} jobs), "
          f"opens that waited for pages: {jt['open_waits']}")
    same = min(sum(a == b for a, b in zip(s["tokens"], res[label]["tokens"])) for label, _, _ in runs)
    print(f"identical outputs in all three: {same} / {len(reqs)}")
    return 0 if same == len(reqs) else 1


if __name__ == "__main__":
    sys.exit(main())
