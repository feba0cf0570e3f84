"""Deadline-aware batching (seed 003, Shepherd): FLEX, FLEX-NP, EDF (Clockwork-like) and FCFS as pure schedulers.

Setting (§2.1, §5.1): a *worker* runs one batch at a time; a batch of ``|B|`` requests of model ``m`` takes
``l_m(B) = alpha_m * |B| + beta_m`` seconds (Eq. 1, :class:`BatchLatency`, per worker so volunteer chains of
different speed each have their own fit). A request ``r`` arrives at ``a_r`` and is worth something only if it
finishes by its deadline ``d_r``; *goodput* is on-time completions per second.

One interface drives every discipline (:class:`DeadlineScheduler`), in the simulator and in the runtime alike:

* ``arrive(reqs, now)`` — enqueue one request or a burst arriving at once; idle workers start batches and, for
  FLEX, a busy worker may be preempted;
* ``complete(worker, now)`` — the worker's running batch finished; it gets its next batch;
* ``remove_worker(worker, now)`` — the worker left; its running requests go back to the queue.

Each returns an :class:`Outcome`: the batches to start now (each on its worker, replacing whatever ran there),
the batches stopped before their end (preempted), and the requests dropped. The scheduler never reads a clock:
``now`` is the caller's, in seconds.

Disciplines (``DISCIPLINES``, :func:`make_scheduler`):

* ``fcfs`` — arrival order: a free worker takes the oldest request's model and batches that model's queue in
  arrival order up to ``B_max``; non-preemptive; late requests still run (``drop=True`` drops the hopeless).
* ``edf`` — the seed's Clockwork baseline (§7): a free worker drops requests that can no longer finish, takes
  the earliest-deadline request and batches the longest earliest-deadline-first run of its model's queue that
  still meets that request's deadline; non-preemptive.
* ``flex`` — Alg. 1 with BATCHGEN (Alg. 2): per model the largest feasible batch from the queue (plus the
  worker's running batch when it runs that model, :func:`largest_feasible_batch`), the largest over models
  (tie: earliest ``d(B)``); on arrival a busy worker is preempted when ``|B_g| >= lambda * |B_c|``
  (``lambda`` = 3.03, Thm 5.2) and the preempted requests that can still meet their deadline are re-enqueued
  with their original deadlines, as new arrivals (the loop over workers restarts).
* ``flex-np`` — FLEX without the preemption rule (the seed's SHEPHERD-NP).

Dropping: a queued request whose deadline cannot be met even by a batch of one started now on the fastest
worker serving its model is dropped (FLEX, EDF; FCFS only with ``drop=True``). With ``best_effort=True`` it
moves to a best-effort lane instead (seed mapping §3.7: a generation request already half served should not be
thrown away): a worker with no deadline-feasible batch runs the lane (oldest first, one model per batch, up to
``B_max``), and any deadline-feasible batch preempts a best-effort batch in every discipline (its value is 0,
pausing it costs no goodput). Best-effort completions are late by definition and never count as goodput.

:func:`admission_check` predicts whether a new request can still make its deadline (to refuse doomed requests at
once); :func:`deadline_metrics` computes goodput, SLO attainment and drops.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DISCIPLINES = ("flex", "flex-np", "edf", "fcfs")
# Clockwork runs a model only at the batch sizes it was compiled for, powers of two up to its max_batch_size (8 in
# its sample configuration): ``make_scheduler("clockwork")`` is EDF restricted to these (a sensitivity baseline)
CLOCKWORK_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_LAMBDA = 3.03  # preemption threshold of Thm 5.2 (several GPUs and models)
DEFAULT_B_MAX = 128  # §5.2: bounds cascading preemptions
EPS_S = 1e-9  # float slack of every "finishes by its deadline" test (a batch planned to end at d is on time)

Worker = Hashable


# ----------------------------------------------------------------------------------------------- latency model


@dataclass(frozen=True)
class BatchLatency:
    """Eq. 1: a batch of ``size`` requests takes ``alpha_s * size + beta_s`` seconds (``beta_s``: the cost of an
    empty batch, ``alpha_s``: per request). Seed Table 4 gives ms; here everything is in seconds."""

    alpha_s: float
    beta_s: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def __call__(self, size: int) -> float:
        return self.alpha_s * size + self.beta_s

    def max_batch(self, budget_s: float, cap: int = 2**31) -> int:
        """Largest ``k <= cap`` with ``l(k) <= budget_s`` (0 if not even one request fits)."""
        room = budget_s - self.beta_s + EPS_S
        if room < 0:
            return 0
        if self.alpha_s <= 0:
            return cap
        return max(0, min(cap, int(math.floor(room / self.alpha_s))))

    def throughput(self, size: int) -> float:
        """Requests per second of back-to-back batches of ``size``."""
        t = self(size)
        return math.inf if t <= 0 else size / t

    @classmethod
    def fit(cls, points: Iterable[tuple[float, float]]) -> BatchLatency:
        """Least-squares fit of ``seconds = alpha * batch_size + beta`` to ``(batch size, seconds)`` samples, with
        ``alpha, beta >= 0`` (constrained least squares: when the free fit has a negative coefficient, the best fit
        with that coefficient at 0). Samples at a single batch size cannot separate the two: they are read as all
        ``alpha`` (``beta = 0``), the conservative reading for larger batches."""
        pts = [(float(x), float(y)) for x, y in points]
        if not pts:
            raise ValueError("need at least one (batch size, seconds) sample")
        x = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x <= 0) or np.any(y < 0):
            raise ValueError("samples need batch size > 0 and seconds >= 0, both finite")
        if np.ptp(x) == 0:
            return cls(max(0.0, float(y.mean() / x[0])), 0.0)
        alpha, beta = np.polyfit(x, y, 1)
        if alpha < 0:
            return cls(0.0, max(0.0, float(y.mean())))
        if beta < 0:
            return cls(max(0.0, float((x @ y) / (x @ x))), 0.0)
        return cls(float(alpha), float(beta))


# ---------------------------------------------------------------------------------------------------- requests


@dataclass(eq=False)
class DeadlineRequest:
    """A request as the schedulers see it: ``model`` (the seed's stream/model ``m_r``), arrival and deadline in
    seconds on the caller's clock, and the caller's ``payload``. ``seq`` (arrival order, the tie-break) is set by the
    scheduler on first arrival; a re-enqueued request keeps it and its original deadline."""

    id: Hashable
    model: str
    arrival_s: float
    deadline_s: float
    payload: Any = None
    seq: int = -1

    @classmethod
    def with_slo(cls, id: Hashable, model: str, arrival_s: float, slo_s: float, payload: Any = None) -> DeadlineRequest:
        """``d_r = a_r + SLO`` (§2.1)."""
        return cls(id, model, arrival_s, arrival_s + slo_s, payload)


def token_deadline(arrival_s: float, k: int, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Deadline of output token ``k`` (0 = the first, due with the prefill) of a generation request (seed mapping
    §3.7): ``a_r + TTFT_SLO + k * TPOT_SLO``."""
    if k < 0:
        raise ValueError("token index must be >= 0")
    return arrival_s + ttft_slo_s + k * tpot_slo_s


def token_deadlines(arrival_s: float, n_tokens: int, ttft_slo_s: float, tpot_slo_s: float) -> list[float]:
    """:func:`token_deadline` of tokens ``0 .. n_tokens - 1``."""
    return [token_deadline(arrival_s, k, ttft_slo_s, tpot_slo_s) for k in range(n_tokens)]


# -------------------------------------------------------------------------------------- largest feasible batch


def _largest_k(kth_largest, n: int, now: float, latency: BatchLatency, b_max: int) -> int:
    """Largest ``k <= min(n, b_max)`` with ``kth_largest(k) >= now + l(k)``: the k-th largest deadline falls with k
    and ``l(k)`` rises, so feasibility is monotone and a binary search finds the boundary."""
    lo, hi = 0, min(n, b_max)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kth_largest(mid) + EPS_S >= now + latency(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_feasible_batch(candidates: Iterable[DeadlineRequest], now: float, latency: BatchLatency,
                           b_max: int = DEFAULT_B_MAX) -> list[DeadlineRequest]:
    """BATCHGEN's batch for one model (Alg. 2, the seed's [gap] read as its stated intent): the largest
    ``k <= b_max`` such that at least ``k`` candidates have ``d >= now + alpha * k + beta``, and among the candidates
    meeting that threshold the ``k`` with the earliest deadlines (later ones stay for later batches). Every member
    of the batch, started ``now``, finishes by its deadline. Returned in deadline order (ties: ``seq``, then input
    order)."""
    order = sorted(enumerate(candidates), key=lambda p: (p[1].deadline_s, p[1].seq, p[0]))
    reqs = [r for _, r in order]
    ds = [r.deadline_s for r in reqs]
    n = len(ds)
    k = _largest_k(lambda j: ds[n - j], n, now, latency, b_max)
    if k == 0:
        return []
    i = bisect.bisect_left(ds, now + latency(k) - EPS_S)
    return reqs[i:i + k]


class _DeadlineQueue:
    """One model's queue ordered by deadline (ties: arrival order): a sorted key list plus the requests."""

    __slots__ = ("keys", "reqs")

    def __init__(self) -> None:
        self.keys: list[tuple[float, int]] = []
        self.reqs: dict[int, DeadlineRequest] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def push(self, r: DeadlineRequest) -> None:
        key = (r.deadline_s, r.seq)
        if not self.keys or key > self.keys[-1]:
            self.keys.append(key)
        else:
            bisect.insort(self.keys, key)
        self.reqs[r.seq] = r

    def index(self, t: float) -> int:
        """Position of the first request with ``d >= t`` (up to float slack)."""
        return bisect.bisect_left(self.keys, (t - EPS_S, -1))

    def take(self, i: int, n: int) -> list[DeadlineRequest]:
        keys = self.keys[i:i + n]
        del self.keys[i:i + n]
        return [self.reqs.pop(s) for _, s in keys]

    def expire(self, t: float) -> list[DeadlineRequest]:
        """Remove and return the requests with ``d < t``."""
        return self.take(0, self.index(t))

    def count_before(self, deadline_s: float) -> int:
        return bisect.bisect_right(self.keys, (deadline_s, math.inf))


def _flex_select(q: _DeadlineQueue, extra: Sequence[DeadlineRequest], now: float, latency: BatchLatency,
                 b_max: int) -> tuple[int, int, list[DeadlineRequest]]:
    """:func:`largest_feasible_batch` over ``q`` plus ``extra`` (the running batch, sorted by (deadline, seq))
    without copying ``q``: returns ``(i, n, taken_extra)``, the batch being ``q.keys[i:i+n]`` plus ``taken_extra``.
    Only the ``b_max`` latest deadlines decide ``k``; the chosen ones are a contiguous run of ``q``."""
    keys = q.keys
    if extra:
        top = sorted([d for d, _ in keys[-b_max:]] + [r.deadline_s for r in extra[-b_max:]], reverse=True)
        k = _largest_k(lambda j: top[j - 1], len(top), now, latency, b_max)
    else:
        n = len(keys)
        k = _largest_k(lambda j: keys[n - j][0], n, now, latency, b_max)
    if k == 0:
        return 0, 0, []
    t = now + latency(k)
    i = q.index(t)
    ekeys = [(r.deadline_s, r.seq) for r in extra]
    e = bisect.bisect_left(ekeys, (t - EPS_S, -1))
    n_q, taken = 0, []
    while n_q + len(taken) < k:  # merge the two sorted runs above the threshold
        if e < len(extra) and (i + n_q >= len(keys) or ekeys[e] < keys[i + n_q]):
            taken.append(extra[e])
            e += 1
        else:
            n_q += 1
    return i, n_q, taken


# ---------------------------------------------------------------------------------------------- the interface


@dataclass(frozen=True, eq=False)
class Batch:
    """A batch started on ``worker`` at ``start_s``, planned to end at ``end_s = start_s + latency_s``. A
    best-effort batch holds requests past their deadline (value 0)."""

    worker: Worker
    model: str
    requests: tuple[DeadlineRequest, ...]
    start_s: float
    latency_s: float
    best_effort: bool = False

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s

    @property
    def deadline_s(self) -> float:
        """``d(B)``: the earliest deadline in the batch."""
        return min((r.deadline_s for r in self.requests), default=math.inf)

    @property
    def value(self) -> int:
        """Requests it completes on time: ``|B|``, 0 for a best-effort batch (the preemption rule's size)."""
        return 0 if self.best_effort else len(self.requests)


@dataclass
class Outcome:
    """What one event decided: ``starts`` — batches to run now, each replacing whatever ran on its worker (only
    those still standing at the end of the event); ``preempted`` — batches that were running before the event and
    were stopped (their requests are back in a queue, in a started batch, or dropped); ``dropped`` — requests that
    can no longer meet their deadline and left the scheduler."""

    starts: list[Batch] = field(default_factory=list)
    preempted: list[Batch] = field(default_factory=list)
    dropped: list[DeadlineRequest] = field(default_factory=list)


@dataclass(frozen=True)
class AdmissionEstimate:
    """:func:`admission_check`'s answer: ``feasible`` iff ``finish_s + slack <= deadline``; ``ahead`` is the queued
    work counted before the request."""

    feasible: bool
    finish_s: float
    ahead: int


def admission_check(deadline_s: float, now: float, ahead: int, workers: Sequence[tuple[float, BatchLatency]],
                    b_max: int = DEFAULT_B_MAX, slack_s: float = 0.0) -> AdmissionEstimate:
    """Can a new request still finish by ``deadline_s``? ``ahead``: requests that will be served before it (for a
    deadline-ordered discipline the queued ones of its model with earlier deadlines; FCFS: all queued of its
    model); ``workers``: ``(free_at_s, latency)`` of every worker serving its model (``free_at_s``: when its running
    batch ends, ``<= now`` if idle).

    The estimate is deliberately favourable, so a refusal means the request is doomed: the work ahead runs in full
    batches of ``b_max`` (the densest batches Eq. 1 allows), each on the worker that would finish it first, with the
    request in the last batch, and nothing arriving later overtakes it. A real schedule forms smaller batches, drops
    part of the work ahead or lets later arrivals go first, so a request judged feasible can still miss; one judged
    infeasible could only be saved by requests ahead of it giving up their place. ``slack_s`` widens the margin
    (e.g. the fit's error)."""
    if not workers:
        return AdmissionEstimate(False, math.inf, ahead)
    if ahead < 0 or b_max < 1:
        raise ValueError("ahead must be >= 0 and b_max >= 1")
    free = [max(now, float(f)) for f, _ in workers]
    lats = [lat for _, lat in workers]
    total = ahead + 1
    n_batches = -(-total // b_max)
    finish = math.inf
    for b in range(n_batches):
        size = b_max if b < n_batches - 1 else total - b_max * (n_batches - 1)
        ends = [f + lat(size) for f, lat in zip(free, lats)]
        w = int(np.argmin(ends))
        finish = ends[w]
        free[w] = finish
    return AdmissionEstimate(finish + slack_s <= deadline_s + EPS_S, finish, ahead)


class _WorkerState:
    __slots__ = ("latencies", "running")

    def __init__(self, latencies: Mapping[str, BatchLatency]):
        self.latencies = dict(latencies)
        self.running: Batch | None = None


class DeadlineScheduler:
    """Base of the disciplines: workers, best-effort lane, dropping and the event loop; a discipline supplies its
    queue (``_push``, ``_queued``, ``_ahead``) and ``_pick`` (the batch a free worker runs). ``workers`` maps a worker
    to the latency model of every model it serves (a chain serves one model; a GPU of the seed may serve many)."""

    name = "base"

    def __init__(self, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                 b_max: int = DEFAULT_B_MAX, best_effort: bool = False):
        if int(b_max) != b_max or b_max < 1:
            raise ValueError(f"b_max must be a positive integer, got {b_max!r}")
        self.b_max = int(b_max)
        self.best_effort = bool(best_effort)
        self._workers: dict[Worker, _WorkerState] = {}
        self._l1: dict[str, float] = {}  # fastest l_m(1) over the workers serving m: the drop threshold
        self._be: dict[str, deque[DeadlineRequest]] = {}
        self._seq = 0
        self.preemptions = 0
        for w, lats in (workers or {}).items():
            self.add_worker(w, lats)

    # ---- workers
    def add_worker(self, worker: Worker, latencies: Mapping[str, BatchLatency]) -> None:
        """Add (or re-fit) ``worker``: ``latencies[m]`` is its ``l_m`` for every model ``m`` it serves."""
        if not latencies:
            raise ValueError("a worker must serve at least one model")
        st = self._workers.get(worker)
        if st is None:
            self._workers[worker] = _WorkerState(latencies)
        else:
            st.latencies = dict(latencies)
        self._refresh_l1()

    def remove_worker(self, worker: Worker, now: float) -> Outcome:
        """``worker`` left: its running requests go back to the queue if they can still meet their deadline."""
        st = self._workers.pop(worker)
        out = Outcome()
        self._refresh_l1()
        if st.running is not None:
            out.preempted.append(st.running)
            if self._requeue(st.running, now, out):
                self._on_arrival(now, out, {st.running.model})
        self._after(now, out)
        return out

    def _refresh_l1(self) -> None:
        l1: dict[str, float] = {}
        for st in self._workers.values():
            for m, lat in st.latencies.items():
                l1[m] = min(l1.get(m, math.inf), lat(1))
        self._l1 = l1

    @property
    def workers(self) -> list[Worker]:
        return list(self._workers)

    def running(self, worker: Worker) -> Batch | None:
        return self._workers[worker].running

    def latency(self, worker: Worker, model: str) -> BatchLatency:
        return self._workers[worker].latencies[model]

    # ---- events
    def arrive(self, reqs: DeadlineRequest | Iterable[DeadlineRequest], now: float) -> Outcome:
        """Requests arriving at ``now`` (a burst may come as one call, as BATCHGEN sees all arrivals since its last
        call): enqueue them, start batches on free workers (and preempt, for FLEX)."""
        if isinstance(reqs, DeadlineRequest):
            reqs = (reqs,)
        models = set()
        for r in reqs:
            if r.seq < 0:
                r.seq = self._seq
                self._seq += 1
            self._push(r)
            models.add(r.model)
        out = Outcome()
        self._on_arrival(now, out, models)
        self._after(now, out)
        return out

    def complete(self, worker: Worker, now: float) -> Outcome:
        """``worker`` finished its running batch at ``now``; it starts its next batch if any."""
        st = self._workers[worker]
        if st.running is None:
            raise ValueError(f"worker {worker!r} has no running batch")
        st.running = None
        out = Outcome()
        b = self._pick(worker, now, out)
        if b is not None:
            self._start(b, out)
        self._after(now, out)
        return out

    def queued(self, model: str | None = None) -> int:
        """Requests waiting for a deadline batch (the best-effort lane apart)."""
        return self._queued(model)

    def best_effort_queued(self) -> int:
        return sum(len(q) for q in self._be.values())

    def admission(self, req: DeadlineRequest, now: float, slack_s: float = 0.0) -> AdmissionEstimate:
        """:func:`admission_check` for ``req`` against this scheduler's queue of its model and its workers."""
        ws = [(st.running.end_s if st.running is not None and not st.running.best_effort else now, st.latencies[req.model])
              for st in self._workers.values() if req.model in st.latencies]
        return admission_check(req.deadline_s, now, self._ahead(req, now), ws, self.b_max, slack_s)

    # ---- shared machinery
    def _feasible_any(self, r: DeadlineRequest, now: float) -> bool:
        """Can ``r`` still finish alone started now on the fastest worker serving its model?"""
        return r.deadline_s + EPS_S >= now + self._l1.get(r.model, 0.0)

    def _expire(self, reqs: Iterable[DeadlineRequest], out: Outcome) -> None:
        for r in reqs:
            if self.best_effort:
                self._be.setdefault(r.model, deque()).append(r)
            else:
                out.dropped.append(r)

    def _requeue(self, b: Batch, now: float, out: Outcome, keep: Iterable[DeadlineRequest] = ()) -> bool:
        """Return the requests of a stopped batch ``b`` not in ``keep``: best-effort ones to the front of their lane,
        still-feasible ones to the queue (original deadline and seq), the rest to :meth:`_expire`."""
        kept = set(map(id, keep))
        back = [r for r in b.requests if id(r) not in kept]
        if b.best_effort:
            self._be.setdefault(b.model, deque()).extendleft(reversed(back))
            return False
        late = [r for r in back if not self._feasible_any(r, now)]
        for r in back:
            if self._feasible_any(r, now):
                self._push(r)
        self._expire(late, out)
        return len(late) < len(back)

    def _start(self, b: Batch, out: Outcome) -> None:
        st = self._workers[b.worker]
        old = st.running
        if old is not None:
            if any(s is old for s in out.starts):  # started and stopped within this event: never ran
                out.starts = [s for s in out.starts if s is not old]
            else:
                out.preempted.append(old)
            if not old.best_effort:
                self.preemptions += 1
        st.running = b
        out.starts.append(b)

    def _best_effort_batch(self, worker: Worker, now: float) -> Batch | None:
        st = self._workers[worker]
        heads = [(q[0].seq, m) for m, q in self._be.items() if q and m in st.latencies]
        if not heads:
            return None
        _, m = min(heads)
        q = self._be[m]
        reqs = tuple(q.popleft() for _ in range(min(self.b_max, len(q))))
        return Batch(worker, m, reqs, now, st.latencies[m](len(reqs)), best_effort=True)

    def _after(self, now: float, out: Outcome) -> None:
        """Every event ends here: deadline work preempts best-effort batches, free workers take best-effort work."""
        for w, st in self._workers.items():
            if st.running is not None and st.running.best_effort:
                b = self._pick(w, now, out)
                if b is not None:
                    old = st.running
                    self._start(b, out)
                    self._requeue(old, now, out)
        if not self.best_effort or not self.best_effort_queued():
            return
        for w, st in self._workers.items():
            if st.running is None:
                b = self._pick(w, now, out) or self._best_effort_batch(w, now)
                if b is not None:
                    self._start(b, out)

    def _on_arrival(self, now: float, out: Outcome, models: set[str]) -> None:
        for w, st in self._workers.items():
            if st.running is None:
                b = self._pick(w, now, out)
                if b is not None:
                    self._start(b, out)

    # ---- a discipline supplies these
    def _push(self, r: DeadlineRequest) -> None:
        raise NotImplementedError

    def _queued(self, model: str | None) -> int:
        raise NotImplementedError

    def _ahead(self, r: DeadlineRequest, now: float) -> int:
        raise NotImplementedError

    def _pick(self, worker: Worker, now: float, out: Outcome) -> Batch | None:
        raise NotImplementedError


class FCFS(DeadlineScheduler):
    """Arrival order, non-preemptive: a free worker takes the model of the oldest queued request it serves and runs
    that model's queue in arrival order, up to ``B_max``. Late requests still run unless ``drop=True`` (then a request
    that cannot finish even alone on the fastest worker is dropped when its model is batched)."""

    name = "fcfs"

    def __init__(self, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                 b_max: int = DEFAULT_B_MAX, best_effort: bool = False, drop: bool = False):
        self.drop = bool(drop)
        self._q: dict[str, deque[DeadlineRequest]] = {}
        super().__init__(workers, b_max=b_max, best_effort=best_effort)

    def _push(self, r: DeadlineRequest) -> None:
        q = self._q.setdefault(r.model, deque())
        if q and r.seq < q[-1].seq:  # a re-enqueued request goes back to its place in arrival order
            items = sorted([*q, r], key=lambda x: x.seq)
            q.clear()
            q.extend(items)
        else:
            q.append(r)

    def _queued(self, model: str | None) -> int:
        return sum(len(q) for m, q in self._q.items() if model is None or m == model)

    def _ahead(self, r: DeadlineRequest, now: float) -> int:
        return len(self._q.get(r.model, ()))

    def _pick(self, worker: Worker, now: float, out: Outcome) -> Batch | None:
        st = self._workers[worker]
        while True:
            heads = [(q[0].seq, m) for m, q in self._q.items() if q and m in st.latencies]
            if not heads:
                return None
            _, m = min(heads)
            q = self._q[m]
            if self.drop:
                keep = [r for r in q if self._feasible_any(r, now)]
                if len(keep) < len(q):
                    self._expire([r for r in q if not self._feasible_any(r, now)], out)
                    q.clear()
                    q.extend(keep)
                    continue
            reqs = tuple(q.popleft() for _ in range(min(self.b_max, len(q))))
            return Batch(worker, m, reqs, now, st.latencies[m](len(reqs)))


class _DeadlineOrdered(DeadlineScheduler):
    """Per-model queues ordered by deadline, dropping what can no longer finish."""

    def __init__(self, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                 b_max: int = DEFAULT_B_MAX, best_effort: bool = False):
        self._q: dict[str, _DeadlineQueue] = {}
        super().__init__(workers, b_max=b_max, best_effort=best_effort)

    def _push(self, r: DeadlineRequest) -> None:
        q = self._q.get(r.model)
        if q is None:
            q = self._q[r.model] = _DeadlineQueue()
        q.push(r)

    def _queued(self, model: str | None) -> int:
        return sum(len(q) for m, q in self._q.items() if model is None or m == model)

    def _ahead(self, r: DeadlineRequest, now: float) -> int:
        q = self._q.get(r.model)
        if q is None:
            return 0
        return max(0, q.count_before(r.deadline_s) - q.index(now + self._l1.get(r.model, 0.0)))

    def _queue(self, m: str, now: float, out: Outcome) -> _DeadlineQueue | None:
        """``Q_m`` after dropping the requests that can no longer finish (Alg. 2 line 3)."""
        q = self._q.get(m)
        if q is None or not q:
            return None
        self._expire(q.expire(now + self._l1.get(m, 0.0)), out)
        return q if q else None


class EDF(_DeadlineOrdered):
    """The seed's Clockwork-like baseline (§7): a free worker drops what can no longer finish, takes the earliest
    deadline ``d0`` it can still meet, and batches the longest earliest-deadline-first run of that model's queue with
    ``now + l_m(k) <= d0``; batches run to completion."""

    name = "edf"

    def __init__(self, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                 b_max: int = DEFAULT_B_MAX, best_effort: bool = False, batch_sizes: Sequence[int] | None = None):
        """``batch_sizes``: the only sizes a batch may have (a run is cut to the largest that fits); None: any."""
        if batch_sizes is not None:
            batch_sizes = sorted({int(k) for k in batch_sizes})
            if not batch_sizes or batch_sizes[0] != 1:
                raise ValueError(f"batch_sizes must include 1, got {batch_sizes!r}")
        self.batch_sizes = batch_sizes
        super().__init__(workers, b_max=b_max, best_effort=best_effort)

    def _pick(self, worker: Worker, now: float, out: Outcome) -> Batch | None:
        st = self._workers[worker]
        best = None
        for m, lat in st.latencies.items():
            q = self._queue(m, now, out)
            if q is None:
                continue
            j = q.index(now + lat(1))  # first request this worker can still serve in time
            if j >= len(q):
                continue
            d0 = q.keys[j][0]
            k = min(len(q) - j, lat.max_batch(d0 - now, self.b_max))
            if k < 1:  # the earliest deadline is met only within float slack: nothing of this model fits
                continue
            if self.batch_sizes is not None:
                k = self.batch_sizes[bisect.bisect_right(self.batch_sizes, k) - 1]
            if best is None or (d0, m) < (best[0], best[1]):
                best = (d0, m, j, k)
        if best is None:
            return None
        _, m, j, k = best
        reqs = tuple(self._q[m].take(j, k))
        return Batch(worker, m, reqs, now, st.latencies[m](len(reqs)))


class FLEX(_DeadlineOrdered):
    """Alg. 1 of the seed: largest feasible batch over models (BATCHGEN, Alg. 2; tie between models: earliest
    ``d(B)``), preemption on arrival when ``|B_g| >= lambda * |B_c|`` (``lam``; ``preempt=False`` gives FLEX-NP).

    BATCHGEN recomputes every model the worker serves rather than only those with new arrivals (the seed's
    shortcut): between events feasible sets only shrink, so the result is the same."""

    name = "flex"

    def __init__(self, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                 b_max: int = DEFAULT_B_MAX, best_effort: bool = False, lam: float = DEFAULT_LAMBDA,
                 preempt: bool = True):
        if not (math.isfinite(lam) and lam > 1):
            raise ValueError(f"lambda must be > 1 (a cascade of preemptions must grow), got {lam!r}")
        self.lam = float(lam)
        self.preempt = bool(preempt)
        if not preempt:
            self.name = "flex-np"
        super().__init__(workers, b_max=b_max, best_effort=best_effort)

    def batchgen(self, worker: Worker, now: float, out: Outcome | None = None) -> list[DeadlineRequest]:
        """``B_g(n)`` without dequeuing it (drops expired requests as a side effect, reported in ``out``)."""
        sel = self._batchgen(worker, now, out if out is not None else Outcome())
        if sel is None:
            return []
        m, i, n, extra = sel
        queued = [self._q[m].reqs[s] for _, s in self._q[m].keys[i:i + n]] if n else []
        return sorted([*queued, *extra],
                      key=lambda r: (r.deadline_s, r.seq))

    def _batchgen(self, worker: Worker, now: float, out: Outcome, models: set[str] | None = None):
        st = self._workers[worker]
        run = st.running if st.running is not None and not st.running.best_effort else None
        best = None
        for m, lat in st.latencies.items():
            if models is not None and m not in models:
                continue
            q = self._queue(m, now, out) or _DeadlineQueue()
            extra = sorted(run.requests, key=lambda r: (r.deadline_s, r.seq)) if run is not None and run.model == m else ()
            if not q and not extra:
                continue
            i, n, taken = _flex_select(q, extra, now, lat, self.b_max)
            size = n + len(taken)
            if size == 0:
                continue
            d_b = min(q.keys[i][0] if n else math.inf, taken[0].deadline_s if taken else math.inf)
            if best is None or (-size, d_b, m) < (-best[0], best[1], best[2]):
                best = (size, d_b, m, i, n, taken)
        if best is None:
            return None
        return best[2:]

    def _take(self, worker: Worker, now: float, sel) -> Batch:
        m, i, n, extra = sel
        reqs = sorted([*(self._q[m].take(i, n) if n else ()), *extra], key=lambda r: (r.deadline_s, r.seq))
        return Batch(worker, m, tuple(reqs), now, self._workers[worker].latencies[m](len(reqs)))

    def _pick(self, worker: Worker, now: float, out: Outcome) -> Batch | None:
        sel = self._batchgen(worker, now, out)
        return None if sel is None else self._take(worker, now, sel)

    def _on_arrival(self, now: float, out: Outcome, models: set[str]) -> None:
        """Alg. 1 lines 11-19. Only models with new arrivals (or re-enqueued requests) can change a decision here:
        a worker's candidate for any other model was already no larger than its running batch (or empty, if it is
        idle) and candidates only shrink as time passes, so BATCHGEN looks at those models only (the seed's
        Alg. 2 line 2); requests of the others that expire are dropped when a worker next picks among them."""
        restart = True
        while restart:  # a preemption re-enqueues requests as new arrivals: restart the loop over workers
            restart = False
            for w, st in self._workers.items():
                mine = {m for m in models if m in st.latencies}
                if not mine:
                    continue
                cur = st.running
                if cur is not None and not cur.best_effort:
                    if not self.preempt:
                        continue
                    # |B_g| is at most B_max or what is queued for those models: skip hopeless checks
                    room = sum(len(self._q[m]) for m in mine if m in self._q) + cur.size
                    if min(self.b_max, room) < self.lam * cur.size:
                        continue
                sel = self._batchgen(w, now, out, mine)
                if sel is None:
                    continue
                m, i, n, extra = sel
                if cur is None or cur.best_effort:
                    self._start(self._take(w, now, sel), out)
                    if cur is not None:
                        self._requeue(cur, now, out)
                elif n + len(extra) >= self.lam * cur.size:
                    b = self._take(w, now, sel)
                    self._start(b, out)
                    if self._requeue(cur, now, out, keep=b.requests):
                        models = models | {cur.model}
                        restart = True
                        break


def make_scheduler(discipline: str, workers: Mapping[Worker, Mapping[str, BatchLatency]] | None = None, *,
                   b_max: int = DEFAULT_B_MAX, best_effort: bool = False, lam: float = DEFAULT_LAMBDA,
                   drop: bool = False) -> DeadlineScheduler:
    """A scheduler by name (``DISCIPLINES``, or ``clockwork``: EDF at Clockwork's batch sizes); ``lam`` for FLEX,
    ``drop`` for FCFS."""
    if discipline == "flex":
        return FLEX(workers, b_max=b_max, best_effort=best_effort, lam=lam)
    if discipline == "flex-np":
        return FLEX(workers, b_max=b_max, best_effort=best_effort, lam=lam, preempt=False)
    if discipline == "edf":
        return EDF(workers, b_max=b_max, best_effort=best_effort)
    if discipline == "clockwork":
        sched = EDF(workers, b_max=b_max, best_effort=best_effort, batch_sizes=CLOCKWORK_BATCH_SIZES)
        sched.name = "clockwork"
        return sched
    if discipline == "fcfs":
        return FCFS(workers, b_max=b_max, best_effort=best_effort, drop=drop)
    raise ValueError(f"unknown discipline {discipline!r}; expected one of {DISCIPLINES}")


# ----------------------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class DeadlineMetrics:
    """Goodput (on-time completions per second of ``duration_s``), SLO attainment (on-time / requests), and counts
    of late completions (best-effort or FCFS) and requests never completed (dropped)."""

    requests: int
    on_time: int
    late: int
    dropped: int
    duration_s: float
    goodput_rps: float
    slo_attainment: float
    drop_rate: float


def deadline_metrics(deadlines_s: Sequence[float], finishes_s: Sequence[float | None], duration_s: float) -> DeadlineMetrics:
    """Metrics of requests with deadlines ``deadlines_s`` that finished at ``finishes_s`` (None: never, i.e.
    dropped), arrivals spread over ``duration_s`` seconds."""
    if len(deadlines_s) != len(finishes_s):
        raise ValueError("deadlines and finishes differ in length")
    if not duration_s > 0:
        raise ValueError("duration must be positive")
    n = len(deadlines_s)
    on = sum(1 for d, f in zip(deadlines_s, finishes_s) if f is not None and f <= d + EPS_S)
    dropped = sum(1 for f in finishes_s if f is None)
    late = n - on - dropped
    return DeadlineMetrics(n, on, late, dropped, float(duration_s), on / duration_s, on / n if n else 1.0,
                           dropped / n if n else 0.0)
