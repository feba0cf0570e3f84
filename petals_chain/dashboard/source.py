"""What the standalone dashboard shows: server records + the orchestrator's signed summary, read from the DHT.

Trust: server records come from :meth:`SwarmDHT.fetch_servers` (signature verified, owner key bound to the
peer id); the summary only from :meth:`SwarmDHT.fetch_summary` with an explicit list of trusted orchestrator
peer ids. Nothing unsigned is ever shown. Server records override the summary's view of liveness: a server
the summary lists but whose record expired (or says ``offline``) is shown as ``offline``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

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


def server_entry(record: Any, tau_c: Optional[float] = None) -> dict:
    """A contracts-E server entry from a :class:`ServerRecord` (``last_seen`` = the record's timestamp)."""
    r = _record_dict(record)
    entry = {k: r.get(k, v) for k, v in SERVER_DEFAULTS.items() if k not in ("tau_c", "last_seen")}
    entry["tau_c"] = tau_c
    entry["last_seen"] = r.get("timestamp")
    for extra in ("quant", "max_length", "epoch", "version", "reachability", "maddrs", "emulate_reply_fault",
                  "emulate_reply_fault_rate", "models", "serving"):  # what the server signs (emulation is shown)
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
) -> dict:
    """The contracts-E JSON from verified server records and the trusted summary (or None).

    Every summary field is kept (so extensions pass through); ``servers`` is rebuilt from the records, with
    ``tau_c`` taken from the summary (only the orchestrator measures it). Summary servers without a live
    record are kept with ``state = "offline"`` so the page shows them as gone. Extra fields: ``source``
    (``"dht"``), ``orchestrator_summary`` (bool), ``summary_updated_at``.
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
        entry = server_entry(record, tau_c if isinstance(tau_c, (int, float)) else None)
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
        servers.append(gone)

    view["servers"] = servers
    view["dht_prefix"] = view.get("dht_prefix") or prefix
    if not view.get("model"):
        view["model"] = prefix
    if not view.get("max_length"):
        lengths = [int(_record_dict(r).get("max_length") or 0) for r in records.values()]
        view["max_length"] = max(lengths, default=0)
    if not view.get("initial_peers"):
        view["initial_peers"] = list(initial_peers)
    view["source"] = "dht"
    view["orchestrator_summary"] = summary is not None
    view["summary_updated_at"] = summary.get("updated_at") if summary is not None else None
    view["updated_at"] = now
    if summary is None:
        view["ready"] = False
    return view


class DhtSwarmSource:
    """Polls the DHT in a background thread and keeps the latest merged view.

    ``sd`` is a :class:`petals_chain.swarm.dht.SwarmDHT` (client mode is enough); ``trusted`` are the
    orchestrator peer ids whose signed summary is believed.
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
        self._last_ok: Optional[float] = None
        self._last_error: Optional[str] = None
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
        records = self.sd.fetch_servers(self.prefix)
        summary = self.sd.fetch_summary(self.prefix, trusted=self.trusted) if self.trusted else None
        view = merge_view(self.prefix, records, summary, initial_peers=self.initial_peers)
        with self._lock:
            self._view = view
            self._last_ok = time.time()
            self._last_error = None
        return view

    def view(self) -> dict:
        with self._lock:
            return self._view

    def health(self) -> tuple[bool, dict]:
        """OK while the last successful DHT read is recent (3 poll periods + 10 s)."""
        with self._lock:
            last_ok, err = self._last_ok, self._last_error
        age = None if last_ok is None else time.time() - last_ok
        ok = age is not None and age <= 3 * self.interval_s + 10
        return ok, {
            "dht_prefix": self.prefix,
            "last_dht_read_age_s": age,
            "last_error": err,
            "trusted_orchestrators": self.trusted,
            "orchestrator_summary": bool(self.view().get("orchestrator_summary")),
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
