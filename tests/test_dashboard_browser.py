"""The dashboard page in headless Chromium (Playwright) against a mutable contracts-E fixture."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from petals_chain.dashboard import mount_dashboard

from dashboard_helpers import MutableView, browser_skip_reason, chromium_page, sample_swarm, serve_app

pytestmark = [pytest.mark.browser, pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))]

HOSTILE = '<img src=x onerror="window.__pwned=1"><b>evil</b>'
REFRESH_S = 1.0
# How long the page may take to show a change of the API: a refresh (~1 s quiet) plus the page's work, on a machine
# loaded past what the slowdown measured at the start foresaw. A ceiling, not a bound: the waits end as soon as the
# page shows the change; only a page that never does fails.
PAGE_CEILING_MS = 60_000


class FixtureSwarm:
    """An orchestrator-like app: our own /api/v1/swarm plus the dashboard mounted at / (as the orchestrator does)."""

    def __init__(self, data: dict):
        self.view = MutableView(data)
        self.status = 200
        self.app = FastAPI()

        @self.app.get("/api/v1/swarm")
        def swarm():
            if self.status != 200:
                return JSONResponse({"detail": "boom"}, status_code=self.status)
            return self.view.get()

        mount_dashboard(self.app)


@pytest.fixture(scope="module")
def swarm_url():
    fx = FixtureSwarm(sample_swarm(hostile_name=HOSTILE))
    with serve_app(fx.app) as url:
        yield fx, url


def _open(page, url):
    page.goto(f"{url}/?refresh={REFRESH_S:g}")
    page.wait_for_selector("#servers-table tbody tr[data-peer-id]", timeout=PAGE_CEILING_MS)


def test_page_shows_servers_chains_queue_and_tracks_departures(swarm_url):
    fx, url = swarm_url
    data = fx.view.get()
    with chromium_page() as (page, errors):
        _open(page, url)
        rows = page.locator("#servers-table tbody tr[data-peer-id]")
        assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.peerId)")) == sorted(s["peer_id"] for s in data["servers"])
        for s in data["servers"]:
            row = page.locator(f'#servers-table tr[data-peer-id="{s["peer_id"]}"]')
            assert row.locator(".server-name").inner_text() == s["public_name"]
            assert row.get_attribute("data-state") == "online"
            reach = s.get("reachability")
            assert row.locator(".reach").all_inner_texts() == ([reach] if reach else [])
            assert row.locator(".step-times").all_inner_texts() == (["step 48.0 ms + 31.5 ms net"]
                                                                    if s.get("step_compute_s") else [])
        # chains: every chain, its hops in order, capacity and occupancy
        chains = page.locator(".chain[data-chain-id]")
        assert chains.count() == len(data["chains"])
        for ch in data["chains"]:
            card = page.locator(f'.chain[data-chain-id="{ch["id"]}"]')
            hops = card.locator(".hop").evaluate_all("hs => hs.map(h => h.dataset.peerId)")
            assert hops == ch["servers"]
            assert card.locator(".chain-capacity").inner_text() == str(ch["capacity"])
            assert card.locator(".chain-active").inner_text() == f'{ch["active"]} / {ch["capacity"]}'
        assert page.locator("#queue-length").inner_text() == str(data["queue_length"])
        assert page.locator("#ready-badge").get_attribute("data-ready") == "true"
        assert page.locator("#c-star").inner_text() == str(data["c"])
        assert page.locator("#tokens-per-step").inner_text() == "2.50 (60% of drafts kept)"
        assert page.locator("#legs-per-token").inner_text() == "1.60 (relay: push)"
        assert f'expected L\u0302 {data["job_tokens"]["value"]} ({data["job_tokens"]["mode"]})' in \
            page.locator("#job-tokens").inner_text()
        # coverage map: one row per hosting server, one count per block (24 blocks, every one covered)
        assert page.locator("#coverage rect.cov-cell").count() == len(data["servers"])
        counts = page.locator("#coverage rect[data-block]").evaluate_all("rs => rs.map(r => +r.dataset.count)")
        assert len(counts) == 24 and min(counts) >= 1
        # live chart drawn from the history
        assert page.locator("#latency-chart svg path.line-response").count() == 1
        assert page.locator("#latency-chart circle.dot-response").count() == len(data["history"])

        # the page refreshes in place: queue change and a server leaving show at its next refresh
        gone = data["servers"][1]  # bravo, second hop of chain 0
        page.evaluate("window.__sameDocument = true")
        fx.view.update(lambda d: d.update(queue_length=9, servers=[s for s in d["servers"] if s["peer_id"] != gone["peer_id"]]))
        page.wait_for_selector(f'#servers-table tr[data-peer-id="{gone["peer_id"]}"][data-state="gone"]',
                               timeout=PAGE_CEILING_MS)
        assert page.locator("#queue-length").inner_text() == "9"
        assert "broken" in page.locator('.chain[data-chain-id="0"]').get_attribute("class")
        assert page.locator("#coverage rect.cov-cell").count() == len(data["servers"]) - 1
        assert page.evaluate("window.__sameDocument") is True  # no page reload
        # a server coming back is live again
        fx.view.update(lambda d: d["servers"].append(gone))
        page.wait_for_selector(f'#servers-table tr[data-peer-id="{gone["peer_id"]}"][data-state="online"]',
                               timeout=PAGE_CEILING_MS)
        # an offline record (graceful leave) is shown as gone too
        fx.view.update(lambda d: d["servers"][0].update(state="offline"))
        page.wait_for_selector(f'#servers-table tr[data-peer-id="{data["servers"][0]["peer_id"]}"].gone',
                               timeout=PAGE_CEILING_MS)
        assert errors == []
    fx.view.update(lambda d: d.update(sample_swarm(hostile_name=HOSTILE)))


def test_a_server_that_cannot_load_its_blocks_says_why(swarm_url):
    """A server whose record says it cannot load its assigned span (the planner plans around it) is shown failed,
    with why in its row; the reason is text, never markup."""
    fx, url = swarm_url
    peer = fx.view.get()["servers"][2]["peer_id"]
    why = "2 blocks leave 0 cache slots of 64 tokens: --cache-tokens-per-block 16 <b>x</b>"
    fx.view.update(lambda d: next(s for s in d["servers"] if s["peer_id"] == peer).update(
        state="failed", failed_span=[2, 2], load_error=why))
    try:
        with chromium_page() as (page, errors):
            _open(page, url)
            row = page.locator(f'#servers-table tr[data-peer-id="{peer}"]')
            # not serving, as a failed server is shown (greyed), its badge "failed"
            assert row.get_attribute("data-state") == "gone" and row.locator(".badge").inner_text() == "failed"
            line = row.locator(".load-error")
            assert line.inner_text() == "cannot load its blocks"
            assert line.get_attribute("title") == (f"cannot load its assigned blocks 2\u20133: {why}\n"
                                                   "planned around until it loads them or restarts")
            assert page.locator('#servers-table .load-error').count() == 1 and errors == []
            # the orchestrator's load deadline, for a server that said nothing
            fx.view.update(lambda d: next(s for s in d["servers"] if s["peer_id"] == peer).update(
                load_error="not online 612 s after its assignment (--load-deadline-s 600)"))
            page.wait_for_selector(f'#servers-table tr[data-peer-id="{peer}"] .load-error >> text=not online with '
                                   'its blocks', timeout=PAGE_CEILING_MS)
    finally:
        fx.view.update(lambda d: d.update(sample_swarm(hostile_name=HOSTILE)))


def test_hostile_public_name_is_text(swarm_url):
    fx, url = swarm_url
    with chromium_page() as (page, errors):
        _open(page, url)
        page.wait_for_timeout(300)
        evil = [s for s in fx.view.get()["servers"] if s["public_name"] == HOSTILE][0]
        assert page.locator(f'#servers-table tr[data-peer-id="{evil["peer_id"]}"] .server-name').inner_text() == HOSTILE
        assert page.evaluate("document.querySelectorAll('img, b').length") == 0
        assert page.evaluate("window.__pwned") is None
        assert errors == []


def test_clients_table_shows_fair_shares_and_deadline_outcomes(swarm_url):
    fx, url = swarm_url
    fairness = {"policy": "fcfs", "quantum": None, "jain_index": 0.9, "clients": {
        "alice": {"requests": 5, "waiting": 1, "service": 300, "service_rate": 2.0, "wait_mean_s": 0.5,
                  "wait_max_s": 1.0, "backlogged": True},
        "bob": {"requests": 2, "waiting": 0, "service": 50, "service_rate": 0.5, "wait_mean_s": 0.1, "wait_max_s": 0.2,
                "backlogged": False}}}
    deadlines = {"schedule": "edf", "window_s": 60, "met": 3, "missed": 1, "refused": 1, "dropped": 0,
                 "goodput_per_s": 0.05, "clients": {
                     "alice": {"met": 3, "missed": 1, "refused": 0, "dropped": 0, "goodput_per_s": 0.05},
                     "carol": {"met": 0, "missed": 0, "refused": 1, "dropped": 0, "goodput_per_s": 0.0}}}
    fx.view.update(lambda d: d.update(fairness=fairness, deadlines=deadlines))
    try:
        with chromium_page() as (page, errors):
            _open(page, url)
            page.wait_for_selector('#clients-table tr[data-client="carol"]', timeout=PAGE_CEILING_MS)

            def cells(name):
                return page.locator(f'#clients-table tr[data-client="{name}"] td').all_inner_texts()

            assert cells("alice")[-2:] == ["3/4 (75%)", "0.05 /s"]
            assert cells("bob")[-2:] == ["\u2014", "\u2014"]  # no request with a deadline
            assert cells("carol")[-2:] == ["0/1 (0%)", "0.00 /s"]  # refused only: counted, never served
            summary = page.locator("#clients-summary").inner_text()
            assert "schedule edf" in summary and "goodput 0.05 /s" in summary
            assert errors == []
    finally:
        fx.view.update(lambda d: (d.pop("fairness", None), d.pop("deadlines", None)))


def test_orchestrators_panel_shows_the_groups_and_only_when_there_are_some(swarm_url):
    fx, url = swarm_url
    a, b = "QmLeaderAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "QmOtherBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
    groups = {"me": b, "leader": a, "epoch": 3, "forwarded": 2, "split_method": "ilp", "orchestrators": [
        {"peer_id": a, "http_url": "javascript:alert(1)", "arrival_rate": 1.5, "servers": 3, "live": True},
        {"peer_id": b, "http_url": "http://10.0.0.2:8000", "arrival_rate": 0.25, "servers": 1, "live": False}]}
    with chromium_page() as (page, errors):
        _open(page, url)
        page.wait_for_timeout(300)
        assert not page.locator("#orchestrators-panel").is_visible()  # one orchestrator: nothing to show
        fx.view.update(lambda d: d.update(groups=groups))
        try:
            page.wait_for_selector(f'#orchestrators-table tr[data-orchestrator="{a}"]', timeout=PAGE_CEILING_MS)
            leader = page.locator(f'#orchestrators-table tr[data-orchestrator="{a}"] td').all_inner_texts()
            other = page.locator(f'#orchestrators-table tr[data-orchestrator="{b}"] td').all_inner_texts()
            assert leader[1:] == ["leader", "\u2014", "3", "1.50 /s", "live"]  # a script URL is not a link
            assert other[1:] == ["this one", "http://10.0.0.2:8000", "1", "0.25 /s", "silent"]
            assert page.locator("#orchestrators-table a").count() == 1
            summary = page.locator("#orchestrators-summary").inner_text()
            assert "2 orchestrators" in summary and "epoch 3" in summary and "2 requests forwarded" in summary
            assert errors == []
        finally:
            fx.view.update(lambda d: d.pop("groups", None))


def test_phone_width_has_no_horizontal_overflow(swarm_url):
    fx, url = swarm_url
    with chromium_page({"width": 390, "height": 844}) as (page, errors):
        _open(page, url)
        page.wait_for_timeout(300)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        # server rows become labelled cards on a phone
        assert page.locator("#servers-table thead").is_hidden()
        assert errors == []


def test_api_outage_shows_banner_keeps_last_data_and_recovers(swarm_url):
    fx, url = swarm_url
    with chromium_page() as (page, errors):
        _open(page, url)
        n = page.locator("#servers-table tbody tr[data-peer-id]").count()
        fx.status = 503
        try:
            page.wait_for_selector("#conn-error:not([hidden])", timeout=PAGE_CEILING_MS)
            assert "HTTP 503" in page.locator("#conn-error").inner_text()
            assert page.locator("#servers-table tbody tr[data-peer-id]").count() == n
        finally:
            fx.status = 200
        page.wait_for_selector("#conn-error[hidden]", state="attached", timeout=PAGE_CEILING_MS)
        # the only errors are the browser's own reports of the failed requests, no script errors
        assert all("status of 503" in e for e in errors), errors


def test_refresh_period_is_configurable(swarm_url):
    from playwright.sync_api import expect

    fx, url = swarm_url
    with chromium_page() as (page, errors):
        # an hour: a change that shows within the ceiling came from the period chosen next, at any load
        page.goto(f"{url}/?refresh=3600")
        page.wait_for_selector("#servers-table tbody tr[data-peer-id]", timeout=PAGE_CEILING_MS)
        assert page.locator("#refresh-select").input_value() == "3600"
        with page.expect_response(lambda r: "/api/v1/swarm" in r.url, timeout=PAGE_CEILING_MS):
            page.select_option("#refresh-select", "1")  # polls at once, then every second
        fx.view.update(lambda d: d.update(queue_length=17))  # after that poll: only the new period can show it
        expect(page.locator("#queue-length")).to_have_text("17", timeout=PAGE_CEILING_MS)
        fx.view.update(lambda d: d.update(queue_length=4))
        assert errors == []


def test_screenshot_tool_captures_desktop_and_phone(swarm_url, tmp_path):
    from petals_chain.dashboard.screenshot import capture

    fx, url = swarm_url
    desk, phone = tmp_path / "d.png", tmp_path / "p.png"
    assert capture(url, desk, phone, settle_s=0.5) == []
    for path, width in ((desk, 1280), (phone, 390)):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(data[16:20], "big") == width  # IHDR width: the viewport, no horizontal overflow
        assert int.from_bytes(data[20:24], "big") > 900  # full page, taller than one screen


def test_standalone_view_without_orchestrator_summary():
    """What the standalone dashboard serves before any trusted summary: servers only, queue unknown, not ready."""
    from petals_chain.dashboard import create_app
    from petals_chain.dashboard.source import merge_view

    records = {s["peer_id"]: dict(s, timestamp=s["last_seen"]) for s in sample_swarm()["servers"]}
    app = create_app(lambda: merge_view("tiny-llama-24", records, None))
    with serve_app(app) as url, chromium_page() as (page, errors):
        _open(page, url)
        assert page.locator("#servers-table tbody tr[data-peer-id]").count() == len(records)
        assert page.locator("#ready-badge").get_attribute("data-ready") == "false"
        assert page.locator("#queue-length").inner_text() == "\u2014"
        assert page.locator(".chain[data-chain-id]").count() == 0
        assert "no signed summary" in page.locator("#footer-source").inner_text()
        assert errors == []
