"""Deadline admission under the per-chain client-fair policies (``--fairness d2lpm|d-vtc``) and DLPM's first quantum
(session 35). The deadline prediction counted the whole queue (FIFO) for d2lpm and d-vtc: a light client's deadline
request behind a heavy client's backlog was refused with 429 deadline_unreachable (predicted 37 s) though the policy
starts it within two slot turns; now it counts the jobs bound to the chain the request would be bound to, in that
chain's order (:meth:`ClientShares.ahead_bound`)."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairDispatcher, FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager, chain_key
from petals_chain.orchestrator.fairness import ClientShares


def _job(name: str, client: str, deadline_ms: float | None = None, **kw) -> DispatchJob:
    dl = RequestDeadline.from_ms(client, deadline_ms, None) if deadline_ms is not None else None
    kw = {"input_tokens": 20, "expected_output": 16, **kw}
    return DispatchJob(name, client=client, output_tokens=16, deadline=dl, **kw)


def _shares(policy: str, **cfg) -> ClientShares:
    return ClientShares(FairPolicy(policy, FairnessConfig(**cfg)), registry=CollectorRegistry(), keyed=True)


@pytest.mark.parametrize("chains", [1, 2])
@pytest.mark.parametrize("policy", ["d2lpm", "d-vtc"])
def test_light_clients_deadline_job_is_judged_by_its_chains_order(policy, chains):
    """Each chain of one slot runs a job of 1.7 s; 20 jobs of the heavy client A queue per chain. B's job with an
    8 s deadline: refused before (FIFO, 37 s predicted), though the policy starts it within 2 turns of each slot."""
    async def main():
        shares = _shares(policy, quantum=60.0)
        dm = DispatchManager(policy="jffc", shares=shares, steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=(f"s{i}",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))
                       for i in range(chains)])
        leases = [await dm.acquire(_job(f"r{i}", "A")) for i in range(chains)]
        heavy = [asyncio.ensure_future(dm.acquire(_job(f"a{i}", "A"))) for i in range(20 * chains)]
        await asyncio.sleep(0)
        assert dm.queue_length == 20 * chains
        with pytest.raises(DeadlineUnreachable):  # the heavy client's own waits behind its backlog, rightly
            await dm.acquire(_job("a-late", "A", deadline_ms=8_000))
        light = asyncio.ensure_future(dm.acquire(_job("b0", "B", deadline_ms=8_000)))
        await asyncio.sleep(0)
        assert not light.done(), f"refused although {policy} serves it within its deadline: {light.exception()}"
        order, waiting = [], {*heavy, light}
        while "b0" not in order and len(order) < 6 * chains:  # the slots free one after another, each job charged
            lease = leases.pop(0)
            shares.output(lease.job.client, chain_key(lease.chain), 16)
            dm.release(lease)
            await asyncio.sleep(0)
            for t in [t for t in waiting if t.done()]:
                waiting.discard(t)
                leases.append(t.result())
                order.append(t.result().job.job_id)
        # started within 2 turns of each slot: it has its last token by 3 x 1.7 s < 8 s
        assert "b0" in order[:2 * chains + 1], order
        for lease in leases:
            dm.release(lease)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*heavy, light, return_exceptions=True)

    asyncio.run(main())


def _served_before(policy: str, seed: int, chains: int, own_prefix: bool = False) -> tuple[int, int]:
    """A random history on ``chains`` chains of one slot each, then a new job: what :meth:`ClientShares.ahead_bound`
    counts before it and how many jobs start before it as slots free one after another, oldest job first (each
    charged its output as it ends; those running when the new job comes, before: the dispatcher does not count
    output still to come). ``own_prefix``: the new job may find a prefix cached too."""
    rng = random.Random(seed)
    shares = _shares(policy, quantum=rng.uniform(5, 300), worker_quantum=rng.uniform(20, 400))
    d = FairDispatcher([(1.0, 1)] * chains, shares.policy, shares.describe)
    ids = itertools.count()
    clients = [f"c{i}" for i in range(rng.randint(1, 5))]

    def new(client: str) -> DispatchJob:
        return DispatchJob(f"j{next(ids)}", client=client, input_tokens=rng.choice([1, 4, 20, 50]),
                           matched={rng.randrange(chains): rng.choice([0, 8, 16])} if rng.random() < 0.3 else {},
                           expected_output=rng.choice([1, 5, 16, 40]))

    running: list[tuple[int, DispatchJob]] = []  # (chain, job), oldest first

    def arrive(job: DispatchJob) -> None:
        k = d.arrive(job)
        if k is not None:
            running.append((k, job))

    charged: set[str] = set()

    def end() -> DispatchJob | None:
        k, job = running.pop(0)
        if job.job_id not in charged:
            shares.output(job.client, k, job.expected_output)
        nxt = d.complete(k)
        if nxt is not None:
            running.append((k, nxt))
        return nxt

    for _ in range(rng.randint(chains, 50)):
        if rng.random() < 0.6 or not running:
            arrive(new(rng.choice(clients)))
        else:
            end()
    while d.free_chains():
        arrive(new(rng.choice(clients)))
    for k, j in running:
        shares.output(j.client, k, j.expected_output)
        charged.add(j.job_id)
    job = new(rng.choice([*clients, "newcomer"]))
    if not own_prefix:
        job.matched = {}
    est = shares.ahead_bound(job, d, [1.0] * chains)
    arrive(job)
    for n in itertools.count():
        if end() is job:
            return est, n


@pytest.mark.parametrize("policy", ["d2lpm", "d-vtc"])
def test_per_chain_ahead_is_the_chains_own_order_on_one_chain(policy):
    """Property: on one chain the count is the policy's own order, job for job (before: the whole queue, off in
    most histories, by up to the queue's length). Random clients, lengths, quanta, prefixes and counters."""
    wrong = [(seed, *r) for seed in range(200) if (r := _served_before(policy, seed, 1))[0] != r[1]]
    assert not wrong, f"(seed, estimate, real) {wrong[:5]} of {len(wrong)}"


@pytest.mark.parametrize("policy", ["d2lpm", "d-vtc"])
def test_per_chain_ahead_is_an_upper_bound_on_several_chains(policy):
    """On three equal chains a job that starts after ``n`` slots freed one by one (round robin over the chains'
    ends, oldest first) is counted at least ``n``: the estimate errs long (a refusal, never a missed deadline)."""
    short = [(seed, *r) for seed in range(200) if (r := _served_before(policy, seed, 3, True))[0] < r[1]]
    assert not short, short[:5]


def test_dlpm_ahead_before_any_admission_sizes_the_quantum_as_the_first_refill():
    """Nothing admitted yet (adaptive quantum): the first refill gives each client one request's worth (52 units),
    so B's job starts second; counted with the 2048-unit prior, all 20 of A's jobs were counted before it. (The
    dispatcher reads it so only while no chain has a slot, where the prediction refuses whatever it counts.)"""
    shares = _shares("dlpm")
    queued = [_job(f"a{i}", "A") for i in range(20)]  # 20 + 2 x 16 = 52 units each
    new = _job("b", "B")
    est = shares.ahead(new, queued)
    pol, waiting = shares.policy, [shares.describe(j) for j in [*queued, new]]
    for seq, req in enumerate(waiting):
        req.seq = seq
        pol.arrived(req, waiting[:seq + 1])
    for n in itertools.count():  # the policy's own order on one chain
        req = pol.pick(waiting, "w")
        waiting.remove(req)
        pol.admit(req, "w")
        pol.output(req.client, "w", 16)
        if req.item is new:
            break
    assert est == n == 1
    assert pol.quantum.value == pytest.approx(52.0)
