"""What the standalone dashboard shows: server records + the orchestrator's signed summary, read from the DHT.

Trust: server records come from :meth:`SwarmDHT.fetch_servers` (signature verified, owner key bound to the
peer id); the summary only from :meth:`SwarmDHT.fetch_summary` with an explicit list of trusted orchestrator
peer ids. Nothing unsigned is ever shown. Server records override the summary's view of liveness: a server
the summary lists but whose record expired (or says ``offline``) is shown as ``offline``.

Several models (an orchestrator started with ``--model NAME=SOURCE`` repeated): the trusted summary of the swarm the
dashboard started on lists every model with its DHT prefix (``models``); each is read and merged the same way, and
``view(NAME)`` answers ``?model=NAME`` as the orchestrator's router does (:class:`UnknownModel` for another name).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

#: the most models one dashboard reads (each costs two DHT reads a poll); the orchestrator's summary names them.
MAX_MODELS = 16

#: contracts-E fields of one server entry, with their defaults when a source lacks them.
SERVER_DEFAULTS: dict[str, Any] = {
    "peer_id": "",
    "public_name": "",
    "state": "offline",
    "start_block": 0,
    "num_blocks": 0,
    "slots_total": 0,
    "slots_free": 0,
    "kv_cache": "slots",
    "page_size": 0,
    "cache_tokens_total": 0,
    "cache_tokens_free": 0,
    "prefix_cache": False,
    "prefix_offered_tokens": 0,
    "prefix_reused_tokens": 0,
    "tau_p": None,
    "tau_c": None,
    "memory_bytes": 0,
    "device": "",
    "dtype": "",
    "emulate_rtt_ms": 0.0,
    "emulate_compute_scale": 1.0,
    "last_seen": None,
}

#: contracts-E top-level fields, with what the dashboard shows when no trusted summary is available.
VIEW_DEFAULTS: dict[str, Any] = {
    "model": "",
    "dht_prefix": "",
    "max_length": 0,
    "num_blocks": None,
    "ready": False,
    "initial_peers": [],
    "http_url": "",
    "epoch": -1,
    "placement_policy": "",
    "dispatch_policy": "",
    "c": None,
    "arrival_rate": 0.0,
    "rho_bar": 0.0,
    "predicted_response_s": None,
    "measured": {"mean_response_s": None, "mean_wait_s": None, "mean_service_s": None, "completed": 0, "failed": 0},
    "queue_length": 0,
    "updated_at": 0.0,
    "servers": [],
    "chains": [],
    "history": [],
}


def _record_dict(record: Any) -> dict:
    if isinstance(record, Mapping):
        return dict(record)
    if hasattr(record, "model_dump"):
        return record.model_dump()
    raise TypeError(f"server record must be a ServerRecord or a mapping, got {type(record).__name__}")


def server_entry(record: Any, tau_c: Optional[float] = None, last_seen: Optional[float] = None) -> dict:
    """A contracts-E server entry from a :class:`ServerRecord` (``last_seen``: when the reader first read this record,
    on its clock; without one, the record's timestamp, on its writer's)."""
    r = _record_dict(record)
    entry = {k: r.get(k, v) for k, v in SERVER_DEFAULTS.items() if k not in ("tau_c", "last_seen")}
    entry["tau_c"] = tau_c
    entry["last_seen"] = r.get("timestamp") if last_seen is None else last_seen
    for extra in ("quant", "max_length", "epoch", "version", "protocol", "protocol_min", "reachability", "maddrs",
                  "emulate_reply_fault", "emulate_reply_fault_rate", "models", "serving", "failed_span",
                  "load_error"):  # what it signs
        if extra in r:
            entry[extra] = r[extra]
    return entry


# What only the orchestrator knows about a server (its audits' verdict, the step times it measures, its own dial
# of the server, the refusal of another model's server): passed through from the trusted summary.
_JUDGED = ("trust", "step_compute_s", "step_network_s", "reachability_error", "model_mismatch", "strikes", "banned",
           "banned_for_s", "distrusted", "tau_p_measured", "tau_p_suspect", "rtt_s", "assigned")


def merge_view(
    prefix: str,
    records: Mapping[str, Any],
    summary: Optional[Mapping[str, Any]],
    now: Optional[float] = None,
    initial_peers: Sequence[str] = (),
    num_blocks: Optional[int] = None,
    seen_at: Optional[Mapping[str, float]] = None,
) -> dict:
    """The contracts-E JSON from verified server records and the trusted summary (or None).

    Every summary field is kept (so extensions pass through); ``servers`` is rebuilt from the records, with
    ``tau_c`` taken from the summary (only the orchestrator measures it). Summary servers without a live
    record are kept with ``state = "offline"`` so the page shows them as gone. Extra fields: ``source``
    (``"dht"``), ``orchestrator_summary`` (bool), ``summary_updated_at``. Without a summary, ``num_blocks`` (the
    model's, from an earlier summary) or else :func:`blocks_from_records` sizes the page's coverage chart.

    ``seen_at``: ``{peer id: when its record was first read}`` on the clock of ``now`` (``updated_at``, which the page
    measures "last seen" from): a server's own timestamp is on its clock, and one 10 min behind read "10 min ago"
    while it published every few seconds. Its servers' ``last_seen`` is ``now`` where it has none; without it, their
    records' timestamps. A server only the summary lists keeps the orchestrator's ``last_seen``, moved to this
    clock by the summary's ``updated_at``.
    """
    now = time.time() if now is None else float(now)
    summary = dict(summary) if isinstance(summary, Mapping) else None
    view: dict[str, Any] = {k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in VIEW_DEFAULTS.items()}
    if summary is not None:
        view.update(summary)
    summary_servers: dict[str, dict] = {}
    if summary is not None and isinstance(summary.get("servers"), list):
        for s in summary["servers"]:
            if isinstance(s, Mapping) and isinstance(s.get("peer_id"), str):
                summary_servers[s["peer_id"]] = dict(s)

    servers: list[dict] = []
    for peer_id, record in sorted(records.items()):
        seen_by_orch = summary_servers.get(peer_id, {})
        tau_c = seen_by_orch.get("tau_c")
        seen = None if seen_at is None else seen_at.get(peer_id, now)
        entry = server_entry(record, tau_c if isinstance(tau_c, (int, float)) else None, seen)
        if seen_by_orch.get("state") in ("failed", "refused") and entry["state"] != "offline":
            # the record still says online (or joining), but the orchestrator cannot reach it, or refused it for
            # serving another model
            entry["state"] = seen_by_orch["state"]
        entry.update({k: seen_by_orch[k] for k in _JUDGED if k in seen_by_orch})
        if seen_by_orch.get("reachability") in ("direct", "relayed", "unreachable", "pending"):
            entry["reachability"] = seen_by_orch["reachability"]  # its own dial wins over the server's claim
        servers.append(entry)
    for peer_id, s in summary_servers.items():
        if peer_id in records:
            continue
        gone = {k: s.get(k, v) for k, v in SERVER_DEFAULTS.items()}
        gone["state"] = "offline"  # its signed record expired: the summary's liveness is out of date
        gone["record_expired"] = True
        gone.update({k: s[k] for k in ("version", "protocol", "protocol_min") if k in s})  # the build it ran
        if seen_at is not None:  # its age as the orchestrator said it (both its clock), from this one's now
            gone["last_seen"] = _moved_to(gone["last_seen"], summary.get("updated_at"), now)
        servers.append(gone)

    view["servers"] = servers
    view["dht_prefix"] = view.get("dht_prefix") or prefix
    if not view.get("model"):
        view["model"] = prefix
    if not view.get("max_length"):
        # the one most servers announce (the orchestrator sizes them alike): the largest was any one server's word
        lengths = [n for n in (_record_dict(r).get("max_length") for r in records.values())
                   if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        view["max_length"] = max(set(lengths), key=lambda n: (lengths.count(n), -n), default=0)
    if not view.get("initial_peers"):
        view["initial_peers"] = list(initial_peers)
    view["source"] = "dht"
    view["orchestrator_summary"] = summary is not None
    view["summary_updated_at"] = summary.get("updated_at") if summary is not None else None
    view["updated_at"] = now
    if summary is None:
        view["ready"] = False
        view["num_blocks"] = num_blocks or blocks_from_records(records.values())
    return view


def _stamp_of(record: Any) -> Any:
    return record.get("timestamp") if isinstance(record, Mapping) else getattr(record, "timestamp", None)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _moved_to(t: Any, their_now: Any, now: float) -> Any:
    """The time ``t`` of a clock whose now was ``their_now``, on the clock whose now is ``now`` (None: unknown)."""
    if not (_is_number(t) and _is_number(their_now)):
        return None
    return now - max(0.0, float(their_now) - float(t))


#: how many times further than every other server's span one server's may reach and still size the coverage chart
BLOCKS_SLACK = 16


def blocks_from_records(records: Iterable[Any]) -> Optional[int]:
    """The model's block count as the server records suggest, without an orchestrator's word (None: no spans). The
    largest end of a span, unless one record alone claims it and it lies over ``BLOCKS_SLACK`` times further than
    every other record's: then that one is not believed (a record claiming blocks [0, 4096) drew a coverage chart of
    4096 columns, 4066 of them "uncovered", beside a 30-block swarm)."""
    ends = []
    for record in records:
        r = _record_dict(record)
        start, num = r.get("start_block"), r.get("num_blocks")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (start, num)) and start >= 0 and num > 0:
            ends.append(start + num)
    if not ends:
        return None
    ends.sort()
    if len(ends) >= 2 and ends[-1] > ends[-2] and ends[-1] > BLOCKS_SLACK * ends[-2]:
        return ends[-2]
    return ends[-1]


class UnknownModel(LookupError):
    """``?model=`` names no model of the swarm; ``args[0]`` is the message (it names the models served)."""


class ModelsNotKnownYet(UnknownModel):
    """``?model=`` names another model than the default before any trusted summary said which the swarm serves."""


class SwarmNotReadYet(RuntimeError):
    """No DHT read has succeeded yet: there is no view to show (an empty one looked like a swarm with no servers);
    ``args[0]`` says so, with the last read's error."""


def listed_models(summary: Optional[Mapping[str, Any]], prefix: str) -> list[dict]:
    """The models a trusted summary lists (``[{name, dht_prefix, ...}]``, at most :data:`MAX_MODELS`, names and
    prefixes distinct), or ``[]`` when it lists fewer than two or not the one at ``prefix`` it was read under (one
    model: the dashboard stays as it was)."""
    from petals_chain.swarm.keys import check_prefix

    out: list[dict] = []
    entries = summary.get("models") if isinstance(summary, Mapping) else None
    for m in entries if isinstance(entries, list) else []:
        if not isinstance(m, Mapping):
            continue
        name, pfx = m.get("name"), m.get("dht_prefix")
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            continue
        try:
            check_prefix(pfx)
        except ValueError:  # a malformed entry is simply not shown
            continue
        if any(name == x["name"] or pfx == x["dht_prefix"] for x in out):
            continue
        out.append(dict(m))
        if len(out) == MAX_MODELS:
            break
    return out if len(out) > 1 and any(m["dht_prefix"] == prefix for m in out) else []


class DhtSwarmSource:
    """Polls the DHT in a background thread and keeps the latest merged view (one per model of the swarm).

    ``sd`` is a :class:`petals_chain.swarm.dht.SwarmDHT` (client mode is enough); ``prefix`` is the swarm shown at
    ``/`` (the default model); ``trusted`` are the orchestrator peer ids whose signed summary is believed.
    """

    def __init__(
        self,
        sd: Any,
        prefix: str,
        trusted: Sequence[str],
        interval_s: float = 2.0,
        initial_peers: Sequence[str] = (),
    ):
        if not (interval_s > 0):
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.sd = sd
        self.prefix = prefix
        self.trusted = list(trusted)
        self.interval_s = float(interval_s)
        self.initial_peers = list(initial_peers)
        self._lock = threading.Lock()
        self._view: dict = merge_view(prefix, {}, None, initial_peers=self.initial_peers)
        self._models: list[dict] = []  # listed_models() of the last trusted summary that listed several
        self._views: dict[str, dict] = {}  # by model name, with several models
        self._num_blocks: dict[str, int] = {}  # by DHT prefix, from the last trusted summary that said it
        self._summary_seen = False  # a trusted summary was read once (only then is the list of models known)
        self._last_ok: Optional[float] = None  # time.monotonic() of the last successful read
        self._last_error: Optional[str] = None
        # {prefix: {peer id: (its record's timestamp, when this dashboard first read that record, time.time())}}
        self._seen: dict[str, dict[str, tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def refresh(self) -> dict:
        """Fetch records and summary once and update the view (raises on DHT errors)."""
        if self.initial_peers:  # find a restarted orchestrator again (SwarmDHT.arejoin says why this is needed)
            from petals_chain.swarm.dht import peer_ids_from_maddrs

            try:
                self.sd.rejoin(peer_ids_from_maddrs(self.initial_peers))
            except Exception as e:  # noqa: BLE001 - the records may still be readable through other peers
                logger.debug(f"dashboard: re-bootstrap to the initial peers failed: {e!r}")
        view, summary = self._read(self.prefix)
        self._summary_seen = self._summary_seen or summary is not None
        models = listed_models(summary, self.prefix)
        if summary is None:  # an orchestrator restarting: its other models stay listed until its summary is back
            models = self._models
        views: dict[str, dict] = {}
        for m in models:  # every view read before any is replaced: a failed read keeps the last set whole
            views[m["name"]] = view if m["dht_prefix"] == self.prefix else self._read(m["dht_prefix"])[0]
        if models:
            # the links as the orchestrator's page shows them, their counts from what each link will show
            nav = [{**m, "servers": len(views[m["name"]]["servers"]), "chains": len(views[m["name"]]["chains"]),
                    "queue_length": views[m["name"]]["queue_length"]} for m in models]
            placement = next((v["model_placement"] for v in views.values() if "model_placement" in v), None)
            for name, v in views.items():
                v.update(models=nav, model_name=name)
                if placement is not None:
                    v.setdefault("model_placement", placement)
        else:
            view.pop("models", None)  # a list not taken (malformed, or not naming this swarm): no links to nowhere
        if [m["name"] for m in models] != [m["name"] for m in self._models]:
            logger.info("the swarm serves %s", ", ".join(f"{m['name']} (DHT prefix {m['dht_prefix']})"
                                                        for m in models) or "one model")
        with self._lock:
            self._view, self._models, self._views = view, models, views
            self._last_ok = time.monotonic()  # an age, not a date: a clock step must not make it stale or fresh
            self._last_error = None
        return view

    def _read(self, prefix: str) -> tuple[dict, Optional[dict]]:
        """The merged view of the swarm at ``prefix`` and the trusted summary it was merged from (or None)."""
        records = self.sd.fetch_servers(prefix)
        now = time.time()
        seen = self._seen.get(prefix, {})
        # a server's "last seen" is when this dashboard first read its newest record: its own timestamp is on its
        # clock (kept only for the peers read now: the book stays as large as the swarm)
        self._seen[prefix] = seen = {
            peer: seen[peer] if peer in seen and seen[peer][0] == stamp else (stamp, now)
            for peer, stamp in ((peer, _stamp_of(r)) for peer, r in records.items())}
        summary = self.sd.fetch_summary(prefix, trusted=self.trusted) if self.trusted else None
        blocks = summary.get("num_blocks") if summary is not None else None
        if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks > 0:
            self._num_blocks[prefix] = blocks  # the model's length stays known while its orchestrator restarts
        view = merge_view(prefix, records, summary, now=now, initial_peers=self.initial_peers,
                          num_blocks=self._num_blocks.get(prefix), seen_at={p: t for p, (_, t) in seen.items()})
        return view, summary

    def view(self, model: Optional[str] = None) -> dict:
        """The view of ``model`` (its name or DHT prefix; None or empty: the default one); with one model ``model``
        is ignored, as by an orchestrator serving one. :class:`UnknownModel` if the swarm serves several and no
        such one; :class:`SwarmNotReadYet` before the first successful DHT read. While the reads fail for longer
        than :meth:`health` allows, a copy of the last view marked ``stale_s`` (its age) and ``stale_error``."""
        with self._lock:
            last_ok, err = self._last_ok, self._last_error
        if last_ok is None:
            raise SwarmNotReadYet("the dashboard has not read the swarm from the DHT yet"
                                  + (f" (last attempt: {err})" if err else "") + "; retrying")
        view = self._view_of(model)
        age = time.monotonic() - last_ok
        if age > self._stale_after_s():  # the last data, not shown as current
            view = dict(view, stale_s=round(age, 1), stale_error=err)
        return view

    def _stale_after_s(self) -> float:
        return 3 * self.interval_s + 10

    def _view_of(self, model: Optional[str]) -> dict:
        with self._lock:
            if model and not self._summary_seen and self.trusted and model not in (self.prefix, self._view["model"]):
                # the swarm may serve several models: showing the default one under another's name misled
                raise ModelsNotKnownYet(f"the models of this swarm are not known yet (no summary from a trusted "
                                        f"orchestrator read so far): try ?model={model} again shortly")
            if not model or not self._models:
                return self._view
            # names first: one model's name may be another's prefix (the router's aliases rank them so too)
            for m in sorted(self._models, key=lambda m: model != m["name"]):
                if model in (m["name"], m["dht_prefix"]):
                    return self._views[m["name"]]
            names = ", ".join(repr(m["name"]) for m in self._models)
        raise UnknownModel(f"the model {model!r} does not exist; this swarm serves {names}")

    def models(self) -> list[str]:
        """The names of the models served (empty with one model)."""
        with self._lock:
            return [m["name"] for m in self._models]

    def health(self) -> tuple[bool, dict]:
        """OK while the last successful DHT read is recent (3 poll periods + 10 s; older, the view is stale)."""
        with self._lock:
            last_ok, err = self._last_ok, self._last_error
        age = None if last_ok is None else time.monotonic() - last_ok
        ok = age is not None and age <= self._stale_after_s()
        return ok, {
            "dht_prefix": self.prefix,
            "last_dht_read_age_s": age,
            "last_error": err,
            "trusted_orchestrators": self.trusted,
            "orchestrator_summary": bool(self._view_of(None).get("orchestrator_summary")),
            "models": self.models(),
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the dashboard; keep the last view
                logger.warning(f"dashboard: DHT read failed: {e!r}")
                with self._lock:
                    self._last_error = repr(e)
            self._stop.wait(self.interval_s)

    def start(self) -> "DhtSwarmSource":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dashboard-dht-poll", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
