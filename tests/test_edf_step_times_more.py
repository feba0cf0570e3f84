"""Deadline predictions from observed steps (issue 18), continued: what is learnt of chains a re-plan removed is
forgotten, one occupancy seen scales the plan, a job's own chain opening counts in its first token, and a step looks
only at its own chain's jobs. Pure :class:`~petals_chain.algorithms.edf.StepTimes` / ``predict`` and the dispatcher
fed steps by ``charge``."""

from __future__ import annotations

import asyncio
import time

import pytest

from petals_chain.algorithms.edf import ChainLoad, Preemptible, StepTimes, flex_victim, predict, predict_from_running
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager


def _chain(name: str, capacity: int = 1, service_time: float = 0.34) -> Chain:
    # 17 steps a job by the planner: 20 ms a step
    return Chain(servers=(name,), blocks=(4,), service_time=service_time, capacity=capacity, spans=((0, 4),))


def _deadline_job(name: str, *, ttft_ms: float | None = None, deadline_ms: float | None = None,
                  tokens: int = 16) -> DispatchJob:
    return DispatchJob(name, deadline=RequestDeadline.from_ms("x", deadline_ms, ttft_ms), output_tokens=tokens)


# ---- 1. chains a re-plan removed ------------------------------------------------------------------------------------

def test_step_times_retain_forgets_the_other_chains():
    st = StepTimes(min_samples=1)
    for chain in ("a", "b"):
        st.observe(chain, 1, 0.05)
        st.observe_overhead(chain, 0.1)
        st.observe_open(chain, 0.2)
    st.retain(["a"])
    assert st.chains() == {"a"}
    assert st.step_s("a", 1, 0.02) == pytest.approx(0.05) and st.open_s("a") == pytest.approx(0.2)
    assert st.step_s("b", 1, 0.02) == 0.02 and st.overhead_s("b") == 0.0 and st.open_s("b") == 0.0


def test_what_was_learnt_of_chains_no_longer_planned_does_not_grow_with_re_plans():
    """Every plan of a long run named new chains (servers joining, leaving, moving): each kept its entries for good.
    Now the ids of at most KEPT_CHAIN_IDS chains are kept, and what was learnt of the others is forgotten; a chain
    missing from one plan only (a server that missed a refresh) comes back with its id and what was learnt of it."""
    from petals_chain.orchestrator.dispatch import KEPT_CHAIN_IDS

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([_chain("a")])
        first = dm.chain_ids[0]
        for i in range(KEPT_CHAIN_IDS // 2 + 10):
            dm.set_chains([_chain(f"s{i}"), _chain(f"t{i}")] + ([_chain("a")] if i % 2 else []))
            for _ in range(2):
                lease = await dm.acquire(DispatchJob(f"j{i}", expected_output=4))
                lease.started -= 0.05
                dm.charge(lease, 0.02, 3)
                dm.charge(lease, 0.02, 1)
                dm.release(lease)
            if i == 5:
                assert dm.chain_ids[-1] == first  # back after a plan without it: the same chain
        assert dm.step_times.chains() <= set(dm._id_by_key.values())
        assert len(dm._id_by_key) <= KEPT_CHAIN_IDS and len(dm._peak) <= KEPT_CHAIN_IDS
        assert dm.step_times.chains()  # the live chains' are kept

    asyncio.run(main())


# ---- 2. one occupancy seen ------------------------------------------------------------------------------------------

def test_one_occupancy_seen_scales_the_plan_both_ways():
    st = StepTimes(min_samples=1)
    st.observe("fast", 1, 0.005)  # four times faster than the plan's 20 ms
    st.observe("slow", 3, 0.08)  # four times slower, full
    assert st.step_s("fast", 2, 0.02) == pytest.approx(0.005) and st.step_s("fast", 3, 0.02) == pytest.approx(0.005)
    assert st.step_s("slow", 1, 0.02) == pytest.approx(0.08) and st.step_s("slow", 2, 0.02) == pytest.approx(0.08)


def test_a_chain_seen_faster_than_planned_admits_a_deadline_it_meets():
    """Planned 20 ms a step; seen 5 ms with one job stepping (a plan from a slow first measurement). A second job (two
    stepping, never seen) with 16 tokens due in 0.2 s: 17 x 5 ms. It was refused by the plan (17 x 20 ms = 0.34 s)."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([_chain("a", capacity=2)])
        lease = await dm.acquire(DispatchJob("b", expected_output=64))
        for _ in range(6):
            dm.charge(lease, 0.005, 1)
        job = _deadline_job("d", deadline_ms=200)
        assert dm.predict(job).total_s == pytest.approx(17 * 0.005)
        dm.release(await dm.acquire(job))
        assert dm.deadline_refused == 0
        dm.release(lease)

    asyncio.run(main())


# ---- 3. the job's own chain opening ---------------------------------------------------------------------------------

def test_the_prediction_counts_the_chain_opening():
    free = ChainLoad(capacity=2, active=1, job_s=2.0, step_s=0.1, open_s=0.3)
    p = predict(0.0, [free], 0, 4)
    assert p.wait_s == 0 and p.ttft_s == pytest.approx(0.4) and p.total_s == pytest.approx(0.3 + 0.5)
    assert predict(0.0, [free], 0, 4, ttft_deadline=0.35).doomed
    # the chain serving it soonest from its slot: a slow open on the chain with the faster steps loses
    other = ChainLoad(capacity=2, active=1, job_s=2.0, step_s=0.12, open_s=0.0)
    assert predict(0.0, [free, other], 0, 4).total_s == pytest.approx(0.6)
    # waiting for the running jobs' own work: every choice opens its chain too
    full = ChainLoad(capacity=1, active=1, job_s=2.0, step_s=0.1, open_s=0.3)
    r = predict_from_running(0.0, [full], [1.0], 0, 4, siblings=1)
    assert r.ttft_s == pytest.approx(1.0 + 0.3 + 0.1) and r.total_s == pytest.approx(1.0 + 2 * 0.8)
    # a pause frees the slot, not the opening
    found = flex_victim(0.0, [full], [Preemptible(chain=0, started=0.0)], 0, 4, ttft_deadline=0.35)
    assert found is None
    found = flex_victim(0.0, [full], [Preemptible(chain=0, started=0.0)], 0, 4, ttft_deadline=0.45)
    assert found is not None and found[1].ttft_s == pytest.approx(0.4)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="open_s"):
            ChainLoad(capacity=1, active=0, job_s=2.0, step_s=0.1, open_s=bad)


def test_a_job_whose_chain_takes_long_to_open_is_refused_a_first_token_it_cannot_get():
    """Each job got its slot 0.3 s before its first step (the open RPC through the chain: servers queueing opens,
    a long route). A job asking for its first token in 0.2 s on the free chain was admitted (ttft: one 20 ms step)
    and missed."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([_chain("a")])
        for i in range(5):
            lease = await dm.acquire(DispatchJob(f"b{i}", expected_output=4))
            lease.started = time.monotonic() - 0.32  # its slot 0.3 s before the 20 ms prefill began
            dm.charge(lease, 0.02, 7)
            for _ in range(4):
                dm.charge(lease, 0.02, 1)
            dm.release(lease)
        assert dm.step_times.open_s(dm.chain_ids[0]) == pytest.approx(0.3, abs=0.01)
        job = _deadline_job("d", ttft_ms=200)
        assert dm.predict(job).ttft_s == pytest.approx(0.3 + 0.02, abs=0.01)
        with pytest.raises(DeadlineUnreachable):
            await dm.acquire(job)
        # a held session's later turn opens nothing: the time from its turn's start to its first step is no open
        lease = await dm.acquire(DispatchJob("s", expected_output=4))
        lease.started = time.monotonic() - 0.32
        dm.charge(lease, 0.02, 7)
        lease.job.idle = True  # between turns
        lease.job.idle, lease.started = False, time.monotonic() - 5.0  # the next turn
        dm.charge(lease, 0.02, 3)
        assert dm.step_times.open_s(dm.chain_ids[0]) == pytest.approx(0.3, abs=0.01)
        dm.release(lease)

    asyncio.run(main())


def test_the_open_is_measured_through_the_generation_loop():
    """``ChainHolder.feed`` opens the chain, then steps: the dispatcher sees the slot given at ``acquire`` and the
    first step's start."""
    import types

    import torch

    from petals_chain.orchestrator.failover import ChainHolder

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([_chain("a")])
        orch = types.SimpleNamespace(dispatch=dm, model_id="m", auditor=None, stats=None,
                                     cfg=types.SimpleNamespace(output_reserve_tokens=0, max_failovers=3),
                                     replay_cache=types.SimpleNamespace(new=lambda: None))
        for i in range(5):
            holder = ChainHolder(orch, f"job{i}", 64)
            lease = await dm.acquire(DispatchJob(f"job{i}", expected_output=4))

            async def ensure_chain(prompt=None, need=0, holder=holder, lease=lease):
                if holder.cs is None:
                    await asyncio.sleep(0.05)  # the open RPC
                    holder.cs, holder.lease = types.SimpleNamespace(max_length=64, peers_used=()), lease

            async def forward(x, position, budget, tokens):
                return torch.zeros(1, x.shape[0], 4)

            holder._ensure_chain, holder._forward = ensure_chain, forward
            await holder.feed([1, 2, 3], torch.zeros(3, 4))
            await holder.feed([4], torch.zeros(1, 4))
            dm.release(lease)
        assert 0.05 <= dm.step_times.open_s(dm.chain_ids[0]) < 1.0

    asyncio.run(main())


# ---- 4. a step's count of the jobs stepping -------------------------------------------------------------------------

class _CountedJob(DispatchJob):
    """A job counting how often its ``idle`` is read."""

    reads = 0

    @property
    def idle(self) -> bool:
        _CountedJob.reads += 1
        return self._idle

    @idle.setter
    def idle(self, value: bool) -> None:
        self._idle = value


def test_a_step_looks_only_at_its_own_chain_s_jobs():
    """A step counted the idle sessions of its chain over every running job: O(running) per step, O(running^2) per
    round of steps (7.8 ms of event loop a round at 800 running jobs)."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([_chain(f"s{i}", capacity=2) for i in range(100)])
        leases = [await dm.acquire(_CountedJob(f"b{i}", expected_output=64)) for i in range(200)]
        for lease in leases:
            dm.charge(lease, 0.02, 1)
        _CountedJob.reads = 0
        dm.charge(leases[0], 0.02, 1)
        assert _CountedJob.reads <= 2
        for lease in leases:
            dm.release(lease)

    asyncio.run(main())


def test_the_idle_sessions_of_a_chain_are_not_counted_as_stepping():
    """Three slots: a session held between turns and two jobs stepping: their steps are steps of two jobs; once the
    session's next turn steps too, of three; across a re-plan that keeps the chain; none kept once all are released."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        a = _chain("a", capacity=3)
        dm.set_chains([a])
        cid = dm.chain_ids[0]
        session = await dm.acquire(DispatchJob("s", expected_output=64))
        dm.charge(session, 0.02, 5)
        session.job.idle = True
        one, two = [await dm.acquire(DispatchJob(n, expected_output=64)) for n in ("x", "y")]
        for _ in range(5):
            for lease in (one, two):
                dm.charge(lease, 0.04, 1)
        assert dm.step_times.step_s(cid, 2, 0.02) == pytest.approx(0.04)
        assert dm.step_times.step_s(cid, 3, 1.0) == pytest.approx(0.04)  # three never seen: the one seen
        dm.set_chains([_chain("b"), a])  # the chain stays, at another index
        session.job.idle, session.started = False, time.monotonic()
        for _ in range(5):
            for lease in (session, one, two):
                dm.charge(lease, 0.09, 1)
        assert dm.step_times.step_s(cid, 3, 0.02) == pytest.approx(0.09)
        assert dm.step_times.step_s(cid, 2, 0.02) == pytest.approx(0.04)
        for lease in (session, one, two):
            dm.release(lease)
        assert not dm._running_by_chain and not dm._lease_steps

    asyncio.run(main())


def test_a_refusal_says_the_time_left_of_the_deadline_not_a_value_the_client_did_not_send():
    """deadline_ms 1 was refused with "exceeds deadline_ms 0" (or -1): the time left, printed as if sent."""
    from petals_chain.algorithms.edf import ChainLoad, predict

    chains = [ChainLoad(capacity=1, active=0, job_s=1.0, step_s=0.05)]
    late = predict(100.0, chains, 0, 10, deadline=100.0002)
    assert late.doomed and "exceeds the time left (none) of deadline_ms" in late.reason, late.reason
    first = predict(100.0, chains, 0, 10, ttft_deadline=100.02)
    assert first.doomed and "exceeds the 20 ms left of ttft_deadline_ms" in first.reason, first.reason
