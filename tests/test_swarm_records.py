"""SwarmDHT records: signed, schema-checked, owner key bound to the peer id; forged/overwritten records rejected."""

from __future__ import annotations

import logging
import math
import time

import pydantic
import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from petals_chain.swarm.dht import SwarmDHT, peer_id_of_owner, peer_ids_from_maddrs
from petals_chain.swarm.keys import assignment_key, default_dht_prefix, servers_key, summary_key
from petals_chain.swarm.records import MAX_UNKNOWN_FIELDS, AssignmentRecord, ServerRecord

PREFIX = "tiny-model"


@pytest.fixture(scope="module")
def swarm():
    """Three honest-looking nodes: an orchestrator, a server, and a rogue that runs our code."""
    orch = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], prefix=PREFIX)
    server = SwarmDHT.create(initial_peers=orch.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    rogue = SwarmDHT.create(initial_peers=orch.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield orch, server, rogue
    for sd in (rogue, server, orch):
        sd.shutdown()


def _record(peer_id: str, **kw) -> ServerRecord:
    base = dict(peer_id=peer_id, state="online", memory_bytes=10_000_000, tau_p=0.01, start_block=0, num_blocks=2,
                slots_total=5, slots_free=5, public_name="honest", max_length=64)
    base.update(kw)
    return ServerRecord(**base)


def test_keys_and_prefix():
    assert default_dht_prefix("/models/Llama-2-7b-hf/") == "Llama-2-7b-hf"
    assert default_dht_prefix("meta-llama/Llama 2") == "Llama-2"
    assert servers_key("abc") == "abc.servers" and assignment_key("abc") == "abc.assignment"
    assert summary_key("abc") == "abc.summary"
    with pytest.raises(ValueError):
        servers_key("bad prefix!")
    with pytest.raises(ValueError):
        default_dht_prefix("  ")
    assert peer_ids_from_maddrs(["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.5/tcp/5/p2p/QmA", "/ip4/1.1.1.1/tcp/1"]) == [
        "QmA"]


def test_record_models_validate():
    with pytest.raises(pydantic.ValidationError):
        _record("QmX", slots_free=6)  # more free than total
    with pytest.raises(pydantic.ValidationError):
        _record("QmX", state="hacked")
    with pytest.raises(pydantic.ValidationError):
        AssignmentRecord(epoch=1, max_length=64, orchestrator_peer_id="QmO", assignments={"QmA": [0, 0]})
    asg = AssignmentRecord(epoch=3, max_length=64, orchestrator_peer_id="QmO", assignments={"QmA": [2, 3]})
    assert asg.span_of("QmA") == (2, 3) and asg.span_of("QmB") is None
    # a hostile peer's record stays small: a few MB in one field (or in a newer writer's fields) made every lookup
    # of the servers key fail (the reply outgrew hivemind's message limit)
    from types import SimpleNamespace

    from petals_chain.swarm.records import _ServerValueV1

    value = _record("QmX").to_value()
    for bad in ({"device": "x" * 65}, {"version": "v" * 65}, {"future_field": "y" * 5000},
                {"future_field": [[[[[[1]]]]]]}, {f"f{i}": "z" * 300 for i in range(16)}):
        with pytest.raises(pydantic.ValidationError if "device" in bad or "version" in bad else ValueError):
            ServerRecord.from_value({**value, **bad})
        with pytest.raises(Exception):
            _ServerValueV1.parse_obj({**value, **bad})  # refused on store too
    assert ServerRecord.from_value({**value, "future_field": {"a": [1, 2.5, "short"]}}).peer_id == "QmX"
    # nor is one whose timestamp is far from now read as live (hivemind keeps what it is given)
    reader = SimpleNamespace(_reported_invalid=set())
    assert SwarmDHT._read(reader, ServerRecord, value, "QmX", "server record") is not None
    for ts in (time.time() - 7 * 3600, time.time() + 7 * 3600):
        assert SwarmDHT._read(reader, ServerRecord, {**value, "timestamp": ts}, "QmX", "server record") is None
    # nor its free text a log line or a terminal escape (its public_name was logged as sent)
    odd = ServerRecord.from_value({**value, "public_name": "a\nINFO orchestrator: fake\x1b[2J", "load_error": "b\r\x85c"})
    assert odd.public_name == "a INFO orchestrator: fake [2J" and odd.load_error == "b  c"
    # a hostile peer's inf or NaN never reaches the planner (tau_p = inf stopped every plan)
    good = _record("QmX").to_value()
    for field in ("tau_p", "emulate_rtt_ms", "timestamp"):
        for bad in (math.inf, math.nan):
            with pytest.raises(pydantic.ValidationError):
                ServerRecord.from_value({**good, field: bad})


def test_owner_key_derives_peer_id(swarm):
    orch, server, _ = swarm
    assert peer_id_of_owner(orch.owner_key) == orch.peer_id
    assert peer_id_of_owner(server.owner_key) == server.peer_id != orch.peer_id
    assert peer_id_of_owner(b"[owner:not a key]") is None
    assert peer_id_of_owner(b"no marker") is None


def test_publish_fetch_servers_assignment_summary(swarm):
    orch, server, _ = swarm
    assert server.publish_server(PREFIX, _record(server.peer_id), 30)
    got = orch.fetch_servers(PREFIX)
    assert got[server.peer_id].public_name == "honest" and got[server.peer_id].slots_total == 5

    asg = AssignmentRecord(epoch=7, max_length=64, orchestrator_peer_id=orch.peer_id,
                           assignments={server.peer_id: [0, 2]})
    assert orch.publish_assignment(PREFIX, asg, 30)
    assert server.fetch_assignment(PREFIX, trusted=[orch.peer_id]).epoch == 7
    assert server.fetch_assignment(PREFIX, trusted=[server.peer_id]) is None  # nobody trusted published

    summary = {"model": "tiny", "epoch": 7, "servers": [], "chains": [{"id": 0, "capacity": 3}]}
    assert orch.publish_summary(PREFIX, summary, 30)
    assert server.fetch_summary(PREFIX, trusted=[orch.peer_id]) == summary
    assert server.fetch_summary(PREFIX, trusted=["QmSomeoneElse"]) is None


def test_forged_record_claiming_another_peer_is_dropped(swarm):
    orch, server, rogue = swarm
    assert server.publish_server(PREFIX, _record(server.peer_id, public_name="honest"), 30)
    with pytest.raises(ValueError):
        rogue.publish_server(PREFIX, _record(server.peer_id, state="offline"), 30)
    # Bypass the local check: the record is validly signed by the rogue but claims the server's peer id.
    assert rogue._store(servers_key(PREFIX), _record(server.peer_id, public_name="forged").to_value(), 30, False)
    got = orch.fetch_servers(PREFIX)
    assert got[server.peer_id].public_name == "honest"
    assert rogue.peer_id not in got  # its entry claims a peer id it does not own


def test_overwriting_another_owners_record_is_rejected(swarm):
    orch, server, rogue = swarm
    assert server.publish_server(PREFIX, _record(server.peer_id, public_name="honest"), 30)
    forged = _record(server.peer_id, state="offline", public_name="overwritten").to_value()
    # The rogue signs with its own key under the server's subkey: every honest node rejects the store.
    assert not rogue.dht.store(servers_key(PREFIX), forged, get_dht_time() + 60, subkey=server.owner_key)
    # A malformed value under the rogue's own subkey fails the schema check.
    bad = dict(_record(rogue.peer_id).to_value(), tau_p="fast")
    assert not rogue.dht.store(servers_key(PREFIX), bad, get_dht_time() + 60, subkey=rogue.owner_key)
    # An unsigned subkey (no owner key) is refused by the schema: every entry must be signed.
    assert not rogue.dht.store(servers_key(PREFIX), forged, get_dht_time() + 60, subkey=b"QmVictim")
    got = orch.fetch_servers(PREFIX)
    assert got[server.peer_id].public_name == "honest" and got[server.peer_id].state == "online"


def test_rogue_dht_without_validators_cannot_inject(swarm):
    """A peer running plain hivemind (no validators) keeps forged data locally; honest readers reject it."""
    orch, server, _ = swarm
    assert server.publish_server(PREFIX, _record(server.peer_id, public_name="honest"), 30)
    raw = DHT(initial_peers=orch.visible_maddrs(), start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        forged = _record(server.peer_id, state="offline", public_name="raw-forged").to_value()
        raw.store(servers_key(PREFIX), forged, get_dht_time() + 60, subkey=server.owner_key)
        fake_asg = AssignmentRecord(epoch=99, max_length=64, orchestrator_peer_id=orch.peer_id,
                                    assignments={server.peer_id: [1, 1]}).to_value()
        raw.store(assignment_key(PREFIX), fake_asg, get_dht_time() + 60, subkey=orch.owner_key)
        time.sleep(0.2)
        for reader in (orch, server):
            got = reader.fetch_servers(PREFIX)
            assert got[server.peer_id].public_name == "honest"
            asg = reader.fetch_assignment(PREFIX, trusted=[orch.peer_id])
            assert asg is None or asg.epoch != 99
    finally:
        raw.shutdown()


def test_records_of_newer_and_older_versions_are_read(swarm, caplog):
    """A newer writer's unknown fields are ignored (a bounded number), an older writer's missing fields take their
    defaults; the fields every version wrote stay strict, and a record this version cannot read is reported once."""
    orch, server, rogue = swarm
    prefix, key = "compat-model", servers_key("compat-model")  # only this test's records under it
    for node in swarm:
        node.fetch_servers(prefix)  # every node validates the prefix's records from here on
    newer = dict(_record(server.peer_id, public_name="newer").to_value(), version="petals-chain/0.9",
                 gpu_watts=250.0, regions=["eu"])
    assert server._store(key, newer, 30, False)
    got = orch.fetch_servers(prefix)[server.peer_id]
    assert got.public_name == "newer" and got.version == "petals-chain/0.9" and not hasattr(got, "gpu_watts")
    older = {k: v for k, v in _record(server.peer_id, public_name="older").to_value().items()
             if k not in ("models", "serving", "maddrs", "reachability", "prefix_cache", "kv_cache")}
    assert server._store(key, older, 30, False)
    got = orch.fetch_servers(prefix)[server.peer_id]
    assert got.public_name == "older" and got.models == [] and got.reachability == "unknown"
    # strict where it was: too many unknown fields, a missing timestamp or core field, a wrong type
    crowded = dict(_record(rogue.peer_id).to_value(), **{f"x{i}": i for i in range(MAX_UNKNOWN_FIELDS + 1)})
    rejected = [crowded, dict(_record(rogue.peer_id).to_value(), serving=3)]
    rejected += [{k: v for k, v in _record(rogue.peer_id).to_value().items() if k != drop}
                 for drop in ("timestamp", "tau_p", "peer_id")]
    for value in rejected:
        assert not rogue._store(key, value, 30, False), value
    assert rogue.peer_id not in orch.fetch_servers(prefix)
    with pytest.raises(pydantic.ValidationError):  # built in code, a misspelt field is still an error
        _record(server.peer_id, publc_name="typo")
    with pytest.raises(ValueError, match="timestamp"):  # read off the DHT (from a node without validators)
        ServerRecord.from_value({k: v for k, v in older.items() if k != "timestamp"})
    # valid for the DHT, not for this version's reader (more free slots than slots): one warning, then quiet
    odd = dict(_record(rogue.peer_id).to_value(), slots_free=9, version="petals-chain/7.0")
    assert rogue._store(key, odd, 30, False)
    with caplog.at_level("DEBUG", logger="petals_chain.swarm.dht"):
        assert rogue.peer_id not in orch.fetch_servers(prefix)
        assert rogue.peer_id not in orch.fetch_servers(prefix)
    warned = [r.getMessage() for r in caplog.records if rogue.peer_id in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "petals-chain/7.0" in warned[0] and "slots_free" in warned[0], warned


def test_untrusted_assignment_is_ignored(swarm):
    orch, server, rogue = swarm
    assert orch.publish_assignment(PREFIX, AssignmentRecord(
        epoch=8, max_length=64, orchestrator_peer_id=orch.peer_id, assignments={server.peer_id: [0, 2]}), 30)
    # The rogue publishes a higher epoch under its own key, naming itself (the only way its signature verifies).
    assert rogue.publish_assignment(PREFIX, AssignmentRecord(
        epoch=1000, max_length=64, orchestrator_peer_id=rogue.peer_id, assignments={server.peer_id: [3, 1]}), 30)
    assert server.fetch_assignment(PREFIX, trusted=[orch.peer_id]).epoch == 8
    assert server.fetch_assignment(PREFIX, trusted=[rogue.peer_id]).epoch == 1000  # only if you trust the rogue
    # ... or claiming to be the orchestrator (its own owner key, the orchestrator's peer id).
    forged = AssignmentRecord(epoch=1001, max_length=64, orchestrator_peer_id=orch.peer_id,
                              assignments={server.peer_id: [3, 1]})
    assert rogue._store(assignment_key(PREFIX), forged.to_value(), 30, False)
    asg = server.fetch_assignment(PREFIX, trusted=[orch.peer_id])
    assert asg.epoch == 8 and asg.span_of(server.peer_id) == (0, 2)


def test_swarm_directory_names_the_trusted_orchestrators_swarm(swarm):
    """A dashboard given only --initial-peers finds the swarm here; forged or untrusted entries never count."""
    from petals_chain.swarm.keys import DIRECTORY_KEY
    from petals_chain.swarm.records import DirectoryRecord

    orch, server, rogue = swarm
    assert orch.publish_directory(PREFIX, "tiny model", "http://127.0.0.1:8000", 30)
    assert rogue.publish_directory("rogue-swarm", "evil", "http://127.0.0.1:6666", 30)
    # the rogue signs an entry claiming the orchestrator's peer id (its own key, so its signature verifies)
    forged = DirectoryRecord(orchestrator_peer_id=orch.peer_id, dht_prefix="hijacked", model="x").to_value()
    assert rogue._store(DIRECTORY_KEY, forged, 30, False)
    # and cannot write under the orchestrator's subkey, nor store a malformed or unsigned entry
    assert not rogue.dht.store(DIRECTORY_KEY, forged, get_dht_time() + 60, subkey=orch.owner_key)
    assert not rogue.dht.store(DIRECTORY_KEY, dict(forged, dht_prefix=5), get_dht_time() + 60, subkey=rogue.owner_key)
    assert not rogue.dht.store(DIRECTORY_KEY, forged, get_dht_time() + 60, subkey=b"QmVictim")
    entries = server.fetch_directory(trusted=[orch.peer_id])
    assert [(e.orchestrator_peer_id, e.dht_prefix, e.http_url) for e in entries] == [
        (orch.peer_id, PREFIX, "http://127.0.0.1:8000")]
    assert server.fetch_directory(trusted=[rogue.peer_id]) == []  # its (one) entry now claims someone else
    assert rogue.publish_directory("rogue-swarm", "evil", "http://127.0.0.1:6666", 30)
    assert [e.dht_prefix for e in server.fetch_directory(trusted=[rogue.peer_id])] == ["rogue-swarm"]
    assert server.fetch_directory(trusted=[]) == []


def test_the_dht_process_dies_on_sigterm_under_an_asyncio_signal_handler():
    """Roles fork the DHT process after asyncio took SIGTERM: the child must still die on it, or hivemind's
    "terminating it the hard way" does nothing and each slow shutdown waits out a 10 s join."""
    import asyncio
    import os
    import signal

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        try:
            sd = await loop.run_in_executor(None, lambda: SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            try:
                os.kill(sd.dht.pid, signal.SIGTERM)
                for _ in range(50):
                    if not sd.dht.is_alive():
                        return True
                    await asyncio.sleep(0.1)
                return False
            finally:
                sd.shutdown()  # also reaps a p2pd the kill orphaned
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    assert asyncio.run(main())


def test_shutdown_reaps_the_p2pd_of_a_killed_dht_process():
    """A DHT process killed outright (SIGKILL, or hivemind's "hard way" after a slow shutdown) leaves its p2pd
    running until p2pd next writes to the dead pipe; SwarmDHT.shutdown kills it. (Without that, this fails in 3 of
    4 runs here: p2pd is still sleeping.)"""
    import contextlib
    import os
    import signal

    import psutil

    sd = SwarmDHT.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    p2pd = psutil.Process(sd.dht.pid).children(recursive=True)
    try:
        assert p2pd
        os.kill(sd.dht.pid, signal.SIGKILL)
        sd.shutdown()
        for p in p2pd:
            with contextlib.suppress(psutil.NoSuchProcess):
                assert p.status() == psutil.STATUS_ZOMBIE
    finally:
        for p in p2pd:
            with contextlib.suppress(psutil.Error):
                p.kill()
