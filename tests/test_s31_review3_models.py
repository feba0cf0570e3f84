"""Several models share one replay cache (orchestrator/models.py ``share_replay_cache``): what each model shows of it.

Each model's ``/api/v1/swarm`` and ``/metrics`` samples showed the process's figures as its own: a job of alpha's
made beta show a job and its bytes, and a Prometheus sum over the models counted the cache once per model. The
metrics give the shared cache once (under the first model, its help saying so); the API names the models it counts
(``shared_by``).
Real orchestrators (constructed, not started) behind the real router: no swarm."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import torch

from petals_chain.orchestrator.api import create_app
from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.models import ModelRouter


def test_the_shared_replay_cache_is_counted_once_and_said_to_be_shared(tiny_model_factory):
    alpha, beta = tiny_model_factory("llama", num_layers=4), tiny_model_factory("qwen2", num_layers=2)
    cfg = OrchestratorConfig(model=str(alpha), model_id="alpha", port=0, max_length=64, replay_cache_mb=1)
    orchs = [Orchestrator(c) for c in (cfg, dataclasses.replace(cfg, model=str(beta), model_id="beta"))]
    router = ModelRouter({o.model_id: create_app(o) for o in orchs}, {o.model_id: o for o in orchs})
    store = orchs[0].replay_cache.new()  # one job of alpha's keeps 16,000 bytes of hop inputs
    store.append(1, torch.zeros(1, 1000, 4), 0)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            text = (await c.get("/metrics")).text
            lines = [line for line in text.splitlines() if line.startswith("petals_chain_replay_cache_bytes")]
            assert lines == ['petals_chain_replay_cache_bytes{model="alpha"} 16000.0'], lines  # once, not per model
            assert "one cache for the models alpha, beta" in text  # its help says whose
            assert 'petals_chain_chains{model="alpha"}' in text and 'petals_chain_chains{model="beta"}' in text
            for name in ("alpha", "beta"):
                r = await c.get("/api/v1/swarm", params={"model": name})
                cache = r.json()["relay"]["replay_cache"]
                assert cache["bytes"] == 16000 and cache["shared_by"] == ["alpha", "beta"], cache
            alone = (await c.get("/metrics", params={"model": "beta"})).text  # one model's, as with one model
            assert "petals_chain_replay_cache_bytes 16000.0" in alone

    try:
        asyncio.run(main())
    finally:
        store.close()
