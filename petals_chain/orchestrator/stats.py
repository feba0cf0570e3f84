"""Measured statistics of the orchestrator: recent completions and Prometheus metrics."""

from __future__ import annotations

import asyncio
import math
import sys
import time
import weakref
from collections import deque
from typing import Any, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from petals_chain.orchestrator.auth import ANONYMOUS, CLIENT
from petals_chain.orchestrator.deadlines import OUTCOMES as DEADLINE_OUTCOMES
from petals_chain.orchestrator.errors import RequestError
from petals_chain.orchestrator.request_id import REQUEST

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# How an API request ended (petals_chain_api_requests): its answer came | the swarm could not serve it (503) or an
# error ended it | it was refused for load or limits (429: the dispatcher's queue full, more than the swarm holds, a
# doomed deadline; the admission limits' client in-flight cap, tokens per minute, early queue-full) | its deadline
# passed while it waited for a chain (504) | its client went away first | the request itself was refused (4xx other
# than 429: invalid fields, unknown model, prompt too long, body too large, session busy): the client's to fix, kept
# apart so that neither a refusal-rate nor an error-rate alert fires on a client's bad requests
REQUEST_OUTCOMES = ("completed", "failed", "refused", "dropped", "cancelled", "invalid")
JOB_OUTCOMES = ("completed", "failed", "unserved", "cancelled")  # a job's (petals_chain_client_requests)


def request_outcome(error: BaseException | None) -> str:
    """The outcome (:data:`REQUEST_OUTCOMES`) of a request that ``error`` ended (None: it completed)."""
    if error is None:
        return "completed"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, RequestError):
        return status_outcome(error.status, error.code)
    if getattr(error, "code", None) == "shutting_down":  # core.ShuttingDown: never ran, to be sent elsewhere
        return "refused"
    return "failed"


def status_outcome(status: int, code: str | None = None) -> str:
    """The outcome (:data:`REQUEST_OUTCOMES`) of a request answered with HTTP ``status`` (and error ``code``)."""
    if status < 400:
        return "completed"
    if status == 504 or code == "deadline_exceeded":
        return "dropped"
    if status == 429 or code == "shutting_down":  # turned away by a stopping orchestrator: not an error of the swarm
        return "refused"
    if status == 499 or code == "client_disconnected":
        return "cancelled"
    if status < 500:
        return "invalid"
    return "failed"


def remove_client_series(metric: Any, client: str, outcomes: Sequence[str] = ()) -> None:
    """Remove ``client``'s series of ``metric``: the one labelled ``(client,)``, or with ``outcomes`` the one labelled
    ``(client, outcome)`` for each (a series never made is no matter). Each by its labels, so the cost does not grow
    with the other clients' series: finding them by a collect of the whole metric, or by prometheus_client's
    ``remove_by_labels`` (a scan of every series), made a reload that removed 1,000 of 2,000 names block the event
    loop for minutes."""
    for values in [(client, o) for o in outcomes] or [(client,)]:
        metric.remove(*values)


class _RequestParts:
    """The parts (one per prompt) of one API request under way, and the outcome they decide so far."""

    __slots__ = ("parts", "ended", "outcome", "counted")

    def __init__(self) -> None:
        self.parts = 0
        self.ended = 0
        self.outcome = "completed"
        self.counted = False


class Stats:
    """Counters and a bounded history of completed jobs (``response = wait + service``)."""

    def __init__(self, history: int = 500):
        self.history: deque[dict] = deque(maxlen=history)
        self.completed = 0
        self.failed = 0
        self.unserved = 0  # jobs that ended before holding a chain (refused, dropped queued, their client gone)
        self.cancelled = 0  # jobs stopped while they held a chain (their client gone, a sibling choice failed)
        self.failovers = 0
        self.forks = 0  # n > 1 choices that started from a sibling's prefill (KV copied at the servers)
        self.open_waits = 0  # chain opens a server refused for KV memory, retried as a wait in its FIFO
        self.open_rewaits = 0  # such waits that ran out at the server (open_wait_max_s) and were sent again
        self.extensions = 0  # jobs' chains asked to hold more tokens than opened for (granted)
        self.preemptions = 0  # jobs that gave their chain back for lack of pages (to grow, or a lean first step)
        self.pauses = 0  # jobs that gave their chain to one with a deadline (flex) or of higher priority (db, mlfq)
        self.prompt_tokens = 0
        self.prefix_hits = 0  # chains opened on a prompt prefix their servers held in their prefix caches
        self.prefix_cached_tokens = 0  # prompt tokens those chains did not compute
        # tokens of the sequences chains were opened for (add_chain_open): what the prefix caches were asked for, the
        # hit rate's denominator (each open counts, as each hit does: n > 1 choices on other chains, failovers,
        # resumed jobs, session turns reopening on their history)
        self.prefix_lookup_tokens = 0
        self.tokens = 0
        self.relay_steps = 0
        # Speculative decoding: verification passes, draft tokens sent with them, drafts the model kept.
        self.spec_passes = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.passes = {"orchestrator": 0, "push": 0}  # passes through a whole chain by relay mode
        self.legs = {"orchestrator": 0, "push": 0}  # network legs on those passes' critical paths
        self.push_rescues = 0
        self.push_mismatches = 0
        self.hop_s = 0.0  # time spent waiting on servers (incl. network) summed over hops
        self.service_s = 0.0  # sum of jobs' service times
        # Failover replays by kind: "partial" (one hop's span re-fed on a replacement server) or "full" (the
        # whole prefix through a new chain). tokens: positions re-fed; token_blocks: tokens x blocks recomputed.
        self.replays = {"partial": 0, "full": 0}
        self.replay_tokens = {"partial": 0, "full": 0}
        self.replay_token_blocks = {"partial": 0, "full": 0}
        self.recent_replays: deque[dict] = deque(maxlen=50)
        self.registry = CollectorRegistry()
        r = self.registry
        # jobs, not requests (the name stays for the dashboards that read it): one per completion, so a request of
        # n = 3 or of 3 prompts counts 3 (each its own job, its own outcome), and one per session turn
        self.m_requests = Counter("petals_chain_requests", "Jobs by outcome: one per completion (a request with n = 3 "
                                  "or 3 prompts counts 3) and per session turn; completed | failed | unserved (ended "
                                  "before it held a chain: refused, dropped while queued, its client gone) | "
                                  "cancelled (stopped while it held one: its client gone, another choice of its "
                                  "request failed, a stop cut it off)",
                                  ["outcome"], registry=r)
        self.m_response = Histogram("petals_chain_response_seconds", "Response time (wait + service)", buckets=_BUCKETS, registry=r)
        self.m_wait = Histogram("petals_chain_wait_seconds", "Time waiting for a chain", buckets=_BUCKETS, registry=r)
        self.m_service = Histogram("petals_chain_service_seconds", "Time on a chain", buckets=_BUCKETS, registry=r)
        self.m_tokens = Counter("petals_chain_generated_tokens", "Generated tokens", registry=r)
        self.m_prompt_tokens = Counter("petals_chain_prompt_tokens", "Prompt tokens", registry=r)
        self.m_prompt_cached = Counter("petals_chain_prompt_cached_tokens", "Tokens whose KV came from the servers' "
                                       "prefix caches when a chain opened (not computed): of a prompt, a session "
                                       "turn's history, a failover's replay", registry=r)
        self.m_prefix_lookup = Counter("petals_chain_prefix_lookup_tokens", "Tokens of the sequences chains opened "
                                       "for (not forked from a sibling): what the prefix caches were asked for; "
                                       "petals_chain_prompt_cached_tokens of them were hits", registry=r)
        self.m_draft_failures = Gauge("petals_chain_speculative_draft_failures", "Generations whose draft model "
                                      "(--speculative draft:MODEL) failed or timed out, since start: they went on "
                                      "without drafts", registry=r)
        self.m_deadlines = Counter("petals_chain_deadline_requests", "Requests with a deadline by client and outcome "
                                   "(met, missed, refused as doomed at arrival, dropped in the queue)",
                                   ["client", "outcome"], registry=r)
        self.m_goodput = Gauge("petals_chain_goodput_per_second", "Requests that met every deadline they had, per "
                               "second over the last minute", registry=r)
        self.m_spec_passes = Counter("petals_chain_speculative_passes", "Speculative verification passes (one relay "
                                     "step through the chain with the drafts)", registry=r)
        self.m_spec_drafted = Counter("petals_chain_speculative_draft_tokens", "Draft tokens sent for verification",
                                      registry=r)
        self.m_spec_accepted = Counter("petals_chain_speculative_accepted_tokens", "Draft tokens the model kept",
                                       registry=r)
        self.m_relay_steps = Counter("petals_chain_relay_step_passes", "Passes of a step through a whole chain by relay "
                                     "mode (orchestrator: hop by hop through us; push: server to server)", ["mode"],
                                     registry=r)
        self.m_legs = Counter("petals_chain_relay_critical_legs", "Network legs on the critical path of the passes "
                              "(orchestrator: 2 per hop; push: hops + 1)", ["mode"], registry=r)
        self.m_push_mismatches = Counter("petals_chain_push_mismatches", "Pushed steps computed on an input that "
                                         "was not the previous hop's reply (redone by relay)", registry=r)
        self.m_push_rescues = Counter("petals_chain_push_rescues", "Pushes the orchestrator made itself because a "
                                      "hop could not push to the next one (failed, replaced or unreachable)", registry=r)
        self.m_failovers = Counter("petals_chain_failovers", "Jobs moved to another chain after a server failure", registry=r)
        self.m_queue = Gauge("petals_chain_queue_length", "Jobs in the central queue", registry=r)
        # Maxima since start, kept by the dispatch manager: a scrape cannot miss a short peak.
        self.m_queue_max = Gauge("petals_chain_queue_length_max", "Longest central queue since start", registry=r)
        self.m_queue_bound = Gauge("petals_chain_queue_bound", "Central queue bound (--max-queue)", registry=r)
        self.m_queue_refused = Gauge("petals_chain_queue_refused", "Jobs refused since start because the central queue "
                                     "was full (429 queue_full) or could never hold the request (429 "
                                     "exceeds_capacity)", registry=r)
        self.m_requeued = Gauge("petals_chain_requeued_jobs", "Admitted jobs waiting to get a chain again (failover, "
                                "a session's later turn) or for the slot held for them that a re-plan or failover "
                                "took (a later choice of n > 1); outside the bounded queue", registry=r)
        self.m_places_held = Gauge("petals_chain_queue_places_held", "Queue places held for the later jobs of admitted "
                                   "requests (n > 1, several prompts); with the queue, within the bound", registry=r)
        self.m_slots_held = Gauge("petals_chain_queue_slots_held", "Free chain slots held for the later jobs of "
                                  "admitted requests that the queue had no place for", registry=r)
        self.m_chain_max_active = Gauge("petals_chain_chain_max_active", "Most jobs run at once on a current chain "
                                        "since start", ["chain"], registry=r)
        self.m_running = Gauge("petals_chain_running_jobs", "Jobs holding a chain", registry=r)
        self.m_chains = Gauge("petals_chain_chains", "Chains in the current plan", registry=r)
        self.m_capacity = Gauge("petals_chain_capacity", "Sum of chain capacities", registry=r)
        self.m_preemptions = Counter("petals_chain_preemptions", "Jobs that outgrew their reservation on a hop "
                                     "without free pages, or whose first step on a cached prefix a full hop "
                                     "refused: chain given back, resumed later (cached KV reused)",
                                     registry=r)
        self.m_pauses = Counter("petals_chain_flex_pauses", "Jobs paused between two steps so that a job with a deadline "
                                "(--schedule flex) or of higher priority (--schedule db|mlfq) could take their slot, "
                                "resumed later", registry=r)
        self.m_job_tokens = Gauge("petals_chain_expected_job_tokens", "L^: expected KV tokens per job that paged "
                                  "servers' chain capacities count (mean declared length of recent jobs)", registry=r)
        self.m_servers = Gauge("petals_chain_servers", "Known servers by state", ["state"], registry=r)
        self.m_server_cache = Gauge("petals_chain_server_kv_cache_tokens", "KV cache tokens of a server over its "
                                    "hosted blocks, as its record announces them (kind: total | free); server: its peer "
                                    "id, name: its public name (names need not be unique)", ["server", "name", "kind"],
                                    registry=r)
        self.m_server_step = Gauge("petals_chain_server_step_seconds", "A hop's time per decode step, as the relay "
                                   "observes it (EWMA): part compute (the server's own time for its blocks) | "
                                   "network (the rest of the hop's round trip); server: peer id, name: public name",
                                   ["server", "name", "part"], registry=r)
        self.m_ready = Gauge("petals_chain_ready", "1 if some chain covers all blocks", registry=r)
        self.m_epoch = Gauge("petals_chain_assignment_epoch", "Assignment epoch", registry=r)
        self.m_lower = Gauge("petals_chain_predicted_response_lower_seconds", "Thm 3.7 lower bound", registry=r)
        self.m_upper = Gauge("petals_chain_predicted_response_upper_seconds", "Thm 3.7 upper bound", registry=r)
        self.m_arrival = Gauge("petals_chain_arrival_rate", "Arrival rate used by the planner (req/s)", registry=r)
        self.m_replays = Counter("petals_chain_failover_replays", "Failover replays: partial (the failed hop's span "
                                 "on a replacement server) or full (the whole prefix on a new chain)", ["kind"],
                                 registry=r)
        self.m_replay_tokens = Counter("petals_chain_failover_replayed_tokens", "Token positions re-fed by failover "
                                       "replays", ["kind"], registry=r)
        self.m_replay_token_blocks = Counter("petals_chain_failover_replayed_token_blocks", "Tokens x blocks "
                                             "recomputed by failover replays", ["kind"], registry=r)
        self.m_replay_bytes = Gauge("petals_chain_replay_cache_bytes", "Hop inputs kept for failover replays "
                                    "(all jobs of every model the process serves: one cache)", registry=r)
        self.m_replay_budget = Gauge("petals_chain_replay_cache_budget_bytes", "Budget of the hop inputs kept "
                                     "(--replay-cache-mb)", registry=r)
        self.m_replay_evictions = Gauge("petals_chain_replay_cache_evictions", "Jobs whose hop inputs were dropped "
                                        "to stay within the budget, since start", registry=r)
        self.m_head_batch = Histogram("petals_chain_lm_head_batch_rows", "Rows per batched LM-head call",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.m_endpoints = Counter("petals_chain_endpoint_requests", "API requests by endpoint (the route: "
                                   "/v1/embeddings, /tokenize, /api/v1/sessions/{session_id}/generate, ...; other: "
                                   "a path no route serves) and how they ended (outcomes as petals_chain_api_requests)",
                                   ["endpoint", "outcome"], registry=r)
        self._client_usage()

    def _client_usage(self) -> None:
        """Per-client (API key name) counters: labels are bounded by the configured keys plus ``anonymous``."""
        r = self.registry
        self.m_client_requests = Counter("petals_chain_client_requests", "Jobs by client (API key name) and outcome, "
                                         "as petals_chain_requests: one per completion and per session turn",
                                         ["client", "outcome"], registry=r)
        self.m_client_tokens = Counter("petals_chain_client_tokens", "Prompt + generated tokens by client (API key "
                                       "name)", ["client"], registry=r)
        # client -> (time, tokens) of the last minute, the tokens of each second of the monotonic clock together
        self._window: dict[str, deque[tuple[float, int]]] = {}
        self._totals: dict[str, dict[str, int]] = {}
        # requests, not jobs (issue 18): one per API request whatever its n and prompts, one per session turn
        self.m_api_requests = Counter("petals_chain_api_requests", "API requests by client (API key name) and how "
                                      "they ended, one per request whatever its n or number of prompts, and one per "
                                      "session turn: completed | failed (503, an error ended it) | refused (429: "
                                      "the dispatcher's queue full, more than the swarm holds, a doomed deadline; an "
                                      "admission limit) | dropped (its deadline passed while it waited for a chain) | "
                                      "cancelled (its client went away) | invalid (refused for the request itself: "
                                      "4xx other than 429). Requests without a valid API key (401) are in "
                                      "petals_chain_rejected_requests alone (no client to count them for)",
                                      ["client", "outcome"], registry=r)
        self._request_totals: dict[str, dict[str, int]] = {}
        # request key (what its parts share: the admission's RequestPlaces) -> its parts; gone with the request
        self._requests: weakref.WeakKeyDictionary[object, _RequestParts] = weakref.WeakKeyDictionary()

    def forget_client(self, client: str) -> None:
        """Drop everything counted for ``client`` (its name left the key file and its last request ended): its job
        and request totals, its last minute of tokens and its series of the per-client metrics. The totals over
        every client (``petals_chain_requests``, ``/api/v1/swarm``) keep what it did. ``anonymous`` is never
        forgotten (the client of every request when no keys are configured)."""
        if client == ANONYMOUS:
            return
        self._totals.pop(client, None)
        self._request_totals.pop(client, None)
        self._window.pop(client, None)
        remove_client_series(self.m_client_requests, client, JOB_OUTCOMES)
        remove_client_series(self.m_client_tokens, client)
        remove_client_series(self.m_api_requests, client, REQUEST_OUTCOMES)
        remove_client_series(self.m_deadlines, client, DEADLINE_OUTCOMES)

    def _charge(self, client: str, tokens: int, outcome: str) -> None:
        self.m_client_requests.labels(client, outcome).inc()
        self.m_client_tokens.labels(client).inc(tokens)
        totals = self._totals.setdefault(client, {**dict.fromkeys(JOB_OUTCOMES, 0), "tokens": 0})
        totals[outcome] += 1
        totals["tokens"] += tokens
        if tokens:
            w = self._window.setdefault(client, deque())
            now = time.monotonic()
            if w and math.floor(w[-1][0]) == math.floor(now):
                # one entry per second (at most 61 whatever the rate), timed by its latest tokens: they leave the
                # minute up to a second late, never early (the per-minute limit never counts less)
                w[-1] = (now, w[-1][1] + tokens)
            else:
                w.append((now, tokens))
            self._trim(w)  # here too: read only with a per-minute limit or a state request, it grew per request

    @staticmethod
    def _trim(w: deque) -> None:
        cutoff = time.monotonic() - 60.0
        while w and w[0][0] < cutoff:
            w.popleft()

    def tokens_last_minute(self, client: str) -> int:
        """Prompt + generated tokens ``client`` used in the last 60 s (what ``tokens_per_minute`` limits)."""
        w = self._window.get(client)
        if not w:
            return 0
        self._trim(w)
        return sum(n for _, n in w)

    def usage_window(self, client: str) -> list[tuple[float, int]]:
        """``(monotonic time, tokens)`` of ``client``'s usage in the last 60 s, oldest first."""
        w = self._window.get(client)
        if not w:
            return []
        self._trim(w)
        return list(w)

    def client_totals(self, client: str) -> dict:
        """``client``'s jobs by outcome and tokens, and its requests by outcome (``request_outcomes``)."""
        return {**self._totals.get(client, {**dict.fromkeys(JOB_OUTCOMES, 0), "tokens": 0}),
                "request_outcomes": self.request_totals(client)}

    def request_totals(self, client: str) -> dict[str, int]:
        """``client``'s ended API requests by outcome (:data:`REQUEST_OUTCOMES`)."""
        return dict(self._request_totals.get(client, dict.fromkeys(REQUEST_OUTCOMES, 0)))

    def end_request(self, outcome: str, client: str | None = None) -> None:
        """One API request (or session turn) of ``client`` (None: the current request's) ended with ``outcome``."""
        if outcome not in REQUEST_OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}")
        client = CLIENT.get() if client is None else client
        trace = REQUEST.get()
        if trace is not None:  # the API counts a request nothing counted when it ends (api.py): not this one
            trace.counted = True
        self.m_api_requests.labels(client, outcome).inc()
        totals = self._request_totals.setdefault(client, dict.fromkeys(REQUEST_OUTCOMES, 0))
        totals[outcome] += 1

    def begin_request_part(self, key: object) -> None:
        """A part of the request ``key`` began (one prompt's choices: ``generate_n``). The parts of a request of
        several prompts all begin before any of them can end (the API starts them together; each begins before its
        first await), so the request ends once, when its last part ends (:meth:`end_request_part`)."""
        parts = self._requests.get(key)
        if parts is None:
            parts = self._requests[key] = _RequestParts()
        parts.parts += 1

    def end_request_part(self, key: object, error: BaseException | None) -> None:
        """A part of the request ``key`` ended (``error``: what ended it; None: it completed); at its last part the
        request is counted: the first failure's outcome (a refused prompt, not the others it cancelled), else
        ``cancelled`` if a part's client went away, else ``completed``."""
        parts = self._requests.get(key)
        if parts is None or parts.counted:  # a part begun after the request was counted (none computes): the same one
            return
        parts.ended += 1
        outcome = request_outcome(error)
        if outcome not in ("completed", "cancelled") and parts.outcome in ("completed", "cancelled"):
            parts.outcome = outcome
        elif outcome == "cancelled" and parts.outcome == "completed":
            parts.outcome = outcome
        if parts.ended >= parts.parts:
            parts.counted = True
            self.end_request(parts.outcome)

    def add_prefix_hit(self, tokens: int) -> None:
        """A chain opened holding ``tokens`` of the job's prompt in its servers' prefix caches."""
        self.prefix_hits += 1
        self.prefix_cached_tokens += tokens
        self.m_prompt_cached.inc(tokens)

    def add_chain_open(self, tokens: int, cached: int = 0) -> None:
        """A chain opened (not forked from a sibling's KV) for a sequence of ``tokens`` positions, ``cached`` of them
        held in its servers' prefix caches. The hit rate counts both per open: against the prompt tokens counted once
        per request, the hits of every open (each choice of ``n`` on its own chain, a failover's or a session turn's
        reopen on the whole history) took it past 1."""
        tokens = max(0, int(tokens))
        self.prefix_lookup_tokens += tokens
        self.m_prefix_lookup.inc(tokens)
        if cached > 0:
            self.add_prefix_hit(min(int(cached), tokens))

    def prefix_json(self) -> dict:
        if self.prefix_lookup_tokens:
            rate = self.prefix_cached_tokens / self.prefix_lookup_tokens
        else:  # hits reported without their opens (add_prefix_hit alone): against the prompt tokens
            rate = self.prefix_cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        return {"prompt_tokens": self.prompt_tokens, "prefix_hits": self.prefix_hits,
                "prompt_cached_tokens": self.prefix_cached_tokens, "prefix_lookup_tokens": self.prefix_lookup_tokens,
                "prompt_cache_hit_rate": rate}

    def watch_drafter(self, drafter: Any) -> None:
        """Export ``drafter``'s :attr:`~petals_chain.orchestrator.drafting.DraftModel.failures` (read at each scrape)
        as ``petals_chain_speculative_draft_failures``; None: 0."""
        if drafter is None:
            self.m_draft_failures.set(0)
        else:
            self.m_draft_failures.set_function(lambda: float(getattr(drafter, "failures", 0)))

    def add_speculation(self, drafted: int, accepted: int) -> None:
        """One verification pass sent ``drafted`` draft tokens through the chain; ``accepted`` were kept."""
        self.spec_passes += 1
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        self.m_spec_drafted.inc(drafted)
        self.m_spec_accepted.inc(accepted)
        self.m_spec_passes.inc()

    def speculation_json(self) -> dict:
        return {"passes": self.spec_passes, "drafted_tokens": self.spec_drafted,
                "accepted_tokens": self.spec_accepted,
                "acceptance_rate": self.spec_accepted / self.spec_drafted if self.spec_drafted else None,
                "accepted_per_pass": self.spec_accepted / self.spec_passes if self.spec_passes else None,
                "tokens_per_relay_step": self.tokens / self.relay_steps if self.relay_steps else None}

    def add_relay_step(self, hops: int) -> None:
        """One pass through a chain of ``hops`` hops, relayed by us."""
        self._add_pass("orchestrator", 2 * hops)

    def add_push_step(self, hops: int, rescues: int, mismatches: int = 0) -> None:
        """One pass through a chain of ``hops`` hops with pushes; we pushed ``rescues`` times ourselves;
        ``mismatches``: a hop computed on a push that was not the previous hop's reply (the rest was relayed)."""
        self._add_pass("push", hops + 1)
        self.push_rescues += rescues
        self.m_push_rescues.inc(rescues)
        self.push_mismatches += mismatches
        self.m_push_mismatches.inc(mismatches)

    def _add_pass(self, mode: str, legs: int) -> None:
        self.passes[mode] += 1
        self.legs[mode] += legs
        self.m_relay_steps.labels(mode).inc()
        self.m_legs.labels(mode).inc(legs)

    def legs_json(self) -> dict:
        legs = sum(self.legs.values())
        return {"passes": dict(self.passes), "critical_legs": dict(self.legs), "push_rescues": self.push_rescues,
                "push_mismatches": self.push_mismatches,
                "legs_per_token": legs / self.tokens if self.tokens else None}

    def add_failover(self) -> None:
        self.failovers += 1
        self.m_failovers.inc()

    def add_preemption(self) -> None:
        self.preemptions += 1
        self.m_preemptions.inc()

    def add_pause(self) -> None:
        self.pauses += 1
        self.m_pauses.inc()

    def add_replay(self, kind: str, *, tokens: int, token_blocks: int) -> None:
        """A failover (``kind``: partial|full) re-fed ``tokens`` positions, ``token_blocks`` tokens x blocks."""
        self.replays[kind] += 1
        self.replay_tokens[kind] += tokens
        self.replay_token_blocks[kind] += token_blocks
        self.recent_replays.append({"t": time.time(), "kind": kind, "tokens": tokens, "token_blocks": token_blocks})
        self.m_replays.labels(kind).inc()
        self.m_replay_tokens.labels(kind).inc(tokens)
        self.m_replay_token_blocks.labels(kind).inc(token_blocks)

    def replay_json(self) -> dict:
        return {"replays_partial": self.replays["partial"], "replays_full": self.replays["full"],
                "replayed_tokens_partial": self.replay_tokens["partial"],
                "replayed_tokens_full": self.replay_tokens["full"],
                "replayed_token_blocks_partial": self.replay_token_blocks["partial"],
                "replayed_token_blocks_full": self.replay_token_blocks["full"],
                "recent_replays": list(self.recent_replays)[-20:]}

    def record(self, *, wait_s: float, service_s: float, tokens: int, prompt_tokens: int, ok: bool,
               batch: float | None = None, served: bool = True, whole_request: bool = True) -> None:
        """One finished job: ``tokens`` generated after ``prompt_tokens``, ``batch`` jobs on its chain per step on
        average (the history the model placer replays, ``--placement-index simulated``). ``served`` False: it
        ended before it held a chain (refused, dropped while queued, its client gone): counted ``unserved``, and
        its prompt neither counted nor charged to its client's tokens per minute (nothing was computed).
        ``whole_request``: the job is a whole request (a session turn), also counted as one ended request, by the
        exception being handled when a failed job is recorded (what ended it); False: one job of a request that its
        caller counts once (:meth:`end_request_part`). A job that held a chain and was ended by a cancellation (the
        exception being handled: its client left, another choice of its request failed) is ``cancelled``, not
        ``failed``: no error of the swarm's (a request whose client left is ``cancelled`` in both counters)."""
        # recorded while what ended the job is handled (sessions.py's except clause, generation.py's finally)
        error = None if ok else sys.exc_info()[1]
        cancelled = isinstance(error, asyncio.CancelledError)
        if whole_request:
            self.end_request("failed" if not ok and error is None else request_outcome(error))
        if not ok and not served:
            self.unserved += 1
            self.m_requests.labels("unserved").inc()
            self._charge(CLIENT.get(), 0, "unserved")
            return
        if ok:
            self.completed += 1
            self.m_requests.labels("completed").inc()
            self.history.append({"t": time.time(), "response_s": wait_s + service_s, "wait_s": wait_s,
                                 "service_s": service_s, "prompt_tokens": prompt_tokens, "tokens": tokens,
                                 "batch": batch})
            self.m_response.observe(wait_s + service_s)
            self.m_wait.observe(wait_s)
            self.m_service.observe(service_s)
            self.service_s += service_s
        elif cancelled:
            self.cancelled += 1
            self.m_requests.labels("cancelled").inc()
        else:
            self.failed += 1
            self.m_requests.labels("failed").inc()
        self.tokens += tokens
        self.m_tokens.inc(tokens)
        self.m_prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens += prompt_tokens
        self._charge(CLIENT.get(), tokens + prompt_tokens,
                     "completed" if ok else "cancelled" if cancelled else "failed")

    def measured(self) -> dict:
        h = list(self.history)

        def mean(key):
            return sum(x[key] for x in h) / len(h) if h else None

        return {"mean_response_s": mean("response_s"), "mean_wait_s": mean("wait_s"),
                "mean_service_s": mean("service_s"), "completed": self.completed, "failed": self.failed,
                "unserved": self.unserved, "cancelled": self.cancelled}
