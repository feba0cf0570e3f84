"""Tuning the required capacity ``c`` of GBP-CR (§3.1.3 Eq. 13-14 and §3.2.3).

All methods search ``c in [1, c_max]``, ``c_max = floor((max_j M_j - s_m)/s_c)``, and return the
smallest ``c`` attaining the minimum. The search is exact (same result as running GBP-CR + GCA and
the objective for every ``c``) but shares work: the GBP-CR walk depends on ``c`` only through the
vector ``m(c)`` (Eq. 8), and GCA and the bounds depend only on the resulting placement (residual
slots, Eq. 3, do not involve ``c``), so each distinct walk and each distinct placement is computed once.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from petals_chain.algorithms.bounds import response_time_bounds
from petals_chain.algorithms.gbp_cr import (_ChainSequence, _check_inputs, _check_rate, _server_arrays,
                                            blocks_per_server)
from petals_chain.algorithms.gca import gca_indices
from petals_chain.model import Chain, ModelSpec, Placement, ServerSpec

METHODS = ("lower", "upper", "surrogate")


def max_capacity(servers: Sequence[ServerSpec], model: ModelSpec) -> int:
    """``c_max = floor((max_j M_j - s_m)/s_c)``: most concurrent jobs any server can hold with one block."""
    if not servers:
        return 0
    return max(0, int((max(s.memory for s in servers) - model.block_size) // model.cache_size))


def tune_capacity(servers: Sequence[ServerSpec], model: ModelSpec, arrival_rate: float, rho_bar: float = 0.7,
                  method: str = "lower", *, c_range: tuple[int, int] | None = None,
                  return_table: bool = False):
    """Pick ``c`` for GBP-CR, then place (GBP-CR) and compose chains (GCA).

    * ``"lower"`` / ``"upper"``: minimize the Theorem 3.7 lower / upper bound on the mean response
      time of the GBP-CR + GCA chains (§3.2.3; the paper recommends ``"lower"``).
    * ``"surrogate"``: minimize ``c K(c)`` (Eq. 13-14), ``K(c)`` = GBP-CR's complete chains needed to
      reach ``nu >= lambda/(rho_bar c)`` (``c`` with no such ``K`` are infeasible).

    If no ``c`` has a finite objective (the swarm cannot be stable), the ``c`` whose GCA chains give the
    largest total service rate ``sum c_k mu_k`` is returned. Raises ValueError if no server can hold
    even one block, or the blocks cannot be covered by any chain for any ``c``.
    Returns ``(c, placement, chains)``, plus a dict ``{c: objective}`` if ``return_table``.
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
    L = model.num_blocks

    walks: dict[bytes, _ChainSequence] = {}
    placements: dict[tuple, tuple] = {}  # placement key -> (idx, a, m, gca result, lower, upper, nu)
    table: dict[int, float] = {}
    best = None  # (objective, c, key)
    fallback = None  # (-total rate, c, key)
    for c in range(lo_c, hi_c + 1):
        m_vec = blocks_per_server(memory, model, c)
        wkey = m_vec.tobytes()
        seq = walks.get(wkey)
        if seq is None:
            seq = walks[wkey] = _ChainSequence.build(memory, tau_c, tau_p, model, c)
        target = arrival_rate / (rho_bar * c)
        K, visited = seq.cut(target)
        reached = K > 0 and seq.nu[K - 1] >= target
        pkey = (wkey, visited)
        entry = placements.get(pkey)
        if entry is None and (method != "surrogate" or reached):
            idx, a, m = seq.placement_arrays(visited)
            slots = np.maximum(0, np.floor((memory[idx] - model.block_size * m) / model.cache_size)).astype(np.int64)
            chains = gca_indices(a, m, slots, tau_c[idx], tau_p[idx], L)
            pairs = [(1.0 / T, cap) for _, cap, T in chains]
            lower, upper = response_time_bounds(pairs, arrival_rate) if pairs else (math.inf, math.inf)
            total = sum(mu * cap for mu, cap in pairs)
            entry = placements[pkey] = (idx, a, m, chains, lower, upper, total)
        if method == "surrogate":
            obj = c * K if reached else math.inf
        else:
            obj = entry[4] if method == "lower" else entry[5]
        table[c] = obj
        if math.isfinite(obj) and (best is None or obj < best[0]):
            best = (obj, c, pkey)
        if entry is not None and entry[6] > 0 and (fallback is None or -entry[6] < fallback[0]):
            fallback = (-entry[6], c, pkey)
    if best is None:
        if fallback is None:
            if method == "surrogate":
                # no c reaches the target: fall back to the most capable placement anyway
                return tune_capacity(servers, model, arrival_rate, rho_bar, "lower", c_range=c_range,
                                     return_table=return_table)
            raise ValueError("the servers cannot form any chain covering all blocks for any c")
        best = fallback
    _, c_best, pkey = best
    entry = placements.get(pkey)
    idx, a, m, chains_idx = entry[0], entry[1], entry[2], entry[3]
    placement = Placement({servers[i].name: (int(aj), int(mj)) for i, aj, mj in zip(idx.tolist(), a.tolist(), m.tolist())},
                          num_blocks=L)
    chains = [Chain(servers=tuple(servers[int(idx[j])].name for j, _, _ in hops),
                    blocks=tuple(e - s for _, s, e in hops), service_time=T, capacity=cap,
                    spans=tuple((s, e) for _, s, e in hops)) for hops, cap, T in chains_idx]
    if return_table:
        return c_best, placement, chains, table
    return c_best, placement, chains
