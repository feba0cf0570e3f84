"""The roles outside this machine's comfortable defaults (session 37's hunt of the environments users run in).

* A standard output nobody reads any more (``| head -1``, ``| grep -m1 /p2p/``, a ``tee`` ended by Ctrl-C): the
  orchestrator exited with "error: [Errno 32] Broken pipe" before serving, the server with a BrokenPipeError traceback
  at its ``PEER_ID`` line, the dashboard with one at its first line, ``fetch --list | head -1`` with one too. They now
  run on (the lines go to ``/dev/null``).
* A working directory deleted since the shell entered it: torch's import died with "Intel oneMKL FATAL ERROR: Cannot
  load libtorch_cpu.so", which reads as a broken install. Each role now says so in one line, exit 2.
* Files this user may not read or write (a volunteer or operator who is not the files' owner): a safetensors shard was
  reported "No such file or directory"; an unreadable ``--ssl-keyfile`` (or a certificate that is no PEM) and a
  ``--ready-file`` in a directory this user cannot write were found only once the orchestrator had loaded its model
  and joined the swarm ("error: [Errno 13] Permission denied", naming no file). Root (CI) runs them with
  CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped (``setpriv``), so that file modes apply to it as to any user.
* ``XDG_CACHE_HOME`` was ignored: the models and caches went to ``~/.cache`` whatever it said.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO_ROOT

TIMEOUT_S = 240


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def _unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` without root's power over file modes: its bounding set loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH,
    so a mode-000 file is unreadable to it as to any other user (a non-root user runs ``cmd`` as it is)."""
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): file modes cannot be made to apply")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *cmd]


def _wait_for(what: str, done, proc, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        code = proc.poll()
        assert code is None, f"exited {code} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


# ---- standard output nobody reads ----


def _launch_unread(module: str, args: list[str], tmp: Path, env: dict | None = None):
    """``python -m module *args`` (as the tests launch roles) whose stdout and stderr are a pipe whose reader has gone:
    every line it writes once started fails with EPIPE, as under ``ROLE 2>&1 | head -1``."""
    from petals_chain.swarm.launch import launch

    fifo = tmp / f"{module}.out"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the role's open for writing waits for a reader
    proc = launch(module, args, log_path=fifo, env=env, cwd=REPO_ROOT)

    def holds_pipe() -> bool:
        try:
            fds = f"/proc/{proc.pid}/fd"
            return any(os.readlink(f"{fds}/{fd}") == str(fifo) for fd in os.listdir(fds))
        except OSError:
            return False

    try:
        _wait_for("the role's open of its output", holds_pipe, proc)
    finally:
        os.close(reader)
    return proc


def _stop(proc) -> int:
    """SIGTERM, its exit status; then what is left in its process group (its resource tracker) goes, as
    ``conftest.ServerProcess.stop`` does."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def unread_orchestrator(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unread-orch")
    ready = tmp / "ready.json"
    proc = _launch_unread("petals_chain.orchestrator", ["--model", str(tiny_model_dir), "--port", "0",
                                                        "--ready-file", str(ready)], tmp)
    try:
        _wait_for("ready file", ready.exists, proc)
        yield proc, json.loads(ready.read_text())
    finally:
        if proc.poll() is None:  # (its stop test was not run) a stop, not a kill: its helper processes go with it
            _stop(proc)


def test_an_orchestrator_whose_output_reader_is_gone_serves_and_stops_cleanly(unread_orchestrator):
    proc, ready = unread_orchestrator
    with urllib.request.urlopen(f"{ready['http_url']}/api/v1/swarm", timeout=30) as r:
        assert r.status == 200
    assert proc.poll() is None


def test_a_dashboard_whose_output_reader_is_gone_serves(unread_orchestrator, tmp_path):
    _, ready = unread_orchestrator
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _launch_unread("petals_chain.dashboard", ["--initial-peers", *ready["initial_peers"], "--port", str(port)],
                          tmp_path)
    try:
        def serves() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/swarm", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait_for("dashboard page", serves, proc)
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_server_whose_output_reader_is_gone_goes_past_its_peer_id_line(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    args = ["--model", str(tiny_model_dir), "--memory-gb", "0.05", "--no-progress"]
    proc = _launch_unread("petals_chain.server", args, tmp_path, env=_env(PETALS_CHAIN_CACHE_DIR=str(cache)))
    try:  # tau_p is measured (and cached) after the PEER_ID line
        _wait_for("tau_p measured", (cache / "tau_p.json").exists, proc)
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_orchestrator_stops_cleanly_with_its_output_reader_gone(unread_orchestrator):
    proc, _ = unread_orchestrator
    assert _stop(proc) == 0  # "Shutting down..." goes nowhere; the stop runs whole


def test_fetch_list_into_a_pipe_closed_early_lists_without_a_traceback():
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "petals_chain.fetch", "--list"], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=TIMEOUT_S, env=_env())
    finally:
        os.close(w)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_the_demo_shows_text_its_locale_cannot_encode_as_escapes():
    """A non-UTF-8 locale (ISO-8859-1 here; PYTHONIOENCODING sets what the locale would): the tiny demo's first answer
    with U+FFFD ended it ("demo failed: 'latin-1' codec can't encode character") before its results were shown. The
    swarm part is replaced by one such line: what the command line sets up around it is the demo's own."""
    script = ("import sys, petals_chain.demo as d\n"
              "d.run_tiny = lambda args: print('answer: \\ufffd caf\\xe9') or 0\n"
              "sys.exit(d.main(['--tiny']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=TIMEOUT_S,
                          env=_env(PYTHONIOENCODING="latin-1"))
    assert proc.returncode == 0 and proc.stdout == "answer: \\ufffd café\n".encode("latin-1"), proc.stderr


# ---- a working directory deleted since the shell entered it ----


@pytest.mark.parametrize("role,args", [("server", ["--model", "x"]), ("orchestrator", ["--model", "x"]),
                                       ("dashboard", ["--initial-peers", "/ip4/127.0.0.1/tcp/1"]),
                                       ("demo", ["--tiny"])])
def test_a_deleted_working_directory_is_one_line(tmp_path, role, args):
    gone = tmp_path / "gone dir é"
    gone.mkdir()
    cmd = ["bash", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "-", str(gone), sys.executable, "-m",
           f"petals_chain.{role}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"error: the working directory of this {role} no longer exists (deleted or moved since the "
                           "shell entered it): cd to an existing directory and start it again\n"), proc.stderr


# ---- files this user may not read or write ----

# One interpreter (torch's import, ~9 s of CPU, paid once) runs each command line's main() in turn as a user the files
# are not readable or writable to; each case's exit status and stderr come back as JSON.
_CASES = r"""
import contextlib, io, json, sys
from petals_chain.orchestrator.__main__ import main as orchestrator
from petals_chain.server.__main__ import main as server
cases, out = json.loads(sys.argv[1]), {}
for name, (role, argv) in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            code = {"orchestrator": orchestrator, "server": server}[role](argv)
        except SystemExit as e:
            code = e.code
    out[name] = [code, err.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def unreadable_runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unreadable files")
    secret = tmp / "secret é"
    secret.mkdir()
    (secret / "not a cert.pem").write_text("not a certificate\n")
    (secret / "key.pem").write_text("a key\n")  # never parsed: it cannot be read
    (secret / "key.pem").chmod(0)
    locked = tmp / "locked dir"
    locked.mkdir(mode=0o555)
    model = tmp / "model é"
    shutil.copytree(tiny_model_dir, model)
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.chmod(0)
    orch = ["--model", str(tiny_model_dir), "--port", "0"]
    cases = {
        "tls_unreadable": ["orchestrator", [*orch, "--ssl-certfile", str(secret / "not a cert.pem"), "--ssl-keyfile",
                                            str(secret / "key.pem")]],
        "tls_not_pem": ["orchestrator", [*orch, "--ssl-certfile", str(secret / "not a cert.pem"), "--ssl-keyfile",
                                         str(secret / "not a cert.pem")]],
        "ready_file": ["orchestrator", [*orch, "--ready-file", str(locked / "ready.json")]],
        "shard": ["server", ["--model", str(model), "--memory-gb", "0.05", "--no-progress"]],
    }
    proc = subprocess.run(_unprivileged([sys.executable, "-c", _CASES, json.dumps(cases)]), capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=tmp, env=_env(PETALS_CHAIN_CACHE_DIR=str(tmp / "c")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout), "secret dir": secret, "locked dir": locked, "shard file": shard}


def test_an_unreadable_tls_key_or_a_certificate_that_is_no_pem_is_refused_before_the_model_loads(unreadable_runs):
    code, err = unreadable_runs["tls_unreadable"]
    key = unreadable_runs["secret dir"] / "key.pem"
    assert code == 2 and f"error: --ssl-keyfile {key} cannot be read (Permission denied)" in err, err
    assert "Loading" not in err
    code, err = unreadable_runs["tls_not_pem"]
    assert code == 2 and "are not a PEM certificate and its private key ([SSL]" in err and "Loading" not in err, err


def test_a_ready_file_in_a_directory_this_user_cannot_write_is_refused_before_the_model_loads(unreadable_runs):
    code, err = unreadable_runs["ready_file"]
    assert code == 2, err
    ready = unreadable_runs["locked dir"] / "ready.json"
    assert f"--ready-file {ready}: its directory is not writable by this user" in err
    assert "Loading" not in err


def test_an_unreadable_safetensors_shard_is_named_as_unreadable(unreadable_runs):
    code, err = unreadable_runs["shard"]
    assert code == 2 and f"error: [Errno 13] Permission denied: '{unreadable_runs['shard file']}'\n" in err, err
    assert "No such file" not in err



# ---- XDG_CACHE_HOME ----


def test_xdg_cache_home_holds_the_models_and_caches(monkeypatch, tmp_path):
    from petals_chain.swarm.registry import REGISTRY, cache_dir, models_dir, registry_path

    for var in ("PETALS_CHAIN_CACHE_DIR", "PETALS_CHAIN_MODELS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "petals-chain"
    assert models_dir() == tmp_path / "xdg" / "petals-chain" / "models"
    # a model fetched before XDG_CACHE_HOME was followed is still found where it is
    name, entry = next(iter(sorted(REGISTRY.items())))
    legacy = tmp_path / "home" / ".cache" / "petals-chain" / "models" / entry.filename
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"")
    assert registry_path(name) == legacy
    (tmp_path / "xdg" / "petals-chain" / "models").mkdir(parents=True)
    (tmp_path / "xdg" / "petals-chain" / "models" / entry.filename).write_bytes(b"")
    assert registry_path(name) == tmp_path / "xdg" / "petals-chain" / "models" / entry.filename
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG rule says
    assert cache_dir() == tmp_path / "home" / ".cache" / "petals-chain"
