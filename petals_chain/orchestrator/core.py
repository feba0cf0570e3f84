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
from petals_chain.orchestrator.dispatch import (DISPATCH_POLICIES, PLACEMENT_POLICIES, DispatchJob, Lease, QueueFull,
                                                note_admission)
from petals_chain.orchestrator.planner import Planner
from petals_chain.orchestrator.relay import ChainSession, HeadBatcher, HopFailure
from petals_chain.orchestrator.sampling import SamplingParams, SequenceSampler, StopMatcher, TokenChoice
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
    device: str = "cpu"  # where the embeddings, LM head and sampling run (cpu, cuda, cuda:N)
    arrival_rate: float | None = None  # None: estimate online
    rho_bar: float = 0.7
    max_length: int = 1024
    placement: str = "gbp-cr"
    use_all_servers: bool = True  # --spare-servers use: GBP-CR also places the servers the paper leaves idle
    dispatch: str = "jffc"
    dht_prefix: str | None = None
    model_id: str | None = None  # the id /v1/models lists; default: the model's (short) name
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
    max_queue: int = 1024  # --max-queue: central-queue bound, enforced by the dispatch manager (dispatch.py)


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
    logprobs: list[TokenChoice] | None = None  # per generated token, when asked for
    prompt_logprobs: list[TokenChoice | None] | None = None  # per prompt token (first: None), when asked for
    forked: bool = False  # started from a sibling's prefill (n > 1) instead of its own


# emit(text, token choices since the previous emit): streaming callbacks get the text that is safe to show and
# the tokens (with logprobs when asked) it came from; text may be empty while a stop string is still possible.
Emit = Callable[[str, list[TokenChoice]], Awaitable[None]]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
        self.admitted = False  # held a chain once: later acquires re-queue with priority, never refused
        # (sibling, tokens): a sibling whose first `tokens` KV this job may copy if it lands on the same chain
        self.fork_source: tuple["ChainHolder", int] | None = None
        self.forked = False

    @property
    def chain_names(self) -> list[str]:
        return [h[0] for h in self.lease.hops] if self.lease is not None else []

    async def _ensure_chain(self) -> None:
        orch = self.orch
        deadline = time.monotonic() + orch.cfg.queue_timeout_s
        failed_opens = 0
        if self.cs is not None:
            note_admission(True)  # holds its chain (a session's later turn): admitted without the queue
        while self.cs is None:
            if time.monotonic() > deadline:
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s")
            job = DispatchJob(job_id=self.job_id, requeue=self.admitted)
            t0 = time.monotonic()
            try:
                lease = await asyncio.wait_for(orch.dispatch.acquire(job), timeout=max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise Unavailable(f"no chain became available within {orch.cfg.queue_timeout_s:.0f}s") from None
            except QueueFull as e:  # only a job that never held a chain is refused
                raise RequestError(str(e), status=429, code="queue_full") from None
            self.admitted = True
            cs = ChainSession(orch.client, lease.hops, f"{self.job_id}.{next(self._counter)}", self.max_length,
                              observe=orch.observe_hop, wait_s=getattr(lease, "wait_s", 0.0))
            opened = False
            fork = self._fork_candidate(lease)
            for attempt in range(60):
                try:
                    if fork is not None:
                        try:
                            await cs.open(fork_from=fork[0], fork_length=fork[1])
                        except HopFailure as e:
                            if not (e.no_capacity or _is_refusal(e)):
                                raise
                            fork = None  # the sibling's session moved or a server is full: open plainly
                            continue
                        self.kv_valid = fork[1]
                        self.forked = True
                        self.orch.stats.forks += 1
                    else:
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
                self.lease, self.cs = lease, cs
                if fork is None:
                    self.kv_valid = 0
                orch.chain_sessions.add(cs)
            else:
                orch.dispatch.release(lease)
                # A refusal (or a failure the planner has not acted on yet) must not become a busy loop.
                failed_opens += 1
                await asyncio.sleep(min(2.0, 0.1 * failed_opens))
                self.wait_s += time.monotonic() - t0

    def _fork_candidate(self, lease: Lease) -> tuple[ChainSession, int] | None:
        """The sibling's session to copy the prefix KV from, if it runs on exactly the hops of ``lease``."""
        if self.fork_source is None or self.kv_valid:
            return None
        sibling, n = self.fork_source
        cs = sibling.cs
        if cs is None or sibling.kv_valid < n or cs.hops != lease.hops or self.kv_ids[:n] != sibling.kv_ids[:n]:
            return None
        return cs, n

    def sync(self, target: list[int]) -> list[int]:
        """Make ``target`` the sequence this job continues: keep the longest common prefix of the tokens fed so
        far (rolling the chain's KV back past it) and return the tokens of ``target`` still to feed.

        A turn that failed or was aborted fed tokens nobody kept; a re-templated chat history may tokenize the
        last answer differently: either way the next feed starts where the two sequences agree."""
        keep = common_prefix(self.kv_ids, target)
        del self.kv_ids[keep:]
        self.kv_valid = min(self.kv_valid, keep)
        return list(target[keep:])

    async def _drop(self) -> None:
        cs, lease = self.cs, self.lease
        self.cs, self.lease, self.kv_valid = None, None, 0
        if cs is not None:
            self.orch.chain_sessions.discard(cs)
            await cs.close()
        if lease is not None:
            self.orch.dispatch.release(lease)

    async def feed(self, new_ids: list[int], hidden: torch.Tensor | None = None, *,
                   all_positions: bool = False) -> torch.Tensor:
        """Append ``new_ids`` to the KV; return the last block's output at the last position [H] (or, with
        ``all_positions``, at every position of the tokens fed in this call, [n, H]).

        ``hidden``: the embeddings of ``new_ids`` if the caller has them (the head batcher embeds the tokens it
        samples); replays after a failover embed in the head's worker thread."""
        if len(self.kv_ids) + len(new_ids) > self.max_length:
            raise RequestError(f"sequence would exceed max_length={self.max_length}", code="context_length_exceeded")
        for _ in range(self.orch.cfg.max_failovers + 1):
            await self._ensure_chain()
            ids = self.kv_ids[self.kv_valid:] + list(new_ids)
            position = self.kv_valid
            if hidden is None or len(ids) != len(new_ids):
                hidden = await self.orch.batcher.embed(ids)
            try:
                out = await self.cs.forward(hidden, position)
            except asyncio.CancelledError:
                # A step cut short leaves replies unread: its streams are closed. Release the chain now (its JFFC
                # slot goes to the next job); a session's next turn acquires one and replays what it needs.
                self.orch._background(self._drop())
                raise
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
            return out[0, len(ids) - len(new_ids):] if all_positions else out[0, -1]
        raise Unavailable(f"gave up after {self.failovers} server failures")

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._drop()


def _is_refusal(e: HopFailure) -> bool:
    """The server answered with an error (it lives), as opposed to a dead or silent server."""
    from petals_chain.swarm.rpc import RemoteError

    return isinstance(e.cause, RemoteError) and not isinstance(e.cause, ConnectionError)


class UserSession:
    """A multi-turn session: one job that keeps its chain and KV between calls.

    ``history`` is the session's token sequence after its last completed turn; ``messages`` the conversation
    of a chat session (None for a session fed raw text or token ids). A turn that fails or is aborted leaves
    both exactly as they were."""

    def __init__(self, orch: "Orchestrator", max_length: int):
        self.id = uuid.uuid4().hex
        self.holder = ChainHolder(orch, f"s-{self.id[:12]}", max_length)
        self.history: list[int] = []
        self.messages: list[dict] | None = None
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
        from petals_chain.swarm.sources import check_family, resolve_source

        self.cfg = cfg
        dev = torch.device(cfg.device)  # a bad --device fails here, before anything starts
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device}: no CUDA device is available (use --device cpu)")
        self.source = resolve_source(cfg.model)
        check_family(self.source.config)
        self.prefix = check_prefix(cfg.dht_prefix or default_dht_prefix(self.source.name))
        self.model_id = cfg.model_id or self.source.name
        self.stats = Stats()
        from petals_chain.orchestrator.routed import make_dispatch

        self.dispatch = make_dispatch(cfg.dispatch, wait_s=cfg.route_wait_s, max_queue=cfg.max_queue)
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
        self._token_text: dict[int, str] = {}
        self.chain_sessions: "weakref.WeakSet[ChainSession]" = weakref.WeakSet()
        self._bg_tasks: set[asyncio.Task] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    def load_model(self) -> None:
        """Tokenizer, config and the head (embeddings, final norm, LM head) on ``--device``."""
        from petals_chain.swarm.checkpoint import load_head
        from petals_chain.swarm.sources import check_family

        src = self.source
        self.model_path = src.path
        self.config = src.config
        check_family(self.config)
        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        self.head = load_head(src, dtype=dtype, device=self.cfg.device)
        self.tokenizer = src.load_tokenizer()
        eos = set(src.eos_token_ids())
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos = eos
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
        self.batcher.on_batch = self.stats.m_head_batch.observe
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
            bprr_r=self.cfg.bprr_r, model_fingerprint=self.source.fingerprint)
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
    @property
    def vocab_size(self) -> int:
        return int(self.head.embed_tokens.num_embeddings)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation in the model's chat template, ending with the assistant's turn opening."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(x) for x in out]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as text (logprobs responses); cached, tokens repeat."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def check_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        bad = [i for i in ids if not (0 <= int(i) < vocab)]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")

    def validate_prompt(self, ids: list[int], max_tokens: int, explicit: bool, *, max_length: int | None = None
                        ) -> None:
        """Refuse (RequestError) an empty prompt, unknown token ids, or one that leaves no room to generate."""
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        self.check_ids(ids)
        self._max_tokens(max_tokens, len(ids), max_length or self.cfg.max_length, explicit)

    @staticmethod
    def _max_tokens(max_tokens: int, used: int, max_length: int, explicit: bool) -> int:
        """Tokens to generate after ``used`` context tokens: an implicit limit shrinks to the room left, an
        explicit one that does not fit is refused (OpenAI's behaviour)."""
        room = max_length - used
        if room <= 0:
            raise RequestError(f"the prompt has {used} tokens, but this model's maximum context length is "
                               f"{max_length} tokens", param="prompt", code="context_length_exceeded")
        if not explicit:
            return min(max_tokens, room)
        if max_tokens > room:
            raise RequestError(f"this model's maximum context length is {max_length} tokens; the prompt has {used} "
                               f"and max_tokens is {max_tokens}: reduce the prompt or max_tokens",
                               param="max_tokens", code="context_length_exceeded")
        return max_tokens

    # ---- generation ----------------------------------------------------------------------------
    async def _decode_loop(self, holder: ChainHolder, context: list[int], hidden: torch.Tensor,
                           params: SamplingParams, emit: Emit | None) -> tuple[list[int], str, str, list[TokenChoice]]:
        """Sample, feed, repeat: ``hidden`` is the last block's output after ``context``; returns (tokens,
        text, finish_reason, choices). The LM head, sampling and the next token's embedding run batched in the
        head's worker thread (:class:`HeadBatcher`); this loop only relays."""
        seq = SequenceSampler(params, context)
        matcher = StopMatcher(self.tokenizer, params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        generated: list[int] = []
        choices: list[TokenChoice] = []
        unsent: list[TokenChoice] = []
        finish = "length"
        limit = min(params.max_tokens, holder.max_length - len(context))
        for i in range(limit):
            choice, emb = await self.batcher.sample(hidden, seq)
            tok = choice.token
            seq.append(tok)
            generated.append(tok)
            choices.append(choice)
            unsent.append(choice)
            if tok in stop_ids:
                finish = "stop"
                break
            delta = matcher.feed(tok)
            if delta and emit is not None:
                await emit(delta, unsent)
                unsent = []
            if matcher.stopped:
                finish = "stop"
                break
            if i + 1 < limit:
                hidden = await holder.feed([tok], emb)
        tail = matcher.flush()
        if emit is not None and (tail or unsent):
            await emit(tail, unsent)
        self.stats.relay_steps += holder.steps
        return generated, matcher.text, finish, choices

    def _finish_job(self, holder: ChainHolder, t0: float, generated: int, prompt_tokens: int, ok: bool) -> float:
        """Record a finished job (or turn) and return its service time."""
        service = max(0.0, time.monotonic() - t0 - holder.wait_s)
        self.stats.record(wait_s=holder.wait_s, service_s=service, tokens=generated, prompt_tokens=prompt_tokens,
                          ok=ok)
        if ok and self.planner is not None:
            self.planner.observe_job(holder.steps)
        return service

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, explicit_max_tokens: bool = True,
                       emit: Emit | None = None, prompt_logprobs: int | None = None) -> Generation:
        """One request as one job: queue for a chain, prefill, decode, release the chain."""
        return (await self.generate_n(prompt_ids, [params], explicit_max_tokens, [emit] if emit else None,
                                      prompt_logprobs=prompt_logprobs))[0]

    async def generate_n(self, prompt_ids: list[int], params: list[SamplingParams], explicit_max_tokens: bool = True,
                         emits: list[Emit | None] | None = None, *, prompt_logprobs: int | None = None
                         ) -> list[Generation]:
        """``len(params)`` completions of one prompt, each its own job. The first job prefills; the others
        wait for that prefill and start from a copy of its KV when JFFC puts them on the same chain (else
        they prefill on theirs): the prompt is computed once, and every choice samples its first token from
        the same last hidden state. If one choice fails, the others are cancelled and their chains released."""
        self.validate_prompt(prompt_ids, params[0].max_tokens, explicit_max_tokens)
        params = [SamplingParams(**{**p.__dict__, "stop": list(p.stop), "max_tokens": self._max_tokens(
            p.max_tokens, len(prompt_ids), self.cfg.max_length, explicit_max_tokens)}) for p in params]
        emits = list(emits or [None] * len(params))
        if self.planner is not None:
            for _ in params:
                self.planner.rates.arrive()
        t0 = time.monotonic()
        holders = [ChainHolder(self, f"r-{uuid.uuid4().hex[:12]}", self.cfg.max_length) for _ in params]
        for h in holders[1:]:
            h.fork_source = (holders[0], len(prompt_ids))
        prefill: asyncio.Future = asyncio.get_running_loop().create_future()
        # A failed prefill is reported by its own task; the siblings only wait on it.
        prefill.add_done_callback(lambda f: f.cancelled() or f.exception())
        results: list[Generation | None] = [None] * len(params)

        async def one(i: int) -> None:
            holder, p = holders[i], params[i]
            generated: list[int] = []
            ok = False
            scored = None
            try:
                if i == 0:
                    try:
                        out = await holder.feed(list(prompt_ids), all_positions=prompt_logprobs is not None)
                        if prompt_logprobs is not None:
                            scored = await self.batcher.score(out, list(prompt_ids), prompt_logprobs)
                            out = out[-1]
                        prefill.set_result(out)
                    except BaseException as e:
                        if not prefill.done():
                            prefill.set_exception(e)
                        raise
                    hidden = out
                else:
                    hidden = await asyncio.shield(prefill)
                    holder.kv_ids = list(prompt_ids)  # fed lazily: forked on the sibling's chain or replayed
                generated, text, finish, choices = await self._decode_loop(holder, list(prompt_ids), hidden, p,
                                                                            emits[i])
                ok = True
            finally:
                self._background(holder.close())
                service = self._finish_job(holder, t0, len(generated), len(prompt_ids) if i == 0 else 0, ok)
            results[i] = Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(prompt_ids),
                                    wait_s=holder.wait_s, service_s=service, chain=holder.chain_names,
                                    failovers=holder.failovers, logprobs=choices if p.logprobs is not None else None,
                                    prompt_logprobs=scored, forked=holder.forked)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(params))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not prefill.done():
                prefill.cancel()
        scored = results[0].prompt_logprobs
        for g in results[1:]:
            g.prompt_logprobs = scored
        return results  # type: ignore[return-value]

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

    def session_messages(self, s: UserSession, new: list[dict]) -> list[dict]:
        """The whole conversation after a chat turn adding ``new`` (refused for a raw-text session)."""
        if s.messages is None and s.history:
            raise RequestError("this session was fed raw text or token ids; chat messages cannot continue it",
                               param="messages", code="session_mode")
        return list(s.messages or []) + list(new)

    def session_target(self, s: UserSession, new_ids: list[int]) -> list[int]:
        """The session's token sequence after a raw turn adding ``new_ids`` (refused for a chat session)."""
        if s.messages is not None:
            raise RequestError("this is a chat session; continue it with messages", param="prompt",
                               code="session_mode")
        return s.history + list(new_ids)

    async def session_generate(self, s: UserSession, target: list[int], params: SamplingParams, *,
                               explicit_max_tokens: bool = True, emit: Emit | None = None,
                               messages: list[dict] | None = None) -> Generation:
        """Continue session ``s`` so that its tokens are ``target`` (the history plus this turn's input, or a
        chat conversation templated at once), then generate. Only the tokens the chain does not hold yet are
        fed; on failure or cancellation the session stays as it was before the turn."""
        if s.lock.locked():
            raise RequestError("this session is already generating", status=409, code="session_busy")
        async with s.lock:
            if s.id not in self.sessions:
                raise RequestError("the session was closed", status=404, code="session_not_found")
            self.validate_prompt(target, params.max_tokens, explicit_max_tokens, max_length=s.max_length)
            params = SamplingParams(**{**params.__dict__, "stop": list(params.stop), "max_tokens": self._max_tokens(
                params.max_tokens, len(target), s.max_length, explicit_max_tokens)})
            s.last_used = time.monotonic()
            holder = s.holder
            wait0 = holder.wait_s
            t0 = time.monotonic()
            pending = holder.sync(target)
            prompt_tokens = len(pending)
            try:
                if pending:
                    hidden = await holder.feed(pending)
                else:  # the chain already holds the whole target: recompute the last position's output
                    last = target[-1:]
                    holder.sync(target[:-1])
                    hidden = await holder.feed(last)
                generated, text, finish, choices = await self._decode_loop(holder, list(target), hidden, params, emit)
            except BaseException:
                self.stats.record(wait_s=holder.wait_s - wait0, service_s=0.0, tokens=0, prompt_tokens=prompt_tokens,
                                  ok=False)
                raise
            finally:
                s.last_used = time.monotonic()
            if messages is not None:
                s.messages = self.session_messages(s, messages) + [{"role": "assistant", "content": text}]
            s.history = list(target) + generated
            s.turns += 1
            wait = holder.wait_s - wait0
            service = max(0.0, time.monotonic() - t0 - wait)
            self.stats.record(wait_s=wait, service_s=service, tokens=len(generated), prompt_tokens=prompt_tokens,
                              ok=True)
            return Generation(token_ids=generated, text=text, finish_reason=finish, prompt_tokens=len(target),
                              wait_s=wait, service_s=service, chain=holder.chain_names, failovers=holder.failovers,
                              logprobs=choices if params.logprobs is not None else None)

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
                           "capacity": ch.capacity, "active": self.dispatch.active(k),
                           "max_active": self.dispatch.peak_active(k)})
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
            # maxima and counts since start (exact, unlike samples of queue_length): queue_max <= max_queue
            "queue_max": self.dispatch.queue_max, "max_queue": self.dispatch.max_queue,
            "queue_refused": self.dispatch.refused, "requeued": self.dispatch.requeued,
            "sessions": len(self.sessions), "updated_at": time.time(), "servers": servers, "chains": chains,
            "history": list(self.stats.history)[-200:],
            "plans": list(p.plan_log)[-10:] if p is not None else [],
            "relay": {"tokens": self.stats.tokens, "relay_steps": self.stats.relay_steps, "hop_s": self.stats.hop_s,
                      "service_s": self.stats.service_s, "failovers": self.stats.failovers,
                      "lm_head_batches": self.batcher.batches if self.batcher else 0,
                      "lm_head_rows": self.batcher.rows if self.batcher else 0, "forks": self.stats.forks},
        }

    def update_gauges(self) -> None:
        s = self.stats
        s.m_queue.set(self.dispatch.queue_length)
        s.m_queue_max.set(self.dispatch.queue_max)
        s.m_queue_bound.set(self.dispatch.max_queue if self.dispatch.max_queue is not None else float("inf"))
        s.m_queue_refused.set(self.dispatch.refused)
        s.m_requeued.set(self.dispatch.requeued)
        s.m_chain_max_active.clear()  # only the current chains: a chain gone from the plan drops its series
        for k in range(len(self.dispatch.chains)):
            s.m_chain_max_active.labels(str(self.dispatch.chain_ids[k])).set(self.dispatch.peak_active(k))
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
