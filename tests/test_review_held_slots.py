"""Free slots a request of several jobs holds for its later jobs (dispatch.RequestPlaces.slots): they serve the
request's own jobs, not only the later ones, and a later choice starts where it can fork the prompt's KV."""

from __future__ import annotations

import asyncio

from test_hunt_queue_bound_whole import _chains, _end, _submit

from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, RequestPlaces


def test_a_failed_over_first_job_takes_the_slot_its_request_holds():
    """max_queue 1, three chains of one slot: n = 3 starts on chain 0 and holds a slot for a later choice. Chain 0
    fails and the re-plan keeps chain 1 alone (the held slot moves there); the first job, back after the failover,
    waited in the re-queue lane beside its request's held slot, which its later choices (waiting for its prefill)
    never came to take: the request hung until the queue's timeout (600 s). Now it starts on that slot."""
    async def main():
        dm = DispatchManager(max_queue=1)
        chains = _chains(1, 1, 1)
        dm.set_chains(chains)
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert first.result().index == 0 and dm.places_held == 1 and dm.slots_held == 1
        dm.set_chains([chains[1]])
        dm.release(first.result())
        again = await _submit(dm, DispatchJob("r0", requeue=True, siblings=2), tickets[0])
        assert again.done() and not again.exception() and dm.requeued == 0 and dm.slots_held == 0
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2)]
        # queued, never refused, and within --max-queue: the choice whose held slot the first job took waits in
        # the re-queue lane (it once queued one past the bound)
        assert not any(t.done() for t in later) and dm.queue_length == 1 and dm.requeued == 1
        await _end(dm, again, *later)
        assert (dm.running, dm.queue_length, dm.slots_held, dm.places_held) == (0, 0, 0, 0)

    asyncio.run(main())


def test_a_later_choice_takes_the_held_slot_on_its_first_jobs_chain():
    """Two chains of two slots, max_queue 1: n = 4 starts on chain 0 and holds a slot there and one on chain 1. The
    second choice took the last slot held (chain 1), where it cannot fork the first choice's KV and prefills the
    prompt again; now it starts on chain 0."""
    async def main():
        dm = DispatchManager(max_queue=1)
        dm.set_chains(_chains(2, 2))
        tickets = RequestPlaces().expect(4)
        first = await _submit(dm, DispatchJob("r0", siblings=3), tickets[0])
        assert first.result().index == 0 and dm.slots_held == 2
        second = await _submit(dm, DispatchJob("r1", checked=True), tickets[1])
        assert second.result().index == 0
        tickets[3].drop()  # a choice that ends without a job: the held slot it had no place for goes back
        third = await _submit(dm, DispatchJob("r2", checked=True), tickets[2])
        assert third.done() and dm.places_held == 0 and dm.slots_held == 0 and dm.active(1) == 1
        await _end(dm, first, second, third)

    asyncio.run(main())
