"""Stream messages a peer announces larger than the swarm ever sends: refused unread, on both sides of a stream.

hivemind read whatever length a message's header announced into memory before anything parsed it, so one stream of
anyone (a server answers every peer's ``rpc_push``) made the reader hold 500 MB in 2 s, and a hostile server's
reply did the same to its orchestrator."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from petals_chain.swarm.aio import MAX_STREAM_MESSAGE_BYTES, OversizedMessage
from petals_chain.swarm.rpc import (CHUNK_BYTES, MAX_METADATA_BYTES, PetalsChainBlocks, ServerClient, push_step,
                                    serialize_chunks)

BIG = MAX_STREAM_MESSAGE_BYTES + (1 << 20)


class _Backend:
    """A server that trusts everyone or nobody and adds ``extra_bytes`` of text to its open and info replies."""

    hidden_size = 8

    def __init__(self, trusted: bool = False, extra_bytes: int = 0):
        self.trusted, self.extra_bytes = trusted, extra_bytes

    def authorize(self, peer_id: str) -> bool:
        return self.trusted

    def open_session(self, session_id: str, *args, **kwargs) -> dict:
        return {"notes": "x" * self.extra_bytes}

    def close_session(self, session_id: str, **prefix) -> None:
        pass

    def extend_session(self, session_id: str, max_length: int) -> dict:
        return {"max_length": max_length}

    def info(self) -> dict:
        return {"notes": "x" * self.extra_bytes}


async def _pair(backend: _Backend) -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await PetalsChainBlocks(backend, linger_s=0.2).add_p2p_handlers(server)
    client = await P2P.create(initial_peers=[str(m) for m in await server.get_visible_maddrs()])
    return server, client


def test_the_bound_leaves_room_for_every_message_of_ours():
    assert CHUNK_BYTES + MAX_METADATA_BYTES + 4096 < MAX_STREAM_MESSAGE_BYTES


def test_a_message_announced_too_large_is_refused_before_it_is_read():
    """The header alone decides: the bytes that follow are never buffered (before: they were, then returned)."""

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(BIG.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(BIG))
        reader.feed_eof()
        with pytest.raises(OversizedMessage, match=f"{BIG} bytes"):
            await P2P.receive_raw_data(reader)
        small = asyncio.StreamReader()
        small.feed_data((3).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"abc")
        assert await P2P.receive_raw_data(small) == b"abc"

    asyncio.run(main())


def test_a_servers_oversized_reply_is_a_connection_error():
    """A server whose reply is over the bound is a failed server for its client, named so in a session (before: the
    reply was read whole and the open or info call succeeded)."""

    async def main():
        server, client = await _pair(_Backend(trusted=True, extra_bytes=BIG))
        try:
            with pytest.raises(ConnectionError, match="announced a message of"):
                await ServerClient(client, open_timeout_s=30).open_session(server.peer_id, "s", 0, 1, 16)
            with pytest.raises(ConnectionError):
                await ServerClient(client).info(server.peer_id, timeout_s=30)
            ok_server, ok_client = await _pair(_Backend(trusted=True, extra_bytes=1000))
            try:  # the same calls with replies of ordinary size
                sess = await ServerClient(ok_client, open_timeout_s=30).open_session(ok_server.peer_id, "s", 0, 1, 16)
                await sess.close()
                assert (await ServerClient(ok_client).info(ok_server.peer_id, timeout_s=30))["notes"] == "x" * 1000
            finally:
                await ok_client.shutdown()
                await ok_server.shutdown()
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_an_oversized_push_from_a_stranger_ends_the_stream_unanswered():
    """A stranger's push of ordinary size is refused as ``untrusted``; one over the bound ends the stream with no
    reply at all (before: the server read it whole, then refused it)."""

    def push(metadata_bytes: int) -> runtime_pb2.ExpertRequest:
        meta = {"session_id": "s", "token": "t" * 16, "position": 0, "step_id": 0, "pad": b"\0" * metadata_bytes}
        return runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps(meta))

    async def replies(server: P2P, client: P2P, request: runtime_pb2.ExpertRequest) -> list[dict]:
        name = PetalsChainBlocks._get_handle_name(None, "rpc_push")
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, name)
        out = []
        try:
            await P2P.send_protobuf(request, writer)  # reset under us when the server ends the stream first
            while True:
                reply, err = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 30)
                out.append(MSGPackSerializer.loads(reply.metadata) if err is None else {"error": err.message})
        except (asyncio.IncompleteReadError, ConnectionError):
            return out
        finally:
            writer.close()

    async def main():
        server, client = await _pair(_Backend())
        try:
            assert [r.get("code") for r in await replies(server, client, push(1000))] == ["untrusted"]
            assert await replies(server, client, push(BIG)) == []
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_a_push_longer_than_its_session_is_refused_before_it_is_read():
    """A push is for a session of ``max_length`` tokens: one of more tokens (a chain-mate's 2 GiB, four of them
    kept waiting) is refused from its first message, and ``extend`` raises the bound with the session's own (before:
    any length was read and kept for the step)."""
    token = "ab" * 16

    async def main():
        server, client = await _pair(_Backend(trusted=True))
        try:
            sess = await ServerClient(client, open_timeout_s=30).open_session(server.peer_id, "s", 0, 1, 16,
                                                                             push_token=token)
            hop = {"peer": server.peer_id.to_base58(), "session_id": "s", "token": token}
            await push_step(client, hop, 0, 1, [], serialize_chunks(torch.ones(1, 16, 8)), timeout_s=30)
            with pytest.raises(RuntimeError, match="invalid.*17 tokens.*at most 16"):
                await push_step(client, hop, 0, 2, [], serialize_chunks(torch.ones(1, 17, 8)), timeout_s=30)
            assert await sess.extend(64) == 64
            await push_step(client, hop, 0, 3, [], serialize_chunks(torch.ones(1, 64, 8)), timeout_s=30)
            with pytest.raises(RuntimeError, match="65 tokens"):
                await push_step(client, hop, 0, 4, [], serialize_chunks(torch.ones(1, 65, 8)), timeout_s=30)
            await sess.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())
