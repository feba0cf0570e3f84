"""``/v1/embeddings``: how long the orchestrator's event loop stalls while the answer to N inputs is encoded as floats
(every stream's relay waits that long). Side by side: the answer as a dict on the event loop (FastAPI's
jsonable_encoder, then JSONResponse's json.dumps: how it was encoded before session 37's review) and
``embeddings.response`` in a worker thread (now). Synthetic unit vectors; no model, no swarm.

    python scripts/bench_embeddings_encode.py [--inputs 2048] [--dims 576]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_int  # noqa: E402


async def longest_stall(work) -> tuple[float, float]:
    """(wall seconds of ``await work()``, the longest gap between two ticks of a 1 ms ticker meanwhile)."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await work()
    wall = time.perf_counter() - t0
    done = True
    await tick
    return wall, max(gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=positive_int, default=2048)
    p.add_argument("--dims", type=positive_int, default=576, help="hidden size (SmolLM2-135M: 576)")
    args = p.parse_args()

    import torch
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    from petals_chain.orchestrator.embeddings import Embedded, encoded, response

    done = [Embedded(vector=torch.nn.functional.normalize(torch.randn(args.dims), dim=-1), tokens=8, cached_tokens=0,
                     wait_s=0.0, service_s=0.01, chain=["peer"], failovers=0) for _ in range(args.inputs)]

    async def on_the_loop() -> bytes:  # before: a dict returned by the route
        out = {"object": "list", "model": "m",
               "data": [{"object": "embedding", "index": i, "embedding": encoded(e.vector, "float")}
                        for i, e in enumerate(done)],
               "usage": {"prompt_tokens": 8 * len(done), "total_tokens": 8 * len(done)},
               "petals_chain": [{"wait_s": e.wait_s, "service_s": e.service_s, "chain": e.chain,
                                 "failovers": e.failovers, "cached_tokens": e.cached_tokens} for e in done]}
        return JSONResponse(jsonable_encoder(out)).body

    async def in_a_thread() -> bytes:  # now
        return await asyncio.to_thread(response, "m", done, "float", None)

    before = asyncio.run(longest_stall(on_the_loop))
    after = asyncio.run(longest_stall(in_a_thread))
    print(f"{args.inputs} inputs x {args.dims} dimensions as floats")
    print(f"  {'':40s}{'wall s':>10s}{'longest event-loop stall s':>30s}")
    for label, (wall, stall) in (("dict on the event loop (before)", before), ("encoded in a thread (now)", after)):
        print(f"  {label:40s}{wall:10.2f}{stall:30.3f}")
    print(f"  stall ratio now / before: {after[1] / before[1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
