"""Process lifecycle of a role: its DHT process killed under it, SIGHUP, a systemd ``KillMode=mixed`` stop.

* A role whose DHT process was killed (``kill -9``, the OOM killer) kept running as a member nobody sees: every
  record publish and assignment read failed ("Broken pipe", timeouts) for ever, and its supervisor never restarted
  it. The server now stops and exits 1 saying why.
* SIGHUP (the server's terminal closed, its ssh session ended) ended the server at once, without its ``offline``
  record; it now stops as SIGTERM does (unless ignored: ``nohup``).
* systemd's ``KillMode=mixed``: SIGTERM to the server's own process, SIGKILL to what is left once it has exited.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil

from conftest import ServerProcess
from petals_chain.swarm.dht import SwarmDHT, on_dht_lost
from petals_chain.swarm.records import AssignmentRecord

PREFIX = "s31proc"


def test_a_dht_process_killed_under_its_role_is_reported_and_a_shutdown_is_not(scaled):
    lost: list[SwarmDHT] = []
    on_dht_lost(lost.append)
    sd = other = None
    try:
        sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        other = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        other.shutdown()
        other._watch.join(scaled(10))
        os.kill(sd.dht.pid, signal.SIGKILL)
        sd._watch.join(scaled(10))
        assert lost == [sd] and sd.lost and not other.lost
        daemons = sd._daemons
        sd.shutdown()
        assert not psutil.wait_procs(daemons, timeout=scaled(10))[1]  # its p2pd too
    finally:
        on_dht_lost(None)
        for node in (sd, other):
            if node is not None:
                node.shutdown()


class _FakeServer:
    """What ``server.__main__._serve`` needs of a Server: ``run()`` and ``_on_signal()``."""

    def __init__(self, wait_s: float) -> None:
        self.signals, self.wait_s = 0, wait_s

    def _on_signal(self) -> None:
        self.signals += 1
        self._stop.set()

    async def run(self) -> int:
        self._stop = asyncio.Event()
        signal.raise_signal(signal.SIGHUP)
        try:
            await asyncio.wait_for(self._stop.wait(), self.wait_s)
        except asyncio.TimeoutError:
            pass
        return 0


def test_sighup_stops_the_server_as_sigterm_does_unless_nohup():
    from petals_chain.server.__main__ import _serve

    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's server: SIGHUP's default ended it at once
        fake = _FakeServer(wait_s=60.0)
        assert asyncio.run(_serve(fake)) == 0 and fake.signals == 1
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # under nohup: still ignored
        fake = _FakeServer(wait_s=0.5)
        assert asyncio.run(_serve(fake)) == 0 and fake.signals == 0
    finally:
        signal.signal(signal.SIGHUP, before)


def _start_online_server(model, orch: SwarmDHT, tmp_path, scaled) -> tuple[ServerProcess, str]:
    proc = ServerProcess(["--model", str(model), "--initial-peers", *orch.visible_maddrs(),
                          "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--dht-prefix", PREFIX, "--memory-bytes",
                          "50000000", "--assignment-poll-s", "0.3", "--refresh-s", "2", "--tau-p", "0.01",
                          "--no-progress"], tmp_path / "server.log")
    try:
        peer = proc.wait_peer_id(timeout=scaled(120))
        assert orch.publish_assignment(PREFIX, AssignmentRecord(
            epoch=1, max_length=64, orchestrator_peer_id=orch.peer_id, assignments={peer: [0, 2]}), 300)
        deadline = time.monotonic() + scaled(90)
        while (rec := orch.fetch_servers(PREFIX).get(peer)) is None or rec.state != "online":
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.25)
    except BaseException:
        proc.kill()
        raise
    return proc, peer


def _dht_process(role_pid: int) -> psutil.Process:
    """The role's DHT process: the parent of its p2pd."""
    return next(p for p in psutil.Process(role_pid).children(recursive=True) if p.name() == "p2pd").parent()


def test_a_server_whose_dht_process_is_killed_exits_1_and_leaves_nothing(tiny_model_dir, orchestrator_dht,
                                                                        tmp_path, scaled):
    proc, _ = _start_online_server(tiny_model_dir, orchestrator_dht, tmp_path, scaled)
    try:
        left = psutil.Process(proc.proc.pid).children(recursive=True)
        _dht_process(proc.proc.pid).kill()
        assert proc.proc.wait(timeout=scaled(60)) == 1, proc.log()[-3000:]
        assert "the server's DHT process died" in proc.log()
        assert not psutil.wait_procs(left, timeout=scaled(10))[1]
    finally:
        proc.kill()


def test_a_systemd_mixed_stop_announces_offline_and_leaves_nothing(tiny_model_dir, orchestrator_dht, tmp_path,
                                                                   scaled):
    """``KillMode=mixed``: SIGTERM to the main process only, SIGKILL to the rest of the unit once it has exited."""
    proc, peer = _start_online_server(tiny_model_dir, orchestrator_dht, tmp_path, scaled)
    try:
        unit = psutil.Process(proc.proc.pid).children(recursive=True)  # the rest of the unit's control group
        os.kill(proc.proc.pid, signal.SIGTERM)
        assert proc.proc.wait(timeout=scaled(60)) == 0, proc.log()[-3000:]
        for p in unit:
            try:
                p.kill()
            except psutil.Error:
                pass
        assert orchestrator_dht.fetch_servers(PREFIX)[peer].state == "offline", proc.log()[-3000:]
        assert "DHT process" not in proc.log()  # neither lost nor gone before the offline record
        assert not psutil.wait_procs(unit, timeout=scaled(10))[1]
    finally:
        proc.kill()
