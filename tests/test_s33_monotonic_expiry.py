"""A writer whose clock ran ahead and is then stepped back (NTP) stays in the swarm: the expirations it stores under a
DHT key never go back, so DHT nodes (which keep the entry that expires later) accept its stores."""

from __future__ import annotations

import logging
import re
import time

from petals_chain.swarm.records import ServerRecord

_STEPPED_BACK = "stored to expire just after it"


def _record(peer_id: str, slots_free: int, timestamp: float) -> ServerRecord:
    return ServerRecord(peer_id=peer_id, state="online", memory_bytes=2**30, tau_p=0.01, start_block=0, num_blocks=4,
                        slots_total=64, slots_free=slots_free, public_name="stepped", max_length=256,
                        timestamp=timestamp)


def _stepped_back_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if _STEPPED_BACK in r.getMessage()]


def test_a_live_server_whose_clock_is_stepped_back_stays_listed(monkeypatch, caplog):
    """A server whose clock ran 600 s ahead stored its record to expire 600 s late; stepped back, each republish
    expired earlier than the entry the DHT node held and was refused (publish returned False, readers kept the old
    record, then dropped it one TTL after they first read it): the live server was gone from the plan and
    /api/v1/swarm for about 10 min. Now each republish is stored and read back, and the step is logged once."""
    import petals_chain.swarm.dht as dht_mod

    sd = dht_mod.SwarmDHT.create(prefix="mono")
    try:
        real, skew, ttl = dht_mod.get_dht_time, 600.0, 1.5
        monkeypatch.setattr(dht_mod, "get_dht_time", lambda: real() + skew)  # the writer's clock, 10 min ahead
        assert sd.publish_server("mono", _record(sd.peer_id, 0, time.time() + skew), expiration_s=ttl)
        assert sd.publish_summary("mono", {"n": 0}, ttl)
        monkeypatch.setattr(dht_mod, "get_dht_time", real)  # NTP steps it back
        with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
            deadline, i = time.monotonic() + 2.5 * ttl, 0  # past the first read's TTL: the old record has ended
            while i < 3 or time.monotonic() < deadline:
                i += 1
                assert sd.publish_server("mono", _record(sd.peer_id, i, time.time()), expiration_s=ttl), \
                    f"republish {i} after the clock step was refused by the DHT node"
                assert sd.publish_summary("mono", {"n": i}, ttl), f"summary {i} refused"
                servers = sd.fetch_servers("mono")
                assert sd.peer_id in servers, f"the live server dropped out at republish {i}"
                assert servers[sd.peer_id].slots_free == i  # the new record, not the one stored before the step
                assert sd.fetch_summary("mono", [sd.peer_id]) == {"n": i}
                time.sleep(ttl / 3)
        said = _stepped_back_warnings(caplog)
        assert len(said) == 1, said  # once for the step: not per store, nor per key
        behind = float(re.search(r"clock went back at least ([0-9.]+) s", said[0]).group(1))
        assert skew - 60 <= behind <= skew, said[0]  # (the skew, less the time since the store before the step)
    finally:
        sd.shutdown()


def test_expirations_are_increasing_and_unchanged_with_a_right_clock(caplog):
    """With a right clock a store expires ``now + ttl`` exactly; two stores at the same instant, or a clock stepped
    back, get one just after the last one stored under that key (DHT nodes refuse an equal expiration too)."""
    from petals_chain.swarm.dht import EXPIRATION_STEP_S, StoredExpirations

    book, now = StoredExpirations(), 1_000_000.0
    with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
        assert book.next("k.servers", 15.0, now=now) == now + 15.0
        assert book.next("k.servers", 15.0, now=now + 5) == now + 20.0
        assert book.next("k.servers", 15.0, now=now + 5) == now + 20.0 + EXPIRATION_STEP_S  # same instant
        assert book.next("k.summary", 60.0, now=now + 5) == now + 65.0  # other keys are their own
        assert book.next("k.servers", 15.0, now=now + 5.5) == now + 20.5  # half a second: not a step worth a word
        assert not _stepped_back_warnings(caplog)
        back = book.next("k.servers", 15.0, now=now + 2)  # stepped back 3.5 s
        assert back == now + 20.5 + EXPIRATION_STEP_S
        assert len(_stepped_back_warnings(caplog)) == 1


def test_a_stepped_back_writer_is_read_live_throughout_and_leaves_within_its_skew():
    """The writer's rule and the readers' record lifetimes together, on fake clocks: a server 600 s ahead, republishing
    every 5 s with a 15 s TTL, stepped back at 300 s, is read live at every second (each record lives its TTL,
    expiration - timestamp, from its first read: up to the skew longer while the writer catches up); once caught up
    its expirations are ``now + ttl`` again; a writer that stops while catching up leaves within skew + TTL."""
    from petals_chain.swarm.dht import RecordLifetimes, StoredExpirations

    key, wall, mono, skew, ttl = "k.servers", 1_000_000.0, 50.0, 600.0, 15.0
    writer, reader = StoredExpirations(), RecordLifetimes()
    records: list[tuple[float, float]] = []  # (timestamp, expiration) as stored, in order
    for t in range(0, 1200):
        ahead = skew if t < 300 else 0.0
        if t % 5 == 0:
            stamp = wall + t + ahead
            expiration = writer.next(key, ttl, now=stamp)
            assert not records or expiration > records[-1][1], t  # a DHT node accepts it
            records.append((stamp, expiration))
        stamp, expiration = records[-1]
        assert reader.live("QmS", stamp, expiration, where=key, wall=wall + t, mono=mono + t), t
        assert expiration - stamp <= skew + ttl
    assert records[-1][1] - records[-1][0] == ttl  # caught up: back to the writer's TTL
    # stopped at 400 s, while catching up: its last record, first read then, is live until its expiration only
    stop_writer, stop_reader = StoredExpirations(), RecordLifetimes()
    for t in range(0, 401, 5):
        stamp = wall + t + (skew if t < 300 else 0.0)
        expiration = stop_writer.next(key, ttl, now=stamp)
    live = [t for t in range(400, 400 + 2 * int(skew))
            if stop_reader.live("QmS", stamp, expiration, where=key, wall=wall + t, mono=mono + t)]
    assert live == list(range(400, live[-1] + 1)) and live[-1] - 400 <= skew + ttl


def test_a_server_restarted_once_its_clock_was_set_right_is_listed_at_once(monkeypatch, tmp_path, caplog):
    """The same from a new process: a server whose clock ran 600 s ahead is restarted (same identity) once its clock
    is right, e.g. after a reboot. The orchestrator's DHT node still held its last record, expiring 600 s late, and
    refused every store of the new process: listed with its old record for one TTL, then gone for ~10 min. Now the
    refused store is made again just after the entry held, and the new record is read."""
    import petals_chain.swarm.dht as dht_mod

    identity, real, skew, ttl = str(tmp_path / "server.key"), dht_mod.get_dht_time, 600.0, 30.0
    orch = dht_mod.SwarmDHT.create(prefix="mono")
    try:
        peers = orch.visible_maddrs()
        server = dht_mod.SwarmDHT.create(peers, identity_path=identity, prefix="mono")
        try:
            monkeypatch.setattr(dht_mod, "get_dht_time", lambda: real() + skew)  # ahead
            assert server.publish_server("mono", _record(server.peer_id, 0, time.time() + skew), expiration_s=ttl)
        finally:
            server.shutdown()
        monkeypatch.setattr(dht_mod, "get_dht_time", real)  # set right, and restarted
        assert orch.fetch_servers("mono")[server.peer_id].slots_free == 0  # (the orchestrator holds the old one)
        restarted = dht_mod.SwarmDHT.create(peers, identity_path=identity, prefix="mono")
        try:
            assert restarted.peer_id == server.peer_id
            with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
                for i in (1, 2):
                    assert restarted.publish_server("mono", _record(restarted.peer_id, i, time.time()),
                                                    expiration_s=ttl), f"store {i} of the restarted server refused"
                    assert orch.fetch_servers("mono")[server.peer_id].slots_free == i
            said = _stepped_back_warnings(caplog)
            assert len(said) == 1 and "before this process started" in said[0], said
        finally:
            restarted.shutdown()
    finally:
        orch.shutdown()


# ---------------------------------------------------------------- stores of one key in flight at once

class _Node:
    """One DHT node, as the writer's SwarmDHT sees it: hivemind's own storage (it keeps, per key and subkey, the entry
    that expires later), with each store applied when the test delivers it, so stores arrive in any order."""

    def __init__(self) -> None:
        from hivemind.dht.storage import DHTLocalStorage

        self.storage, self.sent = DHTLocalStorage(), []

    def store(self, key, value, expiration, subkey, return_future):
        import concurrent.futures

        self.sent.append((key, value, expiration, subkey, concurrent.futures.Future()))
        return self.sent[-1][-1]

    def deliver(self, i: int) -> None:
        from hivemind.dht.routing import DHTID

        key, value, expiration, subkey, reply = self.sent[i]
        reply.set_result(self.storage.store(DHTID.generate(source=key), value, expiration, subkey=subkey))

    def get(self, key, latest, return_future):
        import concurrent.futures

        from hivemind.dht.routing import DHTID
        from hivemind.utils import ValueWithExpiration

        reply, held = concurrent.futures.Future(), self.storage.get(DHTID.generate(source=key))
        reply.set_result(None if held is None else ValueWithExpiration(
            {sk: ValueWithExpiration(v, e) for sk, (v, e) in held.value.items()}, held.expiration_time))
        return reply

    def held(self, key: str, subkey: bytes):
        return self.get(key, True, True).result().value[subkey]

    def wait_sent(self, n: int) -> None:
        deadline = time.monotonic() + 30.0
        while len(self.sent) < n:
            assert time.monotonic() < deadline, f"{len(self.sent)} stores sent, waited for {n}"
            time.sleep(0.005)


def _writer(node: _Node):
    """A SwarmDHT on ``node`` (only what its stores use: no DHT process)."""
    import threading
    import weakref

    from petals_chain.swarm.dht import StoredExpirations, SwarmDHT

    sd = object.__new__(SwarmDHT)
    sd.dht, sd.owner_key = node, b"[owner:writer]"
    sd._expirations, sd._in_flight = StoredExpirations(), set()
    sd._pending, sd._pending_lock, sd._exited = weakref.WeakSet(), threading.Lock(), False
    return sd


def test_an_older_store_that_reaches_the_node_last_does_not_overwrite_the_newer_one():
    """Two stores of one key in flight at once (a server's "online" heartbeat, then its "offline" on leaving): the
    node got the newer first and refused the older, as hivemind should. The refused store was then read back, our
    newer entry taken for one left by an earlier process, and the older value stored just after it: the node held
    "online" for a server that had left (publish of the older state returned True). Now the older store is not made
    again (False) and the node keeps the newer state."""
    node = _Node()
    sd = _writer(node)
    older = sd._store("m.servers", {"state": "online"}, 30.0, True)
    newer = sd._store("m.servers", {"state": "offline"}, 30.0, True)
    node.deliver(1)
    node.deliver(0)
    assert newer.result(timeout=30) is True
    deadline = time.monotonic() + 30.0
    while not older.done() and time.monotonic() < deadline:
        if len(node.sent) > 2:  # (the old code stored the older value again: delivered, it was accepted)
            node.deliver(2)
            break
        time.sleep(0.005)
    returned = older.result(timeout=30)
    assert node.held("m.servers", sd.owner_key).value == {"state": "offline"}
    assert returned is False and len(node.sent) == 2  # no store of the older value after the newer


def test_of_two_stores_refused_by_an_earlier_processs_entry_only_the_newer_is_stored_again():
    """A restarted server (its node holds its previous process's entry, expiring 10 min later) publishes twice in a
    row; both are refused. Each was stored again just after the entry held, the older last when its read came back
    last: the node kept the older state. Now only the newer is stored again, and the node holds it."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    node = _Node()
    sd = _writer(node)
    held = get_dht_time() + 600.0
    assert node.storage.store(DHTID.generate(source="m.servers"), {"state": "before restart"}, held,
                              subkey=sd.owner_key)
    older = sd._store("m.servers", {"state": "joining"}, 30.0, True)
    newer = sd._store("m.servers", {"state": "online"}, 30.0, True)
    node.deliver(1)  # refused: the newer is read back and stored again just after the entry held
    node.wait_sent(3)
    node.deliver(0)  # refused too
    deadline = time.monotonic() + 30.0
    while not older.done() and time.monotonic() < deadline:
        if len(node.sent) > 3:  # (the old code stored the older value again, after the newer one)
            break
        time.sleep(0.005)
    for i in range(2, len(node.sent)):
        node.deliver(i)
    assert newer.result(timeout=30) is True
    returned = older.result(timeout=30)
    stored = node.held("m.servers", sd.owner_key)
    assert stored.value == {"state": "online"} and stored.expiration_time > held
    assert returned is False
