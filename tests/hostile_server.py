"""A hostile server for tests: joins the swarm like a real one, but every step reply it sends is invalid.

``python tests/hostile_server.py --model PATH --initial-peers MADDR... --mode nan|shape|dtype|chunks|cycle``

It announces a signed server record (fast ``--tau-p``, the memory given), follows the orchestrator's assignment
(announcing the assigned span as loaded and online at once: it loads nothing) and serves the real RPC handle
names (``PetalsChainBlocks.rpc_session`` / ``rpc_ping`` / ``rpc_info``). Opens succeed; each step is read in
full and answered with, by ``--mode`` (``cycle``: the next mode each time it is given blocks again; with
``--mode-file F`` the mode written in F when a session opens; a session id ``<mode>-...`` picks its own):

* ``nan``: a tensor of the right shape and dtype, full of NaN;
* ``shape``: one column more than the hidden size;
* ``dtype``: the right values in float16;
* ``chunks``: a reply announcing far more chunks than its size allows.

Prints ``PEER_ID <id>`` once up and ``BAD_REPLY <mode> <session>`` for every reply it corrupts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import AsyncIterator

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming

from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.keys import default_dht_prefix
from petals_chain.swarm.records import ServerRecord
from petals_chain.swarm.rpc import _pack, _unpack, serialize_chunks
from petals_chain.swarm.sources import resolve_source

MODES = ("nan", "shape", "dtype", "chunks")


def corrupt(mode: str, x: torch.Tensor) -> list[runtime_pb2.Tensor]:
    """The chunks of an invalid reply to the step input ``x``."""
    if mode == "nan":
        return serialize_chunks(torch.full_like(x, float("nan")))
    if mode == "shape":
        return serialize_chunks(torch.zeros(x.shape[0], x.shape[1], x.shape[2] + 1, dtype=x.dtype))
    if mode == "dtype":
        return serialize_chunks(x.to(torch.float16))
    if mode == "chunks":
        head = serialize_chunks(x)[0]
        head.chunks = 100_000  # far more than a [1, n, H] tensor can take: the client must not wait for them
        return [head]
    raise ValueError(mode)


class PetalsChainBlocks(ServicerBase):  # the class name is the wire protocol's handle prefix
    def __init__(self, mode: str, info: dict, mode_file: str | None = None):
        self.modes = itertools.cycle(MODES) if mode == "cycle" else itertools.repeat(mode)
        self.mode = next(self.modes)
        self.info = info
        self.mode_file = mode_file

    def current_mode(self) -> str:
        if self.mode_file is not None:
            try:
                mode = open(self.mode_file).read().strip()
            except OSError:
                mode = ""
            if mode in MODES:
                return mode
        return self.mode

    async def rpc_ping(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        yield runtime_pb2.ExpertResponse(metadata=request.metadata[:4096])

    async def rpc_info(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, **self.info}))

    async def rpc_session(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        stream = requests.__aiter__()
        first = await stream.__anext__()
        sid = _unpack(first.metadata).get("session_id")
        prefix = str(sid).split("-", 1)[0]
        mode = prefix if prefix in MODES else self.current_mode()  # a session id "nan-..." picks its mode
        yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "session_id": sid, "idle_timeout_s": 60.0}))
        async for msg in stream:
            meta = _unpack(msg.metadata)
            if meta.get("op") == "close":
                yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "closed": True}))
                return
            if meta.get("op") == "keepalive":
                yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "keepalive": True}))
                continue
            parts = [msg.tensors[0]]
            while len(parts) < max(1, parts[0].chunks):
                parts.append((await stream.__anext__()).tensors[0])
            x = deserialize_torch_tensor(combine_from_streaming(parts))
            chunks = corrupt(mode, x)
            print(f"BAD_REPLY {mode} {sid}", flush=True)
            position = int(meta.get("position", 0)) + int(x.shape[1])
            yield runtime_pb2.ExpertResponse(metadata=_pack({"ok": True, "position": position, "compute_s": 1e-4}),
                                             tensors=[chunks[0]])
            for chunk in chunks[1:]:
                yield runtime_pb2.ExpertResponse(tensors=[chunk])


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--mode", default="cycle", choices=[*MODES, "cycle"])
    p.add_argument("--mode-file", default=None, help="read the mode from this file at each session open")
    p.add_argument("--memory-bytes", type=int, required=True)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tau-p", type=float, default=1e-4)
    p.add_argument("--max-blocks", type=int, default=0)
    p.add_argument("--public-name", default="hostile")
    args = p.parse_args(argv)
    source = resolve_source(args.model)
    prefix = default_dht_prefix(source.name)
    sd = SwarmDHT.create(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix=prefix)
    p2p = await sd.replicate_p2p()
    info = {"peer_id": sd.peer_id, "public_name": args.public_name, "state": "online"}
    handler = PetalsChainBlocks(args.mode, info, args.mode_file)
    await handler.add_p2p_handlers(p2p)
    print(f"PEER_ID {sd.peer_id}", flush=True)
    trusted = [a.rsplit("/p2p/", 1)[1] for a in args.initial_peers if "/p2p/" in a]
    span, epoch, max_length, assigned_before = None, -1, 0, False
    while True:
        asg = await sd.afetch_assignment(prefix, trusted)
        if asg is not None and asg.epoch != epoch:
            previous = span
            epoch, span, max_length = asg.epoch, asg.span_of(sd.peer_id), asg.max_length
            if previous is None and span is not None:
                if assigned_before:
                    handler.mode = next(handler.modes)  # planned again after a ban: the next kind of bad reply
                assigned_before = True
        start, num = span if span is not None else (0, 0)
        rec = ServerRecord(peer_id=sd.peer_id, state="online", memory_bytes=args.memory_bytes, tau_p=args.tau_p,
                           start_block=int(start), num_blocks=int(num), slots_total=args.slots if num else 0,
                           slots_free=args.slots if num else 0, public_name=args.public_name,
                           max_length=max_length, epoch=epoch, model_fingerprint=source.fingerprint,
                           max_blocks=args.max_blocks, timestamp=time.time())
        await sd.apublish_server(prefix, rec, 10.0)
        await asyncio.sleep(0.3)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
