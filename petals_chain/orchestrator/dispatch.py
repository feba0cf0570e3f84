"""Asyncio front of a chain dispatcher (JFFC by default): jobs await a chain lease, hold it until done.

The dispatcher itself (contracts A) is an event-driven state machine; this module turns its decisions
into awaited leases, keeps one central FIFO queue across re-plans, and swaps the chain set when the
planner publishes a new one without losing a queued or running job.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from petals_chain.model import Chain

logger = logging.getLogger(__name__)

DispatcherFactory = Callable[[list[Chain]], Any]


def chain_key(chain: Chain) -> tuple:
    """Identity of a chain across re-plans: its hops and their block spans."""
    return (tuple(chain.servers), tuple(tuple(s) for s in chain.spans))


@dataclass(eq=False)
class DispatchJob:
    """One job as the dispatcher sees it (hashable by identity)."""

    job_id: str
    arrival: float = field(default_factory=time.monotonic)
    wait_s: float = 0.0


@dataclass(eq=False)
class Lease:
    """A running job's right to use chain ``index`` of dispatcher generation ``generation``."""

    job: DispatchJob
    chain: Chain
    index: int
    generation: int
    chain_id: int
    released: bool = False

    @property
    def hops(self) -> list[tuple[str, int, int]]:
        """``(peer_id, start_block, end_block)`` per hop, end exclusive."""
        return [(name, int(s), int(e)) for name, (s, e) in zip(self.chain.servers, self.chain.spans)]


DISPATCH_POLICIES = ("jffc", "jsq", "jiq", "sed", "sa-jsq", "petals", "bprr")  # petals, bprr: routed.py
PLACEMENT_POLICIES = ("gbp-cr", "whole-model", "petals", "bprr")


def jffc_factory(queue_factory: Callable[[], Any] | None = None) -> DispatcherFactory:
    """JFFC over the central queue ``queue_factory()`` (any object with push/pop/remove/__len__/__iter__;
    default FIFO): the queue discipline is pluggable without touching dispatch or relay."""
    from petals_chain.algorithms import JFFCDispatcher

    return lambda chains: JFFCDispatcher(chains, queue=queue_factory() if queue_factory is not None else None)


def dispatcher_factory(policy: str, seed: int = 0, queue_factory: Callable[[], Any] | None = None) -> DispatcherFactory:
    """Factory for ``policy``: JFFC (central queue) or a per-chain-FIFO baseline (JSQ, JIQ, SED, SA-JSQ)."""
    import random

    if policy == "jffc":
        return jffc_factory(queue_factory)
    if policy not in DISPATCH_POLICIES:
        raise ValueError(f"unknown dispatch policy {policy!r}; choose from {', '.join(DISPATCH_POLICIES)}")
    from petals_chain.algorithms.baselines.dispatch import make_dispatcher

    rng = random.Random(seed)
    return lambda chains: make_dispatcher(policy, chains, rng=rng)


class DispatchManager:
    """Central-queue dispatch over the current chains.

    ``acquire`` waits (FIFO, in the dispatcher's central queue) until the dispatcher starts the job on a
    chain; ``release`` ends it there and starts the next queued job. ``set_chains`` installs a new chain
    set: running jobs whose chain is unchanged keep counting against it, queued jobs re-arrive in order.
    """

    def __init__(self, factory: DispatcherFactory | None = None, policy: str = "jffc"):
        self.factory = factory or dispatcher_factory(policy)
        self.policy = policy
        self.generation = 0
        self.dispatcher: Any = None
        self.chains: list[Chain] = []
        self.chain_ids: list[int] = []
        self._ids = itertools.count()
        self._id_by_key: dict[tuple, int] = {}
        self._waiters: dict[DispatchJob, asyncio.Future] = {}
        self._pending: list[DispatchJob] = []  # arrived while no chain exists (FIFO)
        self._running: dict[DispatchJob, Lease] = {}

    # ---- state -------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        q = self.dispatcher.queue_length if self.dispatcher is not None else 0
        return int(q) + len(self._pending)

    def active(self, index: int) -> int:
        """Jobs running on chain ``index`` of the current generation."""
        return sum(1 for ls in self._running.values() if ls.generation == self.generation and ls.index == index)

    @property
    def running(self) -> int:
        return len(self._running)

    # ---- chain set ---------------------------------------------------------------------------
    def set_chains(self, chains: Sequence[Chain]) -> None:
        """Install ``chains`` (GCA order). Jobs on unchanged chains are carried over."""
        chains = list(chains)
        old_running = list(self._running.values())
        queued = self._drain_queue()
        self.generation += 1
        self.chains = chains
        self.chain_ids = []
        for ch in chains:
            key = chain_key(ch)
            if key not in self._id_by_key:
                self._id_by_key[key] = next(self._ids)
            self.chain_ids.append(self._id_by_key[key])
        self.dispatcher = self.factory(chains) if chains else None
        index_by_key = {chain_key(ch): i for i, ch in enumerate(chains)}
        for lease in old_running:
            k = index_by_key.get(chain_key(lease.chain))
            if k is not None and self._adopt(k, lease.job):
                lease.index, lease.generation, lease.chain = k, self.generation, chains[k]
            # else: the job keeps its (old) chain until it finishes; its server slots are still held, and
            # servers refuse rather than over-commit, so a job started meanwhile retries (see engine).
        for job in queued:
            self._arrive(job)
        logger.info("dispatch generation %d: %d chains, %d running, %d queued", self.generation, len(chains),
                    len(self._running), self.queue_length)

    def _adopt(self, k: int, job: DispatchJob) -> bool:
        """Count an already running ``job`` against chain ``k`` of the new dispatcher (arrive() would pick a
        chain by its own rule; the job already runs on chain k)."""
        return bool(self.dispatcher.adopt(k, job))

    def _drain_queue(self) -> list[DispatchJob]:
        queued: list[DispatchJob] = []
        d = self.dispatcher
        if d is not None:
            q = getattr(d, "queue", None)
            if q is not None:
                queued.extend(list(q))
            else:  # remove_job is the contract's way to take a queued job out
                for job in list(self._waiters):
                    if job not in self._running and d.remove_job(job):
                        queued.append(job)
        queued.sort(key=lambda j: j.arrival)
        queued.extend(j for j in self._pending if j not in queued)
        self._pending = []
        queued.sort(key=lambda j: j.arrival)
        return queued

    # ---- jobs --------------------------------------------------------------------------------
    def _arrive(self, job: DispatchJob) -> None:
        if self.dispatcher is None:
            self._pending.append(job)
            return
        k = self.dispatcher.arrive(job)
        if k is not None and self._is_started(k, job):
            self._start(job, k)

    def _is_started(self, k: int, job: DispatchJob) -> bool:
        # JFFC returns None when it queues; per-chain-FIFO baselines return k also when the job waits there.
        started = getattr(self.dispatcher, "last_started", None)
        return True if started is None else bool(started)

    def _start(self, job: DispatchJob, k: int) -> None:
        lease = Lease(job=job, chain=self.chains[k], index=k, generation=self.generation, chain_id=self.chain_ids[k])
        self._running[job] = lease
        fut = self._waiters.pop(job, None)
        job.wait_s += time.monotonic() - job.arrival
        if fut is not None and not fut.done():
            fut.set_result(lease)
        else:  # nobody waits any more: give the slot back at once
            self.release(lease)

    async def acquire(self, job: DispatchJob) -> Lease:
        """Wait until ``job`` is started on a chain; FIFO with every other waiting job."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters[job] = fut
        job.arrival = time.monotonic()
        self._arrive(job)
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(job, None)
            if job in self._pending:
                self._pending.remove(job)
            elif job in self._running:
                self.release(self._running[job])
            elif self.dispatcher is not None:
                self.dispatcher.remove_job(job)
            raise

    def release(self, lease: Lease) -> None:
        """The job of ``lease`` is done with its chain: start the next queued job there."""
        if lease.released:
            return
        lease.released = True
        self._running.pop(lease.job, None)
        if lease.generation != self.generation or self.dispatcher is None:
            return
        nxt = self.dispatcher.complete(lease.index)
        if nxt is not None:
            self._start(nxt, lease.index)

    def snapshot(self) -> list[dict]:
        return [
            {"id": self.chain_ids[k], "index": k, "active": self.active(k), "capacity": ch.capacity}
            for k, ch in enumerate(self.chains)
        ]

