"""Review of b4e3d8f (limits.py): a refused generation request (client_inflight_limit, tokens_per_minute, queue_full)
waits for the app's checks before its 429 so that a 400 comes first (``_Refusal``); it is not counted in flight
meanwhile. Those checks tokenize, template and compile grammars: a client past its cap must not have any number of
requests doing that at once. At most its in-flight cap of them wait; past that the 429 is answered once the body
passes the route's model, and the count is released on every path (a 500 before the reservation too)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from petals_chain.orchestrator import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.api import create_app

from conftest import measure_slowdown

KEY = "k-limits-0123456789"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


def test_a_client_past_its_cap_has_at_most_its_cap_of_refused_requests_checked_at_once(model_path, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"k {KEY}\n")
    keys.chmod(0o600)
    gate = threading.Event()
    entered: list[int] = []
    deadline_s = 30 * measure_slowdown()

    async def main():
        cfg = OrchestratorConfig(model=str(model_path), max_length=64, port=0, queue_timeout_s=60)
        cfg.api_keys = str(keys)
        orch = Orchestrator(cfg)
        orch.load_model()
        await orch.start()
        real = orch.encode_chat
        fail = []

        def held_encode_chat(messages):  # the chat template, off the event loop: held until the test lets it go
            entered.append(1)
            gate.wait(deadline_s)
            if fail:
                raise RuntimeError("the template failed")
            return real(messages)

        orch.encode_chat = held_encode_chat
        try:
            app = create_app(orch)
            limits = app.state.limits
            limits.limits.client_max_inflight = 2
            limits.by_client["k"] = 2  # two requests of k run: every new one is refused (client_inflight_limit)
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://orch", timeout=deadline_s,
                                         headers={"authorization": f"Bearer {KEY}"}) as c:
                body = {"model": orch.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
                tasks = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for _ in range(5)]
                try:
                    end = time.monotonic() + deadline_s
                    while len(entered) + sum(t.done() for t in tasks) < 5 and time.monotonic() < end:
                        await asyncio.sleep(0.02)
                    # two wait for the app's checks (the cap); the other three are answered at once
                    assert len(entered) == 2, f"{len(entered)} refused requests in the app's checks at once"
                    assert sum(t.done() for t in tasks) == 3 and limits.checking == {"k": 2}
                finally:
                    gate.set()
                    replies = await asyncio.gather(*tasks)
                assert [r.status_code for r in replies] == [429] * 5, [r.text for r in replies]
                assert {r.json()["error"]["code"] for r in replies} == {"client_inflight_limit"}
                assert all(int(r.headers["retry-after"]) >= 1 for r in replies)
                assert limits.rejected == {"client_inflight_limit": 5} and limits.checking == {}
                fail.append(1)  # an exception in the app before the reservation releases its place too
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 500 and limits.checking == {}
                assert limits.by_client == {"k": 2} and limits.inflight == 0  # refused ones never counted in flight
        finally:
            gate.set()
            await orch.stop()

    asyncio.run(main())


def test_a_refused_request_an_app_serves_without_reserving_gets_its_429():
    """A deferred refusal is answered at the endpoint's token reservation; an app path that answers 200 without one
    (a stub app, an endpoint that skips ``reserve_tokens``) served a request past its client's cap."""
    from types import SimpleNamespace

    from petals_chain.orchestrator.limits import AdmissionLimits, LimitsConfig

    served = []

    async def app(scope, receive, send):  # a generation endpoint that never calls Admission.reserve
        served.append(1)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def post(lim):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(m):
            sent.append(m)

        await lim(scope, receive, send)
        return sent

    orch = SimpleNamespace(dispatch=SimpleNamespace(queue_length=0, chains=[]), sessions={}, groups=None,
                           stats=SimpleNamespace(registry=None, tokens_last_minute=lambda c: 0))
    lim = AdmissionLimits(app, orch, LimitsConfig(client_max_inflight=1))
    lim._metric = None
    lim.by_client["anonymous"] = 1  # at its cap
    sent = asyncio.run(post(lim))
    assert served == [1] and sent[0]["status"] == 429, sent
    assert b'"client_inflight_limit"' in sent[1]["body"] and len(sent) == 2
    assert lim.rejected == {"client_inflight_limit": 1} and lim.checking == {} and lim.by_client == {"anonymous": 1}
    lim.by_client.clear()  # within its limits: the app's 200 as it is
    sent = asyncio.run(post(lim))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"{}" and lim.rejected == {"client_inflight_limit": 1}
