"""Several models behind one orchestrator (issue 17, first step): one :class:`~petals_chain.orchestrator.core.
Orchestrator` per model, sharing one DHT node, and one HTTP API that routes each request to its model's.

``python -m petals_chain.orchestrator --model chat=smollm2-135m --model code=/models/tiny`` serves both: each model
has its own DHT prefix (from its source, as its servers derive it), planner, chains, queue and dispatch, so a volunteer
serves a model by starting a server with that model. :class:`ModelRouter` is the ASGI app in front:

* ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``, ``/tokenize``,
  ``/detokenize`` and ``/api/v1/sessions``: by the body's ``model`` (without one: the first model); an unknown
  model is a 404 ``model_not_found`` naming the ones served;
* ``/api/v1/sessions/{id}...``: to the model whose orchestrator holds the session;
* ``GET /v1/models``: every model; ``/v1/models/{id}``: that one; ``GET /healthz``: every model's, 200 only if all are;
* ``GET /metrics``: every model's series in one exposition, each sample labelled ``model="NAME"`` (what a Prometheus
  scrape of the orchestrator expects; the replay cache the models share: once, under the first model, its help
  saying so); ``?model=NAME`` gives that model's alone, unlabelled, as with one model;
* everything else (``/api/v1/swarm``, the dashboard): the model named by ``?model=NAME``, else the first;
  ``/api/v1/swarm`` lists the models served (``models``) so the dashboard can offer the others; each model's signed
  summary lists them too (:func:`models_json`), for the standalone dashboard. Its ``relay.replay_cache`` names the
  models whose jobs its figures count (``shared_by``: all of them).
"""

from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from petals_chain.orchestrator.errors import shown_model_name
from petals_chain.orchestrator.limits import READ_BODY, BodyTooLarge, ReadBody, client_of, read_whole, replay_body
from petals_chain.swarm.jsonsafe import json_safe
from petals_chain.swarm.sources import MODEL_NAME_RE, split_model_arg
from petals_chain.swarm.version import build_version

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_BY_BODY = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
            ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/api/v1/sessions")}
_SESSION = re.compile(r"^/api/v1/sessions/([^/]+)")
MAX_BODY = 64 * 2**20  # read to route; each model's own limit (--max-body-bytes) applies after
# Gauges of the replay cache every model shares (share_replay_cache): the process's figures, not one model's
SHARED_REPLAY_FAMILIES = frozenset({"petals_chain_replay_cache_bytes", "petals_chain_replay_cache_budget_bytes",
                                    "petals_chain_replay_cache_evictions"})


def parse_models(values: list[str]) -> list[tuple[str | None, str]]:
    """``--model`` values as ``(name, source)``: one plain source keeps today's naming (``name`` None); several
    must each be ``NAME=SOURCE`` with distinct names. ValueError with the reason otherwise."""
    if len(values) == 1 and split_model_arg(values[0])[0] is None:  # a bare source (which may hold "=")
        return [(None, values[0])]
    out: list[tuple[str | None, str]] = []
    for v in values:
        name, sep, source = v.partition("=")
        if not sep or not source:
            raise ValueError(f"with several models each --model is NAME=SOURCE, got {v!r}")
        if not MODEL_NAME_RE.match(name):
            raise ValueError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        out.append((name, source))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {', '.join(names)}")
    return out


async def _call(app: App, method: str, path: str, query: bytes = b"", body: bytes = b"",
                headers: list | None = None) -> tuple[int, bytes]:
    """One request to ``app`` inside this process: (status, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": query, "headers": headers or [], "scheme": "http",
             "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0), "root_path": ""}
    sent = False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def _json(send: Send, status: int, obj: Any) -> None:
    body = json.dumps(json_safe(obj)).encode()  # no inf/nan (a server's record can make one): browsers reject them
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def models_json(orchs: Mapping[str, Any], name: str, placer: Any = None) -> dict[str, Any]:
    """What ``/api/v1/swarm?model=name`` adds with several models (and the signed summary of each, so that a
    standalone dashboard finds the others' DHT prefixes): ``models`` (each one's name, prefix and load: the page's
    model links), ``model_name`` (the one shown) and ``model_placement`` (``placer``'s, if any)."""
    out: dict[str, Any] = {
        "models": [{"name": n, "model": o.model_id, "dht_prefix": o.prefix,
                    "servers": len(o.planner.servers) if o.planner is not None else 0,
                    "chains": len(o.dispatch.chains), "queue_length": o.dispatch.queue_length,
                    "completed": o.stats.completed, "failed": o.stats.failed, "unserved": o.stats.unserved,
                    "cancelled": o.stats.cancelled,
                    "arrival_rate": round(o.planner.arrival_rate, 4) if o.planner is not None else 0.0}
                   for n, o in orchs.items()],
        "model_name": name}
    if placer is not None:
        out["model_placement"] = placer.json()
    return out


def share_replay_cache(orchs: Mapping[str, Any]) -> None:
    """Give every model the first one's replay cache: ``--replay-cache-mb`` bounds the hop inputs kept by all the
    process's jobs (help: "all jobs together"), not each model's (N models kept up to N times the budget)."""
    caches = [o for o in orchs.values() if getattr(o, "replay_cache", None) is not None]
    for o in caches[1:]:
        o.replay_cache = caches[0].replay_cache  # before any request: no job holds the model's own cache yet


class ModelsCollector:
    """Every model's Prometheus registry as one collector: families merged by name, each sample labelled with its
    model's name (``orchs[name].stats.registry``; each orchestrator's gauges are refreshed first). A replay cache
    several models share gives its :data:`SHARED_REPLAY_FAMILIES` once, under the first of them, and says so in the
    family's help."""

    def __init__(self, orchs: Mapping[str, Any]):
        self.orchs = orchs

    def collect(self):
        families: dict[str, Metric] = {}
        shown: set[int] = set()  # replay caches whose figures were given already
        for name, o in self.orchs.items():
            o.update_gauges()
            cache = getattr(o, "replay_cache", None)
            users = [n for n, p in self.orchs.items() if getattr(p, "replay_cache", None) is cache]
            shared = cache is not None and len(users) > 1
            for fam in o.stats.registry.collect():
                if shared and fam.name in SHARED_REPLAY_FAMILIES:
                    # the process's one cache (share_replay_cache): each model showed the total as its own, and a
                    # sum over the models counted it once per model
                    if id(cache) in shown:
                        continue
                    doc = f"{fam.documentation} (one cache for the models {', '.join(users)}: given under {name})"
                else:
                    doc = fam.documentation
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, doc, fam.type, fam.unit)
                out.samples.extend(s._replace(labels={"model": name, **s.labels}) for s in fam.samples)
            if shared:
                shown.add(id(cache))
        return iter(families.values())

    def exposition(self) -> bytes:
        return generate_latest(self)


class ModelRouter:
    """The ASGI app over several models' apps (``apps[name]``, the first is the default); ``orchs[name]`` are their
    orchestrators (for sessions and the list of models), which from now on share one replay cache
    (:func:`share_replay_cache`)."""

    def __init__(self, apps: Mapping[str, App], orchs: Mapping[str, Any], placer: Any = None):
        if not apps or set(apps) != set(orchs):
            raise ValueError("one app per orchestrator, at least one")
        self.apps, self.orchs = dict(apps), dict(orchs)
        self.placer = placer  # placement.ModelPlacer: which model each server offering several serves
        self.default = next(iter(self.apps))
        # what a request may call a model: its name, and what its own API accepts (model id, DHT prefix, source)
        self.aliases: dict[str, str] = {}
        for name, o in self.orchs.items():
            for alias in (getattr(o, "model_id", None), getattr(o, "prefix", None), getattr(o.cfg, "model", None),
                          *getattr(o, "adapters", {})):  # a LoRA adapter's name: its model's API serves it
                if alias:
                    self.aliases.setdefault(str(alias), name)
        self.aliases.update({name: name for name in self.apps})
        share_replay_cache(self.orchs)

    def models(self) -> list[str]:
        return list(self.apps)

    async def _not_found(self, send: Send, name: Any) -> None:
        shown = shown_model_name(name)

        def served(n: str) -> str:  # a model and its LoRA adapters' names (model ids too, as its own 404 says)
            adapters = getattr(self.orchs[n], "adapters", None) or {}
            return repr(n) + (f" (and its LoRA adapters {', '.join(map(repr, adapters))})" if adapters else "")

        await _json(send, 404, {"error": {"message": f"the model {shown} does not exist; this swarm serves "
                                                     f"{', '.join(served(n) for n in self.apps)}",
                                          "type": "invalid_request_error", "param": "model",
                                          "code": "model_not_found"}})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.apps[self.default](scope, receive, send)
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        if (method, path) in _BY_BODY:
            return await self._by_body(scope, receive, send)
        if method == "GET" and path == "/v1/models":
            data = []
            for app in self.apps.values():  # with the caller's headers: an API key may be needed
                status, body = await _call(app, "GET", "/v1/models", headers=list(scope.get("headers", [])))
                if status != 200:
                    return await _json(send, status, json.loads(body))
                data.extend(json.loads(body)["data"])
            return await _json(send, 200, {"object": "list", "data": data})
        if path.startswith("/v1/models/"):
            name = self.aliases.get(path[len("/v1/models/"):])
            if name is None:
                return await self._not_found(send, path[len("/v1/models/"):])
            return await self.apps[name](scope, receive, send)
        if method == "GET" and path == "/healthz":
            out, ok, stopping = {}, True, False
            for name, app in self.apps.items():
                status, body = await _call(app, "GET", "/healthz", headers=list(scope.get("headers", [])))
                try:
                    seen = json.loads(body)
                except ValueError:
                    seen = None
                out[name] = seen if status == 200 or isinstance(seen, dict) else {"ok": False, "status": status}
                ok = ok and status == 200
                stopping = stopping or (isinstance(seen, dict) and bool(seen.get("shutting_down")))
            # a draining orchestrator says so at the top, as a one-model one does: clients and balancers skip it
            return await _json(send, 200 if ok else 503, {"ok": ok, "models": out, "version": build_version(),
                                                          **({"shutting_down": True} if stopping else {})})
        m = _SESSION.match(path)
        if m:
            # held here, or opened through a forward on another orchestrator (its model's app forwards the calls)
            owner = next((n for n, o in self.orchs.items() if m.group(1) in o.sessions
                          or m.group(1) in getattr(getattr(o, "groups", None), "session_owners", ())), self.default)
            return await self.apps[owner](scope, receive, send)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if method == "GET" and path == "/metrics" and not query.get("model"):
            return await self._metrics(send)
        asked = (query.get("model") or [self.default])[0]
        name = self.aliases.get(asked)
        if name is None:
            return await self._not_found(send, asked)
        if method == "GET" and path == "/api/v1/swarm":
            return await self._swarm(scope, name, send)
        return await self.apps[name](scope, receive, send)

    async def _metrics(self, send: Send) -> None:
        body = ModelsCollector(self.orchs).exposition()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _swarm(self, scope: Scope, name: str, send: Send) -> None:
        status, body = await _call(self.apps[name], "GET", "/api/v1/swarm", scope.get("query_string", b""),
                                   headers=list(scope.get("headers", [])))
        if status != 200:
            return await _json(send, status, json.loads(body))
        state = json.loads(body)
        state.update(models_json(self.orchs, name, self.placer))
        replay = (state.get("relay") if isinstance(state.get("relay"), dict) else {}).get("replay_cache")
        cache = getattr(self.orchs[name], "replay_cache", None)
        if isinstance(replay, dict) and cache is not None:  # the figures count every model's jobs: say whose
            replay["shared_by"] = [n for n, o in self.orchs.items() if getattr(o, "replay_cache", None) is cache]
        # a server the placer moved off a model it cannot load: the row of the model it serves says which and why
        failures = getattr(self.placer, "load_failures", None) or {}
        for row in state.get("servers", []):
            if by := failures.get(row.get("peer_id")):
                row["failed_models"] = {m: {"failed_span": f["failed_span"], "load_error": f["load_error"],
                                            "reason": f.get("reason", "reported")}
                                        for m, f in by.items()}
        await _json(send, 200, state)

    async def _by_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A request the API refuses before reading its body (no key or an unknown one, a Content-Length past the
        # limit) goes to the default model's API unread: reading up to 64 MiB per request first let anyone make
        # the router buffer it.
        limits = [x.limits for x in (getattr(getattr(a, "state", None), "limits", None) for a in self.apps.values())
                  if x is not None]
        cap = min(MAX_BODY, max((x.max_body_bytes for x in limits), default=MAX_BODY))
        if limits and limits[0].keys is not None and client_of(scope, limits[0].keys) is None:
            return await self.apps[self.default](scope, receive, send)
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length" and (not v.isdigit() or int(v) > cap):
                return await self.apps[self.default](scope, receive, send)
        try:
            body = await read_whole(receive, cap)
        except BodyTooLarge:  # the rest is not read
            # counted as the default model's refusal, as a Content-Length past the cap is (its limits answer that):
            # the model the body names was not read
            if (default := getattr(getattr(self.apps[self.default], "state", None), "limits", None)) is not None:
                default.count_refusal("body_too_large")
            return await _json(send, 413, {"error": {"message": f"the request body is larger than {cap} bytes",
                                                     "type": "invalid_request_error", "code": "body_too_large"}})
        if body is None:
            return  # the client went away
        # read once: the model's limits and its endpoint take these bytes and this parse (limits.ReadBodyRoute)
        read = scope[READ_BODY] = ReadBody(body)
        try:
            obj = read.json() if body.strip() else {}
        except (ValueError, RecursionError):  # too deep for the parser: the default model's app answers 400 too
            obj = None  # the default model's app answers 400 with its own message
        asked = obj.get("model") if isinstance(obj, dict) else None
        if asked is not None and not isinstance(asked, str):
            asked = None  # not a name (a number, a list): the default model's API answers 400 for its type, not 404
        name = self.default if asked is None else self.aliases.get(asked)
        if name is None:
            return await self._not_found(send, asked)
        await self.apps[name](scope, replay_body(body, receive), send)  # then the client's disconnect, as apps expect
