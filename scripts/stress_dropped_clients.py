"""Clients that drop their stream mid-request: the server's log lines, side by side with and without the fix.

A stand-in handler on real hivemind P2P (two p2pd on loopback) answers each request with a reply of ``--reply-mib``
MiB, then "computes" for a second before its next reply; ``--clients`` clients send a request each and abort their
stream before reading (some at once, some up to 0.2 s later), ``--rounds`` times. Counted: WARNING lines of asyncio
("socket.send() raised exception.", once per 64 KiB chunk written to a lost connection past the fifth) and of
hivemind's stream handler ("Exception while receiving requests:" with a traceback), and the DEBUG lines that replace
them (:func:`petals_chain.swarm.aio.quiet_stream_peers_gone`).

    python scripts/stress_dropped_clients.py --clients 150 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.p2p import P2P  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

from petals_chain.swarm import aio  # noqa: E402 - not rpc: importing it installs the fix

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import positive_float, positive_int  # noqa: E402


class Lines(logging.Handler):
    """Counts records by (level, first words of the message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.WARNING or "mid-request" in message:
            self.counts[(record.levelname, message[:40] + (" +traceback" if record.exc_info else ""))] += 1


async def storm(clients: int, rounds: int, reply_mib: float) -> None:
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        async def handler(requests, context):
            async for _ in requests:
                yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"x" * int(reply_mib * 2**20))])
                await asyncio.sleep(1.0)  # the next step's compute
                yield runtime_pb2.ExpertResponse()

        await server.add_protobuf_handler("rpc_drop", handler, runtime_pb2.ExpertRequest, stream_input=True,
                                          stream_output=True)

        async def one(i: int) -> None:
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "rpc_drop")
            await P2P.send_protobuf(runtime_pb2.ExpertRequest(uid="x"), writer)
            await asyncio.sleep(0.05 * (i % 5))
            writer.transport.abort()  # gone mid-request

        for _ in range(rounds):
            await asyncio.gather(*(one(i) for i in range(clients)), return_exceptions=True)
            await asyncio.sleep(2.0)  # the handlers notice and end
    finally:
        await client.shutdown()
        await server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=positive_int, default=150, help="streams dropped per round")
    ap.add_argument("--rounds", type=positive_int, default=1)
    ap.add_argument("--reply-mib", type=positive_float, default=3.0, help="size of the reply in flight (MiB)")
    args = ap.parse_args()
    lines = Lines()
    for name in ("asyncio", "hivemind.p2p.p2p_daemon"):
        log = logging.getLogger(name)
        log.addHandler(lines)
        log.setLevel(logging.DEBUG)
        log.propagate = False
    results = {}
    for mode in ("before", "after"):
        if mode == "after":
            aio.quiet_stream_peers_gone()
        lines.counts.clear()
        asyncio.run(storm(args.clients, args.rounds, args.reply_mib))
        results[mode] = dict(lines.counts)
    kinds = sorted(set(results["before"]) | set(results["after"]))
    print(f"{args.clients} clients x {args.rounds} rounds dropped mid-request, {args.reply_mib:g} MiB replies")
    print(f"{'level':8} {'message':52} {'before':>7} {'after':>7}")
    for level, message in kinds:
        print(f"{level:8} {message:52} {results['before'].get((level, message), 0):7d} "
              f"{results['after'].get((level, message), 0):7d}")


if __name__ == "__main__":
    main()
