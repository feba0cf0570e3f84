"""Per-request routing at arrival (the PETALS and BPRR baselines) behind the dispatch-manager interface.

Unlike JFFC (one central FIFO queue; a job starts only on a chain with a free slot and never waits at a
server), a routed job picks its route the moment it arrives, over the live free-slot counts, and opens
its sessions at once with ``wait_s``: a server without enough free slots queues the open (bounded FIFO,
:mod:`petals_chain.server.admission`). There is no central queue.

* ``petals``: PETALS' min-latency route (``petals_route``): per hop ``RTT/2 + overhead``, per block the
  per-token compute time, ``+cache_penalty`` on a server that lacks free slots.
* ``bprr``: WS-RR (``ws_rr_route``): per hop ``tau_c_j + tau_p_j m_ij`` (per job) plus the hop's expected
  wait when the server lacks ``m_ij`` free slots.

Free slots are counted here, exactly: every session on these servers is opened by this orchestrator, so
``free_j = slots_total_j - (slots held or awaited by our routed jobs on j)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from petals_chain.model import Chain, ServerSpec
from petals_chain.orchestrator.dispatch import KEPT_CHAIN_IDS, DispatchJob, DispatchManager, Lease, note_admission

logger = logging.getLogger(__name__)

ROUTED_POLICIES = ("petals", "bprr")
DEFAULT_ROUTE_WAIT_S = 600.0  # how long a routed open may wait at a server (the server caps it too)


def make_dispatch(policy: str, max_queue: int | None = None, shares: Any = None, schedule: str = "fcfs",
                  steps_per_job: Any = None, classes: int = 1, **kwargs: Any):
    """The dispatch manager for ``policy``: routed (PETALS, BPRR) or central-queue (JFFC and the others, whose
    queue is bounded by ``max_queue``; routed jobs have no central queue to bound). ``shares``: the fairness
    policy and per-client accounting (:class:`~petals_chain.orchestrator.fairness.ClientShares`), central queue
    only; ``schedule``: the central queue's order (``fcfs``, ``edf``, ...); ``classes``: length classes per model
    under ``--schedule db|mlfq``."""
    if policy in ROUTED_POLICIES:
        if shares is not None and shares.central:
            raise ValueError(f"--fairness {shares.policy.name} needs a central queue; --dispatch {policy} has none")
        if schedule != "fcfs":
            raise ValueError(f"--schedule {schedule} orders a central queue; --dispatch {policy} has none")
        return RoutedDispatch(policy, **kwargs)
    return DispatchManager(policy=policy, max_queue=max_queue, shares=shares, schedule=schedule,
                           steps_per_job=steps_per_job, classes=classes)


class RoutedDispatch:
    """Same interface as :class:`DispatchManager` (acquire/release/set_chains/...), per-request routes."""

    def __init__(self, policy: str, *, wait_s: float = DEFAULT_ROUTE_WAIT_S, overhead_s: float = 0.0,
                 cache_penalty_s: float = 10.0):
        if policy not in ROUTED_POLICIES:
            raise ValueError(f"routed policy must be one of {ROUTED_POLICIES}, got {policy!r}")
        self.policy = policy
        self.wait_s = float(wait_s)
        self.overhead_s = overhead_s  # measured pings already include the emulated/real per-hop overhead
        self.cache_penalty_s = cache_penalty_s
        self.planner: Any = None
        self.generation = 0
        self.chains: list[Chain] = []  # GCA chains of the placement: shown on the dashboard, define "ready"
        self.chain_ids: list[int] = []
        self.held: dict[str, int] = {}  # peer -> slots held or awaited by our routed jobs
        self._running: dict[DispatchJob, Lease] = {}
        self._service_est: float | None = None  # mean route service time (s), for WS-RR's expected waits
        self.routes = 0
        # The DispatchManager's counters, for the same swarm JSON and metrics: nothing queues centrally here.
        self.max_queue: int | None = None
        self.queue_max = 0
        self.refused = 0
        self.requeued = 0
        self.preferred_starts = 0  # routes ignore DispatchJob.prefer: each request picks its own servers
        self._peak: dict[tuple, int] = {}  # (servers, capacity) of a GCA chain -> most routes on it at once

    def attach(self, planner: Any) -> None:
        self.planner = planner

    # ---- DispatchManager interface -------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return 0  # no central queue: jobs wait at servers

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def stepping(self) -> int:
        return sum(1 for lease in self._running.values() if not lease.job.idle)  # a session's held lease: idle

    def active(self, index: int) -> int:
        if not (0 <= index < len(self.chains)):
            return 0
        key = tuple(self.chains[index].servers)
        return sum(1 for ls in self._running.values() if tuple(ls.chain.servers) == key)

    def peak_active(self, index: int) -> int:
        """Most routed jobs at once on exactly the servers of chain ``index`` (at its capacity) since start."""
        if not (0 <= index < len(self.chains)):
            return 0
        ch = self.chains[index]
        return self._peak.get((tuple(ch.servers), int(ch.capacity)), 0)

    def set_chains(self, chains) -> None:
        self.chains = list(chains)
        self.chain_ids = list(range(len(self.chains)))
        self.generation += 1
        if len(self._peak) > KEPT_CHAIN_IDS:  # a long run's re-plans (servers back under new ids): keep the current
            current = {(tuple(ch.servers), int(ch.capacity)) for ch in self.chains}
            self._peak = {k: n for k, n in self._peak.items() if k in current}

    def waiting_jobs(self) -> list[DispatchJob]:
        """Nothing waits centrally: routed jobs wait at their servers."""
        return []

    def snapshot(self) -> list[dict]:
        return [{"id": k, "index": k, "active": self.active(k), "capacity": ch.capacity,
                 "max_active": self.peak_active(k)} for k, ch in enumerate(self.chains)]

    async def acquire(self, job: DispatchJob) -> Lease:
        """Route ``job`` now (waiting only while no route exists yet, e.g. before the first plan)."""
        job.arrival = time.monotonic()
        note_admission(True)  # never refused here: a routed job waits at its servers (their bounded FIFOs)
        while True:
            hops = self.route()
            if hops is not None:
                break
            await asyncio.sleep(0.2)
        for peer, s, e in hops:
            self.held[peer] = self.held.get(peer, 0) + (e - s)
        chain = Chain(servers=tuple(h[0] for h in hops), blocks=tuple(e - s for _, s, e in hops),
                      service_time=self._route_time(hops), capacity=1, spans=tuple((s, e) for _, s, e in hops))
        lease = Lease(job=job, chain=chain, index=-1, generation=self.generation, chain_id=-1)
        lease.wait_s = self.wait_s  # the relay opens this lease's sessions with this server-side wait
        self._running[job] = lease
        self.routes += 1
        for k, ch in enumerate(self.chains):
            if tuple(ch.servers) == tuple(chain.servers):
                key = (tuple(ch.servers), int(ch.capacity))
                self._peak[key] = max(self._peak.get(key, 0), self.active(k))
        return lease

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self._running.pop(lease.job, None)
        for peer, s, e in lease.hops:
            left = self.held.get(peer, 0) - (e - s)
            if left > 0:
                self.held[peer] = left
            else:
                self.held.pop(peer, None)

    # ---- routing -------------------------------------------------------------------------------
    def _views(self):
        p = self.planner
        if p is None or p.model_spec is None:
            return None, []
        return p, [v for v in p.online_views() if v.peer_id in p.assignment]

    def free_slots(self) -> dict[str, int]:
        _, views = self._views()
        return {v.peer_id: max(0, int(v.record.slots_total) - self.held.get(v.peer_id, 0)) for v in views}

    def _route_time(self, hops) -> float:
        p, views = self._views()
        by = {s.name: s for s in p.specs(views)} if p is not None else {}
        total = sum(by[n].tau_c + by[n].tau_p * (e - s) for n, s, e in hops if n in by)
        return max(total, 1e-6)

    def route(self):
        """Hops ``[(peer, start, end)]`` for a request arriving now, or None if the blocks are not covered."""
        from petals_chain.algorithms.baselines import petals_route, ws_rr_route

        p, views = self._views()
        if not views:
            return None
        model = p.model_spec
        placement = {v.peer_id: tuple(p.assignment[v.peer_id]) for v in views}
        free = self.free_slots()
        try:
            if self.policy == "petals":
                # PETALS weighs one token's latency: per-step RTT and per-step compute per block.
                steps = max(1.0, float(p.steps_per_job))
                specs = [ServerSpec(name=v.peer_id, memory=float(v.record.memory_bytes),
                                    tau_c=(v.rtt_s if v.rtt_s is not None else p.tau_c(v) / steps),
                                    tau_p=p.tau_p(v) / steps) for v in views]
                hops = petals_route(specs, model, placement, free, overhead=self.overhead_s,
                                    cache_penalty=self.cache_penalty_s)
            else:
                specs = p.specs(views)
                hops = ws_rr_route(specs, model, placement, free, self.expected_wait(views, specs))
        except ValueError as e:
            logger.debug("no route yet: %s", e)
            return None
        t = self._route_time(hops)
        self._service_est = t if self._service_est is None else 0.9 * self._service_est + 0.1 * t
        return [(str(n), int(s), int(e)) for n, s, e in hops]

    def expected_wait(self, views, specs) -> dict[str, float]:
        """Expected wait at each server for one more job: slots free at ``slots_total / S`` per second (a job
        holds its slots for its whole service ``S``), and our backlog there is ``held - slots_total``."""
        S = self._service_est
        if S is None:
            S = min((ch.service_time for ch in self.chains), default=1.0)
        out = {}
        for v in views:
            total = max(1, int(v.record.slots_total))
            m = int(self.planner.assignment[v.peer_id][1])
            backlog = self.held.get(v.peer_id, 0) + m - total
            out[v.peer_id] = max(0.0, backlog / total * S) if backlog > 0 else 0.0
        return out
