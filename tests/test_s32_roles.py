"""Roles' lifecycle and model sources, leftovers.

* A corrupt ``--identity-path`` of the orchestrator (or the dashboard) was found only when the DHT node started: the
  orchestrator loaded its model first and exited 1, the dashboard blamed the initial peers. Both now say so in one
  line and exit 2 before loading or starting anything, with the server's own check (now ``swarm.dht``'s).
* The weight digests and GGUF metadata cached per file were keyed by path, size and mtime: a byte changed in place
  with the mtime set back (``os.utime``) kept the old fingerprint. The key now holds the inode and the ctime too.
* ``BlockRunner.release`` with a malformed hash blob raised after marking the session closing: the session was lost
  (never dropped, its pages held until the runner closed). The blob is now checked first.
* systemd's default ``KillMode=control-group`` sends SIGTERM to the role and its DHT process at once: the DHT
  process could die and be reported lost before the role's loop handled its own SIGTERM, and the ordinary stop
  exited 1 (restarted by ``Restart=on-failure``) without draining. A DHT process ended by a stop signal is now
  reported only if its role does not stop within a grace period.
* A DHT request in flight when the DHT process died was awaited for ever: such a stop (or a ``kill -9`` of the DHT
  process) left the server hung in its assignment poll. Pending requests now fail once the process has exited.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time

import psutil
import pytest
import torch

from conftest import ServerProcess
from test_s31_sources import flip_middle_byte, write_tiny_gguf

# ---- --identity-path: one line, exit 2, before anything loads ----


@pytest.fixture
def garbage_key(tmp_path):
    path = tmp_path / "bad.id"
    path.write_bytes(b"garbage, not a key")
    return path


def _one_error_line(err: str, path) -> None:
    assert err.count("\n") == 1 and err.startswith(f"error: --identity-path {path} is not a libp2p RSA identity key")


def test_the_orchestrator_refuses_a_corrupt_identity_file_before_loading_its_model(tiny_model_dir, garbage_key,
                                                                                    monkeypatch, capsys):
    from petals_chain.orchestrator import __main__ as cli

    served = []

    async def serve(*args, **kwargs):  # where the model loads and the DHT node starts
        served.append(args)

    monkeypatch.setattr(cli, "serve", serve)
    assert cli.main(["--model", str(tiny_model_dir), "--port", "0", "--identity-path", str(garbage_key)]) == 2
    _one_error_line(capsys.readouterr().err, garbage_key)
    assert not served and garbage_key.read_bytes() == b"garbage, not a key"


def test_the_server_refuses_a_corrupt_identity_file_before_hashing_its_weights(tiny_model_dir, garbage_key,
                                                                              monkeypatch, capsys):
    from petals_chain.server import __main__ as cli

    hashed = []
    monkeypatch.setattr(cli, "_hash_weights", hashed.append)
    assert cli.main(["--model", str(tiny_model_dir), "--identity-path", str(garbage_key)]) == 2
    _one_error_line(capsys.readouterr().err, garbage_key)
    assert not hashed


def test_the_dashboard_refuses_a_corrupt_identity_file_before_joining(garbage_key, monkeypatch, capsys):
    from petals_chain.dashboard import __main__ as cli

    ran = []
    monkeypatch.setattr(cli, "_run", lambda *args: ran.append(args) or 0)
    assert cli.main(["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--dht-prefix", "x", "--port", "1",
                     "--identity-path", str(garbage_key)]) == 2  # (port 1: no bind is reached)
    _one_error_line(capsys.readouterr().err, garbage_key)
    assert not ran


def test_the_identity_check_is_the_shared_one():
    from petals_chain.server import server
    from petals_chain.swarm import dht

    assert server.check_identity_path is dht.check_identity_path


# ---- fingerprint cache: a byte changed in place, the mtime set back ----

@pytest.fixture
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PETALS_CHAIN_CACHE_DIR", str(tmp_path / "cache"))


def _flip_keeping_mtime(path, start: int, nbytes: int) -> None:
    """Change a byte in place and set the mtime back, as a tool that preserves times does; the ctime moves on (the
    wait is for the filesystem clock's next tick: a ctime equal to the old one would tell nothing apart)."""
    before = os.stat(path)
    flip_middle_byte(path, start, nbytes)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    while os.stat(path).st_ctime_ns == before.st_ctime_ns:
        time.sleep(0.01)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


@pytest.mark.usefixtures("_own_cache")
def test_a_gguf_byte_changed_in_place_with_its_mtime_set_back_changes_the_fingerprint(tmp_path):
    from petals_chain.swarm.sources import GGUFSource

    path = write_tiny_gguf(tmp_path / "a.gguf")
    src = GGUFSource(path, "a")
    before = src.fingerprint
    _, _, start, nbytes = src._table["blk.1.ffn_up.weight"]
    _flip_keeping_mtime(path, start, nbytes)
    assert GGUFSource(path, "a").fingerprint != before


@pytest.mark.usefixtures("_own_cache")
def test_a_safetensors_byte_changed_in_place_with_its_mtime_set_back_changes_the_fingerprint(tiny_model_factory,
                                                                                             tmp_path):
    from petals_chain.swarm.sources import HFSource

    model = tmp_path / "m"
    shutil.copytree(tiny_model_factory("llama", num_layers=2, hidden_size=64), model)
    src = HFSource(model, "m")
    before = src.fingerprint
    name = "model.layers.1.self_attn.q_proj.weight"
    shard = model / src.weight_map[name]
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
    _flip_keeping_mtime(shard, 8 + n + begin, end - begin)
    assert HFSource(model, "m").fingerprint != before


# ---- BlockRunner.release: a malformed hash blob loses nothing ----

def test_a_release_with_a_malformed_hash_blob_is_refused_and_the_session_is_kept(tiny_model_dir):
    from petals_chain.server.runner import BlockRunner
    from petals_chain.swarm.prefix import prefix_hashes

    runner = BlockRunner(tiny_model_dir, 0, 2, num_slots=2, max_length=64, progress=False, batching=False)
    try:
        tokens = list(range(1, 41))
        runner.allocate("a", 0, 2)
        runner.forward("a", torch.randn(1, len(tokens), 64, generator=torch.Generator().manual_seed(0)), 0)
        with pytest.raises(ValueError):
            runner.release("a", b"\x00" * 5)  # not a whole number of hashes
        assert "a" in runner.sessions()
        runner.forward("a", torch.randn(1, 1, 64), len(tokens))  # still usable
        assert runner.release("a", prefix_hashes(tokens))
        stats = runner.cache_stats()
        assert "a" not in runner.sessions() and stats["pages_used"] == 0 and stats["pages_evictable"] > 0
    finally:
        runner.close()


# ---- a stop of the whole service (systemd's KillMode=control-group) ----

def test_a_dht_process_ended_by_a_stop_signal_is_not_lost_when_its_role_stops_meanwhile(scaled, monkeypatch):
    """SIGTERM to the DHT process: its role (here: this test) shuts the node down within the grace period, as a
    role that got the same SIGTERM does: not lost, no callback. Alone (no shutdown), it is lost after the grace."""
    from petals_chain.swarm import dht as dht_module
    from petals_chain.swarm.dht import SwarmDHT, on_dht_lost

    lost: list = []
    on_dht_lost(lost.append)
    nodes = []
    try:
        stopped = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        nodes.append(stopped)
        alone = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        nodes.append(alone)
        monkeypatch.setattr(dht_module, "STOP_SIGNAL_GRACE_S", 3600.0, raising=False)  # the role's stop comes first
        os.kill(stopped.dht.pid, signal.SIGTERM)
        stopped.dht.join(scaled(10))
        stopped.shutdown()
        stopped._watch.join(scaled(10))
        assert not stopped._watch.is_alive() and not stopped.lost and not lost
        monkeypatch.setattr(dht_module, "STOP_SIGNAL_GRACE_S", 0.2, raising=False)  # no stop of its role follows
        os.kill(alone.dht.pid, signal.SIGTERM)
        alone._watch.join(scaled(10))
        assert lost == [alone] and alone.lost
    finally:
        on_dht_lost(None)
        for node in nodes:
            node.shutdown()


def _zombie_or_gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_a_server_stopped_with_its_dht_process_at_once_exits_0(tiny_model_dir, orchestrator_dht, tmp_path, scaled):
    """SIGTERM to the server and every process under it at once, the server not scheduled meanwhile (SIGSTOP: a
    loaded host) so that its DHT process is dead before the server sees its own SIGTERM: an ordinary stop, exit 0,
    the DHT process not reported lost."""
    proc = ServerProcess(["--model", str(tiny_model_dir), "--initial-peers", *orchestrator_dht.visible_maddrs(),
                          "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--dht-prefix", "s32roles", "--memory-bytes",
                          "50000000", "--refresh-s", "2", "--tau-p", "0.01", "--no-progress"], tmp_path / "server.log")
    try:
        proc.wait_peer_id(timeout=scaled(120))
        role = psutil.Process(proc.proc.pid)
        unit = role.children(recursive=True)
        dht_process = [p.parent() for p in unit if p.name() == "p2pd"]  # (not a resource tracker: it ignores SIGTERM)
        assert len(dht_process) == 1, unit
        role.suspend()
        try:
            for p in [role, *unit]:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + scaled(30)
            while not _zombie_or_gone(dht_process):
                assert time.monotonic() < deadline, "the DHT process did not die of SIGTERM"
                time.sleep(0.05)
        finally:
            role.resume()
        assert proc.proc.wait(timeout=scaled(60)) == 0, proc.log()[-3000:]
        assert "DHT process died" not in proc.log()
    finally:
        proc.kill()


def test_a_dht_call_in_flight_when_the_dht_process_dies_fails_instead_of_waiting_for_ever(scaled):
    """A request the DHT process had not answered when it died was awaited for ever: a server stopped by systemd's
    control-group stop (or whose DHT process was killed) hung in its assignment poll and never exited."""
    import asyncio
    import threading

    from petals_chain.swarm.dht import SwarmDHT

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix="s32fly")
    try:
        os.kill(sd.dht.pid, signal.SIGSTOP)  # it reads no request now: the ones below stay unanswered
        blocking: list = []

        def fetch_summary() -> None:  # as the dashboard's poller thread does
            try:
                blocking.append(sd.fetch_summary("s32fly", []))
            except Exception as e:  # noqa: BLE001
                blocking.append(e)

        thread = threading.Thread(target=fetch_summary, daemon=True)  # (on the old code it never returned)
        thread.start()

        async def in_flight():
            fetch = asyncio.ensure_future(sd.afetch_servers("s32fly"))
            await asyncio.sleep(0.2)
            os.kill(sd.dht.pid, signal.SIGKILL)
            return (await asyncio.wait_for(asyncio.gather(fetch, return_exceptions=True), scaled(30)))[0]

        awaited = asyncio.run(in_flight())
        thread.join(scaled(30))
        for result in (awaited, *blocking):
            assert isinstance(result, RuntimeError) and "exited" in str(result), result
        assert blocking
        with pytest.raises(RuntimeError, match="exited"):  # and a request made afterwards
            sd.fetch_servers("s32fly")
        sd._watch.join(scaled(30))  # (else it reports the loss to whatever callback a later test installs)
        assert not sd._watch.is_alive() and sd.lost
    finally:
        sd.shutdown()
