"""GCA: Greedy Cache Allocation (Alg. 2) as repeated shortest paths on the routing DAG.

Link ``i -> j`` exists iff ``a_j <= a_i + m_i <= a_j + m_j - 1`` (0-based) and then ``j`` processes
``m_ij = a_j + m_j - (a_i + m_i)`` blocks at cost ``tau_c_j + tau_p_j m_ij`` (Eq. 2). Every link moves
the boundary ``e = a_i + m_i`` (blocks covered so far) strictly forward, so the graph is a DAG and the
cost-to-go from ``i`` depends only on ``e``: a shortest ``j0 -> j_{J+1}`` path is a dynamic program
over boundaries ``0..L`` (``j0`` ends at 0, ``j_{J+1}`` is entered from boundary ``L``). A link into
``j`` is usable only while ``j`` has ``>= m_ij`` residual slots (Eq. 3), i.e. for boundaries
``e >= a_j + m_j - M_j``; since slots only decrease, recomputing that test each round drops every
link whose head lacks ``m_ij`` slots, on the last path or not (Alg. 2, lines 9-12, applied globally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from petals_chain.model import Chain, ModelSpec, ServerSpec

# residual slots counted at most: more jobs than any server holds, far below int64's limit (a server record announcing
# 10**30 slots overflowed it: every planner refresh raised, and the plan stopped following the swarm)
SLOTS_MAX = 2 ** 40


@dataclass
class _Group:
    """Servers whose span ends at the same boundary ``E``."""

    E: int
    idx: np.ndarray  # server indices (into the arrays given to _RoutingDAG)
    a: np.ndarray
    tau_c: np.ndarray
    tau_p: np.ndarray
    cols: np.ndarray  # candidate entry boundaries e < E (0 and span ends) with e >= min a_j
    base: np.ndarray  # tau_c_j + tau_p_j (E - e) per (server, column); inf where e < a_j
    e_rel: np.ndarray  # E - e per column


class _RoutingDAG:
    """Routing graph of a placement with mutable residual slots; shortest paths by DP over boundaries.

    GCA asks for a shortest path after every allocation, which only lowers the slots of that chain's servers. Slots
    only decrease, so links only disappear and ``dist`` only grows: a boundary's minimum (and its first-listed argmin,
    the tie rule) stays as it was unless its argmin link lost the slots it needs or the ``dist`` it enters from grew.
    :meth:`shortest_path` re-solves only those boundaries (in boundary order, so a change propagates), which gives the
    same paths as the full DP at a fraction of its cost (it was O(groups x servers) numpy work per chain: seconds per
    GCA with hundreds of servers and chains). Any slot that grew (not GCA's use) falls back to the full DP.
    """

    def __init__(self, a: np.ndarray, m: np.ndarray, slots: np.ndarray, tau_c: np.ndarray,
                 tau_p: np.ndarray, L: int):
        self.L = int(L)
        self.a = np.asarray(a, dtype=np.int64)
        self.m = np.asarray(m, dtype=np.int64)
        self.end = self.a + self.m
        self.slots = np.asarray(slots, dtype=np.int64).copy()
        self.tau_c = np.asarray(tau_c, dtype=float)
        self.tau_p = np.asarray(tau_p, dtype=float)
        self.groups: list[_Group] = []
        # dist is finite only at 0 and at span ends, so only those boundaries are candidate entries
        boundaries = np.unique(np.concatenate(([0], self.end)))
        order = np.lexsort((np.arange(len(self.a)), self.end))  # by end, then input order
        ends = self.end[order]
        for E in np.unique(ends).tolist():
            sel = order[ends == E]
            a_sel = self.a[sel]
            e = boundaries[(boundaries >= a_sel.min()) & (boundaries < E)]
            base = self.tau_c[sel][:, None] + self.tau_p[sel][:, None] * (E - e)[None, :]
            base[e[None, :] < a_sel[:, None]] = np.inf
            self.groups.append(_Group(E=int(E), idx=sel, a=a_sel, tau_c=self.tau_c[sel], tau_p=self.tau_p[sel],
                                      cols=e, base=base, e_rel=(E - e)))
        # the DP's state after the last shortest_path() (None: not solved yet): dist and argmin per boundary, the
        # argmin (row, column) per group, and the slots it was solved with
        self._dist: np.ndarray | None = None
        self._via_server = np.full(self.L + 1, -1, dtype=np.int64)
        self._via_e = np.full(self.L + 1, -1, dtype=np.int64)
        self._arg: list[tuple[int, int] | None] = [None] * len(self.groups)
        self._solved_slots = self.slots.copy()

    def _solve(self, gi: int, dist: np.ndarray) -> None:
        """The minimum into group ``gi``'s boundary over its links with enough slots; sets ``dist``, the argmin and
        ``via`` there (``dist`` stays inf, no argmin, when there is no usable link)."""
        g = self.groups[gi]
        E = g.E
        self._arg[gi] = None
        dist[E] = np.inf
        self._via_server[E] = -1
        self._via_e[E] = -1
        slots = self.slots[g.idx]
        if slots.max() < 1 or len(g.cols) == 0:
            return
        d = dist[g.cols]
        if not np.isfinite(d).any():
            return
        # a link into j from boundary e needs m_ij = E - e <= slots_j
        cost = np.where(g.e_rel[None, :] <= slots[:, None], g.base, np.inf)
        cost += d[None, :]
        flat = int(np.argmin(cost))
        best = cost.flat[flat]
        if best < np.inf:
            row, col = divmod(flat, len(g.e_rel))
            dist[E] = best
            self._via_server[E] = g.idx[row]
            self._via_e[E] = g.cols[col]
            self._arg[gi] = (row, col)

    def _stale(self, gi: int, lowered: set[int], grown: set[int]) -> bool:
        """Whether group ``gi``'s argmin may have changed: its link lost slots it needs, or its entry ``dist`` grew."""
        arg = self._arg[gi]
        if arg is None:  # no usable link: costs only grow, so still none
            return False
        g = self.groups[gi]
        row, col = arg
        j = int(g.idx[row])
        if j in lowered and g.e_rel[col] > self.slots[j]:
            return True
        return int(g.cols[col]) in grown

    def shortest_path(self) -> tuple[float, list[tuple[int, int, int]]] | None:
        """Cheapest chain ``[(server, start, end), ...]`` covering ``0..L-1`` with its cost, or None.

        Ties: the server listed first at a boundary, then the smallest entry boundary.
        """
        L = self.L
        changed = np.nonzero(self.slots != self._solved_slots)[0]
        if self._dist is None or (self.slots[changed] > self._solved_slots[changed]).any():
            dist = self._dist = np.full(L + 1, np.inf)
            dist[0] = 0.0
            self._via_server[:] = -1
            self._via_e[:] = -1
            for gi in range(len(self.groups)):
                self._solve(gi, dist)
        elif len(changed):
            dist = self._dist
            lowered = set(changed.tolist())
            grown: set[int] = set()  # boundaries whose dist grew
            for gi in range(len(self.groups)):  # in boundary order: a grown dist reaches the groups after it
                if not self._stale(gi, lowered, grown):
                    continue
                E = self.groups[gi].E
                before = dist[E]
                self._solve(gi, dist)
                if dist[E] != before:
                    grown.add(E)
        dist = self._dist
        self._solved_slots = self.slots.copy()
        if not np.isfinite(dist[L]):
            return None
        hops = []
        E = L
        while E > 0:
            j = int(self._via_server[E])
            e = int(self._via_e[E])
            hops.append((j, e, E))
            E = e
        hops.reverse()
        return float(dist[L]), hops


def gca_indices(a, m, slots, tau_c, tau_p, L: int, max_chains: int | None = None
                ) -> list[tuple[list[tuple[int, int, int]], int, float]]:
    """GCA on arrays: list of ``(hops [(server index, start, end)], c_k, T_k)`` in allocation order."""
    dag = _RoutingDAG(a, m, slots, tau_c, tau_p, L)
    out = []
    while max_chains is None or len(out) < max_chains:
        found = dag.shortest_path()
        if found is None:
            break
        _, hops = found
        cap = min(int(dag.slots[j]) // (end - start) for j, start, end in hops)  # Alg. 2 line 7
        for j, start, end in hops:
            dag.slots[j] -= (end - start) * cap  # line 8
        # T_k summed hop by hop (Eq. 2); the DP cost is the same sum in the same order
        T = 0.0
        for j, start, end in hops:
            T += float(dag.tau_c[j]) + float(dag.tau_p[j]) * (end - start)
        out.append((hops, cap, T))
    return out


def gca(servers: Sequence[ServerSpec], model: ModelSpec, placement: Mapping[str, tuple[int, int]], *,
        residual_slots: Mapping[str, int] | None = None, max_chains: int | None = None) -> list[Chain]:
    """Server chains and capacities by GCA (Alg. 2) for ``placement``; list order = allocation order.

    Only servers that are in both ``servers`` and ``placement`` take part. ``residual_slots``
    overrides ``M~_j = floor((M_j - s_m m_j)/s_c)`` (Eq. 3), e.g. with slots a live server reports.
    Each chain's ``spans`` are the 0-based ``[start, end)`` blocks per hop; ``blocks`` = ``m_ij``.
    """
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    by_name = {}
    for s in servers:
        if s.name in by_name:
            raise ValueError(f"duplicate server name {s.name!r}")
        by_name[s.name] = s
    unknown = [name for name in placement if name not in by_name]
    if unknown:
        raise ValueError(f"placement names servers that are not given: {sorted(unknown)[:5]}")
    L = model.num_blocks
    names = [s.name for s in servers if s.name in placement]
    a = np.empty(len(names), dtype=np.int64)
    m = np.empty(len(names), dtype=np.int64)
    slots = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        start, count = placement[name]
        if start < 0 or count < 1 or start + count > L:
            raise ValueError(f"span of {name!r} ({start}, {count}) is outside 0..{L - 1}")
        a[i], m[i] = start, count
        if residual_slots is not None and name in residual_slots:
            given = int(residual_slots[name])
            if given < 0:
                raise ValueError(f"residual slots of {name!r} must be >= 0, got {given}")
            slots[i] = min(given, SLOTS_MAX)
        else:
            slots[i] = min(by_name[name].residual_slots(model, count), SLOTS_MAX)
    tau_c = np.array([by_name[n].tau_c for n in names], dtype=float)
    tau_p = np.array([by_name[n].tau_p for n in names], dtype=float)
    chains = []
    for hops, cap, T in gca_indices(a, m, slots, tau_c, tau_p, L, max_chains=max_chains):
        chains.append(Chain(servers=tuple(names[j] for j, _, _ in hops),
                            blocks=tuple(end - start for _, start, end in hops),
                            service_time=T, capacity=cap,
                            spans=tuple((start, end) for _, start, end in hops)))
    return chains
