"""Issue 18 through the API (a tiny model, chain sessions faked): a deadline the prediction misses even on an idle
swarm is a 429 without ``Retry-After`` (retried as it is, it is refused again), while a deadline refused because the
swarm is busy keeps its ``Retry-After``."""

from __future__ import annotations

import asyncio

import httpx
from test_s31_queue_api import _fake_chains, _orch

from petals_chain.model import Chain


def test_a_deadline_no_idle_swarm_meets_gets_no_retry_after(tiny_model_factory, monkeypatch):
    """One chain of one slot, T 1 s (the planner's steps per job: a first token in tens of ms at best). A first token
    due in 1 ms can never come: 429 ``deadline_infeasible`` (streamed; see the report for the non-streamed code) and
    no ``Retry-After``, where before it was a 429 ``deadline_unreachable`` with one. Due in 300 ms while the slot is
    busy (the wait for it is ~1 s): a 429 ``deadline_unreachable`` that may pass later, with its Retry-After."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.relay import HeadBatcher

    orch = _orch(str(tiny_model_factory("llama", num_layers=2)), schedule="edf")
    gate = asyncio.Event()
    _fake_chains(monkeypatch, orch, gate)

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=1, spans=((0, 2),))])
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         timeout=60) as c:
                body = {"model": orch.model_id, "max_tokens": 2, "ignore_eos": True, "temperature": 0, "prompt": "p"}
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "stream": stream, "ttft_deadline_ms": 1})
                    assert r.status_code == 429 and "idle swarm" in r.json()["error"]["message"], (stream, r.text)
                    assert "retry-after" not in r.headers, (stream, r.headers)
                    assert r.json()["error"]["code"] == "deadline_infeasible", (stream, r.text)
                running = asyncio.ensure_future(c.post("/v1/completions", json=body))
                while orch.dispatch.running < 1:
                    await asyncio.sleep(0.01)
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "stream": stream, "ttft_deadline_ms": 300})
                    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_unreachable", r.text
                    assert int(r.headers["retry-after"]) >= 1
                gate.set()
                assert (await running).status_code == 200
        finally:
            orch.batcher.close()

    asyncio.run(main())
