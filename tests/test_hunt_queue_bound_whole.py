"""A request of several jobs (``n`` > 1, several prompts) under ``--max-queue`` and deadlines, admitted or refused as a
whole: admitted on free slots with fewer queue places than later jobs, it holds those free slots, so new jobs cannot
take them and push its later jobs past the bound; its first job's deadline prediction is its last job's, and once it
is refused (or admitted) its other jobs follow, refused without touching the queue or the fairness policy."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry
from test_queue_bound_siblings import _submit

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import (ADMISSION, PLACE, Admission, DeadlineUnreachable, DispatchJob,
                                                DispatchManager, QueueFull, RequestPlaces)
from petals_chain.orchestrator.fairness import ClientShares


def _chains(*capacities: int, names: str = "") -> list[Chain]:
    """One-server chains of these slots: servers s0, s1... (or s + each letter of ``names``: the chains a re-plan
    keeps are those of the same names)."""
    return [Chain(servers=(f"s{names[k]}" if names else f"s{k}",), blocks=(4,), service_time=1.0 + k, capacity=c,
                  spans=((0, 4),)) for k, c in enumerate(capacities)]


def _refused(task: asyncio.Task, kind: type = QueueFull) -> bool:
    return task.done() and isinstance(task.exception(), kind)


async def _end(dm: DispatchManager, *tasks: asyncio.Task) -> None:
    """Cancel the waiting ``tasks`` and give back the leases of those started."""
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            dm.release(t.result())
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_free_slots_held_for_later_jobs_keep_the_bound():
    """max_queue 1, a chain of 2 slots: n = 3 starts, holds the queue's place and the free slot for its two later
    choices. Before, a new job took that slot and the later choices queued 2 of 1 (queue_max 2); now the new job is
    refused, one later choice starts on the held slot, the other queues in the held place."""
    async def main():
        dm = DispatchManager(max_queue=1)
        dm.set_chains(_chains(2))
        tickets = RequestPlaces().expect(3)
        first = await _submit(dm, DispatchJob("r0", siblings=2), tickets[0])
        assert first.done() and not first.exception() and dm.places_held == 1
        x = await _submit(dm, DispatchJob("x"))
        assert _refused(x) and dm.running == 1 and dm.slots_held == 1
        later = [await _submit(dm, DispatchJob(f"r{i}", checked=True), tickets[i]) for i in (1, 2)]
        assert later[0].done() and not later[0].exception() and not later[1].done()
        assert dm.queue_length == 1 and dm.queue_max == 1 and dm.places_held == 0 and dm.slots_held == 0
        await _end(dm, first, *later)
        assert dm.running == 0 and dm.queue_length == 0

    asyncio.run(main())


def test_a_held_slot_given_back_starts_the_next_waiting_job_and_survives_a_replan():
    """A held slot whose job will not come (its request ended, or a choice had nothing to generate) takes the next
    waiting job at once (else that job waited beside a free slot until some other job ended); it goes back before
    the request's queue places do (a free slot idle is capacity lost); a re-plan keeps it held."""
    async def main():
        dm = DispatchManager(max_queue=2)
        dm.set_chains(_chains(2))
        tickets = RequestPlaces().expect(4)  # n = 4: one slot left, the queue has 2 places: the slot is held
        first = await _submit(dm, DispatchJob("r0", siblings=3), tickets[0])
        assert dm.places_held == 2
        dm.set_chains(_chains(2))  # the same chain again: still held
        y = await _submit(dm, DispatchJob("y", requeue=True))  # a job back after a failover: waits in the lane
        assert not y.done() and dm.requeued == 1 and dm.slots_held == 1 and dm.active(0) == 1
        tickets[3].drop()
        await asyncio.sleep(0)
        assert y.done() and not y.exception() and dm.slots_held == 0 and dm.places_held == 2 and dm.active(0) == 2
        for t in tickets[1:3]:
            t.drop()
        assert dm.places_held == 0
        await _end(dm, first, y)
        assert dm.running == 0

    asyncio.run(main())


def test_a_later_job_on_a_held_slot_is_charged_by_the_fairness_policy():
    """vtc, 4 chains of one slot, max_queue 4: client A's n = 5 and client B's four requests. Before, B took the
    slots A's choices needed and the queue reached 5 of 4 when they came; now it stays within 4, B's request past
    what is left is refused by the bound (not by its share), and A's choice started on a held slot is charged."""
    async def main():
        shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(),
                              keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=4)
        dm.set_chains([Chain(servers=(s,), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))
                       for s in "abcd"])
        tickets = RequestPlaces().expect(5)
        a0 = await _submit(dm, DispatchJob("a0", client="A", siblings=4, input_tokens=10), tickets[0])
        held = dm.places_held_of("A")
        assert a0.done() and 0 < held < 4
        bs = [await _submit(dm, DispatchJob(f"b{i}", client="B", input_tokens=10)) for i in range(4)]
        refused = [t for t in bs if t.done() and t.exception() is not None]
        assert len(refused) == 1 and type(refused[0].exception()) is QueueFull and dm.slots_held == 4 - held
        later = [await _submit(dm, DispatchJob(f"a{i}", client="A", checked=True, input_tokens=10), tickets[i])
                 for i in range(1, 5)]
        assert dm.queue_max <= 4 and dm.queue_length == 4 and dm.running == 4
        started = [t.result().job for t in later if t.done()]
        assert len(started) == 1 and started[0].fair.admitted_on is not None  # admitted by the policy, charged
        await _end(dm, a0, *bs, *later)

    asyncio.run(main())


def test_a_multi_prompt_request_with_a_deadline_is_refused_or_admitted_as_a_whole():
    """Two prompts, one slot busy, deadline 3.5 s with 1 s per job: the first prompt's job alone fits (3 s), the
    second's does not (4 s). Before, the first was admitted and the second refused: a 429 part-way. Now the first's
    prediction is the last job's: both refused at once, counted once; at 4.5 s both are admitted."""
    async def main():
        dm = DispatchManager(max_queue=10, schedule="edf", steps_per_job=lambda: 1.0)
        dm.set_chains(_chains(1))
        busy = await _submit(dm, DispatchJob("busy"))
        for ms, admitted in ((3500, False), (4500, True)):
            places = RequestPlaces()
            tickets = places.expect(1) + places.expect(1)
            dl = RequestDeadline.from_ms("c", ms, None)
            p0 = await _submit(dm, DispatchJob("p0", deadline=dl, output_tokens=1), tickets[0])
            p1 = await _submit(dm, DispatchJob("p1", deadline=dl, output_tokens=1), tickets[1])
            if admitted:
                assert not p0.done() and not p1.done() and dm.queue_length == 2
            else:
                assert _refused(p0, DeadlineUnreachable) and _refused(p1, DeadlineUnreachable)
                assert dm.deadline_refused == 1 and dm.queue_length == 0
            await _end(dm, p0, p1)
        await _end(dm, busy)

    asyncio.run(main())


def test_the_other_prompts_of_a_refused_request_leave_the_fairness_policy_alone():
    """vtc, one busy slot, max_queue 1: a request of two prompts from client C is refused at its first job. Its
    second prompt's job came after the first's ticket was dropped (generation drops it as the refusal ends the
    task): before, it was a request of one job that fit, queued (VTC lifted C's counter to the busy client's) and
    cancelled; now it is refused with its request, the policy untouched and the refusal counted once."""
    async def main():
        shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(),
                              keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, max_queue=1)
        dm.set_chains(_chains(1))
        busy = await _submit(dm, DispatchJob("busy", client="B", input_tokens=40))
        snapshot = shares.policy.snapshot()
        places = RequestPlaces()
        tickets = places.expect(1) + places.expect(1)
        p0 = await _submit(dm, DispatchJob("p0", client="C", input_tokens=10), tickets[0])
        assert _refused(p0)
        tickets[0].drop()
        p1 = await _submit(dm, DispatchJob("p1", client="C", input_tokens=10), tickets[1])
        assert _refused(p1) and dm.queue_length == 0 and dm.refused == 1
        assert shares.policy.snapshot() == snapshot
        await _end(dm, busy)

    asyncio.run(main())


def test_through_the_api_a_new_request_cannot_take_the_slot_of_a_later_choice(tiny_model_factory, monkeypatch):
    """Through the API: ``n`` = 3 on a chain of 2 slots with ``--max-queue 1``. While the first prefill ran, a new
    request took the free slot and the two later choices then queued 2 of 1 (``queue_max`` 2); now new requests get
    429 while the slot is held (``queue_slots_held`` 1 in /api/v1/swarm and /metrics) and the queue stays within 1."""
    from test_queue_bound_siblings import _Session

    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64,
                                           port=0, max_queue=1))
    orch.load_model()
    hidden = int(orch.config.hidden_size)
    gate, prefilling = asyncio.Event(), asyncio.Event()

    async def forward(self, x, position, budget, tokens):
        prefilling.set()
        await gate.wait()  # every prefill lasts until the test lets them go
        return torch.zeros(1, len(tokens) - position, hidden, dtype=orch.head.dtype)

    monkeypatch.setattr(failover, "ChainSession", _Session)
    monkeypatch.setattr(failover.ChainHolder, "_forward", forward)

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        dm = orch.dispatch
        dm.set_chains(_chains(2))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         timeout=60) as c:
                body = {"model": orch.model_id, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
                request = asyncio.ensure_future(c.post("/v1/completions", json={**body, "prompt": "p", "n": 3}))
                await prefilling.wait()
                news = [asyncio.ensure_future(c.post("/v1/completions", json={**body, "prompt": f"x{i}"}))
                        for i in range(2)]
                await asyncio.wait(news, timeout=30)  # refused at once (a started one would wait for the gate)
                decided = sum(t.done() for t in news)
                swarm = (await c.get("/api/v1/swarm")).json()
                metrics = (await c.get("/metrics")).text
                gate.set()
                r = await request
                statuses = [(await t).status_code for t in news]
                assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
                assert dm.queue_max <= 1, (dm.queue_max, statuses)
                assert decided == 2 and statuses == [429, 429], statuses
                assert swarm["queue_slots_held"] == 1 and "petals_chain_queue_slots_held 1.0" in metrics
                assert dm.slots_held == 0 and dm.places_held == 0 and dm.queue_length == 0 and dm.running == 0
                # more completions than the slots and the queue hold together: streamed or not, the client is told to
                # ask for fewer (a streamed refusal said "its queue is full (1 waiting); retry later")
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "prompt": "p", "n": 4, "stream": stream})
                    assert r.status_code == 429 and "ask for fewer" in r.json()["error"]["message"], (stream, r.text)
        finally:
            orch.batcher.close()

    asyncio.run(main())


async def _turns(n: int) -> None:
    """Let ``n`` loop iterations pass (the storm's interleaving depends on its seed alone, not on the clock)."""
    for _ in range(n):
        await asyncio.sleep(0)


@dataclass(frozen=True)
class _Storm:
    """A storm of ``requests`` requests of ``jobs`` jobs each (one drawn per request), arriving over ``arrive_turns``
    loop iterations; later jobs come after a "prefill", ``drop_p`` of them never (dropped), one request in ten is
    cancelled. A planner picks one of ``plans`` every ``replan_turns`` iterations at most (none with one plan); a
    started job fails over (gives its lease back and comes back admitted) as often as drawn from ``failovers``."""

    seed: int
    max_queue: int
    requests: int
    arrive_turns: int
    jobs: tuple[int, ...]
    drop_p: float
    plans: tuple[tuple[Chain, ...], ...]
    replan_turns: int = 0
    failovers: tuple[int, ...] = ()


def _whole(replan: bool) -> _Storm:
    """max_queue 3, 200 requests of 1 to 4 jobs: it went 4 of 3 in each discipline before requests were admitted or
    refused as a whole; with ``replan``, re-plans that change the chains' slots."""
    plans = [_chains(2, 1), _chains(1, 2), _chains(2, 2), _chains(2)] if replan else [_chains(2, 1)]
    return _Storm(seed=2, max_queue=3, requests=200, arrive_turns=300, jobs=(1, 1, 2, 3, 4), drop_p=0.2,
                  plans=tuple(map(tuple, plans)), replan_turns=15 if replan else 0)


def _replans_and_failovers(seed: int) -> _Storm:
    """max_queue 2, 250 requests of 1 to 5 jobs, re-plans that drop and bring back chains (held slots among them) and
    failovers (taking a held slot of its request if it finds no other): the seeds went past the bound before, when a
    dropped held slot or a failed-over job taking one let a later job queue past it."""
    plans = [_chains(3, 2, names="ab"), _chains(2, names="b"), _chains(1, 3, names="ca"), _chains(3, names="c")]
    return _Storm(seed=seed, max_queue=2, requests=250, arrive_turns=400, jobs=(1, 2, 4, 5), drop_p=0.15,
                  plans=tuple(map(tuple, plans)), replan_turns=20, failovers=(0, 0, 1, 2))


@pytest.mark.parametrize("kind,storm", [
    *(pytest.param(kind, _whole(replan), id=f"{kind}-{'replans' if replan else 'one-plan'}")
      for replan in (False, True) for kind in ("jffc", "vtc", "edf")),
    # seeds whose storm went past the bound before (each discipline interleaves differently)
    *(pytest.param(kind, _replans_and_failovers(seed), id=f"{kind}-replans-failovers-{seed}")
      for kind, seed in (("jffc", 6), ("vtc", 11), ("edf", 6), ("sed", 14))),
])
def test_requests_of_several_jobs_keep_the_bound_in_a_storm(kind: str, storm: _Storm):
    """A storm of requests of several jobs (:class:`_Storm`), interleaved by the seed alone. At every loop iteration
    the queue plus the places held stay within max_queue; with one plan, also the dispatcher's busy slots are its
    jobs plus the held slots, no job queues beside a free slot and none waits in the re-queue lane (uncounted: a later
    job sent there had no place held). At the end nothing waits, runs or is held."""
    rng = random.Random(storm.seed)
    max_queue = storm.max_queue

    async def main():
        shares = ClientShares(FairPolicy("vtc", FairnessConfig(quantum=50.0)), registry=CollectorRegistry(),
                              keyed=True) if kind == "vtc" else None
        dm = DispatchManager(max_queue=max_queue, shares=shares, schedule="edf" if kind == "edf" else "fcfs",
                             policy="sed" if kind == "sed" else "jffc")
        plans = [list(plan) for plan in storm.plans]
        dm.set_chains(plans[0])
        bad: list[str] = []
        stop = asyncio.Event()

        def check() -> None:
            if dm.queue_length + dm.places_held > max_queue or dm.queue_max > max_queue:
                bad.append(f"queue {dm.queue_length} held {dm.places_held} max {dm.queue_max}")
            if storm.replan_turns:  # a re-plan leaves jobs running on chains it dropped, and slots busy with them
                return
            if dm.requeued and not storm.failovers:  # only a failed-over job, or one a re-plan took the chain of
                bad.append(f"{dm.requeued} jobs in the re-queue lane, out of the bound's count")
            occupancy = dm.dispatcher.occupancy
            if sum(occupancy) != sum(dm.active(k) for k in range(len(dm.chains))) + dm.slots_held:
                bad.append(f"the dispatcher counts {sum(occupancy)} slots busy, {dm.running} running + "
                           f"{dm.slots_held} held")
            if dm.queue_length and any(occupancy[k] < ch.capacity for k, ch in enumerate(dm.chains)):
                bad.append("a job queued beside a free slot")

        async def watchdog() -> None:
            while not stop.is_set():
                check()
                await asyncio.sleep(0)

        async def planner() -> None:
            while not stop.is_set():
                await _turns(rng.randrange(storm.replan_turns))
                dm.set_chains(rng.choice(plans))

        async def one(name: str, ticket, checked: bool) -> None:
            PLACE.set(ticket)
            try:
                lease = await dm.acquire(DispatchJob(name, client=rng.choice("AB"), checked=checked))
            except QueueFull:
                return
            finally:
                ticket.drop()  # as generation does when the job ends or never came
            try:
                for _ in range(rng.choice(storm.failovers) if storm.failovers else 0):  # back admitted: the lane
                    await _turns(rng.randrange(4))
                    dm.release(lease)
                    lease = await dm.acquire(DispatchJob(name, client="A", requeue=True))
                await _turns(rng.randrange(6))
            finally:
                dm.release(lease)

        async def request(i: int) -> None:
            await _turns(rng.randrange(storm.arrive_turns))
            adm = Admission()
            ADMISSION.set(adm)
            tickets = adm.places.expect(rng.choice(storm.jobs))
            tasks = [asyncio.ensure_future(one(f"{i}", tickets[0], False))]
            await asyncio.sleep(0)
            if adm.state != "refused":
                await _turns(rng.randrange(5))  # its prefill
                for j, t in enumerate(tickets[1:]):
                    if rng.random() < storm.drop_p:
                        t.drop()
                    else:
                        tasks.append(asyncio.ensure_future(one(f"{i}.{j}", t, True)))
                if rng.random() < 0.1:  # its client went away
                    await _turns(rng.randrange(3))
                    for t in tasks:
                        t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tickets:
                t.drop()

        tasks = [asyncio.ensure_future(watchdog())]
        if storm.replan_turns:
            tasks.append(asyncio.ensure_future(planner()))
        await asyncio.gather(*(request(i) for i in range(storm.requests)))
        stop.set()
        await asyncio.gather(*tasks)
        assert not bad, (len(bad), bad[:3])
        assert (dm.queue_length, dm.requeued, dm.places_held, dm.slots_held, dm.running) == (0, 0, 0, 0, 0)

    asyncio.run(main())


def test_a_request_with_its_first_token_is_not_dropped_at_its_ttft_deadline():
    """A multi-prompt request shares one deadline: once a prompt's job gave the first token, a later prompt's job
    still waiting for a chain at ``ttft_deadline_ms`` has missed nothing yet, so it waits on to ``deadline_ms``
    (it was dropped with a 504 for the whole request)."""
    from petals_chain.orchestrator.deadlines import RequestDeadline

    dl = RequestDeadline.from_ms("c", deadline_ms=5000, ttft_deadline_ms=500, arrival=100.0)
    assert dl.drop_at == dl.ttft_deadline == 100.5
    dl.first_token(now=100.2)
    assert dl.drop_at == dl.deadline == 105.0
