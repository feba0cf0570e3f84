"""Files the roles leave in the temporary directory (session 40).

* hivemind 1.1.12 names p2pd's unix sockets ``/tmp/hivemind-p2pd-*.sock`` and ``/tmp/hivemind-p2pclient-*.sock``
  whatever ``TMPDIR`` says, while torch (``torch-shm-dir-*``) and multiprocessing (``pymp-*``) honour it: a role
  SIGKILLed (no handler of theirs runs) left its pair in ``/tmp``, out of reach of a private ``TMPDIR`` (systemd's
  ``PrivateTmp=``, the test session's own folder). ``swarm.dht.use_temp_dir_for_p2p_sockets`` puts them in ``TMPDIR``.
* A role stopped gracefully (SIGTERM, Ctrl-C) must leave nothing there.
* The test session gives its processes a folder of its own as ``TMPDIR`` (conftest), removed at its end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import REPO_ROOT, SESSION_TMPDIR_PREFIX

from petals_chain.swarm.local import memory_for, signal_role


def _start(module: str, args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """``python -m module *args`` in a session of its own, as a volunteer or an operator starts it."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT, start_new_session=True)


def _wait(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


def _family(pids: list[int]) -> set[int]:
    import psutil

    out = set(pids)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return out


def _segments(pids: set[int], before: set[str]) -> list[str]:
    """torch's /dev/shm segments (``torch_{creator pid}_...``) made by one of ``pids`` since ``before`` (a pid's
    number may have served a process before, whose segment another test left)."""
    return sorted(n for n in set(os.listdir("/dev/shm")) - before
                  if n.startswith("torch_") and n.split("_")[1].isdigit() and int(n.split("_")[1]) in pids)


def _assert_cleaned_up(folder: Path, pids: set[int], shm_before: set[str], wait_s: float, prefix: str = "") -> None:
    """Nothing (whose name starts with ``prefix``) left in ``folder`` nor in /dev/shm by ``pids`` once
    torch_shm_manager has had ``wait_s`` to leave (it removes its folder and segments 2 s after its last client has
    gone)."""
    def left() -> list[str]:
        return [n for n in _left(folder) if n.startswith(prefix)]

    deadline = time.monotonic() + wait_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []
    assert _segments(pids, shm_before) == []


def _left(folder: Path) -> list[str]:
    # torch's compile cache (torchinductor_<user>): one folder per user, reused by every process, made at import
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


def test_roles_put_p2pd_sockets_in_tmpdir_and_leave_nothing_there_on_sigterm_or_ctrl_c(tiny_model_dir, tmp_path,
                                                                                        scaled):
    """An orchestrator and a server started with ``python -m`` and a TMPDIR of their own: their p2pd sockets are made
    in it (they were in /tmp), and once the server is stopped by Ctrl-C (SIGINT to its process group) and the
    orchestrator by SIGTERM, it holds nothing of theirs (nor /dev/shm a torch segment of theirs)."""
    # short: the sockets' paths must fit sun_path (a tmp_path is too long, and swarm.dht would keep /tmp)
    folder = Path(tempfile.mkdtemp(prefix="s40-"))
    env = dict(os.environ, TMPDIR=str(folder), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PETALS_CHAIN_CACHE_DIR=str(tmp_path / "cache"))
    ready, orch_log, server_log = tmp_path / "ready.json", tmp_path / "orchestrator.log", tmp_path / "server.log"
    procs: list[subprocess.Popen] = []
    shm_before = set(os.listdir("/dev/shm"))
    try:
        orch = _start("petals_chain.orchestrator", ["--model", str(tiny_model_dir), "--port", "0", "--max-length",
                                                    "64", "--ready-file", str(ready), "--settle-s", "0.5"],
                      orch_log, env)
        procs.append(orch)
        _wait(ready.exists, scaled(120), "the orchestrator", orch_log)
        import json

        peers = json.loads(ready.read_text())["initial_peers"]
        server = _start("petals_chain.server", ["--model", str(tiny_model_dir), "--initial-peers", *peers,
                                                "--memory-bytes", str(memory_for(tiny_model_dir, 2048, 4, 2)),
                                                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--tau-p", "0.01",
                                                "--no-progress"], server_log, env)
        procs.append(server)
        _wait(lambda: "-> online" in server_log.read_text(errors="replace"), scaled(120), "the server online",
              server_log)
        pids = _family([orch.pid, server.pid])
        sockets = [n for n in os.listdir(folder) if n.startswith("hivemind-p2pd-") and n.endswith(".sock")]
        assert len(sockets) == 2, (sockets, os.listdir(folder))  # one p2pd per role, each in TMPDIR

        os.killpg(server.pid, signal.SIGINT)  # a terminal's Ctrl-C
        assert server.wait(timeout=scaled(60)) == 0, server_log.read_text(errors="replace")[-3000:]
        orch.send_signal(signal.SIGTERM)
        assert orch.wait(timeout=scaled(60)) == 0, orch_log.read_text(errors="replace")[-3000:]
        _assert_cleaned_up(folder, pids, shm_before, scaled(15))
    finally:
        for proc in procs:
            if proc.poll() is None:
                signal_role(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_session_gives_its_processes_a_temporary_folder_of_its_own():
    """conftest: this process's and its children's temporary directory is the session's folder (removed at the
    session's end), and hivemind's sockets of a DHT node started here go in it."""
    from hivemind.p2p import P2P

    from petals_chain.swarm import dht

    folder = tempfile.gettempdir()
    assert os.path.basename(folder).startswith(SESSION_TMPDIR_PREFIX) and os.environ["TMPDIR"] == folder
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], env=os.environ,
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == folder
    assert dht.use_temp_dir_for_p2p_sockets() == P2P._UNIX_SOCKET_PREFIX == f"/unix{folder}/hivemind-"


def test_a_temporary_directory_too_long_for_a_unix_socket_keeps_tmp(monkeypatch):
    """A folder whose socket paths would not fit sun_path (104 bytes with macOS) keeps hivemind's /tmp."""
    from petals_chain.swarm import dht

    try:
        monkeypatch.setattr(tempfile, "tempdir", "/" + "d" * 67)  # /ddd.../hivemind-p2pclient-{11}.sock: 104 bytes
        assert dht.use_temp_dir_for_p2p_sockets() == "/unix/tmp/hivemind-"
        monkeypatch.setattr(tempfile, "tempdir", "/" + "d" * 66)  # 103 bytes and the NUL
        assert dht.use_temp_dir_for_p2p_sockets() == "/unix/" + "d" * 66 + "/hivemind-"
        monkeypatch.setattr(tempfile, "tempdir", "/tmp/with space")  # not a path a multiaddr keeps as it is
        assert dht.use_temp_dir_for_p2p_sockets() == "/unix/tmp/hivemind-"
    finally:
        monkeypatch.undo()
        dht.use_temp_dir_for_p2p_sockets()


def test_a_local_swarm_stopped_lets_torch_shm_manager_clean_up(tiny_model_dir, scaled):
    """LocalSwarm (the demo's, the scripts') SIGKILLed each role's process group once the role had stopped, and with
    it torch_shm_manager, which was to exit 2 s later by itself: each role left a ``torch-shm-dir-*`` folder (its
    socket in it) in TMPDIR and its ``/dev/shm/torch_*`` segments. The swarm now spares it; it cleans up."""
    from petals_chain.swarm.local import LocalServer, LocalSwarm

    folder = Path(tempfile.mkdtemp(prefix="s40-"))
    shm_before = set(os.listdir("/dev/shm"))
    try:
        with LocalSwarm(tiny_model_dir, [LocalServer("a", memory_for(tiny_model_dir, 256, 4, 2), tau_p=0.01)],
                        max_length=256, env={"TMPDIR": str(folder)}) as sw:
            sw.wait_ready(timeout=scaled(120))
            pids = _family([sw.orchestrator.popen.pid, *(p.popen.pid for p in sw.servers.values())])
            assert any(n.startswith("torch-shm-dir-") for n in os.listdir(folder))  # (the roles made theirs here)
        assert sw.leftover_processes() == []
        _assert_cleaned_up(folder, pids, shm_before, scaled(15))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_role_killed_with_signal_role_lets_torch_shm_manager_clean_up(tiny_model_dir, tmp_path, scaled):
    """signal_role(pid, SIGKILL) (a lost host, in tests and scripts) killed torch_shm_manager with the role's group:
    its folder and /dev/shm segments stayed. p2pd's sockets and multiprocessing's folder stay (no handler runs)."""
    folder = Path(tempfile.mkdtemp(prefix="s40-"))
    ready, log = tmp_path / "ready.json", tmp_path / "orchestrator.log"
    env = dict(os.environ, TMPDIR=str(folder), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    shm_before = set(os.listdir("/dev/shm"))
    orch = _start("petals_chain.orchestrator", ["--model", str(tiny_model_dir), "--port", "0", "--ready-file",
                                                str(ready)], log, env)
    try:
        _wait(ready.exists, scaled(120), "the orchestrator", log)
        pids = _family([orch.pid])
        assert any(n.startswith("torch-shm-dir-") for n in os.listdir(folder))
        signal_role(orch.pid, signal.SIGKILL)
        assert orch.wait(timeout=scaled(30)) == -signal.SIGKILL
        # (p2pd's sockets and multiprocessing's folder stay: no handler runs)
        _assert_cleaned_up(folder, pids, shm_before, scaled(15), prefix="torch-shm-dir-")
    finally:
        if orch.poll() is None:
            signal_role(orch.pid, signal.SIGKILL)
            orch.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


_LEFT_RUNNING = """
import os, sys, time
import psutil
from petals_chain.swarm.launch import launch
model, ready, log, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
role = launch("petals_chain.orchestrator", ["--model", model, "--port", "0", "--ready-file", ready], log_path=log)
deadline = time.monotonic() + timeout
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.2)
print(" ".join(str(p) for p in [role.pid, *(c.pid for c in psutil.Process(role.pid).children(recursive=True))]))
print(" ".join(n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("torch-shm-dir-")))
"""  # (exits with the role running: launch's exit handler stops it)


def test_a_role_left_running_at_exit_lets_torch_shm_manager_clean_up(tiny_model_dir, tmp_path, scaled):
    """launch's exit handler (roles still running when the process that launched them exits: a script that
    crashed) SIGKILLed each role's process group, torch_shm_manager with it: its folder and segments stayed."""
    folder = Path(tempfile.mkdtemp(prefix="s40-"))
    ready, log = tmp_path / "ready.json", tmp_path / "orchestrator.log"
    env = dict(os.environ, TMPDIR=str(folder), PETALS_CHAIN_LAUNCH="fork", OMP_NUM_THREADS="1")
    shm_before = set(os.listdir("/dev/shm"))
    try:
        out = subprocess.run([sys.executable, "-c", _LEFT_RUNNING, str(tiny_model_dir), str(ready), str(log),
                              str(scaled(120))], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=scaled(180))
        assert out.returncode == 0 and ready.exists(), out.stderr[-3000:] + log.read_text(errors="replace")[-3000:]
        family, made = (out.stdout.splitlines() + ["", ""])[:2]
        pids = {int(p) for p in family.split()}
        assert made.startswith("torch-shm-dir-"), out.stdout  # (the role made its folder there, before the exit)
        _assert_cleaned_up(folder, pids, shm_before, scaled(15), prefix="torch-shm-dir-")  # (SIGKILL: as above)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
