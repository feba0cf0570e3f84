"""Time to first token with and without the servers' prefix caches, on the real model through a 3-hop chain.

Two swarms in turn (an orchestrator and three servers that can each hold only a third of the blocks, so every
chain has three hops, on loopback): servers with the prefix cache (the default) and with ``--no-prefix-cache``.
Each runs the same two workloads, and the ratios are printed side by side:

* **shared system prompt**: ``--requests`` chat requests one after another, each the same ``--system-tokens``
  system prompt plus its own question; time to first token (TTFT: the first streamed text) per request, mean
  over all requests (the first one computes the prefix in both swarms), and the prompt-cache hit rate the
  orchestrator reports (``/api/v1/swarm``: cached / prompt tokens);
* **two-turn conversation**: a session whose first turn carries the long prompt and generates ``--tokens``
  tokens, and a short second turn; the second turn's TTFT over the first's. Between turns the session gives its
  chain back (the default) where every hop has a prefix cache, and the second turn reuses the first's KV;
  servers without one keep the chain held between turns instead (``--hold-sessions`` behaviour), shown beside.

    python scripts/bench_prefix.py [--model smollm2-135m] [--system-tokens 1000] [--requests 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402

QUESTIONS = ["Who built the bridge?", "Where does the river go?", "What do the farmers grow?",
             "When is the market open?", "Why is the tower closed?", "How old is the mill?",
             "What is the school called?", "Who keeps the lighthouse?"]
WORDS = ("village river bridge market tower mill school farmer harvest lantern road forest meadow stone "
         "bell winter summer festival boat fisherman baker library garden orchard well chapel").split()


def system_prompt(tok, n_tokens: int) -> str:
    """A deterministic rulebook of about ``n_tokens`` tokens."""
    lines, i = ["You are the guide of a small village. Follow these rules when you answer."], 0
    while len(tok("\n".join(lines))["input_ids"]) < n_tokens:
        a, b, c = WORDS[i % len(WORDS)], WORDS[(3 * i + 1) % len(WORDS)], WORDS[(7 * i + 2) % len(WORDS)]
        lines.append(f"Rule {i + 1}: when asked about the {a}, mention the {b} and never the {c}.")
        i += 1
    return "\n".join(lines)


def ttft_s(pieces) -> float:
    """Seconds until the first non-empty streamed piece (the rest is drained)."""
    t0 = time.perf_counter()
    first = None
    for piece in pieces:
        if first is None and piece:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def run(args, system: str, prefix_cache: bool) -> dict:
    from petals_chain.swarm.local import LocalServer, LocalSwarm, model_memory

    L, s_m, s_c = model_memory(args.model, args.max_length)
    third = -(-L // 3)
    extra = () if prefix_cache else ("--no-prefix-cache",)
    servers = [LocalServer(f"s{i}", int(third * (s_m + 4 * s_c)), extra_args=extra) for i in range(3)]
    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(args.model, servers, max_length=args.max_length, arrival_rate=1.0, log_dir=logs) as sw:
        st = sw.wait_ready(timeout=600)
        hops = sorted({len(ch["servers"]) for ch in st["chains"]})
        client = sw.client()
        client.chat_completion([{"role": "user", "content": "Hello"}], max_tokens=2)  # warm-up
        before = client.swarm()["relay"]
        shared = []
        for r in range(args.requests):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}]
            body = {"model": client.model, "messages": msgs, "max_tokens": args.answer_tokens, "temperature": 0,
                    "stream": True}
            with client._http.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                shared.append(ttft_s(line for line in resp.iter_lines() if '"content":"' in line
                                     and '"content":""' not in line))
        after = client.swarm()["relay"]
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["prompt_cached_tokens"] - before["prompt_cached_tokens"]
        turns = []
        for r in range(args.conversations):
            with client.session(max_length=args.max_length) as s:
                # a conversation of its own: its first tokens differ from the shared prompt's, nothing is cached
                t1 = ttft_s(s.stream(f"Conversation {r + 1}.\n" + system + "\n" + QUESTIONS[r % len(QUESTIONS)],
                                     max_tokens=args.tokens, ignore_eos=True))
                t2 = ttft_s(s.stream(" Thank you. And who lives there?", max_tokens=args.answer_tokens))
            turns.append((t1, t2))
    return {"hops": hops, "shared": shared, "hit_rate": cached / prompt if prompt else 0.0, "turns": turns}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-tokens", type=positive_int, default=1000)
    p.add_argument("--requests", type=positive_int, default=32)
    p.add_argument("--answer-tokens", type=positive_int, default=4, help="tokens generated per shared-prompt request")
    p.add_argument("--conversations", type=positive_int, default=3, help="two-turn conversations")
    p.add_argument("--tokens", type=positive_int, default=32, help="tokens generated by a conversation's first turn")
    p.add_argument("--max-length", type=positive_int, default=1536)
    args = p.parse_args()

    from petals_chain.swarm.sources import resolve_source

    tok = resolve_source(args.model).load_tokenizer()
    system = system_prompt(tok, args.system_tokens)
    n_system = len(tok(system)["input_ids"])
    res = {}
    for on in (True, False):
        label = "prefix cache" if on else "no prefix cache"
        print(f"running: {label} ...", flush=True)
        res[on] = run(args, system, on)
    mean, med = statistics.mean, statistics.median
    on, off = res[True], res[False]
    print(f"\nmodel {args.model}, chains of {on['hops']} hops; system prompt {n_system} tokens")
    print(f"shared system prompt, {args.requests} requests one after another (mean TTFT, first request included):")
    for name, r in (("no prefix cache", off), ("prefix cache", on)):
        print(f"  {name:16s} {mean(r['shared']) * 1000:8.0f} ms   (median {med(r['shared']) * 1000:.0f} ms, "
              f"prompt-cache hit rate {r['hit_rate']:.1%})")
    print(f"  ratio prefix cache / none: {mean(on['shared']) / mean(off['shared']):.3f}")
    print(f"two-turn conversations ({args.conversations}; first turn {n_system}+ tokens, {args.tokens} generated), "
          f"median TTFT (prefix cache: chain released between turns; none: chain held):")
    for name, r in (("no prefix cache", off), ("prefix cache", on)):
        t1, t2 = med(t for t, _ in r["turns"]), med(t for _, t in r["turns"])
        print(f"  {name:16s} turn 1 {t1 * 1000:7.0f} ms   turn 2 {t2 * 1000:7.0f} ms   turn 2 / turn 1 {t2 / t1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
