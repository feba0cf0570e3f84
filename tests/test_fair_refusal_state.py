"""A request refused at arrival (queue full, the client's share of the queue) leaves the fairness policy as if it had
never arrived: it neither advances d-vtc's per-client round robin nor rr-lpm's, lifts a VTC counter, enters a client
in DLPM's deficits (a refill would then bank it a quantum) nor refills D2LPM's worker credit. And a priority pause
decided for a chain a re-plan then drops is taken back, leaving no mark that serves nobody."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager, QueueFull, QueueShareFull
from petals_chain.orchestrator.fairness import ClientShares

NEWCOMERS = [("c1", "C"), ("a3", "A"), ("b2", "B"), ("c2", "C"), ("a4", "A")]


def _state(policy: FairPolicy) -> tuple:
    return (policy.snapshot(), dict(policy._rr_client), policy._rr, dict(policy.worker_credit))


async def _run(policy: str, keyed: bool, refusals: int) -> list:
    """Two chains of one slot, both busy and the queue at its bound (``keyed``: at client A's share); ``refusals``
    arrivals of A (and, at the bound, of a new client C) refused; then every job served, newcomers arriving as slots
    free. Returns what the policy holds after the refusals and where and in which order each later job went."""
    shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=50.0, worker_quantum=30.0)),
                          registry=CollectorRegistry(), keyed=keyed)
    dm = DispatchManager(policy="jffc", shares=shares, max_queue=4 if keyed else 2)
    dm.set_chains([Chain(servers=(s,), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),)) for s in "ab"])
    tasks: dict[str, asyncio.Task] = {}
    jobs: dict[str, DispatchJob] = {}

    async def submit(name: str, client: str) -> asyncio.Task:
        jobs[name] = DispatchJob(name, client=client, input_tokens=10 + 3 * int(name[-1]), expected_output=4)
        tasks[name] = task = asyncio.ensure_future(dm.acquire(jobs[name]))
        await asyncio.sleep(0)
        return task

    for name, client in [("a0", "A"), ("b0", "B"), ("a1", "A"), ("b1", "B")] + ([("a2", "A")] if keyed else []):
        await submit(name, client)
    assert dm.running == 2 and dm.queue_length == (3 if keyed else 2)
    for i in range(refusals):
        for client in ("A",) if keyed else ("A", "C"):
            task = await submit(f"r{client}{i}", client)
            assert task.done() and isinstance(task.exception(), QueueShareFull if keyed else QueueFull)
            assert keyed or not isinstance(task.exception(), QueueShareFull)
    trace: list = [_state(shares.policy)]
    refused = {n for n, t in tasks.items() if t.done() and t.exception() is not None}
    seen: set[str] = set(refused)
    leases = []
    newcomers = list(NEWCOMERS)

    def note_started() -> None:
        for name in sorted(n for n, t in tasks.items() if t.done() and n not in seen):
            seen.add(name)
            lease = tasks[name].result()
            leases.append(lease)
            trace.append(("started", name, lease.chain.servers[0]))

    note_started()
    while leases:
        dm.release(leases.pop(0))
        await asyncio.sleep(0)
        note_started()
        if newcomers:
            name, client = newcomers.pop(0)
            await submit(name, client)
            trace.append(("bound", name, jobs[name].fair.worker if jobs[name].fair is not None else None))
            note_started()
    assert not newcomers and all(t.done() for t in tasks.values())
    trace.append(_state(shares.policy))
    return trace


# by the share rule only a client with requests waiting is refused: VTC and DLPM change nothing for such a client's
# arrival (its counter is not lifted, its deficit exists), d-vtc's round robin and D2LPM's credit refill do
@pytest.mark.parametrize("policy,keyed", [(p, False) for p in ("vtc", "dlpm", "d2lpm", "d-vtc", "rr-lpm")]
                         + [("d2lpm", True), ("d-vtc", True)])
def test_refused_arrivals_leave_the_policy_as_if_they_never_came(policy, keyed):
    """Before: 3 refused arrivals of A and of a new client C lifted C's VTC counter to A's (10), entered C in DLPM's
    deficits, advanced d-vtc's round robin of A from 2 to 5 (A's next request bound to the other chain) and rr-lpm's
    from 4 to 10; the requests served afterwards went elsewhere or in another order."""
    without = asyncio.run(_run(policy, keyed, 0))
    with_refusals = asyncio.run(_run(policy, keyed, 3))
    assert with_refusals == without


# ---------------------------------------------------------------- a decision a re-plan overtakes


def test_a_priority_pause_on_a_chain_a_replan_dropped_is_taken_back():
    """``--schedule db``: a running job marked to pause for a better waiting one kept its mark when a re-plan dropped
    its chain: it paused at its next step for nobody (the waiting job had re-arrived on the new plan, and the pause
    freed no slot of it), counted as a priority preemption. Now the mark is taken back, as FLEX's promises are."""
    def job(dm: DispatchManager, i: int) -> DispatchJob:
        return DispatchJob(f"j{i}", sched=dm.new_priority_job(f"j{i}", "m"))

    def chain(server: str) -> Chain:
        return Chain(servers=(server,), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))

    async def main():
        dm = DispatchManager(schedule="db")  # L̂ = 1 s (prior): Q0 = 1 s
        dm.set_chains([chain("a")])
        long = await dm.acquire(job(dm, 0))
        long.keeps_kv = True  # its servers keep a paused job's KV: a job that may be paused for priority
        queued = asyncio.ensure_future(dm.acquire(job(dm, 1)))
        await asyncio.sleep(0)
        dm.charge(long, 0.6)
        dm.charge(long, 0.6)  # budget used up: level 1, O = 2.0 > the waiting job's 1.0
        assert long.preempt and dm.priority_preemptions == 1
        dm.set_chains([chain("b")])  # chain a dropped: the waiting job starts on b
        await asyncio.sleep(0)
        assert queued.done() and queued.result().chain.servers == ("b",)
        assert not long.preempt and dm.priority_preemptions == 0
        dm.release(long)
        dm.release(queued.result())

    asyncio.run(main())
