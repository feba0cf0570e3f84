"""Stopped before it serves, a process leaves no DHT process or p2pd behind: Ctrl-C while a DHT node joins, and
SIGTERM or Ctrl-C while the standalone dashboard looks for its swarm."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.slow


def _left_behind(kids: list[psutil.Process]) -> list[str]:
    """Those of ``kids`` still running (torch's shared-memory manager ends itself once its clients are gone)."""
    out = []
    for k in kids:
        try:
            if k.status() != psutil.STATUS_ZOMBIE and k.name() != "torch_shm_manager":
                out.append(f"{k.pid} {k.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def _children_with_p2pd(proc: subprocess.Popen, timeout_s: float) -> list[psutil.Process]:
    """The descendants of ``proc`` once one of them is a p2pd (its DHT node is starting or joining)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        kids = psutil.Process(proc.pid).children(recursive=True)
        if any(k.name() == "p2pd" for k in kids):
            return kids
        time.sleep(0.1)
    raise AssertionError(f"no p2pd under pid {proc.pid} (exit code {proc.poll()})")


def _stop(proc: subprocess.Popen, kids: list[psutil.Process], grace_s: float) -> tuple[int | None, list[str]]:
    """Wait for ``proc`` to exit -> (its exit code, what it left running ``grace_s`` later); whatever it left is
    killed."""
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        rc = None
        proc.kill()
    deadline = time.monotonic() + grace_s
    while _left_behind(kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _left_behind(kids)
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass
    return rc, left


def test_ctrl_c_while_joining_stops_the_dht_process_and_its_p2pd(scaled):
    """A peer that accepts connections and never answers: the join waits; Ctrl-C then left p2pd running (until its
    next log line, seconds later, went to a closed pipe). Now it is gone when the process exits."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        maddr = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/QmfWYKNLKshECqJfmU4iZC1faVBnioLhezeTWc1P1HfwPJ"
        code = (f"from petals_chain.swarm.dht import SwarmDHT\n"
                f"SwarmDHT.create(initial_peers=[{maddr!r}])\nprint('joined')\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        kids = _children_with_p2pd(proc, scaled(60))
        silent.settimeout(scaled(60))
        conn, _ = silent.accept()  # its p2pd dials the peer: the join waits for an answer that never comes
        with conn:
            proc.send_signal(signal.SIGINT)
            rc, left = _stop(proc, kids, grace_s=0)
    assert b"joined" not in proc.stdout.read()
    assert rc is not None and left == [], (rc, left)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_dashboard_stopped_while_it_looks_for_its_swarm_stops_its_dht(orchestrator_dht, sig, scaled):
    """No orchestrator announces a swarm: the dashboard waits for one. SIGTERM then ended it at once (its DHT
    process and p2pd left running), Ctrl-C with a traceback; both now stop it as a stop while serving does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "petals_chain.dashboard", "--initial-peers",
                             *orchestrator_dht.visible_maddrs(), "--port", str(port),
                             "--discover-timeout", str(scaled(120))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        kids = _children_with_p2pd(proc, scaled(60))
        try:
            line = lines.get(timeout=scaled(30))  # printed once its DHT node has joined
        except queue.Empty:
            line = ""
        proc.send_signal(sig)
        rc, left = _stop(proc, kids, grace_s=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert (rc, left) == (0, []), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert line.startswith("looking for the swarm"), line


def test_after_serving_the_dashboard_keeps_its_stop_handler_for_the_cleanup():
    """asyncio's loop, closing, set SIGTERM to its default: a second SIGTERM while the dashboard stopped its DHT
    killed it before the DHT was shut down (review)."""
    import os
    import signal
    import socket
    import threading

    import uvicorn

    from petals_chain.dashboard import __main__ as dash

    async def app(scope, receive, send):
        raise RuntimeError

    before = signal.signal(signal.SIGTERM, dash._interrupt)  # as main() installs it before _run
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
            dash._serve(uvicorn, app, sock)
        assert signal.getsignal(signal.SIGTERM) is dash._interrupt
    finally:
        signal.signal(signal.SIGTERM, before)
