"""Auditing servers (``--audit-rate``): re-run a sample of hop steps on another server holding the same blocks.

The relay sees every hop's input and output. For a sampled step, once the hop answered, a background task opens
a throwaway session on a second server holding the hop's span, feeds it the hop's whole input history plus the
step's input (the token embeddings for a first hop, the inputs kept for failover otherwise) and compares the
outputs per token (relative L2 error, :func:`relative_error`) against a tolerance for the reply's dtype. A
disagreement is broken by a third server; the minority gets a strike (:mod:`petals_chain.algorithms.audit`),
and a server whose decayed strikes reach the threshold is banned for good: it is not planned again, jobs on a
chain through it drop the chain and replay their tokens on honest servers, and prefix caches are re-keyed
(``salt``) because KV that servers downstream of it computed from its replies must never be reused. A cached page
is named by its tokens only, not by the servers upstream of it, so jobs whose chains reused cached or forked KV
named before the ban replay too (``ChainHolder._untrusted``), even on chains without the banned server. Audits never
delay the job: they run beside it, and a step that cannot be audited (no second server, a busy one, inputs no
longer kept) is counted and skipped.

*Probes* (``--audit-probe-s``) catch a server that lies only when nobody audits it, or only on traffic the
samples miss: while the swarm has spare capacity (nothing waits for a chain), every period one server in turn
gets a short random token sequence. Its span's input comes from the token embeddings (a span starting at block
0) or from other servers computing the blocks before it; the server's output is then judged like an audited
step's, against a second holder of the span and, on a disagreement, a third.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import Counter, Gauge, Histogram

from petals_chain.algorithms.audit import StrikeBook, verdict
from petals_chain.orchestrator.relay import check_hop_output, hop_session_id

logger = logging.getLogger(__name__)

# Relative L2 error per token that honest servers stay within, by the dtype they compute in (measured,
# docs/results.md "Verified chains": fp32 servers agree to 6.2e-6 at most, bf16 ones to 0.035 at most)
DEFAULT_TOLERANCE = {"float32": 1e-2, "float64": 1e-2, "float16": 6e-2, "bfloat16": 6e-2}
_TORCH_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}
PRUNE_SLACK = 64  # strike records of servers gone kept before the book is pruned (see Auditor._prune)
MAX_INFLIGHT = 4  # audits running at once: a burst of samples never piles up work on the auditors
# An audit re-computes the hop's whole history on the auditor: steps later in a sequence than this are skipped
# (counted), so auditing costs at most a prefill of this many tokens per sampled step
MAX_AUDIT_TOKENS = 1024
PROBE_TOKENS = (8, 64)  # a probe sequence's length, drawn in this range (a fixed length would mark probes)


@dataclass(frozen=True)
class _Upstream:
    """A hop's history to compute from its tokens (:meth:`Auditor._upstream`): a first hop's embeddings, or a later
    hop's input rebuilt through the blocks before its span."""

    tokens: list[int]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-token ``||out - ref|| / ||ref||`` of two hop outputs [1, n, H] (inf if shapes differ)."""
    if out.shape != ref.shape:
        return float("inf")
    a, b = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    num = (a - b).norm(dim=-1)
    den = b.norm(dim=-1).clamp_min(1e-6)
    return float((num / den).max()) if num.numel() else 0.0


class Auditor:
    """Samples hop steps at ``rate``, re-runs them on other servers, strikes and bans liars (see the module)."""

    def __init__(self, orch: Any, rate: float = 0.0, *, tolerance: float | None = None, threshold: float = 3.0,
                 half_life_s: float = 3600.0, probe_s: float = 0.0, seed: int | None = None, registry: Any = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--audit-rate must be in [0, 1], got {rate!r}")
        if not probe_s >= 0:
            raise ValueError(f"--audit-probe-s must be >= 0, got {probe_s!r}")
        self.probe_s = float(probe_s)
        self._probe_turn = 0
        if tolerance is not None and not tolerance > 0:
            raise ValueError(f"--audit-tolerance must be positive, got {tolerance!r}")
        self.orch = orch
        self.rate = float(rate)
        self.tolerance = tolerance
        self.book = StrikeBook(threshold, half_life_s)
        self._prune_at = 0  # the book's size past which the next prune runs (see _prune)
        self.rng = random.Random(seed)
        self.epoch = 0  # prefix-cache key epoch: bumped by every ban (KV reused under an older one is replayed)
        self._tasks: set[asyncio.Task] = set()
        self.counts = {"sampled": 0, "probes": 0, "audits": 0, "agreed": 0, "disagreed": 0, "inconclusive": 0,
                       "strikes": 0, "bans": 0, "skipped_no_auditor": 0, "skipped_busy": 0, "skipped_no_history": 0,
                       "rebuilt_history": 0, "skipped_auditor_failed": 0, "skipped_long": 0}
        self.max_agreeing_error = 0.0  # the largest error between servers that agreed (tolerance calibration)
        self.errors: deque[float] = deque(maxlen=10_000)  # recent errors of every audit (for the benchmark)
        self.events: deque[dict] = deque(maxlen=50)
        self.m_audits = Counter("petals_chain_audits", "Audited hop steps by outcome", ["outcome"], registry=registry)
        self.m_strikes = Counter("petals_chain_audit_strikes", "Strikes given by audits, by server (peer id: a server "
                                 "names itself, and may take another's name)", ["server"],
                                 registry=registry)
        self.m_bans = Gauge("petals_chain_audit_banned_servers", "Servers banned for wrong results", registry=registry)
        self.m_error = Histogram("petals_chain_audit_relative_error", "Relative L2 error between two servers' "
                                 "outputs of an audited step", buckets=(1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2,
                                                                        0.1, 0.3, 1.0), registry=registry)

    # ---- what the relay asks ------------------------------------------------------------------------
    @property
    def salt(self) -> bytes:
        """Prefix-hash salt: empty until a ban, then the ban epoch (old cache entries never match again)."""
        return struct.pack("<Q", self.epoch) if self.epoch else b""

    def distrusted(self, peer_id: str) -> bool:
        return peer_id in self.book.banned

    def tainted(self, peers: Any) -> bool:
        """Whether any of ``peers`` (peer ids, or ``(peer, start, end)`` hops) is banned: KV a chain computed
        downstream of such a server is not to be trusted."""
        if not self.book.banned:
            return False
        return any((p[0] if isinstance(p, tuple) else p) in self.book.banned for p in peers)

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def sample(self) -> bool:
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return False
        self.counts["sampled"] += 1
        if self.inflight >= MAX_INFLIGHT:
            self._outcome("skipped_busy")
            return False
        return True

    async def stop(self) -> None:
        """Cancel running audits (their throwaway sessions are closed on the way out)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def schedule(self, hop: tuple[str, int, int], x: torch.Tensor, position: int, out: torch.Tensor,
                 tokens: list[int], inputs: Any) -> None:
        """Audit the step that sent ``x`` (positions ``position..``) to ``hop`` and got ``out``: ``tokens`` are the
        job's tokens (a first hop's history), ``inputs`` its kept hop inputs (a later hop's)."""
        peer, start, end = hop
        if position + int(x.shape[1]) > MAX_AUDIT_TOKENS:
            self._outcome("skipped_long")
            return
        if position == 0:
            history = None
        elif start == 0:
            history = _Upstream(list(tokens[:position]))  # the token embeddings (no block before the span)
        else:
            history = inputs.get(start, position)
            if history is None:  # evicted, or a prefix reused from a cache was never relayed
                if len(tokens) < position:
                    self._outcome("skipped_no_history")
                    return
                # rebuilt from the tokens through the blocks before the span on other servers (as a probe's input
                # is): a liar serving later hops of popular prefixes was never audited
                self.counts["rebuilt_history"] += 1
                history = _Upstream(list(tokens[:position]))
        self._spawn(self._audit(peer, start, end, history, x, position, out))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- probes -------------------------------------------------------------------------------------
    async def probe_loop(self, stop: asyncio.Event) -> None:
        """Every ``probe_s`` seconds, probe the next server while the swarm has spare capacity."""
        while self.probe_s > 0 and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.probe_s)
                return
            except asyncio.TimeoutError:
                pass
            if self.inflight >= MAX_INFLIGHT or getattr(self.orch.dispatch, "queue_length", 0):
                continue  # no spare capacity: jobs first
            try:
                target = self._next_probe_target()
            except Exception:  # noqa: BLE001 - a planner in flux must not end the probes
                logger.warning("choosing a server to probe failed", exc_info=True)
                continue
            if target is not None:
                self._spawn(self._probe(*target))

    def _next_probe_target(self) -> tuple[str, int, int] | None:
        planner = getattr(self.orch, "planner", None)
        if planner is None:
            return None
        # whatever free slots a server announces: a liar announcing none was never probed (a full server refuses
        # the open, and the probe counts as skipped_busy)
        views = sorted((v for v in planner.online_views() if not self.distrusted(v.peer_id)
                        and v.record.num_blocks > 0), key=lambda v: v.peer_id)
        if not views:
            return None
        v = views[self._probe_turn % len(views)]
        self._probe_turn += 1
        return v.peer_id, v.record.start_block, v.record.start_block + v.record.num_blocks

    async def _probe(self, peer: str, start: int, end: int) -> None:
        """Run a random sequence through ``peer``'s span (its input computed without it) and judge the output."""
        try:
            self.counts["probes"] += 1
            vocab = int(self.orch.vocab_size)
            # never longer than a job may be: servers refuse sessions beyond --max-length (with --max-length 32,
            # 32 of 57 probe lengths were refused, and the probe wasted)
            longest = max(1, min(PROBE_TOKENS[1], int(getattr(self.orch.cfg, "max_length", PROBE_TOKENS[1]))))
            length = self.rng.randint(min(PROBE_TOKENS[0], longest), longest)
            tokens = [self.rng.randrange(vocab) for _ in range(length)]
            x = await self._upstream(tokens, start, exclude=peer)
            if x is None:
                return
            out = await self._rerun(peer, start, end, None, x, 0)
            if out is not None:
                await self._judge(peer, start, end, None, x, 0, out)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a probe must never break the orchestrator
            logger.warning("probe of %s blocks [%d, %d) failed", peer[:12], start, end, exc_info=True)

    async def _upstream(self, tokens: list[int], start: int, exclude: str) -> torch.Tensor | None:
        """The input of block ``start`` for ``tokens``: their embeddings run through blocks [0, start) on trusted
        servers other than ``exclude`` (None, counted, if no such server can)."""
        x = await self.orch.batcher.embed(tokens)
        pos = 0
        while pos < start:
            hop = self._covering(pos, start, exclude=exclude)
            if hop is None:
                self._outcome("skipped_no_auditor")
                return None
            holder, hop_end = hop
            x = await self._rerun(holder, pos, hop_end, None, x, 0)
            if x is None:
                return None
            pos = hop_end
        return x

    def _job_like_session_id(self) -> str:
        return hop_session_id()  # as a job's hop sessions are named: a server cannot tell an audit from a job

    def _job_like_length(self, tokens: int) -> int:
        reserve = self.rng.choice((16, 32, 64, 128, 256))  # what a job opens for: its tokens and an output reserve
        return max(tokens, min(int(getattr(self.orch.cfg, "max_length", tokens + reserve)), tokens + reserve))

    def _covering(self, pos: int, limit: int, exclude: str) -> tuple[str, int] | None:
        """A trusted server other than ``exclude`` holding block ``pos``, and where its part ends (<= ``limit``)."""
        planner = getattr(self.orch, "planner", None)
        best = None
        for v in planner.online_views() if planner is not None else []:
            r = v.record
            if (v.peer_id == exclude or self.distrusted(v.peer_id)
                    or not r.start_block <= pos < r.start_block + r.num_blocks):
                continue
            reach = min(limit, r.start_block + r.num_blocks)
            if r.slots_free >= 1 and (best is None or reach > best[1]):
                best = (v.peer_id, reach)
        return best

    # ---- the audit ----------------------------------------------------------------------------------
    def _outcome(self, kind: str) -> None:
        self.counts[kind] += 1
        self.m_audits.labels(kind).inc()

    def _tolerance(self, dtype: torch.dtype, peers: list[str]) -> float:
        """The fixed tolerance, else the loosest for the dtypes involved: the reply's and the dtype each server
        computes in (its record; a bf16 server may reply in fp32)."""
        if self.tolerance is not None:
            return self.tolerance
        names = [_TORCH_NAMES.get(dtype, "")]
        for p in peers:
            r = self._record(p)
            names.append(str(getattr(r, "dtype", "")) if r is not None else "")
        return max(DEFAULT_TOLERANCE.get(n, 6e-2) if n else 1e-2 for n in names)

    async def _audit(self, peer: str, start: int, end: int, history: Any, x: torch.Tensor, position: int,
                     out: torch.Tensor) -> None:
        try:
            rebuilt = isinstance(history, _Upstream) and start > 0
            if isinstance(history, _Upstream):
                history = await self._upstream(history.tokens, start, exclude=peer)
                if history is None:
                    return
            await self._judge(peer, start, end, history, x, position, out, rebuilt=rebuilt)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - an audit must never break the relay
            logger.warning("audit of %s blocks [%d, %d) failed", peer[:12], start, end, exc_info=True)

    async def _judge(self, peer: str, start: int, end: int, history: torch.Tensor | None, x: torch.Tensor,
                     position: int, out: torch.Tensor, rebuilt: bool = False) -> None:
        """Compare ``peer``'s ``out`` with a second holder's answer; on a disagreement ask a third and strike the
        minority. ``rebuilt``: ``history`` was computed again by servers holding the blocks before ``start``, not
        the input ``peer``'s KV came from."""
        candidates = [p for p in self.orch.replacement_servers(start, end)
                      if p != peer and not self.distrusted(p) and self._has_room(p)]
        if not candidates:
            self._outcome("skipped_no_auditor")
            return
        # A rebuilt history differs from the one peer's KV holds by the rounding of whoever computed either (the
        # original, from an earlier job or a prefix cache, is unknown): any server before the span may have, so
        # the tolerance is the loosest of theirs too (bf16 upstream rounding moved an honest fp32 hop's output by
        # up to 1.1e-2 at 300 tokens on SmolLM2, past the fp32 tolerance: strikes on an honest server)
        upstream = self._holders_before(start) if rebuilt else []
        tol = self._tolerance(out.dtype, [peer, *candidates[:2], *upstream])
        ref = await self._rerun(candidates[0], start, end, history, x, position)
        if ref is None:
            return
        err = relative_error(out, ref)
        self.errors.append(err)
        self.m_error.observe(min(err, 1e9))
        self.counts["audits"] += 1
        self._prune()
        self.book.audited(peer)
        self.book.audited(candidates[0])
        if err <= tol:
            self.max_agreeing_error = max(self.max_agreeing_error, err)
            self._outcome("agreed")
            return
        self._outcome("disagreed")
        pa = pb = None
        referee = candidates[1] if len(candidates) > 1 else None
        if referee is not None:
            third = await self._rerun(referee, start, end, history, x, position)
            if third is not None:
                self.book.audited(referee)
                pa = relative_error(out, third) <= tol
                pb = relative_error(ref, third) <= tol
        roles = {"primary": peer, "auditor": candidates[0], "referee": referee}
        culprits = verdict(False, pa, pb)
        if not culprits:
            self._outcome("inconclusive")
        for role in culprits:
            self._strike(roles[role], err, start, end)

    async def _rerun(self, peer: str, start: int, end: int, history: torch.Tensor | None, x: torch.Tensor,
                     position: int) -> torch.Tensor | None:
        """``peer``'s output for ``x`` after ``history`` (a fresh session, one prefill); None if it cannot."""
        xx = x if history is None else torch.cat([history.to(x.dtype), x], dim=1)
        try:
            async with asyncio.timeout(self.orch.cfg.step_timeout_s):  # not wait_for: it can swallow a cancellation
                # opened as a job's hop is (its id's form, a length with an output reserve): a server that lies
                # only outside audits must not tell them apart ("audit-" ids and exact lengths gave them away)
                sess = await self.orch.client.open_session(peer, session_id=self._job_like_session_id(),
                                                           start_block=start, end_block=end,
                                                           max_length=self._job_like_length(int(xx.shape[1])))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - full, refusing or gone: this audit is skipped
            self._outcome("skipped_busy" if "capacity" in type(e).__name__.lower() else "skipped_auditor_failed")
            return None
        try:
            res = await sess.step(xx, 0)
            check_hop_output(res, xx)
            return res[:, position:]
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - an auditor that fails is not evidence against the audited server
            self._outcome("skipped_auditor_failed")
            return None
        finally:
            await asyncio.gather(sess.close(), return_exceptions=True)

    def _prune(self) -> None:
        """Forget the strike records of servers gone whose strikes have decayed away (and their strike series): one
        per audited peer id since start, and volunteers come back under new ids. A prune scans the whole book, so
        the next one waits until the book has doubled past what this one kept (banned liars, recent strikes):
        amortized O(1) per audit (with 5,000 banned ids every audit scanned all 5,000 records, ~1 ms each)."""
        planner = getattr(self.orch, "planner", None)
        if planner is None or len(self.book) <= max(2 * len(planner.servers) + PRUNE_SLACK, self._prune_at):
            return
        for server in self.book.prune(planner.servers, time.monotonic()):
            with contextlib.suppress(KeyError):  # (never struck: no series)
                self.m_strikes.remove(server)
        self._prune_at = 2 * len(self.book)

    def _strike(self, server: str, err: float, start: int, end: int) -> None:
        self.counts["strikes"] += 1
        self.m_strikes.labels(server).inc()
        now = time.monotonic()
        banned = self.book.strike(server, now)
        self.events.append({"t": time.time(), "server": server, "name": self._name(server), "event": "ban" if banned
                            else "strike", "relative_error": err, "blocks": [start, end],
                            "score": self.book.score(server, now)})
        logger.warning("audit: %s (%s) returned wrong hidden states for blocks [%d, %d) (relative error %.3g): "
                       "strike, score %.2f", self._name(server), server[:12], start, end, err,
                       self.book.score(server, now))
        if banned:
            self.ban(server)

    def ban(self, server: str) -> None:
        """Ban ``server`` for good: out of every plan, its chains replayed elsewhere, prefix caches re-keyed."""
        self.book.banned.add(server)
        self.counts["bans"] += 1
        self.m_bans.set(len(self.book.banned))
        self.epoch += 1
        logger.error("audit: banning %s (%s) for wrong results; jobs on its chains replay on other servers",
                     self._name(server), server[:12])
        planner = getattr(self.orch, "planner", None)
        if planner is not None:
            planner.report_failure(server, reason="audits found wrong hidden states", permanent=True)

    def _holders_before(self, start: int) -> list[str]:
        """Trusted online servers holding some block before ``start`` (a banned one's KV is replayed anyway)."""
        planner = getattr(self.orch, "planner", None)
        return [v.peer_id for v in (planner.online_views() if planner is not None else [])
                if v.record.num_blocks > 0 and v.record.start_block < start and not self.distrusted(v.peer_id)]

    def _record(self, peer: str) -> Any:
        """The server's last record as the planner knows it (None if unknown)."""
        planner = getattr(self.orch, "planner", None)
        v = planner.servers.get(peer) if planner is not None else None
        return v.record if v is not None else None

    def _has_room(self, peer: str) -> bool:
        """The server announced room for one more session (a slot in each of its blocks): audits use spare
        capacity, never a job's."""
        r = self._record(peer)
        return r is None or r.slots_free >= 1

    def _name(self, peer: str) -> str:
        r = self._record(peer)
        return r.public_name if r is not None and r.public_name else peer[:12]

    # ---- reporting ------------------------------------------------------------------------------------
    def server_json(self, peer: str) -> dict:
        return self.book.snapshot(peer, time.monotonic())

    def _quantiles(self) -> dict:
        """Quantiles of the relative error of the last 10,000 audits (how far from the tolerance honest servers
        stay)."""
        if not self.errors:
            return {}
        xs = sorted(self.errors)

        def q(f: float) -> float:
            return xs[min(len(xs) - 1, int(f * len(xs)))]

        return {"n": len(xs), "p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": xs[-1]}

    def json(self) -> dict:
        return {"rate": self.rate, "tolerance": self.tolerance, "tolerance_mode": "fixed" if self.tolerance else "auto",
                "threshold": self.book.threshold, "half_life_s": self.book.half_life_s, **self.counts,
                "max_agreeing_error": self.max_agreeing_error, "inflight": self.inflight,
                "error_quantiles": self._quantiles(),
                "banned": sorted(self._name(p) for p in self.book.banned), "events": list(self.events)[-20:]}
