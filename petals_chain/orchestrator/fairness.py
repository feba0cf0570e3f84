"""Fair sharing among clients at the orchestrator (``--fairness``): the policy's state and what it is shown.

A client is an API key's name (requests without keys form one client, ``anonymous``). The queue discipline
itself is pure (:mod:`petals_chain.algorithms.fairness`); this module owns one :class:`FairPolicy` for the
orchestrator's lifetime (so counters survive re-plans), describes dispatch jobs to it, charges what the relay
sees (``w_e`` per input token a chain computes, ``w_q`` per generated token; a failover's replay is not charged)
and keeps per-client service, waiting time and Jain's index for ``/api/v1/swarm`` and ``/metrics``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Hashable, Sequence

from prometheus_client import Counter, Gauge, Histogram

from petals_chain.algorithms.fairness import CLIENT_FAIR_POLICIES, FairPolicy, FairRequest, ServiceMeter
from petals_chain.orchestrator.auth import ANONYMOUS
from petals_chain.orchestrator.stats import remove_client_series

FAIRNESS_WINDOW_S = 60.0  # window of the per-client service rates and Jain's index
FAIRNESS_SAMPLE_S = 1.0  # period of the samples of which clients are backlogged (Jain's index)


class ClientShares:
    """The fairness policy and per-client accounting of one orchestrator."""

    def __init__(self, policy: FairPolicy, registry: Any = None, window_s: float = FAIRNESS_WINDOW_S,
                 keyed: bool = False):
        self.policy = policy
        self.keyed = keyed  # clients are told apart by API keys (else every request is one client, anonymous)
        self.meter = ServiceMeter(window_s)
        # client -> [jobs started, total wait s, max wait s, jobs that left the queue unstarted]
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

    def _cost(self, job: Any) -> float:
        """Service units ``job`` is expected to be charged: its input (VTC: all of it; DLPM: what no chain holds
        cached) and its expected output."""
        cached = 0 if self.policy.name == "vtc" else max((int(v) for v in (job.matched or {}).values()), default=0)
        extend = max(0, int(job.input_tokens) - cached)
        return self.policy.cfg.cost(extend, max(0, int(job.expected_output)))

    def ahead(self, job: Any, queued: Sequence[Any]) -> int:
        """How many of ``queued`` (the central queue's jobs, oldest first) the policy is expected to start before
        ``job``, a new arrival of ``job.client``: what the deadline prediction counts ahead of it. Counting them all
        (FIFO) refused a light client's deadline request behind a heavy client's backlog (429 deadline_unreachable,
        again at each retry) that the policy serves next. The central client-fair policies serve each other client
        until its counted service passes what ``job``'s client must be given first: its own queued jobs, plus
        (``vtc``) how far its counter, lifted as on arrival, is ahead of the other's, or (``dlpm``) the other's
        credit and the refill rounds ``job``'s client needs for credit. The others (fcfs, locality-first and the
        per-chain policies): all of them."""
        queued = list(queued)
        name = self.policy.name
        if name not in ("vtc", "dlpm") or not queued:
            return len(queued)
        own = [j for j in queued if j.client == job.client]
        owed = sum(self._cost(j) for j in own)  # served to job's client before job (its clients' jobs: oldest first)
        local = self.policy.local(None)
        state = local.snapshot()
        others: dict[str, list[Any]] = {}
        for j in queued:
            if j.client != job.client:
                others.setdefault(j.client, []).append(j)
        if name == "vtc":
            mine = state.get(job.client, 0.0)
            if not own:  # lifted to the least counter among the queued clients as it becomes backlogged
                mine = max(mine, min((state.get(c, 0.0) for c in others), default=mine))
            budget = {c: mine + owed - state.get(c, 0.0) for c in others}
        else:
            q_u = self.policy.quantum.value
            left = state.get(job.client, 0.0) - owed  # its credit once its own queued jobs are served
            rounds = 0 if left > 0 else math.floor(-left / q_u) + 1  # refills of q_u that take it above 0
            budget = {c: state.get(c, 0.0) + rounds * q_u for c in others}
        count = len(own)
        for c, jobs in others.items():
            spent = 0.0
            for j in jobs:  # a client is served while its service so far does not pass the budget (ties: served)
                if spent > budget[c]:
                    break
                count += 1
                spent += self._cost(j)
        return count

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

    def abandoned(self, job: Any, waited_s: float) -> None:
        """``job`` left the queue without starting after ``waited_s`` (its client timed out or went away): its wait
        counts too, else a client starved until it gives up shows no wait at all."""
        self._waited(getattr(job, "client", "anonymous"), waited_s, started=False)

    def _waited(self, client: str, wait_s: float, started: bool) -> None:
        w = self.waits.setdefault(client, [0, 0.0, 0.0, 0])
        w[0 if started else 3] += 1
        w[1] += wait_s
        w[2] = max(w[2], wait_s)
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
            started, total_wait, max_wait, gave_up = self.waits.get(c, [0, 0.0, 0.0, 0])
            waited = started + gave_up
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
