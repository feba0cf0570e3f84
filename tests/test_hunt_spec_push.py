"""Push relay (``ChainSession.forward_push``) the hunt broke: a next hop whose push handler answers with an error."""

from __future__ import annotations

import asyncio

import torch
from hivemind.p2p import P2PHandlerError

from petals_chain.orchestrator.relay import ChainSession, HopFailure

TOKEN = "ab" * 16


class _Session:
    def __init__(self, peer: str, pushed: bool):
        self.peer, self.pushed = peer, pushed
        self.session_id, self.push_token = f"s-{peer}", TOKEN
        self.input_digest, self.last_compute_s = None, None

    async def step(self, hidden: torch.Tensor, position: int, **kw) -> torch.Tensor:
        if kw.get("pushed"):  # hop 1 awaits a push that never comes (hop 0 could not push)
            await asyncio.Event().wait()
        return hidden + 1.0


def test_a_push_handler_error_at_the_next_hop_moves_that_hop():
    """Hop 0 could not push; the orchestrator pushes its output itself, and the next hop's ``rpc_push`` handler
    answers with an error (hivemind's in-stream error: a bug there, or a hostile server). That P2PHandlerError is
    neither ConnectionError nor RuntimeError: it escaped ``forward_push`` and failed the request (a 500) instead of
    moving the hop. The hop is now handed to ``recover`` like an unreachable one."""

    class Client:
        async def push(self, hop, position, step_id, route, hidden, timeout_s=30.0):
            raise P2PHandlerError("rpc_push of QmNext failed: KeyError: 'x'")

    cs = ChainSession(Client(), [("p0", 0, 2), ("p1", 2, 4)], "job.1", 64, push=True)
    cs._sessions = [_Session("p0", pushed=False), _Session("p1", pushed=True)]
    recovered = []

    async def recover(i: int, failure: HopFailure, x_in: torch.Tensor) -> torch.Tensor:
        recovered.append((i, failure.peer_id))
        return x_in + 1.0

    outs = asyncio.run(cs.forward_push(torch.zeros(1, 1, 4), 0, recover))
    assert recovered == [(1, "p1")] and cs.push_rescues == 1
    assert [float(o[0, 0, 0]) for o in outs] == [1.0, 2.0]


def test_a_lost_push_makes_the_job_relay():
    """Hop 0 says it pushed, but no push reaches hop 1, which refuses after its push timeout (30 s by default): a push
    lost on the way, or a hostile hop 0 that never pushes (it is not blamed: its replies are right, and hop 1's
    refusal blames nobody). The job kept pushing, so with a hop that keeps not pushing every step waited the whole
    timeout. It now relays through the orchestrator after the first such step."""
    from petals_chain.swarm.rpc import RemoteError

    class Client:
        async def push(self, *a, **kw):
            raise AssertionError("hop 0 said it pushed: no rescue")

    class Waiting(_Session):
        async def step(self, hidden, position, **kw):
            raise RemoteError("no push for step 1 within 30.0 s", "unavailable")

    cs = ChainSession(Client(), [("p0", 0, 2), ("p1", 2, 4)], "job.1", 64, push=True)
    cs._sessions = [_Session("p0", pushed=True), Waiting("p1", pushed=True)]

    async def recover(i: int, failure: HopFailure, x_in: torch.Tensor) -> torch.Tensor:
        return x_in + 1.0

    outs = asyncio.run(cs.forward_push(torch.zeros(1, 1, 4), 0, recover))
    assert [float(o[0, 0, 0]) for o in outs] == [1.0, 2.0]
    assert cs.push is False  # the next step is relayed (ChainHolder._forward reads it)
