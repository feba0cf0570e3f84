"""GBP-CR: Greedy Block Placement with Cache Reservation (Alg. 1, Eq. 8-12)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from petals_chain.model import WHOLE_TOLERANCE, ModelSpec, Placement, ServerSpec


def _check_inputs(servers: Sequence[ServerSpec], model: ModelSpec) -> None:
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    names = set()
    for s in servers:
        if not isinstance(s, ServerSpec):
            raise TypeError(f"servers must be ServerSpec objects, got {type(s).__name__}")
        if s.name in names:
            raise ValueError(f"duplicate server name {s.name!r}")
        names.add(s.name)


def _check_rate(arrival_rate: float, rho_bar: float) -> None:
    if not (arrival_rate >= 0 and math.isfinite(arrival_rate)):
        raise ValueError(f"arrival_rate must be finite and >= 0, got {arrival_rate!r}")
    if not (0 < rho_bar <= 1):
        raise ValueError(f"rho_bar must be in (0, 1], got {rho_bar!r}")


def blocks_per_server(memory: np.ndarray, model: ModelSpec, c: int, cap: np.ndarray | None = None) -> np.ndarray:
    """``m_j(c) = min(floor(M_j / (s_m + s_c c)), L)`` for every server (Eq. 8), as int64; ``cap``: per-server
    block caps (``ServerSpec.block_cap``)."""
    m = np.floor(np.asarray(memory, dtype=float) / (model.block_size + model.cache_size * c) + WHOLE_TOLERANCE)
    return np.minimum(m, model.num_blocks if cap is None else cap).astype(np.int64)


@dataclass
class _ChainSequence:
    """GBP-CR's walk for one ``m(c)`` vector: servers in visiting order cut into chains.

    ``order`` lists the indices of servers with ``m_j(c) >= 1`` by ascending ``t~_j(c)``;
    ``ends[k]`` is one past the position in ``order`` of the last server of complete chain ``k`` and
    ``inv_T`` its ``1/T_k``. Chains are computed lazily (``extend``) because GBP-CR usually stops
    after a few of them.
    """

    order: np.ndarray
    m: np.ndarray  # m_j(c) in visiting order
    t: np.ndarray  # t_j(c) in visiting order
    cum_m: np.ndarray
    cum_t: np.ndarray
    L: int
    ends: list
    inv_T: list
    nu: list  # running sum of inv_T (sequential, as Alg. 1 line 8)
    exhausted: bool = False

    @classmethod
    def build(cls, memory, tau_c, tau_p, model: ModelSpec, c: int, cap: np.ndarray | None = None) -> "_ChainSequence":
        m_all = blocks_per_server(memory, model, c, cap)
        usable = np.nonzero(m_all >= 1)[0]
        m_u = m_all[usable]
        t_u = tau_c[usable] + tau_p[usable] * m_u  # t_j(c), Eq. 9
        amortized = t_u / m_u  # t~_j(c), Eq. 12
        # stable sort: ties keep the caller's server order, so results are deterministic
        pos = np.argsort(amortized, kind="stable")
        order = usable[pos]
        m = m_u[pos]
        t = t_u[pos]
        return cls(order=order, m=m, t=t, cum_m=np.cumsum(m), cum_t=np.cumsum(t), L=model.num_blocks,
                   ends=[], inv_T=[], nu=[])

    def extend(self, target: float) -> None:
        """Cut complete chains until their cumulated ``nu`` reaches ``target`` or servers run out."""
        while not self.exhausted and (not self.nu or self.nu[-1] < target):
            start = self.ends[-1] if self.ends else 0
            base_m = self.cum_m[start - 1] if start > 0 else 0
            # first position whose cumulated blocks since `start` reach L closes the chain
            stop = int(np.searchsorted(self.cum_m, base_m + self.L, side="left"))
            if stop >= len(self.order):
                self.exhausted = True
                break
            # T summed server by server as in Alg. 1 line 5
            T = float(sum(self.t[start:stop + 1].tolist()))
            self.ends.append(stop + 1)
            self.inv_T.append(1.0 / T)
            self.nu.append((self.nu[-1] if self.nu else 0.0) + 1.0 / T)

    def cut(self, target: float) -> tuple[int, int]:
        """(number of complete chains K, number of visited servers) when Alg. 1 stops for ``target``."""
        self.extend(target)
        if self.nu and self.nu[-1] >= target:
            k = int(np.searchsorted(np.asarray(self.nu), target, side="left")) + 1
            return k, self.ends[k - 1]
        # never reached: every usable server was visited (trailing incomplete chain included)
        return len(self.ends), len(self.order)

    def placement_arrays(self, visited: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(server indices, a_j, m_j) for the first ``visited`` servers of the walk."""
        idx = self.order[:visited]
        m = self.m[:visited]
        if visited == 0:
            return idx, np.empty(0, dtype=np.int64), m
        ends = self.ends[:bisect.bisect_right(self.ends, visited)]
        if not ends or ends[-1] < visited:
            ends = ends + [visited]
        # each server's first block is the blocks placed before it in its chain (vectorized over all chains)
        before = np.cumsum(m) - m
        chain_start = np.repeat(np.array([0] + ends[:-1], dtype=np.int64), np.diff([0] + ends))
        # Alg. 1 line 4: the last server of a chain shifts left instead of being truncated
        a = np.minimum(before - before[chain_start], self.L - m)
        return idx, a, m


def _server_arrays(servers: Sequence[ServerSpec]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    memory = np.fromiter((s.memory for s in servers), dtype=float, count=len(servers))
    tau_c = np.fromiter((s.tau_c for s in servers), dtype=float, count=len(servers))
    tau_p = np.fromiter((s.tau_p for s in servers), dtype=float, count=len(servers))
    return memory, tau_c, tau_p


def block_caps(servers: Sequence[ServerSpec], model: ModelSpec) -> np.ndarray | None:
    """Per-server block caps, or None when no server has a ``block_limit`` (the paper's setting)."""
    if not any(s.block_limit for s in servers):
        return None
    return np.fromiter((s.block_cap(model) for s in servers), dtype=np.int64, count=len(servers))


def block_caps_at(servers: Sequence[ServerSpec], model: ModelSpec, c: int) -> np.ndarray | None:
    """:func:`block_caps` at required capacity ``c``: a server whose own ``max_blocks`` is not Eq. 8's (one that holds
    fewer jobs than its memory would, such as a volunteer's capped cache) is capped by its ``max_blocks(model, c)``,
    so one that cannot hold ``c`` jobs at any span gets none, as the paper's servers too small for ``c`` (Eq. 8)."""
    own = [type(s).max_blocks is not ServerSpec.max_blocks for s in servers]
    if not any(own):
        return block_caps(servers, model)
    return np.fromiter((s.max_blocks(model, c) if o else s.block_cap(model) for s, o in zip(servers, own)),
                       dtype=np.int64, count=len(servers))


def gbp_cr(servers: Sequence[ServerSpec], model: ModelSpec, c: int, arrival_rate: float,
           rho_bar: float = 0.7, *, use_all_servers: bool = False) -> Placement:
    """Block placement by GBP-CR (Alg. 1) for required capacity ``c``.

    Servers are visited by ascending amortized time ``t~_j(c) = t_j(c)/m_j(c)`` (ties: input order);
    each takes the next ``m_j(c)`` blocks, the last server of a chain starting at
    ``min(a, L - m_j(c))`` (0-based) so it is never truncated. The walk stops once the complete
    chains reach ``nu >= arrival_rate / (rho_bar c)`` (Eq. 10b); servers not visited, and servers
    that cannot hold one block (``m_j(c) = 0``), get no blocks; nor does a server whose own ``max_blocks`` says it
    cannot hold ``c`` jobs (:func:`block_caps_at`).

    ``use_all_servers`` (our extension, not in the paper) keeps walking past that point, so every
    server that can hold a block gets one: the extra chains only add capacity behind the faster
    ones (JFFC fills the fastest first), which absorbs bursts above the planned arrival rate.
    """
    _check_inputs(servers, model)
    _check_rate(arrival_rate, rho_bar)
    if int(c) != c or c < 1:
        raise ValueError(f"c must be a positive integer, got {c!r}")
    memory, tau_c, tau_p = _server_arrays(servers)
    seq = _ChainSequence.build(memory, tau_c, tau_p, model, int(c), block_caps_at(servers, model, int(c)))
    _, visited = seq.cut(math.inf if use_all_servers else arrival_rate / (rho_bar * c))
    idx, a, m = seq.placement_arrays(visited)
    return Placement({servers[i].name: (int(aj), int(mj)) for i, aj, mj in zip(idx.tolist(), a.tolist(), m.tolist())},
                     num_blocks=model.num_blocks)


def gbp_cr_chain_count(servers: Sequence[ServerSpec], model: ModelSpec, c: int, arrival_rate: float,
                       rho_bar: float = 0.7) -> int | None:
    """``K(c)`` of Eq. 13: complete GBP-CR chains needed to reach ``nu >= lambda/(rho_bar c)``; None if never."""
    _check_inputs(servers, model)
    _check_rate(arrival_rate, rho_bar)
    memory, tau_c, tau_p = _server_arrays(servers)
    seq = _ChainSequence.build(memory, tau_c, tau_p, model, int(c), block_caps_at(servers, model, int(c)))
    target = arrival_rate / (rho_bar * c)
    k, _ = seq.cut(target)
    return k if k > 0 and seq.nu[k - 1] >= target else None
