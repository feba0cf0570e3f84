"""Start a role (``python -m petals_chain.server ...``, ``... .orchestrator ...``) as a process on this machine, fast.

A role's imports (torch, transformers' modeling code, hivemind) cost about 9 s of CPU per process on a 2-core
host, and a swarm on one machine (the demo, :class:`~petals_chain.swarm.local.LocalSwarm`, the tests, the
benchmarks) starts dozens of them. :func:`launch` forks each process from a multiprocessing *fork server* that
imported those modules once, then runs the module exactly as ``python -m`` does (:func:`runpy.run_module` as
``__main__``, ``sys.argv`` set), in a new session (its own process group, like ``start_new_session``), with the
given environment, working directory and log file as stdout and stderr.

The fork server is the default (the test suite runs in about two thirds of the time); ``PETALS_CHAIN_LAUNCH=exec``
starts a fresh interpreter instead, as does a platform without the fork server. Both return an object with
Popen's ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill`` (a
:class:`subprocess.Popen` with ``exec``). Volunteers and operators start roles with ``python -m`` as before;
this only changes how a local swarm starts its processes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from petals_chain.swarm.process_locks import install_robust_hivemind_locks

logger = logging.getLogger(__name__)

# Open files a role needs to start and serve a little (measured: an idle orchestrator holds ~21, a server ~30; each
# HTTP connection, P2P stream and session takes one more): below, a role is refused at start, naming ``ulimit -n``.
MIN_OPEN_FILES = 128
# Open files kept for what is not an HTTP connection (log files, pipes, the DHT's and torch's descriptors)
RESERVED_OPEN_FILES = 64
# Raised to at most this: select()-based code cannot take descriptors past 1024, others need no more
MAX_RAISED_OPEN_FILES = 1 << 16
# macOS refuses a soft limit over OPEN_MAX (10240) even under an unlimited hard one: raised to it instead
OPEN_MAX_MACOS = 10240
# How often "out of descriptors" is logged while it lasts (seconds)
EXHAUSTED_LOG_S = 60.0

# Imported once by the fork server; each name is optional (a missing one is skipped by multiprocessing).
PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen2.modeling_qwen2",
    "hivemind",
    "petals_chain.server.server",
    "petals_chain.orchestrator.core",
    "petals_chain.orchestrator.api",
)

_lock = threading.Lock()
_context: Any = None
_live: "set[ForkedProcess]" = set()


def launch_mode() -> str:
    """``fork`` (the fork server, the default where the platform has one) or ``exec`` (a fresh interpreter):
    ``PETALS_CHAIN_LAUNCH``."""
    mode = os.environ.get("PETALS_CHAIN_LAUNCH", "fork").strip().lower()
    if mode not in ("fork", "exec"):
        raise ValueError(f"PETALS_CHAIN_LAUNCH must be 'fork' or 'exec', got {mode!r}")
    if mode == "fork" and "forkserver" not in multiprocessing.get_all_start_methods():
        return "exec"
    return mode


def _fork_context() -> Any:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            atexit.register(_stop_all)  # runs before multiprocessing's own exit handler, which would join them
            _context = ctx
        return _context


def _run_role(module: str, args: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become ``python -m module *args`` with ``env``, ``cwd`` and the log as stdio."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # unbuffered as with PYTHONUNBUFFERED: the log is read while the role runs
            stream.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    # the fork server's (cached at its first use) is not this role's: its temporary files went to the folder the
    # fork server's TMPDIR named, while torch's went to this role's
    tempfile.tempdir = None
    os.chdir(cwd)
    _own_resource_tracker()
    _own_hivemind_locks()
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        # The fork server's torch read its own environment at import; apply this process's thread count.
        sys.modules["torch"].set_num_threads(max(1, int(threads)))
    import runpy

    sys.argv = ["-m", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # a forked child leaves through os._exit: run what the interpreter would at exit


def _own_hivemind_locks() -> None:
    """Give this role hivemind's process-wide locks of its own, ones its death releases.

    hivemind creates them (``mp.Lock()``, a semaphore shared with every process forked afterwards) when it is
    imported, here in the fork server, so without this every role of every swarm would share one lock for all
    their DHT result pipes: a role SIGKILLed while holding it (tests kill servers mid-run) leaves it held forever,
    and the next role's DHT process blocks for good sending its first result (seen in CI: an orchestrator that
    never got past starting its DHT, in two tests in a row). See :mod:`petals_chain.swarm.process_locks`."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # this process's own result pipe and backend thread, on first use
    install_robust_hivemind_locks()


def _own_resource_tracker() -> None:
    """Leave the launching process's multiprocessing resource tracker (inherited through the fork server): the role
    starts its own when it needs one, in its own process group, as a fresh interpreter would. Else semaphores of a
    role killed with its group are reported as leaked by the launcher at exit."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(tracker, "_fd", None)
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass
    tracker._fd = None
    tracker._pid = None


class ForkedProcess:
    """A role forked from the fork server, with the part of :class:`subprocess.Popen`'s interface we use."""

    def __init__(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str):
        self.args = [module, *args]
        self._proc = _fork_context().Process(target=_run_role, args=(module, list(args), dict(env), cwd, log_path),
                                             name=f"petals-chain {module}")
        self._proc.start()
        self.pid: int = self._proc.pid
        _live.add(self)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self._proc.exitcode
        if code is not None:
            _live.discard(self)
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Launched = Union[ForkedProcess, subprocess.Popen]


def launch(module: str, args: Sequence[str], *, log_path: Union[str, Path], env: Mapping[str, str] | None = None,
           cwd: Union[str, Path, None] = None, python: str = sys.executable) -> Launched:
    """Start ``python -m module *args`` in a new session, stdout and stderr appended to ``log_path``.

    ``env``: the whole environment (default: this one); ``cwd``: default this one. ``python``: the interpreter
    for ``exec`` mode; a different interpreter than this one also means ``exec``."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    if launch_mode() == "fork" and python == sys.executable:
        return ForkedProcess(module, args, env, cwd, str(log_path))
    log = open(log_path, "ab")
    try:
        return subprocess.Popen([python, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    finally:
        log.close()  # the child holds its own copy


def raise_open_files_limit(role: str, needed: int = MIN_OPEN_FILES) -> int:
    """Raise this process's soft open-files limit (RLIMIT_NOFILE) to its hard limit (at most
    :data:`MAX_RAISED_OPEN_FILES`, else :data:`OPEN_MAX_MACOS` when that is refused, as macOS does) and return it.
    Distributions and containers start processes at a soft 1024 (sometimes 256) under a far higher hard limit: each
    HTTP connection and P2P stream takes a descriptor, and a role out of them failed its P2P calls and banned every
    server. ``ValueError`` (naming ``ulimit -n`` and ``needed``) when even the hard limit is under ``needed``: the
    role is refused at start rather than failing once loaded."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_RAISED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_RAISED_OPEN_FILES)
    for tried in dict.fromkeys((target, min(target, OPEN_MAX_MACOS))):
        if soft == resource.RLIM_INFINITY or soft >= tried:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (tried, hard))
            soft = tried
            break
        except (ValueError, OSError) as e:  # macOS over OPEN_MAX (tried again at it), a sandbox: checked below
            logger.debug("could not raise the open-files limit from %d to %d: %s", soft, tried, e)
    limit = MAX_RAISED_OPEN_FILES if soft == resource.RLIM_INFINITY else int(soft)
    if limit < needed:
        advised = max(needed, 4096)
        raise ValueError(f"the open-files limit is {limit} (ulimit -n; hard limit {_shown_limit(hard)}): the {role} "
                         f"needs at least {needed}. Raise it: ulimit -n {advised} before starting it (docker: "
                         f"--ulimit nofile={advised}; systemd: LimitNOFILE={advised})")
    return limit


def check_shared_memory(role: str) -> None:
    """ValueError naming ``/dev/shm`` when this process cannot create a semaphore there. multiprocessing's locks
    (hivemind makes some at import, its DHT process more) and torch's shared tensors live in ``/dev/shm``: when it is
    full (or not writable), a role died at import with a 47-line traceback ending in "OSError: [Errno 28] No space
    left on device", naming neither ``/dev/shm`` nor a remedy."""
    import multiprocessing

    try:
        multiprocessing.get_context().Lock()  # released at once: its name was unlinked when it was made
    except OSError as e:
        raise ValueError(f"the {role} cannot create a semaphore in /dev/shm ({e.strerror or e}): multiprocessing, "
                         f"hivemind and torch keep their locks and shared tensors there. Free some space in it "
                         f"(df -h /dev/shm) or give it more (docker: --shm-size=64m)") from None


def _shown_limit(value: int) -> str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from, e.g. the OSError under hivemind's or our RPC's
    ConnectionError) is this process running out of open files (EMFILE, or the system's: ENFILE): a local failure
    that says nothing of the peer it was talking to."""
    seen: set = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def quiet_descriptor_exhaustion(loop: asyncio.AbstractEventLoop, limit: int,
                                period_s: float = EXHAUSTED_LOG_S) -> None:
    """Log asyncio's "socket.accept() out of system resource" (out of descriptors or memory) once per ``period_s``
    with how often it happened, instead of once per try with a traceback: Python's accept loop logs it for each of
    the listener's backlog (2048 under uvicorn) every second it lasts (43,000 log lines in 8 s of an orchestrator
    at its limit). asyncio itself retries the accept a second later: the role recovers when descriptors free up.
    Anything else reaches the previous handler."""
    previous = loop.get_exception_handler()
    state = {"last": -float("inf"), "count": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            state["count"] += 1
            now = loop.time()
            if now - state["last"] >= period_s:
                logger.warning("out of open files or memory (%s): %d failed accept(s) since the last warning; new "
                               "connections wait in the listen backlog, accepted once descriptors free up. The "
                               "open-files limit is %d: raise it (ulimit -n) if this recurs",
                               context.get("exception"), state["count"], limit)
                state["last"], state["count"] = now, 0
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def descendants(pid: int) -> list[Any]:
    """All descendants of ``pid`` as psutil processes (empty if psutil is missing or the process is gone): killed
    later through them, a pid that a new process took meanwhile is left alone (psutil checks its start time)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - best effort; killpg covers the usual case
        return []


def _is_shm_manager(proc: Any) -> bool:
    try:
        return proc.name() == "torch_shm_manager"
    except Exception:  # noqa: BLE001 - gone: nothing to spare
        return False


def kill_role_session(sid: int, children: Optional[Sequence[Any]] = None) -> None:
    """SIGKILL the role ``sid`` first (it starts nothing more), then every other process of its session (it is the
    leader) and its descendants ``children`` (default: found now, before it goes; afterwards they are no longer
    its children), but torch_shm_manager. hivemind's futures share memory through it (file_system strategy); it exits
    by itself 2 s after its last client (the role, its DHT process) has gone, unlinking its ``/dev/shm/torch_*``
    segments and removing its ``TMPDIR/torch-shm-dir-*``. Killed with the role's group, it left both behind, each
    time a swarm stopped (the demo's, a script's: one of each per role, even after a clean stop)."""
    import psutil

    if children is None:
        children = descendants(sid)
    for _ in range(2):  # (a process forked meanwhile by one being killed is found the second time)
        members = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid:
                    members.append(p)
            except (OSError, psutil.Error):
                continue
        members.sort(key=lambda p: p.pid != sid)  # the leader first
        for p in [*members, *children]:
            if not _is_shm_manager(p):
                with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                    p.kill()


def _stop_all() -> None:
    """At exit, roles still running are killed with their sessions and descendants (a role must not outlive the
    swarm that started it, and multiprocessing would otherwise wait for it), torch_shm_manager excepted
    (:func:`kill_role_session`). Its DHT process and p2pd run in a group of their own (see
    ``swarm.dht._DHTProcess``): they would stop by themselves once the role is gone, but not before this process
    exits."""
    for proc in list(_live):
        if proc.poll() is None:
            kill_role_session(proc.pid)
            proc._proc.join(5)
