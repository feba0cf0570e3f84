"""Shared helpers of the dashboard tests: a contracts-E fixture, a threaded uvicorn server, headless Chromium, the
standalone dashboard as its own process."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

from pathlib import Path

import httpx
import uvicorn

from petals_chain.swarm.local import free_port  # noqa: F401 - also imported from here by the live test

REPO_ROOT = Path(__file__).resolve().parents[1]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def browser_skip_reason() -> Optional[str]:
    """Why browser tests cannot run here, or None."""
    if CHROMIUM is None:
        return "Debian chromium is not installed (bash scripts/setup.sh dev installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e .[dev])"
    return None


def sample_swarm(now: Optional[float] = None, hostile_name: str = "<img src=x onerror=window.__pwned=1>evil") -> dict:
    """A contracts-E view of a 5-server, 24-block swarm with 3 chains, a queue and a response history."""
    now = time.time() if now is None else now

    def server(pid, name, start, n, total, free, tau_p, tau_c, mem_gb, rtt=0.0, scale=1.0):
        return {"peer_id": pid, "public_name": name, "state": "online", "start_block": start, "num_blocks": n,
                "slots_total": total, "slots_free": free, "tau_p": tau_p, "tau_c": tau_c,
                "memory_bytes": int(mem_gb * 2**30), "device": "cpu", "dtype": "float32",
                "emulate_rtt_ms": rtt, "emulate_compute_scale": scale, "last_seen": now - 1.5}

    servers = [
        server("QmAlpha1111111111111111111111111111111111111", "alpha-a100", 0, 12, 48, 18, 0.004, 0.030, 40),
        server("QmBravo2222222222222222222222222222222222222", "bravo-3090", 12, 12, 36, 24, 0.006, 0.045, 24, rtt=40),
        server("QmCharl3333333333333333333333333333333333333", "charlie-t4", 0, 8, 16, 16, 0.011, 0.060, 16, scale=2.0),
        server("QmDelta4444444444444444444444444444444444444", "delta-v100", 8, 16, 32, 16, 0.007, 0.050, 32, rtt=80),
        server("QmEvilX5555555555555555555555555555555555555", hostile_name, 4, 10, 20, 10, 0.009, 0.070, 20),
    ]
    servers[1].update(reachability="relayed", maddrs=["/ip4/203.0.113.7/tcp/31337/p2p/QmOrch/p2p-circuit"])
    servers[0].update(reachability="direct", maddrs=["/ip4/198.51.100.4/tcp/4000"])
    servers[0].update(step_compute_s=0.048, step_network_s=0.0315)  # what relayed steps showed (one server so far)
    chains = [
        {"id": 0, "servers": [servers[0]["peer_id"], servers[1]["peer_id"]], "names": ["alpha-a100", "bravo-3090"],
         "blocks": [12, 12], "spans": [[0, 12], [12, 24]], "service_time": 0.20, "capacity": 3, "active": 3},
        {"id": 1, "servers": [servers[2]["peer_id"], servers[3]["peer_id"]], "names": ["charlie-t4", "delta-v100"],
         "blocks": [8, 16], "spans": [[0, 8], [8, 24]], "service_time": 0.31, "capacity": 2, "active": 1},
        {"id": 2, "servers": [servers[0]["peer_id"], servers[3]["peer_id"]], "names": ["alpha-a100", "delta-v100"],
         "blocks": [12, 12], "spans": [[0, 12], [12, 24]], "service_time": 0.26, "capacity": 1, "active": 0},
    ]
    history = []
    for i in range(60):
        wait = max(0.0, 0.05 * ((i * 7) % 11) - 0.2)
        service = 0.2 + 0.02 * ((i * 5) % 7)
        history.append({"t": now - 120 + 2 * i, "response_s": wait + service, "wait_s": wait, "service_s": service})
    return {
        "model": "tiny-llama-24", "dht_prefix": "tiny-llama-24", "max_length": 512, "ready": True,
        "initial_peers": ["/ip4/127.0.0.1/tcp/40000/p2p/QmOrch"], "http_url": "http://127.0.0.1:8000",
        "epoch": 3, "placement_policy": "gbp-cr", "dispatch_policy": "jffc", "c": 3,
        "arrival_rate": 9.5, "rho_bar": 0.7, "predicted_response_s": {"lower": 0.24, "upper": 0.41},
        "measured": {"mean_response_s": 0.31, "mean_wait_s": 0.07, "mean_service_s": 0.24,
                     "completed": 1234, "failed": 2},
        "queue_length": 4, "updated_at": now, "servers": servers, "chains": chains, "history": history,
        "job_tokens": {"value": 176, "mode": "auto", "mean_declared": 171.5, "jobs_observed": 1236,
                       "output_reserve_tokens": 256, "open_waits": 3, "extensions": 5, "preemptions": 1},
        "relay": {"tokens": 5000, "relay_steps": 2000, "prompt_tokens": 20000, "prompt_cache_hit_rate": 0.25,
                  "speculative": {"default": "ngram", "passes": 900, "drafted_tokens": 3000, "accepted_tokens": 1800,
                                  "acceptance_rate": 0.6, "accepted_per_pass": 2.0, "tokens_per_relay_step": 2.5},
                  "mode": "push", "passes": {"orchestrator": 100, "push": 800}, "push_rescues": 1,
                  "critical_legs": {"orchestrator": 600, "push": 3200}, "legs_per_token": 1.6},
    }


@contextlib.contextmanager
def serve_app(app: Any, grace_s: float = 1.0, stop_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free loopback port; yields the base URL.

    On exit, request handlers still running after ``grace_s`` (one a client gave up on, a stand-in told to hang)
    are cancelled, as uvicorn's ``timeout_graceful_shutdown`` does: without it uvicorn waited for them for ever,
    this helper's join gave up after 10 s and left the server thread running. A server thread still alive
    ``stop_s`` later (a handler that ignores cancellation or blocks the event loop) is a leak: RuntimeError,
    unless the body already failed (its own error is the one to see)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=grace_s)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"serve_app:{port}", daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("test HTTP server did not start")
        time.sleep(0.05)
    body_ok = False
    try:
        yield f"http://127.0.0.1:{port}"
        body_ok = True
    finally:
        server.should_exit = True
        thread.join(timeout=grace_s + stop_s)
        if thread.is_alive() and body_ok:
            raise RuntimeError(f"the test HTTP server on port {port} did not stop {grace_s + stop_s:g} s after "
                               "its exit was asked: a request handler ignores cancellation or blocks its event loop")


class MutableView:
    """A view the test can change while the page polls it."""

    def __init__(self, data: dict):
        self._data = copy.deepcopy(data)
        self._lock = threading.Lock()

    def get(self) -> dict:
        with self._lock:
            return copy.deepcopy(self._data)

    def update(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            fn(self._data)


@contextlib.contextmanager
def chromium_browser() -> Iterator[Callable[..., tuple[Any, list[str]]]]:
    """Headless Chromium; yields ``new_page(viewport=None) -> (page, errors)`` where ``errors`` collects the
    page's console errors and uncaught exceptions. (Playwright's sync API cannot nest: one browser, many pages.)"""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

        def new_page(viewport: Optional[dict] = None) -> tuple[Any, list[str]]:
            errors: list[str] = []
            context = browser.new_context(viewport=viewport or {"width": 1280, "height": 900})
            page = context.new_page()
            page.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            return page, errors

        try:
            yield new_page
        finally:
            browser.close()


@contextlib.contextmanager
def chromium_page(viewport: Optional[dict] = None) -> Iterator[tuple[Any, list[str]]]:
    """One headless-Chromium page and the list that collects its console errors and page errors."""
    with chromium_browser() as new_page:
        yield new_page(viewport)


def descendants(pid: int) -> list[int]:
    """All descendant pids of ``pid`` (psutil; empty if it is gone)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - best effort; killpg covers the usual case
        return []


def quietly(fn: Callable[[], Any]) -> None:
    """Run ``fn`` ignoring the errors of signalling/waiting for processes that are already gone."""
    import subprocess

    try:
        fn()
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired, OSError):
        pass


class DashboardProc:
    """``python -m petals_chain.dashboard`` in its own session; ``kill()`` takes its whole group (DHT, p2pd)."""

    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "petals_chain.dashboard", *args], cwd=str(REPO_ROOT),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> list[int]:
        """SIGTERM (as ``kill``, systemd, docker stop), then SIGKILL what is left; returns the processes the
        dashboard left running after SIGTERM (its DHT process and p2pd outlived it: uvicorn re-raised the signal
        before the cleanup)."""
        children = descendants(self.proc.pid)
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            quietly(lambda: self.proc.wait(timeout=timeout))
        deadline = time.time() + 10
        while (left := [pid for pid in children if _running(pid)]) and time.time() < deadline:
            time.sleep(0.2)
        quietly(lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        for pid in children:
            quietly(lambda: os.kill(pid, signal.SIGKILL))
        quietly(lambda: self.proc.wait(timeout=10))
        if not self._log.closed:
            self._log.close()
        return left


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(cond: Callable[[], Optional[object]], timeout: float, what: str, swarm, dash: DashboardProc) -> object:
    deadline = time.time() + timeout
    last_exc = None
    while time.time() < deadline:
        if not swarm.orchestrator.alive():
            raise RuntimeError(f"the orchestrator exited:\n{swarm.log_tail('orchestrator')}")
        if not dash.alive():
            raise RuntimeError(f"the dashboard exited with {dash.proc.returncode}:\n{dash.log()[-3000:]}")
        try:
            value = cond()
            if value:
                return value
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last_exc = e
        time.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what} (last error {last_exc!r})\n--- orchestrator\n"
                       f"{swarm.log_tail('orchestrator')}\n--- dashboard\n{dash.log()[-2000:]}")
