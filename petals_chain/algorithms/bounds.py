"""Response-time analysis of JFFC: Theorem 3.7 bounds (Eq. 28-32) and exact K=2 (App. A.3, Eq. 46-53)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np


def _clean_chains(chains: Iterable[tuple[float, int]]) -> tuple[np.ndarray, np.ndarray]:
    mus, caps = [], []
    for item in chains:
        try:
            mu, c = item
        except (TypeError, ValueError):
            raise ValueError(f"each chain must be a (mu_k, c_k) pair, got {item!r}") from None
        mu = float(mu)
        if not (mu >= 0) or math.isnan(mu):
            raise ValueError(f"service rate mu_k must be >= 0, got {mu!r}")
        if int(c) != c or c < 0:
            raise ValueError(f"capacity c_k must be a non-negative integer, got {c!r}")
        if c > 0 and mu > 0:
            mus.append(mu)
            caps.append(int(c))
    return np.asarray(mus, dtype=float), np.asarray(caps, dtype=np.int64)


def _mean_occupancy(death: np.ndarray, arrival_rate: float, nu: float) -> float:
    """Mean of a birth-death chain: rates ``death[n-1]`` for n <= C, ``nu`` beyond C (Eq. 30-32)."""
    C = len(death)
    rho = arrival_rate / nu
    n = np.arange(C + 1, dtype=float)
    # log w_n = sum_{i<=n} log(lambda / nu_i); shifted by the max before exponentiating
    logw = np.concatenate(([0.0], np.cumsum(math.log(arrival_rate) - np.log(death))))
    shift = logw.max()
    w = np.exp(logw - shift)
    tail = w[C] / (1.0 - rho)  # sum_{n>=C} w_C rho^(n-C)
    norm = w[:C].sum() + tail
    mean = (n[:C] * w[:C]).sum() + w[C] * (rho / (1.0 - rho) ** 2 + C / (1.0 - rho))
    return float(mean / norm)


def response_time_bounds(chains: Iterable[tuple[float, int]], arrival_rate: float) -> tuple[float, float]:
    """Theorem 3.7 lower and upper bounds on JFFC's mean response time (seconds) via Little's law.

    ``chains`` are ``(mu_k, c_k)`` pairs in any order. The lower bound uses the death rates of jobs
    on the fastest chains first (Eq. 28), the upper bound slowest first (Eq. 29); both are
    birth-death chains with a geometric tail of ratio ``rho = lambda/nu`` above ``C = sum c_k``.
    Returns ``(inf, inf)`` when ``rho >= 1`` or there is no chain; for ``arrival_rate == 0`` the
    limits ``1/mu_fastest`` and ``1/mu_slowest``.
    """
    lam = float(arrival_rate)
    if not (lam >= 0) or not math.isfinite(lam):
        raise ValueError(f"arrival_rate must be finite and >= 0, got {arrival_rate!r}")
    mu, c = _clean_chains(chains)
    if len(mu) == 0:
        return math.inf, math.inf
    order = np.argsort(-mu, kind="stable")
    mu, c = mu[order], c[order]
    nu = float((mu * c).sum())
    if lam == 0:
        return 1.0 / float(mu[0]), 1.0 / float(mu[-1])
    if lam >= nu:
        return math.inf, math.inf
    slot_rates = np.repeat(mu, c)  # one entry per concurrent slot, fastest first
    fast_first = np.cumsum(slot_rates)  # nu_bar_n, Eq. 28
    slow_first = np.cumsum(slot_rates[::-1])  # nu_underbar_n, Eq. 29
    lower = _mean_occupancy(fast_first, lam, nu) / lam
    upper = _mean_occupancy(slow_first, lam, nu) / lam
    return lower, upper


def exact_k2_response_time(mu1: float, c1: int, mu2: float, c2: int, arrival_rate: float) -> float:
    """Exact mean response time of JFFC with two chains (App. A.3, Eq. 46-53), in seconds.

    Chain 1 is the faster one (swapped if given otherwise). Coefficients ``alpha`` relative to state
    ``(0, 0, c2)`` follow the recursion (46)-(52) level by level in ``z2``; levels are rescaled as they
    are produced so long recursions do not overflow. Returns inf if ``lambda >= c1 mu1 + c2 mu2``.
    """
    lam = float(arrival_rate)
    for name, v in (("mu1", mu1), ("mu2", mu2)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be positive and finite, got {v!r}")
    for name, v in (("c1", c1), ("c2", c2)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"arrival_rate must be positive and finite, got {arrival_rate!r}")
    mu1, mu2, c1, c2 = float(mu1), float(mu2), int(c1), int(c2)
    if mu2 > mu1:
        mu1, mu2, c1, c2 = mu2, mu1, c2, c1
    nu = c1 * mu1 + c2 * mu2
    if lam >= nu:
        return math.inf
    # alpha[z2] is the vector (alpha_{0,i,z2})_{i=0..c1}; log_scale[z2] its common log factor
    alpha = [None] * (c2 + 1)
    log_scale = [0.0] * (c2 + 1)
    top = np.zeros(c1 + 1)
    top[0] = 1.0  # alpha_{0,0,c2} = 1
    for n in range(1, c1 + 1):  # Eq. 46
        top[n] = (c2 * mu2 * top[:n].sum() + lam * top[n - 1]) / (n * mu1)
    alpha[c2] = top
    for z2 in range(c2 - 1, -1, -1):
        up = alpha[z2 + 1]
        up_cum = np.cumsum(up)  # sum_{i<n} alpha_{0,i,z2+1} = up_cum[n-1]
        a_c1 = (z2 + 1) * mu2 / lam * up_cum[-1]  # Eq. 48
        beta = np.zeros(c1 + 1)
        gamma = np.zeros(c1 + 1)
        beta[0] = 1.0
        sb = sg = 0.0
        for n in range(1, c1 + 1):  # Eq. 50-51
            sb += beta[n - 1]
            sg += gamma[n - 1]
            beta[n] = (z2 * mu2 * sb + lam * beta[n - 1]) / (n * mu1)
            gamma[n] = (z2 * mu2 * sg + lam * gamma[n - 1] - (z2 + 1) * mu2 * up_cum[n - 1]) / (n * mu1)
        a00 = (a_c1 - gamma[c1]) / beta[c1]  # Eq. 52
        level = beta * a00 + gamma
        level[c1] = a_c1
        # keep magnitudes in range: the level is expressed relative to the level above it
        s = float(np.abs(level).max())
        if s > 0 and (s > 1e100 or s < 1e-100):
            level = level / s
            log_scale[z2] = log_scale[z2 + 1] + math.log(s)
            # later levels are computed from this one, so they inherit its scale
        else:
            log_scale[z2] = log_scale[z2 + 1]
        alpha[z2] = level
    ref = max(log_scale)
    num = 0.0
    den = 0.0
    z1 = np.arange(c1 + 1)
    for z2 in range(c2 + 1):
        f = math.exp(log_scale[z2] - ref)
        num += f * float((alpha[z2] * (z1 + z2)).sum())
        den += f * float(alpha[z2].sum())
    a_full = alpha[c2][c1] * math.exp(log_scale[c2] - ref)
    tail = lam * a_full / (nu - lam)  # sum_{n>=1} (lambda/nu)^n alpha_{0,c1,c2}, Eq. 47
    num += tail * (nu / (nu - lam) + c1 + c2)  # Eq. 53
    den += tail
    return (num / den) / lam
