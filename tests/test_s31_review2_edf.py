"""Review of edf.predict's first token (bd21767): timed on the chain that gives it soonest, it was not the chain the
dispatcher starts the job on. JFFC starts a job with a free slot on its fastest free chain; when that chain is slow to
open, a job with ttft_deadline_ms was admitted by a quicker chain's time and got its first token past it (2x here;
refused before bd21767). With a slot free, the first token is now timed on the dispatcher's pick (``start``)."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.algorithms.edf import ChainLoad, predict
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

SLOW_OPEN = ChainLoad(capacity=1, active=0, job_s=1.0, step_s=1 / 17, open_s=1.0)  # fast steps, 1 s to open
QUICK_OPEN = ChainLoad(capacity=1, active=0, job_s=2.0, step_s=2 / 17)


def test_the_first_token_is_timed_on_the_chain_the_job_starts_on():
    chains = [SLOW_OPEN, QUICK_OPEN]
    p = predict(0.0, chains, 0, 16, ttft_deadline=0.5, start=0)
    assert p.doomed and p.ttft_s == pytest.approx(1.0 + 1 / 17) and "time to first token" in p.reason
    assert not predict(0.0, chains, 0, 16, ttft_deadline=0.5, start=1).doomed
    # not known (None), busy or out of range: the chain that gives it soonest, as before
    assert predict(0.0, chains, 0, 16, start=None).ttft_s == pytest.approx(2 / 17)
    busy = [SLOW_OPEN, ChainLoad(capacity=1, active=1, job_s=2.0, step_s=2 / 17)]
    assert predict(0.0, busy, 0, 16, start=1).ttft_s == pytest.approx(1.0 + 1 / 17)
    assert predict(0.0, chains, 0, 16, start=7).ttft_s == pytest.approx(2 / 17)


def _chains() -> list[Chain]:
    return [Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),)),  # JFFC's first
            Chain(servers=("b",), blocks=(4,), service_time=2.0, capacity=1, spans=((0, 4),))]


def test_a_ttft_deadline_the_fastest_free_chain_misses_by_its_opening_is_timed_on_the_free_chain_that_meets_it():
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains(_chains())
        for _ in range(5):  # chain a's hops took 1 s to open for the jobs before
            dm.step_times.observe_open(dm.chain_ids[0], 1.0)
        job = DispatchJob("j", deadline=RequestDeadline.from_ms("x", None, 500), output_tokens=16)
        # JFFC's chain a misses the first token by its 1 s opening: the job is timed (and started) on b, which meets it
        assert not dm.predict(job).doomed and dm.predict(job).ttft_s == pytest.approx(2 / 17)
        lease = await dm.acquire(DispatchJob("k", deadline=RequestDeadline.from_ms("x", None, 1500),
                                             output_tokens=16))
        assert lease.index == 0  # where a job with a free slot goes: JFFC's fastest chain
        # a busy: the job would start on b (quick to open), its first token in time
        assert not dm.predict(job).doomed and dm.predict(job).ttft_s == pytest.approx(2 / 17)
        dm.release(lease)

    asyncio.run(main())
