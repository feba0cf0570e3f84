"""Python calls per dispatch decision for a job without a LoRA adapter (flex's pause and doom checks, the db/mlfq
priority pause), ``--running`` jobs busy on 4 chains: a deterministic cost measure (call counts, not times, which
the shared CPUs make noisy). ``--old PATH``: also run it on another checkout (e.g. a ``git archive`` of an earlier
commit) and print both side by side with their ratios.

    python scripts/bench_dispatch_calls.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys


def measure(running: int) -> dict[str, int]:
    """Calls (Python and C) made by one decision of each kind."""
    from petals_chain.model import Chain
    from petals_chain.orchestrator.deadlines import RequestDeadline
    from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

    def chain(i: int) -> Chain:
        slots = -(-running // 4)
        return Chain(servers=(f"s{i}",), blocks=(4,), service_time=1.0 + i / 10, capacity=slots, spans=((0, 4),))

    def calls(fn) -> int:
        n = 0

        def prof(frame, event, arg):
            nonlocal n
            n += event in ("call", "c_call")

        sys.setprofile(prof)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return n

    async def main() -> dict[str, int]:
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains([chain(i) for i in range(4)])
        for i in range(running):
            await dm.acquire(DispatchJob(f"j{i}", expected_output=200))
        job = DispatchJob("d", deadline=RequestDeadline.from_ms("x", None, 1), output_tokens=16)
        out = {"flex _pause_for": calls(lambda: dm._pause_for(job)),
               "flex _misses_waiting": calls(lambda: dm._misses_waiting(job))}
        dm = DispatchManager(schedule="mlfq")
        dm.set_chains([chain(i) for i in range(4)])
        for i in range(running):
            dm.kv_kept(await dm.acquire(DispatchJob(f"m{i}", sched=dm.new_priority_job(f"m{i}", "m"))), True)
        waiting = [asyncio.ensure_future(dm.acquire(DispatchJob(f"w{i}", sched=dm.new_priority_job(f"w{i}", "m"))))
                   for i in range(20)]
        await asyncio.sleep(0)
        out["mlfq _preempt_for_priority"] = calls(dm._preempt_for_priority)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return out

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=128, help="jobs running on the 4 chains")
    ap.add_argument("--old", default=None, help="another checkout's root, measured too (side by side)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one run's counts (for --old)
    args = ap.parse_args()
    here = measure(args.running)
    if args.json:
        print(json.dumps(here))
        return
    if args.old is None:
        for name, n in here.items():
            print(f"{name:28s} {n:8d} calls")
        return
    env = dict(os.environ, PYTHONPATH=args.old)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--running", str(args.running)],
                          env=env, cwd=args.old, capture_output=True, text=True, check=True)
    old = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'decision':28s} {'old':>8s} {'this':>8s} {'this/old':>9s}")
    for name, n in here.items():
        print(f"{name:28s} {old[name]:8d} {n:8d} {n / old[name]:9.2f}")


if __name__ == "__main__":
    main()
