"""An Orchestrator in this test process (its own event loop in a thread) with real server processes.

Unlike LocalSwarm (the orchestrator as a process, seen through HTTP), tests reach the orchestrator's
configuration and state directly: ``swarm.call(lambda orch: orch.generate(...))`` runs a coroutine on its loop.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from conftest import REPO_ROOT, ServerProcess


class InProcessSwarm:
    def __init__(self, model_path: str | Path, workdir: Path, **cfg: Any):
        from petals_chain.orchestrator import Orchestrator, OrchestratorConfig

        self.model_path = str(model_path)
        self.workdir = Path(workdir)
        config = OrchestratorConfig(model=self.model_path, port=0)
        for k, v in {"settle_s": 0.5, "max_length": 64, **cfg}.items():
            setattr(config, k, v)  # also knobs an older OrchestratorConfig lacks (then ignored)
        self.orch = Orchestrator(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.servers: dict[str, ServerProcess] = {}
        self.helpers: dict[str, subprocess.Popen] = {}

    def call(self, fn: Callable[[Any], Awaitable[Any]], timeout: float = 300.0) -> Any:
        """Run ``fn(orch)`` on the orchestrator's loop and return its result."""
        async def run():
            return await fn(self.orch)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def submit(self, fn: Callable[[Any], Awaitable[Any]]):
        """Like :meth:`call`, without waiting: a concurrent.futures.Future."""
        async def run():
            return await fn(self.orch)

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def start(self) -> "InProcessSwarm":
        async def start(orch):
            await asyncio.to_thread(orch.load_model)
            await orch.start()

        self.call(start)
        return self

    @property
    def initial_peers(self) -> list[str]:
        return self.orch.initial_peers

    def add_server(self, name: str, memory_bytes: int, *args: str, tau_p: float = 0.002) -> ServerProcess:
        proc = ServerProcess(["--model", self.model_path, "--initial-peers", *self.initial_peers,
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--memory-bytes", str(memory_bytes),
                              "--public-name", name, "--tau-p", str(tau_p), "--no-progress", "--refresh-s", "2",
                              "--assignment-poll-s", "0.3", *args],
                             self.workdir / f"{name}.log", env={"OMP_NUM_THREADS": "1"})
        self.servers[name] = proc
        return proc

    def add_hostile(self, name: str, memory_bytes: int, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "hostile_server.py"), "--model",
                                 self.model_path, "--initial-peers", *self.initial_peers, "--memory-bytes",
                                 str(memory_bytes), "--public-name", name, *args], cwd=str(REPO_ROOT),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.helpers[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict:
        async def get(orch):
            return orch.swarm_json()

        return self.call(get, timeout=30)

    def wait_until(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if predicate(st):
                return st
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in [*self.servers, *self.helpers])
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}: "
                                   f"{[(s['public_name'], s['state'], s['assigned']) for s in st['servers']]}"
                                   f" chains={[ch['names'] for ch in st['chains']]}\n{logs}")
            time.sleep(0.2)

    def stop(self) -> None:
        try:
            async def stop(orch):
                await orch.stop()

            self.call(stop, timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            for proc in self.servers.values():
                proc.kill()
            for proc in self.helpers.values():
                import os
                import signal

                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
