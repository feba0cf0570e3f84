"""With the queue full, a request whose body the API refuses (``max_tokens: -1``, a parameter it does not know, not
JSON) is answered its 400, not the early 429 ``queue_full`` (soak hunt, session 35): clients retry a 429, and a request
that can never succeed came back again and again (14-28 of 50 bad requests per soak round). A valid request still gets
the early 429. In-process orchestrator with no servers: every admitted request waits in the queue."""

from __future__ import annotations

import asyncio

import pytest

from test_overload_limits import body, run_with_api, wait_queue


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


def test_an_invalid_body_gets_its_400_before_a_full_queues_429(model_path):
    async def fn(orch, c):
        waiting = asyncio.create_task(c.post("/v1/completions", json=body(orch)))
        await wait_queue(orch, 1)
        chat = {"model": orch.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        bad = [("/v1/completions", {"json": body(orch, max_tokens=-1)}, "invalid_value"),
               ("/v1/completions", {"json": body(orch, stream=True, max_tokens=-1)}, "invalid_value"),
               ("/v1/completions", {"json": body(orch, frobnicate=1)}, "unsupported_parameter"),
               ("/v1/chat/completions", {"json": {**chat, "messages": "hi"}}, "invalid_value"),
               ("/v1/completions", {"content": b'{"prompt": ', "headers": {"content-type": "application/json"}},
                "invalid_json"),
               ("/v1/completions", {"content": b"prompt=hi"}, "invalid_json")]
        for path, kw, code in bad:
            r = await c.post(path, **kw)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (path, kw, r.status_code, r.text)
        for path, payload in [("/v1/completions", body(orch)), ("/v1/completions", body(orch, stream=True)),
                              ("/v1/chat/completions", chat)]:
            r = await c.post(path, json=payload)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", (path, r.text)
            assert int(r.headers["retry-after"]) >= 1
        lim = (await c.get("/api/v1/limits")).json()
        assert lim["rejected"] == {"queue_full": 3} and lim["inflight"] == 1, lim
        assert orch.dispatch.queue_length == 1 and orch.dispatch.refused == 0
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await wait_queue(orch, 0)

    run_with_api(model_path, fn, max_queue=1)

