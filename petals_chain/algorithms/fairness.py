"""Fair sharing among clients with prefix locality (seed 002): FCFS, LPM, VTC, DLPM, and D2LPM over chains.

Two decisions, kept apart as in the seed: *which waiting request a worker takes next* (the queue discipline)
and, for the distributed policies, *which worker (chain) a new request is bound to*. A worker is a chain; its
identity is any hashable the caller keeps stable across re-plans (the orchestrator uses the chain's hops and
spans), so counters survive re-planning and a vanished chain's counters are dropped (:meth:`FairPolicy.retain`).

Service (§3): ``W = w_e * extend + w_q * output`` in *service units*, where ``extend`` is the input tokens the
worker must compute (input minus the prefix it holds cached) and ``output`` the tokens generated. The policies
charge ``w_e * extend`` when a request is admitted (started on a chain) and ``w_q`` per output token as it is
produced, as DLPM's Alg. 1 does; a caller that learns the exact extend later corrects it with
:meth:`FairPolicy.prompt`. Recomputation caused by the system (a failover's replay) is not charged.

Policies (``FAIRNESS_POLICIES``):

* ``fcfs`` — oldest first (the paper's JFFC queue).
* ``lpm`` — longest prefix match on the freed worker first (locality, unfair).
* ``vtc`` — Virtual Token Counter: the backlogged client with the least counted service first (fair, blind to
  locality). A client arriving with nothing queued is lifted to the least counter among queued clients (with
  nobody queued, to the counter of the client admitted last, as it is now), so idle time is not banked. VTC
  counts full input tokens (``w_e * input``), as in its paper.
* ``dlpm`` — Deficit LPM (Alg. 1): the waiting requests in LPM order, each client admitted while its deficit
  ``q_i > 0``; when no queued client has credit every client with ``q_i <= 0`` is refilled by the quantum
  ``Q^u``. One request is taken per freed slot, so the printed spin on a full batch cannot happen.
* ``d2lpm`` — D2LPM (Alg. 2): a new request is bound to a worker by ``SelectWorker`` (the workers holding its
  longest prefix where the client still has per-worker credit ``q_{i,w} > 0``, else the least loaded worker with
  credit; all of the client's worker credits refilled by ``Q^w`` when none is left), and each worker runs DLPM
  locally on the requests bound to it.
* ``d-vtc`` and ``rr-lpm`` — the seed's distributed baselines: VTC locally with per-client round-robin binding,
  and LPM locally with per-request round-robin binding.

Readings of the seed's gaps (docs/scheduling-seeds.md §2): DLPM's client list ``l`` holds every client seen, so an
idle client keeps at most one quantum of credit (``q_i <= Q^u``: no banking) and keeps its debt (no forgiveness
by going quiet). Binding (distributed policies) follows JFFC's capacity rule: while some worker has a free slot
a new request is bound only to a free worker, and a worker whose own queue is empty takes (re-binds) the request
its local discipline prefers among all waiting ones, so no worker idles while a request waits (work-conserving,
P3). Ties go to the faster worker, then the lower index.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from petals_chain.algorithms.jffc import _chain_rate_capacity

FAIRNESS_POLICIES = ("fcfs", "lpm", "vtc", "dlpm", "d2lpm", "d-vtc", "rr-lpm")
DISTRIBUTED_POLICIES = ("d2lpm", "d-vtc", "rr-lpm")
# the policies that share service among clients (lpm and rr-lpm order by prefix locality alone)
CLIENT_FAIR_POLICIES = ("vtc", "dlpm", "d2lpm", "d-vtc")

Worker = Hashable


MAX_WEIGHT = 1e6  # service units per token (w_e, w_q)
MIN_QUANTUM, MAX_QUANTUM = 1.0, 1e15  # service units (Q^u, Q^w): one token's worth at the least


@dataclass(frozen=True)
class FairnessConfig:
    """Weights and quanta of the fair policies, all in service units (``w_e`` per extend token, ``w_q`` per output
    token: 1 and 2 as in the seed). ``quantum`` is DLPM's ``Q^u`` (None: adaptive, 1 to ``quantum_factor`` times
    the median full cost of the last ``quantum_window`` admitted requests as more of their input is found cached,
    :class:`AdaptiveQuantum`; ``quantum_prior`` bounds it before any request was admitted);
    ``worker_quantum`` is D2LPM's ``Q^w``."""

    w_e: float = 1.0
    w_q: float = 2.0
    quantum: float | None = None
    worker_quantum: float = 20000.0
    quantum_factor: float = 4.0
    quantum_window: int = 256
    quantum_prior: float = 2048.0

    def __post_init__(self) -> None:
        for name in ("w_e", "w_q", "worker_quantum", "quantum_factor", "quantum_prior"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.w_e + self.w_q <= 0:
            raise ValueError("w_e and w_q cannot both be 0")
        # Bounded so that counters stay exact in floats: a weight of 1e308 overflowed a refill, and a quantum many
        # orders below one request's cost made the refill's rounds vanish in rounding (a loop that never ended)
        if max(self.w_e, self.w_q) > MAX_WEIGHT:
            raise ValueError(f"w_e and w_q must be at most {MAX_WEIGHT:g} units per token, got {self.w_e}, {self.w_q}")
        for name in ("quantum", "worker_quantum", "quantum_prior"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and MIN_QUANTUM <= v <= MAX_QUANTUM):
                raise ValueError(f"{name} must be between {MIN_QUANTUM:g} and {MAX_QUANTUM:g} service units, "
                                 f"got {v!r}")
        if not self.quantum_factor > 0:  # the quanta's bounds above keep them positive
            raise ValueError(f"quantum_factor must be positive, got {self.quantum_factor!r}")
        if int(self.quantum_window) != self.quantum_window or self.quantum_window < 1:
            raise ValueError(f"quantum_window must be a positive integer, got {self.quantum_window!r}")

    def cost(self, extend_tokens: float, output_tokens: float) -> float:
        """Service units of a request that computes ``extend_tokens`` input tokens and generates ``output_tokens``."""
        return self.w_e * extend_tokens + self.w_q * output_tokens


@dataclass(eq=False)
class FairRequest:
    """A request as the policies see it. ``matched``: cached prefix tokens per worker (workers not listed hold
    none); ``expected_output``: tokens the request may generate (for the adaptive quantum only). ``item`` is the
    caller's object; ``seq`` (arrival order) and ``worker`` (the worker a distributed policy bound it to) are set
    by the dispatcher."""

    item: Any
    client: str
    input_tokens: int
    matched: Mapping[Worker, int] = field(default_factory=dict)
    expected_output: int = 0
    seq: int = 0
    worker: Worker | None = None
    charged: float = 0.0  # w_e * tokens charged at admission (corrected by FairPolicy.prompt)
    admitted_on: Worker | None = None  # set by FairPolicy.admit
    # the same request admitted again (after a failover, a preemption or a pause): charged for what it has not paid
    # for, but not counted as another request nor sampled by the adaptive quantum
    again: bool = False

    def match(self, worker: Worker) -> int:
        return min(int(self.matched.get(worker, 0)), int(self.input_tokens))

    def extend(self, worker: Worker) -> int:
        """Input tokens ``worker`` must compute for this request."""
        return max(0, int(self.input_tokens) - self.match(worker))


class AdaptiveQuantum:
    """``Q^u`` = ``f`` x the median full cost (``w_e * input + w_q * expected output``, cache ignored) of the last
    ``window`` admitted requests, with ``f = 1 + (factor - 1) · h`` and ``h`` the fraction of those requests' input
    tokens that were cached where they ran (the seed gives no default). The quantum exists for locality: ~4 median
    requests per round keep a client's prefix-sharing requests together without loosening the bound much, and a
    quantum at least one cache miss long keeps one miss from putting its client rounds in debt. Where nothing is
    reused (``h`` = 0) a longer round only makes other clients wait, so it shrinks to one median request (deficit
    round robin). Measured: a light client's wait behind a heavy one falls from 3.4 to 1.7 s in the simulator's
    `heavy` experiment, with throughput and Jain's index unchanged on the prefix workloads. Before any request is
    admitted a refill sizes it by the same rule from the requests waiting (:meth:`for_queue`), at most ``prior``;
    until then it reads ``prior``, after that the quantum so sized."""

    def __init__(self, cfg: FairnessConfig):
        self.cfg = cfg
        self._costs: deque[float] = deque(maxlen=int(cfg.quantum_window))
        self._reuse: deque[tuple[int, int]] = deque(maxlen=int(cfg.quantum_window))  # (cached, input) tokens
        self._value = float(cfg.quantum if cfg.quantum is not None else cfg.quantum_prior)
        self._dirty = False

    def observe(self, cost: float, input_tokens: int = 0, cached_tokens: int = 0) -> None:
        """An admitted request of full cost ``cost``, ``cached_tokens`` of its ``input_tokens`` found cached."""
        if self.cfg.quantum is None:
            self._costs.append(float(cost))
            self._reuse.append((max(0, min(int(cached_tokens), int(input_tokens))), max(0, int(input_tokens))))
            self._dirty = True

    @property
    def observed(self) -> bool:
        """Some admitted request sized it (its window is not empty)."""
        return bool(self._costs)

    @property
    def reuse(self) -> float:
        """``h``: the cached fraction of the window's input tokens (0 without input)."""
        total = sum(n for _, n in self._reuse)
        return sum(c for c, _ in self._reuse) / total if total else 0.0

    def for_queue(self, waiting: Sequence[FairRequest], worker: Worker) -> float:
        """The quantum of a refill while ``waiting`` wait for ``worker``: :attr:`value`, or, before any request was
        admitted, the same rule over ``waiting`` (their full costs, the share of their input cached on ``worker``),
        at most ``prior``. The prior alone, 2048 units where a request cost 60, let the first client after each
        start run 36 requests before another client's first one was taken."""
        if self.cfg.quantum is not None or self._costs or not waiting:
            return self.value
        self._value = self.sized(waiting, worker)  # reported as value until sampled
        return self._value

    def sized(self, waiting: Sequence[FairRequest], worker: Worker) -> float:
        """The quantum :meth:`for_queue` would use for ``waiting`` on ``worker``, nothing changed (a prediction
        reads it)."""
        if self.cfg.quantum is not None or self._costs or not waiting:
            return self.value
        cost, inputs = self.cfg.cost, sum(max(0, int(r.input_tokens)) for r in waiting)
        reuse = sum(r.match(worker) for r in waiting) / inputs if inputs else 0.0
        factor = 1.0 + (self.cfg.quantum_factor - 1.0) * max(0.0, reuse)
        median = statistics.median(cost(r.input_tokens, r.expected_output) for r in waiting)
        return min(float(self.cfg.quantum_prior), max(1.0, factor * median))

    @property
    def value(self) -> float:
        if self._dirty:
            factor = 1.0 + (self.cfg.quantum_factor - 1.0) * self.reuse
            self._value = max(1.0, factor * statistics.median(self._costs))
            self._dirty = False
        return self._value


def _oldest(reqs: Iterable[FairRequest]) -> FairRequest | None:
    return min(reqs, key=lambda r: r.seq, default=None)


def _longest_match(reqs: Iterable[FairRequest], worker: Worker) -> FairRequest | None:
    """LPM order: longest cached prefix on ``worker`` first, then the oldest."""
    return min(reqs, key=lambda r: (-r.match(worker), r.seq), default=None)


class _Local:
    """A local queue discipline: picks one of ``waiting`` for ``worker``; charged on admission and output."""

    def arrived(self, req: FairRequest, waiting: Sequence[FairRequest], again: bool = False) -> None:
        """``req`` joined ``waiting``; ``again``: it waited before a re-plan already (its client stays backlogged)."""

    def pick(self, waiting: Sequence[FairRequest], worker: Worker) -> FairRequest | None:
        raise NotImplementedError

    def charge(self, client: str, units: float) -> None:
        pass

    def took(self, client: str) -> None:
        """A request of ``client`` was admitted (started) here."""

    def snapshot(self) -> dict[str, float]:
        return {}

    def mark(self, client: str) -> Any:
        """What an arrival of ``client`` may change here (:meth:`restore` puts it back)."""
        return None

    def restore(self, client: str, mark: Any) -> None:
        pass

    def forget(self, client: str) -> None:
        """Drop ``client``'s state here (it has nothing waiting or running: :meth:`FairPolicy.forget`)."""


class _FCFS(_Local):
    def pick(self, waiting, worker):
        return _oldest(waiting)


class _LPM(_Local):
    def pick(self, waiting, worker):
        return _longest_match(waiting, worker)


class _VTC(_Local):
    """Counters ``c_i`` of service received; the queued client with the least counter goes first."""

    def __init__(self) -> None:
        self.counter: dict[str, float] = {}
        # the client of the last request admitted (picked from the queue or started on a free chain)
        self._last: str | None = None
        self._last_counter = 0.0  # that client's final counter once it was forgotten (the lift's floor stays)

    def arrived(self, req, waiting, again=False):
        queued = {r.client for r in waiting if r is not req}
        if req.client in queued or (again and req.client in self.counter):
            return  # lifted only when it becomes backlogged: a re-plan re-queueing its waiting jobs is not that
        # With nobody queued, VTC lifts to the *current* counter of the client that left the queue last: a counter
        # read when it was picked missed all it was served since, requests started on free chains included, and a
        # client idle meanwhile banked that (idle through 50 of another's requests, it then took 6 turns in a row)
        last = self.counter.get(self._last, 0.0) if self._last is not None else self._last_counter
        floor = min((self.counter.get(c, 0.0) for c in queued), default=last)
        self.counter[req.client] = max(self.counter.get(req.client, 0.0), floor)

    def pick(self, waiting, worker):
        if not waiting:
            return None
        client = min({r.client for r in waiting}, key=lambda c: (self.counter.get(c, 0.0), c))
        return _oldest(r for r in waiting if r.client == client)

    def took(self, client):
        self._last = client

    def charge(self, client, units):
        self.counter[client] = self.counter.get(client, 0.0) + units

    def snapshot(self):
        return dict(self.counter)

    def mark(self, client):
        return self.counter.get(client)

    def restore(self, client, mark):
        _put(self.counter, client, mark)

    def forget(self, client):
        # Counters are relative: the others' order is theirs alone. The last admitted client's counter is the floor
        # an arrival with nobody queued is lifted to; dropped with it, that floor fell to 0 and the next arrival
        # banked all the service given since its own counter
        if self._last == client:
            self._last_counter = self.counter.get(client, 0.0)
            self._last = None
        self.counter.pop(client, None)


def _put(d: dict, key: Hashable, value: Any) -> None:
    """``d[key] = value``, or no ``key`` at all for None (it was not there)."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def _rounds_to_credit(q: float, q_u: float) -> int:
    """Refills of ``q_u`` that take a deficit ``q <= 0`` above 0."""
    r = max(1, math.floor(-q / q_u) + 1)
    while r > 1 and q + (r - 1) * q_u > 0:  # float rounding either way
        r -= 1
    while q + r * q_u <= 0:
        r += 1
    return r


class _DLPM(_Local):
    """Alg. 1: deficits ``q_i`` (start 0, ``-U < q_i <= Q^u``), refilled together when no queued client has credit."""

    def __init__(self, quantum: Callable[[], float],
                 quantum_for: Callable[[Sequence[FairRequest], Worker], float] | None = None):
        """``quantum()``: ``Q^u``; ``quantum_for(waiting, worker)``: ``Q^u`` for a refill among ``waiting`` on
        ``worker`` (:meth:`AdaptiveQuantum.for_queue`; default: ``quantum()``)."""
        self.quantum = quantum
        self.quantum_for = quantum_for
        self.deficit: dict[str, float] = {}
        self.refills = 0

    def arrived(self, req, waiting, again=False):
        self.deficit.setdefault(req.client, 0.0)

    def _check_refill(self, clients: set[str], quantum: Callable[[], float] | None = None) -> None:
        # Refill rounds until some queued client has credit; a client deep in debt may need several rounds,
        # during which every other client with q <= 0 is refilled too (as repeated CheckRefill calls would).
        # Computed in one pass: the rounds one by one took (debt / quantum) x clients steps, seconds on the event
        # loop for a client a long generation left deep in debt.
        for c in clients:
            self.deficit.setdefault(c, 0.0)
        if any(self.deficit[c] > 0 for c in clients):
            return
        q_u = (quantum or self.quantum)()
        if not q_u > 0:
            raise ValueError(f"the quantum must be > 0, got {q_u!r}")
        rounds = min(_rounds_to_credit(self.deficit[c], q_u) for c in clients)
        for c, q in self.deficit.items():
            if q <= 0:  # refilled each round until it has credit
                self.deficit[c] = q + q_u * min(rounds, _rounds_to_credit(q, q_u))
        self.refills += rounds

    def pick(self, waiting, worker):
        if not waiting:
            return None
        sized = self.quantum_for
        self._check_refill({r.client for r in waiting}, None if sized is None else lambda: sized(waiting, worker))
        return _longest_match((r for r in waiting if self.deficit.get(r.client, 0.0) > 0), worker)

    def charge(self, client, units):
        self.deficit[client] = self.deficit.get(client, 0.0) - units

    def snapshot(self):
        return dict(self.deficit)

    def mark(self, client):
        return self.deficit.get(client)

    def restore(self, client, mark):
        _put(self.deficit, client, mark)

    def forget(self, client):
        # A refill's rounds are counted over the queued clients only, and each deficit moves on its own: dropping an
        # idle client's entry changes no other's (it loses its debt or credit: the name is gone)
        self.deficit.pop(client, None)


class _PairCredit(dict):
    """D2LPM's ``q_{i,w}`` keyed ``(client, worker)``, each client's workers indexed: an arrival's :meth:`FairPolicy.
    mark` reads its own client's credits (a scan of every pair took 9 ms an arrival with 10,000 keys on 20 chains)."""

    # dict's own constructor, |= and copy.copy() fill the items without __setitem__ (copy.copy() shared the index
    # itself): each goes through update() here, or a client's credits went missing from of() and a refused
    # arrival's restore() dropped them
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__()
        self.update(*args, **kw)

    def __ior__(self, other: Any) -> _PairCredit:
        self.update(other)
        return self

    def __copy__(self) -> _PairCredit:
        return type(self)(self)

    def _index(self) -> dict[str, set]:
        return self.__dict__.setdefault("workers_of", {})  # unpickling sets items before the instance's state

    def __setitem__(self, key: tuple[str, Worker], value: float) -> None:
        super().__setitem__(key, value)
        self._index().setdefault(key[0], set()).add(key[1])

    def __delitem__(self, key: tuple[str, Worker]) -> None:
        super().__delitem__(key)
        workers = self._index().get(key[0])
        if workers is not None:
            workers.discard(key[1])
            if not workers:
                del self._index()[key[0]]

    def update(self, *args: Any, **kw: Any) -> None:
        for key, value in dict(*args, **kw).items():
            self[key] = value

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            return dict.pop(self, key, *default)
        value = self[key]
        del self[key]
        return value

    def clear(self) -> None:
        super().clear()
        self._index().clear()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self) -> tuple:
        key, value = next(reversed(self.items())) if self else dict.popitem(self)
        del self[key]
        return key, value

    def of(self, client: str) -> dict[tuple[str, Worker], float]:
        """``client``'s credits."""
        return {(client, w): self[(client, w)] for w in self._index().get(client, ())}


class FairPolicy:
    """State of one fairness policy, kept across re-plans (one per orchestrator and model).

    Also counts each client's service ``W_i`` (:attr:`service`, ``w_e * extend + w_q * output`` for every policy,
    so they compare) and requests admitted (:attr:`admitted_requests`)."""

    def __init__(self, name: str = "dlpm", cfg: FairnessConfig | None = None):
        if name not in FAIRNESS_POLICIES:
            raise ValueError(f"unknown fairness policy {name!r}; choose from {', '.join(FAIRNESS_POLICIES)}")
        self.name = name
        self.cfg = cfg or FairnessConfig()
        self.quantum = AdaptiveQuantum(self.cfg)
        self.distributed = name in DISTRIBUTED_POLICIES
        self.service: dict[str, float] = {}
        self.admitted_requests: dict[str, int] = {}
        self._local: dict[Worker, _Local] = {}  # per worker (distributed policies); key None: the central one
        self.worker_credit: dict[tuple[str, Worker], float] = _PairCredit()  # D2LPM's q_{i,w}
        self._rr_client: dict[str, int] = {}  # d-vtc: next worker index per client
        self._rr = 0  # rr-lpm: next worker index
        self._workers: set[Worker] | None = None  # the workers of the plan (retain); None: any worker

    # ---- local disciplines ------------------------------------------------------------------------
    def _new_local(self) -> _Local:
        kind = {"fcfs": "fcfs", "lpm": "lpm", "rr-lpm": "lpm", "vtc": "vtc", "d-vtc": "vtc"}.get(self.name, "dlpm")
        if kind == "fcfs":
            return _FCFS()
        if kind == "lpm":
            return _LPM()
        if kind == "vtc":
            return _VTC()
        return _DLPM(lambda: self.quantum.value, self.quantum.for_queue)

    def local(self, worker: Worker | None) -> _Local:
        key = worker if self.distributed else None
        loc = self._local.get(key)
        if loc is None:
            loc = self._local[key] = self._new_local()
        return loc

    def _worked(self, worker: Worker | None) -> _Local | None:
        """The local discipline charged for work done on ``worker``; None (distributed policies) for no worker of the
        plan: None (a job counted on no chain now) or one :meth:`retain` dropped (a chain re-planned away). Charged
        there, a dropped worker came back as state no chain reads, growing with every charge until the next plan."""
        if self.distributed and (worker is None or (self._workers is not None and worker not in self._workers)):
            return None
        return self.local(worker)

    def retain(self, workers: Iterable[Worker]) -> None:
        """Keep the state of ``workers`` only (the current chains): a new chain starts at 0, a gone one is dropped."""
        keep = self._workers = set(workers)
        if self.distributed:
            for w in [w for w in self._local if w not in keep]:
                del self._local[w]
        for key in [k for k in self.worker_credit if k[1] not in keep]:
            del self.worker_credit[key]

    def forget(self, client: str) -> None:
        """Drop all that is kept of ``client`` (its name is gone: a removed or renamed API key), which must have
        nothing waiting or running: its service and requests counted, VTC's counters, DLPM's deficits, D2LPM's
        worker credits and d-vtc's round robin. Each client's counters move on their own (refills, lifts and picks
        read the queued clients'), so the others' order is as if it had stayed idle; it comes back, if ever, as a
        new client. The state kept is thus bounded by the clients that still exist."""
        self.service.pop(client, None)
        self.admitted_requests.pop(client, None)
        self._rr_client.pop(client, None)
        for key in list(self.worker_credit.of(client)):
            del self.worker_credit[key]
        for loc in self._local.values():
            loc.forget(client)

    def mark(self, client: str) -> tuple:
        """Everything an arrival of ``client`` may change (:meth:`arrived`, :meth:`choose_worker`, :meth:`bound`):
        :meth:`restore` puts it back, for an arrival refused in the same step (as if it never came)."""
        credit = self.worker_credit.of(client)
        local = {w: loc.mark(client) for w, loc in self._local.items()}
        return client, self.service.get(client), self._rr, self._rr_client.get(client), credit, local

    def restore(self, mark: tuple) -> None:
        """Undo what happened since :meth:`mark` was taken (nothing else may have happened in between)."""
        client, service, rr, rr_client, credit, local = mark
        _put(self.service, client, service)
        self._rr = rr
        _put(self._rr_client, client, rr_client)
        for key in list(self.worker_credit.of(client)):
            del self.worker_credit[key]
        self.worker_credit.update(credit)
        for w in [w for w in self._local if w not in local]:  # a worker's discipline it brought into being
            del self._local[w]
        for w, m in local.items():
            self._local[w].restore(client, m)

    # ---- events -------------------------------------------------------------------------------------
    def arrived(self, req: FairRequest, waiting: Sequence[FairRequest], again: bool = False) -> None:
        """``req`` joined ``waiting`` (for a distributed policy: before it is bound); ``again``: it was waiting
        before a re-plan (the policy's state must not treat its client as newly backlogged)."""
        self.service.setdefault(req.client, 0.0)
        if self.distributed:
            return
        self.local(None).arrived(req, waiting, again)

    def choose_worker(self, req: FairRequest, candidates: Sequence[Worker], load: Callable[[Worker], float]) -> Worker:
        """Bind ``req`` to one of ``candidates`` (distributed policies; in the caller's preference order, e.g.
        fastest first). ``load(w)``: requests bound to ``w`` and not finished, per unit of its capacity."""
        return self._select_worker(req, candidates, load, commit=True)

    def peek_worker(self, req: FairRequest, candidates: Sequence[Worker], load: Callable[[Worker], float]) -> Worker:
        """The worker :meth:`choose_worker` would bind ``req`` to now, nothing changed (a prediction reads it)."""
        return self._select_worker(req, candidates, load, commit=False)

    def _select_worker(self, req: FairRequest, candidates: Sequence[Worker], load: Callable[[Worker], float],
                       commit: bool) -> Worker:
        if not candidates:
            raise ValueError("no worker to choose from")
        if self.name == "rr-lpm":
            w = candidates[self._rr % len(candidates)]
            if commit:
                self._rr += 1
            return w
        if self.name == "d-vtc":
            i = self._rr_client.get(req.client, 0)
            if commit:
                self._rr_client[req.client] = i + 1
            return candidates[i % len(candidates)]
        # D2LPM SelectWorker over the candidates.
        credit = {w: self.worker_credit.get((req.client, w), 0.0) for w in candidates}
        with_credit = [w for w in candidates if credit[w] > 0]
        if not with_credit:
            # refill rounds of Q^w on every candidate until one has credit, counted in one pass (one round a loop
            # took debt / Q^w turns: an hour of the event loop for an 8k-token prompt at w_e 1e6, Q^w 1)
            q_w = self.cfg.worker_quantum
            rounds = min(_rounds_to_credit(q, q_w) for q in credit.values())
            for w in candidates:
                credit[w] += rounds * q_w
                if commit:
                    self.worker_credit[(req.client, w)] = credit[w]
            with_credit = [w for w in candidates if credit[w] > 0]
        best = max((req.match(w) for w in candidates), default=0)
        holding = [w for w in with_credit if best > 0 and req.match(w) == best]
        pool = holding or with_credit
        order = {w: i for i, w in enumerate(candidates)}
        return min(pool, key=lambda w: (load(w), order[w]))

    def pick(self, waiting: Sequence[FairRequest], worker: Worker) -> FairRequest | None:
        """The request ``worker`` takes next among ``waiting`` (None if empty)."""
        return self.local(worker).pick(waiting, worker) if waiting else None

    def admit(self, req: FairRequest, worker: Worker) -> None:
        """``req`` starts on ``worker``: charge its input (extend tokens; VTC and D2LPM's worker credit: all of it)."""
        cfg = self.cfg
        extend = req.extend(worker)
        req.admitted_on = worker
        req.charged = cfg.w_e * extend
        self.service[req.client] = self.service.get(req.client, 0.0) + req.charged
        local = self.local(worker)
        local.charge(req.client, cfg.w_e * (req.input_tokens if isinstance(local, _VTC) else extend))
        local.took(req.client)
        if req.again:
            return
        self.admitted_requests[req.client] = self.admitted_requests.get(req.client, 0) + 1
        # Q^u follows full costs: sized on extend costs, a cache miss would put its client rounds in debt
        self.quantum.observe(cfg.cost(req.input_tokens, req.expected_output), req.input_tokens,
                             req.input_tokens - extend)

    def rebind(self, req: FairRequest, worker: Worker) -> None:
        """``req``, bound to another worker, is taken by ``worker`` (work conservation): its D2LPM worker credit
        moves along (nothing was charged locally before admission)."""
        old = req.worker
        self.local(worker).arrived(req, [req])
        if self.name == "d2lpm" and old is not None and old != worker:
            units = self.cfg.w_e * req.input_tokens
            if (req.client, old) in self.worker_credit:
                self.worker_credit[(req.client, old)] += units
            self.worker_credit[(req.client, worker)] = self.worker_credit.get((req.client, worker), 0.0) - units
        req.worker = worker

    def bound(self, req: FairRequest, worker: Worker, waiting: Sequence[FairRequest], again: bool = False) -> None:
        """``req`` was bound to ``worker`` at arrival (distributed policies; ``waiting``: the requests bound there,
        ``req`` included): the worker's local discipline sees it arrive, and D2LPM charges the client's credit
        there for its whole input (Alg. 2 charges at dispatch). ``again``: as for :meth:`arrived`."""
        req.worker = worker
        self.local(worker).arrived(req, waiting, again)
        if self.name == "d2lpm":
            key = (req.client, worker)
            self.worker_credit[key] = self.worker_credit.get(key, 0.0) - self.cfg.w_e * req.input_tokens

    def unbind(self, req: FairRequest) -> None:
        """``req`` left its worker's queue without starting (cancelled, moved to another queue, re-planned): D2LPM
        gives back the credit its binding took."""
        if self.name == "d2lpm" and req.worker is not None and req.admitted_on is None:
            key = (req.client, req.worker)
            if key in self.worker_credit:
                self.worker_credit[key] += self.cfg.w_e * req.input_tokens
        req.worker = None

    def prompt(self, req: FairRequest, worker: Worker, extend_tokens: int) -> None:
        """The exact extend of ``req`` on ``worker`` is now known (the worker reported its cached prefix): correct
        the admission charge."""
        delta = self.cfg.w_e * max(0, int(extend_tokens)) - req.charged
        if delta:
            req.charged += delta
            self.service[req.client] = self.service.get(req.client, 0.0) + delta
            local = self._worked(worker)
            if local is not None and not isinstance(local, _VTC):
                local.charge(req.client, delta)

    def refund(self, req: FairRequest, worker: Worker, gone: bool = False) -> None:
        """``req``'s admission on ``worker`` served nothing (its chain refused or failed the open; it queues again
        as a new request): undo everything the admission and its binding charged (with :meth:`prompt`'s
        correction to 0, VTC's counter and D2LPM's worker credit stayed charged). It stays one admitted request:
        its next admission is marked ``again`` and not counted; ``gone``: nobody waits for it any more, so it is
        not counted either."""
        cfg = self.cfg
        self.service[req.client] = self.service.get(req.client, 0.0) - req.charged
        local = self._worked(worker)
        if local is not None:  # (a worker re-planned away took its charges with it)
            local.charge(req.client, -(cfg.w_e * req.input_tokens if isinstance(local, _VTC) else req.charged))
        if self.name == "d2lpm":
            key = (req.client, req.worker if req.worker is not None else worker)
            if key in self.worker_credit:
                self.worker_credit[key] += cfg.w_e * req.input_tokens
        if gone and not req.again and self.admitted_requests.get(req.client, 0) > 0:
            self.admitted_requests[req.client] -= 1
        req.charged = 0.0

    def input(self, client: str, worker: Worker | None, tokens: int) -> None:
        """``worker`` computed ``tokens`` more input tokens for ``client`` outside an admission (a session's turn on
        the chain it holds)."""
        self._charge(client, worker, self.cfg.w_e * tokens)

    def output(self, client: str, worker: Worker | None, tokens: int = 1) -> None:
        """``tokens`` output tokens were generated for ``client`` on ``worker`` (None: counted on no worker now)."""
        self._charge(client, worker, self.cfg.w_q * tokens)

    def _charge(self, client: str, worker: Worker | None, units: float) -> None:
        """Work done for a running request: its client's service, local counter and D2LPM worker credit (for no
        worker of the plan, :meth:`_worked`: its service alone)."""
        self.service[client] = self.service.get(client, 0.0) + units
        local = self._worked(worker)
        if local is None:
            return
        local.charge(client, units)
        if self.name == "d2lpm":
            key = (client, worker)
            self.worker_credit[key] = self.worker_credit.get(key, 0.0) - units

    def counters(self, worker: Worker | None) -> dict[str, float]:
        """The local discipline's counters on ``worker`` (VTC's, DLPM's deficits; None: the central one), a copy;
        empty for a worker it has none on yet (none is made)."""
        loc = self._local.get(worker if self.distributed else None)
        return loc.snapshot() if loc is not None else {}

    def snapshot(self) -> dict[str, Any]:
        """Counters for APIs and tests: service per client, local counters (per worker when distributed)."""
        local = {("*" if w is None else str(w)): loc.snapshot() for w, loc in self._local.items()}
        return {"policy": self.name, "quantum": self.quantum.value, "service": dict(self.service),
                "admitted": dict(self.admitted_requests), "counters": local}


class FairDispatcher:
    """JFFC's capacity rule with a fair queue: a new job starts on a free chain or waits; a chain whose job ended
    takes the job :class:`FairPolicy` picks for it. Same contract as :class:`~petals_chain.algorithms.jffc.
    JFFCDispatcher` (``arrive``/``complete``/``adopt``/``remove_job``, ``queue``, ``queue_length``,
    ``last_started``), so the orchestrator's dispatch and the simulator drive either.

    ``describe(job) -> FairRequest`` tells the policy who sent a job and what it holds cached where (the request's
    ``item`` must be the job); ``workers``: stable worker ids of ``chains`` (default: their indices). Central
    policies start a job on the free chain holding its longest prefix (then the fastest); distributed ones bind
    it with :meth:`FairPolicy.choose_worker` (see the module). A caller that refuses the job it just queued (its
    queue is full) takes it back with :meth:`refuse`, which leaves the policy as if it never arrived.
    """

    def __init__(self, chains: Sequence[Any], policy: FairPolicy, describe: Callable[[Any], FairRequest],
                 workers: Sequence[Worker] | None = None):
        self.chains = list(chains)
        params = [_chain_rate_capacity(ch) for ch in self.chains]
        self.rates = [mu for mu, _ in params]
        self.capacities = [cap for _, cap in params]
        self.workers = list(workers) if workers is not None else list(range(len(self.chains)))
        if len(self.workers) != len(self.chains) or len(set(self.workers)) != len(self.workers):
            raise ValueError("workers must name each chain once")
        self._index = {w: k for k, w in enumerate(self.workers)}
        self.policy = policy
        policy.retain(self.workers)
        self.describe = describe
        self.occupancy = [0] * len(self.chains)
        self._bound = [0] * len(self.chains)  # waiting jobs bound to each chain (distributed policies)
        self._waiting: dict[int, FairRequest] = {}  # seq -> request, arrival order
        self._by_item: dict[int, FairRequest] = {}  # id(job) -> its request
        self._seq = itertools.count()
        # fastest first, then the lower index (JFFC's order); chains of capacity 0 never take a job
        self._order = sorted((k for k in range(len(self.chains)) if self.capacities[k] > 0),
                             key=lambda k: (-self.rates[k], k))
        self.last_started = False
        self.started: FairRequest | None = None  # the request of the last job started (for the caller's charges)
        self._undo: tuple[FairRequest, tuple] | None = None  # the last arrival and the policy's state before it

    # ---- contract ---------------------------------------------------------------------------------
    @property
    def running(self) -> list[int]:
        return self.occupancy

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def queue(self) -> list[Any]:
        """Waiting jobs in arrival order."""
        return [r.item for r in self._waiting.values()]

    def free_chains(self) -> int:
        return sum(1 for k in self._order if self.occupancy[k] < self.capacities[k])

    def request_of(self, job: Any) -> FairRequest | None:
        return self._by_item.get(id(job))

    def peek_binding(self, req: FairRequest) -> tuple[int, list[FairRequest]] | None:
        """Distributed policies: the chain a new request ``req`` would be bound to if it arrived now, with every chain
        full (:meth:`arrive`'s choice: :meth:`FairPolicy.peek_worker` over all chains), and the requests waiting
        bound there, oldest first; nothing changes. None if a chain has a free slot (it starts at once) or none
        takes jobs."""
        if not self.policy.distributed or not self._order or self.free_chains():
            return None
        w = self.policy.peek_worker(req, [self.workers[k] for k in self._order], self._load)
        return self._index[w], [r for r in self._waiting.values() if r.worker == w]

    def arrive(self, job: Any) -> int | None:
        req = self.describe(job)
        if req.item is not job:
            raise ValueError("describe(job).item must be the job")
        req.seq = next(self._seq)
        req.worker = None
        waiting = list(self._waiting.values())
        self._undo = (req, self.policy.mark(req.client))
        self.policy.arrived(req, waiting + [req])
        free = [k for k in self._order if self.occupancy[k] < self.capacities[k]]
        if self.policy.distributed:
            cands = free or self._order
            if not cands:
                return self._wait(req)
            w = self.policy.choose_worker(req, [self.workers[k] for k in cands], self._load)
            k = self._index[w]
            self.policy.bound(req, w, [r for r in waiting if r.worker == w] + [req])
            if self.occupancy[k] < self.capacities[k]:
                return self._start_now(req, k)
            self._bound[k] += 1
            return self._wait(req)
        if free and not self._waiting:
            k = min(free, key=lambda k: (-req.match(self.workers[k]), -self.rates[k], k))
            return self._start_now(req, k)
        return self._wait(req)

    def arrive_all(self, jobs: Iterable[Any], fresh: Collection[Any] = ()) -> list[tuple[Any, int]]:
        """``jobs`` that were waiting before a re-plan, in arrival order: all are queued first and then every free
        slot takes the job the policy picks (arriving one by one, the first would take a free chain whatever the
        policy says). ``fresh``: those of them the policy never saw (they came while no chain existed): they
        arrive as new, the others as waiting all along. Returns the ``(job, chain index)`` pairs started."""
        self._undo = None
        for job in jobs:
            req = self.describe(job)
            req.seq = next(self._seq)
            req.worker = None
            again = job not in fresh
            self.policy.arrived(req, list(self._waiting.values()) + [req], again=again)
            if self.policy.distributed and self._order:
                w = self.policy.choose_worker(req, [self.workers[k] for k in self._order], self._load)
                self.policy.bound(req, w, [r for r in self._waiting.values() if r.worker == w] + [req], again=again)
                self._bound[self._index[w]] += 1
            self._wait(req)
        started = []
        for k in self._order:
            while self.occupancy[k] < self.capacities[k]:
                req = self._pick(k)
                if req is None:
                    break
                self._forget(req)
                self._start(req, k)
                started.append((req.item, k))
        return started

    def complete(self, k: int) -> Any | None:
        """A job left chain ``k``: start the job the policy picks for it and return it, or None if none waits."""
        if not (0 <= k < len(self.chains)) or self.occupancy[k] <= 0:
            raise ValueError(f"no job is running on chain {k!r}")
        self._undo = None  # a pick may refill deficits: an arrival before it can no longer be undone
        self.occupancy[k] -= 1
        if self.occupancy[k] >= self.capacities[k]:  # capacity shrank meanwhile: nothing starts here
            return None
        req = self._pick(k)
        if req is None:
            return None
        self._forget(req)
        self._start(req, k)
        return req.item

    def adopt(self, k: int, job: Any) -> bool:
        """Count ``job``, already running on chain ``k`` (carried over a re-plan), if ``k`` has room; no charge."""
        if not (0 <= k < len(self.chains)) or self.occupancy[k] >= self.capacities[k]:
            return False
        self.occupancy[k] += 1
        return True

    def remove_job(self, job: Any) -> bool:
        req = self._by_item.get(id(job))
        if req is None:
            return False
        self._undo = None
        self._forget(req)
        self.policy.unbind(req)
        return True

    def refuse(self, job: Any) -> bool:
        """Take ``job`` out of the queue as if it had never arrived (the caller refuses it: queue full): unlike
        :meth:`remove_job`, the policy's state goes back to what it was before (VTC's counter lift, DLPM's deficit
        entry, d-vtc's and rr-lpm's round robin, D2LPM's credit refill). Only for the last job to :meth:`arrive`,
        still waiting, with nothing in between; False if it is not waiting."""
        req = self._by_item.get(id(job))
        if req is None:
            return False
        if self._undo is None or self._undo[0] is not req:
            raise ValueError("refuse() undoes the last arrival only, before anything else happens")
        self._forget(req)
        self.policy.restore(self._undo[1])
        req.worker = None
        self._undo = None
        return True

    def drain(self) -> list[Any]:
        """Take every waiting job out (a re-plan re-queues them in a new dispatcher, :meth:`arrive_all`), in
        arrival order; their bindings are undone, so they are not charged twice."""
        reqs = list(self._waiting.values())
        for req in reqs:
            self._forget(req)
            self.policy.unbind(req)
        return [r.item for r in reqs]

    # ---- internals --------------------------------------------------------------------------------
    def _load(self, w: Worker) -> float:
        k = self._index[w]
        return (self.occupancy[k] + self._bound[k]) / max(1, self.capacities[k])

    def _wait(self, req: FairRequest) -> None:
        self._waiting[req.seq] = req
        self._by_item[id(req.item)] = req
        self.last_started = False
        return None

    def _start(self, req: FairRequest, k: int) -> int:
        self.occupancy[k] += 1
        w = self.workers[k]
        if self.policy.distributed and req.worker != w:
            self.policy.rebind(req, w)
        self.policy.admit(req, w)
        self.last_started = True
        self.started = req
        return k

    def _start_now(self, req: FairRequest, k: int) -> int:
        """Start ``req`` at its arrival on chain ``k``, with nothing waiting: the policy picks it as the only waiting
        request, so DLPM refills its client's deficit first when it has no credit, as the seed's admission loop
        does. Started straight, a client alone on free chains ran its deficit down without end (-15,100 after 50
        requests) and was starved once another client came, until that one had been served as much."""
        self.policy.pick([req], self.workers[k])
        return self._start(req, k)

    def _forget(self, req: FairRequest) -> None:
        del self._waiting[req.seq]
        del self._by_item[id(req.item)]
        if req.worker is not None and req.worker in self._index:
            k = self._index[req.worker]
            if self._bound[k] > 0 and self.policy.distributed:
                self._bound[k] -= 1

    def _pick(self, k: int) -> FairRequest | None:
        if not self._waiting:
            return None
        w = self.workers[k]
        waiting = list(self._waiting.values())
        if self.policy.distributed:
            own = [r for r in waiting if r.worker == w]
            if own:
                return self.policy.pick(own, w)
            # Work conservation: nothing bound here, take what this chain's discipline prefers among the rest.
        return self.policy.pick(waiting, w)


class ServiceMeter:
    """Each client's service over the last ``window_s`` seconds and Jain's index among the clients that stayed
    backlogged through it. Times are the caller's clock, in seconds.

    The seed takes Jain's index only over the interval in which every client is backlogged. A server has no fixed
    set of clients, so the meter samples which clients have a request waiting (:meth:`sample`, at a steady period)
    and compares those backlogged in at least ``BACKLOGGED_SHARE`` of the window's contention (its samples from the
    first to the last in which anyone waited): clients that would take any more service they were given, which a
    fair order serves equally. A client that waited now and then got what it asked for and is left out (taking
    every client that waited once called a fairly served light client unfair: 0.52).

    Service is summed per client in buckets of about ``window_s / BUCKETS`` (one entry per client and bucket, not
    one per event: memory and time grew with the request rate); the bucket the window's start cuts counts by the
    fraction of it inside the window (exact for service spread evenly within a bucket)."""

    BACKLOGGED_SHARE = 0.9
    MIN_SAMPLES = 5
    BUCKETS = 120

    def __init__(self, window_s: float = 60.0):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = float(window_s)
        # a power of two near window_s / BUCKETS: bucket edges are exact in binary floating point, so an event at
        # the window's start is in or out by its time alone (not by the rounding of a division)
        self.bucket_s = 2.0 ** round(math.log2(self.window_s / self.BUCKETS))
        # [bucket, client, units] entries, in the order their first units came (oldest bucket first, the clock
        # being steady); _open finds a live entry by (bucket, client)
        self._events: deque[list] = deque()
        self._open: dict[tuple[int, str], list] = {}
        self._sums: dict[str, float] = {}  # per client, over the entries kept (whole buckets)
        self._waited: dict[str, float] = {}  # client -> last time it had a request waiting
        self._samples: deque[tuple[float, frozenset]] = deque()  # (time, clients with a request waiting)

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        self._trim_service(cutoff)
        for c in [c for c, t in self._waited.items() if t < cutoff]:
            del self._waited[c]
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def _trim_service(self, cutoff: float) -> None:
        """Drop the entries of buckets wholly before ``cutoff`` (the oldest first)."""
        while self._events and (self._events[0][0] + 1) * self.bucket_s <= cutoff:
            k, c, units = self._events.popleft()
            del self._open[(k, c)]
            left = self._sums.get(c, 0.0) - units  # corrections can be negative: sums need not stay positive
            if abs(left) <= 1e-9:
                self._sums.pop(c, None)
            else:
                self._sums[c] = left

    def forget(self, *clients: str) -> None:
        """Drop ``clients`` from the window (their names are gone): their service, their waits and their places in the
        samples, so that the rates, the backlogged clients and Jain's index are those of the clients that remain.
        One pass over the window for them all (a reload that removed 1,000 names: one pass, not 1,000)."""
        gone = set(clients)
        if not gone:
            return
        if any(e[1] in gone for e in self._events):
            self._events = deque(e for e in self._events if e[1] not in gone)
            self._open = {key: e for key, e in self._open.items() if key[1] not in gone}
        for client in gone:
            self._sums.pop(client, None)
            self._waited.pop(client, None)
        if any(not gone.isdisjoint(c) for _, c in self._samples):
            self._samples = deque((t, c - gone) for t, c in self._samples)

    def served(self, now: float, client: str, units: float) -> None:
        if units:
            key = (math.floor(now / self.bucket_s), client)
            entry = self._open.get(key)
            if entry is None:
                entry = self._open[key] = [key[0], client, 0.0]
                self._events.append(entry)
            entry[2] += float(units)
            self._sums[client] = self._sums.get(client, 0.0) + float(units)
            self._trim_service(now - self.window_s)  # bounded whoever reads it (samples stop with the queue)

    def waited(self, now: float, client: str) -> None:
        """``client`` had a request waiting at ``now`` (listed as backlogged; Jain's index reads :meth:`sample`)."""
        self._waited[client] = now

    def sample(self, now: float, backlogged: Iterable[str]) -> None:
        """The clients with a request waiting at ``now``; called at a steady period (Jain's index counts samples)."""
        clients = frozenset(backlogged)
        self._samples.append((now, clients))
        for c in clients:
            self._waited[c] = now
        self._trim(now)

    def rates(self, now: float) -> dict[str, float]:
        """Service units per second over the window, per client served in it."""
        self._trim(now)
        sums = dict(self._sums)
        cutoff = now - self.window_s
        for k, c, units in self._events:  # the oldest buckets first: those the window's start cuts
            lo = k * self.bucket_s
            if lo >= cutoff:
                break
            sums[c] = sums.get(c, 0.0) - units * (cutoff - lo) / self.bucket_s  # the part before the window
        return {c: max(0.0, v) / self.window_s for c, v in sums.items()}

    def backlogged(self, now: float) -> list[str]:
        """Clients that had a request waiting at some time in the window."""
        self._trim(now)
        return sorted(self._waited)

    def saturated(self, now: float) -> list[str]:
        """Clients backlogged in at least ``BACKLOGGED_SHARE`` of the window's contention (the samples from the
        first to the last with anyone waiting: an idle lead-in or tail is no one's share; none before
        ``MIN_SAMPLES``)."""
        self._trim(now)
        busy = [i for i, (_, clients) in enumerate(self._samples) if clients]
        if not busy or busy[-1] - busy[0] + 1 < self.MIN_SAMPLES:
            return []
        span = [clients for i, (_, clients) in enumerate(self._samples) if busy[0] <= i <= busy[-1]]
        counts = Counter(c for clients in span for c in clients)
        return sorted(c for c, k in counts.items() if k >= self.BACKLOGGED_SHARE * len(span))

    def jain(self, now: float) -> float | None:
        """Jain's index of the window's service among the :meth:`saturated` clients (None with fewer than two)."""
        clients = self.saturated(now)
        if len(clients) < 2:
            return None
        rates = self.rates(now)
        return jain_index([rates.get(c, 0.0) for c in clients])


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n sum x^2)``: 1 when all equal, 1/n when one gets everything."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("jain_index needs at least one value")
    sq = sum(x * x for x in xs)
    return 1.0 if sq == 0 else sum(xs) ** 2 / (len(xs) * sq)


def service_bound(cfg: FairnessConfig, quantum: float, max_input_tokens: int, max_batch_tokens: int,
                  workers: int = 1) -> float:
    """Thm 4.1 / 5.1: the most service two continuously backlogged clients can differ by, ``2 |W| (U + Q^u)`` with
    ``U = w_e L_input + w_q M`` (``M``: most tokens a worker's running batch generates per step, i.e. requests
    it runs at once)."""
    u = cfg.w_e * max_input_tokens + cfg.w_q * max_batch_tokens
    return 2.0 * workers * (u + quantum)


__all__ = ["FAIRNESS_POLICIES", "DISTRIBUTED_POLICIES", "FairnessConfig", "FairRequest", "FairPolicy",
           "FairDispatcher", "AdaptiveQuantum", "ServiceMeter", "jain_index", "service_bound"]
