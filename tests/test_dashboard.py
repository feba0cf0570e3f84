"""Dashboard without a browser: page assembly, the apps' routes, merging DHT records with the signed summary."""

from __future__ import annotations

import base64
import hashlib
import math
import re
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from petals_chain.dashboard import create_app, mount_dashboard, page_headers, page_html
from petals_chain.dashboard.__main__ import build_parser, main, resolve_prefix
from petals_chain.dashboard.source import DhtSwarmSource, merge_view
from petals_chain.swarm.records import ServerRecord

from conftest import measure_slowdown
from dashboard_helpers import sample_swarm


def _record(peer_id: str, **kw) -> ServerRecord:
    base = dict(peer_id=peer_id, state="online", memory_bytes=2**30, tau_p=0.01, start_block=0, num_blocks=4,
                slots_total=8, slots_free=5, public_name=peer_id.lower(), max_length=256, timestamp=time.time() - 2)
    base.update(kw)
    return ServerRecord(**base)


def test_page_is_self_contained_and_csp_hashes_match():
    html = page_html()
    assert "<!--DASHBOARD" not in html
    assert 'src="http' not in html and "href=\"http" not in html  # no CDN: the swarm may run offline
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    assert len(scripts) == 1 and len(styles) == 1
    assert "api/v1/swarm" in scripts[0] and '"/api/v1/swarm"' not in scripts[0]  # relative URL
    assert "innerHTML" not in scripts[0]  # untrusted names reach the DOM as text only
    csp = page_headers()["Content-Security-Policy"]
    for body, directive in ((scripts[0], "script-src"), (styles[0], "style-src")):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_mount_dashboard_on_an_orchestrator_like_app():
    app = FastAPI()
    view = sample_swarm()

    @app.get("/api/v1/swarm")
    def swarm():
        return view

    mount_dashboard(app)
    client = TestClient(app)
    for path in ("/", "/index.html"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "petals-chain swarm" in r.text and "Content-Security-Policy" in r.headers
    assert client.get("/api/v1/swarm").json()["model"] == view["model"]
    with pytest.raises(ValueError):
        mount_dashboard(FastAPI(), path="dashboard")


def test_create_app_routes_and_non_finite_numbers():
    view = sample_swarm()
    view["predicted_response_s"] = {"lower": 0.5, "upper": math.inf}  # unstable: no finite upper bound
    healthy = {"ok": True}
    app = create_app(lambda: view, lambda: (healthy["ok"], {"why": "test"}))
    client = TestClient(app)
    data = client.get("/api/v1/swarm").json()
    assert data["predicted_response_s"] == {"lower": 0.5, "upper": None}
    assert [s["peer_id"] for s in data["servers"]] == [s["peer_id"] for s in view["servers"]]
    assert client.get("/healthz").json() == {"ok": True, "why": "test"}
    healthy["ok"] = False
    assert client.get("/healthz").status_code == 503
    assert client.get("/").status_code == 200


def test_merge_records_override_summary_liveness():
    now = time.time()
    summary = {
        "model": "tiny", "max_length": 256, "ready": True, "queue_length": 2, "c": 3,
        "servers": [
            {"peer_id": "QmA", "public_name": "a", "state": "online", "tau_c": 0.03, "start_block": 0, "num_blocks": 4},
            {"peer_id": "QmGone", "public_name": "gone", "state": "online", "tau_c": 0.05, "start_block": 4,
             "num_blocks": 4, "last_seen": now - 30},
        ],
        "chains": [{"id": 0, "servers": ["QmA", "QmGone"], "capacity": 2, "active": 1}],
        "num_blocks": 8,  # an extension field: passes through
    }
    records = {"QmA": _record("QmA"), "QmNew": _record("QmNew", state="joining", num_blocks=0, slots_total=0,
                                                       slots_free=0, reachability="relayed",
                                                       maddrs=["/ip4/1.2.3.4/tcp/5/p2p-circuit"])}
    view = merge_view("tiny", records, summary, now=now)
    by_id = {s["peer_id"]: s for s in view["servers"]}
    assert set(by_id) == {"QmA", "QmNew", "QmGone"}
    assert by_id["QmA"]["tau_c"] == 0.03 and by_id["QmA"]["slots_free"] == 5  # live numbers from the record
    assert by_id["QmA"]["last_seen"] == pytest.approx(records["QmA"].timestamp)
    assert by_id["QmNew"]["state"] == "joining" and by_id["QmNew"]["tau_c"] is None
    assert by_id["QmGone"]["state"] == "offline" and by_id["QmGone"]["record_expired"] is True
    assert view["chains"] == summary["chains"] and view["queue_length"] == 2 and view["ready"] is True
    assert view["num_blocks"] == 8 and view["source"] == "dht" and view["orchestrator_summary"] is True
    assert view["updated_at"] == now
    # the orchestrator's "failed" (unreachable) wins over a record that still says online
    summary["servers"][0]["state"] = "failed"
    assert merge_view("tiny", records, summary)["servers"][0]["state"] == "failed"
    # how a server is reached: its record's claim, unless the orchestrator dialed it itself
    assert by_id["QmNew"]["reachability"] == "relayed" and by_id["QmNew"]["maddrs"] == ["/ip4/1.2.3.4/tcp/5/p2p-circuit"]
    assert by_id["QmA"]["reachability"] == "unknown"
    summary["servers"][0]["reachability"] = "unreachable"
    assert merge_view("tiny", records, summary)["servers"][0]["reachability"] == "unreachable"
    # what only the orchestrator knows passes through (a server banned by audits showed as a normal online one,
    # one refused for serving another model as joining); what the server signs is shown (its emulated faults)
    summary["servers"][0].update(state="refused", trust={"banned": True, "strikes": 3}, step_compute_s=0.01,
                                 model_mismatch=True)
    records["QmA"] = _record("QmA", emulate_reply_fault="noise", emulate_reply_fault_rate=0.5,
                             models=["tiny", "other"], serving="tiny")
    a = {s["peer_id"]: s for s in merge_view("tiny", records, summary)["servers"]}["QmA"]
    assert a["state"] == "refused" and a["trust"] == {"banned": True, "strikes": 3} and a["step_compute_s"] == 0.01
    assert a["emulate_reply_fault"] == "noise" and a["emulate_reply_fault_rate"] == 0.5
    assert a["models"] == ["tiny", "other"] and a["serving"] == "tiny" and a["model_mismatch"] is True
    # a span it cannot load, and why: signed by the server, shown with the orchestrator's "failed"
    records["QmA"] = _record("QmA", state="joining", num_blocks=0, slots_total=0, slots_free=0, failed_span=[0, 4],
                             load_error="loading failed: OutOfMemoryError: CUDA out of memory")
    summary["servers"][0].update(state="failed")
    a = {s["peer_id"]: s for s in merge_view("tiny", records, summary)["servers"]}["QmA"]
    assert a["state"] == "failed" and a["failed_span"] == [0, 4] and "out of memory" in a["load_error"]


def test_merge_without_summary_and_with_garbage_summary():
    records = {"QmA": _record("QmA", max_length=512)}
    view = merge_view("pfx", records, None, initial_peers=["/ip4/1.2.3.4/tcp/1/p2p/QmX"])
    assert view["ready"] is False and view["chains"] == [] and view["model"] == "pfx"
    assert view["max_length"] == 512 and view["orchestrator_summary"] is False
    assert view["initial_peers"] == ["/ip4/1.2.3.4/tcp/1/p2p/QmX"]
    assert [s["peer_id"] for s in view["servers"]] == ["QmA"]
    # a (signed but) malformed summary must not crash the dashboard
    view = merge_view("pfx", records, {"servers": "nonsense", "chains": [], "ready": True})
    assert [s["peer_id"] for s in view["servers"]] == ["QmA"]
    view = merge_view("pfx", records, {"servers": [None, 3, {"peer_id": 5}, {"peer_id": "QmB"}]})
    assert {s["peer_id"] for s in view["servers"]} == {"QmA", "QmB"}



class FakeDht:
    """What :class:`DhtSwarmSource` reads, by prefix: server records and the (trusted) summary."""

    def __init__(self, records: dict, summaries: dict):
        self.records, self.summaries = records, summaries

    def fetch_servers(self, prefix: str) -> dict:
        return self.records.get(prefix, {})

    def fetch_summary(self, prefix: str, trusted) -> dict | None:
        return self.summaries.get(prefix)


def test_several_models_listed_by_the_trusted_summary_are_each_shown():
    """One model: ``?model=`` ignored, as by an orchestrator of one. Several (the summary's ``models``): each one's
    view by name or prefix, with the list for the page's links; another name is UnknownModel, and a 404 like the
    orchestrator router's on the API and the page."""
    from petals_chain.dashboard.source import UnknownModel

    listed = [{"name": "alpha", "model": "alpha", "dht_prefix": "pa", "servers": 9},
              {"name": "beta", "model": "beta", "dht_prefix": "pb"},
              {"name": "bad", "dht_prefix": "not a prefix!"}, {"name": "alpha", "dht_prefix": "pc"}, "junk"]
    dht = FakeDht({"pa": {"QmA": _record("QmA")}, "pb": {"QmB": _record("QmB"), "QmC": _record("QmC")}},
                  {"pa": {"model": "alpha", "chains": [{"id": 0}]}, "pb": {"model": "beta", "queue_length": 4}})
    source = DhtSwarmSource(dht, "pa", trusted=["QmOrch"])
    source.refresh()
    assert source.view("beta") is source.view() and "models" not in source.view()  # one model, as today
    dht.summaries["pa"]["models"] = listed
    source.refresh()
    assert source.models() == ["alpha", "beta"]  # malformed and duplicate entries dropped
    for asked in ("beta", "pb"):
        beta = source.view(asked)
        assert (beta["model"], beta["model_name"], beta["dht_prefix"]) == ("beta", "beta", "pb")
        assert [s["peer_id"] for s in beta["servers"]] == ["QmB", "QmC"] and beta["queue_length"] == 4
    assert source.view() is source.view("alpha") and source.view()["model_name"] == "alpha"
    # the links' counts are those of the view each leads to
    assert [(m["name"], m["servers"], m["chains"], m["queue_length"]) for m in source.view("pb")["models"]] == [
        ("alpha", 1, 1, 0), ("beta", 2, 0, 4)]
    with pytest.raises(UnknownModel, match="'gamma' does not exist; this swarm serves 'alpha', 'beta'"):
        source.view("gamma")
    del dht.summaries["pa"]  # the orchestrator restarting: its models stay reachable meanwhile
    source.refresh()
    assert source.view("beta")["dht_prefix"] == "pb" and source.view()["orchestrator_summary"] is False
    dht.summaries["pa"] = {"models": [dict(listed[0], dht_prefix="pc"), listed[1]]}  # not listing ours: ignored
    source.refresh()
    assert source.models() == [] and source.view("beta")["dht_prefix"] == "pa" and "models" not in source.view()

    dht.summaries["pa"]["models"] = listed
    source.refresh()
    client = TestClient(create_app(source.view, source.health, model_view=source.view))
    assert client.get("/api/v1/swarm", params={"model": "beta"}).json()["dht_prefix"] == "pb"
    assert client.get("/api/v1/swarm", params={"model": ""}).json()["dht_prefix"] == "pa"
    assert client.get("/", params={"model": "beta"}).status_code == 200
    for path in ("/api/v1/swarm", "/", "/index.html"):
        r = client.get(path, params={"model": "gamma"})
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "the model 'gamma' does not exist; this swarm serves 'alpha', 'beta'",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert client.get("/healthz").json()["models"] == ["alpha", "beta"]

def test_cli_requires_a_prefix_and_validates_arguments(capsys, tmp_path):
    args = build_parser().parse_args(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--model", "/m/Tiny-Llama/"])
    assert resolve_prefix(args) == "Tiny-Llama"
    # no prefix and no trusted orchestrator (no peer id in the multiaddr) to discover it from
    with pytest.raises(SystemExit) as exc:
        main(["--initial-peers", "/ip4/127.0.0.1/tcp/1"])
    assert exc.value.code == 2 and "--dht-prefix" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--initial-peers", "x", "--dht-prefix", "bad prefix!"])
    # a directory that holds no model: a one-line usage error (was a FileNotFoundError traceback)
    with pytest.raises(SystemExit) as exc:
        main(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--model", str(tmp_path)])
    assert exc.value.code == 2 and "config.json" in capsys.readouterr().err
    for bad in (["--poll-interval", "0"], ["--poll-interval", "inf"], ["--log-level", "bogus"]):
        with pytest.raises(SystemExit):
            main(["--initial-peers", "x", "--dht-prefix", "ok", *bad])
    # base58 but no peer id (hivemind's from_base58 takes it): a typo trusted nobody, the page stayed empty
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--initial-peers", "x", "--dht-prefix", "ok", "--trust-orchestrator", "notapeerid"])
    assert exc.value.code == 2 and "not a peer id: 'notapeerid'" in capsys.readouterr().err


def test_the_model_names_the_swarm_the_orchestrator_of_that_model_announces(smollm2_path):
    """``--model`` given as the path of the real model's file: the orchestrator names that swarm by the registry's
    short name; the dashboard took the raw file name and watched an empty swarm."""
    from petals_chain.swarm.keys import default_dht_prefix
    from petals_chain.swarm.sources import resolve_source

    args = build_parser().parse_args(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--model", str(smollm2_path)])
    assert resolve_prefix(args) == default_dht_prefix(resolve_source(smollm2_path).name) == "smollm2-135m"


@pytest.mark.slow
def test_dht_source_reads_signed_records_and_only_the_trusted_summary():
    """Real hivemind DHT: an orchestrator node, a server node, an impostor; the dashboard node in client mode."""
    from petals_chain.swarm.dht import SwarmDHT

    prefix = "dash-unit"
    nodes = []
    try:
        orch = SwarmDHT.create(prefix=prefix)
        nodes.append(orch)
        peers = orch.visible_maddrs()
        server = SwarmDHT.create(initial_peers=peers, prefix=prefix)
        impostor = SwarmDHT.create(initial_peers=peers, prefix=prefix)
        nodes += [server, impostor]
        assert server.publish_server(prefix, _record(server.peer_id, public_name="srv"), expiration_s=60)
        good = sample_swarm()
        good["servers"] = [{"peer_id": server.peer_id, "tau_c": 0.02}]
        good["queue_length"] = 7
        assert orch.publish_summary(prefix, good, expiration_s=60)
        forged = dict(good, queue_length=999, chains=[{"id": 42, "servers": ["QmForged"]}])
        assert impostor.publish_summary(prefix, forged, expiration_s=60)

        reader = SwarmDHT.create(initial_peers=peers, client_mode=True, prefix=prefix)
        nodes.append(reader)
        source = DhtSwarmSource(reader, prefix, trusted=[orch.peer_id], interval_s=0.5)
        assert source.health()[0] is False  # nothing read yet
        view = source.refresh()
        assert view["queue_length"] == 7 and all(ch["id"] != 42 for ch in view["chains"])
        assert [s["peer_id"] for s in view["servers"]] == [server.peer_id]
        assert view["servers"][0]["public_name"] == "srv" and view["servers"][0]["tau_c"] == 0.02
        assert source.health()[0] is True

        untrusting = DhtSwarmSource(reader, prefix, trusted=[impostor.peer_id], interval_s=0.5).refresh()
        assert untrusting["queue_length"] == 999  # the trust list, not the data, decides whose summary counts
        nobody = DhtSwarmSource(reader, prefix, trusted=[], interval_s=0.5).refresh()
        assert nobody["ready"] is False and nobody["chains"] == []

        # background polling picks up a server going offline
        source.start()
        assert server.publish_server(prefix, _record(server.peer_id, state="offline"), expiration_s=60)
        deadline = time.time() + 10 * measure_slowdown()
        while time.time() < deadline and source.view()["servers"][0]["state"] != "offline":
            time.sleep(0.2)
        assert source.view()["servers"][0]["state"] == "offline"
        source.stop()
    finally:
        for node in reversed(nodes):
            node.shutdown()
