"""The orchestrator: configuration, lifecycle, the model's head and tokenizer, planner wiring, swarm state.

A *job* is one request (or one multi-turn session): it waits in the central queue for a chain, holds
that chain until it is done, and every token goes hop by hop through the chain's servers while the
embeddings, final norm, LM head and sampling run here. The parts live beside this module: ``errors``
(RequestError, Unavailable), ``failover`` (a job's chain: dispatch, feeding, forks, failover), ``replay``
(the hop inputs failover replays), ``generation`` (the decode loop, ``n`` choices), ``sessions``
(multi-turn sessions, their lease and keepalives), ``planner``, ``dispatch``, ``relay``, ``stats``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from petals_chain.algorithms.fairness import FAIRNESS_POLICIES, FairnessConfig, FairPolicy
from petals_chain.model import Chain, ModelSpec
from petals_chain.orchestrator.deadlines import DeadlineBook
from petals_chain.orchestrator.dispatch import DISPATCH_POLICIES, PLACEMENT_POLICIES, ChainPrefixes
from petals_chain.orchestrator.drafting import DRAFT_TIMEOUT_S
from petals_chain.orchestrator.audit import Auditor
from petals_chain.orchestrator.errors import RequestError, Unavailable, context_length_error
from petals_chain.orchestrator.fairness import FAIRNESS_SAMPLE_S, ClientShares
from petals_chain.orchestrator.generation import Emit, Generation, GenerationMixin
from petals_chain.orchestrator.planner import SERVER_RECORD_TTL_S, Planner
from petals_chain.orchestrator.relay import ChainSession, HeadBatcher, HopFailure
from petals_chain.orchestrator.replay import ReplayCache
from petals_chain.orchestrator.resume import SHUTTING_DOWN
from petals_chain.orchestrator.sessions import SessionMixin, UserSession
from petals_chain.orchestrator.stats import Stats
from petals_chain.orchestrator.tokentext import TokenText
from petals_chain.swarm.jsonsafe import json_safe
from petals_chain.swarm.launch import out_of_descriptors
from petals_chain.swarm.reachability import Prober
from petals_chain.swarm.rpc import RemoteError
from petals_chain.swarm.version import build_version
from petals_chain.swarm.webpage import url_host

__all__ = ["Emit", "Generation", "JoinError", "Orchestrator", "OrchestratorConfig", "RequestError", "ShuttingDown",
           "Unavailable", "UserSession"]

logger = logging.getLogger(__name__)

PLACEMENTS = PLACEMENT_POLICIES
DISPATCHES = DISPATCH_POLICIES


class JoinError(RuntimeError):
    """The DHT node could not start or join the swarm (unreachable initial peers, a bad identity file, ...)."""


class ShuttingDown(Unavailable):
    """The orchestrator is stopping (SIGTERM): the request is not served here; HTTP 503 ``shutting_down`` (another
    orchestrator, or this one once it is back, serves it)."""

    code = SHUTTING_DOWN

    def __init__(self, message: str = "the orchestrator is shutting down: the request was not served; send it again "
                                      "(to another orchestrator, or here once it is back)"):
        super().__init__(message)


def fairness_policy_name(cfg: "OrchestratorConfig") -> str:
    """``--fairness`` resolved: ``auto`` is dlpm when API keys name the clients, the queue is JFFC's central one
    (``--dispatch jffc``; the baselines have none or their own) and not ordered by ``--schedule`` (deadlines,
    priorities: those need the FIFO's fairness), else fcfs."""
    if cfg.fairness == "auto":
        central = getattr(cfg, "dispatch", "jffc") == "jffc" and getattr(cfg, "schedule", "fcfs") == "fcfs"
        return "dlpm" if getattr(cfg, "api_keys", None) and central else "fcfs"
    return cfg.fairness


def make_shares(cfg: "OrchestratorConfig", registry: Any) -> ClientShares:
    """The fairness policy of ``cfg`` (ValueError naming the flag if a value is out of range)."""
    name = fairness_policy_name(cfg)
    if name not in FAIRNESS_POLICIES:
        raise ValueError(f"--fairness must be auto or one of {', '.join(FAIRNESS_POLICIES)}, got {cfg.fairness!r}")
    try:
        fc = FairnessConfig(w_e=cfg.fairness_w_e, w_q=cfg.fairness_w_q, quantum=cfg.fairness_quantum,
                            worker_quantum=cfg.fairness_worker_quantum)
    except ValueError as e:
        raise ValueError(f"--fairness-*: {e}") from None
    return ClientShares(FairPolicy(name, fc), registry=registry, keyed=bool(getattr(cfg, "api_keys", None)))


@dataclass
class OrchestratorConfig:
    model: str
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)  # what servers are told to dial (default: host_maddrs)
    relay_service: bool = True  # relay for servers nobody can dial (libp2p circuit relay v2)
    ssl_certfile: str | None = None  # HTTPS for the API and dashboard
    ssl_keyfile: str | None = None
    initial_peers: list[str] = field(default_factory=list)
    identity_path: str | None = None
    group_with: list[str] = field(default_factory=list)  # the other orchestrators' peer ids (groups.py)
    group_ttl_s: float = 6.0
    public_url: str | None = None  # where others reach the HTTP API (default from host, port, public_ip)
    public_ip: str | None = None
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
    max_n: int = 8  # completions per request, prompts x n (--max-choices)
    max_sessions: int = 1024
    session_idle_timeout_s: float = 300.0
    queue_timeout_s: float = 600.0
    # a new request while no chain serves the model (no server ready, all gone) waits this long for one, then 503
    no_chain_wait_s: float = 30.0
    sse_keepalive_s: float = 15.0  # --sse-keepalive-s: an SSE comment after this long without an event (0: none)
    # an open a server queues for pages, on a server that sends no heartbeats while it waits (older versions), waits
    # there at most this long before it is sent again: a reply lost on the way (seen once in a run with many
    # re-placements: an open silent for 594 s) costs this, not the job's budget. Heartbeating servers keep the open
    # for the job's whole queue time, and a lost stream shows as silence within ~20 s (swarm/rpc.py).
    open_wait_max_s: float = 60.0
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
    replay_cache_mb: float = 256.0  # --replay-cache-mb: hop inputs kept for failover, all jobs together (replay.py)
    keepalive_tick_s: float = 0.25  # how often idle server sessions are checked for a keepalive (sessions.py)
    hold_sessions: bool = False  # --hold-sessions: a session keeps its chain between turns even with prefix caches
    ban_base_s: float = 5.0  # a failed server is not planned for this long, doubling per failure (planner.py)
    ban_max_s: float = 300.0
    ban_reset_s: float = 120.0  # unbanned and no failure for this long: its next ban starts at ban_base_s again
    # --load-deadline-s: a server not online with a span it was assigned this long after is planned around (planner.py;
    # 0: never). Ten minutes: the whole of a 70B model in 16 bits (~140 GB; weights are fetched before a server joins)
    # reads from a disk at 250 MB/s in less, a volunteer's span in a fraction of that; a missed deadline costs only a
    # re-plan (the server keeps its span and rejoins once loaded), a hung load without one cost the chains for good
    load_deadline_s: float = 600.0
    # --records-lost-s: how long a read of the servers' records naming none of the live ones (an empty DHT get in a
    # network blip) is taken for a failed read, the views and plan kept (planner.py; 0: at once). A record's lifetime
    # by default: longer for swarms whose servers refresh their records less often (a larger --refresh-s)
    records_lost_s: float = SERVER_RECORD_TTL_S
    output_reserve_tokens: int = 256  # --output-reserve-tokens: a chain is opened for the prompt + this (failover.py)
    job_tokens: int | None = None  # --job-tokens: L^ of paged chain capacities (None: learnt; token_budget.py)
    api_keys: str | None = None  # --api-keys FILE (auth.py; limits.py)
    # --fairness: queue discipline among clients (API key names; fairness.py). "auto": dlpm with --api-keys, else
    # fcfs (the paper's FIFO). Service units: w_e per input token computed, w_q per output token.
    fairness: str = "auto"
    # --schedule: the central queue's order, fcfs or edf (earliest deadline first; deadlines.py). Either way a
    # request whose deadline the dispatcher predicts it cannot meet is refused at once.
    schedule: str = "fcfs"
    # --schedule-classes: under --schedule db|mlfq a model's one-shot jobs form this many services by length (K-means
    # of (prompt tokens, max_tokens), learnt online; seed 001 §6.1); 1: one service per model
    schedule_classes: int = 4
    fairness_quantum: float | None = None  # DLPM's Q^u in service units (None: 1-4 x the median cost, by reuse)
    fairness_worker_quantum: float = 20000.0  # D2LPM's Q^w
    fairness_w_e: float = 1.0
    fairness_w_q: float = 2.0
    # --audit-rate: fraction of hop steps re-run on another server holding the same blocks (audit.py)
    audit_rate: float = 0.02
    audit_tolerance: float | None = None  # relative L2 error per token (None: by the dtypes servers compute in)
    audit_strikes: float = 3.0  # decayed strikes that ban a server for good
    audit_half_life_s: float = 3600.0
    audit_probe_s: float = 30.0  # --audit-probe-s: a probe of the next server this often while capacity is spare
    # --speculative: none, ngram (prompt-lookup drafts) or draft (a draft model's greedy tokens), verified by the whole
    # chain in one relay step; requests may override it with their "speculative" field. --speculative-k: the first
    # draft length (it adapts). draft_model (--speculative draft:MODEL): a registry name, a path or "self" (the
    # served model); draft_layers (--draft-layers): only its first N decoder layers (None: all).
    speculative: str = "none"
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_timeout_s: float = DRAFT_TIMEOUT_S  # --draft-timeout-s: a draft call silent this long gives up (drafting.py)
    # --relay: orchestrator (each hop's output comes back to us and goes on to the next hop: the paper's mode) or
    # push (each server pushes its output straight to the next one; see petals_chain.swarm.push)
    relay: str = "orchestrator"
    speculative_k: int = 4
    # --adapter NAME=PATH: LoRA adapters served as models of their own (adapters.py), on servers that announce them
    adapters: list[str] = field(default_factory=list)


class Orchestrator(GenerationMixin, SessionMixin):
    """Owns the swarm side (DHT, planner, dispatch, relay); generation and sessions come from the mixins."""

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
        if isinstance(cfg.output_reserve_tokens, bool) or not isinstance(cfg.output_reserve_tokens, int) \
                or cfg.output_reserve_tokens < 0:
            raise ValueError(f"--output-reserve-tokens must be an int >= 0, got {cfg.output_reserve_tokens!r}")
        if cfg.job_tokens is not None and (isinstance(cfg.job_tokens, bool) or not isinstance(cfg.job_tokens, int)
                                           or not 1 <= cfg.job_tokens <= cfg.max_length):
            raise ValueError(f"--job-tokens must be an int in [1, --max-length {cfg.max_length}], got {cfg.job_tokens!r}")
        if not (0 <= cfg.replay_cache_mb < math.inf):
            raise ValueError(f"--replay-cache-mb must be a finite number >= 0, got {cfg.replay_cache_mb}")
        if not (0 < cfg.ban_base_s <= cfg.ban_max_s < math.inf):
            raise ValueError(f"--ban-base-s and --ban-max-s must satisfy 0 < base <= max, got {cfg.ban_base_s}, "
                             f"{cfg.ban_max_s}")
        if not (0 <= cfg.load_deadline_s < math.inf):
            raise ValueError(f"--load-deadline-s must be a finite number >= 0 (0: none), got {cfg.load_deadline_s}")
        if not (0 <= cfg.records_lost_s < math.inf):
            raise ValueError(f"--records-lost-s must be a finite number >= 0 (0: at once), got {cfg.records_lost_s}")
        if not (0 < cfg.draft_timeout_s < math.inf):
            raise ValueError(f"--draft-timeout-s must be a positive finite number, got {cfg.draft_timeout_s}")
        from petals_chain.swarm.memory import check_device
        from petals_chain.swarm.sources import check_family, resolve_source

        self.cfg = cfg
        check_device(cfg.device)  # a bad --device fails here, before anything starts
        self.source = resolve_source(cfg.model)
        check_family(self.source.config)
        self.prefix = check_prefix(cfg.dht_prefix or default_dht_prefix(self.source.name))
        self.model_id = cfg.model_id or self.source.name
        from petals_chain.orchestrator.adapters import load_adapters

        # {name: LoraAdapter}: read and validated against the model now, before anything starts
        self.adapters = load_adapters(cfg.adapters, self.source.config,
                                      reserved=(self.model_id, self.prefix, cfg.model))
        if self.adapters and cfg.dispatch != "jffc":
            raise ValueError(f"--adapter needs --dispatch jffc (dispatch {cfg.dispatch!r} routes jobs without regard "
                             "to the adapters servers serve)")
        self.stats = Stats()
        from petals_chain.orchestrator.routed import make_dispatch

        self.shares = make_shares(cfg, self.stats.registry)
        self.auditor = Auditor(self, cfg.audit_rate, tolerance=cfg.audit_tolerance, threshold=cfg.audit_strikes,
                               half_life_s=cfg.audit_half_life_s, probe_s=cfg.audit_probe_s,
                               registry=self.stats.registry)
        self.deadlines = DeadlineBook(counter=self.stats.m_deadlines)
        self.dispatch = make_dispatch(cfg.dispatch, wait_s=cfg.route_wait_s, max_queue=cfg.max_queue,
                                      shares=self.shares, schedule=cfg.schedule, steps_per_job=self._steps_per_job,
                                      classes=cfg.schedule_classes)
        if hasattr(self.dispatch, "serves_adapter"):
            self.dispatch.serves_adapter = lambda chain, adapter: all(
                self.server_serves_adapter(peer, adapter) for peer in chain.servers)
        self.sessions: dict[str, UserSession] = {}
        self.replay_cache = ReplayCache(int(cfg.replay_cache_mb * 2**20))
        self.prefix_directory = ChainPrefixes()  # what each chain's servers were given to cache
        self.started_at = time.time()  # a date (the OpenAI model's ``created``)
        self.started_mono = time.monotonic()  # for ``uptime_s``: a clock stepped back made it negative
        self.http_url = f"http://{url_host(cfg.host)}:{cfg.port}"
        self.local_url = self.http_url  # this API as this process reaches it (forward.py reruns cut streams here)
        self.dht = None
        self._owns_dht = True  # False when another model's orchestrator in this process runs the DHT node
        self.client = None
        self.planner: Planner | None = None
        self.groups: Any = None  # groups.GroupCoordinator with --group-with
        self.head = None
        self.tokenizer = None
        self.batcher: HeadBatcher | None = None
        self.drafter = None  # DraftModel (drafting.py) when --speculative draft:MODEL
        self._p2p = None
        # fresh dials to servers at their announced addresses (reachability checks; swarm/reachability.py)
        self.prober = Prober()
        self.frontdoor = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._eos: set[int] = set()
        self.token_text: TokenText | None = None  # logprobs' per-token bytes, text and offsets
        self.siblings: list[Orchestrator] = [self]  # the orchestrators of every model behind one router
        self.placer: Any = None  # placement.ModelPlacer of those models (several), for the summary
        self.chain_sessions: "weakref.WeakSet[ChainSession]" = weakref.WeakSet()
        self._bg_tasks: set[asyncio.Task] = set()
        self.draining = False  # stopping: new requests are refused (begin_drain)

    # ---- lifecycle -----------------------------------------------------------------------------
    def load_model(self) -> None:
        """Tokenizer, config and the head (embeddings, final norm, LM head) on ``--device``."""
        from petals_chain.swarm.checkpoint import load_head
        from petals_chain.swarm.sources import check_family

        src = self.source
        src.fingerprint  # noqa: B018 - every weight byte hashed here, in a thread (start() reads it on the loop)
        self.model_path = src.path
        self.config = src.config
        check_family(self.config)
        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        self.head = load_head(src, dtype=dtype, device=self.cfg.device)
        self.tokenizer = src.load_tokenizer()
        self.token_text = TokenText(self.tokenizer)
        eos = set(src.eos_token_ids())
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos = eos
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos and self.cfg.max_length > max_pos:
            raise ValueError(f"--max-length {self.cfg.max_length} exceeds the model's max_position_embeddings {max_pos}")
        if self.cfg.draft_model:
            self.drafter = self._load_drafter()
            self.stats.watch_drafter(self.drafter)  # petals_chain_speculative_draft_failures, read at each scrape

    def _load_drafter(self):
        from petals_chain.orchestrator.drafting import DraftModel
        from petals_chain.swarm.sources import resolve_source

        name = self.cfg.draft_model
        draft_src = src = self.source
        if name != "self":
            draft_src = resolve_source(name)
        if int(draft_src.config.vocab_size) != int(self.config.vocab_size):
            raise ValueError(f"draft model {name!r} has a vocabulary of {draft_src.config.vocab_size} tokens, the "
                             f"served model {self.config.vocab_size}: drafts need the same tokenizer")
        if draft_src is not src and draft_src.load_tokenizer().get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"draft model {name!r} does not share the served model's tokenizer")
        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        drafter = DraftModel.load(draft_src, name, num_layers=self.cfg.draft_layers, dtype=dtype, device=self.cfg.device)
        drafter.timeout_s = self.cfg.draft_timeout_s
        logger.info("draft model %s: %d decoder layers", name, drafter.layers)
        return drafter

    def model_spec(self) -> ModelSpec:
        """``L``, ``s_m``, ``s_c`` (bytes) from the model config at the swarm's max_length, rounded up to the KV pages
        of a default server (paged, 16 tokens), as the servers size theirs. A server whose record announces its own
        sizes (its dtype, quantization, KV pages) is planned with those (``Planner.own_sizes``)."""
        from petals_chain.swarm.memory import DEFAULT_PAGE_SIZE, block_bytes, cache_slot_bytes, slot_tokens

        dtype = None if self.cfg.dtype == "auto" else self.cfg.dtype
        tokens = slot_tokens("paged", self.cfg.max_length, DEFAULT_PAGE_SIZE)
        return ModelSpec(num_blocks=int(self.config.num_hidden_layers), block_size=block_bytes(self.config, dtype),
                         cache_size=cache_slot_bytes(self.config, dtype, tokens))

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

    async def start(self, shared: "Orchestrator | None" = None) -> None:
        """Start the DHT node, the planner and the background tasks. ``shared``: another model's orchestrator in
        this process (models.py), whose DHT node this one uses (and whose dial-back service answers servers)."""
        from petals_chain.swarm.dht import SwarmDHT
        from petals_chain.swarm.reachability import PetalsChainFrontdoor
        from petals_chain.swarm.rpc import ServerClient

        self._stop = asyncio.Event()
        if self.head is None:
            await asyncio.to_thread(self.load_model)
        self.batcher = HeadBatcher(self.head, window_s=self.cfg.head_window_s)
        self.batcher.on_batch = self.stats.m_head_batch.observe
        self._owns_dht = shared is None
        if shared is not None:
            self.dht = shared.dht
        else:
            dht_kwargs: dict = {"announce_maddrs": list(self.cfg.announce_maddrs)} if self.cfg.announce_maddrs else {}
            if self.cfg.relay_service:
                # go-libp2p serves as a relay only while it believes it is publicly reachable; servers dial us
                dht_kwargs["force_reachability"] = "public"
            try:
                self.dht = await asyncio.to_thread(
                    SwarmDHT.create, initial_peers=self.cfg.initial_peers, host_maddrs=self.cfg.host_maddrs,
                    identity_path=self.cfg.identity_path, prefix=self.prefix, **dht_kwargs)
            except Exception as e:  # hivemind's P2PDaemonError, protobuf's DecodeError, ...: a traceback before
                peers = f"via {list(self.cfg.initial_peers)}" if self.cfg.initial_peers else "(a new swarm)"
                key = f" with --identity-path {self.cfg.identity_path}" if self.cfg.identity_path else ""
                raise JoinError(f"the DHT node could not start {peers}{key}: {type(e).__name__}: {e}") from e
        self._p2p = await self.dht.replicate_p2p()
        if self._owns_dht:
            self.frontdoor = PetalsChainFrontdoor(self.prober)
            await self.frontdoor.add_p2p_handlers(self._p2p)
        self.client = ServerClient(self._p2p, step_timeout_s=self.cfg.step_timeout_s,
                                   model_fingerprint=self.source.fingerprint)
        self.planner = Planner(
            dht=self.dht, prefix=self.prefix, client=self.client, max_length=self.cfg.max_length,
            on_chains=self._on_chains, arrival_rate=self.cfg.arrival_rate, rho_bar=self.cfg.rho_bar,
            placement=self.cfg.placement, use_all_servers=self.cfg.use_all_servers,
            move_margin=self.cfg.move_margin, settle_s=self.cfg.settle_s,
            refresh_s=self.cfg.refresh_s, replan_interval_s=self.cfg.replan_interval_s,
            model_spec_fallback=self.model_spec, on_failure=self._abort_sessions_on,
            serialization_s=self.measure_serialization(), petals_cache_tokens=self.cfg.petals_cache_tokens,
            bprr_r=self.cfg.bprr_r, model_fingerprint=self.source.fingerprint,
            model_legacy_fingerprint=self.source.legacy_fingerprint, ban_base_s=self.cfg.ban_base_s,
            prober=self.prober,
            ban_max_s=self.cfg.ban_max_s, ban_reset_s=self.cfg.ban_reset_s, job_tokens=self.cfg.job_tokens,
            load_deadline_s=self.cfg.load_deadline_s, records_lost_s=self.cfg.records_lost_s)
        self.client.heartbeats = self._open_heartbeats
        if hasattr(self.dispatch, "attach"):  # routed dispatch (PETALS, BPRR) reads live server views
            self.dispatch.attach(self.planner)
        self._tasks = []
        if self.cfg.group_with:
            from petals_chain.orchestrator.groups import GroupCoordinator

            self.planner.group = set()  # nothing is ours before the first split
            self.groups = GroupCoordinator(dht=self.dht, prefix=self.prefix, peers=self.cfg.group_with,
                                           planner=self.planner, http_url=lambda: self.http_url,
                                           ttl_s=self.cfg.group_ttl_s, refresh_s=self.cfg.refresh_s)
            self._tasks.append(asyncio.create_task(self.groups.run(self._stop), name="groups"))
        self._tasks += [asyncio.create_task(self.planner.run(self._stop), name="planner"),
                       asyncio.create_task(self._summary_loop(), name="summary"),
                       asyncio.create_task(self._sample_backlog(), name="fairness-samples"),
                       asyncio.create_task(self._reap_sessions(), name="session-reaper")]
        if self.cfg.keepalive_tick_s > 0:
            self._tasks.append(asyncio.create_task(self._keep_alive(), name="keepalive"))
        if self.auditor.probe_s > 0:
            self._tasks.append(asyncio.create_task(self.auditor.probe_loop(self._stop), name="audit-probes"))

    @property
    def initial_peers(self) -> list[str]:
        return self.dht.visible_maddrs() if self.dht is not None else []

    async def stop(self) -> None:
        self._stop.set()
        await self.auditor.stop()
        self._leave_groups()  # a stop without a drain (an embedder's) leaves too
        if self._bg_tasks:  # closes of finished jobs' server sessions: a courtesy (a server frees the slots of a
            # stream that ends), so a server that went away first does not hold the shutdown for long
            _, pending = await asyncio.wait(list(self._bg_tasks), timeout=3)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for s in list(self.sessions.values()):
            await s.holder.close()
        self.sessions.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.batcher is not None:
            self.batcher.close()
        if self.drafter is not None:
            self.drafter.close()
        if self._p2p is not None:
            try:
                await self._p2p.shutdown()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.debug("p2p replica shutdown failed", exc_info=True)
            self._p2p = None
        if self.dht is not None and self._owns_dht:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None

    def begin_drain(self) -> int:
        """Stop taking work, as a stop with requests in flight begins (``__main__``): from now on the API refuses
        new requests (503 ``shutting_down``, api.ShutdownGate) and every request waiting in the queue for a chain is
        answered :class:`ShuttingDown` now (it was left to hang until the process was gone). Requests already served
        (and their failovers) go on. Returns how many queued requests were answered."""
        self.draining = True
        self._leave_groups()
        refuse = getattr(self.dispatch, "refuse_waiting", None)  # (routed baselines queue per server: cut later)
        return refuse(ShuttingDown) if refuse is not None else 0

    def _leave_groups(self) -> None:
        """Leave the HERD groups (once): the other orchestrators take this group over now, not ttl_s after the exit."""
        leave = getattr(self.groups, "leave", None)
        if leave is not None and not getattr(self.groups, "leaving", False):
            self._background(leave())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)

    def _open_heartbeats(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record says it heartbeats a queued open (see ServerClient.open_session)."""
        view = self.planner.servers.get(peer_id) if self.planner is not None else None
        return bool(view is not None and view.record is not None and view.record.open_heartbeats)

    def _abort_sessions_on(self, peer_id: str) -> None:
        """Jobs waiting on a server declared failed fail over now (not at their step timeout)."""
        for cs in list(self.chain_sessions):
            cs.abort(peer_id)

    def _on_chains(self, chains: list[Chain]) -> None:
        self.dispatch.set_chains(chains)
        self.prefix_directory.retain(chains)  # the chains re-planned away hold nothing a job is steered to

    def observe_hop(self, peer_id: str, n_tokens: int, n_blocks: int, seconds: float | None,
                    compute_s: float | None = None) -> None:
        self.stats.hop_s += seconds if seconds is not None else (compute_s or 0.0)
        if self.planner is not None:
            self.planner.observe_hop(peer_id, n_tokens, n_blocks, seconds, compute_s)

    def server_failed(self, e: HopFailure) -> None:
        """A hop failed: unless it was a refusal the server sent, ban the server from the plan at once (a dead
        server, and one whose reply was invalid: shape, dtype, NaN, chunking)."""
        if isinstance(e.cause, RemoteError) and not isinstance(e.cause, ConnectionError):
            return  # the server answered: it lives (e.g. lost the session on re-assignment or to its idle timeout)
        if out_of_descriptors(e.cause):
            return  # this process is out of open files (ulimit -n): the server is not to blame (the planner warns)
        if self.planner is not None:
            self.planner.report_failure(e.peer_id, reason=f"{type(e.cause).__name__}: {e.cause}")

    def server_serves_adapter(self, peer_id: str, adapter: str) -> bool:
        """Whether ``peer_id``'s latest record announces the LoRA adapter fingerprint ``adapter``."""
        view = self.planner.servers.get(peer_id) if self.planner is not None else None
        return view is not None and view.record is not None and adapter in view.record.adapters

    def replacement_servers(self, start: int, end: int) -> list[str]:
        """Servers that could take blocks ``[start, end)`` of a failed hop over (see ``Planner.replacements``)."""
        return self.planner.replacements(start, end) if self.planner is not None else []

    def _schedule_json(self) -> dict:
        """``--schedule`` and its pauses; with ``db``/``mlfq`` the learnt ``L̂_s``, ``σ_s`` of each service (s)."""
        d = self.dispatch
        out = {"name": self.cfg.schedule, "paused": self.stats.pauses,
               "priority_preemptions": getattr(d, "priority_preemptions", 0),
               "starvation_promotions": getattr(d, "starvation_promotions", 0)}
        if getattr(d, "priorities", None) is not None:
            out["services"] = {str(k): {"mean_exec_s": round(st.mean, 4), "std_exec_s": round(st.std, 4),
                                        "completed": st.count} for k, st in d.priorities.monitor.stats.items()}
        if getattr(d, "length_classes", None) is not None:
            out["classes"] = d.length_classes.describe()
        return out

    def _steps_per_job(self) -> float:
        """The planner's steps per job (``T_k`` covers that many), for the deadline prediction."""
        return self.planner.steps_per_job if self.planner is not None else 17.0

    @property
    def ready(self) -> bool:
        return bool(self.dispatch.chains)

    @property
    def uptime_s(self) -> float:
        """Seconds since this orchestrator was made (monotonic: clock steps do not change it)."""
        return time.monotonic() - self.started_mono

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

    def check_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        bad = [i for i in ids if not (0 <= int(i) < vocab)]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt",
                               code="invalid_token_id")

    def validate_prompt(self, ids: list[int], max_tokens: int, explicit: bool, *, max_length: int | None = None,
                        field: str = "max_tokens") -> int:
        """Refuse (RequestError) an empty prompt, unknown token ids, or one that leaves no room to generate; else the
        most tokens it may generate (an implicit limit ends where the context does). ``field``: the body field the
        limit came in (``max_completion_tokens`` for a chat request that sent it)."""
        if not ids:
            raise RequestError("the prompt is empty", param="prompt", code="empty_prompt")
        self.check_ids(ids)
        return self._max_tokens(max_tokens, len(ids), max_length or self.cfg.max_length, explicit,
                                session=max_length is not None, field=field)

    @staticmethod
    def _max_tokens(max_tokens: int, used: int, max_length: int, explicit: bool, session: bool = False,
                    field: str = "max_tokens") -> int:
        """Tokens to generate after ``used`` context tokens: an implicit limit shrinks to the room left, an
        explicit one that does not fit is refused (OpenAI's behaviour). ``session``: ``max_length`` is a session's
        (the error names it, not the model's context); ``field``: the body field the error names."""
        room = max_length - used
        scoring = explicit and max_tokens == 0  # a prompt scored, echoed: it may fill the whole context
        if room < 0 or (room == 0 and not scoring):
            raise context_length_error(used, max_length, session=session, scoring=scoring)
        if not explicit:
            return min(max_tokens, room)
        if max_tokens > room:
            raise context_length_error(used, max_length, max_tokens=max_tokens, limit_field=field, session=session)
        return max_tokens

    # ---- state ---------------------------------------------------------------------------------
    def swarm_json(self) -> dict[str, Any]:
        """The ``GET /api/v1/swarm`` object (contracts E)."""
        p = self.planner
        current = p.current if p is not None else None
        servers = p.server_json() if p is not None else []
        for s in servers:  # what audits found (verified chains): audits, strikes, decayed score, ban
            s["trust"] = self.auditor.server_json(s["peer_id"])
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
            "version": build_version(),  # this orchestrator's build: the signed summary tells the standalone dashboard
            # the model's blocks (the page's coverage bar; else it would take the largest span any record claims)
            "num_blocks": int(self.source.config.num_hidden_layers),
            "ready": self.ready, "initial_peers": self.initial_peers, "http_url": self.http_url,
            "epoch": p.epoch if p is not None else 0, "placement_policy": self.cfg.placement,
            "dispatch_policy": self.cfg.dispatch, "c": p.plan.c if p is not None and p.plan is not None else None,
            "arrival_rate": p.arrival_rate if p is not None else (self.cfg.arrival_rate or 0.0),
            "arrival_rate_mode": "fixed" if self.cfg.arrival_rate is not None else "auto",
            "rho_bar": self.cfg.rho_bar, "predicted_response_s": predicted, "measured": self.stats.measured(),
            "job_tokens": self._job_tokens_json(),
            "audit": self.auditor.json(),
            "groups": self.groups.json() if self.groups is not None else None,
            "fairness": self.shares.json(self.dispatch.waiting_jobs()),
            "deadlines": {"schedule": self.cfg.schedule, **self.deadlines.json(), "paused": self.stats.pauses},
            "schedule": self._schedule_json(),
            "queue_length": self.dispatch.queue_length, "running": self.dispatch.running,
            # maxima and counts since start (exact, unlike samples of queue_length): queue_max <= max_queue
            "queue_max": self.dispatch.queue_max, "max_queue": self.dispatch.max_queue,
            "queue_refused": self.dispatch.refused,
            "queue_share_refused": getattr(self.dispatch, "share_refused", 0), "requeued": self.dispatch.requeued,
            # places held for the later jobs of admitted requests (n > 1, several prompts): queue_length + these
            # stay within max_queue for new requests
            "queue_places_held": getattr(self.dispatch, "places_held", 0),
            # and the free slots held for those of them the queue had no place for (new jobs queue instead)
            "queue_slots_held": getattr(self.dispatch, "slots_held", 0),
            "sessions": len(self.sessions), "updated_at": time.time(), "servers": servers, "chains": chains,
            "history": list(self.stats.history)[-200:],
            "plans": list(p.plan_log)[-10:] if p is not None else [],
            "relay": {"tokens": self.stats.tokens, "relay_steps": self.stats.relay_steps, "hop_s": self.stats.hop_s,
                      "service_s": self.stats.service_s, "failovers": self.stats.failovers,
                      "lm_head_batches": self.batcher.batches if self.batcher else 0,
                      "lm_head_rows": self.batcher.rows if self.batcher else 0, "forks": self.stats.forks,
                      **self.stats.replay_json(), **self.stats.prefix_json(),
                      "speculative": {"default": self.cfg.speculative,
                                      "draft_model": (None if self.drafter is None else
                                                      {"name": self.drafter.name, "layers": self.drafter.layers}),
                                      **self.stats.speculation_json()},
                      "mode": self.cfg.relay, **self.stats.legs_json(),
                      "preferred_starts": self.dispatch.preferred_starts,
                      "replay_cache": {"bytes": self.replay_cache.bytes, "budget_bytes": self.replay_cache.budget,
                                       "jobs": self.replay_cache.jobs, "evictions": self.replay_cache.evictions}},
        }

    def summary_json(self) -> dict[str, Any]:
        """What the signed summary publishes: :meth:`swarm_json`, and with several models behind one router what the
        router adds to ``/api/v1/swarm`` (models.py ``models_json``): the standalone dashboard learns the other
        models' DHT prefixes from it, and shows the same model links as this page."""
        summary = self.swarm_json()
        if len(self.siblings) > 1:
            from petals_chain.orchestrator.models import models_json

            summary.update(models_json({o.model_id: o for o in self.siblings}, self.model_id, self.placer))
        return summary

    def _job_tokens_json(self) -> dict:
        """``L^`` (what paged servers' chain capacities count per job), how it is set and what it is learnt from; how
        jobs' reservations went (opens that waited for pages, extensions, preemptions)."""
        p, st = self.planner, self.stats
        if p is None:
            value, mean, observed = self.cfg.job_tokens or self.cfg.max_length, 0.0, 0
        else:
            value, mean, observed = p.job_tokens.value, p.job_tokens.mean, p.job_tokens.observed
        return {"value": value, "mode": "fixed" if self.cfg.job_tokens is not None else "auto",
                "mean_declared": mean, "jobs_observed": observed, "output_reserve_tokens": self.cfg.output_reserve_tokens,
                "open_waits": st.open_waits, "open_rewaits": st.open_rewaits, "extensions": st.extensions,
                "preemptions": st.preemptions}

    def update_gauges(self) -> None:
        s = self.stats
        s.m_queue.set(self.dispatch.queue_length)
        s.m_queue_max.set(self.dispatch.queue_max)
        s.m_queue_bound.set(self.dispatch.max_queue if self.dispatch.max_queue is not None else float("inf"))
        s.m_queue_refused.set(self.dispatch.refused)
        s.m_requeued.set(self.dispatch.requeued)
        s.m_places_held.set(getattr(self.dispatch, "places_held", 0))
        s.m_slots_held.set(getattr(self.dispatch, "slots_held", 0))
        s.m_chain_max_active.clear()  # only the current chains: a chain gone from the plan drops its series
        for k in range(len(self.dispatch.chains)):
            s.m_chain_max_active.labels(str(self.dispatch.chain_ids[k])).set(self.dispatch.peak_active(k))
        s.m_running.set(self.dispatch.running)
        s.m_chains.set(len(self.dispatch.chains))
        s.m_capacity.set(sum(ch.capacity for ch in self.dispatch.chains))
        s.m_ready.set(1 if self.ready else 0)
        s.m_replay_bytes.set(self.replay_cache.bytes)
        s.m_replay_budget.set(self.replay_cache.budget)
        s.m_replay_evictions.set(self.replay_cache.evictions)
        self.shares.update_gauge(self.dispatch.waiting_jobs())
        s.m_goodput.set(self.deadlines.goodput())
        if self.planner is not None:
            s.m_epoch.set(self.planner.epoch)
            s.m_arrival.set(self.planner.arrival_rate)
            s.m_job_tokens.set(self.planner.job_tokens.value)
            cur = self.planner.current
            if cur is not None and cur.chains and math.isfinite(cur.lower):
                s.m_lower.set(cur.lower)
                s.m_upper.set(cur.upper if math.isfinite(cur.upper) else float("nan"))
            else:  # no chain: no prediction (the last plan's bounds would outlive it)
                s.m_lower.set(float("nan"))
                s.m_upper.set(float("nan"))
            s.m_server_cache.clear()  # only servers known now
            s.m_server_step.clear()
            for v in self.planner.servers.values():
                # by peer id: two servers of one name (an operator's two GPUs, or a stranger taking an honest
                # server's name) would write one series
                who = (v.peer_id, v.record.public_name)
                s.m_server_cache.labels(*who, "total").set(v.record.cache_tokens_total)
                s.m_server_cache.labels(*who, "free").set(v.record.cache_tokens_free)
                for part, value in self.planner.hop_step_s(v).items():
                    if value is not None:
                        s.m_server_step.labels(*who, part).set(value)
            counts: dict[str, int] = {}
            for v in self.planner.servers.values():
                st = "failed" if v.failed_at is not None or v.load_failed else v.record.state
                counts[st] = counts.get(st, 0) + 1
            for st in ("joining", "online", "draining", "offline", "failed"):
                s.m_servers.labels(st).set(counts.get(st, 0))

    async def _sample_backlog(self) -> None:
        """Which clients have requests waiting, once a second: Jain's index compares those backlogged throughout."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=FAIRNESS_SAMPLE_S)
                return
            except asyncio.TimeoutError:
                self.shares.sample(self.dispatch.waiting_jobs())

    async def _summary_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.cfg.summary_interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                summary = json_safe(self.summary_json())  # no inf/nan: JSON readers (browsers) reject them
                expiration_s = max(30.0, 3 * self.cfg.summary_interval_s)
                await asyncio.to_thread(self.dht.publish_summary, self.prefix, summary, expiration_s)
                # the directory entry lets a dashboard find this swarm from --initial-peers alone (one entry per DHT
                # node: with several models, the first model's; the API and its dashboard serve them all)
                if self._owns_dht:
                    await asyncio.to_thread(self.dht.publish_directory, self.prefix, self.model_id, self.http_url,
                                            expiration_s)
            except Exception:  # noqa: BLE001 - a failed publish is retried next period
                logger.warning("publishing the swarm summary failed", exc_info=True)
