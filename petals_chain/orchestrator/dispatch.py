"""Asyncio front of a chain dispatcher (JFFC by default): jobs await a chain lease, hold it until done.

The dispatcher itself (contracts A) is an event-driven state machine; this module turns its decisions
into awaited leases, keeps one central FIFO queue across re-plans, and swaps the chain set when the
planner publishes a new one without losing a queued or running job.

The queue bound (``--max-queue``) is enforced here, where jobs are queued: a new job that cannot start
at once enters the queue only if the queue stays within the bound, else ``acquire`` raises
:class:`QueueFull` (HTTP 429). The check and the enqueue happen in one synchronous step of the event loop,
so ``queue_length <= max_queue`` holds at every instant for new jobs. Jobs that already held a chain (failover,
a session's later turn, a job retrying after a refused open) are never refused: they wait in a separate
re-queue lane (``requeued``), served before the queue and not counted in ``queue_length``; the lane holds
only jobs admitted earlier, so it does not grow with the offered load. The later jobs of a request of several
(the later choices of ``n`` > 1, which come after the first's prefill, and the other prompts of a multi-prompt
request) are never refused either: they queue in the discipline's order. The request's first job to arrive is
admitted only if the queue has a place for each of its jobs the free slots cannot start (:meth:`_check_room`), and
from then on it holds a place for each job still to come, as many as the queue has (and, where the queue keeps
places, as its client's share allows) (:class:`RequestPlaces`, ``places_held``): new jobs see them as taken until
each later job arrives and takes its own, or the request ends without it. A request admitted on free slots with
fewer places than later jobs holds one of those free slots for each of the others (``slots_held``): new jobs see the
slot as busy and queue (within the bound) or are refused, and the later job starts on it when it comes (taken by new
jobs, its later jobs had queued past the bound). A later job whose held slot is gone (a re-plan dropped its chain
with no room elsewhere, or a job of the request back after a failover found no other free slot and took it) waits in
the re-queue lane, as an admitted job, not in the queue. So ``queue_length + places_held <= max_queue`` holds at
every instant, through re-plans and failovers too. A request that can never be admitted (more jobs than the slots and
the queue, or its client's share of it, hold at once) is refused with :class:`QueueNeverFits`. A request is admitted
or refused as a whole: once its first job is refused (the bound, the share or its deadline, predicted for the last
of all its jobs) its other jobs are refused with it, touching nothing; once admitted, its other jobs are never refused.
(A request's jobs are known by the :class:`PlaceTicket` its generation gives each of them; jobs without one, e.g.
driven directly, are checked for their ``siblings`` but hold no places.)
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from petals_chain.algorithms.edf import (ChainLoad, EDFQueue, Preemptible, Prediction, StepTimes, flex_victim,
                                        meets_on, predict, predict_from_running)
from petals_chain.algorithms.jffc import JFFCDispatcher
from petals_chain.algorithms.prefix_locality import PrefixDirectory
from petals_chain.model import Chain
from petals_chain.orchestrator.fairness import ClientShares
from petals_chain.swarm.prefix import PREFIX_BLOCK_TOKENS, split_hashes

logger = logging.getLogger(__name__)

DispatcherFactory = Callable[[list[Chain]], Any]


def chain_key(chain: Chain) -> tuple:
    """Identity of a chain across re-plans: its hops and their block spans."""
    return (tuple(chain.servers), tuple(tuple(s) for s in chain.spans))


# a starved job's place: before every priority (O_r, levels are >= 0), the service starved longest first (plus
# seconds since the manager started: exact to ~0.1 us for 30 years)
STARVED_KEY = -1e9
STARVE_CHECK_S = 0.02
# chain ids (with the step times learnt and the peaks) kept of the chains planned now and before; past this many,
# only those planned now
KEPT_CHAIN_IDS = 256


@dataclass(eq=False)
class DispatchJob:
    """One job as the dispatcher sees it (hashable by identity).

    ``requeue``: the job held a chain before (it was admitted then); it waits in the re-queue lane and is
    never refused. ``prefer``: chain keys (:func:`chain_key`) to start on, in order, when one has room (the
    chains holding the longest cached prefix of the job's prompt, :class:`ChainPrefixes`).

    For the fairness policy (:mod:`~petals_chain.orchestrator.fairness`): ``client`` (API key name),
    ``input_tokens`` the job's chain will compute that its client has not paid for yet, ``matched`` (chain key ->
    those of them cached there), ``expected_output`` (tokens it may generate); ``fair`` is the policy's view.

    ``deadline``: the request's :class:`~petals_chain.orchestrator.deadlines.RequestDeadline` (None: none), for
    ``--schedule edf`` and the admission prediction; ``output_tokens``: the most it may generate."""

    job_id: str
    arrival: float = field(default_factory=time.monotonic)
    wait_s: float = 0.0
    requeue: bool = False
    prefer: tuple = ()
    client: str = "anonymous"
    input_tokens: int = 0
    matched: Mapping = field(default_factory=dict)
    expected_output: int = 0
    fair: Any = None
    deadline: Any = None
    output_tokens: int = 0
    yields: bool = False  # paused for a deadline (--schedule flex): re-queued behind every job with a deadline
    sched: Any = None  # --schedule db|mlfq: its algorithms.multimodel.Job (level, budget, priority), kept by the job
    # --schedule db: promoted by the starvation rule, first in the queue until it starts: the time its service's
    # oldest waiting job arrived (services starved longest go first), else None
    starved: float | None = None
    protected: bool = False  # started because it starved: not paused for priority again (a pause costs a round trip)
    # a session holding its chain between turns: it steps no more until its next turn, so pausing it frees nothing
    idle: bool = False
    # n > 1: the request's other choices, which ask for slots after this one (its first): its deadline prediction
    # is the last choice's. ``checked``: one of those later choices, admitted with the first (never refused or
    # dropped for its deadline: the request is already answering)
    siblings: int = 0
    checked: bool = False
    # a LoRA adapter's fingerprint (orchestrator/adapters.py): the job runs only on chains whose every server serves it
    adapter: str = ""

    @property
    def order_key(self) -> float:
        """EDF's key: the job's earliest deadline (``inf``: none, after every job with one; a job paused for a
        deadline just before those, so it resumes before new jobs without one)."""
        if self.deadline is not None:
            return self.deadline.order_key
        return sys.float_info.max if self.yields else math.inf

    @property
    def preemptible(self) -> bool:
        """No deadline of its own (or best effort): ``--schedule flex`` may pause it for one that has."""
        dl = self.deadline
        return dl is None or not dl.active or dl.best_effort


# a chain a re-plan left out keeps its prefix entries this long (ChainPrefixes.retain): above --ban-max-s's default
REPLANNED_KEEP_S = 600.0


class ChainPrefixes:
    """Which prompt prefixes each chain's servers were given to cache (at every job's close), so that a job starts
    on the chain holding the longest prefix of its prompt when that chain has room (a hint: servers evict on
    their own, and a chain that lost its prefix only costs the recompute)."""

    def __init__(self, directory: PrefixDirectory | None = None, keep_s: float = REPLANNED_KEEP_S,
                 clock: Callable[[], float] = time.monotonic):
        self.directory = directory if directory is not None else PrefixDirectory()
        if not keep_s >= 0:
            raise ValueError(f"keep_s must be >= 0, got {keep_s!r}")
        self.keep_s, self._clock = float(keep_s), clock
        self._planned: set[tuple] | None = None  # chain keys of the plan now (None: no plan seen yet)
        self._left: dict[tuple, float] = {}  # chain key -> when a plan left it out (kept for keep_s)

    def add(self, chain: Chain, named: bytes) -> None:
        """``chain``'s servers were given the KV of the tokens ``named`` (:func:`~petals_chain.swarm.prefix.
        prefix_hashes`) to cache."""
        self.directory.add(chain_key(chain), split_hashes(named))

    def retain(self, chains: Sequence[Chain]) -> int:
        """Forget what the chains not in ``chains`` (the plan now) were given (:meth:`PrefixDirectory.retain`): a
        re-planned chain's entries left only by the LRU cap. A chain left out for less than ``keep_s`` is kept: a
        failed server is banned from the plan for seconds (--ban-base-s) and keeps its cache meanwhile, and the
        chains through it come back as they were (forgotten at once, every prompt they held was computed again).
        Returns the entries dropped."""
        now = self._clock()
        planned = {chain_key(ch) for ch in chains}
        for key in (self._planned or set()) - planned:
            self._left.setdefault(key, now)
        self._left = {key: t for key, t in self._left.items() if key not in planned and now - t < self.keep_s}
        self._planned = planned
        return self.directory.retain(planned | self._left.keys())

    def preferred(self, named: bytes) -> tuple:
        """Chain keys holding part of the prompt ``named`` (its prefix hashes), longest first."""
        return tuple(self.directory.preferred(split_hashes(named)))

    def matched_tokens(self, named: bytes) -> dict[tuple, int]:
        """Chain key -> tokens of the prompt ``named`` its servers were given to cache."""
        return {k: n * PREFIX_BLOCK_TOKENS for k, n in self.directory.match(split_hashes(named)).items()}

    def live_match(self, named: bytes, paid: int = 0) -> "LiveMatch":
        """:meth:`matched_tokens` less ``paid`` (tokens its client paid for already), kept current while the job
        waits: a fair policy ordering the queue by prefix sees a chain that gained the prefix meanwhile."""
        return LiveMatch(self.directory, split_hashes(named), paid)


class LiveMatch(Mapping):
    """Chain key -> cached tokens of one prompt beyond what its client paid for, re-matched when the directory
    changes (a copy taken at arrival ordered the queue by what the chains held then)."""

    def __init__(self, directory: PrefixDirectory, keys: Sequence, paid: int):
        self._directory, self._keys, self._paid = directory, keys, int(paid)
        self._version = -1
        self._now: dict = {}

    def _current(self) -> dict:
        if self._version != self._directory.version:
            self._version = self._directory.version
            self._now = {k: max(0, n * PREFIX_BLOCK_TOKENS - self._paid)
                         for k, n in self._directory.match(self._keys).items()}
        return self._now

    def __getitem__(self, key):
        return self._current()[key]

    def __iter__(self):
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    # read straight from the current dict: Mapping's own get raises and catches a KeyError per chain that holds
    # nothing, and its items look every key up again (the LPM orders read these per queued job and chain)
    def get(self, key, default=None):
        return self._current().get(key, default)

    def items(self):
        return self._current().items()


class QueueFull(Exception):
    """A new job found no free chain and the central queue at its bound: refused (HTTP 429 ``queue_full``)."""

    code = "queue_full"

    def __init__(self, max_queue: int, message: str = ""):
        super().__init__(message or f"the swarm is at capacity and its queue is full ({max_queue} places waiting "
                                    "or held for admitted requests); retry later")
        self.max_queue = max_queue


class QueueShareFull(QueueFull):
    """A client-fair queue (:attr:`ClientShares.keeps_places`) refused a new request: its client would hold more than
    its share of what is left of the queue (HTTP 429 ``client_queue_share``), which stays free for other clients."""

    code = "client_queue_share"

    def __init__(self, max_queue: int, mine: int, queued: int, need: int = 1, choices: int = 1):
        if choices > 1:
            what = (f"this request's {choices} completions (prompts x n) need {need} places in the queue, where this "
                    f"client has {mine} of the {queued} waiting or held (bound {max_queue}); the last places are kept "
                    "for other clients; retry later, or ask for fewer")
        else:
            what = (f"this client already has {mine} requests waiting of the {queued} in the queue (bound "
                    f"{max_queue}); the rest of the queue is kept for other clients; retry later")
        super().__init__(max_queue, what)
        self.mine, self.queued = mine, queued


class QueueNeverFits(QueueFull):
    """A request of more jobs than the chains' slots and the queue (or, where the queue keeps places, its client's share
    of it) can ever hold at once: refused however idle the swarm (HTTP 429 ``exceeds_capacity``, without
    ``Retry-After``: the same request can never be admitted; it must ask for fewer completions)."""

    code = "exceeds_capacity"


# A client-fair queue admits a client's new waiting job only while the client has fewer than QUEUE_SHARE_ALPHA x (the
# places that stay free after it) waiting (Choudhury & Hahne's dynamic threshold for shared buffers): k clients that
# never stop sending hold about k·a/(1 + k·a) of the queue and never its last place, so a client with nothing waiting
# always finds room (one sender alone: 80 % of --max-queue), where a plain bound let a few heavy clients fill it and
# refuse everyone else
QUEUE_SHARE_ALPHA = 4.0

# a decode step's observed period is taken at most at this many times the step already known (see _observe_step)
GAP_FACTOR = 4.0


class NoAdapterChain(Exception):
    """A new job of a LoRA adapter (``DispatchJob.adapter``) finds no chain of the plan whose every server serves it
    (HTTP 503 ``no_adapter_chain``: servers that load it may join)."""

    code = "no_adapter_chain"

    def __init__(self, adapter: str):
        super().__init__(f"no chain of the swarm has every server serving this LoRA adapter ({adapter}); servers "
                         "started with it (--adapter) may join: retry later")


class DeadlineUnreachable(Exception):
    """A new job's deadline cannot be met by the dispatcher's prediction: refused at once (HTTP 429
    ``deadline_unreachable``, with ``Retry-After``: the swarm may have room for it later)."""

    code = "deadline_unreachable"

    def __init__(self, prediction: Prediction, message: str = ""):
        super().__init__(message or f"the deadline cannot be met: {prediction.reason}; retry with a later deadline, "
                                    "fewer max_tokens or best_effort")
        self.prediction = prediction


class DeadlineInfeasible(DeadlineUnreachable):
    """A new job's deadline is missed by the prediction even with every chain idle (no queue, no running job): refused
    however idle the swarm (HTTP 429 ``deadline_infeasible``, without ``Retry-After``: the same request is refused
    again; it must ask for a later deadline, fewer ``max_tokens`` or ``best_effort``)."""

    code = "deadline_infeasible"

    def __init__(self, prediction: Prediction):
        super().__init__(prediction, f"the deadline cannot be met even by an idle swarm: {prediction.reason}; ask for "
                                     "a later deadline, fewer max_tokens or best_effort")


class Admission:
    """The dispatcher's first decision on a request's jobs: admitted (started or queued) or refused.

    The API middleware puts one in :data:`ADMISSION` per generation request and holds a streamed response's
    headers until it is decided, so a refusal can still be an HTTP 429 rather than an error inside a 200."""

    def __init__(self) -> None:
        self.state: str | None = None  # None, "admitted" or "refused"
        self.code = ""  # a refusal's error code (queue_full, deadline_unreachable)
        self.message = ""  # and what the client is told
        # the refusal holds whatever the swarm does (the request never fits as it is): no Retry-After invites it back
        self.never_fits = False
        self.event = asyncio.Event()
        self.arrived = time.monotonic()  # the request came in (before its body was read): deadlines count from here
        # reserve(tokens): the most tokens the request may use, held against its client's tokens_per_minute until it
        # ends (RequestError 429 if they do not fit); set by the API middleware when the client has such a limit
        self.reserve: Callable[[int], None] | None = None
        self.reserved = 0  # tokens held by reserve()
        # reserve() is an early refusal (limits.py's _Refusal): the request gets a 429 once found valid, so its
        # checks do no work the refusal makes useless (a structured output is checked, not compiled)
        self.refused_early = False
        self.places = RequestPlaces()  # the request's jobs (all its prompts'), for the places the queue holds them

    def decide(self, admitted: bool, code: str = "", message: str = "", never_fits: bool = False) -> None:
        if self.state is None:
            self.state = "admitted" if admitted else "refused"
            self.code, self.message, self.never_fits = code, message, never_fits
            self.event.set()


# Context of the current request (copied into the tasks it spawns); None outside the API.
ADMISSION: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("petals_chain_admission", default=None)


class RequestPlaces:
    """The jobs one request submits to the dispatcher (each choice of each of its prompts, :meth:`expect`).

    Its first job to arrive is admitted only if the queue has a place for each of its jobs the free slots cannot
    start, and from then on it holds a place for each job still to come, as many as the queue had
    (:attr:`DispatchManager.places_held`), and a free slot for each of the others (:attr:`DispatchManager.
    slots_held`): new jobs see them as taken until each job arrives (and takes a slot or a place) or will not come
    (:meth:`PlaceTicket.drop`). Once its first job is refused, so are the others (:attr:`refusal`)."""

    def __init__(self) -> None:
        self.tickets: list[PlaceTicket] = []
        self.admitted = False  # its first job was admitted: the places of the others are held
        self.client = "anonymous"
        self.cap = 0  # the most places it holds (those the queue had at its admission)
        # chain keys of the free slots held for the jobs still to come beyond ``cap`` (one each), and the manager
        # that gives them back when those jobs will not come (:meth:`DispatchManager._give_back_slots`)
        self.slots: list[tuple] = []
        self.on_drop: Callable[["RequestPlaces"], None] | None = None
        self.refusal: Exception | None = None  # its first job's refusal: its other jobs are refused with it

    def expect(self, jobs: int) -> list["PlaceTicket"]:
        """``jobs`` more jobs of the request will arrive: one ticket each (to put in :data:`PLACE` of its task)."""
        if int(jobs) < 0:
            raise ValueError(f"jobs must be >= 0, got {jobs!r}")
        tickets = [PlaceTicket(self) for _ in range(int(jobs))]
        self.tickets.extend(tickets)
        return tickets

    @property
    def pending(self) -> int:
        """Jobs expected that have neither arrived nor been dropped."""
        return sum(1 for t in self.tickets if t.state == "expected")

    @property
    def holding(self) -> int:
        """Places it holds now: one per job still to come, at most :attr:`cap`."""
        return min(self.pending, self.cap)

    @property
    def slots_needed(self) -> int:
        """Free slots it holds for its jobs still to come that have no place (beyond :attr:`cap`)."""
        return max(0, self.pending - self.cap)


@dataclass(eq=False)
class PlaceTicket:
    """One job of a :class:`RequestPlaces`: ``expected``, then ``arrived`` (its job reached the dispatcher) or
    ``dropped`` (it never will: the request ended or failed first)."""

    places: RequestPlaces
    state: str = "expected"

    def drop(self) -> None:
        """The job will not arrive (any more): its place or slot, if held, is given back."""
        if self.state == "expected":
            self.state = "dropped"
            if self.places.slots and self.places.on_drop is not None:
                self.places.on_drop(self.places)


# The ticket of the job the current task submits (set by generation for each choice's task); None: none known.
PLACE: contextvars.ContextVar[PlaceTicket | None] = contextvars.ContextVar("petals_chain_place", default=None)


def note_admission(admitted: bool, code: str = "", message: str = "", never_fits: bool = False) -> None:
    """Record the dispatcher's decision on the current request's job (no-op outside a request); a refusal names
    its error ``code`` and ``message`` (a streamed response that was held back answers with them), and whether the
    request can never be admitted (``never_fits``)."""
    adm = ADMISSION.get()
    if adm is not None:
        adm.decide(admitted, code, message, never_fits)


@dataclass(eq=False)
class Lease:
    """A running job's right to use chain ``index`` of dispatcher generation ``generation``."""

    job: DispatchJob
    chain: Chain
    index: int
    generation: int
    chain_id: int
    released: bool = False
    preempt: bool = False  # --schedule flex: give the chain back at the next step (a deadline job takes it)
    # every hop keeps a paused job's KV as a cached prefix (paged servers with a prefix cache): a pause for priority
    # costs a round trip there, and a recompute of the job's whole history anywhere else
    keeps_kv: bool = False
    started: float = field(default_factory=time.monotonic)
    # counted against chain ``index`` (and ``also``), which share servers with its own ``chain`` that a re-plan
    # dropped (DispatchManager._carry): its steps teach nothing of chain ``index``
    carried: bool = False
    # further chains of the current plan it is counted against: those of its servers that chain ``index`` does not
    # pass through are each counted on one of them (one place each, given back at its release)
    also: list[int] = field(default_factory=list)

    @property
    def hops(self) -> list[tuple[str, int, int]]:
        """``(peer_id, start_block, end_block)`` per hop, end exclusive."""
        return [(name, int(s), int(e)) for name, (s, e) in zip(self.chain.servers, self.chain.spans)]


DISPATCH_POLICIES = ("jffc", "jsq", "jiq", "sed", "sa-jsq", "petals", "bprr")  # petals, bprr: routed.py
# the central queue's order (--schedule); flex: edf + pausing jobs without one; db, mlfq: seed 001's preemptive
# priorities (doubling budget, skip-join MLFQ) over the jobs' execution so far, paused between two steps
SCHEDULES = ("fcfs", "edf", "flex", "db", "mlfq")
PRIORITY_SCHEDULES = ("db", "mlfq")
PLACEMENT_POLICIES = ("gbp-cr", "whole-model", "petals", "bprr")


def jffc_factory(queue_factory: Callable[[], Any] | None = None) -> DispatcherFactory:
    """JFFC over the central queue ``queue_factory()`` (any object with push/pop/remove/__len__/__iter__;
    default FIFO): the queue discipline is pluggable without touching dispatch or relay."""
    from petals_chain.algorithms import JFFCDispatcher

    return lambda chains: JFFCDispatcher(chains, queue=queue_factory() if queue_factory is not None else None)


def fair_factory(shares: ClientShares) -> DispatcherFactory:
    """JFFC's capacity rule with the fairness policy of ``shares`` choosing the waiting job a freed chain takes
    (and, for D2LPM, the chain a job is bound to); chains are named by :func:`chain_key`, so the policy's
    counters survive re-plans."""
    from petals_chain.algorithms.fairness import FairDispatcher

    return lambda chains: FairDispatcher(chains, shares.policy, shares.describe,
                                         workers=[chain_key(ch) for ch in chains])


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
    chain; ``release`` ends it there and starts the next waiting job (re-queue lane first, then the queue).
    ``set_chains`` installs a new chain set: running jobs whose chain is unchanged keep counting against it,
    waiting jobs re-arrive in order. ``max_queue`` (None: unbounded) bounds ``queue_length``: see the module.

    ``schedule``: the central queue's order, ``fcfs`` or ``edf`` (earliest deadline first, :class:`EDFQueue`);
    ``flex`` is ``edf`` that also pauses a running job without a deadline for a new one that would miss its own
    (:meth:`_pause_for`; the paused job re-queues in the lane behind the deadline jobs).
    Either way a new job with a deadline (``job.deadline``, not best effort) is refused with
    :class:`DeadlineUnreachable` when :meth:`predict` says it would miss; ``steps_per_job()`` is the planner's
    steps per job (``T_k`` covers that many steps).

    Since start: ``queue_max`` (longest queue), ``refused`` (jobs refused by the bound), ``deadline_refused``
    (jobs refused as doomed; a request's other jobs refused with its first count in neither) and
    :meth:`peak_active` (most jobs run at once on a chain).
    """

    def __init__(self, factory: DispatcherFactory | None = None, policy: str = "jffc", max_queue: int | None = None,
                 shares: ClientShares | None = None, schedule: str = "fcfs",
                 steps_per_job: Callable[[], float] | None = None, classes: int = 1):
        if max_queue is not None and int(max_queue) < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.shares = shares
        self.schedule = schedule
        self.steps_per_job = steps_per_job or (lambda: 17.0)
        if factory is None and shares is not None and shares.central:
            if policy != "jffc":
                raise ValueError(f"fairness policy {shares.policy.name!r} needs the central queue of JFFC, not "
                                 f"dispatch {policy!r}")
            if schedule != "fcfs":
                order = "priority" if schedule in PRIORITY_SCHEDULES else "deadline"
                raise ValueError(f"--schedule {schedule} orders the central queue by {order}, --fairness "
                                 f"{shares.policy.name} by client shares: choose one (--fairness fcfs with --schedule "
                                 f"{schedule})")
            factory = fair_factory(shares)
        # --schedule db|mlfq: the discipline's numbers (algorithms/multimodel.py); L̂_s learnt from finished jobs
        self.priorities = None
        if schedule in PRIORITY_SCHEDULES:
            from petals_chain.algorithms.multimodel import STARVE_FACTOR, ServiceMonitor, make_scheduler

            # mlfq: FastServe's starvation rule, after 2 x the mean execution time learnt (the simulator's threshold)
            self.priorities = make_scheduler(schedule, ServiceMonitor(),
                                             **({"starve_factor": STARVE_FACTOR} if schedule == "mlfq" else {}))
        # --schedule-classes: a model's jobs form that many services by length (seed 001 §6.1), each with its L̂_s
        self.length_classes = None
        if self.priorities is not None and int(classes) > 1:
            from petals_chain.algorithms.multimodel import LengthClasses

            self.length_classes = LengthClasses(int(classes))
        # mlfq: q_1 and each job's first iteration from the steps jobs run here (the skip-join needs both)
        self.iterations = None
        if schedule == "mlfq":
            from petals_chain.algorithms.multimodel import IterationTimes

            self.iterations = IterationTimes()
        self.priority_preemptions = 0  # running jobs paused for a waiting job of higher priority (db, mlfq)
        self.starvation_promotions = 0  # waiting jobs put first by the starvation rule (db; mlfq: to the top queue)
        self._epoch = time.monotonic()
        self._starve_checked = -math.inf
        if factory is None and schedule in ("edf", "flex", *PRIORITY_SCHEDULES):
            if policy != "jffc":
                raise ValueError(f"--schedule {schedule} needs the central queue of JFFC, not dispatch {policy!r}")
            key = ((lambda job: job.order_key) if self.priorities is None else self._priority)
            factory = jffc_factory(lambda: EDFQueue(key=key))
        self.factory = factory or dispatcher_factory(policy)
        self.policy = policy
        self.max_queue = None if max_queue is None else int(max_queue)
        self.generation = 0
        self.dispatcher: Any = None
        self.chains: list[Chain] = []
        self.chain_ids: list[int] = []
        self._index_by_key: dict[tuple, int] = {}  # chain_key -> index in the current chains
        self.preferred_starts = 0  # jobs started on a chain they preferred (its cached prefix)
        self._ids = itertools.count()
        # chain_key -> id, kept across re-plans (a chain missing from one plan comes back with its id, what was learnt
        # of it and its peak); the chains of older plans are forgotten past KEPT_CHAIN_IDS (ids are never reused)
        self._id_by_key: dict[tuple, int] = {}
        self._running_by_chain: dict[int, set[Lease]] = {}  # chain id -> its running leases (in any plan)
        # leases of chains a re-plan dropped -> (rank, their servers that no chain counts them on yet: no chain through
        # them had room), in order: each takes the next slot freed on a chain through one of those servers
        # (_slot_freed)
        self._carried: dict[Lease, tuple[int, set[str]]] = {}
        self._carry_ranks = itertools.count()
        self._carried_on: dict[str, dict[Lease, None]] = {}  # server -> the leases of _carried still to count there
        self._chains_on: dict[str, list[tuple[int, int, int]]] = {}  # server -> (chain index, span) of the plan
        # chain index -> the leases of other chains counted there (carried, or its ``also``): a step on the chain
        # leaves their idle sessions out of its occupancy as it does its own (_observe_step)
        self._guests: dict[int, set[Lease]] = {}
        self._waiters: dict[DispatchJob, asyncio.Future] = {}
        self._pending: list[DispatchJob] = []  # arrived while no chain exists (FIFO); part of the queue
        self._lane: list[DispatchJob] = []  # re-queued jobs (FIFO), served before the queue
        self._running: dict[DispatchJob, Lease] = {}
        self._active: dict[int, int] = {}  # chain index -> jobs running there (current generation)
        # (chain id, capacity) -> most jobs at once: a chain re-planned with another capacity starts afresh,
        # so peak_active(k) <= capacity is an invariant a reader can check at any time.
        self._peak: dict[tuple[int, int], int] = {}
        self.queue_max = 0
        self.refused = 0
        self.share_refused = 0  # new requests refused by the share rule (QueueShareFull), not by the bound
        self.deadline_refused = 0
        self.flex_preemptions = 0  # running jobs paused so that a deadline job could take their slot
        self.step_times = StepTimes()  # each chain's time per token by jobs stepping, for the deadline predictions
        self._lease_steps: dict[Lease, list[float]] = {}  # running job -> [its first step's start, last step's end]
        # --schedule flex: running jobs marked to pause -> the deadline job each frees its slot for; and jobs whose
        # promised slot another job took (a paused job's slot goes to the queue's head) and are still waiting
        self._promised: dict[Lease, DispatchJob] = {}
        self._owed: list[DispatchJob] = []
        self._holds: list[RequestPlaces] = []  # admitted requests with jobs still to come (their places held)
        self._slot_holds: list[RequestPlaces] = []  # those of them holding free slots too
        self._reserved: dict[int, int] = {}  # chain index -> its free slots held for them (current generation)
        # stopping (refuse_waiting): what a new job is refused with, instead of queueing behind work that will be cut
        self.refusal: Callable[[], BaseException] | None = None
        self._new_waiters: set[DispatchJob] = set()  # waiting jobs of requests not admitted before: refusable
        # LoRA adapters: serves_adapter(chain, fingerprint) (set by the orchestrator) says whether every server of a
        # chain serves one. A job of an adapter starts on the fastest such chain with a free slot, else waits here
        # (FIFO) for one to free, never in the dispatcher's queue (whose head takes whichever chain's slot frees)
        self.serves_adapter: Callable[[Chain, str], bool] | None = None
        self._picky: list[DispatchJob] = []

    # ---- state -------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        q = self.dispatcher.queue_length if self.dispatcher is not None else 0
        return int(q) + len(self._pending) + sum(1 for j in self._picky if not j.requeue)

    @property
    def places_held(self) -> int:
        """Places in the queue held for the jobs still to come of admitted requests (see the module)."""
        if self._holds:
            self._holds = [p for p in self._holds if p.holding]
        return sum(p.holding for p in self._holds)

    @property
    def slots_held(self) -> int:
        """Free slots held for the later jobs of admitted requests that the queue had no place for (see the
        module): counted busy by the dispatcher until each such job starts there, or will not come."""
        return sum(self._reserved.values())

    def places_held_of(self, client: str) -> int:
        """The places of :attr:`places_held` that ``client``'s requests hold."""
        return sum(p.holding for p in self._holds if p.client == client)

    @property
    def requeued(self) -> int:
        """Jobs in the re-queue lane (admitted earlier; not part of ``queue_length``)."""
        return len(self._lane)

    def planned(self, chain: Chain) -> bool:
        """Whether ``chain`` is one of the chains planned now."""
        return chain_key(chain) in self._index_by_key

    def worker_of(self, lease: Lease) -> tuple | None:
        """The chain key (:func:`chain_key`) a fairness policy charges the work of ``lease`` to: the chain of the plan
        now that it is counted on first (its own, or for a job whose chain a re-plan dropped the one of the plan
        sharing most of its servers, :meth:`_carry`). None while it is counted on none (no chain through its servers
        had room yet, or they left the plan): the chain it was given is no worker of the plan any more."""
        if lease.generation != self.generation or not 0 <= lease.index < len(self.chains):
            return None
        return chain_key(self.chains[lease.index])

    def active(self, index: int) -> int:
        """Jobs running on chain ``index`` of the current generation."""
        return self._active.get(index, 0)

    def peak_active(self, index: int) -> int:
        """Most jobs run at once on chain ``index`` (at its current capacity) since start."""
        if not (0 <= index < len(self.chains)):
            return 0
        return self._peak.get((self.chain_ids[index], int(self.chains[index].capacity)), 0)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def stepping(self) -> int:
        """Jobs holding a chain and working on it (sessions held between turns left out)."""
        return sum(1 for lease in self._running.values() if not lease.job.idle)

    def _count(self, k: int, delta: int) -> None:
        n = self._active.get(k, 0) + delta
        self._active[k] = n
        if delta > 0:
            key = (self.chain_ids[k], int(self.chains[k].capacity))
            if n > self._peak.get(key, 0):
                self._peak[key] = n

    def _note_queue(self) -> None:
        q = self.queue_length
        if q > self.queue_max:
            self.queue_max = q

    # ---- chain set ---------------------------------------------------------------------------
    def set_chains(self, chains: Sequence[Chain]) -> None:
        """Install ``chains`` (GCA order). Jobs on unchanged chains are carried over."""
        chains = list(chains)
        old_running = list(self._running.values())
        queued, fresh = self._drain_queue()
        self.generation += 1
        self.chains = chains
        self.chain_ids = []
        for ch in chains:
            key = chain_key(ch)
            if key not in self._id_by_key:
                self._id_by_key[key] = next(self._ids)
            self.chain_ids.append(self._id_by_key[key])
        if len(self._id_by_key) > KEPT_CHAIN_IDS:  # a long run's re-plans: keep the chains planned now
            current = {chain_key(ch) for ch in chains}
            self._id_by_key = {k: i for k, i in self._id_by_key.items() if k in current}
            kept = set(self._id_by_key.values())
            self._peak = {k: n for k, n in self._peak.items() if k[0] in kept}
            self.step_times.retain(kept)  # what was learnt of the chains forgotten
        self.dispatcher = self.factory(chains) if chains else None
        self._active = {}
        index_by_key = self._index_by_key = {chain_key(ch): i for i, ch in enumerate(chains)}
        self._carried, self._carried_on, self._chains_on, self._guests = {}, {}, {}, {}
        for k, ch in enumerate(chains):
            for server, (a, b) in zip(ch.servers, ch.spans):
                self._chains_on.setdefault(server, []).append((k, int(a), int(b)))
        unplaced = []
        for lease in old_running:
            lease.also = []
            k = index_by_key.get(chain_key(lease.chain))
            if k is not None and self._adopt(k, lease.job):
                self._own(lease, k)
                self._count(k, +1)
            else:
                unplaced.append(lease)
        # after every job of an unchanged chain has its place there (in _running's order, a job of a dropped chain
        # took the place of one running on the chain itself, which was then counted as carried or not at all)
        for lease in unplaced:
            self._carry(lease)
        self._reserved = {}
        for places in list(self._slot_holds):  # held slots stay held (their chain first) before waiting jobs come
            keys, places.slots = places.slots, []
            self._slot_holds.remove(places)
            if chains and places.slots_needed:
                self._reserve(places, min(len(keys), places.slots_needed),
                              [index_by_key[key] for key in keys if key in index_by_key])
        lane, self._lane = self._lane, []
        if self.schedule in ("edf", "flex") or self.priorities is not None:
            # Every waiting job in the order a freed slot would take them (release(): the lane first, but a job
            # paused for deadlines or priority after the queue's jobs that go before it): arriving lane first,
            # then the queue by arrival, gave the new slots to whoever came first whatever their deadline.
            order = self._priority if self.priorities is not None else (lambda job: job.order_key)
            waiting = [(job, True) for job in lane] + [(job, False) for job in queued]
            waiting.sort(key=lambda e: (-math.inf if e[1] and not e[0].yields else order(e[0]), not e[1]))
            for job, in_lane in waiting:
                if in_lane:
                    self._arrive_requeued(job)
                else:
                    self._arrive(job)
            queued = []
        else:
            for job in lane:  # re-queued jobs first: they start or go back to the lane, in order
                self._arrive_requeued(job)
        picky, self._picky = self._picky, []
        for job in picky:  # adapters' jobs, in order: on the new chains serving theirs, or waiting on
            if job.requeue:
                self._arrive_requeued(job)
            elif self.dispatcher is None:
                self._picky.append(job)
            else:
                self._arrive_picky(job)
        if hasattr(self.dispatcher, "arrive_all"):  # a fairness policy picks among them all (fairness.py)
            for job, k in self.dispatcher.arrive_all(queued, fresh=fresh):
                self._start(job, k, queued=True)
        else:
            for job in queued:
                # No bound check: each re-arriving job queues at most once, so the queue cannot grow here.
                self._arrive(job)
        if self._promised:  # a job marked to pause on a chain this plan dropped frees no slot of it
            self._settle_promises()
        if self.priorities is not None:
            self._unmark_dropped(old_running)
        self._note_queue()
        carried = sum(1 for lease in self._running.values() if lease.carried or lease in self._carried)
        logger.info("dispatch generation %d: %d chains, %d running (%d of them on chains re-planned away, %d still "
                    "to be counted on a server they hold), %d queued, %d re-queued", self.generation, len(chains),
                    len(self._running), carried, len(self._carried), self.queue_length, len(self._lane))

    def _adopt(self, k: int, job: DispatchJob) -> bool:
        """Count an already running ``job`` against chain ``k`` of the new dispatcher (arrive() would pick a
        chain by its own rule; the job already runs on chain k)."""
        return bool(self.dispatcher.adopt(k, job))

    def _own(self, lease: Lease, k: int) -> None:
        """``lease`` runs on chain ``k`` of the current plan itself (its hops and spans): counted there as its own."""
        lease.index, lease.generation, lease.chain, lease.carried = k, self.generation, self.chains[k], False
        if lease.chain_id != self.chain_ids[k]:  # its chain's id was pruned while the plan left it out
            on_chain = self._running_by_chain.get(lease.chain_id, set())
            on_chain.discard(lease)
            if not on_chain:
                self._running_by_chain.pop(lease.chain_id, None)
            lease.chain_id = self.chain_ids[k]
            self._running_by_chain.setdefault(lease.chain_id, set()).add(lease)

    def _by_overlap(self, chain: Chain) -> list[int]:
        """Indices of the current chains that pass through a server of ``chain``, most blocks of those servers shared
        first, then most servers shared (ties: GCA order). O(hops x chains through them)."""
        shared: dict[int, list[int]] = {}
        for server, (a, b) in zip(chain.servers, chain.spans):
            for k, c, d in self._chains_on.get(server, ()):
                n = shared.setdefault(k, [0, 0])
                n[0] += max(0, min(int(b), d) - max(int(a), c))
                n[1] += 1
        return sorted(shared, key=lambda k: (-shared[k][0], -shared[k][1], k))

    def _carry(self, lease: Lease) -> None:
        """Count ``lease``, running on a chain the plan no longer has (or no longer has room on), against chains of the
        plan through its servers: GCA sized the new chains on every slot of their servers, so a job still holding a
        slot on each of them takes a place there. Chains with room, most shared first, until each of its servers
        that the plan uses is passed by one it counts on; a server of a full chain waits for the next slot freed on
        a chain through it (:meth:`_carry_into`), before any waiting job. Uncounted, JFFC started ``c_k`` more jobs
        on the same servers (a chain re-split by a block ran two jobs at capacity 1; a chain split over two new ones
        was counted on one, and the other started a job on the server it still held). The lease keeps its own chain
        and id (its hops, its step times); only its count moves (``carried``). A server no chain uses any more
        (gone, or left out of the plan) is not counted anywhere."""
        need = {server for server in lease.chain.servers if server in self._chains_on}
        for k in self._by_overlap(lease.chain):
            if not need:
                break
            if need.isdisjoint(self.chains[k].servers) or not self._adopt(k, lease.job):
                continue
            self._counted_on(lease, k)
            need.difference_update(self.chains[k].servers)
        if need:
            self._carried[lease] = (next(self._carry_ranks), need)
            for server in need:
                self._carried_on.setdefault(server, {})[lease] = None

    def _counted_on(self, lease: Lease, k: int) -> None:
        """``lease`` takes a place of chain ``k`` (the dispatcher counts it already): its first chain of this plan,
        or one more (``also``)."""
        if lease.generation != self.generation:
            if chain_key(lease.chain) == chain_key(self.chains[k]):  # its own chain, whose capacity had shrunk
                self._own(lease, k)
            else:
                lease.index, lease.generation, lease.carried = k, self.generation, True
        else:
            lease.also.append(k)
        if lease.carried or k != lease.index:
            self._guests.setdefault(k, set()).add(lease)
        self._count(k, +1)

    def _uncarry(self, lease: Lease) -> None:
        """``lease`` waits for no slot any more (it is counted on every server it holds, or it ended)."""
        for server in self._carried.pop(lease, (0, ()))[1]:
            on = self._carried_on.get(server)
            if on is not None:
                on.pop(lease, None)
                if not on:
                    del self._carried_on[server]

    def _unmark_dropped(self, leases: Sequence[Lease]) -> None:
        """``--schedule db|mlfq``: a running job marked to pause for priority on a chain the new plan dropped runs on
        (its pause would free no slot of the plan: the waiting job it was for re-arrived here), and is not counted;
        the jobs of the new plan are weighed again instead."""
        unmarked = 0
        for lease in leases:
            if lease.preempt and lease.generation != self.generation and not lease.released:
                lease.preempt = False
                self.priority_preemptions -= 1
                unmarked += 1
        if unmarked:
            self._preempt_for_priority()

    def _drain_queue(self) -> tuple[list[DispatchJob], set[DispatchJob]]:
        """Every waiting job, by arrival, and those of them no policy saw yet (they arrived while no chain existed)."""
        queued: list[DispatchJob] = []
        d = self.dispatcher
        if d is not None:
            q = getattr(d, "queue", None)
            if hasattr(d, "drain"):  # a fairness dispatcher: undo what queueing charged
                queued.extend(d.drain())
            elif q is not None:
                queued.extend(list(q))
            else:  # remove_job is the contract's way to take a queued job out
                for job in list(self._waiters):
                    if job not in self._running and d.remove_job(job):
                        queued.append(job)
        queued.sort(key=lambda j: j.arrival)
        fresh = {j for j in self._pending if j not in queued}
        queued.extend(fresh)
        self._pending = []
        queued.sort(key=lambda j: j.arrival)
        return queued, fresh

    # ---- jobs --------------------------------------------------------------------------------
    def _arrive(self, job: DispatchJob, bounded: bool = False, later: int = 0, now: float | None = None) -> int:
        """Start ``job`` or queue it; with ``bounded``, raise :class:`QueueFull` instead of exceeding the bound, which
        must leave room for the ``later`` jobs of its request still to come (:meth:`_check_room`). Returns the places
        its request may hold for them (all ``later`` unbounded). ``now``: the time its deadlines are judged at (the
        prediction's, :meth:`_fits`)."""
        if bounded and job.adapter and self.dispatcher is not None and not self._adapter_chains(job.adapter):
            raise NoAdapterChain(job.adapter)  # a new request's, at once (not QueueNeverFits for its 0 slots)
        bounded = bounded and self.max_queue is not None
        cap = later
        if bounded and later:
            cap = self._check_room(job, later)
        if job.adapter and self.dispatcher is not None:
            return self._arrive_picky(job, bounded, cap)
        if self.dispatcher is None:
            if bounded and len(self._pending) + self.places_held + cap >= self.max_queue:
                raise QueueFull(self.max_queue)
            self._pending.append(job)
            if bounded and self.keeps_places:
                self._check_share(job, cap)
            return cap
        fits = self._fits(job, now)
        if self._start_preferred(job, fits):
            return cap
        k = self.dispatcher.arrive(job) if fits is None else self.dispatcher.arrive(job, fits)
        if k is not None and self._is_started(k, job):
            if chain_key(self.chains[k]) in job.prefer:
                self.preferred_starts += 1
            self._start(job, k)
            return cap
        if bounded and cap:
            # queued although _check_room counted a free slot for it (a per-chain baseline, SED, queues at a full fast
            # chain beside one): that slot starts a later job instead, so the later jobs hold one place fewer (before,
            # the full cap on top of this job refused a request that fit, the queue empty)
            cap = max(0, min(cap, self.max_queue - self.queue_length - self.places_held))
        if bounded and self.queue_length + self.places_held + cap > self.max_queue:
            # Undone in the same step (no await in between): the over-long queue is never observable.
            self._withdraw(job)
            raise QueueFull(self.max_queue)
        elif bounded and self.keeps_places:
            self._check_share(job, cap)
        return cap

    def _adapter_chains(self, adapter: str) -> list[int]:
        """The current chains whose every server serves the adapter ``adapter``, fastest first."""
        serves = self.serves_adapter
        return sorted((k for k, ch in enumerate(self.chains) if serves is not None and serves(ch, adapter)),
                      key=lambda k: (self.chains[k].service_time, k))

    def _start_picky(self, job: DispatchJob) -> bool:
        """Start a job of an adapter on the fastest chain serving it with a free slot (JFFC over those chains)."""
        for k in self._adapter_chains(job.adapter):
            if self._room(k) > 0 and self.dispatcher.adopt(k, job):
                self._start(job, k)
                return True
        return False

    def _arrive_picky(self, job: DispatchJob, bounded: bool = False, cap: int = 0) -> int:
        """:meth:`_arrive` for a job of an adapter: start it, or queue it apart (:attr:`_picky`) within the bound. A new
        request's job that no chain of the plan serves is refused with :class:`NoAdapterChain`: raised on arrival
        (``bounded``), or through its waiter when a plan comes (it arrived before any chain did, or the plan dropped
        the chains serving it)."""
        if not self._adapter_chains(job.adapter):
            if bounded:
                raise NoAdapterChain(job.adapter)
            fut = self._waiters.get(job)
            if job in self._new_waiters and fut is not None and not fut.done():
                fut.set_exception(NoAdapterChain(job.adapter))
                return cap
        if self._start_picky(job):
            return cap
        if bounded and self.queue_length + self.places_held + 1 + cap > self.max_queue:
            raise QueueFull(self.max_queue)
        if bounded and self.keeps_places:  # the share rule, as _check_share (a client took every place else)
            queued = self.queue_length + self.places_held
            mine = self.waiting_of(job.client) + self.places_held_of(job.client)
            if self._over_share(mine, queued, 1 + cap):
                raise QueueShareFull(self.max_queue, mine, queued, 1 + cap, 1 + cap)
        self._picky.append(job)
        return cap

    def _picky_for(self, k: int) -> DispatchJob | None:
        """The waiting job of an adapter that chain ``k``'s freed slot goes to: the first that ``k`` serves, if it came
        back after holding a chain or goes before the dispatcher's queue head (FIFO across both, or the queue's
        order: deadlines, priorities)."""
        if not self._picky:
            return None
        q = getattr(self.dispatcher, "queue", None)
        if q is None or not len(q):
            head = None
        elif hasattr(q, "peek"):
            head = q.peek()
        else:  # a fair policy's queue (a list, by arrival): its oldest job (taken for none, adapters' jobs went first)
            head = next(iter(q))
        # in the queue's own order (edf, flex: deadlines; db, mlfq: priorities; else arrival), as the predictions of
        # the queued jobs count those ahead: by arrival alone, an adapter's job without a deadline took the slot of a
        # deadline job that came after it. A job paused for a deadline or priority goes after a head that goes first
        # (as in the re-queue lane); one back after a failover goes first
        key = ((self._priority if self.priorities is not None else (lambda j: j.order_key)) if isinstance(q, EDFQueue)
               else (lambda j: 0.0))
        for job in self._picky:
            first = head is None or (job.requeue and not job.yields) or (
                (key(job), job.arrival) <= (key(head), head.arrival))
            if first and self._may_run_on(job, k):
                return job
        return None

    def _hold(self, ticket: PlaceTicket, job: DispatchJob, cap: int) -> None:
        """``job``, its request's first, was admitted: up to ``cap`` places of the request's jobs still to come are
        held."""
        places = ticket.places
        ticket.state = "arrived"
        places.admitted, places.client, places.cap = True, job.client, int(cap)
        places.adapter = job.adapter  # its later jobs' held slots: on chains serving it
        if places.pending and places not in self._holds:
            self._holds.append(places)
        if places.slots_needed and self.dispatcher is not None:
            # the free slots (_check_room counted them) start the jobs the queue has no place for: held for them,
            # the first job's chain first (a later choice forks its prompt's KV there)
            lease = self._running.get(job)
            self._reserve(places, places.slots_needed, () if lease is None else (lease.index,))

    def _reserve(self, places: RequestPlaces, n: int, first: Sequence[int] = ()) -> None:
        """Hold up to ``n`` free slots for ``places``' jobs to come (chains ``first``, then the fastest); the
        dispatcher counts each busy (as a job carried over a re-plan) until :meth:`_take_slot` or
        :meth:`_give_back_slots`."""
        order = [*first, *sorted(range(len(self.chains)), key=lambda i: (self.chains[i].service_time, i))]
        adapter = getattr(places, "adapter", "")
        if adapter:
            serving = set(self._adapter_chains(adapter))
            order = [k for k in order if k in serving]
        for k in order:
            while n > 0 and self._room(k) > 0 and self.dispatcher.adopt(k, places):
                self._reserved[k] = self._reserved.get(k, 0) + 1
                places.slots.append(chain_key(self.chains[k]))
                n -= 1
        if places.slots:
            places.on_drop = self._give_back_slots
            if places not in self._slot_holds:
                self._slot_holds.append(places)

    def _take_slot(self, places: RequestPlaces, last: bool = False) -> int | None:
        """The index of a slot ``places`` holds, now its job's (None: it holds none): the first held (the first job's
        chain, where a later choice forks its prompt's KV), or with ``last`` the last (the slowest, to give back)."""
        k = None
        while places.slots and k is None:
            k = self._index_by_key.get(places.slots.pop() if last else places.slots.pop(0))
            if k is not None and self._reserved.get(k, 0) > 0:
                self._reserved[k] -= 1
            else:
                k = None
        if not places.slots and places in self._slot_holds:
            self._slot_holds.remove(places)
        return k

    def _give_back_slots(self, places: RequestPlaces) -> None:
        """``places`` holds more slots than jobs to come without a place (one will not come): each slot too many
        takes the next waiting job, as a job's end does."""
        while len(places.slots) > places.slots_needed:
            k = self._take_slot(places, last=True)
            if k is not None and self.dispatcher is not None:
                self._slot_freed(k)
        if not places.slots and places in self._slot_holds:
            self._slot_holds.remove(places)

    def _withdraw(self, job: DispatchJob) -> None:
        """Take ``job``, queued in this same step, out again as if it had never arrived (it is refused): a dispatcher
        whose policy keeps state per arrival (a fair one: VTC's counters, d-vtc's round robin) undoes it."""
        if self.dispatcher is None:
            self._pending.remove(job)
            return
        refuse = getattr(self.dispatcher, "refuse", None)
        try:
            if refuse is not None and refuse(job):
                return
        except ValueError:  # something came between its arrival and now: the policy keeps that arrival's trace
            logger.warning("dispatch: a refused job's arrival could not be undone in the fairness policy")
        self.dispatcher.remove_job(job)

    @property
    def keeps_places(self) -> bool:
        """The queue keeps its last places for clients with nothing waiting (:data:`QUEUE_SHARE_ALPHA`): a bounded
        queue under a client-fair discipline with clients told apart (:attr:`ClientShares.keeps_places`)."""
        return self.max_queue is not None and self.shares is not None and self.shares.keeps_places

    def waiting_of(self, client: str) -> int:
        """``client``'s jobs counted by ``queue_length``."""
        return sum(1 for j in self._queued_jobs() if j.client == client)

    def _room(self, k: int) -> int:
        """Chain ``k``'s slots neither running a job nor reserved for a request (negative when over capacity)."""
        return int(self.chains[k].capacity) - self.active(k) - self._reserved.get(k, 0)

    def _free_slots(self, ks: Iterable[int]) -> int:
        """Free slots of the chains ``ks``."""
        return sum(max(0, self._room(k)) for k in ks) if self.dispatcher is not None else 0

    def _slots(self, ks: Iterable[int]) -> int:
        """Slots of the chains ``ks``, busy or not."""
        return sum(max(0, int(self.chains[k].capacity)) for k in ks)

    def _chains_for(self, adapter: str) -> list[int]:
        """The chains a job of LoRA adapter ``adapter`` may run on: those serving it, or all (``""``: the base)."""
        return self._adapter_chains(adapter) if adapter else list(range(len(self.chains)))

    def _check_room(self, job: DispatchJob, later: int) -> int:
        """The first job of a request of several (``n`` > 1, several prompts): refuse it now unless the queue has a
        place for each of its jobs the free slots cannot start (the ``later`` ones come after its prefill and are
        never refused), within the bound and, where the queue keeps places, the share; places held for other
        requests count as taken. Returns the places the request may hold for its later jobs: all of them where the
        queue has room (then the bound holds whoever takes the free slots meanwhile), else those it has."""
        # an adapter's jobs start only on the chains serving it: the other chains' free slots start none of them
        ks = self._chains_for(job.adapter)
        free = self._free_slots(ks)
        need = max(0, 1 + later - free)
        queued = self.queue_length + self.places_held
        if need > self.max_queue - queued:
            slots = self._slots(ks)
            whose = (f"the chains' {slots} slots" if not job.adapter
                     else f"the {slots} slots of the chains serving its LoRA adapter")
            # never fits, however idle the swarm: not "retry later" (with no chain yet, nothing is known of slots)
            if self.dispatcher is not None and 1 + later - slots > self.max_queue:
                raise QueueNeverFits(self.max_queue, f"this request's {1 + later} completions (prompts x n) are more "
                                                     f"than {whose} and the queue's bound "
                                                     f"(--max-queue {self.max_queue}) together: ask for fewer")
            raise QueueFull(self.max_queue, f"the swarm is busy: its queue ({queued} waiting or held, bound "
                                            f"{self.max_queue}) has no room for the {need} of this request's "
                                            f"{1 + later} completions (prompts x n) that the {free} free slots cannot "
                                            "start; retry later, or ask for fewer")
        mine = self.waiting_of(job.client) + self.places_held_of(job.client)
        if self.keeps_places and self._over_share(mine, queued, need):
            if self.dispatcher is not None:
                idle = max(0, 1 + later - self._slots(ks))
                if self._over_share(0, 0, idle):  # more than any client's share even of an idle swarm's queue
                    raise QueueNeverFits(self.max_queue, f"this request's {1 + later} completions (prompts x n) "
                                                         f"need {idle} places in the queue beyond the chains' free "
                                                         "slots, more than one client may hold of it (--max-queue "
                                                         f"{self.max_queue}, the rest kept for other clients) even "
                                                         "when the swarm is idle: ask for fewer")
            raise QueueShareFull(self.max_queue, mine, queued, need, 1 + later)
        cap = min(later, self.max_queue - queued - (0 if free > 0 else 1))
        if self.keeps_places:  # the places it holds are its client's too: no more than its share (need fits)
            while cap > need and self._over_share(mine, queued, cap):
                cap -= 1
        return cap

    def _over_share(self, mine: int, queued: int, need: int = 1) -> bool:
        """The share rule (:data:`QUEUE_SHARE_ALPHA`): a client with ``mine`` jobs waiting of ``queued`` asks for
        ``need`` more places; refused if, at its last one, it would hold at least ALPHA x the places left free after
        it. A client with nothing waiting asking for one place is never refused by it."""
        held = mine + need - 1
        return held > 0 and held >= QUEUE_SHARE_ALPHA * (self.max_queue - queued - need)

    def most_jobs_admissible(self, adapter: str = "") -> int | None:
        """The most jobs one request may have at once and still be admitted on an idle swarm (:meth:`_check_room`:
        the chains' slots, those serving the LoRA adapter ``adapter`` if one is named, and the places of the queue's
        bound, or of one client's share where it keeps places); None: no bound (no chain yet, or no bound at all).
        For a caller that chooses how many of its request's jobs run at once (the inputs of an embeddings request),
        so that its own choice is never refused as too many."""
        if self.max_queue is None or self.dispatcher is None:
            return None
        places = self.max_queue
        if self.keeps_places:
            places = next(k for k in range(self.max_queue + 1) if self._over_share(0, 0, k + 1))
        return self._slots(self._chains_for(adapter)) + places

    def _check_share(self, job: DispatchJob, later: int = 0) -> None:
        """Refuse ``job`` (just queued, not started) with :class:`QueueShareFull` if its client, with the places of
        the ``later`` jobs of its request, would hold more than its share of the free places
        (:data:`QUEUE_SHARE_ALPHA`); undone in the same step, like the bound."""
        queued = self.queue_length - 1 + self.places_held  # before this job
        mine = self.waiting_of(job.client) - 1 + self.places_held_of(job.client)
        if self._over_share(mine, queued, 1 + later):
            self._withdraw(job)
            raise QueueShareFull(self.max_queue, mine, queued, 1 + later, 1 + later)

    def _queued_jobs(self) -> list[DispatchJob]:
        """Jobs counted by ``queue_length`` (the dispatcher's queue and jobs waiting for a first plan)."""
        q = getattr(self.dispatcher, "queue", None) if self.dispatcher is not None else None
        return [*(list(q) if q is not None else []), *self._pending, *(j for j in self._picky if not j.requeue)]

    def _arrive_requeued(self, job: DispatchJob, ticket: PlaceTicket | None = None) -> None:
        """Start ``job`` if the dispatcher has a free slot for it now, or one its request holds (``ticket``: its
        place in the request), else put it in the re-queue lane."""
        if job.adapter:  # an adapter's: only on chains serving it, waiting apart
            if self.dispatcher is not None and self._start_picky(job):
                return
            # or on a slot its request holds (on a chain serving it, _reserve), as below: it idled while the job waited
            k = self._take_slot(ticket.places) if self.dispatcher is not None and ticket is not None \
                and ticket.places.slots else None
            if k is not None:
                self._start(job, k)
            else:
                self._picky.append(job)
            return
        if self.dispatcher is not None:
            if self._start_preferred(job):
                return
            k = self.dispatcher.arrive(job)
            if k is not None and self._is_started(k, job):
                self._start(job, k)
                return
            self.dispatcher.remove_job(job)  # it waits in the lane, not in the dispatcher's queue
            # A per-chain baseline (SED) may have queued it at a full fast chain while another has room: an
            # admitted job is not left waiting beside a free slot (the lane takes the first slot that frees).
            for k in sorted(range(len(self.chains)), key=lambda i: self.chains[i].service_time):
                if self.dispatcher.adopt(k, job):
                    self._start(job, k)
                    return
            # a job of a request holding free slots for its jobs still to come (its first, failed over: its chain
            # left the plan) takes one: those jobs wait for this one's prefill, so the slot idled, held for them,
            # while it waited in the lane until the queue's timeout (the later job without a slot queues instead)
            k = self._take_slot(ticket.places) if ticket is not None and ticket.places.slots else None
            if k is not None:
                self._start(job, k)
                return
        self._lane.append(job)
        if self.priorities is not None:  # db, mlfq: the lane too is served best priority first (stable)
            self._lane.sort(key=self._priority)

    def _start_preferred(self, job: DispatchJob, fits: Callable[[int], bool] | None = None) -> bool:
        """Start ``job`` on the chain it prefers that :meth:`_preferred_pick` names (JFFC: a chain has room only while
        the queue is empty, so no queued job is passed over). False if none, or if the dispatcher weighs prefixes
        itself (a fairness policy)."""
        if self.shares is not None and self.shares.central:
            return False
        k = self._preferred_pick(job, fits)
        if k is None or not self.dispatcher.adopt(k, job):
            return False
        self.preferred_starts += 1
        self._start(job, k)
        return True

    def _preferred_pick(self, job: DispatchJob, fits: Callable[[int], bool] | None = None) -> int | None:
        """The chain ``job`` prefers (its cached prefix) that it starts on now: the first with room; with ``fits``
        (:meth:`_fits`) the first with room where it meets its deadlines, else none if the dispatcher has a free
        chain where it does (``arrive(job, fits)`` starts it there), else the first with room. None: the
        dispatcher's own choice."""
        room = [k for k in (self._index_by_key.get(key) for key in job.prefer)
                if k is not None and self._room(k) > 0]
        if fits is not None:
            k = next((k for k in room if fits(k)), None)
            if k is not None:
                return k
            k = self.dispatcher.peek(fits)
            if k is not None and fits(k):
                return None
        return room[0] if room else None

    def _is_started(self, k: int, job: DispatchJob) -> bool:
        # JFFC returns None when it queues; per-chain-FIFO baselines return k also when the job waits there.
        started = getattr(self.dispatcher, "last_started", None)
        return True if started is None else bool(started)

    def _start(self, job: DispatchJob, k: int, queued: bool = False) -> None:
        lease = Lease(job=job, chain=self.chains[k], index=k, generation=self.generation, chain_id=self.chain_ids[k])
        self._running[job] = lease
        # (a step counts the idle sessions among its own chain's leases, not among every running job)
        self._running_by_chain.setdefault(lease.chain_id, set()).add(lease)
        self._count(k, +1)
        fut = self._waiters.pop(job, None)
        job.wait_s += time.monotonic() - job.arrival
        if job.starved is not None:
            job.starved, job.protected = None, True
        live = fut is not None and not fut.done()
        if self.shares is not None:
            if live:
                self.shares.started(job, chain_key(self.chains[k]), queued)
            else:  # a policy that picked it charged it: its client went away in the same turn, nothing is served
                self.shares.refund(job, chain_key(self.chains[k]), gone=True)
        if live:
            fut.set_result(lease)
        else:  # nobody waits any more: give the slot back at once
            self.release(lease)
        if self._promised:
            self._settle_promises()

    async def acquire(self, job: DispatchJob) -> Lease:
        """Wait until ``job`` is started on a chain; FIFO with every other waiting job.

        Raises :class:`QueueFull` at once if ``job`` is new (not ``requeue``), cannot start now and the queue
        is at ``max_queue``."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters[job] = fut
        # one clock reading for the prediction and the start: the chain admission times is the chain it starts on
        now = job.arrival = time.monotonic()
        if job.sched is not None:  # the starvation rule's wait counts from its arrival or its last pause
            job.sched.waiting_since = job.arrival
        ticket = None if job.requeue else PLACE.get()  # the job's place in its request (None: not known)
        if ticket is not None and ticket.state == "dropped":
            ticket = None
        if ticket is not None and ticket.places.refusal is not None:
            # its request was refused (its first job): so is this job, at once, as nothing (counted with the first)
            self._waiters.pop(job, None)
            raise ticket.places.refusal
        # a later job of an admitted request (a later choice, another prompt): admitted with it, never refused
        joined = job.checked or (ticket is not None and ticket.places.admitted)
        if self.refusal is not None and not job.requeue and not joined:  # stopping: only a new request is refused
            self._waiters.pop(job, None)
            raise self.refusal()
        later = ticket.places.pending - 1 if not joined and ticket is not None and ticket.state == "expected" else 0
        if later > job.siblings:  # a multi-prompt request's first job: its deadline is its last job's
            job.siblings = later
        paused: list[Lease] = []
        try:
            dl = job.deadline
            fresh = not job.requeue and not joined and dl is not None and dl.active
            if fresh and dl.best_effort:
                # served late rather than refused, so not first in the queue either: behind the jobs that can still
                # meet their deadlines (else ttft_deadline_ms=1 with best_effort would jump every queue). Decided
                # once: a multi-prompt request's jobs share it, and a queued job's key must not change under it
                if not dl.late_decided:
                    dl.late, dl.late_decided = self.predict(job, now).doomed, True
            elif (joined and not job.requeue and self.schedule == "flex" and dl is not None and dl.active
                  and not dl.best_effort and math.isfinite(dl.deadline)
                  and not (ticket is not None and ticket.state == "expected" and ticket.places.slots)):
                # a later choice, admitted with the first when enough jobs were there to pause for them all: it
                # pauses its own now that it needs the slot (paused with the first, the slot went to the paused
                # job's own resumption before this choice came). Only for the last token (the request's first
                # token is the first choice's). Never refused
                if self.predict(job, first_token=False).doomed or self._misses_waiting(job, first_token=False):
                    paused = self._pause_for(job, first_token=False) or []
            elif fresh:
                pred = self.predict(job, now)
                # flex: a job that would miss (by the queue's rate, or waiting for the running jobs' own remaining
                # work) takes the slot of a job without a deadline if that saves it; else edf's rule
                found = (self._pause_for(job) if self.schedule == "flex" and (pred.doomed or
                                                                               self._misses_waiting(job)) else None)
                paused = found or []
                if pred.doomed and not found:
                    self.deadline_refused += 1
                    idle = self._predict_idle(job, now)
                    raise DeadlineInfeasible(idle) if idle.doomed else DeadlineUnreachable(pred)
            if job.requeue:
                self._arrive_requeued(job, PLACE.get())
            elif joined:
                # a later job of an admitted request: starts on the slot held for it, or takes the place held for it
                # (in the same step, so the bound holds) and queues in the discipline's order, never refused
                k, slotted = None, False
                if ticket is not None and ticket.state == "expected":
                    slotted = ticket.places.pending > ticket.places.cap  # admitted on a held slot, not a place
                    ticket.state = "arrived"
                    k = self._take_slot(ticket.places)
                if k is not None:
                    self._start(job, k)
                elif slotted:
                    # its held slot is gone (a re-plan dropped its chain with no room elsewhere, or a failed-over job
                    # of its request took it): admitted with no place in the queue, it waits in the re-queue lane
                    # (the next slot that frees) rather than queue past the bound
                    self._arrive_requeued(job)
                else:
                    self._arrive(job)
            else:
                cap = self._arrive(job, bounded=True, later=job.siblings, now=now)
                if ticket is not None:
                    self._hold(ticket, job, cap)
        except NoAdapterChain as e:  # no admission noted: a held stream ends in the 503 this becomes (failover.py)
            self._waiters.pop(job, None)
            if ticket is not None and not ticket.places.admitted:
                ticket.places.refusal = e
            raise
        except (QueueFull, DeadlineUnreachable) as e:
            self._waiters.pop(job, None)
            if ticket is not None and not ticket.places.admitted:
                ticket.places.refusal = e
            if isinstance(e, QueueShareFull):
                self.share_refused += 1
            elif isinstance(e, QueueFull):
                self.refused += 1
            if isinstance(e, QueueFull):
                for lease in paused:  # refused after all: the jobs it would have paused run on
                    lease.preempt = False
                    self.flex_preemptions -= 1
            note_admission(False, e.code, str(e), never_fits=isinstance(e, (QueueNeverFits, DeadlineInfeasible)))
            raise
        if job not in self._pending:  # with no chain at all it is not admitted yet: a stream held back stays so, and
            note_admission(True)  # becomes the 503 it ends in if no chain comes (not a 200 with an error event)
        self._note_queue()
        if self.priorities is not None and job not in self._running:
            self._preempt_for_priority()
        if not job.requeue and not joined:
            self._new_waiters.add(job)
        try:
            lease = await fut
            note_admission(True)  # a job that waited in _pending (no-op if decided)
            return lease
        except BaseException:  # its request went away, or was refused while it waited (refuse_waiting)
            self._waiters.pop(job, None)
            if job in self._lane:
                self._lane.remove(job)
            elif job in self._picky:
                self._picky.remove(job)
            elif job in self._pending:
                self._pending.remove(job)
            elif job in self._running:  # started in the turn its waiter went: served nothing
                lease = self._running[job]
                if self.shares is not None:
                    self.shares.refund(job, chain_key(lease.chain), gone=True)
                self.release(lease)
            elif self.dispatcher is not None:
                self.dispatcher.remove_job(job)
            if self._promised:  # a job marked to pause for this one runs on (its next step may come first)
                self._settle_promises()
            raise
        finally:
            self._new_waiters.discard(job)

    def refuse_waiting(self, refusal: Callable[[], BaseException]) -> int:
        """Answer every new job waiting for a chain with ``refusal()`` raised from its :meth:`acquire`, now, and each
        new job that comes later at once (the orchestrator stops: a queued request hung until the process was
        gone). The jobs of requests being served wait on and run within the grace: re-queued ones (a failover, a
        pause) and later jobs of an admitted request (choices of n > 1, other prompts: refusing one failed the whole
        request, its answered part too). Returns how many waiting jobs were refused."""
        self.refusal = refusal
        refused = 0
        for job, fut in list(self._waiters.items()):
            if job in self._new_waiters and not fut.done():
                fut.set_exception(refusal())
                refused += 1
        return refused

    def release(self, lease: Lease) -> None:
        """The job of ``lease`` is done with its chain: start the next queued job there."""
        if lease.released:
            return
        lease.released = True
        self._running.pop(lease.job, None)
        on_chain = self._running_by_chain.get(lease.chain_id)
        if on_chain is not None:
            on_chain.discard(lease)
            if not on_chain:
                del self._running_by_chain[lease.chain_id]
        self._job_overhead(lease)
        if lease in self._carried:
            self._uncarry(lease)
        beneficiary = self._promised.pop(lease, None)
        if beneficiary is not None and beneficiary in self._waiters:
            # the slot goes to the queue's head, which may be another job: this one is owed the next promise freed
            self._owed.append(beneficiary)
        if lease.generation != self.generation or self.dispatcher is None:
            return
        freed = [lease.index, *lease.also]
        for k in freed:
            self._count(k, -1)
            guests = self._guests.get(k)
            if guests is not None:
                guests.discard(lease)
        if len(freed) > 1:  # a carried job's slots, freed at once: the fastest first (JFFC's choice; a job paused by
            freed.sort(key=lambda i: (self.chains[i].service_time, i))  # flex for the fast one got the slow one)
        for k in freed:
            self._slot_freed(k)

    def _slot_freed(self, k: int) -> None:
        """A slot of chain ``k`` (current plan) is free: the next waiting job takes it."""
        if self._carried and self._carry_into(k):
            return
        # A re-queued job takes the slot over (the dispatcher's count on this chain stays as it is): the first one
        # the queue's head does not go before (a job paused for it waits, not the re-queued jobs behind it)
        lane = next((j for j in self._lane if not self._deadline_before(j)), None)
        if lane is not None:
            self._lane.remove(lane)
            self._start(lane, k, queued=True)
            return
        picky = self._picky_for(k)
        if picky is not None:  # an adapter's job, first in line among those chain k serves: it takes the slot over
            self._picky.remove(picky)
            self._start(picky, k, queued=True)
            return
        nxt = self.dispatcher.complete(k)
        if nxt is not None:
            self._start(nxt, k, queued=True)

    def _carry_into(self, k: int) -> bool:
        """The freed slot of chain ``k`` goes to the first job (in :attr:`_carried`'s order) still to be counted on a
        server of ``k`` (the dispatcher's count of ``k`` stays as it is); True if one took it. O(hops of ``k``)."""
        first = None
        for server in self.chains[k].servers:  # each server's leases are in _carried's order: its first is its oldest
            on = self._carried_on.get(server)
            if on:
                lease = next(iter(on))
                if first is None or self._carried[lease][0] < self._carried[first][0]:
                    first = lease
        if first is None:
            return False
        self._counted_on(first, k)
        need = self._carried[first][1]
        for server in self.chains[k].servers:
            if server in need:
                need.discard(server)
                on = self._carried_on[server]
                del on[first]
                if not on:
                    del self._carried_on[server]
        if not need:
            del self._carried[first]
        return True

    def _deadline_before(self, job: DispatchJob) -> bool:
        """``job`` (re-queued) was paused for deadlines (``flex``) or for priority (``db``, ``mlfq``) and the queue's
        head goes before it: the head goes first (the re-queue lane otherwise goes before the queue)."""
        q = getattr(self.dispatcher, "queue", None)
        if not (job.yields and isinstance(q, EDFQueue) and len(q) > 0):
            return False
        if self.priorities is not None:
            return self._priority(q.peek()) < self._priority(job)
        return q.peek().order_key < job.order_key

    # ---- db, mlfq: preemptive priorities (seed 001) ------------------------------------------------
    def _priority(self, job: DispatchJob) -> float:
        """A job's place under ``--schedule db|mlfq`` (smaller first): ``O_r`` (db) or its level, then its arrival
        (mlfq); a starved job first of all."""
        if job.starved is not None:
            return STARVED_KEY + (job.starved - self._epoch)
        return self.priorities.key(job.sched) if job.sched is not None else math.inf

    def _promote_starved(self) -> None:
        """The starvation rule of ``mlfq`` (FastServe's: a job waiting longer than 2 x the mean execution time
        learnt goes back to the top queue) and of ``db`` (seed 001 Alg. 2 ``GetHighestPriorityOrStarvedRequest``,
        θ_s = 2·L̂_s), below. DB: while jobs
        of two or more services are about, the best waiting job of a service whose oldest waiting job has waited
        longer than θ_s goes first, the service waiting longest first (it takes the next slot that frees and
        pauses nobody, see :meth:`_preempt_for_priority`). One promoted job per service at a time; a job's wait
        counts from its arrival or its last pause. Once started, a promoted job is not paused for priority again:
        the seed's free preemption is a round trip here, and pausing it at the next better arrival undid the rule
        (measured: a promoted job paused 18 ms after it started, 254 pauses in two minutes with SmolLM2)."""
        now = time.monotonic()
        # every step of every running job asks: a look over the queue at most every STARVE_CHECK_S (θ_s is seconds)
        if not hasattr(self.priorities, "starved_among") or now - self._starve_checked < STARVE_CHECK_S:
            return
        self._starve_checked = now
        waiting = {id(j.sched): j for j in self.waiting_jobs() if j.sched is not None}
        running = {lease.job.sched.service for lease in self._running.values() if lease.job.sched is not None}
        promoted = {j.sched.service for j in waiting.values() if j.starved is not None}
        q = getattr(self.dispatcher, "queue", None) if self.dispatcher is not None else None
        for oldest, sched in self.priorities.starved_among([j.sched for j in waiting.values()], running, now):
            best = waiting[id(sched)]
            if self.schedule == "db" and sched.service in promoted:  # db: one promoted job per service at a time
                continue
            in_queue = isinstance(q, EDFQueue) and q.remove(best)  # before its key changes
            if self.schedule == "mlfq":  # FastServe: back to the top queue, FCFS there
                self.priorities.promote(sched)
            # first of all until it starts, pausing nobody, then protected (as the simulator, chainsim): a promoted
            # mlfq job that paused a demoted running one made that one starve in turn (35k pauses for 4.9k
            # requests in the simulator)
            best.starved = oldest
            self.starvation_promotions += 1
            if in_queue:
                q.push(best)  # its key changed
            elif best in self._lane:
                self._lane.sort(key=self._priority)
            logger.info("%s: job %s of %s starved (waited %.3g s): goes first", self.schedule, best.job_id,
                        sched.service, now - oldest)

    def new_priority_job(self, key: str, service: str, shape: tuple[int, int] | None = None) -> Any:
        """The discipline's record of a new job of ``service`` (None unless ``--schedule db|mlfq``): level 0, budget
        ``Q0_s = L̂_s + σ_s`` (db) or the top queue (mlfq). The job keeps it across pauses and failovers.
        ``shape``: (prompt tokens, max_tokens) of a one-shot job; with ``--schedule-classes`` its length class is
        part of its service (``model:class``). Sessions (no shape) stay the model's service."""
        if self.priorities is None:
            return None
        from petals_chain.algorithms.multimodel import Job

        if self.length_classes is not None and shape is not None:
            c = self.length_classes.observe(*shape)
            if self.length_classes.fitted:  # before the first fit the model is one service (no mixed class 0)
                model, service = service, f"{service}:{c}"
                self.priorities.monitor.start_from(service, model)  # a new class starts from its model's L̂, σ

        prefill_s = self.iterations.first_iteration_s(shape[0]) if self.iterations is not None and shape else 0.0
        job = Job(key=key, service=service, arrival=time.monotonic(), prefill_s=prefill_s)
        self.priorities.start(job, time.monotonic())
        return job

    def charge(self, lease: Lease, step_s: float, tokens: int = 1) -> None:
        """The job of ``lease`` ran one step of ``tokens`` positions for ``step_s`` s (0: a step that tells nothing
        of an iteration's time): the chain's observed step time for the deadline predictions (:meth:`_observe_step`);
        ``db``, ``mlfq``: its budget shrinks (and doubles, a level down, when used up); if a waiting job now goes
        before it, it gives its chain back at its next step."""
        self._observe_step(lease, step_s, tokens)
        if self._promised:
            self._settle_promises()  # a beneficiary that left the queue meanwhile: before the victim's next step
        if self.priorities is None or lease.job.sched is None:
            return
        if self.iterations is not None:
            self.iterations.observe(step_s, tokens)
            if self.iterations.decode_s:
                self.priorities.q1 = self.iterations.decode_s
        self.priorities.account(lease.job.sched, step_s)
        self._preempt_for_priority()

    def finished(self, sched: Any) -> None:
        """A job is done: its execution time feeds ``L̂_s`` and ``σ_s`` of its service."""
        if self.priorities is not None and sched is not None:
            self.priorities.monitor.observe(sched.service, sched.used)

    def kv_kept(self, lease: Lease, keeps: bool) -> None:
        """Whether every hop of ``lease``'s chain now keeps a paused job's KV (a hop moved to another server). A
        pause for priority marked while it kept it, and that would now recompute its whole history, is taken back
        (not counted) and the running jobs are weighed again."""
        lease.keeps_kv = bool(keeps)
        if (not keeps and lease.preempt and self.priorities is not None and not lease.released
                and lease not in self._promised):
            lease.preempt = False
            self.priority_preemptions -= 1
            self._preempt_for_priority()

    def _preempt_for_priority(self) -> None:
        """While jobs wait and no chain has room, mark the running job that goes last to give its chain back when
        the best waiting job goes before it by the discipline's margin (``worth_pausing``; one per waiting job)."""
        if self.priorities is None or self.dispatcher is None:
            return
        self._promote_starved()
        waiting = [j for j in self.waiting_jobs() if j.sched is not None]
        if not waiting:
            return
        running = [lease for lease in self._running.values() if lease.generation == self.generation]
        promised = sum(1 for lease in running if lease.preempt)
        if promised >= len(waiting):
            return
        # Seed 001 preempts for free; a chain that would recompute the paused job's history is not paused for
        # priority (its jobs finish, the queue's order still holds): on SmolLM2 with --kv-cache slots, pausing
        # there made DB 1.2x FCFS's normalized latency at overload, 1.6x when nothing queued for long
        candidates = [lease for lease in running if not lease.preempt and lease.keeps_kv and not lease.job.idle
                      and lease.job.sched is not None and not lease.job.protected]
        if not candidates:
            return
        best = min(waiting, key=self._priority)
        if best.starved is not None:
            # A starved job takes the next slot that frees, pausing nobody: at overload every service starves and
            # its pauses were most of DB's (70 of 112 with SmolLM2 at 3 req/s on three servers, DB 1.63x FCFS)
            return
        def rank(lease: Lease) -> tuple[float, float]:
            # the simulator's rule too (chainsim, pause rule "runtime"): the one that goes last, the newest on a tie
            # (by -started it was the lease that started first: the one with the most done)
            return self._priority(lease.job), lease.job.sched.arrival

        worst = None
        # a LoRA adapter's job takes only a slot of a chain serving it (paused elsewhere, a job paused for nobody):
        # where none of those may be paused for it, the next waiting job pauses one (the slot goes to the queue's
        # head), down to one without an adapter; stopping at the adapter's job, base jobs waited behind the jobs
        # far below them that it could not pause
        for best in sorted(waiting, key=self._priority) if best.adapter else (best,):
            usable = [lease for lease in candidates if self._may_run_on(best, lease.index)] if best.adapter \
                else candidates
            best_key = self._priority(best)
            worst = self.priorities.pause_victim(usable, best_key, rank)
            if worst is not None or not best.adapter:
                break
        if worst is not None:
            worst_key = self._priority(worst.job)
            worst.preempt = True
            self.priority_preemptions += 1
            logger.info("%s: job %s (priority %.4g) pauses job %s (priority %.4g) on chain %d", self.schedule,
                        best.job_id, best_key, worst.job.job_id, worst_key, worst.index)

    def _chain_load(self, k: int, ch: Chain, spj: float, idle: int, empty: bool = False) -> ChainLoad:
        """Chain ``k`` as the predictions see it, ``idle`` of its slots held by sessions between turns. Its steps are
        those observed (:meth:`_observe_step`) where seen, else the planner's (``T_k`` / ``spj``: a job alone): the
        new job's at the occupancy it would find (one more job, every slot busy at most); the rate slots free at
        while jobs queue (``job_s``) at a full chain's, plus the time a job holds its slot besides its steps
        (:meth:`_job_overhead`); and the new job's own wait for its chain to open (:meth:`_observe_step`). By the
        planner's alone, neither a full chain's slower steps (each batching ``c_k`` jobs) nor that time counted, and
        jobs admitted at overload missed (issue 18). ``empty``: as if no job ran on it (``idle`` 0), and it opened as
        fast as it was seen to (:meth:`~petals_chain.algorithms.edf.StepTimes.open_best_s`: not the waits for its
        servers' slots that load adds to the mean)."""
        capacity = max(0, int(ch.capacity) - idle)
        active = 0 if empty else max(0, self.active(k) + self._reserved.get(k, 0) - idle)  # a held slot is its job's
        planned = ch.service_time / spj
        if capacity == 0:
            return ChainLoad(capacity=0, active=active, job_s=ch.service_time, step_s=planned)
        cid = self.chain_ids[k]
        step = self.step_times.step_s(cid, min(capacity, active + 1), planned)
        full = self.step_times.step_s(cid, capacity, planned)
        opens = self.step_times.open_best_s(cid) if empty else self.step_times.open_s(cid)
        return ChainLoad(capacity=capacity, active=active, step_s=step, open_s=opens,
                         job_s=max(step, full) * spj + self.step_times.overhead_s(cid))

    def _observe_step(self, lease: Lease, step_s: float, tokens: int) -> None:
        """Learn the chain's time per token at the jobs stepping on it now (:class:`~petals_chain.algorithms.edf.
        StepTimes`): for a decode step (one token) the time since the job's previous step ended, so the head's
        sampling between two steps counts too (a job's tokens come that far apart), or ``step_s`` when it has none
        (its first step on this lease, or its turn's first: ``started`` moves then). A lease's first step also
        tells how long its chain took to open since it got its slot (:meth:`~petals_chain.algorithms.edf.StepTimes.
        open_s`)."""
        if lease.released:  # nothing releases it again: what is kept of it here would stay for good
            return
        now = time.monotonic()
        current = lease.generation == self.generation and 0 <= lease.index < len(self.chains) and not lease.carried
        span = self._lease_steps.get(lease)
        prev = None if span is None else span[1]
        if span is None or span[0] < lease.started:  # its first step, or its turn's first (a held session)
            began = now - max(0.0, step_s)
            self._lease_steps[lease] = [began, now]
            if span is None and current:  # (a held session's later turn opens nothing)
                self.step_times.observe_open(lease.chain_id, max(0.0, began - lease.started))
        else:
            span[1] = now
        if tokens != 1 or step_s <= 0 or not current:
            return
        k = lease.index
        period = step_s if prev is None or prev < lease.started else max(step_s, now - prev)
        idle = sum(1 for other in self._running_by_chain.get(lease.chain_id, ())
                   if other.job.idle and other.generation == self.generation and other.index == k)
        # and the sessions of other chains counted here (carried over a re-plan), held between turns as well
        idle += sum(1 for other in self._guests.get(k, ()) if other.job.idle)
        jobs, cid = self.active(k) - idle, self.chain_ids[k]
        # a gap between two steps that is no step (a session turn cut outside its steps, then retried: the time
        # between turns) is taken at GAP_FACTOR x the step known at most: a chain that really slowed is still learnt
        # within a few steps, a gap of minutes no longer refuses every deadline job on the chain
        known = self.step_times.step_s(cid, jobs, self.chains[k].service_time / self._steps_per_job())
        self.step_times.observe(cid, jobs, min(period, GAP_FACTOR * known))

    def _steps_per_job(self) -> float:
        """The planner's steps per job (at least 1): a chain's planned step is ``T_k`` over it."""
        return max(1.0, float(self.steps_per_job()))

    def _idle_by_chain(self) -> dict[int, int]:
        """Chain index -> sessions of the current plan holding a slot there between turns (not stepping: a slot
        freed at no known time)."""
        idle: dict[int, int] = {}
        for lease in self._running.values():
            if lease.job.idle and lease.generation == self.generation:
                for k in (lease.index, *lease.also):  # a place it holds on each chain it is counted on
                    idle[k] = idle.get(k, 0) + 1
        return idle

    def _job_overhead(self, lease: Lease) -> None:
        """``lease`` is released: learn how long its job held the slot besides its steps (opening the chain before
        the first, closing it after the last), which slows the rate a chain's slots free at as much as its steps
        do. Not for a job that never stepped, nor a session's (held between turns, not stepping)."""
        span = self._lease_steps.pop(lease, None)
        if (span is None or span[0] < lease.started or lease.job.idle or lease.generation != self.generation
                or lease.carried or not 0 <= lease.index < len(self.chain_ids)):
            return
        # (a session's turn cut between two steps gives its chain back at once, or holds it marked idle: sessions.py)
        held = time.monotonic() - lease.started
        self.step_times.observe_overhead(self.chain_ids[lease.index], held - (span[1] - span[0]))

    def _loads(self, job: DispatchJob) -> tuple[list[ChainLoad], int]:
        """The chains as :func:`~petals_chain.algorithms.edf.predict` sees them, and how many jobs are served before
        ``job``: the re-queue lane and, in the queue, every job (``fcfs``), those with an earlier or equal deadline
        (``edf``, ``flex``) or those a client-fair ``--fairness`` serves first (:meth:`ClientShares.ahead`)."""
        chains = self._serving_loads(job, self._chain_loads())
        q = getattr(self.dispatcher, "queue", None) if self.dispatcher is not None else None
        # jobs paused for deadlines wait in the lane behind every deadline (see _deadline_before)
        ahead = sum(1 for j in self._lane if not j.yields or j.order_key <= job.order_key) + len(self._pending)
        if self.schedule in ("edf", "flex") and isinstance(q, EDFQueue):
            ahead += q.ahead_of(job.order_key)
        elif q is not None and self.shares is not None and self.shares.central:
            # the fairness policy's order, not FIFO's: a light client's job goes before a heavy client's backlog.
            # Running jobs' output still to come is not passed: it is charged as it is generated, while slots free,
            # so counting it all before this job's turn made a client's own long generation refuse its next request
            # per-chain policies (d2lpm, d-vtc, rr-lpm): the jobs bound to the chain it would be bound to, in its
            # order; lpm: the jobs matching each chain's prefix at least as much as it (ClientShares.ahead_bound)
            bound = self.shares.ahead_bound(job, self.dispatcher, [c.capacity / c.job_s if c.capacity > 0 and
                                                                    c.job_s > 0 else 0.0 for c in chains])
            ahead += self.shares.ahead(job, (j for j in q if j is not job)) if bound is None else bound
        else:
            ahead += self.queue_length - len(self._pending)
        return chains, ahead

    def _serving_loads(self, job: DispatchJob, loads: list[ChainLoad]) -> list[ChainLoad]:
        """``loads`` as ``job`` may use them: for a LoRA adapter's job, the chains not serving it without slots (it
        never starts there; counted, its deadline was judged by a free chain it could not take, and flex paused a job
        there for it, freeing a slot it could not use)."""
        if not job.adapter:
            return loads
        serving = set(self._adapter_chains(job.adapter))
        return [c if k in serving else replace(c, capacity=0, active=0) for k, c in enumerate(loads)]

    def _may_run_on(self, job: DispatchJob, k: int) -> bool:
        """Whether ``job`` may run on chain ``k`` (every server of it serves its LoRA adapter, if it names one)."""
        return not job.adapter or (self.serves_adapter is not None and 0 <= k < len(self.chains)
                                   and self.serves_adapter(self.chains[k], job.adapter))

    def _chain_loads(self, empty: bool = False) -> list[ChainLoad]:
        """The current chains as the predictions see them (:meth:`_chain_load`); ``empty``: every one idle."""
        spj = self._steps_per_job()
        idle = {} if empty else self._idle_by_chain()
        return [self._chain_load(k, ch, spj, idle.get(k, 0), empty) for k, ch in enumerate(self.chains)]

    @staticmethod
    def _deadlines(job: DispatchJob, first_token: bool = True) -> dict[str, float]:
        """``job``'s deadlines as the predictions take them; ``first_token=False``: its last token's alone (a later
        choice of ``n``: the request's first token is the first choice's)."""
        dl = job.deadline
        if dl is None:
            return {"ttft_deadline": math.inf, "deadline": math.inf}
        return {"ttft_deadline": dl.ttft_deadline if first_token else math.inf, "deadline": dl.deadline}

    def predict(self, job: DispatchJob, now: float | None = None, *, first_token: bool = True) -> Prediction:
        """When ``job`` would get its first and last token if it arrived now (:func:`~petals_chain.algorithms.edf.
        predict`, with the jobs :meth:`_loads` counts before it)."""
        chains, ahead = self._loads(job)
        now = time.monotonic() if now is None else now
        start = self._start_chain(job, chains, now if first_token else None)
        return predict(now, chains, ahead, job.output_tokens, siblings=job.siblings, start=start,
                       **self._deadlines(job, first_token))

    def _predict_idle(self, job: DispatchJob, now: float) -> Prediction:
        """:meth:`predict` with every chain idle (no queue, no running job, no session holding a slot, each opening as
        fast as it was seen to): doomed, the deadline is missed however idle the swarm. Its first token on the chain
        that gives it soonest (where JFFC starts a job with a TTFT deadline that meets it there, :meth:`_fits`), so it
        is not later than the system."""
        return predict(now, self._serving_loads(job, self._chain_loads(empty=True)), 0, job.output_tokens,
                       siblings=job.siblings, **self._deadlines(job))

    def _start_chain(self, job: DispatchJob, chains: list[ChainLoad], now: float | None) -> int | None:
        """The chain ``job`` would start on now if it has a free slot, as :meth:`_arrive` starts it (a chain it prefers,
        :meth:`_preferred_pick`, else JFFC's: :meth:`JFFCDispatcher.peek` with :meth:`_fits`): its first token comes
        there, however soon another would give it. None if none or not known (a fairness policy or a per-chain
        baseline picks by its own rule). ``now``: None for a job whose first token is not its own (a later choice)."""
        if self.dispatcher is None or (self.shares is not None and self.shares.central):
            return None
        if job.adapter:  # as _start_picky starts it
            return next((k for k in self._adapter_chains(job.adapter) if self._room(k) > 0), None)
        fits = None if now is None else self._fits(job, now, chains)
        k = self._preferred_pick(job, fits)
        if k is not None:
            return k
        return self.dispatcher.peek(fits) if isinstance(self.dispatcher, JFFCDispatcher) else None

    def _fits(self, job: DispatchJob, now: float | None = None,
              chains: list[ChainLoad] | None = None) -> Callable[[int], bool] | None:
        """For a job with a TTFT deadline still to meet, dispatched by JFFC: whether starting it now on chain ``k``
        meets its deadlines by the prediction (:func:`~petals_chain.algorithms.edf.meets_on`), which JFFC's choice
        and the prediction's take (a TTFT deadline that JFFC's fastest free chain misses by its opening was refused
        while another free chain met it). None for every other job: JFFC's own choice (Alg. 3)."""
        dl = job.deadline
        if (dl is None or not math.isfinite(dl.ttft_deadline) or dl.first_token_at is not None or job.requeue
                or job.checked or not isinstance(self.dispatcher, JFFCDispatcher)
                or (self.shares is not None and self.shares.central)):
            return None
        t = time.monotonic() if now is None else now
        loads = chains

        def fits(k: int) -> bool:
            nonlocal loads
            # the loads read at the first call, in the step that starts the job (O(chains + running jobs)): none when
            # no chain is free, as for every job a re-plan re-queues behind the free slots (1000 queued on 100 chains
            # took 0.46 s of the event loop per re-plan, 3 ms without TTFT deadlines)
            if loads is None:
                loads = self._chain_loads()
            return 0 <= k < len(loads) and meets_on(t, loads[k], job.output_tokens, ttft_deadline=dl.ttft_deadline,
                                                    deadline=dl.deadline)
        return fits

    def _remaining(self, lease: Lease, chains: list[ChainLoad], now: float) -> float | None:
        """Seconds until a running job frees its slot if left to run (at most its ``expected_output`` tokens);
        None for one of another plan's chains or held between turns (no known time)."""
        if lease.generation != self.generation or not 0 <= lease.index < len(chains) or lease.job.idle:
            return None
        return (1 + lease.job.expected_output) * chains[lease.index].step_s - (now - lease.started)

    def _misses_waiting(self, job: DispatchJob, *, first_token: bool = True) -> bool:
        """True if ``job`` misses a deadline waiting for a slot that the running jobs free when their remaining work
        (at most their ``expected_output`` tokens) is done
        (:func:`~petals_chain.algorithms.edf.predict_from_running`)."""
        chains, ahead = self._loads(job)
        now = time.monotonic()
        # a job carried over a re-plan holds a slot on each chain it is counted on, all freed when it is done
        # (of those an adapter's job may use: _serving_loads; a job without one reads no adapter, the hot path)
        remaining = [r for lease in self._running.values() if (r := self._remaining(lease, chains, now)) is not None
                     for k in (lease.index, *lease.also) if not job.adapter or self._may_run_on(job, k)]
        return predict_from_running(now, chains, remaining, ahead, job.output_tokens, siblings=job.siblings,
                                    **self._deadlines(job, first_token)).doomed

    def _pause_for(self, job: DispatchJob, *, first_token: bool = True) -> list[Lease] | None:
        """``--schedule flex``: mark running jobs without a deadline to give their chain back at their next step,
        if that lets ``job`` (and its later choices) meet its deadlines (:func:`~petals_chain.algorithms.edf.
        flex_victim`); their leases, None if no pause saves it."""
        chains, ahead = self._loads(job)
        now = time.monotonic()
        promised: dict[int, int] = {}
        running = []
        others: list[list[float]] = [[] for _ in chains]  # jobs that free their slots only when done
        for lease in self._running.values():
            if lease.generation != self.generation:
                continue
            # a job carried over a re-plan is counted on each chain of ``also`` too: its pause frees a slot on each
            # (of those an adapter's job may use: _serving_loads)
            held = (lease.index, *lease.also)
            if job.adapter:  # a job without one reads no adapter (the hot path)
                held = tuple(k for k in held if self._may_run_on(job, k))
            if lease.preempt:
                for k in held:
                    promised[k] = promised.get(k, 0) + 1
                continue
            left = self._remaining(lease, chains, now)
            if lease.job.preemptible and not lease.job.idle:
                running.extend(Preemptible(chain=k, started=lease.started, ref=lease,
                                           remaining_s=math.inf if left is None else left) for k in held)
            elif left is not None:
                for k in held:
                    others[k].append(left)
        if not running:
            return None
        found = flex_victim(now, chains, running, ahead, job.output_tokens, siblings=job.siblings,
                            promised=[promised.get(k, 0) for k in range(len(chains))],
                            remaining=others if job.siblings else None, **self._deadlines(job, first_token))
        if found is None:
            return None
        # one slot for this job now; a later choice pauses its own when it comes (flex_victim found enough for all)
        victims = [v.ref for v in found[0][:1]]
        for victim in victims:
            victim.preempt = True
            self._promised[victim] = job
            self.flex_preemptions += 1
            logger.info("flex: job %s pauses job %s on chain %d (predicted last token in %.2f s)", job.job_id,
                        victim.job.job_id, victim.index, found[1].total_s)
        return victims

    def _settle_promises(self) -> None:
        """``--schedule flex``: one job marked to pause per deadline job still waiting for the slot it frees. A job
        that no longer waits (it started on a slot freed otherwise, or left the queue) hands its promise to a job
        whose promised slot another took (:attr:`_owed`), else the promise is taken back: the marked job runs on
        and its pause is not counted. (Left marked, it paused for nobody, and the marked slot counted as free for
        the next deadline job.)"""
        self._owed = [j for j in self._owed if j in self._waiters]
        for victim, job in list(self._promised.items()):
            if victim.released or not victim.preempt:  # taken back already (the deadline job refused after all)
                del self._promised[victim]
            elif victim.generation != self.generation:  # its chain was re-planned away: its pause frees nothing here
                del self._promised[victim]
                victim.preempt = False
                self.flex_preemptions -= 1
                if job in self._waiters:
                    self._owed.append(job)
            elif job in self._waiters:
                continue
            elif self._owed:
                self._promised[victim] = self._owed.pop(0)
            else:
                del self._promised[victim]
                victim.preempt = False
                self.flex_preemptions -= 1
                logger.info("flex: job %s no longer waits for the slot of job %s on chain %d: that one runs on",
                            job.job_id, victim.job.job_id, victim.index)

    def waiting_jobs(self) -> list[DispatchJob]:
        """Jobs waiting for a chain (queue, jobs waiting for a first plan, re-queue lane, adapters' jobs)."""
        return [*self._queued_jobs(), *self._lane, *(j for j in self._picky if j.requeue)]

    def snapshot(self) -> list[dict]:
        return [
            {"id": self.chain_ids[k], "index": k, "active": self.active(k), "capacity": ch.capacity,
             "max_active": self.peak_active(k)}
            for k, ch in enumerate(self.chains)
        ]

