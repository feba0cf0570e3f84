"""DHT regressions found by the reliability campaign.

* Large DHT commands (a swarm summary of hundreds of KiB) must not kill the DHT process: hivemind 1.1.12 reads its
  command pipe non-blocking (uvloop add_reader); a command bigger than one pipe write was read half-written and the
  DHT process died, after which the orchestrator hung (found by scripts/chaos.py).
* A server must find an orchestrator restarted with the same identity and address (its DHT is fresh and empty).
"""

from __future__ import annotations

import json
import time

from petals_chain.swarm.dht import SwarmDHT

from conftest import measure_slowdown


def test_large_summaries_keep_the_dht_alive():
    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="big")
    try:
        summary = {"model": "big", "history": [{"t": time.time() + i, "response_s": 0.123456789, "wait_s": 0.1,
                                                "service_s": 0.2} for i in range(2000)]}
        for i in range(30):
            assert sd.publish_summary("big", {**summary, "n": i}, 30, return_future=True).result(timeout=30)
        assert sd.dht.is_alive()
        assert sd.fetch_summary("big", trusted=[sd.peer_id])["n"] == 29
    finally:
        sd.shutdown()


def test_large_commands_from_several_threads_keep_the_dht_alive():
    """hivemind sends commands without a lock: large ones from several threads interleaved and killed the DHT."""
    import threading

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="big")
    errors: list[str] = []
    summary = {"model": "big", "history": [{"t": float(i), "response_s": 0.123456789} for i in range(3000)]}

    def work() -> None:
        for _ in range(10):
            try:
                # False is fine (a concurrent store with a later expiration won); an exception or a hang is not.
                sd.publish_summary("big", summary, 30, return_future=True).result(timeout=30)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and sd.dht.is_alive()
        assert sd.fetch_summary("big", trusted=[sd.peer_id])["model"] == "big"
    finally:
        sd.shutdown()


_ORCHESTRATOR_DHT = r"""
import json, sys, time
from petals_chain.swarm.dht import SwarmDHT
sd = SwarmDHT.create(host_maddrs=[f"/ip4/127.0.0.1/tcp/{sys.argv[2]}"], identity_path=sys.argv[1], prefix="rj")
print("MADDRS " + json.dumps(sd.visible_maddrs()), flush=True)
while True:
    print("SERVERS " + json.dumps(sorted(r.public_name for r in sd.fetch_servers("rj").values())), flush=True)
    time.sleep(0.3)
"""


class _OrchestratorDHT:
    """A bare orchestrator-like DHT node in its own process group (SIGKILL ends its p2pd too)."""

    def __init__(self, identity: str, port: int):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _ORCHESTRATOR_DHT, identity, str(port)],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        assert line.startswith("MADDRS "), line
        self.maddrs = json.loads(line.split(" ", 1)[1])

    def sees(self, names: list[str], within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("SERVERS ") and json.loads(line.split(" ", 1)[1]) == names:
                return True
        return False

    def kill(self) -> None:
        import signal

        from petals_chain.swarm.local import signal_role

        signal_role(self.proc.pid, signal.SIGKILL)  # its DHT process and p2pd too, at once (a group of their own)
        self.proc.wait(10)


def _record(sd: SwarmDHT, name: str):
    from petals_chain.swarm.records import ServerRecord

    return ServerRecord(peer_id=sd.peer_id, state="online", memory_bytes=1 << 20, tau_p=0.01, device="cpu",
                        dtype="float32", quant="none", start_block=0, num_blocks=1, slots_total=1, slots_free=1,
                        public_name=name, max_length=8, s_m_bytes=1, s_c_bytes=1, emulate_rtt_ms=0.0,
                        emulate_compute_scale=1.0, epoch=0, timestamp=time.time())


def test_rejoin_an_orchestrator_restarted_with_the_same_identity(tmp_path):
    """Root cause of the orchestrator-restart outage: hivemind drops a peer after one failed RPC and never pings its
    initial peers again, while the restarted orchestrator (no initial peers, empty routing table) calls nobody.
    SwarmDHT.arejoin pings the dropped initial peer; afterwards our record reaches the fresh DHT."""
    import asyncio
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    identity = str(tmp_path / "orchestrator.id")
    orch = _OrchestratorDHT(identity, port)
    server = None
    try:
        orch_id = orch.maddrs[0].rsplit("/", 1)[-1]
        server = SwarmDHT.create(initial_peers=orch.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="rj")
        assert server.publish_server("rj", _record(server, "s"), 30)
        assert orch.sees(["s"], 20 * measure_slowdown())
        assert server.rejoin([orch_id]) == []  # in the table: nothing to do (blocking form, as the dashboard uses)
        orch.kill()
        server.publish_server("rj", _record(server, "s"), 30)  # fails to reach it: hivemind drops the peer
        assert asyncio.run(server.arejoin([orch_id], timeout_s=2)) == []  # down: no answer
        orch = _OrchestratorDHT(identity, port)
        assert orch.maddrs[0].endswith(orch_id)
        server.publish_server("rj", _record(server, "s"), 30)
        assert not orch.sees(["s"], 3), "the restarted DHT found us without a rejoin: hivemind changed"
        # The server's announcer calls arejoin every few seconds; the first ping after the restart may still hit
        # libp2p's dial backoff from the failed dials while it was down, so poll as the announcer does.
        deadline = time.monotonic() + 30 * measure_slowdown()
        back: list[str] = []
        while not back and time.monotonic() < deadline:
            back = asyncio.run(server.arejoin([orch_id, "not-a-peer-id"], timeout_s=2))
            if not back:
                time.sleep(1.0)
        assert back == [orch_id]
        assert server.publish_server("rj", _record(server, "s"), 30)
        assert orch.sees(["s"], 20 * measure_slowdown())
    finally:
        orch.kill()
        if server is not None:
            server.shutdown()
