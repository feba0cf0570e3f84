"""Memory follows the span: peak RSS of a server process loading k of the model's blocks, above its idle baseline.

Each measurement runs in a fresh process that imports what a server imports and resolves the model (the
idle baseline: a server that joined but holds no blocks), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), loads blocks ``[0, k)`` with a ``BlockRunner`` (the server's loading path, with
one KV slot per block at the given max_length) and reports the peak RSS above the baseline. The ratio
10-of-30 / 30-of-30 is the issue's acceptance (<= 0.4; the ideal is 1/3 plus the fixed per-load costs).

    python scripts/bench_span_memory.py [--model smollm2-135m] [--blocks 10 30] [--max-length 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402

CHILD = r"""
import json, os, sys
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
import petals_chain.server.server  # everything a server process imports
from petals_chain.server.runner import BlockRunner
from petals_chain.swarm.sources import resolve_source
model, k, max_length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
src = resolve_source(model)
src.config, src.fingerprint  # a joined server has parsed its model's metadata
base = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
runner = BlockRunner(src, 0, k, num_slots=k, max_length=max_length, progress=False)
print(json.dumps({"blocks": k, "baseline": base, "peak": rss("VmHWM"), "now": rss("VmRSS"),
                  "blocks_bytes": runner.blocks_bytes, "kv_bytes": runner.pool.nbytes}))
"""


def measure(model: str, k: int, max_length: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(k), str(max_length)], capture_output=True, text=True,
                         env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--blocks", type=positive_int, nargs="+", default=[10, 30])
    p.add_argument("--max-length", type=positive_int, default=1024)
    p.add_argument("--repeats", type=positive_int, default=2, help="runs per size (the smallest peak counts)")
    args = p.parse_args()
    rows = {}
    for k in args.blocks:
        runs = [measure(args.model, k, args.max_length) for _ in range(args.repeats)]
        rows[k] = min(runs, key=lambda r: r["peak"] - r["baseline"])
    mb = 1 / 2**20
    print(f"model {args.model}, max_length {args.max_length}, one KV slot per block; MB = 2^20 bytes")
    print(f"{'blocks':>6} {'baseline':>9} {'peak-base':>10} {'weights':>8} {'kv':>6}")
    for k, r in rows.items():
        print(f"{k:>6} {r['baseline'] * mb:>9.1f} {(r['peak'] - r['baseline']) * mb:>10.1f} "
              f"{r['blocks_bytes'] * mb:>8.1f} {r['kv_bytes'] * mb:>6.1f}")
    if len(rows) >= 2:
        small, large = min(rows), max(rows)
        ratio = (rows[small]["peak"] - rows[small]["baseline"]) / (rows[large]["peak"] - rows[large]["baseline"])
        print(f"peak above baseline, {small} of {large} blocks: {ratio:.3f}x (ideal {small / large:.3f}x; "
              f"acceptance <= 0.4x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
