"""Event simulator of deadline-aware batching on exclusive-batch workers (seed 003, Shepherd) and its experiments.

Model (the seed's emulated worker, §7.1): a worker runs one batch at a time; a batch of ``|B|`` requests of model
``m`` takes exactly ``l_m(B) = alpha_m |B| + beta_m`` (Table 4); a preempted batch's work is lost (the time it ran
is counted as wasted) and preemption itself is free (the seed's exit points cost < 5 %, Fig. 12). The schedulers
are the pure ones of :mod:`petals_chain.algorithms.deadlines`; requests arriving at the same instant reach them as
one burst. Goodput = requests finished by their deadline / the arrival window's length.

Experiments (``EXPERIMENTS``; ``python -m petals_chain.sim deadlines --experiment ...``):

* :func:`fig11a` — the seed's Fig. 11a: one GPU, stream A (ResNet18, bursts of 1024 every 120 ms from 5 ms) and
  stream B (ResNeSt269, one request per ms), SLO 250 ms and 90 ms;
* :func:`load` — goodput vs offered load for FLEX, FLEX-NP, EDF and FCFS on several workers serving several
  Table 4 models, MMPP-bursty arrivals (or the Azure trace's arrival times);
* :func:`herd` — the HERD ILP against brute force on small instances, and its solve time at 100 streams x 50 GPUs;
* :func:`chain` — the seed mapping §3.7 at chain level: decode steps as batches, per-token deadlines.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from petals_chain.algorithms import herd as herdlib
from petals_chain.algorithms.deadlines import (DISCIPLINES, EPS_S, BatchLatency, DeadlineRequest, DeadlineScheduler,
                                               deadline_metrics, make_scheduler)
from petals_chain.sim import data as simdata

# Seed Table 4: alpha / beta in ms per model.
TABLE4_MS = {
    "RN18": (0.22, 3.74), "RN34": (0.38, 5.78), "RN50": (0.75, 7.96), "RN101": (1.25, 13.57), "RN152": (1.77, 18.98),
    "RS50": (1.18, 15.39), "RS101": (1.91, 29.21), "RS200": (3.35, 45.43), "RS269": (4.37, 74.20),
    "DN121": (0.69, 19.96), "DN161": (1.74, 23.10), "DN169": (0.83, 27.47), "DN201": (1.12, 32.33),
    "GoogLeNet": (0.25, 8.41), "IncV3": (0.96, 11.77), "RCNN": (2.59, 14.90), "BERT": (40.98, 5.67),
}

SEED_CLAIMS = {
    "fig11a": "Fig. 11a (1 GPU): SLO 250 ms: SHEPHERD and SHEPHERD-NP 3.7x Clockwork (prioritization); "
              "SLO 90 ms: SHEPHERD 6.2x both SHEPHERD-NP and Clockwork (preemption)",
    "load": "Fig. 7: at high load SHEPHERD 4.6x (MAF-stable) / 5.2x (MAF-bursty) Clockwork's goodput; "
            "Clockwork saturates, SHEPHERD keeps growing",
    "herd": "Table 5: 200k streams / 200 models / 200 workers solved in 0.55 s (10 groups)",
    "chain": "seed mapping §3.7 (not in the paper): step-level FLEX on chains with per-token deadlines",
}


def table4(name: str) -> BatchLatency:
    a, b = TABLE4_MS[name]
    return BatchLatency(a / 1000.0, b / 1000.0)


# ------------------------------------------------------------------------------------------------- simulator


@dataclass
class SimOutcome:
    """Per request (in input order) its finish time or None (dropped / never run), plus counters."""

    requests: list[DeadlineRequest]
    finish_s: list[float | None]
    duration_s: float
    batches: int = 0
    preemptions: int = 0
    busy_s: dict[Any, float] = field(default_factory=dict)  # completed batches, the whole run (drain included)
    wasted_s: float = 0.0
    best_effort_done: int = 0
    window_busy_s: float = 0.0  # completed batches' time inside [0, duration_s], all workers together

    @property
    def utilization(self) -> float:
        """Fraction of the workers' time in the arrival window ``[0, duration_s]`` spent on batches that completed
        (at most 1; preempted work is ``wasted_s``). Dividing all busy time by the window counted the drain after
        the last arrival: FCFS at twice the capacity read 2.15."""
        return self.window_busy_s / (len(self.busy_s) * self.duration_s) if self.busy_s else 0.0

    def metrics(self, model: str | None = None) -> dict[str, Any]:
        idx = [i for i, r in enumerate(self.requests) if model is None or r.model == model]
        m = deadline_metrics([self.requests[i].deadline_s for i in idx], [self.finish_s[i] for i in idx],
                             self.duration_s)
        return {"requests": m.requests, "on_time": m.on_time, "late": m.late, "dropped": m.dropped,
                "goodput_rps": m.goodput_rps, "slo_attainment": m.slo_attainment}


def simulate(sched: DeadlineScheduler, requests: Sequence[DeadlineRequest], duration_s: float) -> SimOutcome:
    """Run ``requests`` (any order) through ``sched`` until every batch has ended. Completions at an instant are
    handled before arrivals at that instant (a freed worker sees the new requests)."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    pos = {id(r): i for i, r in enumerate(requests)}
    finish: list[float | None] = [None] * len(requests)
    out_sim = SimOutcome(list(requests), finish, duration_s, busy_s={w: 0.0 for w in sched.workers})
    heap: list[tuple[float, int, Any]] = []
    seq = 0

    def apply(o, now: float) -> None:
        nonlocal seq
        for b in o.preempted:
            out_sim.wasted_s += now - b.start_s
        for b in o.starts:
            heapq.heappush(heap, (b.end_s, seq, b))
            seq += 1

    i, n = 0, len(reqs)
    while i < n or heap:
        if heap and (i >= n or heap[0][0] <= reqs[i].arrival_s):
            t, _, b = heapq.heappop(heap)
            if sched.running(b.worker) is not b:
                continue  # preempted
            out_sim.batches += 1
            out_sim.busy_s[b.worker] = out_sim.busy_s.get(b.worker, 0.0) + b.latency_s
            out_sim.window_busy_s += max(0.0, min(t, duration_s) - max(b.start_s, 0.0))
            for r in b.requests:
                finish[pos[id(r)]] = t
            out_sim.best_effort_done += b.size if b.best_effort else 0
            apply(sched.complete(b.worker, t), t)
        else:
            t = reqs[i].arrival_s
            j = i
            while j < n and reqs[j].arrival_s == t:
                j += 1
            apply(sched.arrive(reqs[i:j], t), t)
            i = j
    out_sim.preemptions = sched.preemptions
    return out_sim


def run_policies(policies: Sequence[str], workers: Mapping[Any, Mapping[str, BatchLatency]],
                 make_requests, duration_s: float, **kw: Any) -> dict[str, SimOutcome]:
    """The same workload (fresh request objects per policy) under each discipline."""
    return {p: simulate(make_scheduler(p, workers, **kw), make_requests(), duration_s) for p in policies}


def _ratio(a: float, b: float) -> float | None:
    return None if b <= 0 else a / b


def _summary(o: SimOutcome, models: Sequence[str]) -> dict[str, Any]:
    m = o.metrics()
    m.update({"preemptions": o.preemptions, "batches": o.batches, "wasted_s": o.wasted_s,
              "utilization": o.utilization,
              "per_model": {k: o.metrics(k)["goodput_rps"] for k in models}})
    return m


# ------------------------------------------------------------------------------------------------- Fig. 11a


FIG11A_PERIOD_S, FIG11A_FIRST_BURST_S = 0.120, 0.005


def fig11a_requests(slo_s: float, duration_s: float, *, burst: int = 1024, period_s: float = FIG11A_PERIOD_S,
                    first_burst_s: float = FIG11A_FIRST_BURST_S, b_interval_s: float = 0.001) -> list[DeadlineRequest]:
    """Stream A (model ``A`` = ResNet18): ``burst`` requests every ``period_s`` from ``first_burst_s``; stream B
    (model ``B`` = ResNeSt269): one request every ``b_interval_s`` from 0; both with deadline ``a + slo_s``."""
    reqs = []
    t = first_burst_s
    while t < duration_s - 1e-12:
        reqs += [DeadlineRequest.with_slo(("A", len(reqs) + k), "A", round(t, 9), slo_s) for k in range(burst)]
        t += period_s
    for k in range(int(math.ceil(duration_s / b_interval_s - 1e-9))):
        reqs.append(DeadlineRequest.with_slo(("B", k), "B", round(k * b_interval_s, 9), slo_s))
    return reqs


FIG11A_SWEEP_S = (0.06, 0.07, 0.08, 0.085, 0.09, 0.095, 0.1, 0.11, 0.12, 0.15, 0.2, 0.25)


def steady_goodput(o: SimOutcome, start_s: float, end_s: float) -> float:
    """On-time requests among those arriving in ``[start_s, end_s)``, per second of that window: the steady state,
    without the first period's start from an empty GPU nor the last burst's drain after the arrivals end."""
    on_time = sum(1 for r, f in zip(o.requests, o.finish_s)
                  if start_s <= r.arrival_s < end_s and f is not None and f <= r.deadline_s + EPS_S)
    return on_time / (end_s - start_s)


def fig11a(*, quick: bool = False, seed: int = 0, slos_s: Sequence[float] = (0.250, 0.090),
           duration_s: float | None = None, policies: Sequence[str] = DISCIPLINES,
           sweep_s: Sequence[float] = FIG11A_SWEEP_S) -> dict[str, Any]:
    """The seed's Fig. 11a on one GPU with Table 4's ResNet18 (A) and ResNeSt269 (B); ``sweep_s``: the same for a
    range of SLOs, goodput only (the tight-SLO ratio depends on how B's batches fall against A's bursts).
    Deterministic (``seed`` unused)."""
    duration_s = duration_s or (1.2 if quick else 6.0)
    workers = {"gpu": {"A": table4("RN18"), "B": table4("RS269")}}
    # the steady state: the arrivals from the second burst to the last one (excluded)
    bursts = math.ceil((duration_s - FIG11A_FIRST_BURST_S) / FIG11A_PERIOD_S - 1e-9)
    window = (FIG11A_FIRST_BURST_S + FIG11A_PERIOD_S, FIG11A_FIRST_BURST_S + (bursts - 1) * FIG11A_PERIOD_S)
    runs = {}  # each SLO simulated once: the detailed ones are in the sweep too
    for slo in dict.fromkeys([*slos_s, *sweep_s]):
        detailed = slo in slos_s
        res = run_policies(list(dict.fromkeys([*policies, *(["clockwork"] if detailed else [])])), workers,
                           lambda: fig11a_requests(slo, duration_s), duration_s)
        runs[slo] = {p: _summary(o, ("A", "B")) for p, o in res.items()}
        if detailed and window[1] > window[0]:
            for p, o in res.items():
                runs[slo][p]["steady_goodput_rps"] = steady_goodput(o, *window)
    rows, sweep = {}, {}
    for slo in slos_s:
        g = {p: v["goodput_rps"] for p, v in runs[slo].items()}
        st = {p: v.get("steady_goodput_rps", 0.0) for p, v in runs[slo].items()}
        rows[f"{slo * 1000:g}ms"] = {
            "slo_s": slo, "policies": runs[slo],
            "flex_vs_edf": _ratio(g.get("flex", 0), g.get("edf", 0)),
            "flex_np_vs_edf": _ratio(g.get("flex-np", 0), g.get("edf", 0)),
            "flex_vs_flex_np": _ratio(g.get("flex", 0), g.get("flex-np", 0)),
            "flex_vs_fcfs": _ratio(g.get("flex", 0), g.get("fcfs", 0)),
            "steady_flex_vs_edf": _ratio(st.get("flex", 0), st.get("edf", 0)),
            "flex_vs_clockwork": _ratio(g.get("flex", 0), g.get("clockwork", 0)),
            "steady_flex_vs_clockwork": _ratio(st.get("flex", 0), st.get("clockwork", 0)),
        }
    for slo in sweep_s:
        g = {p: v["goodput_rps"] for p, v in runs[slo].items()}
        sweep[f"{slo * 1000:g}ms"] = {"goodput_rps": g, "flex_vs_edf": _ratio(g.get("flex", 0), g.get("edf", 0)),
                                      "flex_vs_flex_np": _ratio(g.get("flex", 0), g.get("flex-np", 0))}
    return {"experiment": "fig11a", "duration_s": duration_s, "requests_per_s": {"A": 1024 / 0.120, "B": 1000.0},
            "latency_ms": {"A": TABLE4_MS["RN18"], "B": TABLE4_MS["RS269"]}, "slos": rows, "sweep": sweep,
            "seed": {"250ms": {"flex_vs_edf": 3.7, "flex_np_vs_edf": 3.7}, "90ms": {"flex_vs_edf": 6.2, "flex_vs_flex_np": 6.2}},
            "seed_claim": SEED_CLAIMS["fig11a"]}


# ---------------------------------------------------------------------------------------------------- load


LOAD_MODELS = ("RN50", "RS50", "DN121", "IncV3", "RN101", "GoogLeNet")


def mmpp_arrivals(rng: np.random.Generator, rate: float, duration_s: float, *, high: float = 4.0,
                  p_high: float = 0.2, mean_high_s: float = 0.05) -> np.ndarray:
    """A two-state Markov-modulated Poisson process of mean ``rate``: a *high* state at ``high`` x the low state's
    rate holds a fraction ``p_high`` of the time, mean sojourn ``mean_high_s`` (the low state's follows). The seed's
    MAF-bursty expands per-minute counts this way; its parameters are not given, these make bursts of a few tens of
    ms at 4x."""
    low_rate = rate / (p_high * high + (1 - p_high))
    mean_low_s = mean_high_s * (1 - p_high) / p_high
    out, t, hi = [], 0.0, bool(rng.random() < p_high)
    while t < duration_s:
        stay = rng.exponential(mean_high_s if hi else mean_low_s)
        r = low_rate * (high if hi else 1.0)
        k = rng.poisson(r * stay)
        out.append(t + np.sort(rng.uniform(0, stay, k)))
        t += stay
        hi = not hi
    a = np.concatenate(out) if out else np.zeros(0)
    return a[a < duration_s]


def trace_arrivals(rate: float, duration_s: float, path: str | None, seed: int = 0) -> tuple[np.ndarray, str]:
    """The Azure trace's arrival times (``path`` or ``../shared/data``; synthetic fallback), rescaled to ``rate``."""
    found = path or simdata.default_data_path(simdata.TRACE_FILENAME)
    tr = simdata.get_trace(found, seed=seed) if found else simdata.synthetic_trace(seed=seed)
    if not math.isfinite(tr.rate):  # rescaled to no time at all, the run failed on "duration must be positive"
        raise ValueError(f"{tr.source}: its {len(tr)} request(s) arrive at one instant: no arrival pattern to rescale")
    a = np.asarray(tr.arrivals, dtype=float) * tr.time_scale(rate, duration_s)
    return a[a < duration_s], tr.source


def model_capacity(lat: BatchLatency, slo_s: float, b_max: int = 128) -> float:
    """Requests/s of one worker on back-to-back batches of the largest size that fits half the SLO (a request
    waits about one batch before its own, so a batch longer than half the SLO cannot run back to back)."""
    k = max(1, lat.max_batch(slo_s / 2, b_max))
    return lat.throughput(k)


def load(*, quick: bool = False, seed: int = 0, workers: int = 4, models: Sequence[str] = LOAD_MODELS,
         slo_s: float = 0.250, loads: Sequence[float] | None = None, duration_s: float | None = None,
         trace: str | None = None, policies: Sequence[str] = DISCIPLINES) -> dict[str, Any]:
    """Goodput vs offered load (x the workers' capacity, :func:`model_capacity` averaged over equally likely
    models) on ``workers`` workers that each serve every model (one serving group), MMPP-bursty arrivals per model
    (``trace``: the Azure trace's arrival times instead, models assigned round-robin)."""
    loads = loads or ((0.5, 1.0, 2.0) if quick else (0.25, 0.5, 1.0, 2.0, 4.0))
    duration_s = duration_s or (1.0 if quick else 3.0)
    lats = {m: table4(m) for m in models}
    per_req_s = float(np.mean([1.0 / model_capacity(lats[m], slo_s) for m in models]))
    capacity = workers / per_req_s
    ws = {f"w{i}": dict(lats) for i in range(workers)}
    rows, source = [], "mmpp"
    for f in loads:
        rate = f * capacity
        if trace is not None:
            arr, source = trace_arrivals(rate, duration_s, None if trace == "default" else trace, seed)
            spec = [(float(t), models[i % len(models)]) for i, t in enumerate(arr)]
            # a rescaled trace shorter than the window: goodput over the span it covers
            span = min(duration_s, float(arr[-1]) if len(arr) else duration_s)
        else:
            spec = []
            for k, m in enumerate(models):
                rng = np.random.default_rng([seed, k, int(f * 1000)])
                spec += [(float(t), m) for t in mmpp_arrivals(rng, rate / len(models), duration_s)]
            span = duration_s
        res = run_policies(policies, ws, lambda: [DeadlineRequest.with_slo(i, m, t, slo_s) for i, (t, m) in enumerate(spec)],
                           span)
        pol = {p: _summary(o, models) for p, o in res.items()}
        g = {p: v["goodput_rps"] for p, v in pol.items()}
        rows.append({"load": f, "rate_rps": rate, "requests": len(spec), "window_s": span, "policies": pol,
                     "flex_vs_edf": _ratio(g.get("flex", 0), g.get("edf", 0)),
                     "flex_vs_flex_np": _ratio(g.get("flex", 0), g.get("flex-np", 0)),
                     "flex_vs_fcfs": _ratio(g.get("flex", 0), g.get("fcfs", 0))})
    return {"experiment": "load", "workers": workers, "models": list(models), "slo_s": slo_s, "arrivals": source,
            "capacity_rps": capacity, "duration_s": duration_s, "rows": rows, "seed_claim": SEED_CLAIMS["load"]}


# ----------------------------------------------------------------------------------------------------- HERD


def random_herd_instance(rng: np.random.Generator, streams: int, gpus: int, models: int, *, g_bar: int,
                         mem_gpu: float = 16.0, affinity_sets: int = 1,
                         mem_range: tuple[float, float] = (1.0, 6.0)) -> herdlib.HerdProblem:
    """Streams of random models with lognormal ``n_i`` (GPUs for the average load) summing to ~60 % of the cluster,
    model sizes uniform in ``mem_range`` GB on ``mem_gpu`` GB GPUs, models split round-robin into ``affinity_sets``
    sets."""
    model_of = [f"m{int(k)}" for k in rng.integers(0, models, streams)]
    n = rng.lognormal(0.0, 1.0, streams)
    n = n / n.sum() * 0.6 * gpus
    names = sorted(set(model_of), key=lambda s: int(s[1:]))
    mem = {m: float(rng.uniform(*mem_range)) for m in names}
    aff = [[m for j, m in enumerate(names) if j % affinity_sets == c] for c in range(affinity_sets)]
    return herdlib.HerdProblem(
        streams=[herdlib.Stream(f"s{i}", model_of[i], float(n[i])) for i in range(streams)],
        model_memory=mem, gpu_memory=mem_gpu, num_gpus=gpus, g_bar=g_bar,
        affinity_sets=[s for s in aff if s])


def herd(*, quick: bool = False, seed: int = 0, instances: int | None = None) -> dict[str, Any]:
    """HERD ILP (scipy milp) against brute force on small random instances, and its solve time at 100 streams x
    50 GPUs (Ḡ = 12, 20 models of 0.5-3 GB on 16 GB GPUs, two affinity sets)."""
    instances = instances or (10 if quick else 40)
    rng = np.random.default_rng(seed)
    agree, rows = 0, []
    for k in range(instances):
        p = random_herd_instance(rng, streams=int(rng.integers(2, 6)), gpus=int(rng.integers(2, 9)),
                                 models=int(rng.integers(1, 4)), g_bar=int(rng.integers(1, 5)),
                                 mem_gpu=float(rng.choice([6.0, 9.0, 16.0])), affinity_sets=int(rng.integers(1, 3)))
        ilp = herdlib.solve_herd(p)
        bf = herdlib.brute_force_herd(p)
        same = (ilp is None and bf is None) or (ilp is not None and bf is not None and abs(ilp.objective - bf.objective) <= 1e-6 * max(1, bf.objective))
        agree += same
        rows.append({"streams": len(p.streams), "gpus": p.num_gpus, "g_bar": p.g_bar,
                     "ilp": None if ilp is None else ilp.objective, "brute_force": None if bf is None else bf.objective,
                     "equal": same})
    times, cpu = [], []
    big = None
    for rep in range(1 if quick else 3):
        p = random_herd_instance(np.random.default_rng([seed, 100 + rep]), streams=100, gpus=50, models=20, g_bar=12,
                                 affinity_sets=2, mem_range=(0.5, 3.0))
        t0, c0 = time.perf_counter(), time.process_time()
        big = herdlib.solve_herd(p)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # CPU time: robust to other load on the machine
    # seed mapping §3.7: chains per model for 6 models on 60 servers, chains of 2-4 servers
    cm = herdlib.solve_chain_allocation({f"m{i}": 0.5 + i for i in range(6)}, {f"m{i}": 2 + i % 3 for i in range(6)},
                                        num_servers=60, g_bar=8)
    return {"experiment": "herd", "instances": instances, "ilp_equals_brute_force": agree, "small": rows,
            "large": {"streams": 100, "gpus": 50, "models": 20, "g_bar": 12, "seconds": times,
                      "max_seconds": max(times), "cpu_seconds": cpu, "max_cpu_seconds": max(cpu), "objective": None if big is None else big.objective,
                      "status": None if big is None else big.status},
            "chain_allocation": None if cm is None else {"objective": cm.objective, "chains": cm.chains,
                                                         "groups": cm.groups},
            "seed_claim": SEED_CLAIMS["herd"]}


# ------------------------------------------------------------------------------------------------ chain level


def chain(*, quick: bool = False, seed: int = 0, chains: int = 2, capacity: int = 32, ttft_slo_s: float = 1.0,
          tpot_slo_s: float = 0.25, loads: Sequence[float] | None = None, duration_s: float | None = None,
          policies: Sequence[str] = ("flex", "flex-np", "edf", "fcfs")) -> dict[str, Any]:
    """Seed mapping §3.7 (a first cut): a chain runs one decode step for a set of sessions at a time,
    ``l_chain(B) = alpha |B| + beta`` with beta dominated by network hops (alpha = 4 ms, beta = 120 ms); every
    request needs ``n`` steps (lognormal, median 16 tokens) and token ``k`` is due at ``a + TTFT + k * TPOT``. A
    session's next step is a request with that token's deadline, issued when its previous step ends; a preempted
    or dropped step is one more token late, the request counts as on time only if all its tokens were. ``capacity``
    bounds a step (the chain's ``c_k``). The workers are exclusive-batch (a step is a batch), i.e. the scheduler
    decides the membership of every step."""
    loads = loads or ((0.5, 1.5) if quick else (0.5, 1.0, 1.5, 2.5))
    duration_s = duration_s or (20.0 if quick else 60.0)
    lat = BatchLatency(0.004, 0.120)
    step_cap = lat.throughput(capacity)  # token-steps per second of one chain at full batches
    rng = np.random.default_rng(seed)
    mean_tokens = 16 * math.exp(0.5 * 0.6 ** 2)
    rows = []
    for f in loads:
        rate = f * chains * step_cap / mean_tokens
        arr = np.sort(rng.uniform(0, duration_s, rng.poisson(rate * duration_s)))
        ntok = np.maximum(1, np.rint(rng.lognormal(math.log(16), 0.6, len(arr)))).astype(int)
        pol = {}
        for p in policies:
            sched = make_scheduler(p, {f"c{i}": {"llm": lat} for i in range(chains)}, b_max=capacity)
            pol[p] = _chain_run(sched, arr, ntok, ttft_slo_s, tpot_slo_s, duration_s)
        g = {p: v["goodput_rps"] for p, v in pol.items()}
        rows.append({"load": f, "requests": len(arr), "policies": pol,
                     "flex_vs_edf": _ratio(g.get("flex", 0), g.get("edf", 0)),
                     "flex_vs_fcfs": _ratio(g.get("flex", 0), g.get("fcfs", 0))})
    return {"experiment": "chain", "chains": chains, "capacity": capacity, "alpha_s": lat.alpha_s, "beta_s": lat.beta_s,
            "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s, "duration_s": duration_s, "rows": rows,
            "seed_claim": SEED_CLAIMS["chain"]}


def _chain_run(sched: DeadlineScheduler, arrivals: np.ndarray, ntok: np.ndarray, ttft: float, tpot: float,
               duration_s: float) -> dict[str, Any]:
    """Drive token steps: each request issues step k when step k-1 completed; a dropped step is retried (the
    session goes on, late) only if it is still within the horizon, as a best-effort generation server would."""
    heap: list[tuple[float, int, int, Any]] = []  # (time, kind 0=complete 1=arrival, seq, payload)
    seq = 0
    for i, a in enumerate(arrivals):
        heapq.heappush(heap, (float(a), 1, seq, (i, 0)))
        seq += 1
    late = np.zeros(len(arrivals), dtype=bool)
    done = np.zeros(len(arrivals), dtype=bool)
    finished_at = np.full(len(arrivals), np.nan)
    tokens_on_time = 0

    def issue(i: int, k: int, now: float):
        d = float(arrivals[i]) + ttft + k * tpot
        if late[i]:  # a late session keeps its pace from now on (the next token one TPOT after this one)
            d = max(d, now + tpot)
        return DeadlineRequest((i, k), "llm", now, d, payload=(i, k))

    def apply(o, now):
        nonlocal seq
        for b in o.starts:
            heapq.heappush(heap, (b.end_s, 0, seq, b))
            seq += 1
        for r in o.dropped:
            i, k = r.payload
            late[i] = True
            heapq.heappush(heap, (now, 1, seq, (i, k)))  # retry the same token, late
            seq += 1

    while heap:
        t, kind, _, x = heapq.heappop(heap)
        if kind == 0:
            if sched.running(x.worker) is not x:
                continue
            nxt = []
            for r in x.requests:
                i, k = r.payload
                if t > r.deadline_s + EPS_S:
                    late[i] = True
                elif not late[i]:
                    tokens_on_time += 1
                if k + 1 < ntok[i]:
                    nxt.append(issue(i, k + 1, t))
                else:
                    done[i] = True
                    finished_at[i] = t
            apply(sched.complete(x.worker, t), t)
            if nxt:
                apply(sched.arrive(nxt, t), t)
        else:
            i, k = x
            if t > duration_s * 3:  # give up on sessions the system cannot finish
                continue
            apply(sched.arrive(issue(i, k, t), t), t)
    on_time = int(np.sum(done & ~late))
    return {"requests": len(arrivals), "on_time": on_time, "goodput_rps": on_time / duration_s,
            "slo_attainment": on_time / len(arrivals) if len(arrivals) else 1.0, "completed": int(done.sum()),
            "tokens_on_time": tokens_on_time, "preemptions": sched.preemptions}


EXPERIMENTS = {"fig11a": fig11a, "load": load, "herd": herd, "chain": chain}


def tables(name: str, r: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """``(title, headers, rows)`` of one experiment's result for ``python -m petals_chain.sim deadlines``."""
    out: list[tuple[str, list[str], list[list[Any]]]] = []
    if name == "fig11a":
        for key, v in r["slos"].items():
            seed = r["seed"].get(key, {})
            out.append((f"Fig. 11a, SLO {key} (1 GPU, {r['duration_s']} s; seed: {seed})",
                        ["policy", "goodput req/s", "steady req/s", "A req/s", "B req/s", "attainment", "preemptions",
                         "wasted s"],
                        [[p, m["goodput_rps"], m.get("steady_goodput_rps"), m["per_model"]["A"], m["per_model"]["B"],
                          m["slo_attainment"], m["preemptions"], m["wasted_s"]] for p, m in v["policies"].items()]))
            out.append((f"Fig. 11a ratios, SLO {key} (steady: arrivals from the 2nd burst to the last, excluded; "
                        "clockwork: EDF at batch sizes 1, 2, 4, 8)",
                        ["FLEX/EDF", "steady", "seed", "FLEX-NP/EDF", "seed", "FLEX/FLEX-NP", "seed", "FLEX/clockwork",
                         "steady"],
                        [[v["flex_vs_edf"], v.get("steady_flex_vs_edf"), seed.get("flex_vs_edf"), v["flex_np_vs_edf"],
                          seed.get("flex_np_vs_edf"), v["flex_vs_flex_np"], seed.get("flex_vs_flex_np"),
                          v.get("flex_vs_clockwork"), v.get("steady_flex_vs_clockwork")]]))
        if r.get("sweep"):
            pols = list(next(iter(r["sweep"].values()))["goodput_rps"])
            out.append((f"Fig. 11a over SLOs (goodput req/s, {r['duration_s']} s)",
                        ["SLO"] + pols + ["FLEX/EDF", "FLEX/FLEX-NP"],
                        [[k] + [v["goodput_rps"][p] for p in pols] + [v["flex_vs_edf"], v["flex_vs_flex_np"]]
                         for k, v in r["sweep"].items()]))
    elif name in ("load", "chain"):
        pols = list(r["rows"][0]["policies"]) if r["rows"] else []
        title = (f"goodput (req/s) vs load: {r.get('workers')} workers, models {r.get('models')}, SLO {r.get('slo_s')} s, "
                 f"{r.get('arrivals')} arrivals, capacity {r.get('capacity_rps', 0):.0f} req/s" if name == "load" else
                 f"chain level (§3.7): {r['chains']} chains, step {r['alpha_s']}*|B|+{r['beta_s']} s, TTFT {r['ttft_slo_s']} s, "
                 f"TPOT {r['tpot_slo_s']} s; goodput = requests with every token on time per s")
        out.append((title, ["load", "requests", *pols, "FLEX/EDF", "FLEX/FCFS"],
                    [[x["load"], x["requests"], *[x["policies"][p]["goodput_rps"] for p in pols], x["flex_vs_edf"],
                      x["flex_vs_fcfs"]] for x in r["rows"]]))
    elif name == "herd":
        lg = r["large"]
        out.append(("HERD ILP vs brute force (small instances) and solve time", ["instances", "ILP == brute force",
                    "100x50 wall s (max)", "100x50 CPU s (max)", "100x50 min bt", "status"],
                    [[r["instances"], r["ilp_equals_brute_force"], lg["max_seconds"], lg.get("max_cpu_seconds"),
                      lg["objective"], lg["status"]]]))
        if r.get("chain_allocation"):
            ca = r["chain_allocation"]
            out.append(("HERD at chain level (§3.7): chains per model", ["model", "chains", "min bt"],
                        [[m, c, ca["objective"]] for m, c in ca["chains"].items()]))
    return out
