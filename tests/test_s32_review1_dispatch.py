"""Review of the TTFT dispatch (3966467): JFFC's state after ``arrive(job, fits)`` against a brute-force model, the
prediction's start chain against where jobs start, the cost of ``fits`` for the jobs a re-plan re-queues, and
``deadline_infeasible`` judged on how fast an idle chain opens (not on opens that waited for the servers' slots)."""

from __future__ import annotations

import asyncio
import random
import time

from petals_chain.algorithms.edf import StepTimes
from petals_chain.algorithms.jffc import JFFCDispatcher
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import (ADMISSION, Admission, DeadlineInfeasible, DeadlineUnreachable,
                                                DispatchJob, DispatchManager, chain_key)


def _model_pick(rates, caps, occ, fits):
    free = sorted((-rates[k], k) for k in range(len(rates)) if occ[k] < caps[k])
    if not free:
        return None
    k0 = free[0][1]
    if fits is None or fits(k0):
        return k0
    return next((k for _, k in free if fits(k)), k0)


def test_jffc_with_fits_matches_a_brute_force_model():
    """Random arrivals (with and without ``fits``), adoptions and completions: the chain each job starts on, the
    occupancy, the free-chain heap and the queue's order are the model's (the heap stays right after a start on a
    chain other than its top fills that chain)."""
    for seed in range(400):
        rng = random.Random(seed)
        n = rng.randint(1, 6)
        rates = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
        caps = [rng.randint(0, 3) for _ in range(n)]
        d = JFFCDispatcher(list(zip(rates, caps)))
        occ, queue, running = [0] * n, [], []
        for step in range(50):
            op = rng.random()
            if op < 0.5:
                good = {k for k in range(n) if rng.random() < 0.4}
                fits = good.__contains__ if rng.random() < 0.8 else None
                expected = _model_pick(rates, caps, occ, fits)
                assert d.peek(fits) == expected, (seed, step)
                job = object()
                assert d.arrive(job, fits) == expected, (seed, step)
                if expected is None:
                    queue.append(job)
                else:
                    occ[expected] += 1
                    running.append(expected)
            elif op < 0.6:
                k = rng.randrange(n)
                ok = d.adopt(k, object())
                assert ok == (occ[k] < caps[k]), (seed, step)
                if ok:
                    occ[k] += 1
                    running.append(k)
            elif running:
                k = running.pop(rng.randrange(len(running)))
                nxt = d.complete(k)
                if queue:
                    assert nxt is queue.pop(0), (seed, step)
                    running.append(k)
                else:
                    assert nxt is None, (seed, step)
                    occ[k] -= 1
            assert d.occupancy == occ, (seed, step)
            assert sorted(d._free) == sorted((-rates[k], k) for k in range(n) if occ[k] < caps[k]), (seed, step)
            assert not (queue and d._free), (seed, step)  # Alg. 3: nothing waits beside a free chain


def test_admission_predicts_the_chain_the_job_starts_on():
    """Random chains (some slow to open), loads, TTFT deadlines and preferred chains under each schedule: a job the
    prediction starts at once (no wait) starts on the chain it timed (``_start_chain``)."""
    async def run(seed: int) -> int:
        rng = random.Random(seed)
        chains = [Chain(servers=(f"s{k}",), blocks=(4,), service_time=rng.choice([0.5, 1.0, 2.0]),
                        capacity=rng.randint(1, 2), spans=((0, 4),)) for k in range(rng.randint(1, 4))]
        dm = DispatchManager(schedule=rng.choice(["edf", "fcfs", "flex"]), steps_per_job=lambda: 17.0,
                             max_queue=rng.choice([None, 3]))
        dm.set_chains(chains)
        for cid in dm.chain_ids:
            for _ in range(5):
                dm.step_times.observe_open(cid, rng.choice([0.0, 0.3, 1.0]))
        leases, waiting, checked = [], [], 0
        for step in range(25):
            if leases and rng.random() < 0.35:
                dm.release(leases.pop(rng.randrange(len(leases))))
                continue
            dl = RequestDeadline.from_ms("x", rng.choice([None, 2500, 60000]), rng.choice([None, 150, 300, 600]))
            job = DispatchJob(f"j{step}", deadline=dl if dl.active else None, output_tokens=rng.choice([1, 16]))
            if rng.random() < 0.3:
                job.prefer = (chain_key(chains[rng.randrange(len(chains))]),)
            chains_seen, _ = dm._loads(job)
            pred = dm.predict(job)
            start = dm._start_chain(job, chains_seen, time.monotonic())
            task = asyncio.ensure_future(dm.acquire(job))
            await asyncio.sleep(0)
            if not task.done():
                waiting.append(task)
            elif task.exception() is None:
                leases.append(task.result())
                if pred.wait_s == 0 and start is not None:
                    assert task.result().index == start, (seed, step)
                    checked += 1
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return checked

    assert sum(asyncio.run(run(seed)) for seed in range(60)) > 100


def test_a_replan_does_not_read_the_loads_for_every_queued_ttft_job():
    """A re-plan re-queues every waiting job through ``_arrive``: a job with a TTFT deadline read every chain's load
    (and every running job) for its ``fits`` even with no chain free, where it is never asked (1000 queued on 100
    chains: 0.46 s of the event loop per re-plan, 3 ms without TTFT deadlines). Read only when asked now."""
    async def main():
        chains = [Chain(servers=(f"s{k}",), blocks=(4,), service_time=1.0 + k / 100, capacity=1, spans=((0, 4),))
                  for k in range(4)]
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains(chains)
        running = [await dm.acquire(DispatchJob(f"r{k}", output_tokens=4)) for k in range(4)]
        queued = [asyncio.ensure_future(dm.acquire(DispatchJob(
            f"q{i}", deadline=RequestDeadline.from_ms("x", 600_000, 300_000), output_tokens=4))) for i in range(40)]
        await asyncio.sleep(0)
        assert dm.queue_length == 40
        reads = []
        loads = dm._chain_loads
        dm._chain_loads = lambda *a, **kw: reads.append(1) or loads(*a, **kw)
        dm.set_chains(list(chains))
        assert dm.queue_length == 40 and len(reads) <= 1, len(reads)  # was 40: one per queued job
        # a slot that frees still goes to the queue's head, and a new TTFT job still asks where it fits
        dm.release(running[0])
        await asyncio.sleep(0)
        assert queued[0].done() and dm.queue_length == 39
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)

    asyncio.run(main())


def test_open_best_s_is_the_fastest_opening_seen():
    st = StepTimes(min_samples=3)
    for s in (0.5, 0.05, 2.0):
        assert st.open_best_s("a") == 0.0  # nothing learnt until min_samples, as open_s
        st.observe_open("a", s)
    assert st.open_best_s("a") == 0.05 and st.open_s("a") > 0.05
    st.observe_open("a", float("nan"))  # ignored, as by open_s
    assert st.open_best_s("a") == 0.05
    st.retain(["b"])
    assert st.open_best_s("a") == 0.0 and st.chains() == set()


def test_opens_that_waited_under_load_do_not_make_a_deadline_infeasible():
    """A chain that opened in 50 ms while its servers had room, and in 2 s while opens queued there for slots held by
    other jobs: the mean opening (1.9 s) misses a first token due in 1 s, a refusal that may pass later (429
    ``deadline_unreachable`` with Retry-After). It was ``deadline_infeasible`` (no Retry-After: "even an idle swarm
    misses it") although the idle chain opens in 50 ms. A first token due sooner than any idle chain's step still
    is."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=2, spans=((0, 4),))])
        cid = dm.chain_ids[0]
        for s in [0.05] * 5 + [2.0] * 40:
            dm.step_times.observe_open(cid, s)
        assert dm.step_times.open_s(cid) > 1.0
        for ttft_ms, refusal, code in ((1000, DeadlineUnreachable, "deadline_unreachable"),
                                       (20, DeadlineInfeasible, "deadline_infeasible")):
            adm = Admission()
            token = ADMISSION.set(adm)
            try:
                job = DispatchJob("j", deadline=RequestDeadline.from_ms("x", None, ttft_ms), output_tokens=16)
                try:
                    await dm.acquire(job)
                    raise AssertionError("admitted")
                except DeadlineUnreachable as e:
                    assert type(e) is refusal and e.code == code, (ttft_ms, e)
            finally:
                ADMISSION.reset(token)
            assert adm.code == code and adm.never_fits == (code == "deadline_infeasible")

    asyncio.run(main())
