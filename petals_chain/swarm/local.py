"""LocalSwarm: an orchestrator and heterogeneous servers as real processes on loopback.

Used by the demo, the end-to-end tests and the benchmarks. Every node runs in a session of its own; its DHT process
and ``p2pd`` run in a process group of their own in it (a signal to the node's group, as Ctrl-C sends, reaches the node
alone: it stops them itself). Stopping or SIGKILLing a node (a crashed machine) kills its group and every descendant.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx

from petals_chain.swarm.launch import Launched, descendants as _descendants, kill_role_session, launch


@dataclass
class LocalServer:
    """One server to start: memory budget ``M_j`` in bytes and emulation knobs."""

    public_name: str
    memory_bytes: int
    emulate_rtt_ms: float = 0.0
    emulate_compute_scale: float = 1.0
    tau_p: Optional[float] = None  # skip profiling and announce this (seconds per block per job)
    extra_args: Sequence[str] = ()
    model: Optional[str | Sequence[str]] = None  # the model(s) it offers (paths): default the swarm's model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for fixed ports that survive a process restart)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_memory(model_path: str | os.PathLike, max_length: int, dtype: str | None = None) -> tuple[int, int, int]:
    """``(L, s_m, s_c)`` in bytes of the model at ``model_path`` for slots of ``max_length`` tokens."""
    from petals_chain.swarm.checkpoint import load_config
    from petals_chain.swarm.memory import block_bytes, cache_slot_bytes

    config = load_config(model_path)
    return int(config.num_hidden_layers), block_bytes(config, dtype), cache_slot_bytes(config, dtype, max_length)


def memory_for(model_path: str | os.PathLike, max_length: int, blocks: int, slots_per_block: int) -> int:
    """Memory budget (bytes) for ``blocks`` blocks with ``slots_per_block`` concurrent jobs each."""
    _, s_m, s_c = model_memory(model_path, max_length)
    return int(blocks * (s_m + s_c * slots_per_block))


def signal_role(pid: int, sig: int) -> None:
    """Signal a role started in a session of its own, as losing its host would: its process group, and every
    descendant (its DHT process and p2pd run in a group of their own, ``swarm.dht._DHTProcess``: a killpg of the
    role alone leaves them to stop by themselves, a few ms later, and a SIGSTOP of it alone leaves them answering).
    SIGKILL spares torch_shm_manager, which serves no peer and cleans up after itself (:func:`kill_role_session`)."""
    import psutil

    descendants = _descendants(pid)  # before the role goes: afterwards they are no longer its children
    if sig == signal.SIGKILL:
        kill_role_session(pid, descendants)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    for child in descendants:
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            child.send_signal(sig)


@dataclass
class _Proc:
    name: str
    popen: Launched  # a subprocess.Popen or a ForkedProcess (launch.py)
    log_path: Path
    spec: Any = None
    stopped: bool = False  # stopped on purpose (kill_server): its exit is no failure

    def alive(self) -> bool:
        return self.popen.poll() is None


class LocalSwarm:
    """Start, observe and stop a whole swarm on this machine.

    ```python
    with LocalSwarm(model_path, [LocalServer("a", mem), LocalServer("b", mem)], max_length=256) as swarm:
        swarm.wait_ready()
        client = swarm.client()
    ```
    """

    def __init__(self, model_path: str | os.PathLike, servers: Sequence[LocalServer] = (), *, max_length: int = 256,
                 arrival_rate: Optional[float] = None, orchestrator_args: Sequence[str] = (),
                 server_args: Sequence[str] = (), log_dir: Optional[str | os.PathLike] = None,
                 python: str = sys.executable, env: Optional[dict] = None, settle_s: float = 1.0,
                 models: Optional[dict[str, str | os.PathLike]] = None):
        self.model_path = str(model_path)
        # several models behind the orchestrator (--model NAME=PATH each); model_path is then the first one's
        self.models = {str(k): str(v) for k, v in (models or {}).items()}
        self.server_specs = list(servers)
        self.max_length = max_length
        self.arrival_rate = arrival_rate
        self.orchestrator_args = list(orchestrator_args)
        self.server_args = list(server_args)
        self._tmp = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="petals-chain-swarm-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # Two cores are shared by many processes: keep every node to one intra-op thread.
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env.setdefault("MKL_NUM_THREADS", "1")
        self.settle_s = settle_s
        self.orchestrator: Optional[_Proc] = None
        self.servers: dict[str, _Proc] = {}
        self.url: Optional[str] = None
        self.initial_peers: list[str] = []
        self.orchestrator_peer_id: Optional[str] = None
        self._sigterm: Any = None  # the SIGTERM handler __enter__ replaced (restored at __exit__)

    # ---- processes -----------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], spec: Any = None) -> _Proc:
        log_path = self.log_dir / f"{name}.log"
        assert args[0] == "-m", args
        popen = launch(args[1], args[2:], log_path=log_path, env=self.env, cwd=os.getcwd(), python=self.python)
        return _Proc(name=name, popen=popen, log_path=log_path, spec=spec)

    def log_tail(self, name: str, lines: int = 40) -> str:
        proc = self.orchestrator if name == "orchestrator" else self.servers.get(name)
        if proc is None or not proc.log_path.exists():
            return ""
        return "\n".join(proc.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start_orchestrator(self, timeout: float = 120.0) -> None:
        ready_file = self.log_dir / "orchestrator.ready.json"
        if ready_file.exists():
            ready_file.unlink()
        model_args = (["--model", self.model_path] if not self.models else
                      [a for name, path in self.models.items() for a in ("--model", f"{name}={path}")])
        args = ["-m", "petals_chain.orchestrator", *model_args, "--port", "0",
                "--max-length", str(self.max_length), "--ready-file", str(ready_file),
                "--settle-s", str(self.settle_s)]
        if self.arrival_rate is not None:
            args += ["--arrival-rate", str(self.arrival_rate)]
        args += self.orchestrator_args
        self.orchestrator = self._spawn("orchestrator", args)
        deadline = time.monotonic() + timeout
        while not ready_file.exists():
            if not self.orchestrator.alive():
                raise RuntimeError(f"the orchestrator exited:\n{self.log_tail('orchestrator')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the orchestrator did not start in {timeout}s:\n{self.log_tail('orchestrator')}")
            time.sleep(0.1)
        info = json.loads(ready_file.read_text())
        self.url = info["http_url"]
        self.initial_peers = list(info["initial_peers"])
        self.orchestrator_peer_id = info["peer_id"]

    def add_server(self, spec: LocalServer) -> None:
        """Start one more server (it joins the running swarm)."""
        if self.orchestrator is None:
            raise RuntimeError("start the orchestrator first")
        if spec.public_name in self.servers:
            raise ValueError(f"a server named {spec.public_name!r} already exists")
        models = [spec.model] if isinstance(spec.model, (str, os.PathLike)) else list(spec.model or [self.model_path])
        args = ["-m", "petals_chain.server", *[a for m in models for a in ("--model", str(m))], "--initial-peers",
                *self.initial_peers,
                "--memory-bytes", str(int(spec.memory_bytes)), "--public-name", spec.public_name,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--emulate-rtt-ms", str(spec.emulate_rtt_ms),
                "--emulate-compute-scale", str(spec.emulate_compute_scale), "--no-progress"]
        if spec.tau_p is not None:
            args += ["--tau-p", str(spec.tau_p)]
        args += self.server_args + list(spec.extra_args)
        self.servers[spec.public_name] = self._spawn(f"server-{spec.public_name}", args, spec)

    def start(self, timeout: float = 120.0) -> "LocalSwarm":
        try:
            self.start_orchestrator(timeout)
            for spec in self.server_specs:
                self.add_server(spec)
        except BaseException:
            self.stop()
            raise
        return self

    def kill_server(self, name: str, sig: int = signal.SIGKILL) -> None:
        """SIGKILL (default): kill the server's whole process group and descendants at once, a crashed machine.
        Any other signal goes to the server's own process, as an operator's ``kill PID`` or Ctrl-C: SIGTERM makes
        it drain and announce its leave (its DHT process and p2pd are stopped by the server itself)."""
        proc = self.servers[name]
        proc.stopped = True
        if sig != signal.SIGKILL:
            self._signal(proc, sig, group=False)
            return
        self._reap(proc, _descendants(proc.popen.pid))
        proc.popen.wait(timeout=10)

    # ---- observation ---------------------------------------------------------------------------
    def swarm(self, model: str | None = None, timeout: float = 10.0) -> dict:
        """``/api/v1/swarm``; with several models, ``model``'s (the router answers for the first one unless asked)."""
        r = httpx.get(f"{self.url}/api/v1/swarm", params={"model": model} if model else None, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def wait_until(self, predicate: Callable[[dict], bool], timeout: float = 120.0, what: str = "condition") -> dict:
        """Poll ``/api/v1/swarm`` until ``predicate(state)``; fail fast if the orchestrator died, or if every server
        (but those :meth:`kill_server` stopped) did: servers that all exit at start made scripts wait their whole
        timeout (10-15 minutes) for a swarm that would never form."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        while True:
            if self.orchestrator is None or not self.orchestrator.alive():
                raise RuntimeError(f"the orchestrator exited:\n{self.log_tail('orchestrator')}")
            try:
                last = self.swarm()
                if predicate(last):
                    return last
            except httpx.HTTPError:
                pass
            started = {n: p for n, p in self.servers.items() if not p.stopped}
            if started and not any(p.alive() for p in started.values()):
                logs = "\n".join(f"--- {n} (exit status {p.popen.poll()})\n{self.log_tail(n)}"
                                 for n, p in started.items())
                raise RuntimeError(f"every server exited while waiting for {what}:\n{logs}")
            if time.monotonic() > deadline:
                dead = [n for n, p in self.servers.items() if not p.alive() and p.spec is not None]
                logs = "\n".join(f"--- {n}\n{self.log_tail(n)}" for n in dead)
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}; state: "
                                   f"ready={last.get('ready')} chains={len(last.get('chains', []))} "
                                   f"servers={[(s.get('public_name'), s.get('state')) for s in last.get('servers', [])]}"
                                   f"\n--- orchestrator\n{self.log_tail('orchestrator')}\n{logs}")
            time.sleep(0.25)

    def wait_ready(self, timeout: float = 120.0, *, all_servers: bool = True) -> dict:
        """Wait until a chain covers the model and (``all_servers``) every started server is known and settled."""
        names = {n for n, p in self.servers.items() if p.alive()}

        def ok(state: dict) -> bool:
            if not state.get("ready"):
                return False
            if not all_servers:
                return True
            known = {s["public_name"]: s for s in state.get("servers", [])}
            if not names <= set(known):
                return False
            # Assigned servers must be online with their span; unassigned ones may stay idle.
            return all(s.get("assigned") is None or s["state"] == "online" for s in known.values() if s["public_name"] in names)

        return self.wait_until(ok, timeout, "the swarm to be ready")

    def client(self, **kwargs: Any):
        from petals_chain.client import Client

        return Client(self.url, **kwargs)

    # ---- shutdown ------------------------------------------------------------------------------
    @staticmethod
    def _signal(proc: _Proc, sig: int, *, group: bool) -> None:
        """Signal the process's whole group, or the process alone as ``kill PID`` does (a server then shuts its DHT
        process and p2pd down itself)."""
        try:
            (os.killpg if group else os.kill)(proc.popen.pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _wait(procs: Sequence[_Proc], timeout: float) -> None:
        """Wait until every process in ``procs`` has exited, or ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return

    def _reap(self, proc: _Proc, descendants: Sequence[Any]) -> None:
        """Kill whatever is left of ``proc``: its session (its group; its DHT process and p2pd, in a group of their
        own) and ``descendants``, but for torch's shared-memory manager (:func:`kill_role_session`)."""
        kill_role_session(proc.popen.pid, descendants)
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _stop_proc(self, proc: _Proc, timeout: float = 10.0) -> None:
        descendants = _descendants(proc.popen.pid)
        if proc.alive():
            self._signal(proc, signal.SIGTERM, group=True)
            self._wait([proc], timeout)
        self._reap(proc, descendants)

    def stop(self, server_timeout: float = 5.0) -> None:
        """Stop the servers, then the orchestrator; no process (p2pd included) survives.

        Servers go first, all at once, each signalled alone (``kill PID``, as an operator does): each drains and
        publishes its ``offline`` record while the orchestrator's DHT node still takes it. A server still draining
        after ``server_timeout`` s (a session the orchestrator holds) is killed after the orchestrator has stopped
        and closed its sessions.
        """
        procs = list(self.servers.values())
        descendants = {p.name: _descendants(p.popen.pid) for p in procs}
        for p in procs:
            if p.alive():
                self._signal(p, signal.SIGTERM, group=False)
        self._wait(procs, server_timeout)
        if self.orchestrator is not None:
            self._stop_proc(self.orchestrator)
        for p in procs:
            self._reap(p, descendants[p.name])

    def leftover_processes(self, wait_s: float = 5.0) -> list[int]:
        """Live (non-zombie) processes left from this swarm's sessions (each node's process group, and its DHT
        process's and p2pd's group in it); should be empty after stop()."""
        import psutil

        groups = {p.popen.pid for p in [*self.servers.values(), *([self.orchestrator] if self.orchestrator else [])]}
        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for proc in psutil.process_iter(["pid", "status", "name"]):
                try:
                    # torch_shm_manager leaves by itself once its clients are gone (kill_role_session)
                    if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["name"] == "torch_shm_manager":
                        continue
                    if os.getsid(proc.info["pid"]) in groups or os.getpgid(proc.info["pid"]) in groups:
                        left.append(proc.info["pid"])
                except (ProcessLookupError, psutil.Error, OSError):
                    continue
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def __enter__(self) -> "LocalSwarm":
        # SIGTERM (``timeout``, ``kill``) ended a script at once and left its swarm running: it now unwinds the
        # ``with`` like Ctrl-C does, so the swarm stops (only where nobody handles SIGTERM already)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
            if self._tmp is not None:
                self._tmp.cleanup()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
