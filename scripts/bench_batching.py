"""Decode throughput of one BlockRunner with continuous batching on vs off, measured side by side.

    python scripts/bench_batching.py [--sessions 16] [--json] [--family llama] [--hidden-size 64]
                                     [--num-layers 8] [--prefix 32] [--steps 40] [--rounds 3]

Builds a tiny random-weight model (default: llama, 8 layers, hidden 64, 4 heads -- the size the tests use)
in a temporary directory and two runners over all its blocks, one with ``batching=True`` and one with
``batching=False``. Each round opens ``--sessions`` sessions on a runner, prefills ``--prefix`` tokens each,
then starts one thread per session that does ``--steps`` single-token decode steps as fast as it can
(``runner.forward(session_id, hidden, position)``, the server's call); steps/s = sessions * steps / wall time.
Rounds alternate batched / unbatched (A/B/A/B...) because the machine is shared and noisy; the reported
rates are medians over rounds and ``ratio`` is the median of the per-round ratios.
``batched_async_steps_per_s``: the same decode load as coroutines on one asyncio loop calling
``BlockRunner.forward_async`` (how a server's event loop should call the runner), measured in each round too.
With ``--json`` prints one JSON object; otherwise a short table too.

``--chunks`` times prefill chunk sizes: tokens/s of a chunk alone and the time of one batch holding the
chunk plus the decode steps of ``--sessions`` sessions (how long one chunk holds up their steps).
``--attention`` instead times the two ways decode rows attend over their own slots (padded gather of all
rows' prefixes + one SDPA, vs one SDPA per row over views of the slots) for a few shapes; the batcher picks
between them by the size of the gathered tensor (``GATHER_MAX_ELEMENTS`` in petals_chain/server/batching.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.tiny_model import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import nonnegative_float, nonnegative_int, positive_int  # noqa: E402


def _open_prefilled(runner: BlockRunner, sessions: int, prefix: int, seed: int, tag: str):
    """Open ``sessions`` sessions over the runner's whole span, prefill ``prefix`` random tokens in each;
    returns (session ids, one random decode input per session)."""
    H, L = runner.hidden_size, runner.end_block
    g = torch.Generator().manual_seed(seed)
    sids = [f"{tag}{seed}-{i}" for i in range(sessions)]
    for sid in sids:
        runner.allocate(sid, runner.start_block, L)
        runner.forward(sid, torch.randn(1, prefix, H, generator=g), 0)
    return sids, [torch.randn(1, 1, H, generator=g) for _ in sids]


def decode_rate(runner: BlockRunner, sessions: int, prefix: int, steps: int, seed: int = 0) -> tuple[float, float]:
    """(steps/s, mean rows per batch) of ``sessions`` threads each doing ``steps`` decode steps after a
    ``prefix``-token prefill. Rows per batch is 1 for an unbatched runner."""
    sids, tokens = _open_prefilled(runner, sessions, prefix, seed, "bench")
    b0, r0 = runner.scheduler.batches, runner.scheduler.rows  # count decode batches only
    barrier = threading.Barrier(sessions + 1)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            x, sid = tokens[i], sids[i]
            barrier.wait()
            for k in range(steps):
                x = runner.forward(sid, x, prefix + k)
                x = x / (x.norm() + 1e-6)  # keep the random chain of states bounded
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for sid in sids:
        runner.release(sid)
    if errors:
        raise errors[0]
    batches = runner.scheduler.batches - b0
    return sessions * steps / wall, (runner.scheduler.rows - r0) / batches if batches else 1.0


def async_decode_rate(runner: BlockRunner, sessions: int, prefix: int, steps: int, seed: int = 0) -> float:
    """Steps/s of ``sessions`` coroutines on one event loop doing decode steps with ``forward_async`` (the
    server's shape: one loop thread, no executor)."""
    import asyncio

    sids, tokens = _open_prefilled(runner, sessions, prefix, seed, "async")

    async def one(i: int) -> None:
        x = tokens[i]
        for k in range(steps):
            x = await runner.forward_async(sids[i], x, prefix + k)
            x = x / (x.norm() + 1e-6)

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        return time.perf_counter() - t0

    wall = asyncio.run(run())
    for sid in sids:
        runner.release(sid)
    return sessions * steps / wall


def measure(sessions: int = 16, *, family: str = "llama", hidden_size: int = 64, num_layers: int = 8,
            heads: int = 4, prefix: int = 32, steps: int = 40, rounds: int = 3, batch_wait_ms: float = 2.0,
            max_batch_tokens: int = 256) -> dict:
    """Run the A/B comparison and return the result dict (see the module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(d, family=family, num_layers=num_layers, hidden_size=hidden_size,
                                num_attention_heads=heads)
        common = dict(num_slots=sessions * num_layers, max_length=prefix + steps + 1, progress=False)
        batched = BlockRunner(path, 0, num_layers, batching=True, batch_wait_ms=batch_wait_ms,
                              max_batch_tokens=max_batch_tokens, **common)
        unbatched = BlockRunner(path, 0, num_layers, batching=False, **common)
        decode_rate(batched, sessions, prefix, 4)  # warm-up of both paths
        decode_rate(unbatched, sessions, prefix, 4)
        async_decode_rate(batched, sessions, prefix, 4)
        b_rates, u_rates, a_rates, ratios = [], [], [], []
        for k in range(rounds):
            b, rows = decode_rate(batched, sessions, prefix, steps, seed=k)
            u, _ = decode_rate(unbatched, sessions, prefix, steps, seed=k)
            a_rates.append(async_decode_rate(batched, sessions, prefix, steps, seed=k))
            b_rates.append(b)
            u_rates.append(u)
            ratios.append(b / u)
    return {
        "sessions": sessions,
        "batched_steps_per_s": round(statistics.median(b_rates), 1),
        "unbatched_steps_per_s": round(statistics.median(u_rates), 1),
        "ratio": round(statistics.median(ratios), 2),
        "ratios": [round(r, 2) for r in ratios],
        "batched_async_steps_per_s": round(statistics.median(a_rates), 1),
        "mean_rows_per_batch_last_round": round(rows, 1),
        "model": {"family": family, "num_layers": num_layers, "hidden_size": hidden_size, "heads": heads,
                  "dtype": "float32", "prefix": prefix, "steps_per_session": steps},
        "torch_threads": torch.get_num_threads(),
        "batch_wait_ms": batch_wait_ms,
    }


def attention_choice(rows: int = 16) -> list[dict]:
    """Microseconds of gathered vs per-row decode attention over a slot pool, for tiny and 7B-like heads."""
    import torch.nn.functional as F

    def timed(f, n: int = 30) -> float:
        f()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    out = []
    g = torch.Generator().manual_seed(0)
    for kv, h, hd in ((4, 4, 16), (8, 32, 128)):
        for length in (32, 512, 2048):
            pool_k = torch.randn(2 * rows, kv, length + 8, hd, generator=g)
            pool_v = torch.randn(2 * rows, kv, length + 8, hd, generator=g)
            slots = torch.arange(0, 2 * rows, 2)
            lens = torch.randint(length // 2, length + 1, (rows,), generator=g)
            lens[0] = length
            q = torch.randn(rows, h, 1, hd, generator=g)
            mask = (torch.arange(length)[None] < lens[:, None])[:, None, None, :]
            sl, ll = slots.tolist(), lens.tolist()

            def gather():
                k = pool_k[:, :, :length].index_select(0, slots)
                v = pool_v[:, :, :length].index_select(0, slots)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)

            def per_row():
                o = torch.empty(rows, h, 1, hd)
                for i in range(rows):
                    s = sl[i]
                    o[i] = F.scaled_dot_product_attention(q[i:i + 1], pool_k[s:s + 1, :, :ll[i]],
                                                          pool_v[s:s + 1, :, :ll[i]], enable_gqa=h != kv)[0]
                return o

            torch.testing.assert_close(gather(), per_row(), atol=1e-4, rtol=1e-4)
            out.append({"rows": rows, "kv_heads": kv, "heads": h, "head_dim": hd, "max_len": length,
                        "gathered_elements": rows * kv * length * hd, "gather_us": round(timed(gather)),
                        "per_row_us": round(timed(per_row))})
    return out


def chunk_choice(hidden_size: int = 64, num_layers: int = 8, heads: int = 4, sessions: int = 16,
                 chunks: tuple[int, ...] = (16, 32, 64, 128, 256, 512)) -> list[dict]:
    """For each prefill chunk size: prefill tokens/s of one session alone, and the time of one batch holding
    that chunk plus ``sessions`` decode steps (how long those decode steps are held up by the chunk)."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(d, family="llama", num_layers=num_layers, hidden_size=hidden_size,
                                num_attention_heads=heads)
        r = BlockRunner(path, 0, num_layers, num_slots=(sessions + 1) * num_layers, max_length=2 * max(chunks) + 64,
                        batching=False, progress=False)
        H = r.hidden_size
        from petals_chain.server.batching import BatchItem, run_batch

        for i in range(sessions + 1):
            r.allocate(f"c{i}", 0, num_layers)
            r.forward(f"c{i}", torch.randn(1, 32, H), 0)
        dec = [BatchItem(torch.randn(1, 1, H), 32, r._sessions[f"c{i}"].pages_of, 0, num_layers)
               for i in range(sessions)]
        pre = r._sessions[f"c{sessions}"].pages_of
        for c in chunks:
            x = torch.randn(1, c, H)
            times_alone, times_mixed = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                r._run_blocks(x, 32, pre, 0, num_layers)
                times_alone.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                run_batch(r, dec + [BatchItem(x, 32, pre, 0, num_layers)])
                times_mixed.append(time.perf_counter() - t0)
            out.append({"chunk": c, "prefill_tokens_per_s": round(c / statistics.median(times_alone)),
                        "batch_ms_with_decode": round(statistics.median(times_mixed) * 1e3, 2)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=positive_int, default=16)
    ap.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2"])
    ap.add_argument("--hidden-size", type=positive_int, default=64)
    ap.add_argument("--num-layers", type=positive_int, default=8)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--prefix", type=positive_int, default=32)
    ap.add_argument("--steps", type=positive_int, default=40)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--batch-wait-ms", type=nonnegative_float, default=2.0)
    ap.add_argument("--max-batch-tokens", type=positive_int, default=256)
    ap.add_argument("--threads", type=nonnegative_int, default=1,
                    help="torch intra-op threads, both modes (0: torch's default); 1 as in bench_server.py: on the "
                         "shared 2-core machine intra-op threads only add contention to these small ops")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--attention", action="store_true", help="time gathered vs per-row decode attention instead")
    ap.add_argument("--chunks", action="store_true", help="time prefill chunk sizes (alone and with decode rows)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunks:
        for row in chunk_choice(args.hidden_size, args.num_layers, args.heads, args.sessions):
            print(json.dumps(row))
        return
    if args.attention:
        for row in attention_choice(args.sessions):
            print(json.dumps(row))
        return
    res = measure(args.sessions, family=args.family, hidden_size=args.hidden_size, num_layers=args.num_layers,
                  heads=args.heads, prefix=args.prefix, steps=args.steps, rounds=args.rounds,
                  batch_wait_ms=args.batch_wait_ms, max_batch_tokens=args.max_batch_tokens)
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.family} L={args.num_layers} H={args.hidden_size}, {args.sessions} sessions, "
          f"{args.steps} decode steps each after a {args.prefix}-token prefill, {args.rounds} A/B rounds")
    print(f"batched   {res['batched_steps_per_s']:9.1f} steps/s  ({res['mean_rows_per_batch_last_round']} rows/batch)")
    print(f"unbatched {res['unbatched_steps_per_s']:9.1f} steps/s")
    print(f"async     {res['batched_async_steps_per_s']:9.1f} steps/s  (batched, forward_async on one event loop)")
    print(f"ratio     {res['ratio']:9.2f}  (per round: {res['ratios']})")


if __name__ == "__main__":
    main(sys.argv[1:])
