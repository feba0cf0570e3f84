"""The limits layer (limits.py) answers a request that would be a 400 with that 400 whatever its client's limits say
(in-flight, tokens per minute, a full queue): an invalid body, a prompt longer than the context. A refusal that
can pass later (429) is only for a request that could be served. And a request's body is read and parsed once: the
model router's read (models.py) is the one every layer and the endpoint use."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app

from conftest import measure_slowdown


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


KEY = "k-limits-0123456789"


def run_api(model_path, tmp_path, fn, router=False):
    """``fn(orch, client, limits)`` against an in-process orchestrator without servers (max_length 64; key ``k``
    with 1,000 tokens per minute), optionally behind a one-model :class:`ModelRouter`."""
    keys = tmp_path / "keys"
    keys.write_text(f"k {KEY} tokens_per_minute=1000\n")
    keys.chmod(0o600)

    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, queue_timeout_s=60)
        cfg.api_keys = str(keys)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        try:
            app = create_app(orch)
            front = app
            if router:
                from petals_chain.orchestrator.models import ModelRouter

                front = ModelRouter({"m": app}, {"m": orch})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://orch",
                                         headers={"authorization": f"Bearer {KEY}"},
                                         timeout=30 * measure_slowdown()) as c:
                return await fn(orch, c, app.state.limits)
        finally:
            await orch.stop()

    return asyncio.run(main())


def at_limit(limits, which: str) -> None:
    """Put client ``k`` at one of its limits: every generation request of it is refused early (429)."""
    if which == "client_inflight_limit":
        limits.limits.client_max_inflight = 0
    elif which == "tokens_per_minute":
        limits.reserved["k"] = 1000  # its whole budget held by requests under way
    else:
        limits.limits.max_queue = 0


LONG = "hello " * 200  # far more than the context of 64 tokens


@pytest.mark.parametrize("which", ["client_inflight_limit", "tokens_per_minute", "queue_full"])
def test_a_request_that_is_a_400_gets_it_at_any_limit(model_path, tmp_path, which):
    async def fn(orch, c, limits):
        at_limit(limits, which)
        m = orch.model_id
        chat = {"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": LONG}]}
        # a parameter of the wrong type: the app's 400, not a 429 the client retries for ever
        r = await c.post("/v1/completions", json={"model": m, "prompt": "hi", "temperature": "hot"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert "retry-after" not in r.headers
        # longer than the model's context: 400 context_length_exceeded, each endpoint naming its field
        for path, payload, field in (("/v1/completions", {"model": m, "prompt": LONG}, "prompt"),
                                     ("/v1/chat/completions", chat, "messages"),
                                     ("/v1/chat/completions", {**chat, "stream": True}, "messages"),
                                     ("/v1/responses", {"model": m, "input": LONG}, "input")):
            r = await c.post(path, json=payload)
            assert r.status_code == 400, (path, r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == field, (path, err)
        # a request that could be served: the limit's own 429, with its code, wording and Retry-After, as before
        for payload in ({"model": m, "prompt": "hi", "max_tokens": 2},
                        {"model": m, "prompt": "hi", "max_tokens": 2, "stream": True}):
            r = await c.post("/v1/completions", json=payload)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == which and err["type"] == "rate_limit_error", err
            assert int(r.headers["retry-after"]) >= 1 and r.headers["content-type"] == "application/json"
        lim = (await c.get("/api/v1/limits")).json()
        assert lim["rejected"] == {which: 2} and lim["inflight"] == 0  # 400s are no limit's refusals
        assert orch.dispatch.queue_length == 0 and limits.by_client == {}
        assert limits.reserved == ({"k": 1000} if which == "tokens_per_minute" else {})

    run_api(model_path, tmp_path, fn)


def test_a_json_body_without_content_type_at_a_full_queue_is_the_apps_400(model_path, tmp_path):
    """FastAPI reads a body without Content-Type as bytes (400 "must be a JSON object sent with Content-Type:
    application/json"); the queue-full check's own rule took it for JSON and answered 429."""
    async def fn(orch, c, limits):
        at_limit(limits, "queue_full")
        data = json.dumps({"model": orch.model_id, "prompt": "hi", "max_tokens": 2}).encode()
        r = await c.post("/v1/completions", content=data)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text

    run_api(model_path, tmp_path, fn)


def test_the_routers_read_body_is_parsed_once_and_bounded(model_path, tmp_path, monkeypatch):
    """Behind the model router a body is read and parsed once (the router's parse is the endpoint's: a 1 MiB body was
    parsed twice on every request), and the model's own --max-body-bytes still holds for it (chunked too)."""
    parsed: list[int] = []
    loads = json.loads

    def counting(s, *a, **kw):
        if isinstance(s, (bytes, str)) and len(s) > 100_000:
            parsed.append(len(s))
        return loads(s, *a, **kw)

    async def fn(orch, c, limits):
        at_limit(limits, "queue_full")  # the limits layer checks the body too: with the same parse
        # 300 kB (of spaces between the fields: a valid request)
        data = json.dumps({"model": orch.model_id, "prompt": "hi", "max_tokens": 2}).replace(",", "," + " " * 100_000)
        monkeypatch.setattr(json, "loads", counting)
        try:
            r = await c.post("/v1/completions", content=data, headers={"content-type": "application/json"})
        finally:
            monkeypatch.setattr(json, "loads", loads)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert len(parsed) == 1, parsed
        limits.limits.max_body_bytes = 200_000

        async def chunked():
            for i in range(0, len(data), 50_000):
                yield data[i:i + 50_000].encode()

        r = await c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        assert "200000 bytes" in r.json()["error"]["message"]

    run_api(model_path, tmp_path, fn, router=True)


def test_a_session_turn_at_its_limit_is_checked_here_and_refused_at_once(model_path, tmp_path):
    """A session's turn may wait for the turn under way before the app's own checks end: its body is checked by the
    limits layer (FastAPI's rules, the endpoint's parse): a 400 for a body the app refuses, else the 429 at once."""
    async def fn(orch, c, limits):
        sid = (await c.post("/api/v1/sessions", json={})).json()["session_id"]
        at_limit(limits, "client_inflight_limit")
        url = f"/api/v1/sessions/{sid}/generate"
        r = await c.post(url, json={"prompt": "hi", "max_tokens": "many"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = await c.post(url, content=json.dumps({"prompt": "hi"}).encode())  # no Content-Type: bytes to FastAPI
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        r = await c.post(url, content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        r = await c.post(url, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "client_inflight_limit", r.text
        assert (await c.get("/api/v1/limits")).json()["rejected"] == {"client_inflight_limit": 1}

    run_api(model_path, tmp_path, fn)
