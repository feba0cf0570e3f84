"""A job's hold on a chain: acquisition through dispatch, feeding tokens, forks, and failover.

When a hop fails, the job keeps its chain lease and its other hops: the failed hop's span moves to another
server that holds it (a hop whose server only lost the session, e.g. to its idle timeout, is re-opened on the
same server), which replays just that hop's inputs (:mod:`~petals_chain.orchestrator.replay`). Only when no
server can take the span over, or the inputs were evicted, does the job drop its chain and replay its whole
prefix on a chain the dispatcher gives it. Greedy output is the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import torch

from petals_chain.model import Chain
from petals_chain.orchestrator.adapters import ADAPTER
from petals_chain.orchestrator.auth import CLIENT
from petals_chain.orchestrator.deadlines import DEADLINE
from petals_chain.orchestrator.dispatch import DeadlineUnreachable, DispatchJob, Lease, QueueFull, chain_key, note_admission
from petals_chain.orchestrator.dispatch import NoAdapterChain
from petals_chain.orchestrator.errors import RequestError, Unavailable
from petals_chain.orchestrator.relay import SESSION_NUMBERS, ChainSession, HopFailure
from petals_chain.swarm.prefix import prefix_hashes
from petals_chain.swarm.rpc import NoCapacityError, RemoteError

logger = logging.getLogger(__name__)

MAX_REPLACEMENT_TRIES = 3  # servers tried for one failed hop before the whole chain is given up


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def is_refusal(e: HopFailure) -> bool:
    """The server answered with an error (it lives), as opposed to a dead, silent or garbage-answering server."""
    return isinstance(e.cause, RemoteError) and not isinstance(e.cause, ConnectionError)


def step_refused_full(e: HopFailure) -> bool:
    """A hop's server refused a step ``no_capacity``. An honest server does so only for a session opened *lean* on
    its cached prefix (own pages only after the match, the pool being full) whose first step starts before that
    match (another hop matched less): it needs pages the server has not got now, and they free up as other jobs
    end. Any other step it refuses so (:meth:`ChainHolder._waits_for_pages`) is a failed step."""
    return isinstance(e.cause, NoCapacityError)


class ChainHolder:
    """A job's chain and server sessions; feeds tokens, fails over hop by hop, or replays on another chain."""

    _counter = SESSION_NUMBERS  # one sequence with the hops' server sessions (and the audits', audit.py)
    adapter = ""  # the LoRA adapter's fingerprint (set per job in __init__; a holder built without it: the base)

    def __init__(self, orch: Any, job_id: str, max_length: int, relay: str | None = None,
                 shape: tuple[int, int] | None = None):
        self.orch = orch
        self.job_id = job_id
        self.max_length = max_length  # the job's length limit (prompt + max_tokens, or a session's max_length)
        # What a chain is opened for: the tokens to feed plus this many (0: the whole max_length); a job that
        # outgrows it extends its sessions, doubling the reserve, or is preempted (see feed)
        self.output_reserve = int(getattr(orch.cfg, "output_reserve_tokens", 0) or 0)
        self.kv_ids: list[int] = []  # tokens whose KV the current chain holds
        self.lease: Lease | None = None
        self.cs: ChainSession | None = None
        self.kv_valid = 0
        self.wait_s = 0.0
        self.steps = 0
        self.batch_steps = 0  # jobs on the chain summed over this job's steps (its mean batch, for StepCost.fit)
        self.failovers = 0
        self.preemptions = 0  # times the job gave its chain back because a hop had no pages to grow it
        # a hop refused the first step of the last chain for want of pages (step_refused_full): the next open
        # names no cached prefix, so that every server reserves the whole length at open (or queues the open)
        self.open_full = False
        # the current chain was opened naming a cached prefix (not forked, not open_full) and has not stepped yet:
        # only its first step may be refused for want of pages by a server that works as it should
        self.lean_first = False
        # (prompt tokens, cached tokens) of the current chain's open, counted as a prefix lookup once its first step
        # is served (:meth:`_count_lookup`): a chain given up before that served no hit and is no lookup of its own
        self._lookup: tuple[int, int] | None = None
        self.yields = False  # its next acquire queues after the deadline jobs (it was paused for one)
        # --schedule db|mlfq: level, budget and priority of the job (kept across pauses and failovers); ``shape``
        # (prompt tokens, max_tokens) puts a one-shot job in its length class
        self.priority = orch.dispatch.new_priority_job(job_id, str(getattr(orch, "model_id", "")), shape) \
            if hasattr(orch.dispatch, "new_priority_job") else None
        self.closed = False
        # held a chain once: later acquires re-queue with priority, never refused (dropped at the deadline as any)
        self.admitted = False
        # opened a chain once (ran): its deadline passing while it waits for another is a miss, not a drop
        self.ran = False
        # n > 1 (generation.py): the first choice's job counts the others in its deadline prediction; the others
        # are admitted with it (``checked``: never refused or dropped for the request's deadline)
        self.siblings = 0
        self.checked = False
        self.completed = False  # a request (a session: a turn) ran to its end: its time is an execution time
        # (sibling, tokens): a sibling whose first `tokens` KV this job may copy if it lands on the same chain
        self.fork_source: tuple["ChainHolder", int] | None = None
        self.forked = False
        self.inputs = orch.replay_cache.new()  # what each hop received: replay one hop, not the chain
        self.relay = relay  # "orchestrator" | "push" for the chains this job opens; None: --relay
        self.cached_tokens = 0  # tokens the last chain opened held in its servers' prefix caches (not computed)
        self.reused_tokens = 0  # leading tokens of the last feed's sequence whose KV was not computed by it
        # Provenance of KV the current chain holds but did not compute (a prefix-cache hit, a fork): a cached page
        # is named by its tokens and the salt only, not by the servers upstream of it, so it may come from a job
        # through a server banned since. kv_epoch: the auditor's epoch when the reused pages were named (None:
        # nothing reused); kv_peers: the servers a forked sibling's KV came from, beyond this chain's own.
        self.kv_epoch: int | None = None
        self.kv_peers: frozenset[str] = frozenset()
        # Fair sharing (fairness.py): the API key name of the request that made this job, the leading tokens of its
        # sequence its client was charged for, and the chain charged last (its admission's: refunds and the
        # prompt's correction go there) with the lease it came with (work done is charged where that is counted now)
        self.client = CLIENT.get()
        self.adapter = ADAPTER.get()  # the LoRA adapter's fingerprint its request named ("": the base model)
        self.paid = 0
        self.drafted = 0  # the feed under way ends with this many speculative drafts (not the client's input)
        self._worker: tuple | None = None
        self._worker_lease: tuple[Lease, tuple] | None = None

    @property
    def chain_names(self) -> list[str]:
        """Peer ids of the hops serving the job now (a replaced hop included)."""
        if self.cs is not None:
            return [h[0] for h in self.cs.hops]
        return [h[0] for h in self.lease.hops] if self.lease is not None else []

    def declared_length(self, need: int) -> int:
        """Tokens a chain opened now is asked to hold for this job: ``need`` (what the next feed leaves in the KV)
        plus the output reserve, within the job's ``max_length``."""
        if self.output_reserve <= 0:
            return self.max_length
        return min(self.max_length, int(need) + self.output_reserve)

    async def _ensure_chain(self, prompt: list[int] | None = None, need: int = 0) -> None:
        """Hold a chain with open sessions. ``prompt``: the whole sequence the next feed computes; a chain whose
        servers hold a prefix of it in their prefix caches is preferred, and the feed starts after that prefix.
        ``need``: tokens the chain must hold after that feed (see :meth:`declared_length`)."""
        orch = self.orch
        began = time.monotonic()
        deadline = began + orch.cfg.queue_timeout_s
        shares = getattr(orch, "shares", None)
        failed_opens = 0
        if not self.admitted:  # a new request (a session's turn after one that lost its chain): it has not run yet
            self.ran = False
        # the last token is always computed (its output is what the job samples from): named once, for dispatch and
        # for every open
        auditor = getattr(orch, "auditor", None)
        if self.cs is not None:
            note_admission(True)  # holds its chain (a session's later turn): admitted without the queue
            job = self.lease.job if self.lease is not None else None
            if job is not None and job.idle:  # a held session's next turn: its own deadline and length, stepping
                self._as_this_request(job, need)
                job.idle = False
                self.lease.started = time.monotonic()
        while self.cs is None:
            if time.monotonic() > deadline:
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s")
            # named per attempt: a ban while the job waited changes the salt (no prefix cached before it matches)
            named = prefix_hashes(prompt[:-1], self._prefix_salt(auditor)) if prompt else b""
            named_epoch = auditor.epoch if auditor is not None else 0
            paid = self.paid
            job = DispatchJob(job_id=self.job_id, requeue=self.admitted,
                              prefer=orch.prefix_directory.preferred(named) if named else (), client=self.client,
                              input_tokens=max(0, need - self.drafted - paid),
                              matched=orch.prefix_directory.live_match(named, paid) if named else {},
                              yields=self.yields, sched=self.priority, siblings=self.siblings,
                              checked=self.checked, adapter=self.adapter)
            # A job back after a failover, a preemption or a pause keeps its deadline (its order in the queue, and
            # flex never pauses it for another), and is dropped as a new job is when it passes while the job waits
            # (it waited --queue-timeout-s and ended 503 though its deadline had passed long before). A later choice
            # of n admitted with the first is not, until it has held a chain (admitted with it: never refused nor
            # dropped before it starts).
            self._as_this_request(job, need)
            dl = DEADLINE.get()
            t0 = time.monotonic()
            droppable = dl is not None and dl.active and (self.admitted or not self.checked)

            def dropped_at() -> float:
                # read again when the wait ends: once another prompt's job of the request gave its first token, only
                # deadline_ms is left to miss (RequestDeadline.drop_at)
                return dl.drop_at if droppable else float("inf")

            drop_at = dropped_at()
            wait_s = max(0.1, deadline - time.monotonic())
            if drop_at < deadline:
                wait_s = max(0.001, drop_at - time.monotonic())
            chainless = not self.admitted and not getattr(orch.dispatch, "chains", True)
            if chainless:  # nothing serves the model now: a new request learns it soon, not after the queue time
                wait_s = min(wait_s, max(0.001, float(getattr(orch.cfg, "no_chain_wait_s", wait_s))))
            def keep_waiting() -> float:
                # chains came while a new request waited for the first: it waits on in its place (queued again it
                # went to the back, and its request's held places could be taken meanwhile)
                if chainless and getattr(orch.dispatch, "chains", None):
                    return min(deadline, dropped_at()) - time.monotonic()
                if dropped_at() > drop_at:  # the request's first token came meanwhile
                    return min(deadline, dropped_at()) - time.monotonic()
                return 0.0

            try:
                lease = await self._acquire(job, wait_s, keep_waiting)
            except asyncio.CancelledError:
                self._gave_up(job, began)  # its client went away while it waited
                raise
            except Unavailable:  # refused before or while it waited: the orchestrator stops (dispatch.refuse_waiting)
                self._gave_up(job, began)
                if dl is not None and dl.active and not self.admitted:
                    orch.deadlines.settle(dl, "refused")  # it never ran: not a miss of the model's chains
                raise
            except asyncio.TimeoutError:
                if time.monotonic() >= dropped_at():  # still waiting for a chain when its deadline passed: dropped
                    self._gave_up(job, began)
                    # it ran, and lost its chain (or was paused): a miss, not a drop unserved. One whose every open
                    # failed never started: dropped (deadlines.py)
                    if self.ran:
                        orch.deadlines.settle(dl, "missed")
                        raise RequestError("the deadline passed while the request waited for another chain to go "
                                           "on (its chain was lost or given back)", status=504,
                                           code="deadline_exceeded") from None
                    orch.deadlines.settle(dl, "dropped")
                    raise RequestError("the deadline passed while the request waited for a chain", status=504,
                                       code="deadline_exceeded") from None
                self._gave_up(job, began)
                if dl is not None and dl.active and not self.admitted:
                    orch.deadlines.settle(dl, "refused")  # it never ran: not a miss of the model's chains
                if chainless and not getattr(orch.dispatch, "chains", True):
                    raise Unavailable(f"no server serves the model {orch.model_id!r} now (no chain for {wait_s:.0f} s);"
                                      f" try again later") from None
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s") from None
            except QueueFull as e:  # only a job that never held a chain is refused
                if dl is not None and dl.active:
                    orch.deadlines.settle(dl, "refused")  # refused, not missed: it never ran
                raise RequestError(str(e), status=429, code=e.code) from None
            except DeadlineUnreachable as e:
                orch.deadlines.settle(dl, "refused")
                raise RequestError(str(e), status=429, code=e.code) from None
            except NoAdapterChain as e:  # nothing serves the request's adapter now: as no chain for a model, a 503
                if dl is not None and dl.active:
                    orch.deadlines.settle(dl, "refused")
                raise Unavailable(str(e), code=e.code) from None  # no_adapter_chain, as documented
            self.admitted, self.yields = True, False
            if auditor is not None and auditor.tainted(lease.hops):  # a plan from before a ban: wait for the next
                if shares is not None:
                    shares.refund(job, chain_key(lease.chain))  # not served: the admission is undone
                orch.dispatch.release(lease)
                await asyncio.sleep(0.2)
                continue
            self._worker = chain_key(lease.chain)
            self._worker_lease = (lease, self._worker)
            # no prefix named to a chain with a hop that has no prefix cache: it starts at 0 whatever the others hold
            named_here = self._named_for(lease, named)
            declared = self.declared_length(need)
            cs = ChainSession(orch.client, lease.hops, f"{self.job_id}.{next(self._counter)}", declared,
                              observe=orch.observe_hop, wait_s=getattr(lease, "wait_s", 0.0),
                              push=(self.relay or orch.cfg.relay) == "push")
            cs.adapter = self.adapter  # every hop's session (forks and replacements too) runs with it
            orch.chain_sessions.add(cs)  # from its open on: a server declared failed aborts a long open too
            opened = False
            fork = self._fork_candidate(lease)
            # read before the open's awaits: the sibling may drop its chain (and forget its provenance) meanwhile
            source = self.fork_source[0] if fork is not None else None
            fork_trust = (source.kv_peers | fork[0].peers_used, source.kv_epoch) if source is not None else None
            retry_s = 0.0
            for attempt in range(60):
                try:
                    if retry_s:  # in the try: a cancellation while the job waits to retry gives the lease back
                        await asyncio.sleep(retry_s)
                        retry_s = 0.0
                    if fork is not None:
                        try:
                            await cs.open(fork_from=fork[0], fork_length=fork[1])
                        except HopFailure as e:
                            if not (e.no_capacity or is_refusal(e)):
                                raise
                            fork = None  # the sibling's session moved or a server is full: open plainly
                            continue
                        self.kv_valid = fork[1]
                        self.forked = True
                        self.orch.stats.forks += 1
                    else:
                        await cs.open(named=b"" if self.open_full else named_here)
                    opened = True
                    self.lean_first = fork is None and bool(named_here) and not self.open_full
                    self.open_full = False
                    break
                except HopFailure as e:
                    if e.no_capacity and time.monotonic() < deadline:
                        # A paged chain's capacity counts jobs of the expected length (token_budget.py), and slots
                        # may still be held by jobs of a previous plan: the servers queue the opens (FIFO, in
                        # route order) until pages free up, instead of refusing. A server that heartbeats keeps the
                        # open for the job's queue time; one that does not, at most open_wait_max_s a time, then the
                        # open is sent again (its silence may be a lost reply).
                        first = cs.wait_s <= 0
                        cs.wait_s = max(0.1, deadline - time.monotonic())
                        cs.silent_wait_max_s = float(orch.cfg.open_wait_max_s)
                        if first:
                            self.orch.stats.open_waits += 1
                            continue
                        self.orch.stats.open_rewaits += 1
                    elif e.no_capacity:
                        break  # its queue time is up: refused below
                    if e.no_capacity and attempt < 59:
                        retry_s = min(0.5, 0.02 * (attempt + 1))
                        continue
                    self.failovers += 1
                    orch.stats.add_failover()
                    orch.server_failed(e)
                    break
                except BaseException:
                    orch.chain_sessions.discard(cs)
                    if shares is not None:  # the open never finished (its client went away): nothing was served
                        shares.refund(job, self._worker, gone=True)
                    orch.dispatch.release(lease)
                    raise
            if opened:
                self.ran = True
                self.wait_s += time.monotonic() - t0
                self.lease, self.cs = lease, cs
                lease.keeps_kv = cs.prefix_cache
                planner = getattr(orch, "planner", None)
                if planner is not None:
                    planner.observe_job_tokens(declared)  # L^ of paged chain capacities (token_budget.py)
                if shares is not None:  # what the chain computes, now that its cached prefix is known
                    shares.prompt(job, self._worker, need - self.drafted -
                                  max(cs.cached_tokens if fork is None else fork[1], paid))
                # charged at admission: a failover's replay of these tokens is not charged again
                self.paid = max(self.paid, need - self.drafted)
                if fork is None:
                    self.kv_valid = self.cached_tokens = cs.cached_tokens
                    self.kv_epoch, self.kv_peers = (named_epoch if cs.cached_tokens else None), frozenset()
                    self.inputs.clear()
                    # every open's lookup, not only its hits: the hit rate stays within 1 (each choice of n, a
                    # failover's reopen and a session turn look the prompt up again); counted at the first step
                    self._lookup = (len(prompt) if prompt else 0, cs.cached_tokens)
                else:
                    self.inputs.copy_prefix(self.fork_source[0].inputs, fork[1])
                    # the sibling's KV: whoever computed it (a hop it replaced during our open too), and its reuse
                    self.kv_peers = frozenset(fork_trust[0] | fork[0].peers_used)
                    self.kv_epoch = fork_trust[1]
            else:
                orch.chain_sessions.discard(cs)
                if shares is not None:
                    shares.refund(job, self._worker)  # not served: the admission is undone
                orch.dispatch.release(lease)
                # A refusal (or a failure the planner has not acted on yet) must not become a busy loop.
                failed_opens += 1
                await asyncio.sleep(min(2.0, 0.1 * failed_opens))
                self.wait_s += time.monotonic() - t0

    async def _acquire(self, job: DispatchJob, wait_s: float, keep_waiting: Callable[[], float]) -> Lease:
        """``dispatch.acquire(job)`` within ``wait_s`` (``asyncio.TimeoutError`` after it); at that time it waits
        ``keep_waiting()`` seconds more if that is > 0, in its place. A lease given as it stops waiting is used, or
        given back if its request was cancelled."""
        orch = self.orch
        acq = asyncio.ensure_future(orch.dispatch.acquire(job))
        try:
            timeout, extended = wait_s, False
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(acq), timeout=timeout)
                except asyncio.TimeoutError:
                    if acq.done():
                        return acq.result()
                    if extended or (timeout := keep_waiting()) <= 0:
                        raise
                    extended = True
        except BaseException:
            if not acq.done():
                acq.cancel()  # its own handler takes the job out of the queue
                await asyncio.gather(acq, return_exceptions=True)
            elif not acq.cancelled() and acq.exception() is None:  # its chain came as the request went away
                lease = acq.result()
                shares = getattr(orch, "shares", None)
                if shares is not None:
                    shares.refund(job, chain_key(lease.chain), gone=True)
                orch.dispatch.release(lease)
            raise

    def _gave_up(self, job: DispatchJob, began: float) -> None:
        """The request stops waiting for a chain unstarted (a timeout, a dropped deadline, its client gone): its
        client's wait counts (fair sharing's figures; a starved client showed no wait at all). A job re-queued after
        it started (its chain failed or was given back) was counted as started: it is not one more that gave up, but
        its wait since it was re-queued counts (left out, ``petals_chain_client_wait_seconds`` lost it)."""
        shares = getattr(self.orch, "shares", None)
        if shares is not None:
            since = job.arrival if job.requeue else began
            shares.abandoned(job, max(0.0, time.monotonic() - since), gave_up=not job.requeue)

    def _fork_candidate(self, lease: Lease) -> tuple[ChainSession, int] | None:
        """The sibling's session to copy the prefix KV from, if it runs on exactly the hops of ``lease`` and its KV
        is trusted (a sibling that has not yet stepped since a ban still holds KV it is about to replay)."""
        if self.fork_source is None or self.kv_valid:
            return None
        sibling, n = self.fork_source
        cs = sibling.cs
        if cs is None or sibling.kv_valid < n or cs.hops != lease.hops or self.kv_ids[:n] != sibling.kv_ids[:n]:
            return None
        if sibling._untrusted():
            return None
        return cs, n

    def sync(self, target: list[int]) -> list[int]:
        """Make ``target`` the sequence this job continues: keep the longest common prefix of the tokens fed so
        far (rolling the chain's KV back past it) and return the tokens of ``target`` still to feed.

        A turn that failed or was aborted fed tokens nobody kept; a re-templated chat history may tokenize the
        last answer differently: either way the next feed starts where the two sequences agree."""
        keep = common_prefix(self.kv_ids, target)
        del self.kv_ids[keep:]
        self.paid = min(self.paid, keep)  # tokens fed again are computed again
        self.kv_valid = min(self.kv_valid, keep)
        return list(target[keep:])

    def _prefix_salt(self, auditor: Any) -> bytes:
        """What the prefix hashes of this job's tokens start from: the auditor's salt, and its adapter (an adapter's
        K/V are not the base model's: its prefixes are named, and preferred, apart)."""
        return (auditor.salt if auditor is not None else b"") + self.adapter.encode()

    def _untrusted(self) -> bool:
        """Whether the current chain's KV may come from a banned server's replies: one of the servers that fed it
        (its hops, replaced ones, a forked sibling's) is banned, or it reused KV named before a ban (cached pages
        carry no record of the servers upstream of them: a later hop's pages made behind a liar match a job whose
        earlier hop is honest)."""
        auditor = getattr(self.orch, "auditor", None)
        if auditor is None or self.cs is None:
            return False
        if auditor.tainted(self.cs.peers_used) or auditor.tainted(self.kv_peers):
            return True
        return self.kv_epoch is not None and self.kv_epoch != auditor.epoch

    async def _drop(self) -> None:
        cs, lease = self.cs, self.lease
        held = self.kv_ids[:self.kv_valid]  # every hop holds their KV: servers may keep it as cached prefixes
        auditor = getattr(self.orch, "auditor", None)
        if self._untrusted():
            held = []  # maybe computed from a banned server's replies: never offered to a later job
        self.cs, self.lease, self.kv_valid, self.lean_first, self._lookup = None, None, 0, False, None
        self.kv_epoch, self.kv_peers = None, frozenset()
        self.inputs.clear()
        named = prefix_hashes(held, self._prefix_salt(auditor)) if held else b""
        # the directory names chains a later job with this prompt starts on to reuse it: not one with a hop that
        # keeps no prefix (that job computed everything there, and passed over the chain the dispatcher would pick)
        holder = self._holding_chain(cs, lease) if named and cs is not None and cs.prefix_cache else None
        if holder is not None:
            self.orch.prefix_directory.add(holder, named)
        if cs is None:
            if lease is not None:
                self.orch.dispatch.release(lease)
            return
        self.orch.chain_sessions.discard(cs)
        # The close (a round trip per hop, up to its timeout on a silent server) runs to its end even if our caller
        # is cancelled meanwhile (a client gone, a sibling choice failed), and the slot goes back after it: the
        # chain's free slots then match its servers' (released before, a new job's open could find them full;
        # released after an await that a cancellation skips, the slot was lost for good).
        closing = asyncio.ensure_future(cs.close(named=named))

        def closed(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:  # read here: a cancelled caller never does
                logger.warning("job %s: closing its chain session failed: %r", self.job_id, f.exception())
            if lease is not None:
                self.orch.dispatch.release(lease)

        closing.add_done_callback(closed)
        await asyncio.shield(closing)

    def _holding_chain(self, cs: ChainSession, lease: Lease | None) -> Chain | None:
        """The planned chain whose servers hold the pages of ``cs`` (the hops it ended on): the lease's when no hop
        moved; after a hop moved to another server, the planned chain of exactly those hops if there is one, else
        None: the lease's chain names the failed server, which holds none of them, and a chain reuses a prefix only
        where every hop holds it (a later job steered there computed the whole prompt)."""
        if lease is None:
            return None
        if cs.hops == lease.hops:
            # a chain re-planned away while the job ran is not entered: the directory forgets such chains at each
            # plan (ChainPrefixes.retain), and one entered after that stayed until the LRU cap pushed it out
            planned = getattr(self.orch.dispatch, "planned", None)
            return lease.chain if planned is None or planned(lease.chain) else None
        key = (tuple(peer for peer, _, _ in cs.hops), tuple((start, end) for _, start, end in cs.hops))
        return next((ch for ch in getattr(self.orch.dispatch, "chains", None) or () if chain_key(ch) == key), None)

    def _as_this_request(self, job: DispatchJob, need: int) -> None:
        """``job`` as the request under way: the tokens it may still generate after ``need``, and its deadline and
        most output tokens when it has an active one (else none)."""
        dl = DEADLINE.get()
        job.expected_output = max(0, self.max_length - need)
        job.deadline, job.output_tokens = (dl, job.expected_output) if dl is not None and dl.active else (None, 0)

    def next_turn(self) -> None:
        """A session's next turn is a new request: for ``--schedule db|mlfq`` the last turn's execution time is
        observed (if it completed) and this one starts with a fresh record (top level, first budget), not the level
        the session's earlier turns had reached."""
        if self.priority is None:
            return
        if self.completed:
            self.orch.dispatch.finished(self.priority)
        self.completed = False
        self.priority = self.orch.dispatch.new_priority_job(self.job_id, str(getattr(self.orch, "model_id", "")))
        if self.lease is not None:
            self.lease.job.sched = self.priority

    async def release_chain(self) -> bool:
        """Between a session's turns: give the chain back (its servers keep the KV as cached prefixes; the next
        turn reuses what is still cached, recomputes the rest). Only when every hop has a prefix cache, else the
        chain stays held (a slots-mode chain would recompute the whole history), and with ``--hold-sessions``.
        True if released."""
        if self.cs is None:
            return False
        paused = self.lease is not None and self.lease.preempt  # marked at its last step: it has no next one
        if (not self.cs.prefix_cache or self.orch.cfg.hold_sessions) and not paused:
            if self.lease is not None:
                self.lease.job.idle = True  # held, not stepping: not a job to pause for another
            return False
        await self._drop()
        # the next turn is a new request: queued, predicted, refused and dropped as one (the re-queue lane is for
        # a job that lost its chain within a request)
        self.admitted = self.ran = False
        return True

    async def feed(self, new_ids: list[int], hidden: torch.Tensor | None = None, *,
                   all_positions: bool = False, drafted: int = 0) -> torch.Tensor:
        """Append ``new_ids`` to the KV; return the last block's output at the last position [H] (or, with
        ``all_positions``, at every position of the tokens fed in this call, [n, H]).

        ``hidden``: the embeddings of ``new_ids`` if the caller has them (the head batcher embeds the tokens it
        samples); replays after a failover embed in the head's worker thread. ``drafted``: the last tokens of
        ``new_ids`` are speculative drafts, the system's guesses: not charged to the client as input (the accepted
        ones are charged as output)."""
        if len(self.kv_ids) + len(new_ids) > self.max_length:
            raise RequestError(f"sequence would exceed max_length={self.max_length}", code="context_length_exceeded")
        budget = [self.orch.cfg.max_failovers]  # hop and chain failovers of this call, together
        # a refusal in an earlier call that ended before its full re-open (cancelled, timed out) concerned a chain of
        # that time: this call's opens may reuse cached prefixes again (a session's next turn recomputed its history)
        self.open_full = False
        while True:
            if self.lease is not None and self.lease.preempt:
                await self._pause()
            full = self.kv_ids + list(new_ids)
            # every position of new_ids needs its output (prompt logprobs, a speculative verify): a prefix cache may
            # serve the tokens held before them, never one of them (the chain computes the last token named)
            self.drafted = drafted  # a chain taken now is not charged for them (_ensure_chain)
            try:
                await self._ensure_chain(prompt=full[:len(self.kv_ids) + 1] if all_positions else full,
                                         need=len(full))
            finally:
                self.drafted = 0
            if self._untrusted():
                # A server of this chain (or one whose replies its reused KV came from) was caught returning wrong
                # results: what the hops downstream of it hold was computed from them. Replay every token on a
                # chain that computes them itself (not charged as a failover).
                logger.warning("job %s: its KV may come from a banned server; replaying %d tokens elsewhere",
                               self.job_id, len(full))
                self.kv_valid = 0
                await self._drop()
                continue
            if len(full) > self.cs.max_length:
                try:
                    await self._grow(len(full))
                except HopFailure as e:
                    if e.no_capacity:
                        await self._preempt(e)
                    else:
                        await self._chain_failed(e, budget, len(full) - self.kv_valid)
                    continue
            position = self.kv_valid
            ids = full[position:]
            # the caller's embeddings cover exactly new_ids: usable only when the chain holds all the rest
            x = hidden if hidden is not None and position == len(self.kv_ids) else await self.orch.batcher.embed(ids)
            t_step, failovers = time.monotonic(), self.failovers
            try:
                out = await self._forward(x, position, budget, full)
            except asyncio.CancelledError:
                # A step cut short leaves replies unread: its streams are closed. Release the chain now (its JFFC
                # slot goes to the next job); a session's next turn acquires one and replays what it needs.
                self.kv_valid = min(self.kv_valid, len(self.kv_ids))  # a reused prefix beyond them is not kept
                self.orch._background(self._drop())
                raise
            except HopFailure as e:
                if self._waits_for_pages(e):
                    await self._refused_full(e)
                else:
                    await self._chain_failed(e, budget, len(ids))
                continue
            self.lean_first = False
            self._count_lookup()
            self.kv_ids.extend(new_ids)
            self.kv_valid = len(self.kv_ids)
            if self.lease is not None and hasattr(self.orch.dispatch, "charge"):  # routed dispatch: no central queue
                # every schedule's deadline predictions learn the chain's steps from it (DispatchManager.charge)
                # a step's time tells an iteration's (mlfq) only for a plain decode or prefill: not a speculative
                # verify nor prompt scoring (every position wanted), nor a step that failed over
                plain = not all_positions and self.failovers == failovers
                self.orch.dispatch.charge(self.lease, time.monotonic() - t_step, len(ids) if plain else 0)
            billable = len(self.kv_ids) - drafted
            if self.paid < billable:  # a turn on a chain the job kept: no admission charged it
                self._charge("input", billable - self.paid)
            self.reused_tokens = position
            self.steps += 1
            self.batch_steps += self._chain_jobs()
            return out[0, len(ids) - len(new_ids):] if all_positions else out[0, -1]

    def _named_for(self, lease: Lease, named: bytes) -> bytes:
        """``named`` (the prompt's prefix hashes) for the open of ``lease``'s chain, or nothing when a hop's server
        announces no prefix cache (its record's ``prefix_cache``; a server the planner has no record of counts as
        having one). That hop holds nothing, so the chain starts at 0 and the other hops' matches are of no use;
        named, a server whose pool was full opened lean on its match and refused the first step for want of pages
        (a preemption and a second open, every time). Unnamed, it reserves the whole length or queues the open."""
        planner = getattr(self.orch, "planner", None)
        servers = getattr(planner, "servers", None) or {}
        for peer, _, _ in lease.hops:
            view = servers.get(peer)
            if view is not None and not getattr(view.record, "prefix_cache", True):
                return b""
        return named

    def _count_lookup(self) -> None:
        """The current chain served its first step: count its open's prefix lookup and hits now. A chain given up
        before (a lean first step refused for want of pages, a failed first step) served none of its hits, and the
        open after it is the same request's lookup: counted at its open, a lean refusal's full re-open added the
        prompt again with 0 hits and a refused open's hits were counted though recomputed."""
        if self._lookup is not None:
            self.orch.stats.add_chain_open(*self._lookup)
            self._lookup = None

    def _chain_jobs(self) -> int:
        """Jobs running on this job's chain now (itself included)."""
        lease, dispatch = self.lease, self.orch.dispatch
        if lease is None or not hasattr(dispatch, "active"):
            return 1
        if getattr(dispatch, "generation", None) != lease.generation:  # re-planned: its index means another chain
            return 1
        return max(1, dispatch.active(lease.index))

    @property
    def mean_batch(self) -> float | None:
        """Jobs on its chain per step of this job, on average (None before a step)."""
        return self.batch_steps / self.steps if self.steps else None

    def charge_output(self, tokens: int = 1) -> None:
        """``tokens`` were generated for the job's client (fair sharing: ``w_q`` each, on the chain serving it)."""
        self._charge("output", tokens)

    def _charge(self, kind: str, tokens: int) -> None:
        shares = getattr(self.orch, "shares", None)
        if kind == "output":
            self.paid = max(self.paid, len(self.kv_ids) + tokens)  # the token is fed next: charged once
        else:
            self.paid += tokens
        if shares is not None and self._worker is not None and tokens > 0:
            (shares.output if kind == "output" else shares.input)(self.client, self._charged_worker(), tokens)

    def _charged_worker(self) -> tuple | None:
        """The chain key work done now is charged to: where the job's lease is counted in the plan now
        (:meth:`DispatchManager.worker_of`; None: on no chain, its client's service alone). A re-plan that re-split
        its chain counts it on the new one: charged to the dropped chain's key, that chain's per-chain counters
        (d-vtc, d2lpm) never saw its tokens and the dropped key's entry grew. ``_worker`` set from elsewhere (a
        later choice charged where its first ran) is taken as it is."""
        held, worker_of = self._worker_lease, getattr(self.orch.dispatch, "worker_of", None)
        if held is None or worker_of is None or held[1] != self._worker:
            return self._worker
        return worker_of(held[0])

    async def _grow(self, need: int) -> None:
        """The job outgrew what its chain was opened for: ask every hop for ``need`` tokens plus twice the previous
        output reserve (so a long generation extends a logarithmic number of times). HopFailure if a hop cannot."""
        self.output_reserve = max(2 * self.output_reserve, 16)
        await self.cs.extend(min(self.max_length, need + self.output_reserve))
        self.orch.stats.extensions += 1

    async def _preempt(self, e: HopFailure) -> None:
        """Too few free pages on a hop to grow: give the chain back. The servers keep the KV as cached prefixes; the
        next feed goes back to the dispatcher (never refused) and resumes with a larger reservation, reusing what is
        still cached and recomputing the rest: the output is the same either way."""
        self.preemptions += 1
        self.orch.stats.add_preemption()
        logger.info("job %s: preempted at %d tokens (%s); resuming on a chain with room", self.job_id,
                    len(self.kv_ids), e)
        self.kv_valid = min(self.kv_valid, len(self.kv_ids))
        await self._drop()

    async def _refused_full(self, e: HopFailure) -> None:
        """A hop refused the chain's first step for want of pages (:func:`step_refused_full`): not a failed server.
        It was handled as one: a failover that tried to move the hop (those opens were refused too), a full replay
        on another chain, and after ``--max-failovers`` of them in a row (a burst of requests sharing a system
        prompt on a full server) the request failed 503 though the chain could serve it a moment later. Now the job
        gives the chain back as a preemption does and opens the next one naming no cached prefix: each server
        reserves the whole length at open, or queues the open until pages free up (never refused at a step)."""
        self.open_full = True
        await self._preempt(e)

    def _waits_for_pages(self, e: HopFailure) -> bool:
        """``e`` is a step refusal to wait out (:meth:`_refused_full`), not a failed step: the refusal of the first
        step of a chain opened on a cached prefix. A server refusing any other step (a buggy or hostile one, which
        refuses every step: each re-open was refused again) goes the failover way, within ``--max-failovers``: as
        a wait it cost no budget, and the request re-opened its chain for ever, thousands of times a second."""
        return step_refused_full(e) and self.lean_first

    async def _pause(self) -> None:
        """A deadline job (``--schedule flex``) or a job of higher priority (``db``, ``mlfq``) needs this job's slot:
        give the chain back between two steps, as :meth:`_preempt` does (the servers keep the KV as cached
        prefixes), and queue again behind the jobs that go first. It resumes where it was, reusing what is still
        cached; the output is the same."""
        self.orch.stats.add_pause()
        logger.info("job %s: paused at %d tokens for a job %s", self.job_id, len(self.kv_ids),
                    "of higher priority" if self.priority is not None else "with a deadline")
        self.kv_valid = min(self.kv_valid, len(self.kv_ids))
        self.yields = True
        await self._drop()

    async def _chain_failed(self, e: HopFailure, budget: list[int], replay_tokens: int) -> None:
        """The chain as a whole is lost: drop it (the next feed replays on another chain), within the budget."""
        self.failovers += 1
        self.orch.stats.add_failover()
        blocks = sum(end - start for _, start, end in (self.cs.hops if self.cs is not None else []))
        self.orch.stats.add_replay("full", tokens=len(self.kv_ids), token_blocks=len(self.kv_ids) * blocks)
        logger.warning("job %s: %s; replaying %d tokens on another chain", self.job_id, e, replay_tokens)
        self.orch.server_failed(e)
        await self._drop()
        budget[0] -= 1
        if budget[0] < 0:
            raise Unavailable(f"gave up after {self.failovers} server failures") from None

    async def _forward(self, hidden: torch.Tensor, position: int, budget: list[int], tokens: list[int]) -> torch.Tensor:
        """Run ``hidden`` (positions ``position..`` of ``tokens``) through the chain, keeping every hop's input; a
        failed hop moves to another server (:meth:`_move_hop`). HopFailure: the chain as a whole is lost."""
        cs, inputs = self.cs, self.inputs
        inputs.truncate(position)
        x = hidden
        # an adapter's steps are not audited: the auditor re-runs hops on base-model sessions (see orchestrator README)
        auditor = getattr(self.orch, "auditor", None) if not self.adapter else None
        if cs.push:
            async def recover(i: int, failure: HopFailure, x_in: torch.Tensor) -> torch.Tensor:
                return await self._move_hop(i, failure, x_in, position, budget, tokens)

            rescues, mismatches = cs.push_rescues, cs.push_mismatches
            outs = await cs.forward_push(x, position, recover)
            self.orch.stats.add_push_step(len(cs.hops), cs.push_rescues - rescues, cs.push_mismatches - mismatches)
            for i, out in enumerate(outs):
                if i > 0:
                    inputs.append(cs.hops[i][1], x, position)
                if auditor is not None and auditor.sample():
                    auditor.schedule(cs.hops[i], x, position, out, tokens, inputs)
                x = out
            return x
        self.orch.stats.add_relay_step(len(cs.hops))
        for i in range(len(cs.hops)):
            if i > 0:
                inputs.append(cs.hops[i][1], x, position)
            try:
                x_in, x = x, await cs.step(i, x, position)
            except HopFailure as e:  # its replacement's answer is sampled too (as push mode's recovered hops are)
                x_in, x = x, await self._move_hop(i, e, x, position, budget, tokens)
            if auditor is not None and auditor.sample():
                auditor.schedule(cs.hops[i], x_in, position, x, tokens, inputs)
        return x

    async def _move_hop(self, i: int, failure: HopFailure, x: torch.Tensor, position: int,
                        budget: list[int], tokens: list[int]) -> torch.Tensor:
        """Give hop ``i`` to another server holding its span (or re-open it on its own server if that server only
        lost the session) and replay the hop's inputs there; re-raise ``failure`` if that is not possible."""
        orch, cs = self.orch, self.cs
        peer, start, end = cs.hops[i]
        if self._waits_for_pages(failure):
            raise failure  # the server lives and is full for now: the job re-opens its chain (feed)
        orch.server_failed(failure)  # a dead or lying server is banned before candidates are chosen
        if budget[0] <= 0:
            raise failure
        auditor = getattr(orch, "auditor", None)
        if auditor is not None and auditor.distrusted(peer):
            raise failure  # banned for wrong results: the hops after it hold KV computed from them, replay it all
        if position == 0:
            history = None
        elif start == 0:
            history = await orch.batcher.embed(tokens[:position])
        else:
            history = self.inputs.get(start, position)
            if history is None:  # evicted (over --replay-cache-mb) or never kept: replay the whole chain
                raise failure
        candidates = [p for p in orch.replacement_servers(start, end) if p != peer
                      and (not self.adapter or orch.server_serves_adapter(p, self.adapter))]
        if is_refusal(failure):
            candidates.insert(0, peer)  # the server lives (e.g. its idle timeout dropped the session)
        for cand in candidates[:MAX_REPLACEMENT_TRIES]:
            try:
                out = await cs.replace(i, cand, history, x, position)
            except HopFailure as e:
                logger.info("job %s: %s cannot take blocks [%d, %d) over: %s", self.job_id, cand[:12], start, end, e)
                orch.server_failed(e)
                continue
            if self.lease is not None:  # a pause for priority frees its slot cheaply only where every hop keeps KV
                kept = getattr(orch.dispatch, "kv_kept", None)  # routed dispatch: no pauses
                if kept is not None:
                    kept(self.lease, cs.prefix_cache)
                else:
                    self.lease.keeps_kv = cs.prefix_cache
            budget[0] -= 1
            self.failovers += 1
            orch.stats.add_failover()
            orch.stats.add_replay("partial", tokens=position, token_blocks=position * (end - start))
            logger.warning("job %s: %s; replayed %d tokens of blocks [%d, %d) on %s", self.job_id, failure, position,
                           start, end, cand[:12])
            return out
        raise failure

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.priority is not None and self.completed:  # a refused or failed job taught L̂_s 0 s
                self.orch.dispatch.finished(self.priority)
            await self._drop()
            self.inputs.close()
