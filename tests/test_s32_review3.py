"""Review of session 32's follow-ups (3): the dashboard's count of departed servers it does not list counts only
servers still gone."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

DASHBOARD_JS = Path(__file__).resolve().parents[1] / "petals_chain" / "swarm" / "static" / "dashboard.js"

# The page's own state, trackDepartures and goneNotListed under node; polls 2 s apart.
_PRELUDE = r"""
const src = require("fs").readFileSync(process.argv[1], "utf8");
const grab = (name) => src.match(new RegExp("  function " + name + "\\([^]*?\\n  }\\n"))[0];
const consts = ["GONE_KEEP_MS", "GONE_KEEP_MAX", "GONE_COUNT_MAX"].map(
  (n) => (src.match(new RegExp("var " + n + " = [^;]*;")) || [""])[0]);
function str(v) { return v === null || v === undefined ? "" : String(v); }
eval(consts.join("\n") + src.match(/  var state = \{[^]*?\n  \};\n/)[0] + grab("trackDepartures") +
     grab("goneNotListed"));
const ids = (prefix, n) => Array.from({ length: n }, (_, i) => ({ peer_id: prefix + i }));
const seen = () => ({ listed: state.gone.size, not_listed: goneNotListed() });
let t = 0;
const poll = (servers) => { trackDepartures(servers, t); t += 2000; };
"""

_BACK = _PRELUDE + r"""
const out = {};
poll(ids("s", 60));
poll(ids("s", 1));  // 59 leave for one poll (a partial read of the DHT, a network blip)
out.left = seen();
poll(ids("s", 60));  // every one is back
out.back = seen();
// one server that leaves (before 50 others: not listed) and comes back, again and again: counted once at most, and
// not when back
const flap = { peer_id: "flap" }, others = ids("other", 50), base = ids("s", 60);
for (let k = 0; k < 3; k++) {
  poll([...base, flap, ...others]);
  poll([...base, ...others]);
  poll(base);
  const counted = state.goneDropped instanceof Map && state.goneDropped.has("flap");  // (a Map of ids now)
  out["flap_gone_" + k] = { ...seen(), flap_counted: counted };
  poll([...base, flap, ...others]);
  out["flap_back_" + k] = seen();
}
console.log(JSON.stringify(out));
"""


def _node(script: str) -> dict:
    out = subprocess.run(["node", "-e", script, str(DASHBOARD_JS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_departed_servers_that_came_back_are_not_counted_as_gone_unlisted():
    """The page counted the departures it leaves out of the list (past the 50 latest) per poll, by number only: 59
    servers missing from one poll and back at the next left "(the 50 latest departures listed; 9 more not)" for 10
    minutes with every server online and none listed, and a server that left and came back was counted at every
    departure. The count is of servers still gone now: one that comes back leaves it."""
    res = _node(_BACK)
    assert res["left"] == {"listed": 50, "not_listed": 9}, res
    assert res["back"] == {"listed": 0, "not_listed": 0}, res
    for k in range(3):
        assert res[f"flap_gone_{k}"] == {"listed": 50, "not_listed": 1, "flap_counted": True}, (k, res)
        assert res[f"flap_back_{k}"] == {"listed": 0, "not_listed": 0}, (k, res)


_FORGOTTEN = _PRELUDE + r"""
poll(ids("s", GONE_COUNT_MAX + 60));
poll([]);
const gone = seen();
const floor = t < state.goneForgottenUntil;
for (let k = 0; k < 301; k++) poll([]);  // 10 minutes and 2 s later
console.log(JSON.stringify({ gone: gone, floor: floor, later: seen(), later_floor: t < state.goneForgottenUntil,
                             count_max: GONE_COUNT_MAX }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_ids_of_unlisted_departures_are_bounded_and_expire():
    """Remembering the unlisted departures by id is bounded (the count is then a floor, shown with a "+"), and they
    are forgotten when 10 minutes old, as the listed ones."""
    res = _node(_FORGOTTEN)
    n = res["count_max"]
    assert n >= 1000, res
    assert res["gone"] == {"listed": 50, "not_listed": n} and res["floor"] is True, res
    assert res["later"] == {"listed": 0, "not_listed": 0} and res["later_floor"] is False, res


@pytest.mark.browser
def test_the_summary_counts_only_servers_still_gone(tmp_path):
    """In the page: 59 of 60 servers missing from one poll, then back: the summary says every one is online and
    nothing more (it said "(the 50 latest departures listed; 9 more not)" for 10 minutes)."""
    from dashboard_helpers import browser_skip_reason, chromium_page, sample_swarm, serve_app, MutableView

    if browser_skip_reason() is not None:
        pytest.skip(str(browser_skip_reason()))
    from fastapi import FastAPI

    from petals_chain.dashboard import mount_dashboard

    data = sample_swarm()
    template = data["servers"][0]
    servers = [{**template, "peer_id": f"QmServer{i:04d}", "public_name": f"s{i}"} for i in range(60)]
    data.update(servers=servers, chains=[])
    view = MutableView(data)
    app = FastAPI()

    @app.get("/api/v1/swarm")
    def swarm():
        return view.get()

    mount_dashboard(app)
    summary = "#servers-summary"
    with serve_app(app) as url, chromium_page() as (page, errors):
        page.goto(f"{url}/?refresh=0.5")
        page.wait_for_selector(f'{summary}:has-text("60 known")', timeout=60_000)
        view.update(lambda d: d.update(servers=servers[:1]))
        page.wait_for_selector(f'{summary}:has-text("1 known")', timeout=60_000)
        text = page.locator(summary).inner_text()
        assert text == "1 known \u00b7 1 online \u00b7 59 gone (9 that left earlier not listed)", text
        assert page.locator("#servers-table tr.gone").count() == 50
        view.update(lambda d: d.update(servers=servers))
        page.wait_for_selector(f'{summary}:has-text("60 known")', timeout=60_000)
        text = page.locator(summary).inner_text()
        assert text == "60 known \u00b7 60 online", text
        assert errors == []
