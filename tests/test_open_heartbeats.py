"""A queued open's heartbeats on the wire (real hivemind P2P on loopback, a stand-in session backend).

A server that heartbeats answers an open waiting for slots with "still waiting" replies, so the client keeps a long
wait and gives up on silence within a few periods; a client that did not ask gets no heartbeat (older clients read
the first reply as the open's), and a server that does not heartbeat (an older one) ignores the field.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from petals_chain.swarm.rpc import (HEARTBEATS_MISSED, MIN_HEARTBEAT_S, NoCapacityError, PetalsChainBlocks,
                                    RefusedError, ServerClient, _pack, _unpack)


class WaitingBackend:
    """Every open must wait: it is served when :attr:`free` is set (or refused when its wait runs out)."""

    hidden_size = 8
    model_fingerprint = ""

    def __init__(self):
        self.free = asyncio.Event()
        self.waiting: list[str] = []  # opens that reached the wait
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.withdrawn: list[str] = []

    def authorize(self, peer_id: str) -> bool:
        return True

    def open_session(self, *args, **kwargs) -> dict:
        raise RefusedError("no_capacity", "no capacity: full")

    async def open_session_wait(self, sid, start, end, max_length, peer, wait_s, **kwargs) -> dict:
        self.waiting.append(sid)
        try:
            await asyncio.wait_for(self.free.wait(), wait_s)
        except asyncio.TimeoutError:
            raise RefusedError("no_capacity", f"no capacity: no slots freed up within {wait_s} s") from None
        except asyncio.CancelledError:
            self.withdrawn.append(sid)
            raise
        self.opened.append(sid)
        return {"slots_free": 0}

    def close_session(self, session_id: str, **kwargs) -> None:
        self.closed.append(session_id)

    def info(self) -> dict:
        return {}

    def session(self, session_id: str):
        return None


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_queued_open_heartbeats_and_silence_is_given_up_on(scaled):
    async def main():
        beating, silent = WaitingBackend(), WaitingBackend()
        servers = []
        for backend, heartbeats in ((beating, True), (silent, False)):
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            await PetalsChainBlocks(backend, open_heartbeats=heartbeats).add_p2p_handlers(p2p)
            servers.append(p2p)
        maddrs = [str(m) for p2p in servers for m in await p2p.get_visible_maddrs()]
        client_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        a, b = (p2p.peer_id.to_base58() for p2p in servers)
        try:
            # the grace is the client's allowance for a loaded machine: scaled, as another test file's swarm may
            # hold the cores (0.3 s unscaled: a heartbeat 1.3 s late, a stall of a loaded loop, failed step 1)
            client = ServerClient(client_p2p, open_timeout_s=scaled(20), heartbeat_grace_s=scaled(0.3))
            client.heartbeat_s = 0.1  # the server keeps MIN_HEARTBEAT_S (0.5 s)
            client.heartbeats = lambda peer: True  # as if both records said so (b's lies: an older server)
            silence_s = HEARTBEATS_MISSED * MIN_HEARTBEAT_S + client.heartbeat_grace_s  # what ends a silent wait

            # 1. the open waits longer than the silence that ends it and is kept alive by heartbeats meanwhile, then
            # served
            opening = asyncio.ensure_future(client.open_session(a, "waits", 0, 2, 32, wait_s=30))
            await _until(lambda: beating.waiting == ["waits"], scaled(10), "the open never reached the server")
            await asyncio.sleep(silence_s + 0.5)
            assert not opening.done()
            beating.free.set()
            sess = await asyncio.wait_for(opening, scaled(10))
            assert beating.opened == ["waits"] and sess.open_heartbeats >= 3, sess.open_heartbeats
            await sess.close()
            await _until(lambda: beating.closed == ["waits"], scaled(5), "the session was not closed")

            # 2. a server that never answers the heartbeat: given up on after 3 periods + grace, not after wait_s,
            # and the wait at the server is withdrawn
            t0 = time.monotonic()
            with pytest.raises(ConnectionError, match="no reply within"):
                await client.open_session(b, "lost", 0, 2, 32, wait_s=30)
            assert time.monotonic() - t0 < scaled(5)
            await _until(lambda: silent.withdrawn == ["lost"], scaled(5), "the silent server kept the wait")

            # 3. a client that does not ask for heartbeats gets none: the first reply is the open's own
            beating.free.clear()
            client.heartbeats = lambda peer: False
            opening = asyncio.ensure_future(client.open_session(a, "plain", 0, 2, 32, wait_s=30))
            await asyncio.sleep(0.5)
            beating.free.set()
            sess = await asyncio.wait_for(opening, scaled(10))
            assert sess.open_heartbeats == 0
            await sess.close()

            # 4. the server's own wait runs out while it heartbeats: the refusal reaches the client
            beating.free.clear()
            client.heartbeats = lambda peer: True
            with pytest.raises(NoCapacityError, match="within 0.5"):
                await client.open_session(a, "late", 0, 2, 32, wait_s=0.5)

            # 5. a client that leaves while its open waits withdraws it there (no slots held for nobody)
            opening = asyncio.ensure_future(client.open_session(a, "gone", 0, 2, 32, wait_s=30))
            # (cancelled before it reached the server, there was nothing to withdraw: the check failed under load)
            await _until(lambda: "gone" in beating.waiting, scaled(10), "the open never reached the server")
            opening.cancel()
            await _until(lambda: "gone" in beating.withdrawn, scaled(5), "a left client's open kept waiting")

            # 6. a malformed heartbeat_s is refused like any malformed field
            stub = PetalsChainBlocks.get_stub(client_p2p, PeerID.from_base58(a))
            for bad in (-1.0, "5", True, float("inf")):
                queue: asyncio.Queue = asyncio.Queue()
                queue.put_nowait(runtime_pb2.ExpertRequest(metadata=_pack({
                    "op": "open", "session_id": "bad", "start_block": 0, "end_block": 2, "max_length": 32,
                    "wait_s": 5.0, "heartbeat_s": bad})))

                async def requests():
                    while True:
                        yield await queue.get()

                stream = await stub.rpc_session(requests())
                reply = _unpack((await asyncio.wait_for(stream.__anext__(), scaled(10))).metadata)
                assert not reply["ok"] and reply["code"] == "invalid" and "heartbeat_s" in reply["error"], reply
        finally:
            await client_p2p.shutdown()
            for p2p in servers:
                await p2p.shutdown()

    asyncio.run(main())
