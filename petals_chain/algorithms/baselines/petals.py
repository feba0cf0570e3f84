"""PETALS' own block placement and per-request min-latency routing (the paper's baseline, §4.1.3).

Placement: servers join one by one in random order; each hosts
``m = min(L, floor((M - reserve) / (s_m + s_c cache_tokens / max_length)))`` blocks (PETALS reserves a
fixed attention cache of ``cache_tokens`` tokens per block) and takes the window of ``m`` blocks
that covers the weakest part of the swarm by announced throughput. Upstream PETALS compares the
windows' per-block throughputs sorted ascending, lexicographically (``window_rule="sorted"``); the
authors' simulator minimizes the window's sum (``"sum"``); ties go to the smallest start. A server
announces ``min(forward_rps / ((m + 1) / 2), network_rps)`` with ``forward_rps = 1 / tau_p``.

Routing: each request takes the min-latency route: per hop ``RTT/2 + overhead`` (``RTT = tau_c -
overhead``, since ``tau_c`` = RTT + overhead in the paper's setting), ``tau_p`` per block, plus
``cache_penalty`` seconds on a server with fewer free slots than the blocks it would process;
servers are switched only at the end of a span.

No prefix locality: PETALS has no cache of prompt prefixes shared across requests (a session's attention cache
lives only as long as its inference session), so a route depends on the swarm's latencies and free slots alone.
The orchestrator's preference for a chain that holds a job's cached prefix (``DispatchJob.prefer``) is not used by
this baseline (``orchestrator/routed.py``), and the simulator's jobs carry no prefix at all.
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping, Sequence

import numpy as np

from petals_chain.algorithms.baselines.routing import Hop, _free_array, _placed_servers, min_cost_route
from petals_chain.model import ModelSpec, Placement, ServerSpec


def petals_num_blocks(server: ServerSpec, model: ModelSpec, *, cache_tokens: int = 4096,
                      max_length: int = 2048, reserve: float = 0.0) -> int:
    """Blocks PETALS loads on ``server``: ``min(L, floor((M - reserve)/(s_m + s_c cache_tokens/max_length)))``."""
    per_block = model.block_size + model.cache_size * cache_tokens / max_length
    return max(0, min(server.block_cap(model), int(max(0.0, server.memory - reserve) // per_block)))


def petals_cache_slots(num_blocks: int, *, cache_tokens: int = 4096, max_length: int = 2048) -> int:
    """Slots (block x job at ``max_length``) in PETALS' fixed cache of ``cache_tokens`` per block."""
    return int(num_blocks * cache_tokens // max_length)


def petals_throughput(server: ServerSpec, num_blocks: int, network_rps: float = math.inf) -> float:
    """Announced throughput ``min(forward_rps / ((m + 1)/2), network_rps)``, ``forward_rps = 1/tau_p``."""
    forward_rps = 1.0 / server.tau_p if server.tau_p > 0 else math.inf
    return min(forward_rps / ((num_blocks + 1) / 2.0), network_rps)


def _choose_start(throughputs: np.ndarray, m: int, rule: str) -> int:
    L = len(throughputs)
    if rule == "sum":
        sums = np.convolve(throughputs, np.ones(m), mode="valid")  # window sums, starts 0..L-m
        return int(np.argmin(sums))
    best = None
    for i in range(L - m + 1):
        key = sorted(throughputs[i:i + m].tolist())
        if best is None or key < best[0]:
            best = (key, i)
    return best[1]


def petals_placement(servers: Sequence[ServerSpec], model: ModelSpec, *, rng: Any = None,
                     window_rule: str = "sorted", cache_tokens: int = 4096, max_length: int = 2048,
                     reserve: float = 0.0, network_rps: Mapping[str, float] | None = None) -> Placement:
    """PETALS' greedy placement (see module doc); ``rng`` shuffles the join order (None: given order)."""
    if window_rule not in ("sorted", "sum"):
        raise ValueError(f"window_rule must be 'sorted' or 'sum', got {window_rule!r}")
    if cache_tokens < 0 or max_length < 1:
        raise ValueError("cache_tokens must be >= 0 and max_length >= 1")
    order = list(servers)
    if rng is not None:
        if isinstance(rng, int):
            rng = random.Random(rng)
        if hasattr(rng, "permutation"):  # numpy Generator
            order = [order[i] for i in rng.permutation(len(order))]
        else:
            rng.shuffle(order)
    L = model.num_blocks
    throughputs = np.zeros(L)
    spans = {}
    for s in order:
        m = petals_num_blocks(s, model, cache_tokens=cache_tokens, max_length=max_length, reserve=reserve)
        if m < 1:
            continue
        start = _choose_start(throughputs, m, window_rule)
        throughputs[start:start + m] += petals_throughput(s, m, (network_rps or {}).get(s.name, math.inf))
        spans[s.name] = (start, m)
    return Placement(spans, num_blocks=L)


def petals_route(servers: Sequence[ServerSpec], model: ModelSpec, placement: Mapping[str, tuple[int, int]],
                 free_slots: Mapping[str, int], *, overhead: float = 0.018,
                 cache_penalty: float = 10.0) -> list[Hop]:
    """PETALS' min-latency route for one request; raises ValueError if the blocks are not covered."""
    names, specs, a, m = _placed_servers(servers, model, placement)
    tau_c = np.array([s.tau_c for s in specs], dtype=float)
    base = np.maximum(tau_c - overhead, 0.0) / 2.0 + overhead
    per_block = np.array([s.tau_p for s in specs], dtype=float)
    route = min_cost_route(names, a, a + m, model.num_blocks, base, per_block,
                           np.full(len(names), float(cache_penalty)), _free_array(names, free_slots))
    if route is None:
        raise ValueError("the placement does not cover every block: no route")
    return route
