"""Response-time analysis of JFFC: Theorem 3.7 bounds (Eq. 28-32) and exact K=2 (App. A.3, Eq. 46-53)."""

from __future__ import annotations

import math
from typing import Iterable

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


def _first_slot_rates(mu: np.ndarray, c: np.ndarray, N: int) -> np.ndarray:
    """Rates of the first ``N`` slots when chains (in the given order) fill one after another."""
    before = np.cumsum(c) - c
    return np.repeat(mu, np.clip(N - before, 0, c))


_EXACT_C = 1 << 16  # up to this many slots every term is summed
_NEGLIGIBLE = 80.0  # log-weight drop below the maximum that ends the sum (e^-80 ~ 1.8e-35)
_WINDOW_MAX = 1 << 22  # most terms summed around the mode for a huge C (a few 32 MiB arrays)


def _mean_occupancy(mu: np.ndarray, c: np.ndarray, arrival_rate: float, nu: float) -> float:
    """Mean of the birth-death chain of Eq. 30-32: death rate ``nu_n`` = sum of the first ``n`` slot
    rates (chains filled in the given order) for n <= C, ``nu`` beyond C (geometric tail).

    Log-weights ``log w_n = sum_{i<=n} log(lambda/nu_i)`` are shifted by their maximum. Up to ``_EXACT_C``
    slots every term is summed; beyond, only a window around the mode (see :func:`_window_occupancy`).
    """
    C = int(c.sum())
    if C > _EXACT_C:
        return _window_occupancy(mu, c, arrival_rate, nu)
    rho = arrival_rate / nu
    death = np.cumsum(_first_slot_rates(mu, c, C))
    logw = np.concatenate(([0.0], np.cumsum(math.log(arrival_rate) - np.log(death))))
    w = np.exp(logw - logw.max())
    n = np.arange(C + 1, dtype=float)
    tail = w[C] / (1.0 - rho)  # sum_{n>=C} w_C rho^(n-C)
    norm = w[:C].sum() + tail
    mean = (n[:C] * w[:C]).sum() + w[C] * (rho / (1.0 - rho) ** 2 + C / (1.0 - rho))
    return float(mean / norm)


def _window_occupancy(mu: np.ndarray, c: np.ndarray, lam: float, nu: float) -> float:
    """:func:`_mean_occupancy` for a huge ``C``: the terms summed from the mode outwards until what is left on
    each side is below ``e^-80`` of the mode's (the weights are log-concave, so both sides shrink at least
    geometrically), and the geometric tail exactly if the window reaches ``C``. Summing from ``n = 0`` allocated
    gigabytes for 1e9 slots at a high load (the mode near ``C``); the window is about
    ``sqrt(160 lambda / mu)`` terms, and more than ``_WINDOW_MAX`` of them is refused with a ValueError."""
    ends = np.cumsum(c)
    starts = ends - c
    rates = np.cumsum(mu * c)
    base = rates - mu * c  # death rate of the slots before each chain's

    def death(n: np.ndarray) -> np.ndarray:  # nu_n for 1 <= n <= C, in closed form (piecewise linear in n)
        k = np.searchsorted(ends, n, side="left")
        return base[k] + (n - starts[k]) * mu[k]

    log_lam, C = math.log(lam), int(ends[-1])
    # the mode: the last n with nu_n < lambda (weights grow up to it, shrink after it)
    k = min(int(np.searchsorted(rates, lam, side="left")), len(c) - 1)
    peak = int(starts[k]) + min(max(math.ceil((lam - float(base[k])) / float(mu[k])) - 1, 0), int(c[k]))
    parts: dict[int, list[np.ndarray]] = {1: [], -1: []}  # log(lambda / nu_n) of the n summed right and left
    lo = hi = peak
    for side in (1, -1):
        drop, step = 0.0, 4096  # drop: log w at the window's edge relative to the mode's
        while (hi < C) if side == 1 else (lo > 0):
            m = min(step, C - hi) if side == 1 else min(step, lo)
            n = np.arange(hi + 1, hi + m + 1, dtype=np.int64) if side == 1 else \
                np.arange(lo - m + 1, lo + 1, dtype=np.int64)
            s = log_lam - np.log(death(n))
            parts[side].append(s)
            if side == 1:
                hi += m
                drop += float(s.sum())
                r = lam / float(death(np.array([hi]))[0]) if hi < C else 0.0  # the next terms' ratio, at most
            else:
                lo -= m
                drop -= float(s.sum())
                r = float(death(np.array([lo]))[0]) / lam if lo > 0 else 0.0
            if hi - lo > _WINDOW_MAX:
                raise ValueError(f"Theorem 3.7 bounds: more than {_WINDOW_MAX} states of the birth-death chain "
                                 f"carry weight at arrival rate {lam:g} ({C} slots, total rate {nu:g}); too many "
                                 "to sum")
            # left over beyond the edge: at most w_edge r / (1 - r)
            if r < 1.0 and (r == 0.0 or drop + math.log(r) - math.log1p(-r) < -_NEGLIGIBLE):
                break
            step *= 2
    steps = np.concatenate(parts[-1][::-1] + parts[1])  # log(lambda / nu_n) for n = lo+1 .. hi (left: outwards)
    logw = np.concatenate(([0.0], np.cumsum(steps)))
    w = np.exp(logw - logw.max())
    n = np.arange(lo, hi + 1, dtype=float)
    if hi < C:
        return float((n * w).sum() / w.sum())
    rho = lam / nu
    norm = w[:-1].sum() + w[-1] / (1.0 - rho)
    mean = (n[:-1] * w[:-1]).sum() + w[-1] * (rho / (1.0 - rho) ** 2 + C / (1.0 - rho))
    return float(mean / norm)


def response_time_bounds(chains: Iterable[tuple[float, int]], arrival_rate: float) -> tuple[float, float]:
    """Theorem 3.7 lower and upper bounds on JFFC's mean response time (seconds) via Little's law.

    ``chains`` are ``(mu_k, c_k)`` pairs in any order. The lower bound uses the death rates of jobs
    on the fastest chains first (Eq. 28), the upper bound slowest first (Eq. 29); both are
    birth-death chains with a geometric tail of ratio ``rho = lambda/nu`` above ``C = sum c_k``.
    Returns ``(inf, inf)`` when ``rho >= 1`` or there is no chain; for ``arrival_rate == 0`` the
    limits ``1/mu_fastest`` and ``1/mu_slowest``.
    """
    return _bounds(chains, arrival_rate, upper=True)


def response_time_lower_bound(chains: Iterable[tuple[float, int]], arrival_rate: float) -> float:
    """``response_time_bounds(chains, arrival_rate)[0]`` (the same number) without the upper bound's work."""
    return _bounds(chains, arrival_rate, upper=False)[0]


def _bounds(chains: Iterable[tuple[float, int]], arrival_rate: float, upper: bool) -> tuple[float, float]:
    """:func:`response_time_bounds`; with ``upper`` False the upper bound is left as nan (not computed)."""
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
    lower = _mean_occupancy(mu, c, lam, nu) / lam  # fastest chains first: nu_bar_n, Eq. 28
    if not upper:
        return lower, math.nan
    upper_bound = _mean_occupancy(mu[::-1], c[::-1], lam, nu) / lam  # slowest first: nu_underbar_n, Eq. 29
    return lower, upper_bound


def _k2_check(mu1: float, c1: int, mu2: float, c2: int, lam: float) -> tuple[float, float, int, int, float]:
    for name, v in (("mu1", mu1), ("mu2", mu2)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be positive and finite, got {v!r}")
    for name, v in (("c1", c1), ("c2", c2)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"arrival_rate must be positive and finite, got {lam!r}")
    mu1, mu2, c1, c2 = float(mu1), float(mu2), int(c1), int(c2)
    if mu2 > mu1:
        mu1, mu2, c1, c2 = mu2, mu1, c2, c1
    return mu1, c1, mu2, c2, float(lam)


def _k2_recursion(mu1: float, c1: int, mu2: float, c2: int, lam: float) -> np.ndarray:
    """``alpha[z2, z1] = pi_{0,z1,z2} / pi_{0,0,c2}`` by Eq. 46-52, each level scaled to max 1 (returned with
    the per-level log scale folded in relative to the largest level)."""
    alpha = np.zeros((c2 + 1, c1 + 1))
    log_scale = np.zeros(c2 + 1)
    top = alpha[c2]
    top[0] = 1.0  # alpha_{0,0,c2} = 1
    for n in range(1, c1 + 1):  # Eq. 46
        top[n] = (c2 * mu2 * top[:n].sum() + lam * top[n - 1]) / (n * mu1)
    for z2 in range(c2 - 1, -1, -1):
        up_cum = np.cumsum(alpha[z2 + 1])  # sum_{i<n} alpha_{0,i,z2+1} = up_cum[n-1]
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
        level = beta * ((a_c1 - gamma[c1]) / beta[c1]) + gamma  # Eq. 52, then alpha_{0,n,z2}
        level[c1] = a_c1
        # the recursion is linear in the level above, so levels can be rescaled as they are produced
        s = float(np.abs(level).max())
        if not (s > 0 and math.isfinite(s)):
            raise FloatingPointError("K=2 recursion broke down")
        alpha[z2] = level / s
        log_scale[z2] = log_scale[z2 + 1] + math.log(s)
    return alpha * np.exp(log_scale - log_scale.max())[:, None]


def _level_eliminate(row_c1: np.ndarray, slack: float, lam: float, mu1: float, source: float):
    """Subtraction-free elimination (GTH style) of one level's states ``z1 = c1, ..., 1``.

    Off-diagonal rates inside the level: ``z1 -> z1+1`` at ``lam`` (``z1 < c1``), ``z1 -> z1-1`` at
    ``z1 mu1``, plus ``row_c1[l]`` from ``c1`` to ``l`` (returns via the level above); every state also
    leaves the level for good at rate ``slack``. Solves ``x^T M = source e_{c1}^T`` for the M-matrix
    ``M`` (diagonal = total outflow). Returns ``(diag, b)``: pivots ``M_kk`` and right-hand sides at
    elimination time, from which ``x_k = (b_k + lam x_{k-1}) / M_kk``. Only row ``k-1`` fills in when
    ``k`` is eliminated, so one level costs O(c1^2).
    """
    c1 = len(row_c1) - 1
    R = row_c1[:c1].astype(float).copy()  # current row k, entries l < k
    R[c1 - 1] += c1 * mu1
    sl = np.full(c1 + 1, float(slack))
    b = np.zeros(c1 + 1)
    b[c1] = source
    diag = np.zeros(c1 + 1)
    for k in range(c1, 0, -1):
        mkk = sl[k] + R.sum()
        diag[k] = mkk
        if k > 1:
            b[:k] += R * (b[k] / mkk)
            R_new = R[:k - 1] * (lam / mkk)
            R_new[k - 2] += (k - 1) * mu1
        else:
            b[0] += R[0] * (b[1] / mkk)
            R_new = R[:0]
        sl[k - 1] += lam * sl[k] / mkk
        R = R_new
    diag[0] = sl[0]
    return diag, b


def _k2_linear(mu1: float, c1: int, mu2: float, c2: int, lam: float) -> np.ndarray:
    """Same ``alpha`` (up to a factor) by linear level reduction over ``z2`` (levels of ``c1+1`` states).

    A level is left upwards only from ``z1 = c1`` (an arrival joining chain 2), so
    ``pi_{z2} = pi_{z2-1}[c1] x_{z2}`` with ``x_{z2}^T M_{z2} = lambda e_{c1}^T`` (``M_{z2}`` the
    level's M-matrix including returns from above); level 0 is a censored chain. Everything is solved by
    subtraction-free elimination, so there is no cancellation. The queue tail above ``(0, c1, c2)``
    balances its own arrivals (Eq. 47), so the arrival out of the full state is left out.
    """
    n = c1 + 1
    x = [None] * (c2 + 1)
    w = np.zeros(n)  # return rates from the level above into each state (none above the top level)
    for z2 in range(c2, 0, -1):
        # x_{z2}^T M_{z2} = lam e_{c1}^T: states leave the level for good at z2 mu2 (a chain-2 completion)
        diag, b = _level_eliminate(w, z2 * mu2, lam, mu1, lam)
        xz = np.zeros(n)
        xz[0] = b[0] / diag[0]
        for k in range(1, n):
            xz[k] = (b[k] + lam * xz[k - 1]) / diag[k]
        x[z2] = xz
        w = z2 * mu2 * xz  # returns into level z2 - 1 (they sum to lam)
    # level 0: censored chain (no slack); unnormalized pi_k = pi_{k-1} lam / out_k, in logs
    diag, _ = _level_eliminate(w, 0.0, lam, mu1, 0.0)
    log_level0 = np.concatenate(([0.0], np.cumsum(math.log(lam) - np.log(diag[1:]))))
    levels = np.zeros((c2 + 1, n))
    log_scale = np.zeros(c2 + 1)
    top = log_level0.max()
    levels[0] = np.exp(log_level0 - top)
    log_scale[0] = top
    for z2 in range(1, c2 + 1):
        v = levels[z2 - 1][c1] * x[z2]
        m = float(v.max())
        levels[z2] = v / m if m > 0 else v
        log_scale[z2] = log_scale[z2 - 1] + (math.log(m) if m > 0 else 0.0)
    return levels * np.exp(log_scale - log_scale.max())[:, None]


def _k2_residual(alpha: np.ndarray, mu1: float, mu2: float, lam: float) -> float:
    """Relative L1 residual of the balance equations (tail-cut as in ``_k2_linear``) for ``alpha``."""
    c2, c1 = alpha.shape[0] - 1, alpha.shape[1] - 1
    z1 = np.arange(c1 + 1)[None, :]
    z2 = np.arange(c2 + 1)[:, None]
    arr = np.full(alpha.shape, lam)
    arr[c2, c1] = 0.0
    out = alpha * (arr + z1 * mu1 + z2 * mu2)
    inflow = np.zeros_like(alpha)
    inflow[:, 1:] += lam * alpha[:, :-1]  # arrivals to chain 1
    inflow[1:, c1] += lam * alpha[:-1, c1]  # arrivals to chain 2
    inflow[:, :-1] += (z1[:, 1:] * mu1) * alpha[:, 1:]
    inflow[:-1, :] += (z2[1:, :] * mu2) * alpha[1:, :]
    return float(np.abs(inflow - out).sum() / max(out.sum(), 1e-300))


def exact_k2_response_time(mu1: float, c1: int, mu2: float, c2: int, arrival_rate: float,
                           method: str = "auto") -> float:
    """Exact mean response time of JFFC with two chains (App. A.3), in seconds.

    Chain 1 is the faster one (swapped if given otherwise). ``method="recursion"`` evaluates Eq. 46-53
    as in the paper (levels rescaled against overflow); its step (52) cancels catastrophically once
    ``c1`` is in the tens, so ``"auto"`` checks the balance equations and, if the recursion is not
    accurate, solves them by linear level reduction (``"linear"``, O(c2 c1^2), no cancellation).
    Returns inf if ``lambda >= c1 mu1 + c2 mu2``.
    """
    if method not in ("auto", "recursion", "linear"):
        raise ValueError(f"method must be 'auto', 'recursion' or 'linear', got {method!r}")
    mu1, c1, mu2, c2, lam = _k2_check(mu1, c1, mu2, c2, arrival_rate)
    nu = c1 * mu1 + c2 * mu2
    if lam >= nu:
        return math.inf
    alpha = None
    # the recursion loses about a digit per few units of c1; beyond small c1 go straight to "linear"
    if method == "recursion" or (method == "auto" and c1 <= 20):
        try:
            with np.errstate(all="ignore"):
                alpha = _k2_recursion(mu1, c1, mu2, c2, lam)
            if method == "auto" and not (np.all(alpha >= 0) and _k2_residual(alpha, mu1, mu2, lam) < 1e-10):
                alpha = None
        except FloatingPointError:
            if method == "recursion":
                raise
    if alpha is None:
        alpha = _k2_linear(mu1, c1, mu2, c2, lam)
    z = np.arange(c1 + 1)[None, :] + np.arange(c2 + 1)[:, None]
    a_full = alpha[c2, c1]
    tail = lam * a_full / (nu - lam)  # sum_{n>=1} (lambda/nu)^n alpha_{0,c1,c2}, Eq. 47
    num = float((alpha * z).sum()) + tail * (nu / (nu - lam) + c1 + c2)  # Eq. 53
    den = float(alpha.sum()) + tail
    return (num / den) / lam
