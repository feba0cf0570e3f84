#!/usr/bin/env python3
"""Emulated testbed of the paper's §4.2 / Table 1: PETALS vs BPRR vs JFFC-only vs proposed on our runtime.

Every policy runs through the same real processes (LocalSwarm: one orchestrator, 9 servers, hivemind P2P on
loopback), the same relay and the same measurement (client-side response time; the orchestrator's wait and
service split). A tiny random-weight 32-layer Llama does the real tensor work; what the CPU cannot be is
emulated and stated in the output:

* Memory (in units of one cache slot ``s_c``): the tiny model is shaped so that ``s_m / s_c`` equals
  LLaMA-2-7B's (fp16 blocks, KV for 2048 tokens: 0.405 GB / 0.0336 GB = 12.06), and servers get
  ``--memory-bytes`` of 1150 ``s_c`` (3g.40gb: 38.6 GB usable) or 575 ``s_c`` (2g.20gb: 19.3 GB), so that at
  ``c = 35`` a 3g slice hosts 24 blocks and a 2g slice 12, as in the paper. PETALS mode caps every server's cache
  at PETALS' fixed 4096 tokens per block (= 2 slots of 2048 tokens per block).
* Compute: footnote 11 for LLaMA-2-7B on the two slices (``t_o = 1`` ms; ``t_I = F/f``, ``t_O = s_m/b`` with
  120 / 80 TFLOPS and 1.02 / 0.51 GB/ms), slept by the server after the real compute, per block and step.
* Network: RTT(orchestrator, server j) from RIPE Atlas anchors as the authors sample them, + 18 ms, added to
  every request/reply round trip by the server (``--emulate-rtt-ms``).
* Requests: the first N requests of the Azure code trace at their original arrival times. Lengths are capped
  to the paper's max length 2048 (``l_out <= 256``, ``l_in <= 2048 - l_out``); each real prompt token stands
  for ``TOKEN_SCALE`` = 8 trace tokens (the emulated prefill time uses the trace length), so a session fits
  the tiny model's 512-token slots. ``--time-scale F`` divides arrivals and every emulated time by F.
* Output tokens (``--out-token-scale K``, default 4): one real decode step stands for K trace tokens; the
  server's emulated decode time and link delay are those of K tokens (``--emulate-decode-ms`` and
  ``--emulate-rtt-ms`` times K), so the modelled service time is kept while the host runs K times fewer
  real steps. Why: every real step runs 32 Python-level HF layers (about 0.5 ms each on this CPU); at
  K = 1 the trace's decode steps alone ask more than the host's 2 cores, and the host, not the policy,
  sets the response times. Each request makes ``ceil(l_out / K)`` real steps (the rounding, and K link
  delays on the prefill message and on pings, are the emulation's error: about +15 % link time).

``python scripts/bench_swarm.py --quick --json`` (CI-sized) or without ``--quick`` for the full run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, nonnegative_int, output_file, positive_float, positive_int  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {  # name -> (placement, dispatch, extra orchestrator flags)
    "petals": ("petals", "petals", []),
    "bprr": ("bprr", "bprr", []),
    "jffc-only": ("whole-model", "jffc", []),
    "proposed": ("gbp-cr", "jffc", ["--spare-servers", "idle"]),  # the paper's Alg. 1: leftover servers idle
    # ours: GBP-CR + every volunteer placed (the orchestrator's default) + GCA + JFFC
    "proposed-all": ("gbp-cr", "jffc", ["--spare-servers", "use"]),
}
TABLE1 = ("petals", "bprr", "jffc-only", "proposed")  # the default set (the paper's Table 1)
PAPER = {  # Table 1 (seconds)
    "petals": {"mean_response_s": 31.4, "p95_response_s": 68.5, "mean_wait_s": 24.2},
    "bprr": {"mean_response_s": 19.8, "p95_response_s": 44.2, "mean_wait_s": 12.6},
    "jffc-only": {"mean_response_s": 10.0, "p95_response_s": 22.1, "mean_wait_s": 1.5},
    "proposed": {"mean_response_s": 7.3, "p95_response_s": 15.2, "mean_wait_s": 0.6},
}

# LLaMA-2-7B (fp16) and the two MIG slices, as in petals_chain.sim.scenarios
L = 32
S_M_OVER_S_C = (4 * 4096**2 + 3 * 4096 * 11008) * 2 / (2 * 4096 * 2048 * 2)  # 12.06
FAST = {"name": "3g.40gb", "memory_slots": 1150, "tflops": 120.0, "gb_per_ms": 1.02}
SLOW = {"name": "2g.20gb", "memory_slots": 575, "tflops": 80.0, "gb_per_ms": 0.51}
T_O_MS = 1.0
F_GFLOP = 4 * 4096**2 + 3 * 4096 * 11008  # x2 / 1e9 below: GFLOP per block per token
S_M_GB = (4 * 4096**2 + 3 * 4096 * 11008) * 2 / 1e9
PAPER_MAX_LENGTH = 2048
MAX_OUT = 256
TOKEN_SCALE = 8
OUT_TOKEN_SCALE = 4  # default --out-token-scale: trace output tokens per real decode step
REAL_MAX_LENGTH = 512  # tiny model's slot length: 2048 / 8 prompt tokens + up to 256 outputs
PETALS_CACHE_SLOTS = 2  # PETALS' 4096 tokens per block = 2 slots of 2048
OVERHEAD_MS = 18.0
PLAN_QUIET_S = 10.0  # the plan (its epoch, chains and the servers' states) unchanged this long: the swarm has formed


def wait_plan_settled(swarm: Any, timeout: float, quiet_s: float = PLAN_QUIET_S) -> dict:
    """The swarm's state once its plan has not changed for ``quiet_s``. ``wait_ready`` passes as soon as one chain
    covers the model and the assigned servers are online: replays started on 3 or 4 of the 9 chains the plan soon
    had, while servers still joined, so the first requests measured a smaller swarm than the policy builds."""
    seen: dict = {"key": None, "since": 0.0}

    def settled(state: dict) -> bool:
        key = (state.get("epoch"), len(state.get("chains", [])),
               tuple(sorted((s.get("public_name"), s.get("state")) for s in state.get("servers", []))))
        now = time.monotonic()
        if key != seen["key"]:
            seen["key"], seen["since"] = key, now
        return bool(state.get("ready")) and now - seen["since"] >= quiet_s

    return swarm.wait_until(settled, timeout, "the plan to settle")

def build_model(workdir: Path) -> tuple[Path, int, int]:
    """32-layer tiny Llama whose s_m / s_c (fp32, 512-token slots) is LLaMA-2-7B's 12.06."""
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.memory import block_bytes, cache_slot_bytes
    from petals_chain.swarm.tiny_model import build_tiny_model

    # hidden 16, 4 heads of 4, one KV head: s_c = 2*4*512*4 B = 16 KiB; the MLP width sets s_m.
    hidden, kv = 16, 4
    s_c_params = 2 * kv * REAL_MAX_LENGTH
    attn = 2 * hidden * hidden + 2 * hidden * kv + 2 * hidden
    inter = int(round((S_M_OVER_S_C * s_c_params - attn) / (3 * hidden)))
    path = build_tiny_model(workdir / "tiny-llama-32", family="llama", num_layers=L, hidden_size=hidden,
                            num_attention_heads=4, num_key_value_heads=1, intermediate_size=inter, num_shards=1,
                            max_position_embeddings=REAL_MAX_LENGTH * 2)
    cfg = load_config(path)
    return Path(path), block_bytes(cfg, "float32"), cache_slot_bytes(cfg, "float32", REAL_MAX_LENGTH)


def load_requests(n: int, trace_path: str | None, seed: int):
    from petals_chain.sim import data as simdata

    trace = simdata.get_trace(trace_path, seed=seed).head(n)
    l_out = np.minimum(trace.generated_tokens, MAX_OUT).astype(int)
    l_out = np.maximum(l_out, 1)
    l_in = np.minimum(trace.context_tokens, PAPER_MAX_LENGTH - l_out).astype(int)
    l_in = np.maximum(l_in, 1)
    capped = int(np.sum((trace.generated_tokens > MAX_OUT) | (trace.context_tokens + trace.generated_tokens
                                                                > PAPER_MAX_LENGTH)))
    return trace, l_in, l_out, capped


def server_specs(model_path: Path, s_c: int, rtts_ms: np.ndarray, *, time_scale: float, l_in_mean: float,
                 l_out_mean: float, petals: bool, n_fast: int, n_slow: int, batching: bool = True,
                 kv_cache: str = "slots", out_token_scale: int = 1):
    from petals_chain.swarm.local import LocalServer

    specs, described = [], []
    for j in range(n_fast + n_slow):
        gpu = FAST if j < n_fast else SLOW
        t_I = F_GFLOP * 2 / 1e9 / gpu["tflops"]  # ms per token per block (GFLOP / TFLOPS = ms)
        t_O = S_M_GB / gpu["gb_per_ms"]  # ms per token per block
        tau_p_s = (T_O_MS + t_I * l_in_mean + t_O * (l_out_mean - 1)) / 1000.0
        rtt = (float(rtts_ms[j]) + OVERHEAD_MS) * out_token_scale / time_scale
        extra = ["--emulate-step-ms", f"{T_O_MS / time_scale:.6g}",
                 "--emulate-prefill-ms-per-token", f"{t_I * TOKEN_SCALE / time_scale:.6g}",
                 "--emulate-decode-ms", f"{t_O * out_token_scale / time_scale:.6g}",
                 "--max-waiters", "4096", "--max-wait-s", "3600", "--idle-timeout-s", "900",
                 # DHT polling at the servers' default pace: faster polls cost the shared host ~0.5 core
                 "--refresh-s", "10", "--assignment-poll-s", "2", "--drain-timeout-s", "5"]
        if petals:
            extra += ["--cache-tokens-per-block", str(PETALS_CACHE_SLOTS * REAL_MAX_LENGTH)]
        if not batching:
            extra += ["--no-batching"]
        extra += ["--kv-cache", kv_cache]
        name = f"{'fast' if j < n_fast else 'slow'}{j}"
        specs.append(LocalServer(name, memory_bytes=int(gpu["memory_slots"] * s_c), emulate_rtt_ms=rtt,
                                 tau_p=tau_p_s / time_scale, extra_args=extra))
        described.append({"name": name, "slice": gpu["name"], "memory_slots": gpu["memory_slots"],
                          "rtt_ms": float(rtts_ms[j]), "emulated_rtt_ms_per_message": rtt * time_scale,
                          "t_I_ms": t_I, "t_O_ms": t_O, "t_o_ms": T_O_MS, "tau_p_s": tau_p_s})
    return specs, described


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["ok"]]
    resp = np.array([r["response_s"] for r in ok]) if ok else np.array([])

    def q(p):
        return float(np.percentile(resp, p)) if len(resp) else None

    reasons: dict[str, int] = {}
    for r in rows:
        if not r["ok"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {
        "mean_response_s": float(resp.mean()) if len(resp) else None, "median_response_s": q(50),
        "p95_response_s": q(95), "p99_response_s": q(99),
        "mean_wait_s": float(np.mean([r["wait_s"] for r in ok])) if ok else None,
        "mean_service_s": float(np.mean([r["service_s"] for r in ok])) if ok else None,
        "completed": len(ok), "failed": len(rows) - len(ok), "failure_reasons": reasons,
    }


async def replay(url: str, model_id: str, arrivals: np.ndarray, l_in: np.ndarray, l_out: np.ndarray, *,
                 time_scale: float, vocab: int, seed: int, timeout_s: float, progress: bool,
                 out_token_scale: int = 1) -> list[dict]:
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(max(1, math.ceil(int(n) / TOKEN_SCALE)))] for n in l_in]
    rows: list[dict] = [None] * len(arrivals)  # type: ignore[list-item]
    # (a keep-alive cap below the connections lets httpcore 1.0.9 close a connection it has just handed a request:
    # a ReadError that is not the swarm's, encode/httpcore#1110)
    limits = httpx.Limits(max_connections=len(arrivals) + 8, max_keepalive_connections=len(arrivals) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic() + 0.5

        async def one(i: int):
            due = t0 + float(arrivals[i]) / time_scale
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            start = time.monotonic()
            steps = max(1, math.ceil(int(l_out[i]) / out_token_scale))  # real tokens generated
            row = {"i": i, "arrival_s": float(arrivals[i]), "l_in": int(l_in[i]), "l_out": int(l_out[i]),
                   "real_tokens": steps, "ok": False, "reason": "", "late_s": start - due}
            try:
                r = await client.post(f"{url}/v1/completions", json={
                    "model": model_id, "prompt": prompts[i], "max_tokens": steps, "ignore_eos": True,
                    "temperature": 0.0})
                elapsed = time.monotonic() - due  # response time from the scheduled arrival
                if r.status_code != 200:
                    row["reason"] = f"http {r.status_code}: {r.text[:120]}"
                else:
                    body = r.json()
                    extra = body["petals_chain"][0]
                    n_tok = body["usage"]["completion_tokens"]
                    if n_tok != steps:
                        row["reason"] = f"generated {n_tok} of {steps} tokens"
                    else:
                        row.update(ok=True, response_s=elapsed * time_scale, wait_s=extra["wait_s"] * time_scale,
                                   service_s=extra["service_s"] * time_scale, chain=extra["chain"])
            except Exception as e:  # noqa: BLE001 - every request is accounted for, with its reason
                row["reason"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows[i] = row
            if progress:
                done = sum(1 for x in rows if x is not None)
                if done % 25 == 0 or done == len(rows):
                    print(f"  {done}/{len(rows)} done", file=sys.stderr, flush=True)

        await asyncio.gather(*(one(i) for i in range(len(arrivals))))
    return rows


def run_policy(policy: str, model_path: Path, s_c: int, rtts: np.ndarray, trace, l_in, l_out, *, args,
               workdir: Path) -> dict:
    from petals_chain.swarm.local import LocalSwarm

    placement, dispatch, policy_args = POLICIES[policy]
    rate = float(trace.rate) * args.time_scale
    specs, described = server_specs(model_path, s_c, rtts, time_scale=args.time_scale,
                                    l_in_mean=float(np.mean(l_in)), l_out_mean=float(np.mean(l_out)),
                                    petals=policy == "petals", n_fast=args.fast, n_slow=args.slow,
                                    batching=not args.no_batching, kv_cache=args.kv_cache,
                                    out_token_scale=args.out_token_scale)
    orch_args = ["--placement", placement, "--dispatch", dispatch, "--replan-interval-s", "1000000",
                 "--petals-cache-tokens", str(PETALS_CACHE_SLOTS * REAL_MAX_LENGTH),
                 "--route-wait-s", str(3600), "--log-level", "WARNING",
                 # the replay is one HTTP client standing for the trace's many users: no per-client limits
                 "--client-max-inflight", "1000000", "--max-queue", "1000000",
                 # the paper's system: no audits or probes taking server time beside the jobs
                 "--audit-rate", "0", "--audit-probe-s", "0", *policy_args]
    log_dir = workdir / f"logs-{policy}"
    t_start = time.monotonic()
    swarm = LocalSwarm(model_path, specs, max_length=REAL_MAX_LENGTH, arrival_rate=rate,
                       orchestrator_args=orch_args, log_dir=log_dir, settle_s=2.0)
    try:
        swarm.start(timeout=300)
        swarm.wait_ready(timeout=args.ready_timeout)
        state = wait_plan_settled(swarm, timeout=args.ready_timeout, quiet_s=args.plan_quiet_s)
        ready_s = time.monotonic() - t_start
        if args.progress:
            print(f"[{policy}] ready in {ready_s:.0f} s: c={state.get('c')} chains={len(state.get('chains', []))}",
                  file=sys.stderr, flush=True)
        from petals_chain.swarm.checkpoint import load_config

        vocab = int(load_config(model_path).vocab_size)
        t0 = time.monotonic()
        rows = asyncio.run(replay(swarm.url, state["model"], trace.arrivals, l_in, l_out, time_scale=args.time_scale,
                                  vocab=vocab, seed=args.seed, timeout_s=args.request_timeout,
                                  progress=args.progress, out_token_scale=args.out_token_scale))
        wall = time.monotonic() - t0
        final = swarm.swarm()
    finally:
        swarm.stop()
    out = summarize(rows)
    by_name = {s["peer_id"]: s["public_name"] for s in final.get("servers", [])}
    out.update({
        "placement": placement, "dispatch": dispatch, "c": final.get("c"),
        "chains": [{"names": ch["names"], "blocks": ch["blocks"], "capacity": ch["capacity"],
                    "service_time_s": ch["service_time"] * args.time_scale} for ch in final.get("chains", [])],
        "servers": [{"name": s["public_name"], "span": [s["start_block"], s["num_blocks"]],
                     "slots_total": s["slots_total"]} for s in final.get("servers", [])],
        "predicted_response_s": final.get("predicted_response_s"), "ready_s": ready_s, "wall_s": wall,
        "late_start_s_max": max(r["late_s"] for r in rows),
        "hops_mean": float(np.mean([len(r["chain"]) for r in rows if r["ok"]])) if out["completed"] else None,
        "response_times_s": [r.get("response_s") for r in rows],
        "requests": [{k: r.get(k) for k in ("i", "l_in", "l_out", "real_tokens", "ok", "reason", "response_s", "wait_s",
                                             "service_s")}
                     | {"chain": [by_name.get(x, x[:12]) for x in r.get("chain", [])]} for r in rows],
    })
    if out["predicted_response_s"]:
        out["predicted_response_s"] = {k: (v * args.time_scale if v is not None else None)
                                       for k, v in out["predicted_response_s"].items()}
    del by_name
    return out


def modelled_service(result: dict, policy: str) -> dict | None:
    """What the emulation alone accounts for in each completed request's service time, from the run's JSON.

    Per hop of the request's route (hops cover blocks in order, up to the end of each server's span): the
    footnote-11 compute of its blocks for the request's trace lengths, plus one emulated link delay per
    message (session open, prefill, and each real decode step). The rest of the measured service time is
    the host: real tensor work, serialization, p2pd and Python scheduling on the shared CPU cores.
    """
    r = result.get(policy) or {}
    servers = {sv["name"]: sv for sv in (result.get("setting") or {}).get("servers", [])}
    spans = {sv["name"]: sv["span"] for sv in r.get("servers", [])}
    measured, modelled = [], []
    for q in r.get("requests", []):
        if not q.get("ok") or not q.get("chain"):
            continue
        block, total = 0, 0.0
        for name in q["chain"]:
            sv, span = servers.get(name), spans.get(name)
            if sv is None or span is None:
                break
            end = min(L, span[0] + span[1])
            blocks, block = max(0, end - block), end
            compute_ms = blocks * (sv["t_o_ms"] + sv["t_I_ms"] * q["l_in"] + sv["t_O_ms"] * (q["l_out"] - 1))
            messages = 2 + int(q.get("real_tokens") or q["l_out"])  # open + prefill + decode steps
            rtt_ms = sv.get("emulated_rtt_ms_per_message", sv.get("emulated_rtt_ms"))  # older runs: one name
            total += compute_ms / 1000.0 + messages * rtt_ms / 1000.0
        else:
            measured.append(q["service_s"])
            modelled.append(total)
    if not measured:
        return None
    m, e = float(np.mean(measured)), float(np.mean(modelled))
    return {"measured_service_s": m, "modelled_service_s": e, "host_overhead_s": m - e,
            "host_share_of_service": (m - e) / m if m > 0 else None, "requests": len(measured)}


def plot_cdf(result: dict, path: str) -> None:
    """CDF of the response times of every policy in ``result`` (the ``--out`` JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in POLICIES:
        times = sorted(t for t in (result.get(pol) or {}).get("response_times_s", []) if t is not None)
        if times:
            ax.step(times, np.arange(1, len(times) + 1) / len(times), where="post",
                    label=f"{pol} (mean {np.mean(times):.1f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("response time (s)")
    ax.set_ylabel("CDF")
    n = (result.get("setting") or {}).get("requests")
    ax.set_title(f"Emulated testbed, first {n} Azure code requests")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-sized: 40 requests, time compressed 4x")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="first N trace requests (default 1000; quick 40)")
    p.add_argument("--time-scale", type=positive_float, default=None,
                   help="compress time by this factor (default 1; quick 4)")
    p.add_argument("--policies", nargs="+", default=list(TABLE1), choices=list(POLICIES),
                   help="default: the paper's four; 'proposed-all' adds ours (leftover servers get blocks)")
    p.add_argument("--out-token-scale", type=positive_int, default=OUT_TOKEN_SCALE,
                   help="trace output tokens per real decode step (emulated decode time and link delay scale with "
                        "it; 1 = one real step per trace token)")
    p.add_argument("--fast", type=nonnegative_int, default=3, help="servers like MIG 3g.40gb")
    p.add_argument("--slow", type=nonnegative_int, default=6, help="servers like MIG 2g.20gb")
    p.add_argument("--trace", default=None, help="Azure code trace CSV (default ../shared/data/..., else synthetic)")
    p.add_argument("--rtt-file", default=None, help="RIPE Atlas CSV (default ../shared/data/..., else synthetic)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--ready-timeout", type=positive_float, default=300.0)
    p.add_argument("--plan-quiet-s", type=nonnegative_float, default=PLAN_QUIET_S,
                   help="start the replay once the plan has not changed for this long (default %(default)s s)")
    p.add_argument("--request-timeout", type=positive_float, default=None,
                   help="seconds a request may take before it counts as failed (default 1800; quick 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by policy")
    p.add_argument("--out", type=output_file, default=None,
                   help="also write the JSON (with per-request response times) here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-batching", action="store_true",
                   help="servers run each session's step alone (issue 7's with/without-batching comparison)")
    p.add_argument("--kv-cache", choices=["slots", "paged"], default="slots",
                   help="the servers' KV cache (default slots: the paper's Eq. 3 model that Table 1 assumes)")
    p.add_argument("--plot", type=output_file, default=None, help="write a CDF plot of response times (PNG) here")
    p.add_argument("--plot-from", default=None, help="only plot, from a previous --out JSON")
    p.add_argument("--analyze", default=None, metavar="JSON",
                   help="only print measured vs modelled service time per policy, from a previous --out JSON")
    args = p.parse_args(argv)
    if args.analyze:
        res = json.loads(Path(args.analyze).read_text())
        print(json.dumps({pol: modelled_service(res, pol) for pol in POLICIES if pol in res}, indent=1))
        return 0
    if args.plot_from:
        if not args.plot:
            p.error("--plot-from needs --plot")
        plot_cdf(json.loads(Path(args.plot_from).read_text()), args.plot)
        return 0
    args.requests = args.requests or (40 if args.quick else 1000)
    args.time_scale = args.time_scale or (4.0 if args.quick else 1.0)
    args.progress = not args.no_progress
    args.request_timeout = args.request_timeout or (300.0 if args.quick else 1800.0)
    if args.fast + args.slow < 1:  # (each alone is checked as parsed)
        p.error("need at least one server (--fast + --slow >= 1)")

    import signal

    def _terminate(signum, frame):  # SIGTERM: unwind, so every LocalSwarm stops its processes (p2pd included)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    from petals_chain.sim import data as simdata

    trace, l_in, l_out, capped = load_requests(args.requests, args.trace, args.seed)
    anchors = simdata.get_anchors(args.rtt_file, seed=args.seed)
    rtts = simdata.sample_rtts_ms(anchors, args.fast + args.slow, np.random.default_rng(args.seed))
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        workdir = Path(tmp)
        model_path, s_m, s_c = build_model(workdir)
        _, described = server_specs(model_path, s_c, rtts, time_scale=args.time_scale, l_in_mean=float(np.mean(l_in)),
                                    l_out_mean=float(np.mean(l_out)), petals=False, n_fast=args.fast, n_slow=args.slow,
                                    out_token_scale=args.out_token_scale)
        setting = {
            "requests": int(args.requests), "trace": trace.source, "trace_rate_per_s": float(trace.rate),
            "time_scale": args.time_scale, "out_token_scale": args.out_token_scale, "capped_requests": capped,
            "max_out": MAX_OUT,
            "paper_max_length": PAPER_MAX_LENGTH, "token_scale": TOKEN_SCALE, "real_max_length": REAL_MAX_LENGTH,
            "mean_l_in": float(np.mean(l_in)), "mean_l_out": float(np.mean(l_out)),
            "s_m_bytes": s_m, "s_c_bytes": s_c, "s_m_over_s_c": s_m / s_c, "llama2_7b_s_m_over_s_c": S_M_OVER_S_C,
            "petals_cache_slots_per_block": PETALS_CACHE_SLOTS, "server_batching": not args.no_batching,
            "kv_cache": args.kv_cache,
            "rtt_source": anchors.source if hasattr(anchors, "source") else str(args.rtt_file or "default"),
            "servers": described, "times_in": "seconds of the uncompressed trace (measured x time_scale)",
        }
        for policy in args.policies:
            try:
                result[policy] = run_policy(policy, model_path, s_c, rtts, trace, l_in, l_out, args=args,
                                            workdir=workdir)
            except Exception as e:  # noqa: BLE001 - report the policy as failed, every request with the reason
                reason = f"swarm: {type(e).__name__}: {str(e)[:300]}"
                result[policy] = {**summarize([{"ok": False, "reason": reason}] * len(l_in)), "error": reason}
            if args.out:  # partial results survive an interrupted long run
                Path(args.out).write_text(json.dumps({**result, "setting": setting, "partial": True}, indent=1))
            if args.progress:
                r = result[policy]
                print(f"[{policy}] mean {r['mean_response_s']} s, completed {r['completed']}, failed {r['failed']}",
                      file=sys.stderr, flush=True)
    c_vals = [result[p].get("c") for p in ("proposed",) if p in result]
    result["c"] = c_vals[0] if c_vals else None
    result["setting"] = setting
    if "petals" in result and result["petals"].get("mean_response_s"):
        for pol in POLICIES:
            if pol in result and result[pol].get("mean_response_s"):
                result[pol]["vs_petals"] = result[pol]["mean_response_s"] / result["petals"]["mean_response_s"]
    result["paper"] = PAPER
    for pol in POLICIES:
        if pol in result:
            result[pol]["service_breakdown"] = modelled_service(result, pol)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_cdf(result, args.plot)
    printable = {k: ({kk: vv for kk, vv in v.items() if kk not in ("response_times_s", "requests")}
                     if isinstance(v, dict) and k in POLICIES else v) for k, v in result.items()}
    if args.json:
        print(json.dumps(printable))
    else:
        print(f"{'policy':<10} {'mean':>7} {'median':>7} {'p95':>7} {'p99':>7} {'wait':>6} {'service':>7} "
              f"{'done':>5} {'fail':>4}")
        for pol in args.policies:
            r = result[pol]
            f = lambda x: f"{x:7.2f}" if isinstance(x, (int, float)) else f"{'-':>7}"  # noqa: E731
            print(f"{pol:<10} {f(r['mean_response_s'])} {f(r['median_response_s'])} {f(r['p95_response_s'])} "
                  f"{f(r['p99_response_s'])} {f(r['mean_wait_s'])} {f(r['mean_service_s'])} {r['completed']:5d} "
                  f"{r['failed']:4d}")
        print(f"c (proposed) = {result['c']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
