"""A session turn cut between two steps (its client gone while sampling): the chain goes back to the pool as after a
completed turn. Real ``SessionMixin.session_generate`` and ``ChainHolder``, a stub chain session and decode loop.

Found by review: a cut turn kept its chain until the session's next turn or the reaper (300 s), a queued job waiting
beside the idle slot; and a turn marked to pause for a deadline job (``--schedule flex``) kept the slot it promised."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager
from petals_chain.orchestrator.sampling import SamplingParams
from petals_chain.orchestrator.sessions import SessionMixin, UserSession


class StubChain:
    hops = [("a", 0, 4)]

    def __init__(self, prefix_cache: bool):
        self.prefix_cache = prefix_cache  # every hop keeps a prefix cache: the chain is given back between turns

    async def close(self, named=b""):
        pass


class Orch(SessionMixin):
    def __init__(self, dm: DispatchManager, cut: bool):
        self.dispatch, self.cut = dm, cut
        self.sessions, self.planner, self.auditor = {}, None, None
        self.cfg = SimpleNamespace(output_reserve_tokens=0, hold_sessions=False, max_length=64)
        self.stats = SimpleNamespace(record=lambda **kw: None, add_pause=lambda: None)
        self.deadlines = SimpleNamespace(settle=lambda *a, **kw: None)
        self.replay_cache = SimpleNamespace(new=lambda: SimpleNamespace(clear=lambda: None, close=lambda: None))
        self.prefix_directory = SimpleNamespace(add=lambda *a: None)
        self.chain_sessions = set()

    def validate_prompt(self, *a, **kw):
        pass

    def check_speculative(self, *a, **kw):
        pass

    def _max_tokens(self, n, *a, **kw):
        return n

    async def _decode_loop(self, holder, target, hidden, params, emit, generated):
        await asyncio.sleep(0)
        if self.cut:
            raise asyncio.CancelledError()  # the client went away while the head sampled
        return [7], "x", "length", None


async def _turn(dm: DispatchManager, cut: bool, prefix_cache: bool, job: DispatchJob):
    orch = Orch(dm, cut)
    s = UserSession(orch, 64)
    orch.sessions[s.id] = s
    lease = await dm.acquire(job)
    s.holder.lease, s.holder.cs = lease, StubChain(prefix_cache)

    async def feed(ids, *a, **kw):
        s.holder.kv_ids.extend(ids)
        s.holder.kv_valid = len(s.holder.kv_ids)
        return "hidden"

    s.holder.feed = feed
    return orch, s, lease


@pytest.mark.parametrize("cut", [False, True])
def test_a_cut_turn_gives_its_chain_back_as_a_completed_one_does(cut):
    async def main():
        dm = DispatchManager(max_queue=8)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))])
        orch, s, lease = await _turn(dm, cut, True, DispatchJob("s", expected_output=50))
        queued = asyncio.ensure_future(dm.acquire(DispatchJob("q")))
        await asyncio.sleep(0)
        try:
            await orch.session_generate(s, [1, 2, 3], SamplingParams(max_tokens=4))
        except asyncio.CancelledError:
            assert cut
        await asyncio.sleep(0.05)
        assert lease.released and queued.done()
        dm.release(queued.result())

    asyncio.run(main())


def test_a_cut_turn_marked_to_pause_gives_its_slot_to_the_deadline_job():
    """The chain would be held between turns (no prefix cache), but the turn was marked to pause for a deadline job:
    it goes, as a completed turn's does, and the deadline job starts; a held chain is marked idle."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))])
        orch, s, lease = await _turn(dm, True, False, DispatchJob("s", expected_output=200))
        dm.charge(lease, 0.1, 1)
        urgent = asyncio.ensure_future(dm.acquire(DispatchJob("d", deadline=RequestDeadline.from_ms("x", None, 300),
                                                              output_tokens=16)))
        await asyncio.sleep(0)
        assert lease.preempt
        with pytest.raises(asyncio.CancelledError):
            await orch.session_generate(s, [1, 2, 3], SamplingParams(max_tokens=4))
        await asyncio.sleep(0.05)
        assert lease.released and urgent.done()
        dm.release(urgent.result())
        # no pause pending: the next cut turn holds its chain (no prefix cache), marked idle between turns
        orch2, s2, lease2 = await _turn(dm, True, False, DispatchJob("s2", expected_output=200))
        with pytest.raises(asyncio.CancelledError):
            await orch2.session_generate(s2, [1, 2, 3], SamplingParams(max_tokens=4))
        assert not lease2.released and lease2.job.idle

    asyncio.run(main())
