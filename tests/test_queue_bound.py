"""The central-queue bound of the dispatch manager, without processes: many concurrent asyncio jobs acquire,
release, fail over (re-queue), give up and meet re-plans, and the bound holds at every step of the loop."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.dispatch import ADMISSION, Admission, DispatchJob, DispatchManager, QueueFull


def chain(servers, T, cap):
    n = len(servers)
    cuts = [round(i * 4 / n) for i in range(n + 1)]
    spans = tuple((cuts[i], cuts[i + 1]) for i in range(n))
    return Chain(servers=tuple(servers), blocks=tuple(b - a for a, b in spans), service_time=T, capacity=cap,
                 spans=spans)


# Re-plans: chains kept, chains gone, a chain kept with another capacity, and no chain at all.
PLANS = [
    [chain(["a"], 1.0, 2), chain(["b", "c"], 2.0, 1)],
    [chain(["a"], 1.0, 2)],
    [chain(["d"], 0.5, 3), chain(["a"], 1.0, 1)],
    [],
    [chain(["b", "c"], 2.0, 2), chain(["e"], 3.0, 1)],
]


@pytest.mark.parametrize("policy", ["jffc", "jsq", "sed", "jiq"])
@pytest.mark.parametrize("max_queue", [0, 3])
def test_bound_holds_under_acquire_release_replan_storm(policy, max_queue):
    rng = random.Random(11)

    async def main():
        dm = DispatchManager(policy=policy, max_queue=max_queue)
        dm.set_chains(PLANS[0])
        violations: list[str] = []
        outcomes: Counter = Counter()
        stop = asyncio.Event()

        def check(where: str) -> None:
            if dm.queue_length > max_queue or dm.queue_max > max_queue:
                violations.append(f"{where}: queue {dm.queue_length} max {dm.queue_max} > {max_queue}")
            for k, ch in enumerate(dm.chains):
                if not (0 <= dm.active(k) <= dm.peak_active(k) <= ch.capacity):
                    violations.append(f"{where}: chain {k} active {dm.active(k)} peak {dm.peak_active(k)} "
                                      f"capacity {ch.capacity}")

        async def watchdog():  # runs once per loop iteration: sees every state another task can see
            while not stop.is_set():
                check("loop")
                await asyncio.sleep(0)

        async def planner():
            while not stop.is_set():
                await asyncio.sleep(rng.random() * 0.01)
                dm.set_chains(rng.choice(PLANS))
                check("set_chains")

        async def hold(lease) -> None:
            await asyncio.sleep(rng.random() * 0.004)
            dm.release(lease)
            check("release")

        async def job(i: int) -> None:
            await asyncio.sleep(rng.random() * 0.002)
            adm = Admission()
            ADMISSION.set(adm)  # this task's context, as the API middleware does per request
            fails_over = rng.random() < 0.3
            gives_up = rng.random() < 0.1
            try:
                acquire = dm.acquire(DispatchJob(str(i)))
                lease = await (asyncio.wait_for(acquire, rng.random() * 0.003) if gives_up else acquire)
            except QueueFull:
                check("refused")
                assert adm.state == "refused"
                outcomes["refused"] += 1
                return
            except asyncio.TimeoutError:
                check("gave up")
                outcomes["gave_up"] += 1
                return
            assert adm.state == "admitted"
            check("acquired")
            if fails_over:  # the chain failed: the admitted job waits again, never refused
                dm.release(lease)
                lease = await dm.acquire(DispatchJob(str(i), requeue=True))
                check("re-acquired")
                outcomes["failed_over"] += 1
            await hold(lease)
            outcomes["served"] += 1

        tasks = [asyncio.create_task(watchdog()), asyncio.create_task(planner())]
        total = 0
        for _ in range(12):  # bursts of 4 x (largest capacity + bound)
            n = 4 * (4 + max_queue)
            burst = [asyncio.create_task(job(total + i)) for i in range(n)]
            total += n
            await asyncio.sleep(rng.random() * 0.01)
            tasks += burst
        jobs = tasks[2:]
        await asyncio.sleep(0.05)
        stop.set()
        dm.set_chains(PLANS[0])  # chains stay: everything still waiting is served
        await asyncio.wait_for(asyncio.gather(*jobs), 30)
        await asyncio.gather(*tasks[:2])
        check("end")
        assert violations == [], violations[:5]
        assert outcomes["served"] + outcomes["refused"] + outcomes["gave_up"] == total, outcomes
        assert outcomes["served"] > 0 and outcomes["failed_over"] > 0
        assert dm.refused == outcomes["refused"]
        assert dm.running == 0 and dm.queue_length == 0 and dm.requeued == 0
        return outcomes, dm.queue_max

    outcomes, queue_max = asyncio.run(main())
    assert outcomes["refused"] > 0  # the storm did reach the bound
    assert queue_max == max_queue  # ... and the queue filled up to it


def test_requeued_jobs_go_first_and_are_never_refused():
    async def main():
        dm = DispatchManager(policy="jffc", max_queue=1)
        dm.set_chains([chain(["a"], 1.0, 1)])
        first = await dm.acquire(DispatchJob("1"))
        queued = asyncio.create_task(dm.acquire(DispatchJob("2")))
        await asyncio.sleep(0)
        assert dm.queue_length == 1 and dm.queue_max == 1
        with pytest.raises(QueueFull):
            await dm.acquire(DispatchJob("3"))
        # Two admitted jobs fail over while the queue is full: they wait in the lane, not refused.
        lane = [asyncio.create_task(dm.acquire(DispatchJob(f"f{i}", requeue=True))) for i in range(2)]
        await asyncio.sleep(0)
        assert dm.requeued == 2 and dm.queue_length == 1 and dm.refused == 1
        dm.release(first)
        f0 = await lane[0]  # the lane goes before the queue
        assert f0.job.job_id == "f0" and not queued.done()
        dm.release(f0)
        f1 = await lane[1]
        dm.release(f1)
        second = await queued
        assert second.job.job_id == "2" and dm.peak_active(0) == 1
        dm.release(second)
        # No chain: new jobs wait up to the bound, the rest are refused; re-queued ones always wait.
        dm.set_chains([])
        waiting = asyncio.create_task(dm.acquire(DispatchJob("4")))
        again = asyncio.create_task(dm.acquire(DispatchJob("f2", requeue=True)))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await dm.acquire(DispatchJob("5"))
        assert dm.queue_length == 1 and dm.requeued == 1
        dm.set_chains([chain(["a"], 1.0, 1)])
        got = await again  # the lane first, on the chain that came back
        assert got.job.job_id == "f2" and not waiting.done()
        dm.release(got)
        dm.release(await waiting)
        assert dm.running == dm.queue_length == dm.requeued == 0 and dm.queue_max == 1 and dm.refused == 2

    asyncio.run(main())
