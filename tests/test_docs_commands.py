"""The documented commands given a new user's usual mistakes (README, the role guides, the client kit): each is a
clear usage error at once, before any process starts, not a traceback, a silent default, or a failure after the
swarm was set up."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from petals_chain import demo
from petals_chain.client import Client

ROOT = Path(__file__).resolve().parents[1]
PEER_ID = "QmSdW9w9D3eLPdjKNJzqqbubRT9naoyGEvq6rcbP6DsT4v"  # well-formed; nobody listens at the address below


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """demo.main installs its SIGTERM / SIGHUP / SIGINT handlers in this process: left in place, a later test's SIGTERM
    to itself (test_launch.py) raised the demo's KeyboardInterrupt and stopped the whole run (CI)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _no_swarm(args) -> int:
    pytest.fail(f"the swarm was started with max_length={args.max_length!r}, arrival_rate={args.arrival_rate!r}")


@pytest.mark.parametrize("argv, says", [
    (["--max-length", "0"], "--max-length must be >= 256"),  # ran the demo at 1024, unsaid
    (["--max-length", "-5"], "--max-length must be >= 256"),  # a traceback
    (["--max-length", "8"], "--max-length must be >= 256"),  # failed after the swarm had started
    (["--tiny", "--max-length", "4"], "--max-length must be >= 88"),
    (["--arrival-rate", "abc"], "argument --arrival-rate"),  # a traceback
    (["--tiny", "--arrival-rate", "x"], "argument --arrival-rate"),
    (["--arrival-rate", "0"], "must be positive"),  # the orchestrator's error, after the servers had started
    (["--arrival-rate", "inf"], "must be positive"),
    (["--work-dir", "/proc/petals-chain-no-such-dir"], "--work-dir"),  # a traceback
])
def test_demo_refuses_bad_flag_values_before_starting_anything(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(demo, "run_real", _no_swarm)
    monkeypatch.setattr(demo, "run_tiny", _no_swarm)
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_demo_accepts_the_documented_values(monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "run_real", lambda args: seen.append((args.max_length, args.arrival_rate)) or 0)
    monkeypatch.setattr(demo, "run_tiny", lambda args: seen.append((args.max_length, args.arrival_rate)) or 0)
    for argv in ([], ["--max-length", "2048", "--arrival-rate", "1.5"], ["--tiny"], ["--tiny", "--arrival-rate",
                                                                                    "auto"]):
        assert demo.main(argv) == 0
    assert seen == [(1024, "0.5"), (2048, "1.5"), (256, "8"), (256, "auto")]


def test_demo_with_a_model_that_does_not_exist_is_an_error_not_a_traceback(capsys):
    assert demo.main(["--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "error: --model /nonexistent/model.gguf" in err and "does not exist" in err


@pytest.mark.parametrize("url, says", [
    ("127.0.0.1:8000", "http(s)://HOST:PORT"),  # every request a 503 "no orchestrator could serve"
    (["http://127.0.0.1:8000", "localhost:8001"], "http(s)://HOST:PORT"),  # the same after retry_s (30 s) of rounds
    ("http://127.0.0.1:8000/v1", "without /v1"),  # OpenAI's base URL: every path doubled, a bare 404
    ("https://swarm.example.org/v1/", "without /v1"),
])
def test_client_refuses_what_is_not_an_orchestrator_url(url, says):
    with pytest.raises(ValueError) as e:
        Client(url)
    assert says in str(e.value)


def test_client_takes_orchestrator_urls():
    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "https://swarm.example.org/petals",
                ["http://a:1", "http://b:2"]):
        Client(url).close()


def test_dashboard_on_a_port_in_use_says_so_before_joining_the_dht():
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))  # bound, never listening: the initial peer's address refuses connections
        port, dead = taken.getsockname()[1], free.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "petals_chain.dashboard", "--initial-peers",
                            f"/ip4/127.0.0.1/tcp/{dead}/p2p/{PEER_ID}", "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "dashboard: http" not in r.stdout  # it did not announce a page it could not serve


def test_orchestrator_on_an_http_port_in_use_names_the_port_and_the_flag(tiny_model_dir):
    """It exited with only "error: [Errno 98] Address already in use", naming neither the port nor --port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "petals_chain.orchestrator", "--model", str(tiny_model_dir),
                            "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use (give another --port or --host)" in r.stderr


def test_the_demo_stops_on_sigint_when_started_with_it_ignored(monkeypatch):
    """A shell script's background job inherits SIGINT ignored: `kill -INT` did nothing (SIGTERM did)."""
    import signal

    seen = []
    monkeypatch.setattr(demo, "run_tiny", lambda args: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # put back by _signal_handlers_restored
    assert demo.main(["--tiny"]) == 0
    assert seen == [signal.default_int_handler]
