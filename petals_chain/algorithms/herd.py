"""HERD, Shepherd's periodic planner (seed 003 §4): streams and models into serving groups by an ILP.

For each stream ``i``: ``n_i = rate_i / T_i`` GPUs sustain its average load (``T_i``: its measured goodput on one
GPU). Its *burst tolerance* in an assignment is ``bt(i) = sum_j size_j * x_ij / n_i`` (GPUs it can use at peak over
GPUs it needs on average). HERD maximizes ``min_i bt(i)``. The seed's Eq. 2 is lost; the ILP below is the rebuild
of docs/scheduling-seeds.md §3.3 (variables of Table 2)::

    x_ij, y_cj, z_kj in {0,1}; size_j in {0..Ḡ}; w_ij >= 0 (= size_j * x_ij); t >= 0
    max t   s.t.   t <= sum_j w_ij / n_i                 for all i
                   w_ij <= Ḡ x_ij,  w_ij <= size_j        (w's lower bounds are implied: max t pushes w up)
    (a) sum_j size_j <= N            (b) size_j <= Ḡ
    (c) sum_k z_kj mem_k <= mem      (every GPU of group j holds all of j's models)
    (d) sum_j x_ij = 1;  x_ij <= z_{m(i) j}
    (e) sum_c y_cj <= 1;  z_kj <= sum_c q_ck y_cj     (a group's models come from one affinity set)

with ``⌈N/Ḡ⌉`` candidate groups (empty ones allowed) and ``size_1 >= size_2 >= ...`` to break the groups'
symmetry. Solved with ``scipy.optimize.milp`` (HiGHS); :func:`brute_force_herd` enumerates small instances.

Seed mapping §3.7 (:func:`solve_chain_allocation`): in petals-chain the unit is a *chain* (a chain serves one
model), so a group's size counts chains and the memory constraint becomes "every model a group serves has at least
one complete chain in it"; a model-stream's burst tolerance counts the chains of its own model.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

# HiGHS's presolve answers some instances whose model sets sit a hair from a GPU's memory wrongly (4 streams, models
# of 4.0000005 / 2 / 4 / 4 GB on 8 GB GPUs: 0.667 where brute force finds 0.967; 3 of 2,000 adversarial instances):
# instances up to this many variables (the sizes brute force checks) are solved without it; larger ones keep it, as
# it solves them ~3x faster (100 streams x 50 GPUs, 316 variables merged: 0.14 s against 0.39 s of CPU), and may
# there miss the optimum of such a near-boundary instance.
PRESOLVE_OFF_MAX_VARS = 200


@dataclass(frozen=True)
class Stream:
    """A request stream (or a model-stream): its model and ``n`` = GPUs (or chains) for its average load."""

    name: str
    model: str
    n: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.n) and self.n > 0):
            raise ValueError(f"stream {self.name!r}: n must be a positive number, got {self.n!r}")


@dataclass
class HerdProblem:
    """``num_gpus`` GPUs of ``gpu_memory`` each; groups of at most ``g_bar`` GPUs (None: no limit);
    ``affinity_sets``: a partition of the models (None: one set, the seed's evaluation ``K̄ = ∞``);
    ``groups``: candidate groups (None: ``⌈N/Ḡ⌉``). Bad input (no GPU, a model's memory missing, NaN or negative,
    stream names twice, affinity sets that are no partition) is a ``ValueError`` here."""

    streams: Sequence[Stream]
    model_memory: Mapping[str, float]
    gpu_memory: float
    num_gpus: int
    g_bar: int | None = None
    affinity_sets: Sequence[Sequence[str]] | None = None
    groups: int | None = None

    def __post_init__(self) -> None:
        _check_count("num_gpus", self.num_gpus, 1)
        for name in ("g_bar", "groups"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), 1)
        if not (isinstance(self.gpu_memory, numbers.Real) and self.gpu_memory > 0):  # inf: no limit; NaN fails
            raise ValueError(f"gpu_memory must be a positive number, got {self.gpu_memory!r}")
        names = [s.name for s in self.streams]
        if len(set(names)) < len(names):  # the solution maps names to groups: a twin was lost from it
            raise ValueError(f"stream names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
        for m in self.models():
            mem = self.model_memory.get(m)
            if not (isinstance(mem, numbers.Real) and math.isfinite(mem) and mem >= 0):
                raise ValueError(f"model_memory of {m!r} must be a finite number >= 0, got {mem!r}")
        if self.affinity_sets:
            for m in self.models():
                n = sum(m in c for c in self.affinity_sets)
                if n != 1:  # a partition: none made the model unplaceable, two made (e) ambiguous
                    raise ValueError(f"affinity_sets must be a partition of the models: {m!r} is in {n} sets")

    def g(self) -> int:
        return self.num_gpus if self.g_bar is None else min(self.g_bar, self.num_gpus)

    def num_groups(self) -> int:
        return self.groups or max(1, -(-self.num_gpus // self.g()))

    def models(self) -> list[str]:
        return sorted({s.model for s in self.streams})

    def sets(self) -> list[list[str]]:
        return [list(s) for s in self.affinity_sets] if self.affinity_sets else [self.models()]


@dataclass
class HerdSolution:
    """``objective`` = min burst tolerance; ``group[stream name]``, ``sizes[j]``, ``models[j]``, ``bt[stream]``."""

    objective: float
    group: dict[str, int]
    sizes: list[int]
    models: list[list[str]]
    bt: dict[str, float] = field(default_factory=dict)
    status: str = "optimal"


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _constraint_matrix(rows: list, nv: int):
    """``(A, lo, hi)`` for scipy's ``LinearConstraint`` from rows ``({variable: coefficient}, lo, hi)``."""
    A = lil_matrix((len(rows), nv))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    for r, (coef, a, b) in enumerate(rows):
        for v, c in coef.items():
            A[r, v] = c
        lo[r], hi[r] = a, b
    return A, lo, hi

def burst_tolerance(problem: HerdProblem, group: Mapping[str, int], sizes: Sequence[int]) -> dict[str, float]:
    return {s.name: sizes[group[s.name]] / s.n for s in problem.streams}


def check_solution(problem: HerdProblem, sol: HerdSolution) -> list[str]:
    """Constraint violations of ``sol`` (empty if valid): (a)-(e) and the objective."""
    bad = []
    G = problem.g()
    if sum(sol.sizes) > problem.num_gpus:
        bad.append("(a) cluster size")
    if any(s < 0 or s > G for s in sol.sizes):
        bad.append("(b) group-worker limit")
    sets = problem.sets()
    for j, ms in enumerate(sol.models):
        if sum(problem.model_memory[m] for m in ms) > problem.gpu_memory + 1e-9:
            bad.append(f"(c) memory of group {j}")
        if ms and not any(set(ms) <= set(c) for c in sets):
            bad.append(f"(e) group {j} mixes affinity sets")
    for s in problem.streams:
        if s.model not in sol.models[sol.group[s.name]]:
            bad.append(f"(d) stream {s.name} in a group without its model")
    bt = burst_tolerance(problem, sol.group, sol.sizes)
    if bt and abs(min(bt.values()) - sol.objective) > 1e-6 * max(1.0, sol.objective):
        bad.append("objective is not min bt")
    return bad


def solve_herd(problem: HerdProblem, *, merge: bool = True, time_limit_s: float | None = None,
               mip_rel_gap: float = 1e-7) -> HerdSolution | None:
    """The HERD ILP (module docstring) by HiGHS; None if infeasible (a model larger than a GPU, say). The memory
    constraint (c) is kept exactly, not to the solver's tolerance: a group's model set over a GPU's memory is cut
    off and the ILP solved again.

    ``merge`` (default) solves it over model-streams (:func:`merge_model_streams`, the seed's scaling step) and puts
    every stream in its model's group. This loses nothing: given any solution, moving a stream into the group that
    holds its model's largest-``n`` stream keeps (c)-(e) (that group already holds the model) and gives it
    ``bt = size / n_i >= size / max n >= t``, so both problems have the same optimum; the merged one has one
    binary per model and group instead of one per stream and group."""
    if merge:
        merged = merge_model_streams(problem.streams)
        if len(merged) < len(problem.streams):
            sub = HerdProblem(merged, problem.model_memory, problem.gpu_memory, problem.num_gpus, problem.g_bar,
                              problem.affinity_sets, problem.num_groups())
            sol = solve_herd(sub, merge=False, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
            if sol is None:
                return None
            group = {s.name: sol.group[s.model] for s in problem.streams}
            bt = burst_tolerance(problem, group, sol.sizes)
            return HerdSolution(min(bt.values()), group, sol.sizes, sol.models, bt, sol.status)
    streams = list(problem.streams)
    S, J, G, N = len(streams), problem.num_groups(), problem.g(), problem.num_gpus
    if S == 0:  # nothing to plan (the ILP's t would be unbounded: no solution, read as infeasible)
        return HerdSolution(0.0, {}, [0] * J, [[] for _ in range(J)], {})
    models = problem.models()
    K = len(models)
    kidx = {m: k for k, m in enumerate(models)}
    sets = problem.sets()
    C = len(sets)
    # variable layout
    ox, ow, oz, oy, osz = 0, S * J, 2 * S * J, 2 * S * J + K * J, 2 * S * J + K * J + C * J
    ot = osz + J
    nv = ot + 1
    X = lambda i, j: ox + i * J + j  # noqa: E731
    W = lambda i, j: ow + i * J + j  # noqa: E731
    Z = lambda k, j: oz + k * J + j  # noqa: E731
    Y = lambda c, j: oy + c * J + j  # noqa: E731
    rows: list[tuple[dict[int, float], float, float]] = []
    for i, s in enumerate(streams):
        rows.append(({ot: 1.0, **{W(i, j): -1.0 / s.n for j in range(J)}}, -np.inf, 0.0))
        rows.append(({X(i, j): 1.0 for j in range(J)}, 1.0, 1.0))
        for j in range(J):
            rows.append(({W(i, j): 1.0, X(i, j): -float(G)}, -np.inf, 0.0))
            rows.append(({W(i, j): 1.0, osz + j: -1.0}, -np.inf, 0.0))
            rows.append(({X(i, j): 1.0, Z(kidx[s.model], j): -1.0}, -np.inf, 0.0))
    rows.append(({osz + j: 1.0 for j in range(J)}, -np.inf, float(N)))
    for j in range(J):
        rows.append(({Z(k, j): float(problem.model_memory[m]) for k, m in enumerate(models)}, -np.inf,
                     float(problem.gpu_memory)))
        rows.append(({Y(c, j): 1.0 for c in range(C)}, -np.inf, 1.0))
        for k, m in enumerate(models):
            rows.append(({Z(k, j): 1.0, **{Y(c, j): -1.0 for c in range(C) if m in sets[c]}}, -np.inf, 0.0))
        if j + 1 < J:
            rows.append(({osz + j: -1.0, osz + j + 1: 1.0}, -np.inf, 0.0))  # symmetry: sizes non-increasing
    lb = np.zeros(nv)
    ub = np.ones(nv)
    ub[ow:ow + S * J] = G
    ub[osz:osz + J] = G
    ub[ot] = np.inf
    for k, m in enumerate(models):  # a model larger than a GPU is in no group (exact, not to the solver's tolerance)
        if problem.model_memory[m] > problem.gpu_memory:
            ub[oz + k * J:oz + (k + 1) * J] = 0.0
    integrality = np.ones(nv)
    integrality[ow:ow + S * J] = 0
    integrality[ot] = 0
    c = np.zeros(nv)
    c[ot] = -1.0
    opts: dict[str, Any] = {"mip_rel_gap": mip_rel_gap}
    if nv <= PRESOLVE_OFF_MAX_VARS:  # HiGHS's presolve answers some near-boundary instances wrongly (see above)
        opts["presolve"] = False
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    cut: set[tuple[int, tuple[str, ...]]] = set()  # (n, models): at most n of them in a group
    while True:
        if deadline is not None:  # the limit is for the whole solve, every resolve below included
            opts["time_limit"] = max(0.0, deadline - time.monotonic())
        A, lo, hi = _constraint_matrix(rows, nv)
        res = None
        # HiGHS ends some near-boundary instances in "solve error" (status 4, no answer) under the settings above
        # (two streams whose models of 8.0000005 GB cannot share a 16 GB GPU: None where a plan exists, 2.0 on two
        # GPUs); a tighter MIP feasibility tolerance solves them. Only infeasible (2) and out of time (1) are final.
        for retry in ({}, {"mip_feasibility_tolerance": 1e-9},
                      {"mip_feasibility_tolerance": 1e-9, "presolve": not opts.get("presolve", True)}):
            if deadline is not None and retry:
                opts["time_limit"] = max(0.0, deadline - time.monotonic())
            try:
                with warnings.catch_warnings():  # options scipy does not know are passed to HiGHS, with a warning
                    warnings.simplefilter("ignore", RuntimeWarning)
                    res = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
                               bounds=Bounds(lb, ub), options={**opts, **retry})
            except (ValueError, RuntimeError):  # HiGHS threw (its presolve did on a server-split model)
                res = None
                continue
            if res.x is not None or res.status in (1, 2):
                break
        if res is None or res.x is None:
            return None
        x = res.x
        group = {s.name: int(np.argmax([x[X(i, j)] for j in range(J)])) for i, s in enumerate(streams)}
        gm = [sorted({s.model for s in streams if group[s.name] == j}) for j in range(J)]
        # (c) holds only to HiGHS's feasibility tolerance (~1e-6): models a hair over a GPU's memory shared one.
        # Such a set is cut off in every group, with every set like it (_memory_cuts), and the ILP solved again.
        over = [ms for ms in gm if sum(problem.model_memory[m] for m in ms) > problem.gpu_memory + 1e-9]
        if not over:
            break
        mem = {m: problem.model_memory[m] for m in models}
        new = set().union(*(_memory_cuts(ms, mem, problem.gpu_memory) for ms in over))
        if not new - cut:  # every cut it breaks is in the ILP already
            raise RuntimeError(f"HiGHS broke a cut on the model sets {over} of the HERD ILP")
        for n, ms in new - cut:
            for j in range(J):
                rows.append(({Z(kidx[m], j): 1.0 for m in ms}, -np.inf, float(n)))
        cut |= new
    sizes = _fill(problem, group, [int(round(x[osz + j])) for j in range(J)])
    bt = burst_tolerance(problem, group, sizes)
    return HerdSolution(min(bt.values()) if bt else 0.0, group, sizes, gm, bt,
                        "optimal" if res.status == 0 else f"status {res.status}: {res.message}")


def _memory_cuts(over: Sequence[str], memory: Mapping[str, float], gpu_memory: float
                 ) -> set[tuple[int, tuple[str, ...]]]:
    """Cuts ``(n, E)`` (at most ``n`` models of ``E`` in one group) that a model set ``over`` that does not fit one
    GPU breaks, each one valid for every set (``memory``: the problem's models only).

    For each size ``t`` in ``over``: ``E`` = the models of at least ``t`` GB, ``n`` = how many of them fit at most
    (the ``n`` smallest). And an extended cover: ``C`` = ``over`` less its largest models while it still does not
    fit, ``E`` = ``C`` and every model at least as large as ``C``'s largest (any ``|C|`` of them weigh at least
    ``C``), ``n = |C| - 1``. Cutting ``over`` alone took one resolve per set: 20 models of 16/5 GB + 1e-8 on 16 GB
    GPUs (every five a hair over) ran 73 resolves in 2 minutes, unfinished."""
    fits = gpu_memory + 1e-9  # check_solution's and brute force's slack
    cuts = set()
    for t in sorted({memory[m] for m in over}):
        big = sorted((m for m in memory if memory[m] >= t), key=lambda m: (memory[m], m))
        n = total = 0
        while n < len(big) and total + memory[big[n]] <= fits:
            total += memory[big[n]]
            n += 1
        if sum(memory[m] >= t for m in over) > n:
            cuts.add((n, tuple(sorted(big))))
    cover = sorted(over, key=lambda m: (memory[m], m))
    for m in sorted(over, key=lambda m: (-memory[m], m)):
        rest = [k for k in cover if k != m]
        if sum(memory[k] for k in rest) > fits:
            cover = rest
    top = max(memory[m] for m in cover)
    cuts.add((len(cover) - 1, tuple(sorted(set(cover) | {m for m, v in memory.items() if v >= top}))))
    return cuts


def _fill(problem: HerdProblem, group: Mapping[str, int], sizes: list[int]) -> list[int]:
    """Hand GPUs the ILP left unused (it is indifferent to them) to non-full groups, the lowest burst tolerance
    first: the objective cannot drop and every stream gains headroom."""
    G, left = problem.g(), problem.num_gpus - sum(sizes)
    need = {}
    for s in problem.streams:
        need[group[s.name]] = max(need.get(group[s.name], 0.0), s.n)
    while left > 0:
        open_ = [j for j in need if sizes[j] < G]
        if not open_:
            break
        j = min(open_, key=lambda j: (sizes[j] / need[j], j))
        sizes[j] += 1
        left -= 1
    return sizes


def _best_sizes(need: Sequence[float], N: int, G: int) -> tuple[float, list[int]]:
    """Max ``t`` with integer sizes ``ceil(t * need_j) <= G`` and ``sum <= N`` (``need_j`` = the largest ``n_i`` in
    group j, 0 for an empty group): the optimum has some group at ``t = s / need_j``, so try those values."""
    cands = sorted({s / n for n in need if n > 0 for s in range(1, G + 1)}, reverse=True)
    for t in cands:
        sizes = [math.ceil(t * n - 1e-9) if n > 0 else 0 for n in need]
        if max(sizes, default=0) <= G and sum(sizes) <= N:
            return t, sizes
    return 0.0, [0] * len(need)


def brute_force_herd(problem: HerdProblem) -> HerdSolution | None:
    """Every assignment of streams to groups (``J^S``; small instances only), the best sizes for each."""
    streams = list(problem.streams)
    J, G, N = problem.num_groups(), problem.g(), problem.num_gpus
    if len(streams) > 8 or J ** len(streams) > 200_000:
        raise ValueError("instance too large for brute force")
    sets = [set(s) for s in problem.sets()]
    best: HerdSolution | None = None
    for assign in itertools.product(range(J), repeat=len(streams)):
        gm = [sorted({s.model for s, a in zip(streams, assign) if a == j}) for j in range(J)]
        if any(sum(problem.model_memory[m] for m in ms) > problem.gpu_memory + 1e-9 for ms in gm):
            continue
        if any(ms and not any(set(ms) <= c for c in sets) for ms in gm):
            continue
        need = [max((s.n for s, a in zip(streams, assign) if a == j), default=0.0) for j in range(J)]
        t, sizes = _best_sizes(need, N, G)
        if best is None or t > best.objective + 1e-12:
            group = {s.name: a for s, a in zip(streams, assign)}
            best = HerdSolution(t, group, sizes, gm, burst_tolerance(problem, group, sizes), "brute force")
    return best


def merge_model_streams(streams: Sequence[Stream]) -> list[Stream]:
    """The seed's scaling step: streams of one model become one model-stream whose burst tolerance is the lowest of
    its streams', i.e. ``n`` = the largest ``n_i`` (bt = size / n_i is lowest for the largest n_i)."""
    by: dict[str, float] = {}
    for s in streams:
        by[s.model] = max(by.get(s.model, 0.0), s.n)
    return [Stream(m, m, n) for m, n in sorted(by.items())]


@dataclass
class ChainAllocation:
    """``chains[model]`` chains for each model, ``groups[j]`` = {model: chains} and the min burst tolerance."""

    objective: float
    chains: dict[str, int]
    groups: list[dict[str, int]]


def solve_chain_allocation(need: Mapping[str, float], servers_per_chain: Mapping[str, int], num_servers: int,
                           g_bar: int | None = None) -> ChainAllocation | None:
    """Seed mapping §3.7: ``need[m]`` = chains model ``m`` needs for its average load (``rate_m / T_m``, ``T_m`` the
    goodput of one chain), a chain of ``m`` uses ``servers_per_chain[m]`` servers. Chosen: chains ``c_mj`` of each
    model in each group (each model in one group, ``>= 1`` chain there), at most ``g_bar`` chains per group and
    ``num_servers`` servers in all, maximizing ``min_m c_m / need[m]``. None if not every model gets a chain."""
    models = sorted(need)
    for m in models:
        if not (isinstance(need[m], numbers.Real) and math.isfinite(need[m]) and need[m] > 0):
            raise ValueError(f"need of {m!r} must be a positive number, got {need[m]!r}")
        _check_count(f"servers_per_chain of {m!r}", servers_per_chain.get(m), 1)
    _check_count("num_servers", num_servers, 0)
    if g_bar is not None:
        _check_count("g_bar", g_bar, 1)
    K = len(models)
    if K == 0:
        return ChainAllocation(0.0, {}, [])
    max_chains = sum(num_servers // max(1, int(servers_per_chain[m])) for m in models)
    G = max_chains if g_bar is None else max(1, min(g_bar, max_chains))
    J = max(1, -(-max_chains // G)) if max_chains else 1
    ox, oc, ot = 0, K * J, 2 * K * J
    nv = ot + 1
    rows: list[tuple[dict[int, float], float, float]] = []
    for k, m in enumerate(models):
        rows.append(({ot: 1.0, **{oc + k * J + j: -1.0 / float(need[m]) for j in range(J)}}, -np.inf, 0.0))
        rows.append(({ox + k * J + j: 1.0 for j in range(J)}, 1.0, 1.0))
        for j in range(J):
            rows.append(({oc + k * J + j: 1.0, ox + k * J + j: -float(G)}, -np.inf, 0.0))
            rows.append(({oc + k * J + j: 1.0, ox + k * J + j: -1.0}, 0.0, np.inf))
    for j in range(J):
        rows.append(({oc + k * J + j: 1.0 for k in range(K)}, -np.inf, float(G)))
    rows.append(({oc + k * J + j: float(servers_per_chain[m]) for k, m in enumerate(models) for j in range(J)},
                 -np.inf, float(num_servers)))
    A, lo, hi = _constraint_matrix(rows, nv)
    ub = np.concatenate([np.ones(K * J), np.full(K * J, float(G)), [np.inf]])
    integrality = np.concatenate([np.ones(2 * K * J), [0]])
    c = np.zeros(nv)
    c[ot] = -1.0
    res = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options={"mip_rel_gap": 1e-7})
    if res.x is None:
        return None
    cm = np.rint(res.x[oc:oc + K * J]).astype(int).reshape(K, J)
    chains = {m: int(cm[k].sum()) for k, m in enumerate(models)}
    groups = [{m: int(cm[k, j]) for k, m in enumerate(models) if cm[k, j]} for j in range(J)]
    return ChainAllocation(min(chains[m] / float(need[m]) for m in models), chains, groups)


# ---- runtime mapping: servers into the groups of several orchestrators ------------------------------------------
@dataclass(frozen=True)
class GroupServer:
    """A server as the group split sees it: ``blocks`` it can hold (its M_j), ``throughput`` in block-steps/s
    (``blocks / (tau_c + tau_p * blocks)``, what it adds to a group's chains)."""

    peer_id: str
    blocks: int
    throughput: float


def group_burst_tolerance(members: Sequence[GroupServer], demand: float, num_blocks: int) -> float:
    """A group's burst tolerance: the jobs/s its servers sustain (``sum throughput / L``) over the jobs/s that
    arrive at its orchestrator (``demand``); 0 when its servers cannot hold all ``num_blocks`` (no chain)."""
    if sum(s.blocks for s in members) < num_blocks:
        return 0.0
    return sum(s.throughput for s in members) / max(1, num_blocks) / max(demand, 1e-9)


def assign_server_groups(servers: Sequence[GroupServer], demand: Mapping[str, float], num_blocks: int,
                         previous: Mapping[str, str] | None = None, *, max_moves: int = 2,
                         margin: float = 0.1) -> dict[str, str]:
    """HERD for one model over several orchestrators (seed mapping §3.7): ``{server peer id: orchestrator}``.

    ``demand[o]``: jobs/s arriving at orchestrator ``o`` (its stream; a floor keeps idle ones in the game);
    the groups are ``demand``'s keys. Servers keep their ``previous`` group while its orchestrator is in
    ``demand`` (a move costs a re-plan and maybe a reload); the others go, largest first, to the group that has
    no complete copy of the model yet, else to the one of lowest burst tolerance. Then at most ``max_moves``
    servers move from the most to the least tolerant group, each only if the lower of the two tolerances rises
    by more than ``margin`` and the donor keeps a complete copy — HERD's max-min objective, greedily."""
    orchestrators = sorted(demand)
    if not orchestrators:
        return {}
    need = _demand_with_floor(demand)
    previous = previous or {}
    groups: dict[str, list[GroupServer]] = {o: [] for o in orchestrators}
    rest = []
    for s in servers:
        if previous.get(s.peer_id) in groups:
            groups[previous[s.peer_id]].append(s)
        else:
            rest.append(s)

    def blocks(o: str) -> int:
        return sum(s.blocks for s in groups[o])

    def bt(o: str, members: Sequence[GroupServer] | None = None) -> float:
        return group_burst_tolerance(groups[o] if members is None else members, need[o], num_blocks)

    for s in sorted(rest, key=lambda s: (-s.throughput, -s.blocks, s.peer_id)):
        uncovered = [o for o in orchestrators if blocks(o) < num_blocks]
        if uncovered:  # the group closest to a complete copy first: one chain somewhere beats two half-chains
            target = max(uncovered, key=lambda o: (blocks(o), need[o], o))
        else:
            target = min(orchestrators, key=lambda o: (bt(o), o))
        groups[target].append(s)
    # A group without a complete copy serves nothing: give it one from a group that keeps its own, if any can.
    for low in [o for o in orchestrators if blocks(o) < num_blocks]:
        for high in sorted(orchestrators, key=lambda o: (-bt(o), o)):
            if blocks(high) - num_blocks < num_blocks - blocks(low):
                continue
            moved = []
            for s in sorted(groups[high], key=lambda s: (-s.blocks, s.throughput, s.peer_id)):
                if blocks(low) >= num_blocks:
                    break
                if blocks(high) - s.blocks >= num_blocks:
                    groups[high].remove(s)
                    groups[low].append(s)
                    moved.append(s)
            if blocks(low) >= num_blocks:
                break
            for s in moved:  # not enough after all: undo
                groups[low].remove(s)
                groups[high].append(s)
    for _ in range(max_moves):
        if len(orchestrators) < 2:
            break
        low = min(orchestrators, key=lambda o: (bt(o), o))
        high = max(orchestrators, key=lambda o: (bt(o), o))
        if low == high:
            break
        before = min(bt(low), bt(high))
        best = None
        for s in sorted(groups[high], key=lambda s: (s.throughput, s.peer_id)):
            donor = [x for x in groups[high] if x is not s]
            if sum(x.blocks for x in donor) < num_blocks:
                continue
            after = min(bt(high, donor), bt(low, groups[low] + [s]))
            if after > before * (1 + margin) + 1e-12 and (best is None or after > best[0]):
                best = (after, s)
        if best is None:
            break
        groups[high].remove(best[1])
        groups[low].append(best[1])
    return {s.peer_id: o for o in orchestrators for s in groups[o]}


def split_score(servers: Sequence[GroupServer], demand: Mapping[str, float], num_blocks: int,
                 split: Mapping[str, str]) -> tuple[int, float]:
    """``(groups holding a complete copy, the lowest burst tolerance among them)`` of a split (demands floored as
    :func:`assign_server_groups` floors them; a group without a copy forwards its demand, shared evenly by the
    groups with one: :func:`covered_demand`)."""
    demand = _demand_with_floor(demand)
    by: dict[str, list[GroupServer]] = {o: [] for o in demand}
    for s in servers:
        by[split[s.peer_id]].append(s)
    covered = [o for o in demand if sum(s.blocks for s in by[o]) >= num_blocks]
    need = covered_demand(demand, covered)
    return len(covered), min((group_burst_tolerance(by[o], need[o], num_blocks) for o in covered), default=0.0)


def covered_demand(demand: Mapping[str, float], covered: Sequence[str]) -> dict[str, float]:
    """The jobs/s each group of ``covered`` (those holding a complete copy) serves: its own, and an even share of
    the groups' without a copy, whose orchestrators forward their requests. (Scored on its own demand alone, the
    one copy of a swarm went to the orchestrator that received least, and moved back and forth as the two
    demands crossed.)"""
    if not covered:
        return {}
    rest = sum(v for o, v in demand.items() if o not in covered)
    return {o: demand[o] + rest / len(covered) for o in covered}


def _demand_with_floor(demand: Mapping[str, float]) -> dict[str, float]:
    floor = max([v for v in demand.values() if v > 0], default=1.0) * 0.05
    return {o: max(float(v), floor) for o, v in demand.items()}


# Enumerate which groups hold a copy (no big-M) while there are at most this many choices.
_MAX_COVER_SETS = 64
# Server-split models up to this many variables (about 20 servers for 3 orchestrators) are solved again under another
# random seed (solve_server_groups): each solve takes milliseconds there; larger ones already run into the time limit.
_RESEED_MAX_VARS = 64
# Splits of at most this many servers are solved exactly (_max_covered, _exact_cover_split; HiGHS only where those run
# out of time): HiGHS called splits optimal that its cuts had cut off (4 % below the best). Whole splits of 12 servers
# over 3 / 4 / 5 orchestrators (30 random instances each, a third of identical servers, half with a previous split;
# 2 loaded cores): mean 15 / 28 / 97 ms, worst 74 / 105 / 551 ms (HiGHS alone: 98 / 192 / 547, worst 326 / 772 /
# 2,484 ms). The search alone over 14 servers and 5 orchestrators took up to 3.3 s: larger splits stay with HiGHS.
_EXACT_MAX_SERVERS = 12


def _max_covered(blocks: Sequence[int], num_blocks: int, groups: int, deadline: float) -> int | None:
    """The most of ``groups`` groups that can each hold ``num_blocks`` blocks with servers of ``blocks`` (one
    group each), exactly by a search over block counts; None if ``deadline`` (``time.monotonic``) passes first."""
    if num_blocks <= 0:
        return groups
    items = sorted((min(int(b), num_blocks) for b in blocks if b > 0), reverse=True)
    rest = list(itertools.accumulate(reversed(items), initial=0))[::-1]  # rest[i]: blocks of items[i:]
    failed: set[tuple[int, tuple[int, ...]]] = set()
    nodes = 0

    def fill(i: int, bins: tuple[int, ...]) -> bool:  # bins: blocks so far per group, ascending, capped
        nonlocal nodes
        nodes += 1
        if nodes % 1024 == 0 and time.monotonic() > deadline:
            raise TimeoutError
        if bins[0] >= num_blocks:
            return True
        if sum(num_blocks - b for b in bins) > rest[i] or (i, bins) in failed:
            return False
        for v in sorted({b for b in bins if b < num_blocks}):  # groups at the same count are interchangeable
            j = bins.index(v)
            if fill(i + 1, tuple(sorted(bins[:j] + (min(num_blocks, v + items[i]),) + bins[j + 1:]))):
                return True
        if fill(i + 1, bins):  # this server in a group that holds a copy already
            return True
        failed.add((i, bins))
        return False

    try:
        return next((k for k in range(groups, 0, -1) if fill(0, (0,) * k)), 0)
    except TimeoutError:
        return None


def _exact_cover_split(throughput: Sequence[float], blocks: Sequence[int], weights: Sequence[float], num_blocks: int,
                       above: float | None, deadline: float) -> tuple[float | None, list[int] | None, bool]:
    """Every server into one of ``len(weights)`` groups, each holding ``num_blocks`` blocks, maximizing
    ``r = min_j (throughput in j) / weights[j]``, by branch and bound: ``(r, group of each server, finished)``.

    Only splits with ``r`` above ``above`` (relative 1e-9) are looked for: ``(None, None, True)`` says there is none.
    Servers alike (throughput, blocks) are placed as one kind (how many per group) and groups alike at a node as
    one; a node is cut when the blocks left cannot complete every group, or when even pouring the throughput left
    into the lowest groups (water-filling) does not beat the best ``r`` so far. ``finished`` is False when
    ``deadline`` passed first: then ``r`` is the best found (or None)."""
    L, c = num_blocks, len(weights)
    kinds: dict[tuple[float, int], list[int]] = {}
    for i, (t, b) in enumerate(zip(throughput, blocks)):
        kinds.setdefault((float(t), min(int(b), max(L, 0))), []).append(i)
    order = sorted(kinds, key=lambda k: (-k[0], -k[1]))  # fastest first: good splits early, cuts sooner
    th, bl, cnt = [k[0] for k in order], [k[1] for k in order], [len(kinds[k]) for k in order]
    K = len(order)
    rest_t, rest_b, rest_n = [0.0] * (K + 1), [0] * (K + 1), [0] * (K + 1)
    for k in range(K - 1, -1, -1):
        rest_t[k] = rest_t[k + 1] + th[k] * cnt[k]
        rest_b[k] = rest_b[k + 1] + bl[k] * cnt[k]
        rest_n[k] = rest_n[k + 1] + (cnt[k] if bl[k] > 0 else 0)
    w = [float(x) for x in weights]
    best_r, best = above, None
    take = [[0] * c for _ in range(K)]  # servers of each kind in each group
    nodes = 0
    tol = 1.0 + 1e-9

    def bound(T: tuple[float, ...], R: float) -> float:  # the highest min level R more throughput can reach
        lv = sorted(range(c), key=lambda j: T[j] / w[j])
        W = base = 0.0
        for m, j in enumerate(lv):
            W, base = W + w[j], base + T[j]
            if m + 1 == c or (R + base) / W <= T[lv[m + 1]] / w[lv[m + 1]]:
                return (R + base) / W
        return math.inf

    def place(k: int, T: tuple[float, ...], B: tuple[int, ...]) -> None:
        nonlocal nodes, best_r, best
        nodes += 1
        if nodes % 1024 == 0 and time.monotonic() > deadline:
            raise TimeoutError
        short = [L - b for b in B if b < L]
        if sum(short) > rest_b[k] or len(short) > rest_n[k]:
            return
        if k == K:
            r = min(T[j] / w[j] for j in range(c))
            if best_r is None or r > best_r * tol:
                best_r, best = r, [row[:] for row in take]
            return
        if best_r is not None and bound(T, rest_t[k]) <= best_r * tol:
            return
        groups = sorted(range(c), key=lambda j: (T[j] / w[j], j))  # the lowest group gets the most first
        keys = [(T[j], min(B[j], L), w[j]) for j in groups]
        # a group alike an earlier one (same state and weight) takes at most as many: the rest are relabellings
        twin = [max((q for q in range(p) if keys[q] == keys[p]), default=-1) for p in range(c)]
        given = [0] * c

        def spread(p: int, left: int, T: tuple[float, ...], B: tuple[int, ...]) -> None:
            j = groups[p]
            most = left if twin[p] < 0 else min(left, given[twin[p]])
            for m in range(most, (left if p + 1 == c else 0) - 1, -1):
                given[p] = take[k][j] = m
                T2 = T[:j] + (T[j] + th[k] * m,) + T[j + 1:] if m else T
                B2 = B[:j] + (B[j] + bl[k] * m,) + B[j + 1:] if m else B
                if p + 1 == c:
                    place(k + 1, T2, B2)
                else:
                    spread(p + 1, left - m, T2, B2)
            take[k][j] = 0

        spread(0, cnt[k], T, B)

    finished = True
    try:
        place(0, (0.0,) * c, (0,) * c)
    except TimeoutError:
        finished = False
    if best is None:
        return None, None, finished
    split = [0] * len(throughput)
    for k, key in enumerate(order):
        members = iter(kinds[key])
        for j in range(c):
            for _ in range(best[k][j]):
                split[next(members)] = j
    return best_r, split, finished


def solve_server_groups(servers: Sequence[GroupServer], demand: Mapping[str, float], num_blocks: int,
                        previous: Mapping[str, str] | None = None, *, margin: float = 0.1,
                        time_limit_s: float = 2.0, mip_rel_gap: float = 1e-4) -> dict[str, str] | None:
    """The split of :func:`assign_server_groups` as HERD's ILP (scipy ``milp``): ``x_sj`` (server ``s`` in group
    ``j``) and ``t`` (the lowest burst tolerance over the groups holding a complete copy). First as many covered
    groups as the servers allow (with ``u_j``: ``sum_s blocks_s x_sj >= L u_j``), then the highest ``t`` for each
    set of that many groups (a set's groups must hold a copy and serve the others' demand too,
    :func:`covered_demand`; the others are free: no big-M), then, with a
    ``previous`` split, the fewest moves among the sets that keep ``t`` within ``margin`` of the best. Only when
    there are more than ``_MAX_COVER_SETS`` such sets does ``t`` use the big-M link ``t <= bt_j + M (1 - u_j)``.
    Up to ``_EXACT_MAX_SERVERS`` servers, the first two steps are exact searches instead (HiGHS where they run out
    of time, the better kept). ``time_limit_s`` bounds the whole split (every solve); None if the solver fails (the
    caller falls back to the greedy split)."""
    if not time_limit_s > 0:  # NaN too: HiGHS would get no time and the split would silently be the greedy one
        raise ValueError(f"time_limit_s must be a positive number, got {time_limit_s!r}")
    deadline = time.monotonic() + time_limit_s
    groups = sorted(demand)
    if not groups:
        return {}
    servers = list(servers)
    if not servers:
        return {}
    need = _demand_with_floor(demand)
    S, J = len(servers), len(groups)
    # bt normalized by the pooled tolerance (every server for all the demand), so t <= big = sum d / min d (the
    # whole swarm for the least loaded orchestrator): big is also the tightest big-M for an uncovered group
    pooled = sum(s.throughput for s in servers) / max(1, num_blocks) / sum(need.values())
    scale = pooled if pooled > 0 else 1.0
    big = max(1.0, sum(need.values()) / min(need.values())) if pooled > 0 else 1.0
    X = lambda i, j: i * J + j  # noqa: E731
    U = lambda j: S * J + j  # noqa: E731
    WITH_U = None  # model key: u_j variables (and big-M rows on t), instead of a fixed set of covered groups

    def budget(share: float) -> float:
        """The deadline of a step given ``share`` of the time left."""
        now = time.monotonic()
        return now + max(0.0, deadline - now) * share

    @functools.cache
    def model(cover: frozenset[int] | None) -> tuple[list, int]:
        """Rows and variable count: ``x``, then ``u`` for the ``WITH_U`` model, then ``t`` (index ``nv - 1``).
        ``cover``: the groups that must hold a copy and bound ``t``."""
        T = S * J + (J if cover is WITH_U else 0)
        rows: list[tuple[dict[int, float], float, float]] = []
        for i in range(S):
            rows.append(({X(i, j): 1.0 for j in range(J)}, 1.0, 1.0))
        # a fixed cover serves the uncovered groups' demand too; the u_j model (cover unknown) scores own demand
        served = need if cover is WITH_U else {**need, **covered_demand(need, [groups[j] for j in cover])}
        for j, o in enumerate(groups):
            hold = {X(i, j): float(s.blocks) for i, s in enumerate(servers)}
            coef = {X(i, j): -s.throughput / max(1, num_blocks) / served[o] / scale for i, s in enumerate(servers)}
            # t's row divided by its largest x coefficient (the same constraint): HiGHS's root cuts cut the optimum
            # off less often with x coefficients in [-1, 0] (18 of 300 solves of 15 such instances, 65 undivided)
            norm = max((-c for c in coef.values()), default=0.0) or 1.0
            coef = {v: c / norm for v, c in coef.items()}
            if cover is WITH_U:  # sum blocks x >= L u;  t <= bt_j / scale + big (1 - u_j)
                rows.append(({**hold, U(j): -float(num_blocks)}, 0.0, np.inf))
                rows.append(({T: 1.0 / norm, **coef, U(j): big / norm}, -np.inf, big / norm))
            elif j in cover:  # sum blocks x >= L;  t <= bt_j / scale
                rows.append((hold, float(num_blocks), np.inf))
                rows.append(({T: 1.0 / norm, **coef}, -np.inf, 0.0))
        return rows, T + 1

    def solve(objective_at: Mapping[int, float], cover: frozenset[int] | None, extra: Sequence = (), *,
              stop: float) -> np.ndarray | None:
        """The model's optimum, found by ``stop`` (``time.monotonic``; None: no answer)."""
        rows, nv = model(cover)
        objective = np.zeros(nv)
        for v, c in objective_at.items():
            objective[nv - 1 if v < 0 else v] = c
        extra = [({nv - 1 if v < 0 else v: c for v, c in coef.items()}, a, b) for coef, a, b in extra]
        A, lo, hi = _constraint_matrix(rows + extra, nv)
        lb, ub = np.zeros(nv), np.ones(nv)
        ub[nv - 1] = big
        integrality = np.ones(nv)
        integrality[nv - 1] = 0
        # HiGHS (scipy 1.17) ends some small instances in "solve error" (status 4), and returns a worse cover or
        # split as optimal (gap 0) with presolve on (HiGHS issue 3094's kind; with the u_j links, and more rarely
        # without: t 10.0 for 10.25 on a fixed cover of three groups) and, more rarely still, with it off (0.919 for
        # 0.980), or throws (known instances in tests/test_herd_groups.py): solved both ways, the better kept.
        # Both ways can be wrong at once: its cuts cut the optimum off under some random seeds (16.0 called optimal
        # for 16.2 under 9 of 80 seed x presolve settings, under 26 of 80 in another instance), so a small model is
        # solved a third time under another seed unless a solve ran out of time (16 instances wrong both ways,
        # found around the two Hypothesis found: 1 still wrong with the t rows divided and the third solve; small
        # splits are solved exactly first, so this is their fallback).
        best = None
        reseed = nv <= _RESEED_MAX_VARS
        settings = [{"presolve": False}, {}, {"presolve": False, "random_seed": 1},
                    {"presolve": False, "mip_feasibility_tolerance": 1e-7}]
        for n, extra_options in enumerate(settings):
            if "random_seed" in extra_options and not reseed:
                continue
            if best is not None and "mip_feasibility_tolerance" in extra_options:
                break  # the last setting is only for when none of the others gave an answer
            # the call's time shared by the settings still planned: one solve that runs out of time leaves the next
            # its share (each used to get the whole limit: a split of 20 servers took twice its time_limit_s)
            limit = (stop - time.monotonic()) / {0: 2 + reseed, 1: 1 + reseed}.get(n, 1)
            if limit <= 0:
                break
            try:
                with warnings.catch_warnings():  # options scipy does not know are passed to HiGHS, with a warning
                    warnings.simplefilter("ignore", RuntimeWarning)
                    res = milp(objective, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
                               bounds=Bounds(lb, ub), options={"time_limit": limit,
                                                               "mip_rel_gap": mip_rel_gap, **extra_options})
            except (ValueError, RuntimeError):  # HiGHS's presolve threw std::length_error on one known model
                continue
            if res.status == 1:  # out of time: not called optimal, and another seed would only spend another limit
                reseed = False
            if res.x is not None and (best is None or res.fun < best.fun - 1e-9):
                best = res
        return None if best is None else best.x

    def count_covered(x: np.ndarray) -> int:
        return int(round(sum(x[U(j)] for j in range(J))))

    T = -1  # t, wherever the model puts it
    prev = {s.peer_id: previous[s.peer_id] for s in servers if previous and previous.get(s.peer_id) in demand}
    exact = S <= _EXACT_MAX_SERVERS
    blocks, throughput = [s.blocks for s in servers], [s.throughput for s in servers]
    # the most groups with a complete copy: exactly for a few servers (a count of blocks), else by the u_j model
    covered = _max_covered(blocks, num_blocks, J, budget(1 / 3)) if exact else None
    x = None
    if not covered:
        x = solve({U(j): -1.0 for j in range(J)}, WITH_U, stop=budget(1 / 3))
        if x is None:
            return None
        covered = max(covered or 0, count_covered(x))
    # then the best worst t: per set of `covered` groups, or (too many sets) with u_j and the cover count fixed
    if covered == 0:
        candidates = [(0.0, WITH_U, [], x)]
    elif math.comb(J, covered) <= _MAX_COVER_SETS:
        candidates = []
        covers = list(map(frozenset, itertools.combinations(range(J), covered)))
        for n, cover in enumerate(covers):
            stop = budget(1 / (len(covers) - n + bool(prev)))  # this set's part of the time left (the moves' too)
            got = None  # (t, x)
            finished = False
            if exact:
                js = sorted(cover)
                served = covered_demand(need, [groups[j] for j in js])
                # only sets that can beat the best so far (within the moves' margin) matter: the search cuts the rest
                top = max((c[0] for c in candidates), default=None)
                above = None if top is None else top * scale * max(1, num_blocks) * ((1 - margin) if prev else 1.0)
                # half this set's time: HiGHS gets the rest if the search cannot finish in it
                r, split, finished = _exact_cover_split(throughput, blocks, [served[groups[j]] for j in js],
                                                        num_blocks, above, (time.monotonic() + stop) / 2)
                if split is not None:
                    y = np.zeros(S * J + 1)
                    for i, j in enumerate(split):
                        y[X(i, js[j])] = 1.0
                    y[-1] = r / max(1, num_blocks) / scale
                    got = (float(y[-1]), y)
            if not finished:  # no exact answer in time (or none tried): HiGHS, the better kept
                y = solve({T: -1.0}, cover, stop=stop)
                if y is not None and (got is None or float(y[-1]) > got[0]):
                    got = (float(y[-1]), y)
            if got is not None:
                candidates.append((got[0], cover, [], got[1]))
    else:
        fix = [({U(j): 1.0 for j in range(J)}, covered, covered)]
        y = solve({T: -1.0}, WITH_U, fix, stop=budget(1 / (1 + bool(prev))))
        candidates = [] if y is None else [(float(y[-1]), WITH_U, fix, y)]
    if not candidates:
        return None
    t_star, _, _, x = max(candidates, key=lambda c: c[0])
    if prev:
        stay = {X(i, groups.index(prev[s.peer_id])): -1.0 for i, s in enumerate(servers) if s.peer_id in prev}
        floor = [({T: 1.0}, t_star * (1 - margin) - 1e-12, np.inf)]
        best_stay = None
        near = [c for c in candidates if c[0] >= t_star * (1 - margin) - 1e-12]
        for n, (t_c, cover, fix, _) in enumerate(near):
            y = solve(stay, cover, fix + floor, stop=budget(1 / (len(near) - n)))
            if y is not None:
                kept = sum(y[v] for v in stay)
                if best_stay is None or kept > best_stay + 0.5:
                    best_stay, x = kept, y
    return {s.peer_id: groups[int(np.argmax([x[X(i, j)] for j in range(J)]))] for i, s in enumerate(servers)}


def brute_force_server_groups(servers: Sequence[GroupServer], demand: Mapping[str, float],
                              num_blocks: int) -> tuple[int, float]:
    """The best ``(covered groups, lowest burst tolerance among them)`` over every split (tests: small only)."""
    groups = sorted(demand)
    best = (0, 0.0)
    for choice in itertools.product(groups, repeat=len(servers)):
        score = split_score(servers, demand, num_blocks, {s.peer_id: o for s, o in zip(servers, choice)})
        best = max(best, score)
    return best
