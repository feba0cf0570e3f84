"""Clocks: durations on the monotonic clock, and records timed so that a host whose wall clock is wrong, or steps,
neither lingers nor is ignored for as long as its clock is off."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import pytest

from petals_chain.swarm.records import ServerRecord


# ---------------------------------------------------------------- dashboard: the age of its last DHT read

class _FakeDht:
    def fetch_servers(self, prefix: str) -> dict:
        return {}

    def fetch_summary(self, prefix: str, trusted) -> None:
        return None


def test_the_dashboard_age_of_its_last_read_ignores_clock_steps(monkeypatch):
    """The age of the last successful DHT read was measured on the wall clock: stepped forward 10 min, a dashboard
    reading fine showed 'stale, 600 s old' and /health failed; stepped back, the age was -600 s and a dashboard whose
    reads then failed reported itself healthy for 10 min."""
    from petals_chain.dashboard.source import DhtSwarmSource

    source = DhtSwarmSource(_FakeDht(), "pa", trusted=["QmOrch"])
    source.refresh()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600.0)  # an NTP step forward
    assert "stale_s" not in source.view()
    ok, body = source.health()
    assert ok and 0 <= body["last_dht_read_age_s"] < 60
    monkeypatch.setattr(time, "time", lambda: real() - 600.0)  # and back
    ok, body = source.health()
    assert ok and 0 <= body["last_dht_read_age_s"] < 60
    source._last_ok -= 120  # its reads have failed for two minutes: stale, whatever the wall clock says
    assert not source.health()[0] and source.view()["stale_s"] >= 120


# ---------------------------------------------------------------- DHT records of a writer whose clock is ahead

def test_a_record_lives_its_writers_ttl_after_it_is_first_read(caplog):
    """Unit: the writer's TTL (expiration - timestamp, both its clock) from the first read, never less than with
    right clocks; a writer stamping records in the future is named once, with its skew."""
    from petals_chain.swarm.dht import RecordLifetimes

    book = RecordLifetimes()
    wall, mono = 1_000_000.0, 50.0
    # right clocks: published 3 s ago with a 15 s TTL: live until its expiration and past it only by the read lag
    assert book.live("QmA", wall - 3, wall + 12, wall=wall, mono=mono)
    assert book.live("QmA", wall - 3, wall + 12, wall=wall + 11.9, mono=mono + 11.9)
    with caplog.at_level(logging.WARNING, logger="petals_chain.swarm.dht"):
        # 600 s ahead: alive 15 s from the first read, not 615
        assert book.live("QmB", wall + 600, wall + 615, wall=wall, mono=mono)
        assert book.live("QmB", wall + 600, wall + 615, wall=wall + 14, mono=mono + 14)
        assert not book.live("QmB", wall + 600, wall + 615, wall=wall + 16, mono=mono + 16)
        # its next publish is a new record: live again
        assert book.live("QmB", wall + 620, wall + 635, wall=wall + 20, mono=mono + 20)
    said = [r.getMessage() for r in caplog.records if "QmB" in r.getMessage()]
    assert len(said) == 1 and "at least 600 s ahead" in said[0]
    assert book.live("QmC", None, wall + 10, wall=wall, mono=mono)  # no timestamp: its expiration alone
    assert not book.live("QmC", wall + 10, wall + 5, wall=wall, mono=mono)  # expires before it was stamped
    # bounded: records whose TTL is over are dropped from the book (one publish every 2 s, each living 1 s)
    for i in range(3 * book.PRUNE_AT):
        book.live(f"Qm{i}", wall + 2 * i, wall + 2 * i + 1, wall=wall + 2 * i, mono=mono + 2 * i)
    assert len(book._first_read) <= book.PRUNE_AT + 1


def test_a_dead_server_whose_clock_ran_ahead_leaves_with_its_ttl(monkeypatch):
    """A server whose clock ran 10 min ahead published records expiring 10 min late (hivemind sets the expiration by
    the writer's clock): once it stopped, orchestrators and dashboards listed it for 10 more minutes. Now it is gone
    its TTL after it was first read."""
    import petals_chain.swarm.dht as dht_mod

    sd = dht_mod.SwarmDHT.create(prefix="clk")
    try:
        real = dht_mod.get_dht_time
        skew = 600.0
        monkeypatch.setattr(dht_mod, "get_dht_time", lambda: real() + skew)  # the writer's clock, 10 min ahead
        rec = ServerRecord(peer_id=sd.peer_id, state="online", memory_bytes=2**30, tau_p=0.01, start_block=0,
                           num_blocks=4, slots_total=8, slots_free=5, public_name="ahead", max_length=256,
                           timestamp=time.time() + skew)
        assert sd.publish_server("clk", rec, expiration_s=2.0)
        monkeypatch.setattr(dht_mod, "get_dht_time", real)  # (read with the right clock)
        assert sd.peer_id in sd.fetch_servers("clk")  # live: read at once
        deadline = time.monotonic() + 20.0
        while sd.peer_id in sd.fetch_servers("clk") and time.monotonic() < deadline:
            time.sleep(0.25)
        assert sd.peer_id not in sd.fetch_servers("clk"), "the record of a writer 600 s ahead stayed for 600 s"
    finally:
        sd.shutdown()


# ---------------------------------------------------------------- a server following placements

def test_a_placement_published_after_the_orchestrators_clock_stepped_back_is_followed():
    """The server followed a placement record only if its timestamp was later than the last one's: after the
    orchestrator's clock stepped back 10 min its moves were ignored for 10 min. Its epochs order them now."""
    from petals_chain.server.server import Server

    a, b = (types.SimpleNamespace(prefix=p, hidden_size=64, fingerprint=p) for p in ("model-a", "model-b"))
    records = []

    async def fetch(prefixes, trusted, peer_id):
        return records[-1]

    async def unload():
        pass

    def placement(epoch: int, ts: float, model: str, orch: str = "QmOrch"):
        return types.SimpleNamespace(orchestrator_peer_id=orch, epoch=epoch, timestamp=ts, placement={"me": model})

    async def main():
        s = object.__new__(Server)
        s.hosted, s.active, s.trusted, s._misplaced, s.placement_timestamp, s.switches = [a, b], a, {"QmOrch"}, set(), \
            0.0, 0
        s.state, s.span, s.announcer, s._stop = "online", None, None, asyncio.Event()
        s.epoch, s.assignment_timestamp, s._applied_content = -1, 0.0, ()
        s._failed_load, s._failed_loads, s.load_failure = None, 0, None
        s.service = types.SimpleNamespace(hidden_size=64, model_fingerprint="model-a")
        s.sd = types.SimpleNamespace(peer_id="me", afetch_placement=fetch)
        s._unload = unload
        records.append(placement(3, 1000.0, "model-b"))
        await s.follow_placement()
        assert s.active is b
        records.append(placement(4, 400.0, "model-a"))  # its clock went back 10 min; a new move
        await s.follow_placement()
        assert s.active is a, "a placement stamped before the last one was ignored"
        records.append(placement(4, 300.0, "model-b"))  # not newer: the same epoch, stamped earlier
        await s.follow_placement()
        assert s.active is a
        records.append(placement(9, 200.0, "model-b", orch="QmOther"))  # another orchestrator's older record
        await s.follow_placement()
        assert s.active is a
        return s

    s = asyncio.run(main())
    assert s.active is a and s.switches == 2


# ---------------------------------------------------------------- the orchestrator's uptime

def test_the_orchestrators_uptime_is_not_moved_by_a_clock_step(monkeypatch, tiny_model_factory):
    """``/healthz``'s uptime_s was ``time.time() - started_at``: negative after an NTP step back."""
    from petals_chain.orchestrator.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator(OrchestratorConfig(model=str(tiny_model_factory("llama", num_layers=2)), max_length=64,
                                           port=0))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 600.0)
    assert 0 <= orch.uptime_s < 60
    monkeypatch.setattr(time, "time", lambda: real() + 600.0)
    assert 0 <= orch.uptime_s < 60


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
