"""Per-step cost of the orchestrator's token sampling: batched ``sample_batch`` vs a loop of ``PerRequestSampler``.

Both sample the same rows with the same parameter mix; the two measurements alternate (which one goes first
flips every repeat) so machine noise hits both alike, and the table reports medians.

    python scripts/bench_sampling.py --threads 1            # full table
    python scripts/bench_sampling.py --quick                # smaller, fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from petals_chain.orchestrator.sampling import (
    PerRequestSampler,
    SamplingParams,
    SequenceSampler,
    sample_batch,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_int, positive_int  # noqa: E402

CONTEXT = 200  # prompt tokens per sequence (what the repetition penalty scans)

# Parameter mix, repeated every 8 rows (batch 1 is row 0).
MIX: list[tuple[str, dict]] = [
    ("T=0.7 top_p=0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("T=0.7 top_p=0.9 rep=1.1", {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}),
    ("T=0.7 top_p=0.9 presence=0.3 frequency=0.3 logit_bias(2)",
     {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.3, "frequency_penalty": 0.3,
      "logit_bias": {13: -100.0, 42: 2.0}}),
    ("T=0.7 top_p=0.9 rep=1.1", {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}),
    ("T=0.8 top_k=50", {"temperature": 0.8, "top_k": 50}),
    ("T=1.0 min_p=0.05", {"temperature": 1.0, "min_p": 0.05}),
    ("greedy rep=1.1", {"temperature": 0.0, "repetition_penalty": 1.1}),
    ("T=1.0 (no filter)", {"temperature": 1.0}),
]
FLAT_EVERY = 10  # rows 9, 19, 29, ... get a flat ("uncertain step") distribution


def make_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """LM-like logits: a N(0, 2^2) bulk over the vocabulary plus 40 plausible tokens at 9 + 2.5 N(0, 1), which gives
    a top-1 probability around 0.5 at T=1 and a nucleus (top_p 0.9, T=0.7) of a few tokens, like a real LM's
    typical step; every 10th row has no plausible tokens (a flat, uncertain step: its nucleus has thousands of
    tokens, past the first 256 candidates, so the batched path sizes it and retries with a wider topk)."""
    x = torch.randn(batch, vocab, generator=gen) * 2.0
    for r in range(batch):
        if r % FLAT_EVERY != FLAT_EVERY - 1:
            idx = torch.randperm(vocab, generator=gen)[:40]
            x[r, idx] += 9.0 + 2.5 * torch.randn(40, generator=gen)
    return x


def describe(x: torch.Tensor) -> str:
    peaked = [r for r in range(x.shape[0]) if r % FLAT_EVERY != FLAT_EVERY - 1]
    p1 = torch.softmax(x[peaked], dim=1).amax(dim=1)
    ps = torch.softmax(x[peaked] / 0.7, dim=1).sort(dim=1, descending=True).values.cumsum(1)
    nucleus = (ps < 0.9).sum(1) + 1
    return (f"peaked rows: top-1 prob at T=1 median {p1.median().item():.2f}; nucleus (T=0.7, top_p=0.9) median "
            f"{nucleus.median().item():.0f} tokens, max {nucleus.max().item()}")


def bench(vocab: int, batch: int, steps: int, repeats: int, seed: int, kind: int = 0) -> tuple[float, float]:
    """Median ms/step (batched, loop); row i uses MIX[(i + kind) % len(MIX)]."""
    gen = torch.Generator().manual_seed(seed)
    pool = [make_logits(batch, vocab, gen) for _ in range(steps)]
    params = [SamplingParams(**MIX[(i + kind) % len(MIX)][1], seed=seed + i) for i in range(batch)]
    prompts = [torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(batch)]

    def run_batched() -> float:
        seqs = [SequenceSampler(p, ctx) for p, ctx in zip(params, prompts)]
        t0 = time.perf_counter()
        for x in pool:
            for s, c in zip(seqs, sample_batch(x, seqs)):
                s.append(c.token)
        return (time.perf_counter() - t0) / steps

    def run_loop() -> float:
        samplers = [PerRequestSampler(p) for p in params]
        ctxs = [list(ctx) for ctx in prompts]
        t0 = time.perf_counter()
        for x in pool:
            for i, s in enumerate(samplers):
                ctxs[i].append(s.next_token(x[i], ctxs[i]))
        return (time.perf_counter() - t0) / steps

    run_batched(), run_loop()  # warm-up
    tb, tl = [], []
    for r in range(repeats):
        if r % 2 == 0:
            tb.append(run_batched())
            tl.append(run_loop())
        else:
            tl.append(run_loop())
            tb.append(run_batched())
    return statistics.median(tb) * 1e3, statistics.median(tl) * 1e3


def profile(vocab: int, batch: int, seed: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    gen = torch.Generator().manual_seed(seed)
    x = make_logits(batch, vocab, gen)
    seqs = [SequenceSampler(SamplingParams(**MIX[i % len(MIX)][1], seed=i),
                            torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist()) for i in range(batch)]
    sample_batch(x, seqs)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            sample_batch(x, seqs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=positive_int, default=7, help="alternating measurement pairs per cell (median)")
    ap.add_argument("--steps", type=positive_int, default=4, help="sampling steps per measurement")
    ap.add_argument("--quick", action="store_true", help="3 repeats of 2 steps")
    ap.add_argument("--vocab", type=positive_int, nargs="+", default=[49152, 128256])
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--per-kind", action="store_true", help="also batch 1 for every entry of the mix")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of sample_batch at the largest cell")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats, args.steps = 3, 2
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"parameter mix (row i uses entry i % {len(MIX)}; every sequence has {CONTEXT} context tokens, grows "
          f"by the sampled tokens):")
    for i, (name, _) in enumerate(MIX):
        print(f"  {i}: {name}")
    print(f"logits: {make_logits.__doc__.split(':', 1)[1].strip()}")
    sample = make_logits(64, args.vocab[-1], torch.Generator().manual_seed(1))
    print(f"  measured at vocab {args.vocab[-1]}: {describe(sample)}")
    print(f"median of {args.repeats} alternating repeats x {args.steps} steps\n")
    print(f"{'vocab':>7} {'batch':>5} {'batched ms/step':>16} {'loop ms/step':>13} {'batched/loop':>13}")
    for vocab in args.vocab:
        for batch in args.batch:
            tb, tl = bench(vocab, batch, args.steps, args.repeats, args.seed)
            print(f"{vocab:>7} {batch:>5} {tb:>16.3f} {tl:>13.3f} {tb / tl:>13.3f}", flush=True)
    if args.per_kind:
        print(f"\nbatch 1, each parameter set alone:\n{'vocab':>7} {'set':<58} {'batched':>8} {'loop':>8} {'ratio':>6}")
        for vocab in args.vocab:
            for kind, (name, _) in enumerate(MIX):
                tb, tl = bench(vocab, 1, args.steps, args.repeats, args.seed, kind)
                print(f"{vocab:>7} {name:<58} {tb:>8.3f} {tl:>8.3f} {tb / tl:>6.3f}", flush=True)
    if args.profile:
        profile(max(args.vocab), max(args.batch), args.seed)


if __name__ == "__main__":
    main()
