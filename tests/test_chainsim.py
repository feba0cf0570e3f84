"""The chain simulator's step cost fitted from completed requests (algorithms/chainsim.py), as the orchestrator's
placer fits it from its history before replaying that history (``--placement-index simulated``)."""

from __future__ import annotations

import random

import pytest

from petals_chain.algorithms.chainsim import MM_COST, StepCost


def samples(cost: StepCost, n: int, *, batches=(1, 2, 4, 8), inputs=(5, 50, 400), outputs=(1, 64), noise: float = 0.0,
            seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i, o, bt = rng.choice(inputs), rng.randint(*outputs), rng.choice(batches)
        t = o * cost.a + cost.b * i + cost.d * o * bt
        out.append((i, o, t * (1 + rng.uniform(-noise, noise)), bt))
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
    for i, o in ((5, 1), (400, 30)):  # and what was seen is predicted
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
