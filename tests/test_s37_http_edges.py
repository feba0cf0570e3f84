"""HTTP at the edges of the protocol, on the orchestrator's API and the dashboard (swarm/httpedge.py): request bodies
sent with ``Content-Encoding`` (gzip and deflate decoded, bounded once decoded; other codings a 415), ``HEAD`` on
the GET endpoints, a 405's ``Allow``, a path with ``//``, a client gone before its body came.

Before: a gzip body was "not valid JSON: it is not UTF-8 text", a body marked ``br`` was read as plain JSON, HEAD
/healthz and every other HEAD were 405, no 405 named its methods, ``GET //v1/models`` was told "the API is under
/v1", and a client that left mid-body was logged and counted as a 400 ``invalid_request``.

The orchestrator runs in this process over fake chains (test_s33_api_envelope's: their hops return their input)."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import httpx
import pytest
from test_s33_api_envelope import FakeChainSession, _chain
from test_model_router import orch as stand_in_orch, stand_in

LIMIT = 200_000  # the orchestrator's --max-body-bytes here
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def api(tiny_model_factory):
    """(orchestrator, app) over fake chains, one chain up; no API keys; bodies up to :data:`LIMIT` bytes."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(failover, "ChainSession", FakeChainSession)
        mp.setattr(FakeChainSession, "delay", 0.0)
        orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), port=0,
                                               max_length=128, no_chain_wait_s=5.0))
        orch.cfg.max_body_bytes = LIMIT  # read by the limits as --max-body-bytes is
        orch.load_model()
        orch.batcher = HeadBatcher(orch.head)
        try:
            yield orch, create_app(orch)
        finally:
            orch.batcher.close()


def _run(api, fn):
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(4)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://o", timeout=60) as c:
            return await fn(orch, c)

    return asyncio.run(main())


def _body(orch, **extra) -> bytes:
    return json.dumps({"model": orch.model_id, **CHAT, **extra}).encode()


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def test_a_gzip_or_deflate_body_is_decoded(api):
    """gzip (``x-gzip`` too), deflate in its zlib format and raw, a gzip of two members: the same reply as the plain
    body (greedy), streamed too; ``identity`` is no coding."""

    async def fn(orch, c):
        plain = _body(orch)
        want = (await c.post("/v1/chat/completions", content=plain,
                             headers={"content-type": "application/json"})).json()["petals_chain"][0]["token_ids"]
        half = len(plain) // 2
        out = {}
        for name, coding, data in (("gzip", "gzip", gzip.compress(plain)), ("x-gzip", "x-gzip", gzip.compress(plain)),
                                   ("zlib", "deflate", zlib.compress(plain)), ("raw", "deflate", _raw_deflate(plain)),
                                   ("members", "gzip", gzip.compress(plain[:half]) + gzip.compress(plain[half:])),
                                   ("identity", "Identity", plain)):
            r = await c.post("/v1/chat/completions", content=data,
                             headers={"content-type": "application/json", "content-encoding": coding})
            out[name] = (r.status_code, r.json())
        streamed = await c.post("/v1/chat/completions", content=gzip.compress(_body(orch, stream=True)),
                                headers={"content-type": "application/json", "content-encoding": "gzip"})
        return want, out, streamed

    want, out, streamed = _run(api, fn)
    for name, (status, body) in out.items():
        assert status == 200, (name, body)
        assert body["petals_chain"][0]["token_ids"] == want, name
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_another_coding_is_a_415_naming_the_ones_taken(api):
    """br, zstd and two codings at once: 415 with ``Accept-Encoding`` (RFC 9110 §12.5.3), never read as plain JSON."""

    async def fn(orch, c):
        out = []
        for coding in ("br", "zstd", "gzip, gzip"):
            r = await c.post("/v1/chat/completions", content=_body(orch),
                             headers={"content-type": "application/json", "content-encoding": coding})
            out.append((coding, r.status_code, r.headers.get("accept-encoding"), r.json()["error"]))
        return out

    for coding, status, accepted, error in _run(api, fn):
        assert status == 415 and accepted == "gzip, deflate", coding
        assert error["code"] == "unsupported_content_encoding" and repr(coding) in error["message"], error


def test_a_bad_coded_body_is_a_400_and_a_bomb_stops_at_the_limit(api):
    """A corrupt or cut gzip body, trailing bytes after a deflate stream: 400 ``invalid_content_encoding``. A body of
    ~20 kB that inflates to 20 MB is refused (413 ``body_too_large``) once it passes the limit, its rest never
    decoded; so is a gzip stream of empty blocks that decode to nothing, once its coded bytes pass it."""
    bomb = gzip.compress(b" " * 20_000_000, compresslevel=9)
    empty = gzip.compress(b"")  # its header, then empty stored blocks (5 bytes each), then its end
    blocks = empty[:10] + b"\x00\x00\x00\xff\xff" * (LIMIT // 5 + 2) + empty[10:]

    async def fn(orch, c):
        plain = _body(orch)
        good = gzip.compress(plain)
        cases = {"corrupt": ("gzip", good[:10] + b"\x00" * 8 + good[18:]), "cut": ("gzip", good[:-12]),
                 "trailing": ("deflate", zlib.compress(plain) + b"xx"), "not gzip": ("gzip", plain),
                 "bomb": ("gzip", bomb), "empty blocks": ("gzip", blocks)}
        out = {}
        for name, (coding, data) in cases.items():
            r = await c.post("/v1/chat/completions", content=data,
                             headers={"content-type": "application/json", "content-encoding": coding})
            out[name] = (r.status_code, r.json()["error"])

        async def chunks():  # a plain body without Content-Length: the limit trips while FastAPI reads it
            for _ in range(LIMIT // 10_000 + 1):
                yield b" " * 10_000

        r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        out["chunked"] = (r.status_code, r.json()["error"])
        return out

    out = _run(api, fn)
    assert len(bomb) < LIMIT
    for name in ("corrupt", "cut", "trailing", "not gzip"):
        status, error = out[name]
        assert status == 400 and error["code"] == "invalid_content_encoding", (name, error)
    for name in ("bomb", "empty blocks", "chunked"):  # chunked: the limits' own code (it was request_too_large)
        status, error = out[name]
        assert status == 413 and error["code"] == "body_too_large" and str(LIMIT) in error["message"], (name, error)


def test_a_layer_that_reads_the_body_itself_gets_it_decoded_and_its_errors_answered():
    """A router in front of several models' APIs reads the body to find its model (orchestrator/__main__.py puts
    DecodedBody in front of it): a gzip body goes to the model it names, decoded; a bomb raised through the router
    is answered 413 by DecodedBody; HEAD reaches the router's own answers as GET."""
    from petals_chain.orchestrator.models import ModelRouter
    from petals_chain.swarm.httpedge import DecodedBody, HeadAsGet

    seen: list = []
    router = ModelRouter({"chat": stand_in("chat", seen), "code": stand_in("code", seen)},
                         {"chat": stand_in_orch("chat", "Tiny-Chat"), "code": stand_in_orch("code", "Tiny-Code")})
    app = HeadAsGet(DecodedBody(router, limit=lambda: 100_000))
    plain = json.dumps({"model": "code", "prompt": "hi"}).encode()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x",
                                     headers={"Authorization": "Bearer k"}) as c:
            routed = await c.post("/v1/completions", content=gzip.compress(plain),
                                  headers={"content-type": "application/json", "content-encoding": "gzip"})
            bomb = await c.post("/v1/completions", content=gzip.compress(b" " * 1_000_000),
                                headers={"content-type": "application/json", "content-encoding": "gzip"})
            head, get = await c.head("/v1/models"), await c.get("/v1/models")
            return routed, bomb, head, get

    routed, bomb, head, get = asyncio.run(main())
    assert routed.json() == {"served_by": "code"} and seen[0][3] == plain
    assert bomb.status_code == 413 and bomb.json()["error"]["code"] == "body_too_large"
    assert head.status_code == get.status_code == 200 and head.content == b"" and get.json()["data"]


def test_head_answers_as_get_without_the_body(api):
    """HEAD on the GET endpoints (the limits' own /api/v1/limits too): GET's status and headers, no body."""

    async def fn(orch, c):
        out = {}
        for path in ("/healthz", "/v1/models", f"/v1/models/{orch.model_id}", "/api/v1/swarm", "/metrics", "/",
                     "/api/v1/limits", "/v1/models/nope"):
            head, get = await c.head(path), await c.get(path)
            out[path] = (head.status_code, head.content, head.headers.get("content-type"), get.status_code,
                         get.headers.get("content-type"))
        return out

    for path, (status, body, kind, get_status, get_kind) in _run(api, fn).items():
        assert (status, body, kind) == (get_status, b"", get_kind), path
    assert _run(api, fn)["/v1/models/nope"][0] == 404


def test_a_405_names_the_methods_allowed_and_a_double_slash_is_named(api):
    """A 405 carries ``Allow`` (RFC 9110 §15.5.6 requires it): GET or OPTIONS on a POST endpoint, POST on a GET one,
    any other method on /api/v1/limits. ``GET //v1/models`` (a base URL ending in "/" joined to "/v1/models") is a
    404 that points at the ``//``, not "the API is under /v1"."""

    async def fn(orch, c):
        out = {}
        for method, path in (("GET", "/v1/chat/completions"), ("OPTIONS", "/v1/completions"),
                             ("POST", "/healthz"), ("DELETE", "/v1/models"), ("POST", "/api/v1/limits")):
            r = await c.request(method, path)
            out[(method, path)] = (r.status_code, r.headers.get("allow"), r.json()["error"]["code"])
        slash = (await c.get(httpx.URL("http://o//v1/models"))).json()["error"]["message"]
        return out, slash

    out, slash = _run(api, fn)
    assert out == {("GET", "/v1/chat/completions"): (405, "POST", "method_not_allowed"),
                   ("OPTIONS", "/v1/completions"): (405, "POST", "method_not_allowed"),
                   ("POST", "/healthz"): (405, "GET", "method_not_allowed"),
                   ("DELETE", "/v1/models"): (405, "GET", "method_not_allowed"),
                   ("POST", "/api/v1/limits"): (405, "GET", "method_not_allowed")}
    assert "'//'" in slash and "GET /v1/models" in slash and "under /v1" not in slash, slash


def test_a_client_gone_before_its_body_came_is_counted_cancelled_not_invalid(api):
    """A request whose client disconnects mid-body (plain and gzip): not answered as a 400 ``invalid_request`` nor
    counted as invalid in ``petals_chain_api_requests``: a 499 ``client_disconnected``, counted cancelled."""
    orch, app = api

    def outcomes() -> dict:
        return {o: orch.stats.m_api_requests.labels("anonymous", o)._value.get() for o in ("invalid", "cancelled")}

    async def call(coding: bytes | None) -> list:
        part = b'{"model": "' if coding is None else gzip.compress(_body(orch))[:15]
        messages = [{"type": "http.request", "body": part, "more_body": True}, {"type": "http.disconnect"}]
        sent: list = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"host", b"o")]
        headers += [(b"content-encoding", coding)] if coding else [(b"content-length", b"1000")]
        await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                   "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                   "query_string": b"", "headers": headers, "client": ("127.0.0.1", 1), "server": ("o", 80)},
                  receive, send)
        return sent

    before = outcomes()
    sent = [asyncio.run(call(coding)) for coding in (None, b"gzip")]
    after = outcomes()
    for messages in sent:
        status = next(m["status"] for m in messages if m["type"] == "http.response.start")
        body = json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"))
        assert status == 499 and body["error"]["code"] == "client_disconnected", body
    assert after["invalid"] == before["invalid"] and after["cancelled"] == before["cancelled"] + 2


def test_the_dashboard_answers_head():
    """The standalone dashboard: HEAD / and /healthz answer as GET (they were 405)."""
    from fastapi.testclient import TestClient

    from petals_chain.dashboard.app import create_app

    client = TestClient(create_app(lambda: {"model": "m", "servers": [], "chains": []}, lambda: (True, {})))
    for path in ("/", "/healthz", "/api/v1/swarm"):
        head, get = client.head(path), client.get(path)
        assert (head.status_code, head.content) == (200, b"") and get.status_code == 200, path
        assert head.headers["content-type"] == get.headers["content-type"], path
