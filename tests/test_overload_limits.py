"""Admission limits (limits.py) on a real in-process orchestrator with no servers: every accepted request
waits in the central queue, so the queue bound, per-client limits and 429/Retry-After are exact."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app

from conftest import measure_slowdown


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def run_with_api(model_path, fn, early_queue_check=True, **limits):
    """Run ``fn(orch, client)`` against an in-process orchestrator; ``early_queue_check=False`` turns the
    middleware's early queue check off, so that only the dispatch manager's bound refuses."""
    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, queue_timeout_s=60)
        for k, v in limits.items():
            setattr(cfg, k, v)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orch",
                                         timeout=30 * measure_slowdown()) as c:
                if not early_queue_check:
                    await c.get("/healthz")  # builds the middleware stack (app.state.limits)
                    app.state.limits.limits.max_queue = 10**6
                return await fn(orch, c)
        finally:
            await orch.stop()

    return asyncio.run(main())


def body(orch, **kw):
    return {"model": orch.model_id, "prompt": "hello", "max_tokens": 2, **kw}


async def wait_queue(orch, n, timeout=10.0):
    for _ in range(int(timeout * measure_slowdown() / 0.02)):
        if orch.dispatch.queue_length == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"queue length {orch.dispatch.queue_length} != {n}")


def test_queue_bound_429_retry_after_and_recovery(model_path):
    async def fn(orch, c):
        # No chain: every accepted request queues. Three fit (max_queue=3), the rest get 429.
        waiting = [asyncio.create_task(c.post("/v1/completions", json=body(orch), headers={"x-api-key": f"k{i}"}))
                   for i in range(3)]
        await wait_queue(orch, 3)
        for path, payload in [("/v1/completions", body(orch)),
                              ("/v1/chat/completions", {"model": orch.model_id, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})]:
            r = await c.post(path, json=payload, headers={"x-api-key": "other"})
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and err["message"]
            assert int(r.headers["retry-after"]) >= 1
        # Cheap endpoints are never limited.
        assert (await c.get("/api/v1/swarm")).status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        lim = (await c.get("/api/v1/limits")).json()
        assert lim["inflight"] == 3 and lim["rejected"]["queue_full"] == 2
        metrics = (await c.get("/metrics")).text
        assert 'petals_chain_rejected_requests_total{reason="queue_full"} 2.0' in metrics
        assert "petals_chain_queue_length_max 3.0" in metrics and "petals_chain_queue_bound 3.0" in metrics
        st = (await c.get("/api/v1/swarm")).json()
        assert st["queue_length"] == st["queue_max"] == st["max_queue"] == 3 and st["requeued"] == 0
        # Queued clients give up: the queue drains and new requests are admitted again.
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await wait_queue(orch, 0)
        lim = (await c.get("/api/v1/limits")).json()
        assert lim["inflight"] == 0 and lim["clients"] == 0
        t = asyncio.create_task(c.post("/v1/completions", json=body(orch)))
        await wait_queue(orch, 1)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    run_with_api(model_path, fn, max_queue=3)


KEYS = """# name key [limits]
alice alice-key-0123456789
bob   bob-key-0123456789abc
carol carol-key-0123456789 max_concurrent=1 max_sessions=1
"""


def test_per_key_inflight_and_session_limits(model_path, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text(KEYS)

    async def fn(orch, c):
        a = {"authorization": "Bearer alice-key-0123456789"}
        b = {"x-api-key": "bob-key-0123456789abc"}
        # no key or an unknown key: 401 before anything else; public endpoints stay open
        for headers in ({}, {"authorization": "Bearer nope-nope-nope-nope"}):
            r = await c.post("/v1/completions", json=body(orch), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/v1/models", headers=headers)).status_code == 401
        for public in ("/healthz", "/api/v1/swarm", "/metrics"):
            assert (await c.get(public)).status_code == 200
        waiting = [asyncio.create_task(c.post("/v1/completions", json=body(orch), headers=a)) for _ in range(2)]
        await wait_queue(orch, 2)
        r = await c.post("/v1/completions", json=body(orch), headers=a)
        assert r.status_code == 429 and r.json()["error"]["code"] == "client_inflight_limit"
        assert "retry-after" in r.headers
        # Another key is unaffected; the same key in X-API-Key form is the same client.
        r2 = asyncio.create_task(c.post("/v1/completions", json=body(orch), headers=b))
        await wait_queue(orch, 3)
        r3 = await c.post("/v1/completions", json=body(orch), headers={"x-api-key": "alice-key-0123456789"})
        assert r3.status_code == 429
        # a key's own limits override the defaults: carol may run one request at a time
        carol = {"authorization": "Bearer carol-key-0123456789"}
        r4 = asyncio.create_task(c.post("/v1/completions", json=body(orch), headers=carol))
        await wait_queue(orch, 4)
        assert (await c.post("/v1/completions", json=body(orch), headers=carol)).status_code == 429
        # this process finishing a cut forwarded stream of hers (already counted) gets past her cap; a forged one not
        from petals_chain.orchestrator import resume
        forged = {**carol, resume.RESUME_HEADER: "a-guess"}
        assert (await c.post("/v1/completions", json=body(orch), headers=forged)).status_code == 429
        resumed = asyncio.create_task(c.post("/v1/completions", json=body(orch),
                                             headers={**carol, **resume.resume_headers()}))
        await wait_queue(orch, 5)
        # Sessions: two per key by default, one for carol; a session answers only to its own key.
        ids = []
        for _ in range(2):
            s = await c.post("/api/v1/sessions", json={}, headers=a)
            assert s.status_code == 200
            ids.append(s.json()["session_id"])
        s = await c.post("/api/v1/sessions", json={}, headers=a)
        assert s.status_code == 429 and s.json()["error"]["code"] == "client_session_limit"
        assert (await c.post("/api/v1/sessions", json={}, headers=b)).status_code == 200
        assert (await c.post("/api/v1/sessions", json={}, headers=carol)).status_code == 200
        assert (await c.post("/api/v1/sessions", json={}, headers=carol)).status_code == 429
        for method, path in (("GET", ""), ("POST", "/generate"), ("DELETE", "")):
            r = await c.request(method, f"/api/v1/sessions/{ids[0]}{path}", headers=b,
                                json={"prompt": "x"} if method == "POST" else None)
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (method, r.text)
        assert (await c.get(f"/api/v1/sessions/{ids[0]}", headers=a)).status_code == 200
        assert (await c.delete(f"/api/v1/sessions/{ids[0]}", headers=a)).status_code == 200
        assert (await c.post("/api/v1/sessions", json={}, headers=a)).status_code == 200  # a slot came back
        # usage per key name (never the key) in the swarm state
        clients = {x["name"]: x for x in (await c.get("/api/v1/swarm")).json()["clients"]}
        assert set(clients) == {"alice", "bob", "carol"}
        assert clients["alice"]["inflight"] == 2 and clients["alice"]["sessions"] == 2
        assert clients["carol"]["limits"]["max_concurrent"] == 1
        assert "alice-key" not in (await c.get("/api/v1/swarm")).text + (await c.get("/metrics")).text
        for t in [*waiting, r2, r4, resumed]:
            t.cancel()
        await asyncio.gather(*waiting, r2, r4, resumed, return_exceptions=True)
        await wait_queue(orch, 0)

    run_with_api(model_path, fn, client_max_inflight=2, client_max_sessions=2, api_keys=str(keyfile))


def test_key_file_errors_name_the_line(tmp_path):
    from petals_chain.orchestrator.auth import KeyFileError, KeyRing

    cases = {"alice short": "shorter than", "alice k-0123456789abcdef bogus=1": "invalid limit",
             "anonymous k-0123456789abcdef": "invalid key name", "a k-0123456789abcdef\na k-0123456789abcdeg": "duplicate",
             "a k-0123456789abcdef\nb k-0123456789abcdef": "listed twice", "# only a comment": "no keys",
             "a k-0123456789abcdef max_sessions=0": "invalid limit"}
    for text, message in cases.items():
        path = tmp_path / "keys"
        path.write_text(text.replace("\\n", "\n"))
        with pytest.raises(KeyFileError, match=message):
            KeyRing.from_file(path)
    ring = KeyRing.from_file(_write(tmp_path / "ok", "alice k-0123456789abcdef tokens_per_minute=100  # comment\n"))
    assert ring.lookup("k-0123456789abcdef").name == "alice" and ring.lookup("k-0123456789abcdeX") is None
    assert ring.get("alice").tokens_per_minute == 100 and ring.get("alice").max_concurrent is None


def _write(path, text):
    path.write_text(text)
    return path


def test_oversized_bodies_are_413_and_lose_nothing(model_path):
    async def fn(orch, c):
        big = "x" * 300_000
        r = await c.post("/v1/completions", json=body(orch, prompt=big))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunked():
            for _ in range(40):
                yield b" " * 10_000

        r = await c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code in (400, 413), r.text
        assert r.status_code < 500
        assert (await c.get("/api/v1/limits")).json()["inflight"] == 0
        assert orch.dispatch.queue_length == 0

    run_with_api(model_path, fn, max_body_bytes=200_000)


def test_dispatcher_bound_refuses_with_429_streamed_or_not(model_path):
    """Without the middleware's early check the dispatch manager's bound alone holds; a refused request is a
    429 queue_full with Retry-After, streamed (its held 200 is never sent) or not."""
    async def fn(orch, c):
        waiting = [asyncio.create_task(c.post("/v1/completions", json=body(orch), headers={"x-api-key": f"k{i}"}))
                   for i in range(2)]
        await wait_queue(orch, 2)
        chat = {"model": orch.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for path, payload in [("/v1/completions", body(orch)), ("/v1/completions", body(orch, stream=True)),
                              ("/v1/chat/completions", {**chat, "stream": True})]:
            r = await c.post(path, json=payload)
            assert r.status_code == 429, (path, payload, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        st = (await c.get("/api/v1/swarm")).json()
        assert st["queue_length"] == st["queue_max"] == 2 and st["queue_refused"] == 3
        lim = (await c.get("/api/v1/limits")).json()
        assert lim["rejected"]["queue_full"] == 3 and lim["inflight"] == 2
        assert "petals_chain_queue_refused 3.0" in (await c.get("/metrics")).text
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await wait_queue(orch, 0)
        assert (await c.get("/api/v1/limits")).json()["inflight"] == 0

    run_with_api(model_path, fn, early_queue_check=False, max_queue=2)
