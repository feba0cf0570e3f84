"""The queue bound (``--max-queue``) with requests of several jobs: the later choices of ``n`` > 1 (they come after the
first choice's prefill and are never refused) and the other prompts of a multi-prompt request. Their places are
counted when the request's first job is admitted and held until each later job arrives, so new arrivals cannot
take them meanwhile and ``queue_length`` does not pass the bound (one admitted on free slots with fewer places than
later jobs can pass it if others take those slots first: see the dispatch module)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, QueueFull


def _one_slot() -> list[Chain]:
    return [Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))]


async def _submit(dm: DispatchManager, job: DispatchJob, ticket=None) -> asyncio.Task:
    """``dm.acquire(job)`` in a task of its own (as each choice's task), with ``ticket`` as its place; returned once
    the dispatcher has decided (started, queued or refused)."""
    async def run():
        if ticket is not None:
            from petals_chain.orchestrator.dispatch import PLACE

            PLACE.set(ticket)
        return await dm.acquire(job)

    task = asyncio.ensure_future(run())
    await asyncio.sleep(0)
    return task


def _refused(task: asyncio.Task) -> bool:
    return task.done() and isinstance(task.exception(), QueueFull)


def test_the_places_of_later_choices_are_held_against_new_arrivals():
    """n = 3 on a free slot with max_queue 2: its two later choices' places were counted, not held; two new requests
    took them before the prefill ended and the choices then took the queue to 4 of 2."""
    from petals_chain.orchestrator.dispatch import RequestPlaces

    async def main():
        dm = DispatchManager(max_queue=2)
        dm.set_chains(_one_slot())
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert first.done() and dm.places_held == 2  # started; a place held for each later choice
        others = [await _submit(dm, DispatchJob(f"x{i}")) for i in range(2)]
        assert all(_refused(t) for t in others) and dm.queue_length == 0
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2)]
        assert not any(t.done() for t in later) and dm.queue_length == 2 and dm.places_held == 0
        assert dm.queue_max <= dm.max_queue
        dm.release(first.result())
        await asyncio.sleep(0)
        assert later[0].done() and not later[1].done()  # in the queue's order
        later[1].cancel()
        await asyncio.gather(later[1], return_exceptions=True)

    asyncio.run(main())


def test_a_request_that_ends_early_gives_its_held_places_back():
    """Places held for later jobs that will never come (the request failed or was cancelled, or a choice had
    nothing to generate) go back at once, not when the jobs would have come."""
    from petals_chain.orchestrator.dispatch import RequestPlaces

    async def main():
        dm = DispatchManager(max_queue=2)
        dm.set_chains(_one_slot())
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert dm.places_held == 2
        tickets[2].drop()
        assert dm.places_held == 1
        assert not _refused(await _submit(dm, DispatchJob("x0")))  # queued in the place given back
        assert _refused(await _submit(dm, DispatchJob("x1")))  # the last place is still held
        tickets[1].drop()
        x2 = await _submit(dm, DispatchJob("x2"))
        assert not _refused(x2) and dm.queue_length == 2 and dm.places_held == 0
        for t in [first, x2]:
            t.cancel()
        await asyncio.gather(first, x2, return_exceptions=True)

    asyncio.run(main())


def test_free_slots_start_what_the_queue_cannot_hold_and_a_request_that_never_fits_is_told_so():
    """max_queue 1: n = 3 on an idle chain of 4 slots is admitted (its later choices find free slots; it holds the
    one place the queue has, so a new request must not take it meanwhile), where holding a place for every later
    choice refused it on an idle swarm (review); n = 3 on a chain of one slot never fits (one slot and one place
    for three completions): refused at once, and the message says so rather than "retry later"."""
    from petals_chain.orchestrator.dispatch import RequestPlaces

    async def main():
        dm = DispatchManager(max_queue=1)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=4, spans=((0, 4),))])
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert first.done() and not first.exception() and dm.places_held == 1
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2)]
        assert all(t.done() and not t.exception() for t in later) and dm.places_held == 0 and dm.active(0) == 3
        for t in [first, *later]:
            dm.release(t.result())

        dm = DispatchManager(max_queue=1)
        dm.set_chains(_one_slot())
        first = await _submit(dm, DispatchJob("r0", siblings=2), RequestPlaces().expect(3)[0])
        assert _refused(first) and "ask for fewer" in str(first.exception()), first.exception()
        assert "more than the chains' 1 slots and the queue's bound" in str(first.exception())
        assert dm.places_held == 0 and dm.queue_length == 0 and dm.active(0) == 0

    asyncio.run(main())


def test_the_prompts_of_one_request_are_admitted_together_and_keep_the_discipline_order():
    """A request of two prompts (each its own first job, submitted apart) needs its places when its first job comes;
    its other prompt then takes a held place and queues by the discipline (EDF here), not ahead of an earlier
    deadline."""
    from petals_chain.orchestrator.deadlines import RequestDeadline
    from petals_chain.orchestrator.dispatch import RequestPlaces

    async def main():
        dm = DispatchManager(max_queue=5, schedule="edf", steps_per_job=lambda: 1.0)
        dm.set_chains(_one_slot())
        running = await _submit(dm, DispatchJob("busy"))
        urgent = await _submit(dm, DispatchJob("urgent", deadline=RequestDeadline.from_ms("u", 600_000, None)))
        places = RequestPlaces()
        tickets = places.expect(2) + places.expect(2)  # two prompts, n = 2
        refused = await _submit(dm, DispatchJob("too-big", siblings=1), RequestPlaces().expect(6)[0])
        assert _refused(refused) and "6 completions" in str(refused.exception())  # 1 waiting + 6 > 5
        p0 = await _submit(dm, DispatchJob("p0", siblings=1), tickets[0])
        p1 = await _submit(dm, DispatchJob("p1", siblings=1), tickets[2])  # the other prompt: admitted with it
        assert not p1.done() and dm.queue_length == 3 and dm.places_held == 2  # 5: the bound
        assert _refused(await _submit(dm, DispatchJob("x")))
        dm.release(running.result())
        await asyncio.sleep(0)
        assert urgent.done() and not p0.done()  # the deadline job first, whatever came later
        for t in (urgent, p0, p1):
            t.cancel()
        await asyncio.gather(urgent, p0, p1, return_exceptions=True)
        for t in tickets:
            t.drop()
        assert dm.places_held == 0

    asyncio.run(main())


# ---------------------------------------------------------------- through the HTTP API


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


class _Session:
    """A chain session that opens at once (the relay is faked: these tests are about admission)."""

    def __init__(self, client, hops, session_id, max_length, **kw):
        self.hops, self.peers_used, self.max_length = list(hops), {h[0] for h in hops}, max_length
        self.wait_s, self.silent_wait_max_s, self.cached_tokens, self.prefix_cache = 0.0, 0.0, 0, False

    async def open(self, **kw):
        pass

    async def close(self, **kw):
        pass


@pytest.mark.parametrize("prompts,n,max_queue", [(1, 3, 2), (2, 2, 3)])
def test_a_request_of_several_jobs_keeps_the_bound_through_the_api(model_path, monkeypatch, prompts, n, max_queue):
    """Through the API (its middleware's Admission, generation's choices): while the first prefill runs, new requests
    are refused because the request's later jobs hold their places, and the queue never passes ``--max-queue``
    (before: 4 of 2 for n = 3, the new requests admitted in the places counted for the later choices)."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    orch = Orchestrator(OrchestratorConfig(model=str(model_path), max_length=64, port=0, max_queue=max_queue))
    orch.load_model()
    hidden = int(orch.config.hidden_size)
    gate, prefilling = asyncio.Event(), asyncio.Event()

    async def forward(self, x, position, budget, tokens):
        prefilling.set()
        await gate.wait()  # the first prefill lasts until the test lets it go
        return torch.zeros(1, len(tokens) - position, hidden, dtype=orch.head.dtype)

    monkeypatch.setattr(failover, "ChainSession", _Session)
    monkeypatch.setattr(failover.ChainHolder, "_forward", forward)

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=1, spans=((0, 2),))])
        dm = orch.dispatch
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         timeout=60) as c:
                body = {"model": orch.model_id, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
                request = asyncio.ensure_future(c.post("/v1/completions", json={
                    **body, "prompt": [f"p{i}" for i in range(prompts)] if prompts > 1 else "p", "n": n}))
                await prefilling.wait()
                news = [asyncio.ensure_future(c.post("/v1/completions", json={**body, "prompt": f"x{i}"}))
                        for i in range(2)]
                await asyncio.wait(news, timeout=30)  # refused at once (queued ones would wait for the gate)
                decided = sum(t.done() for t in news)
                swarm = (await c.get("/api/v1/swarm")).json()  # the held places, as an operator sees them
                held = swarm["queue_places_held"]  # (a later prompt's first job may be queued already)
                assert held > 0 and held + swarm["queue_length"] == prompts * n - 1, swarm
                assert f"petals_chain_queue_places_held {float(held)}" in (await c.get("/metrics")).text
                gate.set()
                r = await request
                statuses = [(await t).status_code for t in news]
                assert r.status_code == 200 and len(r.json()["choices"]) == prompts * n, r.text
                assert dm.queue_max <= max_queue, (dm.queue_max, statuses)
                assert decided == 2 and statuses == [429, 429], statuses
                assert dm.places_held == 0 and dm.queue_length == 0
        finally:
            orch.batcher.close()

    asyncio.run(main())


def test_a_request_queued_as_chains_come_waits_on_in_its_place(monkeypatch):
    """A new request arrives while no chain exists (it waits --no-chain-wait-s, not the queue time); chains come and
    it is queued; at the end of that wait it was taken out and queued again as a new job: behind a request that came
    after it (and, its request's places held, past --max-queue: review). Now it waits on in its place."""
    from test_fairness import _holder

    async def main():
        dm = DispatchManager(max_queue=2)
        busy = asyncio.ensure_future(dm.acquire(DispatchJob("busy")))
        await asyncio.sleep(0)
        r = asyncio.ensure_future(_holder(dm, None, monkeypatch, no_chain_wait_s=0.1).feed([1, 2, 3]))
        await asyncio.sleep(0.02)
        dm.set_chains(_one_slot())  # busy takes the slot, r is queued
        await asyncio.sleep(0.02)
        z = asyncio.ensure_future(dm.acquire(DispatchJob("z")))  # a later request, queued behind r
        await asyncio.sleep(0.2)  # past r's no-chain wait
        assert dm.queue_length == 2 and dm.queue_max <= 2 and not r.done()
        dm.release(busy.result())
        await asyncio.sleep(0.02)
        assert not z.done() and dm.running == 1  # the slot went to r (its chain's open hangs), not to z
        for t in (r, z):
            t.cancel()
        await asyncio.gather(r, z, return_exceptions=True)
        assert dm.running == 0 and dm.queue_length == 0

    asyncio.run(main())


def test_the_places_a_request_holds_are_within_its_clients_share():
    """A client-fair queue (vtc, keyed, max_queue 4, 4 free slots): client A's n = 5 started on a free slot and held
    every place the queue had, so client B, with nothing waiting, was refused its fourth request by its share
    (review). Now A holds no more than its share of places (and free slots for the rest of its jobs): B's first
    starts, two queue, and the fourth is refused by the bound itself (5 + 4 jobs for 4 slots and 4 places), not
    by B's share."""
    from prometheus_client import CollectorRegistry

    from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
    from petals_chain.orchestrator.dispatch import RequestPlaces
    from petals_chain.orchestrator.fairness import ClientShares

    async def main():
        shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(), keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=4)
        dm.set_chains([Chain(servers=(s,), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),)) for s in "abcd"])
        tickets = RequestPlaces().expect(5)
        a0 = await _submit(dm, DispatchJob("a0", client="A", siblings=4), tickets[0])
        assert a0.done() and not a0.exception() and 0 < dm.places_held_of("A") < 4
        bs = [await _submit(dm, DispatchJob(f"b{i}", client="B")) for i in range(4)]
        assert [type(t.exception()) if _refused(t) else None for t in bs] == [None, None, None, QueueFull]
        tasks = [a0, *bs]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
