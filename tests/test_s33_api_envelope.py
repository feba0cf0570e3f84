"""The API's envelope as an operator and an OpenAI client see it: every response names its request
(``x-request-id``, the client's own when valid), a stream waiting in the queue sends SSE keepalive comments, every
error has a code and a 503 a ``Retry-After``, and every generation request is counted once in
``petals_chain_api_requests`` however early it was refused.

The orchestrator runs in this process with the real API, limits and dispatcher over fake chains (their hops return
their input): no server process, no DHT."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest

from petals_chain.model import Chain
from petals_chain.orchestrator.errors import RequestError

KEYS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}
GENERATED = re.compile(r"^req_[0-9a-f]{32}$")


class FakeChainSession:
    """A chain session whose hops return their input, each step after ``delay`` s."""

    delay = 0.0

    def __init__(self, client, hops, session_id, max_length, observe=None, wait_s=0.0, push=False):
        self.hops = list(hops)
        self.peers_used = {h[0] for h in self.hops}
        self.max_length = max_length
        self.cached_tokens, self.prefix_cache, self.push, self.wait_s = 0, False, False, wait_s
        self.silent_wait_max_s = float("inf")
        self.push_rescues = self.push_mismatches = 0

    async def open(self, fork_from=None, fork_length=0, named=b""):
        pass

    async def step(self, i, x, position):
        if FakeChainSession.delay:
            await asyncio.sleep(FakeChainSession.delay)
        return x.clone()

    async def extend(self, max_length):
        self.max_length = max(self.max_length, max_length)

    async def close(self, named=b""):
        pass


def fake_chain_app(tiny_model_factory, monkeypatch, **cfg):
    """(orchestrator, app) over fake chains (:class:`FakeChainSession`, no delay), its head batched, no API keys;
    ``cfg``: the OrchestratorConfig fields besides the model and port. A generator for fixtures to ``yield from``."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    monkeypatch.setattr(failover, "ChainSession", FakeChainSession)
    monkeypatch.setattr(FakeChainSession, "delay", 0.0)
    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), port=0, **cfg))
    orch.load_model()
    orch.batcher = HeadBatcher(orch.head)
    try:
        yield orch, create_app(orch)
    finally:
        orch.batcher.close()


@pytest.fixture
def api(tiny_model_factory, tmp_path, monkeypatch):
    """(orchestrator, app) with keys alice (tokens_per_minute=50) and bob, over fake chains; no chain yet."""
    from petals_chain.orchestrator import failover
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
    from petals_chain.orchestrator.relay import HeadBatcher

    monkeypatch.setattr(failover, "ChainSession", FakeChainSession)
    monkeypatch.setattr(FakeChainSession, "delay", 0.0)
    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEYS['alice']} tokens_per_minute=50\nbob {KEYS['bob']}\n")
    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=128,
                                           port=0, api_keys=str(keys), no_chain_wait_s=0.2))
    orch.cfg.max_body_bytes = 2_000_000  # the limits' body bound (read from the config as --max-body-bytes is)
    orch.load_model()
    orch.batcher = HeadBatcher(orch.head)
    try:
        yield orch, create_app(orch)
    finally:
        orch.batcher.close()


def _chain(capacity: int = 1) -> Chain:
    return Chain(servers=("a",), blocks=(2,), service_time=0.1, capacity=capacity, spans=((0, 2),))


def _client(app, name: str = "bob", **headers) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://x", timeout=60,
                             headers={"Authorization": f"Bearer {KEYS[name]}", **headers})


def _samples(text: str, name: str) -> dict[tuple, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[tuple(v.split('"')[1] for v in labels.split(","))] = float(value)
    return out


def test_every_response_names_its_request_and_its_log_lines_do_too(api, monkeypatch, caplog):
    """JSON, SSE, 404s, the limits' own 401 and 413, a 500: each has ``x-request-id``, the client's own when it is
    short printable ASCII, else a new ``req_<32 hex>``; the log line about a refused request ends with it."""
    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain(2)])
        body = {"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
        got = {}
        async with _client(app) as c:
            got["models"] = await c.get("/v1/models")
            got["own"] = await c.get("/v1/models", headers={"X-Request-Id": "trace-7.a:b_c"})
            got["bad"] = await c.get("/v1/models", headers={"X-Request-Id": "two words"})
            got["long"] = await c.get("/v1/models", headers={"X-Request-Id": "x" * 129})
            got["json"] = await c.post("/v1/completions", json=body)
            got["sse"] = await c.post("/v1/completions", json={**body, "stream": True})
            got["route"] = await c.get("/v1/nothing-here")
            got["unknown_model"] = await c.post("/v1/completions", json={**body, "model": "nope"})
            got["no_key"] = await c.get("/v1/models", headers={"Authorization": "Bearer wrong-key-0123456789"})
            got["body_413"] = await c.post("/v1/completions", content=b"x" * 2_000_001,
                                           headers={"content-type": "application/json"})
            with caplog.at_level(logging.INFO, logger="petals_chain"):
                got["too_long"] = await c.post("/v1/completions", json={**body, "prompt": "a" * 1_000_001},
                                               headers={"X-Request-Id": "mine-413"})

            def boom(*args, **kwargs):
                raise RuntimeError("boom")

            monkeypatch.setattr(orch, "validate_prompt", boom)
            got["bug"] = await c.post("/v1/completions", json=body)
        return got

    got = asyncio.run(main())
    statuses = {k: r.status_code for k, r in got.items()}
    assert statuses == {"models": 200, "own": 200, "bad": 200, "long": 200, "json": 200, "sse": 200, "route": 404,
                        "unknown_model": 404, "no_key": 401, "body_413": 413, "too_long": 413, "bug": 500}
    assert got["own"].headers["x-request-id"] == "trace-7.a:b_c"
    assert got["too_long"].headers["x-request-id"] == "mine-413"
    for k in ("models", "bad", "long", "json", "sse", "route", "unknown_model", "no_key", "body_413", "bug"):
        assert GENERATED.match(got[k].headers.get("x-request-id", "")), (k, dict(got[k].headers))
        assert len(got[k].headers.get_list("x-request-id")) == 1, k
    assert len({got[k].headers["x-request-id"] for k in ("models", "bad", "long", "json")}) == 4  # one per request
    lines = [r.getMessage() for r in caplog.records if "[request mine-413]" in r.getMessage()]
    assert any("413 prompt_too_long" in line for line in lines), [r.getMessage() for r in caplog.records]


def test_errors_have_codes_and_a_503_says_when_to_come_back(api, monkeypatch):
    """A 413 "prompt is too long" had code null, as did FastAPI's 404 for an unknown route and every RequestError
    raised without one; a non-streamed 503 (no chain) had no Retry-After while 429s had one. A stream's error event
    carries the non-streamed response's code (a bug's too: it was null)."""
    orch, app = api

    async def main():
        body = {"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 2}
        async with _client(app) as c:
            too_long = await c.post("/v1/completions", json={**body, "prompt": "a" * 1_000_001})
            chat_long = await c.post("/v1/chat/completions", json={
                "model": orch.model_id, "messages": [{"role": "user", "content": "a" * 1_000_001}]})
            many = await c.post("/v1/completions", json={**body, "n": orch.cfg.max_n + 1})
            route = await c.get("/v1/nothing-here")
            no_chain = await c.post("/v1/completions", json=body)  # no chain: 503 after no_chain_wait_s
            orch.dispatch.set_chains([_chain()])

            def boom(*args, **kwargs):
                raise RuntimeError("boom")

            monkeypatch.setattr(orch, "generate_n", boom)
            bug = await c.post("/v1/completions", json=body)
            bug_stream = await c.post("/v1/completions", json={**body, "stream": True})
        return too_long, chat_long, many, route, no_chain, bug, bug_stream

    too_long, chat_long, many, route, no_chain, bug, bug_stream = asyncio.run(main())
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "prompt_too_long"
    assert chat_long.status_code == 413 and chat_long.json()["error"]["code"] == "prompt_too_long"
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_choices"
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"
    assert no_chain.status_code == 503 and no_chain.json()["error"]["code"] == "swarm_unavailable"
    assert no_chain.headers.get("retry-after") == "3"  # a planner round (refresh_s 1) after settle_s (2)
    assert bug.status_code == 500 and bug.json()["error"]["code"] == "internal_error"
    # the stream's error event, before the dispatcher saw the request: sent as its HTTP status (limits.py)
    assert bug_stream.status_code == 500 and bug_stream.json()["error"]["code"] == "internal_error"
    assert bug_stream.json()["error"]["message"] == bug.json()["error"]["message"]  # not the exception's own text
    assert RequestError("raced", status=409).code == "conflict"
    assert RequestError("gone", status=404, code="session_not_found").code == "session_not_found"


def test_a_stream_waiting_in_the_queue_sends_keepalives_the_openai_client_skips(api):
    """A streamed request queued behind a held slot had nothing on the wire after its opening event for as long as
    it waited (a proxy's read timeout cut it); now an SSE comment goes out each ``sse_keepalive_s`` of silence, before
    the opening event too when that waits for the prompt's scoring (echo with logprobs). The openai package parses
    such a stream into the same chunks."""
    import openai

    from petals_chain.orchestrator.dispatch import DispatchJob

    orch, app = api
    orch.cfg.sse_keepalive_s = 0.05
    raw: list[bytes] = []

    class Recording(httpx.ASGITransport):
        """Keeps the bytes of each reply (the openai package reads the stream itself)."""

        async def handle_async_request(self, request):
            r = await super().handle_async_request(request)
            body = b"".join([part async for part in r.stream])
            raw.append(body)
            return httpx.Response(r.status_code, headers=r.headers, content=body)

    async def hold_until_queued(name: str) -> asyncio.Task:
        """Hold the chain's one slot until a job has waited 0.3 s in the queue (6 keepalive periods; the stream
        began waiting before its job was queued, so its keepalive timer always comes first)."""
        held = await orch.dispatch.acquire(DispatchJob(job_id=f"hold-{name}"))

        async def release():
            for _ in range(3000):  # ~60 s, however loaded the machine
                if orch.dispatch.queue_length:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            orch.dispatch.release(held)
        return asyncio.create_task(release())

    async def main():
        orch.dispatch.set_chains([_chain()])
        out = {}
        async with _client(app) as c:
            for name, extra in (("chat", None), ("scored", {"echo": True, "logprobs": 1})):
                releasing = await hold_until_queued(name)
                if extra is None:
                    r = await c.post("/v1/chat/completions", json={
                        "model": orch.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "stream": True, "ignore_eos": True})
                else:
                    r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": "hi there",
                                                              "max_tokens": 3, "stream": True, "ignore_eos": True,
                                                              **extra})
                assert r.status_code == 200, r.text
                await releasing
                out[name] = r.text
            client = openai.AsyncOpenAI(api_key=KEYS["bob"], base_url="http://x/v1", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=Recording(app=app)))
            releasing = await hold_until_queued("openai")
            stream = await client.chat.completions.create(
                model=orch.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
                extra_body={"ignore_eos": True})
            chunks = [ch async for ch in stream]
            await releasing
            await client.close()
        return out, chunks, raw[0].decode()

    out, chunks, raw = asyncio.run(main())
    for name, text in out.items():
        events = text.split("\n\n")
        assert ": keepalive" in events, (name, text[:300])
        assert events[-2] == "data: [DONE]", name
    opening = out["scored"].split("\n\n")
    assert opening[0] == ": keepalive"  # the opening event waited for the prompt's scoring
    assert ": keepalive" in raw.split("\n\n")
    assert [c.choices[0].delta.role for c in chunks][0] == "assistant"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    data = [e for e in raw.split("\n\n") if e.startswith("data: {")]
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len(chunks) == len(data)  # comments: none


def test_every_generation_request_is_counted_once_however_early_it_was_refused(api):
    """Requests refused before their generation began were missing from ``petals_chain_api_requests``: a bad field
    (400), an unknown model (404), a prompt too long (413: the app's and the limits' body check), over the key's
    tokens per minute (429), a session turn while another runs (409). Now: ``invalid`` for the client's 4xx,
    ``refused`` for 429; a request counted where it ran (completed, a dispatcher's refusal) is not counted again,
    and one without a valid key (401) only in ``petals_chain_rejected_requests``."""
    from petals_chain.orchestrator.dispatch import DispatchJob

    orch, app = api

    async def main():
        orch.dispatch.set_chains([_chain()])
        body = {"model": orch.model_id, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
        async with _client(app) as bob, _client(app, "alice") as alice:
            assert (await bob.post("/v1/completions", json=body)).status_code == 200
            assert (await bob.post("/v1/completions", json={**body, "n": 99})).status_code == 400
            assert (await bob.post("/v1/completions", json={**body, "temperature": "hot"})).status_code == 400
            assert (await bob.post("/v1/completions", json={**body, "model": "nope"})).status_code == 404
            assert (await bob.post("/v1/completions", json={**body, "prompt": "a" * 1_000_001})).status_code == 413
            assert (await bob.post("/v1/completions", content=b"x" * 2_000_001,
                                   headers={"content-type": "application/json"})).status_code == 413
            assert (await alice.post("/v1/completions", json={**body, "max_tokens": 60})).status_code == 429
            assert (await bob.post("/v1/completions", json=body,
                                   headers={"Authorization": "Bearer wrong-key-0123456789"})).status_code == 401
            held = await orch.dispatch.acquire(DispatchJob(job_id="hold"))
            r = await bob.post("/v1/completions", json={**body, "ttft_deadline_ms": 1})  # the dispatcher's refusal
            assert r.status_code == 429, r.text
            orch.dispatch.release(held)
            sid = (await bob.post("/api/v1/sessions", json={})).json()["session_id"]
            r = await bob.post(f"/api/v1/sessions/{sid}/generate", json={"input_ids": [1, 2], "n": 2})
            assert r.status_code == 400, r.text
            assert (await bob.get("/v1/models")).status_code == 200  # not a generation: not counted
            return (await bob.get("/metrics")).text

    text = asyncio.run(main())
    assert _samples(text, "petals_chain_api_requests_total") == {
        ("bob", "completed"): 1, ("bob", "invalid"): 6, ("bob", "refused"): 1, ("alice", "refused"): 1}


def forwarder(monkeypatch, handler):
    """``forward()``: ``maybe_forward`` of a completion request by an orchestrator whose group's other orchestrator
    (``http://other:8000``, live, 3 servers) answers with ``handler`` (an httpx mock handler)."""
    from types import SimpleNamespace as NS

    from starlette.requests import Request

    import petals_chain.orchestrator.forward as fw

    real_client = httpx.AsyncClient

    class Client(real_client):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    orch = NS(cfg=NS(queue_timeout_s=0.5), dispatch=NS(chains=[], max_queue=None, queue_length=0),
              groups=NS(me="me", forwarded=0, session_owners=fw.SessionOwners(), json=lambda: {"orchestrators": [
                  {"peer_id": "other", "http_url": "http://other:8000", "live": True, "servers": 3,
                   "arrival_rate": 0.0}]}))

    async def receive():
        return {"type": "http.request", "body": b'{"prompt":"x"}', "more_body": False}

    async def forward():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "asgi": {"version": "3.0"}}
        return await fw.maybe_forward(orch, Request(scope, receive))

    monkeypatch.setattr(fw.httpx, "AsyncClient", Client)
    return forward


def test_a_forwarded_request_carries_its_request_id(monkeypatch):
    """The request another orchestrator's group serves (HERD) is sent there with the same ``x-request-id``, so its
    log lines there name the id the client got."""
    from petals_chain.orchestrator.request_id import REQUEST, RequestTrace

    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers.get("x-request-id"))
        return httpx.Response(200, json={"choices": [{"text": "done"}]}, headers={"x-request-id": "theirs"})

    forward = forwarder(monkeypatch, handler)

    async def main():
        token = REQUEST.set(RequestTrace("req_" + "ab" * 16))
        try:
            r = await forward()
        finally:
            REQUEST.reset(token)
        assert r is not None and r.status_code == 200

    asyncio.run(main())
    assert seen == ["req_" + "ab" * 16]


async def _asgi(app, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """One request straight through ``app`` (no HTTP client: it would refuse some of these headers):
    (status, response headers)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"x"), *headers], "client": ("127.0.0.1", 1),
             "server": ("x", 80)}
    start: dict = {}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)

    await app(scope, receive, send)
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_a_client_cannot_forge_log_lines_nor_fill_the_log_without_a_key(api, monkeypatch, caplog):
    """The error line of an API request (and a bug's) showed its decoded path: ``/v1/x%0A<a forged line>%1B[2J``
    wrote a second, forged log line and an ANSI escape to the operator's log, with or without a valid key; and every
    request without a valid key (401) wrote a line, so anyone could fill the log at will. Now the path is shown
    percent-encoded (as uvicorn's access log writes it) and a 401 writes none (``petals_chain_rejected_requests``
    counts it)."""
    orch, app = api
    forged = "2026-11-30 05:00:00,000 CRITICAL petals_chain.orchestrator.core: forged"

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    async def main():
        async with _client(app) as c:
            with caplog.at_level(logging.INFO, logger="petals_chain"):
                lost = await c.get(f"/v1/x%0A{forged}%1B[2J")
                refused = [(await c.post("/v1/completions", json={}, headers={
                    "Authorization": "Bearer wrong-key-0123456789"})).status_code for _ in range(20)]
                monkeypatch.setattr(orch, "get_session", boom)
                bug = await c.post(f"/api/v1/sessions/s%0A{forged}%1B[2J/generate", json={"input_ids": [1]})
        return lost, refused, bug

    lost, refused, bug = asyncio.run(main())
    assert lost.status_code == 404 and refused == [401] * 20 and bug.status_code == 500
    lines = [r.getMessage() for r in caplog.records if r.name == "petals_chain.orchestrator.api"]
    assert len(lines) == 2, lines  # the 404's and the bug's; none for the 401s
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, repr(line)
    assert lines[0].startswith("GET /v1/x%0A2026-11-30%2005%3A00%3A00") and "%1B%5B2J: 404 not_found" in lines[0]
    assert lines[1].startswith("POST /api/v1/sessions/s%0A2026-11-30") and "internal error (RuntimeError)" in lines[1]


def test_a_request_id_is_kept_only_when_all_of_it_is_safe(api):
    """``X-Request-Id: trace-1\\n`` was kept (the pattern's ``$`` matches before a trailing newline), to be sent in
    the response's header and written into log lines; an error code of any text (a forwarded reply's) was logged as
    it came. Now such an id is replaced by a new one, and only a plain code is logged."""
    from petals_chain.orchestrator.request_id import _error_code, request_id_of

    orch, app = api
    status, headers = asyncio.run(_asgi(app, "GET", "/v1/models", [
        (b"authorization", f"Bearer {KEYS['bob']}".encode()), (b"x-request-id", b"trace-1\n")]))
    assert status == 200 and GENERATED.match(headers["x-request-id"]), headers
    assert request_id_of([(b"x-request-id", b"trace-1")]) == "trace-1"
    assert _error_code(b'{"error": {"code": "session_busy"}}') == "session_busy"
    assert _error_code(b'{"error": {"code": "busy\\n2026 CRITICAL forged"}}') is None


def test_a_rebuilt_log_record_is_not_broken_by_the_request_ids():
    """``logging.makeLogRecord`` (a record rebuilt from a dict: socket and queue log receivers) calls the record
    factory with no logger name; during a request the factory raised AttributeError on it."""
    from petals_chain.orchestrator.request_id import REQUEST, RequestTrace, install_log_ids

    install_log_ids()  # as create_app does (once per process)
    token = REQUEST.set(RequestTrace("req_" + "cd" * 16))
    try:
        rebuilt = logging.makeLogRecord({"name": "petals_chain.orchestrator.api", "msg": "from %s", "args": ("a",)})
        tagged = logging.getLogger("petals_chain.orchestrator.api").makeRecord(
            "petals_chain.orchestrator.api", logging.INFO, __file__, 1, "seen %d", (1,), None)
        other = logging.getLogger("hivemind.p2p").makeRecord("hivemind.p2p", logging.INFO, __file__, 1, "x", (), None)
    finally:
        REQUEST.reset(token)
    assert rebuilt.getMessage() == "from a"
    assert tagged.getMessage() == "seen 1 [request req_" + "cd" * 16 + "]"
    assert other.getMessage() == "x"
