"""One user's tokens/s over the wide area: relay through the orchestrator vs server-to-server push, each with and
without speculative decoding (issue 19), side by side.

    python scripts/bench_latency.py [--model smollm2-135m | --tiny] [--rtt-ms 50] [--hops 3] [--max-tokens 96]
                                    [--rounds 2] [--device cpu|cuda] [--dtype float32] [--decode-graph cuda]
                                    [--temperature 0.8 --seed 7] [--json out.json]

Real processes: an orchestrator and ``--hops`` servers (each may hold at most ``ceil(L / hops)`` blocks, so the
one chain has ``--hops`` hops), every server emulating ``--rtt-ms`` of round trip per relay step (the link between
the orchestrator and it). One session at a time, greedy (or sampled with a seed: ``--temperature``), on
input-grounded tasks (rewrite a given text, fix a function, answer by quoting a passage: the output repeats spans
of the prompt, prompt lookup's case). Each task runs in the four modes of :data:`MODES` (``relay`` x
``speculative`` request fields) in turn, ``--rounds`` times each (order reversed every other round; the machine is
shared), on the same swarm, and the outputs must be token-identical (a seed draws the same tokens with drafts).
Prints tokens/s per mode and its ratio to the paper's relay, network legs on the critical path per generated
token, and the drafts' acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, nonnegative_int, output_file, positive_int  # noqa: E402

# (relay, speculative): the paper's relay first (the ratios' base), then server-to-server push, then each with drafts
MODES = [("orchestrator", "none"), ("push", "none"), ("orchestrator", "ngram"), ("push", "ngram")]
TASKS = [
    ("rewrite", "Rewrite the following text exactly, but in the past tense:\n\n"
                "The committee meets every Tuesday in the small room on the third floor. The chair opens the "
                "meeting, reads the minutes of the last session and asks whether anyone has corrections. Then the "
                "treasurer reports on the budget, and the members discuss the proposals that were sent in during "
                "the week. At the end, the secretary writes down every decision and sends the notes to all members."),
    ("code", "Add type hints to this Python function and return the whole function:\n\n"
             "def moving_average(values, window):\n"
             "    if window <= 0:\n"
             "        raise ValueError('window must be positive')\n"
             "    out = []\n"
             "    total = 0.0\n"
             "    for i, v in enumerate(values):\n"
             "        total += v\n"
             "        if i >= window:\n"
             "            total -= values[i - window]\n"
             "        if i >= window - 1:\n"
             "            out.append(total / window)\n"
             "    return out\n"),
    ("quote", "Here is a passage:\n\n\"The river rises in the hills north of the town, runs south through the old "
              "market square, and meets the sea at the harbour, where the fishing boats come in every morning before "
              "sunrise.\"\n\nQuote the sentence of the passage that says where the river meets the sea, word for "
              "word."),
]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama (fast; no real text)")
    ap.add_argument("--rtt-ms", type=nonnegative_float, default=50.0)
    ap.add_argument("--hops", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=positive_int, default=96)
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--max-length", type=positive_int, default=1024)
    ap.add_argument("--device", default="cpu", help="where the servers' blocks and the orchestrator's head run")
    ap.add_argument("--dtype", default="float32", help="the servers' and the head's dtype")
    ap.add_argument("--decode-graph", default="off", choices=["off", "cuda", "eager"],
                    help="the servers' --decode-graph (cuda: one-token steps replayed as CUDA graphs)")
    ap.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy; else sampled with --seed")
    ap.add_argument("--seed", type=nonnegative_int, default=7)
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args()
    placement = ["--device", args.device, "--dtype", args.dtype]

    import httpx

    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory
    from petals_chain.swarm.registry import registry_path

    with tempfile.TemporaryDirectory() as d:
        if args.tiny:
            from petals_chain.swarm.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(d) / "tiny", family="llama", num_layers=6))
        else:
            model = args.model if Path(args.model).exists() else str(registry_path(args.model))
        L, s_m, s_c = model_memory(model, args.max_length)
        per = math.ceil(L / args.hops)
        server_args = ["--max-blocks", str(per), *placement, "--decode-graph", args.decode_graph]
        servers = [LocalServer(f"s{i}", per * s_m + 8 * per * s_c, emulate_rtt_ms=args.rtt_ms, tau_p=0.05,
                               extra_args=server_args) for i in range(args.hops)]
        sw = LocalSwarm(model, servers, max_length=args.max_length, arrival_rate=0.5, log_dir=Path(d) / "logs",
                        orchestrator_args=placement)
        sw.start()
        try:
            st = sw.wait_until(lambda st: st["ready"] and st["chains"]
                               and all(s["state"] == "online" for s in st["servers"]), 600, "the chain")
            hops = [len(ch["servers"]) for ch in st["chains"]]
            url, name = sw.url, st["model"]
            rows = []
            with httpx.Client(base_url=url, timeout=1800) as c:
                def run(prompt: str, mode: tuple[str, str]) -> dict:
                    relay, spec = mode
                    before = c.get("/api/v1/swarm").json()["relay"]
                    r = c.post("/v1/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": prompt}],
                        "temperature": args.temperature, **({"seed": args.seed} if args.temperature > 0 else {}),
                        "max_tokens": args.max_tokens, "speculative": spec, "relay": relay})
                    r.raise_for_status()
                    after = c.get("/api/v1/swarm").json()["relay"]
                    info = r.json()["petals_chain"][0]

                    def delta(*path: str) -> float:
                        a, b = after, before
                        for k in path:
                            a, b = a[k], b[k]
                        return a - b

                    return {"tokens": info["token_ids"], "service_s": info["service_s"],
                            "steps": delta("relay_steps"), "legs": delta("critical_legs", relay),
                            "drafted": delta("speculative", "drafted_tokens"),
                            "accepted": delta("speculative", "accepted_tokens"),
                            "passes": delta("speculative", "passes")}

                run(TASKS[0][1], MODES[0])  # warm-up (the chain's first job)
                run(TASKS[0][1], MODES[1])
                for task, prompt in TASKS:
                    res: dict = {m: [] for m in MODES}
                    for rnd in range(args.rounds):
                        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                            res[mode].append(run(prompt, mode))
                    base = res[MODES[0]][0]["tokens"]
                    row = {"task": task, "tokens": len(base),
                           "identical": all(r["tokens"] == base for m in res for r in res[m])}
                    tps = {m: statistics.median(len(r["tokens"]) / r["service_s"] for r in res[m]) for m in MODES}
                    for m in MODES:
                        key = "+".join(m)
                        row[f"tokens_per_s[{key}]"] = tps[m]
                        row[f"ratio[{key}]"] = tps[m] / tps[MODES[0]]
                        row[f"legs_per_token[{key}]"] = statistics.mean(r["legs"] / len(r["tokens"]) for r in res[m])
                    sp = [r for m in MODES if m[1] == "ngram" for r in res[m]]
                    drafted, accepted, passes = (sum(r[k] for r in sp) for k in ("drafted", "accepted", "passes"))
                    row["acceptance_rate"] = accepted / drafted if drafted else 0.0
                    row["accepted_per_pass"] = accepted / passes if passes else 0.0
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
                # where a decode step's time goes, per hop (EWMA over the relayed steps; the planner's view)
                st = c.get("/api/v1/swarm").json()
                by_id = {s["peer_id"]: s for s in st["servers"]}
                per_hop = [{"server": by_id[p]["public_name"], "blocks": by_id[p]["num_blocks"],
                            "compute_ms": _ms(by_id[p].get("step_compute_s")),
                            "network_ms": _ms(by_id[p].get("step_network_s"))} for p in st["chains"][0]["servers"]]
        finally:
            sw.stop()
    print(f"\n{args.hops}-hop chain {hops} on {args.device} ({args.dtype}, decode graph {args.decode_graph}), "
          f"emulated RTT {args.rtt_ms:g} ms per hop, "
          f"{'greedy' if args.temperature <= 0 else f'sampled (temperature {args.temperature:g}, seed {args.seed})'}, "
          f"{args.max_tokens} tokens max; tokens/s = generated "
          f"tokens / service time (median of {args.rounds}); ratio vs {'+'.join(MODES[0])}; legs = network legs "
          f"per generated token on the critical path")
    print(f"{'task':8} {'tokens':>6} " + " ".join(f"{'+'.join(m):>26}" for m in MODES) + "  accept  identical")
    for r in rows:
        cells = [f"{r[f'tokens_per_s[{k}]']:6.2f} ({r[f'ratio[{k}]']:4.2f}x, {r[f'legs_per_token[{k}]']:4.2f} legs)"
                 for k in ("+".join(m) for m in MODES)]
        print(f"{r['task']:8} {r['tokens']:6d} " + " ".join(f"{c:>26}" for c in cells)
              + f"  {r['acceptance_rate']:6.2f}  {r['identical']}")
    print("per decode step, each hop (relayed steps' EWMA): " + ", ".join(
        f"{h['server']} ({h['blocks']} blocks): compute {h['compute_ms']} ms, network {h['network_ms']} ms"
        for h in per_hop))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "per_hop": per_hop}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
