"""Deadlines under a client-fair ``--fairness`` (the default with --api-keys: dlpm): the admission prediction counts
the jobs the policy serves before a new one, not the whole queue. Counting the whole queue (FIFO) refused a light
client's deadline request behind a heavy client's backlog with 429 deadline_unreachable, at every retry, though the
policy would have served it next."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager, chain_key
from petals_chain.orchestrator.fairness import ClientShares


def _job(name: str, client: str, deadline_ms: float | None = None) -> DispatchJob:
    dl = RequestDeadline.from_ms(client, deadline_ms, None) if deadline_ms is not None else None
    return DispatchJob(name, client=client, input_tokens=20, expected_output=16, output_tokens=16, deadline=dl)


@pytest.mark.parametrize("policy", ["fcfs", "vtc", "dlpm"])
def test_light_clients_deadline_job_is_judged_by_the_fair_order(policy):
    async def main():
        shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=60.0)), registry=CollectorRegistry(),
                              keyed=True)
        # one chain of one slot: a job takes 1.7 s (17 steps of 0.1 s)
        dm = DispatchManager(policy="jffc", shares=shares, steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))])
        lease = await dm.acquire(_job("a0", "A"))
        heavy = [asyncio.ensure_future(dm.acquire(_job(f"a{i}", "A"))) for i in range(1, 21)]
        await asyncio.sleep(0)
        assert dm.queue_length == 20
        # the heavy client's own deadline job waits behind its 20 queued jobs under any policy: 21 x 1.7 s > 8 s
        with pytest.raises(DeadlineUnreachable):
            await dm.acquire(_job("a-late", "A", deadline_ms=8_000))
        light = asyncio.ensure_future(dm.acquire(_job("b0", "B", deadline_ms=8_000)))
        await asyncio.sleep(0)
        if policy == "fcfs":  # FIFO: 20 ahead, 37 s: refused, rightly
            assert isinstance(light.exception(), DeadlineUnreachable)
        else:
            assert not light.done(), "refused although the fairness policy serves it within its deadline"
            order = []
            for _ in range(4):  # the policy does serve it within the first few slots that free (< 8 s / 1.7 s)
                shares.output(lease.job.client, chain_key(lease.chain), 16)
                dm.release(lease)
                await asyncio.sleep(0)
                lease = next(t.result() for t in [*heavy, light] if t.done() and t.result().job.job_id not in order)
                order.append(lease.job.job_id)
            assert "b0" in order, order
        dm.release(lease)
        for t in [*heavy, light]:
            t.cancel()
        await asyncio.gather(*heavy, light, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["vtc", "dlpm"])
def test_fair_ahead_counts_own_jobs_and_the_others_within_the_budget(policy):
    """The estimate itself: a client's own queued jobs always count; another client's only up to what the policy
    serves it first (VTC: the counter gap; DLPM: its credit and the refills the newcomer needs)."""
    shares = ClientShares(FairPolicy(policy, FairnessConfig(quantum=52.0)), registry=CollectorRegistry(), keyed=True)
    a = [_job(f"a{i}", "A") for i in range(10)]  # each 20 + 2 x 16 = 52 units
    b = [_job(f"b{i}", "B") for i in range(2)]
    assert shares.ahead(_job("x", "A"), []) == 0
    assert shares.ahead(_job("x", "A"), a) == 10  # its own client's backlog is all ahead of it
    light = shares.ahead(_job("x", "C"), a + b)
    assert 1 <= light <= 4, light  # a newcomer goes after about one job of each backlogged client, not after 12
    assert shares.ahead(_job("x", "B"), a + b) < 2 + 10  # B's own 2, then a few of A's
    assert shares.ahead(_job("x", "B"), a + b) >= 2
