"""A backlogged heavy client holding every slot, and a light client's lone requests: its wait for a slot under
``--fairness vtc`` with and without ``--fairness-preempt``, side by side in one run (issue 16).

Real processes: an orchestrator with two API keys and one server holding the whole tiny 4-block Llama with
``--kv-cache slots`` and ``--slots`` slots, ``--rtt-ms`` emulated per message. The heavy client keeps
``--heavy-outstanding`` greedy requests in flight (closed loop, more than the slots, so it is always backlogged);
after a warm-up the light client sends one request, waits for its reply, then a random pause (exponential, mean
``--gap-s`` s, seeded: the same pauses for every policy) so that its requests meet the heavy jobs at every phase. Printed per policy: the light
requests' wait for a chain (mean, median, max), their service time, the heavy client's completed requests and the
jobs paused. Every reply is checked to be the same greedy text (exit code 1 otherwise).

    python scripts/bench_fair_preempt.py [--policies vtc,vtc+preempt] [--duration-s 20] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HEAVY_KEY, LIGHT_KEY = "heavy-key-0123456789", "light-key-0123456789"


async def drive(url: str, model: str, args) -> dict:
    import httpx

    light, heavy_done, texts = [], [0], set()
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        stop = time.monotonic() + args.duration_s

        async def one(key: str) -> dict:
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": model, "prompt": list(range(11, 11 + args.prompt_tokens)),
                                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            texts.add(body["choices"][0]["text"])
            return body["petals_chain"][0]

        async def heavy_loop() -> None:
            while time.monotonic() < stop:
                await one(HEAVY_KEY)
                heavy_done[0] += 1

        async def light_loop() -> None:
            rng = random.Random(args.seed)
            await asyncio.sleep(args.warmup_s)
            while time.monotonic() < stop:
                x = await one(LIGHT_KEY)
                light.append({"wait_s": x["wait_s"], "service_s": x["service_s"]})
                await asyncio.sleep(rng.expovariate(1.0 / args.gap_s))

        await asyncio.gather(*(heavy_loop() for _ in range(args.heavy_outstanding)), light_loop())
    return {"light": light, "heavy_completed": heavy_done[0], "texts": sorted(texts)}


def run(args, variant: str, model_path: str, work: Path) -> dict:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for, model_memory

    name, _, extra = variant.partition("+")
    orch = ["--api-keys", str(work / "keys"), "--fairness", name] + (["--fairness-preempt"] if extra else [])
    L, _, _ = model_memory(model_path, args.max_length)
    server = LocalServer("s0", memory_for(model_path, args.max_length, L, args.slots),
                         extra_args=("--kv-cache", "slots", "--emulate-rtt-ms", str(args.rtt_ms)))
    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(model_path, [server], max_length=args.max_length, arrival_rate=1.0, log_dir=logs,
                       orchestrator_args=orch) as sw:
        st = sw.wait_ready(timeout=300)
        out = asyncio.run(drive(sw.url, st["model"], args))
        out["paused"] = sw.swarm()["fairness"].get("preemptions", 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="vtc,vtc+preempt", help="comma-separated --fairness values; "
                   "POLICY+preempt adds --fairness-preempt")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--heavy-outstanding", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--gap-s", type=float, default=1.0, help="mean pause between a light reply and its next request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from petals_chain.swarm.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_fair_preempt_"))
    (work / "keys").write_text(f"heavy {HEAVY_KEY}\nlight {LIGHT_KEY}\n")
    model_path = str(build_tiny_model(work / "tiny", family="llama", num_layers=4))
    results, texts = {}, set()
    for variant in [v.strip() for v in args.policies.split(",") if v.strip()]:
        print(f"--fairness {variant} ...", flush=True)
        results[variant] = r = run(args, variant, model_path, work)
        texts.update(r["texts"])
        w = [x["wait_s"] for x in r["light"]]
        print(f"  light requests {len(w)}: wait mean {statistics.mean(w):.3f} s, median {statistics.median(w):.3f} s, "
              f"max {max(w):.3f} s; service {statistics.mean(x['service_s'] for x in r['light']):.3f} s; heavy "
              f"completed {r['heavy_completed']}; jobs paused {r['paused']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if len(texts) != 1:
        print(f"ERROR: {len(texts)} distinct greedy outputs for one prompt", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
