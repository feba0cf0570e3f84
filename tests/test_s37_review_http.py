"""Review of the HTTP edges (swarm/httpedge.py) and of how a client that leaves is counted.

* ``HEAD`` ran the app on the server's own scope with its method set to GET: uvicorn's httptools protocol (what
  ``uvicorn[standard]`` installs) reads the method as the response goes out, so it expected GET's body after the
  headers and raised "Response content shorter than Content-Length" (a traceback per ``curl -I``, per uptime check),
  and its access log said GET. The server's scope now says HEAD throughout; the keys the app sets still reach the
  layers outside (the request's count by route, its client's release).
* A job whose client left while it held a chain was counted ``failed`` in ``petals_chain_requests`` (and in its
  client's totals, the dashboard's "failed") while ``petals_chain_api_requests`` counted its request ``cancelled``:
  now ``cancelled`` in both. The requests here come gzip-coded, so the client's leaving is seen through DecodedBody
  (a stream's and a plain reply's ``is_disconnected`` poll alike).
* A gzip body of many tiny members (21 bytes each) was decoded member by member, each with a decompressor of its own
  and a copy of the rest of its message: 8 MiB of them held the event loop for seconds (0.2-0.5 s of CPU per MiB),
  decoding to almost nothing. At most ``MAX_GZIP_MEMBERS`` are read; past that, a 400 naming the cap.
* A deflate body's bytes after its stream were a 400 only when they came in the stream's last message: in a later
  one (another TCP segment) they started a second stream, decoded and appended.

The orchestrator runs in this process over fake chains (test_s33_api_envelope's: their hops return their input)."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from test_s33_api_envelope import FakeChainSession, _chain


@pytest.fixture(scope="module")
def api(tiny_model_factory):
    """(orchestrator, app) over fake chains, no API keys."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(failover, "ChainSession", FakeChainSession)
        mp.setattr(FakeChainSession, "delay", 0.0)
        orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), port=0,
                                               max_length=256))
        orch.load_model()
        orch.batcher = HeadBatcher(orch.head)
        try:
            yield orch, create_app(orch)
        finally:
            orch.batcher.close()


def _scope(method: str, path: str, headers: list) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"o"), *headers], "client": ("127.0.0.1", 1), "server": ("o", 80)}


async def _as_a_server(app, scope: dict, receive, on_send=None) -> tuple[list, list]:
    """Run ``app`` on ``scope`` as uvicorn does: (messages sent, the scope's method as each one went out)."""
    sent, methods = [], []

    async def send(message):
        sent.append(message)
        methods.append(scope["method"])  # what uvicorn reads here: httptools' framing, the access log
        if on_send is not None:
            on_send(message)

    await asyncio.wait_for(app(scope, receive, send), 60)
    return sent, methods


async def _no_body():
    return {"type": "http.request", "body": b"", "more_body": False}


def test_head_leaves_the_servers_method_head(api):
    """HEAD on the API and the dashboard: each message goes out with the scope's method HEAD (it was GET), no body;
    the API still counts the request by its route and releases its client's hold on the limits."""
    from petals_chain.dashboard.app import create_app as dashboard_app

    orch, app = api
    dashboard = dashboard_app(lambda: {"model": "m", "servers": [], "chains": []}, lambda: (True, {}))
    routed = orch.stats.m_endpoints.labels("/v1/models", "completed")
    before = routed._value.get()

    async def main():
        out = {}
        for name, target, path in (("api", app, "/v1/models"), ("api", app, "/healthz"),
                                   ("dashboard", dashboard, "/healthz")):
            scope = _scope("HEAD", path, [])
            out[(name, path)] = (*await _as_a_server(target, scope, _no_body), scope)
        return out

    for (name, path), (sent, methods, scope) in asyncio.run(main()).items():
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, (name, path, sent[0])
        assert set(methods) == {"HEAD"}, (name, path, methods)
        assert scope["method"] == "HEAD" and b"".join(m.get("body", b"") for m in sent[1:]) == b"", (name, path)
    assert routed._value.get() == before + 1  # by the route the router set inside
    assert not app.state.limits.ledger.active.get("anonymous")  # the hold the limits took inside was released


def test_a_client_gone_mid_generation_counts_its_job_cancelled_not_failed(api):
    """A gzip-coded stream whose client leaves after its first event, and a gzip-coded plain request whose client
    leaves while it runs: both are seen gone through DecodedBody (the stream ends, the other is a 499), and each job,
    which held a chain, is counted ``cancelled`` as its request is, never ``failed``."""
    orch, app = api
    stats = orch.stats

    def counts() -> dict:
        return {"jobs": {o: stats.m_requests.labels(o)._value.get() for o in ("failed", "cancelled")},
                "requests": stats.m_api_requests.labels("anonymous", "cancelled")._value.get(),
                "client": {o: stats.client_totals("anonymous").get(o, 0) for o in ("failed", "cancelled")},
                "measured": {o: stats.measured().get(o, 0) for o in ("failed", "cancelled")}}

    async def leave(stream: bool) -> list:
        body = gzip.compress(json.dumps({"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 200,
                                         "ignore_eos": True, "stream": stream}).encode())
        gone, asked = asyncio.Event(), False
        if not stream:  # a plain reply: gone while it runs (unless_disconnected polls every second)
            asyncio.get_running_loop().call_later(0.2, gone.set)

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # as uvicorn's: at once when the connection is gone
            return {"type": "http.disconnect"}

        def first_event(message):  # a stream's client leaves once its first event came
            if stream and message["type"] == "http.response.body" and message.get("body"):
                gone.set()

        scope = _scope("POST", "/v1/completions", [(b"content-type", b"application/json"),
                                                   (b"content-encoding", b"gzip")])
        return (await _as_a_server(app, scope, receive, first_event))[0]

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        return [await leave(stream) for stream in (True, False)]

    before = counts()
    FakeChainSession.delay = 0.05  # 200 tokens: 10 s unless cancelled
    try:
        streamed, plain = asyncio.run(main())
    finally:
        FakeChainSession.delay = 0.0
    after = counts()
    events = b"".join(m.get("body", b"") for m in streamed if m["type"] == "http.response.body")
    assert streamed[0]["status"] == 200 and events.startswith(b"data: ") and b"[DONE]" not in events, events[-300:]
    error = json.loads(b"".join(m.get("body", b"") for m in plain if m["type"] == "http.response.body"))["error"]
    assert plain[0]["status"] == 499 and error["code"] == "client_disconnected", error
    assert after["requests"] == before["requests"] + 2
    for kind in ("jobs", "client", "measured"):
        assert after[kind]["cancelled"] == before[kind]["cancelled"] + 2, (kind, before, after)
        assert after[kind]["failed"] == before[kind]["failed"], (kind, before, after)


def _echo_through_decoded_body(coding: bytes, parts: list[bytes], limit: int = 1 << 20) -> tuple[int, dict | bytes]:
    """(status, JSON error or body echoed) of ``parts`` (one receive() each) sent with ``coding`` through
    DecodedBody to an app that reads the whole body and sends it back."""
    from petals_chain.swarm.httpedge import DecodedBody

    async def echo(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def main():
        sent, _ = await _as_a_server(DecodedBody(echo, limit=lambda: limit),
                                     _scope("POST", "/x", [(b"content-encoding", coding)]), receive)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], (body if sent[0]["status"] == 200 else json.loads(body)["error"])

    return asyncio.run(main())


def test_gzip_members_are_capped_and_deflate_has_one_stream_whatever_the_messages():
    """:data:`MAX_GZIP_MEMBERS` members are decoded whole; one more is a 400 naming the cap (it was decoded, however
    many: seconds of CPU for a body of tiny ones). A second deflate stream is a 400 whether it comes in the first
    stream's message or in the next (it was decoded and appended when in the next)."""
    import zlib

    from petals_chain.swarm.httpedge import MAX_GZIP_MEMBERS

    members = [gzip.compress(bytes([65 + i % 26])) for i in range(MAX_GZIP_MEMBERS + 1)]
    assert _echo_through_decoded_body(b"gzip", [b"".join(members[:-1])]) == (
        200, bytes(65 + i % 26 for i in range(MAX_GZIP_MEMBERS)))
    for parts in ([b"".join(members)], members):  # in one message, and one member a message
        status, error = _echo_through_decoded_body(b"gzip", parts)
        assert status == 400 and error["code"] == "invalid_content_encoding", error
        assert f"more than {MAX_GZIP_MEMBERS} gzip members" in error["message"], error
    first, second = zlib.compress(b'{"a": 1}'), zlib.compress(b'{"b": 2}')
    for parts in ([first + second], [first, second]):
        status, error = _echo_through_decoded_body(b"deflate", parts)
        assert status == 400 and "data after the end of the compressed stream" in error["message"], (parts, error)
