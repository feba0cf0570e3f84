"""The standalone dashboard's API while it has not read the swarm yet and while its DHT reads fail (a 503 with
Retry-After at start, old data marked stale), and the page's handling of hostile or odd names (one browser load)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from petals_chain.dashboard.app import create_app
from petals_chain.dashboard.source import DhtSwarmSource


def _poll(source: DhtSwarmSource) -> None:
    """One poll as the source's thread makes it (a failed read is kept as the last error)."""
    try:
        source.refresh()
    except TimeoutError as e:
        source._last_error = repr(e)


class _FlakyDht:
    """Server records of one server, or an error on every read while ``fail`` is set."""

    def __init__(self):
        self.fail = True

    def fetch_servers(self, prefix: str) -> dict:
        if self.fail:
            raise TimeoutError("DHT get timed out")
        return {"QmA": {"peer_id": "QmA", "public_name": "alpha", "state": "online", "start_block": 0,
                        "num_blocks": 4, "timestamp": 1.0}}

    def fetch_summary(self, prefix: str, trusted) -> dict | None:
        return {"model": "tiny", "num_blocks": 4, "ready": True, "servers": [], "chains": []}


def test_api_answers_503_until_the_swarm_is_read_then_marks_old_data_stale():
    """Before its first DHT read the dashboard served an empty "swarm" (no servers, not ready) as if read; while
    its reads fail it served the last view as current, ``ready`` and all."""
    sd = _FlakyDht()
    source = DhtSwarmSource(sd, "tiny", trusted=["QmOrch"], interval_s=1.0)
    client = TestClient(create_app(source.view, source.health, model_view=source.view))
    _poll(source)  # fails: nothing read yet
    reply = client.get("/api/v1/swarm")
    assert reply.status_code == 503, reply.json()
    assert reply.headers["retry-after"] == "2" and reply.headers["cache-control"] == "no-store"
    error = reply.json()["error"]
    assert error["code"] == "swarm_not_read_yet" and "DHT get timed out" in error["message"]
    assert client.get("/api/v1/swarm", params={"model": "tiny"}).status_code == 503
    assert client.get("/").status_code == 200  # the page loads and polls until the swarm is read
    assert client.get("/healthz").status_code == 503

    sd.fail = False
    _poll(source)
    fresh = client.get("/api/v1/swarm")
    assert fresh.status_code == 200 and fresh.json()["ready"] is True and "stale_s" not in fresh.json()
    assert client.get("/healthz").status_code == 200

    sd.fail = True
    _poll(source)
    assert "stale_s" not in client.get("/api/v1/swarm").json()  # one failed read within the health window
    source._last_ok -= 60  # its reads have failed for a minute (instead of waiting one)
    stale = client.get("/api/v1/swarm")
    assert stale.status_code == 200 and stale.headers["cache-control"] == "no-store"
    body = stale.json()
    assert body["stale_s"] >= 59 and "DHT get timed out" in body["stale_error"]
    assert [s["peer_id"] for s in body["servers"]] == ["QmA"]  # the last data is still shown, marked
    assert "stale_s" not in source._view, "the stored view itself is not changed"
    assert client.get("/healthz").status_code == 503


# ---------- the page in a browser ----------

RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: reverses what follows it in its paragraph
LONG_MODEL = "m" * 128  # the longest model name the dashboard lists (source.listed_models)


def _crafted() -> dict:
    from dashboard_helpers import sample_swarm

    data = sample_swarm()
    data["model"] = RLO + "evil-model"
    data["dht_prefix"] = "prefix-abc"
    data["models"] = [{"name": "tiny", "dht_prefix": "prefix-abc", "servers": 5, "chains": 3, "queue_length": 4},
                      {"name": RLO + "rtl", "dht_prefix": "b", "servers": 7, "chains": 1, "queue_length": 0},
                      {"name": LONG_MODEL, "dht_prefix": "c", "servers": 2, "chains": 0, "queue_length": 0}]
    data["model_name"] = "tiny"
    data["servers"][0]["device"] = "d" * 64  # the longest a record may say (records._SHORT_MAX)
    data["servers"][0]["dtype"] = "t" * 64
    data["servers"][1]["public_name"] = RLO + "reversed"
    data["stale_s"] = 75.4
    data["stale_error"] = "TimeoutError('DHT get timed out')"
    return data


# The left edges of the first and last characters of ``needle`` in the text under ``sel``: left to right if the
# text reads in order.
_CHAR_XS = """([sel, needle]) => {
  const w = document.createTreeWalker(document.querySelector(sel), NodeFilter.SHOW_TEXT);
  for (let n = w.nextNode(); n; n = w.nextNode()) {
    const i = n.data.indexOf(needle);
    if (i < 0) continue;
    const r = document.createRange();
    return [i, i + needle.length - 1].map(k => {
      r.setStart(n, k); r.setEnd(n, k + 1); return r.getBoundingClientRect().left;
    });
  }
  return null;
}"""


@pytest.mark.browser
def test_page_waits_for_the_swarm_then_isolates_hostile_names_and_says_stale():
    """One page at phone width: while the API answers 503 the banner says why; then a crafted view: a model name
    with an RTL override no longer reverses the text after it, a 128-character model name and 64-character device
    and dtype do not make the page or the servers' cards scroll sideways, and a stale view says so."""
    from dashboard_helpers import browser_skip_reason, chromium_page, serve_app

    if browser_skip_reason():
        pytest.skip(browser_skip_reason())
    mode = {"starting": True}
    app = FastAPI()

    @app.get("/api/v1/swarm")
    def swarm():
        if mode["starting"]:
            return JSONResponse({"error": {"message": "the dashboard has not read the swarm from the DHT yet",
                                           "code": "swarm_not_read_yet"}}, status_code=503,
                                headers={"Retry-After": "2"})
        return _crafted()

    from petals_chain.swarm.webpage import mount_dashboard

    mount_dashboard(app)
    with serve_app(app) as url, chromium_page({"width": 375, "height": 800}) as (page, errors):
        page.goto(f"{url}/?refresh=1")
        page.wait_for_selector("#conn-error:not([hidden])", timeout=10_000)
        assert "has not read the swarm from the DHT yet" in page.locator("#conn-error").inner_text()
        mode["starting"] = False
        page.wait_for_selector("#servers-table tbody tr[data-peer-id]", timeout=10_000)
        page.wait_for_selector("#conn-error[hidden]", state="attached", timeout=10_000)

        # an RTL override in a model name stays inside the name
        first, last = page.evaluate(_CHAR_XS, ["#prefix", "DHT prefix prefix-abc"])
        assert first < last, "the DHT prefix after the model name is drawn reversed"
        first, last = page.evaluate(_CHAR_XS, ['#models-nav [data-model="\u202ertl"]', "7 servers"])
        assert first < last, "the counts after a model name in the models' links are drawn reversed"
        # the links are to this page's ?model= only
        hrefs = page.locator("#models-nav a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
        assert hrefs and all(h.startswith("?model=") for h in hrefs)

        # nothing wider than the phone
        assert page.evaluate("document.documentElement.scrollWidth") <= 375
        wrap = page.locator(".table-wrap:has(#servers-table)")
        assert wrap.evaluate("w => w.scrollWidth - w.clientWidth") <= 1, "the servers' cards scroll sideways"

        # old data says it is old
        assert page.locator("#stale-warning").is_visible()
        assert "75 s" in page.locator("#stale-warning").inner_text()
        assert "DHT get timed out" in page.locator("#stale-warning").inner_text()
        assert page.locator("#ready-badge").inner_text() == "stale"
        # 503s while starting are the browser's reports of the failed requests, no script errors
        assert all("status of 503" in e for e in errors), errors
