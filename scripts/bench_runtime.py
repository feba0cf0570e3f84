"""Per-token decode time of a BlockRunner vs the same layers in transformers (DynamicCache), by prefix length.

    python scripts/bench_runtime.py [--family llama] [--hidden-size 64] [--num-layers 8] [--prefix 16 256 1024]

Builds a tiny random-weight model in a temporary directory, runs a prefill of each prefix length, then
``--steps`` single-token decode steps, and prints the median per-token time of (a) one BlockRunner over all
blocks with the pre-allocated slot cache and (b) the HF model's forward with its DynamicCache (which also
runs embeddings and LM head, a small constant here). Also prints tau_p for one block (footnote 11 workload).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from petals_chain.server.profiling import measure_tau_p
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.checkpoint import cache_kwarg
from petals_chain.swarm.tiny_model import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2"])
    ap.add_argument("--hidden-size", type=positive_int, default=64)
    ap.add_argument("--num-layers", type=positive_int, default=8)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--prefix", type=positive_int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--steps", type=positive_int, default=32)
    ap.add_argument("--threads", type=positive_int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(d, family=args.family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                                num_attention_heads=args.heads)
        max_len = max(args.prefix) + args.steps + 1
        runner = BlockRunner(path, 0, args.num_layers, num_slots=args.num_layers, max_length=max_len,
                             progress=False)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        print(f"{args.family} L={args.num_layers} H={args.hidden_size} threads={args.threads}; "
              f"s_c={runner.s_c} B/slot, blocks={runner.blocks_bytes} B")
        print(f"{'prefix':>7} {'runner ms/token':>16} {'HF ms/token':>12}")
        for prefix in args.prefix:
            x = torch.randn(1, prefix, args.hidden_size)
            runner.allocate("b", 0, args.num_layers)
            runner.forward("b", x, 0)
            ts = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                runner.forward("b", x[:, :1], prefix + i)
                ts.append(time.perf_counter() - t0)
            runner.release("b")
            ids = torch.randint(0, model.config.vocab_size, (1, prefix))
            cache = DynamicCache(config=model.config)
            hs = []
            with torch.no_grad():
                model(ids, use_cache=True, **{cache_kwarg(model): cache})
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    model(ids[:, :1], use_cache=True, **{cache_kwarg(model): cache})
                    hs.append(time.perf_counter() - t0)
            print(f"{prefix:>7} {1e3 * statistics.median(ts):>16.3f} {1e3 * statistics.median(hs):>12.3f}")
        tau = measure_tau_p(path, use_cache=False, progress=False)
        print(f"tau_p (one block, l_in=128, l_out=16): {1e3 * tau:.2f} ms")


if __name__ == "__main__":
    main()
