"""A running job whose chain a re-plan re-split or split (it is *carried*: counted on the plan's chains through the
servers it holds, ``Lease.also``): where its work is charged under a per-chain fairness policy, what ``--schedule
flex`` sees when pausing it, and how a step on a chain it is counted on counts its idle session.
"""

from __future__ import annotations

import asyncio
import math
import types

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, chain_key
from petals_chain.orchestrator.fairness import ClientShares


def _chain(servers, spans, cap, service=1.0):
    return Chain(servers=tuple(servers), blocks=tuple(b - a for a, b in spans), service_time=service, capacity=cap,
                 spans=tuple(spans))


class _OpenSession:
    """A chain session whose open succeeds at once (nothing cached)."""

    def __init__(self, *a, **k):
        self.wait_s, self.cached_tokens, self.prefix_cache = 0.0, 0, True

    async def open(self, **k):
        pass

    async def close(self, **k):
        pass


def _holder(dm, shares, monkeypatch):
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.auth import CLIENT
    from petals_chain.orchestrator.dispatch import ChainPrefixes
    from petals_chain.orchestrator.replay import ReplayCache

    monkeypatch.setattr(failover, "ChainSession", _OpenSession)
    cfg = types.SimpleNamespace(queue_timeout_s=60.0, output_reserve_tokens=0, relay="orchestrator",
                                no_chain_wait_s=10.0, open_wait_max_s=5.0, max_failovers=2)
    orch = types.SimpleNamespace(cfg=cfg, dispatch=dm, replay_cache=ReplayCache(1 << 20), shares=shares,
                                 prefix_directory=ChainPrefixes(), deadlines=None, client=None, observe_hop=None,
                                 chain_sessions=set(), stats=None, auditor=None, planner=None, model_id="m")
    token = CLIENT.set("alice")
    try:
        return failover.ChainHolder(orch, "r-1", 4096)
    finally:
        CLIENT.reset(token)


@pytest.mark.parametrize("policy", ["d-vtc", "d2lpm"])
def test_a_carried_jobs_tokens_are_charged_on_the_chain_it_is_counted_on(policy, monkeypatch):
    """A job runs on s1 -> s2; a re-plan moves the split by a block (the same servers: the job is counted on the new
    chain). Before: its 50 output tokens were charged to the dropped chain's key, the new chain's counters never saw
    them (the next job there was ordered as if the client had been served nothing) and the dropped key came back in
    ``policy.snapshot()["counters"]``, growing with every token until the next re-plan."""
    old, new = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1), _chain(["s1", "s2"], [(0, 16), (16, 30)], 1)

    async def run():
        shares = ClientShares(FairPolicy(policy), registry=CollectorRegistry(), keyed=True)
        dm = DispatchManager(shares=shares)
        dm.set_chains([old])
        holder = _holder(dm, shares, monkeypatch)
        await holder._ensure_chain(prompt=list(range(8)), need=8)
        lease = holder.lease
        dm.set_chains([new])
        assert lease.carried and lease.generation == dm.generation and lease.index == 0
        before = shares.policy.counters(chain_key(new)).get("alice", 0.0)
        service = shares.policy.service["alice"]
        holder.charge_output(50)
        units = 50 * shares.policy.cfg.w_q
        counters = shares.policy.snapshot()["counters"]
        assert str(chain_key(old)) not in counters, "the dropped chain's key was charged (and kept) again"
        moved = shares.policy.counters(chain_key(new)).get("alice", 0.0) - before
        # VTC counts service up, D2LPM's deficit down
        assert moved == pytest.approx(units if policy == "d-vtc" else -units)
        assert shares.policy.service["alice"] == pytest.approx(service + units)
        if policy == "d2lpm":
            assert ("alice", chain_key(old)) not in shares.policy.worker_credit
            assert shares.policy.worker_credit.get(("alice", chain_key(new)), 0.0) == pytest.approx(-units)
        dm.release(lease)

    asyncio.run(run())


def test_a_job_counted_on_no_chain_is_charged_to_its_client_alone(monkeypatch):
    """Its chain split over two new chains that are both full: counted on none yet. Its tokens are its client's
    service; no per-chain entry (and none for the dropped chain) is made for them."""
    old = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1)
    a, b = _chain(["s1", "s3"], [(0, 15), (15, 30)], 1), _chain(["s4", "s2"], [(0, 15), (15, 30)], 1)

    async def run():
        shares = ClientShares(FairPolicy("d-vtc"), registry=CollectorRegistry(), keyed=True)
        dm = DispatchManager(shares=shares)
        dm.set_chains([old, a, b])
        holder = _holder(dm, shares, monkeypatch)
        await holder._ensure_chain(prompt=list(range(8)), need=8)
        others = [await dm.acquire(DispatchJob(f"o{i}", client="bob", input_tokens=1)) for i in range(2)]
        assert holder.lease.chain == old and {o.chain for o in others} == {a, b}
        dm.set_chains([a, b])  # a and b keep their jobs: the old one waits for a place on each
        assert holder.lease.generation != dm.generation  # counted on no chain yet
        service = shares.policy.service["alice"]
        holder.charge_output(10)
        assert shares.policy.service["alice"] == pytest.approx(service + 10 * shares.policy.cfg.w_q)
        assert set(shares.policy.snapshot()["counters"]) == {str(chain_key(a)), str(chain_key(b))}
        assert all("alice" not in shares.policy.counters(chain_key(c)) for c in (a, b))
        for lease in (holder.lease, *others):
            dm.release(lease)
        assert dm.running == 0

    asyncio.run(run())


def test_flex_pauses_a_carried_job_for_a_slot_of_any_chain_it_is_counted_on():
    """A job without a deadline ran on s1 -> s2; the plan split it over a slow s1 -> s3 and a fast s4 -> s2 (one slot
    each): it holds both. A job with a 2 s deadline meets it only on the fast chain. Before: FLEX saw the carried job
    on the slow chain alone and paused nobody: the deadline job waited behind the carried job's 1,000 tokens
    (a deadline miss) though pausing it frees the fast chain's slot too. And the slots a carried job frees at once
    go fastest first (JFFC's choice): the slow one first gave the deadline job the chain where it misses."""
    old = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1, 1.0)
    slow = _chain(["s1", "s3"], [(0, 15), (15, 30)], 1, 17.0)  # 1 s a step (17 steps a job)
    fast = _chain(["s4", "s2"], [(0, 15), (15, 30)], 1, 0.17)  # 10 ms a step

    async def run():
        m = DispatchManager(schedule="flex")
        m.set_chains([old])
        carried = await m.acquire(DispatchJob("bulk", expected_output=1000, output_tokens=1000))
        m.set_chains([slow, fast])
        assert carried.carried and (carried.index, carried.also) == (0, [1]) and (m.active(0), m.active(1)) == (1, 1)
        job = DispatchJob("urgent", output_tokens=10, expected_output=10,
                          deadline=RequestDeadline.from_ms("c", deadline_ms=2000, ttft_deadline_ms=None))
        waiting = asyncio.ensure_future(m.acquire(job))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiting.done() or waiting.exception() is None, f"refused: {waiting.exception()}"
        assert carried.preempt and m.flex_preemptions == 1
        m.release(carried)  # its pause: both slots free, the deadline job takes the fast one
        for _ in range(3):
            await asyncio.sleep(0)
        assert waiting.done() and waiting.result().chain == fast
        m.release(waiting.result())
        assert m.running == 0 and (m.active(0), m.active(1)) == (0, 0)

    asyncio.run(run())


def test_flex_counts_every_slot_a_carried_job_frees_when_done(monkeypatch):
    """The running jobs' remaining work (``_misses_waiting``): a carried job counted on two chains frees two slots when
    done, and a pause promised of it frees a slot on each."""
    old = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1)
    m = DispatchManager(schedule="flex")

    async def run():
        m.set_chains([old])
        carried = await m.acquire(DispatchJob("bulk", expected_output=5))
        m.set_chains([_chain(["s1", "s3"], [(0, 15), (15, 30)], 1), _chain(["s4", "s2"], [(0, 15), (15, 30)], 1)])
        assert carried.also == [1]
        seen = {}

        def spy(now, chains, remaining_s, ahead, output_tokens, **kw):
            seen["remaining"] = list(remaining_s)
            return types.SimpleNamespace(doomed=False)

        import petals_chain.orchestrator.dispatch as dispatch
        monkeypatch.setattr(dispatch, "predict_from_running", spy)
        m._misses_waiting(DispatchJob("x", output_tokens=1))
        assert len(seen["remaining"]) == 2 and math.isclose(*seen["remaining"])
        m.release(carried)

    asyncio.run(run())


def test_the_slots_a_carried_job_frees_go_to_the_waiting_jobs_fastest_first():
    """A carried job holds a slot of a slow chain (the one it shares most with, its first) and of a fast one. Before:
    at its end the slow chain's slot went first, and the one waiting job started there (JFFC starts it on the
    fastest free chain)."""
    old = _chain(["s1", "s2"], [(0, 15), (15, 30)], 1)
    slow = _chain(["s1", "s3"], [(0, 20), (20, 30)], 1, 5.0)  # shares 15 blocks of s1 and s1 alone: first
    fast = _chain(["s4", "s2"], [(0, 16), (16, 30)], 1, 0.5)  # shares 14 blocks of s2

    async def run():
        m = DispatchManager()
        m.set_chains([old])
        carried = await m.acquire(DispatchJob("c"))
        m.set_chains([slow, fast])
        assert (carried.index, carried.also) == (0, [1])
        waiting = asyncio.ensure_future(m.acquire(DispatchJob("w")))
        await asyncio.sleep(0)
        m.release(carried)
        await asyncio.sleep(0)
        assert waiting.done() and waiting.result().chain == fast
        m.release(waiting.result())
        assert m.running == 0

    asyncio.run(run())


def test_a_step_leaves_out_a_carried_session_held_between_turns():
    """Chain K (capacity 2) runs a job of its own and a session carried from a re-split chain, held between turns
    (idle). Before: the job's steps were learnt as steps of 2 jobs (the idle carried session was counted as
    stepping), so K's one-job step time stayed the planner's and its two-job one was the one-job steps'."""
    old = _chain(["s1", "s2"], [(0, 15), (15, 30)], 2)
    k_chain = _chain(["s1", "s2"], [(0, 16), (16, 30)], 2)

    async def run():
        m = DispatchManager()
        m.set_chains([old])
        session = await m.acquire(DispatchJob("sess"))
        m.set_chains([k_chain])
        assert session.carried and session.index == 0
        session.job.idle = True
        own = await m.acquire(DispatchJob("own"))
        assert own.chain == k_chain and m.active(0) == 2
        m.charge(own, 0.05, 1)
        m.charge(own, 0.05, 1)
        learnt = m.step_times._by_chain[m.chain_ids[0]]
        assert set(learnt) == {1}, f"learnt at occupancies {sorted(learnt)}"
        session.job.idle = False
        m.charge(own, 0.05, 1)
        assert set(learnt) == {1, 2}
        m.release(session)
        m.release(own)
        assert m.running == 0 and m.active(0) == 0

    asyncio.run(run())
