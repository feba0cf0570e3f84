"""Theorem 3.7 bounds and the exact K=2 analysis (App. A.3) against a direct CTMC solution."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.sparse import lil_matrix
from scipy.sparse.linalg import spsolve

from petals_chain.algorithms import exact_k2_response_time, response_time_bounds

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ctmc_jffc_k2(mu1, c1, mu2, c2, lam, q_max=None):
    """Mean response time of JFFC with 2 chains by solving the truncated CTMC (independent of A.3)."""
    nu = c1 * mu1 + c2 * mu2
    rho = lam / nu
    if q_max is None:
        q_max = int(math.log(1e-14) / math.log(rho)) + 10 if rho > 0 else 10
    states = [(0, z1, z2) for z1 in range(c1 + 1) for z2 in range(c2 + 1)] + \
             [(q, c1, c2) for q in range(1, q_max + 1)]
    index = {s: i for i, s in enumerate(states)}
    n = len(states)
    Q = lil_matrix((n, n))
    for s, i in index.items():
        q, z1, z2 = s
        out = []
        if q == 0 and z1 < c1:
            out.append(((0, z1 + 1, z2), lam))
        elif q == 0 and z2 < c2:
            out.append(((0, z1, z2 + 1), lam))
        elif q < q_max:
            out.append(((q + 1, c1, c2), lam))
        if q > 0:
            out.append(((q - 1, c1, c2), nu))
        else:
            if z1 > 0:
                out.append(((0, z1 - 1, z2), z1 * mu1))
            if z2 > 0:
                out.append(((0, z1, z2 - 1), z2 * mu2))
        for t, r in out:
            Q[i, index[t]] += r
            Q[i, i] -= r
    A = Q.T.tocsr().tolil()
    A[0, :] = 1.0  # replace one balance equation by normalization
    b = np.zeros(n)
    b[0] = 1.0
    pi = spsolve(A.tocsr(), b)
    occupancy = np.array([q + z1 + z2 for q, z1, z2 in states], dtype=float)
    return float(pi @ occupancy) / lam


def _mmc_response(mu, c, lam):
    """M/M/c mean response time (Erlang C)."""
    a = lam / mu
    rho = a / c
    terms = sum(a ** k / math.factorial(k) for k in range(c))
    last = a ** c / (math.factorial(c) * (1 - rho))
    p_wait = last / (terms + last)
    return p_wait / (c * mu - lam) + 1 / mu


@SETTINGS
@given(mu1=st.floats(0.05, 5.0), mu2=st.floats(0.05, 5.0), c1=st.integers(1, 12), c2=st.integers(1, 12),
       load=st.floats(0.01, 0.97))
def test_bounds_sandwich_exact_k2(mu1, mu2, c1, c2, load):
    lam = load * (c1 * mu1 + c2 * mu2)
    exact = exact_k2_response_time(mu1, c1, mu2, c2, lam)
    lower, upper = response_time_bounds([(mu1, c1), (mu2, c2)], lam)
    assert math.isfinite(exact)
    tol = 1e-9 * upper
    assert lower - tol <= exact <= upper + tol


@settings(max_examples=40, deadline=None)
@given(mu1=st.floats(0.1, 3.0), mu2=st.floats(0.1, 3.0), c1=st.integers(1, 6), c2=st.integers(1, 6),
       load=st.floats(0.05, 0.9))
def test_exact_k2_matches_ctmc(mu1, mu2, c1, c2, load):
    lam = load * (c1 * mu1 + c2 * mu2)
    fast, slow = ((mu1, c1), (mu2, c2)) if mu1 >= mu2 else ((mu2, c2), (mu1, c1))
    want = _ctmc_jffc_k2(fast[0], fast[1], slow[0], slow[1], lam)
    assert exact_k2_response_time(mu1, c1, mu2, c2, lam) == pytest.approx(want, rel=1e-7)


def test_exact_k2_known_values_and_errors():
    # lower bound is tight when the fast chain dominates; equal rates reduce to M/M/(c1+c2)
    assert exact_k2_response_time(1.0, 2, 1.0, 3, 3.0) == pytest.approx(_mmc_response(1.0, 5, 3.0), rel=1e-10)
    assert exact_k2_response_time(2.0, 1, 1.0, 1, 3.0) == math.inf
    with pytest.raises(ValueError):
        exact_k2_response_time(0.0, 1, 1.0, 1, 0.5)
    with pytest.raises(ValueError):
        exact_k2_response_time(1.0, 0, 1.0, 1, 0.5)
    # large capacities stay finite (rescaled recursion)
    v = exact_k2_response_time(1.0, 60, 0.5, 60, 80.0)
    lo, hi = response_time_bounds([(1.0, 60), (0.5, 60)], 80.0)
    assert math.isfinite(v) and lo - 1e-9 <= v <= hi + 1e-9


@settings(max_examples=60, deadline=None)
@given(mu=st.floats(0.01, 10.0), c=st.integers(1, 40), load=st.floats(0.01, 0.99))
def test_single_chain_bounds_equal_mmc(mu, c, load):
    lam = load * c * mu
    lower, upper = response_time_bounds([(mu, c)], lam)
    want = _mmc_response(mu, c, lam)
    assert lower == pytest.approx(want, rel=1e-9)
    assert upper == pytest.approx(want, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(chains=st.lists(st.tuples(st.floats(0.01, 2.0), st.integers(1, 400)), min_size=1, max_size=30),
       load=st.floats(0.001, 0.999))
def test_bounds_finite_for_large_C_and_ordered(chains, load):
    nu = sum(mu * c for mu, c in chains)
    lam = load * nu
    lower, upper = response_time_bounds(chains, lam)
    assert math.isfinite(lower) and math.isfinite(upper)
    fastest = max(mu for mu, _ in chains)
    slowest = min(mu for mu, _ in chains)
    assert 1 / fastest * (1 - 1e-9) <= lower <= upper * (1 + 1e-12)
    # the upper bound never beats an idle system on the slowest chain
    assert upper >= 1 / slowest * (1 - 1e-9) or load > 0


def test_bounds_thousands_of_slots_and_edge_cases():
    chains = [(1 / (8 + 0.01 * k), 50) for k in range(100)]  # C = 5000
    nu = sum(mu * c for mu, c in chains)
    for load in (0.1, 0.7, 0.99, 0.9999):
        lo, hi = response_time_bounds(chains, load * nu)
        assert math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi
    assert response_time_bounds(chains, nu * (1 + 1e-12)) == (math.inf, math.inf)
    assert response_time_bounds(chains, 2 * nu) == (math.inf, math.inf)
    assert response_time_bounds([], 0.1) == (math.inf, math.inf)
    assert response_time_bounds([(2.0, 1), (0.5, 1)], 0.0) == (0.5, 2.0)
    assert response_time_bounds([(2.0, 0), (0.5, 1)], 0.1)[0] > 1.9  # zero-capacity chains ignored
    # order of the input does not matter
    assert response_time_bounds([(0.5, 3), (2.0, 1)], 1.0) == response_time_bounds([(2.0, 1), (0.5, 3)], 1.0)
    with pytest.raises(ValueError):
        response_time_bounds([(1.0, 1)], -1.0)
    with pytest.raises(ValueError):
        response_time_bounds([(1.0, 1.5)], 0.1)
    with pytest.raises(ValueError):
        response_time_bounds([1.0], 0.1)


@settings(max_examples=25, deadline=None)
@given(mu1=st.floats(0.05, 5.0), mu2=st.floats(0.05, 5.0), c1=st.integers(20, 120), c2=st.integers(1, 120),
       load=st.floats(0.01, 0.995))
def test_exact_k2_large_capacities_stable(mu1, mu2, c1, c2, load):
    """Where the paper's recursion (52) cancels, the level-reduction solve stays between the bounds."""
    lam = load * (c1 * mu1 + c2 * mu2)
    exact = exact_k2_response_time(mu1, c1, mu2, c2, lam)
    lower, upper = response_time_bounds([(mu1, c1), (mu2, c2)], lam)
    assert lower * (1 - 1e-9) <= exact <= upper * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(mu1=st.floats(0.1, 3.0), mu2=st.floats(0.1, 3.0), c1=st.integers(1, 10), c2=st.integers(1, 10),
       load=st.floats(0.02, 0.95))
def test_exact_k2_recursion_and_level_reduction_agree(mu1, mu2, c1, c2, load):
    lam = load * (c1 * mu1 + c2 * mu2)
    a = exact_k2_response_time(mu1, c1, mu2, c2, lam, method="recursion")
    b = exact_k2_response_time(mu1, c1, mu2, c2, lam, method="linear")
    assert a == pytest.approx(b, rel=1e-8)


def test_bounds_huge_capacity_truncation_matches_exact_sum():
    """Beyond 2^16 slots the sum is truncated where terms are negligible; compare with a full sum."""
    import petals_chain.algorithms.bounds as b

    chains = [(10.0, 300_000), (3.0, 200_000), (0.5, 100)]
    for lam in (1.0, 50.0, 4000.0):
        got = response_time_bounds(chains, lam)
        old = b._EXACT_C
        b._EXACT_C = 10**7
        try:
            want = response_time_bounds(chains, lam)
        finally:
            b._EXACT_C = old
        assert got == pytest.approx(want, rel=1e-12)
        assert math.isfinite(got[0]) and got[0] <= got[1]
