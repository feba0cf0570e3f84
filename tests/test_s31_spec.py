"""Speculative decoding, push relay and audits: defects of the thirty-first session (draft model that hangs, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from petals_chain.orchestrator.drafting import DraftModel, DraftState


@dataclass
class HeldForward:
    """A draft model's ``forward`` held in the draft worker (a stuck device, a deadlock) until ``release`` is set:
    ``entered`` is set once a call is held, ``calls`` has the tokens each held call fed."""

    forward: Callable
    release: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    calls: list[int] = field(default_factory=list)


@contextlib.contextmanager
def held_draft_forward(drafter: DraftModel, *, first_only: bool = False,
                       wait_s: float = 60.0) -> Iterator[HeldForward]:
    """Hold every call of ``drafter.model.forward`` (``first_only``: the first call; the model's own runs the next ones)
    until the yielded :class:`HeldForward`'s ``release`` is set, ``wait_s`` at most. On leaving, held calls are
    released and the model's own ``forward`` is back (a test that fails must not leave the worker hung)."""
    held = HeldForward(drafter.model.forward)

    def hold(*args, **kwargs):
        if first_only:
            drafter.model.forward = held.forward
        held.calls.append(int(kwargs["input_ids"].shape[1]))
        held.entered.set()
        held.release.wait(wait_s)
        return held.forward(*args, **kwargs)

    drafter.model.forward = hold
    try:
        yield held
    finally:
        held.release.set()
        drafter.model.forward = held.forward


def test_a_hung_draft_model_gives_up_and_the_others_do_not_queue_behind_it(tiny_model_factory):
    """A draft model that hangs (a stuck device, a deadlock) ran with no bound in the shared draft thread: its
    generation, and every other one drafting, waited for it forever. A call past ``timeout_s`` now gives up: that
    generation goes on without drafts, others get [] at once while the hung call still holds the worker, and drafting
    works again once it ends."""
    drafter = DraftModel.load(tiny_model_factory("llama", num_layers=2), "hangs")
    drafter.timeout_s = 0.5

    async def run(held: HeldForward) -> None:
        state = DraftState()
        assert await asyncio.wait_for(drafter.draft(state, [5, 6, 7], 3), 20) == []
        assert state.failed and drafter.failures == 1
        other = DraftState()
        assert await asyncio.wait_for(drafter.draft(other, [5, 6, 7], 3), 5) == []  # not queued behind it
        assert not other.failed and drafter.failures == 1  # not its fault: it drafts again later
        held.release.set()
        for _ in range(200):  # the hung call ends in the worker
            if await drafter.draft(other, [5, 6, 7], 3):
                break
            await asyncio.sleep(0.05)
        assert len(await drafter.draft(other, [5, 6, 7, 8], 3)) == 3 and drafter.failures == 1

    try:
        with held_draft_forward(drafter, first_only=True) as held:  # only the first call hangs
            asyncio.run(run(held))
    finally:
        drafter.close()


def test_a_missing_push_is_refused_with_its_own_code_and_the_relay_reads_the_code():
    """A hop whose push never came refused with code ``unavailable`` (the code of a drained or re-assigned server too),
    and the orchestrator told it apart by matching the text "no push for step": any other wording left the job pushing,
    every step waiting the whole push timeout. The refusal now carries ``no_push``, which the relay reads; an older
    server's ``unavailable`` with that text is still understood, and no other ``unavailable`` is taken for it."""
    import torch
    from hivemind.proto import runtime_pb2

    from petals_chain.orchestrator.relay import ChainSession, HopFailure
    from petals_chain.swarm.push import PushBox
    from petals_chain.swarm.rpc import PetalsChainBlocks, RefusedError, RemoteError

    token = "ab" * 16
    blocks = PetalsChainBlocks(backend=None, push_timeout_s=0.05)
    blocks._boxes["s1"] = PushBox(token)

    async def take() -> RefusedError:
        try:
            await blocks._take_push(runtime_pb2.ExpertRequest(), {"pushed": True, "step_id": 1, "tokens": 1}, "s1", 0)
        except RefusedError as e:
            return e
        raise AssertionError("a step with no push was taken")

    refused = asyncio.run(take())
    assert refused.code == "no_push", (refused.code, str(refused))
    assert RemoteError(str(refused), refused.code).no_push
    assert RemoteError("no push for step 3 within 30.0 s", "unavailable").no_push  # a server before the code
    assert not RemoteError("this server serves model m2 now, not m1", "unavailable").no_push

    class Session:
        def __init__(self, peer: str, error: RemoteError | None = None):
            self.session_id, self.push_token, self.error = f"s-{peer}", token, error
            self.pushed, self.input_digest, self.last_compute_s = True, None, None

        async def step(self, hidden, position, **kw):
            if self.error is not None:
                raise self.error
            return hidden + 1.0

    async def recover(i: int, failure: HopFailure, x_in):
        return x_in + 1.0

    cs = ChainSession(None, [("p0", 0, 2), ("p1", 2, 4)], "job.1", 64, push=True)
    cs._sessions = [Session("p0"), Session("p1", RemoteError("waited 30 s for the input of step 1", "no_push"))]
    outs = asyncio.run(cs.forward_push(torch.zeros(1, 1, 4), 0, recover))
    assert [float(o[0, 0, 0]) for o in outs] == [1.0, 2.0]
    assert cs.push is False  # the next step is relayed through the orchestrator


def test_a_push_taken_from_a_hop_that_then_failed_over_is_reported_as_the_failover(caplog):
    """Hop 0 pushes its output, then fails (dies before its reply, or answers garbage); its replacement's output is
    not bit-identical to what the failed server pushed. Hop 1 had computed on that push, so its input digest is not
    the replacement's reply: this was logged as hop 1 computing "on a push that is not <replacement>'s reply", the
    replacement named as if it had pushed, and counted as a push mismatch (the metric of dishonest pushes). The log
    now says hop 1 took the failed server's push, the count is left alone, and hop 1 still runs again on the
    replacement's output, relayed from then on (the failed server's push is not to be trusted)."""
    import logging

    import torch

    from petals_chain.orchestrator.relay import ChainSession, HopFailure
    from petals_chain.swarm.push import tensor_digest

    token = "ab" * 16
    pushed_by_old = torch.full((1, 1, 4), 1.0)
    replacement_out = torch.full((1, 1, 4), 1.0 + 1e-6)

    class Session:
        def __init__(self, peer: str):
            self.peer, self.session_id, self.push_token = peer, f"s-{peer}", token
            self.pushed, self.input_digest, self.last_compute_s = True, None, None

        async def step(self, hidden, position, **kw):
            if self.peer == "old0":  # pushed (hop 1 took it), then died before its reply
                raise ConnectionError("stream reset")
            if kw.get("pushed"):
                self.input_digest = tensor_digest(pushed_by_old)
                return pushed_by_old + 1.0
            return hidden + 1.0

    class Client:
        async def push(self, *a, **kw):  # the orchestrator's own push of the replacement's output (hop 1 took one)
            return None

    cs = ChainSession(Client(), [("old0", 0, 2), ("p1", 2, 4)], "job.1", 64, push=True)
    cs._sessions = [Session("old0"), Session("p1")]

    async def recover(i: int, failure: HopFailure, x_in):
        cs.hops[i], cs._sessions[i] = ("new0", 0, 2), Session("new0")  # what ChainSession.replace does
        return replacement_out

    with caplog.at_level(logging.INFO, logger="petals_chain.orchestrator.relay"):
        outs = asyncio.run(cs.forward_push(torch.zeros(1, 1, 4), 0, recover))
    assert torch.equal(outs[0], replacement_out) and torch.equal(outs[1], replacement_out + 1.0)  # hop 1 ran again
    assert cs.push_mismatches == 0 and cs.push is False
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "old0" in text and "failed" in text and "not new0's reply" not in text, text
