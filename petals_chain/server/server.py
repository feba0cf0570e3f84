"""The volunteer server: join the DHT, announce ``M_j`` and ``tau_p``, follow the orchestrator's signed
assignment, hold exactly the assigned blocks with ``floor((M_j - s_m m_j) / s_c)`` KV slots (Eq. 3) and
serve sessions over :mod:`petals_chain.swarm.rpc`.

States (published in the server record): ``joining`` (no blocks loaded: waiting for or loading an
assignment) -> ``online`` (serving) -> ``draining`` (no new sessions; open ones finish) -> ``offline``.
A new assignment epoch with a different span (or ``max_length``) drains and reloads; the same span never
reloads. SIGINT/SIGTERM drain, announce ``offline`` and stop the DHT (and its p2pd) before exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from petals_chain.swarm.dht import SwarmDHT, peer_ids_from_maddrs
from petals_chain.swarm.emulation import Emulation
from petals_chain.swarm.keys import check_prefix, default_dht_prefix
from petals_chain.swarm.records import AssignmentRecord, ServerRecord
from petals_chain.swarm.rpc import PetalsChainBlocks, RefusedError

logger = logging.getLogger("petals_chain.server")

CPU_MEMORY_FRACTION = 0.5  # default M_j on CPU: half of the RAM available at start
CUDA_HEADROOM_FRACTION = 0.05  # default M_j on CUDA: free memory minus max(1 GiB, 5 %) for activations
CUDA_HEADROOM_MIN_BYTES = 1 << 30


@dataclass
class ServerConfig:
    """Everything the command line sets (see ``python -m petals_chain.server --help``)."""

    model: str
    initial_peers: Sequence[str] = ()
    dht_prefix: Optional[str] = None
    memory_bytes: Optional[int] = None
    device: str = "cpu"
    dtype: str = "auto"
    quant: str = "none"
    public_name: str = ""
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    identity_path: Optional[str] = None
    client_mode: bool = False
    emulate_rtt_ms: float = 0.0
    emulate_compute_scale: float = 1.0
    max_length: Optional[int] = None  # None: the assignment's max_length (DEFAULT_MAX_LENGTH until one arrives)
    max_blocks: int = 0  # the volunteer's cap on hosted blocks (0: as many as the memory budget allows)
    trust_orchestrator: Sequence[str] = ()  # empty: the peer ids named in initial_peers
    allow_any_client: bool = False
    tau_p: Optional[float] = None  # None: measure (cached); else use this value (s/block/job, unscaled)
    profile_l_in: int = 128
    profile_l_out: int = 16
    profile_cache: Optional[str] = None
    refresh_s: float = 30.0
    assignment_poll_s: float = 3.0
    idle_timeout_s: float = 120.0
    drain_timeout_s: float = 60.0
    progress: Optional[bool] = None
    # Testbed emulation of the footnote-11 compute model (sleeps after the real compute, per step):
    emulate_step_ms: float = 0.0  # t_o, ms per block, once per session (its first step)
    emulate_prefill_ms_per_token: float = 0.0  # t_I, ms per block per token of a multi-token step
    emulate_decode_ms: float = 0.0  # t_O, ms per block per token of a one-token step
    cache_tokens_per_block: int = 0  # > 0: PETALS-style fixed cache, at most this many tokens per block
    batching: bool = True  # run concurrent sessions' steps together (one forward per block); False: one at a time
    max_waiters: int = 256  # opens waiting for slots (wait_s > 0), FIFO
    max_wait_s: float = 600.0


DEFAULT_MAX_LENGTH = 2048
INLINE_MAX_TOKENS = 8  # steps with at most this many tokens run inline (see Server.forward)


def default_memory_bytes(device: str) -> int:
    """``M_j`` when the volunteer gives no limit: see CPU_MEMORY_FRACTION / CUDA_HEADROOM_* above."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return max(0, int(free - max(CUDA_HEADROOM_MIN_BYTES, CUDA_HEADROOM_FRACTION * free)))
    import psutil

    return int(psutil.virtual_memory().available * CPU_MEMORY_FRACTION)


class JoinError(RuntimeError):
    """The DHT could not be started or joined (nothing else was started)."""


class Server:
    """One volunteer server process (``asyncio.run(Server(cfg).run())``); also the RPC session backend."""

    def __init__(self, cfg: ServerConfig):
        from petals_chain.swarm.checkpoint import QUANT_MODES, load_config, parse_dtype
        from petals_chain.swarm.sources import check_family, resolve_source

        self.cfg = cfg
        if cfg.quant not in QUANT_MODES:
            raise ValueError(f"--quant must be one of {QUANT_MODES}, got {cfg.quant!r}")
        if isinstance(cfg.max_blocks, bool) or not isinstance(cfg.max_blocks, int) or cfg.max_blocks < 0:
            raise ValueError(f"--max-blocks must be a non-negative integer, got {cfg.max_blocks!r}")
        self.emulation = Emulation(cfg.emulate_rtt_ms, cfg.emulate_compute_scale)
        self.source = resolve_source(cfg.model)
        self.model_path = self.source.path
        self.config = load_config(self.source)
        check_family(self.config)
        self.model_fingerprint = self.source.fingerprint
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.torch_dtype = parse_dtype(cfg.dtype, self.config)
        self.dtype_name = str(self.torch_dtype).replace("torch.", "")
        self.prefix = check_prefix(cfg.dht_prefix) if cfg.dht_prefix else default_dht_prefix(self.source.name)
        if cfg.max_length is not None and cfg.max_length < 1:
            raise ValueError("--max-length must be >= 1")
        self._initial_peer_ids = peer_ids_from_maddrs(cfg.initial_peers)
        self.trusted: set[str] = set(cfg.trust_orchestrator) or set(self._initial_peer_ids)
        if not self.trusted and not cfg.allow_any_client:
            logger.warning("no trusted orchestrator (no --trust-orchestrator, no /p2p/ id in --initial-peers): "
                           "this server will never receive an assignment")

        self.state = "joining"
        self.epoch = -1
        self.assignment_timestamp = 0.0
        self._applied_content: tuple = ()
        self.rejoins = 0  # times a lost initial peer (the orchestrator) answered again and we re-announced
        self.span: Optional[tuple[int, int]] = None
        self.max_length = cfg.max_length or DEFAULT_MAX_LENGTH
        self.runner = None
        self.memory_bytes = 0
        self.tau_p = 0.0
        self.s_m = 0
        self.sessions: dict[str, dict[str, Any]] = {}  # session_id -> {runner, max_length, peer}
        self.reloads = 0
        self.sd: Optional[SwarmDHT] = None
        self.p2p = None
        self._stop = asyncio.Event()
        self._force_stop = False
        self._sessions_changed = asyncio.Event()
        self._record_dirty = asyncio.Event()
        for knob in ("emulate_step_ms", "emulate_prefill_ms_per_token", "emulate_decode_ms"):
            v = getattr(cfg, knob)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"--{knob.replace('_', '-')} must be finite and >= 0, got {v}")
        if cfg.cache_tokens_per_block < 0:
            raise ValueError("--cache-tokens-per-block must be >= 0")
        from petals_chain.server.admission import SlotWaitQueue
        from petals_chain.server.runner import NoCapacityError

        self.admission = SlotWaitQueue(NoCapacityError, max_waiters=cfg.max_waiters, max_wait_s=cfg.max_wait_s)

    # ------------------------------------------------------------------ memory model

    def s_c(self, max_length: int) -> int:
        from petals_chain.swarm.memory import cache_slot_bytes

        return cache_slot_bytes(self.config, self.torch_dtype, max_length)

    def slots_for(self, num_blocks: int, max_length: int) -> int:
        """Eq. 3: ``floor((M_j - s_m m_j) / s_c)``."""
        from petals_chain.swarm.memory import slots_for_budget

        slots = slots_for_budget(self.memory_bytes, num_blocks, self.s_m, self.s_c(max_length))
        if self.cfg.cache_tokens_per_block > 0:  # PETALS' fixed attention cache, in slots of max_length tokens
            slots = min(slots, num_blocks * self.cfg.cache_tokens_per_block // max_length)
        return slots

    # ------------------------------------------------------------------ record

    def record(self) -> ServerRecord:
        runner = self.runner
        start, num = self.span if (self.span and runner is not None) else (0, 0)
        return ServerRecord(
            peer_id=self.sd.peer_id, state=self.state, memory_bytes=int(self.memory_bytes),
            tau_p=float(self.emulation.scaled_tau_p(self.tau_p)), device=self.cfg.device, dtype=self.dtype_name,
            quant=self.cfg.quant, start_block=int(start), num_blocks=int(num),
            slots_total=int(runner.slots_total) if runner is not None else 0,
            slots_free=int(runner.slots_free) if runner is not None else 0,
            public_name=self.cfg.public_name[:128], max_length=int(self.max_length), s_m_bytes=int(self.s_m),
            s_c_bytes=int(self.s_c(self.max_length)), emulate_rtt_ms=float(self.cfg.emulate_rtt_ms),
            emulate_compute_scale=float(self.cfg.emulate_compute_scale), epoch=int(self.epoch),
            model_fingerprint=self.model_fingerprint, max_blocks=int(self.cfg.max_blocks), timestamp=time.time(),
        )

    async def publish(self, expiration_s: Optional[float] = None) -> bool:
        expiration_s = expiration_s or max(3 * self.cfg.refresh_s, 10.0)
        try:
            ok = await self.sd.apublish_server(self.prefix, self.record(), expiration_s)
        except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the server
            logger.warning(f"publishing the server record failed: {e}")
            return False
        if not ok:
            logger.warning("the DHT did not store our server record (no reachable peers?)")
        return bool(ok)

    def set_state(self, state: str) -> None:
        if state != self.state:
            logger.info(f"state: {self.state} -> {state}")
            self.state = state
        self._record_dirty.set()

    # ------------------------------------------------------------------ session backend (rpc.SessionBackend)

    def authorize(self, peer_id: str) -> bool:
        return self.cfg.allow_any_client or peer_id in self.trusted

    def _check_open(self, session_id: str, max_length: int):
        runner = self.runner
        if self.state != "online" or runner is None:
            raise RefusedError("unavailable", f"server is {self.state}, not accepting sessions")
        if max_length > runner.max_length:
            raise RefusedError("invalid", f"max_length {max_length} exceeds this server's {runner.max_length}")
        if session_id in self.sessions:
            raise RefusedError("invalid", f"session {session_id!r} is already open")
        return runner

    def _allocate(self, session_id: str, start_block: int, end_block: int, max_length: int, peer_id: str,
                  fork_from: Optional[str] = None, fork_length: int = 0) -> dict:
        """Check and allocate; raises the runner's NoCapacityError when the slots are not free (yet).

        ``fork_from``: an open session of the same peer and span whose first ``fork_length`` tokens of KV the
        new session starts with (``n > 1`` samples of one prompt share its prefill)."""
        runner = self._check_open(session_id, max_length)
        try:
            if fork_from is None:
                runner.allocate(session_id, start_block, end_block)
            else:
                src = self.sessions.get(fork_from)
                if src is None or src["peer"] != peer_id or src["span"] != (start_block, end_block):
                    raise ValueError(f"cannot fork {fork_from!r}: no open session of this peer over blocks "
                                     f"[{start_block}, {end_block})")
                runner.fork(fork_from, session_id, fork_length)
        except (ValueError, KeyError) as e:
            raise RefusedError("invalid", str(e)) from None
        self.sessions[session_id] = {"runner": runner, "max_length": max_length, "peer": peer_id, "steps": 0,
                                     "span": (start_block, end_block)}
        self._record_dirty.set()
        return {"slots_free": runner.slots_free, "start_block": start_block, "end_block": end_block}

    def _no_capacity(self, e: Exception, start_block: int, end_block: int) -> RefusedError:
        runner = self.runner
        free, total = (runner.slots_free, runner.slots_total) if runner is not None else (0, 0)
        return RefusedError("no_capacity", f"no capacity: {e} (slots free {free} of {total}, "
                                           f"need {end_block - start_block})")

    def open_session(self, session_id: str, start_block: int, end_block: int, max_length: int, peer_id: str,
                     fork_from: Optional[str] = None, fork_length: int = 0) -> dict:
        from petals_chain.server.runner import NoCapacityError

        self._check_open(session_id, max_length)
        if len(self.admission):  # opens waiting for slots are served first (FIFO)
            raise RefusedError("no_capacity", f"no capacity: {len(self.admission)} opens wait for slots")
        try:
            return self._allocate(session_id, start_block, end_block, max_length, peer_id, fork_from, fork_length)
        except NoCapacityError as e:
            raise self._no_capacity(e, start_block, end_block) from None

    async def open_session_wait(self, session_id: str, start_block: int, end_block: int, max_length: int,
                                peer_id: str, wait_s: float) -> dict:
        """Like open_session, but wait up to ``wait_s`` seconds (FIFO with other waiters) for free slots."""
        from petals_chain.server.admission import WaitRefused
        from petals_chain.server.runner import NoCapacityError

        runner = self._check_open(session_id, max_length)
        if end_block - start_block > runner.slots_total:
            raise RefusedError("no_capacity", f"no capacity: {end_block - start_block} slots needed, the server has "
                                              f"{runner.slots_total} in all")
        try:
            return await self.admission.acquire(
                lambda: self._allocate(session_id, start_block, end_block, max_length, peer_id), wait_s,
                release=lambda _result: self.close_session(session_id))
        except NoCapacityError as e:
            raise self._no_capacity(e, start_block, end_block) from None
        except WaitRefused as e:
            raise RefusedError("no_capacity", f"no capacity: {e}") from None

    async def _emulate_compute(self, sess: dict, n_blocks: int, n_tokens: int) -> None:
        cfg = self.cfg
        ms = cfg.emulate_step_ms if sess.get("steps", 0) == 0 else 0.0
        ms += (cfg.emulate_prefill_ms_per_token if n_tokens > 1 else cfg.emulate_decode_ms) * n_tokens
        sess["steps"] = sess.get("steps", 0) + 1
        if ms > 0:
            await asyncio.sleep(ms * n_blocks / 1000.0)

    async def forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out = await self._forward(session_id, hidden, position)
        sess = self.sessions.get(session_id)
        if sess is not None:
            start, end = sess["span"]
            await self._emulate_compute(sess, end - start, int(hidden.shape[1]))
        return out

    async def _forward(self, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        sess = self.sessions.get(session_id)
        if sess is None:
            raise RefusedError("invalid", f"unknown session {session_id!r}")
        if position + hidden.shape[1] > sess["max_length"]:
            raise RefusedError("invalid", f"positions {position}..{position + hidden.shape[1] - 1} exceed the "
                                          f"session's max_length {sess['max_length']}")
        runner = sess["runner"]
        try:
            # The runner's batch scheduler runs concurrent sessions' steps in one forward per block (issue 7);
            # a lone short step runs inline (a thread hand-off costs ~1.5 ms here) and longer work runs off the
            # event loop, so pings and other streams stay responsive.
            return await runner.forward_async(session_id, hidden, position, inline_max_tokens=INLINE_MAX_TOKENS)
        except (ValueError, KeyError) as e:
            raise RefusedError("invalid", str(e)) from None

    def close_session(self, session_id: str) -> None:
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            sess["runner"].release(session_id)
            self._sessions_changed.set()
            self._record_dirty.set()
            self.admission.notify()

    def info(self) -> dict:
        runner = self.runner
        return {
            "peer_id": self.sd.peer_id if self.sd else "", "public_name": self.cfg.public_name, "state": self.state,
            "epoch": self.epoch, "span": list(self.span) if (self.span and runner) else None,
            "slots_total": runner.slots_total if runner else 0, "slots_free": runner.slots_free if runner else 0,
            "sessions": len(self.sessions), "max_length": self.max_length, "hidden_size": self.hidden_size,
            "tau_p": self.emulation.scaled_tau_p(self.tau_p), "memory_bytes": self.memory_bytes, "s_m_bytes": self.s_m,
            "s_c_bytes": self.s_c(self.max_length), "dtype": self.dtype_name, "device": self.cfg.device,
            "quant": self.cfg.quant, "emulate_rtt_ms": self.cfg.emulate_rtt_ms,
            "emulate_compute_scale": self.cfg.emulate_compute_scale, "reloads": self.reloads,
            "emulate_step_ms": self.cfg.emulate_step_ms,
            "emulate_prefill_ms_per_token": self.cfg.emulate_prefill_ms_per_token,
            "emulate_decode_ms": self.cfg.emulate_decode_ms, "cache_tokens_per_block": self.cfg.cache_tokens_per_block,
            "batching": self.cfg.batching, "rejoins": self.rejoins,
            "admission": self.admission.stats(),
        }

    # ------------------------------------------------------------------ assignment

    def _on_signal(self) -> None:
        if self._stop.is_set():
            logger.warning("second signal: not waiting for open sessions")
            self._force_stop = True
            self._sessions_changed.set()
        self._stop.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new sessions, wait up to ``timeout_s`` for open ones to close, then release the rest."""
        self.set_state("draining")
        self.admission.fail_all(lambda: RefusedError("unavailable", "server is draining, not accepting sessions"))
        await self.publish()
        deadline = time.monotonic() + timeout_s
        while self.sessions and time.monotonic() < deadline and not self._force_stop:
            self._sessions_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._sessions_changed.wait(), timeout=min(1.0, deadline - time.monotonic()))
        if self.sessions:
            logger.warning(f"drain timeout: releasing {len(self.sessions)} open session(s)")
            for sid in list(self.sessions):
                self.close_session(sid)

    @staticmethod
    def _assignment_content(asg: AssignmentRecord) -> tuple:
        return asg.max_length, tuple(sorted((k, tuple(v)) for k, v in asg.assignments.items()))

    def is_new_assignment(self, asg: AssignmentRecord) -> bool:
        """A higher epoch; or, published later than the one we follow, a lower epoch or the same epoch with other
        spans (a restarted orchestrator counts its epochs anew from 1)."""
        if asg.epoch > self.epoch:
            return True
        if asg.timestamp <= self.assignment_timestamp:
            return False
        return asg.epoch < self.epoch or self._assignment_content(asg) != self._applied_content

    async def apply_assignment(self, asg: AssignmentRecord) -> None:
        """Follow a (new-epoch) assignment: reload only if our span or max_length changes."""
        if not self.is_new_assignment(asg):
            return
        if asg.model_fingerprint and asg.model_fingerprint != self.model_fingerprint:
            if asg.timestamp > self.assignment_timestamp:
                self.assignment_timestamp = asg.timestamp
                logger.error(f"the orchestrator serves model {asg.model_fingerprint}, this server holds "
                             f"{self.model_fingerprint} ({self.source.path}): not following its assignment")
            return
        span = asg.span_of(self.sd.peer_id)
        max_length = self.cfg.max_length or asg.max_length
        logger.info(f"assignment epoch {asg.epoch}: span {span}, max_length {max_length}")
        self.epoch = asg.epoch
        self.assignment_timestamp = asg.timestamp
        self._applied_content = self._assignment_content(asg)
        if span == self.span and max_length == self.max_length and (self.runner is not None or span is None):
            logger.info("same span and max_length: keeping the loaded blocks (no reload)")
            self._record_dirty.set()
            return
        if span is not None:
            start, num = span
            if start + num > self.num_layers:
                logger.error(f"assignment {span} is outside the model's {self.num_layers} blocks; ignoring it")
                return
            if self.cfg.max_blocks and num > self.cfg.max_blocks:
                logger.error(f"assignment of {num} blocks exceeds --max-blocks {self.cfg.max_blocks}; ignoring it")
                return
        if self.runner is not None:
            await self.drain(self.cfg.drain_timeout_s)
            self.runner.close()
            self.runner = None
            self.span = None
            if self.torch_device.type == "cuda":
                torch.cuda.empty_cache()
        self.max_length = max_length
        self.set_state("joining")
        if span is None:
            await self.publish()
            return
        start, num = span
        slots = self.slots_for(num, max_length)
        if self.s_m * num > self.memory_bytes or slots < 1:
            logger.error(f"assignment of {num} blocks leaves {slots} cache slots in M_j={self.memory_bytes} bytes "
                         f"(s_m={self.s_m}, s_c={self.s_c(max_length)}); not loading it")
            await self.publish()
            return
        await self.publish()
        logger.info(f"loading blocks [{start}, {start + num}) with {slots} cache slots (max_length {max_length})")
        from petals_chain.server.runner import BlockRunner

        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            runner = await loop.run_in_executor(None, lambda: BlockRunner(
                self.source, start, num, num_slots=slots, max_length=max_length, dtype=self.torch_dtype,
                device=self.cfg.device, quant=self.cfg.quant, compute_scale=self.cfg.emulate_compute_scale,
                config=self.config, progress=self.cfg.progress, batching=self.cfg.batching))
        except Exception:
            logger.exception("loading the assigned blocks failed")
            await self.publish()
            return
        self.runner, self.span = runner, (start, num)
        self.reloads += 1
        logger.info(f"loaded blocks [{start}, {start + num}) in {time.perf_counter() - t0:.1f} s; "
                    f"{runner.slots_total} slots")
        self.set_state("online")
        await self.publish()

    # ------------------------------------------------------------------ main

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.cfg.device)

    def measure_tau_p(self) -> float:
        """Unscaled tau_p (s/block/job): --tau-p, else the runtime profiler's cached footnote-11 measurement."""
        if self.cfg.tau_p is not None:
            return float(self.cfg.tau_p)
        from petals_chain.server.profiling import measure_tau_p

        # Measured at compute_scale 1 (no emulation sleeps); the emulated scale multiplies it in record().
        return measure_tau_p(self.model_path, self.cfg.profile_l_in, self.cfg.profile_l_out, dtype=self.torch_dtype,
                             device=self.cfg.device, quant=self.cfg.quant, cache_path=self.cfg.profile_cache,
                             progress=self.cfg.progress)

    async def run(self) -> int:
        from petals_chain.swarm.memory import block_bytes

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        # The DHT forks its process: start it before touching CUDA.
        try:
            self.sd = await loop.run_in_executor(None, lambda: SwarmDHT.create(
                initial_peers=list(self.cfg.initial_peers), host_maddrs=list(self.cfg.host_maddrs),
                identity_path=self.cfg.identity_path, client_mode=self.cfg.client_mode, prefix=self.prefix))
        except Exception as e:  # noqa: BLE001 - unreachable peers, bad multiaddrs, identity in use, ...
            raise JoinError(f"cannot join the swarm via {list(self.cfg.initial_peers)}: {e}") from e
        handler = None
        try:
            self.p2p = await self.sd.replicate_p2p()
            handler = PetalsChainBlocks(self, emulation=self.emulation, idle_timeout_s=self.cfg.idle_timeout_s)
            await handler.add_p2p_handlers(self.p2p)
            maddrs = self.sd.visible_maddrs()
            logger.info(f"peer id {self.sd.peer_id}; multiaddrs: {' '.join(maddrs)}")
            print(f"PEER_ID {self.sd.peer_id}", flush=True)

            self.memory_bytes = int(self.cfg.memory_bytes if self.cfg.memory_bytes is not None
                                    else default_memory_bytes(self.cfg.device))
            self.s_m = block_bytes(self.config, self.torch_dtype, self.cfg.quant)
            logger.info(f"M_j = {self.memory_bytes} bytes, s_m = {self.s_m}, s_c = {self.s_c(self.max_length)} "
                        f"(max_length {self.max_length})")
            await self.publish()  # joining, tau_p not measured yet
            self.tau_p = await loop.run_in_executor(None, self.measure_tau_p)
            logger.info(f"tau_p = {self.tau_p * 1e3:.3f} ms/block/job (x{self.cfg.emulate_compute_scale} emulated)")
            await self.publish()
            await self._main_loop()
        finally:
            await self._shutdown(handler)
        return 0

    async def _main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self.cfg.refresh_s
        next_poll = loop.time()
        while not self._stop.is_set():
            now = loop.time()
            if now >= next_poll:
                next_poll = now + self.cfg.assignment_poll_s
                await self._rejoin()
                try:
                    asg = await self.sd.afetch_assignment(self.prefix, sorted(self.trusted))
                except Exception as e:  # noqa: BLE001
                    logger.warning(f"fetching the assignment failed: {e}")
                    asg = None
                if asg is not None and self.is_new_assignment(asg):
                    await self.apply_assignment(asg)
            if now >= next_refresh or self._record_dirty.is_set():
                self._record_dirty.clear()
                next_refresh = now + self.cfg.refresh_s
                await self.publish()
            timeout = max(0.05, min(next_poll, next_refresh) - loop.time())
            waiters = [asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(self._record_dirty.wait())]
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    async def _rejoin(self) -> None:
        """Re-bootstrap to the initial peers our DHT node has dropped, then re-announce at once.

        hivemind drops a peer from the routing table after one failed RPC and never pings its initial peers
        again; an orchestrator restarted with the same identity and address (an empty DHT of its own) would
        never see our record otherwise (see :meth:`SwarmDHT.arejoin`)."""
        try:
            timeout_s = max(1.0, self.cfg.assignment_poll_s)
            back = await asyncio.wait_for(self.sd.arejoin(self._initial_peer_ids, timeout_s=timeout_s),
                                          2 * timeout_s + 5.0)
        except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the server
            logger.warning(f"re-bootstrapping to the initial peers failed: {e}")
            return
        if back:
            self.rejoins += 1
            logger.info(f"initial peer(s) {', '.join(p[:12] for p in back)} answer again: re-announcing our record")
            self._record_dirty.set()

    async def _shutdown(self, handler) -> None:
        logger.info("shutting down")
        try:
            if self.sd is not None and self.p2p is not None:
                if self.runner is not None:
                    await self.drain(self.cfg.drain_timeout_s)
                    self.runner.close()
                self.set_state("offline")
                await self.publish(expiration_s=max(3 * self.cfg.refresh_s, 10.0))
        except Exception:  # noqa: BLE001
            logger.exception("announcing offline failed")
        if handler is not None and self.p2p is not None:
            with contextlib.suppress(Exception):
                await handler.remove_p2p_handlers(self.p2p)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
        if self.sd is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.sd.shutdown)
        logger.info("stopped")
