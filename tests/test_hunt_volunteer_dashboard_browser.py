"""The standalone dashboard's coverage chart in headless Chromium, without an orchestrator's summary: one server record
claiming blocks [0, 4096) drew 4096 columns ("4066 uncovered") beside a 30-block swarm."""

from __future__ import annotations

import pytest

from dashboard_helpers import browser_skip_reason, chromium_page, sample_swarm, serve_app

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))]


def test_a_lone_record_claiming_a_huge_span_does_not_size_the_chart():
    from petals_chain.dashboard import create_app
    from petals_chain.dashboard.source import merge_view

    servers = sample_swarm()["servers"]
    records = {s["peer_id"]: dict(s, timestamp=s["last_seen"]) for s in servers}
    honest = max(s["start_block"] + s["num_blocks"] for s in servers)
    liar = dict(servers[0], peer_id="QmLiar", public_name="liar", start_block=0, num_blocks=4096)
    records["QmLiar"] = dict(liar, timestamp=liar["last_seen"])
    app = create_app(lambda: merge_view("tiny-llama-24", records, None))
    with serve_app(app) as url, chromium_page() as (page, errors):
        page.goto(f"{url}/?refresh=1")
        page.wait_for_selector("#coverage svg rect[data-block]", timeout=10_000)
        assert page.locator("#coverage rect[data-block]").count() == honest
        assert page.locator("#coverage-summary").inner_text().startswith(f"{honest} blocks")
        assert page.locator('#coverage rect.cov-cell[data-peer-id="QmLiar"]').count() == 1  # still shown, clipped
        assert errors == []
