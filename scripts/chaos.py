"""Churn test: a swarm with spare capacity under steady load while servers are SIGKILLed and restarted.

Every completion is greedy over token-id prompts with ``ignore_eos``, so it must equal the reference (a
greedy loop over the same tiny model in transformers) token for token, whichever chains served it and
however often it failed over.

    python scripts/chaos.py --quick --json        # ~1 min: 3 servers, 2 kills
    python scripts/chaos.py --json                # ~5 min: 4 servers, a kill every 15 s
    python scripts/chaos.py --quick --orchestrator-kills 1 --json   # also SIGKILL + restart the orchestrator

With ``--orchestrator-kills K`` the orchestrator (fixed identity, libp2p and HTTP ports) is SIGKILLed K times,
evenly spread, and restarted at once; clients retry a request that failed with a connection-level error or a 503
(what a client of a restarting service does), so every request must still complete identically.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from petals_chain.swarm.local import LocalServer, LocalSwarm, free_port, memory_for  # noqa: E402


def reference_greedy(model_path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by the whole model in one process (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(max_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            out.append(seq[len(ids):])
    return out


def make_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]


def restart_server(swarm: LocalSwarm, name: str) -> None:
    """Start a fresh process for the (dead) server ``name``, with its original spec."""
    proc = swarm.servers.pop(name)
    if proc.log_file is not None:
        proc.log_file.close()
        proc.log_file = None
    swarm.add_server(proc.spec)


def restart_orchestrator(swarm: LocalSwarm, timeout: float = 180.0) -> float:
    """SIGKILL the orchestrator's process group and start it again (same args: identity and ports); seconds down."""
    t0 = time.monotonic()
    os.killpg(swarm.orchestrator.popen.pid, signal.SIGKILL)
    swarm.orchestrator.popen.wait(10)
    if swarm.orchestrator.log_file is not None:
        swarm.orchestrator.log_file.close()
        swarm.orchestrator.log_file = None
    swarm.start_orchestrator(timeout=timeout)
    return time.monotonic() - t0


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def run_load_with_churn(swarm: LocalSwarm, prompts: list[list[int]], reference: list[list[int]], *,
                        duration_s: float, concurrency: int, max_tokens: int, kill_interval_s: float,
                        restart_after_s: float, min_alive: int = 1, seed: int = 0,
                        request_timeout_s: float = 300.0, orchestrator_kills: int = 0,
                        log: Callable[[str], None] = lambda s: None) -> dict:
    """Closed-loop load (``concurrency`` clients) for ``duration_s`` while a random server is SIGKILLed every
    ``kill_interval_s`` and restarted ``restart_after_s`` later; returns the churn report.

    ``orchestrator_kills``: also SIGKILL and restart the orchestrator that many times (the swarm must give it a fixed
    identity and ports); clients then retry connection-level errors and 503s until ``request_timeout_s``."""
    rng = random.Random(seed)
    model = swarm.swarm()["model"]
    results: list[dict] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(idx: int) -> None:
        crng = random.Random(seed * 1000 + idx)
        with httpx.Client(base_url=swarm.url, timeout=request_timeout_s) as http:
            while not stop.is_set():
                k = crng.randrange(len(prompts))
                t0 = time.monotonic()
                rec: dict[str, Any] = {"prompt": k, "retries": 0}
                while True:
                    try:
                        r = http.post("/v1/completions", json={"model": model, "prompt": prompts[k],
                                                               "max_tokens": max_tokens, "temperature": 0,
                                                               "ignore_eos": True})
                        rec["status"] = r.status_code
                        if r.status_code == 200:
                            info = r.json()["petals_chain"][0]
                            rec["token_ids"] = info["token_ids"]
                            rec["failovers"] = info["failovers"]
                        else:
                            rec["error"] = r.text[:300]
                    except httpx.HTTPError as e:
                        rec["status"] = None
                        rec["error"] = repr(e)
                    retryable = rec["status"] is None or rec["status"] == 503
                    if not (orchestrator_kills and retryable and time.monotonic() - t0 < request_timeout_s):
                        break
                    rec["retries"] += 1  # the orchestrator is restarting: retry as a client of it would
                    time.sleep(0.5)
                rec["response_s"] = time.monotonic() - t0
                with lock:
                    results.append(rec)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    kills: list[dict] = []
    dead: dict[str, float] = {}  # name -> time of death
    t_start = time.monotonic()
    next_kill = t_start + kill_interval_s
    restart_retries = 0
    orch_at = [duration_s * (i + 1) / (orchestrator_kills + 1) for i in range(orchestrator_kills)]
    orch_restarts: list[dict] = []
    while time.monotonic() - t_start < duration_s:
        now = time.monotonic()
        if orch_at and now - t_start >= orch_at[0]:
            orch_at.pop(0)
            t_kill = round(now - t_start, 2)
            down_s = restart_orchestrator(swarm)
            t_up = time.monotonic()
            swarm.wait_until(lambda st: bool(st.get("ready")), 180, "the restarted orchestrator to have a chain")
            orch_restarts.append({"t": t_kill, "down_s": round(down_s, 1),
                                  "chain_after_s": round(time.monotonic() - t_up + down_s, 1)})
            log(f"orchestrator restarted: {orch_restarts[-1]}")
            continue  # the restart took a while: check the duration and the dead servers first
        for name, t_dead in list(dead.items()):
            if now - t_dead >= restart_after_s:
                restart_server(swarm, name)
                del dead[name]
                log(f"restarted {name}")
        for name, proc in list(swarm.servers.items()):
            # A restarted server that exits (e.g. could not join in time) is restarted again, as a supervisor would.
            if name not in dead and not proc.alive():
                restart_retries += 1
                restart_server(swarm, name)
                log(f"{name} exited after its restart; restarted again")
        if now >= next_kill:
            alive = [n for n, p in swarm.servers.items() if p.alive() and n not in dead]
            if len(alive) > min_alive:
                # Prefer a server that is serving jobs right now: its death must be survived mid-generation.
                busy: set[str] = set()
                try:
                    for ch in swarm.swarm()["chains"]:
                        if ch["active"] > 0:
                            busy.update(ch["names"])
                except httpx.HTTPError:
                    pass
                candidates = sorted(set(alive) & busy) or sorted(alive)
                victim = rng.choice(candidates)
                swarm.kill_server(victim)
                dead[victim] = time.monotonic()
                kills.append({"server": victim, "t": round(time.monotonic() - t_start, 2)})
                log(f"SIGKILL {victim}")
            next_kill = now + kill_interval_s
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=request_timeout_s)
    for name in list(dead):  # leave the swarm whole
        restart_server(swarm, name)
    ok = [r for r in results if r.get("status") == 200]
    identical = sum(1 for r in ok if r["token_ids"] == reference[r["prompt"]])
    errors = [r["error"] for r in results if r.get("status") != 200][:5]
    retried = [r for r in results if r.get("retries")]
    return {"requests": len(results), "completed": len(ok), "identical_to_reference": identical,
            "kills": len(kills), "restarts": len(kills), "restart_retries": restart_retries, "failovers": sum(r.get("failovers", 0) for r in ok),
            "p50_response_s": percentile([r["response_s"] for r in ok], 0.5),
            "p95_response_s": percentile([r["response_s"] for r in ok], 0.95),
            "duration_s": duration_s, "concurrency": concurrency, "max_tokens": max_tokens,
            "orchestrator_restarts": orch_restarts, "requests_retried": len(retried),
            "retried_completed_identical": sum(1 for r in retried if r.get("status") == 200
                                               and r["token_ids"] == reference[r["prompt"]]),
            "kill_log": kills, "errors": errors}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (about a minute)")
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--servers", type=int, default=None)
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--kill-interval-s", type=float, default=None)
    p.add_argument("--restart-after-s", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks-per-server", type=int, default=None,
                   help="size each server's memory for this many blocks (2 jobs) instead of the whole model, so "
                        "chains span several servers (default: the whole model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--orchestrator-kills", type=int, default=0,
                   help="also SIGKILL and restart the orchestrator this many times (clients retry)")
    args = p.parse_args(argv)
    q = args.quick
    n_servers = args.servers or (3 if q else 4)
    duration = args.duration_s or (30.0 if q else 300.0)
    concurrency = args.concurrency or (2 if q else 4)
    kill_interval = args.kill_interval_s or (10.0 if q else 15.0)
    restart_after = args.restart_after_s or (8.0 if q else 10.0)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.json else (lambda s: None)

    from petals_chain.swarm.tiny_model import build_tiny_model

    work = tempfile.TemporaryDirectory(prefix="petals-chain-chaos-")
    model_path = str(build_tiny_model(Path(work.name) / "model", family="llama", num_layers=args.layers, seed=0))
    from petals_chain.swarm.checkpoint import load_config

    vocab = int(load_config(model_path).vocab_size)
    prompts = make_prompts(vocab, 8, args.seed)
    reference = reference_greedy(model_path, prompts, args.max_tokens)
    max_length = 64
    # Every server can hold the whole model with 2 slots: losing any one leaves spare capacity.
    blocks = args.layers if args.blocks_per_server is None else max(1, min(args.layers, args.blocks_per_server))
    mem = memory_for(model_path, max_length, blocks, 2)
    servers = [LocalServer(f"s{i}", mem, tau_p=0.002) for i in range(n_servers)]
    orch_args = ["--replan-interval-s", "10"]
    if args.orchestrator_kills > 0:  # a restart keeps the peer id (servers trust it) and both addresses
        orch_args += ["--identity-path", str(Path(work.name) / "orchestrator.id"),
                      "--host-maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}", "--port", str(free_port())]
    sw = LocalSwarm(model_path, servers, max_length=max_length, arrival_rate=1.0, log_dir=Path(work.name) / "logs",
                    orchestrator_args=orch_args)
    try:
        sw.start()
        sw.wait_ready(timeout=180)
        log(f"swarm ready at {sw.url}")
        report = run_load_with_churn(sw, prompts, reference, duration_s=duration, concurrency=concurrency,
                                     max_tokens=args.max_tokens, kill_interval_s=kill_interval,
                                     restart_after_s=restart_after, seed=args.seed,
                                     orchestrator_kills=args.orchestrator_kills, log=log)
        report["servers"] = n_servers
        report["blocks_per_server"] = blocks
        # Every server start loads blocks once; any further load is a reload (a moved span).
        starts = n_servers + report["restarts"] + report["restart_retries"]
        loads = sum(proc.log_path.read_text(errors="replace").count("loading blocks [") for proc in sw.servers.values())
        report["block_loads"], report["block_reloads"] = loads, max(0, loads - starts)
        report["command"] = "python scripts/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    finally:
        sw.stop()
        left = sw.leftover_processes()
        work.cleanup()
    report["leftover_processes"] = len(left)
    print(json.dumps(report, indent=None if args.json else 2))
    ok = report["completed"] == report["requests"] == report["identical_to_reference"] and report["requests"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
