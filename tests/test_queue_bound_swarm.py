"""Property test of the queue bound on a real swarm (LocalSwarm: orchestrator and servers as processes).

Bursts of 4 x (capacity + max_queue) simultaneous requests (a quarter streamed) while servers join, crash and
leave: every request completes (identical to the reference greedy output; a stream without an error event) or
gets a 429 ``queue_full`` with Retry-After, never a 5xx or a hang, and the orchestrator's own maximum queue
length stays within ``--max-queue``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 64
MAX_QUEUE = 4
MAX_TOKENS = 8


def _chaos():
    spec = importlib.util.spec_from_file_location("_qb_chaos", ROOT / "scripts" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bursts_with_servers_joining_and_leaving_keep_the_queue_bound(tiny_model_factory, tmp_path, scaled):
    chaos = _chaos()
    model_path = str(tiny_model_factory("llama", num_layers=4))
    from petals_chain.swarm.checkpoint import load_config

    prompts = chaos.make_prompts(int(load_config(model_path).vocab_size), 6, seed=5)
    ref = chaos.reference_greedy(model_path, prompts, MAX_TOKENS)
    mem = memory_for(model_path, MAX_LENGTH, 4, 2)  # each server: the whole model, 2 concurrent jobs
    sw = LocalSwarm(model_path, [LocalServer(f"s{i}", mem, tau_p=0.002) for i in range(2)], max_length=MAX_LENGTH,
                    arrival_rate=1.0, log_dir=tmp_path / "logs",
                    orchestrator_args=["--max-queue", str(MAX_QUEUE), "--replan-interval-s", "5"])
    sw.start(timeout=scaled(120))
    try:
        sw.wait_ready(timeout=scaled(120))
        capacity = sum(ch["capacity"] for ch in sw.swarm()["chains"])
        burst_size = 4 * (capacity + MAX_QUEUE)
        in_burst = threading.Event()  # set while a burst is in flight: churn lands mid-burst
        churn_done = threading.Event()
        churn: list[str] = []
        churn_error: list[BaseException] = []

        def serving(name: str):
            return lambda st: any(name in ch["names"] for ch in st["chains"])

        def do_churn() -> None:
            try:
                in_burst.wait()
                sw.add_server(LocalServer("s2", mem, tau_p=0.002))  # join
                churn.append("join s2")
                sw.wait_until(serving("s2"), scaled(90), "the new server s2 to serve in a chain")
                in_burst.wait()
                sw.kill_server("s0")  # crash: its jobs fail over (re-queued, never refused)
                churn.append("SIGKILL s0")
                time.sleep(1.0)
                in_burst.wait()
                sw.kill_server("s1", signal.SIGTERM)  # graceful leave: drains, announces offline
                churn.append("SIGTERM s1")
                sw.wait_until(lambda st: st["ready"] and not serving("s1")(st), scaled(60), "s1 to leave the chains")
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                churn_error.append(e)
            finally:
                churn_done.set()

        async def burst(model: str) -> list[tuple[int, object]]:
            limits = httpx.Limits(max_connections=burst_size + 5, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=sw.url, timeout=scaled(120), limits=limits) as c:
                async def one(i: int):
                    k = i % len(prompts)
                    body = {"model": model, "prompt": prompts[k], "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True}
                    try:
                        if i % 4 != 3:
                            return k, await c.post("/v1/completions", json=body)
                        # every 4th request streams: a refusal must still be a 429, not an error inside a 200
                        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            if r.status_code != 200:
                                await r.aread()
                                return k, r
                            lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                            return k, ("stream", lines)
                    except httpx.HTTPError as e:  # a timeout here is a hang
                        return k, e

                return await asyncio.gather(*(one(i) for i in range(burst_size)))

        model = sw.swarm()["model"]
        churner = threading.Thread(target=do_churn, daemon=True)
        churner.start()
        outcomes = {"ok": 0, "streamed": 0, "rejected": 0, "failovers": 0, "other": []}
        rounds = 0
        t0 = time.monotonic()
        deadline = t0 + scaled(180)
        # Bursts go on until the churn is over (plus two more on the swarm it left), then stop.
        after_churn = 0
        while after_churn < 2 and time.monotonic() < deadline:
            after_churn += churn_done.is_set()
            in_burst.set()
            results = asyncio.run(burst(model))
            in_burst.clear()
            rounds += 1
            time.sleep(0.2)  # a breath between bursts, so that joining servers get some CPU too
            for k, r in results:
                if isinstance(r, Exception):
                    outcomes["other"].append(repr(r)[:200])
                elif isinstance(r, tuple):
                    _, lines = r
                    outcomes["streamed"] += 1
                    if any('"error"' in line for line in lines) or not lines or lines[-1] != "data: [DONE]":
                        outcomes["other"].append(f"stream: {lines[-3:]}")
                elif r.status_code == 200:
                    info = r.json()["petals_chain"][0]
                    outcomes["ok"] += 1
                    outcomes["failovers"] += info["failovers"]
                    if info["token_ids"] != ref[k]:
                        outcomes["other"].append(f"prompt {k}: {info['token_ids']} != {ref[k]}")
                elif r.status_code == 429:
                    outcomes["rejected"] += 1
                    err = r.json()["error"]
                    if err["code"] != "queue_full" or int(r.headers.get("retry-after", 0)) < 1:
                        outcomes["other"].append(f"429 without queue_full/Retry-After: {r.headers} {err}")
                else:
                    outcomes["other"].append(f"{r.status_code}: {r.text[:200]}")
        elapsed = time.monotonic() - t0
        churner.join(timeout=scaled(60))
        st = sw.swarm()
        report = {**outcomes, "other": outcomes["other"][:10], "rounds": rounds, "burst": burst_size, "churn": churn, "elapsed_s": round(elapsed, 1),
                  "queue_max": st["queue_max"], "queue_refused": st["queue_refused"]}
        print(f"\nQUEUE_BOUND {json.dumps(report)}", flush=True)
        assert not churn_error, churn_error
        assert churn == ["join s2", "SIGKILL s0", "SIGTERM s1"]
        assert outcomes["other"] == [], outcomes["other"][:10]  # only completions (identical), 429 queue_full
        assert outcomes["ok"] >= 1 and outcomes["streamed"] >= 1 and outcomes["rejected"] >= 1
        # The bound, from the orchestrator's own maximum since start (exact, not sampled).
        assert st["max_queue"] == MAX_QUEUE and 1 <= st["queue_max"] <= MAX_QUEUE
        assert all(ch["max_active"] <= ch["capacity"] for ch in st["chains"])
        assert "petals_chain_queue_length_max" in httpx.get(f"{sw.url}/metrics", timeout=10).text
        settled = chaos_settled(sw.url, scaled(60))
        assert settled["settled"], settled
    finally:
        sw.stop()
        assert sw.leftover_processes() == []


def chaos_settled(url: str, timeout_s: float) -> dict:
    """No job running or waiting (queue and re-queue lane) and every online server's slots free."""
    deadline = time.monotonic() + timeout_s
    st: dict = {}
    while time.monotonic() < deadline:
        st = httpx.get(f"{url}/api/v1/swarm", timeout=10).json()
        leaked = sum(s["slots_total"] - s["slots_free"] for s in st["servers"] if s.get("state") == "online")
        if st["queue_length"] == st["requeued"] == st["running"] == leaked == 0:
            return {"settled": True}
        time.sleep(0.5)
    return {"settled": False, "queue_length": st.get("queue_length"), "requeued": st.get("requeued"),
            "running": st.get("running")}
