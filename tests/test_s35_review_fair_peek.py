"""Review of the per-chain deadline admission (session 35, ``cb09130``): the prediction reads the chain a request
would be bound to (:meth:`FairDispatcher.peek_binding` / :meth:`FairPolicy.peek_worker`) and must change nothing.
The commit's tests would not notice a peek that refilled D2LPM's worker credits: the arrival right after sees the
credit and skips its own refill, so the binding is the same; but a request the prediction refuses (429
``deadline_unreachable``) never arrives, and its client kept the refill."""

from __future__ import annotations

import asyncio
import itertools
import pickle
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from petals_chain.algorithms.fairness import FairDispatcher, FairnessConfig, FairPolicy, FairRequest
from petals_chain.model import Chain
from petals_chain.orchestrator.deadlines import RequestDeadline
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, DispatchManager
from petals_chain.orchestrator.fairness import ClientShares


def _state(pol: FairPolicy) -> bytes:
    """Everything a binding or an arrival may change, comparable by value."""
    local = sorted((repr(w), sorted(loc.snapshot().items())) for w, loc in pol._local.items())
    return pickle.dumps((sorted(pol.worker_credit.items(), key=repr), pol._rr, sorted(pol._rr_client.items()),
                         local, pol.quantum._value, list(pol.quantum._costs), sorted(pol.service.items()),
                         sorted(pol.admitted_requests.items())))


def _describe(job: SimpleNamespace) -> FairRequest:
    return FairRequest(item=job, client=job.client, input_tokens=job.input_tokens, matched=job.matched,
                       expected_output=job.expected_output)


@pytest.mark.parametrize("policy", ["d2lpm", "d-vtc", "rr-lpm"])
def test_peek_binding_names_the_arrivals_chain_and_changes_nothing(policy):
    """Random histories on chains of 0 to 2 slots (capacity-0 chains among them), D2LPM's worker quantum below one
    request's input so that its refills come often: before each arrival the peek leaves the policy as it was and
    names the chain the arrival is then bound to (None exactly when it starts at once)."""
    refills = peeks = 0
    for seed in range(40):
        rng = random.Random(seed)
        caps = [rng.choice([0, 1, 2]) for _ in range(rng.randint(2, 4))]
        caps[rng.randrange(len(caps))] = 1
        pol = FairPolicy(policy, FairnessConfig(quantum=rng.uniform(5, 100), worker_quantum=rng.uniform(1, 30)))
        d = FairDispatcher([(rng.choice([0.5, 1.0, 2.0]), c) for c in caps], pol, _describe)
        ids, running = itertools.count(), []
        for _ in range(60):
            if rng.random() < 0.65 or not running:
                job = SimpleNamespace(id=next(ids), client=f"c{rng.randrange(4)}", input_tokens=rng.choice([5, 40]),
                                      matched={rng.randrange(len(caps)): 8} if rng.random() < 0.4 else {},
                                      expected_output=4)
                req = _describe(job)
                cands = [d.workers[k] for k in d._order]
                refills += policy == "d2lpm" and all(pol.worker_credit.get((job.client, w), 0.0) <= 0 for w in cands)
                before = _state(pol)
                found = d.peek_binding(req)
                assert _state(pol) == before, f"seed {seed}: the peek changed the policy"
                k = d.arrive(job)
                if k is not None:
                    running.append(k)
                    assert found is None, f"seed {seed}: started at once on chain {k}, peek said {found}"
                else:
                    peeks += 1
                    assert found is not None and d.workers[found[0]] == d.request_of(job).worker, f"seed {seed}"
                    assert [r.item for r in found[1]] == [r.item for r in d._waiting.values()
                                                          if r.worker == d.request_of(job).worker][:-1]
            else:
                k = running.pop(rng.randrange(len(running)))
                pol.output(f"c{rng.randrange(4)}", d.workers[k], 3)
                if d.complete(k) is not None:
                    running.append(k)
    assert peeks > 200 and (policy != "d2lpm" or refills > 50), (peeks, refills)  # the branches were exercised


@pytest.mark.parametrize("policy", ["d2lpm", "d-vtc"])
def test_a_request_refused_by_its_deadline_leaves_the_fairness_policy_as_it_was(policy):
    """One slot busy, the heavy client A's backlog queued, its worker credit spent (each request's 20 input tokens
    take the 20-unit quantum it was refilled by): A's deadline request is refused (429 deadline_unreachable) and
    the policy is as before: no credit refill (d2lpm), no turn of the round robin (d-vtc)."""
    async def main():
        pol = FairPolicy(policy, FairnessConfig(quantum=60.0, worker_quantum=20.0))
        shares = ClientShares(pol, registry=CollectorRegistry(), keyed=True)
        dm = DispatchManager(policy="jffc", shares=shares, steps_per_job=lambda: 17.0)
        dm.set_chains([Chain(servers=(f"s{i}",), blocks=(4,), service_time=1.7, capacity=1, spans=((0, 4),))
                       for i in range(2)])
        leases = [await dm.acquire(DispatchJob(f"r{i}", client="A", input_tokens=20, expected_output=16))
                  for i in range(2)]
        heavy = [asyncio.ensure_future(dm.acquire(DispatchJob(f"a{i}", client="A", input_tokens=20,
                                                               expected_output=16))) for i in range(20)]
        await asyncio.sleep(0)
        assert dm.queue_length == 20
        if policy == "d2lpm":
            assert all(v <= 0 for (c, _), v in pol.worker_credit.items() if c == "A")  # a peek would refill
        before = _state(pol)
        for _ in range(3):  # retried, as a client does
            late = DispatchJob("a-late", client="A", input_tokens=20, expected_output=16,
                               deadline=RequestDeadline.from_ms("A", 8_000, None))
            with pytest.raises(DeadlineUnreachable):
                await dm.acquire(late)
        assert _state(pol) == before
        for t in heavy:
            t.cancel()
        await asyncio.gather(*heavy, return_exceptions=True)
        for lease in leases:
            dm.release(lease)

    asyncio.run(main())
