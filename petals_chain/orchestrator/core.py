"""The orchestrator: DHT peer, planner, JFFC dispatch, relay, sampling, multi-turn sessions.

A *job* is one request (or one multi-turn session): it waits in the central queue for a chain, holds
that chain until it is done, and every token goes hop by hop through the chain's servers while the
embeddings, final norm, LM head and sampling run here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from petals_chain.model import Chain, ModelSpec
from petals_chain.orchestrator.dispatch import DISPATCH_POLICIES, PLACEMENT_POLICIES, DispatchJob, DispatchManager, Lease
from petals_chain.orchestrator.planner import Planner
from petals_chain.orchestrator.relay import ChainSession, HeadBatcher, HopFailure
from petals_chain.orchestrator.sampling import Sampler, SamplingParams, StopMatcher
from petals_chain.orchestrator.stats import Stats

logger = logging.getLogger(__name__)

PLACEMENTS = PLACEMENT_POLICIES
DISPATCHES = DISPATCH_POLICIES


class RequestError(ValueError):
    """A request the orchestrator refuses (maps to HTTP 4xx)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class Unavailable(RuntimeError):
    """The swarm could not serve the request (no chain in time, too many failures): HTTP 503."""


@dataclass
class OrchestratorConfig:
    model: str
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    initial_peers: list[str] = field(default_factory=list)
    identity_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    arrival_rate: float | None = None  # None: estimate online
    rho_bar: float = 0.7
    max_length: int = 1024
    placement: str = "gbp-cr"
    use_all_servers: bool = True  # --spare-servers use: GBP-CR also places the servers the paper leaves idle
    dispatch: str = "jffc"
    dht_prefix: str | None = None
    model_id: str | None = None  # the id /v1/models lists; default: the DHT prefix
    max_tokens_limit: int = 4096
    max_n: int = 8
    max_sessions: int = 1024
    session_idle_timeout_s: float = 300.0
    queue_timeout_s: float = 600.0
    max_failovers: int = 8
    summary_interval_s: float = 5.0
    settle_s: float = 2.0
    refresh_s: float = 1.0
    replan_interval_s: float = 30.0
    move_margin: float = 0.2
    head_window_s: float = 0.0  # extra wait to grow LM-head batches (0: batch what is ready now)
    step_timeout_s: float = 60.0  # a hop silent this long is treated as failed (the job fails over)
    petals_cache_tokens: int = 4096  # --placement petals: PETALS' fixed attention cache per block (tokens)
    bprr_r: int | None = None  # --placement bprr: CG-BP target concurrency (None: GBP-CR's c*)
    route_wait_s: float = 600.0  # --dispatch petals|bprr: max wait at the servers for slots (routed.py)


@dataclass
class Generation:
    """Result of one generation."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    wait_s: float
    service_s: float
    chain: list[str]
    failovers: int


Emit = Callable[[str, int], Awaitable[None]]


class ChainHolder:
    """A job's chain and server sessions; feeds tokens and replays its prefix on another chain on failure."""

    _counter = itertools.count()

    def __init__(self, orch: "Orchestrator", job_id: str, max_length: int):
        self.orch = orch
        self.job_id = job_id
        self.max_length = max_length
        self.kv_ids: list[int] = []  # tokens whose KV the current chain holds
        self.lease: Lease | None = None
        self.cs: ChainSession | None = None
        self.kv_valid = 0
        self.wait_s = 0.0
        self.steps = 0
        self.failovers = 0
        self.closed = False

    @property
    def chain_names(self) -> list[str]:
        return [h[0] for h in self.lease.hops] if self.lease is not None else []

    async def _ensure_chain(self) -> None:
        orch = self.orch
        deadline = time.monotonic() + orch.cfg.queue_timeout_s
        failed_opens = 0
        while self.cs is None:
            if time.monotonic() > deadline:
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s")
            job = DispatchJob(job_id=self.job_id)
            t0 = time.monotonic()
            try:
                lease = await asyncio.wait_for(orch.dispatch.acquire(job), timeout=max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s") from None
            cs = ChainSession(orch.client, lease.hops, f"{self.job_id}.{next(self._counter)}", self.max_length,
                              observe=orch.observe_hop, wait_s=getattr(lease, "wait_s", 0.0))
            opened = False
            for attempt in range(60):
                try:
                    await cs.open()
                    opened = True
                    break
                except HopFailure as e:
                    if e.no_capacity and attempt < 59:
                        # Slots still held by jobs of a previous plan: they free up as those finish.
                        await asyncio.sleep(min(0.5, 0.02 * (attempt + 1)))
                        continue
                    self.failovers += 1
                    orch.stats.add_failover()
                    orch.server_failed(e)
                    break
                except BaseException:
                    orch.dispatch.release(lease)
                    raise
            if opened:
                self.wait_s += time.monotonic() - t0
                self.lease, self.cs, self.kv_valid = lease, cs, 0
                orch.chain_sessions.add(cs)
            else:
                orch.dispatch.release(lease)
                # A refusal (or a failure the planner has not acted on yet) must not become a busy loop.
                failed_opens += 1
                await asyncio.sleep(min(2.0, 0.1 * failed_opens))
                self.wait_s += time.monotonic() - t0

    async def _drop(self) -> None:
        cs, lease = self.cs, self.lease
        self.cs, self.lease, self.kv_valid = None, None, 0
        if cs is not None:
            self.orch.chain_sessions.discard(cs)
            await cs.close()
        if lease is not None:
            self.orch.dispatch.release(lease)

    async def feed(self, new_ids: list[int]) -> torch.Tensor:
        """Append ``new_ids`` to the KV; return the last hidden state [H] (output of the last block)."""
        if len(self.kv_ids) + len(new_ids) > self.max_length:
            raise RequestError(f"sequence would exceed max_length={self.max_length}", code="context_length_exceeded")
        for _ in range(self.orch.cfg.max_failovers + 1):
            await self._ensure_chain()
            ids = self.kv_ids[self.kv_valid:] + list(new_ids)
            position = self.kv_valid
            hidden = self.orch.head.embed(torch.tensor([ids], dtype=torch.long))
            try:
                out = await self.cs.forward(hidden, position)
            except HopFailure as e:
                self.failovers += 1
                self.orch.stats.add_failover()
                logger.warning("job %s: %s; replaying %d tokens on another chain", self.job_id, e, len(ids))
                self.orch.server_failed(e)
                await self._drop()
                continue
            self.kv_ids.extend(new_ids)
            self.kv_valid = len(self.kv_ids)
            self.steps += 1
            return out[0, -1]
        raise Unavailable(f"gave up after {self.failovers} server failures")

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._drop()


class UserSession:
    """A multi-turn session: one job that keeps its chain and KV between calls."""

    def __init__(self, orch: "Orchestrator", max_length: int):
        self.id = uuid.uuid4().hex
        self.holder = ChainHolder(orch, f"s-{self.id[:12]}", max_length)
        self.history: list[int] = []
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.created = time.time()
        self.turns = 0

    @property
    def max_length(self) -> int:
        return self.holder.max_length


class Orchestrator:
    """Owns the swarm side (DHT, planner, dispatch, relay) and the generation logic the API calls."""

    def __init__(self, cfg: OrchestratorConfig):
        from petals_chain.swarm.keys import check_prefix, default_dht_prefix

        if cfg.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be one of {PLACEMENTS}, got {cfg.placement!r}")
        if cfg.dispatch not in DISPATCHES:
            raise ValueError(f"--dispatch must be one of {DISPATCHES}, got {cfg.dispatch!r}")
        if not (0 < cfg.rho_bar <= 1):
            raise ValueError(f"--rho-bar must be in (0, 1], got {cfg.rho_bar}")
        if cfg.arrival_rate is not None and not (cfg.arrival_rate > 0 and math.isfinite(cfg.arrival_rate)):
            raise ValueError(f"--arrival-rate must be positive, got {cfg.arrival_rate}")
        if cfg.max_length < 2:
            raise ValueError(f"--max-length must be at least 2, got {cfg.max_length}")
        self.cfg = cfg
        self.prefix = check_prefix(cfg.dht_prefix or default_dht_prefix(cfg.model))
        self.model_id = cfg.model_id or self.prefix
        self.stats = Stats()
        from petals_chain.orchestrator.routed import make_dispatch

        self.dispatch = make_dispatch(cfg.dispatch, wait_s=cfg.route_wait_s)
        self.sessions: dict[str, UserSession] = {}
        self.started_at = time.time()
        self.http_url = f"http://{cfg.host}:{cfg.port}"
        self.dht = None
        self.client = None
        self.planner: Planner | None = None
        self.head = None
        self.tokenizer = None
        self.batcher: HeadBatcher | None = None
        self._p2p = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._eos: set[int] = set()
        self.chain_sessions: "weakref.WeakSet[ChainSession]" = weakref.WeakSet()
        self._bg_tasks: set[asyncio.Task] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    def load_model(self) -> None:
        """Tokenizer, config and the head (embeddings, final norm, LM head)."""
        from transformers import AutoTokenizer

        from petals_chain.swarm.checkpoint import load_config, load_head, resolve_model_path

        path = resolve_model_path(self.cfg.model)
        self.model_path = path
        self.config = load_config(path)
        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        self.head = load_head(path, dtype=dtype, device="cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        eos = getattr(self.config, "eos_token_id", None)
        eos_list = eos if isinstance(eos, (list, tuple)) else [eos]
        try:
            from transformers import GenerationConfig

            gc = GenerationConfig.from_pretrained(str(path))
            g = gc.eos_token_id
            eos_list += g if isinstance(g, (list, tuple)) else [g]
        except (OSError, ValueError):
            pass
        if self.tokenizer.eos_token_id is not None:
            eos_list.append(self.tokenizer.eos_token_id)
        self._eos = {int(e) for e in eos_list if e is not None}
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos and self.cfg.max_length > max_pos:
            raise ValueError(f"--max-length {self.cfg.max_length} exceeds the model's max_position_embeddings {max_pos}")

    def model_spec(self) -> ModelSpec:
        """``L``, ``s_m``, ``s_c`` (bytes) from the model config at the swarm's max_length."""
        from petals_chain.swarm.memory import block_bytes, cache_slot_bytes

        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        return ModelSpec(num_blocks=int(self.config.num_hidden_layers), block_size=block_bytes(self.config, dtype),
                         cache_size=cache_slot_bytes(self.config, dtype, self.cfg.max_length))

    def measure_serialization(self, repeats: int = 50) -> float:
        """Seconds of (de)serialization per relay step and hop: a one-token hidden state is serialized and
        deserialized twice (here and at the server), as every decode step does."""
        from hivemind.compression import deserialize_torch_tensor
        from hivemind.utils.streaming import combine_from_streaming

        from petals_chain.swarm.rpc import serialize_chunks

        hidden = torch.zeros(1, 1, int(self.config.hidden_size), dtype=self.head.dtype)
        t0 = time.perf_counter()
        for _ in range(repeats):
            deserialize_torch_tensor(combine_from_streaming(serialize_chunks(hidden)))
        return 2 * (time.perf_counter() - t0) / repeats

    async def start(self) -> None:
        from petals_chain.swarm.dht import SwarmDHT
        from petals_chain.swarm.rpc import ServerClient

        self._stop = asyncio.Event()
        if self.head is None:
            await asyncio.to_thread(self.load_model)
        self.batcher = HeadBatcher(self.head, window_s=self.cfg.head_window_s)
        self.dht = await asyncio.to_thread(
            SwarmDHT.create, initial_peers=self.cfg.initial_peers, host_maddrs=self.cfg.host_maddrs,
            identity_path=self.cfg.identity_path, prefix=self.prefix)
        self._p2p = await self.dht.replicate_p2p()
        self.client = ServerClient(self._p2p, step_timeout_s=self.cfg.step_timeout_s)
        self.planner = Planner(
            dht=self.dht, prefix=self.prefix, client=self.client, max_length=self.cfg.max_length,
            on_chains=self._on_chains, arrival_rate=self.cfg.arrival_rate, rho_bar=self.cfg.rho_bar,
            placement=self.cfg.placement, use_all_servers=self.cfg.use_all_servers,
            move_margin=self.cfg.move_margin, settle_s=self.cfg.settle_s,
            refresh_s=self.cfg.refresh_s, replan_interval_s=self.cfg.replan_interval_s,
            model_spec_fallback=self.model_spec, on_failure=self._abort_sessions_on,
            serialization_s=self.measure_serialization(), petals_cache_tokens=self.cfg.petals_cache_tokens,
            bprr_r=self.cfg.bprr_r)
        if hasattr(self.dispatch, "attach"):  # routed dispatch (PETALS, BPRR) reads live server views
            self.dispatch.attach(self.planner)
        self._tasks = [asyncio.create_task(self.planner.run(self._stop), name="planner"),
                       asyncio.create_task(self._summary_loop(), name="summary"),
                       asyncio.create_task(self._reap_sessions(), name="session-reaper")]

    @property
    def initial_peers(self) -> list[str]:
        return self.dht.visible_maddrs() if self.dht is not None else []

    async def stop(self) -> None:
        self._stop.set()
        if self._bg_tasks:
            await asyncio.wait(list(self._bg_tasks), timeout=10)
        for s in list(self.sessions.values()):
            await s.holder.close()
        self.sessions.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.batcher is not None:
            self.batcher.close()
        if self._p2p is not None:
            try:
                await self._p2p.shutdown()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.debug("p2p replica shutdown failed", exc_info=True)
            self._p2p = None
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)

    def _abort_sessions_on(self, peer_id: str) -> None:
        """Jobs waiting on a server declared failed fail over now (not at their step timeout)."""
        for cs in list(self.chain_sessions):
            cs.abort(peer_id)

    def _on_chains(self, chains: list[Chain]) -> None:
        self.dispatch.set_chains(chains)

    def observe_hop(self, peer_id: str, n_tokens: int, n_blocks: int, seconds: float,
                    compute_s: float | None = None) -> None:
        self.stats.hop_s += seconds
        if self.planner is not None:
            self.planner.observe_hop(peer_id, n_tokens, n_blocks, seconds, compute_s)

    def server_failed(self, e: HopFailure) -> None:
        """A hop failed: unless it was a refusal the server sent, drop the server from the plan at once."""
        try:
            from petals_chain.swarm.rpc import RemoteError
        except ImportError:  # pragma: no cover
            RemoteError = ()  # type: ignore[assignment]
        if isinstance(e.cause, RemoteError) and not isinstance(e.cause, ConnectionError):
            return  # the server answered: it lives (e.g. lost the session on re-assignment)
        if self.planner is not None:
            self.planner.report_failure(e.peer_id)

    @property
    def ready(self) -> bool:
        return bool(self.dispatch.chains)

    # ---- tokens --------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(x) for x in out]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode(text)

    def check_ids(self, ids: list[int]) -> None:
        vocab = int(self.head.embed_tokens.num_embeddings)
        bad = [i for i in ids if not (0 <= int(i) < vocab)]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")

    # ---- generation ----------------------------------------------------------------------------
    def _resolve_max_tokens(self, params: SamplingParams, used: int, max_length: int, explicit: bool) -> None:
        room = max_length - used
        if room <= 0:
            raise RequestError(f"the prompt has {used} tokens, but this model's maximum context length is "
                               f"{max_length} tokens", param="prompt", code="context_length_exceeded")
        if not explicit:
            params.max_tokens = min(params.max_tokens, room)
        elif params.max_tokens > room:
            raise RequestError(f"this model's maximum context length is {max_length} tokens; the prompt has {used} "
                               f"and max_tokens is {params.max_tokens}: reduce the prompt or max_tokens",
                               param="max_tokens", code="context_length_exceeded")

    async def _generate(self, holder: ChainHolder, history: list[int], feed: list[int], params: SamplingParams,
                        emit: Emit | None) -> tuple[list[int], str, str]:
        sampler = Sampler(params)
        matcher = StopMatcher(self.tokenizer, params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        generated: list[int] = []
        finish = "length"
        for _ in range(params.max_tokens):
            hidden = await holder.feed(feed)
            logits = await self.batcher.logits(hidden)
            tok = sampler.next_token(logits, history)
            history.append(tok)
            generated.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            delta = matcher.feed(tok)
            if delta and emit is not None:
                await emit(delta, tok)
            if matcher.stopped:
                finish = "stop"
                break
            if len(history) >= holder.max_length:
                break
            feed = [tok]
        tail = matcher.flush()
        if tail and emit is not None:
            await emit(tail, -1)
        self.stats.relay_steps += holder.steps
        return generated, matcher.text, finish

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, explicit_max_tokens: bool = True,
                       emit: Emit | None = None) -> Generation:
        """One request as one job: queue for a chain, prefill, decode, release the chain."""
        self.check_ids(prompt_ids)
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        self._resolve_max_tokens(params, len(prompt_ids), self.cfg.max_length, explicit_max_tokens)
        if self.planner is not None:
            self.planner.rates.arrive()
        t0 = time.monotonic()
        holder = ChainHolder(self, f"r-{uuid.uuid4().hex[:12]}", self.cfg.max_length)
        ok = False
        generated: list[int] = []
        try:
            generated, text, finish = await self._generate(holder, list(prompt_ids), list(prompt_ids), params, emit)
            ok = True
        finally:
            chain = holder.chain_names
            total = time.monotonic() - t0
            # Closing the server sessions costs a round trip: the reply need not wait for it. The chain slot
            # is released only after the servers freed their slots, so nobody is refused meanwhile.
            self._background(holder.close())
            service = max(0.0, total - holder.wait_s)
            self.stats.record(wait_s=holder.wait_s, service_s=service, tokens=len(generated),
                              prompt_tokens=len(prompt_ids), ok=ok)
            if ok and self.planner is not None:
                self.planner.observe_job(holder.steps)
        return Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(prompt_ids),
                          wait_s=holder.wait_s, service_s=service, chain=chain, failovers=holder.failovers)

    # ---- multi-turn sessions -------------------------------------------------------------------
    def open_session(self, max_length: int | None = None) -> UserSession:
        if len(self.sessions) >= self.cfg.max_sessions:
            raise RequestError(f"too many open sessions ({self.cfg.max_sessions})", status=429)
        ml = self.cfg.max_length if max_length is None else int(max_length)
        if not (2 <= ml <= self.cfg.max_length):
            raise RequestError(f"max_length must be in [2, {self.cfg.max_length}], got {ml}", param="max_length")
        s = UserSession(self, ml)
        self.sessions[s.id] = s
        return s

    def get_session(self, session_id: str) -> UserSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise RequestError(f"no open session {session_id!r}", status=404, code="session_not_found")
        return s

    async def close_session(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is None:
            raise RequestError(f"no open session {session_id!r}", status=404, code="session_not_found")
        async with s.lock:
            await s.holder.close()

    async def session_generate(self, s: UserSession, new_ids: list[int], params: SamplingParams, *,
                               explicit_max_tokens: bool = True, emit: Emit | None = None) -> Generation:
        """Continue session ``s`` with ``new_ids`` (appended to its history) and generate."""
        if s.lock.locked():
            raise RequestError("this session is already generating", status=409, code="session_busy")
        async with s.lock:
            if s.id not in self.sessions:
                raise RequestError("the session was closed", status=404, code="session_not_found")
            self.check_ids(new_ids)
            if not new_ids and not s.history:
                raise RequestError("the prompt is empty", param="prompt")
            self._resolve_max_tokens(params, len(s.history) + len(new_ids), s.max_length, explicit_max_tokens)
            s.last_used = time.monotonic()
            wait0, steps0 = s.holder.wait_s, s.holder.steps
            t0 = time.monotonic()
            history = s.history + list(new_ids)
            pending = history[len(s.holder.kv_ids):]
            try:
                generated, text, finish = await self._generate(s.holder, history, pending, params, emit)
            except BaseException:
                self.stats.record(wait_s=s.holder.wait_s - wait0, service_s=0.0, tokens=0, prompt_tokens=len(new_ids),
                                  ok=False)
                raise
            s.history = history
            s.turns += 1
            s.last_used = time.monotonic()
            wait = s.holder.wait_s - wait0
            service = max(0.0, time.monotonic() - t0 - wait)
            self.stats.record(wait_s=wait, service_s=service, tokens=len(generated), prompt_tokens=len(new_ids), ok=True)
            return Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(new_ids),
                              wait_s=wait, service_s=service, chain=s.holder.chain_names,
                              failovers=s.holder.failovers)

    async def _reap_sessions(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(5.0)
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if not s.lock.locked() and now - s.last_used > self.cfg.session_idle_timeout_s:
                    logger.info("closing idle session %s", sid)
                    self.sessions.pop(sid, None)
                    await s.holder.close()

    # ---- state ---------------------------------------------------------------------------------
    def swarm_json(self) -> dict[str, Any]:
        """The ``GET /api/v1/swarm`` object (contracts E)."""
        p = self.planner
        current = p.current if p is not None else None
        servers = p.server_json() if p is not None else []
        name_of = {s["peer_id"]: s["public_name"] for s in servers}
        chains = []
        for k, ch in enumerate(self.dispatch.chains):
            chains.append({"id": self.dispatch.chain_ids[k], "servers": list(ch.servers),
                           "names": [name_of.get(x, x[:12]) for x in ch.servers], "blocks": list(ch.blocks),
                           "spans": [list(s) for s in ch.spans], "service_time": ch.service_time,
                           "capacity": ch.capacity, "active": self.dispatch.active(k)})
        predicted = None
        if current is not None and current.chains and math.isfinite(current.lower):
            predicted = {"lower": current.lower, "upper": current.upper if math.isfinite(current.upper) else None}
        return {
            "model": self.model_id, "dht_prefix": self.prefix, "max_length": self.cfg.max_length,
            "ready": self.ready, "initial_peers": self.initial_peers, "http_url": self.http_url,
            "epoch": p.epoch if p is not None else 0, "placement_policy": self.cfg.placement,
            "dispatch_policy": self.cfg.dispatch, "c": p.plan.c if p is not None and p.plan is not None else None,
            "arrival_rate": p.arrival_rate if p is not None else (self.cfg.arrival_rate or 0.0),
            "arrival_rate_mode": "fixed" if self.cfg.arrival_rate is not None else "auto",
            "rho_bar": self.cfg.rho_bar, "predicted_response_s": predicted, "measured": self.stats.measured(),
            "queue_length": self.dispatch.queue_length, "running": self.dispatch.running,
            "sessions": len(self.sessions), "updated_at": time.time(), "servers": servers, "chains": chains,
            "history": list(self.stats.history)[-200:],
            "plans": list(p.plan_log)[-10:] if p is not None else [],
            "relay": {"tokens": self.stats.tokens, "relay_steps": self.stats.relay_steps, "hop_s": self.stats.hop_s,
                      "service_s": self.stats.service_s, "failovers": self.stats.failovers,
                      "lm_head_batches": self.batcher.batches if self.batcher else 0,
                      "lm_head_rows": self.batcher.rows if self.batcher else 0},
        }

    def update_gauges(self) -> None:
        s = self.stats
        s.m_queue.set(self.dispatch.queue_length)
        s.m_running.set(self.dispatch.running)
        s.m_chains.set(len(self.dispatch.chains))
        s.m_capacity.set(sum(ch.capacity for ch in self.dispatch.chains))
        s.m_ready.set(1 if self.ready else 0)
        if self.planner is not None:
            s.m_epoch.set(self.planner.epoch)
            s.m_arrival.set(self.planner.arrival_rate)
            cur = self.planner.current
            if cur is not None and math.isfinite(cur.lower):
                s.m_lower.set(cur.lower)
                s.m_upper.set(cur.upper if math.isfinite(cur.upper) else float("nan"))
            counts: dict[str, int] = {}
            for v in self.planner.servers.values():
                st = "failed" if v.failed_at is not None else v.record.state
                counts[st] = counts.get(st, 0) + 1
            for st in ("joining", "online", "draining", "offline", "failed"):
                s.m_servers.labels(st).set(counts.get(st, 0))

    async def _summary_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.cfg.summary_interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                from petals_chain.dashboard.app import json_safe

                summary = json_safe(self.swarm_json())  # no inf/nan: JSON readers (browsers) reject them
                expiration_s = max(30.0, 3 * self.cfg.summary_interval_s)
                await asyncio.to_thread(self.dht.publish_summary, self.prefix, summary, expiration_s)
                # the directory entry lets a dashboard find this swarm from --initial-peers alone
                await asyncio.to_thread(self.dht.publish_directory, self.prefix, self.model_id, self.http_url,
                                        expiration_s)
            except Exception:  # noqa: BLE001 - a failed publish is retried next period
                logger.warning("publishing the swarm summary failed", exc_info=True)
