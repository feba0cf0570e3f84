"""A heavy client against light ones on a real swarm: ``--fairness fcfs`` vs ``dlpm`` side by side (issue 16).

Real processes: an orchestrator with API keys (one per client) and ``--servers`` servers on loopback, each link
delayed by ``--rtt-ms`` (emulated, per message), with ``--kv-cache slots`` so every chain runs a fixed number of
jobs. Clients send completion requests open-loop (Poisson arrivals, ``--max-tokens`` greedy tokens each, a
prompt of ``--prompt-tokens`` random ids): ``--light`` light clients at rate ``r`` each and ``--heavy`` heavy clients
(one by default) at ``--heavy-factor`` x ``r`` each.

First a probe of light requests measures the swarm's service time; ``r`` is then set so that the total offered
load is ``--overload`` x the chains' capacity (the heavy client is backlogged, each light client asks for less
than its fair share). The light requests of that plan run alone (fcfs, same times, no heavy client): their
latency is the "alone" baseline. The same arrival times are replayed under every ``--policies`` entry, each on
a fresh swarm. Printed per policy: light clients' mean latency and its ratio to the alone run, their mean and
median wait for a chain, the heavy client's latency, total throughput (completed requests/s and service units/s)
against the first policy (Jain's index over backlogged clients is the simulator's: here only the heavy client is
backlogged), and the number of distinct greedy outputs (one prompt: must be 1; exit code 1 otherwise). With
``--max-queue N`` (the orchestrator's) a request may be refused (429): refusals are counted per kind of client and
the latencies are of the requests served (several heavy clients and a short queue show whether they can fill it
against the light ones). With ``--plot``: per-request latency over time, one panel per policy.

    python scripts/bench_fairness.py [--model PATH|smollm2-135m] [--duration-s 45] [--rtt-ms 20] [--plot F.png]
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
from _args import name_list, nonnegative_float, nonnegative_int, output_file, positive_float, positive_int  # noqa: E402

from petals_chain.algorithms.fairness import FAIRNESS_POLICIES  # noqa: E402 - pure, imported at once


def model_and_prompt(args, work: Path, rng: np.random.Generator) -> list[int]:
    """Set ``args.model`` to a tiny random-weight Llama built in ``work`` when none was given; return a prompt of
    ``args.prompt_tokens`` random ids of its vocabulary."""
    if args.model is None:
        from petals_chain.swarm.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(work / "tiny", family="llama", num_layers=4))
    from petals_chain.swarm.sources import resolve_source

    vocab = int(resolve_source(args.model).config.vocab_size)
    return rng.integers(10, vocab, size=args.prompt_tokens).tolist()


def arrivals(rate: float, duration: float, rng: np.random.Generator) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return out
        out.append(t)


async def replay(url: str, model: str, plan: list[tuple[float, str, str]], prompt: list[int],
                 max_tokens: int) -> list[dict]:
    """Send ``plan``'s requests (time, client name, key) at their times; per request: client, sent, latency."""
    import httpx

    limits = httpx.Limits(max_connections=len(plan) + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()

        async def one(at: float, name: str, key: str) -> dict:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter() - t0
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "ignore_eos": True})
            if r.status_code == 429:  # a full queue (--max-queue): the refusal is part of the result
                return {"client": name, "sent": sent, "refused": r.json()["error"]["code"]}
            r.raise_for_status()
            body = r.json()
            extra = body["petals_chain"][0]
            return {"client": name, "sent": sent, "latency": time.perf_counter() - t0 - sent,
                    "wait": extra["wait_s"], "service": extra["service_s"], "text": body["choices"][0]["text"]}

        return await asyncio.gather(*(one(*p) for p in plan))


def run_policy(args, policy: str, plan: list[tuple[float, str, str]], keys_file: Path, prompt: list[int]) -> dict:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for, model_memory

    L, _, _ = model_memory(args.model, args.max_length)
    extra = ("--kv-cache", args.kv_cache, "--emulate-rtt-ms", str(args.rtt_ms))
    servers = [LocalServer(f"s{i}", memory_for(args.model, args.max_length, L, args.slots), extra_args=extra)
               for i in range(args.servers)]
    orch_args = ["--api-keys", str(keys_file), "--fairness", policy]
    if args.max_queue is not None:
        orch_args += ["--max-queue", str(args.max_queue)]
    if args.quantum is not None:
        orch_args += ["--fairness-quantum", str(args.quantum)]
    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs,
                       orchestrator_args=orch_args) as sw:
        st = sw.wait_ready(timeout=900)
        model = st["model"]
        t0 = time.perf_counter()
        results = asyncio.run(replay(sw.url, model, plan, prompt, args.max_tokens))
        wall = time.perf_counter() - t0
        st = sw.swarm()
    return {"results": results, "wall_s": wall, "capacity": sum(ch["capacity"] for ch in st["chains"]),
            "fairness": st["fairness"]}


def summarize(run: dict, lights: list[str]) -> dict:
    refused = [r for r in run["results"] if "refused" in r]
    res = [r for r in run["results"] if "refused" not in r]
    by = {}
    for r in res:
        by.setdefault(r["client"], []).append(r)
    light = [r for c in lights for r in by.get(c, [])]
    light_lat = [r["latency"] for r in light]
    light_wait = [r["wait"] for r in light]
    out = {"light_mean_s": statistics.mean(light_lat) if light else None,
           "distinct_outputs": len({r["text"] for r in res}),
           "light_wait_mean_s": statistics.mean(light_wait) if light else None,
           "light_wait_p50_s": statistics.median(light_wait) if light else None,
           "light_p90_s": float(np.percentile(light_lat, 90)) if light else None,
           "requests_per_s": len(res) / run["wall_s"], "wall_s": run["wall_s"], "capacity": run["capacity"],
           "light_refused": sum(r["client"] in lights for r in refused),
           "heavy_refused": sum(r["client"] not in lights for r in refused),
           "refused_codes": sorted({r["refused"] for r in refused})}
    heavy = [r["latency"] for c, rs in by.items() if c not in lights for r in rs]
    if heavy:
        out["heavy_mean_s"] = statistics.mean(heavy)
    fair = run["fairness"]
    out["service_units"] = {c: v["service"] for c, v in fair["clients"].items()}
    # the orchestrator's own figure at the run's end: Jain's index among clients backlogged through the last minute
    out["jain_index"], out["jain_clients"] = fair.get("jain_index"), fair.get("jain_clients", [])
    out["service_units_per_s"] = sum(out["service_units"].values()) / run["wall_s"]
    return out


def _div(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0 (a row of the table with nothing to show)."""
    return None if a is None or not b else a / b


def add_testbed_args(p: argparse.ArgumentParser) -> None:
    """The swarm's shape, shared with bench_deadlines: servers, their slots, lengths and the emulated RTT."""
    p.add_argument("--servers", type=positive_int, default=1)
    p.add_argument("--slots", type=positive_int, default=3, help="jobs a server runs at once (cache slots per block)")
    p.add_argument("--max-length", type=positive_int, default=128)
    p.add_argument("--max-tokens", type=positive_int, default=24)
    p.add_argument("--prompt-tokens", type=positive_int, default=16)
    p.add_argument("--rtt-ms", type=nonnegative_float, default=20.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or short name (default: a tiny random-weight Llama)")
    # checked as parsed, before any work: a rate of 0 divided by zero after the swarm's first probe (or hung: NaN),
    # a negative one failed in numpy, no light client in ``statistics.mean``, a policy's typo failed to start its
    # orchestrator after the probe runs
    add_testbed_args(p)
    p.add_argument("--light", type=positive_int, default=3, help="light clients")
    p.add_argument("--heavy", type=nonnegative_int, default=1, help="heavy clients")
    p.add_argument("--heavy-factor", type=positive_float, default=4.0, help="a heavy client's rate / a light client's")
    p.add_argument("--max-queue", type=nonnegative_int, default=None,
                   help="the orchestrator's --max-queue (default: its own)")
    p.add_argument("--overload", type=positive_float, default=1.3,
                   help="offered load / capacity with the heavy client")
    p.add_argument("--duration-s", type=positive_float, default=45.0, help="arrival window per policy")
    p.add_argument("--policies", type=name_list(("auto", *FAIRNESS_POLICIES)), default="fcfs,dlpm",
                   help="comma-separated --fairness values")
    p.add_argument("--kv-cache", default="slots", choices=["slots", "paged"],
                   help="servers' KV cache (slots: a chain's capacity stays --slots jobs)")
    p.add_argument("--quantum", type=positive_float, default=None, help="--fairness-quantum (default: auto)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the raw results here")
    p.add_argument("--plot", type=output_file, default=None, help="PNG of per-request latency over time per policy")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_fairness_"))
    rng = np.random.default_rng(args.seed)
    prompt = model_and_prompt(args, work, rng)
    lights = [f"light{i}" for i in range(args.light)]
    heavies = ["heavy"] if args.heavy == 1 else [f"heavy{i}" for i in range(args.heavy)]
    keys = {name: f"{name}-key-{i:04d}-0123456789" for i, name in enumerate([*heavies, *lights])}
    keys_file = work / "api-keys"
    keys_file.write_text("".join(f"{n} {k}\n" for n, k in keys.items()))

    # 1. light clients alone: their latency without the heavy client, and the service time that sets the rate
    probe_rate = 0.5
    alone_plan = sorted((t, c, keys[c]) for c in lights for t in arrivals(probe_rate, args.duration_s / 2, rng))
    # at least one request to time (a short --duration-s drew none: statistics.mean of nothing, after the swarm ran)
    alone_plan = alone_plan or [(0.0, lights[0], keys[lights[0]])]
    print(f"light clients alone ({len(alone_plan)} requests) ...", flush=True)
    alone = run_policy(args, "fcfs", alone_plan, keys_file, prompt)
    service = statistics.mean(r["service"] for r in alone["results"] if "service" in r)
    cap_rate = alone["capacity"] / service  # requests/s the chains complete when full
    rate = args.overload * cap_rate / (args.light + len(heavies) * args.heavy_factor)
    print(f"capacity {alone['capacity']} jobs, service {service:.2f} s -> {cap_rate:.2f} req/s; light rate "
          f"{rate:.3f}/s each, {len(heavies)} heavy {args.heavy_factor * rate:.3f}/s each (offered "
          f"{args.overload:g}x capacity)", flush=True)
    plan = sorted([(t, c, keys[c]) for c in lights for t in arrivals(rate, args.duration_s, rng)]
                  + [(t, h, keys[h]) for h in heavies for t in arrivals(args.heavy_factor * rate, args.duration_s, rng)])
    # the light clients alone: exactly the mixed runs' light requests (same times), without the heavy clients
    alone_plan = [x for x in plan if x[1] in lights]
    if not alone_plan:
        print(f"error: no light client's request arrives in --duration-s {args.duration_s:g} at {rate:.3g} req/s "
              "each: make it longer", file=sys.stderr)
        return 2
    print(f"light clients alone, the mixed runs' light requests ({len(alone_plan)}) ...", flush=True)
    alone = run_policy(args, "fcfs", alone_plan, keys_file, prompt)
    alone_mean = statistics.mean(r["latency"] for r in alone["results"] if "latency" in r)
    policies = args.policies
    runs, summ = {}, {}
    for pol in policies:
        print(f"--fairness {pol}: {len(plan)} requests over {args.duration_s:g} s ...", flush=True)
        runs[pol] = run_policy(args, pol, plan, keys_file, prompt)
        summ[pol] = summarize(runs[pol], lights)
    base = summ[policies[0]]
    print(f"\nlight clients alone: mean latency {alone_mean:.2f} s ({len(alone_plan)} requests)")
    print(f"{'':34s}" + "".join(f"{pol:>12s}" for pol in policies))
    rows = (("light mean latency (s)", lambda s: s["light_mean_s"]),
            ("light mean / alone", lambda s: _div(s["light_mean_s"], alone_mean)),
            ("light P90 latency (s)", lambda s: s["light_p90_s"]),
            ("light wait mean / median (s)", lambda s: s["light_wait_mean_s"]),
            ("", lambda s: s["light_wait_p50_s"]),
            ("heavy mean latency (s)", lambda s: s.get("heavy_mean_s")),
            ("throughput (req/s)", lambda s: s["requests_per_s"]),
            ("throughput / " + policies[0], lambda s: _div(s["requests_per_s"], base["requests_per_s"])),
            ("service units/s / " + policies[0], lambda s: _div(s["service_units_per_s"], base["service_units_per_s"])),
            ("light requests refused (429)", lambda s: s["light_refused"]),
            ("heavy requests refused (429)", lambda s: s["heavy_refused"]),
            ("distinct greedy outputs", lambda s: s["distinct_outputs"]))
    for name, f in rows:  # "-" where there is nothing to show (no heavy client, every light request refused)
        print(f"{name:34s}" + "".join(f"{'-' if f(summ[pol]) is None else format(f(summ[pol]), '.3f'):>12s}"
                                      for pol in policies))
    print(f"{'Jain (backlogged clients), API':34s}" + "".join(
        f"{'-' if summ[pol]['jain_index'] is None else format(summ[pol]['jain_index'], '.3f'):>12s}"
        for pol in policies))
    print(f"{'  over clients':34s}" + "".join(f"{','.join(summ[pol]['jain_clients']) or '-':>12s}" for pol in policies))
    for pol in policies:
        if summ[pol]["refused_codes"]:
            print(f"--fairness {pol}: refusals {', '.join(summ[pol]['refused_codes'])}")
    texts = {r["text"] for run in [alone, *runs.values()] for r in run["results"] if "text" in r}
    if len(texts) != 1:  # same prompt, greedy: every reply must be the same text
        print(f"ERROR: {len(texts)} distinct greedy outputs for one prompt", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "alone_mean_s": alone_mean, "rate": rate,
                                               "summary": summ, "runs": {k: v["results"] for k, v in runs.items()}},
                                              indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 3.6), sharey=True, squeeze=False)
        for ax, pol in zip(axes[0], policies):
            for c, color in [*[(h, "tab:red") for h in heavies], *[(x, "tab:blue") for x in lights]]:
                pts = [(r["sent"], r["latency"]) for r in runs[pol]["results"] if r["client"] == c and "latency" in r]
                if pts:
                    ax.scatter(*zip(*pts), s=8, color=color, label=("light" if c in lights else "heavy")
                               if c in (heavies[0], lights[0]) else None)
            ax.axhline(alone_mean, color="gray", ls="--", lw=1, label="light alone (mean)")
            ax.set_title(f"--fairness {pol}")
            ax.set_xlabel("request sent (s)")
        axes[0][0].set_ylabel("latency (s)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
