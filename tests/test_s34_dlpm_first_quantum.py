"""DLPM's adaptive quantum before any request's cost is seen (session 34).

The first refill after a start gave the first client the whole prior (``quantum_prior``, 2048 units) as credit where
a request cost 60: a heavy client's burst then ran 36 requests before a light client's first one, at every restart.
The first refill is now sized from the requests waiting, by the rule that sizes the later ones."""

from __future__ import annotations

import pytest

from petals_chain.algorithms.fairness import FairDispatcher, FairnessConfig, FairPolicy, FairRequest


class Job:
    def __init__(self, client: str, tokens: int = 20, out: int = 20, matched: dict | None = None):
        self.client, self.tokens, self.out, self.matched = client, tokens, out, matched or {}


def describe(job: Job) -> FairRequest:
    return FairRequest(item=job, client=job.client, input_tokens=job.tokens, matched=job.matched,
                       expected_output=job.out)


@pytest.mark.parametrize("policy", ["dlpm", "d2lpm"])
def test_a_heavy_burst_after_a_start_does_not_run_ahead_of_a_light_clients_first_request(policy):
    """One slot; 40 requests of a heavy client (cost 20 + 2 x 20 = 60 units each), then one of a light client:
    served in deficit round robin from the first round (before: 36 heavy requests went first)."""
    pol = FairPolicy(policy)  # the default: adaptive quantum
    d = FairDispatcher([(1.0, 1)], pol, describe)
    running = [job for job in [Job("heavy") for _ in range(40)] if d.arrive(job) is not None]
    assert pol.local(0 if pol.distributed else None).deficit["heavy"] == pytest.approx(60.0 - 20.0)  # one request's
    light = Job("light")
    assert d.arrive(light) is None
    order = []
    while running:
        job = running.pop()
        pol.output(job.client, 0, job.out)
        nxt = d.complete(0)
        if nxt is not None:
            order.append(nxt.client)
            running.append(nxt)
    assert len(order) == 40
    assert order.index("light") <= 1, order


def test_the_first_quantum_follows_the_waiting_requests_rule_and_the_prior_bounds_it():
    cfg = FairnessConfig()
    q = FairPolicy("dlpm", cfg).quantum
    assert q.value == cfg.quantum_prior  # nothing seen, nothing waiting
    reqs = [FairRequest(item=i, client="a", input_tokens=100, expected_output=n, matched={0: 50})
            for i, n in enumerate((5, 10, 400))]
    # median full cost 100 + 2 x 10, half the input cached on worker 0: factor 1 + 3 x 0.5 = 2.5
    assert q.for_queue(reqs, 0) == pytest.approx(2.5 * 120.0)
    assert q.for_queue(reqs, 1) == pytest.approx(120.0)  # nothing cached on worker 1: one median request
    assert q.value == pytest.approx(120.0)  # reported as used
    huge = [FairRequest(item=0, client="a", input_tokens=9000, expected_output=500)]
    assert q.for_queue(huge, 0) == cfg.quantum_prior  # at most the prior
    assert q.for_queue([], 0) == cfg.quantum_prior == q.value  # none waiting: the last sized one
    sized = FairPolicy("dlpm", cfg).quantum
    assert sized.for_queue(reqs[:1], 1) == pytest.approx(110.0) == sized.for_queue([], 0) == sized.value
    # once a request was admitted the window's median rules, whatever waits
    pol = FairPolicy("dlpm", cfg)
    pol.admit(FairRequest(item=0, client="a", input_tokens=30, expected_output=10), 0)
    assert pol.quantum.for_queue(huge, 0) == pytest.approx(50.0) == pol.quantum.value
    fixed = FairPolicy("dlpm", FairnessConfig(quantum=7.0)).quantum
    assert fixed.for_queue(reqs, 0) == 7.0  # a fixed quantum stays

