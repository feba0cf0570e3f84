"""What relaying costs a volunteer behind NAT: one chain whose second hop is a server on a public host vs the same
chain whose second hop sits behind NAT and is reached through the orchestrator as a circuit relay (issue 20).

    python scripts/bench_netns.py [--model smollm2-135m | --tiny] [--max-tokens 32] [--rounds 3] [--json out.json]

Root only (network namespaces, nftables). Two swarms run side by side in one lab, each an orchestrator and two
servers on hosts of their own: ``direct`` (front + a public server) and ``relayed`` (front + a server in a home
namespace behind a masquerading router). Requests alternate between the swarms (order reversed every round; the
machine is shared), in both relay modes: ``orchestrator`` (the orchestrator calls each hop; a NAT'd server's
calls ride the connection it opened to the orchestrator) and ``push`` (the front server pushes to the second
hop, which for the NAT'd server goes through the relay). Prints tokens/s, time per token, the orchestrator's
ping to the second hop, and the ratio relayed / direct; outputs must be token-identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import output_file, positive_int  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_netns_swarm", ROOT / "scripts" / "netns_swarm.py")
nl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nl
_spec.loader.exec_module(nl)

PROMPTS = ["Explain what a network address translator does, in three sentences.",
           "Write a short poem about a lighthouse.",
           "List five uses of a paperclip."]
RELAYS = ("orchestrator", "push")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama (fast; no real text)")
    ap.add_argument("--max-tokens", type=positive_int, default=32)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--max-length", type=positive_int, default=256)
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args()
    for check in (nl.available, nl.nat_available):
        ok, why = check()
        if not ok:
            print(f"cannot build the lab: {why}", file=sys.stderr)
            return 2

    from petals_chain.swarm.local import LocalServer, model_memory
    from petals_chain.swarm.netns import NetnsSwarm

    tmp = tempfile.TemporaryDirectory(prefix="bench-netns-")
    model = args.model
    if args.tiny:
        from petals_chain.swarm.tiny_model import build_tiny_model

        model = build_tiny_model(Path(tmp.name) / "tiny", family="llama", num_layers=8)
    n_layers, s_m, s_c = model_memory(model, args.max_length)
    half = (n_layers + 1) // 2
    mem = half * s_m + 32 * s_c
    extra = ["--max-blocks", str(half)]
    swarms: dict[str, NetnsSwarm] = {}
    with nl.NetnsLab(tag="bench-netns") as lab:
        try:
            for name, nat in (("direct", False), ("relayed", True)):
                sw = NetnsSwarm(lab, model, [], max_length=args.max_length, log_dir=Path(tmp.name) / name,
                                orchestrator_args=["--replan-interval-s", "3600"], orchestrator_host=f"o-{name[:3]}")
                sw.start()
                sw.add_server(LocalServer(f"{name[:3]}-front", mem, tau_p=0.05, extra_args=extra))
                sw.add_server(LocalServer(f"{name[:3]}-second", mem, tau_p=0.05, extra_args=extra), nat=nat)
                swarms[name] = sw
            for name, sw in swarms.items():
                sw.wait_until(lambda st: st["ready"] and all(s["state"] == "online" for s in st["servers"])
                              and len(st["servers"]) == 2, 600, f"the {name} swarm")
            reach = {name: {s["public_name"]: s["reachability"] for s in sw.swarm()["servers"]}
                     for name, sw in swarms.items()}
            print("reachability:", reach, flush=True)
            assert reach["relayed"]["rel-second"] == "relayed", reach
            clients = {name: sw.client() for name, sw in swarms.items()}
            samples: dict[tuple[str, str], list[float]] = {(n, r): [] for n in swarms for r in RELAYS}
            outputs: dict[tuple[str, str], list[int]] = {}
            for rnd in range(args.rounds):
                order = [(n, r) for n in swarms for r in RELAYS]
                for name, relay in (order if rnd % 2 == 0 else order[::-1]):
                    for p in PROMPTS:
                        t0 = time.perf_counter()
                        c = clients[name].complete(p, max_tokens=args.max_tokens, relay=relay, ignore_eos=True)
                        dt = time.perf_counter() - t0
                        key = (p, relay)
                        if key in outputs and outputs[key] != c.token_ids:
                            raise AssertionError(f"outputs differ for {relay!r} on {name}: {p!r}")
                        outputs.setdefault(key, c.token_ids)
                        samples[(name, relay)].append(len(c.token_ids) / dt)
            relay_stats = {name: sw.swarm().get("relay", {}) for name, sw in swarms.items()}
            rtt = {name: next((s["rtt_s"] for s in sw.swarm()["servers"] if s["public_name"].endswith("second")), None)
                   for name, sw in swarms.items()}
        finally:
            for sw in swarms.values():
                sw.stop()
    rows = []
    print(f"\n{'relay':<14}{'second hop':<12}{'tokens/s':>10}{'ms/token':>10}{'ping ms':>9}{'relayed/direct':>16}")
    for relay in RELAYS:
        base = statistics.median(samples[("direct", relay)])
        for name in swarms:
            tps = statistics.median(samples[(name, relay)])
            ping = rtt[name] * 1e3 if rtt[name] is not None else float("nan")
            ratio = tps / base
            rows.append({"relay": relay, "second_hop": name, "tokens_per_s": tps, "ms_per_token": 1e3 / tps,
                         "ping_ms": ping, "throughput_vs_direct": ratio})
            print(f"{relay:<14}{name:<12}{tps:>10.2f}{1e3 / tps:>10.1f}{ping:>9.2f}{ratio:>16.3f}")
    for name, st in relay_stats.items():  # a push the next hop never got is pushed by the orchestrator (a rescue)
        print(f"{name}: relay passes {st.get('passes')}, push rescues {st.get('push_rescues')}")
    print("outputs identical across the two swarms and both relay modes")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model if not args.tiny else "tiny"), "rows": rows, "relay": relay_stats,
                                               "max_tokens": args.max_tokens, "rounds": args.rounds}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
