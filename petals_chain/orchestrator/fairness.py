"""Fair sharing among clients at the orchestrator (``--fairness``): the policy's state and what it is shown.

A client is an API key's name (requests without keys form one client, ``anonymous``). The queue discipline
itself is pure (:mod:`petals_chain.algorithms.fairness`); this module owns one :class:`FairPolicy` for the
orchestrator's lifetime (so counters survive re-plans), describes dispatch jobs to it, charges what the relay
sees (``w_e`` per input token a chain computes, ``w_q`` per generated token; a failover's replay is not charged)
and keeps per-client service, waiting time and Jain's index for ``/api/v1/swarm`` and ``/metrics``.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Hashable, Iterable, Iterator, Sequence

from prometheus_client import Counter, Gauge, Histogram

from petals_chain.algorithms.fairness import (CLIENT_FAIR_POLICIES, FairPolicy, FairRequest, ServiceMeter,
                                              _rounds_to_credit)
from petals_chain.orchestrator.auth import ANONYMOUS
from petals_chain.orchestrator.stats import remove_client_series

FAIRNESS_WINDOW_S = 60.0  # window of the per-client service rates and Jain's index
FAIRNESS_SAMPLE_S = 1.0  # period of the samples of which clients are backlogged (Jain's index)


def _popped(items: list) -> Iterator:
    """``items`` in ascending order, each popped from a heap as the reader goes (O(n) to start, not a sort)."""
    heapq.heapify(items)
    while items:
        yield heapq.heappop(items)


def _match(job: Any, worker: Hashable) -> int:
    """Tokens of ``job``'s input that ``worker`` holds cached (:meth:`FairRequest.match` of a dispatch job)."""
    matched = job.matched
    return min(int(matched.get(worker, 0)), int(job.input_tokens)) if matched else 0


def _turns(on_chain: int, mu: float, mu_k: float) -> int:
    """Jobs of all chains (rate ``mu``) started before a job that waits for ``on_chain`` jobs of one chain (rate
    ``mu_k``); the tolerance keeps an exact multiple from rounding up."""
    return math.ceil((on_chain + 1) * mu / mu_k - 1e-9) - 1


class ClientShares:
    """The fairness policy and per-client accounting of one orchestrator."""

    def __init__(self, policy: FairPolicy, registry: Any = None, window_s: float = FAIRNESS_WINDOW_S,
                 keyed: bool = False):
        self.policy = policy
        self.keyed = keyed  # clients are told apart by API keys (else every request is one client, anonymous)
        self.meter = ServiceMeter(window_s)
        # client -> [jobs started, total wait s, max wait s, jobs that left the queue unstarted, waits counted]
        self.waits: dict[str, list[float]] = {}
        self.m_service = Counter("petals_chain_client_service_units", "Service per client (API key name): w_e per "
                                 "input token computed + w_q per output token (seed 002); an admission's input is "
                                 "counted once its chain says what it held cached", ["client"], registry=registry)
        self.m_wait = Histogram("petals_chain_client_wait_seconds", "Time a client's jobs waited for a chain (also "
                                "those that gave up waiting)", ["client"],
                                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                registry=registry)
        self.m_jain = Gauge("petals_chain_fairness_jain_index", "Jain's index of the last minute's service among "
                            "clients backlogged through it (NaN with fewer than two)", registry=registry)

    @property
    def central(self) -> bool:
        """The discipline replaces JFFC's FIFO (every policy but ``fcfs``, which keeps the paper's queue)."""
        return self.policy.name != "fcfs"

    @property
    def keeps_places(self) -> bool:
        """A bounded queue keeps its last places for clients with nothing waiting (``dispatch.QUEUE_SHARE_ALPHA``):
        under a client-fair policy, with clients told apart."""
        return self.keyed and self.policy.name in CLIENT_FAIR_POLICIES

    def describe(self, job: Any) -> FairRequest:
        """The policy's view of a dispatch job (``client``, ``input_tokens``, ``matched``, ``expected_output``; a
        job back after a failover, preemption or pause, and a later choice of ``n`` > 1, are the same request
        admitted again: charged for their own work, not counted as more requests)."""
        again = bool(getattr(job, "requeue", False) or getattr(job, "checked", False))
        req = FairRequest(item=job, client=job.client, input_tokens=job.input_tokens, matched=job.matched,
                          expected_output=job.expected_output, again=again)
        job.fair = req
        return req

    def ahead(self, job: Any, queued: Iterable[Any], running: Iterable[tuple[Any, float]] = ()) -> int:
        """How many of ``queued`` (the central queue's jobs, oldest first) the policy is expected to start before
        ``job``, a new arrival of ``job.client``, as slots free: what the deadline prediction counts ahead of it.
        ``running``: the running jobs with the output tokens each may still generate, all charged to their clients
        before ``job``'s turn (an upper bound: they are charged as generated, while slots free; the dispatcher
        passes none).

        Counting them all (FIFO) refused a light client's deadline request behind a heavy client's backlog (429
        deadline_unreachable, again at each retry) that the policy serves next. The central client-fair policies
        serve another client while its counted service stays below what ``job``'s client is charged first (its own
        queued jobs and pending output): ``vtc``, while its counter is below that client's, lifted as on arrival
        (equal: the lesser name, VTC's tie); ``dlpm``, while it has credit, its own plus the refills ``job``'s
        client needs to get credit, taking its longest cached prefixes first (LPM). Each job is expected to cost
        its ``expected_output`` and, for dlpm, its input less the longest prefix a chain holds. ``job``'s own
        prefix is not counted (it may go before others' jobs with credit: an estimate that errs long). DLPM's
        quantum before any request was admitted is sized as its first refill sizes it (:meth:`AdaptiveQuantum.
        sized`, over the queue and ``job``), not read as the prior. The others (fcfs; lpm and the per-chain
        policies without their dispatcher, :meth:`ahead_bound`): all of them. One pass over the queue."""
        if self.policy.name not in ("vtc", "dlpm"):
            return sum(1 for _ in queued)
        return self._before(job, queued, running, None)

    def ahead_bound(self, job: Any, dispatcher: Any, rates: Sequence[float]) -> int | None:
        """:meth:`ahead` for the per-chain policies (``d2lpm``, ``d-vtc``, ``rr-lpm``) and the central ``lpm``
        (:meth:`_lpm_bound`) of ``dispatcher`` (a :class:`~petals_chain.algorithms.fairness.FairDispatcher`): the
        jobs started before ``job`` counted as the prediction counts them (served at the rate of every chain).
        ``rates``: each chain's rate of freeing slots (jobs per second), in the dispatcher's order. None for other
        policies (the caller counts the queue). Counting the whole queue for lpm and rr-lpm refused a request that
        matched a chain's cached prefix (429 deadline_unreachable) for a backlog those orders start after it.

        A new job is bound to the chain :meth:`FairPolicy.peek_worker` names (JFFC's capacity rule, then the
        policy's choice), which serves the jobs bound to it by its own discipline (:meth:`ahead`'s rule on that
        chain's counters, prefixes and jobs; rr-lpm's: the longest prefix it holds, then the oldest) and takes no
        other job while one is bound to it; the other chains serve their own and may take ``job`` sooner (work
        conservation). So ``job`` waits at most for those jobs' turns on its chain alone, and at most for the whole
        queue at the rate of all chains (without later arrivals, as the prediction counts): the least of the two, in
        jobs at the rate of all chains. Exact on one chain; an upper bound on several. 0 when a chain has a free
        slot (the job starts at once)."""
        if self.policy.name == "lpm" and hasattr(dispatcher, "workers"):
            return self._lpm_bound(job, dispatcher, rates)
        if self.policy.name not in ("d2lpm", "d-vtc", "rr-lpm") or not hasattr(dispatcher, "peek_binding"):
            return None
        req = FairRequest(item=job, client=job.client, input_tokens=job.input_tokens, matched=job.matched,
                          expected_output=job.expected_output)
        total = dispatcher.queue_length
        found = dispatcher.peek_binding(req)
        if found is None:
            return 0 if dispatcher.free_chains() else total
        k, waiting = found
        mu, mu_k = sum(r for r in rates if r > 0), rates[k] if k < len(rates) else 0.0
        if not mu_k > 0:
            return total
        w = dispatcher.workers[k]
        if self.policy.name == "rr-lpm":  # its chain's LPM: a longer or equal match (older) goes first
            mine = _match(job, w)
            on_chain = sum(1 for r in waiting if r.item is not job and _match(r.item, w) >= mine)
        else:
            on_chain = self._before(job, (r.item for r in waiting), (), w)
        return min(total, _turns(on_chain, mu, mu_k))

    @staticmethod
    def _lpm_bound(job: Any, dispatcher: Any, rates: Sequence[float]) -> int:
        """:meth:`ahead_bound` for the central ``lpm``: a freed chain takes the waiting job with the longest prefix
        it holds, the oldest first, so on chain ``w`` only the jobs matching at least as much as ``job`` there go
        before it. Those of them on some chain (no other starts before it), and on each chain alone those jobs'
        turns in jobs of all chains: the least. Exact on one chain; an upper bound on several. 0 when a chain has
        a free slot.

        Every queued job matches at least as much as ``job`` on a chain where ``job`` holds nothing, so only the
        chains holding part of ``job``'s prompt are counted, each queued job's own matches read once: O(queue +
        its matches), not O(queue x chains) (83 ms an admission with 1,000 queued jobs on 50 chains)."""
        if dispatcher.free_chains():
            return 0
        queued = [j for j in dispatcher.queue if j is not job]
        usable = {w: k for k, w in enumerate(dispatcher.workers) if dispatcher.capacities[k] > 0}
        mine = {w: n for w in usable if (n := _match(job, w)) > 0}  # the chains holding part of job's prompt
        # a chain where job holds nothing: every queued job may go before it there
        held_everywhere = len(mine) == len(usable)
        best = 0 if held_everywhere else len(queued)
        on_chain = dict.fromkeys(mine, 0)
        if mine:
            for j in queued:
                matched = j.matched
                if not matched:
                    continue
                cap, ahead = int(j.input_tokens), False
                for w, n in matched.items():
                    if w in on_chain and min(int(n), cap) >= mine[w]:
                        on_chain[w] += 1
                        ahead = True
                if ahead and held_everywhere:
                    best += 1
        mu = sum(r for r in rates if r > 0)
        for w, k in usable.items():
            if k < len(rates) and rates[k] > 0:
                best = min(best, _turns(on_chain.get(w, len(queued)), mu, rates[k]))
        return best

    def _before(self, job: Any, queued: Iterable[Any], running: Iterable[tuple[Any, float]],
                worker: Hashable | None) -> int:
        """:meth:`ahead`'s count by the discipline of ``worker`` (None: the central one) over ``queued``."""
        dlpm = self.policy.name in ("dlpm", "d2lpm")
        w_e, w_q = self.policy.cfg.w_e, self.policy.cfg.w_q
        central = worker is None

        def cost(j: Any) -> tuple[int, float]:
            """(tokens cached, units charged) of a queued job."""
            n, out, cached = j.input_tokens, j.expected_output, 0
            if dlpm and j.matched:
                cached = max(j.matched.values()) if central else j.matched.get(worker, 0)
                cached = n if cached > n else cached if cached > 0 else 0
            return cached, w_e * (n - cached if n > cached else 0) + w_q * (out if out > 0 else 0)

        mine_client = job.client
        own, owed = [job], 0.0  # job and its client's queued jobs
        others: dict[str, list] = {}  # client -> its jobs, oldest first
        for j in queued:  # one pass; the others' costs are read only as far as their budgets go
            if j.client == mine_client:  # served before job: same client, older
                own.append(j)
                owed += cost(j)[1]
            else:
                others.setdefault(j.client, []).append(j)
        if not others:
            return len(own) - 1
        pending: dict[str, float] = {}  # units the running jobs will still be charged, per client
        for j, tokens in running:
            if tokens > 0:
                pending[j.client] = pending.get(j.client, 0.0) + w_q * float(tokens)
        state = self.policy.counters(worker)
        if not dlpm:
            mine = state.get(job.client, 0.0)
            if len(own) == 1:  # lifted to the least counter among the queued clients as it becomes backlogged
                mine = max(mine, min(state.get(c, 0.0) for c in others))
            mine += owed + pending.get(job.client, 0.0)
            budget = {c: mine - state.get(c, 0.0) - pending.get(c, 0.0) for c in others}
        else:
            q_u = self._quantum([*own, *(j for js in others.values() for j in js)], worker)
            left = state.get(job.client, 0.0) - owed - pending.get(job.client, 0.0)  # its credit after its own
            rounds = 0 if left > 0 else _rounds_to_credit(left, q_u)  # refills (of everyone in debt) it waits for
            budget = {c: state.get(c, 0.0) + rounds * q_u - pending.get(c, 0.0) for c in others}
        count = len(own) - 1
        for c, jobs in others.items():
            costs: Iterable[tuple[int, float]] = map(cost, jobs)
            if dlpm and any(j.matched for j in jobs):
                # LPM: the longest cached prefix first, then the oldest (popped only as far as the budget goes)
                costs = ((-k, u) for k, _, u in _popped([(-k, i, u) for i, (k, u) in enumerate(costs)]))
            tie = not dlpm and c < job.client  # VTC picks the lesser (counter, name)
            spent, limit = 0.0, budget[c]
            for _, units in costs:
                if spent > limit or (spent == limit and not tie):
                    break
                count += 1
                spent += units
        return count

    def _quantum(self, jobs: list[Any], worker: Hashable | None) -> float:
        """DLPM's ``Q^u`` at the refill a new job waits for (``jobs``: it and the queued jobs it waits with): once a
        request was admitted, the window's; before, the first refill's rule over them (:meth:`AdaptiveQuantum.
        sized`; read as the prior, 2048 units where a request cost 52, it counted 20 jobs of another client before
        a new one that the policy starts second). The central queue's refill is sized on the chain that frees, not
        known here: the largest of the chains' (the one with most of their input cached)."""
        quantum = self.policy.quantum
        if self.policy.cfg.quantum is not None or quantum.observed:
            return quantum.value
        reqs = [FairRequest(item=j, client=j.client, input_tokens=j.input_tokens, matched=j.matched or {},
                            expected_output=j.expected_output) for j in jobs]
        workers = {worker} if worker is not None else {w for r in reqs for w in r.matched} or {None}
        return max(quantum.sized(reqs, w) for w in workers)

    def started(self, job: Any, worker: Hashable, queued: bool) -> None:
        """``job`` started on ``worker`` after waiting ``job.wait_s`` (``queued``: it waited in the queue)."""
        req = getattr(job, "fair", None)
        if req is None or req.admitted_on is None:  # FIFO (fcfs) and re-queue lane starts: charge here
            req = self.describe(job)
            self.policy.admit(req, worker)
        now = time.monotonic()
        self._served(now, job.client, req.charged, count=False)  # counted by prompt(), once it is exact
        self._waited(job.client, job.wait_s, started=True)
        if queued:
            self.meter.waited(now, job.client)

    def abandoned(self, job: Any, waited_s: float, gave_up: bool = True) -> None:
        """``job`` left the queue without starting after ``waited_s`` (its client timed out or went away): its wait
        counts too, else a client starved until it gives up shows no wait at all. ``gave_up=False``: a job re-queued
        after it started (counted as started then): its wait counts, not one more job that gave up."""
        self._waited(getattr(job, "client", "anonymous"), waited_s, started=False, gave_up=gave_up)

    def _waited(self, client: str, wait_s: float, started: bool, gave_up: bool = True) -> None:
        w = self.waits.setdefault(client, [0, 0.0, 0.0, 0, 0])
        if started or gave_up:
            w[0 if started else 3] += 1
        w[1] += wait_s
        w[2] = max(w[2], wait_s)
        w[4] += 1
        self.m_wait.labels(client).observe(wait_s)

    def waiting(self, jobs: Any) -> None:
        """The jobs waiting now (marks their clients backlogged)."""
        now = time.monotonic()
        for job in jobs:
            self.meter.waited(now, getattr(job, "client", "anonymous"))

    def sample(self, jobs: Any) -> None:
        """The jobs waiting now, sampled at a steady period for Jain's index (:meth:`ServiceMeter.sample`)."""
        self.meter.sample(time.monotonic(), (getattr(job, "client", "anonymous") for job in jobs))

    def prompt(self, job: Any, worker: Hashable, extend_tokens: int) -> None:
        """The chain ``job`` opened on holds all but ``extend_tokens`` of its new input: correct the charge."""
        req = getattr(job, "fair", None)
        if req is None or req.admitted_on is None:
            return
        before = req.charged
        self.policy.prompt(req, worker, extend_tokens)
        self._served(time.monotonic(), req.client, req.charged - before, count=False)
        if req.charged > 0:  # the admission's input, now exact: a Prometheus counter cannot take a refund back
            self.m_service.labels(req.client).inc(req.charged)

    def refund(self, job: Any, worker: Hashable, gone: bool = False) -> None:
        """``job``'s start on ``worker`` served nothing (the chain refused or failed its open): the admission is
        undone; the job queues again and is charged when it next starts (``gone``: its client went away)."""
        req = getattr(job, "fair", None)
        if req is None or req.admitted_on is None:
            return
        before = req.charged
        self.policy.refund(req, worker, gone=gone)
        self._served(time.monotonic(), req.client, -before, count=False)

    def input(self, client: str, worker: Hashable, tokens: int) -> None:
        """A chain a job holds computed ``tokens`` new input tokens (a session's turn without a new admission)."""
        self.policy.input(client, worker, tokens)
        self._served(time.monotonic(), client, self.policy.cfg.w_e * tokens)

    def output(self, client: str, worker: Hashable, tokens: int = 1) -> None:
        self.policy.output(client, worker, tokens)
        self._served(time.monotonic(), client, self.policy.cfg.w_q * tokens)

    def _served(self, now: float, client: str, units: float, count: bool = True) -> None:
        if count and units > 0:
            self.m_service.labels(client).inc(units)
        self.meter.served(now, client, units)

    def forget(self, *clients: str) -> None:
        """Drop ``clients``' state (their names left the key file; nothing of them waits or runs): the policy's
        counters (:meth:`FairPolicy.forget`: the others' order stays as it was), their service and waits in the window
        (one pass for them all) and their Prometheus series. ``anonymous`` is never forgotten."""
        gone = [c for c in dict.fromkeys(clients) if c != ANONYMOUS]
        for client in gone:
            self.policy.forget(client)
            self.waits.pop(client, None)
            for metric in (self.m_service, self.m_wait):
                remove_client_series(metric, client)
        self.meter.forget(*gone)

    def update_gauge(self, waiting_jobs: Any = ()) -> float | None:
        """Mark the clients of ``waiting_jobs`` backlogged and set the Jain gauge; returns Jain's index."""
        self.waiting(waiting_jobs)
        jain = self.meter.jain(time.monotonic())
        self.m_jain.set(float("nan") if jain is None else jain)
        return jain

    def json(self, waiting_jobs: Any = ()) -> dict[str, Any]:
        """``fairness`` of ``/api/v1/swarm``: policy, weights, quantum, Jain's index and per-client figures."""
        jain = self.update_gauge(waiting_jobs)
        now = time.monotonic()
        rates = self.meter.rates(now)
        backlogged = set(self.meter.backlogged(now))
        queued: dict[str, int] = {}
        for job in waiting_jobs:
            c = getattr(job, "client", "anonymous")
            queued[c] = queued.get(c, 0) + 1
        clients = {}
        # a client whose requests all still wait (the one being starved) is listed too
        for c in sorted(set(self.policy.service) | set(self.waits) | set(queued) | backlogged):
            started, total_wait, max_wait, gave_up, waited = self.waits.get(c, [0, 0.0, 0.0, 0, 0])
            clients[c] = {"service": self.policy.service.get(c, 0.0), "service_rate": rates.get(c, 0.0),
                          "requests": self.policy.admitted_requests.get(c, 0), "started": int(started),
                          "gave_up": int(gave_up), "waiting": queued.get(c, 0),
                          "wait_mean_s": total_wait / waited if waited else None, "wait_max_s": max_wait,
                          "backlogged": c in backlogged}
        cfg = self.policy.cfg
        return {"policy": self.policy.name, "w_e": cfg.w_e, "w_q": cfg.w_q, "quantum": self.policy.quantum.value,
                "quantum_mode": "fixed" if cfg.quantum is not None else "auto",
                "quantum_reuse": self.policy.quantum.reuse,
                "worker_quantum": cfg.worker_quantum, "window_s": self.meter.window_s, "jain_index": jain,
                "jain_clients": self.meter.saturated(now),
                "clients": clients}
