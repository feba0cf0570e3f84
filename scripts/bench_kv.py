"""Paged vs slot KV cache on one server's blocks, measured side by side (issue 15).

    python scripts/bench_kv.py [--model smollm2-135m | --tiny | --seven-b] [--trace PATH] [--max-length 4096]
                               [--slots 32] [--windows 50] [--sessions 16] [--blocks 4] [--steps 20] [--json]
                               [--device cuda --dtype bfloat16]

``--seven-b``: random weights shaped like Llama-2-7B's blocks (hidden 4096, 32 heads, MLP 11008), for a GPU.

Session lengths (prompt + output tokens) come from the Azure LLM *conversation* trace in ``../shared/data``
(or ``--trace``; without it a synthetic lognormal stand-in with the same mean and P90), capped at
``--max-length`` (a longer request fits in no slot either).

1. **Admission at equal memory.** Two runners over ``--blocks`` blocks hold the same KV memory: ``--slots``
   slots of ``--max-length`` tokens per block. ``slots`` admits one session per slot whatever its length;
   ``paged`` admits a session while the pages its declared length needs are available. For each of
   ``--windows`` windows of consecutive trace requests, sessions open in trace order until the first one is
   refused; the ratio is paged / slots sessions admitted (ideal: max_length / mean length, about 3.0).
2. **Decode step time at ``--sessions`` sessions.** Both runners hold the same ``--sessions`` sessions (trace
   lengths, prefilled through the real blocks); one batched decode step of all of them (the batcher's
   ``run_batch``, as a server runs it) is timed ``--steps`` times per mode, alternating modes (A/B/A/B: the
   machine is shared). The ratio is the median paged step / the median slots step. Before it, ``--churn``
   random opens and closes of other sessions fragment the paged pool (half of it stays held by them), so
   that some page tables are scattered (read by one gathering copy) as on a server that has run a while.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from petals_chain.server.batching import BatchItem, run_batch
from petals_chain.server.kv_cache import NoCapacityError
from petals_chain.server.runner import BlockRunner
from petals_chain.sim.data import get_conversation_lengths
from petals_chain.swarm.tiny_model import LLAMA2_7B_SHAPE

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_int, positive_int  # noqa: E402


def admission(runner: BlockRunner, lengths: np.ndarray) -> int:
    """Sessions opened in order until the first refusal (all of the runner's blocks each); closes them again."""
    opened = []
    try:
        for i, n in enumerate(lengths):
            try:
                runner.allocate(f"adm{i}", runner.start_block, runner.end_block, max_tokens=int(n))
            except NoCapacityError:
                break
            opened.append(f"adm{i}")
        return len(opened)
    finally:
        for sid in opened:
            runner.release(sid)


def churn(runner: BlockRunner, lengths: np.ndarray, events: int, rng: np.random.Generator) -> None:
    """Open and close sessions of trace lengths at random (``events`` times) so that the pool is fragmented,
    as on a server that has run a while; leaves the pool about half full of other sessions."""
    open_ids: list[str] = []
    for i in range(events):
        if open_ids and (rng.random() < 0.5 or runner.pool.pages_available < runner.pool.num_pages // 2):
            runner.release(open_ids.pop(int(rng.integers(len(open_ids)))))
            continue
        try:
            runner.allocate(f"bg{i}", runner.start_block, runner.end_block, max_tokens=int(rng.choice(lengths)))
            open_ids.append(f"bg{i}")
        except NoCapacityError:
            pass




def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(runner: BlockRunner, lengths: list[int], seed: int) -> list[BatchItem]:
    """Open one session per length, prefill ``length - 1`` tokens in chunks; returns each session's decode step."""
    g = torch.Generator().manual_seed(seed)
    H, items = runner.hidden_size, []
    dev, dt = runner.device, runner.dtype
    for i, n in enumerate(lengths):
        sid = f"dec{i}"
        runner.allocate(sid, runner.start_block, runner.end_block, max_tokens=n)
        for pos in range(0, n - 1, 512):
            k = min(512, n - 1 - pos)
            runner.forward(sid, (torch.randn(1, k, H, generator=g) * 0.1).to(dev, dt), pos)
        s = runner._sessions[sid]
        items.append(BatchItem((torch.randn(1, 1, H, generator=g) * 0.1).to(dev, dt), n - 1, dict(s.pages_of), runner.start_block,
                               runner.end_block))
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name or path (default: the real model)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight llama instead of --model (fast)")
    ap.add_argument("--seven-b", action="store_true", help="random weights shaped like Llama-2-7B (for a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--trace", default=None, help="Azure conversation trace CSV (default: ../shared/data)")
    ap.add_argument("--max-length", type=positive_int, default=4096)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--slots", type=positive_int, default=32, help="KV memory of this many max_length slots per block")
    ap.add_argument("--windows", type=positive_int, default=50)
    ap.add_argument("--sessions", type=positive_int, default=16)
    ap.add_argument("--blocks", type=positive_int, default=4)
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--churn", type=nonnegative_int, default=400,
                    help="open/close events on the paged runner before the decode test (fragments its pool; 0: none)")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    tmp = None
    if args.tiny or args.seven_b:
        from petals_chain.swarm.tiny_model import build_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model = build_tiny_model(Path(tmp.name) / "tiny", family="llama", num_layers=args.blocks,
                                 max_position_embeddings=args.max_length, **(LLAMA2_7B_SHAPE if args.seven_b else {}))
    else:
        from petals_chain.swarm.registry import registry_path

        model = registry_path(args.model) if not Path(args.model).exists() else args.model
    lengths, source = get_conversation_lengths(args.trace, seed=args.seed)
    lengths = np.minimum(lengths, args.max_length)
    runners = {mode: BlockRunner(model, 0, args.blocks, num_slots=args.slots * args.blocks, max_length=args.max_length,
                                 kv_cache=mode, page_size=args.page_size, progress=False, dtype=args.dtype,
                                 device=args.device)
               for mode in ("slots", "paged")}
    assert runners["slots"].pool.nbytes <= runners["paged"].pool.nbytes <= runners["slots"].pool.nbytes * 1.001

    rng = np.random.default_rng(args.seed)
    admitted = {"slots": [], "paged": []}
    for _ in range(args.windows):
        start = int(rng.integers(0, max(1, len(lengths) - 10 * args.slots)))
        window = lengths[start:start + 10 * args.slots]
        for mode, r in runners.items():
            admitted[mode].append(admission(r, window))
    ratio_adm = float(np.mean(admitted["paged"]) / np.mean(admitted["slots"]))

    dec_lengths = [int(x) for x in rng.choice(lengths, size=args.sessions)]
    if args.churn:  # the paged runner only: slots never fragment (one page per block)
        churn(runners["paged"], lengths, args.churn, np.random.default_rng(args.seed + 1))
    items = {mode: prefill(r, dec_lengths, args.seed) for mode, r in runners.items()}
    runs = [all(t[i] == t[0] + i for i in range(len(t))) for it in items["paged"] for t in it.pages_of.values()]
    for mode in runners:  # same inputs in both modes
        for a, b in zip(items[mode], items["slots"]):
            a.x = b.x
    times = {"slots": [], "paged": []}
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            for mode, r in runners.items():
                run_batch(r, items[mode])
        for step in range(args.steps):
            for mode in (("slots", "paged") if step % 2 == 0 else ("paged", "slots")):
                _sync(runners[mode].device)
                t0 = time.perf_counter()
                run_batch(runners[mode], items[mode])
                _sync(runners[mode].device)
                times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    out = {
        "model": "tiny" if args.tiny else "7b-shaped" if args.seven_b else str(args.model),
        "device": str(args.device), "dtype": args.dtype, "trace": source, "max_length": args.max_length,
        "page_size": args.page_size, "blocks": args.blocks, "slots_per_block": args.slots,
        "length_mean": float(lengths.mean()), "length_p90": float(np.percentile(lengths, 90)),
        "admitted_slots_mean": float(np.mean(admitted["slots"])), "admitted_paged_mean": float(np.mean(admitted["paged"])),
        "admitted_ratio": ratio_adm, "admitted_ideal": float(args.max_length / lengths.mean()),
        "decode_sessions": args.sessions, "decode_mean_length": float(np.mean(dec_lengths)),
        "churn_events": args.churn, "page_tables_in_one_run": float(np.mean(runs)),
        "decode_step_ms_slots": med["slots"] * 1e3, "decode_step_ms_paged": med["paged"] * 1e3,
        "decode_ratio_paged_over_slots": med["paged"] / med["slots"],
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"trace: {source}  lengths mean {out['length_mean']:.0f}  P90 {out['length_p90']:.0f} "
              f"(capped at {args.max_length})")
        print(f"admitted at equal memory ({args.slots} slots of {args.max_length} tokens x {args.blocks} blocks): "
              f"slots {out['admitted_slots_mean']:.1f}  paged {out['admitted_paged_mean']:.1f}  "
              f"ratio {ratio_adm:.2f}x (ideal {out['admitted_ideal']:.2f}x)")
        print(f"decode step, {args.sessions} sessions (mean length {out['decode_mean_length']:.0f}): "
              f"slots {out['decode_step_ms_slots']:.2f} ms  paged {out['decode_step_ms_paged']:.2f} ms  "
              f"ratio {out['decode_ratio_paged_over_slots']:.2f}x  (after {args.churn} open/close events, "
              f"{100 * out['page_tables_in_one_run']:.0f}% of the page tables are one run of consecutive pages)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
