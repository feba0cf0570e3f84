"""Token-step simulator of chains serving one or several models (seed 001, SeaLLM): the simulator the unserved
index replays recent traffic on, shared by the offline experiments (``sim/multimodel.py``) and the orchestrator's
model placer (``orchestrator/placement.py``, ``--placement-index simulated``). Pure: no I/O, no clock but the
simulated one (``Outcome.wall_s`` only reports how long a run took).

Model. Volunteer servers (:class:`~petals_chain.algorithms.multimodel.Volunteer`) each serve one model (the
placement); a model's servers form chains by GBP-CR + GCA (:func:`~petals_chain.algorithms.multimodel.model_chains`).
A chain is a sharing group: continuous batching of at most ``max_batch`` requests (and its GCA capacity ``c_k``),
steps back to back, each step ``a + b * extend tokens + d * batch`` seconds (:class:`StepCost`, scaled by the
chain's ``T_k`` over the reference chain's). Before every step the chain's scheduler (``db|fcfs|mlfq``) picks the
batch, so preemption is at step granularity. KV as the servers' paged cache holds it (``kv_tokens`` per chain,
:class:`ChainWorker`): a request joins a batch only when its whole reservation (prompt + declared output, rounded
up to pages) fits beside those of the requests before it in the scheduler's order (the seed's ``EnoughResource``;
a worse running request gives its pages back as it gives its batch place), so a chain never over-commits; one that
leaves the batch keeps its KV as cached pages, so resuming costs nothing unless a reservation evicted them. A
request whose reservation exceeds ``kv_tokens`` is refused at arrival. A request's first token comes out of its
prefill step; one token per step after that.

Dispatch (seed §3): a new request goes to the chain of its model with the fewest requests per batch place
(ties: the faster chain). Re-placement (SeaLLM's switch-over, §5): a server that changes model leaves after its
current step, its requests move to the model's other chains (their KV is lost there) and it serves its new
model after ``reload_s`` seconds (block download and load).

Execution time ``exec_s`` of a request = its steps alone on a reference chain (prefill ``a + b·input + d``, then
``a + d`` per token); ``L̂_s`` = the service's mean ``exec_s``; SLO = 5 x ``exec_s`` (§6.1).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from scipy.optimize import nnls

from petals_chain.algorithms import multimodel as mm
from petals_chain.algorithms.multimodel import Job, ServedModel, ServiceMonitor, Volunteer

# Tokens per KV page: the servers' --page-size default (swarm/memory.DEFAULT_PAGE_SIZE, which this pure layer may
# not import; tests/test_s33_chainsim_kv.py checks that they agree).
PAGE_SIZE = 16


@dataclass(frozen=True)
class StepCost:
    """Seconds per continuous-batching step: ``a + b * extend_tokens + d * batch_size``.

    Defaults: ``a`` = 20 ms per forward pass, ``b`` = 0.2 ms per prefill token (5k tokens/s: a 2000-token document
    costs 0.4 s, twenty decode steps, so recomputing long shared prefixes dominates, as for the seed's
    long-context QA and LLM-as-a-judge workloads), ``d`` = 1 ms per running request (decode grows with the batch)."""

    a: float = 0.02
    b: float = 0.0002
    d: float = 0.001

    def step(self, extend_tokens: int, batch: int) -> float:
        return self.a + self.b * extend_tokens + self.d * batch

    @staticmethod
    def prefill_tokens(input_tokens: Any, output_tokens: Any, batch: Any, prompt_per_step: float) -> Any:
        """Prefill tokens in a request's steps: its own prompt, and the others' in its batch, each bringing
        ``prompt_per_step`` per step (mean input / mean output in steady state). Numbers or numpy arrays."""
        return input_tokens + output_tokens * (batch - 1) * prompt_per_step

    def request_s(self, input_tokens: float, output_tokens: float, batch: float, prompt_per_step: float) -> float:
        """Service time of a request of ``output_tokens`` steps (its prefill the first) with ``batch`` requests in
        each on average (:meth:`prefill_tokens`): the model :meth:`fit` inverts."""
        prefill = self.prefill_tokens(input_tokens, output_tokens, batch, prompt_per_step)
        return self.a * output_tokens + self.b * prefill + self.d * output_tokens * batch

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float, float]], prior: "StepCost | None" = None,
            min_samples: int = 8) -> "StepCost | None":
        """The step cost that explains observed requests, or None with fewer than ``min_samples``.

        ``samples``: ``(input tokens, output tokens, service s, mean batch)`` of completed requests, where a request
        of ``o`` tokens took ``o`` steps (its prefill the first) with ``mean batch`` requests in each on average,
        and each of the others in its batch brought its prompt once in its own output's worth of steps
        (:meth:`request_s`: ``a·o + b·(input + o·(batch - 1)·mean input / mean output) + d·o·batch``), fitted by
        non-negative least squares (without the others' prompts ``d`` took their cost: 1.4x too large, and a replay of a
        loaded chain 55 % too slow, in ``tests/test_chainsim.py``). A coefficient the samples cannot tell apart
        from the others (every request alone, every request of the same lengths: a rank-deficient design), or
        that only a fit without a per-step cost would explain, keeps ``prior``'s ratio to ``a`` (default
        :data:`MM_COST`'s), so a swarm that never batched still predicts what batching costs."""
        rows = [(float(i), float(o), float(t), float(bt)) for i, o, t, bt in samples
                if o >= 1 and t > 0 and math.isfinite(t) and bt > 0]
        if len(rows) < min_samples:
            return None
        prior = prior or MM_COST
        x = np.array(rows)
        inp, out, service, batch = x[:, 0], x[:, 1], x[:, 2], x[:, 3]

        def rank(*cols: np.ndarray) -> int:
            return int(np.linalg.matrix_rank(np.stack(cols, axis=1)))

        # what the samples tell apart from the steps' cost: the prompt's share unless every request has the same
        # lengths, the batch's share unless every request ran alone (or in batches of one size)
        told = ("a",) + (("b",) if rank(out, inp) == 2 else ()) + (("d",) if rank(out, out * batch) == 2 else ())
        prefill = cls.prefill_tokens(inp, out, batch, inp.mean() / out.mean())
        for free in [told] + [f for f in (("a", "d"), ("a", "b"), ("a",)) if set(f) < set(told)]:
            # a coefficient not fitted rides on ``a`` at the prior's ratio: the column of ``a`` carries it
            col_a = out + (0 if "b" in free else prior.b / prior.a * prefill) + (0 if "d" in free else
                                                                               prior.d / prior.a * out * batch)
            cols = {"a": col_a, "b": prefill, "d": out * batch}
            design = np.stack([cols[k] for k in free], axis=1)
            if np.linalg.matrix_rank(design) < len(free):
                continue
            coef, _ = nnls(design / service[:, None], np.ones(len(rows)))  # relative errors: short and long alike
            got = dict(zip(free, coef))
            if got["a"] > 0:
                break
        else:
            return None
        a = got["a"]
        return cls(a=float(a), b=float(got.get("b", prior.b / prior.a * a)),
                   d=float(got.get("d", prior.d / prior.a * a)))

# A chain's step: 30 ms fixed (a decode step of a whole model, network included), 0.05 ms per prefill token
# (20k tokens/s: a 2000-token prompt costs ~3 decode steps), 1 ms per request in the batch.
MM_COST = StepCost(a=0.03, b=0.00005, d=0.001)


@dataclass(eq=False)
class MMRequest:
    """One request of ``model`` (service ``service``, default the model): ``input``/``output`` tokens; the
    simulator fills the times (s) and counters."""

    rid: int
    model: str
    arrival: float
    input: int
    output: int
    exec_s: float = math.nan  # alone on the reference chain
    service: str = ""
    max_tokens: int | None = None  # declared output limit, what its KV reservation counts (None: exactly ``output``)
    first_token: float = math.nan
    finished: float = math.nan
    admitted: float = math.nan  # the start of its first step
    batch_steps: int = 0  # requests in each of its steps, summed (its mean batch: what StepCost.fit reads)
    done: int = 0
    started: bool = False  # prefilled at least once
    kv_lost: bool = False  # its KV must be recomputed before it decodes again
    job: Job | None = None
    chain: Any = None
    preemptions: int = 0
    recomputes: int = 0
    migrations: int = 0
    refused: bool = False  # its reservation exceeds a chain's KV: no chain of the simulation can ever hold it

    def __post_init__(self) -> None:
        self.service = self.service or self.model
        if self.max_tokens is not None and self.max_tokens < self.output:
            raise ValueError(f"request {self.rid}: max_tokens {self.max_tokens} < its output {self.output}")

    def reservation(self, page_size: int = PAGE_SIZE) -> int:
        """KV tokens a server reserves for this request at open and holds until it leaves: prompt + declared output
        (``max_tokens``, else ``output``) rounded up to whole pages (``server/runner.pages_needed`` per block)."""
        n = self.input + (self.output if self.max_tokens is None else self.max_tokens)
        return -(-n // page_size) * page_size

    @property
    def latency(self) -> float:
        return self.finished - self.arrival


def exec_alone(inp: int, out: int, cost: StepCost) -> float:
    """Seconds of a request alone on the reference chain: a prefill step (its first token), then ``out - 1``."""
    return cost.step(inp, 1) + (out - 1) * cost.step(0, 1)


class ChainWorker:
    """One chain: its scheduler, the batch of the step in flight and the KV pages (``kv_tokens`` in all).

    As a server's paged cache (``server/runner.py``, ``kv_cache.py``): a request in the batch holds its whole
    :meth:`MMRequest.reservation`, taken when it joins (:meth:`choose`: only if it fits beside the reservations of
    the requests that go before it) and kept until it leaves, so decoding never outgrows the pages. A request that
    leaves the batch unfinished (paused) keeps its KV (prompt + generated tokens) as cached pages, which count as
    free: a reservation that needs them evicts the KV of the request paused longest ago (recomputed when it resumes;
    the servers' pool evicts least recently used pages first, ``server/kv_cache.py``).
    Hence ``kv_used`` (reserved + cached) never exceeds ``kv_tokens``."""

    def __init__(self, key: Any, model: str, servers: tuple[str, ...], cost: StepCost, scale: float, capacity: int,
                 sched: mm.Scheduler, kv_tokens: int, page_size: int = PAGE_SIZE):
        self.key, self.model, self.servers = key, model, servers
        self.cost, self.scale, self.capacity, self.sched = cost, scale, capacity, sched
        self.kv_tokens, self.page_size = kv_tokens, page_size
        self.reserved: dict[int, int] = {}  # rid -> tokens reserved by a request in the batch
        self.cached: dict[int, tuple[Job, int]] = {}  # rid -> (job, tokens of KV) of a paused request
        self.kv_reserved = 0
        self.kv_cached = 0
        self.batch: list[Job] = []
        self.stepping = False
        self.draining = False
        self.alive = True
        self.steps = 0

    @property
    def kv_used(self) -> int:
        """Tokens of pages in use: reserved by running requests plus cached by paused ones."""
        return self.kv_reserved + self.kv_cached

    def choose(self, now: float, one_of: Callable[[Job], Any] | None = None) -> list[Job]:
        """The next step's batch: the scheduler's choice (``select``, the seed's ``EnoughResource`` as ``fits``) with
        each request's reservation. A waiting request joins only if its pages fit beside those of the requests
        ahead of it in the batch; under pause rule ``seed`` a better one may so take a worse running one's pages, as
        it takes its batch place, and a running request that no longer fits beside better ones is paused, as are
        those the scheduler pauses for a batch place (:meth:`pause`). Paused KV the reservations need is evicted,
        least recently used first (the request paused longest ago), as the servers' page pool evicts."""
        sched = self.sched
        was_running = {id(j) for j in self.batch if j.running}  # the last step's unfinished jobs (not every job's)

        # The pages reserved by ``ahead``, kept as it grows: select asks about every waiting request in order while a
        # batch place is free and passes its batch, which only grows between calls (a new list where a job leaves
        # it); summed afresh per call, a queue of requests that do not fit made each step O(queue x batch).
        memo: list = [None, 0, 0]  # [the list summed (held, so its id is not reused), its length then, the sum]

        def fits(job: Job, ahead: Sequence[Job]) -> bool:
            r: MMRequest = job.key
            need = r.reservation(self.page_size)
            if memo[0] is not ahead or memo[1] > len(ahead):
                memo[:] = [ahead, 0, 0]
            if memo[1] < len(ahead):
                memo[2] += sum(self.reserved[k.key.rid] for k in ahead[memo[1]:])
                memo[1] = len(ahead)
            if memo[2] + need > self.kv_tokens:
                return False
            self._uncache(r.rid)  # its own cached KV is now part of its reservation
            self.reserved[r.rid] = need
            self.kv_reserved += need
            return True

        batch = sched.select(self.capacity, now, fits, one_of=one_of)
        # Every request that joined fits beside all ahead of it, so only running ones after the last that joined can
        # be over (rule "seed"): the worst of them give their pages back (pausing as select pauses one for a place).
        total = sum(self.reserved[j.key.rid] for j in batch)
        while total > self.kv_tokens and batch and id(batch[-1]) in was_running:
            j = batch.pop()
            total -= self.reserved[j.key.rid]
            j.running, j.waiting_since = False, now
            sched.preempted.append(j)
        for j in sched.preempted:
            self.pause(j.key)
        if self.kv_used > self.kv_tokens:  # cached pages count as free: the reservations take them
            for j, _ in list(self.cached.values()):  # least recently used first: paused longest ago
                self._uncache(j.key.rid)
                j.key.kv_lost = True
                if self.kv_used <= self.kv_tokens:
                    break
        return batch

    def pause(self, r: MMRequest) -> None:
        """``r`` left the batch unfinished: its reservation ends and its KV stays as cached pages."""
        self.free(r)
        if r.started and not r.kv_lost:
            kv = r.input + r.done
            self.cached[r.rid] = (r.job, kv)
            self.kv_cached += kv

    def free(self, r: MMRequest) -> None:
        """``r`` finished or left the chain: its reservation and its cached KV are released."""
        n = self.reserved.pop(r.rid, None)
        if n is not None:
            self.kv_reserved -= n
        self._uncache(r.rid)

    def _uncache(self, rid: int) -> None:
        c = self.cached.pop(rid, None)
        if c is not None:
            self.kv_cached -= c[1]


@dataclass
class Outcome:
    """One run: the requests with their times, the counters and the plan history."""

    requests: list[MMRequest]
    schedule: str
    steps: int
    wall_s: float
    plans: list[dict] = field(default_factory=list)
    intervals: list[dict] = field(default_factory=list)
    unfinished: int = 0  # requests never finished (no chain ran them): metrics over the finished ones omit them
    refused: int = 0  # of those, requests whose KV reservation exceeds ``kv_tokens`` (refused at arrival)


def _llm(job: Job) -> str:
    return job.key.model


class MultiModelSim:
    """Event-driven token-step simulator. ``models``: the served models (name, blocks, memory, rate for GBP-CR);
    ``servers``: the volunteers; ``plan``: server -> model at time 0; ``schedule``: ``db|fcfs|mlfq``.

    ``replan`` (optional): a callable ``(sim, now) -> (new plan or None, next check time or None)`` called at the
    times it returns (the adaptive replacement of :func:`petals_chain.sim.multimodel.adaptive_policy`).
    ``group_of``: request model -> the served model whose chains run it (the seed's setting, where one sharing
    group time-shares several LLMs: a ``shared`` model serving both; its services stay apart, and a step runs the
    requests of one LLM only, that of the discipline's first job). ``ref_times``: see
    :meth:`ref_service_time`. ``kv_tokens``: each chain's KV pages, in tokens of pages of ``page_size``
    (:class:`ChainWorker`). ``pauses``: when a chain's scheduler pauses a running request
    (:data:`~petals_chain.algorithms.multimodel.PAUSE_RULES`; default the orchestrator's)."""

    def __init__(self, models: Sequence[ServedModel], servers: Sequence[Volunteer], plan: Mapping[str, str], *,
                 schedule: str = "db", cost: StepCost = MM_COST, max_batch: int = 16, kv_tokens: int = 131072,
                 monitor_priors: Mapping[str, tuple[float, float]] | None = None,
                 sched_kw: Mapping[str, Any] | None = None, reload_s: float = 20.0,
                 replan: Callable[["MultiModelSim", float], tuple[dict | None, float | None]] | None = None,
                 replan_first: float | None = None, group_of: Mapping[str, str] | None = None,
                 ref_times: Mapping[str, float] | None = None, page_size: int = PAGE_SIZE, pauses: str = "runtime"):
        if schedule not in mm.SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        for name, v in (("kv_tokens", kv_tokens), ("page_size", page_size)):
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.models = {m.name: m for m in models}
        self.servers = {s.name: s for s in servers}
        self.schedule, self.cost, self.max_batch = schedule, cost, int(max_batch)
        self.kv_tokens, self.page_size = int(kv_tokens), int(page_size)
        self.monitor = ServiceMonitor(monitor_priors)
        self.pauses = pauses
        self.sched_kw = {"pauses": pauses, **(sched_kw or {})}
        mm.make_scheduler(schedule, **self.sched_kw)  # bad scheduler arguments fail here, not at the first chain
        self.reload_s = float(reload_s)
        self.replan_fn, self.replan_first = replan, replan_first
        self.group_of = dict(group_of or {})
        self.ref_times = dict(ref_times or {})
        self.plan: dict[str, str] = dict(plan)
        self.loading: dict[str, str] = {}  # server -> model it is loading
        self.workers: dict[Any, ChainWorker] = {}
        self.backlog: dict[str, list[MMRequest]] = {m: [] for m in self.models}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.steps = 0
        self.finished = 0
        self.plans: list[dict] = []
        self.arrived: list[MMRequest] = []
        for m in self.models:
            self._rebuild(m)

    # ------------------------------------------------------------------------------------------- chains

    def _push(self, t: float, kind: int, x: Any) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, x))
        self.seq += 1

    def ref_service_time(self, model: ServedModel) -> float:
        """``T`` of the chain ``cost`` describes: ``ref_times[model]`` (a cost fitted on a running swarm's chains),
        else a whole-model chain of speed-1 servers with free links."""
        return self.ref_times.get(model.name) or model.num_blocks * model.block_time

    def _rebuild(self, model: str) -> None:
        """Recompute ``model``'s chains on the servers serving it; unchanged chains keep their requests."""
        m = self.models[model]
        servers = [self.servers[s] for s, mm_ in self.plan.items() if mm_ == model]
        chains = mm.model_chains(servers, m)
        keep = set()
        for ch in chains:
            key = (model, ch.servers, ch.spans)
            keep.add(key)
            if key not in self.workers:
                scale = ch.service_time / self.ref_service_time(m)
                c = StepCost(self.cost.a * scale, self.cost.b * scale, self.cost.d * scale)
                self.workers[key] = ChainWorker(key, model, ch.servers, c, scale, min(self.max_batch, ch.capacity),
                                                mm.make_scheduler(self.schedule, self.monitor, **self.sched_kw),
                                                self.kv_tokens, self.page_size)
        for key, w in list(self.workers.items()):
            if w.model == model and key not in keep and w.alive:
                self._drain(w)
        waiting, self.backlog[model] = self.backlog[model], []
        for r in waiting:
            self._dispatch(r)

    def _drain(self, w: ChainWorker) -> None:
        w.draining = True
        if not w.stepping:
            self._retire(w)

    def _retire(self, w: ChainWorker) -> None:
        """The chain is gone: its requests go to the model's other chains (without their KV)."""
        w.alive = False
        self.workers.pop(w.key, None)
        for j in list(w.sched.jobs.values()):
            w.sched.remove(j)
            r: MMRequest = j.key
            r.chain = None
            r.kv_lost = r.started
            r.migrations += 1
            self._dispatch(r)

    def _dispatch(self, r: MMRequest) -> None:
        g = self.group_of.get(r.model, r.model)
        ws = [w for w in self.workers.values() if w.model == g and w.alive and not w.draining]
        if not ws:
            self.backlog[g].append(r)
            return
        w = min(ws, key=lambda w: (len(w.sched) / w.capacity, w.scale))
        if r.job is None:
            r.job = Job(r, r.service, r.arrival, prefill_s=self.cost.step(r.input, 1))
        r.chain = w.key
        w.sched.arrive(r.job, self.now)
        if not w.stepping:
            self._start_step(w)

    def _start_step(self, w: ChainWorker) -> None:
        if not w.alive:
            return
        if w.draining:
            self._retire(w)
            return
        prev = set(map(id, w.batch))
        # several LLMs time-sharing a chain (group_of): a step runs one of them (one model's weights at a time)
        batch = w.choose(self.now, one_of=_llm if self.group_of else None)
        for j in w.sched.preempted:
            j.key.preemptions += 1
        extend = 0
        for j in batch:
            if id(j) in prev:
                continue
            r: MMRequest = j.key
            if math.isnan(r.admitted):
                r.admitted = self.now
            if not r.started:
                extend += r.input
            elif r.kv_lost:
                extend += r.input + r.done  # its KV is not here (evicted or migrated): recompute
                r.recomputes += 1
                r.kv_lost = False
        w.batch = batch
        if not batch:
            w.stepping = False
            return
        w.stepping = True
        dt = w.cost.step(extend, len(batch))
        self._push(self.now + dt, 1, (w, dt))
        w.steps += 1
        self.steps += 1

    def _end_step(self, w: ChainWorker, dt: float) -> None:
        w.stepping = False
        if not w.alive:
            return
        batch = w.batch
        w.sched.charge(batch, dt / w.scale, self.now)  # budgets in reference-chain seconds
        for j in batch:
            r: MMRequest = j.key
            r.started = True
            r.done += 1
            r.batch_steps += len(batch)
            if r.done == 1:
                r.first_token = self.now
            if r.done >= r.output:
                r.finished = self.now
                self.finished += 1
                w.sched.complete(j, self.now)
                w.free(r)
        w.batch = [j for j in batch if j.key.done < j.key.output]
        self._start_step(w)

    # --------------------------------------------------------------------------------------- re-planning

    def apply_plan(self, new: Mapping[str, str]) -> list[tuple[str, str | None, str]]:
        """Move the servers whose model differs in ``new``: they leave now and serve their new model after
        ``reload_s``. Returns the moves."""
        moves = [(s, self.plan.get(s), m) for s, m in new.items() if self.plan.get(s) != m and s not in self.loading]
        touched = set()
        for s, src, dst in moves:
            if src is not None:
                del self.plan[s]
                touched.add(src)
            self.loading[s] = dst
            self._push(self.now + self.reload_s, 2, s)
        for m in touched:
            self._rebuild(m)
        if moves:
            self.plans.append({"t": self.now, "moves": [list(x) for x in moves]})
        return moves

    def _loaded(self, s: str) -> None:
        m = self.loading.pop(s)
        self.plan[s] = m
        self._rebuild(m)

    # -------------------------------------------------------------------------------------------- run

    def run(self, requests: Sequence[MMRequest]) -> Outcome:
        t0 = time.perf_counter()
        for r in requests:
            self._push(r.arrival, 0, r)
        if self.replan_fn is not None and self.replan_first is not None:
            self._push(self.replan_first, 3, None)
        pending, refused = len(requests), 0
        while self.heap and pending > refused:
            self.now, _, kind, x = heapq.heappop(self.heap)
            if kind == 0:
                self.arrived.append(x)
                if x.reservation(self.page_size) > self.kv_tokens:  # a server refuses what its pages cannot hold
                    x.refused = True
                    refused += 1
                else:
                    self._dispatch(x)
            elif kind == 1:
                self._end_step(*x)
                pending = len(requests) - self.finished
            elif kind == 2:
                self._loaded(x)
            else:
                new, nxt = self.replan_fn(self, self.now)
                if new:
                    self.apply_plan(new)
                if nxt is not None:
                    self._push(nxt, 3, None)
        return Outcome(list(requests), self.schedule, self.steps, time.perf_counter() - t0, self.plans,
                       unfinished=pending, refused=refused)


def summarize(reqs: Sequence[MMRequest], *, scale: float = mm.SLO_SCALE, since: float = 0.0,
              until: float = math.inf, by: str = "service") -> dict[str, Any]:
    """Normalized latency (Eq. 1, mean of ``L_r / L̂_s``; and the ratio of means), P99 latency, SLO attainment
    (Eq. 5), mean TTFT, overall and per model, over the finished requests that arrived in ``[since, until)``.
    ``by``: what ``s`` is in ``L̂_s`` (``service``, the seed's; or ``model``, one service per model)."""
    rs = [r for r in reqs if since <= r.arrival < until and not math.isnan(r.finished)]
    if not rs:
        return {"requests": 0}

    def of(r: MMRequest) -> str:
        return r.service if by == "service" else r.model

    lhat: dict[str, float] = {}
    for s in {of(r) for r in rs}:
        lhat[s] = float(np.mean([r.exec_s for r in reqs if of(r) == s]))

    def block(xs: Sequence[MMRequest]) -> dict[str, Any]:
        lat = [r.latency for r in xs]
        norm = [lhat[of(r)] for r in xs]
        return {"requests": len(xs), "norm_latency": mm.normalized_latency(lat, norm),
                "norm_latency_ratio_of_means": float(np.mean(lat) / np.mean(norm)),
                "p99_s": mm.p99(lat), "mean_s": float(np.mean(lat)),
                "slo_attainment": mm.slo_attainment(lat, [r.exec_s for r in xs], scale),
                "ttft_s": float(np.mean([r.first_token - r.arrival for r in xs])),
                "preemptions": int(sum(r.preemptions for r in xs)), "recomputes": int(sum(r.recomputes for r in xs))}

    out = block(rs)
    out["per_model"] = {m: block([r for r in rs if r.model == m]) for m in sorted({r.model for r in rs})}
    out["lhat_s"] = lhat
    return out


def fresh(reqs: Sequence[MMRequest]) -> list[MMRequest]:
    """Unsimulated copies (every policy sees the same workload)."""
    return [MMRequest(r.rid, r.model, r.arrival, r.input, r.output, r.exec_s, r.service, r.max_tokens) for r in reqs]


def sched_kwargs(schedule: str, cost: StepCost, reqs: Sequence[MMRequest], max_batch: int) -> dict[str, Any]:
    """MLFQ: ``q_1`` = a decode step of a half-full batch; starvation after 2 x the pooled mean ``exec_s``
    (FastServe's threshold, ours [outside]). DB: the default starvation factor."""
    if schedule == "mlfq":
        return {"q1": cost.step(0, max(1, max_batch // 2)),
                "starve_s": mm.STARVE_FACTOR * float(np.mean([r.exec_s for r in reqs]))}
    return {}


def simulate(reqs: Sequence[MMRequest], models: Sequence[ServedModel], servers: Sequence[Volunteer],
             plan: Mapping[str, str], schedule: str, *, cost: StepCost = MM_COST, max_batch: int = 16,
             **kw: Any) -> Outcome:
    """Run ``schedule`` on fresh copies of ``reqs``; the monitor's priors are the services' ``exec_s`` statistics."""
    rs = fresh(reqs)
    priors = {}
    for sv in sorted({r.service for r in rs}):
        e = np.array([r.exec_s for r in rs if r.service == sv])
        priors[sv] = (float(e.mean()), float(e.std()))
    sim = MultiModelSim(models, servers, plan, schedule=schedule, cost=cost, max_batch=max_batch,
                        monitor_priors=priors, sched_kw=sched_kwargs(schedule, cost, rs, max_batch), **kw)
    return sim.run(rs)


def _of(x: Any, name: str) -> Any:
    """``x[name]`` if ``x`` is per model, else ``x``."""
    return x[name] if isinstance(x, Mapping) else x


PLACEMENTS = ("analytic", "simulated")  # the unserved index by the M/M/C estimate, or by this simulator


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def simulated_evaluate(history: Sequence[MMRequest], models: Sequence[ServedModel], *, schedule: str = "db",
                       cost: StepCost | Mapping[str, StepCost] = MM_COST, max_batch: int | Mapping[str, int] = 16,
                       kv_tokens: int = 131072, alpha: float = mm.ALPHA, scale: float = mm.SLO_SCALE,
                       horizon_s: float | None = None, ref_times: Mapping[str, float] | None = None,
                       page_size: int = PAGE_SIZE, pauses: str = "runtime") -> mm.Evaluate:
    """The seed's unserved index (§4.1, Eq. 6) by simulation: ``evaluate(servers per model)`` replays each model's
    requests of ``history`` on its servers alone (this simulator, ``schedule``) and counts the SLO misses and
    ``L_N^s``. Unlike the M/M/C estimate it sees the traffic's bursts and lengths, so a model whose requests come in
    bursts is given the servers its bursts need. A model with no complete chain counts every request as unserved,
    and one with a rate but no request in the history (a short window between a bursty model's bursts) the
    ``rate x horizon_s`` requests it expects (``horizon_s``: default the history's span), so that no plan may drop
    its last chain for free. Results are cached by (model, servers): Alg. 1 re-evaluates unchanged groups at every
    step. ``cost``, ``max_batch``: one for all models or one per model (a running swarm's fitted costs), with
    ``ref_times`` the chain time each cost was measured on (:meth:`MultiModelSim.ref_service_time`)."""
    by_name = {m.name: m for m in models}
    if horizon_s is None:
        horizon_s = max((r.arrival for r in history), default=0.0) - min((r.arrival for r in history), default=0.0)
    per = {n: [r for r in history if r.model == n] for n in by_name}
    cache: dict[tuple[str, tuple[str, ...]], mm.ModelEstimate] = {}

    def one(name: str, group: Sequence[Volunteer]) -> mm.ModelEstimate:
        key = (name, tuple(s.name for s in group))
        if key not in cache:
            m, rs = by_name[name], per[name]
            n = float(len(rs))
            if not mm.model_chains(group, m):
                unserved = n if rs else m.rate * horizon_s
                est = (mm.ModelEstimate(unserved, unserved, mm.UNPLACED_LN, unserved + alpha * mm.UNPLACED_LN)
                       if unserved else mm.ModelEstimate(0.0, 0.0, 0.0, 0.0))
            elif not rs:
                est = mm.ModelEstimate(0.0, 0.0, 0.0, 0.0)
            else:
                o = simulate(rs, [m], group, {s.name: name for s in group}, schedule, cost=_of(cost, name),
                             max_batch=_of(max_batch, name), kv_tokens=kv_tokens, ref_times=ref_times,
                             page_size=page_size, pauses=pauses)
                sm = summarize(o.requests, scale=scale)
                misses = n * (1.0 - sm["slo_attainment"])
                est = mm.ModelEstimate(n, misses, sm["norm_latency"], misses + alpha * sm["norm_latency"])
            cache[key] = est
        return cache[key]

    def evaluate(groups: Mapping[str, Sequence[Volunteer]]) -> dict[str, mm.ModelEstimate]:
        return {n: one(n, groups.get(n, ())) for n in by_name}

    return evaluate
