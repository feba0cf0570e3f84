"""Who ends a session stream, and when the other side learns it (real hivemind P2P on loopback, stand-in backends).

A handler that closes its end right after its last reply lets the P2P daemons reset the stream with the reply in
flight (``scripts/stress_streams.py`` measures it): a server therefore keeps the stream after a refusal or a close
until the client ends it. And a stream the server does end, with or without a reply, must reach the client at
once as an error, not as a silent server until the open times out (hivemind's own stream client waits for the
requests to end before it reports the end of the stream).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from typing import AsyncIterator

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from petals_chain.swarm.rpc import PeerStream, PetalsChainBlocks, RemoteError, ServerClient, _drain, _pack

_spec = importlib.util.spec_from_file_location(
    "_stress_streams", Path(__file__).resolve().parents[1] / "scripts" / "stress_streams.py")
stress_streams = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress_streams)
RefusingBackend = stress_streams.RefusingBackend  # refuses every open at once


class Recording(PetalsChainBlocks):
    """Records when each session or ping handler returns (the server's end of the stream closes then)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ended: list[float] = []

    async def _recorded(self, replies: AsyncIterator[runtime_pb2.ExpertResponse]
                        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            async for reply in replies:
                yield reply
        finally:
            self.ended.append(time.monotonic())

    def rpc_session(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                    context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._recorded(super().rpc_session(requests, context))

    def rpc_ping(self, request: runtime_pb2.ExpertRequest,
                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._recorded(super().rpc_ping(request, context))


Recording.__name__ = "PetalsChainBlocks"  # the class name is the wire's handler name


class Mute(PetalsChainBlocks):
    """Reads the open and ends the stream without a reply: what a lost reply looks like from the client."""

    async def rpc_session(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await requests.__anext__()
        return
        yield  # an async generator, like every stream handler


Mute.__name__ = "PetalsChainBlocks"


async def _swarm(*handlers: PetalsChainBlocks) -> tuple[list[P2P], P2P]:
    servers = []
    for handler in handlers:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await handler.add_p2p_handlers(p2p)
        servers.append(p2p)
    maddrs = [str(m) for p2p in servers for m in await p2p.get_visible_maddrs()]
    return servers, await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


async def _shutdown(servers: list[P2P], client_p2p: P2P) -> None:
    await client_p2p.shutdown()
    for p2p in servers:
        await p2p.shutdown()


async def _until_ended(handler: Recording, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not handler.ended:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _open_message() -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=_pack({"op": "open", "session_id": "s", "start_block": 0,
                                                     "end_block": 1, "max_length": 8}))


def test_a_refusal_keeps_the_stream_until_the_client_ends_it(scaled):
    async def main():
        lingering, closing = Recording(RefusingBackend()), Recording(RefusingBackend(), linger_s=0.0)
        servers, client_p2p = await _swarm(lingering, closing)
        try:
            for handler, p2p in ((lingering, servers[0]), (closing, servers[1])):
                queue: asyncio.Queue = asyncio.Queue()
                queue.put_nowait(_open_message())
                stream = await PeerStream.open(client_p2p, p2p.peer_id, "rpc_session", _drain(queue))
                reply = await asyncio.wait_for(stream.__anext__(), scaled(10))
                assert b"this stand-in refuses every open" in reply.metadata
                after = asyncio.ensure_future(stream.__anext__())
                done, _ = await asyncio.wait({after}, timeout=scaled(1.0))
                if handler is closing:  # closed at once: the end reaches the client at once
                    assert done and isinstance(after.exception(), StopAsyncIteration)
                    assert handler.ended
                    continue
                assert not done and not handler.ended  # held: the reply cannot be reset away in flight
                t_end = time.monotonic()
                queue.put_nowait(None)  # the client ends the stream: the server's handler returns
                await _until_ended(handler, scaled(5), "the server held the stream after the client ended it")
                assert handler.ended[0] >= t_end
                await asyncio.wait({after}, timeout=scaled(5))
                assert after.done()
        finally:
            await _shutdown(servers, client_p2p)

    asyncio.run(main())


def test_a_ping_keeps_its_stream_until_the_client_closes_it(scaled):
    """A one-message call cannot wait for the client's end of stream (hivemind has read it before the handler runs):
    the server holds the stream after its reply until the client closes its end."""
    async def main():
        holding, closing = Recording(RefusingBackend()), Recording(RefusingBackend(), linger_s=0.0)
        servers, client_p2p = await _swarm(holding, closing)
        try:
            for handler, p2p in ((holding, servers[0]), (closing, servers[1])):
                replies = await PetalsChainBlocks.get_stub(client_p2p, p2p.peer_id).rpc_ping(
                    runtime_pb2.ExpertRequest(metadata=b"hello"))
                assert (await asyncio.wait_for(replies.__anext__(), scaled(10))).metadata == b"hello"
                await asyncio.sleep(scaled(1.0))  # we still hold our end
                if handler is closing:
                    assert handler.ended  # closed at once after the reply
                    await replies.aclose()
                    continue
                assert not handler.ended
                t_close = time.monotonic()
                await replies.aclose()  # hivemind closes our end of the stream: the server's handler is cancelled
                await _until_ended(handler, scaled(5), "the server held the ping's stream after the client closed it")
                assert handler.ended[0] >= t_close
        finally:
            await _shutdown(servers, client_p2p)

    asyncio.run(main())


def test_a_stream_ended_without_a_reply_fails_the_open_at_once(scaled):
    async def main():
        servers, client_p2p = await _swarm(Mute(RefusingBackend()), PetalsChainBlocks(RefusingBackend()))
        mute, refusing = (p2p.peer_id.to_base58() for p2p in servers)
        try:
            client = ServerClient(client_p2p, open_timeout_s=scaled(30))
            t0 = time.monotonic()
            try:
                await client.open_session(mute, "s", 0, 1, 8)
                raise AssertionError("the open succeeded on a server that never replied")
            except ConnectionError as e:
                assert "closed the stream" in str(e), e
            assert time.monotonic() - t0 < scaled(5), "the end of the stream reached the client only by timeout"
            # the same client, a server that answers: its refusal arrives as the server's error
            try:
                await client.open_session(refusing, "s", 0, 1, 8)
                raise AssertionError("the stand-in refuses every open")
            except RemoteError as e:
                assert e.code == "invalid" and "this stand-in refuses every open" in str(e)
        finally:
            await _shutdown(servers, client_p2p)

    asyncio.run(main())


def test_stress_script_counts_every_open():
    """``scripts/stress_streams.py`` in miniature: every refused open is counted once, and with both fixes each one
    gets its reply."""
    r = asyncio.run(stress_streams.run_mode("after", 60, 20, 10.0))
    assert (r["replied"], r["ended"], r["silent"]) == (60, 0, 0), r
    r = asyncio.run(stress_streams.run_mode("before", 20, 10, 10.0))
    assert r["replied"] + r["ended"] + r["silent"] == 20, r
    r = asyncio.run(stress_streams.run_mode("ping-after", 40, 20, 10.0))
    assert (r["replied"], r["ended"], r["silent"]) == (40, 0, 0), r
