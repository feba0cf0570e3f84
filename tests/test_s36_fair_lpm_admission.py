"""Deadline admission under ``--fairness lpm`` and ``rr-lpm`` (session 36). The deadline prediction counted the whole
queue for them: a request whose prompt prefix a chain holds was refused with 429 deadline_unreachable behind a
backlog without it that LPM starts after it; now it counts what these orders put ahead of it
(:meth:`ClientShares.ahead_bound`)."""

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


def _shares(policy: str) -> ClientShares:
    return ClientShares(FairPolicy(policy, FairnessConfig()), registry=CollectorRegistry(), keyed=True)


@pytest.mark.parametrize("policy", ["lpm", "rr-lpm"])
def test_a_request_holding_the_chains_prefix_is_not_refused_for_a_backlog_lpm_serves_after_it(policy):
    """One chain of one slot, a job of 1.7 s; 20 jobs of client A without a cached prefix queue. B's job, whose
    16-token prefix the chain holds, with an 8 s deadline: refused before (the whole queue, 37 s predicted), though
    LPM starts it at the next free slot; A's own late job is still refused."""
    async def main():
        shares = _shares(policy)
        dm = DispatchManager(policy="jffc", shares=shares, steps_per_job=lambda: 17.0)
        chain = Chain(servers=("s0",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))
        dm.set_chains([chain])

        def job(name: str, client: str, deadline_ms: float | None = None, **kw) -> DispatchJob:
            dl = RequestDeadline.from_ms(client, deadline_ms, None) if deadline_ms is not None else None
            return DispatchJob(name, client=client, output_tokens=16, deadline=dl, input_tokens=20,
                               expected_output=16, **kw)

        lease = await dm.acquire(job("r0", "A"))
        heavy = [asyncio.ensure_future(dm.acquire(job(f"a{i}", "A"))) for i in range(20)]
        await asyncio.sleep(0)
        assert dm.queue_length == 20
        with pytest.raises(DeadlineUnreachable):  # no prefix: LPM serves it after the backlog, rightly refused
            await dm.acquire(job("a-late", "A", deadline_ms=8_000))
        light = asyncio.ensure_future(dm.acquire(job("b0", "B", deadline_ms=8_000,
                                                     matched={chain_key(chain): 16})))
        await asyncio.sleep(0)
        assert not light.done(), f"refused although {policy} starts it next: {light.exception()}"
        dm.release(lease)
        await asyncio.sleep(0)
        assert light.done() and light.result().job.job_id == "b0"  # the order the prediction counted
        dm.release(light.result())
        for t in heavy:
            t.cancel()
        await asyncio.gather(*heavy, return_exceptions=True)

    asyncio.run(main())


def _served_before(policy: str, seed: int, chains: int) -> tuple[int, int]:
    """A random history on ``chains`` chains of one slot, then a new job that may hold a prefix: what
    :meth:`ClientShares.ahead_bound` counts before it, and how many jobs start before it as the slots free one after
    another, the oldest running job first."""
    rng = random.Random(seed)
    shares = _shares(policy)
    d = FairDispatcher([(1.0, 1)] * chains, shares.policy, shares.describe)
    ids = itertools.count()

    def new() -> DispatchJob:
        matched = {k: rng.choice([0, 8, 16]) for k in range(chains) if rng.random() < 0.4}
        return DispatchJob(f"j{next(ids)}", client=rng.choice("abc"), input_tokens=rng.choice([4, 20]),
                           matched=matched, expected_output=4)

    running: list[tuple[int, DispatchJob]] = []

    def arrive(job: DispatchJob) -> None:
        k = d.arrive(job)
        if k is not None:
            running.append((k, job))

    def end() -> DispatchJob | None:
        k, _ = running.pop(0)
        nxt = d.complete(k)
        if nxt is not None:
            running.append((k, nxt))
        return nxt

    for _ in range(rng.randint(chains, 40)):
        if rng.random() < 0.65 or not running:
            arrive(new())
        else:
            end()
    while d.free_chains():
        arrive(new())
    job = new()
    est = shares.ahead_bound(job, d, [1.0] * chains)
    arrive(job)
    for n in itertools.count():
        if end() is job:
            return est, n


@pytest.mark.parametrize("policy", ["lpm", "rr-lpm"])
def test_lpm_ahead_is_exact_on_one_chain_and_an_upper_bound_on_several(policy):
    """Property over random histories, prefixes and lengths: on one chain the count is the order's own, job for job
    (before: None, the caller counted the whole queue); on three chains it never counts fewer than start first."""
    wrong = [(seed, *r) for seed in range(150) if (r := _served_before(policy, seed, 1))[0] != r[1]]
    assert not wrong, f"(seed, estimate, real) {wrong[:5]} of {len(wrong)}"
    under = [(seed, *r) for seed in range(150) if (r := _served_before(policy, seed, 3))[0] is None or r[0] < r[1]]
    assert not under, f"(seed, estimate, real) {under[:5]} of {len(under)}"
