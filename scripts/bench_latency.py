"""One user's tokens/s over the wide area: plain relaying vs speculative decoding (issue 19), side by side.

    python scripts/bench_latency.py [--model smollm2-135m | --tiny] [--rtt-ms 50] [--hops 3] [--max-tokens 96]
                                    [--rounds 2] [--json out.json]

Real processes: an orchestrator and ``--hops`` servers (each may hold at most ``ceil(L / hops)`` blocks, so the
one chain has ``--hops`` hops), every server emulating ``--rtt-ms`` of round trip per relay step (the link between
the orchestrator and it). One session at a time, greedy, on input-grounded tasks (rewrite a given text, fix a
function, answer by quoting a passage: the output repeats spans of the prompt, prompt lookup's case). Each task
runs with ``speculative: "none"`` and ``"ngram"`` alternately (``--rounds`` times each; the machine is shared),
on the same swarm, and the outputs must be token-identical. Prints tokens/s per mode and their ratio, drafts'
acceptance rate, accepted tokens per verification pass and relay steps per generated token.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama (fast; no real text)")
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--hops", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

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
        servers = [LocalServer(f"s{i}", per * s_m + 8 * per * s_c, emulate_rtt_ms=args.rtt_ms, tau_p=0.05,
                               extra_args=["--max-blocks", str(per)]) for i in range(args.hops)]
        sw = LocalSwarm(model, servers, max_length=args.max_length, arrival_rate=0.5, log_dir=Path(d) / "logs")
        sw.start()
        try:
            st = sw.wait_until(lambda st: st["ready"] and st["chains"]
                               and all(s["state"] == "online" for s in st["servers"]), 600, "the chain")
            hops = [len(ch["servers"]) for ch in st["chains"]]
            url, name = sw.url, st["model"]
            rows = []
            with httpx.Client(base_url=url, timeout=1800) as c:
                def run(prompt: str, mode: str) -> dict:
                    before = c.get("/api/v1/swarm").json()["relay"]
                    t0 = time.perf_counter()
                    r = c.post("/v1/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                        "max_tokens": args.max_tokens, "speculative": mode})
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    after = c.get("/api/v1/swarm").json()["relay"]
                    info = r.json()["petals_chain"][0]
                    toks = info["token_ids"]
                    return {"tokens": toks, "seconds": dt, "service_s": info["service_s"],
                            "steps": after["relay_steps"] - before["relay_steps"],
                            "drafted": (after["speculative"]["drafted_tokens"]
                                        - before["speculative"]["drafted_tokens"]),
                            "accepted": (after["speculative"]["accepted_tokens"]
                                         - before["speculative"]["accepted_tokens"]),
                            "passes": after["speculative"]["passes"] - before["speculative"]["passes"]}

                run(TASKS[0][1], "none")  # warm-up (the chain's first job)
                for task, prompt in TASKS:
                    res = {"none": [], "ngram": []}
                    for rnd in range(args.rounds):
                        for mode in (("none", "ngram") if rnd % 2 == 0 else ("ngram", "none")):
                            res[mode].append(run(prompt, mode))
                    same = all(r["tokens"] == res["none"][0]["tokens"] for m in res for r in res[m])
                    n_tok = len(res["none"][0]["tokens"])
                    tps = {m: statistics.median(len(r["tokens"]) / r["service_s"] for r in res[m]) for m in res}
                    sp = res["ngram"]
                    drafted, accepted, passes = (sum(r[k] for r in sp) for k in ("drafted", "accepted", "passes"))
                    row = {"task": task, "tokens": n_tok, "identical": same,
                           "tokens_per_s_plain": tps["none"], "tokens_per_s_ngram": tps["ngram"],
                           "ratio": tps["ngram"] / tps["none"],
                           "acceptance_rate": accepted / drafted if drafted else 0.0,
                           "accepted_per_pass": accepted / passes if passes else 0.0,
                           "steps_per_token_plain": statistics.mean(r["steps"] / len(r["tokens"]) for r in res["none"]),
                           "steps_per_token_ngram": statistics.mean(r["steps"] / len(r["tokens"]) for r in sp)}
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
        finally:
            sw.stop()
    print(f"\n{args.hops}-hop chain {hops}, emulated RTT {args.rtt_ms:g} ms per hop, greedy, {args.max_tokens} "
          f"tokens max; tokens/s = generated tokens / service time (median of {args.rounds})")
    print(f"{'task':8} {'tokens':>6} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} {'accept':>7} "
          f"{'per pass':>8} {'steps/tok plain':>15} {'ngram':>6} identical")
    for r in rows:
        print(f"{r['task']:8} {r['tokens']:6d} {r['tokens_per_s_plain']:11.2f} {r['tokens_per_s_ngram']:11.2f} "
              f"{r['ratio']:5.2f}x {r['acceptance_rate']:7.2f} {r['accepted_per_pass']:8.2f} "
              f"{r['steps_per_token_plain']:15.2f} {r['steps_per_token_ngram']:6.2f} {r['identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
