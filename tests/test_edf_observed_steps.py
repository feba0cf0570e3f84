"""Deadline predictions from the steps the chains were seen to run (issue 18): under continuous batching a full
chain's steps are slower than a job alone's (the planner's ``T_k``), and a prediction from ``T_k`` alone admitted jobs
that then missed — pure :class:`~petals_chain.algorithms.edf.StepTimes` and the dispatcher fed steps by ``charge``."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager


def test_step_times_by_occupancy_fall_back_on_the_plan():
    from petals_chain.algorithms.edf import StepTimes

    st = StepTimes(alpha=0.5, min_samples=3)
    assert st.step_s("c", 3, 0.02) == 0.02  # nothing seen: the plan
    for _ in range(2):
        st.observe("c", 1, 0.03)
    assert st.step_s("c", 1, 0.02) == 0.02  # too few steps yet
    st.observe("c", 1, 0.03)
    assert st.step_s("c", 1, 0.02) == pytest.approx(0.03)
    # one occupancy seen: the plan scaled to it (the step seen), whether the plan was slower or faster
    assert st.step_s("c", 3, 0.02) == pytest.approx(0.03) and st.step_s("c", 3, 0.05) == pytest.approx(0.03)
    for _ in range(3):
        st.observe("c", 3, 0.07)
    assert st.step_s("c", 3, 0.02) == pytest.approx(0.07)
    assert st.step_s("c", 2, 0.02) == pytest.approx(0.05)  # on the line between 1 and 3 jobs
    assert st.step_s("c", 4, 0.02) == pytest.approx(0.09)  # and beyond
    assert st.step_s("other", 3, 0.02) == 0.02  # per chain
    st.observe("c", 3, 0.17)  # an EWMA: recent steps weigh alpha
    assert st.step_s("c", 3, 0.02) == pytest.approx(0.12)
    for bad in ((0, 0.1), (2, 0.0), (2, float("inf")), (2, float("nan"))):
        st.observe("c", *bad)
    assert st.step_s("c", 2, 0.02) == pytest.approx(0.075)
    # never faster with more jobs, even when the steps seen say so
    st2 = StepTimes(min_samples=1)
    st2.observe("c", 1, 0.05)
    st2.observe("c", 3, 0.03)
    assert st2.step_s("c", 2, 0.01) == pytest.approx(0.05) and st2.step_s("c", 4, 0.01) == pytest.approx(0.05)


def _steps(dm: DispatchManager, leases, step_s: float, n: int = 6) -> None:
    for _ in range(n):
        for lease in leases:
            dm.charge(lease, step_s, 1)


def test_a_full_chain_is_predicted_at_the_steps_it_was_seen_to_run():
    """Planned: 20 ms a step (0.34 s a job of 17 steps). Seen with both slots busy: 60 ms a step. A job with 16 tokens
    to generate by 1 s behind a full chain waits ~0.51 s for a slot and then runs 17 steps of 60 ms: it misses, and
    is refused (it was admitted: 0.17 s + 0.34 s by the plan)."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=2, spans=((0, 4),))])
        leases = [await dm.acquire(DispatchJob(f"b{i}", expected_output=16)) for i in range(2)]
        job = DispatchJob("d", deadline=RequestDeadline.from_ms("x", 1000, None), output_tokens=16)
        planned = dm.predict(job)
        assert not planned.doomed and planned.total_s == pytest.approx(0.17 + 0.34)
        _steps(dm, leases, 0.06)
        seen = dm.predict(job)
        assert seen.doomed and seen.wait_s == pytest.approx(0.51) and seen.total_s == pytest.approx(0.51 + 1.02)
        with pytest.raises(DeadlineUnreachable):
            await dm.acquire(job)
        assert dm.deadline_refused == 1
        # prefill and speculative steps (not one token), and steps with no time, teach nothing
        dm2 = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm2.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=2, spans=((0, 4),))])
        more = [await dm2.acquire(DispatchJob(f"b{i}", expected_output=16)) for i in range(2)]
        for lease in more:
            for _ in range(6):
                dm2.charge(lease, 0.5, 16)
                dm2.charge(lease, 0.5, 0)
                dm2.charge(lease, 0.0, 1)
        assert not dm2.predict(job).doomed

    asyncio.run(main())


def test_a_free_slot_is_predicted_at_the_occupancy_the_job_would_find():
    """Three slots, one job running: a new job steps with two. Seen: 30 ms with two jobs, 90 ms with three (a
    full chain). The new job's 17 steps take 0.51 s (not 0.34 s by the plan, nor 1.53 s as if full); a job behind
    a full chain waits at the full chain's rate."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=3, spans=((0, 4),))])
        a = await dm.acquire(DispatchJob("a", expected_output=16))
        b = await dm.acquire(DispatchJob("b", expected_output=16))
        _steps(dm, [a, b], 0.03)
        c = await dm.acquire(DispatchJob("c", expected_output=16))
        _steps(dm, [a, b, c], 0.09)
        dm.release(c)
        job = DispatchJob("d", deadline=RequestDeadline.from_ms("x", 60_000, None), output_tokens=16)
        free = dm.predict(job)
        assert free.wait_s == 0 and free.total_s == pytest.approx(0.09 * 17)  # it fills the chain: 3 jobs step
        dm.release(b)
        assert dm.predict(job).total_s == pytest.approx(0.03 * 17)  # one job runs: it steps with two
        b2 = await dm.acquire(DispatchJob("b2", expected_output=16))
        c2 = await dm.acquire(DispatchJob("c2", expected_output=16))
        full = dm.predict(job)
        # slots free at 3 per 17 x 90 ms while the chain is full
        assert full.wait_s == pytest.approx(0.09 * 17 / 3) and full.total_s == pytest.approx(0.09 * 17 * (1 + 1 / 3))
        for lease in (a, b2, c2):
            dm.release(lease)

    asyncio.run(main())


def test_a_job_s_steps_reach_the_predictions_under_every_schedule(scaled):
    """The orchestrator's generation loop reports each step (``ChainHolder.feed`` -> ``DispatchManager.charge``):
    it did so for ``--schedule db|mlfq`` alone, so ``edf`` and ``flex`` never saw a step."""
    import types

    import torch

    from petals_chain.orchestrator.failover import ChainHolder

    async def main(schedule):
        dm = DispatchManager(schedule=schedule, steps_per_job=lambda: 17.0)  # planned: 20 ms a step
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=2, spans=((0, 4),))])
        orch = types.SimpleNamespace(dispatch=dm, model_id="m", auditor=None, stats=None,
                                     cfg=types.SimpleNamespace(output_reserve_tokens=0, max_failovers=3),
                                     replay_cache=types.SimpleNamespace(new=lambda: None))
        holder = ChainHolder(orch, "job", 64)
        lease = await dm.acquire(DispatchJob("job", expected_output=16))

        async def ensure_chain(prompt=None, need=0):
            holder.cs, holder.lease = types.SimpleNamespace(max_length=64, peers_used=()), lease

        async def forward(x, position, budget, tokens):
            await asyncio.sleep(0.03)
            return torch.zeros(1, x.shape[0], 4)

        holder._ensure_chain, holder._forward = ensure_chain, forward
        await holder.feed([1, 2, 3], torch.zeros(3, 4))  # the prefill: not a decode step
        for t in range(8):
            await holder.feed([10 + t], torch.zeros(1, 4))
        seen = dm.step_times.step_s(lease.chain_id, 1, planned=0.02)
        assert 0.03 <= seen < scaled(0.2)  # (a loaded machine's 30 ms sleeps last longer)
        dm.release(lease)

    for schedule in ("fcfs", "edf", "flex"):
        asyncio.run(main(schedule))


def test_the_time_a_job_holds_its_slot_besides_its_steps_slows_the_queue():
    """A job holds its slot while the chain is opened before its first step and closed after its last (round trips
    the steps do not show): slots free that much slower. Seen 0.2 s a job here: a job behind a full chain waits 0.54
    s, not the 0.34 s of 17 steps."""
    import time

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)  # planned: 20 ms a step, a job 0.34 s
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=1, spans=((0, 4),))])
        job = DispatchJob("d", deadline=RequestDeadline.from_ms("x", 60_000, None), output_tokens=16)
        for i in range(5):
            lease = await dm.acquire(DispatchJob(f"b{i}", expected_output=16))
            lease.started = time.monotonic() - 0.22  # opened 0.2 s before its first step (0.02 s), closed at once
            dm.charge(lease, 0.02, 3)
            dm.charge(lease, 0.02, 1)
            assert dm.predict(job).wait_s == pytest.approx(0.34)  # until seen 5 times
            dm.release(lease)
        lease = await dm.acquire(DispatchJob("b5", expected_output=16))
        assert dm.predict(job).wait_s == pytest.approx(0.34 + 0.2, abs=0.01)
        # a session held between turns does not count (it holds the slot without stepping)
        dm.charge(lease, 0.02, 1)
        lease.job.idle = True
        lease.started -= 100
        dm.release(lease)
        lease = await dm.acquire(DispatchJob("b6", expected_output=16))
        assert dm.predict(job).wait_s == pytest.approx(0.34 + 0.2, abs=0.01)
        dm.release(lease)

    asyncio.run(main())


def test_a_gap_between_two_steps_is_not_learnt_as_a_step_nor_a_fallback_as_faster():
    """A session turn cut outside its steps kept its chain; the retry's first step came the whole gap after the last
    one, and the chain's step at one job was learnt as that gap (one 0.6 s gap: 0.011 -> 0.097 s, every 1 s deadline
    then refused; found by review). A period is now taken at most at 4x the step known. And a fitted line that falls
    to 0 or below at an occupancy no longer returns the plan unclamped (faster with more jobs)."""
    from petals_chain.algorithms.edf import StepTimes
    from petals_chain.orchestrator.dispatch import GAP_FACTOR

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.34, capacity=1, spans=((0, 4),))])
        lease = await dm.acquire(DispatchJob("s", expected_output=16))
        for _ in range(12):
            await asyncio.sleep(0.01)
            dm.charge(lease, 0.01, 1)
        before = dm.step_times.step_s(lease.chain_id, 1, 0.02)
        await asyncio.sleep(0.6)
        dm.charge(lease, 0.01, 1)
        after = dm.step_times.step_s(lease.chain_id, 1, 0.02)
        dm.release(lease)
        return before, after

    before, after = asyncio.run(main())
    assert after <= before + (GAP_FACTOR - 1) * before * 0.5 + 1e-9, (before, after)  # one sample, EWMA weight <= 1/2
    st = StepTimes(min_samples=1)
    st.observe("c", 2, 0.05)
    st.observe("c", 3, 0.20)
    assert st.step_s("c", 1, 0.5) <= st.step_s("c", 2, 0.5) <= st.step_s("c", 3, 0.5)
