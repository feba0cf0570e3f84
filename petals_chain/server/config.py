"""ServerConfig: everything a volunteer sets on the command line (``python -m petals_chain.server --help``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from petals_chain.server.admission import (DEFAULT_MAX_KV_SHARE_PER_STRANGER, DEFAULT_MAX_KV_SHARE_STRANGERS,
                                           StrangerShares, check_share)
from petals_chain.swarm.emulation import Emulation

DEFAULT_MAX_LENGTH = 2048  # slots are sized for this many tokens until an assignment says otherwise


@dataclass
class ServerConfig:
    model: str
    extra_models: Sequence[str] = ()  # more models the volunteer offers (server/models.py); one is served at a time
    adapters: Sequence[str] = ()  # --adapter values: LoRA adapters, NAME=PATH or MODEL:NAME=PATH (server/models.py)
    initial_peers: Sequence[str] = ()
    dht_prefix: Optional[str] = None
    memory_bytes: Optional[int] = None
    device: str = "cpu"
    dtype: str = "auto"
    quant: str = "none"
    public_name: str = ""
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: Sequence[str] = ()  # what peers are told to dial (default: what the daemon listens on)
    nat_relay: str = "auto"  # auto: relay through the orchestrator if it cannot dial us | always | never
    relay_wait_s: float = 60.0  # how long a relayed server waits for its relay reservation to work
    identity_path: Optional[str] = None
    client_mode: bool = False
    max_length: Optional[int] = None  # None: the assignment's max_length (DEFAULT_MAX_LENGTH until one arrives)
    max_blocks: int = 0  # the volunteer's cap on hosted blocks (0: as many as the memory budget allows)
    trust_orchestrator: Sequence[str] = ()  # empty: the peer ids named in initial_peers
    allow_any_client: bool = False
    # with allow_any_client: parts of the KV pool one untrusted peer, and all of them together, may hold
    max_kv_share_per_stranger: float = DEFAULT_MAX_KV_SHARE_PER_STRANGER
    max_kv_share_strangers: float = DEFAULT_MAX_KV_SHARE_STRANGERS
    tau_p: Optional[float] = None  # None: measure (cached); else use this value (s/block/job, unscaled)
    profile_l_in: int = 128
    profile_l_out: int = 16
    profile_cache: Optional[str] = None
    refresh_s: float = 30.0
    assignment_poll_s: float = 3.0
    idle_timeout_s: float = 120.0
    drain_timeout_s: float = 60.0
    progress: Optional[bool] = None
    cache_tokens_per_block: int = 0  # > 0: PETALS-style fixed cache, at most this many tokens per block
    batching: bool = True  # run concurrent sessions' steps together (one forward per block); False: one at a time
    kv_cache: str = "paged"  # paged | slots (server/kv_cache.py)
    page_size: int = 16  # tokens per KV page (paged mode)
    prefix_cache: bool = True  # keep finished sessions' full pages for prompts with the same prefix (paged mode)
    decode_graph: str = "off"  # off | cuda | eager: one session's one-token steps with static shapes (decode_graph.py)
    max_waiters: int = 256  # opens waiting for slots (wait_s > 0), FIFO
    max_wait_s: float = 600.0
    # Testbed emulation (swarm/emulation.py), all shown in the server record:
    emulate_rtt_ms: float = 0.0
    emulate_compute_scale: float = 1.0
    emulate_step_ms: float = 0.0  # t_o, ms per block, once per session (its first step)
    emulate_prefill_ms_per_token: float = 0.0  # t_I, ms per block per token of a multi-token step
    emulate_decode_ms: float = 0.0  # t_O, ms per block per token of a one-token step
    emulate_reply_fault: str = "none"  # chaos runs: none | nan | shape
    emulate_reply_fault_rate: float = 0.0  # fraction of step replies corrupted
    emulate_tau_p_lie: float = 1.0  # announce tau_p this many times better than measured

    def validate(self) -> None:
        """ValueError naming the first option whose value the server could not run with (an option accepted and
        then failing later, e.g. a record the DHT refuses or every session refused, leaves a volunteer guessing)."""
        def number(flag: str, value: object, *, positive: bool) -> None:
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                raise ValueError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")

        if self.tau_p is not None:
            number("--tau-p", self.tau_p, positive=True)
        if self.memory_bytes is not None:  # NaN failed in int() later, inf with an OverflowError, "8GB" in int()
            number("memory_bytes (--memory-bytes)", self.memory_bytes, positive=True)
        for flag, value in (("--refresh-s", self.refresh_s), ("--assignment-poll-s", self.assignment_poll_s),
                            ("--idle-timeout-s", self.idle_timeout_s), ("--max-wait-s", self.max_wait_s)):
            number(flag, value, positive=True)
        if self.refresh_s > 3600:  # the record lives 3 x as long; readers drop records that claim over 6 h
            raise ValueError(f"--refresh-s must be at most 3600, got {self.refresh_s!r}")
        number("--drain-timeout-s", self.drain_timeout_s, positive=False)
        number("relay_wait_s", self.relay_wait_s, positive=False)
        for flag, value in (("--profile-l-in", self.profile_l_in), ("--profile-l-out", self.profile_l_out),
                            ("--page-size", self.page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        self.stranger_shares()

    def stranger_shares(self) -> StrangerShares:
        """What untrusted peers may hold of the KV pool (validated: ValueError naming the flag)."""
        return StrangerShares(check_share("--max-kv-share-per-stranger", self.max_kv_share_per_stranger),
                              check_share("--max-kv-share-strangers", self.max_kv_share_strangers))

    def emulation(self) -> Emulation:
        """The emulation knobs (validated: ValueError naming the bad one)."""
        return Emulation(rtt_ms=self.emulate_rtt_ms, compute_scale=self.emulate_compute_scale,
                         step_ms=self.emulate_step_ms, prefill_ms_per_token=self.emulate_prefill_ms_per_token,
                         decode_ms=self.emulate_decode_ms, reply_fault=self.emulate_reply_fault,
                         reply_fault_rate=self.emulate_reply_fault_rate, tau_p_lie=self.emulate_tau_p_lie)
