"""The chain simulator's step cost fitted from completed requests (algorithms/chainsim.py), as the orchestrator's
placer fits it from its history before replaying that history (``--placement-index simulated``)."""

from __future__ import annotations

import random
import statistics

import pytest

from petals_chain.algorithms.chainsim import MM_COST, MMRequest, StepCost, exec_alone, simulate, summarize
from petals_chain.algorithms.multimodel import ServedModel, Volunteer


def samples(cost: StepCost, n: int, *, batches=(1, 2, 4, 8), inputs=(5, 50, 400), outputs=(1, 64), noise: float = 0.0,
            seed: int = 0):
    """Requests as a chain serves them: ``o`` steps, each with ``batch - 1`` others whose prompts are prefilled
    over their own outputs' worth of steps (the model :meth:`StepCost.fit` assumes)."""
    rng = random.Random(seed)
    shapes = [(rng.choice(inputs), rng.randint(*outputs), rng.choice(batches)) for _ in range(n)]
    per_step = statistics.fmean(i for i, _, _ in shapes) / statistics.fmean(o for _, o, _ in shapes)
    out = []
    for i, o, bt in shapes:
        out.append((i, o, cost.request_s(i, o, bt, per_step) * (1 + rng.uniform(-noise, noise)), bt))
    return out


def test_fit_recovers_the_step_cost_from_requests_at_several_batch_sizes():
    true = StepCost(a=0.05, b=0.0004, d=0.006)
    got = StepCost.fit(samples(true, 200))
    assert (got.a, got.b, got.d) == pytest.approx((true.a, true.b, true.d), rel=1e-6)
    noisy = StepCost.fit(samples(true, 400, noise=0.1, seed=1))
    assert noisy.a == pytest.approx(true.a, rel=0.1) and noisy.d == pytest.approx(true.d, rel=0.2)
    assert noisy.b == pytest.approx(true.b, rel=0.3)


def test_what_the_requests_cannot_tell_apart_keeps_the_priors_ratio():
    true = StepCost(a=0.05, b=0.0004, d=0.006)
    # every request alone: a step's cost is seen, not how it grows with the batch
    got = StepCost.fit(samples(true, 100, batches=(1,)))
    prior = MM_COST
    assert got.d / got.a == pytest.approx(prior.d / prior.a)
    assert got.b == pytest.approx(true.b, rel=1e-6)  # one prompt length or several: a request's own constant
    for i, o in ((5, 1), (400, 30)):  # and what was seen is predicted (alone: no one else's prompt)
        assert o * got.a + got.b * i + got.d * o == pytest.approx(o * true.a + true.b * i + true.d * o, rel=1e-6)
    # every request alone and no prompt: nothing tells the prefill apart, b keeps the ratio too
    got = StepCost.fit(samples(true, 100, batches=(1,), inputs=(0,)))
    assert got.b / got.a == pytest.approx(prior.b / prior.a) and got.d / got.a == pytest.approx(prior.d / prior.a)


def test_requests_all_of_one_length_fit_the_batch_cost_and_keep_the_prompts_ratio():
    """The real-process test's traffic: one prompt, one output length, batches of 1-3 (a swarm's closed-loop
    clients). The prompt's share cannot be told from the steps'; a fit that gave the whole time to the prompt
    (``a`` = 0, as the first fit did here) is not a step cost."""
    true = StepCost(a=0.05, b=0.0004, d=0.006)
    got = StepCost.fit(samples(true, 60, inputs=(5,), outputs=(20, 20), batches=(1, 2, 3), noise=0.05))
    assert got is not None and got.a > 0
    assert got.b / got.a == pytest.approx(MM_COST.b / MM_COST.a)
    for batch in (1, 3):  # what a request of that shape costs, as seen
        want = 20 * true.a + true.b * 5 + true.d * 20 * batch
        assert 20 * got.a + got.b * 5 + got.d * 20 * batch == pytest.approx(want, rel=0.1)


def test_too_few_or_unusable_samples_give_no_fit():
    assert StepCost.fit(samples(MM_COST, 7)) is None
    assert StepCost.fit([(5, 0, 1.0, 1)] * 20) is None  # no output token: not a request the model explains
    assert StepCost.fit([(5, 10, float("nan"), 1)] * 20) is None


def test_a_cost_fitted_on_a_simulated_chains_requests_predicts_that_chain():
    """The run-time loop in the simulator: requests served by continuous batching (each step also carries the
    prefills of requests admitted into it, which no sample states) give the samples the orchestrator records;
    the cost fitted on them replays the same requests with normalized latency and SLO attainment close to the
    true cost's."""
    rng = random.Random(3)
    true = StepCost(a=0.03, b=0.0002, d=0.004)
    reqs, t = [], 0.0
    for k in range(400):
        t += rng.expovariate(6.0)
        inp, out = rng.choice((20, 200, 800)), rng.randint(4, 60)
        reqs.append(MMRequest(k, "m", t, inp, out, exec_alone(inp, out, true)))
    model = ServedModel("m", 2, 1.0, 0.01, 0.5, rate=6.0, c=8)
    servers = [Volunteer("s0", 4.0), Volunteer("s1", 4.0)]
    plan = {"s0": "m", "s1": "m"}
    ran = simulate(reqs, [model], servers, plan, "fcfs", cost=true, max_batch=8).requests
    got = StepCost.fit((r.input, r.output, r.finished - r.admitted, r.batch_steps / r.output) for r in ran)
    assert 1.5 < statistics.fmean(r.batch_steps / r.output for r in ran) < 8  # batches of several sizes
    again = [MMRequest(r.rid, "m", r.arrival, r.input, r.output, exec_alone(r.input, r.output, got)) for r in reqs]
    fitted = summarize(simulate(again, [model], servers, plan, "fcfs", cost=got, max_batch=8).requests)
    truth = summarize(ran)
    assert fitted["norm_latency"] == pytest.approx(truth["norm_latency"], rel=0.15), (got, fitted, truth)
    assert fitted["slo_attainment"] == pytest.approx(truth["slo_attainment"], abs=0.05), (got, fitted, truth)
