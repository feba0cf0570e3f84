"""The standalone dashboard of a swarm serving several models (``--model alpha=PATH --model beta=PATH``) — real
processes on loopback: the orchestrator, one server per model, two ``python -m petals_chain.dashboard`` (one finding
the swarm in the DHT directory, one given beta's ``--dht-prefix``). Each must serve every model the orchestrator's
signed summary lists, answer ``?model=NAME`` on its JSON and page as the orchestrator does (an unknown name: the
same 404), and show the page's model links."""

from __future__ import annotations

import httpx
import pytest

from dashboard_helpers import DashboardProc, browser_skip_reason, chromium_page, free_port, wait_for
from petals_chain.swarm.local import LocalServer, LocalSwarm, memory_for

pytestmark = pytest.mark.slow


def names(view: dict) -> set[str]:
    return {s["public_name"] for s in view["servers"]}


@pytest.fixture(scope="module")
def dashboards(tiny_model_factory, tmp_path_factory, slowdown):
    """``(swarm, {"found": url, "beta": url}, prefixes)``: the dashboards once each sees both models' summaries."""
    alpha, beta = tiny_model_factory("llama", num_layers=4), tiny_model_factory("qwen2", num_layers=2)
    tmp = tmp_path_factory.mktemp("dash-models")
    servers = [LocalServer("a0", memory_for(alpha, 64, 4, 2), tau_p=0.01),
               LocalServer("b0", memory_for(beta, 64, 2, 2), tau_p=0.01, model=str(beta))]
    sw = LocalSwarm(alpha, servers, max_length=64, log_dir=tmp / "logs", models={"alpha": alpha, "beta": beta})
    dashes: dict[str, DashboardProc] = {}
    urls: dict[str, str] = {}
    try:
        sw.start()
        prefixes = {m["name"]: m["dht_prefix"] for m in sw.swarm()["models"]}
        for which, extra in (("found", []), ("beta", ["--dht-prefix", prefixes["beta"]])):
            port = free_port()
            dashes[which] = DashboardProc(["--initial-peers", *sw.initial_peers, "--port", str(port),
                                           "--poll-interval", "1", "--log-level", "WARNING", *extra],
                                          tmp / f"dashboard-{which}.log")
            urls[which] = f"http://127.0.0.1:{port}"
        for which, url in urls.items():
            def both_summaries(url=url):
                views = {m: httpx.get(f"{url}/api/v1/swarm", params={"model": m}, timeout=10) for m in prefixes}
                return all(r.status_code == 200 and r.json()["orchestrator_summary"]
                           and r.json().get("model_name") == m for m, r in views.items())

            # summaries come every 5 s; the first may predate the list of models (the router is made after start)
            wait_for(both_summaries, 60 * slowdown, f"dashboard {which} to show each model", sw, dashes[which])
        yield sw, urls, prefixes
    finally:
        left = {which: d.stop() for which, d in dashes.items()}
        sw.stop()
        assert sw.leftover_processes() == []
        assert not any(left.values()) and all(d.proc.returncode == 0 for d in dashes.values()), left


def test_every_model_by_name_or_prefix_and_unknown_ones_404_as_on_the_orchestrator(dashboards):
    sw, urls, prefixes = dashboards
    for which, default in (("found", "alpha"), ("beta", "beta")):  # /: the swarm found, or the one given
        url = urls[which]
        view = httpx.get(f"{url}/api/v1/swarm", timeout=10).json()
        assert view["model_name"] == default and view["dht_prefix"] == prefixes[default], view["dht_prefix"]
        for name in ("alpha", "beta"):
            for asked in (name, prefixes[name]):  # the router's aliases: the name and the DHT prefix
                view = httpx.get(f"{url}/api/v1/swarm", params={"model": asked}, timeout=10).json()
                assert (view["model"], view["model_name"], view["dht_prefix"]) == (name, name, prefixes[name])
                assert names(view) == {"a0" if name == "alpha" else "b0"}  # only that model's server
                assert [(m["name"], m["dht_prefix"]) for m in view["models"]] == list(prefixes.items())
        for path in ("/api/v1/swarm", "/"):
            mine = httpx.get(f"{url}{path}", params={"model": "gamma"}, timeout=10)
            theirs = httpx.get(f"{sw.url}{path}", params={"model": "gamma"}, timeout=10)
            assert mine.status_code == theirs.status_code == 404 and mine.json() == theirs.json(), mine.text
            assert mine.json()["error"]["code"] == "model_not_found"
        assert httpx.get(f"{url}/", params={"model": "beta"}, timeout=10).status_code == 200
        health = httpx.get(f"{url}/healthz", timeout=10).json()
        assert health["ok"] is True and health["models"] == ["alpha", "beta"]


@pytest.mark.browser
@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_page_shows_the_model_asked_and_links_the_others(dashboards):
    _, urls, _ = dashboards
    from playwright.sync_api import expect

    with chromium_page() as (page, errors):
        page.goto(f"{urls['found']}/?model=beta&refresh=1")
        page.wait_for_selector("#models-nav .model-link.current", timeout=20_000)
        assert page.locator("#models-nav .model-link.current").get_attribute("data-model") == "beta"
        # a locator's wait, not a string predicate: polling one is an eval, which the page's CSP refuses
        expect(page.locator("#model-name")).to_have_text("beta", timeout=20_000)
        page.wait_for_selector("#servers-table tbody tr[data-peer-id] .server-name:text-is('b0')", timeout=20_000)
        page.locator("#models-nav a.model-link[data-model='alpha']").click()  # the user's way to the other model
        # a locator's wait, not a string predicate: polling one is an eval, which the page's CSP refuses
        expect(page.locator("#model-name")).to_have_text("alpha", timeout=20_000)
        assert page.locator("#models-nav .model-link.current").get_attribute("data-model") == "alpha"
        page.wait_for_selector("#servers-table tbody tr[data-peer-id] .server-name:text-is('a0')", timeout=20_000)
        assert page.locator("#servers-table tbody tr[data-peer-id] .server-name:text-is('b0')").count() == 0
        assert errors == []
