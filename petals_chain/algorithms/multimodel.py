"""Several models in one swarm (seed 001, SeaLLM): DB scheduling, placement by unserved index, adaptive replacement.

Pure (no torch, no I/O, no asyncio): the simulator (``petals_chain.sim.multimodel``) and the orchestrator drive
the same objects. Section, equation and algorithm numbers are the seed's (``docs/scheduling-seeds.md`` §1).

Vocabulary. A *service* ``s`` is a model plus a request class (any hashable; by default the model's name;
:class:`LengthClasses` gives the seed's classes, K-means clusters of request lengths). A
*sharing group* is one chain: it runs steps (one prefill or decode iteration of every request in its batch) and
asks its :class:`Scheduler` before every step which requests run (preemption at step granularity). Times are
seconds of execution on the chain that runs the request (the caller may normalize them to a reference speed);
``L̂_s`` and ``σ_s`` are the mean and standard deviation of a service's execution time without queueing.

Schedulers (``SCHEDULES``, the orchestrator's ``--schedule db|fcfs|mlfq``), all behind one interface
(:meth:`Scheduler.arrive`, :meth:`Scheduler.select`, :meth:`Scheduler.charge`, :meth:`Scheduler.complete`):

* ``db`` — doubling budget (§4.2, Eq. 7, Alg. 2): :class:`DBScheduler`.
* ``fcfs`` — first come first served, non-preemptive continuous batching (SeaLLM-F, AlpaServe, vLLM).
* ``mlfq`` — FastServe's skip-join multi-level feedback queue (SeaLLM-M): :class:`MLFQScheduler`.

Placement (§4.1, Eq. 6, Alg. 1): :func:`place_by_unserved_index` gives every volunteer server one model; inside
a model the blocks are placed by GBP-CR and chains formed by GCA (:func:`model_chains`). Replacement (§4.3,
Eq. 8): :class:`AdaptiveInterval`, :class:`MixDriftDetector` and :func:`moves_that_pay`. Metrics (Eq. 1, Eq. 5):
:func:`normalized_latency`, :func:`slo_attainment`, :func:`p99`.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from petals_chain.algorithms.gbp_cr import gbp_cr
from petals_chain.algorithms.gca import gca
from petals_chain.model import Chain, ModelSpec, ServerSpec

SCHEDULES = ("db", "fcfs", "mlfq")
ALPHA = 1e-4  # weight of L_N^s in the unserved index (Eq. 6, §6.1)
BETA = 0.1  # interval step and tolerance (Eq. 8, §6.1)
SLO_SCALE = 5.0  # SLO = 5 x the request's execution time (§6.1)
SWAP_MARGIN = 0.05  # servers swapped between two models in one re-plan must save > 5 % of the interval's cost
MIN_SWAP_GAIN = 1.0  # ... and more than this (the unserved index: one request's SLO miss) per swapped pair
# (neither in the seed: moves_that_pay)
STARVE_FACTOR = 2.0  # [gap] starvation threshold theta_s = 2 L̂_s
# with one service about, a paused job that waited JOB_STARVE_FACTOR x theta_s goes first (a backstop, not a second order)
JOB_STARVE_FACTOR = 4.0
PAUSE_FACTOR = 2.0  # DB pauses a running job for one of at most half its O_r (one budget doubling; PAUSE_RULES)
# When select pauses a running job: "runtime" as the orchestrator does (Scheduler.pause_victim: a running job keeps
# its place unless a waiting one goes before it by the discipline's margin, worth_pausing; a starved job takes the
# next free place and pauses nobody; a job started because it starved is not paused again), "seed" on any priority
# inversion (seed 001 Alg. 2, where preemption is free)
PAUSE_RULES = ("runtime", "seed")
UNPLACED_LN = 1e4  # L_N^s counted for a service with no complete chain (all its requests are unserved)


# ------------------------------------------------------------------------------------------ service stats


class ServiceStats:
    """``L̂_s`` and ``σ_s`` of one service's execution time (s, without queueing) over the last ``window``
    completed requests; the profiled ``prior`` (mean, std) until ``min_samples`` were seen (the seed's profiler /
    service monitor, §3). ``σ_s`` is the standard deviation (the seed's "standard variance" [gap])."""

    def __init__(self, prior_mean: float, prior_std: float = 0.0, *, window: int = 512, min_samples: int = 16):
        if not (prior_mean > 0 and math.isfinite(prior_mean)) or not (prior_std >= 0 and math.isfinite(prior_std)):
            raise ValueError(f"prior must be a positive mean and a std >= 0, got ({prior_mean!r}, {prior_std!r})")
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self.prior_mean, self.prior_std = float(prior_mean), float(prior_std)
        self.window, self.min_samples = int(window), int(min_samples)
        self._xs: deque[float] = deque()
        self._sum = self._sq = 0.0

    def observe(self, exec_s: float) -> None:
        """One completed request took ``exec_s`` seconds of execution."""
        x = float(exec_s)
        if not (x >= 0 and math.isfinite(x)):
            raise ValueError(f"execution time must be finite and >= 0, got {exec_s!r}")
        self._xs.append(x)
        self._sum += x
        self._sq += x * x
        if len(self._xs) > self.window:
            y = self._xs.popleft()
            self._sum -= y
            self._sq -= y * y

    @property
    def count(self) -> int:
        return len(self._xs)

    @property
    def total_s(self) -> float:
        """Execution seconds of the requests in the window."""
        return self._sum

    @property
    def mean(self) -> float:
        """``L̂_s`` (s)."""
        if len(self._xs) < self.min_samples:
            return self.prior_mean
        return max(self._sum / len(self._xs), 1e-9)

    @property
    def std(self) -> float:
        """``σ_s`` (s), population standard deviation of the window."""
        n = len(self._xs)
        if n < self.min_samples:
            return self.prior_std
        return math.sqrt(max(self._sq / n - (self._sum / n) ** 2, 0.0))

    @property
    def base_budget(self) -> float:
        """``Q0_s = L̂_s + σ_s`` (s)."""
        return self.mean + self.std


class ServiceMonitor:
    """Per-service :class:`ServiceStats`; a service not profiled yet gets ``default`` (mean, std) as its prior."""

    def __init__(self, priors: Mapping[Hashable, tuple[float, float]] | None = None, *,
                 default: tuple[float, float] = (1.0, 0.0), window: int = 512, min_samples: int = 16):
        self.default = default
        self.window, self.min_samples = window, min_samples
        self.stats: dict[Hashable, ServiceStats] = {}
        for s, (m, sd) in (priors or {}).items():
            self.stats[s] = ServiceStats(m, sd, window=window, min_samples=min_samples)

    def __getitem__(self, service: Hashable) -> ServiceStats:
        st = self.stats.get(service)
        if st is None:
            st = self.stats[service] = ServiceStats(*self.default, window=self.window, min_samples=self.min_samples)
        return st

    def observe(self, service: Hashable, exec_s: float) -> None:
        self[service].observe(exec_s)

    def pooled_mean(self) -> float:
        """The mean execution time over every service's window (s); the default prior's mean before any sample."""
        n = sum(st.count for st in self.stats.values())
        if n == 0:
            return float(self.default[0])
        return sum(st.total_s for st in self.stats.values()) / n

    def start_from(self, service: Hashable, parent: Hashable) -> None:
        """A ``service`` not seen yet takes ``parent``'s learnt (mean, std) as its prior (a length class starts
        from its model's numbers rather than ``default``)."""
        if service not in self.stats and parent in self.stats:
            p = self.stats[parent]
            self.stats[service] = ServiceStats(p.mean, p.std, window=self.window, min_samples=self.min_samples)


def length_features(input_tokens: int, output_tokens: int) -> tuple[float, float]:
    """A request's point in the length space the classes are clustered in: (log input, log output) tokens."""
    return math.log(max(1, int(input_tokens))), math.log(max(1, int(output_tokens)))


class LengthClasses:
    """Request classes by length: the seed's services (§6.1: a K-means cluster of (input len, output len)), learnt
    online from the requests seen (scheduling-seeds.md §1.9: "otherwise an online length cluster").

    Points are :func:`length_features` of (input tokens, declared output tokens: ``max_tokens`` at run time, the
    output in the simulator, as the seed clusters known lengths). :meth:`fit` runs Lloyd's K-means from ``k``
    distinct points at the quantiles of size (log input + log output), drops clusters left empty, and orders the
    centroids by size, so class 0 is the shortest and a refit keeps each class's meaning (the
    :class:`ServiceMonitor` keyed by it stays valid).
    :meth:`observe` records an arrival, refits every ``refit_every`` arrivals over the last ``window`` once
    ``min_samples`` were seen, and returns the arrival's class; until the first fit every request is class 0.
    ``k = 1`` is one class (a service per model)."""

    def __init__(self, k: int = 4, *, window: int = 2048, refit_every: int = 128, min_samples: int = 64,
                 iters: int = 50):
        if k < 1 or window < 1 or refit_every < 1 or min_samples < 1 or iters < 1:
            raise ValueError("k, window, refit_every, min_samples and iters must be >= 1")
        self.k, self.window, self.refit_every = int(k), int(window), int(refit_every)
        self.min_samples, self.iters = max(int(min_samples), int(k)), int(iters)
        self._seen: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._since_fit = 0
        self.centroids: np.ndarray | None = None  # (k', 2), k' <= k, ordered by size
        self.fits = 0

    def fit(self, points: Iterable[tuple[float, float]]) -> np.ndarray:
        """K-means of ``points`` (:func:`length_features`); sets and returns the centroids, shortest first."""
        x = np.asarray(list(points), dtype=float).reshape(-1, 2)
        if len(x) == 0:
            raise ValueError("no points to fit")
        # start from k distinct points at the quantiles of size (repeated points would give twin centroids)
        u = np.unique(x, axis=0)
        u = u[np.argsort(u.sum(axis=1), kind="stable")]
        k = min(self.k, len(u))
        c = u[((np.arange(k) + 0.5) * len(u) / k).astype(int)]
        for _ in range(self.iters):
            lab = np.argmin(((x[:, None, :] - c[None]) ** 2).sum(axis=2), axis=1)
            keep = [j for j in range(len(c)) if np.any(lab == j)]  # an empty cluster is dropped
            nc = np.array([x[lab == j].mean(axis=0) for j in keep])
            if len(nc) == len(c) and np.allclose(nc, c):
                break
            c = nc
        self.centroids = c[np.argsort(c.sum(axis=1), kind="stable")]
        self.fits += 1
        return self.centroids

    @property
    def fitted(self) -> bool:
        """Whether there are classes yet (a fit that found at least two)."""
        return self.centroids is not None and len(self.centroids) >= 2

    def classify(self, input_tokens: int, output_tokens: int) -> int:
        """The class of a request of these lengths (0 until :attr:`fitted`)."""
        if not self.fitted:
            return 0
        p = np.asarray(length_features(input_tokens, output_tokens))
        return int(np.argmin(((self.centroids - p) ** 2).sum(axis=1)))

    def observe(self, input_tokens: int, output_tokens: int) -> int:
        """Record an arriving request and return its class (refitting first when one is due)."""
        if self.k > 1:
            self._seen.append(length_features(input_tokens, output_tokens))
            self._since_fit += 1
            if len(self._seen) >= self.min_samples and (self.centroids is None or self._since_fit >= self.refit_every):
                self.fit(self._seen)
                self._since_fit = 0
        return self.classify(input_tokens, output_tokens)

    def describe(self) -> dict[str, object]:
        """The classes for an operator: centroids as (input, output) tokens, shortest first."""
        cs = [] if self.centroids is None else [[round(math.exp(a)), round(math.exp(b))] for a, b in self.centroids]
        return {"k": self.k, "fits": self.fits, "seen": len(self._seen), "centroids_tokens": cs}


# ------------------------------------------------------------------------------------------- scheduling


@dataclass(eq=False)
class Job:
    """A request as a scheduler sees it. ``key``: the caller's handle; ``prefill_s``: estimated time of its first
    iteration (MLFQ's skip-join). The scheduler keeps the rest: ``level`` (DB's ``k_r``, MLFQ's queue),
    ``budget`` (DB's ``Q_r``, MLFQ's quantum left, s), ``priority`` (DB's ``O_r``), ``used`` (execution seconds
    charged), ``waiting_since`` (arrival or the end of its last step) and ``running`` (in the last batch)."""

    key: Hashable
    service: Hashable
    arrival: float
    prefill_s: float = 0.0
    level: int = 0
    budget: float = math.nan
    priority: float = math.nan
    used: float = 0.0
    steps: int = 0
    waiting_since: float = math.nan
    running: bool = False
    starved: bool = False  # put first by the starvation rule, until it starts
    protected: bool = False  # started because it starved: not paused for priority again (pause rule "runtime")


class Scheduler:
    """The queue discipline of one sharing group (chain). Drive it as::

        sched.arrive(job, now)                 # a request is dispatched to this group
        batch = sched.select(capacity, now)    # before every step: the jobs that run it (<= capacity)
        ...                                    # run the step (jobs in sched.preempted left the batch: pause them)
        sched.charge(batch, step_s, now)       # after the step: each job in it used step_s seconds
        sched.complete(job, now)               # a job finished (its ``used`` feeds the service monitor)

    ``remove(job)`` takes a job away without completing it (migration to another group; re-``arrive`` it there:
    its level and budget are kept). ``pauses``: when :meth:`select` pauses a running job (:data:`PAUSE_RULES`)."""

    name = "?"

    def __init__(self, monitor: ServiceMonitor | None = None, *, pauses: str = "seed"):
        if pauses not in PAUSE_RULES:
            raise ValueError(f"unknown pause rule {pauses!r}; choose from {', '.join(PAUSE_RULES)}")
        self.monitor = monitor if monitor is not None else ServiceMonitor()
        self.pauses = pauses
        self.jobs: dict[int, Job] = {}
        self.preempted: list[Job] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, job: Job) -> bool:
        return id(job) in self.jobs

    def arrive(self, job: Job, now: float) -> None:
        if id(job) in self.jobs:
            raise ValueError(f"job {job.key!r} is already here")
        job.waiting_since = now
        job.running = False
        self._init(job, now)
        self.jobs[id(job)] = job

    def _init(self, job: Job, now: float) -> None:
        pass

    def _order(self, now: float) -> list[Job]:
        raise NotImplementedError

    def _lead(self, ordered: list[Job]) -> Job:
        """The job whose kind a one-kind step runs (``select``'s ``one_of``): the first in this discipline's order."""
        return ordered[0]

    def select(self, capacity: int, now: float, fits: Callable[[Job, Sequence[Job]], bool] | None = None,
               one_of: Callable[[Job], Hashable] | None = None) -> list[Job]:
        """The jobs that run the next step, at most ``capacity``; ``preempted``: those that ran the last step and do
        not run this one. ``fits(job, ahead)`` is asked about each job that did not run the last step, in priority
        order: whether the group has room for it beside the jobs ``ahead`` of it in the batch (KV pages; it may
        reserve them); a job that does not fit is skipped (the seed's ``EnoughResource``). ``one_of(job)``: a step
        runs jobs of one kind only (the LLM, where a group time-shares several: one model's weights per iteration):
        the kind of :meth:`_lead`'s job, else (none of its jobs fits) the next kind by its first job in the order,
        so the group never idles while a kind could run (a kind whose jobs all fail ``fits`` reserved nothing).

        Which running jobs stay follows :attr:`pauses`: ``seed``, the first ``capacity`` jobs of the order (a
        running job leaves on any inversion); ``runtime``, running jobs keep their places, free places go to the
        waiting jobs in order, then each waiting job in order takes the place of the running job that goes last
        while :meth:`pause_victim` allows (not for a starved job, nor from a protected one)."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        # the runtime rule reads which jobs starve (a starved job that starts is protected) even with room for all
        ordered = len(self.jobs) > capacity or fits is not None or one_of is not None or self.pauses == "runtime"
        jobs = self._order(now) if ordered else list(self.jobs.values())
        if self.pauses == "runtime":
            # as the orchestrator's queue: a job the starvation rule put first stays first until it starts
            first = [j for j in jobs if j.starved and not j.running]
            if first:
                ids = set(map(id, first))
                jobs = sorted(first, key=lambda j: j.waiting_since) + [j for j in jobs if id(j) not in ids]
        groups = [jobs]
        if one_of is not None and jobs:
            lead = one_of(self._lead(jobs))
            kinds = [lead, *(k for k in dict.fromkeys(map(one_of, jobs)) if k != lead)]
            groups = [[j for j in jobs if one_of(j) == k] for k in kinds]
        batch: list[Job] = []
        for group in groups:
            batch = self._fill(group, capacity, fits) if self.pauses == "seed" else self._keep(group, capacity, fits)
            if batch:
                break
        chosen = set(map(id, batch))
        self.preempted = [j for j in self.jobs.values() if j.running and id(j) not in chosen]
        for j in self.preempted:
            j.running = False
            j.waiting_since = now
        for j in batch:
            if not j.running and j.starved:
                j.starved, j.protected = False, self.pauses == "runtime"
            j.running = True
        return batch

    @staticmethod
    def _fill(group: list[Job], capacity: int, fits: Callable[[Job, Sequence[Job]], bool] | None) -> list[Job]:
        """The first ``capacity`` jobs of ``group`` that run or fit (pause rule ``seed``)."""
        if fits is None:
            return group[:capacity]
        batch: list[Job] = []
        for j in group:
            if len(batch) >= capacity:
                break
            if j.running or fits(j, batch):
                batch.append(j)
        return batch

    def _keep(self, group: list[Job], capacity: int, fits: Callable[[Job, Sequence[Job]], bool] | None) -> list[Job]:
        """Pause rule ``runtime``: ``group``'s running jobs stay, free places go to its waiting jobs in order, then
        waiting jobs take running ones' places as :meth:`pause_victim` allows."""
        batch = [j for j in group if j.running][:capacity]
        waiting = [j for j in group if not j.running]
        left: list[Job] = []  # waiting jobs that did not get a place, in order
        for i, j in enumerate(waiting):
            if len(batch) >= capacity:
                left += waiting[i:]  # (not one by one: the queue may be thousands long, and this runs every step)
                break
            if fits is None or fits(j, batch):
                batch.append(j)
            else:
                left.append(j)
        for j in left:
            if j.starved:
                break  # a starved job takes the next place that frees (as the orchestrator: it pauses nobody)
            victim = self.pause_victim([k for k in batch if k.running and not k.protected], self.key(j),
                                       lambda k: (self.key(k), k.arrival))
            if victim is None:
                break  # the next waiting job goes after this one: no running job is worth pausing for it either
            rest = [k for k in batch if k is not victim]
            if fits is not None and not fits(j, rest):
                break
            batch = [*rest, j]
        return batch

    def pause_victim(self, running: Iterable[Any], waiting_key: float,
                     rank: Callable[[Any], tuple[float, ...]]) -> Any | None:
        """The running job to pause for a waiting job of :meth:`key` ``waiting_key``, or None: the one that goes
        last by ``rank`` (its key first, then a tie-break: the newest goes last), if the waiting one goes before it
        by this discipline's margin (:meth:`worth_pausing`). The orchestrator's rule (``--schedule db|mlfq``) and
        the simulator's under pause rule ``runtime``."""
        worst = max(running, key=rank, default=None)
        if worst is None:
            return None
        k = rank(worst)[0]
        return worst if k > waiting_key and self.worth_pausing(k, waiting_key) else None

    def charge(self, batch: Iterable[Job], step_s: float, now: float) -> None:
        """Each job of ``batch`` used ``step_s`` seconds of execution in the step that ended at ``now``."""
        for j in batch:
            j.used += step_s
            j.steps += 1
            j.waiting_since = now
            self._charged(j, step_s)

    def _charged(self, job: Job, step_s: float) -> None:
        pass

    def complete(self, job: Job, now: float, exec_s: float | None = None) -> None:
        """``job`` finished; its execution time (default: what it was charged) updates ``L̂_s``, ``σ_s``."""
        self.jobs.pop(id(job))
        job.running = False
        self.monitor.observe(job.service, job.used if exec_s is None else exec_s)

    def remove(self, job: Job) -> None:
        self.jobs.pop(id(job))
        job.running = False

    # The runtime (orchestrator/dispatch.py) keeps its own queue and asks only for the discipline's numbers:
    def start(self, job: Job, now: float) -> None:
        """Set ``job``'s level, budget and priority as :meth:`arrive` does, without holding it here."""
        job.waiting_since = now
        self._init(job, now)

    def account(self, job: Job, step_s: float) -> None:
        """``job`` (not held here) used ``step_s`` seconds of execution, as :meth:`charge` counts it."""
        job.used += step_s
        job.steps += 1
        self._charged(job, step_s)

    def key(self, job: Job) -> float:
        """Where ``job`` goes in a queue ordered by this discipline (smaller first; ties by arrival)."""
        return job.arrival

    def worth_pausing(self, running: float, waiting: float) -> bool:
        """At run time, where a pause is a round trip and may cost a recompute (the simulator's preemption is
        free): pause the running job of :meth:`key` ``running`` for the waiting one of key ``waiting``. Here: on
        any inversion."""
        return running > waiting


class FCFSScheduler(Scheduler):
    """First come first served with continuous batching: running jobs keep their place (never preempted, except
    that LLMs time-sharing a group run one per step: the oldest job's), free places go to the earliest arrivals
    (SeaLLM-F; the paper's JFFC queue)."""

    name = "fcfs"

    def _order(self, now: float) -> list[Job]:
        return sorted(self.jobs.values(), key=lambda j: (not j.running, j.arrival))

    def _lead(self, ordered: list[Job]) -> Job:
        return min(ordered, key=lambda j: j.arrival)  # the oldest job's kind runs (its place, not a running job's)

    def worth_pausing(self, running: float, waiting: float) -> bool:
        """Never: a running job keeps its place (the orchestrator's fcfs pauses nobody either)."""
        return False


class DBScheduler(Scheduler):
    """Doubling-budget scheduling (§4.2, Eq. 7, Alg. 2).

    * Arrival: ``k_r = 0``, ``Q_r = Q0_s = L̂_s + σ_s``, priority ``O_r = Q_r · L̂_s`` (Eq. 7 with the remaining
      budget as ``T'_r``); smallest ``O_r`` runs first.
    * After each step: ``Q_r -= step_s``; when ``Q_r <= 0``: ``k_r += 1`` and ``Q_r = 2^k_r · Q0_s`` [gap: the seed
      writes only the first doubling, ``2(L̂_s + σ_s)``, then says "double again each time": geometric]. The
      overshoot of the step that exhausted the budget is not carried over (as the seed's reset). ``O_r`` is then
      recomputed with the current ``L̂_s``; ``Q0_s`` is read when the budget is (re)set, so online profiling
      changes only budgets set later.
    * Starvation [gap]: service ``s`` is starved when its longest-waiting job (not in the last batch) has waited
      more than ``θ_s = starve_factor · L̂_s`` since its arrival or its last step; starved services go first,
      longest-waiting first, each contributing its min-``O`` waiting job; the rest of the batch by ``O``. The rule
      orders services, so it applies only while the group holds requests of two services or more.
    * Preemption: re-ranked before every step; a running job leaves the batch only for a strictly smaller
      ``O`` (ties keep running jobs, then the earlier arrival), so a pause happens only on a priority inversion.
    * Departures from Alg. 2 (documented): one batch may mix services and phases (petals servers batch sessions
      themselves; the seed's one-service-one-phase batches exist because SeaLLM time-shares GPUs between models,
      which a petals chain never does); no skip-and-reinsert loop is needed (Alg. 2 l. 17-20 [gap]: as printed it
      never advances on a mismatch)."""

    name = "db"

    def __init__(self, monitor: ServiceMonitor | None = None, *, starve_factor: float | None = STARVE_FACTOR,
                 pauses: str = "seed"):
        super().__init__(monitor, pauses=pauses)
        self.starve_factor = starve_factor

    def _init(self, job: Job, now: float) -> None:
        if math.isnan(job.budget):  # a migrated job keeps (k_r, Q_r)
            job.level = 0
            job.budget = self.monitor[job.service].base_budget
        job.priority = job.budget * self.monitor[job.service].mean

    def _charged(self, job: Job, step_s: float) -> None:
        job.budget -= step_s
        if job.budget <= 0:
            job.level += 1
            job.budget = (2 ** job.level) * self.monitor[job.service].base_budget
        job.priority = job.budget * self.monitor[job.service].mean

    def key(self, job: Job) -> float:
        return job.priority

    def worth_pausing(self, running: float, waiting: float) -> bool:
        """Only for a job of at most ``1 / PAUSE_FACTOR`` of the running job's ``O_r``: one budget doubling apart,
        so a job demoted a level still pauses for a new job of its own service, while near-equal priorities (two
        services' new jobs, a job resumed after a pause) never pause each other: each such pause cost a round trip
        and a recompute on another chain for nothing (SmolLM2: 100 pauses in two minutes, some 10 % apart)."""
        return running >= PAUSE_FACTOR * waiting

    def starved(self, now: float) -> list[Job]:
        """The min-``O`` waiting job of every starved service, the longest-waiting service first."""
        waiting = [j for j in self.jobs.values() if not j.running]
        running = {j.service for j in self.jobs.values() if j.running}
        return [best for _, best in self.starved_among(waiting, running, now)]

    def starved_among(self, waiting: Iterable[Job], running: Iterable[Hashable],
                      now: float) -> list[tuple[float, Job]]:
        """The starvation rule over ``waiting`` jobs (held here or not) with jobs of the ``running`` services
        running: ``(oldest waiting_since, min-O waiting job)`` of every service whose oldest waiting job has
        waited more than ``θ_s = starve_factor · L̂_s``, the longest-waiting service first. With one service about
        that job would be the one its order runs next anyway, so the rule takes the paused job (one that has run)
        waiting longest once it has waited ``JOB_STARVE_FACTOR · θ_s``: else a long request, demoted below every
        new one of its service, stalled mid-stream for good (a single-model swarm with ``--schedule-classes 1``, or
        jobs all of one length class). Jobs not started yet are left to the order (promoting them too made DB
        first-come-first-served under overload)."""
        if self.starve_factor is None:
            return []
        oldest: dict[Hashable, float] = {}
        first: dict[Hashable, Job] = {}  # the paused job (one that ran) waiting longest, per service
        best: dict[Hashable, Job] = {}
        for j in waiting:
            s = j.service
            if j.waiting_since < oldest.get(s, math.inf):
                oldest[s] = j.waiting_since
            if j.steps and j.waiting_since < getattr(first.get(s), "waiting_since", math.inf):
                first[s] = j
            b = best.get(s)
            if b is None or (j.priority, j.arrival) < (b.priority, b.arrival):
                best[s] = j
        if len(set(oldest) | set(running)) < 2:
            since, pick = {s: j.waiting_since for s, j in first.items()}, first
            factor = JOB_STARVE_FACTOR * self.starve_factor
        else:
            since, pick, factor = oldest, best, self.starve_factor
        out = sorted((s for s, t in since.items() if now - t > factor * self.monitor[s].mean), key=since.get)
        return [(since[s], pick[s]) for s in out]

    def _order(self, now: float) -> list[Job]:
        first = self.starved(now)
        if self.pauses == "runtime":
            # As the orchestrator (DispatchManager._promote_starved): one promoted job per service at a time, first
            # until it starts (select puts it there); the service's other jobs keep their places by O_r. Promoting
            # every step's min-O job too, a job of a starved service that had waited 0.1 s went first and was then
            # never paused for priority.
            promoted = {j.service for j in self.jobs.values() if j.starved and not j.running}
            for j in first:
                if j.service not in promoted:
                    j.starved = True
                    promoted.add(j.service)
            return sorted(self.jobs.values(), key=lambda j: (j.priority, not j.running, j.arrival))
        ids = set(map(id, first))
        rest = sorted((j for j in self.jobs.values() if id(j) not in ids),
                      key=lambda j: (j.priority, not j.running, j.arrival))
        return first + rest


class IterationTimes:
    """What one iteration of a chain takes, learnt from the steps jobs run (moving averages, weight ``alpha``): a
    decode step (one token, s) and the extra time per prompt token of a prefill (s). Skip-join MLFQ at run time
    takes ``q_1`` from the first (FastServe: about one decode iteration) and each new job's first-iteration time
    (``prefill_s``, the level it joins) from both."""

    def __init__(self, alpha: float = 0.1):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = float(alpha)
        self.decode_s: float | None = None
        self.per_token_s: float | None = None

    def _avg(self, old: float | None, x: float) -> float:
        return x if old is None else old + self.alpha * (x - old)

    def observe(self, seconds: float, tokens: int) -> None:
        """A step that computed ``tokens`` positions took ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0) or tokens < 1:
            return
        if tokens == 1:
            self.decode_s = self._avg(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.per_token_s = self._avg(self.per_token_s, max(0.0, seconds - self.decode_s) / (tokens - 1))

    def first_iteration_s(self, prompt_tokens: int) -> float:
        """The estimated time of a new job's first iteration (its prefill; 0 before any step was seen)."""
        if self.decode_s is None:
            return 0.0
        return self.decode_s + (self.per_token_s or 0.0) * max(0, int(prompt_tokens) - 1)


class MLFQScheduler(Scheduler):
    """FastServe's skip-join MLFQ (SeaLLM-M; [outside] FastServe §4): ``levels`` queues with quanta
    ``q_i = q_1 · 2^i`` (``i`` = 0 highest; ``q_1`` ≈ one decode iteration, s). A new job joins the highest queue
    whose quantum covers its first iteration (``prefill_s``), skipping the ones above; it drops one level each
    time it uses up its quantum; FCFS inside a queue; preempted at step boundaries; a job waiting longer than
    ``starve_s`` since its last step goes back to the top queue (``starve_factor`` x the pooled mean execution time
    the monitor learnt when ``starve_s`` is None; neither: never)."""

    name = "mlfq"

    def __init__(self, monitor: ServiceMonitor | None = None, *, q1: float = 0.03, levels: int = 16,
                 starve_s: float | None = None, starve_factor: float | None = None, pauses: str = "seed"):
        super().__init__(monitor, pauses=pauses)
        if not (q1 > 0) or levels < 1:
            raise ValueError("q1 must be > 0 and levels >= 1")
        self.q1, self.levels, self.starve_s = float(q1), int(levels), starve_s
        self.starve_factor = starve_factor

    def starve_threshold(self) -> float | None:
        """Seconds of waiting after which a job goes back to the top queue (None: never)."""
        if self.starve_s is not None:
            return self.starve_s
        return None if self.starve_factor is None else self.starve_factor * self.monitor.pooled_mean()

    def starved_among(self, waiting: Iterable[Job], running: Iterable[Hashable],
                      now: float) -> list[tuple[float, Job]]:
        """``(waiting_since, job)`` of the ``waiting`` jobs (held here or not) below the top queue that waited
        longer than :meth:`starve_threshold`, longest first (``running`` is unused: FastServe's rule is per job).
        Move each to the top with :meth:`promote`."""
        limit = self.starve_threshold()
        if limit is None:
            return []
        out = [(j.waiting_since, j) for j in waiting if j.level > 0 and now - j.waiting_since > limit]
        out.sort(key=lambda x: x[0])
        return out

    def promote(self, job: Job) -> None:
        """Back to the top queue with its full quantum."""
        job.level, job.budget = 0, self.quantum(0)

    def quantum(self, level: int) -> float:
        return self.q1 * 2 ** level

    def join_level(self, prefill_s: float) -> int:
        """Skip-join: the highest queue whose quantum is at least the first iteration's time."""
        for i in range(self.levels):
            if self.quantum(i) >= prefill_s:
                return i
        return self.levels - 1

    def _init(self, job: Job, now: float) -> None:
        if math.isnan(job.budget):
            job.level = self.join_level(job.prefill_s)
            job.budget = self.quantum(job.level)

    def _charged(self, job: Job, step_s: float) -> None:
        job.budget -= step_s
        if job.budget <= 0:
            job.level = min(job.level + 1, self.levels - 1)
            job.budget = self.quantum(job.level)

    def worth_pausing(self, running: float, waiting: float) -> bool:
        """Only for a job a level above (never inside a level, where the order is FCFS)."""
        return math.floor(running) > math.floor(waiting)

    def key(self, job: Job) -> float:
        """Its level, then its arrival (FCFS inside a queue, as :meth:`_order`, also in a queue that breaks ties by
        insertion: a job promoted back to the top goes before younger ones). ``arrival · 2^-32`` stays under one
        level for 136 years of seconds and keeps arrivals 15 us apart distinct up to level 15."""
        return job.level + job.arrival * 2.0 ** -32

    def _order(self, now: float) -> list[Job]:
        for _, j in self.starved_among([j for j in self.jobs.values() if not j.running], (), now):
            self.promote(j)
            # Pause rule "runtime": first until it starts, pausing nobody, then protected, as DB's promoted jobs and
            # as the orchestrator's: a promoted job that paused a demoted running one made that one starve in turn
            # (in this simulator, before: 35k pauses for 4.9k requests).
            j.starved = True
        return sorted(self.jobs.values(), key=lambda j: (j.level, j.arrival))


def make_scheduler(name: str, monitor: ServiceMonitor | None = None, **kw) -> Scheduler:
    """``db|fcfs|mlfq`` (``--schedule``); ``kw`` go to the scheduler (``pauses``; ``starve_factor``; ``q1``,
    ``levels``, ``starve_s``, ``starve_factor``)."""
    if name == "db":
        return DBScheduler(monitor, **kw)
    if name == "fcfs":
        return FCFSScheduler(monitor, pauses=kw.get("pauses", "seed"))  # db's and mlfq's other kw mean nothing to fcfs
    if name == "mlfq":
        return MLFQScheduler(monitor, **kw)
    raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")


# ---------------------------------------------------------------------------------------------- metrics


def normalized_latency(latency_s: Sequence[float], service_exec_s: Sequence[float]) -> float:
    """Eq. 1 per request: ``mean_r(L_r / L̂_{s(r)})`` ([gap] sum vs mean: the mean, as §6.1 reports it).
    ``service_exec_s[i]``: ``L̂_s`` of request ``i``'s service."""
    x, n = np.asarray(latency_s, dtype=float), np.asarray(service_exec_s, dtype=float)
    if len(x) != len(n):
        raise ValueError("latency and L̂ must have the same length")
    return float(np.mean(x / n)) if len(x) else math.nan


def slo_attainment(latency_s: Sequence[float], exec_s: Sequence[float], scale: float = SLO_SCALE) -> float:
    """Eq. 5: the fraction of requests with ``L_r < SLO_r``, ``SLO_r = scale`` x the request's own execution
    time ([gap] Fig. 10 uses the service mean; §6.1 the request's)."""
    x, e = np.asarray(latency_s, dtype=float), np.asarray(exec_s, dtype=float)
    if len(x) != len(e):
        raise ValueError("latency and execution times must have the same length")
    return float(np.mean(x < scale * e)) if len(x) else math.nan


def p99(latency_s: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(latency_s, dtype=float), 99)) if len(latency_s) else math.nan


def on_time_upper_bound(arrival_s: Sequence[float], deadline_s: Sequence[float], work_s: Sequence[float],
                        capacity: float, *, grid_s: float = 1.0, max_window_s: float = 60.0) -> int:
    """An upper bound on how many requests *any* schedule finishes by their deadlines, whatever its order,
    preemptions or batching, when request ``i`` needs at least ``work_s[i]`` seconds of a resource that supplies
    ``capacity`` seconds per second (e.g. chains x speed; ``work_s`` a lower bound such as its share of full-batch
    steps).

    The requests that arrive and are due inside a window ``[t1, t2]`` must all be served inside it, so at most the
    largest number of them whose smallest works fit in ``capacity · (t2 - t1)`` can be on time. These limits hold
    together over disjoint windows; the bound is ``N`` minus the largest total overflow over a set of disjoint
    windows on a ``grid_s`` grid, each at most ``max_window_s`` long (dynamic programming over the grid). A smaller
    grid or longer windows give a tighter (lower) bound."""
    arr = np.asarray(arrival_s, dtype=float)
    due = np.asarray(deadline_s, dtype=float)
    work = np.asarray(work_s, dtype=float)
    if not (len(arr) == len(due) == len(work)):
        raise ValueError("arrival, deadline and work must have the same length")
    if not (np.isfinite(arr).all() and np.isfinite(due).all() and np.isfinite(work).all() and (work >= 0).all()):
        raise ValueError("arrival, deadline and work must be finite, work >= 0")
    if not (capacity > 0 and grid_s > 0 and max_window_s >= grid_s):
        raise ValueError("need capacity > 0, grid_s > 0 and max_window_s >= grid_s")
    # due before arriving (or at arrival with work to do): never on time, and kept out of the windows, where such a
    # request could fall inside two of them
    possible = (due > arr) | ((due == arr) & (work == 0))
    arr, due, work = arr[possible], due[possible], work[possible]
    n = len(arr)
    if n == 0:
        return 0
    order = np.argsort(arr, kind="stable")
    arr, due, work = arr[order], due[order], work[order]
    t0 = math.floor(float(arr[0]) / grid_s) * grid_s
    grid = t0 + grid_s * np.arange(int(math.ceil((float(due.max()) - t0) / grid_s)) + 1)
    span = max(1, int(max_window_s / grid_s + 1e-9))
    slack = 1e-9 * capacity * max(1.0, abs(float(grid[-1])))  # rounding of the grid's differences at large times
    best = np.zeros(len(grid))  # best[j]: the largest overflow of disjoint windows inside [grid[0], grid[j]]
    into: list[list[tuple[int, int]]] = [[] for _ in grid]  # into[j]: (i, overflow of [grid[i], grid[j]])
    for i in range(len(grid) - 1):
        lo = int(np.searchsorted(arr, grid[i], side="left"))
        hi = int(np.searchsorted(arr, grid[i] + span * grid_s, side="right"))
        if hi <= lo:
            continue
        by_due = np.argsort(due[lo:hi], kind="stable")
        d, w = due[lo:hi][by_due], work[lo:hi][by_due]
        for j in range(i + 1, min(len(grid), i + span + 1)):
            k = int(np.searchsorted(d, grid[j], side="right"))
            if k == 0:
                continue
            fit = int(np.searchsorted(np.cumsum(np.sort(w[:k])), capacity * (grid[j] - grid[i]) + slack,
                                      side="right"))
            if k > fit:
                into[j].append((i, k - fit))
    for j in range(1, len(grid)):
        best[j] = max([best[j - 1]] + [best[i] + over for i, over in into[j]])
    return int(n - best[-1])


# -------------------------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Volunteer:
    """A volunteer server: ``memory`` (the unit of the models' ``block_memory``), ``speed`` (1 = the reference
    hardware the models' ``block_time`` is measured on) and ``tau_c`` (s per job, its link to the orchestrator)."""

    name: str
    memory: float
    speed: float = 1.0
    tau_c: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or not (self.memory >= 0 and self.speed > 0 and self.tau_c >= 0):
            raise ValueError(f"bad volunteer {self!r}")


@dataclass(frozen=True)
class ServedModel:
    """A model and its traffic: ``num_blocks`` ``L``, ``block_memory`` ``s_m`` and ``cache_memory`` ``s_c`` (per
    block per job), ``block_time`` (s per block per job on speed-1 hardware), ``rate`` ``λ_s`` (req/s),
    ``exec_s`` ``L̂_s`` (mean execution time of a request on a reference chain, s; default ``L · block_time``),
    ``c`` the concurrency GBP-CR plans each chain for, ``slo_scale`` the SLO in multiples of the execution time."""

    name: str
    num_blocks: int
    block_memory: float
    cache_memory: float
    block_time: float
    rate: float = 0.0
    exec_s: float | None = None
    c: int = 8
    slo_scale: float = SLO_SCALE

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.num_blocks, self.block_memory, self.cache_memory)

    @property
    def mean_exec_s(self) -> float:
        return self.exec_s if self.exec_s is not None else self.num_blocks * self.block_time

    def with_rate(self, rate: float) -> "ServedModel":
        return ServedModel(self.name, self.num_blocks, self.block_memory, self.cache_memory, self.block_time, rate,
                           self.exec_s, self.c, self.slo_scale)

    def can_hold(self, server: Volunteer) -> bool:
        """``CanAllocate``: the server holds at least one block with one cache slot (Eq. 3)."""
        return server.memory >= self.block_memory + self.cache_memory


def server_specs(servers: Iterable[Volunteer], model: ServedModel) -> list[ServerSpec]:
    """The servers in seed 000's terms for ``model``: ``tau_p = block_time / speed``."""
    return [ServerSpec(s.name, s.memory, s.tau_c, model.block_time / s.speed) for s in servers]


def model_chains(servers: Sequence[Volunteer], model: ServedModel) -> list[Chain]:
    """Chains of ``model`` on ``servers`` (all of them serving it): GBP-CR (Alg. 1 of seed 000, every server that
    holds a block takes part) places the blocks for concurrency ``c``, GCA (Alg. 2) forms chains. Empty when the
    servers cannot cover all ``L`` blocks."""
    fit = [s for s in servers if model.can_hold(s)]
    if not fit:
        return []
    specs = server_specs(fit, model)
    placement = gbp_cr(specs, model.spec, model.c, max(model.rate, 1e-9), use_all_servers=True)
    if not placement:
        return []
    return gca(specs, model.spec, placement)


@dataclass(frozen=True)
class ModelEstimate:
    """Predicted performance of one model over a history window: ``requests``, ``misses`` (expected SLO misses),
    ``norm_latency`` (``L_N^s``) and the unserved index ``ui`` (Eq. 6)."""

    requests: float
    misses: float
    norm_latency: float
    ui: float

    @property
    def slo_attainment(self) -> float:
        return 1.0 - self.misses / self.requests if self.requests > 0 else 1.0


def erlang_c(servers: int, load: float) -> float:
    """Probability of waiting in M/M/``servers`` with offered load ``load = λ/μ`` (1 when ``load >= servers``)."""
    if servers <= 0 or load >= servers:
        return 1.0
    if load <= 0:
        return 0.0
    # sum_{k<c} a^k/k! and a^c/c! via a stable recurrence
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= load / k
        total += term
        if k > load and 2 * load < servers and term < total * 1e-18:
            # the terms left, a^c/c! with them, are below 1e-18 of the sum (c/(c - a) < 2): no wait. O(a), not O(c):
            # a server record announcing 10**30 bytes of memory made c ~10**12 and froze the orchestrator's loop
            return 0.0
    last = term * load / servers
    top = last * servers / (servers - load)
    return top / (total + top)


def estimate_model(model: ServedModel, chains: Sequence[Chain], horizon_s: float, *, alpha: float = ALPHA) -> ModelEstimate:
    """An M/M/C estimate of ``model`` on ``chains`` over ``horizon_s`` seconds of its traffic (the placement's fast
    stand-in for the seed's simulator; a caller may supply its own ``evaluate``): ``C = Σ c_k`` slots served at
    the capacity-weighted mean rate ``μ = Σ c_k/T_k / C``. A request's execution on chain ``k`` takes
    ``x L̂_s`` with ``x = T_k / (L · block_time)`` (the chain's slowness against the reference; capacity-weighted
    mean); it misses its SLO when ``x L̂_s + W > slo_scale · L̂_s`` (Erlang C, exponential wait tail);
    ``L_N^s = x + E[W] / L̂_s`` (at most ``U/2``, ``U`` = :data:`UNPLACED_LN`). No complete chain: every request is
    unserved, ``L_N^s = U``; ``λ >= ν = Σ c_k/T_k``: every request is unserved, ``L_N^s = U (1 - ν / 2λ)``."""
    n = model.rate * horizon_s
    C = sum(ch.capacity for ch in chains)
    if not chains or C <= 0:
        return ModelEstimate(n, n, UNPLACED_LN, n + alpha * UNPLACED_LN)
    nu = sum(ch.capacity / ch.service_time for ch in chains)  # jobs/s with every slot busy
    mu = nu / C
    ref = model.num_blocks * model.block_time
    x = sum(ch.capacity / ch.service_time * ch.service_time / ref for ch in chains) / nu
    load = model.rate / mu
    if model.rate >= nu:
        # Overloaded: every request misses, as with no chain. L_N lies between a stable plan's (capped at U/2 below)
        # and an unplaced model's U, falling as the capacity ν grows: a server that only makes an overload smaller
        # still lowers the index (counted alike, no overloaded model would ever be given a server that leaves it
        # overloaded).
        ln = UNPLACED_LN * (1.0 - nu / (2.0 * model.rate))
        return ModelEstimate(n, n, ln, n + alpha * ln)
    pw = erlang_c(C, load)
    gap = max(nu - model.rate, 1e-12)
    wait = pw / gap
    slack = (model.slo_scale - x) * model.mean_exec_s  # the wait a request can afford
    miss = 1.0 if slack <= 0 else pw * math.exp(-gap * slack)
    ln = min(x + wait / model.mean_exec_s, UNPLACED_LN / 2)  # E[W] grows without bound as λ -> ν
    return ModelEstimate(n, n * miss, ln, n * miss + alpha * ln)


PLACEMENT_RULES = ("most_unserved", "largest_gain")
Assignment = Mapping[str, str]  # server name -> model name
Evaluate = Callable[[Mapping[str, Sequence[Volunteer]]], Mapping[str, ModelEstimate]]


def analytic_evaluate(models: Sequence[ServedModel], horizon_s: float, alpha: float = ALPHA) -> Evaluate:
    """``evaluate(servers per model) -> {model: ModelEstimate}`` by :func:`estimate_model` on GBP-CR/GCA chains."""
    by_name = {m.name: m for m in models}
    # a pure function of (model, its servers): the placement's search asks again for every group but the one it
    # just changed (each a GBP-CR + GCA; with hundreds of servers the re-plan took seconds on the event loop)
    memo: dict[tuple, ModelEstimate] = {}

    def estimate(name: str, m: ServedModel, group: Sequence[Volunteer]) -> ModelEstimate:
        key = (name, tuple(group))
        if key not in memo:
            memo[key] = estimate_model(m, model_chains(group, m), horizon_s, alpha=alpha)
        return memo[key]

    def evaluate(groups: Mapping[str, Sequence[Volunteer]]) -> dict[str, ModelEstimate]:
        return {name: estimate(name, m, groups.get(name, ())) for name, m in by_name.items()}

    return evaluate


def groups_of(assignment: Assignment, servers: Sequence[Volunteer]) -> dict[str, list[Volunteer]]:
    """Servers per model (in the order of ``servers``)."""
    out: dict[str, list[Volunteer]] = {}
    for s in servers:
        m = assignment.get(s.name)
        if m is not None:
            out.setdefault(m, []).append(s)
    return out


def place_by_unserved_index(servers: Sequence[Volunteer], models: Sequence[ServedModel], *,
                            horizon_s: float = 600.0, alpha: float = ALPHA, evaluate: Evaluate | None = None,
                            fixed: Assignment | None = None, rule: str = "most_unserved",
                            allowed: Mapping[str, Collection[str]] | None = None) -> dict[str, str]:
    """Which model each server serves, by the unserved index (§4.1, Eq. 6, Alg. 1).

    Repeat until no server can be added: estimate ``UI_s = #SLO misses + α · L_N^s`` of every model on the partial
    plan (``evaluate``, default :func:`analytic_evaluate` over ``horizon_s`` of traffic; a model without a complete
    chain counts all its requests as unserved), then visit the servers by ascending request rate already placed on
    them and, within a server, the models by descending ``UI_s``; the first pair where the server can hold the
    model (``CanAllocate``: one block and one cache slot) is added. As the seed's §3 gives a newly registered
    service its minimum group first, a model with traffic (requests in the estimate, or a rate: a short history may
    hold none of a bursty model's requests) and no complete chain is served before the others: the pair is sought
    among those models first.

    ``rule``: ``most_unserved`` (the seed's: the server goes to the model with the highest ``UI_s``) or
    ``largest_gain`` (to the model whose ``UI_s`` it lowers most; ours). Alg. 1's rule keeps feeding a model whose
    misses stay many whatever it is given (a bursty one) while one server would clear another model's queue: on the
    Azure traces at rho 0.5 it gave chat 1 server of 8 (chat at 2x its capacity), where 2 serve it with no miss.
    ``largest_gain`` is myopic and meant for the simulated index: the M/M/C estimate counts an overload as all
    missed until it clears, so a model short of several servers gains almost nothing from one (rates 4.5 and 0.6
    req/s on six 1-req/s servers: 4 + 2, the first still overloaded, where Alg. 1 gives 5 + 1).

    Petals mapping: a *group* is one volunteer server and holds exactly one model (the seed's TP group partition
    becomes GBP-CR's spans inside the model, done by :func:`model_chains`), so only unassigned servers (rate 0)
    are candidates; ties between them go to the fastest, then the largest, then the first listed. ``fixed``:
    servers whose model is already decided (kept as they are). ``allowed``: the models a server listed there may take
    (those it offers and can load); one listed with none is left unplaced."""
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ValueError("duplicate server names")
    mnames = [m.name for m in models]
    if len(set(mnames)) != len(mnames):
        raise ValueError("duplicate model names")
    if rule not in PLACEMENT_RULES:
        raise ValueError(f"rule must be one of {PLACEMENT_RULES}, got {rule!r}")
    evaluate = evaluate or analytic_evaluate(models, horizon_s, alpha)

    def fits(s: Volunteer, m: ServedModel) -> bool:
        return m.can_hold(s) and (allowed is None or s.name not in allowed or m.name in allowed[s.name])

    plan: dict[str, str] = {k: v for k, v in (fixed or {}).items() if k in set(names) and v in set(mnames)}
    position = {name: i for i, name in enumerate(names)}
    free = sorted((s for s in servers if s.name not in plan), key=lambda s: (-s.speed, -s.memory, position[s.name]))
    chained: dict[tuple, bool] = {}  # (model, its servers) -> has a complete chain: asked again each round

    def has_chain(m: ServedModel, group: Sequence[Volunteer]) -> bool:
        key = (m.name, tuple(group))
        if key not in chained:
            chained[key] = bool(model_chains(group, m))
        return chained[key]

    while free:
        groups = groups_of(plan, servers)
        est = evaluate(groups)
        order = sorted(models, key=lambda m: (-est[m.name].ui, mnames.index(m.name)))
        # §3: a service with traffic first gets the minimum it needs, one complete chain, before any service gets
        # more; else a model whose misses outnumber another's requests (bursts no capacity absorbs) takes all
        unplaced = [m for m in order if (est[m.name].requests > 0 or m.rate > 0)
                    and not has_chain(m, groups.get(m.name, ()))]
        pair = next(((s, m) for s in free for m in unplaced if fits(s, m)), None)
        if pair is None and rule == "largest_gain":
            gains = []
            for i, m in enumerate(order):
                s = next((s for s in free if fits(s, m)), None)
                if s is not None:
                    after = evaluate(groups_of({**plan, s.name: m.name}, servers))[m.name].ui
                    gains.append((est[m.name].ui - after, -i, s, m))
            pair = max(gains, key=lambda g: g[:2])[2:] if gains else None
        if pair is None:
            pair = next(((s, m) for s in free for m in order if fits(s, m)), None)
        if pair is None:
            break
        plan[pair[0].name] = pair[1].name
        free.remove(pair[0])
    return plan


def even_split(servers: Sequence[Volunteer], models: Sequence[ServedModel]) -> dict[str, str]:
    """No placement (SeaLLM-P, vLLM): the servers dealt round-robin to the models that fit them."""
    plan: dict[str, str] = {}
    k = 0
    for s in servers:
        for _ in range(len(models)):
            m = models[k % len(models)]
            k += 1
            if m.can_hold(s):
                plan[s.name] = m.name
                break
    return plan


# ------------------------------------------------------------------------------------------ replacement


@dataclass(frozen=True)
class PlanMetrics:
    """What Eq. 8 compares: SLO attainment and normalized latency of one interval."""

    slo_attainment: float
    norm_latency: float


class AdaptiveInterval:
    """The replacement interval ``I_t`` (§4.3, Eq. 8): after interval ``t``, ``I_{t+1} = (1 - β) I_t`` when the
    relative error ``|M_real - M_est| / M_est`` exceeds ``β``, ``(1 + β) I_t`` when it is below ``β``.

    [gap] ``M`` holds SLO attainment and normalized latency: shrink when either error exceeds ``β``, grow when
    both are below it, keep ``I_t`` otherwise (an error exactly ``β``); clamped to ``[min_s, max_s]`` (not in the
    paper). ``initial_s`` = ``I_0`` [gap: 10 min]."""

    def __init__(self, initial_s: float = 600.0, *, beta: float = BETA, min_s: float = 30.0, max_s: float = 3600.0):
        if not 0 < beta < 1:
            raise ValueError("beta must be in (0, 1)")
        if not 0 < min_s <= initial_s <= max_s:
            raise ValueError("need 0 < min_s <= initial_s <= max_s")
        self.interval, self.beta, self.min_s, self.max_s = float(initial_s), float(beta), float(min_s), float(max_s)
        self.history: list[tuple[float, float]] = []  # (relative error, interval after)

    @staticmethod
    def relative_error(real: PlanMetrics, est: PlanMetrics) -> float:
        """The larger of the two metrics' ``|real - est| / est`` (inf when an estimate is 0 and the real is not)."""
        errs = []
        for r, e in ((real.slo_attainment, est.slo_attainment), (real.norm_latency, est.norm_latency)):
            errs.append(abs(r - e) / abs(e) if e else (0.0 if r == e else math.inf))
        return max(errs)

    def update(self, real: PlanMetrics, est: PlanMetrics) -> float:
        """The next interval (s) from the interval that just ended."""
        err = self.relative_error(real, est)
        if err > self.beta:
            self.interval *= 1.0 - self.beta
        elif err < self.beta:
            self.interval *= 1.0 + self.beta
        self.interval = min(max(self.interval, self.min_s), self.max_s)
        self.history.append((err, self.interval))
        return self.interval


class MixDriftDetector:
    """Traffic-mix drift (ours, beside Eq. 8): the share of arrivals per model over the last ``window_s`` seconds
    against the shares the plan was made for; drift when their total variation distance exceeds ``threshold``
    (and at least ``min_arrivals`` arrived in the window), so a shift re-plans before the interval ends.

    Arrivals are counted per model in buckets of about ``window_s / BUCKETS`` (one entry per model and bucket, not
    one per arrival: memory and time grew with the request rate); the bucket the window's start cuts counts by the
    fraction of it inside the window (exact for arrivals spread evenly within a bucket)."""

    BUCKETS = 120

    def __init__(self, window_s: float = 60.0, threshold: float = 0.2, min_arrivals: int = 30):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s, self.threshold, self.min_arrivals = float(window_s), float(threshold), int(min_arrivals)
        # a power of two near window_s / BUCKETS: bucket edges are exact in binary floating point, so an arrival at
        # the window's start is in or out by its time alone (not by the rounding of a division)
        self.bucket_s = 2.0 ** round(math.log2(self.window_s / self.BUCKETS))
        # [bucket, model, arrivals] entries in the order their first arrival came; _open finds one by (bucket,
        # model) (the placement feeds each model's arrivals in turn, so a bucket may come again after a later one)
        self._events: deque[list] = deque()
        self._open: dict[tuple[int, str], list] = {}
        self.planned: dict[str, float] = {}

    def arrive(self, model: str, now: float) -> None:
        key = (math.floor(now / self.bucket_s), model)
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = [key[0], model, 0]
            self._events.append(entry)
        entry[2] += 1
        self._trim(now)  # a placement that never asks for the mix (even, static) must not keep every arrival

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._events and (self._events[0][0] + 1) * self.bucket_s <= cutoff:  # wholly before the window
            k, m, _ = self._events.popleft()
            del self._open[(k, m)]

    def _counts(self, now: float) -> dict[str, float]:
        """Arrivals per model in the window (a bucket the window's start cuts, by the fraction inside it)."""
        self._trim(now)
        cutoff = now - self.window_s
        out: dict[str, float] = {}
        for k, m, n in self._events:  # every entry: one fed late may sit behind newer ones
            lo = k * self.bucket_s
            inside = 1.0 if lo >= cutoff else max(0.0, (lo + self.bucket_s - cutoff) / self.bucket_s)
            if inside > 0:
                out[m] = out.get(m, 0.0) + n * inside
        return out

    def count(self, now: float) -> float:
        """Arrivals in the window (all models)."""
        return sum(self._counts(now).values())

    def mix(self, now: float) -> dict[str, float]:
        """Share of arrivals per model in the window."""
        counts = self._counts(now)
        total = sum(counts.values())
        return {m: n / total for m, n in counts.items()} if total > 0 else {}

    def rates(self, now: float) -> dict[str, float]:
        """Arrivals per second per model in the window."""
        return {m: n / self.window_s for m, n in self._counts(now).items()}

    def set_plan(self, mix: Mapping[str, float]) -> None:
        self.planned = dict(mix)

    def distance(self, now: float) -> float:
        cur = self.mix(now)
        keys = set(cur) | set(self.planned)
        return 0.5 * sum(abs(cur.get(k, 0.0) - self.planned.get(k, 0.0)) for k in keys)

    def drifted(self, now: float) -> bool:
        return bool(self.planned) and self.count(now) >= self.min_arrivals and self.distance(now) > self.threshold


class ReplanTrigger:
    """When to re-place (ours, around Eq. 8): at the end of the interval, when the mix drifts, and once more
    ``window_s`` after a re-plan for a drift, whose rates still mixed the traffic from before it (the window it
    measured over) and so described neither regime. :meth:`reason` says why to re-plan now (None: not now);
    :meth:`replanned` records a re-plan made."""

    INTERVAL = "replacement interval"
    DRIFT = "traffic mix drifted"
    SETTLE = "settling after a drift"

    def __init__(self, window_s: float):
        self.window_s = float(window_s)
        self.settle_at: float | None = None  # when the re-plan that follows a drift's is due

    def reason(self, now: float, *, due: bool, drifted: bool) -> str | None:
        if due:
            return self.INTERVAL
        if drifted:
            return self.DRIFT
        if self.settle_at is not None and now >= self.settle_at:
            return self.SETTLE
        return None

    def replanned(self, now: float, reason: str) -> None:
        self.settle_at = now + self.window_s if reason == self.DRIFT else None


@dataclass(frozen=True)
class Move:
    """Server ``server`` goes from model ``src`` (None: idle) to ``dst``; ``benefit``: the objective it saves over
    the interval net of its reload (objective units, e.g. expected SLO misses)."""

    server: str
    src: str | None
    dst: str
    benefit: float


def moves_that_pay(current: Assignment, target: Assignment, cost_rate: Callable[[Assignment], float], *,
                   reload_s: float, interval_s: float, swap_margin: float = SWAP_MARGIN,
                   min_swap_gain: float = MIN_SWAP_GAIN, min_gain: float = 0.0,
                   idle: Collection[str] = frozenset()) -> list[Move]:
    """The moves from ``current`` toward ``target`` that pay for their reload ("move only servers whose move pays
    for its reload time"). ``cost_rate(assignment)``: the objective per second under an assignment (e.g. the
    predicted unserved index per second, :func:`ui_rate`). A server moving ``A -> B`` serves nothing for
    ``reload_s``, then serves ``B`` for the rest of ``interval_s``; it pays when
    ``I · cost(now) > reload · cost(without it) + (I - reload) · cost(after)``.

    Greedy: repeatedly take the best-paying single move against the moves taken so far; when no single move pays
    but all the remaining ones together do (a chain may need several servers to exist at all), take them all.
    Moving servers both ways between two models in one re-plan (a swap: no model's number of servers changes, only
    which server serves which) must save more than ``swap_margin`` of the interval's cost, and more than
    ``min_swap_gain`` per swapped pair (in the objective's units over the interval): its gain rests on measured
    speeds, and on processes such swaps "paid" 0.01 % of the cost for two reloads, or 5e-6 requests when the
    cost itself was near 0 (a simulated index replaying a quiet spell). Any move must save more than ``min_gain``
    (0 by default: on exact costs, as in the simulator, the smallest gains pay too), except a move away from a model
    of ``idle`` (no traffic: it costs that model's users nothing), which pays with any gain."""
    if not (reload_s >= 0 and interval_s > 0 and 0 <= swap_margin < 1 and min_swap_gain >= 0 and min_gain >= 0):
        raise ValueError("need reload_s >= 0, interval_s > 0, 0 <= swap_margin < 1, min_swap_gain >= 0 and "
                         "min_gain >= 0")
    cur = dict(current)
    todo = [(s, m) for s, m in target.items() if cur.get(s) != m]
    taken: list[Move] = []
    rest = max(interval_s - reload_s, 0.0)

    def gain(base: dict[str, str], moves: Sequence[tuple[str, str]]) -> float:
        mid = {k: v for k, v in base.items() if k not in {s for s, _ in moves}}
        after = dict(base)
        after.update(moves)
        return interval_s * cost_rate(base) - reload_s * cost_rate(mid) - rest * cost_rate(after)

    def cancelled(flow: Counter) -> int:
        return sum(min(n, flow.get((b, a), 0)) for (a, b), n in flow.items())

    def swapping(moves: Sequence[tuple[str, str]]) -> int:
        """How many swapped pairs ``moves`` make: moves that cancel moves the other way (taken or among
        themselves) rather than add to a flow."""
        before = Counter((mv.src, mv.dst) for mv in taken)
        return (cancelled(before + Counter((cur.get(s), m) for s, m in moves)) - cancelled(before)) // 2

    def floor(servers: Sequence[str]) -> float:
        return min_gain * sum(cur.get(s) not in idle for s in servers)

    while todo:
        margin = max(swap_margin * interval_s * cost_rate(cur), min_swap_gain)
        scored = [(g - margin * swapping([(s, m)]) - floor([s]), g, s, m) for s, m in todo
                  for g in (gain(cur, [(s, m)]),)]
        net, b, s, m = max(scored, key=lambda x: x[0])
        if net > 0:
            taken.append(Move(s, cur.get(s), m, b))
            cur[s] = m
            todo.remove((s, m))
            continue
        b = gain(cur, todo)
        if b - margin * swapping(todo) - floor([s for s, _ in todo]) > 0:
            taken.extend(Move(s, cur.get(s), m, b / len(todo)) for s, m in todo)
        break
    return taken


def ui_rate(servers: Sequence[Volunteer], models: Sequence[ServedModel], *, horizon_s: float = 600.0,
            alpha: float = ALPHA, evaluate: Evaluate | None = None) -> Callable[[Assignment], float]:
    """``assignment -> Σ_s UI_s / horizon`` (predicted unserved index per second; ``evaluate`` over ``horizon_s``
    of traffic, default analytic) for :func:`moves_that_pay`."""
    ev = evaluate or analytic_evaluate(models, horizon_s, alpha)
    cache: dict[tuple, float] = {}

    def rate(assignment: Assignment) -> float:
        key = tuple(sorted(assignment.items()))
        if key not in cache:
            cache[key] = sum(e.ui for e in ev(groups_of(assignment, servers)).values()) / horizon_s
        return cache[key]

    return rate


@dataclass
class ReplanState:
    """What must survive a re-plan (§1.9): the interval controller, the last estimate and when it was made."""

    interval: AdaptiveInterval
    estimate: PlanMetrics | None = None
    planned_at: float = 0.0
    plans: list[dict] = field(default_factory=list)
