"""Each peer's build where an operator looks: server records, the orchestrator's ``/api/v1/swarm`` rows (refused ones
too) and its own ``/healthz``, the standalone dashboard's merge, and the page (a build unlike the orchestrator's
marked). Every record said ``petals-chain/0.1`` whatever code wrote it, and no row showed it."""

from __future__ import annotations

import asyncio
import importlib.metadata

import httpx
import pytest

from petals_chain.dashboard.source import merge_view
from petals_chain.swarm import records as rec_mod
from petals_chain.swarm.records import RECORD_VERSION, ServerRecord

OLD = "petals-chain/0.0.9+g0badc0d"


def test_a_record_says_the_package_build_it_was_written_by():
    record = ServerRecord(peer_id="QmX", state="online", memory_bytes=1, tau_p=0.01)
    assert record.version == RECORD_VERSION
    assert RECORD_VERSION.startswith(f"petals-chain/{importlib.metadata.version('petals_chain')}"), RECORD_VERSION


def test_the_orchestrators_server_rows_show_each_build_and_protocol():
    from test_failover_units import planner, record

    newer = rec_mod.PROTOCOL + 1
    records = {"a": record("a", version=OLD), "b": record("b"),
               "c": record("c", version="petals-chain/9.0.0+gfeedbee", protocol=newer, protocol_min=newer)}
    pl = planner(records)
    asyncio.run(pl.refresh())
    rows = {s["peer_id"]: s for s in pl.server_json()}
    assert rows["c"]["state"] == "refused"
    assert {k: (r["version"], r["protocol"], r["protocol_min"]) for k, r in rows.items()} == {
        "a": (OLD, rec_mod.PROTOCOL, rec_mod.OLDEST_PROTOCOL),
        "b": (RECORD_VERSION, rec_mod.PROTOCOL, rec_mod.OLDEST_PROTOCOL),
        "c": ("petals-chain/9.0.0+gfeedbee", newer, newer)}


def test_the_standalone_dashboard_shows_each_build_and_protocol():
    live = ServerRecord(peer_id="QmLive", state="online", memory_bytes=1, tau_p=0.01, version=OLD)
    gone = {"peer_id": "QmGone", "state": "online", "version": "petals-chain/0.0.8", "protocol": 1,
            "protocol_min": 1}
    view = merge_view("p", {"QmLive": live}, {"servers": [gone], "updated_at": 100.0, "version": RECORD_VERSION},
                      now=100.0)
    rows = {s["peer_id"]: s for s in view["servers"]}
    assert (rows["QmLive"]["version"], rows["QmLive"]["protocol"], rows["QmLive"]["protocol_min"]) == (
        OLD, rec_mod.PROTOCOL, rec_mod.OLDEST_PROTOCOL)
    assert rows["QmGone"]["state"] == "offline" and rows["QmGone"]["version"] == "petals-chain/0.0.8"
    assert view["version"] == RECORD_VERSION  # the orchestrator's, passed through


def test_healthz_and_swarm_say_the_orchestrators_build():
    from unittest.mock import MagicMock

    from petals_chain.orchestrator.api import create_app

    # the two routes read only these of the orchestrator (a real one costs a DHT peer and a model: ~10 s here)
    orch = MagicMock(draining=False, ready=True, uptime_s=1.0)
    orch.dispatch.chains, orch.dispatch.queue_length = [], 0
    orch.swarm_json.return_value = {"servers": []}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(orch)), base_url="http://orch") as c:
            return (await c.get("/healthz")).json(), (await c.get("/api/v1/swarm")).json()

    health, swarm = asyncio.run(main())
    assert health["ok"] is True and health["version"] == swarm["version"] == RECORD_VERSION


@pytest.mark.browser
def test_the_page_shows_each_servers_build_and_marks_another_than_the_orchestrators():
    from dashboard_helpers import browser_skip_reason, chromium_page, sample_swarm, serve_app
    from fastapi import FastAPI

    from petals_chain.dashboard import mount_dashboard

    if browser_skip_reason() is not None:
        pytest.skip(str(browser_skip_reason()))
    data = sample_swarm()
    data["version"] = "petals-chain/0.2.0+g1a2b3c4"
    for s in data["servers"]:
        s.update(version=data["version"], protocol=2, protocol_min=1)
    old = data["servers"][1]
    old.update(version=OLD, protocol=1, protocol_min=1)
    app = FastAPI()
    app.get("/api/v1/swarm")(lambda: data)
    mount_dashboard(app)
    with serve_app(app) as url, chromium_page() as (page, errors):
        page.goto(f"{url}/?refresh=0")
        page.wait_for_selector("#servers-table tbody tr[data-peer-id] .version", timeout=60_000)
        versions = page.locator("#servers-table tbody tr[data-peer-id]").evaluate_all(
            "rs => rs.map(r => [r.dataset.peerId, r.querySelector('.version').textContent,"
            " r.querySelector('.version').classList.contains('version-differs'), r.querySelector('.version').title])")
        shown = {pid: (text, differs, title) for pid, text, differs, title in versions}
        assert shown[old["peer_id"]][:2] == ("0.0.9+g0badc0d", True)
        assert "wire protocol 1" in shown[old["peer_id"]][2] and data["version"] in shown[old["peer_id"]][2]
        same = shown[data["servers"][0]["peer_id"]]
        assert same[:2] == ("0.2.0+g1a2b3c4", False) and "wire protocol 1..2" in same[2]
        assert "orchestrator petals-chain/0.2.0+g1a2b3c4" in page.locator("#footer-source").text_content()
        assert not errors, errors
