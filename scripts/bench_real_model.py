"""The swarm's overhead on the real model: ms/token through a 3-hop chain vs ``transformers.generate`` in-process.

Starts an orchestrator and three servers (each can hold only a third of the blocks, so every chain has three
hops) on loopback, no emulated delays, and measures side by side, alternating, in one run:

* ``transformers``: ``model.generate`` greedy on the same dequantized model in this process (1 thread, as each
  swarm process runs with ``OMP_NUM_THREADS=1``), ms per generated token (prefill included, as in the swarm);
* ``swarm, 1 session``: one request through the chain, ms per generated token of its service time;
* ``swarm, 8 sessions``: eight concurrent requests, generated tokens per second over the wall time.

    python scripts/bench_real_model.py [--model smollm2-135m] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402

PROMPTS = ["Explain how a bicycle works.", "Write a short story about a lighthouse keeper.",
           "What are the main causes of rain?", "Describe the city of Paris.", "How do computers store numbers?",
           "Give three tips for learning a language.", "What is photosynthesis?", "Why is the sky blue?"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=positive_int, default=64, help="generated tokens per request (ignore_eos)")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--max-length", type=positive_int, default=512)
    args = p.parse_args()

    import torch

    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory
    from petals_chain.swarm.sources import resolve_source

    torch.set_num_threads(1)
    src = resolve_source(args.model)
    tok = src.load_tokenizer()
    ref = src.load_reference(torch.float32)
    L, s_m, s_c = model_memory(args.model, args.max_length)
    third = -(-L // 3)
    servers = [LocalServer(f"s{i}", int(third * (s_m + 8 * s_c))) for i in range(3)]

    def chat_ids(q: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        return list(getattr(out, "input_ids", out))

    def hf_ms_per_token(q: str) -> float:
        ids = torch.tensor([chat_ids(q)])
        t0 = time.perf_counter()
        with torch.no_grad():
            ref.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                         pad_token_id=tok.eos_token_id)
        return (time.perf_counter() - t0) * 1000 / args.tokens

    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs) as sw:
        st = sw.wait_ready(timeout=300)
        hops = sorted({len(ch["servers"]) for ch in st["chains"]})
        client = sw.client()

        def swarm_one(q: str) -> float:
            c = client.complete(chat_ids(q), max_tokens=args.tokens, ignore_eos=True)
            assert len(c.token_ids) == args.tokens
            return c.service_s * 1000 / args.tokens

        def swarm_concurrent(n: int = 8) -> float:
            done = []

            def one(i: int) -> None:
                c = client.complete(chat_ids(PROMPTS[i % len(PROMPTS)]), max_tokens=args.tokens, ignore_eos=True)
                done.append(len(c.token_ids))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return sum(done) / (time.perf_counter() - t0)

        swarm_one(PROMPTS[0])  # warm-up: first steps allocate, caches fill
        hf_ms_per_token(PROMPTS[0])
        hf, one, conc = [], [], []
        for r in range(args.repeats):
            q = PROMPTS[r % len(PROMPTS)]
            hf.append(hf_ms_per_token(q))
            one.append(swarm_one(q))
            conc.append(swarm_concurrent())
        capacity = sum(ch["capacity"] for ch in sw.swarm()["chains"])
    med = statistics.median
    print(f"model {args.model}, {args.tokens} tokens per request, chains of {hops} hops (capacity {capacity}), "
          f"{args.repeats} alternating repeats, medians")
    print(f"  transformers.generate in-process (1 thread): {med(hf):7.2f} ms/token  ({1000 / med(hf):.1f} tokens/s)")
    print(f"  swarm, 1 session (3-hop chain):               {med(one):7.2f} ms/token  ({1000 / med(one):.1f} tokens/s)")
    print(f"  overhead ratio swarm / transformers:          {med(one) / med(hf):7.2f}x")
    print(f"  swarm, 8 concurrent sessions:                 {med(conc):7.1f} tokens/s "
          f"({med(conc) * med(hf) / 1000:.2f}x one in-process generate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
