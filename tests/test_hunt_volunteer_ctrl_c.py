"""A signal to a role's whole process group (a terminal's Ctrl-C, ``kill -TERM -PGID``) reached its DHT process and
p2pd too: SIGTERM killed the DHT node before the server could announce ``offline`` (the record stayed ``online``
until it expired), SIGINT reached p2pd (closing under the orchestrator, whose DHT node then failed to stop and was
killed after its grace period). The DHT process (and so p2pd) now runs in a process group of its own and stops when
the role that started it is gone (a SIGKILL of the role alone left both running)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from conftest import ServerProcess
from petals_chain.swarm.records import AssignmentRecord

PREFIX = "ctrlc"


def _dht_and_p2pd(role_pid: int) -> list[psutil.Process]:
    """The role's DHT process and its p2pd (the parent of each p2pd below the role)."""
    p2pds = [p for p in psutil.Process(role_pid).children(recursive=True) if p.name() == "p2pd"]
    return [*(p.parent() for p in p2pds), *p2pds]


def test_a_signal_to_the_servers_group_leaves_it_time_to_announce_offline(tiny_model_dir, orchestrator_dht, tmp_path,
                                                                           scaled):
    orch = orchestrator_dht
    proc = ServerProcess(["--model", str(tiny_model_dir), "--initial-peers", *orch.visible_maddrs(), "--host-maddrs",
                          "/ip4/127.0.0.1/tcp/0", "--dht-prefix", PREFIX, "--memory-bytes", "50000000",
                          "--assignment-poll-s", "0.3", "--refresh-s", "2", "--tau-p", "0.01", "--no-progress"],
                         tmp_path / "server.log")
    try:
        peer = proc.wait_peer_id(timeout=scaled(120))
        assert orch.publish_assignment(PREFIX, AssignmentRecord(
            epoch=1, max_length=64, orchestrator_peer_id=orch.peer_id, assignments={peer: [0, 2]}), 300)
        _wait_state(orch, peer, "online", scaled(90), proc)
        dht = _dht_and_p2pd(proc.proc.pid)
        assert len(dht) == 2, dht
        assert {os.getpgid(p.pid) for p in dht} == {dht[0].pid}  # out of the group a terminal's Ctrl-C reaches
        assert {os.getsid(p.pid) for p in dht} == {proc.proc.pid}  # in its session: LocalSwarm finds leftovers
        os.killpg(proc.proc.pid, signal.SIGTERM)  # as Ctrl-C does with SIGINT: the whole group
        assert proc.proc.wait(timeout=scaled(60)) == 0, proc.log()[-3000:]
        assert "DHT process is gone" not in proc.log()
        assert orch.fetch_servers(PREFIX)[peer].state == "offline", proc.log()[-3000:]
        assert not psutil.wait_procs(dht, timeout=10)[1]
    finally:
        proc.kill()


def _wait_state(orch, peer: str, state: str, timeout: float, proc: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while (rec := orch.fetch_servers(PREFIX).get(peer)) is None or rec.state != state:
        assert time.monotonic() < deadline, proc.log()[-3000:]
        time.sleep(0.25)


def test_a_role_killed_alone_takes_its_dht_process_and_p2pd_along(tmp_path, scaled):
    """SIGKILL of the role's process only (the OOM killer, ``kill -9 PID``; a killpg no longer reaches the DHT)."""
    from petals_chain.swarm.launch import launch

    log = tmp_path / "role.log"
    role = launch("test_hunt_volunteer_ctrl_c", ["role"], log_path=log,
                  env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + scaled(60)
        while not (line := next((t for t in _lines(log) if t.startswith("DHT ")), None)):
            assert role.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        procs = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert len(procs) == 2  # the DHT process and its p2pd
        os.kill(role.pid, signal.SIGKILL)
        role.wait(10)
        assert not psutil.wait_procs(procs, timeout=15)[1], log.read_text()
    finally:
        role.kill()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


if __name__ == "__main__":  # the role of the test above, started by launch()
    from petals_chain.swarm.dht import SwarmDHT

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print("DHT", sd.dht.pid, *(p.pid for p in sd._daemons), flush=True)
    time.sleep(600)
