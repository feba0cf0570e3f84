"""The queue bound (``--max-queue``) with requests of several jobs through re-plans and failovers: a held free slot
(``queue_slots_held``) whose chain a re-plan drops, or that a failed-over job of its request takes, must not let the
later job it was held for queue past the bound; and a first job SED queues beside a free slot keeps it too."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry
from test_queue_bound_siblings import _submit

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import PLACE, DispatchJob, DispatchManager, QueueFull, RequestPlaces
from petals_chain.orchestrator.fairness import ClientShares


def _chains(*capacities: int, names: str = "") -> list[Chain]:
    names = names or "".join(chr(ord("a") + k) for k in range(len(capacities)))
    return [Chain(servers=(f"s{names[k]}",), blocks=(4,), service_time=1.0 + k, capacity=c, spans=((0, 4),))
            for k, c in enumerate(capacities)]


def _refused(task: asyncio.Task) -> bool:
    return task.done() and isinstance(task.exception(), QueueFull)


async def _end(dm: DispatchManager, *tasks: asyncio.Task) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            dm.release(t.result())
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _within(dm: DispatchManager) -> bool:
    return dm.queue_length + dm.places_held <= dm.max_queue and dm.queue_max <= dm.max_queue


def test_a_replan_that_drops_a_held_slot_keeps_the_bound():
    """max_queue 1, chains a (2 slots) and b (1): n = 3 starts on a, holds the queue's place and a's free slot. A
    re-plan drops a (its running job goes on there) and keeps b, now full with another job: the later choice the
    slot was held for found none and queued 2 of 1; now it waits in the re-queue lane (admitted, not counted) and
    takes the next slot that frees."""
    async def main():
        dm = DispatchManager(max_queue=1)
        dm.set_chains(_chains(2, 1))
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert first.done() and not first.exception() and dm.places_held == 1 and dm.slots_held == 1
        assert first.result().index == 0
        busy = await _submit(dm, DispatchJob("busy"))  # b's slot
        assert busy.done() and busy.result().index == 1
        dm.set_chains(_chains(1, names="b"))  # a is gone; b is full
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2)]
        assert not any(t.done() for t in later)
        assert _within(dm), (dm.queue_length, dm.places_held, dm.queue_max)
        assert dm.queue_length + dm.requeued == 2
        dm.release(busy.result())
        await asyncio.sleep(0)
        assert sum(t.done() for t in later) == 1
        await _end(dm, first, busy, *later)
        assert (dm.running, dm.queue_length, dm.requeued, dm.places_held, dm.slots_held) == (0, 0, 0, 0, 0)

    asyncio.run(main())


def test_a_failed_over_first_job_on_its_held_slot_keeps_the_bound():
    """max_queue 1, one chain of 3 slots: n = 4 starts, holds the queue's place and the two free slots. Its first job
    fails over (its lease given back) while a new job took the slot it freed: back in the lane it takes one of its
    request's held slots. Before, both later choices then still counted on those slots: one took the slot left, the
    other queued beside the place held for the third, 2 of 1; now it waits in the lane."""
    async def main():
        dm = DispatchManager(max_queue=1)
        dm.set_chains(_chains(3))
        tickets = RequestPlaces().expect(4)

        async def first_job():
            PLACE.set(tickets[0])
            lease = await dm.acquire(DispatchJob("r0", siblings=3))
            dm.release(lease)  # its chain failed: it comes back at once, admitted
            grabbed.set()
            await taken.wait()
            return await dm.acquire(DispatchJob("r0", requeue=True))

        grabbed, taken = asyncio.Event(), asyncio.Event()
        first = asyncio.ensure_future(first_job())
        await grabbed.wait()
        assert dm.places_held == 1 and dm.slots_held == 2
        x = await _submit(dm, DispatchJob("x"))  # takes the slot the failed job freed
        assert x.done() and not x.exception()
        taken.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert first.done() and not first.exception() and dm.slots_held == 1
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2, 3)]
        assert sum(t.done() for t in later) == 1
        assert _within(dm), (dm.queue_length, dm.places_held, dm.queue_max)
        assert dm.queue_length + dm.requeued == 2
        await _end(dm, first, x, *later)
        assert (dm.running, dm.queue_length, dm.requeued, dm.places_held, dm.slots_held) == (0, 0, 0, 0, 0)

    asyncio.run(main())


# The storm of requests of several jobs through re-plans and failovers (its seeds for jffc, vtc, edf and sed) is
# test_hunt_queue_bound_whole.py's storm, one harness for both.


def test_sed_queuing_a_first_job_beside_a_free_slot_admits_a_request_that_fits():
    """SED, max_queue 1, a fast chain busy and a slow one free: n = 2 fits (one free slot, one place). SED queues the
    first job at the fast chain beside the free slot; the places were counted as if it started there, so the request
    was refused "queue full" with the queue empty. Now the free slot is held for the later choice and the queue
    holds the first: within the bound."""
    from petals_chain.orchestrator.dispatch import RequestPlaces

    async def main():
        dm = DispatchManager(max_queue=1, policy="sed")
        dm.set_chains(_chains(1, 1))
        busy = await _submit(dm, DispatchJob("busy"))
        assert busy.done() and busy.result().index == 0
        tickets = RequestPlaces().expect(2)
        first = await _submit(dm, DispatchJob("r0", siblings=1), tickets[0])
        assert not first.done(), first.exception()
        assert (dm.queue_length, dm.places_held, dm.slots_held) == (1, 0, 1) and _within(dm)
        assert _refused(await _submit(dm, DispatchJob("x")))
        later = await _submit(dm, DispatchJob("r1", checked=True), tickets[1])
        assert later.done() and later.result().index == 1 and _within(dm)
        dm.release(busy.result())
        await asyncio.sleep(0)
        assert first.done() and first.result().index == 0
        await _end(dm, first, later)
        assert (dm.running, dm.queue_length, dm.places_held, dm.slots_held) == (0, 0, 0, 0)

    asyncio.run(main())


def test_a_request_past_any_clients_share_of_an_idle_queue_is_told_it_never_fits():
    """vtc with clients told apart, max_queue 4, one idle slot: n = 5 needs 4 places, and a client may hold at most
    3 of 4 (the last kept for others) even when nothing else waits. It was refused "retry later" (client_queue_share)
    on an idle swarm, to be refused again each time; now QueueNeverFits (exceeds_capacity: ask for fewer). n = 4
    (3 places) is admitted."""
    from petals_chain.orchestrator.dispatch import QueueNeverFits, QueueShareFull

    async def main():
        shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(),
                              keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=4)
        dm.set_chains(_chains(1))
        big = await _submit(dm, DispatchJob("big", client="A", siblings=4), RequestPlaces().expect(5)[0])
        assert _refused(big) and type(big.exception()) is QueueNeverFits, repr(big.exception())
        assert big.exception().code == "exceeds_capacity" and "ask for fewer" in str(big.exception())
        assert not isinstance(big.exception(), QueueShareFull)
        assert (dm.queue_length, dm.places_held, dm.running, dm.refused, dm.share_refused) == (0, 0, 0, 1, 0)
        tickets = RequestPlaces().expect(4)
        ok = await _submit(dm, DispatchJob("ok", client="A", siblings=3), tickets[0])
        assert ok.done() and not ok.exception() and dm.places_held == 3
        for t in tickets[1:]:
            t.drop()
        await _end(dm, ok)

    asyncio.run(main())
