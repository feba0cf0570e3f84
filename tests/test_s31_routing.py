"""Several models behind one orchestrator (orchestrator/models.py): one replay budget for all of them, and what the
router answers for a ``model`` that is not a name or is a huge one. Real orchestrators (constructed, not started)
behind the real router and APIs: no swarm."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import torch

from petals_chain.orchestrator.api import create_app
from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig
from petals_chain.orchestrator.errors import MAX_NAME_SHOWN
from petals_chain.orchestrator.models import ModelRouter


@pytest.fixture(scope="module")
def two_models(tiny_model_factory):
    """``(router, [alpha, beta])``: two tiny models' orchestrators with a 1 MiB ``--replay-cache-mb``."""
    alpha, beta = tiny_model_factory("llama", num_layers=4), tiny_model_factory("qwen2", num_layers=2)
    cfg = OrchestratorConfig(model=str(alpha), model_id="alpha", port=0, max_length=64, replay_cache_mb=1)
    orchs = [Orchestrator(c) for c in (cfg, dataclasses.replace(cfg, model=str(beta), model_id="beta"))]
    return ModelRouter({o.model_id: create_app(o) for o in orchs}, {o.model_id: o for o in orchs}), orchs


def test_every_models_jobs_keep_their_hop_inputs_within_one_replay_budget(two_models):
    """``--replay-cache-mb`` is for all jobs together: with two models each had its own cache and the process kept up
    to twice the budget (here 1.5 MiB against 1 MiB)."""
    _, orchs = two_models
    budget = orchs[0].replay_cache.budget
    rows = 3 * 2**14  # [rows, 4] float32: 0.75 MiB, one job per model
    stores = [o.replay_cache.new() for o in orchs]
    try:
        for s in stores:
            s.append(1, torch.zeros(1, rows, 4), 0)
        caches = {id(o.replay_cache): o.replay_cache for o in orchs}.values()
        assert sum(c.bytes for c in caches) <= budget == 2**20
        assert stores[0].length(1) == 0 and stores[1].length(1) == rows  # the older job's inputs made room
    finally:
        for s in stores:
            s.close()
    assert all(o.replay_cache.bytes == 0 for o in orchs)


def test_a_model_that_is_not_a_name_is_a_400_and_an_unknown_huge_one_is_not_echoed_whole(two_models):
    """A number or a list as ``model`` was a 404 "the model 123 does not exist" with several models (one model: a 400
    saying it must be a string); an unknown name of megabytes came back whole in the 404 (JSON-escaped: 6 bytes per
    'é')."""
    router, _ = two_models

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://x") as c:
            for path, body in (("/v1/completions", {"model": 123, "prompt": "hi"}),
                               ("/v1/chat/completions", {"model": ["beta"],
                                                         "messages": [{"role": "user", "content": "hi"}]}),
                               ("/api/v1/sessions", {"model": {"name": "beta"}})):
                r = await c.post(path, json=body)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "model" and "valid string" in err["message"], r.text
            r = await c.post("/v1/completions", json={"model": "é" * 300_000, "prompt": "hi"})
            err = r.json()["error"]
            assert r.status_code == 404 and err["code"] == "model_not_found" and "'alpha', 'beta'" in err["message"]
            assert len(r.content) < 2 * MAX_NAME_SHOWN * 6 and "300000 characters" in err["message"]
            assert (await c.get("/v1/models/" + "x" * 5000)).json()["error"]["message"].count("x") < 2 * MAX_NAME_SHOWN

    asyncio.run(main())


def test_one_models_404_does_not_echo_a_huge_name_whole(two_models):
    """One model's own check (no router in front) cut nothing either."""
    _, orchs = two_models

    async def main():
        app = create_app(orchs[0])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            r = await c.post("/v1/completions", json={"model": "é" * 300_000, "prompt": "hi"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert len(r.content) < 2400 and "(300000 characters)" in r.json()["error"]["message"]

    asyncio.run(main())
