"""Shared fixtures: tiny HF models, a fake orchestrator on the DHT, and server subprocesses killed reliably.

Server processes run in their own session (process group), so stopping one also stops the DHT child and
its p2pd, even after SIGKILL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest
from hypothesis import settings as hypothesis_settings

REPO_ROOT = Path(__file__).resolve().parents[1]

# CPU seconds of _reference_workload() on the project's 2-core host when quiet (measured there: 0.16-0.19 s).
_REFERENCE_CPU_S = 0.18
_MAX_SLOWDOWN = 8.0


def _reference_workload() -> tuple[float, float]:
    """``(wall, cpu)`` seconds of a fixed pure-Python loop (about 0.2 s of one core)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(12):
        acc = 0
        for i in range(300_000):
            acc += (i * i) % 7
    return time.perf_counter() - t0, time.process_time() - c0


@functools.lru_cache(maxsize=None)
def measure_slowdown() -> float:
    """How much slower than the quiet reference host this machine runs now (1.0 to 8.0), measured once per
    session: the share of a core the workload got (wall / cpu: other processes competing) times how much
    slower the core is (cpu / reference), times the number of pytest-xdist workers. ``PETALS_CHAIN_TEST_SLOWDOWN``
    overrides it."""
    forced = os.environ.get("PETALS_CHAIN_TEST_SLOWDOWN")
    if forced:
        return min(_MAX_SLOWDOWN, max(1.0, float(forced)))
    runs = [_reference_workload() for _ in range(3)]
    wall, cpu = sorted(runs)[1]  # the median run: one lucky or unlucky time slice does not decide
    contention = wall / max(cpu, 1e-6)
    core = max(1.0, cpu / _REFERENCE_CPU_S)
    # Each xdist worker measures at its start, beside the others' start (one busy loop a core: no contention seen);
    # later a test shares the machine with the other workers' swarms, and may get only 1/N of it.
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    return round(min(_MAX_SLOWDOWN, max(1.0, contention * core) * workers), 2)


# Every process a test starts inherits this tag (through the environment), orphans and namespaced ones included,
# so the session can find what outlived it.
SESSION_TAG_VAR = "PETALS_CHAIN_TEST_SESSION"
# Under pytest-xdist each worker tags with the controller's tag plus its own id: a worker finds only its own
# leftovers (the other worker's processes are still running), the controller finds every worker's.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_controller_tag = os.environ.get(SESSION_TAG_VAR) if _XDIST_WORKER else None
os.environ[SESSION_TAG_VAR] = (f"{_controller_tag}-{_XDIST_WORKER}" if _controller_tag
                               else f"{os.getpid()}-{time.time_ns()}")
# Every process of the session (the roles the tests start inherit TMPDIR) makes its temporary files in one folder of
# the session's, removed at its end: what a SIGKILLed role leaves (p2pd's sockets, torch_shm_manager's folder, a fork
# server's pymp-* folder; no handler of theirs runs) no longer piles up in /tmp, run after run. The controller makes
# it; xdist's workers inherit it. Short: p2pd's socket paths in it must fit sun_path (swarm.dht falls back to /tmp).
SESSION_TMPDIR_PREFIX = "petals-chain-tests-"
if not _XDIST_WORKER:
    import tempfile

    # pytest's own tmp_path folders stay where they were (kept for three runs, to read a failure's logs)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix=SESSION_TMPDIR_PREFIX)
# How long the interpreter may take to exit once the suite has finished before it is made to (seconds).
_EXIT_GRACE_S = float(os.environ.get("PETALS_CHAIN_TEST_EXIT_GRACE_S", "120"))
_exit_status = 0


# pytest-xdist (`pytest -n 2`; setup.cfg: --dist loadfile) hands whole files to the workers in collection order. These
# take longest (seconds each, under xdist: docs/results.md); they go first so that none of them runs alone at the
# end while the other worker idles. Every other file keeps its place, and every file its tests' order.
LONGEST_FILES = ("test_real_model.py", "test_netns_swarm.py", "test_demo.py", "test_reliability.py",
                 "test_herd_groups.py", "test_audit.py", "test_session_keepalive.py", "test_bench_swarm.py",
                 "test_placement_swarm.py", "test_e2e_swarm.py", "test_docs_commands.py", "test_server_records.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


def pytest_sessionstart(session):
    measure_slowdown()  # at the start, before the suite's own swarms add load of their own (~0.6 s)


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)
    workeroutput = getattr(session.config, "workeroutput", None)  # (xdist's worker)
    if workeroutput is not None:  # a worker's summary is not shown: the controller prints what it scaled by
        workeroutput["petals_chain_slowdown"] = measure_slowdown()


_worker_slowdowns: dict[str, float] = {}  # xdist's controller: each worker's slowdown, sent at its end


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    slowdown = getattr(node, "workeroutput", {}).get("petals_chain_slowdown")
    if slowdown is not None:
        _worker_slowdowns[node.gateway.id] = slowdown


def tagged_leftovers(shm_managers: bool = False) -> list:
    """Live processes started by this session (tag in their environment) other than this one and its helpers
    (multiprocessing's fork server and resource tracker, torch's shared-memory manager: they leave with it);
    ``shm_managers``: the session's torch_shm_manager processes instead."""
    import psutil

    tag = f"{SESSION_TAG_VAR}={os.environ[SESSION_TAG_VAR]}".encode()
    worker_tag = tag + b"-"  # (a worker's tag, when this is xdist's controller)
    out = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "name"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        helper = proc.info["ppid"] == os.getpid() and "multiprocessing" in cmdline
        # torch's shared-memory manager serves this process too: killed, torch aborts at exit (broken pipe)
        shm_manager = "torch_shm_manager" in (proc.info["name"] or "") + cmdline
        helper = (not shm_manager) if shm_managers else (helper or shm_manager)
        if proc.pid == os.getpid() or helper:  # roles forked by the fork server share its command line: not helpers
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
                if any(e == tag or e.startswith(worker_tag) for e in env) and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
        except (OSError, psutil.Error):
            continue
    return out


def _kill_all(procs: list) -> None:
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def pytest_unconfigure(config):
    """A process the suite started must not outlive it: it would hold CI's output pipe open (CI then waits for EOF
    until its own time limit) or load the next run. Kill what is left, and say so (a leak is a bug to fix). Then
    make sure the interpreter's exit cannot hang: after _EXIT_GRACE_S, print every thread's stack and exit with
    the suite's status."""
    import sys
    import threading

    import psutil

    # what is on its way out is not a leftover (xdist: a worker's fork server leaves a moment after its worker)
    leftovers = tagged_leftovers()
    leftovers = psutil.wait_procs(leftovers, timeout=10)[1] if leftovers else leftovers
    _kill_all(leftovers)
    if leftovers:
        names = sorted({f"{p.pid}: " + (" ".join(p.info["cmdline"] or ()) or p.info["name"] or "?")[:120]
                        for p in leftovers})
        print(f"\npetals-chain: killed {len(leftovers)} process(es) the suite left running:\n  " + "\n  ".join(names),
              file=sys.stderr, flush=True)

    def guard() -> None:
        time.sleep(_EXIT_GRACE_S)
        import faulthandler

        print(f"\npetals-chain: the test process did not exit {_EXIT_GRACE_S:.0f} s after the suite finished; "
              f"its threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _kill_all(tagged_leftovers())
        os._exit(_exit_status)

    threading.Thread(target=guard, name="exit-guard", daemon=True).start()
    if not _XDIST_WORKER:
        sweep_session_tmpdir(os.environ["TMPDIR"])
    # Past the interpreter's own shutdown (C-level exit handlers), only another process can end a hang: this one
    # SIGKILLs us a little after the guard; .ci/run then takes the suite's status from STATUS_FILE_VAR's file.
    status_file = os.environ.get(STATUS_FILE_VAR)
    if status_file and not _XDIST_WORKER:  # the suite's status is the controller's, written after every worker's
        Path(status_file).write_text(str(_exit_status))
        import subprocess

        subprocess.Popen([sys.executable, "-c", _EXIT_WATCHDOG, str(os.getpid()), str(_EXIT_GRACE_S + 30)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


def sweep_session_tmpdir(folder: str) -> None:
    """Remove the session's temporary folder (``folder``) once its processes are gone: now, all but this process's
    own multiprocessing folder (its finalizer removes that at exit, and reports a folder removed under it); the
    folder itself at exit, after that finalizer (exit priority -100). A torch_shm_manager whose last client left
    removes its own folder within 2 s: waited for, not to remove what it is about to."""
    import multiprocessing.process
    import multiprocessing.util
    import shutil

    import psutil

    if not os.path.basename(folder).startswith(SESSION_TMPDIR_PREFIX):  # (never anything else, whatever TMPDIR says)
        return
    managers = [p for p in tagged_leftovers(shm_managers=True) if p.info["ppid"] != os.getpid()]
    psutil.wait_procs(managers, timeout=5)
    own = multiprocessing.process.current_process()._config.get("tempdir")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if path == own:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                  exitpriority=-101)


STATUS_FILE_VAR = "PETALS_CHAIN_TEST_STATUS_FILE"  # where the suite's exit status is written before exit

# Hypothesis in CI (.ci/run sets STATUS_FILE_VAR; most CI services set CI): the same examples every run, drawn from
# each test's own hash. A fresh clone has no example database, so random draws made CI fail at random whenever one
# found a new failing example (HERD's split ILP, session 36). Locally the draws stay random and a failure found is
# kept in .hypothesis/ and replayed. Loaded here, before the test modules: a test's @settings inherits the rest.
# `pytest --hypothesis-profile=default` (or =petals-chain-ci) overrides the choice.
hypothesis_settings.register_profile("petals-chain-ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() not in ("", "0", "false") or os.environ.get(STATUS_FILE_VAR):
    hypothesis_settings.load_profile("petals-chain-ci")

_EXIT_WATCHDOG = """
import os, signal, sys, time
pid, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(1)
os.kill(pid, signal.SIGKILL)
"""


def pytest_report_header(config):
    return f"petals-chain timing: slowdown {measure_slowdown()} vs the quiet reference host (timeouts scale by it)"


def pytest_terminal_summary(terminalreporter):
    scaled_by = (", ".join(f"{w} {s}" for w, s in sorted(_worker_slowdowns.items())) if _worker_slowdowns
                 else measure_slowdown())  # (under xdist the controller's own measurement scaled nothing)
    terminalreporter.write_line(f"petals-chain timing: timeouts scaled by slowdown {scaled_by}")


@pytest.fixture(scope="session")
def slowdown() -> float:
    """See :func:`measure_slowdown`."""
    return measure_slowdown()


@pytest.fixture(scope="session")
def scaled(slowdown) -> Callable[[float], float]:
    """``scaled(seconds)``: a timeout (or a time bound) tuned on the quiet reference host, stretched by the
    measured slowdown; use it instead of a bare constant wherever the machine's load changes the time."""
    return lambda seconds: seconds * slowdown


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


def hf_greedy_from(model_path: Path | str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (``n`` tokens, fp32) of ``prompt`` for the model at ``model_path`` (an HF
    folder, or a GGUF file: transformers' own load of it, ``ModelSource.load_reference``)."""
    import torch

    from petals_chain.swarm.sources import resolve_source

    hf = resolve_source(model_path).load_reference(torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # every prompt token attended: generate would mask ids equal to pad_token_id
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


class ServerProcess:
    """A ``python -m petals_chain.server`` process (forked by :func:`~petals_chain.swarm.launch.launch`); ``stop()``
    sends SIGTERM, ``kill()`` kills the group."""

    def __init__(self, args: list[str], log_path: Path, env: Optional[dict] = None):
        from petals_chain.swarm.launch import launch

        self.log_path = log_path
        log_path.write_bytes(b"")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        full_env.setdefault("PETALS_CHAIN_CACHE_DIR", str(log_path.parent / "cache"))
        self.proc = launch("petals_chain.server", args, log_path=log_path, env=full_env, cwd=REPO_ROOT)
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
        from petals_chain.swarm.launch import kill_role_session

        kill_role_session(self.proc.pid)  # (not torch_shm_manager: it cleans up after itself)
        with_suppress(lambda: self.proc.wait(timeout=10))

    def _reap_group(self) -> None:
        # Anything left in the server's session is ours to kill (its DHT process and p2pd run in a group of their
        # own in it: swarm.dht._DHTProcess), but torch_shm_manager, which unlinks its /dev/shm segments as it exits.
        from petals_chain.swarm.launch import kill_role_session

        kill_role_session(self.proc.pid)


def with_suppress(fn) -> None:
    try:
        fn()
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired, OSError):
        pass


@contextlib.contextmanager
def assigned_server(model: Path, memory_bytes: int, workdir: Path, prefix: str, max_length: int,
                    extra_args: Sequence[str] = (), trust_orchestrator: bool = False) -> Iterator[dict]:
    """One server process assigned blocks [0, 2) by a bare orchestrator DHT node, plus a rogue DHT peer
    (``trust_orchestrator``: the server is started with ``--trust-orchestrator`` naming that node).

    Yields ``dict(orch, rogue, peer, proc)`` once the server's record says ``online``; everything is stopped
    afterwards. For tests of the server's wire protocol against trusted and untrusted peers."""
    from petals_chain.swarm.dht import SwarmDHT
    from petals_chain.swarm.records import AssignmentRecord

    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    rogue = SwarmDHT.create(initial_peers=orch.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    proc = ServerProcess(["--model", str(model), "--initial-peers", *orch.visible_maddrs(), "--host-maddrs",
                          "/ip4/127.0.0.1/tcp/0", "--dht-prefix", prefix, "--memory-bytes", str(memory_bytes),
                          "--assignment-poll-s", "0.3", "--refresh-s", "2", "--tau-p", "0.01", "--no-progress",
                          *extra_args, *(["--trust-orchestrator", orch.peer_id] if trust_orchestrator else [])],
                         workdir / "server.log")
    try:
        peer = proc.wait_peer_id(timeout=180)
        assert orch.publish_assignment(prefix, AssignmentRecord(epoch=1, max_length=max_length,
                                                                orchestrator_peer_id=orch.peer_id,
                                                                assignments={peer: [0, 2]}), 300)
        deadline = time.time() + 90
        while time.time() < deadline:
            rec = orch.fetch_servers(prefix).get(peer)
            if rec is not None and rec.state == "online":
                break
            time.sleep(0.25)
        else:
            raise TimeoutError(proc.log()[-3000:])
        yield dict(orch=orch, rogue=rogue, peer=peer, proc=proc)
    finally:
        proc.kill()
        rogue.shutdown()
        orch.shutdown()


def kill_hop_during(swarm: Any, request: Callable[[], Any], hop: int, *, find_s: float, settle_s: float,
                    join_s: float) -> tuple[Any, dict]:
    """Run ``request()`` in a thread; once a chain of ``swarm`` is serving it, wait ``settle_s`` (some tokens first)
    and SIGKILL the server at hop ``hop`` of that chain. Returns the request's result and that chain (as
    ``/api/v1/swarm`` showed it). The request must hold its chain long enough to be seen: a lasting state."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        future = pool.submit(request)
        chain = None
        deadline = time.monotonic() + find_s
        while chain is None and time.monotonic() < deadline:
            chain = next((ch for ch in swarm.swarm()["chains"] if ch["active"] > 0), None)
            time.sleep(0.02)
        assert chain is not None, "the request never showed up on a chain"
        time.sleep(settle_s)
        swarm.kill_server(chain["names"][hop])
        return future.result(timeout=join_s), chain  # the request's own error, if any, is raised here
    finally:
        pool.shutdown(wait=False)


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


# ---- the real model (SmolLM2-135M-Instruct, fetched by scripts/setup.sh) -------------------------------------
@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2 GGUF file. Missing is a failure, not a skip: CI runs setup.sh, which fetches it."""
    from petals_chain.swarm.registry import ModelNotFetched, registry_path

    try:
        return registry_path("smollm2-135m")
    except ModelNotFetched as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own load of the same GGUF (dequantized, float32): the reference for token-exactness."""
    from petals_chain.swarm.sources import resolve_source

    return resolve_source(smollm2_path).load_reference()
