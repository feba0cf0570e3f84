"""The paper's evaluation settings (§4.1.1, §4.2) and the policies compared in §4.1.3 / Table 1.

BLOOM-176B swarm (§4.1): ``L = 70``, ``s_m = 1.32`` GB, ``s_c = 0.11`` GB; fast servers 40 GB with
``tau_p = 109`` ms, slow servers 20 GB with ``tau_p = 175`` ms; ``tau_c_j`` = RTT(orchestrator, j) + 18 ms
from RIPE Atlas; a fraction ``eta`` of the ``J`` servers (chosen at random) is fast.

LLaMA-2-7B testbed (§4.2, used for the trace replay): ``L = 32``; per block 202.4 M parameters, so
``s_m = 0.405`` GB in fp16 and ``F = 0.405`` GFLOP per token; ``s_c = 0.0336`` GB (K and V, 4096 wide,
2048 tokens, fp16); 3 fast (40 GB, 120 TFLOPS, 1.02 GB/ms) and 6 slow (20 GB, 80 TFLOPS, 0.51 GB/ms)
servers as the paper's 3g.40gb / 2g.20gb MIG slices. Per-job times follow footnote 11:
``tau_p_j = t_o + t_I_j l_in + t_O_j (l_out - 1)`` with ``t_o = 1`` ms, ``t_I = F/f_j``, ``t_O = s_m/b_j``;
the orchestrator relays every token, so communication with ``j`` is ``(RTT_j + 18 ms) * l_out``.
The planner sees the same model at the trace's mean lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from petals_chain.model import Chain, ModelSpec, Placement, ServerSpec
from petals_chain.sim import data as simdata
from petals_chain.sim.engine import CostModel, ServerCost, SimResult, Workload, simulate_chains, simulate_routed

# ------------------------------------------------------------------------------------ parameters

BLOOM_176B = ModelSpec(num_blocks=70, block_size=1.32, cache_size=0.11)  # GB
FAST_MEMORY_GB, FAST_TAU_P = 40.0, 0.109
SLOW_MEMORY_GB, SLOW_TAU_P = 20.0, 0.175
DEFAULT_J, DEFAULT_ETA, DEFAULT_LAMBDA, DEFAULT_RHO_BAR, DEFAULT_C = 20, 0.2, 0.2, 0.7, 7
DEFAULT_RUNS = 20
DEFAULT_BPRR_R = 7  # BPRR's target concurrency: the same reservation as GBP-CR's c = 7
PETALS_CACHE_TOKENS = 4096  # PETALS' default attention cache per block (tokens)

# LLaMA-2-7B testbed (§4.2); footnote-11 constants
LLAMA2_7B_PARAMS_PER_BLOCK = 4 * 4096**2 + 3 * 4096 * 11008
LLAMA2_7B = ModelSpec(num_blocks=32, block_size=LLAMA2_7B_PARAMS_PER_BLOCK * 2 / 1e9, cache_size=2 * 4096 * 2048 * 2 / 1e9)
T_O_OVERHEAD = 0.001  # t_o, s per block per job
GPU_FAST = {"memory": 40.0, "tflops": 120.0, "gb_per_ms": 1.02}
GPU_SLOW = {"memory": 20.0, "tflops": 80.0, "gb_per_ms": 0.51}

POLICIES = ("proposed", "petals", "bprr", "jffc-only")
# Our extension: GBP-CR that also places the servers the paper leaves idle (``use_all_servers``).
EXTRA_POLICIES = ("proposed-all",)
DISPATCHERS = ("jffc", "jsq", "jiq", "sed", "sa-jsq")


@dataclass
class Scenario:
    """A swarm: servers (planner view), model, arrival rate, and the cost model the simulator uses."""

    servers: list[ServerSpec]
    model: ModelSpec
    arrival_rate: float
    rho_bar: float = DEFAULT_RHO_BAR
    cost: CostModel | None = None  # None: the Poisson model built from the servers
    rtt_ms: dict[str, float] = field(default_factory=dict)
    fast: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = CostModel.from_servers(self.servers)

    @property
    def by_name(self) -> dict[str, ServerSpec]:
        return {s.name: s for s in self.servers}


def bloom_scenario(num_servers: int = DEFAULT_J, eta: float = DEFAULT_ETA, arrival_rate: float = DEFAULT_LAMBDA, *,
                   rng: np.random.Generator, anchors: simdata.Anchors | None = None,
                   rho_bar: float = DEFAULT_RHO_BAR) -> Scenario:
    """§4.1.1: ``J`` servers, ``round(eta J)`` of them fast (chosen at random), RTTs from RIPE Atlas."""
    if num_servers < 1:
        raise ValueError("need at least one server")
    if not 0 <= eta <= 1:
        raise ValueError(f"eta must be in [0, 1], got {eta!r}")
    anchors = anchors if anchors is not None else simdata.get_anchors()
    rtt = simdata.sample_rtts_ms(anchors, num_servers, rng)
    n_fast = int(round(eta * num_servers))
    fast_idx = set(rng.choice(num_servers, size=n_fast, replace=False).tolist()) if n_fast else set()
    servers = []
    for j in range(num_servers):
        is_fast = j in fast_idx
        servers.append(ServerSpec(name=f"s{j:0{len(str(num_servers - 1))}d}",
                                  memory=FAST_MEMORY_GB if is_fast else SLOW_MEMORY_GB,
                                  tau_c=(float(rtt[j]) + simdata.OVERHEAD_MS) / 1000.0,
                                  tau_p=FAST_TAU_P if is_fast else SLOW_TAU_P))
    return Scenario(servers=servers, model=BLOOM_176B, arrival_rate=arrival_rate, rho_bar=rho_bar,
                    rtt_ms={s.name: float(r) for s, r in zip(servers, rtt)},
                    fast={servers[j].name for j in fast_idx})


def llama_trace_scenario(trace: simdata.Trace, *, rng: np.random.Generator, anchors: simdata.Anchors | None = None,
                         num_fast: int = 3, num_slow: int = 6, rho_bar: float = DEFAULT_RHO_BAR,
                         scale: float = 1.0) -> Scenario:
    """§4.2 testbed for trace replay (module docstring); the planner's ``tau_c``/``tau_p`` use the trace means."""
    anchors = anchors if anchors is not None else simdata.get_anchors()
    J = num_fast + num_slow
    rtt = simdata.sample_rtts_ms(anchors, J, rng)
    l_in = float(np.mean(trace.context_tokens))
    l_out = float(np.mean(trace.generated_tokens))
    model = LLAMA2_7B
    flop_per_token = LLAMA2_7B_PARAMS_PER_BLOCK * 2 / 1e9  # GFLOP per block per token
    servers, costs, fast = [], {}, set()
    for j in range(J):
        gpu = GPU_FAST if j < num_fast else GPU_SLOW
        name = f"{'fast' if j < num_fast else 'slow'}{j}"
        t_I = scale * flop_per_token / gpu["tflops"] / 1000.0  # GFLOP / TFLOPS = ms -> s
        t_O = scale * model.block_size / gpu["gb_per_ms"] / 1000.0
        t_o = scale * T_O_OVERHEAD
        hop = scale * (float(rtt[j]) + simdata.OVERHEAD_MS) / 1000.0
        costs[name] = ServerCost(c0=hop, p0=t_o, pI=t_I, pO=t_O, cO=hop)
        servers.append(ServerSpec(name=name, memory=gpu["memory"], tau_c=hop * l_out,
                                  tau_p=t_o + t_I * l_in + t_O * (l_out - 1)))
        if j < num_fast:
            fast.add(name)
    return Scenario(servers=servers, model=model, arrival_rate=trace.rate, rho_bar=rho_bar, cost=CostModel(costs),
                    rtt_ms={s.name: float(r) for s, r in zip(servers, rtt)}, fast=fast)


# -------------------------------------------------------------------------------------- policies


def slots_for(placement: Placement, scen: Scenario) -> dict[str, int]:
    """Residual cache slots ``M~_j`` (Eq. 3) of every placed server."""
    by = scen.by_name
    return {name: by[name].residual_slots(scen.model, m) for name, (a, m) in placement.items()}


def covers_all_blocks(placement: Placement, model: ModelSpec) -> bool:
    return len(placement) > 0 and min(placement.coverage(model.num_blocks)) > 0


@dataclass
class PlannedPolicy:
    """A policy ready to simulate: either chains + dispatcher factory, or a router over slots."""

    name: str
    placement: Placement | None
    chains: list[Chain] | None = None
    make_dispatcher: Callable[[np.random.Generator], object] | None = None
    route_fn: Callable | None = None
    route_key: Callable | None = None  # memoization key for route_fn (see simulate_routed)
    slots: dict[str, int] | None = None
    c: int | None = None
    feasible: bool = True
    note: str = ""

    def simulate(self, workload: Workload, scen: Scenario, rng: np.random.Generator, *, warmup: int = 0) -> SimResult:
        if not self.feasible:
            raise RuntimeError(f"policy {self.name} is infeasible here: {self.note}")
        if self.chains is not None:
            return simulate_chains(self.chains, self.make_dispatcher(rng), workload, scen.cost, warmup=warmup)
        return simulate_routed(self.route_fn, self.slots, workload, scen.cost, warmup=warmup, route_key=self.route_key)


def make_dispatcher(kind: str, chains: Sequence[Chain], rng: np.random.Generator):
    """One of JFFC, JSQ, JIQ, SED, SA-JSQ over ``chains``."""
    from petals_chain.algorithms import JFFCDispatcher

    if kind == "jffc":
        return JFFCDispatcher(chains)
    from petals_chain.algorithms.baselines import dispatch as bd

    if kind == "jsq":
        return bd.JSQDispatcher(chains, rng=rng)
    if kind == "jiq":
        return bd.JIQDispatcher(chains, rng=rng)
    if kind == "sed":
        return bd.SEDDispatcher(chains)
    if kind == "sa-jsq":
        return bd.SAJSQDispatcher(chains)
    raise ValueError(f"unknown dispatcher {kind!r}; choose from {DISPATCHERS}")


def plan_proposed(scen: Scenario, c: int | None = DEFAULT_C, method: str = "lower", *,
                  use_all_servers: bool = False) -> PlannedPolicy:
    """GBP-CR(c) + GCA + JFFC; ``c=None`` tunes ``c`` with ``tune_capacity(method)``."""
    from petals_chain.algorithms import gbp_cr, gca, tune_capacity

    name = "proposed-all" if use_all_servers else "proposed"
    if c is None:
        c, placement, chains = tune_capacity(scen.servers, scen.model, scen.arrival_rate, scen.rho_bar, method=method,
                                             use_all_servers=use_all_servers)
    else:
        placement = gbp_cr(scen.servers, scen.model, c=c, arrival_rate=scen.arrival_rate, rho_bar=scen.rho_bar,
                           use_all_servers=use_all_servers)
        chains = gca(scen.servers, scen.model, placement) if covers_all_blocks(placement, scen.model) else []
    if not chains:
        return PlannedPolicy(name, placement, feasible=False, c=c, note="GBP-CR cannot cover all blocks")
    return PlannedPolicy(name, placement, chains=chains, c=c, make_dispatcher=lambda rng: make_dispatcher("jffc", chains, rng))


def plan_jffc_only(scen: Scenario) -> PlannedPolicy:
    """Every server that fits all L blocks hosts them; one chain per server; JFFC."""
    from petals_chain.algorithms.baselines import whole_model_placement

    placement, chains = whole_model_placement(scen.servers, scen.model)
    chains = [ch for ch in chains if ch.capacity > 0]
    if not chains:
        return PlannedPolicy("jffc-only", placement, feasible=False, note="no server can hold the whole model")
    return PlannedPolicy("jffc-only", placement, chains=chains, make_dispatcher=lambda rng: make_dispatcher("jffc", chains, rng))


def plan_petals(scen: Scenario, rng: np.random.Generator, window_rule: str = "sorted",
                cache_tokens: int = PETALS_CACHE_TOKENS) -> PlannedPolicy:
    """PETALS: servers join in random order and cover the weakest window; min-latency routing per request.

    Each server keeps PETALS' fixed attention cache of ``cache_tokens`` per block (slots of 2048 tokens).
    """
    from petals_chain.algorithms.baselines import petals_cache_slots, petals_placement, petals_route

    placement = petals_placement(scen.servers, scen.model, rng=rng, window_rule=window_rule, cache_tokens=cache_tokens)
    if not covers_all_blocks(placement, scen.model):
        return PlannedPolicy("petals", placement, feasible=False, note="PETALS placement leaves blocks uncovered")
    servers, model = scen.servers, scen.model
    # PETALS allocates a fixed cache of cache_tokens per block (2 slots at max_length 2048), not M~_j
    slots = {name: petals_cache_slots(m, cache_tokens=cache_tokens) for name, (a, m) in placement.items()}

    def route(free, expected_wait):
        return petals_route(servers, model, placement, free)

    # petals_route penalizes server j only when free_j < m_ij <= m_j: free counts >= m_j are equivalent
    names = list(placement)
    caps = [placement[n][1] for n in names]

    def key(free, expected_wait):
        return tuple(min(free[n], m) for n, m in zip(names, caps))

    return PlannedPolicy("petals", placement, route_fn=route, slots=slots, route_key=key)


def plan_bprr(scen: Scenario, R: int = DEFAULT_BPRR_R) -> PlannedPolicy:
    """BPRR: CG-BP placement with target concurrency ``R`` and WS-RR routing."""
    from petals_chain.algorithms.baselines import cg_bp_placement, ws_rr_route

    placement = cg_bp_placement(scen.servers, scen.model, R)
    if not covers_all_blocks(placement, scen.model):
        return PlannedPolicy("bprr", placement, feasible=False, note="CG-BP placement leaves blocks uncovered")
    servers, model = scen.servers, scen.model
    slots = slots_for(placement, scen)

    def route(free, expected_wait):
        return ws_rr_route(servers, model, placement, free, expected_wait)

    # WS-RR adds server j's expected wait only when free_j < m_ij <= m_j: key on clipped free slots and
    # the waits of the servers that may lack slots
    names = list(placement)
    caps = [placement[n][1] for n in names]

    def key(free, expected_wait):
        return tuple((free[n], expected_wait[n]) if free[n] < m else m for n, m in zip(names, caps))

    return PlannedPolicy("bprr", placement, route_fn=route, slots=slots, route_key=key)


def plan_policy(name: str, scen: Scenario, rng: np.random.Generator, *, c: int | None = DEFAULT_C,
                petals_cache_tokens: int = PETALS_CACHE_TOKENS, bprr_r: int = DEFAULT_BPRR_R) -> PlannedPolicy:
    if name == "proposed":
        return plan_proposed(scen, c=c)
    if name == "proposed-all":
        return plan_proposed(scen, c=c, use_all_servers=True)
    if name == "petals":
        return plan_petals(scen, rng, cache_tokens=petals_cache_tokens)
    if name == "bprr":
        return plan_bprr(scen, R=bprr_r)
    if name == "jffc-only":
        return plan_jffc_only(scen)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES + EXTRA_POLICIES}")


def random_heterogeneous_swarm(num_servers: int, *, rng: np.random.Generator, eta: float = DEFAULT_ETA,
                               anchors: simdata.Anchors | None = None) -> list[ServerSpec]:
    """``bloom_scenario``'s servers (the paper's parameters) for planner benchmarks."""
    return bloom_scenario(num_servers, eta, rng=rng, anchors=anchors).servers
