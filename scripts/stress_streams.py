"""Lost replies on fresh P2P streams: refused opens, side by side with and without the fixes.

A server handler that returns right after its last reply closes its end of the stream at once; the P2P daemons
then reset the stream, and the reset can discard the reply still in flight. hivemind's stream client then waits
for our requests to end before it reports the end of the stream, so the caller saw a silent server until its
timeout (the "open ...: no reply within 30 s" of CI runs). Each mode opens ``--opens`` sessions that the server
refuses at once (a stand-in backend, real hivemind P2P on loopback) and counts how each ended:

- ``before``: the server closes at once (``linger_s=0``), hivemind's stream client;
- ``client``: the server closes at once, our :class:`~petals_chain.swarm.rpc.PeerStream` (a lost reply shows
  as an end of stream at once, not as silence);
- ``after``: the server lingers until the client ends the stream (``LINGER_S``), ``PeerStream``;
- ``ping-before`` / ``ping-after``: one-message pings through hivemind's stub (``ServerClient.ping`` without its
  one retry), the server closing at once / holding the stream until the client closes it.

    python scripts/stress_streams.py --opens 100000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.p2p import P2P  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

from petals_chain.swarm.aio import LINGER_S  # noqa: E402
from petals_chain.swarm.rpc import (  # noqa: E402
    PetalsChainBlocks, RefusedError, RemoteError, ServerClient, _drain, _pack,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for the shared argument types
from _args import name_list, positive_float, positive_int  # noqa: E402


class RefusingBackend:
    """Refuses every open at once, as a server does a bad span or a full one without wait_s."""

    hidden_size = 8
    model_fingerprint = ""

    def authorize(self, peer_id: str) -> bool:
        return True

    def open_session(self, session_id: str, *args, **kwargs) -> dict:
        raise RefusedError("invalid", "this stand-in refuses every open")

    def close_session(self, *args, **kwargs) -> None:
        pass

    def info(self) -> dict:
        return {}

    def session(self, session_id: str):
        return None


async def _first_reply(replies, timeout_s: float) -> str:
    """How a stream from hivemind's stub ended for us: replied | ended | silent."""
    try:
        await asyncio.wait_for(replies.__anext__(), timeout_s)
        return "replied"
    except StopAsyncIteration:
        return "ended"
    except asyncio.TimeoutError:
        return "silent"


async def _hivemind_open(client_p2p: P2P, peer, timeout_s: float) -> str:
    """One open through hivemind's stub."""
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({
        "op": "open", "session_id": uuid.uuid4().hex, "start_block": 0, "end_block": 1, "max_length": 8})))
    try:
        return await _first_reply(await PetalsChainBlocks.get_stub(client_p2p, peer).rpc_session(_drain(queue)),
                                  timeout_s)
    finally:
        queue.put_nowait(None)


async def _ping(client_p2p: P2P, peer, timeout_s: float) -> str:
    request = runtime_pb2.ExpertRequest(metadata=b"\0")
    return await _first_reply(await PetalsChainBlocks.get_stub(client_p2p, peer).rpc_ping(request), timeout_s)


async def _our_open(client: ServerClient, peer_id: str) -> str:
    try:
        await client.open_session(peer_id, uuid.uuid4().hex, 0, 1, 8)
    except RemoteError:
        return "replied"
    except ConnectionError as e:
        return "silent" if "no reply" in str(e) else "ended"
    return "replied"


async def run_mode(mode: str, opens: int, concurrency: int, timeout_s: float) -> dict:
    server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    linger_s = LINGER_S if mode.endswith("after") else 0.0
    await PetalsChainBlocks(RefusingBackend(), linger_s=linger_s).add_p2p_handlers(server_p2p)
    maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
    client_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = ServerClient(client_p2p, open_timeout_s=timeout_s)
    peer_id = server_p2p.peer_id.to_base58()
    counts = {"replied": 0, "ended": 0, "silent": 0}
    t0 = time.perf_counter()
    try:
        for start in range(0, opens, concurrency):
            n = min(concurrency, opens - start)
            if mode == "before":
                outcomes = [_hivemind_open(client_p2p, server_p2p.peer_id, timeout_s) for _ in range(n)]
            elif mode.startswith("ping"):
                outcomes = [_ping(client_p2p, server_p2p.peer_id, timeout_s) for _ in range(n)]
            else:
                outcomes = [_our_open(client, peer_id) for _ in range(n)]
            for outcome in await asyncio.gather(*outcomes):
                counts[outcome] += 1
    finally:
        await client_p2p.shutdown()
        await server_p2p.shutdown()
    return {"mode": mode, "opens": opens, **counts, "wall_s": round(time.perf_counter() - t0, 1)}


MODES = ("before", "client", "after", "ping-before", "ping-after")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opens", type=positive_int, default=50_000, help="refused opens (or pings) per mode")
    ap.add_argument("--concurrency", type=positive_int, default=20, help="opens in flight at once")
    ap.add_argument("--timeout-s", type=positive_float, default=3.0, help="how long an open waits for its reply")
    ap.add_argument("--modes", type=name_list(MODES), default=",".join(MODES))
    args = ap.parse_args()
    print(f"{'mode':11} {'opens':>8} {'replied':>8} {'ended':>6} {'silent':>6} {'wall_s':>7}  (ended/silent: no reply)")
    for mode in args.modes:
        r = asyncio.run(run_mode(mode, args.opens, args.concurrency, args.timeout_s))
        print(f"{r['mode']:11} {r['opens']:8d} {r['replied']:8d} {r['ended']:6d} {r['silent']:6d} {r['wall_s']:7.1f}",
              flush=True)


if __name__ == "__main__":
    main()
