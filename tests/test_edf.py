"""Deadlines at the central queue (issue 18): EDF order, the admission prediction, the dispatcher's refusals and the
per-client outcome book — pure and asyncio units; tests/test_deadlines_swarm.py drives them through HTTP."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from petals_chain.algorithms.edf import ChainLoad, EDFQueue, Preemptible, flex_victim, predict
from petals_chain.model import Chain
from petals_chain.orchestrator.auth import KeyFileError, KeyRing
from petals_chain.orchestrator.deadlines import DEADLINE, DeadlineBook, RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager, QueueFull


class J:
    def __init__(self, d):
        self.d = d


def test_edf_queue_orders_by_deadline_fifo_among_equals_and_removes_by_identity():
    rng = random.Random(3)
    q = EDFQueue(key=lambda j: j.d)
    jobs = [J(rng.choice([1.0, 2.0, 3.0, math.inf])) for _ in range(40)]
    for j in jobs:
        q.push(j)
    gone = jobs[5::7]
    for j in gone:
        assert q.remove(j) and j not in q
    assert not q.remove(J(1.0))
    left = [j for j in jobs if j not in gone]
    expected = sorted(left, key=lambda j: (j.d, jobs.index(j)))  # stable: FIFO among equal deadlines
    assert list(q) == expected and len(q) == len(left)
    assert q.ahead_of(2.0) == sum(j.d <= 2.0 for j in left)
    assert q.peek() is expected[0]
    assert [q.pop() for _ in range(len(left))] == expected
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError):
        q.push(J(math.nan))


def test_prediction_waits_for_a_slot_at_the_queue_rate():
    chains = [ChainLoad(capacity=2, active=2, job_s=2.0, step_s=0.1), ChainLoad(capacity=1, active=1, job_s=4.0,
                                                                                 step_s=0.2)]
    # mu = 2/2 + 1/4 = 1.25 jobs/s; no free slot and 4 jobs ahead: wait (4 + 1) / 1.25 = 4 s, then the fastest chain
    p = predict(100.0, chains, ahead=4, output_tokens=9)
    assert p.wait_s == pytest.approx(4.0) and p.ttft_s == pytest.approx(4.1) and p.total_s == pytest.approx(5.0)
    assert not p.doomed
    assert predict(100.0, chains, 4, 9, ttft_deadline=104.05).doomed
    assert not predict(100.0, chains, 4, 9, ttft_deadline=104.2).doomed
    late = predict(100.0, chains, 4, 9, deadline=104.9)
    assert late.doomed and "deadline_ms" in late.reason
    # a free slot on the slow chain: no wait, and the step is that chain's
    free = [ChainLoad(2, 2, 2.0, 0.1), ChainLoad(1, 0, 4.0, 0.2)]
    p = predict(0.0, free, ahead=0, output_tokens=4)
    assert p.wait_s == 0 and p.total_s == pytest.approx(1.0)
    # no chain to predict from (none yet, a re-plan): not doomed; the caller waits for one and drops the job if its
    # deadline passes first (a ten-minute deadline was refused at once while a request without one waited)
    assert not predict(0.0, [], 0, 4).doomed
    assert not predict(0.0, [], 0, 4, deadline=600.0).doomed
    with pytest.raises(ValueError):
        predict(0.0, free, ahead=-1, output_tokens=1)


def _chains():
    return [Chain(servers=("a",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))]


def _job(i, dl=None, out=16):
    return DispatchJob(job_id=f"j{i}", deadline=dl, output_tokens=out)


def test_edf_dispatch_starts_the_earliest_deadline_and_refuses_the_doomed():
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)  # step 0.1 s, a job 1.7 s
        dm.set_chains(_chains())
        running = await dm.acquire(_job(0))
        late, soon, none = (RequestDeadline.from_ms("x", 60_000, None), RequestDeadline.from_ms("x", 30_000, None),
                            None)
        tasks = [asyncio.ensure_future(dm.acquire(_job(i, dl))) for i, dl in enumerate([none, late, soon], 1)]
        await asyncio.sleep(0)
        assert dm.queue_length == 3
        order = []
        lease = running
        for _ in range(3):
            dm.release(lease)
            await asyncio.sleep(0)
            lease = next(t.result() for t in tasks if t.done() and t.result().job.job_id not in order)
            order.append(lease.job.job_id)
        assert order == ["j3", "j2", "j1"]  # earliest deadline first, no deadline last
        # one job runs (1.7 s of 17 steps): a first token due in 50 ms cannot come; one due in 2 s can
        with pytest.raises(DeadlineUnreachable) as e:
            await dm.acquire(_job(9, RequestDeadline.from_ms("x", None, 50)))
        assert "ttft_deadline_ms" in str(e.value) and dm.deadline_refused == 1 and dm.queue_length == 0
        ok = asyncio.ensure_future(dm.acquire(_job(10, RequestDeadline.from_ms("x", None, 2_000))))
        await asyncio.sleep(0)
        assert not ok.done() and dm.queue_length == 1
        # best effort is never refused; predicted late, it queues behind the job that can still meet its deadline
        # (by its own 1 ms deadline it went first: best_effort with ttft_deadline_ms=1 jumped every queue)
        be = asyncio.ensure_future(dm.acquire(_job(11, RequestDeadline.from_ms("x", None, 1, best_effort=True))))
        await asyncio.sleep(0)
        assert dm.queue_length == 2 and dm.deadline_refused == 1
        dm.release(lease)
        await asyncio.sleep(0)
        assert ok.done() and not be.done()
        assert ok.result().job.deadline.late is False
        be.cancel()
        await asyncio.gather(be, return_exceptions=True)
        assert dm.queue_length == 0

    asyncio.run(main())


def test_flex_victim_pauses_the_newest_job_where_the_deadline_is_met_soonest():
    slow = ChainLoad(capacity=2, active=2, job_s=3.4, step_s=0.2)
    fast = ChainLoad(capacity=2, active=2, job_s=1.7, step_s=0.1)
    running = [Preemptible(0, 1.0, "s-old"), Preemptible(1, 1.0, "f-old"), Preemptible(1, 5.0, "f-new")]
    # 16 tokens within 2 s: waiting for a slot (0.85 s at the queue's rate) would miss, a slot now makes it
    doomed = predict(0.0, [slow, fast], 0, 16, deadline=2.0)
    assert doomed.doomed
    victims, pred = flex_victim(0.0, [slow, fast], running, 0, 16, deadline=2.0)
    assert [v.ref for v in victims] == ["f-new"] and not pred.doomed and pred.total_s == pytest.approx(1.7)
    # only the slow chain has a job to pause: 17 steps of 0.2 s miss 2 s, so nobody is paused
    assert flex_victim(0.0, [slow, fast], running[:1], 0, 16, deadline=2.0) is None
    # a slot already freed on the fast chain for an earlier job (ahead of this one) is not this job's
    assert [v.ref for v in flex_victim(0.0, [slow, fast], running, 1, 16, deadline=2.0, promised=[0, 1])[0]] == [
        "f-new"]
    assert flex_victim(0.0, [slow, fast], running, 2, 16, deadline=2.0, promised=[0, 1]) is None
    assert flex_victim(0.0, [slow, fast], [], 0, 16, deadline=2.0) is None


def test_the_choices_of_n_get_the_first_token_of_the_first_and_the_deadline_of_the_last():
    """A request of ``n`` choices: its first token is its first choice's (``ttft_deadline``), its last the last
    choice's (``deadline``). The prediction gave the first token the last choice's wait too: with a free slot, an
    ``n`` = 2 request with a 150 ms first-token deadline was refused (429) where ``n`` = 1 started at once."""
    one = ChainLoad(capacity=2, active=1, job_s=0.4, step_s=0.02)
    first = predict(0.0, [one], 0, 16, siblings=1, ttft_deadline=0.15)
    assert not first.doomed and first.ttft_s == pytest.approx(0.02) and first.total_s == pytest.approx(1 / 5 + 0.34)
    assert predict(0.0, [one], 0, 16, siblings=1, deadline=0.5).doomed  # the second choice waits for a slot
    assert not predict(0.0, [ChainLoad(2, 0, 0.4, 0.02)], 0, 16, siblings=1, deadline=0.5).doomed
    with pytest.raises(ValueError):
        predict(0.0, [one], 0, 16, siblings=-1)

    async def main(schedule):
        dm = DispatchManager(schedule=schedule, steps_per_job=lambda: 20.0)  # step 0.02 s, a job 0.4 s
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.4, capacity=2, spans=((0, 4),))])
        busy = await dm.acquire(DispatchJob("busy", expected_output=10))
        lease = await asyncio.wait_for(dm.acquire(DispatchJob(
            "c0", deadline=RequestDeadline.from_ms("x", None, 150), output_tokens=16, siblings=1)), 1.0)
        assert lease.index == 0 and not busy.preempt and dm.deadline_refused == 0

    for schedule in ("edf", "flex"):
        asyncio.run(main(schedule))


def test_flex_pauses_a_slot_for_every_choice_or_none():
    """FLEX paused one running job for an ``n`` = 2 request and counted on its second choice getting a slot at the
    queue's mean rate, though the pause was looked for because the running jobs free none in time: the second
    choice waited for the other long job, the request missed its deadline anyway, and the paused job was delayed for
    nothing. Now it pauses a slot per choice, or none (and the request is refused)."""
    chain = ChainLoad(capacity=2, active=2, job_s=0.4, step_s=0.02)
    long_jobs = [Preemptible(0, 1.0, "a", remaining_s=4.0), Preemptible(0, 2.0, "b", remaining_s=4.0)]
    victims, pred = flex_victim(0.0, [chain], long_jobs, 0, 20, siblings=1, deadline=0.7, remaining=[[]])
    assert sorted(v.ref for v in victims) == ["a", "b"] and pred.total_s == pytest.approx(0.42)
    # one choice: the newest job alone
    victims, _ = flex_victim(0.0, [chain], long_jobs, 0, 20, deadline=0.7, remaining=[[]])
    assert [v.ref for v in victims] == ["b"]
    # two choices and one job to pause, the other slot held by a job with a deadline for 4 s: nobody is paused
    assert flex_victim(0.0, [chain], long_jobs[:1], 0, 20, siblings=1, deadline=0.7, remaining=[[4.0]]) is None
    # ... it frees its slot in 0.1 s: one pause is enough
    victims, _ = flex_victim(0.0, [chain], long_jobs[:1], 0, 20, siblings=1, deadline=0.7, remaining=[[0.1]])
    assert [v.ref for v in victims] == ["a"]

    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 20.0)  # the chain's mean job 0.4 s
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.4, capacity=2, spans=((0, 4),))])
        a = await dm.acquire(DispatchJob("a", expected_output=200))  # two jobs of 4 s without deadlines
        b = await dm.acquire(DispatchJob("b", expected_output=200))
        dl = RequestDeadline.from_ms("x", 700, None)
        first = asyncio.ensure_future(dm.acquire(DispatchJob("c0", deadline=dl, output_tokens=20, expected_output=20,
                                                       siblings=1)))
        await asyncio.sleep(0)
        # the first choice pauses one job (the newest) now, there being one more for the second choice
        assert b.preempt and not a.preempt and dm.flex_preemptions == 1 and not first.done()
        dm.release(b)
        await asyncio.sleep(0)
        assert first.done() and first.result().job.job_id == "c0"
        resumed = asyncio.ensure_future(dm.acquire(DispatchJob(job_id="b", requeue=True, yields=True)))
        await asyncio.sleep(0)
        assert not resumed.done()
        # the second choice, after the first's prefill: it pauses the other job, and gets its slot before the
        # paused job's resumption (with both paused at once, the second slot went to that resumption)
        second = asyncio.ensure_future(dm.acquire(DispatchJob("c1", deadline=dl, output_tokens=20, expected_output=20,
                                                                checked=True)))
        await asyncio.sleep(0)
        assert a.preempt and dm.flex_preemptions == 2 and not second.done()
        dm.release(a)
        await asyncio.sleep(0)
        assert second.done() and second.result().job.job_id == "c1" and not resumed.done()
        resumed.cancel()
        await asyncio.gather(resumed, return_exceptions=True)

    asyncio.run(main())
    # not enough jobs to pause for both choices: the request is refused and nobody is paused
    async def short():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 20.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.4, capacity=2, spans=((0, 4),))])
        a = await dm.acquire(DispatchJob("a", expected_output=200))
        d = await dm.acquire(DispatchJob("d", deadline=RequestDeadline.from_ms("x", 60_000, None),
                                         output_tokens=200, expected_output=200))
        with pytest.raises(DeadlineUnreachable):
            await dm.acquire(DispatchJob("c0", deadline=RequestDeadline.from_ms("x", 700, None), output_tokens=20,
                                         siblings=1))
        assert not a.preempt and not d.preempt and dm.flex_preemptions == 0

    asyncio.run(short())


def test_flex_pauses_for_several_choices_across_chains():
    """An ``n`` = 2 request with one pausable job on each of two chains was refused: the pauses were looked for on
    one chain only. Now one per chain does, the first on the fastest chain (where the first choice goes), judged at
    the slowest one's pace."""
    one = ChainLoad(capacity=1, active=1, job_s=0.4, step_s=0.02)
    jobs = [Preemptible(0, 1.0, "a", remaining_s=4.0), Preemptible(1, 2.0, "b", remaining_s=4.0)]
    # both choices on one chain, one after the other: 2 x 21 steps of 0.02 s miss 0.7 s; side by side they meet it
    victims, pred = flex_victim(0.0, [one, one], jobs, 0, 20, siblings=1, deadline=0.7, remaining=[[], []])
    assert [v.ref for v in victims] == ["a", "b"] and pred.total_s == pytest.approx(0.42)
    # a chain twice as slow takes the second choice 0.84 s: judged at the slower pace, nobody is paused
    slow = ChainLoad(capacity=1, active=1, job_s=0.8, step_s=0.04)
    assert flex_victim(0.0, [slow, one], jobs, 0, 20, siblings=1, deadline=0.7, remaining=[[], []]) is None
    # one choice: one chain's pause is enough, as before
    assert [v.ref for v in flex_victim(0.0, [one, one], jobs, 0, 20, deadline=0.7, remaining=[[], []])[0]] == ["a"]

    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 20.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.4, capacity=1, spans=((0, 4),)),
                       Chain(servers=("b",), blocks=(4,), service_time=0.4, capacity=1, spans=((0, 4),))])
        a = await dm.acquire(DispatchJob("a", expected_output=200))  # one long job without a deadline per chain
        b = await dm.acquire(DispatchJob("b", expected_output=200))
        assert {a.index, b.index} == {0, 1}
        dl = RequestDeadline.from_ms("x", 700, None)
        first = asyncio.ensure_future(dm.acquire(DispatchJob("c0", deadline=dl, output_tokens=20, expected_output=20,
                                                       siblings=1)))
        await asyncio.sleep(0)
        assert sum(x.preempt for x in (a, b)) == 1 and dm.flex_preemptions == 1 and dm.deadline_refused == 0
        gave, kept = (a, b) if a.preempt else (b, a)
        dm.release(gave)
        await asyncio.sleep(0)
        assert first.done() and first.result().index == gave.index
        second = asyncio.ensure_future(dm.acquire(DispatchJob("c1", deadline=dl, output_tokens=20, expected_output=20,
                                                                checked=True)))
        await asyncio.sleep(0)
        assert kept.preempt and dm.flex_preemptions == 2  # the second choice pauses the other chain's job
        dm.release(kept)
        await asyncio.sleep(0)
        assert second.done() and second.result().index == kept.index

    asyncio.run(main())


def test_flex_dispatch_pauses_a_job_without_deadline_and_requeues_it_after_the_deadlines():
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)  # step 0.1 s, a job 1.7 s
        dm.set_chains(_chains())
        background = await dm.acquire(_job(0))  # no deadline: preemptible
        later = asyncio.ensure_future(dm.acquire(_job(1)))  # another without one, queued
        await asyncio.sleep(0)
        # a first token within 300 ms: doomed behind the running job (edf refuses), met with its slot (flex)
        urgent = asyncio.ensure_future(dm.acquire(_job(2, RequestDeadline.from_ms("x", None, 300))))
        await asyncio.sleep(0)
        assert not urgent.done() and background.preempt and dm.flex_preemptions == 1 and dm.deadline_refused == 0
        # the paused job gives its slot back (at its next step) and queues again: after the deadline job, before
        # the job without one that arrived before it was paused
        dm.release(background)
        await asyncio.sleep(0)
        assert urgent.done() and urgent.result().job.job_id == "j2"
        resumed = asyncio.ensure_future(dm.acquire(DispatchJob(job_id="j0", requeue=True, yields=True)))
        await asyncio.sleep(0)
        dm.release(urgent.result())
        await asyncio.sleep(0)
        assert resumed.done() and not later.done()
        # a second doomed job finds nothing to pause but the resumed job... which has no deadline either: paused
        again = asyncio.ensure_future(dm.acquire(_job(3, RequestDeadline.from_ms("x", None, 300))))
        await asyncio.sleep(0)
        assert resumed.result().preempt and dm.flex_preemptions == 2
        # a job with a deadline is never paused: a third urgent one behind the second is refused
        with pytest.raises(DeadlineUnreachable):
            await dm.acquire(_job(4, RequestDeadline.from_ms("x", None, 300)))
        for t in (later, again):
            t.cancel()
        await asyncio.gather(later, again, return_exceptions=True)

    asyncio.run(main())


def test_flex_leaves_the_running_job_alone_when_the_deadline_job_is_refused_for_a_full_queue():
    """A deadline job that flex would pause a running job for, but that the full queue refuses: the running job is
    not paused (it was: a round trip, perhaps a recompute, for a job that never ran)."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 10.0, max_queue=0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        running = await dm.acquire(_job(0))
        with pytest.raises(QueueFull):
            await dm.acquire(DispatchJob("j1", deadline=RequestDeadline.from_ms("x", 800, None), output_tokens=5))
        assert not running.preempt and dm.flex_preemptions == 0 and dm.refused == 1

    asyncio.run(main())


def _chain_holder(acquire):
    """A ChainHolder whose orchestrator's dispatcher is ``acquire`` (what the job asks a chain of, and how)."""
    import types

    from petals_chain.orchestrator.dispatch import ChainPrefixes
    from petals_chain.orchestrator.failover import ChainHolder

    orch = types.SimpleNamespace(cfg=types.SimpleNamespace(queue_timeout_s=5.0, output_reserve_tokens=0),
                                 dispatch=types.SimpleNamespace(acquire=acquire), auditor=None,
                                 prefix_directory=ChainPrefixes(), model_id="m", deadlines=DeadlineBook(),
                                 replay_cache=types.SimpleNamespace(new=lambda: types.SimpleNamespace(
                                     clear=lambda: None, close=lambda: None)))
    return ChainHolder(orch, "j", 64)


def test_a_deadline_job_refused_for_a_full_queue_is_refused_not_missed():
    from petals_chain.orchestrator.core import RequestError

    async def acquire(job):
        raise QueueFull(0)

    async def main():
        dl = RequestDeadline.from_ms("x", 3000, None)
        DEADLINE.set(dl)
        with pytest.raises(RequestError):
            await _chain_holder(acquire)._ensure_chain([1, 2, 3], 3)
        return dl.outcome

    assert asyncio.run(main()) == "refused"


def test_a_deadline_job_back_in_the_queue_keeps_its_deadline():
    """A job re-queued after a failover, a preemption or a pause is still a deadline job: flex never pauses it
    for another deadline job. (It re-queued without its deadline: preemptible, and queued behind every deadline
    job once paused.)"""
    seen = []

    class Captured(Exception):
        pass

    async def acquire(job):
        seen.append(job)
        raise Captured()

    async def main():
        dl = RequestDeadline.from_ms("x", 3000, None)
        DEADLINE.set(dl)
        holder = _chain_holder(acquire)
        for admitted in (False, True):  # a new job, then the same job back after a failover
            holder.admitted = admitted
            with pytest.raises(Captured):
                await holder._ensure_chain([1, 2, 3], 3)
        assert [j.requeue for j in seen] == [False, True] and all(j.deadline is dl for j in seen)
        assert not seen[1].preemptible

    asyncio.run(main())


@pytest.mark.parametrize("paused", [False, True])
def test_a_re_plan_gives_its_new_slots_in_deadline_order(paused):
    """A re-plan that adds a slot starts the waiting job a freed slot would start: the deadline job, not the one
    without a deadline that arrived first, nor a job paused for deadlines from the re-queue lane (both took it)."""
    async def main():
        a = Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))
        dm = DispatchManager(schedule="flex" if paused else "edf")
        dm.set_chains([a])
        running = await dm.acquire(_job(0))
        if paused:
            first = asyncio.ensure_future(dm.acquire(DispatchJob(job_id="paused", requeue=True, yields=True)))
        else:
            first = asyncio.ensure_future(dm.acquire(_job(1)))
        await asyncio.sleep(0)
        urgent = asyncio.ensure_future(dm.acquire(DispatchJob(
            "urgent", deadline=RequestDeadline.from_ms("x", 10_000, None, best_effort=True), output_tokens=1)))
        await asyncio.sleep(0)
        dm.set_chains([a, Chain(servers=("b",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        await asyncio.sleep(0)
        assert urgent.done() and not first.done()
        dm.release(running)
        await asyncio.sleep(0)
        assert first.done()

    asyncio.run(main())


def test_edf_needs_the_central_queue_and_no_fairness_policy():
    with pytest.raises(ValueError, match="central queue"):
        DispatchManager(policy="jsq", schedule="edf")
    with pytest.raises(ValueError, match="--schedule"):
        DispatchManager(schedule="flexible")


def test_deadline_outcomes_report_and_goodput():
    book = DeadlineBook(window_s=10.0)
    a = RequestDeadline.from_ms("alice", 1000, 200, arrival=0.0)
    a.first_token(0.1)
    book.settle(a, now=0.9)
    b = RequestDeadline.from_ms("alice", 1000, 200, arrival=0.0)
    b.first_token(0.3)  # first token late
    book.settle(b, now=0.5)
    c = RequestDeadline.from_ms("bob", 500, None, arrival=0.0)
    book.settle(c, "refused", now=0.0)
    book.settle(c, now=1.0)  # decided once
    assert (a.outcome, b.outcome, c.outcome) == ("met", "missed", "refused")
    rep = a.report()
    assert rep["deadline_ms"] == 1000 and rep["ttft_deadline_ms"] == 200 and rep["ttft_ms"] == 100 and rep["met"]
    assert b.report()["ttft_met"] is False
    j = book.json(now=1.0)
    assert j["met"] == 1 and j["missed"] == 1 and j["refused"] == 1 and j["attainment"] == pytest.approx(1 / 3)
    assert j["clients"]["alice"]["attainment"] == 0.5 and j["clients"]["bob"]["met"] == 0
    assert book.goodput(now=1.0) == pytest.approx(0.1) and book.goodput(now=20.0) == 0
    none = RequestDeadline.from_ms("x", None, None)
    assert not none.active and none.drop_at == math.inf
    book.settle(none, now=1.0)
    assert none.outcome is None  # no deadline: not counted


def test_a_queued_job_is_dropped_at_the_first_of_its_deadlines():
    dl = RequestDeadline.from_ms("x", 1500, 600_000, arrival=10.0)
    assert dl.drop_at == pytest.approx(11.5)  # it was the TTFT deadline's, ten minutes on, whenever one was set
    assert RequestDeadline.from_ms("x", 600_000, 1500, arrival=10.0).drop_at == pytest.approx(11.5)
    assert RequestDeadline.from_ms("x", 1500, None, best_effort=True, arrival=10.0).drop_at == math.inf


def test_the_first_choice_of_n_is_predicted_for_them_all_and_the_others_are_not_refused():
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)  # step 0.1 s, a job 1.7 s, one slot
        dm.set_chains(_chains())
        # a free slot and 1.7 s of work: one choice meets 2.5 s, two in a row (the second after the first) do not
        single = asyncio.ensure_future(dm.acquire(_job(0, RequestDeadline.from_ms("x", 2_500, None))))
        await asyncio.sleep(0)
        assert single.done() and not single.exception()
        dm.release(single.result())
        with pytest.raises(DeadlineUnreachable):  # refused before any work, not after the prefill's stream opened
            await dm.acquire(DispatchJob(job_id="n0", deadline=RequestDeadline.from_ms("x", 2_500, None),
                                         output_tokens=16, siblings=1))
        # a later choice of an admitted request waits for a slot however late it is now
        first = await dm.acquire(_job(1))
        later = asyncio.ensure_future(dm.acquire(DispatchJob(
            job_id="n1", deadline=RequestDeadline.from_ms("x", None, 1), output_tokens=16, checked=True)))
        await asyncio.sleep(0)
        assert not later.done() and dm.queue_length == 1 and dm.deadline_refused == 1
        dm.release(first)
        await asyncio.sleep(0)
        assert later.done() and not later.exception()

    asyncio.run(main())


def test_key_file_deadline_defaults(tmp_path):
    f = tmp_path / "keys"
    f.write_text("slo " + "k" * 20 + " ttft_deadline_ms=500 deadline_ms=4000\n")
    key = KeyRing.from_file(f).get("slo")
    assert (key.deadline_ms, key.ttft_deadline_ms) == (4000, 500)
    f.write_text("slo " + "k" * 20 + " deadline_ms=0\n")
    with pytest.raises(KeyFileError, match="deadline_ms"):
        KeyRing.from_file(f)
    # a deadline past an hour (400 digits overflowed float() at every request of the key) is the file's error
    for big in ("3600001", "9" * 18):
        f.write_text("slo " + "k" * 20 + f" deadline_ms={big}\n")
        with pytest.raises(KeyFileError, match="largest value"):
            KeyRing.from_file(f)
    for bad in ("9" * 5000, "²", "٣"):  # int() raised ValueError past 4300 digits; "²".isdigit() is True
        f.write_text("slo " + "k" * 20 + f" deadline_ms={bad}\n")
        with pytest.raises(KeyFileError, match="invalid limit"):
            KeyRing.from_file(f)


def test_flex_and_db_never_pick_an_idle_held_session_to_pause():
    """A session holding its chain between turns steps no more: marked to pause, it gave nothing back until its
    next turn, and the slot it stood for was counted as promised (flex: the deadline job waited and was dropped;
    db: no running job was paused)."""
    one = [Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=2, spans=((0, 4),))]

    async def flex():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 17.0)
        dm.set_chains(one)
        session = await dm.acquire(_job(0))
        session.job.idle = True  # between turns, holding its chain
        running = await dm.acquire(_job(1))
        urgent = asyncio.ensure_future(dm.acquire(_job(2, RequestDeadline.from_ms("x", None, 300))))
        await asyncio.sleep(0)
        assert running.preempt and not session.preempt
        urgent.cancel()
        await asyncio.gather(urgent, return_exceptions=True)

    async def db():
        dm = DispatchManager(schedule="db", classes=1)
        dm.set_chains(one)
        session = await dm.acquire(DispatchJob("s", sched=dm.new_priority_job("s", "m")))
        running = await dm.acquire(DispatchJob("r", sched=dm.new_priority_job("r", "m")))
        session.keeps_kv = running.keeps_kv = True
        for _ in range(3):
            dm.charge(session, 1.0)  # its turns so far: the worst priority
        dm.charge(running, 1.2)
        session.job.idle = True
        new = asyncio.ensure_future(dm.acquire(DispatchJob("n", sched=dm.new_priority_job("n", "m"))))
        await asyncio.sleep(0)
        assert running.preempt and not session.preempt
        new.cancel()
        await asyncio.gather(new, return_exceptions=True)

    asyncio.run(flex())
    asyncio.run(db())


def test_a_paused_job_at_the_head_of_the_re_queue_lane_does_not_hold_back_the_jobs_behind_it():
    def dl(ms):
        return RequestDeadline.from_ms("x", ms, None, best_effort=True)

    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 10.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=1.0, capacity=1, spans=((0, 4),))])
        running = await dm.acquire(DispatchJob("R", deadline=dl(60_000), output_tokens=4))
        paused = asyncio.ensure_future(dm.acquire(DispatchJob("P", requeue=True, yields=True)))
        back = asyncio.ensure_future(dm.acquire(DispatchJob("F", requeue=True, deadline=dl(5_000), output_tokens=4)))
        await asyncio.sleep(0)
        new = asyncio.ensure_future(dm.acquire(DispatchJob("N", deadline=dl(30_000), output_tokens=4)))
        await asyncio.sleep(0)
        dm.release(running)
        await asyncio.sleep(0)
        assert [t.result().job.job_id for t in (paused, back, new) if t.done()] == ["F"]  # not N (later deadline)
        for t in (paused, new):
            t.cancel()
        await asyncio.gather(paused, new, return_exceptions=True)

    asyncio.run(main())


def test_a_slot_an_idle_session_holds_is_not_counted_on_by_the_prediction():
    """The only slot held by a session between turns: a job whose deadline needs that slot was admitted (the
    prediction expected the slot back at the queue's rate), waited, and was dropped at its deadline (504); it is
    refused at once now (429)."""
    async def main(schedule):
        dm = DispatchManager(schedule=schedule, steps_per_job=lambda: 17.0)
        dm.set_chains(_chains())
        session = await dm.acquire(_job(0))
        session.job.idle = True
        with pytest.raises(DeadlineUnreachable):
            await asyncio.wait_for(dm.acquire(_job(1, RequestDeadline.from_ms("x", 5_000, None))), 2.0)
        session.job.idle = False  # its next turn: it steps, and frees the slot when done
        late = asyncio.ensure_future(dm.acquire(_job(2, RequestDeadline.from_ms("x", 5_000, None))))
        await asyncio.sleep(0)
        assert not late.done()  # admitted, waiting
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)

    for schedule in ("edf", "flex"):
        asyncio.run(main(schedule))


def test_a_best_effort_request_is_late_or_not_once_for_all_its_prompts():
    """The prompts of one request share its deadline; each prompt's first job re-decided ``late``, so a job queued
    at the early key stayed there after a later prompt found the request late (ahead of a job that could make it)."""
    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)  # one slot, a job 1.7 s
        dm.set_chains(_chains())
        running = await dm.acquire(_job(0))
        dl = RequestDeadline.from_ms("be", 4_000, None, best_effort=True)  # one request, two prompts
        p1 = asyncio.ensure_future(dm.acquire(_job(1, dl)))
        await asyncio.sleep(0)
        p2 = asyncio.ensure_future(dm.acquire(_job(2, dl)))
        await asyncio.sleep(0)
        assert dl.late_decided and [entry[0] for entry in dm.dispatcher.queue._entries] == [dl.order_key] * 2
        c = asyncio.ensure_future(dm.acquire(_job(3, RequestDeadline.from_ms("ok", 20_000, None))))
        await asyncio.sleep(0)
        dm.release(running)
        await asyncio.sleep(0)
        assert p1.done() and not c.done()  # as its key said when it was queued
        for f in (p2, c):
            f.cancel()
        await asyncio.gather(p2, c, return_exceptions=True)

    asyncio.run(main())


def test_a_later_choice_waits_when_the_queue_is_full():
    async def main():
        dm = DispatchManager(schedule="edf", max_queue=0, steps_per_job=lambda: 17.0)
        dm.set_chains(_chains())
        first = await dm.acquire(_job(0))
        with pytest.raises(QueueFull):  # a new request is refused ...
            await dm.acquire(_job(1))
        later = asyncio.ensure_future(dm.acquire(DispatchJob(job_id="n1", output_tokens=16, checked=True)))
        await asyncio.sleep(0)
        assert not later.done() and dm.refused == 1  # ... a later choice of an admitted one waits
        dm.release(first)
        await asyncio.sleep(0)
        assert later.done() and not later.exception()

    asyncio.run(main())


def test_a_request_no_chain_served_is_refused_not_missed():
    """With no chain a request with a deadline now waits --no-chain-wait-s, then gets a 503: it never ran, so its
    outcome is refused (it read missed, lowering its client's attainment for an outage)."""
    import types

    from petals_chain.orchestrator.core import Unavailable
    from petals_chain.orchestrator.dispatch import ChainPrefixes
    from petals_chain.orchestrator.failover import ChainHolder

    async def main():
        cfg = types.SimpleNamespace(queue_timeout_s=60.0, output_reserve_tokens=0, no_chain_wait_s=0.1)
        orch = types.SimpleNamespace(cfg=cfg, dispatch=DispatchManager(schedule="edf"), auditor=None,
                                     prefix_directory=ChainPrefixes(), model_id="m", deadlines=DeadlineBook(),
                                     replay_cache=types.SimpleNamespace(new=lambda: types.SimpleNamespace(
                                         clear=lambda: None, close=lambda: None)))
        dl = RequestDeadline.from_ms("x", 600_000, None)
        DEADLINE.set(dl)
        with pytest.raises(Unavailable):
            await ChainHolder(orch, "j", 64)._ensure_chain([1, 2, 3], 3)
        return dl.outcome

    assert asyncio.run(main()) == "refused"


def test_a_request_that_never_held_a_chain_is_not_charged_nor_failed(tiny_model_factory, tmp_path):
    """A key's tokens per minute paid the prompts of requests the dispatcher refused (doomed, queue full) or dropped
    at their deadline while queued, which computed nothing, and each counted as a failed request: two refusals of a
    40-token prompt used 80 of a key's 100 tokens, and the third request was refused for ``tokens_per_minute``. Now
    such a request is counted ``unserved`` and charged nothing; a session's refused turn alike."""
    import httpx

    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    keys = tmp_path / "keys"
    keys.write_text("alice alice-secret-0123456789 tokens_per_minute=100\n")
    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=128, port=0,
                                           api_keys=str(keys), schedule="edf"))
    orch.load_model()
    app = create_app(orch)
    key = {"Authorization": "Bearer alice-secret-0123456789"}
    prompt = list(range(10, 50))  # 40 tokens

    async def main():
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.7, capacity=1, spans=((0, 2),))])
        await orch.dispatch.acquire(DispatchJob(job_id="holder"))  # the chain's one slot is busy
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as c:
            body = {"model": orch.model_id, "prompt": prompt, "max_tokens": 5}
            for extra in ({"ttft_deadline_ms": 1}, {"ttft_deadline_ms": 1, "n": 2}, {"ttft_deadline_ms": 1}):
                r = await c.post("/v1/completions", headers=key, json={**body, **extra})
                # 1 ms: less than the first token takes on an idle chain, so refused for good
                assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible", r.text
            r = await c.post("/v1/completions", headers=key, json={**body, "ttft_deadline_ms": 2500})  # queued
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
            s = (await c.post("/api/v1/sessions", headers=key, json={})).json()["session_id"]
            r = await c.post(f"/api/v1/sessions/{s}/generate", headers=key,
                             json={"input_ids": prompt, "max_tokens": 5, "ttft_deadline_ms": 1})
            assert r.status_code == 429, r.text
            assert orch.stats.tokens_last_minute("alice") == 0
            alice = {x["name"]: x for x in (await c.get("/api/v1/swarm")).json()["clients"]}["alice"]
            assert (alice["failed"], alice["completed"], alice["tokens"]) == (0, 0, 0) and alice["unserved"] == 6, alice
            measured = (await c.get("/api/v1/swarm")).json()["measured"]
            assert measured["failed"] == 0 and measured["unserved"] == 6
            assert 'petals_chain_requests_total{outcome="unserved"} 6.0' in (await c.get("/metrics")).text

    asyncio.run(main())


def test_flex_for_n_choices_counts_the_slots_its_own_choices_free():
    """Review of the change above: more choices than slots were never met by the pessimistic view (the last
    choice's slot was one nobody frees) though each choice frees its slot for the next."""
    chain = ChainLoad(capacity=2, active=2, job_s=0.4, step_s=0.02)
    long_jobs = [Preemptible(0, 1.0, "a", remaining_s=4.0), Preemptible(0, 2.0, "b", remaining_s=4.0)]
    victims, pred = flex_victim(0.0, [chain], long_jobs, 0, 20, siblings=2, deadline=1.0, remaining=[[]])
    assert sorted(v.ref for v in victims) == ["a", "b"] and pred.total_s == pytest.approx(0.84)


def test_a_later_choice_pauses_only_for_the_requests_last_token():
    """A later choice of ``n`` paused a job for the request's first-token deadline, which the first choice had met;
    one back in the queue after a failover paused one too (a first choice never does)."""
    async def main():
        dm = DispatchManager(schedule="flex", steps_per_job=lambda: 20.0)
        dm.set_chains([Chain(servers=("a",), blocks=(4,), service_time=0.4, capacity=2, spans=((0, 4),))])
        a = await dm.acquire(DispatchJob("a", expected_output=200))
        ttft_only = RequestDeadline.from_ms("x", None, 300)
        later = asyncio.ensure_future(dm.acquire(DispatchJob("c1", deadline=ttft_only, output_tokens=20,
                                                             expected_output=20, checked=True)))
        await asyncio.sleep(0)
        assert later.done()  # the free slot
        dm.release(later.result())
        b = await dm.acquire(DispatchJob("b", expected_output=200))
        ttft_only2 = RequestDeadline.from_ms("x", None, 300)
        waiting = asyncio.ensure_future(dm.acquire(DispatchJob("d1", deadline=ttft_only2, output_tokens=20,
                                                               expected_output=20, checked=True)))
        both = RequestDeadline.from_ms("x", 700, None)
        requeued = asyncio.ensure_future(dm.acquire(DispatchJob("e1", deadline=both, output_tokens=20,
                                                                expected_output=20, checked=True, requeue=True)))
        await asyncio.sleep(0)
        assert not a.preempt and not b.preempt and dm.flex_preemptions == 0
        for t in (waiting, requeued):
            t.cancel()
        await asyncio.gather(waiting, requeued, return_exceptions=True)

    asyncio.run(main())


def test_a_prompt_waiting_when_another_gives_the_first_token_waits_on_to_deadline_ms():
    """A multi-prompt request (one deadline shared): its second prompt's job waits for a chain while the first
    prompt's job gives the request its first token; the wait began with the TTFT deadline as its end, and was
    dropped there with a 504 though only ``deadline_ms`` was left to miss (review). It now waits on and gets the
    chain freed at 0.6 s (``deadline_ms`` 3000, ``ttft_deadline_ms`` 300)."""

    class GotChain(Exception):
        pass

    async def full(job):
        raise QueueFull(0)

    async def main():
        from petals_chain.orchestrator.core import RequestError

        with pytest.raises(RequestError):  # the first wait's lazy imports (~1 s) out of the timed part
            await _chain_holder(full)._ensure_chain([1, 2, 3], 3)
        dl = RequestDeadline.from_ms("x", 3000, 300)
        DEADLINE.set(dl)
        gate = asyncio.Event()

        async def acquire(job):
            await gate.wait()
            raise GotChain

        async def other_prompt():
            await asyncio.sleep(0.1)
            dl.first_token()
            await asyncio.sleep(0.5)
            gate.set()

        other = asyncio.ensure_future(other_prompt())
        with pytest.raises(GotChain):
            await _chain_holder(acquire)._ensure_chain([1, 2, 3], 3)
        await other

    asyncio.run(main())
