"""Per-request routing on the routing DAG of a placement (shared by PETALS and WS-RR routing).

A route enters server ``j`` at boundary ``e`` (``a_j <= e < a_j + m_j``) and leaves it at the end of
its span, so routes are paths of the same DAG GCA uses; the cheapest one is a DP over boundaries.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from petals_chain.model import ModelSpec, ServerSpec

Hop = tuple[str, int, int]  # (server name, start block, end block), 0-based, end exclusive


def _placed_servers(servers: Sequence[ServerSpec], model: ModelSpec, placement: Mapping[str, tuple[int, int]]):
    by_name = {s.name: s for s in servers}
    unknown = [n for n in placement if n not in by_name]
    if unknown:
        raise ValueError(f"placement names servers that are not given: {sorted(unknown)[:5]}")
    names = [s.name for s in servers if s.name in placement]
    a = np.array([placement[n][0] for n in names], dtype=np.int64)
    m = np.array([placement[n][1] for n in names], dtype=np.int64)
    if len(names) and (a.min() < 0 or m.min() < 1 or (a + m).max() > model.num_blocks):
        raise ValueError("placement has a span outside the model's blocks")
    return names, [by_name[n] for n in names], a, m


def min_cost_route(names: Sequence[str], a: np.ndarray, end: np.ndarray, L: int, base: np.ndarray,
                   per_block: np.ndarray, penalty: np.ndarray, free: np.ndarray) -> list[Hop] | None:
    """Cheapest route covering blocks ``0..L-1``; entering ``j`` at ``e`` costs
    ``base_j + per_block_j (end_j - e)`` plus ``penalty_j`` when ``free_j < end_j - e``.

    Ties: the server listed first, then the smallest entry boundary. None if no route exists.
    """
    dist = np.full(L + 1, np.inf)
    dist[0] = 0.0
    via = [None] * (L + 1)
    order = np.lexsort((np.arange(len(a)), end))
    ends_sorted = end[order]
    for E in np.unique(ends_sorted).tolist():
        sel = order[ends_sorted == E]
        a_min = int(a[sel].min())
        d = dist[a_min:E]
        if not np.isfinite(d).any():
            continue
        e = np.arange(a_min, E)
        cost = (d[None, :] + base[sel][:, None] + per_block[sel][:, None] * (E - e)[None, :]
                + np.where(e[None, :] < (E - free[sel])[:, None], penalty[sel][:, None], 0.0))
        cost[e[None, :] < a[sel][:, None]] = np.inf
        flat = int(np.argmin(cost))
        if np.isfinite(cost.flat[flat]):
            row, col = divmod(flat, len(e))
            dist[E] = cost.flat[flat]
            via[E] = (int(sel[row]), a_min + col)
    if not np.isfinite(dist[L]):
        return None
    hops = []
    E = L
    while E > 0:
        j, e = via[E]
        hops.append((names[j], e, E))
        E = e
    hops.reverse()
    return hops


def _free_array(names: Sequence[str], free_slots: Mapping[str, int]) -> np.ndarray:
    missing = [n for n in names if n not in free_slots]
    if missing:
        raise ValueError(f"free_slots lacks servers {missing[:5]}")
    return np.array([int(free_slots[n]) for n in names], dtype=np.int64)


def route_service_time(servers_by_name: Mapping[str, ServerSpec], route: Sequence[Hop]) -> float:
    """Service time of a route: ``sum_j tau_c_j + tau_p_j m_ij`` over its hops (Eq. 2)."""
    total = 0.0
    for name, start, end in route:
        s = servers_by_name[name]
        if end <= start:
            raise ValueError(f"empty hop {name!r} [{start}, {end})")
        total += s.tau_c + s.tau_p * (end - start)
    return total
