"""Experiments of several models sharing a swarm (seed 001, SeaLLM) on the token-step chain simulator
(:mod:`petals_chain.algorithms.chainsim`, also what the orchestrator's placer replays recent traffic on): the Azure
traces as workloads, the seed's comparisons, traffic shifts, ablations and sweeps, and the adaptive replacement
loop as a ``replan`` callable. Experiments (:data:`EXPERIMENTS`) return JSON-ready dicts; ``python -m
petals_chain.sim multimodel --experiment db|shift|ablation|sweep|all`` prints them beside the seed's numbers.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from petals_chain.algorithms import multimodel as mm
from petals_chain.algorithms.chainsim import (MM_COST, PLACEMENTS, MMRequest, MultiModelSim, StepCost,  # noqa: F401
                                              _check_placement, exec_alone, fresh, sched_kwargs, simulate,
                                              simulated_evaluate, summarize)
from petals_chain.algorithms.multimodel import AdaptiveInterval, MixDriftDetector, PlanMetrics, ServedModel, Volunteer
from petals_chain.sim import data as simdata
from petals_chain.sim.fairness import _round, capacity_req_s

# The seed's numbers (docs/scheduling-seeds.md §1.8) printed beside ours.
SEED_CLAIMS = {
    "db": "Fig. 6 (32 A800): L_N up to 10.38x lower than vLLM, 9.52x than AlpaServe (FCFS sharing), 13.60x than "
          "MuxServe; SeaLLM's L_N < 3 and SLO attainment > 90% at every rate (2-50 req/s)",
    "shift": "Fig. 8: SeaLLM-A (fixed placement) up to 2.44x higher L_N and 1.33x lower SLO attainment",
    "ablation": "Fig. 8: SeaLLM-F / SeaLLM-M up to 4.17x higher L_N, 1.37x lower SLO attainment; SeaLLM-A up to "
                "2.44x and 1.33x; SeaLLM-P degenerates to vLLM (up to 10.38x)",
    "sweep": "Fig. 6: rates swept 2-50 req/s; SeaLLM L_N < 3, SLO > 90% throughout, FCFS sharing degrades several-fold",
}
ACCEPT = {"db_vs_fcfs": 0.5, "db_slo": 0.90, "adaptive_vs_fixed": 1 / 1.3}

# Two models of the same size; lengths differ by service (chat: conversation trace, code: code trace).
REF_MODEL = dict(num_blocks=32, block_memory=0.5)  # GB: a 16 GB model
SERVER_MEMORY = 24.0  # GB: one server holds a whole model and its KV slots


# ----------------------------------------------------------------------------------------------- metrics


# ---------------------------------------------------------------------------------------------- workloads


@functools.lru_cache(maxsize=8)
def _trace(kind: str, path: str | None, seed: int) -> simdata.Trace:
    """The Azure ``conv`` or ``code`` trace at ``path`` (default: the shared file), else a synthetic stand-in
    (cached: the arrays are only read)."""
    fname = simdata.CONV_TRACE_FILENAME if kind == "conv" else simdata.TRACE_FILENAME
    found = path or simdata.default_data_path(fname)
    if found:
        return simdata.get_trace(found)
    if kind == "code":
        return simdata.synthetic_trace(seed=seed)
    # conversation stand-in: the real file's length statistics (README), Poisson-like arrivals at 5.5 req/s
    rng = np.random.default_rng([seed, 5])
    n = 19366
    arr = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / 5.5, n - 1))])
    ctx = np.clip(np.rint(rng.lognormal(math.log(1020), math.sqrt(2 * math.log(1155 / 1020)), n)), 1, 14050)
    gen = np.clip(np.rint(rng.lognormal(math.log(129), math.sqrt(2 * math.log(211 / 129)), n)), 1, 1000)
    return simdata.Trace(arr, ctx.astype(np.int64), gen.astype(np.int64), "synthetic")


TRACE_OF = {"chat": "conv", "code": "code", "chat2": "conv", "code2": "code"}
MAX_TRACE_LAPS = 100  # a run reads a trace round at most this many times


def trace_requests(model: str, rate: float, duration: float, *, kind: str | None = None, path: str | None = None,
                   seed: int = 0, offset: float = 0.0, share: Callable[[float], float] | None = None,
                   cost: StepCost = MM_COST) -> tuple[list[MMRequest], str]:
    """Requests of ``model`` from the Azure ``kind`` trace (``conv`` for chat, ``code`` for code), arrival times
    rescaled to ``rate`` req/s and starting at row ``offset`` x the trace's length, lengths the rows'. ``share``:
    thinning ``t -> [0, 1]`` (a time-varying rate ``rate · share(t)``; the kept rows by a hash of the row)."""
    tr = _trace(kind or TRACE_OF.get(model, "conv"), path, seed)
    start = int(offset * len(tr)) % len(tr)
    scale = tr.time_scale(rate, duration, start)
    out: list[MMRequest] = []
    for k in range(MAX_TRACE_LAPS * len(tr)):  # round the trace again where the run outlasts it (a busy model)
        i = (start + k) % len(tr)
        t = tr.offset_s(start, k) * scale
        if t >= duration:
            break
        keep = True
        if share is not None:
            h = ((i + 1) * 2654435761 + seed * 40503 + zlib.crc32(model.encode()) % 997) % 2**32 / 2**32
            keep = h < share(t)
        if keep:
            inp, outp = max(1, int(tr.context_tokens[i])), max(1, int(tr.generated_tokens[i]))
            out.append(MMRequest(0, model, t, inp, outp, exec_alone(inp, outp, cost)))
    return out, tr.source


def poisson_arrivals(reqs: Sequence[MMRequest], rates: Mapping[str, float], duration: float, *,
                     seed: int = 0) -> list[MMRequest]:
    """The same requests (lengths, models, order within a model) with each model's arrival times redrawn as a
    Poisson process at its rate (the trace's bursts removed); those past ``duration`` are dropped."""
    rng = np.random.default_rng([seed, 77])
    out = []
    for m in sorted({r.model for r in reqs}):
        rs = [r for r in reqs if r.model == m]
        for r, t in zip(rs, np.cumsum(rng.exponential(1.0 / rates[m], len(rs)))):
            if t < duration:
                out.append(replace(r, arrival=float(t)))
    return merge(out)


def merge(*streams: Sequence[MMRequest]) -> list[MMRequest]:
    reqs = sorted((r for s in streams for r in s), key=lambda r: (r.arrival, r.model))
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs


CLASS_FEATURES = ("io", "input")


def assign_length_classes(reqs: Sequence[MMRequest], k: int, *, features: str = "io") -> dict[str, list[list[int]]]:
    """Split each model's requests into ``k`` services by length (the seed's §6.1: K-means clusters of (input,
    output) lengths, known at arrival; :class:`~petals_chain.algorithms.multimodel.LengthClasses` fitted on all of
    the model's requests, as the seed clusters its datasets offline). ``features="input"``: the output is not known
    (a client that declares no ``max_tokens``), clusters of input lengths only. Sets ``service`` to
    ``model:class``; returns each model's centroids as (input, output) tokens."""
    if features not in CLASS_FEATURES:
        raise ValueError(f"features must be one of {CLASS_FEATURES}, got {features!r}")
    out = {}
    for m in sorted({r.model for r in reqs}):
        rs = [r for r in reqs if r.model == m]
        lc = mm.LengthClasses(k)

        def shape(r: MMRequest) -> tuple[int, int]:
            return (r.input, r.output) if features == "io" else (r.input, 1)

        lc.fit(mm.length_features(*shape(r)) for r in rs)
        for r in rs:
            r.service = f"{m}:{lc.classify(*shape(r))}"
        out[m] = lc.describe()["centroids_tokens"]
    return out


def stats(reqs: Sequence[MMRequest], cost: StepCost, max_batch: int) -> dict[str, dict[str, float]]:
    """Per model: mean input/output, mean and std of ``exec_s`` (the profiled prior) and one chain's capacity
    (req/s with a full batch, :func:`~petals_chain.sim.fairness.capacity_req_s`)."""
    out = {}
    for m in sorted({r.model for r in reqs}):
        rs = [r for r in reqs if r.model == m]
        mi, mo = float(np.mean([r.input for r in rs])), float(np.mean([r.output for r in rs]))
        e = np.array([r.exec_s for r in rs])
        out[m] = {"mean_input": mi, "mean_output": mo, "exec_mean_s": float(e.mean()), "exec_std_s": float(e.std()),
                  "chain_capacity_req_s": capacity_req_s(max_batch, mi, mo, cost)}
    return out


def slo_upper_bound(reqs: Sequence[MMRequest], chains: Mapping[str, float], cost: StepCost, max_batch: int, *,
                    scale: float = mm.SLO_SCALE, steps: int = 60) -> float:
    """The highest SLO attainment any scheduler could reach with ``chains[m]`` chains (reference speed) serving
    model ``m``'s requests (:func:`~petals_chain.algorithms.multimodel.on_time_upper_bound` per model; a request
    needs at least its prefill plus one full-batch share of each of its steps, ``b·input + output·(a / max_batch +
    d)`` chain-seconds, and is due ``scale`` x its execution time after it arrives). The smaller of two bounds per
    model: windows up to four times its median SLO (at least 60 s), and windows up to the whole run, each on a grid
    of ``steps`` per window. Requests of a model with no chain count as missed."""
    on_time = 0
    for m in sorted({r.model for r in reqs}):
        rs = [r for r in reqs if r.model == m]
        if chains.get(m, 0) <= 0:
            continue
        arrival = [r.arrival for r in rs]
        due = [r.arrival + scale * r.exec_s for r in rs]
        work = [cost.b * r.input + r.output * (cost.a / max_batch + cost.d) for r in rs]
        whole = max(due) - min(arrival) + 1.0
        on_time += min(mm.on_time_upper_bound(arrival, due, work, float(chains[m]), grid_s=w / steps, max_window_s=w)
                       for w in (min(whole, max(60.0, 4 * scale * float(np.median([r.exec_s for r in rs])))), whole))
    return on_time / len(reqs) if reqs else math.nan


def best_split_slo_bound(reqs: Sequence[MMRequest], names: Sequence[str], servers: int, cost: StepCost,
                         max_batch: int) -> tuple[float, dict[str, int]]:
    """:func:`slo_upper_bound` maximized over every split of ``servers`` whole-model servers between two models
    (each given one at least): what no placement and no order can beat."""
    if len(names) != 2:
        raise ValueError("the split is searched for two models")
    a, b = names
    return max(((slo_upper_bound(reqs, {a: k, b: servers - k}, cost, max_batch), {a: k, b: servers - k})
                for k in range(1, servers)), key=lambda bound_split: bound_split[0])  # ties: the first split


def make_models(names: Sequence[str], rates: Mapping[str, float], st: Mapping[str, Mapping[str, float]],
                max_batch: int = 16) -> list[ServedModel]:
    """The served models in the placement's terms: ``REF_MODEL`` blocks; ``cache_memory`` such that a whole-model
    server keeps exactly ``max_batch`` slots (GCA's ``c_k`` = the batch limit); ``block_time`` such that a
    reference chain's ``c_k / T_k`` is its measured capacity (req/s with a full batch), so the placement's M/M/C
    estimate sees the simulator's capacity; ``exec_s`` = the mean execution time alone (``L̂_s``)."""
    L, sm = REF_MODEL["num_blocks"], REF_MODEL["block_memory"]
    sc = (SERVER_MEMORY - L * sm) / (max_batch * L)
    return [ServedModel(n, L, sm, sc, max_batch / st[n]["chain_capacity_req_s"] / L, rate=rates.get(n, 0.0),
                        exec_s=st[n]["exec_mean_s"], c=max_batch) for n in names]


def make_servers(n: int, memory: float = SERVER_MEMORY, speeds: Sequence[float] | None = None) -> list[Volunteer]:
    return [Volunteer(f"s{i:02d}", memory, speeds[i] if speeds else 1.0) for i in range(n)]


def plan_counts(plan: Mapping[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in plan.values():
        out[m] = out.get(m, 0) + 1
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------- adaptive replacement


def _rebased(reqs: Sequence[MMRequest]) -> list[MMRequest]:
    """Fresh copies of ``reqs`` (arrival order) with arrival times counted from the first one."""
    t0 = reqs[0].arrival if reqs else 0.0
    return [MMRequest(r.rid, r.model, r.arrival - t0, r.input, r.output, r.exec_s, r.service, r.max_tokens)
            for r in reqs]


def _censored_metrics(reqs: Sequence[MMRequest], end: float) -> PlanMetrics:
    """SLO attainment and normalized latency of ``reqs`` seen at time ``end``: a request not finished by then counts
    the time it has waited (Eq. 8's ``M_real`` at an interval's end, and ``M_est`` taken the same way)."""
    lat = [r.latency if not math.isnan(r.finished) and r.finished <= end else end - r.arrival for r in reqs]
    lhat = {s: float(np.mean([r.exec_s for r in reqs if r.service == s])) for s in {r.service for r in reqs}}
    return PlanMetrics(mm.slo_attainment(lat, [r.exec_s for r in reqs]),
                       mm.normalized_latency(lat, [lhat[r.service] for r in reqs]))


def adaptive_policy(models: Sequence[ServedModel], servers: Sequence[Volunteer], *, initial_s: float = 120.0,
                    beta: float = mm.BETA, min_s: float = 30.0, max_s: float = 1200.0, reload_s: float = 20.0,
                    drift_window_s: float = 60.0, drift_threshold: float = 0.15, check_s: float = 10.0,
                    estimate: bool = True, drift: bool = True, horizon_s: float = 600.0,
                    placement: str = "analytic", rule: str = "most_unserved", adapt: bool = True,
                    log: list | None = None) -> Callable[[MultiModelSim, float], tuple[dict | None, float | None]]:
    """SeaLLM's replacement loop (§4.3) as a ``replan`` callable for :class:`MultiModelSim`.

    At the end of interval ``I_t`` (and earlier when :class:`MixDriftDetector` sees the traffic mix drift by more
    than ``drift_threshold``, and ``drift_window_s`` after such a drift re-plan: :class:`ReplanTrigger`):
    ``M_real`` of the interval (its arrivals' SLO attainment and normalized latency) is compared with the
    ``M_est`` made at its start and Eq. 8 sets ``I_{t+1}``; the rates of the last
    ``drift_window_s`` feed :func:`~petals_chain.algorithms.multimodel.place_by_unserved_index`; only the moves
    that pay for ``reload_s`` are made (:func:`~petals_chain.algorithms.multimodel.moves_that_pay`); ``M_est`` of
    the new plan is a simulation of the last interval's requests on it (the seed's simulator on the history).
    ``placement="simulated"``: the unserved index of the placement and of the moves' pay is that simulation too
    (:func:`simulated_evaluate` on the last interval's requests, the seed's, and at least ``drift_window_s`` of
    them), instead of the M/M/C estimate on the recent rates; ``rule``: Alg. 1's choice of a model for each
    server. ``adapt=False``: the interval stays ``initial_s`` (Eq. 8 off; the ``-I`` ablation)."""
    _check_placement(placement)
    ctl = AdaptiveInterval(initial_s, beta=beta, min_s=min_s, max_s=max_s)
    det = MixDriftDetector(drift_window_s, drift_threshold)
    trigger = mm.ReplanTrigger(drift_window_s)
    state: dict[str, Any] = {"start": 0.0, "end": initial_s, "est": None, "seen": 0}
    names = [m.name for m in models]

    def observe(sim: MultiModelSim) -> None:
        for r in sim.arrived[state["seen"]:]:
            det.arrive(r.model, r.arrival)
        state["seen"] = len(sim.arrived)

    def fn(sim: MultiModelSim, now: float) -> tuple[dict | None, float | None]:
        observe(sim)
        if not det.planned:
            det.set_plan(det.mix(now) or {m.name: 1 / len(models) for m in models})
        why = trigger.reason(now, due=now >= state["end"] - 1e-9, drifted=drift and det.drifted(now))
        if why is None:
            return None, now + check_s
        hist = [r for r in sim.arrived if state["start"] <= r.arrival < now]
        real = _censored_metrics(hist, now) if hist else None
        if real is not None and state["est"] is not None and adapt:
            ctl.update(real, state["est"])
        rates = det.rates(now)
        cur = [m.with_rate(rates.get(m.name, 0.0)) for m in models]
        ev, span = None, horizon_s
        if placement == "simulated":
            # at least drift_window_s of history: the first intervals (cut short by drifts) held a few seconds
            since = min(state["start"], now - drift_window_s)
            recent = [r for r in sim.arrived if since <= r.arrival < now]
            if recent:
                span = max(now - since, 1.0)
                ev = simulated_evaluate(_rebased(recent), cur, schedule=sim.schedule, cost=sim.cost,
                                        max_batch=sim.max_batch, kv_tokens=sim.kv_tokens, horizon_s=span,
                                        page_size=sim.page_size, pauses=sim.pauses)
        target = mm.place_by_unserved_index(servers, cur, horizon_s=horizon_s, evaluate=ev, rule=rule)
        current = {**sim.plan, **sim.loading}
        moves = mm.moves_that_pay(current, target, mm.ui_rate(servers, cur, horizon_s=span, evaluate=ev),
                                  reload_s=reload_s, interval_s=ctl.interval)
        new = dict(current)
        new.update({mv.server: mv.dst for mv in moves})
        est = None
        if estimate and hist:
            o = simulate(_rebased(hist), models, servers, new, sim.schedule, cost=sim.cost, max_batch=sim.max_batch,
                         kv_tokens=sim.kv_tokens, page_size=sim.page_size, pauses=sim.pauses)
            # as M_real is taken: requests unfinished at the window's end count what they had waited by then (run to
            # completion from an empty system instead, M_est sat apart from M_real and every update shrank I_t)
            est = _censored_metrics(o.requests, now - hist[0].arrival)
        state["est"] = est
        det.set_plan(det.mix(now))
        trigger.replanned(now, why)
        state["start"], state["end"] = now, now + ctl.interval
        if log is not None:
            log.append({"t": now, "trigger": why, "interval_s": ctl.interval,
                        "real": None if real is None else vars(real), "est": None if est is None else vars(est),
                        "rates": {k: rates.get(k, 0.0) for k in names}, "moves": len(moves),
                        "plan": plan_counts(new)})
        return ({mv.server: mv.dst for mv in moves} or None), now + check_s

    return fn


# --------------------------------------------------------------------------------------------- experiments


def _rates_for(names: Sequence[str], rho: float, servers: int, work: Mapping[str, float],
               st: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Rates that load ``servers`` chains at ``rho``: model ``m`` needs ``work[m]`` of the server-time."""
    tot = sum(work[n] for n in names)
    return {n: rho * servers * work[n] / tot * st[n]["chain_capacity_req_s"] for n in names}


def _workload(names: Sequence[str], rates: Mapping[str, float], duration: float, *, seed: int, cost: StepCost,
              trace: Mapping[str, str | None] | None = None,
              share: Mapping[str, Callable[[float], float]] | None = None,
              before: bool = False) -> tuple[list[MMRequest], dict[str, str]]:
    """Each model's requests from its trace (``TRACE_OF``) at ``rates``; ``before``: the ``duration`` of the same
    trace just before that segment instead (the history a placement made at time 0 would have seen)."""
    streams, sources = [], {}
    for i, n in enumerate(names):
        kind = TRACE_OF.get(n, "conv")
        path = (trace or {}).get(kind)
        offset = 0.5 * (i // 2) + 0.1 * seed
        if before:  # the trace's rows are rescaled to rates[n]: a run of `duration` reads about duration * rate rows
            offset -= duration * rates[n] / len(_trace(kind, path, seed))
        rs, src = trace_requests(n, rates[n], duration, kind=kind, path=path, seed=seed,
                                 offset=offset, share=(share or {}).get(n), cost=cost)
        streams.append(rs)
        sources[n] = src
    return merge(*streams), sources


def _at_own_load(names: Sequence[str], rates_of: Callable[[Mapping[str, Mapping[str, float]]], dict[str, float]],
                 duration: float, st: Mapping[str, Mapping[str, float]], *, seed: int, cost: StepCost,
                 max_batch: int, trace: Mapping[str, str | None] | None,
                 share: Mapping[str, Callable[[float], float]] | None = None
                 ) -> tuple[dict[str, float], list[MMRequest], dict[str, str], dict[str, dict[str, float]]]:
    """``(rates, requests, sources, stats)``: the rows a run replays at ``rates_of(stats)``, the stats being those of
    the rows themselves (a few rounds from a probe's ``st``: a probe of other rows missed the load by up to 5 %)."""
    for _ in range(3):
        rates = rates_of(st)
        reqs, sources = _workload(names, rates, duration, seed=seed, cost=cost, trace=trace, share=share)
        st = stats(reqs, cost, max_batch)
    return rates, reqs, sources, st


def _probe_stats(names: Sequence[str], cost: StepCost, max_batch: int, seed: int,
                 trace: Mapping[str, str | None] | None) -> dict[str, dict[str, float]]:
    probe, _ = _workload(names, {n: 1.0 for n in names}, 2000.0, seed=seed, cost=cost, trace=trace)
    return stats(probe, cost, max_batch)


def compare(names: Sequence[str], *, rho: float = 0.8, servers: int = 8, duration: float = 600.0, seed: int = 0,
            cost: StepCost = MM_COST, max_batch: int = 16, schedules: Sequence[str] = mm.SCHEDULES,
            work: Mapping[str, float] | None = None, trace: Mapping[str, str | None] | None = None,
            shared: bool = False, classes: int = 1, class_features: str = "io",
            arrivals: str = "trace", bound: bool = False, placement: str = "analytic",
            rule: str = "most_unserved", pauses: str = "runtime") -> dict[str, Any]:
    """``names`` models at load ``rho`` on ``servers`` servers placed by the unserved index: every schedule on
    the same requests. ``shared``: the seed's setting instead, every chain serving every model (a sharing group
    time-sharing the LLMs; impossible in petals-chain, where a server holds one model). ``classes`` > 1: each
    model's requests form that many services by length (:func:`assign_length_classes`), and ``L_N`` normalizes by
    them (the seed's Eq. 1 with its services); ``norm_latency_by_model`` is the same run normalized per model.
    ``arrivals="poisson"``: the trace's lengths with Poisson arrival times (:func:`poisson_arrivals`). ``bound``:
    also the SLO attainment no order can beat on this plan, and on the best split of the servers
    (:func:`slo_upper_bound`; not for ``shared``). ``placement``: the unserved index by the M/M/C estimate
    (``analytic``) or by this simulator (``simulated``, the seed's: :func:`simulated_evaluate` on the same length of
    the trace just before the run, its history); ``rule``: Alg. 1's choice of a model for each server
    (:data:`~petals_chain.algorithms.multimodel.PLACEMENT_RULES`)."""
    _check_placement(placement)
    work = work or {n: 1.0 for n in names}
    rates, reqs, sources, st = _at_own_load(
        names, lambda st: _rates_for(names, rho, servers, work, st), duration,
        _probe_stats(names, cost, max_batch, seed, trace), seed=seed, cost=cost, max_batch=max_batch, trace=trace)
    if arrivals == "poisson":
        reqs = poisson_arrivals(reqs, rates, duration, seed=seed)
    elif arrivals != "trace":
        raise ValueError(f"arrivals must be 'trace' or 'poisson', got {arrivals!r}")
    centroids = assign_length_classes(reqs, classes, features=class_features) if classes > 1 else None
    vols = make_servers(servers)
    models = make_models(names, rates, st, max_batch)
    extra: dict[str, Any] = {"pauses": pauses}
    if shared:
        models = [replace(models[0], name="shared")]
        plan = {v.name: "shared" for v in vols}
        extra["group_of"] = {n: "shared" for n in names}
        rho_m = {n: rates[n] / st[n]["chain_capacity_req_s"] / servers for n in names}
    elif placement == "simulated":
        hist, _ = _workload(names, rates, duration, seed=seed, cost=cost, trace=trace, before=True)
        if classes > 1:
            assign_length_classes(hist, classes, features=class_features)
        plan = mm.place_by_unserved_index(vols, models, rule=rule, evaluate=simulated_evaluate(
            hist, models, cost=cost, max_batch=max_batch, pauses=pauses))
    else:
        plan = mm.place_by_unserved_index(vols, models, rule=rule)
    counts = plan_counts(plan)
    if not shared:
        rho_m = {n: rates[n] / (counts.get(n, 0) * st[n]["chain_capacity_req_s"]) if counts.get(n) else math.inf
                 for n in names}
    rows = {}
    for s in schedules:
        o = simulate(reqs, models, vols, plan, s, cost=cost, max_batch=max_batch, **extra)
        m = summarize(o.requests)
        m["norm_latency_by_model"] = summarize(o.requests, by="model")["norm_latency"]
        m["steps"], m["wall_s"], m["unfinished"] = o.steps, o.wall_s, o.unfinished
        rows[s] = m
    f = rows.get("fcfs", {}).get("norm_latency")
    for m in rows.values():
        m["vs_fcfs"] = m["norm_latency"] / f if f else None
    slo_bound = None
    if bound and not shared:
        slo_bound = {"plan": slo_upper_bound(reqs, counts, cost, max_batch)}
        if len(names) == 2:
            slo_bound["best_split"], slo_bound["best_split_plan"] = best_split_slo_bound(reqs, names, servers, cost,
                                                                                         max_batch)
    return {"models": list(names), "shared": shared, "rho": rho, "servers": servers, "duration_s": duration, "requests": len(reqs),
            "sources": sources, "rates": rates, "plan": counts, "rho_per_model": rho_m, "stats": st,
            "max_batch": max_batch, "cost": vars(cost), "schedules": rows, "classes": classes,
            "class_features": class_features if classes > 1 else None, "class_centroids": centroids,
            "slo_upper_bound": slo_bound, "placement": None if shared else f"{placement}, {rule}",
            "arrivals": arrivals}


def poisson_shared(*, seed: int = 0, rho: float = 0.8, duration: float = 600.0, long_share: float = 0.3,
                   cost: StepCost = MM_COST, max_batch: int = 4,
                   schedules: Sequence[str] = mm.SCHEDULES, pauses: str = "seed") -> dict[str, Any]:
    """The seed's mechanism in isolation (its Fig. 2 / §1.8 "worth reproducing"): one chain time-shares a long
    service (``chat``: 100-199 output tokens, ``long_share`` of the requests) and a short one (``code``: 2-7),
    200-token prompts, Poisson arrivals at ``rho`` of the chain's capacity for the lengths drawn. ``pauses``: the
    seed's (a running request pauses on any priority inversion) by default, or the orchestrator's."""
    rng, arrivals = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 3])
    # lengths first, then the rate their capacity gives (a nominal rate put the drawn requests at rho 0.79-0.96)
    lengths: list[tuple[bool, int]] = []
    for _ in range(int(duration * 10)):  # more than a run at rho <= 1 of a 4-request chain can hold
        long_ = bool(rng.random() < long_share)
        lengths.append((long_, int(rng.integers(100, 200)) if long_ else int(rng.integers(2, 8))))
    def rate_for(n: int) -> float:  # rho of the chain's capacity for the first n lengths
        return rho * capacity_req_s(max_batch, 200.0, float(np.mean([o for _, o in lengths[:n]])), cost)

    rate = rate_for(len(lengths))
    for _ in range(2):  # the lengths a run of this rate holds
        rate = rate_for(max(1, int(rate * duration)))
    reqs: list[MMRequest] = []
    t = 0.0
    for long_, out in lengths:
        t += float(arrivals.exponential(1.0 / rate))
        if t >= duration:
            break
        reqs.append(MMRequest(len(reqs), "chat" if long_ else "code", t, 200, out, exec_alone(200, out, cost)))
    st = stats(reqs, cost, max_batch)
    cap = capacity_req_s(max_batch, 200.0, float(np.mean([r.output for r in reqs])), cost)
    models = make_models(("shared",), {"shared": rate}, {"shared": {"chain_capacity_req_s": cap,
                                                                   "exec_mean_s": 1.0}}, max_batch)
    rows = {}
    for sch in schedules:
        o = simulate(reqs, models, make_servers(1), {"s00": "shared"}, sch, cost=cost, max_batch=max_batch,
                     group_of={"chat": "shared", "code": "shared"}, pauses=pauses)
        rows[sch] = {**summarize(o.requests), "unfinished": o.unfinished}
    return {"requests": len(reqs), "rho": rate / cap, "stats": st, "schedules": rows,
            "db_vs_fcfs": rows["db"]["norm_latency"] / rows["fcfs"]["norm_latency"] if {"db", "fcfs"} <= set(rows) else None}


DB_CLASSES = 4  # length classes per model in the db experiment ([gap]: the seed does not state its count)


def db(*, quick: bool = False, seed: int = 0, rho: float = 0.8, trace: Mapping[str, str | None] | None = None,
       classes: int = DB_CLASSES, **kw: Any) -> dict[str, Any]:
    """(a) Chat (conversation trace) and code (code trace) at ``rho`` = 0.8: DB vs FCFS vs MLFQ in petals-chain's
    setting (each server serves one model, placed by the unserved index), each model's requests split into
    ``classes`` services by length (the seed's §6.1 services); beside it the same requests with one service per
    model, with classes of input length only, the seed's setting (every chain time-shares both models), and the
    servers placed by the seed's simulated unserved index on the preceding history (Alg. 1's rule, and ours: the
    server to the model whose index it lowers most), and under the seed's pause rule (a running request pauses for
    any better one; every other row pauses as the orchestrator does, ``PAUSE_RULES``)."""
    servers = kw.pop("servers", 6 if quick else 8)
    duration = kw.pop("duration", 300.0 if quick else 900.0)
    common = dict(rho=rho, servers=servers, duration=duration, seed=seed, trace=trace, **kw)
    r = compare(("chat", "code"), classes=classes, bound=True, **common)

    def variant(**extra: Any) -> dict[str, Any]:
        v = compare(("chat", "code"), **common, **extra)
        out = {k: v[k] for k in ("rho_per_model", "schedules", "plan", "classes", "class_features", "class_centroids",
                                 "requests")}
        out["db_vs_fcfs"] = v["schedules"]["db"]["norm_latency"] / v["schedules"]["fcfs"]["norm_latency"]
        return out

    r["one_service_per_model"] = variant(classes=1)
    r["input_classes"] = variant(classes=classes, class_features="input")
    r["seed_setting"] = variant(classes=classes, shared=True)
    r["poisson_arrivals"] = variant(classes=classes, arrivals="poisson")
    r["simulated_placement"] = variant(classes=classes, placement="simulated")
    r["simulated_gain_placement"] = variant(classes=classes, placement="simulated", rule="largest_gain")
    r["seed_pauses"] = variant(classes=classes, pauses="seed")
    r["poisson_shared"] = poisson_shared(seed=seed)
    rt = poisson_shared(seed=seed, schedules=("db",), pauses="runtime")["schedules"]["db"]
    r["poisson_shared"]["db_runtime_pauses"] = rt
    r["poisson_shared"]["db_runtime_vs_fcfs"] = rt["norm_latency"] / r["poisson_shared"]["schedules"]["fcfs"][
        "norm_latency"]
    d, f = r["schedules"].get("db"), r["schedules"].get("fcfs")
    r["db_vs_fcfs"] = d["norm_latency"] / f["norm_latency"] if d and f else None
    r["accept"] = None if r["db_vs_fcfs"] is None else {
        "db_vs_fcfs": r["db_vs_fcfs"] <= ACCEPT["db_vs_fcfs"], "db_slo": d["slo_attainment"] >= ACCEPT["db_slo"]}
    r["thresholds"] = ACCEPT
    r["experiment"] = "db"
    r["seed_claim"] = SEED_CLAIMS["db"]
    return _round(r)


def _shift_share(duration: float, hi: float) -> dict[str, Callable[[float], float]]:
    """Model ``chat`` (A) carries ``hi`` of the work for the first third, ``code`` (B) for the last half; linear
    in between (shares of the peak rate each model's stream is generated at)."""
    t1, t2 = duration / 3, duration / 2
    lo = 1.0 - hi

    def a_share(t: float) -> float:
        x = 0.0 if t < t1 else 1.0 if t >= t2 else (t - t1) / (t2 - t1)
        return hi + (lo - hi) * x

    return {"chat": lambda t: a_share(t) / hi, "code": lambda t: (1.0 - a_share(t)) / hi}


def shift_run(variants: Sequence[str], *, quick: bool = False, seed: int = 0, rho: float = 0.75, hi: float = 0.75,
              servers: int | None = None, duration: float | None = None, cost: StepCost = MM_COST,
              max_batch: int = 16, reload_s: float = 20.0, initial_s: float = 120.0,
              trace: Mapping[str, str | None] | None = None, classes: int = 1, placement: str = "analytic",
              rule: str = "most_unserved", pauses: str = "runtime") -> dict[str, Any]:
    """Chat's share of the work goes ``hi`` -> ``1 - hi`` (code's the reverse) at total load ``rho``. Variants:
    ``full`` (DB, unserved-index placement, adaptive replacement), ``fixed`` / ``-A`` (placement never re-planned),
    ``-F`` / ``-M`` (FCFS / MLFQ instead of DB, adaptive), ``-P`` (no placement: servers split evenly, fixed),
    ``-I`` (re-placed as ``full``, drift triggers included, but at the interval ``initial_s``: Eq. 8 off).
    ``classes`` > 1: each model's requests in that many length classes (:func:`assign_length_classes`)."""
    names = ("chat", "code")
    servers = servers or (6 if quick else 8)
    duration = duration or (600.0 if quick else 1200.0)
    # each model's peak rate: ``hi`` of the servers' work at load rho (the other model then has 1 - hi of it; sized
    # as if both peaked at once, the total load was rho / (2 hi) = 0.5, not rho)
    peak, reqs, sources, st = _at_own_load(
        names, lambda st: {n: rho * servers * hi * st[n]["chain_capacity_req_s"] for n in names}, duration,
        _probe_stats(names, cost, max_batch, seed, trace), seed=seed, cost=cost, max_batch=max_batch, trace=trace,
        share=_shift_share(duration, hi))
    if classes > 1:
        assign_length_classes(reqs, classes)
    vols = make_servers(servers)
    start_rates = {"chat": peak["chat"], "code": peak["code"] * (1 - hi) / hi}
    models0 = make_models(names, start_rates, st, max_batch)
    ui_plan = mm.place_by_unserved_index(vols, models0)
    even = mm.even_split(vols, models0)
    rows, logs = {}, {}
    for v in variants:
        sched = {"-F": "fcfs", "-M": "mlfq"}.get(v, "db")
        adaptive = v in ("full", "-F", "-M", "-I")
        plan = even if v == "-P" else ui_plan
        log: list = []
        kw: dict[str, Any] = {"reload_s": reload_s, "pauses": pauses}
        if adaptive:
            kw["replan"] = adaptive_policy(models0, vols, initial_s=initial_s, reload_s=reload_s, log=log,
                                           placement=placement, rule=rule, adapt=v != "-I", estimate=v != "-I")
            kw["replan_first"] = 10.0
        o = simulate(reqs, models0, vols, plan, sched, cost=cost, max_batch=max_batch, **kw)
        m = summarize(o.requests)
        m["steps"], m["wall_s"], m["moves"] = o.steps, o.wall_s, sum(len(p["moves"]) for p in o.plans)
        m["unfinished"] = o.unfinished
        m["initial_plan"] = plan_counts(plan)
        m["replans"] = len(log)
        m["intervals_s"] = [round(x["interval_s"], 1) for x in log]
        rows[v] = m
        logs[v] = log
    return {"models": list(names), "rho": rho, "hi": hi, "servers": servers, "duration_s": duration,
            "requests": len(reqs), "sources": sources, "peak_rates": peak, "reload_s": reload_s,
            # the load the rows offer: each request a 1 / capacity share of a chain-second, over the run
            "offered_load": sum(1.0 / st[r.model]["chain_capacity_req_s"] for r in reqs) / (servers * duration),
            "initial_interval_s": initial_s, "variants": rows, "log": logs.get("full", []), "classes": classes}


def shift(*, quick: bool = False, seed: int = 0, classes: int = DB_CLASSES, **kw: Any) -> dict[str, Any]:
    """(b) A traffic shift from chat to code: adaptive replacement vs the fixed plan (both DB), each model's
    requests in ``classes`` length classes (the seed's services)."""
    r = shift_run(("full", "fixed"), quick=quick, seed=seed, classes=classes, **kw)
    a, f = r["variants"]["full"], r["variants"]["fixed"]
    r["adaptive_vs_fixed"] = a["norm_latency"] / f["norm_latency"]
    r["accept"] = {"adaptive_vs_fixed": r["adaptive_vs_fixed"] <= ACCEPT["adaptive_vs_fixed"]}
    r["thresholds"] = ACCEPT
    r["experiment"] = "shift"
    r["seed_claim"] = SEED_CLAIMS["shift"]
    return _round(r)


def ablation(*, quick: bool = False, seed: int = 0, classes: int = DB_CLASSES, **kw: Any) -> dict[str, Any]:
    """(c) The seed's §6.3 ablations on the shift workload: SeaLLM, -F, -M, -P, -A (and -I: re-placed at a fixed
    interval, Eq. 8 off) in one table, each model's
    requests in ``classes`` length classes (the seed's services); the same with one service per model beside it."""

    def run(k: int) -> dict[str, Any]:
        r = shift_run(("full", "-F", "-M", "-P", "fixed", "-I"), quick=quick, seed=seed, classes=k, **kw)
        r["variants"]["-A"] = r["variants"].pop("fixed")
        base = r["variants"]["full"]
        for m in r["variants"].values():
            m["ln_vs_full"] = m["norm_latency"] / base["norm_latency"]
            m["slo_full_over"] = base["slo_attainment"] / m["slo_attainment"] if m["slo_attainment"] else math.inf
        r["classes"] = k
        return r

    r = run(classes)
    if classes > 1:
        r["one_service_per_model"] = {k: v for k, v in run(1).items() if k in ("variants", "classes")}
    r["experiment"] = "ablation"
    r["seed_claim"] = SEED_CLAIMS["ablation"]
    return _round(r)


def sweep(*, quick: bool = False, seed: int = 0, rhos: Sequence[float] | None = None,
          trace: Mapping[str, str | None] | None = None, classes: int = DB_CLASSES, **kw: Any) -> dict[str, Any]:
    """(d) Load swept for 2 models (chat, code) and 4 (chat, code and two more of each trace, other segments),
    each model's requests in ``classes`` length classes (the seed's services)."""
    rhos = rhos or ((0.5, 0.8, 0.9) if quick else (0.5, 0.6, 0.7, 0.8, 0.9))
    rows = []
    for names in (("chat", "code"), ("chat", "code", "chat2", "code2")):
        for rho in rhos:
            r = compare(names, rho=rho, servers=kw.get("servers", 2 * len(names) if quick else 4 * len(names)),
                        duration=kw.get("duration", 200.0 if quick else 600.0), seed=seed, trace=trace,
                        classes=classes)
            row = {"models": len(names), "rho": rho, "requests": r["requests"], "plan": r["plan"]}
            for s, m in r["schedules"].items():
                row[s] = {"norm_latency": m["norm_latency"], "slo_attainment": m["slo_attainment"], "p99_s": m["p99_s"]}
            row["db_vs_fcfs"] = row["db"]["norm_latency"] / row["fcfs"]["norm_latency"]
            rows.append(row)
    return _round({"experiment": "sweep", "rows": rows, "classes": classes, "seed_claim": SEED_CLAIMS["sweep"]})


EXPERIMENTS = {"db": db, "shift": shift, "ablation": ablation, "sweep": sweep}

_COLS = ["L_N", "L_N (ratio of means)", "vs FCFS", "SLO att.", "P99 s", "TTFT s", "preempt", "recompute"]


def _row(label: str, m: Mapping[str, Any], base: float | None = None) -> list[Any]:
    return [label, m["norm_latency"], m["norm_latency_ratio_of_means"],
            None if not base else m["norm_latency"] / base, m["slo_attainment"], m["p99_s"], m["ttft_s"],
            m["preemptions"], m["recomputes"]]


def tables(name: str, r: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """``(title, header, rows)`` of one experiment's result, for the CLI."""
    out = []
    if name == "db":
        k = r["classes"]
        for label, res in ((f"petals-chain (one model per server), {k} length classes per model", r),
                           ("same requests, one service per model", r["one_service_per_model"]),
                           (f"same, {k} classes of input length only (output not declared)", r["input_classes"]),
                           (f"seed setting (chains time-share both models), {k} length classes per model",
                            r["seed_setting"]),
                           (f"the traces' lengths with Poisson arrivals (no bursts), {k} length classes per model",
                            r["poisson_arrivals"]),
                           (f"servers placed by the unserved index simulated on the trace's preceding {r['duration_s']:g} s "
                            f"(the seed's), {k} length classes per model", r["simulated_placement"]),
                           (f"the same simulated index, each server to the model whose index it lowers most, {k} length "
                            f"classes per model", r["simulated_gain_placement"]),
                           (f"the seed's pause rule (a running request pauses for any better one; the orchestrator's "
                            f"and the rows above: by {mm.PAUSE_FACTOR:g}x), {k} length classes per model",
                            r["seed_pauses"])):
            f = res["schedules"]["fcfs"]["norm_latency"]
            rows = [_row(s, m, f) + [m["norm_latency_by_model"]] for s, m in res["schedules"].items()]
            rows += [_row(f"  {s}: {mdl}", pm) + [None] for s, m in res["schedules"].items()
                     for mdl, pm in m["per_model"].items()]
            out.append((f"(a) {label}: chat + code at rho {r['rho']}, servers {res['plan']}, rho per model "
                        f"{ {k: round(v, 2) for k, v in res['rho_per_model'].items()} }, {res['requests']} requests"
                        + (f"; classes (input, output tokens) {res['class_centroids']}" if res["class_centroids"] else ""),
                        ["schedule"] + _COLS + ["L_N by model"], rows))
        ps = r["poisson_shared"]
        f = ps["schedules"]["fcfs"]["norm_latency"]
        out.append((f"(a') seed mechanism: one chain time-shares long chat (100-199 tokens) and short code (2-7), "
                    f"Poisson, rho {ps['rho']:.2f}, {ps['requests']} requests, the seed's pause rule",
                    ["schedule"] + _COLS, [_row(s, m, f) for s, m in ps["schedules"].items()]
                    + [_row("db, the orchestrator's pause rule", ps["db_runtime_pauses"], f)]))
        out.append(("acceptance (issue 17)", ["check", "ours", "target", "met"],
                    [["DB L_N / FCFS L_N (seed mechanism, Poisson)", ps["db_vs_fcfs"], r["thresholds"]["db_vs_fcfs"],
                      ps["db_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["  the same with the orchestrator's pause rule", ps["db_runtime_vs_fcfs"],
                      r["thresholds"]["db_vs_fcfs"], ps["db_runtime_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["DB L_N / FCFS L_N (Azure traces, length classes)", r["db_vs_fcfs"], r["thresholds"]["db_vs_fcfs"],
                      r["accept"]["db_vs_fcfs"]],
                     ["DB L_N / FCFS L_N (one service per model)", r["one_service_per_model"]["db_vs_fcfs"],
                      r["thresholds"]["db_vs_fcfs"],
                      r["one_service_per_model"]["db_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["DB L_N / FCFS L_N (seed setting)", r["seed_setting"]["db_vs_fcfs"], r["thresholds"]["db_vs_fcfs"],
                      r["seed_setting"]["db_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["DB L_N / FCFS L_N (Azure traces, the seed's pause rule)", r["seed_pauses"]["db_vs_fcfs"],
                      r["thresholds"]["db_vs_fcfs"], r["seed_pauses"]["db_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["DB SLO attainment", r["schedules"]["db"]["slo_attainment"], r["thresholds"]["db_slo"],
                      r["accept"]["db_slo"]],
                     ["  upper bound for any order on this plan", r["slo_upper_bound"]["plan"], None, None],
                     [f"  upper bound for any order and split (best: {r['slo_upper_bound']['best_split_plan']})",
                      r["slo_upper_bound"]["best_split"], None, None],
                     [f"DB SLO attainment, placed by simulated UI {r['simulated_placement']['plan']} (L_N / FCFS "
                      f"{r['simulated_placement']['db_vs_fcfs']:.2f})",
                      r["simulated_placement"]["schedules"]["db"]["slo_attainment"], r["thresholds"]["db_slo"],
                      r["simulated_placement"]["schedules"]["db"]["slo_attainment"] >= r["thresholds"]["db_slo"]],
                     [f"DB SLO attainment, simulated UI, largest gain {r['simulated_gain_placement']['plan']} (L_N / "
                      f"FCFS {r['simulated_gain_placement']['db_vs_fcfs']:.2f})",
                      r["simulated_gain_placement"]["schedules"]["db"]["slo_attainment"], r["thresholds"]["db_slo"],
                      r["simulated_gain_placement"]["schedules"]["db"]["slo_attainment"] >= r["thresholds"]["db_slo"]],
                     ["DB L_N / FCFS L_N (traces' lengths, Poisson arrivals)", r["poisson_arrivals"]["db_vs_fcfs"],
                      r["thresholds"]["db_vs_fcfs"], r["poisson_arrivals"]["db_vs_fcfs"] <= r["thresholds"]["db_vs_fcfs"]],
                     ["DB SLO attainment (traces' lengths, Poisson arrivals)",
                      r["poisson_arrivals"]["schedules"]["db"]["slo_attainment"], r["thresholds"]["db_slo"],
                      r["poisson_arrivals"]["schedules"]["db"]["slo_attainment"] >= r["thresholds"]["db_slo"]]]))
    elif name in ("shift", "ablation"):
        for res in (r, r.get("one_service_per_model")):
            if res is None:
                continue
            rows = [[v, m["norm_latency"], m.get("ln_vs_full"), m["slo_attainment"], m["p99_s"], m["moves"],
                     m["replans"], str(m["initial_plan"]), m["per_model"].get("chat", {}).get("norm_latency"),
                     m["per_model"].get("code", {}).get("norm_latency")] for v, m in res["variants"].items()]
            k = res.get("classes", 1)
            out.append((f"({'b' if name == 'shift' else 'c'}) {name}: chat {r['hi']:.0%} -> {1 - r['hi']:.0%} of the "
                        f"work, rho {r['rho']}, {r['servers']} servers, reload {r['reload_s']} s, {r['requests']} "
                        f"requests, " + (f"{k} length classes per model" if k > 1 else "one service per model"),
                        ["variant", "L_N", "vs full", "SLO att.", "P99 s", "moves", "re-plans", "initial plan",
                         "L_N chat", "L_N code"], rows))
        if name == "shift":
            out.append(("acceptance (issue 17)", ["check", "ours", "target", "met"],
                        [["adaptive L_N / fixed L_N", r["adaptive_vs_fixed"], r["thresholds"]["adaptive_vs_fixed"],
                          r["accept"]["adaptive_vs_fixed"]]]))
    elif name == "sweep":
        rows = [[x["models"], x["rho"], x["requests"], str(x["plan"]), x["db"]["norm_latency"], x["fcfs"]["norm_latency"],
                 x["mlfq"]["norm_latency"], x["db_vs_fcfs"], x["db"]["slo_attainment"], x["fcfs"]["slo_attainment"],
                 x["mlfq"]["slo_attainment"]] for x in r["rows"]]
        out.append((f"(d) load sweep, {r.get('classes', 1)} length classes per model", ["models", "rho", "requests", "plan", "L_N db", "L_N fcfs", "L_N mlfq", "db/fcfs",
                                       "SLO db", "SLO fcfs", "SLO mlfq"], rows))
    return out


def run_experiments(names: Sequence[str], *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    return {n: EXPERIMENTS[n](quick=quick, seed=seed) for n in names}

