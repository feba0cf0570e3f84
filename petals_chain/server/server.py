"""The volunteer server's lifecycle: join the DHT, measure ``tau_p``, follow the orchestrator's signed
assignment (load exactly the assigned blocks with ``floor((M_j - s_m m_j) / s_c)`` KV slots, Eq. 3), drain
and shut down. The parts it composes, one concern each:

* :mod:`~petals_chain.server.sessions` -- serving sessions (the RPC backend: open/step/close/fork, admission);
* :mod:`~petals_chain.server.memory` -- ``M_j``, ``s_m``, ``s_c`` and slots (Eq. 3);
* :mod:`~petals_chain.server.announce` -- the signed record, republished on a timer in every state, and
  rejoining lost initial peers;
* :mod:`~petals_chain.server.emulated` -- testbed emulation, wrapped around the runner and the session
  backend only when a knob is set.

States (published in the server record): ``joining`` (no blocks loaded: profiling, waiting for or loading an
assignment) -> ``online`` (serving) -> ``draining`` (no new sessions; open ones finish) -> ``offline``.
A new assignment epoch with a different span (or ``max_length``) drains and reloads; the same span never
reloads. SIGINT/SIGTERM drain, announce ``offline`` and stop the DHT (and its p2pd) before exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import time
from typing import Any, Optional

import torch

from petals_chain.server import emulated
from petals_chain.server.announce import Announcer, announced_capacity, build_record
from petals_chain.server.config import DEFAULT_MAX_LENGTH, ServerConfig
from petals_chain.server.decode_graph import check_decode_graph
from petals_chain.server.memory import CPU_MEMORY_FRACTION, default_memory_bytes
from petals_chain.server.models import HostedModel, StandbyView, attach_adapters, load_hosted
from petals_chain.server.runner import sliding_window
from petals_chain.server.sessions import SessionService
from petals_chain.swarm import reachability
from petals_chain.swarm.aio import quiet_peer_disconnects
from petals_chain.swarm.console import say
from petals_chain.swarm.dht import SwarmDHT, check_identity_path, is_peer_id, peer_ids_from_maddrs
from petals_chain.swarm.memory import block_bytes, slots_for_budget
from petals_chain.swarm.records import AssignmentRecord, PlacementRecord, ServerRecord
from petals_chain.swarm.rpc import PetalsChainBlocks
from petals_chain.swarm.sources import fingerprint_problem

__all__ = ["Server", "ServerConfig", "JoinError", "DEFAULT_MAX_LENGTH", "CPU_MEMORY_FRACTION",
           "default_memory_bytes"]

logger = logging.getLogger("petals_chain.server")


class JoinError(RuntimeError):
    """The DHT could not be started or joined (nothing else was started)."""


UNASSIGNED_WARN_S = 120.0  # a server with no span this long says why it may be ...
UNASSIGNED_REPEAT_S = 600.0  # ... and again this often
OFFLINE_STORE_S = 5.0  # one attempt to store the offline record at a leave
ORPHAN_SWITCH_S = 30.0  # a server of several models with no orchestrator for the one it serves moves on after this
MIN_SWARM_MAX_LENGTH = 2  # the shortest max_length an orchestrator takes (its --max-length check)


def _gib_at_least(n: int) -> str:
    """``n`` bytes in GiB, three significant digits, rounded up (a value to give ``--memory-gb``)."""
    x = n / 2**30
    q = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / q) * q:.3g}"


def assignment_news(epoch: int, held: Optional[tuple[int, int]], held_length: int,
                    span: Optional[tuple[int, int]], max_length: int) -> str:
    """What a new assignment means for the volunteer, in blocks ``[first, end)``: which it is to serve, or that it is
    moved (and what a move costs) or left out. Spans are ``(start_block, num_blocks)``; ``held`` the loaded one.
    ("assignment epoch 7: span (10, 5)" read as blocks 10 to 5, and said nothing of the blocks it left.)"""
    def blocks(s: tuple[int, int]) -> str:
        return f"blocks [{s[0]}, {s[0] + s[1]}) ({s[1]} of them)"

    plan = f"the orchestrator's plan (epoch {epoch})"
    if span is None:
        return (f"{plan} gives this server no blocks: unloading {blocks(held)} (the planner needs them elsewhere or "
                f"not at all)" if held is not None else f"{plan} gives this server no blocks yet")
    if held is None:
        return f"{plan} assigns this server {blocks(span)}, sessions of up to {max_length} tokens"
    if tuple(held) == tuple(span) and held_length == max_length:
        return f"{plan} keeps this server on {blocks(span)}"
    change = (f"moves this server from {blocks(held)} to {blocks(span)}" if tuple(held) != tuple(span)
              else f"keeps this server on {blocks(span)}")
    if held_length != max_length:
        change += f" with sessions of up to {max_length} tokens instead of {held_length}"
    return f"{plan} {change} (it re-planned the swarm): draining open sessions, then reloading"


def _longest_session(config: Any) -> Optional[tuple[int, str]]:
    """The most tokens a session of a model may hold, and what sets it (its positions, or a sliding window the
    runner refuses to exceed: a Mistral with a 4096-token window passed the position check and failed at load or
    when profiling); None if the config says neither."""
    limits = []
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and not isinstance(max_pos, bool):
        limits.append((max_pos, "max_position_embeddings"))
    window = sliding_window(config)
    if window is not None:
        limits.append((window, "sliding_window"))
    return min(limits) if limits else None


class Server:
    """One volunteer server process: ``asyncio.run(Server(cfg).run())``."""

    def __init__(self, cfg: ServerConfig, *, memory_flag: str = "--memory-bytes"):
        """ValueError naming the option when a value cannot work (checked here, before anything starts).
        ``memory_flag``: the option ``cfg.memory_bytes`` came from (``--memory-gb`` or ``--memory-bytes``)."""
        from petals_chain.swarm.checkpoint import QUANT_MODES

        self.cfg = cfg
        # this server's start, in every record it announces (ServerRecord.started_at): each Server of a process that
        # runs several (tests, one host) restarts on its own
        self.started_at = time.time()
        cfg.validate()
        if cfg.quant not in QUANT_MODES:
            raise ValueError(f"--quant must be one of {QUANT_MODES}, got {cfg.quant!r}")
        for flag, value, least in (("--max-blocks", cfg.max_blocks, 0), ("--max-waiters", cfg.max_waiters, 0),
                                   ("--cache-tokens-per-block", cfg.cache_tokens_per_block, 0),
                                   ("--max-length", 1 if cfg.max_length is None else cfg.max_length, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{flag} must be an integer >= {least}, got {value!r}")
        for peer_id in cfg.trust_orchestrator:
            if not is_peer_id(str(peer_id)):
                hint = (" (only the part after /p2p/ of a multiaddr)" if "/p2p/" in str(peer_id) else
                        " (the base58 id, Qm..., an orchestrator prints at start)")
                raise ValueError(f"--trust-orchestrator {peer_id!r} is not a libp2p peer id: give a peer id{hint}")
        check_decode_graph(cfg.decode_graph, cfg.device, cfg.quant)
        try:
            self.emulation = cfg.emulation()
        except ValueError as e:  # it names its fields (emulate_rtt_ms); the volunteer typed the flag
            raise ValueError(re.sub(r"^emulate_(\w+)", lambda m: "--emulate-" + m.group(1).replace("_", "-"),
                                    str(e))) from None
        # every model the volunteer offers (server/models.py); the blocks served are of ``self.active``
        self.hosted = load_hosted([cfg.model, *cfg.extra_models], dht_prefix=cfg.dht_prefix, dtype=cfg.dtype,
                                  quant=cfg.quant, cache_tokens_per_block=cfg.cache_tokens_per_block,
                                  kv_cache=cfg.kv_cache, page_size=cfg.page_size)
        attach_adapters(self.hosted, cfg.adapters)
        for hosted in self.hosted:
            limit = _longest_session(hosted.config)
            if limit is None:
                continue
            if cfg.max_length is not None and cfg.max_length > limit[0]:
                raise ValueError(f"--max-length {cfg.max_length} exceeds {limit[1]} {limit[0]} of model "
                                 f"{hosted.spec!r}")
            profiled = cfg.profile_l_in + cfg.profile_l_out
            if cfg.tau_p is None and profiled > limit[0]:
                # else the server joined, announced itself and exited with a traceback when it profiled
                raise ValueError(f"--profile-l-in {cfg.profile_l_in} + --profile-l-out {cfg.profile_l_out} exceeds "
                                 f"{limit[1]} {limit[0]} of model {hosted.spec!r} (or give --tau-p)")
        if cfg.memory_bytes is not None:
            self.hosted = self._models_the_budget_holds(memory_flag)
        self.active = self.hosted[0]
        if cfg.identity_path is not None:  # last: it may make the key's directory, which a bad flag above would not
            # a quoted or --identity-path=~/x path comes with its ~ (a directory named ~ was made in the cwd)
            cfg.identity_path = os.path.expanduser(str(cfg.identity_path))
            check_identity_path(cfg.identity_path)
        self.placement_timestamp = 0.0  # of the placement record followed last
        self.switches = 0  # times the server was placed on another of its models
        self._misplaced: set[str] = set()  # placements naming a model we do not offer (said once each)
        self._initial_peer_ids = peer_ids_from_maddrs(cfg.initial_peers)
        self.trusted: set[str] = set(cfg.trust_orchestrator) or set(self._initial_peer_ids)

        self.state = "joining"
        self.epoch = -1
        self.assignment_timestamp = 0.0
        self._applied_content: tuple = ()
        # an assignment whose load failed: (its content, when it may be tried again); consecutive failures
        self._failed_load: Optional[tuple[tuple, float]] = None
        self._failed_loads = 0
        # the assigned span not loaded and why, announced (ServerRecord.failed_span, load_error) until a load succeeds:
        # the orchestrator plans around this server meanwhile instead of waiting for blocks that never come
        self.load_failure: Optional[tuple[tuple[int, int], str]] = None
        self.span: Optional[tuple[int, int]] = None
        self._unassigned_since: Optional[float] = None  # monotonic time since when no span is held
        self._unassigned_said = -math.inf
        self.max_length = cfg.max_length or DEFAULT_MAX_LENGTH
        self.reloads = 0
        self.sd: Optional[SwarmDHT] = None
        self.p2p = None
        self.maddrs: list[str] = []  # where peers dial us, as the record announces (swarm/reachability.py)
        self.reachability = "unknown"
        self.announcer: Optional[Announcer] = None
        self._stop = asyncio.Event()
        self._force_stop = False
        self._make_runner = emulated.runner_class(self.emulation)
        self.service = SessionService(hidden_size=self.hidden_size, trusted=self.trusted,
                                      allow_any_client=cfg.allow_any_client, state=lambda: self.state,
                                      on_change=self._record_changed, describe=self.describe,
                                      max_waiters=cfg.max_waiters, max_wait_s=cfg.max_wait_s,
                                      stranger_shares=cfg.stranger_shares())
        self.service.model_fingerprint = self.model_fingerprint
        self.backend = emulated.session_backend(self.service, self.emulation)  # what the RPC handler serves

    def _models_the_budget_holds(self, flag: Optional[str], budget: Optional[int] = None) -> list[HostedModel]:
        """The offered models of which the memory budget holds one block and one KV slot, at ``--max-length`` or,
        without it, at the shortest a swarm may use (the swarm's own is learnt from its first assignment, and a budget
        sized for it must not be refused). A model it cannot hold is never given blocks: said, and not offered (the
        server would serve it first, idle, if it came first); none held: ValueError naming ``flag`` (None: the
        default budget ``budget``, measured at start; else ``budget`` is ``cfg.memory_bytes``)."""
        cfg, budget = self.cfg, int(self.cfg.memory_bytes if budget is None else budget)
        shown = (f"the default memory budget, {budget / 2**30:.4g} GiB ({budget} bytes) of {self.cfg.device},"
                 if flag is None else
                 f"{flag} {budget / 2**30:.4g} ({budget} bytes)" if flag == "--memory-gb" else f"{flag} {budget}")
        length = cfg.max_length or MIN_SWARM_MAX_LENGTH
        advised = cfg.max_length or DEFAULT_MAX_LENGTH  # the least that would do is said for a slot this long

        def fits(h: HostedModel, s_m: int, tokens: int) -> bool:
            return slots_for_budget(budget, 1, s_m, h.memory.s_c(tokens)) >= 1

        def least(h: HostedModel, s_m: int) -> str:
            s_c = h.memory.s_c(advised)
            return (f"{s_m + s_c} bytes (--memory-gb {_gib_at_least(s_m + s_c)}), one block ({s_m}) and one KV slot "
                    f"of {advised} tokens ({s_c})")

        held: list[HostedModel] = []
        refused: list[tuple[str, str]] = []  # (model, the least budget that holds it)
        for h in self.hosted:
            # as MemoryBudget.measure takes it
            s_m = block_bytes(h.memory.config, h.memory.dtype, h.memory.quant) + h.memory.adapter_bytes
            if not fits(h, s_m, length):
                refused.append((h.spec, least(h, s_m)))
                continue
            held.append(h)
            if cfg.max_length is None and not fits(h, s_m, DEFAULT_MAX_LENGTH):
                lo, hi = length, DEFAULT_MAX_LENGTH  # the longest slot it holds: fits(lo), not fits(hi)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(h, s_m, mid) else (lo, mid)
                logger.warning(f"{shown} holds one block of {h.spec} with a KV slot of at most {lo} tokens: an "
                               f"orchestrator whose max length is longer leaves this server out (at least "
                               f"{least(h, s_m)})")
        slot = (f"a KV slot of --max-length {cfg.max_length} tokens" if cfg.max_length is not None
                else "even the shortest KV slot")
        if not held:
            why = "" if cfg.max_length is not None else (
                f" (at the server's default max length {DEFAULT_MAX_LENGTH}; a swarm with a shorter one, given "
                "as --max-length, needs less)")
            raise ValueError(f"{shown} cannot hold one block of any model offered with {slot}; the least that would "
                             f"do{why}: {'; '.join(f'{spec}: {text}' for spec, text in refused)}")
        for spec, text in refused:
            logger.warning(f"not offering model {spec}: {shown} cannot hold one of its blocks with {slot} (it needs "
                           f"at least {text}); offering {', '.join(h.spec for h in held)}")
        return held

    @property
    def runner(self):
        """The runner being served (None while no span is loaded)."""
        return self.service.runner

    # the model being served (several: server/models.py)
    source = property(lambda self: self.active.source)
    model_path = property(lambda self: self.active.source.path)
    config = property(lambda self: self.active.config)
    model_fingerprint = property(lambda self: self.active.fingerprint)
    adapter_names = property(lambda self: self.active.adapter_names)  # {fingerprint: name}, announced
    num_layers = property(lambda self: self.active.num_layers)
    hidden_size = property(lambda self: self.active.hidden_size)
    torch_dtype = property(lambda self: self.active.torch_dtype)
    dtype_name = property(lambda self: self.active.dtype_name)
    prefix = property(lambda self: self.active.prefix)
    memory = property(lambda self: self.active.memory)
    tau_p = property(lambda self: self.active.tau_p)

    def authorize(self, peer_id: str) -> bool:
        return self.service.authorize(peer_id)

    # ------------------------------------------------------------------ state and record
    def set_state(self, state: str) -> None:
        if state != self.state:
            logger.info(f"state: {self.state} -> {state}")
            self.state = state
        self._record_changed()

    def _record_changed(self) -> None:
        if self.announcer is not None:
            self.announcer.mark_dirty()

    def _offering(self, rec: ServerRecord) -> ServerRecord:
        """``rec`` with the models this server offers and the one it serves."""
        rec.models, rec.serving = [h.prefix for h in self.hosted], self.prefix
        return rec

    def record(self) -> ServerRecord:
        return self._offering(build_record(self, self.sd.peer_id))

    def standby_records(self) -> list[tuple[str, ServerRecord]]:
        """``(prefix, record)`` of each model offered but not served: no blocks, ``serving`` names the one served."""
        out = []
        for h in self.hosted:
            if h is self.active:
                continue
            out.append((h.prefix, self._offering(build_record(
                StandbyView(h, self.max_length, self.emulation, self.cfg, self.maddrs, self.reachability,
                            started_at=self.started_at),
                self.sd.peer_id))))
        return out

    def describe(self) -> dict:
        """This server for ``info`` replies (the session service adds its sessions and admission)."""
        runner, emu, cfg = self.runner, self.emulation, self.cfg
        # as the record announces them (capped by the open-files limit): the runner's own pool is in kv_pages
        slots_total, slots_free, _, _ = announced_capacity(runner, self.service)
        return {
            "peer_id": self.sd.peer_id if self.sd else "", "public_name": cfg.public_name, "state": self.state,
            "epoch": self.epoch, "span": list(self.span) if (self.span and runner) else None,
            "slots_total": slots_total, "slots_free": slots_free,
            "max_length": self.max_length, "hidden_size": self.hidden_size,
            "tau_p": emu.announced_tau_p(self.tau_p), "memory_bytes": self.memory.memory_bytes,
            "s_m_bytes": self.memory.s_m, "s_c_bytes": self.memory.s_c(self.max_length), "dtype": self.dtype_name,
            "device": cfg.device, "quant": cfg.quant, **emu.record_fields(), "emulate_step_ms": emu.step_ms,
            "emulate_prefill_ms_per_token": emu.prefill_ms_per_token, "emulate_decode_ms": emu.decode_ms,
            "reloads": self.reloads, "cache_tokens_per_block": cfg.cache_tokens_per_block, "batching": cfg.batching,
            "kv_cache": cfg.kv_cache, "kv_pages": runner.cache_stats() if runner else None,
            # batches run, their rows, and batches that failed whole while each row passed alone (BatchScheduler)
            "batches": sched.stats() if (sched := getattr(runner, "scheduler", None)) is not None else None,
            "decode_graph": (runner.static_decode.stats() if runner is not None and runner.static_decode is not None
                             else {"mode": cfg.decode_graph}),
            "rejoins": self.announcer.rejoins if self.announcer else 0,
            "models": [h.prefix for h in self.hosted], "serving": self.prefix, "model_switches": self.switches,
            "adapters": self.active.adapter_names, "adapter_bytes": runner.adapter_bytes if runner else 0,
        }

    # ------------------------------------------------------------------ assignment
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
            if asg.timestamp > self.assignment_timestamp:  # said once per assignment, not once per poll
                self.assignment_timestamp = asg.timestamp
                problem = fingerprint_problem(asg.model_fingerprint, self.model_fingerprint,
                                              self.active.source.legacy_fingerprint, ours_is="this server's")
                logger.error(f"not following the assignment of orchestrator {asg.orchestrator_peer_id[:12]} "
                             f"({self.source.path}): {problem}")
            return
        span = asg.span_of(self.sd.peer_id)
        max_length = self.cfg.max_length or asg.max_length
        if max_length < asg.max_length and span is None and asg.timestamp > self.assignment_timestamp:
            logger.warning(f"--max-length {max_length} is below the swarm's max_length {asg.max_length}: the "
                           "orchestrator leaves this server out of its chains; restart without --max-length (or "
                           f"with {asg.max_length} or more) to serve")
        content = self._assignment_content(asg)
        failed = self._failed_load
        if failed is not None and failed[0] == content and time.monotonic() < failed[1]:
            return  # its load failed a moment ago: tried again after a backoff, not at every poll
        logger.info(assignment_news(asg.epoch, self.span, self.max_length, span, max_length))
        self.epoch = asg.epoch
        self.assignment_timestamp = asg.timestamp
        self._applied_content = content
        if self.load_failure is not None and (span is None or tuple(span) != self.load_failure[0]):
            # it failed a span this assignment does not give: announced on, it read as failing still to a planner
            # that never gave it that span (a restarted orchestrator, another group's), which then never planned it
            self._forget_load_failure()
            self._record_changed()
        if span is not None and max_length < asg.max_length:
            # slots this short serve none of the swarm's chains (the planner leaves such a server out of them): loaded,
            # they only held blocks the plan counted on
            await self._unload()
            self.set_state("joining")
            self._load_failed(content, span, f"--max-length {max_length} is below the swarm's max_length "
                                             f"{asg.max_length} (restart without --max-length, or with "
                                             f"{asg.max_length} or more)")
            return
        if span == self.span and max_length == self.max_length and (self.runner is not None or span is None):
            logger.info("same span and max_length: keeping the loaded blocks (no reload)" if span is not None
                        else "still no span assigned")
            if self.runner is not None:  # it serves this span: no failure of it stands
                self._forget_load_failure()
            self._record_changed()
            return
        if span is not None:
            start, num = span
            if start + num > self.num_layers:
                logger.error(f"assignment {span} is outside the model's {self.num_layers} blocks; ignoring it")
                return
            if self.cfg.max_blocks and num > self.cfg.max_blocks:
                logger.error(f"assignment of {num} blocks exceeds --max-blocks {self.cfg.max_blocks}; ignoring it")
                return
        await self._unload()
        if self._stop.is_set():  # stopped while draining: a load now would only delay the exit, and announce us
            return
        self.max_length = max_length
        self.set_state("joining")
        if span is None:
            return
        start, num = span
        slots = self.memory.slots_for(num, max_length)
        if not self.memory.holds(num, max_length):
            capped = (self.memory.cache_tokens_per_block > 0
                      and self.memory.slots_for(num, max_length, cap=False) > slots)
            # the cap's tokens per block that give the slots one session needs (slots mode: a slot in every block)
            least = -(-self.memory.slots_for_one_job(num) * max_length // num)
            why = (f"--cache-tokens-per-block {self.memory.cache_tokens_per_block} holds {slots} cache slots of "
                   f"{max_length} tokens in {num} blocks (raise it to at least {least})" if capped
                   else f"M_j={self.memory.memory_bytes} bytes (s_m={self.memory.s_m}, "
                        f"s_c={self.memory.s_c(max_length)})")
            self._load_failed(content, span, f"{num} blocks leave {slots} cache slots of {max_length} tokens: {why}")
            return
        logger.info(f"loading blocks [{start}, {start + num}) with {slots} cache slots (max_length {max_length})")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:  # in an executor: the event loop keeps serving pings and republishing the record meanwhile
            runner = await loop.run_in_executor(None, lambda: self._make_runner(
                self.source, start, num, num_slots=slots, max_length=max_length, dtype=self.torch_dtype,
                device=self.cfg.device, quant=self.cfg.quant, config=self.config, progress=self.cfg.progress,
                batching=self.cfg.batching, kv_cache=self.cfg.kv_cache, page_size=self.cfg.page_size,
                prefix_cache=self.cfg.prefix_cache, decode_graph=self.cfg.decode_graph,
                **({"adapters": self.active.adapters} if self.active.adapters else {})))
        except Exception as e:  # noqa: BLE001 - out of memory, unreadable weights, ...: announced, then retried
            logger.exception("loading the assigned blocks failed")
            self._load_failed(content, span, f"loading failed: {type(e).__name__}: {e}")
            return
        self._forget_load_failure()
        self.service.runner, self.span = runner, (start, num)
        self.reloads += 1
        logger.info(f"loaded blocks [{start}, {start + num}) in {time.perf_counter() - t0:.1f} s; "
                    f"{runner.slots_total} slots")
        self.set_state("online")

    def _forget_load_failure(self) -> None:
        """No failed load stands any more (a load worked, or the failure concerned another span or model): no backoff,
        nothing announced."""
        self._failed_load, self._failed_loads, self.load_failure = None, 0, None

    def _load_failed(self, content: tuple, span: Optional[tuple[int, int]] = None, why: str = "") -> None:
        """The assignment ``content`` was not loaded: follow it again when it is published again (else the server
        stayed joining, without blocks, until the orchestrator published another epoch), after a backoff (10 s,
        doubling up to 5 min). With ``span`` (ours in it), the record says which and ``why`` until a load succeeds:
        the orchestrator plans around this server (its chains waited for these blocks for ever)."""
        self._failed_loads += 1
        backoff_s = min(300.0, 10.0 * 2 ** (self._failed_loads - 1))
        self._failed_load = (content, time.monotonic() + backoff_s)
        self._applied_content, self.assignment_timestamp = (), 0.0
        if span is not None:
            why = " ".join(why.split())  # one line (a CUDA out-of-memory message has several)
            logger.error(f"cannot serve the assigned blocks [{span[0]}, {span[0] + span[1]}): {why}. Announced, so "
                         f"that the orchestrator plans around this server; tried again in "
                         f"{backoff_s:.0f} s (restart with a working configuration to join at once)")
            self.load_failure = (tuple(span), why)
            self._record_changed()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new sessions, wait up to ``timeout_s`` for open ones to close, then release the rest."""
        self.set_state("draining")
        await self.service.drain(timeout_s, forced=lambda: self._force_stop)

    async def _unload(self) -> None:
        """Drain and free the blocks being served, if any."""
        runner = self.runner
        if runner is None:
            return
        await self.drain(self.cfg.drain_timeout_s)
        runner.close()
        del runner
        self._drop_runner()

    def _drop_runner(self) -> None:
        """Drop the server's reference to its runner (closed): its blocks and KV pool are freed here (unless a step
        still runs), so the device's allocator gets them back."""
        if self.runner is None:
            return
        self.service.runner, self.span = None, None
        if torch.device(self.cfg.device).type == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - only a help to the allocator
                # a sticky CUDA error (an illegal memory access, a device-side assert) fails every later CUDA call:
                # raised here, a stop skipped the rest of its cleanup (handlers, p2pd, the DHT process) and crashed
                logger.warning(f"could not return the freed GPU memory to the device: {type(e).__name__}: "
                               f"{' '.join(str(e).split())}")

    # ------------------------------------------------------------------ main
    def measure_tau_p(self, hosted: Optional[HostedModel] = None) -> float:
        """Unscaled tau_p (s/block/job) of ``hosted`` (default: the model served): --tau-p, else the runtime
        profiler's cached footnote-11 measurement plus the emulated delays of its reference job (``--emulate-step-ms``
        and co.; a given --tau-p is taken as it is: benchmarks give one that includes them)."""
        if self.cfg.tau_p is not None:
            return float(self.cfg.tau_p)
        from petals_chain.server import profiling

        h = hosted or self.active
        # Measured on the real device (no emulation); the record shows it scaled (announce.build_record).
        measured = profiling.measure_tau_p(h.source.path, self.cfg.profile_l_in, self.cfg.profile_l_out,
                                           dtype=h.torch_dtype, device=self.cfg.device, quant=self.cfg.quant,
                                           cache_path=self.cfg.profile_cache, progress=self.cfg.progress)
        # Each emulated step waits its delay after the (scaled) compute, so a job through one block takes that much
        # longer: with --emulate-decode-ms 50 it announced 0.05 s, where one job took >= 0.75 s. The record scales
        # the result by compute_scale, which the delays are not: divided by it here.
        delay = self.emulation.reference_job_delay_s(self.cfg.profile_l_in, self.cfg.profile_l_out)
        return measured + delay / self.emulation.compute_scale

    async def run(self) -> int:
        # said here, not at construction: only a server that joins waits for assignments (one embedded in a test or a
        # tool has them applied directly, and the warning misled there)
        if not self.trusted and not self.cfg.allow_any_client:
            logger.warning("no trusted orchestrator (no --trust-orchestrator, no /p2p/ id in --initial-peers): "
                           "this server will never receive an assignment")
        loop = asyncio.get_running_loop()
        quiet_peer_disconnects(loop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        # The DHT forks its process: start it before touching CUDA.
        handler = None
        try:
            await self._join()
            handler = PetalsChainBlocks(self.backend, idle_timeout_s=self.cfg.idle_timeout_s,
                                        push_fault=emulated.push_fault_for(self.backend))
            await handler.add_p2p_handlers(self.p2p, wrapper=emulated.link_for(handler, self.emulation))
            maddrs = self.sd.visible_maddrs()
            logger.info(f"peer id {self.sd.peer_id}; multiaddrs: {' '.join(maddrs)}")
            say(f"PEER_ID {self.sd.peer_id}")  # never raises: its reader may be gone (`| head -1`)

            for h in self.hosted:
                h.memory.measure(self.cfg.memory_bytes, self.cfg.device)
                logger.info(f"{h.prefix}: M_j = {h.memory.memory_bytes} bytes, s_m = {h.memory.s_m}, "
                            f"s_c = {h.memory.s_c(self.max_length)} (max_length {self.max_length})")
            if self.cfg.memory_bytes is None and not self._default_budget_holds():
                return 2
            self.announcer = Announcer(self.sd, lambda: [(self.prefix, self.record()), *self.standby_records()],
                                       refresh_s=self.cfg.refresh_s, rejoin_s=self.cfg.assignment_poll_s,
                                       initial_peer_ids=self._initial_peer_ids)
            await self.announcer.publish()  # joining, tau_p not measured yet
            self.announcer.start()  # from here on the record is republished in every state, whatever we await
            for h in self.hosted:
                h.tau_p = await loop.run_in_executor(None, self.measure_tau_p, h)
                logger.info(f"{h.prefix}: tau_p = {h.tau_p * 1e3:.3f} ms/block/job "
                            f"(x{self.emulation.compute_scale} emulated)")
                self._record_changed()
            await self._follow_assignments()
        finally:
            await self._shutdown(handler)
        return 0

    def _default_budget_holds(self) -> bool:
        """Without ``--memory-gb``, once the default budget is measured (it touches the device, after the DHT
        forks): the models it holds, as an explicit budget is checked before joining; none: the error said, False
        (else the server joined and only warned later, vaguely, that it got no blocks)."""
        try:
            held = self._models_the_budget_holds(None, self.active.memory.memory_bytes)
        except ValueError as e:
            logger.error(str(e))
            return False
        self.hosted = held
        if self.active not in held:  # nothing loaded nor announced yet: serve the first model it holds
            self.active = held[0]
            self.service.hidden_size = self.active.hidden_size
            self.service.model_fingerprint = self.active.fingerprint
        return True

    async def _create_dht(self, relayed: bool) -> None:
        """Start our DHT node; ``relayed``: reachable only through a relay (libp2p circuit relay v2, the initial
        peers being the relays) and a DHT client, as PETALS runs servers that nobody can dial."""
        cfg = self.cfg
        kwargs: dict = (reachability.relayed_p2p_kwargs(self._relays()) if relayed
                        else {"announce_maddrs": list(cfg.announce_maddrs)} if cfg.announce_maddrs else {})
        try:
            self.sd = await asyncio.get_running_loop().run_in_executor(None, lambda: SwarmDHT.create(
                initial_peers=list(cfg.initial_peers), host_maddrs=list(cfg.host_maddrs),
                identity_path=cfg.identity_path, client_mode=cfg.client_mode or relayed, prefix=self.prefix, **kwargs))
        except Exception as e:  # noqa: BLE001 - unreachable peers, bad multiaddrs, identity in use, ...
            raise JoinError(f"cannot join the swarm via {list(cfg.initial_peers)}: {e}") from e
        self.p2p = await self.sd.replicate_p2p()

    def _relays(self) -> list[str]:
        """The trusted orchestrators' addresses among the initial peers: they relay for us if nobody can dial us."""
        return [m for m in self.cfg.initial_peers if set(peer_ids_from_maddrs([m])) & self.trusted]

    async def _dial_back(self, maddrs: list[str]) -> Optional[tuple[bool, str, str]]:
        """Ask a trusted orchestrator to dial us at ``maddrs``; None if none of them answers."""
        for orchestrator in sorted(self.trusted):
            try:
                return await reachability.ask_dial_back(self.p2p, orchestrator, maddrs)
            except ConnectionError as e:
                logger.info(f"reachability check by {orchestrator[:12]} failed: {e}")
        return None

    async def _join(self) -> None:
        """Join the swarm at an address the orchestrator can dial: our own, or else a relay circuit (--nat-relay)."""
        mode = self.cfg.nat_relay
        await self._create_dht(relayed=mode == "always")
        if mode != "always":
            visible = self.sd.visible_maddrs()
            self.maddrs = [m for m in visible if not reachability.is_loopback(m)] or visible
            answer = await self._dial_back(self.maddrs)
            if answer is None:
                self.reachability = "unknown"
                return
            ok, maddr, error = answer
            if ok:
                self.reachability = "direct"
                logger.info(f"reachable directly at {maddr}")
                return
            self.reachability = "unreachable"
            logger.warning(
                f"NOT REACHABLE: the orchestrator cannot dial this server at {' '.join(self.maddrs) or '(none)'} "
                f"({error}). Open or forward the TCP port, or announce an address that works "
                f"(--public-ip / --announce-maddrs)" + (
                    "; relaying through the orchestrator instead" if mode == "auto" else
                    ". With --nat-relay never this server is not given blocks until it is reachable"))
            if mode != "auto":
                return
            await self._shutdown_dht()
            await self._create_dht(relayed=True)
        # relayed: wait until the relay holds our reservation and the orchestrator can dial us through it
        self.maddrs = reachability.circuit_maddrs(self._relays())
        deadline = time.monotonic() + self.cfg.relay_wait_s
        while not self._stop.is_set():
            answer = await self._dial_back(self.maddrs)
            if answer is not None and answer[0]:
                self.reachability = "relayed"
                logger.info(f"reachable through the relay at {answer[1]}")
                return
            if answer is None or time.monotonic() > deadline:
                self.reachability = "unreachable" if answer is not None else "unknown"
                logger.warning(f"not reachable through a relay either ({answer[2] if answer else 'no answer'}); "
                               "the orchestrator keeps checking")
                return
            await asyncio.sleep(1.5)  # longer than the orchestrator's one dial-back per second per peer

    async def _shutdown_dht(self) -> None:
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
            self.p2p = None
        if self.sd is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.sd.shutdown)
            self.sd = None

    async def follow_placement(self) -> None:
        """Serve the model a trusted orchestrator placed this server on (several models: drain and unload the
        blocks of the one served, then follow the other's assignment)."""
        rec = await self.sd.afetch_placement([h.prefix for h in self.hosted], sorted(self.trusted), self.sd.peer_id)
        if rec is None or not self.is_new_placement(rec):
            return
        target = rec.placement[self.sd.peer_id]
        hosted = next((h for h in self.hosted if h.prefix == target), None)
        if hosted is None:
            self._followed_placement(rec)
            if target not in self._misplaced:
                self._misplaced.add(target)
                logger.error(f"placed on model {target!r}, which this server does not offer "
                             f"({', '.join(h.prefix for h in self.hosted)}): staying on {self.prefix}")
            return
        if hosted is self.active:
            self._followed_placement(rec)
            return
        logger.info(f"placed on model {hosted.prefix} (serving {self.prefix}): draining and unloading its blocks")
        if await self._switch_to(hosted):
            self._followed_placement(rec)

    def is_new_placement(self, rec: PlacementRecord) -> bool:
        """Published after the placement followed last: a later timestamp. Not a higher epoch: an orchestrator
        counts its epochs from 0 at each start, so its last run's record (still read under a model it no longer
        serves) outranked the new run's and moved the server back. Nor is one needed when its clock steps back: DHT
        nodes refuse its records while they hold one with a later expiration (the TTL is the same), so the first
        record of it that reaches a server is stamped after the one followed."""
        return rec.timestamp > self.placement_timestamp

    def _followed_placement(self, rec: PlacementRecord) -> None:
        self.placement_timestamp = rec.timestamp

    async def _switch_to(self, hosted: HostedModel) -> bool:
        """Drain and unload the blocks of the model served, then serve ``hosted`` (False: stopped meanwhile)."""
        await self._unload()  # if it raises, the switch is tried again at the next poll (not left draining)
        if self._stop.is_set():
            return False
        self.active = hosted
        self.epoch, self.assignment_timestamp, self._applied_content, self.span = -1, 0.0, (), None
        self._forget_load_failure()  # they concerned the other model
        self.service.hidden_size = hosted.hidden_size
        self.service.model_fingerprint = hosted.fingerprint
        self.switches += 1
        self.set_state("joining")
        return True

    async def serve_a_model_someone_serves(self, asg: Optional[AssignmentRecord], now: float) -> bool:
        """Several models offered, and for ``ORPHAN_SWITCH_S`` no trusted
        orchestrator serving the one served (no assignment, no summary under its prefix): serve the first other
        model one serves. (An orchestrator serving only one of the models offered never places the server, and the
        one served first, ``--model``'s first, had none: the volunteer's GPU sat idle for good.)"""
        # (placed once or not: an orchestrator that placed it publishes a summary under the model it placed it on)
        if len(self.hosted) < 2 or asg is not None or self.span is not None:
            return False
        since = self._unassigned_since
        if since is None or now - since < ORPHAN_SWITCH_S:
            return False
        trusted = sorted(self.trusted)
        if await self.sd.afetch_summary(self.prefix, trusted) is not None:
            return False  # its orchestrator is there (planning, or no room for this server): stay
        for h in self.hosted:
            if h is self.active:
                continue
            if (await self.sd.afetch_assignment(h.prefix, trusted, self.sd.peer_id) is not None
                    or await self.sd.afetch_summary(h.prefix, trusted) is not None):
                logger.info(f"no orchestrator serves {self.prefix}, one serves {h.prefix}: serving that")
                if await self._switch_to(h):
                    self._unassigned_since = None
                    return True
                return False
        return False

    async def _follow_assignments(self) -> None:
        while not self._stop.is_set():
            if len(self.hosted) > 1:
                try:
                    await self.follow_placement()
                except Exception as e:  # noqa: BLE001 - a DHT hiccup: try again at the next poll
                    logger.warning(f"fetching the model placement failed: {e}")
                if self._stop.is_set():
                    break
            try:
                asg = await self.sd.afetch_assignment(self.prefix, sorted(self.trusted), self.sd.peer_id)
            except Exception as e:  # noqa: BLE001
                logger.warning(f"fetching the assignment failed: {e}")
                asg = None
            if asg is not None and self.is_new_assignment(asg):
                try:
                    await self.apply_assignment(asg)
                except Exception as e:  # noqa: BLE001 - a failed drain or unload must not end the server's loop
                    logger.exception("following the assignment failed; trying again after a backoff")
                    self._load_failed(self._assignment_content(asg), asg.span_of(self.sd.peer_id),
                                      f"{type(e).__name__}: {e}")
            self.say_if_unassigned(asg, time.monotonic())
            try:
                if await self.serve_a_model_someone_serves(asg, time.monotonic()):
                    continue  # the new model's assignment at once
            except Exception as e:  # noqa: BLE001 - a DHT hiccup: try again at the next poll
                logger.warning(f"looking for another offered model's orchestrator failed: {e}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.cfg.assignment_poll_s)

    def say_if_unassigned(self, asg: Optional[AssignmentRecord], now: float) -> Optional[str]:
        """A server holding no span for ``UNASSIGNED_WARN_S`` says why it may be (then every ``UNASSIGNED_REPEAT_S``):
        it waited in silence, joining for ever, when no orchestrator served its model or the plan left it out."""
        if self.span is not None:
            self._unassigned_since = None
            return None
        since = self._unassigned_since = now if self._unassigned_since is None else self._unassigned_since
        if now - since < UNASSIGNED_WARN_S or now - self._unassigned_said < UNASSIGNED_REPEAT_S:
            return None
        self._unassigned_said = now
        if self.load_failure is not None:
            (start, num), error = self.load_failure
            why = f"the blocks assigned, [{start}, {start + num}), cannot be served: {error}"
        elif asg is None:
            why = (f"no trusted orchestrator publishes assignments under DHT prefix {self.prefix!r} (is one serving "
                   "this model, reachable through --initial-peers, and trusted?)")
        else:
            why = (f"the orchestrator's plan (epoch {asg.epoch}) leaves this server out (a memory budget below one "
                   "block and its cache, another model's swarm, or servers enough already: see its dashboard)")
        msg = f"no blocks assigned after {now - since:.0f} s: {why}"
        logger.warning(msg)
        return msg

    async def announce_offline(self, attempts: int = 3, backoff_s: float = 0.5) -> bool:
        """Publish the ``offline`` record, retried: it is the last one, and without it the orchestrator learns of
        the leave only when pings fail (the server is then shown ``failed``, not gone gracefully)."""
        for attempt in range(attempts):
            if self.sd is not None and not self.sd.alive:  # killed (systemd's control-group stop) or crashed
                logger.warning("the DHT process is gone: the orchestrator will notice the leave by itself")
                return False  # each store would wait its whole timeout (three made the exit take ~90 s)
            # bounded: a leave must not wait a whole refresh period per attempt on a DHT that is going away
            if await self.announcer.publish(timeout_s=OFFLINE_STORE_S):
                return True
            if attempt + 1 < attempts:
                await asyncio.sleep(backoff_s * (attempt + 1))
        logger.warning("the offline record was not stored: the orchestrator will notice the leave by itself")
        return False

    def _on_signal(self) -> None:
        """Stop (a second call: stop without waiting for open sessions). Runs on the server's event loop: ``run()``
        installs it with ``loop.add_signal_handler``, whose callbacks the loop runs as its own; another thread calls
        it through ``loop.call_soon_threadsafe`` (server/__main__.py's DHT watch, scripts/soak.py)."""
        if self._stop.is_set():
            logger.warning("second signal: not waiting for open sessions")
            self._force_stop = True
            self.service.wake()
        self._stop.set()

    async def _shutdown(self, handler) -> None:
        logger.info("shutting down")
        try:
            if self.runner is not None:
                await self.drain(self.cfg.drain_timeout_s)
                self.runner.close()
        except Exception:  # noqa: BLE001
            logger.exception("draining failed")
        try:
            if self.announcer is not None:
                await self.announcer.stop()
                self.set_state("offline")
                await self.announce_offline()  # (its record still names the span: it is as before)
        finally:
            # a program that stops a server in-process and goes on (tests, a notebook, scripts/soak.py) held the
            # blocks and KV pool until it exited
            self._drop_runner()
        if handler is not None and self.p2p is not None:
            with contextlib.suppress(Exception):
                await handler.remove_p2p_handlers(self.p2p)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
        if self.sd is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.sd.shutdown)
        logger.info("stopped")
