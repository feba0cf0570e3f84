"""Record schemas of the swarm DHT (pydantic v2 for code, pydantic.v1 twins for hivemind's SchemaValidator).

A value is stored as a plain msgpack dict (``record.to_value()``); every field is always present, numbers
have exact types (int vs float), so hivemind's :class:`~hivemind.dht.schema.SchemaValidator` (which
forbids type conversions) accepts what :meth:`to_value` writes.

Peers of different versions share a swarm, so the wire format is tolerant where it can be: a reader ignores fields
it does not know (a newer writer's, at most ``MAX_UNKNOWN_FIELDS`` of them) and fills the fields an older writer
did not have from their defaults; the fields every version wrote (and every type) stay strict. A value of a field
with a fixed set of values (a server's ``state``, ``kv_cache``, ``reachability``) that this version does not know is
read as the field's fallback (``OPEN_ENUMS``: an unknown state is planned as ``offline``), and what the writer said
is kept in :attr:`ServerRecord.unread` for dashboards; the DHT validator takes any short name there. A server
announces the wire protocols it speaks (``protocol_min``..``protocol``; a record without them is an older server's:
protocol 1), and :meth:`ServerRecord.protocol_problem` says why this version cannot drive one. In code, records are
still built strictly (a misspelt field or an unknown value is an error); :meth:`from_value` is the tolerant reader.
"""

from __future__ import annotations

import json
import re
import time
import typing
from typing import Annotated, Any, Dict, Literal, Optional

import pydantic
import pydantic.v1 as pv1
from hivemind.dht.schema import BytesWithPublicKey

from petals_chain.swarm.logs import one_line
from petals_chain.swarm.version import build_version

# the build this peer runs (swarm/version.py: package version + git commit), so an operator can tell old peers apart
RECORD_VERSION = build_version()
STATES = ("joining", "online", "draining", "offline")
# The wire protocol of the RPC (swarm/rpc.py) and the records: bumped only by a change a peer of the previous one
# cannot follow (additions with a fallback, the usual kind, keep it). This version speaks PROTOCOL and drives servers
# down to MIN_PROTOCOL; a record that does not say (every server before the field) speaks protocol 1 only.
PROTOCOL = 1
MIN_PROTOCOL = 1
OLDEST_PROTOCOL = 1
_PROTOCOL_MAX = 1 << 16
# Fields with a fixed set of values a newer writer may extend: one this version does not know is read as the
# fallback here (what it can do is unknown: a state is planned as offline, neither offered jobs nor given blocks).
OPEN_ENUMS = {"state": "offline", "kv_cache": "paged", "reachability": "unknown", "emulate_reply_fault": "none"}
_ENUM_NAME_RE = r"^[a-z][a-z0-9_.-]{0,31}$"  # what the DHT validator accepts in them: a short name
_PEER_ID_MAX = 128
# A newer writer's fields this version does not know: accepted (and ignored) up to this many, names this long.
MAX_UNKNOWN_FIELDS = 16
_UNKNOWN_FIELD_NAME_MAX = 64
_UNKNOWN_VALUES_MAX = 4096  # a newer writer's fields together, in characters of their repr, nested at most 4 deep
_SHORT_MAX = 64  # names like a version, device, dtype or quantization
PUBLIC_NAME_MAX = 128  # ServerRecord.public_name
ADAPTERS_MAX = 8  # ServerRecord.adapters: LoRA adapters a server announces for one model (swarm/lora.py)
_ADAPTER_KEY_MAX = 64  # an adapter fingerprint, or its name
LOAD_ERROR_MAX = 300  # ServerRecord.load_error: one line for the operator and the dashboard
# the largest epoch a record may carry: honest epochs count re-plans; one of 2**64 - 1 left a leader continuing above it
# with an epoch msgpack cannot encode, so no assignment or split could be published again
EPOCH_MAX = 2 ** 53
# a tau_p (s/block/job) is read within these bounds (0, still profiling, stays 0): one of 5e-324 made the placer's
# speed estimate (a reference over it) infinite, so every placement round raised; one of 1e308 overflowed GBP-CR's
# times. No block computes in under a nanosecond, and a server slower than this is as good as none.
TAU_P_MIN = 1e-9
TAU_P_MAX = 1e6


def check_unknown_values(values: list) -> None:
    """ValueError unless a newer writer's field values are small: at most :data:`_UNKNOWN_VALUES_MAX` characters
    of scalars and strings together, nested at most 4 deep (they are kept, and passed on, as they are: a record
    of several MB made the lookups of every record under its key fail)."""
    budget = _UNKNOWN_VALUES_MAX
    stack = [(v, 0) for v in values]
    while stack:
        v, depth = stack.pop()
        if depth > 4:
            raise ValueError("an unknown field's value is nested more than 4 deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
            budget -= 1
        elif isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v)
            budget -= 1
        else:
            budget -= len(v) if isinstance(v, (str, bytes)) else 8
        if budget < 0:
            raise ValueError(f"unknown fields hold more than {_UNKNOWN_VALUES_MAX} characters")


class _Record(pydantic.BaseModel):
    """A DHT record: strict when built in code, tolerant of newer writers' fields when read off the DHT."""

    # inf and NaN are refused: a peer's record with tau_p = inf (or a timestamp of inf, fresh forever) reached the
    # planner, whose every plan then failed on it
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    _unread: dict[str, str] = pydantic.PrivateAttr(default_factory=dict)

    @classmethod
    def from_value(cls, value: Any) -> "_Record":
        """Validate a DHT value, ignoring fields this version does not know (a newer peer's); ``timestamp`` must
        be there (its default is now: a record without one would look fresh)."""
        if isinstance(value, dict):
            if "timestamp" in cls.model_fields and "timestamp" not in value:
                raise ValueError("the record has no timestamp")
            unknown = [k for k in value if k not in cls.model_fields]
            if len(unknown) > MAX_UNKNOWN_FIELDS:
                raise ValueError(f"{len(unknown)} unknown fields (at most {MAX_UNKNOWN_FIELDS})")
            check_unknown_values([value[k] for k in unknown])
            value = {k: v for k, v in value.items() if k in cls.model_fields}
            value, unread = cls._read_open_values(value)
            record = cls.model_validate(value)
            record._unread = unread
            return record
        return cls.model_validate(value)

    @classmethod
    def _read_open_values(cls, value: dict) -> tuple[dict, dict[str, str]]:
        """``value`` with what an older or newer writer says differently than this version: none here."""
        return value, {}

    def to_value(self) -> dict:
        """The msgpack-able DHT value (all fields, exact numeric types)."""
        return self.model_dump()

    @property
    def unread(self) -> dict[str, str]:
        """The values a newer writer announced that this version does not know, read as their fallbacks
        (:data:`OPEN_ENUMS`): ``{field: value as announced}`` (one printable line, at most 32 characters)."""
        return dict(self._unread)


class ServerRecord(_Record):
    """What a server announces under ``{prefix}.servers`` (memory in bytes, tau_p in s/block/job)."""

    peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    version: str = pydantic.Field(default=RECORD_VERSION, max_length=_SHORT_MAX)
    state: Literal["joining", "online", "draining", "offline"]
    memory_bytes: int = pydantic.Field(ge=0)  # M_j
    tau_p: float = pydantic.Field(ge=0)  # s/block/job, footnote-11 workload, emulation scale included
    device: str = pydantic.Field(default="cpu", max_length=_SHORT_MAX)
    dtype: str = pydantic.Field(default="float32", max_length=_SHORT_MAX)
    quant: str = pydantic.Field(default="none", max_length=_SHORT_MAX)
    start_block: int = pydantic.Field(default=0, ge=0)  # a_j (0-based)
    num_blocks: int = pydantic.Field(default=0, ge=0)  # m_j; 0 while nothing is loaded
    slots_total: int = pydantic.Field(default=0, ge=0)
    slots_free: int = pydantic.Field(default=0, ge=0)
    public_name: str = pydantic.Field(default="", max_length=PUBLIC_NAME_MAX)
    max_length: int = pydantic.Field(default=0, ge=0)  # the max_length the slots are sized for
    s_m_bytes: int = pydantic.Field(default=0, ge=0)
    s_c_bytes: int = pydantic.Field(default=0, ge=0)
    emulate_rtt_ms: float = pydantic.Field(default=0.0, ge=0)
    emulate_compute_scale: float = pydantic.Field(default=1.0, gt=0)
    # test-only faults (chaos runs): a fraction of step replies corrupted; tau_p announced this many times better
    emulate_reply_fault: Literal["none", "nan", "shape", "noise", "push"] = "none"
    emulate_reply_fault_rate: float = pydantic.Field(default=0.0, ge=0, le=1)
    emulate_tau_p_lie: float = pydantic.Field(default=1.0, gt=0)
    # assignment epoch the server follows (-1: none yet)
    epoch: int = pydantic.Field(default=-1, ge=-1, le=EPOCH_MAX)
    model_fingerprint: str = pydantic.Field(default="", max_length=64)  # sources.ModelSource.fingerprint
    max_blocks: int = pydantic.Field(default=0, ge=0)  # the volunteer's cap on blocks (0: no cap)
    # the KV cache (server/kv_cache.py): paged (tokens per page) or slots (a page is a max_length slot); tokens
    # of K/V summed over the hosted blocks, and what a new session may still reserve of them
    kv_cache: Literal["paged", "slots"] = "paged"
    page_size: int = pydantic.Field(default=0, ge=0)
    cache_tokens_total: int = pydantic.Field(default=0, ge=0)
    cache_tokens_free: int = pydantic.Field(default=0, ge=0)
    # the sessions it takes at once whatever their length (its open-files limit's cap), -1: no cap, or an older server
    # which does not say; a planner counts no more of its jobs than this, however many short ones its tokens hold
    max_sessions: int = pydantic.Field(default=-1, ge=-1)
    # the prefix cache: on or off; prompt tokens sessions named at open, and how many of them came from the cache
    prefix_cache: bool = False
    prefix_offered_tokens: int = pydantic.Field(default=0, ge=0)
    prefix_reused_tokens: int = pydantic.Field(default=0, ge=0)
    # where other peers dial it (swarm/reachability.py): its announced addresses, or relay circuits; and how the
    # orchestrator reached it when the server asked (unknown: not asked, or nobody answered)
    maddrs: list[Annotated[str, pydantic.StringConstraints(max_length=300)]] = pydantic.Field(default_factory=list,
                                                                                        max_length=8)
    reachability: Literal["unknown", "direct", "relayed", "unreachable"] = "unknown"
    # several models (orchestrator/placement.py): the DHT prefixes of every model this server may serve (its
    # --model list; empty: only the one it is published under) and the one it holds or is loading ("": none yet)
    models: list[Annotated[str, pydantic.StringConstraints(max_length=128)]] = pydantic.Field(default_factory=list,
                                                                                          max_length=8)
    serving: str = pydantic.Field(default="", max_length=128)
    # it answers a queued open's heartbeat_s with "still waiting" replies (swarm/rpc.py; older servers do not)
    open_heartbeats: bool = False
    # the assigned span it could not load ([start_block, num_blocks]; [] for none) and why ("" for none): planners
    # plan around it until it loads a span or restarts (an older server announces neither and is planned as before)
    failed_span: list[Annotated[int, pydantic.Field(ge=0)]] = pydantic.Field(default_factory=list, max_length=2)
    load_error: str = pydantic.Field(default="", max_length=LOAD_ERROR_MAX)
    # the volunteer's --cache-tokens-per-block (0: none): its slots in m blocks are at most m x this // max_length
    # whatever its memory, so a planner can size a span it has not loaded yet (an older server: planned by memory)
    cache_tokens_per_block: int = pydantic.Field(default=0, ge=0)
    # wall time its process started (0: an older server, which does not say): a new value is a restart, which forgets
    # what the orchestrator learnt of its last run (the models it could not load), however soon it came back
    started_at: float = pydantic.Field(default=0.0, ge=0)
    # with --allow-any-client: of slots_free, the slots a peer the server does not trust (holding none there yet) may
    # open now, the strangers' shares and the trusted orchestrators' reserve applied (0: it serves no stranger; -1: an
    # older server, which does not say): see slots_free_for
    stranger_slots_free: int = pydantic.Field(default=-1, ge=-1)
    # the LoRA adapters it serves with this model (swarm/lora.py): {adapter fingerprint: its name, a label}; a session
    # opened naming another fingerprint is refused (an older server announces none)
    adapters: Dict[Annotated[str, pydantic.StringConstraints(min_length=1, max_length=_ADAPTER_KEY_MAX)],
                   Annotated[str, pydantic.StringConstraints(max_length=_ADAPTER_KEY_MAX)]] = pydantic.Field(
        default_factory=dict, max_length=ADAPTERS_MAX)
    # the wire protocols it speaks: the newest, and the oldest client protocol it still serves (absent: 1 and 1)
    protocol: int = pydantic.Field(default=PROTOCOL, ge=1, le=_PROTOCOL_MAX)
    protocol_min: int = pydantic.Field(default=OLDEST_PROTOCOL, ge=1, le=_PROTOCOL_MAX)
    timestamp: float = pydantic.Field(default_factory=time.time)

    @classmethod
    def _read_open_values(cls, value: dict) -> tuple[dict, dict[str, str]]:
        """An older server's record says no protocol (it speaks the oldest); a newer one's enum value this version
        does not know is read as the field's fallback, and kept as said in ``unread``."""
        value = {"protocol": OLDEST_PROTOCOL, "protocol_min": OLDEST_PROTOCOL, **value}
        unread = {}
        for name, fallback in OPEN_ENUMS.items():
            said = value.get(name)
            if isinstance(said, str) and said not in typing.get_args(cls.model_fields[name].annotation):
                if not re.fullmatch(_ENUM_NAME_RE, said):
                    raise ValueError(f"{name} {one_line(said)[:40]!r} is not a short name")
                unread[name] = said
                value[name] = fallback
        return value, unread

    def protocol_problem(self) -> str:
        """Why this version cannot drive the server by its announced protocols ("" when it can)."""
        said = f"{self.protocol_min}..{self.protocol}" if self.protocol_min < self.protocol else f"{self.protocol}"
        ours = f"{MIN_PROTOCOL}..{PROTOCOL}" if MIN_PROTOCOL < PROTOCOL else f"{PROTOCOL}"
        if self.protocol_min > PROTOCOL:
            return (f"it speaks wire protocol {said} ({self.version}), this petals-chain {ours}: a newer server, "
                    "upgrade the orchestrator")
        if self.protocol < MIN_PROTOCOL:
            return (f"it speaks wire protocol {said} ({self.version}), this petals-chain {ours}: an older server, "
                    "upgrade it")
        return ""

    # every free text a peer writes is shown (dashboards) or logged: a bidi override in its device reversed the rest
    # of its row on the page
    @pydantic.field_validator("public_name", "load_error", "version", "device", "dtype", "quant", "serving")
    @classmethod
    def _printable(cls, text: str) -> str:
        return one_line(text)

    @pydantic.field_validator("models")
    @classmethod
    def _printable_models(cls, names: list[str]) -> list[str]:
        return [one_line(name) for name in names]

    @pydantic.field_validator("adapters")
    @classmethod
    def _printable_adapters(cls, adapters: dict[str, str]) -> dict[str, str]:
        return {one_line(fp): one_line(name) for fp, name in adapters.items()}

    @pydantic.field_validator("tau_p")
    @classmethod
    def _plausible_tau_p(cls, tau_p: float) -> float:
        # clamped, not refused: a server announcing its own tau_p (--emulate-tau-p-lie divides it) must not fail to
        # build its record, and a peer's claim is only a claim (the planner plans by what it measures)
        return tau_p if tau_p == 0 else min(max(tau_p, TAU_P_MIN), TAU_P_MAX)

    @pydantic.model_validator(mode="after")
    def _check_slots(self) -> "ServerRecord":
        if self.slots_free > self.slots_total:
            raise ValueError(f"slots_free {self.slots_free} > slots_total {self.slots_total}")
        if self.cache_tokens_free > self.cache_tokens_total:
            raise ValueError(f"cache_tokens_free {self.cache_tokens_free} > cache_tokens_total "
                             f"{self.cache_tokens_total}")
        if len(self.failed_span) not in (0, 2):
            raise ValueError(f"failed_span must be [] or [start_block, num_blocks], got {self.failed_span}")
        if self.protocol_min > self.protocol:
            raise ValueError(f"protocol_min {self.protocol_min} > protocol {self.protocol}")
        if self.stranger_slots_free > self.slots_free:
            raise ValueError(f"stranger_slots_free {self.stranger_slots_free} > slots_free {self.slots_free}")
        return self

    def slots_free_for(self, trusted: bool) -> int:
        """The free slots a peer can plan on: ``slots_free`` if the server trusts it, else ``stranger_slots_free``
        (the trusted orchestrators' reserve and the strangers' shares are not its to take; an older server's record
        does not say, and ``slots_free`` it is)."""
        return self.slots_free if trusted or self.stranger_slots_free < 0 else self.stranger_slots_free

    def session_cap(self) -> Optional[int]:
        """The sessions it takes at once whatever their length (``max_sessions``); None: no cap (or not said)."""
        return None if self.max_sessions < 0 else self.max_sessions


class AssignmentRecord(_Record):
    """The orchestrator's block assignment: ``assignments[peer_id] = [start_block, num_blocks]`` (0-based)."""

    epoch: int = pydantic.Field(ge=0, le=EPOCH_MAX)
    max_length: int = pydantic.Field(ge=1)
    orchestrator_peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    assignments: Dict[str, list[int]] = pydantic.Field(default_factory=dict)
    model_fingerprint: str = pydantic.Field(default="", max_length=64)  # the model the orchestrator serves
    timestamp: float = pydantic.Field(default_factory=time.time)

    @pydantic.field_validator("assignments")
    @classmethod
    def _check_spans(cls, value: Dict[str, list[int]]) -> Dict[str, list[int]]:
        for peer_id, span in value.items():
            if len(span) != 2 or span[0] < 0 or span[1] < 1:
                raise ValueError(f"assignment of {peer_id} must be [start_block >= 0, num_blocks >= 1], got {span}")
        return value

    def span_of(self, peer_id: str) -> Optional[tuple[int, int]]:
        """``(start_block, num_blocks)`` assigned to ``peer_id``, or None."""
        span = self.assignments.get(peer_id)
        return (int(span[0]), int(span[1])) if span is not None else None

    def to_value(self) -> dict:
        value = self.model_dump()
        value["assignments"] = {k: [int(v[0]), int(v[1])] for k, v in self.assignments.items()}
        return value


class PlacementRecord(_Record):
    """Which model each server offering several serves (SeaLLM placement, ``orchestrator/placement.py``):
    ``placement[server peer id] = DHT prefix``; stored under ``{prefix}.placement`` of every model the orchestrator
    serves, so a server finds it under any of its own prefixes."""

    orchestrator_peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    epoch: int = pydantic.Field(default=0, ge=0, le=EPOCH_MAX)
    placement: Dict[str, str] = pydantic.Field(default_factory=dict)
    timestamp: float = pydantic.Field(default_factory=time.time)

    def to_value(self) -> dict:
        value = self.model_dump()
        value["timestamp"] = float(value["timestamp"])
        return value


class SummaryRecord(_Record):
    """Envelope of the orchestrator's swarm summary: the ``GET /api/v1/swarm`` JSON as text."""

    orchestrator_peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    timestamp: float = pydantic.Field(default_factory=time.time)
    json_text: str = pydantic.Field(max_length=4 * 1024 * 1024)

    @classmethod
    def wrap(cls, orchestrator_peer_id: str, summary: dict[str, Any]) -> "SummaryRecord":
        return cls(orchestrator_peer_id=orchestrator_peer_id, json_text=json.dumps(summary, separators=(",", ":")))

    def summary(self) -> dict[str, Any]:
        return json.loads(self.json_text)


class GroupRecord(_Record):
    """One orchestrator's entry under ``{prefix}.groups`` when several serve one swarm (HERD groups): it is alive
    (``timestamp``, a short expiration), where its HTTP API is, the jobs/s arriving at it, and the split it follows
    ``groups[orchestrator] = [server peer ids]`` of ``epoch`` (the leader, the live orchestrator of smallest peer id,
    computes it)."""

    orchestrator_peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    http_url: str = pydantic.Field(default="", max_length=512)
    arrival_rate: float = pydantic.Field(default=0.0, ge=0)
    epoch: int = pydantic.Field(default=0, ge=0, le=EPOCH_MAX)  # of the split, counted on by each new leader
    groups: Dict[str, list[str]] = pydantic.Field(default_factory=dict)
    timestamp: float = pydantic.Field(default_factory=time.time)

    def to_value(self) -> dict:
        value = self.model_dump()
        value["arrival_rate"] = float(value["arrival_rate"])
        value["timestamp"] = float(value["timestamp"])
        return value

    def group_of(self) -> dict[str, str]:
        """``{server peer id: orchestrator peer id}`` of the split."""
        return {s: o for o, members in self.groups.items() for s in members}


class DirectoryRecord(_Record):
    """An orchestrator's entry in the swarm directory: which swarm (DHT prefix, model) it runs, and where."""

    orchestrator_peer_id: str = pydantic.Field(min_length=1, max_length=_PEER_ID_MAX)
    dht_prefix: str = pydantic.Field(min_length=1, max_length=128)
    model: str = pydantic.Field(max_length=512)
    http_url: str = pydantic.Field(default="", max_length=512)
    timestamp: float = pydantic.Field(default_factory=time.time)


# ---- pydantic.v1 schemas for hivemind's SchemaValidator (strict types: no conversions allowed) ----


class _ValueV1(pv1.BaseModel):
    """Unknown fields (a newer writer's) pass, bounded in number and name length, and missing ones with a default
    (an older writer's) too. hivemind's validator requires the parsed value to equal the stored one, so unknown
    fields are kept as they are and ``dict()`` leaves out the fields the value did not have."""

    class Config:
        extra = pv1.Extra.allow

    def dict(self, **kwargs: Any) -> dict:  # noqa: A003 - pydantic v1's name
        kwargs["exclude_unset"] = True
        return super().dict(**kwargs)

    @pv1.root_validator(pre=True)
    def _bound_unknown_fields(cls, values: dict) -> dict:
        unknown = [k for k in values if k not in cls.__fields__]
        if len(unknown) > MAX_UNKNOWN_FIELDS:
            raise ValueError(f"{len(unknown)} unknown fields (at most {MAX_UNKNOWN_FIELDS})")
        if any(not isinstance(k, str) or len(k) > _UNKNOWN_FIELD_NAME_MAX for k in unknown):
            raise ValueError(f"an unknown field's name is not a string of at most {_UNKNOWN_FIELD_NAME_MAX} chars")
        check_unknown_values([values[k] for k in unknown])
        return values


class _ServerValueV1(_ValueV1):
    peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    version: pv1.constr(strict=True, max_length=_SHORT_MAX)
    state: pv1.constr(strict=True, regex=_ENUM_NAME_RE)  # the OPEN_ENUMS: a newer writer may add values
    memory_bytes: pv1.conint(strict=True, ge=0)
    tau_p: pv1.confloat(strict=True, ge=0)
    device: pv1.constr(strict=True, max_length=_SHORT_MAX)
    dtype: pv1.constr(strict=True, max_length=_SHORT_MAX)
    quant: pv1.constr(strict=True, max_length=_SHORT_MAX)
    start_block: pv1.conint(strict=True, ge=0)
    num_blocks: pv1.conint(strict=True, ge=0)
    slots_total: pv1.conint(strict=True, ge=0)
    slots_free: pv1.conint(strict=True, ge=0)
    public_name: pv1.constr(strict=True, max_length=128)
    max_length: pv1.conint(strict=True, ge=0)
    s_m_bytes: pv1.conint(strict=True, ge=0)
    s_c_bytes: pv1.conint(strict=True, ge=0)
    emulate_rtt_ms: pv1.confloat(strict=True, ge=0)
    emulate_compute_scale: pv1.confloat(strict=True, gt=0)
    emulate_reply_fault: pv1.constr(strict=True, regex=_ENUM_NAME_RE)
    emulate_reply_fault_rate: pv1.confloat(strict=True, ge=0, le=1)
    emulate_tau_p_lie: pv1.confloat(strict=True, gt=0)
    epoch: pv1.conint(strict=True, ge=-1, le=EPOCH_MAX)
    model_fingerprint: pv1.constr(strict=True, max_length=64)
    max_blocks: pv1.conint(strict=True, ge=0)
    kv_cache: pv1.constr(strict=True, regex=_ENUM_NAME_RE)
    page_size: pv1.conint(strict=True, ge=0)
    cache_tokens_total: pv1.conint(strict=True, ge=0)
    cache_tokens_free: pv1.conint(strict=True, ge=0)
    max_sessions: pv1.conint(strict=True, ge=-1)
    prefix_cache: pv1.StrictBool
    prefix_offered_tokens: pv1.conint(strict=True, ge=0)
    prefix_reused_tokens: pv1.conint(strict=True, ge=0)
    maddrs: pv1.conlist(pv1.constr(strict=True, max_length=300), max_items=8)
    reachability: pv1.constr(strict=True, regex=_ENUM_NAME_RE)
    models: pv1.conlist(pv1.constr(strict=True, max_length=128), max_items=8)
    serving: pv1.constr(strict=True, max_length=128)
    open_heartbeats: pv1.StrictBool
    failed_span: pv1.conlist(pv1.conint(strict=True, ge=0), max_items=2)
    load_error: pv1.constr(strict=True, max_length=LOAD_ERROR_MAX)
    cache_tokens_per_block: pv1.conint(strict=True, ge=0)
    started_at: pv1.confloat(strict=True, ge=0)
    stranger_slots_free: pv1.conint(strict=True, ge=-1)
    adapters: Dict[pv1.constr(strict=True, min_length=1, max_length=_ADAPTER_KEY_MAX),
                   pv1.constr(strict=True, max_length=_ADAPTER_KEY_MAX)]
    protocol: pv1.conint(strict=True, ge=1, le=_PROTOCOL_MAX)
    protocol_min: pv1.conint(strict=True, ge=1, le=_PROTOCOL_MAX)
    timestamp: pv1.StrictFloat

    @pv1.validator("adapters")
    def _few_adapters(cls, value: dict) -> dict:
        if len(value) > ADAPTERS_MAX:
            raise ValueError(f"{len(value)} adapters (at most {ADAPTERS_MAX})")
        return value


class _AssignmentValueV1(_ValueV1):
    epoch: pv1.conint(strict=True, ge=0, le=EPOCH_MAX)
    max_length: pv1.conint(strict=True, ge=1)
    orchestrator_peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    assignments: Dict[pv1.StrictStr, pv1.conlist(pv1.StrictInt, min_items=2, max_items=2)]
    model_fingerprint: pv1.constr(strict=True, max_length=64)
    timestamp: pv1.StrictFloat


class _SummaryValueV1(_ValueV1):
    orchestrator_peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    timestamp: pv1.StrictFloat
    json_text: pv1.constr(strict=True, max_length=4 * 1024 * 1024)


class _DirectoryValueV1(_ValueV1):
    orchestrator_peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    dht_prefix: pv1.constr(strict=True, min_length=1, max_length=128)
    model: pv1.constr(strict=True, max_length=512)
    http_url: pv1.constr(strict=True, max_length=512)
    timestamp: pv1.StrictFloat


class _GroupValueV1(_ValueV1):
    orchestrator_peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    http_url: pv1.constr(strict=True, max_length=512)
    arrival_rate: pv1.confloat(strict=True, ge=0)
    epoch: pv1.conint(strict=True, ge=0, le=EPOCH_MAX)
    groups: Dict[pv1.constr(strict=True, max_length=_PEER_ID_MAX),
                 pv1.conlist(pv1.constr(strict=True, max_length=_PEER_ID_MAX), max_items=4096)]
    timestamp: pv1.StrictFloat


class _PlacementValueV1(_ValueV1):
    orchestrator_peer_id: pv1.constr(strict=True, min_length=1, max_length=_PEER_ID_MAX)
    epoch: pv1.conint(strict=True, ge=0, le=EPOCH_MAX)
    placement: Dict[pv1.constr(strict=True, max_length=_PEER_ID_MAX), pv1.constr(strict=True, max_length=128)]
    timestamp: pv1.StrictFloat


def _defaults_from(record: type[_Record], value_schema: type[_ValueV1]) -> None:
    """An older writer's value lacks the fields added since: the validator fills them from the record's defaults.
    ``timestamp`` stays required (a record without one must not look fresh)."""
    for name, field in value_schema.__fields__.items():
        info = record.model_fields[name]
        if name != "timestamp" and not info.is_required():
            field.required = False
            field.default = info.get_default(call_default_factory=True)


for _record, _schema in ((ServerRecord, _ServerValueV1), (AssignmentRecord, _AssignmentValueV1),
                         (SummaryRecord, _SummaryValueV1), (DirectoryRecord, _DirectoryValueV1),
                         (GroupRecord, _GroupValueV1), (PlacementRecord, _PlacementValueV1)):
    _defaults_from(_record, _schema)


class DirectorySchemaV1(pv1.BaseModel):
    """The swarm directory key; every entry signed by the orchestrator that wrote it."""

    swarms: Dict[BytesWithPublicKey, _DirectoryValueV1]


class SwarmSchemaV1(pv1.BaseModel):
    """One field per key suffix; every subkey must carry an owner key (``[owner:...]``), so every entry is signed."""

    servers: Dict[BytesWithPublicKey, _ServerValueV1]
    assignment: Dict[BytesWithPublicKey, _AssignmentValueV1]
    summary: Dict[BytesWithPublicKey, _SummaryValueV1]
    groups: Dict[BytesWithPublicKey, _GroupValueV1]
    placement: Dict[BytesWithPublicKey, _PlacementValueV1]


__all__ = ["ServerRecord", "AssignmentRecord", "SummaryRecord", "DirectoryRecord", "GroupRecord", "PlacementRecord",
           "SwarmSchemaV1", "DirectorySchemaV1", "RECORD_VERSION", "STATES", "MAX_UNKNOWN_FIELDS", "PROTOCOL",
           "MIN_PROTOCOL", "OLDEST_PROTOCOL", "OPEN_ENUMS"]
