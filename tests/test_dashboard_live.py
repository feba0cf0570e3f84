"""The dashboard against a LIVE swarm in headless Chromium: a real orchestrator, three real servers and the
standalone dashboard (all separate processes on loopback hivemind), a real completion request.

Checks both pages: the orchestrator's own ``/`` and the standalone dashboard that reads only the DHT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

from conftest import REPO_ROOT, _descendants, with_suppress
from dashboard_helpers import browser_skip_reason, chromium_browser, free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))]

MAX_LENGTH = 128
REFRESH_S = 1.0
SERVER_NAMES = ["live-alpha", "live-bravo", "live-charlie"]


class Proc:
    """A ``python -m ...`` subprocess in its own session; ``kill()`` takes its whole group (DHT child, p2pd)."""

    def __init__(self, module: str, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PETALS_CHAIN_CACHE=str(log.parent / "cache"))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=str(REPO_ROOT), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        descendants = _descendants(self.proc.pid)
        with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        for pid in descendants:
            with_suppress(lambda: os.kill(pid, signal.SIGKILL))
        with_suppress(lambda: self.proc.wait(timeout=10))
        if not self._log.closed:
            self._log.close()


def wait_for(cond: Callable[[], Optional[object]], timeout: float, what: str, procs: list[Proc]) -> object:
    deadline = time.time() + timeout
    last_exc = None
    while time.time() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.log_path.name} exited with {p.proc.returncode}:\n{p.log()[-3000:]}")
        try:
            value = cond()
            if value:
                return value
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last_exc = e
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.log_path.name}\n{p.log()[-2000:]}" for p in procs)
    raise TimeoutError(f"timed out waiting for {what} (last error {last_exc!r})\n{logs}")


@pytest.fixture
def live_swarm(tiny_model_factory, tmp_path):
    """Orchestrator + 3 servers + standalone dashboard; yields a dict of URLs, peer ids and processes."""
    model = tiny_model_factory("llama", num_layers=8)
    procs: list[Proc] = []
    try:
        ready_file = tmp_path / "orch.json"
        orch = Proc("petals_chain.orchestrator", [
            "--model", str(model), "--port", "0", "--ready-file", str(ready_file), "--max-length", str(MAX_LENGTH),
            "--arrival-rate", "1", "--settle-s", "1", "--log-level", "WARNING"], tmp_path / "orch.log")
        procs.append(orch)
        info = wait_for(lambda: ready_file.exists() and json.loads(ready_file.read_text()), 90, "orchestrator", procs)
        peers, orch_url = info["initial_peers"], info["http_url"]
        servers = {}
        for name in SERVER_NAMES:
            p = Proc("petals_chain.server", [
                "--model", str(model), "--initial-peers", *peers, "--memory-bytes", "1500000",
                "--max-length", str(MAX_LENGTH), "--public-name", name, "--tau-p", "0.001", "--refresh-s", "2",
                "--trust-orchestrator", info["peer_id"], "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                "--drain-timeout-s", "5", "--no-progress", "--log-level", "WARNING"], tmp_path / f"{name}.log")
            procs.append(p)
            servers[name] = p
        prefix = httpx.get(f"{orch_url}/api/v1/swarm", timeout=10).json()["dht_prefix"]
        dash_port = free_port()
        dash = Proc("petals_chain.dashboard", [
            "--initial-peers", *peers, "--dht-prefix", prefix, "--port", str(dash_port), "--poll-interval", "1",
            "--log-level", "WARNING"], tmp_path / "dashboard.log")
        procs.append(dash)
        yield {"orch_url": orch_url, "dash_url": f"http://127.0.0.1:{dash_port}", "servers": servers,
               "procs": procs, "prefix": prefix}
    finally:
        for p in reversed(procs):
            p.terminate(timeout=15)


def _servers_by_name(view: dict) -> dict:
    return {s["public_name"]: s for s in view["servers"]}


def test_live_swarm_dashboard(live_swarm):
    orch_url, dash_url, procs = live_swarm["orch_url"], live_swarm["dash_url"], live_swarm["procs"]

    def orch_ready():
        v = httpx.get(f"{orch_url}/api/v1/swarm", timeout=10).json()
        by_name = _servers_by_name(v)
        online = all(by_name.get(n, {}).get("state") == "online" for n in SERVER_NAMES)
        return v if v["ready"] and v["chains"] and online else None

    wait_for(orch_ready, 180, "a ready swarm with all three servers online", procs)
    r = httpx.post(f"{orch_url}/v1/completions", json={"model": live_swarm["prefix"], "prompt": "hello swarm",
                                                       "max_tokens": 4, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    orch_view = wait_for(lambda: (lambda v: v if v["history"] else None)(
        httpx.get(f"{orch_url}/api/v1/swarm", timeout=10).json()), 30, "a completion in the history", procs)

    def dash_ready():  # the standalone dashboard has the signed summary (with the completion) and every server
        v = httpx.get(f"{dash_url}/api/v1/swarm", timeout=10).json()
        by_name = _servers_by_name(v)
        ok = (v["orchestrator_summary"] and v["chains"] and v["history"]
              and all(by_name.get(n, {}).get("state") == "online" for n in SERVER_NAMES))
        return v if ok else None

    dash_view = wait_for(dash_ready, 60, "the standalone dashboard to see the swarm", procs)
    assert httpx.get(f"{dash_url}/healthz", timeout=10).json()["ok"] is True

    leaving = "live-bravo"
    with chromium_browser() as new_page:
        (orch_page, orch_errors), (dash_page, dash_errors) = new_page(), new_page()
        for page, view in ((orch_page, orch_view), (dash_page, dash_view)):
            page.goto(f"{orch_url if page is orch_page else dash_url}/?refresh={REFRESH_S:g}")
            page.wait_for_selector(".chain[data-chain-id]", timeout=15_000)
            for s in view["servers"]:
                if s["public_name"] in SERVER_NAMES:
                    row = page.locator(f'#servers-table tr[data-peer-id="{s["peer_id"]}"]')
                    assert row.locator(".server-name").inner_text() == s["public_name"]
                    assert row.get_attribute("data-state") == "online"
            ids = page.locator(".chain[data-chain-id]").evaluate_all("cs => cs.map(c => +c.dataset.chainId)")
            assert sorted(ids) == sorted(ch["id"] for ch in view["chains"])
            assert page.locator("#queue-length").inner_text() == str(view["queue_length"])
            assert page.locator("#ready-badge").get_attribute("data-ready") == "true"
            assert page.locator("#latency-chart svg polyline.line-response").count() == 1

        peer = _servers_by_name(dash_view)[leaving]["peer_id"]
        t_stop = time.time()
        live_swarm["servers"][leaving].terminate(timeout=30)  # graceful: drains, announces offline, leaves
        for page, url in ((orch_page, orch_url), (dash_page, dash_url)):
            def api_shows_gone():
                s = _servers_by_name(httpx.get(f"{url}/api/v1/swarm", timeout=10).json()).get(leaving)
                return s is None or s["state"] in ("offline", "failed")
            wait_for(api_shows_gone, 60, f"{url} to report {leaving} gone", [p for p in procs if p.proc.poll() is None])
            t_api = time.monotonic()
            page.wait_for_selector(f'#servers-table tr[data-peer-id="{peer}"].gone', timeout=(REFRESH_S + 2) * 1000)
            assert time.monotonic() - t_api <= REFRESH_S + 2
        print(f"server leave -> both pages show it gone after {time.time() - t_stop:.1f} s")
        for page in (orch_page, dash_page):
            for name in SERVER_NAMES:
                if name != leaving:  # the others stay listed and live
                    assert page.locator("#servers-table tbody tr:not(.gone) .server-name", has_text=name).count() == 1
        assert orch_errors == [] and dash_errors == []
