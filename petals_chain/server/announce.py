"""Announcing: this server's signed DHT record, kept alive by a timer of its own, and rejoining lost peers.

The record expires ``max(3 x refresh_s, 10 s)`` after its last publish. :class:`Announcer` republishes it every
``refresh_s`` (and soon after :meth:`Announcer.mark_dirty`) from its own asyncio task, in every state --
joining, profiling ``tau_p``, loading blocks, online, draining -- so a long await in the lifecycle (loading
runs in an executor, a drain waits for sessions) never lets the orchestrator forget a working server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from petals_chain.swarm.dht import SwarmDHT
from petals_chain.swarm.emulation import Emulation
from petals_chain.swarm.memory import page_size_for
from petals_chain.swarm.records import LOAD_ERROR_MAX, PUBLIC_NAME_MAX, ServerRecord

logger = logging.getLogger("petals_chain.server")
# this process's start (ServerRecord.started_at) where a record source has no ``started_at`` of its own: it changes
# at every restart and at nothing else
PROCESS_STARTED_AT = time.time()


class RecordSource(Protocol):
    """What a server record is built from (the lifecycle's ``Server`` is one)."""

    state: str
    epoch: int
    span: Optional[tuple[int, int]]
    max_length: int
    tau_p: float  # measured, unscaled
    runner: Any
    memory: Any  # MemoryBudget
    emulation: Emulation
    cfg: Any  # ServerConfig
    dtype_name: str
    model_fingerprint: str
    maddrs: Sequence[str]  # where peers dial it (swarm/reachability.py)
    reachability: str  # unknown | direct | relayed | unreachable


def build_record(src: RecordSource, peer_id: str) -> ServerRecord:
    """The record of ``src`` as it is now (slots from the runner being served, emulation shown as such; the span it
    could not load and why, from ``src.load_failure`` where it has one: a model offered but not served has none; the
    slots a stranger may open, from ``src.service``, the SessionService, where it has one)."""
    runner = src.runner
    start, num = src.span if (src.span and runner is not None) else (0, 0)
    cfg = src.cfg
    failure = getattr(src, "load_failure", None)
    service = getattr(src, "service", None)
    total, free, tokens_total, tokens_free = announced_capacity(runner, service)
    cap = announced_session_cap(service) if runner is not None else None
    # read after slots_free, and pages a step returned meanwhile may have raised it: at most the slots_free announced
    stranger_free = min(free, int(service.stranger_slots_free())) if runner is not None and service is not None else 0
    return ServerRecord(
        peer_id=peer_id, state=src.state, memory_bytes=int(src.memory.memory_bytes),
        tau_p=float(src.emulation.announced_tau_p(src.tau_p)), device=cfg.device, dtype=src.dtype_name,
        quant=cfg.quant, start_block=int(start), num_blocks=int(num),
        slots_total=total, slots_free=free, stranger_slots_free=stranger_free,
        public_name=cfg.public_name[:PUBLIC_NAME_MAX], max_length=int(src.max_length), s_m_bytes=int(src.memory.s_m),
        s_c_bytes=int(src.memory.s_c(src.max_length)), **src.emulation.record_fields(), epoch=int(src.epoch),
        model_fingerprint=src.model_fingerprint, max_blocks=int(cfg.max_blocks), kv_cache=cfg.kv_cache,
        page_size=(int(runner.page_size) if runner is not None  # before a load: the page its KV will have
                   else page_size_for(cfg.kv_cache, int(src.max_length), int(cfg.page_size))),
        cache_tokens_total=tokens_total, cache_tokens_free=tokens_free, max_sessions=-1 if cap is None else cap,
        prefix_cache=bool(runner is not None and runner.prefix_cache),
        prefix_offered_tokens=int(runner.prefix_offered_tokens) if runner is not None else 0,
        prefix_reused_tokens=int(runner.prefix_reused_tokens) if runner is not None else 0,
        maddrs=list(src.maddrs)[:8], reachability=src.reachability, open_heartbeats=True,
        failed_span=[int(x) for x in failure[0]] if failure else [],
        load_error=failure[1][:LOAD_ERROR_MAX] if failure else "",
        cache_tokens_per_block=int(getattr(cfg, "cache_tokens_per_block", 0) or 0),
        adapters=dict(getattr(src, "adapter_names", None) or {}),
        started_at=float(getattr(src, "started_at", PROCESS_STARTED_AT)), timestamp=time.time(),
    )


def announced_capacity(runner: Any, service: Any) -> tuple[int, int, int, int]:
    """``(slots_total, slots_free, cache_tokens_total, cache_tokens_free)`` as the record announces them: the
    runner's, capped by the sessions the open-files limit holds and admission takes now (``service.descriptors``,
    with the sessions it holds open or waiting: else the record offered slots its opens were refused); zeros
    without a runner."""
    if runner is None:
        return 0, 0, 0, 0
    free, total = int(runner.slots_free), int(runner.slots_total)
    tokens_total, tokens_free = int(runner.cache_tokens_total), int(runner.cache_tokens_free)
    descriptors = getattr(service, "descriptors", None)
    if descriptors is not None:  # no more slots than the open-files limit holds sessions
        held, held_push = getattr(service, "held", None), getattr(service, "held_push", None)
        total, tokens_total = _capped(total, tokens_total, descriptors.sessions_total())
        free, tokens_free = _capped(free, tokens_free, descriptors.sessions_free(
            held() if held is not None else 0, held_push() if held_push is not None else 0))
        free, tokens_free = min(free, total), min(tokens_free, tokens_total)
    return total, free, tokens_total, tokens_free


def announced_session_cap(service: Any) -> Optional[int]:
    """The sessions the server takes at once whatever their length (the record's ``max_sessions``): those its
    open-files limit holds (``service.descriptors``); None: no cap. A paged server's cache tokens hold ``max_length /
    L^`` times more short jobs than its slots: without the cap the planner placed 40 jobs of 64 tokens on a server
    at ``ulimit -n 128`` that admitted 10."""
    descriptors = getattr(service, "descriptors", None)
    return None if descriptors is None else descriptors.sessions_total()


def _capped(slots: int, tokens: int, sessions: Optional[int]) -> tuple[int, int]:
    """``slots`` and their ``tokens`` cut to ``sessions`` slots (the tokens in proportion; None: not cut). A server
    at ``ulimit -n 128`` announced 800 slots it could hold no 100 sessions of: the orchestrator placed 150 jobs on it,
    and none was answered."""
    if sessions is None or sessions >= slots:
        return slots, tokens
    return sessions, (tokens * sessions) // slots if slots else 0


class Announcer:
    """Publishes ``records()`` (``(prefix, record)`` pairs: each under ``{prefix}.servers``; a server offering
    several models has one per model) on a timer and re-pings lost initial peers.

    :meth:`start` runs two tasks until :meth:`stop`: the publish timer (every ``refresh_s``, or at once after
    :meth:`mark_dirty`) and the rejoin loop (every ``rejoin_s``: hivemind drops a peer from the routing table
    after one failed RPC and never pings its initial peers again, so an orchestrator restarted with the same
    identity and address would never see our record otherwise; see :meth:`SwarmDHT.arejoin`).
    """

    def __init__(self, sd: SwarmDHT, records: Callable[[], list[tuple[str, ServerRecord]]], *, refresh_s: float,
                 rejoin_s: float, initial_peer_ids: Sequence[str]):
        self.sd, self.records = sd, records
        self.refresh_s, self.rejoin_s = refresh_s, rejoin_s
        self.initial_peer_ids = list(initial_peer_ids)
        self.rejoins = 0  # times a lost initial peer (the orchestrator) answered again and we re-announced
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()  # one publish at a time: the last one stored carries the newest state
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._wake = asyncio.Event()  # set by stop(): ends the loops' waits

    @property
    def expiration_s(self) -> float:
        return max(3 * self.refresh_s, 10.0)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish_loop(), name="petals-chain-publish"),
                       asyncio.create_task(self._rejoin_loop(), name="petals-chain-rejoin")]

    async def stop(self) -> None:
        """End both loops (a publish or rejoin under way is cancelled)."""
        # Flags as well as cancel(): Python 3.11's wait_for() loses a cancellation that arrives as its inner
        # future completes (gh-86296); the loops then see the flag at their next wait, which stop() ends.
        self._stopping = True
        self._wake.set()
        self._dirty.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=max(self.refresh_s, 5.0) + 5.0)
        self._tasks = []

    def mark_dirty(self) -> None:
        """The record changed: publish it soon (from the timer's task, without waiting here)."""
        self._dirty.set()

    async def publish(self, timeout_s: float | None = None) -> bool:
        """Publish the records now; False (logged) if the DHT did not store one of them (within ``timeout_s``,
        default the refresh period or 5 s)."""
        async with self._lock:
            self._dirty.clear()  # this publish carries every change made so far
            try:
                # bounded: a store hung on an unreachable peer must not hold back the next refresh for long;
                # return_exceptions: a store the DHT cancels (at shutdown) must not leave an unretrieved error
                stores = asyncio.gather(*(
                    self.sd.apublish_server(prefix, record, self.expiration_s) for prefix, record in self.records()),
                    return_exceptions=True)
                # this publish cancelled (stop() under way) ends the gather with a CancelledError nobody awaits:
                # retrieved here, else asyncio logs "exception was never retrieved" as an ERROR at every shutdown
                stores.add_done_callback(lambda f: f.cancelled() or f.exception())
                stored = await asyncio.wait_for(stores, timeout=max(self.refresh_s, 5.0) if timeout_s is None
                                                else timeout_s)
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the server
                logger.warning(f"publishing the server record failed: {type(e).__name__}: {e}")
                return False
            failed = [r for r in stored if isinstance(r, BaseException)]
            if failed:
                if not (self._stopping and all(isinstance(e, asyncio.CancelledError) for e in failed)):
                    logger.warning(f"publishing the server record failed: {type(failed[0]).__name__}: {failed[0]}")
                return False
            ok = all(stored)
        if not ok:
            logger.warning("the DHT did not store our server record: no reachable peers, or peers of a version that "
                           "refuses it (a field's type changed; added fields are accepted both ways)")
        return bool(ok)

    async def _publish_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=self.refresh_s)
            if not self._stopping:
                await self.publish()

    async def _rejoin_loop(self) -> None:
        while not self._stopping:
            await self._rejoin()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.rejoin_s)

    async def _rejoin(self) -> None:
        """Re-bootstrap to the initial peers our DHT node has dropped, then re-announce at once."""
        try:
            timeout_s = max(1.0, self.rejoin_s)
            back = await asyncio.wait_for(self.sd.arejoin(self.initial_peer_ids, timeout_s=timeout_s),
                                          2 * timeout_s + 5.0)
        except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the server
            logger.warning(f"re-bootstrapping to the initial peers failed: {e}")
            return
        if back:
            self.rejoins += 1
            logger.info(f"initial peer(s) {', '.join(p[:12] for p in back)} answer again: re-announcing our record")
            self.mark_dirty()
