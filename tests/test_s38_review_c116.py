"""Review of c116b07 (LoRA adapter dispatch): what it changed for jobs without an adapter. Units on DispatchManager,
no processes. Under --schedule db|mlfq a waiting adapter's job that no running job on its chains may be paused for
stopped every pause: a job without an adapter behind it waited for jobs far below it to end (before c116b07 one was
paused and its slot went to that job). And the per-decision paths of a job without an adapter (flex's pause and
doom checks, the priority pause) asked of every running job whether the job's adapter runs on its chain."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DispatchJob, DispatchManager

SERVES = {"a": {"fr"}, "b": set()}


def chain(server: str, cap: int = 1) -> Chain:
    return Chain(servers=(server,), blocks=(4,), service_time=1.0, capacity=cap, spans=((0, 4),))


def manager(chains: list[Chain], **kw) -> DispatchManager:
    dm = DispatchManager(**kw)
    dm.serves_adapter = lambda ch, adapter: all(adapter in SERVES[s] for s in ch.servers)
    dm.set_chains(chains)
    return dm


def test_mlfq_a_base_job_pauses_a_job_the_adapters_job_cannot():
    """mlfq, chains b (no fr) and a (fr), each running one job: on b one far down the levels, on a a fresh one. A fr
    job (level 0) waits, then a base job (level 0): the fr job can pause nobody (the job on a is not below it), and
    nothing was paused: the base job waited for the job on b to end. Now the job on b is paused for the base job."""
    async def main():
        dm = manager([chain("b"), chain("a")], schedule="mlfq")
        on_b = await dm.acquire(DispatchJob("jb", sched=dm.new_priority_job("jb", "m")))
        on_a = await dm.acquire(DispatchJob("ja", sched=dm.new_priority_job("ja", "m")))
        for lease in (on_b, on_a):
            dm.kv_kept(lease, True)
        for _ in range(40):
            dm.charge(on_b, 0.1)
        assert on_b.job.sched.level > on_a.job.sched.level == 0
        fr = asyncio.ensure_future(dm.acquire(DispatchJob("fr", adapter="fr", sched=dm.new_priority_job("fr", "m"))))
        await asyncio.sleep(0)
        base = asyncio.ensure_future(dm.acquire(DispatchJob("x", sched=dm.new_priority_job("x", "m"))))
        await asyncio.sleep(0)
        assert on_b.preempt and not on_a.preempt and dm.priority_preemptions == 1
        dm.release(on_b)  # it paused at its step: its slot goes to the base job, the fr job cannot take it
        await asyncio.sleep(0)
        assert base.done() and base.result().chain.servers == ("b",) and not fr.done()
        dm.release(on_a)
        await asyncio.sleep(0)
        assert fr.done() and fr.result().chain.servers == ("a",)
        for lease in (base.result(), fr.result()):
            dm.release(lease)

    asyncio.run(main())


@pytest.fixture
def no_adapter_reads(monkeypatch):
    """Fail on any adapter look-up made for a job without an adapter (``_may_run_on``, ``_adapter_chains``)."""
    seen: list[str] = []
    may_run_on, adapter_chains = DispatchManager._may_run_on, DispatchManager._adapter_chains

    def spy_may_run_on(self, job, k):
        if not job.adapter:
            seen.append(f"_may_run_on({job.job_id})")
        return may_run_on(self, job, k)

    def spy_adapter_chains(self, adapter):
        if not adapter:
            seen.append("_adapter_chains('')")
        return adapter_chains(self, adapter)

    monkeypatch.setattr(DispatchManager, "_may_run_on", spy_may_run_on)
    monkeypatch.setattr(DispatchManager, "_adapter_chains", spy_adapter_chains)
    return seen


def test_flex_decisions_of_a_base_job_read_no_adapter(no_adapter_reads):
    """flex, 2 chains x 4 slots busy: a deadline job's pause and doom checks went over every running job asking
    whether its (absent) adapter runs there: 24% more Python calls per _pause_for with 128 running jobs."""
    async def main():
        dm = manager([chain("b", 4), chain("a", 4)], schedule="flex", steps_per_job=lambda: 17.0)
        leases = [await dm.acquire(DispatchJob(f"j{i}", expected_output=200)) for i in range(8)]
        job = DispatchJob("d", deadline=RequestDeadline.from_ms("x", None, 60_000), output_tokens=16)
        dm._misses_waiting(job)
        dm._pause_for(job)
        for lease in leases:
            dm.release(lease)

    asyncio.run(main())
    assert no_adapter_reads == []


def test_priority_pauses_for_a_base_job_read_no_adapter(no_adapter_reads):
    """mlfq: a waiting base job's priority pause filtered the running jobs by the chains its (absent) adapter runs
    on."""
    async def main():
        dm = manager([chain("b", 2), chain("a", 2)], schedule="mlfq")
        leases = [await dm.acquire(DispatchJob(f"m{i}", sched=dm.new_priority_job(f"m{i}", "m"))) for i in range(4)]
        for lease in leases:
            dm.kv_kept(lease, True)
            for _ in range(40):
                dm.charge(lease, 0.1)
        waiting = asyncio.ensure_future(dm.acquire(DispatchJob("w", sched=dm.new_priority_job("w", "m"))))
        await asyncio.sleep(0)
        assert dm.priority_preemptions == 1  # the decision was made (and read nothing of adapters)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for lease in leases:
            dm.release(lease)

    asyncio.run(main())
    assert no_adapter_reads == []
