"""``--schedule flex``: a running job marked to pause for a deadline job (``_pause_for``) when that job starts on a
slot freed otherwise. It paused anyway, for nobody (a round trip, a recompute with ``--kv-cache slots``), and its
marked slot made the next doomed deadline job find nothing to pause (refused). Units on DispatchManager."""

from __future__ import annotations

import asyncio

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager


def _two_chains():
    # one slot each, 0.1 s a step (17 steps a job): a job behind both waits ~0.85 s at the queue's rate
    return [Chain(servers=(s,), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),)) for s in ("a", "b")]


def _urgent(name: str, ttft_ms: float = 300) -> DispatchJob:
    return DispatchJob(name, deadline=RequestDeadline.from_ms("x", None, ttft_ms), output_tokens=16)


def _long(name: str) -> DispatchJob:
    """A running job with a deadline a minute away: never paused."""
    return DispatchJob(name, deadline=RequestDeadline.from_ms("x", 60_000, None), output_tokens=16,
                       expected_output=16)


def test_a_pause_is_taken_back_when_its_deadline_job_starts_elsewhere():
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains(_two_chains())
        victim = await dm.acquire(DispatchJob("v", expected_output=200))  # no deadline: pausable
        other = await dm.acquire(_long("w"))
        assert (victim.index, other.index) == (0, 1)
        urgent = asyncio.ensure_future(dm.acquire(_urgent("d")))
        await asyncio.sleep(0)
        assert victim.preempt and dm.flex_preemptions == 1 and not urgent.done()
        dm.release(other)  # the other chain frees first: the deadline job starts there
        await asyncio.sleep(0)
        assert urgent.done() and urgent.result().index == 1
        assert not victim.preempt and dm.flex_preemptions == 0  # it runs on: nobody needs its slot
        # a later doomed deadline job finds it to pause (left marked, it found nothing and was refused)
        later = asyncio.ensure_future(dm.acquire(_urgent("e")))
        await asyncio.sleep(0)
        assert not later.done() and victim.preempt and dm.flex_preemptions == 1 and dm.deadline_refused == 0
        dm.release(victim)
        await asyncio.sleep(0)
        assert later.done() and later.result().index == 0
        for t in (urgent, later):
            dm.release(t.result())

    asyncio.run(main())


def test_a_pause_passes_to_the_deadline_job_whose_promised_slot_another_took():
    """Two deadline jobs, each with a job paused for it; the second's paused first and its slot went to the first
    (earlier deadline, the queue's head): the first's own paused job is then the second's, not taken back."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains(_two_chains())
        v1 = await dm.acquire(DispatchJob("v1", expected_output=200))
        v2 = await dm.acquire(DispatchJob("v2", expected_output=200))
        d1 = asyncio.ensure_future(dm.acquire(_urgent("d1", 300)))
        await asyncio.sleep(0)
        # behind d1 it waits for a slot at the queue's rate (1.8 s to its first token, in time) but the running jobs
        # free none for 20 s: it pauses the other one
        d2 = asyncio.ensure_future(dm.acquire(_urgent("d2", 2000)))
        await asyncio.sleep(0)
        assert v1.preempt and v2.preempt and dm.flex_preemptions == 2
        dm.release(v2)  # v2 (paused for d2) steps first: d1 takes its slot
        await asyncio.sleep(0)
        assert d1.done() and not d2.done()
        assert v1.preempt and dm.flex_preemptions == 2  # still promised: to d2 now
        dm.release(v1)
        await asyncio.sleep(0)
        assert d2.done() and d2.result().index == v1.index
        for t in (d1, d2):
            dm.release(t.result())

    asyncio.run(main())


def test_a_pause_is_taken_back_when_its_deadline_job_leaves_the_queue():
    """The deadline job's client goes (or its deadline passes in the queue): the job marked to pause for it runs on,
    taken back at the next step any job reports (``charge``), before its own next step."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains(_two_chains())
        victim = await dm.acquire(DispatchJob("v", expected_output=200))
        other = await dm.acquire(_long("w"))
        urgent = asyncio.ensure_future(dm.acquire(_urgent("d")))
        await asyncio.sleep(0)
        assert victim.preempt
        urgent.cancel()
        await asyncio.gather(urgent, return_exceptions=True)
        dm.charge(other, 0.1, 1)
        assert not victim.preempt and dm.flex_preemptions == 0
        for lease in (victim, other):
            dm.release(lease)

    asyncio.run(main())


def _one_slot(name: str) -> Chain:
    return Chain(servers=(name,), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))


def test_a_promise_is_taken_back_when_its_job_is_cancelled_before_the_victims_next_step():
    """The victim runs alone on its chain; its own step's charge came before the deadline job arrived, and the deadline
    job's client went during the victim's sampling: nothing settled the promise before the victim's next step, which
    paused it for nobody (found by review)."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains([_one_slot("a")])
        victim = await dm.acquire(DispatchJob("v", expected_output=200))
        dm.charge(victim, 0.1, 1)
        urgent = asyncio.ensure_future(dm.acquire(_urgent("d")))
        await asyncio.sleep(0)
        assert victim.preempt and dm.flex_preemptions == 1
        urgent.cancel()
        await asyncio.gather(urgent, return_exceptions=True)
        assert not victim.preempt and dm.flex_preemptions == 0

    asyncio.run(main())


def test_a_promise_on_a_chain_a_re_plan_dropped_is_taken_back():
    """The victim's chain left the plan: its pause would free a slot no dispatcher of the new plan sees (found by
    review): it runs on, its pause not counted, and the deadline job waits as one owed a slot."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        a, b = _one_slot("a"), _one_slot("b")
        dm.set_chains([a, b])
        victim = await dm.acquire(DispatchJob("v", expected_output=200))
        w = await dm.acquire(DispatchJob("w", deadline=RequestDeadline.from_ms("x", 60_000, None),
                                         output_tokens=16, expected_output=16))
        assert (victim.index, w.index) == (0, 1)
        urgent = asyncio.ensure_future(dm.acquire(_urgent("d")))
        await asyncio.sleep(0)
        assert victim.preempt
        dm.set_chains([b])
        assert victim.generation != dm.generation
        assert not victim.preempt and dm.flex_preemptions == 0 and dm._owed == [urgent_job(dm, "d")]
        urgent.cancel()
        await asyncio.gather(urgent, return_exceptions=True)

    def urgent_job(dm, name):
        return next(j for j in dm._waiters if j.job_id == name)

    asyncio.run(main())
