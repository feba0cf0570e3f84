"""Deadlines at the orchestrator's central queue: earliest-deadline-first order and the admission prediction.

The swarm's unit of execution is a chain running continuous batching with ``c_k`` slots (seed 003 mapping §3.7),
so a job's wait is the wait for a slot, not for an exclusive batch. Two pure pieces, used by
:class:`~petals_chain.orchestrator.dispatch.DispatchManager` (and testable alone):

* :class:`EDFQueue` — JFFC's central queue in deadline order (jobs without a deadline after every job with one,
  FIFO among equals), with JFFC's queue contract (push, pop, peek, remove, ``in``, ``len``, iteration);
* :func:`predict` — when a new job would get its first and its last token: the wait for a slot with ``ahead``
  jobs served before it is ``max(0, ahead + 1 - free) / mu`` (``mu = sum_k c_k / T_k`` jobs per second, the
  central queue's total service rate of Thm 3.7), then the chain's opening, a prefill step and one step per output
  token on the chain with a free slot (any chain when none is free) that is fastest for that deadline; with a slot
  free, its first token on the chain the dispatcher starts it on (``start``: for a job with a TTFT deadline, the
  fastest free chain where it meets its deadlines when JFFC's own misses them, :func:`meets_on`). A job that
  misses its deadline by this prediction is refused at once (:class:`Prediction`.``doomed``).

  It approximates, and is off where: the jobs ahead and running free slots at the mean rate ``mu`` (as if of the
  planner's mean length, whatever they are: a few long ones free them later; and full chains step slower than
  ``T_k`` says unless :class:`StepTimes` has seen them, so it is optimistic under overload); the job's last token
  comes on the chain best for it (the dispatcher picks by ``T_k``, and jobs that arrive later with an earlier
  deadline may go first: optimistic); it generates all of ``output_tokens`` (its ``max_tokens``: pessimistic when
  it stops earlier). On an idle system it is never later than the system for one choice or for ``n`` (the later
  choices on the slots the first ones free), so it refuses nothing the system would serve in time.

Times are seconds on the caller's monotonic clock; a deadline of ``math.inf`` means none.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence


class EDFQueue:
    """Central queue ordered by ``key(job)`` (a deadline, ``inf`` for none), then by arrival; O(n) insert and
    removal by identity (the queue is bounded by ``--max-queue``), O(1) pop of the earliest deadline."""

    def __init__(self, key: Callable[[Any], float]):
        self._key = key
        self._entries: list[tuple[float, int]] = []  # (deadline, seq), sorted
        self._jobs: dict[int, Any] = {}  # seq -> job
        self._seq_of: dict[int, list[int]] = {}  # id(job) -> its sequence numbers
        self._counter = itertools.count()

    def push(self, job: Any) -> None:
        seq = next(self._counter)
        d = float(self._key(job))
        if math.isnan(d):
            raise ValueError("a deadline must be a number, not NaN")
        bisect.insort(self._entries, (d, seq))
        self._jobs[seq] = job
        self._seq_of.setdefault(id(job), []).append(seq)

    def pop(self) -> Any:
        """Remove and return the job with the earliest deadline; IndexError if empty."""
        if not self._entries:
            raise IndexError("pop from an empty queue")
        _, seq = self._entries.pop(0)
        return self._take(seq)

    def peek(self) -> Any:
        return self._jobs[self._entries[0][1]]

    def remove(self, job: Any) -> bool:
        """Drop ``job`` (its oldest entry); True if it was queued."""
        seqs = self._seq_of.get(id(job))
        if not seqs:
            return False
        seq = seqs[0]
        for i, (_, s) in enumerate(self._entries):
            if s == seq:
                del self._entries[i]
                break
        self._take(seq)
        return True

    def ahead_of(self, deadline: float) -> int:
        """Jobs a new job with ``deadline`` would wait behind (deadline earlier or equal: equals keep FIFO)."""
        return bisect.bisect_right(self._entries, (float(deadline), math.inf))

    def _take(self, seq: int) -> Any:
        job = self._jobs.pop(seq)
        seqs = self._seq_of[id(job)]
        seqs.remove(seq)
        if not seqs:
            del self._seq_of[id(job)]
        return job

    def __contains__(self, job: Any) -> bool:
        return id(job) in self._seq_of

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Any]:
        return iter([self._jobs[s] for _, s in self._entries])


@dataclass(frozen=True)
class ChainLoad:
    """A chain as the prediction sees it: ``capacity`` slots (``c_k``), ``active`` jobs on them, ``job_s`` seconds
    per job of the planner's mean length (``T_k``), ``step_s`` seconds per step of one job (``T_k`` over the
    planner's steps per job) and ``open_s`` seconds from a job's slot to its first step (opening the chain)."""

    capacity: int
    active: int
    job_s: float
    step_s: float
    open_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.open_s < math.inf:
            raise ValueError(f"open_s must be finite and >= 0, got {self.open_s!r}")


class StepTimes:
    """Seconds per step of each chain as observed, by how many jobs were stepping on it: with continuous batching a
    step of ``c`` jobs takes longer than a step of one, so a full chain runs slower than the planner's ``T_k`` (a
    job alone) says, and a prediction from ``T_k`` alone admitted jobs that then missed (issue 18).

    One EWMA (weight ``alpha`` per new step) per (chain, jobs stepping); :meth:`step_s` reads it once it has
    ``min_samples`` steps, else it extrapolates from the occupancies that have (see there), else it falls back on
    the planned step. And one per chain of the seconds a job holds its slot besides its steps (opening the chain
    before the first, closing it after the last: :meth:`overhead_s`), which slows the rate slots free at as much;
    and of the seconds from a job's slot to its first step (:meth:`open_s`), which delay its own first token.
    ``chain``: any hashable name that stays the chain's across re-plans; :meth:`retain` forgets the others."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 5):
        if not 0 < alpha <= 1 or min_samples < 1:
            raise ValueError("alpha must be in (0, 1] and min_samples >= 1")
        self.alpha, self.min_samples = float(alpha), int(min_samples)
        self._by_chain: dict[Any, dict[int, list[float]]] = {}  # chain -> jobs -> [ewma seconds, steps seen]
        self._overhead: dict[Any, list[float]] = {}  # chain -> [ewma seconds, jobs seen]
        self._open: dict[Any, list[float]] = {}  # chain -> [ewma seconds, opens seen]
        self._open_best: dict[Any, float] = {}  # chain -> the fastest opening seen

    def retain(self, chains: Iterable[Any]) -> None:
        """Forget every chain not in ``chains`` (those a re-plan removed: what was learnt grew with every plan)."""
        keep = set(chains)
        for table in (self._by_chain, self._overhead, self._open, self._open_best):
            for chain in [c for c in table if c not in keep]:
                del table[chain]

    def chains(self) -> set[Any]:
        """The chains something was learnt of."""
        return {*self._by_chain, *self._overhead, *self._open}

    def _update(self, e: list[float], x: float) -> None:
        # the first values get a larger weight (a plain mean up to 1/alpha of them): no bias towards the first one
        e[0] += max(self.alpha, 1.0 / (e[1] + 1.0)) * (x - e[0])
        e[1] += 1.0

    def observe(self, chain: Any, jobs: int, step_s: float) -> None:
        """A step of ``jobs`` jobs on ``chain`` took ``step_s`` s (ignored unless both are positive and finite)."""
        if jobs < 1 or not 0 < step_s < math.inf:
            return
        self._update(self._by_chain.setdefault(chain, {}).setdefault(int(jobs), [float(step_s), 0.0]), float(step_s))

    def observe_overhead(self, chain: Any, seconds: float) -> None:
        """A job held a slot of ``chain`` ``seconds`` longer than its steps took (ignored unless finite, >= 0)."""
        if 0 <= seconds < math.inf:
            self._update(self._overhead.setdefault(chain, [float(seconds), 0.0]), float(seconds))

    def overhead_s(self, chain: Any) -> float:
        """Seconds a job of ``chain`` holds its slot besides its steps: 0 until seen ``min_samples`` times."""
        return self._learnt(self._overhead, chain)

    def observe_open(self, chain: Any, seconds: float) -> None:
        """A job got a slot of ``chain`` ``seconds`` before its first step began (ignored unless finite, >= 0)."""
        if 0 <= seconds < math.inf:
            self._update(self._open.setdefault(chain, [float(seconds), 0.0]), float(seconds))
            self._open_best[chain] = min(float(seconds), self._open_best.get(chain, math.inf))

    def open_s(self, chain: Any) -> float:
        """Seconds from a job's slot on ``chain`` to its first step: 0 until seen ``min_samples`` times."""
        return self._learnt(self._open, chain)

    def open_best_s(self, chain: Any) -> float:
        """The fastest opening of ``chain`` seen (0 until :meth:`open_s` has ``min_samples``): an idle chain's. The
        mean counts opens that waited for its servers' slots (held by other jobs, another plan's), seconds under
        load, which an idle swarm does not wait (``deadline_infeasible`` was given for them)."""
        return min(self._open_best.get(chain, 0.0), self.open_s(chain))

    def _learnt(self, table: dict[Any, list[float]], chain: Any) -> float:
        e = table.get(chain)
        return e[0] if e is not None and e[1] >= self.min_samples else 0.0

    def step_s(self, chain: Any, jobs: int, planned: float) -> float:
        """Seconds per step of ``chain`` with ``jobs`` stepping: the EWMA at ``jobs`` when seen often enough; else a
        line through the occupancies that were (least squares, never decreasing: more jobs never make a step
        faster), within the steps seen with more jobs and never below those seen with fewer; one occupancy seen
        alone: the plan scaled by the ratio seen there (the plan is one step for every occupancy, so the step seen);
        none: ``planned``."""
        seen = sorted((n, e[0]) for n, e in self._by_chain.get(chain, {}).items() if e[1] >= self.min_samples)
        jobs = max(1, int(jobs))
        for n, s in seen:
            if n == jobs:
                return s
        if not seen:
            return planned
        if len(seen) == 1:
            # bounded by the plan instead (a floor above it, a ceiling below), a chain seen four times faster than
            # planned stayed at the plan at every other occupancy and refused deadlines it would meet
            return seen[0][1]
        mn = sum(n for n, _ in seen) / len(seen)
        ms = sum(s for _, s in seen) / len(seen)
        slope = max(0.0, sum((n - mn) * (s - ms) for n, s in seen) / sum((n - mn) ** 2 for n, _ in seen))
        line = ms + slope * (jobs - mn)
        if line <= 0:
            line = planned
        line = min([line, *(s for n, s in seen if n > jobs)])
        return max([line, *(s for n, s in seen if n < jobs)])  # last: never faster than with fewer jobs


@dataclass(frozen=True)
class Prediction:
    """When a job would start, get its first token and its last (seconds from ``now``), and whether it is doomed
    (misses a deadline it was given by this prediction; ``reason`` says which)."""

    wait_s: float
    ttft_s: float
    total_s: float
    doomed: bool
    reason: str = ""


def predict(now: float, chains: Sequence[ChainLoad], ahead: int, output_tokens: int, *, siblings: int = 0,
            ttft_deadline: float = math.inf, deadline: float = math.inf, start: int | None = None) -> Prediction:
    """Predicted start, first and last token of a new job with ``ahead`` jobs served before it (see the module);
    ``output_tokens``: the most it may generate (its ``max_tokens``). ``siblings``: the request's other choices
    (``n`` > 1), served after it: its first token is this job's, its last the last choice's. ``ttft_deadline`` /
    ``deadline``: absolute times on the caller's clock (``inf``: none). ``start``: the index in ``chains`` of the
    chain the dispatcher starts the job on if it has a free slot now (its first token is timed there; None: not
    known). No chain at all: doomed when it has a deadline."""
    if ahead < 0 or output_tokens < 0 or siblings < 0:
        raise ValueError("ahead, output_tokens and siblings must be >= 0")
    usable = _usable(chains)
    if not usable:
        return _no_chain(chains, ttft_deadline, deadline)
    free = sum(max(0, c.capacity - c.active) for c in usable)
    mu = sum(c.capacity / c.job_s for c in usable)  # the jobs ahead are of the mean length, as far as we know
    wait = max(0, ahead + 1 - free) / mu
    last = max(0, ahead + 1 + siblings - free) / mu
    open_chains = [c for c in usable if c.active < c.capacity] if wait == 0 else usable
    c = _fastest(open_chains, output_tokens)
    if siblings and free > ahead:
        # the request's own choices free slots too: started ``free - ahead`` at once, the later ones follow on those
        # slots, each after one choice's run (by the mean rate alone, n = 6 on one slot waited 5 mean jobs for
        # 1-token choices and was refused a deadline an idle chain meets in a fraction of that)
        waves = siblings // (free - ahead)
        last = min(last, waves * (c.open_s + c.step_s * (1 + int(output_tokens))))
    # the first token: with a slot free, on the chain the dispatcher starts it on (``start``), else on the chain that
    # gives it soonest (a deadline on it alone was refused by the time of the chain best for the last token, one that
    # opens slower, though another had a free slot; but the soonest is not the dispatcher's pick: JFFC started a job
    # admitted by it on its fastest free chain, slow to open, and its first token came past ttft_deadline_ms)
    pick = chains[start] if start is not None and wait == 0 and 0 <= start < len(chains) else None
    if pick is not None and any(pick is x for x in open_chains):
        first = pick.open_s + pick.step_s
    else:
        first = min(x.open_s + x.step_s for x in open_chains)
    return _verdict(now, wait, c.step_s, output_tokens, ttft_deadline, deadline, last, c.open_s, first)


def meets_on(now: float, chain: ChainLoad, output_tokens: int, *, ttft_deadline: float = math.inf,
             deadline: float = math.inf) -> bool:
    """Whether a job started now on a free slot of ``chain`` meets its deadlines by :func:`predict`'s times there: its
    first token after the chain's opening and a prefill step, its last ``output_tokens`` steps later (its own: a
    request's later choices are :func:`predict`'s). False for a chain the prediction does not use."""
    if not _usable([chain]):
        return False
    return not _verdict(now, 0.0, chain.step_s, output_tokens, ttft_deadline, deadline, open_s=chain.open_s).doomed


def _fastest(chains: Sequence[ChainLoad], output_tokens: int) -> ChainLoad:
    """The chain that would serve a job of ``output_tokens`` soonest from its slot: its open and its steps."""
    return min(chains, key=lambda c: c.open_s + c.step_s * (1 + int(output_tokens)))


def _usable(chains: Sequence[ChainLoad]) -> list[ChainLoad]:
    return [c for c in chains if c.capacity > 0 and 0 < c.step_s <= c.job_s < math.inf]


def _no_chain(chains: Sequence[ChainLoad], ttft_deadline: float, deadline: float) -> Prediction:
    """No usable chain. None at all (none yet, a re-plan): not doomed; the caller waits for one as for a job without
    a deadline and drops the job if its deadline passes first (refusing at once turned away a ten-minute deadline
    during a re-plan). Chains whose every slot is held for good (sessions between turns): doomed if it has a
    deadline."""
    if not chains:
        return Prediction(math.inf, math.inf, math.inf, False, "no chain serves this model yet")
    has_deadline = math.isfinite(ttft_deadline) or math.isfinite(deadline)
    return Prediction(math.inf, math.inf, math.inf, has_deadline, "no chain has a slot it will free")


def _verdict(now: float, wait: float, step: float, output_tokens: int, ttft_deadline: float,
             deadline: float, last_wait: float | None = None, open_s: float = 0.0,
             first_s: float | None = None) -> Prediction:
    """A job that waits ``wait`` for a slot, opens its chain in ``open_s``, then runs a prefill and one step per
    output token of ``step`` each; ``last_wait``: the wait of the request's last choice (``n`` > 1), which its
    deadline is for; ``first_s``: seconds from its slot to its first token when not ``open_s + step`` (on another
    chain)."""
    ttft = wait + (open_s + step if first_s is None else first_s)
    total = (wait if last_wait is None else max(wait, last_wait)) + open_s + step * (1 + int(output_tokens))
    if now + ttft > ttft_deadline:
        return Prediction(wait, ttft, total, True, f"predicted time to first token {ttft * 1000:.0f} ms exceeds "
                                                   f"{_left(ttft_deadline - now)} of ttft_deadline_ms")
    if now + total > deadline:
        return Prediction(wait, ttft, total, True, f"predicted time to the last of {output_tokens} tokens "
                                                   f"{total * 1000:.0f} ms exceeds {_left(deadline - now)} of "
                                                   f"deadline_ms")
    return Prediction(wait, ttft, total, False)


def _left(seconds: float) -> str:
    # the time left now, not the value the client sent (deadline_ms 1 read "exceeds deadline_ms 0", or -1)
    return f"the {seconds * 1000:.0f} ms left" if seconds >= 0.0005 else "the time left (none)"


@dataclass(frozen=True)
class Preemptible:
    """A running job without a deadline (or best effort): ``chain`` index, ``started`` (seconds, the caller's
    clock), ``ref`` (the caller's handle), ``remaining_s`` (seconds until it frees its slot if left to run: see
    :func:`predict_from_running`)."""

    chain: int
    started: float
    ref: Any = None
    remaining_s: float = math.inf


def flex_victim(now: float, chains: Sequence[ChainLoad], running: Sequence[Preemptible], ahead: int,
                output_tokens: int, *, siblings: int = 0, ttft_deadline: float = math.inf, deadline: float = math.inf,
                promised: Sequence[int] = (),
                remaining: Sequence[Sequence[float]] | None = None) -> tuple[list[Preemptible], Prediction] | None:
    """FLEX's best-effort lane on chains (seed 003, Shepherd's value-0 requests, docs/scheduling-seeds.md §3.7):
    a new job that :func:`predict` dooms may take the slots of running jobs without a deadline, paused between
    two steps and resumed later. Returns the jobs to pause and the new job's prediction with their slots, or None
    if no pause makes it meet its deadlines.

    The slots are looked for chain by chain (the new job then waits only for that chain: ``ahead`` jobs before
    it, ``promised[k]`` slots of chain ``k`` already freed by earlier pauses and not yet taken). A request of
    ``n`` choices (``siblings`` = n - 1) may pause up to ``n`` jobs there, as few as meet its deadlines: one slot
    for its first choice would leave the others waiting for the jobs it was paused to get past. The chain needing
    the fewest pauses wins, then the one where the request would finish first; there the jobs started last are
    paused (they have the least progress at stake). When no one chain has enough, several chains' together
    (:func:`_pauses_across_chains`). ``remaining[k]``: the seconds until chain ``k``'s other running
    jobs (those not in ``running``) free their slots; given, a pause must also meet the deadlines by
    :func:`predict_from_running` (the pessimistic view that makes the caller look for a pause), which decides how
    many a request of several choices needs (the caller passes it only for those: for one choice it counts the
    jobs ahead as never giving their slots back, and turned down pauses that would have met the deadline). Shepherd's
    ``|B_g| >= lambda |B_c|`` rule does not apply here: a best-effort job's value is 0, so any batch that meets its
    deadlines is worth more (Alg. 2's best-effort lane, as in ``algorithms.deadlines``)."""
    best: tuple[tuple[int, float], list[Preemptible], Prediction] | None = None
    by_chain: dict[int, list[Preemptible]] = {}
    for r in running:
        by_chain.setdefault(r.chain, []).append(r)
    for k, jobs in sorted(by_chain.items()):
        if not 0 <= k < len(chains):
            continue
        c = chains[k]
        held = promised[k] if k < len(promised) else 0
        newest = sorted(jobs, key=lambda r: r.started, reverse=True)
        for p in range(1, min(len(newest), 1 + siblings) + 1):
            freed = replace(c, active=max(0, c.capacity - held - p))
            others = None if remaining is None else [*(remaining[k] if k < len(remaining) else ()),
                                                     *(r.remaining_s for r in newest[p:])]
            pred = _with_pauses(now, [freed], others, ahead, output_tokens, siblings, ttft_deadline, deadline)
            if pred.doomed:
                continue
            if best is None or (p, pred.total_s) < best[0]:
                best = ((p, pred.total_s), newest[:p], pred)
            break
    if best is None and siblings > 0:
        return _pauses_across_chains(now, chains, by_chain, ahead, output_tokens, siblings, promised, remaining,
                                     ttft_deadline, deadline)
    return None if best is None else (best[1], best[2])


def _pauses_across_chains(now: float, chains: Sequence[ChainLoad], by_chain: dict[int, list[Preemptible]], ahead: int,
                          output_tokens: int, siblings: int, promised: Sequence[int],
                          remaining: Sequence[Sequence[float]] | None, ttft_deadline: float, deadline: float
                          ) -> tuple[list[Preemptible], Prediction] | None:
    """:func:`flex_victim` for a request of several choices that no one chain has enough jobs to pause for (one
    pausable job on each of two chains, ``n`` = 2): the newest job of each chain in turn, the fastest chain first,
    until the jobs paused meet the deadlines on those chains together, the first on the fastest chain (where the
    first choice goes). None if even one per choice does not."""
    order = sorted((k for k in by_chain if 0 <= k < len(chains)), key=lambda k: (chains[k].step_s, k))
    newest = {k: sorted(by_chain[k], key=lambda r: r.started, reverse=True) for k in order}
    taken: dict[int, int] = {}
    picked: list[Preemptible] = []
    while len(picked) < 1 + siblings:
        more = [k for k in order if taken.get(k, 0) < len(newest[k])]
        if not more:
            return None
        for k in more[:1 + siblings - len(picked)]:
            picked.append(newest[k][taken.get(k, 0)])
            taken[k] = taken.get(k, 0) + 1
        if len(taken) < 2:
            continue  # one chain alone was tried by flex_victim
        # every chain at the slowest one's pace: the prediction runs each choice at the fastest chain's step, and
        # the last choice may well land on the slowest
        slowest = max((chains[k] for k in taken), key=lambda c: c.step_s)
        opening = max(chains[k].open_s for k in taken)
        freed = [ChainLoad(capacity=chains[k].capacity, job_s=slowest.job_s, step_s=slowest.step_s, open_s=opening,
                           active=max(0, chains[k].capacity - (promised[k] if k < len(promised) else 0) - n))
                 for k, n in taken.items()]
        others = None if remaining is None else [t for k, n in taken.items() for t in [
            *(remaining[k] if k < len(remaining) else ()), *(r.remaining_s for r in newest[k][n:])]]
        pred = _with_pauses(now, freed, others, ahead, output_tokens, siblings, ttft_deadline, deadline)
        if not pred.doomed:
            return picked, pred
    return None


def _with_pauses(now: float, freed: Sequence[ChainLoad], others: Sequence[float] | None, ahead: int,
                 output_tokens: int, siblings: int, ttft_deadline: float, deadline: float) -> Prediction:
    """A new job's prediction on chains with the paused jobs' slots freed: at the queue's rate and, with ``others``
    (the seconds until the jobs left running there free their slots: given for requests of several choices), the
    later of that and :func:`predict_from_running`'s."""
    kw = dict(siblings=siblings, ttft_deadline=ttft_deadline, deadline=deadline)
    pred = predict(now, freed, ahead, output_tokens, **kw)
    if pred.doomed or others is None:
        return pred
    return max(pred, predict_from_running(now, freed, others, ahead, output_tokens, **kw),
               key=lambda x: (x.doomed, x.total_s))


def predict_from_running(now: float, chains: Sequence[ChainLoad], remaining_s: Sequence[float], ahead: int,
                         output_tokens: int, *, siblings: int = 0, ttft_deadline: float = math.inf,
                         deadline: float = math.inf) -> Prediction:
    """A pessimistic twin of :func:`predict` for ``--schedule flex``: the running jobs free their slots when their
    own remaining work is done (``remaining_s``, from the most tokens each may still generate), not at the queue's
    mean rate, so a few long jobs without deadlines show as the obstacle they are. The ``ahead`` jobs take the
    first slots freed (free slots first); then the new job and each of its ``siblings`` in turn take the next one,
    a choice's slot freed again for a later choice when it is done; each opens and steps as on the fastest chain."""
    usable = _usable(chains)
    if not usable:
        return _no_chain(chains, ttft_deadline, deadline)
    free = sum(max(0, c.capacity - c.active) for c in usable)
    fastest = _fastest(usable, output_tokens)
    step, opening = fastest.step_s, fastest.open_s
    # the jobs ahead take the first slots (when they give them back is not known); each of the request's choices
    # takes the next one, and gives it back for a later choice when it is done
    slots = ([0.0] * free + sorted(max(0.0, r) for r in remaining_s))[ahead:]
    starts: list[float] = []
    for _ in range(1 + siblings):
        if not slots:
            starts.append(math.inf)
            break
        start = heapq.heappop(slots)
        starts.append(start)
        heapq.heappush(slots, start + opening + step * (1 + int(output_tokens)))
    return _verdict(now, starts[0], step, output_tokens, ttft_deadline, deadline, starts[-1], opening)
