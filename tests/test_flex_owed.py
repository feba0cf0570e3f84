"""``--schedule flex``: deadline jobs owed a slot (``_owed``: their paused job's slot went to a job before them). A
promise passing on names them in the order they were owed, not by deadline, and that is no defect: a paused job's slot
goes to the queue's head (the earliest deadline) whichever job its promise names, and the promises only count (a
randomized comparison of both orders over 1,500 runs of arrivals, releases, cancellations and re-plans found no
decision that differed). This pins the order the slots go in. Units on DispatchManager."""

from __future__ import annotations

import asyncio

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager


def _chains():
    # one slot each, 0.1 s a step (17 steps a job)
    return [Chain(servers=(s,), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),)) for s in ("a", "b", "c")]


def _urgent(name: str, ttft_ms: float) -> DispatchJob:
    return DispatchJob(name, deadline=RequestDeadline.from_ms("x", None, ttft_ms), output_tokens=16)


def test_the_earliest_deadline_owed_a_slot_gets_the_next_one_paused_for_another():
    """Two deadline jobs owed a slot, the later deadline owed first; a third deadline job's pause is no longer needed
    (its client went) and passes on: the slot it frees goes to the earliest deadline, and the other stays owed."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains(_chains())
        victims = [await dm.acquire(DispatchJob(f"v{i}", expected_output=200)) for i in range(3)]
        late = asyncio.ensure_future(dm.acquire(_urgent("late", 1500)))
        await asyncio.sleep(0)
        early = asyncio.ensure_future(dm.acquire(_urgent("early", 1000)))
        await asyncio.sleep(0)
        marked = {dm._promised[v].job_id: v for v in victims if v.preempt}
        assert set(marked) == {"late", "early"}, marked
        # jobs back from a failover (the re-queue lane) take the paused slots first, late's first: both are owed
        lane = [asyncio.ensure_future(dm.acquire(DispatchJob(f"r{i}", expected_output=200, requeue=True)))
                for i in range(2)]
        await asyncio.sleep(0)
        dm.release(marked["late"])
        dm.release(marked["early"])
        await asyncio.sleep(0)
        assert all(t.done() for t in lane) and [j.job_id for j in dm._owed] == ["late", "early"]
        third = asyncio.ensure_future(dm.acquire(_urgent("third", 600)))
        await asyncio.sleep(0)
        victim = next(v for v, j in dm._promised.items() if j.job_id == "third")
        third.cancel()
        await asyncio.gather(third, return_exceptions=True)
        assert victim.preempt  # passed on, not taken back
        dm.release(victim)
        await asyncio.sleep(0)
        assert early.done() and not late.done() and [j.job_id for j in dm._owed if j in dm._waiters] == ["late"]
        for t in (early, *lane):
            dm.release(t.result())
        await asyncio.sleep(0)
        assert late.done()
        for lease in [late.result(), *victims]:
            dm.release(lease)

    asyncio.run(main())
