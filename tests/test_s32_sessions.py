"""A server's sessions across peers, and steps larger than their session, over real hivemind P2P on loopback.

A session is bound to the stream that opened it (its steps, extends and close come on that stream only); the
server's session ids are one namespace, though. A drain released a session while its stream stayed open, and its id
could then be opened again by another peer: the first stream's steps then read and wrote the new session's K/V, and
its close closed it. And a step declaring far more tokens than its session holds was read whole (up to 2 GiB, copied
twice) before the session refused it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from petals_chain.server.runner import BlockRunner
from petals_chain.server.sessions import SessionService
from petals_chain.swarm.rpc import PetalsChainBlocks, RefusedError, RemoteError, ServerClient
from petals_chain.swarm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2, seed=0)


def _service(model, state: dict) -> SessionService:
    svc = SessionService(hidden_size=0, trusted=set(), allow_any_client=True, state=lambda: state["s"],
                         on_change=lambda: None, describe=lambda: {})
    svc.runner = BlockRunner(model, 0, 2, num_slots=4, max_length=64, progress=False, batching=False)
    svc.hidden_size = svc.runner.hidden_size
    return svc


async def _peers(backend, n: int) -> tuple[P2P, list[P2P]]:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await PetalsChainBlocks(backend, linger_s=0.2).add_p2p_handlers(server)
    maddrs = [str(m) for m in await server.get_visible_maddrs()]
    return server, [await P2P.create(initial_peers=maddrs) for _ in range(n)]


def test_a_released_session_id_is_not_opened_again(model):
    async def main():
        svc = _service(model, {"s": "online"})
        svc.open_session("s", 0, 2, 16, "peer-a")
        await svc.drain(0.0, forced=lambda: True)
        with pytest.raises(RefusedError, match="released by a drain") as info:
            svc.open_session("s", 0, 2, 16, "peer-b")
        assert info.value.code == "invalid" and not svc.sessions
        with pytest.raises(RefusedError, match="released by a drain"):
            await svc.open_session_wait("s", 0, 2, 16, "peer-b", wait_s=1.0)
        svc.open_session("t", 0, 2, 16, "peer-b")  # a new id opens as ever
        assert list(svc.sessions) == ["t"]

    asyncio.run(main())


def test_a_stream_whose_session_a_drain_released_cannot_reach_another_peers_session(model):
    """Peer A's session X is released by a drain while A's stream stays open; peer B (which learnt X: every hop of a
    chain sees its id) opened X again and A's next step computed on B's K/V, A's close closed B's session."""
    state = {"s": "online"}
    svc = _service(model, state)
    hidden = svc.hidden_size

    async def main():
        server, (pa, pb) = await _peers(svc, 2)
        try:
            a_client, b_client = ServerClient(pa, step_timeout_s=60), ServerClient(pb, step_timeout_s=60)
            a = await a_client.open_session(server.peer_id, "X", 0, 2, 16)
            await a.step(torch.randn(1, 3, hidden), 0)
            state["s"] = "draining"
            await svc.drain(0.0, forced=lambda: True)
            state["s"] = "online"  # reloaded, serving again: A's stream is still open
            with pytest.raises(RemoteError, match="released by a drain") as info:
                await b_client.open_session(server.peer_id, "X", 0, 2, 16)
            assert info.value.code == "invalid"
            b = await b_client.open_session(server.peer_id, "Y", 0, 2, 16)
            await b.step(torch.randn(1, 3, hidden), 0)
            with pytest.raises(RemoteError) as info:
                await a.step(torch.randn(1, 1, hidden), 3)
            assert info.value.code == "unavailable"  # its client fails over, as for a server gone
            await a.close()
            out = await b.step(torch.randn(1, 1, hidden), 3)
            assert out.shape == (1, 1, hidden) and list(svc.sessions) == ["Y"]
            await b.close()
        finally:
            for p in (pa, pb, server):
                await p.shutdown()

    asyncio.run(main())


class _Backend:
    """Trusts everyone; a step returns its input. It checks no lengths: the handler must not pass it a step its
    session cannot hold."""

    hidden_size = 8

    def __init__(self):
        self.steps: list[tuple[int, int]] = []  # (position, tokens) of every step that reached it

    def authorize(self, peer_id: str) -> bool:
        return True

    def open_session(self, session_id: str, *args, **kwargs) -> dict:
        return {}

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        self.steps.append((position, int(hidden.shape[1])))
        return hidden

    def extend_session(self, session_id: str, max_length: int) -> dict:
        return {"max_length": max_length}

    def close_session(self, session_id: str, **prefix) -> None:
        pass

    def info(self) -> dict:
        return {}


def test_a_step_longer_than_its_session_is_refused_before_its_chunks_are_kept():
    """The declared shape is checked against the session's max_length (raised by an extend) before the chunks are
    read; they are dropped as they come, and the stream stays in step."""
    backend = _Backend()

    async def main():
        server, (peer,) = await _peers(backend, 1)
        try:
            sess = await ServerClient(peer, step_timeout_s=60).open_session(server.peer_id, "s", 0, 1, 16)
            big = torch.zeros(1, 40_000, 8)  # 1.28 MB: two chunks
            with pytest.raises(RemoteError, match=r"positions 0\.\.39999 exceed the session's max_length 16") as info:
                await sess.step(big, 0)
            assert info.value.code == "invalid" and backend.steps == []
            assert (await sess.step(torch.ones(1, 14, 8), 0)).shape == (1, 14, 8)  # the stream is still in step
            with pytest.raises(RemoteError, match=r"positions 14\.\.17 exceed the session's max_length 16"):
                await sess.step(torch.ones(1, 4, 8), 14)
            assert await sess.extend(18) == 18
            assert (await sess.step(torch.ones(1, 4, 8), 14)).shape == (1, 4, 8)
            assert backend.steps == [(0, 14), (14, 4)]
            await sess.close()
        finally:
            await peer.shutdown()
            await server.shutdown()

    asyncio.run(main())
