"""Refusals and metrics of the admission path through the API (a tiny model, chain sessions faked): a request that can
never be admitted is told so without a ``Retry-After``; the requests metric counts what its help says."""

from __future__ import annotations

import asyncio

import httpx
import torch
from test_queue_bound_siblings import _Session

from petals_chain.model import Chain


def _orch(model: str, **cfg):
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=model, max_length=64, port=0, **cfg))
    orch.load_model()
    return orch


def _fake_chains(monkeypatch, orch, gate: asyncio.Event | None = None) -> None:
    """Chain sessions that open at once and steps that return zeros (after ``gate``, if given)."""
    from petals_chain.orchestrator import failover

    hidden = int(orch.config.hidden_size)

    async def forward(self, x, position, budget, tokens):
        if gate is not None:
            await gate.wait()
        return torch.zeros(1, len(tokens) - position, hidden, dtype=orch.head.dtype)

    monkeypatch.setattr(failover, "ChainSession", _Session)
    monkeypatch.setattr(failover.ChainHolder, "_forward", forward)


def test_a_request_that_never_fits_gets_no_retry_after(tiny_model_factory, monkeypatch, tmp_path):
    """n = 4 on a chain of 2 slots with --max-queue 1 can never be admitted (2 slots + 1 place): it was a 429
    queue_full with a Retry-After, inviting the client to send it again to the same refusal. Now, streamed or not,
    it is a 429 ``exceeds_capacity`` without Retry-After, while a refusal that may pass later (a full queue) keeps its
    Retry-After; so does a request of more tokens than its key's budget per minute (code tokens_per_minute)."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.relay import HeadBatcher

    keys = tmp_path / "keys"
    keys.write_text("alice alice-secret-0123456789 tokens_per_minute=20\n")
    orch = _orch(str(tiny_model_factory("llama", num_layers=2)), max_queue=1, api_keys=str(keys))
    gate = asyncio.Event()
    _fake_chains(monkeypatch, orch, gate)

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=2, spans=((0, 2),))])
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         headers={"Authorization": "Bearer alice-secret-0123456789"},
                                         timeout=60) as c:
                body = {"model": orch.model_id, "max_tokens": 2, "ignore_eos": True, "temperature": 0, "prompt": "p"}
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "n": 4, "stream": stream})
                    assert r.status_code == 429 and r.json()["error"]["code"] == "exceeds_capacity", (stream, r.text)
                    assert "ask for fewer" in r.json()["error"]["message"]
                    assert "retry-after" not in r.headers, (stream, r.headers)
                r = await c.post("/v1/completions", json={**body, "max_tokens": 40})
                assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute", r.text
                assert r.json()["error"]["param"] == "max_tokens" and "retry-after" not in r.headers, r.headers
                # a full queue may have room later: told when to come back
                running = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
                while orch.dispatch.running + orch.dispatch.queue_length < 3:
                    await asyncio.sleep(0.01)
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
                assert int(r.headers["retry-after"]) >= 1
                gate.set()
                assert [(await t).status_code for t in running] == [200] * 3
        finally:
            orch.batcher.close()

    asyncio.run(main())


def test_the_requests_metric_says_it_counts_jobs(tiny_model_factory, monkeypatch):
    """One request of n = 3 counts 3 in ``petals_chain_requests_total`` (each completion is a job with its own
    outcome), where its help said "Requests by outcome": a dashboard read 3 requests. The help now says jobs (the
    name stays: dashboards and tests read it)."""
    from petals_chain.orchestrator.api import create_app
    from petals_chain.orchestrator.relay import HeadBatcher

    orch = _orch(str(tiny_model_factory("llama", num_layers=2)))
    _fake_chains(monkeypatch, orch)

    async def main():
        orch.batcher = HeadBatcher(orch.head, window_s=orch.cfg.head_window_s)
        orch.dispatch.set_chains([Chain(servers=("a",), blocks=(2,), service_time=1.0, capacity=3, spans=((0, 2),))])
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://x",
                                         timeout=60) as c:
                r = await c.post("/v1/completions", json={"model": orch.model_id, "prompt": "p", "n": 3,
                                                          "max_tokens": 2, "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
                metrics = (await c.get("/metrics")).text
        finally:
            orch.batcher.close()
        assert 'petals_chain_requests_total{outcome="completed"} 3.0' in metrics
        helps = {line.split()[2]: line for line in metrics.splitlines() if line.startswith("# HELP")}
        for name in ("petals_chain_requests_total", "petals_chain_client_requests_total"):
            assert helps[name].split(None, 3)[3].startswith("Jobs "), helps[name]
        assert "n = 3" in helps["petals_chain_requests_total"]

    asyncio.run(main())
