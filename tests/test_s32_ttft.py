"""Issue 18, TTFT deadlines at dispatch: JFFC names the chain it would start a job on (``peek``), the one source of
that rule for the admission prediction and the start; a job with a TTFT deadline that JFFC's fastest free chain misses
(slow to open) starts on the fastest free chain that meets it, where the prediction timed it; a deadline missed even
by an idle swarm is refused as such (429 ``deadline_infeasible``, no ``Retry-After``)."""

from __future__ import annotations

import asyncio
import random

import pytest

from petals_chain.algorithms.edf import ChainLoad, meets_on, predict
from petals_chain.algorithms.jffc import JFFCDispatcher
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import (ADMISSION, Admission, DeadlineUnreachable, DispatchJob,
                                                DispatchManager)


def test_peek_names_the_chain_arrive_starts_on_and_changes_nothing():
    """Random arrivals and completions on random chains: ``peek()`` is always what ``arrive`` returns next (and
    leaves the state as it was); with ``fits``, the fastest free chain that fits when the fastest does not, the
    fastest when none fits, and the dispatcher's state stays right for the plain rule after such a start."""
    rng = random.Random(7)
    for _ in range(200):
        chains = [(rng.choice([1.0, 2.0, 3.0]), rng.randint(0, 2)) for _ in range(rng.randint(1, 5))]
        if not any(c for _, c in chains):
            continue
        d = JFFCDispatcher(chains)
        running: list[int] = []
        for step in range(40):
            if running and rng.random() < 0.4:
                d.complete(running.pop(rng.randrange(len(running))))
                continue
            free = [k for k, (_, c) in enumerate(chains) if d.occupancy[k] < c]
            fits = None
            if rng.random() < 0.5:
                ok = {k for k in range(len(chains)) if rng.random() < 0.5}
                fits = ok.__contains__
            before = (list(d.occupancy), sorted(d._free), len(d.queue))
            k = d.peek(fits)
            assert (list(d.occupancy), sorted(d._free), len(d.queue)) == before  # read-only
            fastest = min(free, key=lambda j: (-chains[j][0], j)) if free else None
            if fits is None or fastest is None or fits(fastest):
                assert k == fastest
            else:
                good = [j for j in free if fits(j)]
                assert k == (min(good, key=lambda j: (-chains[j][0], j)) if good else fastest)
            assert d.arrive(f"job{step}", fits) == k
            if k is not None:
                running.append(k)
            assert all(d.occupancy[j] <= c for j, (_, c) in enumerate(chains))
            assert sorted(j for _, j in d._free) == [j for j, (_, c) in enumerate(chains) if d.occupancy[j] < c]


def test_meets_on_is_the_predictions_first_token_on_the_start_chain():
    slow_open = ChainLoad(capacity=1, active=0, job_s=1.0, step_s=1 / 17, open_s=1.0)
    quick = ChainLoad(capacity=1, active=0, job_s=2.0, step_s=2 / 17)
    assert not meets_on(0.0, slow_open, 16, ttft_deadline=0.5) and meets_on(0.0, quick, 16, ttft_deadline=0.5)
    assert not meets_on(0.0, quick, 16, ttft_deadline=0.5, deadline=1.0)  # 17 steps of 2/17 s: 2 s
    assert not meets_on(0.0, ChainLoad(capacity=1, active=0, job_s=0.1, step_s=0.2), 1)  # one predict ignores
    rng = random.Random(3)
    for _ in range(2000):
        chains = [ChainLoad(capacity=rng.randint(1, 2), active=0, job_s=rng.uniform(0.2, 2),
                            step_s=rng.uniform(0.01, 0.1), open_s=rng.choice([0.0, rng.uniform(0, 1)]))
                  for _ in range(rng.randint(1, 3))]
        k, now, out = rng.randrange(len(chains)), rng.uniform(0, 50), rng.randint(0, 20)
        ttft = now + rng.uniform(0, 1.2)
        assert meets_on(now, chains[k], out, ttft_deadline=ttft) == \
            (not predict(now, chains, 0, out, ttft_deadline=ttft, start=k).doomed)


def _chains() -> list[Chain]:
    return [Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),)),  # JFFC's first
            Chain(servers=("b",), blocks=(4,), service_time=2.0, capacity=1, spans=((0, 4),))]


def _manager(schedule: str = "edf") -> DispatchManager:
    """Chain a: JFFC's fastest (T 1 s, 17 steps of 59 ms) but its hops took 1 s to open; chain b: T 2 s, opens at
    once (a first token in 118 ms)."""
    dm = DispatchManager(schedule=schedule, steps_per_job=lambda: 17.0)
    dm.set_chains(_chains())
    for _ in range(5):
        dm.step_times.observe_open(dm.chain_ids[0], 1.0)
    return dm


def _job(name: str, ttft_ms: float | None = None, deadline_ms: float | None = None, **kw) -> DispatchJob:
    return DispatchJob(name, deadline=RequestDeadline.from_ms("x", deadline_ms, ttft_ms, **kw), output_tokens=16)


@pytest.mark.parametrize("schedule", ["edf", "fcfs"])
def test_a_ttft_deadline_jffcs_chain_misses_starts_on_the_free_chain_that_meets_it(schedule):
    """A first token due in 500 ms: chain a (JFFC's pick) gives it in 1.06 s, chain b (free) in 118 ms. It was refused
    (429 deadline_unreachable) although b met it; now it is admitted, predicted on b and started on b."""
    async def main():
        dm = _manager(schedule)
        job = _job("ttft", ttft_ms=500)
        pred = dm.predict(job)
        assert not pred.doomed and pred.ttft_s == pytest.approx(2 / 17)
        lease = await dm.acquire(job)
        assert lease.index == 1 and dm.deadline_refused == 0
        # chain a is still JFFC's for everyone else: a job without a TTFT deadline goes there (Alg. 3 unchanged)
        other = await dm.acquire(_job("total", deadline_ms=60_000))
        assert other.index == 0
        dm.release(lease)
        dm.release(other)
        # a TTFT deadline JFFC's own chain meets: JFFC's own chain
        late = await dm.acquire(_job("loose", ttft_ms=5_000))
        assert late.index == 0
        dm.release(late)

    asyncio.run(main())


def test_the_ttft_choice_also_passes_over_a_preferred_chain_that_misses():
    """A job preferring chain a (its cached prefix) with a first token due in 500 ms starts on b, which meets it; one
    with a TTFT deadline neither free chain meets, best effort, keeps its preferred chain."""
    async def main():
        dm = _manager()
        key_a = (("a",), ((0, 4),))
        job = _job("pref", ttft_ms=500)
        job.prefer = (key_a,)
        assert dm.predict(job).ttft_s == pytest.approx(2 / 17)
        lease = await dm.acquire(job)
        assert lease.index == 1 and dm.preferred_starts == 0
        dm.release(lease)
        be = _job("be", ttft_ms=50, best_effort=True)
        be.prefer = (key_a,)
        lease = await dm.acquire(be)
        assert lease.index == 0 and dm.preferred_starts == 1
        dm.release(lease)

    asyncio.run(main())


def test_a_deadline_an_idle_swarm_misses_is_refused_for_good_and_a_busy_ones_refusal_may_retry():
    async def main():
        dm = _manager()
        adm = Admission()
        token = ADMISSION.set(adm)
        try:
            # 50 ms: no chain gives a first token that soon even idle (b: 118 ms)
            with pytest.raises(DeadlineUnreachable) as e:
                await dm.acquire(_job("never", ttft_ms=50))
        finally:
            ADMISSION.reset(token)
        # (before: code deadline_unreachable, never_fits False: a Retry-After invited the same refusal again)
        assert adm.state == "refused" and adm.code == "deadline_infeasible" and adm.never_fits
        assert e.value.code == "deadline_infeasible" and "idle swarm" in adm.message and adm.message == str(e.value)
        assert dm.deadline_refused == 1
        # b busy: a first token due in 500 ms misses on a (1.06 s) but would be met once b frees: retry later
        busy = await dm.acquire(_job("busy"))
        held = await dm.acquire(_job("held"))
        assert {busy.index, held.index} == {0, 1}
        dm.release(busy if busy.index == 0 else held)
        adm = Admission()
        token = ADMISSION.set(adm)
        try:
            with pytest.raises(DeadlineUnreachable) as e:
                await dm.acquire(_job("later", ttft_ms=500))
        finally:
            ADMISSION.reset(token)
        assert e.value.code == "deadline_unreachable" and adm.code == "deadline_unreachable" and not adm.never_fits

    asyncio.run(main())
