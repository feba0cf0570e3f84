"""BPRR baseline (Sun, He, Ji, Parag 2025): CG-BP placement with target concurrency ``R`` + WS-RR routing.

CG-BP (our reading of the prior work's Alg. 1, steps 1-2): every server hosts
``m_j = min(L, floor(M_j / (s_m + s_c R)))`` blocks; servers are placed by ascending amortized time
``t~_j = tau_p_j + tau_c_j / m_j``, each at the window that most needs coverage: the most blocks whose
cache count ``C_b`` is still below ``R``; among those, the window whose sorted cache counts are
lexicographically smallest; then the smallest start. A placed server adds
``floor(M~_j / m_j)`` (its cache slots per hosted block) to ``C_b`` of its blocks.

WS-RR: per request, the shortest route where a hop costs ``tau_c_j + tau_p_j m_ij`` plus the server's
expected wait when it has fewer than ``m_ij`` free slots.

No prefix locality: the prior work routes each request on service times, free slots and waits alone (it has no
cache of prompt prefixes shared across requests), so this baseline takes no preferred chain or server
(``DispatchJob.prefer`` is not used by ``orchestrator/routed.py``; the simulator's jobs carry no prefix at all).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from petals_chain.algorithms.baselines.routing import Hop, _free_array, _placed_servers, min_cost_route
from petals_chain.model import ModelSpec, Placement, ServerSpec


def cg_bp_placement(servers: Sequence[ServerSpec], model: ModelSpec, R: int) -> Placement:
    """CG-BP block placement for target concurrency ``R`` (see module doc)."""
    if int(R) != R or R < 1:
        raise ValueError(f"R must be a positive integer, got {R!r}")
    L = model.num_blocks
    cand = []
    for idx, s in enumerate(servers):
        m = s.max_blocks(model, int(R))
        if m >= 1:
            cand.append((s.tau_p + s.tau_c / m, idx, s, m))
    cand.sort(key=lambda x: (x[0], x[1]))
    counts = np.zeros(L, dtype=np.int64)
    spans = {}
    for _, _, s, m in cand:
        under = (counts < R).astype(np.int64)
        n_under = np.convolve(under, np.ones(m, dtype=np.int64), mode="valid")  # per start 0..L-m
        best_n = n_under.max()
        best = None
        for i in np.nonzero(n_under == best_n)[0].tolist():
            key = sorted(counts[i:i + m].tolist())
            if best is None or key < best[0]:
                best = (key, i)
        start = best[1]
        counts[start:start + m] += s.residual_slots(model, m) // m
        spans[s.name] = (start, m)
    return Placement(spans, num_blocks=L)


def ws_rr_route(servers: Sequence[ServerSpec], model: ModelSpec, placement: Mapping[str, tuple[int, int]],
                free_slots: Mapping[str, int], expected_wait: Mapping[str, float]) -> list[Hop]:
    """WS-RR route for one request; raises ValueError if the blocks are not covered."""
    names, specs, a, m = _placed_servers(servers, model, placement)
    base = np.array([s.tau_c for s in specs], dtype=float)
    per_block = np.array([s.tau_p for s in specs], dtype=float)
    wait = np.array([float(expected_wait.get(n, 0.0)) for n in names], dtype=float)
    if len(wait) and (wait.min() < 0 or not np.isfinite(wait).all()):
        raise ValueError("expected_wait must be finite and >= 0")
    route = min_cost_route(names, a, a + m, model.num_blocks, base, per_block, wait,
                           _free_array(names, free_slots))
    if route is None:
        raise ValueError("the placement does not cover every block: no route")
    return route
