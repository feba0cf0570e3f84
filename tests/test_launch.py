"""``launch``: a role forked from the fork server behaves as ``python -m`` would (argv, env, cwd, own session, log,
exit code), and can be signalled and killed with its group; ``PETALS_CHAIN_LAUNCH=exec`` starts a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from petals_chain.swarm import launch as launch_mod
from petals_chain.swarm.launch import ForkedProcess, launch

TESTS = str(Path(__file__).resolve().parent)


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_launched_module_runs_as_python_dash_m(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_LAUNCH", mode)
    log = tmp_path / "probe.log"
    # (a TMPDIR of its own: a forked role made its temporary files where the fork server's TMPDIR said)
    env = {**os.environ, "LAUNCH_PROBE": "42", "PYTHONPATH": TESTS, "TMPDIR": str(tmp_path)}
    proc = launch("launch_probe", ["a", "--b", "c d"], log_path=log, env=env, cwd=tmp_path)
    assert isinstance(proc, ForkedProcess) == (mode == "fork")
    assert proc.wait(timeout=120) == 3 and proc.returncode == 3 and proc.poll() == 3
    first, second = log.read_text().splitlines()[:2]
    seen = json.loads(first)
    assert seen == {"argv": ["a", "--b", "c d"], "cwd": str(tmp_path), "probe": "42", "leader": True,
                    "main": "__main__", "tmpdir": str(tmp_path)}
    assert second == "to stderr"


def test_signal_wait_timeout_and_group_kill(tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_LAUNCH", "fork")
    proc = launch("launch_probe", ["sleep"], log_path=tmp_path / "log", env={**os.environ, "PYTHONPATH": TESTS})
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)  # its own process group, as start_new_session gives
    assert proc.wait(timeout=60) == -signal.SIGTERM
    proc.send_signal(signal.SIGKILL)  # no-op once it has exited
    assert proc not in launch_mod._live


def test_a_role_killed_holding_a_hivemind_lock_does_not_block_the_next_role(tmp_path, monkeypatch):
    """hivemind's process-wide locks are created at import, in the fork server: each role gets its own, else one
    killed while holding one blocks every later role's DHT process (an orchestrator hung at start in CI)."""
    import time

    monkeypatch.setenv("PETALS_CHAIN_LAUNCH", "fork")
    env = {**os.environ, "PYTHONPATH": TESTS}
    holder = launch("launch_probe", ["hold-hivemind-lock"], log_path=tmp_path / "holder", env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "holder").exists() or "holding" not in (tmp_path / "holder").read_text():
        assert time.monotonic() < deadline and holder.poll() is None
        time.sleep(0.05)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    user = launch("launch_probe", ["mpfuture"], log_path=tmp_path / "user", env=env)
    assert user.wait(timeout=120) == 3
    assert "result 42" in (tmp_path / "user").read_text()


def test_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_LAUNCH", "thread")
    with pytest.raises(ValueError, match="PETALS_CHAIN_LAUNCH"):
        launch_mod.launch_mode()
    monkeypatch.setenv("PETALS_CHAIN_LAUNCH", "exec")
    assert launch_mod.launch_mode() == "exec"


def test_fork_is_the_default(monkeypatch):
    monkeypatch.delenv("PETALS_CHAIN_LAUNCH", raising=False)
    assert launch_mod.launch_mode() == "fork"


def test_sigterm_unwinds_a_local_swarm_like_ctrl_c(monkeypatch, tmp_path):
    """``timeout`` or ``kill`` ended a benchmark script at once and left its swarm running (an orchestrator and a
    server found idle minutes later): inside ``with LocalSwarm`` a SIGTERM now unwinds it, so it is stopped."""
    from petals_chain.swarm.local import LocalSwarm

    calls = []
    monkeypatch.setattr(LocalSwarm, "start", lambda self, timeout=120.0: calls.append("start") or self)
    monkeypatch.setattr(LocalSwarm, "stop", lambda self, server_timeout=5.0: calls.append("stop"))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with LocalSwarm(str(tmp_path), log_dir=str(tmp_path)):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert e.value.code == 128 + signal.SIGTERM and calls == ["start", "stop"]
    assert signal.getsignal(signal.SIGTERM) is before  # restored
