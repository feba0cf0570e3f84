"""The HTTP router in front of several models' APIs (orchestrator/models.py), over stand-in ASGI apps: what goes
where, what a caller's headers reach, and the parse of ``--model`` values. tests/test_multimodel_swarm.py drives it
with real orchestrators."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from petals_chain.orchestrator.models import ModelRouter, parse_models


def stand_in(name: str, seen: list):
    """An ASGI app answering as model ``name``'s API; it records (path, query, body, authorization) per request."""

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        headers = dict(scope["headers"])
        seen.append((name, scope["path"], scope["query_string"], body, headers.get(b"authorization")))
        if headers.get(b"authorization") != b"Bearer k":
            status, out = 401, {"error": {"message": "no key"}}
        elif scope["path"] == "/v1/models":
            out, status = {"object": "list", "data": [{"id": name}]}, 200
        elif scope["path"] == "/api/v1/swarm":
            out, status = {"model": name}, 200
        else:
            out, status = {"served_by": name}, 200
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    return app


def orch(name: str, prefix: str, sessions=()):
    return SimpleNamespace(model_id=name, prefix=prefix, cfg=SimpleNamespace(model=f"/models/{prefix}"),
                           sessions={s: object() for s in sessions}, planner=None,
                           dispatch=SimpleNamespace(chains=[1], queue_length=0),
                           stats=SimpleNamespace(completed=3, failed=0, unserved=0, cancelled=0))


def test_router_routes_by_body_session_and_query_with_the_callers_headers():
    seen: list = []
    router = ModelRouter({"chat": stand_in("chat", seen), "code": stand_in("code", seen)},
                         {"chat": orch("chat", "Tiny-Chat"), "code": orch("code", "Tiny-Code", sessions=["s1"])})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x",
                                     headers={"Authorization": "Bearer k"}) as c:
            r = await c.post("/v1/completions", json={"model": "code", "prompt": "hi"})
            assert r.json() == {"served_by": "code"} and seen[-1][3] == b'{"model":"code","prompt":"hi"}'
            assert (await c.post("/v1/chat/completions", json={"model": "Tiny-Code"})).json() == {"served_by": "code"}
            assert (await c.post("/api/v1/sessions", json={})).json() == {"served_by": "chat"}  # the first model
            assert (await c.get("/api/v1/sessions/s1")).json() == {"served_by": "code"}  # its owner
            assert (await c.post("/api/v1/sessions/s1/generate", json={"prompt": "x"})).json()["served_by"] == "code"
            assert (await c.get("/metrics", params={"model": "code"})).json() == {"served_by": "code"}
            assert (await c.get("/metrics", params={"model": "Tiny-Chat"})).json() == {"served_by": "chat"}
            state = (await c.get("/api/v1/swarm", params={"model": "code"})).json()
            assert state["model"] == "code" and state["model_name"] == "code"
            assert [m["name"] for m in state["models"]] == ["chat", "code"]
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["chat", "code"]
            assert (await c.get("/v1/models/Tiny-Chat")).json() == {"served_by": "chat"}
            for r in (await c.post("/v1/completions", json={"model": "gpt-4"}), await c.get("/v1/models/gpt-4"),
                      await c.get("/", params={"model": "gpt-4"})):
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
                assert "'chat', 'code'" in r.json()["error"]["message"]
            # not JSON: the default model's API answers (with its own 400)
            r = await c.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
            assert r.json() == {"served_by": "chat"} and seen[-1][3] == b"{nope"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            assert (await c.get("/v1/models")).status_code == 401  # the caller's (missing) key, not the router's
            health = await c.get("/healthz")
            assert health.status_code == 503 and set(health.json()["models"]) == {"chat", "code"}

    asyncio.run(main())
    assert all(auth in (b"Bearer k", None) for *_, auth in seen)


def test_a_request_the_api_refuses_unread_reaches_it_unread(tmp_path):
    """No key (or a wrong one) or a Content-Length past the limit: the router hands the request to the default
    model's API, which refuses it before reading the body, instead of buffering the body (up to 64 MiB) to route
    it first."""
    from petals_chain.orchestrator.auth import KeyRing

    keys = tmp_path / "keys"
    keys.write_text(f"alice {'k' * 16}\n")
    seen: list = []
    apps = {"chat": stand_in("chat", seen), "code": stand_in("code", seen)}
    for app in apps.values():
        app.state = SimpleNamespace(limits=SimpleNamespace(limits=SimpleNamespace(keys=KeyRing.from_file(keys),
                                                                                  max_body_bytes=1000)))
    router = ModelRouter(apps, {"chat": orch("chat", "Tiny-Chat"), "code": orch("code", "Tiny-Code")})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            body = {"model": "code", "prompt": "hi"}
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await c.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and seen[-1][0] == "chat"
            key = {"Authorization": f"Bearer {'k' * 16}"}
            await c.post("/v1/completions", json=body, headers=key)
            assert seen[-1][0] == "code"
            await c.post("/v1/completions", json={**body, "prompt": "x" * 2000}, headers=key)
            assert seen[-1][0] == "chat"  # too large to read: the default API answers (its own 413)

    asyncio.run(main())


def test_parse_models():
    assert parse_models(["smollm2-135m"]) == [(None, "smollm2-135m")]
    assert parse_models(["chat=smollm2-135m", "code=/m/x"]) == [("chat", "smollm2-135m"), ("code", "/m/x")]
    assert parse_models(["solo=/m/x"]) == [("solo", "/m/x")]
    assert parse_models(["/m/eq=dir/x"]) == [(None, "/m/eq=dir/x")]  # a path holding "=" is a bare source
    for bad, why in ((["a=/x", "/y"], "NAME=SOURCE"), (["a=/x", "a=/y"], "differ"), (["a b=/x", "c=/y"], "model name"),
                     (["a=", "b=/y"], "NAME=SOURCE")):
        with pytest.raises(ValueError, match=why):
            parse_models(bad)


def test_a_keys_limits_hold_over_every_model_behind_the_router(tiny_model_factory, tmp_path):
    """Per-key limits (and --max-sessions) are the key's over every model one orchestrator process serves: counted
    per model's app, a key had its tokens per minute, sessions and concurrency once per model (the reviewer's swarm:
    60 tokens in a minute and two sessions for a key allowed 30 and one)."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.limits import ClientLedger

    keys = tmp_path / "keys"
    keys.write_text("alice alice-secret-0123456789 tokens_per_minute=30 max_sessions=1\n"
                    "bob bob-secret-0123456789\n")
    orchs = []
    for name, layers in (("alpha", 4), ("beta", 2)):
        o = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=layers)), model_id=name,
                                            max_length=64, port=0, api_keys=str(keys), max_sessions=2))
        o.load_model()
        orchs.append(o)
    ledger = ClientLedger(orchs)
    for o in orchs:
        o.siblings = orchs
    router = ModelRouter({o.model_id: create_app(o, ledger) for o in orchs}, {o.model_id: o for o in orchs})

    async def main():
        alice = {"Authorization": "Bearer alice-secret-0123456789"}
        bob = {"Authorization": "Bearer bob-secret-0123456789"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            r = await c.post("/api/v1/sessions", json={"model": "alpha"}, headers=alice)
            assert r.status_code == 200, r.text
            r = await c.post("/api/v1/sessions", json={"model": "beta"}, headers=alice)
            assert r.status_code == 429 and r.json()["error"]["code"] == "client_session_limit", r.text
            # --max-sessions 2 in total: bob's first session is the second of the process, his next one too many
            assert (await c.post("/api/v1/sessions", json={"model": "beta"}, headers=bob)).status_code == 200
            r = await c.post("/api/v1/sessions", json={"model": "beta"}, headers=bob)
            assert r.status_code == 429 and "too many open sessions" in r.json()["error"]["message"]
            orchs[0].stats._charge("alice", 25, "completed")  # 25 of alice's 30 tokens used on alpha
            r = await c.post("/v1/completions", headers=alice,
                             json={"model": "beta", "prompt": [1, 2, 3], "max_tokens": 10})
            assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute", r.text

    asyncio.run(main())


def test_a_session_opened_through_a_forward_is_routed_to_its_models_app():
    """A session one model's orchestrator opened on another orchestrator (forwarded: its id in that model's
    ``groups.session_owners``, not in any ``sessions``) went to the default model's app, which knew nothing of it."""
    from petals_chain.orchestrator.forward import SessionOwners

    seen: list = []
    chat, code = orch("chat", "Tiny-Chat"), orch("code", "Tiny-Code")
    for o in (chat, code):
        o.groups = SimpleNamespace(session_owners=SessionOwners())
    code.groups.session_owners.remember("far-1", "http://other:8000")
    router = ModelRouter({"chat": stand_in("chat", seen), "code": stand_in("code", seen)}, {"chat": chat, "code": code})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x",
                                     headers={"Authorization": "Bearer k"}) as c:
            assert (await c.get("/api/v1/sessions/far-1")).json() == {"served_by": "code"}

    asyncio.run(main())


def test_metrics_without_a_model_are_every_models_labelled(tiny_model_factory):
    """``/metrics`` on a multi-model orchestrator was the first model's alone, with no ``model`` label: a Prometheus
    scrape never saw the other models' requests, deadlines or queues. Now one exposition holds every model's series,
    each labelled; ``?model=NAME`` stays that model's, unlabelled."""
    from prometheus_client.parser import text_string_to_metric_families

    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.limits import ClientLedger

    orchs = []
    for name, layers in (("alpha", 4), ("beta", 2)):
        o = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=layers)), model_id=name,
                                            max_length=64, port=0))
        o.load_model()
        orchs.append(o)
    ledger = ClientLedger(orchs)
    router = ModelRouter({o.model_id: create_app(o, ledger) for o in orchs}, {o.model_id: o for o in orchs})
    orchs[0].stats.record(wait_s=0.1, service_s=0.2, tokens=3, prompt_tokens=2, ok=True)
    for _ in range(2):
        orchs[1].stats.record(wait_s=0.1, service_s=0.2, tokens=3, prompt_tokens=2, ok=False)
    orchs[1].stats.m_deadlines.labels("bob", "missed").inc()

    def samples(text: str) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            r = await c.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            both = samples(r.text)
            assert both[("petals_chain_requests_total", (("model", "alpha"), ("outcome", "completed")))] == 1
            assert both[("petals_chain_requests_total", (("model", "beta"), ("outcome", "failed")))] == 2
            assert ("petals_chain_requests_total", (("model", "alpha"), ("outcome", "failed"))) not in both
            key = ("petals_chain_deadline_requests_total", (("client", "bob"), ("model", "beta"), ("outcome", "missed")))
            assert both[key] == 1
            assert {dict(k[1]).get("model") for k in both} == {"alpha", "beta"}  # every sample labelled
            one = samples((await c.get("/metrics", params={"model": "beta"})).text)
            assert one[("petals_chain_requests_total", (("outcome", "failed"),))] == 2
            assert all("model" not in dict(k[1]) for k in one)

    asyncio.run(main())


def test_the_first_request_without_a_key_is_refused_unread(tiny_model_factory, tmp_path):
    """Each model's API built its limits at its first request, so until then the router in front saw no limits and
    read a request's whole body (up to 64 MiB) to route it before the API refused it for a missing key."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.limits import ClientLedger

    keys = tmp_path / "keys"
    keys.write_text("alice alice-secret-0123456789\n")
    orchs = []
    for name, layers in (("alpha", 4), ("beta", 2)):
        o = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=layers)), model_id=name,
                                            max_length=64, port=0, api_keys=str(keys)))
        o.load_model()
        orchs.append(o)
    ledger = ClientLedger(orchs)
    router = ModelRouter({o.model_id: create_app(o, ledger) for o in orchs}, {o.model_id: o for o in orchs})
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b'{"model": "beta", "prompt": "x"}', "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"33")], "scheme": "http",
             "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0), "root_path": ""}
    asyncio.run(router(scope, receive, send))
    assert sent[0]["status"] == 401 and reads == []


def test_a_body_nested_past_the_parser_reaches_the_default_models_app():
    """json.loads raises RecursionError (not ValueError) for a body ~1000 deep: the router answered 500; now the
    default model's app gets the body and answers it (a real API app: 400 invalid_json)."""
    seen: list = []
    router = ModelRouter({"chat": stand_in("chat", seen), "code": stand_in("code", seen)},
                         {"chat": orch("chat", "Tiny-Chat"), "code": orch("code", "Tiny-Code")})
    body = b'{"model": "code", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x",
                                     headers={"Authorization": "Bearer k", "Content-Type": "application/json"}) as c:
            r = await c.post("/v1/completions", content=body)
            assert r.status_code == 200 and r.json() == {"served_by": "chat"} and seen[-1][3] == body

    asyncio.run(main())
