"""``/v1/embeddings``: one request of N inputs (run as concurrent jobs, at most ``--max-choices`` at a time) against
the same N inputs sent one request after another, on a local swarm (an orchestrator and servers whose every hop
message is delayed by ``--rtt-ms``, as wide-area links are). Prints the wall time of each, side by side, and their
ratio; both give the same vectors (checked).

    PETALS_CHAIN_LAUNCH=exec python scripts/bench_embeddings.py [--model tiny] [--inputs 32] [--rtt-ms 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, positive_int  # noqa: E402

WORDS = "river bridge market tower mill school farmer harvest lantern road forest meadow stone bell".split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model source, or 'tiny' (a random-weight 4-layer Llama)")
    p.add_argument("--inputs", type=positive_int, default=32)
    p.add_argument("--servers", type=positive_int, default=2, help="servers, each holding a share of the blocks")
    p.add_argument("--rtt-ms", type=nonnegative_float, default=20.0, help="emulated delay of each hop message")
    p.add_argument("--max-choices", type=positive_int, default=8, help="the orchestrator's --max-choices")
    p.add_argument("--max-length", type=positive_int, default=128)
    args = p.parse_args()

    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from petals_chain.swarm.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny", family="llama", num_layers=4))
        L, s_m, s_c = model_memory(model, args.max_length)
        share = -(-L // args.servers)
        servers = [LocalServer(f"s{i}", int(share * (s_m + 2 * args.max_choices * s_c)), tau_p=0.01,
                               emulate_rtt_ms=args.rtt_ms, extra_args=["--max-blocks", str(share)])
                   for i in range(args.servers)]
        texts = [f"{WORDS[i % len(WORDS)]} number {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8))
                 for i in range(args.inputs)]
        with LocalSwarm(model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=Path(tmp) / "logs",
                        orchestrator_args=["--max-choices", str(args.max_choices)]) as sw:
            st = sw.wait_ready(timeout=600)
            name = st["model"]
            hops = sorted({len(ch["servers"]) for ch in st["chains"]})
            with httpx.Client(base_url=sw.url, timeout=600) as http:
                def embed(inputs: list[str]) -> list[list[float]]:
                    r = http.post("/v1/embeddings", json={"model": name, "input": inputs})
                    r.raise_for_status()
                    return [d["embedding"] for d in r.json()["data"]]

                embed(texts[:2])  # warm-up
                t0 = time.perf_counter()
                one_by_one = [embed([t])[0] for t in texts]
                sequential = time.perf_counter() - t0
                t0 = time.perf_counter()
                together = embed(texts)
                batched = time.perf_counter() - t0
    same = max(abs(a - b) for u, v in zip(one_by_one, together) for a, b in zip(u, v))
    print(f"model {args.model}, chains of {hops} hops, {args.rtt_ms:g} ms per hop message, {args.inputs} inputs, "
          f"--max-choices {args.max_choices}")
    for label, seconds in (("one request per input, one after another", sequential),
                           (f"one request of {args.inputs} inputs", batched)):
        print(f"  {label:42s}{seconds:8.2f} s")
    print(f"  ratio one request / one by one: {batched / sequential:.3f}   (largest difference of a vector's "
          f"component: {same:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
