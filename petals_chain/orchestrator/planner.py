"""Planner: live server view, tau_c/tau_p estimates, c* + GBP-CR + GCA, signed assignment epochs.

Units: memory in bytes (``M_j`` = ``memory_bytes``, ``s_m``/``s_c`` from the server records), times in
seconds. A *job* for the planner is one request: one prefill step plus its decode steps; ``steps_per_job``
(online mean, with a prior) turns per-message measurements into the paper's per-job ``tau_c_j`` and
``tau_p_j``.

Servers are untrusted: a server is planned by the compute time it delivers once measured, and flagged when
that is more than ``TAU_P_SUSPECT_RATIO`` times what it advertises (:meth:`Planner.tau_p`). A server whose
session failed (dead, silent, or an invalid reply) is banned from the plan with exponential backoff
(:meth:`Planner.report_failure`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from petals_chain.algorithms.token_budget import JobTokenEstimate, jobs_in_budget
from petals_chain.model import Chain, ModelSpec, Placement, ServerSpec, units_that_fit
from petals_chain.swarm.launch import EXHAUSTED_LOG_S, out_of_descriptors
from petals_chain.swarm.memory import DEFAULT_PAGE_SIZE, capped_slots, slot_tokens
from petals_chain.swarm.periodic import run_every
from petals_chain.swarm.reachability import is_circuit, public_dial_error
from petals_chain.swarm.records import EPOCH_MAX
from petals_chain.swarm.sources import fingerprint_problem

logger = logging.getLogger(__name__)

EWMA = 0.2
TAU_P_MIN_OBS = 8  # decode steps observed on a server before its measured tau_p replaces the advertised one
TAU_P_SUSPECT_RATIO = 2.0  # measured tau_p above this multiple of the advertised one: flagged
# a server's memory planned at most (1 PiB): a record may announce any integer, and the slots 10**30 bytes make
# overflowed int64 in GBP-CR's c tuning (negative slots: chains of capacity 0)
MEMORY_MAX = 2 ** 50
# a record's s_m or s_c further than this factor from the orchestrator's is not believed (a dtype takes 1 to 8 bytes,
# nf4 about a seventh of fp32's block): such a server is planned with the orchestrator's sizes, as an older one
SIZE_RATIO_MAX = 64.0
STARTS_KEPT = 8  # process starts remembered per server (an older record read late is told from a restart)
# A server record's lifetime at the servers' default --refresh-s 30 (server/announce.py: it expires 3 x refresh_s after
# its last publish): a read of the records that names none of the live servers (a DHT get that timed out or reached no
# node returns nothing) is taken for their silent departure only once that lasts this long (Planner.refresh)
SERVER_RECORD_TTL_S = 90.0
# The chains' service times scale with the steps per job: they are recomputed once the estimate leaves this factor of
# the value they were computed with (a band, not fixed buckets: a mean hovering at a bucket edge recomputed them at
# every refresh, each a new dispatch generation)
STEPS_PER_JOB_BAND = 1.25
# chains recomputed to the same hops, spans and capacities, their service times within this fraction of the installed
# ones, are not installed again (a new dispatch generation drains and re-arrives every queued job for nothing)
CHAIN_TIME_TOLERANCE = 0.05


@dataclass
class ServerView:
    """What the orchestrator knows about one server."""

    peer_id: str
    record: Any  # ServerRecord
    first_seen: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    rtt_s: float | None = None  # one request/response round trip (ping), EWMA
    ping_failures: int = 0
    step_s_per_block: float | None = None  # observed compute per block per relay step, EWMA
    comm_s_per_step: float | None = None  # observed hop time minus server compute per relay step, EWMA
    hop_obs: int = 0
    failed_at: float | None = None  # wall time a session on it failed; cleared when its ban is over
    strikes: int = 0  # failures counted for the ban backoff (reset after ban_reset_s without one)
    banned_until: float = 0.0  # planner clock: not planned before this
    flagged_slow: bool = False  # measured tau_p was found above TAU_P_SUSPECT_RATIO x advertised
    distrusted: bool = False  # banned for good: audits found it returning wrong results (audit.py)
    # how a fresh dial from the orchestrator reached the record's maddrs: unknown (none announced) | pending |
    # direct | relayed | unreachable; a server is planned only once reachable (swarm/reachability.py)
    reachability: str = "unknown"
    reach_key: tuple = ()  # the maddrs last checked
    reach_checked: float = 0.0  # monotonic time of the last check
    reach_error: str = ""
    # --load-deadline-s: the planner-clock time an assignment gave it a span it did not serve (None: nothing awaited),
    # and whether it was still not online with that span at the deadline (planned around like a failed load)
    awaiting_since: float | None = None
    load_overdue: bool = False
    deadline_scale: float = 1.0  # its deadline: load_deadline_s x this (load_deadline_scale as its clock started)
    # seconds its last awaited load took, from the assignment to online with the span (None: none ended since its clock
    # last started); the model placer shortens a doubled deadline by it (a server slow once kept it for good)
    load_s: float | None = None
    # the process starts its records announced (started_at, 0 left out; Planner._note_start): another one is a restart
    starts: tuple[float, ...] = ()
    # its record reports a failed load of the very span this planner assigns it (set at each refresh): a report of a
    # span it is no longer given (another orchestrator's, one before a restart of this one) must not keep it out
    failed_assigned: bool = False
    span_epoch: int = 0  # the assignment epoch that gave it its current span (a failure announced before is stale)

    @property
    def usable(self) -> bool:
        # tau_p == 0: the server is still profiling; plan with it once its speed is known.
        return (self.failed_at is None and self.record.state != "offline" and self.record.tau_p > 0
                and self.reachability not in ("pending", "unreachable") and not self.load_failed)

    @property
    def load_failed(self) -> bool:
        """It cannot load the span it was assigned, by its record's word or by the load deadline (``load_overdue``):
        planned as if it were not there until it serves that span or restarts (an offline one is gone, whatever it
        says)."""
        return self.record.state != "offline" and (self.load_overdue or self.failed_assigned)

    @property
    def load_reported(self) -> bool:
        """Its record says it cannot load the span it was assigned (swarm/records.py ``failed_span``, ``load_error``;
        an older server's record never says so)."""
        r = self.record
        return r.state != "offline" and bool(getattr(r, "failed_span", None) or getattr(r, "load_error", ""))

    @property
    def banned(self) -> bool:
        return self.failed_at is not None


# RateEstimator: arrivals are counted in this many buckets over the window (a bounded count whatever the rate: every
# arrival time of the last 300 s took ~12 MB at 1,000 req/s); the latest ARRIVALS_KEPT arrival times are kept as well
# (the model placer feeds its mix-drift detector with them each round)
RATE_BUCKETS = 300
ARRIVALS_KEPT = 4096


class RateEstimator:
    """Arrival rate (req/s) over a sliding window, shrunk toward a prior while few arrivals are seen. Thread-safe.

    Arrivals are counted in ``RATE_BUCKETS`` buckets of ``window_s / RATE_BUCKETS``; the oldest bucket counts by the
    fraction of it still inside the window (exact for arrivals spread evenly within a bucket: within 1 % of the exact
    count on a Poisson trace). ``arrivals`` holds the latest ``ARRIVALS_KEPT`` arrival times of the window."""

    def __init__(self, prior: float = 0.5, prior_weight_s: float = 30.0, window_s: float = 300.0):
        self.prior = prior
        self.prior_weight_s = prior_weight_s
        self.window_s = window_s
        self.bucket_s = window_s / RATE_BUCKETS
        self.t0 = time.monotonic()
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        self.buckets: deque[list] = deque()  # [bucket index (start / bucket_s), arrivals in it], oldest first
        # the planner's searches run in a thread (rate() for each bound) while requests arrive on the event loop: two
        # trims of the same expired arrival raised IndexError from popleft() (that refresh's re-plan was lost)
        self._lock = threading.Lock()

    def arrive(self, t: float | None = None) -> None:
        t = time.monotonic() if t is None else t
        k = math.floor(t / self.bucket_s)
        with self._lock:
            self.arrivals.append(t)
            for b in reversed(self.buckets):  # the newest, unless an arrival time comes late
                if b[0] <= k:
                    if b[0] == k:
                        b[1] += 1
                    else:
                        self._insert(k)
                    break
            else:
                self.buckets.appendleft([k, 1])
            self._trim(t)  # here too: with a fixed --arrival-rate nobody asks rate(), and the log grew per request

    def _insert(self, k: int) -> None:
        """A new bucket ``k`` in order (the caller holds the lock; almost always at the end)."""
        if self.buckets[-1][0] < k:
            self.buckets.append([k, 1])
            return
        i = next(i for i, b in enumerate(self.buckets) if b[0] > k)
        self.buckets.insert(i, [k, 1])

    def _trim(self, now: float) -> None:
        """Drop the arrivals and the buckets wholly older than the window (the caller holds the lock)."""
        cutoff = now - self.window_s
        while self.arrivals and self.arrivals[0] < cutoff:
            self.arrivals.popleft()
        while self.buckets and (self.buckets[0][0] + 1) * self.bucket_s <= cutoff:
            self.buckets.popleft()

    def count_since(self, start: float, now: float | None = None) -> float:
        """Arrivals from ``start`` (at most ``window_s`` ago) to ``now``; a bucket that ``start`` cuts counts by the
        fraction of it after ``start``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return self._count(max(start, now - self.window_s))

    def times_since(self, start: float, now: float | None = None) -> list[float]:
        """The arrival times after ``start`` (at most ``window_s`` before ``now``), in order: the kept ones and, where
        more arrived since ``start`` than ``ARRIVALS_KEPT``, the others as their buckets count them, at even times
        within each bucket (what a consumer counting arrivals per span needs: the kept times alone capped them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            start = max(start, now - self.window_s)
            kept = sorted(t for t in self.arrivals if t > start)
            if len(self.arrivals) < ARRIVALS_KEPT or not kept or min(self.arrivals) <= start:
                return kept  # every arrival since start is kept
            first, out, carry = kept[0], [], 0.0
            for k, n in self.buckets:
                lo = max(k * self.bucket_s, start)
                hi = min((k + 1) * self.bucket_s, first)
                if hi <= lo:
                    if k * self.bucket_s >= first:
                        break
                    continue
                if (k + 1) * self.bucket_s > first:  # first's bucket: less what is kept of it
                    missing = n - sum(1 for t in kept if t < (k + 1) * self.bucket_s)
                    missing *= (hi - lo) / max(first - k * self.bucket_s, 1e-12)
                else:
                    missing = n * (hi - lo) / self.bucket_s
                carry += max(0.0, missing)
                m = int(carry)
                carry -= m
                out.extend(lo + (hi - lo) * (i + 0.5) / m for i in range(m))
            return out + kept

    def _count(self, start: float) -> float:
        total = 0.0
        for k, n in reversed(self.buckets):
            lo = k * self.bucket_s
            if lo >= start:
                total += n
                continue
            total += n * max(0.0, (lo + self.bucket_s - start) / self.bucket_s)
            break
        return total

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            count = self._count(now - self.window_s)
        span = min(self.window_s, now - self.t0)
        return (count + self.prior * self.prior_weight_s) / (span + self.prior_weight_s)


@dataclass
class Plan:
    """A plan and its prediction."""

    c: int | None
    placement: Placement
    chains: list[Chain]
    lower: float
    upper: float
    reason: str = ""

    @property
    def predicted(self) -> float:
        return self.lower


@dataclass(frozen=True)
class CappedServerSpec(ServerSpec):
    """A server whose volunteer caps its KV cache (``--cache-tokens-per-block``): in ``m`` blocks it holds at most
    ``m * cache_tokens_per_block // max_length`` slots, whatever its memory (``swarm.memory.capped_slots``, as the
    server loads)."""

    cache_tokens_per_block: int = 0
    max_length: int = 1

    def residual_slots(self, model: ModelSpec, num_blocks: int) -> int:
        return capped_slots(super().residual_slots(model, num_blocks), num_blocks, self.cache_tokens_per_block,
                            self.max_length)

    def most_jobs(self) -> int:
        """The most jobs its cap holds over a span of any length (each takes ``max_length`` tokens in every block).
        0, not one: it is planned by its memory as before (paged, it serves shorter jobs; else its failed load says
        what it holds, which an operator needs to read)."""
        return self.cache_tokens_per_block // max(1, self.max_length)

    def max_blocks(self, model: ModelSpec, capacity: int) -> int:
        """Eq. 8's ``m_j(c)``, or 0 where its cap holds fewer than ``c`` jobs, but some (GBP-CR gives it no blocks, as
        a server too small for ``c``): it was given a span as if its memory's slots held ``c``."""
        return 0 if 0 < self.most_jobs() < capacity else super().max_blocks(model, capacity)


@dataclass(frozen=True)
class SizedServerSpec(CappedServerSpec):
    """A server whose record announces its own ``s_m`` and ``s_c`` (``block_size``, ``cache_size``: its dtype,
    quantization and KV pages), not the orchestrator's: it holds Eq. 8's ``m_j(c)`` blocks and Eq. 3's slots in its
    own sizes and its own budget ``own_memory`` (``M_j``), as it loads. Planned with the orchestrator's, a bf16 server
    under an fp32 orchestrator was given half the blocks it holds, and an fp32 one under a bf16 orchestrator twice
    as many: it refused them and stayed idle.

    ``memory`` is ``M_j`` in the orchestrator's units, scaled up so that Eq. 8 and 3 in those never count fewer blocks,
    slots or jobs than its own sizes (GBP-CR and the ``c`` tuning walk a server by the least of Eq. 8 and its
    ``max_blocks``, and tune ``c`` up to the most jobs any ``memory`` holds); exact when both sizes scale alike, as a
    dtype does."""

    own_memory: float = 0.0
    block_size: float = 1.0
    cache_size: float = 1.0

    @classmethod
    def of(cls, *, memory: float, block_size: float, cache_size: float, model: ModelSpec,
           **fields: Any) -> "SizedServerSpec":
        """The spec of a server with budget ``memory`` (``M_j``) and its own sizes, planned beside ``model``."""
        scale = max(model.block_size / block_size, model.cache_size / cache_size) * (1 + 1e-9)  # (float rounding)
        return cls(memory=memory * scale, own_memory=memory, block_size=block_size, cache_size=cache_size, **fields)

    def residual_slots(self, model: ModelSpec, num_blocks: int) -> int:
        slots = max(0, units_that_fit(self.own_memory - self.block_size * num_blocks, self.cache_size))
        return capped_slots(slots, num_blocks, self.cache_tokens_per_block, self.max_length)

    def max_blocks(self, model: ModelSpec, capacity: int) -> int:
        if 0 < self.most_jobs() < capacity:
            return 0
        return min(units_that_fit(self.own_memory, self.block_size + self.cache_size * capacity), self.block_cap(model))

    def per_block_memory(self, model: ModelSpec, cache_fraction: float) -> float:
        """``M_j`` in ``model``'s units for a rule that divides it by ``s_m + s_c x`` (PETALS' placement, ``x`` its
        fixed cache over ``max_length``): as many blocks as its own sizes give."""
        return self.own_memory * (model.block_size + model.cache_size * cache_fraction) / (
            self.block_size + self.cache_size * cache_fraction)


def started_at_of(record: Any) -> float:
    """When the process that announced ``record`` started (0: unknown, an older server's record, or none)."""
    return float(getattr(record, "started_at", 0.0) or 0.0)


def note_start(seen: tuple[float, ...], started: float) -> tuple[float, ...] | None:
    """``seen`` (a server's last ``STARTS_KEPT`` process starts) with ``started`` added, if it is not among them: a
    restart (also to an earlier time: a clock set back); None if it is (an older record read late)."""
    return None if started in seen else (seen + (started,))[-STARTS_KEPT:]


def same_chains(a: Sequence[Chain], b: Sequence[Chain], tolerance: float = CHAIN_TIME_TOLERANCE) -> bool:
    """Whether chain sets ``a`` and ``b`` are the same for dispatch: in order, the same hops, spans and capacities, and
    service times within ``tolerance`` (relative) of each other."""
    return len(a) == len(b) and all(
        (x.servers, x.spans, x.blocks, x.capacity) == (y.servers, y.spans, y.blocks, y.capacity)
        and abs(x.service_time - y.service_time) <= tolerance * max(abs(x.service_time), abs(y.service_time))
        for x, y in zip(a, b))


def _total_rate(chains: Sequence[Chain]) -> float:
    """``sum_k c_k mu_k`` (jobs/s): the service rate of ``chains`` when all are busy."""
    return sum(ch.capacity / ch.service_time for ch in chains if ch.service_time > 0)


class Planner:
    """Keeps the server view fresh, decides placements and chains, and feeds the dispatcher.

    ``on_chains(chains)`` is called whenever the usable chain set changes (GCA on the servers that are
    online and serve their assigned span). Assignments are published as signed epochs through ``dht``.
    """

    def __init__(self, *, dht: Any, prefix: str, client: Any, max_length: int, on_chains: Callable[[list[Chain]], None],
                 arrival_rate: float | None = None, rho_bar: float = 0.7, placement: str = "gbp-cr",
                 use_all_servers: bool = False, move_margin: float = 0.2, settle_s: float = 2.0, refresh_s: float = 1.0,
                 replan_interval_s: float = 30.0, prior_tokens_per_job: float = 16.0,
                 serialization_s: float = 2e-4, assignment_expiration_s: float = 60.0,
                 model_spec_fallback: Callable[[], ModelSpec | None] | None = None,
                 on_failure: Callable[[str], None] | None = None, petals_cache_tokens: int = 4096,
                 bprr_r: int | None = None, model_fingerprint: str = "", model_legacy_fingerprint: str = "",
                 ban_base_s: float = 5.0,
                 ban_max_s: float = 300.0, ban_reset_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
                 job_tokens: int | None = None, prober: Any = None, reach_recheck_s: float = 15.0,
                 load_deadline_s: float = 600.0, records_lost_s: float = SERVER_RECORD_TTL_S):
        self.dht = dht
        self.prefix = prefix
        self.prober = prober  # swarm.reachability.Prober; None: servers are not checked (tests of the planner alone)
        self.reach_recheck_s = reach_recheck_s  # an unreachable server is dialed again this often
        self._reach_tasks: dict[str, asyncio.Task] = {}
        self.client = client
        self.max_length = max_length
        self._short: dict[str, int] = {}  # servers left out of chains for a smaller max_length (warned once)
        self._odd_sizes: set[str] = set()  # servers whose announced s_m / s_c are not believed (warned once)
        self.on_chains = on_chains
        self.fixed_rate = arrival_rate
        self.rates = RateEstimator()
        self.rho_bar = rho_bar
        self.placement_policy = placement
        self.use_all_servers = use_all_servers  # gbp-cr: every server that can hold a block gets one
        self.move_margin = move_margin
        self.settle_s = settle_s
        self.refresh_s = refresh_s
        self.replan_interval_s = replan_interval_s
        self.serialization_s = serialization_s
        self.assignment_expiration_s = assignment_expiration_s
        self.model_spec_fallback = model_spec_fallback
        self.on_failure = on_failure
        self.petals_cache_tokens = int(petals_cache_tokens)  # PETALS placement: its fixed cache per block
        self.bprr_r = bprr_r  # BPRR placement: CG-BP target concurrency R (None: the c* GBP-CR would pick)
        self.servers: dict[str, ServerView] = {}
        self.distrusted: set[str] = set()  # banned for good (audits), kept when a record expires and returns
        self.ban_base_s, self.ban_max_s, self.ban_reset_s = ban_base_s, ban_max_s, ban_reset_s
        self.clock = clock  # for bans and load deadlines (tests pass their own)
        # a server assigned a span it does not serve, and not online with it this long after, is planned around
        # (check_load_deadlines); 0: never
        self.load_deadline_s = load_deadline_s
        # {peer: k}: its next load deadline is k x load_deadline_s (the model placer doubles it for each load of this
        # model a server was overdue on: a load slower than the deadline was restarted at every try, for good)
        self.load_deadline_scale: dict[str, float] = {}
        self._speed_changed: list[str] = []  # servers newly found slower than they claim: re-plan soon
        # Servers announcing another model (sources.ModelSource.fingerprint): never planned, shown as refused.
        self.model_fingerprint = model_fingerprint
        self.model_legacy_fingerprint = model_legacy_fingerprint  # as versions before 14a2ac8 computed it
        self.refused: dict[str, Any] = {}
        self.steps_per_job = 1.0 + prior_tokens_per_job
        # L^ of paged servers' chain capacities (algorithms/token_budget.py): learnt from the jobs' declared
        # lengths, or fixed by --job-tokens
        self.fixed_job_tokens = job_tokens
        self.job_tokens = JobTokenEstimate(max_length, prior=job_tokens)
        self._steps_obs = 0
        self.epoch = 0
        self.assignment: dict[str, tuple[int, int]] = {}
        self.plan: Plan | None = None  # the placement in force (its prediction at planning time)
        self.current: Plan | None = None  # GCA on usable servers of that placement (what dispatch uses)
        self.last_change = 0.0
        self.last_full_replan = 0.0
        self.last_publish = 0.0
        self.plan_log: deque[dict] = deque(maxlen=100)
        self._gca_key: tuple | None = None
        self._steps_ref: float | None = None  # steps per job the chains were last computed with (_chains_key)
        self._installed: list[Chain] | None = None  # the chains last given to on_chains
        self._considered: set[str] = set()
        self._planned_around: set[str] = set()  # banned servers already planned around (see held_spans)
        # servers whose record says they cannot load their span: (failed_span, load_error) as last said
        self.load_failures: dict[str, tuple[tuple[int, ...], str]] = {}
        self._lock = asyncio.Lock()
        self.model_spec: ModelSpec | None = None
        # Several orchestrators (orchestrator/groups.py): the servers of this one's group; None: every server.
        self.group: set[str] | None = None
        self.seen: dict[str, Any] = {}  # every server record of the last refresh, in this group or not
        self.refreshes = 0  # refreshes done (0: nothing of the swarm read yet)
        # failed reads of the server records in a row (one that raised, or named none of the live servers: see
        # _failed_read), and since when (planner clock) the reads have named none of them; taken for real after
        # records_lost_s
        self.records_lost_s = records_lost_s
        self.failed_reads = 0
        self._lost_since: float | None = None
        # Several models (orchestrator/placement.py): ``placed(peer_id, record)`` says whether a server is placed on
        # this model; None: a server is ours unless it serves another of the models it offers.
        self.placed: Callable[[str, Any], bool] | None = None

    # ---- estimates -----------------------------------------------------------------------------
    @property
    def arrival_rate(self) -> float:
        return self.fixed_rate if self.fixed_rate is not None else self.rates.rate()

    def tau_c(self, v: ServerView) -> float:
        """Communication time of one job with the server: one round trip per relay step + serialization."""
        if v.comm_s_per_step is not None and v.hop_obs >= 8:
            return v.comm_s_per_step * self.steps_per_job
        rtt = v.rtt_s if v.rtt_s is not None else (2e-3 + 2 * v.record.emulate_rtt_ms / 1000.0)
        return (rtt + self.serialization_s) * self.steps_per_job

    def measured_tau_p(self, v: ServerView) -> float | None:
        """Compute time per block per job the server delivers: observed decode steps per block times steps per job,
        once ``TAU_P_MIN_OBS`` decode steps were seen (None before)."""
        if v.step_s_per_block is None or v.hop_obs < TAU_P_MIN_OBS:
            return None
        return v.step_s_per_block * self.steps_per_job

    def tau_p_suspect(self, v: ServerView) -> bool:
        """The server delivers compute more than ``TAU_P_SUSPECT_RATIO`` times slower than it advertises."""
        measured = self.measured_tau_p(v)
        return measured is not None and measured > TAU_P_SUSPECT_RATIO * float(v.record.tau_p)

    def tau_p(self, v: ServerView) -> float:
        """Compute time per block per job used for planning: what the server delivers once measured (a server is
        untrusted: a false claim must not win it blocks), else what its record advertises."""
        measured = self.measured_tau_p(v)
        return measured if measured is not None else float(v.record.tau_p)

    def hop_step_s(self, v: ServerView) -> dict[str, float | None]:
        """Seconds per decode step at server ``v`` as relayed steps showed them (EWMA; None before any): its
        ``compute`` over the blocks it holds, and ``network`` (the hop's round trip less that compute; orchestrator
        relay only, since a pushed hop's reply also waits for its input)."""
        per_block = v.step_s_per_block
        return {"compute": None if per_block is None else per_block * max(1, int(v.record.num_blocks)),
                "network": v.comm_s_per_step}

    def observe_hop(self, peer_id: str, n_tokens: int, n_blocks: int, seconds: float | None,
                    compute_s: float | None = None) -> None:
        """One relay step of ``n_tokens`` through ``n_blocks`` of ``peer_id`` took ``seconds`` (incl. network).

        ``compute_s`` is the server's own time for the step when it reports one: the hop then splits exactly
        into compute (refines ``tau_p``) and communication (refines ``tau_c``). Without it, the ping RTT is
        subtracted, which under load can exceed a fast step — so such estimates never drive ``tau_c``.
        ``seconds=None`` (push mode, where a hop's reply time includes waiting for its input): compute only.
        """
        v = self.servers.get(peer_id)
        if v is None or n_blocks <= 0 or n_tokens != 1:  # decode steps only: prefill cost varies with length
            return
        if seconds is None:
            if compute_s is None or compute_s < 0.0:
                return
            per_block = compute_s / n_blocks
        elif compute_s is not None:
            if not 0.0 <= compute_s <= seconds:
                return  # a report that contradicts our own clock says nothing reliable
            per_block = compute_s / n_blocks
            comm = seconds - compute_s
            v.comm_s_per_step = comm if v.comm_s_per_step is None else (1 - EWMA) * v.comm_s_per_step + EWMA * comm
        else:
            per_block = max(0.0, seconds - (v.rtt_s or 0.0)) / n_blocks
        v.step_s_per_block = per_block if v.step_s_per_block is None else (1 - EWMA) * v.step_s_per_block + EWMA * per_block
        v.hop_obs += 1
        if not v.flagged_slow and self.tau_p_suspect(v):
            v.flagged_slow = True
            logger.warning("server %s (%s) delivers tau_p=%.4g s, %.1fx the %.4g s it advertises: planning it by what "
                           "it delivers", v.record.public_name, peer_id[:12], self.measured_tau_p(v),
                           self.measured_tau_p(v) / max(float(v.record.tau_p), 1e-12), float(v.record.tau_p))
            self._speed_changed.append(peer_id)

    def observe_job(self, steps: int) -> None:
        """A finished job made ``steps`` relay steps (prefill + decodes)."""
        self._steps_obs += 1
        w = max(EWMA, 1.0 / self._steps_obs) if self._steps_obs < 20 else 0.05
        self.steps_per_job = (1 - w) * self.steps_per_job + w * float(steps)

    def report_failure(self, peer_id: str, reason: str = "", permanent: bool = False) -> None:
        """A session on ``peer_id`` failed (dead, silent, invalid reply): drop it from the chains now and ban it
        from the plan for ``ban_base_s * 2**(strikes-1)`` seconds (at most ``ban_max_s``); a server that went
        ``ban_reset_s`` after its last ban without failing starts again at ``ban_base_s``. ``permanent``: audits
        caught it lying; it is never planned again and gives its span up (the others are planned to cover it)."""
        if permanent:
            self.distrusted.add(peer_id)
        v = self.servers.get(peer_id)
        if v is None or v.distrusted:
            return
        if permanent:
            v.distrusted = True
            v.failed_at = v.failed_at or time.time()
            v.banned_until = math.inf
            logger.warning("server %s (%s) banned for good (%s)", v.record.public_name, peer_id[:12], reason)
            if self.on_failure is not None:
                self.on_failure(peer_id)
            self._recompute_chains(reason=f"ban of {v.record.public_name or peer_id[:12]}")
            return
        if v.failed_at is not None:
            return  # already banned: the failures of one incident count once
        now = self.clock()
        if v.strikes and now - v.banned_until >= self.ban_reset_s:
            v.strikes = 0
        v.strikes += 1
        ban_s = min(self.ban_max_s, self.ban_base_s * 2 ** (v.strikes - 1))
        v.banned_until = now + ban_s
        v.failed_at = time.time()
        logger.warning("server %s (%s) failed%s; dropping it from the chains, banned for %.0f s (strike %d)",
                       v.record.public_name, peer_id[:12], f" ({reason})" if reason else "", ban_s, v.strikes)
        if self.on_failure is not None:
            self.on_failure(peer_id)
        self._recompute_chains(reason=f"failure of {v.record.public_name or peer_id[:12]}")

    def _unban(self, v: ServerView) -> bool:
        """Lift ``v``'s ban once it is over, if the server still announces itself and answered the last ping."""
        if (v.failed_at is None or v.distrusted or self.clock() < v.banned_until or v.record.state == "offline"
                or v.ping_failures):
            return False
        v.failed_at = None
        logger.info("server %s (%s): ban over, planning it again", v.record.public_name, v.peer_id[:12])
        return True

    def held_spans(self) -> dict[str, tuple[int, int]]:
        """Assigned spans of servers that are banned, or cannot load their span (by their word or by the load
        deadline), but still announce themselves. They stay in the assignment (a ban must not make a server unload, and
        a reload costs minutes on a real model; a failed load is retried by the server, which may succeed once memory
        frees up, and a slow one may still end) while the plan for everyone else is made without them; when the ban is
        over, or the load succeeds, they rejoin the chains with the blocks they hold. A dead server's record expires,
        and with it its span."""
        return {p: span for p, span in self.assignment.items()
                if (v := self.servers.get(p)) is not None and (v.banned or v.load_failed) and not v.distrusted
                and v.record.state != "offline"}

    def replacements(self, start: int, end: int) -> list[str]:
        """Servers that can take a failed hop's blocks ``[start, end)`` over: online, not banned, serving a span
        that contains them; the most free slots (as last announced) first, then the fastest."""
        views = [v for v in self.online_views() if v.record.start_block <= start
                 and end <= v.record.start_block + v.record.num_blocks and v.record.slots_total >= end - start]
        views.sort(key=lambda v: (-v.record.slots_free, self.tau_p(v)))
        return [v.peer_id for v in views]

    # ---- model spec ----------------------------------------------------------------------------
    def _model_spec(self) -> ModelSpec | None:
        """``L``, ``s_m``, ``s_c`` at the swarm's max_length (servers size their slots for it).

        Computed from the model config rather than taken from records: a record announced before the first
        assignment carries the server's default max_length, not the swarm's."""
        if self.model_spec is None and self.model_spec_fallback is not None:
            self.model_spec = self.model_spec_fallback()
        return self.model_spec

    def specs(self, views: Sequence[ServerView]) -> list[ServerSpec]:
        """Each server as the algorithms see it; one that announces ``--cache-tokens-per-block`` with its cap on
        slots (:class:`CappedServerSpec`: else a span it has not loaded yet, such as one of the model the placer just
        moved it to, was planned with the slots its memory holds, not the fewer it would load)."""
        out: list[ServerSpec] = []
        model = self._model_spec()
        for v in views:
            fields = dict(name=v.peer_id, memory=float(min(v.record.memory_bytes, MEMORY_MAX)), tau_c=self.tau_c(v),
                          tau_p=self.tau_p(v), block_limit=int(v.record.max_blocks))
            per_block = int(getattr(v.record, "cache_tokens_per_block", 0) or 0)
            sizes = self.own_sizes(v.record, model) if model is not None else None
            if sizes is not None:
                out.append(SizedServerSpec.of(**fields, block_size=sizes[0], cache_size=sizes[1], model=model,
                                              cache_tokens_per_block=per_block, max_length=self.max_length))
            else:
                out.append(CappedServerSpec(**fields, cache_tokens_per_block=per_block, max_length=self.max_length)
                           if per_block > 0 else ServerSpec(**fields))
        return out

    def own_sizes(self, record: Any, model: ModelSpec) -> tuple[float, float] | None:
        """``(s_m, s_c)`` in bytes that ``record`` announces (its dtype, quantization and KV pages), ``s_c`` for a
        session of this swarm's ``max_length`` (a record before its first assignment is sized for the server's
        default); None to plan it with ``model``'s: an older record without them, sizes equal to ``model``'s, or ones
        more than ``SIZE_RATIO_MAX`` times off (logged once per server)."""
        s_m, s_c = int(getattr(record, "s_m_bytes", 0) or 0), int(getattr(record, "s_c_bytes", 0) or 0)
        length = int(getattr(record, "max_length", 0) or 0)
        if s_m <= 0 or s_c <= 0 or length <= 0:
            return None
        kv_cache = getattr(record, "kv_cache", "paged")
        # a record shows its page size once loaded; the server's --page-size default before
        page = int(getattr(record, "page_size", 0) or 0) or DEFAULT_PAGE_SIZE
        if length != self.max_length:  # K and V grow with the tokens held
            s_c = s_c * slot_tokens(kv_cache, self.max_length, page) / slot_tokens(kv_cache, length, page)
        if s_m == model.block_size and s_c == model.cache_size:
            return None
        if not all(1 / SIZE_RATIO_MAX <= own / orch <= SIZE_RATIO_MAX
                   for own, orch in ((s_m, model.block_size), (s_c, model.cache_size))):
            peer = getattr(record, "peer_id", "")
            if peer not in self._odd_sizes:
                self._odd_sizes.add(peer)
                logger.warning("server %s (%s) announces s_m=%d s_c=%d bytes, this orchestrator's are %d and %d: "
                               "planned with this orchestrator's", getattr(record, "public_name", ""), peer[:12],
                               s_m, s_c, model.block_size, model.cache_size)
            return None
        return float(s_m), float(s_c)

    # ---- planning ------------------------------------------------------------------------------
    def _bounds(self, chains: list[Chain]) -> tuple[float, float]:
        from petals_chain.algorithms import response_time_bounds

        if not chains:
            return math.inf, math.inf
        return response_time_bounds([(1.0 / ch.service_time, ch.capacity) for ch in chains], self.arrival_rate)

    def observe_job_tokens(self, tokens: int) -> None:
        """A job declared ``tokens`` tokens (prompt + ``max_tokens``, or a session's max_length): the estimate
        ``L^`` follows (unless fixed); chains are recomputed at the next refresh when it moved."""
        if self.fixed_job_tokens is None:
            self.job_tokens.observe(tokens)

    def residual_jobs(self, record: Any) -> int:
        """``M~_j`` for GCA: a loaded server's cache slots (Eq. 3; a job takes one per block it runs there), or
        for a paged KV cache its token budget over ``L^`` rounded up to its pages (algorithms/token_budget.py); no
        more than the sessions it takes at once (its record's ``max_sessions``, where it says: a paged server at
        ``ulimit -n 128`` was planned 40 jobs of 64 tokens and admitted 10)."""
        r = record
        if r.kv_cache != "paged" or r.page_size <= 0 or r.cache_tokens_total <= 0:
            jobs = int(r.slots_total)
        else:
            job = -(-self.job_tokens.value // r.page_size) * r.page_size
            jobs = max(int(r.slots_total), jobs_in_budget(r.cache_tokens_total, job))
        cap = getattr(r, "max_sessions", -1)  # (a record-like view without it: no cap)
        return jobs if cap is None or cap < 0 else min(jobs, int(cap))

    def _chains_key(self, views: Sequence[ServerView]) -> tuple:
        """What GCA on the online servers depends on besides the placement: ``L^``, the steps per job (``tau_c`` and
        the chains' service times scale with it: the value they were computed with, until the estimate leaves
        ``STEPS_PER_JOB_BAND`` of it) and the servers' capacities."""
        spj = max(1.0, self.steps_per_job)
        if self._steps_ref is None or abs(math.log(spj / self._steps_ref)) >= math.log(STEPS_PER_JOB_BAND):
            self._steps_ref = spj
        return (self.job_tokens.value, self._steps_ref) + tuple(sorted((v.peer_id, v.record.slots_total,
                                                                        v.record.cache_tokens_total,
                                                                        getattr(v.record, "max_sessions", -1))
                                                                       for v in views))

    def _servers_change(self, old: Sequence[tuple], new: Sequence[tuple]) -> str:
        """What changed between two ``_chains_key`` server parts (``(peer_id, slots_total, cache_tokens_total[,
        max_sessions])`` each): the servers online that came and went, and the slots, KV cache tokens or session cap
        of those that stayed."""
        def name(p: str) -> str:
            v = self.servers.get(p)
            return (v.record.public_name if v is not None else "") or p[:12]

        was, now = {k[0]: k[1:] for k in old}, {k[0]: k[1:] for k in new}
        moved = [f"+{name(p)}" for p in sorted(now.keys() - was.keys())] + [
            f"-{name(p)}" for p in sorted(was.keys() - now.keys())]
        parts = ["servers online " + ", ".join(moved)] if moved else []
        for p in sorted(now.keys() & was.keys()):
            (s0, t0, *c0), (s1, t1, *c1) = was[p], now[p]
            if s0 != s1:
                parts.append(f"slots of {name(p)} {s0} -> {s1}")
            if t0 != t1:
                parts.append(f"KV cache tokens of {name(p)} {t0} -> {t1}")
            if c0 != c1:
                cap = [("none" if not c or c[0] < 0 else c[0]) for c in (c0, c1)]
                parts.append(f"session cap of {name(p)} {cap[0]} -> {cap[1]}")
        return "; ".join(parts) or "servers online changed"

    def full_plan(self, views: Sequence[ServerView]) -> Plan | None:
        """c* by the Theorem 3.7 lower bound over GBP-CR + GCA on ``views`` (or the configured placement)."""
        model = self._model_spec()
        if model is None or not views:
            return None
        specs = self.specs(views)
        lam = max(self.arrival_rate, 1e-6)
        try:
            if self.placement_policy == "gbp-cr":
                c, placement, chains = self._tune(specs, model, lam)
            else:
                c, placement, chains = self._baseline_placement(specs, model)
        except ValueError as e:
            logger.info("no feasible plan yet: %s", e)
            return None
        lower, upper = self._bounds(chains)
        return Plan(c=c, placement=placement, chains=chains, lower=lower, upper=upper)

    def _tune(self, specs: list[ServerSpec], model: ModelSpec, lam: float) -> tuple[int, Placement, list[Chain]]:
        """c*, GBP-CR and GCA by ``tune_capacity``, which walks and counts each server by its own ``max_blocks`` and
        ``residual_slots`` (:class:`CappedServerSpec`: none at a ``c`` its cap cannot hold, the slots its cap holds).
        A cap below one job, and all caps where they allow no chain, are planned by the servers' memory, as before
        (they load their spans and a failed load says what they cannot hold: else no span was ever assigned).
        ValueError: no plan either way. A server with its own sizes (:class:`SizedServerSpec`) keeps them. Of ``c``
        that tie, the one in force, else the paper's placement at the largest ``c`` giving it (``tune_capacity``'s
        ``prefer`` and ``ties``)."""
        from petals_chain.algorithms import tune_capacity

        def by_memory(s: ServerSpec) -> ServerSpec:
            if isinstance(s, SizedServerSpec):
                return replace(s, cache_tokens_per_block=0)
            return ServerSpec(name=s.name, memory=s.memory, tau_c=s.tau_c, tau_p=s.tau_p, block_limit=s.block_limit)

        # c's ties (the same bound: Theorem 3.7 cannot tell them apart): the c in force when it is one of them (no flap
        # between equal values across re-plans), else the largest giving the paper's placement (the reservation that
        # placement honours: tuning.py)
        kw = dict(rho_bar=self.rho_bar, method="lower", use_all_servers=self.use_all_servers, ties="largest",
                  prefer=self.plan.c if self.plan is not None and self.plan.c else None)
        if not any(isinstance(s, CappedServerSpec) and s.cache_tokens_per_block > 0 for s in specs):
            return tune_capacity(specs, model, lam, **kw)
        try:
            return tune_capacity([by_memory(s) if isinstance(s, CappedServerSpec) and s.most_jobs() == 0 else s
                                  for s in specs], model, lam, **kw)
        except ValueError:
            return tune_capacity([by_memory(s) for s in specs], model, lam, **kw)

    def _baseline_placement(self, specs: list[ServerSpec], model: ModelSpec):
        from petals_chain.algorithms import gca

        if self.placement_policy == "whole-model":
            from petals_chain.algorithms.baselines import whole_model_placement

            placement, _ = whole_model_placement(specs, model)
        elif self.placement_policy == "petals":
            import random

            from petals_chain.algorithms.baselines import petals_placement

            # PETALS divides M_j by s_m + s_c x: a server's own sizes enter through its memory in the model's units
            x = self.petals_cache_tokens / self.max_length
            petals_specs = [ServerSpec(name=s.name, memory=s.per_block_memory(model, x), tau_c=s.tau_c, tau_p=s.tau_p,
                                       block_limit=s.block_limit) if isinstance(s, SizedServerSpec) else s
                            for s in specs]
            # Fixed join order (seeded), so a periodic re-plan reproduces the same placement (no reloads).
            placement = petals_placement(sorted(petals_specs, key=lambda s: s.name), model, rng=random.Random(0),
                                         cache_tokens=self.petals_cache_tokens, max_length=self.max_length)
        elif self.placement_policy == "bprr":
            from petals_chain.algorithms import tune_capacity
            from petals_chain.algorithms.baselines import cg_bp_placement

            R = self.bprr_r
            if R is None:
                R, _, _ = tune_capacity(specs, model, max(self.arrival_rate, 1e-6), rho_bar=self.rho_bar, method="lower")
            placement = cg_bp_placement(specs, model, int(R))
            return int(R), placement, gca(specs, model, placement)
        else:
            raise ValueError(f"placement policy {self.placement_policy!r} is not available")
        return None, placement, gca(specs, model, placement)

    def evaluate(self, views: Sequence[ServerView], placement: Placement, c: int | None = None,
                 residual: dict[str, int] | None = None) -> Plan:
        """GCA on ``placement`` restricted to ``views`` (with their live slot counts when loaded), or with the jobs
        ``residual`` gives (:meth:`held_jobs`: the basis on which plans that place servers differently compare)."""
        from petals_chain.algorithms import gca

        model = self._model_spec()
        names = {v.peer_id for v in views}
        sub = Placement({k: placement[k] for k in placement if k in names}, num_blocks=model.num_blocks)
        if residual is None:
            residual = {}
            for v in views:
                r = v.record
                if v.peer_id in sub and r.num_blocks > 0 and (r.start_block, r.num_blocks) == sub[v.peer_id]:
                    residual[v.peer_id] = self.residual_jobs(r)
        specs = self.specs([v for v in views if v.peer_id in sub])
        chains = gca(specs, model, sub, residual_slots=residual) if specs else []
        lower, upper = self._bounds(chains)
        return Plan(c=c, placement=sub, chains=chains, lower=lower, upper=upper)

    def held_jobs(self, views: Sequence[ServerView], placement: Placement) -> dict[str, int]:
        """``M~_j`` of each server of ``placement`` as it would hold them there: the jobs it announces on the span it
        serves, else its memory's slots (Eq. 3) scaled by what it announces over what its memory gives on the span it
        serves (a paged cache holds ``max_length / L^`` times more, a server short of its memory fewer), or unscaled
        when it serves no span. One basis for the plan in force and a plan that moves servers."""
        model = self._model_spec()
        specs = {s.name: s for s in self.specs([v for v in views if v.peer_id in placement])}
        return {v.peer_id: self._held_at(v, specs[v.peer_id], tuple(placement[v.peer_id]), model)
                for v in views if v.peer_id in placement and v.peer_id in specs}

    def _held_at(self, v: ServerView, spec: ServerSpec, span: tuple[int, int], model: ModelSpec) -> int:
        """:meth:`held_jobs` of one server ``v`` (``spec`` its :meth:`specs`) on ``span``."""
        r = v.record
        loaded = 0 < r.num_blocks and r.start_block + r.num_blocks <= model.num_blocks
        if loaded and (r.start_block, r.num_blocks) == tuple(span):
            return self.residual_jobs(r)
        slots = spec.residual_slots(model, span[1])
        # (a server still loading announces no slots yet: no ratio to scale by)
        mem_there = spec.residual_slots(model, r.num_blocks) if loaded and r.state == "online" else 0
        held = self.residual_jobs(r) if mem_there > 0 else 0
        jobs = slots * held // mem_there if held > 0 else slots
        cap = getattr(r, "max_sessions", -1)  # its sessions cap holds on any span
        return jobs if cap is None or cap < 0 else min(jobs, int(cap))

    def jobs_reserved(self, views: Sequence[ServerView], placement: Placement) -> int | None:
        """The largest cache reservation ``c`` that ``placement``'s servers among ``views`` honour: the fewest jobs of
        ``max_length`` tokens any of them holds over its whole span by its memory (Eq. 3's slots over its blocks, as
        GBP-CR sizes a span for ``c``: ``m_j <= m_j(c)``, Eq. 8). None when none of them is in ``views``."""
        model = self._model_spec()
        placed = [v for v in views if v.peer_id in placement]
        if model is None or not placed:
            return None
        return min(spec.residual_slots(model, int(placement[spec.name][1])) // max(1, int(placement[spec.name][1]))
                   for spec in self.specs(placed))

    def c_on_spans(self, views: Sequence[ServerView], placement: Placement, c: int | None,
                   in_force: int | None) -> int | None:
        """The cache reservation to take for ``c`` (Theorem 3.7's ``c*`` of a full plan not adopted) on spans placed
        for another: ``c`` where every placed server holds ``c`` jobs (:meth:`jobs_reserved`), else the most they
        hold, never below ``min(c, in_force)`` (a lower ``c`` is held wherever the one in force was; a server that
        holds fewer than that, say a newcomer too small for it, does not drag ``c`` down). ``c`` taken whatever the
        spans held reported a reservation a kept server could not make (``c`` 5 on a span holding 3 jobs) and sized
        newcomers' spans for it."""
        if c is None:
            return c
        held = self.jobs_reserved(views, placement)
        floor = 1 if in_force is None else min(c, in_force)
        return c if held is None else max(floor, min(c, held))

    def moves_better(self, views: Sequence[ServerView], current: Plan, new: Plan) -> tuple[bool, float, float]:
        """Whether ``new`` (a full plan that moves servers) predicts a response more than ``move_margin`` better than
        ``current``, both predicted on one basis, the jobs each server would hold (:meth:`held_jobs`). ``new``'s own
        prediction counts the slots the servers' memory gives at ``max_length``: against the slots they announce,
        fewer, it moved equal servers for nothing; on memory both, a paged swarm (jobs of ``L^`` tokens, ``max_length
        / L^`` times more than memory's slots) reloaded for a plan that holds fewer jobs. Also the two predictions,
        current's and new's."""
        from petals_chain.algorithms import gca

        if not new.chains:
            return False, math.inf, math.inf
        model, names = self._model_spec(), {v.peer_id for v in views}

        def predicted(plan: Plan) -> float:
            sub = Placement({k: s for k, s in plan.placement.items() if k in names}, num_blocks=model.num_blocks)
            specs = self.specs([v for v in views if v.peer_id in sub])
            return self._bounds(gca(specs, model, sub, residual_slots=self.held_jobs(views, sub)) if specs else [])[0]

        ours, theirs = predicted(current), predicted(new)
        return theirs < (1 - self.move_margin) * ours, ours, theirs

    def incremental(self, views: Sequence[ServerView], base: Placement, newcomer: ServerView, c: int | None) -> Plan | None:
        """Best span for ``newcomer`` alone (others keep their blocks): no server reloads. Its span is sized for ``c``
        (Eq. 8), and every span, the one it may hold already included, is predicted by the jobs it would hold there
        (:meth:`held_jobs`): by its memory's slots elsewhere against the jobs it announces where it is, a newcomer
        that announces fewer (slots, ``--max-length``) reloaded for nothing, one that announces more (a paged cache)
        kept a span where another was clearly better."""
        model = self._model_spec()
        spec = self.specs([newcomer])[0]
        m = spec.max_blocks(model, c or 1)
        others = self.held_jobs(views, base)  # (theirs do not depend on the newcomer's span)

        def predict(span: tuple[int, int]) -> Plan:
            spans = {**dict(base.items()), newcomer.peer_id: span}
            held = {**others, newcomer.peer_id: self._held_at(newcomer, spec, span, model)}
            return self.evaluate(views, Placement(spans, num_blocks=model.num_blocks), c, residual=held)

        loaded = self._held_span(newcomer, model.num_blocks)
        current = predict(loaded) if loaded is not None else None
        best: Plan | None = None
        for mm in sorted({m, min(model.num_blocks, max(1, m))}):
            if mm < 1:
                continue
            for start in range(0, model.num_blocks - mm + 1):
                plan = predict((start, mm))
                if best is None or plan.lower < best.lower - 1e-12:
                    best = plan
        # A server that already holds blocks (e.g. back after an orchestrator restart) keeps them unless another
        # span predicts a clearly better response: a reload costs minutes on a real model.
        if current is not None and (best is None or not best.lower < (1 - self.move_margin) * current.lower):
            return current
        return best

    def joint(self, views: Sequence[ServerView], base: Placement, newcomers: Sequence[ServerView],
              c: int | None) -> Plan | None:
        """GBP-CR over ``newcomers`` alone at the plan's ``c``, added to ``base`` (others keep their blocks).

        Servers that joined after the plan in a wave can form chains of their own: placed one at a time (see
        :meth:`incremental`) none of them completes a chain, so none is ever worth adding alone. None when the
        newcomers cover no chain or the plan has no ``c`` (a baseline placement policy)."""
        from petals_chain.algorithms import gbp_cr

        model = self._model_spec()
        if model is None or c is None or len(newcomers) < 2:
            return None
        try:
            placed = gbp_cr(self.specs(newcomers), model, int(c), max(self.arrival_rate, 1e-6), rho_bar=self.rho_bar,
                            use_all_servers=self.use_all_servers)
        except ValueError:
            return None
        if not placed or min(placed.coverage(model.num_blocks)) < 1:
            return None
        spans = Placement({**dict(base.items()), **dict(placed.items())}, num_blocks=model.num_blocks)
        return self.evaluate(views, spans, c, residual=self.held_jobs(views, spans))

    def served_plan(self, views: Sequence[ServerView], c: int | None) -> Plan | None:
        """The placement the servers in ``views`` already serve (loaded spans sized for our max_length), if it
        covers every block; else None. Non-empty after an orchestrator restart."""
        model = self._model_spec()
        spans = {v.peer_id: span for v in views if (span := self._held_span(v, model.num_blocks)) is not None}
        if not spans:
            return None
        placement = Placement(spans, num_blocks=model.num_blocks)
        if min(placement.coverage(model.num_blocks)) < 1:
            return None
        return self.evaluate(views, placement, c)

    def all_views(self) -> list[ServerView]:
        """Views of every server of the last refresh, other groups' included (fresh views for those)."""
        return [self.servers.get(p) or ServerView(peer_id=p, record=r) for p, r in self.seen.items()]

    def usable_views(self) -> list[ServerView]:
        return [v for v in self.servers.values() if v.usable]

    def online_views(self) -> list[ServerView]:
        """Usable servers that are online and serve exactly their assigned span, with slots for the swarm's
        ``max_length`` (a server started with a smaller ``--max-length`` refuses a longer job's open, and the job
        took the same chain again until its queue time ran out, ten minutes without a word)."""
        out = []
        for v in self.usable_views():
            span = self.assignment.get(v.peer_id)
            r = v.record
            if span is not None and r.state == "online" and (r.start_block, r.num_blocks) == tuple(span):
                if short := self._short_slots(r):
                    if self._short.get(v.peer_id) != short:
                        self._short[v.peer_id] = short
                        logger.warning("server %s sizes its KV for %d tokens, below this swarm's max_length %d "
                                       "(its --max-length): left out of the chains", r.public_name or v.peer_id,
                                       short, self.max_length)
                    continue
                out.append(v)
        return out

    def _recompute_chains(self, reason: str) -> None:
        """GCA at once on the servers actually online (join, leave, failure)."""
        if self.plan is None or self._model_spec() is None:
            return
        views = self.online_views()
        # the band's reference is the steps per job these chains are computed with, whatever recomputes them (a
        # join's chains, at 12 steps with the reference at 10, were kept while the estimate fell to 8: 50 % slow)
        self._steps_ref = max(1.0, self.steps_per_job)
        key = self._chains_key(views)
        plan = self.evaluate(views, self.plan.placement, self.plan.c)
        self.current = plan
        self._gca_key = key
        if self._installed is not None and same_chains(self._installed, plan.chains):
            logger.debug("chains unchanged (%s): not installed again", reason)
            return
        self._installed = list(plan.chains)
        self.on_chains(plan.chains)
        self._log_plan("chains", plan, reason)

    def _log_plan(self, kind: str, plan: Plan, reason: str) -> None:
        entry = {"t": time.time(), "kind": kind, "epoch": self.epoch, "c": plan.c, "reason": reason,
                 "chains": len(plan.chains), "capacity": sum(ch.capacity for ch in plan.chains),
                 "lower": plan.lower, "upper": plan.upper, "arrival_rate": self.arrival_rate,
                 "placement": {k: list(v) for k, v in plan.placement.items()}}
        self.plan_log.append(entry)
        logger.info("plan[%s] epoch=%d c=%s chains=%d capacity=%d predicted response lower=%.4gs upper=%.4gs "
                    "lambda=%.3g (%s)", kind, self.epoch, plan.c, entry["chains"], entry["capacity"], plan.lower,
                    plan.upper, self.arrival_rate, reason)

    async def _publish_assignment(self) -> None:
        from petals_chain.swarm.records import AssignmentRecord

        rec = AssignmentRecord(epoch=self.epoch, max_length=self.max_length, orchestrator_peer_id=self.dht.peer_id,
                               assignments={k: [int(s), int(n)] for k, (s, n) in self.assignment.items()},
                               model_fingerprint=self.model_fingerprint)
        await asyncio.to_thread(self.dht.publish_assignment, self.prefix, rec, self.assignment_expiration_s)
        self.last_publish = time.monotonic()

    async def _adopt(self, plan: Plan, reason: str) -> None:
        held = {p: span for p, span in self.held_spans().items() if p not in plan.placement}
        if held:
            placement = Placement({**dict(plan.placement.items()), **held}, num_blocks=plan.placement.num_blocks)
            plan = Plan(c=plan.c, placement=placement, chains=plan.chains, lower=plan.lower, upper=plan.upper,
                        reason=plan.reason)
        self.plan = plan
        new_assignment = {k: tuple(v) for k, v in plan.placement.items()}
        if new_assignment != self.assignment:
            self._start_load_clocks(self.assignment, new_assignment)
            self.epoch += 1
            self.assignment = new_assignment
            self._log_plan("placement", plan, reason)
            await self._publish_assignment()
        self._recompute_chains(reason)

    # ---- load deadlines ------------------------------------------------------------------------
    def _short_slots(self, r: Any) -> int:
        """The max_length a server's slots are sized for when below this swarm's (its ``--max-length``: it refuses a
        longer job's open, so it serves no chain), else 0."""
        n = getattr(r, "max_length", 0)
        return n if 0 < n < self.max_length else 0

    def _serves(self, v: ServerView, span: tuple[int, int]) -> bool:
        """Online with ``span``, its slots sized for this swarm's jobs (a server with a smaller ``--max-length`` is
        left out of the chains: an older one, which reports no failed load, is caught by the deadline)."""
        r = v.record
        return r.state == "online" and (r.start_block, r.num_blocks) == tuple(span) and not self._short_slots(r)

    def _start_load_clocks(self, old: dict[str, tuple[int, int]], new: dict[str, tuple[int, int]]) -> None:
        """Start the load deadline of each server that ``new`` gives a span it had not been assigned in ``old`` and does
        not serve already. A span kept keeps its clock (a held server stays overdue); one that a server already serves
        (a restarted orchestrator adopting the placement in force, servers handed over by another group) starts
        none."""
        now = self.clock()
        for p, span in new.items():
            v = self.servers.get(p)
            if v is None or old.get(p) == span:
                continue
            v.awaiting_since, v.load_overdue, v.load_s = (None if self._serves(v, span) else now), False, None
            v.deadline_scale = self.load_deadline_scale.get(p, 1.0)
            v.span_epoch = self.epoch + 1  # the epoch published with it
        for p in old.keys() - new.keys():
            if (v := self.servers.get(p)) is not None:
                v.awaiting_since, v.load_overdue = None, False

    @staticmethod
    def _note_start(v: ServerView, rec: Any) -> bool:
        """Whether ``rec`` announces a process start that ``v``'s records had not (a restart, also to an earlier time:
        a clock set back), and note it; one of the last ``STARTS_KEPT`` is an older record read late, and 0 (an older
        server's) is unknown: neither is a restart."""
        started = started_at_of(rec)
        starts = note_start(v.starts, started) if started > 0 else None
        if starts is None:
            return False
        v.starts = starts
        return True

    def _restart_load_clock(self, v: ServerView) -> None:
        """``v`` restarted (a ``started_at`` not seen before): the span it is assigned, unless its new process serves it
        already, is loaded afresh, so its load deadline starts now, the one deadline (a restart of a server that served
        its span started none: one whose new load hung held its blocks, with no chain through them, for good)."""
        # a new process loads afresh, with the one deadline (the placer forgets its overdue loads too)
        self.load_deadline_scale.pop(v.peer_id, None)
        span = self.assignment.get(v.peer_id)
        if span is None:
            return
        v.awaiting_since = None if self._serves(v, span) else self.clock()
        v.load_overdue, v.deadline_scale, v.load_s = False, 1.0, None
        logger.info("server %s (%s) restarted: %s", v.record.public_name, v.peer_id[:12],
                    "it serves its blocks" if v.awaiting_since is None else
                    f"its load deadline for blocks [{span[0]}, {span[0] + span[1]}) starts again")

    def check_load_deadlines(self) -> None:
        """Plan around each server not online with its assigned span ``load_deadline_s`` after the assignment that
        gave it the span (a load that hangs, a wedged device, an older server that does not report a failed load):
        it stays assigned (held_spans) and rejoins the chains once it serves that span, as a failed load does. A
        server draining, or offline, restarts its clock: it still serves its old blocks' sessions, or it is away
        (back, it loads anew)."""
        now = self.clock()
        for v in self.servers.values():
            if v.awaiting_since is None:
                continue
            span = self.assignment.get(v.peer_id)
            r = v.record
            if span is None:
                v.awaiting_since, v.load_overdue = None, False
            elif self._serves(v, span):
                if v.load_overdue:
                    logger.info("server %s (%s) is online with its blocks [%d, %d) %.0f s after its assignment: "
                                "planning it again", r.public_name, v.peer_id[:12], span[0], span[0] + span[1],
                                now - v.awaiting_since)
                v.awaiting_since, v.load_overdue, v.load_s = None, False, now - v.awaiting_since
            elif r.state == "offline" or (r.state == "draining" and not v.load_overdue):
                v.awaiting_since, v.load_overdue = now, False
            elif not v.load_overdue and 0 < self.deadline_s(v) <= now - v.awaiting_since:
                v.load_overdue = True
                logger.warning("server %s (%s) is not online with its assigned blocks [%d, %d) %.0f s after its "
                               "assignment (%s; it is %s): planning around it until it serves them", r.public_name,
                               v.peer_id[:12], span[0], span[0] + span[1], now - v.awaiting_since,
                               self._deadline_text(v), r.state)

    def deadline_s(self, v: ServerView) -> float:
        """``v``'s load deadline: ``load_deadline_s`` times its scale when its clock started (0: none)."""
        return self.load_deadline_s * v.deadline_scale

    def _deadline_text(self, v: ServerView) -> str:
        scaled = f" x {v.deadline_scale:g} after earlier overdue loads" if v.deadline_scale != 1.0 else ""
        return f"--load-deadline-s {self.load_deadline_s:g}{scaled}"

    def _overdue_error(self, v: ServerView, now: float, flag: bool = True) -> str:
        """Why an overdue server is planned around (its ``load_error``, unless its record says one)."""
        why = f"not online {now - (v.awaiting_since or now):.0f} s after its assignment"
        return f"{why} ({self._deadline_text(v)})" if flag else why

    # ---- loop ----------------------------------------------------------------------------------
    _descriptors_warned_at = -math.inf  # when :meth:`_warn_out_of_descriptors` last warned (time.monotonic())

    def _warn_out_of_descriptors(self, e: BaseException) -> None:
        """Once a minute: pings fail for want of open files here (every server banned for it, before)."""
        now = time.monotonic()
        if now - self._descriptors_warned_at >= EXHAUSTED_LOG_S:
            self._descriptors_warned_at = now
            logger.warning("pings to servers fail for want of open files in this orchestrator (%s): no server is "
                           "blamed for it; raise the open-files limit (ulimit -n) if this recurs", e)

    async def _ping(self, v: ServerView) -> None:
        try:
            rtt = await asyncio.wait_for(self.client.ping(v.peer_id), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - an unreachable server is a fact to record, not to crash on
            if out_of_descriptors(e):  # this process is out of open files: nothing is known of the server
                self._warn_out_of_descriptors(e)
                return
            v.ping_failures += 1
            if v.ping_failures >= 2 and v.failed_at is None:
                logger.info("server %s does not answer pings (%s)", v.peer_id[:12], e)
                self.report_failure(v.peer_id)
            return
        v.ping_failures = 0
        v.rtt_s = rtt if v.rtt_s is None else (1 - EWMA) * v.rtt_s + EWMA * rtt

    def _check_reachability(self, live: list[ServerView]) -> None:
        """Dial servers whose announced addresses are new (or that were unreachable a while ago), in the background:
        a server another host cannot dial must not be planned (its RPCs would ride only the connection it opened
        to us, and pushes from other servers could not reach it at all)."""
        if self.prober is None:
            return
        now = time.monotonic()
        # New addresses first; an unreachable server is dialed again only while no first check waits (its
        # addresses, up to 8, may hold a dial slot for a while, and anyone can announce blackholed ones: new
        # servers stayed "pending", unplanned, behind such re-checks)
        first = [v for v in live if v.record.maddrs and v.peer_id not in self._reach_tasks
                 and tuple(v.record.maddrs) != v.reach_key]
        again = [] if first or self._reach_tasks else [
            v for v in live if v.record.maddrs and v.reachability == "unreachable"
            and now - v.reach_checked >= self.reach_recheck_s]
        for v in first + sorted(again, key=lambda v: v.reach_checked)[:1]:  # one re-check at a time, oldest first
            key = tuple(v.record.maddrs)
            if key != v.reach_key:
                v.reachability = "pending"
            v.reach_key = key
            self._reach_tasks[v.peer_id] = asyncio.create_task(self._dial(v, key), name=f"reach-{v.peer_id[:8]}")

    async def _dial(self, v: ServerView, key: tuple) -> None:
        try:
            ok, maddr, error = await self.prober.dial(v.peer_id, list(key))
        except Exception as e:  # noqa: BLE001 - a failed check is a fact, not a crash
            ok, maddr, error = False, "", f"{type(e).__name__}: {e}"
        finally:
            self._reach_tasks.pop(v.peer_id, None)
        if v.reach_key != key:
            return  # the server announced other addresses meanwhile: that check decides
        was = v.reachability
        v.reach_checked = time.monotonic()
        v.reachability = ("relayed" if is_circuit(maddr) else "direct") if ok else "unreachable"
        v.reach_error = error
        if ok and was != v.reachability:
            self.last_change = time.monotonic()  # a server the planner may use now: a join for it
            logger.info("server %s (%s) is reachable %s at %s", v.record.public_name, v.peer_id[:12],
                        v.reachability, maddr)
        elif not ok and was != "unreachable":
            logger.warning("server %s (%s) is NOT reachable at %s: %s; not planned until it is",
                           v.record.public_name, v.peer_id[:12], " ".join(key), error)

    def _note_load_failure(self, v: ServerView) -> None:
        """Say when ``v``'s record starts or stops reporting that it cannot load the span this planner assigns it
        (once per change); a server that stops is a join for the planner (it loaded its blocks after all, restarted,
        or the span it failed is not its assignment any more: it is planned afresh, and says so again if it fails)."""
        r = v.record
        span = tuple(getattr(r, "failed_span", ()))
        # of the span this planner gives it, reported since it gave it (a record of the epoch that gave the span or a
        # later one): a failure announced before (to an orchestrator before a restart of this one) is stale
        v.failed_assigned = (v.load_reported and len(span) == 2 and span == tuple(self.assignment.get(v.peer_id, ()))
                             and getattr(r, "epoch", -1) >= v.span_epoch)
        failure = (span, getattr(r, "load_error", "")) if v.failed_assigned else None
        said = self.load_failures.get(v.peer_id)
        if failure == said:
            return
        if failure is not None:
            self.load_failures[v.peer_id] = failure
            span = f"[{failure[0][0]}, {failure[0][0] + failure[0][1]})" if len(failure[0]) == 2 else "its span"
            logger.warning("server %s (%s) cannot load its assigned blocks %s: %s; planning around it until it loads "
                           "them or restarts", r.public_name, v.peer_id[:12], span, failure[1] or "(no reason given)")
            return
        del self.load_failures[v.peer_id]
        if r.state != "offline":
            logger.info("server %s (%s) no longer reports a failed load of its assigned blocks (%s): planning it again",
                        r.public_name, v.peer_id[:12], "it loaded them" if r.num_blocks else
                        "it restarted, or they are not its assignment any more")
            self.last_change = time.monotonic()

    def _failed_read(self, records: dict[str, Any] | None, error: str = "") -> bool:
        """Whether this read of the server records (None: it raised ``error``) is a failed one, whose missing records
        are kept as the last read saw them (:meth:`refresh`: views, bans, assignment and ``seen`` kept; pings still
        ban the dead): one that raised, or one that names none of this planner's live
        servers (not even ``offline``) while that has lasted less than ``records_lost_s``. Such a read is what a
        DHT get that timed out or reached no node returns in a network blip of this host; taken as every server
        leaving, it published an empty assignment and every server unloaded its blocks. Servers that all die
        silently are seen gone ``records_lost_s`` later than their records expire: nobody was left to serve anyway."""
        live = [p for p, v in self.servers.items() if v.record.state != "offline"]
        if records is not None and (not live or any(p in records for p in live)):
            if self.failed_reads:
                logger.info("server records read again after %d failed read(s)", self.failed_reads)
            self.failed_reads, self._lost_since = 0, None
            return False
        now = self.clock()
        if records is not None:
            if self._lost_since is None:
                self._lost_since = now
            if now - self._lost_since >= self.records_lost_s:  # 0: at once (the planner before)
                logger.warning("the server records have named none of the %d live servers for %.0f s (a record lives "
                               "%.0f s unless refreshed): taking them as gone", len(live), now - self._lost_since,
                               self.records_lost_s)
                self.failed_reads, self._lost_since = 0, None
                return False
        self.failed_reads += 1
        # once per streak: a blip of minutes read every refresh_s must not fill the log
        log = logger.warning if self.failed_reads == 1 else logger.debug
        if records is None:
            log("reading the server records failed (%s): keeping the %d live servers and the assignment, reading "
                "again", error, len(live))
        else:
            log("a read of the server records names none of the %d live servers (%d record(s)): taken for a failed "
                "read (the DHT unreachable?), keeping them and the assignment unless it lasts %.0f s", len(live),
                len(records), self.records_lost_s)
        return True

    async def refresh(self) -> None:
        """Fetch records, ping, and react to joins, leaves and state changes (a failed read, :meth:`_failed_read`,
        loses no server: what it misses is read as the last read saw it)."""
        async with self._lock:
            try:
                read: dict[str, Any] | None = await self.dht.afetch_servers(self.prefix)
                failed = self._failed_read(read)
            except Exception as e:  # noqa: BLE001 - a DHT error is a failed read (_failed_read), not a planner error
                read, failed = None, self._failed_read(None, f"{type(e).__name__}: {e}")
            read = read or {}
            # A failed read keeps every record the last one saw, under what it names itself: the live servers are
            # still pinged (killed -9 all at once with the DHT nodes that held their records, they stayed in the
            # chains until records_lost_s) and servers it names are taken in (a swarm back with new identities after
            # its old records expired was ignored until then)
            records = {**self.seen, **read} if failed else read
            refused = dict(self.refused) if failed else {}
            for peer_id, rec in list(records.items()):
                problem = rec.protocol_problem()
                if problem:  # a server whose wire protocols this version does not speak: never planned, shown why
                    if peer_id not in self.refused:
                        logger.warning("server %s (%s): %s: refused", rec.public_name, peer_id[:12], problem)
                    refused[peer_id] = records.pop(peer_id)
                elif self.model_fingerprint and rec.model_fingerprint != self.model_fingerprint:
                    if peer_id not in self.refused:
                        logger.warning("server %s (%s): %s: refused", rec.public_name, peer_id[:12],
                                       fingerprint_problem(rec.model_fingerprint, self.model_fingerprint,
                                                           self.model_legacy_fingerprint))
                    refused[peer_id] = records.pop(peer_id)
            self.refused = refused
            self.seen = dict(records)
            # warned-once notes go with the record (volunteers come back under new ids: one entry each for ever)
            self._odd_sizes &= self.seen.keys()
            self._short = {p: n for p, n in self._short.items() if p in self.seen}
            if not failed:
                self.refreshes += 1
            if self.group is not None:  # another orchestrator's servers are not ours to plan: as if absent
                records = {p: r for p, r in records.items() if p in self.group}
            if self.placed is not None:  # a server placed on another model is not ours either
                records = {p: r for p, r in records.items() if self.placed(p, r)}
            else:
                records = {p: r for p, r in records.items() if r.serving in ("", self.prefix)}
            now = time.time()
            joined, left = [], []
            # A server that stops gracefully announces "offline" and its record lingers until it expires: the view
            # is kept (not usable) so that the leave is seen once, not as a join and a leave at every refresh.
            # A join restarts the settle time (more may follow); a leave does not (re-plan at once).
            for peer_id, rec in records.items():
                v = self.servers.get(peer_id)
                if v is None:
                    v = self.servers[peer_id] = ServerView(peer_id=peer_id, record=rec)
                    self._note_start(v, rec)
                    span = self.assignment.get(peer_id)
                    if span is not None and not self._serves(v, span):
                        # assigned and back before a re-plan dropped it (one read missed its record mid-load): its
                        # load clock runs again (a fresh view had none: a load that hung held its blocks for good)
                        v.awaiting_since, v.deadline_scale = self.clock(), self.load_deadline_scale.get(peer_id, 1.0)
                    if peer_id in self.distrusted:  # banned for good before its record expired
                        v.distrusted, v.failed_at, v.banned_until = True, time.time(), math.inf
                    if rec.state != "offline":
                        joined.append(v)
                        self.last_change = time.monotonic()
                else:
                    if rec.state == "offline" and v.record.state != "offline":
                        left.append(v)
                    elif rec.state != "offline" and v.record.state == "offline":
                        joined.append(v)  # back (restarted with the same identity)
                        self.last_change = time.monotonic()
                    if v.record.tau_p <= 0 < rec.tau_p:
                        self.last_change = time.monotonic()  # its speed is known now: a join for the planner
                    restarted = self._note_start(v, rec)
                    v.record = rec
                    if restarted:
                        self._restart_load_clock(v)
                self._note_load_failure(v)
                if peer_id in read:  # (not one kept from the last read)
                    v.last_seen = now
            for peer_id in list(self.servers):
                if peer_id not in records:
                    self.load_failures.pop(peer_id, None)
                    v = self.servers.pop(peer_id)
                    if v.record.state != "offline":
                        left.append(v)
            live = [v for v in self.servers.values() if v.record.state != "offline"]
            self._check_reachability(live)
            await asyncio.gather(*(self._ping(v) for v in live))
            for v in live:
                self._unban(v)
            if not failed:  # (a load is not timed by records this read did not see)
                self.check_load_deadlines()
            for v in joined:
                logger.info("server joined: %s (%s) memory=%d tau_p=%.4g state=%s", v.record.public_name,
                            v.peer_id[:12], v.record.memory_bytes, v.record.tau_p, v.record.state)
            for v in left:
                logger.info("server left: %s (%s)", v.record.public_name, v.peer_id[:12])
                if self.on_failure is not None and v.record.state == "offline":
                    self.on_failure(v.peer_id)  # it drained first: whatever still waits on it gets no answer
            await self._decide(joined, left)

    async def _decide(self, joined: list[ServerView], left: list[ServerView]) -> None:
        speed_changed, self._speed_changed = self._speed_changed, []
        views = self.usable_views()
        settled = time.monotonic() - self.last_change >= self.settle_s
        if self.plan is None:
            if views and settled:
                # planning takes seconds with hundreds of servers: off the event loop (requests and streams go on)
                plan, reason = await asyncio.to_thread(self.full_plan, views), "initial plan"
                served = self.served_plan(views, plan.c if plan is not None else None)
                # After an orchestrator restart the servers still hold their blocks: keep those spans unless a
                # new placement predicts a clearly better response (the same rule as any re-placement).
                if served is not None and served.chains and (
                        plan is None or not plan.chains or not self.moves_better(views, served, plan)[0]):
                    # the full plan's c, as far as the spans served hold it (they were placed for another c)
                    served.c = self.c_on_spans(views, served.placement, served.c, None)
                    plan, reason = served, "kept the spans the servers already serve"
                if plan is not None and plan.chains:
                    self.last_full_replan = time.monotonic()
                    # a restarted orchestrator continues above the epochs the servers followed
                    self.epoch = max([self.epoch] + [v.record.epoch for v in views if v.record.epoch < EPOCH_MAX])
                    await self._adopt(plan, reason)
            return
        # Chains follow the servers that are online now.
        key = self._chains_key(self.online_views())
        if key != self._gca_key:
            if self._gca_key is None:
                why = "servers online changed"
            elif key[2:] != self._gca_key[2:]:
                why = self._servers_change(self._gca_key[2:], key[2:])
            elif key[0] != self._gca_key[0]:
                why = f"expected tokens per job L^ = {key[0]}"
            else:
                why = f"steps per job {self.steps_per_job:.1f} (chains' service times)"
            self._recompute_chains(why)
        elif speed_changed:
            self._recompute_chains("measured speed of " + ", ".join(p[:12] for p in speed_changed))
        # Servers without blocks (new, or left over by GBP-CR) are considered once each, then again only
        # at the periodic re-plan: a leftover server must not trigger planning every refresh.
        unassigned = [v for v in views if v.peer_id not in self.assignment]
        fresh = [v for v in unassigned if v.peer_id not in self._considered]
        held = self.held_spans()
        view_ids = {v.peer_id for v in views}
        # a server that left is fresh again when it comes back (and its id is not kept for ever)
        self._considered &= view_ids
        # A banned server (or one that cannot load its span) is planned around once (others may take its blocks over
        # if the chains need them), not at every refresh of its ban; again if it is held again later.
        self._planned_around &= held.keys()
        planned_around = held.keys() & self._planned_around
        assigned_gone = [p for p in self.assignment if p not in view_ids and p not in planned_around]
        if not settled:
            return
        due = time.monotonic() - self.last_full_replan >= self.replan_interval_s or bool(speed_changed)
        if not (fresh or assigned_gone or due):
            return
        self._considered.update(v.peer_id for v in unassigned)
        self._planned_around = set(held)
        self.last_full_replan = time.monotonic()
        # Plans that place servers differently are predicted on one basis, the jobs each would hold (held_jobs)
        placed = self.plan.placement
        base = self.evaluate(views, placed, self.plan.c, residual=self.held_jobs(views, placed))
        best, reason = base, ""
        alive_placement = base.placement
        # the searches take seconds with hundreds of servers: off the event loop (one refresh runs at a time, and
        # they only read the views and the planner's estimates)
        full = await asyncio.to_thread(self.full_plan, views)
        # c follows lambda (Theorem 3.7's c*) whether or not the full plan's moves are taken: the spans in force keep
        # it, and newcomers' spans are sized for it (at the c before, a retune with a join gave the newcomer a span
        # that holds fewer jobs than the c in force after it)
        c = full.c if full is not None and full.chains and full.c is not None else self.plan.c
        best, reason = self._keep_held_spans(views, base, best, reason, unassigned, c)
        best, reason = await asyncio.to_thread(self._search_joins, views, base, best, reason, unassigned, c)
        # a full plan that moves no server is no re-placement (it "improved" on the same spans every interval: its
        # prediction counted slots by the servers' memory, the plan in force's by the slots they announce), nor is
        # one better only by that basis (moves_better); its c is taken on the spans kept, nothing moved
        moves = full is not None and dict(full.placement.items()) != dict(best.placement.items())
        if moves:
            better, ours, theirs = await asyncio.to_thread(self.moves_better, views, best, full)
            if better:
                best, reason = full, (f"re-placement improves predicted response {ours:.4g}s -> {theirs:.4g}s "
                                      "(jobs each server holds, both)")
        retuned = ""
        if best is not full:  # c on spans placed for another: as far as every placed server holds it
            held_c = self.c_on_spans(views, best.placement, c, self.plan.c)
            if held_c != c:
                c_star, c = c, held_c
                if c != self.plan.c:
                    logger.info("c* = %s at lambda=%.3g: a server of the spans kept holds fewer jobs; c %s taken",
                                c_star, self.arrival_rate, c)
        if best is not full and c != self.plan.c:
            # the spans stay, c follows lambda: new servers' spans (incremental, joint), HERD's split and the model
            # placer read it from the plan in force
            retuned = f"cache reservation c {self.plan.c} -> {c} at lambda={self.arrival_rate:.3g}, spans kept"
        if best is base and set(alive_placement) == set(self.assignment) - set(held):
            if retuned:
                self.plan = replace(self.plan, c=c)
                self._log_plan("c", self.plan, retuned)
            # nothing to re-place: the chains still follow the speeds measured since they were made (a server that
            # delivers faster than it advertised, or slower short of tau_p_suspect, changes no key: its chains kept
            # the advertised times for good); installed only when they moved (same_chains)
            self._recompute_chains("placement kept; chains follow the measured speeds")
            return
        reason = reason or "servers left"
        if retuned:
            best, reason = replace(best, c=c), f"{reason}; {retuned}"
        if failed := [self.servers[p] for p in assigned_gone if p in held and self.servers[p].load_failed]:
            now = self.clock()
            why = {v.peer_id: "cannot load its blocks" if v.failed_assigned else self._overdue_error(v, now, flag=False)
                   for v in failed}
            reason += "; planned around " + ", ".join(f"{v.record.public_name or v.peer_id[:12]} ({why[v.peer_id]})"
                                                       for v in failed)
        await self._adopt(best, reason)

    def _keep_held_spans(self, views: list[ServerView], base: Plan, best: Plan, reason: str,
                         unassigned: list[ServerView], c: int | None) -> tuple[Plan, str]:
        """The ``unassigned`` servers that joined holding a span (handed over by another orchestrator's group, or
        restarted) keep it, no reload, when that predicts better than ``best`` or, by the same rule as newcomers
        placed (:meth:`_adds_capacity`), no worse and serving more: at light load the prediction is flat, and a
        wave holding a whole chain was left unplaced (each span alone completes no chain, and GBP-CR over the wave
        would move them)."""
        num_blocks = self.model_spec.num_blocks
        holding = {v.peer_id: span for v in unassigned if (span := self._held_span(v, num_blocks)) is not None}
        if holding:
            spans = Placement({**dict(base.placement.items()), **holding}, num_blocks=self.model_spec.num_blocks)
            kept = self.evaluate(views, spans, c, residual=self.held_jobs(views, spans))
            if kept.chains and (kept.lower < best.lower * (1 - 1e-9) or self._adds_capacity(kept, best)):
                best, reason = kept, f"{len(holding)} server(s) joined holding spans: kept"
        return best, reason

    def _search_joins(self, views: list[ServerView], base: Plan, best: Plan, reason: str,
                      unassigned: list[ServerView], c: int | None) -> tuple[Plan, str]:
        """The best of ``best`` and the plans that place the ``unassigned`` servers, one at a time (incremental) or
        together (joint), sized for cache reservation ``c``, with the reason for it."""
        for v in unassigned:
            inc = self.incremental(views, Placement(dict(best.placement.items()), num_blocks=self.model_spec.num_blocks),
                                   v, c)
            if inc is None:
                continue
            if inc.lower < best.lower * (1 - 1e-9) or self._adds_capacity(inc, best):
                best, reason = inc, f"join of {v.record.public_name or v.peer_id[:12]} (incremental)"
        if self.placement_policy == "gbp-cr":
            # (judged against the spans taken one at a time above, by the same rule: on a lightly loaded swarm the
            # bound is flat, and a wave's chains of their own predicted no better than one newcomer's span)
            # (but not to move a newcomer off a span it holds: a reload costs minutes on a real model, and GBP-CR over
            # the newcomers places them by their speeds alone, whatever they hold)
            together = self.joint(views, base.placement, unassigned, c)
            if together is not None and (together.lower < best.lower * (1 - 1e-9)
                                         or (self._adds_capacity(together, best)
                                             and not self._moves_held(together, unassigned))):
                best, reason = together, f"join of {len(unassigned)} servers (chains of their own)"
        return best, reason

    def _moves_held(self, plan: Plan, servers: Sequence[ServerView]) -> bool:
        """Whether ``plan`` places one of ``servers`` on another span than the one it holds loaded (for this swarm's
        ``max_length``)."""
        num_blocks = self.model_spec.num_blocks
        for v in servers:
            span, held = plan.placement.get(v.peer_id), self._held_span(v, num_blocks)
            if span is not None and held is not None and tuple(span) != held:
                return True
        return False

    def _held_span(self, v: ServerView, num_blocks: int) -> tuple[int, int] | None:
        """``(start, count)`` of the blocks ``v`` serves loaded for this swarm's ``max_length`` and inside its
        ``num_blocks``, which it can keep without a reload; None if none."""
        r = v.record
        if r.num_blocks > 0 and r.max_length == self.max_length and r.start_block + r.num_blocks <= num_blocks:
            return r.start_block, r.num_blocks
        return None

    def _adds_capacity(self, plan: Plan, best: Plan) -> bool:
        """Using every volunteer (``--spare-servers use``): a plan that predicts no worse than ``best`` and serves
        more jobs per second is better (the bound is flat when the swarm is lightly loaded; capacity absorbs
        bursts)."""
        return (self.use_all_servers and self.placement_policy == "gbp-cr" and plan.lower <= best.lower * (1 + 1e-9)
                and _total_rate(plan.chains) > _total_rate(best.chains) * (1 + 1e-9))

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            for task in list(self._reach_tasks.values()):
                task.cancel()

    async def _round(self) -> None:
        await self.refresh()
        if self.assignment and time.monotonic() - self.last_publish > self.assignment_expiration_s / 3:
            await self._publish_assignment()

    async def _run(self, stop: asyncio.Event) -> None:
        await run_every(stop, self.refresh_s, self._round, logger, "planner refresh")

    def reported_load_failure(self, peer_id: str) -> dict | None:
        """``{"failed_span", "load_error", "reason"}`` while ``peer_id`` cannot load the span this planner assigns
        it, by its record's word (``reason`` "reported": ``failed_assigned``, announced at or after the epoch that
        gave the span) or by the load deadline ("overdue": ``load_overdue``), else None (the model placer moves such
        a server to another model it offers). The text does not change while the failure stands."""
        v = self.servers.get(peer_id)
        if v is None or v.record.state == "offline":
            return None
        found = self._failed_load(v)
        if found is None:
            return None
        reason, span = found
        error = (v.record.load_error if reason == "reported" else
                 f"not online with them within {self._deadline_text(v)} of its assignment")
        return {"failed_span": span, "load_error": error, "reason": reason}

    def _failed_load(self, v: ServerView) -> tuple[str, list[int]] | None:
        """``("reported", span)`` if ``v``'s record says it cannot load the span this planner gives it, ``("overdue",
        span)`` if it is not online with its assigned span past the load deadline, else None."""
        if v.failed_assigned:
            return "reported", list(v.record.failed_span)
        if v.load_overdue and v.peer_id in self.assignment:
            return "overdue", list(self.assignment[v.peer_id])
        return None

    def _load_failure_json(self, v: ServerView, now: float) -> dict:
        """``failed_span`` and ``load_error`` as its record says them, else as the load deadline does."""
        found = self._failed_load(v)
        if found is None:
            return {"failed_span": None, "load_error": ""}  # none, or of a span it is no longer given
        reason, span = found
        return {"failed_span": span, "load_error": v.record.load_error if reason == "reported" else
                self._overdue_error(v, now)}

    def server_json(self, active_by_peer: dict[str, int] | None = None) -> list[dict]:
        out = []
        now = self.clock()
        for v in sorted(self.servers.values(), key=lambda v: (v.record.start_block, v.record.public_name)):
            r = v.record
            # a failed load shows as failed too (dashboards treat it as not serving), told apart by load_error
            state = "failed" if v.failed_at is not None or v.load_failed else r.state
            measured = self.measured_tau_p(v)
            out.append({
                "peer_id": v.peer_id, "public_name": r.public_name, "state": state,
                "start_block": r.start_block, "num_blocks": r.num_blocks,
                "slots_total": r.slots_total, "slots_free": r.slots_free, "kv_cache": r.kv_cache,
                "page_size": r.page_size, "cache_tokens_total": r.cache_tokens_total,
                "cache_tokens_free": r.cache_tokens_free, "prefix_cache": r.prefix_cache,
                "prefix_offered_tokens": r.prefix_offered_tokens, "prefix_reused_tokens": r.prefix_reused_tokens,
                "tau_p": self.tau_p(v), "tau_c": self.tau_c(v), "rtt_s": v.rtt_s,
                "memory_bytes": r.memory_bytes, "device": r.device, "dtype": r.dtype,
                "emulate_rtt_ms": r.emulate_rtt_ms, "emulate_compute_scale": r.emulate_compute_scale,
                "emulate_reply_fault": r.emulate_reply_fault, "emulate_reply_fault_rate": r.emulate_reply_fault_rate,
                "last_seen": v.last_seen, "assigned": list(self.assignment[v.peer_id]) if v.peer_id in self.assignment else None,
                "max_blocks": r.max_blocks, "model_mismatch": False,
                "tau_p_advertised": r.tau_p, "tau_p_measured": measured, "tau_p_suspect": self.tau_p_suspect(v),
                **{f"step_{part}_s": value for part, value in self.hop_step_s(v).items()},
                "strikes": v.strikes, "banned": v.banned, "distrusted": v.distrusted,
                "banned_for_s": None if v.distrusted else max(0.0, v.banned_until - now) if v.banned else 0.0,
                "reachability": v.reachability, "reachability_error": public_dial_error(v.reach_error),
                "maddrs": list(r.maddrs),
                "models": list(r.models), "serving": r.serving, "unread": r.unread, "refused_reason": "",
                "adapters": dict(r.adapters),  # LoRA adapters it serves: {fingerprint: name}
                "version": r.version, "protocol": r.protocol, "protocol_min": r.protocol_min,  # the build it runs
                **self._load_failure_json(v, now),
            })
        for peer_id, r in sorted(self.refused.items()):
            out.append({
                "peer_id": peer_id, "public_name": r.public_name, "state": "refused", "start_block": 0, "num_blocks": 0,
                "slots_total": 0, "slots_free": 0, "kv_cache": r.kv_cache, "page_size": 0, "cache_tokens_total": 0,
                "cache_tokens_free": 0, "prefix_cache": False, "prefix_offered_tokens": 0, "prefix_reused_tokens": 0,
                "tau_p": r.tau_p, "tau_c": None, "rtt_s": None,
                "memory_bytes": r.memory_bytes, "device": r.device, "dtype": r.dtype,
                "emulate_rtt_ms": r.emulate_rtt_ms, "emulate_compute_scale": r.emulate_compute_scale,
                "last_seen": None, "assigned": None, "max_blocks": r.max_blocks,
                "model_mismatch": not r.protocol_problem(), "unread": r.unread,
                "refused_reason": r.protocol_problem() or fingerprint_problem(
                    r.model_fingerprint, self.model_fingerprint, self.model_legacy_fingerprint),
                "tau_p_advertised": r.tau_p, "tau_p_measured": None, "tau_p_suspect": False, "strikes": 0,
                "banned": False, "banned_for_s": 0.0, "reachability": "unknown", "reachability_error": "",
                "maddrs": list(r.maddrs), "models": list(r.models), "serving": r.serving,
                "failed_span": None, "load_error": "",
                "version": r.version, "protocol": r.protocol, "protocol_min": r.protocol_min,
            })
        return out
