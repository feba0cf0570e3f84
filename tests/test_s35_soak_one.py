"""scripts/soak.py, the one soak (session 33's growth soak folded into it, session 35): what a run started is stopped
whatever ends it (a failed start left the orchestrator, its loop thread, the API's socket and uvicorn running), and
its verdict names the containers that grew by more than ``--tolerance`` per 1,000 requests and still grew (exit 1).
No swarm: the roles are fakes, the API a real uvicorn on loopback serving a two-line ``/metrics``."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


class FakeOrch:
    fail_start = False
    last: "FakeOrch | None" = None

    def __init__(self, cfg):
        self.cfg, self.events, self.ready, self.model_id, self.initial_peers = cfg, [], True, "tiny", []
        self.dispatch = SimpleNamespace(chains=[0, 1], running=0, queue_length=0)
        self.leak: list[int] = []  # one entry per round: a leak
        self.levels: list[int] = []  # grows in the first measured rounds, then stays: a filled cache
        FakeOrch.last = self

    def load_model(self):
        self.events.append("load")

    async def start(self):
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("the DHT node could not start")

    async def stop(self):
        self.events.append("stop")


class FakeServer:
    made: list["FakeServer"] = []
    fail_at: int | None = None

    def __init__(self, cfg):
        if len(FakeServer.made) == FakeServer.fail_at:
            raise RuntimeError("no room for the second server")
        self.cfg, self.finished = cfg, False
        self.service = SimpleNamespace(sessions={}, runner=None)
        self._stop = asyncio.Event()
        FakeServer.made.append(self)

    async def run(self):
        await self._stop.wait()
        self.finished = True

    def _on_signal(self):
        self._stop.set()


async def _app(scope, receive, send):  # the API: /metrics is all the soak reads of it directly
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"# HELP x a series\nx 1\n"})


@pytest.fixture
def soak(tmp_path, monkeypatch):
    """scripts/soak.py loaded with fake roles; yields the module and the sockets it listened on. Afterwards: no
    thread of the run is left, nor its temp directory."""
    import petals_chain.orchestrator as orchestrator
    import petals_chain.orchestrator.api as api
    import petals_chain.server.server as server
    import petals_chain.swarm.local as local
    import petals_chain.swarm.tiny_model as tiny

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts scripts/ first
    spec = importlib.util.spec_from_file_location("_s35_soak_one", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def build(path, **kw):
        Path(path).mkdir(parents=True)
        return Path(path)

    sockets: list[socket.socket] = []
    listen = getattr(mod, "_listen", None)

    def recorded():
        sockets.append(listen())
        return sockets[-1]

    monkeypatch.setattr(mod, "_listen", recorded, raising=False)
    monkeypatch.setattr(mod.tempfile, "tempdir", str(tmp_path))  # its temp directory: soak-* here
    monkeypatch.setattr(mod.logging, "basicConfig", lambda **kw: None)  # the test's logging stays as it is
    monkeypatch.setattr(tiny, "build_tiny_model", build)
    monkeypatch.setattr(local, "memory_for", lambda *a, **k: 1 << 20)
    monkeypatch.setattr(orchestrator, "Orchestrator", FakeOrch)
    monkeypatch.setattr(api, "create_app", lambda orch: _app)
    monkeypatch.setattr(server, "Server", FakeServer)
    monkeypatch.setattr(FakeServer, "made", [])
    FakeOrch.last = None
    threads = set(threading.enumerate())
    yield SimpleNamespace(mod=mod, sockets=sockets)
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not left, f"threads left running: {left}"
    assert not list(tmp_path.glob("soak-*")), "the temp directory was left"


def _assert_api_stopped(sockets):
    assert len(sockets) == 1 and sockets[0].fileno() == -1, "the listening socket was left open"


def test_a_failed_orchestrator_start_is_stopped(soak, monkeypatch):
    """orch.start() raising midway (its DHT node up, say) left the orchestrator unstopped and its loop thread
    running; now it is stopped, the thread ended, the temp directory gone, the start's error raised."""
    monkeypatch.setattr(FakeOrch, "fail_start", True)
    with pytest.raises(RuntimeError, match="DHT node"):
        soak.mod.main(["--rounds", "2", "--requests", "10"])
    assert FakeOrch.last.events == ["load", "start", "stop"]
    assert not soak.sockets and not FakeServer.made  # (nothing after the failed start was started)


def test_a_failed_server_start_stops_the_rest(soak, monkeypatch):
    """The second server failing to start (outside the old try) left the orchestrator, the first server, uvicorn
    and its listening socket running; now each is stopped, in the reverse order."""
    monkeypatch.setattr(FakeServer, "fail_at", 1)
    with pytest.raises(RuntimeError, match="no room"):
        soak.mod.main(["--rounds", "2", "--requests", "10"])
    assert FakeOrch.last.events == ["load", "start", "stop"]
    assert [s.finished for s in FakeServer.made] == [True]
    _assert_api_stopped(soak.sockets)


def test_the_verdict_names_what_still_grows(soak, monkeypatch, capsys):
    """A whole run (fake roles): a container gaining 1 entry a round of 100 requests (10 per 1,000, over the
    tolerance of 5) is named and the run exits 1; one that filled and levelled off is not; then all is stopped."""
    drives = []

    async def drive(port, model, first, count, concurrency, tokens):
        orch = FakeOrch.last
        drives.append((first, count))
        orch.leak.append(first)
        orch.dead = dead
        if len(orch.levels) < 3:
            orch.levels += [0, 0]
        return {"plain:200": count}

    monkeypatch.setattr(soak.mod, "_drive", drive)
    monkeypatch.setattr(soak.mod, "_settle", lambda *a, **k: None)
    monkeypatch.setattr(soak.mod, "_types", lambda: __import__("collections").Counter())  # (slow: every object)
    # A dead weakref.proxy in the heap and among what the walk reaches (the test process's other tests leave such
    # proxies): isinstance on one raised ReferenceError and the soak crashed (CI under pytest-xdist).
    gone = type("Gone", (), {})()
    dead = [weakref.proxy(gone)]
    del gone
    assert soak.mod.main(["--rounds", "3", "--requests", "100", "--warmup", "50", "--tolerance", "5"]) == 1
    assert drives == [(0, 50), (50, 100), (150, 100), (250, 100)]
    out = capsys.readouterr().out
    assert "1 container(s) grew by more than 5 per 1,000 requests" in out
    assert '"orch.leak"' in out and '"orch.levels"' not in out
    assert FakeOrch.last.events == ["load", "start", "stop"]
    assert [s.finished for s in FakeServer.made] == [True, True]
    _assert_api_stopped(soak.sockets)


def test_growth_per_1000_requests(monkeypatch):
    """The verdict's arithmetic: from the first measured round to the last (the warm-up with one measured round),
    per 1,000 requests, above the tolerance, and still growing in the last round."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("_s35_soak_one_growth", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one = [{"a": 10, "b": 4}, {"a": 13, "b": 4}]  # warm-up, one measured round of 500 requests: a +6 per 1,000
    assert mod.growth(one, 500, 5.0) == {"a": {"first": 10, "before_last": 10, "last": 13, "per_1000": 6.0}}
    assert mod.growth(one, 500, 6.0) == {}  # (not more than the tolerance)
    three = [{"a": 0, "c": 0}, {"a": 5, "c": 1}, {"a": 9, "c": 9}, {"a": 9, "c": 12, "new": 4}]
    assert mod.growth(three, 100, 5.0) == {  # a: levelled off in the last round; c and new: still growing
        "c": {"first": 1, "before_last": 9, "last": 12, "per_1000": 55.0},
        "new": {"first": 0, "before_last": 0, "last": 4, "per_1000": 20.0}}
    with pytest.raises(ValueError, match="at least one measured round"):
        mod.growth(one[:1], 500, 5.0)
