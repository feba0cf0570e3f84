"""Event-driven simulators of the paper's system model (§2.1).

Two kinds of policies are simulated:

* **Chain dispatch** (:func:`simulate_chains`): chains are ``c_k``-server stations. A dispatcher with
  the shared interface (``arrive(job) -> k | None``, ``complete(k) -> job | None``; JFFC keeps one central
  queue, JSQ/JIQ/SED/SA-JSQ keep one FIFO per chain) decides everything; the simulator only keeps time.
* **Per-request routing** (:func:`simulate_routed`, PETALS and BPRR): on arrival a route (list of
  ``(server, start, end)`` hops) is chosen from the current free slots; the job then acquires
  ``end - start`` cache slots at each hop *in route order*, waiting FIFO at a server that lacks them
  while holding the slots it already has (as a PETALS client holds its open sessions). Its service
  starts once every hop is held, and all slots are released when it completes. Routes visit servers
  by strictly increasing span end, so all jobs acquire in one global order and no deadlock can occur.

Service times are linear in per-job features (:class:`CostModel`): a hop of ``m`` blocks at server
``j`` costs ``size * (c0_j + m p0_j + m pI_j l_in + (cO_j + m pO_j)(l_out - 1))``. With Poisson
workloads only ``c0 = tau_c`` and ``p0 = tau_p`` are non-zero and ``size ~ Exp(1)``, i.e. the
paper's ``size * T_k``; trace replay sets ``size = 1`` and uses the footnote-11 model
``tau_p = t_o + t_I l_in + t_O (l_out - 1)`` plus a per-token relay cost (see ``scenarios.py``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from petals_chain.model import Chain, ServerSpec

Hop = tuple[str, int, int]


@dataclass(frozen=True)
class ServerCost:
    """Per-server coefficients of the linear service-time model (seconds)."""

    c0: float  # communication per job (tau_c for Poisson workloads; first token for traces)
    p0: float  # computation per block per job (tau_p, or t_o for traces)
    pI: float = 0.0  # per block per input token (t_I)
    pO: float = 0.0  # per block per further output token (t_O)
    cO: float = 0.0  # communication per further output token (orchestrator relay)


class CostModel:
    """Maps (route or chain, job) to a service time; see the module docstring."""

    def __init__(self, costs: Mapping[str, ServerCost]):
        self.costs = dict(costs)

    @classmethod
    def from_servers(cls, servers: Sequence[ServerSpec]) -> "CostModel":
        """The paper's Poisson model: a hop costs ``tau_c_j + tau_p_j m_ij`` per unit of job size."""
        return cls({s.name: ServerCost(c0=s.tau_c, p0=s.tau_p) for s in servers})

    def coefficients(self, hops: Sequence[tuple[str, int]]) -> np.ndarray:
        """``(v0, vI, vO)`` of a route given as ``(server, m_ij)`` pairs: time = size*(v0 + vI l_in + vO (l_out-1))."""
        v0 = vI = vO = 0.0
        for name, m in hops:
            sc = self.costs[name]
            v0 += sc.c0 + m * sc.p0
            vI += m * sc.pI
            vO += sc.cO + m * sc.pO
        return np.array([v0, vI, vO])

    def chain_coefficients(self, chain: Chain) -> np.ndarray:
        return self.coefficients(list(zip(chain.servers, chain.blocks)))

    def route_coefficients(self, route: Sequence[Hop]) -> np.ndarray:
        return self.coefficients([(name, end - start) for name, start, end in route])


@dataclass
class Workload:
    """Arrival times (s, non-decreasing) and per-job features ``size*(1, l_in, l_out-1)``."""

    arrivals: np.ndarray
    features: np.ndarray  # shape (n, 3)

    def __post_init__(self) -> None:
        self.arrivals = np.asarray(self.arrivals, dtype=np.float64)
        self.features = np.asarray(self.features, dtype=np.float64)
        if self.features.shape != (len(self.arrivals), 3):
            raise ValueError(f"features must have shape ({len(self.arrivals)}, 3), got {self.features.shape}")
        if len(self.arrivals) and (np.any(np.diff(self.arrivals) < 0) or self.arrivals[0] < 0):
            raise ValueError("arrivals must be non-negative and non-decreasing")

    def __len__(self) -> int:
        return len(self.arrivals)

    @classmethod
    def poisson(cls, rate: float, n: int, rng: np.random.Generator) -> "Workload":
        """Poisson arrivals of ``rate`` with i.i.d. Exp(1) job sizes (§4.1.1)."""
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"arrival rate must be positive and finite, got {rate!r}")
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
        feats = np.zeros((n, 3))
        feats[:, 0] = rng.exponential(1.0, n)
        return cls(arrivals, feats)

    @classmethod
    def from_lengths(cls, arrivals: np.ndarray, l_in: np.ndarray, l_out: np.ndarray) -> "Workload":
        """Trace replay: ``size = 1``, features ``(1, l_in, l_out - 1)``."""
        feats = np.column_stack([np.ones(len(arrivals)), np.asarray(l_in, float), np.maximum(np.asarray(l_out, float) - 1, 0)])
        return cls(np.asarray(arrivals, float), feats)


@dataclass
class SimResult:
    """Per-job times of one simulation run (jobs after the warm-up only) and run statistics."""

    response: np.ndarray
    wait: np.ndarray
    service: np.ndarray
    events: int
    wall_s: float
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        if len(self.response) == 0:
            return {"mean_response_s": math.nan, "p95_response_s": math.nan, "mean_wait_s": math.nan,
                    "mean_service_s": math.nan, "jobs": 0}
        return {
            "mean_response_s": float(self.response.mean()),
            "p95_response_s": float(np.percentile(self.response, 95)),
            "mean_wait_s": float(self.wait.mean()),
            "mean_service_s": float(self.service.mean()),
            "jobs": int(len(self.response)),
        }


def _finish(arr: np.ndarray, start: np.ndarray, end: np.ndarray, warmup: int, events: int, t0: float,
            extra: dict | None = None) -> SimResult:
    if np.any(np.isnan(end)):
        raise RuntimeError("simulation ended with unfinished jobs")  # every job must complete
    sl = slice(warmup, None)
    return SimResult(response=(end - arr)[sl], wait=(start - arr)[sl], service=(end - start)[sl], events=events,
                     wall_s=time.perf_counter() - t0, extra=extra or {})


def simulate_chains(chains: Sequence[Chain], dispatcher, workload: Workload, cost: CostModel | None = None, *,
                    warmup: int = 0) -> SimResult:
    """Run ``workload`` through ``dispatcher`` over ``chains`` (each a ``c_k``-server station).

    ``dispatcher.arrive(i)`` returns the chain index for job ``i`` or None (queued centrally). A job sent
    to a chain that already runs ``c_k`` jobs waits in that chain's own FIFO (JSQ-like baselines);
    ``dispatcher.complete(k)`` names the job that starts next on chain ``k``. Service of job ``i`` on
    chain ``k`` is ``features[i] . coef_k`` (``size * T_k`` for Poisson workloads).
    """
    t0 = time.perf_counter()
    n = len(workload)
    if not chains:
        raise ValueError("no chains to dispatch to")
    if cost is None:
        coef = np.array([[ch.service_time, 0.0, 0.0] for ch in chains])
    else:
        coef = np.array([cost.chain_coefficients(ch) for ch in chains])
    caps = [int(ch.capacity) for ch in chains]
    # service time of every job on every chain, precomputed in one matrix product
    svc = workload.features @ coef.T  # (n, K)
    arr = workload.arrivals
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    running = [0] * len(chains)
    heap: list[tuple[float, int, int]] = []  # (completion time, job, chain)
    events = 0
    push, pop = heapq.heappush, heapq.heappop

    def begin(job: int, k: int, now: float) -> None:
        start[job] = now
        done = now + svc[job, k]
        end[job] = done
        push(heap, (done, job, k))

    def complete_one() -> None:
        now, _, k = pop(heap)
        nxt = dispatcher.complete(k)
        if nxt is None:
            running[k] -= 1
        else:
            begin(int(nxt), k, now)

    for i in range(n):
        t = arr[i]
        while heap and heap[0][0] <= t:
            complete_one()
            events += 1
        k = dispatcher.arrive(i)
        events += 1
        if k is not None:
            if running[k] < caps[k]:
                running[k] += 1
                begin(i, k, t)
            # else: waits in chain k's own FIFO until dispatcher.complete(k) returns it
    while heap:
        complete_one()
        events += 1
    if getattr(dispatcher, "queue_length", 0):
        raise RuntimeError("dispatcher still holds queued jobs after all completions")
    return _finish(arr, start, end, warmup, events, t0)


RouteFn = Callable[[dict[str, int], dict[str, float]], list[Hop]]


def simulate_routed(route_fn: RouteFn, slots: Mapping[str, int], workload: Workload, cost: CostModel, *,
                    warmup: int = 0, check_slots: bool = False,
                    route_key: Callable[[dict[str, int], dict[str, float]], object] | None = None) -> SimResult:
    """Per-request routing with hold-and-wait slot acquisition (module docstring).

    ``route_fn(free_slots, expected_wait)`` picks a route at each arrival. ``free_slots[name]`` is what a new hop
    can take at once (0 at a server with a queue: FIFO); ``expected_wait[name]`` estimates how long a hop that
    finds too few would wait: ``(queued demand + 1) / slots_total * mean holding time`` (slots turn over at rate
    ``slots_total / mean holding time``; the mean is the running mean of completed jobs' service times).
    With ``check_slots`` every acquisition asserts ``0 <= free <= total`` (for tests).
    ``route_key(free_slots, expected_wait)``, when given, must map states on which ``route_fn`` returns
    the same route to the same hashable key; routes are then memoized by key.
    """
    t0 = time.perf_counter()
    n = len(workload)
    total = {name: int(v) for name, v in slots.items()}
    free = dict(total)
    queues: dict[str, deque] = {name: deque() for name in total}  # (job, need)
    queued_demand = {name: 0 for name in total}
    routes: list[list[Hop] | None] = [None] * n
    next_hop = [0] * n
    svc = np.zeros(n)
    arr = workload.arrivals
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    heap: list[tuple[float, int]] = []
    events = 0
    hold_sum, hold_n = 0.0, 0
    max_used = {name: 0 for name in total}
    push, pop = heapq.heappush, heapq.heappop
    feats = workload.features

    def take(name: str, need: int) -> None:
        free[name] -= need
        if check_slots:
            assert 0 <= free[name] <= total[name], (name, free[name], total[name])
            max_used[name] = max(max_used[name], total[name] - free[name])

    def advance(job: int, now: float) -> None:
        """Acquire the job's remaining hops in order; start it when all are held."""
        route = routes[job]
        h = next_hop[job]
        while h < len(route):
            name, s, e = route[h]
            need = e - s
            q = queues[name]
            if q or free[name] < need:
                q.append((job, need))
                queued_demand[name] += need
                next_hop[job] = h
                return
            take(name, need)
            h += 1
        next_hop[job] = h
        start[job] = now
        done = now + svc[job]
        end[job] = done
        push(heap, (done, job))

    def release(job: int, now: float) -> None:
        nonlocal hold_sum, hold_n
        hold_sum += svc[job]
        hold_n += 1
        for name, s, e in routes[job]:
            free[name] += e - s
            q = queues[name]
            # FIFO: only the head may take freed slots, so a big request is never starved
            while q and q[0][1] <= free[name]:
                j2, need = q.popleft()
                queued_demand[name] -= need
                take(name, need)  # j2 was waiting for exactly this hop
                next_hop[j2] += 1
                advance(j2, now)

    mean_guess = float(np.mean(feats[:, 0])) if n else 0.0
    route_cache: dict = {}
    for i in range(n):
        t = arr[i]
        while heap and heap[0][0] <= t:
            now, j = pop(heap)
            release(j, now)
            events += 1
        h = hold_sum / hold_n if hold_n else mean_guess
        # The wait a hop faces where it cannot start at once; routers add it only where free < m_ij. A server with
        # a queue starts no new hop before the queue (FIFO): it shows no free slot. (The wait was 0 wherever one
        # slot was free, so a 4-block hop went to a server with 2 free slots and waited there.)
        expected_wait = {name: (queued_demand[name] + 1) / max(total[name], 1) * h for name in total}
        startable = {name: 0 if queues[name] else free[name] for name in total}
        if route_key is not None:
            key = route_key(startable, expected_wait)
            route = route_cache.get(key)
            if route is None:
                route = route_cache[key] = route_fn(dict(startable), expected_wait)
        else:
            route = route_fn(dict(startable), expected_wait)
        if not route:
            raise RuntimeError(f"router returned no route for job {i}")
        for name, s, e in route:
            if name not in total:
                raise RuntimeError(f"route uses unknown server {name!r}")
            if e - s > total[name]:
                raise RuntimeError(f"route needs {e - s} slots at {name!r}, which has only {total[name]}")
        routes[i] = list(route)
        svc[i] = float(feats[i] @ cost.route_coefficients(route))
        events += 1
        advance(i, t)
    while heap:
        now, j = pop(heap)
        release(j, now)
        events += 1
    return _finish(arr, start, end, warmup, events, t0, extra={"max_used": max_used, "slots": total})


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the Student-t confidence interval at ``level`` over the finite ``values`` (one per
    independent run). The normal quantile 1.96 made a "95 %" interval of 3 runs (``--quick``) 2.2x too narrow, of
    20 runs 7 % too narrow."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return math.nan, math.nan
    if len(v) == 1:
        return float(v[0]), math.inf
    from scipy.special import stdtrit  # the t quantile; scipy.stats would add ~1 s to every import of this module

    q = float(stdtrit(len(v) - 1, 0.5 + level / 2))
    return float(v.mean()), float(q * v.std(ddof=1) / math.sqrt(len(v)))
