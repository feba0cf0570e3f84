"""Which model each server offering several serves (issue 17, seed 001 SeaLLM §4.1 and §4.3), at run time.

One orchestrator process serving several models (``--model NAME=SOURCE`` repeated, ``models.py``) runs one
:class:`ModelPlacer`. A server started with several ``--model`` announces itself under each model's prefix
(``serving`` naming the one it holds); the placer decides the model of every such *flexible* server, tells each
model's planner which servers are its own (``Planner.placed``) and publishes the decision as a signed
:class:`~petals_chain.swarm.records.PlacementRecord`, which the servers follow (``server/server.py``). A server
offering one of the models only is that model's, as before. The decisions are the seed's, shared with the
simulator (``algorithms/multimodel.py``):

* a flexible server seen for the first time is placed at once by the unserved index (Eq. 6, Alg. 1) given the
  servers already placed, unless it already holds blocks of one of the models (an orchestrator restart: kept);
* every replacement interval ``I_t`` (Eq. 8, adapted by ``(1 ± β)`` from how far the last interval's measured
  SLO attainment and normalized latency were from the estimate), or sooner when the traffic mix drifts, the
  placement is recomputed by the unserved index and only the moves that pay for their reload
  (:func:`~petals_chain.algorithms.multimodel.moves_that_pay`) are made; a re-plan for a drift is followed by one
  more ``window_s`` later, when the rates it is made from no longer mix the traffic from before the drift;
* a server that leaves keeps its placement for ``forget_s``: restarted with the same identity it serves the model
  it held (no needless reload of another);
* a server whose record says it cannot load the span its model's planner assigned it (``failed_span``,
  ``load_error``, announced at or after the epoch that gave the span: ``Planner.reported_load_failure``), or that
  is not online with it by the planner's ``--load-deadline-s`` (``reason`` "overdue"), is moved at once to another
  model it offers and not placed on that model again while the failure stands: until it leaves or restarts (a
  restart loads afresh; told by a new ``started_at`` in its records, however soon it came back), or, while still
  placed on the model (every other one failed too), the planner stops saying so (it loaded the blocks, or was
  given others). Its move made the server forget the failure (it concerned
  the model it left), so the placer keeps it: a re-placement gave the model back, and the load failed again. An
  overdue load stands as long as the deadline it missed, and each one of the same model doubles that wait and the
  next try's deadline there (``Planner.load_deadline_scale``): a load slower than the deadline ends on a later try
  (it was restarted at every try, every two deadlines, for good), and a load that ends in time leaves the doublings
  it needed only (a server slow once kept the longer deadline until it restarted).

Policies (``--model-placement``): ``ui`` (all of the above), ``static`` (re-placed once, for the first traffic
seen, then never moved: a fixed plan, the "no adaptive replacement" ablation), ``even`` (round-robin, never moved:
"no placement"). Under each, a server that cannot load its model's span is moved off it (above).

The unserved index (``--placement-index``): ``analytic`` (an M/M/C estimate from each model's arrival rate: fast,
blind to bursts and lengths) or ``simulated`` (the seed's: each model's recent requests, the completed ones with
their lengths and the waiting ones, replayed on the chains a plan would give it by the chain simulator of
:mod:`~petals_chain.algorithms.chainsim`, whose step cost is fitted per model from the completed requests'
service times and batch sizes; falls back to ``analytic`` for a round where a model with traffic has no fitted
cost yet or fewer than ``min_replay`` requests can be replayed); a re-placement's search runs in a worker thread
with either index. ``--placement-rule``:
Alg. 1's ``most_unserved`` (the default with ``analytic``) or ``largest_gain`` (the default with ``simulated``;
docs/results.md, issue 17, for why each pairs with its index). With either index no move leaves a model that has
traffic without a complete chain (:data:`STRANDED_UI_PER_S`).

Model parameters are what the planners know: ``L``, ``s_m``, ``s_c`` (bytes) from the model config, each server's
``tau_p`` and ``tau_c`` for that model (measured once hops were observed), the arrival rate over ``window_s``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from petals_chain.algorithms.chainsim import PLACEMENTS, MMRequest, StepCost, exec_alone, simulated_evaluate
from petals_chain.algorithms.multimodel import (ALPHA, BETA, PLACEMENT_RULES, SCHEDULES, AdaptiveInterval, Evaluate,
                                                MixDriftDetector, PlanMetrics, ReplanTrigger, ServedModel, Volunteer,
                                                analytic_evaluate, groups_of, model_chains, moves_that_pay,
                                                place_by_unserved_index, ui_rate)
from petals_chain.orchestrator.planner import MEMORY_MAX, note_start, started_at_of
from petals_chain.swarm.periodic import run_every
from petals_chain.swarm.records import PlacementRecord

logger = logging.getLogger("petals_chain.orchestrator.placement")

PLACEMENT_POLICIES = ("ui", "static", "even")
PLACEMENT_INDEXES = PLACEMENTS  # how the unserved index is evaluated: analytic (M/M/C) or simulated (the seed's)
DEFAULT_RULE = {"analytic": "most_unserved", "simulated": "largest_gain"}
# what leaving a model that has traffic without a complete chain costs a plan (unserved index per second): more than
# any gain elsewhere, so the moves made never strand a model its users are asking for (its requests would wait for a
# server to reload it; the index alone may trade a quiet model's few misses for a busy one's)
STRANDED_UI_PER_S = 1e6
# a move must cut some model's normalized latency by this much (in execution times; or save an SLO miss) over the
# interval: the plans' estimates rest on measured speeds, which swing +-30 % between re-plans on a shared host, and
# with no miss predicted either way the index prices a reload at nothing (servers moved back and forth for 1e-6).
# A server of a model without traffic moves for any gain (its users lose nothing).
MIN_LN_GAIN = 0.5
# an overdue load doubles the wait before the next try and that try's deadline up to 2**this (1024 x the deadline)
OVERDUE_DOUBLINGS = 10


@dataclass
class History:
    """What the simulated index replays: each model's recent requests (arrivals from the window's start, s),
    its fitted step cost, the chain time that cost was measured on, its batch limit and the schedule."""

    requests: list[MMRequest]
    costs: dict[str, StepCost]
    ref_times: dict[str, float]
    max_batch: dict[str, int]
    schedule: str
    span_s: float
    rate_floor: dict[str, float]

    def models(self, models: Sequence[ServedModel]) -> list[ServedModel]:
        """``models`` with each rate at least its ``rate_floor``."""
        return [m.with_rate(max(m.rate, self.rate_floor.get(m.name, 0.0))) for m in models]

    def evaluate(self, models: Sequence[ServedModel]) -> Evaluate:
        return simulated_evaluate(self.requests, models, schedule=self.schedule, cost=self.costs,
                                  max_batch=self.max_batch, horizon_s=self.span_s, ref_times=self.ref_times)


class ModelPlacer:
    """Places flexible servers on the models of ``orchs`` (one Orchestrator per model, keyed by ``names``)."""

    def __init__(self, orchs: Sequence[Any], *, policy: str = "ui", interval_s: float = 600.0,
                 window_s: float = 120.0, reload_s: float = 10.0, refresh_s: float = 2.0, forget_s: float = 600.0,
                 drift_threshold: float = 0.2, min_arrivals: int = 20, beta: float = BETA,
                 expiration_s: float = 60.0, index: str = "analytic", rule: str | None = None,
                 max_history: int = 2000, min_replay: int = 40, clock: Callable[[], float] = time.monotonic):
        if policy not in PLACEMENT_POLICIES:
            raise ValueError(f"unknown placement policy {policy!r}; choose from {', '.join(PLACEMENT_POLICIES)}")
        if index not in PLACEMENT_INDEXES:
            raise ValueError(f"unknown placement index {index!r}; choose from {', '.join(PLACEMENT_INDEXES)}")
        rule = rule or DEFAULT_RULE[index]
        if rule not in PLACEMENT_RULES:
            raise ValueError(f"unknown placement rule {rule!r}; choose from {', '.join(PLACEMENT_RULES)}")
        self.index, self.rule, self.max_history, self.min_replay = index, rule, int(max_history), int(min_replay)
        if len(orchs) < 2:
            raise ValueError("placement needs two models or more")
        self.orchs = {o.model_id: o for o in orchs}
        self.by_prefix = {o.prefix: name for name, o in self.orchs.items()}
        self.policy = policy
        self.window_s, self.reload_s, self.refresh_s, self.forget_s = window_s, reload_s, refresh_s, forget_s
        self.expiration_s = expiration_s
        self.clock = clock
        self.interval = AdaptiveInterval(interval_s, beta=beta, min_s=min(30.0, interval_s),
                                         max_s=max(3600.0, interval_s))
        self.drift = MixDriftDetector(window_s=window_s, threshold=drift_threshold, min_arrivals=min_arrivals)
        self.placement: dict[str, str] = {}  # flexible server peer id -> model name
        self.gone: dict[str, float] = {}  # placed servers not seen since (clock time)
        # servers that cannot load a model's span, as its planner last read their record or its load deadline says:
        # {peer: {model: {failed_span, load_error, reason, t}}}; never placed on those models while kept (module
        # docstring for when they are forgotten)
        self.load_failures: dict[str, dict[str, dict[str, Any]]] = {}
        # each live flexible server's current process start as its records announce it (0: an older server;
        # _note_start): a record's start changed to one not among starts_seen is a restart, which forgets its load
        # failures (it may come back before its record expires); one among them (the last STARTS_KEPT) is an older
        # record read late (each such read forgot its failed loads: placed back on a model it had failed, the moment
        # traffic asked)
        self.started_at: dict[str, float] = {}
        self.starts_seen: dict[str, tuple[float, ...]] = {}
        self.record_starts: dict[str, dict[str, float]] = {}  # {peer: {model: the start its record there announced}}
        # {peer: {model: k}}: its loads of that model were overdue k times (since it started or joined): the k-th
        # keeps it off the model for 2**(k-1) deadlines and its next try there gets 2**k (OVERDUE_DOUBLINGS at most),
        # where each try had the one deadline: a load slower than it was moved off and back every two deadlines,
        # restarted at every try, and never ended (the model unserved, the server serving nothing half the time)
        self.overdue_strikes: dict[str, dict[str, int]] = {}
        self.epoch = 0
        self.planned_at = clock()
        self._stranded_at = -math.inf  # the last re-placement for a model with traffic and no server
        self.planned_wall = time.time()
        self.estimate: PlanMetrics | None = None
        self.trigger = ReplanTrigger(window_s)
        self.moves = 0
        self.log: deque[dict] = deque(maxlen=50)
        self.replans: deque[dict] = deque(maxlen=20)  # each re-placement: why, the rates, where it aimed, what moved
        self._published_epoch = -1
        self._published_at = -math.inf
        self._last_arrival: dict[str, float] = {name: -math.inf for name in self.orchs}
        for name, o in self.orchs.items():
            o.planner.placed = self._placed_on(name)

    # ---- what the planners ask --------------------------------------------------------------------
    def offered(self, record: Any) -> list[str]:
        """The models (our names) a server record offers, in its order."""
        return [self.by_prefix[p] for p in dict.fromkeys(record.models) if p in self.by_prefix]

    def allowed(self, peer: str, record: Any) -> list[str]:
        """The models a server offers less those it cannot load (``load_failures``), in its order."""
        failed = self.load_failures.get(peer, {})
        return [n for n in self.offered(record) if n not in failed]

    def _failing(self, peer: str) -> bool:
        """Placed on a model it cannot load (it failed every other one it offers too): serves none."""
        return self.placement.get(peer) in self.load_failures.get(peer, {})

    def _placed_on(self, name: str) -> Callable[[str, Any], bool]:
        prefix = self.orchs[name].prefix

        def placed(peer_id: str, record: Any) -> bool:
            if len(self.offered(record)) < 2:  # offers this model only (as far as we serve): ours unless busy
                return record.serving in ("", prefix)
            return self.placement.get(peer_id) == name

        return placed

    # ---- inputs -----------------------------------------------------------------------------------
    def _records(self) -> dict[str, dict[str, Any]]:
        """``{peer id: {model name: record}}`` of every live server any model's planner saw."""
        out: dict[str, dict[str, Any]] = {}
        for name, o in self.orchs.items():
            for peer, rec in o.planner.seen.items():
                if rec.state != "offline":
                    out.setdefault(peer, {})[name] = rec
        return out

    def _rate(self, name: str, now: float) -> float:
        """Arrivals per second at model ``name`` over the last ``window_s`` (the planner's arrival log), and at
        least its requests in flight (running or waiting) over that window: a model whose one long request arrived
        before the window read as idle, so any gain paid for moving the server under it, and the next arrival
        moved one back (two reloads and a cut stream). Sessions held between turns are not in flight (their turns
        arrive as requests do)."""
        o = self.orchs[name]
        rates = o.planner.rates
        span = max(1.0, min(self.window_s, now - rates.t0))
        dispatch = getattr(o, "dispatch", None)
        in_flight = int(getattr(dispatch, "stepping", 0) or 0) + int(getattr(dispatch, "queue_length", 0) or 0)
        return max(rates.count_since(now - span, now), in_flight) / span

    def _note_arrivals(self, now: float) -> None:
        """Feed the mix drift detector with the arrivals since the last round (all of them: the estimator's kept times
        alone, ``ARRIVALS_KEPT``, capped a busy model's share per round: 10,000 vs 1,000 req/s read as a 67/33 mix,
        a drift, and servers re-placed for it)."""
        for name, o in self.orchs.items():
            times = o.planner.rates.times_since(self._last_arrival[name], now)
            for t in times:
                self.drift.arrive(name, t)
            if times:
                self._last_arrival[name] = max(self._last_arrival[name], times[-1])

    def snapshot(self, records: dict[str, dict[str, Any]], now: float
                 ) -> tuple[list[Volunteer], list[ServedModel], dict[str, str]]:
        """``(volunteers, models, fixed)`` for the seed's algorithms: every live server with its memory, speed and
        link, every model with its sizes, reference block time and rate, and the servers that offer one model."""
        # Per block per job, measured (a server that served the model: observed decode steps) and advertised (its
        # record). A model's reference time is the median of what servers delivered, not of what every offering
        # server advertises: most of those never ran it, and their advertised times outvoted the one measured
        # server (a real model ~10x slower than advertised looked fast, and got one server at 3 req/s).
        measured: dict[str, dict[str, float]] = {}
        advertised: dict[str, dict[str, float]] = {}
        comm: dict[str, float] = {}
        for peer, by_model in records.items():
            for name, rec in by_model.items():
                planner = self.orchs[name].planner
                view = planner.servers.get(peer)
                got = planner.measured_tau_p(view) if view is not None else None
                if got is not None and got > 0:
                    measured.setdefault(peer, {})[name] = got
                if float(rec.tau_p) > 0:
                    advertised.setdefault(peer, {})[name] = float(rec.tau_p)
                if peer not in comm and view is not None:
                    comm[peer] = planner.tau_c(view)

        def reference(taus: dict[str, dict[str, float]], name: str) -> float | None:
            times = [t[name] for t in taus.values() if name in t]
            return statistics.median(times) if times else None

        advertised_ref = {name: reference(advertised, name) for name in self.orchs}
        models = []
        for name, o in self.orchs.items():
            spec = o.planner._model_spec() or o.model_spec()
            block_time = reference(measured, name) or advertised_ref[name] or 1.0
            plan = o.planner.plan
            models.append(ServedModel(name, spec.num_blocks, float(spec.block_size), float(spec.cache_size), block_time,
                                      rate=self._rate(name, now), c=int(plan.c) if plan is not None and plan.c else 8))
        by_name = {m.name: m for m in models}
        volunteers, fixed = [], {}
        for peer, by_model in sorted(records.items()):
            # a server's speed: its measured times against the measured references, else its advertised ones
            # against the advertised references (never one against the other)
            if measured.get(peer):
                speeds = [by_name[n].block_time / t for n, t in measured[peer].items()]
            else:
                speeds = [advertised_ref[n] / t for n, t in advertised.get(peer, {}).items()]
            rec = next(iter(by_model.values()))
            volunteers.append(Volunteer(peer, float(min(rec.memory_bytes, MEMORY_MAX)),
                                        statistics.median(speeds) if speeds else 1.0, comm.get(peer, 0.0)))
            offered = self.offered(rec)
            if len(offered) < 2:
                if len(by_model) == 1:
                    fixed[peer] = next(iter(by_model))
                elif rec.serving in self.by_prefix:
                    fixed[peer] = self.by_prefix[rec.serving]
        return volunteers, models, fixed

    # ---- decisions --------------------------------------------------------------------------------
    def _stranded(self, records: dict[str, dict[str, Any]], flexible: dict[str, Any], now: float) -> list[str]:
        """Models that had arrivals in the last ``window_s`` and no live server (none placed on them, none offering
        only them), that a flexible server offers."""
        offered = {n for p, rec in flexible.items() for n in self.allowed(p, rec)}
        served = {self.placement.get(p) for p in flexible if not self._failing(p)}
        for peer, by_model in records.items():
            if peer not in flexible:
                served.update(by_model)  # a server offering one of our models only: it serves that one
        return [n for n in self.orchs if n in offered and n not in served and self._rate(n, now) > 0]

    def _flexible(self, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``{peer: a record}`` of the live servers offering two of our models or more."""
        out = {}
        for peer, by_model in records.items():
            rec = next(iter(by_model.values()))
            if len(self.offered(rec)) >= 2:
                out[peer] = rec
        return out

    def _holding(self, peer: str, records: dict[str, dict[str, Any]]) -> str | None:
        """The model a server already holds blocks of (as its records say), if one of ours."""
        for name, rec in records.get(peer, {}).items():
            if rec.serving == self.orchs[name].prefix and rec.num_blocks > 0:
                return name
        return None

    def _place_new(self, new: list[str], records: dict[str, dict[str, Any]], now: float) -> None:
        """Place servers seen for the first time, at once: by the analytic index and Alg. 1's rule whatever
        ``index`` is (a join waits for no simulation; the next re-placement uses the configured index)."""
        volunteers, models, fixed = self.snapshot(records, now)
        live = {v.name for v in volunteers}
        # a server kept on a model it cannot load (it failed every one it offers) serves none: not counted
        known = {p: m for p, m in self.placement.items() if p in live and not self._failing(p)}
        for peer in new:
            held = self._holding(peer, records)
            if held is not None:
                known[peer] = held
                self._set(peer, held, "holds its blocks")
        for peer in (p for p in new if p not in known):  # one at a time, each given the ones placed before it
            rec = next(iter(records[peer].values()))
            choice = self._choose(peer, self.allowed(peer, rec) or self.offered(rec), volunteers, models,
                                  {**fixed, **known})
            known[peer] = choice
            self._set(peer, choice, "round-robin" if self.policy == "even" else "joined: unserved index")

    def _choose(self, peer: str, allowed: list[str], volunteers: list[Volunteer], models: list[ServedModel],
                placed: dict[str, str]) -> str:
        """The model of ``allowed`` for ``peer`` given the servers ``placed``: round-robin (``even``), else by the
        analytic unserved index and Alg. 1's rule."""
        if self.policy == "even":
            counts = {n: sum(1 for x in placed.values() if x == n) for n in allowed}
            return min(sorted(allowed), key=lambda n: (counts[n], list(self.orchs).index(n)))
        live = {v.name for v in volunteers}
        placed = {p: m for p, m in placed.items() if p in live and p != peer}
        plan = place_by_unserved_index([v for v in volunteers if v.name in placed or v.name == peer], models,
                                       horizon_s=self.interval.interval, fixed=placed, allowed={peer: allowed})
        return plan.get(peer) or sorted(allowed)[0]

    # ---- failed loads -----------------------------------------------------------------------------------
    def _note_load_failures(self, flexible: dict[str, Any], records: dict[str, dict[str, Any]], now: float) -> None:
        """Keep what the planner of each flexible server's model says of its failed load there (its record, at or
        after the epoch that gave it the span; or the load deadline, past), and forget it when the server leaves or
        restarts (it loads afresh; a restart is told by a new ``started_at`` in its records, and what a record of
        the run before says is not taken) or, still placed on the model, the planner stops saying so. An overdue load
        (no error said) is forgotten after as long again as the deadline it missed (:meth:`_expire_overdue`)."""
        self._expire_overdue(now)
        for peer in [p for p in self.load_failures if p not in flexible]:
            logger.info("placement: server %s left: the models it could not load (%s) may be placed on it again",
                        peer[:12], ", ".join(self.load_failures.pop(peer)))
        for peer in [p for p in self.started_at if p not in flexible]:
            del self.started_at[peer]
            self.starts_seen.pop(peer, None)
            self.record_starts.pop(peer, None)
        for peer in [p for p in self.overdue_strikes if p not in flexible]:
            self._forget_overdue(peer)
        for peer, rec in flexible.items():
            by_model = records.get(peer, {})
            started = self._note_start(peer, rec, by_model)
            name = self.placement.get(peer)
            if name is None or started_at_of(by_model.get(name)) != started:
                continue  # its record under that model is another run's (the last, or one read late)
            planner = self.orchs[name].planner
            self._shorten_overdue(peer, name, planner)
            report = getattr(planner, "reported_load_failure", None)
            failure = report(peer) if report is not None else None
            failed = self.load_failures.get(peer, {})
            said = failed.get(name)
            if failure is not None:
                if said is None or (said["failed_span"], said["load_error"]) != (failure["failed_span"],
                                                                                 failure["load_error"]):
                    entry = {"reason": "reported", **failure, "t": time.time(), "since": now}
                    if entry["reason"] == "overdue":
                        entry["wait_s"] = self._overdue_again(peer, name)
                    self.load_failures.setdefault(peer, {})[name] = entry
            elif said is not None and peer in planner.servers:
                del failed[name]
                if not failed:
                    del self.load_failures[peer]
                logger.info("placement: server %s (%s) no longer reports a failed load of model %s (it loaded its "
                            "blocks, or was given others): it may be placed on it again", rec.public_name,
                            peer[:12], name)

    def _overdue_again(self, peer: str, name: str) -> float:
        """Count an overdue load of model ``name`` by ``peer``; the k-th: its next try there gets ``2**k`` times the
        model's load deadline (``Planner.load_deadline_scale``), and the wait before it, returned, is ``2**(k-1)``
        deadlines (the one it missed)."""
        k = self.overdue_strikes.setdefault(peer, {}).get(name, 0) + 1
        self.overdue_strikes[peer][name] = k
        planner = self.orchs[name].planner
        scales = getattr(planner, "load_deadline_scale", None)
        if scales is not None:
            scales[peer] = 2.0 ** min(k, OVERDUE_DOUBLINGS)
        return float(getattr(planner, "load_deadline_s", 0.0) or 0.0) * 2.0 ** min(k - 1, OVERDUE_DOUBLINGS)

    def _shorten_overdue(self, peer: str, name: str, planner: Any) -> None:
        """After a load of model ``name`` that ended in time, ``peer``'s count of overdue loads there falls to the
        fewest doublings of the load deadline that load needed (0: forgotten): one slow load kept the longer deadline,
        and a hang there was noticed that much later, until the server restarted. Never raised here."""
        k = self.overdue_strikes.get(peer, {}).get(name, 0)
        view = planner.servers.get(peer) if k else None
        took = getattr(view, "load_s", None)
        deadline = float(getattr(planner, "load_deadline_s", 0.0) or 0.0)
        if took is None or deadline <= 0:
            return
        doublings = min(k, OVERDUE_DOUBLINGS)  # the deadline its last try had (a late load needs more: kept)
        needed = 0
        while needed < doublings and deadline * 2.0 ** needed < took:
            needed += 1
        if needed >= doublings:
            return
        scales = getattr(planner, "load_deadline_scale", {})
        if needed:
            self.overdue_strikes[peer][name] = needed
            scales[peer] = 2.0 ** needed
        else:
            del self.overdue_strikes[peer][name]
            if not self.overdue_strikes[peer]:
                del self.overdue_strikes[peer]
            scales.pop(peer, None)
        logger.info("placement: server %s loaded model %s's blocks in %.0f s: its next load there gets %g x "
                    "--load-deadline-s (was %g x)", peer[:12], name, took, 2.0 ** needed, 2.0 ** doublings)

    def _forget_overdue(self, peer: str) -> None:
        """Forget ``peer``'s overdue loads and longer deadlines (it left or restarted: it loads afresh)."""
        for name in self.overdue_strikes.pop(peer, {}):
            getattr(self.orchs[name].planner, "load_deadline_scale", {}).pop(peer, None)

    def _expire_overdue(self, now: float) -> None:
        """Forget each overdue load (``reason`` "overdue") of a model the server was moved off once as long as the
        deadline it missed has passed since (``wait_s``, which doubles at each overdue load of that model): a load
        that was only slow (a large download) gets another try, with twice the deadline, where one kept for good
        left a model whose only server it was unserved until the server restarted (review)."""
        for peer in list(self.load_failures):
            by = self.load_failures[peer]
            for name in [m for m, f in by.items() if f.get("reason") == "overdue" and self.placement.get(peer) != m]:
                wait = float(by[name].get("wait_s", 0.0))
                if now - by[name].get("since", now) >= wait:
                    del by[name]
                    logger.info("placement: server %s was overdue loading model %s %.0f s ago: it may be placed on it "
                                "again (a slow load gets another try, with %g x --load-deadline-s)", peer[:12], name,
                                wait, 2.0 ** min(self.overdue_strikes.get(peer, {}).get(name, 0), OVERDUE_DOUBLINGS))
            if not by:
                del self.load_failures[peer]

    def _note_start(self, peer: str, rec: Any, by_model: dict[str, Any]) -> float:
        """The process start of ``peer``'s current run, and whether it restarted (its load failures and overdue loads
        are forgotten): a model's record whose start changed to one not seen before (the last ``STARTS_KEPT``) tells a
        restart, as that model's planner reads it, whether the new start is later or earlier (a clock set back: the
        latest start of all records stayed the run before's while one of its records lived, and the new run's records,
        its failed loads, were passed over until that one expired); a start seen before is an older record read late,
        and so is an earlier one first read under a model without a record before (no restart). At first sight, and
        when no record carries the current start any more, the latest of the records' (an older version's, 0, too)."""
        carried = {name: started_at_of(r) for name, r in by_model.items()} or {"": started_at_of(rec)}
        before = self.record_starts.get(peer, {})
        self.record_starts[peer] = carried
        seen = self.starts_seen.get(peer)
        current = self.started_at.get(peer)
        # (a later one first read under a model, its record there missed by a read before, too)
        changed = [s for name, s in carried.items() if s not in (seen or ()) and (
            s != before[name] if name in before else current is not None and s > current)]
        if seen is None or changed:
            started = max(changed or carried.values())
        elif current not in carried.values() and max(carried.values()) not in seen:
            started = max(carried.values())
        else:
            return self.started_at[peer]
        self.starts_seen[peer] = note_start(seen or (), started) or (seen or ())
        self.started_at[peer] = started
        if seen is not None:
            self._forget_overdue(peer)
            if peer in self.load_failures:
                logger.info("placement: server %s (%s) restarted: the models it could not load (%s) may be placed on "
                            "it again", rec.public_name, peer[:12], ", ".join(self.load_failures.pop(peer)))
        return started

    def _move_off_failed(self, records: dict[str, dict[str, Any]], flexible: dict[str, Any], now: float) -> None:
        """Move each server placed on a model it cannot load to another model it offers, at once (not at the next
        re-placement: it serves nothing where it is); one that failed every model it offers stays (it retries)."""
        failing = [p for p in sorted(flexible) if self._failing(p)]
        if not failing:
            return
        volunteers, models, fixed = self.snapshot(records, now)
        for peer in failing:
            rec, name = flexible[peer], self.placement[peer]
            failure = self.load_failures[peer][name]
            span = failure["failed_span"]
            # overdue: the planner's load deadline passed (a load that hangs, an older server that reports nothing)
            verb = "is overdue loading" if failure.get("reason") == "overdue" else "cannot load"
            what = (f"{verb} model {name}'s blocks "
                    f"{f'[{span[0]}, {span[0] + span[1]})' if len(span) == 2 else ''}: "
                    f"{failure['load_error'] or '(no reason given)'}")
            allowed = self.allowed(peer, rec)
            if not allowed:
                if not failure.get("kept"):
                    failure["kept"] = True
                    logger.warning("placement: server %s (%s) %s; it cannot load any other model it offers either: "
                                   "kept on %s (it retries)", rec.public_name, peer[:12], what, name)
                continue
            placed = {**fixed, **{p: m for p, m in self.placement.items() if p in flexible and not self._failing(p)}}
            choice = self._choose(peer, allowed, volunteers, models, placed)
            scale = 2.0 ** min(self.overdue_strikes.get(peer, {}).get(name, 0), OVERDUE_DOUBLINGS)
            again = (f"for {failure.get('wait_s', 0.0):.0f} s, then with {scale:g} x its load deadline"
                     if failure.get("reason") == "overdue" else "until it restarts")
            self._set(peer, choice, what, level=logging.WARNING, detail=f"; not placed on {name} again {again}")

    def _set(self, peer: str, name: str, why: str, level: int = logging.INFO, detail: str = "") -> None:
        before = self.placement.get(peer)
        if before == name:
            return
        self.placement[peer] = name
        self.epoch += 1
        if before is not None:
            self.moves += 1
        self.log.append({"t": time.time(), "server": peer, "from": before, "to": name, "why": why})
        logger.log(level, "placement: server %s -> model %s (%s%s%s)", peer[:12], name, why,
                   f"; was {before}" if before else "", detail)

    def real_metrics(self, since_wall: float) -> PlanMetrics | None:
        """SLO attainment (response < 5 x the request's own service time) and normalized latency (response over its
        model's mean service time) of the requests completed since ``since_wall``; None without any."""
        met = total = 0
        norm = 0.0
        for o in self.orchs.values():
            done = [h for h in o.stats.history if h["t"] >= since_wall and h["service_s"] > 0]
            if not done:
                continue
            mean_service = sum(h["service_s"] for h in done) / len(done)
            for h in done:
                total += 1
                met += h["response_s"] < 5.0 * h["service_s"]
                norm += h["response_s"] / mean_service
        return PlanMetrics(met / total, norm / total) if total else None

    # ---- the simulated index's inputs, gathered on the event loop ---------------------------------------
    def history(self, volunteers: list[Volunteer], models: list[ServedModel], current: dict[str, str], now: float
                ) -> tuple[History | None, str]:
        """The requests the simulated index replays and each model's fitted step cost, or ``(None, why not)``.

        Requests: each model's completed ones that arrived in the last ``max(window_s, time since the last plan)``
        (lengths and arrival as recorded), reaching further back until ``min_replay`` of them are in (a window of a
        bursty model's traffic may hold one burst or none: a plan must not hang on that), and the ones waiting for
        a chain now (their declared output, at most the longest seen); the latest ``max_history`` per model; fewer
        than ``min_replay`` in all: none (the analytic index decides). Costs: :meth:`StepCost.fit` over the
        model's completed requests (service time, lengths and jobs per step on their chains), measured on its
        current chains (their median ``T_k`` is the reference a plan's chains are scaled from). Each model's rate
        is at least its rate over all the completions kept (``rate_floor``), so a model between bursts still keeps
        a chain."""
        wall, mono = time.time(), time.monotonic()
        by_name = {m.name: m for m in models}
        done: dict[str, list[dict]] = {}
        costs: dict[str, StepCost] = {}
        rate_floor: dict[str, float] = {}
        for name, o in self.orchs.items():
            done[name] = [h for h in o.stats.history if h.get("tokens", 0) >= 1 and h.get("batch")]
            cost = StepCost.fit((h["prompt_tokens"], h["tokens"], h["service_s"], h["batch"]) for h in done[name])
            if cost is not None:
                costs[name] = cost
            if done[name]:
                first = min(h["t"] - h["response_s"] for h in done[name])
                rate_floor[name] = len(done[name]) / max(wall - first, self.window_s)
        arrivals = sorted((h["t"] - h["response_s"] for hs in done.values() for h in hs), reverse=True)
        span = max(self.window_s, now - self.planned_at)
        if len(arrivals) >= self.min_replay:
            span = max(span, wall - arrivals[self.min_replay - 1])
        since = wall - span
        reqs: list[tuple[float, str, int, int]] = []
        ref_times: dict[str, float] = {}
        for name, o in self.orchs.items():
            longest = max((h["tokens"] for h in done[name]), default=None)
            mine = [(h["t"] - h["response_s"], name, int(h["prompt_tokens"]), int(h["tokens"])) for h in done[name]
                    if h["t"] - h["response_s"] >= since]
            dispatch = getattr(o, "dispatch", None)
            for job in (dispatch.waiting_jobs() if dispatch is not None else []):
                out = job.expected_output if longest is None else min(job.expected_output or longest, longest)
                mine.append((wall - (mono - job.arrival), name, int(job.input_tokens), max(1, int(out))))
            mine = sorted(mine)[-self.max_history:]
            if mine and name not in costs:
                return None, f"no step cost for {name} yet ({len(done[name])} completed requests)"
            if name in costs:
                chains = model_chains([v for v in volunteers if current.get(v.name) == name], by_name[name])
                if chains:
                    ref_times[name] = statistics.median(ch.service_time for ch in chains)
            reqs.extend(mine)
        if len(reqs) < self.min_replay:
            return None, f"{len(reqs)} recent requests, fewer than {self.min_replay}"
        reqs.sort()
        history = [MMRequest(k, name, max(0.0, t - since), inp, out, exec_alone(inp, out, costs[name]))
                   for k, (t, name, inp, out) in enumerate(reqs)]
        schedules = {getattr(getattr(o, "cfg", None), "schedule", "fcfs") for o in self.orchs.values()}
        schedule = next(iter(schedules & set(SCHEDULES)), "fcfs")
        return History(history, costs, ref_times, {m.name: max(1, int(m.c)) for m in models}, schedule, span,
                       rate_floor), ""

    # ---- a re-placement: inputs on the loop, the search in a worker thread --------------------------------------
    def _decide(self, volunteers: list[Volunteer], models: list[ServedModel], fixed: dict[str, str],
                current: dict[str, str], offered: dict[str, set[str]], history: History | None,
                served: set[str] = frozenset()) -> dict[str, Any]:
        """The target placement, the moves that pay (none that leaves a model of ``served`` or with a rate
        without a complete chain), and each model's predicted (misses, L_N) now and after."""
        horizon = self.interval.interval
        if history is not None:
            models = history.models(models)
        ev = history.evaluate(models) if history is not None else analytic_evaluate(models, horizon)
        span = history.span_s if history is not None else horizon
        target = place_by_unserved_index(volunteers, models, horizon_s=horizon, fixed=fixed, evaluate=ev,
                                         rule=self.rule, allowed=offered)
        target = {p: m for p, m in target.items() if p in fixed or m in offered.get(p, ())}
        aimed = {**current, **target}
        moves = moves_that_pay(current, aimed, self._never_stranding(
            ui_rate(volunteers, models, horizon_s=span, evaluate=ev), volunteers,
            [m for m in models if m.name in served or m.rate > 0]), reload_s=self.reload_s, interval_s=horizon,
            min_gain=ALPHA * MIN_LN_GAIN, idle={m.name for m in models if m.rate <= 0})
        after = dict(current)
        after.update({mv.server: mv.dst for mv in moves if mv.server in offered})

        def summary(assignment: dict[str, str]) -> tuple[dict[str, int], dict[str, list[float]], PlanMetrics | None]:
            """Servers per model, each model's predicted (misses, L_N), and the plan's SLO attainment and L_N."""
            groups = groups_of(assignment, volunteers)
            est = ev(groups)
            n = sum(e.requests for e in est.values())
            metrics = None if n <= 0 else PlanMetrics(1.0 - sum(e.misses for e in est.values()) / n,
                                                      sum(e.norm_latency * e.requests for e in est.values()) / n)
            return ({m.name: len(groups.get(m.name, ())) for m in models},
                    {k: [round(e.misses, 2), round(e.norm_latency, 3)] for k, e in est.items()}, metrics)

        counts, pred_now, _ = summary(current)
        targets, pred_target, _ = summary(aimed)
        return {"moves": moves, "counts": counts, "pred_now": pred_now, "targets": targets,
                "pred_target": pred_target, "estimate": summary(after)[2]}

    @staticmethod
    def _never_stranding(cost: Callable[[dict[str, str]], float], volunteers: list[Volunteer],
                         busy: list[ServedModel]) -> Callable[[dict[str, str]], float]:
        """``cost`` plus :data:`STRANDED_UI_PER_S` for each model of ``busy`` an assignment leaves without a
        complete chain."""
        chained: dict[tuple[str, tuple[str, ...]], bool] = {}

        def has_chain(m: ServedModel, group: Sequence[Volunteer]) -> bool:
            key = (m.name, tuple(v.name for v in group))
            if key not in chained:
                chained[key] = bool(group) and bool(model_chains(group, m))
            return chained[key]

        def total(assignment: dict[str, str]) -> float:
            groups = groups_of(assignment, volunteers)
            return cost(assignment) + STRANDED_UI_PER_S * sum(not has_chain(m, groups.get(m.name, ())) for m in busy)

        return total

    async def replace(self, records: dict[str, dict[str, Any]], flexible: dict[str, Any], now: float, why: str
                      ) -> list:
        """Re-place the ``flexible`` servers by the unserved index, making only the moves that pay (Eq. 8
        interval)."""
        real = self.real_metrics(self.planned_wall)
        if real is not None and self.estimate is not None:
            self.interval.update(real, self.estimate)
        volunteers, models, fixed = self.snapshot(records, now)
        # a server placed on a model it cannot load serves none (it failed every model it offers: it stays put)
        current = {**fixed, **{p: self.placement[p] for p in flexible if p in self.placement and not self._failing(p)}}
        offered = {p: set(self.allowed(p, rec)) for p, rec in flexible.items()}
        history, index = None, "analytic"
        if self.index == "simulated":
            history, fallback = self.history(volunteers, models, current, now)
            index = "simulated" if history is not None else f"analytic ({fallback})"
        served = {name for name, o in self.orchs.items() if o.stats.history}  # users asked it (recently kept)
        args = (volunteers, models, fixed, current, offered, history, served)
        t0 = time.perf_counter()
        # off the event loop with either index: the analytic search is a GBP-CR + GCA per model and candidate
        # server, seconds with hundreds of servers, during which no request or stream moved
        d = await asyncio.to_thread(self._decide, *args)
        moves = d["moves"]
        for mv in moves:
            if mv.server in flexible:
                self._set(mv.server, mv.dst, f"{why}: pays {mv.benefit:.3g}")
        self.replans.append({"t": time.time(), "why": why, "index": index, "rule": self.rule,
                             "decide_s": round(time.perf_counter() - t0, 3),
                             "replayed": None if history is None else len(history.requests),
                             "step_cost": None if history is None else
                             {k: [round(c.a, 5), round(c.b, 7), round(c.d, 5)] for k, c in history.costs.items()},
                             "rates": {m.name: round(m.rate, 4) for m in models},
                             "servers_per_model": d["counts"], "target": d["targets"], "moves": len(moves),
                             "block_time_s": {m.name: round(m.block_time, 5) for m in models},
                             "slots": {m.name: m.c for m in models},
                             "speeds": {v.name[:8]: round(v.speed, 3) for v in volunteers},
                             "predicted_now": d["pred_now"], "predicted_target": d["pred_target"]})
        logger.info("re-placement (%s, %s index): rates %s, servers %s, target %s, %d moves pay", why, index,
                    self.replans[-1]["rates"], d["counts"], d["targets"], len(moves))
        self.estimate = d["estimate"]
        self.planned_at, self.planned_wall = now, time.time()
        self.trigger.replanned(now, why)
        total = sum(m.rate for m in models)
        self.drift.set_plan({m.name: m.rate / total for m in models} if total > 0 else {})
        return moves

    async def round(self) -> None:
        now = self.clock()
        self._note_arrivals(now)
        records = self._records()
        flexible = self._flexible(records)
        for peer in flexible:
            self.gone.pop(peer, None)
        for peer in [p for p in self.placement if p not in flexible]:
            since = self.gone.setdefault(peer, now)
            if now - since > self.forget_s:
                del self.placement[peer], self.gone[peer]
        new = sorted(p for p in flexible if p not in self.placement)
        if new:
            self._place_new(new, records, now)
        self._note_load_failures(flexible, records, now)
        self._move_off_failed(records, flexible, now)
        # static: one re-placement, for the first traffic seen (the fixed plan), none after
        if flexible and (self.policy == "ui" or (self.policy == "static" and self.estimate is None)):
            due = now - self.planned_at >= self.interval.interval
            # drifted from the mix planned for, or traffic arrives and no plan was made for any yet
            drifted = self.drift.drifted(now) or (not self.drift.planned and sum(self.drift.rates(now).values())
                                                  * self.drift.window_s >= self.drift.min_arrivals)
            # a model with traffic and no server that a flexible server could serve (its last servers left): now,
            # not at the interval's end (up to an hour), at most once a drift window
            if (not drifted and now - self._stranded_at >= self.drift.window_s
                    and self._stranded(records, flexible, now)):
                drifted, self._stranded_at = True, now
            why = self.trigger.reason(now, due=due, drifted=drifted)
            if why is not None:
                await self.replace(records, flexible, now, why)
        await self.publish()

    async def publish(self) -> None:
        """The placement under every model's prefix, when it changed and before it expires."""
        now = self.clock()
        if self._published_epoch == self.epoch and now - self._published_at < self.expiration_s / 3:
            return
        o0 = next(iter(self.orchs.values()))
        record = PlacementRecord(orchestrator_peer_id=o0.dht.peer_id, epoch=self.epoch,
                                 placement={p: self.orchs[m].prefix for p, m in self.placement.items()})
        ok = True
        for o in self.orchs.values():
            ok = await o0.dht.apublish_placement(o.prefix, record, self.expiration_s) and ok
        if ok:
            self._published_epoch, self._published_at = self.epoch, now

    async def run(self, stop: Any) -> None:
        await run_every(stop, self.refresh_s, self.round, logger, "model placement")

    def json(self) -> dict:
        """For ``/api/v1/swarm``: the policy, interval, placement, recent moves and the models servers cannot load
        (``reason``: "reported" by the server's record, or "overdue" past the planner's load deadline)."""
        settle = self.trigger.settle_at if self.policy == "ui" else None  # only ui re-plans after its first plan
        return {"policy": self.policy, "index": self.index, "rule": self.rule, "epoch": self.epoch,
                "interval_s": round(self.interval.interval, 3),
                "settle_in_s": None if settle is None else round(max(0.0, settle - self.clock()), 1),
                "moves": self.moves, "placement": dict(self.placement),
                "servers_per_model": {n: sum(1 for m in self.placement.values() if m == n) for n in self.orchs},
                "recent": list(self.log)[-10:], "replans": list(self.replans)[-10:],
                "load_failures": {p: {m: {k: f[k] for k in ("failed_span", "load_error", "reason", "t")}
                                      for m, f in by.items()} for p, by in self.load_failures.items()},
                "overdue_loads": {p: dict(by) for p, by in self.overdue_strikes.items()}}
