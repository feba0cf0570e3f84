"""Several models behind one orchestrator (issue 17, first step): ``--model alpha=PATH --model beta=PATH``, one server
per model, requests routed by ``model`` and each model's output token-exact against transformers; the listing,
unknown names, sessions, ``?model=`` views and the dashboard's model links — real processes on loopback."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import hf_greedy_from
from dashboard_helpers import browser_skip_reason, chromium_page
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def two_models(tiny_model_factory, tmp_path_factory):
    alpha, beta = tiny_model_factory("llama", num_layers=4), tiny_model_factory("qwen2", num_layers=2)
    servers = [LocalServer("a0", memory_for(alpha, 64, 4, 2), tau_p=0.01),
               LocalServer("b0", memory_for(beta, 64, 2, 2), tau_p=0.01, model=str(beta))]
    sw = LocalSwarm(alpha, servers, max_length=64, log_dir=tmp_path_factory.mktemp("logs"),
                    models={"alpha": alpha, "beta": beta})
    sw.start()
    try:
        deadline = time.monotonic() + 180
        for name in ("alpha", "beta"):
            while not view(sw, name).get("chains"):
                assert time.monotonic() < deadline, f"{name} never got a chain:\n{sw.log_tail('orchestrator')}"
                time.sleep(0.2)
        yield sw, {"alpha": alpha, "beta": beta}
    finally:
        sw.stop()


def view(sw, model: str | None = None) -> dict:
    return sw.swarm(model, timeout=30)


def complete(sw, model: str, **body) -> httpx.Response:
    return httpx.post(f"{sw.url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            **body})


def test_each_model_is_served_by_its_own_servers_token_exact(two_models):
    sw, paths = two_models
    assert {m["id"] for m in httpx.get(f"{sw.url}/v1/models", timeout=30).json()["data"]} == {"alpha", "beta"}
    for name, path in paths.items():
        r = complete(sw, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        assert r.json()["petals_chain"][0]["token_ids"] == hf_greedy_from(path, PROMPT, 8)
        servers = {s["public_name"] for s in view(sw, name)["servers"]}
        assert servers == {"a0" if name == "alpha" else "b0"}  # a server serves only the model it was given
    # streamed, by the model's other names too (its DHT prefix)
    with httpx.stream("POST", f"{sw.url}/v1/completions", timeout=120,
                      json={"model": view(sw, "beta")["dht_prefix"], "prompt": PROMPT, "max_tokens": 4,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200 and "data:" in r.read().decode()


def test_unknown_models_sessions_and_views(two_models):
    sw, paths = two_models
    r = complete(sw, "gamma")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'alpha'" in r.json()["error"]["message"] and "'beta'" in r.json()["error"]["message"]
    assert httpx.get(f"{sw.url}/api/v1/swarm", params={"model": "gamma"}, timeout=30).status_code == 404
    # a session on beta: opened, used and closed through the same URLs as with one model
    s = httpx.post(f"{sw.url}/api/v1/sessions", json={"model": "beta", "max_length": 64}, timeout=30)
    assert s.status_code == 200 and s.json()["model"] == "beta", s.text
    sid = s.json()["session_id"]
    g = httpx.post(f"{sw.url}/api/v1/sessions/{sid}/generate", timeout=120,
                   json={"input_ids": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert g.status_code == 200, g.text
    assert g.json()["token_ids"] == hf_greedy_from(paths["beta"], PROMPT, 6)
    assert httpx.get(f"{sw.url}/api/v1/sessions/{sid}", timeout=30).json()["tokens"] >= len(PROMPT) + 5
    assert httpx.delete(f"{sw.url}/api/v1/sessions/{sid}", timeout=30).status_code == 200
    # views: the first model by default, every model listed; health of all; metrics per model
    default = view(sw)
    assert default["model_name"] == "alpha" and [m["name"] for m in default["models"]] == ["alpha", "beta"]
    assert all(m["chains"] >= 1 for m in default["models"])
    health = httpx.get(f"{sw.url}/healthz", timeout=30)
    assert health.status_code == 200 and set(health.json()["models"]) == {"alpha", "beta"}
    assert "petals_chain_" in httpx.get(f"{sw.url}/metrics", params={"model": "beta"}, timeout=30).text
    both = httpx.get(f"{sw.url}/metrics", timeout=30).text  # one scrape: every model's series, labelled
    assert 'petals_chain_chains{model="alpha"}' in both and 'petals_chain_chains{model="beta"}' in both


@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_dashboard_links_the_models(two_models):
    sw, _ = two_models
    from playwright.sync_api import expect

    with chromium_page() as (page, errors):
        page.goto(f"{sw.url}/?model=beta")
        page.wait_for_selector("#models-nav .model-link.current", timeout=20_000)
        assert page.locator("#models-nav .model-link.current").get_attribute("data-model") == "beta"
        assert page.locator("#models-nav a.model-link").get_attribute("data-model") == "alpha"
        # a locator's wait, not a string predicate: polling one is an eval, which the page's CSP refuses
        expect(page.locator("#model-name")).to_have_text("beta", timeout=20_000)
        assert errors == []
