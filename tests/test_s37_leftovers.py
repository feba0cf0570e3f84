"""Small leftovers of session 37: ``scripts/soak.py --rounds 1`` refused (its verdict needs two measured rounds),
``/openapi.json`` naming the build, the dashboard printing a URL one can
open for a wildcard ``--host``, and the open-files limit raised to macOS's OPEN_MAX where 65,536 is refused."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import resource
import socket
import sys
from pathlib import Path
from unittest.mock import MagicMock

import httpx
import pytest

from petals_chain.swarm import launch

REPO = Path(__file__).resolve().parents[1]


def test_soak_refuses_one_measured_round(monkeypatch, capsys):
    """``--rounds 1`` judged growth from the warm-up: a cache filling for the first time read as a leak and the run
    exited 1 (tests/test_s35_soak_one.py's fake roles, a container filled by round 1 and level after it). Now it is
    an argparse error before anything starts; two rounds run."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts scripts/ first
    spec = importlib.util.spec_from_file_location("_s37_soak", REPO / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    started = []
    monkeypatch.setattr(soak, "_soak", lambda args, work: started.append(args.rounds) or 0)
    with pytest.raises(SystemExit) as e:
        soak.main(["--rounds", "1"])
    assert e.value.code == 2 and not started
    err = capsys.readouterr().err
    assert "--rounds 1: the verdict compares the first measured round with the last" in err
    assert "--rounds 2 or more" in err
    assert soak.main(["--rounds", "2"]) == 0 and started == [2]


def test_openapi_names_the_build(monkeypatch):
    """``/openapi.json`` said ``info.version`` 0.1.0 (FastAPI's placeholder) whatever ran; now the build."""
    from petals_chain.orchestrator import api

    orch = MagicMock(draining=False, ready=True, uptime_s=1.0)
    monkeypatch.setattr(api, "build_version", lambda: "petals-chain/9.8.7+gabcdef0.dirty")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.create_app(orch)), base_url="http://o") as c:
            return (await c.get("/openapi.json")).json()

    info = asyncio.run(main())["info"]
    assert info["version"] == "9.8.7+gabcdef0.dirty" and info["title"] == "petals-chain orchestrator"


@pytest.mark.parametrize("host, url", [("0.0.0.0", "http://127.0.0.1:8089/"), ("::", "http://[::1]:8089/"),
                                       ("127.0.0.1", "http://127.0.0.1:8089/"), ("::1", "http://[::1]:8089/")])
def test_the_dashboard_prints_a_url_one_can_open(monkeypatch, capsys, host, url):
    """``--host 0.0.0.0`` printed ``dashboard: http://0.0.0.0:8080/`` (no address to open); now the loopback one, and
    that it listens on every address. The DHT, the swarm source and uvicorn are stand-ins."""
    import petals_chain.dashboard.source as source
    from petals_chain.dashboard import __main__ as dash
    from petals_chain.swarm.dht import SwarmDHT

    monkeypatch.setattr(SwarmDHT, "create", staticmethod(lambda **kw: MagicMock()))
    monkeypatch.setattr(source, "DhtSwarmSource", MagicMock())
    monkeypatch.setattr(dash, "_serve", lambda *a, **k: False)
    args = argparse.Namespace(initial_peers=[], host_maddrs=[], identity_path=None, host=host, port=8089,
                              poll_interval=1.0)
    with socket.socket() as sock:
        assert dash._run(args, "prefix", ["QmTrusted"], sock) == 0
    out = capsys.readouterr().out
    said = next(line for line in out.splitlines() if line.startswith("dashboard: http"))
    everywhere = " (listening on every address: --host %s)" % host if host in ("0.0.0.0", "::") else ""
    assert said == f"dashboard: {url}{everywhere}", out


def test_the_open_files_limit_falls_back_to_macos_open_max(monkeypatch):
    """macOS (hard limit unlimited) refuses a soft limit over OPEN_MAX (10240) with ValueError: the soft limit stayed
    at its 256 (a role needing more was refused at start: "the open-files limit is 256"). Now it is raised to
    10240."""
    calls: list = []

    def setrlimit(which, limits):
        calls.append(limits)
        if limits[0] > 10240:
            raise ValueError("current limit exceeds maximum limit")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert launch.raise_open_files_limit("server", needed=1024) == 10240
    assert calls == [(65536, resource.RLIM_INFINITY), (10240, resource.RLIM_INFINITY)]
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))  # a hard limit under OPEN_MAX: tried once

    def refused(which, limits):
        calls.append(limits)
        raise OSError("a sandbox")

    monkeypatch.setattr(resource, "setrlimit", refused)
    assert launch.raise_open_files_limit("server") == 256 and calls == [(4096, 4096)]
