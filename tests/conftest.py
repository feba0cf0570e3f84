"""Shared fixtures: tiny HF models, a fake orchestrator on the DHT, and server subprocesses killed reliably.

Server processes run in their own session (process group), so stopping one also stops the DHT child and
its p2pd, even after SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., Path]:
    """``factory(family="llama", num_layers=4, **kw) -> Path``; builds each distinct model once per session."""
    from petals_chain.swarm.tiny_model import build_tiny_model

    built: dict[tuple, Path] = {}

    def factory(family: str = "llama", num_layers: int = 4, **kwargs) -> Path:
        key = (family, num_layers, tuple(sorted(kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}-{num_layers}")
            built[key] = Path(build_tiny_model(out, family=family, num_layers=num_layers, **kwargs))
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> Path:
    """A 4-layer tiny Llama (hidden 64), built once per test session."""
    return tiny_model_factory("llama", num_layers=4)


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001
        return []


class ServerProcess:
    """A ``python -m petals_chain.server`` subprocess; ``stop()`` sends SIGTERM, ``kill()`` kills the group."""

    def __init__(self, args: list[str], log_path: Path, env: Optional[dict] = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        full_env.setdefault("PETALS_CHAIN_CACHE_DIR", str(log_path.parent / "cache"))
        self.proc = subprocess.Popen([sys.executable, "-m", "petals_chain.server", *args], cwd=str(REPO_ROOT),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.peer_id: Optional[str] = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_peer_id(self, timeout: float = 60.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in self.log().splitlines():
                if line.startswith("PEER_ID "):
                    self.peer_id = line.split()[1]
                    return self.peer_id
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"server printed no peer id in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (kills the group if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        return self.proc.returncode

    def kill(self) -> None:
        descendants = _descendants(self.proc.pid)
        with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        for pid in descendants:
            with_suppress(lambda: os.kill(pid, signal.SIGKILL))
        with_suppress(lambda: self.proc.wait(timeout=10))
        self._log.close()

    def _reap_group(self) -> None:
        # Anything left in the process group (a p2pd whose parent died) is ours to kill.
        with_suppress(lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        if not self._log.closed:
            self._log.close()


def with_suppress(fn) -> None:
    try:
        fn()
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired, OSError):
        pass


@pytest.fixture
def server_procs(tmp_path):
    """``start(args) -> ServerProcess``; every started server is stopped (then killed) at teardown."""
    procs: list[ServerProcess] = []

    def start(args: list[str]) -> ServerProcess:
        proc = ServerProcess(args, tmp_path / f"server{len(procs)}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            proc.kill()
        else:
            proc._reap_group()


@pytest.fixture
def orchestrator_dht():
    """A SwarmDHT standing in for the orchestrator (the swarm's first peer); shut down at teardown."""
    from petals_chain.swarm.dht import SwarmDHT

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield sd
    sd.shutdown()


def p2pd_pids_of(pids: list[int]) -> list[int]:
    """p2pd processes whose ancestry includes one of ``pids`` (for leak checks)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "pid"]):
        if "p2pd" not in (p.info["name"] or ""):
            continue
        try:
            parents = {q.pid for q in p.parents()}
        except psutil.Error:
            continue
        if parents & set(pids):
            out.append(p.info["pid"])
    return out
