"""Tuning the required capacity ``c`` of GBP-CR (§3.1.3 Eq. 13-14 and §3.2.3).

All methods search ``c in [1, c_max]``, ``c_max = floor((max_j M_j - s_m)/s_c)``, and return the
smallest ``c`` attaining the minimum (the bound methods: or, on request, the ``c`` in force or the largest one, see
``tune_capacity``'s ``prefer`` and ``ties``). The search is exact (same result as running GBP-CR + GCA and
the objective for every ``c``) but shares work: the GBP-CR walk depends on ``c`` only through the
vector ``m(c)`` (Eq. 8), and GCA and the bounds depend only on the resulting placement (residual
slots, Eq. 3, do not involve ``c``), so each distinct walk and each distinct placement is computed once. A server
whose own ``max_blocks`` or ``residual_slots`` is not Eq. 8's or Eq. 3's (a volunteer's capped cache) is walked and
counted by it, as ``gbp_cr()`` and ``gca()`` do.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from petals_chain.algorithms.bounds import response_time_bounds, response_time_lower_bound
from petals_chain.algorithms.gbp_cr import (_ChainSequence, _check_inputs, _check_rate, _server_arrays,
                                            block_caps, blocks_per_server)
from petals_chain.algorithms.gca import SLOTS_MAX, _RoutingDAG, gca_indices
from petals_chain.model import WHOLE_TOLERANCE, Chain, ModelSpec, Placement, ServerSpec, units_that_fit

METHODS = ("lower", "upper", "surrogate")
TIES = ("smallest", "largest")
# Objectives within this relative distance of the minimum are ties: at light load the bound is the fastest chain's
# service time plus a waiting term below 1e-9 of it, so placements of different capacity differ only in the last
# bits, and the smallest c "attaining" the minimum flapped with them between re-plans (c 7 -> 1 -> 7 as lambda moved,
# the same bound to 1e-12). Which tie serves more is then told by the chains' total rate (_break_tie), not the bound.
TIE_TOLERANCE = 1e-9


def max_capacity(servers: Sequence[ServerSpec], model: ModelSpec) -> int:
    """``c_max = floor((max_j M_j - s_m)/s_c)``: most concurrent jobs any server can hold with one block."""
    if not servers:
        return 0
    return max(0, units_that_fit(max(s.memory for s in servers) - model.block_size, model.cache_size))


def tune_capacity(servers: Sequence[ServerSpec], model: ModelSpec, arrival_rate: float, rho_bar: float = 0.7,
                  method: str = "lower", *, c_range: tuple[int, int] | None = None,
                  return_table: bool = False, prune: bool = True, segments: bool | None = None,
                  use_all_servers: bool = False, prefer: int | None = None, ties: str = "smallest"):
    """Pick ``c`` for GBP-CR, then place (GBP-CR) and compose chains (GCA); see ``_tune``.

    Ties (bound methods: objectives within ``TIE_TOLERANCE`` of the minimum, which Theorem 3.7 cannot tell apart):
    ``prefer`` (the ``c`` in force) is returned when it ties, with its placement, so that ``c`` does not flap between
    equal values across re-plans; else ``ties="smallest"`` (the paper's argmin, the default) or ``"largest"``: of the
    tied placements the one whose chains serve the most (``sum c_k mu_k``; equal rates: the smallest ``c``'s), with
    the largest ``c`` that gives that same placement. Ties are placements the bound cannot rank (at light load all
    whose fastest chain is the same): the most capacity is the one that waits least when lambda grows, where the
    smallest tied ``c`` was the one of least capacity (the demo's swarm: 3 chains of capacity 6 in all, not 2 of 7).
    Over such a ``c`` range every placed server holds the same blocks (Eq. 8), so the placement, its chains and both
    bounds are the same; the largest ``c`` is the reservation the placement honours (each of its servers holds that
    many jobs), and it sizes a newcomer's span (``m_j(c)``) to hold as many jobs as the servers already placed, where
    the smallest (often 1) gave it all the blocks its memory holds beside one job: a chain through it carried one job
    at a time.

    ``use_all_servers`` (our extension; bound methods only) also tunes GBP-CR walking over every
    server (``gbp_cr(use_all_servers=True)``) and returns that plan unless its objective is worse than
    the paper's plan: GCA is greedy, so extra servers can (rarely) reshuffle the chains for the worse,
    and the upper bound charges slow chains pessimistically. The table is the chosen variant's.
    """
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    if prefer is not None and (int(prefer) != prefer or prefer < 1):
        raise ValueError(f"prefer must be a positive integer or None, got {prefer!r}")
    kw = dict(c_range=c_range, prune=prune, segments=segments, prefer=prefer, ties=ties)
    if not use_all_servers or method == "surrogate":
        out = _tune(servers, model, arrival_rate, rho_bar, method, return_table=True, walk_all=False, **kw)
        return out if return_table else out[:3]
    paper = _tune(servers, model, arrival_rate, rho_bar, method, return_table=True, walk_all=False, **kw)
    every = _tune(servers, model, arrival_rate, rho_bar, method, return_table=True, walk_all=True, **kw)
    obj_paper, obj_every = paper[3][paper[0]], every[3][every[0]]
    better = every if not (obj_every > obj_paper * (1 + 1e-9)) else paper
    return better if return_table else better[:3]


def _tune(servers: Sequence[ServerSpec], model: ModelSpec, arrival_rate: float, rho_bar: float = 0.7,
          method: str = "lower", *, c_range: tuple[int, int] | None = None,
          return_table: bool = False, prune: bool = True, segments: bool | None = None,
          walk_all: bool = False, prefer: int | None = None, ties: str = "smallest"):
    """Pick ``c`` for GBP-CR (``walk_all``: the extended walk), then place and compose chains (GCA).

    * ``"lower"`` / ``"upper"``: minimize the Theorem 3.7 lower / upper bound on the mean response
      time of the GBP-CR + GCA chains (§3.2.3; the paper recommends ``"lower"``).
    * ``"surrogate"``: minimize ``c K(c)`` (Eq. 13-14), ``K(c)`` = GBP-CR's complete chains needed to
      reach ``nu >= lambda/(rho_bar c)`` (``c`` with no such ``K`` are infeasible).

    If no ``c`` has a finite objective (the swarm cannot be stable), the ``c`` whose GCA chains give the
    largest total service rate ``sum c_k mu_k`` is returned. Raises ValueError if no server can hold
    even one block, or the blocks cannot be covered by any chain for any ``c``.
    Returns ``(c, placement, chains)``, plus a dict ``{c: objective}`` if ``return_table`` (for the
    bound methods, None where the exact search skipped ``c`` as provably not better; pass
    ``prune=False`` to evaluate every ``c``, e.g. to plot the bounds against ``c``).
    With ``segments`` (default: when ``c_max`` is 1024 or more, e.g. a small model on a large GPU) only
    the first ``c`` of each interval of identical placements is visited (exact, see below), and the
    table has only those ``c``.
    ``walk_all`` places every server that can hold a block (``gbp_cr(use_all_servers=True)``).
    ``prefer`` and ``ties`` break ties of the bound methods (``tune_capacity``); the table then also has the ``c``
    returned.
    """
    _check_inputs(servers, model)
    _check_rate(arrival_rate, rho_bar)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    c_max = max_capacity(servers, model)
    lo_c, hi_c = (1, c_max) if c_range is None else (max(1, int(c_range[0])), min(c_max, int(c_range[1])))
    if c_max < 1 or lo_c > hi_c:
        raise ValueError("no server can hold one block with one cache slot (c_max < 1)")
    memory, tau_c, tau_p = _server_arrays(servers)
    cap = block_caps(servers, model)
    # servers whose own max_blocks is not Eq. 8's (a capped cache: none at a c it cannot hold) are walked by it at
    # each c, as gbp_cr() walks them (block_caps_at); non-increasing in c as Eq. 8, which the segments rely on
    own_blocks = [i for i, s in enumerate(servers) if type(s).max_blocks is not ServerSpec.max_blocks]
    L = model.num_blocks
    # servers whose own residual_slots is not Eq. 3's (a volunteer's capped cache): counted by it, as gca() counts
    # them, else c was tuned with slots their caps do not hold (a chain of capacity 15 where the cap holds 2)
    own_slots = np.fromiter((type(s).residual_slots is not ServerSpec.residual_slots for s in servers), dtype=bool,
                            count=len(servers))

    walks: dict[bytes, _ChainSequence] = {}
    keys: dict[tuple, _ChainSequence] = {}

    def key_at(c: int) -> tuple:
        cap_c = cap
        if own_blocks:
            cap_c = np.full(len(servers), L, dtype=np.int64) if cap is None else cap.copy()
            cap_c[own_blocks] = [servers[i].max_blocks(model, c) for i in own_blocks]
        wkey = blocks_per_server(memory, model, c, cap_c).tobytes()
        seq = walks.get(wkey)
        if seq is None:
            seq = walks[wkey] = _ChainSequence.build(memory, tau_c, tau_p, model, c, cap_c)
        target = arrival_rate / (rho_bar * c)
        K, visited = seq.cut(target)
        if walk_all:
            visited = seq.cut(math.inf)[1]
        pkey = (wkey, visited)
        keys[pkey] = seq
        return pkey, K, K > 0 and seq.nu[K - 1] >= target

    def _same(x: tuple, y: tuple) -> bool:
        # same placement and, for c K(c), same reachability (a walk can end exactly at its last server)
        return x[0] == y[0] and x[2] == y[2]

    per_c: dict[int, tuple] = {}  # c -> (placement key, K, reached)
    if segments is None:
        segments = hi_c - lo_c >= 1024
    if not segments:
        for c in range(lo_c, hi_c + 1):
            per_c[c] = key_at(c)
    else:
        # m_j(c) is non-increasing in c and so is the number of servers GBP-CR visits for a given m(c),
        # so the placement is constant on intervals of c; every objective is constant on such an
        # interval except c K(c), which grows with c: only each interval's first c can be the argmin.
        c = lo_c
        while c <= hi_c:
            here = per_c[c] = key_at(c)
            same, step = c, 1
            while same + step <= hi_c and _same(key_at(same + step), here):
                same, step = same + step, step * 2
            diff = min(same + step, hi_c + 1)
            while diff - same > 1:  # key(same) == key(c) != key(diff)
                mid = (same + diff) // 2
                if _same(key_at(mid), here):
                    same = mid
                else:
                    diff = mid
            c = diff

    entries: dict[tuple, tuple] = {}  # placement key -> (idx, a, m, chains, lower, upper, total rate)
    # Walks of different m(c) often place the same servers the same way (they differ only in servers not visited):
    # GCA, the bounds and the relaxation below depend on the placement alone, so each distinct one is computed once
    # (with hundreds of servers thousands of keys hold a few hundred placements).
    contents: dict[tuple, bytes] = {}  # placement key -> the placement's content key
    placed: dict[bytes, tuple] = {}  # content key -> (idx, a, m, slots)
    evaluated: dict[bytes, tuple] = {}  # content key -> entry
    relaxed: dict[bytes, float] = {}  # content key -> relaxation (below)

    def content(pkey) -> bytes:
        if pkey not in contents:
            idx, a, m = keys[pkey].placement_arrays(pkey[1])
            order = np.argsort(idx, kind="stable")  # input order, as gca() breaks ties
            idx, a, m = idx[order], a[order], m[order]
            ckey = contents[pkey] = idx.tobytes() + a.tobytes() + m.tobytes()
            if ckey not in placed:
                residual = (memory[idx] - model.block_size * m) / model.cache_size
                # as units_that_fit
                slots = np.clip(np.floor(residual + WHOLE_TOLERANCE), 0, SLOTS_MAX).astype(np.int64)
                for pos in np.nonzero(own_slots[idx])[0].tolist():
                    slots[pos] = min(servers[int(idx[pos])].residual_slots(model, int(m[pos])), SLOTS_MAX)
                placed[ckey] = (idx, a, m, slots)
        return contents[pkey]

    def evaluate(pkey):
        if pkey not in entries:
            ckey = content(pkey)
            if ckey not in evaluated:
                idx, a, m, slots = placed[ckey]
                chains = gca_indices(a, m, slots, tau_c[idx], tau_p[idx], L)
                pairs = [(1.0 / T, cap) for _, cap, T in chains]
                lower, upper = response_time_bounds(pairs, arrival_rate) if pairs else (math.inf, math.inf)
                evaluated[ckey] = (idx, a, m, chains, lower, upper, sum(mu * cap for mu, cap in pairs))
            entries[pkey] = evaluated[ckey]
        return entries[pkey]

    def relaxation(pkey) -> float:
        ckey = content(pkey)
        if ckey not in relaxed:
            idx, a, m, slots = placed[ckey]
            found = _RoutingDAG(a, m, slots, tau_c[idx], tau_p[idx], L).shortest_path()
            if found is None:
                relaxed[ckey] = math.inf
            else:
                # Every job holds one slot per block, and its first hop (entered at block 0) holds
                # end_j slots, so sum_k c_k <= C_ub; with all chains as fast as the fastest one the
                # death rates only grow, so M/M/C_ub at rate 1/T_1 lower-bounds both bounds.
                head = a == 0
                c_ub = int(min(slots.sum() // L, (slots[head] // (a[head] + m[head])).sum()))
                relaxed[ckey] = response_time_lower_bound([(1.0 / found[0], c_ub)], arrival_rate) if c_ub > 0 \
                    else math.inf
        return relaxed[ckey]

    table: dict[int, float | None] = {}
    best = None  # (objective, c, key)
    if method == "surrogate":
        for c, (pkey, K, reached) in per_c.items():
            table[c] = obj = c * K if reached else math.inf
            if math.isfinite(obj) and (best is None or obj < best[0]):
                best = (obj, c, pkey)
    else:
        # Exact pruning: both bounds are >= a cheap relaxation (below); visiting placements by
        # ascending relaxation and skipping those whose relaxation exceeds the best objective so far
        # skips only placements that cannot win.
        first = {}
        for pkey in dict.fromkeys(k for k, _, _ in per_c.values()):
            first[pkey] = relaxation(pkey) if prune else 0.0
        by_key: dict[tuple, list[int]] = {}
        for c, (pkey, _, _) in per_c.items():
            by_key.setdefault(pkey, []).append(c)
        best_obj = math.inf
        for pkey in sorted(first, key=lambda k: (first[k], min(by_key[k]))):
            if first[pkey] == math.inf or first[pkey] > best_obj:
                continue
            entry = evaluate(pkey)
            obj = entry[4] if method == "lower" else entry[5]
            best_obj = min(best_obj, obj)
        for c, (pkey, _, _) in per_c.items():
            entry = entries.get(pkey)
            obj = None if entry is None else (entry[4] if method == "lower" else entry[5])
            table[c] = obj if entry is not None or first[pkey] < math.inf else math.inf
            if obj is not None and math.isfinite(obj) and (best is None or obj < best[0]):
                best = (obj, c, pkey)
        if best is not None and (prefer is not None or ties == "largest"):
            best = _break_tie(best, per_c, entries, 4 if method == "lower" else 5, hi_c, prefer, ties, content)
            table[best[1]] = best[0]
    if best is None:
        # nothing stable: all placements were evaluated (pruning never triggers without a finite best)
        for pkey in dict.fromkeys(k for k, _, _ in per_c.values()):
            evaluate(pkey)
        fallback = None
        for c, (pkey, _, _) in per_c.items():
            total = entries[pkey][6]
            if total > 0 and (fallback is None or total > fallback[0]):
                fallback = (total, c, pkey)
        if fallback is None:
            raise ValueError("the servers cannot form any chain covering all blocks for any c")
        best = fallback
    _, c_best, pkey = best
    idx, a, m, chains_idx = evaluate(pkey)[:4]
    placement = Placement({servers[i].name: (int(aj), int(mj)) for i, aj, mj in zip(idx.tolist(), a.tolist(), m.tolist())},
                          num_blocks=L)
    chains = [Chain(servers=tuple(servers[int(idx[j])].name for j, _, _ in hops),
                    blocks=tuple(e - s for _, s, e in hops), service_time=T, capacity=cap,
                    spans=tuple((s, e) for _, s, e in hops)) for hops, cap, T in chains_idx]
    if return_table:
        return c_best, placement, chains, table
    return c_best, placement, chains


def _break_tie(best: tuple, per_c: dict[int, tuple], entries: dict[tuple, tuple], field: int, hi_c: int,
               prefer: int | None, ties: str, content) -> tuple:
    """``(objective, c, placement key)`` among the ``c`` whose objective (entry ``field``) is within
    ``TIE_TOLERANCE`` of ``best``'s: ``prefer`` if it is one of them; else, for ``ties="largest"``, the placement of
    the one whose chains' total rate (entry 6) is the largest (the smallest such ``c``'s) at the largest ``c`` that
    gives the same placement (``content``: a placement key's content); else ``best``. A ``c`` of ``per_c`` stands for
    every ``c`` up to the next one (with ``segments`` only each interval's first is visited: the placement, and so the
    bound, is the same up to the next)."""
    starts = sorted(per_c)

    def objective(c: int) -> float | None:
        entry = entries.get(per_c[c][0])
        return None if entry is None else entry[field]

    limit = best[0] * (1 + TIE_TOLERANCE)
    tied = [c for c in starts if (obj := objective(c)) is not None and obj <= limit]
    if prefer is not None and starts[0] <= prefer <= hi_c:
        start = starts[bisect.bisect_right(starts, prefer) - 1]
        if start in tied:
            return objective(start), int(prefer), per_c[start][0]
    if ties != "largest" or not tied:
        return best
    top = max(entries[per_c[c][0]][6] for c in tied)
    pick = next(c for c in tied if entries[per_c[c][0]][6] >= top * (1 - TIE_TOLERANCE))
    first = per_c[pick][0]
    last = max(c for c in tied if content(per_c[c][0]) == content(first))
    i = bisect.bisect_right(starts, last)
    return objective(pick), (starts[i] - 1 if i < len(starts) else hi_c), first
